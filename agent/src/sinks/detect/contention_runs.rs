//! The contended runs and the takers that `host_contention` (a rank's
//! steps) and `job_contention` (a job's steps) share: the time each
//! outsider took, and the rules by which judged steps make a run that is
//! reported once.

use foldhash::HashMap;

use serde_json::json;

use super::Ranks;
use super::host_config::HostDetectConfig;
use super::run_spans::{ReportedAs, RunSpans};

/// Preemptors named in a finding.
pub const TOP_PREEMPTORS: usize = 3;
/// Distinct preemptors counted per run of contended steps.
pub const MAX_PREEMPTORS: usize = 256;

/// Command names kept per preemptor process.
const MAX_COMMS: usize = 4;

/// The time one process took from the main thread.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Taken {
    pub ns: u64,
    /// A process traced along with the job.
    pub in_job: bool,
    /// Its threads' command names, with the time each took.
    pub comms: Vec<(String, u64)>,
}

impl Taken {
    pub fn add(&mut self, comm: &str, ns: u64) {
        self.ns += ns;
        if let Some(c) = self.comms.iter_mut().find(|(c, _)| c == comm) {
            c.1 += ns;
        } else if self.comms.len() < MAX_COMMS {
            self.comms.push((comm.to_string(), ns));
        }
    }

    /// Adds what `other` (the same process, elsewhere) took.
    pub fn merge(&mut self, other: &Taken) {
        self.in_job = other.in_job;
        self.ns += other.ns;
        for (comm, ns) in &other.comms {
            if let Some(c) = self.comms.iter_mut().find(|(c, _)| c == comm) {
                c.1 += ns;
            } else if self.comms.len() < MAX_COMMS {
                self.comms.push((comm.clone(), *ns));
            }
        }
    }

    /// The command name that took the most.
    pub fn comm(&self) -> &str {
        self.comms
            .iter()
            .max_by_key(|(_, ns)| *ns)
            .map_or("?", |(c, _)| c)
    }
}

/// Time taken per preemptor process (pid).
pub type Takers = HashMap<u32, Taken>;

#[derive(Default)]
pub struct Run {
    pub first_step: u64,
    pub start: u64,
    pub end: u64,
    /// Its latest contended step.
    pub last_step: u64,
    pub steps: u64,
    pub lost: u64,
    pub dur: u64,
    /// (comm, pid) -> (ns taken, from a traced process).
    pub by: Takers,
    pub reported: bool,
    /// Uncontended steps since the last contended one.
    pub clean: u32,
    /// The share outsiders usually took when the run began.
    pub usual_share: f64,
    /// Time lost above the usual share, and time, over every step of the
    /// run (its lulls too).
    pub all_excess: u64,
    pub all_dur: u64,
    /// The finding it fired, once reported: it follows the run on
    /// ([`RunSpans`]).
    pub reported_as: Option<ReportedAs>,
}

/// The processes that took the most, most first.
pub fn top_takers(by: &Takers) -> Vec<(&u32, &Taken)> {
    let mut top: Vec<_> = by.iter().collect();
    top.sort_by_key(|(pid, t)| (std::cmp::Reverse(t.ns), **pid));
    top.truncate(TOP_PREEMPTORS);
    top
}

