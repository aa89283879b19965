//! The simulated training job (tests/sim) on the stand-in device libraries:
//! collective semantics at job level, every fault kind visible in the
//! simulator's own step times and exit statuses, the ground truth, and the
//! Python and Ascend flavors.
//!
//! Each test runs `tests/sim/launch.py` under a guard that kills its whole
//! process group on drop. Every test holds the recording lock, so jobs do
//! not share the CPUs with each other or with a recording. Timing tests
//! compare within one run (before/after a step, or one rank against the
//! others) with wide margins: the machine is shared.

use std::collections::BTreeMap;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use serde_json::Value;
use xpuscope_tests::fixtures::{self, SIM_KERNELS};

/// One job at a time, and never beside a recording (the end-to-end tests
/// share one binary): the lock the recording tests take. The timing tests
/// compare step times; the others' ranks would take CPU from a recording.
fn timing_lock() -> MutexGuard<'static, ()> {
    xpuscope_tests::agent::exclusive()
}

/// Kills the launcher's process group (launcher, ranks, noisy neighbours).
struct GroupGuard(Option<Child>);

impl GroupGuard {
    fn wait_timeout(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let child = self.0.as_mut().expect("child present until drop");
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = child.try_wait().expect("try_wait on launcher") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let pgid = child.id() as libc::pid_t;
            // SAFETY: signalling a process group we created; no memory involved.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// A scratch directory removed on drop unless the test is failing.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("xpuscope-sim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        ScratchDir(dir)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            eprintln!("job output kept in {}", self.0.display());
        }
    }
}

/// A finished simulated job: its ground truth and every rank's step log.
struct Job {
    gt: Value,
    launcher_exit: Option<i32>,
    events: BTreeMap<u64, Vec<Value>>,
    wall: Duration,
    _dir: ScratchDir,
}

impl Job {
    fn status(&self) -> &str {
        self.gt["status"].as_str().unwrap_or("?")
    }

    fn rank(&self, r: u64) -> &Value {
        &self.gt["ranks"][r as usize]
    }

    /// The step records of rank `r`, in step order.
    fn steps(&self, r: u64) -> Vec<&Value> {
        self.events[&r]
            .iter()
            .filter(|e| e["event"] == "step")
            .collect()
    }

    fn step(&self, r: u64, step: u64) -> &Value {
        self.steps(r)
            .into_iter()
            .find(|e| e["step"] == step)
            .unwrap_or_else(|| panic!("rank {r} has no step {step}"))
    }

    fn ms(&self, r: u64, step: u64, field: &str) -> f64 {
        self.step(r, step)[field].as_f64().expect("numeric field") / 1e6
    }

