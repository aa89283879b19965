//! [`Packet`]: one decoded packet of a trace this crate wrote, to inspect
//! and rewrite (for merging traces of several nodes), then encode again.
//!
//! Reading: the system packets' facts ([`Packet::system_info`],
//! [`Packet::clock_snapshot`]), track descriptors ([`Packet::track`]) and,
//! through [`Interning`] (a sequence's interned names), track events with
//! their names and arguments ([`Interning::event`]).
//!
//! Rewriting: [`Packet::remap`] passes every id and time through an
//! [`IdMap`] (sequence ids, track uuids, pids and tids, CPUs, flow ids,
//! BOOTTIME timestamps, compact-sched delta chains included), so the
//! packets of two machines no longer collide.
//!
//! Only the schema subset this crate writes is known: other fields are
//! dropped on decode. That is every field of a trace from this writer.

use prost::Message;
use rustc_hash::FxHashMap as HashMap;

use crate::proto::{self, TracePacket};
use crate::types::{Arg, ArgValue, ClockSnapshot};

/// A packet's bytes did not decode.
#[derive(Debug, thiserror::Error)]
#[error("packet {index}: does not decode as a TracePacket: {source}")]
pub struct DecodeError {
    pub index: u64,
    #[source]
    pub source: prost::DecodeError,
}

/// How ids and times of one trace map into another.
pub trait IdMap {
    /// A BOOTTIME timestamp.
    fn time(&mut self, ts: u64) -> u64;
    fn sequence(&mut self, id: u32) -> u32;
    fn track(&mut self, uuid: u64) -> u64;
    /// A process or thread id (0, the idle task, should stay 0).
    fn pid(&mut self, pid: i32) -> i32;
    fn cpu(&mut self, cpu: u32) -> u32;
    fn flow(&mut self, id: u64) -> u64;
}

/// `SystemInfo` facts a merge needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SystemInfoView {
    pub machine_name: Option<String>,
    pub release: Option<String>,
    pub num_cpus: Option<u32>,
}

/// What a track descriptor describes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TrackView {
    Process {
        pid: i32,
        name: Option<String>,
        labels: Vec<String>,
    },
    Thread {
        pid: i32,
        tid: i32,
    },
    Other {
        parent: Option<u64>,
        name: Option<String>,
    },
}

/// A process tree packet: its processes and threads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessTreeView {
    pub pids: Vec<i32>,
    /// (tid, tgid)
    pub threads: Vec<(i32, i32)>,
}

/// `TrackEvent.type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Begin,
    End,
    Instant,
    Counter,
    Other,
}

/// An argument value as read back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ArgRef<'a> {
    Bool(bool),
    Uint(u64),
    Int(i64),
    Double(f64),
    Str(&'a str),
    Pointer(u64),
    None,
}

impl ArgRef<'_> {
    /// The value as an unsigned integer, where it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            ArgRef::Uint(v) | ArgRef::Pointer(v) => Some(v),
            ArgRef::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
}

/// A track event with its interned names resolved.
#[derive(Clone, Debug)]
pub struct EventView<'a> {
    pub kind: EventKind,
    pub ts: u64,
    pub track: u64,
    pub name: Option<&'a str>,
    pub args: Vec<(&'a str, ArgRef<'a>)>,
}

impl<'a> EventView<'a> {
    pub fn arg(&self, name: &str) -> Option<ArgRef<'a>> {
        self.args.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }
}

/// One decoded packet.
#[derive(Clone, Debug, Default)]
pub struct Packet {
    p: TracePacket,
}

impl Packet {
    /// Decodes a packet's bytes (`index`: its position, for the error).
    pub fn decode(bytes: &[u8], index: u64) -> Result<Packet, DecodeError> {
        TracePacket::decode(bytes)
            .map(|p| Packet { p })
            .map_err(|source| DecodeError { index, source })
    }

