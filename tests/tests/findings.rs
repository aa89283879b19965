//! End to end: the detectors find the simulator's faults while the job
//! runs, graded against its ground truth. The agent attaches to the
//! launcher before it starts its ranks (spawn gate) and the ranks wait
//! before their first device call (init delay), so every communicator's
//! set-up is seen and sequence numbers are exact across ranks.
//! Root and eBPF; these never skip.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::shared_runs;
use serde_json::Value;
use xpuscope_tests::agent::{TempDir, agent_bin, exclusive};
use xpuscope_tests::device::*;
use xpuscope_tests::fixtures;
use xpuscope_tests::service_run::{
    Service, http_get, run_untold_job, run_untold_job_on_nodes, run_untold_job_shaped, try_http_get,
};
use xpuscope_tests::trace_check::{Slice, Timeline, TrackKind, check_importer_rules, decode};

fn findings(run: &SimRun) -> Vec<Value> {
    let doc = &run.stats["findings"];
    assert_eq!(doc["schema"], "xpuscope-findings/1", "{doc}");
    doc["findings"].as_array().expect("a list").clone()
}

/// The trace's `xpuscope findings` slices: (name, args as text).
fn finding_slices_with_args(tl: &Timeline) -> Vec<(String, Vec<(String, String)>)> {
    let tracks: Vec<u64> = tl
        .tracks
        .values()
        .filter(|t| t.name.as_deref() == Some("xpuscope findings"))
        .map(|t| t.uuid)
        .collect();
    tl.slices
        .iter()
        .filter(|s| tracks.contains(&s.track))
        .map(|s| {
            (
                s.name.clone(),
                s.args
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_string()))
                    .collect(),
            )
        })
        .collect()
}

/// Rank 1 never joins the DP all-reduce of step 2; rank 0 waits in it.
/// With a 1 s hang timeout the finding names the communicator (its hash as
/// the trace shows it), the all-reduce's number and rank 1, per ground
/// truth, in the summary, `--stats-json` and the trace.
#[test]
fn a_hang_is_found_while_it_lasts_and_names_the_rank_that_never_joined() {
    let serial = exclusive();
    let run = shared_runs::hang_at_step_2(&serial, "nvidia");
    let fault = &run.ground_truth["faults"][0];
    let expected = &fault["expected"];
    let seq = expected["seq"]
        .as_u64()
        .expect("the hung collective's number");
    let hangs: Vec<Value> = findings(run)
        .into_iter()
        .filter(|f| f["kind"] == "hang")
        .collect();
    assert_eq!(
        hangs.len(),
        1,
        "{:#}\n{}",
        run.stats["findings"],
        run.stderr
    );
    let h = &hangs[0];
    // The communicator as the trace names it on the all-reduces.
    let hashes: std::collections::BTreeSet<String> = run
        .tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("ncclAllReduce"))
        .map(|s| arg_text(s, "comm_hash"))
        .collect();
    assert_eq!(hashes.len(), 1, "one DP communicator: {hashes:?}");
    let comm = format!("nccl:{}", hashes.iter().next().unwrap());
    assert_eq!(h["comm"], comm.as_str(), "{h:#}");
    assert_eq!(h["seq"], seq, "{h:#}");
    assert_eq!(h["ranks"], serde_json::json!([1]), "{h:#}");
    assert_eq!(h["evidence"]["entered"], serde_json::json!([0]), "{h:#}");
    assert_eq!(h["evidence"]["stuck"][0]["rank"], 0, "{h:#}");
    assert!(h["end_ns"].is_null());
    let summary = h["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!("#{seq} on {comm}")) && summary.contains("never by rank 1"),
        "{summary}"
    );
    assert!(run.stderr.contains(summary), "{}", run.stderr);
    let slices = finding_slices_with_args(&run.tl);
    let hang = slices
        .iter()
        .find(|(n, _)| n == "hang")
        .unwrap_or_else(|| panic!("no hang slice: {slices:?}"));
    let arg = |k: &str| {
        hang.1
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(arg("comm"), comm);
    assert_eq!(arg("seq"), seq.to_string());
    assert_eq!(arg("ranks"), "1");
}

