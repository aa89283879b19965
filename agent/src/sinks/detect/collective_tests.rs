//! `slow_rank`, `late_arrival` and `slow_link` on synthetic records: ranks
//! (pid 200 + rank) entering all-reduces on communicators, each followed by
//! a stream sync on the same thread that ends when the operation is done.

use std::time::Duration;

use xpuscope_probes::catalog::{CallKind, Collective, Library, SyncKind};
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::{CallArgs, CollectiveArgs};
use xpuscope_probes::decode::comm::CommContext;

use super::*;
use crate::events::{Comm, Exit};
use crate::model::{
    DeviceCallRecord, DeviceWork, EnqueueMarker, FindingKind, StreamTrack, WorkKind,
};

const MS: u64 = 1_000_000;
const MB: u64 = 1 << 20;

fn pid(rank: u32) -> u32 {
    200 + rank
}

fn identity(rank: u32) -> Record {
    Record::Identity {
        tgid: pid(rank),
        identity: Box::new(RankIdentity::from_environ(
            format!("RANK={rank}\0WORLD_SIZE=8\0").as_bytes(),
        )),
    }
}

fn base(rank: u32, kind: CallKind, function: &'static str, start: u64, end: u64) -> DeviceCall {
    DeviceCall {
        library: Library::Nccl,
        function,
        kind,
        tgid: pid(rank),
        tid: pid(rank),
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

/// One member's all-reduce #seq on `comm` (members `size`), entered at
/// `enter`, then its stream sync ending at `done`.
fn member(
    comm: u64,
    rank: u32,
    size: u32,
    seq: u64,
    enter: u64,
    done: u64,
    bytes: u64,
) -> [Record; 2] {
    let mut c = base(
        rank,
        CallKind::Collective(Collective::AllReduce),
        "ncclAllReduce",
        enter,
        enter + 10_000,
    );
    c.comm = Some(CommContext {
        handle: comm ^ u64::from(rank),
        id_hash: Some(comm),
        rank: Some(rank),
        size: Some(size),
        seq: Some(seq),
        seq_exact: true,
    });
    c.args = CallArgs::Collective(CollectiveArgs {
        op: Collective::AllReduce,
        count: Some(bytes / 4),
        dtype: None,
        bytes: Some(bytes),
        red_op: None,
        root: None,
        send: None,
        recv: None,
        comm: comm ^ u64::from(rank),
        stream: Some(1),
    });
    let mut s = base(
        rank,
        CallKind::Sync(SyncKind::Stream),
        "cudaStreamSynchronize",
        enter + 20_000,
        done,
    );
    s.library = Library::Cudart;
    [
        Record::DeviceCall(Box::new(DeviceCallRecord::new(c))),
        Record::DeviceCall(Box::new(DeviceCallRecord::new(s))),
    ]
}

/// `ops` all-reduces on one communicator of `ranks`, one per 100 ms step,
/// members arriving `jitter(rank, op)` ns after the step start, the
/// operation taking `xfer` ns after the last arrival.
fn job(
    comm: u64,
    ranks: &[u32],
    ops: u64,
    bytes: u64,
    xfer: u64,
    late: impl Fn(u32, u64) -> u64,
) -> Vec<(u64, Record)> {
    job_stepped(comm, ranks, ops, bytes, xfer, 100 * MS, late)
}

/// As [`job`], 8 MiB all-reduces of 2 ms, one per `step` ns.
fn job_every(
    comm: u64,
    ranks: &[u32],
    ops: u64,
    step: u64,
    late: impl Fn(u32, u64) -> u64,
) -> Vec<(u64, Record)> {
    job_stepped(comm, ranks, ops, 8 * MB, 2 * MS, step, late)
}

fn job_stepped(
    comm: u64,
    ranks: &[u32],
    ops: u64,
    bytes: u64,
    xfer: u64,
    step: u64,
    late: impl Fn(u32, u64) -> u64,
) -> Vec<(u64, Record)> {
    let mut out = Vec::new();
    for op in 0..ops {
        let t0 = op * step;
        let enters: Vec<u64> = ranks
            .iter()
            .map(|&r| t0 + (u64::from(r) * 7 + op * 3) % 11 * 10_000 + late(r, op))
            .collect();
        let done = enters.iter().max().unwrap() + xfer;
        for (i, &r) in ranks.iter().enumerate() {
            for rec in member(comm, r, ranks.len() as u32, op, enters[i], done, bytes) {
                out.push((enters[i], rec));
            }
        }
    }
    out
}

fn run(world: u32, cfg: DetectConfig, jobs: Vec<Vec<(u64, Record)>>) -> Vec<Finding> {
    let mut d = Detectors::new(cfg);
    let mut out = Vec::new();
    for r in 0..world {
        d.record(&identity(r), &mut out);
    }
    let mut all: Vec<(u64, Record)> = jobs.into_iter().flatten().collect();
    // Stream order: by time (stable: a call before its sync).
    all.sort_by_key(|p| p.0);
    for (_, r) in &all {
        d.record(r, &mut out);
    }
    d.finish(10_000 * MS, &mut out);
    out
}

fn kinds(f: &[Finding]) -> Vec<FindingKind> {
    f.iter().map(|f| f.kind).collect()
}

#[test]
fn a_clean_job_has_no_findings() {
    let f = run(
        4,
        DetectConfig::default(),
        vec![job(0xa, &[0, 1, 2, 3], 30, 8 * MB, 2 * MS, |_, _| 0)],
    );
    assert!(f.is_empty(), "{f:#?}");
}

#[test]
fn one_late_arrival_names_rank_step_and_delay() {
    let f = run(
        4,
        DetectConfig::default(),
        vec![job(0xa, &[0, 1, 2, 3], 20, 8 * MB, 2 * MS, |r, op| {
            if (r, op) == (2, 7) { 60 * MS } else { 0 }
        })],
    );
    assert_eq!(kinds(&f), vec![FindingKind::LateArrival], "{f:#?}");
    let l = &f[0];
    assert_eq!(l.ranks, vec![2]);
    assert_eq!(l.seq, Some(7));
    assert_eq!(l.step, Some(7));
    assert_eq!(l.comm.as_deref(), Some("nccl:000000000000000a"));
    let delay = l.evidence["delay_ms"].as_f64().unwrap();
    assert!((59.0..61.0).contains(&delay), "{delay}");
    assert!(l.summary.contains("rank 2 arrived 59.9"), "{}", l.summary);
    // 100 ms steps: a quarter of the step sets the bar, not the 10 ms floor.
    assert!(
        l.summary
            .contains("set by a quarter of the rank's usual step"),
        "{}",
        l.summary
    );
    let share = l.evidence["threshold_parts"]["step_share_ms"]
        .as_f64()
        .unwrap();
    assert!((24.9..25.1).contains(&share), "{share}");
    assert_eq!(l.evidence["threshold_parts"]["floor_ms"], 10.0);
}

/// A rank late because its thread was blocked in a sync for most of its
/// lateness (waiting for a pipeline peer's send, say) carries that wait:
/// how long, in what, until when. A rank late by its own doing carries
/// none.
#[test]
fn a_late_arrival_carries_what_it_waited_in() {
    let late = |r: u32, op: u64| {
        if (r, op) == (2, 12) || (r, op) == (1, 15) {
            80 * MS
        } else {
            0
        }
    };
    let mut records = job(0xa, &[0, 1, 2, 3], 20, 8 * MB, 2 * MS, late);
    let t0 = 12 * 100 * MS;
    let mut s = base(
        2,
        CallKind::Sync(SyncKind::Stream),
        "cudaStreamSynchronize",
        t0 + 5 * MS,
        t0 + 75 * MS,
    );
    s.library = Library::Cudart;
    records.push((
        t0 + 75 * MS,
        Record::DeviceCall(Box::new(DeviceCallRecord::new(s))),
    ));
    let f = run(4, DetectConfig::default(), vec![records]);
    assert_eq!(
        kinds(&f),
        vec![FindingKind::LateArrival, FindingKind::LateArrival],
        "{f:#?}"
    );
    let waited = f.iter().find(|f| f.ranks == [2]).expect("rank 2");
    let w = &waited.evidence["waited"];
    assert_eq!(w["function"], "cudaStreamSynchronize", "{w}");
    assert_eq!(w["until_ns"], t0 + 75 * MS, "{w}");
    let ms = w["ms"].as_f64().unwrap();
    assert!((69.0..71.0).contains(&ms), "{ms}");
    assert!(
        waited.summary.contains("waiting in cudaStreamSynchronize"),
        "{}",
        waited.summary
    );
    let own = f.iter().find(|f| f.ranks == [1]).expect("rank 1");
    assert!(own.evidence["waited"].is_null(), "{own:#?}");
}

/// Lateness is judged against the job: on 100 ms steps a rank 22 ms late
/// is within a quarter of its step (no finding); on 40 ms steps the same
/// 22 ms is late, and more than half a step: a finding of its own.
#[test]
fn the_threshold_follows_the_step_time() {
    let late_20 = |r: u32, op: u64| if (r, op) == (2, 7) { 22 * MS } else { 0 };
    let f = run(
        4,
        DetectConfig::default(),
        vec![job(0xa, &[0, 1, 2, 3], 20, 8 * MB, 2 * MS, late_20)],
    );
    assert!(f.is_empty(), "{f:#?}");
    let f = run(
        4,
        DetectConfig::default(),
        vec![job_every(0xa, &[0, 1, 2, 3], 20, 40 * MS, late_20)],
    );
    assert_eq!(kinds(&f), vec![FindingKind::LateArrival], "{f:#?}");
    let share = f[0].evidence["threshold_parts"]["step_share_ms"]
        .as_f64()
        .unwrap();
    assert!((9.9..10.1).contains(&share), "{share}");
}

/// More ranks than CPUs: every operation's last arrival is 8-16 ms late
/// (a different rank each time), 60 ms steps. A lone lateness just over
/// half a step is that noise's tail, no finding; one of several steps is.
#[test]
fn a_lone_lateness_is_judged_against_the_usual_worst() {
    let noisy = |r: u32, op: u64| -> u64 {
        let noise = if u64::from(r) == op % 8 {
            (8 + (op * 5) % 9) * MS
        } else {
            0
        };
        match (r, op) {
            (3, 40) => 32 * MS,
            (5, 50) => 150 * MS,
            _ => noise,
        }
    };
    let ranks: Vec<u32> = (0..8).collect();
    let f = run(
        8,
        DetectConfig::default(),
        vec![job_every(0xa, &ranks, 64, 60 * MS, noisy)],
    );
    let late: Vec<&Finding> = f
        .iter()
        .filter(|f| f.kind == FindingKind::LateArrival)
        .collect();
    assert_eq!(late.len(), 1, "{f:#?}");
    assert_eq!((late[0].ranks.clone(), late[0].seq), (vec![5], Some(50)));
    let bar = late[0].evidence["lone_bar_ms"].as_f64().unwrap();
    assert!(
        (40.0..60.0).contains(&bar),
        "three times the usual worst: {bar}"
    );
    assert!(
        kinds(&f).iter().all(|k| *k == FindingKind::LateArrival),
        "{f:#?}"
    );
}

/// A rank whose own arrivals vary by several ms every step (a busy host)
/// is judged against that: a lateness within its own jitter is none.
#[test]
fn the_threshold_follows_the_ranks_own_jitter() {
    // Rank 3 arrives 0-16 ms after its peers, varying every step, on 40 ms
    // steps (a quarter: 10 ms): once 25 ms, within 5 deviations of its own.
    let jittery = |r: u32, op: u64| match (r, op) {
        (3, 12) => 25 * MS,
        (3, _) => (op * 7 % 5) * 4 * MS,
        _ => 0,
    };
    let f = run(
        4,
        DetectConfig::default(),
        vec![job_every(0xa, &[0, 1, 2, 3], 20, 40 * MS, jittery)],
    );
    assert!(f.is_empty(), "{f:#?}");
    // The same 25 ms from a rank that is otherwise punctual is late.
    let steady = |r: u32, op: u64| if (r, op) == (3, 12) { 25 * MS } else { 0 };
    let f = run(
        4,
        DetectConfig::default(),
        vec![job_every(0xa, &[0, 1, 2, 3], 20, 40 * MS, steady)],
    );
    assert_eq!(kinds(&f), vec![FindingKind::LateArrival], "{f:#?}");
}

#[test]
fn a_persistently_late_rank_is_slow_from_its_first_late_step() {
    let f = run(
        4,
        DetectConfig::default(),
        vec![job(0xa, &[0, 1, 2, 3], 20, 8 * MB, 2 * MS, |r, op| {
            if r == 1 && op >= 6 { 30 * MS } else { 0 }
        })],
    );
    assert_eq!(kinds(&f), vec![FindingKind::SlowRank], "{f:#?}");
    let s = &f[0];
    assert_eq!(s.ranks, vec![1]);
    assert_eq!(s.step, Some(6));
    assert_eq!(s.seq, Some(6));
    assert_eq!(s.evidence["late_ops"], 3);
    assert_eq!(
        s.evidence["median_delay_ms"].as_f64().unwrap().round(),
        30.0
    );
    // Compared with its own earlier, on-time operations (about 0 ms).
    assert!(s.evidence["earlier_offset_ms"].as_f64().unwrap().abs() < 1.0);
    assert!(s.summary.contains("rank 1 is a slow rank"), "{}", s.summary);
}

/// The MAD of the others: members with a wide spread raise the bar (no
/// finding for a delay within it), and the floor holds for two members.
#[test]
fn the_threshold_follows_the_spread_of_the_others() {
    let wide = |r: u32, op: u64| u64::from(r) * ((op % 3) * 8 * MS);
    let f = run(
        6,
        DetectConfig::default(),
        vec![job(0xb, &[0, 1, 2, 3, 4, 5], 12, 8 * MB, 2 * MS, wide)],
    );
    assert!(f.is_empty(), "{f:#?}");
    let f = run(
        2,
        DetectConfig::default(),
        vec![job(0xc, &[0, 1], 12, 8 * MB, 2 * MS, |r, op| {
            if (r, op) == (1, 4) {
                60 * MS
            } else if (r, op) == (0, 8) {
                8 * MS
            } else {
                0
            }
        })],
    );
    assert_eq!(kinds(&f), vec![FindingKind::LateArrival], "{f:#?}");
    assert_eq!((f[0].ranks.clone(), f[0].seq), (vec![1], Some(4)));
}

/// Ranks 0-3 in a ring of two-member communicators; rank 1's link makes
/// its two communicators 4x slower: the finding names rank 1 alone.
#[test]
fn a_slow_link_is_localized_to_the_rank_in_every_slow_communicator() {
    let ring = [
        (0xa0, [0, 1]),
        (0xa1, [1, 2]),
        (0xa2, [2, 3]),
        (0xa3, [3, 0]),
    ];
    let jobs = ring
        .iter()
        .map(|(c, m)| {
            let xfer = if m.contains(&1) { 8 * MS } else { 2 * MS };
            job(*c, m, 10, 8 * MB, xfer, |_, _| 0)
        })
        .collect();
    let f = run(4, DetectConfig::default(), jobs);
    assert_eq!(kinds(&f), vec![FindingKind::SlowLink], "{f:#?}");
    assert_eq!(f[0].ranks, vec![1]);
    assert_eq!(f[0].evidence["localized"], true);
    let ratio = f[0].evidence["ratio"].as_f64().unwrap();
    assert!((3.5..4.5).contains(&ratio), "{ratio}");
    // Small operations (latency-bound) are not compared.
    let jobs = ring
        .iter()
        .map(|(c, m)| {
            let xfer = if m.contains(&1) { 8 * MS } else { 2 * MS };
            job(*c, m, 10, 64 << 10, xfer, |_, _| 0)
        })
        .collect();
    assert!(run(4, DetectConfig::default(), jobs).is_empty());
}

#[test]
fn thresholds_come_from_the_config() {
    let cfg = DetectConfig {
        collective: collective::CollectiveConfig {
            late_min: Duration::from_millis(70),
            ..Default::default()
        },
        ..Default::default()
    };
    let f = run(
        4,
        cfg,
        vec![job(0xa, &[0, 1, 2, 3], 20, 8 * MB, 2 * MS, |r, op| {
            if (r, op) == (2, 7) { 60 * MS } else { 0 }
        })],
    );
    assert!(f.is_empty(), "{f:#?}");
}

#[test]
fn a_process_end_reports_its_pending_late_arrival_and_forgets_it() {
    let mut d = Detectors::new(DetectConfig::default());
    let mut out = Vec::new();
    for r in 0..2 {
        d.record(&identity(r), &mut out);
    }
    let mut all = job(0xd, &[0, 1], 4, 8 * MB, 2 * MS, |r, op| {
        if (r, op) == (1, 3) { 120 * MS } else { 0 }
    });
    all.sort_by_key(|p| p.0);
    for (_, r) in &all {
        d.record(r, &mut out);
    }
    assert!(out.is_empty());
    d.record(
        &Record::Exit {
            exit: Exit {
                cpu: 0,
                ts: 0,
                tid: pid(1),
                tgid: pid(1),
                prio: 120,
                comm: Comm(*b"sim_rank_nvidia\0"),
                group_dead: true,
                group_known: true,
                exit_code: Some(0),
            },
            process_ended: true,
        },
        &mut out,
    );
    assert_eq!(kinds(&out), vec![FindingKind::LateArrival]);
    assert_eq!((out[0].ranks.clone(), out[0].step), (vec![1], Some(3)));
    assert!(d.hang_state_is_empty_for(pid(1)));
}

/// A member that always enters 20 ms after its peers (a later pipeline
/// stage) is judged against its own usual offset: late only beyond it.
#[test]
fn a_member_is_compared_with_its_own_usual_offset() {
    let f = run(
        4,
        DetectConfig::default(),
        vec![job(
            0xe,
            &[0, 1, 2, 3],
            16,
            8 * MB,
            2 * MS,
            |r, op| match (r, op) {
                (3, 9) => 80 * MS,
                (3, _) => 20 * MS,
                _ => 0,
            },
        )],
    );
    assert_eq!(kinds(&f), vec![FindingKind::LateArrival], "{f:#?}");
    assert_eq!((f[0].ranks.clone(), f[0].seq), (vec![3], Some(9)));
}

/// Rank `rank`'s kernels of op `op`: five compute kernels of `each` ns
/// from 10 ms into the step, and a collective kernel (NCCL's) that waits
/// `wait` ns; stamped at `seen` (activity records come late, in buffers).
fn kernels(rank: u32, op: u64, each: u64, wait: u64, seen: u64) -> Vec<(u64, Record)> {
    use crate::model::{DeviceWork, StreamTrack, WorkKind};
    let t0 = op * 100 * MS + 10 * MS;
    let work = |kind, start: u64, end: u64, name: &str| {
        Record::DeviceWork(Box::new(DeviceWork {
            track: StreamTrack {
                tgid: pid(rank),
                name: "GPU 0 stream 7".into(),
                estimated: false,
            },
            kind,
            start,
            end,
            name: name.into(),
            fields: Vec::new(),
            flows: Vec::new(),
        }))
    };
    let mut v: Vec<(u64, Record)> = (0..5)
        .map(|k| {
            let s = t0 + k * each;
            (seen, work(WorkKind::Compute, s, s + each, "gemm"))
        })
        .collect();
    let c = t0 + 5 * each;
    v.push((
        seen,
        work(
            WorkKind::Communication,
            c,
            c + wait,
            "ncclDevKernel_AllReduce",
        ),
    ));
    v
}

/// 12 all-reduces of `ranks` on one communicator, rank 2's device 4x
/// slower from op 4 on; each op's kernels delivered 150 ms late (after
/// later steps' calls, as activity records come).
fn slow_device_job(ranks: &[u32]) -> Vec<(u64, Record)> {
    let mut records = job(0xd, ranks, 12, 8 * MB, 2 * MS, |_, _| 0);
    for op in 0..12 {
        for &r in ranks {
            let slow = r == 2 && op >= 4;
            let each = if slow { 8 * MS } else { 2 * MS };
            let wait = if slow { MS } else { 31 * MS };
            records.extend(kernels(r, op, each, wait, (op * 100 + 150) * MS + 1));
        }
    }
    records
}

/// A device 4x slower from op 4 on: its host arrives on time (no
/// late_arrival), its kernels are 4x longer than its peers', and its peers'
/// collective kernels wait for it (longer, but not compute). Found as a
/// slow rank from the first slow step, once three steps in a row show it.
#[test]
fn a_slow_device_is_a_slow_rank_from_its_compute_kernels() {
    let ranks = [0, 1, 2, 3];
    let f = run(4, DetectConfig::default(), vec![slow_device_job(&ranks)]);
    assert_eq!(kinds(&f), vec![FindingKind::SlowRank], "{f:#?}");
    let slow = &f[0];
    assert_eq!(slow.ranks, vec![2]);
    // Op 4's kernels end in the window the all-reduce of op 5 closes.
    assert_eq!(slow.step, Some(5), "{slow:#?}");
    assert_eq!(slow.evidence["steps"], serde_json::json!([5, 6, 7]));
    assert_eq!(slow.evidence["ratio"][0], 4.0);
    assert!(
        slow.summary.contains("rank 2 is a slow rank on the device"),
        "{}",
        slow.summary
    );

    // The same job with every device alike: nothing.
    let mut clean = job(0xd, &ranks, 12, 8 * MB, 2 * MS, |_, _| 0);
    for op in 0..12 {
        for &r in &ranks {
            clean.extend(kernels(
                r,
                op,
                2 * MS + u64::from(r) * 100_000,
                2 * MS,
                (op * 100 + 150) * MS + 1,
            ));
        }
    }
    let f = run(4, DetectConfig::default(), vec![clean]);
    assert!(f.is_empty(), "{f:#?}");
}

/// A rank that exits is forgotten by the device-compute detector too.
#[test]
fn device_compute_state_goes_with_the_process() {
    let mut d = Detectors::new(DetectConfig::default());
    let mut out = Vec::new();
    let mut records = job(0xe, &[0, 1], 3, 8 * MB, 2 * MS, |_, _| 0);
    records.extend(kernels(0, 0, MS, MS, 1));
    records.sort_by_key(|p| p.0);
    for (_, r) in &records {
        d.record(r, &mut out);
    }
    assert!(!d.hang_state_is_empty_for(pid(0)));
    for r in [0, 1] {
        d.record(&exit_of(r, 400 * MS), &mut out);
        assert!(d.hang_state_is_empty_for(pid(r)));
    }
}

/// Rank `rank`'s process exits at `ts`.
fn exit_of(rank: u32, ts: u64) -> Record {
    Record::Exit {
        exit: Exit {
            cpu: 0,
            ts,
            tid: pid(rank),
            tgid: pid(rank),
            prio: 120,
            comm: Comm::default(),
            group_dead: true,
            group_known: true,
            exit_code: Some(0),
        },
        process_ended: true,
    }
}

/// The agent writes a stream's activity at the process's exit (or every
/// 4,096 pieces of work): the peer that exits first is judged with the one
/// that exits later, from what it left behind.
#[test]
fn a_slow_device_is_found_when_the_activity_comes_at_each_exit() {
    let ranks = [0, 1];
    let mut records = job(0xf, &ranks, 10, 8 * MB, 2 * MS, |_, _| 0);
    for r in ranks {
        let at = 2_000 * MS + u64::from(r) * 100 * MS;
        for op in 0..10 {
            let each = if r == 1 && op >= 2 { 6 * MS } else { 2 * MS };
            records.extend(kernels(r, op, each, MS, at));
        }
        records.push((at + 1, exit_of(r, at + 1)));
    }
    let mut d = Detectors::new(DetectConfig::default());
    let mut out = Vec::new();
    for r in 0..2 {
        d.record(&identity(r), &mut out);
    }
    records.sort_by_key(|p| p.0);
    for (_, r) in &records {
        d.record(r, &mut out);
    }
    let slow: Vec<&Finding> = out
        .iter()
        .filter(|f| f.kind == FindingKind::SlowRank)
        .collect();
    assert_eq!(slow.len(), 1, "{out:#?}");
    assert_eq!(slow[0].ranks, vec![1]);
    assert_eq!(slow[0].step, Some(3));
    assert!(d.hang_state_is_empty_for(pid(0)) && d.hang_state_is_empty_for(pid(1)));
}

/// The host's view hides the link (20 ms of queued compute after every
/// last arrival, on every communicator); the device's does not: each
/// member's collective kernel (activity records, linked to its host call
/// by the API record inside it) lasts its wait plus the transfer, and the
/// shortest member's is the transfer alone: 4x on the communicators
/// through rank 1. The slow link is found from the device, localized.
#[test]
fn a_slow_link_is_found_from_the_collective_kernels_on_the_device() {
    let ring = [
        (0xa0, [0, 1]),
        (0xa1, [1, 2]),
        (0xa2, [2, 3]),
        (0xa3, [3, 0]),
    ];
    let mut flow = 0u64;
    let jobs = ring
        .iter()
        .enumerate()
        .map(|(k, (c, m))| {
            let xfer = if m.contains(&1) { 8 * MS } else { 2 * MS };
            let mut v = job(*c, m, 10, 8 * MB, 20 * MS, |_, _| 0);
            // Each communicator's calls on a thread of their own (the
            // synthetic job has a rank's two communicators' calls at the
            // same instant, which one thread cannot make).
            let mut calls: Vec<(u64, u32, u32)> = Vec::new();
            for (ts, r) in v.iter_mut() {
                if let Record::DeviceCall(d) = r
                    && d.call.function == "ncclAllReduce"
                {
                    d.call.tid = d.call.tgid * 10 + k as u32;
                    calls.push((*ts, d.call.tgid, d.call.tid));
                }
            }
            for (i, (enter, tgid, tid)) in calls.into_iter().enumerate() {
                flow += 1;
                // The second member of each operation waited 1 ms for the
                // first; reported once the step's sync is over.
                let wait = if i % 2 == 1 { MS } else { 0 };
                let seen = enter + 30 * MS;
                v.push((
                    seen,
                    Record::Enqueued(EnqueueMarker {
                        tgid,
                        tid,
                        ts: enter + 5_000,
                        correlation: flow,
                        flow,
                    }),
                ));
                v.push((
                    seen,
                    Record::DeviceWork(Box::new(DeviceWork {
                        track: StreamTrack {
                            tgid,
                            name: "GPU 0 stream 1".into(),
                            estimated: false,
                        },
                        kind: WorkKind::Communication,
                        start: enter + 20_000,
                        end: enter + 20_000 + wait + xfer,
                        name: "ncclDevKernel_AllReduce_Sum_f32_RING_LL".into(),
                        fields: Vec::new(),
                        flows: vec![flow],
                    })),
                ));
            }
            v
        })
        .collect();
    let f = run(4, DetectConfig::default(), jobs);
    assert_eq!(kinds(&f), vec![FindingKind::SlowLink], "{f:#?}");
    assert_eq!(f[0].ranks, vec![1]);
    assert_eq!(f[0].evidence["source"], "device");
    assert_eq!(f[0].evidence["localized"], true);
    let ratio = f[0].evidence["ratio"].as_f64().unwrap();
    assert!((3.5..4.5).contains(&ratio), "{ratio}");
}

/// Two jobs on one node (ranks 0-3 of job "a", 4-7 of job "b"): each
/// job's communicators are judged among themselves. Job b's network is
/// uniformly 4x slower than job a's (other hardware): no finding for it;
/// a slow link in each job: one finding per job, each naming its rank.
#[test]
fn each_job_gets_its_own_slow_link_verdict() {
    let identities = |d: &mut Detectors, out: &mut Vec<Finding>| {
        for r in 0..8u32 {
            let job = if r < 4 { "a" } else { "b" };
            d.record(
                &Record::Identity {
                    tgid: pid(r),
                    identity: Box::new(RankIdentity::from_environ(
                        format!("RANK={r}\0WORLD_SIZE=4\0XPUSCOPE_JOB={job}\0").as_bytes(),
                    )),
                },
                out,
            );
        }
    };
    let rings = |slow_a: Option<u32>, slow_b: Option<u32>| -> Vec<Vec<(u64, Record)>> {
        let mut jobs = Vec::new();
        for (base, slow, typical) in [(0u32, slow_a, 2 * MS), (4, slow_b, 8 * MS)] {
            for i in 0..4u32 {
                let m = [base + i, base + (i + 1) % 4];
                let xfer = if slow.is_some_and(|s| m.contains(&s)) {
                    4 * typical
                } else {
                    typical
                };
                jobs.push(job(
                    0xb0 + u64::from(base + i),
                    &m,
                    10,
                    8 * MB,
                    xfer,
                    |_, _| 0,
                ));
            }
        }
        jobs
    };
    let judge = |jobs: Vec<Vec<(u64, Record)>>| {
        let mut d = Detectors::new(DetectConfig::default());
        let mut out = Vec::new();
        identities(&mut d, &mut out);
        let mut all: Vec<(u64, Record)> = jobs.into_iter().flatten().collect();
        all.sort_by_key(|p| p.0);
        for (_, r) in &all {
            d.record(r, &mut out);
        }
        d.finish(10_000 * MS, &mut out);
        out
    };
    let f = judge(rings(None, None));
    assert!(f.is_empty(), "a slower job is not a slow link: {f:#?}");
    let mut f = judge(rings(Some(1), Some(6)));
    f.sort_by_key(|f| f.ranks.clone());
    assert_eq!(
        kinds(&f),
        vec![FindingKind::SlowLink, FindingKind::SlowLink],
        "{f:#?}"
    );
    assert_eq!((f[0].ranks.clone(), f[1].ranks.clone()), (vec![1], vec![6]));
}

/// Each rank's mstx range `step N` around the step at `t0` (N from 100).
fn step_ranges(ranks: &[u32], ops: u64) -> Vec<(u64, Record)> {
    let mut out = Vec::new();
    for &r in ranks {
        for op in 0..ops {
            let t0 = op * 100 * MS;
            let mut start = base(r, CallKind::RangeStart, "mstxRangeStartA", t0, t0 + 1_000);
            start.library = Library::Mspti;
            start.args = CallArgs::Marker {
                message: Some(format!("step {}", 100 + op)),
                range_id: Some(op + 1),
            };
            let mut end = base(
                r,
                CallKind::RangeEnd,
                "mstxRangeEnd",
                t0 + 95 * MS,
                t0 + 95 * MS,
            );
            end.library = Library::Mspti;
            end.args = CallArgs::Marker {
                message: None,
                range_id: Some(op + 1),
            };
            for (ts, c) in [(t0, start), (t0 + 95 * MS, end)] {
                out.push((ts, Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))));
            }
        }
    }
    out
}

