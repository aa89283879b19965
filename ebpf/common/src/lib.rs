//! The event ABI shared by xpuscope's kernel programs and its agent.
//!
//! This crate is the only definition of what crosses the kernel/user
//! boundary: the `#[repr(C)]` records pushed to the ring buffer, the globals
//! and configuration the agent writes before and while the programs run, map
//! names and limits. Every record starts with an [`EventHeader`] whose `kind`
//! says which record follows; sizes are checked at compile time so both sides
//! agree, and the agent's tests check the offsets it decodes.
//!
//! It is `no_std` so the kernel crate can use it; the `user` feature adds the
//! `aya::Pod` impls the agent needs to read and write maps.
#![no_std]

pub mod uprobe;

/// Length of a task's `comm` (`TASK_COMM_LEN`).
pub const COMM_LEN: usize = 16;
/// Frames kept per stack (kernel and user stacks each).
pub const MAX_STACK_DEPTH: usize = 64;
/// Entries of the per-CPU drop counter array (indexed by [`EventKind`]).
pub const DROP_SLOTS: u32 = 16;
/// Most CPUs the per-CPU "tracked" flags cover.
pub const MAX_CPUS: u32 = 1024;
/// Most traced processes (tgids) at once.
pub const MAX_TARGETS: u32 = 16384;
/// `TARGET_GEN` slots: bumped by the kernel (fork) and by the agent
/// (attach) whenever `TARGETS` changes; each writer owns its slot.
pub const TARGET_GEN_KERNEL: u32 = 0;
pub const TARGET_GEN_AGENT: u32 = 1;

/// Bytes of the user stack copied from `sp` with each user stack
/// ([`UserStackCopy`]), for the agent to unwind from the code's CFI: the
/// deepest fixture stack measured (through the real libcudart, 18 frames)
/// needed 2,520 bytes.
pub const USER_STACK_COPY: usize = 8192;
/// Pending return-probed calls of a thread recorded with its stack copy
/// (a thread blocked in a collective has one or two).
pub const MAX_PENDING_RETURNS: usize = 4;
/// The copy is read in chunks of this size, so a stack that ends less than
/// [`USER_STACK_COPY`] above `sp` still yields every whole chunk below its
/// end (a failed read copies nothing).
pub const USER_STACK_CHUNK: usize = 1024;

/// Most threads with a stack-sampling budget at once (LRU).
pub const MAX_STACK_BUDGETS: u32 = 65536;

/// Most threads with a learned user-stack end at once (LRU).
pub const MAX_STACK_ENDS: u32 = 65536;

/// `user_bytes` of a stack whose frame-pointer walk was not taken: the
/// thread's learned stack end lies within the copy, so the copy's CFI
/// unwind reaches its outermost frame and the walk could add nothing
/// (`-ENODATA`).
pub const USER_STACK_NOT_WALKED: i32 = -61;

/// Map names, looked up by the agent.
pub mod maps {
    pub const EVENTS: &str = "EVENTS";
    pub const DEVICE_EVENTS: &str = "DEVICE_EVENTS";
    pub const BYSTANDER_EVENTS: &str = "BYSTANDER_EVENTS";
    pub const TARGETS: &str = "TARGETS";
    pub const TARGET_GEN: &str = "TARGET_GEN";
    pub const TRACKED_CPUS: &str = "TRACKED_CPUS";
    pub const DROPS: &str = "DROPS";
    pub const CONFIG: &str = "CONFIG";
    pub const STACK_BUDGETS: &str = "STACK_BUDGETS";
    pub const STACK_ENDS: &str = "STACK_ENDS";
    pub const UPROBE_SPECS: &str = "UPROBE_SPECS";
    pub const UPROBE_PENDING: &str = "UPROBE_PENDING";
    pub const UPROBE_HITS: &str = "UPROBE_HITS";
    pub const LAUNCH_COUNTS: &str = "LAUNCH_COUNTS";
    pub const LAUNCH_OPEN: &str = "LAUNCH_OPEN";
}