    /// Median of `field` (ms) over steps [from, to) of rank `r`.
    fn median_ms(&self, r: u64, from: u64, to: u64, field: &str) -> f64 {
        let mut v: Vec<f64> = (from..to).map(|s| self.ms(r, s, field)).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    fn fault_events(&self, r: u64, kind: &str) -> Vec<&Value> {
        self.events[&r]
            .iter()
            .filter(|e| e["event"] == "fault" && e["kind"] == kind)
            .collect()
    }

    fn world(&self) -> u64 {
        self.gt["layout"]["world_size"].as_u64().unwrap()
    }
}

fn run_job(name: &str, args: &[&str], limit: Duration) -> Job {
    run_job_in(ScratchDir::new(name), name, args, limit)
}

fn run_job_in(dir: ScratchDir, name: &str, args: &[&str], limit: Duration) -> Job {
    let fixtures = fixtures::build_all();
    let launcher = fixtures::repo_root().join("tests/sim/launch.py");
    let start = Instant::now();
    let child = Command::new("python3")
        .arg(&launcher)
        .arg("--out-dir")
        .arg(&dir.0)
        .arg("--build-dir")
        .arg(fixtures.join("sim"))
        .arg("--job-name")
        .arg(format!("test-{name}"))
        .arg("--quiet")
        .args(args)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn python3 tests/sim/launch.py");
    let mut guard = GroupGuard(Some(child));
    let status = guard.wait_timeout(limit);
    let wall = start.elapsed();
    assert!(
        status.is_some(),
        "job {name} did not finish within {limit:?}"
    );
    drop(guard);
    let status = status.expect("checked above");
    let gt = read_json(&dir.0.join("ground_truth.json"));
    let mut events = BTreeMap::new();
    for r in gt["ranks"].as_array().expect("ranks array") {
        let rank = r["rank"].as_u64().expect("rank number");
        let log = dir.0.join(r["step_log"].as_str().expect("step_log name"));
        events.insert(rank, read_jsonl(&log));
    }
    Job {
        gt,
        launcher_exit: status.code().or(status.signal().map(|s| 128 + s)),
        events,
        wall,
        _dir: dir,
    }
}

fn read_json(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Kernels sleep for their encoded time on the compute stream, which the
/// rank synchronises every step: no step is shorter than its kernels. Fails
/// when the kernel encoding drifts from standin_kernel.h (kernels take 0 ns).
fn assert_kernels_took_their_time(job: &Job, r: u64) {
    for s in job.steps(r) {
        let (dur, kernels) = (s["dur_ns"].as_u64(), s["kernel_ns"].as_u64());
        assert!(
            dur >= kernels && kernels > Some(0),
            "rank {r} step {}: {dur:?} ns for {kernels:?} ns of kernels",
            s["step"]
        );
    }
}

fn rank_log(job: &Job, r: u64) -> String {
    let dir = job.gt["out_dir"].as_str().expect("out_dir");
    let name = job.rank(r)["log"].as_str().expect("log name");
    std::fs::read_to_string(Path::new(dir).join(name)).unwrap_or_default()
}

const LIMIT: Duration = Duration::from_secs(40);

// ---------------------------------------------------------------------------

#[test]
fn clean_8_rank_job_completes_with_full_ground_truth() {
    let _t = timing_lock();
    let job = run_job(
        "clean",
        &["--steps", "100", "--timeout", "60"],
        Duration::from_secs(90),
    );
    eprintln!(
        "clean 8 ranks x 100 steps (tp2 pp2 dp2, nvidia, C): {:.2} s wall, {:.2} s in ground truth",
        job.wall.as_secs_f64(),
        job.gt["clock"]["duration_s"].as_f64().unwrap_or(f64::NAN)
    );
    assert_eq!(
        job.status(),
        "completed",
        "ground truth: {:#}",
        job.gt["ranks"]
    );
    assert_eq!(job.launcher_exit, Some(0));

    let gt = &job.gt;
    assert_eq!(gt["schema"], "xpuscope-sim-ground-truth/1");
    assert_eq!(gt["flavor"], "nvidia");
    assert_eq!(gt["lang"], "c");
    assert_eq!(gt["job"], "test-clean");
    assert_eq!(gt["env"]["XPUSCOPE_JOB"], "test-clean");
    for key in ["world_size", "tp", "pp", "dp"] {
        assert!(gt["layout"][key].is_u64(), "layout.{key}");
    }
    assert_eq!(
        (
            gt["layout"]["tp"].as_u64(),
            gt["layout"]["pp"].as_u64(),
            gt["layout"]["dp"].as_u64()
        ),
        (Some(2), Some(2), Some(2))
    );
    // Communicators: 4 TP pairs, 4 DP pairs, 4 PP stage pairs, every rank in
    // one TP, one DP and one PP communicator.
    let comms = gt["communicators"].as_array().expect("communicators");
    let count = |kind: &str| comms.iter().filter(|c| c["kind"] == kind).count();
    assert_eq!((count("tp"), count("dp"), count("pp")), (4, 4, 4));
    assert_eq!(comms[0]["name"], "tp0");
    assert_eq!(comms[0]["members"], serde_json::json!([0, 1]));
    let dp0 = comms.iter().find(|c| c["name"] == "dp0").expect("dp0");
    assert_eq!(dp0["members"], serde_json::json!([0, 2]));
    let pp0 = comms
        .iter()
        .find(|c| c["name"] == "pp0.0-1")
        .expect("pp0.0-1");
    assert_eq!(pp0["members"], serde_json::json!([0, 4]));

    for r in 0..8 {
        let rank = job.rank(r);
        assert_eq!(rank["rank"], r);
        assert!(rank["pid"].as_u64().unwrap_or(0) > 0);
        assert!(rank["cpu"].is_u64(), "ranks are pinned");
        assert_eq!(rank["comms"].as_array().map(Vec::len), Some(3));
        assert_eq!(rank["exit"]["returncode"], 0);
        assert_eq!(rank["exit"]["status"], "ok");
        assert!(rank["exit"]["boot_ns"].as_u64().unwrap_or(0) > 0);
        assert_eq!(rank["steps_completed"], 100);
        assert_eq!(rank["last_step_completed"], 99);
        let steps = job.steps(r);
        assert_eq!(steps.len(), 100);
        // Kernels of the step are accounted; the CUPTI consumer read records.
        assert!(
            steps
                .iter()
                .all(|s| s["kernel_ns"].as_u64().unwrap_or(0) > 0)
        );
        let records: u64 = steps
            .iter()
            .map(|s| s["activity_records"].as_u64().unwrap_or(0))
            .sum();
        assert!(records > 0, "rank {r}: no CUPTI records drained");
        assert_kernels_took_their_time(&job, r);
    }
    let launch = gt["clock"]["launch"]["boot_ns"]
        .as_u64()
        .expect("launch boot_ns");
    let end = gt["clock"]["end"]["boot_ns"].as_u64().expect("end boot_ns");
    assert!(gt["clock"]["launch"]["real_ns"].as_u64().unwrap_or(0) > 1_600_000_000_000_000_000);
    let first = job.step(0, 0)["start_boot_ns"].as_u64().unwrap();
    assert!(
        launch < first && first < end,
        "step times are CLOCK_BOOTTIME like the launcher's"
    );
    assert!(gt["faults"].as_array().is_some_and(Vec::is_empty));
    assert!(gt["hang"].is_null());
}

#[test]
fn ranks_of_a_collective_finish_it_together() {
    // A DP all-reduce completes only when both ranks arrived: with rank 1
    // arriving 400 ms late at step 5, rank 0 waits inside the all-reduce.
    let _t = timing_lock();
    let job = run_job(
        "late",
        &[
            "--world-size",
            "4",
            "--dp",
            "4",
            "--steps",
            "12",
            "--fault",
            "delay:rank=1,step=5,ms=400",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "completed");
    let ev = job.fault_events(1, "delay");
    assert_eq!(ev.len(), 1, "one delay injected");
    assert_eq!(ev[0]["comm"], "dp0");
    assert_eq!(
        ev[0]["seq"], 6,
        "broadcast at start-up, then one all-reduce per step"
    );
    let fault = &job.gt["faults"][0];
    assert_eq!(fault["expected"]["comm"], "dp0");
    assert_eq!(fault["expected"]["seq"], 6);
    assert_eq!(
        fault["expected"]["waiting_ranks"],
        serde_json::json!([0, 2, 3])
    );
    assert_eq!(fault["injected"].as_array().map(Vec::len), Some(1));
    for r in [0, 2, 3] {
        let base = job.median_ms(r, 1, 5, "grad_sync_ns");
        let late = job.ms(r, 5, "grad_sync_ns");
        assert!(
            late > base + 300.0 && late < base + 1000.0,
            "rank {r} waited {late:.1} ms in the step-5 all-reduce (usually {base:.1} ms)"
        );
        let step = job.ms(r, 5, "dur_ns");
        assert!(step > 380.0, "rank {r} step 5 took {step:.1} ms");
    }
    // The late rank itself did not wait in the collective: everyone was there.
    let own = job.ms(1, 5, "grad_sync_ns");
    assert!(
        own > 380.0,
        "the late rank's grad sync includes its own lateness: {own:.1} ms"
    );
    let others: Vec<f64> = [0, 2, 3]
        .iter()
        .map(|&r| job.step(r, 5)["end_boot_ns"].as_f64().unwrap())
        .collect();
    let mine = job.step(1, 5)["end_boot_ns"].as_f64().unwrap();
    for end in others {
        assert!((end - mine).abs() < 100e6, "ranks finish step 5 together");
    }
}

#[test]
fn a_missing_rank_hangs_the_others_until_the_timeout() {
    let _serial = timing_lock();
    let job = run_job(
        "hang",
        &[
            "--world-size",
            "4",
            "--dp",
            "4",
            "--steps",
            "50",
            "--timeout",
            "3",
            "--fault",
            "hang:rank=2,step=10",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "hung");
    assert_eq!(job.launcher_exit, Some(124));
    let hang = &job.gt["hang"];
    assert_eq!(hang["detected_by"], "timeout");
    assert_eq!(hang["ranks_alive"], serde_json::json!([0, 1, 2, 3]));
    assert!(hang["boot_ns"].as_u64().is_some());
    let ev = job.fault_events(2, "hang");
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0]["comm"].as_str(), ev[0]["seq"].as_u64()),
        (Some("dp0"), Some(11))
    );
    for r in 0..4 {
        let rank = job.rank(r);
        assert_eq!(rank["status"], "hung", "rank {r}");
        assert_eq!(rank["exit"]["killed_by_launcher"], "timeout");
        // Step 10 began everywhere and completed nowhere.
        assert_eq!(rank["last_step_completed"], 9, "rank {r}");
        assert_eq!(rank["last_step_begun"], 10, "rank {r}");
    }
}

#[test]
fn a_hang_inside_the_collective_library_blocks_every_rank() {
    let _serial = timing_lock();
    // STANDIN_NCCL_HANG_AT_SEQ: rank 1 blocks inside its 4th collective
    // (seq 3: the broadcast, then the all-reduces of steps 0, 1, 2).
    let job = run_job(
        "hang-inside",
        &[
            "--world-size",
            "2",
            "--dp",
            "2",
            "--steps",
            "20",
            "--timeout",
            "2.5",
            "--fault",
            "hang_inside:rank=1,seq=3",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "hung");
    let ev = job.fault_events(1, "hang_inside");
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0]["step"], 2);
    assert_eq!(job.rank(1)["env"]["STANDIN_NCCL_HANG_AT_SEQ"], "3");
    for r in 0..2 {
        assert_eq!(job.rank(r)["last_step_completed"], 1, "rank {r}");
        assert_eq!(job.rank(r)["last_step_begun"], 2, "rank {r}");
    }
}

