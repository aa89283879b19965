//! End-to-end: GPU health from NVML joined to ranks. The simulated job's
//! ranks play their GPUs for the stand-in `libnvidia-ml.so.1`, which the
//! agent loads from its own process (`XPUSCOPE_NVML_LIBRARY`): a `throttle`
//! fault (a thermal clock drop, kernels slowed in proportion) and an `xid`
//! fault are found at the agent's defaults, named by rank and step, online
//! and by `agent diagnose` over the trace; a clean job gives neither; the
//! trace's GPU tracks carry the stand-in's values; and with no NVML the
//! run is as before, with one line saying so. Root and eBPF; never skips.

use std::process::{Command, Stdio};
use std::sync::{MutexGuard, OnceLock};
use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{Proc, Recording, TempDir, exclusive, workload_bin};
use xpuscope_tests::device::{SimRun, run_from_spawn_with_gpus};
use xpuscope_tests::trace_check::{ArgValue, Timeline, TrackKind};

const THROTTLED_RANK: u64 = 1;
const THROTTLE_STEP: u64 = 8;
const THROTTLE_MHZ: f64 = 990.0;
const XID_RANK: u64 = 0;
const XID_STEP: u64 = 20;
const XID: u64 = 79;

/// A 2-rank job (dp 2), 40 steps of about 150 ms, whose rank 1's GPU drops
/// to 990 MHz (of 1980) from step 8 and whose rank 0's GPU raises Xid 79
/// at step 20; recorded once at the agent's defaults.
fn gpu_faults(_serial: &MutexGuard<'static, ()>) -> &'static SimRun {
    static RUN: OnceLock<SimRun> = OnceLock::new();
    RUN.get_or_init(|| {
        run_from_spawn_with_gpus(
            "gpufaults",
            &[
                "--steps",
                "40",
                "--kernel-us",
                "5000",
                "--fault",
                &format!(
                    "throttle:rank={THROTTLED_RANK},mhz={THROTTLE_MHZ},from_step={THROTTLE_STEP}"
                ),
                "--fault",
                &format!("xid:rank={XID_RANK},code={XID},step={XID_STEP}"),
            ],
            &[],
        )
    })
}

fn of_kind<'a>(found: &'a [Value], kind: &str) -> Vec<&'a Value> {
    found.iter().filter(|f| f["kind"] == kind).collect()
}

/// The throttle found on its rank, its step bracketed by the samples
/// around its onset, its reason named; the Xid on its rank at its step.
fn assert_gpu_findings(found: &[Value], gt: &Value, side: &str) {
    let throttled = of_kind(found, "device_throttled");
    assert_eq!(
        throttled.len(),
        1,
        "{side}: one device_throttled in {found:#?}"
    );
    let t = throttled[0];
    assert_eq!(
        t["ranks"],
        serde_json::json!([THROTTLED_RANK]),
        "{side}: {t}"
    );
    assert_eq!(
        t["evidence"]["reasons"],
        serde_json::json!(["sw_thermal_slowdown"]),
        "{side}: {t}"
    );
    assert_eq!(t["evidence"]["sm_clock_mhz"], 990, "{side}: {t}");
    assert_eq!(t["evidence"]["peer_sm_clock_mhz"], 1980, "{side}: {t}");
    // Sampled every second: the onset lies between the last sample at full
    // clock and the first below it.
    let step = t["step"].as_u64().expect("a step");
    let after = t["evidence"]["onset_after_step"].as_u64().unwrap_or(0);
    assert!(
        after <= THROTTLE_STEP && THROTTLE_STEP <= step,
        "{side}: the throttle began at step {THROTTLE_STEP}, found between {after} and {step}: {t}"
    );
    assert!(t["cause"].is_null(), "{side}: a root: {t}");
    // What it caused (its rank's slowness, its peers' waits) is under it.
    for f in found
        .iter()
        .filter(|f| f["kind"] == "slow_rank" || f["kind"] == "late_arrival")
    {
        assert_eq!(f["incident"], t["incident"], "{side}: {f} follows from {t}");
    }
    let injected = gt["faults"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["kind"] == "xid"))
        .expect("the xid fault in the ground truth");
    assert_eq!(injected["injected"][0]["step"], XID_STEP, "{injected}");
    let errors = of_kind(found, "device_error");
    assert_eq!(errors.len(), 1, "{side}: one device_error in {found:#?}");
    let e = errors[0];
    assert_eq!(e["ranks"], serde_json::json!([XID_RANK]), "{side}: {e}");
    assert_eq!(e["step"], XID_STEP, "{side}: {e}");
    assert_eq!(e["evidence"]["xid"], XID, "{side}: {e}");
    assert_eq!(
        e["summary"],
        format!(
            "device_error: rank {XID_RANK}'s GPU {XID_RANK} raised Xid {XID} in step {XID_STEP}"
        ),
        "{side}"
    );
}

