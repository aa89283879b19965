//! The flight recorder: the decoded records of the last `window` kept in
//! memory, bounded in bytes, dumped to a Perfetto trace on request.
//!
//! - Keeping: the fan-out's shared batches are kept as they are (`Arc`,
//!   no copy). Records older than the window expire from the front; past
//!   `max_bytes` the oldest batches are evicted whole (a batch's memory is
//!   freed only when none of it is kept), counted as evictions. What
//!   leaves the front is applied to a [`state::ProcessTable`] (processes,
//!   threads, names, rank identities), so any window renders on its own.
//!   Each batch is read once when it comes ([`state::BatchSummary`]: its
//!   latest time, its bytes, whether it changes the table); a batch that
//!   leaves whole is read again only if it changes the table.
//! - Dumping: a [`DumpRequest`] arrives on a channel; the recorder checks
//!   the rate limit, clones the window's batch handles and the table, and
//!   a thread of its own renders them through the Perfetto sink
//!   ([`dump`]). Recording never waits for a dump. A window may end in the
//!   future (`--after`, `--at`): the request waits until records past its
//!   end arrived (or a tick passed it).
//!
//! Memory is estimated as each batch's record slots plus what its records
//! own on the heap ([`state::BatchSummary`]); shared allocations (stacks,
//! allocation sites) count by their share. A dump in progress holds its
//! batches until it ends, so memory can exceed the bound by one window
//! while a dump renders.

pub mod dump;
pub mod limits;
pub mod state;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

use super::{Batch, Sink, SinkCounters};
use crate::model::{Finding, FindingKind, Record};
pub use dump::{DumpError, DumpOutcome};
use dump::{DumpJob, check_job_label};
use limits::DumpLimits;
pub use limits::Retention;
use state::{BatchSummary, ProcessTable, span};

/// Why a dump was taken (its name's last part).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Trigger {
    /// `agent ctl dump`.
    Manual,
    /// A collective or sync in flight longer than the hang timeout.
    Hang,
    /// A device allocation failed.
    Oom,
    /// A traced process was killed by a signal.
    Signal,
    /// A performance finding: a slow or late rank, a slow link, host
    /// contention, a data-loader stall, a leak (the job runs on; the dump
    /// holds what led to it).
    Slowdown,
}

impl Trigger {
    pub const ALL: [Trigger; 5] = [
        Trigger::Manual,
        Trigger::Hang,
        Trigger::Oom,
        Trigger::Signal,
        Trigger::Slowdown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Manual => "manual",
            Trigger::Hang => "hang",
            Trigger::Oom => "oom",
            Trigger::Signal => "signal",
            Trigger::Slowdown => "slowdown",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// When a dump's window ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowEnd {
    Now,
    /// This long after the request.
    After(Duration),
    /// At this CLOCK_BOOTTIME instant (from a wall-clock time).
    At(u64),
}

/// What to dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpSpec {
    pub trigger: Trigger,
    /// Only this job's processes (and the CPUs' scheduling).
    pub job: Option<String>,
    /// The window's length; None: all the recorder keeps.
    pub seconds: Option<Duration>,
    pub end: WindowEnd,
}

impl DumpSpec {
    /// The whole window, ending now (the automatic triggers' dump).
    #[cfg(test)]
    pub fn now(trigger: Trigger) -> Self {
        Self {
            trigger,
            job: None,
            seconds: None,
            end: WindowEnd::Now,
        }
    }
}

pub type DumpReply = Sender<Result<DumpOutcome, DumpError>>;

pub struct DumpRequest {
    pub spec: DumpSpec,
    /// Where the outcome goes (None: logged and counted only).
    pub reply: Option<DumpReply>,
    /// The finding that triggered it (named in the dump's summary).
    pub finding: Option<Box<Finding>>,
}

