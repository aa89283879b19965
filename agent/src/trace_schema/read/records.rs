//! A trace -> the records that made it, as the live pipeline handed them
//! to its sinks: rank identities from the process tracks; every device
//! call from the thread tracks' slices (arguments, communicator, memory
//! effect: [`call::read_call`]); exits and failed allocations from their
//! instants; the Python step counter's values; the main threads' off-CPU
//! intervals from the scheduler's switches ([`super::offcpu`]); device
//! work from the stream tracks, tied to its calls by the enqueue markers'
//! flows; GPU health from the GPU tracks' sample and Xid instants
//! ([`super::gpu`]). Calls never ended come back apart ([`OpenAtEnd`]): the live
//! pipeline never hands them on as records.
//!
//! Each record comes with the time the live pipeline would have handed it
//! on (a call at its end, an off-CPU interval at its end), so sorting by
//! it replays the recording.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use xpuscope_perfetto::rewrite::{ArgRef, EventKind, EventView, TrackView};
use xpuscope_probes::catalog::Library;
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::memory::{Device, MemoryEffect};
use xpuscope_probes::python::STEP_LOCALS;

use super::offcpu::{self, MainThreadSwitches};
use super::{MAX_LIVE_SITES, TracePackets};
use crate::events::Exit;
use crate::model::{
    DeviceCallRecord, DeviceWork, EnqueueMarker, Field, FieldValue, LiveSiteRow, RankIdentity,
    Record, Site, StepSeen, StreamTrack, WorkKind,
};
use crate::trace_schema::names::{self as n, label};
use crate::trace_schema::{call, keys as k};

/// A call that never returned: open when the trace ended, or running when
/// its thread or process died (`died`).
pub struct OpenAtEnd {
    pub call: DeviceCall,
    pub died: bool,
}

/// Function names the catalog does not know, given a `'static` life (a
/// few distinct ones per run).
#[derive(Default)]
struct Names(HashMap<String, &'static str>);

impl Names {
    fn get(&mut self, s: &str) -> &'static str {
        if let Some(n) = self.0.get(s) {
            return n;
        }
        let leaked: &'static str = Box::leak(s.to_owned().into_boxed_str());
        self.0.insert(s.to_owned(), leaked);
        leaked
    }
}

/// Reads traces into records; one per run, its names shared by all.
#[derive(Default)]
pub struct TraceRecords {
    names: Names,
}

/// A call begun on a thread track, not yet ended.
struct Begun {
    call: Option<DeviceCall>,
    /// An allocation's site, by its id and name.
    site: Option<Arc<Site>>,
}

/// Device work begun on a stream track, not yet ended.
struct BegunWork {
    start: u64,
    name: String,
    kind: Option<WorkKind>,
    fields: Vec<Field>,
}

/// A piece of device work's fields: its arguments but its kind.
fn work_fields(event: &EventView<'_>) -> Vec<Field> {
    event
        .args
        .iter()
        .filter(|(name, _)| *name != k::WORK_KIND.name)
        .filter_map(|(name, v)| {
            let value = match *v {
                ArgRef::Uint(v) | ArgRef::Pointer(v) => FieldValue::Uint(v),
                ArgRef::Double(v) => FieldValue::Double(v),
                ArgRef::Str(s) => FieldValue::Str(s.to_owned()),
                ArgRef::Bool(b) => FieldValue::Bool(b),
                // The sink writes no other kind of field.
                ArgRef::Int(_) | ArgRef::None => return None,
            };
            Some(Field::new(*name, value))
        })
        .collect()
}

/// Device work and the markers of where it was enqueued, handed on in the
/// order the live agent gets them: a marker (an API record, written when
/// the record came, after its call) after the call it falls in, the work
/// after its marker.
#[derive(Default)]
pub(crate) struct DeviceSide {
    pub(crate) work: Vec<DeviceWork>,
    pub(crate) markers: Vec<EnqueueMarker>,
    /// Per thread: (start, end) of its calls.
    pub(crate) calls: HashMap<u32, Vec<(u64, u64)>>,
}

impl DeviceSide {
    pub(crate) fn into_records(mut self, out: &mut Vec<(u64, Record)>) {
        let mut marked: HashMap<u64, u64> = HashMap::new();
        for calls in self.calls.values_mut() {
            calls.sort_unstable();
        }
        for m in self.markers {
            let at = self
                .calls
                .get(&m.tid)
                .and_then(|calls| {
                    let i = calls.partition_point(|(s, _)| *s <= m.ts);
                    // The innermost call holding it: the latest begun
                    // (calls nest, a few deep at most).
                    calls[..i]
                        .iter()
                        .rev()
                        .take(8)
                        .find(|(_, e)| *e >= m.ts)
                        .map(|(_, e)| *e)
                })
                .unwrap_or(m.ts);
            marked.insert(m.flow, at);
            out.push((at, Record::Enqueued(m)));
        }
        for w in self.work {
            let at = w
                .flows
                .iter()
                .filter_map(|f| marked.get(f))
                .fold(w.end, |a, &b| a.max(b));
            out.push((at, Record::DeviceWork(Box::new(w))));
        }
    }
}

