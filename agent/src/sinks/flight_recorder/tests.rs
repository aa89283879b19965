//! The flight recorder with synthetic records: the window is exactly the
//! last N seconds, the byte bound holds under a storm with evictions
//! counted, dumps decode with the independent decoder, and the dump
//! directory's rules (rate, size, names, a full disk) hold.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

use super::dump::{check_job_label, file_label, path_in};
use super::*;
use crate::events::{Comm, Exit, Fork, Switch, Waking};
use crate::model::{ProcessStart, RankIdentity};
use crate::procfs::{ProcessEntry, ThreadEntry};

const S: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const APP: u32 = 100;

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("xpuscope-fr-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Self(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn settings(dir: &Path) -> RecorderSettings {
    RecorderSettings {
        window: Duration::from_secs(10),
        max_bytes: 64 << 20,
        dump_dir: dir.to_path_buf(),
        dump_dir_max_bytes: 1 << 30,
        max_dumps_per_hour: 100,
        host: "node-a".into(),
        write_limit: None,
        dump_on_finding: true,
    }
}

fn waking(ts: u64, tid: u32) -> Record {
    Record::Waking(Waking {
        cpu: 0,
        ts,
        tid,
        tgid: APP,
        comm: Comm::from_str_lossy("worker"),
        prio: 120,
        target_cpu: 0,
        waker_tid: 0,
        waker_tgid: 0,
        new_task: false,
    })
}

fn switch(ts: u64, next: u32) -> Record {
    Record::Switch {
        switch: Switch {
            cpu: 1,
            ts,
            prev_tid: 0,
            prev_tgid: 0,
            prev_comm: Comm::from_str_lossy("swapper"),
            prev_state: 0,
            prev_prio: 120,
            next_tid: next,
            next_tgid: APP,
            next_comm: Comm::from_str_lossy("worker"),
            next_prio: 120,
            preempt: false,
            prev_target: false,
            next_target: true,
            stack_follows: false,
        },
    }
}

fn initial() -> Record {
    Record::InitialProcesses {
        ts: S / 2,
        processes: vec![ProcessEntry {
            pid: APP,
            ppid: 1,
            comm: "trainer".into(),
            cmdline: vec!["python".into(), "train.py".into()],
            uid: Some(0),
            threads: vec![
                ThreadEntry {
                    tid: APP,
                    comm: "trainer".into(),
                },
                ThreadEntry {
                    tid: APP + 1,
                    comm: "worker".into(),
                },
            ],
        }],
    }
}

fn identity(tgid: u32, rank: &str, job: &str) -> Record {
    Record::Identity {
        tgid,
        identity: Box::new(RankIdentity::from_environ(
            format!("RANK={rank}\0WORLD_SIZE=2\0XPUSCOPE_JOB={job}\0").as_bytes(),
        )),
    }
}

fn child_process(ts: u64, pid: u32) -> Record {
    Record::NewTask {
        fork: Fork {
            cpu: 0,
            ts,
            parent_tid: APP,
            parent_tgid: APP,
            child_tid: pid,
            child_tgid: pid,
            child_comm: Comm::from_str_lossy("loader"),
        },
        process: Some(Box::new(ProcessStart {
            ts,
            pid,
            ppid: APP,
            name: "loader".into(),
            cmdline: vec!["loader".into()],
        })),
    }
}

fn feed(rec: &mut FlightRecorder, batch: Vec<Record>) {
    rec.on_shared_batch(&Arc::new(batch), &SinkCounters::default())
        .unwrap();
}

fn dump(
    rec: &mut FlightRecorder,
    tx: &Sender<DumpRequest>,
    spec: DumpSpec,
) -> Result<DumpOutcome, DumpError> {
    let (reply, rx) = std::sync::mpsc::channel();
    tx.send(DumpRequest {
        spec,
        reply: Some(reply),
        finding: None,
    })
    .unwrap();
    rec.on_tick(0, &SinkCounters::default()).unwrap();
    rx.recv_timeout(Duration::from_secs(30)).unwrap()
}

fn timeline(path: &Path) -> Timeline {
    let bytes = std::fs::read(path).unwrap();
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    Timeline::new(&trace)
}

/// 30 s of wakings every 10 ms, a process started at 2 s, rank identities
/// at 1 s: the story of most tests.
fn story(rec: &mut FlightRecorder) -> Vec<u64> {
    let mut all = Vec::new();
    feed(rec, vec![initial(), identity(APP, "0", "job-a")]);
    for second in 1..30u64 {
        let mut batch = Vec::new();
        if second == 2 {
            batch.push(child_process(2 * S, 200));
        }
        for i in 0..100 {
            let ts = second * S + i * 10 * MS;
            batch.push(waking(ts, APP + 1));
            all.push(ts);
        }
        feed(rec, batch);
    }
    all
}

