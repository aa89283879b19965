//! End-to-end: probes in place before a new process's first device call.
//! The agent attaches to the simulator's launcher before it starts any
//! rank; C ranks set up their communicators 100 ms after they start
//! (`--init-delay-ms 100`, five times below the agent's periodic rescan of
//! 500 ms), Python ranks 300 ms after they loaded the libraries, so
//! only probes placed at the rank's start (its program's predicted
//! libraries, its loader's debugger hook) see the set-up calls. Every
//! rank's every collective must then carry its communicator's identity and
//! an exact sequence number. Root and eBPF; these never skip.
//!
//! (With no delay at all a C rank enters its set-up call 5-15 ms after its
//! start; the agent's probes for the first rank of a program land about
//! 5-15 ms after it starts on an idle 2-CPU machine, so the first rank
//! races them; later ranks find them in place. See docs/src/guide/device-probes.md.)

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{Lines, Proc, Recording, TempDir, exclusive, go, workload_bin};
use xpuscope_tests::device::*;
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{Slice, Timeline, check_importer_rules, decode};

/// A job of `world` ranks whose launcher the agent follows from before
/// the ranks exist.
pub(crate) struct EarlyRun {
    _dir: TempDir,
    pub tl: Timeline,
    pub stats: Value,
    pub stderr: String,
    pub rank_pids: BTreeMap<u64, i32>,
}

fn run_spawn_gated(tag: &str, world: u32, extra: &[&str]) -> EarlyRun {
    wait_for_closers();
    run_spawn_gated_with(tag, world, extra, &[])
}

