//! The step breakdown of each rank (MindInsight-style step trace), from
//! its main thread's device calls and its time off CPU.
//!
//! Both drivers feed the same [`StepTracker`]: `agent attach` from the
//! record stream (`sinks/summary/steps.rs`: device-call and off-CPU
//! records), `agent merge` from a node's recorded trace (`merge/steps.rs`:
//! slices, scheduler switches and off-CPU stacks). The tracker sees only
//! what both have: a rank's main-thread calls as they return, and its
//! off-CPU intervals, each already classified.
//!
//! A step is anchored on the rank's gradient all-reduce (the n-th
//! all-reduce on its data-parallel communicator is step n): it ends when
//! the host has synchronised after it (the first stream sync after the
//! all-reduce's own sync: the optimizer's), and starts where the previous
//! one ended. The first step has no earlier end and is not reported. Per
//! step:
//! - `data_wait`: the main thread's time off CPU between the step's start
//!   and its first collective or sync while getting its batch: intervals
//!   asleep, or whose off-CPU stack holds a data-loader frame
//!   ([`DATA_LOADER_FRAMES`]); `--stacks all` gives every interval its
//!   stack;
//! - `preempted`: the other off-CPU time in that stretch (runnable, kept
//!   off its CPU: host contention; frame-pointer stacks often lose the
//!   caller of a libc function, so a preemption in the loader's queue
//!   hand-off can land here);
//! - `grad_sync`: from the end of the call before the all-reduce (the end
//!   of backward) to the end of the all-reduce's stream sync: what the
//!   rank spent getting its gradients synchronised, arriving late included;
//! - `comm_wait`: time in syncs that waited for a collective (exposed
//!   communication, the all-reduce's included);
//! - `compute_wait`: time in other syncs (the host waiting for compute);
//! - `host`: the rest (host work, launches, gaps).
//!
//! Which all-reduce communicator is the data-parallel one is known only
//! once the communicators are (`groups`), so a rank's steps are kept per
//! all-reduce communicator until then ([`StepCandidates`]).
//!
//! Memory: a few words per device call and per off-CPU interval of each
//! rank's main thread, dropped when the rank's steps are computed.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use xpuscope_probes::catalog::CommOp;

use super::groups::Groups;

/// A rank's steps per all-reduce communicator (hash) it anchors on.
pub type CommSteps = BTreeMap<u64, Vec<Step>>;

/// pid -> all-reduce communicator -> the steps it anchors.
pub type StepCandidates = BTreeMap<i32, CommSteps>;

/// Function names (case-insensitive substrings) of a data loader's
/// frames: the simulator's `dataloader_next`, PyTorch's
/// `DataLoader.__next__`/`_next_data`, generic `data_loader`.
pub const DATA_LOADER_FRAMES: &[&str] = &["dataloader", "data_loader", "_next_data"];

/// Whether an off-CPU stack is waiting in the data loader.
pub fn in_data_loader<S: AsRef<str>>(functions: impl IntoIterator<Item = S>) -> bool {
    functions.into_iter().any(|f| {
        let f = f.as_ref().as_bytes();
        DATA_LOADER_FRAMES
            .iter()
            .any(|p| contains_ignoring_ascii_case(f, p.as_bytes()))
    })
}

/// Whether each off-CPU stack waits in the data loader, kept per stack
/// `Arc`: a thread that blocks where it blocked before comes with the same
/// `Arc` (the interpret stage's stack memo), and the frames' names are not
/// searched again. The `Arc` is held, so its address keys no other stack.
#[derive(Default)]
pub struct DataLoaderStacks {
    by_stack: rustc_hash::FxHashMap<usize, (std::sync::Arc<crate::model::Stack>, bool)>,
}

/// Most stacks [`DataLoaderStacks`] keeps before it starts over.
const DATA_LOADER_STACKS: usize = 4096;

