//! A rank's finished step, split by where its main thread spent it: what
//! says whether the step was host-bound (the thread busy in its own code
//! while the device waited) or device-bound (the thread waiting in device
//! calls). The host-side detectors' step clock makes it
//! (`sinks::detect::host_bound::split`); the trace draws it as counters on
//! the rank's process and the metrics observe it per step.

use xpuscope_common::uprobe::LaunchCounts;

/// Where a rank's main thread spent one step (ns).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepSplit {
    pub dur: u64,
    /// In device calls: waiting for the device or the peers.
    pub in_device_calls: u64,
    /// Off CPU outside device calls, runnable (preempted).
    pub runnable: u64,
    /// Off CPU outside device calls, asleep.
    pub asleep: u64,
    /// On CPU outside device calls: the host's own work.
    pub host: u64,
}

impl StepSplit {
    /// The share of the step that was host work.
    pub fn host_share(&self) -> f64 {
        self.host as f64 / self.dur.max(1) as f64
    }

    /// The share of the step spent in device calls.
    pub fn device_wait_share(&self) -> f64 {
        self.in_device_calls as f64 / self.dur.max(1) as f64
    }
}

/// One finished step of a rank (process `tgid`) and its split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSplitRecord {
    pub tgid: u32,
    /// As the host-side findings number it.
    pub step: u64,
    /// CLOCK_BOOTTIME ns.
    pub start: u64,
    pub end: u64,
    pub split: StepSplit,
    /// The process's launches in the step (all threads), as the kernel
    /// counted them; None where no launch was ever counted.
    pub launches: Option<LaunchCounts>,
}
