//! Reads of `task_struct` fields at the offsets the agent found in BTF.

use aya_ebpf::helpers::{bpf_probe_read_kernel, bpf_probe_read_kernel_buf};
use xpuscope_common::{COMM_LEN, TaskOffsets};

/// The fields of one task that the records carry.
pub struct TaskFields {
    pub tid: u32,
    pub tgid: u32,
    pub prio: i32,
}

#[inline(always)]
unsafe fn read_at<T>(task: *const u8, offset: u32) -> T
where
    T: Default,
{
    // SAFETY: `task` is a task_struct pointer from the tracepoint and the
    // offset comes from the running kernel's BTF; probe_read tolerates faults.
    unsafe { bpf_probe_read_kernel(task.add(offset as usize) as *const T) }.unwrap_or_default()
}

#[inline(always)]
pub fn fields(task: *const u8, off: &TaskOffsets) -> TaskFields {
    // SAFETY: see read_at.
    unsafe {
        TaskFields {
            tid: read_at::<u32>(task, off.pid),
            tgid: read_at::<u32>(task, off.tgid),
            prio: read_at::<i32>(task, off.prio),
        }
    }
}

#[inline(always)]
pub fn cpu(task: *const u8, off: &TaskOffsets) -> u32 {
    if off.cpu == TaskOffsets::ABSENT {
        return u32::MAX;
    }
    // SAFETY: see read_at.
    unsafe { read_at::<u32>(task, off.cpu) }
}

/// Copies the task's comm into `dst` (zeroed on failure).
#[inline(always)]
pub fn comm(task: *const u8, off: &TaskOffsets, dst: &mut [u8; COMM_LEN]) {
    // SAFETY: see read_at.
    if unsafe { bpf_probe_read_kernel_buf(task.add(off.comm as usize), dst) }.is_err() {
        *dst = [0; COMM_LEN];
    }
}
