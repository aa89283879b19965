//! Device-library calls on the trace: one slice per call on the calling
//! thread's track (named as the decoder names it, arguments as debug
//! annotations), device memory counters per (process, device), failed
//! allocations as instants, and each process's rank identity as process
//! labels.

mod sites;
mod streams;

use std::collections::HashMap;
use std::io::Write;

use anyhow::Result;
pub use sites::SiteReport;
use sites::{AllocSites, TOP_SITES};
use streams::{CollectiveView, DeviceStreams, HeldCall, HostCall, OpenWindow, StreamKey, Work};
use xpuscope_common::uprobe::{UprobeEntry, UprobeReturn};
use xpuscope_perfetto::{Arg, ArgValue, CounterUnit, TrackUuid};
use xpuscope_probes::activity::names::RemoteStrings;
use xpuscope_probes::activity::{ActivityDetail, ActivityKind};
use xpuscope_probes::catalog::{CallKind, LaunchKind, SyncKind, Vendor};
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::memory::{LiveSite, MemoryEffect};
use xpuscope_probes::decode::{ActivityEvent, Decoded, Decoder, DeviceCall, Unmatched};

use super::TraceBuilder;
use crate::events::CallStack;
use crate::kernel::probes::TableUpdate;

/// What the device decoding saw; the summary (and its JSON) shows it as is.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct DeviceStats {
    /// Calls recorded (entry and return paired).
    pub calls: u64,
    /// Calls that returned an error status.
    pub errors: u64,
    #[serde(rename = "activity_records")]
    pub activities: u64,
    /// Activity records the application read that the probe could not
    /// copy, and those that did not decode: their device work is missing.
    pub activity_unread: u64,
    pub activity_errors: u64,
    /// Entries whose return never came (lost, or the thread exited).
    pub entries_without_return: u64,
    /// Returns whose entry was not seen (attached mid-call, or lost).
    pub returns_without_entry: u64,
    /// Records at an address no probe is known at.
    pub unknown_probes: u64,
    /// Calls still open when the recording ended.
    pub in_flight_at_end: u64,
    /// Slices on device-stream tracks from activity records.
    pub device_slices: u64,
    /// Estimated device slices (streams without activity records).
    pub estimated_slices: u64,
    /// Flows from host launches to their device work.
    pub device_flows: u64,
    /// Device-memory allocations that failed (an OOM), each marked in the
    /// trace with its stack and the largest live allocation sites.
    pub failed_allocations: u64,
    /// Allocating stacks taken, and those the kernel could not take.
    pub alloc_stacks: u64,
    pub alloc_stack_errors: u64,
    /// Allocating stacks not given a site (too many distinct sites).
    #[serde(skip)]
    pub alloc_sites_over_limit: u64,
}

/// Calls of one probed function, for the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FunctionCalls {
    pub library: &'static str,
    pub function: &'static str,
    /// Entries the kernel counted (its probe's hits).
    pub hits: u64,
    /// Calls decoded into the trace (entry and return paired).
    pub calls: u64,
    pub errors: u64,
}

pub struct DeviceTrace {
    decoder: Decoder,
    memory_tracks: HashMap<(u32, Vendor, u32), TrackUuid>,
    /// Process tracks written, with the rank identity as labels.
    process_tracks: HashMap<u32, TrackUuid>,
    out: Vec<Decoded>,
    /// Device-stream tracks (activity records, estimates).
    streams: DeviceStreams,
    /// Kernel names read from the applications.
    strings: RemoteStrings,
    /// Allocating stacks, interned.
    sites: AllocSites,
    /// Largest live allocation sites of processes that exited or were
    /// still running at the end.
    pub site_reports: Vec<SiteReport>,
    /// (library, function) -> (calls, errors).
    pub by_function: HashMap<(&'static str, &'static str), (u64, u64)>,
    pub stats: DeviceStats,
}

impl Default for DeviceTrace {
    fn default() -> Self {
        Self {
            decoder: Decoder::new(Default::default()),
            memory_tracks: HashMap::new(),
            process_tracks: HashMap::new(),
            out: Vec::new(),
            streams: DeviceStreams::default(),
            strings: RemoteStrings::default(),
            sites: AllocSites::default(),
            site_reports: Vec::new(),
            by_function: HashMap::new(),
            stats: DeviceStats::default(),
        }
    }
}

