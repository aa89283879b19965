//! End to end: steps from the job's own markers. An Ascend job (its ranks
//! open an mstx range `step N` around each training step) is attached to
//! in the middle of its run, after it has done some steps: the agent never
//! saw those steps' all-reduces, so counting all-reduces would number the
//! steps from the attach. The findings carry the job's own step numbers,
//! from the markers, and say so (`step_source`), online and from
//! `agent diagnose` over the trace. Python ranks without markers are
//! numbered by their training loop's step counter instead.
//! Root and eBPF; these never skip.

use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{Recording, TempDir, exclusive};
use xpuscope_tests::device::{offline_findings, start_gated_job, wait_for_closers, wait_until};

/// Steps rank `rank` logged as done.
fn steps_done(job_dir: &std::path::Path, rank: u64) -> u64 {
    std::fs::read_to_string(job_dir.join(format!("rank{rank}.steps.jsonl")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .count() as u64
}

const STEPS: u64 = 150;
const STALL_STEP: u64 = 120;
/// Steps the job has done before the agent attaches.
const BEFORE_ATTACH: u64 = 15;

const MARKERS: &str = "the job's mstx step markers (\"step N\")";
const PYTHON_COUNTER: &str =
    "the job's Python step counter (its training loop's step, global_step, iteration, ...)";

#[test]
fn an_attach_in_the_middle_of_a_run_numbers_steps_by_the_jobs_markers() {
    attach_mid_run("c", "ascend", MARKERS);
}

/// The same with the simulator's Python ranks (their markers go through
/// ctypes, as a PyTorch script's `mstx` calls do).
#[test]
fn python_ranks_steps_come_from_their_markers_too() {
    attach_mid_run("python", "ascend", MARKERS);
}

/// Python ranks without markers (the NVIDIA flavor: NVTX cannot be
/// probed): their training loop's `for step in range(...)`, read off their
/// off-CPU stacks, numbers the steps.
#[test]
fn python_ranks_without_markers_are_numbered_by_their_step_counter() {
    attach_mid_run("python", "nvidia", PYTHON_COUNTER);
}

fn attach_mid_run(lang: &str, flavor: &str, source: &str) {
    let _serial = exclusive();
    wait_for_closers();
    let dir = TempDir::new(&format!("stepmarks-{lang}-{flavor}"));
    let stall = format!("dataloader_stall:rank=1,step={STALL_STEP},ms=500");
    let job = start_gated_job(
        dir.path(),
        "job",
        "stepmarks",
        STEPS,
        &[
            "--flavor",
            flavor,
            "--lang",
            lang,
            "--host-us",
            "10000",
            "--fault",
            &stall,
        ],
    );
    std::fs::write(&job.gate, b"").expect("open the gate");
    wait_until(Duration::from_secs(30), "the job's first steps", || {
        steps_done(&job.job_dir, 1) >= BEFORE_ATTACH
    });
    let launcher = job.launcher.0.id().to_string();
    let rec = Recording::start(dir.path(), &["--pid", &launcher]);
    let attached_at = steps_done(&job.job_dir, 1);
    assert!(
        attached_at + 20 < STALL_STEP,
        "the agent attached at step {attached_at}, too late to see the stall's usual waits"
    );
    let done = rec.finish(Duration::from_secs(60));
    let mut launcher = job.launcher;
    assert!(launcher.0.wait().expect("launcher status").success());
    eprintln!("{lang}: attached after step {attached_at} of rank 1");

    // The step table numbers the steps the same way: the stalled step is
    // the job's 120th there too, mostly data wait.
    let rows = done.stats["steps"].as_array().expect("step rows");
    let stalled = rows
        .iter()
        .find(|r| r["rank"] == 1 && r["step"] == STALL_STEP)
        .unwrap_or_else(|| panic!("{lang}: no row of rank 1 step {STALL_STEP}: {rows:#?}"));
    assert_eq!(stalled["step_source"], source, "{lang}: {stalled:#}");
    assert!(
        stalled["data_wait_ns"].as_u64().unwrap() > 250_000_000,
        "{lang}: {stalled:#}"
    );

    let online = done.stats["findings"]["findings"]
        .as_array()
        .expect("findings")
        .clone();
    for (driver, found) in [
        ("online", online),
        ("offline", offline_findings(dir.path(), &[])),
    ] {
        let stalls: Vec<&Value> = found
            .iter()
            .filter(|f| f["kind"] == "dataloader_stall")
            .collect();
        assert_eq!(
            stalls.len(),
            1,
            "{lang} {driver}: {found:#?}\n{}",
            done.stderr
        );
        let f = stalls[0];
        assert_eq!(f["ranks"], serde_json::json!([1]), "{lang} {driver}: {f:#}");
        // The job's own number; all-reduces counted from the attach would
        // say about STALL_STEP - attached_at.
        let step = f["step"].as_u64().expect("a step");
        assert!(
            step.abs_diff(STALL_STEP) <= 1,
            "{lang} {driver}: step {step}, the job's {STALL_STEP} (attached after {attached_at}): {f:#}"
        );
        assert!(
            f["summary"]
                .as_str()
                .is_some_and(|s| s.contains(&format!("at step {step}"))),
            "{lang} {driver}: {f:#}"
        );
        assert_eq!(
            f["evidence"]["step_source"], source,
            "{lang} {driver}: {f:#}"
        );
    }
}
