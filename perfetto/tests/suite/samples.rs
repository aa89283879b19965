//! Off-CPU callstack samples: interning, root-first order, the kernel
//! mapping, and the weight in both sample formats.

use std::collections::HashMap;
use std::sync::Arc;

use perfetto_protos::trace::Trace;
use protobuf::UnknownValueRef;
use xpuscope_perfetto::{
    Frame, Mapping, OFF_CPU_COUNTER_NAME, OFF_CPU_SAMPLE_SOURCE, SampleFormat, WriterOptions,
};
use xpuscope_tests::trace_check::{SampleSource, Timeline};

use super::common::*;

fn libc() -> Arc<Mapping> {
    Arc::new(Mapping {
        path: "/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
        build_id: Some(vec![0xde, 0xad, 0xbe, 0xef]),
        start: 0x7f12_3400_0000,
        end: 0x7f12_3420_0000,
        start_offset: 0x28000,
        load_bias: 0x1000,
    })
}

/// As eBPF gives it: kernel stack leaf first, then user stack leaf first.
fn futex_wait_stack(lib: &Arc<Mapping>) -> Vec<Frame> {
    vec![
        Frame::kernel("schedule", 0xffff_ffff_81a0_0010),
        Frame::kernel("futex_wait", 0xffff_ffff_8110_0020),
        Frame::kernel("do_syscall_64", 0xffff_ffff_81a0_0100),
        Frame::new("__futex_abstimed_wait_common", Arc::clone(lib), 0x9a10),
        Frame::new("pthread_cond_wait", Arc::clone(lib), 0x9c20),
        Frame::new("main", Arc::clone(lib), 0x2_9d90),
    ]
}

const ROOT_FIRST: [&str; 6] = [
    "main",
    "pthread_cond_wait",
    "__futex_abstimed_wait_common",
    "do_syscall_64",
    "futex_wait",
    "schedule",
];

/// Fields of the StackSample in unknown field 135 of `p` (schema v58+):
/// (pid, tid, cpu, mode, callstack_iid, primary_weight).
fn stack_sample_fields(bytes: &[u8]) -> HashMap<&'static str, u64> {
    fn read(bytes: &[u8]) -> Vec<(u32, u64, Vec<u8>)> {
        let mut out = Vec::new();
        let mut pos = 0;
        let varint = |pos: &mut usize| {
            let mut v = 0u64;
            let mut shift = 0;
            loop {
                let b = bytes[*pos];
                *pos += 1;
                v |= u64::from(b & 0x7f) << shift;
                shift += 7;
                if b & 0x80 == 0 {
                    return v;
                }
            }
        };
        while pos < bytes.len() {
            let key = varint(&mut pos);
            match key & 7 {
                0 => out.push(((key >> 3) as u32, varint(&mut pos), Vec::new())),
                2 => {
                    let n = varint(&mut pos) as usize;
                    out.push(((key >> 3) as u32, 0, bytes[pos..pos + n].to_vec()));
                    pos += n;
                }
                w => panic!("unexpected wire type {w}"),
            }
        }
        out
    }
    let mut m = HashMap::new();
    for (n, v, b) in read(bytes) {
        match n {
            1 => {
                for (k, v, _) in read(&b) {
                    m.insert(if k == 2 { "pid" } else { "tid" }, v);
                }
            }
            3 => {
                for (k, v, _) in read(&b) {
                    m.insert(if k == 2 { "cpu" } else { "mode" }, v);
                }
            }
            6 => {
                m.insert("callstack_iid", v);
            }
            11 => {
                m.insert("weight", v);
            }
            other => panic!("unexpected StackSample field {other}"),
        }
    }
    m
}

fn unknown_bytes(fields: &protobuf::UnknownFields, n: u32) -> Option<Vec<u8>> {
    match fields.get(n) {
        Some(UnknownValueRef::LengthDelimited(b)) => Some(b.to_vec()),
        _ => None,
    }
}

