//! One pass over a decoded trace in file order: resolves interned data per
//! sequence, flattens every packet kind into plain records tagged with their
//! machine, and notes the problems only visible while walking (undefined
//! iids, malformed bundles, state used before it was cleared).

use std::collections::HashMap;

use perfetto_protos::debug_annotation::DebugAnnotation;
use perfetto_protos::trace::Trace;
use perfetto_protos::trace_packet::TracePacket;
use perfetto_protos::track_event::TrackEvent;

use super::ftrace::{self, SchedRecord};
use super::records::{
    ArgValue, CounterPoint, ProcessEntry, SampleSource, StackSample, Track, TrackKind,
};
use super::sequence::{ResolvedFrame, SeqState, Sequences};
use super::wire;

/// A track event with every interned reference resolved.
#[derive(Clone, Debug, Default)]
pub(crate) struct RawTrackEvent {
    pub packet: usize,
    pub ts: u64,
    pub track: Option<u64>,
    pub kind: i32,
    pub name: Option<String>,
    pub category: Option<String>,
    pub args: Vec<(String, ArgValue)>,
    pub flow_ids: Vec<u64>,
    pub terminating_flow_ids: Vec<u64>,
    pub callstack: Option<Vec<ResolvedFrame>>,
    pub callstack_weight: Option<f64>,
    pub counter_value: Option<f64>,
}

/// A thread-name update with the importer's priority (ftrace 1,
/// process tree 2, track descriptor 4).
#[derive(Clone, Debug)]
pub(crate) struct NameUpdate {
    pub tid: i32,
    pub tgid: Option<i32>,
    pub priority: u8,
    pub ts: u64,
    pub name: String,
}

/// Everything found in a trace, each record tagged with its machine id
/// (0 when the packet has none).
#[derive(Default)]
pub(crate) struct Extracted {
    pub errors: Vec<String>,
    /// (machine, packet index, utsname.release).
    pub system_infos: Vec<(u32, usize, Option<String>)>,
    /// (machine, packet index, cpu, lost_events, first timestamp).
    pub bundles: Vec<(u32, usize, u32, bool, Option<u64>)>,
    pub sched: Vec<(u32, SchedRecord)>,
    pub processes: Vec<(u32, u64, ProcessEntry)>,
    pub names: Vec<(u32, NameUpdate)>,
    pub tracks: Vec<(u32, usize, Track)>,
    pub track_events: Vec<(u32, RawTrackEvent)>,
    pub samples: Vec<(u32, StackSample)>,
}

fn resolve(
    kind: &str,
    table: &HashMap<u64, String>,
    iid: u64,
    seq: u32,
    errors: &mut Vec<String>,
) -> Option<String> {
    let found = table.get(&iid).cloned();
    if found.is_none() {
        errors.push(format!(
            "{kind} iid {iid} used before its definition on sequence {seq}"
        ));
    }
    found
}

fn callstack(
    state: &SeqState,
    iid: u64,
    seq: u32,
    errors: &mut Vec<String>,
) -> Option<Vec<ResolvedFrame>> {
    match state.interned.resolve_callstack(iid) {
        Ok(frames) => Some(frames),
        Err(e) => {
            errors.push(format!("callstack iid {iid} on sequence {seq}: {e}"));
            None
        }
    }
}

fn annotation(
    a: &DebugAnnotation,
    state: &SeqState,
    seq: u32,
    errors: &mut Vec<String>,
) -> (String, ArgValue) {
    let name = if a.has_name_iid() {
        let table = &state.interned.annotation_names;
        resolve("annotation name", table, a.name_iid(), seq, errors).unwrap_or_default()
    } else {
        a.name().to_owned()
    };
    let value = if a.has_int_value() {
        ArgValue::Int(a.int_value())
    } else if a.has_uint_value() {
        ArgValue::Uint(a.uint_value())
    } else if a.has_double_value() {
        ArgValue::Double(a.double_value())
    } else if a.has_string_value() {
        ArgValue::Str(a.string_value().to_owned())
    } else if a.has_bool_value() {
        ArgValue::Bool(a.bool_value())
    } else if a.has_pointer_value() {
        ArgValue::Pointer(a.pointer_value())
    } else {
        ArgValue::Other(format!("{a:?}"))
    };
    (name, value)
}

