//! The CUDA driver API, `libcuda.so.1` (CUDA 12 ABI, `cuda.h`).
//!
//! cuBLAS, NCCL (2.19+), Triton and PyTorch's expandable segments call the
//! driver directly; libcudart calls it too, on the same thread, inside its
//! own calls (the decoder folds such a nested driver call into the runtime
//! call, see `decode::nesting`). Handles (`CUfunction`, `CUkernel`,
//! `CUstream`, `CUevent`, `CUgraphExec`, `CUmodule`, `CUlibrary`) are
//! pointers; `CUdeviceptr` and `CUmemGenericAllocationHandle` are 64-bit
//! integers; `unsigned int` launch dimensions each take a register or an
//! 8-byte stack slot (low 32 bits).
//!
//! Kernel launches name no kernel, only a handle: the calls that hand out
//! handles (`cuModuleGetFunction`, `cuLibraryGetKernel`,
//! `cuKernelGetFunction`) are probed at L0 with their name string and the
//! handle they return, and the decoder names launches from them.

use super::CallKind::*;
use super::Role::*;
use super::{
    ArgSpec, CallKind, DerefSource, FunctionSpec, HandleKind, LaunchKind, Level, SyncKind, VmmOp,
    reg, stack,
};

const fn f(
    name: &'static str,
    kind: CallKind,
    level: Level,
    args: &'static [ArgSpec],
) -> FunctionSpec {
    FunctionSpec::new(name, kind, level, args)
}

/// Most bytes of a kernel name copied at entry (longer names are cut; a
/// mangled C++ name keeps its distinguishing prefix).
pub(crate) const KERNEL_NAME_BYTES: u16 = 128;

/// `cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ,
/// blockDimX, blockDimY, blockDimZ, unsigned sharedMemBytes, CUstream,
/// void **kernelParams, void **extra)`: six registers, then the stack.
const LAUNCH: &[ArgSpec] = &[
    reg(Func, 0),
    reg(GridX, 1),
    reg(GridY, 2),
    reg(GridZ, 3),
    reg(BlockX, 4),
    reg(BlockY, 5),
    stack(BlockZ, 0),
    stack(SharedMem, 1),
    stack(Stream, 2),
    stack(KernelArgs, 3),
];
/// `cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f,
/// void **kernelParams, void **extra)`.
const LAUNCH_EX: &[ArgSpec] = &[reg(LaunchConfig, 0), reg(Func, 1), reg(KernelArgs, 2)];
/// The part of `CUlaunchConfig` decoded: gridDimX..Z@0, blockDimX..Z@12,
/// `unsigned sharedMemBytes`@24, hStream@32.
pub(crate) const LAUNCH_CONFIG_BYTES: u16 = 40;
const GRAPH: &[ArgSpec] = &[reg(GraphExec, 0), reg(Stream, 1)];
/// `(CUdeviceptr *dptr, size_t bytesize)`.
const MEM_ALLOC: &[ArgSpec] = &[reg(DevPtrOut, 0), reg(Size, 1)];
const MEM_ALLOC_ASYNC: &[ArgSpec] = &[reg(DevPtrOut, 0), reg(Size, 1), reg(Stream, 2)];
const MEM_FREE_ASYNC: &[ArgSpec] = &[reg(DevPtr, 0), reg(Stream, 1)];
/// `cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
/// CUdeviceptr addr, unsigned long long flags)`.
const ADDRESS_RESERVE: &[ArgSpec] = &[
    reg(DevPtrOut, 0),
    reg(Size, 1),
    reg(Alignment, 2),
    reg(Dst, 3),
    reg(Flags, 4),
];
/// `(CUdeviceptr ptr, size_t size)`: `cuMemAddressFree`, `cuMemUnmap`.
const RANGE: &[ArgSpec] = &[reg(DevPtr, 0), reg(Size, 1)];
/// `cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
/// const CUmemAllocationProp *prop, unsigned long long flags)`.
const MEM_CREATE: &[ArgSpec] = &[
    reg(MemHandleOut, 0),
    reg(Size, 1),
    reg(AllocProps, 2),
    reg(Flags, 3),
];
const MEM_RELEASE: &[ArgSpec] = &[reg(MemHandle, 0)];
/// `cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
/// CUmemGenericAllocationHandle handle, unsigned long long flags)`.
const MEM_MAP: &[ArgSpec] = &[
    reg(DevPtr, 0),
    reg(Size, 1),
    reg(Offset, 2),
    reg(MemHandle, 3),
    reg(Flags, 4),
];
/// `(CUfunction *hfunc, CUmodule hmod, const char *name)`; the same shape
/// for `cuLibraryGetKernel(CUkernel *, CUlibrary, const char *)`.
const GET_BY_NAME: &[ArgSpec] = &[reg(FuncOut, 0), reg(Module, 1), reg(KernelName, 2)];
/// `cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)`.
const KERNEL_GET_FUNCTION: &[ArgSpec] = &[reg(FuncOut, 0), reg(Func, 1)];
const STREAM: &[ArgSpec] = &[reg(Stream, 0)];
const EVENT: &[ArgSpec] = &[reg(Event, 0)];

