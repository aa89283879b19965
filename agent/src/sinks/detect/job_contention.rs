//! `host_contention` of a whole job: an outsider that takes every rank's
//! CPU alike (a process spinning on every CPU of the node, a co-tenant
//! on a shared host). A rank's own judgement ([`host_contention`]) is
//! against the larger of its own baseline and its peers' latest share,
//! so what every rank suffers alike is background to each of them; here
//! the job's steps are judged against the job's own history, and such an
//! outsider is one finding naming every rank, not one per rank (or none).
//!
//! Per job and step number, each rank's share of the step lost to
//! outsiders (the same share its own judgement uses: the job's own
//! ranks taking one another's CPUs, a node with more ranks than CPUs,
//! and the agent's threads are not outsiders). A step is complete when
//! every rank of the job that counts steps is past it, or when one rank
//! is two steps past it (a rank that died or lags does not hold the job
//! up). The job's share of a step is what its ranks lost to outsiders
//! over the job's CPU time (the step time on each CPU its ranks ran on, at
//! most one per rank: with more ranks than CPUs, what an outsider takes
//! shows spread thin over many ranks). The usual share is the
//! median of the job's recent uncontended steps, and the job's first
//! [`BASELINE_MIN_STEPS`] complete steps form it unjudged: an outsider
//! present from the job's first step is its background, as a shared host
//! is. A step's usual is never more than what the outsiders that the
//! usual was learnt from took in it: a process new since is never
//! background (a daemon busy through the first steps sets the usual
//! high, and a hog that comes after it and takes less is still found).
//! Then the run rules of a rank's contention ([`advance`]) hold for
//! the job's steps, and a run is reported only when the outsider that
//! took the most above its usual took from more than half the job's
//! ranks (a neighbour on one CPU's ranks is left to their own
//! judgement). The finding names the step its top preemptor came
//! among the job's ranks (as a rank's does), every rank of the job, and
//! `scope: "job"` in its evidence.
//!
//! [`host_contention`]: super::host_contention

use foldhash::{HashMap, HashMapExt};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde_json::json;

use super::Ranks;
use super::contention_runs::{
    Judged, Run, TOP_PREEMPTORS, Takers, WithThresholds, advance, taker_names, top_takers,
};
use super::host_config::HostDetectConfig;
use super::run_spans::{ReportedAs, RunSpans};
use crate::model::{Finding, FindingKind};

/// Complete steps whose share is the job's usual (their median).
const BASELINE_STEPS: usize = 16;
/// Complete steps taken as the usual before any is judged.
pub const BASELINE_MIN_STEPS: usize = 3;
/// Steps a rank may be ahead of a step before it is judged without the
/// ranks that have not reached it.
const LAG_STEPS: u64 = 2;
/// Steps held per job before the oldest is judged anyway.
const MAX_PENDING: usize = 64;
/// Ranks' steps kept per pending step, and CPUs counted per job.
const MAX_RANKS: usize = 4096;
/// The weight of an uncontended step in an outsider's usual share.
const USUAL_WEIGHT: f64 = 0.2;
/// Outsiders counted per rank over a run.
const MAX_TAKERS: usize = 256;

/// One rank's finished step, as the job sees it.
pub struct RankStep {
    pub tgid: u32,
    pub start: u64,
    pub end: u64,
    /// Time lost to outsiders.
    pub lost: u64,
    pub by: Takers,
    /// The CPUs its main thread left in the step.
    pub cpus: Vec<u32>,
}

