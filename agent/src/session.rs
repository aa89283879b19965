//! One recording, from checks to the finished trace: the supervisor that
//! starts the stages in order (load and attach -> reader -> trace writer),
//! stops them on the duration, Ctrl-C/SIGTERM or the target's exit, and
//! always finishes the trace file.

use std::fs::File;
use std::io::BufWriter;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use xpuscope_common::Config;
use xpuscope_perfetto::TraceWriter;

use crate::btf::{self, Btf};
use crate::config::{AttachConfig, StackPolicy};
use crate::events::Event;
use crate::kernel::probes::{AyaDeviceProbes, DeviceProbes, LiveProcesses, Plan, TableUpdate};
use crate::kernel::{CaptureLevels, DeviceLevel, EBPF_OBJECT, Kernel, KernelControl, LoadOptions};
use crate::reader::{Reader, ReaderCounters};
use crate::summary::{RunSummary, StopReason};
use crate::trace::{TraceBuilder, TraceStats};
use crate::{host, preflight, procfs};

/// Messages to the trace stage.
pub enum Msg {
    Events(Vec<Event>),
    /// Per-CPU drop totals changed: the CPUs with new drops, and the total.
    Drops {
        ts: u64,
        cpus: Vec<u32>,
        total: u64,
    },
    /// Device-library probes about to be attached (sent before they can
    /// fire, so every hit finds its meaning).
    Probes(TableUpdate),
}

/// Channel depth between reader and trace stage, in batches.
/// The kernel ring buffer is the real buffer; this only smooths hand-offs
/// (each batch holds up to 4096 decoded events, about 400 KiB).
const CHANNEL_BATCHES: usize = 16;
const POLL: Duration = Duration::from_millis(100);
const STATUS_EVERY: u32 = 10;
const CLOCK_SNAPSHOT_EVERY: Duration = Duration::from_secs(10);
/// Polls between re-scans of the traced processes' libraries (dlopen).
const DEVICE_SCAN_EVERY: u32 = 5;

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

