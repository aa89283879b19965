//! Device-library calls on the trace: one slice per call on the calling
//! thread's track (named as the decoder names it, arguments as debug
//! annotations), device memory counters per (process, device), failed
//! allocations as instants, and each process's rank identity as process
//! labels.

use std::collections::HashMap;
use std::io::Write;

use anyhow::Result;
use xpuscope_common::uprobe::{UprobeEntry, UprobeReturn};
use xpuscope_perfetto::{Arg, ArgValue, CounterUnit, TrackUuid};
use xpuscope_probes::catalog::Vendor;
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::memory::MemoryEffect;
use xpuscope_probes::decode::{Decoded, Decoder, DeviceCall, Unmatched};

use super::TraceBuilder;
use crate::device_probes::TableUpdate;

/// What the device decoding saw, for the summary.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceStats {
    pub calls: u64,
    pub errors: u64,
    pub activities: u64,
    pub entries_without_return: u64,
    pub returns_without_entry: u64,
    pub unknown_probes: u64,
    /// Calls still open when the recording ended.
    pub in_flight_at_end: u64,
}

pub struct DeviceTrace {
    decoder: Decoder,
    memory_tracks: HashMap<(u32, Vendor, u32), TrackUuid>,
    /// Process tracks written, with the rank identity as labels.
    process_tracks: HashMap<u32, TrackUuid>,
    out: Vec<Decoded>,
    pub stats: DeviceStats,
}

