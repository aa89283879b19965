//! Records of user-space probes on device libraries (libcudart, libnccl,
//! libcupti, libascendcl, libhccl, libmspti).
//!
//! One generic entry program and one generic return program serve every
//! probed function. Each probe (one place in one library file, shared by
//! every traced process mapping the file) has a slot, its attach cookie:
//! the programs find what to copy at that slot of `UPROBE_SPECS` and count
//! hits at that slot of `UPROBE_HITS` (array lookups: a hash lookup keyed by
//! process and address cost each program about 40 ns more). Records carry
//! the slot and the probed address (`bpf_get_func_ip`); the agent maps them
//! back to (library, symbol). The kernel copies raw machine state;
//! `xpuscope-probes` decodes it into meaning using the catalog.

use crate::{EventHeader, MAX_STACK_DEPTH, UserStackCopy};

/// Words copied from the stack at entry: `sp[0]` (the return address when
/// the probe sits on the function's first instruction) and the stack-passed
/// arguments after it.
pub const ENTRY_STACK_WORDS: usize = 8;
/// Most bytes copied through a pointer argument at entry or return.
pub const DEREF_BYTES: usize = 128;

/// No pointer argument is dereferenced.
pub const DEREF_NONE: u8 = 0xff;
/// `entry_deref_arg` value: copy from the stack, at `sp + entry_stack_off`
/// (an aggregate passed by value, such as `ncclCommInitRank`'s unique id).
pub const DEREF_STACK: u8 = 0xfe;

/// `ProbeSpec::flags`: at return, read the u64 pointer stored at the saved
/// argument, then copy its pointee (`CUpti_Activity **record`).
pub const RETURN_TWICE: u16 = 1 << 0;
/// `ProbeSpec::flags`: copy at return only when the 32-bit status in rax is 0.
pub const RETURN_ON_SUCCESS: u16 = 1 << 1;
/// `ProbeSpec::flags`: the entry copy is a NUL-terminated string.
pub const ENTRY_STRING: u16 = 1 << 2;

/// `ProbeSpec::flags`: at return, push the caller's user stack
/// ([`UprobeStack`]) before the return record: where device memory was
/// allocated (an OOM's stack, the largest live allocation sites). Taken at
/// return, not entry: there the frame-pointer chain starts in the caller
/// and no frame is skipped.
pub const RETURN_USER_STACK: u16 = 1 << 3;

/// `ProbeSpec::flags`: copy `sp[0..ENTRY_STACK_WORDS]` at entry (the
/// function has stack-passed arguments); otherwise the words are zero and
/// the entry skips a user-memory read.
pub const ENTRY_STACK_ARGS: u16 = 1 << 4;

/// `ProbeSpec::flags`: a launch made by an application-facing library
/// (`cudaLaunchKernel`, `aclrtLaunchKernel`): counted in the kernel at
/// every level ([`LaunchCounts`]), and marked on its thread so that the
/// driver launch made inside it is not counted again.
pub const COUNT_LAUNCH_UPPER: u16 = 1 << 5;
/// `ProbeSpec::flags`: a launch of the library below (`cuLaunchKernel`,
/// `rtKernelLaunch`): counted unless its thread is inside an upper launch.
pub const COUNT_LAUNCH_LOWER: u16 = 1 << 6;
/// `ProbeSpec::flags`, with one of the two above: the launch is a graph's
/// (counted apart: one graph launch runs many kernels).
pub const COUNT_GRAPH: u16 = 1 << 7;

/// `ProbeSpec::flags`: stamp the process's launch counts on the return
/// record ([`UprobeReturn::launches`]): set on the calls that can mark a
/// step's boundary (syncs, collectives, markers), not on the others (a
/// lookup saved on every allocation, and on every launch at level 1).
pub const RETURN_LAUNCH_COUNTS: u16 = 1 << 8;

/// What to copy for one probed function, at its probe's slot in the
/// `UPROBE_SPECS` array; written by the agent before it attaches the probe.
/// An all-zero spec (`level_bit` 0) is an unused or silenced slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Register argument index (0 = rdi ... 5 = r9) whose pointee is copied
    /// at ENTRY, [`DEREF_STACK`], or [`DEREF_NONE`].
    pub entry_deref_arg: u8,
    /// Register argument index whose pointee is copied at RETURN (an out
    /// parameter such as `cudaMalloc`'s `void **`), or [`DEREF_NONE`].
    pub return_deref_arg: u8,
    /// [`RETURN_TWICE`], [`RETURN_ON_SUCCESS`], [`ENTRY_STRING`],
    /// [`RETURN_USER_STACK`], [`ENTRY_STACK_ARGS`], [`COUNT_LAUNCH_UPPER`],
    /// [`COUNT_LAUNCH_LOWER`], [`COUNT_GRAPH`], [`RETURN_LAUNCH_COUNTS`].
    pub flags: u16,
    /// Bytes to copy at entry (at most [`DEREF_BYTES`]).
    pub entry_deref_len: u16,
    /// Bytes to copy at return (at most [`DEREF_BYTES`]).
    pub return_deref_len: u16,
    /// With [`DEREF_STACK`]: byte offset from the probe's sp.
    pub entry_stack_off: u32,
    /// Capture level bit this probe belongs to; the probe pushes nothing
    /// when `UPROBE_LEVELS` (config) lacks the bit.
    pub level_bit: u32,
}

