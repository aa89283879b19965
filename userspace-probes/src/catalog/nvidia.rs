//! NVIDIA tables: libcudart (CUDA 12), libnccl (2.21+), libcupti (CUDA 12).
//!
//! Per-thread-default-stream variants (`*_ptsz`, `*_ptds`) and the
//! `__cudaLaunchKernel` entry points nvcc's stubs call are separate exported
//! functions with the base function's layout; each is probed. In CUDA 12.9
//! `__cudaLaunchKernel[_ptsz]` is a frame-pointer thunk that tail-jumps to
//! `cudaLaunchKernel[_ptsz]`; `resolve` detects that and probes only the
//! target, which sees the same registers and stack.

use super::CallKind::*;
use super::Role::*;
use super::{
    ArgSpec, CallKind, Collective, CommEnd, CommInit, CommQuery, DerefSource, Direction,
    FunctionSpec, LaunchKind, Level, SyncKind, reg, stack,
};

const fn f(
    name: &'static str,
    kind: CallKind,
    level: Level,
    args: &'static [ArgSpec],
) -> FunctionSpec {
    FunctionSpec::new(name, kind, level, args)
}

// ---------------------------------------------------------------- cudart

/// `(func, dim3 grid, dim3 block, void **args, size_t sharedMem, stream)`.
const LAUNCH: &[ArgSpec] = &[
    reg(Func, 0),
    reg(GridXY, 1),
    reg(GridZ, 2),
    reg(BlockXY, 3),
    reg(BlockZ, 4),
    reg(KernelArgs, 5),
    stack(SharedMem, 0),
    stack(Stream, 1),
];
/// `(const cudaLaunchConfig_t *config, const void *func, void **args)`.
const LAUNCH_EXC: &[ArgSpec] = &[reg(LaunchConfig, 0), reg(Func, 1), reg(KernelArgs, 2)];
/// `sizeof` the part of `cudaLaunchConfig_t` decoded: gridDim@0, blockDim@12,
/// dynamicSmemBytes@24, stream@32.
pub(crate) const LAUNCH_CONFIG_BYTES: u16 = 40;
const GRAPH: &[ArgSpec] = &[reg(GraphExec, 0), reg(Stream, 1)];
const MEMCPY: &[ArgSpec] = &[reg(Dst, 0), reg(Src, 1), reg(Size, 2), reg(MemcpyKind, 3)];
const MEMCPY_ASYNC: &[ArgSpec] = &[
    reg(Dst, 0),
    reg(Src, 1),
    reg(Size, 2),
    reg(MemcpyKind, 3),
    reg(Stream, 4),
];
const MEMSET_ASYNC: &[ArgSpec] = &[reg(DevPtr, 0), reg(Value, 1), reg(Size, 2), reg(Stream, 3)];
const MALLOC: &[ArgSpec] = &[reg(DevPtrOut, 0), reg(Size, 1)];
const MALLOC_ASYNC: &[ArgSpec] = &[reg(DevPtrOut, 0), reg(Size, 1), reg(Stream, 2)];
pub(super) const FREE: &[ArgSpec] = &[reg(DevPtr, 0)];
const FREE_ASYNC: &[ArgSpec] = &[reg(DevPtr, 0), reg(Stream, 1)];
pub(super) const STREAM: &[ArgSpec] = &[reg(Stream, 0)];
pub(super) const EVENT: &[ArgSpec] = &[reg(Event, 0)];
pub(super) const EVENT_RECORD: &[ArgSpec] = &[reg(Event, 0), reg(Stream, 1)];
const WAIT_EVENT: &[ArgSpec] = &[reg(Stream, 0), reg(Event, 1), reg(Flags, 2)];
const HOST_FUNC: &[ArgSpec] = &[reg(Stream, 0), reg(HostFn, 1), reg(UserData, 2)];

const fn launch(name: &'static str) -> FunctionSpec {
    f(name, Launch(LaunchKind::Kernel), Level::L1, LAUNCH)
}

