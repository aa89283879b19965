//! One recording (`agent attach`), from checks to the finished trace: the
//! supervisor that starts the stages in order (load and attach -> collect
//! -> pipeline -> sinks), stops them on the duration, Ctrl-C/SIGTERM, the
//! target's exit or a failed stage, and always finishes the trace file.

use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::btf::{self, Btf};
use crate::config::{AttachConfig, StackPolicy};
use crate::kernel::load::DEFAULT_LOADER;
use crate::kernel::probes::closer;
use crate::kernel::probes::{AyaDeviceProbes, DeviceProbes, LiveProcesses};
use crate::kernel::{CaptureLevels, DeviceLevel, EBPF_OBJECT, Kernel, KernelControl};
use crate::model::Finding;
use crate::pipeline::collect::{LoaderNotice, NOTICE_QUEUE, Reader, ReaderCounters};
use crate::pipeline::enrich::LiveEnricher;
use crate::pipeline::interpret::InterpretCounters;
use crate::pipeline::queue_budget::QueueBudget;
use crate::pipeline::{self, Announcements, PIPELINE_BATCHES, Pipeline, PipelineMsg};
use crate::sinks::detect::{DetectConfig, DetectSink};
use crate::sinks::perfetto::{PerfettoSink, Written};
use crate::sinks::summary::{RecordTotals, SummarySink};
use crate::sinks::{FanOut, SinkHandle, SinkReport};
use crate::summary::{RunSummary, StopReason};
use crate::supervise::{announce_and_apply, on_loader_notices, send_drops};
use crate::{host, preflight, procfs};

const POLL: Duration = Duration::from_millis(100);
const STATUS_EVERY: u32 = 10;
/// Polls between re-scans of the traced processes' libraries (dlopen).
const DEVICE_SCAN_EVERY: u32 = 5;
/// Queue depth of each sink, in batches (a batch is up to 4096 records):
/// about as much as the scheduler ring holds, so a sink falls behind only
/// where the kernel ring would have overflowed too.
const SINK_BATCHES: usize = 64;

pub fn run(cfg: AttachConfig) -> Result<RunSummary> {
    preflight::check_object(EBPF_OBJECT)?;
    preflight::check_privileges()?;
    let target = cfg.pid.map(preflight::check_target).transpose()?;
    let btf = Btf::from_file(&cfg.kernel_btf)?;
    let offsets = btf::task_offsets(&btf)?;
    let file = preflight::open_output(&cfg.output)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("xpuscope-io")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(record(cfg, target, offsets, file))
}

/// The kernel side: programs loaded and attached, the target and its
/// descendants in the traced set.
fn start_kernel(
    cfg: &AttachConfig,
    target: Option<u32>,
    offsets: xpuscope_common::TaskOffsets,
    levels: CaptureLevels,
) -> Result<Kernel> {
    let mut probes = Kernel::load_and_attach(&cfg.load_options(
        offsets,
        cfg.stacks.kernel_mode(),
        levels.device.mask(),
    ))?;
    // Programs are attached (forks are followed) before the process tree is
    // read, so no child can slip between the two.
    if let Some(t) = target {
        for pid in procfs::with_descendants(t) {
            probes.add_target(pid)?;
        }
    }
    Ok(probes)
}

/// The running stages of a recording.
struct Stages {
    /// Into the pipeline (collect's and the supervisor's messages).
    tx: mpsc::Sender<PipelineMsg>,
    /// Probe announcements into the pipeline, ahead of queued events.
    announce: Announcements,
    stop_collect: watch::Sender<bool>,
    collect: tokio::task::JoinHandle<Result<()>>,
    collect_counters: Arc<ReaderCounters>,
    pipeline: JoinHandle<Result<InterpretCounters>>,
    trace: SinkHandle<Written<std::io::BufWriter<File>>>,
    summary: SinkHandle<RecordTotals>,
    detect: SinkHandle<Vec<Finding>>,
    /// GPU health from NVML, into the pipeline.
    health: crate::health::HealthSampler,
}

/// Loader notices from collect, for the supervisor.
type Notices = mpsc::Receiver<LoaderNotice>;

