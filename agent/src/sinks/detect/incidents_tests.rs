//! Incidents over findings built here, shaped as the detectors write them.

use std::collections::BTreeSet;

use serde_json::json;

use super::incidents::{causes, causes_where, group, streamed_link_holds, text};
use crate::model::{Finding, FindingKind};

const MS: u64 = 1_000_000;

fn finding(kind: FindingKind, ranks: &[u32], step: Option<u64>, span_ms: (u64, u64)) -> Finding {
    Finding {
        link: Default::default(),
        kind,
        ranks: ranks.to_vec(),
        comm: None,
        seq: None,
        step,
        start_ns: span_ms.0 * MS,
        end_ns: Some(span_ms.1 * MS),
        summary: format!("{}: ranks {ranks:?}", kind.as_str()),
        evidence: json!({}),
        detected_ns: span_ms.1 * MS,
    }
}

/// A hang on `comm` that `missing` never entered while `waiting` did.
fn hang(comm: &str, missing: &[u32], waiting: &[u32], start_ms: u64) -> Finding {
    let mut f = finding(FindingKind::Hang, missing, None, (start_ms, start_ms));
    f.end_ns = None;
    f.comm = Some(comm.into());
    f.evidence = json!({"entered": waiting, "never_entered": missing,
        "stuck": waiting.iter().map(|r| json!({"rank": r})).collect::<Vec<_>>()});
    f
}

/// (kind, ranks, cause's kind and ranks) of each finding, in document order.
fn shape(found: &[Finding]) -> Vec<(u32, FindingKind, Vec<u32>, Option<u32>)> {
    found
        .iter()
        .map(|f| {
            (
                f.link.incident.expect("grouped"),
                f.kind,
                f.ranks.clone(),
                f.link.cause,
            )
        })
        .collect()
}

#[test]
fn peers_that_hang_waiting_for_a_hung_rank_are_its_consequences() {
    // Rank 5 stops before its DP all-reduce: its DP peer 7 waits there,
    // its TP peer 4 at the next TP collective, 4's and 7's pipeline peers
    // wait for them in turn.
    let mut found = vec![
        hang("tp45", &[5], &[4], 1_100),
        hang("pp04", &[4], &[0], 1_300),
        hang("dp57", &[5], &[7], 1_000),
        hang("pp37", &[7], &[3], 1_200),
        hang("dp13", &[3], &[1], 1_400),
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::Hang, vec![5], None),
            (1, FindingKind::Hang, vec![5], Some(1)),
            (1, FindingKind::Hang, vec![7], Some(1)),
            (1, FindingKind::Hang, vec![4], Some(2)),
            (1, FindingKind::Hang, vec![3], Some(3)),
        ]
    );
    assert_eq!(
        found[0].comm.as_deref(),
        Some("dp57"),
        "the first wait is the root"
    );
    let ids: Vec<_> = found.iter().map(|f| f.link.id).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5].map(Some));
    assert_eq!(
        text(&found),
        "hang: ranks [5]\n    evidence: {\"entered\":[7],\"never_entered\":[5],\"stuck\":[{\"rank\":7}]}\n    \
         +5 ranks waited for it (ranks 0, 1, 3, 4, 7); 4 consequence finding(s): hang x4\n"
    );
}

#[test]
fn a_collective_every_member_entered_follows_from_the_one_a_rank_never_entered() {
    // Ranks 0 and 1 (another pipeline stage) entered their all-gather and
    // wait inside it, behind their pipeline peers that wait for rank 5.
    let mut found = vec![
        hang("tp01", &[0, 1], &[0, 1], 1_000),
        hang("dp57", &[5], &[7], 1_010),
    ];
    found[0].evidence["never_entered"] = json!([]);
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::Hang, vec![5], None),
            (1, FindingKind::Hang, vec![0, 1], Some(1)),
        ]
    );
}

