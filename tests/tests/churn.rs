//! End-to-end: bounded state in a long run. A target forks and reaps
//! 20,000 short-lived children; every child's fork and exit is recorded or
//! counted as dropped, the kernel's traced set holds only the live target
//! at the end (each child left it as it exited), and the agent's peak RSS
//! does not grow with the number of children. Root and eBPF; never skips.

use std::process::{Command, Stdio};
use std::time::Duration;

use xpuscope_tests::agent::{Finished, Lines, Proc, Recording, TempDir, exclusive, go};
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

struct ChurnRun {
    target: u32,
    children: u64,
    done: Finished,
    /// The traced set the agent printed at its stop: (count, pids shown).
    targets_at_stop: (usize, Vec<u32>),
}

/// Records `children` forks of the churn workload over `secs` seconds,
/// stopping the agent (SIGINT) while the target still lives.
fn churn(tag: &str, children: u64, secs: &str) -> ChurnRun {
    let dir = TempDir::new(tag);
    let bin = fixtures::build_all().join("workloads/xpuscope-churn");
    let mut wl = Proc::spawn(
        "churn",
        Command::new(bin)
            .args([&children.to_string(), secs])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let mut stdin = wl.stdin();
    let mut out = Lines::new(wl.stdout());
    let target = wl.pid();
    // Scheduler records only, in a ring small enough that both runs cycle
    // through all of it: RSS then compares the agent's own tables, not how
    // much of a 32 MiB ring each run touched.
    let rec = Recording::start(
        dir.path(),
        &[
            "--pid",
            &target.to_string(),
            "--stacks",
            "off",
            "--ring-size",
            "4M",
            "--report-targets",
        ],
    );
    go(&mut stdin);
    let line = out.wait_for("done", Duration::from_secs(120));
    assert_eq!(
        line,
        format!("done {children} 0"),
        "the workload forked and reaped every child"
    );
    // A moment for the last records to reach the ring; then stop while the
    // target lives.
    std::thread::sleep(Duration::from_millis(300));
    rec.agent.signal(libc::SIGINT);
    let done = rec.finish(Duration::from_secs(60));
    let report = done
        .stderr
        .lines()
        .find_map(|l| l.split_once("xpuscope: traced set at stop: "))
        .map(|(_, r)| r.to_string())
        .unwrap_or_else(|| panic!("no traced-set report:\n{}", done.stderr));
    let (count, pids) = report
        .split_once(" processes:")
        .unwrap_or_else(|| panic!("{report}"));
    let targets_at_stop = (
        count.trim().parse().expect("a count"),
        pids.split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect(),
    );
    drop(stdin); // EOF: the workload exits
    ChurnRun {
        target,
        children,
        done,
        targets_at_stop,
    }
}

fn check(run: &ChurnRun) -> u64 {
    let d = &run.done;
    let (forks, fork_drops) = d.per_kind("process_fork");
    let (exits, exit_drops) = d.per_kind("process_exit");
    eprintln!(
        "{} children: forks {forks} (+{fork_drops} dropped), exits {exits} (+{exit_drops} \
         dropped), peak RSS {} MiB",
        run.children,
        d.stats["agent_peak_rss_bytes"].as_u64().unwrap_or(0) >> 20
    );
    // The target is single-threaded and does nothing else: one fork and
    // one exit per child, each recorded or counted as dropped.
    assert_eq!(forks + fork_drops, run.children, "{}", d.stats);
    assert_eq!(exits + exit_drops, run.children, "{}", d.stats);
    // Only the live target is still traced: every child left the set as it
    // exited (without pruning it would hold every child, up to the map's
    // 16,384 entries, and a reused pid would be traced as the old child).
    assert_eq!(run.targets_at_stop, (1, vec![run.target]), "{}", d.stderr);

    // The recorded forks and exits are in the trace, one each.
    let trace = decode(&d.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let target = run.target as i32;
    let new_children: Vec<i32> = tl
        .new_tasks
        .iter()
        .filter(|t| t.firing_pid == target && t.pid != target)
        .map(|t| t.pid)
        .collect();
    assert_eq!(new_children.len() as u64, forks);
    let freed = tl.frees.iter().filter(|f| f.pid != target).count() as u64;
    assert_eq!(freed, exits, "one exit per recorded child exit");
    d.stats["agent_peak_rss_bytes"]
        .as_u64()
        .expect("agent_peak_rss_bytes")
}

/// Every child leaves the traced set at its exit. (On kernels before 6.16,
/// whose exit tracepoint does not say which thread is its process's last,
/// the kernel program reads it from the process's live-thread count.)
#[test]
fn churning_children_leave_the_traced_set() {
    let _serial = exclusive();
    check(&churn("churn-prune", 2_000, "1"));
}

#[test]
fn churning_children_leave_the_traced_set_and_memory_bounded() {
    let _serial = exclusive();
    let small = churn("churn-small", 2_000, "1");
    let small_rss = check(&small);
    let large = churn("churn-large", 20_000, "10");
    let large_rss = check(&large);
    let growth = large_rss.saturating_sub(small_rss);
    assert!(
        growth < 20 << 20,
        "peak RSS grew {} MiB from 2,000 to 20,000 children ({} -> {} MiB)",
        growth >> 20,
        small_rss >> 20,
        large_rss >> 20
    );
}
