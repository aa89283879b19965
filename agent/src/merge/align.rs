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
//! 2-CPU VM (figures in the README). A few rounds let nodes that share
//! collectives only with some others settle.

use std::collections::HashMap;

use xpuscope_perfetto::ClockSnapshot;

/// One node's input.
pub struct NodeClock<'a> {
    pub snapshot: Option<ClockSnapshot>,
    /// (communicator hash, seq) -> end time in the node's BOOTTIME.
    pub ends: &'a HashMap<(u64, u64), u64>,
}

/// How a node's offset was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// The first node: the merged trace's time base.
    Reference,
    /// REALTIME, refined from shared collectives.
    Collectives,
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
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
            },
            NodeClock {
                snapshot: snap(3_000_001_000, 10_040_000_000),
                ends: &b,
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
            },
            NodeClock {
                snapshot: snap(0, 0),
                ends: &b,
            },
        ];
        let al = align(&nodes);
        let err = al[1].offset_ns + 500_000_000;
        assert!(err.abs() <= 5_000, "off by {err} ns");
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
            },
            NodeClock {
                snapshot: snap(50, 1_100),
                ends: &none,
            },
            NodeClock {
                snapshot: None,
                ends: &none,
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
