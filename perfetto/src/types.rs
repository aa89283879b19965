//! The plain data callers hand to [`crate::TraceWriter`]: the project's own
//! types, independent of the Perfetto schema they are written as.

use std::borrow::Cow;
use std::sync::{Arc, LazyLock};

/// Identifies a track created by [`crate::TraceWriter`]'s `*_track` methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TrackUuid(pub u64);

/// The machine that produced the trace (`SystemInfo` packet).
///
/// `release` matters most: the importer decodes `prev_state` by kernel
/// version and assumes 4.4 without it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SystemInfo {
    /// `uname -s`, e.g. "Linux".
    pub sysname: String,
    /// `uname -v`.
    pub version: String,
    /// `uname -r`, e.g. "6.18.0-1-amd64".
    pub release: String,
    /// `uname -m`, e.g. "x86_64".
    pub machine: String,
    /// `sysconf(_SC_CLK_TCK)`.
    pub hz: i64,
    /// Page size in bytes.
    pub page_size: u32,
    /// Number of possible CPUs.
    pub num_cpus: u32,
    /// A human name for the node (shown for multi-machine traces).
    pub machine_name: Option<String>,
}

/// The same instant read on three clocks (`ClockSnapshot` packet). All trace
/// timestamps are BOOTTIME; REALTIME lines machines up with each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClockSnapshot {
    /// CLOCK_BOOTTIME, ns.
    pub boottime_ns: u64,
    /// CLOCK_MONOTONIC, ns.
    pub monotonic_ns: u64,
    /// CLOCK_REALTIME, ns since the Unix epoch.
    pub realtime_ns: u64,
}

/// A process in a [`crate::TraceWriter::process_tree`] snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Process id (tgid).
    pub pid: i32,
    /// Parent process id.
    pub ppid: i32,
    /// argv. Must not be empty (the importer skips processes without a
    /// cmdline): pass `[comm]` when argv is unknown. If it is empty anyway,
    /// the writer uses the main thread's name from the same snapshot, else
    /// the pid, and marks the cmdline as a comm.
    pub cmdline: Vec<String>,
    /// Real user id, if known.
    pub uid: Option<u32>,
}

/// A thread in a [`crate::TraceWriter::process_tree`] snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ThreadInfo {
    /// Thread id.
    pub tid: i32,
    /// Owning process id.
    pub tgid: i32,
    /// comm.
    pub name: String,
}

/// An executable mapping a [`Frame`] belongs to.
///
/// Kernel frames use [`Mapping::kernel`]: path `"kernel"` with
/// `start == end == 0`, which the importer recognises as the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mapping {
    /// File path, e.g. "/usr/lib/x86_64-linux-gnu/libc.so.6".
    pub path: String,
    /// Raw build-id bytes (e.g. the 20-byte GNU build id), not hex.
    pub build_id: Option<Vec<u8>>,
    /// Start address of the mapping in the process.
    pub start: u64,
    /// End address (exclusive) of the mapping in the process.
    pub end: u64,
    /// File offset the mapping starts at (`/proc/pid/maps` offset).
    pub start_offset: u64,
    /// ELF load bias.
    pub load_bias: u64,
}

/// Path of the kernel pseudo-mapping.
pub const KERNEL_MAPPING_PATH: &str = "kernel";

static KERNEL_MAPPING: LazyLock<Arc<Mapping>> = LazyLock::new(|| {
    Arc::new(Mapping {
        path: KERNEL_MAPPING_PATH.to_owned(),
        ..Mapping::default()
    })
});

impl Mapping {
    /// The shared kernel pseudo-mapping.
    pub fn kernel() -> Arc<Mapping> {
        Arc::clone(&KERNEL_MAPPING)
    }

    /// Whether this is the kernel pseudo-mapping (path "kernel", empty range).
    pub fn is_kernel(&self) -> bool {
        self.path == KERNEL_MAPPING_PATH && self.start == 0 && self.end == 0
    }
}

/// One frame of a callstack.
///
/// Stacks are passed LEAF FIRST, as eBPF `bpf_get_stack*` gives them: the user
/// stack and the kernel stack, each innermost frame first, concatenated in
/// either order. The writer emits them root first (reversed user frames, then
/// reversed kernel frames), telling the two parts apart with
/// [`Mapping::is_kernel`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Symbolized function name ("" or a hex address when unknown).
    pub function: String,
    /// The mapping the pc lies in; share one `Arc` per mapping.
    pub mapping: Arc<Mapping>,
    /// pc relative to the mapping's ELF (file-relative, load bias removed).
    pub rel_pc: u64,
}

impl Frame {
    /// A frame in `mapping`.
    pub fn new(function: impl Into<String>, mapping: Arc<Mapping>, rel_pc: u64) -> Self {
        Frame {
            function: function.into(),
            mapping,
            rel_pc,
        }
    }

