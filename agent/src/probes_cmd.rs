//! `agent probes --pid PID`: the device libraries a process has mapped and
//! where each probed function's probe goes. Static: nothing is attached.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use xpuscope_probes::discover;
use xpuscope_probes::maps::ProcessMaps;
use xpuscope_probes::resolve;

pub fn run(pid: u32) -> Result<()> {
    let text = listing(pid)?;
    // A closed pipe (`| head`) is not an error.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn listing(pid: u32) -> Result<String> {
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
            "  {:<36} {:>18} {:>10}  {:<24} placement",
            "function", "address", "offset", "first instruction"
        );
        for p in &resolved.probes {
            let addr = lib
                .address_of(p.probe_file_offset())
                .map(|a| format!("{a:#x}"))
                .unwrap_or_else(|| "unmapped".into());
            let _ = writeln!(
                out,
                "  {:<36} {:>18} {:>#10x}  {:<24} {}",
                p.function.name,
                addr,
                p.probe_file_offset(),
                p.placement.first_insn,
                p.placement
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
