//! `agent merge`: the simulated job over several "nodes" (one launcher per
//! node, each in its own UTS namespace), one `agent attach` per node
//! launcher plus one agent following every rank. One node's trace is
//! rewritten as if its clocks were off; the merge must undo that from the
//! job's collectives and give the same collectives, members and order as
//! the one-agent trace of all ranks, with every rank labelled by node and
//! parallel group, and pass the independent decoder and importer rules.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::Path;

use serde_json::Value;
use xpuscope_tests::agent::exclusive;
use xpuscope_tests::cluster::{
    ClusterRun, merge, relabel_job, run_cluster, shift_trace, strip_clock_snapshots,
};
use xpuscope_tests::steps::{
    StepRow, check_step_rows, json_step_rows, read_step_log, slowest_listed,
};
use xpuscope_tests::trace_check::{ArgValue, Timeline, TrackKind, check_importer_rules, decode};

/// BOOTTIME of the shifted node reads this much later (it booted earlier)...
const D_NS: i64 = 2_500_000_000;
/// ...and its wall clock is this much fast.
const E_NS: i64 = 30_000_000;
/// The merge must recover D to within this (the bound). Two-node
/// runs of these tests on a shared 2-CPU VM at load 5-10 recovered it
/// within 0-19 us (16 runs; interquartile mean of the end differences;
/// docs/src/measurements/merge.md).
const TOLERANCE_NS: i64 = 50_000;
/// Sixteen ranks and five agents on two CPUs: the ranks see a
/// collective's end 0.1-0.6 ms late in the median. With the weighted fit
/// of the all-reduce and send/receive bounds (4 runs, commit 83987b7) every
/// node came out within 2-34 us (the unshifted nodes 2 and 3 are held to
/// twice this); with the all-reduce bounds alone node 1 was 74-90 us off
/// in two CI runs, with the interquartile mean alone 4-88 us (4 runs).
/// With another end-to-end test running beside it (the fresh-clone run of
/// commit b336322), or two busy loops on the same CPUs, node 1 came out
/// 22-59 us off (5 runs): twice the two-node bound holds that.
const TOLERANCE_16_RANKS_NS: i64 = 100_000;
/// A node is placed by the midpoints of the causality intervals that join
/// it to node 0, each off by half the difference of its two sides'
/// quickest wake-ups after a collective: a share of the interval's width
/// that a loaded host makes larger. Fresh-clone CI runs, with other
/// end-to-end tests on the two CPUs, put nodes off by 5.5 % of their
/// stated half width (the 16-rank job's nodes 1 and 3 424 us off, inside
/// the 7.7 ms stated; commit 5816acd) and 8.2 % (a two-node job's node 1
/// 71 us off, inside 864 us; the commit after it). A node is held to the
/// tolerance or this fraction of its stated half width, whichever is
/// larger, and always to the interval the merge states.
const HALF_WIDTH_FRACTION: i64 = 6;

fn timeline(path: &Path) -> Timeline {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let trace = decode(&bytes).expect("decodes with the official schema");
    if let Err(errors) = check_importer_rules(&trace) {
        panic!(
            "{}: importer rules broken:\n{}",
            path.display(),
            errors.join("\n")
        );
    }
    Timeline::new(&trace)
}

fn label<'a>(labels: &'a [String], key: &str) -> Option<&'a str> {
    labels
        .iter()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// pid -> (rank, process name, labels) of every ranked process track.
fn ranks(tl: &Timeline) -> BTreeMap<i32, (u64, String, Vec<String>)> {
    tl.tracks
        .values()
        .filter_map(|t| match &t.kind {
            TrackKind::Process { pid, name, labels } => Some((
                *pid,
                (
                    label(labels, "rank")?.parse().ok()?,
                    name.clone().unwrap_or_default(),
                    labels.clone(),
                ),
            )),
            _ => None,
        })
        .collect()
}

