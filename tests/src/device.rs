//! Shared support for the device-probe end-to-end tests: the simulated
//! job under the agent, Python test programs, and trace lookups.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::agent::{Proc, Recording, TempDir};
use crate::fixtures;
use crate::roots::Entry;
use crate::trace_check::{
    ArgValue, Slice, Timeline, Track, TrackKind, check_importer_rules, decode,
};

/// A Python program (`python3 -c program args...`) with piped stdin and
/// stdout, killed on drop.
pub fn python_program<A: AsRef<std::ffi::OsStr>>(name: &str, program: &str, args: &[A]) -> Proc {
    Proc::spawn(
        name,
        Command::new("python3")
            .args(["-c", program])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    )
}

/// Kills a whole process group (the launcher and its ranks) on drop.
pub struct GroupGuard(pub Child);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        // SAFETY: signalling our own child's process group.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

/// (pid, tid) of a slice's thread track.
pub fn thread_of(tl: &Timeline, s: &Slice) -> Option<(i32, i32)> {
    match &tl.tracks.get(&s.track)?.kind {
        TrackKind::Thread { pid, tid, .. } => Some((*pid, *tid)),
        _ => None,
    }
}

pub fn arg<'a>(s: &'a Slice, name: &str) -> Option<&'a ArgValue> {
    s.args.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

pub fn arg_text(s: &Slice, name: &str) -> String {
    arg(s, name).map(|v| v.to_string()).unwrap_or_default()
}

/// Waits until no earlier agent is still closing its uprobe links in the
/// background (`xpuscope-close`): the kernel serialises those closes with
/// new attaches, which would delay this test's probes.
pub fn wait_for_closers() {
    wait_until(
        Duration::from_secs(60),
        "earlier agents' uprobe closes",
        || !closers_running(),
    );
}

/// Whether an earlier agent's probes are still being released (its
/// `xpuscope-close` child lives until the kernel let go of them).
pub fn closers_running() -> bool {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| std::fs::read_to_string(e.path().join("stat")).is_ok_and(|s| closer_releasing(&s)))
}

pub fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The `xpuscope findings` track's slice names.
pub fn finding_slices(tl: &Timeline) -> Vec<String> {
    let tracks: Vec<u64> = tl
        .tracks
        .values()
        .filter(|t| t.name.as_deref() == Some("xpuscope findings"))
        .map(|t| t.uuid)
        .collect();
    tl.slices
        .iter()
        .filter(|s| tracks.contains(&s.track))
        .map(|s| s.name.clone())
        .collect()
}

/// The finding each simulated fault should give.
pub fn finding_kind_of(fault: &str) -> &'static str {
    match fault {
        "slow" => "slow_rank",
        "hang" | "hang_inside" => "hang",
        "delay" => "late_arrival",
        "dataloader_stall" => "dataloader_stall",
        "mem_leak" => "memory_leak",
        "crash" => "crash",
        "slow_link" => "slow_link",
        "cpu_contention" | "cpu_hog" => "host_contention",
        "host_work" => "host_bound",
        "throttle" => "device_throttled",
        "xid" | "device_error" => "device_error",
        _ => "?",
    }
}

/// Prints, per injected fault of the ground truth, the time from its
/// first injection (the rank's or launcher's `boot_ns`) to the online
/// finding of `kind` (`finding_kind_of`, or `kind` where given) on the
/// trace's findings track (its `detected_ns`: when the detector fired, in
/// the records' time; the pipeline's lag of ~0.1 s comes on top). A
/// measurement for the book's measurements, not a pass/fail bound.
pub fn print_time_to_finding(what: &str, tl: &Timeline, truth: &Value, kind: Option<&str>) {
    let findings: Vec<u64> = tl
        .tracks
        .values()
        .filter(|t| t.name.as_deref() == Some("xpuscope findings"))
        .map(|t| t.uuid)
        .collect();
    for fault in truth["faults"].as_array().into_iter().flatten() {
        let fk = fault["kind"].as_str().unwrap_or("?");
        // A leak that ends in a failed allocation is a device OOM.
        let wants = match (kind, fk) {
            (Some(k), _) => vec![k],
            (None, "mem_leak") => vec!["memory_leak", "device_oom"],
            (None, _) => vec![finding_kind_of(fk)],
        };
        let injected = fault["injected"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| i["boot_ns"].as_u64())
            .min();
        let mut measured = false;
        for want in &wants {
            let detected = tl
                .slices
                .iter()
                .filter(|s| findings.contains(&s.track) && s.name == *want)
                .filter_map(|s| match s.arg("detected_ns") {
                    Some(ArgValue::Uint(v)) => Some(*v),
                    _ => None,
                })
                .min();
            if let (Some(i), Some(d)) = (injected, detected) {
                measured = true;
                eprintln!(
                    "time to finding: {what}: {fk} -> {want}: {:.0} ms",
                    (d as f64 - i as f64) / 1e6
                );
            }
        }
        if !measured {
            eprintln!("time to finding: {what}: {fk}: not measured (injected at {injected:?})");
        }
    }
}