    /// Appends the packet as a `Trace.packet` record.
    pub fn encode_framed(&self, out: &mut Vec<u8>) {
        out.push(0x0A);
        prost::encoding::encode_varint(self.p.encoded_len() as u64, out);
        // Encoding into a Vec only fails for lack of capacity, which a Vec
        // grows instead of reporting.
        self.p.encode(out).expect("a Vec grows as needed");
    }

    pub fn timestamp(&self) -> Option<u64> {
        self.p.timestamp
    }

    pub fn sequence_id(&self) -> Option<u32> {
        self.p.trusted_packet_sequence_id
    }

    pub fn machine_id(&self) -> Option<u32> {
        self.p.machine_id
    }

    pub fn clear_machine_id(&mut self) {
        self.p.machine_id = None;
    }

    pub fn system_info(&self) -> Option<SystemInfoView> {
        let s = self.p.system_info.as_ref()?;
        Some(SystemInfoView {
            machine_name: s.machine_name.clone(),
            release: s.utsname.as_ref().and_then(|u| u.release.clone()),
            num_cpus: s.num_cpus,
        })
    }

    /// A BOOTTIME + MONOTONIC + REALTIME snapshot (missing clocks read 0).
    pub fn clock_snapshot(&self) -> Option<ClockSnapshot> {
        let c = self.p.clock_snapshot.as_ref()?;
        let read = |id| {
            c.clocks
                .iter()
                .find(|k| k.clock_id == Some(id))
                .and_then(|k| k.timestamp)
                .unwrap_or(0)
        };
        Some(ClockSnapshot {
            boottime_ns: read(proto::CLOCK_BOOTTIME),
            monotonic_ns: read(proto::CLOCK_MONOTONIC),
            realtime_ns: read(proto::CLOCK_REALTIME),
        })
    }

    /// Sets the REALTIME reading of a clock snapshot (a test skews a
    /// machine's wall clock with it).
    pub fn set_realtime(&mut self, realtime_ns: u64) {
        if let Some(c) = self.p.clock_snapshot.as_mut() {
            for k in &mut c.clocks {
                if k.clock_id == Some(proto::CLOCK_REALTIME) {
                    k.timestamp = Some(realtime_ns);
                }
            }
        }
    }

    pub fn has_ftrace_events(&self) -> bool {
        self.p.ftrace_events.is_some()
    }

    /// Drops the scheduler bundle of this packet (it becomes empty).
    pub fn clear_ftrace_events(&mut self) {
        self.p.ftrace_events = None;
    }

    /// Calls `f(cpu, ts, prev_state, next_pid)` for each switch of the
    /// packet's scheduler bundle, in order (delta chains decoded).
    pub fn for_each_switch(&self, mut f: impl FnMut(u32, u64, i64, i32)) {
        self.for_each_switch_to(|cpu, ts, state, pid, _| f(cpu, ts, state, pid));
    }

    /// Like [`for_each_switch`](Self::for_each_switch), with the comm of
    /// the task switched to.
    pub fn for_each_switch_to(&self, mut f: impl FnMut(u32, u64, i64, i32, &str)) {
        let Some(b) = &self.p.ftrace_events else {
            return;
        };
        let Some(c) = &b.compact_sched else {
            return;
        };
        let cpu = b.cpu.unwrap_or(0);
        let mut ts = 0u64;
        for (i, dt) in c.switch_timestamp.iter().enumerate() {
            ts = ts.wrapping_add(*dt);
            let state = c.switch_prev_state.get(i).copied().unwrap_or(0);
            let pid = c.switch_next_pid.get(i).copied().unwrap_or(0);
            let comm = c
                .switch_next_comm_index
                .get(i)
                .and_then(|&k| c.intern_table.get(k as usize))
                .map_or("", String::as_str);
            f(cpu, ts, state, pid, comm);
        }
    }

