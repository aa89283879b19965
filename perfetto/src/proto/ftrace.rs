//! Kernel scheduling messages: `FtraceEventBundle`, `CompactSched` and the
//! plain `FtraceEvent`s that carry thread lifetimes.

/// `FtraceEventBundle`. `previous_bundle_end_timestamp = 10` is deliberately
/// absent: it makes the importer hide earlier sched data.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct FtraceEventBundle {
    #[prost(uint32, optional, tag = "1")]
    pub cpu: Option<u32>,
    #[prost(message, repeated, tag = "2")]
    pub event: Vec<FtraceEvent>,
    #[prost(bool, optional, tag = "3")]
    pub lost_events: Option<bool>,
    #[prost(message, optional, tag = "4")]
    pub compact_sched: Option<CompactSched>,
}

/// `FtraceEventBundle.CompactSched`: structure of arrays, all `[packed = true]`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CompactSched {
    #[prost(uint64, repeated, tag = "1")]
    pub switch_timestamp: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub switch_prev_state: Vec<i64>,
    #[prost(int32, repeated, tag = "3")]
    pub switch_next_pid: Vec<i32>,
    #[prost(int32, repeated, tag = "4")]
    pub switch_next_prio: Vec<i32>,
    #[prost(string, repeated, tag = "5")]
    pub intern_table: Vec<String>,
    #[prost(uint32, repeated, tag = "6")]
    pub switch_next_comm_index: Vec<u32>,
    #[prost(uint64, repeated, tag = "7")]
    pub waking_timestamp: Vec<u64>,
    #[prost(int32, repeated, tag = "8")]
    pub waking_pid: Vec<i32>,
    #[prost(int32, repeated, tag = "9")]
    pub waking_target_cpu: Vec<i32>,
    #[prost(int32, repeated, tag = "10")]
    pub waking_prio: Vec<i32>,
    #[prost(uint32, repeated, tag = "11")]
    pub waking_comm_index: Vec<u32>,
}

/// A plain `FtraceEvent`; exactly one payload field is set.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct FtraceEvent {
    #[prost(uint64, optional, tag = "1")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "2")]
    pub pid: Option<u32>,
    #[prost(message, optional, tag = "235")]
    pub task_newtask: Option<TaskNewtask>,
    #[prost(message, optional, tag = "236")]
    pub task_rename: Option<TaskRename>,
    #[prost(message, optional, tag = "240")]
    pub sched_process_free: Option<SchedProcessFree>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TaskNewtask {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(string, optional, tag = "2")]
    pub comm: Option<String>,
    #[prost(uint64, optional, tag = "3")]
    pub clone_flags: Option<u64>,
    #[prost(int32, optional, tag = "4")]
    pub oom_score_adj: Option<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TaskRename {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(string, optional, tag = "2")]
    pub oldcomm: Option<String>,
    #[prost(string, optional, tag = "3")]
    pub newcomm: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SchedProcessFree {
    #[prost(string, optional, tag = "1")]
    pub comm: Option<String>,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
    #[prost(int32, optional, tag = "3")]
    pub prio: Option<i32>,
}
