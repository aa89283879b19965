//! The detectors over records built here (no kernel, no pipeline).

use std::sync::Arc;
use std::time::Duration;

use xpuscope_probes::catalog::{CallKind, Collective, Library, SyncKind, Vendor};
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::memory::{Device, MemoryEffect};

use super::*;
use crate::events::{Comm, Exit};
use crate::model::{
    DeviceCallRecord, FindingKind, InFlightSnapshot, LiveSiteRow, OpenCall, Site, ThreadNow,
};

pub(super) const S: u64 = 1_000_000_000;
const HASH: u64 = 0x3f2a_0000_0000_0001;

pub(super) fn detectors(timeout_s: u64) -> Detectors {
    Detectors::new(DetectConfig {
        hang_timeout: Duration::from_secs(timeout_s),
        ..DetectConfig::default()
    })
}

pub(super) fn identity(tgid: u32, rank: u32) -> Record {
    Record::Identity {
        tgid,
        identity: Box::new(RankIdentity::from_environ(
            format!("RANK={rank}\0WORLD_SIZE=4\0XPUSCOPE_JOB=j\0").as_bytes(),
        )),
    }
}

fn ctx(rank: u32, size: u32, seq: Option<u64>) -> CommContext {
    CommContext {
        handle: 0xc0 + u64::from(rank),
        id_hash: Some(HASH),
        rank: Some(rank),
        size: Some(size),
        seq,
        seq_exact: seq.is_some(),
    }
}

pub(super) fn call(
    tgid: u32,
    kind: CallKind,
    function: &'static str,
    start: u64,
    end: u64,
) -> DeviceCall {
    DeviceCall {
        library: Library::Nccl,
        function,
        kind,
        tgid,
        tid: tgid,
        start_ts: start,
        end_ts: Some(end),
        args: CallArgs::None,
        ret: Some(0),
        error: false,
        name: function.into(),
        comm: None,
        memory: None,
        site: None,
        launches: None,
    }
}

/// A finished all-reduce of rank `rank` (pid 100 + rank) on the comm.
pub(super) fn allreduce(rank: u32, size: u32, seq: u64, start: u64) -> Record {
    let mut c = call(
        100 + rank,
        CallKind::Collective(Collective::AllReduce),
        "ncclAllReduce",
        start,
        start + 1_000,
    );
    c.comm = Some(ctx(rank, size, Some(seq)));
    Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
}

fn open_allreduce(rank: u32, size: u32, seq: u64, start: u64) -> OpenCall {
    OpenCall {
        tgid: 100 + rank,
        tid: 100 + rank,
        library: Library::Nccl,
        function: "ncclAllReduce",
        kind: CallKind::Collective(Collective::AllReduce),
        start_ts: start,
        comm: Some(ctx(rank, size, Some(seq))),
        peer: None,
        thread: ThreadNow::Off {
            state: 1,
            since: start + 10,
        },
    }
}

pub(super) fn open_sync(rank: u32, start: u64) -> OpenCall {
    OpenCall {
        tgid: 100 + rank,
        tid: 100 + rank,
        library: Library::Cudart,
        function: "cudaStreamSynchronize",
        kind: CallKind::Sync(SyncKind::Stream),
        start_ts: start,
        comm: None,
        peer: None,
        thread: ThreadNow::OnCpu,
    }
}

pub(super) fn snapshot(ts: u64, calls: Vec<OpenCall>) -> Record {
    Record::InFlight(Box::new(InFlightSnapshot {
        ts,
        calls,
        main_threads: Vec::new(),
    }))
}

pub(super) fn feed(d: &mut Detectors, records: &[Record]) -> Vec<Finding> {
    let mut out = Vec::new();
    for r in records {
        d.record(r, &mut out);
    }
    out
}

