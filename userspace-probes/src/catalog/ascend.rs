//! Ascend tables: libascendcl, libhccl, libmspti (CANN 8 public API).
//!
//! HCCL's collectives have NCCL's argument positions (the same C shapes), so
//! the layouts are shared with the NVIDIA tables.

use super::CallKind::*;
use super::Role::*;
use super::nvidia::{
    ALL_GATHER, ALL_REDUCE, BCAST, EVENT, FREE, NEXT_RECORD, P2P, REDUCE, REGISTER, STREAM,
};
use super::{
    ArgSpec, CallKind, Collective, CommEnd, CommInit, CommQuery, DerefSource, Direction,
    FunctionSpec, LaunchKind, Level, RetKind, SyncKind, reg,
};

const fn f(
    name: &'static str,
    kind: CallKind,
    level: Level,
    args: &'static [ArgSpec],
) -> FunctionSpec {
    FunctionSpec::new(name, kind, level, args)
}

// ---------------------------------------------------------------- ascendcl

/// `(void **devPtr, size_t size, aclrtMemMallocPolicy policy)`.
const MALLOC: &[ArgSpec] = &[reg(DevPtrOut, 0), reg(Size, 1), reg(Policy, 2)];
/// `(dst, size_t destMax, src, size_t count, aclrtMemcpyKind kind)`.
const MEMCPY: &[ArgSpec] = &[
    reg(Dst, 0),
    reg(DestMax, 1),
    reg(Src, 2),
    reg(Size, 3),
    reg(MemcpyKind, 4),
];
const MEMCPY_ASYNC: &[ArgSpec] = &[
    reg(Dst, 0),
    reg(DestMax, 1),
    reg(Src, 2),
    reg(Size, 3),
    reg(MemcpyKind, 4),
    reg(Stream, 5),
];
/// `(aclrtFuncHandle, uint32_t numBlocks, const void *args, size_t argsSize, stream)`.
const LAUNCH: &[ArgSpec] = &[
    reg(Func, 0),
    reg(NumBlocks, 1),
    reg(KernelArgs, 2),
    reg(ArgsSize, 3),
    reg(Stream, 4),
];

pub(super) const ACL: &[FunctionSpec] = &[
    f("aclrtMalloc", Malloc, Level::L0, MALLOC).ret_deref(0, 8),
    f("aclrtFree", Free, Level::L0, FREE),
    f("aclrtSetDevice", SetDevice, Level::L0, &[reg(Device, 0)]),
    f(
        "aclrtSynchronizeDevice",
        Sync(SyncKind::Device),
        Level::L0,
        &[],
    ),
    f(
        "aclrtSynchronizeStream",
        Sync(SyncKind::Stream),
        Level::L0,
        STREAM,
    ),
    // (stream, int32_t timeout ms); not in the stand-in.
    f(
        "aclrtSynchronizeStreamWithTimeout",
        Sync(SyncKind::Stream),
        Level::L0,
        &[reg(Stream, 0), reg(Timeout, 1)],
    )
    .optional(),
    f(
        "aclrtSynchronizeEvent",
        Sync(SyncKind::Event),
        Level::L0,
        EVENT,
    ),
    f(
        "aclrtLaunchKernel",
        Launch(LaunchKind::Kernel),
        Level::L1,
        LAUNCH,
    ),
    f("aclrtMemcpy", Memcpy, Level::L1, MEMCPY),
    f("aclrtMemcpyAsync", Memcpy, Level::L1, MEMCPY_ASYNC),
    f(
        "aclrtRecordEvent",
        EventRecord,
        Level::L1,
        &[reg(Event, 0), reg(Stream, 1)],
    ),
    f(
        "aclrtStreamWaitEvent",
        StreamWaitEvent,
        Level::L1,
        &[reg(Stream, 0), reg(Event, 1)],
    ),
];

// ---------------------------------------------------------------- hccl

const COMM_QUERY: &[ArgSpec] = &[reg(Comm, 0), reg(ValueOut, 1)];

