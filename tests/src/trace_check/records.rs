//! The records a [`super::Timeline`] is made of: scheduler events, thread
//! and process entries, tracks, slices, counters, samples, thread states.

/// [`Switch::prev_pid`] of a CPU's first switch, whose previous task the
/// compact format does not record.
pub const UNKNOWN_PID: i32 = -1;

/// A context switch on `cpu` at `ts` from `prev_pid` to `next_pid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Switch {
    pub cpu: u32,
    pub ts: u64,
    /// The task switched out: the previous switch's `next_pid` on this CPU,
    /// or [`UNKNOWN_PID`] for a CPU's first switch of compact data.
    pub prev_pid: i32,
    pub prev_state: i64,
    pub next_pid: i32,
    pub next_comm: String,
    pub next_prio: i32,
}

/// `pid` woken up by the task running on `cpu`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waking {
    pub cpu: u32,
    pub ts: u64,
    pub pid: i32,
    pub comm: String,
    pub prio: i32,
    pub target_cpu: i32,
    /// The task running on `cpu` at `ts`, if a switch told us.
    pub waker_pid: Option<i32>,
}

/// `task_newtask`: `firing_pid` created `pid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewTask {
    pub cpu: u32,
    pub ts: u64,
    pub firing_pid: i32,
    pub pid: i32,
    pub comm: String,
    pub clone_flags: u64,
    pub oom_score_adj: i32,
}

/// `task_rename`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rename {
    pub cpu: u32,
    pub ts: u64,
    pub firing_pid: i32,
    pub pid: i32,
    pub old_comm: String,
    pub new_comm: String,
}

/// `sched_process_free`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessFree {
    pub cpu: u32,
    pub ts: u64,
    pub firing_pid: i32,
    pub pid: i32,
    pub comm: String,
    pub prio: i32,
}

/// A bundle flagged `lost_events`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostEvents {
    pub cpu: u32,
    /// Earliest event timestamp in that bundle (None when it was empty).
    pub first_ts: Option<u64>,
}

/// A process, from ProcessTree snapshots, forks and process tracks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessEntry {
    pub pid: i32,
    pub ppid: Option<i32>,
    pub cmdline: Vec<String>,
    pub uid: Option<u32>,
    /// Process name: a process track's name, else `cmdline[0]`, else the comm
    /// it was forked with.
    pub name: Option<String>,
    /// Labels of its process track.
    pub labels: Vec<String>,
}

/// A thread's final name and process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ThreadEntry {
    pub tid: i32,
    pub tgid: Option<i32>,
    pub name: Option<String>,
}

/// What a track descriptor describes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TrackKind {
    Process {
        pid: i32,
        name: Option<String>,
        labels: Vec<String>,
    },
    Thread {
        pid: i32,
        tid: i32,
        name: Option<String>,
    },
    Counter {
        unit: Option<i32>,
        unit_name: Option<String>,
    },
    Custom,
}

/// A track descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Track {
    pub uuid: u64,
    pub name: Option<String>,
    pub parent: Option<u64>,
    pub description: Option<String>,
    pub kind: TrackKind,
}

/// A debug annotation value.
#[derive(Clone, Debug, PartialEq)]
pub enum ArgValue {
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(String),
    Bool(bool),
    Pointer(u64),
    /// Anything else (nested values, proto values), debug-printed.
    Other(String),
}

/// Text as the UI shows it: integers in decimal, pointers in hex.
impl std::fmt::Display for ArgValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArgValue::Int(v) => write!(f, "{v}"),
            ArgValue::Uint(v) => write!(f, "{v}"),
            ArgValue::Double(v) => write!(f, "{v}"),
            ArgValue::Str(v) | ArgValue::Other(v) => f.write_str(v),
            ArgValue::Bool(v) => write!(f, "{v}"),
            ArgValue::Pointer(v) => write!(f, "{v:#x}"),
        }
    }
}

/// A slice (BEGIN..END) on a track.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub track: u64,
    pub ts: u64,
    /// END time; None when never ended.
    pub end: Option<u64>,
    /// Nesting depth on its track (0 = outermost).
    pub depth: usize,
    pub name: String,
    pub category: Option<String>,
    pub args: Vec<(String, ArgValue)>,
    pub flow_ids: Vec<u64>,
    /// From the END event.
    pub terminating_flow_ids: Vec<u64>,
    /// Function names, root first.
    pub callstack: Option<Vec<String>>,
    pub callstack_weight: Option<f64>,
}

impl Slice {
    /// The value of argument `name`.
    pub fn arg(&self, name: &str) -> Option<&ArgValue> {
        self.args.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

/// An instant event.
#[derive(Clone, Debug, PartialEq)]
pub struct Instant {
    pub track: u64,
    pub ts: u64,
    pub name: String,
    pub category: Option<String>,
    pub args: Vec<(String, ArgValue)>,
    pub flow_ids: Vec<u64>,
    /// Function names, root first.
    pub callstack: Option<Vec<String>>,
}

/// A counter value.
#[derive(Clone, Debug, PartialEq)]
pub struct CounterPoint {
    pub track: u64,
    pub ts: u64,
    pub value: f64,
}

/// Which packet a sample came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleSource {
    /// `TracePacket.perf_sample` (66).
    PerfSample,
    /// `TracePacket.stack_sample` (135, schema v58+).
    StackSample,
}

/// A callstack sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackSample {
    pub ts: u64,
    pub cpu: Option<u32>,
    pub pid: i32,
    pub tid: i32,
    /// `StackSample.primary_weight`; for `PerfSample`, the increase of the
    /// CPU's cumulative `timebase_count` since its previous sample.
    /// 0 when the sample has none.
    pub weight: u64,
    /// Function names, root first.
    pub frames: Vec<String>,
    /// Mapping of each frame (path components joined by '/', e.g. "kernel").
    pub mappings: Vec<String>,
    pub source: SampleSource,
}

impl StackSample {
    /// `frame (mapping) > ...`, root first: a stack as a failing test
    /// prints it.
    pub fn describe(&self) -> String {
        self.frames
            .iter()
            .zip(&self.mappings)
            .map(|(f, m)| format!("{f} ({m})"))
            .collect::<Vec<_>>()
            .join(" > ")
    }
}

/// A thread state as the UI shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Running,
    /// R
    Runnable,
    /// R+
    RunnablePreempted,
    /// S
    Sleeping,
    /// D
    Uninterruptible,
    /// I (TASK_IDLE)
    Idle,
    /// X or Z
    Dead,
    /// Any other `prev_state` (T, t, P, combinations), raw.
    Other(i64),
}

impl State {
    /// Decodes a `sched_switch` `prev_state` like the importer, for kernel
    /// `version` (major, minor); without one the importer assumes 4.4.
    pub fn from_prev_state(raw: i64, version: Option<(u32, u32)>) -> State {
        let version = version.unwrap_or((4, 4));
        let preempt_bit = if version >= (4, 14) {
            0x100
        } else if version >= (4, 8) {
            0x1000
        } else {
            0x800
        };
        match raw {
            0 => State::Runnable,
            r if r == preempt_bit => State::RunnablePreempted,
            0x1 => State::Sleeping,
            0x2 => State::Uninterruptible,
            0x80 if version >= (4, 14) => State::Idle,
            0x402 if version < (4, 14) => State::Idle,
            0x10 | 0x20 => State::Dead,
            r => State::Other(r),
        }
    }
}

/// Parses "6.18.0-1-amd64" into (6, 18).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}
