//! The detect sink: detectors over the record stream with a clock, each a
//! module of its own, turning what they see into [`Finding`]s (the
//! `xpuscope-findings/1` contract, `crate::model::finding`).
//!
//! - [`hang`]: a collective or sync in flight longer than `hang_timeout`
//!   (from the interpret stage's in-flight snapshots); for a collective,
//!   the members that never entered it, from the communicator's members
//!   and their sequence numbers; for a send, receive or sync, the peers
//!   it waits for point to point ([`p2p`]: sends and receives counted per
//!   peer).
//! - [`oom`]: a device allocation that failed for want of memory and that
//!   its retry did not get, its stack and the largest live sites.
//! - [`device_error`]: any other failure of a device call (a lost device,
//!   an illegal address, ...), once per process and status code.
//! - [`crash`]: a traced process killed by a signal.
//! - [`host`]: the host-side detectors over each rank's steps
//!   ([`host_steps`]): [`host_contention`], [`host_bound`], [`dataloader_stall`],
//!   [`memory_leak`].
//! - [`collective`]: `slow_rank`, `late_arrival` and `slow_link`, from
//!   the members' arrivals at each collective (communicator + seq).
//! - [`device_compute`]: `slow_rank` from the device activity: a rank
//!   whose compute kernels take longer than its peers' (the host cannot
//!   see it).
//! - [`gpu_health`]: `device_throttled` (a rank's GPU clocked below its
//!   peers') and `device_error` for a GPU's Xid or ECC errors, from NVML's
//!   samples (`crate::health`).
//!
//! The detectors are pure ([`Detectors`]: records and ticks in, findings
//! out). The sink sends each new finding back to the pipeline, which puts
//! it into the record stream: the trace renders it, metrics count it, the
//! flight recorder dumps on it. The sink's output is every finding.

pub mod collective;
#[cfg(test)]
mod collective_tests;
pub mod contention_runs;
pub mod crash;
pub mod dataloader_stall;
pub mod device_compute;
pub mod device_error;
pub mod gpu_health;
pub mod hang;
pub mod host;
pub mod host_bound;
pub mod host_config;
pub mod host_contention;
pub mod host_steps;
pub mod incidents;
#[cfg(test)]
mod incidents_tests;
pub mod job_contention;
pub mod memory_leak;
pub mod oom;
pub mod p2p;
#[cfg(test)]
mod p2p_tests;
pub mod run_spans;
pub mod step_marks;
#[cfg(test)]
mod tests;

use foldhash::HashMap;
use std::sync::mpsc::Sender;
use std::time::Duration;

use anyhow::Result;

use super::{Sink, SinkCounters};
use crate::model::{Finding, FindingKind, RankIdentity, Record};

/// Most findings kept for the end-of-run report (the stream carries all).
pub const MAX_FINDINGS: usize = 1_000;

/// Thresholds (config `detect.*`, `agent attach --hang-timeout`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DetectConfig {
    /// A collective or sync running longer than this is a hang.
    pub hang_timeout: Duration,
    /// The host-side detectors' thresholds.
    pub host: host_config::HostDetectConfig,
    /// `slow_rank`, `late_arrival`, `slow_link` (`collective`).
    pub collective: collective::CollectiveConfig,
    /// `device_throttled` (`gpu_health`).
    pub gpu: gpu_health::GpuHealthConfig,
}

pub const DEFAULT_HANG_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for DetectConfig {
    fn default() -> Self {
        Self {
            hang_timeout: DEFAULT_HANG_TIMEOUT,
            host: host_config::HostDetectConfig::default(),
            collective: collective::CollectiveConfig::default(),
            gpu: gpu_health::GpuHealthConfig::default(),
        }
    }
}

