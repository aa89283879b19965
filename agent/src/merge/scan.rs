//! The first pass over one node's trace: what the merge must know before
//! it rewrites anything (hostname, clocks, ranks and their pids, every pid
//! and CPU, sequences, communicators, and a bounded sample of collective
//! end times for clock alignment). Memory is bounded by the number of
//! processes, tracks and communicators, never by the trace's length.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::path::{Path, PathBuf};

use anyhow::Result;
use xpuscope_perfetto::ClockSnapshot;
use xpuscope_perfetto::rewrite::{IdMap, TrackView, Truncated};
use xpuscope_probes::catalog::CommOp;

use super::collectives::{CollectiveTracker, EndSample};
use crate::model::process_comm_id;
use crate::trace_schema::names::{self as n, label};
use crate::trace_schema::read::TracePackets;

/// A traced process's identity as its process track labels say.
#[derive(Clone, Debug, Default)]
pub struct ProcessInfo {
    /// The process track's uuid in the node's trace.
    pub track: Option<u64>,
    pub rank: Option<u32>,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
    pub job: Option<String>,
    pub name: Option<String>,
    pub labels: Vec<String>,
}

/// A communicator as one node saw it.
#[derive(Clone, Debug, Default)]
pub struct CommSeen {
    pub size: u32,
    /// Comm rank -> pid (on this node).
    pub members: BTreeMap<u32, i32>,
    /// Operation kinds ("all_reduce", "send", ...).
    pub ops: BTreeSet<&'static str>,
    pub operations: u64,
}

/// Everything the first pass learns about one node's trace.
pub struct NodeScan {
    pub path: PathBuf,
    pub bytes: u64,
    pub packets: u64,
    pub truncated: Option<Truncated>,
    pub hostname: Option<String>,
    pub release: Option<String>,
    pub num_cpus: u32,
    pub max_cpu: Option<u32>,
    pub first_clock: Option<ClockSnapshot>,
    pub sequences: BTreeSet<u32>,
    pub pids: HashSet<i32>,
    /// By pid.
    pub processes: HashMap<i32, ProcessInfo>,
    /// Thread track uuid -> (pid, tid).
    pub thread_tracks: HashMap<u64, (i32, i32)>,
    /// By communicator hash.
    pub comms: HashMap<u64, CommSeen>,
    pub ends: EndSample,
    pub collectives: u64,
    pub collectives_inexact: u64,
    /// All-reduces of each process's main thread per communicator (its
    /// hash, or its handle when set-up was not recorded): which one steps
    /// are anchored on when the groups name none.
    pub all_reduces: HashMap<i32, BTreeMap<u64, u64>>,
    pub first_ts: Option<u64>,
    pub last_ts: Option<u64>,
}

/// Pids below this are kept in a bitmap (`PID_MAX_LIMIT`): one bit test
/// per scheduler event instead of a hash insert.
const PID_BITMAP: usize = 1 << 22;

/// The set of pids a trace uses.
struct PidSet {
    bits: Vec<u64>,
    other: HashSet<i32>,
}

impl PidSet {
    fn new() -> Self {
        PidSet {
            bits: vec![0; PID_BITMAP / 64],
            other: HashSet::default(),
        }
    }

    fn insert(&mut self, pid: i32) {
        match usize::try_from(pid) {
            Ok(p) if p < PID_BITMAP => self.bits[p / 64] |= 1 << (p % 64),
            _ => {
                self.other.insert(pid);
            }
        }
    }

    fn into_set(self) -> HashSet<i32> {
        let mut out = self.other;
        for (i, word) in self.bits.iter().enumerate() {
            let mut w = *word;
            while w != 0 {
                let b = w.trailing_zeros() as usize;
                out.insert((i * 64 + b) as i32);
                w &= w - 1;
            }
        }
        out
    }
}

/// Identity map that records the pids and CPUs it sees.
struct Census<'a> {
    pids: &'a mut PidSet,
    max_cpu: &'a mut Option<u32>,
    sequences: &'a mut BTreeSet<u32>,
}

impl IdMap for Census<'_> {
    fn time(&mut self, ts: u64) -> u64 {
        ts
    }
    fn sequence(&mut self, id: u32) -> u32 {
        self.sequences.insert(id);
        id
    }
    fn track(&mut self, uuid: u64) -> u64 {
        uuid
    }
    fn pid(&mut self, pid: i32) -> i32 {
        self.pids.insert(pid);
        pid
    }
    fn cpu(&mut self, cpu: u32) -> u32 {
        *self.max_cpu = Some(self.max_cpu.map_or(cpu, |m| m.max(cpu)));
        cpu
    }
    fn flow(&mut self, id: u64) -> u64 {
        id
    }
}

