//! End to end: one injected fault is one incident whose root is the fault.
//! Simulated jobs with one fault each, recorded by `agent attach` at its
//! default options (only the hang timeout is short: a test cannot wait the
//! default 300 s), graded against the simulator's ground truth, online
//! (attach's `--stats-json`) and offline (`agent diagnose`, also at its
//! defaults): the first root finding is the injected kind, rank and step
//! (within 2); every other finding of its incident carries a `cause`; one
//! incident for the fault and none besides; offline gives the incidents
//! online gives. Layouts where a fault cascades (tp 2, pp 2, dp 2: peers
//! wait for the faulty rank across communicators), and more ranks than
//! the 2-CPU test machine has CPUs. Root and eBPF; these never skip.

use std::process::Command;

use crate::diagnose::online;
use serde_json::Value;
use xpuscope_tests::agent::{agent_bin, exclusive};
use xpuscope_tests::device::*;

/// The hang timeout of the hang cases (attach's default is 300 s).
const HANG_TIMEOUT: &str = "2s";

/// A job of `layout` and `steps` with one `fault`, recorded from its start
/// (the agent at its defaults plus `agent_args`).
fn record(
    tag: &str,
    flavor: &str,
    layout: &[&str],
    steps: &str,
    fault: &str,
    agent_args: &[&str],
) -> SimRun {
    let mut args = layout.to_vec();
    args.extend(["--flavor", flavor, "--steps", steps, "--timeout", "10"]);
    if !fault.is_empty() {
        args.extend(["--fault", fault]);
    }
    let run = run_from_spawn(tag, &args, agent_args);
    print_time_to_finding(tag, &run.tl, &run.ground_truth, None);
    run
}

/// `agent diagnose --json -` (the document from stdout) and its exit code.
fn offline(run: &SimRun, extra: &[&str]) -> (Vec<Value>, Option<i32>, String) {
    let out = Command::new(agent_bin())
        .args(["diagnose", "--json", "-"])
        .args(extra)
        .arg(run._dir.path().join("trace.pftrace"))
        .output()
        .expect("run agent diagnose");
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    let doc: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("the findings document on stdout ({e}): {text}"));
    let found = doc["findings"].as_array().expect("a list").clone();
    assert_diagnose_status(&out.status, &found, &text);
    (found, out.status.code(), text)
}

fn roots(found: &[Value]) -> Vec<&Value> {
    found.iter().filter(|f| f.get("cause").is_none()).collect()
}

/// One line per finding (incident, id, cause, kind, ranks, step, summary):
/// what a failure message shows first (a whole document is cut short in
/// CI logs).
fn listing(found: &[Value]) -> String {
    found
        .iter()
        .map(|f| {
            format!(
                "  #{} id {} cause {} {} ranks {} step {}: {}\n",
                f["incident"], f["id"], f["cause"], f["kind"], f["ranks"], f["step"], f["summary"]
            )
        })
        .collect()
}

/// Every finding has an id and an incident; a consequence's cause is a
/// finding of its own incident.
fn check_links(found: &[Value], what: &str) {
    for f in found {
        assert!(f["id"].is_u64() && f["incident"].is_u64(), "{what}: {f:#}");
        if let Some(cause) = f.get("cause") {
            let c = found
                .iter()
                .find(|g| g["id"] == *cause)
                .unwrap_or_else(|| panic!("{what}: the cause of {f:#} is in the document"));
            assert_eq!(c["incident"], f["incident"], "{what}: {f:#} vs {c:#}");
        }
    }
}

/// The incidents of the fault: every root must be within 2 steps of the
/// injected one (or have no step): the whole run has one incident per
/// fault, at default options, on the busy 2-CPU test machine too (the
/// detectors judge the job against itself: its step time, each rank's own
/// jitter and baseline, its peers).
fn fault_incidents<'a>(found: &'a [Value], step: Option<u64>, what: &str) -> Vec<&'a Value> {
    let (near, far): (Vec<&Value>, Vec<&Value>) =
        roots(found)
            .into_iter()
            .partition(|r| match (r["step"].as_u64(), step) {
                (Some(s), Some(step)) => s.abs_diff(step) <= 2,
                _ => true,
            });
    assert!(
        far.is_empty(),
        "{what}: incidents of their own away from the fault:\n{}",
        listing(found)
    );
    near
}

