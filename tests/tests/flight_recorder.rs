//! End-to-end: `agent service` with a 4-second flight recorder while a
//! simulated 2-rank job trains for longer than that; `agent ctl dump --at
//! T --seconds 2.5` (T a second before the request, so no record of the
//! window is still in the pipeline) writes a trace holding exactly that
//! window, checked against the ranks' own step logs: nothing older than
//! the window's start, nothing after its end, every step that lies fully
//! inside it present with its all-reduce, nothing from steps that ended
//! before it. Root and eBPF; never skipped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use xpuscope_tests::agent::{TempDir, agent_bin, exclusive};
use xpuscope_tests::device::{start_gated_job, thread_of, wait_for_closers, wait_until};
use xpuscope_tests::fixtures;
use xpuscope_tests::service_run::Service;
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

/// The recorder keeps this many seconds.
const RECORDER_SECONDS: u64 = 4;
/// The dump's window: shorter than the recorder's, ending a second ago.
const WINDOW_S: f64 = 2.5;
const WINDOW_END_AGO_S: f64 = 1.0;
/// How long the job trains before the dump: well past the recorder's window.
const TRAIN_BEFORE_DUMP: Duration = Duration::from_secs(8);

fn ctl(socket: &Path, args: &[&str]) -> Result<Value, String> {
    let out = Command::new(agent_bin())
        .arg("ctl")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run agent ctl");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("agent ctl {args:?}: not JSON ({e}): {:?}", out.stdout)))
}

