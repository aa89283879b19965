//! End-to-end: `agent service` finds a simulated training job by itself
//! (no pid given: its ranks map the stand-in libcudart/libnccl), lists its
//! ranks over the control API, dumps a flight-recorder trace holding every
//! rank's all-reduces, serves their counts on `/metrics`, changes its level
//! at runtime (launches appear at level 2, same agent, no restart), and
//! stops on SIGTERM leaving no program behind. Root and eBPF; never skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use xpuscope_tests::agent::{Lines, Proc, TempDir, exclusive};
use xpuscope_tests::device::{
    GroupGuard, arg_text, start_gated_job_in, thread_of, wait_for_closers, wait_until,
};
use xpuscope_tests::fixtures;
use xpuscope_tests::roots::Entry;
use xpuscope_tests::service_run::{Service, ctl, http_get, stop_service, wait_traced};
use xpuscope_tests::trace_check::{Slice, Timeline, check_importer_rules, decode};

const STEPS: u64 = 5;

/// BPF programs loaded now, from Debian's `bpftool` (installed if
/// missing): (id, name, pids of the processes holding it).
fn bpf_programs() -> Vec<(u64, String, Vec<u64>)> {
    if Command::new("bpftool").arg("version").output().is_err() {
        xpuscope_tests::packages::apt_install(&["bpftool"]);
    }
    let out = Command::new("bpftool")
        .args(["-j", "prog", "show"])
        .output()
        .expect("run bpftool");
    assert!(out.status.success(), "bpftool prog show failed: {out:?}");
    let progs: Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    progs
        .as_array()
        .expect("a list of programs")
        .iter()
        .map(|p| {
            let pids = p["pids"]
                .as_array()
                .map(|a| a.iter().filter_map(|h| h["pid"].as_u64()).collect())
                .unwrap_or_default();
            (
                p["id"].as_u64().expect("id"),
                p["name"].as_str().unwrap_or_default().to_string(),
                pids,
            )
        })
        .collect()
}

/// Whether a program name is one of ours (the kernel keeps 15 characters).
fn is_ours(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "sched_process_f",
        "sched_process_e",
        "task_rename",
        "sched_waking",
        "sched_wakeup_ne",
        "sched_switch",
        "device_call_",
        "loader_link_map",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Ids of our programs loaded now.
fn our_program_ids() -> BTreeSet<u64> {
    bpf_programs()
        .into_iter()
        .filter(|(_, name, _)| is_ours(name))
        .map(|(id, _, _)| id)
        .collect()
}

/// A simulated 2-rank job started with no agent told about it; it waits
/// at its start gate after init.
struct Job {
    launcher: GroupGuard,
    gate: PathBuf,
    job_dir: PathBuf,
    /// rank -> pid
    ranks: BTreeMap<u64, u32>,
}

impl Job {
    fn start(dir: &Path, name: &str) -> Job {
        Job::start_with(dir, name, &[])
    }

    /// With `extra` launcher options.
    fn start_with(dir: &Path, name: &str, extra: &[&str]) -> Job {
        Job::start_in(None, dir, name, extra)
    }

    /// In `root`, entered as `entry` says (a job in a container).
    fn start_in(root: Option<(&Path, Entry)>, dir: &Path, name: &str, extra: &[&str]) -> Job {
        let job = start_gated_job_in(root, dir, name, name, STEPS, extra);
        Job {
            launcher: job.launcher,
            gate: job.gate,
            job_dir: job.job_dir,
            ranks: job
                .rank_pids
                .into_iter()
                .map(|(rank, pid)| (rank, pid as u32))
                .collect(),
        }
    }

    /// Opens the gate and waits for the job to finish.
    fn run(mut self) -> BTreeMap<u64, u32> {
        std::fs::write(&self.gate, b"").expect("open the gate");
        let end = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.launcher.0.try_wait().expect("try_wait") {
                break s;
            }
            assert!(Instant::now() < end, "the job did not finish");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            status.success(),
            "the job failed: {status} (logs in {})",
            self.job_dir.display()
        );
        self.ranks.clone()
    }
}

