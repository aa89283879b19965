//! The metrics sink over synthetic records, checked on the rendered text.

use std::sync::Arc;

use xpuscope_probes::catalog::{CallKind, Collective, Library, SyncKind, Vendor};
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::{CallArgs, CollectiveArgs};
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::enums::{DataType, RedOp};
use xpuscope_probes::decode::memory::{Device, MemoryEffect};

use super::series::MAX_SERIES;
use super::*;
use crate::events::{Comm, Exit};
use crate::model::{Preemptor, StepSplit, StepSplitRecord};

const MS: u64 = 1_000_000;

fn call(tgid: u32, start: u64, dur: u64, kind: CallKind, args: CallArgs) -> DeviceCall {
    DeviceCall {
        library: Library::Nccl,
        function: "f",
        kind,
        tgid,
        tid: tgid,
        start_ts: start,
        end_ts: Some(start + dur),
        args,
        ret: Some(0),
        error: false,
        name: String::new(),
        comm: None,
        memory: None,
        site: None,
        launches: None,
    }
}

fn allreduce(tgid: u32, start: u64, dur: u64, seq: u64, comm_hash: u64) -> Record {
    let mut c = call(
        tgid,
        start,
        dur,
        CallKind::Collective(Collective::AllReduce),
        CallArgs::Collective(CollectiveArgs {
            op: Collective::AllReduce,
            count: Some(1 << 20),
            dtype: Some(DataType::Bf16),
            bytes: Some(2 << 20),
            red_op: Some(RedOp::Sum),
            root: None,
            send: None,
            recv: None,
            comm: 0xc0c0,
            stream: None,
        }),
    );
    c.comm = Some(CommContext {
        handle: 0xc0c0,
        id_hash: Some(comm_hash),
        rank: Some(0),
        size: Some(2),
        seq: Some(seq),
        seq_exact: true,
    });
    Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
}

fn sync(tgid: u32, start: u64, dur: u64) -> Record {
    let mut c = call(
        tgid,
        start,
        dur,
        CallKind::Sync(SyncKind::Stream),
        CallArgs::Sync {
            stream: Some(7),
            event: None,
        },
    );
    c.library = Library::Cudart;
    Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
}

fn malloc(tgid: u32, held_after: u64, failed: bool) -> Record {
    let mut c = call(tgid, 0, 1_000, CallKind::Malloc, CallArgs::None);
    c.library = Library::Cudart;
    c.memory = Some(MemoryEffect {
        device: Device {
            vendor: Vendor::Nvidia,
            index: 1,
        },
        delta: if failed { 0 } else { 1 << 20 },
        held_after,
        failed_request: failed.then_some(1 << 40),
        untracked: false,
        site: None,
    });
    Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
}

fn identity(tgid: u32, rank: u32) -> Record {
    Record::Identity {
        tgid,
        identity: Box::new(RankIdentity::from_environ(
            format!("RANK={rank}\0LOCAL_RANK={rank}\0WORLD_SIZE=2\0XPUSCOPE_JOB=llama\0")
                .as_bytes(),
        )),
    }
}

fn lines_with<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(prefix)).collect()
}

