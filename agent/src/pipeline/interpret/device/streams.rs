//! Device work on per-stream tracks: which work goes on which stream, its
//! flow from the host call, and estimates where no activity records come.
//!
//! - Activity records (CUPTI/MSPTI, `--probe-level 2`): one slice per
//!   kernel / copy / HCCL task from its true device start to end, on a track
//!   "GPU 0 stream 7" under the process. A flow goes from the host API call
//!   that enqueued it (matched by correlation id through the API record: a
//!   zero-length "launch" slice on the calling thread at the API record's
//!   start) to the device slice.
//! - Without activity records: an estimate per stream, from the first
//!   launch after the previous window to the end of the next sync covering
//!   that stream, on "GPU 0 stream 0x... (estimated)", `estimated=true`.
//!
//! Records arrive late and out of order, so work is buffered per track and
//! written in start order when a track has more than [`MAX_BUFFERED`]
//! pending and at the end. Work that overlaps earlier work of its stream
//! goes to an extra lane track ("GPU 0 stream 7 #2") so slices nest (the
//! trace sink picks lanes).

use foldhash::HashMap;
use std::collections::HashSet;

use std::collections::VecDeque;

use crate::model::{Field, FieldValue, StreamTrack};
use xpuscope_probes::activity::ActivityKind;
use xpuscope_probes::catalog::CallKind;
use xpuscope_probes::decode::DeviceCall;

/// Most pending slices per track before they are written.
pub const MAX_BUFFERED: usize = 4096;
/// Most API records remembered for flows (cleared when exceeded).
pub const MAX_API_RECORDS: usize = 1 << 16;
/// Longest kernel name kept (characters).
pub const MAX_NAME_CHARS: usize = 256;
/// Most calls held per process waiting for their API record.
pub const MAX_HELD: usize = 1024;
/// Flow ids from here on (unique in the trace, never reused).
const FLOW_BASE: u64 = 0x5850_0000_0000_0000;

/// Where a piece of device work goes.
pub type StreamKey = StreamTrack;

/// One pending slice.
#[derive(Clone, Debug)]
pub struct Work {
    pub start: u64,
    pub end: u64,
    pub name: String,
    pub args: Vec<Field>,
    /// The correlation id, to find the host call.
    pub correlation: Option<u64>,
    /// Which view of a collective this is, if one: MSPTI describes each
    /// HCCL operation twice (an HCCL record with its bandwidth, a
    /// communication record with its element count, type and correlation
    /// id), and the two become one slice.
    pub collective_view: Option<CollectiveView>,
    pub kind: crate::model::WorkKind,
}

/// The two MSPTI record kinds that describe one HCCL operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveView {
    Hccl,
    Communication,
}

/// How far back in a track's pending work the other view of a collective
/// is looked for (the two records are read one after the other).
const COLLECTIVE_VIEW_WINDOW: usize = 64;

/// Folds `work` into the other view of the same operation among the last
/// pending slices (same name, start and end); false if there is none.
fn merge_collective_view(pending: &mut [Work], work: &mut Work) -> bool {
    let Some(view) = work.collective_view else {
        return false;
    };
    let start = pending.len().saturating_sub(COLLECTIVE_VIEW_WINDOW);
    let Some(other) = pending[start..].iter_mut().rev().find(|w| {
        w.collective_view.is_some_and(|v| v != view)
            && (w.start, w.end) == (work.start, work.end)
            && w.name == work.name
    }) else {
        return false;
    };
    for arg in work.args.drain(..) {
        if !other.args.iter().any(|a| a.name == arg.name) {
            other.args.push(arg);
        }
    }
    other.correlation = other.correlation.or(work.correlation);
    // Merged: a third record of the operation would be a new slice.
    other.collective_view = None;
    true
}

/// The host side of a correlation: the API record's thread and start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostCall {
    pub tid: u32,
    pub ts: u64,
}

/// A host call that enqueued device work, waiting for its API record.
#[derive(Clone, Debug)]
pub struct HeldCall {
    pub call: DeviceCall,
}