const fn launch_exc(name: &'static str) -> FunctionSpec {
    f(name, Launch(LaunchKind::KernelExC), Level::L1, LAUNCH_EXC)
        .entry_deref(DerefSource::Arg(0), LAUNCH_CONFIG_BYTES)
        .optional()
}

pub(super) const CUDART: &[FunctionSpec] = &[
    // L0: memory, device, synchronisation.
    f("cudaMalloc", Malloc, Level::L0, MALLOC).ret_deref(0, 8),
    f("cudaFree", Free, Level::L0, FREE),
    f("cudaMallocAsync", Malloc, Level::L0, MALLOC_ASYNC).ret_deref(0, 8),
    f("cudaMallocAsync_ptsz", Malloc, Level::L0, MALLOC_ASYNC).ret_deref(0, 8),
    f("cudaFreeAsync", Free, Level::L0, FREE_ASYNC),
    f("cudaFreeAsync_ptsz", Free, Level::L0, FREE_ASYNC),
    f("cudaSetDevice", SetDevice, Level::L0, &[reg(Device, 0)]),
    f(
        "cudaDeviceSynchronize",
        Sync(SyncKind::Device),
        Level::L0,
        &[],
    ),
    f(
        "cudaStreamSynchronize",
        Sync(SyncKind::Stream),
        Level::L0,
        STREAM,
    ),
    f(
        "cudaStreamSynchronize_ptsz",
        Sync(SyncKind::Stream),
        Level::L0,
        STREAM,
    ),
    f(
        "cudaEventSynchronize",
        Sync(SyncKind::Event),
        Level::L0,
        EVENT,
    ),
    // L1: launches, copies, events.
    launch("cudaLaunchKernel"),
    launch("cudaLaunchKernel_ptsz"),
    launch("__cudaLaunchKernel"),
    launch("__cudaLaunchKernel_ptsz"),
    // Not in the stand-ins.
    launch_exc("cudaLaunchKernelExC"),
    launch_exc("cudaLaunchKernelExC_ptsz"),
    f(
        "cudaGraphLaunch",
        Launch(LaunchKind::Graph),
        Level::L1,
        GRAPH,
    )
    .optional(),
    f(
        "cudaGraphLaunch_ptsz",
        Launch(LaunchKind::Graph),
        Level::L1,
        GRAPH,
    )
    .optional(),
    f("cudaMemcpy", Memcpy, Level::L1, MEMCPY),
    f("cudaMemcpy_ptds", Memcpy, Level::L1, MEMCPY),
    f("cudaMemcpyAsync", Memcpy, Level::L1, MEMCPY_ASYNC),
    f("cudaMemcpyAsync_ptsz", Memcpy, Level::L1, MEMCPY_ASYNC),
    f("cudaMemsetAsync", Memset, Level::L1, MEMSET_ASYNC).optional(),
    f("cudaMemsetAsync_ptsz", Memset, Level::L1, MEMSET_ASYNC).optional(),
    f("cudaEventRecord", EventRecord, Level::L1, EVENT_RECORD),
    f("cudaEventRecord_ptsz", EventRecord, Level::L1, EVENT_RECORD),
    f(
        "cudaStreamWaitEvent",
        StreamWaitEvent,
        Level::L1,
        WAIT_EVENT,
    ),
    f(
        "cudaStreamWaitEvent_ptsz",
        StreamWaitEvent,
        Level::L1,
        WAIT_EVENT,
    ),
    f("cudaLaunchHostFunc", HostFunc, Level::L1, HOST_FUNC),
    f("cudaLaunchHostFunc_ptsz", HostFunc, Level::L1, HOST_FUNC),
];

// ---------------------------------------------------------------- nccl

