//! `cargo xtask bench merge`: `agent merge` on 16 node traces.
//!
//! The traces come from a long simulated job over two "nodes" (one agent
//! per node launcher, every off-CPU stack recorded, device calls at
//! probe level 1), each used eight times as if from eight nodes (pids
//! clash, so the merge moves them; ranks repeat, which it only warns
//! about). The job runs as many steps as make each node's trace about
//! `--trace-mb` (100 MB by default: a 4,200-step job, about 45 s on two
//! CPUs); the two traces are kept in `target/bench/merge-traces/<N>mb`
//! and reused while they are of that size (delete the folder to record
//! them again, e.g. after the agent's trace format changed). Run it at two
//! sizes (`--trace-mb 25`, `--trace-mb 100`) to see that the peak RSS does
//! not follow the traces' length. Figures, each
//! round interleaved with its baseline:
//! - merge throughput in MB/s of input, against reading the same 16 files
//!   (to /dev/null: the floor any merge pays; a copy into one file would
//!   need the inputs' size again on disk), as a ratio;
//! - the merge's peak RSS for 16 traces against 2 traces of the same run:
//!   bounded memory means it does not grow with the input.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::build::{self, ChildGuard};
use crate::measure::{median, wait_until_recording};
use crate::root;

const NODES: usize = 2;
const COPIES: usize = 8;
/// Steps of the job per MB of one node's trace (3,000 steps made 71 MB
/// traces).
const STEPS_PER_MB: f64 = 42.3;

