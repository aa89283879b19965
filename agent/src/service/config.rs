//! `agent service`'s configuration: `/etc/xpuscope/agent.toml`.
//!
//! Every key is optional; a missing key takes the default below. A key
//! this file does not know, or a value that does not parse, is an error
//! naming the file, the line and the key (`agent service --check-config`
//! reports it without starting anything).
//!
//! The default file, every key with its default value and what it does;
//! `cargo xtask install` installs it (`deploy/agent.toml`, the one copy):
//!
#![doc = concat!("```toml\n", include_str!("../../../deploy/agent.toml"), "```")]
//!
//! Sizes are bytes as an integer or a string with a suffix (`256k`, `32M`,
//! `4G`); durations are seconds as an integer or a string with a unit
//! (`500ms`, `30s`, `5m`).

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::config::{parse_duration, parse_size};

/// Where `agent service` reads its configuration by default.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/xpuscope/agent.toml";

/// A capture level (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct CaptureLevel(u8);

impl CaptureLevel {
    pub const MAX: u8 = 3;

    pub fn new(level: u8) -> Result<Self, String> {
        if level > Self::MAX {
            return Err(format!(
                "level {level} does not exist; levels are 0 (device calls for metrics), \
                 1 (+ scheduling), 2 (+ launches and copies), 3 (+ activity records and stacks)"
            ));
        }
        Ok(Self(level))
    }

    pub fn get(self) -> u8 {
        self.0
    }
}

impl Default for CaptureLevel {
    fn default() -> Self {
        Self(1)
    }
}

impl fmt::Display for CaptureLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Off-CPU stacks at levels 1 and 2: a per-thread token bucket (level 3
/// takes one at every switch-out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StacksConfig {
    /// Stacks per second per thread, on average.
    pub rate: u32,
    /// Stacks a thread may take at once after a quiet spell.
    pub burst: u32,
}

impl Default for StacksConfig {
    /// A tenth of `agent attach`'s (100 per second, bursts of 20): a
    /// capture costs the switching thread about 10-20 us (the kernel walk,
    /// the frame-pointer walk and the 8 KiB stack copy), which the service,
    /// always on, must not charge the training at every wait. Measured on
    /// the 8-rank simulated job (docs/src/measurements/service.md, "The soak"): 100 per second took half
    /// of the programs' time in the ranks.
    fn default() -> Self {
        Self {
            rate: 10,
            burst: 10,
        }
    }
}

/// The device-library probes' capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbesConfig {
    /// Probe slots handed out at most: one per probed function of each
    /// distinct library file in use (at most `MAX_PROBE_SLOTS` - 1).
    pub slots: u32,
    /// A library file no traced process has used this long has its probes
    /// released (detached, their slots free again).
    pub release_after: Duration,
}

