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
            if !drain(&mut rings, &out, &counters, delay).await {
                return Ok(()); // downstream is gone
            }
            if stopping || *stop.borrow() {
                drain(&mut rings, &out, &counters, Duration::ZERO).await;
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

/// Merges sequences by timestamp, keeping each one's own order (a ring's
/// records are in write order, which is not strictly time order across
/// CPUs): the next record out is the earliest of the sequences' heads, the
/// earlier sequence first on a tie.
fn merge_by_time(sequences: Vec<Vec<Event>>) -> Vec<Event> {
    let mut sequences: Vec<Vec<Event>> = sequences.into_iter().filter(|s| !s.is_empty()).collect();
    if sequences.len() <= 1 {
        return sequences.pop().unwrap_or_default();
    }
    let mut out = Vec::with_capacity(sequences.iter().map(Vec::len).sum());
    let mut heads: Vec<_> = sequences
        .into_iter()
        .map(|s| s.into_iter().peekable())
        .collect();
    // A linear scan of the heads: there are three rings.
    loop {
        let mut earliest: Option<(usize, u64)> = None;
        for (i, head) in heads.iter_mut().enumerate() {
            if let Some(ts) = head.peek().map(Event::ts)
                && earliest.is_none_or(|(_, best)| ts < best)
            {
                earliest = Some((i, ts));
            }
        }
        let Some((i, _)) = earliest else { break };
        out.extend(heads[i].next());
    }
    out
}

/// One batch from the three rings, in time order where it matters: a
/// thread's device records all come before its exit record, and a CPU's
/// bystander switches fall between the target's switches on it. The device
/// and bystander rings are read before and after the scheduler ring; the
/// second read goes on until the ring is empty or past the last scheduler
/// record read, so a record written before a scheduler record of this
/// batch (each ring keeps write order) is in this batch too. For the
/// device ring that read is unbounded (a thread's calls must precede its
/// exit); for the bystander ring it stops at another batch: a storm's
/// backlog would otherwise make one batch of up to a whole ring (~95k
/// records at the default size), and every queue downstream is sized in
/// batches. A bystander switch that waits for the next batch is only out of order
/// against another CPU's records or the target's, which the trace's
/// importer sorts and nothing in the pipeline keeps state about. Returns
/// the batch and whether any ring had more than a batch.
fn read_batch(rings: &mut Rings, counters: &ReaderCounters) -> (Vec<Event>, bool) {
    let mut device = Vec::new();
    read_ring(rings.device, &mut device, BATCH, None, counters);
    let mut bystander = Vec::new();
    read_ring(rings.bystander, &mut bystander, BATCH, None, counters);
    let mut sched = Vec::with_capacity(BATCH);
    read_ring(rings.sched, &mut sched, BATCH, None, counters);
    let full = device.len() == BATCH || sched.len() == BATCH || bystander.len() == BATCH;
    if let Some(last) = sched.iter().map(Event::ts).max() {
        read_ring(rings.device, &mut device, usize::MAX, Some(last), counters);
        read_ring(rings.bystander, &mut bystander, BATCH, Some(last), counters);
    }
    (merge_by_time(vec![device, sched, bystander]), full)
}

/// Drains everything available. Returns false if the consumer hung up.
async fn drain(
    rings: &mut Rings<'_>,
    out: &mpsc::Sender<Msg>,
    counters: &ReaderCounters,
    delay: Duration,
) -> bool {
    loop {
        let (batch, full) = read_batch(rings, counters);
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

    fn at(ts: u64, tid: u32) -> Event {
        Event::Rename(Rename {
            cpu: 0,
            ts,
            tid,
            tgid: tid,
            old_comm: Comm::default(),
            new_comm: Comm::default(),
        })
    }

    fn order(v: &[Event]) -> Vec<(u64, u32)> {
        v.iter()
            .map(|e| match e {
                Event::Rename(r) => (r.ts, r.tid),
                _ => unreachable!(),
            })
            .collect()
    }

    #[test]
    fn merge_interleaves_by_time_and_keeps_each_sequence_order() {
        // The scheduler sequence is not strictly sorted (records of two
        // CPUs): its own order stays.
        let sched = vec![at(10, 1), at(30, 1), at(25, 1), at(50, 1)];
        let device = vec![at(5, 2), at(26, 2), at(40, 2)];
        let merged = merge_by_time(vec![device, sched]);
        assert_eq!(
            order(&merged),
            vec![(5, 2), (10, 1), (26, 2), (30, 1), (25, 1), (40, 2), (50, 1)]
        );
        assert_eq!(
            order(&merge_by_time(vec![vec![], vec![at(1, 1)]])),
            vec![(1, 1)]
        );
        assert_eq!(
            order(&merge_by_time(vec![vec![at(1, 2)], vec![]])),
            vec![(1, 2)]
        );
        assert!(merge_by_time(vec![]).is_empty());
    }

    #[test]
    fn merge_of_three_rings_keeps_each_order_and_puts_ties_in_ring_order() {
        let device = vec![at(20, 2), at(60, 2)];
        let sched = vec![at(10, 1), at(20, 1), at(45, 1), at(40, 1)];
        let bystander = vec![at(5, 3), at(20, 3), at(41, 3), at(30, 3), at(70, 3)];
        let merged = merge_by_time(vec![device, sched, bystander]);
        assert_eq!(
            order(&merged),
            vec![
                (5, 3),
                (10, 1),
                // A tie: device, then scheduler, then bystander.
                (20, 2),
                (20, 1),
                (20, 3),
                // 41 before 30: the bystander ring's own order.
                (41, 3),
                (30, 3),
                (45, 1),
                (40, 1),
                (60, 2),
                (70, 3),
            ]
        );
        assert_eq!(merged.len(), 11, "nothing lost or repeated");
    }
}
