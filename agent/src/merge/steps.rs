//! The step breakdown of each rank (MindInsight-style step trace), from
//! its main thread's device calls and scheduling.
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
//! Memory: a few words per device call and per sleep of each rank's main
//! thread (the steps are only known once the communicators are).

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap as HashMap;

/// pid -> all-reduce communicator -> the steps it anchors.
pub type StepCandidates = BTreeMap<i32, BTreeMap<u64, Vec<Step>>>;

use xpuscope_perfetto::rewrite::{EventKind, EventView};

use super::collectives::{Observed, sync_stream};

/// Function names (case-insensitive substrings) of a data loader's
/// frames: the simulator's `dataloader_next`, PyTorch's
/// `DataLoader.__next__`/`_next_data`, generic `data_loader`.
pub const DATA_LOADER_FRAMES: &[&str] = &["dataloader", "data_loader", "_next_data"];

/// Whether an off-CPU stack is waiting in the data loader.
pub fn in_data_loader(functions: &[&str]) -> bool {
    functions.iter().any(|f| {
        let f = f.to_ascii_lowercase();
        DATA_LOADER_FRAMES.iter().any(|p| f.contains(p))
    })
}

/// Linux `prev_state` bits of a task that went to sleep.
const SLEEPING: i64 = 0x1 | 0x2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A collective on (communicator, stream), its op.
    Collective(u64, Option<u64>, &'static str),
    /// A stream sync; whether it waited for a collective.
    Sync(bool),
    Other,
}

#[derive(Clone, Copy, Debug)]
struct Mark {
    start: u64,
    end: u64,
    kind: Kind,
}

#[derive(Default)]
struct MainThread {
    open: Vec<(u64, Kind, Option<u64>)>,
    /// Streams with a collective not yet synced.
    pending: HashMap<u64, ()>,
    marks: Vec<Mark>,
    /// Left a CPU (asleep or not) / came back on a CPU: CPUs' bundles
    /// arrive in any order, so they are paired once all are in.
    slept: Vec<(u64, bool)>,
    resumed: Vec<u64>,
    /// Off-CPU stacks: (left the CPU, in the data loader).
    stacks: Vec<(u64, bool)>,
}

impl MainThread {
    /// (left the CPU, back on a CPU, asleep) intervals, in time order.
    fn sleeps(&self) -> Vec<(u64, u64, bool)> {
        let mut slept = self.slept.clone();
        let mut resumed = self.resumed.clone();
        slept.sort_unstable();
        resumed.sort_unstable();
        let mut out = Vec::new();
        let mut r = 0;
        for (s, asleep) in slept {
            while r < resumed.len() && resumed[r] < s {
                r += 1;
            }
            if let Some(&e) = resumed.get(r) {
                out.push((s, e, asleep));
            }
        }
        out
    }
}

/// Collects what the breakdown needs while a node's trace is scanned.
#[derive(Default)]
pub struct StepTracker {
    /// By pid (the main thread is tid == pid).
    threads: HashMap<i32, MainThread>,
    /// Per CPU: the task running.
    running: Vec<Option<i32>>,
}

impl StepTracker {
    /// Follows `pid`'s main thread from now on.
    pub fn follow(&mut self, pid: i32) {
        self.threads.entry(pid).or_default();
    }

    /// A device call event on thread `tid` of process `pid`.
    pub fn event(&mut self, pid: i32, tid: i32, event: &EventView<'_>, call: Option<&Observed>) {
        if pid != tid {
            return;
        }
        let Some(t) = self.threads.get_mut(&pid) else {
            return;
        };
        match event.kind {
            EventKind::Begin => {
                let (kind, stream) = match (call, sync_stream(event)) {
                    (Some(o), _) => (
                        Kind::Collective(o.call.comm_hash.unwrap_or(0), o.call.stream, o.call.op),
                        None,
                    ),
                    (None, Some(stream)) => (Kind::Sync(false), stream),
                    (None, None) => (Kind::Other, None),
                };
                t.open.push((event.ts, kind, stream));
            }
            EventKind::End => {
                let Some((start, mut kind, stream)) = t.open.pop() else {
                    return;
                };
                match kind {
                    Kind::Collective(_, Some(s), _) => {
                        t.pending.insert(s, ());
                    }
                    Kind::Sync(_) => {
                        let waited = stream.is_some_and(|s| t.pending.remove(&s).is_some());
                        kind = Kind::Sync(waited);
                    }
                    _ => {}
                }
                t.marks.push(Mark {
                    start,
                    end: event.ts,
                    kind,
                });
            }
            _ => {}
        }
    }

