//! The catalog: which device-library functions xpuscope probes, and how.
//!
//! Plain data, one table per library ([`Library::functions`]): the exported
//! name (and its aliases), what the call means ([`CallKind`]), where each
//! argument sits at entry under the System V x86-64 ABI ([`ArgSpec`]), what
//! the kernel must copy through a pointer at entry or return ([`Capture`]),
//! the capture level ([`Level`]) and whether the function may be absent
//! (`optional`: newer/older versions or the stand-ins lack it).
//!
//! ```
//! use xpuscope_probes::catalog::{Library, Level};
//! let lib = Library::from_path("/opt/venv/nvidia/nccl/lib/libnccl.so.2").unwrap();
//! assert_eq!(lib, Library::Nccl);
//! let f = lib.function("pncclAllReduce").unwrap(); // aliases resolve too
//! assert_eq!(f.name, "ncclAllReduce");
//! assert_eq!(f.level, Level::L0);
//! ```
//!
//! ABI facts the layouts encode (checked against the real libraries'
//! disassembly): a `dim3` (12 bytes, INTEGER class) travels in two registers
//! (`x | y << 32`, then `z`); an aggregate over 16 bytes (`ncclUniqueId`,
//! 128 bytes) is passed in memory on the stack and takes no register, so
//! `ncclCommInitRank(comm, nranks, id, rank)` has `rank` in the third
//! register; arguments past the sixth register are at `sp + 8 + 8 * slot` at
//! entry (`sp[0]` is the return address).

mod ascend;
mod ascend_runtime;
mod nvidia;
mod nvidia_driver;
mod ops;
pub mod status;

pub use ops::CommOp;

use xpuscope_common::uprobe::{
    DEREF_BYTES, DEREF_NONE, DEREF_STACK, ENTRY_STACK_ARGS, ENTRY_STRING, ProbeSpec,
    RETURN_ON_SUCCESS, RETURN_TWICE,
};

use crate::placement::{Reg, RegSet};

/// A device runtime library the agent knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Library {
    /// CUDA runtime, `libcudart.so.12`.
    Cudart,
    /// CUDA driver, `libcuda.so.1` (installed with the kernel driver, as
    /// `libcuda.so.<driver version>`).
    Cuda,
    /// NCCL, `libnccl.so.2`.
    Nccl,
    /// CUPTI activity API, `libcupti.so.12`.
    Cupti,
    /// AscendCL runtime, `libascendcl.so`.
    AscendCl,
    /// The CANN runtime below AscendCL, `libruntime.so`.
    AscendRuntime,
    /// HCCL, `libhccl.so`.
    Hccl,
    /// MSPTI activity API, `libmspti.so`.
    Mspti,
}

/// Device vendor: device numbers and memory are accounted per vendor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Vendor {
    Nvidia,
    Ascend,
}

impl Library {
    pub const ALL: [Library; 8] = [
        Library::Cudart,
        Library::Cuda,
        Library::Nccl,
        Library::Cupti,
        Library::AscendCl,
        Library::AscendRuntime,
        Library::Hccl,
        Library::Mspti,
    ];

