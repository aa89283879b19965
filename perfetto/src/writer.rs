//! [`TraceWriter`]: construction, system packets (SystemInfo, clocks,
//! process trees), scheduler events and the end of the stream.
//!
//! Track events live in `track_events.rs`, callstack samples in `samples.rs`.

use std::io::{self, Write};

use crate::packet::PacketSink;
use crate::proto::{self, FtraceEvent, TracePacket};
use crate::sched::{CpuBundle, EncodeScratch, MAX_CPUS};
use crate::sequence::{SYSTEM_SEQUENCE_ID, TrackSequence, sample_defaults};
use crate::types::{
    ClockSnapshot, ProcessInfo, SampleFormat, SystemInfo, ThreadInfo, WriterOptions,
};

/// Streams a native Perfetto trace into `W`.
///
/// Memory stays bounded by the open per-CPU bundles (at most
/// [`WriterOptions::bundle_events`] events each), a 256 KiB output buffer and
/// the intern tables (one entry per distinct name, mapping, frame and
/// callstack). See the crate docs for the packet layout.
///
/// End with [`TraceWriter::finish`] (or call [`TraceWriter::flush`] at
/// checkpoints): dropping the writer loses the open bundles and up to 256 KiB
/// of buffered packets. After an I/O error the output may end in a partial
/// packet; stop writing.
pub struct TraceWriter<W: Write> {
    pub(crate) sink: PacketSink<W>,
    /// Open bundle per CPU, indexed by cpu.
    cpus: Vec<CpuBundle>,
    /// Buffers for encoding the bundles (kept: no allocation per bundle).
    sched_scratch: EncodeScratch,
    bundle_events: usize,
    pub(crate) seq: TrackSequence,
    pub(crate) sample_format: SampleFormat,
    /// Cumulative off-CPU ns per CPU (the `PerfSample` timebase).
    pub(crate) perf_timebase: Vec<u64>,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl<W: Write> TraceWriter<W> {
    /// A writer with [`WriterOptions::default`].
    pub fn new(out: W) -> Self {
        Self::with_options(out, WriterOptions::default())
    }

    /// A writer with explicit options (`bundle_events` of 0 counts as 1).
    pub fn with_options(out: W, options: WriterOptions) -> Self {
        TraceWriter {
            sink: PacketSink::new(out, options.machine_id),
            cpus: Vec::new(),
            sched_scratch: EncodeScratch::default(),
            bundle_events: options.bundle_events.max(1),
            seq: TrackSequence::new(sample_defaults(options.sample_format), options.machine_id),
            sample_format: options.sample_format,
            perf_timebase: Vec::new(),
        }
    }

    fn system_packet(timestamp: Option<u64>) -> TracePacket {
        TracePacket {
            timestamp,
            trusted_packet_sequence_id: Some(SYSTEM_SEQUENCE_ID),
            ..TracePacket::default()
        }
    }

    /// Writes the `SystemInfo` packet. Write it first: the importer needs
    /// `release` to decode `prev_state`.
    pub fn system_info(&mut self, info: &SystemInfo) -> io::Result<()> {
        let mut p = Self::system_packet(None);
        p.system_info = Some(proto::SystemInfo {
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
        });
        self.sink.write(&mut p)
    }

    /// Writes a BOOTTIME + MONOTONIC + REALTIME snapshot with BOOTTIME as the
    /// trace clock. Write one at the start and then periodically.
    pub fn clock_snapshot(&mut self, snap: &ClockSnapshot) -> io::Result<()> {
        let clock = |id, ts| proto::Clock {
            clock_id: Some(id),
            timestamp: Some(ts),
        };
        let mut p = Self::system_packet(Some(snap.boottime_ns));
        p.clock_snapshot = Some(proto::ClockSnapshot {
            clocks: vec![
                clock(proto::CLOCK_BOOTTIME, snap.boottime_ns),
                clock(proto::CLOCK_MONOTONIC, snap.monotonic_ns),
                clock(proto::CLOCK_REALTIME, snap.realtime_ns),
            ],
            primary_trace_clock: Some(proto::CLOCK_BOOTTIME as i32),
        });
        self.sink.write(&mut p)
    }

    /// Writes a `ProcessTree` snapshot taken at `ts` (BOOTTIME ns).
    pub fn process_tree(
        &mut self,
        ts: u64,
        processes: &[ProcessInfo],
        threads: &[ThreadInfo],
    ) -> io::Result<()> {
        let process = |p: &ProcessInfo| {
            let (cmdline, is_comm) = if p.cmdline.is_empty() {
                let name = threads
                    .iter()
                    .find(|t| t.tid == p.pid && !t.name.is_empty())
                    .map_or_else(|| p.pid.to_string(), |t| t.name.clone());
                (vec![name], Some(true))
            } else {
                (p.cmdline.clone(), None)
            };
            proto::ProcessTreeProcess {
                pid: Some(p.pid),
                ppid: Some(p.ppid),
                cmdline,
                uid: p.uid.map(|u| u as i32),
                cmdline_is_comm: is_comm,
            }
        };
        let thread = |t: &ThreadInfo| proto::ProcessTreeThread {
            tid: Some(t.tid),
            name: Some(t.name.clone()),
            tgid: Some(t.tgid),
        };
        let mut p = Self::system_packet(Some(ts));
        p.process_tree = Some(proto::ProcessTree {
            processes: processes.iter().map(process).collect(),
            threads: threads.iter().map(thread).collect(),
        });
        self.sink.write(&mut p)
    }

    /// The open bundle of `cpu`, flushed first if an event at `ts` would go
    /// back in time inside it.
    fn bundle_for(&mut self, cpu: u32, ts: u64) -> io::Result<&mut CpuBundle> {
        if cpu >= MAX_CPUS {
            return Err(invalid(format!("cpu {cpu} is not below {MAX_CPUS}")));
        }
        let idx = cpu as usize;
        if idx >= self.cpus.len() {
            self.cpus.resize_with(idx + 1, CpuBundle::default);
        }
        if self.cpus[idx].goes_backwards(ts) {
            self.flush_cpu(cpu)?;
        }
        Ok(&mut self.cpus[idx])
    }

    /// Writes `cpu`'s bundle once it is full.
    fn after_push(&mut self, cpu: u32) -> io::Result<()> {
        if self.cpus[cpu as usize].len() >= self.bundle_events {
            self.flush_cpu(cpu)?;
        }
        Ok(())
    }

    fn flush_cpu(&mut self, cpu: u32) -> io::Result<()> {
        let bundle = &mut self.cpus[cpu as usize];
        if !bundle.has_data() {
            return Ok(());
        }
        let scratch = &mut self.sched_scratch;
        let result = self.sink.write_encoded(|out, machine_id| {
            bundle.encode_packet(cpu, SYSTEM_SEQUENCE_ID, machine_id, scratch, out)
        });
        bundle.clear();
        result
    }

    /// A `sched_switch` on `cpu` at `ts` to `next_pid`. Feed each CPU in time
    /// order; the previous task is implied by the CPU's previous switch.
    pub fn sched_switch(
        &mut self,
        cpu: u32,
        ts: u64,
        prev_state: i64,
        next_pid: i32,
        next_prio: i32,
        next_comm: &str,
    ) -> io::Result<()> {
        self.bundle_for(cpu, ts)?
            .push_switch(ts, prev_state, next_pid, next_prio, next_comm);
        self.after_push(cpu)
    }

    /// A `sched_waking` of `pid` that fired on `cpu` (whose running task is
    /// the waker) at `ts`.
    pub fn sched_waking(
        &mut self,
        cpu: u32,
        ts: u64,
        pid: i32,
        target_cpu: i32,
        prio: i32,
        comm: &str,
    ) -> io::Result<()> {
        self.bundle_for(cpu, ts)?
            .push_waking(ts, pid, target_cpu, prio, comm);
        self.after_push(cpu)
    }

    fn plain_event(&mut self, cpu: u32, event: FtraceEvent) -> io::Result<()> {
        let ts = event.timestamp.unwrap_or_default();
        self.bundle_for(cpu, ts)?.push_event(event);
        self.after_push(cpu)
    }

    fn event_header(ts: u64, firing_pid: i32) -> FtraceEvent {
        FtraceEvent {
            timestamp: Some(ts),
            pid: Some(firing_pid as u32),
            ..FtraceEvent::default()
        }
    }

    /// `task_newtask`: `firing_pid` created `new_pid`. `clone_flags &
    /// CLONE_THREAD (0x10000)` makes it a thread of the creator's process.
    #[allow(clippy::too_many_arguments)]
    pub fn task_newtask(
        &mut self,
        cpu: u32,
        ts: u64,
        firing_pid: i32,
        new_pid: i32,
        comm: &str,
        clone_flags: u64,
        oom_score_adj: i32,
    ) -> io::Result<()> {
        let mut e = Self::event_header(ts, firing_pid);
        e.task_newtask = Some(proto::TaskNewtask {
            pid: Some(new_pid),
            comm: Some(comm.to_owned()),
            clone_flags: Some(clone_flags),
            oom_score_adj: Some(oom_score_adj),
        });
        self.plain_event(cpu, e)
    }

    /// `task_rename`: `pid`'s comm changed (prctl, exec).
    pub fn task_rename(
        &mut self,
        cpu: u32,
        ts: u64,
        firing_pid: i32,
        pid: i32,
        old_comm: &str,
        new_comm: &str,
    ) -> io::Result<()> {
        let mut e = Self::event_header(ts, firing_pid);
        e.task_rename = Some(proto::TaskRename {
            pid: Some(pid),
            oldcomm: Some(old_comm.to_owned()),
            newcomm: Some(new_comm.to_owned()),
        });
        self.plain_event(cpu, e)
    }

    /// `sched_process_free`: `pid`'s task struct was freed (end of a thread).
    pub fn sched_process_free(
        &mut self,
        cpu: u32,
        ts: u64,
        firing_pid: i32,
        pid: i32,
        comm: &str,
        prio: i32,
    ) -> io::Result<()> {
        let mut e = Self::event_header(ts, firing_pid);
        e.sched_process_free = Some(proto::SchedProcessFree {
            comm: Some(comm.to_owned()),
            pid: Some(pid),
            prio: Some(prio),
        });
        self.plain_event(cpu, e)
    }

    /// Sets `lost_events` on `cpu`'s next bundle (written even if empty).
    /// CPUs at or above 1024 are ignored, as their events are rejected.
    pub fn mark_lost_events(&mut self, cpu: u32) {
        if cpu >= MAX_CPUS {
            return;
        }
        let idx = cpu as usize;
        if idx >= self.cpus.len() {
            self.cpus.resize_with(idx + 1, CpuBundle::default);
        }
        self.cpus[idx].mark_lost_events();
    }

    /// Writes every open CPU bundle.
    pub fn flush_sched(&mut self) -> io::Result<()> {
        for cpu in 0..self.cpus.len() as u32 {
            self.flush_cpu(cpu)?;
        }
        Ok(())
    }

    /// Writes every open bundle and hands all buffered bytes to `W`, then
    /// flushes it: what `W` holds afterwards is a valid trace.
    pub fn flush(&mut self) -> io::Result<()> {
        self.flush_sched()?;
        self.sink.flush()
    }

    /// Bytes of complete packets produced so far (excluding events still in
    /// open CPU bundles).
    pub fn bytes_written(&self) -> u64 {
        self.sink.bytes_written()
    }

    /// Writes everything still open and returns `W`; the trace is complete.
    pub fn finish(mut self) -> io::Result<W> {
        self.flush_sched()?;
        self.sink.into_inner()
    }
}
