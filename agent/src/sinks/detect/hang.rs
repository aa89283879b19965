//! `hang`: a collective, point-to-point call or synchronization in flight
//! longer than the hang timeout.
//!
//! What is running comes from the interpret stage's in-flight snapshots
//! (about once a second; calls that returned since are taken out as their
//! records pass). Who should have joined comes from the communicators:
//! every call on a communicator whose identity is known (its set-up was
//! seen) names a member, its rank and the communicator's size, and every
//! collective with an exact sequence number says how far that member got.
//!
//! The hung operation is the stuck call itself when it is a collective with
//! an exact sequence number; for a sync (NCCL collectives are enqueued and
//! return; the wait shows in the stream sync after them) or a collective
//! without one, it is the last collective the stuck process entered on a
//! communicator where other members are behind it. Its ranks are the
//! members that never entered it; when every member entered and none left,
//! all members; when members are not traced (fewer seen than the size),
//! the stuck ranks. Without any communicator identity, the stuck rank(s).
//!
//! Point-to-point calls carry no sequence number; [`super::p2p`] counts
//! them per peer, which says whom a stuck process waits for (its wait-for
//! edges: it entered more receives from a peer than that peer entered
//! sends to it, or the other way round). They go into every hang's
//! evidence; a stuck call no collective explains names the peers it waits
//! for, as a collective names the members that never entered.
//!
//! Why a member never entered: the snapshot also carries each rank's main
//! thread, its state and the stack it left its CPU with; the finding says
//! where that thread waits (`sleeping for 9.2 s in do_nanosleep <-
//! stuck_before_collective (rank.py:274) <- train_step (rank.py:404)`,
//! Python frames where it is a Python process).

use foldhash::{HashMap, HashMapExt};
use std::collections::HashSet;
use std::time::Duration;

use serde_json::{Value, json};
use xpuscope_probes::catalog::{CallKind, Library};
use xpuscope_probes::decode::comm::CommContext;

use super::Ranks;
use super::p2p::{self, PointToPoint, Wait};
use crate::model::finding::comm_name;
use crate::model::{
    CommKey, DeviceCallRecord, Finding, FindingKind, InFlightSnapshot, MainThreadNow, OpenCall,
    ThreadNow, comm_key,
};

/// Most operations and calls remembered as reported (then forgotten,
/// oldest first, which at worst reports one again).
const MAX_REPORTED: usize = 4096;

#[derive(Clone, Debug, Default)]
struct Member {
    /// Its rank on the communicator.
    rank: Option<u32>,
    /// The highest exact sequence number it entered.
    last_seq: Option<u64>,
    /// The function of that collective.
    last_function: Option<&'static str>,
    /// When it entered that collective (CLOCK_BOOTTIME ns).
    last_entered: u64,
}

#[derive(Default)]
struct CommState {
    size: Option<u32>,
    members: HashMap<u32, Member>,
}

pub struct HangDetector {
    timeout_ns: u64,
    comms: HashMap<CommKey, CommState>,
    /// tgid -> the communicators it is a member of.
    of_process: HashMap<u32, HashSet<CommKey>>,
    /// The last snapshot's calls, less those that returned since.
    open: Vec<OpenCall>,
    reported_calls: HashSet<(u32, u32, u64)>,
    reported_ops: HashSet<(CommKey, u64)>,
    /// The last snapshot's main threads, by process.
    main_threads: HashMap<u32, MainThreadNow>,
    /// The sends and receives each process entered, per peer.
    p2p: PointToPoint,
}

impl p2p::Members for HashMap<CommKey, CommState> {
    fn rank_of(&self, comm: CommKey, tgid: u32) -> Option<u32> {
        self.get(&comm)?.members.get(&tgid)?.rank
    }

    fn process_at(&self, comm: CommKey, rank: u32) -> Option<u32> {
        self.get(&comm)?
            .members
            .iter()
            .filter(|(_, m)| m.rank == Some(rank))
            .map(|(t, _)| *t)
            .min()
    }
}

/// The job's own frames named for a waiting main thread.
const WAIT_DEPTH: usize = 4;