/// [`run_spawn_gated`] with `agent_env` in the agent's environment, and
/// without waiting for earlier agents' probes to be released.
pub(crate) fn run_spawn_gated_with(
    tag: &str,
    world: u32,
    extra: &[&str],
    agent_env: &[(&str, &str)],
) -> EarlyRun {
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
    let rec = Recording::start_with_env(
        dir.path(),
        &["--pid", &launcher.0.id().to_string(), "--probe-level", "0"],
        agent_env,
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
    let rank_pids: BTreeMap<u64, i32> = xpuscope_tests::device::rank_pids(&gt);
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
pub(crate) fn assert_fully_identified(
    run: &EarlyRun,
    init_prefix: &str,
    collective_prefix: &str,
    predicted: bool,
) {
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
    if predicted {
        assert!(
            device["libraries_ahead"].as_u64().unwrap_or(0) >= 2,
            "libraries predicted from the rank program: {device}"
        );
    }
}

/// A C rank's set-up delay: well above the agent's reaction to a new
/// program (milliseconds), well below its periodic rescan (500 ms).
pub(crate) const INIT_DELAY: &str = "100";

#[test]
fn nvidia_c_ranks_started_after_the_agent_are_fully_identified() {
    let _serial = exclusive();
    let run = run_spawn_gated("early-nv", 4, &["--init-delay-ms", INIT_DELAY]);
    assert_fully_identified(&run, "ncclCommInitRank", "nccl", true);
}

#[test]
fn ascend_c_ranks_started_after_the_agent_are_fully_identified() {
    let _serial = exclusive();
    let run = run_spawn_gated(
        "early-npu",
        4,
        &["--flavor", "ascend", "--init-delay-ms", INIT_DELAY],
    );
    assert_fully_identified(&run, "HcclCommInit", "Hccl", true);
}

/// Python ranks load the libraries with `dlopen` (ctypes), one after the
/// other, after the interpreter started: the loader hook reports each load,
/// nothing is predicted from the program (python3 needs no device
/// library). Their set-up comes 300 ms after the loads: the probes of three
/// libraries, attached as each is loaded, take up to ~250 ms on a loaded
/// 2-vCPU VM (the C-rank and dlopen tests are the tight ones).
#[test]
fn python_ranks_started_after_the_agent_are_fully_identified() {
    let _serial = exclusive();
    let python = ["--lang", "python", "--init-delay-ms", "300"];
    let run = run_spawn_gated("early-py", 2, &python);
    assert_fully_identified(&run, "ncclCommInitRank", "nccl", false);
    let ascend = [&python[..], &["--flavor", "ascend"]].concat();
    let run = run_spawn_gated("early-py-npu", 2, &ascend);
    assert_fully_identified(&run, "HcclCommInit", "Hccl", false);
}

/// A workload the agent follows from before it loads anything: after "go"
/// it `dlopen`s the stand-in CUDA runtime, waits `delay_ms`, then calls
/// `cudaSetDevice(i)` for i = 0..calls, `interval_us` apart. Returns the
/// (index, start time) of the calls the trace has, the workload's JSON
/// line, and the recording's stats.
fn dlopen_run(
    tag: &str,
    delay_ms: u64,
    calls: u64,
    interval_us: u64,
    agent_args: &[&str],
) -> (Vec<(i64, u64)>, Value, Value) {
    wait_for_closers();
    let lib = fixtures::build_all().join("standins/lib/libcudart.so.12");
    let dir = TempDir::new(tag);
    let mut wl = Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .arg("dlopen")
            .arg(&lib)
            .args([delay_ms, calls, interval_us].map(|n| n.to_string()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let pid = wl.pid();
    let mut args = vec![
        "--pid".to_string(),
        pid.to_string(),
        "--probe-level".into(),
        "0".into(),
    ];
    args.extend(agent_args.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let rec = Recording::start(dir.path(), &args);
    let mut stdout = Lines::new(wl.stdout());
    go(&mut wl.stdin());
    let line = stdout.wait_for("dlopen_return_ns", Duration::from_secs(30));
    let truth: Value = serde_json::from_str(line.trim()).expect("the workload's JSON");
    let done = rec.finish(Duration::from_secs(30));
    let trace = decode(&done.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let mut seen: Vec<(i64, u64)> = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("cudaSetDevice"))
        .filter(|s| thread_of(&tl, s).is_some_and(|(p, _)| p as u32 == pid))
        .map(|s| {
            (
                arg_text(s, "device").parse().expect("a device number"),
                s.ts,
            )
        })
        .collect();
    seen.sort_unstable();
    (seen, truth, done.stats)
}

/// Calls made 50 ms after `dlopen` returns are all recorded: the loader's
/// debugger hook told the agent at once (its periodic rescan comes every
/// 500 ms, too late for them).
#[test]
fn calls_50_ms_after_dlopen_are_recorded() {
    let _serial = exclusive();
    let (seen, truth, stats) = dlopen_run("early-dlopen", 50, 20, 1000, &[]);
    let seen: Vec<i64> = seen.iter().map(|(i, _)| *i).collect();
    assert_eq!(seen, (0..20).collect::<Vec<i64>>(), "{truth}\n{stats}");
    let changes = stats["per_kind"]
        .as_array()
        .expect("per_kind")
        .iter()
        .find(|k| k["kind"] == "link_map_change")
        .map(|k| k["consumed"].as_u64().unwrap_or(0))
        .unwrap_or(0);
    assert!(
        changes >= 2,
        "dlopen reports before and after mapping: {stats}"
    );
}

/// How soon after `dlopen` returns the library's calls are recorded, with
/// the loader hook and with the periodic rescan alone (`--no-loader-hook`):
/// a call every millisecond from the moment dlopen returns; the first call
/// recorded says when the probes were in place. Printed, not asserted
/// (figures in docs/src/measurements/device-probes.md); each run must still record the later calls.
#[test]
fn dlopen_to_first_recorded_call() {
    let _serial = exclusive();
    for (what, args) in [
        ("loader hook", &[][..]),
        ("periodic rescan", &["--no-loader-hook"][..]),
    ] {
        let (seen, truth, _) = dlopen_run("early-dlopen-latency", 0, 1500, 1000, args);
        let &(first, first_ts) = seen
            .first()
            .unwrap_or_else(|| panic!("{what}: no call recorded: {truth}"));
        assert_eq!(
            seen.last().map(|s| s.0),
            Some(1499),
            "{what}: the last call is recorded"
        );
        assert_eq!(
            seen.len() as i64,
            1500 - first,
            "{what}: every call after the first recorded"
        );
        let opened = truth["dlopen_return_ns"]
            .as_u64()
            .expect("dlopen_return_ns");
        println!(
            "dlopen -> first recorded call ({what}): {:.1} ms (call #{first} of 1 per ms)",
            first_ts.saturating_sub(opened) as f64 / 1e6
        );
    }
}