#[test]
fn a_dump_holds_exactly_the_last_window() {
    let dir = Dir::new("window");
    let (mut rec, tx, stats) = FlightRecorder::new(settings(&dir.0));
    let all = story(&mut rec);
    let end = *all.last().unwrap();

    // The whole window (10 s), then a shorter one (2.5 s).
    for (seconds, len) in [
        (None, 10 * S),
        (Some(Duration::from_millis(2500)), 2_500 * MS),
    ] {
        let out = dump(
            &mut rec,
            &tx,
            DumpSpec {
                seconds,
                ..DumpSpec::now(Trigger::Manual)
            },
        )
        .unwrap();
        assert_eq!((out.window_start_ns, out.window_end_ns), (end - len, end));
        assert_eq!(out.truncated, None);
        let tl = timeline(&out.trace);
        let got: Vec<u64> = tl.wakings.iter().map(|w| w.ts).collect();
        let want: Vec<u64> = all.iter().copied().filter(|&t| t >= end - len).collect();
        assert_eq!(got, want, "nothing older, nothing missing");
        // State from before the window: the process tree, the rank name,
        // the child process started at 2 s.
        assert_eq!(
            tl.processes[&(APP as i32)].name.as_deref(),
            Some("rank 0/2 job job-a")
        );
        assert!(tl.processes.contains_key(&200));
        assert_eq!(tl.thread_name((APP + 1) as i32).as_deref(), Some("worker"));
        let name = out.trace.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("job-a-node-a-") && name.contains("Z-manual"),
            "{name}"
        );
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&out.summary).unwrap()).unwrap();
        assert_eq!(summary["records_per_kind"]["waking"], want.len() as u64);
        assert_eq!(summary["processes"][0]["rank"], "0");
        assert_eq!(summary["outcome"]["trigger"], "manual");
    }
    assert_eq!(
        stats
            .trigger(Trigger::Manual)
            .written
            .load(Ordering::Relaxed),
        2
    );
    // Older records expired, nothing was evicted.
    assert!(stats.expired_records.load(Ordering::Relaxed) > 1_500);
    assert_eq!(stats.evicted_records.load(Ordering::Relaxed), 0);

    // A window larger than the recorder keeps is refused.
    let e = dump(
        &mut rec,
        &tx,
        DumpSpec {
            seconds: Some(Duration::from_secs(11)),
            ..DumpSpec::now(Trigger::Manual)
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("keeps the last 10s"), "{e}");
}

#[test]
fn the_byte_bound_holds_under_a_storm_and_evictions_are_counted() {
    let dir = Dir::new("storm");
    let mut s = settings(&dir.0);
    s.max_bytes = 4 << 20;
    s.window = Duration::from_secs(3600); // only the byte bound applies
    let (mut rec, tx, stats) = FlightRecorder::new(s);
    feed(&mut rec, vec![initial()]);
    let mut offered = 1u64;
    let mut ts = S;
    // About 1 M records, each batch 1 ms of a 1 M/s storm.
    for _ in 0..1_000 {
        let batch: Vec<Record> = (0..1_000)
            .map(|i| {
                ts += 1_000;
                if i % 2 == 0 {
                    switch(ts, APP + 1)
                } else {
                    waking(ts, APP + 1)
                }
            })
            .collect();
        offered += batch.len() as u64;
        feed(&mut rec, batch);
        let bytes = stats.bytes.load(Ordering::Relaxed);
        assert!(bytes <= 4 << 20, "{bytes} bytes held");
    }
    let held = stats.records.load(Ordering::Relaxed);
    let evicted = stats.evicted_records.load(Ordering::Relaxed);
    assert!(evicted > 900_000, "{evicted}");
    assert_eq!(
        held + evicted + stats.expired_records.load(Ordering::Relaxed),
        offered
    );
    // The estimate is honest: at least the records' own slots.
    assert!(stats.bytes.load(Ordering::Relaxed) >= held * std::mem::size_of::<Record>() as u64);
    // A dump after the storm still renders on its own, and says where the
    // evictions cut its window.
    let out = dump(&mut rec, &tx, DumpSpec::now(Trigger::Manual)).unwrap();
    let tl = timeline(&out.trace);
    assert_eq!(tl.wakings.len() as u64 + tl.switches.len() as u64, held);
    assert!(out.complete_from_ns.is_some());
    assert_eq!(tl.thread_name((APP + 1) as i32).as_deref(), Some("worker"));
}

