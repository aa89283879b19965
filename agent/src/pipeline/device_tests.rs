//! Tests of device-call interpretation and rendering, decoded back
//! independently.

use xpuscope_common::EventHeader;
use xpuscope_common::uprobe::{UprobeEntry, UprobeReturn};
use xpuscope_probes::activity::{ActivityDetail, ActivityKind};
use xpuscope_probes::catalog::{CallKind, LaunchKind, Library, SyncKind};
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::table::ProbeTarget;
use xpuscope_probes::decode::{ActivityEvent, Decoded, DeviceCall};
use xpuscope_tests::trace_check::{Timeline, TrackKind, check_importer_rules, decode};

use super::testing::TestPipeline;
use crate::events::Event;
use crate::kernel::probes::TableUpdate;
use crate::model::{RankIdentity, Record};

fn entry(ts: u64, ip: u64, args: [u64; 6]) -> Event {
    Event::ProbeEntry(Box::new(UprobeEntry {
        header: EventHeader {
            kind: 0,
            cpu: 0,
            ts,
        },
        tid: 43,
        tgid: 42,
        probe_ip: ip,
        args,
        sp: 0,
        stack: [0; 8],
        deref_len: 0,
        slot: 0,
        deref: [0; 128],
    }))
}

fn ret(ts: u64, ip: u64, rax: u64, out: &[u8]) -> Event {
    let mut deref = [0u8; 128];
    deref[..out.len()].copy_from_slice(out);
    Event::ProbeReturn(Box::new(UprobeReturn {
        header: EventHeader {
            kind: 0,
            cpu: 0,
            ts,
        },
        tid: 43,
        tgid: 42,
        probe_ip: ip,
        ret: rax,
        deref_len: out.len() as u32,
        slot: 0,
        launches: Default::default(),
        deref,
    }))
}

/// Calls become named slices with arguments on the thread's track,
/// errors are marked, memory is a counter, unmatched records counted.
#[test]
fn device_calls_become_slices_and_counters() {
    let mut b = builder();
    let target = |lib: Library, f: &str| ProbeTarget {
        library: lib,
        function: lib.function(f).unwrap(),
        sp_delta: 0,
    };
    b.probes_added(TableUpdate {
        tgid: 42,
        probes: vec![
            (0x1000, 1, target(Library::Nccl, "ncclAllReduce")),
            (0x2000, 2, target(Library::Cudart, "cudaMalloc")),
        ],
        identity: RankIdentity::from_environ(b"RANK=1\0WORLD_SIZE=2\0XPUSCOPE_JOB=j\0"),
        maps: Default::default(),
    });
    let events = vec![
        entry(1_000, 0x1000, [0xa000, 0xb000, 32 << 20, 9, 0, 0xc0c0]),
        ret(9_000, 0x1000, 0, &[]),
        entry(10_000, 0x2000, [0x7000, 1 << 20, 0, 0, 0, 0]),
        ret(11_000, 0x2000, 0, &0x2000_0000_0000u64.to_le_bytes()),
        entry(12_000, 0x2000, [0x7000, 1 << 40, 0, 0, 0, 0]),
        ret(13_000, 0x2000, 2, &[]),
        ret(14_000, 0x1000, 0, &[]),
    ];
    for e in events {
        b.handle(e);
    }
    let (bytes, stats) = b.finish(20_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let names: Vec<&str> = tl
        .slices_on_thread(43)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(
        names,
        vec![
            "ncclAllReduce 64 MiB bf16 sum",
            "cudaMalloc 1 MiB",
            "cudaMalloc 1 TiB [error 2]"
        ]
    );
    let reduce = tl.slices_on_thread(43)[0];
    assert_eq!((reduce.ts, reduce.end), (1_000, Some(9_000)));
    let arg = |n: &str| {
        reduce
            .args
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.to_string())
    };
    assert_eq!(arg("seq").as_deref(), Some("0"));
    assert_eq!(arg("dtype").as_deref(), Some("bf16"));
    assert_eq!(
        tl.counter_values("device memory dev0"),
        vec![1048576.0, 1048576.0]
    );
    let marks = tl.instants_on_thread(43);
    assert!(
        marks.iter().any(|(n, _)| n == "cudaMalloc failed"),
        "{marks:?}"
    );
    let p = &tl.processes[&42];
    assert_eq!(p.name.as_deref(), Some("rank 1/2 job j"));
    assert_eq!(stats.device.calls, 3);
    assert_eq!(stats.device.errors, 1);
    assert_eq!(stats.device.returns_without_entry, 1);
}

