//! `cargo xtask bench service [--compare-agent PATH]`: the always-on
//! service's CPU per record, by thread, in its steady state, and the
//! window its flight recorder's byte bound holds.
//!
//! A round starts `agent service` (the default configuration; its socket,
//! metrics port and dumps under a scratch directory), then the 8-rank
//! simulated job (`tests/sim/launch.py`, far denser in events than
//! training). After [`WARM_UP`] (the recorder full and evicting: what a
//! service that never stops does all day) it reads, over [`WINDOW`], each
//! agent thread's CPU time (`/proc/PID/task/TID/schedstat`, nanoseconds)
//! and the records the pipeline handed to the sinks
//! (`xpuscope_agent_records_total` on `/metrics`); then the recorder's
//! records and bytes (`agent ctl status`). The figure is CPU per record:
//! the job's record rate varies a little from round to round, the cost of
//! each record much less. With `--compare-agent`, rounds of the two
//! builds alternate, so the machine's drift (which moves every thread
//! alike, the ring reader's included) hits both.
//!
//! Results: `target/bench/service-results.json`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench_soak::{Job, Scratch, Service, load_average};
use crate::build;
use crate::measure::median;

/// Rounds per build.
const ROUNDS: usize = 3;
/// From the job's start to the measured window: the recorder fills its
/// 256 MiB in about 12 s on this job.
const WARM_UP: Duration = Duration::from_secs(20);
/// The measured window.
const WINDOW: Duration = Duration::from_secs(15);
/// Steps the job is given (it is stopped at the end of the round).
const JOB_STEPS: u64 = 1_000_000;

/// CPU nanoseconds of each live thread of `pid`: tid -> (name, ns).
fn thread_cpu(pid: u32) -> Result<BTreeMap<u32, (String, u64)>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let entry = entry?;
        let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        // A thread that exits between the listing and the reads is left
        // out (the service's own threads live as long as it does).
        let (Ok(comm), Ok(schedstat)) = (
            std::fs::read_to_string(entry.path().join("comm")),
            std::fs::read_to_string(entry.path().join("schedstat")),
        ) else {
            continue;
        };
        // schedstat: time on CPU (ns), time waiting, timeslices.
        let ns: u64 = schedstat
            .split_whitespace()
            .next()
            .context("schedstat")?
            .parse()?;
        // The main thread is named after the binary: one name for every
        // build compared.
        let name = if tid == pid {
            "main thread".to_string()
        } else {
            comm.trim().to_string()
        };
        out.insert(tid, (name, ns));
    }
    Ok(out)
}

/// The sum of `xpuscope_agent_records_total` over its kinds.
fn records_total(metrics: &str) -> Result<f64> {
    let mut total = 0.0;
    let mut seen = false;
    for line in metrics.lines() {
        if let Some(rest) = line.strip_prefix("xpuscope_agent_records_total{") {
            let value = rest
                .rsplit_once(' ')
                .context("a sample line")?
                .1
                .parse::<f64>()?;
            total += value;
            seen = true;
        }
    }
    if !seen {
        bail!("no xpuscope_agent_records_total on /metrics");
    }
    Ok(total)
}

/// One round with `agent`: the figures of its window.
fn round(dir: &Path, agent: &Path, tag: &str) -> Result<Value> {
    let svc = Service::start_binary(agent, dir, tag, None)?;
    let mut job = Job::start(dir, &format!("{tag}-job"), JOB_STEPS, None, None)?;
    std::thread::sleep(WARM_UP);
    if job.finished()? {
        bail!("the simulated job ended before the measured window");
    }
    let pid = svc.pid();
    let (cpu0, rec0) = (thread_cpu(pid)?, records_total(&svc.metrics()?)?);
    std::thread::sleep(WINDOW);
    let (cpu1, rec1) = (thread_cpu(pid)?, records_total(&svc.metrics()?)?);
    let status = svc.ctl(&["status"])?;
    drop(job);
    svc.stop()?;

    let records = rec1 - rec0;
    if records <= 0.0 {
        bail!("no records in the measured window");
    }
    // By thread name; a thread born in the window counts from zero.
    let mut by_name: BTreeMap<String, u64> = BTreeMap::new();
    for (tid, (name, ns)) in &cpu1 {
        let before = cpu0.get(tid).map_or(0, |(_, ns)| *ns);
        *by_name.entry(name.clone()).or_default() += ns.saturating_sub(before);
    }
    let total_ns: u64 = by_name.values().sum();
    let secs = WINDOW.as_secs_f64();
    let fr = &status["flight_recorder"];
    let held = fr["records"].as_f64().unwrap_or(0.0);
    let bytes = fr["bytes"].as_f64().unwrap_or(0.0);
    let rate = records / secs;
    Ok(json!({
        "records_per_s": rate,
        "cpu_percent": total_ns as f64 / secs / 1e7,
        "ns_per_record": total_ns as f64 / records,
        "threads_ns_per_record": by_name
            .iter()
            .map(|(name, ns)| (name.clone(), json!(*ns as f64 / records)))
            .collect::<serde_json::Map<_, _>>(),
        "recorder_records": held,
        "recorder_bytes": bytes,
        "recorder_bytes_per_record": if held > 0.0 { bytes / held } else { 0.0 },
        "recorder_window_s": held / rate,
    }))
}

