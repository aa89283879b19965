//! The second pass: every node's packets, rewritten so they live side by
//! side in one trace, written out as they are read (memory stays bounded
//! by one packet and the id tables).
//!
//! Per node: timestamps shifted by its clock offset; sequence ids, track
//! uuids and flow ids moved into the node's own space; pids another node
//! also uses moved above the kernel's pid range; CPUs numbered after the
//! previous nodes' (so each CPU track stays one CPU's time order). Process
//! tracks of ranks are named and labelled with node, rank and parallel
//! groups, and ordered by global rank; every collective gets the id it
//! shares with the same collective on its other members.

use rustc_hash::FxHashMap as HashMap;

use anyhow::Result;
use xpuscope_perfetto::rewrite::{EventKind, IdMap, Packet, TrackView};

use super::collectives::{CollectiveTracker, EndSample};
use super::ids::{MERGE_TRACK_SEQUENCE, NodeMap};
use super::output::Output;
use super::scan::NodeScan;
use super::step_out::StepOut;
use super::steps::{StepCandidates, TraceSteps};
use crate::analysis::groups::Groups;
use crate::trace_schema::keys;
use crate::trace_schema::names::{self as n, label};
use crate::trace_schema::read::TracePackets;

/// What a rank's process track says in the merged trace.
pub struct ProcessLabel {
    pub name: String,
    pub labels: Vec<String>,
    pub order: Option<i32>,
}

/// Name and labels of node `k`'s process `pid`.
pub fn process_label(scan: &NodeScan, k: usize, groups: &Groups, pid: i32) -> Option<ProcessLabel> {
    let p = scan.processes.get(&pid)?;
    let host = scan.host_label(k);
    let mut labels = p.labels.clone();
    labels.push(format!("node={host}"));
    let Some(rank) = p.rank else {
        return Some(ProcessLabel {
            name: format!(
                "{} [{host}]",
                p.name.clone().unwrap_or_else(|| pid.to_string())
            ),
            labels,
            order: None,
        });
    };
    let name = match groups.ranks.get(&rank) {
        Some(c) => {
            labels.extend([
                format!("tp={}", c.tp),
                format!("pp={}", c.pp),
                format!("dp={}", c.dp),
            ]);
            format!("rank {rank} ({}) {host}", c.label())
        }
        None => format!("rank {rank} {host}"),
    };
    Some(ProcessLabel {
        name,
        labels,
        order: Some(rank as i32),
    })
}

/// Options of the second pass.
pub struct EmitOptions {
    pub no_sched: bool,
    /// Global rank -> its data-parallel communicator (hash).
    pub dp: std::collections::HashMap<u32, u64>,
}

/// Packets between two takes of the finished steps.
const TAKE_STEPS_EVERY: u64 = 4_096;

/// Each rank's finished steps on its anchor communicator, to the step
/// outputs.
fn write_steps(
    finished: StepCandidates,
    anchors: &HashMap<i32, (u32, Option<u64>)>,
    host: &str,
    map: &mut NodeMap,
    steps: &mut StepOut,
    out: &mut Output,
) -> Result<()> {
    for (pid, mut per_comm) in finished {
        let Some(&(rank, Some(anchor))) = anchors.get(&pid) else {
            continue;
        };
        for mut step in per_comm.remove(&anchor).unwrap_or_default() {
            step.start_ns = map.time(step.start_ns);
            step.end_ns = map.time(step.end_ns);
            steps.add(rank, host, step, out)?;
        }
    }
    Ok(())
}