impl DataLoaderStacks {
    pub fn in_data_loader(&mut self, stack: &std::sync::Arc<crate::model::Stack>) -> bool {
        let key = std::sync::Arc::as_ptr(stack) as usize;
        if let Some((_, verdict)) = self.by_stack.get(&key) {
            return *verdict;
        }
        let verdict = in_data_loader(stack.leaf_first().map(|f| &*f.function));
        if self.by_stack.len() >= DATA_LOADER_STACKS {
            self.by_stack.clear();
        }
        self.by_stack.insert(key, (stack.clone(), verdict));
        verdict
    }
}

/// Whether `haystack` contains `needle` (lower-case ASCII), whatever the
/// case of its ASCII letters; without the lower-cased copy a plain
/// `contains` would need (every off-CPU stack of a main thread asks).
fn contains_ignoring_ascii_case(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty()
        || haystack
            .windows(needle.len())
            .any(|w| w.eq_ignore_ascii_case(needle))
}

/// Report-format `prev_state` bits of a task that went to sleep
/// (interruptible or not).
pub const SLEEPING: i64 = 0x1 | 0x2;

/// What a main-thread call was, for the breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// A collective on `comm` (its hash; its handle when set-up was not
    /// seen), enqueued on `stream`.
    Collective {
        comm: u64,
        stream: Option<u64>,
        op: CommOp,
    },
    /// A synchronisation with a stream (`None`: the device or an event).
    Sync {
        stream: Option<u64>,
    },
    /// Device work enqueued on `stream` (a kernel launch, an async copy or
    /// memset, a graph launch): recorded at `--probe-level 1` and up.
    Work {
        stream: Option<u64>,
    },
    Other,
}

/// Why the main thread was off its CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffCpuKind {
    /// Asleep, or kept off its CPU inside the data loader.
    Waiting,
    /// Runnable, kept off its CPU elsewhere (host contention).
    Preempted,
}

