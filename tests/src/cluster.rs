//! Support for the multi-node tests: a simulated job over several "nodes"
//! (one launcher per node, each in its own UTS namespace) with one agent
//! per node launcher, plus one agent following every rank (the reference a
//! merged trace is compared with); and rewriting a recorded trace as if its
//! machine's clocks were off (with the official schema, independent of the
//! merger).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use perfetto_protos::trace::Trace;
use protobuf::Message;
use serde_json::Value;

use crate::agent::{Lines, Proc, TempDir, agent_bin};
use crate::device::{GroupGuard, read_json, wait_for_closers, wait_until};
use crate::fixtures;

/// Builtin clock ids.
const CLOCK_REALTIME: u32 = 1;
const CLOCK_MONOTONIC: u32 = 3;
const CLOCK_BOOTTIME: u32 = 6;

fn shift(ts: u64, d: i64) -> u64 {
    (ts as i64 + d).max(0) as u64
}

/// The trace as a machine whose BOOTTIME reads `d_ns` later would have
/// recorded it, with a wall clock `e_ns` off as well: every timestamp
/// (packets, ftrace events, compact-sched delta chains, BOOTTIME and
/// MONOTONIC in clock snapshots) + `d_ns`, REALTIME readings + `e_ns`.
pub fn shift_trace(bytes: &[u8], d_ns: i64, e_ns: i64) -> Vec<u8> {
    let mut trace = Trace::parse_from_bytes(bytes).expect("a trace to shift");
    for p in &mut trace.packet {
        if p.has_timestamp() {
            p.set_timestamp(shift(p.timestamp(), d_ns));
        }
        if p.has_clock_snapshot() {
            for c in &mut p.mut_clock_snapshot().clocks {
                match c.clock_id() {
                    CLOCK_BOOTTIME | CLOCK_MONOTONIC => c.set_timestamp(shift(c.timestamp(), d_ns)),
                    CLOCK_REALTIME => c.set_timestamp(shift(c.timestamp(), e_ns)),
                    _ => {}
                }
            }
        }
        if p.has_ftrace_events() {
            let b = p.mut_ftrace_events();
            if let Some(c) = b.compact_sched.as_mut() {
                if let Some(t) = c.switch_timestamp.first_mut() {
                    *t = shift(*t, d_ns);
                }
                if let Some(t) = c.waking_timestamp.first_mut() {
                    *t = shift(*t, d_ns);
                }
            }
            for e in &mut b.event {
                if e.has_timestamp() {
                    e.set_timestamp(shift(e.timestamp(), d_ns));
                }
            }
        }
    }
    trace.write_to_bytes().expect("encode the shifted trace")
}

/// The trace without its clock snapshots (an agent that recorded none).
pub fn strip_clock_snapshots(bytes: &[u8]) -> Vec<u8> {
    let mut trace = Trace::parse_from_bytes(bytes).expect("a trace to strip");
    trace.packet.retain(|p| !p.has_clock_snapshot());
    trace.write_to_bytes().expect("encode the stripped trace")
}

/// Rewrites the `job=` label of every process track (a trace of "another
/// job").
pub fn relabel_job(bytes: &[u8], job: &str) -> Vec<u8> {
    let mut trace = Trace::parse_from_bytes(bytes).expect("a trace to relabel");
    for p in &mut trace.packet {
        if p.has_track_descriptor() {
            let d = p.mut_track_descriptor();
            if let Some(proc_) = d.process.as_mut() {
                for l in &mut proc_.process_labels {
                    if l.starts_with("job=") {
                        *l = format!("job={job}");
                    }
                }
            }
        }
    }
    trace.write_to_bytes().expect("encode the relabelled trace")
}

/// A finished multi-node job with its traces.
pub struct ClusterRun {
    pub dir: TempDir,
    /// Per node: its agent's trace.
    pub node_traces: Vec<PathBuf>,
    /// The agent that followed every rank (all launchers).
    pub all_trace: PathBuf,
    /// The job's ground truth (`xpuscope-sim-job-ground-truth/1`).
    pub job: Value,
    /// Each node's ground truth.
    pub nodes: Vec<Value>,
    pub rdv: PathBuf,
    /// The agents' stderr (their summaries): the one on every rank, then
    /// one per node. Their `--stats-json` is next to each trace
    /// (`.json`).
    pub agent_logs: Vec<String>,
}

/// An agent recording one process tree, optionally from inside a node's
/// UTS namespace.
struct NodeAgent {
    agent: Proc,
    stderr: Lines,
}

