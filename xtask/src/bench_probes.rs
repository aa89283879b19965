//! `cargo xtask bench probes`: what device-library probes cost.
//!
//! 1. Per call: one live process (`xpuscope-probe-bench`) calls the stand-in
//!    `cudaSetDevice` N times per measurement (timed in batches; the least
//!    disturbed batch counts) while, in turn and
//!    interleaved over rounds, nothing is attached; a bare uprobe+uretprobe
//!    pair that only counts (`bench_count_*` in the eBPF object) sits on
//!    the function's first instruction (where a naive tool puts it); the
//!    same bare pair sits where the agent places its probe; and the agent
//!    itself is attached (default options: its real entry and return
//!    programs, records to the ring). Done on the plain stand-in (`push
//!    %rbp` first) and on the `-fcf-protection` build (`endbr64` first,
//!    which the kernel single-steps: the agent places past it).
//! 2. Per step: the same process runs simulated training steps (1000
//!    kernel launches at 20 k/s, a stream sync, an allocation and a free),
//!    without and with the agent at its default level: rounds with the
//!    agent, each between two untraced rounds; the overhead is the mean of
//!    the per-round ratios with its 95% confidence interval, for the step's
//!    wall time and for the launching thread's CPU time. Also the default
//!    level without launch counts (`--no-launch-counts`), the default at
//!    100 k launches/s, and launch probes on at 20 k and 100 k.
//!
//! 3. Per driver launch (`launch`): `cuLaunchKernel` called straight, as
//!    cuBLAS, NCCL and Triton launch, with launch probes on against the bare
//!    uprobe pair at the same place.
//!
//! Every figure is a ratio or difference against a baseline measured in
//! the same run.

mod launch;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeLinkId, UProbeScope};
use aya::programs::{ProgramError, UProbe};
use aya::{Ebpf, EbpfLoader};
use serde_json::{Value, json};

use crate::build::{self, ChildGuard};
use crate::measure::{
    mean_ci95, median, overhead_summary, paired_overhead, wait_for_closers, wait_until_recording,
};
use crate::root;

/// The function measured: probed at the agent's default level, cheap in
/// the stand-in, and `endbr64`-first in the cf-protection build.
const FUNCTION: &str = "cudaSetDevice";
const CALLS: u64 = 100_000;
const CALL_ROUNDS: usize = 12;
const STEP_ROUNDS: usize = 24;
const STEPS_PER_ROUND: u64 = 10;

fn bench_binary() -> PathBuf {
    root().join("target/fixtures/workloads/xpuscope-probe-bench")
}

/// Where the benchmark process runs.
#[derive(Clone, Copy, Debug)]
enum Placement {
    /// Every thread on the last CPU: each launch wakes the stand-in's
    /// stream thread there, two context switches of the launching CPU.
    SameCpu,
    /// Only the launching thread on the last CPU; the stream thread (the
    /// "device") runs elsewhere and polls for work, as a GPU takes
    /// launched work without a host thread being woken.
    DeviceElsewhere,
}

