//! Size of scheduler data, and a throughput probe to run by hand.

use std::time::Instant;

use xpuscope_perfetto::TraceWriter;
use xpuscope_tests::trace_check::Timeline;

use super::common::*;

#[test]
fn switches_take_at_most_12_bytes_each() {
    let input = realistic_switches(100_000, 2, 7);
    let mut w = writer();
    for s in &input {
        w.sched_switch(s.cpu, s.ts, s.prev_state, s.pid, s.prio, &s.comm)
            .unwrap();
    }
    let bytes = w.finish().unwrap();
    let per_switch = bytes.len() as f64 / input.len() as f64;
    eprintln!(
        "{} bytes for {} switches: {per_switch:.2} bytes/switch",
        bytes.len(),
        input.len()
    );
    assert!(per_switch <= 12.0, "{per_switch:.2} bytes per switch");
    let trace = decode_checked(&bytes);
    assert_eq!(Timeline::new(&trace).switches.len(), input.len());
}

/// Encoding throughput of the sched path; run by hand in release:
/// `cargo test --release -p xpuscope-perfetto --test integration -- --ignored --nocapture encode_rate`
#[test]
#[ignore = "timing probe, run by hand in release"]
fn encode_rate() {
    let input = realistic_switches(2_000_000, 8, 11);
    let mut w = TraceWriter::new(std::io::sink());
    // Warm up (intern tables, buffer capacities), then measure.
    for s in &input[..100_000] {
        w.sched_switch(s.cpu, s.ts, s.prev_state, s.pid, s.prio, &s.comm)
            .unwrap();
    }
    let start = Instant::now();
    for s in &input[100_000..] {
        w.sched_switch(s.cpu, s.ts, s.prev_state, s.pid, s.prio, &s.comm)
            .unwrap();
    }
    w.flush_sched().unwrap();
    let elapsed = start.elapsed();
    let n = (input.len() - 100_000) as f64;
    eprintln!(
        "{:.2} M switch events/s ({:.1} ns/event, {} bytes written)",
        n / elapsed.as_secs_f64() / 1e6,
        elapsed.as_nanos() as f64 / n,
        w.bytes_written()
    );
}