/// The first root is `kind` at the injected rank and step (within 2); the
/// fault is one incident; its consequences carry `cause`.
fn check_one_incident(found: &[Value], kind: &str, rank: u64, step: Option<u64>, what: &str) {
    check_links(found, what);
    let r = fault_incidents(found, step, what);
    assert_eq!(
        r.len(),
        1,
        "{what}: one incident:\n{}\n{found:#?}",
        listing(found)
    );
    let root = r[0];
    assert_eq!(found[0], *root, "{what}: the root comes first");
    assert_eq!(root["kind"], kind, "{what}: {root:#}");
    assert_eq!(root["ranks"], serde_json::json!([rank]), "{what}: {root:#}");
    if let Some(step) = step {
        let s = root["step"].as_u64();
        assert!(
            s.is_some_and(|s| s.abs_diff(step) <= 2),
            "{what}: step {s:?} vs injected {step}: {root:#}"
        );
    }
    for f in found
        .iter()
        .filter(|f| f["incident"] == root["incident"])
        .skip(1)
    {
        assert!(f["cause"].is_u64(), "{what}: a consequence: {f:#}");
    }
    matrix_line(what, found, root, step);
}

/// The matrix's figures (the detection chapter's table), printed: the
/// root, the findings of its incident, the incidents in all.
fn matrix_line(what: &str, found: &[Value], root: &Value, injected: Option<u64>) {
    eprintln!(
        "matrix: {what}: root {} rank {} step {} (injected {injected:?}); {} finding(s) in its \
         incident; {} incident(s) in all",
        root["kind"],
        root["ranks"],
        root["step"],
        found
            .iter()
            .filter(|f| f["incident"] == root["incident"])
            .count(),
        roots(found).len()
    );
}

/// The incidents' shape, to compare online with offline: each root's kind
/// and ranks.
fn root_shape(found: &[Value], step: Option<u64>) -> Vec<(Value, Value)> {
    fault_incidents(found, step, "shape")
        .iter()
        .map(|f| (f["kind"].clone(), f["ranks"].clone()))
        .collect()
}

/// Grades one recording online and offline against its injected fault.
fn grade(run: &SimRun, kind: &str, offline_extra: &[&str], what: &str) {
    let fault = &run.ground_truth["faults"][0];
    let rank = fault["rank"].as_u64().expect("a rank");
    let step = fault["step"].as_u64();
    let on = online(run);
    check_one_incident(&on, kind, rank, step, &format!("{what} online"));
    let (off, code, text) = offline(run, offline_extra);
    check_one_incident(&off, kind, rank, step, &format!("{what} offline"));
    assert_eq!(code, Some(DIAGNOSE_EXIT_ROOT_FINDING), "{what}: {text}");
    assert!(text.starts_with(&format!("{kind}: ")), "{what}: {text}");
    assert_eq!(
        root_shape(&on, step),
        root_shape(&off, step),
        "{what}: offline = online"
    );
}

/// Rank 1's device allocations fail with the flavor's "no device" status
/// (not out of memory) from step 2; it exits, the launcher stops its
/// peers. One `device_error` incident naming rank 1, never a `device_oom`.
/// Both flavors, 2 ranks.
#[test]
fn a_non_oom_device_failure_is_one_device_error_incident() {
    let _serial = exclusive();
    for flavor in ["nvidia", "ascend"] {
        let run = record(
            &format!("rcdeverr{flavor}"),
            flavor,
            &[],
            "6",
            "device_error:rank=1,step=2",
            &[],
        );
        let what = format!("device error {flavor}");
        grade(&run, "device_error", &[], &what);
        let on = online(&run);
        let code = &run.ground_truth["faults"][0]["expected"]["code"];
        assert_eq!(on[0]["evidence"]["code"], *code, "{what}: {:#}", on[0]);
        let name = on[0]["evidence"]["code_name"].as_str().unwrap_or("");
        assert!(
            name == "cudaErrorNoDevice" || name == "ACL_ERROR_RT_INTERNAL_ERROR",
            "{what}: {name}"
        );
        assert!(
            on.iter().all(|f| f["kind"] != "device_oom"),
            "{what}: not out of memory: {on:#?}"
        );
    }
}