/// (collective "hash:seq", rank) -> (start, end) of every exact collective.
fn collectives(tl: &Timeline) -> BTreeMap<(String, u64), (u64, u64)> {
    let ranks = ranks(tl);
    let mut out = BTreeMap::new();
    for s in &tl.slices {
        let Some(TrackKind::Thread { pid, .. }) = tl.tracks.get(&s.track).map(|t| &t.kind) else {
            continue;
        };
        let (Some(ArgValue::Str(hash)), Some(ArgValue::Uint(seq)), Some(ArgValue::Bool(true))) =
            (s.arg("comm_hash"), s.arg("seq"), s.arg("seq_exact"))
        else {
            continue;
        };
        let Some((rank, _, _)) = ranks.get(pid) else {
            continue;
        };
        let key = format!("{hash}:{seq}");
        if let Some(ArgValue::Str(id)) = s.arg("collective_id") {
            assert_eq!(
                id, &key,
                "the shared id names the communicator and sequence"
            );
        }
        out.insert((key, *rank), (s.ts, s.end.unwrap_or(s.ts)));
    }
    out
}

/// Every exact collective of the merged trace carries its shared id
/// (communicator:sequence) and its communicator's group kind as the
/// summary's table gives it.
fn check_collective_tags(tl: &Timeline, st: &Value) {
    let kinds: BTreeMap<&str, &str> = st["groups"]["communicators"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["comm_hash"].as_str().unwrap(),
                c["kind"].as_str().unwrap(),
            )
        })
        .collect();
    let mut tagged = 0;
    for s in &tl.slices {
        let (Some(ArgValue::Str(hash)), Some(ArgValue::Uint(seq)), Some(ArgValue::Bool(true))) =
            (s.arg("comm_hash"), s.arg("seq"), s.arg("seq_exact"))
        else {
            continue;
        };
        assert_eq!(
            s.arg("collective_id"),
            Some(&ArgValue::Str(format!("{hash}:{seq}"))),
            "{s:?}"
        );
        assert_eq!(
            s.arg("group"),
            Some(&ArgValue::Str(kinds[hash.as_str()].to_owned())),
            "{s:?}"
        );
        tagged += 1;
    }
    assert!(tagged > 50, "{tagged} collectives tagged");
}

fn stats(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).expect("stats written")).expect("stats JSON")
}

/// How far apart two agents stamp the same calls on this machine, measured
/// in this run: every node's trace as recorded (the shift is applied to a
/// copy) and the all-ranks trace hold the same calls of that node's ranks
/// on one clock, so their differences are the probes' stamping alone (each
/// agent's uprobe runs in turn on every call; on a slow machine a rank can
/// be preempted between the two, tens of microseconds). (90th percentile,
/// maximum) of |difference|, start and end, over every node's calls.
fn stamping_skew(run: &ClusterRun, all: &Timeline) -> (i64, i64) {
    let all = collectives(all);
    let mut d: Vec<i64> = Vec::new();
    for trace in &run.node_traces {
        let node = collectives(&timeline(trace));
        d.extend(
            node.iter()
                .filter_map(|(k, (ts, end))| {
                    let (ats, aend) = all.get(k)?;
                    Some([
                        (*ts as i64 - *ats as i64).abs(),
                        (*end as i64 - *aend as i64).abs(),
                    ])
                })
                .flatten(),
        );
    }
    assert!(
        d.len() > 20 * run.node_traces.len(),
        "the nodes' collectives in both traces: {}",
        d.len()
    );
    d.sort_unstable();
    (d[d.len() * 9 / 10], *d.last().unwrap())
}

