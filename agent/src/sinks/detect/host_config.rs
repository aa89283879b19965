//! The host-side detectors' thresholds (config `detect.*`), apart from
//! the detectors: [`host`](super::host) drives them and each detector reads
//! its own fields, so the settings sit below all of them.

use std::time::Duration;

/// Thresholds of the host-side detectors (config `detect.*`; defaults
/// below, documented in `docs/src/reference/config.md` and `deploy/agent.toml`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostDetectConfig {
    /// A step is contended when its main thread lost at least this
    /// percentage of the step to other processes' threads...
    pub contention_min_share_pct: u32,
    /// ...and at least this much time.
    pub contention_min_lost: Duration,
    /// Contended steps in a row before a finding...
    pub contention_min_steps: u32,
    /// ...spanning at least this long (a few short steps of contention
    /// are a blip of the host, not a neighbour).
    pub contention_min_span: Duration,
    /// A data wait shorter than this is never a stall.
    pub stall_min: Duration,
    /// A stall is this many times the rank's usual (median) wait.
    pub stall_factor: u32,
    /// Steps of a rank seen before its waits are judged.
    pub stall_min_history: u32,
    /// Bytes a site must grow by every step to count as leaking.
    pub leak_min_per_step: u64,
    /// Growing steps in a row before a finding.
    pub leak_min_steps: u32,
}

pub const DEFAULT_CONTENTION_MIN_SHARE_PCT: u32 = 10;
pub const DEFAULT_CONTENTION_MIN_LOST: Duration = Duration::from_millis(1);
pub const DEFAULT_CONTENTION_MIN_STEPS: u32 = 3;
pub const DEFAULT_CONTENTION_MIN_SPAN: Duration = Duration::from_secs(1);
pub const DEFAULT_STALL_MIN: Duration = Duration::from_millis(50);
pub const DEFAULT_STALL_FACTOR: u32 = 4;
pub const DEFAULT_STALL_MIN_HISTORY: u32 = 2;
pub const DEFAULT_LEAK_MIN_PER_STEP: u64 = 1 << 20;
pub const DEFAULT_LEAK_MIN_STEPS: u32 = 5;

impl Default for HostDetectConfig {
    fn default() -> Self {
        Self {
            contention_min_share_pct: DEFAULT_CONTENTION_MIN_SHARE_PCT,
            contention_min_lost: DEFAULT_CONTENTION_MIN_LOST,
            contention_min_steps: DEFAULT_CONTENTION_MIN_STEPS,
            contention_min_span: DEFAULT_CONTENTION_MIN_SPAN,
            stall_min: DEFAULT_STALL_MIN,
            stall_factor: DEFAULT_STALL_FACTOR,
            stall_min_history: DEFAULT_STALL_MIN_HISTORY,
            leak_min_per_step: DEFAULT_LEAK_MIN_PER_STEP,
            leak_min_steps: DEFAULT_LEAK_MIN_STEPS,
        }
    }
}