/// Rank 5 of 8 (tp 2, pp 2, dp 2) stops before step 2's gradient
/// all-reduce; its DP peer waits there, its TP and pipeline peers wait for
/// it and for one another. One incident: the root names rank 5 (and the
/// ground truth's communicator and number); every other hang carries its
/// cause. Both flavors.
#[test]
fn a_hang_with_waiting_peers_is_one_incident_rooted_at_the_hung_rank() {
    let _serial = exclusive();
    for flavor in ["nvidia", "ascend"] {
        let run = record(
            &format!("rchang{flavor}"),
            flavor,
            TP2_PP2_DP2,
            "6",
            "hang:rank=5,step=2",
            &["--hang-timeout", HANG_TIMEOUT],
        );
        let what = format!("hang {flavor}");
        grade(&run, "hang", &["--hang-timeout", HANG_TIMEOUT], &what);
        let expected = &run.ground_truth["faults"][0]["expected"];
        let on = online(&run);
        assert_eq!(on[0]["seq"], expected["seq"], "{what}: {:#}", on[0]);
    }
}

/// Rank 2 of 8 arrives 1 s late at step 3's gradient all-reduce; its
/// pipeline peer waits for it and comes late itself. One incident, rooted
/// at rank 2. Both flavors.
#[test]
fn a_delayed_rank_is_the_root_and_the_peer_that_waited_for_it_a_consequence() {
    let _serial = exclusive();
    for flavor in ["nvidia", "ascend"] {
        let run = record(
            &format!("rcdelay{flavor}"),
            flavor,
            TP2_PP2_DP2,
            "8",
            "delay:rank=2,step=3,ms=1000",
            &[],
        );
        grade(&run, "late_arrival", &[], &format!("delay {flavor}"));
    }
}

/// Rank 6's data loader sleeps 800 ms before batch 4 (8 ranks): its peers
/// that wait for it are consequences of the stall. Both flavors, online
/// and offline.
#[test]
fn a_dataloader_stall_is_the_root_of_the_lateness_it_causes() {
    let _serial = exclusive();
    for flavor in ["nvidia", "ascend"] {
        let run = record(
            &format!("rcstall{flavor}"),
            flavor,
            TP2_PP2_DP2,
            "10",
            "dataloader_stall:rank=6,step=4,ms=800",
            &[],
        );
        grade(&run, "dataloader_stall", &[], &format!("stall {flavor}"));
    }
}

/// Rank 6's main thread spends 150 ms more CPU time on host work in every
/// step from step 4 (8 ranks, more than the CPUs): its steps turn
/// host-bound, its peers' do not; it arrives last and they wait for it.
/// One incident rooted at rank 6's `host_bound` at step 4 (within 2),
/// their lateness under it. Both flavors, online and offline.
#[test]
fn a_rank_turned_host_bound_is_the_root_of_the_waits_it_causes() {
    let _serial = exclusive();
    for flavor in ["nvidia", "ascend"] {
        let run = record(
            &format!("rchost{flavor}"),
            flavor,
            TP2_PP2_DP2,
            "10",
            "host_work:rank=6,ms=150,from_step=4",
            &[],
        );
        let what = format!("host-bound {flavor}");
        let fault = &run.ground_truth["faults"][0];
        assert_eq!(fault["from_step"], 4, "{what}: {fault}");
        let step = Some(4);
        let on = online(&run);
        check_one_incident(&on, "host_bound", 6, step, &format!("{what} online"));
        let e = &on[0]["evidence"];
        assert!(
            e["host_share_pct"].as_f64().unwrap_or(0.0) >= 50.0
                && e["host_ms_per_step"].as_f64().unwrap_or(0.0) >= 100.0,
            "{what}: most of its steps on its CPU, the injected work among it: {e:#}"
        );
        // The trace's step counters: rank 6's host share rises past half
        // its steps from the fault on; its peers' stays under it.
        for (&rank, &pid) in &run.rank_pids {
            let host = step_counter(&run.tl, pid, "step host work %");
            let device = step_counter(&run.tl, pid, "step device wait %");
            assert!(
                host.len() >= 8 && host.len() == device.len(),
                "{what}: rank {rank}'s step counters: {host:?} {device:?}"
            );
            let late = &host[host.len() - 3..];
            if rank == 6 {
                assert!(late.iter().all(|v| *v >= 50.0), "{what}: rank 6: {host:?}");
                assert!(host[0] < 50.0, "{what}: rank 6 before the fault: {host:?}");
            } else {
                assert!(
                    late.iter().all(|v| *v < 50.0),
                    "{what}: rank {rank}: {host:?}"
                );
            }
        }
        // Its launches did not grow with its host work: the kernel counts
        // every rank's launches at the default level, per step, as the
        // simulator made them.
        for (&rank, &pid) in &run.rank_pids {
            let per_step = runtime_launches_per_step(&run, rank);
            let launches = step_counter(&run.tl, pid, "step kernel launches");
            assert!(launches.len() >= 8, "{what}: rank {rank}: {launches:?}");
            assert!(
                launches.iter().all(|n| *n as u64 == per_step),
                "{what}: rank {rank}, {per_step} a step: {launches:?}"
            );
            if rank == 6 {
                assert_eq!(e["launches_per_step"], per_step, "{what}: {e:#}");
                assert_eq!(e["usual_launches_per_step"], per_step, "{what}: {e:#}");
            }
        }
        // The summary's split over the recording: rank 6 did the most host
        // work of all ranks.
        let rows = run.stats["step_split"].as_array().expect("step_split");
        assert_eq!(rows.len(), 8, "{what}: {rows:#?}");
        let host = |r: &serde_json::Value| r["host_pct"].as_f64().unwrap_or(0.0);
        let six = rows.iter().find(|r| r["rank"] == 6).expect("rank 6");
        assert!(
            rows.iter()
                .filter(|r| r["rank"] != 6)
                .all(|r| host(r) < host(six)),
            "{what}: {rows:#?}"
        );
        let (off, code, text) = offline(&run, &[]);
        check_one_incident(&off, "host_bound", 6, step, &format!("{what} offline"));
        assert_eq!(code, Some(DIAGNOSE_EXIT_ROOT_FINDING), "{what}: {text}");
        // Offline the launches come back from the syncs' slices (the
        // process's count so far): the same launches per step.
        let oe = &off[0]["evidence"];
        for key in ["launches_per_step", "usual_launches_per_step"] {
            assert_eq!(oe[key], e[key], "{what}: {key} offline: {oe:#}");
        }
        assert_eq!(
            root_shape(&on, step),
            root_shape(&off, step),
            "{what}: offline = online"
        );
    }
}

