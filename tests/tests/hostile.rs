//! End-to-end: traced processes that try to stall, exhaust or blind the
//! privileged agent. Any local user can become traced (a process is traced
//! for mapping a file whose name looks like a device library, or for its
//! command name), so what such a process hands the agent (library paths,
//! files, crashes) must never stop the agent reading its rings, answering
//! its endpoints or keeping the evidence of a real incident. Root and eBPF;
//! never skipped.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use xpuscope_tests::agent::{Proc, TempDir, exclusive};
use xpuscope_tests::device::wait_for_closers;
use xpuscope_tests::service_run::{Service, ctl, stop_service, wait_traced};

/// `GET path` on the service's metrics port, answered within `limit`
/// (status line and body), or why not.
fn http_get_within(port: u16, path: &str, limit: Duration) -> Result<String, String> {
    let mut s = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), limit)
        .map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(limit)).unwrap();
    s.set_write_timeout(Some(limit)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("write: {e}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .map_err(|e| format!("no answer within {limit:?}: {e}"))?;
    Ok(text)
}

/// A shell under a command name the service's discovery matches, running
/// `script` once `gate` exists (so it is traced before it does anything).
fn traced_shell(dir: &Path, name: &str, gate: &Path, script: &str) -> Proc {
    let shell = dir.join(name);
    std::fs::copy("/bin/sh", &shell).expect("copy /bin/sh");
    Proc::spawn(
        name,
        Command::new(&shell)
            .arg("-c")
            .arg(format!(
                "while [ ! -e '{}' ]; do sleep 0.05; done; {script}",
                gate.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
}

/// A traced process starts a program whose `LD_LIBRARY_PATH` holds a FIFO
/// named `libc.so.6`. The agent replays the loader's search at that exec
/// (to probe device libraries before they are mapped); opening the FIFO
/// like a file would block until someone writes to it. The service must
/// go on answering `/healthz` within a second, and go on tracing: a process
/// started afterwards is still found and listed.
#[test]
fn a_fifo_in_a_library_path_stalls_nothing() {
    let _serial = exclusive();
    wait_for_closers();
    let dir = TempDir::new("hostile-fifo");
    let lib = dir.path().join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    let fifo = lib.join("libc.so.6");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
    let Service {
        mut agent,
        mut stderr,
        socket,
        port,
        ..
    } = Service::start(
        dir.path(),
        "[discovery]\ncomm = \"^xpuscope-(fifo|late)$\"\n",
    );
    let gate = dir.path().join("go");
    // The program started is itself stuck in its own loader on the FIFO;
    // it is killed with its shell at the end.
    let shell = traced_shell(
        dir.path(),
        "xpuscope-fifo",
        &gate,
        &format!("LD_LIBRARY_PATH='{}' exec /bin/true", lib.display()),
    );
    wait_traced(&socket, shell.pid(), Duration::from_secs(10));
    std::fs::write(&gate, b"").unwrap();
    // Several seconds of health checks: the search happens at the exec,
    // within the first of them.
    let checks = Instant::now();
    while checks.elapsed() < Duration::from_secs(4) {
        let asked = Instant::now();
        match http_get_within(port, "/healthz", Duration::from_secs(1)) {
            Ok(text) => assert!(
                text.starts_with("HTTP/1.1 200"),
                "/healthz is not ok {:?} after the exec: {text}\n{}",
                checks.elapsed(),
                stderr.rest(Duration::from_millis(200))
            ),
            Err(e) => panic!(
                "/healthz did not answer ({e}, asked {:?} after the exec, waited {:?}):\n{}",
                checks.elapsed(),
                asked.elapsed(),
                stderr.rest(Duration::from_millis(200))
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // The kernel side still works: a process started now is traced.
    let late_gate = dir.path().join("late-go");
    let late = traced_shell(dir.path(), "xpuscope-late", &late_gate, "true");
    wait_traced(&socket, late.pid(), Duration::from_secs(10));
    std::fs::write(&late_gate, b"").unwrap();
    let status = ctl(&socket, &["status"]);
    assert!(status.is_object(), "{status}");
    shell.signal(libc::SIGKILL);
    // The child stuck on the FIFO: opened for writing once, it goes on.
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo);
    stop_service(&mut agent, &mut stderr);
}

/// Agents one after another: the kernel releases an agent's uprobes after
/// it exits, slowly (one perf event at a time where uprobe-multi links are
/// not used: about 90 ms each, under the mutex that attaching takes too).
/// An agent started meanwhile must still record every call of its job,
/// from the ranks' first: it waits for the releases before it starts
/// recording, and says so. The second agent attaches one perf event per
/// function too, as on kernels without uprobe-multi links (before 6.6):
/// each of those registrations would queue behind a release, and the
/// ranks' set-up calls (100 ms after their start) went unrecorded.
#[test]
fn an_agent_started_while_earlier_probes_are_released_records_every_call() {
    use super::probes_early::{INIT_DELAY, assert_fully_identified, run_spawn_gated_with};
    let _serial = exclusive();
    wait_for_closers();
    let extra = ["--init-delay-ms", INIT_DELAY];
    // The first agent's probes are perf events: their release takes
    // seconds.
    let first = run_spawn_gated_with(
        "b2b-first",
        2,
        &extra,
        &[("XPUSCOPE_UPROBE_LINKS", "perf-event")],
    );
    assert!(!first.rank_pids.is_empty());
    assert!(
        xpuscope_tests::device::closers_running(),
        "the first agent's probes were released already: this test shows nothing"
    );
    let second = run_spawn_gated_with(
        "b2b-second",
        4,
        &extra,
        &[("XPUSCOPE_UPROBE_LINKS", "perf-event")],
    );
    assert_fully_identified(&second, "ncclCommInitRank", "nccl", true);
    assert!(
        second
            .stderr
            .contains("waiting for earlier agents' device probes to be released"),
        "the second agent did not say it waited:\n{}",
        second.stderr
    );
    let device = &second.stats["device"];
    assert_eq!(device["slow_attaches"], 0, "{device}");
}

/// Thread churn against the stack rate limit: each new thread used to
/// start with a full burst of stack credit (20 stacks at the default
/// policy), so a process starting short-lived threads took a stack at
/// nearly every switch-out, the rate limit bypassed. A new thread now
/// starts with one stack's credit and earns more at the policy's rate.
#[test]
fn thread_churn_does_not_bypass_the_stack_rate_limit() {
    use xpuscope_tests::device::python_program;
    use xpuscope_tests::trace_check::{Timeline, decode};
    let _serial = exclusive();
    let dir = TempDir::new("churn-stack-rate");
    // 100 threads one after another, each blocking 30 times in 0.5 ms
    // sleeps (about 20 ms of life): 3,000 switch-outs.
    let program = r#"
import sys, threading, time
sys.stdin.readline()
def worker():
    for _ in range(30):
        time.sleep(0.0005)
for _ in range(100):
    t = threading.Thread(target=worker)
    t.start()
    t.join()
print("done", flush=True)
sys.stdin.readline()
"#;
    let mut py = python_program("thread-churn", program, &[] as &[&str]);
    let rec =
        xpuscope_tests::agent::Recording::start(dir.path(), &["--pid", &py.pid().to_string()]);
    let mut out = xpuscope_tests::agent::Lines::new(py.stdout());
    xpuscope_tests::agent::go(&mut py.stdin());
    out.wait_for("done", Duration::from_secs(60));
    drop(py);
    let done = rec.finish(Duration::from_secs(60));
    let tl = Timeline::new(&decode(&done.trace).expect("decodes"));
    let mut per_thread: std::collections::BTreeMap<i32, usize> = Default::default();
    for s in &tl.stack_samples {
        *per_thread.entry(s.tid).or_default() += 1;
    }
    // The workers: every thread of the process but its main one.
    let main_tid = tl
        .stack_samples
        .iter()
        .find(|s| s.tid == s.pid)
        .map(|s| s.tid);
    let mut workers: Vec<usize> = per_thread
        .iter()
        .filter(|(tid, _)| Some(**tid) != main_tid)
        .map(|(_, n)| *n)
        .collect();
    workers.sort_unstable();
    assert!(
        workers.len() >= 50,
        "stacks of {} worker threads",
        workers.len()
    );
    let median = workers[workers.len() / 2];
    // One stack at the start and one per 10 ms (100 per second) of a
    // ~20 ms life: about 3; the old burst gave each up to 20.
    assert!(
        median <= 6,
        "a short-lived thread took {median} stacks (median of {}): {workers:?}",
        workers.len()
    );
}
