//! The end-of-recording summary, printed for humans and optionally written
//! as JSON for scripts and tests.

use crate::model::finding::{Finding, FindingsDoc};
use crate::own_usage::OwnUsage;
use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;
use xpuscope_common::EventKind;

use xpuscope_probes::catalog::Library;

use crate::analysis::steps::slowest_lines;
use crate::config::AttachConfig;
use crate::pipeline::enrich::CacheReport;
use crate::pipeline::interpret::InterpretCounters;
use crate::sinks::SinkReport;
use crate::sinks::summary::bound::RankStepSplit;
use crate::sinks::summary::offcpu::OffCpuSummary;
use crate::sinks::summary::steps::RankStep;
use crate::sinks::summary::{DeviceRecordCounts, FunctionCalls, RecordTotals, SiteReport};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Duration,
    Interrupted,
    Terminated,
    TargetExited,
    /// A stage stopped on its own (an error, reported below).
    Failed,
}

impl StopReason {
    fn describe(self) -> &'static str {
        match self {
            StopReason::Duration => "duration reached",
            StopReason::Interrupted => "interrupted",
            StopReason::Terminated => "terminated",
            StopReason::TargetExited => "target exited",
            StopReason::Failed => "a stage failed",
        }
    }
}

#[derive(Debug, Serialize)]
pub struct KindCount {
    pub kind: String,
    pub consumed: u64,
    pub dropped: u64,
}

#[derive(Debug, Serialize)]
pub struct Ranked {
    pub what: String,
    pub total_ns: u64,
    pub count: u64,
}

#[derive(Debug, Serialize)]
pub struct RunSummary {
    pub output: String,
    pub stop_reason: StopReason,
    pub seconds: f64,
    pub events: u64,
    /// Every lost event: ring buffer full, plus `kernel_skipped`.
    pub dropped: u64,
    /// Of `dropped`: program runs the kernel skipped because the program was
    /// already running on that CPU (a tracepoint firing from an interrupt
    /// inside it).
    pub kernel_skipped: u64,
    pub decode_errors: u64,
    pub per_kind: Vec<KindCount>,
    pub bytes: u64,
    pub threads: usize,
    pub stacks: u64,
    pub stack_errors: u64,
    pub stacks_unmatched: u64,
    /// Off-CPU stacks seen before in their process (same addresses): their
    /// symbolized frames were reused.
    pub stacks_memoized: u64,
    /// User stacks (off-CPU and allocating) unwound from the code's CFI
    /// (the rest kept their frame-pointer walk).
    pub user_stacks_cfi: u64,
    /// Of those, stacks deeper than the kernel's copy (their root end is
    /// missing; they end in a `[truncated: ...]` frame).
    pub user_stacks_truncated: u64,
    /// Of those, stacks copied only up to their thread's learned stack
    /// end (the outermost frame's slots), without a frame-pointer walk.
    pub user_stacks_short_copies: u64,
    /// Of those, stacks taken inside a call the agent return-probes (a
    /// collective, a sync), unwound past the kernel's uretprobe trampoline
    /// with the real return address the record carries.
    pub user_stacks_past_uretprobes: u64,
    /// Ring bytes of the off-CPU stack records: a stack whose copy reached
    /// its thread's learned end within a short class came in that
    /// smaller record (`xpuscope_common::OffCpuStackOf`).
    pub stack_record_bytes: u64,
    /// Off-CPU stacks of CPython threads with their Python frames
    /// interleaved; those whose Python frames could not be read (native
    /// frames only); the mean time a read took (us).
    pub python_stacks: u64,
    pub python_stack_errors: u64,
    pub python_read_us_mean: f64,
    /// The byte-bounded caches that traced processes feed: `python` (code
    /// objects) and `cfi` (files' unwind tables), each with what it holds
    /// at the end, its peak, and what it evicted and refused.
    pub caches: CacheReport,

