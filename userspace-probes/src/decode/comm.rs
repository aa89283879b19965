//! Communicators: identity across ranks, rank and size, and the sequence
//! number of each collective.
//!
//! Every rank of a communicator passes the same `ncclUniqueId` (128 bytes)
//! or `HcclRootInfo` (first 128 of 4108 bytes) to its init call, so a hash
//! of those bytes names the communicator on every rank and node. Collectives
//! on one communicator run in the same order on every rank (NCCL and HCCL
//! require it), so counting them per communicator in call order gives the
//! same number to the same collective everywhere: the key to match ranks'
//! slices and to find the rank that did not arrive.

use foldhash::HashMap;

use crate::catalog::Library;

/// Most communicators tracked per process; beyond it new ones are counted
/// but not remembered.
pub const MAX_COMMS: usize = 4096;
/// Bytes of the unique id / root info that name a communicator.
pub const ID_BYTES: usize = 128;

/// A stable 64-bit name for communicator id bytes (FNV-1a over the first
/// [`ID_BYTES`], trailing zero bytes ignored, so a copy cut short inside
/// the id's zero padding names the same communicator). Stable across
/// processes, machines and builds.
pub fn comm_id_hash(id: &[u8]) -> u64 {
    let id = &id[..id.len().min(ID_BYTES)];
    let end = id.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    fnv1a(FNV_OFFSET, &id[..end])
}

/// The identity of a communicator split from `parent` with `color`: the
/// same on every rank that passed that color.
pub fn split_hash(parent: u64, color: i32) -> u64 {
    let h = fnv1a(FNV_OFFSET, b"split");
    let h = fnv1a(h, &parent.to_le_bytes());
    fnv1a(h, &color.to_le_bytes())
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// What is known about one communicator of a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Communicator {
    pub library: Library,
    /// The handle (`ncclComm_t` / `HcclComm`) in the process.
    pub handle: u64,
    /// [`comm_id_hash`] of its id, when its init was seen.
    pub id_hash: Option<u64>,
    pub rank: Option<u32>,
    pub size: Option<u32>,
    /// Collectives issued so far (the next one's sequence number).
    pub collectives: u64,
    /// Its init was seen, so `collectives` counts from the first one and
    /// matches other ranks; false when the agent attached later.
    pub seen_init: bool,
}

/// The communicator fields a call carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommContext {
    pub handle: u64,
    pub id_hash: Option<u64>,
    pub rank: Option<u32>,
    pub size: Option<u32>,
    /// This collective's number on the communicator (None for send/recv
    /// and non-collective calls).
    pub seq: Option<u64>,
    /// `seq` counts from the communicator's first collective (its init was
    /// seen); otherwise it counts from the attach and differs across ranks.
    pub seq_exact: bool,
}

/// The communicators of one process, by handle.
#[derive(Clone, Debug, Default)]
pub struct CommRegistry {
    comms: HashMap<u64, Communicator>,
    /// Communicators not remembered because of [`MAX_COMMS`].
    pub overflow: u64,
}