/// Records the simulated job over two nodes for `steps` steps; returns
/// the two node traces.
fn record(dir: &Path, steps: u64) -> Result<Vec<PathBuf>> {
    let rdv = dir.join("rdv");
    let _ = std::fs::remove_dir_all(&rdv);
    let gate = dir.join("go");
    let _ = std::fs::remove_file(&gate);
    let launcher = root().join("tests/sim/launch.py");
    let steps = steps.to_string();
    let mut launchers = Vec::new();
    for k in 0..NODES {
        let child = Command::new("python3")
            .arg(&launcher)
            .arg("--build-dir")
            .arg(root().join("target/fixtures/sim"))
            .args([
                "--quiet",
                "--world-size",
                "4",
                "--tp",
                "2",
                "--dp",
                "2",
                "--pp",
                "1",
            ])
            .args(["--steps", &steps, "--timeout", "1800"])
            .args([
                "--nnodes",
                &NODES.to_string(),
                "--node-rank",
                &k.to_string(),
            ])
            .arg("--rdv-dir")
            .arg(&rdv)
            .arg("--spawn-gate")
            .arg(&gate)
            .args(["--init-delay-ms", "3000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting the simulated job")?;
        launchers.push(ChildGuard(child));
    }
    let start = Instant::now();
    let pids: Vec<u32> = loop {
        let pids: Vec<u32> = (0..NODES)
            .filter_map(|k| {
                let text = std::fs::read_to_string(rdv.join(format!("node{k}/ground_truth.json")));
                let v: Value = serde_json::from_str(&text.ok()?).ok()?;
                Some(v["node"]["launcher_pid"].as_u64()? as u32)
            })
            .collect();
        if pids.len() == NODES {
            break pids;
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the launchers did not start");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let traces: Vec<PathBuf> = (0..NODES)
        .map(|k| dir.join(format!("node{k}.pftrace")))
        .collect();
    let mut agents = Vec::new();
    for (pid, trace) in pids.iter().zip(&traces) {
        let mut agent = Command::new(build::agent_binary())
            .args([
                "attach",
                "--pid",
                &pid.to_string(),
                "--stacks",
                "all",
                "--probe-level",
                "1",
            ])
            .arg("-o")
            .arg(trace)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the agent")?;
        wait_until_recording(&mut agent)?;
        agents.push(ChildGuard(agent));
    }
    std::fs::write(&gate, b"")?;
    for mut l in launchers {
        let status = l.0.wait()?;
        if !status.success() {
            bail!("the simulated job failed: {status}");
        }
    }
    for mut a in agents {
        let status = a.0.wait()?;
        if !status.success() {
            bail!("an agent failed: {status}");
        }
    }
    Ok(traces)
}

/// One merge: (seconds, the merge's own stats).
fn merge(inputs: &[PathBuf], out: &Path, stats: &Path) -> Result<(f64, Value)> {
    let start = Instant::now();
    let status = Command::new(build::agent_binary())
        .arg("merge")
        .arg("-o")
        .arg(out)
        .arg("--stats-json")
        .arg(stats)
        .args(inputs)
        .stdout(Stdio::null())
        .status()
        .context("running agent merge")?;
    let secs = start.elapsed().as_secs_f64();
    if !status.success() {
        bail!("agent merge failed: {status}");
    }
    Ok((secs, serde_json::from_slice(&std::fs::read(stats)?)?))
}

/// The baseline: the same files read (and written to /dev/null).
fn copy(inputs: &[PathBuf]) -> Result<f64> {
    let start = Instant::now();
    let mut w = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create("/dev/null")?);
    for p in inputs {
        std::io::copy(&mut std::fs::File::open(p)?, &mut w)?;
    }
    std::io::Write::flush(&mut w)?;
    Ok(start.elapsed().as_secs_f64())
}

/// Removes the bench's traces however it ends: they are large and can
/// be made again.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).map_or(0, |m| m.len())
}

/// Two node traces of about `trace_mb` each: the cached ones when they
/// are of that size (within 10%), else recorded (again, with more steps,
/// if the first job's traces came out too small).
fn node_traces(cache: &Path, trace_mb: u64) -> Result<Vec<PathBuf>> {
    let target = trace_mb * 1_000_000;
    let fits = |traces: &[PathBuf]| {
        traces.len() == NODES
            && traces
                .iter()
                .all(|p| size(p) >= target * 9 / 10 && size(p) <= target * 13 / 10)
    };
    let cached: Vec<PathBuf> = (0..NODES)
        .map(|k| cache.join(format!("node{k}.pftrace")))
        .collect();
    if fits(&cached) {
        eprintln!(
            "bench merge: using the node traces in {} ({:.0} and {:.0} MB)",
            cache.display(),
            size(&cached[0]) as f64 / 1e6,
            size(&cached[1]) as f64 / 1e6
        );
        return Ok(cached);
    }
    std::fs::create_dir_all(cache)?;
    let mut steps = (trace_mb as f64 * STEPS_PER_MB).ceil() as u64;
    for attempt in 0..2 {
        eprintln!(
            "bench merge: recording a {steps}-step simulated job over {NODES} nodes \
             (node traces of about {trace_mb} MB)"
        );
        let traces = record(cache, steps)?;
        let _ = std::fs::remove_dir_all(cache.join("rdv"));
        let _ = std::fs::remove_file(cache.join("go"));
        if fits(&traces) || attempt == 1 {
            return Ok(traces);
        }
        let smallest = traces.iter().map(|p| size(p)).min().unwrap_or(0).max(1);
        steps = (steps as f64 * target as f64 / smallest as f64 * 1.05).ceil() as u64;
    }
    unreachable!("the second attempt returns")
}

pub fn run(dir: &Path, trace_mb: u64) -> Result<Value> {
    let traces = node_traces(
        &dir.join("merge-traces").join(format!("{trace_mb}mb")),
        trace_mb,
    )?;
    let dir = dir.join("merge");
    std::fs::create_dir_all(&dir)?;
    // The merged output (1.6 GB) goes; the node traces stay cached.
    let _scratch = Scratch(dir.clone());
    let inputs: Vec<PathBuf> = (0..COPIES).flat_map(|_| traces.iter().cloned()).collect();
    let bytes: u64 = inputs
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()))
        .sum::<std::io::Result<u64>>()?;
    let (out, stats) = (dir.join("job.pftrace"), dir.join("merge.json"));
    let (mut merge_s, mut copy_s, mut rss16, mut rss2) = (vec![], vec![], vec![], vec![]);
    for round in 0..3 {
        let c = copy(&inputs)?;
        let (m, st) = merge(&inputs, &out, &stats)?;
        let (_, st2) = merge(&traces, &out, &stats)?;
        eprintln!(
            "bench merge: round {round}: read {:.0} MB/s, merge {:.0} MB/s",
            bytes as f64 / 1e6 / c,
            bytes as f64 / 1e6 / m
        );
        copy_s.push(c);
        merge_s.push(m);
        rss16.push(st["peak_rss_bytes"].as_f64().unwrap_or(0.0));
        rss2.push(st2["peak_rss_bytes"].as_f64().unwrap_or(0.0));
    }
    let (m, c) = (median(merge_s), median(copy_s));
    let result = json!({
        "inputs": inputs.len(),
        "input_mb_each": traces.iter().map(|p| std::fs::metadata(p).map(|m| m.len() as f64 / 1e6).unwrap_or(0.0)).collect::<Vec<_>>(),
        "input_mb_total": bytes as f64 / 1e6,
        "output_mb": std::fs::metadata(&out).map(|m| m.len() as f64 / 1e6).unwrap_or(0.0),
        "merge_mb_per_s": bytes as f64 / 1e6 / m,
        "read_mb_per_s": bytes as f64 / 1e6 / c,
        "merge_time_over_read": m / c,
        "peak_rss_mb_16_traces": median(rss16) / 1e6,
        "peak_rss_mb_2_traces": median(rss2) / 1e6,
    });
    println!(
        "\nmerge of {} traces ({:.0} MB in all, {:.1} MB each; medians of 3 rounds):",
        inputs.len(),
        bytes as f64 / 1e6,
        bytes as f64 / 1e6 / inputs.len() as f64
    );
    println!(
        "  agent merge: {:.0} MB/s of input, {:.1}x the time of reading the same files ({:.0} MB/s)",
        result["merge_mb_per_s"].as_f64().unwrap_or(0.0),
        result["merge_time_over_read"].as_f64().unwrap_or(0.0),
        result["read_mb_per_s"].as_f64().unwrap_or(0.0)
    );
    println!(
        "  peak RSS: {:.0} MB for 16 traces, {:.0} MB for 2 of them",
        result["peak_rss_mb_16_traces"].as_f64().unwrap_or(0.0),
        result["peak_rss_mb_2_traces"].as_f64().unwrap_or(0.0)
    );
    Ok(result)
}
