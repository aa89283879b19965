//! Scheduler data: CompactSched switch/waking columns, plain thread-lifetime
//! events, bundle boundaries and lost events, decoded field by field.

use perfetto_protos::ftrace_event_bundle::FtraceEventBundle;
use xpuscope_perfetto::WriterOptions;
use xpuscope_tests::trace_check::{State, Timeline, UNKNOWN_PID, check_importer_rules, decode};

use super::common::*;

/// A decoded compact switch: (cpu, ts, prev_state, pid, prio, comm).
type Decoded = (u32, u64, i64, i32, i32, String);

/// Rebuilds absolute switches from one bundle's delta-encoded columns.
fn switches_of(b: &FtraceEventBundle) -> Vec<Decoded> {
    let c = b.compact_sched.as_ref().expect("compact_sched");
    let mut ts = 0u64;
    (0..c.switch_timestamp.len())
        .map(|i| {
            ts += c.switch_timestamp[i];
            let comm = c.intern_table[c.switch_next_comm_index[i] as usize].clone();
            (
                b.cpu(),
                ts,
                c.switch_prev_state[i],
                c.switch_next_pid[i],
                c.switch_next_prio[i],
                comm,
            )
        })
        .collect()
}

#[test]
fn switches_round_trip_field_by_field_across_bundles() {
    let input = realistic_switches(5_000, 3, 42);
    let mut w = writer_with(WriterOptions {
        bundle_events: 128,
        ..WriterOptions::default()
    });
    for s in &input {
        w.sched_switch(s.cpu, s.ts, s.prev_state, s.pid, s.prio, &s.comm)
            .unwrap();
    }
    let trace = decode_checked(&w.finish().unwrap());
    let mut got: Vec<Decoded> = Vec::new();
    for p in bundles(&trace) {
        let b = p.ftrace_events();
        assert!(b.previous_bundle_end_timestamp.is_none());
        assert!(!b.lost_events());
        let c = b.compact_sched.as_ref().unwrap();
        assert!(c.switch_timestamp.len() <= 128);
        // The intern table is local and has no duplicates.
        let mut table = c.intern_table.clone();
        table.sort();
        table.dedup();
        assert_eq!(table.len(), c.intern_table.len());
        got.extend(switches_of(b));
    }
    got.sort_by_key(|s| (s.1, s.0));
    let want: Vec<Decoded> = input
        .iter()
        .map(|s| (s.cpu, s.ts, s.prev_state, s.pid, s.prio, s.comm.clone()))
        .collect();
    assert_eq!(got, want);
    // Per CPU: ceil(n / 128) bundles.
    for cpu in 0..3 {
        let n = input.iter().filter(|s| s.cpu == cpu).count();
        let b = bundles(&trace)
            .iter()
            .filter(|p| p.ftrace_events().cpu() == cpu)
            .count();
        assert_eq!(b, n.div_ceil(128), "cpu {cpu}");
    }
    // The Timeline reconstructs prev_pid from the previous switch per CPU.
    let tl = Timeline::new(&trace);
    assert_eq!(tl.switches.len(), input.len());
    for cpu in 0..3 {
        let on_cpu: Vec<_> = tl.switches.iter().filter(|s| s.cpu == cpu).collect();
        assert_eq!(on_cpu[0].prev_pid, UNKNOWN_PID);
        for pair in on_cpu.windows(2) {
            assert_eq!(pair[1].prev_pid, pair[0].next_pid);
        }
    }
}

