//! Device health: a thread that reads the host's management libraries
//! every interval and hands the readings to the pipeline as [`Record`]s:
//! NVML for NVIDIA GPUs (SM clock, clock-event reasons, utilization,
//! memory, ECC errors, the compute processes on each GPU, and its Xid
//! events, drained between readings) and DCMI for Ascend NPUs (AI Core
//! frequency, utilization, HBM, health, the error codes each NPU lists and
//! the processes on it); either, or both when both are installed. One place
//! turns each library's values into records: [`sample`]. Per device, never
//! per process: the processes a sample lists are joined to ranks by the
//! sinks, through the identities they already keep (and drop at exit).
//!
//! No library on the host (no driver, no device): no error and no
//! readings; the run's summary says which health source was unavailable
//! and why.
//!
//! ```text
//!  sampler thread --(bounded; a full queue drops the reading, counted)--> pipeline
//!    |- NVML source (GPUs)
//!    '- DCMI source (NPUs)
//! ```

pub mod dcmi;
pub mod nvml;
pub mod sample;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;

use crate::model::Record;
use crate::model::gpu::{GpuSample, GpuXid, Vendor};

/// The library a host's NVIDIA driver installs.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// Names the NVML library to load instead (a path or a file name).
pub const NVML_LIBRARY_ENV: &str = "XPUSCOPE_NVML_LIBRARY";
/// Where the Ascend driver installs DCMI, tried in order when no library
/// is named: the loader's search path first, then the driver's two
/// install directories (not on the loader's path by default).
pub const DEFAULT_DCMI_LIBRARIES: [&str; 3] = [
    "libdcmi.so",
    "/usr/local/Ascend/driver/lib64/driver/libdcmi.so",
    "/usr/local/Ascend/driver/lib64/common/libdcmi.so",
];
/// Names the DCMI library to load instead (a path or a file name).
pub const DCMI_LIBRARY_ENV: &str = "XPUSCOPE_DCMI_LIBRARY";
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Readings queued for the pipeline at most (a few seconds of 64 devices).
const QUEUE: usize = 1024;
/// Xid events taken per 50 ms tick at most.
const MAX_XIDS_PER_TICK: usize = 256;

/// What to read, how often.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthConfig {
    /// The NVML library to load.
    pub library: PathBuf,
    /// The DCMI library to load; `None`: the first of
    /// [`DEFAULT_DCMI_LIBRARIES`] that loads.
    pub dcmi_library: Option<PathBuf>,
    /// Between two readings; zero turns device health off.
    pub interval: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            library: PathBuf::from(DEFAULT_NVML_LIBRARY),
            dcmi_library: None,
            interval: DEFAULT_INTERVAL,
        }
    }
}

impl HealthConfig {
    /// The default, with the libraries from [`NVML_LIBRARY_ENV`] and
    /// [`DCMI_LIBRARY_ENV`] when set.
    pub fn from_env() -> Self {
        let mut c = Self::default();
        if let Some(lib) = std::env::var_os(NVML_LIBRARY_ENV).filter(|v| !v.is_empty()) {
            c.library = PathBuf::from(lib);
        }
        c.dcmi_library = std::env::var_os(DCMI_LIBRARY_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        c
    }
}

/// What one health source (NVML or DCMI) gave, for the summary and the
/// stats JSON. The same fields for both: `gpus` counts the source's
/// devices (NPUs for DCMI), `xid_events` its device errors (DCMI's error
/// codes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HealthReport {
    #[serde(skip)]
    pub vendor: Vendor,
    /// The library was loaded and initialized.
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
    fn of(vendor: Vendor) -> Self {
        Self {
            vendor,
            ..Self::default()
        }
    }

    /// The summary's line.
    pub fn line(&self) -> String {
        let device = self.vendor.device();
        match &self.unavailable {
            Some(why) => format!("{device} health: unavailable ({why})"),
            None => format!(
                "{device} health: {} {device}s from {}, {} samples, {} {}{}",
                self.gpus,
                self.library,
                self.samples,
                self.xid_events,
                match self.vendor {
                    Vendor::Nvidia => "Xid events",
                    Vendor::Ascend => "error codes",
                },
                if self.dropped > 0 {
                    format!(", {} readings dropped", self.dropped)
                } else {
                    String::new()
                }
            ),
        }
    }
}

/// Both sources' reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReports {
    /// NVML's (GPUs).
    pub gpu: HealthReport,
    /// DCMI's (NPUs).
    pub npu: HealthReport,
}

impl Default for HealthReports {
    fn default() -> Self {
        Self {
            gpu: HealthReport::of(Vendor::Nvidia),
            npu: HealthReport::of(Vendor::Ascend),
        }
    }
}

/// One source's counts, kept apart so each report says what its library
/// gave.
#[derive(Default)]
struct Counts {
    samples: AtomicU64,
    errors: AtomicU64,
    dropped: AtomicU64,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    gpu: Counts,
    npu: Counts,
    reports: Mutex<HealthReports>,
}

