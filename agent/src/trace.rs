//! The trace stage: turns typed events into the Perfetto trace, keeps
//! off-CPU intervals and names, and collects what the summary reports.
//!
//! Mapping to Perfetto (see `shared/design/perfetto-format.md`):
//! - switches and wakings -> per-CPU compact sched bundles (CPU tracks,
//!   thread states, wakeups);
//! - fork/exec/exit/rename -> `task_newtask`, `task_rename`,
//!   `sched_process_free` and process-tree packets (thread lifetimes and
//!   names);
//! - off-CPU intervals with a stack -> callstack samples weighted by the
//!   off-CPU time;
//! - preemptions of traced threads -> an instant "preempted by <task>" on
//!   the thread's track;
//! - drops -> `lost_events` on the CPU's bundle and a counter track;
//! - device-library calls -> slices on the calling thread's track, device
//!   memory counters, rank labels (see [`device`]).

pub mod device;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;

use anyhow::Result;
use rustc_hash::FxHashMap;
use xpuscope_perfetto::{
    self as pf, Arg, ArgValue, CounterUnit, ProcessInfo, ThreadInfo, TraceWriter, TrackUuid,
};

use crate::events::{Comm, Event, Exec, Exit, Fork, Rename, StackCapture, Switch, Waking};
use crate::offcpu::{OffCpuInterval, OffCpuSummary, OffCpuTracker, Preemptor, Stack};
use crate::procfs;
use crate::state::{REPORT_DEAD, REPORT_PREEMPTED, REPORT_ZOMBIE, report_state};
use crate::symbolize::{StackSymbolizer, SymFrame};

const CLONE_THREAD_FLAGS: u64 = 0x0001_0000 | 0x0000_0100 | 0x0000_0800; // THREAD|VM|SIGHAND
const SIGCHLD: u64 = 17;

/// What the trace stage learned, for the summary.
#[derive(Default)]
pub struct TraceStats {
    pub offcpu: OffCpuSummary,
    pub stacks: u64,
    pub stacks_unmatched: u64,
    pub stack_errors: u64,
    pub preemptions: u64,
    pub threads_seen: usize,
    pub first_ts: Option<u64>,
    pub last_ts: u64,
    pub device: device::DeviceStats,
    /// Largest live device-memory allocation sites (at each process's exit
    /// or the end), largest first.
    pub alloc_sites: Vec<device::SiteReport>,
    /// Device-library calls per function, most called first.
    pub device_functions: Vec<device::FunctionCalls>,
}

pub struct TraceBuilder<W: Write> {
    writer: TraceWriter<W>,
    symbolizer: StackSymbolizer,
    offcpu: OffCpuTracker,
    /// tid -> (tgid, latest name) of traced threads.
    threads: FxHashMap<u32, (u32, String)>,
    /// Threads named by the process tree at attach. The importer ranks
    /// process-tree names above scheduler names, so a later rename of such
    /// a thread is also written as a (higher-ranked) thread track name.
    tree_named: HashSet<u32>,
    /// Tree-named threads renamed since: their track carries the name.
    renamed: HashSet<u32>,
    thread_tracks: FxHashMap<u32, TrackUuid>,
    drops_track: Option<TrackUuid>,
    frames: FrameConverter,
    device: device::DeviceTrace,
    pub stats: TraceStats,
}

impl<W: Write> TraceBuilder<W> {
    pub fn new(writer: TraceWriter<W>) -> Self {
        Self {
            writer,
            symbolizer: StackSymbolizer::new(),
            offcpu: OffCpuTracker::default(),
            threads: FxHashMap::default(),
            tree_named: HashSet::new(),
            renamed: HashSet::new(),
            thread_tracks: FxHashMap::default(),
            drops_track: None,
            frames: FrameConverter::default(),
            device: device::DeviceTrace::default(),
            stats: TraceStats::default(),
        }
    }

    pub fn writer(&mut self) -> &mut TraceWriter<W> {
        &mut self.writer
    }