    /// Short name for traces and logs ("cudart", "nccl", ...).
    pub fn name(self) -> &'static str {
        match self {
            Library::Cudart => "cudart",
            Library::Cuda => "cuda",
            Library::Nccl => "nccl",
            Library::Cupti => "cupti",
            Library::AscendCl => "ascendcl",
            Library::AscendRuntime => "ascend_runtime",
            Library::Hccl => "hccl",
            Library::Mspti => "mspti",
        }
    }

    /// The file-name stem before `.so` (`libcudart`).
    pub fn stem(self) -> &'static str {
        match self {
            Library::Cudart => "libcudart",
            Library::Cuda => "libcuda",
            Library::Nccl => "libnccl",
            Library::Cupti => "libcupti",
            Library::AscendCl => "libascendcl",
            Library::AscendRuntime => "libruntime",
            Library::Hccl => "libhccl",
            Library::Mspti => "libmspti",
        }
    }

    /// The SONAME of the version this catalog was written against.
    pub fn soname(self) -> &'static str {
        match self {
            Library::Cudart => "libcudart.so.12",
            Library::Cuda => "libcuda.so.1",
            Library::Nccl => "libnccl.so.2",
            Library::Cupti => "libcupti.so.12",
            Library::AscendCl => "libascendcl.so",
            Library::AscendRuntime => "libruntime.so",
            Library::Hccl => "libhccl.so",
            Library::Mspti => "libmspti.so",
        }
    }

    pub fn vendor(self) -> Vendor {
        match self {
            Library::Cudart | Library::Cuda | Library::Nccl | Library::Cupti => Vendor::Nvidia,
            Library::AscendCl | Library::AscendRuntime | Library::Hccl | Library::Mspti => {
                Vendor::Ascend
            }
        }
    }

    /// The functions to probe, public names first.
    pub fn functions(self) -> &'static [FunctionSpec] {
        match self {
            Library::Cudart => nvidia::CUDART,
            Library::Cuda => nvidia_driver::CUDA,
            Library::Nccl => nvidia::NCCL,
            Library::Cupti => nvidia::CUPTI,
            Library::AscendCl => ascend::ACL,
            Library::AscendRuntime => ascend_runtime::RUNTIME,
            Library::Hccl => ascend::HCCL,
            Library::Mspti => ascend::MSPTI,
        }
    }

    /// The catalog entry named `name` or having it as an alias.
    pub fn function(self, name: &str) -> Option<&'static FunctionSpec> {
        self.functions()
            .iter()
            .find(|f| f.name == name || f.aliases.contains(&name))
    }

    /// Which library a mapped file is, from its file name: `<stem>.so`,
    /// `<stem>.so.<version>` or an auditwheel copy `<stem>-<8 hex>.so[...]`.
    /// Plug-ins and siblings (`libnccl-net.so`, `libhccl_alg.so`) do not
    /// match. A trailing ` (deleted)` (a replaced file, as `/proc/PID/maps`
    /// shows it) is ignored.
    pub fn from_path(path: &str) -> Option<Library> {
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        let file = path.rsplit('/').next()?;
        let (stem, after) = file.split_once(".so")?;
        let version_ok = after.is_empty()
            || (after.starts_with('.')
                && after[1..].bytes().all(|b| b.is_ascii_digit() || b == b'.'));
        if !version_ok {
            return None;
        }
        Library::ALL.into_iter().find(|lib| {
            stem == lib.stem()
                || stem.strip_prefix(lib.stem()).is_some_and(|rest| {
                    rest.len() == 9
                        && rest.starts_with('-')
                        && rest[1..].bytes().all(|b| b.is_ascii_hexdigit())
                })
        })
    }
}

/// Capture level: L0 is always on and cheap; higher levels add volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Level {
    /// Collectives, synchronisation, memory, communicator set-up, the
    /// job's markers (mstx: a few per step, and they number its steps).
    L0,
    /// Kernel launches, copies, events.
    L1,
    /// Activity records (device timestamps) and their plumbing.
    L2,
}

impl Level {
    /// The bit of `ProbeSpec::level_bit`; a config mask enabling level N
    /// should also enable every lower level.
    pub fn bit(self) -> u32 {
        1 << self as u32
    }

    /// Mask of this level and all below it.
    pub fn mask_up_to(self) -> u32 {
        (self.bit() << 1) - 1
    }
}

