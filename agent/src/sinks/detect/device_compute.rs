//! `slow_rank` from the device side: a rank whose compute kernels take
//! `slow_compute_pct` percent or more of its peers' for `slow_rank_persist`
//! steps in a row.
//!
//! A rank whose device computes slower (a throttled or failing GPU, a
//! smaller clock) does not arrive late at its collectives: NCCL and HCCL
//! enqueue and return, every member enters on time, and every member then
//! waits in the same stream sync for the collective the slow device joins
//! last. The host sees nothing; the device activity records do (`agent
//! attach --probe-level 2`, the service's level 3): the slow rank's
//! compute kernels are longer, and its peers' collective kernels wait.
//!
//! - Peers: the members of the rank's anchor communicator (the first one
//!   it all-reduces on: data-parallel peers, who run the same kernels on
//!   other data).
//! - Steps: a kernel counts in the step whose window (from one anchor
//!   all-reduce's start to the next) holds its end. With async enqueue a
//!   step's last kernels can end after the host entered its all-reduce, so
//!   a window holds the tail of one step and most of the next; the same on
//!   every member, so they stay comparable. Where the job marks its steps
//!   (`step_marks`), a step is named by the marked step its closing
//!   all-reduce fell in (the job's own number).
//! - A step is judged once every member's anchor all-reduces and kernels
//!   (activity records come in buffers, later than calls) are past the
//!   window after it. A member is slow at a step when its compute is at
//!   least `slow_compute_pct` of the median of the others' and at least
//!   [`MIN_EXCESS_NS`] more.
//! - Only compute kernels count (`WorkKind::Compute`): a collective's
//!   kernel time is mostly waiting, longest on the fast ranks.

use foldhash::{HashMap, HashMapExt};
use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde_json::json;
use xpuscope_probes::catalog::{CallKind, Collective};

use super::Ranks;
use super::step_marks::StepSource;
use crate::model::finding::comm_name;
use crate::model::{
    CommKey, DeviceCallRecord, DeviceWork, Finding, FindingKind, WorkKind, comm_key,
};

/// A slow step needs at least this much more compute than the peers'
/// median (a 150% of 100 us is noise, not a slow device).
pub const MIN_EXCESS_NS: u64 = 500_000;
/// Anchor starts kept per rank beyond the next step to judge.
const MAX_ANCHORS: usize = 4096;
/// Steps of compute kept per rank while its peers lag (a peer without
/// activity records never lets a step be judged).
const MAX_OPEN_STEPS: usize = 256;

#[derive(Default)]
struct RankCompute {
    tgid: u32,
    /// Its global rank (kept: a peer may judge it after it exited).
    rank: Option<u32>,
    anchor: Option<CommKey>,
    /// Start times of the anchor all-reduces from step `base` on.
    anchors: Vec<u64>,
    /// The step the job's markers were in at each anchor (parallel to
    /// `anchors`), where it marks its steps.
    marked: Vec<Option<u64>>,
    /// What numbered the marked steps (markers or the Python step counter).
    marked_source: StepSource,
    base: u64,
    /// Compute ns per step.
    per_step: BTreeMap<u64, u64>,
    /// The latest end of any of its compute kernels.
    latest_end: u64,
    /// Consecutive slow steps: (step, its compute, the peers' median).
    run: Vec<(u64, u64, u64)>,
    reported: bool,
    /// The process exited: everything it will send is in.
    ended: bool,
}

impl RankCompute {
    /// The step whose window holds time `t` (anchor n closes step n).
    fn step_at(&self, t: u64) -> u64 {
        self.base + self.anchors.partition_point(|&a| a < t) as u64
    }

    /// Anchor all-reduces seen so far (steps closed).
    fn closed(&self) -> u64 {
        self.base + self.anchors.len() as u64
    }

    /// The job's own number of `step` (the marked step its closing anchor
    /// fell in), where the job marks its steps.
    fn marked_step(&self, step: u64) -> Option<u64> {
        step.checked_sub(self.base)
            .and_then(|i| self.marked.get(i as usize).copied().flatten())
    }

    fn anchor_start(&self, step: u64) -> Option<u64> {
        step.checked_sub(self.base)
            .and_then(|i| self.anchors.get(i as usize).copied())
    }

