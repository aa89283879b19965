//! The host-side detectors over synthetic steps (records built here, no
//! kernel): each fires on its fault, at the right rank and step, and stays
//! quiet on clean-looking steps and on look-alikes (a late arrival is not a
//! stall, the rank's own threads are not contention, a warm-up is not a
//! leak).

use std::sync::Arc;
use std::time::Duration;

use xpuscope_probes::catalog::{CallKind, Collective, Library, SyncKind, Vendor};
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::CallArgs;
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::memory::{Device, MemoryEffect};

use super::super::tests::{exit, identity};
use super::super::{DetectConfig, Detectors};
use crate::events::Comm;
use crate::model::{
    DeviceCallRecord, Finding, FindingKind, OffCpuInterval, Preemptor, Record, Site, Stack,
    StepSeen, SymFrame,
};

const MS: u64 = 1_000_000;
const PID: u32 = 100;
const GPU0: Device = Device {
    vendor: Vendor::Nvidia,
    index: 0,
};

/// What one synthetic step holds besides its usual calls.
#[derive(Clone, Default)]
struct StepShape {
    /// The main thread's wait for its batch (asleep, loader stack or not).
    data_wait: u64,
    loader_stack: bool,
    /// Preempted in host work: (by pid, tid, comm, ns).
    preempted: Vec<(u32, u32, &'static str, u64)>,
    /// Asleep just before the all-reduce (a late arrival).
    late: u64,
    /// Bytes allocated at the leaking site (7), never freed.
    leak: i64,
}

struct Job {
    t: u64,
    records: Vec<(u64, Record)>,
    held: u64,
    /// The job marks each step with an mstx range `step N`, N from this.
    marked_from: Option<u64>,
    /// The job's Python step counter, seen from this step on (no markers).
    counted_from: Option<u64>,
    steps: u64,
}

fn device_call(kind: CallKind, function: &'static str, start: u64, end: u64) -> DeviceCall {
    DeviceCall {
        library: Library::Cudart,
        function,
        kind,
        tgid: PID,
        tid: PID,
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

/// The rank's gradient all-reduce (its data-parallel communicator's).
fn all_reduce(start: u64, end: u64) -> DeviceCall {
    let mut ar = device_call(
        CallKind::Collective(Collective::AllReduce),
        "ncclAllReduce",
        start,
        end,
    );
    ar.library = Library::Nccl;
    ar.comm = Some(CommContext {
        handle: 0xc0,
        id_hash: Some(0xd0),
        rank: Some(0),
        size: Some(2),
        seq: None,
        seq_exact: false,
    });
    ar
}

fn frame(f: &str) -> SymFrame {
    SymFrame {
        function: f.into(),
        module: "sim_rank".into(),
        module_start: 0,
        module_end: 0,
        module_offset: 0,
        rel_pc: 0,
    }
}

impl Job {
    fn new() -> Self {
        Job {
            t: 1_000 * MS,
            records: vec![(0, identity(PID, 0))],
            held: 0,
            marked_from: None,
            counted_from: None,
            steps: 0,
        }
    }

    fn call(&mut self, c: DeviceCall) -> &mut DeviceCallRecord {
        let end = c.end_ts.unwrap();
        self.records
            .push((end, Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))));
        match &mut self.records.last_mut().unwrap().1 {
            Record::DeviceCall(c) => c,
            _ => unreachable!(),
        }
    }

    fn sync(&mut self, start: u64, end: u64) {
        self.call(device_call(
            CallKind::Sync(SyncKind::Stream),
            "cudaStreamSynchronize",
            start,
            end,
        ));
        // It sleeps inside: not a data wait.
        self.off(start + 10_000, end - 10_000, 1, None, None);
    }

    fn off(
        &mut self,
        start: u64,
        end: u64,
        state: i64,
        stack: Option<Arc<Stack>>,
        by: Option<Preemptor>,
    ) {
        self.records.push((
            end,
            Record::OffCpu(OffCpuInterval {
                tid: PID,
                tgid: PID,
                cpu: 0,
                start,
                end,
                state,
                stack,
                preempted_by: by,
                truncated: false,
            }),
        ));
    }

    fn memory(&mut self, at: u64, delta: i64, site: u64, label: &str) {
        self.held = (self.held as i64 + delta) as u64;
        let held = self.held;
        let (f, kind) = if delta > 0 {
            ("cudaMalloc", CallKind::Malloc)
        } else {
            ("cudaFree", CallKind::Free)
        };
        let c = self.call(device_call(kind, f, at, at + 10_000));
        c.call.memory = Some(MemoryEffect {
            device: GPU0,
            delta,
            held_after: held,
            failed_request: None,
            untracked: false,
            site: Some(site),
        });
        c.site = Some(Arc::new(Site {
            id: site,
            tgid: PID,
            frames: vec![frame(label)],
            label: label.into(),
        }));
    }

    /// One step: batch wait, copy, forward (sync), host work, all-reduce,
    /// its sync, the optimizer's sync.
    fn marker(&mut self, kind: CallKind, at: u64, message: Option<String>, range_id: u64) {
        let function = match kind {
            CallKind::RangeStart => "mstxRangeStartA",
            _ => "mstxRangeEnd",
        };
        let mut c = device_call(kind, function, at, at + 5_000);
        c.library = Library::Mspti;
        c.args = CallArgs::Marker {
            message,
            range_id: Some(range_id),
        };
        self.call(c);
    }

    fn step(&mut self, s: &StepShape) {
        let b = self.t;
        let range = self.marked_from.map(|from| {
            let (n, id) = (from + self.steps, 1_000 + self.steps);
            self.marker(CallKind::RangeStart, b, Some(format!("step {n}")), id);
            id
        });
        self.steps += 1;
        let mut t = b + MS / 10;
        // The data wait: asleep in the loader's queue.
        let wait = s.data_wait.max(MS / 10);
        if let Some(from) = self.counted_from {
            // Its off-CPU stack shows the training loop's `step`.
            self.records.push((
                t,
                Record::StepSeen(StepSeen {
                    tgid: PID,
                    tid: PID,
                    ts: t,
                    local: "step",
                    step: from + self.steps - 1,
                }),
            ));
        }
        let stack = s.loader_stack.then(|| {
            Arc::new(Stack {
                kernel: vec![frame("futex_wait")],
                user: vec![frame("dataloader_next"), frame("train_step")],
            })
        });
        self.off(t, t + wait, 1, stack, None);
        t += wait + MS / 10;
        self.call(device_call(
            CallKind::Memcpy,
            "cudaMemcpyAsync",
            t,
            t + MS / 20,
        ));
        t += MS / 10;
        // A per-step workspace: allocated and freed (no growth).
        self.memory(t, 4 << 20, 8, "workspace < forward");
        if s.leak > 0 {
            self.memory(t + MS / 20, s.leak, 7, "cache_activations < forward");
        }
        t += MS / 5;
        self.sync(t, t + 2 * MS);
        t += 2 * MS + MS / 10;
        self.memory(t, -(4 << 20), 8, "workspace < forward");
        t += MS / 10;
        // Host work; the rank's own dataloader thread takes the CPU briefly.
        self.off(
            t,
            t + MS / 20,
            0,
            None,
            Some(Preemptor {
                tid: PID + 1,
                tgid: PID,
                comm: Comm::from_str_lossy("dataloader"),
                in_job: true,
            }),
        );
        t += MS / 10;
        for &(pid, tid, comm, ns) in &s.preempted {
            self.off(
                t,
                t + ns,
                0,
                None,
                Some(Preemptor {
                    tid,
                    tgid: pid,
                    comm: Comm::from_str_lossy(comm),
                    in_job: false,
                }),
            );
            t += ns + MS / 20;
        }
        t += MS;
        if s.late > 0 {
            self.off(t, t + s.late, 1, None, None);
            t += s.late + MS / 20;
        }
        self.call(all_reduce(t, t + MS / 20));
        t += MS / 10;
        self.sync(t, t + MS);
        t += MS + MS / 10;
        self.sync(t, t + MS / 2);
        if let Some(id) = range {
            self.marker(CallKind::RangeEnd, t + MS / 2 + MS / 20, None, id);
        }
        self.t = t + MS / 2 + MS / 10;
    }

    fn steps(&mut self, n: u64, shape: impl Fn(u64) -> StepShape) {
        for k in 0..n {
            self.step(&shape(k));
        }
    }

    /// The records in stream order (by the time each was emitted).
    fn run(self, cfg: DetectConfig) -> Vec<Finding> {
        self.run_to_end(cfg, false)
    }

    /// As [`run`](Self::run); with `extend`, the findings as the end of a
    /// run gives them: each spans its whole run of steps.
    fn run_to_end(mut self, cfg: DetectConfig, extend: bool) -> Vec<Finding> {
        self.records.sort_by_key(|(ts, _)| *ts);
        let mut d = Detectors::new(cfg);
        let mut out = Vec::new();
        for (_, r) in &self.records {
            d.record(r, &mut out);
        }
        d.record(&exit(PID, None), &mut out);
        assert!(d.hang_state_is_empty_for(PID), "forgotten at exit");
        if extend {
            d.extend_spans(&mut out);
        }
        out
    }
}

fn run(n: u64, shape: impl Fn(u64) -> StepShape) -> Vec<Finding> {
    let mut job = Job::new();
    job.steps(n, shape);
    job.run(DetectConfig::default())
}

/// The defaults, but contention need not span a second: the synthetic
/// steps here are a few ms (the span has a test of its own).
fn short_steps() -> DetectConfig {
    let mut cfg = DetectConfig::default();
    cfg.host.contention_min_span = Duration::ZERO;
    cfg
}

fn run_short_steps(n: u64, shape: impl Fn(u64) -> StepShape) -> Vec<Finding> {
    let mut job = Job::new();
    job.steps(n, shape);
    job.run(short_steps())
}

/// Contention over a few steps of a few ms each is a blip, not a
/// neighbour: at the defaults it must span `contention_min_span` (1 s).
#[test]
fn contention_shorter_than_the_span_is_not_reported() {
    let shape = |k: u64| StepShape {
        preempted: if (10..16).contains(&k) {
            vec![(4242, 4243, "noisy", 6 * MS)]
        } else {
            vec![]
        },
        ..StepShape::default()
    };
    let found = run(30, shape);
    assert!(
        of_kind(&found, FindingKind::HostContention).is_empty(),
        "{found:#?}"
    );
    let found = run_short_steps(30, shape);
    assert_eq!(
        of_kind(&found, FindingKind::HostContention).len(),
        1,
        "{found:#?}"
    );
}

fn of_kind(found: &[Finding], kind: FindingKind) -> Vec<&Finding> {
    found.iter().filter(|f| f.kind == kind).collect()
}

#[test]
fn clean_steps_have_no_findings() {
    // Some jitter in the data wait, the rank's own threads preempting it,
    // brief preemptions by others, allocations that are freed.
    let found = run(40, |k| StepShape {
        data_wait: MS / 10 + (k % 5) * MS / 10,
        preempted: if k % 7 == 0 {
            vec![(999, 999, "kworker/0:1", MS / 5)]
        } else {
            vec![]
        },
        ..StepShape::default()
    });
    assert_eq!(found, vec![]);
}

#[test]
fn a_long_wait_for_the_loader_is_a_stall_at_its_step_and_a_late_arrival_is_not() {
    let found = run(30, |k| StepShape {
        data_wait: match k {
            12 => 300 * MS,
            // A wait at the very first step is not judged (no usual wait).
            0 => 500 * MS,
            _ => MS / 2,
        },
        loader_stack: k == 12,
        // Sleeping 400 ms just before the all-reduce: a late arrival.
        late: if k == 20 { 400 * MS } else { 0 },
        ..StepShape::default()
    });
    let stalls = of_kind(&found, FindingKind::DataloaderStall);
    assert_eq!(stalls.len(), 1, "{found:#?}");
    let f = stalls[0];
    assert_eq!((f.ranks.clone(), f.step), (vec![0], Some(12)));
    let ev = &f.evidence;
    let wait = ev["wait_ms"].as_f64().unwrap();
    assert!((299.0..=301.0).contains(&wait), "{ev}");
    assert!(
        (0.4..=0.6).contains(&ev["usual_wait_ms"].as_f64().unwrap()),
        "{ev}"
    );
    assert_eq!(ev["in_loader_stack_ms"], ev["wait_ms"]);
    assert!(
        f.summary
            .starts_with("dataloader_stall: rank 0's training thread waited 300.0 ms")
            && f.summary
                .contains("at step 12 (its off-CPU stack is in the data loader), usually 0.5 ms"),
        "{}",
        f.summary
    );
    assert_eq!(found.len(), 1, "nothing else: {found:#?}");
}

#[test]
fn stalls_need_both_the_floor_and_the_factor() {
    // 40 ms: under the 50 ms floor.
    let found = run(20, |k| StepShape {
        data_wait: if k == 8 { 40 * MS } else { MS / 10 },
        ..StepShape::default()
    });
    assert_eq!(found, vec![]);
    // A rank that always waits 80 ms: its usual wait.
    let found = run(20, |k| StepShape {
        data_wait: if k == 8 { 200 * MS } else { 80 * MS },
        ..StepShape::default()
    });
    assert_eq!(found, vec![], "200 ms is 2.5x its usual 80 ms");
    // Several stalled steps in a row: one finding, at the first.
    let found = run(20, |k| StepShape {
        data_wait: if (8..11).contains(&k) {
            200 * MS
        } else {
            MS / 10
        },
        ..StepShape::default()
    });
    assert_eq!(
        found.iter().map(|f| f.step).collect::<Vec<_>>(),
        vec![Some(8)]
    );
}

#[test]
fn persistent_preemption_by_other_processes_is_contention_naming_them() {
    let found = run_short_steps(30, |k| StepShape {
        preempted: if k >= 10 {
            vec![
                (4242, 4243, "noisy", 3 * MS),
                (4242, 4244, "noisy", 2 * MS),
                (77, 77, "kworker/0:2", MS / 2),
            ]
        } else {
            vec![]
        },
        ..StepShape::default()
    });
    let hits = of_kind(&found, FindingKind::HostContention);
    assert_eq!(hits.len(), 1, "one finding per run: {found:#?}");
    assert_eq!(found.len(), 1, "{found:#?}");
    let f = hits[0];
    assert_eq!((f.ranks.clone(), f.step), (vec![0], Some(10)));
    let ev = &f.evidence;
    assert_eq!(ev["steps"], 3, "fired at the third contended step: {ev}");
    assert!(
        (5.4..=5.6).contains(&ev["lost_ms_per_step"].as_f64().unwrap()),
        "{ev}"
    );
    assert_eq!(ev["preemptors"][0]["comm"], "noisy");
    assert_eq!(ev["preemptors"][0]["pid"], 4242);
    assert!(
        (14.9..=15.1).contains(&ev["preemptors"][0]["ms"].as_f64().unwrap()),
        "{ev}"
    );
    assert_eq!(ev["preemptors"][1]["comm"], "kworker/0:2");
    assert!(
        f.summary.contains("lost 5.5 ms per step")
            && f.summary
                .contains("3 steps in a row from step 10; most by noisy (pid 4242, 15.0 ms)"),
        "{}",
        f.summary
    );
}

/// On an oversubscribed node the preemptors are often traced ranks. A
/// sibling rank of the same job is the job's own shape (every rank alike,
/// every step): not contention. A rank of another job sharing the node
/// is, named by its rank and job.
#[test]
fn contention_by_another_jobs_rank_names_it_and_siblings_do_not_count() {
    let mut job = Job::new();
    job.records.push((0, identity(5000, 1)));
    job.records.push((
        0,
        Record::Identity {
            tgid: 6000,
            identity: Box::new(crate::model::RankIdentity::from_environ(
                b"RANK=0\0WORLD_SIZE=1\0XPUSCOPE_JOB=other\0",
            )),
        },
    ));
    job.steps(30, |k| StepShape {
        preempted: if k >= 10 {
            vec![
                (5000, 5001, "python3", 5 * MS),
                (6000, 6000, "python3", 3 * MS),
            ]
        } else {
            vec![]
        },
        ..StepShape::default()
    });
    let found = job.run(short_steps());
    let hits = of_kind(&found, FindingKind::HostContention);
    assert_eq!(hits.len(), 1, "{found:#?}");
    let f = hits[0];
    assert!(
        f.summary.contains("lost 3.0 ms per step")
            && f.summary
                .contains("most by rank 0 of job other, python3 (pid 6000, 9.0 ms)")
            && !f.summary.contains("its job's rank"),
        "{}",
        f.summary
    );
    let p = &f.evidence["preemptors"];
    assert_eq!(
        (p[0]["rank"].clone(), p[0]["job"].clone()),
        (0.into(), "other".into())
    );
    assert_eq!(p.as_array().map(Vec::len), Some(1), "{p}");
}

/// The job's own ranks and the agent's threads taking the rank's CPU every
/// step, however much: no contention finding.
#[test]
fn siblings_and_the_agent_are_not_contention() {
    let mut job = Job::new();
    job.records.push((0, identity(5000, 1)));
    job.steps(30, |_| StepShape {
        preempted: vec![
            (5000, 5001, "python3", 6 * MS),
            (7000, 7001, "xpuscope-pipeline", 4 * MS),
        ],
        ..StepShape::default()
    });
    let found = job.run(DetectConfig::default());
    assert!(
        of_kind(&found, FindingKind::HostContention).is_empty(),
        "{found:#?}"
    );
}

#[test]
fn a_contention_with_a_lull_is_one_finding_and_a_new_one_after_it_ends() {
    let noisy = vec![(4242, 4243, "noisy", 6 * MS)];
    let found = run_short_steps(40, |k| StepShape {
        // Contended from 5, one step under the bar at 12 and 14, over at
        // 24: a new run after three clean steps.
        preempted: if (5..20).contains(&k) && k != 12 && k != 14 || (24..28).contains(&k) {
            noisy.clone()
        } else {
            vec![]
        },
        ..StepShape::default()
    });
    assert_eq!(
        found.iter().map(|f| (f.kind, f.step)).collect::<Vec<_>>(),
        vec![
            (FindingKind::HostContention, Some(5)),
            (FindingKind::HostContention, Some(24))
        ]
    );
}

/// A contention fires at its third contended step and goes on: once the
/// run's findings are all known, its finding spans the whole run (what
/// comes late later in it is its consequence), through its lulls, and not
/// into the next run.
#[test]
fn a_contention_that_goes_on_after_it_fires_spans_its_whole_run_at_the_end() {
    let shape = |k: u64| StepShape {
        preempted: if (5..20).contains(&k) && k != 12 && k != 14 || (24..28).contains(&k) {
            vec![(4242, 4243, "noisy", 6 * MS)]
        } else {
            vec![]
        },
        ..StepShape::default()
    };
    let job = || {
        let mut job = Job::new();
        job.steps(40, shape);
        job
    };
    let fired = job().run_to_end(short_steps(), false);
    let ended = job().run_to_end(short_steps(), true);
    assert_eq!(fired.len(), 2, "{fired:#?}");
    assert_eq!(ended.len(), 2, "{ended:#?}");
    let (f, e) = (&fired[0], &ended[0]);
    assert_eq!(f.evidence["steps"], 3, "fired at its third step: {f:#?}");
    assert!(f.evidence.get("last_step").is_none(), "{f:#?}");
    assert_eq!(e.evidence["last_step"], 19, "{e:#?}");
    assert_eq!(
        e.evidence["run_steps"], 13,
        "15 steps, 2 of them lulls: {e:#?}"
    );
    assert_eq!(e.start_ns, f.start_ns);
    assert!(
        e.end_ns > f.end_ns && e.end_ns < Some(ended[1].start_ns),
        "to the end of step 19, before the next run: {e:#?}"
    );
    assert!(
        e.summary.ends_with("; it went on to step 19"),
        "{}",
        e.summary
    );
    assert_eq!(ended[1].evidence["last_step"], 27, "{:#?}", ended[1]);
}

#[test]
fn one_step_under_the_bar_does_not_end_a_run_before_it_fires() {
    let found = run_short_steps(30, |k| StepShape {
        preempted: if [8, 9, 11, 12].contains(&k) {
            vec![(4242, 4243, "noisy", 6 * MS)]
        } else {
            vec![]
        },
        ..StepShape::default()
    });
    assert_eq!(
        found
            .iter()
            .map(|f| (f.step, f.evidence["steps"].clone()))
            .collect::<Vec<_>>(),
        vec![(Some(8), serde_json::json!(3))]
    );
}

#[test]
fn short_or_small_preemption_is_not_contention() {
    // Two contended steps, then clean, then two again: never three in a row.
    let found = run(30, |k| StepShape {
        preempted: if [5, 6, 9, 10].contains(&k) {
            vec![(4242, 4243, "noisy", 6 * MS)]
        } else {
            vec![]
        },
        ..StepShape::default()
    });
    assert_eq!(found, vec![]);
    // Every step, but under a tenth of it.
    let found = run(30, |_| StepShape {
        preempted: vec![(4242, 4243, "noisy", MS / 2)],
        ..StepShape::default()
    });
    assert_eq!(found, vec![]);
    // The rank's own threads, however long, are not contention.
    let found = run(30, |_| StepShape {
        preempted: vec![(PID, PID + 7, "cuda_stream", 8 * MS)],
        ..StepShape::default()
    });
    assert_eq!(found, vec![]);
}

#[test]
fn a_site_growing_every_step_is_a_leak_with_its_rate_and_start() {
    let found = run(20, |k| StepShape {
        leak: if k >= 6 { 48 << 20 } else { 0 },
        ..StepShape::default()
    });
    let leaks = of_kind(&found, FindingKind::MemoryLeak);
    assert_eq!(found.len(), 1, "{found:#?}");
    let f = leaks[0];
    assert_eq!((f.ranks.clone(), f.step), (vec![0], Some(6)));
    let ev = &f.evidence;
    assert_eq!(ev["mb_per_step"], 48.0);
    assert_eq!(ev["stack"], "cache_activations < forward");
    assert_eq!(ev["device"], "gpu0");
    assert_eq!(ev["steps"], 5);
    assert!(
        f.summary.starts_with(
            "memory_leak: rank 0's gpu0 memory grows 48.0 MiB per step at cache_activations \
             < forward, 5 steps in a row from step 6; it holds 240 MiB there"
        ),
        "{}",
        f.summary
    );
}

#[test]
fn a_warm_up_that_levels_off_is_not_a_leak() {
    let found = run(30, |k| StepShape {
        leak: if (1..5).contains(&k) { 64 << 20 } else { 0 },
        ..StepShape::default()
    });
    assert_eq!(found, vec![]);
    // Growth under the rate floor.
    let found = run(30, |_| StepShape {
        leak: 512 << 10,
        ..StepShape::default()
    });
    assert_eq!(found, vec![]);
}

#[test]
fn thresholds_come_from_the_config() {
    let mut job = Job::new();
    job.steps(20, |k| StepShape {
        leak: if k >= 6 { 48 << 20 } else { 0 },
        data_wait: if k == 9 { 30 * MS } else { MS / 10 },
        ..StepShape::default()
    });
    let mut cfg = DetectConfig::default();
    cfg.host.leak_min_steps = 10;
    cfg.host.stall_min = std::time::Duration::from_millis(20);
    let found = job.run(cfg);
    assert_eq!(
        found.iter().map(|f| (f.kind, f.step)).collect::<Vec<_>>(),
        vec![
            (FindingKind::DataloaderStall, Some(9)),
            (FindingKind::MemoryLeak, Some(6))
        ]
    );
}

/// A job numbered from step 500 (attached to in the middle of its run),
/// a stall at its 13th step and a leak from its 4th: the findings carry
/// the job's own numbers (the all-reduce count would say 12 and 3) and say
/// where they come from. Returns the stall.
fn numbered_from_500(mut job: Job, source: &str) -> Finding {
    job.steps(30, |k| StepShape {
        data_wait: if k == 12 { 300 * MS } else { MS / 2 },
        loader_stack: k == 12,
        leak: if k >= 3 { 16 << 20 } else { 0 },
        ..StepShape::default()
    });
    let found = job.run(DetectConfig::default());
    let stalls = of_kind(&found, FindingKind::DataloaderStall);
    assert_eq!(stalls.len(), 1, "{found:#?}");
    assert_eq!(stalls[0].step, Some(512), "{:#?}", stalls[0]);
    assert!(
        stalls[0].summary.contains("at step 512"),
        "{}",
        stalls[0].summary
    );
    let leaks = of_kind(&found, FindingKind::MemoryLeak);
    assert_eq!(leaks.len(), 1, "{found:#?}");
    let from = leaks[0].step.unwrap();
    assert!((503..=505).contains(&from), "{:#?}", leaks[0]);
    for f in [stalls[0], leaks[0]] {
        assert_eq!(f.evidence["step_source"], source, "{f:#?}");
    }
    assert_eq!(found.len(), 2, "nothing else: {found:#?}");
    stalls[0].clone()
}

/// A Python rank without markers: its training loop's `step` (read off
/// its stacks, first at each step's data wait) numbers the steps the
/// all-reduces bound.
#[test]
fn a_python_step_counter_numbers_the_findings_as_the_job_does() {
    let mut job = Job::new();
    job.counted_from = Some(500);
    numbered_from_500(job, super::super::step_marks::STEP_SOURCE_PYTHON);
}

/// The job marks its steps (mstx ranges `step 500`, `step 501`, ...); the
/// stall's wait is the marked step's.
#[test]
fn marked_steps_number_the_findings_as_the_job_does() {
    let mut job = Job::new();
    job.marked_from = Some(500);
    let stall = numbered_from_500(job, super::super::step_marks::STEP_SOURCE_MARKERS);
    let wait = stall.evidence["wait_ms"].as_f64().unwrap();
    assert!(
        (299.0..=301.0).contains(&wait),
        "the marked step's wait: {wait}"
    );
}

/// A step's launches are the process's launches between the returns of
/// the two anchor all-reduces bounding it, whichever thread made them and
/// whichever thread's return carried the count last; none before the
/// first count.
#[test]
fn a_step_s_launches_are_the_counts_between_its_boundaries() {
    use super::super::host_steps::StepClock;
    use xpuscope_common::uprobe::LaunchCounts;
    let counts = |kernels, graphs| Some(LaunchCounts { kernels, graphs });
    let anchor = |t: u64, launches| {
        let mut c = all_reduce(t, t + MS);
        c.launches = launches;
        DeviceCallRecord::new(c)
    };
    let on_thread = |tid: u32, t: u64, launches| {
        let mut c = device_call(
            CallKind::Sync(SyncKind::Stream),
            "cudaStreamSynchronize",
            t,
            t + MS,
        );
        c.tid = tid;
        c.launches = launches;
        DeviceCallRecord::new(c)
    };
    let mut clock = StepClock::default();
    clock.follow(PID);
    assert!(clock.device_call(&anchor(0, None)).is_none());
    let w = clock.device_call(&anchor(10 * MS, None)).expect("step 0");
    assert_eq!(w.launches, None, "nothing counted yet");
    // The autograd thread's launches, seen on its own return.
    clock.device_call(&on_thread(PID + 1, 12 * MS, counts(40, 1)));
    let w = clock
        .device_call(&anchor(20 * MS, counts(41, 1)))
        .expect("step 1");
    assert_eq!(w.launches, counts(41, 1));
    // A late record of another thread with an older count changes nothing.
    clock.device_call(&on_thread(PID + 1, 21 * MS, counts(30, 1)));
    clock.device_call(&on_thread(PID, 25 * MS, counts(60, 1)));
    let w = clock
        .device_call(&anchor(30 * MS, counts(71, 2)))
        .expect("step 2");
    assert_eq!(w.launches, counts(30, 1));
    // A step whose anchor carried no count: the latest count seen.
    clock.device_call(&on_thread(PID + 1, 35 * MS, counts(90, 2)));
    let w = clock.device_call(&anchor(40 * MS, None)).expect("step 3");
    assert_eq!(w.launches, counts(19, 0));
}

/// A window the detectors are done with gives its room to the next one:
/// the next window holds its own off-CPU intervals only (those from the
/// closing all-reduce on, carried over, among them), in the recycled
/// vector.
#[test]
fn a_recycled_window_s_room_holds_the_next_window_only() {
    use super::super::host_steps::StepClock;
    let off = |start: u64, end: u64| OffCpuInterval {
        tid: PID,
        tgid: PID,
        cpu: 0,
        start,
        end,
        state: 1,
        stack: None,
        preempted_by: None,
        truncated: false,
    };
    let anchor = |t: u64| DeviceCallRecord::new(all_reduce(t, t + MS));
    let starts = |w: &super::super::host_steps::Window| -> Vec<u64> {
        w.off_cpu.iter().map(|i| i.start).collect()
    };
    let mut clock = StepClock::default();
    clock.follow(PID);
    assert!(clock.device_call(&anchor(0)).is_none());
    for t in [2, 4, 6] {
        clock.off_cpu(&off(t * MS, t * MS + MS / 2), false);
    }
    // Step 1 began inside the all-reduce closing step 0 (its records come
    // after the interval that began there).
    clock.off_cpu(&off(10 * MS + 1, 10 * MS + 2), false);
    let w = clock.device_call(&anchor(10 * MS)).expect("step 0");
    assert_eq!(starts(&w), [2 * MS, 4 * MS, 6 * MS]);
    let room = w.off_cpu.as_ptr();
    clock.recycle(w);
    for t in [12, 14] {
        clock.off_cpu(&off(t * MS, t * MS + MS / 2), false);
    }
    let w = clock.device_call(&anchor(20 * MS)).expect("step 1");
    assert_eq!(starts(&w), [10 * MS + 1, 12 * MS, 14 * MS]);
    clock.recycle(w);
    clock.off_cpu(&off(22 * MS, 23 * MS), false);
    clock.off_cpu(&off(30 * MS + 1, 30 * MS + 2), false);
    let w = clock.device_call(&anchor(30 * MS)).expect("step 2");
    assert_eq!(starts(&w), [22 * MS]);
    // Step 0's vector, recycled, gathered the intervals of step 2 (step
    // 1's own had been gathered in a new one).
    assert_eq!(w.off_cpu.as_ptr(), room, "the recycled vector is reused");
}