/// A work kind by its name on the trace.
pub fn work_kind_of(name: &str) -> Option<WorkKind> {
    WorkKind::ALL.into_iter().find(|k| k.name() == name)
}

/// A process's identity from its process track's labels.
fn identity_of(labels: &[String]) -> Option<RankIdentity> {
    let owned = |key| label(labels, key).map(str::to_owned);
    let id = RankIdentity {
        rank: owned(n::RANK_LABEL),
        local_rank: owned(n::LOCAL_RANK_LABEL),
        world_size: owned(n::WORLD_SIZE_LABEL),
        job: owned(n::JOB_LABEL),
    };
    id.rank.is_some().then_some(id)
}

impl TraceRecords {
    /// Reads the trace at `path` into `(time handed on, record)` pairs
    /// and the calls still open at its end; `pid` maps the trace's pids
    /// and tids to the caller's (several traces keep theirs apart).
    /// Returns the trace's last timestamp.
    pub fn read(
        &mut self,
        path: &Path,
        pid: impl Fn(i32) -> u32 + Copy,
        out: &mut Vec<(u64, Record)>,
        open: &mut Vec<OpenAtEnd>,
    ) -> Result<u64> {
        self.read_with(|| TracePackets::open(path), pid, out, open)
    }

    /// [`Self::read`] of a trace in memory.
    #[cfg(test)]
    pub fn read_bytes(
        &mut self,
        trace: &[u8],
        pid: impl Fn(i32) -> u32 + Copy,
        out: &mut Vec<(u64, Record)>,
        open: &mut Vec<OpenAtEnd>,
    ) -> Result<u64> {
        let path = Path::new("(in memory)");
        self.read_with(|| Ok(TracePackets::new(trace, path)), pid, out, open)
    }

