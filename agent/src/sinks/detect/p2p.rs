//! `p2p`: the point-to-point wait-for edges of the hang detector.
//!
//! Sends and receives (`ncclSend`/`ncclRecv`, `HcclSend`/`HcclRecv`)
//! carry no sequence number, but NCCL and HCCL match them per peer and in
//! order: the k-th send from A to B on a communicator pairs with the k-th
//! receive of B from A on it. So the number of each that every process
//! entered, per communicator, peer and direction (a [`Channel`]), says who
//! waits for whom once a call is stuck: a rank that entered more receives
//! from P than P entered sends to it waits for P to send; one that entered
//! more sends to P than P entered receives from it waits for P to receive.
//! A pipeline-parallel rank waiting on its stage neighbour is linked to it
//! this way, where collectives' sequence numbers say nothing.
//!
//! A call counts as entered when its record passes (at its return, or
//! when its return is known lost), and while it is still in flight (a
//! blocking send or receive: the in-flight snapshot names its peer).
//! Failed calls posted nothing and are not counted. A peer's count is
//! known when it is a traced member of the communicator (0 when it sent or
//! received nothing yet); an untraced peer gives no edge.

use foldhash::HashMap;

use serde_json::{Value, json};
use xpuscope_probes::catalog::{CallKind, Direction};
use xpuscope_probes::decode::args::CallArgs;

use super::Ranks;
use crate::model::finding::comm_name;
use crate::model::{CommKey, DeviceCallRecord, OpenCall, comm_key};

/// Most channels counted per process (a pipeline rank has a few; an
/// all-to-all of point-to-point calls two per peer). Past it the process's
/// new channels are not counted and its missing counts are unknown, not 0.
pub const MAX_CHANNELS: usize = 4096;

/// One direction of point-to-point traffic between a process and a peer
/// on a communicator, as that process calls it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Channel {
    pub comm: CommKey,
    /// The peer's rank on the communicator.
    pub peer: u32,
    pub direction: Direction,
}

/// The direction of the calls that match `d`'s at the peer.
fn opposite(d: Direction) -> Direction {
    match d {
        Direction::Send => Direction::Recv,
        Direction::Recv => Direction::Send,
    }
}

/// `d`'s name in the evidence.
fn op_name(d: Direction) -> &'static str {
    match d {
        Direction::Send => "send",
        Direction::Recv => "recv",
    }
}

impl Channel {
    /// The channel of a finished (or abandoned) send or receive.
    fn of_record(r: &DeviceCallRecord) -> Option<Channel> {
        let c = &r.call;
        let (CallKind::SendRecv(direction), CallArgs::SendRecv(args), Some(cc), false) =
            (c.kind, &c.args, &c.comm, c.error)
        else {
            return None;
        };
        Some(Channel {
            comm: comm_key(c.library, cc)?,
            peer: u32::try_from(args.peer).ok()?,
            direction,
        })
    }

    /// The channel of a send or receive still in flight.
    fn of_open(c: &OpenCall) -> Option<Channel> {
        let CallKind::SendRecv(direction) = c.kind else {
            return None;
        };
        Some(Channel {
            comm: comm_key(c.library, c.comm.as_ref()?)?,
            peer: c.peer?,
            direction,
        })
    }

    /// The same traffic as the peer calls it: to or from `my_rank`, the
    /// other way.
    fn as_peer_calls_it(self, my_rank: u32) -> Channel {
        Channel {
            comm: self.comm,
            peer: my_rank,
            direction: opposite(self.direction),
        }
    }
}

/// What a process entered on one channel.
#[derive(Clone, Copy, Debug, Default)]
struct Count {
    entered: u64,
    /// The start of the last one counted (CLOCK_BOOTTIME ns): a call in
    /// flight that began by then is one of them (its record passed).
    last_start: u64,
}

#[derive(Default)]
struct ProcessCounts {
    channels: HashMap<Channel, Count>,
    /// A channel was not counted for [`MAX_CHANNELS`].
    full: bool,
}

/// What the communicators know of their members.
pub trait Members {
    /// `tgid`'s rank on `comm`.
    fn rank_of(&self, comm: CommKey, tgid: u32) -> Option<u32>;
    /// The traced process that is rank `rank` of `comm`.
    fn process_at(&self, comm: CommKey, rank: u32) -> Option<u32>;
}

/// A wait-for edge: process `tgid` entered more on `channel` than its
/// peer entered of the matching calls, so it waits for that peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wait {
    pub tgid: u32,
    pub channel: Channel,
    pub peer_tgid: u32,
    /// The calls it entered on the channel.
    pub entered: u64,
    /// The matching calls its peer entered.
    pub peer_entered: u64,
}

