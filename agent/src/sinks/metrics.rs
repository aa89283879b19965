//! The metrics sink: Prometheus families from the record stream, served as
//! OpenMetrics text on `/metrics` (see `crate::service::metrics_endpoint`).
//!
//! Families (label sets in brackets; `R` = training_job, rank, local_rank,
//! node; `training_job`, not `job`: Prometheus owns `job` and `instance`,
//! the scrape's, and renames a target's own to `exported_job`):
//! - `xpuscope_collective_duration_seconds` histogram [R, comm, op, dtype]:
//!   collectives and point-to-point calls from entry to return;
//! - `xpuscope_collective_bytes_total` [R, comm, op, dtype];
//! - `xpuscope_collective_last_seq` [R, comm]: the last collective number
//!   on each communicator (one query across nodes shows the rank that lags);
//! - `xpuscope_sync_duration_seconds` histogram [R];
//! - `xpuscope_device_memory_bytes` [R, device], `xpuscope_device_ooms_total`
//!   [R, device];
//! - `xpuscope_launches_total` [R] (level >= 2);
//! - `xpuscope_off_cpu_seconds_total` [R], `xpuscope_runqueue_delay_seconds`
//!   histogram [R] (time preempted threads waited for a CPU; level >= 1);
//! - the agent's own: `xpuscope_agent_records_total` [kind],
//!   `xpuscope_agent_kernel_dropped_events_total`,
//!   `xpuscope_agent_sink_records_total` [sink, outcome],
//!   `xpuscope_agent_cpu_seconds_total`, `xpuscope_agent_resident_bytes`
//!   (also as the standard `process_cpu_seconds_total`,
//!   `process_resident_memory_bytes`, with `process_start_time_seconds`
//!   and `process_open_fds`), `xpuscope_build_info` [version, commit],
//!   `xpuscope_flight_recorder_bytes`,
//!   `xpuscope_flight_recorder_evicted_records_total`,
//!   `xpuscope_flight_recorder_dumps_total` [trigger, outcome],
//!   `xpuscope_metrics_series_folded_total` [family],
//!   `xpuscope_agent_cache_bytes` [cache],
//!   `xpuscope_agent_cache_evictions_total` [cache],
//!   `xpuscope_agent_cache_evicted_bytes_total` [cache],
//!   `xpuscope_agent_cache_refused_total` [cache] (the caches traced
//!   processes feed: `python`, `cfi`),
//!   `xpuscope_agent_device_probe_attaches_total` [outcome],
//!   `xpuscope_agent_device_probe_slots` (slots held now),
//!   `xpuscope_agent_device_probe_files_released_total`.
//!
//! The series of a rank whose processes all exited are served for
//! [`EXITED_SERIES_RETENTION_NS`](series::EXITED_SERIES_RETENTION_NS) more (5 minutes), then removed (the
//! bound's room with them).
//!
//! `comm` is the communicator's kind and identity (`nccl:1a2b3c4d`); `op`
//! `allreduce`, `send`, ...; `dtype` `bf16`, ...
//!
//! Cardinality is bounded: each family keeps at most [`MAX_SERIES`](series::MAX_SERIES) label
//! sets. Past that, a new label set is folded into one with `rank`,
//! `local_rank`, `comm`, `op`, `dtype` and `device` set to `other` (its
//! values still count), and `xpuscope_metrics_series_folded_total` counts
//! the observations folded. Label values are at most 128 characters (the
//! environment's values are cut there when read).
//!
//! - `xpuscope_in_flight_oldest_seconds` [R] (the hang gauge): how long
//!   the oldest collective, point-to-point call or sync still running on
//!   the rank has run (0 when none), from the interpret stage's in-flight
//!   snapshots (about once a second);
//! - `xpuscope_findings_total` [kind]: what the detectors found (`hang`,
//!   `device_oom`, `crash`); `xpuscope_incidents_total` [kind]: those that
//!   follow from no earlier finding (the faults, without their
//!   consequences).
//!
//! - GPU health per GPU and rank on it (`xpuscope_gpu_*`, see [`gpu`]).
//!
//! Not yet here: algorithm bandwidth.

use foldhash::{HashMap, HashMapExt};
use std::collections::HashSet;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use rustc_hash::FxHashMap;
use xpuscope_probes::catalog::{CallKind, CommOp, Library};
use xpuscope_probes::decode::args::CallArgs;

mod gpu;
mod series;

use self::series::{Admission, RankFamily, RankPart, RankSeries, SeriesBook};
use super::flight_recorder::{RecorderStats, Trigger};
use super::{Sink, SinkCounters};
use crate::model::{
    DeviceCallRecord, InFlightSnapshot, OffCpuInterval, RankIdentity, Record, StepSplitRecord,
};
use crate::own_usage::OwnUsage;

