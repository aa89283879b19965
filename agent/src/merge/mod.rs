//! `agent merge`: one trace of a whole job from the traces of its nodes.
//!
//! ```text
//! agent merge -o job.pftrace node0.pftrace node1.pftrace ...
//! ```
//!
//! Two streaming passes over the inputs (memory bounded by one packet and
//! per-node tables of processes, tracks and communicators, never by the
//! traces' size):
//! 1. [`scan`]: hostnames, clock snapshots, ranks, pids, CPUs, sequences,
//!    communicators and a sample of collective end times per node;
//!    [`align`] turns those into per-node clock offsets, [`groups`] the
//!    communicators into TP/PP/DP groups.
//! 2. [`emit`]: every node's packets rewritten into one id space and one
//!    time base, written as they are read.

mod align;
pub(crate) mod collectives;
mod emit;
mod ids;
mod mix;
mod output;
mod scan;
mod step_out;
mod steps;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use xpuscope_perfetto::SystemInfo;
use xpuscope_perfetto::rewrite::Packet;

use crate::analysis::groups::{self, CommInfo, Groups};
use crate::analysis::steps::{dp_comm_by_rank, slowest_lines};
use align::{Alignment, NodeClock};
use emit::EmitOptions;
use ids::MERGE_SYSTEM_SEQUENCE;
use output::Output;
use scan::NodeScan;
use step_out::{StepOut, StepTable};

/// Perfetto's limit on CPU numbers (`FtraceEventBundle.cpu`).
const MAX_CPUS: u32 = 1024;

