//! `sched_switch`, `sched_waking` and `sched_wakeup_new`.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_smp_processor_id},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use xpuscope_common::{EventKind, SchedSwitch, SchedWaking, switch_flags};

use crate::{
    maps::{TRACKED_CPUS, agent_tgid, config, is_target, offsets},
    ring::{Ring, now, reserve, submit},
    stacks, task,
};

/// `sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int prev_state)`
#[btf_tracepoint(function = "sched_switch")]
pub fn sched_switch(ctx: BtfTracePointContext) -> u32 {
    let prev_state: u64 = ctx.arg(3);
    try_sched_switch(&ctx, prev_state).unwrap_or(0)
}

/// [`sched_switch`] for kernels before 5.18, whose tracepoint has no
/// `prev_state` (`sched_switch(bool preempt, prev, next)`): the state is
/// the task's own `__state` as it leaves, which is what those kernels'
/// own tracepoint reports.
#[btf_tracepoint(function = "sched_switch")]
pub fn sched_switch_compat(ctx: BtfTracePointContext) -> u32 {
    let prev: *const u8 = ctx.arg(1);
    let prev_state = task::state(prev, &offsets());
    try_sched_switch(&ctx, prev_state as u64).unwrap_or(0)
}

/// `TASK_DEAD` in `task_struct::__state`.
const TASK_DEAD: u32 = 0x80;

#[inline(always)]
fn try_sched_switch(ctx: &BtfTracePointContext, prev_state: u64) -> Option<u32> {
    let preempt: u64 = ctx.arg(0);
    let prev: *const u8 = ctx.arg(1);
    let next: *const u8 = ctx.arg(2);
    let off = offsets();
    let cfg = config();
    if cfg.sched_off != 0 && cfg.system_wide == 0 {
        return Some(0);
    }
    // SAFETY: helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };

    let prev_task = task::fields(prev, &off);
    let next_task = task::fields(next, &off);
    let prev_target = is_target(prev_task.tgid);
    let next_target = is_target(next_task.tgid);

    if cfg.system_wide == 0 {
        let tracked = TRACKED_CPUS.get_ptr_mut(cpu)?;
        if prev_target || next_target {
            // SAFETY: array slot of this CPU.
            unsafe { *tracked = 1 };
        } else if unsafe { *tracked } == 0 {
            return Some(0);
        }
    }

    let mut flags = 0;
    if preempt & 1 != 0 {
        flags |= switch_flags::PREEMPT;
    }
    if prev_target {
        flags |= switch_flags::PREV_TARGET;
    }
    if next_target {
        flags |= switch_flags::NEXT_TARGET;
    }
    let ts = now();
    // A dying thread's last switch-out never ends: its stack would never be
    // used (TASK_DEAD in `__state`).
    let dying = prev_state as u32 & TASK_DEAD != 0;
    let take_stack = prev_target
        && !dying
        && prev_task.tid != 0
        && prev_task.tgid != agent_tgid()
        && stacks::should_capture(&cfg, prev_task.tid, ts);
    if take_stack {
        flags |= switch_flags::STACK_FOLLOWS;
    }

    // A switch between two untraced tasks goes to a ring of its own, so
    // that only such records can be lost to a neighbour's switch storm.
    // System-wide, every task is the subject: one ring (no bystanders, and
    // no second ring for the agent to merge in time order).
    let (ring, kind) = if prev_target || next_target || cfg.system_wide != 0 {
        (Ring::Sched, EventKind::SchedSwitch)
    } else {
        (Ring::Bystander, EventKind::BystanderSwitch)
    };
    let mut entry = reserve::<SchedSwitch>(ring, kind, cpu, ts)?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).prev_tid = prev_task.tid;
        (*rec).prev_tgid = prev_task.tgid;
        (*rec).next_tid = next_task.tid;
        (*rec).next_tgid = next_task.tgid;
        (*rec).prev_state = prev_state as u32;
        (*rec).prev_prio = prev_task.prio;
        (*rec).next_prio = next_task.prio;
        (*rec).flags = flags;
        task::comm(prev, &off, &mut (*rec).prev_comm);
        task::comm(next, &off, &mut (*rec).next_comm);
    }
    submit(ring, entry, &cfg);

    if take_stack {
        stacks::capture_off_cpu(ctx, &cfg, cpu, ts, prev_task.tid, prev_task.tgid);
    }
    Some(0)
}

/// `sched_waking(struct task_struct *p)`: fires on the waker's CPU.
#[btf_tracepoint(function = "sched_waking")]
pub fn sched_waking(ctx: BtfTracePointContext) -> u32 {
    try_waking(&ctx, EventKind::SchedWaking).unwrap_or(0)
}

/// `sched_wakeup_new(struct task_struct *p)`: a new task's first wakeup.
#[btf_tracepoint(function = "sched_wakeup_new")]
pub fn sched_wakeup_new(ctx: BtfTracePointContext) -> u32 {
    try_waking(&ctx, EventKind::SchedWakeupNew).unwrap_or(0)
}

fn try_waking(ctx: &BtfTracePointContext, kind: EventKind) -> Option<u32> {
    let wakee: *const u8 = ctx.arg(0);
    let off = offsets();
    let cfg = config();
    if cfg.sched_off != 0 && cfg.system_wide == 0 {
        return Some(0);
    }
    let wakee_task = task::fields(wakee, &off);
    // SAFETY: helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if cfg.system_wide == 0 {
        if !is_target(wakee_task.tgid) {
            return Some(0);
        }
        // The waker runs here: record this CPU's switches from now on so
        // the waker is known.
        if let Some(tracked) = TRACKED_CPUS.get_ptr_mut(cpu) {
            // SAFETY: array slot of this CPU.
            unsafe { *tracked = 1 };
        }
    }
    let waker = bpf_get_current_pid_tgid();
    let mut entry = reserve::<SchedWaking>(Ring::Sched, kind, cpu, now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = wakee_task.tid;
        (*rec).tgid = wakee_task.tgid;
        (*rec).target_cpu = task::cpu(wakee, &off);
        (*rec).prio = wakee_task.prio;
        (*rec).waker_tid = waker as u32;
        (*rec).waker_tgid = (waker >> 32) as u32;
        task::comm(wakee, &off, &mut (*rec).comm);
    }
    submit(Ring::Sched, entry, &cfg);
    Some(0)
}
