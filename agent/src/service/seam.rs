//! What the supervisor and the kernel side hand each other: the running
//! pipeline's inputs the kernel side feeds, and the level switch the
//! control API turns. Kept apart from both so neither imports the other's
//! internals (the supervisor starts the kernel side; the kernel side only
//! sees this).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

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
}