/// `(send, recv, count, datatype, op, comm, stream@sp+8)`.
pub(super) const ALL_REDUCE: &[ArgSpec] = &[
    reg(SendBuf, 0),
    reg(RecvBuf, 1),
    reg(Count, 2),
    reg(Dtype, 3),
    reg(RedOp, 4),
    reg(Comm, 5),
    stack(Stream, 0),
];
/// `(send, recv, count, datatype, int root, comm, stream@sp+8)`.
const BROADCAST: &[ArgSpec] = &[
    reg(SendBuf, 0),
    reg(RecvBuf, 1),
    reg(Count, 2),
    reg(Dtype, 3),
    reg(Root, 4),
    reg(Comm, 5),
    stack(Stream, 0),
];
/// `(buff, count, datatype, int root, comm, stream)`.
pub(super) const BCAST: &[ArgSpec] = &[
    reg(Buf, 0),
    reg(Count, 1),
    reg(Dtype, 2),
    reg(Root, 3),
    reg(Comm, 4),
    reg(Stream, 5),
];
/// `(send, recv, count, datatype, op, int root, comm@sp+8, stream@sp+16)`.
pub(super) const REDUCE: &[ArgSpec] = &[
    reg(SendBuf, 0),
    reg(RecvBuf, 1),
    reg(Count, 2),
    reg(Dtype, 3),
    reg(RedOp, 4),
    reg(Root, 5),
    stack(Comm, 0),
    stack(Stream, 1),
];
/// `(send, recv, sendcount, datatype, comm, stream)`.
pub(super) const ALL_GATHER: &[ArgSpec] = &[
    reg(SendBuf, 0),
    reg(RecvBuf, 1),
    reg(Count, 2),
    reg(Dtype, 3),
    reg(Comm, 4),
    reg(Stream, 5),
];
/// `(buf, count, datatype, int peer, comm, stream)`.
pub(super) const P2P: &[ArgSpec] = &[
    reg(Buf, 0),
    reg(Count, 1),
    reg(Dtype, 2),
    reg(Peer, 3),
    reg(Comm, 4),
    reg(Stream, 5),
];
const COMM: &[ArgSpec] = &[reg(Comm, 0)];
const COMM_QUERY: &[ArgSpec] = &[reg(Comm, 0), reg(ValueOut, 1)];

