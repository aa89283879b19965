//! Decoder tests on hand-built raw records.

use xpuscope_common::uprobe::{DEREF_BYTES, ENTRY_STACK_WORDS, UprobeEntry, UprobeReturn};
use xpuscope_common::{EventHeader, EventKind};

use super::args::CallArgs;
use super::comm::comm_id_hash;
use super::enums::{DataType, MemcpyKind, RedOp};
use super::memory::Device;
use super::table::{ProbeTable, ProbeTarget};
use super::*;
use crate::activity::ActivityKind;
use crate::catalog::{Collective, Vendor};

const TGID: u32 = 100;
const TID: u32 = 101;
/// Garbage the ABI allows in the upper half of a 32-bit argument register.
const JUNK: u64 = 0xdead_beef_0000_0000;
const GIB: u64 = 1 << 30;

fn ip_of(name: &str) -> u64 {
    // A distinct fake address per function name.
    0x7f00_0000_0000
        + name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64))
            % 0x1000_0000
            * 16
}

fn lib_of(name: &str) -> Library {
    Library::ALL
        .into_iter()
        .find(|l| l.function(name).is_some())
        .unwrap()
}

fn decoder_with(names: &[&str], sp_delta: i64) -> Decoder {
    let mut table = ProbeTable::new();
    for tgid in [TGID, TGID + 1] {
        for n in names {
            let library = lib_of(n);
            let function = library.function(n).unwrap();
            table.insert(
                tgid,
                ip_of(n),
                ProbeTarget {
                    library,
                    function,
                    sp_delta,
                },
            );
        }
    }
    Decoder::new(table)
}

fn entry(name: &str, ts: u64, args: [u64; 6], stack: &[u64]) -> UprobeEntry {
    let mut e = UprobeEntry {
        header: EventHeader {
            kind: EventKind::UprobeEntry as u32,
            cpu: 0,
            ts,
        },
        tid: TID,
        tgid: TGID,
        probe_ip: ip_of(name),
        args,
        sp: 0x7ffd_0000_1000,
        stack: [0; ENTRY_STACK_WORDS],
        deref_len: 0,
        slot: 0,
        deref: [0; DEREF_BYTES],
    };
    e.stack[0] = 0x5555_0000_1234; // return address
    for (i, w) in stack.iter().enumerate() {
        e.stack[1 + i] = *w;
    }
    e
}

fn ret(name: &str, ts: u64, rax: u64, deref: &[u8]) -> UprobeReturn {
    let mut r = UprobeReturn {
        header: EventHeader {
            kind: EventKind::UprobeReturn as u32,
            cpu: 0,
            ts,
        },
        tid: TID,
        tgid: TGID,
        probe_ip: ip_of(name),
        ret: rax,
        deref_len: deref.len() as u32,
        slot: 0,
        launches: Default::default(),
        deref: [0; DEREF_BYTES],
    };
    r.deref[..deref.len()].copy_from_slice(deref);
    r
}

fn with_deref(mut e: UprobeEntry, bytes: &[u8]) -> UprobeEntry {
    e.deref[..bytes.len()].copy_from_slice(bytes);
    e.deref_len = bytes.len() as u32;
    e
}

fn pid(mut e: UprobeEntry, tgid: u32, tid: u32) -> UprobeEntry {
    e.tgid = tgid;
    e.tid = tid;
    e
}

fn pid_r(mut r: UprobeReturn, tgid: u32, tid: u32) -> UprobeReturn {
    r.tgid = tgid;
    r.tid = tid;
    r
}

/// Runs an entry and its return, expecting exactly one call.
fn call(d: &mut Decoder, e: UprobeEntry, r: UprobeReturn) -> DeviceCall {
    let mut out = Vec::new();
    d.on_entry(&e, &mut out);
    d.on_return(&r, &mut out);
    match out.as_slice() {
        [Decoded::Call(c)] => c.clone(),
        other => panic!("expected one call, got {other:?}"),
    }
}

#[test]
fn all_reduce_typed_and_named() {
    let mut d = decoder_with(&["ncclAllReduce"], 0);
    let e = entry(
        "ncclAllReduce",
        1_000,
        [0xa000, 0xb000, 32 << 20, JUNK | 9, JUNK, 0xc0c0],
        &[0x5e5e],
    );
    let c = call(&mut d, e, ret("ncclAllReduce", 9_000, JUNK, &[]));
    assert_eq!(c.name, "ncclAllReduce 64 MiB bf16 sum");
    assert_eq!(
        (c.start_ts, c.end_ts, c.ret, c.error),
        (1_000, Some(9_000), Some(0), false)
    );
    assert_eq!(
        (c.library, c.function, c.tgid, c.tid),
        (Library::Nccl, "ncclAllReduce", TGID, TID)
    );
    let CallArgs::Collective(a) = &c.args else {
        panic!("{:?}", c.args)
    };
    assert_eq!(
        (
            a.op, a.count, a.dtype, a.bytes, a.red_op, a.comm, a.stream, a.send, a.recv
        ),
        (
            Collective::AllReduce,
            Some(32 << 20),
            Some(DataType::Bf16),
            Some(64 << 20),
            Some(RedOp::Sum),
            0xc0c0,
            Some(0x5e5e),
            Some(0xa000),
            Some(0xb000)
        )
    );
    let ctx = c.comm.unwrap();
    assert_eq!(
        (ctx.handle, ctx.seq, ctx.seq_exact),
        (0xc0c0, Some(0), false),
        "attached after init"
    );
    // ncclInvalidArgument (4), with junk above the 32-bit status.
    let c = call(&mut d, e, ret("ncclAllReduce", 9_500, JUNK | 4, &[]));
    assert_eq!((c.ret, c.error), (Some(4), true));
    assert_eq!(c.comm.unwrap().seq, Some(1));
}

#[test]
fn other_collectives_and_p2p() {
    let names = [
        "ncclReduce",
        "ncclBroadcast",
        "ncclAllGather",
        "ncclSend",
        "ncclRecv",
        "HcclAllReduce",
        "HcclBarrier",
        "HcclReduceScatter",
    ];
    let mut d = decoder_with(&names, 0);
    // ncclReduce(send, recv, count, fp32, max, root 3, comm@sp+8, stream@sp+16)
    let c = call(
        &mut d,
        entry("ncclReduce", 1, [1, 2, 1024, 7, 2, JUNK | 3], &[0xc1, 0x51]),
        ret("ncclReduce", 2, 0, &[]),
    );
    assert_eq!(c.name, "ncclReduce 4 KiB fp32 max root 3");
    let CallArgs::Collective(a) = &c.args else {
        panic!()
    };
    assert_eq!((a.comm, a.stream, a.root), (0xc1, Some(0x51), Some(3)));
    let c = call(
        &mut d,
        entry("ncclBroadcast", 3, [1, 2, 256, 0, 0, 0xc1], &[0x51]),
        ret("ncclBroadcast", 4, 0, &[]),
    );
    assert_eq!(c.name, "ncclBroadcast 256 B int8 root 0");
    assert_eq!(c.comm.unwrap().seq, Some(1), "per communicator, across ops");
    let c = call(
        &mut d,
        entry("ncclAllGather", 5, [1, 2, 1 << 20, 6, 0xc1, 0x51], &[]),
        ret("ncclAllGather", 6, 0, &[]),
    );
    assert_eq!(c.name, "ncclAllGather 2 MiB fp16");
    let c = call(
        &mut d,
        entry("ncclSend", 7, [1, 1 << 20, 7, JUNK | 3, 0xc1, 0x51], &[]),
        ret("ncclSend", 8, 0, &[]),
    );
    assert_eq!(c.name, "ncclSend 4 MiB fp32 to 3");
    assert_eq!(c.comm.unwrap().seq, None, "send/recv are not numbered");
    let c = call(
        &mut d,
        entry("ncclRecv", 9, [1, 1 << 20, 7, 0, 0xc1, 0x51], &[]),
        ret("ncclRecv", 10, 0, &[]),
    );
    assert_eq!(c.name, "ncclRecv 4 MiB fp32 from 0");
    // A receive still running names its peer (the hang detector counts it
    // as entered); a negative peer is none.
    let mut out = Vec::new();
    d.on_entry(
        &entry("ncclRecv", 13, [1, 1 << 20, 7, JUNK | 5, 0xc1, 0x51], &[]),
        &mut out,
    );
    let open: Vec<_> = d.in_flight().map(|f| (f.function, f.peer)).collect();
    assert_eq!(open, [("ncclRecv", Some(5))]);
    d.on_return(&ret("ncclRecv", 14, 0, &[]), &mut out);
    d.on_entry(
        &entry(
            "ncclSend",
            15,
            [1, 1 << 20, 7, u64::from(u32::MAX), 0xc1, 0x51],
            &[],
        ),
        &mut out,
    );
    let open: Vec<_> = d.in_flight().map(|f| (f.function, f.peer)).collect();
    assert_eq!(open, [("ncclSend", None)]);
    d.on_return(&ret("ncclSend", 16, 0, &[]), &mut out);
    // HCCL enums differ: 11 is bf16, 4 fp32.
    let c = call(
        &mut d,
        entry("HcclAllReduce", 11, [1, 2, 8, 11, 3, 0xd1], &[0x61]),
        ret("HcclAllReduce", 12, 0, &[]),
    );
    assert_eq!(c.name, "HcclAllReduce 16 B bf16 min");
    let c = call(
        &mut d,
        entry("HcclReduceScatter", 13, [1, 2, 8, 4, 0, 0xd1], &[0x61]),
        ret("HcclReduceScatter", 14, 0, &[]),
    );
    assert_eq!(c.name, "HcclReduceScatter 32 B fp32 sum");
    let c = call(
        &mut d,
        entry("HcclBarrier", 15, [0xd1, 0x61, 0, 0, 0, 0], &[]),
        ret("HcclBarrier", 16, 0, &[]),
    );
    assert_eq!(c.name, "HcclBarrier");
    assert_eq!(c.comm.unwrap().seq, Some(2));
    // An unknown dtype: count and raw value, no bytes.
    let c = call(
        &mut d,
        entry("ncclAllGather", 17, [1, 2, 10, 77, 0xc1, 0x51], &[]),
        ret("ncclAllGather", 18, 0, &[]),
    );
    assert_eq!(c.name, "ncclAllGather 10 x dtype(77)");
}

