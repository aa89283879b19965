//! The step breakdown of `agent attach`: each rank's steps from the record
//! stream (its main thread's device calls and off-CPU intervals), by the
//! same analysis `agent merge` runs over recorded traces
//! (`analysis::steps`), with the data-parallel communicator picked the same
//! way (`analysis::groups`, from the communicators this recording saw).
//!
//! A rank's calls and intervals are kept until its finished steps are
//! computed (every `MARK_LIMIT` calls, and when its process ends or the
//! recording does); then only its steps are.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use xpuscope_probes::catalog::{CallKind as ProbeCallKind, CommOp};
use xpuscope_probes::decode::args::CallArgs;

use crate::analysis::groups::{self, CommInfo};
use crate::analysis::steps::{
    CallKind, CommSteps, DataLoaderStacks, OffCpuKind, Step, StepTracker, dp_comm_by_rank,
    rank_steps,
};
use crate::model::{DeviceCallRecord, OffCpuInterval, Record, process_comm_id};
use crate::sinks::detect::step_marks::{MarkedSteps, StepMark, StepMarks, StepSource};

/// One step of one rank, as the summary reports it (times in BOOTTIME).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankStep {
    pub rank: u32,
    pub pid: u32,
    #[serde(flatten)]
    pub step: Step,
    /// Where `step`'s number comes from: the job's step markers (the
    /// marked step the step's end falls in) or the count of the rank's
    /// gradient all-reduces, as the findings say it.
    pub step_source: &'static str,
}

/// Calls a rank's main thread keeps before its finished steps are
/// computed (64-byte marks: about 8 MB per rank).
const MARK_LIMIT: usize = 1 << 17;

pub struct RecordSteps {
    tracker: StepTracker,
    /// Which stacks wait in the data loader, per stack.
    loader_stacks: DataLoaderStacks,
    /// Ranked processes still running: pid -> global rank.
    ranks: BTreeMap<u32, u32>,
    /// Communicators seen (by hash), members as global ranks.
    comms: BTreeMap<u64, CommInfo>,
    /// Ranks whose process ended: (pid, rank, steps per communicator,
    /// its marked steps).
    ended: Vec<(u32, u32, CommSteps, MarkedSteps)>,
    /// The job's step markers (they number the steps where a rank has
    /// them, as the detectors do).
    marks: StepMarks,
    scratch: Vec<StepMark>,
}

impl Default for RecordSteps {
    fn default() -> Self {
        Self {
            tracker: StepTracker::with_mark_limit(MARK_LIMIT),
            ranks: BTreeMap::new(),
            comms: BTreeMap::new(),
            ended: Vec::new(),
            marks: StepMarks::default(),
            scratch: Vec::new(),
            loader_stacks: DataLoaderStacks::default(),
        }
    }
}

impl RecordSteps {
    pub fn record(&mut self, r: &Record) {
        match r {
            Record::Identity { tgid, identity } => {
                if let Some(rank) = identity.rank.as_deref().and_then(|v| v.parse().ok()) {
                    self.ranks.insert(*tgid, rank);
                    self.tracker.follow(*tgid as i32);
                }
            }
            Record::DeviceCall(c) if c.unmatched.is_none() => self.call(c),
            Record::OffCpu(i) => self.off_cpu(i),
            Record::StepSeen(seen) if self.ranks.contains_key(&seen.tgid) => {
                self.marks.step_seen(seen)
            }
            Record::Exit {
                exit,
                process_ended: true,
            } => {
                let marked = self.marks.take(exit.tgid);
                if let Some(rank) = self.ranks.remove(&exit.tgid)
                    && let Some(steps) = self.tracker.finish_process(exit.tgid as i32)
                {
                    self.ended.push((exit.tgid, rank, steps, marked));
                }
            }
            _ => {}
        }
    }

