//! End-to-end: `agent attach` on real workloads (root, eBPF). Every test
//! decodes the written trace with the independent decoder, checks the
//! importer's rules, and asserts what a user would see in the UI.
//!
//! These need root and a BPF-capable kernel with BTF; without them the agent
//! fails and so do these tests (they never skip).

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{
    Lines, Proc, Recording, TempDir, exclusive, go, run_agent, workload_bin,
};
use xpuscope_tests::trace_check::{State, Timeline, check_importer_rules, decode};

fn workload(args: &[&str]) -> Proc {
    Proc::spawn(
        "workload",
        Command::new(workload_bin())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    )
}

fn tid(truth: &Value, key: &str) -> i32 {
    truth[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} in {truth}")) as i32
}

#[test]
fn attach_records_the_known_pattern() {
    let _serial = exclusive();
    let dir = TempDir::new("pattern");
    let mut wl = workload(&["pattern"]);
    let mut stdin = wl.stdin();
    let mut out = Lines::new(wl.stdout());
    let rec = Recording::start(dir.path(), &["--pid", &wl.pid().to_string()]);
    // A CPU hog outside the traced process, on the victim thread's CPU.
    let _hog = Proc::spawn(
        "hog",
        Command::new(workload_bin()).args(["hog", "1", "1.4"]),
    );
    go(&mut stdin);
    let truth: Value =
        serde_json::from_str(&out.wait_for("sleep_ns", Duration::from_secs(30))).unwrap();
    let done = rec.finish(Duration::from_secs(30));
    assert!(
        done.stderr.contains("stopped (target exited)"),
        "{}",
        done.stderr
    );

    let trace = decode(&done.trace).expect("decodes with the official schema");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let pid = tid(&truth, "pid");

    // Every thread is there, named, in the right process (all were created
    // after attach; one renamed itself).
    for (key, name) in [
        ("sleeper_tid", "sleeper"),
        ("spinner_tid", "spinner"),
        ("holder_tid", "lock-holder"),
        ("waiter_tid", "lock-waiter"),
        ("renamed_tid", "renamed-worker"),
        ("victim_tid", "victim"),
    ] {
        let t = tid(&truth, key);
        assert_eq!(
            tl.thread_name(t).as_deref(),
            Some(name),
            "name of {key} {t}"
        );
        assert_eq!(
            tl.process_of(t),
            Some(pid),
            "{key} {t} belongs to the workload"
        );
        assert!(
            tl.switches.iter().any(|s| s.next_pid == t),
            "{key} {t} ran on some CPU"
        );
    }
    assert!(
        tl.renames
            .iter()
            .any(|r| r.pid == tid(&truth, "renamed_tid") && r.new_comm == "renamed-worker"),
        "the rename is in the trace"
    );

    // The main thread, present at attach, was renamed after it.
    assert_eq!(tl.thread_name(pid).as_deref(), Some("pattern-main"));

    // The forked child process appears, as a process of its own.
    let child = tid(&truth, "child_pid");
    assert_eq!(tl.process_of(child), Some(child));
    assert_eq!(tl.thread_name(child).as_deref(), Some("pattern-child"));
    assert!(
        tl.switches.iter().any(|s| s.next_pid == child),
        "the child ran"
    );

    // Sleep of the sleeper thread within 10% of what it measured itself.
    let sleeper = tid(&truth, "sleeper_tid");
    let slept: u64 = tl
        .thread_state_intervals(sleeper)
        .iter()
        .filter(|(_, _, st)| *st == State::Sleeping)
        .map(|(a, b, _)| b - a)
        .sum();
    let truth_ns = truth["sleep_ns"].as_u64().unwrap();
    let err = (slept as f64 - truth_ns as f64).abs() / truth_ns as f64;
    assert!(
        err < 0.10,
        "sleeper slept {slept} ns in the trace vs {truth_ns} ns measured ({:.1}% off)",
        err * 100.0
    );

    // Off-CPU stacks of the mutex waiter name the workload's functions and
    // the kernel's futex wait, weighted by time off CPU.
    let waiter = tid(&truth, "waiter_tid");
    let lock_waits: Vec<_> = tl
        .stack_samples
        .iter()
        .filter(|s| s.tid == waiter && s.frames.iter().any(|f| f.contains("futex")))
        .collect();
    assert!(
        !lock_waits.is_empty(),
        "the waiter has futex off-CPU stacks"
    );
    assert!(
        lock_waits
            .iter()
            .any(|s| s.frames.iter().any(|f| f == "mutex_waiter_main")),
        "user frames of the waiter: {:?}",
        lock_waits[0].frames
    );
    let waited: u64 = lock_waits.iter().map(|s| s.weight).sum();
    assert!(waited > 100_000_000, "lock waits weigh {waited} ns");

    // The hog pinned to the victim's CPU preempted it, and is named for it.
    let victim = tid(&truth, "victim_tid");
    let by_hog = tl
        .switches
        .iter()
        // Still runnable when switched out: R (tick preemption on return to
        // user space) or R+ (preempted in the kernel).
        .filter(|s| {
            s.prev_pid == victim
                && (s.prev_state == 0 || s.prev_state == 0x100)
                && s.next_comm == "cpu-hog"
        })
        .count();
    assert!(
        by_hog > 0,
        "switches from the victim (preempted) to cpu-hog"
    );
    let markers = tl
        .instants_on_thread(victim)
        .into_iter()
        .filter(|(name, args)| {
            name == "preempted by cpu-hog"
                && args.iter().any(|(k, v)| k == "by_comm" && v == "cpu-hog")
        })
        .count();
    assert!(markers > 0, "preemption markers on the victim's track");
    assert_eq!(done.stats["dropped"], 0, "no drops at this rate");
    let top: Vec<&str> = done.stats["top_preemptors"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["what"].as_str())
        .collect();
    assert!(
        top.iter().any(|w| w.starts_with("cpu-hog")),
        "summary names the hog: {top:?}"
    );
    // The job's own threads taking turns are not interference: they are
    // counted apart, never listed as preemptors.
    let own = |w: &&str| {
        w.rsplit_once('(')
            .and_then(|(_, t)| t.trim_end_matches(')').parse::<i32>().ok())
            .is_some_and(|tid| tl.process_of(tid) == Some(wl.pid() as i32))
    };
    assert!(!top.iter().any(own), "no thread of the job in {top:?}");
    assert!(
        done.stats["preempted_by_own_threads"].as_u64().is_some(),
        "{}",
        done.stats
    );
}