    /// Reads the trace `packets` opens (twice: its ranks first).
    fn read_with<R: Read>(
        &mut self,
        packets: impl Fn() -> Result<TracePackets<R>>,
        pid: impl Fn(i32) -> u32 + Copy,
        out: &mut Vec<(u64, Record)>,
        open: &mut Vec<OpenAtEnd>,
    ) -> Result<u64> {
        let ranked = ranked_pids(packets()?)?;
        let mut packets = packets()?;
        let mut threads: HashMap<u64, (i32, i32)> = HashMap::new();
        let mut processes: HashMap<u64, i32> = HashMap::new();
        let mut stacks: HashMap<u64, Vec<Begun>> = HashMap::new();
        let mut identified: HashMap<i32, RankIdentity> = HashMap::new();
        // Device stream tracks (children of a process track): uuid -> (pid,
        // stream name), and the work begun on each.
        let mut streams: HashMap<u64, (i32, String)> = HashMap::new();
        let mut work: HashMap<u64, Vec<BegunWork>> = HashMap::new();
        // GPU tracks (top level, `GPU <index>`): uuid -> index.
        let mut gpus: HashMap<u64, (crate::model::gpu::Vendor, u32)> = HashMap::new();
        let mut device = DeviceSide::default();
        let mut switches = MainThreadSwitches::default();
        for p in ranked {
            switches.follow(p);
        }
        // Per thread track: where in `out` its last call ended (a failed
        // allocation's instant completes it).
        let mut last_call: HashMap<u64, usize> = HashMap::new();
        let mut last = 0u64;
        while let Some(packet) = packets.next()? {
            if let Some(ts) = packet.timestamp() {
                last = last.max(ts);
            }
            if let Some(sample) = packets.interning().sample(&packet) {
                switches.stack(sample.pid, sample.tid, sample.ts, &sample.functions);
            }
            packet
                .for_each_new_task(|parent, child, flags| switches.new_task(parent, child, flags));
            packet.for_each_switch_to(|cpu, ts, state, next, comm| {
                switches.switch(cpu, ts, state, next, comm)
            });
            if let Some(tree) = packet.process_tree() {
                for p in tree.pids {
                    switches.thread(p, p);
                }
                for (tid, p) in tree.threads {
                    switches.thread(p, tid);
                }
            }
            match packet.track() {
                Some(TrackView::Process { pid: p, labels, .. }) => {
                    if let Some(uuid) = packet.track_uuid() {
                        processes.insert(uuid, p);
                    }
                    switches.thread(p, p);
                    if let Some(id) = identity_of(&labels)
                        && identified.get(&p) != Some(&id)
                    {
                        switches.identified(p, id.job.as_deref());
                        identified.insert(p, id.clone());
                        out.push((
                            0,
                            Record::Identity {
                                tgid: pid(p),
                                identity: Box::new(id),
                            },
                        ));
                    }
                }
                Some(TrackView::Thread { pid: p, tid }) => {
                    if let Some(uuid) = packet.track_uuid() {
                        threads.insert(uuid, (p, tid));
                    }
                    switches.thread(p, tid);
                }
                Some(TrackView::Other {
                    parent: None,
                    name: Some(name),
                }) => {
                    if let (Some(uuid), Some(gpu)) = (packet.track_uuid(), n::gpu_of_track(&name)) {
                        gpus.insert(uuid, gpu);
                    }
                }
                Some(TrackView::Other {
                    parent: Some(parent),
                    name: Some(name),
                }) => {
                    if let (Some(uuid), Some(&p)) = (packet.track_uuid(), processes.get(&parent)) {
                        streams.insert(uuid, (p, stream_name(&name).to_owned()));
                    }
                }
                _ => {}
            }
            let Some(event) = packets.event(&packet) else {
                continue;
            };
            if let Some(&gpu) = gpus.get(&event.track) {
                if event.kind == EventKind::Instant {
                    if let Some(s) = super::gpu::sample(&event, gpu, pid) {
                        out.push((s.ts, Record::GpuSample(Box::new(s))));
                    } else if let Some(x) = super::gpu::xid(&event, gpu, pid) {
                        out.push((x.ts, Record::GpuXid(x)));
                    }
                }
                continue;
            }
            if let Some((p, stream)) = streams.get(&event.track) {
                let begun = work.entry(event.track).or_default();
                match event.kind {
                    EventKind::Begin => begun.push(BegunWork {
                        start: event.ts,
                        name: event.name.unwrap_or("").to_owned(),
                        kind: k::WORK_KIND.read(&event).and_then(work_kind_of),
                        fields: work_fields(&event),
                    }),
                    EventKind::End => {
                        if let Some(BegunWork {
                            start,
                            name,
                            kind: Some(kind),
                            fields,
                        }) = begun.pop()
                        {
                            device.work.push(DeviceWork {
                                track: StreamTrack {
                                    tgid: pid(*p),
                                    name: stream.clone(),
                                    estimated: kind == WorkKind::Estimated,
                                },
                                kind,
                                start,
                                end: event.ts,
                                name,
                                fields,
                                flows: packet.flows(),
                            });
                        }
                    }
                    _ => {}
                }
                continue;
            }
            if let Some(&p) = processes.get(&event.track) {
                if let Some(exit) = process_exit(&event, pid(p), pid) {
                    out.push((
                        exit.ts,
                        Record::Exit {
                            exit,
                            process_ended: true,
                        },
                    ));
                }
                continue;
            }
            let Some(&(p, tid)) = threads.get(&event.track) else {
                continue;
            };
            if event.kind == EventKind::Instant
                && event
                    .name
                    .is_some_and(|name| name.starts_with(n::PREEMPTED_BY_EVENT))
                && let (Some(by_pid), Some(by_comm)) =
                    (k::BY_PID.read(&event), k::BY_COMM.read(&event))
            {
                switches.preempted(p, tid, event.ts, by_pid as u32, by_comm);
                continue;
            }
            let (tgid, tid) = (pid(p), pid(tid));
            if let Some(seen) = step_seen(&event, tgid, tid) {
                out.push((event.ts, Record::StepSeen(seen)));
                continue;
            }
            // Where an API record says this call enqueued device work: the
            // flow to that work starts here.
            if event.kind == EventKind::Begin
                && event.name == Some(n::ENQUEUED_EVENT)
                && let (Some(correlation), Some(&flow)) =
                    (k::CORRELATION_ID.read(&event), packet.flows().first())
            {
                device.markers.push(EnqueueMarker {
                    tgid,
                    tid,
                    ts: event.ts,
                    correlation,
                    flow,
                });
            }
            let stack = stacks.entry(event.track).or_default();
            let names = &mut self.names;
            match event.kind {
                EventKind::Begin => {
                    let call = call::read_call(&event, tgid, tid, |f| names.get(f));
                    let site = match (
                        call.as_ref().and_then(|c| c.memory),
                        k::ALLOC_STACK.read(&event),
                    ) {
                        (Some(MemoryEffect { site: Some(id), .. }), Some(label)) => {
                            Some(Arc::new(Site {
                                id,
                                tgid,
                                frames: Vec::new(),
                                label: label.to_string(),
                            }))
                        }
                        _ => None,
                    };
                    stack.push(Begun { call, site });
                }
                EventKind::End => {
                    if let Some(Begun {
                        call: Some(mut c),
                        site,
                    }) = stack.pop()
                    {
                        c.end_ts = Some(event.ts);
                        device
                            .calls
                            .entry(tid)
                            .or_default()
                            .push((c.start_ts, event.ts));
                        let mut r = DeviceCallRecord::new(c);
                        r.site = site;
                        last_call.insert(event.track, out.len());
                        out.push((event.ts, Record::DeviceCall(Box::new(r))));
                    }
                }
                // A failed device allocation (the sink's "<function>
                // failed" instant, with the request and the live sites),
                // written at the end of its call: what the live record
                // says of the failure, on that call.
                EventKind::Instant if k::REQUESTED.present(&event) => {
                    if let Some(failed) = failed_allocation(&event, tgid, tid) {
                        let call =
                            last_call
                                .get(&event.track)
                                .and_then(|&i| match out.get_mut(i) {
                                    Some((_, Record::DeviceCall(r)))
                                        if r.call.function == failed.call.function
                                            && r.call.end_ts == Some(event.ts)
                                            && r.oom.is_none() =>
                                    {
                                        Some(r)
                                    }
                                    _ => None,
                                });
                        match call {
                            Some(r) => {
                                if let (Some(m), Some(f)) =
                                    (r.call.memory.as_mut(), failed.call.memory)
                                {
                                    m.failed_request = f.failed_request;
                                }
                                r.oom = failed.oom;
                                if r.site.is_none() {
                                    r.site = failed.site;
                                }
                            }
                            None => out.push((event.ts, Record::DeviceCall(Box::new(failed)))),
                        }
                    }
                }
                // A call its thread or process died in (the sink marks it
                // at its start): in flight until that death.
                EventKind::Instant if k::UNMATCHED.present(&event) => {
                    let mut begin = event.clone();
                    begin.kind = EventKind::Begin;
                    // The instant's name says why after the call's name.
                    begin.name = event
                        .name
                        .map(|name| name.rsplit_once(" (").map_or(name, |(call, _)| call));
                    if let Some(c) = call::read_call(&begin, tgid, tid, |f| names.get(f)) {
                        open.push(OpenAtEnd {
                            call: c,
                            died: true,
                        });
                    }
                }
                _ => {}
            }
        }
        switches.into_records(pid, out);
        device.into_records(out);
        // Calls never ended: in flight when the recording stopped.
        for begun in stacks.into_values().flatten() {
            if let Some(c) = begun.call {
                open.push(OpenAtEnd {
                    call: c,
                    died: false,
                });
            }
        }
        Ok(last)
    }
}