fn call_id(c: &OpenCall) -> (u32, u32, u64) {
    (c.tgid, c.tid, c.start_ts)
}

/// What a stuck thread is doing, in words.
fn thread_words(t: ThreadNow, now: u64) -> String {
    match t {
        ThreadNow::Off { state, since } => format!(
            "{} for {:.1} s",
            crate::state::label(state),
            now.saturating_sub(since) as f64 / 1e9
        ),
        ThreadNow::OnCpu => "running on a CPU".into(),
        ThreadNow::Unknown => "state unknown (scheduling is not recorded)".into(),
    }
}

fn thread_json(t: ThreadNow, now: u64) -> Value {
    match t {
        ThreadNow::Off { state, since } => json!({
            "state": crate::state::label(state),
            "off_cpu_s": now.saturating_sub(since) as f64 / 1e9,
        }),
        ThreadNow::OnCpu => json!({ "state": "running" }),
        ThreadNow::Unknown => json!({ "state": "unknown" }),
    }
}

/// "rank 1's main thread sleeping for 9.2 s in do_nanosleep <-
/// stuck_before_collective (rank.py:274) <- train_step (rank.py:404)".
fn main_thread_words(who: String, m: &MainThreadNow, now: u64) -> String {
    let state = thread_words(m.thread, now);
    match (&m.stack, m.thread) {
        (Some(stack), ThreadNow::Off { .. }) => {
            format!(
                "{who}'s main thread {state} {}",
                stack.wait_words(WAIT_DEPTH)
            )
        }
        _ => format!("{who}'s main thread {state}"),
    }
}

fn main_thread_json(rank: Option<u32>, m: &MainThreadNow, now: u64) -> Value {
    let mut v = thread_json(m.thread, now);
    v["rank"] = json!(rank);
    v["pid"] = json!(m.tgid);
    if let (Some(stack), ThreadNow::Off { .. }) = (&m.stack, m.thread) {
        v["waits_in"] = json!(stack.kernel_wait().map(|f| f.function.to_string()));
        v["frames"] = json!(
            stack
                .own_frames()
                .iter()
                .map(|f| f.function.to_string())
                .collect::<Vec<_>>()
        );
    }
    v
}

