//! The collective detectors: `slow_rank`, `late_arrival` and `slow_link`,
//! from each member's entry into a collective (communicator identity hash
//! plus exact sequence number, as `hang` matches them) and the end of the
//! first stream sync after it on the same thread (NCCL and HCCL enqueue a
//! collective and return; its end shows in the sync that waits for it).
//!
//! - An operation (communicator, seq) is analysed once every member of the
//!   communicator (its size) entered it. Its last arrival is *late* when it
//!   came after the median arrival of the other members, less its own
//!   usual offset at that function (the median of its on-time ones: a
//!   pipeline stage that always enters later is not late), by more than a
//!   threshold judged against the job itself ([`ThresholdParts`]): the
//!   largest of `late_min` (a floor), `late_mad_k` robust deviations
//!   (1.4826 MAD) of the others' arrivals (robust to one outlier; with two
//!   members only the other parts count), `late_mad_k` robust deviations
//!   of the member's own on-time offsets (its recent baseline: a rank on a
//!   busy host that arrives a few ms apart every step), and a quarter of
//!   its usual step (the median of its recent data-parallel all-reduce
//!   intervals). A member is judged once it entered the function
//!   `WARMUP_OPS` times on the communicator (start-up skew): a rank slow
//!   from its first step has no on-time baseline and is not found.
//! - `slow_rank`: a rank late at `slow_rank_persist` or more of the last
//!   `2 * slow_rank_persist` operations of a communicator (a rank that
//!   persistently makes its peers wait). Its start is its first late
//!   arrival in that window; the evidence compares its delays with its own
//!   offset in earlier, on-time operations.
//! - `late_arrival`: a late arrival that did not become a `slow_rank`
//!   (reported once it left the window, or at the end), and that stands
//!   alone: it cost its peers at least half of the rank's usual step
//!   (100 ms before that is known). A one-off of a fraction of a step is
//!   what a busy host does now and then; repeated, it is a `slow_rank`.
//! - `slow_link`: operations of at least `link_min_bytes` (bandwidth, not
//!   latency, sets their time) whose transfer time per bus byte is
//!   `slow_link_ratio` times that of a typical communicator (the lower
//!   median of them): from the device where activity records link each
//!   member's collective kernel to its host call (the shortest member's
//!   kernel is the transfer), else from the host (the time from the last
//!   arrival to the first member's sync that saw it done, nobody arriving
//!   late: the later ones may have waited for a CPU). Its ranks are those in
//!   every slow communicator and in no fast one (where a link slows every
//!   operation through it); the members of the slow ones when that leaves
//!   none. It needs a fast communicator to compare with: a job with one
//!   communicator has no `slow_link`.
//!
//! Step: the number of all-reduces the rank entered before the operation on
//! its data-parallel communicator (the all-reduce communicator with the
//! fewest, one per step: the gradients), as `analysis::steps` anchors steps.

use foldhash::{HashMap, HashMapExt};
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::time::Duration;

use serde_json::json;
use xpuscope_probes::catalog::{CallKind, Collective};
use xpuscope_probes::decode::args::CallArgs;

use super::Ranks;
use super::step_marks::StepSource;
use crate::model::device::FlowId;
use crate::model::finding::comm_name;
use crate::model::{
    CommKey, DeviceCallRecord, DeviceWork, EnqueueMarker, Finding, FindingKind, WorkKind, comm_key,
};

/// Operations waiting for members, per communicator (oldest dropped:
/// a member that is not traced never arrives).
const MAX_OPEN_OPS: usize = 256;
/// All-reduce entries kept per rank and communicator (for steps).
const MAX_ALLREDUCES: usize = 1 << 20;
/// Link samples kept per communicator (the most recent).
const MAX_LINK_SAMPLES: usize = 4096;
/// On-time offsets kept per member and function (its own baseline).
const MAX_BASELINE: usize = 64;
/// Operations of a function a member must have entered before its
/// arrival is judged (start-up skew; its own baseline needs them).
const WARMUP_OPS: usize = 2;

/// Thresholds of the collective detectors (`DetectConfig`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveConfig {
    pub late_min: Duration,
    pub late_mad_k: u32,
    pub slow_rank_persist: u32,
    pub slow_link_ratio: u32,
    pub link_min_bytes: u64,
    pub link_min_ops: u32,
    /// A rank whose compute kernels take this percentage of its peers'
    /// (median) or more, `slow_rank_persist` steps in a row, is a slow
    /// rank (`device_compute`; needs activity records).
    pub slow_compute_pct: u32,
}

