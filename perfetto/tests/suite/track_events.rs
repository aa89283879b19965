//! Track descriptors and track events, decoded field by field.

use std::collections::HashMap;
use std::sync::Arc;

use perfetto_protos::trace::Trace;
use perfetto_protos::track_event::track_event::Type;
use protobuf::UnknownValueRef;
use xpuscope_perfetto::{Arg, ArgValue, CounterUnit, Frame, Mapping, TrackUuid};
use xpuscope_tests::trace_check::{self, Timeline, TrackKind};

use super::common::*;

/// Everything interned on the writer's track sequence: (kind, iid) -> name.
fn interned_names(trace: &Trace) -> HashMap<(&'static str, u64), String> {
    let mut out = HashMap::new();
    for p in &trace.packet {
        if let Some(d) = p.interned_data.as_ref() {
            for n in &d.event_names {
                assert!(
                    out.insert(("event", n.iid()), n.name().to_owned())
                        .is_none(),
                    "defined twice"
                );
            }
            for n in &d.event_categories {
                assert!(
                    out.insert(("category", n.iid()), n.name().to_owned())
                        .is_none()
                );
            }
            for n in &d.debug_annotation_names {
                assert!(
                    out.insert(("annotation", n.iid()), n.name().to_owned())
                        .is_none()
                );
            }
        }
    }
    out
}

#[test]
fn track_descriptors_carry_every_field() {
    let mut w = writer();
    let labels = vec!["rank=3".to_string(), "job=llm-pretrain".to_string()];
    let process = w.process_track(4242, "trainer", &labels).unwrap();
    let thread = w.thread_track(4242, 4250, "pt_autograd_0").unwrap();
    let custom = w
        .custom_track(Some(process), "CUDA stream 7", Some("kernels on stream 7"))
        .unwrap();
    let plain = w.custom_track(None, "NCCL", None).unwrap();
    let c1 = w
        .counter_track(Some(process), "HBM used", CounterUnit::SizeBytes)
        .unwrap();
    let c2 = w
        .counter_track(None, "SM busy", CounterUnit::Other("%".into()))
        .unwrap();
    let c3 = w.counter_track(None, "queue", CounterUnit::Count).unwrap();
    let c4 = w.counter_track(None, "wait", CounterUnit::TimeNs).unwrap();
    let all = [process, thread, custom, plain, c1, c2, c3, c4];
    let mut uuids: Vec<u64> = all.iter().map(|t| t.0).collect();
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), all.len(), "distinct uuids");
    assert!(uuids.iter().all(|&u| u != 0));
    // Process and thread uuids are stable.
    assert_eq!(w.process_track(4242, "trainer", &labels).unwrap(), process);
    assert_eq!(w.thread_track(4242, 4250, "pt_autograd_0").unwrap(), thread);

    let trace = decode_checked(&w.finish().unwrap());
    let desc: HashMap<u64, _> = trace
        .packet
        .iter()
        .filter(|p| p.has_track_descriptor())
        .map(|p| {
            assert_eq!(p.trusted_packet_sequence_id(), 2);
            (p.track_descriptor().uuid(), p.track_descriptor().clone())
        })
        .collect();
    let p = desc[&process.0].process.as_ref().unwrap();
    assert_eq!(
        (p.pid(), p.process_name(), p.process_labels.clone()),
        (4242, "trainer", labels.clone())
    );
    let t = desc[&thread.0].thread.as_ref().unwrap();
    assert_eq!(
        (t.pid(), t.tid(), t.thread_name()),
        (4242, 4250, "pt_autograd_0")
    );
    let c = &desc[&custom.0];
    assert_eq!(
        (c.name(), c.parent_uuid),
        ("CUDA stream 7", Some(process.0))
    );
    // description = 14 is newer than schema v51: an unknown field.
    match c.special_fields.unknown_fields().get(14) {
        Some(UnknownValueRef::LengthDelimited(b)) => assert_eq!(b, b"kernels on stream 7"),
        other => panic!("description missing: {other:?}"),
    }
    assert_eq!(
        (desc[&plain.0].name(), desc[&plain.0].parent_uuid),
        ("NCCL", None)
    );
    let unit = |t: TrackUuid| {
        let c = desc[&t.0].counter.as_ref().unwrap();
        (c.unit.map(|u| u.value()), c.unit_name.clone())
    };
    assert_eq!(unit(c1), (Some(3), None));
    assert_eq!(unit(c2), (None, Some("%".into())));
    assert_eq!(unit(c3), (Some(2), None));
    assert_eq!(unit(c4), (Some(1), None));
    assert_eq!(desc[&c1.0].parent_uuid, Some(process.0));

    let tl = Timeline::new(&trace);
    assert_eq!(
        tl.tracks[&custom.0].description.as_deref(),
        Some("kernels on stream 7")
    );
    assert_eq!(tl.processes[&4242].labels, labels);
    assert_eq!(tl.processes[&4242].name.as_deref(), Some("trainer"));
    assert_eq!(tl.thread_name(4250).as_deref(), Some("pt_autograd_0"));
    assert_eq!(tl.process_of(4250), Some(4242));
    assert!(matches!(tl.tracks[&c2.0].kind, TrackKind::Counter { .. }));
}