/// A process whose calls hit probes attached by file before its own plan
/// came (a new rank of a job whose libraries are probed already, on a
/// loaded machine): its identity is read at its first call, so its track
/// and every sink name it by its rank from that call on, and the plan's
/// later identity is not sent again.
#[test]
fn calls_decoded_by_slot_before_the_plan_carry_the_process_identity() {
    let identity = RankIdentity::from_environ(b"RANK=1\0WORLD_SIZE=2\0XPUSCOPE_JOB=j\0");
    let mut b = TestPipeline::with_identities([(42, identity.clone())].into());
    let target = ProbeTarget {
        library: Library::Nccl,
        function: Library::Nccl.function("ncclAllReduce").unwrap(),
        sp_delta: 0,
    };
    b.slots_added(vec![(5, target)]);
    let slotted = |e: Event| match e {
        Event::ProbeEntry(mut x) => {
            x.slot = 5;
            Event::ProbeEntry(x)
        }
        Event::ProbeReturn(mut x) => {
            x.slot = 5;
            Event::ProbeReturn(x)
        }
        other => other,
    };
    b.handle(slotted(entry(
        1_000,
        0x1000,
        [0xa000, 0xb000, 32 << 20, 9, 0, 0xc0c0],
    )));
    b.handle(slotted(ret(9_000, 0x1000, 0, &[])));
    b.probes_added(TableUpdate {
        tgid: 42,
        probes: vec![(0x1000, 5, target)],
        identity,
        maps: Default::default(),
    });
    b.handle(entry(
        10_000,
        0x1000,
        [0xa000, 0xb000, 32 << 20, 9, 0, 0xc0c0],
    ));
    b.handle(ret(12_000, 0x1000, 0, &[]));
    let records = b.records();
    let identities: Vec<usize> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r, Record::Identity { tgid: 42, .. }))
        .map(|(i, _)| i)
        .collect();
    let first_call = records
        .iter()
        .position(|r| matches!(r, Record::DeviceCall(_)))
        .expect("the calls");
    assert_eq!(identities.len(), 1, "one identity: {records:?}");
    assert!(identities[0] < first_call, "before the first call");
    let (bytes, stats) = b.finish(20_000);
    assert_eq!(stats.device.calls, 2);
    let tl = Timeline::new(&decode(&bytes).unwrap());
    assert_eq!(tl.processes[&42].name.as_deref(), Some("rank 1/2 job j"));
}