#[derive(Default)]
struct JobSteps {
    /// Each rank counting steps, and the latest step it finished.
    latest: HashMap<u32, u64>,
    /// Steps not yet complete, by number.
    pending: BTreeMap<u64, Vec<RankStep>>,
    /// Shares of the job's recent uncontended steps.
    usual: VecDeque<f64>,
    /// Complete steps seen (judged or taken as the usual).
    complete: usize,
    /// The CPUs the job's main threads ran on.
    cpus: BTreeSet<u32>,
    /// Per rank, over the contended run's steps (from its first): the
    /// time each outsider took from it, and the time.
    in_run: HashMap<u32, (HashMap<u32, u64>, u64)>,
    /// Per outsider, the share of a rank's step it usually takes (a
    /// moving average over the job's uncontended steps): the launcher's
    /// polling, a daemon's wake-ups.
    usual_by: HashMap<u32, f64>,
    /// Steps `usual_by` was taken from.
    usual_steps: usize,
}

/// When the job's top preemptor came among its ranks (from the ranks'
/// own judgement): its first step and that step's start.
pub type Came = Option<(u64, u64)>;

#[derive(Default)]
pub struct JobContention {
    jobs: HashMap<String, JobSteps>,
    runs: HashMap<String, Run>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    v[v.len() / 2]
}

impl JobContention {
    /// A rank left the job (its process ended): its steps are no longer
    /// waited for; a job without ranks is forgotten.
    pub fn forget(&mut self, tgid: u32, job: &str) {
        if let Some(j) = self.jobs.get_mut(job) {
            j.latest.remove(&tgid);
            if j.latest.is_empty() {
                self.jobs.remove(job);
                self.runs.remove(job);
            }
        }
    }