impl Shared {
    fn counts(&self, vendor: Vendor) -> &Counts {
        match vendor {
            Vendor::Nvidia => &self.gpu,
            Vendor::Ascend => &self.npu,
        }
    }

    fn report(&self, vendor: Vendor, f: impl FnOnce(&mut HealthReport)) {
        if let Ok(mut r) = self.reports.lock() {
            f(match vendor {
                Vendor::Nvidia => &mut r.gpu,
                Vendor::Ascend => &mut r.npu,
            });
        }
    }
}

/// The running sampler.
pub struct HealthSampler {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Starts the sampler; its records come out of the returned receiver
/// (the pipeline drains it). With a zero interval nothing starts and the
/// reports say device health is off.
pub fn start(cfg: &HealthConfig) -> (HealthSampler, Receiver<Record>) {
    let (tx, rx) = sync_channel(QUEUE);
    let shared = Arc::new(Shared::default());
    shared.report(Vendor::Nvidia, |r| {
        r.library = cfg.library.display().to_string()
    });
    shared.report(Vendor::Ascend, |r| {
        r.library = match &cfg.dcmi_library {
            Some(p) => p.display().to_string(),
            None => DEFAULT_DCMI_LIBRARIES[0].to_owned(),
        }
    });
    if cfg.interval.is_zero() {
        for v in [Vendor::Nvidia, Vendor::Ascend] {
            shared.report(v, |r| {
                r.unavailable = Some("turned off: --gpu-health-interval 0".into())
            });
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
            for v in [Vendor::Nvidia, Vendor::Ascend] {
                shared.report(v, |r| {
                    r.unavailable = Some(format!("the sampler thread could not start: {e}"))
                });
            }
        })
        .ok();
    (HealthSampler { shared, thread }, rx)
}

/// A management library the sampler reads: its devices' readings each
/// interval, in the order the pipeline should see them, and errors raised
/// between readings.
enum Source {
    Nvml(nvml::Nvml, sample::Reader),
    Dcmi(dcmi::Dcmi, sample::DcmiReader),
}

impl Source {
    fn vendor(&self) -> Vendor {
        match self {
            Source::Nvml(..) => Vendor::Nvidia,
            Source::Dcmi(..) => Vendor::Ascend,
        }
    }

    /// The devices' readings now. DCMI's error codes come before its
    /// samples: a health alarm a sample shows is then known to come with
    /// its error code.
    fn read(&mut self, ts: u64) -> (Vec<GpuXid>, Vec<GpuSample>) {
        match self {
            Source::Nvml(nvml, reader) => (Vec::new(), reader.samples(nvml, ts)),
            Source::Dcmi(dcmi, reader) => {
                let (samples, errors) = reader.samples(dcmi, ts);
                (errors, samples)
            }
        }
    }

    /// An error raised since the last call (NVML's Xid events; DCMI lists
    /// its error codes with each reading instead).
    fn next_error(&mut self, ts: u64) -> Option<GpuXid> {
        match self {
            Source::Nvml(nvml, reader) => reader.next_xid(nvml, ts),
            Source::Dcmi(..) => None,
        }
    }
}

/// NVML, or why not.
fn open_nvml(path: &Path) -> Result<Source, String> {
    let nvml = nvml::Nvml::open(path).map_err(|e| e.to_string())?;
    let reader = sample::Reader::new(&nvml);
    Ok(Source::Nvml(nvml, reader))
}

/// DCMI from the named library, or the first default that loads; or why
/// not. The library loaded, for the report.
fn open_dcmi(path: Option<&Path>) -> Result<(Source, String), String> {
    let open = |p: &Path| {
        dcmi::Dcmi::open(p).map(|d| {
            let reader = sample::DcmiReader::new(&d);
            (Source::Dcmi(d, reader), p.display().to_string())
        })
    };
    if let Some(p) = path {
        return open(p).map_err(|e| e.to_string());
    }
    let mut not_loaded = Vec::new();
    for candidate in DEFAULT_DCMI_LIBRARIES {
        match open(Path::new(candidate)) {
            Ok(s) => return Ok(s),
            // Found but failing (no device, a driver error): that is why.
            Err(e @ (dcmi::DcmiError::Call { .. } | dcmi::DcmiError::Missing { .. })) => {
                return Err(e.to_string());
            }
            Err(dcmi::DcmiError::Load { .. }) => not_loaded.push(candidate),
        }
    }
    Err(format!(
        "libdcmi.so not found (tried {})",
        not_loaded.join(", ")
    ))
}

/// The sampler thread's body.
fn run(cfg: &HealthConfig, shared: &Shared, tx: &SyncSender<Record>) {
    let mut sources = Vec::new();
    let opened = [
        (Vendor::Nvidia, open_nvml(&cfg.library).map(|s| (s, None))),
        (
            Vendor::Ascend,
            open_dcmi(cfg.dcmi_library.as_deref()).map(|(s, lib)| (s, Some(lib))),
        ),
    ];
    for (vendor, source) in opened {
        match source {
            Ok((source, library)) => {
                let devices = match &source {
                    Source::Nvml(n, _) => n.gpus(),
                    Source::Dcmi(d, _) => d.npus(),
                };
                shared.report(vendor, |r| {
                    r.available = true;
                    r.gpus = devices;
                    if let Some(lib) = library {
                        r.library = lib;
                    }
                });
                sources.push(source);
            }
            Err(why) => {
                tracing::info!("{} health unavailable: {why}", vendor.device());
                shared.report(vendor, |r| r.unavailable = Some(why));
            }
        }
    }
    if sources.is_empty() {
        return;
    }
    let send = |vendor: Vendor, r: Record| match tx.try_send(r) {
        Ok(()) => true,
        Err(TrySendError::Full(_)) => {
            shared
                .counts(vendor)
                .dropped
                .fetch_add(1, Ordering::Relaxed);
            true
        }
        Err(TrySendError::Disconnected(_)) => false,
    };
    let tick = Duration::from_millis(50).min(cfg.interval);
    let mut next = std::time::Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        let due = std::time::Instant::now() >= next;
        if due {
            next += cfg.interval;
        }
        for source in &mut sources {
            let vendor = source.vendor();
            let counts = shared.counts(vendor);
            if due {
                let (errors, samples) = source.read(crate::host::boottime_ns());
                for e in errors {
                    counts.errors.fetch_add(1, Ordering::Relaxed);
                    if !send(vendor, Record::GpuXid(e)) {
                        return;
                    }
                }
                for s in samples {
                    counts.samples.fetch_add(1, Ordering::Relaxed);
                    if !send(vendor, Record::GpuSample(Box::new(s))) {
                        return;
                    }
                }
            }
            // Errors between samples, stamped when seen; a bounded number
            // per tick (a library that never runs dry cannot hold the
            // thread).
            for _ in 0..MAX_XIDS_PER_TICK {
                let Some(x) = source.next_error(crate::host::boottime_ns()) else {
                    break;
                };
                counts.errors.fetch_add(1, Ordering::Relaxed);
                if !send(vendor, Record::GpuXid(x)) {
                    return;
                }
            }
        }
        std::thread::sleep(tick);
    }
}

