//! End-to-end: probes in place before a new process's first device call.
//! The agent attaches to the simulator's launcher before it starts any
//! rank; ranks set up their communicators right away (no `--init-delay-ms`),
//! so only probes placed at the rank's start (its program's predicted
//! libraries, or its loader's debugger hook) see the set-up calls. Every
//! rank's every collective must then carry its communicator's identity and
//! an exact sequence number. Root and eBPF; these never skip.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{Recording, TempDir, exclusive};
use xpuscope_tests::device::*;
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{Slice, Timeline, check_importer_rules, decode};

/// A job of `world` ranks whose launcher the agent follows from before
/// the ranks exist.
struct EarlyRun {
    _dir: TempDir,
    tl: Timeline,
    stats: Value,
    stderr: String,
    rank_pids: BTreeMap<u64, i32>,
}

fn run_spawn_gated(tag: &str, world: u32, extra: &[&str]) -> EarlyRun {
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let dir = TempDir::new(tag);
    let job_dir = dir.path().join("job");
    let gate = dir.path().join("spawn.go");
    let launcher = Command::new("python3")
        .arg(fixtures::repo_root().join("tests/sim/launch.py"))
        .arg("--out-dir")
        .arg(&job_dir)
        .arg("--build-dir")
        .arg(fixtures.join("sim"))
        .args(["--job-name", tag, "--quiet", "--timeout", "60"])
        .args([
            "--world-size",
            &world.to_string(),
            "--dp",
            &world.to_string(),
        ])
        .args(["--tp", "1", "--pp", "1", "--steps", "3"])
        .args(extra)
        .arg("--spawn-gate")
        .arg(&gate)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn the launcher");
    let mut launcher = GroupGuard(launcher);
    wait_until(
        Duration::from_secs(30),
        "the launcher's ground truth",
        || read_json(&job_dir.join("ground_truth.json")).is_some(),
    );
    let rec = Recording::start(
        dir.path(),
        &["--pid", &launcher.0.id().to_string(), "--probe-level", "0"],
    );
    std::fs::write(&gate, b"").expect("open the spawn gate");
    let done = rec.finish(Duration::from_secs(60));
    let status = launcher.0.wait().expect("launcher status");
    assert!(
        status.success(),
        "the job failed: {status}\n{}",
        done.stderr
    );
    let gt = read_json(&job_dir.join("ground_truth.json")).expect("ground truth");
    let rank_pids: BTreeMap<u64, i32> = gt["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            (
                r["rank"].as_u64().unwrap(),
                r["pid"].as_i64().unwrap() as i32,
            )
        })
        .collect();
    assert_eq!(rank_pids.len(), world as usize, "{gt}");
    let trace = decode(&done.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    EarlyRun {
        _dir: dir,
        tl: Timeline::new(&trace),
        stats: done.stats,
        stderr: done.stderr,
        rank_pids,
    }
}

/// Every rank has its communicator set-up call(s) with the communicator's
/// identity, and every collective names a communicator set up on that rank
/// and carries an exact sequence number, counting 0, 1, 2, ... per
/// communicator, the same on every rank.
fn assert_fully_identified(run: &EarlyRun, init_prefix: &str, collective_prefix: &str) {
    let tl = &run.tl;
    let mut seqs_by_comm: BTreeMap<String, BTreeMap<u64, Vec<u64>>> = BTreeMap::new();
    for (&rank, &pid) in &run.rank_pids {
        let on_rank = |s: &&Slice| thread_of(tl, s).is_some_and(|(p, _)| p == pid);
        let inits: Vec<&Slice> = tl
            .slices
            .iter()
            .filter(|s| s.name.starts_with(init_prefix))
            .filter(on_rank)
            .collect();
        let ids: BTreeSet<String> = inits.iter().map(|s| arg_text(s, "id_hash")).collect();
        assert!(
            !inits.is_empty() && ids.iter().all(|h| h.len() == 16),
            "rank {rank} (pid {pid}): no {init_prefix} with an identity: {inits:?}\n{}",
            run.stderr
        );
        let mut collectives: Vec<&Slice> = tl
            .slices
            .iter()
            .filter(|s| s.name.starts_with(collective_prefix) && arg(s, "seq").is_some())
            .filter(on_rank)
            .collect();
        collectives.sort_by_key(|s| s.ts);
        assert!(collectives.len() >= 3, "rank {rank}: {collectives:?}");
        for s in &collectives {
            assert_eq!(arg_text(s, "seq_exact"), "true", "rank {rank}: {s:?}");
            let comm = arg_text(s, "comm_hash");
            assert!(ids.contains(&comm), "rank {rank}: {s:?} not on {ids:?}");
            let seq: u64 = arg_text(s, "seq").parse().expect("a number");
            seqs_by_comm
                .entry(comm)
                .or_default()
                .entry(rank)
                .or_default()
                .push(seq);
        }
    }
    for (comm, by_rank) in &seqs_by_comm {
        let first = by_rank.values().next().expect("a rank");
        assert_eq!(
            *first,
            (0..first.len() as u64).collect::<Vec<_>>(),
            "comm {comm}"
        );
        for (rank, seqs) in by_rank {
            assert_eq!(seqs, first, "comm {comm}, rank {rank}");
        }
    }
    let device = &run.stats["device"];
    assert_eq!(device["attach_failures"], 0, "{device}");
    assert!(
        device["libraries_ahead"].as_u64().unwrap_or(0) > 0,
        "libraries predicted from the rank program: {device}"
    );
}

#[test]
fn nvidia_c_ranks_started_after_the_agent_are_fully_identified() {
    let _serial = exclusive();
    let run = run_spawn_gated("early-nv", 4, &[]);
    assert_fully_identified(&run, "ncclCommInitRank", "nccl");
}

#[test]
fn ascend_c_ranks_started_after_the_agent_are_fully_identified() {
    let _serial = exclusive();
    let run = run_spawn_gated("early-npu", 4, &["--flavor", "ascend"]);
    assert_fully_identified(&run, "HcclCommInit", "Hccl");
}
