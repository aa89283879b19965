//! What the flight recorder needs to know about each record: the time it
//! covers, its cost in memory, its owner process, and what it changes in
//! the state a window needs to be rendered on its own (processes, threads,
//! names, rank identities) once the records before that window are gone.

use std::collections::BTreeMap;
use std::mem::size_of;
use std::sync::Arc;

use crate::model::{
    DeviceCallRecord, DeviceWork, Field, FieldValue, ProcessStart, RankIdentity, Record, Site,
    Stack, SymFrame,
};
use crate::procfs::{ProcessEntry, ThreadEntry};

/// The time a record covers, CLOCK_BOOTTIME ns (`start <= end`), or None
/// for records that carry state and no time (rank identities).
pub fn span(r: &Record) -> Option<(u64, u64)> {
    let at = |t: u64| Some((t, t));
    match r {
        Record::InitialProcesses { ts, .. } => at(*ts),
        Record::Switch { switch, .. } => at(switch.ts),
        Record::Waking(w) => at(w.ts),
        Record::NewTask { fork, .. } => at(fork.ts),
        Record::Exec { exec, .. } => at(exec.ts),
        Record::Rename(r) => at(r.ts),
        Record::Exit { exit, .. } => at(exit.ts),
        Record::Preempted(p) => at(p.ts),
        Record::OffCpu(i) => Some((i.start, i.end.max(i.start))),
        Record::Identity { .. } => None,
        Record::DeviceCall(c) => Some((c.call.start_ts, c.end_ts())),
        Record::CallsSummarized(s) => Some((s.start, s.end.max(s.start))),
        Record::Enqueued(m) => at(m.ts),
        Record::DeviceWork(w) => Some((w.start, w.end.max(w.start))),
        Record::MemoryHeld(m) => at(m.ts),
        Record::InFlightAtEnd(c) => Some((c.start_ts, c.end.max(c.start_ts))),
        Record::Drops { ts, .. } => at(*ts),
        Record::InFlight(s) => at(s.ts),
        Record::Finding(f) => Some((f.start_ns.min(f.detected_ns), f.detected_ns)),
        Record::LinkMapChanged(l) => at(l.ts),
        Record::StepSeen(s) => at(s.ts),
        Record::StepSplit(s) => Some((s.start, s.end.max(s.start))),
        Record::GpuSample(s) => at(s.ts),
        Record::GpuXid(x) => at(x.ts),
    }
}

/// The process a record belongs to, where it belongs to exactly one
/// (scheduler records of a CPU, drops and the process table do not).
pub fn owner(r: &Record) -> Option<u32> {
    match r {
        Record::NewTask { fork, .. } => Some(fork.child_tgid),
        Record::Exec { exec, .. } => Some(exec.tgid),
        Record::Rename(r) => Some(r.tgid),
        Record::Exit { exit, .. } => Some(exit.tgid),
        Record::Preempted(p) => Some(p.tgid),
        Record::OffCpu(i) => Some(i.tgid),
        Record::Identity { tgid, .. } => Some(*tgid),
        Record::DeviceCall(c) => Some(c.call.tgid),
        Record::CallsSummarized(s) => Some(s.tgid),
        Record::Enqueued(m) => Some(m.tgid),
        Record::DeviceWork(w) => Some(w.track.tgid),
        Record::MemoryHeld(m) => Some(m.tgid),
        Record::InFlightAtEnd(c) => Some(c.tgid),
        Record::LinkMapChanged(l) => Some(l.tgid),
        Record::StepSeen(s) => Some(s.tgid),
        Record::StepSplit(s) => Some(s.tgid),
        Record::InitialProcesses { .. }
        | Record::Switch { .. }
        | Record::Waking(_)
        | Record::Drops { .. }
        | Record::InFlight(_)
        // A GPU's, shared by whatever runs on it.
        | Record::GpuSample(_)
        | Record::GpuXid(_)
        | Record::Finding(_) => None,
    }
}

