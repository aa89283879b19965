//! `agent probes --pid PID [--duration D]`: the device libraries a process
//! has mapped and where each probed function's probe goes. Static unless
//! `--duration`: then every probe is attached for that long with the
//! capture levels off, so the kernel only counts each probe's hits (nothing
//! is recorded), and the listing gains a hits column. Each probed row ends
//! with the device capture level that probes the function.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use aya::EbpfLoader;
use xpuscope_common::{Config, globals};
use xpuscope_probes::catalog::Level;
use xpuscope_probes::discover;
use xpuscope_probes::maps::ProcessMaps;
use xpuscope_probes::resolve;

use crate::kernel::EBPF_OBJECT;
use crate::kernel::config_map;
use crate::kernel::load;
use crate::kernel::probes::{AyaAttacher, DeviceProbes, LiveProcesses, MultiPrograms};
use crate::kernel::{CaptureLevels, DeviceLevel};
use crate::preflight;

pub fn run(pid: u32, count_for: Option<Duration>) -> Result<()> {
    let hits = count_for.map(|d| count_hits(pid, d)).transpose()?;
    let text = listing(pid, hits.as_ref())?;
    // A closed pipe (`| head`) is not an error.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Attaches every probe of `pid`'s device libraries for `duration` (or
/// until the process exits) with no capture level enabled, and returns each
/// probe's hits by probe address.
fn count_hits(pid: u32, duration: Duration) -> Result<HashMap<u64, u64>> {
    preflight::check_object(EBPF_OBJECT)?;
    preflight::check_privileges()?;
    preflight::check_target(pid)?;
    let agent_tgid = std::process::id();
    let mut bpf = EbpfLoader::new()
        .override_global(globals::AGENT_TGID, &agent_tgid, true)
        .load(EBPF_OBJECT)
        .context("loading the eBPF programs failed (is BPF enabled in this kernel?)")?;
    // Levels off: the programs count hits and push no records.
    config_map::write(
        &mut bpf,
        Config {
            probe_levels: 0,
            ..Config::default()
        },
    )?;
    // Only traced processes are counted (the probes sit on the files).
    load::add_target(&mut bpf, pid)?;
    // Every level's probes, recording nothing (CONFIG.probe_levels is 0).
    let levels = CaptureLevels {
        device: DeviceLevel::MAX,
        launch_counts: true,
    };
    let mut device = DeviceProbes::new(levels, false);
    let plan = device.plan(&[pid], &mut LiveProcesses);
    let mut multi = MultiPrograms::default();
    device.apply(&mut AyaAttacher::new(&mut bpf, &mut multi), plan)?;
    eprintln!(
        "xpuscope: counting calls of {} probed functions in pid {pid} for {:.1} s",
        device.stats().attached,
        duration.as_secs_f64()
    );
    let end = Instant::now() + duration;
    while Instant::now() < end && Path::new(&format!("/proc/{pid}")).exists() {
        std::thread::sleep(Duration::from_millis(100).min(end - Instant::now()));
    }
    let mut attacher = AyaAttacher::new(&mut bpf, &mut multi);
    let hits = device.hits_by_address(&attacher, pid);
    device.detach_all(&mut attacher);
    Ok(hits)
}

/// The device capture level that probes a catalog function
/// ([`DeviceLevel`]: `agent attach --probe-level`; the service probes
/// device level N at its level N + 1, and level 0 at its level 0 too).
fn device_level(level: Level) -> u8 {
    match level {
        Level::L0 => 0,
        Level::L1 => 1,
        Level::L2 => 2,
    }
}

fn listing(pid: u32, hits: Option<&HashMap<u64, u64>>) -> Result<String> {
    let mut out = String::new();
    let maps = ProcessMaps::read(pid).with_context(|| format!("reading /proc/{pid}/maps"))?;
    let libs = discover::discover(&maps);
    if libs.is_empty() {
        let _ = writeln!(out, "pid {pid}: no device library mapped");
        return Ok(out);
    }
    for lib in libs {
        let path = if lib.deleted {
            lib.map_files_path(pid).unwrap_or_else(|| lib.path.clone())
        } else {
            lib.path.clone()
        };
        let _ = writeln!(
            out,
            "{} {} (inode {}{}) base {:#x}",
            lib.library.name(),
            lib.path,
            lib.inode,
            if lib.deleted { ", deleted" } else { "" },
            lib.base
        );
        let resolved = match resolve::resolve(Path::new(&path), lib.library) {
            Ok(r) => r,
            Err(e) => {
                let _ = writeln!(out, "  cannot resolve: {e}");
                continue;
            }
        };
        let _ = writeln!(
            out,
            "  {:<36} {:>18} {:>10}  {:<24} {}placement (capture level)",
            "function",
            "address",
            "offset",
            "first instruction",
            if hits.is_some() { "      hits  " } else { "" }
        );
        for p in &resolved.probes {
            let address = lib.address_of(p.probe_file_offset());
            let addr = address
                .map(|a| format!("{a:#x}"))
                .unwrap_or_else(|| "unmapped".into());
            let hit_column = match hits {
                Some(h) => match address.and_then(|a| h.get(&a)) {
                    Some(n) => format!("{n:>10}  "),
                    None => format!("{:>10}  ", "-"),
                },
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "  {:<36} {:>18} {:>#10x}  {:<24} {}{}  (level {})",
                p.function.name,
                addr,
                p.probe_file_offset(),
                p.placement.first_insn,
                hit_column,
                p.placement,
                device_level(p.function.level)
            );
        }
        for s in &resolved.skipped {
            let _ = writeln!(out, "  {:<36} skipped: {:?}", s.function.name, s.reason);
        }
        for f in &resolved.missing {
            let _ = writeln!(out, "  {:<36} not exported", f.name);
        }
    }
    Ok(out)
}
