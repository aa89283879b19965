//! Which series exist, who feeds them, and when they go.
//!
//! Two bounds keep `/metrics` from growing with the node's history:
//! - per family, at most [`MAX_SERIES`] label sets at a time (past that a
//!   new one is folded into `other` values, counted);
//! - a rank's series leave once every process that fed them has exited and
//!   [`EXITED_SERIES_RETENTION_NS`] has passed, so a node that runs job
//!   after job serves the jobs of the last minutes, not of its uptime (and
//!   the bound never fills with finished jobs, folding the new ones).
//!
//! A series belongs to the rank part of its labels (training_job, rank, local_rank,
//! node); a process feeds the rank its identity names, and also a folded
//! one once its series were folded.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use super::{CollectiveLabels, CommLabels, DeviceLabels, RankLabels};

/// Most label sets per family.
pub const MAX_SERIES: usize = 2_000;
/// How long the series of a rank whose processes all exited are still
/// served: several scrapes at any usual interval (15 s to 1 min) read their
/// final values before they go.
pub const EXITED_SERIES_RETENTION_NS: u64 = 300_000_000_000;

/// The families whose series are keyed by the rank labels alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RankFamily {
    Sync,
    Launches,
    /// Off-CPU seconds and the run-queue delay histogram (one bound).
    OffCpu,
    InFlightOldest,
    /// The step split's three histograms (one bound).
    Steps,
}

impl RankFamily {
    pub fn bound_name(self) -> &'static str {
        match self {
            RankFamily::Sync => "sync_duration",
            RankFamily::Launches => "launches",
            RankFamily::OffCpu => "off_cpu",
            RankFamily::InFlightOldest => "in_flight_oldest",
            RankFamily::Steps => "step",
        }
    }
}

/// The series of one rank, and the processes feeding it.
#[derive(Default, Debug)]
pub struct RankSeries {
    live: HashSet<u32>,
    /// When its last process exited (CLOCK_BOOTTIME ns); `None` while one
    /// lives.
    idle_since: Option<u64>,
    pub rank_families: Vec<RankFamily>,
    pub collective: Vec<CollectiveLabels>,
    pub comm: Vec<CommLabels>,
    pub device: Vec<DeviceLabels>,
}

/// A label set's owner key.
pub trait RankPart {
    fn rank_part(&self) -> RankLabels;
}

macro_rules! rank_part {
    ($($t:ty),*) => {$(
        impl RankPart for $t {
            fn rank_part(&self) -> RankLabels {
                RankLabels {
                    training_job: self.training_job.clone(),
                    rank: self.rank.clone(),
                    local_rank: self.local_rank.clone(),
                    node: self.node.clone(),
                }
            }
        }
    )*};
}
rank_part!(RankLabels, CollectiveLabels, CommLabels, DeviceLabels);

/// The label sets admitted per family, and their owners.
#[derive(Default)]
pub struct SeriesBook {
    seen: HashMap<&'static str, HashSet<u64>>,
    owners: HashMap<RankLabels, RankSeries>,
    /// Each live process's owner keys: its rank's, and folded ones.
    processes: HashMap<u32, Vec<RankLabels>>,
}

/// What [`SeriesBook::admit`] decided.
pub enum Admission {
    /// A series the family already has.
    Known,
    /// A new series: the caller records it in its owner with
    /// [`SeriesBook::owner`].
    New,
    /// No room: fold the labels (and admit the folded set).
    Full,
}

fn key<L: Hash>(labels: &L) -> u64 {
    let mut h = DefaultHasher::new();
    labels.hash(&mut h);
    h.finish()
}

impl SeriesBook {
    /// Whether `family` has, or has room for, `labels`.
    pub fn admit<L: Hash>(&mut self, family: &'static str, labels: &L) -> Admission {
        let key = key(labels);
        let seen = self.seen.entry(family).or_default();
        if seen.contains(&key) {
            Admission::Known
        } else if seen.len() < MAX_SERIES {
            seen.insert(key);
            Admission::New
        } else {
            Admission::Full
        }
    }

    /// The owner of series with rank part `rank`, created if new.
    pub fn owner(&mut self, rank: RankLabels) -> &mut RankSeries {
        self.owners.entry(rank).or_default()
    }

    /// `tgid` feeds `rank` from now on (its identity, or a fold of it).
    pub fn feeds(&mut self, tgid: u32, rank: &RankLabels) {
        let keys = self.processes.entry(tgid).or_default();
        if keys.contains(rank) {
            return;
        }
        keys.push(rank.clone());
        let owner = self.owners.entry(rank.clone()).or_default();
        owner.live.insert(tgid);
        owner.idle_since = None;
    }

    /// `tgid` stops feeding `rank` at `ts` (its identity changed).
    pub fn stops_feeding(&mut self, tgid: u32, rank: &RankLabels, ts: u64) {
        if let Some(keys) = self.processes.get_mut(&tgid) {
            keys.retain(|k| k != rank);
        }
        self.release(tgid, rank, ts);
    }

    /// `tgid` exited at `ts`.
    pub fn exited(&mut self, tgid: u32, ts: u64) {
        for rank in self.processes.remove(&tgid).unwrap_or_default() {
            self.release(tgid, &rank, ts);
        }
    }

    fn release(&mut self, tgid: u32, rank: &RankLabels, ts: u64) {
        if let Some(owner) = self.owners.get_mut(rank) {
            owner.live.remove(&tgid);
            if owner.live.is_empty() {
                owner.idle_since = Some(ts);
            }
        }
    }

    /// The ranks whose processes all exited at least the retention before
    /// `now`, taken out of the book (their label sets forgotten, so the
    /// bound has room again): the caller removes their series.
    pub fn expire(&mut self, now: u64) -> Vec<(RankLabels, RankSeries)> {
        let gone: Vec<RankLabels> = self
            .owners
            .iter()
            .filter(|(_, o)| {
                o.idle_since
                    .is_some_and(|t| now.saturating_sub(t) >= EXITED_SERIES_RETENTION_NS)
            })
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::with_capacity(gone.len());
        for rank in gone {
            let Some(owner) = self.owners.remove(&rank) else {
                continue;
            };
            self.forget(&rank, &owner);
            out.push((rank, owner));
        }
        out
    }

    fn forget(&mut self, rank: &RankLabels, owner: &RankSeries) {
        let mut drop_key = |family: &'static str, k: u64| {
            if let Some(s) = self.seen.get_mut(family) {
                s.remove(&k);
            }
        };
        for f in &owner.rank_families {
            drop_key(f.bound_name(), key(rank));
        }
        for l in &owner.collective {
            drop_key("collective", key(l));
        }
        for l in &owner.comm {
            drop_key("last_seq", key(l));
        }
        for l in &owner.device {
            drop_key("device_memory", key(l));
        }
    }

    /// Ranks with series, and processes feeding them.
    #[cfg(test)]
    pub fn sizes(&self) -> (usize, usize) {
        (self.owners.len(), self.processes.len())
    }
}