/// A host-bound rank: its main thread's host work grows by the injected
/// milliseconds from the fault's step (C and Python ranks), and its peers
/// wait for it in the gradient all-reduce.
#[test]
fn host_work_grows_the_rank_s_host_time_and_its_peers_wait() {
    let _t = timing_lock();
    for lang in ["c", "python"] {
        let job = run_job(
            &format!("hostwork{lang}"),
            &[
                "--lang",
                lang,
                "--world-size",
                "2",
                "--steps",
                "12",
                "--fault",
                "host_work:rank=1,ms=60,from_step=6",
            ],
            LIMIT,
        );
        assert_eq!(job.status(), "completed", "{lang}");
        let events = job.fault_events(1, "host_work");
        assert_eq!(events.len(), 1, "{lang}");
        assert_eq!(events[0]["step"], 6, "{lang}");
        let before = job.median_ms(1, 2, 6, "host_ns");
        let after = job.median_ms(1, 7, 12, "host_ns");
        assert!(
            (after - before - 60.0).abs() < 15.0,
            "{lang}: rank 1's host work {before:.1} -> {after:.1} ms"
        );
        let wait = job.median_ms(0, 7, 12, "grad_sync_ns");
        assert!(wait > 40.0, "{lang}: rank 0 waits {wait:.1} ms for rank 1");
    }
}

#[test]
fn a_slow_rank_slows_its_compute_and_everyone_s_steps() {
    let _t = timing_lock();
    let job = run_job(
        "slow",
        &[
            "--world-size",
            "4",
            "--dp",
            "4",
            "--steps",
            "30",
            "--kernel-us",
            "800",
            "--fault",
            "slow:rank=3,factor=3,from_step=15",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "completed");
    assert_eq!(job.fault_events(3, "slow").len(), 1);
    assert_eq!(job.fault_events(3, "slow")[0]["step"], 15);
    // The slow rank's own kernels take 3x (planned device time).
    let k_before = job.median_ms(3, 5, 15, "kernel_ns");
    let k_after = job.median_ms(3, 16, 30, "kernel_ns");
    assert!(
        (k_after / k_before - 3.0).abs() < 0.01,
        "{k_before} -> {k_after}"
    );
    for r in 0..4 {
        let before = job.median_ms(r, 5, 15, "dur_ns");
        let after = job.median_ms(r, 16, 30, "dur_ns");
        // No step can be shorter than the slow rank's kernels (they sleep),
        // and before the fault steps were clearly shorter than that.
        assert!(
            after >= 0.98 * k_after && after > 1.4 * before,
            "rank {r}: step time {before:.1} -> {after:.1} ms (slow rank's kernels {k_after:.1} ms)"
        );
        if r != 3 {
            // Peers' kernels are unchanged: they spend the time waiting in the all-reduce.
            assert!((job.median_ms(r, 16, 30, "kernel_ns") - k_before).abs() < 0.01);
            let wait = job.median_ms(r, 16, 30, "grad_sync_ns");
            assert!(
                wait > 0.5 * (after - before),
                "rank {r} waits {wait:.1} ms in grad sync"
            );
        }
    }
}

/// The state file the rank writes for its GPU (`standin_nvml.h`): `key`'s
/// values.
fn gpu_state(job: &Job, gpu: u64, key: &str) -> Vec<u64> {
    let dir = job.gt["nvml_dir"].as_str().expect("nvml_dir");
    let text = std::fs::read_to_string(Path::new(dir).join(format!("gpu{gpu}")))
        .expect("the GPU's state file");
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v.parse().expect("a number"))
        .collect()
}

#[test]
fn a_throttled_gpu_slows_its_rank_s_kernels_and_shows_in_its_nvml_state() {
    let _t = timing_lock();
    for lang in ["c", "python"] {
        throttle_and_xid(lang);
    }
}

