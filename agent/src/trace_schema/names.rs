//! Names of the events and tracks the agent writes. Readers find events
//! by them: they are part of the format.

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
