//! The CANN runtime below AscendCL, `libruntime.so` (`runtime/lib64/` of a
//! CANN install; declarations in CANN's `runtime/kernel.h`, `mem.h`,
//! `stream.h`, `event.h`, `dev.h` and `rts/rts_kernel.h`).
//!
//! AscendCL makes its launches, allocations, frees and syncs through it, on
//! the caller's thread, inside its own call (`aclrtLaunchKernel` ->
//! `rtLaunchKernelByFuncHandleV3`, `aclrtMalloc` -> `rtMalloc`,
//! `aclrtSynchronizeStream` -> `rtStreamSynchronize`, ...): the decoder folds
//! such a nested call into the AscendCL call (`decode::nesting`). Operator
//! libraries and HCCL call it directly; those calls stay calls. Its
//! statuses are AscendCL's external `ACL_ERROR_RT_*` codes (0 is success).
//!
//! Handles (`rtStream_t`, `rtEvent_t`, `rtFuncHandle`, `rtBinHandle`, stub
//! functions) are pointers; `rtMemType_t` and `numBlocks` are `uint32_t`.
//! Launches name no kernel: a stub function (`rtKernelLaunch`) is named by
//! `rtFunctionRegister(binHandle, stubFunc, stubName, ...)` or
//! `rtGetFunctionByName`, a function handle (`rtLaunchKernelByFuncHandle*`,
//! `rts*LaunchKernel*`) by `rtsFuncGetByName` / `rtBinaryGetFunctionByName`;
//! those are probed at L0 with the name and the handle, and the decoder
//! names launches from them. `rtKernelLaunchWithHandle[V2]` launches a
//! binary's kernel by tiling key, which no name call maps: counted, unnamed.
//! The `rt*ByFuncHandle*`, `rts*` and `WithFlag`/`WithHandle` calls came in
//! later CANN versions and are optional.

use super::CallKind::*;
use super::Role::*;
use super::nvidia_driver::KERNEL_NAME_BYTES;
use super::{ArgSpec, CallKind, FunctionSpec, HandleKind, LaunchKind, Level, SyncKind, reg};

const fn f(
    name: &'static str,
    kind: CallKind,
    level: Level,
    args: &'static [ArgSpec],
) -> FunctionSpec {
    FunctionSpec::new(name, kind, level, args)
}

/// `rtMalloc(void **devPtr, uint64_t size, rtMemType_t type, uint16_t
/// moduleId)` (CANN 5 and older: without `moduleId`; the same registers).
const MALLOC: &[ArgSpec] = &[reg(DevPtrOut, 0), reg(Size, 1), reg(Policy, 2)];
/// `rtKernelLaunch(const void *stubFunc, uint32_t numBlocks, void *args,
/// uint32_t argsSize, rtSmDesc_t *smDesc, rtStream_t stm)`.
const KERNEL_LAUNCH: &[ArgSpec] = &[
    reg(Func, 0),
    reg(NumBlocks, 1),
    reg(KernelArgs, 2),
    reg(ArgsSize, 3),
    reg(Opaque, 4),
    reg(Stream, 5),
];
/// `rtKernelLaunchWithFlag(const void *stubFunc, uint32_t numBlocks,
/// rtArgsEx_t *argsInfo, rtSmDesc_t *smDesc, rtStream_t stm, uint32_t
/// flags)`; `...V2` adds `const rtTaskCfgInfo_t *cfgInfo` on the stack.
const LAUNCH_WITH_FLAG: &[ArgSpec] = &[
    reg(Func, 0),
    reg(NumBlocks, 1),
    reg(KernelArgs, 2),
    reg(Opaque, 3),
    reg(Stream, 4),
    reg(Flags, 5),
];
/// `rtKernelLaunchWithHandle(void *hdl, uint64_t tilingKey, uint32_t
/// numBlocks, rtArgsEx_t *argsInfo, rtSmDesc_t *smDesc, rtStream_t stm,
/// const void *kernelInfo)`; `...V2` has `const rtTaskCfgInfo_t *` last.
/// `hdl` is the binary, not a kernel: no name.
const LAUNCH_WITH_HANDLE: &[ArgSpec] = &[
    reg(Module, 0),
    reg(Opaque, 1),
    reg(NumBlocks, 2),
    reg(KernelArgs, 3),
    reg(Opaque, 4),
    reg(Stream, 5),
];
/// `rtLaunchKernelByFuncHandle(rtFuncHandle funcHandle, uint32_t numBlocks,
/// rtLaunchArgsHandle argsHandle, rtStream_t stm)`; `V2` adds a task config,
/// `V3` takes `const rtArgsEx_t *argsInfo` for the args handle (what
/// `aclrtLaunchKernel` calls).
const BY_FUNC_HANDLE: &[ArgSpec] = &[
    reg(Func, 0),
    reg(NumBlocks, 1),
    reg(KernelArgs, 2),
    reg(Stream, 3),
];
/// `rtsLaunchKernelWithConfig(rtFuncHandle funcHandle, uint32_t numBlocks,
/// rtStream_t stm, rtKernelLaunchCfg_t *cfg, rtArgsHandle argsHandle,
/// void *reserve)`.
const WITH_CONFIG: &[ArgSpec] = &[
    reg(Func, 0),
    reg(NumBlocks, 1),
    reg(Stream, 2),
    reg(Opaque, 3),
    reg(KernelArgs, 4),
];
/// `rtFunctionRegister(void *binHandle, const void *stubFunc, const char
/// *stubName, const void *kernelInfoExt, uint32_t funcMode)`.
const FUNCTION_REGISTER: &[ArgSpec] = &[reg(Module, 0), reg(Func, 1), reg(KernelName, 2)];
/// `rtGetFunctionByName(const char *stubName, void **stubFunc)`.
const STUB_BY_NAME: &[ArgSpec] = &[reg(KernelName, 0), reg(FuncOut, 1)];
/// `(rtBinHandle binHandle, const char *kernelName, rtFuncHandle
/// *funcHandle)`: `rtsFuncGetByName`, `rtBinaryGetFunctionByName`.
const FUNC_BY_NAME: &[ArgSpec] = &[reg(Module, 0), reg(KernelName, 1), reg(FuncOut, 2)];
const STREAM: &[ArgSpec] = &[reg(Stream, 0)];
const EVENT: &[ArgSpec] = &[reg(Event, 0)];

