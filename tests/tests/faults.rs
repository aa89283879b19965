//! End-to-end: the agent under faults of the job and of its own life — a
//! hang ended by the launcher killing the ranks (calls still running when
//! their process died are reported as such), and a stop signal arriving
//! before recording even started (a valid, empty trace and exit 0).
//! Root and eBPF; these never skip.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::shared_runs;
use xpuscope_tests::agent::{Proc, Recording, TempDir, agent_bin, exclusive, go, workload_bin};
use xpuscope_tests::device::*;
use xpuscope_tests::trace_check::{Timeline, TrackKind, check_importer_rules, decode};

/// Rank 1 never joins the all-reduce of step 2; rank 0 blocks in it until
/// the launcher's timeout kills both. The call rank 0 was in is marked as
/// running when its process died, and counted so in the summary. (The
/// recording is shared with `findings` and `diagnose`.)
#[test]
fn a_hang_ended_by_the_launcher_shows_the_call_its_rank_died_in() {
    let serial = exclusive();
    let run = shared_runs::hang_at_step_2(&serial, "nvidia");
    assert!(!run.status.success(), "the launcher reports the hang");
    let device = &run.stats["device"];
    let died = device["died_in_call"].as_u64().expect("died_in_call");
    assert!(died >= 1, "{device}");
    assert!(
        run.stderr
            .contains("calls still running when their process died"),
        "{}",
        run.stderr
    );
    let rank0 = run.rank_pids[&0];
    let marks: Vec<String> =
        run.tl
            .instants
            .iter()
            .filter(|i| i.name.contains("(running when its"))
            .filter(|i| {
                run.tl.tracks.get(&i.track).is_some_and(
                    |t| matches!(t.kind, TrackKind::Thread { pid, .. } if pid == rank0),
                )
            })
            .map(|i| i.name.clone())
            .collect();
    assert!(
        marks
            .iter()
            .any(|n| n.starts_with("ncclAllReduce") || n.starts_with("cudaStreamSynchronize")),
        "rank 0 died waiting for its all-reduce: {marks:?}"
    );
}

/// SIGTERM as soon as the agent created its output, while it still loads
/// its programs (~70 ms), before it records anything: still a valid trace
/// and a clean exit, never a 0-byte file (the defect: exit 143, 0 bytes).
#[test]
fn a_stop_before_recording_starts_leaves_a_valid_trace() {
    let _serial = exclusive();
    let dir = TempDir::new("early-stop");
    let target = Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .args(["loop", "30"])
            .stdout(Stdio::null()),
    );
    for round in 0..4 {
        let out = dir.path().join(format!("early-{round}.pftrace"));
        let agent = Proc::spawn(
            "agent",
            Command::new(agent_bin())
                .args(["attach", "--pid", &target.pid().to_string(), "-o"])
                .arg(&out)
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
        );
        wait_until(Duration::from_secs(10), "the output file", || out.exists());
        agent.signal(libc::SIGTERM);
        let mut agent = agent;
        let status = agent
            .wait_timeout(Duration::from_secs(30))
            .expect("the agent stops");
        assert!(status.success(), "round {round}: exit {status}");
        let bytes = std::fs::read(&out).expect("the trace exists");
        assert!(!bytes.is_empty(), "round {round}: empty file");
        let trace = decode(&bytes).expect("a valid trace");
        check_importer_rules(&trace).expect("importer rules hold");
        let _ = Timeline::new(&trace);
    }
    target.signal(libc::SIGKILL);
}