/// What a call means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallKind {
    Collective(Collective),
    SendRecv(Direction),
    GroupStart,
    GroupEnd,
    /// `ncclGetUniqueId` / `HcclGetRootInfo`: the communicator id is made.
    UniqueId,
    CommInit(CommInit),
    /// `ncclCommCount` / `HcclGetRankSize`, ...: an int written at return.
    CommQuery(CommQuery),
    CommEnd(CommEnd),
    Malloc,
    Free,
    SetDevice,
    Memcpy,
    Memset,
    Launch(LaunchKind),
    Sync(SyncKind),
    /// The driver's virtual-memory calls (`cuMemMap`, ...).
    Vmm(VmmOp),
    /// A call handing out a kernel handle (`cuModuleGetFunction`, ...):
    /// what names the driver's launches.
    KernelHandle(HandleKind),
    EventRecord,
    StreamWaitEvent,
    HostFunc,
    /// `cuptiActivityGetNextRecord` / `msptiActivityGetNextRecord`.
    ActivityNextRecord,
    ActivityFlush,
    ActivityRegister,
    ActivityEnable,
    /// `cuptiGetTimestamp`: the activity clock, sampled by the application.
    ClockSample,
    /// `mstxMarkA`.
    Mark,
    /// `mstxRangeStartA` (returns the range id).
    RangeStart,
    RangeEnd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    Barrier,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Send,
    Recv,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommInit {
    /// `ncclCommInitRank[Config]`: id by value, nranks, rank.
    Rank,
    /// `ncclCommInitAll`: ndev communicators in one process.
    All,
    /// `ncclCommSplit(comm, color, key, *newcomm, config)`.
    Split,
    /// `HcclCommInitRootInfo[Config]`: root info by pointer.
    RootInfo,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommQuery {
    Size,
    Rank,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommEnd {
    Destroy,
    Abort,
    Finalize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LaunchKind {
    /// `cudaLaunchKernel` (grid/block dims) or `aclrtLaunchKernel` (blocks).
    Kernel,
    /// `cudaLaunchKernelExC(config*, func, args)`: dims in the config.
    KernelExC,
    /// `cudaGraphLaunch(exec, stream)`.
    Graph,
}

/// The driver's virtual memory: an address range is reserved, physical
/// memory created, mapped into the range and unmapped, released. Device
/// memory in use is what is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VmmOp {
    /// `cuMemAddressReserve(*ptr, size, alignment, addr, flags)`.
    Reserve,
    /// `cuMemAddressFree(ptr, size)`.
    AddressFree,
    /// `cuMemCreate(*handle, size, prop, flags)`.
    Create,
    /// `cuMemRelease(handle)`.
    Release,
    /// `cuMemMap(ptr, size, offset, handle, flags)`.
    Map,
    /// `cuMemUnmap(ptr, size)`.
    Unmap,
}

/// Which handle a kernel-handle call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HandleKind {
    /// `cuModuleGetFunction(*CUfunction, CUmodule, name)`.
    ModuleFunction,
    /// `cuLibraryGetKernel(*CUkernel, CUlibrary, name)`.
    LibraryKernel,
    /// `cuKernelGetFunction(*CUfunction, CUkernel)`: no name, the kernel's.
    KernelFunction,
    /// `rtFunctionRegister(binHandle, stubFunc, stubName, ...)`: the stub
    /// function, passed in, launches the named kernel once the call
    /// succeeded.
    StubRegister,
    /// `rtGetFunctionByName(stubName, *stubFunc)`.
    StubByName,
    /// `rtsFuncGetByName` / `rtBinaryGetFunctionByName(binHandle,
    /// kernelName, *rtFuncHandle)`.
    BinaryFunction,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyncKind {
    Stream,
    Device,
    Event,
}

/// What an argument is, so the decoder can type it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    SendBuf,
    RecvBuf,
    /// In-place buffer (`ncclBcast`, `HcclBroadcast`, send/recv buffer).
    Buf,
    /// Element count (a `size_t`/`uint64_t`).
    Count,
    /// `ncclDataType_t` / `HcclDataType` (by the library).
    Dtype,
    /// `ncclRedOp_t` / `HcclReduceOp`.
    RedOp,
    Root,
    Peer,
    Comm,
    Stream,
    /// `T *` written at return with a communicator handle (or an array).
    CommOut,
    NRanks,
    Rank,
    Config,
    DevList,
    Color,
    Key,
    /// `ncclUniqueId *` / `HcclRootInfo *` filled at return.
    IdOut,
    /// `const HcclRootInfo *` read at entry.
    RootInfo,
    /// `int *` / `uint32_t *` written at return.
    ValueOut,
    /// `void **` written at return with the allocation.
    DevPtrOut,
    DevPtr,
    /// Bytes (`size_t`).
    Size,
    Policy,
    Device,
    Dst,
    Src,
    DestMax,
    /// `cudaMemcpyKind` / `aclrtMemcpyKind` (by the library).
    MemcpyKind,
    Value,
    Func,
    /// `dim3` first eightbyte: `x | y << 32`.
    GridXY,
    /// One `unsigned int` dimension (the driver's launches).
    GridX,
    GridY,
    BlockX,
    BlockY,
    /// `dim3` second eightbyte: `z` in the low 32 bits.
    GridZ,
    BlockXY,
    BlockZ,
    KernelArgs,
    SharedMem,
    NumBlocks,
    ArgsSize,
    /// `const cudaLaunchConfig_t *`, copied at entry.
    LaunchConfig,
    GraphExec,
    Event,
    Flags,
    HostFn,
    UserData,
    ActivityBuffer,
    ValidSize,
    /// `CUpti_Activity **` / `msptiActivity **`.
    RecordOut,
    ActivityKind,
    Callback,
    TimestampOut,
    /// `const char *` copied at entry as a string.
    Message,
    RangeId,
    Timeout,
    /// `size_t` alignment (`cuMemAddressReserve`).
    Alignment,
    /// `size_t` offset into a physical allocation (`cuMemMap`).
    Offset,
    /// `CUmemGenericAllocationHandle` (a u64).
    MemHandle,
    /// `CUmemGenericAllocationHandle *` written at return.
    MemHandleOut,
    /// `const CUmemAllocationProp *` (not read).
    AllocProps,
    /// `CUfunction *` / `CUkernel *` written at return.
    FuncOut,
    /// `CUmodule` / `CUlibrary`.
    Module,
    /// `const char *` kernel name, copied at entry as a string.
    KernelName,
    /// An argument the decoder does not read (`rtSmDesc_t *`, a tiling
    /// key), named so a layout's registers stay consecutive.
    Opaque,
}

/// Where an argument is at the function's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgLoc {
    /// Register argument 0..=5: rdi, rsi, rdx, rcx, r8, r9.
    Reg(u8),
    /// Stack-passed argument: at `sp + 8 + 8 * slot` at entry (`sp[0]` is
    /// the return address); a probe placed `sp_delta` bytes deeper reads it
    /// at `sp + 8 + sp_delta + 8 * slot`.
    Stack(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ArgSpec {
    pub role: Role,
    pub loc: ArgLoc,
}

/// Where an entry copy comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DerefSource {
    /// The pointee of register argument `n`.
    Arg(u8),
    /// An aggregate passed by value on the stack, starting at stack slot
    /// `slot` (`sp + 8 + 8 * slot` at entry).
    Stack { slot: u8 },
}

/// Bytes copied at entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryDeref {
    pub source: DerefSource,
    /// At most [`DEREF_BYTES`].
    pub len: u16,
    /// NUL-terminated string (copy up to `len` bytes, stop at the NUL).
    pub string: bool,
}