/// Global (read-only data) names, set by the agent at load time.
pub mod globals {
    /// `u32`: the agent's own tgid.
    pub const AGENT_TGID: &str = "AGENT_TGID";
    /// [`super::TaskOffsets`]: `task_struct` field offsets read from BTF.
    pub const TASK_OFFSETS: &str = "TASK_OFFSETS";
}

/// What follows an [`EventHeader`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    SchedSwitch = 1,
    SchedWaking = 2,
    SchedWakeupNew = 3,
    ProcessFork = 4,
    ProcessExec = 5,
    ProcessExit = 6,
    TaskRename = 7,
    OffCpuStack = 8,
    /// A probed library function was entered ([`uprobe::UprobeEntry`]).
    UprobeEntry = 9,
    /// A probed library function returned ([`uprobe::UprobeReturn`]).
    UprobeReturn = 10,
    /// The caller's user stack as a probed function returns
    /// ([`uprobe::UprobeStack`]); precedes that call's return record.
    UprobeStack = 11,
    /// A context switch where neither task is traced ([`SchedSwitch`]
    /// layout, flags without `PREV_TARGET`/`NEXT_TARGET`): pushed to the
    /// bystander ring, so a neighbour's switch storm can only lose records
    /// of its own kind, never the traced job's.
    BystanderSwitch = 12,
    /// A traced process's dynamic loader changed its link map (it called
    /// its debugger hook `_dl_debug_state`: at start-up before and after
    /// mapping the program's libraries, and at every `dlopen`/`dlclose`)
    /// ([`LinkMapChange`]).
    LinkMapChange = 13,
}

impl EventKind {
    pub const ALL: [EventKind; 13] = [
        EventKind::SchedSwitch,
        EventKind::SchedWaking,
        EventKind::SchedWakeupNew,
        EventKind::ProcessFork,
        EventKind::ProcessExec,
        EventKind::ProcessExit,
        EventKind::TaskRename,
        EventKind::OffCpuStack,
        EventKind::UprobeEntry,
        EventKind::UprobeReturn,
        EventKind::UprobeStack,
        EventKind::BystanderSwitch,
        EventKind::LinkMapChange,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|k| *k as u32 == v)
    }
}

/// Most device-library probes (slots of `UPROBE_SPECS` and `UPROBE_HITS`)
/// in one recording.
pub const MAX_PROBE_SLOTS: u32 = 16384;

/// Drop-counter slot for stacks that could not be captured although the
/// record carrying them was written (e.g. a user stack of a kernel thread).
pub const DROP_SLOT_STACK_ERRORS: u32 = 15;

/// Common header of every record.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventHeader {
    /// An [`EventKind`] value.
    pub kind: u32,
    /// CPU the event fired on.
    pub cpu: u32,
    /// CLOCK_BOOTTIME nanoseconds.
    pub ts: u64,
}

/// `sched_switch` flags.
pub mod switch_flags {
    /// The switch was a preemption (the previous task was still runnable).
    pub const PREEMPT: u32 = 1;
    /// The previous task belongs to a traced process.
    pub const PREV_TARGET: u32 = 2;
    /// The next task belongs to a traced process.
    pub const NEXT_TARGET: u32 = 4;
    /// An [`super::OffCpuStack`] record for the previous task follows.
    pub const STACK_FOLLOWS: u32 = 8;
}

/// A context switch on `header.cpu` from `prev` to `next`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SchedSwitch {
    pub header: EventHeader,
    pub prev_tid: u32,
    pub prev_tgid: u32,
    pub next_tid: u32,
    pub next_tgid: u32,
    /// The raw `prev->__state` the tracepoint passes (TASK_* bits).
    pub prev_state: u32,
    pub prev_prio: i32,
    pub next_prio: i32,
    /// [`switch_flags`] bits.
    pub flags: u32,
    pub prev_comm: [u8; COMM_LEN],
    pub next_comm: [u8; COMM_LEN],
}

