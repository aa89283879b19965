//! The step breakdown's input from a node's recorded trace: the main
//! thread's slices paired into calls, its off-CPU intervals rebuilt from
//! the scheduler's switches, each classified by the off-CPU stack taken at
//! the same switch. The breakdown itself is `analysis::steps`, shared with
//! `agent attach`.

use rustc_hash::FxHashMap as HashMap;

use xpuscope_perfetto::rewrite::{EventKind, EventView};

pub use crate::analysis::steps::StepCandidates;
use crate::analysis::steps::{CallKind, OffCpuKind, SLEEPING, StepTracker, in_data_loader};

use super::collectives::{Observed, sync_stream};

#[derive(Default)]
struct MainThread {
    /// Calls begun and not yet ended (slices nest).
    open: Vec<(u64, CallKind)>,
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
pub struct TraceSteps {
    tracker: StepTracker,
    /// By pid (the main thread is tid == pid).
    threads: HashMap<i32, MainThread>,
    /// Per CPU: the task running.
    running: Vec<Option<i32>>,
}

impl TraceSteps {
    /// Follows `pid`'s main thread from now on.
    pub fn follow(&mut self, pid: i32) {
        self.threads.entry(pid).or_default();
        self.tracker.follow(pid);
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
                let kind = match (call, sync_stream(event)) {
                    (Some(o), _) => CallKind::Collective {
                        comm: o.call.comm_hash.or(o.call.comm).unwrap_or(0),
                        stream: o.call.stream,
                        op: o.call.op,
                    },
                    (None, Some(stream)) => CallKind::Sync { stream },
                    (None, None) => CallKind::Other,
                };
                t.open.push((event.ts, kind));
            }
            EventKind::End => {
                if let Some((start, kind)) = t.open.pop() {
                    self.tracker.call(pid, start, event.ts, kind);
                }
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
    /// node is scanned): pid -> comm hash -> steps.
    pub fn finish(mut self) -> StepCandidates {
        for (pid, t) in std::mem::take(&mut self.threads) {
            let mut stacks = t.stacks.clone();
            stacks.sort_unstable();
            for (s, e, asleep) in t.sleeps() {
                let in_loader = loader_stack(&stacks, s) == Some(true);
                let kind = if asleep {
                    OffCpuKind::Waiting
                } else {
                    OffCpuKind::classify(0, in_loader)
                };
                self.tracker.off_cpu(pid, s, e, kind);
            }
        }
        self.tracker.finish()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_takes_the_stack_of_its_own_switch() {
        let stacks = [(10_000, true), (50_000, false)];
        assert_eq!(loader_stack(&stacks, 10_500), Some(true));
        assert_eq!(loader_stack(&stacks, 49_000), Some(false));
        assert_eq!(loader_stack(&stacks, 30_000), None, "no stack taken there");
    }

    #[test]
    fn sleeps_come_from_switches_of_the_main_thread() {
        let mut t = TraceSteps::default();
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
