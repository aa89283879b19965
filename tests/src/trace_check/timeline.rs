//! [`Timeline`]: what a user of the Perfetto UI would see in a trace,
//! reconstructed the way the importer does (prev task from the previous
//! switch, wakers from the running task, thread names by priority, slices
//! from BEGIN/END pairs, interned callstacks root first).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use perfetto_protos::trace::Trace;

use super::extract::{self, Extracted};
use super::ftrace::{RawSwitch, SchedRecord};
use super::records::{
    CounterPoint, Instant, LostEvents, NewTask, ProcessEntry, ProcessFree, Rename, SampleSource,
    Slice, StackSample, State, Switch, ThreadEntry, Track, TrackKind, UNKNOWN_PID, Waking,
    kernel_version,
};

/// What a user would see in one machine's part of a trace.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// `utsname.release` of the last SystemInfo.
    pub kernel_release: Option<String>,
    /// Sorted by time (stable: file order at equal times).
    pub switches: Vec<Switch>,
    pub wakings: Vec<Waking>,
    pub new_tasks: Vec<NewTask>,
    pub renames: Vec<Rename>,
    pub frees: Vec<ProcessFree>,
    pub lost_events: Vec<LostEvents>,
    /// CPUs with at least one `lost_events` bundle.
    pub lost_event_cpus: BTreeSet<u32>,
    pub processes: BTreeMap<i32, ProcessEntry>,
    pub threads: BTreeMap<i32, ThreadEntry>,
    pub tracks: BTreeMap<u64, Track>,
    /// Sorted by (track, ts).
    pub slices: Vec<Slice>,
    pub instants: Vec<Instant>,
    pub counters: Vec<CounterPoint>,
    pub stack_samples: Vec<StackSample>,
    /// Latest scheduler timestamp: open thread states end here.
    pub end_ts: u64,
}

impl Timeline {
    /// The timeline of all packets (for single-machine traces).
    pub fn new(trace: &Trace) -> Timeline {
        Self::build(&extract::extract(trace), None)
    }

    /// The timeline of the packets with `machine_id` (0 = none set).
    pub fn for_machine(trace: &Trace, machine_id: u32) -> Timeline {
        Self::build(&extract::extract(trace), Some(machine_id))
    }

    fn build(x: &Extracted, machine: Option<u32>) -> Timeline {
        let mine = |m: &u32| machine.is_none_or(|want| *m == want);
        let mut t = Timeline {
            kernel_release: x
                .system_infos
                .iter()
                .filter(|(m, ..)| mine(m))
                .filter_map(|(_, _, r)| r.clone())
                .next_back(),
            ..Timeline::default()
        };
        t.lost_events = x
            .bundles
            .iter()
            .filter(|(m, _, _, lost, _)| mine(m) && *lost)
            .map(|&(_, _, cpu, _, first_ts)| LostEvents { cpu, first_ts })
            .collect();
        t.lost_event_cpus = t.lost_events.iter().map(|l| l.cpu).collect();
        t.sched(x, &mine);
        t.names(x, &mine);
        t.track_events(x, machine);
        t.samples(x, &mine);
        t
    }

    fn sched(&mut self, x: &Extracted, mine: &dyn Fn(&u32) -> bool) {
        let mut records: Vec<&SchedRecord> = x
            .sched
            .iter()
            .filter(|(m, _)| mine(m))
            .map(|(_, r)| r)
            .collect();
        // Stable: at equal times keep tokenizer order (switches first).
        records.sort_by_key(|r| r.ts());
        let mut running: HashMap<u32, i32> = HashMap::new();
        for r in records {
            self.end_ts = self.end_ts.max(r.ts());
            match r {
                SchedRecord::Switch(RawSwitch {
                    cpu,
                    ts,
                    prev_pid,
                    prev_state,
                    next_pid,
                    next_comm,
                    next_prio,
                }) => {
                    let prev = prev_pid.or_else(|| running.get(cpu).copied());
                    running.insert(*cpu, *next_pid);
                    self.switches.push(Switch {
                        cpu: *cpu,
                        ts: *ts,
                        prev_pid: prev.unwrap_or(UNKNOWN_PID),
                        prev_state: *prev_state,
                        next_pid: *next_pid,
                        next_comm: next_comm.clone(),
                        next_prio: *next_prio,
                    });
                }
                SchedRecord::Waking(w) => {
                    let mut w = w.clone();
                    w.waker_pid = running.get(&w.cpu).copied();
                    self.wakings.push(w);
                }
                SchedRecord::NewTask(n) => self.new_tasks.push(n.clone()),
                SchedRecord::Rename(r) => self.renames.push(r.clone()),
                SchedRecord::Free(f) => self.frees.push(f.clone()),
            }
        }
    }

