//! The job's own step markers: mstx ranges (`mstxRangeStartA("step 12")`
//! .. `mstxRangeEnd`) and marks (`mstxMarkA("step 12")`) whose message
//! names a training step, as Ascend training scripts (and the profilers'
//! step annotations) emit them. Where a rank has them, its findings carry
//! the job's own step numbers (right even when the agent attached in the
//! middle of the run, and for jobs with several all-reduces per step);
//! elsewhere the detectors count steps by the rank's gradient all-reduces
//! (see [`STEP_SOURCE_ALLREDUCE`]).
//!
//! A message names a step when it is one of [`STEP_WORDS`] followed by the
//! step number (`step 12`, `Step_12`, `iteration=12`, `global_step:12`,
//! `step 12 fwd` does not count: a step range holds everything of the
//! step, sub-ranges are not steps). Any thread of the process may open a
//! step range (the training thread does); ranges nest with others freely.
//! A mark `step N` starts step N and ends the previous marked step.
//!
//! Python ranks without markers number their steps by their Python step
//! counter ([`StepSeen`]: the training loop's `step`, `global_step`, ...
//! read off the frames of the rank's off-CPU stacks): a step starts where
//! a new value is first seen. That dates steps to the first wait of each
//! (a rank waits in every step: for its data, its device, its peers), so
//! it numbers what the all-reduces bound; markers, where a rank has both,
//! win (they bound steps exactly).
//!
//! Memory: per process, the open step ranges (at most [`MAX_OPEN`]) and
//! the starts of its last [`MAX_STARTS`] steps (to date a finding at a
//! time); forgotten when the process exits.

use foldhash::HashMap;
use std::collections::VecDeque;

use xpuscope_probes::catalog::CallKind;
use xpuscope_probes::decode::args::CallArgs;

use crate::model::{DeviceCallRecord, StepSeen};

/// Where a finding's step number comes from (evidence `step_source`): the
/// rank's gradient all-reduces (the n-th on its data-parallel communicator
/// closes step n, counted from when the agent first saw the rank).
pub const STEP_SOURCE_ALLREDUCE: &str = "all-reduces on the rank's data-parallel communicator";
/// ... or the job's own step markers.
pub const STEP_SOURCE_MARKERS: &str = "the job's mstx step markers (\"step N\")";
/// ... or the job's own step counter in its Python frames.
pub const STEP_SOURCE_PYTHON: &str =
    "the job's Python step counter (its training loop's step, global_step, iteration, ...)";

/// The words a step marker starts with (any case).
pub const STEP_WORDS: [&str; 5] = ["global_step", "train_step", "iteration", "step", "iter"];

/// Open step ranges kept per process (a range never ended is dropped
/// oldest first).
const MAX_OPEN: usize = 8;
/// Step starts kept per process for dating findings.
const MAX_STARTS: usize = 4096;

/// Where a step came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepSource {
    #[default]
    AllReduces,
    Markers,
    PythonCounter,
}

impl StepSource {
    pub fn describe(self) -> &'static str {
        match self {
            StepSource::AllReduces => STEP_SOURCE_ALLREDUCE,
            StepSource::Markers => STEP_SOURCE_MARKERS,
            StepSource::PythonCounter => STEP_SOURCE_PYTHON,
        }
    }
}

/// A step boundary the job marked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMark {
    /// Step `step` of process `tgid` began at `ts`.
    Begin { tgid: u32, step: u64, ts: u64 },
    /// ... and ended: it ran from `start` to `end`.
    End {
        tgid: u32,
        step: u64,
        start: u64,
        end: u64,
    },
}

#[derive(Default)]
struct ProcessMarks {
    /// Open step ranges: (range id, step, start).
    open: VecDeque<(u64, u64, u64)>,
    /// The step a `step N` mark opened: (step, start).
    marked: Option<(u64, u64)>,
    /// (start, step), in start order.
    starts: MarkedSteps,
}

