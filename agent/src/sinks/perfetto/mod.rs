//! The Perfetto sink: renders records as a native Perfetto trace. Render
//! only: every record already carries its meaning, names and symbolized
//! stacks.
//!
//! Mapping (see `docs/src/development/perfetto-format.md`):
//! - switches and wakings -> per-CPU compact sched bundles (CPU tracks,
//!   thread states, wakeups);
//! - new tasks, exec, exit, rename -> `task_newtask`, `task_rename`,
//!   `sched_process_free` and process-tree packets (thread lifetimes and
//!   names);
//! - off-CPU intervals with a stack -> callstack samples weighted by the
//!   off-CPU time;
//! - preemptions by outsiders -> an instant "preempted by <task>" on the
//!   thread's track;
//! - drops -> `lost_events` on the CPU's bundle and a counter track; records
//!   this sink itself lost (it lagged) -> a counter track of their own;
//! - device records -> see [`device`];
//! - GPU health samples and Xid errors -> see [`gpu`].

mod device;
mod findings;
mod gpu;

#[cfg(test)]
pub use crate::trace_schema::names::FINDINGS_TRACK;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustc_hash::FxHashMap;
use xpuscope_perfetto::{
    self as pf, Arg, ArgValue, CounterUnit, ProcessInfo, ThreadInfo, TraceWriter, TrackUuid,
};

use super::{Sink, SinkCounters};
use crate::events::{Exec, Exit, Fork, Rename, Switch, Waking};
use crate::model::{
    Field, FieldValue, OffCpuInterval, Preemption, ProcessStart, Record, Stack, StepSeen, SymFrame,
};
use crate::procfs::ProcessEntry;
use crate::trace_schema::keys as k;
use crate::trace_schema::names as n;

const CLONE_THREAD_FLAGS: u64 = 0x0001_0000 | 0x0000_0100 | 0x0000_0800; // THREAD|VM|SIGHAND
const SIGCHLD: u64 = 17;
const CLOCK_SNAPSHOT_EVERY: Duration = Duration::from_secs(10);

/// What the Perfetto sink hands back.
pub struct Written<W> {
    pub out: W,
    pub bytes: u64,
}

pub struct PerfettoSink<W: Write> {
    writer: TraceWriter<W>,
    /// Threads named by the process tree at attach. The importer ranks
    /// process-tree names above scheduler names, so a later rename of such
    /// a thread is also written as a (higher-ranked) thread track name.
    tree_named: HashSet<u32>,
    /// Tree-named threads renamed since: tid -> (tgid, latest name); their
    /// track carries the name (written at their exit or the end).
    renamed: HashMap<u32, (u32, String)>,
    thread_tracks: FxHashMap<u32, TrackUuid>,
    drops_track: Option<TrackUuid>,
    /// Records this sink lost, as last written.
    lost_written: u64,
    lost_track: Option<TrackUuid>,
    frames: FrameConverter,
    callstacks: CallstackCache,
    device: device::DeviceTracks,
    findings: findings::FindingLanes,
    gpus: gpu::GpuTracks,
    /// Whether to write clock snapshots every [`CLOCK_SNAPSHOT_EVERY`]
    /// (the live recording does; tests leave them out).
    snapshots: Option<Instant>,
}

impl PerfettoSink<BufWriter<File>> {
    /// A sink writing `file`, with the machine's description and a first
    /// clock snapshot.
    pub fn to_file(file: File) -> Result<Self> {
        let out = BufWriter::with_capacity(1 << 20, file);
        Self::with_host_header(TraceWriter::new(out))
    }
}

impl<W: Write> PerfettoSink<W> {
    /// A sink over `writer` that starts with this machine's description and
    /// a clock snapshot (a recording, a flight-recorder dump).
    pub fn with_host_header(writer: TraceWriter<W>) -> Result<Self> {
        let mut sink = Self::new(writer);
        sink.writer.system_info(&crate::host::system_info())?;
        sink.writer.clock_snapshot(&crate::host::clock_snapshot())?;
        sink.snapshots = Some(Instant::now());
        Ok(sink)
    }
}

impl<W: Write> PerfettoSink<W> {
    pub fn new(writer: TraceWriter<W>) -> Self {
        Self {
            writer,
            tree_named: HashSet::new(),
            renamed: HashMap::new(),
            thread_tracks: FxHashMap::default(),
            drops_track: None,
            lost_written: 0,
            lost_track: None,
            frames: FrameConverter::default(),
            callstacks: CallstackCache::default(),
            device: device::DeviceTracks::default(),
            findings: findings::FindingLanes::default(),
            gpus: gpu::GpuTracks::default(),
            snapshots: None,
        }
    }

