//! The host-side detectors, fed together from the step clock
//! ([`host_steps`](super::host_steps)): [`host_contention`](super::host_contention),
//! [`host_bound`](super::host_bound),
//! [`dataloader_stall`](super::dataloader_stall),
//! [`memory_leak`](super::memory_leak). Each judges a rank's finished steps,
//! so each finding names its step.

use super::Ranks;
use super::dataloader_stall::StallDetector;
use super::host_bound::HostBoundDetector;
use super::host_bound::split;
use super::host_config::HostDetectConfig;
use super::host_contention::ContentionDetector;
use super::host_steps::{StepClock, Window};
use super::memory_leak::LeakDetector;
use super::step_marks::{StepMark, StepSource};
use crate::analysis::steps::DataLoaderStacks;
use crate::model::{Finding, Record, StepSplitRecord};

/// Splits held between two takes (a sink that never takes them, as
/// `agent diagnose` does not, keeps at most these).
const MAX_SPLITS: usize = 4096;

pub struct HostDetectors {
    cfg: HostDetectConfig,
    clock: StepClock,
    contention: ContentionDetector,
    bound: HostBoundDetector,
    stall: StallDetector,
    /// Finished steps' splits, until the sink takes them.
    splits: Vec<StepSplitRecord>,
    leak: LeakDetector,
    loader_stacks: DataLoaderStacks,
}

impl HostDetectors {
    pub fn new(cfg: HostDetectConfig) -> Self {
        Self {
            cfg,
            clock: StepClock::default(),
            contention: ContentionDetector::default(),
            bound: HostBoundDetector::default(),
            splits: Vec::new(),
            stall: StallDetector::default(),
            leak: LeakDetector::default(),
            loader_stacks: DataLoaderStacks::default(),
        }
    }

    /// A record, after [`Detectors`](super::Detectors) noted identities
    /// (`ranks`) and before it forgets an ended process.
    pub fn record(&mut self, r: &Record, ranks: &Ranks, out: &mut Vec<Finding>) {
        match r {
            Record::Identity { tgid, .. } if ranks.of(*tgid).is_some() => {
                self.clock.follow(*tgid);
            }
            Record::DeviceCall(c) => {
                self.leak.device_call(c, ranks.of(c.call.tgid).is_some());
                if let Some(w) = self.clock.device_call(c) {
                    self.step_ended(&w, ranks, out);
                    self.clock.recycle(w);
                }
            }
            Record::OffCpu(i) if i.tid == i.tgid => {
                let in_loader = i
                    .stack
                    .as_ref()
                    .is_some_and(|s| self.loader_stacks.in_data_loader(s));
                self.clock.off_cpu(i, in_loader);
            }
            Record::Exit {
                exit,
                process_ended: true,
            } => {
                self.clock.forget(exit.tgid);
                self.contention.forget(exit.tgid);
                self.bound.forget(exit.tgid);
                self.stall.forget(exit.tgid);
                self.leak.forget(exit.tgid);
            }
            _ => {}
        }
    }

    /// Step boundaries the job marked (before the call that marked them
    /// reaches [`record`](Self::record)).
    pub fn step_marks(&mut self, marks: &[StepMark], ranks: &Ranks, out: &mut Vec<Finding>) {
        for m in marks {
            if let Some(w) = self.clock.step_mark(m) {
                self.step_ended(&w, ranks, out);
                self.clock.recycle(w);
            }
        }
    }

    fn step_ended(&mut self, w: &Window, ranks: &Ranks, out: &mut Vec<Finding>) {
        // A rank whose Python step counter numbers its steps: the window
        // the all-reduces bound takes that number.
        let renamed;
        let w = match ranks.marks.source(w.tgid) {
            Some(StepSource::PythonCounter) if w.source == StepSource::AllReduces => {
                match ranks.marked_step(w.tgid, w.named_at) {
                    Some(step) => {
                        renamed = Window {
                            step,
                            source: StepSource::PythonCounter,
                            ..w.clone()
                        };
                        &renamed
                    }
                    None => w,
                }
            }
            _ => w,
        };
        let first_new = out.len();
        self.contention.step_ended(w, &self.cfg, ranks, out);
        let s = split(w);
        self.bound.step_ended(w, &s, ranks, out);
        if ranks.of(w.tgid).is_some() && w.dur() > 0 && self.splits.len() < MAX_SPLITS {
            self.splits.push(StepSplitRecord {
                tgid: w.tgid,
                step: w.step,
                start: w.start,
                end: w.end,
                split: s,
                launches: w.launches,
            });
        }
        self.stall.step_ended(w, &self.cfg, ranks, out);
        self.leak.step_ended(w, &self.cfg, ranks, out);
        for f in &mut out[first_new..] {
            if let Some(e) = f.evidence.as_object_mut() {
                e.insert("step_source".into(), w.source.describe().into());
            }
        }
    }

    /// Stretches the findings of runs that went on past them to where the
    /// runs got ([`RunSpans`](super::run_spans::RunSpans)).
    pub fn extend_spans(&self, found: &mut [Finding]) {
        self.contention.spans().extend(found);
        self.bound.spans().extend(found);
    }

    /// The steps split since the last call.
    pub fn take_splits(&mut self) -> Vec<StepSplitRecord> {
        std::mem::take(&mut self.splits)
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.clock.follows(tgid)
    }
}

#[cfg(test)]
#[path = "host_tests.rs"]
mod tests;
