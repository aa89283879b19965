//! Native Perfetto trace writer: streams scheduler data, track events,
//! counters and callstack samples as a protobuf trace that
//! [ui.perfetto.dev](https://ui.perfetto.dev) and the trace processor open
//! directly.
//!
//! ```
//! use xpuscope_perfetto::{
//!     Arg, ClockSnapshot, CounterUnit, Frame, ProcessInfo, SystemInfo, ThreadInfo, TraceWriter,
//! };
//!
//! # fn main() -> std::io::Result<()> {
//! let mut w = TraceWriter::new(Vec::new());
//! w.system_info(&SystemInfo { release: "6.18.0".into(), ..SystemInfo::default() })?;
//! w.clock_snapshot(&ClockSnapshot { boottime_ns: 1_000, monotonic_ns: 900, realtime_ns: 5_000 })?;
//! w.process_tree(
//!     1_000,
//!     &[ProcessInfo { pid: 42, ppid: 1, cmdline: vec!["python3".into(), "train.py".into()], uid: None }],
//!     &[ThreadInfo { tid: 42, tgid: 42, name: "python3".into() }],
//! )?;
//!
//! // Scheduler: switches and wakings per CPU, in time order.
//! w.sched_switch(0, 2_000, 0, 42, 120, "python3")?;
//! w.sched_waking(0, 2_500, 43, 1, 120, "pt_worker")?;
//! w.sched_switch(0, 3_000, 1, 0, 120, "swapper/0")?; // 42 went to sleep (S)
//!
//! // Track events: a slice with an argument on the thread, and a counter.
//! let thread = w.thread_track(42, 42, "python3")?;
//! w.slice_begin(thread, 2_100, "cudaStreamSynchronize", Some("cuda"), &[Arg::new("stream", 7u64)], &[], None)?;
//! w.slice_end(thread, 2_900, &[])?;
//! let mem = w.counter_track(None, "device memory", CounterUnit::SizeBytes)?;
//! w.counter(mem, 2_000, 1.5e9)?;
//!
//! // Off-CPU stack (leaf first, as eBPF gives it) weighted by 1 ms.
//! let stack = [Frame::kernel("schedule", 0x40), Frame::kernel("futex_wait", 0x80)];
//! w.stack_sample(3_000, 0, 42, 42, &stack, 1_000_000)?;
//!
//! let bytes = w.finish()?;
//! assert!(!bytes.is_empty());
//! # Ok(())
//! # }
//! ```
//!
//! # What goes where
//! - Sequence 1 (no incremental state): `SystemInfo`, `ClockSnapshot`s
//!   (BOOTTIME, MONOTONIC, REALTIME; BOOTTIME is the trace clock),
//!   `ProcessTree`s and one `FtraceEventBundle` per CPU per
//!   [`WriterOptions::bundle_events`] events. Switches and wakings use
//!   `CompactSched` (delta-encoded timestamps, a comm table local to the
//!   bundle, about 8-10 bytes per switch); thread lifetimes are plain
//!   `task_newtask`/`task_rename`/`sched_process_free` events in the same
//!   bundle. A timestamp that goes back on a CPU starts a new bundle.
//!   `previous_bundle_end_timestamp` is never set.
//! - Sequence 2: track descriptors, track events and samples, with event
//!   names, categories, annotation names, function names, mappings, frames
//!   and callstacks interned (ids from 1, identical callstacks shared). Its
//!   first packet clears the incremental state.
//! - With [`WriterOptions::machine_id`], every packet carries `machine_id`.
//!
//! # Off-CPU weight
//! Perfetto has one faithful way to say "this stack stands for N ns": the
//! `StackSample` packet of Perfetto v58+ (`TracePacket` field 135). Its
//! `primary_weight` is documented as "the value attributed to this sample for
//! the primary counter (e.g. the number of … nanoseconds this sample
//! represents)"; the importer stores it as a counter value joined to the
//! sample, and the UI's area-selection flamegraph offers it as a measure
//! summed per frame ("Xpuscope Off Cpu Samples (off-cpu time)") next to the
//! sample count. The writer declares the counter once per sequence in
//! `TracePacketDefaults.stack_sample_defaults` (source
//! [`OFF_CPU_SAMPLE_SOURCE`], counter [`OFF_CPU_COUNTER_NAME`] in ns).
//!
//! `PerfSample` (field 66) has no per-sample weight: `timebase_count` is a
//! cumulative counter reading ("no deltas"), and `cpu_mode`, `cpu` etc. carry
//! no time. Writing the off-CPU time there per sample would break that
//! contract, so [`SampleFormat::PerfSample`] (for trace processors older than
//! v58) keeps `timebase_count` cumulative per CPU and its flamegraphs count
//! samples only. `TrackEvent.callstack_weight` (v58+) weighs stacks attached
//! to slices, which suits stacks on slices, not free-standing samples.
//!
//! # Checking output
//! `xpuscope_tests::trace_check` decodes traces with the official schema
//! (`perfetto_protos`, a different protobuf runtime) and checks the
//! importer's rules; this crate's integration tests run it on every trace.

mod edit;
mod intern;
mod packet;
mod proto;
mod read;
mod samples;
mod sched;
mod sequence;
mod track_events;
mod types;
mod writer;

pub use samples::InternedCallstack;
pub use types::{
    Arg, ArgValue, ClockSnapshot, CounterUnit, DEFAULT_BUNDLE_EVENTS, Frame, KERNEL_MAPPING_PATH,
    Mapping, ProcessInfo, SampleFormat, SystemInfo, ThreadInfo, TrackUuid, WriterOptions,
};
pub use writer::TraceWriter;

/// Reading and rewriting traces this crate wrote (merging nodes).
pub mod rewrite {
    pub use crate::edit::{
        ArgRef, DecodeError, EventKind, EventView, IdMap, Interning, Packet, ProcessTreeView,
        SampleView, SystemInfoView, TrackView,
    };
    pub use crate::read::{MAX_PACKET_BYTES, PacketReader, ReadError, Truncated};
}

/// `StackSampleDefaults.source` of off-CPU samples; the UI titles their
/// tracks and flamegraph tab after it ("Xpuscope Off Cpu").
pub const OFF_CPU_SAMPLE_SOURCE: &str = "xpuscope.off_cpu";

/// Name of the nanosecond counter that weighs off-CPU samples.
pub const OFF_CPU_COUNTER_NAME: &str = "off-cpu time";

/// Name of the `PerfSample` timebase (cumulative off-CPU ns per CPU).
pub const OFF_CPU_PERF_TIMEBASE_NAME: &str = "off-cpu time (cumulative ns)";
