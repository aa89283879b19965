//! The validated configuration of a recording. The CLI's defaults come from
//! [`AttachConfig::default`].

use std::path::PathBuf;
use std::time::Duration;

use xpuscope_common::{Config, TaskOffsets, stack_mode};

use crate::kernel::{DeviceLevel, LoadOptions};

/// How off-CPU stacks are taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StackPolicy {
    /// No stacks.
    Off,
    /// Per-thread token bucket (`--stack-rate` per second, bursts of
    /// `--stack-burst`): every long wait of a thread that blocks rarely is
    /// kept, while a thread switching 100k times a second costs little.
    Sampled,
    /// A stack at every switch-out of a traced thread (costly on
    /// switch-heavy workloads).
    All,
}

impl StackPolicy {
    pub fn kernel_mode(self) -> u32 {
        match self {
            StackPolicy::Off => stack_mode::OFF,
            StackPolicy::Sampled => stack_mode::SAMPLED,
            StackPolicy::All => stack_mode::ALL,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct AttachConfig {
    /// The process to trace (with its threads and future children).
    pub pid: Option<u32>,
    /// Record every process's scheduling on every CPU.
    pub system_wide: bool,
    pub output: PathBuf,
    /// Stop after this long (else on Ctrl-C/SIGTERM or when the target exits).
    pub duration: Option<Duration>,
    pub stacks: StackPolicy,
    pub stack_rate: u32,
    pub stack_burst: u32,
    /// Scheduler ring buffer size in bytes (a power of two, at least one page).
    pub ring_bytes: u32,
    /// Device-call ring buffer size in bytes (likewise).
    pub device_ring_bytes: u32,
    /// Bystander ring buffer size in bytes (likewise): switches where
    /// neither task is traced.
    pub bystander_ring_bytes: u32,
    /// BTF to read kernel struct layouts from.
    pub kernel_btf: PathBuf,
    /// Write a JSON summary here at the end.
    pub stats_json: Option<PathBuf>,
    /// Testing aid: sleep this long after each drained batch, to force the
    /// overload path.
    pub reader_delay: Duration,
    /// How often the reader drains the ring when no wakeup came.
    pub drain_interval: Duration,
    /// Device-library capture level: 0 collectives, syncs, memory, comm
    /// init; 1 adds launches and copies; 2 adds activity records.
    pub probe_level: u8,
    /// Count launches in the kernel below the level that records them.
    pub launch_counts: bool,
    /// Testing aid: device-level changes during the recording.
    pub level_schedule: LevelSchedule,
    /// Testing aid: print the kernel's traced set (`TARGETS`) at the stop.
    pub report_targets: bool,
    /// Probe the dynamic loader's debugger hook (a `dlopen` is seen at
    /// once, not at the next rescan of the traced processes' maps).
    pub loader_hook: bool,
    /// Device-call records per second per (process, function) before calls
    /// are summarized (0: no limit).
    pub device_call_rate: u32,
    /// A collective or sync running longer than this is reported as a hang.
    pub hang_timeout: Duration,
    /// Thresholds of the host-side detectors.
    pub host_detect: crate::sinks::detect::host_config::HostDetectConfig,
    /// `slow_rank`, `late_arrival`, `slow_link` thresholds.
    pub collective: crate::sinks::detect::collective::CollectiveConfig,
    /// GPU health from NVML: the library, how often.
    pub gpu_health: crate::health::HealthConfig,
}

pub const DEFAULT_RING_BYTES: u32 = 32 << 20;
/// Small enough that the ring stays near the CPU caches between the probes
/// writing a line and the agent reading it (a 32 MiB ring made each traced
/// call ~100-180 ns dearer: `cargo xtask bench probes`), large enough for
/// a burst of allocations with their stack copies (8.8 KB each: a 256 KiB
/// ring lost records of a 16-rank job's start). Was 256 KiB before stack
/// copies; the probe-cost bench has not been re-run at 2 MiB.
pub const DEFAULT_DEVICE_RING_BYTES: u32 = 2 << 20;
/// Room for the switches between untraced tasks on the traced threads'
/// CPUs. A pinned pipe ping-pong makes ~500k of them a second (88 bytes
/// each, ~44 MB/s); the reader drains every 10 ms or at a quarter full, so
/// 8 MiB (~95k records, ~190 ms of such a storm) rides out a reader stall
/// of that length, and costs ~16 MB resident. What does not fit is counted
/// apart from the target's records, which have the scheduler ring to
/// themselves.
pub const DEFAULT_BYSTANDER_RING_BYTES: u32 = 8 << 20;
/// Device-call records per second per (process, function) before calls are
/// summarized per 100 ms: far above what a training step makes (a few
/// thousand launches a second), far below a pathological loop (860k calls a
/// second wrote 1.19 GB in 20 s).
pub const DEFAULT_DEVICE_CALL_RATE: u32 = 50_000;
pub const DEFAULT_STACK_RATE: u32 = 100;
pub const DEFAULT_STACK_BURST: u32 = 20;

impl Default for AttachConfig {
    fn default() -> Self {
        Self {
            pid: None,
            system_wide: false,
            output: PathBuf::from("xpuscope.pftrace"),
            duration: None,
            stacks: StackPolicy::Sampled,
            stack_rate: DEFAULT_STACK_RATE,
            stack_burst: DEFAULT_STACK_BURST,
            ring_bytes: DEFAULT_RING_BYTES,
            device_ring_bytes: DEFAULT_DEVICE_RING_BYTES,
            bystander_ring_bytes: DEFAULT_BYSTANDER_RING_BYTES,
            kernel_btf: PathBuf::from(crate::btf::VMLINUX_BTF),
            stats_json: None,
            reader_delay: Duration::ZERO,
            drain_interval: Duration::from_millis(10),
            probe_level: 0,
            device_call_rate: DEFAULT_DEVICE_CALL_RATE,
            hang_timeout: crate::sinks::detect::DEFAULT_HANG_TIMEOUT,
            host_detect: Default::default(),
            collective: Default::default(),
            level_schedule: LevelSchedule::default(),
            report_targets: false,
            loader_hook: true,
            launch_counts: true,
            gpu_health: crate::health::HealthConfig::from_env(),
        }
    }
}

impl AttachConfig {
    /// The options for a recording configured so (rings, stack
    /// sampling, BTF), with this stack mode and device probe mask (the
    /// attach and service supervisors decide those).
    pub fn load_options(
        &self,
        offsets: TaskOffsets,
        stack_mode: u32,
        probe_levels: u32,
    ) -> LoadOptions<'_> {
        let cfg = self;
        LoadOptions {
            offsets,
            ring_bytes: cfg.ring_bytes,
            device_ring_bytes: cfg.device_ring_bytes,
            bystander_ring_bytes: cfg.bystander_ring_bytes,
            config: Config {
                system_wide: cfg.system_wide as u32,
                stack_mode,
                stack_rate: cfg.stack_rate,
                stack_burst: cfg.stack_burst,
                // A reader wakeup when a ring is a quarter full.
                wakeup_bytes: (cfg.ring_bytes / 4) as u64,
                device_wakeup_bytes: (cfg.device_ring_bytes / 4) as u64,
                probe_levels,
                sched_off: 0,
                bystander_wakeup_bytes: (cfg.bystander_ring_bytes / 4) as u64,
            },
            kernel_btf: &cfg.kernel_btf,
        }
    }
}

/// Parses `30s`, `1.5s`, `500ms`, `2m`, `1h` or plain seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (num, unit) = match t.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&t[..i], &t[i..]),
        None => (t, "s"),
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (examples: 30s, 500ms, 2m)"))?;
    let scale = match unit {
        "ms" => 1e-3,
        "s" | "" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}` (use ms, s, m or h)"
            ));
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || secs <= 0.0 || secs > 7.0 * 86400.0 {
        return Err(format!(
            "duration `{text}` must be positive and at most 7 days"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Device capture levels to switch to while recording, each after a time
/// since the start (`--probe-level-schedule 0,1@1s,0@3s`: level 0 from the
/// start, 1 after 1 s, 0 again after 3 s). The supervisor applies them
/// through the same call the control API will use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LevelSchedule {
    /// The level at the start, if the schedule names one.
    pub initial: Option<DeviceLevel>,
    /// Changes not applied yet, earliest first.
    changes: Vec<(Duration, DeviceLevel)>,
}

impl LevelSchedule {
    /// The level due by `elapsed`, once: the latest change whose time has
    /// come (earlier ones it passed over are skipped).
    pub fn take_due(&mut self, elapsed: Duration) -> Option<DeviceLevel> {
        let due = self
            .changes
            .iter()
            .take_while(|(at, _)| *at <= elapsed)
            .count();
        self.changes.drain(..due).next_back().map(|(_, l)| l)
    }
}

/// Parses a [`LevelSchedule`]: comma-separated `LEVEL@TIME`, the first may
/// be a bare `LEVEL` (the level at the start); times increase.
pub fn parse_level_schedule(text: &str) -> Result<LevelSchedule, String> {
    let mut schedule = LevelSchedule::default();
    for (i, step) in text.split(',').map(str::trim).enumerate() {
        match step.split_once('@') {
            None if i == 0 => schedule.initial = Some(step.parse()?),
            None => {
                return Err(format!(
                    "`{step}` in `{text}` needs a time (e.g. 1@2s); only the first level may                      omit it"
                ));
            }
            Some((level, at)) => {
                let at = parse_duration(at)?;
                if schedule.changes.last().is_some_and(|(prev, _)| *prev >= at) {
                    return Err(format!("times in `{text}` must increase"));
                }
                schedule.changes.push((at, level.parse()?));
            }
        }
    }
    Ok(schedule)
}

/// Parses a byte size such as `32M`, `4096`, `1G`, `256k`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("`{text}` is not a size (examples: 4096, 256k, 32M)"))
}

/// A valid ring buffer size: a power of two of at least one page, at most 1 GiB.
pub fn parse_ring_size(text: &str) -> Result<u32, String> {
    let bytes = parse_size(text)?;
    let page = 4096;
    if bytes < page || !bytes.is_power_of_two() || bytes > (1 << 30) {
        return Err(format!(
            "ring size {text} must be a power of two between 4k and 1G (the kernel requires it)"
        ));
    }
    Ok(bytes as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(
            parse_duration("soon")
                .unwrap_err()
                .contains("not a duration")
        );
        assert!(parse_duration("5y").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("0s").is_err());
    }

    #[test]
    fn level_schedules() {
        let lvl = |n| DeviceLevel::new(n).unwrap();
        let mut s = parse_level_schedule("0,1@1s,2@3s,0@4s").unwrap();
        assert_eq!(s.initial, Some(lvl(0)));
        assert_eq!(s.take_due(Duration::from_millis(500)), None);
        assert_eq!(s.take_due(Duration::from_millis(1100)), Some(lvl(1)));
        assert_eq!(s.take_due(Duration::from_millis(1200)), None, "once");
        // A slow tick passes over 2@3s: the latest due wins.
        assert_eq!(s.take_due(Duration::from_secs(5)), Some(lvl(0)));
        assert_eq!(s.take_due(Duration::from_secs(9)), None);
        assert_eq!(parse_level_schedule("1@2s").unwrap().initial, None);
        assert!(
            parse_level_schedule("0,1")
                .unwrap_err()
                .contains("needs a time")
        );
        assert!(
            parse_level_schedule("1@2s,0@1s")
                .unwrap_err()
                .contains("increase")
        );
        assert!(
            parse_level_schedule("5")
                .unwrap_err()
                .contains("use 0, 1 or 2")
        );
        assert!(
            parse_level_schedule("1@soon")
                .unwrap_err()
                .contains("not a duration")
        );
    }

    #[test]
    fn ring_sizes() {
        assert_eq!(parse_ring_size("32M"), Ok(32 << 20));
        assert_eq!(parse_ring_size("4096"), Ok(4096));
        assert!(parse_ring_size("3000").is_err());
        assert!(parse_ring_size("3M").is_err(), "not a power of two");
        assert!(parse_ring_size("lots").is_err());
    }
}