    #[cfg(test)]
    pub fn writer(&mut self) -> &mut TraceWriter<W> {
        &mut self.writer
    }

    pub fn record(&mut self, r: &Record) -> Result<()> {
        match r {
            Record::InitialProcesses { ts, processes } => self.initial_processes(*ts, processes)?,
            Record::Switch { switch } => self.switch(switch, switch.report_state())?,
            Record::Waking(w) => self.waking(w)?,
            Record::NewTask { fork, process } => self.new_task(fork, process.as_deref())?,
            Record::Exec {
                exec,
                old_name,
                process,
            } => self.exec(exec, old_name, process)?,
            Record::Rename(r) => self.rename(r)?,
            Record::Exit {
                exit,
                process_ended,
            } => {
                self.writer.sched_process_free(
                    exit.cpu,
                    exit.ts,
                    exit.tid as i32,
                    exit.tid as i32,
                    &exit.comm.as_str(),
                    exit.prio,
                )?;
                self.thread_gone(exit.tid)?;
                if *process_ended {
                    self.process_exited(exit)?;
                    self.device.process_ended(exit.tgid, exit.ts);
                    self.gpus.process_ended(exit.tgid);
                }
            }
            Record::Preempted(p) => self.preempted(p)?,
            Record::OffCpu(i) => self.off_cpu(i)?,
            Record::Drops { ts, cpus, total } => self.drops(*ts, cpus, *total)?,
            Record::Identity { tgid, identity } => {
                self.gpus.identity(*tgid, identity);
                self.identity(*tgid, identity)?
            }
            Record::DeviceCall(c) => self.device_call(c)?,
            Record::CallsSummarized(s) => self.calls_summarized(s)?,
            Record::Enqueued(m) => self.enqueued(m)?,
            Record::DeviceWork(w) => self.device_work(w)?,
            Record::MemoryHeld(m) => self.memory_held(m)?,
            Record::InFlightAtEnd(c) => self.in_flight_at_end(c)?,
            Record::Finding(f) => self.finding(f)?,
            // What is still running shows as slices once it returns (or as
            // "in flight at end"); a snapshot adds nothing to draw.
            Record::InFlight(_) => {}
            // Counted in the summary; the calls it let the agent probe
            // early are what the trace shows.
            Record::LinkMapChanged(_) => {}
            Record::StepSeen(s) => self.step_seen(s)?,
            Record::StepSplit(s) => self.step_split(s)?,
            Record::GpuSample(s) => self.gpu_sample(s)?,
            Record::GpuXid(x) => self.gpu_xid(x)?,
        }
        Ok(())
    }

    /// How a process ended, as an instant on its process track: for a
    /// process killed by a signal, and for every process with device
    /// tracks (a rank). `agent diagnose` reads crashes back from it.
    fn process_exited(&mut self, exit: &Exit) -> Result<()> {
        let Some(code) = exit.exit_code else {
            return Ok(());
        };
        let killed_by = exit.killed_by();
        if killed_by.is_none() && !self.device.processes.contains_key(&exit.tgid) {
            return Ok(());
        }
        let track = self.device_process_track(exit.tgid)?;
        let name = match killed_by {
            Some(sig) => format!(
                "{}: killed by {}",
                n::PROCESS_EXIT_EVENT,
                crate::model::sched::signal_name(sig)
            ),
            None => format!("{}: status {}", n::PROCESS_EXIT_EVENT, (code >> 8) & 0xff),
        };
        let mut args = vec![
            k::EXIT_CODE.arg(i64::from(code)),
            k::EXIT_TID.arg(u64::from(exit.tid)),
            k::EXIT_COMM.arg(exit.comm.as_str()),
        ];
        if let Some(sig) = killed_by {
            args.push(k::SIGNAL.arg(i64::from(sig)));
        }
        self.writer.instant(track, exit.ts, &name, &args, None)?;
        Ok(())
    }