fn throttle_and_xid(lang: &str) {
    let job = run_job(
        &format!("throttle-{lang}"),
        &[
            "--lang",
            lang,
            "--world-size",
            "2",
            "--dp",
            "2",
            "--steps",
            "20",
            "--kernel-us",
            "800",
            "--fault",
            "throttle:rank=1,mhz=495,from_step=10",
            "--fault",
            "xid:rank=0,code=48,step=5",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "completed");
    assert_eq!(job.fault_events(1, "throttle")[0]["step"], 10);
    assert_eq!(job.fault_events(1, "throttle")[0]["mhz"], 495);
    assert_eq!(job.fault_events(0, "xid")[0]["step"], 5);
    // 1980 / 495 = 4x the kernel time, its peer's unchanged.
    let before = job.median_ms(1, 2, 10, "kernel_ns");
    let after = job.median_ms(1, 11, 20, "kernel_ns");
    assert!((after / before - 4.0).abs() < 0.01, "{before} -> {after}");
    assert!((job.median_ms(0, 11, 20, "kernel_ns") - before).abs() < 0.01);
    // What the stand-in NVML reads: GPU 1 at 495 MHz, thermal; GPU 0's Xid.
    assert_eq!(gpu_state(&job, 1, "sm_mhz"), [495]);
    assert_eq!(gpu_state(&job, 1, "max_sm_mhz"), [1980]);
    assert_eq!(gpu_state(&job, 1, "reasons"), [0x20]);
    assert_eq!(gpu_state(&job, 0, "xid"), [48]);
    assert_eq!(gpu_state(&job, 0, "sm_mhz"), [1980]);
    // The ranks exited: no process on either GPU.
    assert!(gpu_state(&job, 0, "pid").is_empty() && gpu_state(&job, 1, "pid").is_empty());
    let truth = job.gt["faults"].as_array().expect("faults");
    let t = truth
        .iter()
        .find(|f| f["kind"] == "throttle")
        .expect("throttle");
    assert_eq!(t["expected"]["throttled_rank"], 1);
    assert_eq!(t["expected"]["gpu"], 1);
    assert_eq!(t["expected"]["compute_factor"], 4.0);
    let x = truth.iter().find(|f| f["kind"] == "xid").expect("xid");
    assert_eq!(
        (&x["expected"]["xid"], &x["expected"]["step"]),
        (&48.into(), &5.into())
    );
}

/// The state file an Ascend rank writes for its NPU (`standin_dcmi.h`):
/// `key`'s values.
fn npu_state(job: &Job, npu: u64, key: &str) -> Vec<u64> {
    let dir = job.gt["dcmi_dir"].as_str().expect("dcmi_dir");
    let text = std::fs::read_to_string(Path::new(dir).join(format!("npu{npu}")))
        .expect("the NPU's state file");
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v.parse().expect("a number"))
        .collect()
}

#[test]
fn an_ascend_throttle_and_error_code_show_in_the_npu_s_dcmi_state() {
    let _t = timing_lock();
    for lang in ["c", "python"] {
        let job = run_job(
            &format!("npu-throttle-{lang}"),
            &[
                "--flavor",
                "ascend",
                "--lang",
                lang,
                "--world-size",
                "2",
                "--dp",
                "2",
                "--steps",
                "20",
                "--kernel-us",
                "800",
                "--fault",
                "throttle:rank=1,mhz=495,from_step=10",
                "--fault",
                "xid:rank=0,code=2162169857,step=5",
            ],
            LIMIT,
        );
        assert_eq!(job.status(), "completed", "{lang}");
        assert_eq!(job.fault_events(1, "throttle")[0]["step"], 10);
        assert_eq!(job.fault_events(0, "xid")[0]["step"], 5);
        let before = job.median_ms(1, 2, 10, "kernel_ns");
        let after = job.median_ms(1, 11, 20, "kernel_ns");
        assert!(
            (after / before - 4.0).abs() < 0.01,
            "{lang}: {before} -> {after}"
        );
        // What the stand-in DCMI reads: NPU 1 at 495 MHz with no reason,
        // NPU 0's error code and major alarm.
        assert_eq!(npu_state(&job, 1, "aicore_mhz"), [495], "{lang}");
        assert_eq!(npu_state(&job, 1, "max_aicore_mhz"), [1980], "{lang}");
        assert_eq!(npu_state(&job, 1, "health"), [0], "{lang}");
        assert_eq!(npu_state(&job, 0, "error_code"), [0x80E0_1801], "{lang}");
        assert_eq!(npu_state(&job, 0, "health"), [2], "{lang}");
        assert!(
            npu_state(&job, 0, "pid").is_empty() && npu_state(&job, 1, "pid").is_empty(),
            "{lang}: the ranks exited"
        );
        assert!(job.gt["nvml_dir"].is_null(), "{lang}");
        let truth = job.gt["faults"].as_array().expect("faults");
        let t = truth
            .iter()
            .find(|f| f["kind"] == "throttle")
            .expect("throttle");
        assert!(t["expected"]["reason"].is_null(), "{lang}: {t}");
        let x = truth.iter().find(|f| f["kind"] == "xid").expect("xid");
        assert_eq!(x["expected"]["device"], "NPU", "{lang}: {x}");
    }
}