#[test]
fn wakings_keep_their_own_delta_chain_and_fields() {
    let mut w = writer();
    w.sched_switch(1, 10_000, 0, 300, 120, "trainer").unwrap();
    w.sched_waking(1, 10_500, 301, 0, 120, "loader").unwrap();
    w.sched_waking(1, 10_500, 302, 1, 100, "nccl").unwrap();
    w.sched_switch(1, 11_000, 1, 301, 120, "loader").unwrap();
    w.sched_waking(1, 12_345, 300, 1, 120, "trainer").unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    let b = bundles(&trace);
    assert_eq!(b.len(), 1);
    let c = b[0].ftrace_events().compact_sched.as_ref().unwrap();
    assert_eq!(c.switch_timestamp, [10_000, 1_000]);
    assert_eq!(c.waking_timestamp, [10_500, 0, 1_845]);
    assert_eq!(c.waking_pid, [301, 302, 300]);
    assert_eq!(c.waking_target_cpu, [0, 1, 1]);
    assert_eq!(c.waking_prio, [120, 100, 120]);
    let comms: Vec<&str> = c
        .waking_comm_index
        .iter()
        .map(|&i| c.intern_table[i as usize].as_str())
        .collect();
    assert_eq!(comms, ["loader", "nccl", "trainer"]);
    assert!(c.waking_common_flags.is_empty());
    // Switch and waking comms share the bundle's table.
    assert_eq!(c.intern_table, ["trainer", "loader", "nccl"]);

    let tl = Timeline::new(&trace);
    let wakers: Vec<(i32, Option<i32>)> = tl.wakings.iter().map(|w| (w.pid, w.waker_pid)).collect();
    assert_eq!(
        wakers,
        [(301, Some(300)), (302, Some(300)), (300, Some(301))]
    );
}

#[test]
fn thread_lifetimes_share_the_cpu_bundle_in_time_order() {
    let mut w = writer();
    w.sched_switch(0, 1_000, 0, 100, 120, "python3").unwrap();
    w.task_newtask(0, 1_100, 100, 101, "python3", 0x3d0f00, 0)
        .unwrap();
    w.task_newtask(0, 1_150, 100, 200, "python3", 0x1200011, 0)
        .unwrap();
    w.task_rename(0, 1_200, 101, 101, "python3", "pt_autograd_0")
        .unwrap();
    w.sched_switch(0, 1_300, 1, 101, 120, "pt_autograd_0")
        .unwrap();
    w.sched_process_free(0, 1_400, 101, 200, "python3", 120)
        .unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    let b = bundles(&trace);
    assert_eq!(b.len(), 1, "one bundle for the CPU");
    let bundle = b[0].ftrace_events();
    assert_eq!(switches_of(bundle).len(), 2);
    let ev = &bundle.event;
    assert_eq!(ev.len(), 4);
    let ts: Vec<u64> = ev.iter().map(|e| e.timestamp()).collect();
    assert_eq!(ts, [1_100, 1_150, 1_200, 1_400]);
    let n = ev[0].task_newtask();
    assert_eq!(
        (
            ev[0].pid(),
            n.pid(),
            n.comm(),
            n.clone_flags(),
            n.oom_score_adj()
        ),
        (100, 101, "python3", 0x3d0f00, 0)
    );
    let n = ev[1].task_newtask();
    assert_eq!((n.pid(), n.clone_flags()), (200, 0x1200011));
    let r = ev[2].task_rename();
    assert_eq!(
        (ev[2].pid(), r.pid(), r.oldcomm(), r.newcomm()),
        (101, 101, "python3", "pt_autograd_0")
    );
    let f = ev[3].sched_process_free();
    assert_eq!(
        (ev[3].pid(), f.pid(), f.comm(), f.prio()),
        (101, 200, "python3", 120)
    );

    let tl = Timeline::new(&trace);
    assert_eq!(
        tl.process_of(101),
        Some(100),
        "CLONE_THREAD joins the creator's process"
    );
    assert_eq!(tl.process_of(200), Some(200), "a fork starts a process");
    assert_eq!(tl.processes[&200].ppid, Some(100));
    assert_eq!(tl.thread_name(101).as_deref(), Some("pt_autograd_0"));
    assert_eq!(tl.renames.len(), 1);
    assert_eq!(tl.frees[0].pid, 200);
    assert_eq!(
        tl.thread_state_intervals(100),
        [
            (1_000, 1_300, State::Running),
            (1_300, 1_400, State::Sleeping)
        ]
    );
}