    fn initial_processes(&mut self, ts: u64, processes: &[ProcessEntry]) -> Result<()> {
        let mut procs = Vec::new();
        let mut threads = Vec::new();
        for p in processes {
            procs.push(process_info(p.pid, p.ppid, &p.cmdline, &p.comm, p.uid));
            for t in &p.threads {
                threads.push(ThreadInfo {
                    tid: t.tid as i32,
                    tgid: p.pid as i32,
                    name: t.comm.clone(),
                });
                self.tree_named.insert(t.tid);
            }
        }
        self.writer.process_tree(ts, &procs, &threads)?;
        Ok(())
    }

    fn switch(&mut self, s: &Switch, state: i64) -> Result<()> {
        self.writer.sched_switch(
            s.cpu,
            s.ts,
            state,
            s.next_tid as i32,
            s.next_prio.into(),
            &s.next_comm.as_str(),
        )?;
        Ok(())
    }

    fn waking(&mut self, w: &Waking) -> Result<()> {
        let target_cpu = if w.target_cpu == u32::MAX {
            -1
        } else {
            w.target_cpu as i32
        };
        self.writer.sched_waking(
            w.cpu,
            w.ts,
            w.tid as i32,
            target_cpu,
            w.prio,
            &w.comm.as_str(),
        )?;
        Ok(())
    }

    fn new_task(&mut self, f: &Fork, process: Option<&ProcessStart>) -> Result<()> {
        let flags = if f.is_thread() {
            CLONE_THREAD_FLAGS
        } else {
            SIGCHLD
        };
        self.writer.task_newtask(
            f.cpu,
            f.ts,
            f.parent_tid as i32,
            f.child_tid as i32,
            &f.child_comm.as_str(),
            flags,
            0,
        )?;
        if let Some(p) = process {
            // The process entry only: a thread name here would outrank the
            // child's later renames (exec, prctl) in the importer.
            let info = process_info(p.pid, p.ppid, &p.cmdline, &p.name, None);
            self.writer.process_tree(p.ts, &[info], &[])?;
        }
        Ok(())
    }

    fn exec(&mut self, e: &Exec, old: &str, p: &ProcessStart) -> Result<()> {
        self.writer
            .task_rename(e.cpu, e.ts, e.tid as i32, e.tid as i32, old, &p.name)?;
        let info = process_info(p.pid, p.ppid, &p.cmdline, &p.name, None);
        self.writer.process_tree(e.ts, &[info], &[])?;
        self.renamed_thread(e.tid, e.tgid, &p.name);
        Ok(())
    }

    fn rename(&mut self, r: &Rename) -> Result<()> {
        let new = r.new_comm.as_str();
        self.writer.task_rename(
            r.cpu,
            r.ts,
            r.tid as i32,
            r.tid as i32,
            &r.old_comm.as_str(),
            &new,
        )?;
        self.renamed_thread(r.tid, r.tgid, &new);
        Ok(())
    }

    /// After a rename of a thread the process tree named: its track is
    /// described with the final name when it exits or at the end (track
    /// names carry no time, so once is enough however often it is renamed).
    fn renamed_thread(&mut self, tid: u32, tgid: u32, name: &str) {
        if self.tree_named.contains(&tid) {
            self.renamed.insert(tid, (tgid, name.to_string()));
        }
    }

    /// A thread exited: its renamed track name is written now, and what
    /// this sink keeps about it goes (tids are reused).
    fn thread_gone(&mut self, tid: u32) -> Result<()> {
        if let Some((tgid, name)) = self.renamed.remove(&tid) {
            self.writer.thread_track(tgid as i32, tid as i32, &name)?;
        }
        self.tree_named.remove(&tid);
        self.thread_tracks.remove(&tid);
        self.device.thread_ended(tid);
        Ok(())
    }

    fn thread_track(&mut self, tid: u32, tgid: u32) -> Result<TrackUuid> {
        if let Some(t) = self.thread_tracks.get(&tid) {
            return Ok(*t);
        }
        // Track names outrank every other source of thread names in the
        // importer: give one only where it must override the process tree,
        // so scheduler names and renames stay authoritative otherwise.
        let name = self
            .renamed
            .get(&tid)
            .map(|(_, n)| n.clone())
            .unwrap_or_default();
        let track = self.writer.thread_track(tgid as i32, tid as i32, &name)?;
        self.thread_tracks.insert(tid, track);
        Ok(track)
    }