#[test]
fn a_dataloader_stall_delays_that_step_on_every_rank() {
    let _t = timing_lock();
    let job = run_job(
        "stall",
        &[
            "--world-size",
            "2",
            "--dp",
            "2",
            "--steps",
            "16",
            "--fault",
            "dataloader_stall:rank=1,step=10,ms=500",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "completed");
    assert_eq!(job.fault_events(1, "dataloader_stall").len(), 1);
    let wait = job.ms(1, 10, "data_wait_ns");
    let usual = job.median_ms(1, 2, 9, "data_wait_ns");
    // Prefetch (2 batches) hides at most two steps of the stall.
    let step = job.median_ms(1, 2, 9, "dur_ns");
    assert!(
        wait > 500.0 - 3.0 * step - 50.0,
        "rank 1 waited {wait:.1} ms for batch 10"
    );
    assert!(usual < 20.0, "usual data wait {usual:.1} ms");
    let peer_wait = job.ms(0, 10, "grad_sync_ns");
    assert!(
        peer_wait > 0.7 * wait,
        "rank 0 waited {peer_wait:.1} ms for rank 1 in step 10"
    );
    assert!(
        job.ms(0, 10, "data_wait_ns") < 20.0,
        "rank 0's own loader was not stalled"
    );
}

#[test]
fn cpu_contention_slows_the_contended_rank_and_its_peers() {
    // Three spinners on rank 1's CPU: its stream workers and main thread
    // wait for the CPU after every wake-up, so its own compute phases
    // stretch; rank 0 (the other CPU) only waits longer for it.
    let _t = timing_lock();
    let job = run_job(
        "contention",
        &[
            "--world-size",
            "2",
            "--dp",
            "2",
            "--steps",
            "40",
            "--fault",
            "cpu_contention:rank=1,from_step=20,threads=3",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "completed");
    let fault = &job.gt["faults"][0];
    let injected = &fault["injected"][0];
    assert!(injected["neighbour_pid"].as_u64().is_some());
    assert!(injected["boot_ns"].as_u64().is_some());
    assert!(injected["stopped"]["boot_ns"].as_u64().is_some());
    let cpu = job.rank(1)["cpu"].as_u64().expect("rank 1 pinned");
    assert_ne!(
        job.rank(0)["cpu"].as_u64(),
        Some(cpu),
        "ranks on different CPUs"
    );
    assert_eq!(fault["expected"]["cpu"], cpu);
    assert_eq!(fault["expected"]["ranks_on_cpu"], serde_json::json!([1]));
    let trigger = injected["step"].as_u64().expect("trigger step");
    assert!(
        (20..25).contains(&trigger),
        "neighbour started at step {trigger}"
    );
    let from = trigger + 2;
    let own = |r: u64, a: u64, b: u64| {
        job.median_ms(r, a, b, "fwd_ns") + job.median_ms(r, a, b, "bwd_ns")
    };
    let (before, after) = (own(1, 5, 20), own(1, from, 40));
    assert!(
        after > 1.5 * before,
        "rank 1 forward+backward {before:.1} -> {after:.1} ms with 3 spinners on CPU {cpu}"
    );
    assert!(
        own(0, from, 40) < after,
        "the contended rank is the slow one: rank 0 {:.1} ms, rank 1 {after:.1} ms",
        own(0, from, 40)
    );
    for r in 0..2 {
        let step_before = job.median_ms(r, 5, 20, "dur_ns");
        let step_after = job.median_ms(r, from, 40, "dur_ns");
        assert!(
            step_after > 1.5 * step_before,
            "rank {r} step time {step_before:.1} -> {step_after:.1} ms"
        );
    }
}

#[test]
fn a_slow_link_stretches_the_collectives_of_that_rank() {
    let _t = timing_lock();
    let common = [
        "--world-size",
        "2",
        "--dp",
        "2",
        "--steps",
        "12",
        "--grad-mb",
        "32",
        "--bw-gbps",
        "10",
    ];
    let clean = run_job("link-clean", &common, LIMIT);
    let mut args = common.to_vec();
    args.extend(["--fault", "slow_link:rank=1,factor=5"]);
    let slow = run_job("link-slow", &args, LIMIT);
    assert_eq!((clean.status(), slow.status()), ("completed", "completed"));
    assert_eq!(slow.rank(1)["env"]["STANDIN_LINK_SLOWDOWN"], "5.0");
    assert_eq!(
        slow.gt["faults"][0]["expected"]["affected_comms"],
        serde_json::json!(["dp0"])
    );
    // A 32 MiB all-reduce over 2 ranks at 10 GB/s transfers for about
    // 3.4 ms (the stand-in's bytes * 2(n-1)/n / bandwidth); 5x: about 17 ms,
    // a floor that load on the machine can only raise.
    let transfer = (32u64 << 20) as f64 / 10e9 * 1e3;
    for r in 0..2 {
        let base = clean.median_ms(r, 2, 12, "grad_sync_ns");
        let slowed = slow.median_ms(r, 2, 12, "grad_sync_ns");
        assert!(
            slowed >= 0.98 * 5.0 * transfer && slowed > base + 0.6 * 4.0 * transfer,
            "rank {r}: all-reduce {base:.1} -> {slowed:.1} ms with a 5x slower link"
        );
    }
}

#[test]
fn a_device_memory_leak_ends_in_oom_at_the_expected_step() {
    let _serial = timing_lock();
    let job = run_job(
        "oom",
        &[
            "--world-size",
            "2",
            "--dp",
            "2",
            "--steps",
            "40",
            "--device-mem-mb",
            "512",
            "--fault",
            "mem_leak:rank=1,mb=48,from_step=3",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "failed");
    assert_eq!(job.launcher_exit, Some(1));
    let expected = &job.gt["faults"][0]["expected"];
    let baseline = expected["baseline_bytes"]
        .as_u64()
        .expect("baseline from the rank");
    let oom_step = expected["oom_step"].as_u64().expect("expected OOM step");
    assert_eq!(oom_step, 3 + ((512u64 << 20) - baseline) / (48 << 20));
    let oom: Vec<&Value> = job.events[&1]
        .iter()
        .filter(|e| e["event"] == "oom")
        .collect();
    assert_eq!(oom.len(), 1, "one OOM logged");
    assert_eq!(oom[0]["step"], oom_step);
    assert_eq!(oom[0]["status"], 2, "cudaErrorMemoryAllocation");
    assert!(rank_log(&job, 1).contains(&format!("out of memory at step {oom_step}")));
    let r1 = job.rank(1);
    assert_eq!(
        (r1["status"].as_str(), r1["exit"]["exit_code"].as_u64()),
        (Some("failed"), Some(1))
    );
    assert_eq!(r1["last_step_completed"], oom_step - 1);
    // torchrun-like: the launcher then stops the peer that waits for rank 1.
    assert_eq!(job.rank(0)["status"], "terminated");
    assert_eq!(job.gt["first_failure"]["rank"], 1);
}

#[test]
fn a_crash_is_recorded_with_its_signal() {
    let _serial = timing_lock();
    let job = run_job(
        "crash",
        &[
            "--world-size",
            "4",
            "--steps",
            "30",
            "--fault",
            "crash:rank=2,step=7,signal=SIGSEGV",
        ],
        LIMIT,
    );
    assert_eq!(job.status(), "failed");
    let r2 = job.rank(2);
    assert_eq!(r2["status"], "crashed");
    assert_eq!(r2["exit"]["signal"], 11);
    assert_eq!(r2["exit"]["signal_name"], "SIGSEGV");
    assert_eq!(r2["exit"]["returncode"], -11);
    assert!(r2["exit"]["killed_by_launcher"].is_null());
    assert_eq!(r2["last_step_completed"], 6);
    let ev = job.fault_events(2, "crash");
    assert_eq!((ev.len(), ev[0]["signal"].as_u64()), (1, Some(11)));
    let truth = &job.gt["faults"][0];
    assert_eq!(truth["expected"]["signal_name"], "SIGSEGV");
    assert_eq!(truth["injected"][0]["step"], 7);
    for r in [0, 1, 3] {
        assert_eq!(job.rank(r)["status"], "terminated", "rank {r}");
        assert_eq!(job.rank(r)["exit"]["killed_by_launcher"], "peer_failure");
    }
}

#[test]
fn python_flavor_runs_train_step_through_ctypes() {
    let _serial = timing_lock();
    for flavor in ["nvidia", "ascend"] {
        let job = run_job(
            &format!("python-{flavor}"),
            &[
                "--lang",
                "python",
                "--flavor",
                flavor,
                "--world-size",
                "4",
                "--steps",
                "8",
            ],
            LIMIT,
        );
        assert_eq!(job.status(), "completed", "{flavor}: {:#}", job.gt["ranks"]);
        assert_eq!(job.gt["lang"], "python");
        for r in 0..job.world() {
            assert_eq!(job.rank(r)["steps_completed"], 8);
            assert!(
                job.rank(r)["argv"][1]
                    .as_str()
                    .is_some_and(|a| a.ends_with("rank.py"))
            );
            let init = &job.events[&r][0];
            assert_eq!(
                (init["event"].as_str(), init["lang"].as_str()),
                (Some("init"), Some("python"))
            );
            let records: u64 = job
                .steps(r)
                .iter()
                .map(|s| s["activity_records"].as_u64().unwrap_or(0))
                .sum();
            assert!(
                records > 0,
                "{flavor} rank {r}: the activity consumer read no records"
            );
            assert_kernels_took_their_time(&job, r);
        }
    }
}

/// `--driver-launches` (and, on NVIDIA, `--expandable-segments`) make the
/// Python ranks launch and map below the runtime as the C ranks do: step
/// lines with the same fields, the same launches of each kind, kernel time,
/// mapped bytes and memory at every step, and the same ground truth.
#[test]
fn python_ranks_launch_and_map_below_the_runtime_as_c_ranks_do() {
    let _t = timing_lock();
    for (flavor, extra) in [("nvidia", &["--expandable-segments"][..]), ("ascend", &[])] {
        let [c, python] = ["c", "python"].map(|lang| {
            let args = [
                &["--lang", lang, "--flavor", flavor, "--world-size", "2"][..],
                &["--steps", "4", "--driver-launches"],
                extra,
            ]
            .concat();
            run_job(&format!("below-{flavor}-{lang}"), &args, LIMIT)
        });
        for job in [&c, &python] {
            assert_eq!(job.status(), "completed", "{flavor}: {:#}", job.gt["ranks"]);
            assert_eq!(job.gt["driver"]["driver_launches"], true);
        }
        for r in 0..2 {
            let what = format!("{flavor} rank {r}");
            let (ct, pt) = (c.rank(r), python.rank(r));
            assert!(ct["launches"]["driver"].as_u64() > Some(0), "{what}: {ct}");
            assert_eq!(ct["launches"], pt["launches"], "{what}");
            assert_eq!(ct["segment_bytes"], pt["segment_bytes"], "{what}");
            let mapped = ct["segment_bytes"].as_array().expect("segment_bytes");
            assert_eq!(
                mapped.iter().any(|b| b.as_u64() > Some(0)),
                flavor == "nvidia",
                "{what}: {mapped:?}"
            );
            let (cs, ps) = (c.steps(r), python.steps(r));
            assert_eq!(cs.len(), 4, "{what}");
            assert_eq!(cs.len(), ps.len(), "{what}");
            for (a, b) in cs.iter().zip(&ps) {
                let fields =
                    |s: &Value| s.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>());
                assert_eq!(fields(a), fields(b), "{what}");
                for f in [
                    "kernel_ns",
                    "mem_bytes",
                    "segment_bytes",
                    "runtime_launches",
                    "driver_launches",
                    "graph_launches",
                ] {
                    assert_eq!(a[f], b[f], "{what} {f}: {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn ascend_flavor_runs_on_acl_hccl_and_mspti() {
    let _t = timing_lock();
    let job = run_job("ascend", &["--flavor", "ascend", "--steps", "20"], LIMIT);
    assert_eq!(job.status(), "completed", "{:#}", job.gt["ranks"]);
    assert_eq!(job.gt["flavor"], "ascend");
    assert_eq!(job.gt["env"]["RANK_SIZE"], "8");
    for r in 0..8 {
        assert_eq!(job.rank(r)["steps_completed"], 20);
        let records: u64 = job
            .steps(r)
            .iter()
            .map(|s| s["activity_records"].as_u64().unwrap_or(0))
            .sum();
        assert!(records > 0, "rank {r}: no MSPTI records drained");
        assert_kernels_took_their_time(&job, r);
        assert!(
            job.events[&r]
                .iter()
                .any(|e| e["event"] == "comm_init" && e["status"] == 0)
        );
    }
}

/// `--activity-log` writes every record a rank's CUPTI/MSPTI consumer read
/// (as many as its steps report); `--activity-api` adds the host API
/// records, one per launch with the kernel's correlation id, from the
/// rank's own process, starting before its kernel. The C and Python ranks
/// read the same records; without `--activity-api` there are none of the
/// API kind.
#[test]
fn activity_log_has_api_records_linking_kernels_to_launches() {
    let _serial = timing_lock();
    let kinds_of = |job: &Job, r: u64| -> Vec<Value> {
        let dir = job.gt["out_dir"].as_str().expect("out_dir");
        let name = job.rank(r)["activity_log"]
            .as_str()
            .expect("activity_log name");
        let log = read_jsonl(&Path::new(dir).join(name));
        let drained: u64 = job
            .steps(r)
            .iter()
            .map(|s| s["activity_records"].as_u64().unwrap_or(0))
            .sum();
        assert_eq!(
            log.len() as u64,
            drained,
            "rank {r}: one line per record read"
        );
        log
    };
    let steps = 2u64;
    let base = [
        "--world-size",
        "2",
        "--dp",
        "2",
        "--tp",
        "1",
        "--pp",
        "1",
        "--steps",
        "2",
    ];
    for flavor in ["nvidia", "ascend"] {
        let launch_api = |a: &Value| match flavor {
            "nvidia" => a["cbid"] == 211, // cudaLaunchKernel_v7000
            _ => a["name"] == "aclrtLaunchKernel",
        };
        let mut by_lang = BTreeMap::new();
        for lang in ["c", "python"] {
            let name = format!("actlog-{flavor}-{lang}");
            let mut args = base.to_vec();
            args.extend([
                "--flavor",
                flavor,
                "--lang",
                lang,
                "--activity-api",
                "--activity-log",
            ]);
            let job = run_job(&name, &args, LIMIT);
            assert_eq!(job.status(), "completed", "{name}: {:#}", job.gt["ranks"]);
            assert_eq!(job.gt["activity"]["api_records"], true);
            for r in 0..2 {
                let log = kinds_of(&job, r);
                let pid = job.rank(r)["pid"].as_u64().expect("pid");
                let api: BTreeMap<u64, &Value> = log
                    .iter()
                    .filter(|a| a["kind"] == "api")
                    .map(|a| (a["correlation"].as_u64().expect("correlation"), a))
                    .collect();
                let kernels: Vec<&Value> = log
                    .iter()
                    .filter(|k| k["kind"] == "kernel")
                    .filter(|k| SIM_KERNELS.iter().any(|n| k["name"] == *n))
                    .collect();
                // Forward and backward kernels per microbatch and layer, and
                // the optimizer's (workload defaults: 2, 3, 2).
                assert_eq!(
                    kernels.len() as u64,
                    steps * (2 * 3 * 2 + 2),
                    "{name} rank {r}"
                );
                for k in kernels {
                    let corr = k["correlation"].as_u64().expect("kernel correlation");
                    let a = api
                        .get(&corr)
                        .unwrap_or_else(|| panic!("{name} rank {r}: no API record for {k}"));
                    assert!(launch_api(a), "{name} rank {r}: {k} from {a}");
                    assert_eq!(a["pid"].as_u64(), Some(pid), "{a}");
                    assert!(a["start"].as_u64() <= k["start"].as_u64(), "{a} {k}");
                }
                let mut kinds: Vec<String> = log
                    .iter()
                    .map(|x| format!("{} {} {}", x["kind"], x["name"], x["cbid"]))
                    .collect();
                kinds.sort();
                by_lang.entry(r).or_insert_with(Vec::new).push(kinds);
            }
        }
        for (r, runs) in by_lang {
            assert_eq!(
                runs[0], runs[1],
                "{flavor} rank {r}: C and Python read alike"
            );
        }
    }
    let mut args = base.to_vec();
    args.push("--activity-log");
    let job = run_job("actlog-noapi", &args, LIMIT);
    assert_eq!(job.status(), "completed", "{:#}", job.gt["ranks"]);
    assert_eq!(job.gt["activity"]["api_records"], false);
    for r in 0..2 {
        let log = kinds_of(&job, r);
        assert!(log.iter().any(|x| x["kind"] == "kernel"), "rank {r}");
        assert!(
            !log.iter().any(|x| x["kind"] == "api"),
            "rank {r}: API records off"
        );
    }
}

fn boot_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[test]
fn ranks_wait_at_a_start_gate_until_an_agent_opens_it() {
    let _serial = timing_lock();
    // What an agent does: read the pids from the ground truth written at
    // start, wait until every rank is ready (libraries loaded, communicators
    // up), attach, then open the gate.
    let dir = ScratchDir::new("gate");
    let out = dir.0.clone();
    let gate = out.join("go");
    let gate_arg = gate.to_str().expect("utf-8 path").to_owned();
    let opener = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(Instant::now() < deadline, "ranks never became ready");
            let gt: Option<Value> = std::fs::read_to_string(out.join("ground_truth.json"))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
            let ready = gt.as_ref().is_some_and(|gt| {
                gt["status"] == "running"
                    && gt["ranks"].as_array().is_some_and(|ranks| {
                        ranks.iter().all(|r| {
                            r["pid"].is_u64()
                                && read_jsonl(&out.join(r["step_log"].as_str().unwrap_or("-")))
                                    .iter()
                                    .any(|e| e["event"] == "ready")
                        })
                    })
            });
            if ready {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        let opened = boot_ns();
        std::fs::write(&gate, b"").expect("open the gate");
        opened
    });
    let job = run_job_in(
        dir,
        "gate",
        &[
            "--world-size",
            "2",
            "--steps",
            "3",
            "--start-gate",
            &gate_arg,
        ],
        LIMIT,
    );
    let opened = opener.join().expect("gate opener");
    assert_eq!(job.status(), "completed");
    for r in 0..2 {
        let ready = job.rank(r)["ready"]["boot_ns"].as_u64().expect("ready");
        let start = job.rank(r)["start"]["boot_ns"].as_u64().expect("start");
        assert!(
            ready + 300_000_000 < opened,
            "rank {r} was ready before the gate opened"
        );
        assert!(
            start >= opened,
            "rank {r} started training after the gate opened"
        );
        let first = job.step(r, 0)["start_boot_ns"].as_u64().expect("step 0");
        assert!(first >= start);
    }
}

// ---------------------------------------------------------------------------
// Several "nodes": one launcher per node, started on its own, meeting in a
// shared rendezvous directory.

/// A finished multi-node job: the job's ground truth and each node's.
struct NodesJob {
    job: Value,
    nodes: Vec<Value>,
    exits: Vec<Option<i32>>,
    _dir: ScratchDir,
}

/// Starts `nnodes` launchers of one job (each in its own process group, as
/// on separate machines), `node-<k>` as each node's hostname.
fn run_nodes(name: &str, nnodes: usize, args: &[&str], limit: Duration) -> NodesJob {
    let dir = ScratchDir::new(name);
    let fixtures = fixtures::build_all();
    let launcher = fixtures::repo_root().join("tests/sim/launch.py");
    let rdv = dir.0.join("rdv");
    let mut guards: Vec<GroupGuard> = (0..nnodes)
        .map(|k| {
            let child = Command::new("python3")
                .arg(&launcher)
                .arg("--build-dir")
                .arg(fixtures.join("sim"))
                .args(["--quiet", "--nnodes", &nnodes.to_string()])
                .args(["--node-rank", &k.to_string()])
                .args(["--node-name", &format!("node-{k}")])
                .arg("--rdv-dir")
                .arg(&rdv)
                .args(args)
                .stdin(Stdio::null())
                .process_group(0)
                .spawn()
                .expect("spawn python3 tests/sim/launch.py");
            GroupGuard(Some(child))
        })
        .collect();
    let exits = guards
        .iter_mut()
        .enumerate()
        .map(|(k, g)| {
            let status = g.wait_timeout(limit);
            assert!(
                status.is_some(),
                "node {k} of {name} still running after {limit:?}"
            );
            status.and_then(|s| s.code().or(s.signal().map(|sig| 128 + sig)))
        })
        .collect();
    drop(guards);
    let job = read_json(&rdv.join("ground_truth.json"));
    let nodes = (0..nnodes)
        .map(|k| read_json(&rdv.join(format!("node{k}")).join("ground_truth.json")))
        .collect();
    NodesJob {
        job,
        nodes,
        exits,
        _dir: dir,
    }
}

fn step_events(node_gt: &Value, rank: &Value) -> Vec<Value> {
    let dir = Path::new(node_gt["out_dir"].as_str().expect("out_dir"));
    read_jsonl(&dir.join(rank["step_log"].as_str().expect("step_log")))
        .into_iter()
        .filter(|e| e["event"] == "step")
        .collect()
}

#[test]
fn launchers_of_two_nodes_start_their_own_ranks_and_meet_in_collectives() {
    // 8 ranks (tp2 dp4) over 2 nodes: TP pairs stay on a node, the DP
    // communicators span both. Rank 5 (node 1) arrives 300 ms late at step 3:
    // its DP peers on node 0 (ranks 1, 3) wait for it inside the all-reduce.
    let _t = timing_lock();
    let run = run_nodes(
        "nodes2",
        2,
        &[
            "--world-size",
            "8",
            "--tp",
            "2",
            "--dp",
            "4",
            "--steps",
            "6",
            "--timeout",
            "60",
            "--fault",
            "delay:rank=5,step=3,ms=300",
        ],
        Duration::from_secs(90),
    );
    assert_eq!(run.exits, vec![Some(0), Some(0)]);
    let job = &run.job;
    assert_eq!(job["schema"], "xpuscope-sim-job-ground-truth/1");
    assert_eq!(job["status"], "completed");
    assert_eq!(job["layout"]["world_size"], 8);
    let ranks: Vec<u64> = job["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_u64().unwrap())
        .collect();
    assert_eq!(
        ranks,
        (0..8).collect::<Vec<_>>(),
        "every rank once, in order"
    );
    for (k, node) in run.nodes.iter().enumerate() {
        assert_eq!(node["status"], "completed");
        assert_eq!(node["job"], job["job"], "one job name on every node");
        let info = &node["node"];
        assert_eq!(info["node_rank"], k);
        assert_eq!(info["hostname"], format!("node-{k}"), "own UTS namespace");
        assert_eq!(job["nodes"][k]["hostname"], format!("node-{k}"));
        let local: Vec<u64> = (4 * k as u64..4 * k as u64 + 4).collect();
        assert_eq!(info["ranks"], serde_json::json!(local));
        let mine = node["ranks"].as_array().unwrap();
        assert_eq!(mine.len(), 4, "a node starts only its own ranks");
        for (i, r) in mine.iter().enumerate() {
            assert_eq!(r["rank"], local[i]);
            assert_eq!(r["local_rank"], i);
            assert_eq!(r["env"]["RANK"], local[i].to_string());
            assert_eq!(r["env"]["LOCAL_RANK"], i.to_string());
            assert_eq!(r["steps_completed"], 6);
            assert!(r["pid"].as_i64().unwrap() > 0);
        }
        assert_eq!(node["env"]["GROUP_RANK"], k.to_string());
        assert_eq!(node["env"]["NODE_RANK"], k.to_string());
        assert_eq!(node["env"]["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(node["env"]["WORLD_SIZE"], "8");
    }
    // The fault lives in node 1's ground truth (and the job's), not node 0's.
    assert_eq!(run.nodes[0]["faults"].as_array().map(Vec::len), Some(0));
    assert_eq!(run.nodes[1]["faults"][0]["kind"], "delay");
    assert_eq!(
        job["faults"][0]["expected"]["waiting_ranks"],
        serde_json::json!([1, 3, 7])
    );
    // Rank 1 (node 0) and rank 5 (node 1) share dp communicator dp1: the
    // late arrival on node 1 holds node 0's rank inside the all-reduce.
    let r1 = step_events(&run.nodes[0], &run.nodes[0]["ranks"][1]);
    let r5 = step_events(&run.nodes[1], &run.nodes[1]["ranks"][1]);
    let sync = |steps: &[Value], s: usize| steps[s]["grad_sync_ns"].as_f64().unwrap() / 1e6;
    let base = (sync(&r1, 1) + sync(&r1, 2)) / 2.0;
    assert!(
        sync(&r1, 3) > base + 250.0,
        "rank 1 waited {:.1} ms for rank 5 on the other node (usually {base:.1} ms)",
        sync(&r1, 3)
    );
    let end = |steps: &[Value], s: usize| steps[s]["end_boot_ns"].as_f64().unwrap();
    assert!(
        (end(&r1, 3) - end(&r5, 3)).abs() < 100e6,
        "DP peers on two nodes finish step 3 together"
    );
}

#[test]
fn a_crash_on_one_node_stops_the_ranks_of_every_node() {
    let _t = timing_lock();
    let run = run_nodes(
        "nodes-crash",
        2,
        &[
            "--world-size",
            "4",
            "--dp",
            "4",
            "--steps",
            "200",
            "--timeout",
            "60",
            "--fault",
            "crash:rank=3,step=4,signal=SIGSEGV",
        ],
        Duration::from_secs(90),
    );
    assert_eq!(
        run.exits,
        vec![Some(1), Some(1)],
        "both launchers report failure"
    );
    assert_eq!(run.job["status"], "failed");
    let crashed = &run.nodes[1]["ranks"][1];
    assert_eq!(crashed["status"], "crashed");
    assert_eq!(crashed["exit"]["signal_name"], "SIGSEGV");
    for r in run.nodes[0]["ranks"].as_array().unwrap() {
        assert_eq!(r["status"], "terminated", "{r:#}");
        assert_eq!(r["exit"]["killed_by_launcher"], "peer_failure");
        assert!(r["steps_completed"].as_u64().unwrap() < 200);
    }
    assert_eq!(run.nodes[0]["first_failure"]["rank"], 3);
}

#[test]
fn a_rendezvous_directory_is_used_by_one_job_only() {
    let _serial = timing_lock();
    let dir = ScratchDir::new("nodes-stale");
    let fixtures = fixtures::build_all();
    let rdv = dir.0.join("rdv");
    std::fs::create_dir_all(rdv.join("launchers")).unwrap();
    std::fs::write(rdv.join("launchers/node1.json"), "{}").unwrap();
    let out = Command::new("python3")
        .arg(fixtures::repo_root().join("tests/sim/launch.py"))
        .arg("--build-dir")
        .arg(fixtures.join("sim"))
        .args(["--world-size", "4", "--nnodes", "2", "--node-rank", "1"])
        .arg("--rdv-dir")
        .arg(&rdv)
        .output()
        .expect("run launch.py");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node 1 already registered") && err.contains("fresh --rdv-dir"),
        "{err}"
    );
    let out = Command::new("python3")
        .arg(fixtures::repo_root().join("tests/sim/launch.py"))
        .args(["--world-size", "4", "--nnodes", "3"])
        .arg("--rdv-dir")
        .arg(&rdv)
        .output()
        .expect("run launch.py");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a multiple of --nnodes 3"));
}