const fn launch(name: &'static str, args: &'static [ArgSpec]) -> FunctionSpec {
    f(name, Launch(LaunchKind::Kernel), Level::L1, args)
}

const fn func_by_name(name: &'static str) -> FunctionSpec {
    f(
        name,
        KernelHandle(HandleKind::BinaryFunction),
        Level::L0,
        FUNC_BY_NAME,
    )
    .entry_string(1, KERNEL_NAME_BYTES)
    .ret_deref(2, 8)
    .optional()
}

pub(super) const RUNTIME: &[FunctionSpec] = &[
    // L0: memory, synchronisation, kernel names.
    f("rtMalloc", Malloc, Level::L0, MALLOC).ret_deref(0, 8),
    f("rtFree", Free, Level::L0, &[reg(DevPtr, 0)]),
    f(
        "rtStreamSynchronize",
        Sync(SyncKind::Stream),
        Level::L0,
        STREAM,
    ),
    f(
        "rtEventSynchronize",
        Sync(SyncKind::Event),
        Level::L0,
        EVENT,
    ),
    f(
        "rtDeviceSynchronize",
        Sync(SyncKind::Device),
        Level::L0,
        &[],
    ),
    f(
        "rtFunctionRegister",
        KernelHandle(HandleKind::StubRegister),
        Level::L0,
        FUNCTION_REGISTER,
    )
    .entry_string(2, KERNEL_NAME_BYTES),
    f(
        "rtGetFunctionByName",
        KernelHandle(HandleKind::StubByName),
        Level::L0,
        STUB_BY_NAME,
    )
    .entry_string(0, KERNEL_NAME_BYTES)
    .ret_deref(1, 8),
    func_by_name("rtsFuncGetByName"),
    func_by_name("rtBinaryGetFunctionByName"),
    // L1: launches.
    launch("rtKernelLaunch", KERNEL_LAUNCH),
    launch("rtKernelLaunchWithFlag", LAUNCH_WITH_FLAG).optional(),
    launch("rtKernelLaunchWithFlagV2", LAUNCH_WITH_FLAG).optional(),
    launch("rtKernelLaunchWithHandle", LAUNCH_WITH_HANDLE).optional(),
    launch("rtKernelLaunchWithHandleV2", LAUNCH_WITH_HANDLE).optional(),
    launch("rtLaunchKernelByFuncHandle", BY_FUNC_HANDLE).optional(),
    launch("rtLaunchKernelByFuncHandleV2", BY_FUNC_HANDLE).optional(),
    launch("rtLaunchKernelByFuncHandleV3", BY_FUNC_HANDLE).optional(),
    launch("rtsLaunchKernelWithConfig", WITH_CONFIG).optional(),
];