/// The benchmark process and its command channel.
struct Target {
    guard: ChildGuard,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Target {
    fn start(lib: &Path, placement: Placement) -> Result<Target> {
        Self::start_with_period(lib, placement, None)
    }

    /// With `launch_ns` between a step's launches (the workload's default:
    /// 50 us, 20 k launches/s).
    fn start_with_period(
        lib: &Path,
        placement: Placement,
        launch_ns: Option<u64>,
    ) -> Result<Target> {
        // The target on the last CPU, the agent on CPU 0 (as on a node
        // where the agent does not share the training thread's core).
        let cpu = last_cpu().to_string();
        let mut cmd = match placement {
            Placement::SameCpu => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpu]).arg(bench_binary()).arg(lib);
                c
            }
            Placement::DeviceElsewhere => {
                let mut c = Command::new(bench_binary());
                c.arg(lib).arg(&cpu);
                // Stream threads poll between launches 50 us apart
                // instead of being woken by each (a GPU is not woken).
                c.env("STANDIN_STREAM_POLL_US", "500");
                c
            }
        };
        if let Some(ns) = launch_ns {
            cmd.env("PROBE_BENCH_LAUNCH_NS", ns.to_string());
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting xpuscope-probe-bench")?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("stdout")?);
        let mut t = Target {
            guard: ChildGuard(child),
            stdin,
            stdout,
        };
        let ready = t.line()?;
        if ready.trim() != "ready" {
            bail!("probe-bench: expected ready, got {ready:?}");
        }
        Ok(t)
    }

    fn pid(&self) -> u32 {
        self.guard.0.id()
    }

    fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("probe-bench exited");
        }
        Ok(line)
    }

    fn command(&mut self, cmd: &str) -> Result<Vec<f64>> {
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        Ok(numbers(&self.line()?))
    }

    /// ns per call of CALLS calls, in the least disturbed of their batches
    /// of 10,000 (`calls` in probe_bench.c): on this shared VM one batch in
    /// several runs 10-40% slower for reasons outside the benchmark, and the
    /// least one is the repeatable cost of the call.
    fn ns_per_call(&mut self) -> Result<f64> {
        self.command(&format!("calls {CALLS}"))?
            .get(1)
            .copied()
            .context("ns_per_call: no least-batch figure")
    }

    /// Runs `steps` steps; wall and calling-thread CPU ns per step.
    fn steps(&mut self, steps: u64) -> Result<(Vec<f64>, Vec<f64>)> {
        let wall = self.command(&format!("steps {steps}"))?;
        let cpu = numbers(&self.line()?);
        if wall.len() != steps as usize || cpu.len() != steps as usize {
            bail!(
                "probe-bench answered {} and {} of {steps} steps",
                wall.len(),
                cpu.len()
            );
        }
        Ok((wall, cpu))
    }

    /// One round of STEPS_PER_ROUND steps: median wall and CPU ns per step.
    fn round(&mut self) -> Result<(f64, f64)> {
        let (wall, cpu) = self.steps(STEPS_PER_ROUND)?;
        Ok((median(wall), median(cpu)))
    }
}

/// The numbers after the first word of an answer line.
fn numbers(line: &str) -> Vec<f64> {
    line.split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect()
}

/// The agent attached to a pid until dropped (SIGINT, then waits).
struct AgentRun {
    child: Option<Child>,
    stats: PathBuf,
}

impl AgentRun {
    fn start(pid: u32, dir: &Path, extra: &[&str]) -> Result<AgentRun> {
        wait_for_closers()?;
        let stats = dir.join("probes-bench-stats.json");
        let _ = std::fs::remove_file(&stats);
        let mut child = Command::new("taskset")
            .args(["-c", "0"])
            .arg(build::agent_binary())
            .args(["attach", "--pid", &pid.to_string(), "-o"])
            .arg(dir.join("probes-bench.pftrace"))
            .arg("--stats-json")
            .arg(&stats)
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the agent")?;
        wait_until_recording(&mut child)?;
        Ok(AgentRun {
            child: Some(child),
            stats,
        })
    }

    /// Stops the agent and waits until its probes are released; returns
    /// its stats.
    fn stop(mut self) -> Result<Value> {
        let mut child = self.child.take().context("agent")?;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let status = child.wait()?;
        if !status.success() {
            bail!("the agent failed: {status}");
        }
        wait_for_closers()?;
        Ok(serde_json::from_slice(&std::fs::read(&self.stats)?)?)
    }
}

impl Drop for AgentRun {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The bare counting programs, loaded once.
struct BareProbe {
    bpf: Ebpf,
}

impl BareProbe {
    fn load() -> Result<BareProbe> {
        let mut bpf = EbpfLoader::new()
            .load_file(build::ebpf_object())
            .context("loading the eBPF object for the bare probe")?;
        for name in ["bench_count_entry", "bench_count_return"] {
            program(&mut bpf, name)?
                .load()
                .with_context(|| format!("loading {name}"))?;
        }
        Ok(BareProbe { bpf })
    }

