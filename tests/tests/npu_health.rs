//! End-to-end: Ascend NPU health from DCMI joined to ranks. The simulated
//! Ascend job's ranks play their NPUs for the stand-in `libdcmi.so`, which
//! the agent loads from its own process (`XPUSCOPE_DCMI_LIBRARY`): a
//! `throttle` fault (the AI Core frequency drops, with no reason, kernels
//! slowed in proportion) and an `xid` fault (the NPU lists a DCMI error
//! code, its health a major alarm) are found at the agent's defaults,
//! named by rank and step, online and by `agent diagnose` over the trace; a
//! clean job gives neither; the trace's NPU tracks carry the stand-in's
//! values; and with no DCMI on the host the run is as before, with one
//! line saying so. Root and eBPF; never skips.

use std::process::{Command, Stdio};
use std::sync::{MutexGuard, OnceLock};
use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{Proc, Recording, TempDir, exclusive, workload_bin};
use xpuscope_tests::device::{SimRun, run_from_spawn_with_npus};
use xpuscope_tests::trace_check::{ArgValue, Timeline, TrackKind};

const THROTTLED_RANK: u64 = 1;
const THROTTLE_STEP: u64 = 8;
const THROTTLE_MHZ: f64 = 990.0;
const ERROR_RANK: u64 = 0;
const ERROR_STEP: u64 = 20;
/// A DCMI error code (0x80E01801), given to the simulator in decimal.
const ERROR_CODE: u64 = 0x80E0_1801;

/// A 2-rank Ascend job (dp 2), 50 steps of about 150 ms, whose rank 1's
/// NPU drops to 990 MHz (of 1980) from step 8 and whose rank 0's NPU lists
/// error code 0x80E01801 at step 20; recorded once at the agent's defaults.
fn npu_faults(_serial: &MutexGuard<'static, ()>) -> &'static SimRun {
    static RUN: OnceLock<SimRun> = OnceLock::new();
    RUN.get_or_init(|| {
        run_from_spawn_with_npus(
            "npufaults",
            &[
                "--steps",
                "50",
                "--kernel-us",
                "5000",
                "--fault",
                &format!(
                    "throttle:rank={THROTTLED_RANK},mhz={THROTTLE_MHZ},from_step={THROTTLE_STEP}"
                ),
                "--fault",
                &format!("xid:rank={ERROR_RANK},code={ERROR_CODE},step={ERROR_STEP}"),
            ],
            &[],
        )
    })
}

fn of_kind<'a>(found: &'a [Value], kind: &str) -> Vec<&'a Value> {
    found.iter().filter(|f| f["kind"] == kind).collect()
}

fn findings(run: &SimRun) -> Vec<Value> {
    run.stats["findings"]["findings"]
        .as_array()
        .expect("findings")
        .clone()
}