    fn names(&mut self, x: &Extracted, mine: &dyn Fn(&u32) -> bool) {
        let mut updates: Vec<extract::NameUpdate> = x
            .names
            .iter()
            .filter(|(m, _)| mine(m))
            .map(|(_, u)| u.clone())
            .collect();
        for (_, _, p) in x.processes.iter().filter(|(m, ..)| mine(m)) {
            self.processes.insert(p.pid, p.clone());
            self.threads.entry(p.pid).or_insert_with(|| ThreadEntry {
                tid: p.pid,
                tgid: Some(p.pid),
                name: None,
            });
        }
        let ftrace = |tid: i32, tgid: Option<i32>, ts: u64, name: &str| extract::NameUpdate {
            tid,
            tgid,
            priority: 1,
            ts,
            name: name.to_owned(),
        };
        for s in &self.switches {
            updates.push(ftrace(s.next_pid, None, s.ts, &s.next_comm));
        }
        for w in &self.wakings {
            updates.push(ftrace(w.pid, None, w.ts, &w.comm));
        }
        for r in &self.renames {
            updates.push(ftrace(r.pid, None, r.ts, &r.new_comm));
        }
        for n in &self.new_tasks {
            let parent_tgid = self
                .threads
                .get(&n.firing_pid)
                .and_then(|t| t.tgid)
                .unwrap_or(n.firing_pid);
            let tgid = if n.clone_flags & 0x10000 != 0 {
                parent_tgid
            } else {
                self.processes.entry(n.pid).or_insert_with(|| ProcessEntry {
                    pid: n.pid,
                    ppid: Some(parent_tgid),
                    name: Some(n.comm.clone()),
                    ..ProcessEntry::default()
                });
                n.pid
            };
            updates.push(ftrace(n.pid, Some(tgid), n.ts, &n.comm));
        }
        for (_, _, track) in x.tracks.iter().filter(|(m, ..)| mine(m)) {
            match &track.kind {
                TrackKind::Thread { pid, tid, name } => updates.push(extract::NameUpdate {
                    tid: *tid,
                    tgid: Some(*pid),
                    priority: 4,
                    ts: 0,
                    name: name.clone().unwrap_or_default(),
                }),
                TrackKind::Process { pid, name, labels } => {
                    let p = self.processes.entry(*pid).or_insert_with(|| ProcessEntry {
                        pid: *pid,
                        ..ProcessEntry::default()
                    });
                    if name.is_some() {
                        p.name = name.clone();
                    }
                    p.labels = labels.clone();
                }
                _ => {}
            }
        }
        // task_newtask starts a new thread (the importer's new utid): what
        // was said about an earlier thread with the same tid no longer
        // applies, except track descriptors, which carry no time.
        let mut born: HashMap<i32, u64> = HashMap::new();
        for n in &self.new_tasks {
            let b = born.entry(n.pid).or_insert(n.ts);
            *b = (*b).max(n.ts);
        }
        updates.retain(|u| u.priority == 4 || born.get(&u.tid).is_none_or(|&b| u.ts >= b));
        // Highest priority wins, then the latest; stable for file order.
        updates.sort_by_key(|u| (u.priority, u.ts));
        for u in updates {
            let e = self.threads.entry(u.tid).or_insert_with(|| ThreadEntry {
                tid: u.tid,
                ..ThreadEntry::default()
            });
            if u.tgid.is_some() {
                e.tgid = u.tgid;
            }
            if !u.name.is_empty() {
                e.name = Some(u.name);
            }
        }
    }