/// The kernels rank `rank` launched in each step, by its step log: the
/// same in every step.
fn runtime_launches_per_step(run: &SimRun, rank: u64) -> u64 {
    let path = run.job_dir.join(format!("rank{rank}.steps.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let counts: Vec<u64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| v["runtime_launches"].as_u64().expect("runtime_launches"))
        .collect();
    assert!(counts.len() >= 8, "rank {rank}: {counts:?}");
    assert!(
        counts.iter().all(|n| *n == counts[0]),
        "rank {rank}: {counts:?}"
    );
    assert!(counts[0] > 0, "rank {rank}: {counts:?}");
    counts[0]
}

/// The values of counter `name` on process `pid`'s track, in time order;
/// the track is one, under the process track named by the rank (`rank 6/8
/// job ...`): a late record drawn on a track of its own would rename it.
fn step_counter(tl: &xpuscope_tests::trace_check::Timeline, pid: i32, name: &str) -> Vec<f64> {
    use xpuscope_tests::trace_check::TrackKind;
    let process: Vec<(u64, Option<String>)> = tl
        .tracks
        .values()
        .filter_map(|t| match &t.kind {
            TrackKind::Process { pid: p, name, .. } if *p == pid => Some((t.uuid, name.clone())),
            _ => None,
        })
        .collect();
    let counters: Vec<(u64, u64)> = tl
        .tracks
        .values()
        .filter(|t| t.name.as_deref() == Some(name))
        .filter_map(|t| Some((t.uuid, t.parent?)))
        .filter(|(_, parent)| process.iter().any(|(p, _)| p == parent))
        .collect();
    assert_eq!(
        counters.len(),
        1,
        "pid {pid}: one {name} track: {process:?}"
    );
    let parent = process.iter().find(|(p, _)| *p == counters[0].1);
    assert!(
        parent.is_some_and(|(_, n)| n.as_deref().is_some_and(|n| n.starts_with("rank "))),
        "pid {pid}: {name} under its rank's process track: {parent:?}"
    );
    tl.counter_values_on(&counters.iter().map(|(c, _)| *c).collect())
}

/// A clean 8-rank job at default options: no incident, and `agent
/// diagnose` exits 0.
#[test]
fn a_clean_job_has_no_incident() {
    let _serial = exclusive();
    let run = record("rcclean", "nvidia", TP2_PP2_DP2, "8", "", &[]);
    let on = online(&run);
    assert!(roots(&on).is_empty(), "{on:#?}");
    let (off, code, text) = offline(&run, &[]);
    assert!(off.is_empty(), "{off:#?}");
    assert_eq!(code, Some(0), "{text}");
}

/// A noisy neighbour (four spinning threads) on rank 1's CPU from step 5
/// of a 2-rank job of 48 steps with 10 ms of host work per step (the
/// contention spans more than 1 s, as one must), on both flavors: rank 1
/// loses time to it and arrives late, rank 0 waits for it. One incident:
/// its root rank 1's `host_contention` naming the neighbour, the late
/// arrivals under it. The launcher's SIGKILL of its neighbour at the end
/// (a traced child of the launcher, no rank) is no crash. The 8-rank case
/// is [`a_noisy_neighbour_among_oversubscribed_ranks_is_one_incident_on_its_cpu`].
#[test]
fn a_noisy_neighbour_is_one_incident() {
    let _serial = exclusive();
    for flavor in ["nvidia", "ascend"] {
        let run = record(
            &format!("rcnoisy-{flavor}"),
            flavor,
            &["--host-us", "10000"],
            "48",
            "cpu_contention:rank=1,from_step=5,threads=4",
            &[],
        );
        let fault = &run.ground_truth["faults"][0];
        let neighbour = &fault["injected"][0]["neighbour_pid"];
        for (driver, found) in [("online", online(&run)), ("offline", offline(&run, &[]).0)] {
            let what = format!("{flavor} {driver}");
            check_links(&found, &what);
            let r = fault_incidents(&found, Some(5), &what);
            assert_eq!(
                r.len(),
                1,
                "{what}: one incident:\n{}\n{found:#?}",
                listing(&found)
            );
            assert_eq!(r[0]["kind"], "host_contention", "{what}: {:#}", r[0]);
            assert_eq!(r[0]["ranks"], serde_json::json!([1]), "{what}: {:#}", r[0]);
            assert_eq!(
                r[0]["evidence"]["preemptors"][0]["pid"], *neighbour,
                "{what}: {:#}",
                r[0]
            );
            matrix_line(&format!("noisy 2 ranks {what}"), &found, r[0], Some(5));
        }
    }
}

/// A clean 8-rank job (tp 2, pp 2, dp 2) with 10 ms of host work per step
/// on a machine with fewer CPUs than ranks: the ranks take one another's
/// CPUs every step, alike, and the agent's threads take theirs; every
/// operation's last member comes 5-30 ms late. That is the job's shape,
/// not a fault: no finding at all, online or offline, at default options
/// (earlier builds: `host_contention` on every rank, and lone late
/// arrivals just over half a step in about 1 run in 4).
#[test]
fn a_clean_job_with_more_ranks_than_cpus_has_no_incident() {
    let _serial = exclusive();
    let mut layout = TP2_PP2_DP2.to_vec();
    layout.extend(["--host-us", "10000"]);
    let run = record("rcoversub", "nvidia", &layout, "24", "", &[]);
    for (driver, found) in [("online", online(&run)), ("offline", offline(&run, &[]).0)] {
        assert!(
            found.is_empty(),
            "{driver}: a clean oversubscribed job:\n{}",
            listing(&found)
        );
    }
}

/// A noisy neighbour on rank 1's CPU from step 5 of an 8-rank job (tp 2,
/// pp 2, dp 2) with 10 ms of host work per step: more ranks than CPUs,
/// so every rank already shares its CPU with its siblings, and the
/// neighbour takes from every rank on that CPU (the ground truth's
/// `ranks_on_cpu`). Online and offline: one incident, its root a
/// `host_contention` of a rank on that CPU naming the neighbour, dated at
/// the neighbour's step (within 2: the share it takes above the usual
/// flickers step by step, so the contention is dated from when the
/// neighbour came among the job's ranks), and every `host_contention`
/// names it (never a sibling or the agent).
#[test]
fn a_noisy_neighbour_among_oversubscribed_ranks_is_one_incident_on_its_cpu() {
    let _serial = exclusive();
    let mut layout = TP2_PP2_DP2.to_vec();
    layout.extend(["--host-us", "10000"]);
    let run = record(
        "rcnoisy8",
        "nvidia",
        &layout,
        "40",
        "cpu_contention:rank=1,from_step=5,threads=4",
        &[],
    );
    let fault = &run.ground_truth["faults"][0];
    let neighbour = fault["injected"][0]["neighbour_pid"].clone();
    let on_cpu: Vec<Value> = fault["expected"]["ranks_on_cpu"]
        .as_array()
        .expect("the ranks on the neighbour's CPU")
        .clone();
    assert!(on_cpu.contains(&serde_json::json!(1)), "{fault:#}");
    for (driver, found) in [("online", online(&run)), ("offline", offline(&run, &[]).0)] {
        check_links(&found, driver);
        let contention: Vec<&Value> = found
            .iter()
            .filter(|f| f["kind"] == "host_contention")
            .collect();
        assert!(!contention.is_empty(), "{driver}:\n{}", listing(&found));
        for c in &contention {
            assert_eq!(
                c["evidence"]["preemptors"][0]["pid"], neighbour,
                "{driver}: {c:#}"
            );
            let ranks = c["ranks"].as_array().expect("ranks");
            assert!(
                ranks.len() == 1 && on_cpu.contains(&ranks[0]),
                "{driver}: a rank on the neighbour's CPU {on_cpu:?}: {c:#}"
            );
        }
        assert!(
            !found.iter().any(|f| f["kind"] == "crash"),
            "{driver}: the launcher stopping its neighbour is no crash:\n{}",
            listing(&found)
        );
        let r = fault_incidents(&found, Some(5), driver);
        assert_eq!(r.len(), 1, "{driver}: one incident:\n{}", listing(&found));
        let first = r[0];
        assert_eq!(
            first["kind"],
            "host_contention",
            "{driver}:\n{}",
            listing(&found)
        );
        matrix_line(&format!("noisy 8 ranks {driver}"), &found, first, Some(5));
    }
}

/// An outsider on every CPU of the job (a process spinning two threads
/// per CPU, not pinned) from step 5, on an 8-rank job (tp 2, pp 2, dp 2,
/// more ranks than CPUs) and on a 2-rank job of the other flavor, both
/// with 10 ms of host work per step: every rank loses its CPU to it
/// alike, so no rank suffers it more than its peers. Online and offline:
/// one incident, its root a job-level `host_contention` naming every
/// rank and the outsider, at its step (within 2); a rank's own
/// contention, if any, comes under it.
#[test]
fn an_outsider_on_every_cpu_is_one_job_level_incident() {
    let _serial = exclusive();
    let eight: Vec<&str> = TP2_PP2_DP2
        .iter()
        .copied()
        .chain(["--host-us", "10000"])
        .collect();
    let two = ["--host-us", "10000"];
    for (flavor, layout, what) in [
        ("nvidia", &eight[..], "8 ranks"),
        ("ascend", &two[..], "2 ranks"),
    ] {
        let run = record(
            &format!("rchog-{flavor}"),
            flavor,
            layout,
            "40",
            "cpu_hog:from_step=5",
            &[],
        );
        let fault = &run.ground_truth["faults"][0];
        let hog = fault["injected"][0]["neighbour_pid"].clone();
        assert!(hog.is_u64(), "the hog started: {fault:#}");
        let every = fault["expected"]["ranks"].clone();
        for (driver, found) in [("online", online(&run)), ("offline", offline(&run, &[]).0)] {
            let driver = format!("{what} {flavor} {driver}");
            check_links(&found, &driver);
            let r = fault_incidents(&found, Some(5), &driver);
            assert_eq!(r.len(), 1, "{driver}: one incident:\n{}", listing(&found));
            let root = r[0];
            assert_eq!(found[0], *root, "{driver}: the root comes first");
            assert_eq!(
                root["kind"],
                "host_contention",
                "{driver}:\n{}",
                listing(&found)
            );
            assert_eq!(root["ranks"], every, "{driver}: every rank: {root:#}");
            assert_eq!(root["evidence"]["scope"], "job", "{driver}: {root:#}");
            assert_eq!(
                root["evidence"]["preemptors"][0]["pid"], hog,
                "{driver}: {root:#}"
            );
            // It fired once it had held a second; the hog ran on to the
            // job's last step (39), and so does the incident: lateness
            // late in the run is its consequence, not a fault of its own.
            let last = root["evidence"]["last_step"].as_u64();
            assert!(
                last.is_some_and(|s| s >= 36),
                "{driver}: it went on while the hog ran: {root:#}"
            );
            for f in found
                .iter()
                .filter(|f| f["incident"] == root["incident"])
                .skip(1)
            {
                assert!(f["cause"].is_u64(), "{driver}: a consequence: {f:#}");
            }
            matrix_line(&format!("hog {driver}"), &found, root, Some(5));
        }
    }
}