    /// Calls `f(parent_tid, child_tid, clone_flags)` for each new task
    /// (`task_newtask`) of the packet's scheduler bundle.
    pub fn for_each_new_task(&self, mut f: impl FnMut(i32, i32, u64)) {
        let Some(b) = &self.p.ftrace_events else {
            return;
        };
        for e in &b.event {
            if let Some(t) = &e.task_newtask {
                f(
                    e.pid.unwrap_or(0) as i32,
                    t.pid.unwrap_or(0),
                    t.clone_flags.unwrap_or(0),
                );
            }
        }
    }

    /// The packet's process tree, if it has one.
    pub fn process_tree(&self) -> Option<ProcessTreeView> {
        let t = self.p.process_tree.as_ref()?;
        Some(ProcessTreeView {
            pids: t.processes.iter().filter_map(|p| p.pid).collect(),
            threads: t
                .threads
                .iter()
                .filter_map(|th| Some((th.tid?, th.tgid?)))
                .collect(),
        })
    }

    /// The flows the packet's track event starts and ends (`flow_ids`,
    /// then `terminating_flow_ids`).
    pub fn flows(&self) -> Vec<u64> {
        self.p.track_event.as_ref().map_or_else(Vec::new, |e| {
            e.flow_ids
                .iter()
                .chain(&e.terminating_flow_ids)
                .copied()
                .collect()
        })
    }

    pub fn track_uuid(&self) -> Option<u64> {
        self.p.track_descriptor.as_ref()?.uuid
    }

    /// What the packet's track descriptor describes, if it has one.
    pub fn track(&self) -> Option<TrackView> {
        let d = self.p.track_descriptor.as_ref()?;
        if let Some(p) = &d.process {
            return Some(TrackView::Process {
                pid: p.pid.unwrap_or(0),
                name: p.process_name.clone(),
                labels: p.process_labels.clone(),
            });
        }
        if let Some(t) = &d.thread {
            return Some(TrackView::Thread {
                pid: t.pid.unwrap_or(0),
                tid: t.tid.unwrap_or(0),
            });
        }
        Some(TrackView::Other {
            parent: d.parent_uuid,
            name: d.name.clone(),
        })
    }

    /// Renames and relabels a process track descriptor; `order` places it
    /// among its siblings.
    pub fn set_process(&mut self, name: &str, labels: Vec<String>, order: Option<i32>) {
        if let Some(d) = self.p.track_descriptor.as_mut()
            && let Some(p) = d.process.as_mut()
        {
            p.process_name = Some(name.to_owned());
            p.process_labels = labels;
            d.sibling_order_rank = order;
        }
    }

    /// Adds flow ids to a track event (it continues those flows).
    pub fn add_flows(&mut self, ids: &[u64]) {
        if let Some(e) = self.p.track_event.as_mut() {
            e.flow_ids.extend_from_slice(ids);
        }
    }

    /// Adds arguments (names written inline) to a track event.
    pub fn add_args(&mut self, args: &[Arg]) {
        if let Some(e) = self.p.track_event.as_mut() {
            e.debug_annotations
                .extend(args.iter().map(inline_annotation));
        }
    }

