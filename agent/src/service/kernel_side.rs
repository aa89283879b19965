//! The service's kernel side: the programs loaded (not system-wide: only
//! the traced set is recorded), collect feeding the pipeline, and one task
//! owning the kernel that every [`ROUND`] discovers training processes
//! ([`super::discovery`]), adds them to the traced set, plans and applies
//! the device probes of the traced set (table updates sent to the pipeline
//! before the probes are attached), forwards drops, and keeps
//! [`Running::traced`] equal to the traced set. Level changes from the
//! control API reach that task as requests ([`KernelLevels`]).
//!
//! # Levels
//! | service level | device calls (`DeviceLevel`) | scheduling, off-CPU stacks |
//! |---|---|---|
//! | 0 | 0: collectives, syncs, memory, communicator set-up | off (`CONFIG.sched_off`) |
//! | 1 (default) | 0 | on, sampled stacks (`[stacks]`: 10/s per thread) |
//! | 2 | 1: + launches and copies | on, sampled stacks (`[stacks]`) |
//! | 3 | 2: + activity records | on, a stack at every switch-out |
//!
//! At level 0 the scheduler programs return at once for the traced
//! processes; fork, exec and exit are still recorded (the traced set
//! follows children, state is dropped at exit).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::Instrument;
use xpuscope_common::stack_mode;

use super::config::{CaptureLevel, ServiceConfig};
use super::discovery::{Discovery, Found, LiveProcTable};
use super::seam::{JobEnv, LevelSwitch, Running};
use crate::btf::{self, Btf};
use crate::config::AttachConfig;
use crate::kernel::load::DEFAULT_LOADER;
use crate::kernel::probes::closer::ReleaseWait;
use crate::kernel::probes::plan::{FileId, Predicted};
use crate::kernel::probes::{AyaDeviceProbes, DeviceProbes, LiveProcesses, ProcessSource};
use crate::kernel::{CaptureLevels, DeviceLevel, EBPF_OBJECT, Kernel, KernelControl};
use crate::model::RankIdentity;
use crate::pipeline::Announcements;
use crate::pipeline::PipelineMsg;
use crate::pipeline::collect::{LoaderNotice, NOTICE_QUEUE};
use crate::pipeline::collect::{Reader, ReaderCounters};
use crate::pipeline::queue_budget::QueueBudget;
use crate::supervise::{announce_and_apply, on_loader_notices, send_drops};
use crate::{host, preflight, procfs};

/// How often discovery runs (and drops are forwarded).
pub const ROUND: Duration = Duration::from_millis(250);
/// How long the control API waits for the kernel task to switch levels.
const LEVEL_TIMEOUT: Duration = Duration::from_secs(5);

/// What a service level asks of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLevel {
    pub device: DeviceLevel,
    pub stack_mode: u32,
    /// The scheduler programs record the traced processes.
    pub sched: bool,
}

impl KernelLevel {
    pub fn of(level: CaptureLevel) -> KernelLevel {
        // DeviceLevel::new cannot fail for 0..=2 (its MAX is 2).
        let device = |n| DeviceLevel::new(n).unwrap_or_default();
        match level.get() {
            0 => KernelLevel {
                device: device(0),
                stack_mode: stack_mode::SAMPLED,
                sched: false,
            },
            1 => KernelLevel {
                device: device(0),
                stack_mode: stack_mode::SAMPLED,
                sched: true,
            },
            2 => KernelLevel {
                device: device(1),
                stack_mode: stack_mode::SAMPLED,
                sched: true,
            },
            _ => KernelLevel {
                device: device(2),
                stack_mode: stack_mode::ALL,
                sched: true,
            },
        }
    }
}

/// A level change for the kernel task, with where to answer.
pub struct LevelRequest {
    level: CaptureLevel,
    reply: std::sync::mpsc::SyncSender<Result<(), String>>,
}

/// The [`LevelSwitch`] of the running service: asks the kernel task and
/// waits for its answer (called from a blocking context).
pub struct KernelLevels {
    tx: mpsc::Sender<LevelRequest>,
}

impl KernelLevels {
    pub fn channel() -> (KernelLevels, mpsc::Receiver<LevelRequest>) {
        let (tx, rx) = mpsc::channel(4);
        (KernelLevels { tx }, rx)
    }
}

