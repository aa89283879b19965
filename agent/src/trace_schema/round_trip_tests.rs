//! Records -> the Perfetto sink, in memory -> the trace reader -> the same
//! records. What the trace does not carry is named where it is left out
//! of a comparison.

use std::sync::Arc;

use xpuscope_perfetto::TraceWriter;
use xpuscope_probes::catalog::{Collective, Direction, HandleKind, Library, VmmOp};
use xpuscope_probes::decode::args::{
    AllocArgs, CallArgs, CollectiveArgs, KernelHandleArgs, LaunchArgs, MemcpyArgs, SendRecvArgs,
    VmmArgs,
};
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::enums::{DataType, MemcpyKind, RedOp};
use xpuscope_probes::decode::memory::{Device, MemoryEffect};
use xpuscope_probes::decode::{DeviceCall, OpenReason};

use super::read::{OpenAtEnd, TraceRecords};
use crate::events::{Comm, Exit, Switch};
use crate::model::{
    DeviceCallRecord, DeviceWork, EnqueueMarker, Field, FieldValue, LiveSiteRow, OffCpuInterval,
    Preemptor, RankIdentity, Record, Site, StepSeen, StreamTrack, WorkKind,
};
use crate::sinks::SinkCounters;
use crate::sinks::perfetto::PerfettoSink;

const PID: u32 = 100;
const WORKER: u32 = 101;

fn call(library: Library, function: &str, tid: u32, start: u64, args: CallArgs) -> DeviceCall {
    let spec = library.function(function).unwrap();
    DeviceCall {
        library,
        function: spec.name,
        kind: spec.kind,
        tgid: PID,
        tid,
        start_ts: start,
        end_ts: Some(start + 1_000),
        args,
        ret: Some(0),
        error: false,
        name: function.to_string(),
        comm: None,
        memory: None,
        site: None,
        launches: None,
    }
}

fn comm(seq: Option<u64>) -> CommContext {
    CommContext {
        handle: 0x5500,
        id_hash: Some(0xabcd_ef01_2345_6789),
        rank: Some(1),
        size: Some(2),
        seq,
        seq_exact: seq.is_some(),
    }
}

fn site(id: u64, label: &str) -> Arc<Site> {
    Arc::new(Site {
        id,
        tgid: PID,
        frames: Vec::new(),
        label: label.into(),
    })
}

fn device() -> Device {
    Device {
        vendor: Library::Cudart.vendor(),
        index: 1,
    }
}