/// `sched_waking` or `sched_wakeup_new`: the waker is the task running on
/// `header.cpu` (`waker_tid`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SchedWaking {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    pub target_cpu: u32,
    pub prio: i32,
    pub waker_tid: u32,
    pub waker_tgid: u32,
    pub comm: [u8; COMM_LEN],
}

/// A new task: a thread (`child_tgid == parent_tgid`) or a process.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessFork {
    pub header: EventHeader,
    pub parent_tid: u32,
    pub parent_tgid: u32,
    pub child_tid: u32,
    pub child_tgid: u32,
    pub child_comm: [u8; COMM_LEN],
}

/// A successful exec; `comm` is the new name.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessExec {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    /// The tid before exec (a non-leader thread that execs takes the leader's).
    pub old_tid: u32,
    pub _pad: u32,
    pub comm: [u8; COMM_LEN],
}

/// A task exiting (`sched_process_exit`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessExit {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    pub prio: i32,
    /// [`EXIT_GROUP_DEAD`] and future bits; unknown bits are zero.
    pub flags: u32,
    /// `task->exit_code` as the thread exits (valid with
    /// [`EXIT_CODE_KNOWN`]): the signal that killed it in the low 7 bits
    /// (0x80: it dumped core), else the exit status in bits 8-15.
    pub exit_code: i32,
    pub _pad: u32,
    pub comm: [u8; COMM_LEN],
}

/// [`ProcessExit::flags`]: the last thread of its process exited: the
/// process is gone (and left `TARGETS`), so its pid may be reused.
pub const EXIT_GROUP_DEAD: u32 = 1;
/// [`ProcessExit::flags`]: the kernel says whether this was the process's
/// last thread ([`EXIT_GROUP_DEAD`] is meaningful; Linux 6.16+). Without it
/// the agent takes the main thread's exit as the process's.
pub const EXIT_GROUP_KNOWN: u32 = 2;
/// [`ProcessExit::flags`]: `exit_code` was read (the kernel's BTF has
/// `task_struct.exit_code`).
pub const EXIT_CODE_KNOWN: u32 = 4;

/// A thread renamed (`prctl(PR_SET_NAME)`, `pthread_setname_np`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TaskRename {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    pub old_comm: [u8; COMM_LEN],
    pub new_comm: [u8; COMM_LEN],
}

/// The stacks of a traced thread as it leaves the CPU; it belongs to the
/// [`SchedSwitch`] with the same cpu and timestamp whose `prev_tid` is `tid`.
///
/// One layout in size classes: the full record ([`OffCpuStack`]), and
/// short ones ([`ShortOffCpuStack`]) for a stack whose learned end lies
/// within a smaller copy. A stack at every switch fills the ring with
/// these records, and most stacks are short: the ring reserves, and the
/// agent reads, only the class the stack needs. The agent tells the
/// classes apart by the record's length.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuStackOf<const WALK: usize, const COPY: usize> {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    /// Bytes of `kernel` filled (frames * 8), or a negative errno.
    pub kernel_bytes: i32,
    /// Bytes of `user` filled (frames * 8), or a negative errno;
    /// [`USER_STACK_NOT_WALKED`] in a short record.
    pub user_bytes: i32,
    /// Leaf first, as the kernel walks it.
    pub kernel: [u64; MAX_STACK_DEPTH],
    /// Leaf first. None in a short record: its copy holds the whole stack,
    /// so the frame-pointer walk is never taken.
    pub user: [u64; WALK],
    /// Registers and stack top for the CFI unwind (the frame-pointer walk
    /// in `user` is the fallback).
    pub copy: UserStackCopyOf<COPY>,
}

/// The full off-CPU stack record: the whole [`USER_STACK_COPY`] and the
/// frame-pointer walk, for a stack whose end is not learned or lies
/// beyond the largest short class.
pub type OffCpuStack = OffCpuStackOf<MAX_STACK_DEPTH, USER_STACK_COPY>;

/// A short off-CPU stack record: a copy of `COPY` bytes (one of
/// [`SHORT_STACK_COPIES`]) that reached the thread's learned stack end,
/// and no frame-pointer walk.
pub type ShortOffCpuStack<const COPY: usize> = OffCpuStackOf<0, COPY>;

