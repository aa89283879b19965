//! Helpers every benchmark part uses (so the parts do not depend on each
//! other): waiting for the agent to record or to release its probes, a
//! median, and paired overheads with their confidence interval.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Waits for the agent's "recording" line on its (piped) stderr, then keeps
/// draining stderr so the agent never blocks on a full pipe.
pub fn wait_until_recording(agent: &mut std::process::Child) -> Result<()> {
    let stderr = agent.stderr.take().context("agent stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("xpuscope: recording") => break,
            Some(Ok(_)) => continue,
            _ => bail!("the agent stopped before recording"),
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Ok(())
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Waits until no agent's `xpuscope-close` child still holds uprobes: a
/// probe being released still traps, which would bias what follows.
pub fn wait_for_closers() -> Result<()> {
    let end = Instant::now() + Duration::from_secs(120);
    loop {
        let closing = std::fs::read_dir("/proc")?.flatten().any(|e| {
            std::fs::read_to_string(e.path().join("stat")).is_ok_and(|s| closer_releasing(&s))
        });
        if !closing {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("an xpuscope-close process did not finish");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Mean, and the half-width of its 95% confidence interval (Student's t),
/// of `v`.
pub fn mean_ci95(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, t95(v.len() - 1) * (var / n).sqrt())
}

/// Two-sided 95% critical value of Student's t for `df` degrees of freedom
/// (table values; conservative between entries).
fn t95(df: usize) -> f64 {
    const TABLE: [(usize, f64); 12] = [
        (1, 12.706),
        (2, 4.303),
        (3, 3.182),
        (4, 2.776),
        (5, 2.571),
        (6, 2.447),
        (8, 2.306),
        (10, 2.228),
        (15, 2.131),
        (20, 2.086),
        (30, 2.042),
        (60, 2.000),
    ];
    TABLE
        .iter()
        .rev()
        .find(|(d, _)| *d <= df)
        .map_or(f64::INFINITY, |(_, t)| *t)
}

/// Per-round overhead in percent of one measure (e.g. time per step):
/// each traced round against the mean of the untraced rounds just before
/// and just after it, which cancels a drift of the machine's speed that
/// is linear over the three rounds.
pub fn paired_overhead(base_rounds: &[f64], agent_rounds: &[f64]) -> Vec<f64> {
    agent_rounds
        .iter()
        .enumerate()
        .map(|(r, a)| (a / ((base_rounds[r] + base_rounds[r + 1]) / 2.0) - 1.0) * 100.0)
        .collect()
}

/// Summary of paired per-round overheads: mean with its 95% interval,
/// median and range.
pub fn overhead_summary(paired: &[f64]) -> Value {
    let (mean, ci) = mean_ci95(paired);
    json!({
        "mean_percent": mean,
        "ci95_percent": ci,
        "median_percent": median(paired.to_vec()),
        "min_percent": paired.iter().cloned().fold(f64::MAX, f64::min),
        "max_percent": paired.iter().cloned().fold(f64::MIN, f64::max),
    })
}

/// Whether `/proc/PID/stat` content `stat` is an `xpuscope-close` process
/// that has not exited: one that has holds no uprobe any more (its files
/// went before it became a zombie), though it stays listed until reaped.
fn closer_releasing(stat: &str) -> bool {
    let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
        return false;
    };
    let comm = &stat[open + 1..close.max(open + 1)];
    let state = stat[close + 1..].split_whitespace().next().unwrap_or("");
    comm == "xpuscope-close" && !matches!(state, "Z" | "X" | "x")
}