#[test]
fn a_full_disk_cuts_the_dump_to_a_valid_trace_and_counts_it() {
    let dir = Dir::new("full");
    let mut s = settings(&dir.0);
    s.write_limit = Some(4_000);
    let (mut rec, tx, stats) = FlightRecorder::new(s);
    story(&mut rec);
    let out = dump(&mut rec, &tx, DumpSpec::now(Trigger::Oom)).unwrap();
    let error = out.truncated.clone().expect("cut short");
    assert!(error.contains("No space left"), "{error}");
    let len = std::fs::metadata(&out.trace).unwrap().len();
    assert!(len <= 4_000 && len == out.trace_bytes, "{len}");
    let tl = timeline(&out.trace);
    // What came before the cut is there (the process tree is written
    // first); the bundles after it are not.
    assert!(tl.processes.contains_key(&(APP as i32)));
    assert!(tl.wakings.len() < 1_000);
    let counts = stats.trigger(Trigger::Oom);
    assert_eq!(counts.written.load(Ordering::Relaxed), 1);
    assert_eq!(counts.truncated.load(Ordering::Relaxed), 1);
    // Recording goes on.
    feed(&mut rec, vec![waking(31 * S, APP + 1)]);
    assert!(stats.records.load(Ordering::Relaxed) > 0);
}

#[test]
fn dumps_are_rate_limited_and_the_directory_bounded() {
    let dir = Dir::new("bounds");
    let mut s = settings(&dir.0);
    s.max_dumps_per_hour = 3;
    s.dump_dir_max_bytes = 1;
    let (mut rec, tx, stats) = FlightRecorder::new(s);
    story(&mut rec);
    std::fs::create_dir_all(&dir.0).unwrap();
    std::fs::write(dir.0.join("notes.txt"), "not a dump").unwrap();
    let mut outs = Vec::new();
    for _ in 0..3 {
        outs.push(dump(&mut rec, &tx, DumpSpec::now(Trigger::Hang)).unwrap());
    }
    let e = dump(&mut rec, &tx, DumpSpec::now(Trigger::Hang)).unwrap_err();
    assert!(
        matches!(e, DumpError::RateLimited { per_hour: 3, .. }),
        "{e}"
    );
    assert_eq!(
        stats
            .trigger(Trigger::Hang)
            .rate_limited
            .load(Ordering::Relaxed),
        1
    );
    // Same second, same name: a suffix keeps them apart.
    assert_ne!(outs[0].trace, outs[1].trace);
    // Each dump removed the older ones (the bound is 1 byte) and kept
    // itself; other files are never touched.
    assert_eq!(outs[1].removed_old_dumps, 2);
    let mut left: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let last = outs[2]
        .trace
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let last_summary = outs[2]
        .summary
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut want = vec!["notes.txt".to_string(), last, last_summary];
    want.sort();
    assert_eq!(left, want);
}

#[test]
fn a_window_ending_later_waits_for_its_records() {
    let dir = Dir::new("after");
    let (mut rec, tx, _stats) = FlightRecorder::new(settings(&dir.0));
    feed(&mut rec, vec![initial(), waking(5 * S, APP + 1)]);
    let (reply, rx) = std::sync::mpsc::channel();
    tx.send(DumpRequest {
        spec: DumpSpec {
            end: WindowEnd::At(7 * S),
            ..DumpSpec::now(Trigger::Manual)
        },
        reply: Some(reply),
        finding: None,
    })
    .unwrap();
    feed(&mut rec, vec![waking(6 * S, APP + 1)]);
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "not yet"
    );
    feed(
        &mut rec,
        vec![waking(7 * S, APP + 1), waking(8 * S, APP + 1)],
    );
    let out = rx.recv_timeout(Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(out.window_end_ns, 7 * S);
    let got: Vec<u64> = timeline(&out.trace).wakings.iter().map(|w| w.ts).collect();
    assert_eq!(got, vec![5 * S, 6 * S, 7 * S]);
}

