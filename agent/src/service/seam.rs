//! What the supervisor and the kernel side hand each other: the running
//! pipeline's inputs the kernel side feeds, and the level switch the
//! control API turns. Kept apart from both so neither imports the other's
//! internals (the supervisor starts the kernel side; the kernel side only
//! sees this).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

use serde_json::Value;
use tokio::sync::mpsc;

use super::config::CaptureLevel;
use crate::pipeline::{Announcements, PipelineMsg};

/// Changes the kernel side's capture level at runtime
/// ([`super::kernel_side::KernelLevels`] over the real kernel).
pub trait LevelSwitch: Send + Sync + 'static {
    fn set_level(&self, level: CaptureLevel) -> Result<(), String>;
}

/// The level switch of a service run without a kernel side (tests of the
/// interfaces).
#[cfg(test)]
pub struct KernelNotAttached;

#[cfg(test)]
impl LevelSwitch for KernelNotAttached {
    fn set_level(&self, _level: CaptureLevel) -> Result<(), String> {
        Err("the kernel side is not attached in service mode yet".into())
    }
}

/// What the rest of the service plugs into.
pub struct Running {
    /// Into the pipeline: collect's events, drops.
    pub pipeline: mpsc::Sender<PipelineMsg>,
    /// Probe tables into the pipeline, ahead of queued events.
    pub announce: Announcements,
    /// Traced processes by pid, as `GET /processes` lists them.
    pub traced: Arc<Mutex<BTreeMap<u32, Value>>>,
    /// `labels.job_env` as it applies now.
    pub job_env: JobEnv,
    /// The device probes' counters, as of the kernel side's last round
    /// (for the metrics).
    pub probe_stats: Arc<Mutex<crate::kernel::probes::DeviceProbeStats>>,
    /// What the kernel side lost, as running totals.
    pub losses: Arc<crate::sinks::metrics::KernelLosses>,
    /// The kernel's learned stack ends, handed to the pipeline once the
    /// programs are loaded.
    pub stack_ends: std::sync::mpsc::Sender<crate::kernel::stack_ends::StackEndsMap>,
}

/// `labels.job_env` in effect: the kernel side reads it whenever it reads
/// a process's identity, a reload replaces it. Shared rather than copied
/// so that a reload reaches processes traced from then on without a
/// restart (those already labelled keep their label: relabelling them
/// would split their series mid-run).
#[derive(Clone, Debug)]
pub struct JobEnv(Arc<RwLock<Arc<[String]>>>);

impl JobEnv {
    pub fn new(names: &[String]) -> Self {
        Self(Arc::new(RwLock::new(names.into())))
    }

    pub fn get(&self) -> Arc<[String]> {
        match self.0.read() {
            Ok(n) => n.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn set(&self, names: &[String]) {
        let mut n = match self.0.write() {
            Ok(n) => n,
            Err(poisoned) => poisoned.into_inner(),
        };
        *n = names.into();
    }
}