    fn preempted(&mut self, p: &Preemption) -> Result<()> {
        let track = self.thread_track(p.tid, p.tgid)?;
        let by = &p.by;
        let args = [
            k::BY_COMM.arg(by.comm.as_str()),
            k::BY_TID.arg(by.tid as u64),
            k::BY_PID.arg(by.tgid as u64),
            k::CPU.arg(p.cpu as u64),
        ];
        self.writer.instant(
            track,
            p.ts,
            &format!("{}{}", n::PREEMPTED_BY_EVENT, by.comm.as_str()),
            &args,
            None,
        )?;
        Ok(())
    }

    fn step_seen(&mut self, s: &StepSeen) -> Result<()> {
        let track = self.thread_track(s.tid, s.tgid)?;
        let args = [k::STEP.arg(s.step), k::STEP_LOCAL.arg(s.local)];
        self.writer.instant(
            track,
            s.ts,
            &format!("{}{}", n::PYTHON_STEP_EVENT, s.step),
            &args,
            None,
        )?;
        Ok(())
    }

    fn off_cpu(&mut self, interval: &OffCpuInterval) -> Result<()> {
        if let Some(stack) = &interval.stack {
            let callstack = match self.callstacks.get(stack) {
                Some(c) => c,
                None => {
                    let frames: Vec<pf::Frame> =
                        stack.leaf_first().map(|f| self.frames.frame(f)).collect();
                    let c = self.writer.intern_callstack(&frames);
                    self.callstacks.insert(stack, c);
                    c
                }
            };
            if !callstack.is_empty() {
                self.writer.interned_stack_sample(
                    interval.start,
                    interval.cpu.into(),
                    interval.tgid as i32,
                    interval.tid as i32,
                    callstack,
                    interval.duration(),
                )?;
            }
        }
        Ok(())
    }

    /// Marks CPUs that lost events and updates the drop counter track.
    fn drops(&mut self, ts: u64, cpus_with_new_drops: &[u32], total: u64) -> Result<()> {
        for cpu in cpus_with_new_drops {
            self.writer.mark_lost_events(*cpu);
        }
        let track = match self.drops_track {
            Some(t) => t,
            None => {
                let t = self
                    .writer
                    .counter_track(None, n::DROPS_TRACK, CounterUnit::Count)?;
                self.drops_track = Some(t);
                t
            }
        };
        self.writer.counter(track, ts, total as f64)?;
        Ok(())
    }

    /// Records this sink lost while it lagged, on a counter track of their
    /// own (the kernel's drops are on `xpuscope dropped events`).
    fn own_losses(&mut self, ts: u64, lost: &SinkCounters) -> Result<()> {
        let n = lost.dropped();
        if n == self.lost_written {
            return Ok(());
        }
        let track = match self.lost_track {
            Some(t) => t,
            None => {
                let t =
                    self.writer
                        .counter_track(None, n::WRITER_LOSSES_TRACK, CounterUnit::Count)?;
                self.lost_track = Some(t);
                t
            }
        };
        self.writer.counter(track, ts, n as f64)?;
        self.lost_written = n;
        Ok(())
    }

    /// A counter track `name` of losses counted elsewhere (the flight
    /// recorder's own, in a dump): the running total at each (time,
    /// count), starting from 0 at the first. Nothing when there are none.
    pub fn loss_counter(&mut self, name: &str, losses: &[(u64, u64)]) -> Result<()> {
        let Some(&(first, _)) = losses.first() else {
            return Ok(());
        };
        let track = self.writer.counter_track(None, name, CounterUnit::Count)?;
        self.writer.counter(track, first.saturating_sub(1), 0.0)?;
        let mut total = 0u64;
        for &(ts, count) in losses {
            total += count;
            self.writer.counter(track, ts, total as f64)?;
        }
        Ok(())
    }

    fn maybe_snapshot(&mut self) -> Result<()> {
        if let Some(last) = self.snapshots
            && last.elapsed() >= CLOCK_SNAPSHOT_EVERY
        {
            self.writer.clock_snapshot(&crate::host::clock_snapshot())?;
            self.snapshots = Some(Instant::now());
        }
        Ok(())
    }

