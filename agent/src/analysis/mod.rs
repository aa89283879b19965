//! Analyses of a training job that both drivers share: `agent attach`
//! feeds them from the live record stream (a sink), `agent merge` from
//! recorded traces. They see only what both have, never a trace's bytes
//! or a ring's.
//!
//! - [`groups`]: the job's TP/PP/DP groups from its communicators;
//! - [`steps`]: each rank's step breakdown from its main thread's calls
//!   and time off CPU.

pub mod groups;
pub mod steps;

/// The operation kind of a collective's function or slice name
/// (`ncclAllReduce`, `HcclAllGather 1 MiB`).
pub fn op_kind(name: &str) -> Option<&'static str> {
    let f = name.split_whitespace().next().unwrap_or("");
    let table: [(&str, &'static str); 8] = [
        ("AllReduce", "all_reduce"),
        ("AllGather", "all_gather"),
        ("ReduceScatter", "reduce_scatter"),
        ("Broadcast", "broadcast"),
        ("AlltoAll", "all_to_all"),
        ("Reduce", "reduce"),
        ("Send", "send"),
        ("Recv", "recv"),
    ];
    table.iter().find(|(k, _)| f.contains(k)).map(|(_, v)| *v)
}

#[cfg(test)]
mod tests {
    use super::op_kind;

    #[test]
    fn op_kinds_of_both_vendors() {
        assert_eq!(op_kind("ncclAllGather 1 MiB"), Some("all_gather"));
        assert_eq!(op_kind("HcclReduceScatter 1 MiB"), Some("reduce_scatter"));
        assert_eq!(op_kind("ncclSend 256 KiB"), Some("send"));
        assert_eq!(op_kind("HcclRecv"), Some("recv"));
        assert_eq!(op_kind("ncclAllReduce"), Some("all_reduce"));
        assert_eq!(op_kind("cudaMalloc"), None);
    }
}
