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
//! least `contention_min_share_pct` percent of the step. It fires when a
//! run holds `contention_min_steps` contended steps, once per run: a run
//! goes on through one uncontended step (contention flickers with the rest
//! of the machine's load) and ends at two in a row, or, once reported, at
//! `contention_min_steps` in a row. The finding names the first step of the run, the time lost per step and the top
//! preemptors (command name, pid, time taken; a traced one by its rank,
//! and whether it is of the same job).

use std::collections::HashMap;

use serde_json::json;

use super::Ranks;
use super::host_config::HostDetectConfig;
use super::host_steps::Window;
use crate::model::{Finding, FindingKind};

/// Preemptors named in a finding.
pub const TOP_PREEMPTORS: usize = 3;
/// Distinct preemptors counted per run of contended steps.
const MAX_PREEMPTORS: usize = 256;

/// Command names kept per preemptor process.
const MAX_COMMS: usize = 4;

/// The time one process took from the main thread.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Taken {
    pub ns: u64,
    /// A process traced along with the job.
    pub in_job: bool,
    /// Its threads' command names, with the time each took.
    pub comms: Vec<(String, u64)>,
}

impl Taken {
    fn add(&mut self, comm: &str, ns: u64) {
        self.ns += ns;
        if let Some(c) = self.comms.iter_mut().find(|(c, _)| c == comm) {
            c.1 += ns;
        } else if self.comms.len() < MAX_COMMS {
            self.comms.push((comm.to_string(), ns));
        }
    }

    /// The command name that took the most.
    fn comm(&self) -> &str {
        self.comms
            .iter()
            .max_by_key(|(_, ns)| *ns)
            .map_or("?", |(c, _)| c)
    }
}

/// Time taken per preemptor process (pid).
pub type Takers = HashMap<u32, Taken>;

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
    /// Uncontended steps since the last contended one.
    clean: u32,
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
        if by.len() < MAX_PREEMPTORS || by.contains_key(&p.pid) {
            let e = by.entry(p.pid).or_default();
            e.in_job = p.in_job;
            e.add(&p.comm, d);
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
            // A run survives one step under the bar (contention flickers
            // with what else the machine runs); a reported one ends only
            // after `contention_min_steps` such steps in a row, so a lull
            // in a long contention is not a new finding.
            if let Some(run) = self.runs.get_mut(&w.tgid) {
                run.clean += 1;
                let ends = if run.reported {
                    cfg.contention_min_steps.max(2)
                } else {
                    2
                };
                if run.clean >= ends {
                    self.runs.remove(&w.tgid);
                }
            }
            return;
        }
        let run = self.runs.entry(w.tgid).or_insert_with(|| Run {
            first_step: w.step,
            start: w.start,
            ..Run::default()
        });
        run.clean = 0;
        run.end = w.end;
        run.steps += 1;
        run.lost += lost;
        run.dur += w.dur();
        for (pid, taken) in by {
            if run.by.len() < MAX_PREEMPTORS || run.by.contains_key(&pid) {
                let e = run.by.entry(pid).or_default();
                e.in_job = taken.in_job;
                for (comm, ns) in &taken.comms {
                    e.add(comm, *ns);
                }
            }
        }
        if run.reported || run.steps < u64::from(cfg.contention_min_steps.max(1)) {
            return;
        }
        run.reported = true;
        let mut top: Vec<_> = run.by.iter().collect();
        top.sort_by_key(|(pid, t)| (std::cmp::Reverse(t.ns), **pid));
        top.truncate(TOP_PREEMPTORS);
        let ms = |ns: u64| ns as f64 / 1e6;
        let per_step = run.lost / run.steps;
        let share = 100.0 * run.lost as f64 / run.dur.max(1) as f64;
        // A traced preemptor is named by its rank: a sibling rank of the
        // same job (an oversubscribed node) reads differently from
        // another job sharing the node, or from an untraced process.
        let job = ranks.job_of(w.tgid);
        let whose = |pid: u32| -> Option<String> {
            let rank = ranks.of(pid)?;
            Some(match ranks.job_of(pid) {
                j if j == job => format!("its job's rank {rank}"),
                "" => format!("rank {rank} of an unlabelled job"),
                j => format!("rank {rank} of job {j}"),
            })
        };
        let names = top
            .iter()
            .map(|(pid, t)| {
                let what = format!("{} (pid {pid}, {:.1} ms)", t.comm(), ms(t.ns));
                match whose(**pid) {
                    Some(rank) => format!("{rank}, {what}"),
                    None => what,
                }
            })
            .collect::<Vec<_>>()
            .join(", ");
        let who = ranks.describe(w.tgid);
        out.push(Finding {
            link: Default::default(),
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
                "preemptors": top.iter().map(|(pid, t)| json!({
                    "comm": t.comm(),
                    "pid": pid,
                    "ms": ms(t.ns),
                    "ms_per_step": ms(t.ns / run.steps),
                    "traced": t.in_job,
                    "rank": ranks.of(**pid),
                    "job": ranks.of(**pid).map(|_| ranks.job_of(**pid)),
                    "threads": t.comms.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
                "contention_min_share_pct": cfg.contention_min_share_pct,
                "contention_min_lost_ms": ms(cfg.contention_min_lost.as_nanos() as u64),
                "contention_min_steps": cfg.contention_min_steps,
            }),
            detected_ns: w.end,
        });
    }
}
