//! The decoded record stream: what the interpret stage makes of the kernel's
//! raw events, enriched with names, identities and symbolized stacks, and
//! what every sink consumes. Plain data: no Perfetto types, no byte
//! layouts, no reads of `/proc`.
//!
//! A sink sees every record of a process before that process's
//! [`Record::Exit`] with `process_ended`, so it may drop what it keeps about
//! the process there (pids are reused).

pub mod counters;
pub mod device;
pub mod finding;
pub mod gpu;
pub mod identity;
pub mod sched;
pub mod stack;
pub mod step;

use std::sync::Arc;

pub use device::{
    CallSummary, CommKey, DeviceCallRecord, DeviceWork, EnqueueMarker, InFlightCall,
    InFlightSnapshot, LiveSiteRow, MainThreadNow, MemoryHeld, OpenCall, StreamTrack, ThreadNow,
    WorkKind, comm_key, process_comm_id,
};
pub use finding::{Finding, FindingKind};
pub use identity::RankIdentity;
pub use stack::{Site, Stack, SymFrame, site_label};
pub use step::{StepSplit, StepSplitRecord};

use crate::procfs::ProcessEntry;
use sched::{Comm, Exec, Exit, Fork, LinkMap, Rename, Switch, Waking};

/// A named value attached to a record (rendered as a trace argument, a
/// metric label, a finding's evidence).
#[derive(Clone, Debug, PartialEq)]
pub struct Field {
    pub name: String,
    pub value: FieldValue,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FieldValue {
    Uint(u64),
    Double(f64),
    Str(String),
    Bool(bool),
}

impl Field {
    pub fn new(name: impl Into<String>, value: FieldValue) -> Self {
        Self {
            name: name.into(),
            value,
        }
    }
}

/// A rank's step counter as its Python frames showed it, when it first
/// showed a new value: the training loop's `step` (or `global_step`, ...;
/// `xpuscope_probes::python::STEP_LOCALS`) read off its main thread's
/// frames at `ts` (as an off-CPU stack was enriched: `ts` is the read's
/// time, a little after the stack's, which is what the value is true at).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSeen {
    pub tgid: u32,
    pub tid: u32,
    pub ts: u64,
    /// The local's name.
    pub local: &'static str,
    pub step: u64,
}

/// Who took the CPU from a thread that was still runnable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preemptor {
    pub tid: u32,
    pub tgid: u32,
    pub comm: Comm,
    /// A thread of the traced job itself (not interference from outside).
    pub in_job: bool,
}

/// A traced thread preempted by a task outside the traced job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preemption {
    pub ts: u64,
    pub cpu: u32,
    pub tid: u32,
    pub tgid: u32,
    pub by: Preemptor,
}

/// A finished off-CPU interval of a traced thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpuInterval {
    pub tid: u32,
    pub tgid: u32,
    /// u16 (CPUs are numbered below 65536; see `offcpu::cpu_of`) keeps
    /// the interval, a third of the records, within a record's 80 bytes.
    pub cpu: u16,
    pub start: u64,
    pub end: u64,
    /// Report-format state at switch-out (see `state`).
    pub state: i64,
    /// The stack taken as it left, when the sampling policy took one.
    pub stack: Option<Arc<Stack>>,
    pub preempted_by: Option<Preemptor>,
    /// The trace ended before the thread ran again.
    pub truncated: bool,
}

impl OffCpuInterval {
    pub fn duration(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }
}

/// A process that came to be: forked from a traced one, or exec'd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessStart {
    pub ts: u64,
    pub pid: u32,
    pub ppid: u32,
    pub name: String,
    /// argv, read from `/proc` when the record was enriched (empty when the
    /// process had gone).
    pub cmdline: Vec<String>,
}

