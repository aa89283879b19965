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

/// What the supervisor acts on the moment collect reads it, before the
/// record itself is held back for time order: a traced process started a
/// program (`exec`) or its dynamic loader changed its link map. The
/// supervisor then probes the libraries that process maps, or will.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderNotice {
    pub tgid: u32,
    /// A new program (else a link map change).
    pub exec: bool,
}

impl LoaderNotice {
    fn of(event: &Event) -> Option<Self> {
        match event {
            Event::Exec(e) => Some(Self {
                tgid: e.tgid,
                exec: true,
            }),
            Event::LinkMap(l) => Some(Self {
                tgid: l.tgid,
                exec: false,
            }),
            _ => None,
        }
    }
}

/// Notices waiting for the supervisor; a full queue loses notices, never
/// records (the supervisor's periodic rescan still finds the libraries).
pub const NOTICE_QUEUE: usize = 1024;

pub struct Reader {
    pub rings: KernelRings,
    pub out: mpsc::Sender<Msg>,
    /// Where [`LoaderNotice`]s go (`None`: nobody acts on them).
    pub notices: Option<mpsc::Sender<LoaderNotice>>,
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
            notices,
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
        let mut held = Held::new();
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
                notices: notices.as_ref(),
            };
            if !drain(&mut rings, &mut held, &out, &counters, delay, false).await {
                return Ok(()); // downstream is gone
            }
            if stopping || *stop.borrow() {
                drain(&mut rings, &mut held, &out, &counters, Duration::ZERO, true).await;
                return Ok(());
            }
        }
    }
}

struct Rings<'a> {
    sched: &'a mut RingBuf<MapData>,
    device: &'a mut RingBuf<MapData>,
    bystander: &'a mut RingBuf<MapData>,
    notices: Option<&'a mpsc::Sender<LoaderNotice>>,
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
    notices: Option<&mpsc::Sender<LoaderNotice>>,
) {
    let mut n = 0;
    while n < limit {
        let Some(item) = ring.next() else { break };
        n += 1;
        match events::decode(&item) {
            Ok(event) => {
                counters.consumed[event.kind() as usize].fetch_add(1, Ordering::Relaxed);
                if let Some(tx) = notices
                    && let Some(n) = LoaderNotice::of(&event)
                {
                    let _ = tx.try_send(n);
                }
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

/// How long after a record's timestamp it is surely in its ring: a
/// program stamps, reserves and commits a record within microseconds and
/// cannot be preempted meanwhile; a millisecond leaves a wide margin.
const COMMIT_SLACK_NS: u64 = 1_000_000;

/// The records read but not handed on yet (see [`read_batch`]).
pub(crate) type Held = Vec<Event>;

/// What one read of a ring saw.
struct RingRead {
    /// Read to empty.
    drained: bool,
    /// The timestamp of the last record read (in ring order), if any.
    last_ts: Option<u64>,
}

fn read_all(
    ring: &mut RingBuf<MapData>,
    into: &mut Vec<Event>,
    counters: &ReaderCounters,
    notices: Option<&mpsc::Sender<LoaderNotice>>,
) -> RingRead {
    let before = into.len();
    read_ring(ring, into, BATCH, None, counters, notices);
    let n = into.len() - before;
    RingRead {
        drained: n < BATCH,
        last_ts: (n > 0).then(|| into[into.len() - 1].ts()),
    }
}

/// One batch from the three rings, in time order: every CPU's records
/// (switches above all: a CPU's track must never go back in time) and a
/// thread's device calls before its exit, whichever ring they came in.
///
/// Records are held until no ring can still hold an earlier one. `now` is
/// taken before the rings are read, so every record stamped before
/// `now - COMMIT_SLACK_NS` was in its ring by then, and a ring read to
/// empty gave all of them; a ring that had more than a batch can still
/// give records from just before its last record read (a later record in
/// a ring was reserved later, so it was stamped at most the slack earlier),
/// so the watermark also stays below that. Records up to the watermark go
/// out, sorted by time (stable: on a tie the device ring, then the
/// scheduler ring, then the bystander ring); `flush` (at the end) sends
/// everything. Returns the batch and whether a ring had more than a batch.
fn read_batch(
    rings: &mut Rings,
    held: &mut Held,
    counters: &ReaderCounters,
    flush: bool,
) -> (Vec<Event>, bool) {
    let now = crate::host::boottime_ns();
    let reads = [
        read_all(rings.device, held, counters, None),
        read_all(rings.sched, held, counters, rings.notices),
        read_all(rings.bystander, held, counters, None),
    ];
    let full = reads.iter().any(|r| !r.drained);
    let mut watermark = now.saturating_sub(COMMIT_SLACK_NS);
    for r in reads.iter().filter(|r| !r.drained) {
        if let Some(last) = r.last_ts {
            watermark = watermark.min(last.saturating_sub(COMMIT_SLACK_NS));
        }
    }
    (
        release(held, if flush && !full { u64::MAX } else { watermark }),
        full,
    )
}

/// The held records stamped at or before `watermark`, in time order
/// (stable); the rest stay held.
fn release(held: &mut Held, watermark: u64) -> Vec<Event> {
    // Stable and adaptive: the rings are nearly in time order already.
    held.sort_by_key(Event::ts);
    let n = held.partition_point(|e| e.ts() <= watermark);
    let rest = held.split_off(n);
    std::mem::replace(held, rest)
}

/// Drains everything available. Returns false if the consumer hung up.
async fn drain(
    rings: &mut Rings<'_>,
    held: &mut Held,
    out: &mpsc::Sender<Msg>,
    counters: &ReaderCounters,
    delay: Duration,
    flush: bool,
) -> bool {
    loop {
        let (batch, full) = read_batch(rings, held, counters, flush);
        if batch.is_empty() {
            if full {
                continue; // all held back: read on
            }
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

    /// Records go out in time order, and only up to the watermark: a
    /// record of an earlier time read later (another ring, a later batch)
    /// still comes before anything later of its CPU.
    #[test]
    fn records_go_out_in_time_order_up_to_the_watermark() {
        // Write order of three rings: cpu 1's 10 before cpu 0's 5, and a
        // bystander record of cpu 0 at 4 read after them.
        let mut held: Held = vec![at(1, 10, 1), at(0, 5, 1), at(0, 5, 2), at(0, 4, 3)];
        let out = release(&mut held, 6);
        assert_eq!(order(&out), vec![(0, 4, 3), (0, 5, 1), (0, 5, 2)]);
        assert_eq!(order(&held), vec![(1, 10, 1)], "10 waits");
        // The next read brings cpu 1's 7 (another ring): it still goes out
        // before the held 10.
        held.push(at(1, 7, 3));
        held.push(at(0, 12, 1));
        let out = release(&mut held, 11);
        assert_eq!(order(&out), vec![(1, 7, 3), (1, 10, 1)]);
        let out = release(&mut held, u64::MAX);
        assert_eq!(order(&out), vec![(0, 12, 1)]);
        assert!(held.is_empty());
    }
}
