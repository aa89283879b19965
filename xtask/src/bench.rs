//! `cargo xtask bench`: overhead and throughput figures, always as ratios
//! against a baseline measured in the same run, interleaved so machine noise
//! hits every variant alike.
//!
//! 1. Scheduling capture overhead: a pinned pipe ping-pong between two
//!    threads of the target (two switches and two wakeups per round trip),
//!    without the agent, with it (no stacks), with the default sampled stack
//!    policy, and with a stack at every switch. Also: events/s the agent
//!    consumed and its drops during those runs.
//! 2. Trace writer: switch events encoded per second on one core, and bytes
//!    per switch in the file.
//! 3. A system-wide recording under load: the agent's own CPU per event and
//!    peak RSS.
//! 4. Device-library probes (`cargo xtask bench probes` alone): cost per
//!    traced call against a bare counting uprobe, and the overhead on a
//!    simulated training step (see `bench_probes`).
//! 5. `agent merge` (`cargo xtask bench merge` alone): MB/s and peak RSS
//!    merging 16 node traces (see `bench_merge`).
//! 6. `agent service` always on (`cargo xtask bench soak [--minutes N]`
//!    alone): CPU and RSS over a long run with the 8-rank simulated job,
//!    and the job's step-time overhead (see `bench_soak`).
//! 7. The service's CPU per record by thread and its flight recorder's
//!    window (`cargo xtask bench service [--compare-agent PATH]` alone,
//!    see `bench_service`).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::build::{self, ChildGuard};
use crate::measure::{median, wait_until_recording};
use crate::{clean_command, root, run_checked};

fn workload() -> std::path::PathBuf {
    root().join("target/fixtures/workloads/xpuscope-workload")
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Baseline,
    /// No agent; programs that only count on `sched_switch` and
    /// `sched_waking` (`crate::bench_floor`): what any program there costs.
    Floor,
    NoStacks,
    Sampled,
    AllStacks,
    /// The default policy under the `--compare-agent` binary (e.g. a build
    /// of the previous version), interleaved with the others.
    CompareSampled,
    /// A stack at every switch under the `--compare-agent` binary.
    CompareAll,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Baseline => "no agent",
            Variant::Floor => "counting programs only (floor)",
            Variant::NoStacks => "agent, no stacks",
            Variant::Sampled => "agent, sampled stacks (default)",
            Variant::AllStacks => "agent, stack at every switch",
            Variant::CompareSampled => "compare build, sampled stacks",
            Variant::CompareAll => "compare build, stack at every switch",
        }
    }
    fn stacks_arg(self) -> Option<&'static str> {
        match self {
            Variant::Baseline | Variant::Floor => None,
            Variant::NoStacks => Some("off"),
            Variant::Sampled => Some("sampled"),
            Variant::AllStacks => Some("all"),
            Variant::CompareSampled => Some("sampled"),
            Variant::CompareAll => Some("all"),
        }
    }
}

struct PingPongRun {
    ns_per_round_trip: f64,
    seconds: f64,
    stats: Option<Value>,
}