impl CommRegistry {
    pub fn get(&self, handle: u64) -> Option<&Communicator> {
        self.comms.get(&handle)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Communicator> {
        self.comms.values()
    }

    pub fn len(&self) -> usize {
        self.comms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.comms.is_empty()
    }

    fn entry(&mut self, library: Library, handle: u64) -> Option<&mut Communicator> {
        if !self.comms.contains_key(&handle) {
            if self.comms.len() >= MAX_COMMS {
                self.overflow += 1;
                return None;
            }
            self.comms.insert(
                handle,
                Communicator {
                    library,
                    handle,
                    id_hash: None,
                    rank: None,
                    size: None,
                    collectives: 0,
                    seen_init: false,
                },
            );
        }
        self.comms.get_mut(&handle)
    }

    /// A communicator was created (init returned it): a fresh count.
    pub fn init(
        &mut self,
        library: Library,
        handle: u64,
        id_hash: Option<u64>,
        rank: Option<u32>,
        size: Option<u32>,
    ) {
        self.comms.remove(&handle);
        if let Some(c) = self.entry(library, handle) {
            c.id_hash = id_hash;
            c.rank = rank;
            c.size = size;
            c.seen_init = true;
        }
    }

    /// Takes the next collective sequence number of `handle`: `(seq, exact)`.
    pub fn next_seq(&mut self, library: Library, handle: u64) -> (Option<u64>, bool) {
        match self.entry(library, handle) {
            Some(c) => {
                let seq = c.collectives;
                c.collectives += 1;
                (Some(seq), c.seen_init)
            }
            None => (None, false),
        }
    }

    /// A size or rank learnt from a query (`ncclCommCount`, ...).
    pub fn learn(&mut self, library: Library, handle: u64, size: Option<u32>, rank: Option<u32>) {
        if let Some(c) = self.entry(library, handle) {
            c.size = size.or(c.size);
            c.rank = rank.or(c.rank);
        }
    }

    /// The communicator is gone (destroy/abort returned).
    pub fn remove(&mut self, handle: u64) -> Option<Communicator> {
        self.comms.remove(&handle)
    }

    /// The fields for a call on `handle` with sequence number `seq`.
    pub fn context(&self, handle: u64, seq: Option<u64>, seq_exact: bool) -> CommContext {
        let c = self.comms.get(&handle);
        CommContext {
            handle,
            id_hash: c.and_then(|c| c.id_hash),
            rank: c.and_then(|c| c.rank),
            size: c.and_then(|c| c.size),
            seq,
            seq_exact: seq.is_some() && seq_exact,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_hash_is_stable_and_ignores_zero_padding() {
        let mut id = [0u8; 128];
        id[..8].copy_from_slice(b"SNCL\0\0\0\0");
        id[8..20].copy_from_slice(b"/standin-abc");
        let full = comm_id_hash(&id);
        assert_eq!(
            full,
            comm_id_hash(&id[..56]),
            "a 56-byte copy inside the padding"
        );
        assert_eq!(full, comm_id_hash(&id[..20]));
        assert_ne!(full, comm_id_hash(&id[..19]));
        // Bytes past 128 (HcclRootInfo is 4108 bytes) do not count.
        let mut long = id.to_vec();
        long.extend_from_slice(&[7u8; 100]);
        assert_eq!(full, comm_id_hash(&long));
        // A fixed value: the hash must not change between builds, since
        // traces from different agents are merged by it.
        assert_eq!(comm_id_hash(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(comm_id_hash(&[]), FNV_OFFSET);
        assert_ne!(split_hash(full, 0), split_hash(full, 1));
        assert_eq!(split_hash(full, 1), split_hash(full, 1));
    }

    #[test]
    fn sequence_numbers_per_communicator() {
        let mut r = CommRegistry::default();
        r.init(Library::Nccl, 0xa0, Some(11), Some(1), Some(4));
        assert_eq!(r.next_seq(Library::Nccl, 0xa0), (Some(0), true));
        assert_eq!(r.next_seq(Library::Nccl, 0xa0), (Some(1), true));
        // An unknown handle (attached after its init) counts from 0, inexact.
        assert_eq!(r.next_seq(Library::Nccl, 0xb0), (Some(0), false));
        let ctx = r.context(0xa0, Some(2), true);
        assert_eq!(
            (ctx.id_hash, ctx.rank, ctx.size, ctx.seq, ctx.seq_exact),
            (Some(11), Some(1), Some(4), Some(2), true)
        );
        // A handle reused after destroy starts over.
        assert!(r.remove(0xa0).is_some());
        r.init(Library::Nccl, 0xa0, Some(12), Some(0), Some(2));
        assert_eq!(r.next_seq(Library::Nccl, 0xa0), (Some(0), true));
        r.learn(Library::Nccl, 0xb0, Some(8), None);
        assert_eq!(r.get(0xb0).unwrap().size, Some(8));
        assert!(!r.context(0xb0, None, true).seq_exact);
    }

    #[test]
    fn bounded() {
        let mut r = CommRegistry::default();
        for h in 0..MAX_COMMS as u64 + 10 {
            r.next_seq(Library::Hccl, h);
        }
        assert_eq!(r.len(), MAX_COMMS);
        assert_eq!(r.overflow, 10);
        assert_eq!(r.next_seq(Library::Hccl, u64::MAX), (None, false));
    }
}
