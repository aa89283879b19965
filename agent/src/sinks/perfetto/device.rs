//! Device records on the trace: one slice per call on the calling thread's
//! track (named as the decoder names it, arguments as debug annotations),
//! device memory counters per (process, device), failed allocations and
//! memory still held as instants with their allocation sites, device work on
//! per-stream tracks (on lanes, so slices nest) with flows from the host,
//! and each process's rank identity as process labels.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;

use anyhow::Result;
use xpuscope_perfetto::{Arg, ArgValue, CounterUnit, Frame, TrackUuid};
use xpuscope_probes::catalog::{CallKind, SyncKind, Vendor};
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::{DeviceCall, OpenReason};

use super::{PerfettoSink, args};
use crate::model::{
    CallSummary, DeviceCallRecord, DeviceWork, EnqueueMarker, InFlightCall, LiveSiteRow,
    MemoryHeld, RankIdentity, Site, StreamTrack, WorkKind, site_label,
};

/// Tracks written for device records, per process.
#[derive(Default)]
pub struct DeviceTracks {
    memory: HashMap<(u32, Vendor, u32), TrackUuid>,
    /// Process tracks written, with the rank identity as labels.
    pub(super) processes: HashMap<u32, TrackUuid>,
    /// Lane tracks of each device stream and where each lane's last slice
    /// ends.
    lanes: HashMap<StreamTrack, Vec<(TrackUuid, u64)>>,
    /// Callstack frames of allocation sites, converted once.
    site_frames: HashMap<u64, (u32, Arc<[Frame]>)>,
    /// Thread tracks of calling threads, described once (a descriptor per
    /// call was a third of a device-heavy trace's packets).
    threads: HashMap<u32, TrackUuid>,
}

impl DeviceTracks {
    /// A process ended: its tracks were written; its pid may come back.
    pub fn process_ended(&mut self, tgid: u32) {
        self.memory.retain(|k, _| k.0 != tgid);
        self.processes.remove(&tgid);
        self.lanes.retain(|k, _| k.tgid != tgid);
        self.site_frames.retain(|_, (t, _)| *t != tgid);
    }

    /// A thread exited: its tid may come back in another process.
    pub fn thread_ended(&mut self, tid: u32) {
        self.threads.remove(&tid);
    }
}

/// The argument naming a piece of device work's kind.
pub const WORK_KIND_ARG: &str = "work";
/// The name of the zero-length slice marking where a host call enqueued
/// device work (an API record).
pub const ENQUEUED_EVENT: &str = "device work enqueued";

pub fn work_kind_name(kind: WorkKind) -> &'static str {
    match kind {
        WorkKind::Compute => "compute",
        WorkKind::Copy => "copy",
        WorkKind::Communication => "communication",
        WorkKind::Estimated => "estimated",
        WorkKind::Other => "other",
    }
}

pub fn work_kind_of(name: &str) -> Option<WorkKind> {
    Some(match name {
        "compute" => WorkKind::Compute,
        "copy" => WorkKind::Copy,
        "communication" => WorkKind::Communication,
        "estimated" => WorkKind::Estimated,
        "other" => WorkKind::Other,
        _ => return None,
    })
}

/// The lane for work starting at `start` given each lane's last end: the
/// first lane free by then, or a new one (`ends.len()`).
fn pick_lane(ends: &[u64], start: u64) -> usize {
    ends.iter().position(|&e| e <= start).unwrap_or(ends.len())
}

