//! The ring-buffer reader stage: drains the kernel ring buffer on wakeups
//! and on a short timer, decodes every record and hands batches on.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use xpuscope_common::DROP_SLOTS;

use crate::events;
use crate::session::Msg;

/// Records per batch sent downstream.
const BATCH: usize = 4096;

/// What the reader has seen, shared with the supervisor.
#[derive(Default)]
pub struct ReaderCounters {
    /// Decoded records per `EventKind` value.
    pub consumed: [AtomicU64; DROP_SLOTS as usize],
    pub decode_errors: AtomicU64,
}

impl ReaderCounters {
    pub fn total_consumed(&self) -> u64 {
        self.consumed
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

pub struct Reader {
    pub ring: RingBuf<MapData>,
    pub out: mpsc::Sender<Msg>,
    pub counters: Arc<ReaderCounters>,
    pub drain_interval: Duration,
    /// Testing aid: pause after each batch.
    pub delay: Duration,
}

impl Reader {
    /// Runs until `stop` turns true, then drains what is left and returns.
    pub async fn run(self, mut stop: watch::Receiver<bool>) -> Result<()> {
        let Reader {
            ring,
            out,
            counters,
            drain_interval,
            delay,
        } = self;
        // SAFETY: the ring buffer owns its fd, which stays open (and is
        // deregistered) for as long as the AsyncFd owns the ring buffer.
        let mut fd = unsafe { AsyncFd::register(ring) }
            .map_err(|e| anyhow::anyhow!("registering the ring buffer with the runtime: {e}"))?;
        let mut tick = tokio::time::interval(drain_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mut stopping = false;
            tokio::select! {
                guard = fd.readable_mut() => guard?.clear_ready(),
                _ = tick.tick() => {}
                _ = stop.changed() => stopping = true,
            }
            if !drain(fd.get_mut(), &out, &counters, delay).await {
                return Ok(()); // downstream is gone
            }
            if stopping || *stop.borrow() {
                drain(fd.get_mut(), &out, &counters, Duration::ZERO).await;
                return Ok(());
            }
        }
    }
}

/// Drains everything available. Returns false if the consumer hung up.
async fn drain(
    ring: &mut RingBuf<MapData>,
    out: &mpsc::Sender<Msg>,
    counters: &ReaderCounters,
    delay: Duration,
) -> bool {
    loop {
        let mut batch = Vec::with_capacity(BATCH);
        while batch.len() < BATCH {
            let Some(item) = ring.next() else { break };
            match events::decode(&item) {
                Ok(event) => {
                    counters.consumed[event.kind() as usize].fetch_add(1, Ordering::Relaxed);
                    batch.push(event);
                }
                Err(e) => {
                    counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("undecodable record: {e}");
                }
            }
        }
        if batch.is_empty() {
            return true;
        }
        let full = batch.len() == BATCH;
        if out.send(Msg::Events(batch)).await.is_err() {
            return false;
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if !full {
            return true;
        }
    }
}
