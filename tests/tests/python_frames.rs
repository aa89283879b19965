//! Python frames read from outside a live CPython process
//! (xpuscope_probes::python) against what the interpreter itself reports.
//!
//! The fixture (tests/workloads/py_frames.py) blocks three threads inside
//! nested functions (`train_step -> Model.forward -> time.sleep` on the
//! main thread, a lock and an `Event.wait` on two others), starts a native
//! thread that never runs Python, and prints each Python thread's stack as
//! `sys._current_frames()` gives it. The reader must return exactly those
//! functions, files and lines, in order, for each thread; nothing for the
//! native thread; and no interpreter at all in a process that is not
//! Python.
//!
//! The simulated job's Python flavor (`tests/sim/launch.py --lang
//! python`) is read the same way: every rank shows `train_step` in
//! rank.py.
//!
//! Interpreters: Debian's /usr/bin/python3.11 always (installed with apt
//! under CI), Debian unstable's 3.14 in a root of its own (chrooted, in a
//! mount namespace, in a container with and without its own pid
//! namespace), plus every pyenv CPython 3.10-3.13 under ~/.pyenv/versions
//! (the development machine has 3.10.13, 3.11.7, 3.12.1 and 3.13.0); the
//! test prints which ones it checked.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use xpuscope_probes::maps::{MappedFiles, ProcessMaps};
use xpuscope_probes::python::layout::{self, Layout};
use xpuscope_probes::python::memory::ProcMem;
use xpuscope_probes::python::walk::{FrameReader, KnownTypes};
use xpuscope_probes::python::{
    LayoutSource, MixedFrame, PyFrame, PythonProcess, PythonProcesses, interleave, step_of,
};
use xpuscope_probes::unwind::{StackCopy, Unwinder, UserRegs};
use xpuscope_tests::fixtures;
use xpuscope_tests::roots::{self, Entry};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An interpreter the test runs the fixture under.
struct Python {
    /// How the test names it.
    label: String,
    /// The interpreter's path as its process sees it.
    program: String,
    /// The root it runs in and how it entered it; `None`: the host's.
    root: Option<(&'static Path, Entry)>,
}

impl Python {
    fn host(path: PathBuf) -> Self {
        Self {
            label: path.display().to_string(),
            program: path.display().to_string(),
            root: None,
        }
    }