/// Writes node `k`'s packets, rewritten, to `out`, and its ranks' steps
/// as they finish to `steps`.
pub fn emit_node(
    scan: &NodeScan,
    k: usize,
    map: &mut NodeMap,
    groups: &Groups,
    opts: &EmitOptions,
    steps: &mut StepOut,
    out: &mut Output,
) -> Result<()> {
    let mut packets = TracePackets::open(&scan.path)?;
    // The same keys as the scan gave (send/receive are counted again).
    let mut tracker = CollectiveTracker::default();
    let mut ends = EndSample::default();
    let labels: HashMap<i32, ProcessLabel> = scan
        .processes
        .keys()
        .filter_map(|&pid| Some((pid, process_label(scan, k, groups, pid)?)))
        .collect();
    // Ranks' steps are anchored on their data-parallel communicator, or
    // their only repeated all-reduce when the groups name none.
    let anchors: HashMap<i32, (u32, Option<u64>)> = scan
        .processes
        .iter()
        .filter_map(|(&pid, p)| {
            let rank = p.rank?;
            let anchor = opts
                .dp
                .get(&rank)
                .copied()
                .or_else(|| scan.only_all_reduce(pid));
            Some((pid, (rank, anchor)))
        })
        .collect();
    let host = scan.host_label(k);
    let mut trace_steps = TraceSteps::default();
    // Slices begun and not yet ended, per track (as the node wrote it), and
    // the node's latest time in the merged base: a truncated node trace
    // leaves slices without their END, which are ended where it ends.
    let mut open: HashMap<u64, u32> = HashMap::default();
    let mut last_ts = 0u64;
    loop {
        if packets.packets() % TAKE_STEPS_EVERY == 0 {
            let finished = trace_steps.take_finished();
            write_steps(finished, &anchors, &host, map, steps, out)?;
        }
        let Some(mut packet) = packets.next()? else {
            break;
        };
        if let Some(sample) = packets.interning().sample(&packet) {
            trace_steps.stack(sample.pid, sample.tid, sample.ts, &sample.functions);
        }
        packet.for_each_switch(|cpu, ts, state, next| trace_steps.switch(cpu, ts, state, next));
        // The merger writes one SystemInfo; the first node's clocks are
        // the time base, other nodes' would contradict it once shifted.
        if packet.system_info().is_some() || (k > 0 && packet.clock_snapshot().is_some()) {
            continue;
        }
        if opts.no_sched && packet.has_ftrace_events() {
            continue;
        }
        let event = packets.event(&packet);
        match &event {
            Some(e) if e.kind == EventKind::Begin => *open.entry(e.track).or_default() += 1,
            Some(e) if e.kind == EventKind::End => {
                if let Some(n) = open.get_mut(&e.track) {
                    *n = n.saturating_sub(1);
                }
            }
            _ => {}
        }
        let observed = event.and_then(|e| {
            let o = tracker.observe(&e, &mut ends);
            if let Some(&(pid, tid)) = scan.thread_tracks.get(&e.track) {
                trace_steps.event(pid, tid, &e, o.as_ref());
            }
            o
        });
        let mut extra = Vec::new();
        if let Some(o) = observed {
            if let Some(id) = o.id() {
                extra.push(keys::COLLECTIVE_ID.arg(id));
            }
            if let Some(kind) = o.call.comm_hash.and_then(|h| groups.kind_of(h)) {
                extra.push(keys::GROUP.arg(kind));
            }
        }
        let process = match packet.track() {
            Some(TrackView::Process { pid, labels: l, .. }) => {
                // Followed from its rank's process track on, as the scan
                // learnt the rank.
                if anchors.contains_key(&pid) && label(&l, n::RANK_LABEL).is_some() {
                    trace_steps.follow(pid);
                }
                labels.get(&pid)
            }
            _ => None,
        };
        packet.remap(map);
        packet.clear_machine_id();
        last_ts = last_ts.max(packet.timestamp().unwrap_or(0));
        if !extra.is_empty() {
            packet.add_args(&extra);
        }
        if let Some(l) = process {
            packet.set_process(&l.name, l.labels.clone(), l.order);
        }
        out.write(&packet)?;
    }
    let mut unended: Vec<(u64, u32)> = open.into_iter().filter(|(_, n)| *n > 0).collect();
    unended.sort_unstable();
    for (track, n) in unended {
        let track = map.track(track);
        for _ in 0..n {
            out.write(&Packet::new_slice_event(
                MERGE_TRACK_SEQUENCE,
                false,
                last_ts,
                track,
                None,
                &[],
            ))?;
        }
    }
    let finished = trace_steps.finish();
    write_steps(finished, &anchors, &host, map, steps, out)?;
    Ok(())
}

/// Process tracks of every rank, in global-rank order, before any node's
/// packets: the importer numbers processes in the order it meets them.
pub fn rank_tracks(
    scans: &[NodeScan],
    maps: &mut [NodeMap],
    groups: &Groups,
    out: &mut Output,
) -> Result<()> {
    let mut rows = Vec::new();
    for (k, s) in scans.iter().enumerate() {
        for (&pid, p) in &s.processes {
            if let (Some(rank), Some(track)) = (p.rank, p.track) {
                rows.push((rank, k, pid, track));
            }
        }
    }
    rows.sort_unstable();
    for (_, k, pid, track) in rows {
        let Some(l) = process_label(&scans[k], k, groups, pid) else {
            continue;
        };
        let m = &mut maps[k];
        let p = Packet::new_process_track(
            MERGE_TRACK_SEQUENCE,
            m.track(track),
            m.pid(pid),
            &l.name,
            l.labels,
            l.order,
        );
        out.write(&p)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use xpuscope_perfetto::{SystemInfo, TraceWriter};
    use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

    use super::super::{MergeOptions, run};

    /// A node trace cut after a slice began (its END lost with the cut):
    /// the merged trace ends that slice where the node's trace ends, so it
    /// keeps the importer's rules; a complete slice is left as it was.
    #[test]
    fn slices_a_cut_trace_left_open_end_where_it_ends() {
        let dir = std::env::temp_dir().join(format!("xpuscope-merge-open-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = TraceWriter::new(Vec::new());
        w.system_info(&SystemInfo {
            sysname: "Linux".into(),
            release: "6.18.0".into(),
            machine: "x86_64".into(),
            hz: 100,
            page_size: 4096,
            num_cpus: 2,
            ..SystemInfo::default()
        })
        .unwrap();
        let t = w.thread_track(42, 42, "python3").unwrap();
        w.slice_begin(t, 1_000, "ncclAllReduce", None, &[], &[], None)
            .unwrap();
        w.slice_begin(t, 2_000, "inner", None, &[], &[], None)
            .unwrap();
        w.slice_end(t, 3_000, &[]).unwrap();
        w.slice_begin(t, 4_000, "cudaDeviceSynchronize", None, &[], &[], None)
            .unwrap();
        let node = dir.join("node.pftrace");
        std::fs::write(&node, w.finish().unwrap()).unwrap();
        let merged = dir.join("merged.pftrace");
        run(&MergeOptions {
            inputs: vec![node],
            output: merged.clone(),
            force: false,
            no_sched: false,
            steps_csv: None,
        })
        .unwrap();
        let trace = decode(&std::fs::read(&merged).unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        check_importer_rules(&trace).unwrap();
        let tl = Timeline::new(&trace);
        let mut slices: Vec<(String, u64, Option<u64>)> = tl
            .slices
            .iter()
            .map(|s| (s.name.clone(), s.ts, s.end))
            .collect();
        slices.sort();
        assert_eq!(
            slices,
            [
                ("cudaDeviceSynchronize".to_string(), 4_000, Some(4_000)),
                ("inner".to_string(), 2_000, Some(3_000)),
                ("ncclAllReduce".to_string(), 1_000, Some(4_000)),
            ]
        );
    }
}