/// A rank's Python step counter, from the sink's `python step N` instant.
fn step_seen(event: &EventView, tgid: u32, tid: u32) -> Option<StepSeen> {
    if event.kind != EventKind::Instant || !event.name?.starts_with(n::PYTHON_STEP_EVENT) {
        return None;
    }
    let step = k::STEP.read(event)?;
    // The sink writes one of the known names; anything else reads as the
    // plain `step`.
    let local = k::STEP_LOCAL
        .read(event)
        .and_then(|l| STEP_LOCALS.iter().copied().find(|w| *w == l));
    Some(StepSeen {
        tgid,
        tid,
        ts: event.ts,
        local: local.unwrap_or("step"),
        step,
    })
}

/// A stream track's name without its lane (`GPU 0 stream 7 #2`: the
/// second lane of stream 7, where its work overlapped).
pub fn stream_name(track: &str) -> &str {
    match track.rsplit_once(" #") {
        Some((base, lane)) if !lane.is_empty() && lane.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => track,
    }
}

/// The processes of a trace that have a rank (first pass: the scheduler's
/// switches of their main threads are kept from the trace's start).
fn ranked_pids<R: Read>(mut packets: TracePackets<R>) -> Result<Vec<i32>> {
    let mut pids = Vec::new();
    while let Some(packet) = packets.next()? {
        if let Some(TrackView::Process { pid, labels, .. }) = packet.track()
            && label(&labels, n::RANK_LABEL).is_some()
        {
            pids.push(pid);
        }
    }
    Ok(pids)
}

