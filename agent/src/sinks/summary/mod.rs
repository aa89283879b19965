//! The summary sink: totals over the record stream for the end-of-run
//! summary (off-CPU time and its reasons, preemptors, device calls per
//! function, device work, failed allocations, memory still held).

pub mod bound;
pub mod offcpu;
pub mod steps;

use std::collections::{BTreeMap, HashMap};

use anyhow::Result;
use serde::Serialize;

use super::{Sink, SinkCounters};
use crate::model::{Record, site_label};
use offcpu::OffCpuSummary;
use steps::{RankStep, RecordSteps};

/// Device records counted (the decoding's own counters are in
/// `InterpretCounters`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeviceRecordCounts {
    /// Calls recorded (entry and return paired).
    pub calls: u64,
    /// Calls that returned an error status.
    pub errors: u64,
    /// Entries whose return never came (lost, or the thread exited).
    pub entries_without_return: u64,
    /// Of those: calls still running when their thread or process died
    /// (killed in the call, as a launcher ends a hung job).
    pub died_in_call: u64,
    /// Calls still open when the recording ended.
    pub in_flight_at_end: u64,
    /// Slices on device-stream tracks from activity records.
    pub device_slices: u64,
    /// Estimated device slices (streams without activity records).
    pub estimated_slices: u64,
    /// Flows from host launches to their device work.
    pub device_flows: u64,
    /// Device-memory allocations that failed (an OOM), each marked in the
    /// trace with its stack and the largest live allocation sites.
    pub failed_allocations: u64,
    /// Calls past `--device-call-rate`, summarized per thread and window
    /// instead of a slice each (included in `calls`).
    pub rate_limited_calls: u64,
}

/// Calls of one probed function, for the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FunctionCalls {
    pub library: &'static str,
    pub function: &'static str,
    /// Entries the kernel counted (its probe's hits).
    pub hits: u64,
    /// Calls decoded into the trace (entry and return paired).
    pub calls: u64,
    pub errors: u64,
}

/// A site's live bytes, for the summary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SiteReport {
    pub pid: u32,
    pub device: String,
    pub bytes: u64,
    pub allocations: u64,
    /// The allocating stack, innermost caller first ("(unknown)" when no
    /// stack was taken).
    pub stack: String,
}

/// What the summary sink counted.
#[derive(Default)]
pub struct RecordTotals {
    pub offcpu: OffCpuSummary,
    /// Preemptions of traced threads (by anyone).
    pub preemptions: u64,
    pub device: DeviceRecordCounts,
    /// Calls per function, most called first.
    pub functions: Vec<FunctionCalls>,
    /// Largest live allocation sites (at each process's exit or the end),
    /// largest first.
    pub sites: Vec<SiteReport>,
    /// Records per kind (`Record::kind`).
    pub records: BTreeMap<&'static str, u64>,
    /// What ran: distinct tasks switched in, CPUs switches were seen on
    /// (the measure of a `--system` recording, which has no traced threads).
    pub tasks_ran: u64,
    pub cpus_seen: u64,
    /// Each rank's step breakdown (ranks whose data-parallel all-reduce
    /// was seen), by rank.
    pub steps: Vec<RankStep>,
    /// Where each rank's steps went, summed, by rank.
    pub step_split: Vec<bound::RankStepSplit>,
}

const RECENT: usize = 32;

#[derive(Default)]
pub struct SummarySink {
    totals: RecordTotals,
    /// Records per kind, by `Record::kind_index` (a map lookup per record
    /// showed in the agent's cost per event).
    per_kind: [u64; Record::KINDS],
    tasks: rustc_hash::FxHashSet<u32>,
    /// Tasks recently added to `tasks`, by `tid % RECENT`: most switches
    /// are of a few tasks switching back and forth, already in the set.
    recent: [u32; RECENT],
    /// CPUs seen, by number.
    cpus: Vec<bool>,
    /// (library, function) -> (calls, errors).
    by_function: HashMap<(&'static str, &'static str), (u64, u64)>,
    steps: RecordSteps,
    bound: bound::StepBound,
}