impl Default for CollectiveConfig {
    fn default() -> Self {
        Self {
            late_min: Duration::from_millis(10),
            late_mad_k: 5,
            slow_rank_persist: 3,
            slow_link_ratio: 3,
            link_min_bytes: 1 << 20,
            link_min_ops: 5,
            slow_compute_pct: 150,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Arrival {
    enter: u64,
    done: Option<u64>,
    /// The thread that entered it (its waits before are the evidence of
    /// why it came late).
    tid: u32,
}

/// A device call a thread blocked in (a sync, a blocking send or receive,
/// any call of [`MIN_WAIT_NS`] or more): what a late rank was doing while
/// its peers waited for it.
#[derive(Clone, Copy, Debug)]
struct Wait {
    start: u64,
    end: u64,
    function: &'static str,
}

/// Calls shorter than this are not waits.
const MIN_WAIT_NS: u64 = 100_000;
/// Waits kept per thread (the most recent).
const WAITS_PER_THREAD: usize = 32;

/// How much of `[from, to]` the thread spent in device calls that block,
/// when it last left one in it, and the longest's function.
fn waited_in(waits: Option<&VecDeque<Wait>>, from: u64, to: u64) -> Option<WaitedIn> {
    let mut w = WaitedIn::default();
    let mut longest = 0;
    for x in waits.into_iter().flatten() {
        let (a, b) = (x.start.max(from), x.end.min(to));
        if a >= b {
            continue;
        }
        w.ns += b - a;
        w.until = w.until.max(x.end);
        if b - a > longest {
            longest = b - a;
            w.function = x.function;
        }
    }
    (w.ns > 0).then_some(w)
}

/// A late member's waits in the time it was late (`waited_in`).
#[derive(Clone, Copy, Debug, Default)]
struct WaitedIn {
    ns: u64,
    until: u64,
    function: &'static str,
}

#[derive(Default)]
struct Op {
    size: u32,
    members: HashMap<u32, Arrival>,
    bus_bytes: u64,
    function: &'static str,
    /// Late arrival analysed (once every member entered).
    arrivals_done: bool,
    late: bool,
}

/// A late arrival not yet reported.
#[derive(Clone, Debug)]
struct Late {
    index: u64,
    seq: u64,
    enter: u64,
    delay_ns: u64,
    threshold_ns: u64,
    /// What set the threshold.
    parts: ThresholdParts,
    /// Its delay beyond its own usual offset.
    beyond_usual_ns: u64,
    /// Half its usual step (0 while not known).
    half_step_ns: u64,
    /// The communicator's usual worst lateness, times
    /// [`LONE_TAIL_FACTOR`] (0 while not known).
    usual_worst_ns: u64,
    /// Its waits in device calls while it was late.
    waited: Option<WaitedIn>,
    peers_wait_ns: u64,
    function: &'static str,
}

/// The parts of a late-arrival threshold: the largest sets it. Lateness is
/// judged against the job itself (how far its members' arrivals spread,
/// how much this member's own arrivals vary, how long its steps are) with
/// an absolute floor under it: on a busy or oversubscribed host every rank
/// arrives tens of ms apart now and then, and on a job of 1 s steps a
/// 10 ms lateness is noise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ThresholdParts {
    /// `late_min`.
    floor: u64,
    /// `late_mad_k` robust deviations of the other members' arrivals.
    peers_spread: u64,
    /// `late_mad_k` robust deviations of the member's own on-time offsets
    /// at this function (its recent baseline).
    own_jitter: u64,
    /// A share of the member's usual step time (1/[`STEP_SHARE_DIVISOR`]).
    step_share: u64,
}

impl ThresholdParts {
    fn threshold(&self) -> u64 {
        self.floor
            .max(self.peers_spread)
            .max(self.own_jitter)
            .max(self.step_share)
    }

    /// Which part set the threshold, in words.
    fn set_by(&self) -> &'static str {
        let t = self.threshold();
        if t == self.floor {
            "the floor"
        } else if t == self.step_share {
            "a quarter of the rank's usual step"
        } else if t == self.own_jitter {
            "the rank's own arrival jitter"
        } else {
            "the spread of its peers' arrivals"
        }
    }

    fn evidence(&self) -> serde_json::Value {
        json!({
            "floor_ms": ms(self.floor),
            "peers_spread_ms": ms(self.peers_spread),
            "own_jitter_ms": ms(self.own_jitter),
            "step_share_ms": ms(self.step_share),
        })
    }
}

/// A lateness under a quarter of the rank's usual step is not judged late.
const STEP_SHARE_DIVISOR: u64 = 4;

impl Late {
    /// The evidence of its waits, and the words for the summary.
    fn waited_evidence(&self) -> (serde_json::Value, String) {
        match self.waited {
            Some(w) => (
                json!({
                    "ms": ms(w.ns),
                    "function": w.function,
                    "until_ns": w.until,
                }),
                format!(
                    "; it spent {:.1} ms of its lateness waiting in {}",
                    ms(w.ns),
                    w.function
                ),
            ),
            None => (serde_json::Value::Null, String::new()),
        }
    }

    /// Whether it is worth a finding on its own (not part of a slow
    /// rank): it cost its peers at least half a step, and several times
    /// what the communicator's last arrivals usually cost. A one-off
    /// lateness of a fraction of a step is what a busy host does now and
    /// then (on a host with more ranks than CPUs, every operation's last
    /// arrival is late by a share of a step); the same lateness step after
    /// step is a `slow_rank`.
    fn stands_alone(&self) -> bool {
        self.beyond_usual_ns >= self.lone_bar()
    }

    /// The lateness [`Self::stands_alone`] asks for.
    fn lone_bar(&self) -> u64 {
        let half = match self.half_step_ns {
            0 => LONE_LATE_WITHOUT_STEPS_NS,
            half => half,
        };
        half.max(self.usual_worst_ns)
    }
}

/// A lone late arrival stands out from this many times the communicator's
/// usual worst lateness.
const LONE_TAIL_FACTOR: u64 = 3;
/// Operations whose last arrival's lateness the usual worst is taken over.
const LATENESS_WINDOW: usize = 64;
/// Operations needed before the usual worst counts.
const LATENESS_MIN_OPS: usize = 16;

/// The usual worst lateness of a communicator's last arrivals: the 90th
/// percentile of their recent lateness beyond their own usual offsets.
fn usual_worst(lateness: &VecDeque<u64>) -> Option<u64> {
    if lateness.len() < LATENESS_MIN_OPS {
        return None;
    }
    let mut v: Vec<u64> = lateness.iter().copied().collect();
    v.sort_unstable();
    Some(v[(v.len() * 9 / 10).min(v.len() - 1)])
}
/// A one-off lateness before the rank's step time is known (its first
/// steps, start-up skew among them) stands alone from this much.
const LONE_LATE_WITHOUT_STEPS_NS: u64 = 100_000_000;
/// On-time offsets a member needs before its own jitter counts.
const MIN_JITTER_SAMPLES: usize = 4;
/// Data-parallel all-reduces (steps) the usual step time is the median of.
const USUAL_STEP_WINDOW: usize = 16;

/// `k` robust deviations (1.4826 MAD) of a member's sorted on-time offsets.
fn own_jitter(sorted: &[i64], k: f64) -> u64 {
    if sorted.len() < MIN_JITTER_SAMPLES {
        return 0;
    }
    let med = sorted[sorted.len() / 2];
    let mut dev: Vec<u64> = sorted.iter().map(|&o| o.abs_diff(med)).collect();
    (k * 1.4826 * median_u64(&mut dev) as f64) as u64
}

/// The member's usual step time before `ts`: the median interval of its
/// last [`USUAL_STEP_WINDOW`] data-parallel all-reduces (the all-reduce
/// communicator with the fewest: one per step); None before 3 steps.
fn usual_step(
    allreduces: &HashMap<u32, HashMap<CommKey, Vec<u64>>>,
    tgid: u32,
    ts: u64,
) -> Option<u64> {
    let dp = dp_allreduces(allreduces, tgid)?;
    let before = &dp[..dp.partition_point(|&t| t < ts)];
    let recent = &before[before.len().saturating_sub(USUAL_STEP_WINDOW + 1)..];
    if recent.len() < 4 {
        return None;
    }
    let mut steps: Vec<u64> = recent
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]))
        .collect();
    Some(median_u64(&mut steps))
}

