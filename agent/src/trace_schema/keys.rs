//! Argument keys, typed by their values. A name used with two types (a
//! call's `comm` handle, an exit's `comm` name) is two keys.

use super::{Flag, Hex, Int, Key, Ptr, Text, Uint};

// A device call's slice: what it is and its arguments.
pub const LIBRARY: Key<Text> = Key::new("library");
pub const BYTES: Key<Uint> = Key::new("bytes");
pub const COUNT: Key<Uint> = Key::new("count");
pub const DTYPE: Key<Text> = Key::new("dtype");
/// A collective's reduction (`sum`).
pub const RED_OP: Key<Text> = Key::new("op");
/// A user-defined reduction's value (its name does not say it).
pub const RED_OP_VALUE: Key<Uint> = Key::new("op_value");
pub const ROOT: Key<Int> = Key::new("root");
pub const SEND_BUF: Key<Ptr> = Key::new("send_buf");
pub const RECV_BUF: Key<Ptr> = Key::new("recv_buf");
/// A send's or receive's buffer.
pub const BUF: Key<Ptr> = Key::new("buf");
pub const PEER: Key<Int> = Key::new("peer");
pub const STREAM: Key<Ptr> = Key::new("stream");
pub const NRANKS: Key<Uint> = Key::new("nranks");
pub const INIT_RANK: Key<Uint> = Key::new("init_rank");
pub const ID_HASH: Key<Hex> = Key::new("id_hash");
pub const PTR: Key<Ptr> = Key::new("ptr");
/// `cudaSetDevice`'s argument.
pub const SET_DEVICE: Key<Int> = Key::new("device");
pub const MEMCPY_KIND: Key<Text> = Key::new("kind");
pub const MEMCPY_DST: Key<Ptr> = Key::new("dst");
pub const MEMCPY_SRC: Key<Ptr> = Key::new("src");
pub const MEMSET_VALUE: Key<Int> = Key::new("value");
pub const FUNC: Key<Ptr> = Key::new("func");
pub const GRID: Key<Text> = Key::new("grid");
pub const BLOCK: Key<Text> = Key::new("block");
pub const BLOCKS: Key<Uint> = Key::new("blocks");
pub const SHARED_MEM: Key<Uint> = Key::new("shared_mem");
pub const GRAPH_EXEC: Key<Ptr> = Key::new("graph_exec");
/// A launch's kernel, named by the driver handle it runs.
pub const KERNEL: Key<Text> = Key::new("kernel");
/// A driver virtual-memory call's physical allocation handle.
pub const MEM_HANDLE: Key<Hex> = Key::new("mem_handle");
pub const MEM_OFFSET: Key<Uint> = Key::new("offset");
/// A kernel handle a driver call handed out (`CUfunction`, `CUkernel`).
pub const HANDLE: Key<Ptr> = Key::new("handle");
/// The `CUkernel` a `cuKernelGetFunction` asked for.
pub const FROM_KERNEL: Key<Ptr> = Key::new("from_kernel");
/// What a synchronisation waits for (`stream`, `device`, `event`):
/// readers find the syncs by it.
pub const SYNC: Key<Text> = Key::new("sync");
pub const EVENT: Key<Ptr> = Key::new("event");
/// A communicator's handle in its process.
pub const COMM: Key<Ptr> = Key::new("comm");
/// What a communicator query returned.
pub const QUERY_VALUE: Key<Uint> = Key::new("value");
pub const ACTIVITY_KIND: Key<Uint> = Key::new("activity_kind");
pub const TIMESTAMP: Key<Uint> = Key::new("timestamp");
pub const MESSAGE: Key<Text> = Key::new("message");
pub const RANGE_ID: Key<Uint> = Key::new("range_id");
/// Arguments as debug text (traces of earlier agents).
pub const LEGACY_ARGS: Key<Text> = Key::new("args");

// The communicator context of a call.
pub const COMM_HASH: Key<Hex> = Key::new("comm_hash");
pub const COMM_RANK: Key<Uint> = Key::new("rank");
pub const COMM_SIZE: Key<Uint> = Key::new("size");
pub const SEQ: Key<Uint> = Key::new("seq");
pub const SEQ_EXACT: Key<Flag> = Key::new("seq_exact");

// A call's effect on device memory.
pub const DEVICE: Key<Uint> = Key::new("device");
pub const DEVICE_BYTES_HELD: Key<Uint> = Key::new("device_bytes_held");
pub const DEVICE_BYTES_DELTA: Key<Int> = Key::new("device_bytes_delta");
pub const ALLOC_SITE: Key<Uint> = Key::new("alloc_site");
/// An allocation's site, by name.
pub const ALLOC_STACK: Key<Text> = Key::new("alloc_stack");
/// Memory the driver does not count as the process's (the trace's counter
/// leaves it out).
pub const UNTRACKED: Key<Flag> = Key::new("untracked");

// The process's launches so far (all threads), as the kernel counted them
// when the call returned: on the calls that carry them (synchronisations).
// Step windows take their launches from the differences.
pub const LAUNCHES_SO_FAR: Key<Uint> = Key::new("launches_so_far");
pub const GRAPH_LAUNCHES_SO_FAR: Key<Uint> = Key::new("graph_launches_so_far");