impl Trigger {
    /// The automatic dump's trigger for a finding: every kind dumps (a
    /// performance finding too: the window shows what led to it), each
    /// trigger rate-limited on its own.
    pub fn of_finding(kind: FindingKind) -> Trigger {
        match kind {
            FindingKind::Hang => Trigger::Hang,
            // A device that failed: the same dump as its memory failing.
            FindingKind::DeviceOom | FindingKind::DeviceError => Trigger::Oom,
            FindingKind::Crash => Trigger::Signal,
            FindingKind::HostContention
            | FindingKind::HostBound
            | FindingKind::DataloaderStall
            | FindingKind::MemoryLeak
            | FindingKind::SlowRank
            | FindingKind::LateArrival
            | FindingKind::SlowLink
            | FindingKind::DeviceThrottled => Trigger::Slowdown,
        }
    }
}

/// The recorder's settings (from the service configuration).
#[derive(Clone, Debug)]
pub struct RecorderSettings {
    pub window: Duration,
    pub max_bytes: u64,
    pub dump_dir: PathBuf,
    pub dump_dir_max_bytes: u64,
    pub max_dumps_per_hour: u32,
    /// The node's name in dump names.
    pub host: String,
    /// Testing aid: dumps see a full disk after this many bytes.
    pub write_limit: Option<u64>,
    /// A finding in the stream dumps the window (trigger by its kind).
    pub dump_on_finding: bool,
}

/// Dumps of one trigger.
#[derive(Debug, Default)]
pub struct TriggerCounts {
    pub written: AtomicU64,
    /// Written but cut short (a full disk): still valid traces.
    pub truncated: AtomicU64,
    pub failed: AtomicU64,
    pub rate_limited: AtomicU64,
}

/// The recorder's accounting, shared with metrics and the control API.
#[derive(Debug, Default)]
pub struct RecorderStats {
    /// Estimated bytes held.
    pub bytes: AtomicU64,
    /// Records held.
    pub records: AtomicU64,
    /// Records evicted by the byte bound (they were still in the window).
    pub evicted_records: AtomicU64,
    pub evicted_bytes: AtomicU64,
    /// Records that aged out of the window (not a loss).
    pub expired_records: AtomicU64,
    /// Per [`Trigger`], in [`Trigger::ALL`] order.
    pub dumps: [TriggerCounts; Trigger::ALL.len()],
    /// The last dump written (for status).
    pub last_dump: Mutex<Option<DumpOutcome>>,
}

impl RecorderStats {
    pub fn trigger(&self, t: Trigger) -> &TriggerCounts {
        &self.dumps[t.index()]
    }
}

/// A kept batch: the shared records from `first` on.
struct Kept {
    batch: Batch,
    first: usize,
    summary: BatchSummary,
}

pub struct FlightRecorder {
    settings: RecorderSettings,
    kept: VecDeque<Kept>,
    bytes: u64,
    records: u64,
    /// State before the oldest kept record.
    table: ProcessTable,
    /// The latest time seen (records, ticks).
    now: u64,
    /// The end of the newest record evicted by the byte bound.
    evicted_until: Option<u64>,
    requests: Receiver<DumpRequest>,
    /// Requests whose window has not ended yet: (end, request).
    pending: Vec<(u64, DumpRequest)>,
    limits: DumpLimits,
    /// Each kept process's job label (its latest identity), for the rate
    /// limits; dropped when its exit leaves the window.
    jobs: HashMap<u32, String>,
    /// The recorder's own losses (records the fan-out dropped while it
    /// lagged) in the window: (time seen, count), oldest first.
    losses: VecDeque<(u64, u64)>,
    /// The fan-out's count of the recorder's lost records when last read.
    lost_seen: u64,
    stats: Arc<RecorderStats>,
    renders: Vec<JoinHandle<()>>,
}

