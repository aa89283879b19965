//! `cargo xtask bench soak [--minutes N]`: `agent service` always on.
//!
//! 1. Soak: one `agent service` (default level and flight recorder; metrics
//!    on loopback, scraped every 15 s as Prometheus would; control socket
//!    and dump dir in a temporary directory) runs for N minutes (default
//!    30) while the 8-rank simulated job (`tests/sim/launch.py`) is
//!    started back to back, each job about a minute long, so discovery
//!    also sees processes come and go. Every 2 s the agent's CPU (% of one
//!    core, from `/proc/PID/stat`) and RSS (`/proc/PID/statm`) and the
//!    recorder's size (`agent ctl status`) are sampled into
//!    `target/bench/soak-samples.csv`. The recorder is full once its window
//!    starts expiring records (or the memory bound evicts): RSS from then
//!    on must stay flat, below `flight_recorder.max_bytes` + 150 MB.
//! 2. Step-time overhead: rounds of the same 8-rank job alternate between
//!    untraced (no service running, its probes released) and traced (a
//!    service started for the round, the job's ranks discovered before the
//!    job's start gate opens), untraced first and last. Each round's figure
//!    is the median step time (`dur_ns` of every rank's step log, the first
//!    steps left out); each traced round counts against the mean of the
//!    untraced rounds around it (`measure::paired_overhead`). Between the
//!    same untraced rounds a floor round runs the job with counting-only
//!    programs where the service attaches its own (`bench_floor`): what
//!    any eBPF tracer of these events costs the ranks on this machine.
//! 3. The same rounds again with the agent on a CPU of its own (CPU 0) and
//!    the job's ranks on the others, traced and untraced alike: a node
//!    where the training does not use every core. What is left is what the
//!    probes cost the ranks themselves (the kernel programs run in their
//!    context), not the agent's CPU taken from them. Not run on one CPU.
//!
//! Results: `target/bench/soak-results.json`.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench_floor::{Floor, default_level_points};
use crate::build;
use crate::measure::{median, overhead_summary, paired_overhead, wait_for_closers};
use crate::root;

/// The simulated job's size (its default layout: tp 2, pp 2, dp 2).
const WORLD: u32 = 8;
/// Wall time of each soak job.
const SOAK_JOB_SECONDS: f64 = 60.0;
/// Traced rounds of the overhead phase (one more untraced round).
const OVERHEAD_PAIRS: usize = 4;
/// Wall time of each overhead round's training steps.
const ROUND_SECONDS: f64 = 20.0;
/// Steps left out of each round's median (start-up, discovery).
const WARMUP_STEPS: u64 = 3;
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
const SCRAPE_EVERY: Duration = Duration::from_secs(15);
/// The goal: RSS at most the recorder's bound plus this.
const RSS_HEADROOM: u64 = 150_000_000;
/// The default `flight_recorder.max_bytes` (deploy/agent.toml).
const RECORDER_MAX_BYTES: u64 = 256 << 20;

/// Where the overhead rounds run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Placement {
    /// The ranks and the agent share every CPU (as in the soak).
    Shared,
    /// The agent alone on CPU 0, the ranks on the other CPUs.
    AgentOwnCpu,
}

impl Placement {
    /// The CPUs the job's ranks are pinned to (`launch.py --cpus`).
    fn job_cpus(self) -> Option<String> {
        match self {
            Placement::Shared => None,
            Placement::AgentOwnCpu => Some(
                (1..host_cpus())
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            ),
        }
    }

    /// The CPU the agent is held to.
    fn agent_cpu(self) -> Option<usize> {
        (self == Placement::AgentOwnCpu).then_some(0)
    }

    fn tag(self) -> &'static str {
        match self {
            Placement::Shared => "shared",
            Placement::AgentOwnCpu => "own-cpu",
        }
    }
}

fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Holds the process about to exec to `cpu` (with its threads to come).
fn pin_to(cmd: &mut Command, cpu: usize) {
    // SAFETY: only sched_setaffinity, async-signal-safe, between fork and
    // exec.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A temporary directory, removed on drop.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new() -> Result<Scratch> {
        let p = std::env::temp_dir().join(format!("xpuscope-soak-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        Ok(Scratch(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `agent service`, stopped with SIGTERM on drop.
pub(crate) struct Service {
    child: Option<Child>,
    /// The agent binary it runs (and `agent ctl` with it).
    agent: PathBuf,
    socket: PathBuf,
    port: u16,
    log: PathBuf,
}

impl Service {
    /// Starts the service with a configuration of defaults except where
    /// files and endpoints go (all under `dir`), and waits until its
    /// control API answers.
    fn start(dir: &Path, tag: &str, cpu: Option<usize>) -> Result<Service> {
        Self::start_binary(&build::agent_binary(), dir, tag, cpu)
    }

    /// [`Service::start`] with the agent binary `agent`.
    pub(crate) fn start_binary(
        agent: &Path,
        dir: &Path,
        tag: &str,
        cpu: Option<usize>,
    ) -> Result<Service> {
        wait_for_closers()?;
        let dir = dir.join(tag);
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("run/agent.sock");
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "dump_dir = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n\
                 [control]\nsocket = \"{}\"\n",
                dir.join("dumps").display(),
                socket.display()
            ),
        )?;
        let log = dir.join("agent.log");
        let mut cmd = Command::new(agent);
        if let Some(cpu) = cpu {
            pin_to(&mut cmd, cpu);
        }
        let child = cmd
            .arg("service")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting agent service")?;
        let mut svc = Service {
            child: Some(child),
            agent: agent.to_path_buf(),
            socket,
            port,
            log,
        };
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = svc.child.as_mut().context("child")?.try_wait()? {
                bail!(
                    "agent service exited ({status}): {}",
                    std::fs::read_to_string(&svc.log).unwrap_or_default()
                );
            }
            if svc.socket.exists() && svc.status().is_ok() {
                return Ok(svc);
            }
            if Instant::now() > end {
                bail!("agent service did not answer on {}", svc.socket.display());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    pub(crate) fn ctl(&self, args: &[&str]) -> Result<Value> {
        let out = Command::new(&self.agent)
            .arg("ctl")
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            bail!(
                "agent ctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    fn status(&self) -> Result<Value> {
        self.ctl(&["status"])
    }

    /// One scrape of `/metrics`; its size in bytes.
    fn scrape(&self) -> Result<usize> {
        Ok(self.metrics()?.len())
    }

    /// One scrape of `/metrics`: the response, headers and all.
    pub(crate) fn metrics(&self) -> Result<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = Vec::new();
        s.read_to_end(&mut text)?;
        if !text.starts_with(b"HTTP/1.1 200") {
            bail!("/metrics: {}", String::from_utf8_lossy(&text));
        }
        Ok(String::from_utf8_lossy(&text).into_owned())
    }

    /// SIGTERM, then waits for it and for its probes to be released.
    pub(crate) fn stop(mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait()?;
        if !status.success() {
            bail!(
                "agent service failed ({status}): {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        wait_for_closers()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A simulated job (its own process group, killed on drop).
pub(crate) struct Job {
    child: Option<Child>,
    dir: PathBuf,
    /// CPU seconds (user + system) of the launcher and its ranks, once
    /// the job finished: the kernel programs and uprobe traps run in the
    /// ranks' context, so this holds what tracing costs them, with far
    /// less noise than their step times on a shared VM.
    cpu_seconds: Option<f64>,
}

impl Job {
    pub(crate) fn start(
        dir: &Path,
        name: &str,
        steps: u64,
        gate: Option<&Path>,
        cpus: Option<&str>,
    ) -> Result<Job> {
        let job_dir = dir.join(name);
        let timeout = (steps as f64 * 2.0).max(120.0) + 3.0 * SOAK_JOB_SECONDS;
        let mut cmd = Command::new("python3");
        cmd.arg(root().join("tests/sim/launch.py"))
            .arg("--out-dir")
            .arg(&job_dir)
            .arg("--build-dir")
            .arg(root().join("target/fixtures/sim"))
            .args(["--job-name", name, "--quiet"])
            .args(["--world-size", &WORLD.to_string()])
            .args(["--steps", &steps.to_string()])
            .args(["--timeout", &format!("{timeout:.0}")]);
        if let Some(g) = gate {
            cmd.arg("--start-gate").arg(g);
        }
        if let Some(c) = cpus {
            cmd.args(["--cpus", c]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting tests/sim/launch.py")?;
        Ok(Job {
            child: Some(child),
            dir: job_dir,
            cpu_seconds: None,
        })
    }

    /// Whether it finished; fails if it failed.
    /// Whether it finished; fails if it failed. Reaps the launcher with
    /// `wait4` for its resource usage, which includes its ranks' (the
    /// children it waited for): [`Job::cpu_seconds`].
    pub(crate) fn finished(&mut self) -> Result<bool> {
        let Some(c) = self.child.as_ref() else {
            return Ok(true);
        };
        let mut status = 0;
        // SAFETY: rusage is plain integers, valid all zero.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: wait4 on our own child, with valid out-pointers.
        let pid = unsafe { libc::wait4(c.id() as i32, &mut status, libc::WNOHANG, &mut usage) };
        match pid {
            0 => Ok(false),
            p if p < 0 => Err(std::io::Error::last_os_error()).context("waiting for the job"),
            _ => {
                // Reaped here: the Child must not be waited for or killed.
                self.child = None;
                let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
                self.cpu_seconds = Some(secs(usage.ru_utime) + secs(usage.ru_stime));
                if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
                    Ok(true)
                } else {
                    bail!(
                        "the simulated job failed (wait status {status:#x}); logs in {}",
                        self.dir.display()
                    )
                }
            }
        }
    }

    fn wait(&mut self, limit: Duration) -> Result<()> {
        let end = Instant::now() + limit;
        while !self.finished()? {
            if Instant::now() > end {
                bail!("the simulated job did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Waits until every rank is ready at the start gate.
    fn wait_ready(&mut self) -> Result<()> {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = (0..WORLD).all(|r| {
                std::fs::read_to_string(self.dir.join(format!("rank{r}.steps.jsonl")))
                    .is_ok_and(|t| t.contains("\"ready\""))
            });
            if ready {
                return Ok(());
            }
            if self.finished()? || Instant::now() > end {
                bail!("the job's ranks were not ready ({})", self.dir.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The ranks' pids, from the launcher's ground truth.
    fn rank_pids(&self) -> Result<Vec<u64>> {
        let gt: Value =
            serde_json::from_slice(&std::fs::read(self.dir.join("ground_truth.json"))?)?;
        Ok(gt["ranks"]
            .as_array()
            .context("ranks")?
            .iter()
            .filter_map(|r| r["pid"].as_u64())
            .collect())
    }

    /// Step durations (ns) of every rank, steps from `from` on.
    fn step_durations(&self, from: u64) -> Result<Vec<f64>> {
        let mut out = Vec::new();
        for r in 0..WORLD {
            let path = self.dir.join(format!("rank{r}.steps.jsonl"));
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            for l in text.lines() {
                let Ok(v) = serde_json::from_str::<Value>(l) else {
                    continue;
                };
                if v["event"] == "step" && v["step"].as_u64().is_some_and(|s| s >= from) {
                    out.push(v["dur_ns"].as_f64().context("dur_ns")?);
                }
            }
        }
        if out.is_empty() {
            bail!("no steps logged in {}", self.dir.display());
        }
        Ok(out)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child's process group.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }
}

/// CPU seconds (user + system) and resident bytes of a process.
fn cpu_and_rss(pid: u32) -> Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the comm (which may hold spaces) follow the last `)`:
    // utime and stime are fields 14 and 15 (proc(5)).
    let rest: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc/PID/stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = rest[11].parse::<u64>()? + rest[12].parse::<u64>()?;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm"))?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .context("/proc/PID/statm")?
        .parse()?;
    // SAFETY: sysconf has no preconditions.
    let (hz, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK) as f64,
            libc::sysconf(libc::_SC_PAGESIZE) as u64,
        )
    };
    Ok((ticks as f64 / hz, pages * page))
}

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn load_1min() -> f64 {
    load_average()
        .split(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One sample of the soak.
struct Sample {
    t: f64,
    cpu_percent: f64,
    rss: u64,
    recorder_bytes: u64,
    recorder_records: u64,
    expired: u64,
    evicted: u64,
    processes: u64,
    load1: f64,
    /// The service's own account (status `memory.resident`): anonymous
    /// memory, file-backed, and of that the ring buffers' double mapping.
    anon: u64,
    file: u64,
    rings: u64,
    /// The allocator's live allocations (status `memory.allocator`): flat
    /// while the resident size moves means no leak.
    allocated: u64,
}

/// Steps per job so that it trains about `seconds`, from a short job.
fn calibrate(dir: &Path, placement: Placement) -> Result<f64> {
    let mut job = Job::start(
        dir,
        &format!("calibrate-{}", placement.tag()),
        20,
        None,
        placement.job_cpus().as_deref(),
    )?;
    job.wait(Duration::from_secs(300))?;
    Ok(median(job.step_durations(WARMUP_STEPS)?) / 1e9)
}

fn soak(dir: &Path, out: &Path, minutes: u64, step_s: f64) -> Result<Value> {
    let svc = Service::start(dir, "soak", None)?;
    let pid = svc.pid();
    let steps = ((SOAK_JOB_SECONDS / step_s) as u64).max(10);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(minutes * 60);
    let (mut last_cpu, _) = cpu_and_rss(pid)?;
    let mut last_t = 0.0;
    let mut samples: Vec<Sample> = Vec::new();
    let mut csv = String::from(
        "seconds,cpu_percent,rss_bytes,recorder_bytes,recorder_records,expired_records,\
         evicted_records,processes,load1,anon_bytes,file_bytes,ring_mapped_bytes,\
         heap_allocated_bytes\n",
    );
    let mut jobs = 0u64;
    let mut traced_steps: Vec<f64> = Vec::new();
    let mut job: Option<Job> = None;
    let mut next_sample = started + SAMPLE_EVERY;
    let mut next_scrape = started + SCRAPE_EVERY;
    let mut scrapes = 0u64;
    let mut dumps_auto = 0u64;
    while Instant::now() < deadline {
        if let Some(j) = job.as_mut()
            && j.finished()?
        {
            traced_steps.extend(j.step_durations(WARMUP_STEPS)?);
            let _ = std::fs::remove_dir_all(&j.dir);
            job = None;
        }
        if job.is_none() {
            job = Some(Job::start(dir, &format!("soak-{jobs}"), steps, None, None)?);
            jobs += 1;
        }
        let now = Instant::now();
        if now >= next_scrape {
            svc.scrape()?;
            scrapes += 1;
            next_scrape += SCRAPE_EVERY;
        }
        if now >= next_sample {
            next_sample += SAMPLE_EVERY;
            let t = started.elapsed().as_secs_f64();
            let (cpu, rss) = cpu_and_rss(pid)?;
            let st = svc.status()?;
            let fr = &st["flight_recorder"];
            let s = Sample {
                t,
                cpu_percent: (cpu - last_cpu) / (t - last_t) * 100.0,
                rss,
                recorder_bytes: fr["bytes"].as_u64().unwrap_or(0),
                recorder_records: fr["records"].as_u64().unwrap_or(0),
                expired: fr["expired_records"].as_u64().unwrap_or(0),
                evicted: fr["evicted_records"].as_u64().unwrap_or(0),
                processes: st["processes"].as_u64().unwrap_or(0),
                load1: load_1min(),
                anon: st["memory"]["resident"]["anon_bytes"].as_u64().unwrap_or(0),
                file: st["memory"]["resident"]["file_bytes"].as_u64().unwrap_or(0),
                rings: st["memory"]["resident"]["ring_mapped_bytes"]
                    .as_u64()
                    .unwrap_or(0),
                allocated: st["memory"]["allocator"]["allocated_bytes"]
                    .as_u64()
                    .unwrap_or(0),
            };
            dumps_auto = ["hang", "oom", "signal", "slowdown"]
                .iter()
                .map(|t| fr["dumps"][t]["written"].as_u64().unwrap_or(0))
                .sum();
            (last_cpu, last_t) = (cpu, t);
            csv += &format!(
                "{:.1},{:.2},{},{},{},{},{},{},{:.2},{},{},{},{}\n",
                s.t,
                s.cpu_percent,
                s.rss,
                s.recorder_bytes,
                s.recorder_records,
                s.expired,
                s.evicted,
                s.processes,
                s.load1,
                s.anon,
                s.file,
                s.rings,
                s.allocated
            );
            if samples.len().is_multiple_of(30) {
                eprintln!(
                    "bench soak: {:>5.0} s  cpu {:>5.1}%  rss {:>6.1} MB  recorder {:>6.1} MB  {} processes  load {}",
                    s.t,
                    s.cpu_percent,
                    s.rss as f64 / 1e6,
                    s.recorder_bytes as f64 / 1e6,
                    s.processes,
                    load_average()
                );
            }
            samples.push(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::write(out.join("soak-samples.csv"), &csv)?;
    let status = svc.status()?;
    // The job in progress is cut off after the last sample, once the
    // service stopped (a traced process killed by a signal would dump).
    svc.stop()?;
    drop(job);

    if samples.len() < 3 {
        bail!("too few samples");
    }
    let cpu: Vec<f64> = samples.iter().map(|s| s.cpu_percent).collect();
    let full_at = samples.iter().position(|s| s.expired > 0 || s.evicted > 0);
    let rss_mb = |s: &Sample| s.rss as f64 / 1e6;
    let max_rss = samples.iter().map(|s| s.rss).max().unwrap_or(0);
    let after_full = full_at.map(|i| {
        let tail = &samples[i..];
        // Least-squares slope of RSS over time after the recorder filled.
        let n = tail.len() as f64;
        let mt = tail.iter().map(|s| s.t).sum::<f64>() / n;
        let mr = tail.iter().map(rss_mb).sum::<f64>() / n;
        let cov: f64 = tail.iter().map(|s| (s.t - mt) * (rss_mb(s) - mr)).sum();
        let var: f64 = tail.iter().map(|s| (s.t - mt).powi(2)).sum();
        let slope_mb_per_h = if var > 0.0 { cov / var * 3600.0 } else { 0.0 };
        json!({
            "full_at_s": samples[i].t,
            "rss_at_full_mb": rss_mb(&samples[i]),
            "rss_max_after_full_mb": tail.iter().map(rss_mb).fold(0.0, f64::max),
            "rss_slope_after_full_mb_per_hour": slope_mb_per_h,
            "samples_after_full": tail.len(),
        })
    });
    let loads: Vec<f64> = samples.iter().map(|s| s.load1).collect();
    Ok(json!({
        "minutes": minutes,
        "samples": samples.len(),
        "jobs": jobs,
        "steps_per_job": steps,
        "scrapes": scrapes,
        "automatic_dumps": dumps_auto,
        "cpu_percent_mean": cpu.iter().sum::<f64>() / cpu.len() as f64,
        "cpu_percent_p95": percentile(&cpu, 0.95),
        "cpu_percent_max": cpu.iter().cloned().fold(0.0, f64::max),
        "rss_first_mb": rss_mb(&samples[0]),
        "rss_last_mb": rss_mb(samples.last().unwrap()),
        "rss_max_mb": max_rss as f64 / 1e6,
        "recorder_max_bytes": RECORDER_MAX_BYTES,
        "rss_goal_mb": (RECORDER_MAX_BYTES + RSS_HEADROOM) as f64 / 1e6,
        "rss_within_goal": max_rss <= RECORDER_MAX_BYTES + RSS_HEADROOM,
        "recorder_full": after_full,
        "recorder_bytes_last": samples.last().unwrap().recorder_bytes,
        "recorder_bytes_max": samples.iter().map(|s| s.recorder_bytes).max(),
        "traced_step_ms_median": if traced_steps.is_empty() { 0.0 } else { median(traced_steps) / 1e6 },
        "load1_mean": loads.iter().sum::<f64>() / loads.len() as f64,
        "load1_max": loads.iter().cloned().fold(0.0, f64::max),
        "anon_max_mb": samples.iter().map(|s| s.anon).max().unwrap_or(0) as f64 / 1e6,
        "anon_last_mb": samples.last().unwrap().anon as f64 / 1e6,
        "file_last_mb": samples.last().unwrap().file as f64 / 1e6,
        "ring_mapped_mb": samples.last().unwrap().rings as f64 / 1e6,
        "allocator": status["memory"]["allocator"].clone(),
        "heap_allocated_first_full_mb": full_at.map(|i| samples[i].allocated as f64 / 1e6),
        "heap_allocated_last_mb": samples.last().unwrap().allocated as f64 / 1e6,
        "final_status": status,
    }))
}

/// What runs alongside an overhead round's job.
#[derive(Clone, Copy, Debug, PartialEq)]
enum RoundKind {
    /// Nothing: no service, its probes released.
    Untraced,
    /// Counting-only programs where the service's default level attaches
    /// its own (`bench_floor`): this machine's floor for any such tracer.
    Floor,
    /// A fresh `agent service` at its default level.
    Traced,
}

impl RoundKind {
    fn tag(self) -> &'static str {
        match self {
            RoundKind::Untraced => "untraced",
            RoundKind::Floor => "floor",
            RoundKind::Traced => "traced",
        }
    }
}

/// What one overhead round measured.
struct RoundResult {
    /// Median step time of all ranks (ns).
    step_ns: f64,
    /// CPU seconds of the job (launcher and ranks), start to end.
    cpu_s: f64,
}

/// One overhead round: the job, with what `kind` names alongside.
fn round(
    dir: &Path,
    placement: Placement,
    n: usize,
    steps: u64,
    kind: RoundKind,
) -> Result<RoundResult> {
    let name = format!("round-{}-{n}", placement.tag());
    let svc = if kind == RoundKind::Traced {
        Some(Service::start(dir, &name, placement.agent_cpu())?)
    } else {
        wait_for_closers()?;
        None
    };
    let gate = dir.join(format!("{name}.go"));
    let mut job = Job::start(
        dir,
        &name,
        steps,
        Some(&gate),
        placement.job_cpus().as_deref(),
    )?;
    job.wait_ready()?;
    let pids = job.rank_pids()?;
    if let Some(s) = &svc {
        // Every rank discovered before training starts.
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let listed: Vec<u64> = s
                .ctl(&["processes"])?
                .as_array()
                .context("a list")?
                .iter()
                .filter_map(|e| e["pid"].as_u64())
                .collect();
            if pids.iter().all(|p| listed.contains(p)) {
                break;
            }
            if Instant::now() > end {
                bail!("round {n}: ranks {pids:?} not discovered: {listed:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let floor = if kind == RoundKind::Floor {
        Some(Floor::attach(&default_level_points(&pids)?)?)
    } else {
        None
    };
    std::fs::write(&gate, b"")?;
    job.wait(Duration::from_secs_f64(ROUND_SECONDS * 10.0 + 120.0))?;
    let m = median(job.step_durations(WARMUP_STEPS)?);
    let cpu_s = job.cpu_seconds.context("the job's CPU time")?;
    let probes = floor.as_ref().map(|f| f.probes);
    drop(floor);
    if let Some(s) = svc {
        s.stop()?;
    }
    let _ = std::fs::remove_dir_all(&job.dir);
    eprintln!(
        "bench soak: {} round {n} {:<9} median step {:.3} ms, job CPU {cpu_s:.2} s{}",
        placement.tag(),
        kind.tag(),
        m / 1e6,
        probes.map_or(String::new(), |p| format!(" ({p} bare uprobe pairs)"))
    );
    Ok(RoundResult { step_ns: m, cpu_s })
}

/// Rounds of one placement: untraced first and last, and between each two
/// untraced rounds a traced one and a floor one, so that each counts
/// against the same pair of untraced rounds around it.
fn overhead(dir: &Path, placement: Placement, step_s: f64) -> Result<Value> {
    let steps = ((ROUND_SECONDS / step_s) as u64).max(WARMUP_STEPS + 10);
    let mut base = Vec::new();
    let mut traced = Vec::new();
    let mut floor = Vec::new();
    let mut n = 0;
    base.push(round(dir, placement, n, steps, RoundKind::Untraced)?);
    for _ in 0..OVERHEAD_PAIRS {
        for (kind, into) in [
            (RoundKind::Traced, &mut traced),
            (RoundKind::Floor, &mut floor),
        ] {
            n += 1;
            into.push(round(dir, placement, n, steps, kind)?);
        }
        n += 1;
        base.push(round(dir, placement, n, steps, RoundKind::Untraced)?);
    }
    let steps_ns = |v: &[RoundResult]| v.iter().map(|r| r.step_ns).collect::<Vec<_>>();
    let cpu = |v: &[RoundResult]| v.iter().map(|r| r.cpu_s).collect::<Vec<_>>();
    let paired = paired_overhead(&steps_ns(&base), &steps_ns(&traced));
    let paired_floor = paired_overhead(&steps_ns(&base), &steps_ns(&floor));
    let paired_cpu = paired_overhead(&cpu(&base), &cpu(&traced));
    let paired_cpu_floor = paired_overhead(&cpu(&base), &cpu(&floor));
    let ms = |v: &[RoundResult]| v.iter().map(|r| r.step_ns / 1e6).collect::<Vec<_>>();
    Ok(json!({
        "placement": placement.tag(),
        "job_cpus": placement.job_cpus(),
        "agent_cpu": placement.agent_cpu(),
        "untraced_step_calibrated_ms": step_s * 1e3,
        "rounds_traced": traced.len(),
        "rounds_floor": floor.len(),
        "rounds_untraced": base.len(),
        "steps_per_round": steps,
        "untraced_step_ms": ms(&base),
        "traced_step_ms": ms(&traced),
        "floor_step_ms": ms(&floor),
        "untraced_job_cpu_s": cpu(&base),
        "traced_job_cpu_s": cpu(&traced),
        "floor_job_cpu_s": cpu(&floor),
        "per_round_percent": paired,
        "floor_per_round_percent": paired_floor,
        "overhead": overhead_summary(&paired),
        "floor_overhead": overhead_summary(&paired_floor),
        "job_cpu_overhead": overhead_summary(&paired_cpu),
        "floor_job_cpu_overhead": overhead_summary(&paired_cpu_floor),
    }))
}

/// One overhead phase's paired figures (`measure::overhead_summary`): the
/// agent's, and the floor's (counting programs on the same attach points).
fn print_overhead(phase: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    for (label, o) in [
        ("step time, agent service", &phase["overhead"]),
        (
            "step time, floor (counting programs only)",
            &phase["floor_overhead"],
        ),
        (
            "the job's CPU time, agent service",
            &phase["job_cpu_overhead"],
        ),
        (
            "the job's CPU time, floor",
            &phase["floor_job_cpu_overhead"],
        ),
    ] {
        println!(
            "{label}: mean {:+.2}% (95% CI +/- {:.2}), median {:+.2}%, range {:+.2}% .. {:+.2}%",
            f(&o["mean_percent"]),
            f(&o["ci95_percent"]),
            f(&o["median_percent"]),
            f(&o["min_percent"]),
            f(&o["max_percent"])
        );
    }
    println!("(goal for the agent's step time: <= 0.5%)");
}

pub fn run(out: &Path, minutes: u64) -> Result<Value> {
    if minutes == 0 {
        bail!("--minutes must be at least 1");
    }
    let scratch = Scratch::new()?;
    let dir = scratch.0.as_path();
    let load_before = load_average();
    eprintln!("bench soak: load average before: {load_before}");
    let step_s = calibrate(dir, Placement::Shared)?;
    eprintln!(
        "bench soak: untraced step {:.2} ms; soaking {minutes} min",
        step_s * 1e3
    );
    let soak = soak(dir, out, minutes, step_s)?;
    let shared = overhead(dir, Placement::Shared, step_s)?;
    let cpus = host_cpus();
    let own_cpu = if cpus >= 2 {
        let step_s = calibrate(dir, Placement::AgentOwnCpu)?;
        eprintln!(
            "bench soak: untraced step with the ranks on CPUs {}: {:.2} ms",
            Placement::AgentOwnCpu.job_cpus().unwrap_or_default(),
            step_s * 1e3
        );
        overhead(dir, Placement::AgentOwnCpu, step_s)?
    } else {
        eprintln!("bench soak: one CPU: no rounds with the agent on a CPU of its own");
        json!({"skipped": "one CPU: the agent cannot have a CPU of its own"})
    };
    let load_after = load_average();
    let results = json!({
        "soak": soak,
        "step_overhead": shared,
        "step_overhead_agent_own_cpu": own_cpu,
        "world_size": WORLD,
        "host_cpus": cpus,
        "load_average_before": load_before,
        "load_average_after": load_after,
    });

    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let s = &results["soak"];
    println!(
        "\n## Soak: agent service, default level, 8-rank simulated job, {minutes} min ({} jobs back to back)\n",
        s["jobs"]
    );
    println!(
        "agent CPU: mean {:.2}% of one core, p95 {:.2}%, max {:.2}%",
        f(&s["cpu_percent_mean"]),
        f(&s["cpu_percent_p95"]),
        f(&s["cpu_percent_max"])
    );
    println!(
        "RSS: first {:.1} MB, last {:.1} MB, max {:.1} MB (goal <= {:.0} MB: {})",
        f(&s["rss_first_mb"]),
        f(&s["rss_last_mb"]),
        f(&s["rss_max_mb"]),
        f(&s["rss_goal_mb"]),
        if s["rss_within_goal"] == true {
            "met"
        } else {
            "NOT met"
        }
    );
    println!(
        "of which at the end: anonymous {:.1} MB (max {:.1}), file-backed {:.1} MB, the rings' double mapping {:.1} MB",
        f(&s["anon_last_mb"]),
        f(&s["anon_max_mb"]),
        f(&s["file_last_mb"]),
        f(&s["ring_mapped_mb"])
    );
    println!(
        "allocator: {:.1} MB allocated when the recorder filled, {:.1} MB at the end; resident {:.1} MB",
        f(&s["heap_allocated_first_full_mb"]),
        f(&s["heap_allocated_last_mb"]),
        f(&s["allocator"]["resident_bytes"]) / 1e6
    );
    match s["recorder_full"].as_object() {
        Some(full) => println!(
            "flight recorder full after {:.0} s: RSS then {:.1} MB, max after {:.1} MB, slope {:+.1} MB/h",
            f(&full["full_at_s"]),
            f(&full["rss_at_full_mb"]),
            f(&full["rss_max_after_full_mb"]),
            f(&full["rss_slope_after_full_mb_per_hour"])
        ),
        None => println!("the flight recorder never filled (run longer than its window)"),
    }
    println!(
        "recorder {:.1} MB at the end; {} /metrics scrapes; {} automatic dumps",
        f(&s["recorder_bytes_last"]) / 1e6,
        s["scrapes"],
        s["automatic_dumps"]
    );
    let o = &results["step_overhead"];
    println!(
        "\n## Step-time overhead: {} traced and {} floor rounds between {} untraced ({} steps each)\n",
        o["rounds_traced"], o["rounds_floor"], o["rounds_untraced"], o["steps_per_round"]
    );
    print_overhead(o);
    let o = &results["step_overhead_agent_own_cpu"];
    if o["overhead"].is_object() {
        println!(
            "\n## Step-time overhead, the agent on CPU 0 and the ranks on CPUs {}: {} traced and {} floor rounds between {} untraced ({} steps each)\n",
            o["job_cpus"].as_str().unwrap_or(""),
            o["rounds_traced"],
            o["rounds_floor"],
            o["rounds_untraced"],
            o["steps_per_round"]
        );
        print_overhead(o);
    } else {
        println!(
            "\n(no rounds with the agent on a CPU of its own: {})",
            o["skipped"]
        );
    }
    println!(
        "load average before {load_before}, after {load_after} ({cpus} CPUs, shared with other work)"
    );
    Ok(results)
}