#[test]
fn a_late_arrival_in_a_marked_step_carries_the_jobs_step_number() {
    let ranks = [0, 1, 2, 3];
    let f = run(
        4,
        DetectConfig::default(),
        vec![
            step_ranges(&ranks, 20),
            job(0xa, &ranks, 20, 8 * MB, 2 * MS, |r, op| {
                if (r, op) == (2, 7) { 60 * MS } else { 0 }
            }),
        ],
    );
    assert_eq!(kinds(&f), vec![FindingKind::LateArrival], "{f:#?}");
    assert_eq!((f[0].seq, f[0].step), (Some(7), Some(107)));
    assert!(f[0].summary.contains("in step 107"), "{}", f[0].summary);
    assert_eq!(
        f[0].evidence["step_source"],
        super::step_marks::STEP_SOURCE_MARKERS
    );
}

/// The slow device of [`a_slow_device_is_a_slow_rank_from_its_compute_kernels`]
/// in a job that marks its steps (from 100): named by the job's numbers.
#[test]
fn a_slow_device_in_a_marked_job_is_named_by_the_jobs_steps() {
    let ranks = [0, 1, 2, 3];
    let mut records = slow_device_job(&ranks);
    records.extend(step_ranges(&ranks, 12));
    let f = run(4, DetectConfig::default(), vec![records]);
    assert_eq!(kinds(&f), vec![FindingKind::SlowRank], "{f:#?}");
    // The all-reduce closing the anchor step 5 is in the marked step 105.
    assert_eq!(f[0].step, Some(105), "{:#?}", f[0]);
    assert_eq!(f[0].evidence["steps"], serde_json::json!([105, 106, 107]));
    assert_eq!(
        f[0].evidence["step_source"],
        super::step_marks::STEP_SOURCE_MARKERS
    );
    assert!(f[0].summary.contains("from step 105"), "{}", f[0].summary);
}