#[test]
fn communicator_identity_rank_size_and_sequence_across_ranks() {
    let mut d = decoder_with(
        &[
            "ncclGetUniqueId",
            "ncclCommInitRank",
            "ncclAllReduce",
            "ncclCommDestroy",
        ],
        0,
    );
    let mut id = [0u8; 128];
    id[..4].copy_from_slice(b"SNCL");
    id[8..40].copy_from_slice(b"/standin-nccl-4242-1234567-abcde");
    let words: Vec<u64> = id
        .chunks(8)
        .take(7)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    // Rank 0 made the id.
    let c = call(
        &mut d,
        entry("ncclGetUniqueId", 1, [0x9000, 0, 0, 0, 0, 0], &[]),
        ret("ncclGetUniqueId", 2, 0, &id),
    );
    assert_eq!(
        c.args,
        CallArgs::UniqueId {
            id_hash: Some(comm_id_hash(&id))
        }
    );
    // Rank 0 (process TGID) and rank 1 (process TGID+1) init with it.
    for (tgid, rank, handle, new_abi) in [(TGID, 0u64, 0xc0u64, false), (TGID + 1, 1, 0xe0, true)] {
        let mut e = pid(
            entry(
                "ncclCommInitRank",
                10,
                [0x8000, JUNK | 2, JUNK | rank, 0, 0, 0],
                &words,
            ),
            tgid,
            tgid + 1,
        );
        if new_abi {
            // The proposed ABI copies the whole 128-byte id from sp+8.
            e = with_deref(e, &id);
        }
        let r = pid_r(
            ret("ncclCommInitRank", 20, 0, &handle.to_le_bytes()),
            tgid,
            tgid + 1,
        );
        let c = call(&mut d, e, r);
        assert_eq!(c.name, format!("ncclCommInitRank rank {rank}/2"));
        let CallArgs::CommInit(init) = &c.args else {
            panic!()
        };
        assert_eq!(
            (init.nranks, init.rank, &init.comms[..]),
            (Some(2), Some(rank as u32), &[handle][..])
        );
        assert_eq!(
            init.id_hash,
            Some(comm_id_hash(&id)),
            "same id, same name on every rank"
        );
        let comm = d.communicator(tgid, handle).unwrap();
        assert_eq!(
            (comm.rank, comm.size, comm.seen_init),
            (Some(rank as u32), Some(2), true)
        );
    }
    // Both ranks' collectives get the same numbers, exact.
    for (tgid, handle) in [(TGID, 0xc0u64), (TGID + 1, 0xe0)] {
        for seq in 0..3 {
            let e = pid(
                entry("ncclAllReduce", 30 + seq, [1, 2, 4, 7, 0, handle], &[0]),
                tgid,
                tgid + 1,
            );
            let r = pid_r(ret("ncclAllReduce", 40 + seq, 0, &[]), tgid, tgid + 1);
            let ctx = call(&mut d, e, r).comm.unwrap();
            assert_eq!(
                (ctx.seq, ctx.seq_exact, ctx.id_hash, ctx.size),
                (Some(seq), true, Some(comm_id_hash(&id)), Some(2))
            );
        }
    }
    // Destroy forgets it.
    let c = call(
        &mut d,
        entry("ncclCommDestroy", 50, [0xc0, 0, 0, 0, 0, 0], &[]),
        ret("ncclCommDestroy", 51, 0, &[]),
    );
    assert_eq!(c.comm.unwrap().id_hash, Some(comm_id_hash(&id)));
    assert!(d.communicator(TGID, 0xc0).is_none());
    // A failed init registers nothing.
    let e = entry("ncclCommInitRank", 60, [0x8000, 2, 0, 0, 0, 0], &words);
    let c = call(
        &mut d,
        e,
        ret("ncclCommInitRank", 61, 5, &0xf0u64.to_le_bytes()),
    );
    assert!(c.error);
    assert!(d.communicator(TGID, 0xf0).is_none());
}

#[test]
fn hccl_root_info_init() {
    let mut d = decoder_with(
        &["HcclGetRootInfo", "HcclCommInitRootInfo", "HcclGetRankSize"],
        0,
    );
    let mut root = [0u8; 128];
    root[..4].copy_from_slice(b"SHCL");
    root[4..20].copy_from_slice(b"/standin-hccl-77");
    let c = call(
        &mut d,
        entry("HcclGetRootInfo", 1, [0x9000, 0, 0, 0, 0, 0], &[]),
        ret("HcclGetRootInfo", 2, 0, &root),
    );
    assert_eq!(
        c.args,
        CallArgs::UniqueId {
            id_hash: Some(comm_id_hash(&root))
        }
    );
    // (nRanks 8, root*, rank 5, comm*): root copied at entry, comm at return.
    let e = with_deref(
        entry(
            "HcclCommInitRootInfo",
            3,
            [JUNK | 8, 0x9000, JUNK | 5, 0x8000, 0, 0],
            &[],
        ),
        &root,
    );
    let c = call(
        &mut d,
        e,
        ret("HcclCommInitRootInfo", 4, 0, &0xabcdu64.to_le_bytes()),
    );
    assert_eq!(c.name, "HcclCommInitRootInfo rank 5/8");
    let comm = d.communicator(TGID, 0xabcd).unwrap();
    assert_eq!(
        (comm.id_hash, comm.rank, comm.size),
        (Some(comm_id_hash(&root)), Some(5), Some(8))
    );
    // A size query of an unknown communicator teaches its size.
    let c = call(
        &mut d,
        entry("HcclGetRankSize", 5, [0x1234, 0x8000, 0, 0, 0, 0], &[]),
        ret("HcclGetRankSize", 6, 0, &4u32.to_le_bytes()),
    );
    assert_eq!(
        c.args,
        CallArgs::CommQuery {
            comm: 0x1234,
            value: Some(4)
        }
    );
    assert_eq!(d.communicator(TGID, 0x1234).unwrap().size, Some(4));
}

#[test]
fn init_all_and_split() {
    let mut d = decoder_with(&["ncclCommInitAll", "ncclCommSplit", "ncclCommInitRank"], 0);
    let handles: Vec<u8> = [0x10u64, 0x20]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect();
    let c = call(
        &mut d,
        entry("ncclCommInitAll", 1, [0x8000, JUNK | 2, 0, 0, 0, 0], &[]),
        ret("ncclCommInitAll", 2, 0, &handles),
    );
    assert_eq!(c.name, "ncclCommInitAll 2 devices");
    assert_eq!(d.communicator(TGID, 0x20).unwrap().rank, Some(1));
    assert_eq!(d.communicator(TGID, 0x20).unwrap().size, Some(2));
    let parent = d.communicator(TGID, 0x10).unwrap().id_hash.unwrap();
    let c = call(
        &mut d,
        entry("ncclCommSplit", 3, [0x10, JUNK | 1, 0, 0x8000, 0, 0], &[]),
        ret("ncclCommSplit", 4, 0, &0x30u64.to_le_bytes()),
    );
    assert_eq!(c.name, "ncclCommSplit color 1");
    assert_eq!(
        d.communicator(TGID, 0x30).unwrap().id_hash,
        Some(comm::split_hash(parent, 1))
    );
}

