//! The probes attached in each process: absolute probe address -> catalog
//! function, and the kernel `UPROBE_SPECS` entries to write for them. A
//! probe's slot (shared by every process mapping the same file) also names
//! its function: a record from a process whose own addresses are not known
//! yet still decodes.

use foldhash::HashMap;

use xpuscope_common::uprobe::{DEREF_NONE, DEREF_STACK, ProbeKey, ProbeSpec, RETURN_LAUNCH_COUNTS};

use crate::catalog::{FunctionSpec, Library};
use crate::discover::LoadedLibrary;
use crate::resolve::ResolvedLibrary;

/// What a probe address means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeTarget {
    pub library: Library,
    pub function: &'static FunctionSpec,
    /// The placement's stack shift (stack args at `sp + 8 + sp_delta + 8 * slot`).
    pub sp_delta: i64,
}

/// One probe of a process, as the kernel side needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttachedProbe {
    pub key: ProbeKey,
    /// What the kernel copies (see [`FunctionSpec::probe_spec`]), stack
    /// offsets adjusted for the placement.
    pub spec: ProbeSpec,
    /// File offset to attach at, in the library's file.
    pub file_offset: u64,
    pub target: ProbeTarget,
}

/// Every probe of a library file, whoever maps it: (file offset to attach
/// at, what the kernel copies with stack offsets adjusted for the
/// placement, what it is). A probe attached by file before any process
/// maps it is named by its slot alone.
pub fn file_probes(resolved: &ResolvedLibrary) -> Vec<(u64, ProbeSpec, ProbeTarget)> {
    resolved
        .probes
        .iter()
        .map(|p| {
            let target = ProbeTarget {
                library: resolved.library,
                function: p.function,
                sp_delta: p.placement.sp_delta,
            };
            let mut spec = p.function.probe_spec();
            spec.flags |= super::nesting::launch_count_flags(resolved.library, p.function.kind);
            if super::nesting::stamps_launch_counts(p.function.kind) {
                spec.flags |= RETURN_LAUNCH_COUNTS;
            }
            if spec.entry_deref_arg == DEREF_STACK {
                // The aggregate moved by the instructions the probe sits past.
                match u32::try_from(i64::from(spec.entry_stack_off) + p.placement.sp_delta) {
                    Ok(off) => spec.entry_stack_off = off,
                    Err(_) => {
                        spec.entry_deref_arg = DEREF_NONE;
                        spec.entry_deref_len = 0;
                    }
                }
            }
            (p.probe_file_offset(), spec, target)
        })
        .collect()
}

/// Probe addresses of all traced processes.
#[derive(Clone, Debug, Default)]
pub struct ProbeTable {
    by_ip: HashMap<(u32, u64), ProbeTarget>,
    /// Probe slots (kernel attach cookies; 0 is none) -> function.
    by_slot: HashMap<u32, ProbeTarget>,
}

impl ProbeTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, tgid: u32, probe_ip: u64, target: ProbeTarget) {
        self.by_ip.insert((tgid, probe_ip), target);
    }

    pub fn get(&self, tgid: u32, probe_ip: u64) -> Option<&ProbeTarget> {
        self.by_ip.get(&(tgid, probe_ip))
    }

    /// Names probe slot `slot` (non-zero).
    pub fn insert_slot(&mut self, slot: u32, target: ProbeTarget) {
        if slot != 0 {
            self.by_slot.insert(slot, target);
        }
    }

    /// The function a record is about: by the process's own address, else
    /// by the probe's slot (a process whose libraries the agent has not
    /// read yet, calling a probe another traced process attached).
    pub fn lookup(&self, tgid: u32, probe_ip: u64, slot: u32) -> Option<&ProbeTarget> {
        self.get(tgid, probe_ip).or_else(|| match slot {
            0 => None,
            s => self.by_slot.get(&s),
        })
    }

    pub fn len(&self) -> usize {
        self.by_ip.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_ip.is_empty()
    }

    /// Adds every probe of `resolved` as `loaded` maps it in `tgid`, and
    /// returns them (keys and specs for the kernel map). Probes whose file
    /// offset is not mapped executable are left out.
    pub fn add_library(
        &mut self,
        tgid: u32,
        loaded: &LoadedLibrary,
        resolved: &ResolvedLibrary,
    ) -> Vec<AttachedProbe> {
        let mut out = Vec::with_capacity(resolved.probes.len());
        for (file_offset, spec, target) in file_probes(resolved) {
            let Some(probe_ip) = loaded.address_of(file_offset) else {
                continue;
            };
            self.insert(tgid, probe_ip, target);
            out.push(AttachedProbe {
                key: ProbeKey {
                    tgid,
                    _pad: 0,
                    probe_ip,
                },
                spec,
                file_offset,
                target,
            });
        }
        out
    }

    /// Removes the probes inside `loaded`'s executable ranges of `tgid` and
    /// returns their keys (to delete from the kernel map).
    pub fn remove_library(&mut self, tgid: u32, loaded: &LoadedLibrary) -> Vec<ProbeKey> {
        let mut gone = Vec::new();
        self.by_ip.retain(|&(t, ip), _| {
            let inside = t == tgid && loaded.file_offset_of(ip).is_some();
            if inside {
                gone.push(ProbeKey {
                    tgid,
                    _pad: 0,
                    probe_ip: ip,
                });
            }
            !inside
        });
        gone
    }

    /// Removes every probe of `tgid`.
    pub fn remove_process(&mut self, tgid: u32) {
        self.by_ip.retain(|&(t, _), _| t != tgid);
    }
}