/// A hang of `stuck` that no collective explains, waiting point to point
/// for `peers` (the detector's `p2p_waits`).
fn p2p_hang(stuck: u32, peers: &[u32], start_ms: u64) -> Finding {
    let mut f = finding(FindingKind::Hang, peers, None, (start_ms, start_ms));
    f.end_ns = None;
    f.comm = Some(format!("pp{stuck}"));
    f.evidence = json!({
        "stuck": [{"rank": stuck}],
        "p2p_waits": peers.iter().map(|p| json!({"rank": stuck, "peer": p, "op": "recv"}))
            .collect::<Vec<_>>(),
    });
    f
}

#[test]
fn point_to_point_waits_lead_to_the_hang_that_holds_their_peer() {
    // Rank 5 never entered the DP all-reduce rank 7 waits in. Rank 1
    // waits to receive from rank 5 and began waiting first; ranks 0 and 2
    // are inside a TP collective every member entered, rank 2 also waiting
    // to receive from rank 7 (stuck in the all-reduce); an unrelated hang
    // that rank 9 never entered is open at the same time.
    let mut all_in = hang("tp02", &[0, 2], &[0, 2], 1_200);
    all_in.evidence["never_entered"] = json!([]);
    all_in.evidence["p2p_waits"] = json!([{"rank": 2, "peer": 7, "op": "recv"}]);
    let mut found = vec![
        p2p_hang(1, &[5], 900),
        hang("dp57", &[5], &[7], 1_000),
        all_in,
        hang("other", &[9], &[8], 1_100),
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::Hang, vec![5], None),
            (1, FindingKind::Hang, vec![5], Some(1)),
            (1, FindingKind::Hang, vec![0, 2], Some(1)),
            (2, FindingKind::Hang, vec![9], None),
        ]
    );
    assert_eq!(
        found[0].comm.as_deref(),
        Some("dp57"),
        "the collective rank 5 never entered says more than a wait for it"
    );
    assert_eq!(found[1].comm.as_deref(), Some("pp1"));
}

#[test]
fn waits_into_several_hangs_of_one_fault_follow_from_it() {
    // 16 ranks, TP 2, DP 4, two pipeline stages; rank 5 stops before its
    // data-parallel all-reduce (ranks 1, 3, 7 wait in it). Each of the
    // stage's tensor-parallel all-gathers waits for the odd rank of its
    // pair, and the next stage's data-parallel all-reduces, which every
    // member entered, wait to receive from the stage's ranks: ranks 0, 2,
    // 4, 6 (each held by another all-gather) and 1, 3, 5, 7.
    let mut found = vec![hang("dp1357", &[5], &[1, 3, 7], 1_000)];
    for (even, odd) in [(0, 1), (2, 3), (4, 5), (6, 7)] {
        found.push(hang(&format!("tp{even}{odd}"), &[odd], &[even], 1_010));
    }
    for (name, peers) in [("dp8", [0, 2, 4, 6]), ("dp9", [1, 3, 5, 7])] {
        let mut all_in = hang(name, &[], &[], 990);
        all_in.evidence["never_entered"] = json!([]);
        all_in.evidence["p2p_waits"] = json!(
            peers
                .iter()
                .map(|p| json!({"rank": p + 8, "peer": p, "op": "recv"}))
                .collect::<Vec<_>>()
        );
        all_in.ranks = peers.iter().map(|p| p + 8).collect();
        found.push(all_in);
    }
    group(&mut found);
    let incidents: BTreeSet<u32> = found.iter().filter_map(|f| f.link.incident).collect();
    assert_eq!(incidents.len(), 1, "one fault: {:#?}", shape(&found));
    assert_eq!(found[0].comm.as_deref(), Some("dp1357"));
    // One of its waits is for a rank held up by a second, unrelated fault
    // (rank 20 never entered "other", rank 21 waits in it): the waits lead
    // to two faults, and it stands alone.
    let mut split = found.clone();
    split.push(hang("other", &[20], &[21], 1_020));
    if let Some(f) = split.iter_mut().find(|f| f.comm.as_deref() == Some("dp8")) {
        f.evidence["p2p_waits"] = json!([{"rank": 10, "peer": 0, "op": "recv"},
            {"rank": 11, "peer": 21, "op": "recv"}]);
    }
    group(&mut split);
    let dp8 = split
        .iter()
        .find(|f| f.comm.as_deref() == Some("dp8"))
        .unwrap();
    assert_eq!(
        dp8.link.cause,
        None,
        "its waits lead to two faults: {:#?}",
        shape(&split)
    );
}

