//! Off-CPU intervals of traced threads: from the switch that takes a thread
//! off a CPU to the switch that puts it back, with the stack taken as it
//! left (when the sampling policy took one) and, for preemptions, the task
//! that took the CPU. Pure: fed events in order, it returns finished
//! intervals. The interpret stage feeds it the kernel's switches as they
//! come; `agent diagnose` a trace's (`trace_schema::read`), put in time
//! order per thread.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::model::{OffCpuInterval, Preemptor, Stack};

struct Open {
    tgid: u32,
    cpu: u32,
    start: u64,
    state: i64,
    stack: Option<Arc<Stack>>,
    preempted_by: Option<Preemptor>,
}

#[derive(Default)]
pub struct OffCpuTracker {
    open: FxHashMap<u32, Open>,
}

impl OffCpuTracker {
    /// A traced thread left the CPU.
    pub fn switched_out(
        &mut self,
        tid: u32,
        tgid: u32,
        cpu: u32,
        ts: u64,
        state: i64,
        preempted_by: Option<Preemptor>,
    ) {
        self.open.insert(
            tid,
            Open {
                tgid,
                cpu,
                start: ts,
                state,
                stack: None,
                preempted_by,
            },
        );
    }

    /// Since when, and in which report state, thread `tid` is off CPU.
    pub fn off_since(&self, tid: u32) -> Option<(i64, u64)> {
        self.open.get(&tid).map(|o| (o.state, o.start))
    }

    /// The stack thread `tid` left its CPU with, while it is off CPU.
    pub fn stack_of(&self, tid: u32) -> Option<Arc<Stack>> {
        self.open.get(&tid).and_then(|o| o.stack.clone())
    }

    /// The stack taken at the switch-out at `ts`.
    pub fn stack_taken(&mut self, tid: u32, ts: u64, stack: Arc<Stack>) -> bool {
        match self.open.get_mut(&tid) {
            Some(open) if open.start == ts => {
                open.stack = Some(stack);
                true
            }
            _ => false,
        }
    }

    /// A thread got a CPU: closes its interval if it had one.
    pub fn switched_in(&mut self, tid: u32, ts: u64) -> Option<OffCpuInterval> {
        let open = self.open.remove(&tid)?;
        Some(finish(tid, open, ts, false))
    }

    /// A thread exited: its interval (if any) ends here, not at trace end.
    pub fn exited(&mut self, tid: u32, ts: u64) -> Option<OffCpuInterval> {
        self.switched_in(tid, ts)
    }

    /// Closes every open interval at `end` (trace end).
    pub fn finish_all(&mut self, end: u64) -> Vec<OffCpuInterval> {
        let mut out: Vec<OffCpuInterval> = self
            .open
            .drain()
            .map(|(tid, open)| {
                let end = end.max(open.start);
                finish(tid, open, end, true)
            })
            .collect();
        out.sort_by_key(|i| (i.start, i.tid));
        out
    }

    #[cfg(test)]
    pub fn open_count(&self) -> usize {
        self.open.len()
    }
}

/// A CPU number as an interval holds it (the kernel numbers CPUs below
/// its NR_CPUS, at most 8192; saturated past u16 all the same).
pub fn cpu_of(cpu: u32) -> u16 {
    u16::try_from(cpu).unwrap_or(u16::MAX)
}

fn finish(tid: u32, open: Open, end: u64, truncated: bool) -> OffCpuInterval {
    OffCpuInterval {
        tid,
        tgid: open.tgid,
        cpu: cpu_of(open.cpu),
        start: open.start,
        end,
        state: open.state,
        stack: open.stack,
        preempted_by: open.preempted_by,
        truncated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Comm;
    use crate::model::SymFrame;
    use crate::sinks::summary::offcpu::{OffCpuSummary, reason};

    fn frame(name: &str, kernel: bool) -> SymFrame {
        let module = match (kernel, name.starts_with("__GI")) {
            (true, _) => "kernel",
            (false, true) => "/usr/lib/x86_64-linux-gnu/libc.so.6",
            (false, false) => "/bin/app",
        };
        SymFrame {
            function: Arc::from(name),
            module: Arc::from(module),
            module_start: 0,
            module_end: 0,
            module_offset: 0,
            rel_pc: 0,
        }
    }

    #[test]
    fn intervals_open_close_and_carry_stacks() {
        let mut t = OffCpuTracker::default();
        t.switched_out(10, 9, 0, 100, 0x1, None);
        let stack = Arc::new(Stack {
            kernel: vec![frame("__schedule", true), frame("futex_wait", true)],
            user: vec![
                frame("__GI___lll_lock_wait", false),
                frame("lock_it", false),
                frame("main", false),
            ],
        });
        assert!(t.stack_taken(10, 100, stack.clone()));
        assert!(
            !t.stack_taken(10, 99, stack.clone()),
            "stack of another switch"
        );
        assert!(t.switched_in(11, 150).is_none(), "never left");
        let i = t.switched_in(10, 400).unwrap();
        assert_eq!(
            (i.start, i.end, i.duration(), i.truncated),
            (100, 400, 300, false)
        );
        assert_eq!(reason(&i), "sleeping in futex_wait <- lock_it");
        let mut s = OffCpuSummary::default();
        s.add(&i);
        assert_eq!(s.by_reason["sleeping in futex_wait <- lock_it"], (300, 1));
    }

    #[test]
    fn preemptions_and_truncation() {
        let mut t = OffCpuTracker::default();
        let hog = Preemptor {
            tid: 77,
            tgid: 77,
            comm: Comm::from_str_lossy("hog"),
            in_job: false,
        };
        let sibling = Preemptor {
            tid: 11,
            tgid: 9,
            comm: Comm::from_str_lossy("loader"),
            in_job: true,
        };
        t.switched_out(10, 9, 1, 100, 0x100, Some(hog));
        t.switched_out(13, 9, 1, 200, 0x100, Some(sibling));
        t.switched_out(12, 9, 0, 50, 0x1, None);
        let rest = t.finish_all(1000);
        assert_eq!(rest.len(), 3);
        assert!(rest.iter().all(|i| i.truncated && i.end == 1000));
        let mut s = OffCpuSummary::default();
        rest.iter().for_each(|i| s.add(i));
        assert_eq!(
            s.top_preemptors(5),
            vec![("hog (77)".to_string(), 900, 1)],
            "outsiders only"
        );
        assert_eq!(s.by_own_threads, (800, 1), "a sibling thread, apart");
        assert_eq!(s.total_ns, 900 + 950 + 800);
        assert_eq!(s.with_stack_ns, 0);
        assert_eq!(t.open_count(), 0);
    }
}
