//! The hang detector's point-to-point wait-for edges over records built
//! here: pipeline communicators of two ranks each, sends and receives
//! counted per peer.

use serde_json::json;
use xpuscope_probes::catalog::{CallKind, Direction, Library};
use xpuscope_probes::decode::args::{CallArgs, SendRecvArgs};
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::enums::DataType;

use super::tests::{S, allreduce, call, detectors, exit, feed, identity, open_sync};
use super::*;
use crate::model::{DeviceCallRecord, InFlightSnapshot, MainThreadNow, OpenCall, ThreadNow};

/// The pipeline communicator of global ranks `a` < `b`: ranks 0 and 1 on
/// it (so a peer's rank on it is not its global rank).
fn pipe_hash(a: u32, b: u32) -> u64 {
    0x9a9e_0000_0000_0000 | u64::from(a) << 8 | u64::from(b)
}

fn pipe_name(a: u32, b: u32) -> String {
    format!("nccl:{:016x}", pipe_hash(a, b))
}

/// `rank`'s context on its pipeline communicator with `peer`.
fn pipe_ctx(rank: u32, peer: u32) -> CommContext {
    CommContext {
        handle: 0xd000 + u64::from(rank) * 16 + u64::from(peer),
        id_hash: Some(pipe_hash(rank.min(peer), rank.max(peer))),
        rank: Some(u32::from(rank > peer)),
        size: Some(2),
        seq: None,
        seq_exact: false,
    }
}

fn function(direction: Direction) -> &'static str {
    match direction {
        Direction::Send => "ncclSend",
        Direction::Recv => "ncclRecv",
    }
}

/// A send or receive of global rank `rank` (pid 100 + rank) to or from
/// global rank `peer`, returned.
fn p2p(rank: u32, peer: u32, direction: Direction, start: u64) -> Record {
    let cc = pipe_ctx(rank, peer);
    let mut c = call(
        100 + rank,
        CallKind::SendRecv(direction),
        function(direction),
        start,
        start + 1_000,
    );
    c.args = CallArgs::SendRecv(SendRecvArgs {
        direction,
        buf: 0x7000,
        count: 1024,
        dtype: DataType::Fp32,
        bytes: Some(4096),
        peer: i32::from(rank < peer),
        comm: cc.handle,
        stream: Some(0x51),
    });
    c.comm = Some(cc);
    Record::DeviceCall(Box::new(DeviceCallRecord::new(c)))
}

/// `n` calls of `rank` to or from `peer`, a second apart from `from_s`.
fn many(rank: u32, peer: u32, direction: Direction, n: u64, from_s: u64) -> Vec<Record> {
    (0..n)
        .map(|k| p2p(rank, peer, direction, (from_s + k) * S + u64::from(rank)))
        .collect()
}

/// A send or receive of `rank` to or from `peer` still in flight.
fn open_p2p(rank: u32, peer: u32, direction: Direction, start: u64) -> OpenCall {
    OpenCall {
        tgid: 100 + rank,
        tid: 100 + rank,
        library: Library::Nccl,
        function: function(direction),
        kind: CallKind::SendRecv(direction),
        start_ts: start,
        comm: Some(pipe_ctx(rank, peer)),
        peer: Some(u32::from(rank < peer)),
        thread: ThreadNow::Unknown,
    }
}

/// A snapshot of `calls`, with rank `asleep`'s main thread sleeping since
/// `since` where given.
fn snapshot_with(ts: u64, calls: Vec<OpenCall>, asleep: Option<(u32, u64)>) -> Record {
    Record::InFlight(Box::new(InFlightSnapshot {
        ts,
        calls,
        main_threads: asleep
            .map(|(rank, since)| MainThreadNow {
                tgid: 100 + rank,
                thread: ThreadNow::Off {
                    state: crate::state::report_state(1, false),
                    since,
                },
                stack: None,
            })
            .into_iter()
            .collect(),
    }))
}

fn identities(ranks: &[u32]) -> Vec<Record> {
    ranks.iter().map(|&r| identity(100 + r, r)).collect()
}

