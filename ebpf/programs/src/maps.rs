//! Maps and load-time globals, named by `xpuscope_common::maps`/`globals`.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use xpuscope_common::{
    Config, DROP_SLOTS, MAX_CPUS, MAX_STACK_BUDGETS, MAX_TARGETS, StackBudget, TaskOffsets,
    uprobe::{PendingDerefs, ProbeKey, ProbeSpec},
};

/// All records. The agent sets the real size at load time.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 22, 0);

/// Traced processes: tgid -> 1. Children are added on fork.
#[map]
pub static TARGETS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TARGETS, 0);

/// CPUs on which a traced thread ran or woke someone: every switch there is
/// recorded from then on, so CPU tracks show what ran between the targets.
#[map]
pub static TRACKED_CPUS: Array<u32> = Array::with_max_entries(MAX_CPUS, 0);

/// Records that could not be reserved, per CPU, per `EventKind`.
#[map]
pub static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DROP_SLOTS, 0);

/// Runtime configuration, index 0.
#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Per-thread stack-sampling budgets.
#[map]
pub static STACK_BUDGETS: LruHashMap<u32, StackBudget> =
    LruHashMap::with_max_entries(MAX_STACK_BUDGETS, 0);

/// What each probed device-library function copies, by (process, address).
#[map]
pub static UPROBE_SPECS: HashMap<ProbeKey, ProbeSpec> = HashMap::with_max_entries(16384, 0);

/// Out-parameter pointers saved at entry for the return program, per thread.
#[map]
pub static UPROBE_PENDING: LruHashMap<u32, PendingDerefs> = LruHashMap::with_max_entries(65536, 0);

/// The agent's own tgid (set at load).
#[unsafe(no_mangle)]
pub static AGENT_TGID: u32 = 0;

/// `task_struct` offsets (set at load).
#[unsafe(no_mangle)]
pub static TASK_OFFSETS: TaskOffsets = TaskOffsets {
    pid: 0,
    tgid: 0,
    prio: 0,
    comm: 0,
    cpu: TaskOffsets::ABSENT,
    _pad: 0,
};

#[inline(always)]
pub fn agent_tgid() -> u32 {
    // SAFETY: a read of a static the loader patched; volatile so the compiler
    // does not fold the placeholder value.
    unsafe { core::ptr::read_volatile(&AGENT_TGID) }
}

#[inline(always)]
pub fn offsets() -> TaskOffsets {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&TASK_OFFSETS) }
}

#[inline(always)]
pub fn config() -> Config {
    match CONFIG.get(0) {
        Some(c) => *c,
        None => Config::default(),
    }
}

#[inline(always)]
pub fn is_target(tgid: u32) -> bool {
    // SAFETY: the value is only tested for presence.
    unsafe { TARGETS.get(&tgid).is_some() }
}

#[inline(always)]
pub fn count_drop(slot: u32) {
    if let Some(counter) = DROPS.get_ptr_mut(slot) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *counter += 1 };
    }
}