/// Rank identity from a process's environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankIdentity {
    pub rank: Option<String>,
    pub local_rank: Option<String>,
    pub world_size: Option<String>,
    pub job: Option<String>,
}

impl RankIdentity {
    pub fn from_environ(environ: &[u8]) -> Self {
        let mut id = Self::default();
        let mut job_name = None;
        for var in environ.split(|&b| b == 0) {
            let Ok(var) = std::str::from_utf8(var) else {
                continue;
            };
            let Some((k, v)) = var.split_once('=') else {
                continue;
            };
            let v = Some(v.chars().take(128).collect::<String>());
            match k {
                "RANK" => id.rank = v,
                "LOCAL_RANK" => id.local_rank = v,
                "WORLD_SIZE" => id.world_size = v,
                "XPUSCOPE_JOB" => id.job = v,
                "JOB_NAME" => job_name = v,
                _ => {}
            }
        }
        if id.job.is_none() {
            id.job = job_name;
        }
        id
    }

    pub fn read(pid: u32) -> Self {
        std::fs::read(format!("/proc/{pid}/environ"))
            .map(|b| Self::from_environ(&b))
            .unwrap_or_default()
    }

    /// "rank 3/8 job sim-x", or None without a rank.
    pub fn name(&self) -> Option<String> {
        let rank = self.rank.as_ref()?;
        let mut s = format!("rank {rank}");
        if let Some(w) = &self.world_size {
            s.push_str(&format!("/{w}"));
        }
        if let Some(j) = &self.job {
            s.push_str(&format!(" job {j}"));
        }
        Some(s)
    }

    pub fn labels(&self) -> Vec<String> {
        let mut labels = Vec::new();
        if let Some(r) = &self.rank {
            labels.push(format!("rank={r}"));
        }
        if let Some(r) = &self.local_rank {
            labels.push(format!("local_rank={r}"));
        }
        if let Some(w) = &self.world_size {
            labels.push(format!("world_size={w}"));
        }
        if let Some(j) = &self.job {
            labels.push(format!("job={j}"));
        }
        labels
    }
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
        CallArgs::None => {}
        other => push("args", ArgValue::Str(format!("{other:?}"))),
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

impl<W: Write> TraceBuilder<W> {
    /// Probes of a process about to be attached: learn what they mean and
    /// label the process with its rank.
    pub fn probes_added(&mut self, update: TableUpdate) -> Result<()> {
        self.symbolizer.remember_maps(update.tgid, update.maps);
        let table = self.device.decoder.probes_mut();
        for (ip, slot, target) in update.probes {
            table.insert(update.tgid, ip, target);
            table.insert_slot(slot, target);
        }
        if !self.device.process_tracks.contains_key(&update.tgid) {
            let t = self.writer.process_track(
                update.tgid as i32,
                &update.identity.name().unwrap_or_default(),
                &update.identity.labels(),
            )?;
            self.device.process_tracks.insert(update.tgid, t);
        }
        Ok(())
    }

    /// The process's track, written once with its rank identity (a later
    /// descriptor without them would replace the labels).
    fn device_process_track(&mut self, tgid: u32) -> Result<TrackUuid> {
        if let Some(t) = self.device.process_tracks.get(&tgid) {
            return Ok(*t);
        }
        let id = RankIdentity::default();
        let name = id.name().unwrap_or_default();
        let t = self
            .writer
            .process_track(tgid as i32, &name, &id.labels())?;
        self.device.process_tracks.insert(tgid, t);
        Ok(t)
    }

    pub(super) fn probe_entry(&mut self, e: &UprobeEntry) -> Result<()> {
        let mut out = std::mem::take(&mut self.device.out);
        self.device.decoder.on_entry(e, &mut out);
        self.emit(&mut out)?;
        self.device.out = out;
        Ok(())
    }