impl HealthSampler {
    /// Stops the thread (at most one tick's wait) and reports.
    pub fn stop(mut self) -> HealthReports {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut r = self
            .shared
            .reports
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        for (report, counts) in [
            (&mut r.gpu, &self.shared.gpu),
            (&mut r.npu, &self.shared.npu),
        ] {
            report.samples = counts.samples.load(Ordering::Relaxed);
            report.xid_events = counts.errors.load(Ordering::Relaxed);
            report.dropped = counts.dropped.load(Ordering::Relaxed);
        }
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
            dcmi_library: Some(PathBuf::from("/nonexistent/libdcmi.so")),
            interval: Duration::from_millis(10),
        };
        let (sampler, rx) = start(&cfg);
        std::thread::sleep(Duration::from_millis(50));
        let report = sampler.stop();
        assert!(!report.gpu.available && !report.npu.available);
        assert!(rx.try_recv().is_err(), "no records without a library");
        let line = report.gpu.line();
        assert!(
            line.starts_with(
                "GPU health: unavailable (/nonexistent/libnvidia-ml.so.1 could not be loaded"
            ),
            "{line}"
        );
        let line = report.npu.line();
        assert!(
            line.starts_with(
                "NPU health: unavailable (/nonexistent/libdcmi.so could not be loaded"
            ),
            "{line}"
        );
    }

    #[test]
    fn without_a_named_dcmi_the_driver_s_places_are_tried() {
        match open_dcmi(None) {
            // A host with the Ascend driver: one of its places.
            Ok((_, library)) => assert!(
                DEFAULT_DCMI_LIBRARIES.contains(&library.as_str()),
                "{library}"
            ),
            Err(e) => assert_eq!(
                e,
                format!(
                    "libdcmi.so not found (tried {})",
                    DEFAULT_DCMI_LIBRARIES.join(", ")
                )
            ),
        }
    }

    #[test]
    fn a_zero_interval_turns_it_off() {
        let (sampler, _rx) = start(&HealthConfig {
            interval: Duration::ZERO,
            ..HealthConfig::default()
        });
        let r = sampler.stop();
        assert_eq!(
            r.gpu.line(),
            "GPU health: unavailable (turned off: --gpu-health-interval 0)"
        );
        assert_eq!(
            r.npu.line(),
            "NPU health: unavailable (turned off: --gpu-health-interval 0)"
        );
    }

    #[test]
    fn an_npu_report_counts_npus_and_error_codes() {
        let r = HealthReport {
            available: true,
            library: "libdcmi.so".into(),
            gpus: 8,
            samples: 40,
            xid_events: 1,
            ..HealthReport::of(Vendor::Ascend)
        };
        assert_eq!(
            r.line(),
            "NPU health: 8 NPUs from libdcmi.so, 40 samples, 1 error codes"
        );
    }
}