fn track_event(
    packet: &TracePacket,
    idx: usize,
    state: &SeqState,
    errors: &mut Vec<String>,
) -> RawTrackEvent {
    let e: &TrackEvent = packet.track_event();
    let seq = packet.trusted_packet_sequence_id();
    if seq == 0 {
        errors.push("track event without trusted_packet_sequence_id".into());
    }
    if !packet.has_timestamp() {
        errors.push("track event packet without timestamp".into());
    }
    let name = if e.has_name_iid() {
        resolve(
            "event name",
            &state.interned.event_names,
            e.name_iid(),
            seq,
            errors,
        )
    } else if e.has_name() {
        Some(e.name().to_owned())
    } else {
        None
    };
    let mut categories: Vec<String> = e
        .category_iids
        .iter()
        .filter_map(|&iid| resolve("category", &state.interned.categories, iid, seq, errors))
        .collect();
    categories.extend(e.categories.iter().cloned());
    let unknown = e.special_fields.unknown_fields();
    let callstack = if let Some(iid) = wire::unknown_u64(unknown, 56) {
        callstack(state, iid, seq, errors)
    } else if let Some(inline) = wire::unknown_bytes(unknown, 55) {
        inline_callstack(inline, errors)
    } else {
        None
    };
    let counter_value = if e.has_double_counter_value() {
        Some(e.double_counter_value())
    } else if e.has_counter_value() {
        Some(e.counter_value() as f64)
    } else {
        None
    };
    RawTrackEvent {
        packet: idx,
        ts: packet.timestamp(),
        track: e.track_uuid.or(state.default_track_uuid),
        kind: e.type_.map_or(0, |t| t.value()),
        name,
        category: (!categories.is_empty()).then(|| categories.join(",")),
        args: e
            .debug_annotations
            .iter()
            .map(|a| annotation(a, state, seq, errors))
            .collect(),
        flow_ids: [e.flow_ids.as_slice(), e.flow_ids_old.as_slice()].concat(),
        terminating_flow_ids: [
            e.terminating_flow_ids.as_slice(),
            e.terminating_flow_ids_old.as_slice(),
        ]
        .concat(),
        callstack,
        callstack_weight: wire::unknown_u64(unknown, 57).map(f64::from_bits),
        counter_value,
    }
}

/// An `InlineCallstack` (frames root first, `function_name = 1`).
fn inline_callstack(bytes: &[u8], errors: &mut Vec<String>) -> Option<Vec<ResolvedFrame>> {
    let parse = || -> Result<Vec<ResolvedFrame>, String> {
        let f = wire::fields(bytes)?;
        wire::all_bytes(&f, 1)
            .into_iter()
            .map(|frame| {
                let ff = wire::fields(frame)?;
                Ok(ResolvedFrame {
                    function: wire::last_string(&ff, 1).unwrap_or_default(),
                    mapping: String::new(),
                    build_id: Vec::new(),
                    rel_pc: 0,
                })
            })
            .collect()
    };
    parse()
        .map_err(|e| errors.push(format!("bad inline callstack: {e}")))
        .ok()
}

fn track_descriptor(packet: &TracePacket) -> Track {
    let d = packet.track_descriptor();
    let name = if d.has_name() {
        Some(d.name().to_owned())
    } else if d.has_static_name() {
        Some(d.static_name().to_owned())
    } else if d.has_atrace_name() {
        Some(d.atrace_name().to_owned())
    } else {
        None
    };
    let kind = if let Some(t) = d.thread.as_ref() {
        TrackKind::Thread {
            pid: t.pid(),
            tid: t.tid(),
            name: t.thread_name.clone(),
        }
    } else if let Some(p) = d.process.as_ref() {
        TrackKind::Process {
            pid: p.pid(),
            name: p.process_name.clone(),
            labels: p.process_labels.clone(),
        }
    } else if let Some(c) = d.counter.as_ref() {
        TrackKind::Counter {
            unit: c.unit.map(|u| u.value()),
            unit_name: c.unit_name.clone(),
        }
    } else {
        TrackKind::Custom
    };
    let unknown = d.special_fields.unknown_fields();
    Track {
        uuid: d.uuid(),
        name,
        parent: d.parent_uuid,
        description: wire::unknown_bytes(unknown, 14)
            .map(|b| String::from_utf8_lossy(b).into_owned()),
        kind,
    }
}

/// Decodes `StackSample` (field 135, schema v58+) from its bytes.
fn stack_sample(
    bytes: &[u8],
    ts: u64,
    state: &SeqState,
    seq: u32,
    errors: &mut Vec<String>,
) -> Result<StackSample, String> {
    let f = wire::fields(bytes)?;
    let (mut pid, mut tid) = (None, None);
    if let Some(task) = wire::all_bytes(&f, 1).last() {
        let t = wire::fields(task)?;
        pid = wire::last_u64(&t, 2).map(|v| v as i32);
        tid = wire::last_u64(&t, 3).map(|v| v as i32);
    } else if wire::last_u64(&f, 2).is_some() {
        errors.push("stack sample with an interned task context (not decoded)".into());
    }
    let cpu = match wire::all_bytes(&f, 3).last() {
        Some(exec) => wire::last_u64(&wire::fields(exec)?, 2).map(|v| v as u32),
        None => None,
    };
    let frames = if let Some(iid) = wire::last_u64(&f, 6) {
        callstack(state, iid, seq, errors).unwrap_or_default()
    } else if let Some(inline) = wire::all_bytes(&f, 5).last() {
        inline_callstack(inline, errors).unwrap_or_default()
    } else {
        Vec::new()
    };
    let weight = wire::last_u64(&f, 11);
    let has_descriptor = wire::last_u64(&f, 10).is_some()
        || !wire::all_bytes(&f, 9).is_empty()
        || state
            .stack_defaults
            .as_ref()
            .is_some_and(|d| d.primary.is_some());
    if weight.is_some() && !has_descriptor {
        errors.push(
            "stack sample weight without a primary counter descriptor (dropped by the importer)"
                .into(),
        );
    }
    Ok(StackSample {
        ts,
        cpu,
        pid: pid.unwrap_or(0),
        tid: tid.unwrap_or(0),
        weight: weight.unwrap_or(0),
        frames: frames.iter().map(|fr| fr.function.clone()).collect(),
        mappings: frames.into_iter().map(|fr| fr.mapping).collect(),
        source: SampleSource::StackSample,
    })
}

