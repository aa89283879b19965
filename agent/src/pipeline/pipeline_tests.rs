//! Tests of the pipeline as it runs: stages on their threads, sinks behind
//! their queues. A second sink sees the stream the trace and the summary
//! see; a lagging sink loses only its own records, counted; a panicking
//! stage still leaves a finished trace; state per process goes at exit.

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use tokio::sync::mpsc;
use xpuscope_common::EventHeader;
use xpuscope_common::uprobe::{UprobeEntry, UprobeReturn};
use xpuscope_perfetto::TraceWriter;
use xpuscope_probes::catalog::Library;
use xpuscope_probes::decode::table::ProbeTarget;
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

use super::enrich::fake::FakeEnricher;
use super::queue_budget::QueueShare;
use super::{Pipeline, PipelineMsg};
use crate::events::{Comm, Event, Exit, Fork, StackCapture, Switch};
use crate::kernel::probes::TableUpdate;
use crate::model::{RankIdentity, Record};
use crate::sinks::counting::CountingSink;
use crate::sinks::perfetto::PerfettoSink;
use crate::sinks::summary::SummarySink;
use crate::sinks::{FanOut, Sink, SinkCounters};

const APP: u32 = 42;

fn switch(ts: u64, prev: u32, next: u32, prev_target: bool, next_target: bool) -> Event {
    let tgid = |target: bool, tid: u32| if target { APP } else { tid };
    switch_in(
        ts,
        (prev, tgid(prev_target, prev)),
        (next, tgid(next_target, next)),
        prev_target,
        next_target,
    )
}

fn switch_in(
    ts: u64,
    (prev, prev_tgid): (u32, u32),
    (next, next_tgid): (u32, u32),
    prev_target: bool,
    next_target: bool,
) -> Event {
    Event::Switch(Switch {
        cpu: 0,
        ts,
        prev_tid: prev,
        prev_tgid,
        prev_comm: Comm::from_str_lossy("t"),
        prev_state: 1,
        prev_prio: 120,
        next_tid: next,
        next_tgid,
        next_comm: Comm::from_str_lossy("t"),
        next_prio: 120,
        preempt: false,
        prev_target,
        next_target,
        stack_follows: true,
    })
}

fn header(ts: u64) -> EventHeader {
    EventHeader {
        kind: 0,
        cpu: 0,
        ts,
    }
}

fn allreduce(ts: u64) -> [Event; 2] {
    [
        Event::ProbeEntry(Box::new(UprobeEntry {
            header: header(ts),
            tid: APP,
            tgid: APP,
            probe_ip: 0x1000,
            args: [0xa000, 0xb000, 1 << 20, 9, 0, 0xc0c0],
            sp: 0,
            stack: [0; 8],
            deref_len: 0,
            slot: 1,
            deref: [0; 128],
        })),
        Event::ProbeReturn(Box::new(UprobeReturn {
            header: header(ts + 500),
            tid: APP,
            tgid: APP,
            probe_ip: 0x1000,
            ret: 0,
            deref_len: 0,
            slot: 1,
            launches: Default::default(),
            deref: [0; 128],
        })),
    ]
}

fn probes() -> TableUpdate {
    let function = Library::Nccl.function("ncclAllReduce").unwrap();
    TableUpdate {
        tgid: APP,
        probes: vec![(
            0x1000,
            1,
            ProbeTarget {
                library: Library::Nccl,
                function,
                sp_delta: 0,
            },
        )],
        identity: RankIdentity::from_environ(b"RANK=0\0WORLD_SIZE=1\0"),
        maps: Default::default(),
    }
}

/// A story: the app's thread blocks and runs 50 times with a stack each
/// time and calls ncclAllReduce 30 times.
fn story() -> Vec<PipelineMsg> {
    let mut msgs = vec![PipelineMsg::Probes(probes())];
    for i in 0..50u64 {
        let t = 10_000 + i * 10_000;
        let mut batch = vec![
            switch(t, APP, 0, true, false),
            Event::Stack(Box::new(StackCapture {
                cpu: 0,
                ts: t,
                tid: APP,
                tgid: APP,
                kernel: Ok(vec![0xffff_ffff_8100_0000 + i]),
                user: Ok(vec![0x4000]),
                user_copy: None,
                record_bytes: 0,
            })),
            switch(t + 3_000, 0, APP, false, true),
        ];
        if i < 30 {
            batch.extend(allreduce(t + 4_000));
        }
        msgs.push(PipelineMsg::Events(batch, QueueShare::default()));
    }
    msgs
}

