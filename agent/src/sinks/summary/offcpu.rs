//! Off-CPU time for the summary: totals, the top reasons a traced thread
//! waited, and who preempted it.

use std::collections::HashMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::events::Comm;
use crate::model::{OffCpuInterval, Stack};

/// A short human reason for an off-CPU interval: its state, the kernel
/// function it waited in, and the innermost user function.
pub fn reason(interval: &OffCpuInterval) -> String {
    let state = crate::state::label(interval.state);
    let Some(stack) = &interval.stack else {
        return format!("{state} (no stack sampled)");
    };
    let kernel = stack.kernel_wait();
    // The innermost frame of the program itself says more than the C
    // library's syscall wrapper it went through; in a Python thread, the
    // innermost Python function more than the interpreter's C code.
    let user = stack.own_frames().first().copied().or(stack.user.first());
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
    /// Time runnable while another thread of the job held the CPU (the
    /// job's own business, not interference): (total ns, count).
    pub by_own_threads: (u64, u64),
    pub total_ns: u64,
    pub with_stack_ns: u64,
    /// The reason of each (stack, state) seen lately: a thread blocking
    /// where it blocked before comes with the same stack `Arc` (the
    /// interpret stage's stack memo), and its reason is not built again.
    /// The `Arc` is held, so its address keys no other stack.
    reasons: FxHashMap<(usize, i64), (Arc<Stack>, String)>,
}

/// Most (stack, state) reasons kept before the cache starts over.
const CACHED_REASONS: usize = 4096;

impl OffCpuSummary {
    pub fn add(&mut self, interval: &OffCpuInterval) {
        let d = interval.duration();
        self.total_ns += d;
        if let Some(stack) = &interval.stack {
            self.with_stack_ns += d;
            let key = (Arc::as_ptr(stack) as usize, interval.state);
            if !self.reasons.contains_key(&key) {
                if self.reasons.len() >= CACHED_REASONS {
                    self.reasons.clear();
                }
                self.reasons.insert(key, (stack.clone(), reason(interval)));
            }
            let reason = &self.reasons[&key].1;
            match self.by_reason.get_mut(reason.as_str()) {
                Some(e) => {
                    e.0 += d;
                    e.1 += 1;
                }
                None => {
                    self.by_reason.insert(reason.clone(), (d, 1));
                }
            }
        }
        if let Some(p) = &interval.preempted_by {
            let e = if p.in_job {
                &mut self.by_own_threads
            } else {
                self.by_preemptor.entry((p.tid, p.comm)).or_default()
            };
            e.0 += d;
            e.1 += 1;
        }
    }

    /// The `n` preemptors from outside the job that took the most time, as
    /// "comm (tid)".
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