    /// A kernel frame (in the shared [`Mapping::kernel`] mapping).
    pub fn kernel(function: impl Into<String>, rel_pc: u64) -> Self {
        Frame::new(function, Mapping::kernel(), rel_pc)
    }
}

/// A named value attached to a track event (a `DebugAnnotation`).
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    /// Argument name (interned per sequence). A writer's fixed keys are
    /// `&'static str`: no allocation per argument for its name.
    pub name: Cow<'static, str>,
    /// Argument value.
    pub value: ArgValue,
}

impl Arg {
    /// `Arg::new("bytes", 4096u64)`.
    pub fn new(name: impl Into<Cow<'static, str>>, value: impl Into<ArgValue>) -> Self {
        Arg {
            name: name.into(),
            value: value.into(),
        }
    }
}

/// The value of an [`Arg`].
#[derive(Clone, Debug, PartialEq)]
pub enum ArgValue {
    /// Signed integer.
    Int(i64),
    /// Unsigned integer.
    Uint(u64),
    /// Floating point.
    Double(f64),
    /// String (not interned).
    Str(String),
    /// Boolean.
    Bool(bool),
    /// An address, shown in hex.
    Pointer(u64),
}

impl From<i64> for ArgValue {
    fn from(v: i64) -> Self {
        ArgValue::Int(v)
    }
}

impl From<u64> for ArgValue {
    fn from(v: u64) -> Self {
        ArgValue::Uint(v)
    }
}

impl From<f64> for ArgValue {
    fn from(v: f64) -> Self {
        ArgValue::Double(v)
    }
}

impl From<bool> for ArgValue {
    fn from(v: bool) -> Self {
        ArgValue::Bool(v)
    }
}

impl From<String> for ArgValue {
    fn from(v: String) -> Self {
        ArgValue::Str(v)
    }
}

impl From<&str> for ArgValue {
    fn from(v: &str) -> Self {
        ArgValue::Str(v.to_owned())
    }
}

/// Unit of a counter track.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CounterUnit {
    /// Nanoseconds.
    TimeNs,
    /// A plain count.
    Count,
    /// Bytes.
    SizeBytes,
    /// Any other unit, shown by name (e.g. "%", "W").
    Other(String),
}

/// How [`crate::TraceWriter::stack_sample`] writes callstack samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SampleFormat {
    /// `TracePacket.stack_sample` (field 135, Perfetto v58+): the off-CPU
    /// time is the sample's `primary_weight`, declared once per sequence as
    /// a nanosecond counter, so area-selection flamegraphs can be weighted by
    /// time. Trace processors before v58 ignore these packets.
    #[default]
    StackSample,
    /// `TracePacket.perf_sample` (field 66), readable by every Perfetto
    /// version but only as sample counts: `timebase_count` holds the
    /// cumulative off-CPU ns per CPU, as the field's "no deltas" contract
    /// asks, which Perfetto does not turn into per-sample weights.
    PerfSample,
}

/// Tuning for [`crate::TraceWriter::with_options`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterOptions {
    /// Events per CPU bundle before it is written (default 4096). Larger
    /// bundles compress better; the UI prefers packets of a few tens of KiB.
    pub bundle_events: usize,
    /// Set as `machine_id` on every packet, to merge several nodes' traces.
    pub machine_id: Option<u32>,
    /// Packet used for callstack samples.
    pub sample_format: SampleFormat,
}

/// Default [`WriterOptions::bundle_events`].
pub const DEFAULT_BUNDLE_EVENTS: usize = 4096;

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            bundle_events: DEFAULT_BUNDLE_EVENTS,
            machine_id: None,
            sample_format: SampleFormat::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_mapping_is_shared_and_recognised() {
        let a = Mapping::kernel();
        let b = Mapping::kernel();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(a.is_kernel());
        let user = Mapping {
            path: "kernel".into(),
            start: 0x1000,
            end: 0x2000,
            ..Mapping::default()
        };
        assert!(!user.is_kernel());
        assert!(Frame::kernel("schedule", 0x10).mapping.is_kernel());
    }

    #[test]
    fn arg_conversions() {
        assert_eq!(Arg::new("a", 1i64).value, ArgValue::Int(1));
        assert_eq!(Arg::new("a", 1u64).value, ArgValue::Uint(1));
        assert_eq!(Arg::new("a", "x").value, ArgValue::Str("x".into()));
        assert_eq!(Arg::new("a", true).value, ArgValue::Bool(true));
        assert_eq!(Arg::new("a", 0.5).value, ArgValue::Double(0.5));
    }

    #[test]
    fn default_options() {
        let o = WriterOptions::default();
        assert_eq!(o.bundle_events, 4096);
        assert_eq!(o.machine_id, None);
        assert_eq!(o.sample_format, SampleFormat::StackSample);
    }
}