#[derive(Clone, Debug)]
pub struct MergeOptions {
    pub inputs: Vec<PathBuf>,
    pub output: PathBuf,
    /// Merge traces whose job labels differ.
    pub force: bool,
    /// Leave the scheduler data out (many nodes' CPUs exceed Perfetto's 1024).
    pub no_sched: bool,
    /// Write the step breakdown here as CSV.
    pub steps_csv: Option<PathBuf>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Truncation {
    pub complete_bytes: u64,
    pub partial_bytes: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct NodeReport {
    pub trace: PathBuf,
    pub hostname: String,
    pub ranks: Vec<u32>,
    pub jobs: Vec<String>,
    pub bytes: u64,
    pub packets: u64,
    pub truncated: Option<Truncation>,
    /// CPU numbers of this node in the merged trace start here.
    pub cpu_base: u32,
    /// Pids moved because an earlier node uses them.
    pub pids_remapped: usize,
    pub collectives: u64,
    pub collectives_inexact: u64,
    pub collective_ends_sampled: usize,
    #[serde(flatten)]
    pub alignment: Alignment,
}

#[derive(Debug, serde::Serialize)]
pub struct MergeReport {
    pub schema: &'static str,
    pub output: PathBuf,
    pub nodes: Vec<NodeReport>,
    pub groups: Groups,
    pub warnings: Vec<String>,
    /// Per rank and step (the first step of each rank has no start marker
    /// and is left out), in the order they finished.
    pub steps: StepTable,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub seconds: f64,
    pub mb_per_s: f64,
    pub peak_rss_bytes: u64,
}

fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Communicators seen on any node, members as global ranks.
fn communicators(scans: &[NodeScan]) -> Vec<CommInfo> {
    let mut by_hash: BTreeMap<u64, CommInfo> = BTreeMap::new();
    for s in scans {
        let ranks = s.ranks();
        for (&hash, seen) in &s.comms {
            let c = by_hash.entry(hash).or_insert_with(|| CommInfo {
                hash,
                ..CommInfo::default()
            });
            c.size = c.size.max(seen.size);
            if c.members.len() < c.size as usize {
                c.members.resize(c.size as usize, None);
            }
            for (&comm_rank, pid) in &seen.members {
                if let (Some(slot), Some(&r)) =
                    (c.members.get_mut(comm_rank as usize), ranks.get(pid))
                {
                    *slot = Some(r);
                }
            }
            c.ops.extend(seen.ops.iter().copied());
            c.operations = c.operations.max(seen.operations);
        }
    }
    by_hash.into_values().collect()
}

fn check_jobs(scans: &[NodeScan], force: bool, warnings: &mut Vec<String>) -> Result<()> {
    let jobs: Vec<BTreeSet<String>> = scans.iter().map(NodeScan::jobs).collect();
    let all: BTreeSet<&String> = jobs.iter().flatten().collect();
    if all.len() <= 1 {
        return Ok(());
    }
    let list = scans
        .iter()
        .zip(&jobs)
        .map(|(s, j)| {
            let names: Vec<&str> = j.iter().map(String::as_str).collect();
            format!(
                "{}: job {}",
                s.path.display(),
                if names.is_empty() {
                    "(none)".into()
                } else {
                    names.join(", ")
                }
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    if !force {
        bail!(
            "these traces are of different jobs ({list}); merge the traces of one job, or pass --force to merge them anyway"
        );
    }
    warnings.push(format!("merged traces of different jobs (--force): {list}"));
    Ok(())
}

pub fn run(opts: &MergeOptions) -> Result<MergeReport> {
    let started = Instant::now();
    if opts.inputs.is_empty() {
        bail!("no traces to merge: give one trace per node");
    }
    if let Some(same) = opts.inputs.iter().find(|p| **p == opts.output) {
        bail!(
            "the output {} is also an input: write the merged trace elsewhere",
            same.display()
        );
    }
    let scans = opts
        .inputs
        .iter()
        .map(|p| scan::scan(p))
        .collect::<Result<Vec<_>>>()?;
    let mut warnings = Vec::new();
    check_jobs(&scans, opts.force, &mut warnings)?;
    for s in &scans {
        if let Some(t) = s.truncated {
            warnings.push(format!(
                "{} is truncated: merged up to its last complete packet (byte {}; {} bytes of a cut packet left out)",
                s.path.display(),
                t.complete_bytes,
                t.partial_bytes
            ));
        }
    }
    let cpus: u32 = scans
        .iter()
        .map(NodeScan::cpu_span)
        .fold(0, u32::saturating_add);
    if cpus > MAX_CPUS && !opts.no_sched {
        bail!(
            "the nodes have {cpus} CPUs in all, more than Perfetto's {MAX_CPUS}: merge fewer nodes, or pass --no-sched to leave scheduler data out"
        );
    }
    let samples: Vec<HashMap<(u64, u64), u64>> = scans.iter().map(|s| s.ends.ends()).collect();
    let entries: Vec<HashMap<(u64, u64), u64>> = scans.iter().map(|s| s.ends.entries()).collect();
    let clocks: Vec<NodeClock<'_>> = scans
        .iter()
        .zip(&samples)
        .zip(&entries)
        .map(|((s, e), en)| NodeClock {
            snapshot: s.first_clock,
            ends: e,
            entries: en,
        })
        .collect();
    let alignments = align::align(&clocks);
    for (s, a) in scans.iter().zip(&alignments).skip(1) {
        match a.method {
            align::Method::Realtime => warnings.push(format!(
                "{}: no collectives shared with the other nodes (communicator set-up not recorded?): aligned by REALTIME only",
                s.path.display()
            )),
            align::Method::None => warnings.push(format!(
                "{}: no clock snapshot and no shared collectives: its clock is taken as is (offset 0)",
                s.path.display()
            )),
            align::Method::Collectives | align::Method::Bounds if s.first_clock.is_none() => warnings.push(format!(
                "{}: no clock snapshot: aligned by its collectives alone",
                s.path.display()
            )),
            _ => {}
        }
    }
    if scans.len() > 1 && scans[0].first_clock.is_none() {
        warnings.push(format!(
            "{}: no clock snapshot: the other nodes are aligned by collectives only",
            scans[0].path.display()
        ));
    }
    let ranks: BTreeSet<u32> = scans.iter().flat_map(|s| s.ranks().into_values()).collect();
    let mut seen_ranks: HashMap<u32, usize> = HashMap::new();
    for (k, s) in scans.iter().enumerate() {
        for r in s.ranks().into_values() {
            if let Some(j) = seen_ranks.insert(r, k)
                && j != k
            {
                warnings.push(format!(
                    "rank {r} is in {} and {}",
                    scans[j].path.display(),
                    s.path.display()
                ));
            }
        }
    }
    let comms = communicators(&scans);
    let groups = groups::infer(&comms, &ranks);

    let offsets: Vec<i64> = alignments.iter().map(|a| a.offset_ns).collect();
    let mut maps = ids::node_maps(&scans, &offsets);
    let mut out = Output::create(&opts.output)?;
    let first = &scans[0];
    let hosts: Vec<String> = scans
        .iter()
        .enumerate()
        .map(|(k, s)| s.host_label(k))
        .collect();
    let job = scans.iter().flat_map(NodeScan::jobs).next();
    out.write(&Packet::new_system_info(
        MERGE_SYSTEM_SEQUENCE,
        &SystemInfo {
            sysname: "Linux".into(),
            release: first.release.clone().unwrap_or_default(),
            num_cpus: cpus,
            machine_name: Some(match &job {
                Some(j) => format!("job {j} on {}", hosts.join(", ")),
                None => hosts.join(", "),
            }),
            ..SystemInfo::default()
        },
    ))?;
    emit::rank_tracks(&scans, &mut maps, &groups, &mut out)?;
    let emit_opts = EmitOptions {
        no_sched: opts.no_sched,
        dp: dp_comm_by_rank(&groups),
    };
    let mut step_out = StepOut::create(
        &opts.output,
        opts.steps_csv.as_deref(),
        &scans,
        &mut maps,
        &mut out,
    )?;
    for (k, s) in scans.iter().enumerate() {
        emit::emit_node(
            s,
            k,
            &mut maps[k],
            &groups,
            &emit_opts,
            &mut step_out,
            &mut out,
        )?;
    }
    let steps = step_out.finish()?;
    let bytes_out = out.bytes;
    out.finish()?;

    let nodes: Vec<NodeReport> = scans
        .iter()
        .zip(alignments)
        .zip(&maps)
        .enumerate()
        .map(|(k, ((s, alignment), m))| NodeReport {
            trace: s.path.clone(),
            hostname: s.host_label(k),
            ranks: s
                .ranks()
                .into_values()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
            jobs: s.jobs().into_iter().collect(),
            bytes: s.bytes,
            packets: s.packets,
            truncated: s.truncated.map(|t| Truncation {
                complete_bytes: t.complete_bytes,
                partial_bytes: t.partial_bytes,
            }),
            cpu_base: m.cpu_base,
            pids_remapped: m.pids.len(),
            collectives: s.collectives,
            collectives_inexact: s.collectives_inexact,
            collective_ends_sampled: s.ends.len(),
            alignment,
        })
        .collect();
    let bytes_in: u64 = scans.iter().map(|s| s.bytes).sum();
    let seconds = started.elapsed().as_secs_f64();
    Ok(MergeReport {
        schema: "xpuscope-merge/1",
        output: opts.output.clone(),
        nodes,
        groups,
        warnings,
        steps,
        bytes_in,
        bytes_out,
        seconds,
        mb_per_s: bytes_in as f64 / 1e6 / seconds.max(1e-9),
        peak_rss_bytes: peak_rss_bytes(),
    })
}

fn us(ns: i64) -> String {
    format!("{:.1} us", ns as f64 / 1e3)
}

impl MergeReport {
    /// The human summary (stdout).
    pub fn print(&self) {
        println!(
            "xpuscope merge: {} nodes, {} ranks -> {} ({:.1} MB)",
            self.nodes.len(),
            self.groups.ranks.len(),
            self.output.display(),
            self.bytes_out as f64 / 1e6
        );
        println!(
            "  clock alignment (offset added to each node's BOOTTIME; node 0 is the time base):"
        );
        for n in &self.nodes {
            let a = &n.alignment;
            println!(
                "    {:<12} ranks {:<12} offset {:>16}  correction over REALTIME {:>12}  residual median {} p90 {} over {} collectives ({:?}{})",
                n.hostname,
                format!("{:?}", n.ranks),
                us(a.offset_ns),
                a.correction_ns.map_or("-".into(), us),
                a.residual_median_ns.map_or("-".into(), |v| us(v as i64)),
                a.residual_p90_ns.map_or("-".into(), |v| us(v as i64)),
                a.matched_collectives,
                a.method,
                // The most the offset can be off: its distance to the
                // far end of what the causality allows relative to node 0.
                a.bounds_ns.map_or(String::new(), |(lo, hi)| format!(
                    ", within {}",
                    us((a.offset_ns - lo).max(hi - a.offset_ns))
                ))
            );
        }
        let g = &self.groups;
        println!(
            "  parallel groups: tp {} x pp {} x dp {} ({} communicators)",
            g.tp_size,
            g.pp_size,
            g.dp_size,
            g.communicators.len()
        );
        for c in &g.communicators {
            let members: Vec<String> = c
                .members
                .iter()
                .map(|m| m.map_or("?".into(), |r| r.to_string()))
                .collect();
            println!(
                "    {:<5} {} ranks [{}] {} ops ({})",
                c.kind,
                c.size,
                members.join(", "),
                c.operations,
                c.ops.join(", ")
            );
        }
        if self.steps.rows > 0 {
            println!("  slowest steps (of {}):", self.steps.rows);
            for line in slowest_lines(self.steps.slowest.iter().map(|(r, s)| (*r, s)), 5) {
                println!("    {line}");
            }
        }
        for w in &self.warnings {
            println!("  warning: {w}");
        }
        println!(
            "  {:.1} MB read in {:.2} s ({:.0} MB/s), peak RSS {:.0} MB",
            self.bytes_in as f64 / 1e6,
            self.seconds,
            self.mb_per_s,
            self.peak_rss_bytes as f64 / 1e6
        );
    }
}
