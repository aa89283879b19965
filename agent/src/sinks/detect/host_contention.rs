//! `host_contention`: a rank's training (main) thread kept off its CPU by
//! tasks of other processes while it was runnable, for a large share of
//! its steps, several steps in a row.
//!
//! Per step (a window of the step clock, `host_steps`), the time lost is
//! the main thread's off-CPU time in intervals where it was preempted
//! (runnable) by a thread of another process, as the scheduler's switch
//! named it; the rank's own threads (its data loader, the device
//! libraries' workers) are its own business and not counted, and neither
//! are the job's other ranks (a node with more ranks than CPUs: every rank
//! loses time to its siblings alike, every step; that is the job's shape,
//! not a fault) nor the agent's own threads (its overhead). A step is
//! contended when the time lost, above what the rank usually loses, is at
//! least `contention_min_lost` and at least `contention_min_share_pct`
//! percent of the step. What it usually loses is the larger of its own
//! recent baseline and its peers' (see [`reference_share`]). It fires when
//! a run holds `contention_min_steps` contended steps spanning
//! `contention_min_span`, and the run as a whole (its lulls included)
//! lost `contention_min_share_pct` above the usual; once per run. A run
//! goes on through two uncontended steps (contention flickers with the
//! rest of the machine's load, and a rank sharing its CPU with siblings
//! and a neighbour is preempted by one or the other, step by step) and
//! ends at three in a row, or, once reported, at `contention_min_steps`
//! (at least 3) in a row. An isolated blip (one contended step, then two
//! uncontended) does not start a run (blips before a neighbour do not date
//! it). The finding names the step the contention began: the first step
//! of its top preemptor's presence in the job (steps it took a noticeable
//! share of some rank's thread in, at most [`PRESENCE_GAP`] apart: a
//! neighbour's share above the usual flickers on a CPU it shares with
//! several ranks, so a rank's run can be confirmed steps after it came, or
//! begun by a blip of something else just before it), else the run's
//! first step; the time lost per step and the top
//! preemptors (command name, pid, time taken; a traced one by its rank,
//! and whether it is of the same job).

use foldhash::{HashMap, HashMapExt};
use std::collections::VecDeque;

use serde_json::json;

use super::Ranks;
use super::contention_runs::{
    Judged, MAX_PREEMPTORS, Run, Taken, Takers, WithThresholds, advance, ms, taker_names,
    top_takers,
};
use super::host_config::HostDetectConfig;
use super::host_steps::Window;
use super::job_contention::{JobContention, RankStep};
use super::run_spans::{ReportedAs, RunSpans};
use crate::model::{Finding, FindingKind};

/// Steps of each rank kept to name a time by its step.
const RECENT_STEPS: usize = 64;

/// Steps an outsider may take nothing noticeable and still be present.
const PRESENCE_GAP: u64 = 2;

/// An outsider's presence among a job's ranks: the steps it took a
/// noticeable share of a rank's main thread in, from `first_step` (whose
/// window began at `first_start`) to `last_step`, at most
/// [`PRESENCE_GAP`] apart.
#[derive(Clone, Copy, Debug)]
struct Presence {
    first_step: u64,
    first_start: u64,
    last_step: u64,
}

#[derive(Default)]
pub struct ContentionDetector {
    runs: HashMap<u32, Run>,
    /// Per job (label), per outsider process: its presence.
    presence: HashMap<String, HashMap<u32, Presence>>,
    /// The job of each rank judged.
    jobs: HashMap<u32, String>,
    /// Per rank, the start and number of its recent steps (to name a
    /// time by the rank's own step: ranks of a pipeline count theirs
    /// apart).
    recent_steps: HashMap<u32, VecDeque<(u64, u64)>>,
    /// Per rank: the share of its recent steps (outside contended runs)
    /// outsiders took, its own baseline; and the share of its latest step.
    usual: HashMap<u32, Usual>,
    /// The jobs' steps, judged as a whole.
    job: JobContention,
    /// Where the reported runs (a rank's, a job's) got to.
    spans: RunSpans,
}