    pub(super) fn probe_return(&mut self, r: &UprobeReturn) -> Result<()> {
        let mut out = std::mem::take(&mut self.device.out);
        self.device.decoder.on_return(r, &mut out);
        self.emit(&mut out)?;
        self.device.out = out;
        Ok(())
    }

    /// The caller's stack as an allocation returns (just before its return
    /// record): interned as a site the call and its bytes are charged to.
    pub(super) fn probe_stack(&mut self, s: &CallStack) -> Result<()> {
        self.device.stats.alloc_stacks += 1;
        let addrs = match &s.user {
            Ok(a) if !a.is_empty() => a,
            _ => {
                self.device.stats.alloc_stack_errors += 1;
                return Ok(());
            }
        };
        let (symbolizer, frames) = (&mut self.symbolizer, &mut self.frames);
        let site = self.device.sites.intern(s.tgid, addrs, || {
            let sym = symbolizer.user_frames(s.tgid, addrs);
            let converted = sym.iter().map(|f| frames.frame(f)).collect();
            (sym, converted)
        });
        self.device.stats.alloc_sites_over_limit = self.device.sites.over_limit;
        if let Some(site) = site {
            self.device
                .decoder
                .on_call_site(s.tgid, s.tid, s.probe_ip, site);
        }
        Ok(())
    }

    /// Process `tgid`'s device memory still held, by allocation site, as an
    /// instant on its process track (`why`: "at exit", "at end of trace")
    /// and in the summary.
    fn report_live_sites(&mut self, tgid: u32, ts: u64, why: &str) -> Result<()> {
        let Some(rows) = self
            .device
            .decoder
            .memory(tgid)
            .map(|m| m.largest_sites(None, TOP_SITES))
        else {
            return Ok(());
        };
        if rows.is_empty() {
            return Ok(());
        }
        let held: u64 = self
            .device
            .decoder
            .memory(tgid)
            .map(|m| m.devices().map(|(_, b)| b).sum())
            .unwrap_or(0);
        let mut args = vec![Arg::new("device_bytes_held", ArgValue::Uint(held))];
        args.extend(self.device.sites.annotations("live_sites", &rows));
        let stack = self.site_frames(rows[0].site);
        let track = self.device_process_track(tgid)?;
        self.writer.instant(
            track,
            ts,
            &format!("device memory held {why}"),
            &args,
            stack.as_deref(),
        )?;
        let reports = self.device.sites.reports(tgid, &rows);
        self.device.site_reports.extend(reports);
        Ok(())
    }

    /// The frames of allocation site `site` (for a callstack).
    fn site_frames(&self, site: Option<u64>) -> Option<Vec<xpuscope_perfetto::Frame>> {
        let frames = &self.device.sites.get(site?)?.frames;
        (!frames.is_empty()).then(|| frames.clone())
    }

    /// A thread (or, for the main thread, the process) exited.
    pub(super) fn device_exited(&mut self, tgid: u32, tid: u32, ts: u64) -> Result<()> {
        let mut out = std::mem::take(&mut self.device.out);
        if tid == tgid {
            self.report_live_sites(tgid, ts, "at exit")?;
            self.device.sites.forget_process(tgid);
            self.release_held(Some(tgid))?;
            let mut keys: Vec<StreamKey> = (self.device.streams.pending.keys())
                .filter(|k| k.tgid == tgid)
                .cloned()
                .collect();
            keys.sort();
            for key in keys {
                self.flush_stream(&key)?;
            }
            self.device.streams.forget_process(tgid);
            self.device.strings.forget_process(tgid);
            self.device.decoder.process_exited(tgid, &mut out);
        } else {
            self.device.streams.current_device.remove(&(tgid, tid));
            self.device.decoder.thread_exited(tgid, tid, &mut out);
        }
        self.emit(&mut out)?;
        self.device.out = out;
        Ok(())
    }

