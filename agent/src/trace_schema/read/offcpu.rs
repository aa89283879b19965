//! The ranks' main threads' off-CPU intervals, rebuilt from a trace's
//! scheduler switches for the offline driver by the interpret stage's own
//! tracker (`analysis::offcpu`): a main thread leaves a CPU at a switch
//! (asleep, or runnable and preempted by the task switched to) and comes
//! back at the next switch to it on any CPU. The task that took the CPU
//! is named by the switch; it is a task of the traced job when the trace
//! knows its process (process tree, new-task events, thread tracks: the
//! agent writes those for the tasks it follows), else an outsider, its
//! process from the "preempted by" instant the Perfetto sink wrote at
//! that switch. The off-CPU stack taken at the switch (a callstack sample
//! at the same instant) comes with the interval: the data loader is known
//! by its frames.
//!
//! Memory: the main threads' switches of the trace (the offline driver
//! holds the trace's records anyway).

use std::collections::HashMap;
use std::sync::Arc;

use super::switches::{CpuRunning, Switched, taken_at_switch};
use crate::analysis::jobs::JobLabels;
use crate::analysis::offcpu::OffCpuTracker;
use crate::events::Comm;
use crate::model::{Preemptor, Record, Stack, SymFrame};
use crate::state::REPORT_PREEMPTED;
use xpuscope_common::COMM_LEN;

struct Left {
    ts: u64,
    cpu: u32,
    state: i64,
    /// The task switched to, and its comm.
    next: i32,
    next_comm: String,
}

#[derive(Default)]
struct MainThread {
    left: Vec<Left>,
    resumed: Vec<u64>,
    /// (ts, function names root first).
    stacks: Vec<(u64, Vec<String>)>,
    /// Outsiders that took its CPU: ts -> (pid, comm).
    preempted: HashMap<u64, (u32, String)>,
}

/// One trace's scheduler view of its ranks' main threads.
#[derive(Default)]
pub struct MainThreadSwitches {
    /// By pid (the main thread's tid is the pid).
    threads: HashMap<i32, MainThread>,
    /// Every task of the job the trace knows: tid -> pid.
    traced: HashMap<i32, i32>,
    /// The job labels of its processes (a traced task of another job
    /// preempts as an outsider).
    jobs: JobLabels,
    running: CpuRunning,
}

/// A task name as the kernel's fixed-size, NUL-terminated `comm`.
pub(super) fn comm(s: &str) -> Comm {
    let mut c = [0u8; COMM_LEN];
    let n = s.len().min(COMM_LEN - 1);
    c[..n].copy_from_slice(&s.as_bytes()[..n]);
    Comm(c)
}

impl MainThreadSwitches {
    /// Rebuilds `pid`'s main thread's intervals (a rank).
    pub fn follow(&mut self, pid: i32) {
        self.threads.entry(pid).or_default();
    }

    /// A task of the job (a thread track, a process tree's entry).
    pub fn thread(&mut self, pid: i32, tid: i32) {
        self.traced.insert(tid, pid);
    }

    /// A new task of `parent`: a thread of its process, or a process.
    pub fn new_task(&mut self, parent: i32, child: i32, clone_flags: u64) {
        const CLONE_THREAD: u64 = 0x0001_0000;
        let pid = if clone_flags & CLONE_THREAD != 0 {
            self.traced.get(&parent).copied().unwrap_or(parent)
        } else {
            let from = self.traced.get(&parent).copied().unwrap_or(parent);
            self.jobs.forked(child as u32, from as u32);
            child
        };
        self.traced.insert(child, pid);
    }

    /// Process `pid`'s identity names job `job`.
    pub fn identified(&mut self, pid: i32, job: Option<&str>) {
        self.jobs.identified(pid as u32, job);
    }

    /// A switch on `cpu` at `ts` to `next` (named `next_comm`); the task
    /// leaving was in `state` (report format).
    pub fn switch(&mut self, cpu: u32, ts: u64, state: i64, next: i32, next_comm: &str) {
        let Switched::Changed { left } = self.running.switch(cpu, next) else {
            return;
        };
        if let Some(prev) = left
            && let Some(t) = self.threads.get_mut(&prev)
        {
            t.left.push(Left {
                ts,
                cpu,
                state,
                next,
                next_comm: next_comm.to_owned(),
            });
        }
        if let Some(t) = self.threads.get_mut(&next) {
            t.resumed.push(ts);
        }
    }