/// The pipeline is alive while the sink heard from it this recently.
pub const LIVENESS_NS: u64 = 10_000_000_000;
const FOLDED: &str = "other";

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabels {
    pub training_job: String,
    pub rank: String,
    pub local_rank: String,
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CollectiveLabels {
    pub training_job: String,
    pub rank: String,
    pub local_rank: String,
    pub node: String,
    pub comm: String,
    pub op: String,
    pub dtype: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommLabels {
    pub training_job: String,
    pub rank: String,
    pub local_rank: String,
    pub node: String,
    pub comm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabels {
    pub training_job: String,
    pub rank: String,
    pub local_rank: String,
    pub node: String,
    pub device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    commit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WhatLabels {
    what: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SinkLabels {
    sink: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TriggerLabels {
    trigger: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabels {
    family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabels {
    cache: String,
}

type Hist<L> = Family<L, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    // 10 us to ~168 s, x4 per bucket.
    Histogram::new(exponential_buckets(1e-5, 4.0, 13))
}

/// How long a rank's labels outlive its process for its late records.
const ENDED_KEPT_NS: u64 = 60_000_000_000;

/// The families, registered once.
#[derive(Clone)]
struct Families {
    collective_seconds: Hist<CollectiveLabels>,
    collective_bytes: Family<CollectiveLabels, Counter>,
    last_seq: Family<CommLabels, Gauge>,
    sync_seconds: Hist<RankLabels>,
    memory: Family<DeviceLabels, Gauge>,
    ooms: Family<DeviceLabels, Counter>,
    launches: Family<RankLabels, Counter>,
    off_cpu: Family<RankLabels, Counter<f64, AtomicU64>>,
    runqueue: Hist<RankLabels>,
    step_seconds: Hist<RankLabels>,
    step_host_seconds: Hist<RankLabels>,
    step_device_wait_seconds: Hist<RankLabels>,
    step_kernel_launches: Family<RankLabels, Counter>,
    step_graph_launches: Family<RankLabels, Counter>,
    records: Family<KindLabels, Counter>,
    kernel_drops: Counter,
    sink_records: Family<SinkLabels, Counter>,
    cpu: Counter<f64, AtomicU64>,
    rss: Gauge,
    /// The same figures under the names every Prometheus client library
    /// exports (`process_*`), for the dashboards that already read them.
    process_cpu: Counter<f64, AtomicU64>,
    process_rss: Gauge,
    process_start: Gauge,
    process_open_fds: Gauge,
    build_info: Family<BuildLabels, Gauge>,
    recorder_bytes: Gauge,
    recorder_evicted: Counter,
    kernel_skips: Counter,
    decode_errors: Counter,
    interpret_losses: Family<WhatLabels, Counter>,
    probe_attaches: Family<OutcomeLabels, Counter>,
    probe_slots: Gauge,
    probe_files_released: Counter,
    dumps: Family<TriggerLabels, Counter>,
    folded: Family<FamilyLabels, Counter>,
    in_flight_oldest: Family<RankLabels, Gauge<f64, AtomicU64>>,
    findings: Family<KindLabels, Counter>,
    incidents: Family<KindLabels, Counter>,
    cache_bytes: Family<CacheLabels, Gauge>,
    cache_evictions: Family<CacheLabels, Counter>,
    cache_evicted_bytes: Family<CacheLabels, Counter>,
    cache_refused: Family<CacheLabels, Counter>,
}

impl Families {
    fn register(registry: &mut Registry) -> Self {
        let f = Self {
            collective_seconds: Family::new_with_constructor(seconds_histogram),
            collective_bytes: Family::default(),
            last_seq: Family::default(),
            sync_seconds: Family::new_with_constructor(seconds_histogram),
            memory: Family::default(),
            ooms: Family::default(),
            launches: Family::default(),
            off_cpu: Family::default(),
            runqueue: Family::new_with_constructor(seconds_histogram),
            step_seconds: Family::new_with_constructor(seconds_histogram),
            step_host_seconds: Family::new_with_constructor(seconds_histogram),
            step_device_wait_seconds: Family::new_with_constructor(seconds_histogram),
            step_kernel_launches: Family::default(),
            step_graph_launches: Family::default(),
            records: Family::default(),
            kernel_drops: Counter::default(),
            sink_records: Family::default(),
            cpu: Counter::default(),
            rss: Gauge::default(),
            process_cpu: Counter::default(),
            process_rss: Gauge::default(),
            process_start: Gauge::default(),
            process_open_fds: Gauge::default(),
            build_info: Family::default(),
            recorder_bytes: Gauge::default(),
            recorder_evicted: Counter::default(),
            kernel_skips: Counter::default(),
            decode_errors: Counter::default(),
            interpret_losses: Family::default(),
            probe_attaches: Family::default(),
            probe_slots: Gauge::default(),
            probe_files_released: Counter::default(),
            dumps: Family::default(),
            folded: Family::default(),
            in_flight_oldest: Family::default(),
            findings: Family::default(),
            incidents: Family::default(),
            cache_bytes: Family::default(),
            cache_evictions: Family::default(),
            cache_evicted_bytes: Family::default(),
            cache_refused: Family::default(),
        };
        // Every kind from the start: a query for a kind sees 0, not nothing.
        for kind in crate::model::FindingKind::ALL {
            let labels = KindLabels {
                kind: kind.as_str().into(),
            };
            let _ = f.findings.get_or_create(&labels);
            let _ = f.incidents.get_or_create(&labels);
        }
        let r = registry;
        r.register(
            "xpuscope_collective_duration_seconds",
            "Collective and point-to-point calls, entry to return",
            f.collective_seconds.clone(),
        );
        r.register(
            "xpuscope_collective_bytes",
            "Bytes of collective and point-to-point calls",
            f.collective_bytes.clone(),
        );
        r.register(
            "xpuscope_collective_last_seq",
            "Last collective number seen on each communicator",
            f.last_seq.clone(),
        );
        r.register(
            "xpuscope_sync_duration_seconds",
            "Stream, event and device synchronizations, entry to return",
            f.sync_seconds.clone(),
        );
        r.register(
            "xpuscope_device_memory_bytes",
            "Device memory held, as allocated and freed since attach",
            f.memory.clone(),
        );
        r.register(
            "xpuscope_device_ooms",
            "Failed device-memory allocations, each attempt (a caching allocator's retry that then gets the memory counts too; findings_total{kind=\"device_oom\"} counts the failures that stood)",
            f.ooms.clone(),
        );
        r.register(
            "xpuscope_launches",
            "Kernel and graph launches",
            f.launches.clone(),
        );
        r.register(
            "xpuscope_off_cpu_seconds",
            "Time the training threads spent off CPU",
            f.off_cpu.clone(),
        );
        r.register(
            "xpuscope_runqueue_delay_seconds",
            "Time preempted training threads waited for a CPU",
            f.runqueue.clone(),
        );
        r.register(
            "xpuscope_step_duration_seconds",
            "Training steps of each rank (from its gradient all-reduces)",
            f.step_seconds.clone(),
        );
        r.register(
            "xpuscope_step_host_seconds",
            "Per step, the training thread on its CPU outside device calls: its host work (a step mostly this is host-bound)",
            f.step_host_seconds.clone(),
        );
        r.register(
            "xpuscope_step_device_wait_seconds",
            "Per step, the training thread in device calls: waiting for its device or its peers (a step mostly this is device- or communication-bound)",
            f.step_device_wait_seconds.clone(),
        );
        r.register(
            "xpuscope_step_kernel_launches",
            "Kernel launches of the rank's process (all threads) in its finished steps, counted in the kernel at every capture level (xpuscope_launches counts recorded launch calls, at level 1)",
            f.step_kernel_launches.clone(),
        );
        r.register(
            "xpuscope_step_graph_launches",
            "Graph launches of the rank's process in its finished steps (each runs many kernels)",
            f.step_graph_launches.clone(),
        );
        r.register(
            "xpuscope_agent_records",
            "Records the pipeline produced, per kind",
            f.records.clone(),
        );
        r.register(
            "xpuscope_agent_kernel_dropped_events",
            "Events the kernel rings could not hold",
            f.kernel_drops.clone(),
        );
        r.register(
            "xpuscope_agent_sink_records",
            "Records offered to each sink: delivered, or dropped because it lagged",
            f.sink_records.clone(),
        );
        r.register(
            "xpuscope_agent_cpu_seconds",
            "CPU time of the agent",
            f.cpu.clone(),
        );
        r.register(
            "xpuscope_agent_resident_bytes",
            "Resident memory of the agent",
            f.rss.clone(),
        );
        r.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds (the agent's)",
            f.process_cpu.clone(),
        );
        r.register(
            "process_resident_memory_bytes",
            "Resident memory size in bytes (the agent's)",
            f.process_rss.clone(),
        );
        r.register(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds (the agent's)",
            f.process_start.clone(),
        );
        r.register(
            "process_open_fds",
            "Number of open file descriptors (the agent's)",
            f.process_open_fds.clone(),
        );
        r.register(
            "xpuscope_build_info",
            "The agent's version and the commit it was built from (always 1)",
            f.build_info.clone(),
        );
        f.build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
                commit: env!("XPUSCOPE_COMMIT").to_string(),
            })
            .set(1);
        f.process_start
            .set(crate::own_usage::start_time_unix_seconds().unwrap_or(0) as i64);
        r.register(
            "xpuscope_agent_kernel_skipped_events",
            "Program runs the kernel skipped because a program already ran on that CPU (their events are missing)",
            f.kernel_skips.clone(),
        );
        r.register(
            "xpuscope_agent_decode_errors",
            "Ring records the agent could not decode (skipped)",
            f.decode_errors.clone(),
        );
        r.register(
            "xpuscope_agent_interpret_losses",
            "What the interpret stage could not make whole: stacks the kernel could not take (stack_errors) or whose switch-out was not found (stacks_unmatched), Python stacks not read, allocation stacks not given a site (alloc_sites_over_limit), returns without their entry, activity records not read or not decodable, records of unknown probes",
            f.interpret_losses.clone(),
        );
        r.register(
            "xpuscope_agent_device_probe_attaches",
            "Device-library probe attaches: functions made live (attached), functions or libraries that could not be attached (failed), library files whose probes took over a second (slow: calls in that time unrecorded)",
            f.probe_attaches.clone(),
        );
        r.register(
            "xpuscope_agent_device_probe_slots",
            "Device-library probe slots held now (one per probed function of each library file in use; at most probes.slots)",
            f.probe_slots.clone(),
        );
        r.register(
            "xpuscope_agent_device_probe_files_released",
            "Library files whose probes were released because no traced process used them for probes.release_after (their slots reused)",
            f.probe_files_released.clone(),
        );
        r.register(
            "xpuscope_flight_recorder_bytes",
            "Estimated bytes the flight recorder holds",
            f.recorder_bytes.clone(),
        );
        r.register(
            "xpuscope_flight_recorder_evicted_records",
            "Records evicted from the flight recorder by its byte bound",
            f.recorder_evicted.clone(),
        );
        r.register(
            "xpuscope_flight_recorder_dumps",
            "Flight recorder dumps by trigger and outcome",
            f.dumps.clone(),
        );
        r.register(
            "xpuscope_in_flight_oldest_seconds",
            "How long the oldest collective or sync still running on the rank has run",
            f.in_flight_oldest.clone(),
        );
        r.register(
            "xpuscope_findings",
            "Findings of the detectors (hang, device_oom, crash)",
            f.findings.clone(),
        );
        r.register(
            "xpuscope_incidents",
            "Faults: findings that follow from no earlier one, by kind (a peer that waited for a slow rank is counted in findings only)",
            f.incidents.clone(),
        );
        r.register(
            "xpuscope_agent_cache_bytes",
            "Bytes held by the caches traced processes feed (python: code objects; cfi: files' unwind tables)",
            f.cache_bytes.clone(),
        );
        r.register(
            "xpuscope_agent_cache_evictions",
            "Entries evicted from those caches by their byte bounds",
            f.cache_evictions.clone(),
        );
        r.register(
            "xpuscope_agent_cache_evicted_bytes",
            "Bytes evicted from those caches by their byte bounds",
            f.cache_evicted_bytes.clone(),
        );
        r.register(
            "xpuscope_agent_cache_refused",
            "Items those caches refused unread as larger than their cap or the room left",
            f.cache_refused.clone(),
        );
        r.register(
            "xpuscope_metrics_series_folded",
            "Observations folded into `other` label values by the cardinality bound",
            f.folded.clone(),
        );
        f
    }
}

/// Where the agent-level figures come from (filled by the service as it
/// starts the other sinks).
#[derive(Default)]
pub struct AgentSources {
    pub sinks: Mutex<Vec<(&'static str, Arc<SinkCounters>)>>,
    pub recorder: Mutex<Option<Arc<RecorderStats>>>,
    /// The device probes' counters (the kernel side's, updated each round).
    pub probe_stats: Arc<Mutex<crate::kernel::probes::DeviceProbeStats>>,
    /// What the kernel side lost (updated each round).
    pub kernel_losses: Arc<KernelLosses>,
    /// The interpret stage's counters (published at each sink tick).
    pub interpret: Arc<Mutex<crate::model::counters::InterpretCounters>>,
    /// The pipeline's caches that traced processes feed (the pipeline's
    /// enricher is built with these).
    pub caches: crate::model::counters::CacheCounters,
}

/// What the kernel side of the service lost, as running totals: for the
/// metrics and `agent ctl status` (the trace carries the drops as records).
#[derive(Debug, Default)]
pub struct KernelLosses {
    /// Events the kernel rings could not hold.
    pub dropped_events: AtomicU64,
    /// Program runs the kernel skipped (a program already running on that
    /// CPU: recursion protection), per the programs' own counts.
    pub skipped_events: AtomicU64,
    /// Ring records collect could not decode (counted, then skipped).
    pub decode_errors: AtomicU64,
}

/// What `/metrics` and `/healthz` read.
#[derive(Clone)]
pub struct MetricsHandle {
    registry: Arc<Registry>,
    /// CLOCK_BOOTTIME ns of the last batch or tick the sink saw.
    last_heard: Arc<AtomicU64>,
}

impl MetricsHandle {
    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Whether the pipeline fed this sink within [`LIVENESS_NS`] of `now`.
    pub fn alive(&self, now: u64) -> bool {
        now.saturating_sub(self.last_heard.load(Ordering::Relaxed)) < LIVENESS_NS
    }
}

/// Running totals turned into counter increments.
#[derive(Default)]
struct Deltas {
    last: HashMap<String, f64>,
}

impl Deltas {
    fn delta(&mut self, key: &str, total: f64) -> f64 {
        let last = self.last.insert(key.to_string(), total).unwrap_or(0.0);
        (total - last).max(0.0)
    }
}

/// The series one process feeds, resolved when first fed: a lookup by
/// labels clones and hashes them, and the stream brings ~100 k records a
/// second (a cached handle shares the series' value).
#[derive(Default)]
struct ProcessSeries {
    off_cpu: Option<(Counter<f64, AtomicU64>, Histogram)>,
    sync: Option<Histogram>,
    launches: Option<Counter>,
    collectives: FxHashMap<CollectiveKey, CollectiveSeries>,
}

/// A process's collectives of one communicator, op and dtype: the library,
/// the communicator's identity hash (or its handle when unknown), op, dtype.
type CollectiveKey = (
    Library,
    Option<u64>,
    Option<u64>,
    &'static str,
    &'static str,
);

struct CollectiveSeries {
    seconds: Histogram,
    bytes: Counter,
    /// The communicator's last collective number, once a call carried one.
    last_seq: Option<Gauge>,
}

pub struct MetricsSink {
    f: Families,
    node: String,
    ranks: HashMap<u32, RankLabels>,
    /// Per live process, the series it feeds (dropped with its labels).
    resolved: FxHashMap<u32, ProcessSeries>,
    /// `xpuscope_agent_records_total` per record kind, resolved once.
    kind_counters: [Option<Counter>; Record::KINDS],
    /// Device-memory series per process (removed at its exit: a gauge of a
    /// gone process would read as memory still held).
    memory_series: HashMap<u32, HashSet<DeviceLabels>>,
    /// Hang-gauge series set by the last snapshot (zeroed when their rank
    /// has nothing running).
    in_flight_series: HashSet<RankLabels>,
    /// The series per family and per rank, and which processes feed them.
    book: SeriesBook,
    /// Whether a process still runs (the sweep's backstop for an exit the
    /// stream did not carry); a fake in tests.
    alive: fn(u32) -> bool,
    /// Processes the last sweep found gone from `/proc` while the stream
    /// had not yet carried their exit, and when. Their last records may
    /// still be on the way (the pipeline runs behind the kernel on a
    /// loaded machine), so a process is dropped only when the next sweep
    /// finds it gone too.
    gone_since: HashMap<u32, u64>,
    /// Ranks whose process ended, and when: records about them that come
    /// after their exit (a step split the detect sink fed back) still count
    /// under their rank. Kept [`ENDED_KEPT_NS`].
    ended: HashMap<u32, (RankLabels, u64)>,
    /// The latest CLOCK_BOOTTIME ns the sink was told of.
    latest: u64,
    next_sweep: u64,
    deltas: Deltas,
    sources: Arc<AgentSources>,
    last_heard: Arc<AtomicU64>,
    gpu: gpu::GpuMetrics,
}

impl MetricsSink {
    /// The sink, what serves it, and where the service plugs in the
    /// agent's other counters.
    pub fn new(node: &str) -> (Self, MetricsHandle, Arc<AgentSources>) {
        let mut registry = Registry::default();
        let f = Families::register(&mut registry);
        let gpu = gpu::GpuMetrics::register(&mut registry);
        let last_heard = Arc::new(AtomicU64::new(crate::host::boottime_ns()));
        let sources = Arc::new(AgentSources::default());
        let sink = Self {
            f,
            node: node.chars().take(128).collect(),
            ranks: HashMap::new(),
            resolved: FxHashMap::default(),
            kind_counters: std::array::from_fn(|_| None),
            memory_series: HashMap::new(),
            in_flight_series: HashSet::new(),
            book: SeriesBook::default(),
            alive: process_alive,
            gone_since: HashMap::new(),
            ended: HashMap::new(),
            latest: 0,
            next_sweep: 0,
            deltas: Deltas::default(),
            sources: sources.clone(),
            last_heard: last_heard.clone(),
            gpu,
        };
        let handle = MetricsHandle {
            registry: Arc::new(registry),
            last_heard,
        };
        (sink, handle, sources)
    }

    /// The labels of `tgid`'s rank (empty job and rank until its identity
    /// is known); a process seen for the first time starts feeding them.
    fn rank(&mut self, tgid: u32) -> RankLabels {
        if let Some(r) = self.ranks.get(&tgid) {
            return r.clone();
        }
        let r = RankLabels {
            node: self.node.clone(),
            ..Default::default()
        };
        self.book.feeds(tgid, &r);
        self.ranks.insert(tgid, r.clone());
        r
    }

    fn identity(&mut self, tgid: u32, id: &RankIdentity) {
        let v = |s: &Option<String>| s.clone().unwrap_or_default();
        let labels = RankLabels {
            training_job: v(&id.job),
            rank: v(&id.rank),
            local_rank: v(&id.local_rank),
            node: self.node.clone(),
        };
        if let Some(old) = self.ranks.get(&tgid)
            && *old != labels
        {
            let old = old.clone();
            self.book.stops_feeding(tgid, &old, self.latest);
        }
        self.book.feeds(tgid, &labels);
        self.ranks.insert(tgid, labels);
        // Its series are those of its new labels from now on.
        self.resolved.remove(&tgid);
    }

    /// `labels` if `family` has room for them (or has them), else the
    /// folded set `fold(labels)`, counted; a new series is kept in its
    /// rank's book with `keep`, and a process whose series fold feeds the
    /// folded rank too.
    fn admit<L: Hash + Clone + RankPart>(
        &mut self,
        tgid: u32,
        family: &'static str,
        labels: L,
        fold: impl FnOnce(L) -> L,
        keep: impl FnOnce(&mut RankSeries, &L),
    ) -> L {
        match self.book.admit(family, &labels) {
            Admission::Known => labels,
            Admission::New => {
                keep(self.book.owner(labels.rank_part()), &labels);
                labels
            }
            Admission::Full => {
                self.f
                    .folded
                    .get_or_create(&FamilyLabels {
                        family: family.into(),
                    })
                    .inc();
                let folded = fold(labels);
                let rank = folded.rank_part();
                self.book.feeds(tgid, &rank);
                keep(self.book.owner(rank), &folded);
                folded
            }
        }
    }

    fn admit_rank(&mut self, tgid: u32, family: RankFamily, r: RankLabels) -> RankLabels {
        self.admit(
            tgid,
            family.bound_name(),
            r,
            |r| RankLabels {
                rank: FOLDED.into(),
                local_rank: FOLDED.into(),
                ..r
            },
            |o, _| {
                if !o.rank_families.contains(&family) {
                    o.rank_families.push(family);
                }
            },
        )
    }

    /// The last thread of `tgid` exited at `ts`.
    fn process_ended(&mut self, tgid: u32, ts: u64) {
        self.gone_since.remove(&tgid);
        if let Some(labels) = self.ranks.remove(&tgid)
            && !(labels.rank.is_empty() && labels.training_job.is_empty())
        {
            self.ended.insert(tgid, (labels, ts));
        }
        self.resolved.remove(&tgid);
        for labels in self.memory_series.remove(&tgid).unwrap_or_default() {
            self.f.memory.remove(&labels);
        }
        self.book.exited(tgid, ts);
    }

    /// Removes the series of ranks whose processes all exited longer than
    /// the retention ago (every few seconds of `now`).
    fn sweep(&mut self, now: u64) {
        const EVERY_NS: u64 = 10_000_000_000;
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now + EVERY_NS;
        self.ended
            .retain(|_, (_, exited)| now.saturating_sub(*exited) < ENDED_KEPT_NS);
        let gone: HashMap<u32, u64> = self
            .ranks
            .keys()
            .copied()
            .filter(|t| !(self.alive)(*t))
            .map(|t| (t, self.gone_since.get(&t).copied().unwrap_or(now)))
            .collect();
        // Gone at two sweeps in a row: its exit was lost, not late.
        let previous = std::mem::take(&mut self.gone_since);
        for (tgid, since) in gone {
            if previous.contains_key(&tgid) {
                self.process_ended(tgid, since);
            } else {
                self.gone_since.insert(tgid, since);
            }
        }
        for (rank, owner) in self.book.expire(now) {
            let f = &self.f;
            for family in owner.rank_families {
                match family {
                    RankFamily::Sync => {
                        f.sync_seconds.remove(&rank);
                    }
                    RankFamily::Launches => {
                        f.launches.remove(&rank);
                    }
                    RankFamily::OffCpu => {
                        f.off_cpu.remove(&rank);
                        f.runqueue.remove(&rank);
                    }
                    RankFamily::InFlightOldest => {
                        f.in_flight_oldest.remove(&rank);
                        self.in_flight_series.remove(&rank);
                    }
                    RankFamily::Steps => {
                        f.step_seconds.remove(&rank);
                        f.step_host_seconds.remove(&rank);
                        f.step_device_wait_seconds.remove(&rank);
                        f.step_kernel_launches.remove(&rank);
                        f.step_graph_launches.remove(&rank);
                    }
                }
            }
            for l in &owner.collective {
                f.collective_seconds.remove(l);
                f.collective_bytes.remove(l);
            }
            for l in &owner.comm {
                f.last_seq.remove(l);
            }
            for l in &owner.device {
                f.memory.remove(l);
                f.ooms.remove(l);
            }
        }
    }

    /// Counts a batch's records by kind: one atomic add per kind present,
    /// where one per record was a tenth of this sink's time.
    fn count_kinds(&mut self, batch: &[Record]) {
        let mut counts = [0u64; Record::KINDS];
        for r in batch {
            counts[r.kind_index()] += 1;
        }
        for (kind, n) in counts.into_iter().enumerate() {
            if n == 0 {
                continue;
            }
            self.kind_counters[kind]
                .get_or_insert_with(|| {
                    self.f
                        .records
                        .get_or_create(&KindLabels {
                            kind: Record::KIND_NAMES[kind].into(),
                        })
                        .clone()
                })
                .inc_by(n);
        }
    }

    fn record(&mut self, r: &Record) {
        match r {
            Record::Identity { tgid, identity } => self.identity(*tgid, identity),
            Record::DeviceCall(c) if c.unmatched.is_none() => self.device_call(c),
            Record::OffCpu(i) => self.off_cpu(i),
            Record::StepSplit(s) => self.step_split(s),
            Record::InFlight(s) => self.in_flight(s),
            Record::GpuSample(s) => self.gpu.sample(&self.node, s, &self.ranks),
            Record::GpuXid(x) => self.gpu.xid(&self.node, x, &self.ranks),
            Record::Finding(f) => {
                let labels = KindLabels {
                    kind: f.kind.as_str().into(),
                };
                self.f.findings.get_or_create(&labels).inc();
                if f.link.follows_from.is_none() {
                    self.f.incidents.get_or_create(&labels).inc();
                }
            }
            Record::Drops { total, .. } => {
                let d = self.deltas.delta("kernel_drops", *total as f64);
                self.f.kernel_drops.inc_by(d as u64);
            }
            Record::Exit {
                exit,
                process_ended: true,
            } => {
                self.latest = self.latest.max(exit.ts);
                self.process_ended(exit.tgid, exit.ts);
            }
            _ => {}
        }
    }

    fn device_call(&mut self, c: &DeviceCallRecord) {
        let call = &c.call;
        let tgid = call.tgid;
        let seconds = c.end_ts().saturating_sub(call.start_ts) as f64 / 1e9;
        let (op, dtype, bytes) = match (&call.kind, &call.args) {
            (CallKind::Collective(op), CallArgs::Collective(a)) => (
                CommOp::from(*op).metric_label(),
                a.dtype.map(|d| d.name()).unwrap_or(""),
                a.bytes,
            ),
            (CallKind::SendRecv(_), CallArgs::SendRecv(a)) => (
                CommOp::of(call.kind).map_or("", CommOp::metric_label),
                a.dtype.name(),
                a.bytes,
            ),
            (CallKind::Sync(_), _) => {
                if self.resolved.get(&tgid).is_none_or(|p| p.sync.is_none()) {
                    let rank = self.rank(tgid);
                    let labels = self.admit_rank(tgid, RankFamily::Sync, rank);
                    let h = self.f.sync_seconds.get_or_create(&labels).clone();
                    self.resolved.entry(tgid).or_default().sync = Some(h);
                }
                if let Some(h) = self.resolved.get(&tgid).and_then(|p| p.sync.as_ref()) {
                    h.observe(seconds);
                }
                return;
            }
            (CallKind::Launch(_), _) => {
                if self
                    .resolved
                    .get(&tgid)
                    .is_none_or(|p| p.launches.is_none())
                {
                    let rank = self.rank(tgid);
                    let labels = self.admit_rank(tgid, RankFamily::Launches, rank);
                    let h = self.f.launches.get_or_create(&labels).clone();
                    self.resolved.entry(tgid).or_default().launches = Some(h);
                }
                if let Some(h) = self.resolved.get(&tgid).and_then(|p| p.launches.as_ref()) {
                    h.inc();
                }
                return;
            }
            (CallKind::Malloc | CallKind::Free, _) => {
                let rank = self.rank(tgid);
                self.memory(tgid, rank, c);
                return;
            }
            _ => return,
        };
        let key: CollectiveKey = (
            call.library,
            call.comm.as_ref().and_then(|cc| cc.id_hash),
            call.comm
                .as_ref()
                .filter(|cc| cc.id_hash.is_none())
                .map(|cc| cc.handle),
            op,
            dtype,
        );
        let seq = call.comm.as_ref().and_then(|cc| cc.seq);
        let known = self
            .resolved
            .get(&tgid)
            .and_then(|p| p.collectives.get(&key));
        if known.is_none_or(|k| seq.is_some() && k.last_seq.is_none()) {
            let series = self.resolve_collective(c, op, dtype, seq.is_some());
            self.resolved
                .entry(tgid)
                .or_default()
                .collectives
                .insert(key, series);
        }
        let Some(series) = self
            .resolved
            .get(&tgid)
            .and_then(|p| p.collectives.get(&key))
        else {
            return;
        };
        series.seconds.observe(seconds);
        if let Some(b) = bytes {
            series.bytes.inc_by(b);
        }
        if let (Some(seq), Some(g)) = (seq, &series.last_seq) {
            g.set(g.get().max(seq as i64));
        }
    }

    /// The series of a process's collectives on one communicator, op and
    /// dtype (admitted under the bound), and of the communicator's last
    /// collective number when `with_seq`.
    fn resolve_collective(
        &mut self,
        c: &DeviceCallRecord,
        op: &'static str,
        dtype: &'static str,
        with_seq: bool,
    ) -> CollectiveSeries {
        let call = &c.call;
        let rank = self.rank(call.tgid);
        let comm = call.comm.as_ref().map_or_else(
            || format!("{}:unknown", call.library.name()),
            |cc| match cc.id_hash {
                Some(h) => format!("{}:{:08x}", call.library.name(), h as u32),
                None => format!("{}:handle-{:x}", call.library.name(), cc.handle),
            },
        );
        let labels = CollectiveLabels {
            training_job: rank.training_job.clone(),
            rank: rank.rank.clone(),
            local_rank: rank.local_rank.clone(),
            node: rank.node.clone(),
            comm: comm.clone(),
            op: op.into(),
            dtype: dtype.into(),
        };
        let labels = self.admit(
            call.tgid,
            "collective",
            labels,
            |l| CollectiveLabels {
                rank: FOLDED.into(),
                local_rank: FOLDED.into(),
                comm: FOLDED.into(),
                op: FOLDED.into(),
                dtype: FOLDED.into(),
                ..l
            },
            |o, l| {
                if !o.collective.contains(l) {
                    o.collective.push(l.clone());
                }
            },
        );
        let seconds = self.f.collective_seconds.get_or_create(&labels).clone();
        let bytes = self.f.collective_bytes.get_or_create(&labels).clone();
        let last_seq = with_seq.then(|| {
            let labels = CommLabels {
                training_job: rank.training_job,
                rank: rank.rank,
                local_rank: rank.local_rank,
                node: rank.node,
                comm,
            };
            let labels = self.admit(
                call.tgid,
                "last_seq",
                labels,
                |l| CommLabels {
                    rank: FOLDED.into(),
                    local_rank: FOLDED.into(),
                    comm: FOLDED.into(),
                    ..l
                },
                |o, l| {
                    if !o.comm.contains(l) {
                        o.comm.push(l.clone());
                    }
                },
            );
            self.f.last_seq.get_or_create(&labels).clone()
        });
        CollectiveSeries {
            seconds,
            bytes,
            last_seq,
        }
    }

    fn memory(&mut self, tgid: u32, rank: RankLabels, c: &DeviceCallRecord) {
        let Some(m) = &c.call.memory else {
            return;
        };
        let vendor = match m.device.vendor {
            xpuscope_probes::catalog::Vendor::Nvidia => "gpu",
            xpuscope_probes::catalog::Vendor::Ascend => "npu",
        };
        let labels = DeviceLabels {
            training_job: rank.training_job,
            rank: rank.rank,
            local_rank: rank.local_rank,
            node: rank.node,
            device: format!("{vendor}{}", m.device.index),
        };
        let labels = self.admit(
            tgid,
            "device_memory",
            labels,
            |l| DeviceLabels {
                rank: FOLDED.into(),
                local_rank: FOLDED.into(),
                device: FOLDED.into(),
                ..l
            },
            |o, l| {
                if !o.device.contains(l) {
                    o.device.push(l.clone());
                }
            },
        );
        if m.failed_request.is_some() {
            self.f.ooms.get_or_create(&labels).inc();
        }
        self.f
            .memory
            .get_or_create(&labels)
            .set(m.held_after as i64);
        self.memory_series.entry(tgid).or_default().insert(labels);
    }

    /// The hang gauge: per rank, the age of its oldest running call.
    fn in_flight(&mut self, s: &InFlightSnapshot) {
        let mut oldest: HashMap<u32, u64> = HashMap::new();
        for c in &s.calls {
            let age = s.ts.saturating_sub(c.start_ts);
            let e = oldest.entry(c.tgid).or_default();
            *e = (*e).max(age);
        }
        let mut now = HashSet::new();
        for (tgid, age) in oldest {
            let rank = self.rank(tgid);
            let labels = self.admit_rank(tgid, RankFamily::InFlightOldest, rank);
            let g = self.f.in_flight_oldest.get_or_create(&labels);
            // Several processes folded into one series: the oldest wins.
            let seconds = age as f64 / 1e9;
            if !now.contains(&labels) || g.get() < seconds {
                g.set(seconds);
            }
            now.insert(labels);
        }
        for gone in self.in_flight_series.difference(&now) {
            self.f.in_flight_oldest.get_or_create(gone).set(0.0);
        }
        self.in_flight_series = now;
    }

    /// A rank's step ended: where its main thread spent it (the detect
    /// sink's split, fed back into the stream).
    fn step_split(&mut self, r: &StepSplitRecord) {
        let s = r.split;
        // Fed back after the step: its process may have ended since (a
        // pid that came back as another process ended after it began).
        let rank = match self.ended.get(&r.tgid) {
            Some((labels, exited)) if r.end <= *exited => labels.clone(),
            _ => self.rank(r.tgid),
        };
        let labels = self.admit_rank(r.tgid, RankFamily::Steps, rank);
        let secs = |ns: u64| ns as f64 / 1e9;
        let f = &self.f;
        f.step_seconds.get_or_create(&labels).observe(secs(s.dur));
        f.step_host_seconds
            .get_or_create(&labels)
            .observe(secs(s.host));
        f.step_device_wait_seconds
            .get_or_create(&labels)
            .observe(secs(s.in_device_calls));
        if let Some(l) = r.launches {
            f.step_kernel_launches
                .get_or_create(&labels)
                .inc_by(l.kernels);
            f.step_graph_launches
                .get_or_create(&labels)
                .inc_by(l.graphs);
        }
    }

    fn off_cpu(&mut self, i: &OffCpuInterval) {
        let seconds = i.duration() as f64 / 1e9;
        let observe = |(off_cpu, runqueue): &(Counter<f64, AtomicU64>, Histogram)| {
            off_cpu.inc_by(seconds);
            if i.preempted_by.is_some() && !i.truncated {
                runqueue.observe(seconds);
            }
        };
        // A third of the records: one lookup once the process's series
        // are resolved.
        if let Some(h) = self.resolved.get(&i.tgid).and_then(|p| p.off_cpu.as_ref()) {
            observe(h);
            return;
        }
        let rank = self.rank(i.tgid);
        let rank = self.admit_rank(i.tgid, RankFamily::OffCpu, rank);
        let h = (
            self.f.off_cpu.get_or_create(&rank).clone(),
            self.f.runqueue.get_or_create(&rank).clone(),
        );
        observe(&h);
        self.resolved.entry(i.tgid).or_default().off_cpu = Some(h);
    }

    /// The agent's own figures, as of now.
    fn agent(&mut self, lost: &SinkCounters) {
        let own = OwnUsage::now();
        let d = self.deltas.delta("cpu", own.cpu_seconds);
        self.f.cpu.inc_by(d);
        self.f.process_cpu.inc_by(d);
        self.f.rss.set(own.resident_bytes as i64);
        self.f.process_rss.set(own.resident_bytes as i64);
        if let Some(fds) = crate::own_usage::open_fds() {
            self.f.process_open_fds.set(fds as i64);
        }
        let mut sinks: Vec<(String, u64, u64)> = vec![(
            "metrics".into(),
            lost.delivered_records.load(Ordering::Relaxed),
            lost.dropped(),
        )];
        if let Ok(list) = self.sources.sinks.lock() {
            sinks.extend(list.iter().map(|(name, c)| {
                (
                    name.to_string(),
                    c.delivered_records.load(Ordering::Relaxed),
                    c.dropped(),
                )
            }));
        }
        for (sink, delivered, dropped) in sinks {
            for (outcome, total) in [("delivered", delivered), ("dropped", dropped)] {
                let d = self
                    .deltas
                    .delta(&format!("sink/{sink}/{outcome}"), total as f64);
                self.f
                    .sink_records
                    .get_or_create(&SinkLabels {
                        sink: sink.clone(),
                        outcome: outcome.into(),
                    })
                    .inc_by(d as u64);
            }
        }
        let c = self
            .sources
            .interpret
            .lock()
            .map(|c| *c)
            .unwrap_or_default();
        for (what, total) in [
            ("stack_errors", c.stack_errors),
            ("stacks_unmatched", c.stacks_unmatched),
            ("python_stack_errors", c.python_stack_errors),
            ("alloc_stack_errors", c.alloc_stack_errors),
            ("alloc_sites_over_limit", c.alloc_sites_over_limit),
            ("returns_without_entry", c.returns_without_entry),
            ("activity_unread", c.activity_unread),
            ("activity_errors", c.activity_errors),
            ("unknown_probes", c.unknown_probes),
        ] {
            let d = self
                .deltas
                .delta(&format!("interpret/{what}"), total as f64);
            self.f
                .interpret_losses
                .get_or_create(&WhatLabels { what: what.into() })
                .inc_by(d as u64);
        }
        let losses = &self.sources.kernel_losses;
        let d = self.deltas.delta(
            "kernel_skips",
            losses.skipped_events.load(Ordering::Relaxed) as f64,
        );
        self.f.kernel_skips.inc_by(d as u64);
        let d = self.deltas.delta(
            "decode_errors",
            losses.decode_errors.load(Ordering::Relaxed) as f64,
        );
        self.f.decode_errors.inc_by(d as u64);
        let probes = self
            .sources
            .probe_stats
            .lock()
            .map(|s| *s)
            .unwrap_or_default();
        for (outcome, total) in [
            ("attached", probes.attached),
            ("failed", probes.attach_failures),
            ("slow", probes.slow_attaches),
        ] {
            let d = self
                .deltas
                .delta(&format!("probes/{outcome}"), total as f64);
            self.f
                .probe_attaches
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.into(),
                })
                .inc_by(d as u64);
        }
        self.f.probe_slots.set(probes.slots_in_use as i64);
        let d = self
            .deltas
            .delta("probes/files_released", probes.files_released as f64);
        self.f.probe_files_released.inc_by(d as u64);
        let caches = self.sources.caches.report();
        for (cache, c) in [("python", caches.python), ("cfi", caches.cfi)] {
            let labels = CacheLabels {
                cache: cache.into(),
            };
            self.f
                .cache_bytes
                .get_or_create(&labels)
                .set(c.bytes as i64);
            for (family, what, total) in [
                (&self.f.cache_evictions, "evicted", c.evicted),
                (
                    &self.f.cache_evicted_bytes,
                    "evicted_bytes",
                    c.evicted_bytes,
                ),
                (&self.f.cache_refused, "refused", c.refused),
            ] {
                let d = self
                    .deltas
                    .delta(&format!("cache/{cache}/{what}"), total as f64);
                family.get_or_create(&labels).inc_by(d as u64);
            }
        }
        let recorder = self.sources.recorder.lock().ok().and_then(|r| r.clone());
        if let Some(stats) = recorder {
            self.f
                .recorder_bytes
                .set(stats.bytes.load(Ordering::Relaxed) as i64);
            let d = self.deltas.delta(
                "evicted",
                stats.evicted_records.load(Ordering::Relaxed) as f64,
            );
            self.f.recorder_evicted.inc_by(d as u64);
            for t in Trigger::ALL {
                let c = stats.trigger(t);
                for (outcome, n) in [
                    ("written", &c.written),
                    ("truncated", &c.truncated),
                    ("failed", &c.failed),
                    ("rate_limited", &c.rate_limited),
                ] {
                    let d = self.deltas.delta(
                        &format!("dump/{}/{outcome}", t.as_str()),
                        n.load(Ordering::Relaxed) as f64,
                    );
                    self.f
                        .dumps
                        .get_or_create(&TriggerLabels {
                            trigger: t.as_str().into(),
                            outcome: outcome.into(),
                        })
                        .inc_by(d as u64);
                }
            }
        }
    }
}

/// Whether process `tgid` runs (its `/proc` entry is there).
fn process_alive(tgid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{tgid}")).exists()
}

impl Sink for MetricsSink {
    type Output = ();

    fn on_batch(&mut self, batch: &[Record], lost: &SinkCounters) -> Result<()> {
        self.count_kinds(batch);
        for r in batch {
            self.record(r);
        }
        let _ = lost;
        self.last_heard
            .store(crate::host::boottime_ns(), Ordering::Relaxed);
        Ok(())
    }

    fn on_tick(&mut self, now: u64, lost: &SinkCounters) -> Result<()> {
        self.latest = self.latest.max(now);
        self.sweep(now);
        self.agent(lost);
        self.last_heard
            .store(crate::host::boottime_ns(), Ordering::Relaxed);
        Ok(())
    }

    fn finish(mut self, _end: u64, lost: &SinkCounters) -> Result<()> {
        self.agent(lost);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
