//! SystemInfo, clock snapshots, process trees, machine ids.

use xpuscope_perfetto::{ClockSnapshot, ProcessInfo, ThreadInfo, TraceWriter, WriterOptions};
use xpuscope_tests::trace_check::Timeline;

use super::common::*;

#[test]
fn system_info_is_first_with_every_field() {
    let bytes = writer().finish().unwrap();
    let trace = decode_checked(&bytes);
    let p = &trace.packet[0];
    assert!(p.has_system_info());
    let info = p.system_info();
    let uts = info.utsname.as_ref().unwrap();
    assert_eq!(uts.sysname(), "Linux");
    assert_eq!(uts.version(), "#1 SMP PREEMPT_DYNAMIC Debian 6.18.0-1");
    assert_eq!(uts.release(), RELEASE);
    assert_eq!(uts.machine(), "x86_64");
    assert_eq!(info.hz(), 250);
    assert_eq!(info.page_size(), 4096);
    assert_eq!(info.num_cpus(), 2);
    // machine_name = 17 is newer than schema v51: an unknown field.
    match info.special_fields.unknown_fields().get(17) {
        Some(protobuf::UnknownValueRef::LengthDelimited(b)) => assert_eq!(b, b"gpu-node-07"),
        other => panic!("machine_name missing: {other:?}"),
    }
    assert_eq!(p.trusted_packet_sequence_id(), 1);
    assert_eq!(p.machine_id, None);
}

#[test]
fn clock_snapshot_has_boottime_monotonic_realtime() {
    let bytes = writer().finish().unwrap();
    let trace = decode_checked(&bytes);
    let p = &trace.packet[1];
    assert_eq!(p.timestamp(), 1_000);
    let snap = p.clock_snapshot();
    let clocks: Vec<(u32, u64)> = snap
        .clocks
        .iter()
        .map(|c| (c.clock_id(), c.timestamp()))
        .collect();
    assert_eq!(
        clocks,
        [(6, 1_000), (3, 900), (1, 1_700_000_000_000_000_000)]
    );
    assert_eq!(snap.primary_trace_clock.unwrap().value(), 6);
}

#[test]
fn process_tree_round_trips_and_never_drops_a_process() {
    let mut w = writer();
    let processes = [
        ProcessInfo {
            pid: 100,
            ppid: 1,
            cmdline: vec!["python3".into(), "train.py".into()],
            uid: Some(1000),
        },
        ProcessInfo {
            pid: 200,
            ppid: 100,
            cmdline: vec![],
            uid: None,
        },
        ProcessInfo {
            pid: 300,
            ppid: 2,
            cmdline: vec![],
            uid: None,
        },
    ];
    let threads = [
        ThreadInfo {
            tid: 100,
            tgid: 100,
            name: "python3".into(),
        },
        ThreadInfo {
            tid: 101,
            tgid: 100,
            name: "pt_autograd_0".into(),
        },
        ThreadInfo {
            tid: 200,
            tgid: 200,
            name: "nccl-helper".into(),
        },
    ];
    w.process_tree(5_000, &processes, &threads).unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    let p = trace.packet.iter().find(|p| p.has_process_tree()).unwrap();
    assert_eq!(p.timestamp(), 5_000);
    let tree = p.process_tree();
    type Row = (i32, i32, Vec<String>, Option<i32>, bool);
    let got: Vec<Row> = tree
        .processes
        .iter()
        .map(|p| {
            (
                p.pid(),
                p.ppid(),
                p.cmdline.clone(),
                p.uid,
                p.cmdline_is_comm(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                100,
                1,
                vec!["python3".into(), "train.py".into()],
                Some(1000),
                false
            ),
            (200, 100, vec!["nccl-helper".into()], None, true),
            (300, 2, vec!["300".into()], None, true),
        ]
    );
    let threads: Vec<(i32, i32, &str)> = tree
        .threads
        .iter()
        .map(|t| (t.tid(), t.tgid(), t.name()))
        .collect();
    assert_eq!(
        threads,
        [
            (100, 100, "python3"),
            (101, 100, "pt_autograd_0"),
            (200, 200, "nccl-helper")
        ]
    );

    let tl = Timeline::new(&trace);
    assert_eq!(tl.process_of(101), Some(100));
    assert_eq!(tl.thread_name(101).as_deref(), Some("pt_autograd_0"));
    assert_eq!(tl.processes[&200].ppid, Some(100));
    assert_eq!(tl.processes[&100].uid, Some(1000));
}

#[test]
fn machine_id_is_on_every_packet() {
    let mut w = writer_with(WriterOptions {
        machine_id: Some(3),
        ..WriterOptions::default()
    });
    w.sched_switch(0, 2_000, 0, 5, 120, "a").unwrap();
    let t = w.thread_track(5, 5, "a").unwrap();
    w.instant(t, 2_100, "x", &[], None).unwrap();
    w.stack_sample(
        2_200,
        0,
        5,
        5,
        &[xpuscope_perfetto::Frame::kernel("schedule", 1)],
        10,
    )
    .unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    assert!(trace.packet.len() >= 6);
    assert!(trace.packet.iter().all(|p| p.machine_id == Some(3)));
    let tl = Timeline::for_machine(&trace, 3);
    assert_eq!(tl.switches.len(), 1);
    assert!(Timeline::for_machine(&trace, 0).switches.is_empty());
}

#[test]
fn out_of_range_cpus_are_rejected() {
    let mut w = TraceWriter::new(Vec::new());
    let err = w.sched_switch(1024, 1, 0, 1, 120, "x").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(w.sched_waking(5000, 1, 1, 0, 120, "x").is_err());
    assert!(w.stack_sample(1, 1024, 1, 1, &[], 1).is_err());
    w.mark_lost_events(4096); // ignored, not a panic
    w.sched_switch(1023, 1, 0, 1, 120, "x").unwrap();
    let bytes = w.finish().unwrap();
    let trace = xpuscope_tests::trace_check::decode(&bytes).unwrap();
    assert_eq!(bundles(&trace).len(), 1);
    assert_eq!(bundles(&trace)[0].ftrace_events().cpu(), 1023);
}

#[test]
fn flush_makes_the_output_a_complete_trace() {
    let mut w = TraceWriter::new(Vec::new());
    w.system_info(&system_info()).unwrap();
    w.sched_switch(0, 10, 0, 1, 120, "x").unwrap();
    assert_eq!(w.bytes_written() as usize, {
        // SystemInfo only: the switch is still in its bundle.
        let mut probe = TraceWriter::new(Vec::new());
        probe.system_info(&system_info()).unwrap();
        probe.finish().unwrap().len()
    });
    w.flush().unwrap();
    let n = w.bytes_written();
    let bytes = w.finish().unwrap();
    assert_eq!(bytes.len() as u64, n);
    assert_eq!(bundles(&decode_checked(&bytes)).len(), 1);
}

#[test]
fn periodic_clock_snapshots_keep_their_order() {
    let mut w = writer();
    for i in 1..=3u64 {
        w.clock_snapshot(&ClockSnapshot {
            boottime_ns: i * 1_000_000,
            monotonic_ns: i,
            realtime_ns: i,
        })
        .unwrap();
    }
    let trace = decode_checked(&w.finish().unwrap());
    let ts: Vec<u64> = trace
        .packet
        .iter()
        .filter(|p| p.has_clock_snapshot())
        .map(|p| p.timestamp())
        .collect();
    assert_eq!(ts, [1_000, 1_000_000, 2_000_000, 3_000_000]);
}