fn trace_sink() -> PerfettoSink<Vec<u8>> {
    let mut sink = PerfettoSink::new(TraceWriter::new(Vec::new()));
    sink.writer()
        .system_info(&xpuscope_perfetto::SystemInfo {
            release: "6.18.0".into(),
            ..Default::default()
        })
        .unwrap();
    sink
}

/// Runs `msgs` through a pipeline (on its own thread, as in a recording).
fn run_pipeline(fanout: FanOut, msgs: Vec<PipelineMsg>, enricher: FakeEnricher) -> Result<()> {
    let (tx, rx) = mpsc::channel(4);
    let pipeline =
        std::thread::spawn(move || Pipeline::new(enricher, fanout).run(rx, || 1_000_000_000));
    for m in msgs {
        tx.blocking_send(m).unwrap();
    }
    drop(tx);
    pipeline.join().unwrap().map(|_| ())
}

#[test]
fn every_sink_sees_the_same_stream() {
    let mut fanout = FanOut::default();
    let trace = fanout.add("trace", trace_sink(), 64).unwrap();
    // As in a recording: the summary on the pipeline's thread.
    let summary = fanout.add_inline("summary", SummarySink::default());
    let counting = fanout.add("count", CountingSink::default(), 64).unwrap();
    run_pipeline(fanout, story(), FakeEnricher::default()).unwrap();

    let (t_report, c_report) = (trace.report(), counting.report());
    assert_eq!(
        summary.report().delivered_records,
        c_report.delivered_records
    );
    let bytes = trace.join().unwrap().out;
    let totals = summary.join().unwrap();
    let counts = counting.join().unwrap();

    // Nothing lost, and every sink was offered the same records.
    assert_eq!(t_report.dropped_records, 0);
    assert_eq!(t_report.delivered_records, c_report.delivered_records);
    let total: u64 = counts.per_kind.values().sum();
    assert_eq!(total, c_report.delivered_records);
    // The counting sink agrees with the summary...
    assert_eq!(counts.per_kind["off_cpu"], 50);
    assert_eq!(counts.per_kind["device_call"], totals.device.calls);
    assert_eq!(counts.calls_per_function["ncclAllReduce"], 30);
    assert_eq!(totals.functions[0].calls, 30);
    assert_eq!(totals.offcpu.total_ns, 50 * 3_000);
    assert_eq!(totals.offcpu.with_stack_ns, 50 * 3_000);
    // ... and with what the trace shows.
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    assert_eq!(tl.slices_on_thread(APP as i32).len(), 30);
    assert_eq!(tl.stack_samples.len(), 50);
    assert_eq!(
        tl.processes[&(APP as i32)].name.as_deref(),
        Some("rank 0/1")
    );
}

/// A sink that waits on a gate before its first batch returns.
struct GatedSink {
    entered: std_mpsc::Sender<()>,
    gate: Arc<Mutex<std_mpsc::Receiver<()>>>,
    seen: u64,
}

impl Sink for GatedSink {
    type Output = u64;
    fn on_batch(&mut self, batch: &[Record], _lost: &SinkCounters) -> Result<()> {
        if self.seen == 0 {
            let _ = self.entered.send(());
            let _ = self.gate.lock().unwrap().recv();
        }
        self.seen += batch.len() as u64;
        Ok(())
    }
    fn finish(self, _end: u64, _lost: &SinkCounters) -> Result<u64> {
        Ok(self.seen)
    }
}