impl Stages {
    /// Starts the sinks, the pipeline thread and the collect task.
    fn start(
        cfg: &AttachConfig,
        probes: &mut Kernel,
        file: File,
    ) -> Result<(Self, usize, Notices)> {
        let start_ts = host::boottime_ns();
        let pids: Vec<u32> = if cfg.system_wide {
            procfs::all_pids()
        } else {
            probes.targets()
        };
        let processes: Vec<procfs::ProcessEntry> =
            pids.into_iter().filter_map(procfs::process).collect();
        let initial_threads: usize = processes.iter().map(|p| p.threads.len()).sum();

        let mut fanout = FanOut::default();
        let trace = fanout.add("trace", PerfettoSink::to_file(file)?, SINK_BATCHES)?;
        let summary = fanout.add_inline("summary", SummarySink::default());
        // Findings go back into the stream: the trace renders them.
        let (findings_tx, findings_rx) = std::sync::mpsc::channel();
        let detect_cfg = DetectConfig {
            hang_timeout: cfg.hang_timeout,
            host: cfg.host_detect.clone(),
            collective: cfg.collective.clone(),
            gpu: Default::default(),
        };
        // Inline too: a few map updates per device call, nothing per
        // scheduler record; findings leave on a channel (never blocks).
        let detect = fanout.add_inline("detect", DetectSink::new(detect_cfg, Some(findings_tx)));
        let (tx, rx) = mpsc::channel::<PipelineMsg>(PIPELINE_BATCHES);
        let device_call_rate = cfg.device_call_rate;
        let (announce_tx, announce_rx) = std::sync::mpsc::channel();
        // Without the handle, every stack is copied whole (as before the
        // ends were learned): slower, never wrong.
        let stack_ends = probes
            .stack_ends()
            .map_err(|e| tracing::warn!("stacks are copied whole: {e}"))
            .ok();
        let (health, health_rx) = crate::health::start(&cfg.gpu_health);
        let pipeline = pipeline::start_thread(
            move || {
                let mut enricher = LiveEnricher::default();
                if let Some(map) = stack_ends {
                    enricher = enricher.with_stack_ends(Box::new(map));
                }
                let mut pipeline = Pipeline::new(enricher, fanout)
                    .with_device_call_rate(device_call_rate)
                    .with_findings(findings_rx)
                    .with_health(health_rx)
                    .with_announcements(announce_rx);
                pipeline.start(start_ts, processes);
                pipeline
            },
            rx,
        )?;

        let collect_counters = Arc::new(ReaderCounters::default());
        let (stop_collect, stop_rx) = watch::channel(false);
        let (notice_tx, notices) = mpsc::channel(NOTICE_QUEUE);
        let reader = Reader {
            rings: probes.take_rings()?,
            out: tx.clone(),
            notices: Some(notice_tx),
            counters: collect_counters.clone(),
            budget: QueueBudget::default(),
            drain_interval: cfg.drain_interval,
            delay: cfg.reader_delay,
        };
        let collect = tokio::spawn(
            reader
                .run(stop_rx)
                .instrument(tracing::info_span!("collect")),
        );
        let stages = Self {
            tx,
            announce: announce_tx,
            stop_collect,
            collect,
            collect_counters,
            pipeline,
            trace,
            summary,
            detect,
            health,
        };
        Ok((stages, initial_threads, notices))
    }

    /// A stage that ended on its own (an error or a panic).
    fn failed(&self) -> bool {
        self.collect.is_finished()
            || self.pipeline.is_finished()
            || self.trace.is_finished()
            || self.summary.is_finished()
            || self.detect.is_finished()
    }
}

/// What the stages handed back at the end.
struct Finished {
    consumed: Vec<u64>,
    decode_errors: u64,
    interpret: InterpretCounters,
    totals: RecordTotals,
    sinks: Vec<SinkReport>,
    bytes: u64,
    findings: Vec<Finding>,
    health: crate::health::HealthReports,
}