    fn track_events(&mut self, x: &Extracted, machine: Option<u32>) {
        let mine = |m: &u32| machine.is_none_or(|want| *m == want);
        for (_, _, track) in x.tracks.iter().filter(|(m, ..)| mine(m)) {
            self.tracks.insert(track.uuid, track.clone());
        }
        let mut events: Vec<&extract::RawTrackEvent> = x
            .track_events
            .iter()
            .filter(|(m, _)| mine(m))
            .map(|(_, e)| e)
            .collect();
        events.sort_by_key(|e| e.ts);
        let names = |f: &Option<Vec<super::ResolvedFrame>>| {
            f.as_ref()
                .map(|fr| fr.iter().map(|f| f.function.clone()).collect())
        };
        let mut open: HashMap<u64, Vec<usize>> = HashMap::new();
        for e in events {
            let Some(track) = e.track else { continue };
            match e.kind {
                1 => {
                    let stack = open.entry(track).or_default();
                    stack.push(self.slices.len());
                    self.slices.push(Slice {
                        track,
                        ts: e.ts,
                        end: None,
                        depth: stack.len() - 1,
                        name: e.name.clone().unwrap_or_default(),
                        category: e.category.clone(),
                        args: e.args.clone(),
                        flow_ids: e.flow_ids.clone(),
                        terminating_flow_ids: Vec::new(),
                        callstack: names(&e.callstack),
                        callstack_weight: e.callstack_weight,
                    });
                }
                2 => {
                    if let Some(i) = open.get_mut(&track).and_then(Vec::pop) {
                        let s = &mut self.slices[i];
                        s.end = Some(e.ts);
                        s.terminating_flow_ids = e.terminating_flow_ids.clone();
                    }
                }
                3 => self.instants.push(Instant {
                    track,
                    ts: e.ts,
                    name: e.name.clone().unwrap_or_default(),
                    category: e.category.clone(),
                    args: e.args.clone(),
                    flow_ids: e.flow_ids.clone(),
                    callstack: names(&e.callstack),
                }),
                _ => {}
            }
        }
        self.slices.sort_by_key(|s| (s.track, s.ts));
        self.counters = extract::counter_points(&x.track_events, machine);
    }

    fn samples(&mut self, x: &Extracted, mine: &dyn Fn(&u32) -> bool) {
        let mut samples: Vec<StackSample> = x
            .samples
            .iter()
            .filter(|(m, _)| mine(m))
            .map(|(_, s)| s.clone())
            .collect();
        samples.sort_by_key(|s| s.ts);
        // PerfSample.timebase_count is cumulative per CPU: weight = increase.
        let mut last: HashMap<Option<u32>, u64> = HashMap::new();
        for s in samples
            .iter_mut()
            .filter(|s| s.source == SampleSource::PerfSample)
        {
            let prev = last.insert(s.cpu, s.weight).unwrap_or(0);
            s.weight = s.weight.saturating_sub(prev);
        }
        self.stack_samples = samples;
    }

    /// Name of thread `tid`, if known.
    pub fn thread_name(&self, tid: i32) -> Option<String> {
        self.threads.get(&tid).and_then(|t| t.name.clone())
    }

    /// Process (tgid) of thread `tid`, if known.
    pub fn process_of(&self, tid: i32) -> Option<i32> {
        self.threads.get(&tid).and_then(|t| t.tgid)
    }

    /// The first track named `name`.
    pub fn track_named(&self, name: &str) -> Option<&Track> {
        self.tracks
            .values()
            .find(|t| t.name.as_deref() == Some(name))
    }

    /// Slices on `track`, by start time.
    pub fn slices_on(&self, track: u64) -> Vec<&Slice> {
        self.slices.iter().filter(|s| s.track == track).collect()
    }

    /// Uuids of the thread tracks of `tid`.
    fn thread_tracks(&self, tid: i32) -> BTreeSet<u64> {
        self.tracks
            .values()
            .filter(|t| matches!(t.kind, TrackKind::Thread { tid: t2, .. } if t2 == tid))
            .map(|t| t.uuid)
            .collect()
    }

    /// Slices on the thread tracks of `tid`, by start time.
    pub fn slices_on_thread(&self, tid: i32) -> Vec<&Slice> {
        let tracks = self.thread_tracks(tid);
        let mut v: Vec<&Slice> = self
            .slices
            .iter()
            .filter(|s| tracks.contains(&s.track))
            .collect();
        v.sort_by_key(|s| s.ts);
        v
    }