    /// Rewrites every id and BOOTTIME time through `map`.
    pub fn remap(&mut self, map: &mut impl IdMap) {
        let p = &mut self.p;
        if let Some(ts) = p.timestamp.as_mut() {
            *ts = map.time(*ts);
        }
        if let Some(s) = p.trusted_packet_sequence_id.as_mut() {
            *s = map.sequence(*s);
        }
        if let Some(c) = p.clock_snapshot.as_mut() {
            for k in &mut c.clocks {
                if matches!(
                    k.clock_id,
                    Some(proto::CLOCK_BOOTTIME | proto::CLOCK_MONOTONIC)
                ) && let Some(ts) = k.timestamp.as_mut()
                {
                    *ts = map.time(*ts);
                }
            }
        }
        if let Some(tree) = p.process_tree.as_mut() {
            for pr in &mut tree.processes {
                remap_opt(&mut pr.pid, map);
                remap_opt(&mut pr.ppid, map);
            }
            for t in &mut tree.threads {
                remap_opt(&mut t.tid, map);
                remap_opt(&mut t.tgid, map);
            }
        }
        if let Some(b) = p.ftrace_events.as_mut() {
            remap_bundle(b, map);
        }
        if let Some(d) = p.track_descriptor.as_mut() {
            if let Some(u) = d.uuid.as_mut() {
                *u = map.track(*u);
            }
            if let Some(u) = d.parent_uuid.as_mut() {
                *u = map.track(*u);
            }
            if let Some(pr) = d.process.as_mut() {
                remap_opt(&mut pr.pid, map);
            }
            if let Some(t) = d.thread.as_mut() {
                remap_opt(&mut t.pid, map);
                remap_opt(&mut t.tid, map);
            }
        }
        if let Some(e) = p.track_event.as_mut() {
            if let Some(u) = e.track_uuid.as_mut() {
                *u = map.track(*u);
            }
            for f in e
                .flow_ids
                .iter_mut()
                .chain(e.terminating_flow_ids.iter_mut())
            {
                *f = map.flow(*f);
            }
        }
        if let Some(s) = p.perf_sample.as_mut() {
            remap_opt_u32(&mut s.pid, map);
            remap_opt_u32(&mut s.tid, map);
            if let Some(c) = s.cpu.as_mut() {
                *c = map.cpu(*c);
            }
        }
        if let Some(s) = p.stack_sample.as_mut() {
            if let Some(t) = s.task_context.as_mut() {
                remap_opt_u32(&mut t.pid, map);
                remap_opt_u32(&mut t.tid, map);
            }
            if let Some(c) = s.execution_context.as_mut().and_then(|x| x.cpu.as_mut()) {
                *c = map.cpu(*c);
            }
        }
    }

    // ---- packets a merge writes itself (no interning: names inline) ----

    /// A `SystemInfo` packet on sequence `seq`.
    pub fn new_system_info(seq: u32, info: &crate::SystemInfo) -> Packet {
        Packet {
            p: TracePacket {
                trusted_packet_sequence_id: Some(seq),
                system_info: Some(proto::SystemInfo {
                    utsname: Some(proto::Utsname {
                        sysname: Some(info.sysname.clone()),
                        version: Some(info.version.clone()),
                        release: Some(info.release.clone()),
                        machine: Some(info.machine.clone()),
                    }),
                    hz: Some(info.hz),
                    page_size: Some(info.page_size),
                    num_cpus: Some(info.num_cpus),
                    machine_name: info.machine_name.clone(),
                }),
                ..TracePacket::default()
            },
        }
    }

    /// A named track under `parent` on sequence `seq`.
    pub fn new_track(seq: u32, uuid: u64, parent: Option<u64>, name: &str, order: i32) -> Packet {
        Packet {
            p: TracePacket {
                trusted_packet_sequence_id: Some(seq),
                track_descriptor: Some(proto::TrackDescriptor {
                    uuid: Some(uuid),
                    parent_uuid: parent,
                    name: Some(name.to_owned()),
                    sibling_order_rank: Some(order),
                    ..proto::TrackDescriptor::default()
                }),
                ..TracePacket::default()
            },
        }
    }

    /// A process track descriptor on sequence `seq`.
    pub fn new_process_track(
        seq: u32,
        uuid: u64,
        pid: i32,
        name: &str,
        labels: Vec<String>,
        order: Option<i32>,
    ) -> Packet {
        Packet {
            p: TracePacket {
                trusted_packet_sequence_id: Some(seq),
                track_descriptor: Some(proto::TrackDescriptor {
                    uuid: Some(uuid),
                    process: Some(proto::ProcessDescriptor {
                        pid: Some(pid),
                        process_name: Some(name.to_owned()),
                        process_labels: labels,
                    }),
                    sibling_order_rank: order,
                    ..proto::TrackDescriptor::default()
                }),
                ..TracePacket::default()
            },
        }
    }

