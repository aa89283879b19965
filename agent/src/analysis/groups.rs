//! The job's parallel groups, from its communicators alone: which
//! communicators are tensor-, pipeline- and data-parallel groups, and each
//! rank's index in each.
//!
//! - A communicator used only for send/receive is a pipeline pair; its comm
//!   rank 0 is the earlier stage (as pipeline schedules create them), so
//!   following pairs from a rank without a predecessor gives each stage.
//! - Collective communicators fall into families of equal size and equal
//!   stride between members (Megatron-style layouts: TP groups are
//!   contiguous ranks, DP groups stride over them). With two or more
//!   families the smallest stride is TP and the next DP; further ones are
//!   `other`. A lone family is TP when it gathers or scatters
//!   (activations), DP when it only reduces or broadcasts (gradients).

use std::collections::{BTreeMap, BTreeSet};

/// A communicator with what the traces say about it.
#[derive(Clone, Debug, Default)]
pub struct CommInfo {
    pub hash: u64,
    pub size: u32,
    /// Global rank of each comm rank, where known.
    pub members: Vec<Option<u32>>,
    pub ops: BTreeSet<&'static str>,
    pub operations: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CommGroup {
    pub comm_hash: String,
    /// "tp", "dp", "pp" or "other".
    pub kind: String,
    pub size: u32,
    pub members: Vec<Option<u32>>,
    pub ops: Vec<&'static str>,
    pub operations: u64,
}

/// A rank's place in the layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Coord {
    pub tp: u32,
    pub pp: u32,
    pub dp: u32,
}