#[derive(Default)]
struct Usual {
    shares: VecDeque<f64>,
    latest: f64,
}

/// Steps a rank's own baseline is the median of.
const BASELINE_STEPS: usize = 16;
/// Steps of history before a rank's own baseline counts.
const BASELINE_MIN_STEPS: usize = 3;

/// The share of its steps a rank usually loses to outsiders, to judge a
/// step against: the larger of its own recent baseline and its peers'
/// (the lower median of the job's other ranks' latest steps). What every
/// rank of the job loses alike (a busy host, the launcher's polling) and
/// what this rank always lost are the background; contention is what
/// comes on top of both. A neighbour present from the first step is still
/// found: its peers do not suffer it.
fn reference_share(usual: &HashMap<u32, Usual>, tgid: u32, ranks: &Ranks) -> f64 {
    let own = usual.get(&tgid).map_or(0.0, own_baseline);
    let job = ranks.job_of(tgid);
    let mut peers: Vec<f64> = usual
        .iter()
        .filter(|(t, _)| **t != tgid && ranks.of(**t).is_some() && ranks.job_of(**t) == job)
        .map(|(_, u)| u.latest)
        .collect();
    peers.sort_unstable_by(f64::total_cmp);
    let peer = peers
        .get(peers.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0.0);
    own.max(peer)
}