async fn record(
    cfg: AttachConfig,
    target: Option<u32>,
    offsets: xpuscope_common::TaskOffsets,
    file: File,
) -> Result<RunSummary> {
    let levels = CaptureLevels {
        device: DeviceLevel::new(cfg.probe_level)?,
        launch_counts: cfg.launch_counts,
    };
    if target.is_some() {
        wait_for_earlier_releases();
    }
    let mut probes = start_kernel(&cfg, target, offsets, levels)?;
    let (stages, initial_threads, mut notices) = Stages::start(&cfg, &mut probes, file)?;
    // The host's loader's debugger hook: a traced process's start-up and
    // every dlopen are reported at once (others' loaders are hooked when a
    // traced program names them).
    let hooked = target.is_some()
        && cfg.loader_hook
        && probes
            .hook_loader(DEFAULT_LOADER)
            .inspect_err(|e| tracing::warn!("loader hook: {e:#}"))
            .is_ok();

    // Device libraries already mapped are probed before the start line, so
    // a caller waiting for it sees their calls from then on.
    let mut device = DeviceProbes::new(levels, cfg.stacks != StackPolicy::Off);
    device.loaders_hooked(probes.hooked_loaders());
    // With the loader hook, a process starting under the target gets its
    // probes within milliseconds: the programs are verified beforehand.
    if target.is_some()
        && hooked
        && let Err(e) = device.load_programs(&mut probes.attacher())
    {
        // With the cause (aya's error and the verifier's log), which the
        // kernel error's own message leaves to its source.
        tracing::warn!("device probes: {:#}", anyhow::Error::new(e));
    }
    if target.is_some()
        && let Err(e) = scan_devices(&mut device, &mut probes, &stages.announce).await
    {
        tracing::warn!("device probes: {e:#}");
    }
    announce(&cfg, target, initial_threads);

    let started = Instant::now();
    let mut drops_seen = vec![0u64; host::possible_cpus()];
    let reason = supervise(
        &cfg,
        target,
        &stages,
        &mut probes,
        &mut device,
        &mut drops_seen,
        &mut notices,
    )
    .await?;

    if cfg.report_targets {
        report_targets(&probes);
    }
    // Detach first, then drain: everything produced is then either consumed
    // or counted as dropped.
    let kernel_skips = probes.kernel_skips();
    let device_hits = device.hits(&probes.attacher());
    device.detach_all(&mut probes.attacher());
    probes.detach_all();
    send_drops(&probes, &mut drops_seen, &stages.tx).await;
    let mut drops_by_kind = probes.drops_by_kind();
    for (slot, skipped) in kernel_skips.iter().enumerate() {
        drops_by_kind[slot] += skipped;
    }
    drop(probes);
    let finished = stop(stages, &cfg).await?;

    let mut summary = RunSummary::new(
        &cfg,
        reason,
        started.elapsed(),
        &finished.consumed,
        &drops_by_kind,
        finished.decode_errors,
        finished.bytes,
        finished.interpret,
        finished.totals,
        finished.sinks,
    );
    summary.findings = finished.findings;
    summary.gpu_health = finished.health.gpu;
    summary.npu_health = finished.health.npu;
    summary.set_device_probes(device.stats());
    summary.set_device_hits(&device_hits);
    summary.kernel_skipped = kernel_skips.iter().sum();
    Ok(summary)
}

/// How long `agent attach` waits for earlier agents' uprobe releases
/// before it records anyway (they take about 90 ms per perf-event probe:
/// a few seconds for a job's libraries, rarely more).
const RELEASE_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Waits, saying so, while earlier agents' device probes are released:
/// probes attached meanwhile land late and the job's first calls go
/// unrecorded (see [`closer::wait_for_releases`]).
fn wait_for_earlier_releases() {
    let waited = closer::wait_for_releases(
        RELEASE_WAIT_LIMIT,
        || crate::stop::requested().is_some(),
        |pids| {
            eprintln!(
                "xpuscope: waiting for earlier agents' device probes to be released (closer pids {pids:?}); \
                 probes attached meanwhile would land late and miss the job's first calls"
            )
        },
    );
    match waited {
        closer::ReleaseWait::None => {}
        closer::ReleaseWait::Done { waited, .. } => {
            eprintln!("xpuscope: earlier agents' probes released after {waited:.1?}")
        }
        closer::ReleaseWait::GaveUp { closers, waited } => eprintln!(
            "xpuscope: warning: {closers} earlier agents still release their probes after {waited:.1?}; \
             recording now: device probes may land late (counted as slow attaches)"
        ),
    }
}