impl FlightRecorder {
    /// A recorder, the sender for its dump requests, and its counters.
    pub fn new(settings: RecorderSettings) -> (Self, Sender<DumpRequest>, Arc<RecorderStats>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let stats = Arc::new(RecorderStats::default());
        let recorder = Self {
            limits: DumpLimits::new(settings.max_dumps_per_hour),
            jobs: HashMap::new(),
            losses: VecDeque::new(),
            lost_seen: 0,
            settings,
            kept: VecDeque::new(),
            bytes: 0,
            records: 0,
            table: ProcessTable::default(),
            now: 0,
            evicted_until: None,
            requests: rx,
            pending: Vec::new(),
            stats: stats.clone(),
            renders: Vec::new(),
        };
        (recorder, tx, stats)
    }

    fn window_ns(&self) -> u64 {
        self.settings.window.as_nanos() as u64
    }

    fn keep(&mut self, batch: &Batch) {
        let summary = BatchSummary::of(batch, batch.capacity());
        if let Some(last) = summary.end {
            self.now = self.now.max(last);
        }
        self.bytes += summary.bytes;
        self.records += batch.len() as u64;
        self.kept.push_back(Kept {
            batch: batch.clone(),
            first: 0,
            summary,
        });
        if summary.changes_table {
            for r in batch.iter() {
                if let Record::Identity { tgid, identity } = r
                    && let Some(job) = &identity.job
                {
                    self.jobs.insert(*tgid, job.clone());
                }
            }
        }
        if self.settings.dump_on_finding {
            // The window ends at the finding's detection (the latest time
            // seen): the dump holds what led to it, and the finding. One
            // dump per trigger and batch: findings come out together (every
            // member of a hung collective at the same tick), and one window
            // holds them all (its summary lists every finding in it). A
            // finding that follows from an earlier one (a peer that waited
            // for the slow rank) is that fault's consequence: the fault's
            // own dump holds what led to both.
            let mut triggers = Vec::new();
            for r in batch.iter() {
                if let Record::Finding(f) = r
                    && f.link.follows_from.is_none()
                {
                    let trigger = Trigger::of_finding(f.kind);
                    if triggers.contains(&trigger) {
                        continue;
                    }
                    triggers.push(trigger);
                    self.pending.push((
                        self.now,
                        DumpRequest {
                            spec: DumpSpec {
                                trigger,
                                job: None,
                                seconds: None,
                                end: WindowEnd::Now,
                            },
                            reply: None,
                            finding: Some(f.clone()),
                        },
                    ));
                }
            }
        }
        self.expire();
        self.evict_to_bound();
        self.publish();
    }

    /// Drops records that ended before the window (front first, in stream
    /// order: a late record stays until those before it go).
    fn expire(&mut self) {
        let horizon = self.now.saturating_sub(self.window_ns());
        while self.losses.front().is_some_and(|(ts, _)| *ts < horizon) {
            self.losses.pop_front();
        }
        while let Some(front) = self.kept.front_mut() {
            // Wholly before the window: it goes without a look at each
            // record unless one of them changes the table.
            if front.summary.end.is_none_or(|end| end < horizon) {
                let left = (front.batch.len() - front.first) as u64;
                if front.summary.changes_table {
                    for r in &front.batch[front.first..] {
                        Self::leave_table(&mut self.table, &mut self.jobs, r);
                    }
                }
                self.records -= left;
                self.stats
                    .expired_records
                    .fetch_add(left, Ordering::Relaxed);
                self.bytes -= front.summary.bytes;
                self.kept.pop_front();
                continue;
            }
            while let Some(r) = front.batch.get(front.first) {
                match span(r) {
                    Some((_, end)) if end >= horizon => break,
                    _ => {}
                }
                Self::leave_table(&mut self.table, &mut self.jobs, r);
                front.first += 1;
                self.records -= 1;
                self.stats.expired_records.fetch_add(1, Ordering::Relaxed);
            }
            if front.first < front.batch.len() {
                return;
            }
            self.bytes -= front.summary.bytes;
            self.kept.pop_front();
        }
    }