    /// A slice BEGIN (`Some(name)`) or END (`None`) on `track`. `first`:
    /// the sequence's first packet (it clears the incremental state).
    pub fn new_slice_event(
        seq: u32,
        first: bool,
        ts: u64,
        track: u64,
        name: Option<&str>,
        args: &[Arg],
    ) -> Packet {
        Packet {
            p: TracePacket {
                timestamp: Some(ts),
                trusted_packet_sequence_id: Some(seq),
                sequence_flags: first.then_some(proto::SEQ_INCREMENTAL_STATE_CLEARED),
                track_event: Some(proto::TrackEvent {
                    r#type: Some(if name.is_some() {
                        proto::TYPE_SLICE_BEGIN
                    } else {
                        proto::TYPE_SLICE_END
                    }),
                    track_uuid: Some(track),
                    name: name.map(str::to_owned),
                    debug_annotations: args.iter().map(inline_annotation).collect(),
                    ..proto::TrackEvent::default()
                }),
                ..TracePacket::default()
            },
        }
    }
}

fn inline_annotation(a: &Arg) -> proto::DebugAnnotation {
    let mut d = proto::DebugAnnotation {
        name: Some(a.name.to_string()),
        ..proto::DebugAnnotation::default()
    };
    match &a.value {
        ArgValue::Int(v) => d.int_value = Some(*v),
        ArgValue::Uint(v) => d.uint_value = Some(*v),
        ArgValue::Double(v) => d.double_value = Some(*v),
        ArgValue::Bool(v) => d.bool_value = Some(*v),
        ArgValue::Str(v) => d.string_value = Some(v.clone()),
        ArgValue::Pointer(v) => d.pointer_value = Some(*v),
    }
    d
}

fn remap_opt(v: &mut Option<i32>, map: &mut impl IdMap) {
    if let Some(x) = v.as_mut() {
        *x = map.pid(*x);
    }
}

fn remap_opt_u32(v: &mut Option<u32>, map: &mut impl IdMap) {
    if let Some(x) = v.as_mut() {
        *x = map.pid(*x as i32) as u32;
    }
}

/// Shifts a delta chain: only its first entry is absolute.
fn remap_chain(ts: &mut [u64], map: &mut impl IdMap) {
    if let Some(first) = ts.first_mut() {
        *first = map.time(*first);
    }
}

fn remap_bundle(b: &mut proto::FtraceEventBundle, map: &mut impl IdMap) {
    if let Some(c) = b.cpu.as_mut() {
        *c = map.cpu(*c);
    }
    if let Some(c) = b.compact_sched.as_mut() {
        remap_chain(&mut c.switch_timestamp, map);
        remap_chain(&mut c.waking_timestamp, map);
        for p in c.switch_next_pid.iter_mut().chain(c.waking_pid.iter_mut()) {
            *p = map.pid(*p);
        }
        for cpu in &mut c.waking_target_cpu {
            *cpu = map.cpu(*cpu as u32) as i32;
        }
    }
    for e in &mut b.event {
        if let Some(ts) = e.timestamp.as_mut() {
            *ts = map.time(*ts);
        }
        remap_opt_u32(&mut e.pid, map);
        if let Some(n) = e.task_newtask.as_mut() {
            remap_opt(&mut n.pid, map);
        }
        if let Some(r) = e.task_rename.as_mut() {
            remap_opt(&mut r.pid, map);
        }
        if let Some(f) = e.sched_process_free.as_mut() {
            remap_opt(&mut f.pid, map);
        }
    }
}

/// The interned names of each sequence, as the importer keeps them: reset
/// by a packet that clears the incremental state, extended by interned
/// data. Bounded by the distinct names a writer interns.
#[derive(Default)]
pub struct Interning {
    sequences: HashMap<u32, Names>,
}

#[derive(Default)]
struct Names {
    events: HashMap<u64, String>,
    annotations: HashMap<u64, String>,
    functions: HashMap<u64, String>,
    /// Frame iid -> function name iid.
    frames: HashMap<u64, u64>,
    /// Callstack iid -> frame iids, root first.
    callstacks: HashMap<u64, Vec<u64>>,
}