fn announce(cfg: &AttachConfig, target: Option<u32>, initial_threads: usize) {
    match target {
        Some(t) => eprintln!(
            "xpuscope: recording pid {t} ({}), {initial_threads} threads{} -> {}; Ctrl-C to stop",
            procfs::stat(t).map(|s| s.comm).unwrap_or_default(),
            if cfg.system_wide {
                ", all CPUs and processes"
            } else {
                ""
            },
            cfg.output.display()
        ),
        None => eprintln!(
            "xpuscope: recording all CPUs and processes -> {}; Ctrl-C to stop",
            cfg.output.display()
        ),
    }
}

/// Runs until a reason to stop: polls the target, rescans device
/// libraries, forwards drops and ticks, prints the status line.
async fn supervise(
    cfg: &AttachConfig,
    target: Option<u32>,
    stages: &Stages,
    probes: &mut Kernel,
    device: &mut AyaDeviceProbes,
    drops_seen: &mut [u64],
    notices: &mut Notices,
) -> Result<StopReason> {
    let mut level_schedule = cfg.level_schedule.clone();
    let started = Instant::now();
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let deadline = cfg.duration.map(|d| tokio::time::Instant::now() + d);
    let mut poll = tokio::time::interval(POLL);
    let mut polls = 0u32;
    let mut last_consumed = 0u64;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let early = |sig| {
        if sig == libc::SIGINT {
            StopReason::Interrupted
        } else {
            StopReason::Terminated
        }
    };
    if let Some(sig) = crate::stop::requested() {
        eprintln!("xpuscope: stop requested during start-up; the trace ends here");
        return Ok(early(sig));
    }
    let reason = loop {
        tokio::select! {
            _ = sigint.recv() => break StopReason::Interrupted,
            _ = sigterm.recv() => break StopReason::Terminated,
            _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await },
                if deadline.is_some() => break StopReason::Duration,
            Some(first) = notices.recv(), if target.is_some() => {
                let mut batch = vec![first];
                while let Ok(n) = notices.try_recv() {
                    batch.push(n);
                }
                if let Err(e) = on_loader_notices(device, probes, &stages.announce, &batch, &mut LiveProcesses).await {
                    tracing::warn!("device probes: {e:#}");
                }
            }
            _ = poll.tick() => {
                polls += 1;
                if let Some(sig) = crate::stop::requested() {
                    break early(sig);
                }
                if let Some(t) = target && !procfs::is_alive(t) {
                    break StopReason::TargetExited;
                }
                if stages.failed() {
                    break StopReason::Failed;
                }
                probes.flush_log();
                if let Some(level) = level_schedule.take_due(started.elapsed())
                    && let Err(e) = change_device_level(device, probes, &stages.announce, level).await
                {
                    tracing::warn!("device probes: switching to level {level}: {e:#}");
                }
                if target.is_some()
                    && polls.is_multiple_of(DEVICE_SCAN_EVERY)
                    && let Err(e) = scan_devices(device, probes, &stages.announce).await
                {
                    tracing::warn!("device probes: {e:#}");
                }
                send_drops(probes, drops_seen, &stages.tx).await;
                if polls.is_multiple_of(STATUS_EVERY) {
                    let consumed = stages.collect_counters.total_consumed();
                    let drops: u64 = drops_seen.iter().sum();
                    let lagged = stages.trace.counters.dropped() + stages.summary.counters.dropped();
                    let traced = match (target, cfg.system_wide) {
                        (None, true) => "all processes".to_string(),
                        _ => format!("processes {}", probes.targets().len()),
                    };
                    let line = format!(
                        "xpuscope: {:>6.1}s  {:>8.1}k events/s  drops {}{}  {traced}",
                        started.elapsed().as_secs_f64(),
                        (consumed - last_consumed) as f64 / 1e3 / (POLL * STATUS_EVERY).as_secs_f64(),
                        drops,
                        if lagged > 0 { format!(" (+{lagged} records behind sinks)") } else { String::new() },
                    );
                    last_consumed = consumed;
                    if tty { eprint!("\r{line}   ") } else { eprintln!("{line}") }
                }
            }
        }
    };
    if tty {
        eprintln!();
    }
    Ok(reason)
}

