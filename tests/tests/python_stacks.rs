//! End to end: `agent attach` on a running CPython 3.11 process (no
//! restart, no LD_PRELOAD) writes off-CPU stacks with the Python frames in
//! place of the interpreter's evaluation frames ("mixed" stacks): the main
//! thread's `train_step -> forward` around `time.sleep`, the loader
//! thread's `loader -> fetch_batch` around a lock wait, each with its file
//! and line, innermost first below the native frames of the wait; and
//! the summary's top off-CPU reasons name the Python function. Root and
//! eBPF; never skipped.

use std::process::{Command, Stdio};
use std::time::Duration;

use xpuscope_tests::agent::{Lines, Proc, Recording, TempDir, exclusive, go};
use xpuscope_tests::fixtures;
use xpuscope_tests::roots::{self, Entry};
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

/// The line of `tests/workloads/py_offcpu.py` marked `# MARK <mark>`.
fn line_of(script: &str, mark: &str) -> usize {
    script
        .lines()
        .position(|l| l.contains(&format!("# MARK {mark}")))
        .unwrap_or_else(|| panic!("no MARK {mark}"))
        + 1
}

#[test]
fn attach_shows_python_frames_in_off_cpu_stacks() {
    let _serial = exclusive();
    let python = std::path::Path::new("/usr/bin/python3.11");
    if !python.exists() && std::env::var("CI").is_ok_and(|v| v == "true") {
        xpuscope_tests::packages::apt_install(&["python3.11"]);
    }
    assert!(
        python.exists(),
        "/usr/bin/python3.11 is missing (apt-get install python3.11)"
    );
    let script_path = fixtures::repo_root().join("tests/workloads/py_offcpu.py");
    let mut cmd = Command::new(python);
    cmd.arg(&script_path);
    check_offcpu_stacks(cmd, None);
}

/// The same for CPython 3.14 (Debian unstable's, stripped, its evaluation
/// loop split by the compiler) in a container: an overlay of Debian
/// unstable's root as its root, in mount and pid namespaces of its own.
/// Its maps name its glibc `/usr/lib/x86_64-linux-gnu/libc.so.6`, which on
/// the host is another glibc; its thread states hold its own thread ids.
#[test]
fn attach_shows_python_frames_of_a_job_in_a_container() {
    let _serial = exclusive();
    let root = roots::sid();
    let script_path = fixtures::repo_root().join("tests/workloads/py_offcpu.py");
    let dir = roots::place(root, "py_offcpu", &[&script_path]);
    let entry = Entry::ContainerPidNamespace;
    let mut cmd = entry.command(root, "/usr/bin/python3.14");
    cmd.arg(format!("{dir}/py_offcpu.py"));
    let stacks = check_offcpu_stacks(cmd, Some(entry));
    // Named from the process's own glibc (the host's symbols at its
    // offsets would name other functions): the main thread starts in its
    // __libc_start_main.
    assert!(
        stacks.iter().any(|s| s
            .iter()
            .any(|(f, m)| f == "__libc_start_main" && m.ends_with("libc.so.6"))),
        "no stack starts in glibc's __libc_start_main: {stacks:#?}"
    );
}