    /// Rank `tgid` of `job` finished `step`. `came` names when a top
    /// preemptor came among the job's ranks.
    #[allow(clippy::too_many_arguments)]
    pub fn step_ended(
        &mut self,
        job: &str,
        step: u64,
        rs: RankStep,
        cfg: &HostDetectConfig,
        ranks: &Ranks,
        came: impl Fn(u32) -> Came,
        spans: &mut RunSpans,
        out: &mut Vec<Finding>,
    ) {
        let j = self.jobs.entry(job.to_string()).or_default();
        let latest = j.latest.entry(rs.tgid).or_insert(step);
        *latest = (*latest).max(step);
        for cpu in &rs.cpus {
            if j.cpus.len() < MAX_RANKS {
                j.cpus.insert(*cpu);
            }
        }
        let at = j.pending.entry(step).or_default();
        if at.len() < MAX_RANKS {
            at.push(rs);
        }
        loop {
            let j = self.jobs.get_mut(job).expect("entered above");
            let Some((&first, _)) = j.pending.first_key_value() else {
                break;
            };
            let ahead = j.latest.values().copied().max().unwrap_or(0);
            let all_past = j.latest.values().all(|&s| s >= first);
            if !(all_past || ahead >= first + LAG_STEPS || j.pending.len() > MAX_PENDING) {
                break;
            }
            let steps = j.pending.remove(&first).expect("its first key");
            self.judge(job, first, steps, cfg, ranks, &came, spans, out);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn judge(
        &mut self,
        job: &str,
        step: u64,
        steps: Vec<RankStep>,
        cfg: &HostDetectConfig,
        ranks: &Ranks,
        came: &impl Fn(u32) -> Came,
        spans: &mut RunSpans,
        out: &mut Vec<Finding>,
    ) {
        // One rank is no job: its own judgement covers it.
        if steps.len() < 2 {
            return;
        }
        let j = self
            .jobs
            .get_mut(job)
            .expect("judged steps are of a known job");
        let dur = {
            let mut d: Vec<f64> = steps
                .iter()
                .map(|s| s.end.saturating_sub(s.start) as f64)
                .collect();
            median(&mut d).max(1.0) as u64
        };
        // The share of the job's CPU time outsiders took: what its ranks
        // lost to them, over the CPUs the ranks can have at once (more
        // ranks than CPUs: a rank waits its turn behind its siblings, so
        // what an outsider takes shows spread thin over many ranks).
        let lost: u64 = steps.iter().map(|s| s.lost).sum();
        let cpus = (j.cpus.len().max(1)).min(steps.len()) as f64;
        let share = lost as f64 / (dur as f64 * cpus);
        j.complete += 1;
        if j.complete <= BASELINE_MIN_STEPS {
            j.usual.push_back(share);
            j.usual_steps += 1;
            note_usual_takers(&mut j.usual_by, &steps, j.usual_steps);
            return;
        }
        // What the job's usual outsiders took this step: one that took
        // nothing in the steps the usual was learnt from (it is not in
        // `usual_by`) is new, and never the background, however high a
        // passing process at the job's start set the usual (a daemon busy
        // through the first steps, then a hog that takes less than it
        // did would otherwise be learnt as usual itself).
        let new: u64 = steps
            .iter()
            .flat_map(|s| s.by.iter())
            .filter(|(pid, _)| !j.usual_by.contains_key(pid))
            .map(|(_, t)| t.ns)
            .sum();
        let by_usual_takers = lost.saturating_sub(new) as f64 / (dur as f64 * cpus);
        let usual = median(&mut j.usual.iter().copied().collect::<Vec<_>>()).min(by_usual_takers);
        let excess = ((share - usual).max(0.0) * dur as f64) as u64;
        let contended = excess >= cfg.contention_min_lost.as_nanos() as u64
            && excess.saturating_mul(100) >= dur * u64::from(cfg.contention_min_share_pct);
        let in_run = self.runs.contains_key(job);
        if !contended && !in_run {
            j.usual.push_back(share);
            if j.usual.len() > BASELINE_STEPS {
                j.usual.pop_front();
            }
            j.usual_steps += 1;
            note_usual_takers(&mut j.usual_by, &steps, j.usual_steps);
        }
        if !in_run {
            j.in_run.clear();
        }
        if contended || in_run {
            for s in &steps {
                if j.in_run.len() < MAX_RANKS || j.in_run.contains_key(&s.tgid) {
                    let (took, d) = j.in_run.entry(s.tgid).or_default();
                    *d += s.end.saturating_sub(s.start);
                    for (pid, t) in &s.by {
                        if took.len() < MAX_TAKERS || took.contains_key(pid) {
                            *took.entry(*pid).or_default() += t.ns;
                        }
                    }
                }
            }
        }
        let mut by = Takers::new();
        for s in &steps {
            for (pid, t) in &s.by {
                by.entry(*pid).or_default().merge(t);
            }
        }
        let judged = Judged {
            step,
            start: steps.iter().map(|s| s.start).min().unwrap_or(0),
            end: steps.iter().map(|s| s.end).max().unwrap_or(0),
            dur,
            lost,
            excess,
            contended,
            usual,
            by,
        };
        if !advance(&mut self.runs, job.to_string(), judged, cfg, spans) {
            return;
        }
        // Every rank alike: the outsider that took the most took a
        // noticeable share of the steps of more than half the job's ranks
        // in the run (a quarter of its mean share, and 1 %: how much a
        // rank loses to it varies with how long the rank sleeps in its
        // collectives); one on the CPUs of a few ranks (a neighbour
        // pinned to one CPU of two takes from that CPU's ranks only) is
        // theirs to report, and stays unreported here while it lasts, as
        // are the others that come to those ranks when it crowds them out
        // of their CPUs.
        let j = &self.jobs[job];
        // What each outsider took in the run above what it usually takes.
        let all_dur: u64 = j.in_run.values().map(|v| v.1).sum();
        let mut above: HashMap<u32, f64> = HashMap::new();
        for (took, _) in j.in_run.values() {
            for (pid, ns) in took {
                *above.entry(*pid).or_default() += *ns as f64;
            }
        }
        for (pid, v) in above.iter_mut() {
            *v -= j.usual_by.get(pid).copied().unwrap_or(0.0) * all_dur as f64;
        }
        let Some((&top_pid, &top_above)) = above
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(a.0)))
        else {
            return;
        };
        let usual_top = j.usual_by.get(&top_pid).copied().unwrap_or(0.0);
        let mean = top_above / all_dur.max(1) as f64;
        let bar = (mean / 4.0).max(0.01);
        let touched = j
            .in_run
            .values()
            .filter(|(took, d)| {
                let t = took.get(&top_pid).copied().unwrap_or(0) as f64;
                t - usual_top * *d as f64 >= bar * *d as f64
            })
            .count();
        let run = self.runs.get_mut(job).expect("advanced above");
        // (Ranks that left during the run still count: the job's ranks
        // end one by one.)
        if touched * 2 <= j.in_run.len().max(j.latest.len()) {
            run.reported = false;
            return;
        }
        let run = &self.runs[job];
        // The outsider judged above leads the list (and dates the
        // finding), even where a usual taker (the launcher's polling) took
        // more in total.
        let mut top = top_takers(&run.by);
        if let Some(i) = top.iter().position(|(pid, _)| **pid == top_pid) {
            let judged = top.remove(i);
            top.insert(0, judged);
        } else if let Some(judged) = run.by.get_key_value(&top_pid) {
            top.insert(0, judged);
            top.truncate(TOP_PREEMPTORS);
        }
        let (first_step, start) = top
            .first()
            .and_then(|(pid, _)| came(**pid))
            .map_or((run.first_step, run.start), |(step, start)| {
                (step.min(run.first_step), start.min(run.start))
            });
        let j_cpus = self.jobs[job].cpus.len();
        let mut job_ranks: Vec<u32> = ranks_counting_steps(self.jobs.get(job), ranks);
        job_ranks.sort_unstable();
        let ms = |ns: u64| ns as f64 / 1e6;
        let per_step = run.lost / run.steps;
        let cpus = j_cpus.clamp(1, job_ranks.len().max(1));
        let pct = 100.0 * run.lost as f64 / (run.dur.max(1) as f64 * cpus as f64);
        let whose = if job.is_empty() {
            "the job".to_string()
        } else {
            format!("job {job}")
        };
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::HostContention,
            ranks: job_ranks.clone(),
            comm: None,
            seq: None,
            step: Some(first_step),
            start_ns: start,
            end_ns: Some(run.end),
            summary: format!(
                "host_contention: every rank of {whose} ({} ranks on {j_cpus} CPUs) lost its CPU \
                 to other processes: they took {pct:.0}% of the job's CPU time (usually {:.0}%), \
                 {:.1} ms of its ranks' time per step, {} steps in a row from step {first_step}; \
                 most by {}",
                job_ranks.len(),
                100.0 * run.usual_share,
                ms(per_step),
                run.steps,
                taker_names(&top, job, ranks),
            ),
            // What the job's ranks lost together per step
            // (`lost_ms_per_step`), and as a share of the job's CPU time
            // (its step time on each of the CPUs its ranks ran on, `cpus`,
            // at most one per rank).
            evidence: run
                .evidence(
                    first_step,
                    &top,
                    ranks,
                    json!({
                        "scope": "job",
                        "job": job,
                        "cpus": j_cpus,
                        "ranks_touched": touched,
                        "lost_share_pct": pct,
                    }),
                )
                .with_thresholds(cfg),
            detected_ns: run.end,
        });
        let at = out.last().map(ReportedAs::of);
        if let Some(run) = self.runs.get_mut(job) {
            run.reported_as = at;
        }
    }
}