async fn record(
    cfg: AttachConfig,
    target: Option<u32>,
    offsets: xpuscope_common::TaskOffsets,
    file: File,
) -> Result<RunSummary> {
    let levels = CaptureLevels {
        device: DeviceLevel::new(cfg.probe_level)?,
    };
    let kernel_config = Config {
        system_wide: cfg.system_wide as u32,
        stack_mode: cfg.stacks.kernel_mode(),
        stack_rate: cfg.stack_rate,
        stack_burst: cfg.stack_burst,
        wakeup_bytes: (cfg.ring_bytes / 4) as u64,
        device_wakeup_bytes: (cfg.device_ring_bytes / 4) as u64,
        probe_levels: levels.device.mask(),
        _pad: 0,
    };
    let mut probes = Kernel::load_and_attach(&LoadOptions {
        offsets,
        ring_bytes: cfg.ring_bytes,
        device_ring_bytes: cfg.device_ring_bytes,
        config: kernel_config,
        kernel_btf: &cfg.kernel_btf,
    })?;
    // Programs are attached (forks are followed) before the process tree is
    // read, so no child can slip between the two.
    if let Some(t) = target {
        for pid in procfs::with_descendants(t) {
            probes.add_target(pid)?;
        }
    }
    let start_ts = host::boottime_ns();
    let pids: Vec<u32> = if cfg.system_wide {
        procfs::all_pids()
    } else {
        probes.targets()
    };
    let processes: Vec<procfs::ProcessEntry> =
        pids.into_iter().filter_map(procfs::process).collect();
    let initial_threads: usize = processes.iter().map(|p| p.threads.len()).sum();

    let counters = Arc::new(ReaderCounters::default());
    let (tx, rx) = mpsc::channel::<Msg>(CHANNEL_BATCHES);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (sched_ring, device_ring) = probes.take_rings()?;
    let reader = Reader {
        sched: sched_ring,
        device: device_ring,
        out: tx.clone(),
        counters: counters.clone(),
        drain_interval: cfg.drain_interval,
        delay: cfg.reader_delay,
    };
    let reader_task = tokio::spawn(reader.run(stop_rx));
    let writer_thread = std::thread::Builder::new()
        .name("xpuscope-trace".into())
        .spawn(move || write_trace(file, rx, start_ts, processes))
        .context("starting the trace writer")?;

    // Device libraries already mapped are probed before the start line, so
    // a caller waiting for it sees their calls from then on.
    let mut device = DeviceProbes::new(levels, cfg.stacks != StackPolicy::Off);
    let mut level_schedule = cfg.level_schedule.clone();
    if target.is_some()
        && let Err(e) = scan_devices(&mut device, &mut probes, &tx).await
    {
        tracing::warn!("device probes: {e:#}");
    }

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

    let started = Instant::now();
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let deadline = cfg.duration.map(|d| tokio::time::Instant::now() + d);
    let mut poll = tokio::time::interval(POLL);
    let mut polls = 0u32;
    let mut drops_seen = vec![0u64; host::possible_cpus()];
    let mut last_consumed = 0u64;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let reason = loop {
        tokio::select! {
            _ = sigint.recv() => break StopReason::Interrupted,
            _ = sigterm.recv() => break StopReason::Terminated,
            _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await },
                if deadline.is_some() => break StopReason::Duration,
            _ = poll.tick() => {
                polls += 1;
                if let Some(t) = target && !procfs::is_alive(t) {
                    break StopReason::TargetExited;
                }
                if writer_thread.is_finished() || reader_task.is_finished() {
                    break StopReason::Failed;
                }
                probes.flush_log();
                if let Some(level) = level_schedule.take_due(started.elapsed())
                    && let Err(e) = change_device_level(&mut device, &mut probes, &tx, level).await
                {
                    tracing::warn!("device probes: switching to level {level}: {e:#}");
                }
                if target.is_some()
                    && polls.is_multiple_of(DEVICE_SCAN_EVERY)
                    && let Err(e) = scan_devices(&mut device, &mut probes, &tx).await
                {
                    tracing::warn!("device probes: {e:#}");
                }
                send_drops(&probes, &mut drops_seen, &tx).await;
                if polls.is_multiple_of(STATUS_EVERY) {
                    let consumed = counters.total_consumed();
                    let drops: u64 = drops_seen.iter().sum();
                    let line = format!(
                        "xpuscope: {:>6.1}s  {:>8.1}k events/s  drops {}  processes {}",
                        started.elapsed().as_secs_f64(),
                        (consumed - last_consumed) as f64 / 1e3 / (POLL * STATUS_EVERY).as_secs_f64(),
                        drops,
                        probes.targets().len(),
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

    if cfg.report_targets {
        report_targets(&probes);
    }
    // Detach first, then drain: everything produced is then either consumed
    // or counted as dropped.
    let kernel_skips = probes.kernel_skips();
    let device_hits = device.hits(&probes.attacher());
    device.detach_all(&mut probes.attacher());
    probes.detach_all();
    send_drops(&probes, &mut drops_seen, &tx).await;
    let mut drops_by_kind = probes.drops_by_kind();
    for (slot, skipped) in kernel_skips.iter().enumerate() {
        drops_by_kind[slot] += skipped;
    }
    let _ = stop_tx.send(true);
    let reader_result = reader_task
        .await
        .map_err(|e| anyhow!("reader task panicked: {e}"))?;
    drop(tx);
    drop(probes);
    let writer_result = tokio::task::spawn_blocking(move || writer_thread.join())
        .await?
        .map_err(|_| anyhow!("the trace writer panicked"))?;
    let (stats, bytes) = match writer_result {
        Ok(done) => done,
        Err(e) => {
            // A full disk or a quota: keep what was written, as a valid file.
            let kept = crate::trace_file::cut_to_complete_packets(&cfg.output);
            return Err(match kept {
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
            });
        }
    };
    reader_result?;

    let consumed: Vec<u64> = counters
        .consumed
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect();
    let mut summary = RunSummary::new(
        &cfg,
        reason,
        started.elapsed(),
        &consumed,
        &drops_by_kind,
        counters.decode_errors.load(Ordering::Relaxed),
        bytes,
        stats,
    );
    summary.set_device_probes(device.stats());
    summary.set_device_hits(&device_hits);
    summary.kernel_skipped = kernel_skips.iter().sum();
    Ok(summary)
}

/// Re-reads the traced processes' libraries; announces new probes to the
/// trace stage, then attaches them.
async fn scan_devices(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &mpsc::Sender<Msg>,
) -> Result<()> {
    let plan = device.plan(&probes.targets(), &mut LiveProcesses);
    announce_and_apply(device, probes, tx, plan).await
}

/// Switches the device capture level of the running recording.
async fn change_device_level(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &mpsc::Sender<Msg>,
    level: DeviceLevel,
) -> Result<()> {
    tracing::info!(
        "device probes: capture level {} -> {level}",
        device.levels().device
    );
    let plan = device.set_device_level(level, &mut LiveProcesses);
    announce_and_apply(device, probes, tx, plan).await
}

/// Sends a plan's table updates to the trace stage, then applies it.
async fn announce_and_apply(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &mpsc::Sender<Msg>,
    mut plan: Plan,
) -> Result<()> {
    if plan.is_empty() {
        return Ok(());
    }
    for update in std::mem::take(&mut plan.updates) {
        tx.send(Msg::Probes(update))
            .await
            .map_err(|_| anyhow!("the trace stage stopped"))?;
    }
    Ok(device.apply(&mut probes.attacher(), plan)?)
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

/// Sends new per-CPU drops to the trace stage.
async fn send_drops(probes: &impl KernelControl, seen: &mut [u64], tx: &mpsc::Sender<Msg>) {
    let per_kind = probes.drops();
    let mut per_cpu = vec![0u64; seen.len()];
    for (slot, cpus) in per_kind.iter().enumerate() {
        if slot as u32 == xpuscope_common::DROP_SLOT_STACK_ERRORS {
            continue; // stacks that failed inside a written record: not lost records
        }
        for (cpu, n) in cpus.iter().enumerate() {
            if let Some(c) = per_cpu.get_mut(cpu) {
                *c += n;
            }
        }
    }
    let changed: Vec<u32> = (0..seen.len())
        .filter(|&c| per_cpu[c] > seen[c])
        .map(|c| c as u32)
        .collect();
    if changed.is_empty() {
        return;
    }
    seen.copy_from_slice(&per_cpu);
    let total = per_cpu.iter().sum();
    let _ = tx
        .send(Msg::Drops {
            ts: host::boottime_ns(),
            cpus: changed,
            total,
        })
        .await;
}

/// The trace stage's thread: writes the header, then every event, then
/// finishes the file.
fn write_trace(
    file: File,
    mut rx: mpsc::Receiver<Msg>,
    start_ts: u64,
    processes: Vec<procfs::ProcessEntry>,
) -> Result<(TraceStats, u64)> {
    let out = BufWriter::with_capacity(1 << 20, file);
    let mut builder = TraceBuilder::new(TraceWriter::new(out));
    builder.writer().system_info(&host::system_info())?;
    builder.writer().clock_snapshot(&host::clock_snapshot())?;
    builder.initial_processes(start_ts, &processes)?;
    let mut last_snapshot = Instant::now();
    while let Some(msg) = rx.blocking_recv() {
        match msg {
            Msg::Events(events) => {
                for event in events {
                    builder.handle(event)?;
                }
            }
            Msg::Drops { ts, cpus, total } => builder.drops(ts, &cpus, total)?,
            Msg::Probes(update) => builder.probes_added(update)?,
        }
        if last_snapshot.elapsed() >= CLOCK_SNAPSHOT_EVERY {
            builder.writer().clock_snapshot(&host::clock_snapshot())?;
            last_snapshot = Instant::now();
        }
    }
    let end = host::boottime_ns();
    builder.writer().clock_snapshot(&host::clock_snapshot())?;
    let (out, stats, bytes) = builder.finish(end)?;
    let file = out
        .into_inner()
        .map_err(|e| e.into_error())
        .context("flushing the trace")?;
    file.sync_all().context("syncing the trace file")?;
    Ok((stats, bytes))
}