#[derive(Default)]
struct MemberHistory {
    /// Late (true) or not, for the last `2 * persist` operations.
    window: VecDeque<bool>,
    pending: Vec<Late>,
    /// Offsets (ns after the others' median) of on-time operations, per
    /// function (a pipeline stage enters an all-gather later than its
    /// peers every step, by design).
    baseline: HashMap<&'static str, VecDeque<i64>>,
}

#[derive(Default)]
struct CommOps {
    open: BTreeMap<u64, Op>,
    analysed: u64,
    history: HashMap<u32, MemberHistory>,
    /// How late each recent operation's last member came, beyond its own
    /// usual offset (the last [`LATENESS_WINDOW`]).
    lateness: VecDeque<u64>,
    /// ns per bus byte of clean, large operations.
    link: VecDeque<f64>,
    /// The same from the device (activity records): the shortest member
    /// kernel of each operation (the last member to arrive waits for no
    /// one: its kernel is the transfer alone).
    device_link: VecDeque<f64>,
    members: HashSet<u32>,
    /// The global ranks of every member seen (for a verdict after they
    /// ended).
    member_ranks: BTreeSet<u32>,
    /// The job its members belong to (their job label): each job's
    /// communicators are judged among themselves.
    job: String,
}

/// A communicator whose members all ended, with its link samples: judged
/// with the live ones for [`ENDED_LINK_KEEP_NS`] (a job's activity records
/// come in batches, the last at each rank's exit: the device's samples
/// may all arrive as the job ends).
struct EndedLink {
    key: CommKey,
    job: String,
    ended: u64,
    link: VecDeque<f64>,
    device_link: VecDeque<f64>,
    ranks: BTreeSet<u32>,
}

/// (communicator, its members' ranks, device samples, host samples).
type LinkSamples<'a> = (CommKey, BTreeSet<u32>, &'a VecDeque<f64>, &'a VecDeque<f64>);

