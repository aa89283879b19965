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
