//! The collect stage: drains the kernel's three ring buffers (the traced
//! job's scheduling, device calls, bystander switches) on wakeups and on a
//! short timer, turns every record into a typed raw event (`crate::events`,
//! the one place that knows each record's byte layout) and hands batches to
//! the pipeline, merged in time order.
//! It waits when the pipeline is behind (the kernel rings are the buffer and
//! count what they cannot hold); sinks never hold it up (see `sinks`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use xpuscope_common::DROP_SLOTS;

use super::PipelineMsg as Msg;
use crate::events::{self, Event};
use crate::kernel::KernelRings;

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
    pub rings: KernelRings,
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
            rings:
                KernelRings {
                    sched,
                    device,
                    bystander,
                },
            out,
            counters,
            drain_interval,
            delay,
        } = self;
        let register = |ring| {
            // SAFETY: the ring buffer owns its fd, which stays open (and is
            // deregistered) for as long as the AsyncFd owns the ring buffer.
            unsafe { AsyncFd::register(ring) }
                .map_err(|e| anyhow::anyhow!("registering a ring buffer with the runtime: {e}"))
        };
        let mut sched = register(sched)?;
        let mut device = register(device)?;
        let mut bystander = register(bystander)?;
        let mut tick = tokio::time::interval(drain_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pending = Vec::new();
        loop {
            let mut stopping = false;
            tokio::select! {
                guard = sched.readable_mut() => guard?.clear_ready(),
                guard = device.readable_mut() => guard?.clear_ready(),
                guard = bystander.readable_mut() => guard?.clear_ready(),
                _ = tick.tick() => {}
                _ = stop.changed() => stopping = true,
            }
            let mut rings = Rings {
                sched: sched.get_mut(),
                device: device.get_mut(),
                bystander: bystander.get_mut(),
            };
            if !drain(&mut rings, &mut pending, &out, &counters, delay).await {
                return Ok(()); // downstream is gone
            }
            if stopping || *stop.borrow() {
                drain(&mut rings, &mut pending, &out, &counters, Duration::ZERO).await;
                return Ok(());
            }
        }
    }
}

struct Rings<'a> {
    sched: &'a mut RingBuf<MapData>,
    device: &'a mut RingBuf<MapData>,
    bystander: &'a mut RingBuf<MapData>,
}

/// Decodes records from `ring` into `into` until it is empty, `limit`
/// records were read, or (with `until`) a record stamped after `until`
/// was read.
fn read_ring(
    ring: &mut RingBuf<MapData>,
    into: &mut Vec<Event>,
    limit: usize,
    until: Option<u64>,
    counters: &ReaderCounters,
) {
    let mut n = 0;
    while n < limit {
        let Some(item) = ring.next() else { break };
        n += 1;
        match events::decode(&item) {
            Ok(event) => {
                counters.consumed[event.kind() as usize].fetch_add(1, Ordering::Relaxed);
                let ts = event.ts();
                into.push(event);
                if until.is_some_and(|u| ts > u) {
                    break;
                }
            }
            Err(e) => {
                counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("undecodable record: {e}");
            }
        }
    }
}

/// Most bystander records held back for a later batch; past it the
/// bystander ring is not read until they are out (the ring then overflows
/// and counts its losses, never the target's).
const MAX_PENDING_BYSTANDER: usize = 4 * BATCH;

/// One batch from the three rings, sorted by time (stable: on a tie the
/// device ring, then the scheduler ring, then the bystander ring). Each
/// ring holds a CPU's records in time order, so what matters is that no
/// record of a CPU can still come, in a later batch, from before a record
/// of that CPU in this one:
/// - The bystander ring is read before the scheduler ring: a scheduler
///   record stamped before a bystander record just read was written before
///   it (a CPU writes in time order), so it is in the scheduler ring by
///   now. If the scheduler ring is then read to empty, every bystander
///   record read goes out; if it had more than a batch, a CPU's bystander
///   records go out only up to the last scheduler record of that CPU read
///   (unread ones of that CPU are later), the rest wait in `pending`.
/// - The device ring is read before and after the scheduler ring, the
///   second read up to the last scheduler record read, so a thread's calls
///   come before its exit.
///
/// Returns the batch and whether a ring had more than a batch.
fn read_batch(
    rings: &mut Rings,
    pending: &mut Vec<Event>,
    counters: &ReaderCounters,
) -> (Vec<Event>, bool) {
    let mut device = Vec::new();
    read_ring(rings.device, &mut device, BATCH, None, counters);
    let room = MAX_PENDING_BYSTANDER.saturating_sub(pending.len());
    let before = pending.len();
    read_ring(rings.bystander, pending, room.min(BATCH), None, counters);
    let bystander_full = room > 0 && pending.len() - before == room.min(BATCH);
    let mut sched = Vec::with_capacity(BATCH);
    read_ring(rings.sched, &mut sched, BATCH, None, counters);
    let sched_drained = sched.len() < BATCH;
    let last = sched.iter().map(Event::ts).max();
    if let Some(last) = last {
        read_ring(rings.device, &mut device, usize::MAX, Some(last), counters);
    }
    let full = device.len() >= BATCH || !sched_drained || bystander_full;
    (assemble(device, sched, pending, sched_drained), full)
}