/// The `slow_link` verdict over one job's communicators, if one is slow.
fn judge_links(cfg: &CollectiveConfig, comms: &[LinkSamples<'_>], now: u64) -> Option<Finding> {
    let min_ops = cfg.link_min_ops.max(1) as usize;
    // Per communicator: its median time per byte, and what it must stay
    // above to be slow at all times: the median from the device; from the
    // host its lower quartile, since a host's samples also hold the time
    // a member's thread waited for a CPU to see the transfer done (on a
    // busy or oversubscribed host a share of operations take several
    // times their time that way; a slow link is slow at its best too).
    let per_comm_of = |device: bool| -> Vec<(CommKey, f64, usize, BTreeSet<u32>, f64)> {
        comms
            .iter()
            .filter_map(|(k, r, dev, host)| {
                let samples = if device { *dev } else { *host };
                if samples.len() < min_ops {
                    return None;
                }
                let mut v: Vec<f64> = samples.iter().copied().collect();
                let median = median_f64(&mut v);
                let best = if device {
                    median
                } else {
                    v.sort_by(f64::total_cmp);
                    v[v.len() / 4]
                };
                Some((*k, median, v.len(), r.clone(), best))
            })
            .collect()
    };
    // The device's own timing where activity records give it (the
    // host's time after the last arrival also holds the compute queued
    // before the collective); the host's otherwise.
    let mut source = "device";
    let mut per_comm = per_comm_of(true);
    if per_comm.len() < 2 {
        source = "host";
        per_comm = per_comm_of(false);
    }
    if per_comm.len() < 2 {
        return None;
    }
    per_comm.sort_by(|a, b| a.1.total_cmp(&b.1));
    // The reference is a typical communicator (the lower median: a
    // healthy one while fewer than half are slow), not the fastest: one
    // communicator that happened to be quick would make the others look
    // slow.
    let reference = per_comm[(per_comm.len() - 1) / 2].1.max(1e-12);
    let ratio = f64::from(cfg.slow_link_ratio.max(1));
    type Judged = (CommKey, f64, usize, BTreeSet<u32>, f64);
    let (slow, fast): (Vec<&Judged>, Vec<&Judged>) = per_comm
        .iter()
        .partition(|c| c.1 >= ratio * reference && c.4 >= ratio * reference);
    if slow.is_empty() {
        return None;
    }
    let mut candidates = slow[0].3.clone();
    for c in &slow[1..] {
        candidates.retain(|r| c.3.contains(r));
    }
    for c in &fast {
        for r in &c.3 {
            candidates.remove(r);
        }
    }
    let localized = !candidates.is_empty();
    if !localized {
        candidates = slow.iter().flat_map(|c| c.3.iter().copied()).collect();
    }
    let rank_ids: Vec<u32> = candidates.into_iter().collect();
    let names: Vec<String> = slow
        .iter()
        .map(|c| comm_name(c.0.0.name(), c.0.1))
        .collect();
    let worst = slow.last().expect("one");
    let who = match rank_ids.as_slice() {
        [r] => format!("rank {r}"),
        rs => format!(
            "ranks {}",
            rs.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ),
    };
    Some(Finding {
        link: Default::default(),
        kind: FindingKind::SlowLink,
        ranks: rank_ids.clone(),
        comm: Some(names[0].clone()),
        seq: None,
        step: None,
        start_ns: now,
        end_ns: None,
        summary: format!(
            "slow link through {who}: collectives on {} take {:.1}x the time per byte of the \
             typical communicator (threshold {ratio}x){}{}",
            names.join(", "),
            worst.1 / reference,
            if source == "host" {
                " with every member on time"
            } else {
                ", from the device"
            },
            if localized {
                ""
            } else {
                "; not localized to one rank (no rank is in only the slow communicators)"
            },
        ),
        evidence: json!({
            "slow_comms": slow.iter().map(|c| json!({
                "comm": comm_name(c.0.0.name(), c.0.1),
                "ns_per_byte": c.1,
                "ops": c.2,
            })).collect::<Vec<_>>(),
            "reference_ns_per_byte": reference,
            "ratio": worst.1 / reference,
            "threshold_ratio": ratio,
            "localized": localized,
            "source": source,
        }),
        detected_ns: now,
    })
}

const ENDED_LINK_KEEP_NS: u64 = 60_000_000_000;
const MAX_ENDED_LINKS: usize = 256;

/// A large collective whose device work is still to come, by the flow from
/// its host call to that work.
#[derive(Clone, Copy)]
struct DeviceOp {
    key: CommKey,
    seq: u64,
    size: u32,
    bus_bytes: u64,
}

/// Flows (and operations) remembered for their device work; cleared past
/// this (activity records lost or never enabled).
const MAX_DEVICE_OPS: usize = 16_384;

pub struct CollectiveDetector {
    cfg: CollectiveConfig,
    comms: HashMap<CommKey, CommOps>,
    /// tid -> collectives waiting for the thread's next sync.
    awaiting_sync: HashMap<u32, Vec<(CommKey, u64)>>,
    /// tgid -> all-reduce communicator -> entry times.
    allreduces: HashMap<u32, HashMap<CommKey, Vec<u64>>>,
    /// Processes named slow ranks (by this or the device-compute
    /// detector: one finding per rank).
    pub(super) slow_reported: HashSet<u32>,
    /// Jobs given their `slow_link` verdict (one per job; forgotten once
    /// none of the job's communicators is left).
    link_reported: HashSet<String>,
    /// Flow id -> the large collective its host call enqueued.
    device_ops: HashMap<FlowId, DeviceOp>,
    /// (communicator, seq) -> its members' kernel durations so far.
    device_kernels: HashMap<(CommKey, u64), Vec<u64>>,
    /// Communicators that ended, with their link samples.
    ended_links: VecDeque<EndedLink>,
    /// tid -> its latest large collectives (start, end, tgid, op): an
    /// enqueue marker inside one is that collective's device work.
    recent_calls: HashMap<u32, VecDeque<(u64, u64, u32, DeviceOp)>>,
    /// (tgid, tid) -> the thread's latest blocking device calls (evidence
    /// of why it came late: it waited for something).
    waits: HashMap<(u32, u32), VecDeque<Wait>>,
}

/// Large collectives remembered per thread for their enqueue markers.
const RECENT_CALLS: usize = 64;

pub(super) fn median_u64(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        v[n / 2 - 1] / 2 + v[n / 2] / 2
    }
}

fn median_f64(v: &mut [f64]) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn ms(ns: u64) -> f64 {
    (ns as f64 / 1e4).round() / 100.0
}

/// NCCL's bus-bandwidth factor: the bytes each link carries.
fn bus_bytes(op: Collective, bytes: u64, n: u32) -> u64 {
    let n = u64::from(n.max(1));
    match op {
        Collective::AllReduce => bytes * 2 * (n - 1) / n,
        Collective::AllGather | Collective::ReduceScatter => bytes * (n - 1),
        Collective::Broadcast | Collective::Reduce => bytes,
        Collective::Barrier => 0,
    }
}

impl CollectiveDetector {
    pub fn new(cfg: CollectiveConfig) -> Self {
        Self {
            cfg,
            comms: HashMap::new(),
            awaiting_sync: HashMap::new(),
            allreduces: HashMap::new(),
            slow_reported: HashSet::new(),
            link_reported: HashSet::new(),
            device_ops: HashMap::new(),
            device_kernels: HashMap::new(),
            recent_calls: HashMap::new(),
            ended_links: VecDeque::new(),
            waits: HashMap::new(),
        }
    }

    fn window_len(&self) -> usize {
        2 * self.cfg.slow_rank_persist.max(1) as usize
    }

