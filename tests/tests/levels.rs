//! End to end: the service's level 0 turns the scheduler programs'
//! records of the traced processes off at runtime (device calls still
//! recorded), and level 1 turns them back on, same agent. Root and eBPF;
//! never skipped.

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

/// (switches onto the rank's threads, its all-reduces) in `tl`.
fn counts(tl: &Timeline, pid: i32) -> (usize, usize) {
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
    let reduces = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("ncclAllReduce"))
        .filter(|s| thread_of(tl, s).is_some_and(|(p, _)| p == pid))
        .count();
    (switches, reduces)
}

#[test]
fn level_0_records_no_scheduling_and_level_1_does_again() {
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
    assert_eq!(svc.ctl(&["level", "0"])["level"], 0);
    let truth = run_untold_job(dir.path(), "lvl0", &["--steps", "4"]);
    let tl = dump(&svc);
    for pid in pids(&truth) {
        let (switches, reduces) = counts(&tl, pid);
        assert_eq!(switches, 0, "rank pid {pid}: no scheduling at level 0");
        assert_eq!(reduces, 4, "rank pid {pid}: its all-reduces at level 0");
    }
    assert_eq!(svc.ctl(&["level", "1"])["level"], 1);
    let truth = run_untold_job(dir.path(), "lvl1", &["--steps", "4"]);
    let tl = dump(&svc);
    for pid in pids(&truth) {
        let (switches, reduces) = counts(&tl, pid);
        assert!(switches > 0, "rank pid {pid}: scheduling at level 1");
        assert_eq!(reduces, 4, "rank pid {pid}");
    }
    assert_eq!(svc.agent.pid(), agent_pid, "same agent, no restart");
    svc.stop();
}