/// What an allocation of `n` bytes costs the allocator (glibc): a
/// header of 8 bytes, rounded up to 16, at least 32. Measured in the soak,
/// counting payloads alone put the recorder's estimate at half its real
/// heap (records own many small strings and boxes).
pub fn alloc(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (n + 8).next_multiple_of(16).max(32)
    }
}

fn string_bytes(s: &str) -> usize {
    alloc(s.len())
}

// A `Vec` (not a slice): its capacity is what it holds.
#[allow(clippy::ptr_arg)]
fn strings_bytes(v: &Vec<String>) -> usize {
    alloc(v.capacity() * size_of::<String>()) + v.iter().map(|s| alloc(s.capacity())).sum::<usize>()
}

fn frames_bytes(v: &[SymFrame]) -> usize {
    // Function and module names are `Arc<str>` shared through the
    // symbolizer's caches: only the frames themselves are counted.
    alloc(std::mem::size_of_val(v))
}

/// This record's share of a shared allocation (an `Arc` held by several
/// records counts once in total).
fn share<T>(a: &Arc<T>, payload: usize) -> usize {
    // The Arc's two counts come with its value.
    (alloc(16 + size_of::<T>()) + payload) / Arc::strong_count(a).max(1)
}

fn stack_bytes(s: &Arc<Stack>) -> usize {
    share(s, frames_bytes(&s.kernel) + frames_bytes(&s.user))
}

fn site_bytes(s: &Arc<Site>) -> usize {
    share(s, frames_bytes(&s.frames) + string_bytes(&s.label))
}

fn fields_bytes(v: &[Field]) -> usize {
    alloc(std::mem::size_of_val(v))
        + v.iter()
            .map(|f| {
                alloc(f.name.capacity())
                    + match &f.value {
                        FieldValue::Str(s) => alloc(s.capacity()),
                        _ => 0,
                    }
            })
            .sum::<usize>()
}

fn process_bytes(p: &ProcessEntry) -> usize {
    size_of::<ProcessEntry>()
        + alloc(p.comm.capacity())
        + strings_bytes(&p.cmdline)
        + alloc(p.threads.capacity() * size_of::<ThreadEntry>())
        + p.threads
            .iter()
            .map(|t| alloc(t.comm.capacity()))
            .sum::<usize>()
}

fn process_start_bytes(p: &ProcessStart) -> usize {
    alloc(size_of::<ProcessStart>()) + alloc(p.name.capacity()) + strings_bytes(&p.cmdline)
}

fn identity_bytes(id: &RankIdentity) -> usize {
    alloc(size_of::<RankIdentity>())
        + [&id.rank, &id.local_rank, &id.world_size, &id.job]
            .iter()
            .map(|s| s.as_ref().map_or(0, |s| alloc(s.capacity())))
            .sum::<usize>()
}