    pub fn device_call(&mut self, c: &DeviceCallRecord, ranks: &Ranks, out: &mut Vec<Finding>) {
        let call = &c.call;
        if let Some(end) = call.end_ts
            && end.saturating_sub(call.start_ts) >= MIN_WAIT_NS
            && !matches!(call.kind, CallKind::Collective(_))
        {
            // Collectives only enqueue: their time is the wait that
            // follows (a sync), which is recorded as a wait itself.
            let w = self.waits.entry((call.tgid, call.tid)).or_default();
            w.push_back(Wait {
                start: call.start_ts,
                end,
                function: call.function,
            });
            if w.len() > WAITS_PER_THREAD {
                w.pop_front();
            }
        }
        match call.kind {
            CallKind::Collective(op) => {
                let Some(cc) = &call.comm else { return };
                let (Some(key), Some(seq), true, Some(size)) =
                    (comm_key(call.library, cc), cc.seq, cc.seq_exact, cc.size)
                else {
                    return;
                };
                if size < 2 {
                    return;
                }
                if op == Collective::AllReduce {
                    let v = self
                        .allreduces
                        .entry(call.tgid)
                        .or_default()
                        .entry(key)
                        .or_default();
                    if v.len() < MAX_ALLREDUCES {
                        v.push(call.start_ts);
                    }
                }
                let bytes = match &call.args {
                    CallArgs::Collective(a) => a.bytes.unwrap_or(0),
                    _ => 0,
                };
                let comm = self.comms.entry(key).or_default();
                if comm.members.insert(call.tgid) && comm.job.is_empty() {
                    comm.job = ranks.job_of(call.tgid).to_owned();
                }
                comm.member_ranks.extend(ranks.of(call.tgid));
                let o = comm.open.entry(seq).or_default();
                o.size = size;
                o.function = call.function;
                o.bus_bytes = o.bus_bytes.max(bus_bytes(op, bytes, size));
                o.members.entry(call.tgid).or_insert(Arrival {
                    enter: call.start_ts,
                    done: None,
                    tid: call.tid,
                });
                while comm.open.len() > MAX_OPEN_OPS {
                    comm.open.pop_first();
                }
                let bus = bus_bytes(op, bytes, size);
                if bus >= self.cfg.link_min_bytes {
                    let dop = DeviceOp {
                        key,
                        seq,
                        size,
                        bus_bytes: bus,
                    };
                    for &flow in &c.flows {
                        self.device_op(flow, dop);
                    }
                    if let Some(end) = call.end_ts {
                        let recent = self.recent_calls.entry(call.tid).or_default();
                        recent.push_back((call.start_ts, end, call.tgid, dop));
                        if recent.len() > RECENT_CALLS {
                            recent.pop_front();
                        }
                    }
                }
                let waiting = self.awaiting_sync.entry(call.tid).or_default();
                waiting.push((key, seq));
                // A thread that never syncs: keep its latest only.
                if waiting.len() > MAX_OPEN_OPS {
                    waiting.remove(0);
                }
                self.try_close(key, seq, ranks, out);
            }
            CallKind::Sync(_) => {
                let Some(end) = call.end_ts else { return };
                for (key, seq) in self.awaiting_sync.remove(&call.tid).unwrap_or_default() {
                    if let Some(a) = self
                        .comms
                        .get_mut(&key)
                        .and_then(|c| c.open.get_mut(&seq))
                        .and_then(|o| o.members.get_mut(&call.tgid))
                    {
                        a.done = Some(end);
                    }
                    self.try_close(key, seq, ranks, out);
                }
            }
            _ => {}
        }
    }

    fn device_op(&mut self, flow: FlowId, op: DeviceOp) {
        if self.device_ops.len() >= MAX_DEVICE_OPS {
            self.device_ops.clear();
        }
        self.device_ops.insert(flow, op);
    }

    /// A host thread enqueued device work (an API record): inside one of
    /// its large collectives, that work is the collective's.
    pub fn enqueued(&mut self, m: &EnqueueMarker) {
        let op = self.recent_calls.get(&m.tid).and_then(|calls| {
            calls
                .iter()
                .rev()
                .find(|(start, end, tgid, _)| *tgid == m.tgid && (*start..=*end).contains(&m.ts))
                .map(|c| c.3)
        });
        if let Some(op) = op {
            self.device_op(m.flow, op);
        }
    }

    /// A collective's kernel on a member's device (activity records with
    /// the flow from its host call): once every member's is in, the
    /// shortest is the operation's transfer time.
    pub fn device_work(&mut self, w: &DeviceWork) {
        if w.kind != WorkKind::Communication {
            return;
        }
        for flow in &w.flows {
            let Some(op) = self.device_ops.remove(flow) else {
                continue;
            };
            if self.device_kernels.len() >= MAX_DEVICE_OPS {
                self.device_kernels.clear();
            }
            let kernels = self.device_kernels.entry((op.key, op.seq)).or_default();
            kernels.push(w.end.saturating_sub(w.start));
            if kernels.len() < op.size as usize {
                continue;
            }
            let shortest = kernels.iter().copied().min().unwrap_or(0);
            self.device_kernels.remove(&(op.key, op.seq));
            if let Some(comm) = self.comms.get_mut(&op.key) {
                comm.device_link
                    .push_back(shortest as f64 / op.bus_bytes as f64);
                if comm.device_link.len() > MAX_LINK_SAMPLES {
                    comm.device_link.pop_front();
                }
            }
        }
    }

    fn try_close(&mut self, key: CommKey, seq: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        let Some(comm) = self.comms.get_mut(&key) else {
            return;
        };
        let Some(op) = comm.open.get_mut(&seq) else {
            return;
        };
        if op.members.len() < op.size as usize {
            return;
        }
        if !op.arrivals_done {
            op.arrivals_done = true;
            self.arrivals(key, seq, ranks, out);
        }
        let comm = self.comms.get_mut(&key).expect("present");
        let op = comm.open.get(&seq).expect("present");
        if op.members.values().all(|a| a.done.is_some()) {
            let op = comm.open.remove(&seq).expect("present");
            if !op.late && op.bus_bytes >= self.cfg.link_min_bytes {
                let last = op.members.values().map(|a| a.enter).max().unwrap_or(0);
                // The first member to see the operation done: the others
                // may have waited for a CPU to return from their syncs (a
                // busy or oversubscribed host), which is not the link's
                // time.
                let first_done = op
                    .members
                    .values()
                    .filter_map(|a| a.done)
                    .min()
                    .unwrap_or(last);
                let post = first_done.saturating_sub(last);
                comm.link.push_back(post as f64 / op.bus_bytes as f64);
                if comm.link.len() > MAX_LINK_SAMPLES {
                    comm.link.pop_front();
                }
            }
        }
    }

