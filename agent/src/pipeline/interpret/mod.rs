//! Interpretation: the collect stage's raw events -> [`Record`]s with
//! meaning. Scheduler records become switches with report states,
//! off-CPU intervals (with the stack taken as the thread left and who
//! preempted it), preemptions by outsiders and process lifetimes;
//! device-library records become decoded calls, device work and memory
//! (see [`device`]). What needs the live system (symbols, names, command
//! lines) is asked of an [`Enrich`] at the moment a record needs it.
//!
//! State is per thread and per process and dropped at exit, so a long
//! recording stays bounded and a reused pid starts clean.

pub mod device;
mod stack_memo;

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::analysis::jobs::JobLabels;
use crate::analysis::offcpu::OffCpuTracker;
use crate::events::{Comm, Event, Exec, Exit, Fork, Rename, StackCapture, Switch, UserCopy};
use crate::kernel::probes::TableUpdate;
use crate::model::{
    InFlightSnapshot, MainThreadNow, OpenCall, Preemption, Preemptor, ProcessStart, Record, Stack,
    StepSeen, SymFrame, ThreadNow,
};
use crate::pipeline::enrich::Enrich;
use crate::pipeline::enrich::python::PyOutcome;
use crate::pipeline::enrich::stack_ends::UnwoundCopy;
use crate::procfs::ProcessEntry;
use crate::state::{REPORT_DEAD, REPORT_PREEMPTED, REPORT_ZOMBIE, report_state};
use device::DeviceInterpreter;
use stack_memo::{StackKey, StackMemo};
use xpuscope_common::USER_STACK_NOT_WALKED;
use xpuscope_probes::decode::table::ProbeTarget;
use xpuscope_probes::python::StepLocal;

pub use crate::model::counters::InterpretCounters;

/// A user stack's addresses, leaf first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UserAddrs {
    pub addrs: Vec<u64>,
    /// The CFI unwind stopped before the outermost frame (the stack is
    /// deeper than the kernel's copy): the root end is missing.
    pub truncated: bool,
}

/// A user stack's addresses: the CFI unwind of the stack copy where there
/// is one, else the frame-pointer walk taken with it. The walk wins only
/// where it agrees with the unwind and reaches further (code with frame
/// pointers whose stack outgrew the copy); in code without frame pointers
/// it stops early or goes astray, and the unwind is right.
pub(crate) fn user_addrs(
    en: &mut dyn Enrich,
    (tgid, tid): (u32, u32),
    ts: u64,
    frame_pointer: &Result<Vec<u64>, i32>,
    copy: Option<&UserCopy>,
    c: &mut InterpretCounters,
) -> Result<UserAddrs, i32> {
    let walk = |fp: &Vec<u64>| UserAddrs {
        addrs: fp.clone(),
        truncated: false,
    };
    let Some(cfi) = copy.and_then(|copy| en.unwind_user(tgid, ts, copy)) else {
        return frame_pointer.as_ref().map(walk).map_err(|e| *e);
    };
    if let Some(copy) = copy
        && let Ok(bytes) = &copy.stack
    {
        en.stack_unwound(UnwoundCopy {
            tid,
            sp: copy.sp,
            copied: bytes.len(),
            used: cfi.stack_bytes_used,
            truncated: cfi.truncated,
        });
    }
    if let Ok(fp) = frame_pointer
        && fp.len() > cfi.frames.len()
        && fp.starts_with(&cfi.frames)
    {
        return Ok(walk(fp));
    }
    c.user_stacks_cfi += 1;
    if *frame_pointer == Err(USER_STACK_NOT_WALKED) {
        c.user_stacks_short_copies += 1;
    }
    if copy.is_some_and(|c| c.restored_returns > 0) {
        c.user_stacks_past_uretprobes += 1;
    }
    if cfi.truncated {
        c.user_stacks_truncated += 1;
    }
    Ok(UserAddrs {
        addrs: cfi.frames,
        truncated: cfi.truncated,
    })
}