    /// Calls still open at the end: an instant each (a hang shows here).
    pub(super) fn device_finish(&mut self, end: u64) -> Result<()> {
        let open: Vec<_> = self.device.decoder.in_flight().collect();
        for call in open {
            self.device.stats.in_flight_at_end += 1;
            let track = self
                .writer
                .thread_track(call.tgid as i32, call.tid as i32, "")?;
            let mut args = vec![
                Arg::new("started", ArgValue::Uint(call.start_ts)),
                Arg::new("open_ns", ArgValue::Uint(end.saturating_sub(call.start_ts))),
            ];
            if let Some(s) = call.seq {
                args.push(Arg::new("seq", ArgValue::Uint(s)));
            }
            self.writer.instant(
                track,
                end,
                &format!("{} (in flight at end)", call.function),
                &args,
                None,
            )?;
        }
        let mut live: Vec<u32> = self.device.process_tracks.keys().copied().collect();
        live.sort_unstable();
        for tgid in live {
            self.report_live_sites(tgid, end, "at end of trace")?;
        }
        self.release_held(None)?;
        let mut keys: Vec<StreamKey> = self.device.streams.pending.keys().cloned().collect();
        keys.sort();
        for key in keys {
            self.flush_stream(&key)?;
        }
        let s = self.device.decoder.stats();
        self.device.stats.activities = s.activities;
        self.device.stats.unknown_probes = s.unknown_probes;
        self.device.stats.activity_unread = s.activity_unread;
        self.device.stats.activity_errors = s.activity_errors;
        Ok(())
    }

    fn emit(&mut self, out: &mut Vec<Decoded>) -> Result<()> {
        for d in out.drain(..) {
            match d {
                Decoded::Call(call) => self.device_call(&call)?,
                Decoded::Activity(a) => self.device_activity(&a)?,
                Decoded::Unmatched(Unmatched::EntryWithoutReturn { call, reason }) => {
                    self.device.stats.entries_without_return += 1;
                    let track = self
                        .writer
                        .thread_track(call.tgid as i32, call.tid as i32, "")?;
                    let mut args = call_args(&call);
                    args.push(Arg::new("unmatched", ArgValue::Str(format!("{reason:?}"))));
                    self.writer.instant(
                        track,
                        call.start_ts,
                        &format!("{} (no return)", call.name),
                        &args,
                        None,
                    )?;
                }
                Decoded::Unmatched(Unmatched::ReturnWithoutEntry { .. }) => {
                    self.device.stats.returns_without_entry += 1;
                }
                Decoded::Unmatched(Unmatched::UnknownProbe { .. }) => {}
            }
        }
        Ok(())
    }

    fn device_call(&mut self, call: &DeviceCall) -> Result<()> {
        self.device.stats.calls += 1;
        let counts = self
            .device
            .by_function
            .entry((call.library.name(), call.function))
            .or_default();
        counts.0 += 1;
        if call.error {
            self.device.stats.errors += 1;
            counts.1 += 1;
        }
        let end = call.end_ts.unwrap_or(call.start_ts).max(call.start_ts);
        self.estimate(call, end)?;
        // Calls that enqueue device work wait (bounded) for their API
        // record in processes that produce them: it gives the flow id.
        if call.memory.is_none()
            && call.end_ts.is_some()
            && self.device.streams.awaits_api_record(call.tgid, call.kind)
        {
            let held = self.device.streams.held.entry(call.tgid).or_default();
            held.push_back(HeldCall { call: call.clone() });
            if held.len() > streams::MAX_HELD {
                let h = held.pop_front().expect("not empty");
                self.write_call(&h.call, &[])?;
            }
            return Ok(());
        }
        self.write_call(call, &[])
    }

    /// One call as a slice on its thread (with the flow to its device work).
    fn write_call(&mut self, call: &DeviceCall, flow_ids: &[u64]) -> Result<()> {
        // An empty name: track names outrank scheduler names in the importer.
        let track = self
            .writer
            .thread_track(call.tgid as i32, call.tid as i32, "")?;
        let args = call_args(call);
        let end = call.end_ts.unwrap_or(call.start_ts).max(call.start_ts);
        let stack = self.site_frames(call.site);
        self.writer.slice_begin(
            track,
            call.start_ts,
            &slice_name(call),
            Some("device"),
            &args,
            flow_ids,
            stack.as_deref(),
        )?;
        self.writer.slice_end(track, end, &[])?;
        if let Some(m) = &call.memory {
            self.memory_effect(call, m, track, end)?;
        }
        Ok(())
    }