/// Rank 1 raises SIGABRT at step 2: a crash finding names it and the
/// signal (and no other: the launcher's SIGTERM to rank 0 follows from
/// it); a clean job has no findings at all.
#[test]
fn a_crash_names_the_rank_and_signal_and_a_clean_job_has_no_findings() {
    let serial = exclusive();
    let run = shared_runs::crash_at_step_2(&serial, "nvidia");
    let expected = &run.ground_truth["faults"][0]["expected"];
    let crashes: Vec<Value> = findings(run)
        .into_iter()
        .filter(|f| f["kind"] == "crash")
        .collect();
    // One: rank 0, stopped by the launcher after it, is no second crash.
    assert_eq!(crashes.len(), 1, "{:#}", run.stats["findings"]);
    assert_eq!(crashes[0]["evidence"]["signal"], expected["signal"]);
    assert_eq!(crashes[0]["ranks"], serde_json::json!([1]));
    assert_eq!(
        crashes[0]["evidence"]["signal_name"],
        expected["signal_name"]
    );
    assert!(
        finding_slices_with_args(&run.tl)
            .iter()
            .any(|(n, _)| n == "crash"),
        "the crash on the findings track"
    );

    // A late arrival of 10-20 ms is what a busy 2-vCPU machine alone gives
    // a clean job's rank now and then; the injected delays are 120 ms and
    // more, so the clean job is judged above that noise. (Shared with
    // `diagnose`.)
    let clean = shared_runs::clean_8_ranks(&serial);
    assert_eq!(findings(clean), Vec::<Value>::new(), "{}", clean.stderr);
    assert!(clean.stderr.contains("findings: none"), "{}", clean.stderr);
}

