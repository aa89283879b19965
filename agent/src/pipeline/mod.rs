//! The event pipeline: collect -> interpret (+ enrich) -> fan-out to sinks.
//!
//! ```text
//!  kernel rings --collect--> PipelineMsg --interpret/enrich--> Records --fan-out--> sinks
//!  (tokio task)              (bounded)    (pipeline thread)              (a thread and a
//!                                                                         bounded queue each,
//!                                                                         or inline)
//! ```
//! - [`collect`]: ring records -> typed raw events (`crate::events`).
//! - [`interpret`]: raw events -> [`Record`]s with meaning; asks [`enrich`]
//!   for what needs the live system, on this thread, before any sink.
//! - fan-out ([`crate::sinks::FanOut`]): every batch to every sink, never
//!   waiting for one.
//!
//! Adding an event kind: the record in `ebpf/common`, the kernel program in
//! `ebpf/programs` (and the program table in the kernel loader), its decoding
//! in `crate::events` (collect), its meaning in [`interpret`] as a
//! [`Record`] variant in `crate::model`, and the sinks that care. Nothing
//! else.

pub mod collect;
#[cfg(test)]
mod device_tests;
pub mod enrich;
pub mod interpret;
#[cfg(test)]
mod pipeline_tests;
pub mod queue_budget;
#[cfg(test)]
mod sched_tests;
#[cfg(test)]
pub mod testing;

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use anyhow::{Result, anyhow};
use tokio::sync::mpsc;

use crate::events::Event;
use crate::kernel::probes::TableUpdate;
use crate::model::Record;
use crate::procfs::ProcessEntry;
use crate::sinks::{FanOut, panic_message};
use enrich::Enrich;
use interpret::{InterpretCounters, Interpreter};
use queue_budget::QueueShare;
use xpuscope_probes::decode::table::ProbeTarget;

/// Messages into the pipeline, in stream order.
pub enum PipelineMsg {
    /// Events in time order, holding their share of the queue's byte
    /// budget until the pipeline is done with them.
    Events(Vec<Event>, QueueShare),
    /// Per-CPU drop totals changed: the CPUs with new drops, and the total.
    Drops { ts: u64, cpus: Vec<u32>, total: u64 },
    /// Device-library probes about to be attached (sent before they can
    /// fire, so every hit finds its meaning).
    Probes(TableUpdate),
    /// Probes attached by library file ahead of any process mapping it:
    /// (slot, what it is). A hit from any traced process decodes by slot.
    ProbeSlots(Vec<(u32, ProbeTarget)>),
    /// Time passes (sinks flush, write clock snapshots).
    Tick(u64),
}

/// The supervisors' probe announcements (`Probes`, `ProbeSlots`): a
/// channel of their own, read before every message of the main one, so a
/// probe's meaning reaches interpret before any batch that can hold its
/// hits, however many batches queue ahead (a new rank's probes must be
/// attached within milliseconds; waiting behind a full queue of events
/// took 150 ms). Unbounded: announcements are few.
pub type Announcements = std::sync::mpsc::Sender<PipelineMsg>;

/// Channel depth from collect (and the supervisor) into the pipeline, in
/// batches. The kernel ring buffer is the real buffer; this only smooths
/// hand-offs (each batch holds up to 4096 events, about 400 KiB of
/// scheduler records; batches of stacks are bounded in bytes as well, by
/// [`queue_budget`]).
pub const PIPELINE_BATCHES: usize = 16;

/// Ticks forwarded to sinks at most this often (ns).
const SINK_TICK_NS: u64 = 1_000_000_000;

/// The interpret stage with its enricher, feeding the fan-out.
pub struct Pipeline<E: Enrich> {
    pub interpreter: Interpreter,
    pub enricher: E,
    pub fanout: FanOut,
    last_tick: u64,
    /// Findings fed back by the detect sink.
    /// What the detect sink feeds back: findings and step splits.
    findings: Option<std::sync::mpsc::Receiver<Record>>,
    /// GPU health readings from the health sampler (`crate::health`).
    health: Option<std::sync::mpsc::Receiver<Record>>,
    announcements: Option<std::sync::mpsc::Receiver<PipelineMsg>>,
    /// Where the interpret stage's counters are published at each sink
    /// tick (a long-running service's metrics and status read them).
    published: Option<Arc<Mutex<InterpretCounters>>>,
}

impl<E: Enrich> Pipeline<E> {
    pub fn new(enricher: E, fanout: FanOut) -> Self {
        Self {
            interpreter: Interpreter::default(),
            enricher,
            fanout,
            last_tick: 0,
            findings: None,
            health: None,
            announcements: None,
            published: None,
        }
    }

    /// Publishes the interpret stage's counters into `to` at every sink
    /// tick.
    pub fn with_published_counters(mut self, to: Arc<Mutex<InterpretCounters>>) -> Self {
        self.published = Some(to);
        self
    }

    /// Reads probe announcements from their own channel (see
    /// [`Announcements`]) as well.
    pub fn with_announcements(mut self, rx: std::sync::mpsc::Receiver<PipelineMsg>) -> Self {
        self.announcements = Some(rx);
        self
    }

    /// Handles every announcement waiting.
    fn take_announcements(&mut self) {
        while let Some(msg) = self
            .announcements
            .as_ref()
            .and_then(|rx| rx.try_recv().ok())
        {
            self.handle(msg);
        }
    }

    /// Device calls past `rate` per second per (process, function) are
    /// summarized (0: never).
    pub fn with_device_call_rate(mut self, rate: u32) -> Self {
        self.interpreter = Interpreter::with_device_call_rate(rate);
        self
    }

    /// The processes present at attach.
    pub fn start(&mut self, ts: u64, processes: Vec<ProcessEntry>) {
        let mut out = Vec::new();
        self.interpreter.initial_processes(ts, processes, &mut out);
        self.fanout.send(out);
    }