impl LevelSwitch for KernelLevels {
    fn set_level(&self, level: CaptureLevel) -> Result<(), String> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.tx
            .try_send(LevelRequest { level, reply })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => {
                    "other level changes are in progress; try again".to_string()
                }
                mpsc::error::TrySendError::Closed(_) => "the kernel side has stopped".to_string(),
            })?;
        answer.recv_timeout(LEVEL_TIMEOUT).map_err(|_| {
            format!(
                "the kernel side did not answer within {LEVEL_TIMEOUT:?}; \
                 the level may change later, see `agent ctl status`"
            )
        })?
    }
}

/// Checks, then loads and attaches the programs at `cfg.level`.
pub fn load(cfg: &ServiceConfig) -> Result<Kernel> {
    preflight::check_object(EBPF_OBJECT)?;
    preflight::check_privileges()?;
    let tuning = AttachConfig {
        ring_bytes: cfg.rings.scheduler,
        device_ring_bytes: cfg.rings.device,
        bystander_ring_bytes: cfg.rings.bystander,
        stack_rate: cfg.stacks.rate,
        stack_burst: cfg.stacks.burst,
        ..AttachConfig::default()
    };
    let btf = Btf::from_file(&tuning.kernel_btf)?;
    let offsets = btf::task_offsets(&btf)?;
    let level = KernelLevel::of(cfg.level);
    let mut options = tuning.load_options(offsets, level.stack_mode, level.device.mask());
    options.config.sched_off = (!level.sched) as u32;
    Kernel::load_and_attach(&options)
}

/// How often the always-on service drains the rings when no wakeup came
/// (`agent attach` drains every 10 ms). Each drain is a batch through the
/// pipeline and a wakeup of every sink's thread; nothing the service feeds
/// (the flight recorder's window, metrics scraped every few seconds, detectors
/// that judge steps and seconds) needs the records sooner, and a ring a
/// quarter full still wakes the reader at once. Measured on the 8-rank
/// simulated job: 5.2-5.7% of a core against 6.5-7.3% at 10 ms
/// (interleaved runs; 100 ms gained nothing more).
pub const SERVICE_DRAIN_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// How long the service waits at start for earlier agents' uprobe
/// releases (well inside systemd's start timeout).
const RELEASE_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The running kernel side, as the supervisor holds it.
pub struct KernelHandle {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl KernelHandle {
    /// The kernel task or collect ended on its own (an error, a panic).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Detaches everything, drains the rings into the pipeline and stops
    /// collect; the pipeline's input then ends with the supervisor's.
    pub async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        self.task
            .await
            .map_err(|e| anyhow!("the kernel side panicked: {e}"))?
    }
}

/// Starts collect and the kernel task; returns after a first discovery
/// round, so the processes running now are traced when the service says
/// it is ready.
pub async fn start(
    mut kernel: Kernel,
    cfg: &ServiceConfig,
    running: Running,
    levels: mpsc::Receiver<LevelRequest>,
) -> Result<KernelHandle> {
    let tuning = AttachConfig::default();
    let rings = kernel.take_rings()?;
    // Without it, every stack is copied whole: slower, never wrong.
    match kernel.stack_ends() {
        Ok(map) => {
            let _ = running.stack_ends.send(map);
        }
        Err(e) => tracing::warn!("stacks are copied whole: {e}"),
    }
    let (stop_collect, stop_rx) = watch::channel(false);
    let (notice_tx, notices) = mpsc::channel(NOTICE_QUEUE);
    // A service restarted while its predecessor's probes are still being
    // released would attach its own behind each release, late for the
    // jobs starting now: it waits (bounded: it must report ready to
    // systemd within its start timeout).
    let waited = crate::kernel::probes::closer::wait_for_releases(
        RELEASE_WAIT_LIMIT,
        || false,
        |pids| {
            tracing::info!(
                "waiting for earlier agents' device probes to be released (closer pids {pids:?})"
            )
        },
    );
    match waited {
        ReleaseWait::None => {}
        ReleaseWait::Done { waited, .. } => {
            tracing::info!("earlier agents' probes released after {waited:.1?}")
        }
        ReleaseWait::GaveUp { closers, waited } => tracing::warn!(
            "{closers} earlier agents still release their probes after {waited:.1?}; starting now: \
             device probes may land late (counted as slow attaches)"
        ),
    }
    // The host's loader's debugger hook: a traced process's start-up and
    // every dlopen are reported at once.
    let hooked = kernel
        .hook_loader(DEFAULT_LOADER)
        .inspect_err(|e| tracing::warn!("loader hook: {e:#}"))
        .is_ok();
    let reader_counters = Arc::new(ReaderCounters::default());
    let reader = Reader {
        notices: Some(notice_tx),
        rings,
        out: running.pipeline.clone(),
        counters: reader_counters.clone(),
        budget: QueueBudget::default(),
        drain_interval: SERVICE_DRAIN_INTERVAL,
        delay: tuning.reader_delay,
    };
    let collect = tokio::spawn(
        reader
            .run(stop_rx)
            .instrument(tracing::info_span!("collect")),
    );
    let level = KernelLevel::of(cfg.level);
    let mut side = KernelSide {
        device: DeviceProbes::new(
            CaptureLevels {
                device: level.device,
                launch_counts: cfg.launch_counts,
            },
            true,
        )
        .with_capacity(cfg.probes.slots, cfg.probes.release_after),
        kernel,
        discovery: Discovery::new(cfg.discovery.clone()),
        job_env: running.job_env,
        tx: running.pipeline,
        announce: running.announce,
        traced: running.traced,
        known: HashMap::new(),
        environ_unset: HashSet::new(),
        drops_seen: vec![0; host::possible_cpus()],
        probe_stats: running.probe_stats,
        losses: running.losses,
        reader_counters,
    };
    side.device.loaders_hooked(side.kernel.hooked_loaders());
    // Programs verified beforehand: a starting process's probes are then
    // attached within milliseconds of its loader's first report.
    if hooked && let Err(e) = side.device.load_programs(&mut side.kernel.attacher()) {
        tracing::warn!("device probes: {:#}", anyhow::Error::new(e));
    }
    side.round().await?;
    let (stop, stop_rx) = oneshot::channel();
    // The kernel side blocks: it reads `/proc` and the files traced
    // processes name, and attaching a probe waits behind the kernel's
    // uprobe releases. On a thread of its own, none of that holds up the
    // runtime's worker, which reads the rings and serves `/metrics` and
    // the control API.
    let runtime = tokio::runtime::Handle::current();
    let task = tokio::task::spawn_blocking(move || {
        runtime.block_on(
            side.run(levels, notices, stop_rx, stop_collect, collect)
                .instrument(tracing::info_span!("kernel")),
        )
    });
    Ok(KernelHandle { stop, task })
}