/// The throttle found on its rank with no reason but the frequency, its
/// step bracketed by the samples around its onset; the error code on its
/// rank at its step, once (the health alarm that came with it is no
/// second finding).
fn assert_npu_findings(found: &[Value], gt: &Value, side: &str) {
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
    assert_eq!(t["evidence"]["source"], "dcmi", "{side}: {t}");
    assert_eq!(
        t["evidence"]["reasons"],
        serde_json::json!([]),
        "{side}: {t}"
    );
    assert_eq!(t["evidence"]["sm_clock_mhz"], 990, "{side}: {t}");
    assert_eq!(t["evidence"]["peer_sm_clock_mhz"], 1980, "{side}: {t}");
    let summary = t["summary"].as_str().unwrap_or("");
    assert!(
        summary.starts_with(&format!(
            "device_throttled: rank {THROTTLED_RANK}'s NPU {THROTTLED_RANK} ran its AI Cores at 990 MHz"
        )) && summary.contains("frequency below peers"),
        "{side}: {summary}"
    );
    let step = t["step"].as_u64().expect("a step");
    let after = t["evidence"]["onset_after_step"].as_u64().unwrap_or(0);
    assert!(
        after <= THROTTLE_STEP && THROTTLE_STEP <= step,
        "{side}: the throttle began at step {THROTTLE_STEP}, found between {after} and {step}: {t}"
    );
    assert!(t["cause"].is_null(), "{side}: a root: {t}");
    let injected = gt["faults"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["kind"] == "xid"))
        .expect("the error fault in the ground truth");
    assert_eq!(injected["injected"][0]["step"], ERROR_STEP, "{injected}");
    assert_eq!(injected["expected"]["device"], "NPU", "{injected}");
    let errors = of_kind(found, "device_error");
    assert_eq!(errors.len(), 1, "{side}: one device_error in {found:#?}");
    let e = errors[0];
    assert_eq!(e["ranks"], serde_json::json!([ERROR_RANK]), "{side}: {e}");
    // DCMI lists the codes an NPU has, read once a second: the code
    // appeared between the sample before and the one that listed it.
    let step = e["step"].as_u64().expect("a step");
    let after = e["evidence"]["listed_after_step"].as_u64().unwrap_or(0);
    assert!(
        after <= ERROR_STEP && ERROR_STEP <= step,
        "{side}: the code was raised in step {ERROR_STEP}, found between {after} and {step}: {e}"
    );
    assert_eq!(e["evidence"]["error_code"], "0x80E01801", "{side}: {e}");
    assert_eq!(
        e["summary"],
        format!(
            "device_error: rank {ERROR_RANK}'s NPU {ERROR_RANK} listed error code 0x80E01801 in step {step}"
        ),
        "{side}"
    );
}

#[test]
fn a_throttled_npu_and_an_error_code_are_found_on_their_ranks_online() {
    let serial = exclusive();
    let run = npu_faults(&serial);
    assert!(run.status.success(), "the job completes");
    assert_npu_findings(&findings(run), &run.ground_truth, "online");
    let health = &run.stats["npu_health"];
    assert_eq!(health["available"], true, "{health}");
    assert_eq!(health["gpus"], 8, "{health}");
    assert_eq!(health["xid_events"], 1, "{health}");
    assert!(
        run.stderr.contains("NPU health: 8 NPUs from") && run.stderr.contains("1 error codes"),
        "{}",
        run.stderr
    );
    assert_eq!(run.stats["gpu_health"]["available"], false);
}

#[test]
fn agent_diagnose_finds_the_same_npu_findings_from_the_trace() {
    let serial = exclusive();
    let run = npu_faults(&serial);
    let offline = run.offline_findings(&[]);
    assert_npu_findings(&offline, &run.ground_truth, "offline");
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

/// The counter named `NPU <npu><suffix>` under the track `NPU <npu>`.
fn npu_counter(tl: &Timeline, npu: u32, suffix: &str) -> Vec<(u64, f64)> {
    let name = format!("NPU {npu}");
    let npu_track = tl
        .tracks
        .values()
        .find(|t| t.name.as_deref() == Some(name.as_str()) && t.parent.is_none())
        .unwrap_or_else(|| panic!("no track {name}"));
    let counter_name = format!("{name}{suffix}");
    let counter = tl
        .tracks
        .values()
        .find(|t| {
            t.parent == Some(npu_track.uuid) && t.name.as_deref() == Some(counter_name.as_str())
        })
        .unwrap_or_else(|| panic!("no counter {counter_name} under {name}"));
    tl.counters
        .iter()
        .filter(|c| c.track == counter.uuid)
        .map(|c| (c.ts, c.value))
        .collect()
}

#[test]
fn the_npu_tracks_carry_the_stand_in_s_values() {
    let serial = exclusive();
    let run = npu_faults(&serial);
    let tl = &run.tl;
    let throttle_ns = run.ground_truth["faults"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["kind"] == "throttle"))
        .and_then(|f| f["injected"][0]["boot_ns"].as_u64())
        .expect("the throttle's time in the ground truth");
    let clocks = npu_counter(tl, THROTTLED_RANK as u32, " AI Core frequency");
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
    let utilization = npu_counter(tl, 0, " utilization");
    assert!(
        utilization.iter().any(|(_, v)| *v == 90.0),
        "the ranks' 90 %: {utilization:?}"
    );
    assert!(
        npu_counter(tl, 5, " utilization")
            .iter()
            .all(|(_, v)| *v == 0.0)
    );
    let memory = npu_counter(tl, 1, " memory used");
    assert!(
        memory.iter().any(|(_, v)| *v > 0.0),
        "the rank's allocations, as HBM MB: {memory:?}"
    );
    // Each sample names the NPU's pids and ranks and its health.
    let pid = run.rank_pids[&ERROR_RANK];
    let npu0 = tl
        .tracks
        .values()
        .find(|t| t.name.as_deref() == Some("NPU 0") && t.kind == TrackKind::Custom)
        .map(|t| t.uuid);
    let has = |i: &&xpuscope_tests::trace_check::Instant, key: &str, value: &ArgValue| {
        i.args.iter().any(|(k, v)| k == key && v == value)
    };
    let samples: Vec<_> = tl
        .instants
        .iter()
        .filter(|i| Some(i.track) == npu0 && i.name == "gpu sample")
        .collect();
    assert!(
        samples
            .iter()
            .any(|i| has(i, "pids", &ArgValue::Str(pid.to_string()))
                && has(i, "ranks", &ArgValue::Str(ERROR_RANK.to_string()))),
        "a sample of NPU 0 names rank {ERROR_RANK} (pid {pid})"
    );
    assert!(
        samples.iter().any(|i| has(i, "health", &ArgValue::Uint(2))),
        "the major alarm after the error"
    );
    assert!(
        tl.instants
            .iter()
            .any(|i| Some(i.track) == npu0 && i.name == "error code 0x80E01801")
    );
}