    /// An off-CPU stack of thread `tid` of `pid`, taken as it left the CPU
    /// at `ts`.
    pub fn stack(&mut self, pid: i32, tid: i32, ts: u64, functions: &[&str]) {
        if pid == tid
            && let Some(t) = self.threads.get_mut(&pid)
        {
            t.stacks.push((ts, in_data_loader(functions)));
        }
    }

    /// A context switch on `cpu` at `ts` to `next`; the task leaving was
    /// in `prev_state`.
    pub fn switch(&mut self, cpu: u32, ts: u64, prev_state: i64, next: i32) {
        let slot = cpu as usize;
        if slot >= self.running.len() {
            self.running.resize(slot + 1, None);
        }
        let prev = self.running[slot].replace(next);
        if prev == Some(next) {
            return;
        }
        if let Some(prev) = prev
            && let Some(t) = self.threads.get_mut(&prev)
        {
            t.slept.push((ts, prev_state & SLEEPING != 0));
        }
        if let Some(t) = self.threads.get_mut(&next) {
            t.resumed.push(ts);
        }
    }

    /// The steps of every followed rank for each communicator it
    /// all-reduced on (which one is data-parallel is known only once every
    /// node is scanned): pid -> comm hash -> steps. Consumes the marks, so
    /// a node's per-call state is freed once its scan ends.
    pub fn finish(self) -> StepCandidates {
        let mut out = StepCandidates::new();
        for (pid, t) in self.threads {
            let mut marks = t.marks.clone();
            marks.sort_by_key(|m| m.start);
            let mut stacks = t.stacks.clone();
            stacks.sort_unstable();
            let sleeps = t.sleeps();
            let comms: BTreeSet<u64> = marks
                .iter()
                .filter_map(|m| match m.kind {
                    Kind::Collective(c, _, "all_reduce") => Some(c),
                    _ => None,
                })
                .collect();
            let per: BTreeMap<u64, Vec<Step>> = comms
                .into_iter()
                .map(|c| (c, breakdown(&marks, &sleeps, &stacks, c)))
                .filter(|(_, steps)| !steps.is_empty())
                .collect();
            out.insert(pid, per);
        }
        out
    }
}

/// One step of one rank (ns; times in the node's BOOTTIME).
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
}

/// Whether the off-CPU interval that began at `ts` was spent in the data
/// loader, by its stack (taken at the same switch).
fn loader_stack(stacks: &[(u64, bool)], ts: u64) -> Option<bool> {
    const SAME_SWITCH_NS: u64 = 2_000;
    let i = stacks.partition_point(|(t, _)| *t < ts);
    let before = i.checked_sub(1).and_then(|j| stacks.get(j));
    [before, stacks.get(i)]
        .into_iter()
        .flatten()
        .min_by_key(|(t, _)| t.abs_diff(ts))
        .filter(|(t, _)| t.abs_diff(ts) <= SAME_SWITCH_NS)
        .map(|(_, l)| *l)
}