/// Who a process is in the job: its global rank, from its environment;
/// and where it is in the job, by its own step markers.
#[derive(Default)]
pub struct Ranks {
    by_tgid: HashMap<u32, u32>,
    /// Its job label ([`crate::model::identity::job_label`]), where it has one.
    jobs: HashMap<u32, String>,
    /// The job's step markers, per process.
    pub marks: step_marks::StepMarks,
    /// Each job's current run: the ranks seen in it, kept after their
    /// processes ended (a crashed rank's finding still names its run).
    runs: HashMap<String, JobRun>,
    /// Bumped at every identity (which run was touched last).
    touches: u64,
}

/// One run of a job: from its first rank's identity until a rank it has
/// seen appears again in a new process (the job restarted).
struct JobRun {
    generation: u32,
    ranks: std::collections::BTreeSet<u32>,
    /// Its processes with a rank that have not ended.
    live: std::collections::BTreeSet<u32>,
    /// When its last process ended.
    ended_at: Option<u64>,
    touched: u64,
}

/// How long after its last process ended a run still owns the findings
/// made about it (those made at the exits themselves, a late verdict).
const ENDED_RUN_GRACE_NS: u64 = 60_000_000_000;

/// Jobs whose runs are remembered; past it the least recently seen goes.
const MAX_JOB_RUNS: usize = 1024;

impl Ranks {
    /// Records `tgid`'s identity; whether it is new (not a repeat).
    fn identity(&mut self, tgid: u32, id: &RankIdentity) -> bool {
        let mut new = false;
        let rank = id.rank.as_deref().and_then(|r| r.trim().parse().ok());
        if let Some(r) = rank {
            new = self.by_tgid.insert(tgid, r) != Some(r);
        }
        if let Some(j) = &id.job {
            self.jobs.insert(tgid, j.clone());
        }
        if let Some(r) = rank
            && new
        {
            self.note_run(tgid, r);
        }
        new
    }

    /// A new process holds rank `r` of its job: the job's run goes on, or
    /// a new one begins if the rank was seen in this run already.
    fn note_run(&mut self, tgid: u32, r: u32) {
        self.touches += 1;
        let job = self.job_of(tgid).to_string();
        if !self.runs.contains_key(&job) && self.runs.len() >= MAX_JOB_RUNS {
            let oldest = self
                .runs
                .iter()
                .min_by_key(|(_, run)| run.touched)
                .map(|(j, _)| j.clone());
            if let Some(j) = oldest {
                self.runs.remove(&j);
            }
        }
        let run = self.runs.entry(job).or_insert_with(|| JobRun {
            generation: 0,
            ranks: Default::default(),
            live: Default::default(),
            ended_at: None,
            touched: 0,
        });
        run.touched = self.touches;
        if !run.ranks.insert(r) {
            run.generation += 1;
            run.ranks.clear();
            run.ranks.insert(r);
        }
        run.live.insert(tgid);
        run.ended_at = None;
    }

    /// The job and run that ranks `ranks` belong to, for a finding made
    /// at `at`: the one job whose current run has seen them all and is
    /// running (or ended less than [`ENDED_RUN_GRACE_NS`] before); None
    /// when none is, or when two jobs are (their ranks are numbered alike).
    pub fn run_of(&self, ranks: &[u32], at: u64) -> Option<(String, u32)> {
        if ranks.is_empty() {
            return None;
        }
        let mut holding = self.runs.iter().filter(|(_, run)| {
            let current = !run.live.is_empty()
                || run
                    .ended_at
                    .is_some_and(|end| at <= end.saturating_add(ENDED_RUN_GRACE_NS));
            current && ranks.iter().all(|r| run.ranks.contains(r))
        });
        let (job, run) = holding.next()?;
        holding
            .next()
            .is_none()
            .then(|| (job.clone(), run.generation))
    }

    pub fn of(&self, tgid: u32) -> Option<u32> {
        self.by_tgid.get(&tgid).copied()
    }