/// Thread churn with a stack at every switch-out: a dying thread's last
/// switch-out takes no stack (it would never be used: the defect counted
/// one unmatched stack per thread).
#[test]
fn dying_threads_take_no_stack() {
    let _serial = exclusive();
    let dir = TempDir::new("churn-stacks");
    let mut wl = Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .args(["threads", "2000"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let rec = Recording::start(
        dir.path(),
        &["--pid", &wl.pid().to_string(), "--stacks", "all"],
    );
    go(&mut wl.stdin());
    let done = rec.finish(Duration::from_secs(60));
    let stats = &done.stats;
    assert_eq!(stats["dropped"], 0, "{stats}");
    assert!(stats["threads"].as_u64().unwrap() > 2000, "{stats}");
    assert!(stats["stacks"].as_u64().unwrap() >= 2000, "{stats}");
    assert_eq!(stats["stacks_unmatched"], 0, "{stats}");
    // The rings' memory is stated (defaults: 32 MiB + 2 MiB + 8 MiB).
    assert_eq!(
        stats["ring_bytes"].as_u64(),
        Some((32 << 20) + (2 << 20) + (8 << 20)),
        "{stats}"
    );
    assert!(
        done.stderr.contains("the rings, mapped twice"),
        "{}",
        done.stderr
    );
}

/// The ids of the BPF programs and links process `pid` holds, from its
/// file descriptors' `fdinfo` (`prog_id:` / `link_id:`).
fn bpf_objects_of(pid: u32) -> (Vec<u64>, Vec<u64>) {
    let (mut progs, mut links) = (Vec::new(), Vec::new());
    for entry in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .expect("fdinfo")
        .flatten()
    {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in text.lines() {
            let id = |l: &str| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            };
            if line.starts_with("prog_id:") {
                progs.extend(id(line));
            } else if line.starts_with("link_id:") {
                links.extend(id(line));
            }
        }
    }
    progs.sort_unstable();
    progs.dedup();
    links.sort_unstable();
    links.dedup();
    (progs, links)
}

/// Every BPF program and link id present now, from Debian's `bpftool`
/// (installed if missing).
fn bpf_ids() -> (Vec<u64>, Vec<u64>) {
    ensure_bpftool();
    let ids = |what: &str| -> Vec<u64> {
        let out = Command::new("bpftool")
            .args([what, "show", "-j"])
            .output()
            .expect("run bpftool");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()
            .map(|a| a.iter().filter_map(|o| o["id"].as_u64()).collect())
            .unwrap_or_default()
    };
    (ids("prog"), ids("link"))
}

fn ensure_bpftool() {
    if Command::new("bpftool")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return;
    }
    xpuscope_tests::packages::apt_install(&["bpftool"]);
}

/// SIGKILL of the agent while it records device calls: the kernel frees
/// every program and link it held (nothing is pinned, nothing left behind).
#[test]
fn sigkill_leaves_no_program_or_link_behind() {
    let _serial = exclusive();
    let dir = TempDir::new("sigkill");
    let wl = Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .args(["loop", "120"])
            .stdout(Stdio::null()),
    );
    let rec = Recording::start(dir.path(), &["--pid", &wl.pid().to_string()]);
    let (progs, links) = bpf_objects_of(rec.agent.pid());
    assert!(progs.len() >= 7, "the agent's programs: {progs:?}");
    assert!(!links.is_empty(), "the agent's links: {links:?}");
    rec.agent.signal(libc::SIGKILL);
    let mut agent = rec.agent;
    agent.wait_timeout(Duration::from_secs(10)).expect("killed");
    wait_until(Duration::from_secs(20), "programs and links freed", || {
        let (now_progs, now_links) = bpf_ids();
        !progs.iter().any(|p| now_progs.contains(p)) && !links.iter().any(|l| now_links.contains(l))
    });
}

/// Two agents on one target at once: each has its own maps and rings, and
/// both traces hold the target's scheduling.
#[test]
fn two_agents_on_one_target_both_record() {
    let _serial = exclusive();
    let dir_a = TempDir::new("two-a");
    let dir_b = TempDir::new("two-b");
    let wl = Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .args(["loop", "3"])
            .stdout(Stdio::null()),
    );
    let pid = wl.pid().to_string();
    let a = Recording::start(dir_a.path(), &["--pid", &pid]);
    let b = Recording::start(dir_b.path(), &["--pid", &pid]);
    let done_a = a.finish(Duration::from_secs(30));
    let done_b = b.finish(Duration::from_secs(30));
    for done in [&done_a, &done_b] {
        assert!(
            done.stderr.contains("stopped (target exited)"),
            "{}",
            done.stderr
        );
        assert_eq!(done.stats["dropped"], 0, "{}", done.stats);
        let trace = decode(&done.trace).expect("decodes");
        check_importer_rules(&trace).expect("importer rules hold");
        let tl = Timeline::new(&trace);
        let ran = tl
            .switches
            .iter()
            .filter(|s| tl.process_of(s.next_pid) == Some(wl.pid() as i32))
            .count();
        assert!(
            ran > 50,
            "the target's threads ran {ran} times in this trace"
        );
    }
}