#[test]
fn a_clean_ascend_job_gives_no_npu_finding() {
    let _serial = exclusive();
    let run = run_from_spawn_with_npus("npuclean", &["--steps", "30", "--kernel-us", "5000"], &[]);
    assert!(run.status.success());
    let health = &run.stats["npu_health"];
    assert_eq!(health["available"], true, "{health}");
    assert!(health["samples"].as_u64().unwrap_or(0) >= 8, "{health}");
    let found = findings(&run);
    let offline = run.offline_findings(&[]);
    for kind in ["device_throttled", "device_error"] {
        assert!(
            of_kind(&found, kind).is_empty(),
            "{kind} in a clean job: {found:#?}"
        );
        assert!(
            of_kind(&offline, kind).is_empty(),
            "{kind} offline: {offline:#?}"
        );
    }
}

#[test]
fn without_dcmi_the_run_is_unchanged_and_says_why() {
    let _serial = exclusive();
    let dir = TempDir::new("nodcmi");
    let target = Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .args(["loop", "30"])
            .stdout(Stdio::null()),
    );
    let pid = target.pid().to_string();
    // No library named: the agent tries the Ascend driver's places, none
    // of which this host has.
    let rec = Recording::start_with_env(
        dir.path(),
        &["--pid", &pid, "--duration", "2s"],
        &[("XPUSCOPE_DCMI_LIBRARY", "")],
    );
    let done = rec.finish(Duration::from_secs(30));
    let health = &done.stats["npu_health"];
    assert_eq!(health["available"], false, "{health}");
    assert_eq!(health["samples"], 0, "{health}");
    let why = health["unavailable"].as_str().expect("why");
    assert_eq!(
        why,
        "libdcmi.so not found (tried libdcmi.so, /usr/local/Ascend/driver/lib64/driver/libdcmi.so, \
         /usr/local/Ascend/driver/lib64/common/libdcmi.so)"
    );
    assert!(
        done.stderr
            .contains(&format!("NPU health: unavailable ({why})")),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("xpuscope: error"), "{}", done.stderr);
    let tl = Timeline::new(&xpuscope_tests::trace_check::decode(&done.trace).expect("decodes"));
    assert!(
        !tl.tracks
            .values()
            .any(|t| t.name.as_deref().is_some_and(|n| n.starts_with("NPU "))),
        "no NPU tracks without DCMI"
    );
    assert!(tl.switches.len() > 10, "the recording itself is unchanged");
}
