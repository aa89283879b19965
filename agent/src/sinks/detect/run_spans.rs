//! How far a reported run of steps went. A run (host contention, a
//! host-bound rank) is reported once, when it has held long enough, and
//! it goes on after that: the finding it fired with ends where the run had
//! got to then. The grouping into incidents needs the span the fault
//! really had. A rank that comes late ten steps into a contention that
//! still takes the job's CPU is its consequence, not a fault of its own.
//! So each detector notes here where its reported runs got to, and once
//! the run's findings are all known (the end of `agent attach`, `agent
//! diagnose`), [`RunSpans::extend`] stretches each finding to its run's
//! last step. The record stream already carries the finding as it fired.

use foldhash::HashMap;

use crate::model::{Finding, FindingKind};

/// Reported runs followed at most (as many as the findings kept).
const MAX_SPANS: usize = super::MAX_FINDINGS;

/// Which finding a run fired: its kind, start and ranks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReportedAs {
    pub kind: FindingKind,
    pub start_ns: u64,
    pub ranks: Vec<u32>,
}

impl ReportedAs {
    pub fn of(f: &Finding) -> Self {
        Self {
            kind: f.kind,
            start_ns: f.start_ns,
            ranks: f.ranks.clone(),
        }
    }
}

/// Where a reported run has got to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reach {
    end_ns: u64,
    last_step: u64,
    /// Its steps that counted (contended, bound), lulls not included.
    steps: u64,
}

#[derive(Default)]
pub struct RunSpans {
    reach: HashMap<ReportedAs, Reach>,
}

impl RunSpans {
    /// The run that fired `at` has reached `end_ns`, at `last_step`, with
    /// `steps` steps that counted.
    pub fn went_on(&mut self, at: &ReportedAs, end_ns: u64, last_step: u64, steps: u64) {
        if let Some(r) = self.reach.get_mut(at) {
            if end_ns >= r.end_ns {
                *r = Reach {
                    end_ns,
                    last_step,
                    steps,
                };
            }
        } else if self.reach.len() < MAX_SPANS {
            self.reach.insert(
                at.clone(),
                Reach {
                    end_ns,
                    last_step,
                    steps,
                },
            );
        }
    }

    /// Stretches each finding whose run went on past it to where the run
    /// got: its end, and in its evidence `last_step` (the run's last
    /// step that counted) and `run_steps` (how many counted).
    pub fn extend(&self, found: &mut [Finding]) {
        for f in found.iter_mut() {
            let Some(r) = self.reach.get(&ReportedAs::of(f)) else {
                continue;
            };
            if f.end_ns.is_some_and(|end| end >= r.end_ns) {
                continue;
            }
            f.end_ns = Some(r.end_ns);
            if let Some(e) = f.evidence.as_object_mut() {
                e.insert("last_step".into(), r.last_step.into());
                e.insert("run_steps".into(), r.steps.into());
            }
            f.summary
                .push_str(&format!("; it went on to step {}", r.last_step));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finding(kind: FindingKind, ranks: Vec<u32>, start_ns: u64, end_ns: u64) -> Finding {
        Finding {
            link: Default::default(),
            kind,
            ranks,
            comm: None,
            seq: None,
            step: Some(5),
            start_ns,
            end_ns: Some(end_ns),
            summary: "host_contention: x".into(),
            evidence: serde_json::json!({"steps": 3}),
            detected_ns: end_ns,
        }
    }

    #[test]
    fn a_finding_is_stretched_to_its_own_run_only() {
        let ours = finding(FindingKind::HostContention, vec![0, 1], 100, 200);
        let mut spans = RunSpans::default();
        let at = ReportedAs::of(&ours);
        spans.went_on(&at, 200, 7, 3);
        spans.went_on(&at, 500, 12, 8);
        // An earlier end never shortens it.
        spans.went_on(&at, 400, 11, 7);
        let mut found = vec![
            ours.clone(),
            // The same start, another rank; the same start and ranks,
            // another kind: other runs.
            finding(FindingKind::HostContention, vec![0], 100, 200),
            finding(FindingKind::HostBound, vec![0, 1], 100, 200),
        ];
        spans.extend(&mut found);
        assert_eq!(found[0].end_ns, Some(500));
        assert_eq!(found[0].evidence["last_step"], 12);
        assert_eq!(found[0].evidence["run_steps"], 8);
        assert_eq!(found[0].evidence["steps"], 3, "as it fired");
        assert_eq!(
            found[0].summary,
            "host_contention: x; it went on to step 12"
        );
        assert_eq!(
            found[1..],
            [
                finding(FindingKind::HostContention, vec![0], 100, 200),
                finding(FindingKind::HostBound, vec![0, 1], 100, 200)
            ]
        );
        // Once only: a second pass changes nothing.
        let once = found.clone();
        spans.extend(&mut found);
        assert_eq!(found, once);
    }

    #[test]
    fn a_run_that_stopped_where_it_fired_is_left_as_it_fired() {
        let f = finding(FindingKind::HostContention, vec![0], 100, 200);
        let mut spans = RunSpans::default();
        spans.went_on(&ReportedAs::of(&f), 200, 7, 3);
        let mut found = vec![f.clone()];
        spans.extend(&mut found);
        assert_eq!(found, vec![f]);
    }
}
