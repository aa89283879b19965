//! Device-library calls: one generic entry and one generic return program,
//! attached to every probed function of libcudart, libnccl, libcupti,
//! libascendcl, libhccl and libmspti (once per library file, for all
//! processes). A probe's slot, its attach cookie, says what to copy
//! (`UPROBE_SPECS`) and where to count hits (`UPROBE_HITS`); processes not
//! traced are ignored.

use aya_ebpf::{
    EbpfContext,
    bindings::BPF_F_USER_STACK,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_probe_read_user_buf,
        generated::{
            bpf_get_attach_cookie, bpf_get_func_ip, bpf_get_stack, bpf_probe_read_user,
            bpf_probe_read_user_str,
        },
    },
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use xpuscope_common::{
    DROP_SLOT_STACK_ERRORS, EventKind, MAX_STACK_DEPTH,
    uprobe::{
        COUNT_GRAPH, COUNT_LAUNCH_LOWER, COUNT_LAUNCH_UPPER, DEREF_BYTES, DEREF_NONE, DEREF_STACK,
        ENTRY_STACK_ARGS, ENTRY_STACK_WORDS, ENTRY_STRING, LaunchCounts, OpenLaunch, PendingKey,
        ProbeSpec, RETURN_LAUNCH_COUNTS, RETURN_ON_SUCCESS, RETURN_SP_OFFSET, RETURN_TWICE,
        RETURN_USER_STACK, UprobeEntry, UprobeReturn, UprobeStack,
    },
};

use crate::{
    maps::{
        LAUNCH_COUNTS, LAUNCH_OPEN, UPROBE_HITS, UPROBE_PENDING, UPROBE_SPECS, config, count_drop,
        is_target,
    },
    ring::{Ring, now, reserve, submit},
};

/// The probe that fired, for a traced process: (slot, address, spec).
#[inline(always)]
fn spec_for<C: EbpfContext>(ctx: &C, tgid: u32) -> Option<(u32, u64, ProbeSpec)> {
    if !is_target(tgid) {
        return None;
    }
    // SAFETY: helpers on our own context.
    let (cookie, probe_ip) = unsafe {
        (
            bpf_get_attach_cookie(ctx.as_ptr()),
            bpf_get_func_ip(ctx.as_ptr()),
        )
    };
    let slot = cookie as u32;
    let spec = *UPROBE_SPECS.get(slot)?;
    if spec.level_bit == 0 {
        return None; // an unused or silenced slot
    }
    Some((slot, probe_ip, spec))
}

/// One more call of the probe at `slot` (this CPU's count).
#[inline(always)]
fn count_hit(slot: u32) {
    if let Some(n) = UPROBE_HITS.get_ptr_mut(slot) {
        // SAFETY: an atomic add (BPF_ATOMIC) on this CPU's value: a
        // preempted uprobe program may share the CPU with another.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                n, 1,
            );
        }
    }
}

/// Atomically adds 1 to the counter at `n` (threads of one process
/// launch on several CPUs at once).
#[inline(always)]
fn add_one(n: *mut u64) {
    // SAFETY: `n` points into a map value; BPF_ATOMIC add.
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            n, 1,
        );
    }
}

/// Reads the user word at `at` (0 if unreadable).
#[inline(always)]
fn user_word(at: u64) -> u64 {
    let mut word = [0u8; 8];
    // SAFETY: the helper tolerates any user address.
    match unsafe { bpf_probe_read_user_buf(at as *const u8, &mut word) } {
        Ok(()) => u64::from_le_bytes(word),
        Err(_) => 0,
    }
}

