//! The floor of the step-time benchmarks: programs that only count, on the
//! attach points the service uses at its default level, so that a round
//! with them shows what any eBPF program there costs the ranks on this
//! machine (the tracepoint's and the uprobe trap's own cost), apart from
//! what the agent's programs do.
//!
//! - `sched_switch` and `sched_waking` (`bench_count_switch`,
//!   `bench_count_waking`): the service records both for the traced
//!   processes from level 1.
//! - A bare uprobe+uretprobe pair (`bench_count_entry`/`_return`) where the
//!   agent places each probe of a device library the job maps, for the
//!   functions its default level probes (device level 0: `agent probes`
//!   names each function's level), attached for every process as the agent
//!   attaches them.
//!
//! Left out, being rare: fork, exec, exit, rename, the first wakeup of a
//! new task and the loader's link-map hook.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeScope};
use aya::programs::{BtfTracePoint, ProgramError};
use aya::{Btf, Ebpf, EbpfLoader};

use crate::{bench_probes, build};

/// The device level the service probes at its default level (1).
const DEFAULT_DEVICE_LEVEL: u8 = 0;

/// A device-library probe: the library file and the file offset where the
/// agent places the probe.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProbePoint {
    pub library: PathBuf,
    pub offset: u64,
    pub function: String,
}

/// The counting programs, attached; detached when dropped (the links
/// belong to the loaded object).
pub struct Floor {
    _bpf: Ebpf,
    pub probes: usize,
}

impl Floor {
    /// Loads and attaches the counting programs: the scheduler tracepoints,
    /// and a pair at each of `points`.
    pub fn attach(points: &[ProbePoint]) -> Result<Floor> {
        let mut bpf = EbpfLoader::new()
            .load_file(build::ebpf_object())
            .context("loading the eBPF object for the floor programs")?;
        let btf = Btf::from_sys_fs().context("reading the kernel's BTF")?;
        for (name, tracepoint) in [
            ("bench_count_switch", "sched_switch"),
            ("bench_count_waking", "sched_waking"),
        ] {
            let p: &mut BtfTracePoint = bpf
                .program_mut(name)
                .with_context(|| format!("{name} missing from the eBPF object"))?
                .try_into()
                .map_err(|e: ProgramError| anyhow::anyhow!("{name}: {e}"))?;
            p.load(tracepoint, &btf)
                .with_context(|| format!("loading {name}"))?;
            p.attach().with_context(|| format!("attaching {name}"))?;
        }
        for name in ["bench_count_entry", "bench_count_return"] {
            let p = bench_probes::program(&mut bpf, name)?;
            p.load().with_context(|| format!("loading {name}"))?;
            for point in points {
                p.attach(
                    UProbeAttachLocation::AbsoluteOffset(point.offset),
                    &point.library,
                    UProbeScope::AllProcesses,
                )
                .with_context(|| {
                    format!(
                        "attaching {name} at {}+{:#x} ({})",
                        point.library.display(),
                        point.offset,
                        point.function
                    )
                })?;
            }
        }
        Ok(Floor {
            _bpf: bpf,
            probes: points.len(),
        })
    }
}

/// Where the agent's default level probes the device libraries these
/// processes map, from `agent probes --pid` (each library file once).
pub fn default_level_points(pids: &[u64]) -> Result<Vec<ProbePoint>> {
    let mut points = BTreeSet::new();
    for pid in pids {
        let out = Command::new(build::agent_binary())
            .args(["probes", "--pid", &pid.to_string()])
            .output()
            .context("running agent probes")?;
        if !out.status.success() {
            bail!(
                "agent probes --pid {pid} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        points.extend(parse_listing(
            &String::from_utf8_lossy(&out.stdout),
            DEFAULT_DEVICE_LEVEL,
        )?);
    }
    if points.is_empty() {
        bail!("agent probes listed no probe at device level {DEFAULT_DEVICE_LEVEL} for {pids:?}");
    }
    Ok(points.into_iter().collect())
}

/// The probe points of `agent probes`' listing at `level` or below: a
/// library line (`name path (inode ...) base ...`), then indented rows
/// `function address offset first-instruction... placement... (level N)`.
fn parse_listing(text: &str, level: u8) -> Result<Vec<ProbePoint>> {
    let mut out = Vec::new();
    let mut library: Option<PathBuf> = None;
    for line in text.lines() {
        if !line.starts_with(' ') {
            library = line.split_whitespace().nth(1).map(PathBuf::from);
            continue;
        }
        let Some(row_level) = line
            .trim_end()
            .strip_suffix(')')
            .and_then(|l| l.rsplit_once("(level "))
            .and_then(|(_, n)| n.parse::<u8>().ok())
        else {
            continue; // the header, or a function not probed
        };
        if row_level > level {
            continue;
        }
        let cols: Vec<&str> = line.split_whitespace().collect();
        let lib = library
            .clone()
            .with_context(|| format!("a probe row before any library: {line:?}"))?;
        let offset = cols
            .get(2)
            .and_then(|c| u64::from_str_radix(c.trim_start_matches("0x"), 16).ok())
            .with_context(|| format!("no offset in {line:?}"))?;
        out.push(ProbePoint {
            library: lib,
            offset,
            function: cols[0].to_string(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listing_gives_the_probe_points_up_to_a_level() {
        let text = "\
cudart /lib/libcudart.so.12 (inode 5) base 0x7f0d49935000
  function                                        address     offset  first instruction        placement (capture level)
  cudaMalloc                               0x7f0d49938d80     0x3d80  push %rbp                +0 push %rbp (emulated)  (level 0)
  cudaLaunchKernel                         0x7f0d49939640     0x4640  push %rbp                +0 push %rbp (emulated)  (level 1)
  cudaStreamSynchronize                    0x7f0d49939137     0x413e  mov $0x83,%edx           +7 jmp 0x2ea0 (emulated)  (level 0)
  cudaGraphLaunch                      not exported
nccl /lib/libnccl.so.2 (inode 6) base 0x7f0d49000000
  function                                        address     offset  first instruction        placement (capture level)
  ncclAllReduce                            0x7f0d49001000     0x1000  push %rbp                +0 push %rbp (emulated)  (level 0)
";
        let points = parse_listing(text, 0).unwrap();
        let got: Vec<(&str, u64, &str)> = points
            .iter()
            .map(|p| (p.library.to_str().unwrap(), p.offset, p.function.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("/lib/libcudart.so.12", 0x3d80, "cudaMalloc"),
                ("/lib/libcudart.so.12", 0x413e, "cudaStreamSynchronize"),
                ("/lib/libnccl.so.2", 0x1000, "ncclAllReduce"),
            ]
        );
        assert_eq!(parse_listing(text, 1).unwrap().len(), 4);
    }
}
