//! Sinks: the consumers of the decoded record stream (the Perfetto writer,
//! the end-of-run summary; next a flight recorder, metrics, detectors).
//!
//! Each sink runs on its own thread behind its own bounded queue, fed by the
//! fan-out with batches shared between sinks (`Arc`, never copied). A sink
//! that lags loses its own batches, counted as drops under its name: it
//! never stalls the kernel rings or the other sinks. A sink whose work is a
//! few counters per record (the end-of-run summary) can instead run on the
//! fan-out's thread ([`FanOut::add_inline`]): no queue, nothing lost, and
//! none of a thread's hand-off costs. A new capability is a new [`Sink`];
//! it never decodes raw bytes itself.

#[cfg(test)]
pub mod counting;
pub mod detect;
pub mod flight_recorder;
pub mod metrics;
pub mod perfetto;
pub mod summary;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow};
use serde::Serialize;

use crate::model::Record;

/// Records handed to every sink at once.
pub type Batch = Arc<Vec<Record>>;

/// A consumer of the record stream.
pub trait Sink: Send + 'static {
    /// What the sink hands back when the recording ends.
    type Output: Send + 'static;
    /// The records in stream order (a batch's records, then the next
    /// batch's; batches the sink lost are counted in `lost`).
    fn on_batch(&mut self, batch: &[Record], lost: &SinkCounters) -> Result<()>;
    /// The same, for a sink that keeps batches (the flight recorder): the
    /// shared batch itself, so keeping it copies nothing.
    fn on_shared_batch(&mut self, batch: &Batch, lost: &SinkCounters) -> Result<()> {
        self.on_batch(batch, lost)
    }
    /// Called about once a second, also when no records came.
    fn on_tick(&mut self, _now: u64, _lost: &SinkCounters) -> Result<()> {
        Ok(())
    }
    /// The recording ended at `end` (CLOCK_BOOTTIME ns).
    fn finish(self, end: u64, lost: &SinkCounters) -> Result<Self::Output>;
}

/// A sink's own accounting, read by the summary and by the sink itself.
#[derive(Debug, Default)]
pub struct SinkCounters {
    pub delivered_records: AtomicU64,
    pub dropped_records: AtomicU64,
    pub dropped_batches: AtomicU64,
    /// The sink's thread ended before the recording did (an error).
    pub stopped: AtomicBool,
}

impl SinkCounters {
    pub fn dropped(&self) -> u64 {
        self.dropped_records.load(Ordering::Relaxed)
    }
}

/// A sink's counters for the summary.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SinkReport {
    pub name: &'static str,
    pub delivered_records: u64,
    pub dropped_records: u64,
    pub dropped_batches: u64,
}

enum SinkMsg {
    Batch(Batch),
    Tick(u64),
    Finish(u64),
}

/// The fan-out's end of one sink.
struct SinkQueue {
    name: &'static str,
    tx: Option<SyncSender<SinkMsg>>,
    counters: Arc<SinkCounters>,
}

/// A running sink: its queue's counters and where its output comes from.
pub struct SinkHandle<T> {
    pub name: &'static str,
    pub counters: Arc<SinkCounters>,
    runs: Runs<T>,
}

/// Where a sink runs.
enum Runs<T> {
    /// Its own thread, behind a queue.
    Thread(JoinHandle<Result<T>>),
    /// On the fan-out's thread; its output is left here when it ends.
    Inline(Arc<Mutex<Option<Result<T>>>>),
}

impl<T> SinkHandle<T> {
    pub fn is_finished(&self) -> bool {
        match &self.runs {
            Runs::Thread(thread) => thread.is_finished(),
            Runs::Inline(slot) => slot.lock().is_ok_and(|s| s.is_some()),
        }
    }

    /// Waits for the sink's output (after [`FanOut::finish`]).
    pub fn join(self) -> Result<T> {
        let name = self.name;
        match self.runs {
            Runs::Thread(thread) => match thread.join() {
                Ok(r) => r.with_context(|| format!("the {name} sink failed")),
                Err(panic) => Err(anyhow!(
                    "the {name} sink panicked: {}",
                    panic_message(&*panic)
                )),
            },
            Runs::Inline(slot) => slot
                .lock()
                .map_err(|_| anyhow!("the {name} sink's output was poisoned"))?
                .take()
                .unwrap_or_else(|| Err(anyhow!("the recording did not end")))
                .with_context(|| format!("the {name} sink failed")),
        }
    }