    /// Writes what waits for the end and finishes the file.
    pub fn finish_trace(mut self, end: u64, lost: &SinkCounters) -> Result<Written<W>> {
        self.own_losses(end, lost)?;
        self.gpus_finish(end)?;
        let mut renamed: Vec<u32> = self.renamed.keys().copied().collect();
        renamed.sort_unstable();
        for tid in renamed {
            if let Some((tgid, name)) = self.renamed.get(&tid) {
                self.writer.thread_track(*tgid as i32, tid as i32, name)?;
            }
        }
        if self.snapshots.is_some() {
            self.writer.clock_snapshot(&crate::host::clock_snapshot())?;
        }
        // The open per-CPU bundles first: the count leaves them out, and
        // they can be most of a short trace.
        self.writer.flush_sched()?;
        let bytes = self.writer.bytes_written();
        let out = self.writer.finish()?;
        Ok(Written { out, bytes })
    }
}

impl<W: Write + Send + 'static> Sink for PerfettoSink<W> {
    type Output = Written<W>;

    fn on_batch(&mut self, batch: &[Record], lost: &SinkCounters) -> Result<()> {
        for r in batch {
            self.record(r)?;
        }
        self.maybe_snapshot()?;
        if lost.dropped() != self.lost_written {
            self.own_losses(crate::host::boottime_ns(), lost)?;
        }
        Ok(())
    }

    fn on_tick(&mut self, _now: u64, _lost: &SinkCounters) -> Result<()> {
        self.maybe_snapshot()
    }

    fn finish(self, end: u64, lost: &SinkCounters) -> Result<Written<W>> {
        self.finish_trace(end, lost).context("finishing the trace")
    }
}

fn process_info(
    pid: u32,
    ppid: u32,
    cmdline: &[String],
    comm: &str,
    uid: Option<u32>,
) -> ProcessInfo {
    ProcessInfo {
        pid: pid as i32,
        ppid: ppid as i32,
        // The importer skips processes without a cmdline: fall back to the comm.
        cmdline: if cmdline.is_empty() {
            vec![comm.to_string()]
        } else {
            cmdline.to_vec()
        },
        uid,
    }
}

/// A record's fields as trace arguments.
fn args(fields: &[Field]) -> Vec<Arg> {
    fields
        .iter()
        .map(|f| {
            Arg::new(
                f.name.clone(),
                match &f.value {
                    FieldValue::Uint(v) => ArgValue::Uint(*v),
                    FieldValue::Double(v) => ArgValue::Double(*v),
                    FieldValue::Str(v) => ArgValue::Str(v.clone()),
                    FieldValue::Bool(v) => ArgValue::Bool(*v),
                },
            )
        })
        .collect()
}

/// The callstack ids of stacks this sink wrote, by the stack's `Arc`: the
/// interpret stage hands a thread that blocks where it blocked before the
/// same `Arc` (its stack memo), and its samples then cost no conversion.
/// The `Arc` is held, so its address cannot be reused by another stack
/// while it keys an entry. Bounded; the writer's interning stays valid
/// past a clear (the same frames intern to the same id).
#[derive(Default)]
struct CallstackCache {
    by_stack: FxHashMap<usize, (Arc<Stack>, pf::InternedCallstack)>,
}

/// Most stacks [`CallstackCache`] holds before it starts over.
const CACHED_CALLSTACKS: usize = 16_384;

impl CallstackCache {
    fn get(&self, stack: &Arc<Stack>) -> Option<pf::InternedCallstack> {
        self.by_stack
            .get(&(Arc::as_ptr(stack) as usize))
            .map(|(_, c)| *c)
    }

    fn insert(&mut self, stack: &Arc<Stack>, callstack: pf::InternedCallstack) {
        if self.by_stack.len() >= CACHED_CALLSTACKS {
            self.by_stack.clear();
        }
        self.by_stack
            .insert(Arc::as_ptr(stack) as usize, (stack.clone(), callstack));
    }
}

/// Converts symbolized frames, sharing one `Mapping` per module.
#[derive(Default)]
struct FrameConverter {
    mappings: HashMap<(Arc<str>, u64), Arc<pf::Mapping>>,
}

impl FrameConverter {
    fn frame(&mut self, f: &SymFrame) -> pf::Frame {
        if f.is_kernel() {
            return pf::Frame::kernel(f.function.to_string(), f.rel_pc);
        }
        let mapping = self
            .mappings
            .entry((f.module.clone(), f.module_start))
            .or_insert_with(|| {
                Arc::new(pf::Mapping {
                    path: f.module.to_string(),
                    build_id: None,
                    start: f.module_start,
                    end: f.module_end,
                    start_offset: f.module_offset,
                    load_bias: 0,
                })
            })
            .clone();
        pf::Frame::new(f.function.to_string(), mapping, f.rel_pc)
    }
}