    fn call(&mut self, c: &DeviceCallRecord) {
        let call = &c.call;
        let Some(&rank) = self.ranks.get(&call.tgid) else {
            return;
        };
        self.scratch.clear();
        self.marks.device_call(c, &mut self.scratch);
        let op = call
            .comm
            .as_ref()
            .and_then(|_| CommOp::of_name(call.function));
        if let (Some(comm), Some(op)) = (&call.comm, op)
            && let Some(hash) = comm.id_hash
        {
            let info = self.comms.entry(hash).or_insert_with(|| CommInfo {
                hash,
                ..CommInfo::default()
            });
            info.size = info.size.max(comm.size.unwrap_or(0));
            if info.members.len() < info.size as usize {
                info.members.resize(info.size as usize, None);
            }
            if let Some(slot) = comm.rank.and_then(|r| info.members.get_mut(r as usize)) {
                *slot = Some(rank);
            }
            info.ops.insert(op.label());
            info.operations += 1;
        }
        if call.tid != call.tgid {
            return;
        }
        let kind = match (&call.comm, op, &call.args) {
            (Some(comm), Some(op), args) => CallKind::Collective {
                comm: process_comm_id(comm.id_hash, Some(comm.handle)),
                stream: match args {
                    CallArgs::Collective(a) => a.stream,
                    CallArgs::SendRecv(a) => a.stream,
                    _ => None,
                },
                op,
            },
            (_, _, CallArgs::Sync { stream, .. })
                if matches!(call.kind, ProbeCallKind::Sync(_)) =>
            {
                CallKind::Sync { stream: *stream }
            }
            (_, _, CallArgs::Launch(l)) => CallKind::Work { stream: l.stream },
            (_, _, CallArgs::Memcpy(m)) => CallKind::Work { stream: m.stream },
            (_, _, CallArgs::Memset { stream, .. } | CallArgs::Graph { stream, .. }) => {
                CallKind::Work { stream: *stream }
            }
            _ => CallKind::Other,
        };
        self.tracker
            .call(call.tgid as i32, call.start_ts, c.end_ts(), kind);
    }

    fn off_cpu(&mut self, i: &OffCpuInterval) {
        if i.tid != i.tgid || !self.tracker.follows(i.tgid as i32) {
            return;
        }
        let in_loader = i
            .stack
            .as_ref()
            .is_some_and(|s| self.loader_stacks.in_data_loader(s));
        self.tracker.off_cpu(
            i.tgid as i32,
            i.start,
            i.end,
            OffCpuKind::classify(i.state, in_loader),
        );
    }

    /// Every rank's steps on its data-parallel communicator, by rank and
    /// step.
    pub fn finish(mut self) -> Vec<RankStep> {
        for (pid, steps) in std::mem::take(&mut self.tracker).finish() {
            if let Some(rank) = self.ranks.get(&(pid as u32)) {
                let marked = self.marks.take(pid as u32);
                self.ended.push((pid as u32, *rank, steps, marked));
            }
        }
        let ranks: BTreeSet<u32> = self.ended.iter().map(|(_, r, _, _)| *r).collect();
        let comms: Vec<CommInfo> = self.comms.into_values().collect();
        let dp = dp_comm_by_rank(&groups::infer(&comms, &ranks));
        let mut rows: Vec<RankStep> = self
            .ended
            .into_iter()
            .flat_map(|(pid, rank, steps, marked)| {
                number_by_marks(rank_steps(steps, dp.get(&rank).copied()), &marked)
                    .into_iter()
                    .map(move |(step, source)| RankStep {
                        rank,
                        pid,
                        step,
                        step_source: source.describe(),
                    })
            })
            .collect();
        rows.sort_by_key(|r| (r.rank, r.step.start_ns));
        rows
    }
}

