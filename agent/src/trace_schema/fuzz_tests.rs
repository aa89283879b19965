//! The trace reader on traces the sink did not write: a trace file given
//! to `agent diagnose` or `agent merge` is user input. Seeded mutations of
//! traces the Perfetto sink wrote (the whole file, or one packet's bytes
//! with the framing kept, so the decoder and the reader get past the
//! first packet), read the way `diagnose` reads them (into records) and
//! the way `merge` does (the packet loop: every view of a packet, its ids
//! remapped, encoded again). Each must end in records or in an error that
//! names the file, with records and allocations bounded by the input.
//! Longer runs: raise `ROUNDS`.

use std::path::Path;
use std::sync::Arc;

use xpuscope_perfetto::rewrite::{IdMap, Packet, PacketReader};
use xpuscope_perfetto::{Arg, ArgValue};

use super::keys as k;
use super::names as n;
use super::read::{TracePackets, TraceRecords};
use super::round_trip_tests::{recording, trace_of};
use crate::model::{OffCpuInterval, Record, Stack, SymFrame};
use crate::service::fuzzing::Mutator;

const ROUNDS: usize = 8_000;
const NAME: &str = "(in memory)";

/// Bytes this thread has allocated so far (jemalloc, the agent's
/// allocator, counts them).
fn allocated() -> u64 {
    let p = tikv_jemalloc_ctl::thread::allocatedp::read().expect("jemalloc stats");
    p.get()
}

/// What reading a trace may allocate: the readers' buffers (1 MiB each,
/// two passes for records, one for the packet loop), then in proportion
/// to the input.
fn allocation_bound(len: usize) -> u64 {
    (8 << 20) + 1024 * len as u64
}

/// The recording's trace, and the same with an off-CPU stack (interned
/// frames and a callstack sample).
fn seeds() -> Vec<Vec<u8>> {
    let written = recording().written;
    let frame = |f: &str| SymFrame {
        function: Arc::from(f),
        module: Arc::from("/usr/lib/libc.so.6"),
        module_start: 0x7f00_0000_0000,
        module_end: 0x7f00_0010_0000,
        module_offset: 0,
        rel_pc: 0x1234,
    };
    let mut with_stack = written.clone();
    with_stack.push(Record::OffCpu(OffCpuInterval {
        tid: 100,
        tgid: 100,
        cpu: 0,
        start: 2_000,
        end: 5_000,
        state: 1,
        stack: Some(Arc::new(Stack {
            kernel: vec![frame("schedule")],
            user: vec![frame("futex_wait"), frame("main")],
        })),
        preempted_by: None,
        truncated: false,
    }));
    vec![trace_of(&written), trace_of(&with_stack)]
}

/// A trace's packets, without their framing.
fn packets(trace: &[u8]) -> Vec<Vec<u8>> {
    let mut r = PacketReader::new(trace);
    let mut out = Vec::new();
    while let Some(p) = r.next_packet().expect("a seed reads") {
        out.push(p.to_vec());
    }
    out
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A varint's value and length.
fn read_varint(bytes: &[u8]) -> (u64, usize) {
    let mut v = 0u64;
    for (i, b) in bytes.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return (v, i + 1);
        }
    }
    panic!("not a varint: {bytes:02x?}")
}

fn framed(packets: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in packets {
        out.push(0x0a);
        varint(p.len() as u64, &mut out);
        out.extend_from_slice(p);
    }
    out
}

/// `agent diagnose`'s read: records, or an error naming the file.
fn read_records(trace: &[u8]) -> Option<usize> {
    let mut out = Vec::new();
    let mut open = Vec::new();
    match TraceRecords::default().read_bytes(trace, |p| p as u32, &mut out, &mut open) {
        Ok(_) => {
            let records = out.len() + open.len();
            assert!(
                records <= trace.len(),
                "{records} records of {} bytes",
                trace.len()
            );
            Some(records)
        }
        Err(e) => {
            assert!(format!("{e:#}").contains(NAME), "{e:#}");
            None
        }
    }
}

/// Moves everything, as a merge moves a node's ids.
struct Shift;

impl IdMap for Shift {
    fn time(&mut self, ts: u64) -> u64 {
        ts.wrapping_add(1_000)
    }
    fn sequence(&mut self, id: u32) -> u32 {
        id.wrapping_add(7)
    }
    fn track(&mut self, uuid: u64) -> u64 {
        uuid ^ 0x5a5a
    }
    fn pid(&mut self, pid: i32) -> i32 {
        pid.wrapping_add(100_000)
    }
    fn cpu(&mut self, cpu: u32) -> u32 {
        cpu.wrapping_add(64)
    }
    fn flow(&mut self, id: u64) -> u64 {
        id ^ 0xf10
    }
}

/// `agent merge`'s packet loop: every view of each packet, then its ids
/// moved and the packet written again, which must read back as one
/// packet. Returns the packets read.
fn merge_pass(trace: &[u8]) -> u64 {
    let mut packets = TracePackets::new(trace, Path::new(NAME));
    loop {
        let mut p = match packets.next() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(e) => {
                assert!(format!("{e:#}").contains(NAME), "{e:#}");
                break;
            }
        };
        let _ = (p.system_info(), p.clock_snapshot(), p.timestamp());
        let _ = (p.track(), p.track_uuid(), p.process_tree(), p.flows());
        if let Some(e) = packets.event(&p) {
            let _ = (e.name, k::CORRELATION_ID.read(&e), k::STACK.read(&e));
        }
        if let Some(s) = packets.interning().sample(&p) {
            assert!(s.functions.len() <= trace.len());
        }
        p.for_each_switch_to(|_, _, _, _, _| {});
        p.for_each_new_task(|_, _, _| {});
        p.remap(&mut Shift);
        let mut again = Vec::new();
        p.encode_framed(&mut again);
        assert_eq!(again[0], 0x0a);
        let (len, header) = read_varint(&again[1..]);
        assert_eq!(1 + header + len as usize, again.len(), "one packet");
        Packet::decode(&again[1 + header..], 0).expect("a written packet decodes");
    }
    assert!(packets.offset() <= trace.len() as u64);
    packets.packets()
}