/// A failed device allocation read back from its instant: the request,
/// what the device held, the allocating stack and the largest live sites
/// (as labels: the trace keeps the frames on the instant's callstack).
fn failed_allocation(event: &EventView, tgid: u32, tid: u32) -> Option<DeviceCallRecord> {
    let fname = event.name?.strip_suffix(n::FAILED_SUFFIX)?;
    let (library, spec) = Library::ALL
        .into_iter()
        .find_map(|l| Some((l, l.function(fname)?)))?;
    let device = Device {
        vendor: library.vendor(),
        index: k::DEVICE.read(event).unwrap_or(0) as u32,
    };
    let site = |label: &str| {
        (label != "(unknown)").then(|| {
            Arc::new(Site {
                id: 0,
                tgid,
                frames: Vec::new(),
                label: label.to_owned(),
            })
        })
    };
    let uint = |key: &str| event.arg(key).and_then(|v| v.as_u64());
    let mut rows = Vec::new();
    for i in 1..=MAX_LIVE_SITES {
        let Some(bytes) = uint(&k::live_site(i, "bytes")) else {
            break;
        };
        let stack = match event.arg(&k::live_site(i, "stack")) {
            Some(ArgRef::Str(s)) => site(s),
            _ => None,
        };
        rows.push(LiveSiteRow {
            device,
            bytes,
            allocations: uint(&k::live_site(i, "allocations")).unwrap_or(0),
            site: stack,
        });
    }
    let call = DeviceCall {
        library,
        function: spec.name,
        kind: spec.kind,
        tgid,
        tid,
        start_ts: event.ts,
        end_ts: Some(event.ts),
        args: CallArgs::None,
        ret: k::RETURN.read(event),
        error: true,
        name: spec.name.into(),
        comm: None,
        memory: Some(MemoryEffect {
            device,
            delta: 0,
            held_after: k::DEVICE_BYTES_HELD.read(event).unwrap_or(0),
            failed_request: k::REQUESTED.read(event),
            untracked: false,
            site: None,
        }),
        site: None,
        launches: None,
    };
    let mut r = DeviceCallRecord::new(call);
    r.site = k::STACK.read(event).and_then(site);
    r.oom = Some(rows);
    Some(r)
}

/// A process's end, from its process track's exit instant
/// ([`n::PROCESS_EXIT_EVENT`]).
fn process_exit(event: &EventView, tgid: u32, pid: impl Fn(i32) -> u32) -> Option<Exit> {
    if event.kind != EventKind::Instant || !event.name?.starts_with(n::PROCESS_EXIT_EVENT) {
        return None;
    }
    Some(Exit {
        cpu: 0,
        ts: event.ts,
        tid: k::EXIT_TID.read(event).map_or(tgid, |t| pid(t as i32)),
        tgid,
        prio: 0,
        comm: offcpu::comm(k::EXIT_COMM.read(event).unwrap_or("")),
        group_dead: true,
        group_known: true,
        exit_code: k::EXIT_CODE.read(event).and_then(|c| i32::try_from(c).ok()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_track_is_named_without_its_lane() {
        assert_eq!(stream_name("GPU 0 stream 7 #2"), "GPU 0 stream 7");
        assert_eq!(stream_name("GPU 0 stream 7"), "GPU 0 stream 7");
        assert_eq!(stream_name("NPU 1 stream #x"), "NPU 1 stream #x");
    }

    #[test]
    fn device_work_comes_after_its_marker_and_the_marker_after_its_call() {
        let mut d = DeviceSide::default();
        // The call 100..500 on thread 7 enqueued work (API record at 200);
        // the work ran 300..400, before the call returned.
        d.calls.insert(7, vec![(600, 700), (100, 500), (150, 160)]);
        d.markers.push(EnqueueMarker {
            tgid: 7,
            tid: 7,
            ts: 200,
            correlation: 1,
            flow: 99,
        });
        d.work.push(DeviceWork {
            track: StreamTrack {
                tgid: 7,
                name: "GPU 0 stream 7".into(),
                estimated: false,
            },
            kind: WorkKind::Communication,
            start: 300,
            end: 400,
            name: "ncclDevKernel_AllReduce".into(),
            fields: Vec::new(),
            flows: vec![99],
        });
        let mut out = Vec::new();
        d.into_records(&mut out);
        let at: Vec<(u64, &str)> = out
            .iter()
            .map(|(ts, r)| {
                (
                    *ts,
                    match r {
                        Record::Enqueued(_) => "marker",
                        Record::DeviceWork(_) => "work",
                        _ => "other",
                    },
                )
            })
            .collect();
        assert_eq!(at, [(500, "marker"), (500, "work")]);
    }
}