#[test]
fn a_lagging_sink_loses_only_its_own_records_counted() {
    let (entered_tx, entered) = std_mpsc::channel();
    let (open, gate) = std_mpsc::channel();
    let mut fanout = FanOut::default();
    let slow = fanout
        .add(
            "slow",
            GatedSink {
                entered: entered_tx,
                gate: Arc::new(Mutex::new(gate)),
                seen: 0,
            },
            1,
        )
        .unwrap();
    let counting = fanout.add("count", CountingSink::default(), 1024).unwrap();
    let (tx, rx) = mpsc::channel(1024);
    let pipeline = std::thread::spawn(move || {
        Pipeline::new(FakeEnricher::default(), fanout).run(rx, || 1_000_000_000)
    });
    let mut msgs = story().into_iter();
    // The first batch reaches the slow sink, which then blocks.
    tx.blocking_send(msgs.next().unwrap()).unwrap();
    tx.blocking_send(msgs.next().unwrap()).unwrap();
    entered.recv().unwrap();
    for m in msgs {
        tx.blocking_send(m).unwrap();
    }
    drop(tx);
    // The pipeline ends without waiting for the slow sink (its end message
    // waits for room only after every batch was offered).
    let waiter = std::thread::spawn(move || pipeline.join().unwrap());
    std::thread::sleep(std::time::Duration::from_millis(200));
    open.send(()).unwrap();
    waiter.join().unwrap().unwrap();

    let slow_report = slow.report();
    let count_report = counting.report();
    let seen = slow.join().unwrap();
    let counts = counting.join().unwrap();
    assert_eq!(
        count_report.dropped_records, 0,
        "the other sink lost nothing"
    );
    assert_eq!(
        counts.per_kind.values().sum::<u64>(),
        count_report.delivered_records
    );
    assert!(slow_report.dropped_records > 0, "{slow_report:?}");
    assert!(slow_report.dropped_batches > 0);
    assert_eq!(
        slow_report.delivered_records + slow_report.dropped_records,
        count_report.delivered_records,
        "every record offered is either delivered or counted as dropped"
    );
    assert_eq!(seen, slow_report.delivered_records);
}

/// An enricher that panics when asked to symbolize.
struct PanickingEnricher(FakeEnricher);

impl super::enrich::Enrich for PanickingEnricher {
    fn kernel_frames(&mut self, _addrs: &[u64]) -> Vec<crate::model::SymFrame> {
        panic!("symbolizer bug")
    }
    fn user_frames(&mut self, tgid: u32, addrs: &[u64]) -> Vec<crate::model::SymFrame> {
        self.0.user_frames(tgid, addrs)
    }
    fn unwind_user(
        &mut self,
        tgid: u32,
        ts: u64,
        copy: &crate::events::UserCopy,
    ) -> Option<super::enrich::UnwoundUser> {
        self.0.unwind_user(tgid, ts, copy)
    }
    fn remote_string(&mut self, tgid: u32, ptr: u64) -> Result<String, String> {
        self.0.remote_string(tgid, ptr)
    }
    fn cmdline(&mut self, pid: u32) -> Vec<String> {
        self.0.cmdline(pid)
    }
    fn ppid(&mut self, pid: u32) -> u32 {
        self.0.ppid(pid)
    }
    fn process_forked(&mut self, child: u32, parent: u32) {
        self.0.process_forked(child, parent)
    }
    fn process_exec(&mut self, tgid: u32) {
        self.0.process_exec(tgid)
    }
    fn process_ended(&mut self, tgid: u32) {
        self.0.process_ended(tgid)
    }
    fn remember_maps(&mut self, tgid: u32, maps: xpuscope_probes::maps::ProcessMaps) {
        self.0.remember_maps(tgid, maps)
    }
}

#[test]
fn a_panicking_stage_ends_the_run_with_an_error_and_a_finished_trace() {
    let mut fanout = FanOut::default();
    let trace = fanout.add("trace", trace_sink(), 64).unwrap();
    let (tx, rx) = mpsc::channel(64);
    let pipeline = std::thread::spawn(move || {
        Pipeline::new(PanickingEnricher(FakeEnricher::default()), fanout).run(rx, || 1_000_000_000)
    });
    let mut msgs = story().into_iter();
    tx.blocking_send(msgs.next().unwrap()).unwrap();
    // The second message holds a stack: symbolizing it panics.
    let _ = tx.blocking_send(msgs.next().unwrap());
    drop(tx);
    let err = pipeline.join().unwrap().unwrap_err();
    assert!(
        err.to_string()
            .contains("interpret stage panicked: symbolizer bug"),
        "{err}"
    );
    let bytes = trace.join().unwrap().out;
    let trace = decode(&bytes).expect("a finished, valid trace");
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    assert_eq!(
        tl.processes[&(APP as i32)].name.as_deref(),
        Some("rank 0/1"),
        "what came before the panic is in the trace"
    );
}

/// A sink whose first batch panics.
struct PanickingSink;

