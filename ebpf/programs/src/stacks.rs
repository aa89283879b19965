//! Off-CPU stacks: the policy deciding whether to take one, and the capture
//! of kernel and user stacks straight into a ring-buffer record (no
//! STACK_TRACE map: nothing to collide, evict or look up later).

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, BPF_RB_NO_WAKEUP, pt_regs},
    helpers::{
        bpf_probe_read_kernel,
        generated::{
            bpf_get_current_task_btf, bpf_get_stack, bpf_probe_read_user, bpf_task_pt_regs,
        },
    },
};
use xpuscope_common::{
    Config, DROP_SLOT_STACK_ERRORS, EventKind, MAX_PENDING_RETURNS, MAX_STACK_DEPTH, OffCpuStackOf,
    SHORT_STACK_COPIES, StackBudget, TaskOffsets, USER_STACK_CHUNK, USER_STACK_COPY,
    USER_STACK_NOT_WALKED, UserStackCopyOf, stack_mode,
};

use crate::{
    maps::{STACK_BUDGETS, STACK_ENDS, count_drop},
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
            // A new thread's first stack, and no burst to spend: with one,
            // threads started one after another would each take a burst
            // of stacks, the rate limit bypassed by thread churn.
            let fresh = StackBudget {
                credit_ns: 0,
                last_ns: now,
            };
            let _ = STACK_BUDGETS.insert(&tid, &fresh, 0);
            true
        }
    }
}

/// Pushes the current task's kernel and user stacks, in the smallest
/// record class whose copy reaches the thread's learned stack end (see
/// [`OffCpuStackOf`]), or the full record.
#[inline(always)]
pub fn capture_off_cpu<C: EbpfContext>(
    ctx: &C,
    cfg: &Config,
    cpu: u32,
    ts: u64,
    tid: u32,
    tgid: u32,
) {
    // SAFETY: helpers on the current task, which is a user task being
    // switched out (kernel threads are never traced).
    let task = unsafe { bpf_get_current_task_btf() } as *const u8;
    let regs = UserRegs::of(task);
    // The class has to be known before the reserve (its size is a
    // constant of each reserve call).
    let reach = learned_reach(tid, regs.sp);
    let at = Capture {
        cfg,
        cpu,
        ts,
        tid,
        tgid,
        task,
        regs: &regs,
        reach,
    };
    let taken = if reach == 0 {
        false
    } else if reach <= SHORT_STACK_COPIES[0] as u64 {
        at.push::<0, { SHORT_STACK_COPIES[0] }, C>(ctx)
    } else if reach <= SHORT_STACK_COPIES[1] as u64 {
        at.push::<0, { SHORT_STACK_COPIES[1] }, C>(ctx)
    } else if reach <= SHORT_STACK_COPIES[2] as u64 {
        at.push::<0, { SHORT_STACK_COPIES[2] }, C>(ctx)
    } else {
        false
    };
    if !taken {
        at.push::<MAX_STACK_DEPTH, USER_STACK_COPY, C>(ctx);
    }
}

/// What an off-CPU stack record is filled from.
struct Capture<'a> {
    cfg: &'a Config,
    cpu: u32,
    ts: u64,
    tid: u32,
    tgid: u32,
    task: *const u8,
    regs: &'a UserRegs,
    /// [`learned_reach`] of the stack.
    reach: u64,
}

impl Capture<'_> {
    /// Pushes the stacks in the record class with a `COPY`-byte copy and a
    /// `WALK`-frame frame-pointer walk. A short class (no walk) whose copy
    /// fell short of the learned end (a read failed before it) is
    /// discarded, so the full record with its walk takes the stack:
    /// returns false then. True once the stack was pushed or dropped
    /// (ring full, counted).
    #[inline(always)]
    fn push<const WALK: usize, const COPY: usize, C: EbpfContext>(&self, ctx: &C) -> bool {
        let Some(mut entry) = reserve::<OffCpuStackOf<WALK, COPY>>(
            Ring::Sched,
            EventKind::OffCpuStack,
            self.cpu,
            self.ts,
        ) else {
            return true;
        };
        let rec = entry.as_mut_ptr();
        // SAFETY: `rec` points into the reserved ring-buffer record, and
        // each buffer handed to bpf_get_stack is exactly the size passed.
        unsafe {
            // The copy first: where it reaches the thread's learned stack
            // end, the frame-pointer walk could add nothing to its CFI
            // unwind, and is skipped (it costs about a microsecond a
            // stack).
            (*rec).copy.ip = self.regs.ip;
            (*rec).copy.sp = self.regs.sp;
            (*rec).copy.bp = self.regs.bp;
            let covered = copy_user_stack(&mut (*rec).copy, self.reach);
            let user = if covered {
                USER_STACK_NOT_WALKED as i64
            } else if WALK == 0 {
                entry.discard(BPF_RB_NO_WAKEUP as u64);
                return false;
            } else {
                bpf_get_stack(
                    ctx.as_ptr(),
                    (*rec).user.as_mut_ptr().cast(),
                    (WALK * 8) as u32,
                    BPF_F_USER_STACK as u64,
                )
            };
            copy_pending_returns(self.task, &mut (*rec).copy);
            (*rec).tid = self.tid;
            (*rec).tgid = self.tgid;
            let kernel = bpf_get_stack(
                ctx.as_ptr(),
                (*rec).kernel.as_mut_ptr().cast(),
                STACK_BYTES,
                0,
            );
            if kernel < 0 || (user < 0 && !covered) {
                count_drop(DROP_SLOT_STACK_ERRORS);
            }
            (*rec).kernel_bytes = kernel as i32;
            (*rec).user_bytes = user as i32;
        }
        submit(Ring::Sched, entry, self.cfg);
        true
    }
}