#[test]
fn a_chain_of_point_to_point_waits_is_rooted_at_the_rank_that_waits_on_nothing() {
    // 0 waits for 1, 1 waits for 3, 3 is in no call.
    let mut found = vec![p2p_hang(0, &[1], 1_000), p2p_hang(1, &[3], 1_010)];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::Hang, vec![3], None),
            (1, FindingKind::Hang, vec![1], Some(1)),
        ]
    );
}

#[test]
fn ranks_waiting_for_each_other_are_one_incident() {
    let mut found = vec![hang("a", &[1], &[0], 1_000), hang("b", &[0], &[1], 1_010)];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::Hang, vec![1], None),
            (1, FindingKind::Hang, vec![0], Some(1)),
        ]
    );
}

#[test]
fn a_dead_or_failed_rank_explains_the_hangs_that_wait_for_it() {
    for fatal in [FindingKind::Crash, FindingKind::DeviceError] {
        let mut found = vec![
            hang("dp", &[1], &[0], 1_000),
            finding(fatal, &[1], Some(2), (900, 900)),
        ];
        group(&mut found);
        assert_eq!(
            shape(&found),
            vec![
                (1, fatal, vec![1], None),
                (1, FindingKind::Hang, vec![1], Some(1))
            ]
        );
    }
}

#[test]
fn late_arrivals_that_overlap_a_stall_follow_from_it_and_unrelated_ones_stand_alone() {
    let late = |rank, step, span| finding(FindingKind::LateArrival, &[rank], Some(step), span);
    let mut found = vec![
        late(2, 6, (5_300, 5_600)),
        finding(FindingKind::DataloaderStall, &[6], Some(5), (5_000, 5_500)),
        late(4, 5, (5_200, 5_450)),
        // Steps later: its own fault.
        late(3, 12, (9_000, 9_200)),
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::DataloaderStall, vec![6], None),
            (1, FindingKind::LateArrival, vec![4], Some(1)),
            (1, FindingKind::LateArrival, vec![2], Some(1)),
            (2, FindingKind::LateArrival, vec![3], None),
        ]
    );
}

#[test]
fn a_peer_late_because_it_waited_for_a_late_rank_follows_from_it() {
    let late = |rank, span| finding(FindingKind::LateArrival, &[rank], Some(5), span);
    // Rank 1's delay shows at its all-reduce and at its TP all-gather;
    // rank 3 waited for it.
    let mut found = vec![
        late(3, (5_100, 5_900)),
        late(1, (5_000, 6_000)),
        late(1, (5_050, 6_001)),
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::LateArrival, vec![1], None),
            (1, FindingKind::LateArrival, vec![1], Some(1)),
            (1, FindingKind::LateArrival, vec![3], Some(1)),
        ]
    );
}

/// Findings streamed as they are made are linked by the same rules, but
/// not one rank's lateness to another's (host evidence alone cannot tell
/// which of two ranks late together waited for the other); a stall still
/// explains the lateness that overlaps it.
#[test]
fn a_streamed_lateness_follows_from_a_stall_never_from_another_rank_s_lateness() {
    let late = |rank, span| finding(FindingKind::LateArrival, &[rank], Some(5), span);
    let peers = vec![late(3, (5_100, 5_900)), late(1, (5_000, 6_000))];
    assert_eq!(causes(&peers), vec![Some(1), None]);
    assert_eq!(causes_where(&peers, streamed_link_holds), vec![None, None]);
    let stalled = vec![
        late(4, (5_200, 5_450)),
        finding(FindingKind::DataloaderStall, &[6], Some(5), (5_000, 5_500)),
    ];
    assert_eq!(
        causes_where(&stalled, streamed_link_holds),
        vec![Some(1), None]
    );
}