/// Heap bytes a record owns beyond its own `size_of::<Record>()` slot, as
/// the allocator counts them (boxes included).
pub fn heap_bytes(r: &Record) -> usize {
    match r {
        Record::InitialProcesses { processes, .. } => {
            alloc(processes.capacity() * size_of::<ProcessEntry>())
                + processes.iter().map(process_bytes).sum::<usize>()
        }
        Record::NewTask { process, .. } => process.as_deref().map_or(0, process_start_bytes),
        Record::Exec {
            old_name, process, ..
        } => alloc(old_name.capacity()) + process_start_bytes(process),
        Record::OffCpu(i) => i.stack.as_ref().map_or(0, stack_bytes),
        Record::Identity { identity, .. } => identity_bytes(identity),
        Record::DeviceCall(c) => {
            alloc(size_of::<DeviceCallRecord>())
                + alloc(c.call.name.capacity())
                + match &c.call.args {
                    xpuscope_probes::decode::args::CallArgs::Marker {
                        message: Some(m), ..
                    } => alloc(m.capacity()),
                    xpuscope_probes::decode::args::CallArgs::CommInit(init) => {
                        alloc(init.comms.capacity() * 8)
                    }
                    _ => 0,
                }
                + c.site.as_ref().map_or(0, site_bytes)
                + alloc(c.flows.capacity() * 8)
                + c.oom.as_ref().map_or(0, |rows| {
                    alloc(rows.capacity() * size_of::<crate::model::LiveSiteRow>())
                        + rows
                            .iter()
                            .filter_map(|r| r.site.as_ref())
                            .map(site_bytes)
                            .sum::<usize>()
                })
        }
        Record::CallsSummarized(s) => {
            alloc(s.functions.capacity() * size_of::<(&'static str, &'static str, u64)>())
        }
        Record::DeviceWork(w) => {
            alloc(size_of::<DeviceWork>())
                + alloc(w.track.name.capacity())
                + alloc(w.name.capacity())
                + fields_bytes(&w.fields)
                + alloc(w.flows.capacity() * 8)
        }
        Record::MemoryHeld(m) => {
            alloc(m.rows.capacity() * size_of::<crate::model::LiveSiteRow>())
                + m.rows
                    .iter()
                    .filter_map(|r| r.site.as_ref())
                    .map(site_bytes)
                    .sum::<usize>()
        }
        Record::Drops { cpus, .. } => alloc(cpus.capacity() * 4),
        Record::InFlight(s) => {
            alloc(size_of::<crate::model::InFlightSnapshot>())
                + alloc(s.calls.capacity() * size_of::<crate::model::OpenCall>())
        }
        Record::StepSplit(_) => alloc(size_of::<crate::model::StepSplitRecord>()),
        Record::GpuSample(s) => {
            alloc(size_of::<crate::model::gpu::GpuSample>())
                + alloc(s.name.capacity())
                + alloc(s.uuid.capacity())
                + alloc(s.pids.capacity() * 4)
        }
        Record::GpuXid(x) => alloc(x.pids.capacity() * 4),
        Record::Finding(f) => {
            alloc(size_of::<crate::model::Finding>())
                + alloc(f.summary.capacity())
                + f.comm.as_ref().map_or(0, |c| alloc(c.capacity()))
                + alloc(f.ranks.capacity() * 4)
                // The evidence's own allocations, about as large as its text.
                + f.evidence.to_string().len()
        }
        Record::Switch { .. }
        | Record::Waking(_)
        | Record::Rename(_)
        | Record::Exit { .. }
        | Record::Preempted(_)
        | Record::Enqueued(_)
        | Record::InFlightAtEnd(_)
        | Record::LinkMapChanged(_)
        | Record::StepSeen(_) => 0,
    }
}

/// What the recorder keeps about a batch, from one pass over it when it
/// comes: its records are then read again only when one of them changes
/// the process table (see [`changes_table`]) or the window's edge falls
/// inside it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSummary {
    /// The latest end of its records' spans (None: none has a time).
    pub end: Option<u64>,
    /// Bytes it holds in memory: its vector's slots (used or not) and what
    /// each record owns.
    pub bytes: u64,
    /// Whether any of its records changes the process table.
    pub changes_table: bool,
}

impl BatchSummary {
    pub fn of(batch: &[Record], capacity: usize) -> Self {
        let mut end: Option<u64> = None;
        let mut heap = 0;
        let mut changes = false;
        for r in batch {
            if let Some((_, e)) = span(r) {
                end = Some(end.map_or(e, |m| m.max(e)));
            }
            heap += heap_bytes(r);
            changes |= changes_table(r);
        }
        BatchSummary {
            end,
            bytes: (alloc(capacity.max(batch.len()) * size_of::<Record>())
                + heap
                + alloc(16 + size_of::<Vec<Record>>())) as u64,
            changes_table: changes,
        }
    }
}