/// Runs `tests/workloads/py_offcpu.py` as `python` (a command that runs
/// it) under `agent attach` and checks its mixed stacks; returns them
/// (frame, mapping), root first.
fn check_offcpu_stacks(mut python: Command, entry: Option<Entry>) -> Vec<Vec<(String, String)>> {
    let script_path = fixtures::repo_root().join("tests/workloads/py_offcpu.py");
    let script = std::fs::read_to_string(&script_path).expect("the fixture");
    let dir = TempDir::new("pystacks");
    let mut py = Proc::spawn(
        "python",
        python.stdin(Stdio::piped()).stdout(Stdio::piped()),
    );
    let mut stdin = py.stdin();
    let mut out = Lines::new(py.stdout());
    out.wait_for("pid ", Duration::from_secs(20));
    // The interpreter's host pid (`unshare` forks it into a pid namespace).
    let program = entry.map_or(py.pid(), |e| e.program_pid(py.pid()));
    let rec = Recording::start(
        dir.path(),
        &["--pid", &program.to_string(), "--stacks", "all"],
    );
    go(&mut stdin);
    let done = rec.finish(Duration::from_secs(60));
    let trace = decode(&done.trace).expect("decodes with the official schema");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);

    let file = "py_offcpu.py";
    // Innermost first, as the chain must appear (root first in samples).
    let chains = [
        vec![
            format!("forward ({file}:{})", line_of(&script, "forward-sleep")),
            format!(
                "train_step ({file}:{})",
                line_of(&script, "train_step-call")
            ),
        ],
        vec![
            format!("fetch_batch ({file}:{})", line_of(&script, "fetch-wait")),
            format!("loader ({file}:{})", line_of(&script, "loader-call")),
        ],
    ];
    let pid = program as i32;
    let samples: Vec<_> = tl.stack_samples.iter().filter(|s| s.pid == pid).collect();
    assert!(
        !samples.is_empty(),
        "no off-CPU stacks of the Python process"
    );
    for chain in &chains {
        let found = samples.iter().any(|s| {
            // Root first in the sample: the chain reversed, the innermost
            // Python frames, above the kernel's frames of the wait.
            let want: Vec<&str> = chain.iter().rev().map(String::as_str).collect();
            let python_frames: Vec<&str> = s
                .frames
                .iter()
                .zip(&s.mappings)
                .filter(|(_, m)| m.starts_with("[python]"))
                .map(|(f, _)| f.as_str())
                .collect();
            python_frames.ends_with(&want) && s.mappings.iter().any(|m| m == "kernel")
        });
        assert!(
            found,
            "no off-CPU stack holds {chain:?}; the Python process's stacks:\n{:#?}",
            samples
                .iter()
                .take(12)
                .map(|s| s.describe())
                .collect::<Vec<_>>()
        );
    }
    // Native frames are named by function symbols: none after data.
    for s in &samples {
        for (f, m) in s.frames.iter().zip(&s.mappings) {
            assert!(
                !["_PyRuntime", "_Py_NoneStruct", "_Py_TrueStruct"].contains(&f.as_str()),
                "a frame named after data: {f} ({m}) in {:?}",
                s.frames
            );
        }
    }
    let stats = &done.stats;
    assert!(stats["python_stacks"].as_u64().unwrap() > 0, "{stats}");
    // The summary names the Python function a thread waited in.
    let reasons: Vec<&str> = stats["top_offcpu"]
        .as_array()
        .expect("top_offcpu")
        .iter()
        .filter_map(|r| r["what"].as_str())
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains(&chains[0][0]) || r.contains(&chains[1][0])),
        "{reasons:?}"
    );
    samples
        .iter()
        .map(|s| {
            s.frames
                .iter()
                .cloned()
                .zip(s.mappings.iter().cloned())
                .collect()
        })
        .collect()
}

/// The simulator's Python flavor, rank 1 stuck before step 2's
/// all-reduce (`hang` fault), recorded from before the ranks start: the
/// hang finding says where rank 1's main thread waits, in Python
/// (`stuck_before_collective` called from `train_step`, with rank.py's
/// lines), and rank 0's off-CPU stacks in its collectives' syncs show its
/// Python callers.
#[test]
fn a_python_rank_that_hangs_is_found_where_it_waits() {
    let _serial = exclusive();
    python_rank_hang(None, "pyhang");
}

/// The same job in a container (an overlay of Debian unstable's root,
/// CPython 3.14, a mount namespace of its own).
#[test]
fn a_python_rank_in_a_container_that_hangs_is_found_where_it_waits() {
    let _serial = exclusive();
    python_rank_hang(Some((roots::sid(), Entry::Container)), "pyhangroot");
}