/// "rank 1", "ranks 0, 2", or "no rank".
fn rank_list(ranks: &[u32]) -> String {
    match ranks {
        [] => "no rank".into(),
        [r] => format!("rank {r}"),
        _ => format!(
            "ranks {}",
            ranks
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl HangDetector {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout_ns: timeout.as_nanos() as u64,
            comms: HashMap::new(),
            of_process: HashMap::new(),
            open: Vec::new(),
            reported_calls: HashSet::new(),
            reported_ops: HashSet::new(),
            main_threads: HashMap::new(),
            p2p: PointToPoint::default(),
        }
    }

    /// A member seen on `key` (and, for a collective with an exact
    /// number, how far it got).
    fn member(
        &mut self,
        tgid: u32,
        library: Library,
        kind: CallKind,
        function: &'static str,
        cc: &CommContext,
        entered: u64,
    ) {
        let Some(key) = comm_key(library, cc) else {
            return;
        };
        let comm = self.comms.entry(key).or_default();
        comm.size = cc.size.or(comm.size);
        let m = comm.members.entry(tgid).or_default();
        m.rank = cc.rank.or(m.rank);
        if let (CallKind::Collective(_), true, Some(seq)) = (kind, cc.seq_exact, cc.seq)
            && m.last_seq.is_none_or(|s| s < seq)
        {
            m.last_seq = Some(seq);
            m.last_function = Some(function);
            m.last_entered = entered;
        }
        self.of_process.entry(tgid).or_default().insert(key);
    }

    pub fn device_call(&mut self, c: &DeviceCallRecord) {
        let call = &c.call;
        if let Some(cc) = &call.comm {
            self.member(
                call.tgid,
                call.library,
                call.kind,
                call.function,
                cc,
                call.start_ts,
            );
        }
        self.p2p.device_call(c);
        if c.unmatched.is_none() {
            self.open
                .retain(|o| (o.tgid, o.tid, o.start_ts) != (call.tgid, call.tid, call.start_ts));
        }
    }

    pub fn snapshot(&mut self, s: &InFlightSnapshot) {
        self.open = s.calls.clone();
        self.main_threads = s.main_threads.iter().map(|m| (m.tgid, m.clone())).collect();
        for c in &s.calls {
            if let Some(cc) = &c.comm {
                self.member(c.tgid, c.library, c.kind, c.function, cc, c.start_ts);
            }
        }
        // Calls no longer running need no memory of being reported.
        let running: HashSet<_> = self.open.iter().map(call_id).collect();
        self.reported_calls.retain(|id| running.contains(id));
    }

    pub fn process_ended(&mut self, tgid: u32) {
        self.open.retain(|c| c.tgid != tgid);
        self.main_threads.remove(&tgid);
        self.p2p.process_ended(tgid);
        for key in self.of_process.remove(&tgid).unwrap_or_default() {
            if let Some(comm) = self.comms.get_mut(&key) {
                comm.members.remove(&tgid);
                if comm.members.is_empty() {
                    self.comms.remove(&key);
                }
            }
        }
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.of_process.contains_key(&tgid)
            && !self.main_threads.contains_key(&tgid)
            && self.comms.values().all(|c| !c.members.contains_key(&tgid))
            && self.open.iter().all(|c| c.tgid != tgid)
            && self.p2p.forgot(tgid)
    }

    /// The operation a stuck call waits for: (communicator, sequence
    /// number), when it can be told: its own collective; else the
    /// collective its process entered that a peer has not (it waits for
    /// that peer); else, when every member of one of its communicators
    /// entered the same last collective and every one is still in a call
    /// (`hung`: processes with a call in flight), that collective, the one
    /// entered last: it never completed.
    fn op_of(&self, c: &OpenCall, hung: &HashSet<u32>) -> Option<(CommKey, u64)> {
        self.awaited_op(c)
            .or_else(|| self.op_all_stuck_in(c.tgid, hung))
    }

    fn op_all_stuck_in(&self, tgid: u32, hung: &HashSet<u32>) -> Option<(CommKey, u64)> {
        self.of_process
            .get(&tgid)?
            .iter()
            .filter_map(|key| {
                let comm = &self.comms[key];
                let mine = comm.members.get(&tgid)?;
                let seq = mine.last_seq?;
                let whole = comm.size.is_none_or(|n| n as usize == comm.members.len());
                let all_in = comm.members.len() >= 2
                    && whole
                    && comm
                        .members
                        .iter()
                        .all(|(t, m)| m.last_seq == Some(seq) && hung.contains(t));
                all_in.then_some((mine.last_entered, *key, seq))
            })
            .max_by_key(|(entered, key, _)| (*entered, key.1))
            .map(|(_, key, seq)| (key, seq))
    }

    fn awaited_op(&self, c: &OpenCall) -> Option<(CommKey, u64)> {
        if let (CallKind::Collective(_), Some(cc)) = (c.kind, &c.comm)
            && cc.seq_exact
            && let (Some(key), Some(seq)) = (comm_key(c.library, cc), cc.seq)
        {
            return Some((key, seq));
        }
        let mut best: Option<(usize, CommKey, u64)> = None;
        let mut keys: Vec<&CommKey> = self.of_process.get(&c.tgid)?.iter().collect();
        keys.sort_by_key(|k| k.1);
        for key in keys {
            let comm = &self.comms[key];
            let Some(mine) = comm.members.get(&c.tgid).and_then(|m| m.last_seq) else {
                continue;
            };
            let behind = comm
                .members
                .iter()
                .filter(|(t, m)| **t != c.tgid && m.last_seq.is_none_or(|s| s < mine))
                .count();
            if behind > 0 && best.is_none_or(|b| behind > b.0) {
                best = Some((behind, *key, mine));
            }
        }
        best.map(|(_, k, s)| (k, s))
    }

    pub fn tick(&mut self, now: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        let hung: Vec<OpenCall> = self
            .open
            .iter()
            .filter(|c| now.saturating_sub(c.start_ts) >= self.timeout_ns)
            .filter(|c| !self.reported_calls.contains(&call_id(c)))
            .cloned()
            .collect();
        // Processes in a call now (past the timeout or not yet): a
        // collective every member entered last, with every member still
        // in a call, never completed.
        let hung_tgids: HashSet<u32> = self.open.iter().map(|c| c.tgid).collect();
        for c in &hung {
            if self.reported_calls.contains(&call_id(c)) {
                continue;
            }
            match self.op_of(c, &hung_tgids) {
                Some(op) if self.reported_ops.contains(&op) => {
                    self.reported_calls.insert(call_id(c));
                }
                Some(op) => {
                    let stuck: Vec<&OpenCall> = hung
                        .iter()
                        .filter(|h| self.op_of(h, &hung_tgids) == Some(op))
                        .collect();
                    out.push(self.collective_finding(op, &stuck, now, ranks));
                    let ids: Vec<_> = stuck.iter().map(|s| call_id(s)).collect();
                    self.reported_calls.extend(ids);
                    if self.reported_ops.len() >= MAX_REPORTED {
                        self.reported_ops.clear();
                    }
                    self.reported_ops.insert(op);
                }
                None => {
                    let waits = self.waits_of(&[c]);
                    if waits.is_empty() {
                        out.push(self.lone_finding(c, now, ranks));
                        self.reported_calls.insert(call_id(c));
                        continue;
                    }
                    // Its process's other stuck calls that no collective
                    // explains wait for the same peers: one finding.
                    let stuck: Vec<&OpenCall> = hung
                        .iter()
                        .filter(|h| h.tgid == c.tgid && !self.reported_calls.contains(&call_id(h)))
                        .filter(|h| self.op_of(h, &hung_tgids).is_none())
                        .collect();
                    out.push(self.p2p_finding(&stuck, &waits, now, ranks));
                    let ids: Vec<_> = stuck.iter().map(|s| call_id(s)).collect();
                    self.reported_calls.extend(ids);
                }
            }
        }
    }

    /// The point-to-point waits of the processes of `stuck`.
    fn waits_of(&self, stuck: &[&OpenCall]) -> Vec<Wait> {
        let mut tgids: Vec<u32> = stuck.iter().map(|c| c.tgid).collect();
        tgids.sort_unstable();
        tgids.dedup();
        tgids
            .into_iter()
            .flat_map(|t| self.p2p.waits(t, &self.open, &self.comms))
            .collect()
    }

    /// The main threads of `tgids` as the last snapshot saw them, and
    /// "; rank 3's main thread sleeping for 9.2 s in ..." for each.
    fn where_they_wait(
        &self,
        tgids: &[u32],
        now: u64,
        ranks: &Ranks,
    ) -> (Vec<(u32, &MainThreadNow)>, String) {
        let waiting: Vec<(u32, &MainThreadNow)> = tgids
            .iter()
            .filter_map(|t| self.main_threads.get(t).map(|m| (*t, m)))
            .collect();
        let words = waiting
            .iter()
            .map(|(t, m)| format!("; {}", main_thread_words(ranks.describe(*t), m, now)))
            .collect();
        (waiting, words)
    }

    fn stuck_json(&self, c: &OpenCall, now: u64, ranks: &Ranks) -> Value {
        json!({
            "rank": ranks.of(c.tgid),
            "pid": c.tgid,
            "tid": c.tid,
            "function": c.function,
            "since_ns": c.start_ts,
            "in_flight_s": now.saturating_sub(c.start_ts) as f64 / 1e9,
            "thread": thread_json(c.thread, now),
        })
    }

    fn stuck_words(&self, c: &OpenCall, now: u64, ranks: &Ranks) -> String {
        format!(
            "{}'s thread {} has been in {} for {:.1} s, {}",
            ranks.describe(c.tgid),
            c.tid,
            c.function,
            now.saturating_sub(c.start_ts) as f64 / 1e9,
            thread_words(c.thread, now)
        )
    }

    fn collective_finding(
        &self,
        (key, seq): (CommKey, u64),
        stuck: &[&OpenCall],
        now: u64,
        ranks: &Ranks,
    ) -> Finding {
        let comm = &self.comms[&key];
        let name = comm_name(key.0.name(), key.1);
        let mut entered = Vec::new();
        let mut never = Vec::new();
        let mut tgids: Vec<(&u32, &Member)> = comm.members.iter().collect();
        tgids.sort_by_key(|(t, _)| (ranks.of(**t), **t));
        for (tgid, m) in &tgids {
            let inside = stuck.iter().any(|s| s.tgid == **tgid);
            if inside || m.last_seq.is_some_and(|s| s >= seq) {
                entered.push(**tgid);
            } else {
                never.push(**tgid);
            }
        }
        let rank_of = |ts: &[u32]| -> Vec<u32> {
            let mut r: Vec<u32> = ts.iter().filter_map(|t| ranks.of(*t)).collect();
            r.sort_unstable();
            r
        };
        let op = stuck
            .iter()
            .find(|s| matches!(s.kind, CallKind::Collective(_)))
            .map(|s| s.function)
            .or_else(|| {
                entered
                    .iter()
                    .find_map(|t| comm.members.get(t).and_then(|m| m.last_function))
            })
            .unwrap_or("collective");
        let size = comm.size.unwrap_or(comm.members.len() as u32);
        let missing = size.saturating_sub(comm.members.len() as u32);
        let stuck_tgids: Vec<u32> = stuck.iter().map(|s| s.tgid).collect();
        let (finding_ranks, what) = if !never.is_empty() {
            (
                rank_of(&never),
                format!(
                    "entered by {} but never by {}",
                    rank_list(&rank_of(&entered)),
                    rank_list(&rank_of(&never))
                ),
            )
        } else if missing > 0 {
            (
                rank_of(&stuck_tgids),
                format!(
                    "entered by {}; {missing} of its {size} members are not traced",
                    rank_list(&rank_of(&entered))
                ),
            )
        } else {
            (
                rank_of(&entered),
                "entered by every member, and none left".to_string(),
            )
        };
        let first = stuck.iter().min_by_key(|s| s.start_ts);
        // Where the members that never entered wait.
        let (waiting, waiting_words) = self.where_they_wait(&never, now, ranks);
        // Whom the stuck ranks wait for point to point besides.
        let waits = self.waits_of(stuck);
        let summary = format!(
            "hang: {op} #{seq} on {name} ({size} ranks) {what}{waiting_words}{}{}",
            first
                .map(|c| format!("; {}", self.stuck_words(c, now, ranks)))
                .unwrap_or_default(),
            waits_words(&waits, ranks)
        );
        Finding {
            link: Default::default(),
            kind: FindingKind::Hang,
            ranks: finding_ranks,
            comm: Some(name.clone()),
            seq: Some(seq),
            step: None,
            start_ns: first.map_or(now, |c| c.start_ts),
            end_ns: None,
            summary,
            evidence: json!({
                "op": op,
                "comm": name,
                "seq": seq,
                "comm_size": size,
                "entered": rank_of(&entered),
                "never_entered": rank_of(&never),
                "untraced_members": missing,
                "in_flight_s": first.map_or(0.0, |c| now.saturating_sub(c.start_ts) as f64 / 1e9),
                "hang_timeout_s": self.timeout_ns as f64 / 1e9,
                "stuck": stuck.iter().map(|c| self.stuck_json(c, now, ranks)).collect::<Vec<_>>(),
                "never_entered_main_threads": waiting
                    .iter()
                    .map(|(t, m)| main_thread_json(ranks.of(*t), m, now))
                    .collect::<Vec<_>>(),
                "p2p_waits": waits.iter().map(|w| w.json(ranks)).collect::<Vec<_>>(),
            }),
            detected_ns: now,
        }
    }

    /// A stuck call no communicator explains.
    fn lone_finding(&self, c: &OpenCall, now: u64, ranks: &Ranks) -> Finding {
        let comm = c
            .comm
            .as_ref()
            .and_then(|cc| comm_key(c.library, cc))
            .map(|k| comm_name(k.0.name(), k.1));
        let why = match (&c.comm, &comm) {
            (Some(_), None) => {
                "; its communicator's identity is unknown (set up before the agent attached), \
                 so its members cannot be compared"
            }
            _ => "",
        };
        Finding {
            link: Default::default(),
            kind: FindingKind::Hang,
            ranks: ranks.of(c.tgid).into_iter().collect(),
            comm,
            seq: c
                .comm
                .as_ref()
                .filter(|cc| cc.seq_exact)
                .and_then(|cc| cc.seq),
            step: None,
            start_ns: c.start_ts,
            end_ns: None,
            summary: format!("hang: {}{why}", self.stuck_words(c, now, ranks)),
            evidence: json!({
                "op": c.function,
                "in_flight_s": now.saturating_sub(c.start_ts) as f64 / 1e9,
                "hang_timeout_s": self.timeout_ns as f64 / 1e9,
                "stuck": [self.stuck_json(c, now, ranks)],
                "p2p_waits": [],
            }),
            detected_ns: now,
        }
    }

    /// Stuck calls of one process that no collective explains, waiting
    /// point to point (`waits`, not empty): the peers it waits for are
    /// the finding's ranks, as the members that never entered are a
    /// collective's.
    fn p2p_finding(&self, stuck: &[&OpenCall], waits: &[Wait], now: u64, ranks: &Ranks) -> Finding {
        let mut peers: Vec<u32> = waits.iter().map(|w| w.peer_tgid).collect();
        peers.sort_by_key(|t| (ranks.of(*t), *t));
        peers.dedup();
        let mut culprits: Vec<u32> = peers.iter().filter_map(|t| ranks.of(*t)).collect();
        culprits.dedup();
        if culprits.is_empty() {
            // Peers without a rank identity: the stuck rank, as alone.
            culprits.extend(stuck.iter().filter_map(|c| ranks.of(c.tgid)));
            culprits.sort_unstable();
            culprits.dedup();
        }
        let first = stuck.iter().min_by_key(|c| c.start_ts).copied();
        let comm = waits
            .first()
            .map(|w| comm_name(w.channel.comm.0.name(), w.channel.comm.1));
        // Where the peers it waits for are.
        let (waiting, waiting_words) = self.where_they_wait(&peers, now, ranks);
        let edges = waits
            .iter()
            .map(|w| w.words(ranks))
            .collect::<Vec<_>>()
            .join("; ");
        let summary = format!(
            "hang: {edges}{waiting_words}{}",
            first
                .map(|c| format!("; {}", self.stuck_words(c, now, ranks)))
                .unwrap_or_default()
        );
        Finding {
            link: Default::default(),
            kind: FindingKind::Hang,
            ranks: culprits,
            comm: comm.clone(),
            seq: None,
            step: None,
            start_ns: first.map_or(now, |c| c.start_ts),
            end_ns: None,
            summary,
            evidence: json!({
                "op": first.map(|c| c.function),
                "comm": comm,
                "in_flight_s": first.map_or(0.0, |c| now.saturating_sub(c.start_ts) as f64 / 1e9),
                "hang_timeout_s": self.timeout_ns as f64 / 1e9,
                "stuck": stuck.iter().map(|c| self.stuck_json(c, now, ranks)).collect::<Vec<_>>(),
                "p2p_waits": waits.iter().map(|w| w.json(ranks)).collect::<Vec<_>>(),
                "waited_for_main_threads": waiting
                    .iter()
                    .map(|(t, m)| main_thread_json(ranks.of(*t), m, now))
                    .collect::<Vec<_>>(),
            }),
            detected_ns: now,
        }
    }
}

/// "; rank 1 waits to receive its 7th message from rank 3 on ..., which
/// sent 6" for each wait ("" for none).
fn waits_words(waits: &[Wait], ranks: &Ranks) -> String {
    waits
        .iter()
        .map(|w| format!("; {}", w.words(ranks)))
        .collect()
}
