//! Device-library records: calls with their meaning, device work on device
//! streams, device memory by allocation site.

use std::sync::Arc;

use xpuscope_probes::catalog::{CallKind, Library};
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::memory::Device;
use xpuscope_probes::decode::{DeviceCall, OpenReason};

use super::{Field, Site};

/// Ties a host call (or an enqueue marker) to the device work it caused;
/// unique in a recording.
pub type FlowId = u64;

/// A communicator as every member names it, on every node: its library
/// and the hash of its unique id. Known only where the communicator's
/// set-up was recorded; what matches collectives across ranks.
pub type CommKey = (Library, u64);

/// The communicator of a call with one, as every member names it.
pub fn comm_key(library: Library, comm: &CommContext) -> Option<CommKey> {
    comm.id_hash.map(|h| (library, h))
}

/// A communicator as one process names it: its id's hash when its set-up
/// was recorded, else its handle (which tells that process's
/// communicators apart, not one job's).
pub fn process_comm_id(id_hash: Option<u64>, handle: Option<u64>) -> u64 {
    id_hash.or(handle).unwrap_or(0)
}

/// A device-library call as decoded.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceCallRecord {
    pub call: DeviceCall,
    /// The allocating stack (device-memory allocations).
    pub site: Option<Arc<Site>>,
    /// Flows to the device work this call enqueued.
    pub flows: Vec<FlowId>,
    /// Set when the return never came, and why.
    pub unmatched: Option<OpenReason>,
    /// A failed allocation: the largest live sites on its device.
    pub oom: Option<Vec<LiveSiteRow>>,
}

impl DeviceCallRecord {
    pub fn new(call: DeviceCall) -> Self {
        Self {
            call,
            site: None,
            flows: Vec::new(),
            unmatched: None,
            oom: None,
        }
    }

    /// Whether the call never returned because its thread or process died
    /// in it (killed: a hung job ended by its launcher).
    pub fn died_in_call(&self) -> bool {
        matches!(
            self.unmatched,
            Some(OpenReason::ThreadExited | OpenReason::ProcessExited)
        )
    }

    /// When the call ended (its start when no return was seen).
    pub fn end_ts(&self) -> u64 {
        self.call
            .end_ts
            .unwrap_or(self.call.start_ts)
            .max(self.call.start_ts)
    }
}

/// Live device memory charged to one allocation site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveSiteRow {
    pub device: Device,
    pub bytes: u64,
    pub allocations: u64,
    pub site: Option<Arc<Site>>,
}

/// When device memory still held is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldAt {
    Exit,
    EndOfTrace,
}

impl HeldAt {
    pub fn describe(self) -> &'static str {
        match self {
            HeldAt::Exit => "at exit",
            HeldAt::EndOfTrace => "at end of trace",
        }
    }
}

/// A process's device memory still held, largest sites first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryHeld {
    pub tgid: u32,
    pub ts: u64,
    pub at: HeldAt,
    /// Bytes held over all devices.
    pub held: u64,
    pub rows: Vec<LiveSiteRow>,
}

/// A host thread enqueued device work (known from an API record only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnqueueMarker {
    pub tgid: u32,
    pub tid: u32,
    pub ts: u64,
    pub correlation: u64,
    pub flow: FlowId,
}

/// A device stream of a process, as a track.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamTrack {
    pub tgid: u32,
    /// "GPU 0 stream 7", "NPU 1 stream 3", "GPU 0 stream 0x10 (estimated)".
    pub name: String,
    /// Estimated from launches and syncs (no activity records).
    pub estimated: bool,
}

/// What a piece of device work is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkKind {
    /// A compute kernel (the model's own work).
    Compute,
    /// A copy on the copy engines.
    Copy,
    /// A collective's device side: NCCL's kernels, HCCL's operations (its
    /// time includes waiting for the other members).
    Communication,
    /// Estimated from launches and syncs (no activity records).
    Estimated,
    Other,
}

impl WorkKind {
    pub const ALL: [WorkKind; 5] = [
        WorkKind::Compute,
        WorkKind::Copy,
        WorkKind::Communication,
        WorkKind::Estimated,
        WorkKind::Other,
    ];

    /// Its name on the trace (the device work's `work` argument).
    pub fn name(self) -> &'static str {
        match self {
            WorkKind::Compute => "compute",
            WorkKind::Copy => "copy",
            WorkKind::Communication => "communication",
            WorkKind::Estimated => "estimated",
            WorkKind::Other => "other",
        }
    }
}

/// One piece of device work (a kernel, a copy, a collective, an estimate),
/// in start order per stream.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceWork {
    pub track: StreamTrack,
    pub kind: WorkKind,
    pub start: u64,
    pub end: u64,
    pub name: String,
    pub fields: Vec<Field>,
    /// Flows from the host call that enqueued it.
    pub flows: Vec<FlowId>,
}

/// Calls of one thread summarized over a window because their functions
/// were called faster than `--device-call-rate` (a flood). One window per
/// thread at a time, so its slices nest with the thread's other calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallSummary {
    pub tgid: u32,
    pub tid: u32,
    /// (library, function, calls), in first-seen order.
    pub functions: Vec<(&'static str, &'static str, u64)>,
    /// The first call's start and the last one's end.
    pub start: u64,
    pub end: u64,
    pub calls: u64,
    /// Time spent in those calls.
    pub busy_ns: u64,
}

/// A call still open when the recording ended (where a hang shows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlightCall {
    pub tgid: u32,
    pub tid: u32,
    pub function: &'static str,
    pub start_ts: u64,
    pub seq: Option<u64>,
    pub end: u64,
}

/// What a thread with a blocking call open was doing at a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadNow {
    /// On a CPU (or its last switch-out was not seen).
    OnCpu,
    /// Off CPU since `since` in report state `state` (see `crate::state`).
    Off { state: i64, since: u64 },
    /// Scheduling is not recorded (capture level 0).
    Unknown,
}

/// A blocking call (collective, point-to-point, synchronization) entered
/// and not yet returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenCall {
    pub tgid: u32,
    pub tid: u32,
    pub library: Library,
    pub function: &'static str,
    pub kind: CallKind,
    pub start_ts: u64,
    /// The communicator as the call's record will carry it.
    pub comm: Option<CommContext>,
    /// A send's or receive's peer: its rank on that communicator.
    pub peer: Option<u32>,
    pub thread: ThreadNow,
}

/// The blocking calls still running at `ts` (sent about once a second
/// while there are any, and once more when the last one returned): what
/// sinks need to see a hang while it lasts. Each snapshot replaces the
/// previous one, so a sink that lost batches is right again at the next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlightSnapshot {
    pub ts: u64,
    pub calls: Vec<OpenCall>,
    /// The main thread of every process with a rank identity: what it is
    /// doing, and the stack it left its CPU with if it is off CPU now (a
    /// rank that never joins a collective sits there).
    pub main_threads: Vec<MainThreadNow>,
}

/// A process's main thread at a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MainThreadNow {
    pub tgid: u32,
    pub thread: ThreadNow,
    pub stack: Option<std::sync::Arc<super::Stack>>,
}
