//! A synchronous pipeline for unit tests: interpretation with the live
//! enricher, the Perfetto sink over a `Vec<u8>` and the summary sink, fed
//! in order on the calling thread (no queues, nothing lost), so a test can
//! feed a small known story and decode the trace back.

use std::collections::HashMap;

use xpuscope_perfetto::TraceWriter;
use xpuscope_probes::decode::Decoded;
use xpuscope_probes::decode::table::ProbeTarget;

use super::enrich::LiveEnricher;
use super::interpret::Interpreter;
use crate::events::Event;
use crate::kernel::probes::TableUpdate;
use crate::model::Record;
use crate::model::identity::RankIdentity;
use crate::procfs::ProcessEntry;
use crate::sinks::perfetto::PerfettoSink;
use crate::sinks::summary::offcpu::OffCpuSummary;
use crate::sinks::summary::{RecordTotals, SummarySink};
use crate::sinks::{Sink, SinkCounters};

pub struct TestPipeline {
    pub interpreter: Interpreter,
    enricher: LiveEnricher,
    trace: PerfettoSink<Vec<u8>>,
    summary: SummarySink,
    lost: SinkCounters,
    delivered: Vec<Record>,
}

/// The device counters tests check, from both stages.
#[derive(Debug, Default)]
pub struct DeviceCounts {
    pub calls: u64,
    pub errors: u64,
    pub returns_without_entry: u64,
    pub device_slices: u64,
    pub estimated_slices: u64,
    pub device_flows: u64,
}

pub struct TestStats {
    pub preemptions: u64,
    pub offcpu: OffCpuSummary,
    pub device: DeviceCounts,
}

impl TestPipeline {
    pub fn new() -> Self {
        Self::with_identities(HashMap::new())
    }

    /// With the rank identities the live system would give these
    /// processes (none for any other: the test's pids are not this
    /// machine's).
    pub fn with_identities(identities: HashMap<u32, RankIdentity>) -> Self {
        let mut trace = PerfettoSink::new(TraceWriter::new(Vec::new()));
        trace
            .writer()
            .system_info(&xpuscope_perfetto::SystemInfo {
                release: "6.18.0".into(),
                ..Default::default()
            })
            .expect("writing to a Vec cannot fail");
        Self {
            interpreter: Interpreter::default(),
            enricher: LiveEnricher::default()
                .with_identities(Box::new(move |pid| identities.get(&pid).cloned())),
            trace,
            summary: SummarySink::default(),
            lost: SinkCounters::default(),
            delivered: Vec::new(),
        }
    }

    /// Every record delivered so far, in order.
    pub fn records(&self) -> Vec<Record> {
        self.delivered.clone()
    }

    fn deliver(&mut self, out: Vec<Record>) {
        self.delivered.extend(out.iter().cloned());
        self.trace.on_batch(&out, &self.lost).unwrap();
        self.summary.on_batch(&out, &self.lost).unwrap();
    }

    pub fn initial_processes(&mut self, ts: u64, processes: &[ProcessEntry]) {
        let mut out = Vec::new();
        self.interpreter
            .initial_processes(ts, processes.to_vec(), &mut out);
        self.deliver(out);
    }

    pub fn handle(&mut self, e: Event) {
        let mut out = Vec::new();
        self.interpreter.event(e, &mut self.enricher, &mut out);
        self.deliver(out);
    }

    pub fn drops(&mut self, ts: u64, cpus: &[u32], total: u64) {
        let mut out = Vec::new();
        self.interpreter.drops(ts, cpus.to_vec(), total, &mut out);
        self.deliver(out);
    }

    /// Probe slots attached by file, ahead of any process's plan.
    pub fn slots_added(&mut self, slots: Vec<(u32, ProbeTarget)>) {
        self.interpreter.slots_added(slots);
    }

    pub fn probes_added(&mut self, update: TableUpdate) {
        let mut out = Vec::new();
        self.interpreter
            .probes_added(update, &mut self.enricher, &mut out);
        self.deliver(out);
    }

    /// Decoder output straight into the device interpretation.
    pub fn emit(&mut self, decoded: &mut Vec<Decoded>) {
        let mut out = Vec::new();
        self.interpreter
            .device_emit(decoded, &mut self.enricher, &mut out);
        self.deliver(out);
    }

    /// The interpret stage's in-flight snapshot at `now` (delivered too).
    pub fn in_flight(&mut self, now: u64) -> Vec<Record> {
        let mut out = Vec::new();
        self.interpreter
            .in_flight(now, &mut self.enricher, &mut out);
        self.deliver(out.clone());
        out
    }

    /// Records made by hand (a finding), delivered like the stream's.
    pub fn deliver_records(&mut self, records: Vec<Record>) {
        self.deliver(records);
    }

    pub fn finish(mut self, end: u64) -> (Vec<u8>, TestStats) {
        let mut out = Vec::new();
        self.interpreter.finish(end, &mut out);
        self.deliver(out);
        let counters = self.interpreter.counters;
        let written = self.trace.finish(end, &self.lost).unwrap();
        let t: RecordTotals = self.summary.finish(end, &self.lost).unwrap();
        let device = DeviceCounts {
            calls: t.device.calls,
            errors: t.device.errors,
            returns_without_entry: counters.returns_without_entry,
            device_slices: t.device.device_slices,
            estimated_slices: t.device.estimated_slices,
            device_flows: t.device.device_flows,
        };
        let stats = TestStats {
            preemptions: t.preemptions,
            offcpu: t.offcpu,
            device,
        };
        (written.out, stats)
    }
}