fn python_rank_hang(root: Option<(&'static std::path::Path, Entry)>, tag: &str) {
    let run = xpuscope_tests::device::run_from_spawn_in(
        root,
        tag,
        &[
            "--lang",
            "python",
            "--steps",
            "6",
            "--fault",
            "hang:rank=1,step=2",
            "--timeout",
            "8",
        ],
        &["--hang-timeout", "1s"],
    );
    let findings = run.stats["findings"]["findings"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", run.stats["findings"]));
    let hang = findings
        .iter()
        .find(|f| f["kind"] == "hang")
        .unwrap_or_else(|| panic!("no hang: {findings:#?}"));
    assert_eq!(hang["ranks"], serde_json::json!([1]), "{hang:#}");
    let summary = hang["summary"].as_str().unwrap();
    assert!(
        summary.contains("rank 1's main thread")
            && summary.contains("stuck_before_collective (rank.py:")
            && summary.contains("train_step (rank.py:"),
        "{summary}"
    );
    let waits = &hang["evidence"]["never_entered_main_threads"][0];
    assert!(
        waits["frames"][0]
            .as_str()
            .is_some_and(|f| f.starts_with("stuck_before_collective (rank.py:")),
        "{waits:#}"
    );
    // Rank 0 waits in its syncs; its off-CPU stacks name its Python code.
    let rank0 = run.rank_pids[&0];
    let with_train_step = run
        .tl
        .stack_samples
        .iter()
        .filter(|s| s.pid == rank0)
        .filter(|s| {
            s.frames
                .iter()
                .any(|f| f.starts_with("train_step (rank.py:"))
        })
        .count();
    assert!(
        with_train_step > 0,
        "rank 0 has no stack through train_step"
    );
}

/// A traced Python program that makes 20,000 distinct functions, each
/// with a 128 KiB line table, and goes off CPU in each, recorded with a
/// stack at every switch: the agent reads every code object, and an
/// unbounded code cache would copy up to 16,384 of those tables (2 GiB).
/// The agent stays far below that (its peak resident memory), the Python
/// code cache stays within its per-process bound and counts what it
/// evicted, and the trace still decodes with the flood's Python frames.
#[test]
fn a_code_object_flood_keeps_the_agent_bounded() {
    let _serial = exclusive();
    let python = std::path::Path::new("/usr/bin/python3.11");
    if !python.exists() && std::env::var("CI").is_ok_and(|v| v == "true") {
        xpuscope_tests::packages::apt_install(&["python3.11"]);
    }
    assert!(
        python.exists(),
        "/usr/bin/python3.11 is missing (apt-get install python3.11)"
    );
    const FUNCTIONS: u64 = 20_000;
    const TABLE: u64 = 128 << 10;
    let script = fixtures::repo_root().join("tests/workloads/py_code_flood.py");
    let dir = TempDir::new("pyflood");
    let mut py = Proc::spawn(
        "python",
        Command::new(python)
            .arg(&script)
            .arg(FUNCTIONS.to_string())
            .arg(TABLE.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let mut stdin = py.stdin();
    let mut out = Lines::new(py.stdout());
    out.wait_for("pid ", Duration::from_secs(60));
    let rec = Recording::start(
        dir.path(),
        &["--pid", &py.pid().to_string(), "--stacks", "all"],
    );
    go(&mut stdin);
    let done = rec.finish(Duration::from_secs(180));
    let stats = &done.stats;
    let peak_rss = stats["agent_peak_rss_bytes"].as_u64().expect("peak RSS");
    let code = &stats["caches"]["python"];
    eprintln!(
        "python_stacks {} errors {}; agent peak RSS {} MiB; python code cache {code}",
        stats["python_stacks"],
        stats["python_stack_errors"],
        peak_rss >> 20
    );
    let stacks = stats["python_stacks"].as_u64().expect("python_stacks");
    // Enough code objects read that an unbounded cache would hold
    // gigabytes: each is a 128 KiB copy.
    assert!(stacks > 5_000, "too few Python stacks to flood: {stats}");
    assert!(
        peak_rss < 512 << 20,
        "the agent's peak RSS {} MiB (an unbounded cache of {stacks} code objects would hold up to {} MiB)",
        peak_rss >> 20,
        (stacks.min(16_384) * TABLE) >> 20
    );
    let peak_code = code["peak_bytes"]
        .as_u64()
        .expect("caches.python.peak_bytes");
    assert!(
        peak_code > 0 && peak_code <= 64 << 20,
        "the code cache held {peak_code} bytes at its peak: {code}"
    );
    assert!(
        code["evicted"].as_u64().expect("caches.python.evicted") > 0
            && code["evicted_bytes"].as_u64().expect("evicted_bytes") > 0,
        "{code}"
    );
    let trace = decode(&done.trace).expect("decodes with the official schema");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let pid = py.pid() as i32;
    let flood_frames = tl
        .stack_samples
        .iter()
        .filter(|s| s.pid == pid)
        .filter(|s| {
            s.frames
                .iter()
                .zip(&s.mappings)
                .any(|(f, m)| m.starts_with("[python]") && f.starts_with("flood_"))
        })
        .count();
    assert!(
        flood_frames > 1_000,
        "only {flood_frames} stacks show a flood_ function's Python frame"
    );
}
