//! The step clock of the host-side detectors: each rank's training steps,
//! online, from its main thread's device calls, and what its main thread
//! did in each (its calls and its time off CPU).
//!
//! A step is anchored on the rank's gradient all-reduce, as the step
//! breakdown does (`analysis::steps`): the first communicator the main
//! thread all-reduces on is the anchor, and the n-th all-reduce on it
//! (0-based) closes step n. A step's window runs from the start of the
//! previous anchor all-reduce to the start of this one: it holds the end of
//! the previous step (its gradient sync and optimizer) and this step's data
//! wait, host work, forward and backward. The window before the first
//! all-reduce is not a step (it holds the process's start-up).
//!
//! The main thread runs one call at a time, so when its all-reduce's record
//! arrives every call and off-CPU interval of the window before it has
//! arrived too: the window is handed to the detectors then.
//!
//! Where the job marks its steps (mstx ranges named `step N`:
//! [`step_marks`](super::step_marks)), a rank's windows are its marked
//! steps instead, numbered as the job numbers them: from the start of the
//! step range to its end, calls and off-CPU intervals in between. The first
//! marked step switches the rank to its markers for good.
//!
//! Memory: a window's calls and intervals, per rank, bounded by
//! [`MAX_WINDOW_ITEMS`] (a window past it loses its oldest: a rank that
//! stopped all-reducing does not grow the agent).

use foldhash::HashMap;

use xpuscope_probes::catalog::{CallKind, CommOp};

use super::step_marks::{StepMark, StepSource};
use crate::model::{DeviceCallRecord, OffCpuInterval, process_comm_id};
use xpuscope_common::uprobe::LaunchCounts;

/// Calls or off-CPU intervals a rank's open window keeps.
pub const MAX_WINDOW_ITEMS: usize = 1 << 15;

/// What a main-thread call was, for the detectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallShape {
    /// A collective or point-to-point call; whether it is an anchor
    /// all-reduce.
    Collective {
        anchor: bool,
    },
    /// A synchronisation (stream, event, device).
    Sync,
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MainCall {
    pub start: u64,
    pub end: u64,
    pub shape: CallShape,
}

/// Who took the CPU from the runnable main thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taker {
    pub comm: String,
    pub pid: u32,
    /// Traced along with the job (a process the launcher started).
    pub in_job: bool,
}

/// A main-thread off-CPU interval, as the detectors need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MainOffCpu {
    pub start: u64,
    pub end: u64,
    /// It went to sleep (interruptible or not).
    pub asleep: bool,
    /// Its off-CPU stack (when one was taken) is in a data loader.
    pub in_loader: bool,
    /// Runnable and preempted by a task of another process.
    pub preempted_by: Option<Taker>,
    /// The CPU it left.
    pub cpu: u32,
}

/// One finished step of one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub tgid: u32,
    /// 0-based: the number of anchor all-reduces before the one closing it;
    /// or the number the job's step marker gave it.
    pub step: u64,
    pub source: StepSource,
    pub start: u64,
    pub end: u64,
    /// When the closing anchor all-reduce returned (steps from
    /// all-reduces; else `end`): the rank is surely in the step then, so
    /// its Python step counter's value then names the window.
    pub named_at: u64,
    /// In start order; the first is the previous anchor all-reduce (for
    /// steps from all-reduces).
    pub calls: Vec<MainCall>,
    /// In start order.
    pub off_cpu: Vec<MainOffCpu>,
    /// The process's launches in the step, all threads (from the kernel's
    /// counts stamped on returns); None before its first counted launch.
    pub launches: Option<LaunchCounts>,
}

impl Window {
    pub fn dur(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }
}