    /// `script` (a host file) run by this interpreter: placed inside its
    /// root first when it has one.
    fn command(&self, script: &Path) -> Command {
        match self.root {
            None => {
                let mut cmd = Command::new(&self.program);
                cmd.arg(script);
                cmd
            }
            Some((root, entry)) => {
                let dir = roots::place(root, "py_frames", &[script]);
                let name = script.file_name().expect("a file name").to_string_lossy();
                let mut cmd = entry.command(root, &self.program);
                cmd.arg(format!("{dir}/{name}"));
                cmd
            }
        }
    }
}

fn interpreters() -> Vec<Python> {
    let system = PathBuf::from("/usr/bin/python3.11");
    if !system.exists() && std::env::var("CI").is_ok_and(|v| v == "true") {
        xpuscope_tests::packages::apt_install(&["python3.11"]);
    }
    assert!(
        system.exists(),
        "/usr/bin/python3.11 is missing (apt-get install python3.11)"
    );
    let mut out = vec![Python::host(system)];
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    if let Ok(dir) = std::fs::read_dir(Path::new(&home).join(".pyenv/versions")) {
        let mut extra: Vec<PathBuf> = dir
            .filter_map(|e| {
                let v = e.ok()?.file_name().into_string().ok()?;
                let minor: u32 = v.strip_prefix("3.")?.split('.').next()?.parse().ok()?;
                let bin = e_path(&home, &v, minor);
                ((10..=13).contains(&minor) && bin.exists()).then_some(bin)
            })
            .collect();
        extra.sort();
        out.extend(extra.into_iter().map(Python::host));
    }
    // CPython 3.14 in a root of its own (Debian unstable's), entered both
    // ways a job's container may be.
    let sid = roots::sid();
    for entry in Entry::ALL {
        out.push(Python {
            label: format!("python3.14 in {} ({entry:?})", sid.display()),
            program: "/usr/bin/python3.14".into(),
            root: Some((sid, entry)),
        });
    }
    out
}

fn e_path(home: &str, version: &str, minor: u32) -> PathBuf {
    Path::new(home).join(format!(".pyenv/versions/{version}/bin/python3.{minor}"))
}

/// One frame as the fixture prints it: [function, file, line].
fn expected(frames: &serde_json::Value) -> Vec<(String, String, u32)> {
    frames
        .as_array()
        .expect("frames")
        .iter()
        .map(|f| {
            (
                f[0].as_str().expect("function").to_string(),
                f[1].as_str().expect("file").to_string(),
                f[2].as_u64().expect("line") as u32,
            )
        })
        .collect()
}

fn got(frames: &[PyFrame]) -> Vec<(String, String, u32)> {
    frames
        .iter()
        .map(|f| (f.function.clone(), f.file.clone(), f.line.unwrap_or(0)))
        .collect()
}

/// Stops thread `tid` with ptrace, copies its registers and the top 64 KiB
/// of its stack, and lets it go on.
fn stop_and_copy(tid: u32) -> (UserRegs, u64, Vec<u8>) {
    let t = tid as libc::pid_t;
    // SAFETY: ptrace/waitpid on a thread of our own child; every pointer
    // passed points at a live local of the right type and size.
    unsafe {
        assert_eq!(libc::ptrace(libc::PTRACE_SEIZE, t, 0, 0), 0, "PTRACE_SEIZE");
        assert_eq!(libc::ptrace(libc::PTRACE_INTERRUPT, t, 0, 0), 0);
        let mut status = 0;
        assert_eq!(libc::waitpid(t, &mut status, libc::__WALL), t);
        let mut regs: libc::user_regs_struct = std::mem::zeroed();
        assert_eq!(
            libc::ptrace(libc::PTRACE_GETREGS, t, 0, &mut regs as *mut _),
            0
        );
        let mut stack = vec![0u8; 64 * 1024];
        let local = libc::iovec {
            iov_base: stack.as_mut_ptr().cast(),
            iov_len: stack.len(),
        };
        let remote = libc::iovec {
            iov_base: regs.rsp as *mut libc::c_void,
            iov_len: stack.len(),
        };
        let n = libc::process_vm_readv(t, &local, 1, &remote, 1, 0);
        assert!(n > 0, "process_vm_readv");
        stack.truncate(n as usize);
        assert_eq!(libc::ptrace(libc::PTRACE_DETACH, t, 0, 0), 0);
        (
            UserRegs {
                ip: regs.rip,
                sp: regs.rsp,
                bp: regs.rbp,
            },
            regs.rsp,
            stack,
        )
    }
}

fn check_interpreter(python: &Python) {
    let script = fixtures::repo_root().join("tests/workloads/py_frames.py");
    let child = python
        .command(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", python.label));
    let mut child = Killed(child);
    let entry = python.root.map(|(_, e)| e);
    let pid = entry.map_or(child.0.id(), |e| e.program_pid(child.0.id()));
    // The fixture reports its threads as it numbers them (in a pid
    // namespace of its own, not as the kernel and the agent do).
    let host = |own: u32| roots::host_tid(pid, own);
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the fixture's report");
    let report: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("{}: the fixture's report {line:?}: {e}", python.label));

    let t0 = Instant::now();
    let mut proc = PythonProcess::attach(pid)
        .expect("attach")
        .unwrap_or_else(|| panic!("{}: no interpreter found", python.label));
    let attach = t0.elapsed();
    let interp = proc.interpreter().clone();
    // 3.13 and later are read by the layout they publish; 3.13's equals
    // this project's table of it.
    let minor = interp.version.1;
    assert_eq!(
        interp.layout_source,
        if minor >= 13 {
            LayoutSource::DebugOffsets
        } else {
            LayoutSource::Table
        },
        "{}",
        python.label
    );
    if minor == 13 {
        assert_eq!(*interp.layout(), layout::PY313, "{}", python.label);
    }
    if minor >= 14 {
        assert_eq!(*interp.layout(), layout::PY314, "{}", python.label);
    }
    assert!(
        !interp.eval_frames.is_empty(),
        "{}: no _PyEval_EvalFrameDefault",
        interp.path
    );

    let threads = report["threads"].as_object().expect("threads");
    assert_eq!(threads.len(), 4);
    for (who, t) in threads {
        let tid = host(t["tid"].as_u64().expect("tid") as u32);
        let want = expected(&t["frames"]);
        let frames = proc.frames(tid).expect("read frames");
        assert_eq!(got(&frames), want, "{} thread {who} ({tid})", python.label);
        assert!(
            frames.last().expect("frames").entry,
            "the outermost frame is entered from C"
        );
        let functions: Vec<&str> = frames.iter().map(|f| f.function.as_str()).collect();
        assert!(functions.contains(&"train_step"), "{functions:?}");
        // The step counter: `step`, the argument of train_step (and of the
        // model's methods), an int in two threads; a bool and a negative
        // number are not step counts.
        let step = step_of(&frames).map(|s| (s.name, s.value));
        let want_step = match who.as_str() {
            "main" => Some(("step", 7)),
            "backward" => Some(("step", (1 << 35) + 3)),
            _ => None,
        };
        assert_eq!(step, want_step, "{} thread {who}", python.label);
    }
    let native = host(report["native_tid"].as_u64().expect("native tid") as u32);
    assert_eq!(
        proc.frames(native)
            .expect("read frames of the native thread"),
        vec![],
        "a thread that never ran Python has no Python frames"
    );
    let reads = proc.reads();
    assert_eq!(proc.frames(native).expect("again"), vec![]);
    assert_eq!(
        proc.reads(),
        reads,
        "a thread just found to have no thread state is not looked up again"
    );

    // The thread list through glibc's `struct pthread` (how 3.10, which
    // has no native_thread_id, maps tids) finds the same threads.
    let mut via_pthread: Layout = *interp.layout();
    via_pthread.tstate_native_thread_id = None;
    let reader = FrameReader::new(
        ProcMem::open(pid).expect("open mem"),
        via_pthread,
        interp.runtime,
        KnownTypes::default(),
    );
    let mut tids: Vec<u32> = reader
        .thread_states()
        .expect("thread list")
        .iter()
        .map(|t| t.tid.expect("a tid from struct pthread"))
        .collect();
    tids.sort_unstable();
    assert_eq!(tids, proc.threads().expect("threads"));

    // A mixed stack of the main thread: native frames (CFI unwinding of
    // the stopped thread) with the Python frames at the evaluation frames,
    // one evaluation call per frame marked `entry`.
    let main = host(threads["main"]["tid"].as_u64().expect("tid") as u32);
    let py = proc.frames(main).expect("frames");
    let (regs, base, stack) = stop_and_copy(main);
    let maps = ProcessMaps::read(pid).expect("maps");
    let mut unwinder = Unwinder::new();
    // The process's own files: another root's are not the host's.
    let unwound = unwinder.process(&maps, MappedFiles::Process(pid)).unwind(
        regs,
        &StackCopy {
            base,
            bytes: &stack,
        },
        127,
    );
    assert!(!unwound.truncated, "{:x?}", unwound.frames);
    let evals = unwound
        .frames
        .iter()
        .filter(|&&a| proc.is_eval_frame(a))
        .count();
    let entries = py.iter().filter(|f| f.entry).count();
    let described: Vec<String> = unwound
        .frames
        .iter()
        .map(|&a| match maps.find(a) {
            Some(m) => format!("{a:#x} {}+{:#x}", m.path, m.file_offset_of(a)),
            None => format!("{a:#x} ?"),
        })
        .collect();
    assert_eq!(
        evals, entries,
        "{}: evaluation frames vs entry frames; native stack {described:#?}, eval ranges {:x?}",
        python.label, interp.eval_frames
    );
    let mixed = interleave(&unwound.frames, &py, |a| proc.is_eval_frame(a));
    let python_in_mixed: Vec<&PyFrame> = mixed
        .iter()
        .filter_map(|m| match m {
            MixedFrame::Python(f) => Some(f),
            MixedFrame::Native(_) => None,
        })
        .collect();
    assert_eq!(python_in_mixed, py.iter().collect::<Vec<_>>());
    assert!(
        matches!(mixed[0], MixedFrame::Native(_)),
        "the thread sleeps in native code"
    );
    println!(
        "{}: mixed main-thread stack: {} native + {} Python frames, {evals} evaluation call(s)",
        python.label,
        unwound.frames.len() - evals,
        py.len()
    );

    // Cost (figures, no asserts): the first stack of a thread (thread
    // list walk, code objects read), then steady state (code objects
    // cached), for the 3-frame main thread and the deep thread.
    let mut figures = Vec::new();
    for who in ["main", "deep"] {
        let tid = host(threads[who]["tid"].as_u64().expect("tid") as u32);
        let mut fresh = PythonProcess::attach(pid).expect("attach").expect("python");
        let t0 = Instant::now();
        let depth = fresh.frames(tid).expect("frames").len();
        let first = (t0.elapsed(), fresh.reads());
        let n = 1000;
        let reads0 = fresh.reads();
        let t0 = Instant::now();
        for _ in 0..n {
            assert_eq!(fresh.frames(tid).expect("frames").len(), depth);
        }
        let per = t0.elapsed() / n;
        let reads = (fresh.reads() - reads0) as f64 / f64::from(n);
        figures.push(format!(
            "{depth} frames: first {:?} ({} reads), then {per:?} ({reads:.0} reads)",
            first.0, first.1
        ));
    }
    println!(
        "{} ({}.{}.{}): attach {attach:?}; {}",
        python.label,
        interp.version.0,
        interp.version.1,
        interp.version.2,
        figures.join("; "),
    );
}

#[test]
fn python_frames_match_the_interpreter() {
    let pythons = interpreters();
    for p in &pythons {
        check_interpreter(p);
    }
    println!(
        "checked: {}",
        pythons
            .iter()
            .map(|p| p.label.clone())
            .collect::<Vec<_>>()
            .join(", ")
    );

    // A process that is not Python.
    let sleeper = Command::new("sleep").arg("60").spawn().expect("sleep");
    let sleeper = Killed(sleeper);
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        PythonProcess::attach(sleeper.0.id())
            .expect("attach to sleep")
            .is_none()
    );
    let mut cache = PythonProcesses::new();
    assert!(cache.get(sleeper.0.id()).expect("cached lookup").is_none());
    let python = Killed(
        Command::new("/usr/bin/python3.11")
            .args(["-c", "import time; time.sleep(60)"])
            .spawn()
            .expect("python3.11"),
    );
    let pid = python.0.id();
    // spawn returns once exec has replaced the address space, possibly
    // before the kernel has mapped the new program: wait for it.
    let start = Instant::now();
    while !ProcessMaps::read(pid)
        .expect("maps")
        .mappings()
        .iter()
        .any(|m| m.path.ends_with("python3.11"))
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "python3.11 not mapped"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Its thread list fills once it has initialised.
    loop {
        let proc = cache.get(pid).expect("attach").expect("a Python process");
        assert_eq!(proc.pid(), pid);
        if proc.threads().is_ok_and(|t| t == [pid]) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no Python thread"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cache.forget(pid);
}

/// Kills a process group (the launcher and its ranks) when dropped.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: signalling the process group this test created.
        unsafe {
            libc::kill(-(self.0.id() as libc::pid_t), libc::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

/// The rank processes of the launcher's process group.
fn ranks_of(group: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // pgrp is the 3rd field after the parenthesised comm.
        let pgrp = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(2)?.parse::<u32>().ok());
        if pgrp == Some(group) && String::from_utf8_lossy(&cmdline).contains("rank.py") {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

#[test]
fn sim_python_ranks_show_train_step() {
    // A simulated job takes CPU: not beside a recording.
    let _serial = xpuscope_tests::agent::exclusive();
    let fixtures = fixtures::build_all();
    let dir = std::env::temp_dir().join(format!("xpuscope-pyframes-sim-{}", std::process::id()));
    let launcher = Command::new("python3")
        .arg(fixtures::repo_root().join("tests/sim/launch.py"))
        .arg("--out-dir")
        .arg(&dir)
        .arg("--build-dir")
        .arg(fixtures.join("sim"))
        .args([
            "--quiet",
            "--lang",
            "python",
            "--world-size",
            "2",
            "--dp",
            "2",
        ])
        .args(["--steps", "100000"])
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn tests/sim/launch.py");
    let group = Group(launcher);
    let world = 2;
    let start = Instant::now();
    let mut seen: BTreeMap<u32, Vec<PyFrame>> = BTreeMap::new();
    let mut samples = 0;
    while seen.len() < world && start.elapsed() < Duration::from_secs(30) {
        for pid in ranks_of(group.0.id()) {
            if seen.contains_key(&pid) {
                continue;
            }
            let Ok(Some(mut proc)) = PythonProcess::attach(pid) else {
                continue;
            };
            for tid in proc.threads().unwrap_or_default() {
                samples += 1;
                let Ok(frames) = proc.frames(tid) else {
                    continue;
                };
                if frames.iter().any(|f| {
                    f.function == "train_step" && f.file.ends_with("rank.py") && f.line.is_some()
                }) {
                    seen.insert(pid, frames);
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(group);
    let _ = std::fs::remove_dir_all(&dir);
    for (pid, frames) in &seen {
        let stack: Vec<String> = frames
            .iter()
            .map(|f| format!("{}:{}", f.function, f.line.unwrap_or(0)))
            .collect();
        println!("rank pid {pid}: {}", stack.join(" <- "));
    }
    assert_eq!(
        seen.len(),
        world,
        "ranks whose stack showed train_step in rank.py within 30 s ({samples} samples)"
    );
}