    pub preemptions: u64,
    pub offcpu_ns: u64,
    pub offcpu_with_stack_ns: u64,
    pub top_offcpu: Vec<Ranked>,
    /// Tasks outside the traced job that took a traced thread's CPU.
    pub top_preemptors: Vec<Ranked>,
    /// Time traced threads waited, runnable, while another thread of the
    /// job ran in their place (not interference), and how often.
    pub preempted_by_own_threads_ns: u64,
    pub preempted_by_own_threads: u64,
    /// The agent's own CPU time (user + system) for the whole run.
    pub agent_cpu_seconds: f64,
    /// The agent's peak resident memory.
    pub agent_peak_rss_bytes: u64,
    pub device: DeviceSummary,
    /// GPU health (NVML): whether it was available, why not, what it read.
    pub gpu_health: crate::health::HealthReport,
    /// NPU health (DCMI), the same.
    pub npu_health: crate::health::HealthReport,
    /// Per sink: records delivered, and those it lost while it lagged.
    pub sinks: Vec<SinkReport>,
    /// `--system`: distinct tasks that ran and CPUs seen (what that mode
    /// measures; the per-thread figures above need `--pid`).
    pub system_wide: Option<SystemWide>,
    /// Bytes of the kernel ring buffers (scheduler, device calls,
    /// bystander switches); each is mapped twice, so the agent's resident
    /// memory holds about twice their sum.
    pub ring_bytes: u64,
    /// Decoded records per kind, as the summary sink counted them.
    pub records: std::collections::BTreeMap<&'static str, u64>,
    /// Each rank's step breakdown (the first step of each rank has no
    /// start marker and is left out), by rank and step.
    pub steps: Vec<RankStep>,
    /// Where each rank's steps went over the recording (host work, waits
    /// in device calls, runnable, asleep), and whether that makes it host-
    /// or device-bound, by rank.
    pub step_split: Vec<RankStepSplit>,
    /// What the detectors found, as the `xpuscope-findings/1` document
    /// (`{"schema": ..., "findings": [...]}`).
    #[serde(serialize_with = "findings_doc")]
    pub findings: Vec<Finding>,
}

fn findings_doc<S: serde::Serializer>(f: &[Finding], s: S) -> Result<S::Ok, S::Error> {
    serde::Serialize::serialize(&FindingsDoc::new(f), s)
}

/// What a `--system` recording measured.
#[derive(Debug, Serialize)]
pub struct SystemWide {
    pub tasks_ran: u64,
    pub cpus: u64,
    pub switches: u64,
}

/// Most allocation sites listed in the summary.
const SUMMARY_SITES: usize = 10;

/// Device-library calls (absent libraries leave it all zero).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceSummary {
    /// Library mappings probed (per process).
    pub libraries: u64,
    /// Library files probed ahead of their first mapping, predicted from
    /// a starting program's dependencies.
    pub libraries_ahead: u64,
    /// Functions attached (entry and return), over all processes.
    pub attached_probes: u64,
    /// Functions or libraries that could not be attached.
    pub attach_failures: u64,
    /// Uprobe links made (entries and returns): one per library file and
    /// end where the kernel has uprobe-multi links, else one per function
    /// and end.
    pub probe_links: u64,
    /// Of `probe_links`, the uprobe-multi ones.
    pub multi_links: u64,
    /// Library files whose probes took over a second to attach (calls
    /// in that time unrecorded).
    pub slow_attaches: u64,
    /// Probe slots held at the end.
    pub probe_slots: u64,
    /// Library files whose probes were released (no traced process used
    /// them for a while).
    pub files_released: u64,
    /// What the device records show (calls, device slices, allocations).
    #[serde(flatten)]
    pub counts: DeviceRecordCounts,
    /// What the decoding saw that no record carries (losses, stacks).
    #[serde(flatten)]
    pub decoding: DeviceDecoding,
    /// Largest live allocation sites (at each process's exit or at the
    /// end), largest first.
    pub largest_live_sites: Vec<SiteReport>,
    /// Calls per probed function, most called first (the probes' hits).
    pub functions: Vec<FunctionCalls>,
}