/// A callstack sample with its function names resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SampleView<'a> {
    pub ts: u64,
    pub pid: i32,
    pub tid: i32,
    /// The time it stands for (off-CPU samples: time off CPU), if given.
    pub weight: Option<u64>,
    /// Function names, root first (unknown frames left out).
    pub functions: Vec<&'a str>,
}

impl Interning {
    /// Takes in `packet`'s effect on its sequence's state.
    pub fn observe(&mut self, packet: &Packet) {
        let p = &packet.p;
        let seq = p.trusted_packet_sequence_id.unwrap_or(0);
        if p.sequence_flags.unwrap_or(0) & proto::SEQ_INCREMENTAL_STATE_CLEARED != 0 {
            self.sequences.insert(seq, Names::default());
        }
        if let Some(d) = &p.interned_data {
            let names = self.sequences.entry(seq).or_default();
            for n in &d.event_names {
                if let (Some(iid), Some(name)) = (n.iid, &n.name) {
                    names.events.insert(iid, name.clone());
                }
            }
            for n in &d.debug_annotation_names {
                if let (Some(iid), Some(name)) = (n.iid, &n.name) {
                    names.annotations.insert(iid, name.clone());
                }
            }
            for f in &d.function_names {
                if let (Some(iid), Some(text)) = (f.iid, &f.str) {
                    names
                        .functions
                        .insert(iid, String::from_utf8_lossy(text).into_owned());
                }
            }
            for f in &d.frames {
                if let (Some(iid), Some(name)) = (f.iid, f.function_name_id) {
                    names.frames.insert(iid, name);
                }
            }
            for c in &d.callstacks {
                if let Some(iid) = c.iid {
                    names.callstacks.insert(iid, c.frame_ids.clone());
                }
            }
        }
    }

    /// The packet's callstack sample (`StackSample` or `PerfSample`),
    /// frames resolved on its sequence.
    pub fn sample<'a>(&'a self, packet: &'a Packet) -> Option<SampleView<'a>> {
        let p = &packet.p;
        let (pid, tid, iid, weight) = if let Some(s) = &p.stack_sample {
            let t = s.task_context.as_ref();
            (
                t.and_then(|t| t.pid),
                t.and_then(|t| t.tid),
                s.callstack_iid,
                s.primary_weight,
            )
        } else if let Some(s) = &p.perf_sample {
            (s.pid, s.tid, s.callstack_iid, None)
        } else {
            return None;
        };
        let names = self
            .sequences
            .get(&p.trusted_packet_sequence_id.unwrap_or(0));
        let functions = names
            .zip(iid)
            .and_then(|(n, iid)| {
                let frames = n.callstacks.get(&iid)?;
                Some(
                    frames
                        .iter()
                        .filter_map(|f| n.functions.get(n.frames.get(f)?))
                        .map(String::as_str)
                        .collect(),
                )
            })
            .unwrap_or_default();
        Some(SampleView {
            ts: p.timestamp.unwrap_or(0),
            pid: pid.unwrap_or(0) as i32,
            tid: tid.unwrap_or(0) as i32,
            weight,
            functions,
        })
    }

