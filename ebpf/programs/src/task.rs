//! Reads of `task_struct` fields at the offsets the agent found in BTF.
//!
//! `tp_btf` arguments are BTF-typed pointers, so the verifier lets the
//! program load their fields directly (it checks each access against the
//! kernel's BTF, and the offsets are known constants from read-only data).
//! A direct load costs a few nanoseconds; a `bpf_probe_read_kernel` call
//! costs tens, and the scheduler tracepoints run millions of times a second.

use xpuscope_common::{COMM_LEN, TaskOffsets};

/// The fields of one task that the records carry.
pub struct TaskFields {
    pub tid: u32,
    pub tgid: u32,
    pub prio: i32,
}

#[inline(always)]
unsafe fn load<T: Copy>(task: *const u8, offset: u32) -> T {
    // SAFETY: `task` is a BTF pointer to a task_struct handed to the program
    // by the tracepoint; the offset of a field of type T comes from the
    // running kernel's BTF, and the verifier checks the access against it.
    unsafe { core::ptr::read_volatile(task.add(offset as usize) as *const T) }
}

#[inline(always)]
pub fn fields(task: *const u8, off: &TaskOffsets) -> TaskFields {
    // SAFETY: see load.
    unsafe {
        TaskFields {
            tid: load::<u32>(task, off.pid),
            tgid: load::<u32>(task, off.tgid),
            prio: load::<i32>(task, off.prio),
        }
    }
}

#[inline(always)]
pub fn cpu(task: *const u8, off: &TaskOffsets) -> u32 {
    if off.cpu == TaskOffsets::ABSENT {
        return u32::MAX;
    }
    // SAFETY: see load.
    unsafe { load::<u32>(task, off.cpu) }
}

/// The task's `__state` (0 when the kernel's BTF has no such field).
#[inline(always)]
pub fn state(task: *const u8, off: &TaskOffsets) -> u32 {
    if off.state == TaskOffsets::ABSENT {
        return 0;
    }
    // SAFETY: see load.
    unsafe { load::<u32>(task, off.state) }
}

/// The task's `exit_code`, when the kernel's BTF has the field.
#[inline(always)]
pub fn exit_code(task: *const u8, off: &TaskOffsets) -> Option<i32> {
    if off.exit_code == TaskOffsets::ABSENT {
        return None;
    }
    // SAFETY: see load.
    Some(unsafe { load::<i32>(task, off.exit_code) })
}

/// Copies the task's comm into `dst`.
#[inline(always)]
pub fn comm(task: *const u8, off: &TaskOffsets, dst: &mut [u8; COMM_LEN]) {
    // SAFETY: see load; comm is a char[16], read as two u64 loads.
    unsafe {
        let lo = load::<u64>(task, off.comm);
        let hi = load::<u64>(task, off.comm + 8);
        *dst = (((hi as u128) << 64) | lo as u128).to_le_bytes();
    }
}

/// Whether the exiting `task` is the last thread of its process, from its
/// `signal->live` (the count of its threads not yet exiting: `do_exit`
/// decrements it before the `sched_process_exit` tracepoint), for kernels
/// whose tracepoint has no `group_dead`; `None` without the offsets.
///
/// Two threads exiting at once can both read zero: both exits then say
/// "last", which removes the process from the traced set once and tells
/// user space twice that it ended; never "not last" for the last one.
#[inline(always)]
pub fn group_dead_from_signal(task: *const u8, off: &TaskOffsets) -> Option<bool> {
    if off.signal == TaskOffsets::ABSENT || off.signal_live == TaskOffsets::ABSENT {
        return None;
    }
    // SAFETY: kernel pointers read only through bpf_probe_read_kernel,
    // which fails cleanly on a bad one.
    unsafe {
        let signal: u64 =
            aya_ebpf::helpers::bpf_probe_read_kernel(task.add(off.signal as usize) as *const u64)
                .ok()?;
        if signal == 0 {
            return None;
        }
        let live: i32 = aya_ebpf::helpers::bpf_probe_read_kernel(
            (signal as *const u8).add(off.signal_live as usize) as *const i32,
        )
        .ok()?;
        Some(live == 0)
    }
}
