//! Clock alignment: the offset that maps each node's BOOTTIME onto the
//! first node's.
//!
//! First from the clocks: each trace's snapshot says BOOTTIME b reads
//! REALTIME r, so a node's time t is the first node's
//! `t + (r_k - b_k) - (r_0 - b_0)`. Wall clocks of machines differ (NTP
//! error, a clock that was set wrong), so the offset is then refined from
//! the job itself: a collective ends at the same instant on every member,
//! so for each node the correction is the centre of (another node's end -
//! its end) over the collectives it shares with the other nodes, every
//! pair of nodes counted. A node sees a collective end when the first of
//! its ranks wakes after it, late by a tail that is heavy on a loaded host;
//! the centre taken is the interquartile mean (the mean of the middle half
//! of the differences), which the tails leave alone and which varied less
//! than the median over repeated runs of the simulated job on a loaded
//! 2-CPU VM (figures in docs/src/measurements/merge.md). A few rounds let nodes that share
//! collectives only with some others settle.
//!
//! Then the job's causality bounds it: no member of an all-reduce (all-
//! gather, reduce-scatter) sees it end before its last member entered, and
//! no receive ends before its send was called, so for nodes k and j and
//! every such operation both record, `o_k - o_j <= end_j - entry_k` (node
//! j's earliest sync end, node k's latest entry, each in its own clock).
//! Over many operations the tightest of these on both sides leave an
//! interval for `o_k - o_j` whose width is about twice the fastest a member
//! saw an operation end after the last entry (the transfer itself and the
//! quickest wake-up); its midpoint is off by half the difference of the
//! two sides' quickest wake-ups, where the centre of the end differences
//! is off by the whole of a one-sided wake-up tail. Each pair's midpoint is
//! weighted by its interval's tightness and the offsets that fit them all
//! best are taken: in a layout where pipeline sends join nodes tightly
//! (0-2, 1-3) and milli-second all-reduces join them loosely (0-1, 2-3),
//! the loose midpoints are what places one tight group against the other.
//! Pairs whose bounds do not meet are left out (operations matched wrongly
//! or not waiting as assumed); a node no pair bounds keeps the estimate
//! above. Send/receive matter twice: pipeline stages are often the only
//! groups that cross nodes (tp and dp inside a node), and a send's and its
//! receive's ends are not one instant, so the end differences alone are
//! off by how much later receives end than sends.
//!
//! Bounds only relate the nodes they join: a group of nodes bounded among
//! themselves but not to the first node keeps the mean position the end
//! differences gave it.

use std::collections::HashMap;

use xpuscope_perfetto::ClockSnapshot;

/// One node's input.
pub struct NodeClock<'a> {
    pub snapshot: Option<ClockSnapshot>,
    /// (communicator hash, seq) -> end time in the node's BOOTTIME.
    pub ends: &'a HashMap<(u64, u64), u64>,
    /// (communicator hash, seq) -> latest entry among the node's ranks, for
    /// operations whose members all wait for each other.
    pub entries: &'a HashMap<(u64, u64), u64>,
}

/// How a node's offset was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// The first node: the merged trace's time base.
    Reference,
    /// REALTIME, refined from shared collectives.
    Collectives,
    /// The midpoint of the interval the collectives' causality leaves.
    Bounds,
    /// REALTIME only (no collectives shared with other nodes).
    Realtime,
    /// Nothing to align with: offset 0.
    None,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Alignment {
    /// Added to the node's timestamps.
    pub offset_ns: i64,
    /// The REALTIME-based offset.
    pub realtime_offset_ns: Option<i64>,
    /// offset - realtime offset: the wall clock's error as the job shows it.
    pub correction_ns: Option<i64>,
    /// Collectives shared with other nodes that the estimate used.
    pub matched_collectives: usize,
    /// After alignment: median and 90th percentile of |end - the other
    /// nodes' median end| over those collectives.
    pub residual_median_ns: Option<u64>,
    pub residual_p90_ns: Option<u64>,
    pub method: Method,
    /// The interval the collectives' causality leaves for the offset
    /// (lower, upper) relative to the first node, through every chain of
    /// bounded pairs that joins the node to it; none when no chain does
    /// or the pairs' intervals contradict each other.
    pub bounds_ns: Option<(i64, i64)>,
}