/// Nanoseconds as the milliseconds the evidence gives.
pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// "noisy (pid 812, 903.1 ms), its job's rank 3, python3 (pid 77, ...)":
/// a traced preemptor is named by its rank (a sibling rank of the same
/// job, an oversubscribed node, reads differently from another job
/// sharing the node, or from an untraced process).
pub fn taker_names(top: &[(&u32, &Taken)], job: &str, ranks: &Ranks) -> String {
    let whose = |pid: u32| -> Option<String> {
        let rank = ranks.of(pid)?;
        Some(match ranks.job_of(pid) {
            j if j == job => format!("its job's rank {rank}"),
            "" => format!("rank {rank} of an unlabelled job"),
            j => format!("rank {rank} of job {j}"),
        })
    };
    top.iter()
        .map(|(pid, t)| {
            let what = format!("{} (pid {pid}, {:.1} ms)", t.comm(), ms(t.ns));
            match whose(**pid) {
                Some(rank) => format!("{rank}, {what}"),
                None => what,
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The evidence's `preemptors`.
pub fn takers_json(top: &[(&u32, &Taken)], steps: u64, ranks: &Ranks) -> Vec<serde_json::Value> {
    top.iter()
        .map(|(pid, t)| {
            json!({
                "comm": t.comm(),
                "pid": pid,
                "ms": ms(t.ns),
                "ms_per_step": ms(t.ns / steps.max(1)),
                "traced": t.in_job,
                "rank": ranks.of(**pid),
                "job": ranks.of(**pid).map(|_| ranks.job_of(**pid)),
                "threads": t.comms.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>(),
            })
        })
        .collect()
}

impl Run {
    /// The evidence a reported run gives, with `own` (the finding's own
    /// keys) added: when it began (`first_step`, and the run's own first
    /// step), its steps, what was lost per step and usually, the step
    /// time and the top preemptors.
    pub fn evidence(
        &self,
        first_step: u64,
        top: &[(&u32, &Taken)],
        ranks: &Ranks,
        own: serde_json::Value,
    ) -> serde_json::Value {
        let steps = self.steps.max(1);
        let mut v = json!({
            "first_step": first_step,
            // The first step of the contended run itself.
            "run_first_step": self.first_step,
            "steps": self.steps,
            "lost_ms_per_step": ms(self.lost / steps),
            "usual_share_pct": 100.0 * self.usual_share,
            "step_ms": ms(self.dur / steps),
            "preemptors": takers_json(top, steps, ranks),
        });
        if let (Some(e), serde_json::Value::Object(own)) = (v.as_object_mut(), own) {
            e.extend(own);
        }
        v
    }
}

/// Evidence with the thresholds it was judged by.
pub trait WithThresholds {
    fn with_thresholds(self, cfg: &HostDetectConfig) -> Self;
}

impl WithThresholds for serde_json::Value {
    fn with_thresholds(mut self, cfg: &HostDetectConfig) -> Self {
        if let Some(e) = self.as_object_mut() {
            e.insert(
                "contention_min_share_pct".into(),
                cfg.contention_min_share_pct.into(),
            );
            e.insert(
                "contention_min_lost_ms".into(),
                ms(cfg.contention_min_lost.as_nanos() as u64).into(),
            );
            e.insert(
                "contention_min_steps".into(),
                cfg.contention_min_steps.into(),
            );
            e.insert(
                "contention_min_span_ms".into(),
                ms(cfg.contention_min_span.as_nanos() as u64).into(),
            );
        }
        self
    }
}

/// One step (of a rank, or of a whole job) judged against the usual.
pub struct Judged {
    pub step: u64,
    pub start: u64,
    pub end: u64,
    pub dur: u64,
    /// Time lost to outsiders.
    pub lost: u64,
    /// Time lost above the usual share.
    pub excess: u64,
    pub contended: bool,
    /// The usual share it was judged against.
    pub usual: f64,
    pub by: Takers,
}

/// Takes one judged step into the run of `key` (a rank's, a job's):
/// true when that run is to be reported now (once per run). A run goes
/// on through two uncontended steps (contention flickers with what else
/// the machine runs: a rank that shares its CPU with its siblings and a
/// neighbour is preempted by one or the other, step by step) and ends at
/// three in a row, or, once reported, at `contention_min_steps` (at least
/// 3), so a lull in a long contention is not a new finding. An isolated
/// blip (one contended step, then two uncontended) does not start a run
/// (blips before a neighbour do not date it). It is reported when it
/// holds `contention_min_steps` contended steps spanning
/// `contention_min_span` and, its lulls included, lost
/// `contention_min_share_pct` above the usual: scattered contended steps
/// are the host's blips, not a neighbour. A reported run's contended
/// steps carry its finding's span on (`spans`).
pub fn advance<K: std::hash::Hash + Eq + Clone>(
    runs: &mut HashMap<K, Run>,
    key: K,
    j: Judged,
    cfg: &HostDetectConfig,
    spans: &mut RunSpans,
) -> bool {
    if !j.contended {
        if let Some(run) = runs.get_mut(&key) {
            run.clean += 1;
            run.all_excess += j.excess;
            run.all_dur += j.dur;
            let ends = if run.reported {
                cfg.contention_min_steps.max(3)
            } else {
                3
            };
            if run.clean >= ends {
                runs.remove(&key);
            }
        }
        return false;
    }
    let fresh = || Run {
        first_step: j.step,
        start: j.start,
        usual_share: j.usual,
        ..Run::default()
    };
    let run = runs.entry(key).or_insert_with(fresh);
    if !run.reported && run.clean >= 2 && run.steps == 1 {
        *run = fresh();
    }
    run.clean = 0;
    run.all_excess += j.excess;
    run.all_dur += j.dur;
    run.end = j.end;
    run.last_step = j.step;
    run.steps += 1;
    run.lost += j.lost;
    run.dur += j.dur;
    for (pid, taken) in j.by {
        if run.by.len() < MAX_PREEMPTORS || run.by.contains_key(&pid) {
            run.by.entry(pid).or_default().merge(&taken);
        }
    }
    if let Some(at) = &run.reported_as {
        spans.went_on(at, run.end, run.last_step, run.steps);
    }
    if run.reported
        || run.steps < u64::from(cfg.contention_min_steps.max(1))
        || run.end.saturating_sub(run.start) < cfg.contention_min_span.as_nanos() as u64
        || run.all_excess.saturating_mul(100)
            < run.all_dur * u64::from(cfg.contention_min_share_pct)
    {
        return false;
    }
    run.reported = true;
    true
}
