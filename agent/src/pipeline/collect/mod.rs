//! The collect stage: drains the kernel's three ring buffers (the traced
//! job's scheduling, device calls, bystander switches) on wakeups and on a
//! short timer, turns every record into a typed raw event (`crate::events`,
//! the one place that knows each record's byte layout) and hands batches to
//! the pipeline, merged in time order.
//! It waits when the pipeline is behind (the kernel rings are the buffer and
//! count what they cannot hold); sinks never hold it up (see `sinks`).

pub mod batch_pool;
mod floors;
mod positions;

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use xpuscope_common::DROP_SLOTS;

use super::PipelineMsg as Msg;
use super::queue_budget::QueueBudget;
use crate::events::{self, Event};
use crate::kernel::KernelRings;
use floors::{Floors, ReadEnd, RingRead};
use positions::RingPositions;

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
    /// The bytes of batches sent and not yet done with, bounded.
    pub budget: QueueBudget,
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
            budget,
            drain_interval,
            delay,
        } = self;
        let register = |ring| {
            // SAFETY: the ring buffer owns its fd, which stays open (and is
            // deregistered) for as long as the AsyncFd owns the ring buffer.
            unsafe { AsyncFd::register(ring) }
                .map_err(|e| anyhow::anyhow!("registering a ring buffer with the runtime: {e}"))
        };
        let positions = |ring: &RingBuf<MapData>| {
            RingPositions::new(ring.as_fd())
                .map_err(|e| anyhow::anyhow!("mapping a ring buffer's positions: {e}"))
        };
        let positions = [
            positions(&device)?,
            positions(&sched)?,
            positions(&bystander)?,
        ];
        let mut sched = register(sched)?;
        let mut device = register(device)?;
        let mut bystander = register(bystander)?;
        let mut tick = tokio::time::interval(drain_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut held = Held::default();
        let mut floors = Floors::default();
        // The pipeline's clock: a tick says every record stamped up to it
        // was handed on (the watermark of the last read), so a sink that
        // waits for a time (a dump that ends "now") has every record
        // before it once a tick passes it.
        let mut last_tick = Instant::now();
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
                positions: &positions,
                floors: &mut floors,
                notices: notices.as_ref(),
                budget: &budget,
            };
            let Some(watermark) = drain(&mut rings, &mut held, &out, &counters, delay, false).await
            else {
                return Ok(()); // downstream is gone
            };
            if last_tick.elapsed() >= TICK_EVERY
                && let Some(w) = watermark
            {
                last_tick = Instant::now();
                // A full queue: the pipeline is behind, and its batches
                // move its clock meanwhile; the next tick comes later.
                let _ = out.try_send(Msg::Tick(w));
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
    /// Device, scheduler, bystander (the order of `Held`).
    positions: &'a [RingPositions; 3],
    floors: &'a mut Floors,
    notices: Option<&'a mpsc::Sender<LoaderNotice>>,
    budget: &'a QueueBudget,
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
    // Counted here, published once per read (an atomic add per record
    // was a tenth of this loop's time).
    let mut consumed = [0u64; DROP_SLOTS as usize];
    let mut n = 0;
    while n < limit {
        let Some(item) = ring.next() else { break };
        n += 1;
        match events::decode(&item) {
            Ok(event) => {
                consumed[event.kind() as usize] += 1;
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
    for (total, n) in counters.consumed.iter().zip(consumed) {
        if n > 0 {
            total.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// The records read but not handed on yet (see [`read_batch`]), per ring
/// (device, scheduler, bystander: the order ties are broken in), each in
/// time order.
pub(crate) type Held = [Vec<Event>; 3];

/// Reads up to a batch from `ring` into `into` (kept in time order).
fn read_all(
    ring: &mut RingBuf<MapData>,
    positions: &RingPositions,
    into: &mut Vec<Event>,
    counters: &ReaderCounters,
    notices: Option<&mpsc::Sender<LoaderNotice>>,
) -> RingRead {
    let before = into.len();
    read_ring(ring, into, BATCH, None, counters, notices);
    let n = into.len() - before;
    // The last record in ring order (reserved last), before sorting.
    let last_ts = (n > 0).then(|| into[into.len() - 1].ts());
    // The held part is sorted already; the new records join it.
    sort_nearly_sorted(into, before.saturating_sub(1));
    let end = if n == BATCH {
        ReadEnd::BatchFull
    } else if positions.unread() {
        ReadEnd::Blocked
    } else {
        ReadEnd::Empty
    };
    RingRead { end, last_ts }
}

/// One batch from the three rings, in time order: every CPU's records
/// (switches above all: a CPU's track must never go back in time) and a
/// thread's device calls before its exit, whichever ring they came in.
///
/// Records are held until no ring can still hold an earlier one: up to the
/// [`Floors`]' watermark (`now` is taken before the rings are read). They
/// go out sorted by time (stable: on a tie the device ring, then the
/// scheduler ring, then the bystander ring). At the end (`flush`)
/// everything goes, once no ring has more to give: a whole batch read, or
/// (while `flush.settle` lasts) a record being filled.
fn read_batch(
    rings: &mut Rings,
    held: &mut Held,
    counters: &ReaderCounters,
    flush: Option<Flush>,
) -> BatchRead {
    let now = crate::host::boottime_ns();
    let [device, sched, bystander] = held;
    let [pos_device, pos_sched, pos_bystander] = rings.positions;
    let reads = [
        read_all(rings.device, pos_device, device, counters, None),
        read_all(rings.sched, pos_sched, sched, counters, rings.notices),
        read_all(rings.bystander, pos_bystander, bystander, counters, None),
    ];
    for (ring, read) in reads.iter().enumerate() {
        rings.floors.note(ring, *read, now);
    }
    // At the end, a ring that refills as fast as it is read (a switch
    // storm) is read until its records are from after the stop: those
    // belong to no recording.
    let read_on = reads.iter().any(|r| {
        r.end == ReadEnd::BatchFull && flush.is_none_or(|f| r.last_ts.is_none_or(|t| t <= f.stop))
    });
    let blocked = reads.iter().any(|r| r.end == ReadEnd::Blocked);
    let settling = flush.is_some_and(|f| f.settle) && blocked;
    let watermark = if flush.is_some() && !read_on && !settling {
        u64::MAX
    } else {
        rings.floors.watermark()
    };
    BatchRead {
        events: release(held, watermark),
        read_on,
        settling,
        watermark,
    }
}

/// The last drain's terms (see [`read_batch`]).
#[derive(Clone, Copy)]
struct Flush {
    /// When the recording stopped.
    stop: u64,
    /// Whether to wait for records being filled yet.
    settle: bool,
}

/// What [`read_batch`] gives.
struct BatchRead {
    /// Records in time order, up to `watermark`.
    events: Vec<Event>,
    /// A ring had a whole batch: read again at once.
    read_on: bool,
    /// The last drain waits for a record being filled.
    settling: bool,
    /// Every record stamped up to it was read.
    watermark: u64,
}

/// How long the last drain waits for records still being filled (their
/// programs finish within microseconds, or the few milliseconds a
/// hypervisor holds a virtual CPU).
const FLUSH_SETTLE: Duration = Duration::from_millis(50);

/// The held records stamped at or before `watermark`, in time order
/// (stable; on a tie, in ring order); the rest stay held. Each ring's
/// records are in time order already, so this merges them: every record
/// is moved once.
fn release(held: &mut Held, watermark: u64) -> Vec<Event> {
    // Each ring: its records up to the watermark (moved out without a
    // copy), the rest stay held (the last millisecond or so: a short copy).
    // Vectors come from the pool (see `batch_pool`).
    let parts = held.each_mut().map(|ring| {
        let n = ring.partition_point(|e| e.ts() <= watermark);
        if n == 0 {
            return Vec::new();
        }
        let mut rest = batch_pool::take();
        rest.extend(ring.drain(n..));
        std::mem::replace(ring, rest)
    });
    let busy = parts.iter().filter(|p| !p.is_empty()).count();
    if busy <= 1 {
        // One ring had records (usual): they are the batch as they are.
        return parts
            .into_iter()
            .find(|p| !p.is_empty())
            .unwrap_or_default();
    }
    let mut out = batch_pool::take();
    out.reserve(parts.iter().map(Vec::len).sum());
    let mut parts = parts;
    {
        let mut heads = parts.each_mut().map(|p| p.drain(..).peekable());
        loop {
            // The earliest head; on a tie the first ring's (stable).
            let next = heads
                .iter_mut()
                .enumerate()
                .filter_map(|(i, p)| p.peek().map(|e| (e.ts(), i)))
                .min();
            let Some((_, i)) = next else { break };
            out.extend(heads[i].next());
        }
    }
    for p in parts {
        batch_pool::give(p);
    }
    out
}

/// Sorts `v` by time, stably, where `v[..sorted]` is sorted already. A
/// ring is in time order but for records of different CPUs stamped within
/// the same microsecond or so (a program stamps, then reserves), so nearly
/// every record is at most a few places from where it belongs: an
/// insertion sort moves each such record a few places, where a general
/// sort (even an adaptive one) copies every record through a scratch
/// buffer. Past a budget of moves (records far from their place), the
/// general sort takes over.
fn sort_nearly_sorted(v: &mut [Event], sorted: usize) {
    let budget = 8 * v.len() + 64;
    let mut moves = 0;
    for i in sorted.max(1)..v.len() {
        let ts = v[i].ts();
        if v[i - 1].ts() <= ts {
            continue;
        }
        // `v[..i]` is sorted; the record goes after the last one not later
        // than it (stable).
        let mut j = i - 1;
        while j > 0 && v[j - 1].ts() > ts {
            j -= 1;
        }
        moves += i - j;
        if moves > budget {
            v.sort_by_key(Event::ts);
            return;
        }
        v[j..=i].rotate_right(1);
    }
}

/// How often collect tells the pipeline how far its records are complete.
const TICK_EVERY: Duration = Duration::from_millis(100);

/// Drains everything available. Returns None if the consumer hung up,
/// else the watermark of the last read: every record stamped up to it was
/// handed on (None inside when the drain stopped at its batch bound with
/// records still held back).
async fn drain(
    rings: &mut Rings<'_>,
    held: &mut Held,
    out: &mpsc::Sender<Msg>,
    counters: &ReaderCounters,
    delay: Duration,
    flush: bool,
) -> Option<Option<u64>> {
    // Rings that refill as fast as they are read (a switch storm) must not
    // keep the caller from its stop signal: bounded, unless this is the last
    // drain, which reads what came before the stop (see `read_batch`).
    let stop = flush.then(crate::host::boottime_ns);
    let settle_until = Instant::now() + FLUSH_SETTLE;
    let mut batches = 0;
    loop {
        batches += 1;
        if stop.is_none() && batches > MAX_BATCHES_PER_DRAIN {
            return Some(None);
        }
        let flush = stop.map(|stop| Flush {
            stop,
            settle: Instant::now() < settle_until,
        });
        let read = read_batch(rings, held, counters, flush);
        if read.events.is_empty() {
            if read.read_on {
                continue; // all held back: read on
            }
            if read.settling {
                tokio::time::sleep(Duration::from_micros(200)).await;
                continue;
            }
            return Some(Some(read.watermark));
        }
        let share = rings.budget.hold(&read.events).await;
        if out.send(Msg::Events(read.events, share)).await.is_err() {
            return None;
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if !read.read_on && !read.settling {
            return Some(Some(read.watermark));
        }
    }
}

/// Batches one drain reads before it lets the caller look at its stop
/// signal and timer again (it comes back at once when the rings are still
/// full: their readiness or the drain timer).
const MAX_BATCHES_PER_DRAIN: usize = 64;

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
        // Three rings: the scheduler ring has cpu 0's 5 and cpu 1's 10;
        // the device ring a record of cpu 0 at 5 too (a tie: the device
        // ring's goes first); the bystander ring cpu 0's 4.
        let mut held: Held = [
            vec![at(0, 5, 2)],
            vec![at(0, 5, 1), at(1, 10, 1)],
            vec![at(0, 4, 3)],
        ];
        let out = release(&mut held, 6);
        assert_eq!(order(&out), vec![(0, 4, 3), (0, 5, 2), (0, 5, 1)]);
        assert_eq!(order(&held[1]), vec![(1, 10, 1)], "10 waits");
        assert!(held[0].is_empty() && held[2].is_empty());
        // The next read brings cpu 1's 7 (another ring): it still goes out
        // before the held 10.
        held[2].push(at(1, 7, 3));
        held[1].push(at(0, 12, 1));
        let out = release(&mut held, 11);
        assert_eq!(order(&out), vec![(1, 7, 3), (1, 10, 1)]);
        let out = release(&mut held, u64::MAX);
        assert_eq!(order(&out), vec![(0, 12, 1)]);
        assert!(held.iter().all(Vec::is_empty));
    }

    /// The sort keeps equal times in their order and sorts any input: a
    /// ring's near order, a reversed batch (past the budget), and runs.
    #[test]
    fn nearly_sorted_records_sort_stably() {
        let mut v = vec![
            at(0, 2, 1),
            at(1, 1, 1),
            at(0, 3, 1),
            at(1, 3, 2),
            at(0, 2, 2),
        ];
        sort_nearly_sorted(&mut v, 0);
        assert_eq!(
            order(&v),
            vec![(1, 1, 1), (0, 2, 1), (0, 2, 2), (0, 3, 1), (1, 3, 2)]
        );
        let mut rev: Vec<Event> = (0..500).rev().map(|t| at(0, t / 2, t as u32)).collect();
        sort_nearly_sorted(&mut rev, 0);
        let got = order(&rev);
        let mut want = got.clone();
        want.sort_by_key(|&(_, ts, tid)| (ts, std::cmp::Reverse(tid)));
        assert_eq!(got, want, "stable: of equal times, the earlier read first");
        // Pseudo-random small displacements, as a ring's records have.
        let mut x = 7u64;
        let mut jitter: Vec<Event> = (0..2000u64)
            .map(|i| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                at((x >> 60) as u32, i * 10 + (x >> 33) % 25, i as u32)
            })
            .collect();
        let mut want = order(&jitter);
        want.sort_by_key(|&(_, ts, _)| ts);
        sort_nearly_sorted(&mut jitter, 0);
        assert_eq!(order(&jitter), want);
    }
}
