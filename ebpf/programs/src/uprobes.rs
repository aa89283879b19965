//! Device-library calls: one generic entry and one generic return program,
//! attached (per process) to every probed function of libcudart, libnccl,
//! libcupti, libascendcl, libhccl and libmspti. The probed address
//! identifies the function; `UPROBE_SPECS` says what to copy for it.

use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_probe_read_user_buf,
        generated::bpf_get_func_ip,
    },
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use xpuscope_common::{
    EventKind,
    uprobe::{
        DEREF_BYTES, DEREF_NONE, ENTRY_STACK_WORDS, PENDING_DEPTH, PendingDerefs, ProbeKey,
        ProbeSpec, UprobeEntry, UprobeReturn,
    },
};

use crate::{
    maps::{UPROBE_PENDING, UPROBE_SPECS, config},
    ring::{now, reserve, submit_flags},
};

#[inline(always)]
fn spec_for<C: EbpfContext>(ctx: &C, tgid: u32) -> Option<(u64, ProbeSpec)> {
    // SAFETY: helper on our own context.
    let probe_ip = unsafe { bpf_get_func_ip(ctx.as_ptr()) };
    let key = ProbeKey {
        tgid,
        _pad: 0,
        probe_ip,
    };
    // SAFETY: the value is copied out at once.
    let spec = *unsafe { UPROBE_SPECS.get(&key) }?;
    Some((probe_ip, spec))
}

#[inline(always)]
fn deref_len(spec: &ProbeSpec) -> usize {
    (spec.deref_len as usize).min(DEREF_BYTES)
}

/// Copies `len` bytes at user address `ptr` into `dst` (zeroed on failure);
/// returns the bytes copied.
#[inline(always)]
fn copy_user(ptr: u64, len: usize, dst: &mut [u8; DEREF_BYTES]) -> u32 {
    if ptr == 0 || len == 0 {
        return 0;
    }
    // The verifier needs a constant size: copy a whole buffer, report len.
    // SAFETY: probe_read tolerates faulting user addresses.
    match unsafe { bpf_probe_read_user_buf(ptr as *const u8, dst) } {
        Ok(()) => len as u32,
        Err(_) => {
            *dst = [0; DEREF_BYTES];
            0
        }
    }
}

#[uprobe]
pub fn device_call_entry(ctx: ProbeContext) -> u32 {
    try_entry(&ctx).unwrap_or(0)
}

fn try_entry(ctx: &ProbeContext) -> Option<u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    let (probe_ip, spec) = spec_for(ctx, tgid)?;
    let cfg = config();
    if cfg.probe_levels & spec.level_bit == 0 {
        return Some(0);
    }
    // SAFETY: helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    // SAFETY: the probe context's saved user registers.
    let regs = unsafe { &*ctx.regs };
    let args = [regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9];
    if spec.return_deref_arg != DEREF_NONE {
        push_pending(tid, args[(spec.return_deref_arg as usize) % 6]);
    }
    let mut entry = reserve::<UprobeEntry>(EventKind::UprobeEntry, cpu, now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        (*rec).probe_ip = probe_ip;
        (*rec).args = args;
        (*rec).sp = regs.rsp;
        let stack = &mut (*rec).stack;
        let bytes =
            core::slice::from_raw_parts_mut(stack.as_mut_ptr().cast::<u8>(), ENTRY_STACK_WORDS * 8);
        if bpf_probe_read_user_buf(regs.rsp as *const u8, bytes).is_err() {
            *stack = [0; ENTRY_STACK_WORDS];
        }
        (*rec)._pad = 0;
        (*rec).deref_len = if spec.entry_deref_arg != DEREF_NONE {
            copy_user(
                args[(spec.entry_deref_arg as usize) % 6],
                deref_len(&spec),
                &mut (*rec).deref,
            )
        } else {
            0
        };
    }
    entry.submit(submit_flags(&cfg));
    Some(0)
}

#[uretprobe]
pub fn device_call_return(ctx: RetProbeContext) -> u32 {
    try_return(&ctx).unwrap_or(0)
}

fn try_return(ctx: &RetProbeContext) -> Option<u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    let (probe_ip, spec) = spec_for(ctx, tgid)?;
    // The saved pointer is popped whatever the level, to stay balanced.
    let saved = if spec.return_deref_arg != DEREF_NONE {
        pop_pending(tid)
    } else {
        0
    };
    let cfg = config();
    if cfg.probe_levels & spec.level_bit == 0 {
        return Some(0);
    }
    // SAFETY: helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    // SAFETY: the probe context's saved user registers.
    let ret = unsafe { (*ctx.regs).rax };
    let mut entry = reserve::<UprobeReturn>(EventKind::UprobeReturn, cpu, now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        (*rec).probe_ip = probe_ip;
        (*rec).ret = ret;
        (*rec)._pad = 0;
        (*rec).deref_len = copy_user(saved, deref_len(&spec), &mut (*rec).deref);
    }
    entry.submit(submit_flags(&cfg));
    Some(0)
}

#[inline(always)]
fn push_pending(tid: u32, ptr: u64) {
    match UPROBE_PENDING.get_ptr_mut(&tid) {
        Some(p) => {
            // SAFETY: this thread's own entry; only this thread touches it.
            let p = unsafe { &mut *p };
            let depth = p.depth as usize;
            if depth < PENDING_DEPTH {
                p.ptrs[depth] = ptr;
            }
            p.depth += 1;
        }
        None => {
            let mut fresh = PendingDerefs::default();
            fresh.ptrs[0] = ptr;
            fresh.depth = 1;
            let _ = UPROBE_PENDING.insert(&tid, &fresh, 0);
        }
    }
}

#[inline(always)]
fn pop_pending(tid: u32) -> u64 {
    let Some(p) = UPROBE_PENDING.get_ptr_mut(&tid) else {
        return 0;
    };
    // SAFETY: this thread's own entry.
    let p = unsafe { &mut *p };
    if p.depth == 0 {
        return 0;
    }
    p.depth -= 1;
    let depth = p.depth as usize;
    if depth < PENDING_DEPTH {
        p.ptrs[depth]
    } else {
        0
    }
}
