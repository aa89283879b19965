//! `agent diagnose`: the detectors over recorded traces (the offline
//! driver; `agent attach` and the service are the online one). Each
//! trace is read back into the records the detectors take: rank
//! identities from the process tracks; every catalog call from the thread
//! tracks' slices (collectives with their communicator arguments, memory
//! calls with what they added or released at which site); exits and
//! failed allocations from their instants; calls still open at the end as
//! in-flight snapshots; the main threads' off-CPU intervals from the
//! scheduler's switches ([`offcpu`]); device work from the stream tracks,
//! tied to its calls by the enqueue markers' flows. They are fed, in the
//! order the live agent gets them, into the same [`Detectors`]. Several
//! traces of one job (one per node) meet on communicator hash + sequence
//! number; process ids are kept apart per trace. The clocks of different
//! nodes are taken as they are (arrival delays across nodes include their
//! offset).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use xpuscope_perfetto::rewrite::{
    ArgRef, EventKind, EventView, Interning, Packet, PacketReader, TrackView,
};
use xpuscope_probes::catalog::{CallKind, Collective, Library, SyncKind};
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::{CallArgs, CollectiveArgs};
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::memory::{Device, MemoryEffect};

use crate::events::Exit;
use crate::merge::collectives::{collective, sync_stream};
use crate::model::finding::FindingsDoc;
use crate::model::{
    DeviceCallRecord, DeviceWork, EnqueueMarker, Finding, FindingKind, InFlightSnapshot,
    LiveSiteRow, OpenCall, RankIdentity, Record, Site, StepSeen, StreamTrack, ThreadNow, WorkKind,
};
use crate::sinks::detect::{DetectConfig, Detectors};
use crate::sinks::perfetto::{
    ENQUEUED_EVENT, PREEMPTED_BY_EVENT, PROCESS_EXIT_EVENT, PYTHON_STEP_EVENT, WORK_KIND_ARG,
    work_kind_of,
};
use offcpu::MainThreadSwitches;
use xpuscope_probes::python::STEP_LOCALS;

mod offcpu;

pub struct DiagnoseOptions {
    pub traces: Vec<PathBuf>,
    pub json: Option<PathBuf>,
    pub detect: DetectConfig,
}

/// How often the live pipeline snapshots the calls in flight (ns).
const OFFLINE_TICK_NS: u64 = 1_000_000_000;

/// One trace's pid as the detectors see it: unique across traces.
fn job_pid(trace: usize, pid: i32) -> u32 {
    ((trace as u32) << 22) | (pid as u32 & 0x3f_ffff)
}

fn collective_kind(op: &str) -> Option<Collective> {
    Some(match op {
        "all_reduce" => Collective::AllReduce,
        "all_gather" => Collective::AllGather,
        "reduce_scatter" => Collective::ReduceScatter,
        "broadcast" => Collective::Broadcast,
        "reduce" => Collective::Reduce,
        _ => return None,
    })
}

fn library_of(name: Option<&str>) -> Library {
    Library::ALL
        .into_iter()
        .find(|l| Some(l.name()) == name)
        .unwrap_or(Library::Nccl)
}

/// Function names live as long as the run (a few distinct ones).
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

/// A call begun on a thread track, not yet ended.
struct Begun {
    call: Option<DeviceCall>,
    /// An allocation's site, by its id and name.
    site: Option<Arc<Site>>,
}

/// Device work and the markers of where it was enqueued, handed on in the
/// order the live agent gets them: a marker (an API record, written when
/// the record came, after its call) after the call it falls in, the work
/// after its marker.
#[derive(Default)]
struct DeviceSide {
    work: Vec<DeviceWork>,
    markers: Vec<EnqueueMarker>,
    /// Per thread: (start, end) of its calls.
    calls: HashMap<u32, Vec<(u64, u64)>>,
}