    /// Every member entered `seq`: was the last one late?
    fn arrivals(&mut self, key: CommKey, seq: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        let window = self.window_len();
        let persist = self.cfg.slow_rank_persist.max(1) as usize;
        let late_min = self.cfg.late_min.as_nanos() as u64;
        let k = f64::from(self.cfg.late_mad_k);
        let comm = self.comms.get_mut(&key).expect("present");
        let index = comm.analysed;
        comm.analysed += 1;
        let op = comm.open.get_mut(&seq).expect("present");
        let mut by_time: Vec<(u64, u32)> = op.members.iter().map(|(t, a)| (a.enter, *t)).collect();
        by_time.sort_unstable();
        let (last_enter, last) = *by_time.last().expect("two or more members");
        let mut others: Vec<u64> = by_time[..by_time.len() - 1].iter().map(|p| p.0).collect();
        let med = median_u64(&mut others);
        let mut dev: Vec<u64> = others.iter().map(|&a| a.abs_diff(med)).collect();
        let mad = median_u64(&mut dev);
        // Compared with its own on-time offset at this function: a member
        // that always enters this operation later is not late by it.
        let own_offsets: Option<Vec<i64>> = comm
            .history
            .get(&last)
            .and_then(|h| h.baseline.get(op.function))
            .filter(|b| b.len() >= WARMUP_OPS)
            .map(|b| {
                let mut v: Vec<i64> = b.iter().copied().collect();
                v.sort_unstable();
                v
            });
        let own = own_offsets.as_ref().map(|v| v[v.len() / 2].max(0) as u64);
        let step = usual_step(&self.allreduces, last, last_enter);
        let parts = ThresholdParts {
            floor: late_min,
            peers_spread: (k * 1.4826 * mad as f64) as u64,
            own_jitter: own_offsets.as_deref().map_or(0, |v| own_jitter(v, k)),
            step_share: step.map_or(0, |s| s / STEP_SHARE_DIVISOR),
        };
        let threshold = parts.threshold();
        let delay = last_enter.saturating_sub(med);
        let late = own.is_some_and(|own| delay.saturating_sub(own) > threshold);
        let worst = usual_worst(&comm.lateness).map_or(0, |w| w * LONE_TAIL_FACTOR);
        // Past its warm-up only: start-up skew is no usual lateness.
        if let Some(own) = own {
            comm.lateness.push_back(delay.saturating_sub(own));
            if comm.lateness.len() > LATENESS_WINDOW {
                comm.lateness.pop_front();
            }
        }
        let last_tid = op.members.get(&last).map_or(last, |a| a.tid);
        let waited = late
            .then(|| {
                let beyond = delay.saturating_sub(own.unwrap_or(0));
                waited_in(
                    self.waits.get(&(last, last_tid)),
                    last_enter.saturating_sub(beyond),
                    last_enter,
                )
            })
            .flatten();
        op.late = late;
        let function = op.function;
        let peers_wait: u64 = others.iter().map(|&a| last_enter - a).sum();
        let members: Vec<(u32, u64)> = op.members.iter().map(|(t, a)| (*t, a.enter)).collect();
        for (tgid, enter) in members {
            let h = comm.history.entry(tgid).or_default();
            let is_late = late && tgid == last;
            h.window.push_back(is_late);
            if h.window.len() > window {
                h.window.pop_front();
            }
            if is_late {
                h.pending.push(Late {
                    index,
                    seq,
                    enter: last_enter,
                    delay_ns: delay,
                    threshold_ns: threshold,
                    parts,
                    beyond_usual_ns: delay.saturating_sub(own.unwrap_or(0)),
                    half_step_ns: step.map_or(0, |s| s / 2),
                    usual_worst_ns: worst,
                    waited,
                    peers_wait_ns: peers_wait,
                    function,
                });
            } else if tgid == last || !late {
                // Its own offset from the others' median, when on time.
                let b = h.baseline.entry(function).or_default();
                b.push_back(enter as i64 - med as i64);
                if b.len() > MAX_BASELINE {
                    b.pop_front();
                }
            }
        }
        // A rank late often enough in the window: slow.
        let h = comm.history.get(&last).expect("present");
        let late_in_window = h.window.iter().filter(|l| **l).count();
        if late && late_in_window >= persist && !self.slow_reported.contains(&last) {
            self.slow_reported.insert(last);
            let h = comm.history.get_mut(&last).expect("present");
            let lates: Vec<Late> = h
                .pending
                .iter()
                .filter(|l| l.index + window as u64 > index)
                .cloned()
                .collect();
            let mut earlier: Vec<f64> = h
                .baseline
                .get(function)
                .into_iter()
                .flatten()
                .map(|&o| o as f64)
                .collect();
            let earlier_ms = (!earlier.is_empty()).then(|| median_f64(&mut earlier) / 1e6);
            h.pending.clear();
            let first = lates.first().expect("late now");
            let mut delays: Vec<u64> = lates.iter().map(|l| l.delay_ns).collect();
            let med_delay = median_u64(&mut delays);
            let max_delay = lates.iter().map(|l| l.delay_ns).max().unwrap_or(0);
            let wait: u64 = lates.iter().map(|l| l.peers_wait_ns).sum();
            let who = ranks.describe(last);
            let cname = comm_name(key.0.name(), key.1);
            let earlier_words = match earlier_ms {
                Some(e) => format!(" (its own median offset in on-time operations: {e:.2} ms)"),
                None => String::new(),
            };
            out.push(Finding {
                link: Default::default(),
                kind: FindingKind::SlowRank,
                ranks: ranks.of(last).into_iter().collect(),
                comm: Some(cname.clone()),
                seq: Some(first.seq),
                step: ranks
                    .marked_step(last, first.enter)
                    .or_else(|| step_in(&self.allreduces, last, first.enter)),
                start_ns: first.enter,
                end_ns: None,
                summary: format!(
                    "{who} is a slow rank: it arrived last at {late_in_window} of the last {} \
                     collectives on {cname}, a median {:.2} ms (max {:.2} ms) after its peers, \
                     above the {:.2} ms threshold (set by {}){earlier_words}; its peers waited \
                     {:.1} ms in all",
                    h_window_len(window, index),
                    ms(med_delay),
                    ms(max_delay),
                    ms(first.threshold_ns),
                    first.parts.set_by(),
                    ms(wait),
                ),
                evidence: json!({
                    "step_source": step_source(last, ranks),
                    "late_ops": late_in_window,
                    "window_ops": h_window_len(window, index),
                    "median_delay_ms": ms(med_delay),
                    "max_delay_ms": ms(max_delay),
                    "threshold_ms": ms(first.threshold_ns),
                    "threshold_parts": first.parts.evidence(),
                    "waited": first.waited_evidence().0,
                    "earlier_offset_ms": earlier_ms,
                    "peers_wait_ms": ms(wait),
                    "first_seq": first.seq,
                    "seqs": lates.iter().map(|l| l.seq).collect::<Vec<_>>(),
                }),
                detected_ns: last_enter,
            });
        }
        // Late arrivals that left the window without making a slow rank.
        let mut expired = Vec::new();
        for (tgid, h) in comm.history.iter_mut() {
            let (old, keep): (Vec<Late>, Vec<Late>) = h
                .pending
                .drain(..)
                .partition(|l| l.index + window as u64 <= index);
            h.pending = keep;
            if !self.slow_reported.contains(tgid) {
                expired.extend(
                    old.into_iter()
                        .filter(Late::stands_alone)
                        .map(|l| (*tgid, l)),
                );
            }
        }
        for (tgid, l) in expired {
            out.push(self.late_finding(key, tgid, &l, ranks));
        }
    }