#[test]
fn a_timestamp_going_back_starts_a_new_bundle() {
    let mut w = writer();
    w.sched_switch(0, 2_000, 0, 1, 120, "a").unwrap();
    w.sched_switch(0, 3_000, 0, 2, 120, "b").unwrap();
    w.sched_switch(0, 2_500, 0, 3, 120, "c").unwrap(); // back in time
    w.task_rename(0, 2_400, 3, 3, "c", "d").unwrap(); // back again
    w.sched_switch(0, 2_600, 0, 4, 120, "e").unwrap();
    let bytes = w.finish().unwrap();
    let trace = decode(&bytes).unwrap();
    let b = bundles(&trace);
    assert_eq!(b.len(), 3);
    let ts = |i: usize| {
        switches_of(b[i].ftrace_events())
            .iter()
            .map(|s| s.1)
            .collect::<Vec<_>>()
    };
    assert_eq!(ts(0), [2_000, 3_000]);
    assert_eq!(ts(1), [2_500]);
    assert!(
        b[2].ftrace_events()
            .compact_sched
            .as_ref()
            .unwrap()
            .switch_timestamp
            == [2_600]
    );
    assert_eq!(b[2].ftrace_events().event[0].timestamp(), 2_400);
    // No negative delta anywhere; the checker still reports the caller's
    // disorder, which the importer would sort.
    let errors = check_importer_rules(&trace).unwrap_err();
    assert!(
        errors.iter().all(|e| e.contains("goes back in time")),
        "{errors:?}"
    );
}

#[test]
fn lost_events_flag_the_next_bundle_only() {
    let mut w = writer_with(WriterOptions {
        bundle_events: 2,
        ..WriterOptions::default()
    });
    w.sched_switch(1, 100, 0, 1, 120, "a").unwrap();
    w.mark_lost_events(1);
    w.sched_switch(1, 200, 0, 2, 120, "b").unwrap(); // completes bundle 1 (flagged)
    w.sched_switch(1, 300, 0, 3, 120, "c").unwrap();
    w.mark_lost_events(0); // nothing else on CPU 0: an empty flagged bundle
    let trace = decode_checked(&w.finish().unwrap());
    let flags: Vec<(u32, bool, usize)> = bundles(&trace)
        .iter()
        .map(|p| {
            let b = p.ftrace_events();
            let n = b
                .compact_sched
                .as_ref()
                .map_or(0, |c| c.switch_timestamp.len());
            (b.cpu(), b.lost_events(), n)
        })
        .collect();
    assert_eq!(flags, [(1, true, 2), (0, true, 0), (1, false, 1)]);
    let tl = Timeline::new(&trace);
    assert_eq!(tl.lost_events.len(), 2);
    assert_eq!(tl.lost_events[0].cpu, 1);
    assert_eq!(tl.lost_events[0].first_ts, Some(100));
}

#[test]
fn thread_states_follow_prev_state_and_wakings() {
    let mut w = writer();
    // CPU 0: 10 runs, blocks in D; 11 runs, goes idle (I); 10 woken by 11.
    w.sched_switch(0, 1_000, 0, 10, 120, "w10").unwrap();
    w.sched_switch(0, 2_000, 2, 11, 120, "w11").unwrap();
    w.sched_waking(0, 2_500, 10, 1, 120, "w10").unwrap();
    w.sched_switch(0, 3_000, 0x80, 0, 120, "swapper/0").unwrap();
    // CPU 1: 10 runs and is preempted by 12.
    w.sched_switch(1, 2_700, 0, 10, 120, "w10").unwrap();
    w.sched_switch(1, 3_500, 0x100, 12, 120, "w12").unwrap();
    w.sched_switch(1, 4_000, 1, 10, 120, "w10").unwrap();
    let trace = decode_checked(&w.finish().unwrap());
    let tl = Timeline::new(&trace);
    assert_eq!(
        tl.thread_state_intervals(10),
        [
            (1_000, 2_000, State::Running),
            (2_000, 2_500, State::Uninterruptible),
            (2_500, 2_700, State::Runnable),
            (2_700, 3_500, State::Running),
            (3_500, 4_000, State::RunnablePreempted),
        ]
    );
    assert_eq!(
        tl.thread_state_intervals(11),
        [(2_000, 3_000, State::Running), (3_000, 4_000, State::Idle)]
    );
    assert_eq!(
        tl.thread_state_intervals(12),
        [(3_500, 4_000, State::Running),]
    );
    assert_eq!(tl.wakings[0].waker_pid, Some(11));
}
