//! End to end: a running service switched 0 -> 2 -> 1. Level 0 turns the
//! scheduler programs' records of the traced processes off at runtime
//! (device calls still recorded), level 2 turns them back on and adds
//! kernel launches, level 1 keeps scheduling and drops the launches again;
//! same agent throughout. Root and eBPF; never skipped.

use xpuscope_tests::agent::{TempDir, agent_bin, exclusive};
use xpuscope_tests::device::{thread_of, wait_for_closers};
use xpuscope_tests::fixtures;
use xpuscope_tests::service_run::{Service, run_untold_job};
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

/// A dump of the last 30 s, decoded.
fn dump(svc: &Service) -> Timeline {
    let out = svc.ctl(&["dump", "--seconds", "30"]);
    let path = out["trace"].as_str().unwrap_or_else(|| panic!("{out}"));
    let trace = decode(&std::fs::read(path).expect("the dump")).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    Timeline::new(&trace)
}

/// (switches onto the rank's threads, its all-reduces, its launches) in `tl`.
fn counts(tl: &Timeline, pid: i32) -> (usize, usize, usize) {
    let tids: Vec<i32> = tl
        .threads
        .iter()
        .filter(|(_, t)| t.tgid == Some(pid))
        .map(|(tid, _)| *tid)
        .chain([pid])
        .collect();
    let switches = tl
        .switches
        .iter()
        .filter(|s| tids.contains(&s.next_pid) || tids.contains(&s.prev_pid))
        .count();
    let calls = |prefix: &str| {
        tl.slices
            .iter()
            .filter(|s| s.name.starts_with(prefix))
            .filter(|s| thread_of(tl, s).is_some_and(|(p, _)| p == pid))
            .count()
    };
    (switches, calls("ncclAllReduce"), calls("cudaLaunchKernel"))
}

#[test]
fn levels_0_2_1_switch_scheduling_and_launches_at_runtime() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let _ = agent_bin();
    let dir = TempDir::new("levels0");
    let svc = Service::start(dir.path(), "");
    let agent_pid = svc.agent.pid();
    let pids = |truth: &serde_json::Value| -> Vec<i32> {
        truth["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["pid"].as_i64().unwrap() as i32)
            .collect()
    };
    // (level, scheduling expected, launches expected)
    for (level, sched, launches) in [("0", false, false), ("2", true, true), ("1", true, false)] {
        assert_eq!(
            svc.ctl(&["level", level])["level"],
            level.parse::<u64>().unwrap()
        );
        let truth = run_untold_job(dir.path(), &format!("lvl{level}"), &["--steps", "4"]);
        let tl = dump(&svc);
        for pid in pids(&truth) {
            let (switches, reduces, launched) = counts(&tl, pid);
            assert_eq!(
                switches > 0,
                sched,
                "rank pid {pid} at level {level}: {switches} switches"
            );
            assert_eq!(
                reduces, 4,
                "rank pid {pid}: its all-reduces at level {level}"
            );
            assert_eq!(
                launched > 0,
                launches,
                "rank pid {pid} at level {level}: {launched} launches"
            );
        }
    }
    assert_eq!(svc.agent.pid(), agent_pid, "same agent, no restart");
    svc.stop();
}