impl Default for ProbesConfig {
    fn default() -> Self {
        Self {
            slots: xpuscope_common::MAX_PROBE_SLOTS - 1,
            release_after: crate::kernel::probes::RELEASE_AFTER,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct FlightRecorderConfig {
    /// The window kept: the last this many seconds of records.
    pub seconds: Duration,
    /// Bound on the records kept (estimated bytes in memory).
    pub max_bytes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct DetectSection {
    /// A blocking call running longer than this is a hang.
    pub hang_timeout: Duration,
    /// A finding triggers a flight-recorder dump.
    pub dump_on_finding: bool,
    /// Thresholds of the host-side detectors.
    pub host: crate::sinks::detect::host_config::HostDetectConfig,
    /// `late_min`, `late_mad_k`, `slow_rank_persist`, `slow_link_ratio`,
    /// `link_min_bytes`, `link_min_ops`.
    pub collective: crate::sinks::detect::collective::CollectiveConfig,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MetricsConfig {
    /// `/metrics` and `/healthz`; None: not served.
    pub listen: Option<SocketAddr>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ControlConfig {
    /// The Unix socket of the control API (mode 0600, or 0660 with `group`).
    pub socket: PathBuf,
    /// A group whose members may use the socket besides root.
    pub group: Option<String>,
    /// A TCP listener for the control API; only with `token_file`.
    pub tcp_listen: Option<SocketAddr>,
    /// The bearer token TCP clients must send.
    pub token_file: Option<PathBuf>,
}

/// A regex over process names, kept with its source text.
#[derive(Clone, Debug)]
pub struct CommPattern(pub regex::Regex);

impl PartialEq for CommPattern {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

/// Which processes are traced besides those mapping a device library.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiscoveryConfig {
    pub comm: Option<CommPattern>,
    pub cgroup_prefix: Vec<String>,
    pub env: Vec<String>,
}

/// The kernel ring buffers' sizes (powers of two). Each ring's pages are
/// mapped into the agent twice (the kernel maps a ring's data twice, back
/// to back, so a record that wraps reads as one), so the resident size
/// shows about twice their sum.
#[derive(Clone, Debug, PartialEq)]
pub struct RingsConfig {
    pub scheduler: u32,
    pub device: u32,
    pub bystander: u32,
}

impl Default for RingsConfig {
    /// Smaller than `agent attach`'s (32M, 2M, 8M): the service traces the
    /// training processes only, never a whole machine's storm, and drains
    /// every 10 ms; 8 MiB of scheduler ring is ~90k records, half a second
    /// of 8 busy ranks at level 1 behind a stalled reader.
    fn default() -> Self {
        Self {
            scheduler: 8 << 20,
            device: crate::config::DEFAULT_DEVICE_RING_BYTES,
            bystander: 4 << 20,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LabelsConfig {
    /// Environment variables naming the job, in order of preference.
    pub job_env: Vec<String>,
}

/// The validated service configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceConfig {
    pub level: CaptureLevel,
    /// Count launches in the kernel below the level that records them
    /// (`launch_counts`). Off by default in the always-on service: the
    /// entry probes cost a launch-heavy job a few percent of its step
    /// (`agent attach`, a diagnosis session, counts them by default).
    pub launch_counts: bool,
    pub flight_recorder: FlightRecorderConfig,
    pub dump_dir: PathBuf,
    pub dump_dir_max_bytes: u64,
    pub max_dumps_per_hour: u32,
    pub detect: DetectSection,
    pub metrics: MetricsConfig,
    pub control: ControlConfig,
    pub discovery: DiscoveryConfig,
    pub labels: LabelsConfig,
    pub rings: RingsConfig,
    pub stacks: StacksConfig,
    pub probes: ProbesConfig,
    /// GPU health from NVML (`[gpu_health]`).
    pub gpu_health: crate::health::HealthConfig,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            level: CaptureLevel::default(),
            launch_counts: false,
            flight_recorder: FlightRecorderConfig {
                seconds: Duration::from_secs(120),
                max_bytes: 256 << 20,
            },
            dump_dir: PathBuf::from("/var/lib/xpuscope/dumps"),
            dump_dir_max_bytes: 4 << 30,
            max_dumps_per_hour: 12,
            detect: DetectSection {
                hang_timeout: crate::sinks::detect::DEFAULT_HANG_TIMEOUT,
                dump_on_finding: true,
                host: Default::default(),
                collective: Default::default(),
            },
            metrics: MetricsConfig {
                listen: Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            },
            control: ControlConfig {
                socket: PathBuf::from("/run/xpuscope/agent.sock"),
                group: None,
                tcp_listen: None,
                token_file: None,
            },
            discovery: DiscoveryConfig::default(),
            labels: LabelsConfig {
                job_env: crate::model::identity::default_job_env(),
            },
            rings: RingsConfig::default(),
            stacks: StacksConfig::default(),
            probes: ProbesConfig::default(),
            // The library from XPUSCOPE_NVML_LIBRARY when set; the file's
            // `gpu_health.library` wins over it.
            gpu_health: crate::health::HealthConfig::from_env(),
        }
    }
}

/// Keys a reload applies to the running service. Every other key is read
/// once, at start: it sizes or binds something (rings, the recorder's
/// window, sockets, the dump directory) or seeds state built from it
/// (discovery, the detectors), so a change waits for the next restart.
pub const LIVE_KEYS: &[&str] = &["level", "labels.job_env"];

impl ServiceConfig {
    /// Every key with its value, named as in the file, in file order.
    pub fn keys(&self) -> Vec<(&'static str, String)> {
        let c = self;
        let (h, k) = (&c.detect.host, &c.detect.collective);
        macro_rules! keys {
            ($($name:literal => $v:expr),* $(,)?) => {
                vec![$(($name, format!("{:?}", $v))),*]
            };
        }
        keys![
            "level" => c.level,
            "launch_counts" => c.launch_counts,
            "dump_dir" => c.dump_dir,
            "dump_dir_max_bytes" => c.dump_dir_max_bytes,
            "max_dumps_per_hour" => c.max_dumps_per_hour,
            "detect.hang_timeout" => c.detect.hang_timeout,
            "detect.late_min" => k.late_min,
            "detect.late_mad_k" => k.late_mad_k,
            "detect.slow_rank_persist" => k.slow_rank_persist,
            "detect.slow_link_ratio" => k.slow_link_ratio,
            "detect.link_min_bytes" => k.link_min_bytes,
            "detect.link_min_ops" => k.link_min_ops,
            "detect.slow_compute_pct" => k.slow_compute_pct,
            "detect.dump_on_finding" => c.detect.dump_on_finding,
            "detect.contention_min_share_pct" => h.contention_min_share_pct,
            "detect.contention_min_lost" => h.contention_min_lost,
            "detect.contention_min_steps" => h.contention_min_steps,
            "detect.contention_min_span" => h.contention_min_span,
            "detect.stall_min" => h.stall_min,
            "detect.stall_factor" => h.stall_factor,
            "detect.stall_min_history" => h.stall_min_history,
            "detect.leak_min_per_step" => h.leak_min_per_step,
            "detect.leak_min_steps" => h.leak_min_steps,
            "flight_recorder.seconds" => c.flight_recorder.seconds,
            "flight_recorder.max_bytes" => c.flight_recorder.max_bytes,
            "rings.scheduler" => c.rings.scheduler,
            "rings.device" => c.rings.device,
            "rings.bystander" => c.rings.bystander,
            "stacks.rate" => c.stacks.rate,
            "stacks.burst" => c.stacks.burst,
            "probes.slots" => c.probes.slots,
            "probes.release_after" => c.probes.release_after,
            "metrics.listen" => c.metrics.listen,
            "control.socket" => c.control.socket,
            "control.group" => c.control.group,
            "control.tcp_listen" => c.control.tcp_listen,
            "control.token_file" => c.control.token_file,
            "discovery.comm" => c.discovery.comm.as_ref().map(|p| p.0.as_str()),
            "discovery.cgroup_prefix" => c.discovery.cgroup_prefix,
            "discovery.env" => c.discovery.env,
            "labels.job_env" => c.labels.job_env,
            "gpu_health.interval" => c.gpu_health.interval,
            "gpu_health.library" => c.gpu_health.library,
            "gpu_health.dcmi_library" => c.gpu_health.dcmi_library,
        ]
    }

    /// The keys whose values differ from `self` in `other`, in file order.
    pub fn changed_keys(&self, other: &Self) -> Vec<&'static str> {
        self.keys()
            .into_iter()
            .zip(other.keys())
            .filter(|(a, b)| a.1 != b.1)
            .map(|(a, _)| a.0)
            .collect()
    }
}

/// A configuration that cannot be used, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // The cause is in the message (not a `#[source]`): the control API
    // answers with this text alone.
    #[error("{path}: cannot read the configuration: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}:{line}: not valid TOML: {message}")]
    Syntax {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error(
        "{path}:{line}: unknown key `{key}`; known keys here: {known} (fix the spelling or remove it)"
    )]
    UnknownKey {
        path: PathBuf,
        line: usize,
        key: String,
        known: String,
    },
    #[error("{path}:{line}: `{key}`: {message}")]
    Value {
        path: PathBuf,
        line: usize,
        key: String,
        message: String,
    },
}

impl ServiceConfig {
    /// Reads and validates `path`. A missing file at the default path is
    /// the default configuration; anywhere else it is an error.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text, path),
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && path == Path::new(DEFAULT_CONFIG_PATH) =>
            {
                Ok(Self::default())
            }
            Err(error) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                error,
            }),
        }
    }

