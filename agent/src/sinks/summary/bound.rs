//! Where each rank's steps went, over the whole recording: the sums of
//! its step splits (`Record::StepSplit`, fed back by the detect sink), as
//! shares of its steps' time, and what that makes the rank: host-bound
//! (its main thread mostly busy in its own code), device-bound (mostly
//! waiting in device calls: for its device or its peers) or neither.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::{Record, StepSplit};

/// One rank's steps, summed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankStepSplit {
    pub rank: u32,
    pub pid: u32,
    pub steps: u64,
    pub step_ms: f64,
    /// Shares of its steps' time, in percent.
    pub host_pct: f64,
    pub device_calls_pct: f64,
    pub runnable_pct: f64,
    pub asleep_pct: f64,
    /// `host`, `device` or `mixed`.
    pub bound: &'static str,
    /// Kernel and graph launches per step, over the steps with counts
    /// (the kernel counts launches at every capture level); None when
    /// no launch was counted.
    pub launches_per_step: Option<f64>,
    pub graph_launches_per_step: Option<f64>,
}

/// A share of the steps' time past which a rank is bound by it.
const BOUND_PCT: f64 = 50.0;

#[derive(Default)]
pub struct StepBound {
    /// pid -> its rank.
    ranks: BTreeMap<u32, u32>,
    /// pid -> (steps, the splits' sums).
    sums: BTreeMap<u32, (u64, StepSplit)>,
    /// pid -> (steps with launch counts, kernel launches, graph launches).
    launches: BTreeMap<u32, (u64, u64, u64)>,
}

impl StepBound {
    pub fn record(&mut self, r: &Record) {
        match r {
            Record::Identity { tgid, identity } => {
                if let Some(rank) = identity.rank.as_deref().and_then(|r| r.trim().parse().ok()) {
                    self.ranks.insert(*tgid, rank);
                }
            }
            Record::StepSplit(s) => {
                let (n, sum) = self.sums.entry(s.tgid).or_default();
                *n += 1;
                sum.dur += s.split.dur;
                sum.in_device_calls += s.split.in_device_calls;
                sum.runnable += s.split.runnable;
                sum.asleep += s.split.asleep;
                sum.host += s.split.host;
                if let Some(l) = s.launches {
                    let (n, kernels, graphs) = self.launches.entry(s.tgid).or_default();
                    *n += 1;
                    *kernels += l.kernels;
                    *graphs += l.graphs;
                }
            }
            _ => {}
        }
    }

    /// Every rank with steps, by rank. (A pid that came back as another
    /// rank keeps the last rank it had.)
    pub fn finish(self) -> Vec<RankStepSplit> {
        let mut out: Vec<RankStepSplit> = self
            .sums
            .iter()
            .filter_map(|(pid, (n, s))| {
                let rank = *self.ranks.get(pid)?;
                let pct = |part: u64| 100.0 * part as f64 / s.dur.max(1) as f64;
                let (host, device) = (pct(s.host), pct(s.in_device_calls));
                let per_step = |pick: fn(&(u64, u64, u64)) -> u64| {
                    let l = self.launches.get(pid)?;
                    Some(pick(l) as f64 / l.0.max(1) as f64)
                };
                Some(RankStepSplit {
                    rank,
                    pid: *pid,
                    steps: *n,
                    step_ms: s.dur as f64 / 1e6 / (*n).max(1) as f64,
                    host_pct: host,
                    device_calls_pct: device,
                    runnable_pct: pct(s.runnable),
                    asleep_pct: pct(s.asleep),
                    bound: if host >= BOUND_PCT {
                        "host"
                    } else if device >= BOUND_PCT {
                        "device"
                    } else {
                        "mixed"
                    },
                    launches_per_step: per_step(|l| l.1),
                    graph_launches_per_step: per_step(|l| l.2),
                })
            })
            .collect();
        out.sort_by_key(|r| (r.rank, r.pid));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RankIdentity, StepSplitRecord};

    fn split(tgid: u32, host: u64, device: u64) -> Record {
        Record::StepSplit(Box::new(StepSplitRecord {
            tgid,
            step: 0,
            start: 0,
            end: 100,
            split: StepSplit {
                dur: 100,
                in_device_calls: device,
                runnable: 5,
                asleep: 100 - 5 - host - device,
                host,
            },
            launches: None,
        }))
    }

    #[test]
    fn each_rank_s_steps_are_summed_and_named_by_what_bound_them() {
        let mut b = StepBound::default();
        for (tgid, rank) in [(10, 0), (11, 1), (12, 2)] {
            b.record(&Record::Identity {
                tgid,
                identity: Box::new(RankIdentity::from_environ(
                    format!("RANK={rank}\0").as_bytes(),
                )),
            });
        }
        for r in [
            split(10, 70, 20),
            split(10, 50, 40),
            split(11, 10, 80),
            split(12, 40, 40),
            // No rank: not a rank's steps.
            split(99, 90, 0),
        ] {
            b.record(&r);
        }
        let out = b.finish();
        let row = |rank: u32| out.iter().find(|r| r.rank == rank).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(
            (row(0).steps, row(0).host_pct, row(0).bound),
            (2, 60.0, "host")
        );
        assert_eq!((row(1).device_calls_pct, row(1).bound), (80.0, "device"));
        assert_eq!(row(2).bound, "mixed");
        assert_eq!(row(0).runnable_pct, 5.0);
    }
}