fn value(text: &str, series: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn families_render_from_records() {
    let (mut sink, handle, sources) = MetricsSink::new("node-a");
    let lost = SinkCounters::default();
    let mut batch = vec![identity(10, 0), identity(11, 1)];
    for seq in 0..5u64 {
        batch.push(allreduce(10, seq * 100 * MS, 2 * MS, seq, 0x1a2b_3c4d));
        if seq < 3 {
            // Rank 1 is behind.
            batch.push(allreduce(11, seq * 100 * MS, 50 * MS, seq, 0x1a2b_3c4d));
        }
    }
    batch.push(sync(10, 0, 3 * MS));
    batch.push(malloc(10, 3 << 20, false));
    batch.push(malloc(10, 3 << 20, true));
    batch.push(Record::OffCpu(OffCpuInterval {
        tid: 10,
        tgid: 10,
        cpu: 0,
        start: 0,
        end: 250 * MS,
        state: 0,
        stack: None,
        preempted_by: Some(Preemptor {
            tid: 99,
            tgid: 99,
            comm: Comm::from_str_lossy("noisy"),
            in_job: false,
        }),
        truncated: false,
    }));
    batch.push(Record::Drops {
        ts: 1,
        cpus: vec![0],
        total: 7,
    });
    sink.on_batch(&batch, &lost).unwrap();
    // The agent's own figures come from the sources the service plugs in.
    let other = Arc::new(SinkCounters::default());
    other
        .delivered_records
        .store(40, std::sync::atomic::Ordering::Relaxed);
    other
        .dropped_records
        .store(3, std::sync::atomic::Ordering::Relaxed);
    sources
        .sinks
        .lock()
        .unwrap()
        .push(("flight_recorder", other));
    let stats = Arc::new(RecorderStats::default());
    stats
        .bytes
        .store(12345, std::sync::atomic::Ordering::Relaxed);
    stats
        .trigger(Trigger::Hang)
        .written
        .store(2, std::sync::atomic::Ordering::Relaxed);
    *sources.recorder.lock().unwrap() = Some(stats);
    let code = &sources.caches.python;
    code.added(5000);
    code.added(3000);
    code.evicted(3000);
    code.refused(2);
    sink.on_tick(0, &lost).unwrap();

    let text = handle.render();
    // The training job is `training_job`: `job` and `instance` are the
    // scrape's own in Prometheus.
    assert!(
        !text
            .lines()
            .any(|l| l.contains("{job=") || l.contains(",job=")),
        "{text}"
    );
    // The build, and the agent's own cost under the standard names.
    let build = format!(
        "xpuscope_build_info{{version=\"{}\",commit=\"{}\"}}",
        env!("CARGO_PKG_VERSION"),
        env!("XPUSCOPE_COMMIT")
    );
    assert_eq!(value(&text, &build), 1.0);
    assert!(value(&text, "process_cpu_seconds_total") > 0.0, "{text}");
    assert!(
        value(&text, "process_resident_memory_bytes") > 1e6,
        "{text}"
    );
    assert!(value(&text, "process_open_fds") >= 3.0, "{text}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = value(&text, "process_start_time_seconds");
    assert!(
        started <= now && started > now - 3600.0,
        "started {started}, now {now}"
    );
    let r0 = r#"training_job="llama",rank="0",local_rank="0",node="node-a""#;
    let r1 = r#"training_job="llama",rank="1",local_rank="1",node="node-a""#;
    let coll = r#"comm="nccl:1a2b3c4d",op="allreduce",dtype="bf16""#;
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_collective_duration_seconds_count{{{r0},{coll}}}")
        ),
        5.0
    );
    assert!(
        (value(
            &text,
            &format!("xpuscope_collective_duration_seconds_sum{{{r1},{coll}}}")
        ) - 0.15)
            .abs()
            < 1e-9
    );
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_collective_bytes_total{{{r0},{coll}}}")
        ),
        (5 * (2 << 20)) as f64
    );
    // The lagging rank shows in last_seq.
    let comm = r#"comm="nccl:1a2b3c4d""#;
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_collective_last_seq{{{r0},{comm}}}")
        ),
        4.0
    );
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_collective_last_seq{{{r1},{comm}}}")
        ),
        2.0
    );
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_sync_duration_seconds_count{{{r0}}}")
        ),
        1.0
    );
    let dev = format!("{r0},device=\"gpu1\"");
    assert_eq!(
        value(&text, &format!("xpuscope_device_memory_bytes{{{dev}}}")),
        (3 << 20) as f64
    );
    assert_eq!(
        value(&text, &format!("xpuscope_device_ooms_total{{{dev}}}")),
        1.0
    );
    assert_eq!(
        value(&text, &format!("xpuscope_off_cpu_seconds_total{{{r0}}}")),
        0.25
    );
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_runqueue_delay_seconds_count{{{r0}}}")
        ),
        1.0
    );
    assert_eq!(
        value(&text, r#"xpuscope_agent_records_total{kind="device_call"}"#),
        11.0
    );
    assert_eq!(
        value(&text, "xpuscope_agent_kernel_dropped_events_total"),
        7.0
    );
    assert_eq!(
        value(
            &text,
            r#"xpuscope_agent_sink_records_total{sink="flight_recorder",outcome="dropped"}"#
        ),
        3.0
    );
    assert_eq!(value(&text, "xpuscope_flight_recorder_bytes"), 12345.0);
    assert_eq!(
        value(
            &text,
            r#"xpuscope_flight_recorder_dumps_total{trigger="hang",outcome="written"}"#
        ),
        2.0
    );
    assert!(value(&text, "xpuscope_agent_resident_bytes") > 1e6);
    for (series, want) in [
        (r#"xpuscope_agent_cache_bytes{cache="python"}"#, 5000.0),
        (
            r#"xpuscope_agent_cache_evictions_total{cache="python"}"#,
            1.0,
        ),
        (
            r#"xpuscope_agent_cache_evicted_bytes_total{cache="python"}"#,
            3000.0,
        ),
        (r#"xpuscope_agent_cache_refused_total{cache="python"}"#, 2.0),
        (r#"xpuscope_agent_cache_bytes{cache="cfi"}"#, 0.0),
        (r#"xpuscope_agent_cache_evictions_total{cache="cfi"}"#, 0.0),
    ] {
        assert_eq!(value(&text, series), want, "{series}");
    }
    assert!(text.ends_with("# EOF\n"));

    // A process that ends takes its memory gauge with it.
    sink.on_batch(&[exit(10, 1)], &lost).unwrap();
    assert!(lines_with(&handle.render(), "xpuscope_device_memory_bytes{").is_empty());
    assert!(handle.alive(crate::host::boottime_ns()));
    assert!(!handle.alive(crate::host::boottime_ns() + 2 * LIVENESS_NS));
}

#[test]
fn cardinality_is_bounded_and_folds_are_counted() {
    let (mut sink, handle, _) = MetricsSink::new("node-a");
    let lost = SinkCounters::default();
    // 3,000 distinct communicators on one rank: past MAX_SERIES they fold.
    let batch: Vec<Record> = (0..3_000u64)
        .map(|i| allreduce(10, i * MS, MS, i, 0x1000_0000 + i))
        .collect();
    sink.on_batch(&batch, &lost).unwrap();
    let text = handle.render();
    let series = lines_with(&text, "xpuscope_collective_duration_seconds_count{");
    assert_eq!(
        series.len(),
        MAX_SERIES + 1,
        "the bound and one folded series"
    );
    let folded = series
        .iter()
        .find(|l| l.contains(r#"comm="other""#))
        .expect("a folded series");
    assert!(folded.ends_with(" 1000"), "{folded}");
    assert_eq!(
        value(
            &text,
            r#"xpuscope_metrics_series_folded_total{family="collective"}"#
        ),
        1000.0
    );
    assert_eq!(
        lines_with(&text, "xpuscope_collective_last_seq{").len(),
        MAX_SERIES + 1
    );
}

/// The hang gauge follows the in-flight snapshots (the oldest call per
/// rank, 0 once nothing runs), and findings are counted by kind.
#[test]
fn the_hang_gauge_and_findings() {
    use crate::model::{Finding, FindingKind, InFlightSnapshot, OpenCall, ThreadNow};
    let (mut sink, handle, _sources) = MetricsSink::new("node-a");
    let lost = SinkCounters::default();
    let open = |tgid: u32, start: u64| OpenCall {
        tgid,
        tid: tgid,
        library: Library::Nccl,
        function: "ncclAllReduce",
        kind: CallKind::Collective(Collective::AllReduce),
        start_ts: start,
        comm: None,
        peer: None,
        thread: ThreadNow::Unknown,
    };
    let snap = |ts: u64, calls: Vec<OpenCall>| {
        Record::InFlight(Box::new(InFlightSnapshot {
            ts,
            calls,
            main_threads: Vec::new(),
        }))
    };
    let text = handle.render();
    let rank0 = "xpuscope_in_flight_oldest_seconds{training_job=\"llama\",rank=\"0\",local_rank=\"0\",node=\"node-a\"}";
    assert_eq!(value(&text, "xpuscope_findings_total{kind=\"hang\"}"), 0.0);
    sink.on_batch(
        &[
            identity(10, 0),
            identity(11, 1),
            snap(
                10_000 * MS,
                vec![
                    open(10, 2_500 * MS),
                    open(10, 9_000 * MS),
                    open(11, 9_500 * MS),
                ],
            ),
        ],
        &lost,
    )
    .unwrap();
    let text = handle.render();
    assert_eq!(value(&text, rank0), 7.5);
    sink.on_batch(&[snap(11_000 * MS, vec![open(11, 9_500 * MS)])], &lost)
        .unwrap();
    let text = handle.render();
    assert_eq!(value(&text, rank0), 0.0, "rank 0's calls returned");
    sink.on_batch(
        &[Record::Finding(Box::new(Finding {
            link: Default::default(),
            kind: FindingKind::Hang,
            ranks: vec![1],
            comm: None,
            seq: None,
            step: None,
            start_ns: 9_500 * MS,
            end_ns: None,
            summary: "hang".into(),
            evidence: serde_json::json!({}),
            detected_ns: 11_000 * MS,
        }))],
        &lost,
    )
    .unwrap();
    let text = handle.render();
    assert_eq!(value(&text, "xpuscope_findings_total{kind=\"hang\"}"), 1.0);
    assert_eq!(value(&text, "xpuscope_findings_total{kind=\"crash\"}"), 0.0);
    assert_eq!(value(&text, "xpuscope_incidents_total{kind=\"hang\"}"), 1.0);
    // A peer's hang that follows from it: a finding, not another fault.
    let mut peer = Finding {
        link: Default::default(),
        kind: FindingKind::Hang,
        ranks: vec![0],
        comm: None,
        seq: None,
        step: None,
        start_ns: 9_600 * MS,
        end_ns: None,
        summary: "hang".into(),
        evidence: serde_json::json!({}),
        detected_ns: 11_000 * MS,
    };
    peer.link.follows_from = Some("hang: rank 1".into());
    sink.on_batch(&[Record::Finding(Box::new(peer))], &lost)
        .unwrap();
    let text = handle.render();
    assert_eq!(value(&text, "xpuscope_findings_total{kind=\"hang\"}"), 2.0);
    assert_eq!(value(&text, "xpuscope_incidents_total{kind=\"hang\"}"), 1.0);
    assert_eq!(
        value(&text, "xpuscope_incidents_total{kind=\"crash\"}"),
        0.0
    );
}

fn exit(tgid: u32, ts: u64) -> Record {
    Record::Exit {
        exit: Exit {
            cpu: 0,
            ts,
            tid: tgid,
            tgid,
            prio: 120,
            comm: Comm::from_str_lossy("python"),
            group_dead: true,
            group_known: true,
            exit_code: None,
        },
        process_ended: true,
    }
}

/// A node runs job after job: a rank's series are served for the
/// retention after its processes exit, then removed, while a live rank's
/// stay; a process whose exit the stream lost is found gone by the sweep.
#[test]
fn series_of_exited_ranks_go_after_the_retention() {
    use super::series::EXITED_SERIES_RETENTION_NS as RETAIN;
    let (mut sink, handle, _) = MetricsSink::new("node-a");
    // Process 12's exit never reaches the sink; 10 and 11 "run" until the
    // records say otherwise.
    sink.alive = |tgid| tgid != 12;
    let lost = SinkCounters::default();
    let mut batch = Vec::new();
    for (tgid, rank) in [(10, 0), (11, 1), (12, 2)] {
        batch.push(identity(tgid, rank));
        batch.push(allreduce(tgid, MS, MS, 1, 0xabcd));
        batch.push(sync(tgid, 3 * MS, MS));
    }
    sink.on_batch(&batch, &lost).unwrap();
    let ranks_in = |text: &str| -> Vec<String> {
        let mut r: Vec<String> = lines_with(text, "xpuscope_collective_duration_seconds_count{")
            .iter()
            .chain(lines_with(text, "xpuscope_sync_duration_seconds_count{").iter())
            .chain(lines_with(text, "xpuscope_collective_last_seq{").iter())
            .map(|l| {
                let at = l.find("rank=\"").unwrap() + 6;
                l[at..at + 1].to_string()
            })
            .collect();
        r.sort();
        r.dedup();
        r
    };
    assert_eq!(ranks_in(&handle.render()), ["0", "1", "2"]);
    assert_eq!(
        lines_with(
            &handle.render(),
            "xpuscope_collective_duration_seconds_count{"
        )
        .len(),
        3
    );

    sink.on_batch(&[exit(10, 1_000 * MS)], &lost).unwrap();
    // The sweep finds 12 gone at 30 s.
    sink.on_tick(30_000 * MS, &lost).unwrap();
    sink.on_tick(1_000 * MS + RETAIN - MS, &lost).unwrap();
    assert_eq!(
        ranks_in(&handle.render()),
        ["0", "1", "2"],
        "still inside the retention"
    );
    sink.on_tick(1_000 * MS + RETAIN + 10_000 * MS, &lost)
        .unwrap();
    assert_eq!(ranks_in(&handle.render()), ["1", "2"], "rank 0 went");
    sink.on_tick(30_000 * MS + RETAIN + 10_000 * MS, &lost)
        .unwrap();
    let text = handle.render();
    assert_eq!(ranks_in(&text), ["1"], "rank 2 went too");
    // Rank 1's series survive and go on counting.
    sink.on_batch(&[allreduce(11, 5 * MS, MS, 2, 0xabcd)], &lost)
        .unwrap();
    let text = handle.render();
    let count = lines_with(&text, "xpuscope_collective_duration_seconds_count{");
    assert_eq!(count.len(), 1);
    assert!(count[0].ends_with(" 2"), "{count:?}");
    assert_eq!(sink.book.sizes(), (1, 1), "only rank 1 and process 11 kept");
    // Counters of the agent itself are never removed.
    assert_eq!(
        value(&text, r#"xpuscope_agent_records_total{kind="device_call"}"#),
        7.0
    );
}

/// On a loaded machine the pipeline runs behind the kernel: a rank can be
/// gone from `/proc` while its last calls are still on the way. A sweep in
/// between keeps its labels, so those calls count under its rank.
#[test]
fn calls_arriving_after_the_process_left_proc_keep_its_rank() {
    let (mut sink, handle, _) = MetricsSink::new("node-a");
    sink.alive = |_| false;
    let lost = SinkCounters::default();
    sink.on_batch(&[identity(10, 0), allreduce(10, MS, MS, 1, 0xabcd)], &lost)
        .unwrap();
    sink.on_tick(20_000 * MS, &lost).unwrap();
    sink.on_batch(&[allreduce(10, 2 * MS, MS, 2, 0xabcd)], &lost)
        .unwrap();
    let text = handle.render();
    let count = lines_with(&text, "xpuscope_collective_duration_seconds_count{");
    assert_eq!(count.len(), 1, "one series, the rank's: {count:?}");
    assert!(
        count[0].contains(r#"rank="0""#) && count[0].ends_with(" 2"),
        "{count:?}"
    );
    // Gone at the next sweep too: its exit was lost; it is dropped.
    sink.on_tick(40_000 * MS, &lost).unwrap();
    assert!(sink.ranks.is_empty() && sink.gone_since.is_empty());
}

/// Removing a finished job's series gives their room under the bound back:
/// the next job's series are not folded.
#[test]
fn the_bound_frees_the_room_of_removed_series() {
    use super::series::EXITED_SERIES_RETENTION_NS as RETAIN;
    let (mut sink, handle, _) = MetricsSink::new("node-a");
    sink.alive = |_| true;
    let lost = SinkCounters::default();
    let batch: Vec<Record> = (0..MAX_SERIES as u64)
        .map(|i| allreduce(10, i * MS, MS, i, 0x1000_0000 + i))
        .collect();
    sink.on_batch(&batch, &lost).unwrap();
    sink.on_batch(&[exit(10, 10_000 * MS)], &lost).unwrap();
    sink.on_tick(10_000 * MS + RETAIN, &lost).unwrap();
    let text = handle.render();
    assert!(lines_with(&text, "xpuscope_collective_duration_seconds_count{").is_empty());
    assert!(lines_with(&text, "xpuscope_collective_last_seq{").is_empty());
    // The next job: its first communicator is a series of its own.
    sink.on_batch(&[identity(20, 3), allreduce(20, MS, MS, 1, 0xfeed)], &lost)
        .unwrap();
    let text = handle.render();
    let count = lines_with(&text, "xpuscope_collective_duration_seconds_count{");
    assert_eq!(count.len(), 1, "{count:?}");
    assert!(count[0].contains(r#"rank="3""#), "{count:?}");
    assert!(lines_with(&text, "xpuscope_metrics_series_folded_total{").is_empty());
    assert_eq!(sink.book.sizes(), (1, 1));
}

fn off_cpu(tgid: u32, ms: u64) -> Record {
    Record::OffCpu(OffCpuInterval {
        tid: tgid,
        tgid,
        cpu: 0,
        start: 0,
        end: ms * MS,
        state: 0,
        stack: None,
        preempted_by: None,
        truncated: false,
    })
}

/// A process's series are resolved once and reused; when its identity
/// arrives later, what it feeds from then on is its rank's series.
#[test]
fn a_process_feeds_its_new_rank_after_its_identity() {
    let (mut sink, handle, _) = MetricsSink::new("node-a");
    sink.alive = |_| true;
    let lost = SinkCounters::default();
    sink.on_batch(
        &[off_cpu(10, 100), off_cpu(10, 100), sync(10, 0, MS)],
        &lost,
    )
    .unwrap();
    sink.on_batch(
        &[
            identity(10, 0),
            off_cpu(10, 250),
            sync(10, 0, MS),
            sync(10, 0, MS),
            allreduce(10, MS, MS, 7, 0xabcd),
            allreduce(10, 3 * MS, MS, 8, 0xabcd),
        ],
        &lost,
    )
    .unwrap();
    let text = handle.render();
    let before = r#"training_job="",rank="",local_rank="",node="node-a""#;
    let after = r#"training_job="llama",rank="0",local_rank="0",node="node-a""#;
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_off_cpu_seconds_total{{{before}}}")
        ),
        0.2
    );
    assert_eq!(
        value(&text, &format!("xpuscope_off_cpu_seconds_total{{{after}}}")),
        0.25
    );
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_sync_duration_seconds_count{{{before}}}")
        ),
        1.0
    );
    assert_eq!(
        value(
            &text,
            &format!("xpuscope_sync_duration_seconds_count{{{after}}}")
        ),
        2.0
    );
    let count = lines_with(&text, "xpuscope_collective_duration_seconds_count{");
    assert_eq!(count.len(), 1, "{count:?}");
    assert!(
        count[0].contains(after) && count[0].ends_with(" 2"),
        "{count:?}"
    );
    let seq = lines_with(&text, "xpuscope_collective_last_seq{");
    assert!(seq.len() == 1 && seq[0].ends_with(" 8"), "{seq:?}");
    assert_eq!(
        value(&text, r#"xpuscope_agent_records_total{kind="off_cpu"}"#),
        3.0
    );
}

/// Each rank's finished step (the detect sink's split, fed back into the
/// stream) is observed: its duration, its host work (on CPU outside device
/// calls) and its wait in device calls.
#[test]
fn steps_are_split_into_host_work_and_device_waits() {
    let (mut sink, handle, _) = MetricsSink::new("node-a");
    sink.alive = |_| true;
    let lost = SinkCounters::default();
    let step = |n: u64, host: u64, device: u64| {
        Record::StepSplit(Box::new(StepSplitRecord {
            tgid: 10,
            step: n,
            start: n * 100 * MS,
            end: (n + 1) * 100 * MS,
            split: StepSplit {
                dur: 100 * MS,
                in_device_calls: device * MS,
                runnable: 0,
                asleep: 100 * MS - (host + device) * MS,
                host: host * MS,
            },
            // Counted launches: 100 kernels and a graph a step.
            launches: Some(xpuscope_common::uprobe::LaunchCounts {
                kernels: 100,
                graphs: 1,
            }),
        }))
    };
    // The second comes back from the detect sink after the rank's exit.
    sink.on_batch(
        &[
            identity(10, 0),
            step(1, 59, 41),
            exit(10, 300 * MS),
            step(2, 89, 11),
            // Its pid comes back as rank 1's process.
            identity(10, 1),
            step(5, 10, 10),
        ],
        &lost,
    )
    .unwrap();
    let text = handle.render();
    let of_rank = |family: &str, part: &str, rank: u32| -> f64 {
        let lines: Vec<&str> = lines_with(&text, &format!("{family}_{part}{{"))
            .into_iter()
            .filter(|l| l.contains(&format!("rank=\"{rank}\"")))
            .collect();
        assert_eq!(lines.len(), 1, "{family}: {lines:?}\n{text}");
        lines[0].rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(of_rank("xpuscope_step_duration_seconds", "count", 1), 1.0);
    let one = |family: &str, part: &str| of_rank(family, part, 0);
    assert_eq!(one("xpuscope_step_duration_seconds", "count"), 2.0);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(one("xpuscope_step_duration_seconds", "sum"), 0.2));
    assert!(close(
        one("xpuscope_step_device_wait_seconds", "sum"),
        0.052
    ));
    assert!(close(one("xpuscope_step_host_seconds", "sum"), 0.148));
    // Each step's counted launches add up, per rank.
    let counter = |family: &str, rank: u32| -> f64 {
        let lines: Vec<&str> = lines_with(&text, &format!("{family}_total{{"))
            .into_iter()
            .filter(|l| l.contains(&format!("rank=\"{rank}\"")))
            .collect();
        assert_eq!(lines.len(), 1, "{family}: {lines:?}\n{text}");
        lines[0].rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(counter("xpuscope_step_kernel_launches", 0), 200.0);
    assert_eq!(counter("xpuscope_step_graph_launches", 0), 2.0);
    assert_eq!(counter("xpuscope_step_kernel_launches", 1), 100.0);
}