#[test]
fn slices_instants_counters_and_flows_decode_field_by_field() {
    let mut w = writer();
    let thread = w.thread_track(100, 101, "worker").unwrap();
    let stream = w.custom_track(None, "stream 0", None).unwrap();
    let mem = w
        .counter_track(None, "mem", CounterUnit::SizeBytes)
        .unwrap();
    let args = [
        Arg::new("bytes", 4096u64),
        Arg::new("delta", -3i64),
        Arg::new("ratio", 0.25),
        Arg::new("kernel", "gemm_128x128"),
        Arg::new("sync", true),
        Arg {
            name: "ptr".into(),
            value: ArgValue::Pointer(0x7f00_dead_beef),
        },
    ];
    w.slice_begin(
        thread,
        1_000,
        "cudaLaunchKernel",
        Some("cuda"),
        &args,
        &[77],
        None,
    )
    .unwrap();
    w.slice_begin(thread, 1_100, "inner", Some("cuda"), &[], &[], None)
        .unwrap();
    w.slice_end(thread, 1_200, &[]).unwrap();
    w.slice_end(thread, 1_300, &[]).unwrap();
    w.slice_begin(
        stream,
        1_400,
        "gemm_128x128",
        Some("gpu"),
        &[Arg::new("bytes", 1u64)],
        &[],
        None,
    )
    .unwrap();
    w.slice_end(stream, 2_400, &[77]).unwrap();
    w.instant(
        stream,
        2_500,
        "cudaEventRecord",
        &[Arg::new("event", 3u64)],
        None,
    )
    .unwrap();
    w.counter(mem, 1_000, 1.5e9).unwrap();
    w.counter(mem, 2_000, 0.0).unwrap();
    let trace = decode_checked(&w.finish().unwrap());

    let names = interned_names(&trace);
    let events: Vec<_> = trace
        .packet
        .iter()
        .filter(|p| p.has_track_event())
        .collect();
    assert_eq!(events.len(), 9);
    for p in &events {
        assert_eq!(p.trusted_packet_sequence_id(), 2);
        assert_eq!(p.sequence_flags() & 2, 2, "needs incremental state");
    }
    let first_on_seq = trace
        .packet
        .iter()
        .find(|p| p.trusted_packet_sequence_id() == 2)
        .unwrap();
    assert_eq!(
        first_on_seq.sequence_flags() & 1,
        1,
        "first packet clears the state"
    );

    let e0 = events[0].track_event();
    assert_eq!(events[0].timestamp(), 1_000);
    assert_eq!(e0.type_(), Type::TYPE_SLICE_BEGIN);
    assert_eq!(e0.track_uuid(), thread.0);
    assert_eq!(names[&("event", e0.name_iid())], "cudaLaunchKernel");
    assert_eq!(e0.category_iids.len(), 1);
    assert_eq!(names[&("category", e0.category_iids[0])], "cuda");
    assert_eq!(e0.flow_ids, [77]);
    let a = &e0.debug_annotations;
    assert_eq!(a.len(), 6);
    let aname = |i: usize| names[&("annotation", a[i].name_iid())].clone();
    assert_eq!((aname(0), a[0].uint_value()), ("bytes".into(), 4096));
    assert_eq!((aname(1), a[1].int_value()), ("delta".into(), -3));
    assert_eq!((aname(2), a[2].double_value()), ("ratio".into(), 0.25));
    assert_eq!(
        (aname(3), a[3].string_value()),
        ("kernel".into(), "gemm_128x128")
    );
    assert_eq!((aname(4), a[4].bool_value()), ("sync".into(), true));
    assert_eq!(
        (aname(5), a[5].pointer_value()),
        ("ptr".into(), 0x7f00_dead_beef)
    );
    // Names are interned once per sequence and reused.
    let e1 = events[1].track_event();
    assert_eq!(e1.category_iids, e0.category_iids);
    assert_eq!(
        events[4].track_event().debug_annotations[0].name_iid(),
        a[0].name_iid()
    );
    let end = events[5].track_event();
    assert_eq!(
        (
            end.type_(),
            end.track_uuid(),
            end.terminating_flow_ids.clone()
        ),
        (Type::TYPE_SLICE_END, stream.0, vec![77])
    );
    assert!(!end.has_name_iid());
    let inst = events[6].track_event();
    assert_eq!(
        (inst.type_(), names[&("event", inst.name_iid())].as_str()),
        (Type::TYPE_INSTANT, "cudaEventRecord")
    );
    let c = events[7].track_event();
    assert_eq!(
        (c.type_(), c.track_uuid(), c.double_counter_value()),
        (Type::TYPE_COUNTER, mem.0, 1.5e9)
    );

    let tl = Timeline::new(&trace);
    let on_thread = tl.slices_on(thread.0);
    assert_eq!(on_thread.len(), 2);
    assert_eq!(
        (on_thread[0].ts, on_thread[0].end, on_thread[0].depth),
        (1_000, Some(1_300), 0)
    );
    assert_eq!(
        (on_thread[1].ts, on_thread[1].end, on_thread[1].depth),
        (1_100, Some(1_200), 1)
    );
    assert_eq!(on_thread[0].category.as_deref(), Some("cuda"));
    assert_eq!(
        on_thread[0].arg("kernel"),
        Some(&trace_check::ArgValue::Str("gemm_128x128".into()))
    );
    assert_eq!(
        on_thread[0].arg("ptr"),
        Some(&trace_check::ArgValue::Pointer(0x7f00_dead_beef))
    );
    let gpu = tl.slices_on(stream.0);
    assert_eq!(
        (gpu[0].end, gpu[0].terminating_flow_ids.clone()),
        (Some(2_400), vec![77])
    );
    assert_eq!(tl.instants[0].name, "cudaEventRecord");
    assert_eq!(tl.slices_on_thread(101).len(), 2);
    assert!(tl.instants_on_thread(101).is_empty());
    assert_eq!(tl.counter_series(mem.0), [(1_000, 1.5e9), (2_000, 0.0)]);
    assert_eq!(tl.counter_values("mem"), [1.5e9, 0.0]);
}