    fn late_finding(&self, key: CommKey, tgid: u32, l: &Late, ranks: &Ranks) -> Finding {
        let who = ranks.describe(tgid);
        let cname = comm_name(key.0.name(), key.1);
        let step = self.step_of(tgid, l.enter, ranks);
        let at = match step {
            Some(s) => format!(" in step {s}"),
            None => String::new(),
        };
        let (waited, waited_words) = l.waited_evidence();
        Finding {
            link: Default::default(),
            kind: FindingKind::LateArrival,
            ranks: ranks.of(tgid).into_iter().collect(),
            comm: Some(cname.clone()),
            seq: Some(l.seq),
            step,
            start_ns: l.enter.saturating_sub(l.delay_ns),
            end_ns: Some(l.enter),
            summary: format!(
                "{who} arrived {:.2} ms late at {} #{} on {cname}{at} (threshold {:.2} ms, \
                 set by {}); its peers waited {:.1} ms in all{waited_words}",
                ms(l.delay_ns),
                l.function,
                l.seq,
                ms(l.threshold_ns),
                l.parts.set_by(),
                ms(l.peers_wait_ns),
            ),
            evidence: json!({
                "step_source": step_source(tgid, ranks),
                "delay_ms": ms(l.delay_ns),
                "threshold_ms": ms(l.threshold_ns),
                "threshold_parts": l.parts.evidence(),
                // What a lone lateness must reach: half a step, and
                // several times the communicator's usual worst.
                "lone_bar_ms": ms(l.lone_bar()),
                "usual_worst_x3_ms": ms(l.usual_worst_ns),
                "waited": waited,
                "peers_wait_ms": ms(l.peers_wait_ns),
                "function": l.function,
            }),
            detected_ns: l.enter,
        }
    }

    /// Time passed: enough operations for a `slow_link` verdict? Each
    /// job's communicators are judged among themselves, once per job.
    pub fn tick(&mut self, now: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        self.ended_links
            .retain(|e| now.saturating_sub(e.ended) <= ENDED_LINK_KEEP_NS);
        // (communicator, its members' ranks, device samples, host samples),
        // live and recently ended, per job.
        let mut jobs: BTreeMap<&str, Vec<LinkSamples>> = BTreeMap::new();
        for (k, c) in &self.comms {
            let mut r = c.member_ranks.clone();
            r.extend(c.members.iter().filter_map(|t| ranks.of(*t)));
            jobs.entry(c.job.as_str())
                .or_default()
                .push((*k, r, &c.device_link, &c.link));
        }
        for e in &self.ended_links {
            jobs.entry(e.job.as_str()).or_default().push((
                e.key,
                e.ranks.clone(),
                &e.device_link,
                &e.link,
            ));
        }
        // A job none of whose communicators is left may be judged anew.
        self.link_reported.retain(|j| jobs.contains_key(j.as_str()));
        let mut judged = Vec::new();
        for (job, comms) in &jobs {
            if self.link_reported.contains(*job) {
                continue;
            }
            if let Some(f) = judge_links(&self.cfg, comms, now) {
                judged.push(job.to_string());
                out.push(f);
            }
        }
        self.link_reported.extend(judged);
    }