    /// Writes the processes (and their threads) present at attach.
    pub fn initial_processes(&mut self, ts: u64, processes: &[procfs::ProcessEntry]) -> Result<()> {
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
                self.threads.insert(t.tid, (p.pid, t.comm.clone()));
                self.tree_named.insert(t.tid);
            }
        }
        self.writer.process_tree(ts, &procs, &threads)?;
        Ok(())
    }

    pub fn handle(&mut self, event: Event) -> Result<()> {
        let ts = event.ts();
        self.stats.first_ts.get_or_insert(ts);
        self.stats.last_ts = self.stats.last_ts.max(ts);
        match event {
            Event::Switch(s) => self.switch(&s),
            Event::Waking(w) => self.waking(&w),
            Event::Fork(f) => self.fork(&f),
            Event::Exec(e) => self.exec(&e),
            Event::Exit(e) => self.exit(&e),
            Event::Rename(r) => self.rename(&r),
            Event::Stack(s) => self.stack(&s),
            Event::ProbeEntry(e) => self.probe_entry(&e),
            Event::ProbeReturn(r) => self.probe_return(&r),
            Event::ProbeStack(s) => self.probe_stack(&s),
        }
    }

    fn switch(&mut self, s: &Switch) -> Result<()> {
        let state = report_state(s.prev_state, s.preempt);
        self.writer.sched_switch(
            s.cpu,
            s.ts,
            state,
            s.next_tid as i32,
            s.next_prio,
            &s.next_comm.as_str(),
        )?;
        if s.prev_target && s.prev_tid != 0 {
            self.note_thread(s.prev_tid, s.prev_tgid, &s.prev_comm);
            let preemptor = (state == 0 || state == REPORT_PREEMPTED).then_some(Preemptor {
                tid: s.next_tid,
                tgid: s.next_tgid,
                comm: s.next_comm,
            });
            // Preemption by another thread of the traced job is the job's own
            // business (and happens at every wakeup); an outsider taking the
            // CPU is interference worth a marker on the thread's track.
            if let Some(p) = &preemptor {
                self.stats.preemptions += 1;
                if !s.next_target {
                    self.preempted_by_outsider(s, p)?;
                }
            }
            // A dying thread's last switch-out is not a wait: it never returns.
            if state != REPORT_DEAD && state != REPORT_ZOMBIE {
                self.offcpu
                    .switched_out(s.prev_tid, s.prev_tgid, s.cpu, s.ts, state, preemptor);
            }
        }
        if s.next_target && s.next_tid != 0 {
            self.note_thread(s.next_tid, s.next_tgid, &s.next_comm);
            if let Some(interval) = self.offcpu.switched_in(s.next_tid, s.ts) {
                self.interval_done(interval)?;
            }
        }
        Ok(())
    }

    fn note_thread(&mut self, tid: u32, tgid: u32, comm: &Comm) {
        self.threads
            .entry(tid)
            .or_insert_with(|| (tgid, comm.as_str().into_owned()));
    }

    fn thread_track(&mut self, tid: u32) -> Result<TrackUuid> {
        if let Some(t) = self.thread_tracks.get(&tid) {
            return Ok(*t);
        }
        let (tgid, name) = self
            .threads
            .get(&tid)
            .cloned()
            .unwrap_or((tid, String::new()));
        // Track names outrank every other source of thread names in the
        // importer: give one only where it must override the process tree,
        // so scheduler names and renames stay authoritative otherwise.
        let name = if self.renamed.contains(&tid) {
            name
        } else {
            String::new()
        };
        let track = self.writer.thread_track(tgid as i32, tid as i32, &name)?;
        self.thread_tracks.insert(tid, track);
        Ok(track)
    }

    fn preempted_by_outsider(&mut self, s: &Switch, by: &Preemptor) -> Result<()> {
        let track = self.thread_track(s.prev_tid)?;
        let args = [
            Arg::new("by_comm", ArgValue::Str(by.comm.as_str().into_owned())),
            Arg::new("by_tid", ArgValue::Uint(by.tid as u64)),
            Arg::new("by_pid", ArgValue::Uint(by.tgid as u64)),
            Arg::new("cpu", ArgValue::Uint(s.cpu as u64)),
        ];
        self.writer.instant(
            track,
            s.ts,
            &format!("preempted by {}", by.comm.as_str()),
            &args,
            None,
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

    fn fork(&mut self, f: &Fork) -> Result<()> {
        let name = f.child_comm.as_str().into_owned();
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
            &name,
            flags,
            0,
        )?;
        self.threads
            .insert(f.child_tid, (f.child_tgid, name.clone()));
        if !f.is_thread() {
            self.symbolizer.process_forked(f.child_tgid, f.parent_tgid);
            let cmdline = procfs::cmdline(f.child_tgid);
            let p = process_info(f.child_tgid, f.parent_tgid, &cmdline, &name, None);
            // The process entry only: a thread name here would outrank the
            // child's later renames (exec, prctl) in the importer.
            self.writer.process_tree(f.ts, &[p], &[])?;
        }
        Ok(())
    }

    fn exec(&mut self, e: &Exec) -> Result<()> {
        let new = e.comm.as_str().into_owned();
        let old = self
            .threads
            .get(&e.tid)
            .map(|t| t.1.clone())
            .unwrap_or_default();
        self.writer
            .task_rename(e.cpu, e.ts, e.tid as i32, e.tid as i32, &old, &new)?;
        self.threads.insert(e.tid, (e.tgid, new.clone()));
        // A new program: addresses cached for the old one mean nothing now.
        self.symbolizer.forget_process(e.tgid);
        let cmdline = procfs::cmdline(e.tgid);
        let ppid = procfs::stat(e.tgid).map(|s| s.ppid).unwrap_or(0);
        let p = process_info(e.tgid, ppid, &cmdline, &new, None);
        self.writer.process_tree(e.ts, &[p], &[])?;
        self.renamed_thread(e.tid)?;
        Ok(())
    }

    fn exit(&mut self, e: &Exit) -> Result<()> {
        if let Some(interval) = self.offcpu.exited(e.tid, e.ts) {
            self.interval_done(interval)?;
        }
        self.device_exited(e.tgid, e.tid, e.ts)?;
        self.writer.sched_process_free(
            e.cpu,
            e.ts,
            e.tid as i32,
            e.tid as i32,
            &e.comm.as_str(),
            e.prio,
        )?;
        Ok(())
    }

    fn rename(&mut self, r: &Rename) -> Result<()> {
        let new = r.new_comm.as_str().into_owned();
        self.writer.task_rename(
            r.cpu,
            r.ts,
            r.tid as i32,
            r.tid as i32,
            &r.old_comm.as_str(),
            &new,
        )?;
        self.threads.insert(r.tid, (r.tgid, new));
        self.renamed_thread(r.tid)?;
        Ok(())
    }

    /// After a rename of a thread the process tree named: its track is
    /// described with the final name at the end (track names carry no
    /// time, so once is enough however often it is renamed).
    fn renamed_thread(&mut self, tid: u32) -> Result<()> {
        if self.tree_named.contains(&tid) {
            self.renamed.insert(tid);
        }
        Ok(())
    }

    fn stack(&mut self, s: &StackCapture) -> Result<()> {
        self.stats.stacks += 1;
        if s.kernel.is_err() || s.user.is_err() {
            self.stats.stack_errors += 1;
        }
        let kernel = match &s.kernel {
            Ok(addrs) => self.symbolizer.kernel_frames(addrs),
            Err(_) => Vec::new(),
        };
        let user = match &s.user {
            Ok(addrs) => self.symbolizer.user_frames(s.tgid, addrs),
            Err(_) => Vec::new(),
        };
        if !self
            .offcpu
            .stack_taken(s.tid, s.ts, Arc::new(Stack { kernel, user }))
        {
            self.stats.stacks_unmatched += 1;
        }
        Ok(())
    }

    fn interval_done(&mut self, interval: OffCpuInterval) -> Result<()> {
        if let Some(stack) = &interval.stack {
            let frames: Vec<pf::Frame> = stack.leaf_first().map(|f| self.frames.frame(f)).collect();
            if !frames.is_empty() {
                self.writer.stack_sample(
                    interval.start,
                    interval.cpu,
                    interval.tgid as i32,
                    interval.tid as i32,
                    &frames,
                    interval.duration(),
                )?;
            }
        }
        self.stats.offcpu.add(&interval);
        Ok(())
    }

    /// Marks CPUs that lost events and updates the drop counter track.
    pub fn drops(&mut self, ts: u64, cpus_with_new_drops: &[u32], total: u64) -> Result<()> {
        for cpu in cpus_with_new_drops {
            self.writer.mark_lost_events(*cpu);
        }
        let track = match self.drops_track {
            Some(t) => t,
            None => {
                let t = self.writer.counter_track(
                    None,
                    "xpuscope dropped events",
                    CounterUnit::Count,
                )?;
                self.drops_track = Some(t);
                t
            }
        };
        self.writer.counter(track, ts, total as f64)?;
        Ok(())
    }

    /// Ends open intervals at `end` and finishes the file.
    pub fn finish(mut self, end: u64) -> Result<(W, TraceStats, u64)> {
        let mut renamed: Vec<u32> = self.renamed.iter().copied().collect();
        renamed.sort_unstable();
        for tid in renamed {
            let (tgid, name) = self
                .threads
                .get(&tid)
                .cloned()
                .unwrap_or((tid, String::new()));
            self.writer.thread_track(tgid as i32, tid as i32, &name)?;
        }
        for interval in self.offcpu.finish_all(end) {
            self.interval_done(interval)?;
        }
        self.device_finish(end)?;
        self.stats.device = self.device.stats;
        let mut sites = std::mem::take(&mut self.device.site_reports);
        sites.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
        self.stats.alloc_sites = sites;
        let mut functions: Vec<device::FunctionCalls> = self
            .device
            .by_function
            .iter()
            .map(
                |(&(library, function), &(calls, errors))| device::FunctionCalls {
                    library,
                    function,
                    hits: 0,
                    calls,
                    errors,
                },
            )
            .collect();
        functions.sort_by(|a, b| {
            (b.calls, a.library, a.function).cmp(&(a.calls, b.library, b.function))
        });
        self.stats.device_functions = functions;
        self.stats.threads_seen = self.threads.len();
        let bytes = self.writer.bytes_written();
        let out = self.writer.finish()?;
        Ok((out, self.stats, bytes))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Comm, StackCapture};
    use xpuscope_tests::trace_check::{State, Timeline, check_importer_rules, decode};

    fn comm(s: &str) -> Comm {
        Comm::from_str_lossy(s)
    }

    fn switch(
        cpu: u32,
        ts: u64,
        prev: (u32, &str, u32),
        next: (u32, &str, u32),
        flags: (bool, bool, bool),
    ) -> Event {
        Event::Switch(Switch {
            cpu,
            ts,
            prev_tid: prev.0,
            prev_tgid: prev.2,
            prev_comm: comm(prev.1),
            prev_state: if flags.2 { 0 } else { 1 },
            prev_prio: 120,
            next_tid: next.0,
            next_tgid: next.2,
            next_comm: comm(next.1),
            next_prio: 120,
            preempt: flags.2,
            prev_target: flags.0,
            next_target: flags.1,
            stack_follows: false,
        })
    }

    /// Feeds a small, known story through the trace stage and reads it
    /// back with the independent decoder.
    #[test]
    fn events_become_what_the_ui_shows() {
        let mut b = TraceBuilder::new(TraceWriter::new(Vec::new()));
        b.writer()
            .system_info(&xpuscope_perfetto::SystemInfo {
                release: "6.18.0".into(),
                ..Default::default()
            })
            .unwrap();
        let app = procfs::ProcessEntry {
            pid: 100,
            ppid: 1,
            comm: "trainer".into(),
            cmdline: vec!["python3".into(), "train.py".into()],
            uid: Some(0),
            threads: vec![procfs::ThreadEntry {
                tid: 100,
                comm: "trainer".into(),
            }],
        };
        b.initial_processes(1_000, &[app]).unwrap();
        let worker = (101, "worker", 100);
        let main = (100, "trainer", 100);
        let hog = (900, "hog", 900);
        let idle = (0, "swapper/0", 0);
        let events = vec![
            Event::Fork(Fork {
                cpu: 0,
                ts: 2_000,
                parent_tid: 100,
                parent_tgid: 100,
                child_tid: 101,
                child_tgid: 100,
                child_comm: comm("trainer"),
            }),
            Event::Rename(Rename {
                cpu: 0,
                ts: 2_100,
                tid: 101,
                tgid: 100,
                old_comm: comm("trainer"),
                new_comm: comm("worker"),
            }),
            switch(0, 3_000, idle, worker, (false, true, false)),
            // The worker blocks (sleeping) with a stack, for 7 us.
            switch(0, 4_000, worker, main, (true, true, false)),
            Event::Stack(Box::new(StackCapture {
                cpu: 0,
                ts: 4_000,
                tid: 101,
                tgid: 100,
                kernel: Ok(vec![0xffff_ffff_8100_0010]),
                user: Ok(vec![0x1000]),
            })),
            Event::Waking(Waking {
                cpu: 0,
                ts: 10_500,
                tid: 101,
                tgid: 100,
                comm: comm("worker"),
                prio: 120,
                target_cpu: 0,
                waker_tid: 100,
                waker_tgid: 100,
                new_task: false,
            }),
            switch(0, 11_000, main, worker, (true, true, false)),
            // An outsider preempts the worker.
            switch(0, 12_000, worker, hog, (true, false, true)),
            switch(0, 15_000, hog, worker, (false, true, false)),
            Event::Exec(Exec {
                cpu: 0,
                ts: 16_000,
                tid: 100,
                tgid: 100,
                old_tid: 100,
                comm: comm("trainer2"),
            }),
            Event::Exit(Exit {
                cpu: 0,
                ts: 17_000,
                tid: 101,
                tgid: 100,
                prio: 120,
                comm: comm("worker"),
                group_dead: false,
            }),
        ];
        for e in events {
            b.handle(e).unwrap();
        }
        b.drops(18_000, &[1], 5).unwrap();
        let (bytes, stats, _) = b.finish(20_000).unwrap();
        let trace = decode(&bytes).unwrap();
        check_importer_rules(&trace).unwrap();
        let tl = Timeline::new(&trace);

        assert_eq!(tl.thread_name(101).as_deref(), Some("worker"));
        assert_eq!(tl.process_of(101), Some(100));
        assert_eq!(
            tl.thread_name(100).as_deref(),
            Some("trainer2"),
            "exec renames a tree-named thread"
        );
        let states = tl.thread_state_intervals(101);
        assert!(
            states.contains(&(4_000, 10_500, State::Sleeping)),
            "{states:?}"
        );
        assert!(
            states
                .iter()
                .any(|s| s.0 == 12_000 && s.2 == State::RunnablePreempted),
            "{states:?}"
        );
        let woken = tl.wakings.iter().find(|w| w.pid == 101).unwrap();
        assert_eq!(woken.waker_pid, Some(100));
        assert_eq!(tl.stack_samples.len(), 1);
        assert_eq!(
            tl.stack_samples[0].weight, 7_000,
            "weighted by the time off CPU"
        );
        assert_eq!(tl.stack_samples[0].tid, 101);
        let marks = tl.instants_on_thread(101);
        assert!(
            marks.iter().any(|(n, _)| n == "preempted by hog"),
            "{marks:?}"
        );
        assert!(tl.frees.iter().any(|f| f.pid == 101));
        assert_eq!(
            tl.lost_event_cpus.iter().copied().collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(tl.counter_values("xpuscope dropped events"), vec![5.0]);
        assert_eq!(stats.preemptions, 1);
        // worker: 7 us asleep, 3 us preempted; main: off from 11 us to the end.
        assert_eq!(stats.offcpu.total_ns, 7_000 + 3_000 + 9_000);
    }
}