#[test]
fn names_are_interned_once_over_many_events() {
    let mut w = writer();
    let t = w.thread_track(1, 1, "t").unwrap();
    for i in 0..1_000u64 {
        let name = ["ncclAllReduce", "cudaMemcpyAsync", "cudaLaunchKernel"][(i % 3) as usize];
        w.slice_begin(
            t,
            10 + i * 10,
            name,
            Some("lib"),
            &[Arg::new("n", i)],
            &[],
            None,
        )
        .unwrap();
        w.slice_end(t, 15 + i * 10, &[]).unwrap();
    }
    let trace = decode_checked(&w.finish().unwrap());
    let names = interned_names(&trace);
    assert_eq!(names.len(), 3 + 1 + 1);
    let ids: Vec<u64> = names
        .iter()
        .filter(|((k, _), _)| *k == "event")
        .map(|((_, id), _)| *id)
        .collect();
    let mut ids = ids;
    ids.sort();
    assert_eq!(ids, [1, 2, 3], "ids start at 1");
    assert_eq!(Timeline::new(&trace).slices.len(), 1_000);
}

#[test]
fn callstacks_on_slices_and_instants_resolve_root_first() {
    let lib = Arc::new(Mapping {
        path: "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
        build_id: Some(vec![0x12, 0x34]),
        start: 0x7f00_0000_0000,
        end: 0x7f00_0100_0000,
        start_offset: 0x1000,
        load_bias: 0,
    });
    let stack = [
        Frame::new("cuStreamSynchronize", Arc::clone(&lib), 0x4321),
        Frame::new("main", Arc::clone(&lib), 0x10),
        Frame::kernel("schedule", 0xffff_ffff_8100_0000),
    ];
    let mut w = writer();
    let t = w.thread_track(7, 7, "main").unwrap();
    w.slice_begin(t, 100, "sync", None, &[], &[], Some(&stack))
        .unwrap();
    w.slice_end(t, 200, &[]).unwrap();
    w.instant(t, 300, "hang", &[], Some(&stack)).unwrap();
    let by = [
        Arg::new("by_comm", "cpu-hog"),
        Arg::new("cpu", 3u64),
        Arg {
            name: "at".into(),
            value: ArgValue::Pointer(0xbeef),
        },
    ];
    w.instant(t, 400, "preempted by cpu-hog", &by, None)
        .unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    // callstack_iid = 56 is newer than schema v51: an unknown varint.
    let iids: Vec<u64> = trace
        .packet
        .iter()
        .filter(|p| p.has_track_event() && p.track_event().type_() != Type::TYPE_SLICE_END)
        .take(2)
        .map(
            |p| match p.track_event().special_fields.unknown_fields().get(56) {
                Some(UnknownValueRef::Varint(v)) => v,
                other => panic!("no callstack_iid: {other:?}"),
            },
        )
        .collect();
    assert_eq!(iids, [1, 1], "one deduplicated callstack");
    let tl = Timeline::new(&trace);
    let want = Some(vec![
        "main".to_string(),
        "cuStreamSynchronize".into(),
        "schedule".into(),
    ]);
    assert_eq!(tl.slices[0].callstack, want);
    assert_eq!(tl.instants[0].callstack, want);
    let on_thread = tl.instants_on_thread(7);
    assert_eq!(on_thread.len(), 2);
    assert_eq!(on_thread[0], ("hang".to_string(), vec![]));
    let text = |k: &str, v: &str| (k.to_string(), v.to_string());
    assert_eq!(
        on_thread[1],
        (
            "preempted by cpu-hog".to_string(),
            vec![
                text("by_comm", "cpu-hog"),
                text("cpu", "3"),
                text("at", "0xbeef")
            ]
        )
    );
}