/// Rank 1 received 7 messages from rank 3, which sent 6 and then stopped
/// outside any device call; rank 1 waits in the stream sync after its
/// receive. Traffic the other way matched (rank 3 received all rank 1
/// sent). The finding names rank 3, with the edge and where rank 3 is.
#[test]
fn a_rank_waiting_to_receive_names_the_peer_that_never_sent() {
    let mut d = detectors(10);
    let mut records = identities(&[0, 1, 2, 3]);
    records.extend(many(3, 1, Direction::Send, 6, 0));
    records.extend(many(1, 3, Direction::Recv, 7, 0));
    records.extend(many(1, 3, Direction::Send, 6, 0));
    records.extend(many(3, 1, Direction::Recv, 6, 0));
    records.push(snapshot_with(
        20 * S,
        vec![open_sync(1, 7 * S)],
        Some((3, 6 * S)),
    ));
    let mut out = feed(&mut d, &records);
    d.tick(20 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:#?}");
    let f = &out[0];
    let comm = pipe_name(1, 3);
    assert_eq!(f.kind, FindingKind::Hang);
    assert_eq!(f.ranks, vec![3], "the rank waited for: {f:#?}");
    assert_eq!(f.comm.as_deref(), Some(comm.as_str()));
    assert_eq!(f.seq, None);
    assert_eq!(f.start_ns, 7 * S);
    assert_eq!(f.evidence["stuck"][0]["rank"], 1);
    assert_eq!(f.evidence["stuck"][0]["function"], "cudaStreamSynchronize");
    assert_eq!(
        f.evidence["p2p_waits"],
        json!([{
            "rank": 1, "pid": 101, "peer": 3, "peer_pid": 103, "peer_comm_rank": 1,
            "comm": comm, "op": "recv", "nth": 7, "entered": 7, "peer_entered": 6,
        }])
    );
    assert_eq!(f.evidence["waited_for_main_threads"][0]["rank"], 3);
    assert_eq!(
        f.summary,
        format!(
            "hang: rank 1 waits to receive its 7th message from rank 3 on {comm}, which sent 6; \
             rank 3's main thread sleeping for 14.0 s; rank 1's thread 101 has been in \
             cudaStreamSynchronize for 13.0 s, running on a CPU"
        )
    );
    // Reported once.
    let mut again = feed(
        &mut d,
        &[snapshot_with(25 * S, vec![open_sync(1, 7 * S)], None)],
    );
    d.tick(25 * S, &mut again);
    assert!(again.is_empty(), "{again:#?}");
}

/// A blocking send or receive in flight counts as entered: rank 0's 5th
/// send to rank 1 never returns, rank 1 received 4; rank 2's 3rd receive
/// from rank 1 never returns, rank 1 sent 2.
#[test]
fn a_send_or_receive_in_flight_counts_itself() {
    let mut d = detectors(10);
    let mut records = identities(&[0, 1, 2]);
    records.extend(many(0, 1, Direction::Send, 4, 0));
    records.extend(many(1, 0, Direction::Recv, 4, 0));
    records.extend(many(1, 2, Direction::Send, 2, 0));
    records.extend(many(2, 1, Direction::Recv, 2, 0));
    records.push(snapshot_with(
        30 * S,
        vec![
            open_p2p(0, 1, Direction::Send, 5 * S),
            open_p2p(2, 1, Direction::Recv, 6 * S),
        ],
        None,
    ));
    let mut out = feed(&mut d, &records);
    d.tick(30 * S, &mut out);
    assert_eq!(out.len(), 2, "{out:#?}");
    let of = |rank: u64| {
        out.iter()
            .find(|f| f.evidence["stuck"][0]["rank"] == rank)
            .unwrap_or_else(|| panic!("rank {rank} stuck: {out:#?}"))
    };
    let send = of(0);
    assert_eq!(send.ranks, vec![1]);
    assert_eq!(send.evidence["p2p_waits"][0]["op"], "send");
    assert_eq!(send.evidence["p2p_waits"][0]["nth"], 5);
    assert_eq!(send.evidence["p2p_waits"][0]["peer_entered"], 4);
    assert!(
        send.summary.starts_with(&format!(
            "hang: rank 0 waits to send its 5th message to rank 1 on {}, which received 4; \
             rank 0's thread 100 has been in ncclSend for 25.0 s",
            pipe_name(0, 1)
        )),
        "{}",
        send.summary
    );
    let recv = of(2);
    assert_eq!(recv.ranks, vec![1]);
    assert_eq!(
        (
            &recv.evidence["p2p_waits"][0]["op"],
            &recv.evidence["p2p_waits"][0]["nth"],
            &recv.evidence["p2p_waits"][0]["entered"],
            &recv.evidence["p2p_waits"][0]["peer_entered"],
        ),
        (&json!("recv"), &json!(3), &json!(3), &json!(2))
    );
}

/// A call whose record passed while a snapshot still holds it (its return
/// was lost: the record comes unmatched) is counted once.
#[test]
fn a_call_counted_from_its_record_is_not_counted_again_in_flight() {
    let mut d = detectors(10);
    let mut records = identities(&[1, 2]);
    records.extend(many(1, 2, Direction::Send, 2, 0));
    records.extend(many(2, 1, Direction::Recv, 2, 0));
    records.push(snapshot_with(
        7 * S,
        vec![open_p2p(2, 1, Direction::Recv, 6 * S)],
        None,
    ));
    let mut lost = p2p(2, 1, Direction::Recv, 6 * S);
    if let Record::DeviceCall(r) = &mut lost {
        r.call.end_ts = None;
        r.unmatched = Some(xpuscope_probes::decode::OpenReason::OuterReturned);
    }
    records.push(lost);
    records.extend(many(1, 2, Direction::Send, 1, 7));
    let mut out = feed(&mut d, &records);
    d.tick(20 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:#?}");
    assert_eq!(out[0].ranks, vec![2], "3 received of 3 sent: {out:#?}");
    assert_eq!(out[0].evidence["p2p_waits"], json!([]));
}

/// The peer sent as many as the stuck rank received (and received as many
/// as it sent): no edge; the stuck rank alone, as without point-to-point.
#[test]
fn matched_counts_are_no_edge() {
    let mut d = detectors(10);
    let mut records = identities(&[1, 3]);
    records.extend(many(3, 1, Direction::Send, 7, 0));
    records.extend(many(1, 3, Direction::Recv, 7, 0));
    records.extend(many(1, 3, Direction::Send, 7, 0));
    records.extend(many(3, 1, Direction::Recv, 7, 0));
    records.push(snapshot_with(20 * S, vec![open_sync(1, 8 * S)], None));
    let mut out = feed(&mut d, &records);
    d.tick(20 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:#?}");
    let f = &out[0];
    assert_eq!(f.ranks, vec![1]);
    assert_eq!(f.comm, None);
    assert_eq!(f.evidence["p2p_waits"], json!([]));
    assert!(!f.summary.contains("waits to"), "{}", f.summary);
}

/// Rank 0 waits to receive from rank 1, which waits to receive from rank
/// 3, which stopped outside any device call: one incident, rooted at the
/// hang that names rank 3; rank 0's hang carries it as its cause.
#[test]
fn a_chain_of_waits_is_one_incident_rooted_at_the_rank_that_waits_on_nothing() {
    let mut d = detectors(10);
    let mut records = identities(&[0, 1, 2, 3]);
    records.extend(many(1, 0, Direction::Send, 4, 0));
    records.extend(many(0, 1, Direction::Recv, 5, 0));
    records.extend(many(3, 1, Direction::Send, 6, 0));
    records.extend(many(1, 3, Direction::Recv, 7, 0));
    // Rank 0 began waiting first (its wait is seen before the cause's).
    records.push(snapshot_with(
        20 * S,
        vec![open_sync(0, 5 * S + 10), open_sync(1, 7 * S)],
        None,
    ));
    let mut found = feed(&mut d, &records);
    d.tick(20 * S, &mut found);
    assert_eq!(found.len(), 2, "{found:#?}");
    incidents::group(&mut found);
    let shape: Vec<_> = found
        .iter()
        .map(|f| {
            (
                f.link.incident,
                f.ranks.clone(),
                f.evidence["stuck"][0]["rank"].as_u64(),
                f.link.cause,
            )
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (Some(1), vec![3], Some(1), None),
            (Some(1), vec![1], Some(0), Some(1)),
        ]
    );
    assert!(
        found[1].summary.starts_with(&format!(
            "hang: rank 0 waits to receive its 5th message from rank 1 on {}, which sent 4",
            pipe_name(0, 1)
        )),
        "{}",
        found[1].summary
    );
    assert!(
        incidents::text(&found).starts_with("hang: rank 1 waits to receive its 7th message"),
        "{}",
        incidents::text(&found)
    );
}

/// A collective that every member entered, its stuck ranks also waiting
/// point to point: the collective finding as before, the edges in its
/// evidence and words.
#[test]
fn a_collective_hang_carries_the_point_to_point_waits_too() {
    let mut d = detectors(2);
    let mut records = identities(&[0, 1, 3]);
    for seq in 1..=3 {
        for rank in 0..2 {
            records.push(allreduce(rank, 2, seq, seq * S));
        }
    }
    records.extend(many(3, 1, Direction::Send, 2, 0));
    records.extend(many(1, 3, Direction::Recv, 3, 0));
    records.push(snapshot_with(
        8 * S,
        vec![open_sync(0, 4 * S), open_sync(1, 4 * S + 5)],
        None,
    ));
    let mut out = feed(&mut d, &records);
    d.tick(8 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:#?}");
    let f = &out[0];
    assert_eq!((f.ranks.clone(), f.seq), (vec![0, 1], Some(3)));
    assert!(
        f.summary.contains("entered by every member, and none left"),
        "{}",
        f.summary
    );
    assert_eq!(f.evidence["p2p_waits"][0]["rank"], 1);
    assert_eq!(f.evidence["p2p_waits"][0]["peer"], 3);
    assert!(
        f.summary.ends_with(&format!(
            "; rank 1 waits to receive its 3rd message from rank 3 on {}, which sent 2",
            pipe_name(1, 3)
        )),
        "{}",
        f.summary
    );
}

/// A process that ended takes its counts with it: a peer stuck after it
/// is not linked to it, and a new process under its pid counts afresh.
#[test]
fn an_ended_process_takes_its_counts_with_it() {
    let mut d = detectors(10);
    let mut records = identities(&[1, 3]);
    records.extend(many(3, 1, Direction::Send, 6, 0));
    records.extend(many(1, 3, Direction::Recv, 7, 0));
    records.push(exit(103, Some(0)));
    let mut out = feed(&mut d, &records);
    assert!(d.hang_state_is_empty_for(103));
    assert!(!d.hang.forgot(101));
    d.record(
        &snapshot_with(20 * S, vec![open_sync(1, 8 * S)], None),
        &mut out,
    );
    d.tick(20 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:#?}");
    assert_eq!(out[0].ranks, vec![1], "no edge to a process gone");
    assert_eq!(out[0].evidence["p2p_waits"], json!([]));

    // The pid again, a new rank 3: its one send is all it sent.
    let mut d = detectors(10);
    records.push(identity(103, 3));
    records.extend(many(3, 1, Direction::Send, 1, 10));
    records.push(snapshot_with(20 * S, vec![open_sync(1, 8 * S)], None));
    let mut out = feed(&mut d, &records);
    d.tick(20 * S, &mut out);
    assert_eq!(out.len(), 1, "{out:#?}");
    assert_eq!(out[0].ranks, vec![3]);
    assert_eq!(out[0].evidence["p2p_waits"][0]["nth"], 2);
    assert_eq!(out[0].evidence["p2p_waits"][0]["peer_entered"], 1);
}

/// `agent diagnose` over a trace of the same job finds the same wait: the
/// sends and receives come back from the trace with their peer and
/// communicator, and rank 1's 7th receive, running when its process was
/// stopped, is in flight until then, its peer with it.
#[test]
fn offline_diagnose_finds_the_same_point_to_point_wait() {
    use xpuscope_perfetto::TraceWriter;
    use xpuscope_probes::decode::OpenReason;

    use crate::events::{Comm, Exit};
    use crate::sinks::perfetto::PerfettoSink;

    let mut records = identities(&[1, 3]);
    records.extend(many(3, 1, Direction::Send, 6, 0));
    records.extend(many(1, 3, Direction::Recv, 6, 0));
    let mut seventh = p2p(1, 3, Direction::Recv, 7 * S);
    if let Record::DeviceCall(r) = &mut seventh {
        r.call.end_ts = None;
        r.call.ret = None;
        r.unmatched = Some(OpenReason::ProcessExited);
    }
    records.push(seventh);
    records.push(Record::Exit {
        exit: Exit {
            cpu: 0,
            ts: 30 * S,
            tid: 101,
            tgid: 101,
            prio: 120,
            comm: Comm::from_str_lossy("python3"),
            group_dead: true,
            group_known: true,
            exit_code: Some(0),
        },
        process_ended: true,
    });
    let mut sink = PerfettoSink::new(TraceWriter::new(Vec::new()));
    for r in &records {
        sink.record(r).unwrap();
    }
    let trace = sink
        .finish_trace(31 * S, &crate::sinks::SinkCounters::default())
        .unwrap()
        .out;
    let dir = std::env::temp_dir().join(format!("xpuscope-p2p-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pipeline.pftrace");
    std::fs::write(&path, trace).unwrap();
    let found = crate::diagnose::diagnose(
        std::slice::from_ref(&path),
        DetectConfig {
            hang_timeout: std::time::Duration::from_secs(10),
            ..DetectConfig::default()
        },
    );
    let _ = std::fs::remove_dir_all(&dir);
    let found = found.unwrap();
    let hangs: Vec<&Finding> = found
        .iter()
        .filter(|f| f.kind == FindingKind::Hang)
        .collect();
    assert_eq!(hangs.len(), 1, "{found:#?}");
    let f = hangs[0];
    assert_eq!(f.ranks, vec![3]);
    assert_eq!(f.evidence["stuck"][0]["rank"], 1);
    assert_eq!(f.evidence["p2p_waits"][0]["nth"], 7);
    assert_eq!(f.evidence["p2p_waits"][0]["peer_entered"], 6);
    assert!(
        f.summary.starts_with(&format!(
            "hang: rank 1 waits to receive its 7th message from rank 3 on {}, which sent 6",
            pipe_name(1, 3)
        )),
        "{}",
        f.summary
    );
}