/// Polls `/metrics` until every rank of `job` counts `STEPS` all-reduces
/// (the job's last records reach the metrics sink after the ring reader's
/// next pass: on a loaded machine, after the job's exit), for at most
/// 15 s; then asserts.
fn wait_allreduce_counts<'a>(port: u16, job: &str, ranks: impl Iterator<Item = &'a u64>) {
    let ranks: Vec<u64> = ranks.copied().collect();
    let count = |metrics: &str, rank: u64| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("xpuscope_collective_duration_seconds_count{"))
            // This job's only: the service traces every job on the machine.
            .filter(|l| l.contains(&format!("training_job=\"{job}\"")))
            .filter(|l| l.contains(&format!("rank=\"{rank}\"")) && l.contains("op=\"allreduce\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let started = Instant::now();
    loop {
        let metrics = http_get(port, "/metrics");
        let short: Vec<(u64, f64)> = ranks
            .iter()
            .map(|&r| (r, count(&metrics, r)))
            .filter(|&(_, c)| c != STEPS as f64)
            .collect();
        if short.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "job {job}: (rank, all-reduces counted) {short:?}, not {STEPS} each, after 15 s:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Polls `agent ctl processes` until every rank of `job` is listed with
/// its rank; returns how long that took and the entries.
fn wait_listed(socket: &Path, job: &Job, name: &str) -> (Duration, Vec<Value>) {
    let started = Instant::now();
    loop {
        let list = ctl(socket, &["processes"]);
        let entries: Vec<Value> = list.as_array().expect("a list").clone();
        // Listed with its identity: a rank is listed from its fork (a
        // child of its launcher) and named once the agent has read its
        // environment at its exec, which a loaded machine can delay.
        let listed: BTreeSet<u32> = entries
            .iter()
            .filter(|e| !e["rank"].is_null())
            .filter_map(|e| e["pid"].as_u64())
            .map(|p| p as u32)
            .collect();
        if job.ranks.values().all(|p| listed.contains(p)) {
            let ranks: Vec<Value> = entries
                .into_iter()
                .filter(|e| {
                    e["pid"]
                        .as_u64()
                        .is_some_and(|p| job.ranks.values().any(|&r| r as u64 == p))
                })
                .collect();
            return (started.elapsed(), ranks);
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{name}: ranks {:?} not all listed with their identity within 20 s: {list}",
            job.ranks
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `agent ctl dump --seconds 30`: the trace it wrote, decoded and checked.
fn dump(socket: &Path, dump_dir: &Path) -> Timeline {
    let out = ctl(socket, &["dump", "--seconds", "30"]);
    let path = PathBuf::from(out["trace"].as_str().unwrap_or_else(|| panic!("{out}")));
    assert_eq!(
        path.parent(),
        Some(dump_dir),
        "the dump is in the dump dir: {out}"
    );
    let bytes = std::fs::read(&path).expect("the dump exists");
    let trace = decode(&bytes).expect("the dump decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    Timeline::new(&trace)
}

fn slices_of<'a>(tl: &'a Timeline, pid: u32, prefix: &str) -> Vec<&'a Slice> {
    let mut v: Vec<&Slice> = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with(prefix))
        .filter(|s| thread_of(tl, s).is_some_and(|(p, _)| p == pid as i32))
        .collect();
    v.sort_by_key(|s| s.ts);
    v
}

#[test]
fn the_service_finds_a_job_by_itself_dumps_it_serves_metrics_and_switches_levels() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let before = our_program_ids();
    let dir = TempDir::new("service");
    let Service {
        mut agent,
        mut stderr,
        dump_dir,
        socket,
        port,
    } = Service::start(dir.path(), "");
    assert_eq!(ctl(&socket, &["status"])["level"], 1);

    // A job the agent is not told about.
    let job = Job::start(dir.path(), "svcjob");
    let (took, listed) = wait_listed(&socket, &job, "svcjob");
    eprintln!("ranks listed {took:?} after they were ready");
    for e in &listed {
        let pid = e["pid"].as_u64().unwrap() as u32;
        let rank = job.ranks.iter().find(|(_, p)| **p == pid).unwrap().0;
        assert_eq!(e["rank"], rank.to_string(), "{e}");
        assert_eq!(e["job"], "svcjob", "{e}");
        assert_eq!(e["world_size"], "2", "{e}");
        assert!(e["comm"].as_str().is_some_and(|c| !c.is_empty()), "{e}");
    }
    let ranks = job.run();

    let tl = dump(&socket, &dump_dir);
    for (&rank, &pid) in &ranks {
        let reduces = slices_of(&tl, pid, "ncclAllReduce");
        let seqs: Vec<String> = reduces.iter().map(|s| arg_text(s, "seq")).collect();
        // The ranks were found after they mapped the libraries and before
        // the gate opened: every training all-reduce is there. Numbers
        // count from the first collective the agent saw on the
        // communicator: the start-up broadcast (seq 0) when the rank was
        // found before it, else the first all-reduce; with the
        // communicator's init seen too they are exact across ranks.
        let broadcasts = slices_of(&tl, pid, "ncclBroadcast").len() as u64;
        assert!(broadcasts <= 1, "rank {rank}: one start-up broadcast");
        let expect: Vec<String> = (broadcasts..broadcasts + STEPS)
            .map(|s| s.to_string())
            .collect();
        let all: Vec<String> = tl
            .slices
            .iter()
            .filter(|s| s.name.starts_with("nccl"))
            .map(|s| {
                format!(
                    "{} {} seq {} exact {} on {:?}",
                    s.ts,
                    s.name,
                    arg_text(s, "seq"),
                    arg_text(s, "seq_exact"),
                    thread_of(&tl, s)
                )
            })
            .collect();
        assert_eq!(
            seqs,
            expect,
            "rank {rank} (pid {pid}); NCCL calls:\n{}",
            all.join("\n")
        );
        for s in &reduces {
            if arg_text(s, "seq_exact") == "true" {
                assert_eq!(
                    broadcasts, 1,
                    "rank {rank}: an init seen implies its broadcast"
                );
            }
        }
        for s in &reduces {
            assert!(s.end.is_some_and(|e| e >= s.ts), "{s:?}");
            assert_eq!(arg_text(s, "return"), "0", "{s:?}");
        }
        assert!(
            slices_of(&tl, pid, "cudaLaunchKernel").is_empty(),
            "rank {rank}: launches at level 1"
        );
    }

    wait_allreduce_counts(port, "svcjob", ranks.keys());
    // The probes' own accounting: attached, none failed or slow (the
    // agent's own figures are refreshed about once a second).
    let attaches = |metrics: &str, outcome: &str| -> f64 {
        metrics
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "xpuscope_agent_device_probe_attaches_total{{outcome=\"{outcome}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {outcome} attaches in\n{metrics}"))
    };
    let asked = Instant::now();
    let metrics = loop {
        let metrics = http_get(port, "/metrics");
        if attaches(&metrics, "attached") > 0.0 {
            break metrics;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(15),
            "no attached probes counted:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(attaches(&metrics, "failed"), 0.0);
    // Whether an attach takes over a second is the machine's speed (an
    // emulated one takes that long), not the agent's correctness: what is
    // checked is that each one counted was also logged (below).
    let slow = attaches(&metrics, "slow");
    // Each rank's steps (one per all-reduce after its first), split into
    // host work and waits in device calls, which together fit in the step.
    let step_metric = |family: &str, rank: u64| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .filter(|l| {
                l.contains("training_job=\"svcjob\"") && l.contains(&format!("rank=\"{rank}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    for &rank in ranks.keys() {
        assert_eq!(
            step_metric("xpuscope_step_duration_seconds_count", rank),
            (STEPS - 1) as f64,
            "rank {rank}'s steps:\n{metrics}"
        );
        let total = step_metric("xpuscope_step_duration_seconds_sum", rank);
        let host = step_metric("xpuscope_step_host_seconds_sum", rank);
        let device = step_metric("xpuscope_step_device_wait_seconds_sum", rank);
        assert!(
            host > 0.0 && device > 0.0 && host + device <= total + 1e-9,
            "rank {rank}: host {host} s + device waits {device} s within {total} s"
        );
    }
    // Every loss the kernel side counts is in the status and the metrics.
    let status = ctl(&socket, &["status"]);
    for key in ["dropped_events", "skipped_events", "decode_errors"] {
        assert!(
            status["kernel"][key].is_u64(),
            "status.kernel.{key}: {status}"
        );
    }
    assert!(
        status["device_probes"]["attached"].as_u64() > Some(0),
        "{status}"
    );
    // The interpret stage's counters, published at the pipeline's ticks
    // (about once a second).
    let asked = Instant::now();
    loop {
        let status = ctl(&socket, &["status"]);
        if status["interpret"]["threads_seen"].as_u64() > Some(0) {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "the interpret stage's counters: {status}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for family in [
        "xpuscope_agent_kernel_dropped_events_total",
        "xpuscope_agent_kernel_skipped_events_total",
        "xpuscope_agent_decode_errors_total",
        "xpuscope_agent_interpret_losses_total{what=\"stacks_unmatched\"}",
    ] {
        assert!(
            metrics.lines().any(|l| l.starts_with(family)),
            "no {family} in\n{metrics}"
        );
    }

    // Level 2 on the running service: launches appear in a later job.
    let agent_pid = agent.pid();
    assert_eq!(ctl(&socket, &["level", "2"])["level"], 2);
    assert_eq!(ctl(&socket, &["status"])["level"], 2);
    let job = Job::start(dir.path(), "svcjob2");
    wait_listed(&socket, &job, "svcjob2");
    let ranks2 = job.run();
    let tl = dump(&socket, &dump_dir);
    for (&rank, &pid) in &ranks2 {
        assert!(
            !slices_of(&tl, pid, "cudaLaunchKernel").is_empty(),
            "rank {rank} (pid {pid}): no launches at level 2"
        );
        assert_eq!(slices_of(&tl, pid, "ncclAllReduce").len() as u64, STEPS);
    }
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent still runs"
    );
    assert_eq!(agent.pid(), agent_pid);

    // The agent's programs: held by its pid where bpftool can tell (other
    // agents may run on this machine), else every one of ours loaded since.
    let programs = bpf_programs();
    let mut held: BTreeSet<u64> = programs
        .iter()
        .filter(|(_, name, pids)| is_ours(name) && pids.contains(&(agent_pid as u64)))
        .map(|(id, _, _)| *id)
        .collect();
    if programs.iter().all(|(_, _, pids)| pids.is_empty()) {
        held = our_program_ids().difference(&before).copied().collect();
    }
    let names: BTreeSet<&str> = programs
        .iter()
        .filter(|(id, _, _)| held.contains(id))
        .map(|(_, n, _)| n.as_str())
        .collect();
    assert!(
        // `sched_switch_compat` on kernels before 5.18.
        names.iter().any(|n| n.starts_with("sched_switch"))
            && names.iter().any(|n| n.starts_with("device_call_")),
        "the running service's programs: {names:?}"
    );

    agent.signal(libc::SIGTERM);
    let status = agent
        .wait_timeout(Duration::from_secs(60))
        .unwrap_or_else(|| {
            panic!(
                "the service did not stop on SIGTERM:\n{}",
                stderr.rest(Duration::from_millis(100))
            )
        });
    let log = stderr.rest(Duration::from_secs(2));
    assert!(status.success(), "exit {status}:\n{log}");
    assert!(!socket.exists(), "the socket goes with the service");
    let slow_logged = stderr
        .seen
        .iter()
        .filter(|l| l.contains("device probes: attaching") && l.contains("were not recorded"))
        .count();
    assert!(
        slow_logged as f64 >= slow,
        "{slow} slow attaches counted, {slow_logged} logged:\n{}",
        stderr.seen.join("\n")
    );
    // The uprobe links are closed by the agent's closer after it exits.
    wait_for_closers();
    let left: Vec<u64> = our_program_ids().intersection(&held).copied().collect();
    assert!(
        left.is_empty(),
        "programs {left:?} of the service left behind:\n{log}"
    );
}

/// A process the service discovers by its name, before it loads any device
/// library: once traced, its `dlopen` of the CUDA runtime is reported by
/// the loader's debugger hook, so calls made 50 ms after `dlopen` returns
/// are in the flight recorder (the service's discovery round is 250 ms).
#[test]
fn the_service_probes_a_traced_process_at_its_dlopen() {
    let _serial = exclusive();
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let dir = TempDir::new("service-dlopen");
    let Service {
        mut agent,
        mut stderr,
        dump_dir,
        socket,
        ..
    } = Service::start(dir.path(), "[discovery]\ncomm = \"^xpuscope-worklo$\"\n");
    let mut wl = Proc::spawn(
        "workload",
        Command::new(fixtures.join("workloads/xpuscope-workload"))
            .arg("dlopen")
            .arg(fixtures.join("standins/lib/libcudart.so.12"))
            .args(["50", "20", "1000"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let pid = wl.pid();
    wait_traced(&socket, pid, Duration::from_secs(5));
    let mut out = Lines::new(wl.stdout());
    xpuscope_tests::agent::go(&mut wl.stdin());
    out.wait_for("dlopen_return_ns", Duration::from_secs(30));
    assert!(
        wl.wait_timeout(Duration::from_secs(10))
            .is_some_and(|s| s.success())
    );
    // Let the records reach the flight recorder.
    std::thread::sleep(Duration::from_millis(500));
    let tl = dump(&socket, &dump_dir);
    let calls: Vec<String> = slices_of(&tl, pid, "cudaSetDevice")
        .iter()
        .map(|s| arg_text(s, "device"))
        .collect();
    let expected: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    assert_eq!(
        calls,
        expected,
        "{}",
        stderr.rest(Duration::from_millis(200))
    );
    stop_service(&mut agent, &mut stderr);
}

/// Lines of the service's log so far containing `needle`.
fn log_lines(stderr: &mut Lines, needle: &str) -> usize {
    stderr.rest(Duration::from_millis(300));
    stderr.seen.iter().filter(|l| l.contains(needle)).count()
}

fn names(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|k| k.as_str().expect("a key name"))
        .collect()
}

/// A reload applies what it can (the level) and names every key that
/// waits for a restart, in its answer and in the log, at every reload,
/// by `agent ctl reload` and by SIGHUP alike, until the agent restarts:
/// the running configuration, not the last file read, is what the file
/// is compared with.
#[test]
fn the_service_reports_keys_needing_a_restart_at_every_reload() {
    let _serial = exclusive();
    wait_for_closers();
    let dir = TempDir::new("service-reload");
    let Service {
        mut agent,
        mut stderr,
        socket,
        ..
    } = Service::start(dir.path(), "[flight_recorder]\nseconds = 120\n");
    let path = dir.path().join("agent.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text
        .replace("level = 1\n", "level = 2\n")
        .replace("seconds = 120\n", "seconds = 30\n");
    assert_ne!(edited, text);
    std::fs::write(&path, edited).unwrap();
    const LOGGED: &str = "take effect only at the next restart";

    let first = ctl(&socket, &["reload"]);
    assert_eq!(names(&first["applied"]), ["level"], "{first}");
    assert_eq!(
        names(&first["restart_needed_for"]),
        ["flight_recorder.seconds"],
        "{first}"
    );
    assert_eq!(ctl(&socket, &["status"])["level"], 2);
    assert_eq!(log_lines(&mut stderr, LOGGED), 1);

    let second = ctl(&socket, &["reload"]);
    assert!(names(&second["applied"]).is_empty(), "{second}");
    assert_eq!(
        names(&second["restart_needed_for"]),
        ["flight_recorder.seconds"],
        "{second}"
    );
    assert_eq!(log_lines(&mut stderr, LOGGED), 2);

    agent.signal(libc::SIGHUP);
    let end = Instant::now() + Duration::from_secs(10);
    while log_lines(&mut stderr, LOGGED) < 3 {
        assert!(
            Instant::now() < end,
            "SIGHUP: no reload logged:\n{}",
            stderr.seen.join("\n")
        );
    }
    let line = stderr
        .seen
        .iter()
        .rev()
        .find(|l| l.contains(LOGGED))
        .unwrap();
    assert!(line.contains("flight_recorder.seconds"), "{line}");
    let status = ctl(&socket, &["status"]);
    assert_eq!(
        names(&status["restart_needed_for"]),
        ["flight_recorder.seconds"],
        "{status}"
    );

    stop_service(&mut agent, &mut stderr);
}

/// `labels.job_env` names the job everywhere: ranks that carry their job
/// only in `MY_JOB` (none of the default variables) are labelled by it in
/// `/processes`, on `/metrics` and in a dump's process list.
#[test]
fn the_service_labels_jobs_by_the_configured_variable_everywhere() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let dir = TempDir::new("service-job-env");
    let Service {
        mut agent,
        mut stderr,
        dump_dir,
        socket,
        port,
    } = Service::start(dir.path(), "[labels]\njob_env = [\"MY_JOB\"]\n");
    let name = "myjobx";
    let job = Job::start_with(dir.path(), name, &["--job-env", "MY_JOB"]);
    for pid in job.ranks.values() {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
        assert!(vars.contains(&format!("MY_JOB={name}").as_bytes()));
        assert!(
            !vars.iter().any(|v| v.starts_with(b"XPUSCOPE_JOB=")
                || v.starts_with(b"JOB_NAME=")
                || v.starts_with(b"TORCHELASTIC_RUN_ID=")),
            "rank {pid} has a default job variable"
        );
    }
    let (_, listed) = wait_listed(&socket, &job, name);
    for e in &listed {
        assert_eq!(e["job"], name, "{e}");
    }
    let ranks = job.run();

    // The dump waits for the pipeline to pass its request: the job's
    // records have reached every sink by its answer.
    let out = ctl(&socket, &["dump", "--seconds", "30"]);
    let summary = PathBuf::from(out["summary"].as_str().unwrap_or_else(|| panic!("{out}")));
    assert_eq!(summary.parent(), Some(dump_dir.as_path()));
    let file = summary.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        file.starts_with(&format!("{name}-")),
        "named by the job: {file}"
    );
    let v: Value = serde_json::from_slice(&std::fs::read(&summary).unwrap()).unwrap();
    for pid in ranks.values() {
        let row = v["processes"]
            .as_array()
            .expect("processes")
            .iter()
            .find(|p| p["pid"].as_u64() == Some(*pid as u64))
            .unwrap_or_else(|| panic!("rank {pid} not in the dump: {}", v["processes"]));
        assert_eq!(row["job"], name, "{row}");
    }

    wait_allreduce_counts(port, name, ranks.keys());

    stop_service(&mut agent, &mut stderr);
}

/// Copies `from` (a directory of files) into `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// The service's status figure `device_probes.<key>`.
fn probe_figure(socket: &Path, key: &str) -> u64 {
    let status = ctl(socket, &["status"]);
    status["device_probes"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("status.device_probes.{key}: {status}"))
}

/// The slots held once the service has found what already runs (the same
/// figure a second apart; at most 10 s).
fn settled_slots(socket: &Path) -> u64 {
    let started = Instant::now();
    let mut last = probe_figure(socket, "slots_in_use");
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = probe_figure(socket, "slots_in_use");
        if now == last || started.elapsed() > Duration::from_secs(10) {
            return now;
        }
        last = now;
    }
}

/// Jobs one after another, each on its own copy of the device libraries
/// (a per-job virtual environment, a container layer): a copy no traced
/// process maps any more has its probes released and its slots handed out
/// again, so the slots held go back to what they were before each job
/// (the service traces every process on the machine that maps a device
/// library: other processes may hold some) and each copy takes the same
/// number of them, at the default options. Every job's calls are recorded and no attach fails
/// (earlier builds: every copy's slots and uprobes were held until the
/// agent stopped, 16,383 slots in all). The exhaustion this prevents is
/// `kernel::probes::tests::copies_of_a_library_reuse_the_slots_of_released_ones`.
#[test]
fn library_copies_one_job_after_another_reuse_the_probe_slots() {
    let _serial = exclusive();
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let dir = TempDir::new("service-copies");
    let Service {
        mut agent,
        mut stderr,
        socket,
        port,
        ..
    } = Service::start(dir.path(), "");
    let mut per_copy = None;
    for n in 0..3u64 {
        let copy = dir.path().join(format!("copy{n}"));
        copy_dir(&fixtures.join("sim/bin"), &copy.join("sim/bin"));
        copy_dir(&fixtures.join("standins/lib"), &copy.join("standins/lib"));
        let before = settled_slots(&socket);
        let released_before = probe_figure(&socket, "files_released");
        // The service traces every process that maps a device library,
        // other tests' too: failures are counted over this job's run.
        let failures_before = probe_figure(&socket, "attach_failures");
        let name = format!("copyjob{n}");
        let build = copy.join("sim");
        let job = Job::start_with(dir.path(), &name, &["--build-dir", build.to_str().unwrap()]);
        wait_listed(&socket, &job, &name);
        let held = probe_figure(&socket, "slots_in_use");
        eprintln!("job {n}: {held} probe slots held, {before} before it");
        let taken = held.saturating_sub(before);
        assert!(taken > 0, "job {n}: its copy took no slot");
        assert_eq!(
            taken,
            *per_copy.get_or_insert(taken),
            "job {n}: every copy takes as many slots as the first"
        );
        let ranks = job.run();
        wait_allreduce_counts(port, &name, ranks.keys());
        assert_eq!(
            probe_figure(&socket, "attach_failures") - failures_before,
            0,
            "job {n}: every probe attached"
        );
        // Released once no process has mapped the copy for the default
        // `probes.release_after` (10 s).
        wait_until(
            Duration::from_secs(30),
            &format!("job {n}'s probe slots to be released"),
            || probe_figure(&socket, "slots_in_use") <= before,
        );
        let released = probe_figure(&socket, "files_released") - released_before;
        eprintln!("job {n}: {released} library files released");
        assert!(
            released >= 3,
            "job {n}: its copy's libcudart, libnccl and libcupti released: {released}"
        );
    }
    // The same figures on /metrics (refreshed about once a second).
    let value = |metrics: &str, family: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(family) && l[family.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {family} in\n{metrics}"))
    };
    let slots_now = probe_figure(&socket, "slots_in_use") as f64;
    let started = Instant::now();
    loop {
        let metrics = http_get(port, "/metrics");
        let held = value(&metrics, "xpuscope_agent_device_probe_slots");
        let released = value(&metrics, "xpuscope_agent_device_probe_files_released_total");
        if held <= slots_now && released >= 9.0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "metrics: {held} slots held, {released} files released"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    stop_service(&mut agent, &mut stderr);
}

/// A traced process's child seen between its fork and its exec carries
/// its parent's environment: once it runs its own program it is listed
/// with the identity that program was started with (earlier builds: the
/// listing kept the parent's, no rank, for good). The child waits 1.5 s
/// between fork and exec, so the service surely lists it before.
#[test]
fn a_child_listed_before_its_exec_gets_its_identity_after_it() {
    let _serial = exclusive();
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let dir = TempDir::new("service-fork-exec");
    let Service {
        mut agent,
        mut stderr,
        socket,
        ..
    } = Service::start(dir.path(), "");
    let lib = fixtures.join("standins/lib/libcudart.so.12");
    let script = format!(
        "import ctypes, os, sys, time\n\
         ctypes.CDLL({lib:?})\n\
         pid = os.fork()\n\
         if pid == 0:\n\
         \x20   time.sleep(1.5)\n\
         \x20   os.execve('/bin/sleep', ['sleep', '6'], \
         {{'RANK': '3', 'LOCAL_RANK': '1', 'WORLD_SIZE': '4', 'XPUSCOPE_JOB': 'forkexec'}})\n\
         print(pid, flush=True)\n\
         os.waitpid(pid, 0)\n",
        lib = lib.to_str().unwrap()
    );
    let mut parent = Command::new("python3")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("start the parent");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(parent.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    let child: u64 = line.trim().parse().expect("the child's pid");
    let entry = |list: &Value| -> Option<Value> {
        list.as_array()?
            .iter()
            .find(|e| e["pid"].as_u64() == Some(child))
            .cloned()
    };
    // Listed as the parent's copy first, then as its own program.
    let started = Instant::now();
    let mut seen_before_exec = false;
    let listed = loop {
        let list = ctl(&socket, &["processes"]);
        if let Some(e) = entry(&list) {
            if e["comm"] == "python3" {
                seen_before_exec = true;
            }
            if e["rank"] == "3" {
                break e;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the child {child} not listed with its identity: {list}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(seen_before_exec, "listed before its exec too");
    assert_eq!(listed["comm"], "sleep", "{listed}");
    assert_eq!(listed["job"], "forkexec", "{listed}");
    assert_eq!(listed["world_size"], "4", "{listed}");
    // Why it is traced stays what it was when first listed (it maps what
    // its parent mapped, or is its parent's child).
    assert!(
        listed["traced_because"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{listed}"
    );
    // The parent and its child (its process group).
    // SAFETY: a signal to a process group this test started.
    unsafe { libc::killpg(parent.id() as i32, libc::SIGKILL) };
    let _ = parent.wait();
    stop_service(&mut agent, &mut stderr);
}

/// A job in a container (its own mount namespace and root, with its own
/// CPython, glibc and copies of the device libraries): the service finds
/// it by the libraries its ranks map, which it reads through the ranks'
/// own root (the host has no file at those paths), lists its ranks with
/// their identity, probes them, and counts and dumps their all-reduces.
#[test]
fn the_service_finds_and_probes_a_job_in_a_container() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let root = xpuscope_tests::roots::sid();
    let dir = TempDir::new("service-container");
    let Service {
        mut agent,
        mut stderr,
        dump_dir,
        socket,
        port,
    } = Service::start(dir.path(), "");
    let name = "ctrjob";
    let job = Job::start_in(Some((root, Entry::Container)), dir.path(), name, &[]);
    let (_, listed) = wait_listed(&socket, &job, name);
    for e in &listed {
        let pid = e["pid"].as_u64().unwrap() as u32;
        let rank = job.ranks.iter().find(|(_, p)| **p == pid).unwrap().0;
        assert_eq!(e["rank"], rank.to_string(), "{e}");
        assert_eq!(e["job"], name, "{e}");
        assert_eq!(e["world_size"], "2", "{e}");
    }
    // Found by a library it maps (the rank itself or its launcher, whose
    // children it is): the container's copy, a path the host lacks.
    let why: Vec<String> = listed
        .iter()
        .map(|e| e["traced_because"].as_str().unwrap_or_default().to_string())
        .collect();
    let all = ctl(&socket, &["processes"]);
    let found_by_library = all.as_array().expect("a list").iter().any(|e| {
        e["traced_because"]
            .as_str()
            .is_some_and(|r| r.starts_with("maps lib"))
            && (job
                .ranks
                .values()
                .any(|&p| e["pid"].as_u64() == Some(p as u64))
                || job.launcher.0.id() as u64 == e["pid"].as_u64().unwrap_or(0))
    });
    assert!(
        found_by_library,
        "the job was found by a library it maps: {why:?} in {all}"
    );
    for pid in job.ranks.values() {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let nccl = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("libnccl"))
            .unwrap_or_else(|| panic!("rank {pid} maps no libnccl:\n{maps}"));
        assert!(
            !Path::new(nccl).exists(),
            "{nccl}: the job's libraries exist only in its root"
        );
    }
    let ranks = job.run();

    let tl = dump(&socket, &dump_dir);
    for (&rank, &pid) in &ranks {
        let reduces = slices_of(&tl, pid, "ncclAllReduce");
        assert_eq!(
            reduces.len() as u64,
            STEPS,
            "rank {rank} (pid {pid}): every step's all-reduce"
        );
        for s in &reduces {
            assert_eq!(arg_text(s, "return"), "0", "{s:?}");
        }
        let p = tl.processes.get(&(pid as i32)).expect("the rank's process");
        assert!(p.labels.contains(&format!("rank={rank}")), "{p:?}");
        assert!(p.labels.contains(&format!("job={name}")), "{p:?}");
    }
    wait_allreduce_counts(port, name, ranks.keys());
    stop_service(&mut agent, &mut stderr);
}

/// The value of the series of `family` whose labels include every one of
/// `labels` (`key="value"`), in OpenMetrics text.
fn series_value(metrics: &str, family: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// GPU health on `/metrics`: the stand-in NVML's GPUs, each rank's GPU
/// with that rank's labels (job, rank, local rank, node), a GPU no rank
/// uses with empty rank labels.
#[test]
fn the_service_serves_gpu_health_with_the_ranks_on_each_gpu() {
    let _serial = exclusive();
    wait_for_closers();
    let fx = fixtures::build_all();
    let dir = TempDir::new("svcgpu");
    let name = "svcgpu";
    let nvml_dir = dir.path().join(name).join("nvml");
    let library = fx.join("standins/lib/libnvidia-ml.so.1");
    let Service {
        mut agent,
        mut stderr,
        port,
        socket,
        ..
    } = Service::start_with_env(
        dir.path(),
        "",
        &[
            ("XPUSCOPE_NVML_LIBRARY", library.to_str().expect("UTF-8")),
            ("STANDIN_NVML_DIR", nvml_dir.to_str().expect("UTF-8")),
        ],
    );
    let job = Job::start(dir.path(), name);
    wait_listed(&socket, &job, name);
    let started = Instant::now();
    let metrics = loop {
        let metrics = http_get(port, "/metrics");
        let labelled = (0..2).all(|r| {
            series_value(
                &metrics,
                "xpuscope_gpu_sm_clock_mhz",
                &[&format!("gpu=\"{r}\""), &format!("rank=\"{r}\"")],
            )
            .is_some()
        });
        if labelled {
            break metrics;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no GPU series with the ranks' labels:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    for r in 0..2 {
        let labels = [
            format!("gpu=\"{r}\""),
            format!("rank=\"{r}\""),
            format!("local_rank=\"{r}\""),
            format!("training_job=\"{name}\""),
            format!("node=\"{}\"", xpuscope_tests::service_run::TEST_NODE),
            format!("gpu_uuid=\"GPU-5374616e-6469-6e00-0000-00000000000{r}\""),
        ];
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        let value = |family| series_value(&metrics, family, &labels);
        assert_eq!(
            value("xpuscope_gpu_sm_clock_mhz"),
            Some(1980.0),
            "rank {r}:\n{metrics}"
        );
        assert_eq!(value("xpuscope_gpu_max_sm_clock_mhz"), Some(1980.0));
        assert_eq!(value("xpuscope_gpu_throttle_reasons"), Some(0.0));
        assert_eq!(value("xpuscope_gpu_utilization_ratio"), Some(0.9));
        assert!(value("xpuscope_gpu_memory_used_bytes").is_some_and(|b| b > 0.0));
        assert_eq!(
            value("xpuscope_gpu_memory_total_bytes"),
            Some((80u64 << 30) as f64)
        );
        assert_eq!(value("xpuscope_gpu_xid_errors_total"), Some(0.0));
    }
    // A GPU no rank runs on: idle, without rank labels.
    assert_eq!(
        series_value(
            &metrics,
            "xpuscope_gpu_throttle_reasons",
            &["gpu=\"5\"", "rank=\"\""]
        ),
        Some(1.0),
        "GPU 5 idle (reason bit 0x1):\n{metrics}"
    );
    job.run();
    stop_service(&mut agent, &mut stderr);
}