/// A batch from what was read: every bystander record that can go (all of
/// them when the scheduler ring was read to empty, else a CPU's only up to
/// the last scheduler record of that CPU read; the rest stay in
/// `pending`), sorted by time, stable (device, scheduler, bystander on a
/// tie).
fn assemble(
    device: Vec<Event>,
    sched: Vec<Event>,
    pending: &mut Vec<Event>,
    sched_drained: bool,
) -> Vec<Event> {
    let bystander = if sched_drained {
        std::mem::take(pending)
    } else {
        let mut last_by_cpu: Vec<Option<u64>> = Vec::new();
        for e in &sched {
            if let Some(cpu) = e.cpu().map(|c| c as usize)
                && cpu < xpuscope_common::MAX_CPUS as usize
            {
                if cpu >= last_by_cpu.len() {
                    last_by_cpu.resize(cpu + 1, None);
                }
                let slot = &mut last_by_cpu[cpu];
                *slot = Some(slot.map_or(e.ts(), |t| t.max(e.ts())));
            }
        }
        let (out, keep): (Vec<Event>, Vec<Event>) = pending.drain(..).partition(|e| {
            e.cpu()
                .and_then(|c| last_by_cpu.get(c as usize).copied().flatten())
                .is_some_and(|last| e.ts() <= last)
        });
        *pending = keep;
        out
    };
    let mut batch = device;
    batch.extend(sched);
    batch.extend(bystander);
    // Stable and adaptive: the rings are nearly in time order already.
    batch.sort_by_key(Event::ts);
    batch
}

/// Drains everything available. Returns false if the consumer hung up.
async fn drain(
    rings: &mut Rings<'_>,
    pending: &mut Vec<Event>,
    out: &mpsc::Sender<Msg>,
    counters: &ReaderCounters,
    delay: Duration,
) -> bool {
    loop {
        let (batch, full) = read_batch(rings, pending, counters);
        if batch.is_empty() {
            return true;
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Comm, Rename};

    fn at(cpu: u32, ts: u64, tid: u32) -> Event {
        Event::Rename(Rename {
            cpu,
            ts,
            tid,
            tgid: tid,
            old_comm: Comm::default(),
            new_comm: Comm::default(),
        })
    }

    fn order(v: &[Event]) -> Vec<(u32, u64, u32)> {
        v.iter()
            .map(|e| match e {
                Event::Rename(r) => (r.cpu, r.ts, r.tid),
                _ => unreachable!(),
            })
            .collect()
    }

    /// Per CPU, time never goes back: neither within a batch (sorted) nor
    /// across batches (a bystander record waits while its CPU's earlier
    /// scheduler records may still be unread).
    #[test]
    fn a_cpu_never_goes_back_in_time_across_rings_and_batches() {
        // The scheduler ring had more than a batch: cpu 1's record at 10
        // came before cpu 0's at 5 in write order.
        let sched = vec![at(1, 10, 1), at(0, 5, 1)];
        let device = vec![at(0, 5, 2), at(1, 12, 2)];
        let mut pending = vec![at(0, 4, 3), at(0, 7, 3), at(1, 9, 3), at(2, 3, 3)];
        let batch = assemble(device, sched, &mut pending, false);
        assert_eq!(
            order(&batch),
            vec![
                (0, 4, 3),
                // A tie: device, then scheduler.
                (0, 5, 2),
                (0, 5, 1),
                (1, 9, 3),
                (1, 10, 1),
                (1, 12, 2),
            ]
        );
        // cpu 0's 7 waits (its scheduler records after 5 are unread), and
        // cpu 2 had none read at all.
        assert_eq!(order(&pending), vec![(0, 7, 3), (2, 3, 3)]);
        // The scheduler ring read to the end: everything goes.
        let batch = assemble(vec![], vec![at(0, 8, 1)], &mut pending, true);
        assert_eq!(order(&batch), vec![(2, 3, 3), (0, 7, 3), (0, 8, 1)]);
        assert!(pending.is_empty());
    }
}