pub(super) const HCCL: &[FunctionSpec] = &[
    f(
        "HcclAllReduce",
        Collective(Collective::AllReduce),
        Level::L0,
        ALL_REDUCE,
    ),
    f(
        "HcclBroadcast",
        Collective(Collective::Broadcast),
        Level::L0,
        BCAST,
    ),
    f(
        "HcclAllGather",
        Collective(Collective::AllGather),
        Level::L0,
        ALL_GATHER,
    ),
    f(
        "HcclReduceScatter",
        Collective(Collective::ReduceScatter),
        Level::L0,
        ALL_REDUCE,
    ),
    f(
        "HcclReduce",
        Collective(Collective::Reduce),
        Level::L0,
        REDUCE,
    ),
    f(
        "HcclBarrier",
        Collective(Collective::Barrier),
        Level::L0,
        &[reg(Comm, 0), reg(Stream, 1)],
    ),
    f("HcclSend", SendRecv(Direction::Send), Level::L0, P2P),
    f("HcclRecv", SendRecv(Direction::Recv), Level::L0, P2P),
    f("HcclGroupStart", GroupStart, Level::L0, &[]),
    f("HcclGroupEnd", GroupEnd, Level::L0, &[]),
    // HcclRootInfo is 4108 bytes; its first 128 name the communicator.
    f("HcclGetRootInfo", UniqueId, Level::L0, &[reg(IdOut, 0)]).ret_deref(0, 128),
    // (uint32_t nRanks, const HcclRootInfo *root, uint32_t rank, HcclComm *comm)
    f(
        "HcclCommInitRootInfo",
        CommInit(CommInit::RootInfo),
        Level::L0,
        &[
            reg(NRanks, 0),
            reg(RootInfo, 1),
            reg(Rank, 2),
            reg(CommOut, 3),
        ],
    )
    .entry_deref(DerefSource::Arg(1), 128)
    .ret_deref(3, 8),
    // (nRanks, root *, rank, const HcclCommConfig *config, HcclComm *comm); not in the stand-in.
    f(
        "HcclCommInitRootInfoConfig",
        CommInit(CommInit::RootInfo),
        Level::L0,
        &[
            reg(NRanks, 0),
            reg(RootInfo, 1),
            reg(Rank, 2),
            reg(Config, 3),
            reg(CommOut, 4),
        ],
    )
    .entry_deref(DerefSource::Arg(1), 128)
    .ret_deref(4, 8)
    .optional(),
    f(
        "HcclCommDestroy",
        CommEnd(CommEnd::Destroy),
        Level::L0,
        &[reg(Comm, 0)],
    ),
    f(
        "HcclGetRankSize",
        CommQuery(CommQuery::Size),
        Level::L0,
        COMM_QUERY,
    )
    .ret_deref(1, 4),
    f(
        "HcclGetRankId",
        CommQuery(CommQuery::Rank),
        Level::L0,
        COMM_QUERY,
    )
    .ret_deref(1, 4),
];

// ---------------------------------------------------------------- mspti

/// `mstx*A(const char *message, aclrtStream stream)`.
const MARK: &[ArgSpec] = &[reg(Message, 0), reg(Stream, 1)];
/// Bytes of a marker message copied at entry.
const MESSAGE_BYTES: u16 = 64;

pub(super) const MSPTI: &[FunctionSpec] = &[
    f(
        "msptiActivityGetNextRecord",
        ActivityNextRecord,
        Level::L2,
        NEXT_RECORD,
    )
    .ret_deref_twice(2, 128),
    f(
        "msptiActivityFlushAll",
        ActivityFlush,
        Level::L2,
        &[reg(Flags, 0)],
    ),
    f(
        "msptiActivityRegisterCallbacks",
        ActivityRegister,
        Level::L0,
        REGISTER,
    ),
    f(
        "msptiActivityEnable",
        ActivityEnable,
        Level::L0,
        &[reg(ActivityKind, 0)],
    ),
    // mstx markers: in CANN they live in libms_tools_ext.so; the stand-in
    // libmspti exports them. Level 0: the job's `step N` ranges number its
    // steps for the detectors, and a job makes a few per step.
    f("mstxMarkA", Mark, Level::L0, MARK)
        .entry_string(0, MESSAGE_BYTES)
        .returns(RetKind::Void)
        .optional(),
    f("mstxRangeStartA", RangeStart, Level::L0, MARK)
        .entry_string(0, MESSAGE_BYTES)
        .returns(RetKind::Value)
        .optional(),
    f("mstxRangeEnd", RangeEnd, Level::L0, &[reg(RangeId, 0)])
        .returns(RetKind::Void)
        .optional(),
];
