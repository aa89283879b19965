//! The step breakdown's input from a node's recorded trace: the main
//! thread's slices paired into calls, its off-CPU intervals rebuilt from
//! the scheduler's switches (by `analysis::offcpu`, the tracker the live
//! agent and `agent diagnose` use), each classified by the off-CPU stack
//! taken at the same switch. The breakdown itself is `analysis::steps`, shared with
//! `agent attach`. A rank that marks its steps (mstx `step N` ranges or
//! marks, `sinks::detect::step_marks`) has them numbered as it numbers
//! them, as `agent attach` and the detectors do.

use rustc_hash::FxHashMap as HashMap;

use xpuscope_perfetto::rewrite::{EventKind, EventView};

use crate::analysis::offcpu::OffCpuTracker;
pub use crate::analysis::steps::StepCandidates;
use crate::analysis::steps::{CallKind, OffCpuKind, SLEEPING, StepTracker, in_data_loader};

use super::collectives::Observed;
use crate::model::{OffCpuInterval, process_comm_id};
use crate::sinks::detect::step_marks::{MarkedSteps, step_number};
use crate::trace_schema::call::sync_stream;
use crate::trace_schema::keys;
use crate::trace_schema::names::{PYTHON_STEP_EVENT, function_of};
use crate::trace_schema::read::switches::{CpuRunning, SAME_SWITCH_NS, Switched, taken_at_switch};

/// Marks a rank keeps before its finished steps are computed (as
/// `agent attach` does): bounds the tracker's memory.
const MARK_LIMIT: usize = 4_096;
/// How often (trace time) the calls and switches below the watermark are
/// handed to the tracker.
const FLUSH_EVERY_NS: u64 = 100_000_000;
/// A CPU whose last switch is older than this, behind the latest switch
/// seen, no longer holds the watermark back (an idle CPU's bundle may be
/// written only at the end of the recording; its few switches are then
/// paired late, and a finished step misses them).
const STALE_CPU_NS: u64 = 2_000_000_000;

#[derive(Default)]
struct MainThread {
    /// Calls begun and not yet ended (slices nest).
    open: Vec<(u64, CallKind)>,
    /// Calls returned (in that order), not yet handed to the tracker.
    calls: std::collections::VecDeque<(u64, u64, CallKind)>,
    /// Left a CPU (with the state it left in) / came back on a CPU: CPUs'
    /// bundles arrive in any order, so they are handed to the off-CPU
    /// tracker in time order below the watermark.
    slept: Vec<(u64, i64)>,
    resumed: Vec<u64>,
    /// Off-CPU stacks: (left the CPU, in the data loader).
    stacks: Vec<(u64, bool)>,
}

impl MainThread {
    /// Events held (for tests of bounded memory).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.open.len()
            + self.calls.len()
            + self.slept.len()
            + self.resumed.len()
            + self.stacks.len()
    }

    /// Hands the switches before `below` to `offcpu` in time order (a
    /// switch-out before a switch-in at the same time: the interval ends
    /// there) and returns the intervals they close, in time order.
    /// Switches before `below` have all arrived; an interval still open
    /// there stays open in the tracker until its switch-in comes.
    fn off_cpu_below(
        &mut self,
        pid: i32,
        below: u64,
        offcpu: &mut OffCpuTracker,
    ) -> Vec<OffCpuInterval> {
        self.slept.sort_unstable();
        self.resumed.sort_unstable();
        let outs = self.slept.partition_point(|&(s, _)| s < below);
        let ins = self.resumed.partition_point(|&r| r < below);
        let tid = pid as u32;
        let mut closed = Vec::new();
        let (mut o, mut i) = (0, 0);
        while o < outs || i < ins {
            let out_first = o < outs && (i == ins || self.slept[o].0 <= self.resumed[i]);
            if out_first {
                let (ts, state) = self.slept[o];
                offcpu.switched_out(tid, tid, 0, ts, state, None);
                o += 1;
            } else {
                closed.extend(offcpu.switched_in(tid, self.resumed[i]));
                i += 1;
            }
        }
        self.slept.drain(..outs);
        self.resumed.drain(..ins);
        closed
    }
}

/// Collects what the breakdown needs while a node's trace is read, and
/// computes the steps as they finish: memory is bounded by the tracker's
/// marks and a watermark's lag of calls and switches per rank, never by
/// the trace's length.
pub struct TraceSteps {
    tracker: StepTracker,
    /// The main threads' off-CPU intervals, paired as live and offline.
    offcpu: OffCpuTracker,
    /// By pid (the main thread is tid == pid).
    threads: HashMap<i32, MainThread>,
    /// Per CPU: the task running, and the time of its last switch.
    running: CpuRunning,
    cpu_last: Vec<u64>,
    latest: u64,
    flushed_at: u64,
    /// The followed ranks' marked steps.
    marks: HashMap<i32, MarkedSteps>,
}