impl OffCpuKind {
    /// From the report-format state it left its CPU in and whether its
    /// off-CPU stack (when one was taken) is in the data loader.
    pub fn classify(prev_state: i64, in_loader: bool) -> Self {
        if prev_state & SLEEPING != 0 || in_loader {
            OffCpuKind::Waiting
        } else {
            OffCpuKind::Preempted
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A collective on (communicator, stream), its op.
    Collective(u64, Option<u64>, CommOp),
    /// A sync of a stream (`None`: the device or an event); whether it
    /// waited for a collective.
    Sync(Option<u64>, bool),
    /// Device work enqueued on a stream.
    Work(Option<u64>),
    Other,
}

#[derive(Clone, Copy, Debug)]
struct Mark {
    start: u64,
    end: u64,
    kind: Kind,
}

#[derive(Default)]
struct RankThread {
    /// Streams with a collective not yet synced.
    pending: HashSet<u64>,
    marks: Vec<Mark>,
    /// (left the CPU, back on it, asleep or in the data loader).
    off_cpu: Vec<(u64, u64, bool)>,
    /// Steps computed when the marks were compacted, per communicator.
    done: CommSteps,
    /// Communicators given up on at a compaction: they held the marks
    /// back (too few all-reduces to anchor steps on).
    given_up: BTreeSet<u64>,
    /// Steps numbered so far per communicator (those in `done` and those
    /// already taken from it).
    numbered: BTreeMap<u64, u64>,
}

/// Collects what the breakdown needs, per followed rank (by pid).
pub struct StepTracker {
    threads: HashMap<i32, RankThread>,
    /// Marks a rank keeps before its finished steps are computed and the
    /// marks before them dropped.
    mark_limit: usize,
}

impl Default for StepTracker {
    /// Keeps every mark until the end: the input's off-CPU intervals may
    /// come after its calls (`agent merge` pairs switches at the end).
    fn default() -> Self {
        Self::with_mark_limit(usize::MAX)
    }
}

impl StepTracker {
    /// Computes a rank's finished steps whenever it holds `limit` marks
    /// (its calls and off-CPU intervals must then come in time order, as
    /// the record stream gives them), so memory stays bounded however long
    /// the recording.
    pub fn with_mark_limit(limit: usize) -> Self {
        Self {
            threads: HashMap::default(),
            mark_limit: limit.max(8),
        }
    }

    /// Follows `pid`'s main thread from now on.
    pub fn follow(&mut self, pid: i32) {
        self.threads.entry(pid).or_default();
    }

    pub fn follows(&self, pid: i32) -> bool {
        self.threads.contains_key(&pid)
    }

    /// A call of `pid`'s main thread from `start` to `end`, given in the
    /// order the calls returned (a sync waited for a collective when one
    /// was enqueued on its stream since the stream's last sync).
    pub fn call(&mut self, pid: i32, start: u64, end: u64, kind: CallKind) {
        let Some(t) = self.threads.get_mut(&pid) else {
            return;
        };
        let kind = match kind {
            CallKind::Collective { comm, stream, op } => {
                if let Some(s) = stream {
                    t.pending.insert(s);
                }
                Kind::Collective(comm, stream, op)
            }
            CallKind::Sync { stream } => {
                Kind::Sync(stream, stream.is_some_and(|s| t.pending.remove(&s)))
            }
            CallKind::Work { stream } => Kind::Work(stream),
            CallKind::Other => Kind::Other,
        };
        t.marks.push(Mark { start, end, kind });
        if t.marks.len() >= self.mark_limit {
            t.compact(self.mark_limit);
        }
    }

    /// `pid`'s main thread was off its CPU from `start` to `end`.
    pub fn off_cpu(&mut self, pid: i32, start: u64, end: u64, kind: OffCpuKind) {
        if let Some(t) = self.threads.get_mut(&pid) {
            t.off_cpu
                .push((start, end.max(start), kind == OffCpuKind::Waiting));
        }
    }

    /// The steps computed so far (at compactions) of every followed rank,
    /// taken out of the tracker: a caller that writes them as they come
    /// keeps its memory bounded however long the recording.
    pub fn take_finished(&mut self) -> StepCandidates {
        let mut out = StepCandidates::new();
        for (pid, t) in &mut self.threads {
            t.done.retain(|_, steps| !steps.is_empty());
            if !t.done.is_empty() {
                out.insert(*pid, std::mem::take(&mut t.done));
            }
        }
        out
    }

    /// Marks and off-CPU intervals held for the ranks (for tests of
    /// bounded memory).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.threads
            .values()
            .map(|t| t.marks.len() + t.off_cpu.len())
            .sum()
    }

    /// `pid`'s steps per all-reduce communicator; forgets the pid (its
    /// process ended, or the recording did).
    pub fn finish_process(&mut self, pid: i32) -> Option<CommSteps> {
        let t = self.threads.remove(&pid)?;
        Some(t.steps())
    }

    /// The steps of every followed rank for each communicator it
    /// all-reduced on.
    pub fn finish(self) -> StepCandidates {
        self.threads
            .into_iter()
            .map(|(pid, t)| (pid, t.steps()))
            .collect()
    }
}

impl RankThread {
    /// All-reducing communicators of the marks kept, but those given up.
    fn comms(&self) -> BTreeSet<u64> {
        self.marks
            .iter()
            .filter_map(|m| match m.kind {
                Kind::Collective(c, _, CommOp::AllReduce) if !self.given_up.contains(&c) => Some(c),
                _ => None,
            })
            .collect()
    }

    /// `steps` computed over the marks kept, numbered after those done.
    fn record_done(&mut self, c: u64, steps: impl IntoIterator<Item = Step>) {
        let done = self.done.entry(c).or_default();
        let numbered = self.numbered.entry(c).or_default();
        let base = *numbered;
        let before = done.len();
        done.extend(steps.into_iter().map(|mut s| {
            s.step += base;
            s
        }));
        *numbered += (done.len() - before) as u64;
    }