fn call_args(call: &DeviceCall) -> Vec<Arg> {
    let mut a = vec![Arg::new(
        "library",
        ArgValue::Str(call.library.name().into()),
    )];
    let mut push = |name: &str, v: ArgValue| a.push(Arg::new(name, v));
    match &call.args {
        CallArgs::Collective(c) => {
            if let Some(b) = c.bytes {
                push("bytes", ArgValue::Uint(b));
            }
            if let Some(n) = c.count {
                push("count", ArgValue::Uint(n));
            }
            if let Some(t) = c.dtype {
                push("dtype", ArgValue::Str(t.to_string()));
            }
            if let Some(op) = c.red_op {
                push("op", ArgValue::Str(op.to_string()));
            }
            if let Some(r) = c.root {
                push("root", ArgValue::Int(r.into()));
            }
            if let Some(s) = c.stream {
                push("stream", ArgValue::Pointer(s));
            }
        }
        CallArgs::SendRecv(s) => {
            if let Some(b) = s.bytes {
                push("bytes", ArgValue::Uint(b));
            }
            push("count", ArgValue::Uint(s.count));
            push("dtype", ArgValue::Str(s.dtype.to_string()));
            push("peer", ArgValue::Int(s.peer.into()));
            if let Some(st) = s.stream {
                push("stream", ArgValue::Pointer(st));
            }
        }
        CallArgs::CommInit(i) => {
            if let Some(n) = i.nranks {
                push("nranks", ArgValue::Uint(n.into()));
            }
            if let Some(r) = i.rank {
                push("init_rank", ArgValue::Uint(r.into()));
            }
            if let Some(h) = i.id_hash {
                push("id_hash", ArgValue::Str(format!("{h:016x}")));
            }
        }
        CallArgs::Malloc(m) => {
            push("bytes", ArgValue::Uint(m.size));
            if let Some(p) = m.ptr {
                push("ptr", ArgValue::Pointer(p));
            }
            if let Some(s) = m.stream {
                push("stream", ArgValue::Pointer(s));
            }
        }
        CallArgs::Free { ptr, stream } => {
            push("ptr", ArgValue::Pointer(*ptr));
            if let Some(s) = stream {
                push("stream", ArgValue::Pointer(*s));
            }
        }
        CallArgs::SetDevice { device } => push("device", ArgValue::Int((*device).into())),
        CallArgs::Memcpy(m) => {
            push("bytes", ArgValue::Uint(m.bytes));
            push("kind", ArgValue::Str(format!("{:?}", m.kind)));
            if let Some(s) = m.stream {
                push("stream", ArgValue::Pointer(s));
            }
        }
        CallArgs::Memset {
            ptr,
            value,
            bytes,
            stream,
        } => {
            push("ptr", ArgValue::Pointer(*ptr));
            push("value", ArgValue::Int((*value).into()));
            push("bytes", ArgValue::Uint(*bytes));
            if let Some(s) = stream {
                push("stream", ArgValue::Pointer(*s));
            }
        }
        CallArgs::Launch(l) => {
            push("func", ArgValue::Pointer(l.func));
            let dims = |d: [u32; 3]| format!("({},{},{})", d[0], d[1], d[2]);
            if let Some(g) = l.grid {
                push("grid", ArgValue::Str(dims(g)));
            }
            if let Some(b) = l.block {
                push("block", ArgValue::Str(dims(b)));
            }
            if let Some(n) = l.blocks {
                push("blocks", ArgValue::Uint(n.into()));
            }
            if let Some(m) = l.shared_mem {
                push("shared_mem", ArgValue::Uint(m));
            }
            if let Some(s) = l.stream {
                push("stream", ArgValue::Pointer(s));
            }
        }
        CallArgs::Graph { exec, stream } => {
            push("graph_exec", ArgValue::Pointer(*exec));
            if let Some(s) = stream {
                push("stream", ArgValue::Pointer(*s));
            }
        }
        CallArgs::Sync { stream, event } => {
            // What it waits for: readers (`agent merge`) find the syncs by it.
            let what = match call.kind {
                CallKind::Sync(SyncKind::Stream) => "stream",
                CallKind::Sync(SyncKind::Device) => "device",
                CallKind::Sync(SyncKind::Event) => "event",
                _ => "other",
            };
            push("sync", ArgValue::Str(what.into()));
            if let Some(s) = stream {
                push("stream", ArgValue::Pointer(*s));
            }
            if let Some(e) = event {
                push("event", ArgValue::Pointer(*e));
            }
        }
        CallArgs::EventRecord { event, stream } => {
            push("event", ArgValue::Pointer(*event));
            if let Some(s) = stream {
                push("stream", ArgValue::Pointer(*s));
            }
        }
        CallArgs::StreamWaitEvent { stream, event } => {
            push("stream", ArgValue::Pointer(*stream));
            push("event", ArgValue::Pointer(*event));
        }
        CallArgs::HostFunc { stream, func } => {
            push("stream", ArgValue::Pointer(*stream));
            push("func", ArgValue::Pointer(*func));
        }
        CallArgs::CommEnd { comm } => push("comm", ArgValue::Pointer(*comm)),
        CallArgs::CommQuery { comm, value } => {
            push("comm", ArgValue::Pointer(*comm));
            if let Some(v) = value {
                push("value", ArgValue::Uint((*v).into()));
            }
        }
        CallArgs::UniqueId { id_hash } => {
            if let Some(h) = id_hash {
                push("id_hash", ArgValue::Str(format!("{h:016x}")));
            }
        }
        CallArgs::ActivityEnable { kind } => push("activity_kind", ArgValue::Uint((*kind).into())),
        CallArgs::ClockSample { timestamp } => {
            if let Some(t) = timestamp {
                push("timestamp", ArgValue::Uint(*t));
            }
        }
        CallArgs::Marker { message, range_id } => {
            if let Some(m) = message {
                push("message", ArgValue::Str(m.clone()));
            }
            if let Some(r) = range_id {
                push("range_id", ArgValue::Uint(*r));
            }
        }
        CallArgs::None => {}
    }
    if let Some(c) = &call.comm {
        push("comm", ArgValue::Pointer(c.handle));
        if let Some(h) = c.id_hash {
            push("comm_hash", ArgValue::Str(format!("{h:016x}")));
        }
        if let Some(r) = c.rank {
            push("rank", ArgValue::Uint(r.into()));
        }
        if let Some(s) = c.size {
            push("size", ArgValue::Uint(s.into()));
        }
        if let Some(s) = c.seq {
            push("seq", ArgValue::Uint(s));
            push("seq_exact", ArgValue::Bool(c.seq_exact));
        }
    }
    if let Some(m) = &call.memory {
        push("device", ArgValue::Uint(m.device.index.into()));
        push("device_bytes_held", ArgValue::Uint(m.held_after));
        // What the call added or released, and at which allocation site:
        // `agent diagnose` rebuilds each site's live bytes from these.
        if m.delta != 0 {
            push("device_bytes_delta", ArgValue::Int(m.delta));
        }
        if let Some(site) = m.site {
            push("alloc_site", ArgValue::Uint(site));
        }
    }
    if let Some(r) = call.ret {
        push("return", ArgValue::Int(r));
    }
    if call.error {
        push("error", ArgValue::Int(call.ret.unwrap_or(0)));
    }
    a
}

