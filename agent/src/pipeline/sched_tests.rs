//! Tests of scheduler interpretation and rendering: a small known story fed
//! through the pipeline and read back with the independent decoder.

use xpuscope_tests::trace_check::{State, Timeline, check_importer_rules, decode};

use super::testing::TestPipeline;
use crate::events::{Comm, Event, Exec, Exit, Fork, Rename, StackCapture, Switch, Waking};
use crate::procfs;

fn comm(s: &str) -> Comm {
    Comm::from_str_lossy(s)
}

fn switch(
    cpu: u32,
    ts: u64,
    prev: (u32, &str, u32),
    next: (u32, &str, u32),
    flags: (bool, bool, bool),
) -> Event {
    Event::Switch(Switch {
        cpu,
        ts,
        prev_tid: prev.0,
        prev_tgid: prev.2,
        prev_comm: comm(prev.1),
        prev_state: if flags.2 { 0 } else { 1 },
        prev_prio: 120,
        next_tid: next.0,
        next_tgid: next.2,
        next_comm: comm(next.1),
        next_prio: 120,
        preempt: flags.2,
        prev_target: flags.0,
        next_target: flags.1,
        stack_follows: false,
    })
}

/// Feeds a small, known story through the trace stage and reads it
/// back with the independent decoder.
#[test]
fn events_become_what_the_ui_shows() {
    let mut b = TestPipeline::new();
    let app = procfs::ProcessEntry {
        pid: 100,
        ppid: 1,
        comm: "trainer".into(),
        cmdline: vec!["python3".into(), "train.py".into()],
        uid: Some(0),
        threads: vec![procfs::ThreadEntry {
            tid: 100,
            comm: "trainer".into(),
        }],
    };
    b.initial_processes(1_000, &[app]);
    let worker = (101, "worker", 100);
    let main = (100, "trainer", 100);
    let hog = (900, "hog", 900);
    let idle = (0, "swapper/0", 0);
    let events = vec![
        Event::Fork(Fork {
            cpu: 0,
            ts: 2_000,
            parent_tid: 100,
            parent_tgid: 100,
            child_tid: 101,
            child_tgid: 100,
            child_comm: comm("trainer"),
        }),
        Event::Rename(Rename {
            cpu: 0,
            ts: 2_100,
            tid: 101,
            tgid: 100,
            old_comm: comm("trainer"),
            new_comm: comm("worker"),
        }),
        switch(0, 3_000, idle, worker, (false, true, false)),
        // The worker blocks (sleeping) with a stack, for 7 us.
        switch(0, 4_000, worker, main, (true, true, false)),
        Event::Stack(Box::new(StackCapture {
            cpu: 0,
            ts: 4_000,
            tid: 101,
            tgid: 100,
            kernel: Ok(vec![0xffff_ffff_8100_0010]),
            user: Ok(vec![0x1000]),
            user_copy: None,
            record_bytes: 0,
        })),
        Event::Waking(Waking {
            cpu: 0,
            ts: 10_500,
            tid: 101,
            tgid: 100,
            comm: comm("worker"),
            prio: 120,
            target_cpu: 0,
            waker_tid: 100,
            waker_tgid: 100,
            new_task: false,
        }),
        switch(0, 11_000, main, worker, (true, true, false)),
        // An outsider preempts the worker.
        switch(0, 12_000, worker, hog, (true, false, true)),
        switch(0, 15_000, hog, worker, (false, true, false)),
        Event::Exec(Exec {
            cpu: 0,
            ts: 16_000,
            tid: 100,
            tgid: 100,
            old_tid: 100,
            comm: comm("trainer2"),
        }),
        Event::Exit(Exit {
            cpu: 0,
            ts: 17_000,
            tid: 101,
            tgid: 100,
            prio: 120,
            comm: comm("worker"),
            group_dead: false,
            group_known: false,
            exit_code: None,
        }),
    ];
    for e in events {
        b.handle(e);
    }
    b.drops(18_000, &[1], 5);
    let (bytes, stats) = b.finish(20_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);

    assert_eq!(tl.thread_name(101).as_deref(), Some("worker"));
    assert_eq!(tl.process_of(101), Some(100));
    assert_eq!(
        tl.thread_name(100).as_deref(),
        Some("trainer2"),
        "exec renames a tree-named thread"
    );
    let states = tl.thread_state_intervals(101);
    assert!(
        states.contains(&(4_000, 10_500, State::Sleeping)),
        "{states:?}"
    );
    assert!(
        states
            .iter()
            .any(|s| s.0 == 12_000 && s.2 == State::RunnablePreempted),
        "{states:?}"
    );
    let woken = tl.wakings.iter().find(|w| w.pid == 101).unwrap();
    assert_eq!(woken.waker_pid, Some(100));
    assert_eq!(tl.stack_samples.len(), 1);
    assert_eq!(
        tl.stack_samples[0].weight, 7_000,
        "weighted by the time off CPU"
    );
    assert_eq!(tl.stack_samples[0].tid, 101);
    let marks = tl.instants_on_thread(101);
    assert!(
        marks.iter().any(|(n, _)| n == "preempted by hog"),
        "{marks:?}"
    );
    assert!(tl.frees.iter().any(|f| f.pid == 101));
    assert_eq!(
        tl.lost_event_cpus.iter().copied().collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(tl.counter_values("xpuscope dropped events"), vec![5.0]);
    assert_eq!(stats.preemptions, 1);
    // worker: 7 us asleep, 3 us preempted; main: off from 11 us to the end.
    assert_eq!(stats.offcpu.total_ns, 7_000 + 3_000 + 9_000);
}

fn stack_at(ts: u64, tid: u32, tgid: u32, user: u64) -> Event {
    Event::Stack(Box::new(StackCapture {
        cpu: 0,
        ts,
        tid,
        tgid,
        kernel: Ok(vec![0xffff_ffff_8100_0010, 0xffff_ffff_8100_0020]),
        user: Ok(vec![user, 0x2000]),
        user_copy: None,
        record_bytes: 0,
    }))
}

/// A thread that blocks where it blocked before gets the same stack (one
/// symbolization, one callstack conversion), and the trace still shows
/// each off-CPU interval with its own frames and weight; a stack of
/// another place, or of a new process under a reused pid, is its own.
#[test]
fn a_thread_blocking_where_it_blocked_before_shares_its_stack() {
    let mut b = TestPipeline::new();
    let worker = (101, "worker", 100);
    let main = (100, "trainer", 100);
    // Blocks at 0x1000 three times, at 0x1100 once; each 2 us off CPU.
    let places = [0x1000, 0x1000, 0x1100, 0x1000];
    let mut ts = 10_000;
    for place in places {
        b.handle(switch(0, ts, worker, main, (true, true, false)));
        b.handle(stack_at(ts, 101, 100, place));
        b.handle(switch(0, ts + 2_000, main, worker, (true, true, false)));
        ts += 10_000;
    }
    assert_eq!(b.interpreter.counters.stacks, 4);
    assert_eq!(b.interpreter.counters.stacks_memoized, 2);
    let stacks: Vec<_> = b
        .records()
        .into_iter()
        .filter_map(|r| match r {
            crate::model::Record::OffCpu(i) if i.tid == 101 => i.stack,
            _ => None,
        })
        .collect();
    assert_eq!(stacks.len(), 4);
    assert!(std::sync::Arc::ptr_eq(&stacks[0], &stacks[1]));
    assert!(std::sync::Arc::ptr_eq(&stacks[0], &stacks[3]));
    assert!(!std::sync::Arc::ptr_eq(&stacks[0], &stacks[2]));
    assert_ne!(stacks[0].user[0].rel_pc, stacks[2].user[0].rel_pc);

    // The same pid, a new process: its stacks are symbolized anew.
    b.handle(Event::Exit(Exit {
        cpu: 0,
        ts,
        tid: 101,
        tgid: 100,
        prio: 120,
        comm: comm("worker"),
        group_dead: true,
        group_known: true,
        exit_code: None,
    }));
    ts += 10_000;
    b.handle(switch(0, ts, worker, main, (true, true, false)));
    b.handle(stack_at(ts, 101, 100, 0x1000));
    b.handle(switch(0, ts + 2_000, main, worker, (true, true, false)));
    assert_eq!(b.interpreter.counters.stacks_memoized, 2);
    let last = b
        .records()
        .into_iter()
        .filter_map(|r| match r {
            crate::model::Record::OffCpu(i) if i.tid == 101 => i.stack,
            _ => None,
        })
        .last()
        .unwrap();
    assert!(!std::sync::Arc::ptr_eq(&stacks[0], &last));
    assert_eq!(*stacks[0], *last, "the same addresses, the same frames");

    let (bytes, _) = b.finish(ts + 10_000);
    let trace = decode(&bytes).unwrap();
    check_importer_rules(&trace).unwrap();
    let tl = Timeline::new(&trace);
    let samples: Vec<_> = tl.stack_samples.iter().filter(|s| s.tid == 101).collect();
    assert_eq!(samples.len(), 5);
    for s in &samples {
        assert_eq!(s.weight, 2_000, "each interval its own weight");
    }
    for i in [1, 3, 4] {
        assert_eq!(samples[i].frames, samples[0].frames, "sample {i}");
        assert_eq!(samples[i].mappings, samples[0].mappings, "sample {i}");
    }
    assert_ne!(samples[2].frames, samples[0].frames);
    assert_eq!(
        samples[0].frames.len(),
        4,
        "two user frames, two kernel: {:?}",
        samples[0].frames
    );
}

/// A service traces every job on its node: a rank preempted by another
/// job's thread (traced too) is interfered with, a marker on its track;
/// by its own job's threads and worker processes (forked from it, or
/// unlabelled) it is not.
#[test]
fn another_jobs_threads_preempt_as_outsiders() {
    use crate::kernel::probes::TableUpdate;
    use crate::model::{RankIdentity, Record};
    let mut b = TestPipeline::new();
    for (tgid, job) in [(100, "a"), (200, "b")] {
        b.probes_added(TableUpdate {
            tgid,
            probes: Vec::new(),
            identity: RankIdentity::from_environ(
                format!("RANK=0\0WORLD_SIZE=1\0XPUSCOPE_JOB={job}\0").as_bytes(),
            ),
            maps: Default::default(),
        });
    }
    let fork = |ts, parent: u32, child: u32| {
        Event::Fork(Fork {
            cpu: 0,
            ts,
            parent_tid: parent,
            parent_tgid: parent,
            child_tid: child,
            child_tgid: child,
            child_comm: comm("pt_worker"),
        })
    };
    let rank_a = (100, "rank-a", 100);
    let rank_b = (200, "rank-b", 200);
    let worker_a = (101, "pt_worker", 101);
    let worker_b = (201, "pt_worker", 201);
    let launcher = (50, "launcher", 50);
    let preempted = (true, true, true);
    let back = (true, true, false);
    let events = vec![
        fork(1_000, 100, 101),
        fork(1_100, 200, 201),
        // Rank a preempted by rank b, then by job b's worker: outsiders.
        switch(0, 2_000, rank_a, rank_b, preempted),
        switch(0, 3_000, rank_b, rank_a, back),
        switch(0, 4_000, rank_a, worker_b, preempted),
        switch(0, 5_000, worker_b, rank_a, back),
        // By its own worker, and by an unlabelled traced process: its own.
        switch(0, 6_000, rank_a, worker_a, preempted),
        switch(0, 7_000, worker_a, rank_a, back),
        switch(0, 8_000, rank_a, launcher, preempted),
        switch(0, 9_000, launcher, rank_a, back),
    ];
    for e in events {
        b.handle(e);
    }
    let by: Vec<(u32, u64)> = b
        .records()
        .iter()
        .filter_map(|r| match r {
            Record::Preempted(p) if p.tgid == 100 => Some((p.by.tgid, p.ts)),
            _ => None,
        })
        .collect();
    assert_eq!(by, [(200, 2_000), (201, 4_000)], "markers");
    let in_job: Vec<(u32, bool)> = b
        .records()
        .iter()
        .filter_map(|r| match r {
            Record::OffCpu(i) if i.tgid == 100 => {
                i.preempted_by.as_ref().map(|p| (p.tgid, p.in_job))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        in_job,
        [(200, false), (201, false), (101, true), (50, true)],
        "who took its CPU"
    );
}