/// A rank's own baseline share: the median of its recent uncontended
/// steps' (0 before it has [`BASELINE_MIN_STEPS`] of them).
fn own_baseline(u: &Usual) -> f64 {
    if u.shares.len() < BASELINE_MIN_STEPS {
        return 0.0;
    }
    let mut v: Vec<f64> = u.shares.iter().copied().collect();
    v.sort_unstable_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Who a preemptor is to the rank it preempted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TakerClass {
    /// A rank of the same job (an oversubscribed node).
    Sibling,
    /// The agent itself (its threads are named [`AGENT_THREAD_PREFIX`]).
    Agent,
    /// Anything else: a neighbour, another job, the system.
    Outsider,
}

/// The agent names each of its threads with this prefix; a preemptor
/// process with such a thread is the agent (live and in a trace alike).
pub const AGENT_THREAD_PREFIX: &str = "xpuscope-";

pub fn taker_class(pid: u32, t: &Taken, preempted: u32, ranks: &Ranks) -> TakerClass {
    if t.comms
        .iter()
        .any(|(c, _)| c.starts_with(AGENT_THREAD_PREFIX))
    {
        return TakerClass::Agent;
    }
    if ranks.of(pid).is_some() && ranks.job_of(pid) == ranks.job_of(preempted) {
        return TakerClass::Sibling;
    }
    TakerClass::Outsider
}

/// The time a window's main thread lost to other processes, by preemptor.
pub fn lost_in(w: &Window) -> (u64, Takers) {
    let mut by = Takers::new();
    let mut lost = 0;
    for i in &w.off_cpu {
        let Some(p) = &i.preempted_by else {
            continue;
        };
        let d = i.end.min(w.end).saturating_sub(i.start);
        lost += d;
        if by.len() < MAX_PREEMPTORS || by.contains_key(&p.pid) {
            let e = by.entry(p.pid).or_default();
            e.in_job = p.in_job;
            e.add(&p.comm, d);
        }
    }
    (lost, by)
}

impl ContentionDetector {
    pub fn forget(&mut self, tgid: u32) {
        if let Some(job) = self.jobs.get(&tgid) {
            self.job.forget(tgid, job);
        }
        self.runs.remove(&tgid);
        self.usual.remove(&tgid);
        self.recent_steps.remove(&tgid);
        if let Some(job) = self.jobs.remove(&tgid)
            && !self.jobs.values().any(|j| *j == job)
        {
            self.presence.remove(&job);
        }
    }

    /// Outsiders that took a noticeable share of this step (half the
    /// contention share, and `contention_min_lost`) extend or begin their
    /// presence; presences past the gap end.
    fn note_presence(&mut self, w: &Window, by: &Takers, job: &str, cfg: &HostDetectConfig) {
        let dur = w.dur().max(1);
        let noticeable = (cfg.contention_min_lost.as_nanos() as u64)
            .max(dur * u64::from(cfg.contention_min_share_pct) / 200);
        if self.jobs.get(&w.tgid).is_none_or(|j| j != job) {
            self.jobs.insert(w.tgid, job.to_string());
        }
        let steps = self.recent_steps.entry(w.tgid).or_default();
        steps.push_back((w.start, w.step));
        if steps.len() > RECENT_STEPS {
            steps.pop_front();
        }
        let seen = self.presence.entry(job.to_string()).or_default();
        seen.retain(|_, p| w.step.saturating_sub(p.last_step) <= PRESENCE_GAP);
        for (pid, t) in by {
            if t.ns < noticeable {
                continue;
            }
            if let Some(p) = seen.get_mut(pid) {
                p.last_step = p.last_step.max(w.step);
            } else if seen.len() < MAX_PREEMPTORS {
                seen.insert(
                    *pid,
                    Presence {
                        first_step: w.step,
                        first_start: w.start,
                        last_step: w.step,
                    },
                );
            }
        }
    }

    pub fn step_ended(
        &mut self,
        w: &Window,
        cfg: &HostDetectConfig,
        ranks: &Ranks,
        out: &mut Vec<Finding>,
    ) {
        let (_, mut by) = lost_in(w);
        // Only outsiders contend: the job's own ranks taking one another's
        // CPUs (more ranks than CPUs) is the job's shape, alike on every
        // rank and every step, and the agent's own threads are its
        // overhead, not a neighbour.
        by.retain(|pid, t| taker_class(*pid, t, w.tgid, ranks) == TakerClass::Outsider);
        self.note_presence(w, &by, ranks.job_of(w.tgid), cfg);
        let lost: u64 = by.values().map(|t| t.ns).sum();
        if ranks.of(w.tgid).is_some() && w.dur() > 0 {
            let job = ranks.job_of(w.tgid);
            let presence = self.presence.get(job);
            let came = |pid: u32| presence?.get(&pid).map(|p| (p.first_step, p.first_start));
            let rs = RankStep {
                tgid: w.tgid,
                start: w.start,
                end: w.end,
                lost,
                by: by.clone(),
                cpus: {
                    let mut c: Vec<u32> = w.off_cpu.iter().map(|i| i.cpu).collect();
                    c.sort_unstable();
                    c.dedup();
                    c
                },
            };
            self.job
                .step_ended(job, w.step, rs, cfg, ranks, came, &mut self.spans, out);
        }
        let dur = w.dur().max(1);
        let share = lost as f64 / dur as f64;
        let usual = reference_share(&self.usual, w.tgid, ranks);
        let excess = ((share - usual).max(0.0) * dur as f64) as u64;
        let contended = excess >= cfg.contention_min_lost.as_nanos() as u64
            && excess.saturating_mul(100) >= dur * u64::from(cfg.contention_min_share_pct);
        let in_run = self.runs.contains_key(&w.tgid);
        let u = self.usual.entry(w.tgid).or_default();
        u.latest = share;
        if !contended && !in_run {
            u.shares.push_back(share);
            if u.shares.len() > BASELINE_STEPS {
                u.shares.pop_front();
            }
        }
        let judged = Judged {
            step: w.step,
            start: w.start,
            end: w.end,
            dur,
            lost,
            excess,
            contended,
            usual,
            by,
        };
        if !advance(&mut self.runs, w.tgid, judged, cfg, &mut self.spans) {
            return;
        }
        let run = &self.runs[&w.tgid];
        let top = top_takers(&run.by);
        // Dated from its top preemptor's arrival among the job's ranks:
        // before the run when the share it took flickered under the bar,
        // after the run's first step when a blip of something else began
        // it (the finding is about what took the most).
        let came = top
            .first()
            .and_then(|(pid, _)| self.presence.get(ranks.job_of(w.tgid))?.get(pid));
        // Named by this rank's own step at that time.
        let (first_step, start) = match came {
            Some(p) => {
                let steps = self.recent_steps.get(&w.tgid);
                let own = steps
                    .and_then(|s| s.iter().rev().find(|(start, _)| *start <= p.first_start))
                    .or_else(|| steps.and_then(|s| s.front()))
                    .map_or(p.first_step, |(_, step)| *step);
                (own, p.first_start)
            }
            None => (run.first_step, run.start),
        };
        let per_step = run.lost / run.steps;
        let share = 100.0 * run.lost as f64 / run.dur.max(1) as f64;
        let job = ranks.job_of(w.tgid);
        let names = taker_names(&top, job, ranks);
        let who = ranks.describe(w.tgid);
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::HostContention,
            ranks: ranks.of(w.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step: Some(first_step),
            start_ns: start,
            end_ns: Some(run.end),
            summary: format!(
                "host_contention: {who}'s training thread lost {:.1} ms per step ({share:.0}% \
                 of its steps, usually {:.0}%) to other processes taking its CPU, {} steps in a \
                 row from step {}; most by {names}",
                ms(per_step),
                100.0 * run.usual_share,
                run.steps,
                first_step
            ),
            evidence: run
                .evidence(
                    first_step,
                    &top,
                    ranks,
                    json!({ "pid": w.tgid, "lost_share_pct": share }),
                )
                .with_thresholds(cfg),
            detected_ns: w.end,
        });
        let at = out.last().map(ReportedAs::of);
        if let Some(run) = self.runs.get_mut(&w.tgid) {
            run.reported_as = at;
        }
    }

    /// Where the reported runs got to.
    pub fn spans(&self) -> &RunSpans {
        &self.spans
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RankIdentity;
    use crate::sinks::detect::host_steps::{MainOffCpu, Taker};
    use crate::sinks::detect::step_marks::StepSource;

    const MS: u64 = 1_000_000;
    const STEP: u64 = 100 * MS;

    fn ranks(n: u32) -> Ranks {
        let mut r = Ranks::default();
        for rank in 0..n {
            r.identity(
                100 + rank,
                &RankIdentity::from_environ(format!("RANK={rank}\0XPUSCOPE_JOB=j\0").as_bytes()),
            );
        }
        r
    }

    /// Rank `rank`'s step `step` of 100 ms, its main thread preempted by
    /// each (pid, comm, ms).
    fn window(rank: u32, step: u64, takers: &[(u32, &str, u64)]) -> Window {
        let start = step * STEP;
        let mut t = start + MS;
        let off_cpu = takers
            .iter()
            .map(|&(pid, comm, ms)| {
                let i = MainOffCpu {
                    cpu: rank % 2,
                    start: t,
                    end: t + ms * MS,
                    asleep: false,
                    in_loader: false,
                    preempted_by: Some(Taker {
                        comm: comm.into(),
                        pid,
                        in_job: false,
                    }),
                };
                t += ms * MS + MS;
                i
            })
            .collect();
        Window {
            tgid: 100 + rank,
            step,
            source: StepSource::AllReduces,
            start,
            end: start + STEP,
            named_at: start + STEP,
            calls: Vec::new(),
            off_cpu,
            launches: None,
        }
    }

    /// Steps 0..30 of every rank, each taking `takers(rank, step)`.
    fn run(n: u32, takers: impl Fn(u32, u64) -> Vec<(u32, &'static str, u64)>) -> Vec<Finding> {
        let (ranks, cfg) = (ranks(n), HostDetectConfig::default());
        let mut d = ContentionDetector::default();
        let mut out = Vec::new();
        for step in 0..30 {
            for rank in 0..n {
                d.step_ended(
                    &window(rank, step, &takers(rank, step)),
                    &cfg,
                    &ranks,
                    &mut out,
                );
            }
        }
        out
    }

    /// What every rank loses alike (the launcher polling, a busy host) is
    /// the background, however large: no finding.
    #[test]
    fn a_background_every_rank_suffers_alike_is_not_contention() {
        let found = run(4, |_, step| vec![(9, "launcher", 15 + step % 3)]);
        assert!(found.is_empty(), "{found:#?}");
    }

    /// A neighbour on one rank's CPU from the first step: its peers do not
    /// suffer it, so it is found without a history of its own.
    #[test]
    fn a_neighbour_from_the_first_step_is_found_against_the_peers() {
        let found = run(4, |rank, _| match rank {
            1 => vec![(9, "launcher", 5), (77, "noisy", 20)],
            _ => vec![(9, "launcher", 5)],
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!((found[0].ranks.clone(), found[0].step), (vec![1], Some(0)));
        assert_eq!(found[0].evidence["preemptors"][0]["pid"], 77);
    }

    /// Blips at steps 4 and 7 (two quiet steps after each) do not date a
    /// neighbour that comes at step 10: the finding says step 10.
    #[test]
    fn blips_before_a_neighbour_do_not_date_it() {
        let found = run(4, |rank, step| {
            if rank == 2 && (step == 4 || step == 7 || step >= 10) {
                vec![(77, "noisy", 30)]
            } else {
                vec![]
            }
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!((found[0].ranks.clone(), found[0].step), (vec![2], Some(10)));
    }

    /// A neighbour that comes at step 10 but takes under the contention
    /// bar until step 14 (its share flickers on a CPU it shares with
    /// several ranks): dated step 10, when it came; the contended run's
    /// own first step is in the evidence.
    #[test]
    fn a_neighbour_is_dated_from_when_it_came() {
        let found = run(4, |rank, step| match (rank, step) {
            (2, 10..=13) => vec![(77, "noisy", 8)],
            (2, 14..) => vec![(77, "noisy", 30)],
            _ => vec![],
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!((found[0].ranks.clone(), found[0].step), (vec![2], Some(10)));
        assert_eq!(found[0].evidence["run_first_step"], 14);
        assert_eq!(found[0].start_ns, 10 * STEP);
    }

    /// A neighbour that takes a noticeable share of rank 1 from step 10
    /// and contends with rank 3 from step 14: rank 3's contention is dated
    /// from step 10, when the neighbour came among the job's ranks.
    #[test]
    fn a_neighbour_is_dated_from_when_it_came_to_any_rank() {
        let found = run(4, |rank, step| match (rank, step) {
            (1, 10..) => vec![(77, "noisy", 8)],
            (3, 14..) => vec![(77, "noisy", 30)],
            _ => vec![],
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!((found[0].ranks.clone(), found[0].step), (vec![3], Some(10)));
        assert_eq!(found[0].evidence["run_first_step"], 14);
    }

    /// Something else's blip at step 8, one quiet step, then a neighbour
    /// from step 10: the run began at the blip, the finding names the
    /// neighbour and the step it came.
    #[test]
    fn a_blip_of_another_process_just_before_does_not_date_the_neighbour() {
        let found = run(4, |rank, step| match (rank, step) {
            (2, 8) => vec![(55, "cron", 30)],
            (2, 10..) => vec![(77, "noisy", 30)],
            _ => vec![],
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!((found[0].ranks.clone(), found[0].step), (vec![2], Some(10)));
        assert_eq!(found[0].evidence["run_first_step"], 8);
        assert_eq!(found[0].evidence["preemptors"][0]["pid"], 77);
    }

    /// A neighbour that comes at step 12 on top of a background every
    /// rank has: found at step 12, its usual share in the evidence.
    #[test]
    fn a_neighbour_on_top_of_the_background_is_found_where_it_starts() {
        let found = run(4, |rank, step| {
            let mut t = vec![(9, "launcher", 15)];
            if rank == 2 && step >= 12 {
                t.push((77, "noisy", 30));
            }
            t
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!((found[0].ranks.clone(), found[0].step), (vec![2], Some(12)));
        let usual = found[0].evidence["usual_share_pct"].as_f64().unwrap();
        assert!((14.0..16.0).contains(&usual), "{usual}");
        assert!(
            found[0].summary.contains("usually 15%"),
            "{}",
            found[0].summary
        );
    }
    /// An outsider that takes every rank's CPU alike from step 10 (a
    /// process spinning on every CPU of the node): no rank suffers it more
    /// than its peers, so no rank's own judgement finds it; the job's
    /// steps, judged against the job's history, are one finding naming
    /// every rank, at step 10.
    #[test]
    fn an_outsider_every_rank_suffers_alike_is_one_job_level_finding() {
        let found = run(4, |_, step| {
            let mut t = vec![(9, "launcher", 3)];
            if step >= 10 {
                t.push((77, "hog", 25 + step % 3));
            }
            t
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        let f = &found[0];
        assert_eq!((f.ranks.clone(), f.step), (vec![0, 1, 2, 3], Some(10)));
        assert_eq!(f.evidence["scope"], "job");
        assert_eq!(f.evidence["preemptors"][0]["pid"], 77);
        assert_eq!(f.start_ns, 10 * STEP);
        assert!(
            f.summary
                .contains("every rank of job j (4 ranks on 2 CPUs)"),
            "{}",
            f.summary
        );
        // The launcher's 3 ms of 4 ranks' 100 ms steps on 2 CPUs.
        let usual = f.evidence["usual_share_pct"].as_f64().unwrap();
        assert!((5.0..7.0).contains(&usual), "{usual}");
        assert_eq!(f.evidence["cpus"], 2);
    }

    /// A usual taker that takes more in total than the outsider that
    /// came (the launcher polling hard) does not lead the finding: the
    /// outsider judged above its usual does, and dates it.
    #[test]
    fn the_outsider_above_its_usual_leads_the_job_level_finding() {
        let found = run(4, |_, step| {
            let mut t = vec![(9, "launcher", 30)];
            if step >= 10 {
                t.push((77, "hog", 20 + step % 3));
            }
            t
        });
        let job: Vec<_> = found
            .iter()
            .filter(|f| f.evidence["scope"] == "job")
            .collect();
        assert_eq!(job.len(), 1, "{found:#?}");
        assert_eq!(job[0].evidence["preemptors"][0]["pid"], 77);
        assert_eq!(job[0].evidence["preemptors"][1]["pid"], 9);
        assert_eq!(job[0].step, Some(10));
    }

    /// An outsider on the ranks of one CPU of two (half the job): not
    /// every rank alike, so no job-level finding; the ranks' own
    /// judgement finds it on the ranks it took from.
    #[test]
    fn an_outsider_on_half_the_ranks_is_not_job_level() {
        let found = run(8, |rank, step| match (rank % 2, step) {
            (1, 10..) => vec![(77, "noisy", 30)],
            _ => vec![],
        });
        assert!(
            found.iter().all(|f| f.evidence["scope"] != "job"),
            "{found:#?}"
        );
        assert!(!found.is_empty());
        assert!(
            found
                .iter()
                .all(|f| f.ranks.len() == 1 && f.ranks[0] % 2 == 1)
        );
    }

    /// The job's steps are judged without a rank that exited (it is no
    /// longer waited for) and the finding names the ranks left.
    #[test]
    fn a_rank_that_left_does_not_hold_the_job_s_steps() {
        let (ranks, cfg) = (ranks(3), HostDetectConfig::default());
        let mut d = ContentionDetector::default();
        let mut out = Vec::new();
        for step in 0..30 {
            for rank in 0..3 {
                if rank == 2 && step >= 4 {
                    continue;
                }
                let t = if step >= 10 {
                    vec![(77, "hog", 30)]
                } else {
                    vec![]
                };
                d.step_ended(&window(rank, step, &t), &cfg, &ranks, &mut out);
            }
            if step == 4 {
                d.forget(102);
            }
        }
        assert_eq!(out.len(), 1, "{out:#?}");
        assert_eq!((out[0].ranks.clone(), out[0].step), (vec![0, 1], Some(10)));
        assert_eq!(out[0].evidence["scope"], "job");
    }
}