fn slice_name(call: &DeviceCall) -> String {
    if call.error {
        format!("{} [error {}]", call.name, call.ret.unwrap_or(0))
    } else {
        call.name.clone()
    }
}

/// Annotations naming `rows` (largest first) under `prefix`:
/// `prefix.1.bytes`, `prefix.1.allocations`, `prefix.1.stack`, ...
/// (dotted names nest in the UI's argument view).
fn site_annotations(prefix: &str, rows: &[LiveSiteRow]) -> Vec<Arg> {
    let mut args = Vec::with_capacity(rows.len() * 3);
    for (i, r) in rows.iter().enumerate() {
        let n = i + 1;
        args.push(Arg::new(
            format!("{prefix}.{n}.bytes"),
            ArgValue::Uint(r.bytes),
        ));
        args.push(Arg::new(
            format!("{prefix}.{n}.allocations"),
            ArgValue::Uint(r.allocations),
        ));
        args.push(Arg::new(
            format!("{prefix}.{n}.stack"),
            ArgValue::Str(site_label(r.site.as_ref())),
        ));
    }
    args
}

impl<W: Write> PerfettoSink<W> {
    /// The process's track, written once with its rank identity (a later
    /// descriptor without them would replace the labels).
    pub(super) fn identity(&mut self, tgid: u32, id: &RankIdentity) -> Result<()> {
        if !self.device.processes.contains_key(&tgid) {
            let t = self.writer.process_track(
                tgid as i32,
                &id.name().unwrap_or_default(),
                &id.labels(),
            )?;
            self.device.processes.insert(tgid, t);
        }
        Ok(())
    }

    pub(super) fn device_process_track(&mut self, tgid: u32) -> Result<TrackUuid> {
        if let Some(t) = self.device.processes.get(&tgid) {
            return Ok(*t);
        }
        self.identity(tgid, &RankIdentity::default())?;
        Ok(self.device.processes[&tgid])
    }

