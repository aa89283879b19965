//! Decoding of `FtraceEventBundle`s: compact-sched columns and plain
//! events back into scheduler records, with the bundle's own rule checks.

use perfetto_protos::ftrace_event_bundle::FtraceEventBundle;

use super::records::{NewTask, ProcessFree, Rename, Waking};

/// A switch as stored: `prev_pid` only for plain `sched_switch` events.
#[derive(Clone, Debug)]
pub(crate) struct RawSwitch {
    pub cpu: u32,
    pub ts: u64,
    pub prev_pid: Option<i32>,
    pub prev_state: i64,
    pub next_pid: i32,
    pub next_comm: String,
    pub next_prio: i32,
}

/// One scheduler record, in tokenizer order (compact switches, compact
/// wakings, then plain events of each bundle).
#[derive(Clone, Debug)]
pub(crate) enum SchedRecord {
    Switch(RawSwitch),
    Waking(Waking),
    NewTask(NewTask),
    Rename(Rename),
    Free(ProcessFree),
}

impl SchedRecord {
    pub(crate) fn ts(&self) -> u64 {
        match self {
            SchedRecord::Switch(e) => e.ts,
            SchedRecord::Waking(e) => e.ts,
            SchedRecord::NewTask(e) => e.ts,
            SchedRecord::Rename(e) => e.ts,
            SchedRecord::Free(e) => e.ts,
        }
    }
}

/// What a bundle says about itself.
pub(crate) struct BundleInfo {
    pub cpu: u32,
    pub lost_events: bool,
    /// Earliest event timestamp in the bundle.
    pub first_ts: Option<u64>,
}

/// Decodes bundle `b` (packet `idx`), appending its records to `out` in
/// tokenizer order; `None` when it has no cpu.
pub(crate) fn decode_bundle(
    idx: usize,
    b: &FtraceEventBundle,
    errors: &mut Vec<String>,
    out: &mut Vec<SchedRecord>,
) -> Option<BundleInfo> {
    let Some(cpu) = b.cpu else {
        errors.push(format!("packet {idx}: ftrace bundle without cpu"));
        return None;
    };
    if cpu >= 1024 {
        errors.push(format!("packet {idx}: ftrace bundle for cpu {cpu} >= 1024"));
    }
    if b.previous_bundle_end_timestamp.is_some() {
        errors.push(format!(
            "packet {idx}: previous_bundle_end_timestamp is set"
        ));
    }
    let mut first_ts: Option<u64> = None;
    let mut seen = |ts: u64| first_ts = Some(first_ts.map_or(ts, |f| f.min(ts)));
    if let Some(c) = b.compact_sched.as_ref() {
        let table = &c.intern_table;
        let comm = |i: u32, errors: &mut Vec<String>| {
            table.get(i as usize).cloned().unwrap_or_else(|| {
                errors.push(format!(
                    "packet {idx}: comm index {i} outside the bundle's intern table of {}",
                    table.len()
                ));
                String::new()
            })
        };
        let n = c.switch_timestamp.len();
        let lens = [
            c.switch_prev_state.len(),
            c.switch_next_pid.len(),
            c.switch_next_prio.len(),
            c.switch_next_comm_index.len(),
        ];
        if lens.iter().any(|&l| l != n) {
            errors.push(format!(
                "packet {idx}: compact switch arrays differ in length: {n} timestamps, {lens:?}"
            ));
        }
        let mut acc: u64 = 0;
        for i in 0..n.min(lens.into_iter().min().unwrap_or(0)) {
            acc = acc.wrapping_add(c.switch_timestamp[i]);
            if acc > i64::MAX as u64 {
                errors.push(format!(
                    "packet {idx}: switch timestamp overflows (negative delta?)"
                ));
            }
            seen(acc);
            let next_comm = comm(c.switch_next_comm_index[i], errors);
            out.push(SchedRecord::Switch(RawSwitch {
                cpu,
                ts: acc,
                prev_pid: None,
                prev_state: c.switch_prev_state[i],
                next_pid: c.switch_next_pid[i],
                next_comm,
                next_prio: c.switch_next_prio[i],
            }));
        }
        let n = c.waking_timestamp.len();
        let lens = [
            c.waking_pid.len(),
            c.waking_target_cpu.len(),
            c.waking_prio.len(),
            c.waking_comm_index.len(),
        ];
        let flags = c.waking_common_flags.len();
        if lens.iter().any(|&l| l != n) || (flags != 0 && flags != n) {
            errors.push(format!("packet {idx}: compact waking arrays differ in length: {n} timestamps, {lens:?}, {flags} flags"));
        }
        let mut acc: u64 = 0;
        for i in 0..n.min(lens.into_iter().min().unwrap_or(0)) {
            acc = acc.wrapping_add(c.waking_timestamp[i]);
            if acc > i64::MAX as u64 {
                errors.push(format!(
                    "packet {idx}: waking timestamp overflows (negative delta?)"
                ));
            }
            seen(acc);
            let comm = comm(c.waking_comm_index[i], errors);
            out.push(SchedRecord::Waking(Waking {
                cpu,
                ts: acc,
                pid: c.waking_pid[i],
                comm,
                prio: c.waking_prio[i],
                target_cpu: c.waking_target_cpu[i],
                waker_pid: None,
            }));
        }
    }
    for e in &b.event {
        let (ts, firing_pid) = (e.timestamp(), e.pid() as i32);
        seen(ts);
        let record = if e.has_sched_switch() {
            let s = e.sched_switch();
            SchedRecord::Switch(RawSwitch {
                cpu,
                ts,
                prev_pid: Some(s.prev_pid()),
                prev_state: s.prev_state(),
                next_pid: s.next_pid(),
                next_comm: s.next_comm().to_owned(),
                next_prio: s.next_prio(),
            })
        } else if e.has_sched_waking() {
            let w = e.sched_waking();
            SchedRecord::Waking(Waking {
                cpu,
                ts,
                pid: w.pid(),
                comm: w.comm().to_owned(),
                prio: w.prio(),
                target_cpu: w.target_cpu(),
                waker_pid: None,
            })
        } else if e.has_task_newtask() {
            let n = e.task_newtask();
            SchedRecord::NewTask(NewTask {
                cpu,
                ts,
                firing_pid,
                pid: n.pid(),
                comm: n.comm().to_owned(),
                clone_flags: n.clone_flags(),
                oom_score_adj: n.oom_score_adj(),
            })
        } else if e.has_task_rename() {
            let r = e.task_rename();
            SchedRecord::Rename(Rename {
                cpu,
                ts,
                firing_pid,
                pid: r.pid(),
                old_comm: r.oldcomm().to_owned(),
                new_comm: r.newcomm().to_owned(),
            })
        } else if e.has_sched_process_free() {
            let f = e.sched_process_free();
            SchedRecord::Free(ProcessFree {
                cpu,
                ts,
                firing_pid,
                pid: f.pid(),
                comm: f.comm().to_owned(),
                prio: f.prio(),
            })
        } else {
            continue;
        };
        out.push(record);
    }
    Some(BundleInfo {
        cpu,
        lost_events: b.lost_events(),
        first_ts,
    })
}