    /// A record leaves the window: its effect goes into the table.
    fn leave_table(table: &mut ProcessTable, jobs: &mut HashMap<u32, String>, r: &Record) {
        if let Record::Exit {
            exit,
            process_ended: true,
        } = r
        {
            // Unless a later process with the same pid has an identity in
            // the window (pids are reused).
            let ours = table
                .identities
                .get(&exit.tgid)
                .and_then(|i| i.job.as_ref());
            if ours.is_none() || ours == jobs.get(&exit.tgid) {
                jobs.remove(&exit.tgid);
            }
        }
        table.apply(r);
    }

    /// Notes records the fan-out dropped for this sink since the last
    /// look: they belong to the window a dump shows.
    fn note_losses(&mut self, lost: &SinkCounters) {
        let n = lost.dropped();
        if n > self.lost_seen {
            self.losses.push_back((self.now, n - self.lost_seen));
            self.lost_seen = n;
        }
    }

    /// Evicts whole batches, oldest first, until the bound holds.
    fn evict_to_bound(&mut self) {
        while self.bytes > self.settings.max_bytes {
            let Some(front) = self.kept.pop_front() else {
                return;
            };
            let rest = &front.batch[front.first..];
            if front.summary.changes_table {
                for r in rest {
                    Self::leave_table(&mut self.table, &mut self.jobs, r);
                }
            }
            // The batch's latest end: its records' from `first` on, or
            // one of those expired before (ended earlier than any left).
            if let Some(end) = front.summary.end {
                self.evicted_until = Some(self.evicted_until.unwrap_or(0).max(end));
            }
            let evicted = rest.len() as u64;
            self.bytes -= front.summary.bytes;
            self.records -= evicted;
            self.stats
                .evicted_records
                .fetch_add(evicted, Ordering::Relaxed);
            self.stats
                .evicted_bytes
                .fetch_add(front.summary.bytes, Ordering::Relaxed);
        }
    }

    fn publish(&self) {
        self.stats.bytes.store(self.bytes, Ordering::Relaxed);
        self.stats.records.store(self.records, Ordering::Relaxed);
    }

