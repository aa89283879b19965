//! Names of the events and tracks the agent writes. Readers find events
//! by them: they are part of the format.

use crate::model::gpu::Vendor;

/// Category of device call slices, device work and their markers.
pub const DEVICE_CATEGORY: &str = "device";
/// Category of the findings' slices.
pub const FINDINGS_CATEGORY: &str = "xpuscope";

/// The name (before its ": ...") of the instant that says how a process
/// ended: `process exited: killed by SIGKILL`, `process exited: status 1`.
pub const PROCESS_EXIT_EVENT: &str = "process exited";
/// The instant marking a preemption by an outsider, followed by its comm.
pub const PREEMPTED_BY_EVENT: &str = "preempted by ";
/// An instant on a rank's thread where its Python step counter first
/// showed a value: `python step 120`.
pub const PYTHON_STEP_EVENT: &str = "python step ";
/// The zero-length slice marking where a host call enqueued device work
/// (an API record).
pub const ENQUEUED_EVENT: &str = "device work enqueued";
/// What follows a function's name in the instant of a failed allocation:
/// `cudaMalloc failed`.
pub const FAILED_SUFFIX: &str = " failed";
/// What follows a function's name in the instant of a call open when the
/// recording ended.
pub const IN_FLIGHT_AT_END_SUFFIX: &str = " (in flight at end)";
/// The instant of device memory a process still held, before what it
/// describes (`at exit`, ...).
pub const MEMORY_HELD_EVENT: &str = "device memory held ";

/// The findings track's name (tests and users look it up by it).
pub const FINDINGS_TRACK: &str = "xpuscope findings";
/// The counter of events the kernel dropped.
pub const DROPS_TRACK: &str = "xpuscope dropped events";
/// The counter of records the trace writer itself lost while it lagged.
pub const WRITER_LOSSES_TRACK: &str = "xpuscope records lost by the trace writer";
/// The counter, in a flight-recorder dump, of the window's records the
/// recorder lost while it lagged (the dump is missing them).
pub const RECORDER_LOSSES_TRACK: &str = "xpuscope records lost by the flight recorder";
/// A rank's counter of the share of each step its main thread spent on
/// its CPU outside device calls (host work), in percent.
pub const STEP_HOST_TRACK: &str = "step host work %";
/// A rank's counter of the share of each step its main thread spent in
/// device calls (waiting for its device or its peers), in percent.
pub const STEP_DEVICE_WAIT_TRACK: &str = "step device wait %";
/// A rank's counter of the kernel launches its process made in each step
/// (all threads; counted in the kernel at every capture level).
pub const STEP_LAUNCHES_TRACK: &str = "step kernel launches";
/// A rank's counter of the graph launches in each step (each runs many
/// kernels); written once the process launched a graph.
pub const STEP_GRAPH_LAUNCHES_TRACK: &str = "step graph launches";
/// A process's device memory counter, before the device's index.
pub const DEVICE_MEMORY_TRACK: &str = "device memory dev";

/// `agent merge`'s track of a rank's steps, under its process track.
pub const STEPS_TRACK: &str = "steps";
/// `agent merge`'s slice of one step on it: `step 12`.
pub const STEP_EVENT: &str = "step ";

/// Process track labels (`rank=3`) saying a process's place in the job.
pub const RANK_LABEL: &str = "rank";
pub const LOCAL_RANK_LABEL: &str = "local_rank";
pub const WORLD_SIZE_LABEL: &str = "world_size";
pub const JOB_LABEL: &str = "job";

/// The value of label `key` (`rank=3` -> `3`) among a track's labels.
pub fn label<'a>(labels: &'a [String], key: &str) -> Option<&'a str> {
    labels
        .iter()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// The slice name of a call that failed: `cudaMalloc [error 2]`.
pub fn error_slice_name(name: &str, ret: i64) -> String {
    format!("{name} [error {ret}]")
}

/// The function a call's slice or instant is named after (its first word:
/// `ncclAllReduce 4 MiB bf16 sum`).
pub fn function_of(event_name: &str) -> &str {
    event_name.split_whitespace().next().unwrap_or("")
}

/// A GPU's track (`GPU 0`), at the top level, from NVML's index; its
/// description names the model and UUID. Its counters are its children.
pub const GPU_TRACK: &str = "GPU ";
/// An Ascend NPU's track (`NPU 0`), at the top level, from its place in
/// DCMI's enumeration; its description names the chip and its card and
/// device. The same counters and instants as a GPU's; its clock counter is
/// [`NPU_FREQUENCY_TRACK`].
pub const NPU_TRACK: &str = "NPU ";
/// An NPU's AI Core frequency counter (`NPU 0 AI Core frequency`), MHz.
pub const NPU_FREQUENCY_TRACK: &str = " AI Core frequency";
/// A GPU's SM clock counter (`GPU 0 SM clock`), MHz.
pub const GPU_SM_CLOCK_TRACK: &str = " SM clock";
/// A GPU's utilization counter (`GPU 0 utilization`), percent.
pub const GPU_UTILIZATION_TRACK: &str = " utilization";
/// A GPU's memory-in-use counter (`GPU 0 memory used`), bytes.
pub const GPU_MEMORY_TRACK: &str = " memory used";
/// The instant on a GPU's track holding one sample's every reading (the
/// counters draw them; `agent diagnose` reads them back from here).
pub const GPU_SAMPLE_EVENT: &str = "gpu sample";
/// The slice on a GPU's track while its clock is slowed, before the
/// reasons' names: `clocks slowed: sw_thermal_slowdown`.
pub const GPU_SLOWED_EVENT: &str = "clocks slowed: ";
/// The instant of an Xid error on a GPU's track: `Xid 79`.
pub const GPU_XID_EVENT: &str = "Xid ";
/// The instant of an error code an NPU newly lists, on its track:
/// `error code 0x80E01801`.
pub const NPU_ERROR_EVENT: &str = "error code ";

/// A device's track name: `GPU 3`, `NPU 3`.
pub fn gpu_track(vendor: Vendor, gpu: u32) -> String {
    match vendor {
        Vendor::Nvidia => format!("{GPU_TRACK}{gpu}"),
        Vendor::Ascend => format!("{NPU_TRACK}{gpu}"),
    }
}

/// The device a track named by [`gpu_track`] is.
pub fn gpu_of_track(name: &str) -> Option<(Vendor, u32)> {
    if let Some(n) = name.strip_prefix(GPU_TRACK) {
        return Some((Vendor::Nvidia, n.parse().ok()?));
    }
    Some((Vendor::Ascend, name.strip_prefix(NPU_TRACK)?.parse().ok()?))
}

/// A device's error instant's name: `Xid 79`, `error code 0x80E01801`.
pub fn gpu_error_event(vendor: Vendor, code: u64) -> String {
    match vendor {
        Vendor::Nvidia => format!("{GPU_XID_EVENT}{code}"),
        Vendor::Ascend => format!("{NPU_ERROR_EVENT}0x{code:X}"),
    }
}