    /// The job label of `tgid` ("" for a process without one: the
    /// unlabelled processes are taken as one job).
    pub fn job_of(&self, tgid: u32) -> &str {
        self.jobs.get(&tgid).map(String::as_str).unwrap_or("")
    }

    /// The job label of the process with global rank `rank`.
    pub fn job_of_rank(&self, rank: u32) -> Option<&str> {
        let tgid = self.by_tgid.iter().find(|(_, r)| **r == rank)?.0;
        Some(self.job_of(*tgid))
    }

    /// The process with global rank `rank` in job `job`.
    pub fn tgid_of_rank(&self, rank: u32, job: &str) -> Option<u32> {
        self.by_tgid
            .iter()
            .filter(|(t, r)| **r == rank && self.job_of(**t) == job)
            .map(|(t, _)| *t)
            .min()
    }

    /// `tgid` ended at `ts`.
    fn forget(&mut self, tgid: u32, ts: u64) {
        if let Some(run) = self
            .runs
            .get_mut(self.jobs.get(&tgid).map_or("", String::as_str))
            && run.live.remove(&tgid)
            && run.live.is_empty()
        {
            run.ended_at = Some(ts);
        }
        self.by_tgid.remove(&tgid);
        self.jobs.remove(&tgid);
        self.marks.forget(tgid);
    }

    /// `tgid`'s step at `ts` by its own markers, when it marks them.
    pub fn marked_step(&self, tgid: u32, ts: u64) -> Option<u64> {
        self.marks.step_at(tgid, ts)
    }

    /// "rank 3" or "pid 1234" when the process has no rank.
    pub fn describe(&self, tgid: u32) -> String {
        match self.of(tgid) {
            Some(r) => format!("rank {r}"),
            None => format!("pid {tgid}"),
        }
    }
}

/// Every detector, fed in stream order.
pub struct Detectors {
    ranks: Ranks,
    hang: hang::HangDetector,
    oom: oom::OomDetector,
    device_error: device_error::DeviceErrorDetector,
    crash: crash::CrashDetector,
    host: host::HostDetectors,
    collective: collective::CollectiveDetector,
    device_compute: device_compute::DeviceComputeDetector,
    gpu_health: gpu_health::GpuHealthDetector,
    /// Step boundaries of the record at hand (scratch).
    marks: Vec<step_marks::StepMark>,
}

impl Detectors {
    /// The ranks' steps finished since the last call, split by where their
    /// main threads spent them.
    pub fn take_step_splits(&mut self) -> Vec<crate::model::StepSplitRecord> {
        self.host.take_splits()
    }

    pub fn new(cfg: DetectConfig) -> Self {
        Self {
            ranks: Ranks::default(),
            hang: hang::HangDetector::new(cfg.hang_timeout),
            oom: oom::OomDetector::default(),
            device_error: device_error::DeviceErrorDetector::default(),
            crash: crash::CrashDetector::default(),
            host: host::HostDetectors::new(cfg.host),
            device_compute: device_compute::DeviceComputeDetector::new(
                cfg.collective.slow_compute_pct,
                cfg.collective.slow_rank_persist,
            ),
            collective: collective::CollectiveDetector::new(cfg.collective),
            gpu_health: gpu_health::GpuHealthDetector::new(cfg.gpu),
            marks: Vec::new(),
        }
    }

    pub fn record(&mut self, r: &Record, out: &mut Vec<Finding>) {
        // Most records are switches and wakeups, which no detector reads
        // (the host detectors take the off-CPU intervals built from them):
        // they leave before any call (three calls a record showed in the
        // agent's CPU per event).
        if matches!(r, Record::Switch { .. } | Record::Waking(_)) {
            return;
        }
        let first_new = out.len();
        self.record_inner(r, out);
        note_step_source(&mut out[first_new..]);
    }