    pub fn report(&self) -> SinkReport {
        let c = &self.counters;
        SinkReport {
            name: self.name,
            delivered_records: c.delivered_records.load(Ordering::Relaxed),
            dropped_records: c.dropped_records.load(Ordering::Relaxed),
            dropped_batches: c.dropped_batches.load(Ordering::Relaxed),
        }
    }
}

/// The text of a panic payload.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// A sink run on the fan-out's own thread (type-erased).
trait InlineSink: Send {
    fn name(&self) -> &'static str;
    fn counters(&self) -> &SinkCounters;
    fn batch(&mut self, batch: &Batch);
    fn tick(&mut self, now: u64);
    fn finish(&mut self, end: u64);
}

struct Inline<S: Sink> {
    name: &'static str,
    /// `None` once it ended (finished, failed or panicked).
    sink: Option<S>,
    counters: Arc<SinkCounters>,
    output: Arc<Mutex<Option<Result<S::Output>>>>,
}

impl<S: Sink> Inline<S> {
    /// Runs `f` on the sink; an error or a panic ends the sink with it as
    /// its output (the stage goes on: the sink's records count as lost).
    fn call(&mut self, f: impl FnOnce(&mut S, &SinkCounters) -> Result<()>) {
        let Some(sink) = self.sink.as_mut() else {
            return;
        };
        let counters = &self.counters;
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| f(sink, counters)));
        let err = match outcome {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(panic) => anyhow!(
                "the {} sink panicked: {}",
                self.name,
                panic_message(&*panic)
            ),
        };
        tracing::warn!("the {} sink stopped: {err:#}", self.name);
        self.sink = None;
        self.counters.stopped.store(true, Ordering::Relaxed);
        if let Ok(mut out) = self.output.lock() {
            *out = Some(Err(err));
        }
    }
}

impl<S: Sink> InlineSink for Inline<S> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn counters(&self) -> &SinkCounters {
        &self.counters
    }

    fn batch(&mut self, batch: &Batch) {
        self.call(|s, c| s.on_shared_batch(batch, c));
    }

    fn tick(&mut self, now: u64) {
        self.call(|s, c| s.on_tick(now, c));
    }

    fn finish(&mut self, end: u64) {
        let Some(sink) = self.sink.take() else {
            return;
        };
        let counters = &self.counters;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| sink.finish(end, counters)))
            .unwrap_or_else(|panic| {
                Err(anyhow!(
                    "the {} sink panicked: {}",
                    self.name,
                    panic_message(&*panic)
                ))
            });
        if let Ok(mut out) = self.output.lock() {
            *out = Some(result);
        }
    }
}

/// Hands every batch to every sink without waiting for any.
#[derive(Default)]
pub struct FanOut {
    queues: Vec<SinkQueue>,
    inline: Vec<Box<dyn InlineSink>>,
}

impl FanOut {
    /// Starts `sink` on its own thread behind a queue of `depth` batches.
    pub fn add<S: Sink>(
        &mut self,
        name: &'static str,
        sink: S,
        depth: usize,
    ) -> Result<SinkHandle<S::Output>> {
        let (tx, rx) = sync_channel(depth.max(1));
        let counters = Arc::new(SinkCounters::default());
        let thread = {
            let counters = counters.clone();
            std::thread::Builder::new()
                .name(format!("xpuscope-{name}"))
                .spawn(move || run_sink(name, sink, rx, counters))
                .with_context(|| format!("starting the {name} sink"))?
        };
        self.queues.push(SinkQueue {
            name,
            tx: Some(tx),
            counters: counters.clone(),
        });
        Ok(SinkHandle {
            name,
            counters,
            runs: Runs::Thread(thread),
        })
    }

    /// Runs `sink` on the fan-out's own thread (the pipeline's), with no
    /// queue: for sinks whose work per record is a few counters (the
    /// end-of-run summary), where a thread of their own would cost more
    /// than the work (a hand-off per batch, and every record read again
    /// from another CPU's cache). Such a sink must never block: it holds up
    /// the pipeline. It loses nothing; if it fails, the rest goes on.
    pub fn add_inline<S: Sink>(&mut self, name: &'static str, sink: S) -> SinkHandle<S::Output> {
        let counters = Arc::new(SinkCounters::default());
        let output = Arc::new(Mutex::new(None));
        self.inline.push(Box::new(Inline {
            name,
            sink: Some(sink),
            counters: counters.clone(),
            output: output.clone(),
        }));
        SinkHandle {
            name,
            counters,
            runs: Runs::Inline(output),
        }
    }