#[test]
fn a_job_filter_keeps_that_jobs_processes() {
    let dir = Dir::new("job");
    let (mut rec, tx, _stats) = FlightRecorder::new(settings(&dir.0));
    feed(
        &mut rec,
        vec![
            initial(),
            identity(APP, "0", "job-a"),
            child_process(S, 300),
            identity(300, "1", "job-b"),
            Record::Exit {
                exit: Exit {
                    cpu: 0,
                    ts: 2 * S,
                    tid: APP + 1,
                    tgid: APP,
                    prio: 120,
                    comm: Comm::from_str_lossy("worker"),
                    group_dead: false,
                    group_known: true,
                    exit_code: None,
                },
                process_ended: false,
            },
        ],
    );
    let out = dump(
        &mut rec,
        &tx,
        DumpSpec {
            job: Some("job-b".into()),
            ..DumpSpec::now(Trigger::Manual)
        },
    )
    .unwrap();
    let tl = timeline(&out.trace);
    assert!(tl.processes.contains_key(&300));
    assert!(!tl.processes.contains_key(&(APP as i32)));
    assert!(
        tl.frees.is_empty(),
        "job-a's thread exit is not in job-b's dump"
    );
    assert!(
        out.trace
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("job-b-")
    );
    let e = dump(
        &mut rec,
        &tx,
        DumpSpec {
            job: Some("../../etc".into()),
            ..DumpSpec::now(Trigger::Manual)
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("never a path"), "{e}");
}

#[test]
fn names_never_leave_the_dump_directory() {
    let dir = Path::new("/var/lib/xpuscope/dumps");
    for bad in ["..", ".", "", "a/b", "../x.pftrace", "x\0y"] {
        assert!(path_in(dir, bad).is_err(), "{bad:?}");
    }
    assert_eq!(
        path_in(dir, "j-h-20260101T000000Z-manual.pftrace").unwrap(),
        dir.join("j-h-20260101T000000Z-manual.pftrace")
    );
    assert_eq!(file_label("../../etc/passwd"), "_._.._etc_passwd");
    assert_eq!(file_label("job a/b"), "job_a_b");
    assert_eq!(file_label(""), "unknown");
    assert!(!file_label(&"x".repeat(500)).contains('/'));
    assert!(check_job_label("..").is_err());
    assert!(check_job_label("a/b").is_err());
    assert!(check_job_label("llama-70b.run3").is_ok());
}

/// A finding in the stream dumps the window on its own (trigger by kind):
/// the dump's trace holds the finding on its track, its summary names it.
/// Findings of one moment share one dump (two members of a hung job).
#[test]
fn a_finding_dumps_the_window_and_the_summary_names_it() {
    let dir = Dir::new("finding");
    let (mut rec, _tx, stats) = FlightRecorder::new(settings(&dir.0));
    feed(
        &mut rec,
        vec![
            initial(),
            identity(APP, "1", "llama"),
            waking(2 * S, APP + 1),
        ],
    );
    let finding = crate::model::Finding {
        link: Default::default(),
        kind: crate::model::FindingKind::Hang,
        ranks: vec![1],
        comm: Some("nccl:00000000000000aa".into()),
        seq: Some(12),
        step: None,
        start_ns: 3 * S,
        end_ns: None,
        summary: "hang: ncclAllReduce #12 on nccl:00000000000000aa".into(),
        evidence: serde_json::json!({"op": "ncclAllReduce"}),
        detected_ns: 5 * S,
    };
    feed(
        &mut rec,
        vec![
            waking(4 * S, APP + 1),
            Record::Finding(Box::new(finding.clone())),
            Record::Finding(Box::new(crate::model::Finding {
                link: Default::default(),
                ranks: vec![2],
                seq: Some(13),
                summary: "hang: ncclAllReduce #13 on nccl:00000000000000aa".into(),
                ..finding.clone()
            })),
        ],
    );
    let stats = rec.finish(6 * S, &SinkCounters::default()).map(|_| stats);
    let stats = stats.unwrap();
    assert_eq!(
        stats.trigger(Trigger::Hang).written.load(Ordering::Relaxed),
        1
    );
    let last = stats.last_dump.lock().unwrap().clone().expect("a dump");
    assert_eq!(last.trigger, "hang");
    assert!(
        last.trace.to_string_lossy().ends_with("-hang.pftrace"),
        "{}",
        last.trace.display()
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&last.summary).unwrap()).unwrap();
    assert_eq!(summary["finding"]["kind"], "hang");
    assert_eq!(summary["finding"]["seq"], 12);
    assert_eq!(summary["finding"]["comm"], "nccl:00000000000000aa");
    assert_eq!(summary["findings"]["schema"], "xpuscope-findings/1");
    assert_eq!(
        summary["findings"]["findings"][0]["ranks"],
        serde_json::json!([1])
    );
    assert_eq!(
        summary["findings"]["findings"][1]["ranks"],
        serde_json::json!([2]),
        "the other finding is listed in the same dump"
    );
    let trace = decode(&std::fs::read(&last.trace).unwrap()).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    // Overlapping findings take a lane each (tracks of the same name).
    let mut slices: Vec<_> = tl
        .tracks
        .values()
        .filter(|t| t.name.as_deref() == Some(crate::sinks::perfetto::FINDINGS_TRACK))
        .flat_map(|t| tl.slices_on(t.uuid))
        .collect();
    slices.sort_by_key(|s| (s.ts, s.name.clone()));
    assert_eq!(slices.len(), 2, "both findings in the dump's trace");
    assert_eq!((slices[0].ts, slices[0].end), (3 * S, Some(5 * S)));
}