impl Default for TraceSteps {
    fn default() -> Self {
        TraceSteps {
            tracker: StepTracker::with_mark_limit(MARK_LIMIT),
            offcpu: OffCpuTracker::default(),
            threads: HashMap::default(),
            running: CpuRunning::default(),
            cpu_last: Vec::new(),
            latest: 0,
            flushed_at: 0,
            marks: HashMap::default(),
        }
    }
}

impl TraceSteps {
    /// Follows `pid`'s main thread from now on.
    pub fn follow(&mut self, pid: i32) {
        self.threads.entry(pid).or_default();
        self.tracker.follow(pid);
    }

    /// A device call event on thread `tid` of process `pid`.
    pub fn event(&mut self, pid: i32, tid: i32, event: &EventView<'_>, call: Option<&Observed>) {
        if event.kind == EventKind::Begin
            && self.threads.contains_key(&pid)
            && let Some(step) = marked_step(event)
        {
            self.marks.entry(pid).or_default().marker(step, event.ts);
        }
        if event.kind == EventKind::Instant
            && self.threads.contains_key(&pid)
            && let Some(step) = python_step(event)
        {
            self.marks.entry(pid).or_default().counter(step, event.ts);
        }
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
                        comm: process_comm_id(o.call.comm_hash, o.call.comm),
                        stream: o.call.stream,
                        op: o.call.op,
                    },
                    (None, Some(stream)) => CallKind::Sync { stream },
                    (None, None) if enqueues_work(event) => CallKind::Work {
                        stream: keys::STREAM.read(event),
                    },
                    (None, None) => CallKind::Other,
                };
                t.open.push((event.ts, kind));
            }
            EventKind::End => {
                if let Some((start, kind)) = t.open.pop() {
                    t.calls.push_back((start, event.ts, kind));
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
        let switched = self.running.switch(cpu, next);
        if switched == Switched::NotACpu {
            return;
        }
        let slot = cpu as usize;
        if slot >= self.cpu_last.len() {
            self.cpu_last.resize(slot + 1, 0);
        }
        self.cpu_last[slot] = self.cpu_last[slot].max(ts);
        self.latest = self.latest.max(ts);
        if let Switched::Changed { left } = switched {
            if let Some(prev) = left
                && let Some(t) = self.threads.get_mut(&prev)
            {
                t.slept.push((ts, prev_state));
            }
            if let Some(t) = self.threads.get_mut(&next) {
                t.resumed.push(ts);
            }
        }
        if self.latest >= self.flushed_at.saturating_add(FLUSH_EVERY_NS) {
            self.flushed_at = self.latest;
            self.flush(self.watermark());
        }
    }

    /// Every switch before this time has been read: each CPU's bundles
    /// come in its time order, so it is the earliest of the CPUs' last
    /// switches (but those stale for [`STALE_CPU_NS`]).
    fn watermark(&self) -> u64 {
        let stale = self.latest.saturating_sub(STALE_CPU_NS);
        self.cpu_last
            .iter()
            .copied()
            .filter(|&l| l >= stale)
            .min()
            .unwrap_or(stale)
    }

    /// Hands the tracker each rank's off-CPU intervals that began before
    /// `below` and its calls that returned before it (intervals first: a
    /// compaction computes the steps those calls finish).
    fn flush(&mut self, below: u64) {
        for (&pid, t) in &mut self.threads {
            let closed = t.off_cpu_below(pid, below, &mut self.offcpu);
            t.stacks.sort_unstable();
            for i in &closed {
                let in_loader = loader_stack(&t.stacks, i.start) == Some(true);
                let kind = if i.state & SLEEPING != 0 {
                    OffCpuKind::Waiting
                } else {
                    OffCpuKind::classify(0, in_loader)
                };
                self.tracker.off_cpu(pid, i.start, i.end, kind);
            }
            // The stacks an interval still open may need: from its start.
            let open_since = self.offcpu.off_since(pid as u32).map(|(_, s)| s);
            let oldest = [t.slept.first().map(|&(s, _)| s), open_since]
                .into_iter()
                .flatten()
                .fold(below, u64::min);
            let keep_from = oldest.saturating_sub(SAME_SWITCH_NS);
            t.stacks.retain(|&(ts, _)| ts >= keep_from);
            while let Some(&(start, end, kind)) = t.calls.front() {
                if end >= below {
                    break;
                }
                t.calls.pop_front();
                self.tracker.call(pid, start, end, kind);
            }
        }
    }

    /// Steps finished since the last call: pid -> all-reduce communicator
    /// -> steps.
    pub fn take_finished(&mut self) -> StepCandidates {
        let mut finished = self.tracker.take_finished();
        self.number_marked(&mut finished);
        finished
    }

    /// Steps of a rank that marks them take the marked step their end
    /// falls in (as `agent attach`'s step table).
    fn number_marked(&self, finished: &mut StepCandidates) {
        for (pid, per_comm) in finished.iter_mut() {
            let Some(marks) = self.marks.get(pid) else {
                continue;
            };
            for step in per_comm.values_mut().flatten() {
                if let Some(n) = marks.step_at(step.end_ns.saturating_sub(1)) {
                    step.step = n;
                }
            }
        }
    }

    /// Calls, switches, stacks, marks and intervals held (for tests of
    /// bounded memory).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.tracker.held()
            + self.offcpu.open_count()
            + self.threads.values().map(MainThread::held).sum::<usize>()
    }

    /// The steps not yet taken of every followed rank for each
    /// communicator it all-reduced on: pid -> comm hash -> steps.
    pub fn finish(mut self) -> StepCandidates {
        self.flush(u64::MAX);
        let mut finished = std::mem::take(&mut self.tracker).finish();
        self.number_marked(&mut finished);
        finished
    }
}

