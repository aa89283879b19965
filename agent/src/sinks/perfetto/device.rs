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
use xpuscope_probes::catalog::Vendor;
use xpuscope_probes::decode::OpenReason;

use super::{PerfettoSink, args};
use crate::model::{
    CallSummary, DeviceCallRecord, DeviceWork, EnqueueMarker, InFlightCall, LiveSiteRow,
    MemoryHeld, RankIdentity, Site, StepSplitRecord, StreamTrack, site_label,
};
use crate::trace_schema::call::{call_args, slice_name};
use crate::trace_schema::keys as k;
use crate::trace_schema::names as n;

/// Tracks written for device records, per process.
#[derive(Default)]
pub struct DeviceTracks {
    memory: HashMap<(u32, Vendor, u32), TrackUuid>,
    /// Per rank process: its steps' counters.
    step_split: HashMap<u32, StepTracks>,
    /// Processes that ended, with their process track and step counters
    /// and when: a step split fed back after the exit (the detect sink's
    /// records come late) is drawn on them, not on a new, unnamed track.
    ended: HashMap<u32, EndedProcess>,
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

/// What late records of an ended process are drawn on.
#[derive(Clone, Copy)]
struct EndedProcess {
    track: TrackUuid,
    step_split: Option<StepTracks>,
    exited: u64,
}

/// A rank's per-step counters, each written from its first value on.
#[derive(Clone, Copy)]
struct StepTracks {
    host: TrackUuid,
    device: TrackUuid,
    launches: Option<TrackUuid>,
    graphs: Option<TrackUuid>,
}

/// Ended processes remembered for their late records.
const MAX_ENDED: usize = 4096;

impl DeviceTracks {
    /// A process ended at `ts`: its tracks were written; its pid may come
    /// back.
    pub fn process_ended(&mut self, tgid: u32, ts: u64) {
        self.memory.retain(|k, _| k.0 != tgid);
        let step_split = self.step_split.remove(&tgid);
        if let Some(&track) = self.processes.get(&tgid) {
            if self.ended.len() >= MAX_ENDED {
                self.ended.clear();
            }
            self.ended.insert(
                tgid,
                EndedProcess {
                    track,
                    step_split,
                    exited: ts,
                },
            );
        }
        self.processes.remove(&tgid);
        self.lanes.retain(|k, _| k.tgid != tgid);
        self.site_frames.retain(|_, (t, _)| *t != tgid);
    }

    /// A thread exited: its tid may come back in another process.
    pub fn thread_ended(&mut self, tid: u32) {
        self.threads.remove(&tid);
    }
}

/// The lane for work starting at `start` given each lane's last end: the
/// first lane free by then, or a new one (`ends.len()`).
fn pick_lane(ends: &[u64], start: u64) -> usize {
    ends.iter().position(|&e| e <= start).unwrap_or(ends.len())
}

/// Annotations naming the live sites `rows` (largest first):
/// `live_sites.1.bytes`, `live_sites.1.allocations`, `live_sites.1.stack`,
/// ... ([`k::LIVE_SITES`]).
fn site_annotations(rows: &[LiveSiteRow]) -> Vec<Arg> {
    let mut args = Vec::with_capacity(rows.len() * 3);
    for (i, r) in rows.iter().enumerate() {
        let n = i + 1;
        args.push(Arg::new(k::live_site(n, "bytes"), ArgValue::Uint(r.bytes)));
        args.push(Arg::new(
            k::live_site(n, "allocations"),
            ArgValue::Uint(r.allocations),
        ));
        args.push(Arg::new(
            k::live_site(n, "stack"),
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
            args.push(k::UNMATCHED.arg(format!("{reason:?}")));
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
            args.push(k::ALLOC_STACK.arg(site_label(r.site.as_ref())));
        }
        let end = r.end_ts();
        let stack = self.site_frames(r.site.as_ref());
        self.writer.slice_begin(
            track,
            call.start_ts,
            &slice_name(call),
            Some(n::DEVICE_CATEGORY),
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
                    &format!("{}{}", n::DEVICE_MEMORY_TRACK, m.device.index),
                    CounterUnit::SizeBytes,
                )?;
                self.device.memory.insert(key, t);
                t
            }
        };
        self.writer.counter(counter, ts, m.held_after as f64)?;
        if let (Some(req), Some(live)) = (m.failed_request, &r.oom) {
            let mut args = vec![
                k::REQUESTED.arg(req),
                k::DEVICE_BYTES_HELD.arg(m.held_after),
                k::DEVICE.arg(m.device.index.into()),
                k::RETURN.arg(call.ret.unwrap_or(0)),
                k::STACK.arg(site_label(r.site.as_ref())),
            ];
            args.extend(site_annotations(live));
            let stack = self.site_frames(r.site.as_ref());
            self.writer.instant(
                thread,
                ts,
                &format!("{}{}", call.function, n::FAILED_SUFFIX),
                &args,
                stack.as_deref(),
            )?;
        }
        Ok(())
    }

