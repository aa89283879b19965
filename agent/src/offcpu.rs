//! Off-CPU intervals of traced threads: from the switch that takes a thread
//! off a CPU to the switch that puts it back, with the stack taken as it
//! left (when the sampling policy took one) and, for preemptions, the task
//! that took the CPU. Pure: fed events in order, it returns finished
//! intervals; aggregation for the summary lives here too.

use std::collections::HashMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::events::Comm;
use crate::symbolize::SymFrame;

/// Who took the CPU from a thread that was still runnable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preemptor {
    pub tid: u32,
    pub tgid: u32,
    pub comm: Comm,
}

/// A finished off-CPU interval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpuInterval {
    pub tid: u32,
    pub tgid: u32,
    pub cpu: u32,
    pub start: u64,
    pub end: u64,
    /// Report-format state at switch-out (see `state`).
    pub state: i64,
    /// Leaf first: user frames then kernel frames... see [`Stack`].
    pub stack: Option<Arc<Stack>>,
    pub preempted_by: Option<Preemptor>,
    /// The trace ended before the thread ran again.
    pub truncated: bool,
}

impl OffCpuInterval {
    pub fn duration(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }
}

/// A symbolized off-CPU stack.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Stack {
    /// Leaf first.
    pub kernel: Vec<SymFrame>,
    /// Leaf first.
    pub user: Vec<SymFrame>,
}

impl Stack {
    /// All frames leaf first: kernel frames (innermost) then user frames.
    pub fn leaf_first(&self) -> impl Iterator<Item = &SymFrame> {
        self.kernel.iter().chain(self.user.iter())
    }
}

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

fn finish(tid: u32, open: Open, end: u64, truncated: bool) -> OffCpuInterval {
    OffCpuInterval {
        tid,
        tgid: open.tgid,
        cpu: open.cpu,
        start: open.start,
        end,
        state: open.state,
        stack: open.stack,
        preempted_by: open.preempted_by,
        truncated,
    }
}

/// Kernel frames of the scheduler itself, skipped when naming a wait.
fn is_scheduler_frame(name: &str) -> bool {
    matches!(
        name,
        "__schedule" | "schedule" | "__switch_to" | "__switch_to_asm" | "preempt_schedule_common"
    ) || name.starts_with("schedule_")
        || name.starts_with("preempt_schedule")
        || name.starts_with("__cond_resched")
        || name.starts_with("entry_SYSCALL")
        || name.starts_with("do_syscall")
}

/// The C library and the dynamic loader: wrappers, not the reason for a wait.
fn is_system_library(module: &str) -> bool {
    let file = module.rsplit('/').next().unwrap_or(module);
    [
        "libc.so",
        "libc-",
        "libpthread",
        "ld-linux",
        "libm.so",
        "librt",
    ]
    .iter()
    .any(|p| file.starts_with(p))
}

/// A short human reason for an off-CPU interval: its state, the kernel
/// function it waited in, and the innermost user function.
pub fn reason(interval: &OffCpuInterval) -> String {
    let state = crate::state::label(interval.state);
    let Some(stack) = &interval.stack else {
        return format!("{state} (no stack sampled)");
    };
    let kernel = stack
        .kernel
        .iter()
        .find(|f| !is_scheduler_frame(&f.function));
    // The innermost frame of the program itself says more than the C
    // library's syscall wrapper it went through.
    let user = stack
        .user
        .iter()
        .find(|f| !is_system_library(&f.module))
        .or(stack.user.first());
    match (kernel, user) {
        (Some(k), Some(u)) => format!("{state} in {} <- {}", k.function, u.function),
        (Some(k), None) => format!("{state} in {}", k.function),
        (None, Some(u)) => format!("{state} <- {}", u.function),
        (None, None) => state.to_string(),
    }
}

/// Totals for the summary.
#[derive(Default)]
pub struct OffCpuSummary {
    /// reason -> (total ns, count)
    pub by_reason: HashMap<String, (u64, u64)>,
    /// (preemptor tid, comm) -> (total ns, count); named only when reported,
    /// since this is updated at every preemption.
    pub by_preemptor: FxHashMap<(u32, Comm), (u64, u64)>,
    pub total_ns: u64,
    pub with_stack_ns: u64,
}

impl OffCpuSummary {
    pub fn add(&mut self, interval: &OffCpuInterval) {
        let d = interval.duration();
        self.total_ns += d;
        if interval.stack.is_some() {
            self.with_stack_ns += d;
            let e = self.by_reason.entry(reason(interval)).or_default();
            e.0 += d;
            e.1 += 1;
        }
        if let Some(p) = &interval.preempted_by {
            let e = self.by_preemptor.entry((p.tid, p.comm)).or_default();
            e.0 += d;
            e.1 += 1;
        }
    }

    /// The `n` preemptors that took the most time, as "comm (tid)".
    pub fn top_preemptors(&self, n: usize) -> Vec<(String, u64, u64)> {
        let named: HashMap<String, (u64, u64)> = self
            .by_preemptor
            .iter()
            .map(|((tid, comm), v)| (format!("{} ({tid})", comm.as_str()), *v))
            .collect();
        Self::top(&named, n)
    }

    /// The `n` largest entries of `map` by total time.
    pub fn top(map: &HashMap<String, (u64, u64)>, n: usize) -> Vec<(String, u64, u64)> {
        let mut v: Vec<(String, u64, u64)> =
            map.iter().map(|(k, (t, c))| (k.clone(), *t, *c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        t.switched_out(10, 9, 1, 100, 0x100, Some(hog));
        t.switched_out(12, 9, 0, 50, 0x1, None);
        let rest = t.finish_all(1000);
        assert_eq!(rest.len(), 2);
        assert!(rest.iter().all(|i| i.truncated && i.end == 1000));
        let mut s = OffCpuSummary::default();
        rest.iter().for_each(|i| s.add(i));
        assert_eq!(s.top_preemptors(5), vec![("hog (77)".to_string(), 900, 1)]);
        assert_eq!(s.total_ns, 900 + 950);
        assert_eq!(s.with_stack_ns, 0);
        assert_eq!(t.open_count(), 0);
    }
}