    /// A "preempted by" instant on thread `tid` of `pid`.
    pub fn preempted(&mut self, pid: i32, tid: i32, ts: u64, by_pid: u32, by_comm: &str) {
        if pid == tid
            && let Some(t) = self.threads.get_mut(&pid)
        {
            t.preempted.insert(ts, (by_pid, by_comm.to_owned()));
        }
    }

    /// An off-CPU callstack sample of thread `tid` of `pid` at `ts`.
    pub fn stack(&mut self, pid: i32, tid: i32, ts: u64, functions: &[&str]) {
        if pid == tid
            && let Some(t) = self.threads.get_mut(&pid)
        {
            t.stacks
                .push((ts, functions.iter().map(|f| (*f).to_owned()).collect()));
        }
    }

    /// The intervals as `Record::OffCpu` at their ends (when the live
    /// agent hands them on); `id` maps a trace's pid or tid to the
    /// detectors' unique one. Each main thread's switches, put in time
    /// order (the CPUs' bundles come in any order), go through the live
    /// agent's own [`OffCpuTracker`].
    pub fn into_records(self, id: impl Fn(i32) -> u32, out: &mut Vec<(u64, Record)>) {
        let MainThreadSwitches {
            threads,
            traced,
            jobs,
            ..
        } = self;
        for (pid, mut t) in threads {
            t.stacks.sort_by_key(|s| s.0);
            // (time, the switch-out; None: back on a CPU). At one instant
            // it is back before it leaves again.
            let mut switches: Vec<(u64, Option<&Left>)> = t
                .resumed
                .iter()
                .map(|&r| (r, None))
                .chain(t.left.iter().map(|l| (l.ts, Some(l))))
                .collect();
            switches.sort_by_key(|&(ts, l)| (ts, l.is_some()));
            let tid = id(pid);
            let mut tracker = OffCpuTracker::default();
            for (ts, left) in switches {
                match left {
                    Some(l) => {
                        let preempted_by = (l.state == 0 || l.state == REPORT_PREEMPTED)
                            .then(|| preemptor(pid, &t, l, &traced, &jobs, &id))
                            .flatten();
                        tracker.switched_out(tid, tid, l.cpu, l.ts, l.state, preempted_by);
                        if let Some(stack) = stack_at(&t.stacks, l.ts) {
                            tracker.stack_taken(tid, l.ts, stack);
                        }
                    }
                    None => {
                        if let Some(i) = tracker.switched_in(tid, ts) {
                            out.push((i.end, Record::OffCpu(i)));
                        }
                    }
                }
            }
            // A dying thread's last switch-out never comes back: what is
            // still open is left out (the live agent ends it at the exit).
        }
    }
}

/// Who took the CPU from main thread `main` at a runnable switch-out: a
/// task of its job, or an outsider (another job's traced task; else its
/// process as the sink named it, the task itself if not).
fn preemptor(
    main: i32,
    t: &MainThread,
    l: &Left,
    traced: &HashMap<i32, i32>,
    jobs: &JobLabels,
    id: &impl Fn(i32) -> u32,
) -> Option<Preemptor> {
    if l.next == 0 {
        return None;
    }
    let (pid, in_job) = match traced.get(&l.next) {
        Some(&pid) => (pid, !jobs.different(main as u32, pid as u32)),
        None => (
            t.preempted.get(&l.ts).map_or(l.next, |(p, _)| *p as i32),
            false,
        ),
    };
    let name = match (l.next_comm.as_str(), t.preempted.get(&l.ts)) {
        ("", Some((_, c))) => c.as_str(),
        (n, _) => n,
    };
    Some(Preemptor {
        tid: id(l.next),
        tgid: id(pid),
        comm: comm(name),
        in_job,
    })
}