const fn launch(name: &'static str) -> FunctionSpec {
    f(name, Launch(LaunchKind::Kernel), Level::L1, LAUNCH)
}

/// `cuLaunchCooperativeKernel`: `cuLaunchKernel` without `extra`.
const fn launch_cooperative(name: &'static str) -> FunctionSpec {
    f(name, Launch(LaunchKind::Kernel), Level::L1, LAUNCH).optional()
}

const fn launch_ex(name: &'static str) -> FunctionSpec {
    f(name, Launch(LaunchKind::KernelExC), Level::L1, LAUNCH_EX)
        .entry_deref(DerefSource::Arg(0), LAUNCH_CONFIG_BYTES)
        .optional()
}

const fn by_name(name: &'static str, kind: HandleKind) -> FunctionSpec {
    f(name, KernelHandle(kind), Level::L0, GET_BY_NAME)
        .entry_string(2, KERNEL_NAME_BYTES)
        .ret_deref(0, 8)
}

const fn vmm(name: &'static str, op: VmmOp, args: &'static [ArgSpec]) -> FunctionSpec {
    f(name, Vmm(op), Level::L0, args)
}

pub(super) const CUDA: &[FunctionSpec] = &[
    // L0: memory, virtual memory, synchronisation, kernel handles.
    f("cuMemAlloc_v2", Malloc, Level::L0, MEM_ALLOC).ret_deref(0, 8),
    f("cuMemFree_v2", Free, Level::L0, &[reg(DevPtr, 0)]),
    // Stream-ordered allocation: CUDA 11.2+.
    f("cuMemAllocAsync", Malloc, Level::L0, MEM_ALLOC_ASYNC)
        .ret_deref(0, 8)
        .optional(),
    f("cuMemAllocAsync_ptsz", Malloc, Level::L0, MEM_ALLOC_ASYNC)
        .ret_deref(0, 8)
        .optional(),
    f("cuMemFreeAsync", Free, Level::L0, MEM_FREE_ASYNC).optional(),
    f("cuMemFreeAsync_ptsz", Free, Level::L0, MEM_FREE_ASYNC).optional(),
    // Virtual memory management: CUDA 10.2+.
    vmm("cuMemAddressReserve", VmmOp::Reserve, ADDRESS_RESERVE)
        .ret_deref(0, 8)
        .optional(),
    vmm("cuMemAddressFree", VmmOp::AddressFree, RANGE).optional(),
    vmm("cuMemCreate", VmmOp::Create, MEM_CREATE)
        .ret_deref(0, 8)
        .optional(),
    vmm("cuMemRelease", VmmOp::Release, MEM_RELEASE).optional(),
    vmm("cuMemMap", VmmOp::Map, MEM_MAP).optional(),
    vmm("cuMemUnmap", VmmOp::Unmap, RANGE).optional(),
    f(
        "cuStreamSynchronize",
        Sync(SyncKind::Stream),
        Level::L0,
        STREAM,
    ),
    f(
        "cuStreamSynchronize_ptsz",
        Sync(SyncKind::Stream),
        Level::L0,
        STREAM,
    )
    .optional(),
    f(
        "cuEventSynchronize",
        Sync(SyncKind::Event),
        Level::L0,
        EVENT,
    ),
    f("cuCtxSynchronize", Sync(SyncKind::Device), Level::L0, &[]),
    by_name("cuModuleGetFunction", HandleKind::ModuleFunction),
    // The library API: CUDA 12.0+.
    by_name("cuLibraryGetKernel", HandleKind::LibraryKernel).optional(),
    f(
        "cuKernelGetFunction",
        KernelHandle(HandleKind::KernelFunction),
        Level::L0,
        KERNEL_GET_FUNCTION,
    )
    .ret_deref(0, 8)
    .optional(),
    // L1: launches.
    launch("cuLaunchKernel"),
    launch("cuLaunchKernel_ptsz"),
    // CUDA 11.8+.
    launch_ex("cuLaunchKernelEx"),
    launch_ex("cuLaunchKernelEx_ptsz"),
    launch_cooperative("cuLaunchCooperativeKernel"),
    launch_cooperative("cuLaunchCooperativeKernel_ptsz"),
    f("cuGraphLaunch", Launch(LaunchKind::Graph), Level::L1, GRAPH),
    f(
        "cuGraphLaunch_ptsz",
        Launch(LaunchKind::Graph),
        Level::L1,
        GRAPH,
    )
    .optional(),
];
