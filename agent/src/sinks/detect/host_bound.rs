//! `host_bound`: a rank whose steps turned host-bound while its peers'
//! did not: its training (main) thread busy on its CPU in its own code
//! (Python, the framework's dispatch, launches) for most of its steps,
//! where it used to wait for its device and where its peers still do.
//! The device and the peers wait for that host work; the rank arrives
//! last at the job's collectives.
//!
//! Each step of a rank (a window of the step clock, `host_steps`) is split
//! by where its main thread was:
//! - in device calls (syncs, collectives, copies): waiting for the device
//!   or the peers, on CPU or not;
//! - off CPU outside them, runnable: kept off its CPU by other tasks
//!   (`host_contention`'s business);
//! - off CPU outside them, asleep: the data loader, sleeps, locks
//!   (`dataloader_stall`'s, or a delay's);
//! - on CPU outside them: the host's own work, the step's *host* part.
//!
//! A step whose host part dominates is host-bound, one whose time in
//! device calls dominates is device-bound. A job's ranks share a shape,
//! so a rank is judged against the larger of its own recent host share
//! (the median of its last [`BASELINE_STEPS`] steps outside a run, once it
//! has [`BASELINE_MIN_STEPS`]) and its peers' (the lower median of the
//! job's other ranks' latest steps): a step is host-bound for the rank
//! when its host share is at least [`MIN_SHARE`], [`MIN_RISE`] above that
//! reference, and [`MIN_HOST_NS`] more host time than the reference share
//! of the step. It fires when [`MIN_STEPS`] such steps come in a row
//! (one step under the bar in between is allowed, two end the run); once
//! per run, naming the run's first step. A job whose ranks all turned
//! host-bound together is not a rank's fault and not reported; a rank
//! host-bound from its first step has no baseline to turn from and is not
//! either (its peers' waits show it as `slow_rank`).

use foldhash::HashMap;
use std::collections::VecDeque;

use serde_json::json;

use super::Ranks;
use super::host_steps::Window;
use super::run_spans::{ReportedAs, RunSpans};
use crate::analysis::steps::{overlap, total, union};
use crate::model::{Finding, FindingKind, StepSplit};

/// Steps a rank's own baseline is the median of.
const BASELINE_STEPS: usize = 16;
/// Steps of history before a rank is judged.
const BASELINE_MIN_STEPS: usize = 3;
/// A host-bound step's host part: at least this share of the step...
pub const MIN_SHARE: f64 = 0.5;
/// ...this much above the rank's usual share and its peers'...
pub const MIN_RISE: f64 = 0.25;
/// ...and this much more host time than the usual share of the step.
pub const MIN_HOST_NS: u64 = 10_000_000;
/// Host-bound steps in a row before a finding.
pub const MIN_STEPS: u64 = 3;

/// The split of one step. Calls on the main thread run one at a time,
/// but a library's call can wrap another's (a collective launching
/// through the runtime): their union counts once.
pub fn split(w: &Window) -> StepSplit {
    let (lo, hi) = (w.start, w.end.max(w.start));
    let calls = union(
        w.calls
            .iter()
            .map(|c| (c.start.max(lo), c.end.min(hi)))
            .filter(|(s, e)| s < e)
            .collect(),
    );
    let in_device_calls = total(&calls);
    let (mut runnable, mut asleep) = (0, 0);
    // Off-CPU intervals are disjoint (one thread); each counted outside
    // the device calls only.
    for i in &w.off_cpu {
        let (s, e) = (i.start.max(lo), i.end.min(hi));
        if s >= e {
            continue;
        }
        let outside = (e - s) - overlap(&calls, &[(s, e)]);
        if i.asleep {
            asleep += outside;
        } else {
            runnable += outside;
        }
    }
    let dur = hi - lo;
    StepSplit {
        dur,
        in_device_calls,
        runnable,
        asleep,
        host: dur.saturating_sub(in_device_calls + runnable + asleep),
    }
}