    /// A rank's finished step: the share of it that was host work and the
    /// share spent in device calls, two counters on its process track
    /// stepping at each step's start (a host-bound rank's first rises,
    /// its peers' second).
    pub(super) fn step_split(&mut self, s: &StepSplitRecord) -> Result<()> {
        let ended = self
            .device
            .ended
            .get(&s.tgid)
            .copied()
            .filter(|e| s.end <= e.exited);
        let known = match ended {
            Some(e) => e.step_split,
            None => self.device.step_split.get(&s.tgid).copied(),
        };
        let process = match ended {
            Some(e) => e.track,
            None => self.device_process_track(s.tgid)?,
        };
        let pct = || CounterUnit::Other("%".into());
        let mut t = match known {
            Some(t) => t,
            None => StepTracks {
                host: self
                    .writer
                    .counter_track(Some(process), n::STEP_HOST_TRACK, pct())?,
                device: self.writer.counter_track(
                    Some(process),
                    n::STEP_DEVICE_WAIT_TRACK,
                    pct(),
                )?,
                launches: None,
                graphs: None,
            },
        };
        let launches = s.launches.unwrap_or_default();
        if s.launches.is_some() && t.launches.is_none() {
            t.launches = Some(self.writer.counter_track(
                Some(process),
                n::STEP_LAUNCHES_TRACK,
                CounterUnit::Count,
            )?);
        }
        if launches.graphs > 0 && t.graphs.is_none() {
            t.graphs = Some(self.writer.counter_track(
                Some(process),
                n::STEP_GRAPH_LAUNCHES_TRACK,
                CounterUnit::Count,
            )?);
        }
        match self.device.ended.get_mut(&s.tgid) {
            Some(e) if ended.is_some() => e.step_split = Some(t),
            _ => {
                self.device.step_split.insert(s.tgid, t);
            }
        }
        self.writer
            .counter(t.host, s.start, 100.0 * s.split.host_share())?;
        self.writer
            .counter(t.device, s.start, 100.0 * s.split.device_wait_share())?;
        if s.launches.is_some() {
            for (track, n) in [(t.launches, launches.kernels), (t.graphs, launches.graphs)] {
                if let Some(track) = track {
                    self.writer.counter(track, s.start, n as f64)?;
                }
            }
        }
        Ok(())
    }

    /// Device memory still held, by site, as an instant on the process track.
    pub(super) fn memory_held(&mut self, m: &MemoryHeld) -> Result<()> {
        let mut args = vec![k::DEVICE_BYTES_HELD.arg(m.held)];
        args.extend(site_annotations(&m.rows));
        let stack = self.site_frames(m.rows.first().and_then(|r| r.site.as_ref()));
        let track = self.device_process_track(m.tgid)?;
        self.writer.instant(
            track,
            m.ts,
            &format!("{}{}", n::MEMORY_HELD_EVENT, m.at.describe()),
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
            k::CALLS.arg(s.calls),
            k::BUSY_NS.arg(s.busy_ns),
            k::RATE_LIMITED.arg(true),
        ];
        for (_, function, calls) in &s.functions {
            args.push(Arg::new(
                format!("{}.{function}", k::CALLS_PREFIX),
                ArgValue::Uint(*calls),
            ));
        }
        let name = match s.functions.as_slice() {
            [(_, function, _)] => format!("{function} x{} (rate-limited)", s.calls),
            _ => format!("{} device calls (rate-limited)", s.calls),
        };
        self.writer.slice_begin(
            track,
            s.start,
            &name,
            Some(n::DEVICE_CATEGORY),
            &args,
            &[],
            None,
        )?;
        self.writer.slice_end(track, s.end, &[])?;
        Ok(())
    }

    pub(super) fn in_flight_at_end(&mut self, c: &InFlightCall) -> Result<()> {
        let track = self.writer.thread_track(c.tgid as i32, c.tid as i32, "")?;
        let mut args = vec![
            k::STARTED.arg(c.start_ts),
            k::OPEN_NS.arg(c.end.saturating_sub(c.start_ts)),
        ];
        if let Some(s) = c.seq {
            args.push(k::SEQ.arg(s));
        }
        self.writer.instant(
            track,
            c.end,
            &format!("{}{}", c.function, n::IN_FLIGHT_AT_END_SUFFIX),
            &args,
            None,
        )?;
        Ok(())
    }

    /// A zero-length slice on the host thread where an API record says it
    /// enqueued device work; the flow to the work starts here.
    pub(super) fn enqueued(&mut self, m: &EnqueueMarker) -> Result<()> {
        let t = self.writer.thread_track(m.tgid as i32, m.tid as i32, "")?;
        let args = [k::CORRELATION_ID.arg(m.correlation)];
        self.writer.slice_begin(
            t,
            m.ts,
            n::ENQUEUED_EVENT,
            Some(n::DEVICE_CATEGORY),
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
        args.push(k::WORK_KIND.arg(w.kind.name()));
        self.writer.slice_begin(
            track,
            w.start,
            &w.name,
            Some(n::DEVICE_CATEGORY),
            &args,
            &[],
            None,
        )?;
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