    /// Everything of `step` is in: the window after it closed, and its
    /// kernels (which come late) reached past that window's start, or the
    /// process ended.
    fn complete(&self, step: u64) -> bool {
        self.closed() > step + 1
            && (self.ended
                || self
                    .anchor_start(step + 1)
                    .is_some_and(|a| self.latest_end > a))
    }
}

/// The peers of one anchor communicator.
#[derive(Default)]
struct Group {
    /// Live members (their state is in `ranks`).
    live: BTreeSet<u32>,
    /// Members that exited, kept until the group ends: the activity records
    /// of a stream come in batches, the last at the process's exit, so a
    /// member's last steps are judged against peers that end later.
    ended: Vec<RankCompute>,
    /// The next step to judge.
    next: u64,
}

pub struct DeviceComputeDetector {
    pct: u32,
    persist: u32,
    ranks: HashMap<u32, RankCompute>,
    groups: HashMap<CommKey, Group>,
}

impl DeviceComputeDetector {
    pub fn new(pct: u32, persist: u32) -> Self {
        Self {
            pct,
            persist: persist.max(1),
            ranks: HashMap::new(),
            groups: HashMap::new(),
        }
    }

    pub fn device_call(
        &mut self,
        c: &DeviceCallRecord,
        ranks: &Ranks,
        slow: &mut HashSet<u32>,
        out: &mut Vec<Finding>,
    ) {
        let call = &c.call;
        if call.kind != CallKind::Collective(Collective::AllReduce) {
            return;
        }
        let Some(key) = call.comm.as_ref().and_then(|cc| comm_key(call.library, cc)) else {
            return;
        };
        let r = self.ranks.entry(call.tgid).or_insert_with(|| RankCompute {
            tgid: call.tgid,
            ..Default::default()
        });
        r.rank = r.rank.or(ranks.of(call.tgid));
        if *r.anchor.get_or_insert(key) != key {
            return;
        }
        r.anchors.push(call.start_ts);
        // Its return: the rank is in the all-reduce's step then, by a
        // marker (which encloses the call) or its Python step counter.
        r.marked.push(ranks.marked_step(call.tgid, c.end_ts()));
        if let Some(source) = ranks.marks.source(call.tgid) {
            r.marked_source = source;
        }
        if r.anchors.len() > MAX_ANCHORS {
            r.anchors.drain(..MAX_ANCHORS / 2);
            r.marked.drain(..MAX_ANCHORS / 2);
            r.base += (MAX_ANCHORS / 2) as u64;
        }
        self.groups.entry(key).or_default().live.insert(call.tgid);
        self.judge(key, slow, out);
    }

    pub fn device_work(&mut self, w: &DeviceWork, slow: &mut HashSet<u32>, out: &mut Vec<Finding>) {
        if w.kind != WorkKind::Compute {
            return;
        }
        let Some(r) = self.ranks.get_mut(&w.track.tgid) else {
            return; // no anchor yet: start-up, not a step
        };
        let step = r.step_at(w.end);
        *r.per_step.entry(step).or_default() += w.end.saturating_sub(w.start);
        while r.per_step.len() > MAX_OPEN_STEPS {
            r.per_step.pop_first();
        }
        r.latest_end = r.latest_end.max(w.end);
        if let Some(key) = r.anchor {
            self.judge(key, slow, out);
        }
    }