/// Counts a launch of process `tgid` by thread `tid` (spec flags
/// `COUNT_LAUNCH_*`), at every level: the default trace's launches per
/// step come from these counts, not from one record per launch.
#[inline(always)]
fn count_launch(flags: u16, tid: u32, tgid: u32, sp: u64) {
    if flags & COUNT_LAUNCH_UPPER != 0 {
        // The driver launch made inside this one is this one: mark the
        // thread with where this call's return address sits.
        let open = OpenLaunch {
            sp,
            ret: user_word(sp),
        };
        match LAUNCH_OPEN.get_ptr_mut(&tid) {
            // SAFETY: this thread's own entry (only it writes it).
            Some(o) => unsafe { *o = open },
            // A thread's first launch (an update in place is cheaper).
            None => {
                let _ = LAUNCH_OPEN.insert(&tid, &open, 0);
            }
        }
    } else if let Some(open) = LAUNCH_OPEN.get_ptr_mut(&tid) {
        // SAFETY: a value pointer of this thread's own entry: only this
        // thread writes it, and it is running here.
        let o = unsafe { &mut *open };
        // Inside the marked call: deeper on the stack, and its return
        // address still in place (once that call returned, the slot is
        // the caller's again and soon overwritten).
        let inside = o.sp != 0 && sp < o.sp && user_word(o.sp) == o.ret;
        o.sp = 0;
        if inside {
            return;
        }
    }
    let counts = match LAUNCH_COUNTS.get_ptr_mut(&tgid) {
        Some(c) => c,
        None => {
            // BPF_NOEXIST: two threads' first launches must not reset
            // each other's count.
            let _ = LAUNCH_COUNTS.insert(&tgid, &LaunchCounts::default(), 1);
            match LAUNCH_COUNTS.get_ptr_mut(&tgid) {
                Some(c) => c,
                None => return,
            }
        }
    };
    // SAFETY: `counts` points into the map value.
    unsafe {
        if flags & COUNT_GRAPH != 0 {
            add_one(core::ptr::addr_of_mut!((*counts).graphs));
        } else {
            add_one(core::ptr::addr_of_mut!((*counts).kernels));
        }
    }
}

/// Copies `len` (at most [`DEREF_BYTES`]) bytes at user address `ptr` into
/// `dst`; returns the bytes copied (0 on a fault: nothing valid). When the
/// full read faults, the bytes up to the end of `ptr`'s page are read
/// instead: a record shorter than `len` near the end of a page is kept even
/// when the next page is not mapped or not yet touched.
#[inline(always)]
fn copy_user(ptr: u64, len: u16, dst: &mut [u8; DEREF_BYTES]) -> u32 {
    // Masked then capped: the verifier sees a size in [0, DEREF_BYTES].
    let mut n = (len & 0xff) as u32;
    if n > DEREF_BYTES as u32 {
        n = DEREF_BYTES as u32;
    }
    if ptr == 0 || n == 0 {
        return 0;
    }
    // SAFETY: probe_read tolerates faulting user addresses; `n` fits `dst`.
    let rc = unsafe { bpf_probe_read_user(dst.as_mut_ptr().cast(), n, ptr as *const _) };
    if rc == 0 {
        return n;
    }
    // The bytes past a short record can lie in a page never touched yet
    // (fresh buffer memory), which faults the whole read; the record itself
    // was just written, so its page is present: read up to that page's end.
    let in_page = PAGE_SIZE - (ptr as u32 & (PAGE_SIZE - 1));
    if in_page >= n {
        return 0;
    }
    // Masked then capped again for the verifier (in_page < n already). The
    // compiler proves both redundant and drops them, and verifiers before
    // Linux 6.8 do not carry `in_page < n` over from a comparison of two
    // registers: read through a volatile load, the value is opaque to the
    // compiler and the bounds stay in the code.
    // SAFETY: a read of a local.
    let in_page = unsafe { core::ptr::read_volatile(&in_page) };
    let mut m = in_page & 0xff;
    if m > DEREF_BYTES as u32 {
        m = DEREF_BYTES as u32;
    }
    if m == 0 {
        return 0;
    }
    // SAFETY: as above; `m` < `n` fits `dst`.
    let rc = unsafe { bpf_probe_read_user(dst.as_mut_ptr().cast(), m, ptr as *const _) };
    if rc == 0 { m } else { 0 }
}