    /// The track of a thread calling device libraries, described once. An
    /// empty name: track names outrank scheduler names in the importer.
    fn calling_thread(&mut self, tgid: u32, tid: u32) -> Result<TrackUuid> {
        if let Some(t) = self.device.threads.get(&tid) {
            return Ok(*t);
        }
        let t = self.writer.thread_track(tgid as i32, tid as i32, "")?;
        self.device.threads.insert(tid, t);
        Ok(t)
    }

    /// The callstack frames of an allocation site.
    fn site_frames(&mut self, site: Option<&Arc<Site>>) -> Option<Arc<[Frame]>> {
        let site = site?;
        if site.frames.is_empty() {
            return None;
        }
        if let Some((_, f)) = self.device.site_frames.get(&site.id) {
            return Some(f.clone());
        }
        let frames: Arc<[Frame]> = site.frames.iter().map(|f| self.frames.frame(f)).collect();
        self.device
            .site_frames
            .insert(site.id, (site.tgid, frames.clone()));
        Some(frames)
    }

    pub(super) fn device_call(&mut self, r: &DeviceCallRecord) -> Result<()> {
        let call = &r.call;
        let track = self.calling_thread(call.tgid, call.tid)?;
        if let Some(reason) = r.unmatched {
            let mut args = call_args(call);
            args.push(Arg::new("unmatched", ArgValue::Str(format!("{reason:?}"))));
            let why = match reason {
                OpenReason::ProcessExited => "running when its process died",
                OpenReason::ThreadExited => "running when its thread died",
                _ => "no return",
            };
            self.writer.instant(
                track,
                call.start_ts,
                &format!("{} ({why})", call.name),
                &args,
                None,
            )?;
            return Ok(());
        }
        let mut args = call_args(call);
        if call.memory.as_ref().is_some_and(|m| m.delta > 0) && r.site.is_some() {
            // The site's name on every allocation (a dump of a window may
            // not hold the site's first one).
            args.push(Arg::new(
                "alloc_stack",
                ArgValue::Str(site_label(r.site.as_ref())),
            ));
        }
        let end = r.end_ts();
        let stack = self.site_frames(r.site.as_ref());
        self.writer.slice_begin(
            track,
            call.start_ts,
            &slice_name(call),
            Some("device"),
            &args,
            &r.flows,
            stack.as_deref(),
        )?;
        self.writer.slice_end(track, end, &[])?;
        if call.memory.is_some() {
            self.memory_effect(r, track, end)?;
        }
        Ok(())
    }

    fn memory_effect(&mut self, r: &DeviceCallRecord, thread: TrackUuid, ts: u64) -> Result<()> {
        let call = &r.call;
        let Some(m) = &call.memory else {
            return Ok(());
        };
        let key = (call.tgid, m.device.vendor, m.device.index);
        let counter = match self.device.memory.get(&key) {
            Some(t) => *t,
            None => {
                let process = self.device_process_track(call.tgid)?;
                let t = self.writer.counter_track(
                    Some(process),
                    &format!("device memory dev{}", m.device.index),
                    CounterUnit::SizeBytes,
                )?;
                self.device.memory.insert(key, t);
                t
            }
        };
        self.writer.counter(counter, ts, m.held_after as f64)?;
        if let (Some(req), Some(live)) = (m.failed_request, &r.oom) {
            let mut args = vec![
                Arg::new("requested", ArgValue::Uint(req)),
                Arg::new("device_bytes_held", ArgValue::Uint(m.held_after)),
                Arg::new("device", ArgValue::Uint(m.device.index.into())),
                Arg::new("return", ArgValue::Int(call.ret.unwrap_or(0))),
                Arg::new("stack", ArgValue::Str(site_label(r.site.as_ref()))),
            ];
            args.extend(site_annotations("live_sites", live));
            let stack = self.site_frames(r.site.as_ref());
            self.writer.instant(
                thread,
                ts,
                &format!("{} failed", call.function),
                &args,
                stack.as_deref(),
            )?;
        }
        Ok(())
    }

    /// Device memory still held, by site, as an instant on the process track.
    pub(super) fn memory_held(&mut self, m: &MemoryHeld) -> Result<()> {
        let mut args = vec![Arg::new("device_bytes_held", ArgValue::Uint(m.held))];
        args.extend(site_annotations("live_sites", &m.rows));
        let stack = self.site_frames(m.rows.first().and_then(|r| r.site.as_ref()));
        let track = self.device_process_track(m.tgid)?;
        self.writer.instant(
            track,
            m.ts,
            &format!("device memory held {}", m.at.describe()),
            &args,
            stack.as_deref(),
        )?;
        Ok(())
    }