    /// Instants on the thread tracks of `tid`, by time, as (name, args)
    /// with argument values rendered as text (see [`ArgValue`](super::ArgValue)'s `Display`).
    pub fn instants_on_thread(&self, tid: i32) -> Vec<(String, Vec<(String, String)>)> {
        let tracks = self.thread_tracks(tid);
        let mut v: Vec<&Instant> = self
            .instants
            .iter()
            .filter(|i| tracks.contains(&i.track))
            .collect();
        v.sort_by_key(|i| i.ts);
        v.into_iter()
            .map(|i| {
                let args = i
                    .args
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_string()))
                    .collect();
                (i.name.clone(), args)
            })
            .collect()
    }

    /// Values of the counter track(s) named `track_name`, by time.
    pub fn counter_values(&self, track_name: &str) -> Vec<f64> {
        let uuids: BTreeSet<u64> = self
            .tracks
            .values()
            .filter(|t| t.name.as_deref() == Some(track_name))
            .map(|t| t.uuid)
            .collect();
        self.counter_values_on(&uuids)
    }

    /// Values of the counter tracks `uuids`, by time.
    pub fn counter_values_on(&self, uuids: &BTreeSet<u64>) -> Vec<f64> {
        let mut v: Vec<(u64, f64)> = self
            .counters
            .iter()
            .filter(|c| uuids.contains(&c.track))
            .map(|c| (c.ts, c.value))
            .collect();
        v.sort_by_key(|(ts, _)| *ts);
        v.into_iter().map(|(_, value)| value).collect()
    }

    /// (ts, value) of counter track `track`, by time.
    pub fn counter_series(&self, track: u64) -> Vec<(u64, f64)> {
        let mut v: Vec<(u64, f64)> = self
            .counters
            .iter()
            .filter(|c| c.track == track)
            .map(|c| (c.ts, c.value))
            .collect();
        v.sort_by_key(|(ts, _)| *ts);
        v
    }

    /// The states of thread `tid` over time, as (start, end, state) with
    /// end > start: Running between switch-in and switch-out, the decoded
    /// `prev_state` after a switch-out, Runnable after a waking of a
    /// sleeping thread, nothing after `sched_process_free`. The last state
    /// ends at [`Self::end_ts`]. (tid 0 mixes every CPU's idle task.)
    pub fn thread_state_intervals(&self, tid: i32) -> Vec<(u64, u64, State)> {
        let version = self.kernel_release.as_deref().and_then(kernel_version);
        enum Ev {
            In,
            Out(i64),
            Wake,
            Free,
        }
        let mut evs: Vec<(u64, usize, Ev)> = Vec::new();
        for (i, s) in self.switches.iter().enumerate() {
            if s.prev_pid == tid && tid != UNKNOWN_PID {
                evs.push((s.ts, 2 * i, Ev::Out(s.prev_state)));
            }
            if s.next_pid == tid {
                evs.push((s.ts, 2 * i + 1, Ev::In));
            }
        }
        let base = 2 * self.switches.len();
        for (i, w) in self.wakings.iter().enumerate() {
            if w.pid == tid {
                evs.push((w.ts, base + i, Ev::Wake));
            }
        }
        let base = base + self.wakings.len();
        for (i, f) in self.frees.iter().enumerate() {
            if f.pid == tid {
                evs.push((f.ts, base + i, Ev::Free));
            }
        }
        evs.sort_by_key(|(ts, order, _)| (*ts, *order));
        let mut out = Vec::new();
        let mut current: Option<(u64, State)> = None;
        let mut close = |cur: &mut Option<(u64, State)>, ts: u64| {
            if let Some((start, state)) = cur.take()
                && ts > start
            {
                out.push((start, ts, state));
            }
        };
        for (ts, _, ev) in evs {
            match ev {
                Ev::In => {
                    close(&mut current, ts);
                    current = Some((ts, State::Running));
                }
                Ev::Out(raw) => {
                    close(&mut current, ts);
                    current = Some((ts, State::from_prev_state(raw, version)));
                }
                Ev::Wake => {
                    let asleep = !matches!(
                        current,
                        Some((
                            _,
                            State::Running | State::Runnable | State::RunnablePreempted
                        ))
                    );
                    if asleep {
                        close(&mut current, ts);
                        current = Some((ts, State::Runnable));
                    }
                }
                Ev::Free => close(&mut current, ts),
            }
        }
        close(&mut current, self.end_ts);
        out
    }
}
