//! What a communication call does, named once: the catalog's collectives
//! and the two point-to-point directions, with each spelling a reader
//! writes (`all_reduce` in traces' group reports and the step analysis,
//! `allreduce` in metric labels: both are user-facing, so both stay).

use super::{CallKind, Collective, Direction};

/// A communication operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CommOp {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    Barrier,
    AllToAll,
    Send,
    Recv,
}

impl CommOp {
    /// Every operation.
    pub const ALL: [CommOp; 9] = [
        CommOp::AllReduce,
        CommOp::Broadcast,
        CommOp::Reduce,
        CommOp::AllGather,
        CommOp::ReduceScatter,
        CommOp::Barrier,
        CommOp::AllToAll,
        CommOp::Send,
        CommOp::Recv,
    ];

    /// The operation a catalog call performs, if it communicates.
    pub fn of(kind: CallKind) -> Option<CommOp> {
        match kind {
            CallKind::Collective(c) => Some(c.into()),
            CallKind::SendRecv(Direction::Send) => Some(CommOp::Send),
            CallKind::SendRecv(Direction::Recv) => Some(CommOp::Recv),
            _ => None,
        }
    }

    /// The operation named in a function or slice name (`ncclAllGather`,
    /// `HcclReduceScatter 1 MiB`), by the part of the function name that
    /// says it. A barrier moves no data: readers pairing operations across
    /// ranks (the step analysis, the merge) leave it out, as they always
    /// have, and so does this; `ncclBcast` is not named as a broadcast
    /// here for the same reason (only `ncclBroadcast` is).
    pub fn of_name(name: &str) -> Option<CommOp> {
        let f = name.split_whitespace().next().unwrap_or("");
        // Longest first where one contains another (`AllReduce` holds
        // `Reduce`).
        const BY_NAME: [(&str, CommOp); 8] = [
            ("AllReduce", CommOp::AllReduce),
            ("AllGather", CommOp::AllGather),
            ("ReduceScatter", CommOp::ReduceScatter),
            ("Broadcast", CommOp::Broadcast),
            ("AlltoAll", CommOp::AllToAll),
            ("Reduce", CommOp::Reduce),
            ("Send", CommOp::Send),
            ("Recv", CommOp::Recv),
        ];
        BY_NAME
            .iter()
            .find(|(k, _)| f.contains(k))
            .map(|(_, op)| *op)
    }

    /// The name in traces, reports and the step analysis: `all_reduce`.
    pub fn label(self) -> &'static str {
        match self {
            CommOp::AllReduce => "all_reduce",
            CommOp::Broadcast => "broadcast",
            CommOp::Reduce => "reduce",
            CommOp::AllGather => "all_gather",
            CommOp::ReduceScatter => "reduce_scatter",
            CommOp::Barrier => "barrier",
            CommOp::AllToAll => "all_to_all",
            CommOp::Send => "send",
            CommOp::Recv => "recv",
        }
    }

    /// The value of the `op` label of the collective metrics: `allreduce`.
    pub fn metric_label(self) -> &'static str {
        match self {
            CommOp::AllReduce => "allreduce",
            CommOp::Broadcast => "broadcast",
            CommOp::Reduce => "reduce",
            CommOp::AllGather => "allgather",
            CommOp::ReduceScatter => "reducescatter",
            CommOp::Barrier => "barrier",
            CommOp::AllToAll => "alltoall",
            CommOp::Send => "send",
            CommOp::Recv => "recv",
        }
    }

    /// The operation a [`CommOp::label`] names.
    pub fn from_label(label: &str) -> Option<CommOp> {
        CommOp::ALL.into_iter().find(|op| op.label() == label)
    }

    /// The catalog collective, for the operations that are one.
    pub fn collective(self) -> Option<Collective> {
        Some(match self {
            CommOp::AllReduce => Collective::AllReduce,
            CommOp::Broadcast => Collective::Broadcast,
            CommOp::Reduce => Collective::Reduce,
            CommOp::AllGather => Collective::AllGather,
            CommOp::ReduceScatter => Collective::ReduceScatter,
            CommOp::Barrier => Collective::Barrier,
            CommOp::AllToAll | CommOp::Send | CommOp::Recv => return None,
        })
    }

    /// A point-to-point operation (no sequence number; matched by count).
    pub fn is_p2p(self) -> bool {
        matches!(self, CommOp::Send | CommOp::Recv)
    }
}

impl From<Collective> for CommOp {
    fn from(c: Collective) -> CommOp {
        match c {
            Collective::AllReduce => CommOp::AllReduce,
            Collective::Broadcast => CommOp::Broadcast,
            Collective::Reduce => CommOp::Reduce,
            Collective::AllGather => CommOp::AllGather,
            Collective::ReduceScatter => CommOp::ReduceScatter,
            Collective::Barrier => CommOp::Barrier,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_of_both_vendors_by_name() {
        let of = |n: &str| CommOp::of_name(n).map(CommOp::label);
        assert_eq!(of("ncclAllGather 1 MiB"), Some("all_gather"));
        assert_eq!(of("HcclReduceScatter 1 MiB"), Some("reduce_scatter"));
        assert_eq!(of("ncclSend 256 KiB"), Some("send"));
        assert_eq!(of("HcclRecv"), Some("recv"));
        assert_eq!(of("ncclAllReduce"), Some("all_reduce"));
        assert_eq!(of("ncclReduce 4 MiB"), Some("reduce"));
        assert_eq!(of("cudaMalloc"), None);
        assert_eq!(of("HcclBarrier"), None);
    }

    #[test]
    fn each_op_has_its_spellings_and_reads_back() {
        for op in CommOp::ALL {
            assert_eq!(CommOp::from_label(op.label()), Some(op));
            if let Some(c) = op.collective() {
                assert_eq!(CommOp::from(c), op);
                assert_eq!(CommOp::of(CallKind::Collective(c)), Some(op));
            }
        }
        assert_eq!(CommOp::AllReduce.metric_label(), "allreduce");
        assert_eq!(
            CommOp::of(CallKind::SendRecv(Direction::Recv)),
            Some(CommOp::Recv)
        );
    }
}