/// The copy sizes of the short [`OffCpuStack`] classes, smallest first:
/// a stack is pushed in the smallest whose copy reaches its learned end.
pub const SHORT_STACK_COPIES: [usize; 3] = [1024, 2048, 4096];

/// The user registers of a thread and a copy of the top of its user stack
/// (from `sp` up), taken with a frame-pointer stack: the agent unwinds it
/// from the CFI of the mapped files (code built without frame pointers).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserStackCopyOf<const COPY: usize> {
    /// User `ip`, `sp`, `bp` (the task's saved user registers).
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Bytes of `stack` copied from `sp` (whole chunks; less than `COPY`
    /// when the stack ended before), or a negative errno when nothing
    /// could be read.
    pub stack_len: i32,
    /// Entries of `returns` filled.
    pub returns_len: u32,
    /// The thread's pending return-probed calls, innermost first: (the
    /// stack slot of the return address, the real return address). The
    /// kernel replaced the return address in that slot with its uretprobe
    /// trampoline; the agent puts the real one back before unwinding.
    pub returns: [[u64; 2]; MAX_PENDING_RETURNS],
    pub stack: [u8; COPY],
}

/// The whole user-stack copy ([`USER_STACK_COPY`] bytes).
pub type UserStackCopy = UserStackCopyOf<USER_STACK_COPY>;

/// A traced thread called its dynamic loader's debugger hook
/// (`_dl_debug_state`, the `r_brk` of `r_debug` that debuggers break on):
/// the process's link map changed or is about to. Pushed to the scheduler
/// ring with a wakeup of its own (the agent rescans that process's maps at
/// once); rare: a few per process start, one or two per `dlopen`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LinkMapChange {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
}

/// `task_struct` field offsets (bytes), read from the running kernel's BTF
/// because Rust eBPF has no CO-RE relocations.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskOffsets {
    pub pid: u32,
    pub tgid: u32,
    pub prio: u32,
    pub comm: u32,
    /// `thread_info.cpu` (x86-64) or `cpu`; [`TaskOffsets::ABSENT`] if neither.
    pub cpu: u32,
    /// `exit_code`; [`TaskOffsets::ABSENT`] if missing.
    pub exit_code: u32,
    /// `task_struct.utask`, `uprobe_task.return_instances`, and
    /// `return_instance.{stack, orig_ret_vaddr, next}`: the return
    /// addresses the kernel's uretprobe trampoline stands in for
    /// ([`UserStackCopy::returns`]); [`TaskOffsets::ABSENT`] if missing.
    pub utask: u32,
    pub return_instances: u32,
    pub ri_stack: u32,
    pub ri_orig_ret_vaddr: u32,
    pub ri_next: u32,
    /// `task_struct.signal` and `signal_struct.live` (the process's
    /// threads not yet exiting): on kernels whose `sched_process_exit`
    /// tracepoint has no `group_dead` (before 6.16), whether an exiting
    /// thread is its process's last; [`TaskOffsets::ABSENT`] if missing.
    pub signal: u32,
    pub signal_live: u32,
    /// `task_struct.__state` (Linux 5.14 and later): the state a switched-
    /// out task leaves in, on kernels whose `sched_switch` tracepoint does
    /// not pass it (before 5.18); [`TaskOffsets::ABSENT`] if missing.
    pub state: u32,
}

impl TaskOffsets {
    pub const ABSENT: u32 = u32::MAX;
}

/// Off-CPU stack capture policy (see [`Config::stack_mode`]).
pub mod stack_mode {
    /// No stacks.
    pub const OFF: u32 = 0;
    /// A per-thread token bucket: at most `stack_rate` stacks per second per
    /// thread on average, with bursts of `stack_burst`.
    pub const SAMPLED: u32 = 1;
    /// A stack at every switch-out of a traced thread.
    pub const ALL: u32 = 2;
}