struct KernelSide {
    kernel: Kernel,
    device: AyaDeviceProbes,
    discovery: Discovery,
    job_env: JobEnv,
    tx: mpsc::Sender<PipelineMsg>,
    announce: Announcements,
    traced: Arc<Mutex<BTreeMap<u32, Value>>>,
    /// What `GET /processes` says about each traced process, read once
    /// (dropped when it leaves the set).
    known: HashMap<u32, Value>,
    /// Processes whose environment read empty when they were described:
    /// a process in the middle of its exec has its new name before its new
    /// environment is in place, so it is described again until one is.
    environ_unset: HashSet<u32>,
    drops_seen: Vec<u64>,
    probe_stats: Arc<Mutex<crate::kernel::probes::DeviceProbeStats>>,
    losses: Arc<crate::sinks::metrics::KernelLosses>,
    reader_counters: Arc<ReaderCounters>,
}

impl KernelSide {
    async fn run(
        mut self,
        mut levels: mpsc::Receiver<LevelRequest>,
        mut notices: mpsc::Receiver<LoaderNotice>,
        mut stop: oneshot::Receiver<()>,
        stop_collect: watch::Sender<bool>,
        mut collect: tokio::task::JoinHandle<Result<()>>,
    ) -> Result<()> {
        let mut tick = tokio::time::interval(ROUND);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut collect_ended = false;
        let failure = loop {
            tokio::select! {
                _ = &mut stop => break None,
                r = &mut collect => {
                    collect_ended = true;
                    break Some(match r {
                        Ok(Ok(())) => anyhow!("the collect stage ended"),
                        Ok(Err(e)) => e.context("the collect stage failed"),
                        Err(e) => anyhow!("the collect stage panicked: {e}"),
                    });
                }
                Some(first) = notices.recv() => {
                    // A traced process started a program or dlopen'ed:
                    // its probes now, not at the next round.
                    let mut batch = vec![first];
                    while let Ok(n) = notices.try_recv() {
                        batch.push(n);
                    }
                    if let Err(e) =
                        on_loader_notices(
                            &mut self.device,
                            &mut self.kernel,
                            &self.announce,
                            &batch,
                            &mut ServiceProcesses::new(&self.job_env),
                        )
                        .await
                    {
                        tracing::warn!("device probes: {e:#}");
                    }
                }
                Some(req) = levels.recv() => {
                    let answer = self.set_level(req.level).await.map_err(|e| format!("{e:#}"));
                    let _ = req.reply.send(answer);
                }
                _ = tick.tick() => {
                    if let Err(e) = self.round().await {
                        break Some(e);
                    }
                }
            }
        };
        // Detach first, then drain: everything produced is then either
        // consumed or counted as dropped.
        self.device.detach_all(&mut self.kernel.attacher());
        self.kernel.detach_all();
        send_drops(&self.kernel, &mut self.drops_seen, &self.tx).await;
        let _ = stop_collect.send(true);
        let collected = if collect_ended {
            Ok(())
        } else {
            collect
                .await
                .map_err(|e| anyhow!("the collect stage panicked: {e}"))
                .and_then(|r| r)
        };
        if let Ok(mut t) = self.traced.lock() {
            t.clear();
        }
        match failure {
            Some(e) => Err(e),
            None => collected,
        }
    }