    /// Calls past the flood rate: one slice over their window, named with
    /// their count.
    pub(super) fn calls_summarized(&mut self, s: &CallSummary) -> Result<()> {
        let track = self.calling_thread(s.tgid, s.tid)?;
        let mut args = vec![
            Arg::new("calls", ArgValue::Uint(s.calls)),
            Arg::new("busy_ns", ArgValue::Uint(s.busy_ns)),
            Arg::new("rate_limited", ArgValue::Bool(true)),
        ];
        for (_, function, n) in &s.functions {
            args.push(Arg::new(format!("calls.{function}"), ArgValue::Uint(*n)));
        }
        let name = match s.functions.as_slice() {
            [(_, function, _)] => format!("{function} x{} (rate-limited)", s.calls),
            _ => format!("{} device calls (rate-limited)", s.calls),
        };
        self.writer
            .slice_begin(track, s.start, &name, Some("device"), &args, &[], None)?;
        self.writer.slice_end(track, s.end, &[])?;
        Ok(())
    }

    pub(super) fn in_flight_at_end(&mut self, c: &InFlightCall) -> Result<()> {
        let track = self.writer.thread_track(c.tgid as i32, c.tid as i32, "")?;
        let mut args = vec![
            Arg::new("started", ArgValue::Uint(c.start_ts)),
            Arg::new("open_ns", ArgValue::Uint(c.end.saturating_sub(c.start_ts))),
        ];
        if let Some(s) = c.seq {
            args.push(Arg::new("seq", ArgValue::Uint(s)));
        }
        self.writer.instant(
            track,
            c.end,
            &format!("{} (in flight at end)", c.function),
            &args,
            None,
        )?;
        Ok(())
    }

    /// A zero-length slice on the host thread where an API record says it
    /// enqueued device work; the flow to the work starts here.
    pub(super) fn enqueued(&mut self, m: &EnqueueMarker) -> Result<()> {
        let t = self.writer.thread_track(m.tgid as i32, m.tid as i32, "")?;
        let args = [Arg::new("correlation_id", ArgValue::Uint(m.correlation))];
        self.writer.slice_begin(
            t,
            m.ts,
            ENQUEUED_EVENT,
            Some("device"),
            &args,
            &[m.flow],
            None,
        )?;
        self.writer.slice_end(t, m.ts, &[])?;
        Ok(())
    }

    /// Device work on its stream's track, on the first lane free by its
    /// start so slices nest.
    pub(super) fn device_work(&mut self, w: &DeviceWork) -> Result<()> {
        let key = &w.track;
        let parent = self.device_process_track(key.tgid)?;
        let lanes = self.device.lanes.entry(key.clone()).or_default();
        let ends: Vec<u64> = lanes.iter().map(|(_, e)| *e).collect();
        let lane = pick_lane(&ends, w.start);
        if lane == lanes.len() {
            let name = if lane == 0 {
                key.name.clone()
            } else {
                format!("{} #{}", key.name, lane + 1)
            };
            let desc = if key.estimated {
                "estimated: from a launch to the next sync of its stream (no activity records)"
            } else {
                "device work from activity records"
            };
            let t = self.writer.custom_track(Some(parent), &name, Some(desc))?;
            lanes.push((t, 0));
        }
        let (track, last_end) = &mut lanes[lane];
        *last_end = w.end;
        let track = *track;
        let mut args = args(&w.fields);
        // What the work is (a communication kernel or the model's own):
        // `agent diagnose` judges device time from it.
        args.push(Arg::new(
            WORK_KIND_ARG,
            ArgValue::Str(work_kind_name(w.kind).into()),
        ));
        self.writer
            .slice_begin(track, w.start, &w.name, Some("device"), &args, &[], None)?;
        self.writer.slice_end(track, w.end, &w.flows)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_keep_slices_nested() {
        assert_eq!(pick_lane(&[], 5), 0);
        assert_eq!(pick_lane(&[10], 10), 0);
        assert_eq!(pick_lane(&[10], 9), 1);
        assert_eq!(pick_lane(&[10, 4], 9), 1);
    }
}