impl SummarySink {
    fn record(&mut self, r: &Record) {
        self.per_kind[r.kind_index()] += 1;
        match r {
            // Most records: the step table reads neither kind.
            Record::Waking(_) => return,
            Record::Switch { switch, .. } => {
                let tid = switch.next_tid;
                let slot = &mut self.recent[tid as usize % RECENT];
                if tid != 0 && *slot != tid {
                    *slot = tid;
                    self.tasks.insert(tid);
                }
                let cpu = switch.cpu as usize;
                if cpu < xpuscope_common::MAX_CPUS as usize {
                    if cpu >= self.cpus.len() {
                        self.cpus.resize(cpu + 1, false);
                    }
                    self.cpus[cpu] = true;
                }
                return;
            }
            _ => {}
        }
        self.steps.record(r);
        self.bound.record(r);
        let t = &mut self.totals;
        match r {
            Record::OffCpu(i) => {
                if i.preempted_by.is_some() {
                    t.preemptions += 1;
                }
                t.offcpu.add(i);
            }
            Record::DeviceCall(c) if c.unmatched.is_some() => {
                t.device.entries_without_return += 1;
                if c.died_in_call() {
                    t.device.died_in_call += 1;
                }
            }
            Record::DeviceCall(c) => {
                t.device.calls += 1;
                let e = self
                    .by_function
                    .entry((c.call.library.name(), c.call.function))
                    .or_default();
                e.0 += 1;
                if c.call.error {
                    t.device.errors += 1;
                    e.1 += 1;
                }
                if c.oom.is_some() {
                    t.device.failed_allocations += 1;
                }
            }
            Record::CallsSummarized(s) => {
                t.device.calls += s.calls;
                t.device.rate_limited_calls += s.calls;
                for &(library, function, n) in &s.functions {
                    self.by_function.entry((library, function)).or_default().0 += n;
                }
            }
            Record::DeviceWork(w) => {
                if w.track.estimated {
                    t.device.estimated_slices += 1;
                } else {
                    t.device.device_slices += 1;
                }
                t.device.device_flows += w.flows.len() as u64;
            }
            Record::InFlightAtEnd(_) => t.device.in_flight_at_end += 1,
            Record::MemoryHeld(m) => t.sites.extend(m.rows.iter().map(|r| SiteReport {
                pid: m.tgid,
                device: format!("{:?} {}", r.device.vendor, r.device.index),
                bytes: r.bytes,
                allocations: r.allocations,
                stack: site_label(r.site.as_ref()),
            })),
            _ => {}
        }
    }
}

impl Sink for SummarySink {
    type Output = RecordTotals;

    fn on_batch(&mut self, batch: &[Record], _lost: &SinkCounters) -> Result<()> {
        for r in batch {
            self.record(r);
        }
        Ok(())
    }

    fn finish(mut self, _end: u64, _lost: &SinkCounters) -> Result<RecordTotals> {
        let mut functions: Vec<FunctionCalls> = self
            .by_function
            .iter()
            .map(|(&(library, function), &(calls, errors))| FunctionCalls {
                library,
                function,
                hits: 0,
                calls,
                errors,
            })
            .collect();
        functions.sort_by(|a, b| {
            (b.calls, a.library, a.function).cmp(&(a.calls, b.library, b.function))
        });
        self.totals.functions = functions;
        self.totals.tasks_ran = self.tasks.len() as u64;
        self.totals.steps = std::mem::take(&mut self.steps).finish();
        self.totals.step_split = std::mem::take(&mut self.bound).finish();
        self.totals.cpus_seen = self.cpus.iter().filter(|c| **c).count() as u64;
        self.totals.records = Record::KIND_NAMES
            .iter()
            .zip(self.per_kind)
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| (*k, n))
            .collect();
        self.totals
            .sites
            .sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
        Ok(self.totals)
    }
}