    /// Computes every finished step (one whose optimizer sync is followed
    /// by a later collective) and drops the marks and intervals before the
    /// anchor of the last one: the next steps start from it.
    fn compact(&mut self, limit: usize) {
        self.marks.sort_by_key(|m| m.start);
        self.off_cpu.sort_unstable();
        let mut keep: Vec<(u64, usize)> = Vec::new();
        for c in self.comms() {
            let steps = breakdown_anchored(&self.marks, &self.off_cpu, c);
            let first = self
                .marks
                .iter()
                .position(|m| matches!(m.kind, Kind::Collective(x, _, CommOp::AllReduce) if x == c))
                .unwrap_or(0);
            let finished: Vec<(Step, usize)> = steps
                .into_iter()
                .take_while(|(_, _, closed)| *closed)
                .map(|(s, anchor, _)| (s, anchor))
                .collect();
            keep.push((c, finished.last().map_or(first, |(_, a)| *a)));
            self.record_done(c, finished.into_iter().map(|(s, _)| s));
        }
        // A communicator that all-reduces too rarely to anchor steps would
        // hold every mark: give up on it.
        let floor = self.marks.len().saturating_sub(limit / 2);
        for (c, from) in &keep {
            if *from < floor {
                self.given_up.insert(*c);
            }
        }
        let cut = keep
            .iter()
            .filter(|(c, _)| !self.given_up.contains(c))
            .map(|(_, from)| *from)
            .min()
            .unwrap_or(floor);
        let Some(from_ts) = self.marks.get(cut).map(|m| m.start) else {
            return;
        };
        self.marks.drain(..cut);
        self.off_cpu.retain(|(s, _, _)| *s >= from_ts);
    }

    fn steps(mut self) -> CommSteps {
        self.marks.sort_by_key(|m| m.start);
        self.off_cpu.sort_unstable();
        for c in self.comms() {
            let steps = breakdown(&self.marks, &self.off_cpu, c);
            self.record_done(c, steps);
        }
        self.done.retain(|_, steps| !steps.is_empty());
        self.done
    }
}

/// One step of one rank (ns; times in the recording's BOOTTIME, or the
/// merged trace's time base).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Step {
    pub step: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub dur_ns: u64,
    pub data_wait_ns: u64,
    pub preempted_ns: u64,
    pub grad_sync_ns: u64,
    pub comm_wait_ns: u64,
    pub compute_wait_ns: u64,
    pub host_ns: u64,
    /// Device busy computing, as the host sees it: from the first work
    /// enqueued on a stream since its last sync to the end of the sync
    /// that waited for it (launches are recorded at `--probe-level 1`;
    /// without them, the syncs that waited for compute alone: a lower
    /// bound).
    pub compute_ns: u64,
    /// Communication in flight: each collective from its call to the end
    /// of the first sync of its stream (or of the device) after it.
    pub comm_ns: u64,
    /// Communication not overlapped by compute (`comm_ns` less its
    /// overlap with `compute_ns`'s intervals).
    pub exposed_comm_ns: u64,
}