/// The callstack `iid` resolved with the trace's interned data, root first:
/// (function, mapping path, build id, rel_pc, mapping start, end).
fn resolve(trace: &Trace, iid: u64) -> Vec<(String, String, Vec<u8>, u64, u64, u64)> {
    let mut functions = HashMap::new();
    let mut paths = HashMap::new();
    let mut build_ids = HashMap::new();
    let mut mappings = HashMap::new();
    let mut frames = HashMap::new();
    let mut stacks = HashMap::new();
    for p in &trace.packet {
        let Some(d) = p.interned_data.as_ref() else {
            continue;
        };
        for s in &d.function_names {
            functions.insert(s.iid(), String::from_utf8(s.str().to_vec()).unwrap());
        }
        for s in &d.mapping_paths {
            paths.insert(s.iid(), String::from_utf8(s.str().to_vec()).unwrap());
        }
        for s in &d.build_ids {
            build_ids.insert(s.iid(), s.str().to_vec());
        }
        for m in &d.mappings {
            mappings.insert(m.iid(), m.clone());
        }
        for f in &d.frames {
            frames.insert(f.iid(), f.clone());
        }
        for c in &d.callstacks {
            assert!(
                stacks.insert(c.iid(), c.frame_ids.clone()).is_none(),
                "callstack defined twice"
            );
        }
    }
    stacks[&iid]
        .iter()
        .map(|fid| {
            let f = &frames[fid];
            let m = &mappings[&f.mapping_id()];
            assert_eq!(m.path_string_ids.len(), 1);
            let build_id = build_ids.get(&m.build_id()).cloned().unwrap_or_default();
            (
                functions[&f.function_name_id()].clone(),
                paths[&m.path_string_ids[0]].clone(),
                build_id,
                f.rel_pc(),
                m.start(),
                m.end(),
            )
        })
        .collect()
}

#[test]
fn stack_samples_carry_weight_and_interned_root_first_stacks() {
    let lib = libc();
    let stack = futex_wait_stack(&lib);
    let mut w = writer();
    w.stack_sample(10_000, 1, 4242, 4250, &stack, 1_500_000)
        .unwrap();
    w.stack_sample(20_000, 0, 4242, 4251, &stack, 250_000)
        .unwrap();
    w.stack_sample(30_000, 0, 4242, 4250, &stack[..2], 7)
        .unwrap();
    let trace = decode_checked(&w.finish().unwrap());

    // Defaults on the sequence's first packet declare the ns counter
    // (TracePacketDefaults.stack_sample_defaults = 100, schema v58+).
    let first = trace
        .packet
        .iter()
        .find(|p| p.trusted_packet_sequence_id() == 2)
        .unwrap();
    assert_eq!(first.sequence_flags() & 1, 1);
    let defaults = first.trace_packet_defaults.as_ref().expect("defaults");
    let d = unknown_bytes(defaults.special_fields.unknown_fields(), 100)
        .expect("stack_sample_defaults");
    let text = String::from_utf8_lossy(&d);
    assert!(text.contains(OFF_CPU_SAMPLE_SOURCE) && text.contains(OFF_CPU_COUNTER_NAME));

    let samples: Vec<_> = trace
        .packet
        .iter()
        .filter_map(|p| unknown_bytes(p.special_fields.unknown_fields(), 135).map(|b| (p, b)))
        .collect();
    assert_eq!(samples.len(), 3);
    let (p, b) = &samples[0];
    assert_eq!(p.timestamp(), 10_000);
    assert_eq!(p.trusted_packet_sequence_id(), 2);
    assert_eq!(p.sequence_flags() & 2, 2);
    let f = stack_sample_fields(b);
    assert_eq!(
        (f["pid"], f["tid"], f["cpu"], f["mode"], f["weight"]),
        (4242, 4250, 1, 2, 1_500_000)
    );
    let frames = resolve(&trace, f["callstack_iid"]);
    let names: Vec<&str> = frames.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(names, ROOT_FIRST);
    let main = &frames[0];
    assert_eq!(main.1, "/usr/lib/x86_64-linux-gnu/libc.so.6");
    assert_eq!(main.2, [0xde, 0xad, 0xbe, 0xef]);
    assert_eq!(
        (main.3, main.4, main.5),
        (0x2_9d90, 0x7f12_3400_0000, 0x7f12_3420_0000)
    );
    let schedule = &frames[5];
    assert_eq!(
        (
            schedule.1.as_str(),
            schedule.2.len(),
            schedule.4,
            schedule.5
        ),
        ("kernel", 0, 0, 0)
    );
    assert_eq!(schedule.3, 0xffff_ffff_81a0_0010);
    // The same stack is interned once; a different one gets a new id.
    let f2 = stack_sample_fields(&samples[1].1);
    assert_eq!(f2["callstack_iid"], f["callstack_iid"]);
    assert_eq!((f2["tid"], f2["weight"]), (4251, 250_000));
    let f3 = stack_sample_fields(&samples[2].1);
    assert_ne!(f3["callstack_iid"], f["callstack_iid"]);
    assert_eq!(resolve(&trace, f3["callstack_iid"]).len(), 2);

    let tl = Timeline::new(&trace);
    let got: Vec<(u64, i32, i32, u64, Option<u32>)> = tl
        .stack_samples
        .iter()
        .map(|s| (s.ts, s.pid, s.tid, s.weight, s.cpu))
        .collect();
    assert_eq!(
        got,
        [
            (10_000, 4242, 4250, 1_500_000, Some(1)),
            (20_000, 4242, 4251, 250_000, Some(0)),
            (30_000, 4242, 4250, 7, Some(0)),
        ]
    );
    assert!(
        tl.stack_samples
            .iter()
            .all(|s| s.source == SampleSource::StackSample)
    );
    assert_eq!(tl.stack_samples[0].frames, ROOT_FIRST);
    assert_eq!(tl.stack_samples[0].mappings[5], "kernel");
    assert_eq!(tl.stack_samples[2].frames, ["futex_wait", "schedule"]);
}