/// Ranks 0..4 on one communicator; rank 2 never enters #5: the finding
/// names rank 2, the communicator and the number, once.
#[test]
fn a_hang_names_the_member_that_never_entered() {
    let mut d = detectors(10);
    let mut records: Vec<Record> = (0..4).map(|r| identity(100 + r, r)).collect();
    for seq in 0..5 {
        for r in 0..4 {
            records.push(allreduce(r, 4, seq, seq * S));
        }
    }
    let stuck: Vec<OpenCall> = [0, 1, 3]
        .iter()
        .map(|&r| open_allreduce(r, 4, 5, 6 * S))
        .collect();
    records.push(snapshot(8 * S, stuck.clone()));
    assert!(feed(&mut d, &records).is_empty());
    let mut out = Vec::new();
    d.tick(15 * S, &mut out);
    assert!(
        out.is_empty(),
        "9 s in flight is under the timeout: {out:?}"
    );
    d.record(&snapshot(16 * S, stuck.clone()), &mut out);
    d.tick(16 * S + 1, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    let f = &out[0];
    assert_eq!(f.kind, FindingKind::Hang);
    assert_eq!(f.ranks, vec![2]);
    assert_eq!(f.comm.as_deref(), Some("nccl:3f2a000000000001"));
    assert_eq!(f.seq, Some(5));
    assert_eq!(f.start_ns, 6 * S);
    assert_eq!(f.end_ns, None);
    assert_eq!(f.evidence["entered"], serde_json::json!([0, 1, 3]));
    assert_eq!(f.evidence["never_entered"], serde_json::json!([2]));
    assert_eq!(f.evidence["stuck"][0]["thread"]["state"], "sleeping");
    assert!(
        f.summary.starts_with(
            "hang: ncclAllReduce #5 on nccl:3f2a000000000001 (4 ranks) entered by ranks 0, 1, 3 \
             but never by rank 2; rank 0's thread 100 has been in ncclAllReduce for 10.0 s"
        ),
        "{}",
        f.summary
    );
    // Reported once, however long it lasts.
    let mut again = Vec::new();
    d.record(&snapshot(30 * S, stuck), &mut again);
    d.tick(30 * S, &mut again);
    assert!(again.is_empty(), "{again:?}");
}

/// NCCL collectives are enqueued and return; the wait shows in the
/// stream sync after them. The hung collective is the last one the
/// stuck rank entered where another member is behind.
#[test]
fn a_hang_in_a_sync_is_traced_to_the_collective_a_peer_never_entered() {
    let mut d = detectors(1);
    let mut records = vec![identity(100, 0), identity(101, 1)];
    for seq in 0..3 {
        records.push(allreduce(0, 2, seq, seq * S));
    }
    for seq in 0..2 {
        records.push(allreduce(1, 2, seq, seq * S));
    }
    records.push(snapshot(5 * S, vec![open_sync(0, 3 * S)]));
    let mut out = feed(&mut d, &records);
    d.tick(5 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].ranks, vec![1]);
    assert_eq!(out[0].seq, Some(2));
    assert_eq!(out[0].evidence["op"], "ncclAllReduce");
    assert_eq!(
        out[0].evidence["stuck"][0]["function"],
        "cudaStreamSynchronize"
    );
    assert!(
        out[0].summary.contains("running on a CPU"),
        "{}",
        out[0].summary
    );
}

/// Every member entered and none left (a hang inside the collective):
/// all members.
#[test]
fn a_hang_every_member_entered_names_all_members() {
    let mut d = detectors(1);
    let mut records = vec![identity(100, 0), identity(101, 1)];
    records.push(snapshot(
        5 * S,
        vec![open_allreduce(0, 2, 0, S), open_allreduce(1, 2, 0, 2 * S)],
    ));
    let mut out = feed(&mut d, &records);
    d.tick(5 * S, &mut out);
    assert_eq!(out.len(), 1, "one finding for the operation: {out:?}");
    assert_eq!(out[0].ranks, vec![0, 1]);
    assert!(
        out[0]
            .summary
            .contains("entered by every member, and none left")
    );
    assert_eq!(out[0].evidence["stuck"].as_array().unwrap().len(), 2);
}

/// Without the communicator's identity: the stuck rank, and why no more.
#[test]
fn a_hang_without_communicator_identity_names_the_stuck_rank() {
    let mut d = detectors(1);
    let mut c = open_allreduce(1, 2, 0, S);
    c.comm = Some(CommContext {
        id_hash: None,
        seq_exact: false,
        ..ctx(1, 2, Some(0))
    });
    let mut out = feed(&mut d, &[identity(101, 1), snapshot(3 * S, vec![c])]);
    d.tick(3 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].ranks, vec![1]);
    assert_eq!(out[0].comm, None);
    assert!(
        out[0].summary.contains("identity is unknown"),
        "{}",
        out[0].summary
    );
}