#[test]
fn sigterm_and_duration_leave_a_valid_trace() {
    let _serial = exclusive();
    let dir = TempDir::new("sigterm");
    let wl = workload(&["loop", "30"]);
    let rec = Recording::start(dir.path(), &["--pid", &wl.pid().to_string()]);
    std::thread::sleep(Duration::from_millis(800));
    rec.agent.signal(libc::SIGTERM);
    let done = rec.finish(Duration::from_secs(20));
    assert!(
        done.stderr.contains("stopped (terminated)"),
        "{}",
        done.stderr
    );
    let trace = decode(&done.trace).expect("a SIGTERM'd trace decodes");
    check_importer_rules(&trace).expect("and is finalized");
    let tl = Timeline::new(&trace);
    assert!(tl.switches.len() > 50, "it recorded scheduling");
    // The state each thread left its CPU in: the sleeper thread of the
    // workload's pattern leaves asleep (S) in its nanosleep. (Kernels
    // before 5.18 do not pass it to the tracepoint: the agent reads it
    // from the task; `cargo xtask test --kernel 5.15` runs this there.)
    let sleepers: std::collections::BTreeSet<i32> = tl
        .switches
        .iter()
        .filter(|s| s.next_comm == "sleeper")
        .map(|s| s.next_pid)
        .collect();
    let asleep = tl
        .switches
        .iter()
        .filter(|s| sleepers.contains(&s.prev_pid) && s.prev_state == 1)
        .count();
    assert!(asleep > 0, "the sleeper thread leaves in S: {sleepers:?}");

    let dir2 = TempDir::new("duration");
    let rec = Recording::start(
        dir2.path(),
        &["--pid", &wl.pid().to_string(), "--duration", "700ms"],
    );
    let done = rec.finish(Duration::from_secs(20));
    assert!(
        done.stderr.contains("stopped (duration reached)"),
        "{}",
        done.stderr
    );
    check_importer_rules(&decode(&done.trace).unwrap()).unwrap();
}

/// The agent's peak resident memory (the summary's, and its metrics') is
/// its own: started from a program holding 768 MiB (as this test process
/// does here, the way a large orchestration script would start it), it
/// reports what the agent itself held. getrusage's peak kept the memory
/// the process had before its exec, which a `vfork`ed or `posix_spawn`ed
/// child shares with its parent.
#[test]
fn the_agent_reports_its_own_peak_memory_not_its_starters() {
    let _serial = exclusive();
    const HELD: usize = 768 << 20;
    // Touched (non-zero), so resident.
    let held = std::hint::black_box(vec![1u8; HELD]);
    let dir = TempDir::new("own-peak");
    let wl = workload(&["loop", "10"]);
    let rec = Recording::start(
        dir.path(),
        &["--pid", &wl.pid().to_string(), "--duration", "500ms"],
    );
    let done = rec.finish(Duration::from_secs(20));
    drop(held);
    let peak = done.stats["agent_peak_rss_bytes"]
        .as_u64()
        .expect("agent_peak_rss_bytes");
    let rings = done.stats["ring_bytes"].as_u64().expect("ring_bytes");
    assert!(peak > 0, "{}", done.stats);
    assert!(
        peak < (HELD as u64) / 2,
        "the agent reported a peak of {} MiB (its rings {} MiB, mapped twice): its starter's memory, not its own",
        peak >> 20,
        rings >> 20
    );
}

