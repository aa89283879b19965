//! Process and thread lifetimes: fork (following traced processes into
//! their children), exec, exit and rename.

use aya_ebpf::{
    helpers::{bpf_get_smp_processor_id, bpf_probe_read_kernel_str_bytes},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use aya_log_ebpf::warn;
use xpuscope_common::{EventKind, ProcessExec, ProcessExit, ProcessFork, TaskRename};

use crate::{
    maps::{TARGETS, config, is_target, offsets, targets_changed},
    ring::{Ring, now, reserve, submit},
    task,
};

#[inline(always)]
fn this_cpu() -> u32 {
    // SAFETY: helper without arguments.
    unsafe { bpf_get_smp_processor_id() }
}

/// `sched_process_fork(struct task_struct *parent, struct task_struct *child)`
#[btf_tracepoint(function = "sched_process_fork")]
pub fn sched_process_fork(ctx: BtfTracePointContext) -> u32 {
    try_fork(&ctx).unwrap_or(0)
}

fn try_fork(ctx: &BtfTracePointContext) -> Option<u32> {
    let parent: *const u8 = ctx.arg(0);
    let child: *const u8 = ctx.arg(1);
    let off = offsets();
    let cfg = config();
    let p = task::fields(parent, &off);
    let c = task::fields(child, &off);
    let traced = is_target(p.tgid);
    if traced && c.tgid != p.tgid {
        if TARGETS.insert(&c.tgid, &1, 0).is_err() {
            warn!(
                ctx,
                "xpuscope: target map full, child process {} not followed", c.tgid
            );
        }
        targets_changed();
    }
    if !traced && cfg.system_wide == 0 {
        return Some(0);
    }
    let mut entry = reserve::<ProcessFork>(Ring::Sched, EventKind::ProcessFork, this_cpu(), now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).parent_tid = p.tid;
        (*rec).parent_tgid = p.tgid;
        (*rec).child_tid = c.tid;
        (*rec).child_tgid = c.tgid;
        task::comm(child, &off, &mut (*rec).child_comm);
    }
    submit(Ring::Sched, entry, &cfg);
    Some(0)
}

/// `sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)`
#[btf_tracepoint(function = "sched_process_exec")]
pub fn sched_process_exec(ctx: BtfTracePointContext) -> u32 {
    try_exec(&ctx).unwrap_or(0)
}

fn try_exec(ctx: &BtfTracePointContext) -> Option<u32> {
    let p: *const u8 = ctx.arg(0);
    let old_pid: u64 = ctx.arg(1);
    let off = offsets();
    let cfg = config();
    let t = task::fields(p, &off);
    if cfg.system_wide == 0 && !is_target(t.tgid) {
        return Some(0);
    }
    let mut entry = reserve::<ProcessExec>(Ring::Sched, EventKind::ProcessExec, this_cpu(), now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = t.tid;
        (*rec).tgid = t.tgid;
        (*rec).old_tid = old_pid as u32;
        (*rec)._pad = 0;
        task::comm(p, &off, &mut (*rec).comm);
    }
    submit(Ring::Sched, entry, &cfg);
    Some(0)
}

/// `sched_process_exit(struct task_struct *p, ...)`: every exiting thread.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn sched_process_exit(ctx: BtfTracePointContext) -> u32 {
    try_exit(&ctx).unwrap_or(0)
}

fn try_exit(ctx: &BtfTracePointContext) -> Option<u32> {
    let p: *const u8 = ctx.arg(0);
    let off = offsets();
    let cfg = config();
    let t = task::fields(p, &off);
    if cfg.system_wide == 0 && !is_target(t.tgid) {
        return Some(0);
    }
    let mut entry = reserve::<ProcessExit>(Ring::Sched, EventKind::ProcessExit, this_cpu(), now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = t.tid;
        (*rec).tgid = t.tgid;
        (*rec).prio = t.prio;
        (*rec)._pad = 0;
        task::comm(p, &off, &mut (*rec).comm);
    }
    submit(Ring::Sched, entry, &cfg);
    Some(0)
}

/// `task_rename(struct task_struct *task, const char *comm)`
#[btf_tracepoint(function = "task_rename")]
pub fn task_rename(ctx: BtfTracePointContext) -> u32 {
    try_rename(&ctx).unwrap_or(0)
}

fn try_rename(ctx: &BtfTracePointContext) -> Option<u32> {
    let p: *const u8 = ctx.arg(0);
    let new_comm: *const u8 = ctx.arg(1);
    let off = offsets();
    let cfg = config();
    let t = task::fields(p, &off);
    if cfg.system_wide == 0 && !is_target(t.tgid) {
        return Some(0);
    }
    let mut entry = reserve::<TaskRename>(Ring::Sched, EventKind::TaskRename, this_cpu(), now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record; the new
    // name is a kernel string the tracepoint hands us.
    unsafe {
        (*rec).tid = t.tid;
        (*rec).tgid = t.tgid;
        task::comm(p, &off, &mut (*rec).old_comm);
        (*rec).new_comm = [0; 16];
        if bpf_probe_read_kernel_str_bytes(new_comm, &mut (*rec).new_comm).is_err() {
            (*rec).new_comm = [0; 16];
        }
    }
    submit(Ring::Sched, entry, &cfg);
    Some(0)
}