    /// One round: new processes into the traced set, their probes, drops,
    /// and the traced list.
    async fn round(&mut self) -> Result<()> {
        self.kernel.flush_log();
        let traced: HashSet<u32> = self.kernel.targets().into_iter().collect();
        let found = self.discovery.scan(&mut LiveProcTable, &traced);
        let mut reasons = HashMap::new();
        for f in found {
            self.trace(&f, &mut reasons);
        }
        let targets = self.kernel.targets();
        let plan = self
            .device
            .plan(&targets, &mut ServiceProcesses::new(&self.job_env));
        if let Err(e) =
            announce_and_apply(&mut self.device, &mut self.kernel, &self.announce, plan).await
        {
            if self.tx.is_closed() {
                return Err(e.context("device probes"));
            }
            tracing::warn!("device probes: {e:#}");
        }
        send_drops(&self.kernel, &mut self.drops_seen, &self.tx).await;
        self.describe(&targets, &reasons);
        if let Ok(mut s) = self.probe_stats.lock() {
            *s = self.device.stats();
        }
        self.publish_losses();
        Ok(())
    }

    fn trace(&mut self, f: &Found, reasons: &mut HashMap<u32, String>) {
        if let Err(e) = self.kernel.add_target(f.pid) {
            tracing::warn!("tracing pid {} ({}): {e}", f.pid, f.comm);
            return;
        }
        tracing::info!("tracing pid {} ({}): {}", f.pid, f.comm, f.reason);
        reasons.insert(f.pid, f.reason.to_string());
        // Children forked before the kernel followed it; the tree is read
        // after adding it, so none can slip between the two.
        for pid in procfs::with_descendants(f.pid)
            .into_iter()
            .filter(|&p| p != f.pid)
        {
            match self.kernel.add_target(pid) {
                Ok(()) => {
                    reasons.insert(pid, format!("child of {} ({})", f.pid, f.comm));
                }
                Err(e) => tracing::warn!("tracing pid {pid}, child of {}: {e}", f.pid),
            }
        }
    }