/// The device part of [`InterpretCounters`], under its summary names.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct DeviceDecoding {
    pub activity_records: u64,
    /// Activity records the application read that the probe could not
    /// copy, and those that did not decode: their device work is missing.
    pub activity_unread: u64,
    pub activity_errors: u64,
    /// Activity records of kinds not drawn (driver calls, overheads, ...
    /// that an application's profiler enables): read and left, no loss.
    pub activity_other_kinds: u64,
    /// Returns whose entry was not seen (attached mid-call, or lost).
    pub returns_without_entry: u64,
    /// Records at an address no probe is known at.
    pub unknown_probes: u64,
    /// Allocating stacks taken, and those the kernel could not take.
    pub alloc_stacks: u64,
    pub alloc_stack_errors: u64,
    /// Driver calls (`libcuda`) made inside a runtime call of their sort
    /// (`cudaMalloc` -> `cuMemAlloc_v2`): folded into that call.
    pub driver_calls_folded: u64,
}

impl From<&InterpretCounters> for DeviceDecoding {
    fn from(c: &InterpretCounters) -> Self {
        Self {
            activity_records: c.activities,
            activity_unread: c.activity_unread,
            activity_errors: c.activity_errors,
            activity_other_kinds: c.activity_other_kinds,
            returns_without_entry: c.returns_without_entry,
            unknown_probes: c.unknown_probes,
            alloc_stacks: c.alloc_stacks,
            alloc_stack_errors: c.alloc_stack_errors,
            driver_calls_folded: c.driver_calls_folded,
        }
    }
}

fn kind_name(kind: EventKind) -> String {
    match kind {
        EventKind::SchedSwitch => "sched_switch",
        EventKind::SchedWaking => "sched_waking",
        EventKind::SchedWakeupNew => "sched_wakeup_new",
        EventKind::ProcessFork => "process_fork",
        EventKind::ProcessExec => "process_exec",
        EventKind::ProcessExit => "process_exit",
        EventKind::TaskRename => "task_rename",
        EventKind::OffCpuStack => "offcpu_stack",
        EventKind::UprobeEntry => "uprobe_entry",
        EventKind::UprobeReturn => "uprobe_return",
        EventKind::UprobeStack => "uprobe_stack",
        EventKind::BystanderSwitch => "bystander_switch",
        EventKind::LinkMapChange => "link_map_change",
    }
    .to_string()
}

fn ranked(map: &std::collections::HashMap<String, (u64, u64)>) -> Vec<Ranked> {
    OffCpuSummary::top(map, 5)
        .into_iter()
        .map(|(what, total_ns, count)| Ranked {
            what,
            total_ns,
            count,
        })
        .collect()
}