/// The calls of the trace, every kind the readers rely on.
fn calls() -> Vec<DeviceCallRecord> {
    let mut out = Vec::new();
    let mut all_reduce = call(
        Library::Nccl,
        "ncclAllReduce",
        PID,
        10_000,
        CallArgs::Collective(CollectiveArgs {
            op: Collective::AllReduce,
            count: Some(1 << 20),
            dtype: Some(DataType::Bf16),
            bytes: Some(2 << 20),
            red_op: Some(RedOp::Sum),
            root: None,
            send: Some(0x7000_0000),
            recv: Some(0x7100_0000),
            comm: 0x5500,
            stream: Some(0x99),
        }),
    );
    all_reduce.name = "ncclAllReduce 2 MiB bf16 sum".into();
    all_reduce.comm = Some(comm(Some(7)));
    out.push(all_reduce);
    let mut broadcast = call(
        Library::Nccl,
        "ncclBroadcast",
        PID,
        20_000,
        CallArgs::Collective(CollectiveArgs {
            op: Collective::Broadcast,
            count: Some(16),
            dtype: Some(DataType::Unknown(42)),
            bytes: None,
            red_op: Some(RedOp::Custom(7)),
            root: Some(0),
            send: Some(0x10),
            recv: Some(0x20),
            comm: 0x5500,
            stream: None,
        }),
    );
    broadcast.comm = Some(comm(Some(8)));
    out.push(broadcast);
    let mut send = call(
        Library::Nccl,
        "ncclSend",
        PID,
        30_000,
        CallArgs::SendRecv(SendRecvArgs {
            direction: Direction::Send,
            buf: 0x30,
            count: 4,
            dtype: DataType::Fp32,
            bytes: Some(16),
            peer: 0,
            comm: 0x5500,
            stream: Some(0x99),
        }),
    );
    send.comm = Some(comm(None));
    out.push(send);
    let mut malloc = call(
        Library::Cudart,
        "cudaMalloc",
        PID,
        40_000,
        CallArgs::Malloc(AllocArgs {
            size: 4096,
            ptr: Some(0xd000),
            stream: None,
        }),
    );
    malloc.memory = Some(MemoryEffect {
        device: device(),
        delta: 4096,
        held_after: 8192,
        failed_request: None,
        untracked: false,
        site: Some(3),
    });
    out.push(malloc);
    let mut free = call(
        Library::Cudart,
        "cudaFree",
        WORKER,
        50_000,
        CallArgs::Free {
            ptr: 0xc000,
            stream: None,
        },
    );
    free.memory = Some(MemoryEffect {
        device: device(),
        delta: 0,
        held_after: 8192,
        failed_request: None,
        untracked: true,
        site: None,
    });
    out.push(free);
    let mut failed = call(
        Library::Cudart,
        "cudaMalloc",
        PID,
        60_000,
        CallArgs::Malloc(AllocArgs {
            size: 1 << 40,
            ptr: None,
            stream: None,
        }),
    );
    failed.ret = Some(2);
    failed.error = true;
    failed.memory = Some(MemoryEffect {
        device: device(),
        delta: 0,
        held_after: 8192,
        failed_request: Some(1 << 40),
        untracked: false,
        site: None,
    });
    out.push(failed);
    // A sync carries the process's launches so far, as the kernel counted
    // them: step windows take their launches from these.
    let mut sync = call(
        Library::Cudart,
        "cudaStreamSynchronize",
        PID,
        70_000,
        CallArgs::Sync {
            stream: Some(0x99),
            event: None,
        },
    );
    sync.launches = Some(xpuscope_common::uprobe::LaunchCounts {
        kernels: 12_345,
        graphs: 7,
    });
    out.push(sync);
    out.push(call(
        Library::Cudart,
        "cudaLaunchKernel",
        WORKER,
        80_000,
        CallArgs::Launch(LaunchArgs {
            func: 0xf00,
            grid: Some([4, 2, 1]),
            block: Some([256, 1, 1]),
            blocks: None,
            shared_mem: Some(0),
            stream: Some(0x99),
            kernel: Some("vectorAdd".into()),
        }),
    ));
    out.push(call(
        Library::Cuda,
        "cuLaunchKernel",
        WORKER,
        81_000,
        CallArgs::Launch(LaunchArgs {
            func: 0xf00d_0000,
            grid: Some([8, 1, 1]),
            block: Some([128, 1, 1]),
            blocks: None,
            shared_mem: Some(1024),
            stream: Some(0x99),
            kernel: Some("gemm_bf16_tn".into()),
        }),
    ));
    out.push(call(
        Library::Cuda,
        "cuModuleGetFunction",
        WORKER,
        82_000,
        CallArgs::KernelHandle(KernelHandleArgs {
            kind: HandleKind::ModuleFunction,
            name: Some("gemm_bf16_tn".into()),
            handle: Some(0xf00d_0000),
            from: None,
        }),
    ));
    out.push(call(
        Library::Cuda,
        "cuMemMap",
        WORKER,
        83_000,
        CallArgs::Vmm(VmmArgs {
            op: VmmOp::Map,
            ptr: Some(0x3000_0000_0000),
            size: Some(2 << 20),
            handle: Some(0x2000_0000_0000),
            offset: Some(0),
        }),
    ));
    out.push(call(
        Library::Cudart,
        "cudaMemcpyAsync",
        WORKER,
        90_000,
        CallArgs::Memcpy(MemcpyArgs {
            dst: 0xd000,
            src: 0x1000,
            bytes: 64,
            kind: MemcpyKind::HostToDevice,
            stream: Some(0x99),
        }),
    ));
    out.push(call(
        Library::Mspti,
        "mstxRangeStartA",
        PID,
        100_000,
        CallArgs::Marker {
            message: Some("step 12".into()),
            range_id: Some(5),
        },
    ));
    let mut records: Vec<DeviceCallRecord> = out.into_iter().map(DeviceCallRecord::new).collect();
    records[3].site = Some(site(3, "alloc < forward < main"));
    records[5].site = Some(site(9, "big < forward < main"));
    records[5].oom = Some(vec![LiveSiteRow {
        device: device(),
        bytes: 8192,
        allocations: 2,
        site: Some(site(3, "alloc < forward < main")),
    }]);
    records[7].flows = vec![77];
    records
}

/// A switch on CPU 0 from `prev` (left in report state `state`: 0, R, or
/// 1, S, whose raw states report as themselves) to `next`.
fn switch(ts: u64, prev: u32, state: i64, next: u32, next_comm: &str) -> Record {
    assert!(
        state == 0 || state == 1,
        "raw state {state} reports otherwise"
    );
    Record::Switch {
        switch: Switch {
            cpu: 0,
            ts,
            prev_tid: prev,
            prev_tgid: prev,
            prev_comm: Comm::from_str_lossy("prev"),
            prev_state: state as u32,
            prev_prio: 120,
            next_tid: next,
            next_tgid: next,
            next_comm: Comm::from_str_lossy(next_comm),
            next_prio: 120,
            preempt: false,
            prev_target: prev == PID,
            next_target: next == PID,
            stack_follows: false,
        },
    }
}