fn start_agent(pid: u32, uts_of: Option<u32>, out: &Path, probe_level: &str) -> NodeAgent {
    let mut cmd = match uts_of {
        Some(target) => {
            let mut c = Command::new("nsenter");
            c.args(["--uts", "--target", &target.to_string()])
                .arg(agent_bin());
            c
        }
        None => Command::new(agent_bin()),
    };
    cmd.arg("attach")
        .args(["--pid", &pid.to_string(), "--probe-level", probe_level])
        // Every off-CPU interval with its stack: the step breakdown tells
        // a data-loader wait from host work by it.
        .args(["--stacks", "all"])
        .arg("-o")
        .arg(out)
        .arg("--stats-json")
        .arg(out.with_extension("json"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut agent = Proc::spawn("agent", &mut cmd);
    let mut stderr = Lines::new(agent.stderr());
    stderr.wait_for("xpuscope: recording", Duration::from_secs(30));
    NodeAgent { agent, stderr }
}

/// Runs the simulated job over `nnodes` nodes (`node-<k>` hostnames), one
/// agent per node launcher and one on all of them, with `launch_args` for
/// every launcher (layout, steps, flavor, faults).
pub fn run_cluster(tag: &str, nnodes: usize, launch_args: &[&str]) -> ClusterRun {
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let dir = TempDir::new(tag);
    let rdv = dir.path().join("rdv");
    let gate = dir.path().join("go");
    let launcher = fixtures::repo_root().join("tests/sim/launch.py");
    // One parent for every launcher, as one agent's target: it follows them
    // all through fork.
    let mut script = String::from("set -e\n");
    for k in 0..nnodes {
        let mut args = vec![
            launcher.display().to_string(),
            "--build-dir".into(),
            fixtures.join("sim").display().to_string(),
            "--quiet".into(),
            "--timeout".into(),
            "120".into(),
            "--nnodes".into(),
            nnodes.to_string(),
            "--node-rank".into(),
            k.to_string(),
            "--node-name".into(),
            format!("node-{k}"),
            "--rdv-dir".into(),
            rdv.display().to_string(),
            "--job-name".into(),
            tag.into(),
            "--spawn-gate".into(),
            gate.display().to_string(),
            // The agents find a new rank's libraries by rescanning maps
            // (500 ms): communicator set-up waits for their probes (3 s
            // was too short twice in 11 runs with the VM at load 5-10: a
            // node's agent then missed the set-up, and with it the
            // communicators' identity).
            "--init-delay-ms".into(),
            "5000".into(),
        ];
        args.extend(launch_args.iter().map(|s| s.to_string()));
        script.push_str(&format!("python3 {} &\n", args.join(" ")));
    }
    script.push_str("wait\n");
    // Its own process group: the guard kills every launcher and rank.
    let parent = GroupGuard(
        Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start the launchers"),
    );
    let mut launchers = Vec::new();
    wait_until(Duration::from_secs(30), "every node's launcher", || {
        launchers = (0..nnodes)
            .filter_map(|k| read_json(&rdv.join(format!("node{k}/ground_truth.json"))))
            .filter_map(|gt| gt["node"]["launcher_pid"].as_u64())
            .map(|p| p as u32)
            .collect();
        launchers.len() == nnodes
    });
    let all_trace = dir.path().join("all.pftrace");
    let mut agents = vec![start_agent(parent.0.id(), None, &all_trace, "0")];
    let node_traces: Vec<PathBuf> = (0..nnodes)
        .map(|k| dir.path().join(format!("node{k}.pftrace")))
        .collect();
    for (k, &pid) in launchers.iter().enumerate() {
        agents.push(start_agent(pid, Some(pid), &node_traces[k], "0"));
    }
    std::fs::write(&gate, b"").expect("open the spawn gate");
    let mut parent = parent;
    let mut status = None;
    wait_until(Duration::from_secs(150), "the job's end", || {
        status = parent.0.try_wait().expect("wait for the launchers");
        status.is_some()
    });
    let status = status.expect("checked above");
    let mut agent_logs = Vec::new();
    for a in &mut agents {
        let st = a.agent.wait_timeout(Duration::from_secs(60));
        let log = a.stderr.rest(Duration::from_secs(2));
        assert!(
            st.is_some_and(|s| s.success()),
            "agent ended with {st:?}:\n{log}"
        );
        agent_logs.push(log);
    }
    let job = read_json(&rdv.join("ground_truth.json")).expect("the job's ground truth");
    assert!(status.success(), "the job failed: {status}; {job:#}");
    let nodes = (0..nnodes)
        .map(|k| read_json(&rdv.join(format!("node{k}/ground_truth.json"))).expect("node truth"))
        .collect();
    ClusterRun {
        dir,
        node_traces,
        all_trace,
        job,
        nodes,
        rdv,
        agent_logs,
    }
}

/// Runs `agent merge` with `args`; (status, stdout, stderr).
pub fn merge(args: &[&std::ffi::OsStr]) -> (std::process::ExitStatus, String, String) {
    let out = Command::new(agent_bin())
        .arg("merge")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run agent merge");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