    pub fn handle(&mut self, msg: PipelineMsg) {
        let mut out = Vec::new();
        let en = &mut self.enricher;
        match msg {
            PipelineMsg::Events(mut events, _share) => {
                // Room for what the events make, about: growing past it
                // copies every record once more, and room left unused stays
                // with the batch in the flight recorder's window (bounded
                // in bytes) for its whole stay.
                out.reserve(interpret::records_expected(&events));
                for e in events.drain(..) {
                    self.interpreter.event(e, en, &mut out);
                }
                collect::batch_pool::give(events);
            }
            PipelineMsg::Drops { ts, cpus, total } => {
                self.interpreter.drops(ts, cpus, total, &mut out)
            }
            PipelineMsg::Probes(update) => self.interpreter.probes_added(update, en, &mut out),
            PipelineMsg::ProbeSlots(slots) => self.interpreter.slots_added(slots),
            PipelineMsg::Tick(now) => {
                if now.saturating_sub(self.last_tick) >= SINK_TICK_NS {
                    self.last_tick = now;
                    // What still runs, before the sinks' clocks move on.
                    self.interpreter.in_flight(now, en, &mut out);
                    self.take_findings(&mut out);
                    self.fanout.send(std::mem::take(&mut out));
                    self.fanout.tick(now);
                    if let Some(to) = &self.published
                        && let Ok(mut c) = to.lock()
                    {
                        *c = self.interpreter.counters;
                    }
                }
            }
        }
        self.take_findings(&mut out);
        self.fanout.send(out);
    }

    /// Findings the detectors sent back since the last batch, as records
    /// every sink sees in order.
    fn take_findings(&mut self, out: &mut Vec<Record>) {
        if let Some(rx) = &self.health {
            out.extend(rx.try_iter());
        }
        if let Some(rx) = &self.findings {
            out.extend(rx.try_iter());
        }
    }

    /// GPU health readings sent on `rx` (by the health sampler) join the
    /// record stream, in the order they were read.
    pub fn with_health(mut self, rx: std::sync::mpsc::Receiver<Record>) -> Self {
        self.health = Some(rx);
        self
    }

    /// Records sent on `rx` (by the detect sink: findings, step splits)
    /// join the record stream.
    pub fn with_findings(mut self, rx: std::sync::mpsc::Receiver<Record>) -> Self {
        self.findings = Some(rx);
        self
    }

    /// Ends what is open at `end` and tells every sink the recording ended.
    pub fn finish(&mut self, end: u64) -> InterpretCounters {
        let mut out = Vec::new();
        self.take_findings(&mut out);
        self.interpreter.finish(end, &mut out);
        self.take_findings(&mut out);
        self.fanout.send(out);
        // The detectors' verdicts at the end (pending late arrivals, a
        // slow link judged on the last records) go into the trace too.
        let findings = self.findings.as_ref();
        self.fanout.finish_with(end, || {
            findings.map_or_else(Vec::new, |rx| rx.try_iter().collect())
        });
        self.interpreter.counters.caches = self.enricher.caches();
        self.interpreter.counters
    }

    /// The pipeline's body without collect on its thread (tests): every
    /// message until the channel closes, then the end.
    #[cfg(test)]
    pub fn run(
        self,
        rx: mpsc::Receiver<PipelineMsg>,
        end: impl FnOnce() -> u64,
    ) -> Result<InterpretCounters> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| anyhow!("starting the pipeline's runtime: {e}"))?;
        self.run_on(rt, rx, end)
    }

    /// The pipeline thread's body (see [`start_thread`]): every message
    /// until the channel closes, then the end. A panic in interpretation
    /// still ends every sink (a finished, valid trace) and comes back as an
    /// error.
    pub fn run_on(
        mut self,
        rt: tokio::runtime::Runtime,
        mut rx: mpsc::Receiver<PipelineMsg>,
        end: impl FnOnce() -> u64,
    ) -> Result<InterpretCounters> {
        let span = tracing::info_span!("interpret");
        let _entered = span.enter();
        let body = std::panic::catch_unwind(AssertUnwindSafe(|| {
            rt.block_on(async {
                while let Some(msg) = rx.recv().await {
                    self.take_announcements();
                    self.handle(msg);
                }
                self.take_announcements();
            })
        }));
        drop(rt);
        let end = end();
        match body {
            Ok(()) => Ok(self.finish(end)),
            Err(panic) => {
                self.fanout.finish(end);
                Err(anyhow!(
                    "the interpret stage panicked: {}",
                    panic_message(&*panic)
                ))
            }
        }
    }
}

/// Starts the pipeline's thread: it builds the pipeline there (`build`: the
/// symbolizer is not `Send`) and runs it with [`Pipeline::run_on`] until
/// its channel closes. Collect runs elsewhere (a task of the supervisor's
/// runtime): reading the rings and interpreting proceed in parallel on two
/// CPUs. (Running collect on this thread instead saved a few percent of CPU
/// per event, by interpreting each batch in the cache of the CPU that read
/// it, but halved what one recording can consume: a switch storm then
/// outran it.)
pub fn start_thread<E: Enrich + 'static>(
    build: impl FnOnce() -> Pipeline<E> + Send + 'static,
    rx: mpsc::Receiver<PipelineMsg>,
) -> Result<std::thread::JoinHandle<Result<InterpretCounters>>> {
    std::thread::Builder::new()
        .name("xpuscope-pipeline".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .map_err(|e| anyhow!("starting the pipeline's runtime: {e}"))?;
            build().run_on(rt, rx, crate::host::boottime_ns)
        })
        .map_err(|e| anyhow!("starting the pipeline: {e}"))
}