/// The service finds a hung job by itself and dumps it with trigger
/// `hang`: the dump's trace holds every rank and the finding, its summary
/// names the hung collective (communicator, number) and the rank that
/// never joined. A rank killed by SIGABRT gives a `signal` dump naming it.
#[test]
fn the_service_dumps_a_hung_job_and_a_crashed_rank_on_its_own() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let _ = agent_bin();
    let dir = TempDir::new("svcfind");
    let mut svc = Service::start(dir.path(), "[detect]\nhang_timeout = \"1s\"\n");
    let truth = run_untold_job(
        dir.path(),
        "svchang",
        &[
            "--steps",
            "6",
            "--fault",
            "hang:rank=1,step=2",
            "--timeout",
            "6",
        ],
    );
    let seq = truth["faults"][0]["expected"]["seq"].as_u64().expect("seq");
    let pids: Vec<i32> = truth["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["pid"].as_i64().unwrap() as i32)
        .collect();
    let (summary, trace_path) = svc.wait_dump("hang", Duration::from_secs(20), |f| {
        f["kind"] == "hang" && f["seq"] == seq
    });
    let f = &summary["finding"];
    assert_eq!(f["ranks"], serde_json::json!([1]), "{summary:#}");
    assert_eq!(summary["outcome"]["trigger"], "hang");
    let comm = f["comm"].as_str().expect("the communicator").to_string();
    let trace = decode(&std::fs::read(&trace_path).expect("the dump")).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    for pid in &pids {
        assert!(
            tl.processes.contains_key(pid),
            "rank pid {pid} in the dump: {:?}",
            tl.processes.keys().collect::<Vec<_>>()
        );
    }
    // The communicator as this job's all-reduces in the dump name it (the
    // service traces every job on the machine).
    let ours = |s: &&Slice| {
        tl.tracks
            .get(&s.track)
            .is_some_and(|t| matches!(t.kind, TrackKind::Thread { pid, .. } if pids.contains(&pid)))
    };
    let reduces: Vec<_> = tl
        .slices
        .iter()
        .filter(ours)
        .filter(|s| s.name.starts_with("ncclAllReduce"))
        .collect();
    assert!(!reduces.is_empty(), "this job's all-reduces in the dump");
    assert!(
        reduces
            .iter()
            .all(|s| format!("nccl:{}", arg_text(s, "comm_hash")) == comm),
        "{comm}"
    );
    let slices = finding_slices_with_args(&tl);
    assert!(
        slices.iter().any(|(n, args)| n == "hang"
            && args
                .iter()
                .any(|(k, v)| k == "seq" && *v == seq.to_string())),
        "{slices:?}"
    );

    let truth = run_untold_job(
        dir.path(),
        "svccrash",
        &[
            "--steps",
            "5",
            "--fault",
            "crash:rank=1,step=2",
            "--timeout",
            "30",
        ],
    );
    let signal = truth["faults"][0]["expected"]["signal"].clone();
    let (summary, _) = svc.wait_dump("signal", Duration::from_secs(20), |f| {
        f["kind"] == "crash" && f["evidence"]["signal"] == signal
    });
    assert_eq!(summary["finding"]["ranks"], serde_json::json!([1]));
    let metrics = http_get(svc.port, "/metrics");
    for kind in ["hang", "crash"] {
        let n: f64 = metrics
            .lines()
            .find(|l| l.starts_with(&format!("xpuscope_findings_total{{kind=\"{kind}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no findings_total for {kind}:\n{metrics}"));
        assert!(n >= 1.0, "{kind}: {n}");
    }
    svc.stop();
}

/// One fault, not a cascade: rank 5 of an 8-rank job (TP 2, PP 2, DP 2)
/// stops. Its data-parallel peer waits at the all-reduce rank 5 never
/// enters, its tensor-parallel peer at the next all-gather, and their
/// pipeline peers behind them: five hangs. The service writes one dump,
/// triggered by the hang rank 5 never entered; the hangs that wait for it
/// stream as following from it (`follows_from`, the dump's findings), and
/// `xpuscope_incidents_total` counts one fault where
/// `xpuscope_findings_total` counts every hang.
#[test]
fn a_hung_rank_s_waiting_peers_come_out_as_its_consequences() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let _ = agent_bin();
    let dir = TempDir::new("svccascade");
    let mut svc = Service::start(dir.path(), "[detect]\nhang_timeout = \"1s\"\n");
    run_untold_job_shaped(
        dir.path(),
        "svccascade",
        &["--world-size", "8", "--tp", "2", "--pp", "2", "--dp", "2"],
        &[
            "--steps",
            "8",
            "--fault",
            "hang:rank=5,step=3",
            "--timeout",
            "8",
        ],
    );
    let (summary, _) = svc.wait_dump("hang", Duration::from_secs(20), |f| {
        f["follows_from"].is_null() && f["ranks"] == serde_json::json!([5])
    });
    let metrics = http_get(svc.port, "/metrics");
    let count = |family: &str| -> f64 {
        let line = format!("{family}{{kind=\"hang\"}}");
        metrics
            .lines()
            .find(|l| l.starts_with(&line))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {line}:\n{metrics}"))
    };
    let hang_dumps: Vec<Value> = std::fs::read_dir(svc.dump_dir.clone())
        .expect("the dump directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with("-hang.summary.json"))
        .filter_map(|p| serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok())
        .collect();
    svc.stop();
    // The dump's own trigger is the root: the hang rank 5 never entered.
    assert_eq!(hang_dumps.len(), 1, "{hang_dumps:#?}");
    let trigger = &hang_dumps[0]["finding"];
    assert_eq!(trigger["ranks"], serde_json::json!([5]), "{trigger:#}");
    assert!(trigger["follows_from"].is_null(), "{trigger:#}");
    let listed = summary["findings"]["findings"]
        .as_array()
        .expect("findings");
    let root_line = trigger["summary"].as_str().expect("a summary").to_string();
    // Its tensor-parallel peer's hang (rank 4 waits in the all-gather
    // rank 5 never entered) follows from it.
    let tp_peer = listed
        .iter()
        .find(|f| {
            f["ranks"] == serde_json::json!([5])
                && f["summary"]
                    .as_str()
                    .is_some_and(|s| s.contains("ncclAllGather"))
        })
        .unwrap_or_else(|| panic!("the all-gather rank 5 never entered: {listed:#?}"));
    assert_eq!(
        tp_peer["follows_from"].as_str(),
        Some(root_line.as_str()),
        "{listed:#?}"
    );
    let (findings, incidents) = (
        count("xpuscope_findings_total"),
        count("xpuscope_incidents_total"),
    );
    assert!(findings >= 3.0, "the waiting peers' hangs: {findings}");
    assert!(
        incidents >= 1.0 && incidents < findings,
        "faults {incidents} of findings {findings}"
    );
}

/// Debian's `prometheus`, installed if missing (a test that needs a tool
/// installs it; under CI a failed install fails the test).
fn prometheus_bin() -> &'static str {
    xpuscope_tests::packages::ensure_tool("prometheus", "prometheus")
}

