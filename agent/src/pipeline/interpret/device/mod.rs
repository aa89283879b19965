//! Device-library records -> meaning: calls paired and decoded (by
//! `xpuscope-probes`' [`Decoder`]), their allocation sites, device memory
//! (failed allocations with what holds the memory), activity records as
//! device work on device streams with flows from the host calls that
//! enqueued it, and estimated device work where no activity records come.

mod flood;
mod sites;
mod streams;

use foldhash::{HashMap, HashMapExt};
use std::collections::HashSet;

use sites::{AllocSites, TOP_SITES};
use streams::{CollectiveView, DeviceStreams, HeldCall, HostCall, OpenWindow, StreamKey, Work};
use xpuscope_common::uprobe::{UprobeEntry, UprobeReturn};
use xpuscope_probes::activity::{ActivityDetail, ActivityKind};
use xpuscope_probes::catalog::{CallKind, LaunchKind, SyncKind, Vendor};
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::memory::LiveSite;
use xpuscope_probes::decode::{ActivityEvent, Decoded, Decoder, DeviceCall, InFlight, Unmatched};

use super::InterpretCounters;
use crate::events::{CallStack, Exit};
use crate::kernel::probes::TableUpdate;
use crate::model::{
    DeviceCallRecord, DeviceWork, EnqueueMarker, Field, FieldValue, InFlightCall, MemoryHeld,
    Record, WorkKind, device::HeldAt,
};
use crate::pipeline::enrich::Enrich;
use xpuscope_probes::decode::table::ProbeTarget;

pub struct DeviceInterpreter {
    decoder: Decoder,
    /// Processes whose identity was sent.
    identified: HashMap<u32, ()>,
    /// Processes whose environment could not be read at their first call
    /// (gone already): their identity waits for their probes' plan.
    unreadable: HashSet<u32>,
    out: Vec<Decoded>,
    /// Device-stream state (activity records, estimates, held calls).
    streams: DeviceStreams,
    /// Allocating stacks, interned.
    sites: AllocSites,
    /// Calls past the flood rate are summarized.
    flood: flood::FloodLimiter,
}

impl Default for DeviceInterpreter {
    fn default() -> Self {
        Self {
            decoder: Decoder::new(Default::default()),
            identified: HashMap::new(),
            unreadable: HashSet::new(),
            out: Vec::new(),
            streams: DeviceStreams::default(),
            sites: AllocSites::default(),
            flood: flood::FloodLimiter::new(crate::config::DEFAULT_DEVICE_CALL_RATE),
        }
    }
}

impl DeviceInterpreter {
    /// Calls per second per (process, function) past which calls are
    /// summarized (0: never).
    pub fn with_call_rate(rate: u32) -> Self {
        Self {
            flood: flood::FloodLimiter::new(rate),
            ..Self::default()
        }
    }

    /// Probes of a process about to be attached: learn what they mean, and
    /// the process's rank identity.
    pub fn probes_added(
        &mut self,
        update: TableUpdate,
        en: &mut dyn Enrich,
        out: &mut Vec<Record>,
    ) {
        en.remember_maps(update.tgid, update.maps);
        let table = self.decoder.probes_mut();
        for (ip, slot, target) in update.probes {
            table.insert(update.tgid, ip, target);
            table.insert_slot(slot, target);
        }
        if self.identified.insert(update.tgid, ()).is_none() {
            out.push(Record::Identity {
                tgid: update.tgid,
                identity: Box::new(update.identity),
            });
        }
    }

    /// A process's rank identity before its first call's record. Probes
    /// attached by file record a new process's calls at once (decoded by
    /// slot), while its plan, which reads its identity too, comes on the
    /// planner's next round: on a loaded machine after its first calls,
    /// which every sink would then see without a rank.
    fn identify(&mut self, tgid: u32, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        if self.identified.contains_key(&tgid) || self.unreadable.contains(&tgid) {
            return;
        }
        match en.identity(tgid) {
            Some(identity) => {
                self.identified.insert(tgid, ());
                out.push(Record::Identity {
                    tgid,
                    identity: Box::new(identity),
                });
            }
            None => {
                self.unreadable.insert(tgid);
            }
        }
    }