/// The rounds of one build, summarized.
fn summary(rounds: &[Value]) -> Value {
    let col = |key: &str| -> Vec<f64> { rounds.iter().filter_map(|r| r[key].as_f64()).collect() };
    let mut threads: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in rounds {
        for (name, v) in r["threads_ns_per_record"].as_object().into_iter().flatten() {
            threads
                .entry(name.clone())
                .or_default()
                .push(v.as_f64().unwrap_or(0.0));
        }
    }
    let ns = col("ns_per_record");
    json!({
        "ns_per_record": ns,
        "ns_per_record_mean": ns.iter().sum::<f64>() / ns.len().max(1) as f64,
        "cpu_percent": col("cpu_percent"),
        "records_per_s_median": median(col("records_per_s")),
        "threads_ns_per_record_median": threads
            .iter()
            .map(|(name, v)| (name.clone(), json!(median(v.clone()))))
            .collect::<serde_json::Map<_, _>>(),
        "recorder_bytes_per_record_median": median(col("recorder_bytes_per_record")),
        "recorder_window_s_median": median(col("recorder_window_s")),
        "rounds": rounds,
    })
}

pub fn run(compare: Option<&Path>) -> Result<Value> {
    let scratch = Scratch::new()?;
    let dir = scratch.0.as_path();
    let load_before = load_average();
    let this = build::agent_binary();
    let mut builds: Vec<(&str, &Path)> = vec![("this build", this.as_path())];
    if let Some(c) = compare {
        builds.insert(0, ("compared", c));
    }
    let mut rounds: Vec<Vec<Value>> = vec![Vec::new(); builds.len()];
    for i in 0..ROUNDS {
        for (b, (name, agent)) in builds.iter().enumerate() {
            eprintln!("bench service: round {} of {ROUNDS}, {name}", i + 1);
            rounds[b].push(round(dir, agent, &format!("r{i}b{b}"))?);
        }
    }
    let load_after = load_average();
    let results: Vec<Value> = builds
        .iter()
        .zip(&rounds)
        .map(|((name, agent), r)| {
            let mut s = summary(r);
            s["build"] = json!(name);
            s["agent"] = json!(agent.display().to_string());
            s
        })
        .collect();

    println!(
        "\n## agent service, default configuration, 8-rank simulated job: {} s windows from {} s after the job's start, {ROUNDS} rounds per build, interleaved\n",
        WINDOW.as_secs(),
        WARM_UP.as_secs()
    );
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mut names: Vec<String> = Vec::new();
    for r in &results {
        for n in r["threads_ns_per_record_median"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(n, _)| n)
        {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    let header: Vec<String> = results
        .iter()
        .map(|r| r["build"].as_str().unwrap_or("").to_string())
        .collect();
    println!("| | {} |", header.join(" | "));
    println!("|---|{}", "---|".repeat(results.len()));
    let row = |label: &str, cell: &dyn Fn(&Value) -> String| {
        let cells: Vec<String> = results.iter().map(cell).collect();
        println!("| {label} | {} |", cells.join(" | "));
    };
    // A build's rounds, one figure each.
    let rounds = |r: &Value, key: &str, decimals: usize| -> String {
        r[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| format!("{:.*}", decimals, f(v)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    row("ns of CPU per record, rounds", &|r| {
        rounds(r, "ns_per_record", 0)
    });
    row("mean", &|r| format!("{:.0}", f(&r["ns_per_record_mean"])));
    row("% of one core, rounds", &|r| rounds(r, "cpu_percent", 2));
    row("records per second (median)", &|r| {
        format!("{:.0}", f(&r["records_per_s_median"]))
    });
    for n in &names {
        row(
            &format!("`{n}`, ns per record (median)"),
            &|r| match r["threads_ns_per_record_median"][n].as_f64() {
                Some(v) => format!("{v:.0}"),
                None => "-".into(),
            },
        );
    }
    row("flight recorder bytes per record held (median)", &|r| {
        format!("{:.0}", f(&r["recorder_bytes_per_record_median"]))
    });
    row("the window its bytes hold, s (median)", &|r| {
        format!("{:.1}", f(&r["recorder_window_s_median"]))
    });
    println!("\nload average before {load_before}, after {load_after}");
    Ok(json!({
        "builds": results,
        "warm_up_s": WARM_UP.as_secs(),
        "window_s": WINDOW.as_secs(),
        "load_average_before": load_before,
        "load_average_after": load_after,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records counter is summed over its kinds, whatever else the
    /// scrape holds; a scrape without it is an error, not zero.
    #[test]
    fn records_are_summed_over_their_kinds() {
        let text = "HTTP/1.1 200 OK\r\n\r\n# TYPE xpuscope_agent_records_total counter\n\
                    xpuscope_agent_records_total{kind=\"switch\"} 100\n\
                    xpuscope_agent_records_total{kind=\"off_cpu\"} 50.5\n\
                    xpuscope_agent_records_dropped_total 7\n";
        assert_eq!(records_total(text).unwrap(), 150.5);
        assert!(records_total("HTTP/1.1 200 OK\r\n\r\nother 1\n").is_err());
    }

    /// This process's threads are read with their names, and the CPU
    /// time of the thread that works grows.
    #[test]
    fn thread_cpu_reads_this_process() {
        let pid = std::process::id();
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        let before = thread_cpu(pid).unwrap();
        let me = before.get(&tid).expect("this thread").clone();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let after = thread_cpu(pid).unwrap();
        assert!(after[&tid].1 > me.1, "{me:?} -> {:?}", after[&tid]);
        assert!(!me.0.is_empty());
        assert_eq!(after[&pid].0, "main thread");
    }
}