#[test]
fn record_sizes_count_boxes_and_the_allocators_share() {
    use super::state::{alloc, heap_bytes};
    // A boxed process start: the box, its name and command line, each an
    // allocation of its own (header and rounding included).
    let r = child_process(S, 7);
    let Record::NewTask {
        process: Some(p), ..
    } = &r
    else {
        panic!("child_process makes a NewTask with its process");
    };
    assert!(
        heap_bytes(&r)
            >= alloc(std::mem::size_of::<ProcessStart>())
                + alloc(p.name.capacity())
                + alloc(p.cmdline.capacity() * std::mem::size_of::<String>()),
        "{}",
        heap_bytes(&r)
    );
    assert_eq!(alloc(0), 0);
    assert_eq!(alloc(1), 32);
    assert_eq!(alloc(24), 32);
    assert_eq!(alloc(25), 48);
    assert_eq!(alloc(1000), 1008);
}

/// `agent ctl dump` (a window ending now) ends the window at the request:
/// a record stamped before the request that reaches the recorder after
/// it (still in a ring or the pipeline's queue) is in the dump, which is
/// written once collect's clock (a tick) passes the request's instant.
#[test]
fn a_dump_ending_now_waits_for_the_records_from_before_the_request() {
    let dir = Dir::new("barrier");
    let (mut rec, tx, _stats) = FlightRecorder::new(settings(&dir.0));
    let before = crate::host::boottime_ns();
    feed(&mut rec, vec![initial(), waking(before - 5 * MS, APP + 1)]);
    let asked = std::thread::spawn(move || {
        crate::service::control::request_dump(&tx, DumpSpec::now(Trigger::Manual), false)
    });
    // The request is in (it is read at every batch and tick).
    let asked_by = loop {
        rec.on_tick(0, &SinkCounters::default()).unwrap();
        if !rec.pending.is_empty() {
            break crate::host::boottime_ns();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let WindowEnd::At(end) = rec.pending[0].1.spec.end else {
        panic!("a window ending now is given its end at the request")
    };
    assert!((before..=asked_by).contains(&end));
    // A record from just before the request arrives late: not dumped yet.
    let late = end - MS;
    feed(&mut rec, vec![waking(late, APP + 1)]);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !asked.is_finished(),
        "no dump before the clock passed the request"
    );
    // Collect's clock passes the request's instant: the dump is written.
    rec.on_tick(end + MS, &SinkCounters::default()).unwrap();
    let answer = asked.join().unwrap().unwrap();
    assert_eq!(answer["window_end_ns"], end, "{answer}");
    let tl = timeline(Path::new(answer["trace"].as_str().unwrap()));
    let got: Vec<u64> = tl.wakings.iter().map(|w| w.ts).collect();
    assert_eq!(got, vec![before - 5 * MS, late], "the late record is in");
}

/// A process the service discovered after it started has no start record:
/// only its identity and its scheduling. The summary lists it anyway (and
/// one that exited in the window, marked), with the filter or without.
#[test]
fn the_summary_lists_discovered_processes_and_exited_ones() {
    const FOUND: u32 = 525;
    let dir = Dir::new("discovered");
    let (mut rec, tx, _stats) = FlightRecorder::new(settings(&dir.0));
    let leader_runs = |ts: u64| {
        let Record::Switch { switch: mut s } = switch(ts, FOUND) else {
            unreachable!()
        };
        s.next_tgid = FOUND;
        s.next_comm = Comm::from_str_lossy("python3");
        Record::Switch { switch: s }
    };
    // The service starts with nothing to trace; the job comes later.
    feed(
        &mut rec,
        vec![Record::InitialProcesses {
            ts: S / 2,
            processes: Vec::new(),
        }],
    );
    let mut batch = vec![identity(FOUND, "3", "job-a")];
    // Forked by a launcher (its name first), then exec'd as python3,
    // before the service saw it.
    batch.extend((1..=5).map(|i| leader_runs(S + i * MS)));
    if let Record::Switch { switch: s, .. } = &mut batch[1] {
        s.next_comm = Comm::from_str_lossy("bash");
    }
    batch.push(child_process(2 * S, 600));
    batch.push(identity(600, "4", "job-a"));
    batch.push(Record::Exit {
        exit: Exit {
            cpu: 0,
            ts: 3 * S,
            tid: 600,
            tgid: 600,
            prio: 120,
            comm: Comm::from_str_lossy("loader"),
            group_dead: true,
            group_known: true,
            exit_code: None,
        },
        process_ended: true,
    });
    batch.push(waking(4 * S, APP + 1));
    feed(&mut rec, batch);
    for job in [None, Some("job-a".to_string())] {
        let out = dump(
            &mut rec,
            &tx,
            DumpSpec {
                job: job.clone(),
                ..DumpSpec::now(Trigger::Manual)
            },
        )
        .unwrap();
        // The scheduling is in bundles still open at the end: counted too.
        assert_eq!(
            out.trace_bytes,
            std::fs::metadata(&out.trace).unwrap().len()
        );
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&out.summary).unwrap()).unwrap();
        let rows = summary["processes"].as_array().unwrap();
        let row = |pid: u32| {
            rows.iter()
                .find(|r| r["pid"] == pid)
                .unwrap_or_else(|| panic!("pid {pid} missing ({job:?}): {rows:?}"))
        };
        let found = row(FOUND);
        assert_eq!(found["name"], "python3", "named by its main thread");
        assert_eq!(
            (found["rank"].as_str(), found["job"].as_str()),
            (Some("3"), Some("job-a"))
        );
        assert_eq!(found["exited"], false);
        let child = row(600);
        assert_eq!(
            (child["name"].as_str(), child["rank"].as_str()),
            (Some("loader"), Some("4"))
        );
        assert_eq!(child["exited"], true);
        assert_eq!(rows.len(), 2, "{rows:?}");
        let name = out
            .trace
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(name.starts_with("job-a-node-a-"), "{name}");
    }
}