impl Wait {
    /// The message it waits for first (1-based): the first its peer did
    /// not match.
    pub fn nth(&self) -> u64 {
        self.peer_entered + 1
    }

    /// "rank 1 waits to receive its 7th message from rank 3 on
    /// nccl:3f2a000000000002, which sent 6".
    pub fn words(&self, ranks: &Ranks) -> String {
        let me = ranks.describe(self.tgid);
        let peer = ranks.describe(self.peer_tgid);
        let comm = comm_name(self.channel.comm.0.name(), self.channel.comm.1);
        let nth = ordinal(self.nth());
        match self.channel.direction {
            Direction::Recv => format!(
                "{me} waits to receive its {nth} message from {peer} on {comm}, which sent {}",
                self.peer_entered
            ),
            Direction::Send => format!(
                "{me} waits to send its {nth} message to {peer} on {comm}, which received {}",
                self.peer_entered
            ),
        }
    }

    pub fn json(&self, ranks: &Ranks) -> Value {
        json!({
            "rank": ranks.of(self.tgid),
            "pid": self.tgid,
            "peer": ranks.of(self.peer_tgid),
            "peer_pid": self.peer_tgid,
            "peer_comm_rank": self.channel.peer,
            "comm": comm_name(self.channel.comm.0.name(), self.channel.comm.1),
            "op": op_name(self.channel.direction),
            "nth": self.nth(),
            "entered": self.entered,
            "peer_entered": self.peer_entered,
        })
    }
}

/// "1st", "2nd", "3rd", "4th", "11th", "22nd".
fn ordinal(n: u64) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// The sends and receives each process entered, per channel.
#[derive(Default)]
pub struct PointToPoint {
    processes: HashMap<u32, ProcessCounts>,
}

impl PointToPoint {
    /// A call's record passed: a send or receive counts.
    pub fn device_call(&mut self, r: &DeviceCallRecord) {
        let Some(channel) = Channel::of_record(r) else {
            return;
        };
        let p = self.processes.entry(r.call.tgid).or_default();
        if !p.channels.contains_key(&channel) && p.channels.len() >= MAX_CHANNELS {
            p.full = true;
            return;
        }
        let count = p.channels.entry(channel).or_default();
        count.entered += 1;
        count.last_start = count.last_start.max(r.call.start_ts);
    }

    pub fn process_ended(&mut self, tgid: u32) {
        self.processes.remove(&tgid);
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.processes.contains_key(&tgid)
    }

    /// The calls `tgid` entered on `channel`, with those in flight in
    /// `open`; None when not known (not counted for [`MAX_CHANNELS`]).
    fn entered(&self, tgid: u32, channel: Channel, open: &[OpenCall]) -> Option<u64> {
        let p = self.processes.get(&tgid);
        let count = p.and_then(|p| p.channels.get(&channel)).copied();
        if count.is_none() && p.is_some_and(|p| p.full) {
            return None;
        }
        let count = count.unwrap_or_default();
        let in_flight = open
            .iter()
            .filter(|c| c.tgid == tgid && c.start_ts > count.last_start)
            .filter(|c| Channel::of_open(c) == Some(channel))
            .count() as u64;
        Some(count.entered + in_flight)
    }

    /// The channels `tgid` entered a call on, in a stable order.
    fn channels_of(&self, tgid: u32, open: &[OpenCall]) -> Vec<Channel> {
        let mut channels: Vec<Channel> = self
            .processes
            .get(&tgid)
            .into_iter()
            .flat_map(|p| p.channels.keys().copied())
            .chain(
                open.iter()
                    .filter(|c| c.tgid == tgid)
                    .filter_map(Channel::of_open),
            )
            .collect();
        channels.sort_unstable_by_key(|c| (c.comm, c.peer, c.direction == Direction::Recv));
        channels.dedup();
        channels
    }

    /// Whom `tgid` waits for: every channel where it entered more than its
    /// traced peer entered of the matching calls.
    pub fn waits(&self, tgid: u32, open: &[OpenCall], members: &impl Members) -> Vec<Wait> {
        self.channels_of(tgid, open)
            .into_iter()
            .filter_map(|channel| {
                let my_rank = members.rank_of(channel.comm, tgid)?;
                let peer_tgid = members.process_at(channel.comm, channel.peer)?;
                let entered = self.entered(tgid, channel, open)?;
                let peer_entered =
                    self.entered(peer_tgid, channel.as_peer_calls_it(my_rank), open)?;
                (entered > peer_entered).then_some(Wait {
                    tgid,
                    channel,
                    peer_tgid,
                    entered,
                    peer_entered,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_read_as_english() {
        let words: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111]
            .into_iter()
            .map(ordinal)
            .collect();
        assert_eq!(
            words,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st",
                "111th"
            ]
        );
    }
}