/// Stops collect (after it drained the rings), lets the pipeline end every
/// sink, and collects what each stage hands back. A trace whose writing
/// failed is cut back to its last complete packet: still a valid file.
async fn stop(stages: Stages, cfg: &AttachConfig) -> Result<Finished> {
    let Stages {
        tx,
        announce,
        stop_collect,
        collect,
        collect_counters,
        pipeline,
        trace,
        summary,
        detect,
        health,
    } = stages;
    // Its last readings reach the pipeline before the end.
    let health_reports = tokio::task::spawn_blocking(move || health.stop()).await?;
    let _ = stop_collect.send(true);
    let collect_result = collect
        .await
        .map_err(|e| anyhow!("the collect stage panicked: {e}"));
    drop(tx);
    drop(announce);
    let pipeline_result = tokio::task::spawn_blocking(move || pipeline.join())
        .await?
        .map_err(|p| {
            anyhow!(
                "the pipeline panicked: {}",
                crate::sinks::panic_message(&*p)
            )
        })
        .and_then(|r| r);
    let sinks = vec![trace.report(), summary.report(), detect.report()];
    let (trace_result, summary_result, detect_result) =
        tokio::task::spawn_blocking(move || (trace.join(), summary.join(), detect.join())).await?;
    let written = match trace_result {
        Ok(w) => w,
        Err(e) => return Err(cut_trace(e, cfg)),
    };
    let file = written
        .out
        .into_inner()
        .map_err(|e| e.into_error())
        .context("flushing the trace");
    let file = match file {
        Ok(f) => f,
        Err(e) => return Err(cut_trace(e, cfg)),
    };
    file.sync_all().context("syncing the trace file")?;
    // The pipeline's error first: a panic there also cancels collect.
    let interpret = pipeline_result?;
    collect_result??;
    let totals = summary_result?;
    let findings = detect_result?;
    Ok(Finished {
        consumed: collect_counters
            .consumed
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect(),
        decode_errors: collect_counters.decode_errors.load(Ordering::Relaxed),
        interpret,
        totals,
        sinks,
        bytes: written.bytes,
        findings,
        health: health_reports,
    })
}

/// A full disk or a quota: keep what was written, as a valid file.
fn cut_trace(e: anyhow::Error, cfg: &AttachConfig) -> anyhow::Error {
    match crate::trace_file::cut_to_complete_packets(&cfg.output) {
        Ok(n) => e.context(format!(
            "writing the trace failed; {} was cut back to its last complete packet \
             ({n} bytes) and is still a valid trace; free space or choose another \
             path with -o",
            cfg.output.display()
        )),
        Err(cut) => e.context(format!(
            "writing the trace failed, and {} could not be repaired ({cut})",
            cfg.output.display()
        )),
    }
}

/// Re-reads the traced processes' libraries; announces new probes to the
/// pipeline, then attaches them.
async fn scan_devices(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &Announcements,
) -> Result<()> {
    let plan = device.plan(&probes.targets(), &mut LiveProcesses);
    announce_and_apply(device, probes, tx, plan).await
}

/// Switches the device capture level of the running recording (the
/// service's control API will call this too).
async fn change_device_level(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &Announcements,
    level: DeviceLevel,
) -> Result<()> {
    tracing::info!(
        "device probes: capture level {} -> {level}",
        device.levels().device
    );
    let plan = device.set_device_level(level, &mut LiveProcesses);
    announce_and_apply(device, probes, tx, plan).await
}

/// Testing aid: the traced set now, on stderr (a long run must leave only
/// the live processes there).
fn report_targets(kernel: &impl KernelControl) {
    let mut pids = kernel.targets();
    pids.sort_unstable();
    let shown: Vec<String> = pids.iter().take(16).map(u32::to_string).collect();
    eprintln!(
        "xpuscope: traced set at stop: {} processes: {}{}",
        pids.len(),
        shown.join(" "),
        if pids.len() > shown.len() { " ..." } else { "" }
    );
}