#[test]
fn one_neighbour_contending_with_several_ranks_is_one_incident() {
    let contention = |rank, pid, start| {
        let mut f = finding(
            FindingKind::HostContention,
            &[rank],
            Some(3),
            (start, start + 900),
        );
        f.evidence = json!({"preemptors": [{"comm": "noisy", "pid": pid}]});
        f
    };
    let mut found = vec![
        contention(1, 4242, 1_000),
        contention(3, 4242, 1_100),
        contention(5, 777, 1_050),
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::HostContention, vec![1], None),
            (1, FindingKind::HostContention, vec![3], Some(1)),
            (2, FindingKind::HostContention, vec![5], None),
        ]
    );
}

#[test]
fn a_job_level_contention_is_the_root_of_the_ranks_own() {
    let contention = |ranks: &[u32], pid, start, job: bool| {
        let mut f = finding(
            FindingKind::HostContention,
            ranks,
            Some(5),
            (start, start + 900),
        );
        f.evidence = json!({"preemptors": [{"comm": "hog", "pid": pid}]});
        if job {
            f.evidence["scope"] = "job".into();
        }
        f
    };
    // Rank 2's own run was found first, by another process that took its
    // CPU most; the job-level one came later and covers it.
    let mut found = vec![
        contention(&[2], 555, 1_000, false),
        contention(&[0, 1, 2, 3], 4242, 1_050, true),
        contention(&[3], 4242, 1_100, false),
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::HostContention, vec![0, 1, 2, 3], None),
            (1, FindingKind::HostContention, vec![2], Some(1)),
            (1, FindingKind::HostContention, vec![3], Some(1)),
        ]
    );
}

#[test]
fn grouped_findings_serialize_their_incident_and_cause() {
    let mut found = vec![
        hang("dp", &[1], &[0], 1_000),
        finding(FindingKind::Crash, &[1], Some(2), (900, 900)),
    ];
    group(&mut found);
    let v = serde_json::to_value(&found).unwrap();
    assert_eq!((&v[0]["id"], &v[0]["incident"]), (&json!(1), &json!(1)));
    assert!(v[0].get("cause").is_none(), "a root has no cause: {v:#}");
    assert_eq!(
        (&v[1]["id"], &v[1]["incident"], &v[1]["cause"]),
        (&json!(2), &json!(1), &json!(1))
    );
}

#[test]
fn ranks_taking_one_anothers_cpus_are_one_job_level_incident() {
    let contention = |rank, taker: u32, start| {
        let mut f = finding(
            FindingKind::HostContention,
            &[rank],
            Some(3),
            (start, start + 900),
        );
        f.evidence = json!({"preemptors": [{"comm": "sim_rank", "pid": 1000 + taker,
            "traced": true, "rank": taker, "job": "j"}]});
        f
    };
    let mut found = vec![
        contention(2, 0, 1_000),
        contention(0, 2, 1_100),
        contention(4, 6, 1_200),
    ];
    group(&mut found);
    let incidents: Vec<_> = found.iter().map(|f| f.link.incident).collect();
    assert_eq!(incidents, [Some(1); 3]);
    assert_eq!(found[0].ranks, vec![2]);
}

#[test]
fn a_late_arrival_at_the_operation_that_hung_is_part_of_the_hang() {
    let mut late = finding(FindingKind::LateArrival, &[0], Some(3), (900, 912));
    late.comm = Some("tp01".into());
    late.seq = Some(13);
    let mut h = hang("tp01", &[1], &[0], 1_000);
    h.seq = Some(13);
    let mut found = vec![late, h];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::Hang, vec![1], None),
            (1, FindingKind::LateArrival, vec![0], Some(1)),
        ]
    );
}

