//! Size of scheduler data. (Encoding speed is measured by `cargo xtask bench`,
//! see `perfetto/examples/encode_bench.rs`, not asserted in tests.)

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
