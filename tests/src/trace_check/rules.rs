//! The trace-processor importer's rules that a trace must follow for the UI
//! to show it fully, checked on a decoded trace.

use std::collections::{BTreeMap, HashMap};

use perfetto_protos::trace::Trace;

use super::extract::{self, Extracted};
use super::ftrace::SchedRecord;
use super::records::TrackKind;

/// Checks `trace` against the importer's rules; every violation found, with
/// the packet index where it applies.
///
/// - every machine has a `SystemInfo` with `utsname.release`, before its
///   first ftrace bundle;
/// - bundles: `cpu` set and < 1024, no `previous_bundle_end_timestamp`,
///   compact-sched arrays of matching lengths, comm indexes inside the
///   bundle's intern table, no timestamp overflow;
/// - per CPU, switch timestamps never go backwards, across bundles too;
/// - interned data and `SEQ_NEEDS_INCREMENTAL_STATE` only after a
///   `SEQ_INCREMENTAL_STATE_CLEARED` packet on that sequence; every iid
///   (event names, categories, annotation names, callstacks, frames,
///   mappings, function names, mapping paths, build ids) defined earlier on
///   its sequence, never redefined differently;
/// - track events: non-zero sequence id, a timestamp, a `track_uuid`
///   described earlier (parents too); counters only on counter tracks;
///   BEGIN/END balanced per track, END never before its BEGIN;
/// - flows: an id starts on one event and ends on one other (in its
///   `flow_ids` or `terminating_flow_ids`), never on a third, never after it
///   terminated;
/// - `ProcessTree` processes have a cmdline;
/// - `StackSample` weights have a counter descriptor.
pub fn check_importer_rules(trace: &Trace) -> Result<(), Vec<String>> {
    let x = extract::extract(trace);
    let mut errors = x.errors.clone();
    system_info(trace, &x, &mut errors);
    switch_order(&x, &mut errors);
    tracks(&x, &mut errors);
    slices_and_flows(&x, &mut errors);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn system_info(trace: &Trace, x: &Extracted, errors: &mut Vec<String>) {
    let mut machines: Vec<u32> = trace
        .packet
        .iter()
        .map(|p| p.machine_id.unwrap_or(0))
        .collect();
    machines.sort_unstable();
    machines.dedup();
    for m in machines {
        let info = x
            .system_infos
            .iter()
            .find(|(mm, _, release)| *mm == m && release.as_deref().is_some_and(|r| !r.is_empty()));
        let first_bundle = x.bundles.iter().find(|b| b.0 == m).map(|b| b.1);
        match (info, first_bundle) {
            (None, _) => errors.push(format!(
                "machine {m}: no SystemInfo with utsname.release (prev_state would be decoded as kernel 4.4)"
            )),
            (Some((_, idx, _)), Some(bundle)) if *idx > bundle => errors.push(format!(
                "machine {m}: SystemInfo (packet {idx}) comes after the first ftrace bundle (packet {bundle})"
            )),
            _ => {}
        }
    }
}

fn switch_order(x: &Extracted, errors: &mut Vec<String>) {
    let mut last: HashMap<(u32, u32), u64> = HashMap::new();
    for (m, r) in &x.sched {
        if let SchedRecord::Switch(s) = r {
            let prev = last.insert((*m, s.cpu), s.ts);
            if let Some(prev) = prev.filter(|&p| s.ts < p) {
                errors.push(format!(
                    "machine {m} cpu {}: switch at {} goes back in time (previous switch at {prev})",
                    s.cpu, s.ts
                ));
            }
        }
    }
}

fn tracks(x: &Extracted, errors: &mut Vec<String>) {
    let mut described: HashMap<(u32, u64), (usize, bool)> = HashMap::new();
    for (m, idx, t) in &x.tracks {
        if t.uuid == 0 {
            errors.push(format!("packet {idx}: track descriptor with uuid 0"));
        }
        if let Some(parent) = t.parent
            && !described.contains_key(&(*m, parent))
        {
            errors.push(format!(
                "packet {idx}: track {} has parent {parent} not described before",
                t.uuid
            ));
        }
        let is_counter = matches!(t.kind, TrackKind::Counter { .. });
        described.entry((*m, t.uuid)).or_insert((*idx, is_counter));
    }
    for (m, e) in &x.track_events {
        let Some(track) = e.track else {
            errors.push(format!(
                "packet {}: track event without track_uuid",
                e.packet
            ));
            continue;
        };
        match described.get(&(*m, track)) {
            None => errors.push(format!(
                "packet {}: track {track} used but never described",
                e.packet
            )),
            Some((idx, _)) if *idx > e.packet => errors.push(format!(
                "packet {}: track {track} used before its descriptor (packet {idx})",
                e.packet
            )),
            Some((_, is_counter)) => {
                let counter_event = e.kind == 4;
                if counter_event && !is_counter {
                    errors.push(format!(
                        "packet {}: counter value on non-counter track {track}",
                        e.packet
                    ));
                }
                if !counter_event && *is_counter {
                    errors.push(format!(
                        "packet {}: event type {} on counter track {track}",
                        e.packet, e.kind
                    ));
                }
                if counter_event && e.counter_value.is_none() {
                    errors.push(format!(
                        "packet {}: counter event without a value",
                        e.packet
                    ));
                }
                if matches!(e.kind, 1 | 3) && e.name.is_none() {
                    errors.push(format!(
                        "packet {}: slice or instant without a name",
                        e.packet
                    ));
                }
            }
        }
    }
}

fn slices_and_flows(x: &Extracted, errors: &mut Vec<String>) {
    let mut by_machine: BTreeMap<u32, Vec<&extract::RawTrackEvent>> = BTreeMap::new();
    for (m, e) in &x.track_events {
        by_machine.entry(*m).or_default().push(e);
    }
    for (m, mut events) in by_machine {
        // The importer sorts by timestamp; equal times keep file order.
        events.sort_by_key(|e| (e.ts, e.packet));
        let mut open: HashMap<u64, Vec<(usize, u64)>> = HashMap::new();
        // Per flow id: events naming it in flow_ids, and whether it ended.
        let mut flows: HashMap<u64, (u32, bool)> = HashMap::new();
        for e in events {
            let Some(track) = e.track else { continue };
            if e.kind == 1 {
                open.entry(track).or_default().push((e.packet, e.ts));
            }
            let unmatched_end = e.kind == 2 && open.get_mut(&track).and_then(Vec::pop).is_none();
            if unmatched_end {
                errors.push(format!(
                    "packet {}: END at {} on track {track} without an open BEGIN",
                    e.packet, e.ts
                ));
            }
            for id in &e.flow_ids {
                let (uses, ended) = flows.entry(*id).or_default();
                if *ended {
                    errors.push(format!(
                        "packet {}: machine {m}: flow id {id} reused after it terminated",
                        e.packet
                    ));
                } else if *uses >= 2 {
                    errors.push(format!(
                        "packet {}: machine {m}: flow id {id} on a third event (one start, one end: never reuse ids)",
                        e.packet
                    ));
                }
                *uses += 1;
            }
            for id in &e.terminating_flow_ids {
                match flows.get_mut(id) {
                    None | Some((0, _)) => errors.push(format!(
                        "packet {}: machine {m}: flow id {id} terminated but never started",
                        e.packet
                    )),
                    Some((_, true)) => errors.push(format!(
                        "packet {}: machine {m}: flow id {id} terminated twice",
                        e.packet
                    )),
                    Some((_, ended)) => *ended = true,
                }
            }
        }
        for (track, stack) in open {
            for (packet, ts) in stack {
                errors.push(format!(
                    "packet {packet}: BEGIN at {ts} on track {track} never ended"
                ));
            }
        }
    }
}