/// Runtime configuration (map `CONFIG`, index 0), changeable while attached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Record every task's scheduling, not only the targets'.
    pub system_wide: u32,
    /// A [`stack_mode`] value.
    pub stack_mode: u32,
    /// Stacks per second per thread in [`stack_mode::SAMPLED`].
    pub stack_rate: u32,
    /// Burst size in [`stack_mode::SAMPLED`].
    pub stack_burst: u32,
    /// Ring-buffer fill (bytes) above which a submit wakes the reader; below
    /// it the reader drains on its own timer, so the agent's own wakeups do
    /// not feed back into events.
    pub wakeup_bytes: u64,
    /// `wakeup_bytes` for the device-call ring.
    pub device_wakeup_bytes: u64,
    /// Device-library probe levels enabled (bits of `uprobe::ProbeSpec::level_bit`).
    pub probe_levels: u32,
    /// Nonzero: the scheduler programs (switches, wakeups, off-CPU stacks)
    /// record nothing for the traced processes (the service's level 0);
    /// process lifetimes (fork, exec, exit) still are, so the traced set
    /// keeps following children. Ignored with `system_wide`.
    pub sched_off: u32,
    /// `wakeup_bytes` for the bystander ring.
    pub bystander_wakeup_bytes: u64,
}

/// Per-thread token bucket state for [`stack_mode::SAMPLED`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct StackBudget {
    /// Credit in nanoseconds; a stack costs `1e9 / stack_rate`.
    pub credit_ns: u64,
    pub last_ns: u64,
}

// Both sides rely on these sizes; a change here is an ABI change.
const _: () = assert!(core::mem::size_of::<EventHeader>() == 16);
const _: () = assert!(core::mem::size_of::<SchedSwitch>() == 80);
const _: () = assert!(core::mem::size_of::<SchedWaking>() == 56);
const _: () = assert!(core::mem::size_of::<ProcessFork>() == 48);
const _: () = assert!(core::mem::size_of::<ProcessExec>() == 48);
const _: () = assert!(core::mem::size_of::<ProcessExit>() == 56);
const _: () = assert!(core::mem::size_of::<TaskRename>() == 56);
const _: () = assert!(core::mem::size_of::<LinkMapChange>() == 24);
const _: () = assert!(
    core::mem::size_of::<UserStackCopy>() == 32 + 16 * MAX_PENDING_RETURNS + USER_STACK_COPY
);
const _: () = assert!(USER_STACK_COPY.is_multiple_of(USER_STACK_CHUNK));
const _: () = assert!(
    core::mem::size_of::<OffCpuStack>()
        == 32 + 2 * 8 * MAX_STACK_DEPTH + core::mem::size_of::<UserStackCopy>()
);
// Each class is a whole number of copy chunks, smaller than the next, and
// its record size differs from every other class's (the agent's only way
// to tell them apart).
const _: () = {
    let mut i = 0;
    while i < SHORT_STACK_COPIES.len() {
        let copy = SHORT_STACK_COPIES[i];
        assert!(copy.is_multiple_of(USER_STACK_CHUNK));
        let next = if i + 1 < SHORT_STACK_COPIES.len() {
            SHORT_STACK_COPIES[i + 1]
        } else {
            USER_STACK_COPY
        };
        assert!(copy < next);
        i += 1;
    }
};
const _: () = assert!(
    core::mem::size_of::<ShortOffCpuStack<1024>>()
        == 32 + 8 * MAX_STACK_DEPTH + 32 + 16 * MAX_PENDING_RETURNS + 1024
);
const _: () = assert!(
    core::mem::size_of::<ShortOffCpuStack<{ SHORT_STACK_COPIES[2] }>>()
        < core::mem::size_of::<OffCpuStack>()
);
const _: () = assert!(core::mem::size_of::<Config>() == 48);
const _: () = assert!(core::mem::size_of::<TaskOffsets>() == 56);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain-old-data records with explicit padding and no pointers.
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::TaskOffsets {}
    unsafe impl aya::Pod for super::StackBudget {}
}