fn breakdown(
    marks: &[Mark],
    sleeps: &[(u64, u64, bool)],
    stacks: &[(u64, bool)],
    dp: u64,
) -> Vec<Step> {
    // (index of the anchor, grad sync end, step end)
    let mut ends = Vec::new();
    for (i, m) in marks.iter().enumerate() {
        let Kind::Collective(c, _, "all_reduce") = m.kind else {
            continue;
        };
        if c != dp {
            continue;
        }
        let mut syncs = marks[i + 1..]
            .iter()
            .take_while(|n| !matches!(n.kind, Kind::Collective(..)))
            .filter(|n| matches!(n.kind, Kind::Sync(_)));
        let Some(grad) = syncs.next() else {
            continue;
        };
        let end = syncs.next().map_or(grad.end, |s| s.end);
        let after = i
            .checked_sub(1)
            .map_or(m.start, |p| marks[p].end.min(m.start));
        ends.push((after, grad.end, end));
    }
    let mut steps = Vec::new();
    for (n, w) in ends.windows(2).enumerate() {
        let (start, (anchor, grad_end, end)) = (w[0].2, w[1]);
        // Marks and sleeps are sorted by start: look only at this step's.
        let from = marks.partition_point(|m| m.start < start);
        let inside = marks[from..]
            .iter()
            .take_while(|m| m.start <= end)
            .filter(|m| m.end <= end);
        let (mut comm_wait, mut compute_wait) = (0, 0);
        for m in inside.clone() {
            match m.kind {
                Kind::Sync(true) => comm_wait += m.end - m.start,
                Kind::Sync(false) => compute_wait += m.end - m.start,
                _ => {}
            }
        }
        // The first collective or sync: calls at the very start (the
        // previous step's activity flush, frees) come before the data wait.
        let first_call = inside
            .filter(|m| m.kind != Kind::Other)
            .map(|m| m.start)
            .min()
            .unwrap_or(end);
        let (mut data_wait, mut preempted) = (0, 0);
        let from = sleeps.partition_point(|(s, _, _)| *s < start);
        for (s, e, asleep) in sleeps[from..]
            .iter()
            .take_while(|(s, _, _)| *s < first_call)
        {
            let off = (*e).min(first_call) - s;
            if *asleep || loader_stack(stacks, *s) == Some(true) {
                data_wait += off;
            } else {
                preempted += off;
            }
        }
        let dur = end - start;
        steps.push(Step {
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
        });
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(start: u64, end: u64, kind: Kind) -> Mark {
        Mark { start, end, kind }
    }

    #[test]
    fn steps_run_from_optimizer_sync_to_optimizer_sync() {
        let ar = Kind::Collective(9, Some(2), "all_reduce");
        let tp = Kind::Collective(5, Some(1), "all_gather");
        let marks = [
            // step 0
            m(100, 110, tp),
            m(120, 300, Kind::Sync(true)),
            m(400, 405, ar),
            m(406, 600, Kind::Sync(true)),
            m(610, 700, Kind::Sync(false)),
            // step 1: data wait 700..1000, first call at 1100
            m(1100, 1110, tp),
            m(1120, 1300, Kind::Sync(true)),
            m(1400, 1405, ar),
            m(1406, 1700, Kind::Sync(true)),
            m(1710, 1800, Kind::Sync(false)),
        ];
        // Asleep 705..1000 for data, preempted in the loader 1002..1007,
        // preempted 1010..1050 in host work (stacks say where).
        let sleeps = [
            (150, 290, true),
            (705, 1000, true),
            (1002, 1007, false),
            (1010, 1050, false),
            (1130, 1290, true),
        ];
        let stacks = [(705, true), (1002, true), (1010, false)];
        let steps = breakdown(&marks, &sleeps, &stacks, 9);
        assert_eq!(
            steps,
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
            }]
        );
    }

    #[test]
    fn an_interval_takes_the_stack_of_its_own_switch() {
        let stacks = [(10_000, true), (50_000, false)];
        assert_eq!(loader_stack(&stacks, 10_500), Some(true));
        assert_eq!(loader_stack(&stacks, 49_000), Some(false));
        assert_eq!(loader_stack(&stacks, 30_000), None, "no stack taken there");
    }

    #[test]
    fn data_loader_frames_of_sim_and_pytorch() {
        assert!(in_data_loader(&[
            "main",
            "train_step",
            "dataloader_next",
            "futex_wait"
        ]));
        assert!(in_data_loader(&["_PyEval", "_next_data"]));
        assert!(!in_data_loader(&["main", "dispatch_host_work", "schedule"]));
    }

    #[test]
    fn sleeps_come_from_switches_of_the_main_thread() {
        let mut t = StepTracker::default();
        t.follow(42);
        t.switch(0, 10, 0, 42);
        t.switch(0, 20, 1, 0); // 42 sleeps
        t.switch(1, 25, 0, 7);
        t.switch(1, 50, 0, 42); // back, on another CPU
        t.switch(1, 60, 0, 7); // preempted: off CPU too
        t.switch(1, 70, 0, 42);
        assert_eq!(
            t.threads[&42].sleeps(),
            vec![(20, 50, true), (60, 70, false)]
        );
    }
}