/// A Prometheus server on loopback, killed when dropped (also when the
/// test fails).
struct Prometheus {
    child: std::process::Child,
    port: u16,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of an HTTP/1.1 response, de-chunked when it came in chunks
/// (Prometheus chunks larger answers).
fn body_of(response: &str) -> String {
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((response, ""));
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_string();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// `text` as a URL query value.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Prometheus {
    /// Scrapes `127.0.0.1:{target}` every 250 ms, storage in `dir`.
    fn start(dir: &Path, target: u16) -> Prometheus {
        let bin = prometheus_bin();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {rules}\n\
                 scrape_configs:\n  - job_name: xpuscope\n    static_configs:\n\
                 \x20     - targets: ['127.0.0.1:{target}']\n",
                rules = fixtures::repo_root()
                    .join("deploy/prometheus/xpuscope-rules.yml")
                    .display()
            ),
        )
        .unwrap();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--storage.tsdb.retention.time=1h")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, port };
        wait_until(Duration::from_secs(30), "prometheus ready", || {
            try_http_get(p.port, "/-/ready").is_some_and(|t| t.starts_with("HTTP/1.1 200"))
        });
        p
    }

    /// How many series a range query over the last `seconds` returns (as
    /// Grafana runs a time-series panel's query).
    fn range_series(&self, promql: &str, seconds: u64) -> usize {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let text = http_get(
            self.port,
            &format!(
                "/api/v1/query_range?query={}&start={}&end={now}&step=1",
                encode(promql),
                now - seconds
            ),
        );
        let v: Value =
            serde_json::from_str(&body_of(&text)).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"].as_array().map_or(0, Vec::len)
    }

    /// An instant PromQL query's result vector: (labels, value).
    fn query(&self, promql: &str) -> Vec<(Value, f64)> {
        let enc: String = promql
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let text = http_get(self.port, &format!("/api/v1/query?query={enc}"));
        let v: Value =
            serde_json::from_str(&body_of(&text)).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"))
            .iter()
            .map(|r| {
                (
                    r["metric"].clone(),
                    r["value"][1].as_str().unwrap().parse().unwrap(),
                )
            })
            .collect()
    }
}