/// Moves each outsider's usual share towards what it took in an
/// uncontended step (its share of the ranks' time).
/// The first steps weigh alike (a mean), later ones [`USUAL_WEIGHT`].
fn note_usual_takers(usual: &mut HashMap<u32, f64>, steps: &[RankStep], seen: usize) {
    let weight = USUAL_WEIGHT.max(1.0 / seen.max(1) as f64);
    let dur: u64 = steps.iter().map(|s| s.end.saturating_sub(s.start)).sum();
    let mut now: HashMap<u32, u64> = HashMap::new();
    for s in steps {
        for (pid, t) in &s.by {
            if now.len() < MAX_TAKERS || now.contains_key(pid) {
                *now.entry(*pid).or_default() += t.ns;
            }
        }
    }
    for v in usual.values_mut() {
        *v *= 1.0 - weight;
    }
    for (pid, ns) in now {
        if usual.len() < MAX_TAKERS || usual.contains_key(&pid) {
            *usual.entry(pid).or_default() += weight * ns as f64 / dur.max(1) as f64;
        }
    }
    usual.retain(|_, v| *v >= 1e-4);
}

/// The ranks of a job's processes that count steps.
fn ranks_counting_steps(j: Option<&JobSteps>, ranks: &Ranks) -> Vec<u32> {
    j.map(|j| j.latest.keys().filter_map(|t| ranks.of(*t)).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RankIdentity;

    const MS: u64 = 1_000_000;

    fn two_ranks() -> Ranks {
        let mut r = Ranks::default();
        for k in 0..2 {
            let env = format!("RANK={k}\0WORLD_SIZE=2\0XPUSCOPE_JOB=j\0");
            r.identity(10 + k, &RankIdentity::from_environ(env.as_bytes()));
        }
        r
    }

    /// Two ranks, one per CPU, 100 ms steps; `taker(step)` takes that
    /// many ms of each rank's step, as (pid, comm, ms).
    fn run(steps: u64, taker: impl Fn(u64) -> Option<(u32, &'static str, u64)>) -> Vec<Finding> {
        let ranks = two_ranks();
        let cfg = HostDetectConfig::default();
        let mut job = JobContention::default();
        let mut spans = RunSpans::default();
        let mut out = Vec::new();
        for step in 0..steps {
            for (cpu, tgid) in [10u32, 11].into_iter().enumerate() {
                let start = 1_000 * MS + step * 100 * MS;
                let mut by = Takers::new();
                let mut lost = 0;
                if let Some((pid, comm, ms)) = taker(step) {
                    by.entry(pid).or_default().add(comm, ms * MS);
                    lost = ms * MS;
                }
                let rs = RankStep {
                    tgid,
                    start,
                    end: start + 100 * MS,
                    lost,
                    by,
                    cpus: vec![cpu as u32],
                };
                job.step_ended("j", step, rs, &cfg, &ranks, |_| None, &mut spans, &mut out);
            }
        }
        out
    }

    /// A daemon busy through the job's first steps (the first complete
    /// ones, 1-3, form the usual: step 0 had one rank when it was judged)
    /// sets a high usual; a hog that comes after it has gone takes less
    /// than the daemon did, yet it is new: the job's contention, not its
    /// background.
    #[test]
    fn a_newcomer_is_not_background_however_high_a_passing_process_set_the_usual() {
        let found = run(30, |step| match step {
            0..=3 => Some((44, "kcompactd0", 60)),
            _ => Some((999, "noisy", 30)),
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        let f = &found[0];
        assert_eq!(f.kind, FindingKind::HostContention);
        assert_eq!(f.ranks, vec![0, 1]);
        assert_eq!(f.evidence["scope"], "job");
        assert_eq!(f.evidence["preemptors"][0]["pid"], 999, "{f:#?}");
        assert_eq!(f.step, Some(4), "{f:#?}");
        assert!(
            f.evidence["usual_share_pct"].as_f64().unwrap() < 1.0,
            "usually nothing of what took it: {f:#?}"
        );
    }

    /// An outsider there from the job's first step, taking as much all
    /// along, is the host's background: no finding.
    #[test]
    fn an_outsider_present_from_the_first_step_is_background() {
        let found = run(30, |_| Some((999, "noisy", 30)));
        assert!(found.is_empty(), "{found:#?}");
    }
}
