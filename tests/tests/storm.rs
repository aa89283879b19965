//! End-to-end: a bystander's switch storm must not cost the target its own
//! records (a defect found under load, now fixed). A target pinned to CPU 0 forks and reaps
//! 2,000 children while an unrelated pipe ping-pong, pinned to the same
//! CPU, switches there hundreds of thousands of times a second. In `--pid`
//! mode those switches are recorded (they show what ran between the
//! target's threads), but in the bystander ring: here one too small for
//! the storm, so bystander records are lost, counted apart and named in
//! the hint, while every fork and exit of the target's children arrives in
//! a scheduler ring of only 1 MiB drained by a napping reader. Root and
//! eBPF; never skips.

use std::process::{Command, Stdio};
use std::time::Duration;

use xpuscope_tests::agent::{Finished, Lines};
use xpuscope_tests::agent::{Proc, Recording, TempDir, exclusive, go, workload_bin};
use xpuscope_tests::device::wait_for_closers;
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

const CHILDREN: u64 = 2_000;
/// The CPU the target and the storm share.
const CPU: usize = 0;

/// Pins `pid` (and so the children it forks later) to `cpu`.
fn pin(pid: u32, cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe {
        libc::sched_setaffinity(pid as i32, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(
        rc,
        0,
        "pinning pid {pid} to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn a_bystander_switch_storm_costs_the_target_none_of_its_records() {
    let _serial = exclusive();
    // An earlier test's agent may still be releasing its uprobes: the
    // kernel serializes that with this agent's one attach (the loader
    // hook), and with the storm on CPU 0 the release can outlast the 30 s
    // the start is given (CI twice, right after step_markers' agents).
    wait_for_closers();
    let dir = TempDir::new("storm");

    // The bystander: two threads pinned to CPU 0 passing a byte back and
    // forth, far more round trips than the recording lasts (killed on drop).
    let mut storm = Proc::spawn(
        "pingpong",
        Command::new(workload_bin())
            .args(["pingpong", "1000000000", &CPU.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let storm_pid = storm.pid();
    go(&mut storm.stdin());

    // The target, on the same CPU.
    let mut target = Proc::spawn(
        "churn",
        Command::new(fixtures::build_all().join("workloads/xpuscope-churn"))
            .args([&CHILDREN.to_string(), "4"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let target_pid = target.pid();
    pin(target_pid, CPU);
    let mut target_in = target.stdin();
    let mut target_out = Lines::new(target.stdout());

    // A scheduler ring of 1 MiB is plenty for the target's own records,
    // even with a reader that naps 2 ms after each batch (before the
    // bystander ring, this set-up lost ~350 of the 2,000 forks and as many
    // exits to the storm); a 64 KiB bystander ring (~740 switches, about
    // 1.5 ms of the storm) is sure to overflow.
    let rec = Recording::start(
        dir.path(),
        &[
            "--pid",
            &target_pid.to_string(),
            "--stacks",
            "off",
            "--ring-size",
            "1M",
            "--bystander-ring-size",
            "64K",
            "--reader-delay",
            "2ms",
        ],
    );
    go(&mut target_in);
    let line = target_out.wait_for("done", Duration::from_secs(120));
    assert_eq!(
        line,
        format!("done {CHILDREN} 0"),
        "the target forked and reaped every child"
    );
    // A moment for the last records to reach the ring; then stop while the
    // target lives.
    std::thread::sleep(Duration::from_millis(300));
    rec.agent.signal(libc::SIGINT);
    // Normally ~1 s. Under this storm, closing the agent's uprobe perf
    // events waits in the kernel for RCU grace periods (synchronize_rcu in
    // perf_uprobe_destroy), which the pinned ping-pong starves: stops of
    // over 60 s were seen. A slow stop, not a lost one: the trace is
    // written before; the wait is bounded here, and the slowness is an
    // open defect (see docs/src/measurements/scheduling.md).
    let done = rec.finish(Duration::from_secs(180));
    drop(target_in);
    drop(storm);
    check(&done, target_pid as i32, storm_pid as i32);
}

fn check(d: &Finished, target: i32, storm: i32) {
    let stats = &d.stats;
    let (forks, fork_drops) = d.per_kind("process_fork");
    let (exits, exit_drops) = d.per_kind("process_exit");
    let (switches, switch_drops) = d.per_kind("sched_switch");
    let (wakings, waking_drops) = d.per_kind("sched_waking");
    let (bystanders, bystander_drops) = d.per_kind("bystander_switch");
    eprintln!(
        "storm: forks {forks} (+{fork_drops}), exits {exits} (+{exit_drops}), target switches \
         {switches} (+{switch_drops}), wakings {wakings} (+{waking_drops}), bystander switches \
         {bystanders} (+{bystander_drops} dropped), {} trace bytes",
        stats["bytes"]
    );

    // Every record of the target arrived: none lost to the storm.
    assert_eq!(forks, CHILDREN, "{stats}");
    assert_eq!(exits, CHILDREN, "{stats}");
    for (name, dropped) in [
        ("process_fork", fork_drops),
        ("process_exit", exit_drops),
        ("sched_switch", switch_drops),
        ("sched_waking", waking_drops),
    ] {
        assert_eq!(dropped, 0, "{name} lost records: {stats}");
    }
    assert!(switches > 0, "the target's own switches: {stats}");

    // The storm was recorded on the target's CPU, and what did not fit is
    // counted as bystander drops, the only drops of the run.
    assert!(
        bystanders + bystander_drops > 50_000,
        "the storm's switches on CPU {CPU}: {stats}"
    );
    assert!(
        bystander_drops > 0,
        "a 64 KiB ring cannot hold the storm: {stats}"
    );
    assert_eq!(
        stats["dropped"].as_u64(),
        Some(bystander_drops + stats["kernel_skipped"].as_u64().unwrap_or(0)),
        "{stats}"
    );
    // Shown as such, with the option that sizes that ring.
    assert!(
        d.stderr.contains(&format!(
            "{bystander_drops} bystander switches (between untraced tasks) with the bystander \
             ring full"
        )),
        "{}",
        d.stderr
    );
    assert!(d.stderr.contains("--bystander-ring-size"), "{}", d.stderr);
    assert!(
        !d.stderr.contains("with the scheduler ring full"),
        "{}",
        d.stderr
    );

    // The trace: one new task and one free per child, the storm's threads
    // on the shared CPU's track, and that CPU marked as having lost events.
    let trace = decode(&d.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let children = tl
        .new_tasks
        .iter()
        .filter(|t| t.firing_pid == target && t.pid != target)
        .count() as u64;
    assert_eq!(children, CHILDREN, "one new task per child in the trace");
    let freed = tl.frees.iter().filter(|f| f.pid != target).count() as u64;
    assert_eq!(freed, CHILDREN, "one free per child in the trace");
    let storm_on_cpu = tl
        .switches
        .iter()
        .filter(|s| s.cpu == CPU as u32 && (s.next_pid == storm || s.next_comm == "pong"))
        .count() as u64;
    assert!(
        storm_on_cpu > 0 && storm_on_cpu <= bystanders + switches,
        "the storm's switches on CPU {CPU}'s track: {storm_on_cpu}"
    );
    assert!(
        tl.switches
            .iter()
            .any(|s| s.cpu == CPU as u32 && s.next_pid == target),
        "the target ran on CPU {CPU} between the storm's threads"
    );
    assert!(
        tl.lost_event_cpus.contains(&(CPU as u32)),
        "CPU {CPU} is marked lost_events: {:?}",
        tl.lost_event_cpus
    );
}