/// Bytes copied at return through a pointer argument saved at entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReturnDeref {
    /// Register argument index of the out-pointer.
    pub arg: u8,
    /// At most [`DEREF_BYTES`].
    pub len: u16,
    /// Two levels: read the pointer stored at `*arg`, then copy `len`
    /// bytes at that pointer (`CUpti_Activity **record` -> the record).
    pub twice: bool,
}

/// What the kernel copies besides registers and stack words.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Capture {
    pub entry: Option<EntryDeref>,
    pub ret: Option<ReturnDeref>,
}

/// How to read the return value (rax).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetKind {
    /// A 32-bit status enum; 0 is success (cudaSuccess, ncclSuccess,
    /// HCCL_SUCCESS, ACL_SUCCESS, CUPTI_SUCCESS, MSPTI_SUCCESS).
    Status,
    /// A value, never an error (`mstxRangeStartA`'s range id).
    Value,
    /// `void`.
    Void,
}

/// One probed function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FunctionSpec {
    /// The public name reported on the trace.
    pub name: &'static str,
    /// Other exported names of the same function (same address), e.g. the
    /// strong `pncclAllReduce` behind the weak `ncclAllReduce`; resolved
    /// when the public name is absent, probed once.
    pub aliases: &'static [&'static str],
    pub kind: CallKind,
    pub args: &'static [ArgSpec],
    pub capture: Capture,
    pub level: Level,
    pub ret: RetKind,
    /// May be absent from a library version (or the stand-ins): resolution
    /// reports it missing without failing.
    pub optional: bool,
}

impl FunctionSpec {
    pub(crate) const fn new(
        name: &'static str,
        kind: CallKind,
        level: Level,
        args: &'static [ArgSpec],
    ) -> Self {
        Self {
            name,
            aliases: &[],
            kind,
            args,
            capture: Capture {
                entry: None,
                ret: None,
            },
            level,
            ret: RetKind::Status,
            optional: false,
        }
    }