/// A dump is named after its job: the one asked for, else the job of the
/// process its finding names, else the window's only job (`alljobs` when
/// the window holds several).
#[test]
fn a_dump_is_named_after_its_findings_job_or_the_windows_jobs() {
    let dir = Dir::new("names-jobs");
    let (mut rec, tx, stats) = FlightRecorder::new(settings(&dir.0));
    feed(
        &mut rec,
        vec![
            Record::InitialProcesses {
                ts: S / 2,
                processes: Vec::new(),
            },
            waking(S, APP + 1),
            identity(700, "0", "job-x"),
            identity(800, "0", "job-y"),
            waking(2 * S, APP + 1),
        ],
    );
    let out = dump(&mut rec, &tx, DumpSpec::now(Trigger::Manual)).unwrap();
    let name = out
        .trace
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(name.starts_with("alljobs-node-a-"), "{name}");
    feed(
        &mut rec,
        vec![Record::Finding(Box::new(crate::model::Finding {
            link: Default::default(),
            kind: crate::model::FindingKind::DeviceOom,
            ranks: vec![0],
            comm: None,
            seq: None,
            step: None,
            start_ns: 3 * S,
            end_ns: Some(3 * S),
            summary: "device_oom: rank 0 failed to allocate 1024 MiB on gpu0".into(),
            evidence: serde_json::json!({"pid": 800}),
            detected_ns: 3 * S,
        }))],
    );
    let stats = rec
        .finish(4 * S, &SinkCounters::default())
        .map(|_| stats)
        .unwrap();
    let last = stats.last_dump.lock().unwrap().clone().expect("a dump");
    let name = last
        .trace
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        name.starts_with("job-y-node-a-") && name.ends_with("-oom.pftrace"),
        "{name}"
    );
}

