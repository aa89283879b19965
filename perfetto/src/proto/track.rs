//! Track events: descriptors, events, debug annotations and interned data.

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ProcessDescriptor {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(string, optional, tag = "6")]
    pub process_name: Option<String>,
    #[prost(string, repeated, tag = "8")]
    pub process_labels: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ThreadDescriptor {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    /// `int32` up to schema v51, `int64` later: same varint for any i32.
    #[prost(int32, optional, tag = "2")]
    pub tid: Option<i32>,
    #[prost(string, optional, tag = "5")]
    pub thread_name: Option<String>,
}

/// `CounterDescriptor.Unit` values.
pub(crate) const UNIT_TIME_NS: i32 = 1;
pub(crate) const UNIT_COUNT: i32 = 2;
pub(crate) const UNIT_SIZE_BYTES: i32 = 3;

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CounterDescriptor {
    #[prost(int32, optional, tag = "3")]
    pub unit: Option<i32>,
    #[prost(string, optional, tag = "6")]
    pub unit_name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TrackDescriptor {
    #[prost(uint64, optional, tag = "1")]
    pub uuid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    #[prost(message, optional, tag = "3")]
    pub process: Option<ProcessDescriptor>,
    #[prost(message, optional, tag = "4")]
    pub thread: Option<ThreadDescriptor>,
    #[prost(uint64, optional, tag = "5")]
    pub parent_uuid: Option<u64>,
    #[prost(message, optional, tag = "8")]
    pub counter: Option<CounterDescriptor>,
    /// `ChildTracksOrdering`: 3 = EXPLICIT (children by `sibling_order_rank`).
    #[prost(int32, optional, tag = "11")]
    pub child_ordering: Option<i32>,
    #[prost(int32, optional, tag = "12")]
    pub sibling_order_rank: Option<i32>,
    #[prost(string, optional, tag = "14")]
    pub description: Option<String>,
}

/// `TrackEvent.Type` values.
pub(crate) const TYPE_SLICE_BEGIN: i32 = 1;
pub(crate) const TYPE_SLICE_END: i32 = 2;
pub(crate) const TYPE_INSTANT: i32 = 3;
pub(crate) const TYPE_COUNTER: i32 = 4;

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TrackEvent {
    #[prost(uint64, repeated, packed = "false", tag = "3")]
    pub category_iids: Vec<u64>,
    #[prost(message, repeated, tag = "4")]
    pub debug_annotations: Vec<DebugAnnotation>,
    #[prost(int32, optional, tag = "9")]
    pub r#type: Option<i32>,
    #[prost(uint64, optional, tag = "10")]
    pub name_iid: Option<u64>,
    #[prost(uint64, optional, tag = "11")]
    pub track_uuid: Option<u64>,
    /// A name written inline (no interning), as the merger's own events are.
    #[prost(string, optional, tag = "23")]
    pub name: Option<String>,
    #[prost(double, optional, tag = "44")]
    pub double_counter_value: Option<f64>,
    #[prost(fixed64, repeated, packed = "false", tag = "47")]
    pub flow_ids: Vec<u64>,
    #[prost(fixed64, repeated, packed = "false", tag = "48")]
    pub terminating_flow_ids: Vec<u64>,
    /// Newer than schema v51.
    #[prost(uint64, optional, tag = "56")]
    pub callstack_iid: Option<u64>,
}

/// `DebugAnnotation`; one value field is set.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct DebugAnnotation {
    #[prost(uint64, optional, tag = "1")]
    pub name_iid: Option<u64>,
    #[prost(bool, optional, tag = "2")]
    pub bool_value: Option<bool>,
    #[prost(uint64, optional, tag = "3")]
    pub uint_value: Option<u64>,
    #[prost(int64, optional, tag = "4")]
    pub int_value: Option<i64>,
    #[prost(double, optional, tag = "5")]
    pub double_value: Option<f64>,
    #[prost(string, optional, tag = "6")]
    pub string_value: Option<String>,
    #[prost(uint64, optional, tag = "7")]
    pub pointer_value: Option<u64>,
    /// A name written inline (no interning).
    #[prost(string, optional, tag = "10")]
    pub name: Option<String>,
}

/// `EventName`, `EventCategory` and `DebugAnnotationName` share this layout.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct NamedIid {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct InternedString {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(bytes = "vec", optional, tag = "2")]
    pub str: Option<Vec<u8>>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct InternedData {
    #[prost(message, repeated, tag = "1")]
    pub event_categories: Vec<NamedIid>,
    #[prost(message, repeated, tag = "2")]
    pub event_names: Vec<NamedIid>,
    #[prost(message, repeated, tag = "3")]
    pub debug_annotation_names: Vec<NamedIid>,
    #[prost(message, repeated, tag = "5")]
    pub function_names: Vec<InternedString>,
    #[prost(message, repeated, tag = "6")]
    pub frames: Vec<super::Frame>,
    #[prost(message, repeated, tag = "7")]
    pub callstacks: Vec<super::Callstack>,
    #[prost(message, repeated, tag = "16")]
    pub build_ids: Vec<InternedString>,
    #[prost(message, repeated, tag = "17")]
    pub mapping_paths: Vec<InternedString>,
    #[prost(message, repeated, tag = "19")]
    pub mappings: Vec<super::Mapping>,
}

impl InternedData {
    pub(crate) fn is_empty(&self) -> bool {
        self.event_categories.is_empty()
            && self.event_names.is_empty()
            && self.debug_annotation_names.is_empty()
            && self.function_names.is_empty()
            && self.frames.is_empty()
            && self.callstacks.is_empty()
            && self.build_ids.is_empty()
            && self.mapping_paths.is_empty()
            && self.mappings.is_empty()
    }
}