/// A rank's step splits are two counters on its process track; one the
/// detect sink feeds back after the rank exited is drawn on that track
/// too, not on a new one without the rank's name.
#[test]
fn step_splits_are_counters_on_the_rank_s_track_even_after_its_exit() {
    use crate::events::{Comm, Exit};
    use crate::model::{StepSplit, StepSplitRecord};
    let identity = RankIdentity::from_environ(b"RANK=1\0WORLD_SIZE=2\0XPUSCOPE_JOB=j\0");
    let mut b = TestPipeline::with_identities([(42, identity)].into());
    let target = ProbeTarget {
        library: Library::Nccl,
        function: Library::Nccl.function("ncclAllReduce").unwrap(),
        sp_delta: 0,
    };
    b.slots_added(vec![(5, target)]);
    b.probes_added(TableUpdate {
        tgid: 42,
        probes: vec![(0x1000, 5, target)],
        identity: RankIdentity::from_environ(b"RANK=1\0WORLD_SIZE=2\0XPUSCOPE_JOB=j\0"),
        maps: Default::default(),
    });
    b.handle(entry(
        1_000,
        0x1000,
        [0xa000, 0xb000, 32 << 20, 9, 0, 0xc0c0],
    ));
    b.handle(ret(9_000, 0x1000, 0, &[]));
    let split = |step: u64, host: u64| {
        Record::StepSplit(Box::new(StepSplitRecord {
            tgid: 42,
            step,
            start: step * 100_000,
            end: (step + 1) * 100_000,
            split: StepSplit {
                dur: 100_000,
                in_device_calls: 100_000 - host,
                host,
                ..StepSplit::default()
            },
            launches: None,
        }))
    };
    b.deliver_records(vec![split(1, 20_000)]);
    b.handle(Event::Exit(Exit {
        cpu: 0,
        ts: 300_000,
        tid: 42,
        tgid: 42,
        prio: 120,
        comm: Comm::from_str_lossy("rank"),
        group_dead: true,
        group_known: true,
        exit_code: None,
    }));
    b.deliver_records(vec![split(2, 70_000)]);
    let (bytes, _) = b.finish(400_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let named: Vec<_> = tl
        .tracks
        .values()
        .filter(|t| matches!(&t.kind, TrackKind::Process { pid: 42, .. }))
        .collect();
    assert_eq!(named.len(), 1, "one process track: {named:?}");
    assert_eq!(tl.processes[&42].name.as_deref(), Some("rank 1/2 job j"));
    assert_eq!(tl.counter_values("step host work %"), vec![20.0, 70.0]);
    assert_eq!(tl.counter_values("step device wait %"), vec![80.0, 30.0]);
    let parents: Vec<_> = tl
        .tracks
        .values()
        .filter(|t| t.name.as_deref() == Some("step host work %"))
        .map(|t| t.parent)
        .collect();
    assert_eq!(parents, vec![Some(named[0].uuid)]);
}

fn builder() -> TestPipeline {
    TestPipeline::new()
}

fn record(
    tgid: u32,
    kind: ActivityKind,
    (start, end): (u64, u64),
    stream: Option<u64>,
    corr: u64,
    name_ptr: Option<u64>,
    detail: ActivityDetail,
) -> Decoded {
    use xpuscope_probes::activity::{ActivityApi, DeviceActivity};
    Decoded::Activity(ActivityEvent {
        tgid,
        tid: 43,
        ts: 100_000,
        library: Library::Cupti,
        activity: DeviceActivity {
            api: ActivityApi::Cupti,
            kind,
            raw_kind: 0,
            start,
            end,
            device: stream.map(|_| 0),
            stream,
            correlation_id: Some(corr),
            name_ptr,
            detail,
        },
    })
}

fn api(tgid: u32, start: u64, corr: u64) -> Decoded {
    record(
        tgid,
        ActivityKind::Api,
        (start, start + 50),
        None,
        corr,
        None,
        ActivityDetail::Api {
            cbid: Some(211),
            pid: tgid,
            tid: 43,
            ret: Some(0),
        },
    )
}

/// Activity records, late and out of order, become slices on
/// per-stream tracks in start order (overlaps on a second lane), named
/// by the kernel name read from the application, with a flow from the
/// host call their API record matches.
#[test]
fn activity_records_become_device_stream_slices_with_flows() {
    let pid = std::process::id();
    let kname = std::ffi::CString::new("sgemm_128x64").unwrap();
    let ptr = kname.as_ptr() as u64;
    let launch = ActivityDetail::Launch {
        grid: [8, 1, 1],
        block: [128, 1, 1],
        static_shared: 0,
        dynamic_shared: 0,
    };
    let mut b = builder();
    let mut out = vec![
        api(pid, 1_000, 1),
        api(pid, 2_000, 2),
        // Out of order, and 2 overlaps 1.
        record(
            pid,
            ActivityKind::Kernel,
            (6_000, 7_000),
            Some(7),
            2,
            None,
            launch,
        ),
        record(
            pid,
            ActivityKind::Kernel,
            (5_000, 9_000),
            Some(7),
            1,
            Some(ptr),
            launch,
        ),
        record(
            pid,
            ActivityKind::Kernel,
            (9_500, 9_800),
            Some(7),
            9,
            Some(ptr),
            launch,
        ),
        record(
            pid,
            ActivityKind::Memcpy,
            (3_000, 4_000),
            Some(8),
            3,
            None,
            ActivityDetail::Memcpy {
                bytes: 4096,
                kind: xpuscope_probes::decode::enums::MemcpyKind::HostToDevice,
            },
        ),
    ];
    b.emit(&mut out);
    let (bytes, stats) = b.finish(20_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let s7 = tl.track_named("GPU 0 stream 7").expect("stream track");
    let lane2 = tl.track_named("GPU 0 stream 7 #2").expect("lane track");
    let process = tl
        .tracks
        .values()
        .find(|t| matches!(t.kind, TrackKind::Process { pid: p, .. } if p == pid as i32))
        .unwrap();
    assert_eq!(s7.parent, Some(process.uuid));
    let on7: Vec<(u64, Option<u64>, &str)> = tl
        .slices_on(s7.uuid)
        .iter()
        .map(|s| (s.ts, s.end, s.name.as_str()))
        .collect();
    assert_eq!(
        on7,
        vec![
            (5_000, Some(9_000), "sgemm_128x64"),
            (9_500, Some(9_800), "sgemm_128x64")
        ]
    );
    let on2 = tl.slices_on(lane2.uuid);
    assert_eq!((on2[0].ts, on2[0].end), (6_000, Some(7_000)));
    assert_eq!(on2[0].name, "kernel");
    let first = tl.slices_on(s7.uuid)[0];
    let arg = |n: &str| {
        first
            .args
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.to_string())
    };
    assert_eq!(arg("correlation_id").as_deref(), Some("1"));
    assert_eq!(arg("stream").as_deref(), Some("7"));
    assert_eq!(arg("grid").as_deref(), Some("(8,1,1)"));
    let copy = tl.slices_on(tl.track_named("GPU 0 stream 8").unwrap().uuid)[0];
    assert_eq!(copy.name, "memcpy HostToDevice 4096 B");
    // Flows: host (API record's start on thread 43) -> device slice.
    let host = tl.slices_on_thread(43);
    assert_eq!(host.len(), 2, "{host:?}");
    assert_eq!(host[0].ts, 1_000);
    assert_eq!(host[0].flow_ids.len(), 1);
    assert_eq!(first.terminating_flow_ids, host[0].flow_ids);
    assert_eq!(on2[0].terminating_flow_ids, host[1].flow_ids);
    assert_ne!(host[0].flow_ids, host[1].flow_ids);
    // No API record: no flow.
    assert!(copy.terminating_flow_ids.is_empty());
    assert_eq!(stats.device.device_slices, 4);
    assert_eq!(stats.device.device_flows, 2);
    assert_eq!(stats.device.estimated_slices, 0);
}

fn call(kind: CallKind, args: CallArgs, (start, end): (u64, u64)) -> Decoded {
    Decoded::Call(DeviceCall {
        library: Library::Cudart,
        function: "f",
        kind,
        tgid: 42,
        tid: 43,
        start_ts: start,
        end_ts: Some(end),
        args,
        ret: Some(0),
        error: false,
        name: "f".into(),
        comm: None,
        memory: None,
        site: None,
        launches: None,
    })
}

fn launch(stream: u64, ts: u64) -> Decoded {
    use xpuscope_probes::decode::args::LaunchArgs;
    call(
        CallKind::Launch(LaunchKind::Kernel),
        CallArgs::Launch(LaunchArgs {
            func: 0x1234,
            grid: None,
            block: None,
            blocks: None,
            shared_mem: None,
            stream: Some(stream),
            kernel: None,
        }),
        (ts, ts + 100),
    )
}

/// Without activity records: launch to the next sync of the stream,
/// labelled as estimated; a device sync closes every stream.
#[test]
fn launches_and_syncs_become_estimated_device_slices() {
    let mut b = builder();
    let sync = |stream: Option<u64>, kind, ts: u64| {
        call(
            CallKind::Sync(kind),
            CallArgs::Sync {
                stream,
                event: None,
            },
            (ts, ts + 1_000),
        )
    };
    let mut out = vec![
        call(
            CallKind::SetDevice,
            CallArgs::SetDevice { device: 1 },
            (10, 20),
        ),
        launch(0x10, 1_000),
        launch(0x10, 2_000),
        launch(0x20, 2_500),
        sync(Some(0x10), SyncKind::Stream, 3_000),
        launch(0x10, 5_000),
        sync(None, SyncKind::Device, 6_000),
    ];
    b.emit(&mut out);
    let (bytes, stats) = b.finish(20_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let t = tl.track_named("GPU 1 stream 0x10 (estimated)").unwrap();
    let got: Vec<(u64, Option<u64>, &str)> = tl
        .slices_on(t.uuid)
        .iter()
        .map(|s| (s.ts, s.end, s.name.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            (1_000, Some(4_000), "estimated: 2 kernels"),
            (5_000, Some(7_000), "estimated: 1 kernels")
        ]
    );
    let s = tl.slices_on(t.uuid)[0];
    assert!(
        s.args
            .iter()
            .any(|(k, v)| k == "estimated" && v.to_string() == "true"),
        "{s:?}"
    );
    let t2 = tl.track_named("GPU 1 stream 0x20 (estimated)").unwrap();
    assert_eq!(tl.slices_on(t2.uuid)[0].end, Some(7_000));
    assert_eq!(stats.device.estimated_slices, 3);
}

/// Once a process produces API records, its launches wait for theirs:
/// the flow starts on the launch slice itself.
#[test]
fn flow_starts_on_the_launch_slice() {
    let mut b = builder();
    let mut out = vec![
        api(42, 500, 1),
        launch(0x10, 1_000),
        launch(0x10, 2_000),
        api(42, 2_010, 3),
        record(
            42,
            ActivityKind::Kernel,
            (3_000, 3_500),
            Some(7),
            3,
            None,
            ActivityDetail::None,
        ),
        record(
            42,
            ActivityKind::Kernel,
            (2_500, 2_900),
            Some(7),
            2,
            None,
            ActivityDetail::None,
        ),
    ];
    b.emit(&mut out);
    let (bytes, stats) = b.finish(20_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let host = tl.slices_on_thread(43);
    let names: Vec<(&str, u64)> = host.iter().map(|s| (s.name.as_str(), s.ts)).collect();
    // The first launch had no API record: written without a flow.
    assert_eq!(names, vec![("f", 1_000), ("f", 2_000)]);
    assert!(host[0].flow_ids.is_empty());
    assert_eq!(host[1].flow_ids.len(), 1);
    let t = tl.track_named("GPU 0 stream 7").unwrap();
    let dev = tl.slices_on(t.uuid);
    assert!(dev[0].terminating_flow_ids.is_empty());
    assert_eq!(dev[1].terminating_flow_ids, host[1].flow_ids);
    assert_eq!(stats.device.device_flows, 1);
}

/// A process whose consumer reads kernel and API records but no copy
/// records (as MSPTI consumers do): its copies are written at once,
/// without a flow that no device slice would end; its launches still wait
/// for their API record.
#[test]
fn copies_without_copy_records_carry_no_flow() {
    let mut b = builder();
    let mut out = vec![
        api(42, 500, 1),
        call(CallKind::Memcpy, CallArgs::None, (1_000, 1_100)),
        api(42, 1_010, 5),
        launch(0x10, 2_000),
        api(42, 2_010, 6),
        record(
            42,
            ActivityKind::Kernel,
            (2_500, 2_900),
            Some(7),
            6,
            None,
            ActivityDetail::None,
        ),
    ];
    b.emit(&mut out);
    let (bytes, stats) = b.finish(20_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let host = tl.slices_on_thread(43);
    assert_eq!(host.len(), 2, "{host:?}");
    assert!(host[0].flow_ids.is_empty(), "the copy: {:?}", host[0]);
    assert_eq!(host[1].flow_ids.len(), 1, "the launch");
    let t = tl.track_named("GPU 0 stream 7").unwrap();
    assert_eq!(
        tl.slices_on(t.uuid)[0].terminating_flow_ids,
        host[1].flow_ids
    );
    assert_eq!(stats.device.device_flows, 1);
}

/// A process with activity records gets no estimates.
#[test]
fn no_estimates_with_activity_records() {
    let mut b = builder();
    let mut out = vec![
        launch(0x10, 1_000),
        api(42, 1_010, 1),
        record(
            42,
            ActivityKind::Kernel,
            (1_500, 1_800),
            Some(7),
            1,
            None,
            ActivityDetail::None,
        ),
        call(
            CallKind::Sync(SyncKind::Stream),
            CallArgs::Sync {
                stream: Some(0x10),
                event: None,
            },
            (2_000, 3_000),
        ),
    ];
    b.emit(&mut out);
    let (bytes, stats) = b.finish(20_000);
    let tl = Timeline::new(&decode(&bytes).unwrap());
    assert!(
        tl.tracks
            .values()
            .all(|t| { !t.name.as_deref().unwrap_or("").contains("estimated") })
    );
    assert_eq!(stats.device.estimated_slices, 0);
    assert_eq!(stats.device.device_slices, 1);
}

/// A thread's track is described once however many calls it makes, and
/// call arguments are named fields, not debug text.
#[test]
fn a_calling_thread_is_described_once_and_arguments_are_named() {
    let mut b = builder();
    let function = Library::Cudart.function("cudaStreamSynchronize").unwrap();
    b.probes_added(TableUpdate {
        tgid: 42,
        probes: vec![(
            0x3000,
            3,
            ProbeTarget {
                library: Library::Cudart,
                function,
                sp_delta: 0,
            },
        )],
        identity: RankIdentity::default(),
        maps: Default::default(),
    });
    for i in 0..100u64 {
        b.handle(entry(1_000 + i * 100, 0x3000, [0x5000, 0, 0, 0, 0, 0]));
        b.handle(ret(1_050 + i * 100, 0x3000, 0, &[]));
    }
    let (bytes, stats) = b.finish(20_000);
    assert_eq!(stats.device.calls, 100);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let descriptors = trace
        .packet
        .iter()
        .filter(|p| {
            p.has_track_descriptor()
                && p.track_descriptor()
                    .thread
                    .as_ref()
                    .is_some_and(|t| t.tid() == 43)
        })
        .count();
    assert_eq!(descriptors, 1, "one descriptor for thread 43's track");
    let tl = Timeline::new(&trace);
    let sync = tl.slices_on_thread(43)[0];
    let names: Vec<&str> = sync.args.iter().map(|(k, _)| k.as_str()).collect();
    assert!(names.contains(&"stream"), "{names:?}");
    assert!(
        sync.args
            .iter()
            .all(|(k, v)| k != "args" && !v.to_string().contains('{')),
        "{:?}",
        sync.args
    );
}

/// A collective still running shows in the in-flight snapshot with its
/// communicator and its thread's state (launches never do); once it
/// returned, one empty snapshot says so, then none. A finding renders as
/// a slice on the `xpuscope findings` track with its arguments.
#[test]
fn running_collectives_are_snapshotted_and_findings_rendered() {
    use crate::model::{Finding, FindingKind, Record, ThreadNow};
    let mut b = builder();
    let target = |lib: Library, f: &str| ProbeTarget {
        library: lib,
        function: lib.function(f).unwrap(),
        sp_delta: 0,
    };
    b.probes_added(TableUpdate {
        tgid: 42,
        probes: vec![
            (0x1000, 1, target(Library::Nccl, "ncclAllReduce")),
            (0x3000, 3, target(Library::Cudart, "cudaLaunchKernel")),
        ],
        identity: RankIdentity::from_environ(b"RANK=1\0WORLD_SIZE=2\0XPUSCOPE_JOB=j\0"),
        maps: Default::default(),
    });
    assert!(b.in_flight(500).is_empty(), "nothing runs: no snapshot");
    b.handle(entry(
        1_000,
        0x1000,
        [0xa000, 0xb000, 32 << 20, 9, 0, 0xc0c0],
    ));
    b.handle(entry(1_500, 0x3000, [0; 6]));
    let snap = b.in_flight(2_000);
    let [Record::InFlight(s)] = snap.as_slice() else {
        panic!("{snap:?}")
    };
    assert_eq!(s.ts, 2_000);
    assert_eq!(s.calls.len(), 1, "the launch is not a blocking call");
    let c = &s.calls[0];
    assert_eq!(
        (c.tgid, c.tid, c.function, c.start_ts),
        (42, 43, "ncclAllReduce", 1_000)
    );
    let cc = c.comm.expect("the communicator");
    assert_eq!((cc.handle, cc.seq), (0xc0c0, Some(0)));
    assert_eq!(c.thread, ThreadNow::Unknown, "no scheduling seen for it");
    b.handle(ret(1_600, 0x3000, 0, &[]));
    b.handle(ret(9_000, 0x1000, 0, &[]));
    let snap = b.in_flight(10_000);
    assert!(
        matches!(snap.as_slice(), [Record::InFlight(s)] if s.calls.is_empty()),
        "{snap:?}"
    );
    assert!(b.in_flight(11_000).is_empty());
    b.deliver_records(vec![Record::Finding(Box::new(Finding {
        link: Default::default(),
        kind: FindingKind::Hang,
        ranks: vec![0],
        comm: Some("nccl:00000000000000aa".into()),
        seq: Some(4),
        step: None,
        start_ns: 1_000,
        end_ns: None,
        summary: "hang: test".into(),
        evidence: serde_json::json!({"op": "ncclAllReduce", "stuck": [{"rank": 1}]}),
        detected_ns: 8_000,
    }))]);
    let (bytes, _) = b.finish(20_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let track = tl
        .tracks
        .values()
        .find(|t| t.name.as_deref() == Some(crate::sinks::perfetto::FINDINGS_TRACK))
        .expect("the findings track");
    let slices = tl.slices_on(track.uuid);
    assert_eq!(slices.len(), 1);
    let f = slices[0];
    assert_eq!((f.name.as_str(), f.ts, f.end), ("hang", 1_000, Some(8_000)));
    let arg = |n: &str| {
        f.args
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.to_string())
            .unwrap_or_default()
    };
    assert_eq!(arg("comm"), "nccl:00000000000000aa");
    assert_eq!(arg("seq"), "4");
    assert_eq!(arg("ranks"), "0");
    assert_eq!(arg("summary"), "hang: test");
    assert_eq!(arg("evidence.op"), "ncclAllReduce");
}