/// An estimate window being built.
#[derive(Clone, Copy, Debug)]
pub struct OpenWindow {
    pub device: u32,
    pub first_launch: u64,
    pub launches: u64,
}

#[derive(Debug, Default)]
pub struct DeviceStreams {
    pub pending: HashMap<StreamKey, Vec<Work>>,
    /// (tgid, correlation id) -> the host API call.
    pub api: HashMap<(u32, u64), HostCall>,
    /// (tgid, correlation id) -> the flow already on the host call's slice.
    pub launch_flows: HashMap<(u32, u64), u64>,
    /// Processes that produce API records.
    pub api_seen: HashSet<u32>,
    /// (tgid, kind) of the device work each process's records described.
    pub work_seen: HashSet<(u32, ActivityKind)>,
    /// Per process: calls waiting for their API record, in order.
    pub held: HashMap<u32, VecDeque<HeldCall>>,
    next_flow: u64,
    /// Processes with activity records: no estimates for them.
    pub with_activity: HashSet<u32>,
    /// (tgid, tid) -> current device (`cudaSetDevice`).
    pub current_device: HashMap<(u32, u32), u32>,
    /// (tgid, vendor is Ascend, stream) -> open estimate window.
    pub open: HashMap<(u32, bool, u64), OpenWindow>,
}

impl DeviceStreams {
    pub fn new_flow(&mut self) -> u64 {
        self.next_flow += 1;
        FLOW_BASE + self.next_flow
    }

    pub fn remember_api(&mut self, tgid: u32, correlation: u64, call: HostCall) {
        if self.api.len() >= MAX_API_RECORDS {
            self.api.clear();
        }

        self.api.insert((tgid, correlation), call);
    }

    /// A flow id for the host call of `correlation` (on its slice).
    pub fn launch_flow(&mut self, tgid: u32, correlation: u64) -> u64 {
        if self.launch_flows.len() >= MAX_API_RECORDS {
            self.launch_flows.clear();
        }
        let id = self.new_flow();
        self.launch_flows.insert((tgid, correlation), id);
        id
    }

    /// Whether a host call of `kind` in process `tgid` waits for its API
    /// record (for the flow id on its slice), once the process produces
    /// API records. Launches do: kernel records are what a consumer reads
    /// API records for. Copies only once the process has shown a copy
    /// record: consumers often leave those off (MSPTI ones do), and a flow
    /// from a copy would then end nowhere.
    pub fn awaits_api_record(&self, tgid: u32, kind: CallKind) -> bool {
        let awaits = match kind {
            CallKind::Launch(_) => true,
            CallKind::Memcpy => self.work_seen.contains(&(tgid, ActivityKind::Memcpy)),
            _ => false,
        };
        awaits && self.api_seen.contains(&tgid)
    }

    /// Drops what is kept about an exited process (its written tracks and
    /// whether it had activity records stay).
    pub fn forget_process(&mut self, tgid: u32) {
        self.work_seen.retain(|k| k.0 != tgid);
        self.api.retain(|k, _| k.0 != tgid);
        self.launch_flows.retain(|k, _| k.0 != tgid);
        self.current_device.retain(|k, _| k.0 != tgid);
        self.open.retain(|k, _| k.0 != tgid);
        self.held.remove(&tgid);
    }

    /// Buffers work; true when its track should be flushed now.
    pub fn push(&mut self, key: StreamKey, mut work: Work) -> bool {
        let v = self.pending.entry(key).or_default();
        if merge_collective_view(v, &mut work) {
            return false;
        }
        v.push(work);
        v.len() > MAX_BUFFERED
    }
}

/// "GPU 0 stream 7" / "NPU 1 stream 3".
pub fn stream_track_name(ascend: bool, device: Option<u32>, stream: Option<u64>) -> String {
    let unit = if ascend { "NPU" } else { "GPU" };
    let dev = device.map_or("?".to_string(), |d| d.to_string());
    let stream = stream.map_or("?".to_string(), |s| s.to_string());
    format!("{unit} {dev} stream {stream}")
}