    /// An API record of process `tgid`: the held call of that thread it
    /// lies in gets a flow id (written now, with the flow); held calls of
    /// the thread before it will get none (written now). False when no
    /// held call matches.
    fn api_record(&mut self, tgid: u32, tid: u32, start: u64, end: u64, corr: u64) -> Result<bool> {
        self.device.streams.api_seen.insert(tgid);
        let Some(held) = self.device.streams.held.get_mut(&tgid) else {
            return Ok(false);
        };
        let Some(i) = held.iter().position(|h| {
            h.call.tid == tid && h.call.start_ts <= start && h.call.end_ts.is_some_and(|e| end <= e)
        }) else {
            return Ok(false);
        };
        let mut release = Vec::new();
        let mut k = 0;
        held.retain(|h| {
            let j = k;
            k += 1;
            if j <= i && h.call.tid == tid {
                release.push((j == i, h.call.clone()));
                false
            } else {
                true
            }
        });
        for (matched, call) in release {
            if matched {
                let id = self.device.streams.launch_flow(tgid, corr);
                self.write_call(&call, &[id])?;
            } else {
                self.write_call(&call, &[])?;
            }
        }
        Ok(true)
    }

    /// Writes the held calls of one process, or of all.
    fn release_held(&mut self, tgid: Option<u32>) -> Result<()> {
        let mut keys: Vec<u32> = match tgid {
            Some(t) => vec![t],
            None => self.device.streams.held.keys().copied().collect(),
        };
        keys.sort();
        for t in keys {
            if let Some(held) = self.device.streams.held.remove(&t) {
                for h in held {
                    self.write_call(&h.call, &[])?;
                }
            }
        }
        Ok(())
    }

    /// An activity record: API records are remembered for flows; device
    /// work is buffered for its stream's track.
    fn device_activity(&mut self, e: &ActivityEvent) -> Result<()> {
        let a = &e.activity;
        let ascend = e.library.vendor() == Vendor::Ascend;
        match a.kind {
            ActivityKind::Api => {
                if let (Some(c), ActivityDetail::Api { tid, .. }) = (a.correlation_id, a.detail) {
                    let tid = if tid == 0 { e.tid } else { tid };
                    if self.api_record(e.tgid, tid, a.start, a.end, c)? {
                        return Ok(());
                    }
                    let call = HostCall { tid, ts: a.start };
                    self.device.streams.remember_api(e.tgid, c, call);
                }
                return Ok(());
            }
            ActivityKind::Marker => return Ok(()),
            _ => {}
        }
        if a.stream.is_none() && a.device.is_none() {
            return Ok(());
        }
        self.device.streams.with_activity.insert(e.tgid);
        self.device.streams.work_seen.insert((e.tgid, a.kind));
        let mut name_error = None;
        let mut read_name = |fallback: &str| {
            let n = match a.name_ptr.map(|p| self.device.strings.get(e.tgid, p)) {
                Some(Ok(n)) => Some(n),
                Some(Err(err)) => {
                    name_error = Some(err.to_string());
                    None
                }
                None => None,
            };
            streams::bounded_name(n.as_deref(), fallback)
        };
        let name = match (a.kind, a.detail) {
            (ActivityKind::Memcpy, ActivityDetail::Memcpy { bytes, kind }) => {
                format!("memcpy {kind:?} {bytes} B")
            }
            (ActivityKind::Memcpy, _) => "memcpy".to_string(),
            (ActivityKind::Kernel, _) => read_name("kernel"),
            _ => read_name("device task"),
        };
        let mut args = Vec::new();
        if let Some(err) = name_error {
            args.push(Arg::new("name_error", ArgValue::Str(err)));
        }
        if let Some(c) = a.correlation_id {
            args.push(Arg::new("correlation_id", ArgValue::Uint(c)));
        }
        if let Some(d) = a.device {
            args.push(Arg::new("device", ArgValue::Uint(d.into())));
        }
        if let Some(s) = a.stream {
            args.push(Arg::new("stream", ArgValue::Uint(s)));
        }
        match a.detail {
            ActivityDetail::Launch { grid, block, .. } => {
                let dims = |d: [i32; 3]| format!("({},{},{})", d[0], d[1], d[2]);
                args.push(Arg::new("grid", ArgValue::Str(dims(grid))));
                args.push(Arg::new("block", ArgValue::Str(dims(block))));
            }
            ActivityDetail::Memcpy { bytes, .. } => {
                args.push(Arg::new("bytes", ArgValue::Uint(bytes)));
            }
            ActivityDetail::Hccl { bandwidth_gbps, .. } => {
                args.push(Arg::new("bandwidth_gbps", ArgValue::Double(bandwidth_gbps)));
            }
            ActivityDetail::Communication { dtype, count, .. } => {
                args.push(Arg::new("dtype", ArgValue::Str(dtype.name().into())));
                args.push(Arg::new("count", ArgValue::Uint(count)));
            }
            _ => {}
        }
        let key = StreamKey {
            tgid: e.tgid,
            name: streams::stream_track_name(ascend, a.device, a.stream),
            estimated: false,
        };
        let work = Work {
            start: a.start,
            end: a.end.max(a.start),
            name,
            args,
            correlation: a.correlation_id,
            collective_view: match a.kind {
                ActivityKind::Hccl => Some(CollectiveView::Hccl),
                ActivityKind::Communication => Some(CollectiveView::Communication),
                _ => None,
            },
        };
        if self.device.streams.push(key.clone(), work) {
            self.flush_stream(&key)?;
        }
        Ok(())
    }