    fn record_inner(&mut self, r: &Record, out: &mut Vec<Finding>) {
        let first_new = out.len();
        if let Record::Identity { tgid, identity } = r
            && self.ranks.identity(*tgid, identity)
        {
            // A new rank of a job that was in trouble: the job restarted.
            self.crash.job_restarted(self.ranks.job_of(*tgid));
        }
        if let Record::StepSeen(seen) = r {
            self.ranks.marks.step_seen(seen);
        }
        if let Record::DeviceCall(c) = r {
            self.marks.clear();
            self.ranks.marks.device_call(c, &mut self.marks);
            self.host.step_marks(&self.marks, &self.ranks, out);
        }
        self.host.record(r, &self.ranks, out);
        match r {
            Record::DeviceCall(c) => {
                self.hang.device_call(c);
                self.oom.device_call(c, &self.ranks, out);
                if device_error::device_error_code(c).is_some() {
                    let step = self
                        .collective
                        .step_of(c.call.tgid, c.call.start_ts, &self.ranks);
                    self.device_error.device_call(c, step, &self.ranks, out);
                }
                self.collective.device_call(c, &self.ranks, out);
                self.device_compute.device_call(
                    c,
                    &self.ranks,
                    &mut self.collective.slow_reported,
                    out,
                );
            }
            Record::DeviceWork(w) => {
                self.collective.device_work(w);
                self.device_compute
                    .device_work(w, &mut self.collective.slow_reported, out)
            }
            Record::Enqueued(m) => self.collective.enqueued(m),
            Record::GpuSample(s) => {
                let (collective, ranks) = (&self.collective, &self.ranks);
                let step_of = |pid: u32, ts: u64| collective.step_of(pid, ts, ranks);
                self.gpu_health.sample(s, ranks, &step_of, out);
            }
            Record::GpuXid(x) => {
                let (collective, ranks) = (&self.collective, &self.ranks);
                let step_of = |pid: u32, ts: u64| collective.step_of(pid, ts, ranks);
                self.gpu_health.xid(x, ranks, &step_of, out);
            }
            Record::InFlight(s) => self.hang.snapshot(s),
            Record::Exit {
                exit,
                process_ended: true,
            } => {
                // First: a failed allocation it never got explains a crash.
                self.oom.process_ended(exit.tgid, exit.ts, &self.ranks, out);
                let step = self.collective.step_of(exit.tgid, exit.ts, &self.ranks);
                self.crash.process_ended(exit, step, &self.ranks, out);
                self.hang.process_ended(exit.tgid);
                self.device_error.process_ended(exit.tgid);
                // Before the collective detector forgets who was slow.
                self.device_compute.process_ended(
                    exit.tgid,
                    &mut self.collective.slow_reported,
                    out,
                );
                self.collective
                    .process_ended(exit.tgid, exit.ts, &self.ranks, out);
            }
            _ => {}
        }
        self.crash.note_trouble(&out[first_new..], &self.ranks);
        if let Record::Exit {
            exit,
            process_ended: true,
        } = r
        {
            // Last: the findings above named it by its rank and job.
            self.ranks.forget(exit.tgid, exit.ts);
        }
    }

    #[cfg(test)]
    pub fn hang_state_is_empty_for(&self, tgid: u32) -> bool {
        self.hang.forgot(tgid)
            && self.oom.forgot(tgid)
            && self.device_error.forgot(tgid)
            && self.collective.forgot(tgid)
            && self.host.forgot(tgid)
            && self.device_compute.forgot(tgid)
            && self.ranks.of(tgid).is_none()
    }

    /// Time passed: detectors that fire on a duration look again.
    pub fn tick(&mut self, now: u64, out: &mut Vec<Finding>) {
        let first_new = out.len();
        self.hang.tick(now, &self.ranks, out);
        self.date_hangs(&mut out[first_new..]);
        self.oom.tick(now, &self.ranks, out);
        self.collective.tick(now, &self.ranks, out);
        self.crash.note_trouble(&out[first_new..], &self.ranks);
        note_step_source(&mut out[first_new..]);
    }