/// Records of every kind the reader gives back, in the order the sink
/// takes them, and what they are made of.
pub(super) struct Recording {
    identity: RankIdentity,
    calls: Vec<DeviceCallRecord>,
    hung: DeviceCall,
    step: StepSeen,
    marker: EnqueueMarker,
    work: DeviceWork,
    exit: Exit,
    off_cpu: [OffCpuInterval; 2],
    pub(super) written: Vec<Record>,
}

pub(super) fn recording() -> Recording {
    let identity = RankIdentity {
        rank: Some("1".into()),
        local_rank: Some("1".into()),
        world_size: Some("2".into()),
        job: Some("sim".into()),
    };
    let calls = calls();
    let mut hung = call(
        Library::Nccl,
        "ncclAllReduce",
        WORKER,
        110_000,
        CallArgs::None,
    );
    hung.end_ts = None;
    hung.ret = None;
    hung.comm = Some(comm(Some(9)));
    hung.args = CallArgs::Collective(CollectiveArgs {
        op: Collective::AllReduce,
        count: Some(1),
        dtype: Some(DataType::Fp32),
        bytes: Some(4),
        red_op: Some(RedOp::Max),
        root: None,
        send: Some(1),
        recv: Some(2),
        comm: 0x5500,
        stream: Some(0x99),
    });
    let mut died = DeviceCallRecord::new(hung.clone());
    died.unmatched = Some(OpenReason::ProcessExited);
    let step = StepSeen {
        tgid: PID,
        tid: PID,
        ts: 105_000,
        local: "global_step",
        step: 12,
    };
    let marker = EnqueueMarker {
        tgid: PID,
        tid: WORKER,
        ts: 80_500,
        correlation: 4,
        flow: 77,
    };
    let work = DeviceWork {
        track: StreamTrack {
            tgid: PID,
            name: "GPU 1 stream 153".into(),
            estimated: false,
        },
        kind: WorkKind::Compute,
        start: 82_000,
        end: 85_000,
        name: "gemm_kernel".into(),
        fields: vec![Field::new("correlation_id", FieldValue::Uint(4))],
        flows: vec![77],
    };
    let exit = Exit {
        cpu: 0,
        ts: 200_000,
        tid: PID,
        tgid: PID,
        prio: 0,
        comm: Comm::from_str_lossy("python3"),
        group_dead: true,
        group_known: true,
        exit_code: Some(9),
    };

    // The rank's main thread: asleep 2000..5000, then preempted by a
    // task the trace knows nothing of 6000..7000.
    let mut written = vec![
        Record::Identity {
            tgid: PID,
            identity: Box::new(identity.clone()),
        },
        switch(1_000, 0, 0, PID, "python3"),
        switch(2_000, PID, 1, 0, "swapper/0"),
        switch(5_000, 0, 0, PID, "python3"),
        switch(6_000, PID, 0, 555, "hog"),
        switch(7_000, 555, 0, PID, "python3"),
    ];
    let off_cpu = [
        OffCpuInterval {
            tid: PID,
            tgid: PID,
            cpu: 0,
            start: 2_000,
            end: 5_000,
            state: 1,
            stack: None,
            preempted_by: None,
            truncated: false,
        },
        OffCpuInterval {
            tid: PID,
            tgid: PID,
            cpu: 0,
            start: 6_000,
            end: 7_000,
            state: 0,
            stack: None,
            preempted_by: Some(Preemptor {
                tid: 555,
                tgid: 555,
                comm: Comm::from_str_lossy("hog"),
                in_job: false,
            }),
            truncated: false,
        },
    ];
    written.extend(
        calls
            .iter()
            .cloned()
            .map(|c| Record::DeviceCall(Box::new(c))),
    );
    written.push(Record::Enqueued(marker.clone()));
    written.push(Record::DeviceWork(Box::new(work.clone())));
    written.push(Record::StepSeen(step));
    written.push(Record::DeviceCall(Box::new(died)));
    written.push(Record::Exit {
        exit,
        process_ended: true,
    });
    written.sort_by_key(|r| match r {
        Record::DeviceCall(c) => c.call.start_ts,
        Record::Enqueued(m) => m.ts,
        Record::DeviceWork(w) => w.start,
        Record::StepSeen(s) => s.ts,
        Record::Exit { exit, .. } => exit.ts,
        Record::Switch { switch, .. } => switch.ts,
        _ => 0,
    });
    Recording {
        identity,
        calls,
        hung,
        step,
        marker,
        work,
        exit,
        off_cpu,
        written,
    }
}

