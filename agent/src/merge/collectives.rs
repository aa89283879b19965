//! Collectives in a node's trace, and when each one really ended.
//!
//! A collective call returns on the host as soon as it is enqueued; its
//! device work ends when every member has arrived (the same instant on all
//! of them). The host sees that instant as the end of the next
//! synchronisation of the collective's stream on the same thread: that end
//! is the evidence for clock alignment. Collectives followed by another
//! collective on the same stream before any such sync give none.
//!
//! Send/receive calls carry no sequence number: the n-th send from comm
//! rank a to b pairs with the n-th receive of b from a (counted from the
//! communicator's set-up, which every node saw when the hash is known).

use std::collections::{BTreeMap, HashMap};

use rustc_hash::FxHashMap;

use xpuscope_perfetto::rewrite::{EventKind, EventView};
use xpuscope_probes::catalog::CommOp;

use super::mix::mix;
use crate::trace_schema::call::sync_stream;
use crate::trace_schema::keys as k;

/// Collective-end samples kept per node: the same keys are kept on every
/// node (the smallest hashes of (communicator, sequence)), so samples
/// still match across nodes while memory stays bounded.
pub const MAX_END_SAMPLES: usize = 8_192;

/// One collective call on a thread track.
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    pub comm_hash: Option<u64>,
    /// The communicator's handle in its process.
    pub comm: Option<u64>,
    pub seq: Option<u64>,
    pub seq_exact: bool,
    pub comm_rank: Option<u32>,
    pub size: Option<u32>,
    pub stream: Option<u64>,
    pub op: CommOp,
    /// Point to point: (sending comm rank, receiving comm rank).
    pub p2p: Option<(u32, u32)>,
}

/// What matches a collective across its members: (communicator hash,
/// seq) for collectives, (hash mixed with the direction, n-th) for
/// send/receive.
pub type CollectiveKey = (u64, u64);

/// A collective call and, when it can be matched across members, its key.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    pub call: Collective,
    pub key: Option<CollectiveKey>,
}

impl Observed {
    /// The id every member's slice of this operation carries.
    pub fn id(&self) -> Option<String> {
        let hash = self.call.comm_hash?;
        match (self.call.p2p, self.key) {
            (Some((src, dst)), Some((_, n))) => Some(format!("{hash:016x}:p2p{src}>{dst}:{n}")),
            (None, Some((_, seq))) => Some(format!("{hash:016x}:{seq}")),
            _ => None,
        }
    }
}

/// A collective slice's identity, when the event is one.
pub fn collective(event: &EventView<'_>) -> Option<Collective> {
    if event.kind != EventKind::Begin {
        return None;
    }
    let hash = k::COMM_HASH.read(event);
    let seq = k::SEQ.read(event);
    let comm = k::COMM.read(event);
    if hash.is_none() && seq.is_none() && comm.is_none() {
        return None;
    }
    let op = CommOp::of_name(event.name?)?;
    let comm_rank = k::COMM_RANK.read(event).map(|v| v as u32);
    // (A peer read as unsigned: a negative one is no rank.)
    let peer = k::PEER.read(event).and_then(|p| u32::try_from(p).ok());
    let p2p = match (op, comm_rank, peer) {
        (CommOp::Send, Some(r), Some(p)) => Some((r, p)),
        (CommOp::Recv, Some(r), Some(p)) => Some((p, r)),
        _ => None,
    };
    Some(Collective {
        comm_hash: hash,
        comm,
        seq,
        seq_exact: k::SEQ_EXACT.read(event).unwrap_or(false),
        comm_rank,
        size: k::COMM_SIZE.read(event).map(|v| v as u32),
        stream: k::STREAM.read(event),
        op,
        p2p,
    })
}

/// A stable id of a collective: the same on every member and node.
pub fn collective_key_hash(comm_hash: u64, seq: u64) -> u64 {
    mix(comm_hash ^ mix(seq ^ 0x636f_6c6c))
}