#[derive(Default)]
struct RankClock {
    /// The anchor communicator (hash, or handle when set-up was not seen).
    anchor: Option<u64>,
    /// Anchor all-reduces seen.
    anchors: u64,
    /// The open window's start (the last anchor all-reduce's start, or
    /// the open step range's).
    open: Option<u64>,
    /// Steps come from the job's markers (from the first one on).
    source: StepSource,
    /// The open marked step's number.
    marked_step: u64,
    calls: Vec<MainCall>,
    off_cpu: Vec<MainOffCpu>,
    /// The latest launch counts stamped on any of its returns.
    launches_now: Option<LaunchCounts>,
    /// The counts when the open window opened.
    launches_open: Option<LaunchCounts>,
}

impl RankClock {
    /// Counts stamped on a return (threads' records arrive out of order;
    /// the counts only grow).
    fn saw_launches(&mut self, l: Option<LaunchCounts>) {
        if let Some(l) = l {
            let now = self.launches_now.get_or_insert(l);
            now.kernels = now.kernels.max(l.kernels);
            now.graphs = now.graphs.max(l.graphs);
        }
    }

    /// The launches since the window opened, and the window reopened at
    /// `at` (the counts at the boundary).
    fn launches_since_open(&mut self, at: Option<LaunchCounts>) -> Option<LaunchCounts> {
        let at = at.or(self.launches_now)?;
        let open = self.launches_open.replace(at).unwrap_or_default();
        Some(LaunchCounts {
            kernels: at.kernels.saturating_sub(open.kernels),
            graphs: at.graphs.saturating_sub(open.graphs),
        })
    }
}

fn push_bounded<T>(v: &mut Vec<T>, item: T) {
    if v.len() >= MAX_WINDOW_ITEMS {
        v.drain(..MAX_WINDOW_ITEMS / 2);
    }
    v.push(item);
}

/// Every followed rank's clock (followed: a process with a rank).
#[derive(Default)]
pub struct StepClock {
    ranks: HashMap<u32, RankClock>,
    /// Emptied window vectors (see [`StepClock::recycle`]): a step's
    /// calls and off-CPU intervals go into room a finished step left,
    /// instead of vectors grown anew every step.
    spare: Spare,
}

#[derive(Default)]
struct Spare {
    calls: Vec<Vec<MainCall>>,
    off_cpu: Vec<Vec<MainOffCpu>>,
}

/// Emptied window vectors kept at most, of each kind.
const SPARE_KEPT: usize = 8;

impl Spare {
    fn keep<T>(list: &mut Vec<Vec<T>>, mut v: Vec<T>) {
        if list.len() < SPARE_KEPT && v.capacity() > 0 && v.capacity() <= MAX_WINDOW_ITEMS {
            v.clear();
            list.push(v);
        }
    }
}

impl StepClock {
    pub fn follow(&mut self, tgid: u32) {
        self.ranks.entry(tgid).or_default();
    }

    pub fn forget(&mut self, tgid: u32) {
        self.ranks.remove(&tgid);
    }

    /// A window the detectors are done with: its vectors are reused.
    pub fn recycle(&mut self, w: Window) {
        Spare::keep(&mut self.spare.calls, w.calls);
        Spare::keep(&mut self.spare.off_cpu, w.off_cpu);
    }

    #[cfg(test)]
    pub fn follows(&self, tgid: u32) -> bool {
        self.ranks.contains_key(&tgid)
    }