    /// Takes new requests; starts those whose window has ended.
    fn serve_requests(&mut self) {
        while let Ok(req) = self.requests.try_recv() {
            // The recorder's clock is the latest time its records and
            // ticks told it.
            let end = match req.spec.end {
                WindowEnd::Now => self.now,
                WindowEnd::After(d) => self.now + d.as_nanos() as u64,
                WindowEnd::At(t) => t,
            };
            self.pending.push((end, req));
        }
        let now = self.now;
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(end, _)| *end <= now);
        self.pending = waiting;
        for (end, req) in due {
            self.start_dump(end, req);
        }
    }

    fn start_dump(&mut self, end: u64, req: DumpRequest) {
        let counts = self.stats.trigger(req.spec.trigger);
        let reply = |result: Result<DumpOutcome, DumpError>| {
            if let Some(tx) = &req.reply {
                let _ = tx.send(result);
            }
        };
        let seconds = req.spec.seconds.unwrap_or(self.settings.window);
        if seconds > self.settings.window || seconds.is_zero() {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            return reply(Err(DumpError::BadRequest(format!(
                "a window of {seconds:?} is not available: the recorder keeps the last {:?}",
                self.settings.window
            ))));
        }
        if let Some(job) = &req.spec.job
            && let Err(e) = check_job_label(job)
        {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            return reply(Err(DumpError::BadRequest(e)));
        }
        // The job the limits count it against: the one asked for, else
        // the job of the process its finding names.
        let job_key = req
            .spec
            .job
            .clone()
            .or_else(|| {
                let pid = req.finding.as_ref()?.evidence.get("pid")?.as_u64()?;
                self.jobs.get(&u32::try_from(pid).ok()?).cloned()
            })
            .unwrap_or_default();
        let retention = match self.limits.take(req.spec.trigger, &job_key, Instant::now()) {
            Ok(r) => r,
            Err(refused) => {
                counts.rate_limited.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "flight recorder: {} dump refused by the rate limit of {} {} per hour",
                    req.spec.trigger.as_str(),
                    refused.per_hour,
                    refused.scope
                );
                return reply(Err(DumpError::RateLimited {
                    per_hour: refused.per_hour,
                    scope: refused.scope,
                    retry_after: refused.retry_after,
                }));
            }
        };
        let start = end.saturating_sub(seconds.as_nanos() as u64);
        let recorder_losses: Vec<(u64, u64)> = self
            .losses
            .iter()
            .filter(|(ts, _)| (start..=end).contains(ts))
            .copied()
            .collect();
        let job = DumpJob {
            finding: req.finding,
            trigger: req.spec.trigger,
            retention,
            recorder_losses,
            job: req.spec.job.clone(),
            start,
            end,
            table: self.table.clone(),
            batches: self
                .kept
                .iter()
                .map(|k| (k.batch.clone(), k.first))
                .collect(),
            evicted_until: self.evicted_until,
            dir: self.settings.dump_dir.clone(),
            dir_max_bytes: self.settings.dump_dir_max_bytes,
            host: self.settings.host.clone(),
            write_limit: self.settings.write_limit,
        };
        let stats = self.stats.clone();
        let trigger = req.spec.trigger;
        let reply_tx = req.reply;
        let spawned = std::thread::Builder::new()
            .name("xpuscope-dump".into())
            .spawn(move || {
                let result = job.write();
                let counts = stats.trigger(trigger);
                match &result {
                    Ok(o) => {
                        counts.written.fetch_add(1, Ordering::Relaxed);
                        if let Some(e) = &o.truncated {
                            counts.truncated.fetch_add(1, Ordering::Relaxed);
                            tracing::error!(
                                "flight recorder: dump {} cut short, still a valid trace: {e}",
                                o.trace.display()
                            );
                        } else {
                            tracing::info!(
                                "flight recorder: dump written to {}",
                                o.trace.display()
                            );
                        }
                        if let Ok(mut last) = stats.last_dump.lock() {
                            *last = Some(o.clone());
                        }
                    }
                    Err(e) => {
                        counts.failed.fetch_add(1, Ordering::Relaxed);
                        tracing::error!("flight recorder: dump failed: {e}");
                    }
                }
                if let Some(tx) = reply_tx {
                    let _ = tx.send(result);
                }
            });
        match spawned {
            Ok(handle) => self.renders.push(handle),
            Err(e) => {
                self.stats
                    .trigger(trigger)
                    .failed
                    .fetch_add(1, Ordering::Relaxed);
                tracing::error!("flight recorder: starting a dump thread: {e}");
            }
        }
        self.renders.retain(|h| !h.is_finished());
    }
}

impl Sink for FlightRecorder {
    type Output = Arc<RecorderStats>;

    fn on_batch(&mut self, batch: &[Record], lost: &SinkCounters) -> Result<()> {
        // Only reached when called directly: keep a copy.
        self.on_shared_batch(&Arc::new(batch.to_vec()), lost)
    }

    fn on_shared_batch(&mut self, batch: &Batch, lost: &SinkCounters) -> Result<()> {
        self.note_losses(lost);
        self.keep(batch);
        self.serve_requests();
        Ok(())
    }

    fn on_tick(&mut self, now: u64, lost: &SinkCounters) -> Result<()> {
        self.now = self.now.max(now);
        self.note_losses(lost);
        self.expire();
        self.publish();
        self.serve_requests();
        Ok(())
    }

    /// Dumps in progress finish; requests whose window never ended are
    /// answered.
    fn finish(mut self, end: u64, _lost: &SinkCounters) -> Result<Arc<RecorderStats>> {
        self.now = self.now.max(end);
        self.serve_requests();
        for (_, req) in self.pending.drain(..) {
            if let Some(tx) = req.reply {
                let _ = tx.send(Err(DumpError::Stopped));
            }
        }
        for h in self.renders.drain(..) {
            let _ = h.join();
        }
        Ok(self.stats)
    }
}

#[cfg(test)]
mod tests;