impl DeviceSide {
    fn into_records(mut self, out: &mut Vec<(u64, Record)>) {
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

fn open_trace(path: &Path) -> Result<PacketReader<File>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(PacketReader::new(file))
}

/// The trace's next packet, decoded.
fn next_packet(reader: &mut PacketReader<File>, path: &Path) -> Result<Option<Packet>> {
    let n = reader.packets();
    let Some(bytes) = reader
        .next_packet()
        .with_context(|| format!("reading {}", path.display()))?
    else {
        return Ok(None);
    };
    let packet = Packet::decode(bytes, n).with_context(|| {
        format!(
            "reading {}: not an xpuscope trace (agent attach output)?",
            path.display()
        )
    })?;
    Ok(Some(packet))
}

/// Reads one trace into (time, record) pairs; returns its last timestamp.
fn read_trace(
    index: usize,
    path: &Path,
    names: &mut Names,
    out: &mut Vec<(u64, Record)>,
    open: &mut Vec<Stuck>,
) -> Result<u64> {
    let mut reader = open_trace(path)?;
    let mut interning = Interning::default();
    let mut threads: HashMap<u64, (i32, i32)> = HashMap::new();
    let mut processes: HashMap<u64, i32> = HashMap::new();
    let mut stacks: HashMap<u64, Vec<Begun>> = HashMap::new();
    let mut ranked: HashMap<i32, u32> = HashMap::new();
    // Device stream tracks (children of a process track): uuid -> (pid,
    // stream name), and the work begun on each.
    let mut streams: HashMap<u64, (i32, String)> = HashMap::new();
    let mut work: HashMap<u64, Vec<(u64, String, Option<WorkKind>)>> = HashMap::new();
    let mut device = DeviceSide::default();
    let mut switches = MainThreadSwitches::default();
    for pid in ranked_pids(path)? {
        switches.follow(pid);
    }
    let mut last = 0u64;
    while let Some(packet) = next_packet(&mut reader, path)? {
        interning.observe(&packet);
        if let Some(ts) = packet.timestamp() {
            last = last.max(ts);
        }
        if let Some(sample) = interning.sample(&packet) {
            switches.stack(sample.pid, sample.tid, sample.ts, &sample.functions);
        }
        packet.for_each_new_task(|parent, child, flags| switches.new_task(parent, child, flags));
        packet.for_each_switch_to(|cpu, ts, state, next, comm| {
            switches.switch(cpu, ts, state, next, comm)
        });
        if let Some(tree) = packet.process_tree() {
            for pid in tree.pids {
                switches.thread(pid, pid);
            }
            for (tid, pid) in tree.threads {
                switches.thread(pid, tid);
            }
        }
        match packet.track() {
            Some(TrackView::Process { pid, labels, .. }) => {
                if let Some(uuid) = packet.track_uuid() {
                    processes.insert(uuid, pid);
                }
                switches.thread(pid, pid);
                let rank = labels
                    .iter()
                    .find_map(|l| l.strip_prefix("rank=")?.parse::<u32>().ok());
                let job = labels.iter().find_map(|l| l.strip_prefix("job="));
                if let Some(r) = rank
                    && ranked.insert(pid, r) != Some(r)
                {
                    let mut environ = format!("RANK={r}\0");
                    if let Some(j) = job {
                        environ.push_str(&format!("XPUSCOPE_JOB={j}\0"));
                    }
                    out.push((
                        0,
                        Record::Identity {
                            tgid: job_pid(index, pid),
                            identity: Box::new(RankIdentity::from_environ(environ.as_bytes())),
                        },
                    ));
                }
            }
            Some(TrackView::Thread { pid, tid }) => {
                if let Some(uuid) = packet.track_uuid() {
                    threads.insert(uuid, (pid, tid));
                }
                switches.thread(pid, tid);
            }
            Some(TrackView::Other {
                parent: Some(parent),
                name: Some(name),
            }) => {
                if let (Some(uuid), Some(&pid)) = (packet.track_uuid(), processes.get(&parent)) {
                    streams.insert(uuid, (pid, stream_name(&name).to_owned()));
                }
            }
            _ => {}
        }
        let Some(event) = interning.event(&packet) else {
            continue;
        };
        if let Some((pid, stream)) = streams.get(&event.track) {
            let begun = work.entry(event.track).or_default();
            match event.kind {
                EventKind::Begin => begun.push((
                    event.ts,
                    event.name.unwrap_or("").to_owned(),
                    match event.arg(WORK_KIND_ARG) {
                        Some(ArgRef::Str(k)) => work_kind_of(k),
                        _ => None,
                    },
                )),
                EventKind::End => {
                    if let Some((start, name, Some(kind))) = begun.pop() {
                        device.work.push(DeviceWork {
                            track: StreamTrack {
                                tgid: job_pid(index, *pid),
                                name: stream.clone(),
                                estimated: kind == WorkKind::Estimated,
                            },
                            kind,
                            start,
                            end: event.ts,
                            name,
                            fields: Vec::new(),
                            flows: packet.flows(),
                        });
                    }
                }
                _ => {}
            }
            continue;
        }
        if let Some(&pid) = processes.get(&event.track) {
            if let Some(exit) = process_exit(&event, job_pid(index, pid)) {
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
        let Some(&(pid, tid)) = threads.get(&event.track) else {
            continue;
        };
        if event.kind == EventKind::Instant
            && event
                .name
                .is_some_and(|n| n.starts_with(PREEMPTED_BY_EVENT))
            && let (Some(by_pid), Some(ArgRef::Str(by_comm))) = (
                event.arg("by_pid").and_then(|v| v.as_u64()),
                event.arg("by_comm"),
            )
        {
            switches.preempted(pid, tid, event.ts, by_pid as u32, by_comm);
            continue;
        }
        let (tgid, tid) = (job_pid(index, pid), job_pid(index, tid));
        if let Some(seen) = step_seen(&event, tgid, tid) {
            out.push((event.ts, Record::StepSeen(seen)));
            continue;
        }
        // Where an API record says this call enqueued device work: the
        // flow to that work starts here.
        if event.kind == EventKind::Begin
            && event.name == Some(ENQUEUED_EVENT)
            && let (Some(correlation), Some(&flow)) = (
                event.arg("correlation_id").and_then(|v| v.as_u64()),
                packet.flows().first(),
            )
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
        match event.kind {
            EventKind::Begin => {
                let call = call_of(&event, tgid, tid, names);
                let site = match (
                    call.as_ref().and_then(|c| c.memory),
                    event.arg("alloc_stack"),
                ) {
                    (Some(MemoryEffect { site: Some(id), .. }), Some(ArgRef::Str(label))) => {
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
                    if c.ret.is_none() {
                        c.ret = Some(0);
                    }
                    device
                        .calls
                        .entry(tid)
                        .or_default()
                        .push((c.start_ts, event.ts));
                    let mut r = DeviceCallRecord::new(c);
                    r.site = site;
                    out.push((event.ts, Record::DeviceCall(Box::new(r))));
                }
            }
            // A failed device allocation (the Perfetto sink's "<function>
            // failed" instant, with the request and the live sites).
            EventKind::Instant if event.arg("requested").is_some() => {
                if let Some(c) = failed_allocation(&event, tgid, tid, names) {
                    out.push((event.ts, Record::DeviceCall(Box::new(c))));
                }
            }
            // A call its thread or process died in (the Perfetto sink marks
            // it at its start): in flight until that death.
            EventKind::Instant if event.arg("unmatched").is_some() => {
                let mut begin = event.clone();
                begin.kind = EventKind::Begin;
                if let Some(c) = call_of(&begin, tgid, tid, names) {
                    open.push(Stuck {
                        call: open_call(c),
                        died: true,
                    });
                }
            }
            _ => {}
        }
    }
    switches.into_records(|p| job_pid(index, p), out);
    device.into_records(out);
    // Calls never ended: in flight when the recording stopped.
    for begun in stacks.into_values().flatten() {
        if let Some(c) = begun.call {
            open.push(Stuck {
                call: open_call(c),
                died: false,
            });
        }
    }
    Ok(last)
}

/// A rank's Python step counter, from the Perfetto sink's `python step N`
/// instant.
fn step_seen(event: &EventView, tgid: u32, tid: u32) -> Option<StepSeen> {
    if event.kind != EventKind::Instant || !event.name?.starts_with(PYTHON_STEP_EVENT) {
        return None;
    }
    let step = event.arg("step")?.as_u64()?;
    // The sink writes one of the known names; anything else reads as the
    // plain `step`.
    let local = match event.arg("local") {
        Some(ArgRef::Str(l)) => STEP_LOCALS.iter().copied().find(|w| *w == l),
        _ => None,
    };
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
fn stream_name(track: &str) -> &str {
    match track.rsplit_once(" #") {
        Some((base, lane)) if !lane.is_empty() && lane.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => track,
    }
}

/// The processes of a trace that have a rank (first pass: the scheduler's
/// switches of their main threads are kept from the trace's start).
fn ranked_pids(path: &Path) -> Result<Vec<i32>> {
    let mut reader = open_trace(path)?;
    let mut pids = Vec::new();
    while let Some(packet) = next_packet(&mut reader, path)? {
        if let Some(TrackView::Process { pid, labels, .. }) = packet.track()
            && labels.iter().any(|l| l.starts_with("rank="))
        {
            pids.push(pid);
        }
    }
    Ok(pids)
}

/// The collective or stream sync a slice's begin (or a died-in-call
/// instant read as one) records, with the communicator arguments.
fn call_of(event: &EventView, tgid: u32, tid: u32, names: &mut Names) -> Option<DeviceCall> {
    let library = library_of(match event.arg("library") {
        Some(ArgRef::Str(s)) => Some(s),
        _ => None,
    });
    let function = names.get(
        event
            .name
            .unwrap_or("")
            .split_whitespace()
            .next()
            .unwrap_or(""),
    );
    let base = |kind: CallKind| DeviceCall {
        library,
        function,
        kind,
        tgid,
        tid,
        start_ts: event.ts,
        end_ts: None,
        args: CallArgs::None,
        ret: None,
        error: false,
        name: function.into(),
        comm: None,
        memory: None,
        site: None,
    };
    if let Some(c) = collective(event) {
        let op = collective_kind(c.op)?;
        let mut d = base(CallKind::Collective(op));
        d.comm = Some(CommContext {
            handle: c.comm.unwrap_or(0),
            id_hash: c.comm_hash,
            rank: c.comm_rank,
            size: c.size,
            seq: c.seq,
            seq_exact: c.seq_exact,
        });
        d.args = CallArgs::Collective(CollectiveArgs {
            op,
            count: None,
            dtype: None,
            bytes: event.arg("bytes").and_then(|v| v.as_u64()),
            red_op: None,
            root: None,
            send: None,
            recv: None,
            comm: c.comm.unwrap_or(0),
            stream: c.stream,
        });
        Some(d)
    } else if sync_stream(event).is_some() {
        Some(base(CallKind::Sync(SyncKind::Stream)))
    } else {
        // Any other call of a catalog library (launches, copies, memory):
        // the main thread's calls frame its steps, and memory calls carry
        // what they added or released at which allocation site.
        event.arg("library")?;
        let kind = library
            .functions()
            .iter()
            .find(|f| f.name == function)?
            .kind;
        let mut d = base(kind);
        let uint = |name: &str| event.arg(name).and_then(|v| v.as_u64());
        if matches!(
            kind,
            CallKind::Mark | CallKind::RangeStart | CallKind::RangeEnd
        ) {
            // The job's step markers date its steps.
            d.args = CallArgs::Marker {
                message: match event.arg("message") {
                    Some(ArgRef::Str(m)) => Some(m.to_string()),
                    _ => None,
                },
                range_id: uint("range_id"),
            };
        }
        if let Some(held) = uint("device_bytes_held") {
            d.memory = Some(MemoryEffect {
                device: Device {
                    vendor: library.vendor(),
                    index: uint("device").unwrap_or(0) as u32,
                },
                delta: match event.arg("device_bytes_delta") {
                    Some(ArgRef::Int(v)) => v,
                    Some(v) => v.as_u64().and_then(|v| i64::try_from(v).ok()).unwrap_or(0),
                    None => 0,
                },
                held_after: held,
                failed_request: None,
                untracked: false,
                site: uint("alloc_site"),
            });
        }
        if let Some(ArgRef::Int(r)) = event.arg("return") {
            d.ret = Some(r);
        }
        d.error = event.arg("error").is_some();
        Some(d)
    }
}

/// A failed device allocation read back from its instant: the request,
/// what the device held, the allocating stack and the largest live sites
/// (as labels: the trace keeps the frames on the instant's callstack).
fn failed_allocation(
    event: &EventView,
    tgid: u32,
    tid: u32,
    names: &mut Names,
) -> Option<DeviceCallRecord> {
    let function = names.get(event.name?.strip_suffix(" failed")?);
    let library = Library::ALL
        .into_iter()
        .find(|l| l.functions().iter().any(|f| f.name == function))?;
    let uint = |name: &str| event.arg(name).and_then(|v| v.as_u64());
    let text = |name: &str| match event.arg(name) {
        Some(ArgRef::Str(s)) => Some(s.to_string()),
        _ => None,
    };
    let device = Device {
        vendor: library.vendor(),
        index: uint("device").unwrap_or(0) as u32,
    };
    let site = |label: String| {
        (label != "(unknown)").then(|| {
            Arc::new(Site {
                id: 0,
                tgid,
                frames: Vec::new(),
                label,
            })
        })
    };
    let mut rows = Vec::new();
    for n in 1.. {
        let Some(bytes) = uint(&format!("live_sites.{n}.bytes")) else {
            break;
        };
        rows.push(LiveSiteRow {
            device,
            bytes,
            allocations: uint(&format!("live_sites.{n}.allocations")).unwrap_or(0),
            site: text(&format!("live_sites.{n}.stack")).and_then(site),
        });
    }
    let ret = match event.arg("return") {
        Some(ArgRef::Int(v)) => Some(v),
        Some(v) => v.as_u64().and_then(|v| i64::try_from(v).ok()),
        None => None,
    };
    let call = DeviceCall {
        library,
        function,
        kind: library
            .functions()
            .iter()
            .find(|f| f.name == function)
            .map(|f| f.kind)?,
        tgid,
        tid,
        start_ts: event.ts,
        end_ts: Some(event.ts),
        args: CallArgs::None,
        ret,
        error: true,
        name: function.into(),
        comm: None,
        memory: Some(MemoryEffect {
            device,
            delta: 0,
            held_after: uint("device_bytes_held").unwrap_or(0),
            failed_request: uint("requested"),
            untracked: false,
            site: None,
        }),
        site: None,
    };
    let mut r = DeviceCallRecord::new(call);
    r.site = text("stack").and_then(site);
    r.oom = Some(rows);
    Some(r)
}

fn open_call(c: DeviceCall) -> OpenCall {
    OpenCall {
        tgid: c.tgid,
        tid: c.tid,
        library: c.library,
        function: c.function,
        kind: c.kind,
        start_ts: c.start_ts,
        comm: c.comm,
        thread: ThreadNow::Unknown,
    }
}

/// A call that never returned: open when the trace ended, or running when
/// its thread or process died.
struct Stuck {
    call: OpenCall,
    died: bool,
}

/// A process's end, from its process track's exit instant (the Perfetto
/// sink's [`PROCESS_EXIT_EVENT`]).
fn process_exit(event: &EventView, tgid: u32) -> Option<Exit> {
    if event.kind != EventKind::Instant || !event.name?.starts_with(PROCESS_EXIT_EVENT) {
        return None;
    }
    let int = |name: &str| match event.arg(name)? {
        ArgRef::Int(v) => Some(v),
        ArgRef::Uint(v) => i64::try_from(v).ok(),
        _ => None,
    };
    let comm = match event.arg("comm") {
        Some(ArgRef::Str(s)) => offcpu::comm(s),
        _ => offcpu::comm(""),
    };
    Some(Exit {
        cpu: 0,
        ts: event.ts,
        tid: int("tid").map_or(tgid, |t| (tgid & !0x3f_ffff) | (t as u32 & 0x3f_ffff)),
        tgid,
        prio: 0,
        comm,
        group_dead: true,
        group_known: true,
        exit_code: int("exit_code").and_then(|c| i32::try_from(c).ok()),
    })
}

/// Every trace through the detectors: the findings, most important first.
pub fn diagnose(traces: &[PathBuf], cfg: DetectConfig) -> Result<Vec<Finding>> {
    let mut names = Names::default();
    let mut records = Vec::new();
    let mut open = Vec::new();
    let mut end = 0;
    for (i, path) in traces.iter().enumerate() {
        end = end.max(read_trace(i, path, &mut names, &mut records, &mut open)?);
    }
    // The calls that never returned, as the snapshots the live agent takes
    // of what runs (once a second, from when the oldest is past the hang
    // timeout): each holds the calls begun by then and not yet ended, a
    // call ending when its process died (or with the trace). Their age
    // against the timeout decides, as it would live.
    let until = |s: &Stuck| -> u64 {
        if !s.died {
            return end;
        }
        records
            .iter()
            .filter_map(|(ts, r)| match r {
                Record::Exit { exit, .. } if exit.tgid == s.call.tgid && *ts >= s.call.start_ts => {
                    Some(*ts)
                }
                _ => None,
            })
            .min()
            .unwrap_or(end)
    };
    let stuck: Vec<(OpenCall, u64)> = open
        .into_iter()
        .map(|s| {
            let u = until(&s);
            (s.call, u)
        })
        .collect();
    let timeout = cfg.hang_timeout.as_nanos() as u64;
    if let (Some(oldest), Some(last)) = (
        stuck.iter().map(|(c, _)| c.start_ts).min(),
        stuck.iter().map(|(_, u)| *u).max(),
    ) {
        let mut at = oldest.saturating_add(timeout);
        let mut snapshots = 0u64;
        while at < last {
            let calls: Vec<OpenCall> = stuck
                .iter()
                .filter(|(c, u)| c.start_ts <= at && *u > at)
                .map(|(c, _)| c.clone())
                .collect();
            if !calls.is_empty() {
                records.push((
                    at,
                    Record::InFlight(Box::new(InFlightSnapshot {
                        ts: at,
                        calls,
                        main_threads: Vec::new(),
                    })),
                ));
            }
            // A second apart, as live; further apart past an hour of them.
            snapshots += 1;
            at += OFFLINE_TICK_NS * (1 + snapshots / 3600);
        }
    }
    // Identities first (time 0), then calls as they returned.
    records.sort_by_key(|r| r.0);
    let mut d = Detectors::new(cfg);
    let mut found = Vec::new();
    for (ts, r) in &records {
        d.record(r, &mut found);
        if matches!(r, Record::InFlight(_)) {
            d.tick(*ts, &mut found);
        }
    }
    d.finish(end, &mut found);
    found.sort_by_key(|f| (importance(f.kind), f.start_ns));
    Ok(found)
}

/// What to look at first: what stopped the job, then what slowed it.
fn importance(kind: FindingKind) -> u8 {
    match kind {
        FindingKind::Hang => 0,
        FindingKind::Crash => 1,
        FindingKind::DeviceOom => 2,
        FindingKind::SlowRank => 3,
        FindingKind::SlowLink => 4,
        FindingKind::HostContention => 5,
        FindingKind::DataloaderStall => 6,
        FindingKind::MemoryLeak => 7,
        FindingKind::LateArrival => 8,
    }
}

pub fn run(opts: &DiagnoseOptions) -> Result<usize> {
    let found = diagnose(&opts.traces, opts.detect.clone())?;
    if found.is_empty() {
        println!("no findings in {} trace(s)", opts.traces.len());
    }
    for f in &found {
        println!("{}", f.headline());
        println!("    evidence: {}", f.evidence);
    }
    if let Some(path) = &opts.json {
        let json = serde_json::to_string_pretty(&FindingsDoc::new(&found))?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(found.len())
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