#[test]
fn user_then_kernel_input_gives_the_same_callstack() {
    let lib = libc();
    let kernel_first = futex_wait_stack(&lib);
    let mut user_first = kernel_first[3..].to_vec();
    user_first.extend_from_slice(&kernel_first[..3]);
    let mut w = writer();
    w.stack_sample(1_000, 0, 1, 1, &kernel_first, 1).unwrap();
    w.stack_sample(2_000, 0, 1, 1, &user_first, 1).unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    let iids: Vec<u64> = trace
        .packet
        .iter()
        .filter_map(|p| unknown_bytes(p.special_fields.unknown_fields(), 135))
        .map(|b| stack_sample_fields(&b)["callstack_iid"])
        .collect();
    assert_eq!(iids, [1, 1]);
}

#[test]
fn perf_sample_format_keeps_a_cumulative_timebase_per_cpu() {
    let lib = libc();
    let stack = futex_wait_stack(&lib);
    let user_only = &stack[3..];
    let mut w = writer_with(WriterOptions {
        sample_format: SampleFormat::PerfSample,
        ..WriterOptions::default()
    });
    w.stack_sample(1_000, 0, 10, 11, &stack, 100).unwrap();
    w.stack_sample(2_000, 1, 10, 12, &stack, 40).unwrap();
    w.stack_sample(3_000, 0, 10, 11, user_only, 5).unwrap();
    w.stack_sample(4_000, 0, 10, 11, &[], 9).unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    let samples: Vec<_> = trace
        .packet
        .iter()
        .filter(|p| p.has_perf_sample())
        .collect();
    assert_eq!(samples.len(), 4);
    let rows: Vec<(u64, u32, u32, u32, u64, Option<i32>)> = samples
        .iter()
        .map(|p| {
            let s = p.perf_sample();
            (
                p.timestamp(),
                s.cpu(),
                s.pid(),
                s.tid(),
                s.timebase_count(),
                s.cpu_mode.map(|m| m.value()),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            (1_000, 0, 10, 11, 100, Some(1)),
            (2_000, 1, 10, 12, 40, Some(1)),
            (3_000, 0, 10, 11, 105, Some(2)),
            (4_000, 0, 10, 11, 114, None),
        ]
    );
    assert!(samples[3].perf_sample().callstack_iid.is_none());
    let names: Vec<String> = resolve(&trace, samples[0].perf_sample().callstack_iid())
        .into_iter()
        .map(|f| f.0)
        .collect();
    assert_eq!(names, ROOT_FIRST);
    // Defaults name the timebase so it is not taken for cpu-clock.
    let first = trace
        .packet
        .iter()
        .find(|p| p.trusted_packet_sequence_id() == 2)
        .unwrap();
    let timebase = first
        .trace_packet_defaults
        .perf_sample_defaults
        .timebase
        .as_ref()
        .unwrap();
    assert_eq!(
        timebase.name(),
        xpuscope_perfetto::OFF_CPU_PERF_TIMEBASE_NAME
    );

    let tl = Timeline::new(&trace);
    let weights: Vec<u64> = tl.stack_samples.iter().map(|s| s.weight).collect();
    assert_eq!(weights, [100, 40, 5, 9]);
    assert!(
        tl.stack_samples
            .iter()
            .all(|s| s.source == SampleSource::PerfSample)
    );
}
