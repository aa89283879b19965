//! The benchmarks' baselines: programs that only count, on the agent's
//! attach points, to measure the agent's real programs against what any
//! program there costs on the same machine. A bare uprobe and uretprobe
//! (`cargo xtask bench probes`: on one function; `bench soak`: on every
//! function the service probes) and the scheduler tracepoints the agent
//! uses (`bench soak`'s floor rounds). The agent never loads them.

use aya_ebpf::{
    macros::{btf_tracepoint, map, uprobe, uretprobe},
    maps::PerCpuArray,
    programs::{BtfTracePointContext, ProbeContext, RetProbeContext},
};

/// Slot 0: entries, slot 1: returns, slot 2: switches, slot 3: wakeups
/// (per CPU).
#[map]
pub static BENCH_HITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(4, 0);

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

#[btf_tracepoint(function = "sched_switch")]
pub fn bench_count_switch(_ctx: BtfTracePointContext) -> u32 {
    count(2);
    0
}

#[btf_tracepoint(function = "sched_waking")]
pub fn bench_count_waking(_ctx: BtfTracePointContext) -> u32 {
    count(3);
    0
}