    /// A hang's step: the step the rank that never entered (or, without
    /// one, the first peer waited for point to point) was in when its
    /// peers began waiting (its all-reduces before then, or its own step
    /// markers), else the stuck member's; the same online and offline (the
    /// offline snapshots have no main threads, so the rank is looked up).
    fn date_hangs(&self, found: &mut [Finding]) {
        for f in found
            .iter_mut()
            .filter(|f| f.kind == FindingKind::Hang && f.step.is_none())
        {
            let stuck = &f.evidence["stuck"][0];
            let (Some(pid), Some(since)) = (stuck["pid"].as_u64(), stuck["since_ns"].as_u64())
            else {
                continue;
            };
            let pid = pid as u32;
            let missing = f.evidence["never_entered"][0]
                .as_u64()
                .or_else(|| f.evidence["p2p_waits"][0]["peer"].as_u64())
                .and_then(|r| self.ranks.tgid_of_rank(r as u32, self.ranks.job_of(pid)));
            f.step = self
                .collective
                .step_of(missing.unwrap_or(pid), since, &self.ranks);
        }
    }

    /// Once the run's findings are all known: each finding of a run of
    /// steps that went on after it fired (a contention still taking the
    /// job's CPU) spans the whole run, so that what came later in it is
    /// grouped under it.
    pub fn extend_spans(&self, found: &mut [Finding]) {
        self.host.extend_spans(found);
    }

    /// The end: what waits for more evidence is reported as it stands.
    pub fn finish(&mut self, end: u64, out: &mut Vec<Finding>) {
        self.tick(end, out);
        let first_new = out.len();
        self.oom.finish(end, &self.ranks, out);
        self.crash.note_trouble(&out[first_new..], &self.ranks);
        self.collective.finish(end, &self.ranks, out);
        note_step_source(&mut out[first_new..]);
    }
}

/// Where the findings' step numbers come from (evidence `step_source`):
/// the job's own step markers where the rank has them (the detector that
/// dated the finding by them says so), otherwise its gradient all-reduces:
/// the detectors count a rank's steps by the all-reduces it entered on its
/// data-parallel communicator.
pub const STEP_SOURCE: &str = step_marks::STEP_SOURCE_ALLREDUCE;

fn note_step_source(found: &mut [Finding]) {
    for f in found.iter_mut() {
        if let Some(e) = f.evidence.as_object_mut() {
            if f.step.is_some() {
                e.entry("step_source").or_insert_with(|| STEP_SOURCE.into());
            } else {
                e.remove("step_source");
            }
        }
    }
}

/// The sink around [`Detectors`].
pub struct DetectSink {
    detectors: Detectors,
    /// Back into the pipeline (None: kept only for the output): each
    /// finding, and each rank's step split.
    feedback: Option<Sender<Record>>,
    found: Vec<Finding>,
    scratch: Vec<Finding>,
    /// The latest findings with the run of the job they belong to: what a
    /// new finding may follow from (see [`Self::link`]).
    recent: std::collections::VecDeque<(Finding, (String, u32))>,
}

/// Findings a new one is checked against for what it follows from.
const RECENT_FINDINGS: usize = 256;

/// How long before a new finding another can be what it follows from: a
/// fault's consequences come out within the hang timeout (default 5
/// minutes) of it; a finding of the same run much later is a fault of its
/// own (the same rank hanging again an hour on), and dumps.
const RECENT_WINDOW_NS: u64 = 15 * 60 * 1_000_000_000;

impl DetectSink {
    pub fn new(cfg: DetectConfig, feedback: Option<Sender<Record>>) -> Self {
        Self {
            detectors: Detectors::new(cfg),
            feedback,
            found: Vec::new(),
            scratch: Vec::new(),
            recent: Default::default(),
        }
    }