    /// Offers `batch` to every sink; a sink whose queue is full loses it
    /// (counted under its name).
    pub fn send(&mut self, batch: Vec<Record>) {
        if batch.is_empty() {
            return;
        }
        let n = batch.len() as u64;
        let batch: Batch = Arc::new(batch);
        for s in &mut self.inline {
            let c = s.counters();
            if c.stopped.load(Ordering::Relaxed) {
                c.dropped_records.fetch_add(n, Ordering::Relaxed);
                c.dropped_batches.fetch_add(1, Ordering::Relaxed);
            } else {
                c.delivered_records.fetch_add(n, Ordering::Relaxed);
                s.batch(&batch);
            }
        }
        for q in &mut self.queues {
            let Some(tx) = &q.tx else {
                q.counters.dropped_records.fetch_add(n, Ordering::Relaxed);
                q.counters.dropped_batches.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            match tx.try_send(SinkMsg::Batch(batch.clone())) {
                Ok(()) => {
                    q.counters.delivered_records.fetch_add(n, Ordering::Relaxed);
                }
                Err(TrySendError::Full(_)) => {
                    q.counters.dropped_records.fetch_add(n, Ordering::Relaxed);
                    q.counters.dropped_batches.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Disconnected(_)) => {
                    tracing::warn!(
                        "the {} sink stopped; its records are counted as dropped",
                        q.name
                    );
                    q.counters.dropped_records.fetch_add(n, Ordering::Relaxed);
                    q.counters.dropped_batches.fetch_add(1, Ordering::Relaxed);
                    q.tx = None;
                }
            }
        }
    }

    /// A tick to every sink that has room for it (ticks are not counted).
    pub fn tick(&mut self, now: u64) {
        for s in &mut self.inline {
            s.tick(now);
        }
        for q in &self.queues {
            if let Some(tx) = &q.tx {
                let _ = tx.try_send(SinkMsg::Tick(now));
            }
        }
    }

    /// Tells every sink the recording ended at `end` (waiting for room:
    /// the end is never lost), then closes the queues.
    pub fn finish(&mut self, end: u64) {
        self.finish_with(end, Vec::new);
    }

    /// As [`finish`](Self::finish), handing the queued sinks one last
    /// batch made once the inline sinks finished (`last`: the detectors'
    /// findings at the end, which the trace must carry too), waiting for
    /// room.
    pub fn finish_with(&mut self, end: u64, last: impl FnOnce() -> Vec<Record>) {
        for s in &mut self.inline {
            tracing::debug!("finishing the {} sink", s.name());
            s.finish(end);
        }
        let last = last();
        let n = last.len() as u64;
        let last: Batch = Arc::new(last);
        for q in &mut self.queues {
            if let Some(tx) = q.tx.take() {
                if n > 0 {
                    if tx.send(SinkMsg::Batch(last.clone())).is_ok() {
                        q.counters.delivered_records.fetch_add(n, Ordering::Relaxed);
                    } else {
                        q.counters.dropped_records.fetch_add(n, Ordering::Relaxed);
                        q.counters.dropped_batches.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let _ = tx.send(SinkMsg::Finish(end));
            }
        }
    }
}

fn run_sink<S: Sink>(
    name: &'static str,
    mut sink: S,
    rx: Receiver<SinkMsg>,
    counters: Arc<SinkCounters>,
) -> Result<S::Output> {
    let span = tracing::info_span!("sink", name);
    let _entered = span.enter();
    let mut last_ts = 0;
    let result = (|| {
        while let Ok(msg) = rx.recv() {
            match msg {
                SinkMsg::Batch(batch) => sink.on_shared_batch(&batch, &counters)?,
                SinkMsg::Tick(now) => {
                    last_ts = now;
                    sink.on_tick(now, &counters)?;
                }
                SinkMsg::Finish(end) => return sink.finish(end, &counters),
            }
        }
        // The fan-out went away without an end (its stage failed): finish
        // anyway, so what was written is a valid file.
        sink.finish(last_ts.max(crate::host::boottime_ns()), &counters)
    })();
    if result.is_err() {
        counters.stopped.store(true, Ordering::Relaxed);
    }
    result
}