impl Step {
    /// Its duration and parts, by the names the step table's columns, the
    /// stats JSON's keys and the step slices' arguments use.
    pub fn parts(&self) -> [(&'static str, u64); 10] {
        [
            ("dur_ns", self.dur_ns),
            ("data_wait_ns", self.data_wait_ns),
            ("preempted_ns", self.preempted_ns),
            ("grad_sync_ns", self.grad_sync_ns),
            ("comm_wait_ns", self.comm_wait_ns),
            ("compute_wait_ns", self.compute_wait_ns),
            ("host_ns", self.host_ns),
            ("compute_ns", self.compute_ns),
            ("comm_ns", self.comm_ns),
            ("exposed_comm_ns", self.exposed_comm_ns),
        ]
    }

    /// The part the step spent most of its time in, and how long.
    pub fn dominant_part(&self) -> (&'static str, u64) {
        [
            ("data wait", self.data_wait_ns),
            ("preemption", self.preempted_ns),
            ("communication wait", self.comm_wait_ns),
            ("compute wait", self.compute_wait_ns),
            ("host", self.host_ns),
        ]
        .into_iter()
        .max_by_key(|p| p.1)
        .unwrap_or(("host", 0))
    }
}

/// The data-parallel communicator of each global rank (its hash).
pub fn dp_comm_by_rank(groups: &Groups) -> std::collections::HashMap<u32, u64> {
    let mut dp = std::collections::HashMap::new();
    for c in groups.communicators.iter().filter(|c| c.kind == "dp") {
        let Ok(hash) = u64::from_str_radix(&c.comm_hash, 16) else {
            continue;
        };
        for r in c.members.iter().flatten() {
            dp.insert(*r, hash);
        }
    }
    dp
}

/// A rank's steps: those anchored on its data-parallel communicator when
/// the groups name one, else on its only all-reducing communicator (a
/// recording that began after the communicators were set up knows no
/// communicator's identity, so no groups; a data-parallel job's only
/// all-reduce is its gradients').
pub fn rank_steps(mut candidates: CommSteps, dp: Option<u64>) -> Vec<Step> {
    match dp {
        Some(c) => candidates.remove(&c).unwrap_or_default(),
        None if candidates.len() == 1 => candidates.into_values().next().unwrap_or_default(),
        None => Vec::new(),
    }
}

/// "rank 3 step 12  41.20 ms  mostly data wait (30.10 ms); grad sync
/// 2.00 ms" for the `n` slowest steps of `rows` (rank, step).
pub fn slowest_lines<'a>(rows: impl IntoIterator<Item = (u32, &'a Step)>, n: usize) -> Vec<String> {
    let mut slowest: Vec<(u32, &Step)> = rows.into_iter().collect();
    slowest.sort_by_key(|(r, s)| (std::cmp::Reverse(s.dur_ns), *r, s.step));
    slowest
        .into_iter()
        .take(n)
        .map(|(rank, s)| {
            let (what, ns) = s.dominant_part();
            format!(
                "rank {:<4} step {:<5} {:>9.2} ms  mostly {what} ({:.2} ms); grad sync {:.2} ms",
                rank,
                s.step,
                s.dur_ns as f64 / 1e6,
                ns as f64 / 1e6,
                s.grad_sync_ns as f64 / 1e6
            )
        })
        .collect()
}

/// A step's device-side parts (ns).
struct DeviceParts {
    compute: u64,
    comm: u64,
    exposed: u64,
}

