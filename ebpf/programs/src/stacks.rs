//! Off-CPU stacks: the policy deciding whether to take one, and the capture
//! of kernel and user stacks straight into a ring-buffer record (no
//! STACK_TRACE map: nothing to collide, evict or look up later).

use aya_ebpf::{EbpfContext, bindings::BPF_F_USER_STACK, helpers::generated::bpf_get_stack};
use xpuscope_common::{
    Config, DROP_SLOT_STACK_ERRORS, EventKind, MAX_STACK_DEPTH, OffCpuStack, StackBudget,
    stack_mode,
};

use crate::{
    maps::{STACK_BUDGETS, count_drop},
    ring::{Ring, reserve, submit},
};

const STACK_BYTES: u32 = (MAX_STACK_DEPTH * 8) as u32;

/// Whether the thread leaving the CPU gets its stacks taken, by policy.
#[inline(always)]
pub fn should_capture(cfg: &Config, tid: u32, now: u64) -> bool {
    match cfg.stack_mode {
        stack_mode::ALL => true,
        stack_mode::SAMPLED => take_token(cfg, tid, now),
        _ => false,
    }
}

/// Per-thread token bucket kept as nanoseconds of credit: credit accrues
/// with time up to `burst` stacks' worth, and a stack costs 1e9 / rate.
#[inline(always)]
fn take_token(cfg: &Config, tid: u32, now: u64) -> bool {
    if cfg.stack_rate == 0 {
        return false;
    }
    let cost = 1_000_000_000u64 / cfg.stack_rate as u64;
    let cap = cost * (cfg.stack_burst.max(1) as u64);
    match STACK_BUDGETS.get_ptr_mut(&tid) {
        Some(budget) => {
            // SAFETY: a value pointer from the map; the thread is switching
            // out on this CPU, so no one else updates its budget now.
            let b = unsafe { &mut *budget };
            let credit = (b.credit_ns + now.saturating_sub(b.last_ns)).min(cap);
            b.last_ns = now;
            if credit >= cost {
                b.credit_ns = credit - cost;
                true
            } else {
                b.credit_ns = credit;
                false
            }
        }
        None => {
            let fresh = StackBudget {
                credit_ns: cap - cost,
                last_ns: now,
            };
            let _ = STACK_BUDGETS.insert(&tid, &fresh, 0);
            true
        }
    }
}

/// Pushes the current task's kernel and user stacks.
#[inline(always)]
pub fn capture_off_cpu<C: EbpfContext>(
    ctx: &C,
    cfg: &Config,
    cpu: u32,
    ts: u64,
    tid: u32,
    tgid: u32,
) {
    let Some(mut entry) = reserve::<OffCpuStack>(Ring::Sched, EventKind::OffCpuStack, cpu, ts) else {
        return;
    };
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record, and each
    // buffer handed to bpf_get_stack is exactly STACK_BYTES long.
    unsafe {
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        let kernel = bpf_get_stack(
            ctx.as_ptr(),
            (*rec).kernel.as_mut_ptr().cast(),
            STACK_BYTES,
            0,
        );
        let user = bpf_get_stack(
            ctx.as_ptr(),
            (*rec).user.as_mut_ptr().cast(),
            STACK_BYTES,
            BPF_F_USER_STACK as u64,
        );
        if kernel < 0 || user < 0 {
            count_drop(DROP_SLOT_STACK_ERRORS);
        }
        (*rec).kernel_bytes = kernel as i32;
        (*rec).user_bytes = user as i32;
    }
    submit(Ring::Sched, entry, cfg);
}