/// Whether [`ProcessTable::apply`] acts on `r` (and the recorder's job
/// labels on its leaving): the process and thread lifecycle and rank
/// identities. Every kind is named, so a new one needs a decision here.
pub fn changes_table(r: &Record) -> bool {
    match r {
        Record::InitialProcesses { .. }
        | Record::NewTask { .. }
        | Record::Exec { .. }
        | Record::Rename(_)
        | Record::Exit { .. }
        | Record::Identity { .. } => true,
        Record::Switch { .. }
        | Record::Waking(_)
        | Record::Preempted(_)
        | Record::OffCpu(_)
        | Record::DeviceCall(_)
        | Record::CallsSummarized(_)
        | Record::Enqueued(_)
        | Record::DeviceWork(_)
        | Record::MemoryHeld(_)
        | Record::InFlightAtEnd(_)
        | Record::Drops { .. }
        | Record::InFlight(_)
        | Record::Finding(_)
        | Record::LinkMapChanged(_)
        | Record::StepSeen(_)
        | Record::StepSplit(_)
        | Record::GpuSample(_)
        | Record::GpuXid(_) => false,
    }
}

/// The processes, threads, names and rank identities as of some point in
/// the stream: what a window starting there needs to render its tracks.
#[derive(Clone, Debug, Default)]
pub struct ProcessTable {
    pub processes: BTreeMap<u32, ProcessEntry>,
    pub identities: BTreeMap<u32, RankIdentity>,
}

impl ProcessTable {
    /// Applies one record's effect on the table.
    pub fn apply(&mut self, r: &Record) {
        match r {
            Record::InitialProcesses { processes, .. } => {
                for p in processes {
                    self.processes.insert(p.pid, p.clone());
                }
            }
            Record::NewTask { fork, process } => {
                let comm = fork.child_comm.as_str().into_owned();
                match process {
                    Some(p) if !fork.is_thread() => {
                        self.processes.insert(
                            p.pid,
                            ProcessEntry {
                                pid: p.pid,
                                ppid: p.ppid,
                                comm: p.name.clone(),
                                cmdline: p.cmdline.clone(),
                                uid: None,
                                threads: vec![ThreadEntry {
                                    tid: fork.child_tid,
                                    comm,
                                }],
                            },
                        );
                    }
                    _ => {
                        if let Some(p) = self.processes.get_mut(&fork.child_tgid) {
                            p.threads.retain(|t| t.tid != fork.child_tid);
                            p.threads.push(ThreadEntry {
                                tid: fork.child_tid,
                                comm,
                            });
                        }
                    }
                }
            }
            Record::Exec { exec, process, .. } => {
                let entry = self
                    .processes
                    .entry(exec.tgid)
                    .or_insert_with(|| ProcessEntry {
                        pid: process.pid,
                        ppid: process.ppid,
                        comm: String::new(),
                        cmdline: Vec::new(),
                        uid: None,
                        threads: Vec::new(),
                    });
                entry.comm = process.name.clone();
                entry.cmdline = process.cmdline.clone();
                // exec leaves one thread, the exec'ing one, as the leader.
                entry.threads = vec![ThreadEntry {
                    tid: exec.tid,
                    comm: process.name.clone(),
                }];
            }
            Record::Rename(r) => {
                if let Some(t) = self
                    .processes
                    .get_mut(&r.tgid)
                    .and_then(|p| p.threads.iter_mut().find(|t| t.tid == r.tid))
                {
                    t.comm = r.new_comm.as_str().into_owned();
                }
            }
            Record::Exit {
                exit,
                process_ended,
            } => {
                if *process_ended {
                    self.processes.remove(&exit.tgid);
                    self.identities.remove(&exit.tgid);
                } else if let Some(p) = self.processes.get_mut(&exit.tgid) {
                    p.threads.retain(|t| t.tid != exit.tid);
                }
            }
            Record::Identity { tgid, identity } => {
                self.identities.insert(*tgid, (**identity).clone());
            }
            // The kinds `changes_table` says no to.
            _ => {}
        }
    }

    /// The records that put a renderer in this state at `ts`.
    pub fn as_records(&self, ts: u64) -> Vec<Record> {
        let mut out = vec![Record::InitialProcesses {
            ts,
            processes: self.processes.values().cloned().collect(),
        }];
        out.extend(
            self.identities
                .iter()
                .map(|(tgid, identity)| Record::Identity {
                    tgid: *tgid,
                    identity: Box::new(identity.clone()),
                }),
        );
        out
    }
}