/// A finding that follows from an earlier one (a peer that waited for the
/// slow rank) takes no dump of its own: the fault's dump holds what led
/// to both; the next fault dumps again.
#[test]
fn a_consequence_takes_no_dump_of_its_own() {
    use crate::model::FindingKind::SlowRank;
    let dir = Dir::new("consequence");
    let (mut rec, _tx, stats) = FlightRecorder::new(settings(&dir.0));
    feed(&mut rec, vec![initial(), identity(APP, "5", "llama")]);
    feed(
        &mut rec,
        vec![waking(S, APP + 1), finding(SlowRank, APP, 2 * S)],
    );
    let mut consequence = finding(SlowRank, APP + 1, 2 * S + S / 20);
    if let Record::Finding(f) = &mut consequence {
        f.link.follows_from = Some(format!("slow_rank: pid {APP}"));
    }
    feed(&mut rec, vec![waking(2 * S + S / 10, APP + 1), consequence]);
    feed(&mut rec, vec![waking(3 * S, APP + 1)]);
    feed(&mut rec, vec![finding(SlowRank, APP + 2, 60 * S)]);
    feed(&mut rec, vec![waking(61 * S, APP + 1)]);
    rec.finish(62 * S, &SinkCounters::default()).unwrap();
    let written = stats
        .trigger(Trigger::Slowdown)
        .written
        .load(Ordering::Relaxed);
    let mut triggered_by: Vec<u64> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".summary.json"))
        .map(|p| {
            let s: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            s["finding"]["evidence"]["pid"].as_u64().expect("a trigger")
        })
        .collect();
    triggered_by.sort();
    assert_eq!(
        (written, triggered_by),
        (2, vec![u64::from(APP), u64::from(APP + 2)]),
        "a dump for each fault, none for the consequence"
    );
}

fn finding(kind: crate::model::FindingKind, pid: u32, at: u64) -> Record {
    Record::Finding(Box::new(crate::model::Finding {
        link: Default::default(),
        kind,
        ranks: vec![],
        comm: None,
        seq: None,
        step: None,
        start_ns: at,
        end_ns: None,
        summary: format!("{}: pid {pid}", kind.as_str()),
        evidence: serde_json::json!({ "pid": pid }),
        detected_ns: at,
    }))
}

/// The dumps in the directory: (trigger, retention) of each summary, in
/// name order.
fn dumps_on_disk(dir: &Path) -> Vec<(String, String, String)> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".summary.json"))
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            (
                v["outcome"]["trigger"].as_str().unwrap().to_string(),
                v["retention"].as_str().unwrap().to_string(),
                v["finding"]["evidence"]["pid"].to_string(),
            )
        })
        .collect()
}

/// Any traced process can make a crash dump by dying on a fault signal. A
/// burst of them (one job crashing over and over) neither refuses the
/// next real incident's dump (another job's hang) nor later pushes it out
/// of a full directory: routine dumps go first.
#[test]
fn a_crash_flood_neither_refuses_nor_erases_an_incident_dump() {
    use crate::model::FindingKind;
    let dir = Dir::new("crash-flood");
    let mut s = settings(&dir.0);
    s.max_dumps_per_hour = 3;
    let (mut rec, _tx, _stats) = FlightRecorder::new(s);
    const FLOOD: u32 = 500;
    const TRAIN: u32 = 600;
    feed(
        &mut rec,
        vec![
            initial(),
            identity(FLOOD, "0", "flood"),
            identity(TRAIN, "0", "train"),
        ],
    );
    // Twenty crashes of the flooding job, one batch each.
    for i in 0..20u64 {
        let at = S + i * 10 * MS;
        feed(
            &mut rec,
            vec![waking(at, APP + 1), finding(FindingKind::Crash, FLOOD, at)],
        );
    }
    // The training job hangs.
    feed(
        &mut rec,
        vec![
            waking(2 * S, APP + 1),
            finding(FindingKind::Hang, TRAIN, 2 * S),
        ],
    );
    // Wait for the dump threads before bounding the directory.
    let stats = rec.finish(3 * S, &SinkCounters::default()).unwrap();
    assert_eq!(
        stats.trigger(Trigger::Hang).written.load(Ordering::Relaxed),
        1
    );
    assert_eq!(
        stats
            .trigger(Trigger::Signal)
            .written
            .load(Ordering::Relaxed),
        3,
        "the flooding job's share"
    );
    assert_eq!(
        stats
            .trigger(Trigger::Signal)
            .rate_limited
            .load(Ordering::Relaxed),
        17
    );
    let on_disk = dumps_on_disk(&dir.0);
    let classes: Vec<(&str, &str)> = on_disk
        .iter()
        .map(|(t, r, _)| (t.as_str(), r.as_str()))
        .collect();
    let mut sorted = classes.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        vec![
            ("hang", "incident"),
            ("signal", "incident"),
            ("signal", "routine"),
            ("signal", "routine"),
        ],
        "the job's first crash is an incident, the later ones routine"
    );
    // The directory fills: a bound that holds two dumps keeps the hang
    // and the first crash, however old, and removes the routine ones.
    let sizes: Vec<u64> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .collect();
    let biggest_two: u64 = {
        let mut s = sizes.clone();
        s.sort_unstable();
        s.iter().rev().take(4).sum()
    };
    let removed = dump::enforce_dir_bound(&dir.0, biggest_two, &[]).unwrap();
    assert_eq!(removed, 4, "two routine dumps, two files each");
    let left: Vec<String> = dumps_on_disk(&dir.0)
        .into_iter()
        .map(|(_, r, _)| r)
        .collect();
    assert_eq!(left, vec!["incident", "incident"]);
}