/// Merges node 0's trace and node 1's shifted by D (REALTIME by E), the
/// rest as recorded, and checks the result against the one-agent trace.
fn check_merge(run: &ClusterRun, tolerance_ns: i64) {
    let all_tl = timeline(&run.all_trace);
    let (skew_p90, skew_max) = stamping_skew(run, &all_tl);
    eprintln!("two agents' stamps of one call: p90 {skew_p90} ns, max {skew_max} ns");
    // The alignment bound holds over the machine's own stamping noise.
    let tolerance_ns = tolerance_ns + skew_p90;
    let dir = run.dir.path();
    let mut inputs = run.node_traces.clone();
    let shifted = dir.join("node1-shifted.pftrace");
    let original = std::fs::read(&inputs[1]).expect("node 1 trace");
    std::fs::write(&shifted, shift_trace(&original, D_NS, E_NS)).expect("write shifted");
    inputs[1] = shifted;
    let out = dir.join("job.pftrace");
    let stats_path = dir.join("merge.json");
    let csv = dir.join("steps.csv");
    let mut args: Vec<&OsStr> = vec![OsStr::new("-o"), out.as_os_str()];
    args.extend([OsStr::new("--stats-json"), stats_path.as_os_str()]);
    args.extend([OsStr::new("--steps-csv"), csv.as_os_str()]);
    args.extend(inputs.iter().map(|p| p.as_os_str()));
    let (status, stdout, stderr) = merge(&args);
    assert!(status.success(), "merge failed:\n{stdout}\n{stderr}");
    eprintln!("{stdout}");
    let st = stats(&stats_path);
    let nodes = st["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), run.nodes.len());
    assert_eq!(nodes[0]["offset_ns"], 0);
    // Every node's alignment error: node 1 was shifted by D, the others
    // share node 0's clock. Held to the tolerance (twice it for nodes 2
    // and up, which nothing shifted) or to a share of the interval the
    // merge states, whichever is larger; the truth always lies inside that
    // interval.
    let mut max_err = 0;
    let mut node1_bar = tolerance_ns;
    for (k, n) in nodes.iter().enumerate().skip(1) {
        let truth = if k == 1 { -D_NS } else { 0 };
        let off = n["offset_ns"].as_i64().expect("offset");
        let err = off - truth;
        let bounds = n["bounds_ns"]
            .as_array()
            .map(|b| (b[0].as_i64().unwrap(), b[1].as_i64().unwrap()));
        if let Some((lo, hi)) = bounds {
            assert!(
                lo <= truth && truth <= hi,
                "node {k}: the true offset {truth} ns outside the stated {lo}..{hi}"
            );
        }
        let tolerance = if k == 1 {
            tolerance_ns
        } else {
            2 * tolerance_ns
        };
        let bar = bounds.map_or(tolerance, |(lo, hi)| {
            tolerance.max((hi - lo) / 2 / HALF_WIDTH_FRACTION)
        });
        assert!(
            err.abs() <= bar,
            "node {k}'s offset {off} ns, expected {truth} ns within {bar} (bounds {bounds:?})"
        );
        max_err = max_err.max(err.abs());
        if k == 1 {
            node1_bar = bar;
        }
    }
    // The correction over REALTIME is node 1's offset error plus the wall
    // clock's: E, give or take the offset's error and the microseconds
    // between two agents' clock snapshots.
    let corr = nodes[1]["correction_ns"].as_i64().expect("correction");
    assert!(
        (corr + E_NS).abs() <= node1_bar + TOLERANCE_NS,
        "correction over REALTIME {corr} ns, expected {} ns",
        -E_NS
    );
    for (k, n) in nodes.iter().enumerate() {
        assert_eq!(
            n["hostname"],
            format!("node-{k}"),
            "hostname from the trace"
        );
        assert!(n["matched_collectives"].as_u64().unwrap() >= 15, "{n:#}");
        // Sixteen ranks and five agents share two CPUs here: wakeups after
        // a collective scatter by tens of microseconds.
        assert!(
            n["residual_median_ns"].as_u64().unwrap() < 1_000_000,
            "{n:#}"
        );
        let want: Vec<u64> = run.nodes[k]["node"]["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap())
            .collect();
        assert_eq!(n["ranks"], serde_json::json!(want));
    }

    // Groups: the launcher's layout, from the communicators alone.
    let truth: BTreeMap<u64, &Value> = run.job["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["rank"].as_u64().unwrap(), r))
        .collect();
    let layout = &run.job["layout"];
    assert_eq!(st["groups"]["tp_size"], layout["tp"]);
    assert_eq!(st["groups"]["pp_size"], layout["pp"]);
    assert_eq!(st["groups"]["dp_size"], layout["dp"]);
    for (r, t) in &truth {
        let g = &st["groups"]["ranks"][r.to_string()];
        assert_eq!(
            (&g["tp"], &g["pp"], &g["dp"]),
            (&t["tp_rank"], &t["pp_stage"], &t["dp_rank"]),
            "rank {r}"
        );
    }
    let comms = st["groups"]["communicators"].as_array().unwrap();
    assert_eq!(
        comms.len(),
        run.job["communicators"].as_array().unwrap().len()
    );
    for c in run.job["communicators"].as_array().unwrap() {
        assert!(
            comms
                .iter()
                .any(|g| g["kind"] == c["kind"] && g["members"] == c["members"]),
            "communicator {c} found as {}",
            c["kind"]
        );
    }

    // The merged trace: ranks named by rank, groups and node; the same
    // collectives as the one-agent trace, at the same times.
    let merged = timeline(&out);
    let all = all_tl;
    let by_pid = ranks(&merged);
    assert_eq!(by_pid.len(), truth.len(), "one process per rank");
    for (rank, name, labels) in by_pid.values() {
        let t = truth[rank];
        let node = run
            .nodes
            .iter()
            .position(|n| {
                n["node"]["ranks"]
                    .as_array()
                    .unwrap()
                    .contains(&Value::from(*rank))
            })
            .expect("rank on a node");
        assert_eq!(
            name,
            &format!(
                "rank {rank} (tp {}, pp {}, dp {}) node-{node}",
                t["tp_rank"], t["pp_stage"], t["dp_rank"]
            )
        );
        assert_eq!(label(labels, "node"), Some(format!("node-{node}").as_str()));
        assert_eq!(label(labels, "tp"), Some(t["tp_rank"].to_string().as_str()));
    }
    check_collective_tags(&merged, &st);
    let m = collectives(&merged);
    let a = collectives(&all);
    assert!(
        a.len() > 50,
        "the one-agent trace has {} collectives",
        a.len()
    );
    let mk: BTreeSet<_> = m.keys().collect();
    let ak: BTreeSet<_> = a.keys().collect();
    assert_eq!(mk, ak, "the same collectives on the same ranks");
    let mut worst = 0i64;
    for (k, (ts, end)) in &m {
        let (ats, aend) = a[k];
        worst = worst
            .max((*ts as i64 - ats as i64).abs())
            .max((*end as i64 - aend as i64).abs());
    }
    // A node's alignment error, plus two agents' probes on one call
    // stamping it apart (measured above; a few microseconds on a quick
    // machine). A merged call is its node's stamp moved by the node's
    // offset, so it is off by exactly that sum when the call with the
    // largest skew errs the same way as its node's offset (seen in CI:
    // 21,376 + 53,770 = 75,146 ns): the bound includes it.
    assert!(
        worst <= max_err + 50_000.max(skew_max),
        "a merged collective is {worst} ns away from the one-agent trace's \
         (alignment error up to {max_err} ns, stamping skew up to {skew_max} ns)"
    );
    let order = |c: &BTreeMap<(String, u64), (u64, u64)>| {
        let mut per: BTreeMap<u64, Vec<(u64, String)>> = BTreeMap::new();
        for ((id, r), (ts, _)) in c {
            per.entry(*r).or_default().push((*ts, id.clone()));
        }
        per.into_iter()
            .map(|(r, mut v)| {
                v.sort();
                (r, v.into_iter().map(|(_, id)| id).collect::<Vec<_>>())
            })
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(
        order(&m),
        order(&a),
        "each rank's collectives in the same order"
    );
    check_steps(run, &csv, &merged, &st);
}

/// What every rank logged per step: (rank, step) -> its log line.
fn logged_steps(run: &ClusterRun) -> BTreeMap<(u64, u64), Value> {
    let mut logged = BTreeMap::new();
    for (k, node) in run.nodes.iter().enumerate() {
        for r in node["ranks"].as_array().unwrap() {
            let path = run
                .rdv
                .join(format!("node{k}"))
                .join(r["step_log"].as_str().unwrap());
            read_step_log(&path, r["rank"].as_u64().unwrap(), &mut logged);
        }
    }
    logged
}

/// Step breakdown against what each rank logged (`rank<R>.steps.jsonl`),
/// within 5% or 200 us, for every step but the first (it has no start
/// marker) of every rank: the merge's CSV, stats JSON and slices, and each
/// `agent attach`'s own summary (the one on every rank and each node's).
fn check_steps(run: &ClusterRun, csv: &Path, merged: &Timeline, st: &Value) {
    let text = std::fs::read_to_string(csv).expect("steps CSV written");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    assert_eq!(header[..3], ["rank", "node", "step"]);
    let rows: Vec<StepRow> = lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            StepRow {
                rank: cells[0].parse().unwrap(),
                step: cells[2].parse().unwrap(),
                parts: header
                    .iter()
                    .zip(&cells)
                    .skip(3)
                    .map(|(h, c)| (h.to_string(), c.parse().unwrap()))
                    .collect(),
            }
        })
        .collect();
    assert_eq!(rows.len(), st["steps"].as_array().unwrap().len());
    let logged = logged_steps(run);
    let steps = run.job["steps"].as_u64().unwrap();
    let all_ranks: BTreeSet<u64> = run.job["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_u64().unwrap())
        .collect();
    check_step_rows("merge", &rows, &logged, &all_ranks, steps);
    // A slice per step on each rank's "steps" track.
    let step_slices = merged
        .slices
        .iter()
        .filter(|s| s.name.starts_with("step "))
        .count();
    assert_eq!(step_slices, rows.len());

    // One node's trace too: every attach's summary has its ranks' steps.
    let mut attaches = vec![("attach on every rank", &run.all_trace, all_ranks.clone())];
    for (k, trace) in run.node_traces.iter().enumerate() {
        let ranks = run.nodes[k]["node"]["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap())
            .collect();
        attaches.push(("attach on one node", trace, ranks));
    }
    for (i, (what, trace, ranks)) in attaches.iter().enumerate() {
        let stats = stats(&trace.with_extension("json"));
        let rows = json_step_rows(&stats["steps"]);
        check_step_rows(&format!("{what} ({i})"), &rows, &logged, ranks, steps);
        // The summary names the slowest of them and its dominant part.
        let slowest = rows
            .iter()
            .max_by_key(|r| (r.parts["dur_ns"], std::cmp::Reverse((r.rank, r.step))))
            .unwrap();
        let log = &run.agent_logs[i];
        let listed = *slowest_listed(log)
            .first()
            .unwrap_or_else(|| panic!("{what}: no slowest steps in the summary:\n{log}"));
        assert!(
            listed.contains(&format!(
                "rank {:<4} step {:<5}",
                slowest.rank, slowest.step
            )) && listed.contains("mostly "),
            "{what}: the slowest step is rank {} step {}; the summary lists:\n{log}",
            slowest.rank,
            slowest.step
        );
    }
}

#[test]
fn two_nvidia_nodes_merge_into_one_aligned_timeline() {
    let _x = exclusive();
    let run = run_cluster(
        "merge-nv",
        2,
        &[
            "--world-size",
            "4",
            "--tp",
            "2",
            "--dp",
            "2",
            "--pp",
            "1",
            "--steps",
            "30",
        ],
    );
    check_merge(&run, TOLERANCE_NS);
    bad_inputs(&run);
}

#[test]
fn faults_on_one_node_show_in_the_merged_step_breakdown() {
    // A late arrival, a data-loader stall and a slow rank, all on node 1:
    // the breakdown follows each rank's own log through all of them.
    let _x = exclusive();
    let run = run_cluster(
        "merge-faults",
        2,
        &[
            "--world-size",
            "4",
            "--tp",
            "1",
            "--dp",
            "4",
            "--pp",
            "1",
            "--steps",
            "16",
            "--fault",
            "delay:rank=2,step=5,ms=150",
            "--fault",
            "dataloader_stall:rank=3,step=9,ms=120",
            "--fault",
            "slow:rank=3,factor=2,from_step=12",
        ],
    );
    check_merge(&run, TOLERANCE_NS);
    check_diagnose_parity(&run);
}

/// `agent diagnose` over the node traces (one agent per node) gives the
/// findings it gives over the one trace of every rank (ranks matched
/// across traces by communicator hash and number): the same kinds, ranks,
/// communicators, numbers and steps, grouped into the same incidents, with
/// rank 2's late arrival at step 5 (ground truth) among them as a root.
fn check_diagnose_parity(run: &ClusterRun) {
    let diagnose = |traces: &[&Path]| -> Vec<(String, String, String, String, String, String)> {
        let json = run.dir.path().join("findings.json");
        let out = std::process::Command::new(xpuscope_tests::agent::agent_bin())
            .arg("diagnose")
            .arg("--json")
            .arg(&json)
            .args(traces)
            .output()
            .expect("run agent diagnose");
        let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap_or_else(|e| {
            panic!(
                "the findings ({e}): {}",
                String::from_utf8_lossy(&out.stderr)
            )
        }))
        .unwrap();
        xpuscope_tests::device::assert_diagnose_status(
            &out.status,
            doc["findings"].as_array().expect("a list"),
            &String::from_utf8_lossy(&out.stderr),
        );
        let list = doc["findings"].as_array().expect("a list");
        // The finding each follows from, by its kind and ranks (ids differ
        // with the order), or "root": the same incidents both ways.
        let cause_of = |f: &Value| match f.get("cause") {
            None => "root".to_string(),
            Some(id) => list
                .iter()
                .find(|g| g["id"] == *id)
                .map(|g| format!("{} {}", g["kind"], g["ranks"]))
                .unwrap_or_else(|| panic!("the cause of {f} is in the document")),
        };
        let mut found: Vec<_> = list
            .iter()
            .map(|f| {
                (
                    f["kind"].to_string(),
                    f["ranks"].to_string(),
                    f["comm"].to_string(),
                    f["seq"].to_string(),
                    f["step"].to_string(),
                    cause_of(f),
                )
            })
            .collect();
        found.sort();
        found
    };
    let nodes: Vec<&Path> = run.node_traces.iter().map(|p| p.as_path()).collect();
    let per_node = diagnose(&nodes);
    let all = diagnose(&[run.all_trace.as_path()]);
    assert_eq!(per_node, all, "node traces against the trace of all ranks");
    let late = per_node
        .iter()
        .find(|f| f.0 == "\"late_arrival\"" && f.1 == "[2]")
        .unwrap_or_else(|| panic!("rank 2's late arrival: {per_node:#?}"));
    let step: u64 = late.4.parse().expect("a step");
    assert!(step.abs_diff(5) <= 2, "{late:?}");
    assert_eq!(
        late.5, "root",
        "the injected delay is a root: {per_node:#?}"
    );
}

/// Rank 5 of an 8-rank job (tp 2, pp 2, dp 2) on two nodes (ranks 4-7 on
/// node 1) stops before step 2's gradient all-reduce; its peers on both
/// nodes wait for it, through every communicator, until the launchers'
/// timeout stops the job. `agent diagnose` (hang timeout 2 s, otherwise
/// its defaults) over the two node traces gives one incident rooted at
/// rank 5's hang, every other finding its consequence, as over the trace
/// of all ranks: the wait-for chain crosses the nodes.
#[test]
fn a_hang_across_nodes_is_one_incident_over_the_node_traces() {
    let _x = exclusive();
    let mut args = xpuscope_tests::device::TP2_PP2_DP2.to_vec();
    args.extend([
        "--steps",
        "6",
        "--fault",
        "hang:rank=5,step=2",
        // The ranks start 5 s in (`run_cluster`'s init delay); the peers
        // that wait for the peers that wait for rank 5 enter their waits
        // last: every wait is past the 2 s hang timeout when the launchers
        // stop the job.
        "--timeout",
        "14",
    ]);
    let run = run_cluster("merge-hang", 2, &args);
    let diagnose = |traces: &[&Path]| -> Vec<Value> {
        let out = std::process::Command::new(xpuscope_tests::agent::agent_bin())
            .args(["diagnose", "--json", "-", "--hang-timeout", "2s"])
            .args(traces)
            .output()
            .expect("run agent diagnose");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let doc: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("the findings on stdout ({e}): {stderr}"));
        let found = doc["findings"].as_array().expect("a list").clone();
        xpuscope_tests::device::assert_diagnose_status(&out.status, &found, &stderr);
        found
    };
    let nodes: Vec<&Path> = run.node_traces.iter().map(|p| p.as_path()).collect();
    for (what, found) in [
        ("node traces", diagnose(&nodes)),
        ("all ranks", diagnose(&[run.all_trace.as_path()])),
    ] {
        let shown: Vec<String> = found
            .iter()
            .map(|f| {
                format!(
                    "#{} {} {} cause {}",
                    f["incident"], f["kind"], f["ranks"], f["cause"]
                )
            })
            .collect();
        let roots: Vec<&Value> = found.iter().filter(|f| f.get("cause").is_none()).collect();
        assert_eq!(roots.len(), 1, "{what}: one incident: {shown:#?}");
        assert_eq!(roots[0]["kind"], "hang", "{what}: {shown:#?}");
        assert_eq!(
            roots[0]["ranks"],
            serde_json::json!([5]),
            "{what}: {shown:#?}"
        );
        assert!(
            found.len() > 1 && found.iter().skip(1).all(|f| f["cause"].is_u64()),
            "{what}: its peers' hangs are its consequences: {shown:#?}"
        );
    }
}

#[test]
fn four_nodes_of_a_16_rank_job_merge_with_their_groups() {
    // tp2 pp2 dp4 over 4 nodes of 4 ranks: DP groups join nodes 0-1 and
    // 2-3, pipeline pairs join 0-2 and 1-3, so aligning every node to the
    // first takes more than one hop.
    let _x = exclusive();
    let run = run_cluster(
        "merge-16",
        4,
        &[
            "--world-size",
            "16",
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp",
            "4",
            "--steps",
            "12",
            // Sixteen ranks on two CPUs: a rank's own clock reads can lag
            // its calls by a few hundred microseconds; longer gradient
            // all-reduces keep that within the 5% the breakdown is held to.
            "--grad-mb",
            "48",
        ],
    );
    check_merge(&run, TOLERANCE_16_RANKS_NS);
    check_clean(&run);
}

/// A clean job: `agent diagnose` at its defaults finds nothing, over the
/// node traces and over the trace of all ranks (sixteen ranks and five
/// agents on two CPUs delay a rank by 10-20 ms now and then: a fraction of
/// a step, which the thresholds judged against the job do not report).
fn check_clean(run: &ClusterRun) {
    let mut sets: Vec<Vec<&Path>> = vec![run.node_traces.iter().map(|p| p.as_path()).collect()];
    sets.push(vec![run.all_trace.as_path()]);
    for traces in sets {
        let out = std::process::Command::new(xpuscope_tests::agent::agent_bin())
            .arg("diagnose")
            .args(&traces)
            .output()
            .expect("run agent diagnose");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.starts_with("no findings"),
            "a clean job over {} trace(s): {stdout}",
            traces.len()
        );
    }
}

#[test]
fn two_ascend_nodes_of_a_tp_pp_dp_job_merge_with_their_groups() {
    let _x = exclusive();
    let run = run_cluster(
        "merge-npu",
        2,
        &[
            "--flavor",
            "ascend",
            "--world-size",
            "8",
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp",
            "2",
            "--steps",
            "20",
        ],
    );
    check_merge(&run, TOLERANCE_NS);
}

/// Traces of another job are refused by name (merged with --force); a cut
/// trace is merged up to its last complete packet and said so; a node
/// whose pids clash with another's keeps its processes apart.
fn bad_inputs(run: &ClusterRun) {
    let dir = run.dir.path();
    let node0 = &run.node_traces[0];
    let bytes = std::fs::read(node0).unwrap();
    let other = dir.join("other-job.pftrace");
    std::fs::write(
        &other,
        relabel_job(&std::fs::read(&run.node_traces[1]).unwrap(), "another"),
    )
    .unwrap();
    let out = dir.join("bad.pftrace");
    let (status, stdout, stderr) = merge(&[
        OsStr::new("-o"),
        out.as_os_str(),
        node0.as_os_str(),
        other.as_os_str(),
    ]);
    assert!(!status.success(), "{stdout}");
    assert!(
        stderr.contains("different jobs")
            && stderr.contains("job merge-nv")
            && stderr.contains("job another")
            && stderr.contains("--force"),
        "{stderr}"
    );
    let (status, stdout, stderr) = merge(&[
        OsStr::new("-o"),
        out.as_os_str(),
        OsStr::new("--force"),
        node0.as_os_str(),
        other.as_os_str(),
    ]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("merged traces of different jobs"),
        "{stdout}"
    );

    // The same node twice: every pid clashes.
    let twice = dir.join("twice.pftrace");
    let stats_path = dir.join("twice.json");
    let (status, stdout, stderr) = merge(&[
        OsStr::new("-o"),
        twice.as_os_str(),
        OsStr::new("--stats-json"),
        stats_path.as_os_str(),
        node0.as_os_str(),
        node0.as_os_str(),
    ]);
    assert!(status.success(), "{stdout}{stderr}");
    let st = stats(&stats_path);
    assert!(
        st["nodes"][1]["pids_remapped"].as_u64().unwrap() >= 2,
        "{st:#}"
    );
    let tl = timeline(&twice);
    let once = timeline(node0);
    assert_eq!(
        ranks(&tl).len(),
        2 * ranks(&once).len(),
        "processes kept apart"
    );
    assert_eq!(tl.switches.len(), 2 * once.switches.len());
    let device = |tl: &Timeline| {
        tl.slices
            .iter()
            .filter(|s| !s.name.starts_with("step "))
            .count()
    };
    assert_eq!(device(&tl), 2 * device(&once));

    // Cut in the middle of a packet (two thirds in, moved off a packet's
    // first byte: a cut on a packet boundary is a whole, shorter trace).
    let cut = dir.join("cut.pftrace");
    std::fs::write(&cut, &bytes[..mid_packet(&bytes, bytes.len() * 2 / 3)]).unwrap();
    let cut_out = dir.join("cut-merged.pftrace");
    let (status, stdout, stderr) = merge(&[
        OsStr::new("-o"),
        cut_out.as_os_str(),
        cut.as_os_str(),
        run.node_traces[1].as_os_str(),
    ]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("is truncated: merged up to its last complete packet"),
        "{stdout}"
    );
    let tl = timeline(&cut_out);
    assert!(!tl.slices.is_empty());

    // A node whose agent recorded no clock snapshot: aligned by the
    // collectives alone, and said so.
    let clockless = dir.join("no-clocks.pftrace");
    std::fs::write(
        &clockless,
        strip_clock_snapshots(&std::fs::read(&run.node_traces[1]).unwrap()),
    )
    .unwrap();
    let stats_path = dir.join("no-clocks.json");
    let (status, stdout, stderr) = merge(&[
        OsStr::new("-o"),
        out.as_os_str(),
        OsStr::new("--stats-json"),
        stats_path.as_os_str(),
        node0.as_os_str(),
        clockless.as_os_str(),
    ]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("no-clocks.pftrace: no clock snapshot: aligned by its collectives alone"),
        "{stdout}"
    );
    let st = stats(&stats_path);
    let method = st["nodes"][1]["method"].as_str().unwrap_or_default();
    assert!(
        ["collectives", "bounds"].contains(&method),
        "aligned by its collectives: {st:#}"
    );
    let off = st["nodes"][1]["offset_ns"].as_i64().unwrap();
    assert!(off.abs() <= TOLERANCE_NS, "same clock: offset {off} ns");

    // Not a trace at all.
    let json = dir.join("not-a-trace.pftrace");
    std::fs::write(&json, b"{\"x\": 1}").unwrap();
    let (status, _, stderr) = merge(&[OsStr::new("-o"), out.as_os_str(), json.as_os_str()]);
    assert!(!status.success());
    assert!(stderr.contains("not a native Perfetto trace"), "{stderr}");
}

/// An offset at or after `at` strictly inside a packet of the trace
/// `bytes` (a `Trace` message: each packet is field 1, length-delimited).
fn mid_packet(bytes: &[u8], at: usize) -> usize {
    let mut pos = 0;
    while pos < bytes.len() {
        assert_eq!(bytes[pos], 0x0a, "a packet (field 1, bytes) at {pos}");
        let (mut len, mut shift, mut i) = (0usize, 0, pos + 1);
        loop {
            let b = bytes[i];
            len |= usize::from(b & 0x7f) << shift;
            shift += 7;
            i += 1;
            if b & 0x80 == 0 {
                break;
            }
        }
        let end = i + len;
        if end > at {
            return at.max(pos + 1);
        }
        pos = end;
    }
    panic!("no packet past {at}");
}