    /// The packet's track event, names resolved on its sequence.
    pub fn event<'a>(&'a self, packet: &'a Packet) -> Option<EventView<'a>> {
        let p = &packet.p;
        let e = p.track_event.as_ref()?;
        let names = self
            .sequences
            .get(&p.trusted_packet_sequence_id.unwrap_or(0));
        let kind = match e.r#type {
            Some(proto::TYPE_SLICE_BEGIN) => EventKind::Begin,
            Some(proto::TYPE_SLICE_END) => EventKind::End,
            Some(proto::TYPE_INSTANT) => EventKind::Instant,
            Some(proto::TYPE_COUNTER) => EventKind::Counter,
            _ => EventKind::Other,
        };
        let name = e.name.as_deref().or_else(|| {
            names
                .zip(e.name_iid)
                .and_then(|(n, iid)| n.events.get(&iid))
                .map(String::as_str)
        });
        let args = e
            .debug_annotations
            .iter()
            .filter_map(|a| {
                let name = a.name.as_deref().or_else(|| {
                    names
                        .zip(a.name_iid)
                        .and_then(|(n, iid)| n.annotations.get(&iid))
                        .map(String::as_str)
                })?;
                let value = if let Some(v) = a.bool_value {
                    ArgRef::Bool(v)
                } else if let Some(v) = a.uint_value {
                    ArgRef::Uint(v)
                } else if let Some(v) = a.int_value {
                    ArgRef::Int(v)
                } else if let Some(v) = a.double_value {
                    ArgRef::Double(v)
                } else if let Some(v) = &a.string_value {
                    ArgRef::Str(v)
                } else if let Some(v) = a.pointer_value {
                    ArgRef::Pointer(v)
                } else {
                    ArgRef::None
                };
                Some((name, value))
            })
            .collect();
        Some(EventView {
            kind,
            ts: p.timestamp.unwrap_or(0),
            track: e.track_uuid.unwrap_or(0),
            name,
            args,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read::PacketReader;
    use crate::{Arg, ArgValue, ProcessInfo, SystemInfo, ThreadInfo, TraceWriter, WriterOptions};

    fn sample_trace() -> Vec<u8> {
        let mut w = TraceWriter::with_options(
            Vec::new(),
            WriterOptions {
                bundle_events: 4,
                ..WriterOptions::default()
            },
        );
        w.system_info(&SystemInfo {
            release: "6.18.0".into(),
            num_cpus: 2,
            machine_name: Some("node-a".into()),
            ..SystemInfo::default()
        })
        .unwrap();
        w.clock_snapshot(&ClockSnapshot {
            boottime_ns: 1_000,
            monotonic_ns: 900,
            realtime_ns: 50_000,
        })
        .unwrap();
        w.process_tree(
            1_000,
            &[ProcessInfo {
                pid: 42,
                ppid: 1,
                cmdline: vec!["rank".into()],
                uid: None,
            }],
            &[ThreadInfo {
                tid: 43,
                tgid: 42,
                name: "loader".into(),
            }],
        )
        .unwrap();
        w.sched_switch(1, 2_000, 0, 42, 120, "rank").unwrap();
        w.sched_switch(1, 2_500, 1, 43, 120, "loader").unwrap();
        w.sched_waking(1, 2_600, 42, 0, 120, "rank").unwrap();
        let p = w.process_track(42, "rank 3/8", &["rank=3".into()]).unwrap();
        let t = w.thread_track(42, 43, "").unwrap();
        let _ = p;
        w.slice_begin(
            t,
            3_000,
            "ncclAllReduce",
            Some("device"),
            &[
                Arg::new("comm_hash", ArgValue::Str("00ab".into())),
                Arg::new("seq", ArgValue::Uint(7)),
            ],
            &[99],
            None,
        )
        .unwrap();
        w.slice_end(t, 3_500, &[]).unwrap();
        let stack = [
            crate::Frame::kernel("schedule", 0x40),
            crate::Frame::kernel("futex_wait", 0x80),
        ];
        w.stack_sample(3_600, 1, 42, 43, &stack, 1_000).unwrap();
        w.finish().unwrap()
    }

    fn packets(bytes: &[u8]) -> Vec<Packet> {
        let mut r = PacketReader::new(bytes);
        let mut out = Vec::new();
        while let Some(b) = r.next_packet().unwrap() {
            out.push(Packet::decode(b, out.len() as u64).unwrap());
        }
        out
    }

    struct Shift;
    impl IdMap for Shift {
        fn time(&mut self, ts: u64) -> u64 {
            ts + 1_000_000
        }
        fn sequence(&mut self, id: u32) -> u32 {
            id + 10
        }
        fn track(&mut self, uuid: u64) -> u64 {
            uuid ^ 0xff
        }
        fn pid(&mut self, pid: i32) -> i32 {
            if pid == 0 { 0 } else { pid + 5000 }
        }
        fn cpu(&mut self, cpu: u32) -> u32 {
            cpu + 2
        }
        fn flow(&mut self, id: u64) -> u64 {
            id + 1
        }
    }

    #[test]
    fn reads_facts_and_events_with_interned_names() {
        let ps = packets(&sample_trace());
        let info = ps.iter().find_map(Packet::system_info).unwrap();
        assert_eq!(info.machine_name.as_deref(), Some("node-a"));
        assert_eq!(info.num_cpus, Some(2));
        let clock = ps.iter().find_map(Packet::clock_snapshot).unwrap();
        assert_eq!((clock.boottime_ns, clock.realtime_ns), (1_000, 50_000));
        let mut names = Interning::default();
        let mut events = Vec::new();
        for p in &ps {
            names.observe(p);
            if let Some(e) = names.event(p) {
                events.push((
                    e.kind,
                    e.ts,
                    e.name.map(str::to_owned),
                    e.arg("seq").and_then(|a| a.as_u64()),
                ));
            }
            if let Some(TrackView::Process { pid, labels, .. }) = p.track() {
                assert_eq!((pid, labels), (42, vec!["rank=3".to_string()]));
            }
        }
        assert_eq!(
            events,
            vec![
                (
                    EventKind::Begin,
                    3_000,
                    Some("ncclAllReduce".into()),
                    Some(7)
                ),
                (EventKind::End, 3_500, None, None),
            ]
        );
    }

    #[test]
    fn remap_moves_every_id_and_time_and_round_trips() {
        let bytes = sample_trace();
        let mut out = Vec::new();
        for mut p in packets(&bytes) {
            p.remap(&mut Shift);
            p.encode_framed(&mut out);
        }
        let trace = xpuscope_tests::trace_check::decode(&out).unwrap();
        let tl = xpuscope_tests::trace_check::Timeline::new(&trace);
        let sw: Vec<(u32, u64, i32)> = tl
            .switches
            .iter()
            .map(|s| (s.cpu, s.ts, s.next_pid))
            .collect();
        assert_eq!(sw, vec![(3, 1_002_000, 5042), (3, 1_002_500, 5043)]);
        assert_eq!(tl.wakings[0].ts, 1_002_600);
        assert_eq!(tl.wakings[0].pid, 5042);
        assert!(tl.processes.contains_key(&5042));
        let s = &tl.slices[0];
        assert_eq!((s.ts, s.end), (1_003_000, Some(1_003_500)));
        let mut seen = Vec::new();
        for p in packets(&bytes) {
            p.for_each_switch(|cpu, ts, state, pid| seen.push((cpu, ts, state, pid)));
        }
        assert_eq!(seen, vec![(1, 2_000, 0, 42), (1, 2_500, 1, 43)]);
        let mut names = Interning::default();
        let mut samples = Vec::new();
        for p in packets(&bytes) {
            names.observe(&p);
            if let Some(s) = names.sample(&p) {
                samples.push((s.ts, s.tid, s.weight, s.functions.join("<")));
            }
        }
        assert_eq!(
            samples,
            vec![(3_600, 43, Some(1_000), "futex_wait<schedule".to_string())]
        );
        assert_eq!(s.flow_ids, vec![100]);
        for p in &trace.packet {
            if p.has_clock_snapshot() {
                let c = &p.clock_snapshot().clocks;
                let boot = c.iter().find(|k| k.clock_id() == 6).unwrap();
                let real = c.iter().find(|k| k.clock_id() == 1).unwrap();
                assert_eq!((boot.timestamp(), real.timestamp()), (1_001_000, 50_000));
            }
            if p.has_trusted_packet_sequence_id() {
                assert!(p.trusted_packet_sequence_id() > 10);
            }
        }
        xpuscope_tests::trace_check::check_importer_rules(&trace).unwrap();
    }
}