impl Sink for PanickingSink {
    type Output = ();
    fn on_batch(&mut self, _batch: &[Record], _lost: &SinkCounters) -> Result<()> {
        panic!("sink bug")
    }
    fn finish(self, _end: u64, _lost: &SinkCounters) -> Result<()> {
        Ok(())
    }
}

#[test]
fn a_panicking_sink_stops_alone() {
    let mut fanout = FanOut::default();
    let bad = fanout.add("bad", PanickingSink, 1).unwrap();
    let counting = fanout.add("count", CountingSink::default(), 1024).unwrap();
    run_pipeline(fanout, story(), FakeEnricher::default()).unwrap();
    let err = bad.join().unwrap_err();
    assert!(
        err.to_string().contains("the bad sink panicked: sink bug"),
        "{err}"
    );
    let counts = counting.join().unwrap();
    assert_eq!(
        counts.per_kind["off_cpu"], 50,
        "the other sink got everything"
    );
}

/// A sink on the pipeline's thread that panics stops alone too: the
/// pipeline goes on, its records count as lost, and the panic is its error.
#[test]
fn a_panicking_inline_sink_stops_alone() {
    let mut fanout = FanOut::default();
    let bad = fanout.add_inline("bad", PanickingSink);
    let counting = fanout.add("count", CountingSink::default(), 1024).unwrap();
    run_pipeline(fanout, story(), FakeEnricher::default()).unwrap();
    let report = bad.report();
    let err = bad.join().unwrap_err();
    assert!(
        format!("{err:#}").contains("the bad sink panicked: sink bug"),
        "{err:#}"
    );
    let count_report = counting.report();
    assert_eq!(counting.join().unwrap().per_kind["off_cpu"], 50);
    assert!(report.dropped_records > 0, "{report:?}");
    assert_eq!(
        report.delivered_records + report.dropped_records,
        count_report.delivered_records,
        "every record offered is either delivered or counted as dropped"
    );
}

/// 20,000 short-lived child processes: nothing about them stays behind.
#[test]
fn state_per_process_goes_when_it_exits() {
    let mut fanout = FanOut::default();
    let counting = fanout
        .add("count", CountingSink::default(), 1 << 16)
        .unwrap();
    let mut p = Pipeline::new(FakeEnricher::default(), fanout);
    p.handle(PipelineMsg::Probes(probes()));
    for i in 0..20_000u32 {
        let child = 100_000 + i;
        let ts = 1_000_000 + u64::from(i) * 1_000;
        p.handle(PipelineMsg::Events(
            vec![
                Event::Fork(Fork {
                    cpu: 0,
                    ts,
                    parent_tid: APP,
                    parent_tgid: APP,
                    child_tid: child,
                    child_tgid: child,
                    child_comm: Comm::from_str_lossy("child"),
                }),
                switch_in(ts + 10, (0, 0), (child, child), false, true),
                // It blocks (an off-CPU interval opens), then exits.
                switch_in(ts + 20, (child, child), (0, 0), true, false),
                Event::Exit(Exit {
                    cpu: 0,
                    ts: ts + 500,
                    tid: child,
                    tgid: child,
                    prio: 120,
                    comm: Comm::from_str_lossy("child"),
                    group_dead: true,
                    group_known: true,
                    exit_code: None,
                }),
            ],
            QueueShare::default(),
        ));
    }
    assert_eq!(p.interpreter.threads_alive(), 0, "no thread state left");
    assert_eq!(p.enricher.ended.len(), 20_000, "the enricher forgot each");
    assert_eq!(p.interpreter.counters.threads_seen, 20_000);
    p.finish(30_000_000_000);
    let counts = counting.join().unwrap();
    assert_eq!(counts.per_kind["new_task"], 20_000);
    assert_eq!(counts.per_kind["exit"], 20_000);
}