#[derive(Default)]
struct Run {
    first_step: u64,
    start: u64,
    end: u64,
    steps: u64,
    /// Sums over the run's host-bound steps.
    total: StepSplit,
    /// The reference when the run began: (its own, its peers').
    usual: (f64, f64),
    /// Steps under the bar since the last host-bound one.
    clean: u32,
    reported: bool,
    /// The finding it fired: it follows the run on ([`RunSpans`]).
    reported_as: Option<ReportedAs>,
    /// Kernel launches of its steps, while every step had a count.
    launches: Option<u64>,
    /// The rank's usual launches per step when the run began.
    usual_launches: Option<u64>,
}

#[derive(Default)]
struct RankShares {
    /// Host shares of its recent steps outside runs.
    baseline: VecDeque<f64>,
    /// Kernel launches of those steps that had a count.
    baseline_launches: VecDeque<u64>,
    latest: Option<f64>,
}

#[derive(Default)]
pub struct HostBoundDetector {
    ranks: HashMap<u32, RankShares>,
    runs: HashMap<u32, Run>,
    /// Where the reported runs got to.
    spans: RunSpans,
}

fn lower_median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable_by(f64::total_cmp);
    Some(v[(v.len() - 1) / 2])
}

impl HostBoundDetector {
    pub fn forget(&mut self, tgid: u32) {
        self.ranks.remove(&tgid);
        self.runs.remove(&tgid);
    }

    /// The rank's own usual host share, once it has one.
    fn own(&self, tgid: u32) -> Option<f64> {
        let r = self.ranks.get(&tgid)?;
        (r.baseline.len() >= BASELINE_MIN_STEPS)
            .then(|| lower_median(r.baseline.iter().copied().collect()))
            .flatten()
    }

    /// The job's other ranks' latest host shares, their lower median.
    fn peers(&self, tgid: u32, ranks: &Ranks) -> Option<f64> {
        let job = ranks.job_of(tgid);
        lower_median(
            self.ranks
                .iter()
                .filter(|(t, _)| **t != tgid && ranks.of(**t).is_some() && ranks.job_of(**t) == job)
                .filter_map(|(_, r)| r.latest)
                .collect(),
        )
    }