impl Default for DeviceTrace {
    fn default() -> Self {
        Self {
            decoder: Decoder::new(Default::default()),
            memory_tracks: HashMap::new(),
            process_tracks: HashMap::new(),
            out: Vec::new(),
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
        let table = self.device.decoder.probes_mut();
        for (ip, target) in update.probes {
            table.insert(update.tgid, ip, target);
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

    /// A thread (or, for the main thread, the process) exited.
    pub(super) fn device_exited(&mut self, tgid: u32, tid: u32) -> Result<()> {
        let mut out = std::mem::take(&mut self.device.out);
        if tid == tgid {
            self.device.decoder.process_exited(tgid, &mut out);
        } else {
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
        let s = self.device.decoder.stats();
        self.device.stats.activities = s.activities;
        self.device.stats.unknown_probes = s.unknown_probes;
        Ok(())
    }

    fn emit(&mut self, out: &mut Vec<Decoded>) -> Result<()> {
        for d in out.drain(..) {
            match d {
                Decoded::Call(call) => self.device_call(&call)?,
                Decoded::Activity(a) => {
                    let track = self.writer.thread_track(a.tgid as i32, a.tid as i32, "")?;
                    let args = [Arg::new(
                        "activity",
                        ArgValue::Str(format!("{:?}", a.activity)),
                    )];
                    self.writer
                        .instant(track, a.ts, "device activity record", &args, None)?;
                }
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
        if call.error {
            self.device.stats.errors += 1;
        }
        // An empty name: track names outrank scheduler names in the importer.
        let track = self
            .writer
            .thread_track(call.tgid as i32, call.tid as i32, "")?;
        let args = call_args(call);
        let end = call.end_ts.unwrap_or(call.start_ts).max(call.start_ts);
        self.writer.slice_begin(
            track,
            call.start_ts,
            &slice_name(call),
            Some("device"),
            &args,
            &[],
            None,
        )?;
        self.writer.slice_end(track, end, &[])?;
        if let Some(m) = &call.memory {
            self.memory_effect(call, m, track, end)?;
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
            let args = [
                Arg::new("requested", ArgValue::Uint(req)),
                Arg::new("device_bytes_held", ArgValue::Uint(m.held_after)),
                Arg::new("device", ArgValue::Uint(m.device.index.into())),
                Arg::new("return", ArgValue::Int(call.ret.unwrap_or(0))),
            ];
            self.writer.instant(
                thread,
                ts,
                &format!("{} failed", call.function),
                &args,
                None,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xpuscope_common::EventHeader;
    use xpuscope_perfetto::TraceWriter;
    use xpuscope_probes::catalog::Library;
    use xpuscope_probes::decode::table::ProbeTarget;
    use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

    use crate::events::Event;

    fn entry(ts: u64, ip: u64, args: [u64; 6]) -> Event {
        Event::ProbeEntry(Box::new(UprobeEntry {
            header: EventHeader {
                kind: 0,
                cpu: 0,
                ts,
            },
            tid: 43,
            tgid: 42,
            probe_ip: ip,
            args,
            sp: 0,
            stack: [0; 8],
            deref_len: 0,
            _pad: 0,
            deref: [0; 128],
        }))
    }

    fn ret(ts: u64, ip: u64, rax: u64, out: &[u8]) -> Event {
        let mut deref = [0u8; 128];
        deref[..out.len()].copy_from_slice(out);
        Event::ProbeReturn(Box::new(UprobeReturn {
            header: EventHeader {
                kind: 0,
                cpu: 0,
                ts,
            },
            tid: 43,
            tgid: 42,
            probe_ip: ip,
            ret: rax,
            deref_len: out.len() as u32,
            _pad: 0,
            deref,
        }))
    }

    /// Calls become named slices with arguments on the thread's track,
    /// errors are marked, memory is a counter, unmatched records counted.
    #[test]
    fn device_calls_become_slices_and_counters() {
        let mut b = TraceBuilder::new(TraceWriter::new(Vec::new()));
        b.writer()
            .system_info(&xpuscope_perfetto::SystemInfo {
                release: "6.18.0".into(),
                ..Default::default()
            })
            .unwrap();
        let target = |lib: Library, f: &str| ProbeTarget {
            library: lib,
            function: lib.function(f).unwrap(),
            sp_delta: 0,
        };
        b.probes_added(TableUpdate {
            tgid: 42,
            probes: vec![
                (0x1000, target(Library::Nccl, "ncclAllReduce")),
                (0x2000, target(Library::Cudart, "cudaMalloc")),
            ],
            identity: RankIdentity::from_environ(b"RANK=1\0WORLD_SIZE=2\0XPUSCOPE_JOB=j\0"),
        })
        .unwrap();
        let events = vec![
            entry(1_000, 0x1000, [0xa000, 0xb000, 32 << 20, 9, 0, 0xc0c0]),
            ret(9_000, 0x1000, 0, &[]),
            entry(10_000, 0x2000, [0x7000, 1 << 20, 0, 0, 0, 0]),
            ret(11_000, 0x2000, 0, &0x2000_0000_0000u64.to_le_bytes()),
            entry(12_000, 0x2000, [0x7000, 1 << 40, 0, 0, 0, 0]),
            ret(13_000, 0x2000, 2, &[]),
            ret(14_000, 0x1000, 0, &[]),
        ];
        for e in events {
            b.handle(e).unwrap();
        }
        let (bytes, stats, _) = b.finish(20_000).unwrap();
        let trace = decode(&bytes).unwrap();
        check_importer_rules(&trace).unwrap();
        let tl = Timeline::new(&trace);
        let names: Vec<&str> = tl
            .slices_on_thread(43)
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(
            names,
            vec![
                "ncclAllReduce 64 MiB bf16 sum",
                "cudaMalloc 1 MiB",
                "cudaMalloc 1 TiB [error 2]"
            ]
        );
        let reduce = tl.slices_on_thread(43)[0];
        assert_eq!((reduce.ts, reduce.end), (1_000, Some(9_000)));
        let arg = |n: &str| {
            reduce
                .args
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.to_string())
        };
        assert_eq!(arg("seq").as_deref(), Some("0"));
        assert_eq!(arg("dtype").as_deref(), Some("bf16"));
        assert_eq!(
            tl.counter_values("device memory dev0"),
            vec![1048576.0, 1048576.0]
        );
        let marks = tl.instants_on_thread(43);
        assert!(
            marks.iter().any(|(n, _)| n == "cudaMalloc failed"),
            "{marks:?}"
        );
        let p = &tl.processes[&42];
        assert_eq!(p.name.as_deref(), Some("rank 1/2 job j"));
        assert_eq!(stats.device.calls, 3);
        assert_eq!(stats.device.errors, 1);
        assert_eq!(stats.device.returns_without_entry, 1);
    }

    #[test]
    fn rank_identity_from_environ() {
        let env =
            b"PATH=/bin\0RANK=3\0WORLD_SIZE=8\0LOCAL_RANK=1\0JOB_NAME=j\0XPUSCOPE_JOB=sim-a\0";
        let id = RankIdentity::from_environ(env);
        assert_eq!(id.name().as_deref(), Some("rank 3/8 job sim-a"));
        assert_eq!(
            id.labels(),
            vec!["rank=3", "local_rank=1", "world_size=8", "job=sim-a"]
        );
        let id = RankIdentity::from_environ(b"JOB_NAME=j\0");
        assert_eq!(id.name(), None);
        assert_eq!(id.job.as_deref(), Some("j"));
    }
}