/// Probe announcements overtake queued event batches: slots announced
/// after three batches with their hits were queued (a starting program's
/// libraries probed by file while collect's queue is full) still name
/// every hit, and the process's own table is not needed.
#[test]
fn announcements_are_read_before_queued_batches() {
    let mut fanout = FanOut::default();
    let counting = fanout.add("count", CountingSink::default(), 64).unwrap();
    let (tx, rx) = mpsc::channel(8);
    let (announce, announce_rx) = std::sync::mpsc::channel();
    for i in 0..3u64 {
        tx.blocking_send(PipelineMsg::Events(
            allreduce(100_000 * (i + 1)).to_vec(),
            QueueShare::default(),
        ))
        .unwrap();
    }
    let target = probes().probes[0].2;
    announce
        .send(PipelineMsg::ProbeSlots(vec![(1, target)]))
        .unwrap();
    drop(tx);
    Pipeline::new(FakeEnricher::default(), fanout)
        .with_announcements(announce_rx)
        .run(rx, || 1_000_000_000)
        .unwrap();
    let counts = counting.join().unwrap();
    assert_eq!(counts.calls_per_function["ncclAllReduce"], 3, "{counts:?}");
}

/// An inline sink with a verdict only at the end (as the detectors'
/// pending late arrivals): it sends it back to the pipeline as it finishes.
struct VerdictAtEnd(std_mpsc::Sender<Record>);

impl Sink for VerdictAtEnd {
    type Output = ();
    fn on_batch(&mut self, _batch: &[Record], _lost: &SinkCounters) -> Result<()> {
        Ok(())
    }
    fn finish(self, end: u64, _lost: &SinkCounters) -> Result<()> {
        let _ = self.0.send(Record::Finding(Box::new(crate::model::Finding {
            link: Default::default(),
            kind: crate::model::FindingKind::SlowLink,
            ranks: vec![2],
            comm: None,
            seq: None,
            step: None,
            start_ns: end,
            end_ns: None,
            summary: "slow link through rank 2".into(),
            evidence: serde_json::json!({}),
            detected_ns: end,
        })));
        Ok(())
    }
}

#[test]
fn findings_made_as_the_recording_ends_reach_the_trace() {
    let (tx, rx) = std_mpsc::channel();
    let mut fanout = FanOut::default();
    let trace = fanout.add("trace", trace_sink(), 64).unwrap();
    let counting = fanout.add("count", CountingSink::default(), 64).unwrap();
    let _verdict = fanout.add_inline("detect", VerdictAtEnd(tx));
    let (msg_tx, msg_rx) = mpsc::channel(4);
    let pipeline = std::thread::spawn(move || {
        Pipeline::new(FakeEnricher::default(), fanout)
            .with_findings(rx)
            .run(msg_rx, || 1_000_000_000)
    });
    for m in story() {
        msg_tx.blocking_send(m).unwrap();
    }
    drop(msg_tx);
    pipeline.join().unwrap().unwrap();
    assert_eq!(counting.join().unwrap().per_kind.get("finding"), Some(&1));
    let tl = Timeline::new(&decode(&trace.join().unwrap().out).unwrap());
    let findings: Vec<&str> = tl
        .slices
        .iter()
        .filter(|s| {
            tl.tracks
                .get(&s.track)
                .is_some_and(|t| t.name.as_deref() == Some("xpuscope findings"))
        })
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(findings, ["slow_link"]);
}

/// `agent diagnose` reads trace files a user hands it: a trace of this
/// pipeline, then thousands of seeded mutations of it (bytes flipped,
/// overwritten, cut), each read back without a panic (an error is fine)
/// and without growing without bound.
#[test]
fn diagnose_survives_mutated_traces() {
    let mut fanout = FanOut::default();
    let trace = fanout.add("trace", trace_sink(), 64).unwrap();
    run_pipeline(fanout, story(), FakeEnricher::default()).unwrap();
    let good = trace.join().unwrap().out;
    let dir = std::env::temp_dir().join(format!("xpuscope-diag-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.pftrace");
    std::fs::write(&path, &good).unwrap();
    let found = crate::diagnose::diagnose(std::slice::from_ref(&path), Default::default());
    assert!(found.is_ok(), "the unmutated trace: {found:?}");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..1_500 {
        let mut bytes = good.clone();
        for _ in 0..1 + next() % 8 {
            let at = (next() % bytes.len() as u64) as usize;
            match next() % 4 {
                0 => bytes[at] ^= 1 << (next() % 8),
                1 => bytes[at] = 0xff,
                2 => bytes[at] = next() as u8,
                _ => bytes.truncate(at.max(1)),
            }
        }
        std::fs::write(&path, &bytes).unwrap();
        let _ = crate::diagnose::diagnose(std::slice::from_ref(&path), Default::default());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