fn findings(run: &SimRun) -> Vec<Value> {
    run.stats["findings"]["findings"]
        .as_array()
        .expect("findings")
        .clone()
}

#[test]
fn a_throttled_gpu_and_an_xid_are_found_on_their_ranks_online() {
    let serial = exclusive();
    let run = gpu_faults(&serial);
    assert!(run.status.success(), "the job completes");
    assert_gpu_findings(&findings(run), &run.ground_truth, "online");
    let health = &run.stats["gpu_health"];
    assert_eq!(health["available"], true, "{health}");
    assert_eq!(health["gpus"], 8, "{health}");
    assert_eq!(health["xid_events"], 1, "{health}");
    assert!(
        run.stderr.contains("GPU health: 8 GPUs from") && run.stderr.contains("1 Xid events"),
        "{}",
        run.stderr
    );
}

#[test]
fn agent_diagnose_finds_the_same_from_the_trace() {
    let serial = exclusive();
    let run = gpu_faults(&serial);
    let offline = run.offline_findings(&[]);
    assert_gpu_findings(&offline, &run.ground_truth, "offline");
    let online = findings(run);
    for kind in ["device_throttled", "device_error"] {
        let summaries = |found: &[Value]| -> Vec<String> {
            of_kind(found, kind)
                .iter()
                .map(|f| f["summary"].as_str().unwrap_or("").to_owned())
                .collect()
        };
        assert_eq!(summaries(&offline), summaries(&online), "{kind}");
    }
}

/// The GPU track named `GPU <gpu>` and its counter named `GPU <gpu><suffix>`.
fn gpu_counter(tl: &Timeline, gpu: u32, suffix: &str) -> Vec<(u64, f64)> {
    let name = format!("GPU {gpu}");
    let gpu_track = tl
        .tracks
        .values()
        .find(|t| t.name.as_deref() == Some(name.as_str()) && t.parent.is_none())
        .unwrap_or_else(|| panic!("no track {name}"));
    let counter_name = format!("{name}{suffix}");
    let counter = tl
        .tracks
        .values()
        .find(|t| {
            t.parent == Some(gpu_track.uuid) && t.name.as_deref() == Some(counter_name.as_str())
        })
        .unwrap_or_else(|| panic!("no counter {counter_name} under {name}"));
    tl.counters
        .iter()
        .filter(|c| c.track == counter.uuid)
        .map(|c| (c.ts, c.value))
        .collect()
}

