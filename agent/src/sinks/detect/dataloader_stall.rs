//! `dataloader_stall`: a rank's training (main) thread waited for its data
//! loader far longer than it usually does.
//!
//! A step's data wait is measured as the step breakdown measures it
//! (`analysis::steps`): the main thread's time off CPU between the end of
//! the previous step (the sync after its gradient all-reduce's sync: the
//! optimizer's) and the step's first collective or sync, counting intervals
//! asleep outside a device call, or whose off-CPU stack is in a data loader.
//! A late arrival (sleeping just before the all-reduce) or a wait inside a
//! sync is not in that stretch. In a step the job marked (an mstx range
//! `step N`, [`step_marks`](super::step_marks)) the stretch starts at the
//! range's start: the step begins with its data wait.
//!
//! It fires on a step whose wait is at least `stall_min` and at least
//! `stall_factor` times the rank's usual wait (the median of its previous
//! [`HISTORY`] steps, once it has `stall_min_history` of them); once per
//! run of consecutive stalled steps.

use foldhash::HashMap;
use std::collections::VecDeque;

use serde_json::json;

use super::Ranks;
use super::host_config::HostDetectConfig;
use super::host_steps::{CallShape, Window};
use super::step_marks::StepSource;
use crate::model::{Finding, FindingKind};

/// Steps of a rank whose waits make its usual wait.
pub const HISTORY: usize = 16;

#[derive(Default)]
struct RankWaits {
    /// The data waits of its last steps, ns.
    history: VecDeque<u64>,
    /// The previous step stalled (one finding per run of stalled steps).
    stalled: bool,
}

#[derive(Default)]
pub struct StallDetector {
    ranks: HashMap<u32, RankWaits>,
}

/// The step's data wait: (ns, of which with a data-loader stack).
pub fn data_wait(w: &Window) -> (u64, u64) {
    // A marked step starts with its data wait.
    if w.source == StepSource::Markers {
        return wait_between(w, w.start);
    }
    // The previous step ends at the second sync after its all-reduce (the
    // optimizer's), or the first when there is one before the next call.
    let syncs: Vec<_> = w
        .calls
        .iter()
        .skip(1)
        .take_while(|c| !matches!(c.shape, CallShape::Collective { .. }))
        .filter(|c| c.shape == CallShape::Sync)
        .take(2)
        .collect();
    wait_between(w, syncs.last().map_or(w.start, |c| c.end))
}

/// The data wait from `from` to the step's first collective or sync.
fn wait_between(w: &Window, from: u64) -> (u64, u64) {
    let to = w
        .calls
        .iter()
        .filter(|c| c.start >= from && c.shape != CallShape::Other)
        .map(|c| c.start)
        .min()
        .unwrap_or(w.end)
        .min(w.end);
    let inside_call = |s: u64, e: u64| w.calls.iter().any(|c| c.start <= s && e <= c.end);
    let (mut wait, mut loader) = (0, 0);
    for i in w.off_cpu.iter().filter(|i| i.start >= from && i.start < to) {
        if !(i.in_loader || (i.asleep && !inside_call(i.start, i.end))) {
            continue;
        }
        let d = i.end.min(to) - i.start;
        wait += d;
        if i.in_loader {
            loader += d;
        }
    }
    (wait, loader)
}

fn median(v: &VecDeque<u64>) -> u64 {
    let mut s: Vec<u64> = v.iter().copied().collect();
    s.sort_unstable();
    s.get(s.len() / 2).copied().unwrap_or(0)
}

impl StallDetector {
    pub fn forget(&mut self, tgid: u32) {
        self.ranks.remove(&tgid);
    }

    pub fn step_ended(
        &mut self,
        w: &Window,
        cfg: &HostDetectConfig,
        ranks: &Ranks,
        out: &mut Vec<Finding>,
    ) {
        let (wait, loader) = data_wait(w);
        let r = self.ranks.entry(w.tgid).or_default();
        let usual = median(&r.history);
        let known = r.history.len() >= cfg.stall_min_history as usize;
        let stalled = known
            && wait >= cfg.stall_min.as_nanos() as u64
            && wait >= usual.saturating_mul(u64::from(cfg.stall_factor));
        if r.history.len() >= HISTORY {
            r.history.pop_front();
        }
        r.history.push_back(wait);
        let first = stalled && !r.stalled;
        r.stalled = stalled;
        if !first {
            return;
        }
        let ms = |ns: u64| ns as f64 / 1e6;
        let who = ranks.describe(w.tgid);
        let seen = if loader > 0 {
            " (its off-CPU stack is in the data loader)"
        } else {
            ""
        };
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::DataloaderStall,
            ranks: ranks.of(w.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step: Some(w.step),
            start_ns: w.start,
            end_ns: Some(w.end),
            summary: format!(
                "dataloader_stall: {who}'s training thread waited {:.1} ms for its data \
                 loader at step {}{seen}, usually {:.1} ms ({:.0}% of the step)",
                ms(wait),
                w.step,
                ms(usual),
                100.0 * wait as f64 / w.dur().max(1) as f64
            ),
            evidence: json!({
                "pid": w.tgid,
                "step": w.step,
                "wait_ms": ms(wait),
                "usual_wait_ms": ms(usual),
                "history_steps": r.history.len() - 1,
                "in_loader_stack_ms": ms(loader),
                "step_ms": ms(w.dur()),
                "stall_min_ms": ms(cfg.stall_min.as_nanos() as u64),
                "stall_factor": cfg.stall_factor,
            }),
            detected_ns: w.end,
        });
    }
}