    /// The end: late arrivals still pending are reported.
    pub fn finish(&mut self, end: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        self.tick(end, ranks, out);
        let mut keys: Vec<CommKey> = self.comms.keys().copied().collect();
        keys.sort_unstable_by_key(|k| k.1);
        for key in keys {
            let mut pend: Vec<(u32, Late)> = Vec::new();
            for (tgid, h) in self
                .comms
                .get_mut(&key)
                .expect("present")
                .history
                .iter_mut()
            {
                if !self.slow_reported.contains(tgid) {
                    pend.extend(
                        h.pending
                            .drain(..)
                            .filter(Late::stands_alone)
                            .map(|l| (*tgid, l)),
                    );
                }
            }
            pend.sort_by_key(|p| p.1.enter);
            for (tgid, l) in pend {
                out.push(self.late_finding(key, tgid, &l, ranks));
            }
        }
    }

    /// A process ended: its late arrivals not yet reported are (with the
    /// step it knew), and its state goes.
    pub fn process_ended(&mut self, tgid: u32, now: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        let mut pend: Vec<(CommKey, Late)> = Vec::new();
        for (key, comm) in self.comms.iter_mut() {
            if let Some(h) = comm.history.remove(&tgid)
                && !self.slow_reported.contains(&tgid)
            {
                pend.extend(
                    h.pending
                        .into_iter()
                        .filter(Late::stands_alone)
                        .map(|l| (*key, l)),
                );
            }
            comm.members.remove(&tgid);
        }
        pend.sort_by_key(|p| p.1.enter);
        for (key, l) in pend {
            out.push(self.late_finding(key, tgid, &l, ranks));
        }
        self.allreduces.remove(&tgid);
        self.recent_calls.retain(|_, calls| {
            calls.retain(|c| c.2 != tgid);
            !calls.is_empty()
        });
        self.waits.retain(|k, _| k.0 != tgid);
        self.awaiting_sync.remove(&tgid);
        self.slow_reported.remove(&tgid);
        // Communicators no live member uses any more: their link samples
        // stay a while, for the verdict.
        let ended: Vec<CommKey> = self
            .comms
            .iter()
            .filter(|(_, c)| c.members.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for key in ended {
            let c = self.comms.remove(&key).expect("listed");
            if c.link.is_empty() && c.device_link.is_empty() {
                continue;
            }
            if self.ended_links.len() >= MAX_ENDED_LINKS {
                self.ended_links.pop_front();
            }
            self.ended_links.push_back(EndedLink {
                key,
                job: c.job,
                ended: now,
                link: c.link,
                device_link: c.device_link,
                ranks: c.member_ranks,
            });
        }
    }

    /// `tgid`'s training step at `ts`, while it lives: by its own step
    /// markers where it has them (the finding's evidence says so:
    /// [`step_source`]), otherwise by its all-reduces ([`step_in`]).
    pub fn step_of(&self, tgid: u32, ts: u64, ranks: &Ranks) -> Option<u64> {
        ranks
            .marked_step(tgid, ts)
            .or_else(|| step_in(&self.allreduces, tgid, ts))
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.allreduces.contains_key(&tgid)
            && self.comms.values().all(|c| !c.members.contains(&tgid))
            && self.waits.keys().all(|k| k.0 != tgid)
    }
}

/// Where [`CollectiveDetector::step_of`] takes `tgid`'s steps from.
pub fn step_source(tgid: u32, ranks: &Ranks) -> &'static str {
    ranks
        .marks
        .source(tgid)
        .unwrap_or(StepSource::AllReduces)
        .describe()
}

/// The rank's step at `ts`: all-reduces it entered before, on its
/// data-parallel communicator (the one with the fewest).
fn step_in(
    allreduces: &HashMap<u32, HashMap<CommKey, Vec<u64>>>,
    tgid: u32,
    ts: u64,
) -> Option<u64> {
    let dp = dp_allreduces(allreduces, tgid)?;
    Some(dp.partition_point(|&t| t < ts) as u64)
}

/// The entry times of the rank's all-reduces on its data-parallel
/// communicator (the all-reduce communicator with the fewest: one per
/// step, the gradients).
fn dp_allreduces(
    allreduces: &HashMap<u32, HashMap<CommKey, Vec<u64>>>,
    tgid: u32,
) -> Option<&Vec<u64>> {
    allreduces
        .get(&tgid)?
        .values()
        .filter(|v| !v.is_empty())
        .min_by_key(|v| v.len())
}

fn h_window_len(window: usize, index: u64) -> u64 {
    (window as u64).min(index + 1)
}

#[cfg(test)]
mod link_tests {
    use super::*;
    use xpuscope_probes::catalog::Library;

    fn samples(v: &[f64]) -> VecDeque<f64> {
        v.iter().copied().collect()
    }

    fn ranks(r: &[u32]) -> BTreeSet<u32> {
        r.iter().copied().collect()
    }

    /// From the host, a communicator whose operations are several times
    /// slower only now and then (its members waited for a CPU to see them
    /// done) is no slow link; one slow at its best too is.
    #[test]
    fn a_host_timed_link_is_slow_only_when_slow_at_its_best() {
        let cfg = CollectiveConfig::default();
        let none = VecDeque::new();
        let typical = samples(&[1.0; 8]);
        let noisy = samples(&[1.0, 1.1, 0.9, 1.0, 4.0, 4.5, 5.0, 4.2, 3.9]);
        let slow = samples(&[3.5, 4.0, 4.1, 3.8, 4.4, 4.0, 3.9, 4.2]);
        let key = |n: u64| (Library::Nccl, n);
        let judged = |suspect: &VecDeque<f64>| {
            let comms: Vec<LinkSamples<'_>> = vec![
                (key(1), ranks(&[0, 1]), &none, &typical),
                (key(2), ranks(&[2, 3]), &none, &typical),
                (key(3), ranks(&[0, 2]), &none, suspect),
            ];
            judge_links(&cfg, &comms, 0)
        };
        assert!(judged(&noisy).is_none(), "{:#?}", judged(&noisy));
        let f = judged(&slow).expect("a slow link");
        assert_eq!(f.evidence["source"], "host");
        assert_eq!(f.ranks, vec![0, 2]);
    }
}
