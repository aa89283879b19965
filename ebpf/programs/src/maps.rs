//! Maps and load-time globals, named by `xpuscope_common::maps`/`globals`.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use xpuscope_common::{
    Config, DROP_SLOTS, MAX_CPUS, MAX_PROBE_SLOTS, MAX_STACK_BUDGETS, MAX_STACK_ENDS, MAX_TARGETS,
    StackBudget, TaskOffsets,
    uprobe::{LaunchCounts, OpenLaunch, PendingKey, ProbeSpec},
};

/// Scheduler and process records. The agent sets the real size at load
/// time.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 22, 0);

/// Device-library call records (uprobes), apart from the scheduler's: a
/// small ring whose lines stay in cache between the agent reading them and
/// the probes writing them again (each call writes ~460 bytes; into a ring
/// of tens of MB every write missed the caches), and a scheduler storm
/// cannot take its room. The agent sets the real size at load time.
#[map]
pub static DEVICE_EVENTS: RingBuf = RingBuf::with_byte_size(1 << 18, 0);

/// Switches where neither task is traced ("bystanders": what ran between
/// the traced threads on their CPUs, or everything in `--system` without a
/// target), apart from the scheduler ring: a neighbour's switch storm fills
/// this ring only, never the one holding the target's own switches, forks,
/// exits and stacks. The agent sets the real size at load time.
#[map]
pub static BYSTANDER_EVENTS: RingBuf = RingBuf::with_byte_size(1 << 22, 0);

/// When this CPU last forced a reader wakeup, per ring (see `ring::submit`).
#[map]
pub static LAST_WAKEUP: PerCpuArray<u64> = PerCpuArray::with_max_entries(3, 0);

/// Traced processes: tgid -> 1. Children are added on fork.
#[map]
pub static TARGETS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TARGETS, 0);

/// Generation of `TARGETS` (slots: kernel, agent); a change of their sum
/// invalidates every CPU's `TARGET_CACHE`.
#[map]
pub static TARGET_GEN: Array<u64> = Array::with_max_entries(2, 0);

/// Per-CPU cache of recent `TARGETS` answers: 4 direct-mapped words of
/// `tgid << 32 | generation << 1 | is_target`, each written with a single
/// store so a nested program never sees half an entry. The scheduler
/// tracepoints ask for every switch and wakeup, and a hash lookup costs more
/// than the rest of the filter.
#[map]
pub static TARGET_CACHE: PerCpuArray<[u64; 4]> = PerCpuArray::with_max_entries(1, 0);

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

/// Per thread, the address just above the highest user-stack word its
/// stacks' unwind needs (the outermost frame's slots: fixed for the
/// thread's life), written by the agent once it has unwound one of the
/// thread's stacks to its end. The stack is copied from `sp` up to it
/// instead of a fixed [`xpuscope_common::USER_STACK_COPY`] bytes. Removed
/// when the thread exits (tids are reused).
#[map]
pub static STACK_ENDS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(MAX_STACK_ENDS, 0);

/// What each device-library probe copies, by its slot (attach cookie).
#[map]
pub static UPROBE_SPECS: Array<ProbeSpec> = Array::with_max_entries(MAX_PROBE_SLOTS, 0);

/// Calls of each probe (entries) by traced processes, by slot, per CPU:
/// counted whatever the capture level, so `agent probes` can count hits
/// with nothing pushed to the ring.
#[map]
pub static UPROBE_HITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_PROBE_SLOTS, 0);

/// Out-parameter pointers saved at entry for the return program, per call
/// (LRU: the entries of calls whose return never came age out).
#[map]
pub static UPROBE_PENDING: LruHashMap<PendingKey, u64> = LruHashMap::with_max_entries(65536, 0);

/// Launches of each traced process so far, by tgid (see
/// [`xpuscope_common::uprobe::LaunchCounts`]). Removed when the process
/// exits (pids are reused); LRU so a missed exit cannot fill it.
#[map]
pub static LAUNCH_COUNTS: LruHashMap<u32, LaunchCounts> =
    LruHashMap::with_max_entries(MAX_TARGETS, 0);

/// Per thread, the upper launch it is inside, if any (see
/// [`xpuscope_common::uprobe::OpenLaunch`]). Removed when the thread exits.
#[map]
pub static LAUNCH_OPEN: LruHashMap<u32, OpenLaunch> =
    LruHashMap::with_max_entries(MAX_STACK_ENDS, 0);

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
    exit_code: TaskOffsets::ABSENT,
    utask: TaskOffsets::ABSENT,
    return_instances: TaskOffsets::ABSENT,
    ri_stack: TaskOffsets::ABSENT,
    ri_orig_ret_vaddr: TaskOffsets::ABSENT,
    ri_next: TaskOffsets::ABSENT,
    signal: TaskOffsets::ABSENT,
    signal_live: TaskOffsets::ABSENT,
    state: TaskOffsets::ABSENT,
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
fn target_generation() -> u64 {
    let k = TARGET_GEN
        .get(xpuscope_common::TARGET_GEN_KERNEL)
        .copied()
        .unwrap_or(0);
    let a = TARGET_GEN
        .get(xpuscope_common::TARGET_GEN_AGENT)
        .copied()
        .unwrap_or(0);
    k.wrapping_add(a) & 0x7fff_ffff
}

#[inline(always)]
pub fn is_target(tgid: u32) -> bool {
    if tgid == 0 {
        return false; // the idle tasks are never traced
    }
    let generation = target_generation();
    let slot = (tgid & 3) as usize;
    let cache = TARGET_CACHE.get_ptr_mut(0);
    if let Some(cache) = cache {
        // SAFETY: this CPU's slot; a single 8-byte load.
        let word = unsafe { core::ptr::read_volatile(&(*cache)[slot]) };
        if word >> 32 == tgid as u64 && (word >> 1) & 0x7fff_ffff == generation {
            return word & 1 == 1;
        }
    }
    // SAFETY: the value is only tested for presence.
    let found = unsafe { TARGETS.get(&tgid).is_some() };
    if let Some(cache) = cache {
        let word = ((tgid as u64) << 32) | (generation << 1) | found as u64;
        // SAFETY: this CPU's slot; a single 8-byte store.
        unsafe { core::ptr::write_volatile(&mut (*cache)[slot], word) };
    }
    found
}

/// Tells every CPU's cache that `TARGETS` changed (after a kernel-side insert).
#[inline(always)]
pub fn targets_changed() {
    if let Some(g) = TARGET_GEN.get_ptr_mut(xpuscope_common::TARGET_GEN_KERNEL) {
        // SAFETY: an atomic add (BPF_ATOMIC) on the map value, which every
        // CPU shares; core's atomics lack RMW methods on the BPF target.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                g, 1,
            )
        };
    }
}

#[inline(always)]
pub fn count_drop(slot: u32) {
    if let Some(counter) = DROPS.get_ptr_mut(slot) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *counter += 1 };
    }
}