    /// Parses `text` (read from `path`, which errors name).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let doc = DeTable::parse(text).map_err(|e| ConfigError::Syntax {
            path: path.to_path_buf(),
            line: e.span().map(|s| line_of(text, s.start)).unwrap_or(1),
            message: e.message().to_string(),
        })?;
        let mut cfg = Self::default();
        let ctx = Ctx { text, path };
        let mut root = Section::new(&ctx, "", doc.get_ref());
        if let Some(v) = root.take("level") {
            let n = ctx.integer(&v, "level")?;
            cfg.level = u8::try_from(n)
                .map_err(|_| format!("{n} is out of range"))
                .and_then(CaptureLevel::new)
                .map_err(|m| ctx.value_error(&v, "level", m))?;
        }
        if let Some(v) = root.take("launch_counts") {
            cfg.launch_counts = ctx.boolean(&v, "launch_counts")?;
        }
        if let Some(v) = root.take("dump_dir") {
            cfg.dump_dir = ctx.absolute_path(&v, "dump_dir")?;
        }
        if let Some(v) = root.take("dump_dir_max_bytes") {
            cfg.dump_dir_max_bytes = ctx.size(&v, "dump_dir_max_bytes")?;
        }
        if let Some(v) = root.take("max_dumps_per_hour") {
            let n = ctx.integer(&v, "max_dumps_per_hour")?;
            cfg.max_dumps_per_hour = u32::try_from(n)
                .ok()
                .filter(|n| (1..=3600).contains(n))
                .ok_or_else(|| {
                    ctx.value_error(
                        &v,
                        "max_dumps_per_hour",
                        format!("{n} must be between 1 and 3600"),
                    )
                })?;
        }
        if let Some(t) = root.take_table("detect")? {
            let mut s = Section::new(&ctx, "detect", &t);
            if let Some(v) = s.take("hang_timeout") {
                let d = ctx.duration(&v, "detect.hang_timeout")?;
                if d < Duration::from_millis(100) {
                    return Err(ctx.value_error(
                        &v,
                        "detect.hang_timeout",
                        format!("{d:?} would call every collective a hang; use at least 100ms"),
                    ));
                }
                cfg.detect.hang_timeout = d;
            }
            if let Some(v) = s.take("dump_on_finding") {
                cfg.detect.dump_on_finding = ctx.boolean(&v, "detect.dump_on_finding")?;
            }
            host_detect_keys(&ctx, &mut s, &mut cfg.detect.host)?;
            let c = &mut cfg.detect.collective;
            if let Some(v) = s.take("late_min") {
                c.late_min = ctx.duration(&v, "detect.late_min")?;
            }
            if let Some(v) = s.take("link_min_bytes") {
                c.link_min_bytes = ctx.size(&v, "detect.link_min_bytes")?;
            }
            for (key, field, lo, hi) in [
                ("late_mad_k", &mut c.late_mad_k, 1, 1000),
                ("slow_rank_persist", &mut c.slow_rank_persist, 1, 1000),
                ("slow_link_ratio", &mut c.slow_link_ratio, 2, 1000),
                ("link_min_ops", &mut c.link_min_ops, 1, 100_000),
                ("slow_compute_pct", &mut c.slow_compute_pct, 101, 100_000),
            ] {
                if let Some(v) = s.take(key) {
                    let name = format!("detect.{key}");
                    let n = ctx.integer(&v, &name)?;
                    *field = u32::try_from(n)
                        .ok()
                        .filter(|n| (lo..=hi).contains(n))
                        .ok_or_else(|| {
                            ctx.value_error(&v, &name, format!("{n} must be between {lo} and {hi}"))
                        })?;
                }
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("flight_recorder")? {
            let mut s = Section::new(&ctx, "flight_recorder", &t);
            if let Some(v) = s.take("seconds") {
                cfg.flight_recorder.seconds = ctx.duration(&v, "flight_recorder.seconds")?;
            }
            if let Some(v) = s.take("max_bytes") {
                let n = ctx.size(&v, "flight_recorder.max_bytes")?;
                if n < 1 << 20 {
                    return Err(ctx.value_error(
                        &v,
                        "flight_recorder.max_bytes",
                        format!("{n} bytes cannot hold a useful window; use at least 1M"),
                    ));
                }
                cfg.flight_recorder.max_bytes = n;
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("rings")? {
            let mut s = Section::new(&ctx, "rings", &t);
            let r = &mut cfg.rings;
            for (key, field) in [
                ("scheduler", &mut r.scheduler),
                ("device", &mut r.device),
                ("bystander", &mut r.bystander),
            ] {
                if let Some(v) = s.take(key) {
                    let name = format!("rings.{key}");
                    let n = ctx.size(&v, &name)?;
                    *field = crate::config::parse_ring_size(&n.to_string())
                        .map_err(|m| ctx.value_error(&v, &name, m))?;
                }
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("stacks")? {
            let mut s = Section::new(&ctx, "stacks", &t);
            let st = &mut cfg.stacks;
            for (key, field, max) in [
                ("rate", &mut st.rate, 10_000),
                ("burst", &mut st.burst, 1_000),
            ] {
                if let Some(v) = s.take(key) {
                    let name = format!("stacks.{key}");
                    let n = ctx.integer(&v, &name)?;
                    *field = u32::try_from(n).ok().filter(|n| *n <= max).ok_or_else(|| {
                        ctx.value_error(&v, &name, format!("{n} must be between 0 and {max}"))
                    })?;
                }
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("probes")? {
            let mut s = Section::new(&ctx, "probes", &t);
            if let Some(v) = s.take("slots") {
                let max = xpuscope_common::MAX_PROBE_SLOTS - 1;
                let n = ctx.integer(&v, "probes.slots")?;
                cfg.probes.slots = u32::try_from(n)
                    .ok()
                    .filter(|n| (1..=max).contains(n))
                    .ok_or_else(|| {
                        ctx.value_error(
                            &v,
                            "probes.slots",
                            format!("{n} must be between 1 and {max}"),
                        )
                    })?;
            }
            if let Some(v) = s.take("release_after") {
                cfg.probes.release_after = ctx.duration(&v, "probes.release_after")?;
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("metrics")? {
            let mut s = Section::new(&ctx, "metrics", &t);
            if let Some(v) = s.take("listen") {
                cfg.metrics.listen = ctx.listen(&v, "metrics.listen", true)?;
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("control")? {
            let mut s = Section::new(&ctx, "control", &t);
            if let Some(v) = s.take("socket") {
                cfg.control.socket = ctx.absolute_path(&v, "control.socket")?;
            }
            if let Some(v) = s.take("group") {
                let g = ctx.string(&v, "control.group")?;
                if g.is_empty()
                    || !g
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
                {
                    return Err(ctx.value_error(
                        &v,
                        "control.group",
                        format!("`{g}` is not a group name"),
                    ));
                }
                cfg.control.group = Some(g);
            }
            let tcp = s.take("tcp_listen");
            if let Some(v) = &tcp {
                cfg.control.tcp_listen = ctx.listen(v, "control.tcp_listen", false)?;
            }
            if let Some(v) = s.take("token_file") {
                cfg.control.token_file = Some(ctx.absolute_path(&v, "control.token_file")?);
            }
            if let Some(v) = &tcp
                && cfg.control.tcp_listen.is_some()
                && cfg.control.token_file.is_none()
            {
                return Err(ctx.value_error(
                    v,
                    "control.tcp_listen",
                    "a TCP control listener needs `control.token_file` (a file holding the token \
                     clients must send); add one or remove tcp_listen"
                        .into(),
                ));
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("discovery")? {
            let mut s = Section::new(&ctx, "discovery", &t);
            if let Some(v) = s.take("comm") {
                let pattern = ctx.string(&v, "discovery.comm")?;
                let re = regex::Regex::new(&pattern).map_err(|e| {
                    ctx.value_error(&v, "discovery.comm", format!("not a valid regex: {e}"))
                })?;
                cfg.discovery.comm = Some(CommPattern(re));
            }
            if let Some(v) = s.take("cgroup_prefix") {
                cfg.discovery.cgroup_prefix = ctx.strings(&v, "discovery.cgroup_prefix")?;
                if let Some(bad) = cfg
                    .discovery
                    .cgroup_prefix
                    .iter()
                    .find(|p| !p.starts_with('/'))
                {
                    return Err(ctx.value_error(
                        &v,
                        "discovery.cgroup_prefix",
                        format!("`{bad}` must start with `/` (a path in the cgroup hierarchy, as in /proc/PID/cgroup)"),
                    ));
                }
            }
            if let Some(v) = s.take("env") {
                cfg.discovery.env = ctx.env_names(&v, "discovery.env")?;
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("gpu_health")? {
            let mut s = Section::new(&ctx, "gpu_health", &t);
            if let Some(v) = s.take("interval") {
                cfg.gpu_health.interval = ctx.duration(&v, "gpu_health.interval")?;
            }
            if let Some(v) = s.take("library") {
                cfg.gpu_health.library = PathBuf::from(ctx.string(&v, "gpu_health.library")?);
            }
            if let Some(v) = s.take("dcmi_library") {
                cfg.gpu_health.dcmi_library =
                    Some(PathBuf::from(ctx.string(&v, "gpu_health.dcmi_library")?));
            }
            s.finish()?;
        }
        if let Some(t) = root.take_table("labels")? {
            let mut s = Section::new(&ctx, "labels", &t);
            if let Some(v) = s.take("job_env") {
                cfg.labels.job_env = ctx.env_names(&v, "labels.job_env")?;
            }
            s.finish()?;
        }
        root.finish()?;
        Ok(cfg)
    }
}

/// 1-based line of byte offset `at`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The host-side detectors' keys of `[detect]`.
fn host_detect_keys(
    ctx: &Ctx,
    s: &mut Section,
    host: &mut crate::sinks::detect::host_config::HostDetectConfig,
) -> Result<(), ConfigError> {
    let count = |v: &Value, key: &str, lo: i64, hi: i64| -> Result<u32, ConfigError> {
        let n = ctx.integer(v, key)?;
        if !(lo..=hi).contains(&n) {
            return Err(ctx.value_error(v, key, format!("{n} must be between {lo} and {hi}")));
        }
        Ok(n as u32)
    };
    if let Some(v) = s.take("contention_min_share_pct") {
        host.contention_min_share_pct = count(&v, "detect.contention_min_share_pct", 1, 100)?;
    }
    if let Some(v) = s.take("contention_min_lost") {
        host.contention_min_lost = ctx.duration(&v, "detect.contention_min_lost")?;
    }
    if let Some(v) = s.take("contention_min_steps") {
        host.contention_min_steps = count(&v, "detect.contention_min_steps", 1, 10_000)?;
    }
    if let Some(v) = s.take("contention_min_span") {
        host.contention_min_span = ctx.duration(&v, "detect.contention_min_span")?;
    }
    if let Some(v) = s.take("stall_min") {
        host.stall_min = ctx.duration(&v, "detect.stall_min")?;
    }
    if let Some(v) = s.take("stall_factor") {
        host.stall_factor = count(&v, "detect.stall_factor", 1, 1_000)?;
    }
    if let Some(v) = s.take("stall_min_history") {
        host.stall_min_history = count(&v, "detect.stall_min_history", 0, 16)?;
    }
    if let Some(v) = s.take("leak_min_per_step") {
        let n = ctx.size(&v, "detect.leak_min_per_step")?;
        if n == 0 {
            return Err(ctx.value_error(
                &v,
                "detect.leak_min_per_step",
                "0 would call every allocation a leak; use at least 1".into(),
            ));
        }
        host.leak_min_per_step = n;
    }
    if let Some(v) = s.take("leak_min_steps") {
        host.leak_min_steps = count(&v, "detect.leak_min_steps", 2, 10_000)?;
    }
    Ok(())
}

type Value<'i> = Spanned<DeValue<'i>>;

struct Ctx<'a> {
    text: &'a str,
    path: &'a Path,
}

impl Ctx<'_> {
    fn line(&self, v: &Value) -> usize {
        line_of(self.text, v.span().start)
    }

    fn value_error(&self, v: &Value, key: &str, message: String) -> ConfigError {
        ConfigError::Value {
            path: self.path.to_path_buf(),
            line: self.line(v),
            key: key.into(),
            message,
        }
    }

    fn boolean(&self, v: &Value, key: &str) -> Result<bool, ConfigError> {
        match v.get_ref() {
            DeValue::Boolean(b) => Ok(*b),
            other => Err(self.value_error(
                v,
                key,
                format!("expected true or false, found a {}", other.type_str()),
            )),
        }
    }

    fn integer(&self, v: &Value, key: &str) -> Result<i64, ConfigError> {
        match v.get_ref() {
            DeValue::Integer(i) => {
                let digits = i.as_str().replace('_', "");
                let digits = digits.trim_start_matches('+');
                let digits = match i.radix() {
                    10 => digits,
                    _ => digits.get(2..).unwrap_or(""),
                };
                i64::from_str_radix(digits, i.radix())
                    .map_err(|e| self.value_error(v, key, format!("not an integer: {e}")))
            }
            other => Err(self.value_error(
                v,
                key,
                format!("expected an integer, found a {}", other.type_str()),
            )),
        }
    }

    fn string(&self, v: &Value, key: &str) -> Result<String, ConfigError> {
        v.get_ref().as_str().map(String::from).ok_or_else(|| {
            self.value_error(
                v,
                key,
                format!("expected a string, found a {}", v.get_ref().type_str()),
            )
        })
    }

    fn strings(&self, v: &Value, key: &str) -> Result<Vec<String>, ConfigError> {
        let Some(items) = v.get_ref().as_array() else {
            return Err(self.value_error(
                v,
                key,
                format!(
                    "expected a list of strings, found a {}",
                    v.get_ref().type_str()
                ),
            ));
        };
        items.iter().map(|item| self.string(item, key)).collect()
    }

    fn env_names(&self, v: &Value, key: &str) -> Result<Vec<String>, ConfigError> {
        let names = self.strings(v, key)?;
        for n in &names {
            let valid = !n.is_empty()
                && !n.starts_with(|c: char| c.is_ascii_digit())
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(self.value_error(
                    v,
                    key,
                    format!("`{n}` is not an environment variable name (letters, digits, `_`)"),
                ));
            }
        }
        Ok(names)
    }

    fn size(&self, v: &Value, key: &str) -> Result<u64, ConfigError> {
        match v.get_ref() {
            DeValue::Integer(_) => {
                let n = self.integer(v, key)?;
                u64::try_from(n).map_err(|_| self.value_error(v, key, format!("{n} is negative")))
            }
            DeValue::String(s) => parse_size(s).map_err(|m| self.value_error(v, key, m)),
            other => Err(self.value_error(
                v,
                key,
                format!(
                    "expected a size (4096, \"256k\", \"32M\"), found a {}",
                    other.type_str()
                ),
            )),
        }
    }

    fn duration(&self, v: &Value, key: &str) -> Result<Duration, ConfigError> {
        let text = match v.get_ref() {
            DeValue::Integer(_) => format!("{}s", self.integer(v, key)?),
            DeValue::String(s) => s.to_string(),
            other => {
                return Err(self.value_error(
                    v,
                    key,
                    format!(
                        "expected a duration (120, \"30s\", \"5m\"), found a {}",
                        other.type_str()
                    ),
                ));
            }
        };
        parse_duration(&text).map_err(|m| self.value_error(v, key, m))
    }

    fn absolute_path(&self, v: &Value, key: &str) -> Result<PathBuf, ConfigError> {
        let p = PathBuf::from(self.string(v, key)?);
        if !p.is_absolute() {
            return Err(self.value_error(
                v,
                key,
                format!("`{}` must be an absolute path", p.display()),
            ));
        }
        Ok(p)
    }

    /// `host:port`, or (where `may_disable`) "off".
    fn listen(
        &self,
        v: &Value,
        key: &str,
        may_disable: bool,
    ) -> Result<Option<SocketAddr>, ConfigError> {
        let s = self.string(v, key)?;
        if may_disable && s == "off" {
            return Ok(None);
        }
        s.parse::<SocketAddr>().map(Some).map_err(|_| {
            self.value_error(
                v,
                key,
                format!(
                    "`{s}` is not an address:port such as 127.0.0.1:9464{}",
                    if may_disable { " (or \"off\")" } else { "" }
                ),
            )
        })
    }
}

/// The keys of one table, taken one by one; what is left is unknown.
struct Section<'a, 'i> {
    ctx: &'a Ctx<'a>,
    prefix: &'static str,
    entries: Vec<(&'a Spanned<toml::de::DeString<'i>>, &'a Value<'i>)>,
    known: Vec<&'static str>,
    /// Where the last taken value started.
    last_span: usize,
}

impl<'a, 'i> Section<'a, 'i> {
    fn new(ctx: &'a Ctx<'a>, prefix: &'static str, table: &'a DeTable<'i>) -> Self {
        Self {
            ctx,
            prefix,
            entries: table.iter().collect(),
            known: Vec::new(),
            last_span: 0,
        }
    }

    fn take(&mut self, key: &'static str) -> Option<Value<'i>> {
        self.known.push(key);
        let i = self
            .entries
            .iter()
            .position(|(k, _)| k.get_ref().as_ref() == key)?;
        let v = self.entries.remove(i).1.clone();
        self.last_span = v.span().start;
        Some(v)
    }

    fn take_table(&mut self, key: &'static str) -> Result<Option<DeTable<'i>>, ConfigError> {
        let Some(v) = self.take(key) else {
            return Ok(None);
        };
        match v.into_inner() {
            DeValue::Table(t) => Ok(Some(t)),
            other => Err(ConfigError::Value {
                path: self.ctx.path.to_path_buf(),
                line: line_of(self.ctx.text, self.last_span),
                key: key.into(),
                message: format!("expected a table ([{key}]), found a {}", other.type_str()),
            }),
        }
    }

    fn finish(self) -> Result<(), ConfigError> {
        let Some((key, _)) = self.entries.first() else {
            return Ok(());
        };
        let name = key.get_ref().to_string();
        Err(ConfigError::UnknownKey {
            path: self.ctx.path.to_path_buf(),
            line: line_of(self.ctx.text, key.span().start),
            key: if self.prefix.is_empty() {
                name
            } else {
                format!("{}.{name}", self.prefix)
            },
            known: self.known.join(", "),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ServiceConfig, String> {
        ServiceConfig::parse(text, Path::new("/etc/xpuscope/agent.toml")).map_err(|e| e.to_string())
    }

    /// The documented default file (`deploy/agent.toml`, in the module docs).
    fn documented_example() -> String {
        include_str!("../../../deploy/agent.toml").to_string()
    }

    #[test]
    fn the_documented_example_is_the_default() {
        let doc = documented_example();
        let cfg = parse(&doc).unwrap();
        assert_eq!(cfg, ServiceConfig::default());
        assert_eq!(parse("").unwrap(), ServiceConfig::default());
    }

    /// The file's commented-out examples (`# key = value`) are valid too:
    /// uncommented, they parse and take effect.
    #[test]
    fn the_documented_examples_parse_when_uncommented() {
        let mut uncommented = 0;
        let text: String = documented_example()
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest.split_once(" = ").is_some_and(|(k, _)| {
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    }) =>
                {
                    uncommented += 1;
                    format!("{rest}\n")
                }
                _ => format!("{l}\n"),
            })
            .collect();
        assert_eq!(uncommented, 8, "{text}");
        let cfg = parse(&text).unwrap();
        assert_eq!(cfg.control.group.as_deref(), Some("xpuscope"));
        assert!(cfg.control.tcp_listen.is_some() && cfg.control.token_file.is_some());
        assert!(cfg.discovery.comm.as_ref().unwrap().0.is_match("torchrun"));
        assert_eq!(cfg.discovery.cgroup_prefix, vec!["/kubepods.slice"]);
        assert_eq!(
            cfg.gpu_health.dcmi_library.as_deref(),
            Some(Path::new(
                "/usr/local/Ascend/driver/lib64/driver/libdcmi.so"
            ))
        );
        assert_eq!(cfg.discovery.env, vec!["RANK"]);
    }

    #[test]
    fn every_key_parses() {
        let cfg = parse(
            r#"
level = 3
launch_counts = true
dump_dir = "/srv/dumps"
dump_dir_max_bytes = 1073741824
max_dumps_per_hour = 2
[detect]
hang_timeout = "90s"
dump_on_finding = false
contention_min_share_pct = 30
contention_min_lost = "2ms"
contention_min_steps = 4
contention_min_span = "2s"
stall_min = "200ms"
stall_factor = 6
stall_min_history = 3
leak_min_per_step = "8M"
leak_min_steps = 7
late_min = "20ms"
slow_rank_persist = 4
[flight_recorder]
seconds = "10m"
max_bytes = "64M"
[rings]
scheduler = "32M"
device = 1048576
bystander = "16M"
[stacks]
rate = 50
burst = 0
[metrics]
listen = "off"
[control]
socket = "/tmp/x.sock"
group = "xpuscope"
tcp_listen = "127.0.0.1:9465"
token_file = "/etc/xpuscope/token"
[discovery]
comm = "^python"
cgroup_prefix = ["/kubepods.slice"]
env = ["RANK"]
[labels]
job_env = ["MY_JOB"]
[gpu_health]
interval = "5s"
library = "/opt/nvml/libnvidia-ml.so.1"
dcmi_library = "/opt/ascend/libdcmi.so"
"#,
        )
        .unwrap();
        assert_eq!(
            cfg.gpu_health,
            crate::health::HealthConfig {
                interval: Duration::from_secs(5),
                library: PathBuf::from("/opt/nvml/libnvidia-ml.so.1"),
                dcmi_library: Some(PathBuf::from("/opt/ascend/libdcmi.so")),
            }
        );
        assert_eq!(cfg.level.get(), 3);
        assert!(cfg.launch_counts);
        assert!(
            !ServiceConfig::default().launch_counts,
            "off by default in the service"
        );
        assert_eq!(cfg.dump_dir, PathBuf::from("/srv/dumps"));
        assert_eq!(cfg.dump_dir_max_bytes, 1 << 30);
        assert_eq!(cfg.max_dumps_per_hour, 2);
        assert_eq!(cfg.detect.hang_timeout, Duration::from_secs(90));
        assert_eq!(cfg.detect.collective.late_min, Duration::from_millis(20));
        assert_eq!(cfg.detect.collective.slow_rank_persist, 4);
        assert_eq!(cfg.detect.collective.late_mad_k, 5);
        assert!(!cfg.detect.dump_on_finding);
        assert_eq!(
            cfg.detect.host,
            crate::sinks::detect::host_config::HostDetectConfig {
                contention_min_share_pct: 30,
                contention_min_lost: Duration::from_millis(2),
                contention_min_steps: 4,
                contention_min_span: Duration::from_secs(2),
                stall_min: Duration::from_millis(200),
                stall_factor: 6,
                stall_min_history: 3,
                leak_min_per_step: 8 << 20,
                leak_min_steps: 7,
            }
        );
        assert_eq!(cfg.flight_recorder.seconds, Duration::from_secs(600));
        assert_eq!(cfg.flight_recorder.max_bytes, 64 << 20);
        assert_eq!(
            cfg.rings,
            RingsConfig {
                scheduler: 32 << 20,
                device: 1 << 20,
                bystander: 16 << 20
            }
        );
        assert_eq!(cfg.stacks, StacksConfig { rate: 50, burst: 0 });
        let probes = parse("[probes]\nslots = 500\nrelease_after = \"2m\"\n").unwrap();
        assert_eq!(
            probes.probes,
            ProbesConfig {
                slots: 500,
                release_after: Duration::from_secs(120)
            }
        );
        for bad in ["slots = 0", "slots = 16384"] {
            let e = parse(&format!("[probes]\n{bad}\n")).unwrap_err();
            assert!(
                e.contains("agent.toml:2")
                    && e.contains("probes.slots")
                    && e.contains("between 1 and 16383"),
                "{e}"
            );
        }
        let e = parse("[stacks]\nrate = -1\n").unwrap_err();
        assert!(
            e.contains("agent.toml:2") && e.contains("stacks.rate") && e.contains("between 0 and"),
            "{e}"
        );
        let e = parse("[rings]\nscheduler = \"3M\"\n").unwrap_err();
        assert!(
            e.contains("agent.toml:2")
                && e.contains("rings.scheduler")
                && e.contains("power of two"),
            "{e}"
        );
        assert_eq!(cfg.metrics.listen, None);
        assert_eq!(cfg.control.group.as_deref(), Some("xpuscope"));
        assert_eq!(
            cfg.control.tcp_listen,
            Some("127.0.0.1:9465".parse().unwrap())
        );
        assert!(cfg.discovery.comm.as_ref().unwrap().0.is_match("python3"));
        assert_eq!(cfg.discovery.cgroup_prefix, vec!["/kubepods.slice"]);
        assert_eq!(cfg.discovery.env, vec!["RANK"]);
        assert_eq!(cfg.labels.job_env, vec!["MY_JOB"]);
    }

    /// Every key of the documented file (its commented-out examples too)
    /// is one the reload compares, and none else: a key added to the file
    /// but not to the comparison would be silently ignored by reloads.
    #[test]
    fn the_reload_compares_every_documented_key() {
        let mut section = String::new();
        let mut documented = Vec::new();
        for line in documented_example().lines() {
            let line = line.trim_start_matches("# ");
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = format!("{name}.");
            } else if let Some((key, _)) = line.split_once(" = ")
                && !key.is_empty()
                && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            {
                documented.push(format!("{section}{key}"));
            }
        }
        let compared: Vec<String> = ServiceConfig::default()
            .keys()
            .into_iter()
            .map(|(k, _)| k.to_string())
            .collect();
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        assert_eq!(sorted(compared), sorted(documented));
        for key in LIVE_KEYS {
            assert!(
                ServiceConfig::default()
                    .keys()
                    .iter()
                    .any(|(k, _)| k == key),
                "{key}"
            );
        }
    }

    #[test]
    fn changed_keys_name_each_key_that_differs() {
        let base = ServiceConfig::default();
        assert!(base.changed_keys(&base.clone()).is_empty());
        let edited = parse(
            "level = 2\n[flight_recorder]\nseconds = \"30s\"\n[detect]\nlate_mad_k = 7\n\
             [control]\nsocket = \"/run/other.sock\"\n[discovery]\ncomm = \"^python\"\n\
             [labels]\njob_env = [\"MY_JOB\"]\n",
        )
        .unwrap();
        assert_eq!(
            base.changed_keys(&edited),
            vec![
                "level",
                "detect.late_mad_k",
                "flight_recorder.seconds",
                "control.socket",
                "discovery.comm",
                "labels.job_env",
            ]
        );
        assert_eq!(edited.changed_keys(&base), base.changed_keys(&edited));
        // A value written differently but equal is no change.
        let same = parse("[flight_recorder]\nseconds = \"2m\"\nmax_bytes = 268435456\n").unwrap();
        assert!(base.changed_keys(&same).is_empty());
    }

    #[test]
    fn errors_name_file_line_and_key() {
        let e = parse("level = 1\n[flight_recorder]\nsecond = 5\n").unwrap_err();
        assert_eq!(
            e,
            "/etc/xpuscope/agent.toml:3: unknown key `flight_recorder.second`; known keys here: \
             seconds, max_bytes (fix the spelling or remove it)"
        );
        let e = parse("\nlevel = 7\n").unwrap_err();
        assert!(
            e.starts_with("/etc/xpuscope/agent.toml:2: `level`: level 7 does not exist"),
            "{e}"
        );
        let e = parse("[flight_recorder]\nmax_bytes = \"lots\"\n").unwrap_err();
        assert!(
            e.starts_with(
                "/etc/xpuscope/agent.toml:2: `flight_recorder.max_bytes`: `lots` is not a size"
            ),
            "{e}"
        );
        let e = parse("[detect]\nhang_timeout = true\n").unwrap_err();
        assert!(
            e.contains(":2: `detect.hang_timeout`: expected a duration"),
            "{e}"
        );
        let e = parse("[detect]\nslow_link_ratio = 1\n").unwrap_err();
        assert!(e.contains("must be between 2 and 1000"), "{e}");
        let e = parse("[detect]\nhang_timeout = \"1ms\"\n").unwrap_err();
        assert!(e.contains("use at least 100ms"), "{e}");
        let e = parse("[detect]\ndump_on_finding = 1\n").unwrap_err();
        assert!(
            e.contains("`detect.dump_on_finding`: expected true or false, found a integer"),
            "{e}"
        );
        let e = parse("[detect]\ncontention_min_share_pct = 0\n").unwrap_err();
        assert!(
            e.contains(":2: `detect.contention_min_share_pct`: 0 must be between 1 and 100"),
            "{e}"
        );
        let e = parse("[detect]\nleak_min_per_step = 0\n").unwrap_err();
        assert!(e.contains("use at least 1"), "{e}");
        let e = parse("[detect]\nstall_min = \"soon\"\n").unwrap_err();
        assert!(e.contains("`detect.stall_min`"), "{e}");
        // The key moved into [detect]: at the top it is unknown.
        let e = parse("hang_timeout = \"5s\"\n").unwrap_err();
        assert!(e.contains("unknown key `hang_timeout`"), "{e}");
        let e = parse("dump_dir = \"dumps\"\n").unwrap_err();
        assert!(
            e.contains("`dump_dir`: `dumps` must be an absolute path"),
            "{e}"
        );
        let e = parse("[metrics]\nlisten = \"localhost\"\n").unwrap_err();
        assert!(
            e.contains(":2: `metrics.listen`: `localhost` is not an address:port"),
            "{e}"
        );
        let e = parse("[control]\ntcp_listen = \"0.0.0.0:9465\"\n").unwrap_err();
        assert!(
            e.contains(
                ":2: `control.tcp_listen`: a TCP control listener needs `control.token_file`"
            ),
            "{e}"
        );
        let e = parse("[discovery]\ncomm = \"(python\"\n").unwrap_err();
        assert!(e.contains(":2: `discovery.comm`: not a valid regex"), "{e}");
        let e = parse("[discovery]\nenv = [\"RANK=1\"]\n").unwrap_err();
        assert!(
            e.contains("`RANK=1` is not an environment variable name"),
            "{e}"
        );
        let e = parse("metrics = 5\n").unwrap_err();
        assert!(e.contains(":1: `metrics`: expected a table"), "{e}");
        let e = parse("level = \n").unwrap_err();
        assert!(
            e.starts_with("/etc/xpuscope/agent.toml:1: not valid TOML"),
            "{e}"
        );
        let e = parse("[flight_recorder]\nmax_bytes = 1000\n").unwrap_err();
        assert!(e.contains("use at least 1M"), "{e}");
    }

    #[test]
    fn missing_files() {
        let e = ServiceConfig::load(Path::new("/nonexistent/agent.toml")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/agent.toml: cannot read"),
            "{e}"
        );
    }

    /// Fuzzing: arbitrary edits of the documented example (and of a few
    /// other valid files) give a configuration or an error naming the file,
    /// never a panic (8,000 seeded cases per run).
    #[test]
    fn arbitrary_config_text_never_panics() {
        let doc = documented_example();
        let seeds = [
            doc.clone(),
            "level = 2\n[flight_recorder]\nseconds = \"30s\"\nmax_bytes = \"64M\"\n".to_string(),
            "[discovery]\ncomm = \"^python\"\nenv = \"RANK\"\n[control]\ngroup = \"wheel\"\n"
                .to_string(),
        ];
        let path = Path::new("/etc/xpuscope/fuzz.toml");
        let mut m = crate::service::fuzzing::Mutator::new(0x5eed_c0f1);
        for round in 0..8_000 {
            let seed = seeds[round % seeds.len()].as_bytes();
            let bytes = m.mutate(seed);
            let text = String::from_utf8_lossy(&bytes);
            if let Err(e) = ServiceConfig::parse(&text, path) {
                assert!(e.to_string().contains("fuzz.toml"), "{e}");
            }
        }
    }
}