fn check(trace: &[u8]) {
    let before = allocated();
    read_records(trace);
    merge_pass(trace);
    let used = allocated() - before;
    assert!(
        used <= allocation_bound(trace.len()),
        "{used} bytes allocated reading {} bytes",
        trace.len()
    );
}

#[test]
fn the_seeds_read_whole() {
    for seed in seeds() {
        check(&seed);
        assert!(read_records(&seed).is_some_and(|r| r > 10));
        assert_eq!(merge_pass(&seed), packets(&seed).len() as u64);
    }
}

#[test]
fn mutated_traces_read_to_bounded_records_or_a_clear_error() {
    let seeds = seeds();
    let split: Vec<Vec<Vec<u8>>> = seeds.iter().map(|t| packets(t)).collect();
    let mut m = Mutator::new(0x7ace_5eed);
    for round in 0..ROUNDS {
        let seed = round % seeds.len();
        let trace = if round % 2 == 0 {
            m.mutate(&seeds[seed])
        } else {
            let mut p = split[seed].clone();
            let at = (round / 2).wrapping_mul(7919) % p.len();
            p[at] = m.mutate(&p[at]);
            framed(&p)
        };
        check(&trace);
    }
}

#[test]
fn lengths_that_claim_more_than_is_there_allocate_what_is_there() {
    let seed = &seeds()[0];
    // A packet claiming 4 GiB, then 255 MiB (under the reader's limit),
    // with a few bytes behind either; and a field inside a packet
    // claiming 2 GiB.
    let mut claims = Vec::new();
    for len in [4u64 << 30, 255 << 20] {
        let mut t = seed.clone();
        t.push(0x0a);
        varint(len, &mut t);
        t.extend_from_slice(b"\x08\x01\x10\x02");
        claims.push(t);
    }
    let mut inner = vec![0x12u8];
    varint(2 << 30, &mut inner);
    inner.extend_from_slice(b"abc");
    claims.push(framed(&[packets(seed), vec![inner]].concat()));
    for t in &claims {
        check(t);
    }
    let too_large = format!("{:#}", read_err(&claims[0]));
    assert!(
        too_large.contains("corrupt length") && too_large.contains(NAME),
        "{too_large}"
    );
    // Cut short: the trace ends at its last whole packet.
    assert!(read_records(&claims[1]).is_some());
    let bad_field = format!("{:#}", read_err(&claims[2]));
    assert!(bad_field.contains("not an xpuscope trace"), "{bad_field}");
}

fn read_err(trace: &[u8]) -> anyhow::Error {
    TraceRecords::default()
        .read_bytes(trace, |p| p as u32, &mut Vec::new(), &mut Vec::new())
        .expect_err("an error")
}

#[test]
fn garbage_is_refused_by_name() {
    for garbage in [
        &b"{\"traceEvents\": []}"[..],
        b"\x1f\x8b\x08\0",
        b"\x0a\x05ab",
    ] {
        check(garbage);
    }
    let json = format!("{:#}", read_err(b"{\"traceEvents\": []}"));
    assert!(json.contains("not a native Perfetto trace"), "{json}");
    let gzip = format!("{:#}", read_err(b"\x1f\x8b\x08\0"));
    assert!(gzip.contains("gzip"), "{gzip}");
}

#[test]
fn a_failed_allocation_naming_thousands_of_live_sites_reads_a_few() {
    // The sink writes the few largest sites; each row read is looked up
    // among all of the instant's arguments, so a trace naming thousands
    // must not cost thousands of lookups each.
    let seed = &seeds()[0];
    let mut interning = xpuscope_perfetto::rewrite::Interning::default();
    let mut grown = Vec::new();
    let mut found = false;
    for bytes in packets(seed) {
        let mut p = Packet::decode(&bytes, 0).expect("decodes");
        interning.observe(&p);
        let failed = interning.event(&p).is_some_and(|e| {
            e.name.is_some_and(|n| n.ends_with(n::FAILED_SUFFIX)) && k::REQUESTED.present(&e)
        });
        if failed {
            found = true;
            let rows: Vec<Arg> = (10..20_000)
                .flat_map(|i| {
                    [
                        Arg::new(k::live_site(i, "bytes"), ArgValue::Uint(i as u64)),
                        Arg::new(k::live_site(i, "allocations"), ArgValue::Uint(1)),
                    ]
                })
                .collect();
            p.add_args(&rows);
        }
        p.encode_framed(&mut grown);
    }
    assert!(found, "the recording has a failed allocation");
    let mut out = Vec::new();
    TraceRecords::default()
        .read_bytes(&grown, |p| p as u32, &mut out, &mut Vec::new())
        .expect("reads");
    let rows: Vec<usize> = out
        .iter()
        .filter_map(|(_, r)| match r {
            Record::DeviceCall(c) => c.oom.as_ref().map(Vec::len),
            _ => None,
        })
        .collect();
    assert!(!rows.is_empty());
    assert!(
        rows.iter().all(|&r| r <= super::read::MAX_LIVE_SITES),
        "{rows:?}"
    );
}