    /// The kernel side's losses, for the metrics and the status.
    fn publish_losses(&self) {
        let l = &self.losses;
        l.dropped_events.store(
            self.drops_seen.iter().sum(),
            std::sync::atomic::Ordering::Relaxed,
        );
        l.skipped_events.store(
            self.kernel.kernel_skips().iter().sum(),
            std::sync::atomic::Ordering::Relaxed,
        );
        l.decode_errors.store(
            self.reader_counters
                .decode_errors
                .load(std::sync::atomic::Ordering::Relaxed),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Keeps [`Running::traced`] equal to the kernel's traced set.
    fn describe(&mut self, targets: &[u32], reasons: &HashMap<u32, String>) {
        let now: HashSet<u32> = targets.iter().copied().collect();
        self.known.retain(|pid, _| now.contains(pid));
        self.environ_unset.retain(|pid| now.contains(pid));
        for &pid in targets {
            let known = self.known.get(&pid);
            // A process described before it executed its program (a rank
            // forked by a traced launcher, seen between its fork and its
            // exec) carried its parent's environment: described again once
            // its name says it ran another program.
            let earlier_reason = known
                .and_then(|d| d["traced_because"].as_str())
                .map(str::to_string);
            let stat = match known {
                Some(d) if !d["rank"].is_null() => continue,
                Some(d) => match procfs::stat(pid) {
                    Some(stat)
                        if d["comm"] != stat.comm.as_str() || self.environ_unset.contains(&pid) =>
                    {
                        stat
                    }
                    _ => continue,
                },
                None => match procfs::stat(pid) {
                    Some(stat) => stat,
                    None => continue, // gone: the kernel prunes it at its exit
                },
            };
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            if environ.is_empty() {
                self.environ_unset.insert(pid);
            } else {
                self.environ_unset.remove(&pid);
            }
            let id = RankIdentity::from_environ_with(&environ, &self.job_env.get());
            let reason = reasons
                .get(&pid)
                .cloned()
                .or(earlier_reason)
                .unwrap_or_else(|| format!("child of {}", stat.ppid));
            let json = json!({
                "pid": pid,
                "comm": stat.comm,
                "rank": id.rank,
                "local_rank": id.local_rank,
                "world_size": id.world_size,
                "job": id.job,
                "traced_because": reason,
            });
            self.known.insert(pid, json);
        }
        if let Ok(mut t) = self.traced.lock() {
            *t = self
                .known
                .iter()
                .map(|(pid, d)| (*pid, d.clone()))
                .collect();
        }
    }

    async fn set_level(&mut self, level: CaptureLevel) -> Result<()> {
        let want = KernelLevel::of(level);
        self.kernel
            .set_stack_mode(want.stack_mode)
            .context("writing the stack mode")?;
        self.kernel
            .set_sched_off(!want.sched)
            .context("switching the scheduler records")?;
        tracing::info!(
            "level {level}: device capture level {} -> {}",
            self.device.levels().device,
            want.device
        );
        let plan = self
            .device
            .set_device_level(want.device, &mut ServiceProcesses::new(&self.job_env));
        announce_and_apply(&mut self.device, &mut self.kernel, &self.announce, plan).await
    }
}

/// The processes as the service reads them: `/proc` and the library
/// files ([`LiveProcesses`]), with each identity's job label from
/// `labels.job_env` rather than the default list, so that metrics, dumps
/// and detectors (fed the identities the probe plans carry) label a job as
/// `GET /processes` does.
struct ServiceProcesses {
    job_env: std::sync::Arc<[String]>,
}

impl ServiceProcesses {
    fn new(job_env: &JobEnv) -> Self {
        Self {
            job_env: job_env.get(),
        }
    }
}

impl ProcessSource for ServiceProcesses {
    fn maps(&mut self, pid: u32) -> Option<xpuscope_probes::maps::ProcessMaps> {
        LiveProcesses.maps(pid)
    }

    fn identity(&mut self, pid: u32) -> RankIdentity {
        RankIdentity::read_with(pid, &self.job_env)
    }

    fn open_path(
        &mut self,
        pid: u32,
        lib: &xpuscope_probes::discover::LoadedLibrary,
    ) -> Option<String> {
        LiveProcesses.open_path(pid, lib)
    }

    fn file_id(&mut self, path: &str) -> std::io::Result<FileId> {
        LiveProcesses.file_id(path)
    }

    fn resolve(
        &mut self,
        path: &str,
        library: xpuscope_probes::catalog::Library,
    ) -> Result<xpuscope_probes::resolve::ResolvedLibrary, String> {
        LiveProcesses.resolve(path, library)
    }

    fn predict(&mut self, pid: u32) -> Option<Predicted> {
        LiveProcesses.predict(pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_levels_map_to_device_levels_and_stacks() {
        let of = |n| KernelLevel::of(CaptureLevel::new(n).unwrap());
        let device: Vec<u8> = (0..=3).map(|n| of(n).device.get()).collect();
        assert_eq!(device, vec![0, 0, 1, 2]);
        let sched: Vec<bool> = (0..=3).map(|n| of(n).sched).collect();
        assert_eq!(
            sched,
            vec![false, true, true, true],
            "level 0: no scheduling"
        );
        let stacks: Vec<u32> = (0..=3).map(|n| of(n).stack_mode).collect();
        assert_eq!(
            stacks,
            vec![
                stack_mode::SAMPLED,
                stack_mode::SAMPLED,
                stack_mode::SAMPLED,
                stack_mode::ALL
            ]
        );
    }

    #[test]
    fn a_level_switch_waits_for_the_kernel_task_and_reports_its_answer() {
        let (levels, mut rx) = KernelLevels::channel();
        let answering = std::thread::spawn(move || {
            let req = rx.blocking_recv().unwrap();
            assert_eq!(req.level.get(), 2);
            req.reply.send(Err("no probes".into())).unwrap();
            drop(rx);
        });
        assert_eq!(
            levels.set_level(CaptureLevel::new(2).unwrap()),
            Err("no probes".to_string())
        );
        answering.join().unwrap();
        let e = levels.set_level(CaptureLevel::new(1).unwrap()).unwrap_err();
        assert!(e.contains("stopped"), "{e}");
    }
}