/// "GPU 0 stream 0x7f.. (estimated)" (a host stream handle; 0 = default).
pub fn estimated_track_name(ascend: bool, device: u32, stream: u64) -> String {
    let unit = if ascend { "NPU" } else { "GPU" };
    if stream == 0 {
        format!("{unit} {device} stream default (estimated)")
    } else {
        format!("{unit} {device} stream {stream:#x} (estimated)")
    }
}

/// A name read from the application, bounded; "kernel" when unreadable.
pub fn bounded_name(name: Option<&str>, fallback: &str) -> String {
    match name {
        Some(n) if !n.trim().is_empty() => n.chars().take(MAX_NAME_CHARS).collect(),
        _ => fallback.to_string(),
    }
}

pub fn estimated_args(launches: u64) -> Vec<Field> {
    vec![
        Field::new("estimated", FieldValue::Bool(true)),
        Field::new("kernels", FieldValue::Uint(launches)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_await_api_records_only_once_copy_records_show() {
        use xpuscope_probes::catalog::{LaunchKind, SyncKind};
        let mut st = DeviceStreams::default();
        let launch = CallKind::Launch(LaunchKind::Kernel);
        assert!(!st.awaits_api_record(1, launch), "no API records yet");
        st.api_seen.insert(1);
        assert!(st.awaits_api_record(1, launch));
        assert!(
            !st.awaits_api_record(1, CallKind::Memcpy),
            "no copy records"
        );
        assert!(!st.awaits_api_record(1, CallKind::Sync(SyncKind::Stream)));
        assert!(!st.awaits_api_record(2, launch), "another process");
        st.work_seen.insert((1, ActivityKind::Memcpy));
        assert!(st.awaits_api_record(1, CallKind::Memcpy));
        st.forget_process(1);
        st.api_seen.insert(1);
        assert!(!st.awaits_api_record(1, CallKind::Memcpy));
    }

    fn view(start: u64, end: u64, v: CollectiveView, args: &[(&str, u64)]) -> Work {
        Work {
            start,
            end,
            name: "HcclAllReduce".into(),
            args: args
                .iter()
                .map(|(k, x)| Field::new(*k, FieldValue::Uint(*x)))
                .collect(),
            correlation: (v == CollectiveView::Communication).then_some(9),
            collective_view: Some(v),
            kind: crate::model::WorkKind::Communication,
        }
    }

    #[test]
    fn the_two_mspti_views_of_a_collective_are_one_slice() {
        use CollectiveView::{Communication, Hccl};
        let mut st = DeviceStreams::default();
        let key = StreamKey {
            tgid: 1,
            name: "NPU 0 stream 3".into(),
            estimated: false,
        };
        st.push(
            key.clone(),
            view(10, 20, Hccl, &[("stream", 3), ("bandwidth", 5)]),
        );
        st.push(
            key.clone(),
            view(10, 20, Communication, &[("stream", 3), ("count", 64)]),
        );
        // Another operation at other times, and a third record of the first.
        st.push(key.clone(), view(30, 40, Communication, &[("count", 8)]));
        st.push(key.clone(), view(10, 20, Hccl, &[("bandwidth", 6)]));
        let pending = &st.pending[&key];
        assert_eq!(pending.len(), 3, "{pending:?}");
        let merged = &pending[0];
        let names: Vec<&str> = merged.args.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["stream", "bandwidth", "count"]);
        assert_eq!(merged.correlation, Some(9));
        assert_eq!((pending[1].start, pending[2].start), (30, 10));
    }

    #[test]
    fn names() {
        assert_eq!(stream_track_name(false, Some(0), Some(7)), "GPU 0 stream 7");
        assert_eq!(stream_track_name(true, Some(1), Some(3)), "NPU 1 stream 3");
        assert_eq!(
            estimated_track_name(false, 0, 0x10),
            "GPU 0 stream 0x10 (estimated)"
        );
        assert_eq!(bounded_name(None, "kernel"), "kernel");
        assert_eq!(bounded_name(Some(""), "kernel"), "kernel");
        assert_eq!(bounded_name(Some(&"k".repeat(999)), "x").len(), 256);
    }
}