/// A rank's steps (in order) numbered as the job numbers them where it
/// does (markers, its Python step counter): each takes the job's step its
/// end (its optimizer's sync) falls in. Steps before the first such
/// number (the agent attached, or had not read the counter yet) count
/// back from it, one per all-reduce; where the job numbers none, the
/// all-reduce count stands.
fn number_by_marks(steps: Vec<Step>, marked: &MarkedSteps) -> Vec<(Step, StepSource)> {
    let numbers: Vec<Option<u64>> = steps
        .iter()
        .map(|s| marked.step_at(s.end_ns.saturating_sub(1)))
        .collect();
    let first = steps
        .iter()
        .zip(&numbers)
        .find_map(|(s, n)| n.map(|n| n as i64 - s.step as i64));
    let mut seen_first = false;
    steps
        .into_iter()
        .zip(numbers)
        .map(|(mut step, n)| {
            seen_first |= n.is_some();
            let job = match (n, first) {
                (Some(n), _) => Some(n),
                (None, Some(offset)) if !seen_first => {
                    u64::try_from(step.step as i64 + offset).ok()
                }
                _ => None,
            };
            match job {
                Some(n) => {
                    step.step = n;
                    (step, marked.source())
                }
                None => (step, StepSource::AllReduces),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use xpuscope_probes::catalog::{Collective, Library, SyncKind};
    use xpuscope_probes::decode::DeviceCall;
    use xpuscope_probes::decode::args::CollectiveArgs;
    use xpuscope_probes::decode::comm::CommContext;

    use super::*;
    use crate::events::{Comm, Exit};
    use crate::model::{RankIdentity, Stack, SymFrame};
    use crate::sinks::detect::step_marks::{STEP_SOURCE_ALLREDUCE, STEP_SOURCE_MARKERS};

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;
    const DP: u64 = 0xd0;

    fn call(pid: u32, tid: u32, start: u64, end: u64, function: &'static str) -> DeviceCall {
        DeviceCall {
            library: Library::Nccl,
            function,
            kind: ProbeCallKind::Launch(xpuscope_probes::catalog::LaunchKind::Kernel),
            tgid: pid,
            tid,
            start_ts: start,
            end_ts: Some(end),
            args: CallArgs::None,
            ret: Some(0),
            error: false,
            name: function.into(),
            comm: None,
            memory: None,
            site: None,
            launches: None,
        }
    }

    fn record(c: DeviceCall) -> Record {
        Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
    }

    fn all_reduce(pid: u32, rank: u32, start: u64, end: u64) -> Record {
        let mut c = call(pid, pid, start, end, "ncclAllReduce");
        c.kind = ProbeCallKind::Collective(Collective::AllReduce);
        c.args = CallArgs::Collective(CollectiveArgs {
            op: Collective::AllReduce,
            count: Some(1),
            dtype: None,
            bytes: None,
            red_op: None,
            root: None,
            send: None,
            recv: None,
            comm: 0xc0,
            stream: Some(2),
        });
        c.comm = Some(CommContext {
            handle: 0xc0,
            id_hash: Some(DP),
            rank: Some(rank),
            size: Some(2),
            seq: None,
            seq_exact: false,
        });
        record(c)
    }

    fn sync(pid: u32, start: u64, end: u64) -> Record {
        let mut c = call(pid, pid, start, end, "cudaStreamSynchronize");
        c.library = Library::Cudart;
        c.kind = ProbeCallKind::Sync(SyncKind::Stream);
        c.args = CallArgs::Sync {
            stream: Some(2),
            event: None,
        };
        record(c)
    }

    fn off_cpu(pid: u32, start: u64, end: u64, state: i64, frame: Option<&str>) -> Record {
        let stack = frame.map(|f| {
            Arc::new(Stack {
                kernel: Vec::new(),
                user: vec![SymFrame {
                    function: f.into(),
                    module: "/sim/rank".into(),
                    module_start: 0,
                    module_end: 0,
                    module_offset: 0,
                    rel_pc: 0,
                }],
            })
        });
        Record::OffCpu(OffCpuInterval {
            tid: pid,
            tgid: pid,
            cpu: 0,
            start,
            end,
            state,
            stack,
            preempted_by: None,
            truncated: false,
        })
    }

    /// Step k of a rank: 10 ms from `base`: asleep for its batch, kept
    /// off CPU in the loader and elsewhere, backward (a launch), the
    /// gradient all-reduce and its sync, the optimizer's sync.
    fn step(pid: u32, rank: u32, base: u64) -> Vec<Record> {
        vec![
            off_cpu(pid, base + 100 * US, base + 2 * MS, 1, None),
            off_cpu(
                pid,
                base + 2100 * US,
                base + 2200 * US,
                0,
                Some("dataloader_next"),
            ),
            off_cpu(
                pid,
                base + 2500 * US,
                base + 2600 * US,
                0x100,
                Some("host_work"),
            ),
            record(call(
                pid,
                pid,
                base + 3 * MS,
                base + 4900 * US,
                "cudaLaunchKernel",
            )),
            // Another thread's calls are not the step's.
            record(call(
                pid,
                pid + 1,
                base + 3 * MS,
                base + 9 * MS,
                "cudaLaunchKernel",
            )),
            all_reduce(pid, rank, base + 5 * MS, base + 5010 * US),
            sync(pid, base + 5020 * US, base + 7 * MS),
            sync(pid, base + 7100 * US, base + 8 * MS),
        ]
    }

    fn identity(pid: u32, rank: Option<&str>) -> Record {
        Record::Identity {
            tgid: pid,
            identity: Box::new(RankIdentity {
                rank: rank.map(str::to_owned),
                ..RankIdentity::default()
            }),
        }
    }

    fn exit(pid: u32) -> Record {
        Record::Exit {
            exit: Exit {
                cpu: 0,
                ts: 1,
                tid: pid,
                tgid: pid,
                prio: 120,
                comm: Comm::from_str_lossy("rank"),
                group_dead: true,
                group_known: true,
                exit_code: None,
            },
            process_ended: true,
        }
    }

    #[test]
    fn ranks_steps_from_their_calls_and_time_off_cpu() {
        let mut s = RecordSteps::default();
        s.record(&identity(10, Some("0")));
        s.record(&identity(20, Some("1")));
        s.record(&identity(30, None)); // not a rank
        for k in 0..4 {
            for pid in [10, 20, 30] {
                for r in step(pid, pid / 10 - 1, 100 * MS + k * 10 * MS) {
                    s.record(&r);
                }
            }
        }
        // Rank 0 ends: its steps are kept, its calls are not.
        s.record(&exit(10));
        assert!(!s.tracker.follows(10));
        let rows = s.finish();
        assert_eq!(rows.len(), 2 * 3, "steps 1..3 of two ranks: {rows:#?}");
        for (i, r) in rows.iter().enumerate() {
            let k = i as u64 % 3 + 1;
            assert_eq!((r.rank, r.pid), (i as u32 / 3, 10 * (i as u32 / 3 + 1)));
            let base = 100 * MS + k * 10 * MS;
            assert_eq!(
                r.step,
                Step {
                    step: k,
                    start_ns: base - 2 * MS,
                    end_ns: base + 8 * MS,
                    dur_ns: 10 * MS,
                    data_wait_ns: 1900 * US + 100 * US,
                    preempted_ns: 100 * US,
                    grad_sync_ns: 7 * MS - 4900 * US,
                    comm_wait_ns: 7 * MS - 5020 * US,
                    compute_wait_ns: 900 * US,
                    host_ns: 10 * MS - 2000 * US - 100 * US - 1980 * US - 900 * US,
                    // No launch with its stream: the optimizer's sync is
                    // the compute seen; the all-reduce until its sync.
                    compute_ns: 900 * US,
                    comm_ns: 2 * MS,
                    exposed_comm_ns: 2 * MS,
                }
            );
        }
    }

    fn marker(pid: u32, kind: ProbeCallKind, at: u64, message: Option<String>, id: u64) -> Record {
        let mut c = call(pid, pid, at, at + 2 * US, "mstxRangeStartA");
        c.library = Library::Mspti;
        c.kind = kind;
        c.args = CallArgs::Marker {
            message,
            range_id: Some(id),
        };
        record(c)
    }

    /// Rank 0 marks its steps (`step 50` ..), as a job attached to in the
    /// middle of its run: its rows carry the job's numbers; rank 1 marks
    /// none: its rows are counted.
    #[test]
    fn marked_steps_are_numbered_as_the_job_numbers_them() {
        let mut s = RecordSteps::default();
        s.record(&identity(10, Some("0")));
        s.record(&identity(20, Some("1")));
        for k in 0..4 {
            let base = 100 * MS + k * 10 * MS;
            s.record(&marker(
                10,
                ProbeCallKind::RangeStart,
                base,
                Some(format!("step {}", 50 + k)),
                k + 1,
            ));
            for pid in [10, 20] {
                for r in step(pid, pid / 10 - 1, base) {
                    s.record(&r);
                }
            }
            s.record(&marker(
                10,
                ProbeCallKind::RangeEnd,
                base + 9 * MS,
                None,
                k + 1,
            ));
        }
        s.record(&exit(10));
        let rows = s.finish();
        let got: Vec<(u32, u64, &str)> = rows
            .iter()
            .map(|r| (r.rank, r.step.step, r.step_source))
            .collect();
        let (m, a) = (STEP_SOURCE_MARKERS, STEP_SOURCE_ALLREDUCE);
        assert_eq!(
            got,
            vec![
                (0, 51, m),
                (0, 52, m),
                (0, 53, m),
                (1, 1, a),
                (1, 2, a),
                (1, 3, a)
            ]
        );
    }

    /// Steps before the first the job numbered count back from it; a rank
    /// the job numbers nothing of keeps the all-reduce count.
    #[test]
    fn steps_before_the_first_numbered_one_count_back_from_it() {
        let steps: Vec<Step> = (0..6)
            .map(|k| Step {
                step: k,
                start_ns: k * 10 * MS,
                end_ns: (k + 1) * 10 * MS,
                ..Step::default()
            })
            .collect();
        let mut marked = MarkedSteps::default();
        // The counter was first read in the fourth step: 103.
        marked.counter(103, 32 * MS);
        marked.counter(104, 41 * MS);
        marked.counter(105, 52 * MS);
        let got: Vec<(u64, StepSource)> = number_by_marks(steps.clone(), &marked)
            .into_iter()
            .map(|(s, src)| (s.step, src))
            .collect();
        let p = StepSource::PythonCounter;
        assert_eq!(
            got,
            vec![(100, p), (101, p), (102, p), (103, p), (104, p), (105, p)]
        );
        let plain: Vec<(u64, StepSource)> = number_by_marks(steps, &MarkedSteps::default())
            .into_iter()
            .map(|(s, src)| (s.step, src))
            .collect();
        assert_eq!(
            plain,
            (0..6)
                .map(|k| (k, StepSource::AllReduces))
                .collect::<Vec<_>>()
        );
    }
}