pub(super) const NCCL: &[FunctionSpec] = &[
    f(
        "ncclAllReduce",
        Collective(Collective::AllReduce),
        Level::L0,
        ALL_REDUCE,
    )
    .aliases(&["pncclAllReduce"]),
    f(
        "ncclBroadcast",
        Collective(Collective::Broadcast),
        Level::L0,
        BROADCAST,
    )
    .aliases(&["pncclBroadcast"]),
    // Legacy in-place broadcast; not in the stand-in.
    f(
        "ncclBcast",
        Collective(Collective::Broadcast),
        Level::L0,
        BCAST,
    )
    .aliases(&["pncclBcast"])
    .optional(),
    f(
        "ncclReduce",
        Collective(Collective::Reduce),
        Level::L0,
        REDUCE,
    )
    .aliases(&["pncclReduce"]),
    f(
        "ncclAllGather",
        Collective(Collective::AllGather),
        Level::L0,
        ALL_GATHER,
    )
    .aliases(&["pncclAllGather"]),
    f(
        "ncclReduceScatter",
        Collective(Collective::ReduceScatter),
        Level::L0,
        ALL_REDUCE,
    )
    .aliases(&["pncclReduceScatter"]),
    f("ncclSend", SendRecv(Direction::Send), Level::L0, P2P).aliases(&["pncclSend"]),
    f("ncclRecv", SendRecv(Direction::Recv), Level::L0, P2P).aliases(&["pncclRecv"]),
    f("ncclGroupStart", GroupStart, Level::L0, &[]).aliases(&["pncclGroupStart"]),
    f("ncclGroupEnd", GroupEnd, Level::L0, &[]).aliases(&["pncclGroupEnd"]),
    f("ncclGetUniqueId", UniqueId, Level::L0, &[reg(IdOut, 0)])
        .aliases(&["pncclGetUniqueId"])
        .ret_deref(0, 128),
    // (ncclComm_t *comm, int nranks, ncclUniqueId id /* 128 B on the stack */, int rank)
    f(
        "ncclCommInitRank",
        CommInit(CommInit::Rank),
        Level::L0,
        &[reg(CommOut, 0), reg(NRanks, 1), reg(Rank, 2)],
    )
    .aliases(&["pncclCommInitRank"])
    .entry_deref(DerefSource::Stack { slot: 0 }, 128)
    .ret_deref(0, 8),
    // (comm *, nranks, id /* stack */, rank, ncclConfig_t *config); not in the stand-in.
    f(
        "ncclCommInitRankConfig",
        CommInit(CommInit::Rank),
        Level::L0,
        &[
            reg(CommOut, 0),
            reg(NRanks, 1),
            reg(Rank, 2),
            reg(Config, 3),
        ],
    )
    .aliases(&["pncclCommInitRankConfig"])
    .entry_deref(DerefSource::Stack { slot: 0 }, 128)
    .ret_deref(0, 8)
    .optional(),
    // (ncclComm_t *comms, int ndev, const int *devlist): the first 8 handles.
    f(
        "ncclCommInitAll",
        CommInit(CommInit::All),
        Level::L0,
        &[reg(CommOut, 0), reg(NRanks, 1), reg(DevList, 2)],
    )
    .aliases(&["pncclCommInitAll"])
    .ret_deref(0, 64),
    // (comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config); not in the stand-in.
    f(
        "ncclCommSplit",
        CommInit(CommInit::Split),
        Level::L0,
        &[
            reg(Comm, 0),
            reg(Color, 1),
            reg(Key, 2),
            reg(CommOut, 3),
            reg(Config, 4),
        ],
    )
    .aliases(&["pncclCommSplit"])
    .ret_deref(3, 8)
    .optional(),
    f(
        "ncclCommDestroy",
        CommEnd(CommEnd::Destroy),
        Level::L0,
        COMM,
    )
    .aliases(&["pncclCommDestroy"]),
    f("ncclCommAbort", CommEnd(CommEnd::Abort), Level::L0, COMM).aliases(&["pncclCommAbort"]),
    f(
        "ncclCommFinalize",
        CommEnd(CommEnd::Finalize),
        Level::L0,
        COMM,
    )
    .aliases(&["pncclCommFinalize"])
    .optional(),
    f(
        "ncclCommCount",
        CommQuery(CommQuery::Size),
        Level::L0,
        COMM_QUERY,
    )
    .aliases(&["pncclCommCount"])
    .ret_deref(1, 4),
    f(
        "ncclCommUserRank",
        CommQuery(CommQuery::Rank),
        Level::L0,
        COMM_QUERY,
    )
    .aliases(&["pncclCommUserRank"])
    .ret_deref(1, 4),
    // Device memory NCCL allocates itself (cuMem, not through libcudart); not in the stand-in.
    f("ncclMemAlloc", Malloc, Level::L0, MALLOC)
        .aliases(&["pncclMemAlloc"])
        .ret_deref(0, 8)
        .optional(),
    f("ncclMemFree", Free, Level::L0, FREE)
        .aliases(&["pncclMemFree"])
        .optional(),
];

// ---------------------------------------------------------------- cupti

/// `(uint8_t *buffer, size_t validBufferSizeBytes, CUpti_Activity **record)`.
pub(super) const NEXT_RECORD: &[ArgSpec] =
    &[reg(ActivityBuffer, 0), reg(ValidSize, 1), reg(RecordOut, 2)];
pub(super) const REGISTER: &[ArgSpec] = &[reg(Callback, 0), reg(Callback, 1)];

pub(super) const CUPTI: &[FunctionSpec] = &[
    f(
        "cuptiActivityGetNextRecord",
        ActivityNextRecord,
        Level::L2,
        NEXT_RECORD,
    )
    .ret_deref_twice(2, 128),
    f(
        "cuptiActivityFlushAll",
        ActivityFlush,
        Level::L2,
        &[reg(Flags, 0)],
    ),
    f(
        "cuptiGetTimestamp",
        ClockSample,
        Level::L2,
        &[reg(TimestampOut, 0)],
    )
    .ret_deref(0, 8),
    f(
        "cuptiActivityRegisterCallbacks",
        ActivityRegister,
        Level::L0,
        REGISTER,
    ),
    f(
        "cuptiActivityEnable",
        ActivityEnable,
        Level::L0,
        &[reg(ActivityKind, 0)],
    ),
];
