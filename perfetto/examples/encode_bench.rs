//! Encodes synthetic scheduler events as fast as it can and prints, as JSON,
//! switch events encoded per second on one core and bytes per switch.
//! Run by `cargo xtask bench` (release build).

use std::io::Write;
use std::time::Instant;

use xpuscope_perfetto::{SystemInfo, TraceWriter};

/// Counts bytes and throws them away.
struct CountingSink(u64);

impl Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn main() -> std::io::Result<()> {
    let switches: u64 = 5_000_000;
    let comms = [
        "python3",
        "pt_data_worker",
        "nccl-proxy",
        "swapper/0",
        "kworker/1:2",
        "cuda-EvtHandlr",
    ];
    let mut w = TraceWriter::new(CountingSink(0));
    w.system_info(&SystemInfo {
        release: "6.18.0".into(),
        ..Default::default()
    })?;
    let start = Instant::now();
    let mut ts = 1_000_000_000u64;
    for i in 0..switches {
        // Realistic gaps (a few microseconds), pids and a handful of comms.
        ts += 1_500 + (i * 7919) % 3_000;
        let cpu = (i % 8) as u32;
        let pid = 1000 + (i % 24) as i32;
        let comm = comms[(i % comms.len() as u64) as usize];
        w.sched_switch(cpu, ts, if i % 3 == 0 { 0x1 } else { 0 }, pid, 120, comm)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let sink = w.finish()?;
    println!(
        "{{\"switches\":{switches},\"seconds\":{elapsed:.4},\"switches_per_s\":{:.0},\"bytes_per_switch\":{:.3}}}",
        switches as f64 / elapsed,
        sink.0 as f64 / switches as f64
    );
    Ok(())
}