pub fn scan(path: &Path) -> Result<NodeScan> {
    let mut packets = TracePackets::open(path)?;
    let mut s = NodeScan {
        path: path.to_owned(),
        bytes: 0,
        packets: 0,
        truncated: None,
        hostname: None,
        release: None,
        num_cpus: 0,
        max_cpu: None,
        first_clock: None,
        sequences: BTreeSet::new(),
        pids: HashSet::default(),
        processes: HashMap::default(),
        thread_tracks: HashMap::default(),
        comms: HashMap::default(),
        ends: EndSample::default(),
        collectives: 0,
        collectives_inexact: 0,
        all_reduces: HashMap::default(),
        first_ts: None,
        last_ts: None,
    };
    let mut tracker = CollectiveTracker::default();
    let mut pids = PidSet::new();
    while let Some(mut packet) = packets.next()? {
        if let Some(info) = packet.system_info() {
            s.hostname = s.hostname.or(info.machine_name);
            s.release = s.release.or(info.release);
            s.num_cpus = s.num_cpus.max(info.num_cpus.unwrap_or(0));
        }
        if s.first_clock.is_none() {
            s.first_clock = packet.clock_snapshot().filter(|c| c.realtime_ns != 0);
        }
        if let Some(ts) = packet.timestamp().filter(|&t| t > 0) {
            s.first_ts = Some(s.first_ts.map_or(ts, |f| f.min(ts)));
            s.last_ts = Some(s.last_ts.map_or(ts, |l| l.max(ts)));
        }
        match packet.track() {
            Some(TrackView::Process { pid, name, labels }) => {
                let p = s.processes.entry(pid).or_default();
                p.track = packet.track_uuid();
                // A later descriptor without the rank labels would replace
                // them in the importer; keep the richest seen.
                if label(&labels, n::RANK_LABEL).is_some() || p.rank.is_none() {
                    p.rank = label(&labels, n::RANK_LABEL).and_then(|v| v.parse().ok());
                    p.local_rank = label(&labels, n::LOCAL_RANK_LABEL).and_then(|v| v.parse().ok());
                    p.world_size = label(&labels, n::WORLD_SIZE_LABEL).and_then(|v| v.parse().ok());
                    p.job = label(&labels, n::JOB_LABEL).map(str::to_owned);
                    p.name = name;
                    p.labels = labels;
                }
            }
            Some(TrackView::Thread { pid, tid }) => {
                if let Some(uuid) = packet.track_uuid() {
                    s.thread_tracks.insert(uuid, (pid, tid));
                }
            }
            _ => {}
        }
        if let Some(event) = packets.event(&packet) {
            let thread = s.thread_tracks.get(&event.track).copied();
            let pid = thread.map(|t| t.0);
            let observed = tracker.observe(&event, &mut s.ends);
            if let (Some((pid, tid)), Some(o)) = (thread, &observed)
                && pid == tid
                && o.call.op == CommOp::AllReduce
            {
                let comm = process_comm_id(o.call.comm_hash, o.call.comm);
                *s.all_reduces
                    .entry(pid)
                    .or_default()
                    .entry(comm)
                    .or_default() += 1;
            }
            if let Some(o) = observed {
                s.collectives += 1;
                if o.key.is_none() {
                    s.collectives_inexact += 1;
                }
                // The hash is known only when set-up was recorded: then the
                // membership is too.
                if let Some(hash) = o.call.comm_hash {
                    let c = &o.call;
                    let comm = s.comms.entry(hash).or_default();
                    comm.size = comm.size.max(c.size.unwrap_or(0));
                    if let (Some(r), Some(pid)) = (c.comm_rank, pid) {
                        comm.members.insert(r, pid);
                    }
                    comm.ops.insert(c.op.label());
                    comm.operations += 1;
                }
            }
        }
        packet.remap(&mut Census {
            pids: &mut pids,
            max_cpu: &mut s.max_cpu,
            sequences: &mut s.sequences,
        });
    }
    s.bytes = packets.offset();
    s.packets = packets.packets();
    s.truncated = packets.truncated();
    s.pids = pids.into_set();
    s.pids.remove(&0);
    Ok(s)
}

impl NodeScan {
    /// CPUs this node's CPU numbers span.
    pub fn cpu_span(&self) -> u32 {
        // Saturating: a CPU number is the trace file's to claim.
        self.num_cpus
            .max(self.max_cpu.map_or(0, |m| m.saturating_add(1)))
    }

    /// The job labels of its ranks.
    pub fn jobs(&self) -> BTreeSet<String> {
        self.processes
            .values()
            .filter_map(|p| p.job.clone())
            .collect()
    }

    /// Ranked processes: pid -> global rank.
    pub fn ranks(&self) -> BTreeMap<i32, u32> {
        self.processes
            .iter()
            .filter_map(|(pid, p)| Some((*pid, p.rank?)))
            .collect()
    }

    /// The all-reduce communicator `pid`'s steps are anchored on when the
    /// groups name no data-parallel one: its only communicator that
    /// all-reduced more than once (a data-parallel job's only repeated
    /// all-reduce is its gradients').
    pub fn only_all_reduce(&self, pid: i32) -> Option<u64> {
        let mut repeated = self.all_reduces.get(&pid)?.iter().filter(|(_, n)| **n > 1);
        let (&comm, _) = repeated.next()?;
        repeated.next().is_none().then_some(comm)
    }

    pub fn host_label(&self, index: usize) -> String {
        self.hostname
            .clone()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| format!("node{index}"))
    }
}