fn stack_at(stacks: &[(u64, Vec<String>)], ts: u64) -> Option<Arc<Stack>> {
    let functions = taken_at_switch(stacks, ts)?;
    let frame = |f: &String| SymFrame {
        function: Arc::from(f.as_str()),
        module: Arc::from("[trace]"),
        module_start: 0,
        module_end: 0,
        module_offset: 0,
        rel_pc: 0,
    };
    Some(Arc::new(Stack {
        kernel: Vec::new(),
        // Leaf first, as a live stack.
        user: functions.iter().rev().map(frame).collect(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::OffCpuInterval;

    fn intervals(s: MainThreadSwitches) -> Vec<OffCpuInterval> {
        let mut out = Vec::new();
        s.into_records(|p| p as u32 + 1000, &mut out);
        let mut v: Vec<OffCpuInterval> = out
            .into_iter()
            .map(|(ts, r)| match r {
                Record::OffCpu(i) => {
                    assert_eq!(ts, i.end, "handed on at its end");
                    i
                }
                other => panic!("{other:?}"),
            })
            .collect();
        v.sort_by_key(|i| i.start);
        v
    }

    #[test]
    fn main_thread_intervals_with_who_took_the_cpu_and_the_stack() {
        let mut s = MainThreadSwitches::default();
        s.follow(10);
        s.thread(10, 10);
        // A job's thread (its process is known from a new-task event) and
        // an outsider named by the sink's instant.
        s.new_task(10, 11, 0x0001_0000);
        s.new_task(1, 50, 0x11);
        s.new_task(50, 51, 0x0001_0000);
        s.switch(0, 10000, 0, 10, "rank0");
        // Asleep in the loader, back on CPU 1.
        s.stack(
            10,
            10,
            20000,
            &["main", "DataLoader.__next__", "futex_wait"],
        );
        s.switch(0, 20000, 1, 0, "swapper/0");
        s.switch(1, 30000, 0, 10, "rank0");
        // Preempted by the job's own thread 11, back on CPU 1.
        s.switch(1, 40000, 0, 11, "pt_autograd");
        s.switch(1, 45000, 0, 10, "rank0");
        // Preempted by thread 51 of process 50 (launched in the job).
        s.switch(1, 50000, 0x100, 51, "noisy");
        s.switch(1, 60000, 0, 10, "rank0");
        // Preempted by an outsider the trace does not know.
        s.preempted(10, 10, 70000, 77, "kworker");
        s.switch(1, 70000, 0, 78, "kworker");
        s.switch(1, 76000, 0, 10, "rank0");
        // The last switch-out (it died) never comes back.
        s.switch(1, 90000, 0x10, 0, "swapper/1");
        let v = intervals(s);
        assert_eq!(v.len(), 4, "{v:#?}");
        assert_eq!((v[0].start, v[0].end, v[0].cpu), (20_000, 30_000, 0));
        assert!(v[0].preempted_by.is_none(), "asleep");
        let frames: Vec<&str> = v[0]
            .stack
            .as_ref()
            .unwrap()
            .leaf_first()
            .map(|f| &*f.function)
            .collect();
        assert_eq!(frames, ["futex_wait", "DataLoader.__next__", "main"]);
        let by = |i: &OffCpuInterval| {
            let p = i.preempted_by.as_ref().unwrap();
            (p.tgid, p.comm.as_str().into_owned(), p.in_job)
        };
        assert_eq!(by(&v[1]), (1010, "pt_autograd".into(), true));
        assert_eq!(by(&v[2]), (1050, "noisy".into(), true));
        assert_eq!(by(&v[3]), (1077, "kworker".into(), false));
        assert!(v[1].stack.is_none());
        assert!(v.iter().all(|i| i.tgid == 1010 && i.tid == 1010));
    }

    /// Two jobs in one trace (a service's): a traced task of the other
    /// job takes the rank's CPU as an outsider; the rank's own worker,
    /// forked from it before its label was read, does not.
    #[test]
    fn another_jobs_traced_task_preempts_as_an_outsider() {
        let mut s = MainThreadSwitches::default();
        s.follow(10);
        s.thread(10, 10);
        s.thread(20, 20);
        s.new_task(10, 11, 0);
        s.new_task(20, 21, 0);
        s.identified(10, Some("a"));
        s.identified(20, Some("b"));
        s.switch(0, 1_000, 0, 10, "rank-a");
        s.switch(0, 2_000, 0, 20, "rank-b");
        s.switch(0, 3_000, 0, 10, "rank-a");
        s.switch(0, 4_000, 0, 21, "pt_worker");
        s.switch(0, 5_000, 0, 10, "rank-a");
        s.switch(0, 6_000, 0, 11, "pt_worker");
        s.switch(0, 7_000, 0, 10, "rank-a");
        let by: Vec<(u32, bool)> = intervals(s)
            .iter()
            .map(|i| {
                let p = i.preempted_by.as_ref().unwrap();
                (p.tgid, p.in_job)
            })
            .collect();
        assert_eq!(by, [(1020, false), (1021, false), (1011, true)]);
    }
}