/// The frame a truncated user stack ends with (at its root end), so a
/// flamegraph says the callers are missing rather than showing a partial
/// stack as whole.
pub(crate) fn with_truncation(mut frames: Vec<SymFrame>, truncated: bool) -> Vec<SymFrame> {
    if truncated {
        frames.push(SymFrame {
            function: Arc::from("[truncated: stack deeper than the kernel's copy]"),
            module: Arc::from("[unwind]"),
            module_start: 0,
            module_end: 0,
            module_offset: 0,
            rel_pc: 0,
        });
    }
    frames
}

/// A traced thread alive.
struct ThreadEntry {
    /// Its latest name (what an exec renames it from).
    name: String,
    /// Its switches were seen: its state is known (at the service's level
    /// 0 no switch comes).
    switched: bool,
}

/// About how many records `events` make: one each, and an off-CPU
/// interval more for each traced thread switching in (the most common
/// second record; a probed call's entry makes none).
pub fn records_expected(events: &[Event]) -> usize {
    events.len()
        + events
            .iter()
            .filter(|e| matches!(e, Event::Switch(s) if s.next_target))
            .count()
}

/// Raw events in, records out.
#[derive(Default)]
pub struct Interpreter {
    /// Traced threads alive, by tid: one lookup per side of a switch
    /// (switches are most of the records).
    threads: FxHashMap<u32, ThreadEntry>,
    offcpu: OffCpuTracker,
    device: DeviceInterpreter,
    /// The last in-flight snapshot had calls (one more, empty, says they
    /// all returned).
    in_flight_shown: bool,
    /// The last Python step counter value seen per process.
    steps_seen: FxHashMap<u32, u64>,
    /// Symbolized stacks by their addresses.
    stack_memo: StackMemo,
    /// The job of each traced process that has a label: a preemptor of
    /// another job is interference, traced or not.
    jobs: JobLabels,

    pub counters: InterpretCounters,
}

impl Interpreter {
    /// Device calls past `rate` per second per (process, function) are
    /// summarized (0: never).
    pub fn with_device_call_rate(rate: u32) -> Self {
        Self {
            device: DeviceInterpreter::with_call_rate(rate),
            ..Self::default()
        }
    }

    /// The processes (and their threads) present at attach.
    pub fn initial_processes(
        &mut self,
        ts: u64,
        processes: Vec<ProcessEntry>,
        out: &mut Vec<Record>,
    ) {
        for p in &processes {
            for t in &p.threads {
                self.note_thread(t.tid, &t.comm);
            }
        }
        out.push(Record::InitialProcesses { ts, processes });
    }

    /// Device probes of a process about to be attached.
    pub fn probes_added(
        &mut self,
        update: TableUpdate,
        en: &mut dyn Enrich,
        out: &mut Vec<Record>,
    ) {
        let from = out.len();
        self.device.probes_added(update, en, out);
        self.learn_jobs(&out[from..]);
    }

    /// The job labels of the identities among `records` (just made).
    fn learn_jobs(&mut self, records: &[Record]) {
        for r in records {
            if let Record::Identity { tgid, identity } = r {
                self.jobs.identified(*tgid, identity.job.as_deref());
            }
        }
    }

    /// Probes attached by file ahead of any process mapping them.
    pub fn slots_added(&mut self, slots: Vec<(u32, ProbeTarget)>) {
        self.device.slots_added(slots);
    }

    pub fn drops(&mut self, ts: u64, cpus: Vec<u32>, total: u64, out: &mut Vec<Record>) {
        out.push(Record::Drops { ts, cpus, total });
    }

