//! Stacks and samples: interned `Mapping`/`Frame`/`Callstack`, `PerfSample`
//! (schema v51) and `StackSample` (schema v58+).

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Mapping {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    /// iid into `InternedData.build_ids` (raw build-id bytes).
    #[prost(uint64, optional, tag = "2")]
    pub build_id: Option<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub start_offset: Option<u64>,
    #[prost(uint64, optional, tag = "4")]
    pub start: Option<u64>,
    #[prost(uint64, optional, tag = "5")]
    pub end: Option<u64>,
    #[prost(uint64, optional, tag = "6")]
    pub load_bias: Option<u64>,
    /// iids into `InternedData.mapping_paths`; not packed in the schema.
    #[prost(uint64, repeated, packed = "false", tag = "7")]
    pub path_string_ids: Vec<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Frame {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(uint64, optional, tag = "2")]
    pub function_name_id: Option<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub mapping_id: Option<u64>,
    #[prost(uint64, optional, tag = "4")]
    pub rel_pc: Option<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Callstack {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    /// Root (outermost) frame first; not packed in the schema.
    #[prost(uint64, repeated, packed = "false", tag = "2")]
    pub frame_ids: Vec<u64>,
}

/// `Profiling.CpuMode` values.
pub(crate) const CPU_MODE_KERNEL: i32 = 1;
pub(crate) const CPU_MODE_USER: i32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PerfSample {
    #[prost(uint32, optional, tag = "1")]
    pub cpu: Option<u32>,
    #[prost(uint32, optional, tag = "2")]
    pub pid: Option<u32>,
    #[prost(uint32, optional, tag = "3")]
    pub tid: Option<u32>,
    #[prost(uint64, optional, tag = "4")]
    pub callstack_iid: Option<u64>,
    #[prost(int32, optional, tag = "5")]
    pub cpu_mode: Option<i32>,
    /// Counter value since the event was configured (cumulative, no deltas).
    #[prost(uint64, optional, tag = "6")]
    pub timebase_count: Option<u64>,
}

/// `PerfEvents.Timebase`: only the explicit name is written.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PerfTimebase {
    #[prost(string, optional, tag = "10")]
    pub name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PerfSampleDefaults {
    #[prost(message, optional, tag = "1")]
    pub timebase: Option<PerfTimebase>,
}

/// `StackSample.TaskContext`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SampleTaskContext {
    #[prost(uint32, optional, tag = "2")]
    pub pid: Option<u32>,
    #[prost(uint32, optional, tag = "3")]
    pub tid: Option<u32>,
}

/// `StackSample.Mode` values.
pub(crate) const SAMPLE_MODE_USER: i32 = 1;
pub(crate) const SAMPLE_MODE_KERNEL: i32 = 2;

/// `StackSample.ExecutionContext`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SampleExecutionContext {
    #[prost(uint32, optional, tag = "2")]
    pub cpu: Option<u32>,
    #[prost(int32, optional, tag = "3")]
    pub mode: Option<i32>,
}

/// `StackSample.Unit.UNIT_NANOSECONDS`.
pub(crate) const SAMPLE_UNIT_NANOSECONDS: i32 = 1;
/// `StackSample.CounterDescriptor.Scope.SCOPE_GLOBAL`.
pub(crate) const SAMPLE_SCOPE_GLOBAL: i32 = 1;

/// `StackSample.CounterDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SampleCounterDescriptor {
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    #[prost(int32, optional, tag = "3")]
    pub unit: Option<i32>,
    #[prost(string, optional, tag = "6")]
    pub description: Option<String>,
    #[prost(int32, optional, tag = "7")]
    pub scope: Option<i32>,
}

/// `StackSample` (schema v58+, `TracePacket.stack_sample = 135`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct StackSample {
    #[prost(message, optional, tag = "1")]
    pub task_context: Option<SampleTaskContext>,
    #[prost(message, optional, tag = "3")]
    pub execution_context: Option<SampleExecutionContext>,
    #[prost(uint64, optional, tag = "6")]
    pub callstack_iid: Option<u64>,
    /// The value this sample represents for the primary counter.
    #[prost(uint64, optional, tag = "11")]
    pub primary_weight: Option<u64>,
}

/// `StackSampleDefaults` (schema v58+, `TracePacketDefaults` field 100).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct StackSampleDefaults {
    #[prost(string, optional, tag = "1")]
    pub source: Option<String>,
    #[prost(message, optional, tag = "2")]
    pub primary_descriptor: Option<SampleCounterDescriptor>,
}