    /// Rank `w`'s step ended, split as `s` ([`split`]).
    pub fn step_ended(&mut self, w: &Window, s: &StepSplit, ranks: &Ranks, out: &mut Vec<Finding>) {
        if ranks.of(w.tgid).is_none() || w.dur() == 0 {
            return;
        }
        let share = s.host_share();
        let own = self.own(w.tgid);
        let peers = self.peers(w.tgid, ranks).unwrap_or(0.0);
        let bound = own.is_some_and(|own| {
            let reference = own.max(peers);
            share >= MIN_SHARE
                && share - reference >= MIN_RISE
                && s.host.saturating_sub((reference * s.dur as f64) as u64) >= MIN_HOST_NS
        });
        let in_run = self.runs.contains_key(&w.tgid);
        let r = self.ranks.entry(w.tgid).or_default();
        r.latest = Some(share);
        if !bound && !in_run {
            r.baseline.push_back(share);
            if r.baseline.len() > BASELINE_STEPS {
                r.baseline.pop_front();
            }
            if let Some(l) = w.launches {
                r.baseline_launches.push_back(l.kernels);
                if r.baseline_launches.len() > BASELINE_STEPS {
                    r.baseline_launches.pop_front();
                }
            }
        }
        let usual_launches = {
            let mut v: Vec<u64> = r.baseline_launches.iter().copied().collect();
            v.sort_unstable();
            (!v.is_empty()).then(|| v[(v.len() - 1) / 2])
        };
        if !bound {
            if let Some(run) = self.runs.get_mut(&w.tgid) {
                run.clean += 1;
                if run.clean >= 2 {
                    self.runs.remove(&w.tgid);
                }
            }
            return;
        }
        let run = self.runs.entry(w.tgid).or_insert_with(|| Run {
            first_step: w.step,
            start: w.start,
            usual: (own.unwrap_or(0.0), peers),
            launches: Some(0),
            usual_launches,
            ..Run::default()
        });
        run.clean = 0;
        run.steps += 1;
        run.launches = run.launches.zip(w.launches).map(|(sum, l)| sum + l.kernels);
        run.end = w.end;
        let t = &mut run.total;
        t.dur += s.dur;
        t.in_device_calls += s.in_device_calls;
        t.runnable += s.runnable;
        t.asleep += s.asleep;
        t.host += s.host;
        if let Some(at) = &run.reported_as {
            self.spans.went_on(at, run.end, w.step, run.steps);
        }
        if run.reported || run.steps < MIN_STEPS {
            return;
        }
        run.reported = true;
        let n = run.steps;
        let ms = |ns: u64| ns as f64 / 1e6;
        let pct = |part: u64| 100.0 * part as f64 / t.dur.max(1) as f64;
        let who = ranks.describe(w.tgid);
        // Launch overhead is host work: a step launching many more
        // kernels than the rank used to says where the host time went.
        let launches = run.launches.map(|l| l / n);
        let launch_note = match (launches, run.usual_launches) {
            (Some(now), Some(usual)) => {
                format!("; it launched {now} kernels per step (usually {usual})")
            }
            (Some(now), None) => format!("; it launched {now} kernels per step"),
            _ => String::new(),
        };
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::HostBound,
            ranks: ranks.of(w.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step: Some(run.first_step),
            start_ns: run.start,
            end_ns: Some(run.end),
            summary: format!(
                "host_bound: {who}'s training thread was busy on its CPU in its own code for \
                 {:.0}% of its steps ({:.1} of {:.1} ms per step; usually {:.0}%, its peers \
                 {:.0}%), {n} steps in a row from step {}, and waited in device calls for \
                 {:.0}%: its device and its peers waited for its host work (not kept off its \
                 CPU: {:.1} ms runnable per step; not asleep: {:.1} ms){launch_note}",
                pct(t.host),
                ms(t.host / n),
                ms(t.dur / n),
                100.0 * run.usual.0,
                100.0 * run.usual.1,
                run.first_step,
                pct(t.in_device_calls),
                ms(t.runnable / n),
                ms(t.asleep / n),
            ),
            evidence: json!({
                "pid": w.tgid,
                "first_step": run.first_step,
                "steps": n,
                "step_ms": ms(t.dur / n),
                "host_ms_per_step": ms(t.host / n),
                "host_share_pct": pct(t.host),
                "usual_share_pct": 100.0 * run.usual.0,
                "peers_share_pct": 100.0 * run.usual.1,
                "device_calls_ms_per_step": ms(t.in_device_calls / n),
                "device_calls_share_pct": pct(t.in_device_calls),
                "runnable_ms_per_step": ms(t.runnable / n),
                "asleep_ms_per_step": ms(t.asleep / n),
                "launches_per_step": launches,
                "usual_launches_per_step": run.usual_launches,
                "min_share_pct": 100.0 * MIN_SHARE,
                "min_rise_pct": 100.0 * MIN_RISE,
            }),
            detected_ns: w.end,
        });
        run.reported_as = out.last().map(ReportedAs::of);
    }

    /// Where the reported runs got to.
    pub fn spans(&self) -> &RunSpans {
        &self.spans
    }
}

#[cfg(test)]
mod tests {
    use super::super::host_steps::{CallShape, MainCall, MainOffCpu};
    use super::super::step_marks::StepSource;
    use super::*;
    use crate::model::RankIdentity;

    const MS: u64 = 1_000_000;

    fn ranks(n: u32) -> Ranks {
        let mut r = Ranks::default();
        for k in 0..n {
            let env = format!("RANK={k}\0WORLD_SIZE={n}\0XPUSCOPE_JOB=j\0");
            r.identity(10 + k, &RankIdentity::from_environ(env.as_bytes()));
        }
        r
    }

