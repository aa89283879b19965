//! GPU health: a thread that reads the host's NVML every interval (SM
//! clock, clock-event reasons, utilization, memory, ECC errors, the compute
//! processes on each GPU) and drains its Xid events, and hands the
//! readings to the pipeline as [`Record`]s (one place turns NVML's values
//! into records: [`sample`]). Per GPU, never per process: the processes a
//! sample lists are joined to ranks by the sinks, through the identities
//! they already keep (and drop at exit).
//!
//! No NVML on the host (no driver, no GPU): no error and no readings; the
//! run's summary says GPU health was unavailable and why.
//!
//! ```text
//!  sampler thread --(bounded; a full queue drops the reading, counted)--> pipeline
//! ```

pub mod nvml;
pub mod sample;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;

use crate::model::Record;

/// The library a host's NVIDIA driver installs.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// Names the NVML library to load instead (a path or a file name).
pub const NVML_LIBRARY_ENV: &str = "XPUSCOPE_NVML_LIBRARY";
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Readings queued for the pipeline at most (a few seconds of 64 GPUs).
const QUEUE: usize = 1024;
/// Xid events taken per 50 ms tick at most.
const MAX_XIDS_PER_TICK: usize = 256;

/// What to read, how often.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthConfig {
    /// The NVML library to load.
    pub library: PathBuf,
    /// Between two readings; zero turns GPU health off.
    pub interval: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            library: PathBuf::from(DEFAULT_NVML_LIBRARY),
            interval: DEFAULT_INTERVAL,
        }
    }
}

impl HealthConfig {
    /// The default, with the library from [`NVML_LIBRARY_ENV`] when set.
    pub fn from_env() -> Self {
        let mut c = Self::default();
        if let Some(lib) = std::env::var_os(NVML_LIBRARY_ENV).filter(|v| !v.is_empty()) {
            c.library = PathBuf::from(lib);
        }
        c
    }
}

/// What GPU health gave, for the summary and the stats JSON.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HealthReport {
    /// NVML was loaded and initialized.
    pub available: bool,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    /// The library it came from.
    pub library: String,
    pub gpus: u32,
    pub samples: u64,
    pub xid_events: u64,
    /// Readings lost because the pipeline's queue was full.
    pub dropped: u64,
}

impl HealthReport {
    /// The summary's line.
    pub fn line(&self) -> String {
        match &self.unavailable {
            Some(why) => format!("GPU health: unavailable ({why})"),
            None => format!(
                "GPU health: {} GPUs from {}, {} samples, {} Xid events{}",
                self.gpus,
                self.library,
                self.samples,
                self.xid_events,
                if self.dropped > 0 {
                    format!(", {} readings dropped", self.dropped)
                } else {
                    String::new()
                }
            ),
        }
    }
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    samples: AtomicU64,
    xids: AtomicU64,
    dropped: AtomicU64,
    report: Mutex<HealthReport>,
}

/// The running sampler.
pub struct HealthSampler {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Starts the sampler; its records come out of the returned receiver
/// (the pipeline drains it). With a zero interval nothing starts and the
/// report says GPU health is off.
pub fn start(cfg: &HealthConfig) -> (HealthSampler, Receiver<Record>) {
    let (tx, rx) = sync_channel(QUEUE);
    let shared = Arc::new(Shared::default());
    let library = cfg.library.display().to_string();
    if let Ok(mut r) = shared.report.lock() {
        r.library = library.clone();
    }
    if cfg.interval.is_zero() {
        if let Ok(mut r) = shared.report.lock() {
            r.unavailable = Some("turned off: --gpu-health-interval 0".into());
        }
        return (
            HealthSampler {
                shared,
                thread: None,
            },
            rx,
        );
    }
    let cfg = cfg.clone();
    let s = shared.clone();
    let thread = std::thread::Builder::new()
        .name("xpuscope-health".into())
        .spawn(move || run(&cfg, &s, &tx))
        .inspect_err(|e| {
            if let Ok(mut r) = shared.report.lock() {
                r.unavailable = Some(format!("the sampler thread could not start: {e}"));
            }
        })
        .ok();
    (HealthSampler { shared, thread }, rx)
}

/// The sampler thread's body.
fn run(cfg: &HealthConfig, shared: &Shared, tx: &SyncSender<Record>) {
    let nvml = match nvml::Nvml::open(&cfg.library) {
        Ok(n) => n,
        Err(e) => {
            tracing::info!("GPU health unavailable: {e}");
            if let Ok(mut r) = shared.report.lock() {
                r.unavailable = Some(e.to_string());
            }
            return;
        }
    };
    if let Ok(mut r) = shared.report.lock() {
        r.available = true;
        r.gpus = nvml.gpus();
    }
    let mut reader = sample::Reader::new(&nvml);
    let send = |r: Record| match tx.try_send(r) {
        Ok(()) => true,
        Err(TrySendError::Full(_)) => {
            shared.dropped.fetch_add(1, Ordering::Relaxed);
            true
        }
        Err(TrySendError::Disconnected(_)) => false,
    };
    let tick = Duration::from_millis(50).min(cfg.interval);
    let mut next = std::time::Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        if std::time::Instant::now() >= next {
            next += cfg.interval;
            for s in reader.samples(&nvml, crate::host::boottime_ns()) {
                shared.samples.fetch_add(1, Ordering::Relaxed);
                if !send(Record::GpuSample(Box::new(s))) {
                    return;
                }
            }
        }
        // Xid events between samples, stamped when seen; a bounded number
        // per tick (a library that never runs dry cannot hold the thread).
        for _ in 0..MAX_XIDS_PER_TICK {
            let Some(x) = reader.next_xid(&nvml, crate::host::boottime_ns()) else {
                break;
            };
            shared.xids.fetch_add(1, Ordering::Relaxed);
            if !send(Record::GpuXid(x)) {
                return;
            }
        }
        std::thread::sleep(tick);
    }
}

impl HealthSampler {
    /// Stops the thread (at most one tick's wait) and reports.
    pub fn stop(mut self) -> HealthReport {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut r = self
            .shared
            .report
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        r.samples = self.shared.samples.load(Ordering::Relaxed);
        r.xid_events = self.shared.xids.load(Ordering::Relaxed);
        r.dropped = self.shared.dropped.load(Ordering::Relaxed);
        r
    }
}

impl Drop for HealthSampler {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_library_means_a_clear_line_and_no_records() {
        let cfg = HealthConfig {
            library: PathBuf::from("/nonexistent/libnvidia-ml.so.1"),
            interval: Duration::from_millis(10),
        };
        let (sampler, rx) = start(&cfg);
        std::thread::sleep(Duration::from_millis(50));
        let report = sampler.stop();
        assert!(!report.available);
        assert!(rx.try_recv().is_err(), "no records without NVML");
        let line = report.line();
        assert!(
            line.starts_with(
                "GPU health: unavailable (/nonexistent/libnvidia-ml.so.1 could not be loaded"
            ),
            "{line}"
        );
    }

    #[test]
    fn a_zero_interval_turns_it_off() {
        let (sampler, _rx) = start(&HealthConfig {
            interval: Duration::ZERO,
            ..HealthConfig::default()
        });
        let r = sampler.stop();
        assert_eq!(
            r.line(),
            "GPU health: unavailable (turned off: --gpu-health-interval 0)"
        );
    }
}
