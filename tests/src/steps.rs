//! Checking a step breakdown (`agent merge`'s, `agent attach`'s) against
//! what each simulated rank logged per step (`rank<R>.steps.jsonl`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;

/// One step row: rank, step and its parts (ns) by name.
pub struct StepRow {
    pub rank: u64,
    pub step: u64,
    pub parts: BTreeMap<String, i64>,
}

/// Rows of a stats JSON's `steps` (merge and attach write the same keys).
pub fn json_step_rows(steps: &Value) -> Vec<StepRow> {
    steps
        .as_array()
        .expect("a steps array")
        .iter()
        .map(|r| StepRow {
            rank: r["rank"].as_u64().expect("rank"),
            step: r["step"].as_u64().expect("step"),
            parts: r
                .as_object()
                .unwrap()
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_i64()?)))
                .collect(),
        })
        .collect()
}

/// The `step` lines of one rank's log, into `logged` under (rank, step).
pub fn read_step_log(path: &Path, rank: u64, logged: &mut BTreeMap<(u64, u64), Value>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for line in text.lines() {
        let e: Value = serde_json::from_str(line).unwrap();
        if e["event"] == "step" {
            logged.insert((rank, e["step"].as_u64().unwrap()), e);
        }
    }
}

/// `rows` (`what` made them) hold steps 1.. of every rank in `ranks` (the
/// first has no start marker), and each agrees with what the rank logged
/// within 5% or 200 us; on these 2-vCPU machines a wakeup now and then
/// comes late by more than that (a 10 ms step, 0.6 ms off, in one of three
/// clean CI-like runs), so at most one row in 50 (and at least one) may be
/// off by up to three times the tolerance, and is printed. A gradient sync
/// the rank's own clock makes longer than ours is such a row whatever the
/// difference: the rank brackets the all-reduce and its sync with clock
/// reads, so a preemption between a read and the call (16 ranks on 2
/// vCPUs: 4 ms once) lengthens only its figure.
pub fn check_step_rows(
    what: &str,
    rows: &[StepRow],
    logged: &BTreeMap<(u64, u64), Value>,
    ranks: &BTreeSet<u64>,
    steps: u64,
) {
    let got: BTreeSet<(u64, u64)> = rows.iter().map(|r| (r.rank, r.step)).collect();
    let want: BTreeSet<(u64, u64)> = ranks
        .iter()
        .flat_map(|&r| (1..steps).map(move |s| (r, s)))
        .collect();
    assert_eq!(got, want, "{what}: steps 1.. of ranks {ranks:?}");
    assert_eq!(rows.len(), want.len(), "{what}: one row per rank and step");
    let mut worst: BTreeMap<&str, i64> = BTreeMap::new();
    let mut outliers = Vec::new();
    for row in rows {
        let (rank, step) = (row.rank, row.step);
        let log = &logged[&(rank, step)];
        check_device_parts(what, row);
        for field in ["dur_ns", "data_wait_ns", "grad_sync_ns"] {
            let ours = row.parts[field];
            let theirs = log[field].as_i64().unwrap();
            let tolerance = 200_000f64.max(0.05 * theirs as f64) as i64;
            let mut diff = (ours - theirs).abs();
            if field == "data_wait_ns" && theirs > ours {
                // The rank's clock brackets its whole dataloader_next call:
                // a preemption inside it (the queue hand-off wakes the
                // loader thread, on the same CPU) is CPU contention, which
                // the breakdown reports as `preempted` when the lost frame
                // of the libc call hides the loader from the stack.
                diff = (theirs - ours - row.parts["preempted_ns"]).max(0);
            }
            let line = format!(
                "{what}: rank {rank} step {step} {field}: {ours} ns, the rank logged {theirs} ns"
            );
            let rank_clock_longer = field == "grad_sync_ns" && theirs > ours;
            // Everything both sides have of the row: where the time went
            // instead (host, preempted, a wait), and the step's ends on
            // each clock.
            assert!(
                diff <= 3 * tolerance || rank_clock_longer,
                "{line}\n  ours: {:?}\n  the rank's: {log}",
                row.parts
            );
            if diff > tolerance {
                outliers.push(line);
            }
            let w = worst.entry(field).or_default();
            *w = (*w).max(diff);
        }
    }
    let allowed = (rows.len() / 50).max(1);
    assert!(
        outliers.len() <= allowed,
        "{what}: {} rows off by more than 5% or 200 us (at most {allowed}):\n{}",
        outliers.len(),
        outliers.join("\n")
    );
    for o in &outliers {
        eprintln!("{o} (outside 5% or 200 us; within 3 times that)");
    }
    eprintln!(
        "{what}: step breakdown's worst differences from the ranks' own logs (ns): {worst:?}"
    );
}

/// Compute, communication and exposed communication hold together: the
/// exposed part of the communication, the communication and the compute
/// each within the step, and the syncs that waited for each within it.
fn check_device_parts(what: &str, row: &StepRow) {
    let p = |k: &str| {
        *row.parts
            .get(k)
            .unwrap_or_else(|| panic!("{what}: no {k} in rank {} step {}", row.rank, row.step))
    };
    let (dur, compute, comm, exposed) = (
        p("dur_ns"),
        p("compute_ns"),
        p("comm_ns"),
        p("exposed_comm_ns"),
    );
    let line = format!(
        "{what}: rank {} step {}: dur {dur}, compute {compute} (waited {}), communication {comm} (waited {}), exposed {exposed}",
        row.rank,
        row.step,
        p("compute_wait_ns"),
        p("comm_wait_ns")
    );
    assert!(
        0 <= exposed && exposed <= comm && comm <= dur && compute <= dur,
        "{line}"
    );
    assert!(p("compute_wait_ns") <= compute, "{line}");
    assert!(p("comm_wait_ns") <= comm, "{line}");
}

/// With launches recorded (`--probe-level 1`), a step's compute (from the
/// first work enqueued on a stream to the sync that waited for it) holds
/// the device time of every kernel the rank logged launching in it
/// (`kernel_ns`), within 5% or 200 us; the rank's own clock reads bracket
/// the step, so it is at most the step.
pub fn check_compute_against_kernels(
    what: &str,
    rows: &[StepRow],
    logged: &BTreeMap<(u64, u64), Value>,
) {
    let mut least = f64::MAX;
    for row in rows {
        let kernels = logged[&(row.rank, row.step)]["kernel_ns"]
            .as_i64()
            .expect("kernel_ns logged");
        let compute = row.parts["compute_ns"];
        let tolerance = 200_000f64.max(0.05 * kernels as f64) as i64;
        assert!(
            compute + tolerance >= kernels,
            "{what}: rank {} step {}: compute {compute} ns, the rank launched {kernels} ns of kernels",
            row.rank,
            row.step
        );
        least = least.min(compute as f64 / kernels.max(1) as f64);
    }
    eprintln!("{what}: compute over the kernels' logged time: at least {least:.3}");
}

/// The summary's "slowest steps" lines (after its heading).
pub fn slowest_listed(summary: &str) -> Vec<&str> {
    summary
        .lines()
        .skip_while(|l| !l.contains("slowest steps (of"))
        .skip(1)
        .take_while(|l| l.trim_start().starts_with("rank "))
        .collect()
}
