//! The baseline of the device-probe benchmark (`cargo xtask bench probes`):
//! a bare uprobe and uretprobe that only count, to compare the agent's real
//! programs against on the same function. The agent never loads them.

use aya_ebpf::{
    macros::{map, uprobe, uretprobe},
    maps::PerCpuArray,
    programs::{ProbeContext, RetProbeContext},
};

/// Slot 0: entries, slot 1: returns (per CPU).
#[map]
pub static BENCH_HITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

#[inline(always)]
fn count(slot: u32) {
    if let Some(n) = BENCH_HITS.get_ptr_mut(slot) {
        // SAFETY: this CPU's slot; a lost count under preemption does not
        // matter to a cost baseline.
        unsafe { *n += 1 };
    }
}

#[uprobe]
pub fn bench_count_entry(_ctx: ProbeContext) -> u32 {
    count(0);
    0
}

#[uretprobe]
pub fn bench_count_return(_ctx: RetProbeContext) -> u32 {
    count(1);
    0
}