/// One decoded, enriched record.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// The processes and threads present when the recording started.
    InitialProcesses {
        ts: u64,
        processes: Vec<ProcessEntry>,
    },
    /// A context switch (its report-format state: `Switch::report_state`).
    Switch {
        switch: Switch,
    },
    Waking(Waking),
    /// A thread or process was created (`process` for a new process).
    NewTask {
        fork: Fork,
        process: Option<Box<ProcessStart>>,
    },
    /// A thread exec'd a new program (`old_name`: its name before).
    Exec {
        exec: Exec,
        old_name: String,
        process: Box<ProcessStart>,
    },
    Rename(Rename),
    /// A thread exited; `process_ended`: the last of its process.
    Exit {
        exit: Exit,
        process_ended: bool,
    },
    /// A traced thread preempted by a task outside the job.
    Preempted(Preemption),
    /// A traced thread's time off CPU, ended.
    OffCpu(OffCpuInterval),
    /// A process's rank identity (from its environment).
    Identity {
        tgid: u32,
        identity: Box<RankIdentity>,
    },
    /// A device-library call (possibly without its return). Boxed: it is
    /// 400 bytes, and every record of a batch is as large as the largest
    /// variant (see `a_record_is_80_bytes`).
    DeviceCall(Box<DeviceCallRecord>),
    /// Calls past the flood rate, counted over a window.
    CallsSummarized(CallSummary),
    /// A host thread enqueued device work (an API record with no probed
    /// call around it): the flow to the work starts here.
    Enqueued(EnqueueMarker),
    /// Device work on a device stream (activity records or estimated).
    DeviceWork(Box<DeviceWork>),
    /// Device memory a process holds, by allocation site.
    MemoryHeld(MemoryHeld),
    /// A call still running when the recording ended.
    InFlightAtEnd(InFlightCall),
    /// A traced process's dynamic loader changed its link map (start-up,
    /// `dlopen`, `dlclose`): the supervisor has rescanned its maps.
    LinkMapChanged(LinkMap),
    /// A rank's Python step counter showed a new value.
    StepSeen(StepSeen),
    /// Events were lost on these CPUs; `total` lost so far.
    Drops {
        ts: u64,
        cpus: Vec<u32>,
        total: u64,
    },
    /// The blocking calls running now (about once a second while any run).
    InFlight(Box<InFlightSnapshot>),
    /// A detector's conclusion (fed back into the stream by the pipeline,
    /// so every sink sees it in order: the trace renders it, metrics count
    /// it, the flight recorder dumps on it).
    Finding(Box<Finding>),
    /// A rank's finished step and where its main thread spent it (fed
    /// back by the detect sink like a finding).
    StepSplit(Box<StepSplitRecord>),
    /// One GPU's health readings (the health sampler's, about once a
    /// second per GPU).
    GpuSample(Box<gpu::GpuSample>),
    /// An Xid error a GPU raised.
    GpuXid(gpu::GpuXid),
}

impl Record {
    /// Number of kinds ([`Record::kind_index`] is below it).
    pub const KINDS: usize = 24;
    /// The kinds' short names, by [`Record::kind_index`].
    pub const KIND_NAMES: [&'static str; Record::KINDS] = [
        "initial_processes",
        "switch",
        "waking",
        "new_task",
        "exec",
        "rename",
        "exit",
        "preempted",
        "off_cpu",
        "identity",
        "device_call",
        "calls_summarized",
        "enqueued",
        "device_work",
        "memory_held",
        "in_flight_at_end",
        "drops",
        "in_flight",
        "finding",
        "link_map_changed",
        "step_seen",
        "step_split",
        "gpu_sample",
        "gpu_xid",
    ];

    /// A dense index per kind (counting per kind without a map lookup).
    pub fn kind_index(&self) -> usize {
        match self {
            Record::InitialProcesses { .. } => 0,
            Record::Switch { .. } => 1,
            Record::Waking(_) => 2,
            Record::NewTask { .. } => 3,
            Record::Exec { .. } => 4,
            Record::Rename(_) => 5,
            Record::Exit { .. } => 6,
            Record::Preempted(_) => 7,
            Record::OffCpu(_) => 8,
            Record::Identity { .. } => 9,
            Record::DeviceCall(_) => 10,
            Record::CallsSummarized(_) => 11,
            Record::Enqueued(_) => 12,
            Record::DeviceWork(_) => 13,
            Record::MemoryHeld(_) => 14,
            Record::InFlightAtEnd(_) => 15,
            Record::Drops { .. } => 16,
            Record::InFlight(_) => 17,
            Record::Finding(_) => 18,
            Record::LinkMapChanged(_) => 19,
            Record::StepSeen(_) => 20,
            Record::StepSplit(_) => 21,
            Record::GpuSample(_) => 22,
            Record::GpuXid(_) => 23,
        }
    }

    /// A short name per kind (the counting test sink's keys).
    #[cfg(test)]
    pub fn kind(&self) -> &'static str {
        Self::KIND_NAMES[self.kind_index()]
    }
}

#[cfg(test)]
mod size_tests {
    use super::*;

    /// Every record of a batch takes the largest variant's size, in every
    /// stage and for its whole stay in the flight recorder (bounded in
    /// bytes). The rare, large ones are boxed so a switch does not carry a
    /// device call's 400 bytes (a 4x larger record doubled the agent's CPU
    /// per event in a system-wide recording); switches and off-CPU
    /// intervals, two thirds of the records, are 72 bytes so that a record
    /// is 80. A variant grown past that makes every record larger: box it,
    /// or make room.
    #[test]
    fn a_record_is_80_bytes() {
        assert_eq!(size_of::<Switch>(), 72);
        assert_eq!(size_of::<OffCpuInterval>(), 72);
        assert_eq!(size_of::<Record>(), 80);
    }
}