/// Collective ends of one node: (communicator, seq) -> earliest end seen
/// among its ranks (ranks that leave late are the noise), and the latest
/// entry among its ranks for all-reduce, all-gather and reduce-scatter
/// (no member can see one end before its last member entered it) and for
/// sends (no receive ends before its send was called): these bound the
/// clock offsets between nodes (`align`).
#[derive(Default)]
pub struct EndSample {
    by_hash: BTreeMap<u64, Sampled>,
}

struct Sampled {
    key: (u64, u64),
    end: Option<u64>,
    entry: Option<u64>,
}

impl EndSample {
    /// The sample's slot for `key`, if the key is in the sample (the same
    /// keys on every node: the lowest hashes).
    fn slot(&mut self, key: (u64, u64)) -> Option<&mut Sampled> {
        let h = collective_key_hash(key.0, key.1);
        if self.by_hash.len() >= MAX_END_SAMPLES
            && let Some((&last, _)) = self.by_hash.last_key_value()
        {
            if h > last {
                return None;
            }
            if !self.by_hash.contains_key(&h) {
                self.by_hash.pop_last();
            }
        }
        Some(self.by_hash.entry(h).or_insert(Sampled {
            key,
            end: None,
            entry: None,
        }))
    }

    pub fn insert(&mut self, key: (u64, u64), end: u64) {
        if let Some(s) = self.slot(key) {
            s.end = Some(s.end.map_or(end, |e| e.min(end)));
        }
    }

    /// A rank entered collective `key` at `ts`.
    pub fn insert_entry(&mut self, key: (u64, u64), ts: u64) {
        if let Some(s) = self.slot(key) {
            s.entry = Some(s.entry.map_or(ts, |e| e.max(ts)));
        }
    }

    pub fn len(&self) -> usize {
        self.by_hash.values().filter(|s| s.end.is_some()).count()
    }

    /// (communicator, seq) -> end.
    pub fn ends(&self) -> HashMap<(u64, u64), u64> {
        self.by_hash
            .values()
            .filter_map(|s| Some((s.key, s.end?)))
            .collect()
    }

    /// (communicator, seq) -> latest entry, for collectives.
    pub fn entries(&self) -> HashMap<(u64, u64), u64> {
        self.by_hash
            .values()
            .filter_map(|s| Some((s.key, s.entry?)))
            .collect()
    }
}

enum Open {
    Collective(Option<CollectiveKey>, Option<u64>),
    Sync(Option<u64>),
    Other,
}

/// Follows thread tracks: gives each collective its key and pairs it with
/// the end of the next sync of its stream on the same thread.
#[derive(Default)]
pub struct CollectiveTracker {
    open: FxHashMap<u64, Vec<Open>>,
    /// Per (track, stream): the last collective awaiting its sync.
    pending: FxHashMap<(u64, u64), CollectiveKey>,
    /// Send/receive operations so far per (communicator, from, to).
    p2p: FxHashMap<(u64, u32, u32), u64>,
}

impl CollectiveTracker {
    fn key(&mut self, c: &Collective) -> Option<CollectiveKey> {
        let hash = c.comm_hash?;
        if let Some((src, dst)) = c.p2p {
            let n = self.p2p.entry((hash, src, dst)).or_default();
            let key = (
                hash ^ mix(((u64::from(src) << 32) | u64::from(dst)) ^ 0x0070_3270),
                *n,
            );
            *n += 1;
            return Some(key);
        }
        c.seq_exact.then_some((hash, c.seq?))
    }

