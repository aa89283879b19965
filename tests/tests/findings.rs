//! End to end: the detectors find the simulator's faults while the job
//! runs, graded against its ground truth. The agent attaches to the
//! launcher before it starts its ranks (spawn gate) and the ranks wait
//! before their first device call (init delay), so every communicator's
//! set-up is seen and sequence numbers are exact across ranks.
//! Root and eBPF; these never skip.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{Recording, TempDir, agent_bin, exclusive};
use xpuscope_tests::device::*;
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

struct Run {
    _dir: TempDir,
    truth: Value,
    stats: Value,
    stderr: String,
    tl: Timeline,
}

/// A 2-rank job (dp 2) with `extra` launcher options, recorded by
/// `agent attach` with `agent_args` from before its ranks start.
fn run_job(tag: &str, extra: &[&str], agent_args: &[&str]) -> Run {
    wait_for_closers();
    let fx = fixtures::build_all();
    // Built before the launcher starts: its timeout runs from its start.
    let _ = agent_bin();
    let dir = TempDir::new(tag);
    let job_dir = dir.path().join("job");
    let gate = dir.path().join("spawn.go");
    let launcher = Command::new("python3")
        .arg(fixtures::repo_root().join("tests/sim/launch.py"))
        .arg("--out-dir")
        .arg(&job_dir)
        .arg("--build-dir")
        .arg(fx.join("sim"))
        .args(["--job-name", tag, "--quiet"])
        .args(["--world-size", "2", "--dp", "2", "--tp", "1", "--pp", "1"])
        // The agent finds a new rank's libraries by rescanning maps every
        // 500 ms: communicator set-up waits for the probes.
        .args(["--init-delay-ms", "1500"])
        .arg("--spawn-gate")
        .arg(&gate)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("start the launcher");
    let mut launcher = GroupGuard(launcher);
    let pid = launcher.0.id().to_string();
    let mut args = vec!["--pid", pid.as_str()];
    args.extend_from_slice(agent_args);
    let rec = Recording::start(dir.path(), &args);
    std::fs::write(&gate, b"").expect("open the spawn gate");
    let done = rec.finish(Duration::from_secs(60));
    let _ = launcher.0.wait();
    let truth = read_json(&job_dir.join("ground_truth.json")).expect("ground truth");
    let trace = decode(&done.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    Run {
        _dir: dir,
        truth,
        stats: done.stats,
        stderr: done.stderr,
        tl: Timeline::new(&trace),
    }
}

fn findings(run: &Run) -> Vec<Value> {
    let doc = &run.stats["findings"];
    assert_eq!(doc["schema"], "xpuscope-findings/1", "{doc}");
    doc["findings"].as_array().expect("a list").clone()
}

/// The trace's `xpuscope findings` slices: (name, args as text).
fn finding_slices(tl: &Timeline) -> Vec<(String, Vec<(String, String)>)> {
    let tracks: Vec<u64> = tl
        .tracks
        .values()
        .filter(|t| t.name.as_deref() == Some("xpuscope findings"))
        .map(|t| t.uuid)
        .collect();
    tl.slices
        .iter()
        .filter(|s| tracks.contains(&s.track))
        .map(|s| {
            (
                s.name.clone(),
                s.args
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_string()))
                    .collect(),
            )
        })
        .collect()
}

/// Rank 1 never joins the DP all-reduce of step 2; rank 0 waits in it.
/// With a 1 s hang timeout the finding names the communicator (its hash as
/// the trace shows it), the all-reduce's number and rank 1, per ground
/// truth, in the summary, `--stats-json` and the trace.
#[test]
fn a_hang_is_found_while_it_lasts_and_names_the_rank_that_never_joined() {
    let _serial = exclusive();
    let run = run_job(
        "findhang",
        &[
            "--steps",
            "6",
            "--fault",
            "hang:rank=1,step=2",
            "--timeout",
            "5",
        ],
        &["--hang-timeout", "1s"],
    );
    let fault = &run.truth["faults"][0];
    let expected = &fault["expected"];
    let seq = expected["seq"]
        .as_u64()
        .expect("the hung collective's number");
    let hangs: Vec<Value> = findings(&run)
        .into_iter()
        .filter(|f| f["kind"] == "hang")
        .collect();
    assert_eq!(
        hangs.len(),
        1,
        "{:#}\n{}",
        run.stats["findings"],
        run.stderr
    );
    let h = &hangs[0];
    // The communicator as the trace names it on the all-reduces.
    let hashes: std::collections::BTreeSet<String> = run
        .tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("ncclAllReduce"))
        .map(|s| arg_text(s, "comm_hash"))
        .collect();
    assert_eq!(hashes.len(), 1, "one DP communicator: {hashes:?}");
    let comm = format!("nccl:{}", hashes.iter().next().unwrap());
    assert_eq!(h["comm"], comm.as_str(), "{h:#}");
    assert_eq!(h["seq"], seq, "{h:#}");
    assert_eq!(h["ranks"], serde_json::json!([1]), "{h:#}");
    assert_eq!(h["evidence"]["entered"], serde_json::json!([0]), "{h:#}");
    assert_eq!(h["evidence"]["stuck"][0]["rank"], 0, "{h:#}");
    assert!(h["end_ns"].is_null());
    let summary = h["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!("#{seq} on {comm}")) && summary.contains("never by rank 1"),
        "{summary}"
    );
    assert!(run.stderr.contains(summary), "{}", run.stderr);
    let slices = finding_slices(&run.tl);
    let hang = slices
        .iter()
        .find(|(n, _)| n == "hang")
        .unwrap_or_else(|| panic!("no hang slice: {slices:?}"));
    let arg = |k: &str| {
        hang.1
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(arg("comm"), comm);
    assert_eq!(arg("seq"), seq.to_string());
    assert_eq!(arg("ranks"), "1");
}

/// Rank 1 raises SIGABRT at step 2: a crash finding names it and the
/// signal; a clean job has no findings at all.
#[test]
fn a_crash_names_the_rank_and_signal_and_a_clean_job_has_no_findings() {
    let _serial = exclusive();
    let run = run_job(
        "findcrash",
        &[
            "--steps",
            "5",
            "--fault",
            "crash:rank=1,step=2",
            "--timeout",
            "20",
        ],
        &[],
    );
    let expected = &run.truth["faults"][0]["expected"];
    let crashes: Vec<Value> = findings(&run)
        .into_iter()
        .filter(|f| f["kind"] == "crash" && f["evidence"]["signal"] == expected["signal"])
        .collect();
    assert_eq!(crashes.len(), 1, "{:#}", run.stats["findings"]);
    assert_eq!(crashes[0]["ranks"], serde_json::json!([1]));
    assert_eq!(
        crashes[0]["evidence"]["signal_name"],
        expected["signal_name"]
    );
    assert!(
        finding_slices(&run.tl).iter().any(|(n, _)| n == "crash"),
        "the crash on the findings track"
    );

    let clean = run_job("findclean", &["--steps", "5"], &["--hang-timeout", "2s"]);
    assert_eq!(findings(&clean), Vec::<Value>::new(), "{}", clean.stderr);
    assert!(clean.stderr.contains("findings: none"), "{}", clean.stderr);
}