impl Extracted {
    fn process_tree(&mut self, machine: u32, idx: usize, p: &TracePacket) {
        let ts = p.timestamp();
        for proc in &p.process_tree().processes {
            if proc.cmdline.is_empty() {
                self.errors.push(format!(
                    "packet {idx}: process {} has no cmdline (the importer skips it)",
                    proc.pid()
                ));
            }
            self.processes.push((
                machine,
                ts,
                ProcessEntry {
                    pid: proc.pid(),
                    ppid: proc.ppid,
                    cmdline: proc.cmdline.clone(),
                    uid: proc.uid.map(|u| u as u32),
                    name: proc.cmdline.first().cloned(),
                    labels: Vec::new(),
                },
            ));
        }
        for t in &p.process_tree().threads {
            self.names.push((
                machine,
                NameUpdate {
                    tid: t.tid(),
                    tgid: t.tgid,
                    priority: 2,
                    ts,
                    name: t.name().to_owned(),
                },
            ));
        }
    }
}

/// Walks `trace` once.
pub(crate) fn extract(trace: &Trace) -> Extracted {
    let mut out = Extracted::default();
    let mut seqs = Sequences::default();
    let mut sched = Vec::new();
    for (idx, p) in trace.packet.iter().enumerate() {
        let machine = p.machine_id.unwrap_or(0);
        let (state, errs) = seqs.on_packet(machine, p);
        out.errors
            .extend(errs.into_iter().map(|e| format!("packet {idx}: {e}")));
        let seq = p.trusted_packet_sequence_id();
        let mut errors = Vec::new();
        if p.has_system_info() {
            let uts = p.system_info().utsname.as_ref();
            let release = uts.and_then(|u| u.release.clone());
            out.system_infos.push((machine, idx, release));
        } else if p.has_ftrace_events() {
            let mut records = Vec::new();
            let info = ftrace::decode_bundle(idx, p.ftrace_events(), &mut out.errors, &mut records);
            sched.extend(records.into_iter().map(|r| (machine, r)));
            if let Some(b) = info {
                out.bundles
                    .push((machine, idx, b.cpu, b.lost_events, b.first_ts));
            }
        } else if p.has_process_tree() {
            out.process_tree(machine, idx, p);
        } else if p.has_track_descriptor() {
            out.tracks.push((machine, idx, track_descriptor(p)));
        } else if p.has_track_event() {
            let e = track_event(p, idx, state, &mut errors);
            out.track_events.push((machine, e));
        } else if p.has_perf_sample() {
            let s = p.perf_sample();
            let frames = match s.callstack_iid {
                Some(iid) => callstack(state, iid, seq, &mut errors).unwrap_or_default(),
                None => Vec::new(),
            };
            out.samples.push((
                machine,
                StackSample {
                    ts: p.timestamp(),
                    cpu: s.cpu,
                    pid: s.pid() as i32,
                    tid: s.tid() as i32,
                    weight: s.timebase_count(),
                    frames: frames.iter().map(|f| f.function.clone()).collect(),
                    mappings: frames.into_iter().map(|f| f.mapping).collect(),
                    source: SampleSource::PerfSample,
                },
            ));
        } else if let Some(bytes) = wire::unknown_bytes(p.special_fields.unknown_fields(), 135) {
            match stack_sample(bytes, p.timestamp(), state, seq, &mut errors) {
                Ok(s) => out.samples.push((machine, s)),
                Err(e) => errors.push(format!("undecodable stack_sample: {e}")),
            }
        }
        out.errors
            .extend(errors.into_iter().map(|e| format!("packet {idx}: {e}")));
    }
    out.sched = sched;
    out
}

/// Counter values of the extracted track events.
pub(crate) fn counter_points(
    events: &[(u32, RawTrackEvent)],
    machine: Option<u32>,
) -> Vec<CounterPoint> {
    events
        .iter()
        .filter(|(m, e)| machine.is_none_or(|want| *m == want) && e.kind == 4)
        .filter_map(|(_, e)| {
            Some(CounterPoint {
                track: e.track?,
                ts: e.ts,
                value: e.counter_value?,
            })
        })
        .collect()
}