/// Debian's Prometheus scrapes the service as configured by default (no
/// `honor_labels`: the scrape's own `job` and `instance` stay Prometheus's;
/// the training job is the agent's `training_job` label, which tells other
/// jobs on the machine apart).
/// PromQL over its HTTP API returns every rank's all-reduce count of a job
/// whose rank 1 computes 4x slower; in a job whose rank 1 hangs, the rank
/// whose last collective number lags its communicator's is rank 1, and the
/// hang gauge shows rank 0 waiting.
#[test]
fn prometheus_scrapes_the_service_and_promql_finds_the_lagging_rank() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let _ = agent_bin();
    let dir = TempDir::new("prom");
    let svc = Service::start(dir.path(), "");
    let prom = Prometheus::start(dir.path(), svc.port);
    const STEPS: u64 = 20;
    let truth = run_untold_job(
        dir.path(),
        "promjob",
        &[
            "--steps",
            &STEPS.to_string(),
            "--kernel-us",
            "1000",
            "--fault",
            "slow:rank=1,factor=4",
            // Rank 0's activations cache grows (4 MiB a step, far from
            // its device's memory): the dashboard's device-memory panel.
            "--fault",
            "mem_leak:rank=0,mb=4,from_step=2",
        ],
    );
    assert_eq!(truth["status"], "completed", "{truth:#}");
    // Scraped after the job's end: each rank's count, once both have all
    // (a loaded machine may take a few scrapes to get there).
    let want: std::collections::BTreeMap<String, f64> = [
        ("0".to_string(), STEPS as f64),
        ("1".to_string(), STEPS as f64),
    ]
    .into();
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let (counts, by_rank) = loop {
        let counts = prom.query(
            "sum by (rank) (xpuscope_collective_duration_seconds_count{training_job=\"promjob\",op=\"allreduce\"})",
        );
        let by_rank: std::collections::BTreeMap<String, f64> = counts
            .iter()
            .map(|(m, v)| (m["rank"].as_str().unwrap_or_default().to_string(), *v))
            .collect();
        if by_rank == want || std::time::Instant::now() > end {
            break (counts, by_rank);
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(by_rank, want, "{counts:?}");
    // Under a plain scrape configuration the labels fit: `job` and
    // `instance` are the scrape's, the training job is `training_job` (no
    // `exported_job`), the node is the one NODE_NAME names.
    for (m, _) in &counts {
        let raw = prom.query(&format!(
            "xpuscope_collective_duration_seconds_count{{training_job=\"promjob\",op=\"allreduce\",rank={}}}",
            m["rank"]
        ));
        let labels = &raw.first().expect("a series").0;
        assert_eq!(labels["job"], "xpuscope", "{labels}");
        assert!(
            labels["instance"]
                .as_str()
                .is_some_and(|i| i.starts_with("127.0.0.1:")),
            "{labels}"
        );
        assert!(labels["exported_job"].is_null(), "{labels}");
        assert_eq!(
            labels["node"],
            xpuscope_tests::service_run::TEST_NODE,
            "{labels}"
        );
    }
    // A slow rank does not lag in host-side numbers (collectives are
    // enqueued; the wait is in the stream sync on every rank alike). A rank
    // that never joins does: rank 3, on the second of two simulated nodes
    // (one launcher each, ranks 0-1 and 2-3, one data-parallel
    // communicator across both), stops before step 2's all-reduce.
    let truth = run_untold_job_on_nodes(
        dir.path(),
        "promhang",
        2,
        // The launcher's timeout (from its start) leaves the hang a few
        // seconds, the gauge's snapshots come once a second.
        &[
            "--world-size",
            "4",
            "--dp",
            "4",
            "--tp",
            "1",
            "--pp",
            "1",
            "--steps",
            "6",
            "--fault",
            "hang:rank=3,step=2",
            "--timeout",
            "8",
        ],
    );
    assert_eq!(truth["faults"][0]["rank"], 3, "{truth:#}");
    let hosts: Vec<&str> = truth["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter_map(|n| n["hostname"].as_str())
        .collect();
    assert_eq!(hosts, ["node-0", "node-1"]);
    std::thread::sleep(Duration::from_secs(1));
    // Every rank of both nodes is served.
    let served: BTreeSet<String> = prom
        .query("xpuscope_collective_last_seq{training_job=\"promhang\"}")
        .iter()
        .filter_map(|(m, _)| m["rank"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        served,
        ["0", "1", "2", "3"].map(String::from).into(),
        "ranks of both nodes"
    );
    // Samples where a rank's last collective number is below the highest
    // on its communicator, over the job: the lagging rank comes first.
    let lag = prom.query(
        "topk(1, sum by (rank) (sum_over_time((xpuscope_collective_last_seq{training_job=\"promhang\"} \
         < bool on (comm) group_left max by (comm) (xpuscope_collective_last_seq{training_job=\"promhang\"}))\
         [5m:250ms])))",
    );
    assert_eq!(lag.len(), 1, "{lag:?}");
    assert_eq!(lag[0].0["rank"], "3", "{lag:?}");
    assert!(lag[0].1 >= 4.0, "lagged for a second at least: {lag:?}");
    // The hang gauge: the rank left waiting had a call running for seconds.
    let waited = prom.query(
        "max by (rank) (max_over_time(xpuscope_in_flight_oldest_seconds{training_job=\"promhang\"}[5m]))",
    );
    let rank0 = waited
        .iter()
        .find(|(m, _)| m["rank"] == "0")
        .unwrap_or_else(|| panic!("{waited:?}"));
    assert!(rank0.1 >= 1.0, "{waited:?}");
    // The shipped rules, as loaded: the hang alert names rank 3 (pending
    // for its minute; its series stay served for minutes after the job).
    // It is pending once every sample of the rule's minute has rank 3
    // behind: at once where the steps before the hang fell between two
    // evaluations, else when the last sample taken before the hang (0
    // behind) leaves the minute, up to a minute after the hang began.
    let end = std::time::Instant::now() + Duration::from_secs(75);
    let alert = loop {
        let alert =
            prom.query("ALERTS{alertname=\"XpuscopeRankHoldsBackJob\",training_job=\"promhang\"}");
        if !alert.is_empty() || std::time::Instant::now() > end {
            break alert;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let ranks: Vec<&str> = alert
        .iter()
        .filter_map(|(m, _)| m["rank"].as_str())
        .collect();
    assert_eq!(ranks, ["3"], "{alert:?}");
    assert_eq!(alert[0].0["node"], xpuscope_tests::service_run::TEST_NODE);
    // Every query of the shipped Grafana dashboard, its variables set to
    // these jobs and this scrape, returns series.
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures::repo_root().join("deploy/grafana/xpuscope.json"))
            .expect("the dashboard"),
    )
    .expect("the dashboard is JSON");
    let mut empty = Vec::new();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .expect("a PromQL target")
                .replace("$training_job", "promjob|promhang")
                .replace("$agent_job", "xpuscope");
            queries += 1;
            // Tables are instant queries, time series ranges over the
            // recording (series of ended ranks are gone at its end).
            let found = if target["instant"] == true {
                !prom.query(&expr).is_empty()
            } else {
                prom.range_series(&expr, 300) > 0
            };
            if !found {
                empty.push(format!("{}: {expr}", panel["title"]));
            }
        }
    }
    assert!(queries >= 10, "{queries} queries");
    assert!(
        empty.is_empty(),
        "dashboard queries without series:\n{}",
        empty.join("\n")
    );
    drop(prom);
    svc.stop();
}