/// A sink that blocks its thread until let go: the flight recorder stalled
/// (a starved CPU, a slow disk under its dump) while records keep coming.
struct Stalled {
    inner: FlightRecorder,
    gate: std::sync::mpsc::Receiver<()>,
    waiting: bool,
}

impl Sink for Stalled {
    type Output = Arc<RecorderStats>;

    fn on_batch(&mut self, batch: &[Record], lost: &SinkCounters) -> Result<()> {
        self.on_shared_batch(&Arc::new(batch.to_vec()), lost)
    }

    fn on_shared_batch(&mut self, batch: &Batch, lost: &SinkCounters) -> Result<()> {
        if self.waiting {
            let _ = self.gate.recv();
            self.waiting = false;
        }
        self.inner.on_shared_batch(batch, lost)
    }

    fn on_tick(&mut self, now: u64, lost: &SinkCounters) -> Result<()> {
        self.inner.on_tick(now, lost)
    }

    fn finish(self, end: u64, lost: &SinkCounters) -> Result<Arc<RecorderStats>> {
        self.inner.finish(end, lost)
    }
}

/// The recorder stalls while the pipeline goes on: the fan-out drops the
/// batches it cannot take. A dump of that window says so: its outcome
/// counts the lost records and its trace has a counter track of them.
#[test]
fn a_dump_of_a_window_the_recorder_lost_records_in_shows_the_loss() {
    let dir = Dir::new("stalled");
    let (rec, tx, _stats) = FlightRecorder::new(settings(&dir.0));
    let (go, gate) = std::sync::mpsc::channel();
    let mut fanout = crate::sinks::FanOut::default();
    let handle = fanout
        .add(
            "flight_recorder",
            Stalled {
                inner: rec,
                gate,
                waiting: true,
            },
            2,
        )
        .unwrap();
    fanout.send(vec![initial(), identity(APP, "0", "job-a")]);
    // The recorder is stuck on the first batch: of the next ones, the
    // queue (2) takes two and the rest are lost.
    let mut sent = 0u64;
    for second in 1..9u64 {
        let batch: Vec<Record> = (0..100)
            .map(|i| waking(second * S + i * MS, APP + 1))
            .collect();
        sent += batch.len() as u64;
        fanout.send(batch);
    }
    let lost = handle.counters.dropped();
    assert!(lost > 0 && lost < sent, "lost {lost} of {sent}");
    go.send(()).unwrap();
    // After the stall (its queue drained): records that reach it again,
    // then a dump.
    std::thread::sleep(Duration::from_millis(300));
    fanout.send(vec![waking(9 * S, APP + 1)]);
    assert_eq!(handle.counters.dropped(), lost);
    let (reply, rx) = std::sync::mpsc::channel();
    tx.send(DumpRequest {
        spec: DumpSpec::now(Trigger::Manual),
        reply: Some(reply),
        finding: None,
    })
    .unwrap();
    fanout.tick(10 * S);
    let out = rx.recv_timeout(Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(out.lost_records, lost, "{out:?}");
    let tl = timeline(&out.trace);
    assert_eq!(
        tl.counter_values(crate::trace_schema::names::RECORDER_LOSSES_TRACK)
            .last()
            .copied(),
        Some(lost as f64),
        "the dump's trace shows the loss"
    );
    fanout.finish(11 * S);
    handle.join().unwrap();
}

/// A batch is read again when it leaves only if `changes_table` says one
/// of its records changes the process table: the records it passes over
/// must leave the table as it was, and those it names must change it.
#[test]
fn only_the_records_changes_table_names_change_the_process_table() {
    let mut table = ProcessTable::default();
    table.apply(&initial());
    let before = format!("{table:?}");
    let passed_over = [
        switch(S, APP + 1),
        waking(S, APP + 1),
        finding(crate::model::FindingKind::Hang, APP, S),
    ];
    for r in &passed_over {
        assert!(!state::changes_table(r), "{r:?}");
        table.apply(r);
        assert_eq!(format!("{table:?}"), before, "{r:?} changed the table");
    }
    for r in [identity(APP, "0", "job-a"), child_process(S, APP + 7)] {
        assert!(state::changes_table(&r), "{r:?}");
        let was = format!("{table:?}");
        table.apply(&r);
        assert_ne!(format!("{table:?}"), was, "{r:?}");
    }
}
