//! Running the real agent and workloads from tests, with guards that kill
//! and reap every child on drop, and a lock so recordings never overlap
//! (timing assertions need the machine's two cores).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Output, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::fixtures;

/// Serializes tests that record (they share the CPUs and the tracepoints).
pub fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The agent binary: `XPUSCOPE_AGENT_BIN`, else `target/release/agent` if
/// `cargo xtask build` made it, else a fresh `cargo build -p xpuscope-agent`.
pub fn agent_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("XPUSCOPE_AGENT_BIN") {
            return PathBuf::from(p);
        }
        let root = fixtures::repo_root();
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--release", "-p", "xpuscope-agent"])
            .current_dir(&root)
            .status()
            .expect("run cargo build for the agent");
        assert!(status.success(), "building the agent failed");
        root.join("target/release/agent")
    })
    .clone()
}

/// The workload binary (see `tests/workloads/workload.c`).
pub fn workload_bin() -> PathBuf {
    fixtures::build_all();
    fixtures::fixture_out("workloads").join("xpuscope-workload")
}

/// A child process killed and reaped on drop.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name} ({cmd:?}): {e}"));
        Proc {
            child,
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stdin(&mut self) -> ChildStdin {
        self.child.stdin.take().expect("stdin was piped")
    }

    pub fn stdout(&mut self) -> ChildStdout {
        self.child.stdout.take().expect("stdout was piped")
    }

    pub fn stderr(&mut self) -> ChildStderr {
        self.child.stderr.take().expect("stderr was piped")
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid() as i32, sig) };
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lines of a child's stream, collected on a thread.
pub struct Lines {
    rx: Receiver<String>,
    pub seen: Vec<String>,
}

impl Lines {
    pub fn new(stream: impl Read + Send + 'static) -> Lines {
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Lines {
            rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `needle`; panics with what was seen.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let end = Instant::now() + timeout;
        loop {
            if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
                return l.clone();
            }
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => panic!(
                    "no line containing {needle:?} within {timeout:?}; saw:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Everything until the stream closes (or `timeout`).
    pub fn rest(&mut self, timeout: Duration) -> String {
        let end = Instant::now() + timeout;
        while let Ok(line) = self
            .rx
            .recv_timeout(end.saturating_duration_since(Instant::now()))
        {
            self.seen.push(line);
        }
        self.seen.join("\n")
    }
}

/// A recording in progress: the agent with its stderr collected.
pub struct Recording {
    pub agent: Proc,
    pub stderr: Lines,
    pub output: PathBuf,
    pub stats: PathBuf,
}

impl Recording {
    /// Starts `agent attach` with `args` (output and stats paths are added)
    /// and waits until it says it is recording.
    pub fn start(dir: &Path, args: &[&str]) -> Recording {
        Recording::start_with_env(dir, args, &[])
    }

    /// [`Recording::start`] with `env` added to the agent's environment.
    pub fn start_with_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Recording {
        let output = dir.join("trace.pftrace");
        let stats = dir.join("stats.json");
        let mut cmd = Command::new(agent_bin());
        cmd.arg("attach")
            .args(args)
            .arg("-o")
            .arg(&output)
            .arg("--stats-json")
            .arg(&stats)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .envs(env.iter().copied());
        let mut agent = Proc::spawn("agent", &mut cmd);
        let mut stderr = Lines::new(agent.stderr());
        stderr.wait_for("xpuscope: recording", Duration::from_secs(30));
        Recording {
            agent,
            stderr,
            output,
            stats,
        }
    }

    /// Waits for the agent to finish on its own; returns its stderr.
    pub fn finish(mut self, timeout: Duration) -> Finished {
        let status = self.agent.wait_timeout(timeout).unwrap_or_else(|| {
            panic!(
                "agent did not stop within {timeout:?}:\n{}",
                self.stderr.rest(Duration::from_millis(100))
            )
        });
        let stderr = self.stderr.rest(Duration::from_secs(5));
        assert!(status.success(), "agent failed ({status}):\n{stderr}");
        let trace = std::fs::read(&self.output).expect("the trace file exists");
        let stats: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&self.stats).expect("stats written"))
                .expect("stats are JSON");
        Finished {
            stderr,
            trace,
            stats,
        }
    }
}

pub struct Finished {
    pub stderr: String,
    pub trace: Vec<u8>,
    pub stats: serde_json::Value,
}

impl Finished {
    /// (consumed, dropped) records of one kind ("task_rename") in the summary.
    pub fn per_kind(&self, name: &str) -> (u64, u64) {
        let k = self.stats["per_kind"]
            .as_array()
            .expect("per_kind")
            .iter()
            .find(|k| k["kind"] == name)
            .unwrap_or_else(|| panic!("no {name} in {}", self.stats));
        (
            k["consumed"].as_u64().expect("consumed"),
            k["dropped"].as_u64().expect("dropped"),
        )
    }
}

/// A scratch directory removed on drop (kept, and named on stderr, when
/// `XPUSCOPE_TEST_KEEP` is set: a failed run's traces to look at).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("xpuscope-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("XPUSCOPE_TEST_KEEP").is_some() {
            eprintln!("kept {}", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the agent to completion with `args` (no recording expected).
pub fn run_agent(args: &[&str]) -> Output {
    Command::new(agent_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run the agent")
}

/// Sends "go" to a workload waiting on stdin.
pub fn go(stdin: &mut ChildStdin) {
    stdin.write_all(b"go\n").expect("write go");
    stdin.flush().expect("flush go");
}
