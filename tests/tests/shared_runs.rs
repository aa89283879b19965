//! Recordings that several tests read. Each is one simulated job recorded
//! once per test run, by whichever of its tests comes first, and kept for
//! the others: each test asserts on its own side of it (the online
//! findings and the trace in `findings`, `agent diagnose` over the trace in
//! `diagnose`). A recording that fails fails the test that made it; the
//! next test that needs it records again.
//!
//! The callers hold [`exclusive`]'s lock (the reference to its guard is
//! the proof), so a shared recording is made under it like any other.
//! The recordings' folders are removed when the test process exits.
//!
//! [`exclusive`]: xpuscope_tests::agent::exclusive

use std::sync::{Mutex, MutexGuard, OnceLock};

use xpuscope_tests::device::{SimRun, TP2_PP2_DP2, print_time_to_finding, run_from_spawn};

/// A 2-rank job (dp 2) of `flavor` (`nvidia` or `ascend`) whose rank 1
/// never joins the all-reduce of step 2: rank 0 waits in it until the
/// launcher's timeout (5 s) stops both ranks. Recorded with a 1 s hang
/// timeout.
pub fn hang_at_step_2(_serial: &MutexGuard<'static, ()>, flavor: &str) -> &'static SimRun {
    static RUNS: [OnceLock<SimRun>; 2] = [OnceLock::new(), OnceLock::new()];
    RUNS[flavor_index(flavor)].get_or_init(|| {
        record(
            &format!("sharedhang{flavor}"),
            &[
                "--flavor",
                flavor,
                "--steps",
                "6",
                "--fault",
                "hang:rank=1,step=2",
                "--timeout",
                "5",
            ],
            &["--hang-timeout", "1s"],
        )
    })
}

/// A 2-rank job (dp 2) of `flavor` (`nvidia` or `ascend`) whose rank 1
/// kills itself with its fault's signal at step 2; the launcher then stops
/// rank 0. Recorded at the agent's defaults.
pub fn crash_at_step_2(_serial: &MutexGuard<'static, ()>, flavor: &str) -> &'static SimRun {
    static RUNS: [OnceLock<SimRun>; 2] = [OnceLock::new(), OnceLock::new()];
    RUNS[flavor_index(flavor)].get_or_init(|| {
        record(
            &format!("sharedcrash{flavor}"),
            &[
                "--flavor",
                flavor,
                "--steps",
                "6",
                "--fault",
                "crash:rank=1,step=2",
                "--timeout",
                "20",
            ],
            &[],
        )
    })
}

/// A clean job of 8 ranks (tp 2, pp 2, dp 2: pipeline stages enter some
/// collectives later than their peers every step, by design), 6 steps,
/// recorded with a 2 s hang timeout and otherwise the agent's defaults:
/// it must have no findings at all.
pub fn clean_8_ranks(_serial: &MutexGuard<'static, ()>) -> &'static SimRun {
    static RUN: OnceLock<SimRun> = OnceLock::new();
    RUN.get_or_init(|| {
        let mut launcher_args = TP2_PP2_DP2.to_vec();
        launcher_args.extend(["--steps", "6"]);
        record("sharedclean", &launcher_args, &["--hang-timeout", "2s"])
    })
}

fn flavor_index(flavor: &str) -> usize {
    match flavor {
        "nvidia" => 0,
        "ascend" => 1,
        other => panic!("no simulated flavor {other:?}"),
    }
}

/// `run_from_spawn` (a 2-rank job unless `launcher_args` say otherwise), its times to finding printed (for
/// the measurements chapter of the book, not graded), its folder removed at exit.
fn record(tag: &str, launcher_args: &[&str], agent_args: &[&str]) -> SimRun {
    let run = run_from_spawn(tag, launcher_args, agent_args);
    print_time_to_finding(tag, &run.tl, &run.ground_truth, None);
    remove_at_exit(run._dir.path().to_path_buf());
    run
}

/// Folders of the shared recordings: statics are never dropped, so their
/// [`xpuscope_tests::agent::TempDir`]s are removed by an exit handler
/// (kept, like every test's, when `XPUSCOPE_TEST_KEEP` is set).
static AT_EXIT: Mutex<Vec<std::path::PathBuf>> = Mutex::new(Vec::new());

fn remove_at_exit(dir: std::path::PathBuf) {
    extern "C" fn remove_all() {
        let keep = std::env::var_os("XPUSCOPE_TEST_KEEP").is_some();
        let dirs = std::mem::take(&mut *AT_EXIT.lock().unwrap_or_else(|e| e.into_inner()));
        for dir in dirs {
            if keep {
                eprintln!("kept {}", dir.display());
            } else {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
    let mut dirs = AT_EXIT.lock().unwrap_or_else(|e| e.into_inner());
    if dirs.is_empty() {
        // SAFETY: registers a handler that only touches this module's
        // static and the file system; it runs at `exit`.
        unsafe { libc::atexit(remove_all) };
    }
    dirs.push(dir);
}