impl RunSummary {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &AttachConfig,
        stop_reason: StopReason,
        elapsed: Duration,
        consumed: &[u64],
        dropped: &[u64],
        decode_errors: u64,
        bytes: u64,
        interpret: InterpretCounters,
        totals: RecordTotals,
        sinks: Vec<SinkReport>,
    ) -> Self {
        let per_kind: Vec<KindCount> = EventKind::ALL
            .iter()
            .map(|k| KindCount {
                kind: kind_name(*k),
                consumed: consumed.get(*k as usize).copied().unwrap_or(0),
                dropped: dropped.get(*k as usize).copied().unwrap_or(0),
            })
            .collect();
        let own = OwnUsage::now();
        let (agent_cpu_seconds, agent_peak_rss_bytes) = (own.cpu_seconds, own.peak_resident_bytes);
        // The activity iterators' calls are calls too (they make no slice
        // of their own): counted per function and in the total, so the
        // total agrees with the per-function rows and the probes' hits.
        let mut device_counts = totals.device;
        let mut functions = totals.functions.clone();
        for (library, function, n) in [
            (
                Library::Cupti.name(),
                "cuptiActivityGetNextRecord",
                interpret.cupti_reads,
            ),
            (
                Library::Mspti.name(),
                "msptiActivityGetNextRecord",
                interpret.mspti_reads,
            ),
        ] {
            if n > 0 {
                device_counts.calls += n;
                functions.push(FunctionCalls {
                    library,
                    function,
                    hits: 0,
                    calls: n,
                    errors: 0,
                });
            }
        }
        Self {
            agent_cpu_seconds,
            agent_peak_rss_bytes,
            output: cfg.output.display().to_string(),
            stop_reason,
            seconds: elapsed.as_secs_f64(),
            events: per_kind.iter().map(|k| k.consumed).sum(),
            dropped: per_kind.iter().map(|k| k.dropped).sum(),
            kernel_skipped: 0,
            decode_errors,
            per_kind,
            bytes,
            threads: interpret.threads_seen as usize,
            stacks: interpret.stacks,
            stack_errors: interpret.stack_errors,
            stacks_unmatched: interpret.stacks_unmatched,
            stacks_memoized: interpret.stacks_memoized,
            user_stacks_cfi: interpret.user_stacks_cfi,
            user_stacks_truncated: interpret.user_stacks_truncated,
            user_stacks_short_copies: interpret.user_stacks_short_copies,
            user_stacks_past_uretprobes: interpret.user_stacks_past_uretprobes,
            stack_record_bytes: interpret.stack_record_bytes,
            caches: interpret.caches,
            python_stacks: interpret.python_stacks,
            python_stack_errors: interpret.python_stack_errors,
            python_read_us_mean: if interpret.python_stacks + interpret.python_stack_errors > 0 {
                interpret.python_read_ns as f64
                    / 1e3
                    / (interpret.python_stacks + interpret.python_stack_errors) as f64
            } else {
                0.0
            },
            preemptions: totals.preemptions,
            offcpu_ns: totals.offcpu.total_ns,
            offcpu_with_stack_ns: totals.offcpu.with_stack_ns,
            top_offcpu: ranked(&totals.offcpu.by_reason),
            preempted_by_own_threads_ns: totals.offcpu.by_own_threads.0,
            preempted_by_own_threads: totals.offcpu.by_own_threads.1,
            top_preemptors: totals
                .offcpu
                .top_preemptors(5)
                .into_iter()
                .map(|(what, total_ns, count)| Ranked {
                    what,
                    total_ns,
                    count,
                })
                .collect(),
            device: DeviceSummary {
                counts: device_counts,
                decoding: DeviceDecoding::from(&interpret),
                largest_live_sites: totals.sites.iter().take(SUMMARY_SITES).cloned().collect(),
                functions,
                ..DeviceSummary::default()
            },
            sinks,
            gpu_health: crate::health::HealthReports::default().gpu,
            npu_health: crate::health::HealthReports::default().npu,
            system_wide: cfg.system_wide.then(|| SystemWide {
                tasks_ran: totals.tasks_ran,
                cpus: totals.cpus_seen,
                switches: totals.records.get("switch").copied().unwrap_or(0),
            }),
            ring_bytes: u64::from(cfg.ring_bytes)
                + u64::from(cfg.device_ring_bytes)
                + u64::from(cfg.bystander_ring_bytes),
            records: totals.records,
            findings: Vec::new(),
            steps: totals.steps,
            step_split: totals.step_split,
        }
    }

    /// The kernel's per-function hit counts, merged into
    /// [`DeviceSummary::functions`] (most hit first).
    pub fn set_device_hits(&mut self, hits: &HashMap<(&'static str, &'static str), u64>) {
        let functions = &mut self.device.functions;
        for (&(library, function), &n) in hits {
            match functions
                .iter_mut()
                .find(|f| f.library == library && f.function == function)
            {
                Some(f) => f.hits += n,
                None => functions.push(FunctionCalls {
                    library,
                    function,
                    hits: n,
                    ..Default::default()
                }),
            }
        }
        functions.sort_by(|a, b| {
            (b.hits, b.calls, a.library, a.function).cmp(&(a.hits, a.calls, b.library, b.function))
        });
    }

    pub fn set_device_probes(&mut self, stats: crate::kernel::probes::DeviceProbeStats) {
        self.device.libraries = stats.libraries;
        self.device.libraries_ahead = stats.files_ahead;
        self.device.attached_probes = stats.attached;
        self.device.attach_failures = stats.attach_failures;
        self.device.probe_links = stats.links;
        self.device.multi_links = stats.multi_links;
        self.device.slow_attaches = stats.slow_attaches;
        self.device.probe_slots = stats.slots_in_use;
        self.device.files_released = stats.files_released;
    }

    /// Why records were lost to a full ring, per ring: each names the
    /// option that sizes that ring (which ring overflowed decides which
    /// option helps).
    fn ring_drops(&self) -> Vec<String> {
        let ring_full = self.dropped - self.kernel_skipped.min(self.dropped);
        let dropped = |matches: &dyn Fn(&str) -> bool| -> u64 {
            self.per_kind
                .iter()
                .filter(|k| matches(&k.kind))
                .map(|k| k.dropped)
                .sum()
        };
        // Kernel skips are counted under their kind too: a ring's share is
        // bounded by what the rings lost altogether.
        let device_full = dropped(&|k| k.starts_with("uprobe_")).min(ring_full);
        let bystander_full = dropped(&|k| k == "bystander_switch").min(ring_full - device_full);
        let sched_full = ring_full - device_full - bystander_full;
        let mut why = Vec::new();
        if sched_full > 0 {
            why.push(format!(
                "{sched_full} with the scheduler ring full: try a larger --ring-size; those CPUs \
                 are marked lost_events in the trace"
            ));
        }
        if device_full > 0 {
            why.push(format!(
                "{device_full} device-call records with the device ring full: try a larger \
                 --device-ring-size"
            ));
        }
        if bystander_full > 0 {
            why.push(format!(
                "{bystander_full} bystander switches (between untraced tasks) with the bystander \
                 ring full: the traced job's own records are not among them; try a larger \
                 --bystander-ring-size; those CPUs are marked lost_events in the trace"
            ));
        }
        why
    }

    /// What this recording could not show, and how to see it: a rank
    /// whose device computes slower than its peers' makes no host late
    /// (its host enqueues and returns; every member waits in the same
    /// sync), so without the devices' activity records no detector sees
    /// it.
    pub fn unseen(&self) -> Option<String> {
        let c = &self.device.counts;
        (c.calls > 0 && c.device_slices == 0).then(|| {
            "not seen: device compute per rank (no activity records were recorded): a rank \
             whose device computes slower than its peers' shows at `agent attach --probe-level \
             2` (the service's level 3)"
                .to_string()
        })
    }

    pub fn print(&self) {
        let secs = |ns: u64| ns as f64 / 1e9;
        eprintln!(
            "xpuscope: stopped ({}) after {:.1} s",
            self.stop_reason.describe(),
            self.seconds
        );
        let kinds: Vec<String> = self
            .per_kind
            .iter()
            .filter(|k| k.consumed > 0)
            .map(|k| format!("{} {}", k.kind, k.consumed))
            .collect();
        eprintln!("  events:  {} ({})", self.events, kinds.join(", "));
        let mut why = self.ring_drops();
        if self.kernel_skipped > 0 {
            why.push(format!(
                "{} skipped by the kernel: a tracepoint fired from an interrupt while its program ran",
                self.kernel_skipped
            ));
        }
        if why.is_empty() {
            eprintln!("  dropped: 0");
        } else {
            eprintln!("  dropped: {} ({})", self.dropped, why.join("; "));
        }
        for s in self.sinks.iter().filter(|s| s.dropped_records > 0) {
            eprintln!(
                "  the {} sink fell behind and lost {} records in {} batches (counted, not in its output)",
                s.name, s.dropped_records, s.dropped_batches
            );
        }
        if let Some(sys) = &self.system_wide {
            eprintln!(
                "  system-wide: {} switches on {} CPUs, {} distinct tasks ran (per-thread off-CPU \
                 time, preemptions and stacks are for the threads of --pid)",
                sys.switches, sys.cpus, sys.tasks_ran
            );
        }
        eprintln!(
            "  threads: {}   preemptions of traced threads: {}",
            self.threads, self.preemptions
        );
        eprintln!(
            "  off-CPU time of traced threads: {:.3} s ({:.3} s with a sampled stack, {} stacks)",
            secs(self.offcpu_ns),
            secs(self.offcpu_with_stack_ns),
            self.stacks
        );
        if !self.top_offcpu.is_empty() {
            eprintln!("  top off-CPU reasons:");
            for r in &self.top_offcpu {
                eprintln!(
                    "    {:>9.3} s {:>7}x  {}",
                    secs(r.total_ns),
                    r.count,
                    r.what
                );
            }
        }
        if self.preempted_by_own_threads > 0 {
            eprintln!(
                "  runnable behind the job's own threads: {:.3} s ({}x; not interference)",
                secs(self.preempted_by_own_threads_ns),
                self.preempted_by_own_threads
            );
        }
        if !self.top_preemptors.is_empty() {
            eprintln!("  top preemptors of traced threads from outside the job:");
            for r in &self.top_preemptors {
                eprintln!(
                    "    {:>9.3} s {:>7}x  {}",
                    secs(r.total_ns),
                    r.count,
                    r.what
                );
            }
        }
        if !self.steps.is_empty() {
            let ranks: std::collections::BTreeSet<u32> =
                self.steps.iter().map(|s| s.rank).collect();
            eprintln!(
                "  slowest steps (of {} on {} ranks; all in --stats-json):",
                self.steps.len(),
                ranks.len()
            );
            for line in slowest_lines(self.steps.iter().map(|r| (r.rank, &r.step)), 5) {
                eprintln!("    {line}");
            }
        }
        if !self.step_split.is_empty() {
            // The ranks most host-bound first: the one whose host work
            // holds the others up leads.
            let mut rows: Vec<&RankStepSplit> = self.step_split.iter().collect();
            rows.sort_by(|a, b| b.host_pct.total_cmp(&a.host_pct).then(a.rank.cmp(&b.rank)));
            eprintln!(
                "  where the steps went (share of each rank's steps; {} ranks, all in --stats-json):",
                rows.len()
            );
            for r in rows.iter().take(5) {
                let launches = match (r.launches_per_step, r.graph_launches_per_step) {
                    (Some(k), Some(g)) if g > 0.0 => {
                        format!("  {k:.0} launches + {g:.0} graphs/step")
                    }
                    (Some(k), _) => format!("  {k:.0} launches/step"),
                    _ => String::new(),
                };
                eprintln!(
                    "    rank {:<4} {:>4} steps of {:>8.2} ms  host work {:>3.0}%  in device calls {:>3.0}%  runnable {:>3.0}%  asleep {:>3.0}%  ({}){launches}",
                    r.rank,
                    r.steps,
                    r.step_ms,
                    r.host_pct,
                    r.device_calls_pct,
                    r.runnable_pct,
                    r.asleep_pct,
                    match r.bound {
                        "host" => "host-bound",
                        "device" => "device-bound",
                        _ => "neither",
                    }
                );
            }
        }
        // A host with one vendor's devices says nothing of the other's
        // absent library; a host with neither says why for both.
        let (gpu, npu) = (&self.gpu_health, &self.npu_health);
        let both_absent = gpu.unavailable.is_some() && npu.unavailable.is_some();
        for report in [gpu, npu] {
            if report.unavailable.is_none() || both_absent {
                eprintln!("  {}", report.line());
            }
        }
        let d = &self.device;
        let c = &d.counts;
        let dc = &d.decoding;
        if d.attached_probes + d.attach_failures + c.calls > 0 {
            eprintln!(
                "  device:  {} calls ({} errors), {} probes on {} libraries ({} links, {} uprobe-multi), \
                 {} attach failures, {} slow attaches, {} slots held, {} files released, \
                 unmatched: {} entries {} returns, {} in flight at end",
                c.calls,
                c.errors,
                d.attached_probes,
                d.libraries,
                d.probe_links,
                d.multi_links,
                d.attach_failures,
                d.slow_attaches,
                d.probe_slots,
                d.files_released,
                c.entries_without_return,
                dc.returns_without_entry,
                c.in_flight_at_end
            );
            if c.rate_limited_calls > 0 {
                eprintln!(
                    "           {} calls past --device-call-rate were summarized per 100 ms \
                     (slices `... xN (rate-limited)`)",
                    c.rate_limited_calls
                );
            }
            if dc.driver_calls_folded > 0 {
                eprintln!(
                    "           {} driver calls made inside the runtime call they serve were \
                     folded into it",
                    dc.driver_calls_folded
                );
            }
            if c.died_in_call > 0 {
                eprintln!(
                    "           {} calls still running when their process died (marked in the trace)",
                    c.died_in_call
                );
            }
            if dc.activity_unread + dc.activity_errors > 0 {
                eprintln!(
                    "           activity records lost: {} could not be copied, {} did not decode",
                    dc.activity_unread, dc.activity_errors
                );
            }
            if dc.activity_other_kinds > 0 {
                eprintln!(
                    "           activity records of kinds not drawn (driver calls, overheads, \
                     ...: the application's profiler asked for them): {}",
                    dc.activity_other_kinds
                );
            }
            if c.device_slices + c.estimated_slices > 0 {
                eprintln!(
                    "           device work: {} slices from activity records, {} estimated, \
                     {} flows from host launches",
                    c.device_slices, c.estimated_slices, c.device_flows
                );
            }
            let top: Vec<String> = d
                .functions
                .iter()
                .take(5)
                .map(|f| format!("{} {}", f.function, f.hits.max(f.calls)))
                .collect();
            if !top.is_empty() {
                eprintln!("           most called: {}", top.join(", "));
            }
            if c.failed_allocations > 0 {
                eprintln!(
                    "           {} failed allocations (marked in the trace with their stacks)",
                    c.failed_allocations
                );
            }
            if !d.largest_live_sites.is_empty() {
                eprintln!("  largest live device-memory allocation sites:");
                for s in d.largest_live_sites.iter().take(5) {
                    eprintln!(
                        "    {:>10.1} MiB in {:>5} allocations  pid {} {}  {}",
                        s.bytes as f64 / (1u64 << 20) as f64,
                        s.allocations,
                        s.pid,
                        s.device,
                        s.stack
                    );
                }
            }
        }
        eprintln!(
            "  agent:   {:.2} s CPU ({:.0} ns per event), peak RSS {:.0} MB (of which the rings, \
             mapped twice: ~{:.0} MB)",
            self.agent_cpu_seconds,
            self.agent_cpu_seconds * 1e9 / self.events.max(1) as f64,
            self.agent_peak_rss_bytes as f64 / 1e6,
            2.0 * self.ring_bytes as f64 / 1e6
        );
        // Only when a bound acted: then stacks may have lost Python frames
        // (evictions cost re-reads only) or fallen back to frame pointers.
        for (name, c) in [
            ("Python code objects", &self.caches.python),
            ("CFI", &self.caches.cfi),
        ] {
            if c.evicted > 0 || c.refused > 0 {
                eprintln!(
                    "  cache:   {name}: peak {:.1} MiB, {} evicted ({:.1} MiB), {} refused as too large",
                    c.peak_bytes as f64 / (1u64 << 20) as f64,
                    c.evicted,
                    c.evicted_bytes as f64 / (1u64 << 20) as f64,
                    c.refused
                );
            }
        }
        if self.findings.is_empty() {
            eprintln!("  findings: none");
        } else {
            eprintln!(
                "  findings: {} (on the trace's \"xpuscope findings\" track)",
                self.findings.len()
            );
            // Roots, each with its consequences folded into a line.
            for f in self.findings.iter().filter(|f| f.link.cause.is_none()) {
                eprintln!("    {}", f.summary);
                if let Some(line) = crate::sinks::detect::incidents::folded(&self.findings, f) {
                    eprintln!("      {line}");
                }
            }
        }
        if let Some(line) = self.unseen() {
            eprintln!("  {line}");
        }
        eprintln!(
            "  trace:   {} ({:.1} MB); open it at https://ui.perfetto.dev",
            self.output,
            self.bytes as f64 / 1e6
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary_with_drops(dropped: &[(EventKind, u64)]) -> RunSummary {
        let mut slots = vec![0u64; xpuscope_common::DROP_SLOTS as usize];
        for (kind, n) in dropped {
            slots[*kind as usize] = *n;
        }
        RunSummary::new(
            &AttachConfig::default(),
            StopReason::Duration,
            Duration::from_secs(1),
            &[],
            &slots,
            0,
            0,
            InterpretCounters::default(),
            RecordTotals::default(),
            Vec::new(),
        )
    }

    /// Device calls without activity records: the summary says what it
    /// could not see and which level shows it; with them, nothing.
    #[test]
    fn device_compute_unseen_without_activity_records_names_the_level() {
        let mut s = summary_with_drops(&[]);
        assert_eq!(s.unseen(), None, "no device calls: nothing to say");
        s.device.counts.calls = 40;
        let line = s.unseen().expect("a line");
        assert!(line.contains("--probe-level 2"), "{line}");
        s.device.counts.device_slices = 12;
        assert_eq!(s.unseen(), None);
    }

    #[test]
    fn each_full_ring_names_its_own_option() {
        let s = summary_with_drops(&[(EventKind::BystanderSwitch, 500)]);
        assert_eq!(s.dropped, 500);
        let why = s.ring_drops();
        assert_eq!(why.len(), 1, "{why:?}");
        assert!(why[0].starts_with("500 bystander switches"), "{why:?}");
        assert!(why[0].contains("--bystander-ring-size"), "{why:?}");
        assert!(why[0].contains("traced job's own records are not among them"));

        let s = summary_with_drops(&[
            (EventKind::ProcessFork, 3),
            (EventKind::SchedSwitch, 4),
            (EventKind::UprobeEntry, 5),
            (EventKind::BystanderSwitch, 6),
        ]);
        let why = s.ring_drops();
        assert_eq!(why.len(), 3, "{why:?}");
        assert!(why[0].starts_with("7 with the scheduler ring full: try a larger --ring-size"));
        assert!(
            why[1].starts_with("5 device-call records") && why[1].contains("--device-ring-size")
        );
        assert!(why[2].starts_with("6 bystander switches"));
        assert!(summary_with_drops(&[]).ring_drops().is_empty());
    }

    #[test]
    fn bystander_switches_have_their_own_row() {
        let s = summary_with_drops(&[(EventKind::BystanderSwitch, 2)]);
        let row = s
            .per_kind
            .iter()
            .find(|k| k.kind == "bystander_switch")
            .expect("a bystander_switch row");
        assert_eq!(row.dropped, 2);
        let sched = s
            .per_kind
            .iter()
            .find(|k| k.kind == "sched_switch")
            .unwrap();
        assert_eq!(sched.dropped, 0, "counted apart from the target's switches");
    }
}