    /// `tgid` runs another program: its environment, and so its identity,
    /// may be another.
    pub fn process_exec(&mut self, tgid: u32) {
        self.identified.remove(&tgid);
        self.unreadable.remove(&tgid);
    }

    /// Probes attached by file ahead of any process mapping them: their
    /// hits decode by slot until the process's own addresses are known.
    pub fn slots_added(&mut self, slots: Vec<(u32, ProbeTarget)>) {
        let table = self.decoder.probes_mut();
        for (slot, target) in slots {
            table.insert_slot(slot, target);
        }
    }

    pub fn entry(
        &mut self,
        e: &UprobeEntry,
        en: &mut dyn Enrich,
        c: &mut InterpretCounters,
        out: &mut Vec<Record>,
    ) {
        let mut decoded = std::mem::take(&mut self.out);
        self.decoder.on_entry(e, &mut decoded);
        self.emit(&mut decoded, en, c, out);
        self.out = decoded;
    }

    pub fn ret(
        &mut self,
        r: &UprobeReturn,
        en: &mut dyn Enrich,
        c: &mut InterpretCounters,
        out: &mut Vec<Record>,
    ) {
        let mut decoded = std::mem::take(&mut self.out);
        self.decoder.on_return(r, &mut decoded);
        self.emit(&mut decoded, en, c, out);
        self.out = decoded;
    }

    /// The caller's stack as an allocation returns (just before its return
    /// record): interned as a site the call and its bytes are charged to.
    pub fn call_stack(&mut self, s: &CallStack, en: &mut dyn Enrich, c: &mut InterpretCounters) {
        c.alloc_stacks += 1;
        let user =
            match super::user_addrs(en, (s.tgid, s.tid), s.ts, &s.user, s.user_copy.as_ref(), c) {
                Ok(u) if !u.addrs.is_empty() => u,
                _ => {
                    c.alloc_stack_errors += 1;
                    return;
                }
            };
        let site = self.sites.intern(s.tgid, &user.addrs, || {
            super::with_truncation(en.user_frames(s.tgid, &user.addrs), user.truncated)
        });
        c.alloc_sites_over_limit = self.sites.over_limit;
        if let Some(site) = site {
            self.decoder.on_call_site(s.tgid, s.tid, s.probe_ip, site);
        }
    }

    /// Process `tgid`'s device memory still held, by allocation site.
    fn live_sites(&mut self, tgid: u32, ts: u64, at: HeldAt, out: &mut Vec<Record>) {
        let Some(memory) = self.decoder.memory(tgid) else {
            return;
        };
        let rows = memory.largest_sites(None, TOP_SITES);
        if rows.is_empty() {
            return;
        }
        let held: u64 = memory.devices().map(|(_, b)| b).sum();
        out.push(Record::MemoryHeld(MemoryHeld {
            tgid,
            ts,
            at,
            held,
            rows: self.sites.rows(&rows),
        }));
    }

    /// A thread (or, with `process_ended`, its whole process) exited.
    pub fn exited(
        &mut self,
        exit: &Exit,
        process_ended: bool,
        en: &mut dyn Enrich,
        c: &mut InterpretCounters,
        out: &mut Vec<Record>,
    ) {
        let (tgid, tid, ts) = (exit.tgid, exit.tid, exit.ts);
        let mut decoded = std::mem::take(&mut self.out);
        if process_ended {
            self.live_sites(tgid, ts, HeldAt::Exit, out);
            self.release_held(Some(tgid), out);
            let mut keys: Vec<StreamKey> = (self.streams.pending.keys())
                .filter(|k| k.tgid == tgid)
                .cloned()
                .collect();
            keys.sort();
            for key in keys {
                self.flush_stream(&key, out);
            }
            self.streams.forget_process(tgid);
            self.decoder.process_exited(tgid, &mut decoded);
            self.emit(&mut decoded, en, c, out);
            self.flood.process_ended(tgid, out);
            self.sites.forget_process(tgid);
            self.identified.remove(&tgid);
            self.unreadable.remove(&tgid);
        } else {
            self.streams.current_device.remove(&(tgid, tid));
            self.decoder.thread_exited(tgid, tid, &mut decoded);
            self.emit(&mut decoded, en, c, out);
            self.flood.thread_exited(tgid, tid, out);
        }
        self.out = decoded;
    }