impl Coord {
    pub fn label(&self) -> String {
        format!("tp {}, pp {}, dp {}", self.tp, self.pp, self.dp)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Groups {
    pub tp_size: u32,
    pub pp_size: u32,
    pub dp_size: u32,
    pub communicators: Vec<CommGroup>,
    pub ranks: BTreeMap<u32, Coord>,
}

impl Groups {
    pub fn kind_of(&self, hash: u64) -> Option<&str> {
        let h = format!("{hash:016x}");
        self.communicators
            .iter()
            .find(|c| c.comm_hash == h)
            .map(|c| c.kind.as_str())
    }
}

fn stride(members: &[Option<u32>]) -> Option<u32> {
    let mut m: Vec<u32> = members.iter().copied().collect::<Option<Vec<_>>>()?;
    m.sort_unstable();
    let d = m.get(1)?.checked_sub(m[0])?;
    m.windows(2).all(|w| w[1] - w[0] == d).then_some(d)
}

fn is_p2p(c: &CommInfo) -> bool {
    !c.ops.is_empty() && c.ops.iter().all(|o| matches!(*o, "send" | "recv"))
}

/// Classifies `comms` and places every rank in `ranks`.
pub fn infer(comms: &[CommInfo], ranks: &BTreeSet<u32>) -> Groups {
    let mut kinds: Vec<&'static str> = vec!["other"; comms.len()];
    // Families of collective communicators: (stride, size) -> indexes.
    let mut families: BTreeMap<(u32, u32), Vec<usize>> = BTreeMap::new();
    for (i, c) in comms.iter().enumerate() {
        if is_p2p(c) {
            kinds[i] = "pp";
        } else if c.size > 1 {
            let s = stride(&c.members).unwrap_or(u32::MAX);
            families.entry((s, c.size)).or_default().push(i);
        }
    }
    let ordered: Vec<&Vec<usize>> = families.values().collect();
    match ordered.as_slice() {
        [] => {}
        [only] => {
            let gathers = only.iter().any(|&i| {
                comms[i]
                    .ops
                    .iter()
                    .any(|o| matches!(*o, "all_gather" | "reduce_scatter"))
            });
            for &i in *only {
                kinds[i] = if gathers { "tp" } else { "dp" };
            }
        }
        [tp, dp, rest @ ..] => {
            for &i in *tp {
                kinds[i] = "tp";
            }
            for &i in *dp {
                kinds[i] = "dp";
            }
            for fam in rest {
                for &i in *fam {
                    kinds[i] = "other";
                }
            }
        }
    }
    let mut coords: BTreeMap<u32, Coord> = ranks.iter().map(|&r| (r, Coord::default())).collect();
    let mut tp_size = 1;
    let mut dp_size = 1;
    let mut pred: BTreeMap<u32, u32> = BTreeMap::new();
    for (i, c) in comms.iter().enumerate() {
        for (comm_rank, m) in c.members.iter().enumerate() {
            let Some(r) = *m else { continue };
            let coord = coords.entry(r).or_default();
            match kinds[i] {
                "tp" => {
                    coord.tp = comm_rank as u32;
                    tp_size = tp_size.max(c.size);
                }
                "dp" => {
                    coord.dp = comm_rank as u32;
                    dp_size = dp_size.max(c.size);
                }
                _ => {}
            }
        }
        if kinds[i] == "pp"
            && let [Some(a), Some(b)] = c.members.as_slice()
        {
            pred.insert(*b, *a);
        }
    }
    let mut pp_size = 1;
    let all: Vec<u32> = coords.keys().copied().collect();
    for r in all {
        let mut stage = 0;
        let mut at = r;
        while let Some(&p) = pred.get(&at) {
            stage += 1;
            at = p;
            if stage > pred.len() as u32 {
                break; // a cycle: not a pipeline
            }
        }
        if let Some(c) = coords.get_mut(&r) {
            c.pp = stage;
        }
        pp_size = pp_size.max(stage + 1);
    }
    let mut communicators: Vec<CommGroup> = comms
        .iter()
        .zip(&kinds)
        .map(|(c, k)| CommGroup {
            comm_hash: format!("{:016x}", c.hash),
            kind: (*k).to_owned(),
            size: c.size,
            members: c.members.clone(),
            ops: c.ops.iter().copied().collect(),
            operations: c.operations,
        })
        .collect();
    communicators.sort_by(|a, b| (&a.kind, &a.members).cmp(&(&b.kind, &b.members)));
    Groups {
        tp_size,
        pp_size,
        dp_size,
        communicators,
        ranks: coords,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The communicators of a Megatron "tp-dp-pp" layout, as the simulator
    /// builds them (tests/sim/sim_layout.py), with the ops it runs.
    fn layout(tp: u32, pp: u32, dp: u32) -> (Vec<CommInfo>, BTreeMap<u32, Coord>) {
        let rank = |t: u32, d: u32, p: u32| t + tp * (d + dp * p);
        let mut comms = Vec::new();
        let mut hash = 1;
        let mut push = |members: Vec<u32>, ops: &[&'static str]| {
            comms.push(CommInfo {
                hash,
                size: members.len() as u32,
                members: members.into_iter().map(Some).collect(),
                ops: ops.iter().copied().collect(),
                operations: 10,
            });
            hash += 1;
        };
        for p in 0..pp {
            for d in 0..dp {
                if tp > 1 {
                    push(
                        (0..tp).map(|t| rank(t, d, p)).collect(),
                        &["all_gather", "reduce_scatter"],
                    );
                }
            }
        }
        for p in 0..pp {
            for t in 0..tp {
                if dp > 1 {
                    push(
                        (0..dp).map(|d| rank(t, d, p)).collect(),
                        &["broadcast", "all_reduce"],
                    );
                }
            }
        }
        for s in 0..pp.saturating_sub(1) {
            for d in 0..dp {
                for t in 0..tp {
                    push(vec![rank(t, d, s), rank(t, d, s + 1)], &["send", "recv"]);
                }
            }
        }
        let mut truth = BTreeMap::new();
        for p in 0..pp {
            for d in 0..dp {
                for t in 0..tp {
                    truth.insert(
                        rank(t, d, p),
                        Coord {
                            tp: t,
                            pp: p,
                            dp: d,
                        },
                    );
                }
            }
        }
        (comms, truth)
    }

    #[test]
    fn recovers_megatron_layouts_of_4_8_and_16_ranks() {
        for (tp, pp, dp) in [
            (1, 1, 4),
            (2, 1, 2),
            (4, 1, 1),
            (1, 4, 1),
            (2, 2, 2),
            (2, 2, 4),
            (4, 2, 2),
            (2, 4, 2),
        ] {
            let (comms, truth) = layout(tp, pp, dp);
            let ranks = truth.keys().copied().collect();
            let g = infer(&comms, &ranks);
            assert_eq!(g.ranks, truth, "tp{tp} pp{pp} dp{dp}");
            assert_eq!((g.tp_size, g.pp_size, g.dp_size), (tp, pp, dp));
            let count = |k: &str| g.communicators.iter().filter(|c| c.kind == k).count() as u32;
            assert_eq!(count("tp"), if tp > 1 { pp * dp } else { 0 });
            assert_eq!(count("dp"), if dp > 1 { pp * tp } else { 0 });
            assert_eq!(count("pp"), (pp - 1) * tp * dp);
        }
    }

    #[test]
    fn labels_read_like_the_issue_asks() {
        let (comms, truth) = layout(2, 2, 2);
        let g = infer(&comms, &truth.keys().copied().collect());
        assert_eq!(g.ranks[&5].label(), "tp 1, pp 1, dp 0");
        assert_eq!(g.kind_of(1), Some("tp"));
    }
}