fn median(v: &mut [i64]) -> Option<i64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        // Midpoint without overflow.
        v[n / 2 - 1] + (v[n / 2] - v[n / 2 - 1]) / 2
    })
}

/// For node k: (the other nodes' median end - node k's end) per shared key.
fn differences(nodes: &[NodeClock<'_>], offsets: &[i64], k: usize) -> Vec<i64> {
    let mut out = Vec::new();
    let mut others = Vec::new();
    for (key, &end) in nodes[k].ends {
        others.clear();
        for (j, n) in nodes.iter().enumerate() {
            if j != k
                && let Some(&e) = n.ends.get(key)
            {
                others.push(e as i64 + offsets[j]);
            }
        }
        if let Some(m) = median(&mut others) {
            out.push(m - (end as i64 + offsets[k]));
        }
    }
    out
}

/// For node k: (another node's end - node k's end) for every other node
/// and shared key.
fn pairwise_differences(nodes: &[NodeClock<'_>], offsets: &[i64], k: usize) -> Vec<i64> {
    let mut out = Vec::new();
    for (key, &end) in nodes[k].ends {
        let own = end as i64 + offsets[k];
        for (j, n) in nodes.iter().enumerate() {
            if j != k
                && let Some(&e) = n.ends.get(key)
            {
                out.push(e as i64 + offsets[j] - own);
            }
        }
    }
    out
}

/// The mean of the middle half of `v` (the interquartile mean): a
/// quarter of the values on either side may be anything (ranks that woke
/// very late) without moving it, and the middle half's mean varies less
/// than its median.
fn interquartile_mean(v: &mut [i64]) -> Option<i64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let q = v.len() / 4;
    let mid = &v[q..v.len() - q];
    let sum: i128 = mid.iter().map(|&x| i128::from(x)).sum();
    // Rounded to the nearest ns: truncating would leave the rounds a
    // nanosecond short of their fixed point.
    let n = mid.len() as i128;
    Some((2 * sum + n).div_euclid(2 * n) as i64)
}

/// For node k, given the others' offsets: the (lowest, highest) offset
/// the collectives' causality allows.
fn bounds(nodes: &[NodeClock<'_>], offsets: &[i64], k: usize) -> (Option<i64>, Option<i64>) {
    let (mut lo, mut hi): (Option<i64>, Option<i64>) = (None, None);
    for (j, n) in nodes.iter().enumerate() {
        if j == k {
            continue;
        }
        // o_k <= end_j + o_j - entry_k
        for (key, &entry_k) in nodes[k].entries {
            if let Some(&end_j) = n.ends.get(key) {
                let b = end_j as i64 + offsets[j] - entry_k as i64;
                hi = Some(hi.map_or(b, |h| h.min(b)));
            }
        }
        // o_k >= entry_j + o_j - end_k
        for (key, &end_k) in nodes[k].ends {
            if let Some(&entry_j) = n.entries.get(key) {
                let b = entry_j as i64 + offsets[j] - end_k as i64;
                lo = Some(lo.map_or(b, |l| l.max(b)));
            }
        }
    }
    (lo, hi)
}

/// What the causality says about `o_k - o_j` from the operations nodes k
/// and j both record: (lowest, highest), when both sides are bounded.
fn pair_interval(nodes: &[NodeClock<'_>], k: usize, j: usize) -> Option<(i64, i64)> {
    // o_k - o_j <= end_j - entry_k
    let hi = nodes[k]
        .entries
        .iter()
        .filter_map(|(key, &entry_k)| Some(*nodes[j].ends.get(key)? as i64 - entry_k as i64))
        .min();
    // o_k - o_j >= entry_j - end_k
    let lo = nodes[k]
        .ends
        .iter()
        .filter_map(|(key, &end_k)| Some(*nodes[j].entries.get(key)? as i64 - end_k as i64))
        .max();
    Some((lo?, hi?))
}

/// Two nodes the causality bounds on both sides: their offsets' difference
/// is most likely the interval's midpoint, give or take its half width.
struct Edge {
    k: usize,
    j: usize,
    /// The interval for `o_k - o_j`.
    lo: i64,
    hi: i64,
    /// Midpoint for `o_k - o_j`.
    mid: f64,
    /// 1 / half width squared: a tight interval outweighs a loose one.
    weight: f64,
}

fn edges(nodes: &[NodeClock<'_>]) -> Vec<Edge> {
    let n = nodes.len();
    let mut out = Vec::new();
    for k in 0..n {
        for j in k + 1..n {
            // An interval that does not meet says the operations matched
            // wrongly or broke the assumption: it bounds nothing.
            if let Some((lo, hi)) = pair_interval(nodes, k, j)
                && lo <= hi
            {
                let half = (hi - lo) as f64 / 2.0;
                out.push(Edge {
                    k,
                    j,
                    lo,
                    hi,
                    mid: lo as f64 + half,
                    weight: 1.0 / (half * half).max(1.0),
                });
            }
        }
    }
    out
}

/// The offsets that fit every pair's midpoint best, each weighted by how
/// tight its interval is (weighted least squares over the graph of
/// bounded pairs, by conjugate gradients). A pair joined only by loose
/// intervals (two nodes that share all-reduces lasting milliseconds)
/// still places one group of tightly joined nodes against another, which
/// taking each node's tightest interval alone would not. Node 0, and in
/// a group of nodes not joined to it the lowest one, stay where they are;
/// such a group is then put back at the mean position `offsets` gave it.
/// Returns which nodes the bounds placed.
fn fit_bounded(offsets: &mut [i64], edges: &[Edge]) -> Vec<bool> {
    let n = offsets.len();
    let mut group: Vec<Option<usize>> = vec![None; n];
    for start in 0..n {
        if group[start].is_some() {
            continue;
        }
        group[start] = Some(start);
        let mut stack = vec![start];
        while let Some(a) = stack.pop() {
            for e in edges {
                let other = if e.k == a {
                    e.j
                } else if e.j == a {
                    e.k
                } else {
                    continue;
                };
                if group[other].is_none() {
                    group[other] = Some(start);
                    stack.push(other);
                }
            }
        }
    }
    let placed: Vec<bool> = (0..n)
        .map(|a| edges.iter().any(|e| e.k == a || e.j == a))
        .collect();
    // Fixed: node 0 and each group's first node (group ids are the first).
    let free: Vec<bool> = (0..n).map(|a| a != 0 && group[a] != Some(a)).collect();
    let start: Vec<f64> = offsets.iter().map(|&o| o as f64).collect();
    let mut x = start.clone();
    // A x = b over the free nodes: A is the weighted graph Laplacian.
    let apply = |v: &[f64]| -> Vec<f64> {
        let mut out = vec![0.0; n];
        for e in edges {
            let d = e.weight * (v[e.k] - v[e.j]);
            if free[e.k] {
                out[e.k] += d;
            }
            if free[e.j] {
                out[e.j] -= d;
            }
        }
        out
    };
    let mut b = vec![0.0; n];
    for e in edges {
        if free[e.k] {
            b[e.k] += e.weight * e.mid;
        }
        if free[e.j] {
            b[e.j] -= e.weight * e.mid;
        }
    }
    let ax = apply(&x);
    let mut r: Vec<f64> = (0..n)
        .map(|a| if free[a] { b[a] - ax[a] } else { 0.0 })
        .collect();
    let mut p = r.clone();
    let mut rr: f64 = r.iter().map(|v| v * v).sum();
    let scale: f64 = b.iter().map(|v| v * v).sum::<f64>().max(1e-30);
    for _ in 0..(4 * n + 50) {
        if rr <= scale * 1e-26 {
            break;
        }
        let ap = apply(&p);
        let pap: f64 = (0..n).map(|a| p[a] * ap[a]).sum();
        if pap <= 0.0 {
            break;
        }
        let alpha = rr / pap;
        for a in 0..n {
            x[a] += alpha * p[a];
            r[a] -= alpha * ap[a];
        }
        let next: f64 = r.iter().map(|v| v * v).sum();
        for a in 0..n {
            p[a] = r[a] + next / rr * p[a];
        }
        rr = next;
    }
    for g in 1..n {
        if group[g] != Some(g) || group[0] == Some(g) {
            continue;
        }
        let members: Vec<usize> = (0..n).filter(|&a| group[a] == Some(g)).collect();
        let drift = members.iter().map(|&a| start[a] - x[a]).sum::<f64>() / members.len() as f64;
        for &a in &members {
            x[a] += drift;
        }
    }
    for a in 1..n {
        if placed[a] {
            offsets[a] = x[a].round() as i64;
        }
    }
    placed
}

/// What the pairs' intervals together allow for each node's offset
/// relative to node 0: `o_k - o_j` in `[lo, hi]` for every bounded pair is
/// a system of difference constraints, whose tightest consequence for
/// `o_a - o_0` is the shortest path over the pairs (Bellman-Ford): the
/// upper end from node 0 to a, the lower end from a back to node 0. A
/// node joined to node 0 only through loose pairs gets the loose
/// interval, however tight its own pairs are: that, not the interval
/// given the others' estimates, is how far off its offset can be. None
/// for a node no chain joins to node 0, and for every node when the
/// intervals contradict each other (a negative cycle: operations matched
/// wrongly or not waiting as assumed).
fn chained_bounds(n: usize, edges: &[Edge]) -> Vec<Option<(i64, i64)>> {
    // Arcs u -> v with weight w mean o_v - o_u <= w.
    let mut arcs: Vec<(usize, usize, i64)> = Vec::with_capacity(2 * edges.len());
    for e in edges {
        arcs.push((e.j, e.k, e.hi));
        arcs.push((e.k, e.j, e.lo.saturating_neg()));
    }
    let shortest = |arcs: &[(usize, usize, i64)]| -> Option<Vec<Option<i64>>> {
        let mut dist: Vec<Option<i64>> = vec![None; n];
        if n > 0 {
            dist[0] = Some(0);
        }
        for round in 0..=n {
            let mut changed = false;
            for &(u, v, w) in arcs {
                if let Some(du) = dist[u] {
                    let d = du.saturating_add(w);
                    if dist[v].is_none_or(|dv| d < dv) {
                        dist[v] = Some(d);
                        changed = true;
                    }
                }
            }
            if !changed {
                return Some(dist);
            }
            if round == n {
                // Still shrinking after n rounds: a negative cycle.
                return None;
            }
        }
        Some(dist)
    };
    let reversed: Vec<(usize, usize, i64)> = arcs.iter().map(|&(u, v, w)| (v, u, w)).collect();
    let (Some(upper), Some(back)) = (shortest(&arcs), shortest(&reversed)) else {
        return vec![None; n];
    };
    (0..n)
        .map(|a| Some((back[a]?.saturating_neg(), upper[a]?)))
        .collect()
}

fn realtime_offset(
    snapshot: Option<ClockSnapshot>,
    reference: Option<ClockSnapshot>,
) -> Option<i64> {
    let (s, r) = (snapshot?, reference?);
    let own = s.realtime_ns as i64 - s.boottime_ns as i64;
    let base = r.realtime_ns as i64 - r.boottime_ns as i64;
    Some(own - base)
}

/// Offsets for every node, the first one fixed at 0.
pub fn align(nodes: &[NodeClock<'_>]) -> Vec<Alignment> {
    let n = nodes.len();
    let reference = nodes.first().and_then(|c| c.snapshot);
    let rt: Vec<Option<i64>> = nodes
        .iter()
        .map(|c| realtime_offset(c.snapshot, reference))
        .collect();
    let mut offsets: Vec<i64> = rt.iter().map(|o| o.unwrap_or(0)).collect();
    if n > 0 {
        offsets[0] = 0;
    }
    for _round in 0..60 {
        let mut moved = 0i64;
        for k in 1..n {
            let c = interquartile_mean(&mut pairwise_differences(nodes, &offsets, k));
            if let Some(c) = c {
                offsets[k] += c;
                moved = moved.max(c.abs());
            }
        }
        if moved < 1 {
            break;
        }
    }
    // The causality bounds: the best fit of every bounded pair's
    // midpoint, then each node moved into its own interval if the fit
    // left it outside (the intervals move with the others' offsets).
    let edges = edges(nodes);
    let placed = fit_bounded(&mut offsets, &edges);
    let chained = chained_bounds(n, &edges);
    for _round in 0..60 {
        let mut moved = 0i64;
        for k in (1..n).filter(|&k| placed[k]) {
            if let (Some(lo), Some(hi)) = bounds(nodes, &offsets, k)
                && lo <= hi
            {
                let inside = offsets[k].clamp(lo, hi);
                moved = moved.max((inside - offsets[k]).abs());
                offsets[k] = inside;
            }
        }
        if moved < 1 {
            break;
        }
    }
    (0..n)
        .map(|k| {
            let mut d = differences(nodes, &offsets, k);
            let matched = d.len();
            let mut abs: Vec<i64> = d.iter_mut().map(|x| x.abs()).collect();
            abs.sort_unstable();
            let pct = |p: f64| -> Option<u64> {
                (!abs.is_empty()).then(|| abs[((abs.len() - 1) as f64 * p).round() as usize] as u64)
            };
            let method = if k == 0 {
                Method::Reference
            } else if placed[k] {
                Method::Bounds
            } else if matched > 0 {
                Method::Collectives
            } else if rt[k].is_some() {
                Method::Realtime
            } else {
                Method::None
            };
            Alignment {
                offset_ns: offsets[k],
                realtime_offset_ns: rt[k],
                correction_ns: rt[k].map(|r| offsets[k] - r),
                matched_collectives: matched,
                residual_median_ns: pct(0.5),
                residual_p90_ns: pct(0.9),
                method,
                bounds_ns: if k > 0 { chained[k] } else { None },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    static NO_ENTRIES: std::sync::LazyLock<HashMap<(u64, u64), u64>> =
        std::sync::LazyLock::new(HashMap::new);

    fn snap(boot: u64, real: u64) -> Option<ClockSnapshot> {
        Some(ClockSnapshot {
            boottime_ns: boot,
            monotonic_ns: boot,
            realtime_ns: real,
        })
    }

    /// A job of `ops` collectives ending every 1 ms; `late` of them end
    /// 5 ms late on a node (a rank leaving late).
    fn ends(shift: i64, late: &[u64]) -> HashMap<(u64, u64), u64> {
        (0..200u64)
            .map(|s| {
                let mut t = 1_000_000_000 + s as i64 * 1_000_000 + shift;
                if late.contains(&s) {
                    t += 5_000_000;
                }
                ((7, s), t as u64)
            })
            .collect()
    }

    #[test]
    fn recovers_a_clock_error_that_realtime_misses() {
        // Node 1's BOOTTIME is 3 s ahead of node 0's (booted earlier), and
        // its wall clock is 40 ms fast: REALTIME says -3.04 s, the job -3 s.
        let a = ends(0, &[]);
        let b = ends(3_000_000_000, &[3, 50, 51, 120]);
        let nodes = [
            NodeClock {
                snapshot: snap(1_000, 10_000_000_000),
                ends: &a,
                entries: &NO_ENTRIES,
            },
            NodeClock {
                snapshot: snap(3_000_001_000, 10_040_000_000),
                ends: &b,
                entries: &NO_ENTRIES,
            },
        ];
        let al = align(&nodes);
        assert_eq!(al[0].offset_ns, 0);
        assert_eq!(al[0].method, Method::Reference);
        assert_eq!(al[1].realtime_offset_ns, Some(-2_960_000_000));
        assert_eq!(al[1].offset_ns, -3_000_000_000);
        assert_eq!(al[1].correction_ns, Some(-40_000_000));
        assert_eq!(al[1].matched_collectives, 200);
        assert_eq!(al[1].residual_median_ns, Some(0));
        assert_eq!(al[1].method, Method::Collectives);
    }

    #[test]
    fn three_nodes_settle_on_the_consensus() {
        let a = ends(0, &[]);
        let b = ends(-7_000, &[1, 2]);
        let c = ends(12_345, &[]);
        let nodes: Vec<NodeClock<'_>> = [&a, &b, &c]
            .into_iter()
            .map(|e| NodeClock {
                snapshot: snap(0, 0),
                ends: e,
                entries: &NO_ENTRIES,
            })
            .collect();
        let al = align(&nodes);
        assert_eq!(
            al.iter().map(|a| a.offset_ns).collect::<Vec<_>>(),
            vec![0, 7_000, -12_345]
        );
    }

    #[test]
    fn late_wakeups_on_either_node_average_out() {
        // Every collective's end is seen late on both nodes by a wake-up
        // of 0-90 us; a few (late leavers) by 5 ms on node 1. Node 1's
        // BOOTTIME reads 0.5 s later.
        let wake = |s: u64, node: u64| {
            ((s ^ (node << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % 90_000
        };
        let ends = |node: u64, shift: u64| -> HashMap<(u64, u64), u64> {
            (0..400u64)
                .map(|s| {
                    let late = if node == 1 && s % 37 == 0 {
                        5_000_000
                    } else {
                        0
                    };
                    (
                        (7, s),
                        1_000_000_000 + s * 1_000_000 + shift + wake(s, node) + late,
                    )
                })
                .collect()
        };
        let (a, b) = (ends(0, 0), ends(1, 500_000_000));
        let nodes = [
            NodeClock {
                snapshot: snap(0, 0),
                ends: &a,
                entries: &NO_ENTRIES,
            },
            NodeClock {
                snapshot: snap(0, 0),
                ends: &b,
                entries: &NO_ENTRIES,
            },
        ];
        let al = align(&nodes);
        let err = al[1].offset_ns + 500_000_000;
        assert!(err.abs() <= 5_000, "off by {err} ns");
    }

    /// Node 1 is loaded: its ranks see every all-reduce end 100-300 us
    /// late, node 0's 5-20 us; the last member to enter is on either node.
    /// The centre of the end differences is off by the tail (~200 us);
    /// the causality bounds' midpoint by half the quickest wake-up.
    #[test]
    fn causality_bounds_undo_one_sided_wakeup_tails() {
        const D: i64 = 500_000_000;
        let rnd = |s: u64, salt: u64, m: u64| {
            ((s ^ (salt << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % m
        };
        let (mut e0, mut e1, mut n0, mut n1) = (
            HashMap::new(),
            HashMap::new(),
            HashMap::new(),
            HashMap::new(),
        );
        for s in 0..400u64 {
            let t = 1_000_000_000 + s * 1_000_000;
            let (a0, a1) = (t + rnd(s, 1, 200_000), t + rnd(s, 2, 200_000));
            let done = a0.max(a1) + 5_000;
            let key = (7, s);
            e0.insert(key, done + 5_000 + rnd(s, 3, 15_000));
            e1.insert(
                key,
                (done + 100_000 + rnd(s, 4, 200_000)) as i64 as u64 + D as u64,
            );
            n0.insert(key, a0);
            n1.insert(key, a1 + D as u64);
        }
        let none = HashMap::new();
        let centre = align(&[
            NodeClock {
                snapshot: snap(0, 0),
                ends: &e0,
                entries: &none,
            },
            NodeClock {
                snapshot: snap(0, 0),
                ends: &e1,
                entries: &none,
            },
        ]);
        let centre_err = centre[1].offset_ns + D;
        assert!(
            centre_err.abs() > 100_000,
            "the centre alone: {centre_err} ns"
        );
        let al = align(&[
            NodeClock {
                snapshot: snap(0, 0),
                ends: &e0,
                entries: &n0,
            },
            NodeClock {
                snapshot: snap(0, 0),
                ends: &e1,
                entries: &n1,
            },
        ]);
        assert_eq!(al[1].method, Method::Bounds);
        let err = al[1].offset_ns + D;
        assert!(
            err.abs() <= 60_000,
            "bounds: off by {err} ns ({:?})",
            al[1].bounds_ns
        );
        let (lo, hi) = al[1].bounds_ns.unwrap();
        assert!(lo <= -D && -D <= hi, "the true offset is inside {lo}..{hi}");
    }

    #[test]
    fn nodes_bounded_only_among_themselves_keep_their_place() {
        // Nodes 1 and 2 share all-reduces (entries and ends); node 0 shares
        // only broadcasts with them (ends, no bounds). Node 2 wakes slowly
        // after the all-reduces, so their midpoint puts node 2 about 47 us
        // early relative to node 1; the pair must still sit where the
        // broadcasts put it, the error split between them.
        let rnd = |s: u64, salt: u64, m: u64| {
            ((s ^ (salt << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % m
        };
        let mut ends = [HashMap::new(), HashMap::new(), HashMap::new()];
        let mut entries = [HashMap::new(), HashMap::new(), HashMap::new()];
        for s in 0..200u64 {
            let t = 1_000_000_000 + s * 1_000_000;
            for (k, e) in ends.iter_mut().enumerate() {
                e.insert((8, s), t + rnd(s, 10 + k as u64, 2_000));
            }
            let (a1, a2) = (t + 500_000, t + 500_000 + rnd(s, 1, 100_000));
            let done = a1.max(a2) + 5_000;
            entries[1].insert((7, s), a1);
            entries[2].insert((7, s), a2);
            ends[1].insert((7, s), done + 5_000 + rnd(s, 3, 5_000));
            ends[2].insert((7, s), done + 100_000 + rnd(s, 4, 5_000));
        }
        let nodes: Vec<NodeClock<'_>> = (0..3)
            .map(|k| NodeClock {
                snapshot: snap(0, 0),
                ends: &ends[k],
                entries: &entries[k],
            })
            .collect();
        let al = align(&nodes);
        assert_eq!(al[1].method, Method::Bounds);
        assert_eq!(al[2].method, Method::Bounds);
        let (o1, o2) = (al[1].offset_ns, al[2].offset_ns);
        assert!((o1 + o2).abs() <= 4_000, "the pair's mean: {o1} {o2}");
        assert!(
            (30_000..=60_000).contains(&(o1 - o2)),
            "the bounds' midpoint inside the pair: {o1} {o2}"
        );
        // Bounded among themselves, by no chain to node 0: how far off
        // the pair is from node 0 is not something the causality says.
        assert_eq!(al[1].bounds_ns, None);
        assert_eq!(al[2].bounds_ns, None);
    }

    #[test]
    fn loose_intervals_place_tightly_joined_groups() {
        // The 16-rank layout over 4 nodes: pipeline sends join 0-2 and 1-3
        // tightly (a receive ends 240 us after its send), all-reduces of 7.7
        // ms join 0-1 and 2-3 loosely. Nodes 1 and 3 mostly wake late after
        // an all-reduce, which pulls the end differences' centre ~100 us
        // off; only the loose intervals' midpoints place the pair 1-3.
        let rnd = |s: u64, salt: u64, m: u64| {
            ((s ^ (salt << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % m
        };
        let wake = |s: u64, node: u64| -> u64 {
            let slow = node % 2 == 1 && rnd(s, 50 + node, 1000) >= 300;
            5_000
                + rnd(s, 60 + node, 10_000)
                + if slow {
                    100_000 + rnd(s, 70 + node, 300_000)
                } else {
                    0
                }
        };
        let mut ends: [HashMap<(u64, u64), u64>; 4] = Default::default();
        let mut entries: [HashMap<(u64, u64), u64>; 4] = Default::default();
        for s in 0..100u64 {
            let t = 1_000_000_000 + s * 20_000_000;
            for (a, b, comm) in [(0usize, 1usize, 1u64), (2, 3, 3)] {
                let (ea, eb) = (t + rnd(s, comm, 200_000), t + rnd(s, comm + 10, 200_000));
                let done = ea.max(eb) + 7_700_000;
                entries[a].insert((comm, s), ea);
                entries[b].insert((comm, s), eb);
                ends[a].insert((comm, s), done + wake(s, a as u64));
                ends[b].insert((comm, s), done + wake(s, b as u64));
            }
            for (from, to, comm) in [(0usize, 2usize, 20u64), (2, 0, 21), (1, 3, 30), (3, 1, 31)] {
                let sent = t + 9_000_000 + rnd(s, comm, 500_000);
                entries[from].insert((comm, s), sent);
                ends[from].insert((comm, s), sent + 20_000);
                ends[to].insert((comm, s), sent + 240_000 + rnd(s, comm + 5, 30_000));
            }
        }
        let nodes: Vec<NodeClock<'_>> = (0..4)
            .map(|k| NodeClock {
                snapshot: snap(0, 0),
                ends: &ends[k],
                entries: &entries[k],
            })
            .collect();
        let al = align(&nodes);
        for (k, a) in al.iter().enumerate().skip(1) {
            assert_eq!(a.method, Method::Bounds, "node {k}");
            assert!(a.offset_ns.abs() <= 20_000, "node {k}: {a:?}");
            let (lo, hi) = a.bounds_ns.expect("chained to node 0");
            assert!(lo <= 0 && 0 <= hi, "node {k}: the truth inside {lo}..{hi}");
        }
        // Node 2 hangs on node 0 by tight sends; nodes 1 and 3 only through
        // a 7.7 ms all-reduce, whatever their own sends: the bounds say so.
        let half = |k: usize| {
            let (lo, hi) = al[k].bounds_ns.unwrap();
            (hi - lo) / 2
        };
        assert!(half(2) < 300_000, "node 2: {:?}", al[2].bounds_ns);
        for k in [1, 3] {
            assert!(half(k) > 7_000_000, "node {k}: {:?}", al[k].bounds_ns);
        }
    }

    #[test]
    fn interquartile_mean_of_a_few_values() {
        assert_eq!(interquartile_mean(&mut []), None);
        assert_eq!(interquartile_mean(&mut [5]), Some(5));
        assert_eq!(
            interquartile_mean(&mut [100, 1, 2, 3, -90, 4, 5, 6]),
            Some(4)
        );
        assert_eq!(
            interquartile_mean(&mut [i64::MAX, i64::MAX]),
            Some(i64::MAX)
        );
    }

    #[test]
    fn without_shared_collectives_realtime_decides() {
        let none = HashMap::new();
        let nodes = [
            NodeClock {
                snapshot: snap(100, 1_000),
                ends: &none,
                entries: &NO_ENTRIES,
            },
            NodeClock {
                snapshot: snap(50, 1_100),
                ends: &none,
                entries: &NO_ENTRIES,
            },
            NodeClock {
                snapshot: None,
                ends: &none,
                entries: &NO_ENTRIES,
            },
        ];
        let al = align(&nodes);
        assert_eq!(al[1].offset_ns, 150);
        assert_eq!(al[1].method, Method::Realtime);
        assert_eq!(al[2].offset_ns, 0);
        assert_eq!(al[2].method, Method::None);
        assert_eq!(al[1].residual_median_ns, None);
    }
}
