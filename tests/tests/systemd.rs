//! End-to-end: the agent as a systemd service, under a real systemd (the
//! Debian 12 one, 252) booted privately for the test.
//!
//! `cargo xtask install --root STAGE` stages the binary, the unit and the
//! default configuration; `tests/systemd/private-systemd.sh` boots systemd
//! as PID 1 of new pid, mount, cgroup, UTS, IPC and network namespaces with
//! STAGE overlaid on /etc and /usr/local and fresh tmpfs on /tmp, /run and
//! /var/{tmp,lib,log,cache} (the host's files are never written; see the
//! script's header), and only `xpuscope-test.target` (empty) started. Then:
//! `systemctl start` reaches `active` through the agent's READY=1, with the
//! unit's sandbox in force (capabilities, no_new_privs, seccomp, read-only
//! root), its watchdog pings arriving and `systemd-analyze security` rating
//! it 4.0 or better; a simulated job started afterwards is discovered (its ranks in
//! `agent ctl processes`); `agent ctl dump` writes a valid trace with every
//! rank's all-reduces and symbolized kernel frames; `kill -9` of the agent
//! has systemd restart it (new MainPID, NRestarts=1) and the new agent
//! traces a second job whose libraries it can only reach through
//! /proc/PID/map_files (they are under the test's /tmp, hidden from it by
//! PrivateTmp); `systemctl stop` leaves none of the agent's programs or
//! links (its uprobes are perf-event links) behind, by `bpftool`. The
//! namespaces are torn down (PID 1 killed, its cgroup removed) however the
//! test ends. Root and eBPF; never skipped.
//!
//! Differences from a real install, all in the test's drop-in: the unit
//! has no default dependencies (they would pull in sysinit.target, which
//! this systemd must not run) and logs to a file (no journald here).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use serde_json::Value;
use xpuscope_tests::agent::{TempDir, exclusive};
use xpuscope_tests::device::{GroupGuard, arg_text, start_gated_job, thread_of, wait_for_closers};
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

const STEPS: u64 = 5;
const UNIT: &str = "xpuscope-agent.service";
const SOCKET: &str = "/run/xpuscope/agent.sock";
const DUMP_DIR: &str = "/var/lib/xpuscope/dumps";

/// Runs `cmd` to completion within `limit` (killed and a panic past it).
fn run_bounded(cmd: &mut Command, limit: Duration, what: &str) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {what}: {e}"));
    let pid = child.id();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap_or_else(|e| panic!("{what}: {e}")),
        Err(_) => {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("{what} did not finish within {limit:?}");
        }
    }
}