/// One ping-pong run of `iters` round trips, optionally under the agent.
fn pingpong(
    iters: u64,
    variant: Variant,
    dir: &Path,
    compare: Option<&Path>,
) -> Result<PingPongRun> {
    let mut wl = Command::new(workload())
        .args(["pingpong", &iters.to_string(), "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the ping-pong workload")?;
    let mut stdin = wl.stdin.take().context("stdin")?;
    let stdout = wl.stdout.take().context("stdout")?;
    let guard = ChildGuard(wl);
    let stats_path = dir.join("bench-stats.json");
    let _floor = match variant {
        Variant::Floor => Some(crate::bench_floor::Floor::attach(&[])?),
        _ => None,
    };
    let mut agent = None;
    if let Some(stacks) = variant.stacks_arg() {
        let binary = match (variant, compare) {
            (Variant::CompareSampled | Variant::CompareAll, Some(c)) => c.to_path_buf(),
            _ => build::agent_binary(),
        };
        let mut child = Command::new(binary)
            .args([
                "attach",
                "--pid",
                &guard.0.id().to_string(),
                "--stacks",
                stacks,
                "-o",
            ])
            .arg(dir.join("bench.pftrace"))
            .arg("--stats-json")
            .arg(&stats_path)
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the agent")?;
        wait_until_recording(&mut child)?;
        agent = Some(ChildGuard(child));
    }
    let started = Instant::now();
    stdin.write_all(b"go\n")?;
    stdin.flush()?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let seconds = started.elapsed().as_secs_f64();
    let result: Value = serde_json::from_str(line.trim()).context("ping-pong result")?;
    let mut stats = None;
    if let Some(mut a) = agent {
        let end = Instant::now() + Duration::from_secs(30);
        while a.0.try_wait()?.is_none() {
            if Instant::now() > end {
                bail!("the agent did not stop after the target exited");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stats = Some(serde_json::from_slice(&std::fs::read(&stats_path)?)?);
    }
    drop(guard);
    Ok(PingPongRun {
        ns_per_round_trip: result["ns_per_round_trip"]
            .as_f64()
            .context("ns_per_round_trip")?,
        seconds,
        stats,
    })
}

fn host_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// A ping-pong pair pinned to `cpu` that runs until dropped.
fn endless_pingpong(cpu: usize) -> Result<ChildGuard> {
    let mut child = Command::new(workload())
        .args(["pingpong", "1000000000000", &cpu.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("starting a ping-pong pair")?;
    child.stdin.take().context("stdin")?.write_all(b"go\n")?;
    Ok(ChildGuard(child))
}

/// `agent attach --system` for `secs` with `agent`; returns its stats.
fn record_system(agent: &Path, dir: &Path, name: &str, secs: u64, ring: &str) -> Result<Value> {
    let stats_path = dir.join(format!("{name}-stats.json"));
    run_checked(
        Command::new(agent)
            .args(["attach", "--system", "--ring-size", ring, "--duration"])
            .arg(format!("{secs}s"))
            .arg("-o")
            .arg(dir.join(format!("{name}.pftrace")))
            .arg("--stats-json")
            .arg(&stats_path)
            .stderr(Stdio::null()),
        "system-wide recording",
    )?;
    Ok(serde_json::from_slice(&std::fs::read(&stats_path)?)?)
}

/// Writes a part's figures to `dir/<part>-results.json` and says where
/// (`more`: other files it wrote, for the same line).
fn write_results(dir: &Path, part: &str, results: &Value, more: &str) -> Result<()> {
    let path = dir.join(format!("{part}-results.json"));
    std::fs::write(&path, serde_json::to_string_pretty(results)?)?;
    println!("\n(raw figures: {}{more})", path.display());
    Ok(())
}

pub fn run(
    seconds: u64,
    minutes: u64,
    only: Option<&str>,
    compare: Option<&Path>,
    trace_mb: u64,
) -> Result<()> {
    build::all()?;
    if let Some(c) = compare
        && !c.is_file()
    {
        bail!("--compare-agent {}: no such file", c.display());
    }
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    match only {
        None | Some("pingpong") => {}
        Some("probes") => {
            return write_results(&dir, "probes", &crate::bench_probes::run(&dir)?, "");
        }
        Some("merge") => {
            let merge = crate::bench_merge::run(&dir, trace_mb)?;
            return write_results(&dir, "merge", &merge, "");
        }
        Some("soak") => {
            let soak = crate::bench_soak::run(&dir, minutes)?;
            let samples = format!(", samples: {}", dir.join("soak-samples.csv").display());
            return write_results(&dir, "soak", &soak, &samples);
        }
        Some("service") => {
            let service = crate::bench_service::run(compare)?;
            return write_results(&dir, "service", &service, "");
        }
        Some(other) => {
            bail!(
                "unknown benchmark part {other:?} (known: pingpong, probes, merge, soak, service)"
            )
        }
    }

    // Calibrate the iteration count to about `seconds` per run.
    let probe = pingpong(20_000, Variant::Baseline, &dir, compare)?;
    let iters = ((seconds as f64 * 1e9) / probe.ns_per_round_trip).max(10_000.0) as u64;
    let mut variants = vec![
        Variant::Baseline,
        Variant::Floor,
        Variant::NoStacks,
        Variant::Sampled,
        Variant::AllStacks,
    ];
    if compare.is_some() {
        variants.push(Variant::CompareSampled);
        variants.push(Variant::CompareAll);
    }
    let rounds = 3;
    let mut per_variant: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut drops = vec![0u64; variants.len()];
    // The agent's own CPU per stack it took (all of its work, divided by
    // the stacks: with stacks at every switch, mostly the stacks' cost).
    let mut cpu_per_stack: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        for (i, v) in variants.iter().enumerate() {
            let r = pingpong(iters, *v, &dir, compare)?;
            eprintln!(
                "bench: round {round} {:<34} {:>8.2} us/round trip",
                v.name(),
                r.ns_per_round_trip / 1e3
            );
            per_variant[i].push(r.ns_per_round_trip);
            if let Some(s) = &r.stats {
                let events = s["events"].as_f64().unwrap_or(0.0);
                rates[i].push(events / r.seconds);
                drops[i] += s["dropped"].as_u64().unwrap_or(0);
                let stacks = s["stacks"].as_f64().unwrap_or(0.0);
                if stacks > 0.0 {
                    let cpu = s["agent_cpu_seconds"].as_f64().unwrap_or(0.0);
                    cpu_per_stack[i].push(cpu / stacks);
                }
            }
        }
    }
    let base = median(per_variant[0].clone());
    let mut sched = Vec::new();
    println!(
        "\n## Scheduling capture overhead (pinned pipe ping-pong, {iters} round trips, median of {rounds}, interleaved)\n"
    );
    println!(
        "| variant | us per round trip | ratio to no agent | agent events/s | dropped | agent CPU us per stack |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, v) in variants.iter().enumerate() {
        let m = median(per_variant[i].clone());
        let rate = if rates[i].is_empty() {
            0.0
        } else {
            median(rates[i].clone())
        };
        let per_stack = if cpu_per_stack[i].is_empty() {
            "-".to_string()
        } else {
            format!("{:.1}", median(cpu_per_stack[i].clone()) * 1e6)
        };
        println!(
            "| {} | {:.2} | {:.2}x | {} | {} | {per_stack} |",
            v.name(),
            m / 1e3,
            m / base,
            if rate > 0.0 {
                format!("{:.2} M", rate / 1e6)
            } else {
                "-".into()
            },
            if matches!(v, Variant::Baseline | Variant::Floor) {
                "-".to_string()
            } else {
                drops[i].to_string()
            }
        );
        sched.push(json!({"variant": v.name(), "ns_per_round_trip": m, "ratio": m / base, "events_per_s": rate, "dropped": drops[i]}));
    }

    if only == Some("pingpong") {
        std::fs::write(
            dir.join("pingpong-results.json"),
            serde_json::to_string_pretty(&json!({"sched_overhead": sched, "iters": iters}))?,
        )?;
        return Ok(());
    }

    // Writer throughput, in release.
    let out = clean_command("cargo")
        .args([
            "run",
            "--release",
            "--quiet",
            "-p",
            "xpuscope-perfetto",
            "--example",
            "encode_bench",
        ])
        .output()
        .context("running the writer benchmark")?;
    if !out.status.success() {
        bail!(
            "writer benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let writer: Value = serde_json::from_slice(&out.stdout).context("writer benchmark output")?;
    println!("\n## Trace writer (release, one core)\n");
    println!(
        "{:.2} M switch events/s encoded; {:.2} bytes per switch in the file",
        writer["switches_per_s"].as_f64().unwrap_or(0.0) / 1e6,
        writer["bytes_per_switch"].as_f64().unwrap_or(0.0)
    );

    // Throughput: a ping-pong pair on every CPU, recorded system-wide.
    let tput_secs = seconds.max(1) * 3;
    let pairs: Vec<ChildGuard> = (0..host_cpus())
        .map(endless_pingpong)
        .collect::<Result<_>>()?;
    let agent = build::agent_binary();
    let tput = record_system(&agent, &dir, "throughput", tput_secs, "256M")?;
    let tput_compare = match compare {
        Some(c) => Some(record_system(
            c,
            &dir,
            "throughput-compare",
            tput_secs,
            "256M",
        )?),
        None => None,
    };
    drop(pairs);
    let tput_rate =
        tput["events"].as_f64().unwrap_or(0.0) / tput["seconds"].as_f64().unwrap_or(1.0);
    println!("\n## Throughput: a pinned ping-pong pair on each CPU, --system, {tput_secs} s\n");
    println!(
        "{:.2} M scheduler events/s consumed, {} dropped (ring 256 MiB)",
        tput_rate / 1e6,
        tput["dropped"]
    );
    if let Some(t) = &tput_compare {
        println!(
            "compare build: {:.2} M scheduler events/s consumed, {} dropped",
            t["events"].as_f64().unwrap_or(0.0) / t["seconds"].as_f64().unwrap_or(1.0) / 1e6,
            t["dropped"]
        );
    }

    // A long system-wide recording under load: the agent's own cost.
    let secs = seconds.max(1) * 20;
    let load = ChildGuard(
        Command::new(workload())
            .args(["loop", &(secs + 5).to_string()])
            .stdout(Stdio::null())
            .spawn()?,
    );
    let pair = endless_pingpong(0)?;
    let sys = record_system(&agent, &dir, "system", secs, "32M")?;
    let sys_compare = match compare {
        Some(c) => Some(record_system(c, &dir, "system-compare", secs, "32M")?),
        None => None,
    };
    drop(pair);
    drop(load);
    let events = sys["events"].as_f64().unwrap_or(0.0).max(1.0);
    let cpu = sys["agent_cpu_seconds"].as_f64().unwrap_or(0.0);
    println!("\n## System-wide recording, {secs} s, demo workload and a ping-pong pair running\n");
    println!(
        "{} events, {} dropped; agent CPU {:.2} s = {:.0} ns per event (decode, symbolize with cache, encode); peak RSS {:.0} MB; trace {:.1} MB",
        events as u64,
        sys["dropped"],
        cpu,
        cpu * 1e9 / events,
        sys["agent_peak_rss_bytes"].as_f64().unwrap_or(0.0) / 1e6,
        sys["bytes"].as_f64().unwrap_or(0.0) / 1e6
    );
    if let Some(c) = &sys_compare {
        let events = c["events"].as_f64().unwrap_or(0.0).max(1.0);
        let cpu = c["agent_cpu_seconds"].as_f64().unwrap_or(0.0);
        println!(
            "compare build: {} events, {} dropped; agent CPU {:.2} s = {:.0} ns per event; peak RSS {:.0} MB",
            events as u64,
            c["dropped"],
            cpu,
            cpu * 1e9 / events,
            c["agent_peak_rss_bytes"].as_f64().unwrap_or(0.0) / 1e6,
        );
    }
    let probes = crate::bench_probes::run(&dir)?;
    let results = json!({"sched_overhead": sched, "writer": writer, "throughput": tput, "system_wide": sys, "throughput_compare": tput_compare, "system_wide_compare": sys_compare, "device_probes": probes, "iters": iters});
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    println!("\n(raw figures: {})", dir.join("results.json").display());
    Ok(())
}