impl Default for ProbeSpec {
    fn default() -> Self {
        Self {
            entry_deref_arg: DEREF_NONE,
            return_deref_arg: DEREF_NONE,
            flags: 0,
            entry_deref_len: 0,
            return_deref_len: 0,
            entry_stack_off: 0,
            level_bit: 1,
        }
    }
}

/// A probe as one process sees it: the process and the probed address in
/// it (how the agent's probe table is keyed).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProbeKey {
    pub tgid: u32,
    pub _pad: u32,
    /// Absolute address of the probe in the process (what
    /// `bpf_get_func_ip` returns: function start + placement offset).
    pub probe_ip: u64,
}

/// The call a pointer saved at entry belongs to: its thread, its probe's
/// slot and the stack pointer at entry (at the return the return address
/// has been popped: 8 bytes higher). Keyed by call, not a per-thread stack
/// of pointers: with a stack, every entry whose return never comes (the
/// return probe attached a moment after the entry probe, or detached
/// during the call, or a `longjmp` out of it) shifted every later pointer
/// of that thread, and past 8 of them no return of the thread found its
/// pointer again. Seen on an H100: PyTorch's profiler thread calls
/// `cuptiGetTimestamp` ~4,500 times a second, so attaching its probe pair
/// left it broken, and all 11,540 activity records it read went unread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingKey {
    pub tid: u32,
    pub slot: u32,
    pub sp: u64,
}

/// What the return program adds to its stack pointer to get the entry's.
pub const RETURN_SP_OFFSET: u64 = 8;

/// A traced process's launches so far, counted in the kernel by the
/// launch probes' entry ends at every capture level (one record per
/// launch costs too much to be the default: see the measurements), and
/// stamped on each return record of the process. Both zero: no launch
/// seen yet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchCounts {
    /// Kernel launches (direct, cooperative, `Ex`).
    pub kernels: u64,
    /// Graph launches.
    pub graphs: u64,
}

/// A thread inside an upper launch (`COUNT_LAUNCH_UPPER`): where its
/// return address sits and what it is. A lower launch on the thread
/// deeper than `sp` while `*sp` still holds `ret` is that launch's own
/// work (the driver call `cudaLaunchKernel` makes); the mark is used once.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenLaunch {
    pub sp: u64,
    pub ret: u64,
}

/// A probed function was entered.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UprobeEntry {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    /// Absolute probe address (function start + placement offset).
    pub probe_ip: u64,
    /// rdi, rsi, rdx, rcx, r8, r9: the six register arguments.
    pub args: [u64; 6],
    /// Stack pointer at the probe.
    pub sp: u64,
    /// `sp[0..ENTRY_STACK_WORDS]` with [`ENTRY_STACK_ARGS`] (unreadable
    /// words are 0), else zeros.
    pub stack: [u64; ENTRY_STACK_WORDS],
    /// Bytes of `deref` that are valid (0 if nothing was copied).
    pub deref_len: u32,
    /// The probe's slot (attach cookie): which function of which library
    /// file, whatever the process.
    pub slot: u32,
    /// Copy of `*args[spec.entry_deref_arg]`.
    pub deref: [u8; DEREF_BYTES],
}

/// A probed function returned.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UprobeReturn {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    /// The same probe address as the matching entry.
    pub probe_ip: u64,
    /// rax.
    pub ret: u64,
    /// Bytes of `deref` that are valid.
    pub deref_len: u32,
    /// The probe's slot, as in [`UprobeEntry::slot`].
    pub slot: u32,
    /// The process's launches so far (where the step boundaries a return
    /// marks get their launch counts).
    pub launches: LaunchCounts,
    /// Copy of `*saved_args[spec.return_deref_arg]` (saved at entry).
    pub deref: [u8; DEREF_BYTES],
}

/// The user stack of a thread returning from a probed function (spec flag
/// [`RETURN_USER_STACK`]), leaf (the return address in the caller) first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UprobeStack {
    pub header: EventHeader,
    pub tid: u32,
    pub tgid: u32,
    /// The probe address of the call returning.
    pub probe_ip: u64,
    /// Bytes of `user` filled, or the negative errno of `bpf_get_stack`.
    pub user_bytes: i32,
    pub _pad: u32,
    pub user: [u64; MAX_STACK_DEPTH],
    /// Registers and stack top at the return (in the caller) for the CFI
    /// unwind; `user` is the fallback.
    pub copy: UserStackCopy,
}

const _: () = assert!(
    core::mem::size_of::<UprobeStack>()
        == 16 + 8 + 8 + 8 + 8 * MAX_STACK_DEPTH + core::mem::size_of::<UserStackCopy>()
);
const _: () = assert!(core::mem::size_of::<UprobeEntry>() == 16 + 16 + 48 + 8 + 64 + 8 + 128);
const _: () = assert!(core::mem::size_of::<UprobeReturn>() == 16 + 16 + 8 + 8 + 16 + 128);
const _: () = assert!(core::mem::size_of::<ProbeSpec>() == 16);
const _: () = assert!(core::mem::size_of::<ProbeKey>() == 16);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain-old-data with explicit padding.
    unsafe impl aya::Pod for super::ProbeSpec {}
    unsafe impl aya::Pod for super::ProbeKey {}
}
