//! Shared helpers: writers with the usual preamble, decoding with checks, a
//! deterministic random source and a realistic scheduler workload.

use perfetto_protos::trace::Trace;
use perfetto_protos::trace_packet::TracePacket;
use xpuscope_perfetto::{ClockSnapshot, SystemInfo, TraceWriter, WriterOptions};
use xpuscope_tests::trace_check::{check_importer_rules, decode};

pub const RELEASE: &str = "6.18.0-1-amd64";

pub fn system_info() -> SystemInfo {
    SystemInfo {
        sysname: "Linux".into(),
        version: "#1 SMP PREEMPT_DYNAMIC Debian 6.18.0-1".into(),
        release: RELEASE.into(),
        machine: "x86_64".into(),
        hz: 250,
        page_size: 4096,
        num_cpus: 2,
        machine_name: Some("gpu-node-07".into()),
    }
}

/// A writer that already wrote SystemInfo and a clock snapshot.
pub fn writer_with(options: WriterOptions) -> TraceWriter<Vec<u8>> {
    let mut w = TraceWriter::with_options(Vec::new(), options);
    w.system_info(&system_info()).unwrap();
    w.clock_snapshot(&ClockSnapshot {
        boottime_ns: 1_000,
        monotonic_ns: 900,
        realtime_ns: 1_700_000_000_000_000_000,
    })
    .unwrap();
    w
}

pub fn writer() -> TraceWriter<Vec<u8>> {
    writer_with(WriterOptions::default())
}

/// Decodes `bytes` with the independent decoder and asserts that the
/// importer's rules hold.
pub fn decode_checked(bytes: &[u8]) -> Trace {
    let trace = decode(bytes).expect("the trace decodes with the official schema");
    if let Err(errors) = check_importer_rules(&trace) {
        panic!("importer rules broken:\n{}", errors.join("\n"));
    }
    trace
}

/// Packets holding an ftrace bundle, in file order.
pub fn bundles(trace: &Trace) -> Vec<&TracePacket> {
    trace
        .packet
        .iter()
        .filter(|p| p.has_ftrace_events())
        .collect()
}

/// xorshift64*: deterministic, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One generated switch.
#[derive(Clone, Debug, PartialEq)]
pub struct SwitchIn {
    pub cpu: u32,
    pub ts: u64,
    pub prev_state: i64,
    pub pid: i32,
    pub prio: i32,
    pub comm: String,
}

/// `n` switches over `cpus` CPUs of a training node: a trainer's threads,
/// NCCL and CUDA helpers, kworkers, and the idle task, with pids up to a few
/// hundred thousand and 1-100 us between switches. Sorted by time.
pub fn realistic_switches(n: usize, cpus: u32, seed: u64) -> Vec<SwitchIn> {
    let mut rng = Rng::new(seed);
    let mut tasks: Vec<(i32, String, i32)> = Vec::new();
    let comms = [
        "python3",
        "pt_main_thread",
        "pt_autograd_0",
        "nccl-proxy",
        "cuda-EvtHandlr",
        "dataloader_0",
        "dataloader_1",
        "tokio-runtime-w",
        "sshd",
        "systemd-journal",
    ];
    for (i, c) in comms.iter().enumerate() {
        for k in 0..4 {
            let pid = 180_000 + (i as i32) * 1_013 + k * 7;
            tasks.push((pid, c.to_string(), if k == 3 { 100 } else { 120 }));
        }
    }
    for cpu in 0..cpus {
        tasks.push((900 + cpu as i32 * 6, format!("kworker/{cpu}:1H"), 100));
        tasks.push((20 + cpu as i32 * 6, format!("ksoftirqd/{cpu}"), 120));
    }
    let states = [0i64, 1, 1, 1, 2, 0x100, 0x80];
    let mut now = vec![3_600_000_000_000u64; cpus as usize];
    let mut idle = vec![false; cpus as usize];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let cpu = rng.below(u64::from(cpus)) as u32;
        let c = cpu as usize;
        now[c] += 1_000 + rng.below(99_000);
        let prev_state = states[rng.below(states.len() as u64) as usize];
        let (pid, comm, prio) = if !idle[c] && rng.below(3) == 0 {
            (0, format!("swapper/{cpu}"), 120)
        } else {
            tasks[rng.below(tasks.len() as u64) as usize].clone()
        };
        idle[c] = pid == 0;
        out.push(SwitchIn {
            cpu,
            ts: now[c],
            prev_state,
            pid,
            prio,
            comm,
        });
    }
    out.sort_by_key(|s| s.ts);
    out
}