/// x86-64 base page size.
const PAGE_SIZE: u32 = 4096;

/// Copies a NUL-terminated string of at most `len` bytes (NUL included);
/// returns the bytes copied without the NUL.
#[inline(always)]
fn copy_user_str(ptr: u64, len: u16, dst: &mut [u8; DEREF_BYTES]) -> u32 {
    let mut n = (len & 0xff) as u32;
    if n > DEREF_BYTES as u32 {
        n = DEREF_BYTES as u32;
    }
    if ptr == 0 || n == 0 {
        return 0;
    }
    // SAFETY: as above; the helper NUL-terminates within `n`.
    let rc = unsafe { bpf_probe_read_user_str(dst.as_mut_ptr().cast(), n, ptr as *const _) };
    if rc > 1 { (rc - 1) as u32 } else { 0 }
}

/// Register argument `i` (a branch per index: an indexed stack read with a
/// computed offset does not pass the verifier).
#[inline(always)]
fn arg(args: &[u64; 6], i: u8) -> u64 {
    match i {
        0 => args[0],
        1 => args[1],
        2 => args[2],
        3 => args[3],
        4 => args[4],
        5 => args[5],
        _ => 0,
    }
}

#[uprobe]
pub fn device_call_entry(ctx: ProbeContext) -> u32 {
    try_entry(&ctx).unwrap_or(0)
}

fn try_entry(ctx: &ProbeContext) -> Option<u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    let (slot, probe_ip, spec) = spec_for(ctx, tgid)?;
    count_hit(slot);
    // SAFETY: the probe context's saved user registers.
    let regs = unsafe { &*ctx.regs };
    let args = [regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9];
    // Saved whatever the level: the return program takes it whatever the
    // level.
    if spec.return_deref_arg != DEREF_NONE {
        let key = PendingKey {
            tid,
            slot,
            sp: regs.rsp,
        };
        let _ = UPROBE_PENDING.insert(&key, &arg(&args, spec.return_deref_arg), 0);
    }
    if spec.flags & (COUNT_LAUNCH_UPPER | COUNT_LAUNCH_LOWER) != 0 {
        count_launch(spec.flags, tid, tgid, regs.rsp);
    }
    let cfg = config();
    if cfg.probe_levels & spec.level_bit == 0 {
        return Some(0);
    }
    // SAFETY: helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let mut entry = reserve::<UprobeEntry>(Ring::Device, EventKind::UprobeEntry, cpu, now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        (*rec).probe_ip = probe_ip;
        (*rec).args = args;
        (*rec).sp = regs.rsp;
        (*rec).slot = slot;
        let stack = &mut (*rec).stack;
        if spec.flags & ENTRY_STACK_ARGS != 0 {
            let bytes = core::slice::from_raw_parts_mut(
                stack.as_mut_ptr().cast::<u8>(),
                ENTRY_STACK_WORDS * 8,
            );
            if bpf_probe_read_user_buf(regs.rsp as *const u8, bytes).is_err() {
                *stack = [0; ENTRY_STACK_WORDS];
            }
        } else {
            *stack = [0; ENTRY_STACK_WORDS];
        }
        let src = match spec.entry_deref_arg {
            DEREF_NONE => 0,
            DEREF_STACK => regs.rsp.wrapping_add(u64::from(spec.entry_stack_off)),
            i => arg(&args, i),
        };
        (*rec).deref_len = if spec.flags & ENTRY_STRING != 0 {
            copy_user_str(src, spec.entry_deref_len, &mut (*rec).deref)
        } else {
            copy_user(src, spec.entry_deref_len, &mut (*rec).deref)
        };
    }
    submit(Ring::Device, entry, &cfg);
    Some(0)
}

#[uretprobe]
pub fn device_call_return(ctx: RetProbeContext) -> u32 {
    try_return(&ctx).unwrap_or(0)
}