// How a call ended.
pub const RETURN: Key<Int> = Key::new("return");
pub const ERROR: Key<Int> = Key::new("error");
/// Why a call has no return (its thread or process died in it).
pub const UNMATCHED: Key<Text> = Key::new("unmatched");

// A failed allocation's instant and memory still held.
pub const REQUESTED: Key<Uint> = Key::new("requested");
pub const STACK: Key<Text> = Key::new("stack");
/// The largest live sites: `live_sites.1.bytes`, `live_sites.1.allocations`,
/// `live_sites.1.stack`, ... (dotted names nest in the UI's argument view).
pub const LIVE_SITES: &str = "live_sites";

// Calls past the flood rate, summarized.
pub const CALLS: Key<Uint> = Key::new("calls");
pub const BUSY_NS: Key<Uint> = Key::new("busy_ns");
pub const RATE_LIMITED: Key<Flag> = Key::new("rate_limited");
/// Per function: `calls.<function>`.
pub const CALLS_PREFIX: &str = "calls";

// A call open when the recording ended.
pub const STARTED: Key<Uint> = Key::new("started");
pub const OPEN_NS: Key<Uint> = Key::new("open_ns");

// Device work and where it was enqueued.
pub const CORRELATION_ID: Key<Uint> = Key::new("correlation_id");
/// A piece of device work's kind (`communication`, `compute`, ...).
pub const WORK_KIND: Key<Text> = Key::new("work");

// A process's end.
pub const EXIT_CODE: Key<Int> = Key::new("exit_code");
pub const EXIT_TID: Key<Uint> = Key::new("tid");
pub const EXIT_COMM: Key<Text> = Key::new("comm");
pub const SIGNAL: Key<Int> = Key::new("signal");

// A preemption by an outsider.
pub const BY_COMM: Key<Text> = Key::new("by_comm");
pub const BY_TID: Key<Uint> = Key::new("by_tid");
pub const BY_PID: Key<Uint> = Key::new("by_pid");
pub const CPU: Key<Uint> = Key::new("cpu");

// A Python step counter's value.
pub const STEP: Key<Uint> = Key::new("step");
/// The name of the local the step was read from (`step`, `global_step`).
pub const STEP_LOCAL: Key<Text> = Key::new("local");

// A finding's slice.
pub const FINDING_KIND: Key<Text> = Key::new("kind");
pub const SUMMARY: Key<Text> = Key::new("summary");
/// Comma-separated global ranks.
pub const RANKS: Key<Text> = Key::new("ranks");
pub const DETECTED_NS: Key<Uint> = Key::new("detected_ns");
/// The communicator a finding is about, by name.
pub const FINDING_COMM: Key<Text> = Key::new("comm");
/// The headline of the earlier finding a streamed one follows from (its
/// consequence), where one explains it.
pub const FOLLOWS_FROM: Key<Text> = Key::new("follows_from");
/// A finding's evidence: `evidence.<key>`, nested objects dotted.
pub const EVIDENCE: &str = "evidence";

// What `agent merge` adds to a collective's slice.
/// The id every member's slice of one operation carries.
pub const COLLECTIVE_ID: Key<Text> = Key::new("collective_id");
/// The parallel group of its communicator (`tp`, `dp`, ...).
pub const GROUP: Key<Text> = Key::new("group");

/// `live_sites.<n>.<field>`: the n-th (from 1) live site's field.
pub fn live_site(n: usize, field: &str) -> String {
    format!("{LIVE_SITES}.{n}.{field}")
}

// A GPU's sample, slowed clocks and Xid errors (on its GPU track).
/// NVML's index of the GPU.
pub const GPU: Key<Uint> = Key::new("gpu");
pub const GPU_NAME: Key<Text> = Key::new("gpu_name");
pub const GPU_UUID: Key<Text> = Key::new("gpu_uuid");
pub const SM_CLOCK_MHZ: Key<Uint> = Key::new("sm_clock_mhz");
pub const MAX_SM_CLOCK_MHZ: Key<Uint> = Key::new("max_sm_clock_mhz");
/// `nvmlClocksEventReason*` bits.
pub const CLOCK_EVENT_REASONS: Key<Uint> = Key::new("clock_event_reasons");
/// Their names, comma-separated.
pub const REASONS: Key<Text> = Key::new("reasons");
pub const UTILIZATION_PCT: Key<Uint> = Key::new("utilization_pct");
pub const MEMORY_USED_BYTES: Key<Uint> = Key::new("memory_used_bytes");
pub const MEMORY_TOTAL_BYTES: Key<Uint> = Key::new("memory_total_bytes");
pub const ECC_UNCORRECTED: Key<Uint> = Key::new("ecc_uncorrected");
/// The GPU's compute processes, comma-separated pids.
pub const GPU_PIDS: Key<Text> = Key::new("pids");
pub const XID: Key<Uint> = Key::new("xid");
/// An NPU's DCMI health level (0 ok .. 3 critical alarm).
pub const HEALTH: Key<Uint> = Key::new("health");
/// An error code an NPU listed (DCMI).
pub const ERROR_CODE: Key<Uint> = Key::new("error_code");