    /// A 100 ms step (longer with `extra` host work): `host` ms on its
    /// CPU, the rest in a sync it sleeps in; `runnable` ms of its host
    /// part kept off its CPU.
    fn step(tgid: u32, step: u64, host: u64, runnable: u64) -> Window {
        let start = 1_000 * MS + step * 1_000 * MS;
        let sync_start = start + host * MS;
        let end = start.max(sync_start) + (100u64.saturating_sub(host)).max(10) * MS;
        let mut off_cpu = vec![MainOffCpu {
            cpu: 0,
            start: sync_start + MS / 10,
            end: end - MS / 10,
            asleep: true,
            in_loader: false,
            preempted_by: None,
        }];
        if runnable > 0 {
            off_cpu.insert(
                0,
                MainOffCpu {
                    cpu: 0,
                    start: start + MS,
                    end: start + MS + runnable * MS,
                    asleep: false,
                    in_loader: false,
                    preempted_by: None,
                },
            );
        }
        Window {
            tgid,
            step,
            source: StepSource::AllReduces,
            start,
            end,
            named_at: end,
            calls: vec![MainCall {
                start: sync_start,
                end,
                shape: CallShape::Sync,
            }],
            off_cpu,
            launches: None,
        }
    }

    /// Steps 0..12 of 4 ranks; `host(tgid, step)` gives each step's host
    /// ms and runnable ms.
    fn run(host: impl Fn(u32, u64) -> (u64, u64)) -> Vec<Finding> {
        let ranks = ranks(4);
        let mut d = HostBoundDetector::default();
        let mut out = Vec::new();
        for s in 0..12 {
            for tgid in 10..14 {
                let (h, r) = host(tgid, s);
                let w = step(tgid, s, h, r);
                d.step_ended(&w, &split(&w), &ranks, &mut out);
            }
        }
        out
    }

    #[test]
    fn a_step_splits_into_device_calls_runnable_asleep_and_host() {
        let mut w = step(10, 0, 60, 5);
        // A call wrapped in another counts once; an off-CPU stretch half
        // inside a call counts half outside it.
        w.calls.push(MainCall {
            start: w.calls[0].start + MS,
            end: w.calls[0].start + 2 * MS,
            shape: CallShape::Other,
        });
        w.off_cpu.insert(
            1,
            MainOffCpu {
                cpu: 0,
                start: w.calls[0].start - 2 * MS,
                end: w.calls[0].start,
                asleep: true,
                in_loader: false,
                preempted_by: None,
            },
        );
        let s = split(&w);
        assert_eq!(s.dur, 100 * MS);
        assert_eq!(s.in_device_calls, 40 * MS);
        assert_eq!(s.runnable, 5 * MS);
        assert_eq!(s.asleep, 2 * MS);
        assert_eq!(s.host, 53 * MS);
    }

    #[test]
    fn a_rank_whose_steps_turn_host_bound_is_found_once_at_the_first() {
        let found = run(|tgid, s| match (tgid, s) {
            (11, 5..) => (80, 0),
            _ => (20, 0),
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        let f = &found[0];
        assert_eq!(f.kind, FindingKind::HostBound);
        assert_eq!(f.ranks, [1]);
        assert_eq!(f.step, Some(5));
        assert_eq!(f.evidence["steps"], 3);
        let share = f.evidence["host_share_pct"].as_f64().unwrap();
        assert!((share - 80.0).abs() < 0.5, "{share}");
        assert!((f.evidence["peers_share_pct"].as_f64().unwrap() - 20.0).abs() < 0.5);
        assert!(
            f.summary.starts_with("host_bound: rank 1's"),
            "{}",
            f.summary
        );
    }

    #[test]
    fn ranks_that_turn_host_bound_together_are_not_a_rank_fault() {
        let found = run(|_, s| if s >= 5 { (80, 0) } else { (20, 0) });
        assert!(found.is_empty(), "{found:#?}");
    }

    #[test]
    fn time_kept_off_its_cpu_is_not_host_work() {
        // 60 of its 80 ms outside device calls runnable: contention's.
        let found = run(|tgid, s| match (tgid, s) {
            (11, 5..) => (80, 60),
            _ => (20, 0),
        });
        assert!(found.is_empty(), "{found:#?}");
    }

    #[test]
    fn a_rank_host_bound_for_two_steps_is_not_found() {
        let found = run(|tgid, s| match (tgid, s) {
            (11, 5 | 6) => (80, 0),
            _ => (20, 0),
        });
        assert!(found.is_empty(), "{found:#?}");
    }
}