    /// Links the findings made now to what explains them among the
    /// latest findings of the same run of their job (of the last
    /// [`RECENT_WINDOW_NS`]) and each other, as
    /// [`incidents::group`] would judge them ([`incidents::causes`]): the
    /// stream's consumers (the service's log, dumps and metrics) then take
    /// a consequence as such, not as a fault of its own. Findings made
    /// together (a hung job's members, found at one tick) are judged
    /// together, whichever came out first; an earlier finding stays as it
    /// went out. Findings whose job is not known for sure (two jobs
    /// numbering their ranks alike) stand alone, as does one rank's
    /// lateness where only another rank's explains it
    /// ([`incidents::streamed_link_holds`]).
    fn link(&mut self, made: &mut [Finding]) {
        let runs: Vec<Option<(String, u32)>> = made
            .iter()
            .map(|f| self.detectors.ranks.run_of(&f.ranks, f.detected_ns))
            .collect();
        let latest = made.iter().map(|f| f.detected_ns).max().unwrap_or(0);
        let mut judged: Vec<&(String, u32)> = Vec::new();
        for run in runs.iter().flatten() {
            if judged.contains(&run) {
                continue;
            }
            judged.push(run);
            let earlier: Vec<&Finding> = self
                .recent
                .iter()
                .filter(|(g, r)| {
                    r == run && g.detected_ns.saturating_add(RECENT_WINDOW_NS) >= latest
                })
                .map(|(g, _)| g)
                .collect();
            let now: Vec<usize> = (0..made.len())
                .filter(|&k| runs[k].as_ref() == Some(run))
                .collect();
            let together: Vec<Finding> = earlier
                .iter()
                .map(|g| (*g).clone())
                .chain(now.iter().map(|&k| made[k].clone()))
                .collect();
            let causes = incidents::causes_where(&together, incidents::streamed_link_holds);
            for (pos, &k) in now.iter().enumerate() {
                if let Some(c) = causes[earlier.len() + pos] {
                    made[k].link.follows_from = Some(together[c].headline());
                }
            }
        }
        for (f, run) in made.iter().zip(runs) {
            if let Some(run) = run {
                if self.recent.len() == RECENT_FINDINGS {
                    self.recent.pop_front();
                }
                self.recent.push_back((f.clone(), run));
            }
        }
    }

    fn publish(&mut self) {
        let mut made = std::mem::take(&mut self.scratch);
        self.link(&mut made);
        for f in made.drain(..) {
            match &f.link.follows_from {
                None => tracing::warn!("finding: {}", f.summary),
                Some(cause) => tracing::info!("finding: {} (follows from {cause})", f.summary),
            }
            if let Some(tx) = &self.feedback {
                // The pipeline is gone at the very end: the output has it.
                let _ = tx.send(Record::Finding(Box::new(f.clone())));
            }
            if self.found.len() < MAX_FINDINGS {
                self.found.push(f);
            }
        }
        self.scratch = made;
        let splits = self.detectors.take_step_splits();
        if let Some(tx) = &self.feedback {
            for s in splits {
                let _ = tx.send(Record::StepSplit(Box::new(s)));
            }
        }
    }
}

impl Sink for DetectSink {
    type Output = Vec<Finding>;

    fn on_batch(&mut self, batch: &[Record], _lost: &SinkCounters) -> Result<()> {
        for r in batch {
            self.detectors.record(r, &mut self.scratch);
        }
        self.publish();
        Ok(())
    }

    fn on_tick(&mut self, now: u64, _lost: &SinkCounters) -> Result<()> {
        self.detectors.tick(now, &mut self.scratch);
        self.publish();
        Ok(())
    }

    fn finish(mut self, end: u64, _lost: &SinkCounters) -> Result<Vec<Finding>> {
        self.detectors.finish(end, &mut self.scratch);
        self.publish();
        // The run's findings are all known: each spans its whole run, and
        // goes under its fault.
        self.detectors.extend_spans(&mut self.found);
        incidents::group(&mut self.found);
        Ok(self.found)
    }
}