    /// Takes one track event; returns the collective it begins, if any.
    pub fn observe(&mut self, event: &EventView<'_>, ends: &mut EndSample) -> Option<Observed> {
        match event.kind {
            EventKind::Begin => {
                let c = collective(event);
                let observed = c.map(|call| Observed {
                    key: self.key(&call),
                    call,
                });
                // Operations where no member finishes before every member
                // entered (a broadcast's or reduce's members need not wait
                // for each other), and sends: their receive cannot finish
                // before the send was called (the send itself may finish
                // first, buffered, so a receive's entry bounds nothing).
                if let Some(o) = &observed
                    && let Some(k) = o.key
                    && match o.call.p2p {
                        None => matches!(
                            o.call.op,
                            CommOp::AllReduce | CommOp::AllGather | CommOp::ReduceScatter
                        ),
                        Some(_) => o.call.op == CommOp::Send,
                    }
                {
                    ends.insert_entry(k, event.ts);
                }
                let open = match (&observed, sync_stream(event)) {
                    (Some(o), _) => Open::Collective(o.key, o.call.stream),
                    (None, Some(stream)) => Open::Sync(stream),
                    (None, None) => Open::Other,
                };
                self.open.entry(event.track).or_default().push(open);
                observed
            }
            EventKind::End => {
                match self.open.get_mut(&event.track).and_then(Vec::pop) {
                    Some(Open::Collective(key, Some(stream))) => match key {
                        Some(k) => {
                            self.pending.insert((event.track, stream), k);
                        }
                        None => {
                            self.pending.remove(&(event.track, stream));
                        }
                    },
                    Some(Open::Sync(Some(stream))) => {
                        if let Some(k) = self.pending.remove(&(event.track, stream)) {
                            ends.insert(k, event.ts);
                        }
                    }
                    _ => {}
                }
                None
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xpuscope_perfetto::rewrite::ArgRef;

    fn ev<'a>(
        kind: EventKind,
        ts: u64,
        name: Option<&'a str>,
        args: Vec<(&'a str, ArgRef<'a>)>,
    ) -> EventView<'a> {
        EventView {
            kind,
            ts,
            track: 7,
            name,
            args,
        }
    }

    fn coll<'a>(ts: u64, seq: u64, stream: u64) -> EventView<'a> {
        ev(
            EventKind::Begin,
            ts,
            Some("ncclAllReduce 4 MiB f32 sum"),
            vec![
                ("stream", ArgRef::Pointer(stream)),
                ("comm", ArgRef::Pointer(0x55)),
                ("comm_hash", ArgRef::Str("00000000000000ab")),
                ("rank", ArgRef::Uint(1)),
                ("size", ArgRef::Uint(2)),
                ("seq", ArgRef::Uint(seq)),
                ("seq_exact", ArgRef::Bool(true)),
            ],
        )
    }

    fn sync<'a>(ts: u64, text: &'a str) -> EventView<'a> {
        ev(
            EventKind::Begin,
            ts,
            Some("cudaStreamSynchronize"),
            vec![("args", ArgRef::Str(text))],
        )
    }

    fn end<'a>(ts: u64) -> EventView<'a> {
        ev(EventKind::End, ts, None, vec![])
    }

    #[test]
    fn syncs_are_found_by_their_named_arguments_and_by_old_debug_text() {
        let named = ev(
            EventKind::Begin,
            10,
            Some("cudaStreamSynchronize"),
            vec![
                ("sync", ArgRef::Str("stream")),
                ("stream", ArgRef::Pointer(9)),
            ],
        );
        assert_eq!(sync_stream(&named), Some(Some(9)));
        let device = ev(
            EventKind::Begin,
            10,
            Some("cudaDeviceSynchronize"),
            vec![("sync", ArgRef::Str("device"))],
        );
        assert_eq!(sync_stream(&device), Some(None));
        assert_eq!(
            sync_stream(&sync(1, "Sync { stream: Some(3), event: None }")),
            Some(Some(3))
        );
        assert_eq!(sync_stream(&coll(1, 1, 9)), None, "not a sync");
    }

    #[test]
    fn a_collective_ends_with_the_next_sync_of_its_stream() {
        let mut t = CollectiveTracker::default();
        let mut ends = EndSample::default();
        let o = t.observe(&coll(100, 4, 9), &mut ends).unwrap();
        let c = &o.call;
        assert_eq!(
            (c.comm_hash, c.seq, c.op),
            (Some(0xab), Some(4), CommOp::AllReduce)
        );
        assert_eq!(o.id().as_deref(), Some("00000000000000ab:4"));
        t.observe(&end(110), &mut ends);
        // A sync of another stream says nothing about it.
        t.observe(
            &sync(120, "Sync { stream: Some(3), event: None }"),
            &mut ends,
        );
        t.observe(&end(500), &mut ends);
        assert_eq!(ends.len(), 0);
        t.observe(
            &sync(510, "Sync { stream: Some(9), event: None }"),
            &mut ends,
        );
        t.observe(&end(900), &mut ends);
        assert_eq!(ends.ends().get(&(0xab, 4)), Some(&900));
        // Once used, a later sync gives nothing more.
        t.observe(
            &sync(910, "Sync { stream: Some(9), event: None }"),
            &mut ends,
        );
        t.observe(&end(950), &mut ends);
        assert_eq!(ends.ends().get(&(0xab, 4)), Some(&900));
    }

    fn p2p<'a>(ts: u64, name: &'a str, rank: u64, peer: i64) -> EventView<'a> {
        ev(
            EventKind::Begin,
            ts,
            Some(name),
            vec![
                ("peer", ArgRef::Int(peer)),
                ("stream", ArgRef::Pointer(9)),
                ("comm", ArgRef::Pointer(0x56)),
                ("comm_hash", ArgRef::Str("00000000000000cd")),
                ("rank", ArgRef::Uint(rank)),
                ("size", ArgRef::Uint(2)),
            ],
        )
    }

    #[test]
    fn sends_match_receives_by_count_and_direction() {
        let (mut a, mut b) = (CollectiveTracker::default(), CollectiveTracker::default());
        let mut ends = EndSample::default();
        let s0 = a
            .observe(&p2p(1, "ncclSend 1 MiB to 1", 0, 1), &mut ends)
            .unwrap();
        let s1 = a
            .observe(&p2p(2, "ncclSend 1 MiB to 1", 0, 1), &mut ends)
            .unwrap();
        let back = a
            .observe(&p2p(3, "ncclRecv 1 MiB from 1", 0, 1), &mut ends)
            .unwrap();
        let r0 = b
            .observe(&p2p(1, "HcclRecv 1 MiB from 0", 1, 0), &mut ends)
            .unwrap();
        let r1 = b
            .observe(&p2p(2, "HcclRecv 1 MiB from 0", 1, 0), &mut ends)
            .unwrap();
        assert_eq!(s0.key, r0.key);
        assert_eq!(s1.key, r1.key);
        assert_ne!(s0.key, s1.key);
        assert_ne!(
            back.key.map(|k| k.0),
            s0.key.map(|k| k.0),
            "the other direction"
        );
        assert_eq!(s1.id().as_deref(), Some("00000000000000cd:p2p0>1:1"));
    }

    #[test]
    fn a_send_records_its_entry_and_a_receive_does_not() {
        let (mut a, mut b) = (CollectiveTracker::default(), CollectiveTracker::default());
        let (mut sender, mut receiver) = (EndSample::default(), EndSample::default());
        let s = a
            .observe(&p2p(10, "ncclSend 1 MiB to 1", 0, 1), &mut sender)
            .unwrap();
        b.observe(&p2p(5, "ncclRecv 1 MiB from 0", 1, 0), &mut receiver)
            .unwrap();
        let key = s.key.unwrap();
        assert_eq!(sender.entries().get(&key), Some(&10));
        assert!(
            receiver.entries().is_empty(),
            "a send may finish before its receive is called"
        );
    }

    #[test]
    fn the_sample_keeps_the_same_keys_everywhere_and_the_earliest_end() {
        let mut a = EndSample::default();
        let mut b = EndSample::default();
        for seq in 0..(MAX_END_SAMPLES as u64 + 5_000) {
            a.insert((1, seq), seq);
            b.insert((1, MAX_END_SAMPLES as u64 + 4_999 - seq), 0);
        }
        assert_eq!(a.len(), MAX_END_SAMPLES);
        let (ka, kb) = (a.ends(), b.ends());
        assert!(
            ka.keys().all(|k| kb.contains_key(k)),
            "insertion order does not matter"
        );
        a.insert((2, 0), 50);
        a.insert((2, 0), 40);
        a.insert((2, 0), 60);
        if let Some(e) = a.ends().get(&(2, 0)) {
            assert_eq!(*e, 40);
        }
    }
}