#[test]
fn system_mode_records_every_process() {
    let _serial = exclusive();
    let dir = TempDir::new("system");
    let _hog = Proc::spawn(
        "hog",
        Command::new(workload_bin()).args(["hog", "0", "1.5"]),
    );
    let rec = Recording::start(dir.path(), &["--system", "--duration", "1s"]);
    let done = rec.finish(Duration::from_secs(20));
    let trace = decode(&done.trace).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let cpus: std::collections::BTreeSet<u32> = tl.switches.iter().map(|s| s.cpu).collect();
    assert_eq!(
        cpus.len(),
        std::thread::available_parallelism().unwrap().get(),
        "every CPU has a track"
    );
    assert!(
        tl.switches.iter().any(|s| s.next_comm == "cpu-hog"),
        "an untraced process is recorded"
    );
    let pids: std::collections::BTreeSet<i32> = tl.switches.iter().map(|s| s.next_pid).collect();
    assert!(pids.len() > 3, "many tasks: {pids:?}");
    // The summary says what this mode measured (not "processes 0").
    let sys = &done.stats["system_wide"];
    assert_eq!(sys["cpus"].as_u64(), Some(cpus.len() as u64), "{sys}");
    let ran = pids.iter().filter(|&&p| p != 0).count() as u64;
    assert_eq!(sys["tasks_ran"].as_u64(), Some(ran), "{sys}");
    assert_eq!(
        sys["switches"].as_u64(),
        Some(tl.switches.len() as u64),
        "{sys}"
    );
    assert!(done.stderr.contains("system-wide:"), "{}", done.stderr);
}

#[test]
fn overload_counts_every_lost_event() {
    let _serial = exclusive();
    let dir = TempDir::new("overload");
    let renames = 200_000u64;
    let mut wl = workload(&["renamer", &renames.to_string()]);
    let mut stdin = wl.stdin();
    let mut out = Lines::new(wl.stdout());
    // One page of ring buffer and a reader that naps: most renames are lost.
    let rec = Recording::start(
        dir.path(),
        &[
            "--pid",
            &wl.pid().to_string(),
            "--ring-size",
            "4k",
            "--reader-delay",
            "5ms",
            "--stacks",
            "off",
        ],
    );
    go(&mut stdin);
    out.wait_for("renames", Duration::from_secs(30));
    let done = rec.finish(Duration::from_secs(60));
    let (consumed, dropped) = done.per_kind("task_rename");
    assert!(dropped > 0, "the tiny ring overflowed");
    assert_eq!(
        consumed + dropped,
        renames,
        "produced = consumed + dropped, exactly"
    );
    assert!(
        done.stderr
            .contains(&format!("dropped: {}", done.stats["dropped"])),
        "{}",
        done.stderr
    );
    let trace = decode(&done.trace).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    assert!(
        !tl.lost_event_cpus.is_empty(),
        "lost_events marked on the CPU's bundles"
    );
    let drops = tl.counter_values("xpuscope dropped events");
    assert_eq!(
        drops.last().map(|v| *v as u64),
        done.stats["dropped"].as_u64(),
        "drop counter track"
    );
    assert_eq!(
        tl.renames.len() as u64,
        consumed,
        "every consumed rename is in the trace"
    );
}