fn try_return(ctx: &RetProbeContext) -> Option<u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    let (slot, probe_ip, spec) = spec_for(ctx, tgid)?;
    // SAFETY: the probe context's saved user registers.
    let (ret, sp) = unsafe { ((*ctx.regs).rax, (*ctx.regs).rsp) };
    // The saved pointer is taken whatever the level (none is left behind).
    let saved = if spec.return_deref_arg != DEREF_NONE {
        take_pending(PendingKey {
            tid,
            slot,
            sp: sp.wrapping_sub(RETURN_SP_OFFSET),
        })
    } else {
        0
    };
    let cfg = config();
    if cfg.probe_levels & spec.level_bit == 0 {
        return Some(0);
    }
    // SAFETY: helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let ts = now();
    if spec.flags & RETURN_USER_STACK != 0 {
        push_user_stack(ctx, cpu, ts, tid, tgid, probe_ip);
    }
    let mut entry = reserve::<UprobeReturn>(Ring::Device, EventKind::UprobeReturn, cpu, ts)?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        (*rec).probe_ip = probe_ip;
        (*rec).ret = ret;
        (*rec).slot = slot;
        (*rec).launches = if spec.flags & RETURN_LAUNCH_COUNTS != 0 {
            LAUNCH_COUNTS.get(&tgid).copied().unwrap_or_default()
        } else {
            LaunchCounts::default()
        };
        let ok = spec.flags & RETURN_ON_SUCCESS == 0 || ret as u32 == 0;
        let mut src = if ok { saved } else { 0 };
        if src != 0 && spec.flags & RETURN_TWICE != 0 {
            let mut word = [0u8; 8];
            src = match bpf_probe_read_user_buf(src as *const u8, &mut word) {
                Ok(()) => u64::from_le_bytes(word),
                Err(_) => 0,
            };
        }
        (*rec).deref_len = copy_user(src, spec.return_deref_len, &mut (*rec).deref);
    }
    submit(Ring::Device, entry, &cfg);
    Some(0)
}

/// Pushes the returning thread's user stack (it precedes the return record
/// in the ring, so the agent has it when the call completes).
#[inline(always)]
fn push_user_stack(ctx: &RetProbeContext, cpu: u32, ts: u64, tid: u32, tgid: u32, probe_ip: u64) {
    let Some(mut entry) = reserve::<UprobeStack>(Ring::Device, EventKind::UprobeStack, cpu, ts)
    else {
        return;
    };
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved record; the buffer handed to
    // bpf_get_stack is exactly the size passed.
    unsafe {
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        (*rec).probe_ip = probe_ip;
        (*rec)._pad = 0;
        let n = bpf_get_stack(
            ctx.as_ptr(),
            (*rec).user.as_mut_ptr().cast(),
            (MAX_STACK_DEPTH * 8) as u32,
            BPF_F_USER_STACK as u64,
        );
        if n < 0 {
            count_drop(DROP_SLOT_STACK_ERRORS);
        }
        (*rec).user_bytes = n as i32;
        // At a return probe the registers are the caller's, just after
        // the call: the CFI unwind starts there.
        let regs = ctx.regs;
        (*rec).copy.ip = (*regs).rip;
        (*rec).copy.sp = (*regs).rsp;
        (*rec).copy.bp = (*regs).rbp;
        // The frame-pointer walk above is kept: device-call stacks are
        // few, and it is their fallback.
        let reach = crate::stacks::learned_reach(tid, (*rec).copy.sp);
        crate::stacks::copy_user_stack(&mut (*rec).copy, reach);
    }
    submit(Ring::Device, entry, &config());
}

/// The pointer saved at the entry of the call `key` names (0 if none was:
/// the entry came before its probe was attached), removed.
#[inline(always)]
fn take_pending(key: PendingKey) -> u64 {
    // SAFETY: a plain value copied out of the map.
    match unsafe { UPROBE_PENDING.get(&key) }.copied() {
        Some(saved) => {
            let _ = UPROBE_PENDING.remove(&key);
            saved
        }
        None => 0,
    }
}