/// A call that returned is not a hang, even if the next snapshot was lost.
#[test]
fn a_returned_call_is_not_a_hang() {
    let mut d = detectors(1);
    let mut out = feed(
        &mut d,
        &[
            identity(100, 0),
            snapshot(2 * S, vec![open_allreduce(0, 2, 0, S)]),
            allreduce(0, 2, 0, S),
        ],
    );
    d.tick(10 * S, &mut out);
    assert!(out.is_empty(), "{out:?}");
    // A clean stream has no findings at all.
    let mut clean = detectors(1);
    let mut records = vec![identity(100, 0), identity(101, 1)];
    for seq in 0..50 {
        records.push(allreduce(0, 2, seq, seq * S));
        records.push(allreduce(1, 2, seq, seq * S));
    }
    let mut out = feed(&mut clean, &records);
    clean.tick(60 * S, &mut out);
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn a_failed_allocation_is_a_device_oom_with_what_holds_the_memory() {
    let mut d = detectors(300);
    let mut c = call(100, CallKind::Malloc, "cudaMalloc", 5 * S, 5 * S + 100);
    c.library = Library::Cudart;
    c.ret = Some(2);
    c.error = true;
    c.memory = Some(MemoryEffect {
        device: Device {
            vendor: Vendor::Nvidia,
            index: 1,
        },
        delta: 0,
        held_after: 70 << 30,
        failed_request: Some(16 << 30),
        untracked: false,
        site: None,
    });
    let site = |label: &str| {
        Some(Arc::new(Site {
            id: 1,
            tgid: 100,
            frames: Vec::new(),
            label: label.into(),
        }))
    };
    let mut r = DeviceCallRecord::new(c);
    r.site = site("grow_cache < train_step");
    r.oom = Some(vec![LiveSiteRow {
        device: Device {
            vendor: Vendor::Nvidia,
            index: 1,
        },
        bytes: 60 << 30,
        allocations: 3,
        site: site("cache_activations < forward"),
    }]);
    let mut out = feed(&mut d, &[identity(100, 3), Record::DeviceCall(Box::new(r))]);
    // It waits for the allocator's retry first.
    d.tick(5 * S + 100 + oom::SETTLE_NS - 1, &mut out);
    assert!(out.is_empty(), "{out:?}");
    d.tick(5 * S + 100 + oom::SETTLE_NS, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    let f = &out[0];
    assert_eq!((f.kind, f.ranks.clone()), (FindingKind::DeviceOom, vec![3]));
    assert_eq!(f.evidence["attempts"], 1);
    assert_eq!(f.evidence["requested_bytes"], 16u64 << 30);
    assert_eq!(f.evidence["device"], "gpu1");
    assert_eq!(f.evidence["stack"], "grow_cache < train_step");
    assert_eq!(
        f.evidence["largest_live_sites"][0]["stack"],
        "cache_activations < forward"
    );
    assert_eq!(
        f.summary,
        "device_oom: rank 3 failed to allocate 16384 MiB on gpu1 in cudaMalloc at \
         grow_cache < train_step with 71680 MiB held; the largest live site holds 61440 MiB \
         (cache_activations < forward)"
    );
}

/// A `cudaMalloc` on gpu0 at `ts`: failed (`Err(requested)`) or granted
/// (`Ok(bytes)`), with what the device holds after it.
fn malloc(tgid: u32, ts: u64, outcome: Result<u64, u64>, held: u64) -> Record {
    let mut c = call(tgid, CallKind::Malloc, "cudaMalloc", ts, ts);
    c.library = Library::Cudart;
    c.error = outcome.is_err();
    c.ret = Some(if outcome.is_err() { 2 } else { 0 });
    c.memory = Some(MemoryEffect {
        device: Device {
            vendor: Vendor::Nvidia,
            index: 0,
        },
        delta: outcome.map_or(0, |b| b as i64),
        held_after: held,
        failed_request: outcome.err(),
        untracked: false,
        site: None,
    });
    Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
}

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;

/// PyTorch's caching allocator answers a failed `cudaMalloc` by releasing
/// its cached blocks and trying again: when the retry gets the memory,
/// the job never saw an error, and there is no finding.
#[test]
fn a_failed_allocation_the_retry_gets_is_no_oom() {
    let mut d = detectors(300);
    let mut out = feed(
        &mut d,
        &[
            identity(100, 0),
            malloc(100, S, Err(20 << 30), 70 << 30),
            // Cached blocks released (frees), then the same request again.
            malloc(100, S + 10 * MS, Ok(20 << 30), 70 << 30),
        ],
    );
    d.tick(5 * S, &mut out);
    d.finish(6 * S, &mut out);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(d.oom.recovered, 1);
    // A smaller allocation succeeding is no recovery of the larger one.
    let mut out = feed(
        &mut d,
        &[
            malloc(100, 7 * S, Err(20 << 30), 70 << 30),
            malloc(100, 7 * S + MS, Ok(MIB), 70 << 30),
        ],
    );
    d.finish(7 * S + 2 * MS, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
}

/// The retry fails too (as on the H100: 288 MiB held, 128 MiB released,
/// the same 279 GiB request again): one finding, naming both attempts.
#[test]
fn a_failed_retry_is_one_oom_with_its_attempts() {
    let mut d = detectors(300);
    let mut out = feed(
        &mut d,
        &[
            identity(100, 0),
            malloc(100, S, Err(279 << 30), 288 * MIB),
            malloc(100, S + 10 * MS, Err(279 << 30), 160 * MIB),
        ],
    );
    d.tick(S + 500 * MS, &mut out);
    assert!(out.is_empty(), "{out:?}");
    d.tick(2 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    let f = &out[0];
    assert_eq!(f.evidence["attempts"], 2);
    assert_eq!(f.evidence["released_between_attempts_bytes"], 128 * MIB);
    assert_eq!(f.evidence["held_bytes"], 160 * MIB);
    assert_eq!(f.start_ns, S + 10 * MS, "the last attempt");
    assert!(
        f.summary.starts_with(
            "device_oom: rank 0 failed to allocate 285696 MiB on gpu0 in cudaMalloc \
             (2 attempts; 128 MiB released between them) at (unknown) with 160 MiB held"
        ),
        "{}",
        f.summary
    );
}

/// A process that fails and exits is reported at its exit, not a settling
/// time later; one that retries the same request for good is reported
/// once per settling time, not per attempt.
#[test]
fn an_oom_is_reported_at_exit_and_endless_retries_once_a_second() {
    let mut d = detectors(300);
    let out = feed(
        &mut d,
        &[
            identity(100, 0),
            malloc(100, S, Err(MIB << 10), 0),
            exit(100, None),
        ],
    );
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].detected_ns, 2 * S, "at most a settling time late");
    assert_eq!(out[0].kind, FindingKind::DeviceOom);
    assert!(d.oom.forgot(100));

    let mut records = vec![identity(200, 1)];
    records.extend((0..30).map(|i| malloc(200, 10 * S + i * 100 * MS, Err(MIB << 10), 0)));
    let mut out = feed(&mut d, &records);
    d.finish(13 * S, &mut out);
    let attempts: Vec<u64> = out
        .iter()
        .map(|f| f.evidence["attempts"].as_u64().unwrap())
        .collect();
    assert_eq!(attempts, [10, 10, 10], "{out:?}");
}

pub(super) fn exit(tgid: u32, code: Option<i32>) -> Record {
    Record::Exit {
        exit: Exit {
            cpu: 0,
            ts: 9 * S,
            tid: tgid,
            tgid,
            prio: 120,
            comm: Comm(*b"sim_rank_nvidia\0"),
            group_dead: true,
            group_known: true,
            exit_code: code,
        },
        process_ended: true,
    }
}

#[test]
fn a_process_killed_by_a_signal_is_a_crash() {
    let mut d = detectors(300);
    let out = feed(
        &mut d,
        &[
            identity(100, 1),
            identity(101, 0),
            // SIGABRT with a core dump; a normal exit with status 1; unknown.
            exit(100, Some(libc::SIGABRT | 0x80)),
            exit(101, Some(1 << 8)),
            exit(102, None),
        ],
    );
    assert_eq!(out.len(), 1, "{out:?}");
    let f = &out[0];
    assert_eq!((f.kind, f.ranks.clone()), (FindingKind::Crash, vec![1]));
    assert_eq!(f.evidence["signal"], libc::SIGABRT);
    assert_eq!(f.evidence["signal_name"], "SIGABRT");
    assert_eq!(
        f.summary,
        "crash: rank 1 (pid 100) was killed by SIGABRT, core dumped"
    );
}

/// Both members entered all-reduce #4 and both wait in their stream sync
/// past the timeout: the all-reduce never completed (it hangs inside);
/// one finding names it, with every member. With one member not stuck,
/// its peer's wait is a call of its own (no collective to blame).
#[test]
fn a_collective_every_member_entered_and_none_left_is_one_hang() {
    let mut d = detectors(2);
    let mut records = vec![identity(100, 0), identity(101, 1)];
    for seq in 1..=4 {
        for rank in 0..2 {
            records.push(allreduce(rank, 2, seq, seq * S + u64::from(rank)));
        }
    }
    // Rank 1 began its wait later: not past the timeout at the first tick,
    // still one finding (then none more).
    records.push(snapshot(
        8 * S,
        vec![open_sync(0, 4 * S + 5_000), open_sync(1, 7 * S)],
    ));
    let mut out = feed(&mut d, &records);
    d.tick(8 * S, &mut out);
    let mut later = feed(
        &mut d,
        &[snapshot(
            10 * S,
            vec![open_sync(0, 4 * S + 5_000), open_sync(1, 7 * S)],
        )],
    );
    d.tick(10 * S, &mut later);
    assert!(later.is_empty(), "{later:#?}");
    assert_eq!(out.len(), 1, "{out:#?}");
    let f = &out[0];
    assert_eq!(
        (f.kind, f.ranks.clone(), f.seq),
        (FindingKind::Hang, vec![0, 1], Some(4))
    );
    assert!(f.comm.is_some(), "{f:?}");
    assert!(
        f.summary.contains("entered by every member, and none left"),
        "{}",
        f.summary
    );

    let mut d = detectors(2);
    records.pop();
    records.push(snapshot(8 * S, vec![open_sync(0, 4 * S + 5_000)]));
    let mut out = feed(&mut d, &records);
    d.tick(8 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:#?}");
    assert_eq!((out[0].comm.clone(), out[0].ranks.clone()), (None, vec![0]));
}

fn identity_in(tgid: u32, rank: u32, job: &str) -> Record {
    Record::Identity {
        tgid,
        identity: Box::new(RankIdentity::from_environ(
            format!("RANK={rank}\0XPUSCOPE_JOB={job}\0").as_bytes(),
        )),
    }
}

/// A crash says at which step (all-reduces entered before, on the DP
/// communicator); the launcher then stops the other ranks with SIGTERM and
/// SIGKILL: consequences of the crash, not more crashes (counted).
#[test]
fn ranks_stopped_after_a_crash_are_not_more_crashes() {
    let mut d = detectors(300);
    let mut records = vec![identity(100, 0), identity(101, 1), identity(102, 2)];
    for seq in 1..=3 {
        for rank in 0..3 {
            records.push(allreduce(rank, 3, seq, seq * S + u64::from(rank)));
        }
    }
    records.extend([
        exit(101, Some(libc::SIGSEGV)),
        exit(100, Some(libc::SIGTERM)),
        exit(102, Some(libc::SIGKILL)),
    ]);
    let out = feed(&mut d, &records);
    assert_eq!(out.len(), 1, "{out:#?}");
    assert_eq!(
        (out[0].kind, out[0].ranks.clone()),
        (FindingKind::Crash, vec![1])
    );
    assert_eq!(out[0].step, Some(3), "three all-reduces entered before");
    assert_eq!(
        out[0].evidence["step_source"], STEP_SOURCE,
        "{:#}",
        out[0].evidence
    );
    assert_eq!(out[0].evidence["stop_signal"], false);
    assert!(
        out[0].summary.contains("killed by SIGSEGV in step 3"),
        "{}",
        out[0].summary
    );
    assert_eq!(d.crash.stopped_after_trouble, 2);
}

/// A traced process that is no rank (a launcher's helper) stopped by a
/// stop signal is the launcher tidying up, not a crash; killed by a fault
/// signal it is one.
#[test]
fn a_process_without_a_rank_stopped_by_its_launcher_is_no_crash() {
    let mut d = detectors(300);
    let out = feed(
        &mut d,
        &[
            identity(100, 0),
            exit(150, Some(libc::SIGKILL)),
            exit(151, Some(libc::SIGTERM)),
            exit(152, Some(libc::SIGSEGV)),
        ],
    );
    assert_eq!(out.len(), 1, "{out:#?}");
    assert_eq!(out[0].kind, FindingKind::Crash);
    assert_eq!(out[0].evidence["pid"], 152);
    assert!(out[0].ranks.is_empty());
    assert_eq!(d.crash.stopped_without_rank, 2);
}

/// A hang puts its job in trouble too; a stop signal with no trouble
/// before it is reported once (the first rank stopped; the rest of that
/// stop follow it); another job's ranks are judged on their own, and a
/// job that gets a new rank (restarted) is judged afresh.
#[test]
fn stop_signals_are_judged_per_job() {
    let mut d = detectors(1);
    let mut out = feed(
        &mut d,
        &[
            identity_in(100, 0, "a"),
            identity_in(101, 1, "a"),
            identity_in(200, 0, "b"),
            identity_in(201, 1, "b"),
            snapshot(5 * S, vec![open_allreduce(0, 2, 4, S)]),
        ],
    );
    d.tick(5 * S, &mut out);
    assert_eq!(
        out.iter().map(|f| f.kind).collect::<Vec<_>>(),
        [FindingKind::Hang]
    );
    out.extend(feed(
        &mut d,
        &[
            exit(100, Some(libc::SIGTERM)),
            exit(101, Some(libc::SIGTERM)),
            // Job b, in no trouble: its first stopped rank is reported.
            exit(200, Some(libc::SIGTERM)),
            exit(201, Some(libc::SIGKILL)),
        ],
    ));
    let crashes: Vec<&Finding> = out
        .iter()
        .filter(|f| f.kind == FindingKind::Crash)
        .collect();
    assert_eq!(crashes.len(), 1, "{out:#?}");
    assert_eq!(crashes[0].evidence["pid"], 200);
    assert_eq!(crashes[0].evidence["stop_signal"], true);
    assert!(
        crashes[0]
            .summary
            .contains("usually sent by another process")
    );
    assert_eq!(d.crash.stopped_after_trouble, 3);
    // Job b restarts: a new rank; a later stop is reported again.
    let out = feed(
        &mut d,
        &[identity_in(300, 0, "b"), exit(300, Some(libc::SIGTERM))],
    );
    assert_eq!(out.len(), 1, "{out:#?}");
    assert_eq!(out[0].evidence["pid"], 300);
}

/// A process that ended leaves nothing behind: its membership goes, so a
/// peer stuck after it is not blamed on it.
#[test]
fn state_goes_with_the_process() {
    let mut d = detectors(1);
    let mut out = feed(
        &mut d,
        &[
            identity(100, 0),
            identity(101, 1),
            allreduce(0, 2, 0, 0),
            allreduce(1, 2, 0, 0),
            exit(101, Some(0)),
        ],
    );
    assert!(d.hang_state_is_empty_for(101));
    d.record(&snapshot(5 * S, vec![open_allreduce(0, 2, 1, S)]), &mut out);
    d.tick(5 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    assert!(
        out[0].summary.contains("1 of its 2 members are not traced"),
        "{}",
        out[0].summary
    );
    assert_eq!(out[0].ranks, vec![0], "the stuck rank");
}

/// The sink sends each finding back (to the pipeline) and hands every
/// one back at the end.
#[test]
fn the_sink_feeds_findings_back_and_returns_them() {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut sink = DetectSink::new(
        DetectConfig {
            hang_timeout: Duration::from_secs(1),
            ..DetectConfig::default()
        },
        Some(tx),
    );
    let lost = SinkCounters::default();
    sink.on_batch(&[identity(100, 0), exit(100, Some(libc::SIGSEGV))], &lost)
        .unwrap();
    let back: Vec<Finding> = rx
        .try_iter()
        .map(|r| match r {
            Record::Finding(f) => *f,
            other => panic!("a finding, not {other:?}"),
        })
        .collect();
    assert_eq!(back.len(), 1);
    let all = sink.finish(10 * S, &lost).unwrap();
    // Streamed as found; at the end grouped into incidents (its own).
    assert!(back[0].link.incident.is_none(), "{back:?}");
    let ungrouped: Vec<Finding> = all
        .iter()
        .cloned()
        .map(|mut f| {
            f.link = Default::default();
            f
        })
        .collect();
    assert_eq!(ungrouped, back);
    let link = &all[0].link;
    assert_eq!(
        (link.id, link.incident, link.cause),
        (Some(1), Some(1), None)
    );
}

/// The rank that never entered: where its main thread waits, from the
/// stack it left its CPU with (Python frames where it has them), in the
/// summary and the evidence.
#[test]
fn a_hang_says_where_the_missing_rank_waits() {
    use crate::model::{MainThreadNow, Stack, SymFrame};
    let frame = |function: &str, module: &str| SymFrame {
        function: Arc::from(function),
        module: Arc::from(module),
        module_start: 0,
        module_end: 0,
        module_offset: 0,
        rel_pc: 0,
    };
    let stack = Stack {
        kernel: vec![
            frame("__schedule", "kernel"),
            frame("do_nanosleep", "kernel"),
        ],
        user: vec![
            frame("clock_nanosleep", "/usr/lib/x86_64-linux-gnu/libc.so.6"),
            frame("_PyEval_EvalFrameDefault", "/usr/bin/python3.11"),
            frame(
                "stuck_before_collective (rank.py:274)",
                "[python] /sim/rank.py",
            ),
            frame("before_collective (rank.py:180)", "[python] /sim/rank.py"),
            frame("train_step (rank.py:404)", "[python] /sim/rank.py"),
            frame("main (rank.py:500)", "[python] /sim/rank.py"),
        ],
    };
    let mut d = detectors(10);
    let mut records: Vec<Record> = (0..2).map(|r| identity(100 + r, r)).collect();
    for seq in 0..3 {
        for r in 0..2 {
            records.push(allreduce(r, 2, seq, seq * S));
        }
    }
    records.push(Record::InFlight(Box::new(InFlightSnapshot {
        ts: 16 * S,
        calls: vec![open_allreduce(0, 2, 3, 4 * S)],
        main_threads: vec![
            MainThreadNow {
                tgid: 100,
                thread: ThreadNow::OnCpu,
                stack: None,
            },
            MainThreadNow {
                tgid: 101,
                thread: ThreadNow::Off {
                    state: crate::state::report_state(1, false),
                    since: 4 * S,
                },
                stack: Some(Arc::new(stack)),
            },
        ],
    })));
    let mut out = feed(&mut d, &records);
    d.tick(16 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    let f = &out[0];
    assert_eq!(f.ranks, vec![1]);
    assert!(
        f.summary.contains(
            "; rank 1's main thread sleeping for 12.0 s in do_nanosleep <- \
             stuck_before_collective (rank.py:274) <- before_collective (rank.py:180) <- \
             train_step (rank.py:404) <- main (rank.py:500)"
        ),
        "{}",
        f.summary
    );
    let waits = &f.evidence["never_entered_main_threads"][0];
    assert_eq!(waits["rank"], 1);
    assert_eq!(waits["waits_in"], "do_nanosleep");
    assert_eq!(waits["frames"][0], "stuck_before_collective (rank.py:274)");
}

/// A failed allocation of `library` with status `code` by pid 100.
fn failed_malloc(library: Library, function: &'static str, code: i64, ts: u64) -> Record {
    let mut c = call(100, CallKind::Malloc, function, ts, ts + 100);
    c.library = library;
    c.ret = Some(code);
    c.error = true;
    c.memory = Some(MemoryEffect {
        device: Device {
            vendor: library.vendor(),
            index: 0,
        },
        delta: 0,
        held_after: 1 << 30,
        failed_request: Some(256 * MIB),
        untracked: false,
        site: None,
    });
    Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
}

#[test]
fn a_failed_allocation_with_a_driver_error_is_a_device_error_never_a_device_oom() {
    for (library, function, code, name) in [
        (Library::Cudart, "cudaMalloc", 100, "cudaErrorNoDevice"),
        (
            Library::Cudart,
            "cudaMalloc",
            700,
            "cudaErrorIllegalAddress",
        ),
        (
            Library::Cudart,
            "cudaMalloc",
            35,
            "cudaErrorInsufficientDriver",
        ),
        (
            Library::AscendCl,
            "aclrtMalloc",
            507000,
            "ACL_ERROR_RT_INTERNAL_ERROR",
        ),
    ] {
        let mut d = detectors(300);
        // The sticky error repeats: one finding per process and code.
        let mut out = feed(
            &mut d,
            &[
                identity(100, 5),
                failed_malloc(library, function, code, 5 * S),
                failed_malloc(library, function, code, 5 * S + 10 * MS),
            ],
        );
        d.finish(5 * S + 10 * oom::SETTLE_NS, &mut out);
        assert_eq!(out.len(), 1, "{name}: {out:#?}");
        let f = &out[0];
        assert_eq!(
            (f.kind, f.ranks.clone()),
            (FindingKind::DeviceError, vec![5])
        );
        assert_eq!(f.evidence["code"], code, "{f:#?}");
        assert_eq!(f.evidence["code_name"], name, "{f:#?}");
        assert_eq!(f.evidence["function"], function);
        assert_eq!(
            f.summary,
            format!(
                "device_error: rank 5's {function} returned {name} ({code}) \
                 (an allocation of 256 MiB; not out of memory)"
            )
        );
    }
}

#[test]
fn an_out_of_memory_status_stays_a_device_oom_and_routine_statuses_are_nothing() {
    let mut d = detectors(300);
    let mut query = call(
        100,
        CallKind::Sync(SyncKind::Event),
        "cudaEventQuery",
        6 * S,
        6 * S + 10,
    );
    query.library = Library::Cudart;
    query.ret = Some(600);
    query.error = true;
    let mut out = feed(
        &mut d,
        &[
            identity(100, 5),
            failed_malloc(Library::AscendCl, "aclrtMalloc", 207001, 5 * S),
            Record::DeviceCall(Box::new(DeviceCallRecord::new(query))),
        ],
    );
    d.finish(10 * S, &mut out);
    let kinds: Vec<_> = out.iter().map(|f| f.kind).collect();
    assert_eq!(kinds, vec![FindingKind::DeviceOom], "{out:#?}");
}

#[test]
fn a_sticky_error_of_any_call_is_a_device_error_once_per_code() {
    let mut d = detectors(300);
    let sync = |code: i64, ts: u64| {
        let mut c = call(
            100,
            CallKind::Sync(SyncKind::Stream),
            "cudaStreamSynchronize",
            ts,
            ts + 10,
        );
        c.library = Library::Cudart;
        c.ret = Some(code);
        c.error = true;
        Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
    };
    let mut out = feed(
        &mut d,
        &[
            identity(100, 2),
            sync(719, S),
            sync(719, 2 * S),
            sync(214, 3 * S),
        ],
    );
    d.finish(4 * S, &mut out);
    let names: Vec<_> = out
        .iter()
        .map(|f| {
            (
                f.kind,
                f.evidence["code_name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(
        names,
        vec![
            (FindingKind::DeviceError, "cudaErrorLaunchFailure".into()),
            (FindingKind::DeviceError, "cudaErrorECCUncorrectable".into())
        ]
    );
}

/// The sink's findings as they stream, from `records` then a tick at `at`.
fn stream(
    sink: &mut DetectSink,
    rx: &std::sync::mpsc::Receiver<Record>,
    records: &[Record],
    at: u64,
) -> Vec<Finding> {
    let lost = SinkCounters::default();
    sink.on_batch(records, &lost).unwrap();
    sink.on_tick(at, &lost).unwrap();
    rx.try_iter()
        .filter_map(|r| match r {
            Record::Finding(f) => Some(*f),
            _ => None,
        })
        .collect()
}

/// An all-reduce of process `pid` as member `member` of the two-member
/// communicator `hash`: finished (`open` false) or in flight.
fn member_call(pid: u32, hash: u64, member: u32, seq: u64, start: u64) -> (Record, OpenCall) {
    let comm = CommContext {
        handle: hash ^ u64::from(member),
        id_hash: Some(hash),
        rank: Some(member),
        size: Some(2),
        seq: Some(seq),
        seq_exact: true,
    };
    let mut c = call(
        pid,
        CallKind::Collective(Collective::AllReduce),
        "ncclAllReduce",
        start,
        start + 1_000,
    );
    c.comm = Some(comm);
    let open = OpenCall {
        tgid: pid,
        tid: pid,
        library: Library::Nccl,
        function: "ncclAllReduce",
        kind: CallKind::Collective(Collective::AllReduce),
        start_ts: start,
        comm: Some(comm),
        peer: None,
        thread: ThreadNow::Off {
            state: 1,
            since: start + 10,
        },
    };
    (Record::DeviceCall(Box::new(DeviceCallRecord::new(c))), open)
}

/// Ranks 0, 1, 2 of job `j` (pids `first`..): ranks 0 and 1 share
/// communicator A, ranks 1 and 2 communicator B. Rank 0 never enters A's
/// #5, so rank 1 waits there and never enters B's #5, where rank 2 waits:
/// the hang on B (rank 1 missing) follows from the hang on A (rank 0
/// missing, rank 1 waiting), found a tick later (`b_at`: 8 s into the
/// run), or at the same tick (6.5 s). `extra` joins the first batch.
fn chained_hangs(
    sink: &mut DetectSink,
    rx: &std::sync::mpsc::Receiver<Record>,
    first: u32,
    t0: u64,
    b_at: u64,
    extra: &[Record],
) -> Vec<Finding> {
    let (a, b) = (0xa000 + u64::from(first), 0xb000 + u64::from(first));
    let mut records: Vec<Record> = (0..3)
        .map(|r| identity_in(first + r, r, "j"))
        .chain(extra.iter().cloned())
        .collect();
    for seq in 0..5 {
        let at = t0 + seq * S;
        records.push(member_call(first, a, 0, seq, at).0);
        records.push(member_call(first + 1, a, 1, seq, at).0);
        records.push(member_call(first + 1, b, 0, seq, at + 1_000).0);
        records.push(member_call(first + 2, b, 1, seq, at + 1_000).0);
    }
    let waiting_in_a = member_call(first + 1, a, 1, 5, t0 + 6 * S).1;
    let waiting_in_b = member_call(first + 2, b, 1, 5, t0 + b_at).1;
    records.push(snapshot(
        t0 + 17 * S,
        vec![waiting_in_a.clone(), waiting_in_b.clone()],
    ));
    // 11 s in A (over the 10 s timeout), 9 s in B (or 10.5 s).
    let mut found = stream(sink, rx, &records, t0 + 17 * S);
    found.extend(stream(
        sink,
        rx,
        &[snapshot(t0 + 19 * S, vec![waiting_in_a, waiting_in_b])],
        t0 + 19 * S,
    ));
    found
}

/// A finding streamed as it is made says which earlier finding of its
/// job's run explains it (the service then neither dumps nor counts it as
/// a fault of its own); after the job restarted (new processes, the same
/// ranks) nothing of the old run explains the new run's findings, and
/// where two jobs number their ranks alike nothing is linked.
#[test]
fn a_streamed_finding_follows_from_the_earlier_one_of_its_run_that_explains_it() {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut sink = DetectSink::new(
        DetectConfig {
            hang_timeout: Duration::from_secs(10),
            ..DetectConfig::default()
        },
        Some(tx),
    );
    let shape = |found: &[Finding]| -> Vec<(FindingKind, Vec<u32>, bool)> {
        found
            .iter()
            .map(|f| (f.kind, f.ranks.clone(), f.link.follows_from.is_some()))
            .collect()
    };
    let first = chained_hangs(&mut sink, &rx, 100, 0, 8 * S, &[]);
    assert_eq!(
        shape(&first),
        vec![
            (FindingKind::Hang, vec![0], false),
            (FindingKind::Hang, vec![1], true),
        ],
        "{first:#?}"
    );
    assert_eq!(first[1].link.follows_from, Some(first[0].headline()));
    // The job restarted: pids 200.. hold the same ranks, on new
    // communicators. Its second hang follows from its own first.
    let second = chained_hangs(&mut sink, &rx, 200, 100 * S, 8 * S, &[]);
    assert_eq!(shape(&second), shape(&first), "{second:#?}");
    assert_eq!(second[1].link.follows_from, Some(second[0].headline()));
    // (Its first hang names rank 0 as the first run's did: without the
    // run, it would follow from that one.)
    // Another job with ranks 0..3 too: a rank number no longer says
    // whose finding it is, so this run's findings stand alone.
    let other: Vec<Record> = (0..3).map(|r| identity_in(400 + r, r, "k")).collect();
    let third = chained_hangs(&mut sink, &rx, 300, 200 * S, 8 * S, &other);
    assert_eq!(third.len(), 2, "{third:#?}");
    assert!(
        third.iter().all(|f| f.link.follows_from.is_none()),
        "{third:#?}"
    );
    // Job k ends: a minute on, rank numbers say whose findings they are
    // again. Found at the same tick, in whatever order they come out,
    // the hangs are judged together: B follows from A.
    let mut k_ends = Vec::new();
    for pid in 400..403 {
        let mut e = exit(pid, Some(0));
        if let Record::Exit { exit, .. } = &mut e {
            exit.ts = 230 * S;
        }
        k_ends.push(e);
    }
    stream(&mut sink, &rx, &k_ends, 230 * S);
    let fourth = chained_hangs(&mut sink, &rx, 500, 300 * S, 6 * S + S / 2, &[]);
    let mut by_rank = shape(&fourth);
    by_rank.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(by_rank, shape(&first), "{fourth:#?}");
    // At the end the run's findings are grouped; the stream's links give
    // way to the document's.
    let all = sink.finish(400 * S, &SinkCounters::default()).unwrap();
    assert!(all.iter().all(|f| f.link.follows_from.is_none()));
    assert!(all.iter().any(|f| f.link.cause.is_some()));
}

/// A job's run: a new process holding a rank the run has seen begins
/// the next run; ranks of two jobs numbered alike name no run.
#[test]
fn a_rank_seen_again_in_a_new_process_begins_the_jobs_next_run() {
    let mut d = detectors(300);
    let run_of = |d: &Detectors, ranks: &[u32]| d.ranks.run_of(ranks, 10 * S);
    feed(
        &mut d,
        &(0..2)
            .map(|r| identity_in(10 + r, r, "j"))
            .collect::<Vec<_>>(),
    );
    assert_eq!(run_of(&d, &[0, 1]), Some(("j".to_string(), 0)));
    assert_eq!(run_of(&d, &[]), None);
    assert_eq!(run_of(&d, &[2]), None, "no process held rank 2");
    // The same identity again is no new process.
    feed(&mut d, &[identity_in(10, 0, "j")]);
    assert_eq!(run_of(&d, &[0, 1]), Some(("j".to_string(), 0)));
    // Rank 0 in a new process: the restart's run has seen rank 0 only.
    feed(&mut d, &[identity_in(20, 0, "j")]);
    assert_eq!(run_of(&d, &[0]), Some(("j".to_string(), 1)));
    assert_eq!(run_of(&d, &[0, 1]), None);
    feed(&mut d, &[identity_in(21, 1, "j"), identity_in(30, 1, "k")]);
    assert_eq!(run_of(&d, &[0]), Some(("j".to_string(), 1)));
    assert_eq!(run_of(&d, &[1]), None, "jobs j and k both have rank 1");
    // Job k's process ended (exits are stamped 9 s): its run owns the
    // findings of the next minute, then j's rank 1 is j's alone.
    feed(&mut d, &[exit(30, Some(0))]);
    assert_eq!(d.ranks.run_of(&[1], 60 * S), None);
    assert_eq!(
        d.ranks.run_of(&[1], 70 * S),
        Some(("j".to_string(), 1)),
        "k ended over a minute before"
    );
}

/// A finding of the same run long after another that would explain it (the
/// same rank never entering a collective again, 21 minutes on) is a fault
/// of its own; minutes apart, one fault.
#[test]
fn a_finding_long_after_another_of_its_run_is_a_fault_of_its_own() {
    let mut sink = DetectSink::new(DetectConfig::default(), None);
    sink.on_batch(
        &[identity_in(10, 0, "j"), identity_in(11, 1, "j")],
        &SinkCounters::default(),
    )
    .unwrap();
    let hang = |at: u64| Finding {
        link: Default::default(),
        kind: FindingKind::Hang,
        ranks: vec![1],
        comm: Some("nccl:00000000000000aa".into()),
        seq: Some(4),
        step: None,
        start_ns: at,
        end_ns: None,
        summary: format!("hang: at {at}"),
        evidence: serde_json::json!({"entered": [0], "never_entered": [1],
            "stuck": [{"rank": 0}]}),
        detected_ns: at,
    };
    let mut first = vec![hang(100 * S)];
    sink.link(&mut first);
    assert_eq!(first[0].link.follows_from, None);
    let mut soon = vec![hang(400 * S)];
    sink.link(&mut soon);
    assert_eq!(soon[0].link.follows_from, Some(first[0].headline()));
    // 21 minutes on: the one of 400 s is more than 15 minutes before it.
    let mut later = vec![hang(100 * S + 21 * 60 * S)];
    sink.link(&mut later);
    assert_eq!(later[0].link.follows_from, None, "{later:#?}");
}