/// A Debian package's program, installed if missing (`apt-get`,
/// idempotent).
fn require(program: &str, package: &str) {
    let found = Path::new(program).is_absolute() && Path::new(program).exists()
        || Command::new("sh")
            .args(["-c", &format!("command -v {program}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if found {
        return;
    }
    xpuscope_tests::packages::apt_install(&[package]);
}

/// Ids in the `key:` lines of a process's descriptors' fdinfo (`prog_id`
/// for programs and links, `link_id` for links): exactly what it holds,
/// whatever else runs on the machine.
fn held_ids(pid: u32, key: &str) -> BTreeSet<u64> {
    let mut ids = BTreeSet::new();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return ids;
    };
    for fd in fds.flatten() {
        let Ok(info) = std::fs::read_to_string(fd.path()) else {
            continue;
        };
        for line in info.lines() {
            if let Some(v) = line.strip_prefix(key).and_then(|r| r.strip_prefix(':')) {
                ids.extend(v.trim().parse::<u64>().ok());
            }
        }
    }
    ids
}

/// `bpftool -j {prog|link} show`: (id, prog_id or 0, type, name).
fn bpftool(what: &str) -> Vec<(u64, u64, String, String)> {
    let out = run_bounded(
        Command::new("bpftool").args(["-j", what, "show"]),
        Duration::from_secs(30),
        "bpftool",
    );
    assert!(out.status.success(), "bpftool {what} show: {out:?}");
    let list: Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    list.as_array()
        .expect("a list")
        .iter()
        .map(|e| {
            (
                e["id"].as_u64().expect("id"),
                e["prog_id"].as_u64().unwrap_or(0),
                e["type"].as_str().unwrap_or_default().to_string(),
                e["name"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// The `CapabilityBoundingSet=` of the shipped unit as a kernel bit mask.
fn unit_capabilities(unit: &str) -> u64 {
    const CAPS: &[(&str, u32)] = &[
        ("CAP_CHOWN", 0),
        ("CAP_DAC_READ_SEARCH", 2),
        ("CAP_SYS_PTRACE", 19),
        ("CAP_SYS_ADMIN", 21),
        ("CAP_SYS_RESOURCE", 24),
        ("CAP_SYSLOG", 34),
        ("CAP_PERFMON", 38),
        ("CAP_BPF", 39),
        ("CAP_CHECKPOINT_RESTORE", 40),
    ];
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit bounds its capabilities");
    line.split_whitespace()
        .map(|name| {
            let bit = CAPS
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("add {name} to this test's table"))
                .1;
            1u64 << bit
        })
        .fold(0, |a, b| a | b)
}

/// systemd booted privately (see the module docs), torn down on drop.
struct PrivateSystemd {
    /// `unshare`; its child is the namespaces' PID 1.
    launcher: Child,
    /// PID 1's pid on the host (0 until known).
    pid1: u32,
    cgroup: PathBuf,
    stage: PathBuf,
    /// Booted in a root of its own (systemctl is run in it).
    in_root: bool,
}

/// A fresh directory at the root of the cgroup2 hierarchy (on hybrid
/// hosts, `/sys/fs/cgroup/unified`), for the private systemd's cgroup
/// namespace.
fn fresh_cgroup() -> PathBuf {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let root = mountinfo
        .lines()
        .filter(|l| {
            l.split(" - ")
                .nth(1)
                .is_some_and(|t| t.starts_with("cgroup2 "))
        })
        .filter_map(|l| l.split_whitespace().nth(4))
        .min_by_key(|p| p.len())
        .map(PathBuf::from)
        .expect("a cgroup2 hierarchy is mounted (systemd needs one)");
    let dir = root.join(format!("xpuscope-systemd-test-{}", std::process::id()));
    remove_cgroup(&dir);
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// Removes a cgroup tree once its processes are gone (deepest first).
fn remove_cgroup(dir: &Path) {
    fn subdirs(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                subdirs(&e.path(), out);
                out.push(e.path());
            }
        }
    }
    let end = Instant::now() + Duration::from_secs(60);
    while dir.exists() && Instant::now() < end {
        let mut dirs = Vec::new();
        subdirs(dir, &mut dirs);
        dirs.push(dir.to_path_buf());
        for d in dirs {
            let _ = std::fs::remove_dir(d);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl PrivateSystemd {
    fn boot(stage: &Path) -> PrivateSystemd {
        PrivateSystemd::boot_in(stage, None)
    }

    /// Booted in `root` (the script's second argument) rather than over
    /// the host's own.
    fn boot_in(stage: &Path, root: Option<&Path>) -> PrivateSystemd {
        let cgroup = fresh_cgroup();
        let script = fixtures::repo_root().join("tests/systemd/private-systemd.sh");
        let log = std::fs::File::create(stage.with_extension("boot.log")).expect("boot log");
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(
                r#"echo $$ > "$1/cgroup.procs" && exec unshare --pid --mount --uts --ipc --net \
                   --cgroup --fork --kill-child --propagation private -- "$2" "$3" $4"#,
            )
            .arg("sh")
            .arg(&cgroup)
            .arg(&script)
            .arg(stage)
            .arg(root.map(|r| r.display().to_string()).unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // SAFETY: prctl only, between fork and exec. If the test process
        // dies, unshare gets SIGKILL and takes PID 1 (--kill-child) and
        // with it the whole namespace.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let launcher = cmd.spawn().expect("start unshare");
        let mut sd = PrivateSystemd {
            launcher,
            pid1: 0,
            cgroup,
            stage: stage.to_path_buf(),
            in_root: root.is_some(),
        };
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = sd.launcher.try_wait().expect("try_wait") {
                panic!("the private systemd exited ({status}):\n{}", sd.logs());
            }
            assert!(
                Instant::now() < end,
                "the private systemd did not come up within 60 s:\n{}",
                sd.logs()
            );
            if sd.pid1 == 0 {
                let launcher = sd.launcher.id();
                sd.pid1 =
                    std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
                        .ok()
                        .and_then(|c| c.split_whitespace().next()?.parse().ok())
                        .filter(|p| {
                            std::fs::read_to_string(format!("/proc/{p}/comm"))
                                .is_ok_and(|c| c.trim() == "systemd")
                        })
                        .unwrap_or(0);
            } else {
                let state = sd.systemctl_raw(&["is-system-running"]);
                let state = String::from_utf8_lossy(&state.stdout).trim().to_string();
                if state == "running" || state == "degraded" {
                    return sd;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// PID 1's console and the boot script's output.
    fn logs(&self) -> String {
        let read = |p: PathBuf| std::fs::read_to_string(&p).unwrap_or_default();
        format!(
            "boot: {}\nconsole: {}\nagent log: {}",
            read(self.stage.with_extension("boot.log")),
            read(self.stage.join("console")),
            read(self.path("/var/log/xpuscope-agent.log")),
        )
    }

    /// A path inside the namespaces, from the host.
    fn path(&self, inside: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{inside}", self.pid1))
    }

    fn systemctl_raw(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--target={}", self.pid1))
            .args(["--mount", "--pid"]);
        if self.in_root {
            // Its own systemctl, in its root.
            cmd.args(["--root", "--wd", "--"]);
        } else {
            cmd.arg("--");
        }
        run_bounded(
            cmd.arg("systemctl").args(args),
            Duration::from_secs(150),
            &format!("systemctl {}", args.join(" ")),
        )
    }

    /// `systemctl ARGS`, which must succeed.
    fn systemctl(&self, args: &[&str]) -> String {
        let out = self.systemctl_raw(args);
        assert!(
            out.status.success(),
            "systemctl {}: {}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `systemctl show -p ...` of the agent's unit.
    fn show(&self) -> BTreeMap<String, String> {
        self.systemctl(&[
            "show",
            "-p",
            "ActiveState,SubState,StatusText,MainPID,NRestarts,Result,WatchdogTimestampMonotonic",
            UNIT,
        ])
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// The host pid of the namespaces' `ns_pid` (by `NSpid` in the host's
    /// /proc).
    fn host_pid(&self, ns_pid: u32) -> u32 {
        let ns = std::fs::read_link(format!("/proc/{}/ns/pid", self.pid1)).expect("pid ns");
        std::fs::read_dir("/proc")
            .expect("/proc")
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .find(|pid| {
                std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|n| n == ns)
                    && std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                        s.lines()
                            .find_map(|l| l.strip_prefix("NSpid:"))
                            .and_then(|v| v.split_whitespace().last()?.parse::<u32>().ok())
                            == Some(ns_pid)
                    })
            })
            .unwrap_or_else(|| panic!("no host pid for pid {ns_pid} of the namespace"))
    }

    /// The agent's host pid, from the unit's MainPID.
    fn agent_pid(&self) -> u32 {
        let main: u32 = self.show()["MainPID"].parse().expect("MainPID");
        assert_ne!(main, 0, "the unit has no main process:\n{}", self.logs());
        self.host_pid(main)
    }
}

impl Drop for PrivateSystemd {
    fn drop(&mut self) {
        // Killing PID 1 kills everything in its pid namespace; unshare
        // follows. Both waited for, bounded.
        if self.pid1 != 0 {
            // SAFETY: kill(2) on the namespace's init, which this test started.
            unsafe { libc::kill(self.pid1 as i32, libc::SIGKILL) };
        }
        let _ = self.launcher.kill();
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end {
            if !matches!(self.launcher.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        remove_cgroup(&self.cgroup);
    }
}

/// `agent ctl --socket SOCKET ARGS` with the installed agent, as JSON.
fn ctl(agent: &Path, socket: &Path, args: &[&str]) -> Value {
    let out = run_bounded(
        Command::new(agent)
            .arg("ctl")
            .arg("--socket")
            .arg(socket)
            .args(args),
        Duration::from_secs(60),
        "agent ctl",
    );
    assert!(
        out.status.success(),
        "agent ctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("agent ctl {args:?}: not JSON ({e}): {:?}", out.stdout))
}

/// A gated 2-rank job; `ranks` rank -> host pid.
struct Job {
    launcher: GroupGuard,
    gate: PathBuf,
    job_dir: PathBuf,
    ranks: BTreeMap<u64, u32>,
}

impl Job {
    fn start(dir: &Path, name: &str, extra: &[&str]) -> Job {
        let job = start_gated_job(dir, name, name, STEPS, extra);
        Job {
            launcher: job.launcher,
            gate: job.gate,
            job_dir: job.job_dir,
            ranks: job
                .rank_pids
                .into_iter()
                .map(|(r, p)| (r, p as u32))
                .collect(),
        }
    }

    /// Polls `agent ctl processes` until every rank is listed, with its
    /// job; returns how long that took.
    fn wait_listed(&self, agent: &Path, socket: &Path, name: &str) -> Duration {
        let started = Instant::now();
        loop {
            let list = ctl(agent, socket, &["processes"]);
            let listed: BTreeMap<u64, String> = list
                .as_array()
                .expect("a list")
                .iter()
                .filter_map(|e| Some((e["pid"].as_u64()?, e["job"].as_str()?.to_string())))
                .collect();
            if self
                .ranks
                .values()
                .all(|p| listed.get(&(*p as u64)).is_some_and(|j| j == name))
            {
                return started.elapsed();
            }
            // A liveness bound, not a timing assertion: uprobe attaches
            // queue on a kernel-wide mutex behind other agents' link
            // closes (seconds on a shared machine). The time is printed.
            if started.elapsed() >= Duration::from_secs(30) {
                // Where each rank is: a rank stuck in the kernel shows its
                // state and kernel stack; one running shows what it runs.
                let states: Vec<String> = self
                    .ranks
                    .values()
                    .map(|p| {
                        let read = |f: &str| {
                            std::fs::read_to_string(format!("/proc/{p}/{f}")).unwrap_or_default()
                        };
                        format!(
                            "pid {p}: comm {} wchan {} stat {}\n{}",
                            read("comm").trim(),
                            read("wchan"),
                            read("stat").trim(),
                            read("stack")
                        )
                    })
                    .collect();
                panic!(
                    "{name}: ranks {:?} not all listed within 30 s: {list}\n{}",
                    self.ranks,
                    states.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Opens the gate and waits for the job to finish.
    fn run(mut self) -> BTreeMap<u64, u32> {
        std::fs::write(&self.gate, b"").expect("open the gate");
        let end = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.launcher.0.try_wait().expect("try_wait") {
                break s;
            }
            assert!(Instant::now() < end, "the job did not finish");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            status.success(),
            "the job failed: {status} (logs in {})",
            self.job_dir.display()
        );
        self.ranks.clone()
    }
}

/// `agent ctl dump`: the trace, read through the namespaces' root, decoded
/// and checked; every rank has its STEPS all-reduces.
fn dump_with_every_rank(sd: &PrivateSystemd, agent: &Path, ranks: &BTreeMap<u64, u32>) -> Timeline {
    let socket = sd.path(SOCKET);
    // The window ends at the request: the job's last calls, still in the
    // rings or the pipeline when it came, are waited for and in the dump.
    let out = ctl(agent, &socket, &["dump", "--seconds", "30"]);
    let inside = out["trace"].as_str().unwrap_or_else(|| panic!("{out}"));
    assert_eq!(
        Path::new(inside).parent(),
        Some(Path::new(DUMP_DIR)),
        "the dump is in the StateDirectory: {out}"
    );
    let bytes = std::fs::read(sd.path(inside)).expect("the dump exists");
    let trace = decode(&bytes).expect("the dump decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    for (&rank, &pid) in ranks {
        let reduces: Vec<_> = tl
            .slices
            .iter()
            .filter(|s| s.name.starts_with("ncclAllReduce"))
            .filter(|s| thread_of(&tl, s).is_some_and(|(p, _)| p == pid as i32))
            .collect();
        assert_eq!(
            reduces.len() as u64,
            STEPS,
            "rank {rank} (pid {pid}): its all-reduces in {inside}; NCCL calls there: {:?}\n{}",
            tl.slices
                .iter()
                .filter(|s| s.name.starts_with("nccl"))
                .map(|s| (s.name.as_str(), thread_of(&tl, s)))
                .collect::<Vec<_>>(),
            sd.logs()
        );
        for s in reduces {
            assert_eq!(arg_text(s, "return"), "0", "{s:?}");
        }
    }
    tl
}

/// Copies the simulated job's binaries and stand-in libraries (the layout
/// its RUNPATH expects) under `dir`; returns the `--build-dir` to use.
fn copy_job_build(dir: &Path) -> PathBuf {
    let built = fixtures::build_all();
    for (from, to) in [("sim/bin", "sim/bin"), ("standins/lib", "standins/lib")] {
        let (from, to) = (built.join(from), dir.join(to));
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&from).unwrap().flatten() {
            let target = to.join(e.file_name());
            if e.file_type().unwrap().is_symlink() {
                std::os::unix::fs::symlink(std::fs::read_link(e.path()).unwrap(), &target).unwrap();
            } else {
                std::fs::copy(e.path(), &target).unwrap();
            }
        }
    }
    dir.join("sim")
}

#[test]
fn the_unit_runs_the_agent_under_a_private_systemd() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    require("unshare", "util-linux");
    require("nsenter", "util-linux");
    require("/lib/systemd/systemd", "systemd");
    require("bpftool", "bpftool");
    let dir = TempDir::new("systemd");
    let stage = dir.path().join("stage");
    let repo = fixtures::repo_root();

    // Installed as a package would be: binary, unit, default config (the
    // binary the other tests run, not a build of its own).
    let out = run_bounded(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["xtask", "install", "--root"])
            .arg(&stage)
            .arg("--binary")
            .arg(xpuscope_tests::agent::agent_bin())
            .current_dir(&repo),
        Duration::from_secs(600),
        "cargo xtask install --root",
    );
    assert!(
        out.status.success(),
        "cargo xtask install --root: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let shipped_unit =
        std::fs::read_to_string(repo.join("deploy/systemd/xpuscope-agent.service")).unwrap();
    let unit_path = stage.join("etc/systemd/system").join(UNIT);
    assert_eq!(std::fs::read_to_string(&unit_path).unwrap(), shipped_unit);
    assert_eq!(
        std::fs::read(stage.join("etc/xpuscope/agent.toml")).unwrap(),
        std::fs::read(repo.join("deploy/agent.toml")).unwrap()
    );
    let agent = stage.join("usr/local/bin/agent");
    let mode = std::fs::metadata(&agent)
        .expect("installed binary")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
    // Test-only: the target this systemd starts (nothing), and the drop-in
    // the module docs describe.
    std::fs::write(
        stage.join("etc/systemd/system/xpuscope-test.target"),
        "[Unit]\nDescription=xpuscope test: this systemd and nothing else\nDefaultDependencies=no\n",
    )
    .unwrap();
    let drop_in = stage.join("etc/systemd/system").join(format!("{UNIT}.d"));
    std::fs::create_dir_all(&drop_in).unwrap();
    std::fs::write(
        drop_in.join("test.conf"),
        "[Unit]\nDefaultDependencies=no\n[Service]\n\
         StandardOutput=append:/var/log/xpuscope-agent.log\n\
         StandardError=append:/var/log/xpuscope-agent.log\n",
    )
    .unwrap();

    let sd = PrivateSystemd::boot(&stage);
    let socket = sd.path(SOCKET);

    // Started: `systemctl start` returns once the agent said READY=1.
    sd.systemctl(&["start", UNIT]);
    let show = sd.show();
    eprintln!("after start: {show:?}");
    assert_eq!(show["ActiveState"], "active", "{show:?}\n{}", sd.logs());
    assert_eq!(show["SubState"], "running", "{show:?}");
    assert!(
        show["StatusText"].starts_with("level 1, "),
        "the agent's STATUS=: {show:?}"
    );
    assert_eq!(show["NRestarts"], "0", "{show:?}");
    // WATCHDOG=1 pings arrive (each moves systemd's watchdog timestamp).
    let pinged = show["WatchdogTimestampMonotonic"].clone();
    let end = Instant::now() + Duration::from_secs(10);
    while sd.show()["WatchdogTimestampMonotonic"] == pinged {
        assert!(
            Instant::now() < end,
            "no watchdog ping within 10 s: {show:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let first = sd.agent_pid();
    // The unit's sandbox is in force, not only written down.
    let status = std::fs::read_to_string(format!("/proc/{first}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    let bounding = u64::from_str_radix(&field("CapBnd:"), 16).unwrap();
    let effective = u64::from_str_radix(&field("CapEff:"), 16).unwrap();
    let wanted = unit_capabilities(&shipped_unit);
    let host = u64::from_str_radix(
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("CapBnd:"))
            .unwrap()
            .trim(),
        16,
    )
    .unwrap();
    assert_eq!(bounding, wanted & host, "CapBnd vs the unit's {wanted:x}");
    assert_eq!(effective, bounding, "root keeps what the bound allows");
    assert_eq!(field("NoNewPrivs:"), "1");
    assert_eq!(field("Seccomp:"), "2", "SystemCallFilter applies");
    let mounts = std::fs::read_to_string(format!("/proc/{first}/mountinfo")).unwrap();
    let mount_opts = |at: &str| {
        mounts
            .lines()
            .rfind(|l| l.split_whitespace().nth(4) == Some(at))
            .and_then(|l| l.split_whitespace().nth(5))
            .map(String::from)
            .unwrap_or_else(|| panic!("nothing mounted at {at}:\n{mounts}"))
    };
    assert!(mount_opts("/").starts_with("ro"), "ProtectSystem=strict");
    assert!(mount_opts("/sys").starts_with("ro"), "/sys read-only");
    assert!(
        mount_opts("/var/lib/xpuscope").starts_with("rw"),
        "StateDirectory"
    );
    assert!(mount_opts("/tmp").starts_with("rw"), "PrivateTmp");
    assert_eq!(ctl(&agent, &socket, &["status"])["level"], 1);
    // systemd's own rating of the sandbox (docs/src/guide/service.md quotes it): kept at
    // "OK" or better.
    let out = run_bounded(
        Command::new("nsenter")
            .arg(format!("--target={}", sd.pid1))
            .args([
                "--mount",
                "--pid",
                "--",
                "systemd-analyze",
                "security",
                "--no-pager",
                UNIT,
            ]),
        Duration::from_secs(60),
        "systemd-analyze security",
    );
    let rating = String::from_utf8_lossy(&out.stdout);
    let overall = rating
        .lines()
        .find_map(|l| l.strip_prefix("→ Overall exposure level for xpuscope-agent.service: "))
        .unwrap_or_else(|| panic!("systemd-analyze security: {rating}"));
    eprintln!("systemd-analyze security: {overall}");
    let exposure: f64 = overall.split_whitespace().next().unwrap().parse().unwrap();
    assert!(
        exposure <= 4.0,
        "the unit's exposure grew: {overall}\n{rating}"
    );
    let socket_mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(socket_mode & 0o777, 0o600, "the control socket is root's");

    // A job started afterwards is found by itself.
    let job = Job::start(dir.path(), "sdjob", &[]);
    let took = job.wait_listed(&agent, &socket, "sdjob");
    eprintln!("sdjob: ranks listed {took:?} after they mapped the libraries");
    let ranks = job.run();
    let tl = dump_with_every_rank(&sd, &agent, &ranks);
    // Kernel frames of the ranks' off-CPU stacks are symbolized
    // (/proc/kallsyms readable, CAP_SYSLOG).
    let kernel_frames: BTreeSet<&str> = tl
        .stack_samples
        .iter()
        .filter(|s| ranks.values().any(|&p| p as i32 == s.pid))
        .flat_map(|s| s.frames.iter().zip(&s.mappings))
        .filter(|(_, m)| m.as_str() == "kernel")
        .map(|(f, _)| f.as_str())
        .collect();
    assert!(
        kernel_frames.iter().any(|f| f.contains("schedule")),
        "the ranks' off-CPU stacks have named kernel frames: {kernel_frames:?}"
    );
    let first_progs = held_ids(first, "prog_id");
    assert!(!first_progs.is_empty(), "the agent holds its programs");

    // kill -9: systemd restarts it, and it traces again.
    // SAFETY: kill(2) on the agent this test's systemd started.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    let mut show = sd.show();
    let end = Instant::now() + Duration::from_secs(90);
    while !(show["NRestarts"] == "1" && show["ActiveState"] == "active") {
        assert!(
            Instant::now() < end,
            "not restarted after kill -9: {show:?}\n{}",
            sd.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
        show = sd.show();
    }
    eprintln!("after kill -9: {show:?}");
    let second = sd.agent_pid();
    assert_ne!(second, first, "a new MainPID");
    let live: BTreeSet<u64> = bpftool("prog").into_iter().map(|p| p.0).collect();
    let second_progs = held_ids(second, "prog_id");
    assert!(
        first_progs.intersection(&second_progs).next().is_none(),
        "the new agent loaded its own programs"
    );
    assert!(
        first_progs.is_disjoint(&live),
        "the killed agent's programs are gone: {:?}",
        first_progs.intersection(&live).collect::<Vec<_>>()
    );
    // Its libraries under this test's /tmp, which the agent's PrivateTmp
    // hides: found and probed through /proc/PID/map_files.
    let build = copy_job_build(&dir.path().join("copied"));
    let build = build.to_str().unwrap().to_string();
    let job = Job::start(dir.path(), "sdjob2", &["--build-dir", &build]);
    let took = job.wait_listed(&agent, &socket, "sdjob2");
    eprintln!("sdjob2: ranks listed {took:?} after they mapped the libraries");
    let ranks = job.run();
    dump_with_every_rank(&sd, &agent, &ranks);

    // Stopped: none of its programs or links (the uprobes are perf-event
    // links) is left.
    let progs = held_ids(second, "prog_id");
    let links = held_ids(second, "link_id");
    let names: BTreeSet<String> = bpftool("prog")
        .into_iter()
        .filter(|p| progs.contains(&p.0))
        .map(|p| p.3)
        .collect();
    assert!(
        names.contains("sched_switch") && names.iter().any(|n| n.starts_with("device_call_")),
        "the running agent's programs: {names:?}"
    );
    // The dynamic loader's hook is a perf-event uprobe; the device probes
    // are uprobe-multi links (6.6 and later) or perf events too.
    let uprobes = bpftool("link")
        .into_iter()
        .filter(|l| links.contains(&l.0) && matches!(l.2.as_str(), "perf_event" | "uprobe_multi"))
        .count();
    assert!(uprobes > 0, "the agent's uprobe links while running");
    sd.systemctl(&["stop", UNIT]);
    let show = sd.show();
    assert_eq!(show["ActiveState"], "inactive", "{show:?}");
    let end = Instant::now() + Duration::from_secs(30);
    let left = loop {
        let live_progs: BTreeSet<u64> = bpftool("prog").into_iter().map(|p| p.0).collect();
        let live_links: BTreeSet<u64> = bpftool("link").into_iter().map(|l| l.0).collect();
        let left: (BTreeSet<u64>, BTreeSet<u64>) = (
            progs.intersection(&live_progs).copied().collect(),
            links.intersection(&live_links).copied().collect(),
        );
        if (left.0.is_empty() && left.1.is_empty()) || Instant::now() > end {
            break left;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        left.0.is_empty() && left.1.is_empty(),
        "left behind after stop: programs {:?}, links {:?} (of {} and {uprobes} uprobes)\n{}",
        left.0,
        left.1,
        progs.len(),
        sd.logs()
    );
    // Nothing of the unit runs any more (its closer child included): a
    // closer that just released the links may still be leaving the cgroup.
    let cgroup_procs = sd.path("/sys/fs/cgroup/system.slice/xpuscope-agent.service/cgroup.procs");
    let end = Instant::now() + Duration::from_secs(10);
    let procs = loop {
        let procs = std::fs::read_to_string(&cgroup_procs).unwrap_or_default();
        if procs.trim().is_empty() || Instant::now() > end {
            break procs;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(procs.trim().is_empty(), "processes left: {procs}");
    drop(sd);

    // `--uninstall` takes back what install placed, and only that: the
    // unedited config goes, the drop-in (the user's) stays.
    let out = run_bounded(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["xtask", "install", "--uninstall", "--root"])
            .arg(&stage)
            .current_dir(&repo),
        Duration::from_secs(300),
        "cargo xtask install --uninstall --root",
    );
    assert!(out.status.success(), "{out:?}");
    assert!(!agent.exists() && !unit_path.exists());
    assert!(
        !stage.join("etc/xpuscope").exists(),
        "the unedited config and its directory"
    );
    assert!(
        drop_in.join("test.conf").exists(),
        "drop-ins are the user's"
    );
}

/// The Debian package on a Debian 12 machine with no toolchain (the
/// cached debootstrap root, overlaid), booted under its own systemd: dpkg
/// installs it, `systemctl start` of the packaged unit reaches `active`
/// through the agent's READY=1, and the agent finds a simulated job on
/// its own and dumps every rank's all-reduces.
#[test]
fn the_package_s_unit_runs_on_debian_12_under_its_own_systemd() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    require("unshare", "util-linux");
    require("nsenter", "util-linux");
    let root = xpuscope_tests::roots::bookworm();
    let dir = TempDir::new("systemd-package");
    let stage = dir.path().join("stage");
    let deb = xpuscope_tests::packages::xpuscope_deb();
    // What the machine gets before it boots: the package to install, and
    // the test's target and drop-in (as the other systemd test's).
    let upper = stage.join("root-upper");
    std::fs::create_dir_all(upper.join("xpuscope-pkg")).unwrap();
    std::fs::copy(
        deb,
        upper.join("xpuscope-pkg").join(deb.file_name().unwrap()),
    )
    .unwrap();
    let units = upper.join("etc/systemd/system");
    std::fs::create_dir_all(units.join(format!("{UNIT}.d"))).unwrap();
    std::fs::write(
        units.join("xpuscope-test.target"),
        "[Unit]\nDescription=xpuscope test: this systemd and nothing else\nDefaultDependencies=no\n",
    )
    .unwrap();
    // The agent sees the host's /proc, as under the host's systemd (see
    // the boot script).
    std::fs::write(
        units.join(format!("{UNIT}.d/test.conf")),
        "[Unit]\nDefaultDependencies=no\n[Service]\n\
         StandardOutput=append:/var/log/xpuscope-agent.log\n\
         StandardError=append:/var/log/xpuscope-agent.log\n\
         BindPaths=/run/host-proc:/proc\n",
    )
    .unwrap();

    let sd = PrivateSystemd::boot_in(&stage, Some(root));
    // The machine has no toolchain; the package put the agent in /usr/bin
    // and the unit in /lib/systemd/system.
    for absent in ["usr/bin/cargo", "usr/bin/rustc", "usr/bin/gdb"] {
        assert!(!sd.path(&format!("/{absent}")).exists(), "{absent}");
    }
    let agent = sd.path("/usr/bin/agent");
    assert!(agent.exists(), "{}", sd.logs());
    assert!(
        sd.systemctl(&["cat", UNIT])
            .contains("# /lib/systemd/system/xpuscope-agent.service")
    );
    sd.systemctl(&["start", UNIT]);
    let show = sd.show();
    assert_eq!(show["ActiveState"], "active", "{show:?}\n{}", sd.logs());
    assert_eq!(show["SubState"], "running", "{show:?}");
    assert!(
        show["StatusText"].starts_with("level 1, "),
        "the agent's STATUS=: {show:?}"
    );
    let socket = sd.path(SOCKET);
    let status = ctl(&agent, &socket, &["status"]);
    assert_eq!(status["level"], 1, "{status}");

    // (Its files are the host's: the agent reads them as the ranks' own,
    // through /proc/PID/map_files.)
    let job = Job::start(dir.path(), "pkgjob", &[]);
    let took = job.wait_listed(&agent, &socket, "pkgjob");
    eprintln!("ranks listed {took:?} after they were ready");
    let ranks = job.run();
    dump_with_every_rank(&sd, &agent, &ranks);
    sd.systemctl(&["stop", UNIT]);
    let show = sd.show();
    let status = sd.systemctl_raw(&["status", "--no-pager", UNIT]);
    assert_eq!(
        show["ActiveState"],
        "inactive",
        "{show:?}\n{}\n{}",
        String::from_utf8_lossy(&status.stdout),
        sd.logs()
    );
}
