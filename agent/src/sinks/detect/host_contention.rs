//! `host_contention`: a rank's training (main) thread kept off its CPU by
//! tasks of other processes while it was runnable, for a large share of
//! its steps, several steps in a row.
//!
//! Per step (a window of the step clock, `host_steps`), the time lost is
//! the main thread's off-CPU time in intervals where it was preempted
//! (runnable) by a thread of another process, as the scheduler's switch
//! named it; the rank's own threads (its data loader, the device
//! libraries' workers) are its own business and not counted. A step is
//! contended when the time lost is at least `contention_min_lost` and at
//! least `contention_min_share_pct` percent of the step. It fires when
//! `contention_min_steps` steps in a row are contended, once per such run,
//! naming the first step of the run, the time lost per step and the top
//! preemptors (command name, pid, time taken).

use std::collections::HashMap;

use serde_json::json;

use super::Ranks;
use super::host::HostDetectConfig;
use super::host_steps::Window;
use crate::model::{Finding, FindingKind};

/// Preemptors named in a finding.
pub const TOP_PREEMPTORS: usize = 3;
/// Distinct preemptors counted per run of contended steps.
const MAX_PREEMPTORS: usize = 256;

/// Time taken per preemptor: (command name, pid) -> (ns, from a traced
/// process).
pub type Takers = HashMap<(String, u32), (u64, bool)>;

#[derive(Default)]
struct Run {
    first_step: u64,
    start: u64,
    end: u64,
    steps: u64,
    lost: u64,
    dur: u64,
    /// (comm, pid) -> (ns taken, from a traced process).
    by: Takers,
    reported: bool,
}

#[derive(Default)]
pub struct ContentionDetector {
    runs: HashMap<u32, Run>,
}

/// The time a window's main thread lost to other processes, by preemptor.
pub fn lost_in(w: &Window) -> (u64, Takers) {
    let mut by = Takers::new();
    let mut lost = 0;
    for i in &w.off_cpu {
        let Some(p) = &i.preempted_by else {
            continue;
        };
        let d = i.end.min(w.end).saturating_sub(i.start);
        lost += d;
        let key = (p.comm.clone(), p.pid);
        if by.len() < MAX_PREEMPTORS || by.contains_key(&key) {
            let e = by.entry(key).or_insert((0, p.in_job));
            e.0 += d;
        }
    }
    (lost, by)
}

impl ContentionDetector {
    pub fn forget(&mut self, tgid: u32) {
        self.runs.remove(&tgid);
    }

    pub fn step_ended(
        &mut self,
        w: &Window,
        cfg: &HostDetectConfig,
        ranks: &Ranks,
        out: &mut Vec<Finding>,
    ) {
        let (lost, by) = lost_in(w);
        let contended = lost >= cfg.contention_min_lost.as_nanos() as u64
            && lost.saturating_mul(100) >= w.dur() * u64::from(cfg.contention_min_share_pct);
        if !contended {
            self.runs.remove(&w.tgid);
            return;
        }
        let run = self.runs.entry(w.tgid).or_insert_with(|| Run {
            first_step: w.step,
            start: w.start,
            ..Run::default()
        });
        run.end = w.end;
        run.steps += 1;
        run.lost += lost;
        run.dur += w.dur();
        for (k, (ns, in_job)) in by {
            if run.by.len() < MAX_PREEMPTORS || run.by.contains_key(&k) {
                run.by.entry(k).or_insert((0, in_job)).0 += ns;
            }
        }
        if run.reported || run.steps < u64::from(cfg.contention_min_steps.max(1)) {
            return;
        }
        run.reported = true;
        let mut top: Vec<_> = run.by.iter().collect();
        top.sort_by_key(|(k, v)| (std::cmp::Reverse(v.0), k.1));
        top.truncate(TOP_PREEMPTORS);
        let ms = |ns: u64| ns as f64 / 1e6;
        let per_step = run.lost / run.steps;
        let share = 100.0 * run.lost as f64 / run.dur.max(1) as f64;
        let names = top
            .iter()
            .map(|((comm, pid), (ns, _))| format!("{comm} (pid {pid}, {:.1} ms)", ms(*ns)))
            .collect::<Vec<_>>()
            .join(", ");
        let who = ranks.describe(w.tgid);
        out.push(Finding {
            kind: FindingKind::HostContention,
            ranks: ranks.of(w.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step: Some(run.first_step),
            start_ns: run.start,
            end_ns: Some(run.end),
            summary: format!(
                "host_contention: {who}'s training thread lost {:.1} ms per step ({share:.0}% \
                 of its steps) to other processes taking its CPU, {} steps in a row from step \
                 {}; most by {names}",
                ms(per_step),
                run.steps,
                run.first_step
            ),
            evidence: json!({
                "pid": w.tgid,
                "first_step": run.first_step,
                "steps": run.steps,
                "lost_ms_per_step": ms(per_step),
                "lost_share_pct": share,
                "step_ms": ms(run.dur / run.steps),
                "preemptors": top.iter().map(|((comm, pid), (ns, in_job))| json!({
                    "comm": comm,
                    "pid": pid,
                    "ms": ms(*ns),
                    "ms_per_step": ms(*ns / run.steps),
                    "traced": in_job,
                })).collect::<Vec<_>>(),
                "contention_min_share_pct": cfg.contention_min_share_pct,
                "contention_min_lost_ms": ms(cfg.contention_min_lost.as_nanos() as u64),
                "contention_min_steps": cfg.contention_min_steps,
            }),
            detected_ns: w.end,
        });
    }
}
