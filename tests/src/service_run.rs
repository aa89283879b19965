//! A running `agent service` for tests, and simulated jobs nobody tells it
//! about.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::agent::{Lines, Proc, agent_bin};
use crate::device::{GroupGuard, read_json};
use crate::fixtures;

/// The node name test services are given (`NODE_NAME`).
pub const TEST_NODE: &str = "xpuscope-test-node";

/// `agent service` with `config` (TOML appended to the test's own keys),
/// until stopped.
pub struct Service {
    pub agent: Proc,
    pub stderr: Lines,
    pub dump_dir: PathBuf,
    pub socket: PathBuf,
    pub port: u16,
}

impl Service {
    /// Starts `agent service` with `config` added to a configuration of
    /// its own in `dir`; `NODE_NAME` is [`TEST_NODE`].
    pub fn start(dir: &Path, config: &str) -> Service {
        Service::start_with_env(dir, config, &[])
    }

    /// [`Service::start`] with `env` added to the agent's environment.
    pub fn start_with_env(dir: &Path, config: &str, env: &[(&str, &str)]) -> Service {
        let socket = dir.join("run/agent.sock");
        let dump_dir = dir.join("dumps");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let path = dir.join("agent.toml");
        std::fs::write(
            &path,
            format!(
                "level = 1\ndump_dir = \"{}\"\nmax_dumps_per_hour = 100\n\
                 [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
                 [control]\nsocket = \"{}\"\n{config}",
                dump_dir.display(),
                socket.display()
            ),
        )
        .unwrap();
        let mut agent = Proc::spawn(
            "agent service",
            Command::new(agent_bin())
                .arg("service")
                .arg("--config")
                .arg(&path)
                .env("RUST_LOG", "info")
                // As the DaemonSet sets it: the metrics' `node`.
                .env("NODE_NAME", TEST_NODE)
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
        );
        let mut stderr = Lines::new(agent.stderr());
        let up = Instant::now();
        while !socket.exists() {
            if let Some(status) = agent.child.try_wait().unwrap() {
                panic!(
                    "agent service exited ({status}):\n{}",
                    stderr.rest(Duration::from_secs(1))
                );
            }
            assert!(
                up.elapsed() < Duration::from_secs(30),
                "no control socket:\n{}",
                stderr.rest(Duration::from_millis(100))
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Service {
            agent,
            stderr,
            dump_dir,
            socket,
            port,
        }
    }

    /// Waits (up to `limit`) for a dump whose name ends with `-{trigger}`
    /// and whose summary names a finding that passes `wanted`: (summary
    /// with that finding as `finding`, trace path).
    pub fn wait_dump(
        &mut self,
        trigger: &str,
        limit: Duration,
        wanted: impl Fn(&Value) -> bool,
    ) -> (Value, PathBuf) {
        let end = Instant::now() + limit;
        loop {
            let mut names: Vec<PathBuf> = std::fs::read_dir(&self.dump_dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.to_string_lossy()
                        .ends_with(&format!("-{trigger}.summary.json"))
                })
                .collect();
            names.sort();
            for p in names {
                let Some(mut v) = read_json(&p) else { continue };
                // The finding that triggered the dump, or another in its
                // window (findings of one moment share a dump): that one
                // becomes `finding`.
                let listed = v["findings"]["findings"].as_array().cloned();
                let found = std::iter::once(v["finding"].clone())
                    .chain(listed.into_iter().flatten())
                    .find(|f| wanted(f));
                if let Some(f) = found {
                    v["finding"] = f;
                    let trace = PathBuf::from(v["outcome"]["trace"].as_str().expect("trace"));
                    return (v, trace);
                }
            }
            assert!(
                Instant::now() < end,
                "no {trigger} dump in {}:\n{}",
                self.dump_dir.display(),
                self.stderr.rest(Duration::from_millis(100))
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn stop(mut self) {
        self.agent.signal(libc::SIGTERM);
        let status = self.agent.wait_timeout(Duration::from_secs(60));
        let log = self.stderr.rest(Duration::from_secs(2));
        assert!(
            status.is_some_and(|s| s.success()),
            "service ended {status:?}:\n{log}"
        );
    }
}

/// A 2-rank job nobody is told about; waits for its end (any outcome).
pub fn run_untold_job(dir: &Path, tag: &str, extra: &[&str]) -> Value {
    run_untold_job_shaped(
        dir,
        tag,
        &["--world-size", "2", "--dp", "2", "--tp", "1", "--pp", "1"],
        extra,
    )
}

/// [`run_untold_job`] with the job's layout (`--world-size`, `--tp`, ...)
/// given.
pub fn run_untold_job_shaped(dir: &Path, tag: &str, shape: &[&str], extra: &[&str]) -> Value {
    let job_dir = dir.join(tag);
    let mut launcher = untold_launcher(tag, extra, |c| {
        c.arg("--out-dir").arg(&job_dir).args(shape);
    });
    wait_ended(tag, std::slice::from_mut(&mut launcher));
    read_json(&job_dir.join("ground_truth.json")).expect("ground truth")
}

/// A simulated job's launcher (`tests/sim/launch.py`) as job `tag` with
/// `extra` options after what `options` adds, started in a process group
/// of its own.
fn untold_launcher(tag: &str, extra: &[&str], options: impl FnOnce(&mut Command)) -> GroupGuard {
    let mut cmd = Command::new("python3");
    cmd.arg(fixtures::repo_root().join("tests/sim/launch.py"))
        .arg("--build-dir")
        .arg(fixtures::build_all().join("sim"))
        .args(["--job-name", tag, "--quiet"])
        // Discovery (250 ms rounds) and probes before communicator set-up.
        .args(["--init-delay-ms", "1500"]);
    options(&mut cmd);
    GroupGuard(
        cmd.args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start the launcher"),
    )
}

/// Waits up to 90 s for every launcher of job `tag` to end.
fn wait_ended(tag: &str, launchers: &mut [GroupGuard]) {
    let end = Instant::now() + Duration::from_secs(90);
    for launcher in launchers {
        while launcher.0.try_wait().expect("try_wait").is_none() {
            assert!(Instant::now() < end, "job {tag} did not end");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// [`run_untold_job`] over `nnodes` launchers, one per simulated node
/// (`--nnodes`, each in a UTS namespace of its own named `node-K`, meeting
/// in a rendezvous directory), with the job's layout and faults in
/// `extra`; returns the job's ground truth (every node's ranks).
pub fn run_untold_job_on_nodes(dir: &Path, tag: &str, nnodes: usize, extra: &[&str]) -> Value {
    let rdv = dir.join(format!("{tag}-rdv"));
    let mut launchers: Vec<GroupGuard> = (0..nnodes)
        .map(|k| {
            untold_launcher(tag, extra, |c| {
                c.args(["--nnodes", &nnodes.to_string()])
                    .args(["--node-rank", &k.to_string()])
                    .args(["--node-name", &format!("node-{k}")])
                    .arg("--rdv-dir")
                    .arg(&rdv);
            })
        })
        .collect();
    wait_ended(tag, &mut launchers);
    read_json(&rdv.join("ground_truth.json")).expect("the job's ground truth")
}

impl Service {
    /// `agent ctl` on this service's socket; its JSON answer.
    pub fn ctl(&self, args: &[&str]) -> Value {
        ctl(&self.socket, args)
    }
}

/// Stops the service with SIGTERM and asserts it exits cleanly within
/// 30 s (its log so far in the failure).
pub fn stop_service(agent: &mut Proc, stderr: &mut Lines) {
    agent.signal(libc::SIGTERM);
    let stopped = agent.wait_timeout(Duration::from_secs(30));
    assert!(
        stopped.is_some_and(|s| s.success()),
        "the service did not stop cleanly on SIGTERM ({stopped:?}):\n{}",
        stderr.rest(Duration::from_secs(1))
    );
}

/// GET `path` from `127.0.0.1:port`; the answer must be 200.
pub fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read the answer");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}

/// GET `path` from `127.0.0.1:port`, if it answers.
pub fn try_http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    Some(text)
}

/// `agent ctl --socket SOCKET ARGS...`, its JSON answer.
pub fn ctl(socket: &Path, args: &[&str]) -> Value {
    let out = Command::new(agent_bin())
        .arg("ctl")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run agent ctl");
    assert!(
        out.status.success(),
        "agent ctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("agent ctl {args:?}: not JSON ({e}): {:?}", out.stdout))
}

/// Waits (up to `limit`) until `agent ctl processes` lists `pid`.
pub fn wait_traced(socket: &Path, pid: u32, limit: Duration) {
    let started = Instant::now();
    loop {
        let list = ctl(socket, &["processes"]);
        if list
            .as_array()
            .expect("a list")
            .iter()
            .any(|e| e["pid"].as_u64() == Some(pid as u64))
        {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "pid {pid} was not traced within {limit:?}: {list}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