/// The trace the Perfetto sink writes of `records`.
pub(super) fn trace_of(records: &[Record]) -> Vec<u8> {
    let mut sink = PerfettoSink::new(TraceWriter::new(Vec::new()));
    for r in records {
        sink.record(r).unwrap();
    }
    sink.finish_trace(300_000, &SinkCounters::default())
        .unwrap()
        .out
}

#[test]
fn records_come_back_from_the_trace_they_wrote() {
    let Recording {
        identity,
        calls,
        hung,
        step,
        marker,
        work,
        exit,
        off_cpu,
        written,
    } = recording();
    let trace = trace_of(&written);

    let mut read = Vec::new();
    let mut open = Vec::new();
    TraceRecords::default()
        .read_bytes(&trace, |p| p as u32, &mut read, &mut open)
        .unwrap();

    // The identity, whole.
    let ids: Vec<&RankIdentity> = read
        .iter()
        .filter_map(|(_, r)| match r {
            Record::Identity {
                tgid: PID,
                identity,
            } => Some(&**identity),
            _ => None,
        })
        .collect();
    assert_eq!(ids, [&identity]);

    // Every call with every argument, communicator and memory effect, at
    // its end. Not carried: the call's stack id (`DeviceCall::site`) and
    // an allocation site's frames (its id and name come back).
    let read_calls: Vec<&DeviceCallRecord> = read
        .iter()
        .filter_map(|(ts, r)| match r {
            Record::DeviceCall(c) => {
                assert_eq!(Some(*ts), c.call.end_ts, "handed on at its end");
                Some(&**c)
            }
            _ => None,
        })
        .collect();
    assert_eq!(read_calls.len(), calls.len(), "one record per call");
    for want in &calls {
        let got = read_calls
            .iter()
            .find(|c| c.call.tid == want.call.tid && c.call.start_ts == want.call.start_ts)
            .unwrap_or_else(|| panic!("{} read back", want.call.name));
        assert_eq!(got.call, want.call, "{}", want.call.name);
        let label = |s: &Option<Arc<Site>>| s.as_ref().map(|s| s.label.clone());
        assert_eq!(label(&got.site), label(&want.site), "{}", want.call.name);
        if want.call.memory.is_some_and(|m| m.delta > 0) {
            assert_eq!(
                got.site.as_ref().map(|s| s.id),
                want.site.as_ref().map(|s| s.id)
            );
        }
        let rows = |r: &Option<Vec<LiveSiteRow>>| {
            r.as_ref().map(|rows| {
                rows.iter()
                    .map(|r| (r.device, r.bytes, r.allocations, label(&r.site)))
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(rows(&got.oom), rows(&want.oom), "{}", want.call.name);
        assert_eq!(got.unmatched, None);
    }

    // The call its process died in comes back as in flight until then.
    let open: Vec<(&DeviceCall, bool)> = open
        .iter()
        .map(|OpenAtEnd { call, died }| (call, *died))
        .collect();
    assert_eq!(open, [(&hung, true)]);

    // The step counter, the enqueue marker and the work it led to (the
    // work's track name without its lane, and its fields).
    let steps: Vec<&StepSeen> = read
        .iter()
        .filter_map(|(_, r)| match r {
            Record::StepSeen(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(steps, [&step]);
    let markers: Vec<&EnqueueMarker> = read
        .iter()
        .filter_map(|(_, r)| match r {
            Record::Enqueued(m) => Some(m),
            _ => None,
        })
        .collect();
    assert_eq!(markers, [&marker]);
    let works: Vec<&DeviceWork> = read
        .iter()
        .filter_map(|(_, r)| match r {
            Record::DeviceWork(w) => Some(&**w),
            _ => None,
        })
        .collect();
    assert_eq!(works, [&work]);

    // The main thread's time off CPU, from the scheduler's switches, each
    // at its end.
    let mut intervals: Vec<&OffCpuInterval> = read
        .iter()
        .filter_map(|(ts, r)| match r {
            Record::OffCpu(i) => {
                assert_eq!(*ts, i.end);
                Some(i)
            }
            _ => None,
        })
        .collect();
    intervals.sort_by_key(|i| i.start);
    assert_eq!(intervals, off_cpu.iter().collect::<Vec<_>>());

    // The process's end. Not carried: the CPU and priority of its last
    // thread's exit, and whether the kernel said it was the last (a
    // process track's exit instant is the process's end).
    let exits: Vec<&Exit> = read
        .iter()
        .filter_map(|(_, r)| match r {
            Record::Exit {
                exit,
                process_ended: true,
            } => Some(exit),
            _ => None,
        })
        .collect();
    assert_eq!(exits, [&exit]);
}
