//! The subset of Perfetto's trace schema that xpuscope writes, as hand-written
//! prost messages.
//!
//! Field numbers come from `protos/perfetto/trace/perfetto_trace.proto`
//! (google/perfetto) and `docs/src/development/perfetto-format.md`. Oneofs are
//! flattened into optional fields: the writer sets at most one member. Repeated
//! scalars are packed only where the official schema says `[packed = true]`,
//! because Perfetto's protozero decoders read non-packed fields as individual
//! varints and would misread a packed blob.
//!
//! Nothing here is public outside the crate: callers see [`crate::types`].

mod ftrace;
mod profiling;
mod track;

pub(crate) use ftrace::*;
pub(crate) use profiling::*;
pub(crate) use track::*;

/// `TracePacket.sequence_flags`: incremental state was cleared with this packet.
pub(crate) const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
/// `TracePacket.sequence_flags`: this packet needs the sequence's incremental state.
pub(crate) const SEQ_NEEDS_INCREMENTAL_STATE: u32 = 2;

/// `BuiltinClock` ids.
pub(crate) const CLOCK_REALTIME: u32 = 1;
pub(crate) const CLOCK_MONOTONIC: u32 = 3;
pub(crate) const CLOCK_BOOTTIME: u32 = 6;

/// One record of the `Trace.packet = 1` stream.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TracePacket {
    #[prost(message, optional, tag = "1")]
    pub ftrace_events: Option<FtraceEventBundle>,
    #[prost(message, optional, tag = "2")]
    pub process_tree: Option<ProcessTree>,
    #[prost(message, optional, tag = "6")]
    pub clock_snapshot: Option<ClockSnapshot>,
    #[prost(uint64, optional, tag = "8")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "10")]
    pub trusted_packet_sequence_id: Option<u32>,
    #[prost(message, optional, tag = "11")]
    pub track_event: Option<TrackEvent>,
    #[prost(message, optional, tag = "12")]
    pub interned_data: Option<InternedData>,
    #[prost(uint32, optional, tag = "13")]
    pub sequence_flags: Option<u32>,
    #[prost(message, optional, tag = "45")]
    pub system_info: Option<SystemInfo>,
    #[prost(message, optional, tag = "59")]
    pub trace_packet_defaults: Option<TracePacketDefaults>,
    #[prost(message, optional, tag = "60")]
    pub track_descriptor: Option<TrackDescriptor>,
    #[prost(message, optional, tag = "66")]
    pub perf_sample: Option<PerfSample>,
    #[prost(uint32, optional, tag = "98")]
    pub machine_id: Option<u32>,
    /// Schema v58+ (`TracePacket.stack_sample`).
    #[prost(message, optional, tag = "135")]
    pub stack_sample: Option<StackSample>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TracePacketDefaults {
    #[prost(message, optional, tag = "12")]
    pub perf_sample_defaults: Option<PerfSampleDefaults>,
    /// Schema v58+.
    #[prost(message, optional, tag = "100")]
    pub stack_sample_defaults: Option<StackSampleDefaults>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Utsname {
    #[prost(string, optional, tag = "1")]
    pub sysname: Option<String>,
    #[prost(string, optional, tag = "2")]
    pub version: Option<String>,
    #[prost(string, optional, tag = "3")]
    pub release: Option<String>,
    #[prost(string, optional, tag = "4")]
    pub machine: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SystemInfo {
    #[prost(message, optional, tag = "1")]
    pub utsname: Option<Utsname>,
    #[prost(int64, optional, tag = "3")]
    pub hz: Option<i64>,
    #[prost(uint32, optional, tag = "6")]
    pub page_size: Option<u32>,
    #[prost(uint32, optional, tag = "8")]
    pub num_cpus: Option<u32>,
    #[prost(string, optional, tag = "17")]
    pub machine_name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Clock {
    #[prost(uint32, optional, tag = "1")]
    pub clock_id: Option<u32>,
    #[prost(uint64, optional, tag = "2")]
    pub timestamp: Option<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ClockSnapshot {
    #[prost(message, repeated, tag = "1")]
    pub clocks: Vec<Clock>,
    #[prost(int32, optional, tag = "2")]
    pub primary_trace_clock: Option<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ProcessTreeProcess {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(int32, optional, tag = "2")]
    pub ppid: Option<i32>,
    #[prost(string, repeated, tag = "3")]
    pub cmdline: Vec<String>,
    #[prost(int32, optional, tag = "5")]
    pub uid: Option<i32>,
    #[prost(bool, optional, tag = "9")]
    pub cmdline_is_comm: Option<bool>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ProcessTreeThread {
    #[prost(int32, optional, tag = "1")]
    pub tid: Option<i32>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    #[prost(int32, optional, tag = "3")]
    pub tgid: Option<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ProcessTree {
    #[prost(message, repeated, tag = "1")]
    pub processes: Vec<ProcessTreeProcess>,
    #[prost(message, repeated, tag = "2")]
    pub threads: Vec<ProcessTreeThread>,
}