#[test]
fn bad_input_gets_a_clear_error() {
    let _serial = exclusive();
    // No such pid.
    let out = run_agent(&[
        "attach",
        "--pid",
        "999999999",
        "-d",
        "1s",
        "-o",
        "/tmp/xpuscope-never.pftrace",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no process with pid 999999999"), "{err}");

    // Unknown option (clap's usage error).
    let out = run_agent(&["attach", "--pid", "1", "--frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--frobnicate"));

    // Malformed duration.
    let out = run_agent(&["attach", "--pid", "1", "--duration", "soon"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a duration"));

    let me = std::process::id().to_string();
    // Unwritable output.
    let out = run_agent(&[
        "attach",
        "--pid",
        &me,
        "-d",
        "1s",
        "-o",
        "/proc/xpuscope/nope.pftrace",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot write the trace to /proc/xpuscope/nope.pftrace") && err.contains("-o"),
        "{err}"
    );

    // The OS error of an unwritable output is printed once, not twice.
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");

    // A --kernel-btf file that does not exist is named as such.
    let out = run_agent(&[
        "attach",
        "--pid",
        &me,
        "-d",
        "1s",
        "--kernel-btf",
        "/nonexistent/vmlinux",
        "-o",
        "/tmp/xpuscope-never.pftrace",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the BTF file /nonexistent/vmlinux does not exist")
            && err.contains("--kernel-btf")
            && !err.contains("this kernel exposes no BTF"),
        "{err}"
    );

    // A garbage --kernel-btf file: not a BTF file, and what is wrong.
    let dir = TempDir::new("garbage-btf");
    let garbage = dir.path().join("vmlinux.btf");
    std::fs::write(&garbage, b"GARBAGE, not BTF").unwrap();
    let out = run_agent(&[
        "attach",
        "--pid",
        &me,
        "-d",
        "1s",
        "--kernel-btf",
        garbage.to_str().unwrap(),
        "-o",
        "/tmp/xpuscope-never.pftrace",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{} is not a BTF file: it starts with bytes 47 41 52 42, not the BTF magic 9f eb",
            garbage.display()
        )) && !err.contains("big-endian"),
        "{err}"
    );

    // Not root: drop to nobody with no capabilities.
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(xpuscope_tests::agent::agent_bin())
        .args([
            "attach",
            "--pid",
            &me,
            "-d",
            "1s",
            "-o",
            "/tmp/xpuscope-never.pftrace",
        ])
        .output()
        .expect("setpriv (util-linux) runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("needs root") && err.contains("sudo"), "{err}");
}

/// A process whose main thread called `pthread_exit` lives on in its other
/// threads (its leader reads as a zombie in /proc): it is traced.
#[test]
fn a_process_whose_main_thread_exited_is_traced() {
    let _serial = exclusive();
    let dir = TempDir::new("main-exits");
    let bin = xpuscope_tests::fixtures::build_all()
        .join("workloads")
        .join("xpuscope-main-exits");
    let mut wl = Proc::spawn(
        "main-exits",
        Command::new(&bin).arg("20").stdout(Stdio::piped()),
    );
    let mut out = Lines::new(wl.stdout());
    let truth: Value =
        serde_json::from_str(&out.wait_for("survivor_tid", Duration::from_secs(10))).unwrap();
    assert_eq!(truth["leader_state"], "Z", "the leader has exited: {truth}");
    let survivor = tid(&truth, "survivor_tid");
    let rec = Recording::start(
        dir.path(),
        &["--pid", &wl.pid().to_string(), "--duration", "1s"],
    );
    let done = rec.finish(Duration::from_secs(30));
    assert!(
        done.stderr.contains("stopped (duration reached)"),
        "{}",
        done.stderr
    );
    let trace = decode(&done.trace).expect("decodes with the official schema");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    // It sleeps 5 ms and spins 1 ms in a loop: ~160 wakeups a second.
    let ran = tl
        .switches
        .iter()
        .filter(|s| s.next_pid == survivor)
        .count();
    assert!(ran > 50, "the survivor ran {ran} times in the trace");
    let slept: u64 = tl
        .thread_state_intervals(survivor)
        .iter()
        .filter(|(_, _, st)| *st == State::Sleeping)
        .map(|(a, b, _)| b - a)
        .sum();
    assert!(
        slept > 300_000_000,
        "the survivor's sleeps are in its thread states ({slept} ns)"
    );
    assert_eq!(tl.thread_name(survivor).as_deref(), Some("survivor"));
    drop(wl);
}

/// A tmpfs mount removed (and unmounted) on drop.
struct SmallFs(TempDir);

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

#[test]
fn full_disk_leaves_a_valid_trace_and_says_so() {
    let _serial = exclusive();
    let fs = SmallFs(TempDir::new("fulldisk"));
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16k", "xpuscope-test"])
        .arg(fs.0.path())
        .status()
        .expect("run mount");
    assert!(mounted.success(), "mounting a small tmpfs (needs root)");
    let output = fs.0.path().join("trace.pftrace");
    // Keep the scheduler busy so the trace outgrows the disk for sure.
    let mut load = workload(&["pingpong", "400000", "0"]);
    go(&mut load.stdin());
    let out = Command::new(xpuscope_tests::agent::agent_bin())
        .args(["attach", "--system", "--duration", "4s", "-o"])
        .arg(&output)
        .stdin(Stdio::null())
        .output()
        .expect("run the agent");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(
        err.contains("cut back to its last complete packet"),
        "{err}"
    );
    let bytes = std::fs::read(&output).expect("the trace is still there");
    assert!(!bytes.is_empty());
    let trace = decode(&bytes).expect("what is left decodes");
    check_importer_rules(&trace).expect("and is a valid trace");
}