    /// Attaches the counting pair at `offset` in `lib`, for every process
    /// as the agent does (see `agent/src/device_probes.rs`); returns the
    /// links to detach.
    fn attach(&mut self, lib: &Path, offset: u64) -> Result<[UProbeLinkId; 2]> {
        let scope = UProbeScope::AllProcesses;
        let mut ids = Vec::with_capacity(2);
        for name in ["bench_count_entry", "bench_count_return"] {
            let id = program(&mut self.bpf, name)?
                .attach(UProbeAttachLocation::AbsoluteOffset(offset), lib, scope)
                .with_context(|| format!("attaching {name} at {}+{offset:#x}", lib.display()))?;
            ids.push(id);
        }
        let [entry, ret]: [UProbeLinkId; 2] =
            ids.try_into().map_err(|_| anyhow::anyhow!("two links"))?;
        Ok([entry, ret])
    }

    fn detach(&mut self, ids: [UProbeLinkId; 2]) -> Result<()> {
        for (name, id) in ["bench_count_entry", "bench_count_return"]
            .into_iter()
            .zip(ids)
        {
            program(&mut self.bpf, name)?.detach(id)?;
        }
        Ok(())
    }

    /// Entries counted so far (all CPUs).
    fn entries(&self) -> Result<u64> {
        let map = self.bpf.map("BENCH_HITS").context("BENCH_HITS")?;
        let hits = aya::maps::PerCpuArray::<_, u64>::try_from(map)?;
        Ok(hits.get(&0, 0)?.iter().sum())
    }
}

/// The uprobe program `name` of the loaded eBPF object.
pub(crate) fn program<'a>(bpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    let p: &mut UProbe = bpf
        .program_mut(name)
        .with_context(|| format!("{name} missing from the eBPF object"))?
        .try_into()
        .map_err(|e: ProgramError| anyhow::anyhow!("{name}: {e}"))?;
    Ok(p)
}

/// The function's file offset and the agent's placement offset past it,
/// from `agent probes --pid`.
fn placement(pid: u32, lib: &Path, function: &str) -> Result<(u64, u64, String)> {
    let out = Command::new(build::agent_binary())
        .args(["probes", "--pid", &pid.to_string()])
        .output()
        .context("agent probes")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(function))
        .with_context(|| {
            format!(
                "no {function} in `agent probes` for {}:\n{text}",
                lib.display()
            )
        })?;
    let cols: Vec<&str> = row.split_whitespace().collect();
    // function, address, probe file offset, first instruction..., "+N" ...
    let probe_offset = u64::from_str_radix(cols[2].trim_start_matches("0x"), 16)
        .with_context(|| format!("offset in {row:?}"))?;
    let plus = cols[3..]
        .iter()
        .find_map(|c| c.strip_prefix('+').and_then(|n| n.parse::<u64>().ok()))
        .with_context(|| format!("placement in {row:?}"))?;
    let first = row
        .split_whitespace()
        .skip(3)
        .take_while(|c| !c.starts_with('+'))
        .collect::<Vec<_>>()
        .join(" ");
    Ok((probe_offset - plus, plus, first))
}

fn last_cpu() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get() - 1)
        .unwrap_or(0)
}

