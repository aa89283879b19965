//! The launch figure of `cargo xtask bench probes`: what one kernel launch
//! through the CUDA driver costs with launch probes on.
//!
//! cuBLAS, NCCL and Triton launch with `cuLaunchKernel` (or `Ex`) straight,
//! so at `--probe-level 1` every launch of a real job hits the driver's
//! probe pair. The benchmark process calls the stand-in `cuLaunchKernel` N
//! times per measurement (a 0 ns kernel on the legacy stream, whose thread
//! runs elsewhere and polls, as a GPU takes work without a host thread
//! woken) while, in turn, nothing is attached, a bare counting
//! uprobe+uretprobe pair sits where the agent places its probe, and the
//! agent is attached at `--probe-level 1`. The figure is, per round, the
//! agent's added ns per launch over the bare pair's measured in the same
//! round, and its mean with a 95% confidence interval.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::{AgentRun, BareProbe, Placement, Target, placement};
use crate::measure::{mean_ci95, median, wait_for_closers};
use crate::root;

const FUNCTION: &str = "cuLaunchKernel";
const LAUNCHES: u64 = 100_000;
const ROUNDS: usize = 8;

impl Target {
    /// ns per launch of LAUNCHES driver launches, in their least disturbed
    /// batch (as `ns_per_call`).
    fn ns_per_launch(&mut self) -> Result<f64> {
        self.command(&format!("launches {LAUNCHES}"))?
            .get(1)
            .copied()
            .context("ns_per_launch: no least-batch figure")
    }
}

/// The launch figure, on the stand-in runtime `runtime` (the driver beside
/// it is the one probed).
pub(super) fn per_launch(runtime: &Path, dir: &Path, bare: &mut BareProbe) -> Result<Value> {
    let driver = root().join("target/fixtures/standins/lib/libcuda.so.1");
    let mut target = Target::start(runtime, Placement::DeviceElsewhere)?;
    let pid = target.pid();
    let _ = target.ns_per_launch()?; // warm-up; loads the kernel handle
    let (start, placed, first_insn) = placement(pid, &driver, FUNCTION)?;
    let at = start + placed;
    let (mut untraced, mut bare_ns, mut agent_ns, mut ratio) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let u = target.ns_per_launch()?;
        let before = bare.entries()?;
        let ids = bare.attach(&driver, at)?;
        let b = target.ns_per_launch()?;
        bare.detach(ids)?;
        let hits = bare.entries()? - before;
        if hits < LAUNCHES {
            bail!("the bare pair at {FUNCTION}+{placed} counted {hits} of {LAUNCHES} launches");
        }
        let agent = AgentRun::start(pid, dir, &["--probe-level", "1"])?;
        let a = target.ns_per_launch()?;
        let stats = agent.stop()?;
        let hits: u64 = stats["device"]["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["function"] == FUNCTION)
            .filter_map(|f| f["hits"].as_u64())
            .sum();
        if hits < LAUNCHES {
            bail!("the agent's {FUNCTION} probe counted {hits} of {LAUNCHES} launches");
        }
        if b <= u {
            bail!("round {round}: the bare pair added nothing ({b:.0} ns vs {u:.0} ns untraced)");
        }
        ratio.push((a - u) / (b - u));
        eprintln!(
            "bench probes: driver launch round {round}: untraced {u:.0} ns, bare pair {b:.0} ns, \
             agent (level 1) {a:.0} ns: agent / bare {:.3}x",
            ratio[round]
        );
        untraced.push(u);
        bare_ns.push(b);
        agent_ns.push(a);
    }
    wait_for_closers()?;
    let (u, b, a) = (median(untraced), median(bare_ns), median(agent_ns));
    let (mean, ci95) = mean_ci95(&ratio);
    Ok(json!({
        "function": FUNCTION,
        "first_instruction": first_insn,
        "agent_placement": placed,
        "launches_per_measurement": LAUNCHES,
        "rounds": ROUNDS,
        "untraced_ns_per_launch": u,
        "bare_pair_ns_per_launch": b,
        "agent_ns_per_launch": a,
        "bare_added_ns": b - u,
        "agent_added_ns": a - u,
        "agent_vs_bare": {"mean": mean, "ci95": ci95, "median": median(ratio)},
    }))
}

/// The figure as a table.
pub(super) fn print(launch: &Value) {
    let f = |k: &str| launch[k].as_f64().unwrap_or(0.0);
    let r = |k: &str| launch["agent_vs_bare"][k].as_f64().unwrap_or(0.0);
    println!(
        "\n## Driver launches: cost per launch ({FUNCTION} called straight, {LAUNCHES} per measurement, median of {ROUNDS} rounds; the agent at --probe-level 1)\n"
    );
    println!(
        "| untraced ns | bare pair ns (added) | agent ns (added) | agent / bare, per round: mean +- 95% CI | median |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| {:.0} | {:.0} ({:+.0}) | {:.0} ({:+.0}) | {:.3}x +- {:.3} | {:.3}x |",
        f("untraced_ns_per_launch"),
        f("bare_pair_ns_per_launch"),
        f("bare_added_ns"),
        f("agent_ns_per_launch"),
        f("agent_added_ns"),
        r("mean"),
        r("ci95"),
        r("median"),
    );
}