#[test]
fn the_catch_up_after_a_long_delay_follows_from_it_and_later_lateness_does_not() {
    let late = |rank, step, span| finding(FindingKind::LateArrival, &[rank], Some(step), span);
    let mut found = vec![
        late(2, 3, (1_000, 2_000)),
        // 6 ms after rank 2 came back: the ranks resuming at once.
        late(1, 4, (2_006, 2_020)),
        // 300 ms later: not within a quarter of the delay.
        late(3, 4, (2_300, 2_320)),
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::LateArrival, vec![2], None),
            (1, FindingKind::LateArrival, vec![1], Some(1)),
            (2, FindingKind::LateArrival, vec![3], None),
        ]
    );
}

/// A rank 1 s late (root); steps later, while the job catches up, rank 3
/// arrives late after waiting, blocked in a sync, for most of its
/// lateness, the wait ending while rank 1's delay was still under way:
/// it inherited the lateness (its evidence says so), however many steps
/// lie between them. A late arrival of the same step without such a wait,
/// after the catch-up, is an incident of its own.
#[test]
fn a_late_arrival_that_waited_for_a_late_peer_is_its_consequence() {
    let mut root = finding(FindingKind::LateArrival, &[1], Some(3), (100, 1_100));
    root.evidence = json!({"delay_ms": 1000.0});
    let mut waited = finding(FindingKind::LateArrival, &[3], Some(7), (1_050, 1_130));
    waited.evidence = json!({"delay_ms": 80.0,
        "waited": {"ms": 70.0, "function": "cudaStreamSynchronize", "until_ns": 1_120 * MS}});
    let mut own = finding(FindingKind::LateArrival, &[5], Some(7), (1_500, 1_570));
    own.evidence = json!({"delay_ms": 70.0});
    let mut found = vec![waited, own, root];
    group(&mut found);
    assert_eq!(
        shape(&found),
        vec![
            (1, FindingKind::LateArrival, vec![1], None),
            (1, FindingKind::LateArrival, vec![3], Some(1)),
            (2, FindingKind::LateArrival, vec![5], None),
        ]
    );
    // A wait that ended before the peer's delay began explains nothing.
    let mut early = finding(FindingKind::LateArrival, &[3], Some(7), (20, 90));
    early.evidence = json!({"delay_ms": 70.0,
        "waited": {"ms": 60.0, "function": "cudaStreamSynchronize", "until_ns": 80 * MS}});
    let mut root = finding(FindingKind::LateArrival, &[1], Some(3), (100, 1_100));
    root.evidence = json!({"delay_ms": 1000.0});
    let mut found = vec![early, root];
    group(&mut found);
    assert!(found.iter().all(|f| f.link.cause.is_none()), "{found:#?}");
}

#[test]
fn a_throttled_gpu_is_the_root_of_its_rank_s_and_its_peers_lateness() {
    // Rank 1's GPU slows from 2 s on (open: it never came back); its own
    // slow_rank and its peer's late arrival while it lasts follow from
    // it; a late arrival before it does not.
    let mut throttled = finding(FindingKind::DeviceThrottled, &[1], Some(10), (2_000, 2_000));
    throttled.end_ns = None;
    let mut found = vec![
        finding(FindingKind::LateArrival, &[0], Some(2), (500, 600)),
        finding(FindingKind::SlowRank, &[1], Some(12), (3_000, 4_000)),
        finding(FindingKind::LateArrival, &[0], Some(14), (4_500, 4_600)),
        throttled,
    ];
    group(&mut found);
    assert_eq!(
        shape(&found),
        [
            (1, FindingKind::DeviceThrottled, vec![1], None),
            (1, FindingKind::SlowRank, vec![1], Some(1)),
            (1, FindingKind::LateArrival, vec![0], Some(1)),
            (2, FindingKind::LateArrival, vec![0], None),
        ]
    );
}