    pub(crate) const fn aliases(mut self, aliases: &'static [&'static str]) -> Self {
        self.aliases = aliases;
        self
    }

    pub(crate) const fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    pub(crate) const fn returns(mut self, ret: RetKind) -> Self {
        self.ret = ret;
        self
    }

    pub(crate) const fn entry_deref(mut self, source: DerefSource, len: u16) -> Self {
        self.capture.entry = Some(EntryDeref {
            source,
            len,
            string: false,
        });
        self
    }

    pub(crate) const fn entry_string(mut self, arg: u8, len: u16) -> Self {
        self.capture.entry = Some(EntryDeref {
            source: DerefSource::Arg(arg),
            len,
            string: true,
        });
        self
    }

    pub(crate) const fn ret_deref(mut self, arg: u8, len: u16) -> Self {
        self.capture.ret = Some(ReturnDeref {
            arg,
            len,
            twice: false,
        });
        self
    }

    pub(crate) const fn ret_deref_twice(mut self, arg: u8, len: u16) -> Self {
        self.capture.ret = Some(ReturnDeref {
            arg,
            len,
            twice: true,
        });
        self
    }

    /// Where the argument with `role` is, if the function has one.
    pub fn arg(&self, role: Role) -> Option<ArgLoc> {
        self.args.iter().find(|a| a.role == role).map(|a| a.loc)
    }

    /// Registers the decoder reads from an entry record of this function:
    /// its register arguments, the deref sources, and rsp when anything
    /// lives on the stack. Probe placement never moves past an instruction
    /// that writes one of them.
    pub fn reads(&self) -> RegSet {
        let mut set = RegSet::EMPTY;
        for a in self.args {
            set = match a.loc {
                ArgLoc::Reg(i) => set.with(Reg::arg(i)),
                ArgLoc::Stack(_) => set.with(Reg::Rsp),
            };
        }
        match self.capture.entry.map(|e| e.source) {
            Some(DerefSource::Arg(i)) => set = set.with(Reg::arg(i)),
            Some(DerefSource::Stack { .. }) => set = set.with(Reg::Rsp),
            None => {}
        }
        if let Some(r) = self.capture.ret {
            set = set.with(Reg::arg(r.arg));
        }
        // The return probe hijacks the return address at sp: never move sp.
        set.with(Reg::Rsp)
    }

    /// The kernel spec (`xpuscope_common::uprobe::ProbeSpec`) carrying
    /// [`Capture`] exactly: a by-value stack aggregate is copied from
    /// `sp + 8 + 8 * slot` (the attacher adds the placement's `sp_delta`,
    /// see [`crate::decode::table::ProbeTable::add_library`]), strings with
    /// `ENTRY_STRING`, two-level return copies with `RETURN_TWICE`, and
    /// return copies of status-returning functions only on success.
    pub fn probe_spec(&self) -> ProbeSpec {
        let mut spec = ProbeSpec {
            level_bit: self.level.bit(),
            ..ProbeSpec::default()
        };
        // Stack words are read only for functions that pass arguments (or
        // an aggregate) on the stack: the read costs every call.
        let on_stack = self.args.iter().any(|a| matches!(a.loc, ArgLoc::Stack(_)))
            || matches!(
                self.capture.entry.map(|e| e.source),
                Some(DerefSource::Stack { .. })
            );
        if on_stack {
            spec.flags |= ENTRY_STACK_ARGS;
        }
        if let Some(e) = self.capture.entry {
            match e.source {
                DerefSource::Arg(i) => spec.entry_deref_arg = i,
                DerefSource::Stack { slot } => {
                    spec.entry_deref_arg = DEREF_STACK;
                    spec.entry_stack_off = 8 + 8 * u32::from(slot);
                }
            }
            spec.entry_deref_len = e.len.min(DEREF_BYTES as u16);
            if e.string {
                spec.flags |= ENTRY_STRING;
            }
            if spec.entry_deref_len == 0 {
                spec.entry_deref_arg = DEREF_NONE;
                spec.entry_stack_off = 0;
            }
        }
        if let Some(r) = self.capture.ret {
            spec.return_deref_arg = r.arg;
            spec.return_deref_len = r.len.min(DEREF_BYTES as u16);
            if r.twice {
                spec.flags |= RETURN_TWICE;
            }
            if self.ret == RetKind::Status {
                spec.flags |= RETURN_ON_SUCCESS;
            }
            if spec.return_deref_len == 0 {
                spec.return_deref_arg = DEREF_NONE;
                spec.flags &= !(RETURN_TWICE | RETURN_ON_SUCCESS);
            }
        }
        spec
    }
}

/// Every catalog entry with its library.
pub fn all_functions() -> impl Iterator<Item = (Library, &'static FunctionSpec)> {
    Library::ALL
        .into_iter()
        .flat_map(|lib| lib.functions().iter().map(move |f| (lib, f)))
}

// Constructors shared by the tables.
pub(crate) const fn reg(role: Role, i: u8) -> ArgSpec {
    ArgSpec {
        role,
        loc: ArgLoc::Reg(i),
    }
}

pub(crate) const fn stack(role: Role, slot: u8) -> ArgSpec {
    ArgSpec {
        role,
        loc: ArgLoc::Stack(slot),
    }
}

#[cfg(test)]
mod tests;
