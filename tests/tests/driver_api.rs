//! End-to-end: the layer below the runtime under `agent attach`. The CUDA
//! driver API (`libcuda.so.1`), on the simulated job whose stand-in runtime
//! launches, allocates and syncs through the stand-in driver on the
//! caller's thread, and whose ranks also launch library kernels and a
//! graph straight through the driver (`--driver-launches`) and keep
//! activations in an expandable segment mapped page by page
//! (`--expandable-segments`). The CANN runtime (`libruntime.so`), on the
//! Ascend flavor of the job, whose stand-in AscendCL goes through it the
//! same way and whose ranks also launch operator kernels straight through
//! it (`--driver-launches`). Graded against the simulator's own accounting
//! (its step log and ground truth), with C ranks and, on the CUDA driver,
//! CPython ranks too. Root and eBPF; these never skip.

use std::collections::BTreeSet;

use serde_json::Value;
use xpuscope_tests::agent::exclusive;
use xpuscope_tests::device::*;
use xpuscope_tests::trace_check::{ArgValue, Slice, Timeline, TrackKind};

/// The runtime kernels' names (tests/sim/src/rank.c).
const RUNTIME_KERNELS: [&str; 7] = [
    "embedding_fwd",
    "attention_fwd",
    "mlp_fwd",
    "mlp_bwd",
    "attention_bwd",
    "grad_scale",
    "adam",
];

/// The job's ground truth as the launcher wrote it at the end.
fn final_truth(run: &SimRun) -> Value {
    read_json(&run.job_dir.join("ground_truth.json")).expect("ground truth")
}

