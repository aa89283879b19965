//! Process and thread lifetimes: fork (following traced processes into
//! their children), exec, exit and rename.
//!
//! The traced set (`TARGETS`) follows the process tree both ways: a traced
//! process's child joins it at fork, and a process leaves it when its last
//! thread exits ([`sched_process_exit`]). Leaving at exit keeps the set
//! bounded in a long run, and it is what keeps a reused pid from being
//! mistaken for the old process: the kernel hands pids out again, and an
//! entry left behind would make an unrelated process that got the pid
//! traced as if it were the old one.

use aya_ebpf::{
    helpers::{bpf_get_smp_processor_id, bpf_probe_read_kernel_str_bytes},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use aya_log_ebpf::warn;
use xpuscope_common::{
    EXIT_CODE_KNOWN, EXIT_GROUP_DEAD, EXIT_GROUP_KNOWN, EventKind, ProcessExec, ProcessExit,
    ProcessFork, TaskRename,
};

use crate::{
    maps::{
        LAUNCH_COUNTS, LAUNCH_OPEN, STACK_ENDS, TARGETS, config, is_target, offsets,
        targets_changed,
    },
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

/// `sched_process_exit(struct task_struct *p, bool group_dead)`: every
/// exiting thread; `group_dead` on the last one of its process.
///
/// `group_dead` is a tracepoint argument from Linux 6.16 on (commit
/// 3e816361e94a, "sched/tracepoints: Move and extend the
/// sched_process_exit() tracepoint"); before, the tracepoint has only the
/// task, and the verifier rejects this program's read of a second
/// argument. The agent then loads [`sched_process_exit_compat`] instead,
/// which reads the same fact from `task->signal->live` (zero once the last
/// thread is exiting) at offsets from the kernel's BTF.
///
/// Pruning is what keeps `TARGETS` bounded in a long run (16,384 entries,
/// however many short-lived children come and go) and what makes a reused
/// pid safe: the kernel may hand a dead target's pid to an unrelated
/// process, which would be traced as if it were the target had the entry
/// stayed. A child of a traced process is still added on fork, so only
/// the pid's old meaning is lost.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn sched_process_exit(ctx: BtfTracePointContext) -> u32 {
    // A bool argument is widened to a u64 slot of the context.
    let group_dead: u64 = ctx.arg(1);
    try_exit(&ctx, Some(group_dead as u8 != 0)).unwrap_or(0)
}

/// [`sched_process_exit`] for kernels before 6.16 (no `group_dead`): the
/// last thread known by `signal->live`
/// ([`task::group_dead_from_signal`]).
#[btf_tracepoint(function = "sched_process_exit")]
pub fn sched_process_exit_compat(ctx: BtfTracePointContext) -> u32 {
    let p: *const u8 = ctx.arg(0);
    try_exit(&ctx, task::group_dead_from_signal(p, &offsets())).unwrap_or(0)
}

fn try_exit(ctx: &BtfTracePointContext, group_dead: Option<bool>) -> Option<u32> {
    let p: *const u8 = ctx.arg(0);
    let off = offsets();
    let cfg = config();
    let t = task::fields(p, &off);
    let traced = is_target(t.tgid);
    // The thread's learned stack end means nothing to its tid's next user.
    let _ = STACK_ENDS.remove(&t.tid);
    let _ = LAUNCH_OPEN.remove(&t.tid);
    if traced || cfg.system_wide != 0 {
        push_exit(p, &t, group_dead, &off, &cfg);
    }
    // After the record (the process's last record while traced), and
    // whether or not the ring had room for it.
    if traced && group_dead == Some(true) {
        // Nothing to do if the agent removed it meanwhile.
        let _ = TARGETS.remove(&t.tgid);
        let _ = LAUNCH_COUNTS.remove(&t.tgid);
        targets_changed();
    }
    Some(0)
}

#[inline(always)]
fn push_exit(
    p: *const u8,
    t: &task::TaskFields,
    group_dead: Option<bool>,
    off: &xpuscope_common::TaskOffsets,
    cfg: &xpuscope_common::Config,
) -> Option<()> {
    let mut entry = reserve::<ProcessExit>(Ring::Sched, EventKind::ProcessExit, this_cpu(), now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = t.tid;
        (*rec).tgid = t.tgid;
        (*rec).prio = t.prio;
        let code = task::exit_code(p, off);
        (*rec).flags = match group_dead {
            Some(true) => EXIT_GROUP_KNOWN | EXIT_GROUP_DEAD,
            Some(false) => EXIT_GROUP_KNOWN,
            None => 0,
        } | if code.is_some() { EXIT_CODE_KNOWN } else { 0 };
        (*rec).exit_code = code.unwrap_or(0);
        (*rec)._pad = 0;
        task::comm(p, off, &mut (*rec).comm);
    }
    submit(Ring::Sched, entry, cfg);
    Some(())
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