/// Per-call cost on one build of the library.
fn per_call(label: &str, lib: &Path, dir: &Path, bare: &mut BareProbe) -> Result<Value> {
    let mut target = Target::start(lib, Placement::SameCpu)?;
    let pid = target.pid();
    let (start, placed, first_insn) = placement(pid, lib, FUNCTION)?;
    // Variants: untraced, bare at the first instruction, bare at the
    // agent's placement (when it differs), the agent.
    let mut names = vec!["untraced", "bare uprobe at function start"];
    if placed != 0 {
        names.push("bare uprobe at the agent's placement");
    }
    // The device-call ring as large as the scheduler ring (one 32 MiB ring
    // for both was the design before): what the small default saves.
    names.push("agent, --device-ring-size 32M");
    names.push("agent (default options)");
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    // Per round, the agent's added cost over the bare pair's at the same
    // place, the bare pair measured just before and just after the agent
    // (the VM's speed drifts between rounds by more than the difference).
    let mut paired_ratio = Vec::new();
    let same_place = if placed != 0 { start + placed } else { start };
    let _ = target.ns_per_call()?; // warm-up
    for round in 0..CALL_ROUNDS {
        let mut column = 0;
        let untraced = target.ns_per_call()?;
        samples[column].push(untraced);
        column += 1;
        let offsets: Vec<u64> = if placed != 0 {
            vec![start, start + placed]
        } else {
            vec![start]
        };
        for off in offsets {
            samples[column].push(bare_ns_per_call(&mut target, bare, lib, off)?);
            column += 1;
        }
        let bare_before = samples[column - 1][round];
        let mut agent_ns = 0.0;
        for extra in [&["--device-ring-size", "32M"][..], &[]] {
            let agent = AgentRun::start(pid, dir, extra)?;
            agent_ns = target.ns_per_call()?;
            samples[column].push(agent_ns);
            column += 1;
            let stats = agent.stop()?;
            let hits: u64 = stats["device"]["functions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|f| f["function"] == FUNCTION)
                .filter_map(|f| f["hits"].as_u64())
                .sum();
            if hits < CALLS {
                bail!("the agent's probe counted {hits} of {CALLS} calls: not attached?");
            }
        }
        let bare_after = bare_ns_per_call(&mut target, bare, lib, same_place)?;
        let bare_added = (bare_before + bare_after) / 2.0 - untraced;
        paired_ratio.push((agent_ns - untraced) / bare_added);
        eprintln!(
            "bench probes: {label} round {round}: {}, bare again {bare_after:.0} ns: agent / bare {:.3}x",
            names
                .iter()
                .zip(&samples)
                .map(|(n, s)| format!("{n} {:.0} ns", s.last().unwrap_or(&0.0)))
                .collect::<Vec<_>>()
                .join(", "),
            paired_ratio.last().unwrap_or(&0.0),
        );
    }
    wait_for_closers()?;
    let medians: Vec<f64> = samples.iter().map(|s| median(s.clone())).collect();
    let base = medians[0];
    let added: Vec<f64> = medians.iter().map(|m| m - base).collect();
    let agent_added = *added.last().unwrap_or(&0.0);
    let same_column = if placed != 0 { 2 } else { 1 };
    let bare_same_place = added[same_column];
    // Interference on this VM only ever adds time: the least of the rounds
    // is each variant's least disturbed cost (repeatable to ~0.2% between
    // runs here, where medians move by several percent).
    let least: Vec<f64> = samples
        .iter()
        .map(|s| s.iter().cloned().fold(f64::MAX, f64::min))
        .collect();
    let least_added: Vec<f64> = least.iter().map(|m| m - least[0]).collect();
    let least_ratio = least_added.last().unwrap_or(&0.0) / least_added[same_column];
    let (ratio_mean, ratio_ci) = mean_ci95(&paired_ratio);
    Ok(json!({
        "library": label,
        "function": FUNCTION,
        "first_instruction": first_insn,
        "agent_placement": placed,
        "variants": names.iter().enumerate().map(|(i, n)| json!({
            "variant": n,
            "ns_per_call": medians[i],
            "added_ns": added[i],
            "least_ns_per_call": least[i],
            "least_added_ns": least_added[i],
        })).collect::<Vec<_>>(),
        "agent_added_ns": agent_added,
        "agent_vs_bare_same_place": agent_added / bare_same_place,
        "least_agent_vs_bare_same_place": least_ratio,
        "agent_vs_bare_at_start": agent_added / added[1],
        "paired_ratio": {
            "mean": ratio_mean,
            "ci95": ratio_ci,
            "median": median(paired_ratio.clone()),
            "min": paired_ratio.iter().cloned().fold(f64::MAX, f64::min),
            "max": paired_ratio.iter().cloned().fold(f64::MIN, f64::max),
            "rounds": paired_ratio,
        },
    }))
}

/// ns per call of the target with only the bare counting pair attached at
/// file offset `off` (checked: it counted every call).
fn bare_ns_per_call(
    target: &mut Target,
    bare: &mut BareProbe,
    lib: &Path,
    off: u64,
) -> Result<f64> {
    let before = bare.entries()?;
    let ids = bare.attach(lib, off)?;
    let ns = target.ns_per_call()?;
    bare.detach(ids)?;
    let hits = bare.entries()? - before;
    if hits < CALLS {
        bail!("the bare probe at {off:#x} counted {hits} of {CALLS} calls");
    }
    Ok(ns)
}

/// What BPF run-time statistics report per run for the bare counting
/// programs (a per-CPU counter increment): almost all of it is the
/// statistics' own clock reads. The step part subtracts it from each run of
/// the agent's programs, whose statistics carry the same cost.
fn stats_floor_ns(target: &mut Target, bare: &mut BareProbe, lib: &Path, off: u64) -> Result<f64> {
    let stats_on = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("enabling BPF run-time statistics")?;
    let before = program_runs()?;
    bare_ns_per_call(target, bare, lib, off)?;
    let after = program_runs()?;
    drop(stats_on);
    let (mut ns, mut runs) = (0u64, 0u64);
    for (id, (name, t1, c1)) in &after {
        if !name.starts_with("bench_count") {
            continue;
        }
        let (_, t0, c0) = before.get(id).cloned().unwrap_or_default();
        ns += t1.saturating_sub(t0);
        runs += c1.saturating_sub(c0);
    }
    if runs < 2 * CALLS {
        bail!("run-time statistics counted {runs} runs of the bare pair for {CALLS} calls");
    }
    Ok(ns as f64 / runs as f64)
}

/// Name, run time and run count of every loaded BPF program, by id.
fn program_runs() -> Result<std::collections::HashMap<u32, (String, u64, u64)>> {
    aya::programs::loaded_programs()
        .map(|p| {
            let p = p?;
            let name = p.name_as_str().unwrap_or("").to_string();
            Ok((
                p.id(),
                (name, p.run_time().as_nanos() as u64, p.run_count()),
            ))
        })
        .collect()
}

/// What the kernel programs cost per step: one more round with the agent,
/// with BPF run-time statistics on (which add their own cost to every run:
/// see [`stats_floor_ns`]). Returns (program ns per step as reported,
/// program runs per step); the programs of both CPUs count.
fn program_time_per_step(target: &mut Target, pid: u32, dir: &Path) -> Result<(f64, f64)> {
    let agent = AgentRun::start(pid, dir, &[])?;
    let stats_on = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("enabling BPF run-time statistics")?;
    let before = program_runs()?;
    target.steps(STEPS_PER_ROUND)?;
    let after = program_runs()?;
    drop(stats_on);
    agent.stop()?;
    let (mut ns, mut runs) = (0u64, 0u64);
    for (id, (_, t1, c1)) in &after {
        let (_, t0, c0) = before.get(id).cloned().unwrap_or_default();
        ns += t1.saturating_sub(t0);
        runs += c1.saturating_sub(c0);
    }
    let steps = STEPS_PER_ROUND as f64;
    Ok((ns as f64 / steps, runs as f64 / steps))
}

/// Step-time overhead at the agent's default level: STEP_ROUNDS rounds of
/// STEPS_PER_ROUND steps with the agent, each between two untraced rounds
/// (B A B A ... B), on one live process.
/// `hit_ns`: what the kernel's uprobe+uretprobe pair costs per call without
/// any program work (the bare pair's added ns from the per-call part);
/// `stats_ns`: what run-time statistics add to each program run.
fn step_overhead(
    lib: &Path,
    dir: &Path,
    placement: Placement,
    hit_ns: f64,
    stats_ns: f64,
) -> Result<Value> {
    step_overhead_at(lib, dir, placement, hit_ns, stats_ns, None, &[])
}

/// [`step_overhead`] with `launch_ns` between launches and the agent run
/// with `agent_args` (`--probe-level 1`: every launch recorded).
fn step_overhead_at(
    lib: &Path,
    dir: &Path,
    placement: Placement,
    hit_ns: f64,
    stats_ns: f64,
    launch_ns: Option<u64>,
    agent_args: &[&str],
) -> Result<Value> {
    let mut target = Target::start_with_period(lib, placement, launch_ns)?;
    let pid = target.pid();
    let _ = target.steps(2)?; // warm-up
    let (mut base_wall, mut base_cpu) = (Vec::new(), Vec::new());
    let (mut agent_wall, mut agent_cpu) = (Vec::new(), Vec::new());
    let mut probe_hits = 0u64;
    let mut switches = 0u64;
    let (w, c) = target.round()?;
    base_wall.push(w);
    base_cpu.push(c);
    for round in 0..STEP_ROUNDS {
        let agent = AgentRun::start(pid, dir, agent_args)?;
        let (w, c) = target.round()?;
        let stats = agent.stop()?;
        agent_wall.push(w);
        agent_cpu.push(c);
        probe_hits += stats["device"]["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f["hits"].as_u64())
            .sum::<u64>();
        switches += stats["per_kind"]
            .as_array()
            .into_iter()
            .flatten()
            // The target's switches and the bystanders' (their own ring).
            .filter(|k| k["kind"] == "sched_switch" || k["kind"] == "bystander_switch")
            .filter_map(|k| k["consumed"].as_u64())
            .sum::<u64>();
        let (w, c) = target.round()?;
        base_wall.push(w);
        base_cpu.push(c);
        eprintln!(
            "bench probes: steps ({placement:?}) round {round}: untraced {:.3} ms, agent {:.3} ms, untraced {:.3} ms",
            base_wall[round] / 1e6,
            agent_wall[round] / 1e6,
            base_wall[round + 1] / 1e6,
        );
    }
    let (program_ns, program_runs) = program_time_per_step(&mut target, pid, dir)?;
    wait_for_closers()?;
    let b = median(base_wall.clone());
    let spread = (base_wall.iter().cloned().fold(f64::MIN, f64::max)
        - base_wall.iter().cloned().fold(f64::MAX, f64::min))
        / b;
    let steps = (STEP_ROUNDS as u64 * STEPS_PER_ROUND) as f64;
    let hits_per_step = probe_hits as f64 / steps;
    // Kernel-side work the agent adds to a step: its programs' run time
    // plus the uprobe traps of the probed calls.
    let attributed_ns = (program_ns - program_runs * stats_ns).max(0.0) + hits_per_step * hit_ns;
    Ok(json!({
        "placement": format!("{placement:?}"),
        "agent_args": agent_args.join(" "),
        "rounds": STEP_ROUNDS,
        "steps_per_round": STEPS_PER_ROUND,
        "untraced_step_ms": b / 1e6,
        "agent_step_ms": median(agent_wall.clone()) / 1e6,
        "untraced_step_cpu_ms": median(base_cpu.clone()) / 1e6,
        "agent_step_cpu_ms": median(agent_cpu.clone()) / 1e6,
        "wall": overhead_summary(&paired_overhead(&base_wall, &agent_wall)),
        "cpu": overhead_summary(&paired_overhead(&base_cpu, &agent_cpu)),
        "baseline_spread_percent": spread * 100.0,
        "launches_per_s": 1000.0 / (b / 1e9),
        "probe_hits_per_step": hits_per_step,
        "context_switches_per_step": switches as f64 / steps,
        "program_runs_per_step": program_runs,
        "program_ns_per_step": program_ns,
        "stats_ns_per_run": stats_ns,
        "uprobe_pair_ns": hit_ns,
        "attributed_ns_per_step": attributed_ns,
        "attributed_percent": attributed_ns / b * 100.0,
    }))
}

pub fn run(dir: &Path) -> Result<Value> {
    let standins = root().join("target/fixtures/standins");
    let plain = standins.join("lib/libcudart.so.12");
    let cfprot = standins.join("lib-cfprot/libcudart.so.12");
    let mut bare = BareProbe::load()?;
    let calls = vec![
        per_call(
            "stand-in libcudart (push %rbp first)",
            &plain,
            dir,
            &mut bare,
        )?,
        per_call(
            "stand-in libcudart, -fcf-protection (endbr64 first)",
            &cfprot,
            dir,
            &mut bare,
        )?,
    ];
    // The bare pair's added cost on the plain build, per call.
    let hit_ns = calls[0]["variants"][1]["added_ns"]
        .as_f64()
        .context("bare pair cost")?;
    let stats_ns = {
        let mut target = Target::start(&plain, Placement::SameCpu)?;
        let (start, placed, _) = placement(target.pid(), &plain, FUNCTION)?;
        stats_floor_ns(&mut target, &mut bare, &plain, start + placed)?
    };
    eprintln!("bench probes: run-time statistics add {stats_ns:.0} ns to each program run");
    let mut steps = vec![
        step_overhead(&plain, dir, Placement::DeviceElsewhere, hit_ns, stats_ns)?,
        step_overhead(&plain, dir, Placement::SameCpu, hit_ns, stats_ns)?,
    ];
    // The default level without launch counts (the launches' entry probes
    // away: what counting them costs the step), the default (launches
    // counted) at 100 k launches per second, and launch probes on (every
    // launch a record) at 20 k and 100 k: what level 1 by default would
    // cost a step.
    let level_1: &[&str] = &["--probe-level", "1"];
    for (launch_ns, args) in [
        (None, &["--no-launch-counts"][..]),
        (Some(10_000), &[][..]),
        (Some(50_000), level_1),
        (Some(10_000), level_1),
    ] {
        steps.push(step_overhead_at(
            &plain,
            dir,
            Placement::DeviceElsewhere,
            hit_ns,
            stats_ns,
            launch_ns,
            args,
        )?);
    }
    let launch = launch::per_launch(&plain, dir, &mut bare)?;

    println!(
        "\n## Device-library probes: cost per call ({FUNCTION}, {CALLS} calls per measurement, its least disturbed batch of 10,000; median of {CALL_ROUNDS} interleaved rounds; the paired ratio sets each round's agent against the bare pair at the same place just before and after it)\n"
    );
    println!(
        "| library | variant | ns per call (median) | added ns | least ns per call | least added ns |"
    );
    println!("|---|---|---|---|---|---|");
    for c in &calls {
        for v in c["variants"].as_array().into_iter().flatten() {
            let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
            println!(
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} |",
                c["library"].as_str().unwrap_or(""),
                v["variant"].as_str().unwrap_or(""),
                f("ns_per_call"),
                f("added_ns"),
                f("least_ns_per_call"),
                f("least_added_ns"),
            );
        }
        let r = |k: &str| c["paired_ratio"][k].as_f64().unwrap_or(0.0);
        println!(
            "| | agent / bare at the same place: least {:.3}x, medians {:.3}x; per round, paired: mean {:.3}x +- {:.3} (95% CI), median {:.3}x ({:.3}..{:.3}) | | | | |",
            c["least_agent_vs_bare_same_place"].as_f64().unwrap_or(0.0),
            c["agent_vs_bare_same_place"].as_f64().unwrap_or(0.0),
            r("mean"),
            r("ci95"),
            r("median"),
            r("min"),
            r("max"),
        );
    }
    println!(
        "\n## Training-step overhead (1000 launches, a sync, an allocation and a free per step), at the default level and with launch probes on\n"
    );
    println!(
        "| stream thread | agent | launches/s | untraced ms/step | agent ms/step | wall overhead: mean +- 95% CI | median (range) | launching thread CPU: mean +- 95% CI | baseline spread | probe hits/step | switches traced/step | BPF program runs/step | kernel-side cost/step |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for st in &steps {
        let f = |k: &str| st[k].as_f64().unwrap_or(0.0);
        let o = |m: &str, k: &str| st[m][k].as_f64().unwrap_or(0.0);
        println!(
            "| {} | {} | {:.0} | {:.3} | {:.3} | {:+.2}% +- {:.2}% | {:+.2}% ({:+.2}..{:+.2}) | {:+.2}% +- {:.2}% | {:.2}% | {:.1} | {:.0} | {:.0} | {:.1} us ({:.2}%) |",
            st["placement"].as_str().unwrap_or(""),
            match st["agent_args"].as_str().unwrap_or("") {
                "" => "defaults",
                a => a,
            },
            f("launches_per_s"),
            f("untraced_step_ms"),
            f("agent_step_ms"),
            o("wall", "mean_percent"),
            o("wall", "ci95_percent"),
            o("wall", "median_percent"),
            o("wall", "min_percent"),
            o("wall", "max_percent"),
            o("cpu", "mean_percent"),
            o("cpu", "ci95_percent"),
            f("baseline_spread_percent"),
            f("probe_hits_per_step"),
            f("context_switches_per_step"),
            f("program_runs_per_step"),
            f("attributed_ns_per_step") / 1e3,
            f("attributed_percent"),
        );
    }
    println!(
        "\n({STEP_ROUNDS} agent rounds of {STEPS_PER_ROUND} steps, each against the untraced rounds just before and after it; \
         kernel-side cost: the agent's BPF programs' run time per step (one more round, run-time statistics on, both CPUs, \
         less what the statistics add to each run, measured on the bare pair) plus probe hits x the bare uprobe pair's cost)"
    );
    launch::print(&launch);
    Ok(json!({"per_call": calls, "step": steps, "launch": launch}))
}