    /// Estimated device work from launches and syncs (used only for
    /// processes without activity records).
    fn estimate(&mut self, call: &DeviceCall, end: u64) -> Result<()> {
        if call.error || self.device.streams.with_activity.contains(&call.tgid) {
            return Ok(());
        }
        let ascend = call.library.vendor() == Vendor::Ascend;
        let st = &mut self.device.streams;
        let device = |st: &DeviceStreams| {
            st.current_device
                .get(&(call.tgid, call.tid))
                .copied()
                .unwrap_or(0)
        };
        let closed: Vec<(u64, OpenWindow)> = match (call.kind, &call.args) {
            (_, CallArgs::SetDevice { device }) => {
                st.current_device
                    .insert((call.tgid, call.tid), (*device).max(0) as u32);
                return Ok(());
            }
            (CallKind::Launch(LaunchKind::Kernel | LaunchKind::KernelExC), CallArgs::Launch(l)) => {
                let dev = device(st);
                st.open
                    .entry((call.tgid, ascend, l.stream.unwrap_or(0)))
                    .and_modify(|w| w.launches += 1)
                    .or_insert(OpenWindow {
                        device: dev,
                        first_launch: call.start_ts,
                        launches: 1,
                    });
                return Ok(());
            }
            (CallKind::Sync(SyncKind::Stream), CallArgs::Sync { stream, .. }) => {
                let s = stream.unwrap_or(0);
                st.open
                    .remove(&(call.tgid, ascend, s))
                    .map(|w| (s, w))
                    .into_iter()
                    .collect()
            }
            (CallKind::Sync(SyncKind::Device), _) => {
                let dev = device(st);
                let keys: Vec<_> = st
                    .open
                    .iter()
                    .filter(|(k, w)| k.0 == call.tgid && k.1 == ascend && w.device == dev)
                    .map(|(k, _)| *k)
                    .collect();
                let mut v: Vec<(u64, OpenWindow)> = keys
                    .into_iter()
                    .filter_map(|k| st.open.remove(&k).map(|w| (k.2, w)))
                    .collect();
                v.sort_by_key(|(s, _)| *s);
                v
            }
            _ => return Ok(()),
        };
        for (stream, w) in closed {
            let key = StreamKey {
                tgid: call.tgid,
                name: streams::estimated_track_name(ascend, w.device, stream),
                estimated: true,
            };
            let work = Work {
                start: w.first_launch,
                end: end.max(w.first_launch),
                name: format!("estimated: {} kernels", w.launches),
                args: streams::estimated_args(w.launches),
                correlation: None,
                collective_view: None,
            };
            if self.device.streams.push(key.clone(), work) {
                self.flush_stream(&key)?;
            }
        }
        Ok(())
    }