/// `-EFAULT`: no user registers or stack could be read.
const EFAULT: i32 = -14;

/// A task's saved user registers (its `pt_regs`: where it entered the
/// kernel).
pub struct UserRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

impl UserRegs {
    /// The registers of `task`, the current task; zero where unreadable.
    #[inline(always)]
    fn of(task: *const u8) -> Self {
        // SAFETY: `task` is the current task (a BTF pointer); the pt_regs
        // pointer is only read through bpf_probe_read_kernel.
        unsafe {
            let regs = bpf_task_pt_regs(task as *mut _) as *const pt_regs;
            let read = |field: *const u64| bpf_probe_read_kernel(field).unwrap_or(0);
            UserRegs {
                ip: read(core::ptr::addr_of!((*regs).rip)),
                sp: read(core::ptr::addr_of!((*regs).rsp)),
                bp: read(core::ptr::addr_of!((*regs).rbp)),
            }
        }
    }
}

/// How far the thread's stack reaches above `sp`: up to its learned end
/// ([`STACK_ENDS`]); 0 when none is learned, or `sp` is not below it
/// (another stack: a coroutine's, a signal's).
#[inline(always)]
pub fn learned_reach(tid: u32, sp: u64) -> u64 {
    // SAFETY: a plain value copied out of the map.
    let end = unsafe { STACK_ENDS.get(&tid) }.copied().unwrap_or(0);
    if sp != 0 && end > sp { end - sp } else { 0 }
}

/// The task's pending uretprobe return instances, innermost first: where
/// each return address was on the stack and what it was (see
/// [`UserStackCopyOf::returns`]).
#[inline(always)]
fn copy_pending_returns<const COPY: usize>(task: *const u8, copy: &mut UserStackCopyOf<COPY>) {
    let off = crate::maps::offsets();
    if off.utask == TaskOffsets::ABSENT
        || off.return_instances == TaskOffsets::ABSENT
        || off.ri_stack == TaskOffsets::ABSENT
        || off.ri_orig_ret_vaddr == TaskOffsets::ABSENT
        || off.ri_next == TaskOffsets::ABSENT
    {
        return;
    }
    // SAFETY: kernel pointers only read through bpf_probe_read_kernel,
    // which fails cleanly on a bad one.
    let read = |at: u64| unsafe { bpf_probe_read_kernel(at as *const u64).unwrap_or(0) };
    let utask = read(task as u64 + u64::from(off.utask));
    if utask == 0 {
        return;
    }
    let mut ri = read(utask + u64::from(off.return_instances));
    let mut n = 0;
    while n < MAX_PENDING_RETURNS && ri != 0 {
        copy.returns[n] = [
            read(ri + u64::from(off.ri_stack)),
            read(ri + u64::from(off.ri_orig_ret_vaddr)),
        ];
        n += 1;
        ri = read(ri + u64::from(off.ri_next));
    }
    copy.returns_len = n as u32;
}

/// Copies the stack from `copy.sp` up, chunk by chunk until a read fails
/// (the stack's mapping ended) or the copy reaches `reach` bytes (the
/// thread's [`learned_reach`]; 0: unknown, the whole copy), and says how
/// much was copied. Returns whether the copy reached that end (so holds
/// every frame).
#[inline(always)]
pub fn copy_user_stack<const COPY: usize>(copy: &mut UserStackCopyOf<COPY>, reach: u64) -> bool {
    copy.returns_len = 0;
    if copy.sp == 0 {
        copy.stack_len = EFAULT;
        return false;
    }
    // A learned end within reach: copy up to it, whole chunks. Else (not
    // learned yet, or another stack) the whole copy.
    let covered = reach != 0 && reach <= COPY as u64;
    let want = if covered { reach } else { COPY as u64 };
    let mut copied: i32 = 0;
    let mut i = 0;
    while i < COPY / USER_STACK_CHUNK {
        let off = i * USER_STACK_CHUNK;
        if off as u64 >= want {
            break;
        }
        // SAFETY: the destination is `USER_STACK_CHUNK` bytes at `off` of
        // `copy.stack`, inside it since `off + USER_STACK_CHUNK <= COPY`
        // (a whole number of chunks); the source is user memory, read by
        // the helper.
        let r = unsafe {
            bpf_probe_read_user(
                copy.stack.as_mut_ptr().add(off).cast(),
                USER_STACK_CHUNK as u32,
                copy.sp.wrapping_add(off as u64) as *const _,
            )
        };
        if r < 0 {
            if i == 0 {
                copied = r as i32;
            }
            break;
        }
        copied += USER_STACK_CHUNK as i32;
        i += 1;
    }
    copy.stack_len = copied;
    if copied < 0 {
        count_drop(DROP_SLOT_STACK_ERRORS);
    }
    covered && copied as u64 >= want
}