/// `agent diagnose --json` (with `extra` flags) over `dir/trace.pftrace`
/// (where `agent attach` wrote it): the document's findings.
pub fn offline_findings(dir: &Path, extra: &[&str]) -> Vec<Value> {
    let json = dir.join("offline-findings.json");
    let out = Command::new(crate::agent::agent_bin())
        .arg("diagnose")
        .arg("--json")
        .arg(&json)
        .args(extra)
        .arg(dir.join("trace.pftrace"))
        .output()
        .expect("run agent diagnose");
    let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap_or_else(|e| {
        panic!(
            "the findings ({e}): agent diagnose: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    }))
    .expect("findings JSON");
    assert_eq!(doc["schema"], "xpuscope-findings/1", "{doc}");
    let found = doc["findings"].as_array().expect("a list").clone();
    assert_diagnose_status(&out.status, &found, &String::from_utf8_lossy(&out.stderr));
    found
}

/// `agent diagnose`'s exit status when it reports a root finding (one
/// without `cause`); 0 when it reports none.
pub const DIAGNOSE_EXIT_ROOT_FINDING: i32 = 3;

/// The exit status `agent diagnose` owes its findings: 3 with a root
/// finding, 0 without (an error, 1, is never right here).
pub fn assert_diagnose_status(status: &std::process::ExitStatus, found: &[Value], stderr: &str) {
    let roots = found.iter().filter(|f| f["cause"].is_null()).count();
    let want = if roots > 0 {
        DIAGNOSE_EXIT_ROOT_FINDING
    } else {
        0
    };
    assert_eq!(
        status.code(),
        Some(want),
        "agent diagnose with {roots} root finding(s) of {}: {stderr}",
        found.len()
    );
}

pub fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// A finished 2-rank sim job (NVIDIA flavor unless `extra` says
/// `--flavor ascend`) traced from its start gate with `--probe-level level`.
pub struct SimRun {
    pub _dir: TempDir,
    pub job_dir: std::path::PathBuf,
    pub rank_pids: BTreeMap<u64, i32>,
    pub ground_truth: Value,
    pub stats: Value,
    pub stderr: String,
    pub tl: Timeline,
    /// The launcher's exit status.
    pub status: std::process::ExitStatus,
}

impl SimRun {
    /// `agent diagnose` (with `extra` flags) over this run's trace: the
    /// findings of the offline driver, to grade as the online ones.
    pub fn offline_findings(&self, extra: &[&str]) -> Vec<Value> {
        offline_findings(self._dir.path(), extra)
    }

    /// The activity records rank `rank`'s CUPTI/MSPTI consumer read, in
    /// the order it read them (the job must run with `--activity-log`).
    pub fn activity_log(&self, rank: u64) -> Vec<Value> {
        let path = self.job_dir.join(format!("rank{rank}.activity.jsonl"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect()
    }

    /// Records rank `rank` drained in its steps, by its step log.
    pub fn drained_in_steps(&self, rank: u64) -> u64 {
        let path = self.job_dir.join(format!("rank{rank}.steps.jsonl"));
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["event"] == "step")
            .map(|v| v["activity_records"].as_u64().unwrap_or(0))
            .sum()
    }
}

pub fn run_sim_job(tag: &str, level: &str, steps: u64, extra: &[&str]) -> SimRun {
    let run = run_sim_job_any_outcome(tag, level, steps, extra);
    assert!(run.status.success(), "the job failed: {}", run.status);
    run
}

/// A simulated 2-rank job (dp 2) whose ranks are ready and wait at its
/// start gate (`gate`: create the file to let them run).
pub struct GatedJob {
    pub launcher: GroupGuard,
    pub gate: PathBuf,
    pub job_dir: PathBuf,
    pub ground_truth: Value,
    /// rank -> pid
    pub rank_pids: BTreeMap<u64, i32>,
}

/// Starts `tests/sim/launch.py` in `dir/<name>` as job `job_name` with
/// `steps` steps and `extra` options, and waits until its ranks are ready.
pub fn start_gated_job(
    dir: &Path,
    name: &str,
    job_name: &str,
    steps: u64,
    extra: &[&str],
) -> GatedJob {
    start_gated_job_in(None, dir, name, job_name, steps, extra)
}

/// [`start_gated_job`] with the whole job inside `root`, entered as
/// `entry` says (its directory and gate are then in the root's
/// `/xpuscope/sim-<name>`). The ranks' pids are read from the job's
/// ground truth, so `entry` has no pid namespace of its own.
pub fn start_gated_job_in(
    root: Option<(&Path, Entry)>,
    dir: &Path,
    name: &str,
    job_name: &str,
    steps: u64,
    extra: &[&str],
) -> GatedJob {
    assert!(
        root.is_none_or(|(_, e)| e != Entry::ContainerPidNamespace),
        "the ground truth's pids are the host's only outside a pid namespace"
    );
    let fixtures = fixtures::build_all();
    let (mut command, inside, host) = launcher_in(root, dir, name);
    let job_dir = host.join(name);
    let gate = host.join(format!("{name}.go"));
    let build_dir = match root {
        None => fixtures.join("sim"),
        Some(_) => inside.join("fixtures/sim"),
    };
    let launcher = command
        .arg("--out-dir")
        .arg(inside.join(name))
        .arg("--build-dir")
        .arg(build_dir)
        .args(["--job-name", job_name, "--quiet", "--timeout", "60"])
        .args(["--world-size", "2", "--dp", "2", "--tp", "1", "--pp", "1"])
        .args(["--steps", &steps.to_string()])
        .args(extra)
        .arg("--start-gate")
        .arg(inside.join(format!("{name}.go")))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn the simulated job");
    let launcher = GroupGuard(launcher);
    wait_until(Duration::from_secs(30), "ranks ready", || {
        (0..2).all(|r| {
            std::fs::read_to_string(job_dir.join(format!("rank{r}.steps.jsonl")))
                .is_ok_and(|t| t.contains("\"ready\""))
        })
    });
    let ground_truth = read_json(&job_dir.join("ground_truth.json")).expect("ground truth");
    let rank_pids = rank_pids(&ground_truth);
    assert_eq!(rank_pids.len(), 2);
    GatedJob {
        launcher,
        gate,
        job_dir,
        ground_truth,
        rank_pids,
    }
}

/// The launcher command of a simulated job, with the directory its job
/// files go under as the launcher names it and as this test reaches it:
/// the host's `dir`, or, in `root`, the job's own copy of the simulator
/// and its fixtures laid out as in the build (the ranks find the
/// stand-ins by RUNPATH).
fn launcher_in(root: Option<(&Path, Entry)>, dir: &Path, tag: &str) -> (Command, PathBuf, PathBuf) {
    let fx = fixtures::build_all();
    let Some((root, entry)) = root else {
        let mut c = Command::new("python3");
        c.arg(fixtures::repo_root().join("tests/sim/launch.py"));
        return (c, dir.to_path_buf(), dir.to_path_buf());
    };
    let inside = PathBuf::from(format!("/xpuscope/sim-{tag}"));
    let host = root.join(inside.strip_prefix("/").expect("absolute"));
    let _ = std::fs::remove_dir_all(&host);
    std::fs::create_dir_all(host.join("fixtures")).expect("the job's directory");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(fx.join("sim"))
        .arg(fx.join("standins"))
        .arg(host.join("fixtures"))
        .status()
        .expect("cp")
        .success()
        && Command::new("cp")
            .arg("-a")
            .arg(fixtures::repo_root().join("tests/sim"))
            .arg(host.join("sim"))
            .status()
            .expect("cp")
            .success();
    assert!(copied, "copying the simulator into {}", host.display());
    let mut c = entry.command(root, "/usr/bin/python3.14");
    c.arg(inside.join("sim/launch.py"));
    (c, inside, host)
}

/// [`run_sim_job`] for a job that may fail (an injected fault): its
/// launcher's exit status is in [`SimRun::status`].
pub fn run_sim_job_any_outcome(tag: &str, level: &str, steps: u64, extra: &[&str]) -> SimRun {
    wait_for_closers();
    let dir = TempDir::new(tag);
    let GatedJob {
        mut launcher,
        gate,
        job_dir,
        ground_truth: gt,
        rank_pids,
    } = start_gated_job(dir.path(), "job", tag, steps, extra);
    let launcher_pid = launcher.0.id();
    let rec = Recording::start(
        dir.path(),
        &["--pid", &launcher_pid.to_string(), "--probe-level", level],
    );
    std::fs::write(&gate, b"").expect("open the gate");
    let done = rec.finish(Duration::from_secs(40));
    let status = launcher.0.wait().expect("launcher status");
    let trace = decode(&done.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    SimRun {
        _dir: dir,
        job_dir,
        rank_pids,
        ground_truth: gt,
        stats: done.stats,
        stderr: done.stderr,
        tl: Timeline::new(&trace),
        status,
    }
}

/// rank -> pid, from a simulated job's `ground_truth.json`.
pub fn rank_pids(ground_truth: &Value) -> BTreeMap<u64, i32> {
    ground_truth["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            (
                r["rank"].as_u64().unwrap(),
                r["pid"].as_i64().unwrap() as i32,
            )
        })
        .collect()
}

/// Launcher options of a 2-rank, data-parallel-only job.
pub const DP2: &[&str] = &["--world-size", "2", "--dp", "2", "--tp", "1", "--pp", "1"];
/// Launcher options of an 8-rank job with every kind of parallelism
/// (tensor 2, pipeline 2, data 2).
pub const TP2_PP2_DP2: &[&str] = &["--world-size", "8", "--tp", "2", "--pp", "2", "--dp", "2"];

/// A simulated 2-rank job (dp 2) recorded from before its ranks exist:
/// `agent attach` (with `agent_extra`) on the launcher, which spawns the
/// ranks once the agent is attached (`--spawn-gate`), so the agent sees
/// every communicator's set-up (identities and exact sequence numbers, as
/// the collective detectors need). `launcher_extra` goes to `launch.py`.
pub fn run_from_spawn(tag: &str, launcher_extra: &[&str], agent_extra: &[&str]) -> SimRun {
    run_from_spawn_in(None, tag, launcher_extra, agent_extra)
}

/// [`run_from_spawn`] with the whole job (launcher, ranks, the stand-in
/// device libraries, CPython) inside `root`, entered as `entry` says: a
/// job in a container. The pids are the host's (no pid namespace).
pub fn run_from_spawn_in(
    root: Option<(&Path, Entry)>,
    tag: &str,
    launcher_extra: &[&str],
    agent_extra: &[&str],
) -> SimRun {
    spawn_and_record(root, tag, launcher_extra, agent_extra, Health::None)
}

/// Which stand-in management library the agent reads device health from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Health {
    None,
    /// `libnvidia-ml.so.1`, the job's GPUs.
    Nvml,
    /// `libdcmi.so`, the job's NPUs (an Ascend-flavor job).
    Dcmi,
}

/// [`run_from_spawn`] with the agent reading GPU health from the stand-in
/// `libnvidia-ml.so.1` (`XPUSCOPE_NVML_LIBRARY`), whose GPUs the job's
/// ranks play (`STANDIN_NVML_DIR` = the job's `nvml/` folder).
pub fn run_from_spawn_with_gpus(
    tag: &str,
    launcher_extra: &[&str],
    agent_extra: &[&str],
) -> SimRun {
    spawn_and_record(None, tag, launcher_extra, agent_extra, Health::Nvml)
}

/// [`run_from_spawn`] of an Ascend-flavor job (`--flavor ascend` is added)
/// with the agent reading NPU health from the stand-in `libdcmi.so`
/// (`XPUSCOPE_DCMI_LIBRARY`), whose NPUs the job's ranks play
/// (`STANDIN_DCMI_DIR` = the job's `dcmi/` folder); NVML named absent.
pub fn run_from_spawn_with_npus(
    tag: &str,
    launcher_extra: &[&str],
    agent_extra: &[&str],
) -> SimRun {
    let mut extra = vec!["--flavor", "ascend"];
    extra.extend_from_slice(launcher_extra);
    spawn_and_record(None, tag, &extra, agent_extra, Health::Dcmi)
}

fn spawn_and_record(
    root: Option<(&Path, Entry)>,
    tag: &str,
    launcher_extra: &[&str],
    agent_extra: &[&str],
    health: Health,
) -> SimRun {
    wait_for_closers();
    let fx = fixtures::build_all();
    let _ = crate::agent::agent_bin(); // built before the launcher waits for it
    let dir = TempDir::new(tag);
    let (mut command, inside, host) = launcher_in(root, dir.path(), tag);
    let job_dir = host.join("job");
    let gate = host.join("spawn.go");
    let build_dir = match root {
        None => fx.join("sim"),
        Some(_) => inside.join("fixtures/sim"),
    };
    let mut launcher = GroupGuard(
        command
            .arg("--out-dir")
            .arg(inside.join("job"))
            .arg("--build-dir")
            .arg(build_dir)
            .args(["--job-name", tag, "--quiet"])
            .args(["--world-size", "2", "--dp", "2", "--tp", "1", "--pp", "1"])
            .args(["--init-delay-ms", "500", "--timeout", "60"])
            .arg("--spawn-gate")
            .arg(inside.join("spawn.go"))
            .args(launcher_extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start the launcher"),
    );
    let pid = launcher.0.id().to_string();
    let mut args = vec!["--pid", pid.as_str()];
    args.extend_from_slice(agent_extra);
    let nvml_library = fx.join("standins/lib/libnvidia-ml.so.1");
    let nvml_dir = job_dir.join("nvml");
    let (nvml_library, nvml_dir) = (
        nvml_library.to_str().expect("a UTF-8 path"),
        nvml_dir.to_str().expect("a UTF-8 path"),
    );
    let dcmi_library = fx.join("standins/lib/libdcmi.so");
    let dcmi_dir = job_dir.join("dcmi");
    let (dcmi_library, dcmi_dir) = (
        dcmi_library.to_str().expect("a UTF-8 path"),
        dcmi_dir.to_str().expect("a UTF-8 path"),
    );
    let env: &[(&str, &str)] = match health {
        Health::Nvml => &[
            ("XPUSCOPE_NVML_LIBRARY", nvml_library),
            ("STANDIN_NVML_DIR", nvml_dir),
        ],
        Health::Dcmi => &[
            ("XPUSCOPE_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1"),
            ("XPUSCOPE_DCMI_LIBRARY", dcmi_library),
            ("STANDIN_DCMI_DIR", dcmi_dir),
        ],
        Health::None => &[],
    };
    let rec = Recording::start_with_env(dir.path(), &args, env);
    std::fs::write(&gate, b"").expect("open the spawn gate");
    let done = rec.finish(Duration::from_secs(60));
    let status = launcher.0.wait().expect("launcher status");
    let gt = read_json(&job_dir.join("ground_truth.json")).expect("ground truth");
    let rank_pids = rank_pids(&gt);
    let trace = decode(&done.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    SimRun {
        _dir: dir,
        job_dir,
        rank_pids,
        ground_truth: gt,
        stats: done.stats,
        stderr: done.stderr,
        tl: Timeline::new(&trace),
        status,
    }
}

/// The tracks under process `pid`'s track whose names start with `prefix`.
pub fn device_tracks<'a>(tl: &'a Timeline, pid: i32, prefix: &str) -> Vec<&'a Track> {
    let Some(process) = tl
        .tracks
        .values()
        .find(|t| matches!(t.kind, TrackKind::Process { pid: p, .. } if p == pid))
    else {
        return Vec::new();
    };
    tl.tracks
        .values()
        .filter(|t| t.parent == Some(process.uuid))
        .filter(|t| t.name.as_deref().is_some_and(|n| n.starts_with(prefix)))
        .collect()
}

/// Slices of one track in time order, none overlapping (they nest).
pub fn ordered_slices<'a>(tl: &'a Timeline, track: &Track) -> Vec<&'a Slice> {
    let mut slices = tl.slices_on(track.uuid);
    slices.sort_by_key(|s| s.ts);
    for w in slices.windows(2) {
        let end = w[0].end.expect("ended");
        assert!(end <= w[1].ts, "{track:?}: {:?} overlaps {:?}", w[0], w[1]);
    }
    slices
}

/// Whether `/proc/PID/stat` content `stat` is an `xpuscope-close` process
/// that has not exited: one that has holds no uprobe any more (its files
/// went before it became a zombie), though it stays listed until reaped.
fn closer_releasing(stat: &str) -> bool {
    let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
        return false;
    };
    let comm = &stat[open + 1..close.max(open + 1)];
    let state = stat[close + 1..].split_whitespace().next().unwrap_or("");
    comm == "xpuscope-close" && !matches!(state, "Z" | "X" | "x")
}