#[test]
fn launches_with_dim3_in_register_pairs() {
    let mut d = decoder_with(
        &[
            "cudaLaunchKernel",
            "cudaLaunchKernelExC",
            "aclrtLaunchKernel",
        ],
        0,
    );
    // func, grid 7|3<<32, grid.z 1 (junk above), block 128|1<<32, block.z 1, args; sharedMem, stream on the stack.
    let args = [0x4000, 7 | 3 << 32, JUNK | 1, 128 | 1 << 32, 1, 0x7fff_0000];
    let c = call(
        &mut d,
        entry("cudaLaunchKernel", 1, args, &[4096, 0x5157]),
        ret("cudaLaunchKernel", 2, 0, &[]),
    );
    assert_eq!(c.name, "cudaLaunchKernel grid(7,3,1) block(128,1,1)");
    let CallArgs::Launch(l) = &c.args else {
        panic!()
    };
    assert_eq!(
        (l.func, l.shared_mem, l.stream),
        (0x4000, Some(4096), Some(0x5157))
    );
    // No GPU: cudaErrorInsufficientDriver.
    let c = call(
        &mut d,
        entry("cudaLaunchKernel", 3, args, &[0, 0]),
        ret("cudaLaunchKernel", 4, 35, &[]),
    );
    assert_eq!((c.ret, c.error), (Some(35), true));
    // cudaLaunchKernelExC: dims from the copied config.
    let mut cfg = [0u8; 40];
    for (i, v) in [2u32, 2, 2, 64, 2, 1].iter().enumerate() {
        cfg[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    cfg[24..32].copy_from_slice(&512u64.to_le_bytes());
    cfg[32..40].copy_from_slice(&0x51u64.to_le_bytes());
    let e = with_deref(
        entry("cudaLaunchKernelExC", 5, [0x9000, 0x4000, 0, 0, 0, 0], &[]),
        &cfg,
    );
    let c = call(&mut d, e, ret("cudaLaunchKernelExC", 6, 0, &[]));
    assert_eq!(c.name, "cudaLaunchKernelExC grid(2,2,2) block(64,2,1)");
    let CallArgs::Launch(l) = &c.args else {
        panic!()
    };
    assert_eq!((l.shared_mem, l.stream), (Some(512), Some(0x51)));
    let c = call(
        &mut d,
        entry(
            "aclrtLaunchKernel",
            7,
            [0x4000, JUNK | 48, 0x9000, 16, 0x61, 0],
            &[],
        ),
        ret("aclrtLaunchKernel", 8, 0, &[]),
    );
    assert_eq!(c.name, "aclrtLaunchKernel blocks 48");
}

#[test]
fn stack_args_honour_sp_delta() {
    // The same call seen by a probe placed after a push: stack args one word further.
    let mut d = decoder_with(&["cudaLaunchKernel"], 8);
    let args = [0x4000, 1 | 1 << 32, 1, 32 | 1 << 32, 1, 0];
    let c = call(
        &mut d,
        entry("cudaLaunchKernel", 1, args, &[0x0bad, 4096, 0x5157]),
        ret("cudaLaunchKernel", 2, 0, &[]),
    );
    let CallArgs::Launch(l) = &c.args else {
        panic!()
    };
    assert_eq!((l.shared_mem, l.stream), (Some(4096), Some(0x5157)));
}

#[test]
fn device_memory_accounting() {
    let names = [
        "cudaMalloc",
        "cudaFree",
        "cudaSetDevice",
        "cudaMallocAsync",
        "cudaFreeAsync",
        "aclrtMalloc",
        "aclrtSetDevice",
    ];
    let mut d = decoder_with(&names, 0);
    let c = call(
        &mut d,
        entry("cudaMalloc", 1, [0x8000, GIB, 0, 0, 0, 0], &[]),
        ret("cudaMalloc", 2, 0, &0x2000_0000_0000u64.to_le_bytes()),
    );
    assert_eq!(c.name, "cudaMalloc 1 GiB");
    let m = c.memory.unwrap();
    assert_eq!(
        (m.device, m.delta, m.held_after),
        (
            Device {
                vendor: Vendor::Nvidia,
                index: 0
            },
            GIB as i64,
            GIB
        )
    );
    // cudaSetDevice(2) on this thread, then an async allocation lands on device 2.
    call(
        &mut d,
        entry("cudaSetDevice", 3, [JUNK | 2, 0, 0, 0, 0, 0], &[]),
        ret("cudaSetDevice", 4, 0, &[]),
    );
    let c = call(
        &mut d,
        entry("cudaMallocAsync", 5, [0x8000, 2 * GIB, 0x51, 0, 0, 0], &[]),
        ret("cudaMallocAsync", 6, 0, &0x2100_0000_0000u64.to_le_bytes()),
    );
    assert_eq!(c.memory.unwrap().device.index, 2);
    // Out of memory: the requested size is reported, nothing held.
    let c = call(
        &mut d,
        entry("cudaMalloc", 7, [0x8000, 100 * GIB, 0, 0, 0, 0], &[]),
        ret("cudaMalloc", 8, 2, &0u64.to_le_bytes()),
    );
    assert!(c.error);
    assert_eq!(c.memory.unwrap().failed_request, Some(100 * GIB));
    assert_eq!(c.name, "cudaMalloc 100 GiB");
    // Frees.
    let c = call(
        &mut d,
        entry("cudaFree", 9, [0x2000_0000_0000, 0, 0, 0, 0, 0], &[]),
        ret("cudaFree", 10, 0, &[]),
    );
    assert_eq!(c.name, "cudaFree 1 GiB");
    assert_eq!(c.memory.unwrap().delta, -(GIB as i64));
    let c = call(
        &mut d,
        entry(
            "cudaFreeAsync",
            11,
            [0x2100_0000_0000, 0x51, 0, 0, 0, 0],
            &[],
        ),
        ret("cudaFreeAsync", 12, 0, &[]),
    );
    assert_eq!(c.memory.unwrap().held_after, 0);
    let c = call(
        &mut d,
        entry("cudaFree", 13, [0, 0, 0, 0, 0, 0], &[]),
        ret("cudaFree", 14, 0, &[]),
    );
    assert!(c.memory.is_none(), "cudaFree(NULL) is a no-op");
    // Ascend is separate.
    call(
        &mut d,
        entry("aclrtSetDevice", 15, [3, 0, 0, 0, 0, 0], &[]),
        ret("aclrtSetDevice", 16, 0, &[]),
    );
    let c = call(
        &mut d,
        entry("aclrtMalloc", 17, [0x8000, 1 << 20, 0, 0, 0, 0], &[]),
        ret("aclrtMalloc", 18, 0, &0x5000u64.to_le_bytes()),
    );
    assert_eq!(
        c.memory.unwrap().device,
        Device {
            vendor: Vendor::Ascend,
            index: 3
        }
    );
    let ledger = d.memory(TGID).unwrap();
    assert_eq!(
        ledger.held(Device {
            vendor: Vendor::Nvidia,
            index: 0
        }),
        0
    );
    assert_eq!(
        ledger.held(Device {
            vendor: Vendor::Ascend,
            index: 3
        }),
        1 << 20
    );
    assert_eq!(ledger.failures, 1);
}

/// A site given between entry and return (as the kernel's stack record
/// arrives) is carried by the call and charged with the allocation; a free
/// elsewhere credits it back; a failed allocation names its site.
#[test]
fn allocation_sites_from_call_stacks() {
    let mut d = decoder_with(&["cudaMalloc", "cudaFree"], 0);
    let mut out = Vec::new();
    let ip = ip_of("cudaMalloc");
    d.on_entry(
        &entry("cudaMalloc", 1, [0x8000, GIB, 0, 0, 0, 0], &[]),
        &mut out,
    );
    // A site for another probe of the thread is not this call's.
    d.on_call_site(TGID, TID, ip_of("cudaFree"), 99);
    d.on_call_site(TGID, TID, ip, 7);
    d.on_return(
        &ret("cudaMalloc", 2, 0, &0x2000_0000_0000u64.to_le_bytes()),
        &mut out,
    );
    let [Decoded::Call(c)] = out.as_slice() else {
        panic!("{out:?}")
    };
    assert_eq!((c.site, c.memory.unwrap().site), (Some(7), Some(7)));
    // Without a stack: no site.
    let c = call(
        &mut d,
        entry("cudaMalloc", 3, [0x8000, 2 * GIB, 0, 0, 0, 0], &[]),
        ret("cudaMalloc", 4, 0, &0x2100_0000_0000u64.to_le_bytes()),
    );
    assert_eq!(c.site, None);
    let rows = d.memory(TGID).unwrap().largest_sites(None, 5);
    assert_eq!(
        rows.iter()
            .map(|r| (r.site, r.usage.bytes))
            .collect::<Vec<_>>(),
        [(None, 2 * GIB), (Some(7), GIB)]
    );
    let c = call(
        &mut d,
        entry("cudaFree", 5, [0x2000_0000_0000, 0, 0, 0, 0, 0], &[]),
        ret("cudaFree", 6, 0, &[]),
    );
    assert_eq!(c.memory.unwrap().site, Some(7));
    assert_eq!(d.memory(TGID).unwrap().largest_sites(None, 5).len(), 1);
    let mut out = Vec::new();
    d.on_entry(
        &entry("cudaMalloc", 7, [0x8000, 64 * GIB, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_call_site(TGID, TID, ip, 8);
    d.on_return(&ret("cudaMalloc", 8, 2, &[]), &mut out);
    let [Decoded::Call(c)] = out.as_slice() else {
        panic!("{out:?}")
    };
    let m = c.memory.unwrap();
    assert_eq!((m.failed_request, m.site), (Some(64 * GIB), Some(8)));
}

#[test]
fn copies_syncs_markers() {
    let mut d = decoder_with(
        &[
            "cudaMemcpyAsync",
            "aclrtMemcpyAsync",
            "cudaStreamSynchronize",
            "mstxRangeStartA",
        ],
        0,
    );
    let c = call(
        &mut d,
        entry(
            "cudaMemcpyAsync",
            1,
            [1, 2, 4 << 20, JUNK | 1, 0x51, 0],
            &[],
        ),
        ret("cudaMemcpyAsync", 2, 0, &[]),
    );
    assert_eq!(c.name, "cudaMemcpyAsync 4 MiB HtoD");
    let c = call(
        &mut d,
        entry(
            "aclrtMemcpyAsync",
            3,
            [1, 8 << 20, 2, 4 << 20, 2, 0x61],
            &[],
        ),
        ret("aclrtMemcpyAsync", 4, 0, &[]),
    );
    assert_eq!(c.name, "aclrtMemcpyAsync 4 MiB DtoH");
    let CallArgs::Memcpy(m) = &c.args else {
        panic!()
    };
    assert_eq!((m.kind, m.stream), (MemcpyKind::DeviceToHost, Some(0x61)));
    let c = call(
        &mut d,
        entry("cudaStreamSynchronize", 5, [0x51, 0, 0, 0, 0, 0], &[]),
        ret("cudaStreamSynchronize", 6, 0, &[]),
    );
    assert_eq!(
        (c.name.as_str(), &c.args),
        (
            "cudaStreamSynchronize",
            &CallArgs::Sync {
                stream: Some(0x51),
                event: None
            }
        )
    );
    let e = with_deref(
        entry("mstxRangeStartA", 7, [0x9000, 0, 0, 0, 0, 0], &[]),
        b"forward\0garbage",
    );
    let c = call(
        &mut d,
        e,
        ret("mstxRangeStartA", 8, 0xffff_ffff_0000_0007, &[]),
    );
    assert_eq!(c.name, "mstxRangeStartA forward");
    assert_eq!(
        (c.ret, c.error),
        (Some(0xffff_ffff_0000_0007u64 as i64), false),
        "a value, not a status"
    );
}

#[test]
fn pairing_is_lifo_per_thread_and_reports_what_does_not_pair() {
    let mut d = decoder_with(
        &[
            "ncclGroupStart",
            "ncclAllReduce",
            "ncclGroupEnd",
            "cudaStreamSynchronize",
        ],
        0,
    );
    let mut out = Vec::new();
    // Another thread interleaves: pairing is per thread.
    d.on_entry(&entry("ncclGroupStart", 1, [0; 6], &[]), &mut out);
    d.on_entry(
        &pid(
            entry("cudaStreamSynchronize", 2, [0x51, 0, 0, 0, 0, 0], &[]),
            TGID,
            TID + 1,
        ),
        &mut out,
    );
    d.on_return(&ret("ncclGroupStart", 3, 0, &[]), &mut out);
    d.on_return(
        &pid_r(ret("cudaStreamSynchronize", 4, 0, &[]), TGID, TID + 1),
        &mut out,
    );
    let names: Vec<_> = out
        .iter()
        .map(|o| match o {
            Decoded::Call(c) => (c.function, c.tid),
            o => panic!("{o:?}"),
        })
        .collect();
    assert_eq!(
        names,
        [("ncclGroupStart", TID), ("cudaStreamSynchronize", TID + 1)]
    );

    // The inner return is lost: the outer return reports the inner entry.
    out.clear();
    d.on_entry(&entry("ncclGroupEnd", 10, [0; 6], &[]), &mut out);
    d.on_entry(
        &entry("ncclAllReduce", 11, [1, 2, 4, 7, 0, 0xc0], &[0]),
        &mut out,
    );
    assert_eq!(d.in_flight().count(), 2);
    let inner = d
        .in_flight()
        .find(|f| f.function == "ncclAllReduce")
        .unwrap();
    assert_eq!(
        (inner.comm, inner.seq, inner.start_ts),
        (Some(0xc0), Some(0), 11)
    );
    // What sinks see of a collective still running: its communicator as
    // its record will carry it (attached after init: no identity, inexact).
    let ctx = inner.context.expect("a collective's communicator");
    assert_eq!(
        (ctx.handle, ctx.seq, ctx.seq_exact, ctx.id_hash),
        (0xc0, Some(0), false, None)
    );
    assert!(matches!(inner.kind, CallKind::Collective(_)));
    d.on_return(&ret("ncclGroupEnd", 12, 0, &[]), &mut out);
    match out.as_slice() {
        [
            Decoded::Unmatched(Unmatched::EntryWithoutReturn {
                call,
                reason: OpenReason::OuterReturned,
            }),
            Decoded::Call(outer),
        ] => {
            assert_eq!(
                (call.function, call.end_ts, call.ret),
                ("ncclAllReduce", None, None)
            );
            assert_eq!(outer.function, "ncclGroupEnd");
        }
        other => panic!("{other:?}"),
    }
    // A return with no entry.
    out.clear();
    d.on_return(&ret("ncclAllReduce", 13, 0, &[]), &mut out);
    assert!(matches!(
        &out[..],
        [Decoded::Unmatched(Unmatched::ReturnWithoutEntry {
            function: Some("ncclAllReduce"),
            ..
        })]
    ));
    // An unknown address.
    out.clear();
    let mut e = entry("ncclAllReduce", 14, [0; 6], &[]);
    e.probe_ip = 0x1234;
    d.on_entry(&e, &mut out);
    assert!(matches!(
        &out[..],
        [Decoded::Unmatched(Unmatched::UnknownProbe {
            probe_ip: 0x1234,
            at_return: false,
            ..
        })]
    ));
    let s = d.stats();
    assert_eq!(
        (
            s.calls,
            s.entries_without_return,
            s.returns_without_entry,
            s.unknown_probes
        ),
        (3, 1, 1, 1)
    );
    assert_eq!(d.in_flight().count(), 0);
}

#[test]
fn recursion_matches_the_innermost_and_limits_hold() {
    let mut d = decoder_with(&["cudaStreamSynchronize"], 0);
    let mut out = Vec::new();
    d.on_entry(
        &entry("cudaStreamSynchronize", 1, [0xa, 0, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_entry(
        &entry("cudaStreamSynchronize", 2, [0xb, 0, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_return(&ret("cudaStreamSynchronize", 3, 0, &[]), &mut out);
    let Decoded::Call(c) = &out[0] else { panic!() };
    assert_eq!(c.start_ts, 2, "innermost first");
    // Depth limit: the oldest open call is reported.
    out.clear();
    // One call (ts 1) is still open: MAX_DEPTH more overflow by one.
    for ts in 0..MAX_DEPTH as u64 {
        d.on_entry(
            &entry("cudaStreamSynchronize", 10 + ts, [0; 6], &[]),
            &mut out,
        );
    }
    match out.as_slice() {
        [
            Decoded::Unmatched(Unmatched::EntryWithoutReturn {
                call,
                reason: OpenReason::DepthLimit,
            }),
        ] => assert_eq!(call.start_ts, 1),
        other => panic!("{other:?}"),
    }
    // Thread exit reports the rest.
    out.clear();
    d.thread_exited(TGID, TID, &mut out);
    assert_eq!(out.len(), MAX_DEPTH);
    assert!(out.iter().all(|o| matches!(
        o,
        Decoded::Unmatched(Unmatched::EntryWithoutReturn {
            reason: OpenReason::ThreadExited,
            ..
        })
    )));
    // Process exit forgets probes and state.
    out.clear();
    d.on_entry(&entry("cudaStreamSynchronize", 100, [0; 6], &[]), &mut out);
    d.process_exited(TGID, &mut out);
    assert_eq!(out.len(), 1);
    assert!(
        d.probes()
            .get(TGID, ip_of("cudaStreamSynchronize"))
            .is_none()
    );
    assert!(
        d.probes()
            .get(TGID + 1, ip_of("cudaStreamSynchronize"))
            .is_some()
    );
}

#[test]
fn activity_records_from_the_return_copy() {
    let mut d = decoder_with(
        &["cuptiActivityGetNextRecord", "msptiActivityGetNextRecord"],
        0,
    );
    let mut out = Vec::new();
    let rec = crate::activity::cupti::tests::kernel_record(10);
    let args = [0x9000, 4096, 0x8000, 0, 0, 0];
    d.on_entry(&entry("cuptiActivityGetNextRecord", 1, args, &[]), &mut out);
    d.on_return(
        &ret("cuptiActivityGetNextRecord", 2, 0, &rec[..128]),
        &mut out,
    );
    match out.as_slice() {
        [Decoded::Activity(a)] => {
            assert_eq!(
                (
                    a.library,
                    a.ts,
                    a.activity.kind,
                    a.activity.start,
                    a.activity.end
                ),
                (Library::Cupti, 2, ActivityKind::Kernel, 1_000, 5_000)
            );
            assert_eq!(a.activity.correlation_id, Some(42));
        }
        other => panic!("{other:?}"),
    }
    // The end of the buffer (CUPTI_ERROR_MAX_LIMIT_REACHED): nothing.
    out.clear();
    d.on_entry(&entry("cuptiActivityGetNextRecord", 3, args, &[]), &mut out);
    d.on_return(&ret("cuptiActivityGetNextRecord", 4, 12, &[]), &mut out);
    assert!(out.is_empty());
    // Today's ABI: only the pointer: counted as unread.
    d.on_entry(&entry("cuptiActivityGetNextRecord", 5, args, &[]), &mut out);
    d.on_return(
        &ret("cuptiActivityGetNextRecord", 6, 0, &0x9040u64.to_le_bytes()),
        &mut out,
    );
    // Garbage record.
    d.on_entry(&entry("msptiActivityGetNextRecord", 7, args, &[]), &mut out);
    d.on_return(
        &ret("msptiActivityGetNextRecord", 8, 0, &[0xee; 64]),
        &mut out,
    );
    // A kind the agent does not draw (17; PyTorch's profiler enables
    // several such): read and left, no error.
    let mut other = [0u8; 64];
    other[..4].copy_from_slice(&17u32.to_le_bytes());
    d.on_entry(&entry("cuptiActivityGetNextRecord", 9, args, &[]), &mut out);
    d.on_return(&ret("cuptiActivityGetNextRecord", 10, 0, &other), &mut out);
    assert!(out.is_empty());
    let s = d.stats();
    assert_eq!(
        (
            s.activities,
            s.activity_unread,
            s.activity_errors,
            s.activity_other_kinds,
            s.calls
        ),
        (1, 1, 1, 1, 0)
    );
}

#[test]
fn malformed_records_are_bounded() {
    let mut d = decoder_with(&["HcclCommInitRootInfo", "cudaMalloc"], 0);
    let mut e = entry("HcclCommInitRootInfo", 1, [u64::MAX; 6], &[]);
    e.deref_len = u32::MAX;
    let mut r = ret("HcclCommInitRootInfo", 2, 0, &[]);
    r.deref_len = u32::MAX;
    let c = call(&mut d, e, r);
    let CallArgs::CommInit(init) = &c.args else {
        panic!()
    };
    assert_eq!((init.nranks, init.rank), (Some(u32::MAX), Some(u32::MAX)));
    // A successful malloc whose pointer copy is missing.
    let c = call(
        &mut d,
        entry("cudaMalloc", 3, [0, u64::MAX, 0, 0, 0, 0], &[]),
        ret("cudaMalloc", 4, 0, &[]),
    );
    assert_eq!(c.memory, None, "succeeded, pointer unknown: no accounting");
    assert_eq!(c.name, "cudaMalloc 16.0 EiB");
}

/// A traced process whose own addresses the agent has not read yet (a new
/// rank calling a probe another rank's library file already has) decodes
/// by the probe's slot; a record with no known address and no known slot
/// is an unknown probe, counted.
#[test]
fn records_decode_by_probe_slot_when_the_process_is_not_known_yet() {
    let mut table = ProbeTable::new();
    let library = lib_of("cudaMalloc");
    table.insert_slot(
        7,
        ProbeTarget {
            library,
            function: library.function("cudaMalloc").unwrap(),
            sp_delta: 0,
        },
    );
    // Slot 0 means "no slot": never a lookup key.
    table.insert_slot(0, table.lookup(0, 0, 7).copied().unwrap());
    let mut d = Decoder::new(table);
    let mut e = pid(
        entry("cudaMalloc", 1_000, [0x8000, GIB, 0, 0, 0, 0], &[]),
        555,
        556,
    );
    e.slot = 7;
    let mut r = pid_r(
        ret("cudaMalloc", 2_000, 0, &0x2000_0000_0000u64.to_le_bytes()),
        555,
        556,
    );
    r.slot = 7;
    let c = call(&mut d, e, r);
    assert_eq!((c.tgid, c.tid, c.function), (555, 556, "cudaMalloc"));
    assert_eq!(c.name, "cudaMalloc 1 GiB");
    assert_eq!((c.start_ts, c.end_ts, c.ret), (1_000, Some(2_000), Some(0)));

    let mut out = Vec::new();
    e.slot = 0;
    d.on_entry(&e, &mut out);
    assert!(matches!(
        out.as_slice(),
        [Decoded::Unmatched(Unmatched::UnknownProbe {
            tgid: 555,
            at_return: false,
            ..
        })]
    ));
    assert_eq!(d.stats().unknown_probes, 1);
}

// ---------------------------------------------------------------- driver

fn name_bytes(s: &str) -> Vec<u8> {
    let mut b = s.as_bytes().to_vec();
    b.push(0);
    b
}

/// `cuModuleGetFunction(&f, module, name)` returning `handle`.
fn get_function(d: &mut Decoder, name: &str, handle: u64, ts: u64) -> DeviceCall {
    let e = with_deref(
        entry(
            "cuModuleGetFunction",
            ts,
            [0x7ffd_0000_2000, 0x6000, 0x4000_1000, 0, 0, 0],
            &[],
        ),
        &name_bytes(name),
    );
    call(
        d,
        e,
        ret("cuModuleGetFunction", ts + 10, 0, &handle.to_le_bytes()),
    )
}

/// `cuLaunchKernel(f, 4, 2, 1, 128, 1, 1, 256, stream, params, NULL)`.
fn cu_launch(f: u64, ts: u64) -> UprobeEntry {
    entry(
        "cuLaunchKernel",
        ts,
        [f, JUNK | 4, 2, 1, JUNK | 128, 1],
        &[JUNK | 1, JUNK | 256, 0x5000, 0x7ffd_0000_3000, 0],
    )
}

#[test]
fn driver_launches_are_named_by_their_handle() {
    let mut d = decoder_with(
        &[
            "cuModuleGetFunction",
            "cuLibraryGetKernel",
            "cuKernelGetFunction",
            "cuLaunchKernel",
            "cuLaunchKernelEx",
        ],
        0,
    );
    let g = get_function(&mut d, "gemm_bf16_tn", 0xf00d_0000, 1_000);
    let CallArgs::KernelHandle(h) = &g.args else {
        panic!("{:?}", g.args)
    };
    assert_eq!(
        (h.name.as_deref(), h.handle),
        (Some("gemm_bf16_tn"), Some(0xf00d_0000))
    );
    assert_eq!(g.name, "cuModuleGetFunction gemm_bf16_tn");
    let c = call(
        &mut d,
        cu_launch(0xf00d_0000, 2_000),
        ret("cuLaunchKernel", 2_100, 0, &[]),
    );
    let CallArgs::Launch(l) = &c.args else {
        panic!("{:?}", c.args)
    };
    assert_eq!(l.kernel.as_deref(), Some("gemm_bf16_tn"));
    assert_eq!((l.grid, l.block), (Some([4, 2, 1]), Some([128, 1, 1])));
    assert_eq!((l.shared_mem, l.stream), (Some(256), Some(0x5000)));
    assert_eq!(
        c.name,
        "cuLaunchKernel gemm_bf16_tn grid(4,2,1) block(128,1,1)"
    );

    // cuLibraryGetKernel then cuKernelGetFunction: the function has the
    // kernel's name; a CUkernel launched as is has it too.
    let e = with_deref(
        entry(
            "cuLibraryGetKernel",
            3_000,
            [0x7ffd_0000_2000, 0x6100, 0x4000_2000, 0, 0, 0],
            &[],
        ),
        &name_bytes("triton_poi_fused_add_0"),
    );
    call(
        &mut d,
        e,
        ret(
            "cuLibraryGetKernel",
            3_010,
            0,
            &0xbeef_0000u64.to_le_bytes(),
        ),
    );
    let e = entry(
        "cuKernelGetFunction",
        3_100,
        [0x7ffd_0000_2000, 0xbeef_0000, 0, 0, 0, 0],
        &[],
    );
    call(
        &mut d,
        e,
        ret(
            "cuKernelGetFunction",
            3_110,
            0,
            &0xcafe_0000u64.to_le_bytes(),
        ),
    );
    for f in [0xcafe_0000, 0xbeef_0000] {
        let c = call(
            &mut d,
            cu_launch(f, 4_000),
            ret("cuLaunchKernel", 4_100, 0, &[]),
        );
        let CallArgs::Launch(l) = &c.args else {
            panic!()
        };
        assert_eq!(
            l.kernel.as_deref(),
            Some("triton_poi_fused_add_0"),
            "{f:#x}"
        );
    }
    // cuLaunchKernelEx: dims from the CUlaunchConfig, an `unsigned`
    // sharedMemBytes followed by padding.
    let mut cfg = Vec::new();
    for v in [8u32, 1, 1, 256, 1, 1, 1024, 0xffff_ffff] {
        cfg.extend_from_slice(&v.to_le_bytes());
    }
    cfg.extend_from_slice(&0x5100u64.to_le_bytes());
    let e = with_deref(
        entry(
            "cuLaunchKernelEx",
            5_000,
            [0x7ffd_0000_4000, 0xf00d_0000, 0, 0, 0, 0],
            &[],
        ),
        &cfg,
    );
    let c = call(&mut d, e, ret("cuLaunchKernelEx", 5_100, 0, &[]));
    let CallArgs::Launch(l) = &c.args else {
        panic!()
    };
    assert_eq!(
        (l.kernel.as_deref(), l.grid, l.block, l.shared_mem, l.stream),
        (
            Some("gemm_bf16_tn"),
            Some([8, 1, 1]),
            Some([256, 1, 1]),
            Some(1024),
            Some(0x5100)
        )
    );
    // An unknown handle launches without a name; a failed lookup names nothing.
    let c = call(
        &mut d,
        cu_launch(0x1234, 6_000),
        ret("cuLaunchKernel", 6_100, 0, &[]),
    );
    assert!(matches!(&c.args, CallArgs::Launch(l) if l.kernel.is_none()));
    let e = with_deref(
        entry(
            "cuModuleGetFunction",
            7_000,
            [0x7ffd_0000_2000, 0x6000, 0x4000_1000, 0, 0, 0],
            &[],
        ),
        &name_bytes("missing"),
    );
    call(&mut d, e, ret("cuModuleGetFunction", 7_010, 500, &[]));
    assert_eq!(d.kernels(TGID).unwrap().len(), 3);
    // The names go with the process.
    d.process_exited(TGID, &mut Vec::new());
    assert!(d.kernels(TGID).is_none());
}

#[test]
fn a_driver_call_inside_its_runtime_call_is_one_call() {
    let mut d = decoder_with(
        &[
            "cuModuleGetFunction",
            "cudaLaunchKernel",
            "cuLaunchKernel",
            "cudaMalloc",
            "cuMemAlloc_v2",
            "cudaStreamSynchronize",
            "cuStreamSynchronize",
            "ncclAllReduce",
            "cuLaunchKernelEx",
        ],
        0,
    );
    get_function(&mut d, "vectorAdd", 0xf00d_0000, 500);
    let mut out = Vec::new();
    // cudaLaunchKernel(stub, grid, block, args, 0, stream) -> cuLaunchKernel.
    d.on_entry(
        &entry(
            "cudaLaunchKernel",
            1_000,
            [
                0x40_1000,
                4 | 2 << 32,
                1,
                128 | 1 << 32,
                1,
                0x7ffd_0000_3000,
            ],
            &[0, 0x5000],
        ),
        &mut out,
    );
    d.on_entry(&cu_launch(0xf00d_0000, 1_100), &mut out);
    d.on_return(&ret("cuLaunchKernel", 1_200, 0, &[]), &mut out);
    assert!(out.is_empty(), "folded: {out:?}");
    d.on_return(&ret("cudaLaunchKernel", 1_300, 0, &[]), &mut out);
    let [Decoded::Call(c)] = out.as_slice() else {
        panic!("{out:?}")
    };
    assert_eq!(
        (c.function, c.start_ts, c.end_ts),
        ("cudaLaunchKernel", 1_000, Some(1_300))
    );
    assert!(
        matches!(&c.args, CallArgs::Launch(l) if l.kernel.as_deref() == Some("vectorAdd") && l.func == 0x40_1000)
    );
    assert_eq!(
        c.name,
        "cudaLaunchKernel vectorAdd grid(4,2,1) block(128,1,1)"
    );

    // cudaMalloc -> cuMemAlloc_v2: the memory counted once, by the runtime call.
    out.clear();
    d.on_entry(
        &entry(
            "cudaMalloc",
            2_000,
            [0x7ffd_0000_5000, GIB, 0, 0, 0, 0],
            &[],
        ),
        &mut out,
    );
    d.on_entry(
        &entry(
            "cuMemAlloc_v2",
            2_010,
            [0x7ffd_0000_5100, GIB, 0, 0, 0, 0],
            &[],
        ),
        &mut out,
    );
    d.on_return(
        &ret("cuMemAlloc_v2", 2_020, 0, &0x2000_0000u64.to_le_bytes()),
        &mut out,
    );
    d.on_return(
        &ret("cudaMalloc", 2_030, 0, &0x2000_0000u64.to_le_bytes()),
        &mut out,
    );
    let [Decoded::Call(c)] = out.as_slice() else {
        panic!("{out:?}")
    };
    assert_eq!(
        (c.function, c.memory.map(|m| m.held_after)),
        ("cudaMalloc", Some(GIB))
    );
    assert_eq!(d.memory(TGID).unwrap().live(), 1);

    // cudaStreamSynchronize -> cuStreamSynchronize.
    out.clear();
    d.on_entry(
        &entry("cudaStreamSynchronize", 3_000, [0x5000, 0, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_entry(
        &entry("cuStreamSynchronize", 3_010, [0x5000, 0, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_return(&ret("cuStreamSynchronize", 3_900, 0, &[]), &mut out);
    d.on_return(&ret("cudaStreamSynchronize", 3_910, 0, &[]), &mut out);
    assert!(matches!(out.as_slice(), [Decoded::Call(c)] if c.function == "cudaStreamSynchronize"));

    // NCCL launching through the driver: both calls stay, the launch named.
    out.clear();
    get_function(
        &mut d,
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
        0xaaaa_0000,
        3_950,
    );
    d.on_entry(
        &entry(
            "ncclAllReduce",
            4_000,
            [0xa000, 0xb000, 1024, 7, 0, 0xc0c0],
            &[0x5000],
        ),
        &mut out,
    );
    d.on_entry(
        &with_deref(
            entry(
                "cuLaunchKernelEx",
                4_010,
                [0x7ffd_0000_4000, 0xaaaa_0000, 0, 0, 0, 0],
                &[],
            ),
            &[0; 40],
        ),
        &mut out,
    );
    d.on_return(&ret("cuLaunchKernelEx", 4_020, 0, &[]), &mut out);
    d.on_return(&ret("ncclAllReduce", 4_030, 0, &[]), &mut out);
    let names: Vec<&str> = out
        .iter()
        .map(|o| match o {
            Decoded::Call(c) => c.function,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(names, ["cuLaunchKernelEx", "ncclAllReduce"]);
    assert!(
        matches!(&out[0], Decoded::Call(c) if c.name.starts_with("cuLaunchKernelEx ncclDevKernel_AllReduce"))
    );
    let s = d.stats();
    // Two handle lookups, the launch, the allocation, the sync, NCCL and its launch.
    assert_eq!((s.folded, s.calls), (3, 7), "{s:?}");
}

#[test]
fn driver_virtual_memory_holds_what_is_mapped() {
    let mut d = decoder_with(
        &[
            "cuMemAddressReserve",
            "cuMemCreate",
            "cuMemMap",
            "cuMemUnmap",
            "cuMemRelease",
        ],
        0,
    );
    const MIB: u64 = 1 << 20;
    let base = 0x3000_0000_0000u64;
    let c = call(
        &mut d,
        entry(
            "cuMemAddressReserve",
            1_000,
            [0x7ffd_0000_6000, 64 * MIB, 0, 0, 0, 0],
            &[],
        ),
        ret("cuMemAddressReserve", 1_010, 0, &base.to_le_bytes()),
    );
    assert!(c.memory.is_none(), "a reservation holds nothing");
    assert!(matches!(&c.args, CallArgs::Vmm(v) if v.ptr == Some(base) && v.size == Some(64 * MIB)));
    let mut held = 0;
    for page in 0..3u64 {
        let handle = 0x2000_0000_0000 + page * 2 * MIB;
        let c = call(
            &mut d,
            entry(
                "cuMemCreate",
                2_000,
                [0x7ffd_0000_6100, 2 * MIB, 0x7ffd_0000_6200, 0, 0, 0],
                &[],
            ),
            ret("cuMemCreate", 2_010, 0, &handle.to_le_bytes()),
        );
        assert!(c.memory.is_none(), "created, not mapped");
        assert!(matches!(&c.args, CallArgs::Vmm(v) if v.handle == Some(handle)));
        let c = call(
            &mut d,
            entry(
                "cuMemMap",
                2_100,
                [base + page * 2 * MIB, 2 * MIB, 0, handle, 0, 0],
                &[],
            ),
            ret("cuMemMap", 2_110, 0, &[]),
        );
        held += 2 * MIB;
        assert_eq!(
            c.memory.map(|m| (m.delta, m.held_after)),
            Some((2 * MIB as i64, held))
        );
        assert_eq!(c.name, "cuMemMap 2 MiB");
    }
    // The segment shrinks by its last two pages in one unmap.
    let c = call(
        &mut d,
        entry(
            "cuMemUnmap",
            3_000,
            [base + 2 * MIB, 4 * MIB, 0, 0, 0, 0],
            &[],
        ),
        ret("cuMemUnmap", 3_010, 0, &[]),
    );
    assert_eq!(
        c.memory.map(|m| (m.delta, m.held_after)),
        Some((-4 * MIB as i64, 2 * MIB))
    );
    // A failed map holds nothing.
    let c = call(
        &mut d,
        entry(
            "cuMemMap",
            4_000,
            [base + 8 * MIB, 2 * MIB, 0, 0x99, 0, 0],
            &[],
        ),
        ret("cuMemMap", 4_010, 1, &[]),
    );
    assert!(c.error && c.memory.is_none());
    let held_now = d.memory(TGID).unwrap().held(Device {
        vendor: Vendor::Nvidia,
        index: 0,
    });
    assert_eq!(held_now, 2 * MIB);
}

/// The runtime call never returns (its thread jumped out of it after the
/// driver's call returned): the folded driver allocation is not counted,
/// and the runtime call is reported open when its process exits.
#[test]
fn a_folded_driver_call_of_a_runtime_call_that_never_returns_holds_nothing() {
    let mut d = decoder_with(&["cudaMalloc", "cuMemAlloc_v2"], 0);
    let mut out = Vec::new();
    d.on_entry(
        &entry(
            "cudaMalloc",
            1_000,
            [0x7ffd_0000_5000, GIB, 0, 0, 0, 0],
            &[],
        ),
        &mut out,
    );
    d.on_entry(
        &entry(
            "cuMemAlloc_v2",
            1_010,
            [0x7ffd_0000_5100, GIB, 0, 0, 0, 0],
            &[],
        ),
        &mut out,
    );
    d.on_return(
        &ret("cuMemAlloc_v2", 1_020, 0, &0x2000_0000u64.to_le_bytes()),
        &mut out,
    );
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(d.memory(TGID).map_or(0, |m| m.live()), 0);
    d.process_exited(TGID, &mut out);
    let [Decoded::Unmatched(Unmatched::EntryWithoutReturn { call, reason })] = out.as_slice()
    else {
        panic!("{out:?}")
    };
    assert_eq!(
        (call.function, *reason),
        ("cudaMalloc", OpenReason::ProcessExited)
    );
    assert_eq!(d.stats().folded, 1);
}

// ---------------------------------------------------------------- CANN runtime

/// `rtKernelLaunch(stub, 48, args, 16, NULL, stream)`.
fn rt_launch(stub: u64, ts: u64) -> UprobeEntry {
    entry(
        "rtKernelLaunch",
        ts,
        [stub, JUNK | 48, 0x7ffd_0000_3000, JUNK | 16, 0, 0x5000],
        &[],
    )
}

#[test]
fn cann_runtime_launches_are_named_by_stub_and_function_handle() {
    let mut d = decoder_with(
        &[
            "rtFunctionRegister",
            "rtGetFunctionByName",
            "rtsFuncGetByName",
            "rtKernelLaunch",
            "rtLaunchKernelByFuncHandleV3",
            "rtKernelLaunchWithHandle",
        ],
        0,
    );
    // rtFunctionRegister(bin, stub, "name", info, mode): the stub passed in
    // is named once the call succeeded.
    let e = with_deref(
        entry(
            "rtFunctionRegister",
            1_000,
            [0x6000, 0x40_2000, 0x4000_1000, 0, 0, 0],
            &[],
        ),
        &name_bytes("matmul_v2_tbe"),
    );
    let c = call(&mut d, e, ret("rtFunctionRegister", 1_010, 0, &[]));
    let CallArgs::KernelHandle(h) = &c.args else {
        panic!("{:?}", c.args)
    };
    assert_eq!(
        (h.name.as_deref(), h.handle, h.from),
        (Some("matmul_v2_tbe"), Some(0x40_2000), None)
    );
    assert_eq!(c.name, "rtFunctionRegister matmul_v2_tbe");
    let c = call(
        &mut d,
        rt_launch(0x40_2000, 2_000),
        ret("rtKernelLaunch", 2_100, 0, &[]),
    );
    let CallArgs::Launch(l) = &c.args else {
        panic!("{:?}", c.args)
    };
    assert_eq!(
        (l.kernel.as_deref(), l.blocks, l.stream, l.grid),
        (Some("matmul_v2_tbe"), Some(48), Some(0x5000), None)
    );
    assert_eq!(c.name, "rtKernelLaunch matmul_v2_tbe blocks 48");
    // A failed registration names nothing.
    let e = with_deref(
        entry(
            "rtFunctionRegister",
            2_500,
            [0x6000, 0x40_3000, 0x4000_1000, 0, 0, 0],
            &[],
        ),
        &name_bytes("never"),
    );
    call(&mut d, e, ret("rtFunctionRegister", 2_510, 107000, &[]));
    assert_eq!(d.kernels(TGID).unwrap().name(0x40_3000), None);

    // rtGetFunctionByName("name", &stub) and rtsFuncGetByName(bin, "name",
    // &handle): the handles written at return.
    let e = with_deref(
        entry(
            "rtGetFunctionByName",
            3_000,
            [0x4000_2000, 0x7ffd_0000_2000, 0, 0, 0, 0],
            &[],
        ),
        &name_bytes("softmax_tbe"),
    );
    call(
        &mut d,
        e,
        ret("rtGetFunctionByName", 3_010, 0, &0x40_4000u64.to_le_bytes()),
    );
    let e = with_deref(
        entry(
            "rtsFuncGetByName",
            3_100,
            [0x6100, 0x4000_3000, 0x7ffd_0000_2000, 0, 0, 0],
            &[],
        ),
        &name_bytes("add_custom"),
    );
    call(
        &mut d,
        e,
        ret("rtsFuncGetByName", 3_110, 0, &0xbeef_0000u64.to_le_bytes()),
    );
    let c = call(
        &mut d,
        rt_launch(0x40_4000, 4_000),
        ret("rtKernelLaunch", 4_100, 0, &[]),
    );
    assert!(matches!(&c.args, CallArgs::Launch(l) if l.kernel.as_deref() == Some("softmax_tbe")));
    // rtLaunchKernelByFuncHandleV3(handle, numBlocks, argsInfo, stream, cfg).
    let e = entry(
        "rtLaunchKernelByFuncHandleV3",
        5_000,
        [0xbeef_0000, JUNK | 8, 0x7ffd_0000_3000, 0x5100, 0, 0],
        &[],
    );
    let c = call(
        &mut d,
        e,
        ret("rtLaunchKernelByFuncHandleV3", 5_100, 0, &[]),
    );
    let CallArgs::Launch(l) = &c.args else {
        panic!("{:?}", c.args)
    };
    assert_eq!(
        (l.kernel.as_deref(), l.blocks, l.stream),
        (Some("add_custom"), Some(8), Some(0x5100))
    );
    // By binary and tiling key: counted, with no name (the binary handle is
    // not a kernel's).
    let e = entry(
        "rtKernelLaunchWithHandle",
        6_000,
        [0x6100, 7, JUNK | 4, 0x7ffd_0000_3000, 0, 0x5000],
        &[],
    );
    let c = call(&mut d, e, ret("rtKernelLaunchWithHandle", 6_100, 0, &[]));
    assert!(
        matches!(&c.args, CallArgs::Launch(l) if l.kernel.is_none() && l.blocks == Some(4) && l.func == 0)
    );
    assert_eq!(d.kernels(TGID).unwrap().len(), 3);
}

#[test]
fn a_cann_runtime_call_inside_its_ascendcl_call_is_one_call() {
    let mut d = decoder_with(
        &[
            "rtsFuncGetByName",
            "aclrtLaunchKernel",
            "rtLaunchKernelByFuncHandleV3",
            "aclrtMalloc",
            "rtMalloc",
            "aclrtFree",
            "rtFree",
            "aclrtSynchronizeStream",
            "rtStreamSynchronize",
            "HcclAllReduce",
            "rtKernelLaunch",
        ],
        0,
    );
    let e = with_deref(
        entry(
            "rtsFuncGetByName",
            500,
            [0x6100, 0x4000_3000, 0x7ffd_0000_2000, 0, 0, 0],
            &[],
        ),
        &name_bytes("attention_fwd"),
    );
    call(
        &mut d,
        e,
        ret("rtsFuncGetByName", 510, 0, &0xf00d_0000u64.to_le_bytes()),
    );
    let mut out = Vec::new();
    // aclrtLaunchKernel(handle, 48, args, 16, stream) -> rtLaunchKernelByFuncHandleV3.
    d.on_entry(
        &entry(
            "aclrtLaunchKernel",
            1_000,
            [0xf00d_0000, JUNK | 48, 0x7ffd_0000_3000, 16, 0x5000, 0],
            &[],
        ),
        &mut out,
    );
    d.on_entry(
        &entry(
            "rtLaunchKernelByFuncHandleV3",
            1_100,
            [0xf00d_0000, 48, 0x7ffd_0000_3100, 0x5000, 0, 0],
            &[],
        ),
        &mut out,
    );
    d.on_return(
        &ret("rtLaunchKernelByFuncHandleV3", 1_200, 0, &[]),
        &mut out,
    );
    assert!(out.is_empty(), "folded: {out:?}");
    d.on_return(&ret("aclrtLaunchKernel", 1_300, 0, &[]), &mut out);
    let [Decoded::Call(c)] = out.as_slice() else {
        panic!("{out:?}")
    };
    assert_eq!(
        (c.function, c.start_ts, c.end_ts, c.name.as_str()),
        (
            "aclrtLaunchKernel",
            1_000,
            Some(1_300),
            "aclrtLaunchKernel attention_fwd blocks 48"
        )
    );

    // aclrtMalloc -> rtMalloc, aclrtFree -> rtFree: counted once, by the
    // AscendCL call, on the Ascend device.
    out.clear();
    d.on_entry(
        &entry(
            "aclrtMalloc",
            2_000,
            [0x7ffd_0000_5000, GIB, 0, 0, 0, 0],
            &[],
        ),
        &mut out,
    );
    d.on_entry(
        &entry("rtMalloc", 2_010, [0x7ffd_0000_5100, GIB, 0, 3, 0, 0], &[]),
        &mut out,
    );
    d.on_return(
        &ret("rtMalloc", 2_020, 0, &0x5000_0000u64.to_le_bytes()),
        &mut out,
    );
    d.on_return(
        &ret("aclrtMalloc", 2_030, 0, &0x5000_0000u64.to_le_bytes()),
        &mut out,
    );
    let [Decoded::Call(c)] = out.as_slice() else {
        panic!("{out:?}")
    };
    let m = c.memory.expect("memory effect");
    assert_eq!(
        (c.function, m.held_after, m.device.vendor),
        ("aclrtMalloc", GIB, Vendor::Ascend)
    );
    out.clear();
    d.on_entry(
        &entry("aclrtFree", 2_100, [0x5000_0000, 0, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_entry(
        &entry("rtFree", 2_110, [0x5000_0000, 0, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_return(&ret("rtFree", 2_120, 0, &[]), &mut out);
    d.on_return(&ret("aclrtFree", 2_130, 0, &[]), &mut out);
    assert!(matches!(out.as_slice(), [Decoded::Call(c)] if c.function == "aclrtFree"));
    assert_eq!(d.memory(TGID).unwrap().live(), 0);

    // aclrtSynchronizeStream -> rtStreamSynchronize.
    out.clear();
    d.on_entry(
        &entry(
            "aclrtSynchronizeStream",
            3_000,
            [0x5000, 0, 0, 0, 0, 0],
            &[],
        ),
        &mut out,
    );
    d.on_entry(
        &entry("rtStreamSynchronize", 3_010, [0x5000, 0, 0, 0, 0, 0], &[]),
        &mut out,
    );
    d.on_return(&ret("rtStreamSynchronize", 3_900, 0, &[]), &mut out);
    d.on_return(&ret("aclrtSynchronizeStream", 3_910, 0, &[]), &mut out);
    assert!(matches!(out.as_slice(), [Decoded::Call(c)] if c.function == "aclrtSynchronizeStream"));

    // Direct runtime calls stay calls: a launch inside an HCCL collective,
    // an allocation an operator library makes, which feeds the ledger as
    // AscendCL's would.
    out.clear();
    d.on_entry(
        &entry(
            "HcclAllReduce",
            4_000,
            [0xa000, 0xb000, 1024, 4, 0, 0xc0c0],
            &[0x5000],
        ),
        &mut out,
    );
    d.on_entry(&rt_launch(0x40_2000, 4_010), &mut out);
    d.on_return(&ret("rtKernelLaunch", 4_020, 0, &[]), &mut out);
    d.on_return(&ret("HcclAllReduce", 4_030, 0, &[]), &mut out);
    let names: Vec<&str> = out
        .iter()
        .map(|o| match o {
            Decoded::Call(c) => c.function,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(names, ["rtKernelLaunch", "HcclAllReduce"]);
    let c = call(
        &mut d,
        entry(
            "rtMalloc",
            5_000,
            [0x7ffd_0000_5000, 2 * GIB, 0, 3, 0, 0],
            &[],
        ),
        ret("rtMalloc", 5_010, 0, &0x6000_0000u64.to_le_bytes()),
    );
    let m = c.memory.expect("memory effect");
    assert_eq!((m.held_after, m.device.vendor), (2 * GIB, Vendor::Ascend));
    let s = d.stats();
    // The name lookup, the launch, malloc, free, sync, the rt launch,
    // HCCL, the direct malloc.
    assert_eq!((s.folded, s.calls), (4, 8), "{s:?}");
}