/// The step an mstx range's start or mark names (`message` "step N").
fn marked_step(event: &EventView<'_>) -> Option<u64> {
    if !matches!(function_of(event.name?), "mstxRangeStartA" | "mstxMarkA") {
        return None;
    }
    step_number(keys::MESSAGE.read(event)?)
}

/// The step a rank's Python step counter showed (the `python step N`
/// instant the agent writes where it first saw N).
fn python_step(event: &EventView<'_>) -> Option<u64> {
    if !event.name?.starts_with(PYTHON_STEP_EVENT) {
        return None;
    }
    keys::STEP.read(event)
}

/// Whether a call enqueued device work, by the arguments the agent gives
/// it: a kernel launch (`func`), a graph launch (`graph_exec`), a copy
/// (`kind`) or a memset (`value`).
fn enqueues_work(event: &EventView<'_>) -> bool {
    keys::FUNC.present(event)
        || keys::GRAPH_EXEC.present(event)
        || keys::MEMCPY_KIND.present(event)
        || keys::MEMSET_VALUE.present(event)
}

/// Whether the off-CPU interval that began at `ts` was spent in the data
/// loader, by its stack (taken at the same switch).
fn loader_stack(stacks: &[(u64, bool)], ts: u64) -> Option<bool> {
    taken_at_switch(stacks, ts).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::collectives::Collective;
    use xpuscope_perfetto::rewrite::ArgRef;
    use xpuscope_probes::catalog::CommOp;

    fn view<'a>(kind: EventKind, ts: u64, args: Vec<(&'a str, ArgRef<'a>)>) -> EventView<'a> {
        EventView {
            kind,
            ts,
            track: 1,
            name: Some("call"),
            args,
        }
    }

    /// One step of rank 42 from `b`: asleep 5..40 (its data), on the other
    /// CPU after; an all-reduce at 400 and two syncs of its stream.
    fn step(t: &mut TraceSteps, k: u64, b: u64) {
        let (cpu, other) = ((k % 2) as u32, ((k + 1) % 2) as u32);
        t.switch(cpu, b + 5, 1, 7);
        t.switch(other, b + 40, 0, 42);
        let ar = Observed {
            call: Collective {
                comm_hash: Some(9),
                comm: None,
                seq: Some(k),
                seq_exact: true,
                comm_rank: Some(0),
                size: Some(2),
                stream: Some(2),
                op: CommOp::AllReduce,
                p2p: None,
            },
            key: Some((9, k)),
        };
        let sync = || {
            vec![
                ("sync", ArgRef::Str("stream")),
                ("stream", ArgRef::Pointer(2)),
            ]
        };
        let calls: [(u64, u64, Option<&Observed>, bool); 5] = [
            (60, 70, None, false),
            (400, 405, Some(&ar), false),
            (406, 600, None, true),
            (610, 700, None, false),
            (710, 800, None, true),
        ];
        for (s, e, o, is_sync) in calls {
            let args = if is_sync { sync() } else { vec![] };
            t.event(42, 42, &view(EventKind::Begin, b + s, args), o);
            t.event(42, 42, &view(EventKind::End, b + e, vec![]), None);
        }
    }

    #[test]
    fn steps_come_out_as_they_finish_and_memory_stays_bounded() {
        const STEPS: u64 = 20_000;
        let mut t = TraceSteps::default();
        t.follow(42);
        t.switch(0, 10, 0, 42);
        let (mut taken, mut most) = (Vec::new(), 0);
        for k in 0..STEPS {
            step(&mut t, k, 1_000_000 * (k + 1));
            most = most.max(t.held());
            if k % 1_000 == 0 {
                taken.extend(
                    t.take_finished()
                        .remove(&42)
                        .and_then(|mut c| c.remove(&9))
                        .unwrap_or_default(),
                );
            }
        }
        // Unbounded, it would hold 14 per step: 280,000.
        assert!(most < 2 * MARK_LIMIT + 2_000, "held {most}");
        assert!(
            taken.len() > STEPS as usize / 2,
            "most steps came out early"
        );
        taken.extend(
            t.finish()
                .remove(&42)
                .and_then(|mut c| c.remove(&9))
                .unwrap_or_default(),
        );
        assert_eq!(taken.len() as u64, STEPS - 1);
        for (i, s) in taken.iter().enumerate() {
            let k = i as u64 + 1;
            assert_eq!(s.step, k);
            assert_eq!(s.end_ns, 1_000_000 * (k + 1) + 800);
            assert_eq!(s.data_wait_ns, 35, "step {k}: asleep 5..40");
            assert_eq!(s.dur_ns, 1_000_000);
        }
    }

    /// Six steps of rank 42, `number_step(t, k, ts)` giving step k its
    /// number at `ts` (just after its start); the step numbers of the rows.
    fn numbered_steps(number_step: impl Fn(&mut TraceSteps, u64, u64)) -> Vec<u64> {
        let mut t = TraceSteps::default();
        t.follow(42);
        t.switch(0, 10, 0, 42);
        for k in 0..6 {
            let b = 1_000_000 * (k + 1);
            number_step(&mut t, k, b + 1);
            step(&mut t, k, b);
        }
        let steps = t
            .finish()
            .remove(&42)
            .and_then(|mut c| c.remove(&9))
            .unwrap();
        steps.iter().map(|s| s.step).collect()
    }

    /// The rank marks each step (`step 300` ..) with an mstx range at its
    /// start: its steps carry those numbers.
    #[test]
    fn marked_steps_keep_the_jobs_numbers() {
        let numbers = numbered_steps(|t, k, ts| {
            let message = format!("step {}", 300 + k);
            let mut start = view(
                EventKind::Begin,
                ts,
                vec![("message", ArgRef::Str(&message))],
            );
            start.name = Some("mstxRangeStartA step");
            t.event(42, 42, &start, None);
            t.event(42, 42, &view(EventKind::End, ts + 1, vec![]), None);
        });
        assert_eq!(numbers, vec![301, 302, 303, 304, 305]);
    }

    /// A rank's Python step counter (the `python step N` instants the
    /// agent wrote) numbers its steps too.
    #[test]
    fn python_counted_steps_keep_the_jobs_numbers() {
        let numbers = numbered_steps(|t, k, ts| {
            let name = format!("{PYTHON_STEP_EVENT}{}", 700 + k);
            let mut seen = view(
                EventKind::Instant,
                ts,
                vec![
                    ("step", ArgRef::Uint(700 + k)),
                    ("local", ArgRef::Str("step")),
                ],
            );
            seen.name = Some(&name);
            t.event(42, 42, &seen, None);
        });
        assert_eq!(numbers, vec![701, 702, 703, 704, 705]);
    }

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
        let span = |i: &OffCpuInterval| (i.start, i.end, i.state & SLEEPING != 0);
        let th = t.threads.get_mut(&42).unwrap();
        let first = th.off_cpu_below(42, 55, &mut t.offcpu);
        assert_eq!(first.iter().map(span).collect::<Vec<_>>(), [(20, 50, true)]);
        // Off CPU again at 60: open until its switch-in is below the mark.
        assert!(th.off_cpu_below(42, 65, &mut t.offcpu).is_empty());
        let rest = th.off_cpu_below(42, u64::MAX, &mut t.offcpu);
        assert_eq!(rest.iter().map(span).collect::<Vec<_>>(), [(60, 70, false)]);
    }
}