/// Merges `iv` into disjoint intervals, in time order.
pub(crate) fn union(mut iv: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    iv.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(iv.len());
    for (s, e) in iv {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

pub(crate) fn total(iv: &[(u64, u64)]) -> u64 {
    iv.iter().map(|(s, e)| e - s).sum()
}

/// Overlap of two unions of disjoint sorted intervals.
pub(crate) fn overlap(a: &[(u64, u64)], b: &[(u64, u64)]) -> u64 {
    let (mut i, mut j, mut sum) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        let (s, e) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        sum += e.saturating_sub(s);
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    sum
}

/// Compute and communication of a step from its calls (in start order),
/// as the host sees them: a stream's work runs from its first enqueue
/// since the stream's last sync until the next sync of the stream (or the
/// device) returns; a collective from its call until then. Work and
/// collectives no sync of the step covers count up to their call's end.
fn device_parts<'a>(marks: impl Iterator<Item = &'a Mark>, end: u64) -> DeviceParts {
    // Per stream: the first work enqueued since its last sync.
    let mut work: Vec<(Option<u64>, u64)> = Vec::new();
    let mut colls: Vec<(Option<u64>, u64, u64)> = Vec::new();
    let (mut compute, mut comm) = (Vec::new(), Vec::new());
    for m in marks {
        match m.kind {
            Kind::Work(stream) => {
                if !work.iter().any(|(s, _)| *s == stream) {
                    work.push((stream, m.start));
                }
            }
            Kind::Collective(_, stream, _) => colls.push((stream, m.start, m.end)),
            Kind::Sync(stream, waited_comm) => {
                let covers = |s: &Option<u64>| stream.is_none() || *s == stream;
                let mut synced = false;
                work.retain(|(s, from)| {
                    if covers(s) {
                        compute.push((*from, m.end));
                        synced = true;
                        return false;
                    }
                    true
                });
                colls.retain(|(s, from, _)| {
                    if covers(s) {
                        comm.push((*from, m.end));
                        return false;
                    }
                    true
                });
                // Without launches recorded, a sync that waited for
                // compute is the only sign of it.
                if !synced && !waited_comm {
                    compute.push((m.start, m.end));
                }
            }
            Kind::Other => {}
        }
    }
    comm.extend(colls.into_iter().map(|(_, s, e)| (s, e)));
    let clip = |iv: Vec<(u64, u64)>| {
        union(
            iv.into_iter()
                .map(|(s, e)| (s, e.min(end).max(s)))
                .collect(),
        )
    };
    let (compute, comm) = (clip(compute), clip(comm));
    let c = total(&comm);
    DeviceParts {
        compute: total(&compute),
        comm: c,
        exposed: c - overlap(&comm, &compute).min(c),
    }
}

fn breakdown(marks: &[Mark], off_cpu: &[(u64, u64, bool)], dp: u64) -> Vec<Step> {
    breakdown_anchored(marks, off_cpu, dp)
        .into_iter()
        .map(|(s, _, _)| s)
        .collect()
}

/// The steps anchored on `dp`'s all-reduces, each with the index of its
/// anchor and whether it is finished (a collective follows its syncs).
fn breakdown_anchored(
    marks: &[Mark],
    off_cpu: &[(u64, u64, bool)],
    dp: u64,
) -> Vec<(Step, usize, bool)> {
    // (end of the call before the anchor, grad sync end, step end, anchor
    // index, finished)
    let mut ends = Vec::new();
    for (i, m) in marks.iter().enumerate() {
        let Kind::Collective(c, _, CommOp::AllReduce) = m.kind else {
            continue;
        };
        if c != dp {
            continue;
        }
        let mut syncs = marks[i + 1..]
            .iter()
            .take_while(|n| !matches!(n.kind, Kind::Collective(..)))
            .filter(|n| matches!(n.kind, Kind::Sync(..)));
        let Some(grad) = syncs.next() else {
            continue;
        };
        let end = syncs.next().map_or(grad.end, |s| s.end);
        let after = i
            .checked_sub(1)
            .map_or(m.start, |p| marks[p].end.min(m.start));
        let finished = marks[i + 1..]
            .iter()
            .any(|n| matches!(n.kind, Kind::Collective(..)));
        ends.push((after, grad.end, end, i, finished));
    }
    let mut steps = Vec::new();
    for (n, w) in ends.windows(2).enumerate() {
        let (start, (anchor, grad_end, end, index, finished)) = (w[0].2, w[1]);
        // Marks and intervals are sorted by start: look only at this step's.
        let from = marks.partition_point(|m| m.start < start);
        let inside = marks[from..]
            .iter()
            .take_while(|m| m.start <= end)
            .filter(|m| m.end <= end);
        let (mut comm_wait, mut compute_wait) = (0, 0);
        for m in inside.clone() {
            match m.kind {
                Kind::Sync(_, true) => comm_wait += m.end - m.start,
                Kind::Sync(_, false) => compute_wait += m.end - m.start,
                _ => {}
            }
        }
        // The first collective or sync: calls at the very start (the
        // previous step's activity flush, frees) come before the data wait.
        let first_call = inside
            .clone()
            .filter(|m| matches!(m.kind, Kind::Collective(..) | Kind::Sync(..)))
            .map(|m| m.start)
            .min()
            .unwrap_or(end);
        let (mut data_wait, mut preempted) = (0, 0);
        let from = off_cpu.partition_point(|(s, _, _)| *s < start);
        for (s, e, waiting) in off_cpu[from..]
            .iter()
            .take_while(|(s, _, _)| *s < first_call)
        {
            let off = (*e).min(first_call) - s;
            if *waiting {
                data_wait += off;
            } else {
                preempted += off;
            }
        }
        let device = device_parts(inside, end);
        let dur = end - start;
        let step = Step {
            step: n as u64 + 1,
            start_ns: start,
            end_ns: end,
            dur_ns: dur,
            data_wait_ns: data_wait,
            preempted_ns: preempted,
            grad_sync_ns: grad_end - anchor,
            comm_wait_ns: comm_wait,
            compute_wait_ns: compute_wait,
            host_ns: dur.saturating_sub(data_wait + preempted + comm_wait + compute_wait),
            compute_ns: device.compute,
            comm_ns: device.comm,
            exposed_comm_ns: device.exposed,
        };
        steps.push((step, index, finished));
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    const AR: CallKind = CallKind::Collective {
        comm: 9,
        stream: Some(2),
        op: CommOp::AllReduce,
    };
    const TP: CallKind = CallKind::Collective {
        comm: 5,
        stream: Some(1),
        op: CommOp::AllGather,
    };

    fn sync(stream: u64) -> CallKind {
        CallKind::Sync {
            stream: Some(stream),
        }
    }

    #[test]
    fn steps_run_from_optimizer_sync_to_optimizer_sync() {
        let mut t = StepTracker::default();
        t.follow(42);
        let calls = [
            // step 0
            (100, 110, TP),
            (120, 300, sync(1)),
            (400, 405, AR),
            (406, 600, sync(2)),
            (610, 700, sync(2)),
            // step 1: data wait 700..1000, first call at 1100
            (1100, 1110, TP),
            (1120, 1300, sync(1)),
            (1400, 1405, AR),
            (1406, 1700, sync(2)),
            (1710, 1800, sync(2)),
        ];
        for (s, e, k) in calls {
            t.call(42, s, e, k);
            t.call(7, s, e, k); // not followed
        }
        // Asleep 705..1000 for data, preempted in the loader 1002..1007,
        // preempted 1010..1050 in host work.
        for (s, e, k) in [
            (150, 290, OffCpuKind::Waiting),
            (1010, 1050, OffCpuKind::Preempted),
            (705, 1000, OffCpuKind::Waiting),
            (1002, 1007, OffCpuKind::classify(0, true)),
            (1130, 1290, OffCpuKind::classify(1, false)),
        ] {
            t.off_cpu(42, s, e, k);
        }
        let steps = t.finish_process(42).expect("followed");
        assert!(t.finish_process(42).is_none(), "forgotten");
        assert_eq!(
            steps,
            CommSteps::from([(
                9,
                vec![Step {
                    step: 1,
                    start_ns: 700,
                    end_ns: 1800,
                    dur_ns: 1100,
                    data_wait_ns: 295 + 5,
                    preempted_ns: 40,
                    grad_sync_ns: 1700 - 1300,
                    comm_wait_ns: 180 + 294,
                    compute_wait_ns: 90,
                    host_ns: 1100 - 300 - 40 - 474 - 90,
                    // The all-gather until its stream's sync, the
                    // all-reduce until its own; the optimizer's sync is
                    // the only compute seen without launches.
                    compute_ns: 90,
                    comm_ns: 200 + 300,
                    exposed_comm_ns: 500,
                }]
            )])
        );
        assert!(t.finish().is_empty());
    }

    /// `steps` steps of 10 calls and 2 off-CPU intervals each, in time
    /// order; a second all-reduce communicator (4) used once, early.
    fn job(t: &mut StepTracker, steps: u64) {
        t.follow(1);
        t.call(
            1,
            10,
            20,
            CallKind::Collective {
                comm: 4,
                stream: Some(3),
                op: CommOp::AllReduce,
            },
        );
        t.call(1, 21, 30, sync(3));
        for k in 0..steps {
            let b = 1_000 + k * 1_000;
            t.off_cpu(1, b + 5, b + 40 + k % 7, OffCpuKind::Waiting);
            t.off_cpu(1, b + 45, b + 50, OffCpuKind::Preempted);
            for (i, (s, e)) in [(60, 70), (80, 90), (100, 110)].into_iter().enumerate() {
                let kind = if i == 1 { TP } else { CallKind::Other };
                t.call(1, b + s, b + e, kind);
            }
            t.call(1, b + 120, b + 300, sync(1));
            t.call(1, b + 400 + k % 3, b + 405, AR);
            t.call(1, b + 406, b + 600 + k % 5, sync(2));
            t.call(1, b + 610, b + 700, CallKind::Other);
            t.call(1, b + 710, b + 800 + k % 11, sync(2));
            t.call(1, b + 810, b + 820, CallKind::Other);
        }
    }

    #[test]
    fn a_bounded_rank_gets_the_same_steps() {
        let mut all = StepTracker::default();
        job(&mut all, 200);
        let mut bounded = StepTracker::with_mark_limit(64);
        job(&mut bounded, 200);
        assert!(bounded.threads[&1].marks.len() < 64);
        assert!(bounded.threads[&1].off_cpu.len() < 40);
        let (all, bounded) = (all.finish(), bounded.finish());
        assert_eq!(all[&1][&9].len(), 199);
        assert_eq!(all[&1][&9], bounded[&1][&9], "the data-parallel steps");
        assert!(!bounded[&1].contains_key(&4), "given up: it held the marks");
    }

    #[test]
    fn launches_give_compute_and_hide_the_communication_they_overlap() {
        let work = |stream| CallKind::Work {
            stream: Some(stream),
        };
        let mut t = StepTracker::default();
        t.follow(1);
        for b in [0, 10_000] {
            let calls = [
                (b + 100, b + 110, work(1)),
                (b + 120, b + 130, work(1)),
                // A collective on the compute stream (tensor parallel):
                // in flight until the compute stream's sync.
                (b + 140, b + 150, TP),
                (b + 160, b + 170, work(1)),
                (b + 200, b + 1_000, sync(1)),
                (b + 1_100, b + 1_110, AR),
                (b + 1_120, b + 2_000, sync(2)),
                (b + 2_010, b + 2_020, work(1)),
                (b + 2_100, b + 3_000, sync(1)),
            ];
            for (s, e, k) in calls {
                t.call(1, s, e, k);
            }
        }
        let steps = &t.finish()[&1][&9];
        let s = &steps[0];
        assert_eq!((s.start_ns, s.end_ns), (3_000, 13_000));
        // Compute: 10_100..11_000 and 12_010..13_000.
        assert_eq!(s.compute_ns, 900 + 990);
        // Communication: 10_140..11_000 (hidden by compute) and
        // 11_100..12_000 (exposed).
        assert_eq!(s.comm_ns, 860 + 900);
        assert_eq!(s.exposed_comm_ns, 900);
        assert!(s.exposed_comm_ns <= s.comm_ns && s.comm_ns <= s.dur_ns);
    }

    #[test]
    fn a_rank_without_groups_uses_its_only_all_reduce() {
        let step = |n| Step {
            step: n,
            ..Step::default()
        };
        let one = CommSteps::from([(4, vec![step(1)])]);
        let two = CommSteps::from([(4, vec![step(1)]), (5, vec![step(2)])]);
        assert_eq!(rank_steps(one.clone(), None), vec![step(1)]);
        assert_eq!(rank_steps(two.clone(), Some(5)), vec![step(2)]);
        assert_eq!(rank_steps(two, None), vec![], "ambiguous");
        assert_eq!(rank_steps(one, Some(9)), vec![], "not on its DP group");
    }

    #[test]
    fn data_loader_frames_of_sim_and_pytorch() {
        assert!(in_data_loader([
            "main",
            "train_step",
            "dataloader_next",
            "futex_wait"
        ]));
        assert!(in_data_loader(["_PyEval", "_next_data"]));
        assert!(!in_data_loader(["main", "dispatch_host_work", "schedule"]));
    }

    #[test]
    fn the_slowest_steps_name_their_dominant_part() {
        let s = |step, dur, data, comm| Step {
            step,
            dur_ns: dur,
            data_wait_ns: data,
            comm_wait_ns: comm,
            host_ns: dur - data - comm,
            ..Step::default()
        };
        let a = s(3, 50_000_000, 40_000_000, 1_000_000);
        let b = s(4, 20_000_000, 0, 15_000_000);
        let c = s(5, 10_000_000, 0, 0);
        let lines = slowest_lines([(1, &c), (0, &a), (2, &b)], 2);
        assert_eq!(lines.len(), 2);
        assert!(
            lines[0].starts_with("rank 0    step 3")
                && lines[0].contains("50.00 ms  mostly data wait (40.00 ms)"),
            "{lines:?}"
        );
        assert!(lines[1].contains("mostly communication wait (15.00 ms)"));
    }
}