    /// The blocking calls entered and not returned (collectives,
    /// point-to-point, synchronizations; not launches, which return at
    /// once), oldest first.
    /// Processes with a rank identity (probed device processes).
    pub fn identified(&self) -> impl Iterator<Item = u32> + '_ {
        self.identified.keys().copied()
    }

    pub fn open_blocking(&self) -> Vec<InFlight> {
        let mut open: Vec<InFlight> = self
            .decoder
            .in_flight()
            .filter(|c| {
                matches!(
                    c.kind,
                    CallKind::Collective(_) | CallKind::SendRecv(_) | CallKind::Sync(_)
                )
            })
            .collect();
        open.sort_by_key(|c| (c.start_ts, c.tgid, c.tid));
        open
    }

    /// Calls still open at the end (a hang shows here), memory still held,
    /// device work still buffered.
    pub fn finish(&mut self, end: u64, c: &mut InterpretCounters, out: &mut Vec<Record>) {
        let open: Vec<_> = self.decoder.in_flight().collect();
        for call in open {
            out.push(Record::InFlightAtEnd(InFlightCall {
                tgid: call.tgid,
                tid: call.tid,
                function: call.function,
                start_ts: call.start_ts,
                seq: call.seq,
                end,
            }));
        }
        let mut live: Vec<u32> = self.identified.keys().copied().collect();
        live.sort_unstable();
        for tgid in live {
            self.live_sites(tgid, end, HeldAt::EndOfTrace, out);
        }
        self.release_held(None, out);
        self.flood.finish(out);
        let mut keys: Vec<StreamKey> = self.streams.pending.keys().cloned().collect();
        keys.sort();
        for key in keys {
            self.flush_stream(&key, out);
        }
        let s = self.decoder.stats();
        c.activities = s.activities;
        c.unknown_probes = s.unknown_probes;
        c.activity_unread = s.activity_unread;
        c.activity_errors = s.activity_errors;
        c.activity_other_kinds = s.activity_other_kinds;
        c.cupti_reads = s.cupti_reads;
        c.mspti_reads = s.mspti_reads;
        c.driver_calls_folded = s.folded;
    }

    /// Turns what the decoder produced into records.
    pub(crate) fn emit(
        &mut self,
        decoded: &mut Vec<Decoded>,
        en: &mut dyn Enrich,
        c: &mut InterpretCounters,
        out: &mut Vec<Record>,
    ) {
        for d in decoded.drain(..) {
            match d {
                Decoded::Call(call) => {
                    self.identify(call.tgid, en, out);
                    self.device_call(call, out)
                }
                Decoded::Activity(a) => self.device_activity(&a, en, out),
                Decoded::Unmatched(Unmatched::EntryWithoutReturn { call, reason }) => {
                    self.identify(call.tgid, en, out);
                    let mut r = self.record(*call);
                    r.unmatched = Some(reason);
                    out.push(Record::DeviceCall(Box::new(r)));
                }
                Decoded::Unmatched(Unmatched::ReturnWithoutEntry { .. }) => {
                    c.returns_without_entry += 1;
                }
                Decoded::Unmatched(Unmatched::UnknownProbe { .. }) => {}
            }
        }
    }

    /// A call's record with its allocation site and, for a failed
    /// allocation, what holds the device's memory.
    fn record(&self, call: DeviceCall) -> DeviceCallRecord {
        let mut r = DeviceCallRecord::new(call);
        r.site = self.sites.site(r.call.site);
        if let Some(m) = &r.call.memory
            && m.failed_request.is_some()
        {
            let live: Vec<LiveSite> = self
                .decoder
                .memory(r.call.tgid)
                .map(|l| l.largest_sites(Some(m.device), TOP_SITES))
                .unwrap_or_default();
            r.oom = Some(self.sites.rows(&live));
        }
        r
    }

    fn device_call(&mut self, call: DeviceCall, out: &mut Vec<Record>) {
        let end = call.end_ts.unwrap_or(call.start_ts).max(call.start_ts);
        self.estimate(&call, end, out);
        if !self.flood.admit(&call, out) {
            return;
        }
        // Calls that enqueue device work wait (bounded) for their API
        // record in processes that produce them: it gives the flow id.
        if call.memory.is_none()
            && call.end_ts.is_some()
            && self.streams.awaits_api_record(call.tgid, call.kind)
        {
            let held = self.streams.held.entry(call.tgid).or_default();
            held.push_back(HeldCall { call });
            if held.len() > streams::MAX_HELD
                && let Some(h) = held.pop_front()
            {
                let r = self.record(h.call);
                out.push(Record::DeviceCall(Box::new(r)));
            }
            return;
        }
        let r = self.record(call);
        out.push(Record::DeviceCall(Box::new(r)));
    }

    /// An API record of process `tgid`: the held call of that thread it
    /// lies in gets a flow id; held calls of the thread before it get none.
    /// False when no held call matches.
    fn api_record(
        &mut self,
        tgid: u32,
        tid: u32,
        start: u64,
        end: u64,
        corr: u64,
        out: &mut Vec<Record>,
    ) -> bool {
        self.streams.api_seen.insert(tgid);
        let Some(held) = self.streams.held.get_mut(&tgid) else {
            return false;
        };
        let Some(i) = held.iter().position(|h| {
            h.call.tid == tid && h.call.start_ts <= start && h.call.end_ts.is_some_and(|e| end <= e)
        }) else {
            return false;
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
            let mut r = self.record(call);
            if matched {
                r.flows.push(self.streams.launch_flow(tgid, corr));
            }
            out.push(Record::DeviceCall(Box::new(r)));
        }
        true
    }

    /// Releases the held calls of one process, or of all.
    fn release_held(&mut self, tgid: Option<u32>, out: &mut Vec<Record>) {
        let mut keys: Vec<u32> = match tgid {
            Some(t) => vec![t],
            None => self.streams.held.keys().copied().collect(),
        };
        keys.sort();
        for t in keys {
            if let Some(held) = self.streams.held.remove(&t) {
                for h in held {
                    let r = self.record(h.call);
                    out.push(Record::DeviceCall(Box::new(r)));
                }
            }
        }
    }

    /// An activity record: API records are remembered for flows; device
    /// work is buffered for its stream.
    fn device_activity(&mut self, e: &ActivityEvent, en: &mut dyn Enrich, out: &mut Vec<Record>) {
        let a = &e.activity;
        let ascend = e.library.vendor() == Vendor::Ascend;
        match a.kind {
            ActivityKind::Api => {
                if let (Some(c), ActivityDetail::Api { tid, .. }) = (a.correlation_id, a.detail) {
                    let tid = if tid == 0 { e.tid } else { tid };
                    if self.api_record(e.tgid, tid, a.start, a.end, c, out) {
                        return;
                    }
                    let call = HostCall { tid, ts: a.start };
                    self.streams.remember_api(e.tgid, c, call);
                }
                return;
            }
            ActivityKind::Marker => return,
            _ => {}
        }
        if a.stream.is_none() && a.device.is_none() {
            return;
        }
        self.streams.with_activity.insert(e.tgid);
        self.streams.work_seen.insert((e.tgid, a.kind));
        let mut name_error = None;
        let mut read_name = |fallback: &str| {
            let n = match a.name_ptr.map(|p| en.remote_string(e.tgid, p)) {
                Some(Ok(n)) => Some(n),
                Some(Err(err)) => {
                    name_error = Some(err);
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
        let mut push = |name: &str, v: FieldValue| args.push(Field::new(name, v));
        if let Some(err) = name_error {
            push("name_error", FieldValue::Str(err));
        }
        if let Some(c) = a.correlation_id {
            push("correlation_id", FieldValue::Uint(c));
        }
        if let Some(d) = a.device {
            push("device", FieldValue::Uint(d.into()));
        }
        if let Some(s) = a.stream {
            push("stream", FieldValue::Uint(s));
        }
        match a.detail {
            ActivityDetail::Launch { grid, block, .. } => {
                let dims = |d: [i32; 3]| format!("({},{},{})", d[0], d[1], d[2]);
                push("grid", FieldValue::Str(dims(grid)));
                push("block", FieldValue::Str(dims(block)));
            }
            ActivityDetail::Memcpy { bytes, .. } => push("bytes", FieldValue::Uint(bytes)),
            ActivityDetail::Hccl { bandwidth_gbps, .. } => {
                push("bandwidth_gbps", FieldValue::Double(bandwidth_gbps));
            }
            ActivityDetail::Communication { dtype, count, .. } => {
                push("dtype", FieldValue::Str(dtype.name().into()));
                push("count", FieldValue::Uint(count));
            }
            _ => {}
        }
        let key = StreamKey {
            tgid: e.tgid,
            name: streams::stream_track_name(ascend, a.device, a.stream),
            estimated: false,
        };
        let kind = work_kind(a.kind, &name);
        let work = Work {
            kind,
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
        if self.streams.push(key.clone(), work) {
            self.flush_stream(&key, out);
        }
    }

    /// Estimated device work from launches and syncs (only for processes
    /// without activity records).
    fn estimate(&mut self, call: &DeviceCall, end: u64, out: &mut Vec<Record>) {
        if call.error || self.streams.with_activity.contains(&call.tgid) {
            return;
        }
        let ascend = call.library.vendor() == Vendor::Ascend;
        let st = &mut self.streams;
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
                return;
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
                return;
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
            _ => return,
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
                kind: WorkKind::Estimated,
            };
            if self.streams.push(key.clone(), work) {
                self.flush_stream(&key, out);
            }
        }
    }

    /// A stream's pending work in start order, each with its flow from the
    /// host call where the API record is known.
    fn flush_stream(&mut self, key: &StreamKey, out: &mut Vec<Record>) {
        let Some(mut work) = self.streams.pending.remove(key) else {
            return;
        };
        if key.estimated && self.streams.with_activity.contains(&key.tgid) {
            return;
        }
        work.sort_by_key(|w| (w.start, w.end));
        for w in work {
            let mut flows = Vec::new();
            let launch = w
                .correlation
                .and_then(|c| self.streams.launch_flows.remove(&(key.tgid, c)));
            let host = match launch {
                Some(_) => None,
                None => w
                    .correlation
                    .and_then(|c| self.streams.api.remove(&(key.tgid, c))),
            };
            if let Some(id) = launch {
                flows.push(id);
            }
            if let Some(h) = host {
                let flow = self.streams.new_flow();
                out.push(Record::Enqueued(EnqueueMarker {
                    tgid: key.tgid,
                    tid: h.tid,
                    ts: h.ts,
                    correlation: w.correlation.unwrap_or(0),
                    flow,
                }));
                flows.push(flow);
            }
            out.push(Record::DeviceWork(Box::new(DeviceWork {
                track: key.clone(),
                kind: w.kind,
                start: w.start,
                end: w.end,
                name: w.name,
                fields: w.args,
                flows,
            })));
        }
    }
}

/// What an activity record's work is. NCCL's collectives run as kernels
/// named after the library (`ncclDevKernel_AllReduce...`,
/// `ncclKernel_...`); HCCL's come as their own record kinds.
fn work_kind(kind: ActivityKind, name: &str) -> WorkKind {
    match kind {
        ActivityKind::Memcpy => WorkKind::Copy,
        ActivityKind::Hccl | ActivityKind::Communication => WorkKind::Communication,
        ActivityKind::Kernel => {
            let lower = name.get(..4).map(str::to_ascii_lowercase);
            if matches!(lower.as_deref(), Some("nccl" | "hccl")) {
                WorkKind::Communication
            } else {
                WorkKind::Compute
            }
        }
        _ => WorkKind::Other,
    }
}