fn rank_truth(truth: &Value, rank: u64) -> &Value {
    truth["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .find(|r| r["rank"] == rank)
        .unwrap_or_else(|| panic!("rank {rank} in {truth}"))
}

/// The step lines of rank `rank`'s log.
fn steps_of(run: &SimRun, rank: u64) -> Vec<Value> {
    let path = run.job_dir.join(format!("rank{rank}.steps.jsonl"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .collect()
}

/// The device-call slices on process `pid`'s threads.
fn slices_of(tl: &Timeline, pid: i32) -> Vec<&Slice> {
    tl.slices
        .iter()
        .filter(|s| s.category.as_deref() == Some("device"))
        .filter(|s| thread_of(tl, s).is_some_and(|(p, _)| p == pid))
        .collect()
}

fn function(s: &Slice) -> &str {
    s.name.split(' ').next().unwrap_or_default()
}

fn kernel(s: &Slice) -> Option<&str> {
    match arg(s, "kernel") {
        Some(ArgValue::Str(k)) => Some(k.as_str()),
        _ => None,
    }
}

fn uint(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// With launch probes on (level 1), every launch of every rank is one
/// slice with its kernel's name: the runtime's (`cudaLaunchKernel`, named
/// by the driver handle of the `cuLaunchKernel` it made, which is folded
/// into it), the cuBLAS-like `cuLaunchKernel` and Triton-like
/// `cuLaunchKernelEx` made straight through the driver, and the graph
/// launches; no launch is counted twice.
#[test]
fn every_launch_is_counted_once_with_its_kernel() {
    let _serial = exclusive();
    every_launch_is_counted_once("drvlaunch", &[]);
}

/// The same, with the job's ranks in CPython calling the libraries
/// through ctypes.
#[test]
fn every_python_launch_is_counted_once_with_its_kernel() {
    let _serial = exclusive();
    every_launch_is_counted_once("drvlaunchpy", &["--lang", "python"]);
}

/// Runs the NVIDIA job with `--driver-launches` and `extra` at level 1
/// and checks every rank's launches against its ground truth.
fn every_launch_is_counted_once(tag: &str, extra: &[&str]) {
    let steps = 6;
    let run = run_sim_job(tag, "1", steps, &[&["--driver-launches"], extra].concat());
    let truth = final_truth(&run);
    assert_eq!(
        truth["driver"]["driver_launches"], true,
        "{}",
        truth["driver"]
    );
    let tl = &run.tl;
    let (mut runtime_total, mut direct_cu_launch) = (0, 0);
    for (&rank, &pid) in &run.rank_pids {
        let t = &rank_truth(&truth, rank)["launches"];
        assert_eq!(rank_truth(&truth, rank)["steps_completed"], steps);
        let slices = slices_of(tl, pid);
        let of = |name: &str| -> Vec<&Slice> {
            slices
                .iter()
                .copied()
                .filter(|s| function(s) == name)
                .collect()
        };
        let runtime = of("cudaLaunchKernel");
        assert_eq!(runtime.len() as u64, uint(&t["runtime"]), "rank {rank}");
        for s in &runtime {
            let k = kernel(s).unwrap_or_else(|| panic!("rank {rank}: unnamed {s:?}"));
            assert!(RUNTIME_KERNELS.contains(&k), "rank {rank}: {s:?}");
            assert!(
                s.name.starts_with(&format!("cudaLaunchKernel {k} grid(")),
                "{s:?}"
            );
        }
        // Every runtime kernel ran, by name.
        let named: BTreeSet<&str> = runtime.iter().filter_map(|s| kernel(s)).collect();
        assert_eq!(named.len(), RUNTIME_KERNELS.len(), "rank {rank}: {named:?}");
        let gemm = of("cuLaunchKernel");
        let triton = of("cuLaunchKernelEx");
        assert_eq!(gemm.len() as u64, steps, "rank {rank}: {gemm:?}");
        assert_eq!(triton.len() as u64, steps, "rank {rank}: {triton:?}");
        assert!(
            gemm.iter().all(|s| kernel(s) == Some("sim_cublas_gemm")),
            "{gemm:?}"
        );
        assert!(
            triton
                .iter()
                .all(|s| kernel(s) == Some("sim_triton_fused_adam")),
            "{triton:?}"
        );
        assert_eq!(
            arg_text(triton[0], "grid"),
            "(64,1,1)",
            "dims from the CUlaunchConfig"
        );
        // No runtime launch is also a driver launch.
        assert_eq!(
            (gemm.len() + triton.len()) as u64,
            uint(&t["driver"]),
            "rank {rank}"
        );
        let graphs = of("cuGraphLaunch");
        assert_eq!(graphs.len() as u64, uint(&t["graph"]), "rank {rank}");
        assert_eq!(graphs.len() as u64, steps, "rank {rank}");
        runtime_total += runtime.len() as u64;
        direct_cu_launch += gemm.len() as u64;
    }
    // The driver's cuLaunchKernel was hit by every runtime launch and every
    // direct one; only the direct ones are calls of their own.
    let device = &run.stats["device"];
    let row = device["functions"]
        .as_array()
        .expect("functions")
        .iter()
        .find(|f| f["function"] == "cuLaunchKernel")
        .unwrap_or_else(|| panic!("{device}"))
        .clone();
    assert_eq!(
        uint(&row["hits"]),
        runtime_total + direct_cu_launch,
        "{row}"
    );
    assert_eq!(uint(&row["calls"]), direct_cu_launch, "{row}");
    assert!(
        uint(&device["driver_calls_folded"]) >= runtime_total,
        "{device}"
    );
}

/// At the default level (launch probes off) with expandable segments: no
/// launch of any kind is recorded, while the memory and syncs are; each
/// rank's device-memory track equals what the simulator says it mapped at
/// the end of every step (the segment grows by cuMemMap page by page and
/// shrinks by one cuMemUnmap of its top pages), and each runtime sync is
/// one call, not two.
#[test]
fn expandable_segments_memory_track_equals_the_mapped_bytes() {
    let _serial = exclusive();
    let steps = 6;
    let run = run_sim_job(
        "drvseg",
        "0",
        steps,
        &["--expandable-segments", "--driver-launches"],
    );
    segment_memory_track_equals_the_mapped_bytes(&run, steps);
}

/// With the job's ranks in CPython, one run at the default level with
/// expandable segments and driver launches: each rank's device-memory
/// track equals the bytes it mapped, as above, and its launches are
/// counted per step, as [`launches_are_counted_per_step`] checks.
#[test]
fn python_segments_and_launches_per_step_at_the_default_level() {
    let _serial = exclusive();
    let steps = 8;
    let run = run_sim_job(
        "drvsegpy",
        "0",
        steps,
        &[
            "--lang",
            "python",
            "--expandable-segments",
            "--driver-launches",
        ],
    );
    segment_memory_track_equals_the_mapped_bytes(&run, steps);
    launches_are_counted_in_each_step(&run, steps);
}

/// The checks of [`expandable_segments_memory_track_equals_the_mapped_bytes`]
/// on a level-0 run of `steps` steps with `--expandable-segments`.
fn segment_memory_track_equals_the_mapped_bytes(run: &SimRun, steps: u64) {
    let truth = final_truth(run);
    let tl = &run.tl;
    for (&rank, &pid) in &run.rank_pids {
        let rt = rank_truth(&truth, rank);
        let slices = slices_of(tl, pid);
        let count = |name: &str| slices.iter().filter(|s| function(s) == name).count();
        for launch in [
            "cudaLaunchKernel",
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cuGraphLaunch",
        ] {
            assert_eq!(count(launch), 0, "rank {rank}: {launch} at level 0");
        }
        assert!(count("cudaStreamSynchronize") > 0, "rank {rank}: syncs");
        assert_eq!(
            count("cuStreamSynchronize"),
            0,
            "rank {rank}: folded into the runtime's"
        );
        assert!(
            count("cuMemMap") > 0 && count("cuMemUnmap") > 0,
            "rank {rank}"
        );

        let track = tl
            .tracks
            .values()
            .find(|t| {
                t.name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("device memory dev"))
                    && t.parent.and_then(|p| match &tl.tracks.get(&p)?.kind {
                        TrackKind::Process { pid, .. } | TrackKind::Thread { pid, .. } => {
                            Some(*pid)
                        }
                        _ => None,
                    }) == Some(pid)
            })
            .unwrap_or_else(|| panic!("rank {rank}: no device-memory track"));
        let series = tl.counter_series(track.uuid);
        let at = |ts: u64| {
            series
                .iter()
                .take_while(|(t, _)| *t <= ts)
                .last()
                .map_or(0, |(_, v)| *v as u64)
        };
        let ready = uint(&rt["ready"]["mem_bytes"]);
        let mapped = rt["segment_bytes"].as_array().expect("segment_bytes");
        let lines = steps_of(run, rank);
        assert_eq!(lines.len() as u64, steps);
        assert_eq!(mapped.len() as u64, steps);
        let mut peak = 0;
        for (line, mapped) in lines.iter().zip(mapped) {
            let end = uint(&line["end_boot_ns"]);
            // What the rank allocated after the agent attached (at its
            // start gate) is what the segment has mapped.
            assert_eq!(
                uint(&line["mem_bytes"]) - ready,
                uint(mapped),
                "rank {rank}: {line}"
            );
            assert_eq!(
                at(end),
                uint(mapped),
                "rank {rank} step {}: {series:?}",
                line["step"]
            );
            peak = peak.max(uint(mapped));
        }
        // The segment grew past what it held at any step end, page by page.
        let max = series.iter().map(|(_, v)| *v as u64).max().unwrap_or(0);
        assert!(max > peak, "rank {rank}: {series:?}");
    }
}

// ---------------------------------------------------------------- CANN runtime

/// The operator kernels the Ascend ranks launch through the CANN runtime
/// (tests/sim/src/rank.c): by registered stub, and by stub found by name.
const OPERATOR_KERNELS: [(&str, &str); 2] = [
    ("rtKernelLaunch", "sim_tbe_matmul"),
    ("rtKernelLaunchWithFlag", "sim_tbe_fused_adam"),
];

/// The device-memory counter track of process `pid`.
fn memory_series(tl: &Timeline, pid: i32) -> Option<Vec<(u64, f64)>> {
    let track = tl.tracks.values().find(|t| {
        t.name
            .as_deref()
            .is_some_and(|n| n.starts_with("device memory dev"))
            && t.parent.and_then(|p| match &tl.tracks.get(&p)?.kind {
                TrackKind::Process { pid, .. } | TrackKind::Thread { pid, .. } => Some(*pid),
                _ => None,
            }) == Some(pid)
    })?;
    Some(tl.counter_series(track.uuid))
}

/// With launch probes on, on the Ascend job: every `aclrtLaunchKernel` of
/// every rank is one slice named by its kernel (the name lent by the
/// `rtLaunchKernelByFuncHandleV3` it made through the runtime, folded into
/// it), every operator kernel launched straight through the runtime is one
/// `rtKernelLaunch` / `rtKernelLaunchWithFlag` slice with its name (from
/// `rtFunctionRegister` / `rtGetFunctionByName`), and no launch is counted
/// twice.
#[test]
fn every_ascend_launch_is_counted_once_with_its_kernel() {
    let _serial = exclusive();
    let steps = 6;
    let run = run_sim_job(
        "rtlaunch",
        "1",
        steps,
        &["--flavor", "ascend", "--driver-launches"],
    );
    let truth = final_truth(&run);
    assert_eq!(truth["flavor"], "ascend");
    assert_eq!(
        truth["driver"]["driver_launches"], true,
        "{}",
        truth["driver"]
    );
    let tl = &run.tl;
    let mut acl_total = 0;
    for (&rank, &pid) in &run.rank_pids {
        let t = &rank_truth(&truth, rank)["launches"];
        assert_eq!(rank_truth(&truth, rank)["steps_completed"], steps);
        let slices = slices_of(tl, pid);
        let of = |name: &str| -> Vec<&Slice> {
            slices
                .iter()
                .copied()
                .filter(|s| function(s) == name)
                .collect()
        };
        let acl = of("aclrtLaunchKernel");
        assert_eq!(acl.len() as u64, uint(&t["runtime"]), "rank {rank}");
        for s in &acl {
            let k = kernel(s).unwrap_or_else(|| panic!("rank {rank}: unnamed {s:?}"));
            assert!(RUNTIME_KERNELS.contains(&k), "rank {rank}: {s:?}");
            assert_eq!(s.name, format!("aclrtLaunchKernel {k} blocks 48"), "{s:?}");
        }
        let named: BTreeSet<&str> = acl.iter().filter_map(|s| kernel(s)).collect();
        assert_eq!(named.len(), RUNTIME_KERNELS.len(), "rank {rank}: {named:?}");
        // AscendCL's runtime launches are folded into it: none of their own.
        assert!(
            of("rtLaunchKernelByFuncHandleV3").is_empty(),
            "rank {rank}: folded"
        );
        let mut direct = 0;
        for (function, name) in OPERATOR_KERNELS {
            let launches = of(function);
            assert_eq!(launches.len() as u64, steps, "rank {rank}: {launches:?}");
            assert!(
                launches
                    .iter()
                    .all(|s| kernel(s) == Some(name)
                        && s.name == format!("{function} {name} blocks 24")),
                "rank {rank}: {launches:?}"
            );
            direct += launches.len() as u64;
        }
        assert_eq!(direct, uint(&t["driver"]), "rank {rank}");
        assert_eq!(uint(&t["graph"]), 0, "rank {rank}");
        // The names came from the runtime's name calls, at the default level.
        assert_eq!(of("rtFunctionRegister").len(), 2, "rank {rank}");
        assert_eq!(of("rtGetFunctionByName").len(), 1, "rank {rank}");
        acl_total += acl.len() as u64;
    }
    // The runtime's launch by function handle was hit by every AscendCL
    // launch and is a call for none of them.
    let device = &run.stats["device"];
    let row = device["functions"]
        .as_array()
        .expect("functions")
        .iter()
        .find(|f| f["function"] == "rtLaunchKernelByFuncHandleV3")
        .unwrap_or_else(|| panic!("{device}"))
        .clone();
    assert_eq!(uint(&row["hits"]), acl_total, "{row}");
    assert_eq!(uint(&row["calls"]), 0, "{row}");
    assert!(
        uint(&device["driver_calls_folded"]) >= acl_total,
        "{device}"
    );
}

/// At the default level on the Ascend job, with a rank allocating more
/// device memory every step (`aclrtMalloc` -> `rtMalloc`): no launch of
/// either library is recorded, while the syncs (AscendCL's, the runtime's
/// folded into them) and the allocations are, once each; the leaking
/// rank's device-memory track equals what the simulator says it allocated
/// after the agent attached, at the end of every step.
#[test]
fn ascend_memory_and_syncs_are_default_level_and_counted_once() {
    let _serial = exclusive();
    let steps = 6;
    let leak_mb = 4;
    let run = run_sim_job(
        "rtmem",
        "0",
        steps,
        &[
            "--flavor",
            "ascend",
            "--driver-launches",
            "--fault",
            &format!("mem_leak:rank=0,mb={leak_mb},from_step=1"),
        ],
    );
    let truth = final_truth(&run);
    let tl = &run.tl;
    for (&rank, &pid) in &run.rank_pids {
        let slices = slices_of(tl, pid);
        let count = |name: &str| slices.iter().filter(|s| function(s) == name).count();
        for launch in [
            "aclrtLaunchKernel",
            "rtLaunchKernelByFuncHandleV3",
            "rtKernelLaunch",
            "rtKernelLaunchWithFlag",
        ] {
            assert_eq!(count(launch), 0, "rank {rank}: {launch} at level 0");
        }
        assert!(count("aclrtSynchronizeStream") > 0, "rank {rank}: syncs");
        for folded in ["rtStreamSynchronize", "rtMalloc", "rtFree"] {
            assert_eq!(count(folded), 0, "rank {rank}: {folded} folded");
        }
        if rank != 0 {
            continue;
        }
        // One aclrtMalloc per leaking step, each its own call.
        let leaks = slices
            .iter()
            .filter(|s| s.name == format!("aclrtMalloc {leak_mb} MiB"))
            .count() as u64;
        assert_eq!(leaks, steps - 1, "rank {rank}");
        let series =
            memory_series(tl, pid).unwrap_or_else(|| panic!("rank {rank}: no device-memory track"));
        let at = |ts: u64| {
            series
                .iter()
                .take_while(|(t, _)| *t <= ts)
                .last()
                .map_or(0, |(_, v)| *v as u64)
        };
        let ready = uint(&rank_truth(&truth, rank)["ready"]["mem_bytes"]);
        let lines = steps_of(&run, rank);
        assert_eq!(lines.len() as u64, steps);
        for line in &lines {
            let end = uint(&line["end_boot_ns"]);
            let held = uint(&line["mem_bytes"]) - ready;
            assert_eq!(
                at(end),
                held,
                "rank {rank} step {}: {series:?}",
                line["step"]
            );
        }
        assert_eq!(
            at(uint(&lines[lines.len() - 1]["end_boot_ns"])),
            (steps - 1) * leak_mb * (1 << 20)
        );
    }
}

// ------------------------------------------------- launches at the default level

/// The per-step counter `name` under process `pid`'s track.
fn step_counter(tl: &Timeline, pid: i32, name: &str) -> Option<Vec<(u64, f64)>> {
    let track = tl.tracks.values().find(|t| {
        t.name.as_deref() == Some(name)
            && t.parent.and_then(|p| match &tl.tracks.get(&p)?.kind {
                TrackKind::Process { pid, .. } => Some(*pid),
                _ => None,
            }) == Some(pid)
    })?;
    Some(tl.counter_series(track.uuid))
}

/// The launches of one simulated step, the same in every step of a clean
/// run: (kernel launches: the runtime's and the ones made straight below
/// it; graph launches).
fn launches_per_step(run: &SimRun, rank: u64, steps: u64) -> (u64, u64) {
    let lines = steps_of(run, rank);
    assert_eq!(lines.len() as u64, steps, "rank {rank}");
    let of = |l: &Value| {
        (
            uint(&l["runtime_launches"]) + uint(&l["driver_launches"]),
            uint(&l["graph_launches"]),
        )
    };
    let first = of(&lines[0]);
    assert!(first.0 > 0, "rank {rank}: {}", lines[0]);
    for l in &lines {
        assert_eq!(of(l), first, "rank {rank}: every step launches alike: {l}");
    }
    first
}

/// At the default level (no launch recorded), each rank's launches are
/// counted in the kernel and shown per step: a "step kernel launches"
/// counter on its process track with, at every step, exactly the kernels
/// the simulator launched in a step (runtime launches once each, though
/// each also went through the driver; library launches straight through
/// the driver), a "step graph launches" counter with its graph launches,
/// and the same figures per step in the summary's step table.
fn launches_are_counted_per_step(flavor: &str, tag: &str) {
    let steps = 8;
    let run = run_sim_job(tag, "0", steps, &["--flavor", flavor, "--driver-launches"]);
    launches_are_counted_in_each_step(&run, steps);
}

/// The checks of [`launches_are_counted_per_step`] on a level-0 run of
/// `steps` steps with `--driver-launches`.
fn launches_are_counted_in_each_step(run: &SimRun, steps: u64) {
    let tl = &run.tl;
    let split = run.stats["step_split"].as_array().expect("step_split");
    for (&rank, &pid) in &run.rank_pids {
        let (kernels, graphs) = launches_per_step(run, rank, steps);
        let slices = slices_of(tl, pid);
        assert!(
            !slices.iter().any(|s| s.name.contains("Launch")),
            "rank {rank}: no launch recorded at level 0"
        );
        let series = step_counter(tl, pid, "step kernel launches")
            .unwrap_or_else(|| panic!("rank {rank}: no launch counter"));
        // The first step has no earlier boundary and is not reported; the
        // rest are, but the last may end after the recording.
        assert!(series.len() as u64 >= steps - 3, "rank {rank}: {series:?}");
        for (ts, n) in &series {
            assert_eq!(*n as u64, kernels, "rank {rank} at {ts}: {series:?}");
        }
        let graph_series = step_counter(tl, pid, "step graph launches");
        if graphs == 0 {
            assert!(graph_series.is_none(), "rank {rank}: {graph_series:?}");
        } else {
            let graph_series = graph_series.unwrap_or_else(|| panic!("rank {rank}: no graphs"));
            assert_eq!(graph_series.len(), series.len(), "rank {rank}");
            assert!(
                graph_series.iter().all(|(_, n)| *n as u64 == graphs),
                "rank {rank}: {graph_series:?}"
            );
        }
        let row = split
            .iter()
            .find(|r| r["rank"] == rank)
            .unwrap_or_else(|| panic!("rank {rank}: {split:?}"));
        assert_eq!(
            row["launches_per_step"].as_f64(),
            Some(kernels as f64),
            "{row}"
        );
        assert_eq!(
            row["graph_launches_per_step"].as_f64(),
            Some(graphs as f64),
            "{row}"
        );
    }
}

#[test]
fn cuda_launches_are_counted_per_step_at_the_default_level() {
    let _serial = exclusive();
    launches_are_counted_per_step("nvidia", "drvcount");
}

#[test]
fn ascend_launches_are_counted_per_step_at_the_default_level() {
    let _serial = exclusive();
    launches_are_counted_per_step("ascend", "rtcount");
}