    /// A returned call; the window it closes, if it is the main thread's
    /// anchor all-reduce.
    pub fn device_call(&mut self, c: &DeviceCallRecord) -> Option<Window> {
        let call = &c.call;
        if let Some(r) = self.ranks.get_mut(&call.tgid) {
            r.saw_launches(call.launches);
        }
        if c.unmatched.is_some()
            || call.tid != call.tgid
            || matches!(
                call.kind,
                CallKind::Mark | CallKind::RangeStart | CallKind::RangeEnd
            )
        {
            return None;
        }
        let Self { ranks, spare } = self;
        let r = ranks.get_mut(&call.tgid)?;
        let op = call
            .comm
            .as_ref()
            .and_then(|_| CommOp::of_name(call.function));
        let shape = match (&call.comm, op) {
            (Some(cc), Some(op)) => {
                let comm = process_comm_id(cc.id_hash, Some(cc.handle));
                let anchor = op == CommOp::AllReduce && *r.anchor.get_or_insert(comm) == comm;
                CallShape::Collective { anchor }
            }
            _ if matches!(call.kind, CallKind::Sync(_)) => CallShape::Sync,
            _ => CallShape::Other,
        };
        let me = MainCall {
            start: call.start_ts,
            end: c.end_ts(),
            shape,
        };
        if r.source == StepSource::Markers || shape != (CallShape::Collective { anchor: true }) {
            if r.open.is_some() {
                push_bounded(&mut r.calls, me);
            }
            return None;
        }
        let launches = r.launches_since_open(call.launches);
        let closed = r.open.map(|start| {
            let mut calls = std::mem::replace(&mut r.calls, spare.calls.pop().unwrap_or_default());
            calls.sort_by_key(|m| m.start);
            // Intervals from the closing call on belong to the next window.
            let mut off_cpu =
                std::mem::replace(&mut r.off_cpu, spare.off_cpu.pop().unwrap_or_default());
            r.off_cpu
                .extend(off_cpu.extract_if(.., |i| i.start >= me.start));
            off_cpu.sort_by_key(|i| i.start);
            Window {
                tgid: call.tgid,
                step: r.anchors,
                source: StepSource::AllReduces,
                start,
                end: me.start,
                named_at: me.end,
                calls,
                off_cpu,
                launches,
            }
        });
        r.anchors += 1;
        r.open = Some(me.start);
        r.calls.push(me);
        closed
    }

    /// A step boundary the job marked; the window of the step it ends.
    pub fn step_mark(&mut self, m: &StepMark) -> Option<Window> {
        match *m {
            StepMark::Begin { tgid, step, ts } => {
                let r = self.ranks.get_mut(&tgid)?;
                // What came before the step's start is not the step's.
                r.source = StepSource::Markers;
                r.calls.clear();
                r.off_cpu.clear();
                r.open = Some(ts);
                r.marked_step = step;
                r.launches_open = r.launches_now;
                None
            }
            StepMark::End {
                tgid,
                step,
                start,
                end,
            } => {
                let Self { ranks, spare } = self;
                let r = ranks.get_mut(&tgid)?;
                if r.open != Some(start) || r.marked_step != step {
                    return None;
                }
                r.open = None;
                let mut calls =
                    std::mem::replace(&mut r.calls, spare.calls.pop().unwrap_or_default());
                calls.retain(|c| c.start < end);
                calls.sort_by_key(|c| c.start);
                let mut off_cpu =
                    std::mem::replace(&mut r.off_cpu, spare.off_cpu.pop().unwrap_or_default());
                off_cpu.retain(|i| i.start < end);
                off_cpu.sort_by_key(|i| i.start);
                let launches = r.launches_since_open(None);
                Some(Window {
                    tgid,
                    step,
                    source: StepSource::Markers,
                    start,
                    end,
                    named_at: end,
                    calls,
                    off_cpu,
                    launches,
                })
            }
        }
    }

    /// A finished off-CPU interval (kept when it is a followed rank's main
    /// thread's, inside a window).
    pub fn off_cpu(&mut self, i: &OffCpuInterval, in_loader: bool) {
        if i.tid != i.tgid {
            return;
        }
        let Some(r) = self.ranks.get_mut(&i.tgid) else {
            return;
        };
        if r.open.is_none() {
            return;
        }
        let preempted_by = i
            .preempted_by
            .as_ref()
            .filter(|p| p.tgid != i.tgid)
            .map(|p| Taker {
                comm: p.comm.as_str().into_owned(),
                pid: p.tgid,
                in_job: p.in_job,
            });
        push_bounded(
            &mut r.off_cpu,
            MainOffCpu {
                start: i.start,
                end: i.end.max(i.start),
                asleep: i.state & crate::analysis::steps::SLEEPING != 0,
                in_loader,
                preempted_by,
                cpu: i.cpu.into(),
            },
        );
    }
}