    /// Writes a track's pending work in start order, on lanes so slices
    /// nest, with a flow from the host call where the API record is known.
    fn flush_stream(&mut self, key: &StreamKey) -> Result<()> {
        let Some(mut work) = self.device.streams.pending.remove(key) else {
            return Ok(());
        };
        if key.estimated && self.device.streams.with_activity.contains(&key.tgid) {
            return Ok(());
        }
        work.sort_by_key(|w| (w.start, w.end));
        let parent = self.device_process_track(key.tgid)?;
        for w in work {
            let mut flow = Vec::new();
            let launch = w
                .correlation
                .and_then(|c| self.device.streams.launch_flows.remove(&(key.tgid, c)));
            let host = match launch {
                Some(_) => None,
                None => w
                    .correlation
                    .and_then(|c| self.device.streams.api.remove(&(key.tgid, c))),
            };
            if let Some(id) = launch {
                self.device.stats.device_flows += 1;
                flow.push(id);
            }
            if let Some(h) = host {
                let id = self.device.streams.new_flow();
                let t = self
                    .writer
                    .thread_track(key.tgid as i32, h.tid as i32, "")?;
                let args = [Arg::new(
                    "correlation_id",
                    ArgValue::Uint(w.correlation.unwrap_or(0)),
                )];
                self.writer.slice_begin(
                    t,
                    h.ts,
                    "device work enqueued",
                    Some("device"),
                    &args,
                    &[id],
                    None,
                )?;
                self.writer.slice_end(t, h.ts, &[])?;
                self.device.stats.device_flows += 1;
                flow.push(id);
            }
            let lanes = self.device.streams.lanes.entry(key.clone()).or_default();
            let ends: Vec<u64> = lanes.tracks.iter().map(|(_, e)| *e).collect();
            let lane = streams::pick_lane(&ends, w.start);
            if lane == lanes.tracks.len() {
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
                lanes.tracks.push((t, 0));
            }
            let (track, last_end) = &mut lanes.tracks[lane];
            *last_end = w.end;
            let track = *track;
            self.writer
                .slice_begin(track, w.start, &w.name, Some("device"), &w.args, &[], None)?;
            self.writer.slice_end(track, w.end, &flow)?;
            if key.estimated {
                self.device.stats.estimated_slices += 1;
            } else {
                self.device.stats.device_slices += 1;
            }
        }
        Ok(())
    }

    fn memory_effect(
        &mut self,
        call: &DeviceCall,
        m: &MemoryEffect,
        thread: TrackUuid,
        ts: u64,
    ) -> Result<()> {
        let key = (call.tgid, m.device.vendor, m.device.index);
        let counter = match self.device.memory_tracks.get(&key) {
            Some(t) => *t,
            None => {
                let process = self.device_process_track(call.tgid)?;
                let t = self.writer.counter_track(
                    Some(process),
                    &format!("device memory dev{}", m.device.index),
                    CounterUnit::SizeBytes,
                )?;
                self.device.memory_tracks.insert(key, t);
                t
            }
        };
        self.writer.counter(counter, ts, m.held_after as f64)?;
        if let Some(req) = m.failed_request {
            self.device.stats.failed_allocations += 1;
            // What holds the device's memory when the allocation fails.
            let live: Vec<LiveSite> = self
                .device
                .decoder
                .memory(call.tgid)
                .map(|l| l.largest_sites(Some(m.device), TOP_SITES))
                .unwrap_or_default();
            let mut args = vec![
                Arg::new("requested", ArgValue::Uint(req)),
                Arg::new("device_bytes_held", ArgValue::Uint(m.held_after)),
                Arg::new("device", ArgValue::Uint(m.device.index.into())),
                Arg::new("return", ArgValue::Int(call.ret.unwrap_or(0))),
                Arg::new("stack", ArgValue::Str(self.device.sites.label(m.site))),
            ];
            args.extend(self.device.sites.annotations("live_sites", &live));
            let stack = self.site_frames(m.site);
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
}

#[cfg(test)]
mod tests;