impl ProcessMarks {
    fn began(&mut self, step: u64, ts: u64) {
        self.starts.marker(step, ts);
    }
}

/// Every process's step markers.
#[derive(Default)]
pub struct StepMarks {
    procs: HashMap<u32, ProcessMarks>,
}

impl StepMarks {
    /// A returned call: the step boundaries it marks (a mark both ends one
    /// step and begins the next).
    pub fn device_call(&mut self, c: &DeviceCallRecord, out: &mut Vec<StepMark>) {
        let call = &c.call;
        let CallArgs::Marker { message, range_id } = &call.args else {
            return;
        };
        let tgid = call.tgid;
        let ts = call.start_ts;
        match call.kind {
            CallKind::RangeStart => {
                let (Some(step), Some(id)) = (message.as_deref().and_then(step_number), range_id)
                else {
                    return;
                };
                let p = self.procs.entry(tgid).or_default();
                if p.open.len() >= MAX_OPEN {
                    p.open.pop_front();
                }
                p.open.push_back((*id, step, ts));
                p.began(step, ts);
                out.push(StepMark::Begin { tgid, step, ts });
            }
            CallKind::RangeEnd => {
                let Some(id) = range_id else { return };
                let Some(p) = self.procs.get_mut(&tgid) else {
                    return;
                };
                let Some(i) = p.open.iter().position(|(r, _, _)| r == id) else {
                    return;
                };
                let (_, step, start) = p.open.remove(i).expect("found");
                out.push(StepMark::End {
                    tgid,
                    step,
                    start,
                    end: ts.max(start),
                });
            }
            CallKind::Mark => {
                let Some(step) = message.as_deref().and_then(step_number) else {
                    return;
                };
                let p = self.procs.entry(tgid).or_default();
                if let Some((prev, start)) = p.marked.replace((step, ts)) {
                    out.push(StepMark::End {
                        tgid,
                        step: prev,
                        start,
                        end: ts.max(start),
                    });
                }
                p.began(step, ts);
                out.push(StepMark::Begin { tgid, step, ts });
            }
            _ => {}
        }
    }

    /// A rank's Python step counter showed a new value: its step from
    /// there on, unless it has markers.
    pub fn step_seen(&mut self, s: &StepSeen) {
        self.procs
            .entry(s.tgid)
            .or_default()
            .starts
            .counter(s.step, s.ts);
    }

    /// Where process `tgid`'s steps are numbered from, if it numbers them
    /// itself (markers, or its Python step counter).
    pub fn source(&self, tgid: u32) -> Option<StepSource> {
        self.procs
            .get(&tgid)
            .filter(|p| !p.starts.starts.is_empty())
            .map(|p| p.starts.source)
    }

    /// The step process `tgid` was in at `ts` by its markers: the last one
    /// begun at or before `ts` (between steps: the one that just ended).
    pub fn step_at(&self, tgid: u32, ts: u64) -> Option<u64> {
        self.procs.get(&tgid)?.starts.step_at(ts)
    }

    pub fn forget(&mut self, tgid: u32) {
        self.procs.remove(&tgid);
    }

    /// Forgets process `tgid`, handing over its steps' starts (for a step
    /// table made after it ended).
    pub fn take(&mut self, tgid: u32) -> MarkedSteps {
        self.procs
            .remove(&tgid)
            .map(|p| p.starts)
            .unwrap_or_default()
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.procs.contains_key(&tgid)
    }
}

/// One process's marked steps' starts, kept past its exit.
#[derive(Clone, Debug, Default)]
pub struct MarkedSteps {
    /// (start, step), in start order.
    starts: VecDeque<(u64, u64)>,
    source: StepSource,
}

impl MarkedSteps {
    /// What numbered them (markers or the Python step counter).
    pub fn source(&self) -> StepSource {
        self.source
    }