#[test]
fn the_gpu_tracks_carry_the_stand_in_s_clocks_and_the_ranks_on_them() {
    let serial = exclusive();
    let run = gpu_faults(&serial);
    let tl = &run.tl;
    let throttle_ns = run.ground_truth["faults"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["kind"] == "throttle"))
        .and_then(|f| f["injected"][0]["boot_ns"].as_u64())
        .expect("the throttle's time in the ground truth");
    // The throttled rank's GPU: full clock before, 990 MHz a second after.
    let clocks = gpu_counter(tl, THROTTLED_RANK as u32, " SM clock");
    assert!(clocks.len() >= 5, "{clocks:?}");
    assert!(
        clocks
            .iter()
            .filter(|(ts, _)| *ts < throttle_ns)
            .all(|(_, v)| *v == 1980.0),
        "{clocks:?}"
    );
    let after: Vec<f64> = clocks
        .iter()
        .filter(|(ts, _)| *ts > throttle_ns + 1_100_000_000)
        .map(|(_, v)| *v)
        .collect();
    assert!(
        !after.is_empty() && after.iter().all(|v| *v == THROTTLE_MHZ),
        "{clocks:?}"
    );
    // Its peer stays at full clock; an unused GPU is idle at full clock.
    assert!(
        gpu_counter(tl, 0, " SM clock")
            .iter()
            .all(|(_, v)| *v == 1980.0)
    );
    let utilization = gpu_counter(tl, 0, " utilization");
    assert!(
        utilization.iter().any(|(_, v)| *v == 90.0),
        "the ranks' 90 %: {utilization:?}"
    );
    assert!(
        gpu_counter(tl, 5, " utilization")
            .iter()
            .all(|(_, v)| *v == 0.0)
    );
    let memory = gpu_counter(tl, 1, " memory used");
    assert!(
        memory.iter().any(|(_, v)| *v > 0.0),
        "the rank's allocations: {memory:?}"
    );
    // Each sample names the GPU's pids and ranks.
    let pid = run.rank_pids[&THROTTLED_RANK];
    let gpu1 = tl
        .tracks
        .values()
        .find(|t| t.name.as_deref() == Some("GPU 1") && t.kind == TrackKind::Custom)
        .map(|t| t.uuid);
    let named = tl
        .instants
        .iter()
        .filter(|i| Some(i.track) == gpu1 && i.name == "gpu sample")
        .any(|i| {
            i.args
                .iter()
                .any(|(k, v)| k == "pids" && *v == ArgValue::Str(pid.to_string()))
                && i.args
                    .iter()
                    .any(|(k, v)| k == "ranks" && *v == ArgValue::Str(THROTTLED_RANK.to_string()))
        });
    assert!(
        named,
        "a sample of GPU 1 names rank {THROTTLED_RANK} (pid {pid})"
    );
    // The slowdown as a slice on the GPU's track, and the Xid as an instant.
    assert!(
        tl.slices
            .iter()
            .any(|s| Some(s.track) == gpu1 && s.name == "clocks slowed: sw_thermal_slowdown")
    );
    assert!(tl.instants.iter().any(|i| i.name == format!("Xid {XID}")));
}

#[test]
fn a_clean_job_on_healthy_gpus_gives_no_gpu_finding() {
    let _serial = exclusive();
    let run = run_from_spawn_with_gpus("gpuclean", &["--steps", "30", "--kernel-us", "5000"], &[]);
    assert!(run.status.success());
    assert_eq!(
        run.stats["gpu_health"]["available"], true,
        "{}",
        run.stats["gpu_health"]
    );
    assert!(
        run.stats["gpu_health"]["samples"].as_u64().unwrap_or(0) >= 8,
        "{}",
        run.stats["gpu_health"]
    );
    let found = findings(&run);
    for kind in ["device_throttled", "device_error"] {
        assert!(
            of_kind(&found, kind).is_empty(),
            "{kind} in a clean job: {found:#?}"
        );
    }
    let offline = run.offline_findings(&[]);
    for kind in ["device_throttled", "device_error"] {
        assert!(
            of_kind(&offline, kind).is_empty(),
            "{kind} offline: {offline:#?}"
        );
    }
}

#[test]
fn without_nvml_the_run_is_unchanged_and_says_why() {
    let _serial = exclusive();
    let dir = TempDir::new("nonvml");
    let target = Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .args(["loop", "30"])
            .stdout(Stdio::null()),
    );
    let pid = target.pid().to_string();
    let rec = Recording::start_with_env(
        dir.path(),
        &["--pid", &pid, "--duration", "2s"],
        &[("XPUSCOPE_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")],
    );
    let done = rec.finish(Duration::from_secs(30));
    let health = &done.stats["gpu_health"];
    assert_eq!(health["available"], false, "{health}");
    assert_eq!(health["samples"], 0, "{health}");
    let why = health["unavailable"].as_str().expect("why");
    assert!(
        why.starts_with("/nonexistent/libnvidia-ml.so.1 could not be loaded"),
        "{why}"
    );
    assert!(
        done.stderr
            .contains(&format!("GPU health: unavailable ({why})")),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("xpuscope: error"), "{}", done.stderr);
    let tl = Timeline::new(&xpuscope_tests::trace_check::decode(&done.trace).expect("decodes"));
    assert!(
        !tl.tracks
            .values()
            .any(|t| t.name.as_deref().is_some_and(|n| n.starts_with("GPU "))),
        "no GPU tracks without NVML"
    );
    assert!(tl.switches.len() > 10, "the recording itself is unchanged");
}