    /// Judges the group's steps whose evidence is complete on every member.
    /// `slow`: processes already named slow ranks (from their arrivals:
    /// one finding per rank).
    fn judge(&mut self, key: CommKey, slow: &mut HashSet<u32>, out: &mut Vec<Finding>) {
        let Self {
            pct,
            persist,
            ranks,
            groups,
        } = self;
        let Some(g) = groups.get_mut(&key) else {
            return;
        };
        let mut members: Vec<&mut RankCompute> = ranks
            .iter_mut()
            .filter(|(t, _)| g.live.contains(t))
            .map(|(_, r)| r)
            .chain(g.ended.iter_mut())
            .collect();
        if members.len() < 2 {
            return;
        }
        loop {
            let step = g.next;
            if !members.iter().all(|r| r.complete(step)) {
                return;
            }
            let compute: Vec<u64> = members
                .iter()
                .map(|r| r.per_step.get(&step).copied().unwrap_or(0))
                .collect();
            for (i, r) in members.iter_mut().enumerate() {
                let c = compute[i];
                let mut others: Vec<u64> = compute
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, c)| *c)
                    .collect();
                let median = median(&mut others);
                let is_slow = median > 0
                    && c.saturating_mul(100) >= median.saturating_mul(u64::from(*pct))
                    && c >= median + MIN_EXCESS_NS;
                if !is_slow {
                    r.run.clear();
                    continue;
                }
                r.run.push((step, c, median));
                if r.run.len() >= *persist as usize && !r.reported {
                    r.reported = true;
                    if !slow.insert(r.tgid) {
                        continue;
                    }
                    // From the window's start (the anchor before it).
                    let start = r
                        .anchor_start(r.run[0].0.saturating_sub(1))
                        .unwrap_or_else(|| r.anchors.first().copied().unwrap_or(0));
                    let mut f = finding(r, key, start, *pct);
                    f.detected_ns = r.latest_end;
                    out.push(f);
                }
            }
            // Anchors older than a slow run's start are no longer needed.
            let keep_from = step.saturating_sub(u64::from(*persist) + 1);
            for r in members.iter_mut() {
                r.per_step.remove(&step);
                let drop = (keep_from.saturating_sub(r.base) as usize).min(r.anchors.len());
                r.anchors.drain(..drop);
                r.marked.drain(..drop.min(r.marked.len()));
                r.base += drop as u64;
            }
            g.next = step + 1;
        }
    }

    /// The process's state moves to its group until the group ends (its
    /// pid may come back as another process meanwhile).
    pub fn process_ended(&mut self, tgid: u32, slow: &mut HashSet<u32>, out: &mut Vec<Finding>) {
        let Some(mut r) = self.ranks.remove(&tgid) else {
            return;
        };
        let Some(key) = r.anchor else { return };
        let Some(g) = self.groups.get_mut(&key) else {
            return;
        };
        g.live.remove(&tgid);
        r.ended = true;
        // Named slow from its arrivals: the set forgets it with the process.
        r.reported |= slow.contains(&tgid);
        g.ended.push(r);
        self.judge(key, slow, out);
        if self.groups.get(&key).is_some_and(|g| g.live.is_empty()) {
            self.groups.remove(&key);
        }
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.ranks.contains_key(&tgid) && self.groups.values().all(|g| !g.live.contains(&tgid))
    }
}

fn median(v: &mut [u64]) -> u64 {
    if v.is_empty() {
        return 0;
    }
    super::collective::median_u64(v)
}

fn ms(ns: u64) -> f64 {
    (ns as f64 / 1e4).round() / 100.0
}

fn finding(r: &RankCompute, key: CommKey, start: u64, pct: u32) -> Finding {
    let run = &r.run;
    let who = match r.rank {
        Some(rank) => format!("rank {rank}"),
        None => format!("pid {}", r.tgid),
    };
    let cname = comm_name(key.0.name(), key.1);
    let ratios: Vec<f64> = run
        .iter()
        .map(|(_, c, m)| (*c as f64 / *m as f64 * 100.0).round() / 100.0)
        .collect();
    let mut sorted = ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let median_ratio = sorted[sorted.len() / 2];
    let (first, c, m) = run[0];
    let marked = r.marked_step(first);
    let first_step = marked.unwrap_or(first);
    let source = if marked.is_some() {
        r.marked_source
    } else {
        StepSource::AllReduces
    };
    Finding {
        link: Default::default(),
        kind: FindingKind::SlowRank,
        ranks: r.rank.into_iter().collect(),
        comm: Some(cname.clone()),
        seq: None,
        step: Some(first_step),
        start_ns: start,
        end_ns: None,
        summary: format!(
            "{who} is a slow rank on the device: its compute kernels took {median_ratio:.1}x \
             its peers' on {cname} for {} steps in a row from step {first_step} ({:.2} ms \
             against {:.2} ms at the first, threshold {pct}%): every collective waits for \
             its device, and its peers idle in their stream syncs",
            run.len(),
            ms(c),
            ms(m),
        ),
        evidence: json!({
            "source": "device activity (compute kernels per step)",
            "step_source": source.describe(),
            "steps": run
                .iter()
                .map(|(s, _, _)| r.marked_step(*s).unwrap_or(*s))
                .collect::<Vec<_>>(),
            "compute_ms": run.iter().map(|(_, c, _)| ms(*c)).collect::<Vec<_>>(),
            "peers_median_ms": run.iter().map(|(_, _, m)| ms(*m)).collect::<Vec<_>>(),
            "ratio": ratios,
            "threshold_pct": pct,
        }),
        detected_ns: start,
    }
}