    pub fn event(&mut self, event: Event, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        match event {
            Event::Switch(s) => self.switch(s, out),
            Event::Waking(w) => out.push(Record::Waking(w)),
            Event::Fork(f) => self.fork(f, en, out),
            Event::Exec(e) => self.exec(e, en, out),
            Event::Exit(e) => self.exit(e, en, out),
            Event::Rename(r) => self.rename(r, out),
            Event::Stack(s) => self.stack(&s, en, out),
            Event::ProbeEntry(e) => {
                let from = out.len();
                self.device.entry(&e, en, &mut self.counters, out);
                self.learn_jobs(&out[from..]);
            }
            Event::ProbeReturn(r) => {
                let from = out.len();
                self.device.ret(&r, en, &mut self.counters, out);
                self.learn_jobs(&out[from..]);
            }
            Event::ProbeStack(s) => self.device.call_stack(&s, en, &mut self.counters),
            Event::LinkMap(l) => {
                en.link_map_changed(l.tgid);
                self.stack_memo.forget_process(l.tgid);
                out.push(Record::LinkMapChanged(l));
            }
        }
    }

    /// The blocking calls running at `now`, each with what its thread is
    /// doing (called about once a second): sent while there are any, and
    /// once more, empty, when the last returned.
    pub fn in_flight(&mut self, now: u64, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        let open = self.device.open_blocking();
        if open.is_empty() && !self.in_flight_shown {
            return;
        }
        let open_any = !open.is_empty();
        self.in_flight_shown = !open.is_empty();
        let thread_now = |tid: u32| match self.offcpu.off_since(tid) {
            Some((state, since)) => ThreadNow::Off { state, since },
            None if self.threads.get(&tid).is_some_and(|t| t.switched) => ThreadNow::OnCpu,
            None => ThreadNow::Unknown,
        };
        let calls = open
            .into_iter()
            .map(|c| OpenCall {
                tgid: c.tgid,
                tid: c.tid,
                library: c.library,
                function: c.function,
                kind: c.kind,
                start_ts: c.start_ts,
                comm: c.context,
                peer: c.peer,
                thread: thread_now(c.tid),
            })
            .collect();
        let mut main_threads: Vec<MainThreadNow> = if open_any {
            self.device
                .identified()
                .map(|tgid| {
                    let thread = thread_now(tgid);
                    // Off CPU without a stack sampled at its switch-out:
                    // a Python thread's frames can still be read now.
                    let stack = self.offcpu.stack_of(tgid).or_else(|| {
                        matches!(thread, ThreadNow::Off { .. })
                            .then(|| en.python_frames_now(tgid, tgid))
                            .flatten()
                            .map(|user| {
                                Arc::new(Stack {
                                    kernel: Vec::new(),
                                    user,
                                })
                            })
                    });
                    MainThreadNow {
                        tgid,
                        thread,
                        stack,
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        main_threads.sort_by_key(|m| m.tgid);
        out.push(Record::InFlight(Box::new(InFlightSnapshot {
            ts: now,
            calls,
            main_threads,
        })));
    }

    /// Ends what is still open at `end`: off-CPU intervals, calls in
    /// flight, memory held, buffered device work.
    pub fn finish(&mut self, end: u64, out: &mut Vec<Record>) {
        for interval in self.offcpu.finish_all(end) {
            out.push(Record::OffCpu(interval));
        }
        self.device.finish(end, &mut self.counters, out);
    }

    fn note_thread(&mut self, tid: u32, name: &str) {
        if let Some(t) = self.threads.get_mut(&tid) {
            t.name.clear();
            t.name.push_str(name);
        } else {
            self.counters.threads_seen += 1;
            self.threads.insert(
                tid,
                ThreadEntry {
                    name: name.to_string(),
                    switched: false,
                },
            );
        }
    }

    /// A traced thread switched (in or out): known from now on, with the
    /// name it switched with if it was not known yet.
    fn note_switched(&mut self, tid: u32, comm: &Comm) {
        match self.threads.entry(tid) {
            std::collections::hash_map::Entry::Occupied(mut t) => t.get_mut().switched = true,
            std::collections::hash_map::Entry::Vacant(v) => {
                self.counters.threads_seen += 1;
                v.insert(ThreadEntry {
                    name: comm.as_str().into_owned(),
                    switched: true,
                });
            }
        }
    }

    fn switch(&mut self, s: Switch, out: &mut Vec<Record>) {
        let state = report_state(s.prev_state, s.preempt);
        out.push(Record::Switch { switch: s });
        if s.prev_target && s.prev_tid != 0 {
            self.note_switched(s.prev_tid, &s.prev_comm);
            let preemptor = (state == 0 || state == REPORT_PREEMPTED).then(|| Preemptor {
                tid: s.next_tid,
                tgid: s.next_tgid,
                comm: s.next_comm,
                in_job: s.next_target && !self.jobs.different(s.prev_tgid, s.next_tgid),
            });
            // Preemption by another thread of the traced job is the job's own
            // business (and happens at every wakeup); an outsider taking the
            // CPU (another job's too) is interference worth a marker on the
            // thread's track.
            if let Some(p) = &preemptor
                && !p.in_job
            {
                out.push(Record::Preempted(Preemption {
                    ts: s.ts,
                    cpu: s.cpu,
                    tid: s.prev_tid,
                    tgid: s.prev_tgid,
                    by: p.clone(),
                }));
            }
            // A dying thread's last switch-out is not a wait: it never returns.
            if state != REPORT_DEAD && state != REPORT_ZOMBIE {
                self.offcpu
                    .switched_out(s.prev_tid, s.prev_tgid, s.cpu, s.ts, state, preemptor);
            }
        }
        if s.next_target && s.next_tid != 0 {
            self.note_switched(s.next_tid, &s.next_comm);
            if let Some(interval) = self.offcpu.switched_in(s.next_tid, s.ts) {
                out.push(Record::OffCpu(interval));
            }
        }
    }

    fn fork(&mut self, f: Fork, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        let name = f.child_comm.as_str().into_owned();
        self.note_thread(f.child_tid, &name);
        let process = (!f.is_thread()).then(|| {
            en.process_forked(f.child_tgid, f.parent_tgid);
            self.jobs.forked(f.child_tgid, f.parent_tgid);
            Box::new(ProcessStart {
                ts: f.ts,
                pid: f.child_tgid,
                ppid: f.parent_tgid,
                cmdline: en.cmdline(f.child_tgid),
                name,
            })
        });
        out.push(Record::NewTask { fork: f, process });
    }

    fn exec(&mut self, e: Exec, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        let new = e.comm.as_str().into_owned();
        let old_name = self
            .threads
            .get(&e.tid)
            .map(|t| t.name.clone())
            .unwrap_or_default();
        self.note_thread(e.tid, &new);
        // A new program: addresses cached for the old one mean nothing now.
        en.process_exec(e.tgid);
        self.stack_memo.forget_process(e.tgid);
        self.device.process_exec(e.tgid);
        let process = Box::new(ProcessStart {
            ts: e.ts,
            pid: e.tgid,
            ppid: en.ppid(e.tgid),
            cmdline: en.cmdline(e.tgid),
            name: new,
        });
        out.push(Record::Exec {
            exec: e,
            old_name,
            process,
        });
    }

    fn exit(&mut self, e: Exit, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        let process_ended = e.ends_process();
        if let Some(interval) = self.offcpu.exited(e.tid, e.ts) {
            out.push(Record::OffCpu(interval));
        }
        self.device
            .exited(&e, process_ended, en, &mut self.counters, out);
        self.threads.remove(&e.tid);
        en.thread_exited(e.tid);
        if process_ended {
            // Every earlier record of the process is out: what is cached
            // about it goes (its pid may come back as another process).
            en.process_ended(e.tgid);
            self.stack_memo.forget_process(e.tgid);
            self.steps_seen.remove(&e.tgid);
            self.jobs.ended(e.tgid);
        }
        out.push(Record::Exit {
            exit: e,
            process_ended,
        });
    }

    fn rename(&mut self, r: Rename, out: &mut Vec<Record>) {
        self.note_thread(r.tid, &r.new_comm.as_str());
        out.push(Record::Rename(r));
    }

    fn stack(&mut self, s: &StackCapture, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        self.counters.stacks += 1;
        self.counters.stack_record_bytes += u64::from(s.record_bytes);
        // A frame-pointer walk the kernel skipped (the copy held the whole
        // stack) is no error.
        if s.kernel.is_err() || s.user.as_ref().is_err_and(|e| *e != USER_STACK_NOT_WALKED) {
            self.counters.stack_errors += 1;
        }
        let user = user_addrs(
            en,
            (s.tgid, s.tid),
            s.ts,
            &s.user,
            s.user_copy.as_ref(),
            &mut self.counters,
        );
        // A stack seen before (same process, same addresses) is the same
        // stack: symbolized once (see `stack_memo`).
        let key = match (&s.kernel, &user) {
            (Ok(kernel), Ok(u)) => Some(StackKey {
                tgid: s.tgid,
                kernel,
                user: &u.addrs,
                truncated: u.truncated,
            }),
            _ => None,
        };
        let known = key.as_ref().and_then(|k| self.stack_memo.get(k));
        let stack = match known {
            Some(stack) => stack,
            None => {
                let kernel = match &s.kernel {
                    Ok(addrs) => en.kernel_frames(addrs),
                    Err(_) => Vec::new(),
                };
                let mut memoizable = true;
                let user_frames = match &user {
                    Ok(u) => {
                        let (frames, py) = en.thread_user_frames(s.tgid, s.tid, &u.addrs);
                        memoizable = py == PyOutcome::Native;
                        match py {
                            PyOutcome::Mixed(step) => {
                                self.counters.python_stacks += 1;
                                if let Some(step) = step {
                                    let read_at = en.clock_ns();
                                    self.step_seen(s, step, read_at, out);
                                }
                            }
                            PyOutcome::Failed => self.counters.python_stack_errors += 1,
                            PyOutcome::Native | PyOutcome::NoPythonNow => {}
                        }
                        self.counters.python_read_ns = en.python_read_ns();
                        with_truncation(frames, u.truncated)
                    }
                    Err(_) => Vec::new(),
                };
                let stack = Arc::new(Stack {
                    kernel,
                    user: user_frames,
                });
                if let Some(k) = &key
                    && memoizable
                {
                    self.stack_memo.insert(k, stack.clone());
                }
                stack
            }
        };
        self.counters.stacks_memoized = self.stack_memo.hits;
        if !self.offcpu.stack_taken(s.tid, s.ts, stack) {
            self.counters.stacks_unmatched += 1;
        }
    }

    /// A rank's Python step counter, passed on when it changes. Dated when
    /// it was read, not when the stack was taken: the pipeline enriches a
    /// stack milliseconds after its switch-out (and more while it catches
    /// up), and a thread that ran on meanwhile shows the step it is in at
    /// the read. Only the main thread's counts (a training loop runs
    /// there; a data loader's `step` is its own business).
    fn step_seen(
        &mut self,
        s: &StackCapture,
        step: StepLocal,
        read_at: u64,
        out: &mut Vec<Record>,
    ) {
        if s.tid != s.tgid || self.steps_seen.insert(s.tgid, step.value) == Some(step.value) {
            return;
        }
        out.push(Record::StepSeen(StepSeen {
            tgid: s.tgid,
            tid: s.tid,
            ts: read_at,
            local: step.name,
            step: step.value,
        }));
    }

    /// Decoder output straight into the device interpretation (tests).
    #[cfg(test)]
    pub fn device_emit(
        &mut self,
        decoded: &mut Vec<xpuscope_probes::decode::Decoded>,
        en: &mut dyn Enrich,
        out: &mut Vec<Record>,
    ) {
        let from = out.len();
        self.device.emit(decoded, en, &mut self.counters, out);
        self.learn_jobs(&out[from..]);
    }

    /// Threads alive that interpretation keeps state for (tests).
    #[cfg(test)]
    pub fn threads_alive(&self) -> usize {
        self.threads.len()
    }
}

#[cfg(test)]
mod step_seen_tests {
    use super::*;
    use crate::pipeline::enrich::fake::FakeEnricher;

    fn stack(ts: u64, tid: u32, tgid: u32) -> Event {
        Event::Stack(Box::new(StackCapture {
            cpu: 0,
            ts,
            tid,
            tgid,
            kernel: Ok(vec![0xffff_ffff_8100_0010]),
            user: Ok(vec![0x1000]),
            user_copy: None,
            record_bytes: 0,
        }))
    }

    fn seen(out: &[Record]) -> Vec<(u32, u64, u64)> {
        out.iter()
            .filter_map(|r| match r {
                Record::StepSeen(s) => Some((s.tgid, s.ts, s.step)),
                _ => None,
            })
            .collect()
    }

    /// The main thread's counter, once per new value, dated by the read;
    /// another thread's `step` (a data loader's) is not the job's; a pid
    /// used again starts over.
    #[test]
    fn a_new_step_on_the_main_thread_is_passed_on_once_dated_by_its_read() {
        let mut i = Interpreter::default();
        let mut en = FakeEnricher::default();
        let mut out = Vec::new();
        let at = |value| StepLocal {
            name: "step",
            value,
        };
        for (ts, tid, value, read) in [
            (1_000, 100, 7, 5_000),
            (2_000, 100, 7, 6_000),
            (3_000, 101, 99, 7_000),
            (4_000, 100, 8, 9_000),
        ] {
            en.python_steps.insert(tid, at(value));
            en.now = read;
            i.event(stack(ts, tid, 100), &mut en, &mut out);
        }
        assert_eq!(seen(&out), vec![(100, 5_000, 7), (100, 9_000, 8)]);
        // The same addresses each time, but Python frames read from the
        // live thread: never taken from the stack memo.
        assert_eq!(i.counters.stacks_memoized, 0);
        out.clear();
        i.event(
            Event::Exit(Exit {
                cpu: 0,
                ts: 10_000,
                tid: 100,
                tgid: 100,
                prio: 120,
                comm: Comm::from_str_lossy("python3"),
                group_dead: true,
                group_known: true,
                exit_code: Some(0),
            }),
            &mut en,
            &mut out,
        );
        en.now = 12_000;
        i.event(stack(11_000, 100, 100), &mut en, &mut out);
        assert_eq!(seen(&out), vec![(100, 12_000, 8)], "a new process");
    }
}

#[cfg(test)]
mod user_stack_tests {
    use super::*;
    use crate::pipeline::enrich::fake::FakeEnricher;

    fn copy(ip: u64, words: &[u64]) -> UserCopy {
        UserCopy {
            ip,
            sp: 0x7000,
            bp: 0,
            stack: Ok(words.iter().flat_map(|w| w.to_le_bytes()).collect()),
            restored_returns: 0,
        }
    }

    #[test]
    fn the_cfi_unwind_wins_unless_the_frame_pointer_walk_extends_it() {
        let mut en = FakeEnricher::default();
        let mut c = InterpretCounters::default();
        // Without frame pointers the walk stops at the libc wrapper; the
        // unwind (the fake's: ip, then the copy's words) has the callers.
        let got = user_addrs(
            &mut en,
            (1, 1),
            0,
            &Ok(vec![0x10]),
            Some(&copy(0x10, &[0x20, 0x30, 0])),
            &mut c,
        );
        assert_eq!(got.unwrap().addrs, vec![0x10, 0x20, 0x30]);
        assert_eq!(c.user_stacks_cfi, 1);
        // The walk agrees and goes further (the copy ended first): the walk.
        let got = user_addrs(
            &mut en,
            (1, 1),
            0,
            &Ok(vec![0x10, 0x20, 0x30, 0x40]),
            Some(&copy(0x10, &[0x20])),
            &mut c,
        );
        assert_eq!(
            got,
            Ok(UserAddrs {
                addrs: vec![0x10, 0x20, 0x30, 0x40],
                truncated: false
            })
        );
        assert_eq!(c.user_stacks_cfi, 1);
        assert_eq!(c.user_stacks_truncated, 0);
        // A longer walk that disagrees (garbage in rbp) loses.
        let got = user_addrs(
            &mut en,
            (1, 1),
            0,
            &Ok(vec![0x10, 0x99, 0x98, 0x97]),
            Some(&copy(0x10, &[0x20])),
            &mut c,
        );
        // ... and the unwind that ran out of copy says so.
        assert_eq!(
            got,
            Ok(UserAddrs {
                addrs: vec![0x10, 0x20],
                truncated: true
            })
        );
        assert_eq!(c.user_stacks_truncated, 1);
        let frames = with_truncation(Vec::new(), true);
        assert!(frames[0].function.starts_with("[truncated"));
        assert!(with_truncation(Vec::new(), false).is_empty());
        // Nothing copied: the walk, or its error, stays.
        let mut failed = copy(0x10, &[]);
        failed.stack = Err(-14);
        let got = user_addrs(&mut en, (1, 1), 0, &Err(-14), Some(&failed), &mut c);
        assert_eq!(got, Err(-14));
        let got = user_addrs(&mut en, (1, 1), 0, &Ok(vec![0x10]), None, &mut c);
        assert_eq!(got.unwrap().addrs, vec![0x10]);
    }
}

#[cfg(test)]
mod records_expected_tests {
    use super::*;
    use crate::events::Waking;
    use crate::pipeline::enrich::fake::FakeEnricher;

    fn switch(ts: u64, prev: (u32, bool), next: (u32, bool)) -> Event {
        Event::Switch(Switch {
            cpu: 0,
            ts,
            prev_tid: prev.0,
            prev_tgid: prev.0,
            prev_comm: Comm::from_str_lossy("a"),
            prev_state: 1,
            prev_prio: 120,
            next_tid: next.0,
            next_tgid: next.0,
            next_comm: Comm::from_str_lossy("b"),
            next_prio: 120,
            preempt: false,
            prev_target: prev.1,
            next_target: next.1,
            stack_follows: false,
        })
    }

    fn waking(ts: u64, tid: u32) -> Event {
        Event::Waking(Waking {
            cpu: 0,
            ts,
            tid,
            tgid: tid,
            target_cpu: 0,
            prio: 120,
            waker_tid: 0,
            waker_tgid: 0,
            comm: Comm::from_str_lossy("b"),
            new_task: false,
        })
    }

    /// Two traced threads taking turns, with an outsider between: every
    /// record the batch makes fits the room reserved for it (the vector
    /// never grows, so no record is copied twice and the flight recorder
    /// keeps no unused half).
    #[test]
    fn a_scheduling_batch_fits_the_room_expected_for_it() {
        let (a, b, outsider) = ((100, true), (101, true), (900, false));
        let mut events = Vec::new();
        let mut ts = 1_000;
        for _ in 0..50 {
            events.push(waking(ts, b.0));
            events.push(switch(ts + 10, a, b));
            events.push(waking(ts + 20, a.0));
            events.push(switch(ts + 30, b, outsider));
            events.push(switch(ts + 40, outsider, a));
            ts += 100;
        }
        let room = records_expected(&events);
        let mut out = Vec::with_capacity(room);
        let mut i = Interpreter::default();
        let mut en = FakeEnricher::default();
        for e in events {
            i.event(e, &mut en, &mut out);
        }
        let off_cpu = out
            .iter()
            .filter(|r| matches!(r, Record::OffCpu(_)))
            .count();
        // Every switch-in of a traced thread that left its CPU earlier in
        // the batch ends an off-CPU interval: all of a's, all of b's but
        // its first.
        assert_eq!(off_cpu, 50 + 49);
        assert!(out.len() <= room, "{} records, room for {room}", out.len());
        assert_eq!(out.capacity(), room, "the vector did not grow");
    }
}