/// CLOCK_REALTIME `ago` before now as RFC 3339 UTC, by GNU date (an
/// implementation independent of the agent's parser).
fn realtime_ago_rfc3339(ago: f64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let out = Command::new("date")
        .args(["-u", "-d", &format!("@{:.6}", now - ago)])
        .arg("+%Y-%m-%dT%H:%M:%S.%6NZ")
        .output()
        .expect("run date");
    assert!(out.status.success(), "date: {out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write to.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) },
        0
    );
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A rank's step from its own log (CLOCK_BOOTTIME ns).
#[derive(Debug)]
struct Step {
    step: u64,
    start: u64,
    end: u64,
}

fn steps_of(job_dir: &Path, rank: u64) -> Vec<Step> {
    let path = job_dir.join(format!("rank{rank}.steps.jsonl"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| Step {
            step: v["step"].as_u64().unwrap(),
            start: v["start_boot_ns"].as_u64().unwrap(),
            end: v["end_boot_ns"].as_u64().unwrap(),
        })
        .collect()
}

#[test]
fn a_dump_holds_exactly_the_requested_window_of_a_job_longer_than_the_recorder() {
    let _serial = exclusive();
    let began = Instant::now();
    wait_for_closers();
    fixtures::build_all();
    eprintln!("ready to start after {:?}", began.elapsed());
    let dir = TempDir::new("flight-window");
    let Service {
        mut agent,
        mut stderr,
        dump_dir,
        socket,
        ..
    } = Service::start(
        dir.path(),
        &format!("[flight_recorder]\nseconds = {RECORDER_SECONDS}\n"),
    );
    // Until the control API answers (the socket exists a little earlier).
    let up = Instant::now();
    while ctl(&socket, &["status"]).is_err() {
        if let Some(status) = agent.child.try_wait().unwrap() {
            panic!(
                "agent service exited ({status}):\n{}",
                stderr.rest(Duration::from_secs(1))
            );
        }
        assert!(
            up.elapsed() < Duration::from_secs(30),
            "the control API did not answer:\n{}",
            stderr.rest(Duration::from_millis(100))
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A job that trains until it is killed, found by the service alone.
    let job = start_gated_job(
        dir.path(),
        "window",
        "window",
        1_000_000,
        &["--timeout", "120"],
    );
    wait_until(Duration::from_secs(5), "the ranks discovered", || {
        let listed: Vec<u64> = ctl(&socket, &["processes"])
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|e| e["pid"].as_u64())
            .collect();
        job.rank_pids
            .values()
            .all(|p| listed.contains(&(*p as u64)))
    });
    eprintln!("job discovered after {:?}", began.elapsed());
    std::fs::write(&job.gate, b"").expect("open the gate");
    std::thread::sleep(TRAIN_BEFORE_DUMP);

    let at = realtime_ago_rfc3339(WINDOW_END_AGO_S);
    let boot_at = boottime_ns() - (WINDOW_END_AGO_S * 1e9) as u64;
    // `--wait`: the answer is the dump written, though its window is given
    // by its end (written once the recorder's clock passed it, at once here).
    let out = ctl(
        &socket,
        &[
            "dump",
            "--at",
            &at,
            "--seconds",
            &WINDOW_S.to_string(),
            "--wait",
        ],
    )
    .unwrap_or_else(|e| panic!("agent ctl dump --at {at} --wait: {e}"));
    let status = ctl(&socket, &["status"]).expect("status");
    assert_eq!(
        status["flight_recorder"]["last_dump"]["trace"], out["trace"],
        "the status shows the last dump: {status}"
    );
    assert_eq!(out["trigger"], "manual", "{out}");
    // A window longer than the recorder keeps is refused, with the reason.
    let refused = ctl(&socket, &["dump", "--seconds", "10"]).expect_err("a 10 s window");
    assert!(refused.contains("keeps the last"), "{refused}");

    agent.signal(libc::SIGTERM);
    let stopped = agent.wait_timeout(Duration::from_secs(60));
    let log = stderr.rest(Duration::from_secs(1));
    assert!(
        stopped.is_some_and(|s| s.success()),
        "the service stops on SIGTERM:\n{log}"
    );
    // The job has logged every step of the window; stop it.
    drop(job.launcher);

    assert!(
        status["flight_recorder"]["expired_records"]
            .as_u64()
            .is_some_and(|n| n > 0),
        "the job ran past the recorder's window, so records expired: {status}"
    );
    let start = out["window_start_ns"].as_u64().expect("window_start_ns");
    let end = out["window_end_ns"].as_u64().expect("window_end_ns");
    assert_eq!(
        end - start,
        (WINDOW_S * 1e9) as u64,
        "the window is as long as asked: {out}"
    );
    // `--at` is wall-clock time: the window ends there on CLOCK_BOOTTIME
    // (the conversion and `date`'s rounding agree to well under 100 ms).
    assert!(
        end.abs_diff(boot_at) < 100_000_000,
        "the window ends at --at {at}: boottime {boot_at}, dump {end}"
    );
    assert_eq!(
        out["complete_from_ns"],
        Value::Null,
        "nothing of the window was evicted: {out}"
    );
    let path = PathBuf::from(out["trace"].as_str().expect("trace path"));
    assert_eq!(path.parent(), Some(dump_dir.as_path()), "{out}");
    let trace = decode(&std::fs::read(&path).expect("the dump exists")).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    eprintln!("dump decoded after {:?}", began.elapsed());

    // Nothing older than the window's start nor newer than its end: a
    // slice overlaps the window, events lie inside it.
    let outside: Vec<String> = tl
        .slices
        .iter()
        .filter(|s| s.ts > end || s.end.is_some_and(|e| e < start))
        .map(|s| format!("slice {} {}..{:?}", s.name, s.ts, s.end))
        .chain(
            tl.instants
                .iter()
                .filter(|i| i.ts < start || i.ts > end)
                .map(|i| format!("instant {} at {}", i.name, i.ts)),
        )
        .chain(
            tl.switches
                .iter()
                .filter(|s| s.ts < start || s.ts > end)
                .map(|s| format!("switch on cpu {} at {}", s.cpu, s.ts)),
        )
        .chain(
            tl.wakings
                .iter()
                .filter(|w| w.ts < start || w.ts > end)
                .map(|w| format!("waking at {}", w.ts)),
        )
        .collect();
    assert!(
        outside.is_empty(),
        "window {start}..{end}: {} records outside it, e.g.:\n{}",
        outside.len(),
        outside[..outside.len().min(20)].join("\n")
    );
    assert!(
        !tl.switches.is_empty(),
        "level 1: the ranks' scheduling is in the window"
    );

    for (&rank, &pid) in &job.rank_pids {
        let reduces: Vec<(u64, u64)> = tl
            .slices
            .iter()
            .filter(|s| s.name.starts_with("ncclAllReduce"))
            .filter(|s| thread_of(&tl, s).is_some_and(|(p, _)| p == pid))
            .map(|s| (s.ts, s.end.expect("the all-reduce ended")))
            .collect();
        let steps = steps_of(&job.job_dir, rank);
        let inside: Vec<&Step> = steps
            .iter()
            .filter(|s| s.start >= start && s.end <= end)
            .collect();
        assert!(
            inside.len() >= 3,
            "rank {rank}: steps fully inside a {WINDOW_S} s window: {inside:?}"
        );
        for s in &inside {
            let n = reduces
                .iter()
                .filter(|(ts, e)| *ts >= s.start && *e <= s.end)
                .count();
            assert_eq!(
                n, 1,
                "rank {rank} step {} ({}..{}) lies inside the window {start}..{end}: its \
                 all-reduce; all-reduces in the dump: {reduces:?}",
                s.step, s.start, s.end
            );
        }
        for s in steps.iter().filter(|s| s.end < start) {
            let n = reduces
                .iter()
                .filter(|(ts, e)| *ts >= s.start && *e <= s.end)
                .count();
            assert_eq!(
                n, 0,
                "rank {rank} step {} ended before the window: nothing of it",
                s.step
            );
        }
        // Every all-reduce in the dump belongs to a step overlapping it.
        for (ts, e) in &reduces {
            assert!(
                steps
                    .iter()
                    .any(|s| s.start <= *ts && *e <= s.end && s.end >= start && s.start <= end),
                "rank {rank}: all-reduce {ts}..{e} belongs to no step overlapping the window"
            );
        }
    }
}