    /// A marker began step `step` at `ts`. Markers replace what the
    /// Python step counter numbered (they bound steps exactly).
    pub fn marker(&mut self, step: u64, ts: u64) {
        if self.source != StepSource::Markers {
            self.starts.clear();
            self.source = StepSource::Markers;
        }
        self.began(step, ts);
    }

    /// The Python step counter first showed `step` at `ts` (ignored where
    /// markers number the steps).
    pub fn counter(&mut self, step: u64, ts: u64) {
        if self.source == StepSource::Markers {
            return;
        }
        self.source = StepSource::PythonCounter;
        self.began(step, ts);
    }

    /// Step `step` began at `ts` (the oldest is dropped past
    /// [`MAX_STARTS`]).
    fn began(&mut self, step: u64, ts: u64) {
        if self.starts.len() >= MAX_STARTS {
            self.starts.pop_front();
        }
        let at = self.starts.partition_point(|&(s, _)| s <= ts);
        self.starts.insert(at, (ts, step));
    }

    /// As [`StepMarks::step_at`].
    pub fn step_at(&self, ts: u64) -> Option<u64> {
        let i = self.starts.partition_point(|&(s, _)| s <= ts);
        Some(self.starts.get(i.checked_sub(1)?)?.1)
    }
}

/// The step number a marker's message names, if it names one: a word of
/// [`STEP_WORDS`] (any case), optional separators (` `, `_`, `-`, `=`,
/// `:`, `#`), the number, and nothing after it but whitespace.
pub fn step_number(message: &str) -> Option<u64> {
    let m = message.trim();
    let word = STEP_WORDS.iter().find(|w| {
        m.get(..w.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(w))
    })?;
    let rest = m[word.len()..].trim_start_matches([' ', '_', '-', '=', ':', '#']);
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || !rest[digits..].trim().is_empty() {
        return None;
    }
    rest[..digits].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use xpuscope_probes::catalog::Library;
    use xpuscope_probes::decode::DeviceCall;

    fn marker(
        kind: CallKind,
        message: Option<&str>,
        range_id: Option<u64>,
        ts: u64,
    ) -> DeviceCallRecord {
        let function = match kind {
            CallKind::RangeStart => "mstxRangeStartA",
            CallKind::RangeEnd => "mstxRangeEnd",
            _ => "mstxMarkA",
        };
        DeviceCallRecord::new(DeviceCall {
            library: Library::Mspti,
            function,
            kind,
            tgid: 7,
            tid: 7,
            start_ts: ts,
            end_ts: Some(ts + 1),
            args: CallArgs::Marker {
                message: message.map(str::to_owned),
                range_id,
            },
            ret: None,
            error: false,
            name: function.into(),
            comm: None,
            memory: None,
            site: None,
            launches: None,
        })
    }

    #[test]
    fn step_messages_are_recognised_and_sub_ranges_are_not() {
        for (m, want) in [
            ("step 12", Some(12)),
            ("Step_3", Some(3)),
            ("  iteration=40 ", Some(40)),
            ("global_step:7", Some(7)),
            ("train_step #9", Some(9)),
            ("iter-0", Some(0)),
            ("step 12 fwd", None),
            ("forward", None),
            ("step", None),
            ("stepper 3", None),
            ("step 99999999999999999999999", None),
            ("", None),
            ("ß step 1", None),
        ] {
            assert_eq!(step_number(m), want, "{m:?}");
        }
    }

    #[test]
    fn ranges_and_marks_give_steps_and_date_times() {
        let mut m = StepMarks::default();
        let mut out = Vec::new();
        // A sub-range inside the step range is no step.
        for r in [
            marker(CallKind::RangeStart, Some("step 41"), Some(5), 100),
            marker(CallKind::RangeStart, Some("forward"), Some(6), 110),
            marker(CallKind::RangeEnd, None, Some(6), 150),
            marker(CallKind::RangeEnd, None, Some(5), 200),
            marker(CallKind::RangeStart, Some("step 42"), Some(7), 210),
        ] {
            m.device_call(&r, &mut out);
        }
        assert_eq!(
            out,
            vec![
                StepMark::Begin {
                    tgid: 7,
                    step: 41,
                    ts: 100
                },
                StepMark::End {
                    tgid: 7,
                    step: 41,
                    start: 100,
                    end: 200
                },
                StepMark::Begin {
                    tgid: 7,
                    step: 42,
                    ts: 210
                },
            ]
        );
        assert_eq!(m.source(7), Some(StepSource::Markers));
        assert_eq!(m.source(8), None);
        assert_eq!(m.step_at(7, 99), None);
        assert_eq!(m.step_at(7, 100), Some(41));
        assert_eq!(
            m.step_at(7, 205),
            Some(41),
            "between steps: the one that ended"
        );
        assert_eq!(m.step_at(7, 10_000), Some(42));

        out.clear();
        m.device_call(
            &marker(CallKind::Mark, Some("step 43"), None, 300),
            &mut out,
        );
        m.device_call(
            &marker(CallKind::Mark, Some("step 44"), None, 400),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                StepMark::Begin {
                    tgid: 7,
                    step: 43,
                    ts: 300
                },
                StepMark::End {
                    tgid: 7,
                    step: 43,
                    start: 300,
                    end: 400
                },
                StepMark::Begin {
                    tgid: 7,
                    step: 44,
                    ts: 400
                },
            ]
        );
        m.forget(7);
        assert!(m.forgot(7) && m.step_at(7, 500).is_none());
    }

    fn seen(tgid: u32, step: u64, ts: u64) -> StepSeen {
        StepSeen {
            tgid,
            tid: tgid,
            ts,
            local: "step",
            step,
        }
    }

    /// A Python rank's step counter numbers its steps from where each
    /// value was first seen; a repeat (an epoch's counter starting over)
    /// is a new start; markers, once a rank has them, win for good.
    #[test]
    fn the_python_step_counter_numbers_steps_until_markers_come() {
        let mut m = StepMarks::default();
        assert_eq!(m.source(7), None);
        for (step, ts) in [(120, 1_000), (121, 2_000), (0, 3_000)] {
            m.step_seen(&seen(7, step, ts));
        }
        assert_eq!(m.source(7), Some(StepSource::PythonCounter));
        assert_eq!(m.step_at(7, 999), None, "before the first value seen");
        assert_eq!(m.step_at(7, 1_500), Some(120));
        assert_eq!(m.step_at(7, 2_999), Some(121));
        assert_eq!(m.step_at(7, 3_000), Some(0), "the counter started over");
        // Markers replace the counter's numbering...
        let mut out = Vec::new();
        m.device_call(
            &marker(CallKind::Mark, Some("step 500"), None, 4_000),
            &mut out,
        );
        assert_eq!(m.source(7), Some(StepSource::Markers));
        assert_eq!(m.step_at(7, 3_500), None, "the counter's starts are gone");
        // ...and the counter no longer counts.
        m.step_seen(&seen(7, 9, 5_000));
        assert_eq!(m.step_at(7, 6_000), Some(500));
        let taken = m.take(7);
        assert_eq!(taken.source(), StepSource::Markers);
        assert!(m.forgot(7));
    }

    #[test]
    fn unended_ranges_and_history_are_bounded() {
        let mut m = StepMarks::default();
        let mut out = Vec::new();
        for i in 0..(MAX_STARTS as u64 + 100) {
            let r = marker(
                CallKind::RangeStart,
                Some(&format!("step {i}")),
                Some(i),
                i * 10,
            );
            m.device_call(&r, &mut out);
        }
        let p = &m.procs[&7];
        assert_eq!(p.open.len(), MAX_OPEN);
        assert_eq!(p.starts.starts.len(), MAX_STARTS);
        // An end whose start was dropped ends nothing.
        out.clear();
        m.device_call(
            &marker(CallKind::RangeEnd, None, Some(0), 1 << 40),
            &mut out,
        );
        assert!(out.is_empty());
    }
}
