//! Device-library probes: finds the catalog libraries (libcudart, libnccl,
//! libcupti, libascendcl, libhccl, libmspti) mapped by each traced process,
//! attaches the generic `device_call_entry` / `device_call_return` programs
//! at every probed function's file offset, and writes what each probe
//! copies into `UPROBE_SPECS`.
//!
//! Probes are attached per library FILE (device, inode, offset) for all
//! processes, and shared by every traced process mapping that file; the
//! programs ignore processes not traced. Each probe has a slot, passed to
//! the programs as its attach cookie: its spec and hit counter sit at that
//! index of two arrays, and records carry it, so a traced process whose
//! maps the agent has not read yet still decodes. A uprobe scoped to one process
//! is a perf event bound to its main thread, which the kernel schedules out
//! and in at each of that thread's context switches: 50-200 of them added
//! microseconds to every switch of a training loop's main thread. The price
//! of file scope: a process not traced that calls a probed function of the
//! same file takes the trap (about 1 us) and records nothing.
//!
//! Costless when no device library is present: the uprobe programs are
//! loaded only when the first library is found. Each round is split in two
//! so the trace stage learns a probe's meaning before the kernel can report
//! a hit on it: [`DeviceProbes::plan`] (read maps, resolve) returns the
//! table updates to send, then [`DeviceProbes::apply`] attaches and writes
//! the specs. A probe stays attached until the recording ends, even when no
//! traced process maps its file any more: one that maps it again reuses it
//! (a second probe on the same place would record every call twice).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use aya::Ebpf;
use aya::maps::{Array, MapData, PerCpuArray};
use aya::programs::UProbe;
use aya::programs::uprobe::{UProbeAttachPoint, UProbeLink, UProbeLinkId, UProbeScope};
use xpuscope_common::uprobe::{ProbeKey, ProbeSpec, RETURN_USER_STACK};
use xpuscope_common::{MAX_PROBE_SLOTS, maps};
use xpuscope_probes::catalog::{CallKind, Level};
use xpuscope_probes::decode::table::{AttachedProbe, ProbeTable, ProbeTarget};
use xpuscope_probes::discover::{self, LoadedLibrary};
use xpuscope_probes::maps::ProcessMaps;
use xpuscope_probes::resolve::{self, ResolvedLibrary};

use crate::model::RankIdentity;

pub const ENTRY_PROGRAM: &str = "device_call_entry";
pub const RETURN_PROGRAM: &str = "device_call_return";

/// Config mask for `--probe-level N`: level N and every level below it.
pub fn level_mask(level: u8) -> u32 {
    let level = match level {
        0 => Level::L0,
        1 => Level::L1,
        _ => Level::L2,
    };
    level.mask_up_to()
}

/// Probes of one process, to tell the trace stage before they fire.
#[derive(Debug)]
pub struct TableUpdate {
    pub tgid: u32,
    /// (address in the process, probe slot, what it is).
    pub probes: Vec<(u64, u32, ProbeTarget)>,
    /// Read while the process certainly exists (the trace stage may see
    /// this after it exited).
    pub identity: RankIdentity,
    /// Its memory map, read then too: stacks of a process that exits before
    /// the trace stage symbolizes them (a rank right after its OOM) are
    /// symbolized through it.
    pub maps: ProcessMaps,
}

/// Counters for the summary.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceProbeStats {
    /// Functions attached (entry and return), over all processes.
    pub attached: u64,
    /// Single functions (or whole libraries) that could not be attached.
    pub attach_failures: u64,
    pub libraries: u64,
}

struct AttachedFn {
    key: ProbeKey,
    /// The shared uprobe pair it uses.
    site: ProbeSite,
}

/// Where a uprobe pair sits: (device, inode, file offset) of the file.
type ProbeSite = (u64, u64, u64);

/// A uprobe pair on one file offset, shared by the traced processes that
/// map the file.
struct SharedProbe {
    entry: UProbeLinkId,
    ret: UProbeLinkId,
    /// Traced processes mapping it now.
    users: u32,
    slot: u32,
    /// (library, function): what its hits are counted under.
    name: (&'static str, &'static str),
}

struct AttachedLib {
    lib: LoadedLibrary,
    fns: Vec<AttachedFn>,
}

/// A library to probe in one process, as [`DeviceProbes::plan`] found it.
struct PlannedLibrary {
    pid: u32,
    lib: LoadedLibrary,
    /// The path to open it by, and the (device, inode) found there.
    path: String,
    file: (u64, u64),
    /// Its probes, each with the slot it has (or shares).
    probes: Vec<(AttachedProbe, u32)>,
}

/// Work found by [`DeviceProbes::plan`].
#[derive(Default)]
pub struct Plan {
    add: Vec<PlannedLibrary>,
    remove: Vec<(u32, LoadedLibrary)>,
    gone: Vec<u32>,
    pub updates: Vec<TableUpdate>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.remove.is_empty() && self.gone.is_empty()
    }
}

#[derive(Default)]
pub struct DeviceProbes {
    level_mask: u32,
    /// Take the caller's stack at every device-memory allocation.
    alloc_stacks: bool,
    loaded: bool,
    /// Loading the programs failed: no further attempts.
    disabled: bool,
    /// (path, inode) -> the resolved library (None: resolution failed).
    cache: HashMap<(String, u64), Option<Arc<ResolvedLibrary>>>,
    procs: HashMap<u32, Vec<AttachedLib>>,
    /// Attached uprobe pairs, by file position.
    shared: HashMap<ProbeSite, SharedProbe>,
    /// Probe slots handed out, by file position (slot 0 means none).
    slots: HashMap<ProbeSite, u32>,
    pub stats: DeviceProbeStats,
}

/// The path to open a mapped library by: its path when that is still the
/// mapped file, else the process's `map_files` link (deleted, replaced, or
/// in another mount namespace).
fn open_path(pid: u32, lib: &LoadedLibrary) -> Option<String> {
    if !lib.deleted
        && std::fs::metadata(&lib.path)
            .map(|m| m.ino() == lib.inode)
            .unwrap_or(false)
    {
        return Some(lib.path.clone());
    }
    lib.map_files_path(pid)
}

impl DeviceProbes {
    /// Probes the functions of the levels in `level_mask` (see
    /// [`level_mask`]); with `alloc_stacks`, allocations carry the caller's
    /// stack (allocation sites, an OOM's stack).
    pub fn new(level_mask: u32, alloc_stacks: bool) -> Self {
        Self {
            level_mask,
            alloc_stacks,
            ..Self::default()
        }
    }

    /// Reads the maps of `pids`, resolves new libraries, and returns what
    /// changed. Processes not in `pids` (exited) are dropped.
    pub fn plan(&mut self, pids: &[u32]) -> Plan {
        let mut plan = Plan::default();
        for &pid in self.procs.keys() {
            if !pids.contains(&pid) {
                plan.gone.push(pid);
            }
        }
        for &pid in pids {
            let Ok(maps) = ProcessMaps::read(pid) else {
                continue; // exited, or a kernel thread
            };
            let now = discover::discover(&maps);
            let old: Vec<LoadedLibrary> = self
                .procs
                .get(&pid)
                .map(|libs| libs.iter().map(|l| l.lib.clone()).collect())
                .unwrap_or_default();
            let diff = discover::diff(&old, &now);
            for lib in diff.removed {
                plan.remove.push((pid, lib));
            }
            let mut added = diff.added;
            for (before, after) in diff.replaced {
                plan.remove.push((pid, before));
                added.push(after);
            }
            for lib in added {
                let Some(path) = open_path(pid, &lib) else {
                    continue;
                };
                let Some(resolved) = self.resolved(&path, &lib) else {
                    continue;
                };
                let file = match std::fs::metadata(&path) {
                    Ok(m) => (m.dev(), m.ino()),
                    Err(e) => {
                        tracing::warn!("device probes: pid {pid}: {path}: {e}");
                        self.stats.attach_failures += 1;
                        continue;
                    }
                };
                let mut table = ProbeTable::new();
                // Only the levels recorded: every probe costs a perf event
                // (slow to close, see `detach_all`) and a trap per call.
                let (level_mask, alloc_stacks) = (self.level_mask, self.alloc_stacks);
                let probes: Vec<(AttachedProbe, u32)> = table
                    .add_library(pid, &lib, &resolved)
                    .into_iter()
                    .filter(|p| p.spec.level_bit & level_mask != 0)
                    .map(|mut p| {
                        // Allocations are rare next to launches (caching
                        // allocators), so a stack for each costs little.
                        if alloc_stacks && p.target.function.kind == CallKind::Malloc {
                            p.spec.flags |= RETURN_USER_STACK;
                        }
                        p
                    })
                    .filter_map(|p| {
                        let slot = self.slot_for((file.0, file.1, p.file_offset));
                        if slot.is_none() {
                            tracing::warn!(
                                "device probes: {}: all {MAX_PROBE_SLOTS} probe slots in use",
                                p.target.function.name
                            );
                            self.stats.attach_failures += 1;
                        }
                        Some((p, slot?))
                    })
                    .collect();
                plan.updates.push(TableUpdate {
                    tgid: pid,
                    probes: probes
                        .iter()
                        .map(|(p, slot)| (p.key.probe_ip, *slot, p.target))
                        .collect(),
                    identity: RankIdentity::read(pid),
                    maps: maps.clone(),
                });
                plan.add.push(PlannedLibrary {
                    pid,
                    lib,
                    path,
                    file,
                    probes,
                });
            }
        }
        plan
    }

    /// The slot of the probe at `site`, handed out at its first use.
    fn slot_for(&mut self, site: ProbeSite) -> Option<u32> {
        if let Some(&s) = self.slots.get(&site) {
            return Some(s);
        }
        let next = self.slots.len() as u32 + 1;
        if next >= MAX_PROBE_SLOTS {
            return None;
        }
        self.slots.insert(site, next);
        Some(next)
    }

    fn resolved(&mut self, path: &str, lib: &LoadedLibrary) -> Option<Arc<ResolvedLibrary>> {
        let key = (lib.path.clone(), lib.inode);
        if let Some(r) = self.cache.get(&key) {
            return r.clone();
        }
        let r = match resolve::resolve(Path::new(path), lib.library) {
            Ok(r) => {
                for f in r.missing_required() {
                    tracing::warn!("{}: {} not exported", lib.path, f.name);
                }
                Some(Arc::new(r))
            }
            Err(e) => {
                tracing::warn!("device probes: resolving {}: {e}", lib.path);
                self.stats.attach_failures += 1;
                None
            }
        };
        self.cache.insert(key, r.clone());
        r
    }

    /// Attaches and detaches what `plan` found (send `plan.updates` to the
    /// trace stage first).
    pub fn apply(&mut self, bpf: &mut Ebpf, plan: Plan) -> Result<()> {
        for pid in plan.gone {
            if let Some(libs) = self.procs.remove(&pid) {
                for lib in libs {
                    self.detach(lib.fns);
                }
            }
        }
        for (pid, lib) in plan.remove {
            if let Some(libs) = self.procs.get_mut(&pid)
                && let Some(i) = libs.iter().position(|l| l.lib == lib)
            {
                let gone = libs.remove(i);
                self.detach(gone.fns);
            }
        }
        if plan.add.is_empty() {
            return Ok(());
        }
        if self.disabled {
            return Ok(());
        }
        if !self.loaded {
            if let Err(e) = load_programs(bpf) {
                // The scheduler recording goes on without device calls.
                self.disabled = true;
                self.stats.attach_failures += 1;
                return Err(e.context("device probes disabled"));
            }
            self.loaded = true;
        }
        for planned in plan.add {
            let fns = self.attach(bpf, &planned);
            let PlannedLibrary {
                pid, lib, probes, ..
            } = planned;
            tracing::info!(
                "device probes: pid {pid}: {} ({} of {} functions attached)",
                lib.path,
                fns.len(),
                probes.len()
            );
            self.stats.libraries += 1;
            self.procs
                .entry(pid)
                .or_default()
                .push(AttachedLib { lib, fns });
        }
        Ok(())
    }

    fn attach(&mut self, bpf: &mut Ebpf, planned: &PlannedLibrary) -> Vec<AttachedFn> {
        let PlannedLibrary {
            pid,
            path,
            file: (dev, ino),
            probes,
            ..
        } = planned;
        let mut out = Vec::with_capacity(probes.len());
        for &(p, slot) in probes {
            let site = (*dev, *ino, p.file_offset);
            let attached = AttachedFn { key: p.key, site };
            if let Some(shared) = self.shared.get_mut(&site) {
                shared.users += 1;
                self.stats.attached += 1;
                out.push(attached);
                continue;
            }
            // The spec first: the probe may fire as soon as it is attached.
            if let Err(e) = write_spec(bpf, slot, p.spec) {
                tracing::warn!("device probes: {}: {e:#}", p.target.function.name);
                self.stats.attach_failures += 1;
                continue;
            }
            let scope = UProbeScope::AllProcesses;
            let entry = attach_one(bpf, ENTRY_PROGRAM, p.file_offset, path, scope, slot);
            let ret = attach_one(bpf, RETURN_PROGRAM, p.file_offset, path, scope, slot);
            match (entry, ret) {
                (Ok(entry), Ok(ret)) => {
                    self.stats.attached += 1;
                    self.shared.insert(
                        site,
                        SharedProbe {
                            entry,
                            ret,
                            users: 1,
                            slot,
                            name: (p.target.library.name(), p.target.function.name),
                        },
                    );
                    out.push(attached);
                }
                (entry, ret) => {
                    let err = entry.as_ref().err().or(ret.as_ref().err());
                    tracing::warn!(
                        "device probes: attaching {} in pid {pid} at {path}+{:#x}: {}",
                        p.target.function.name,
                        p.file_offset,
                        err.map(|e| format!("{e:#}")).unwrap_or_default()
                    );
                    self.stats.attach_failures += 1;
                    if let Ok(id) = entry {
                        detach_one(bpf, ENTRY_PROGRAM, id);
                    }
                    if let Ok(id) = ret {
                        detach_one(bpf, RETURN_PROGRAM, id);
                    }
                    silence(bpf, slot);
                }
            }
        }
        out
    }

    /// A process no longer maps the files of `fns`. Their probes stay
    /// attached (see the module notes); only traced processes are recorded.
    fn detach(&mut self, fns: Vec<AttachedFn>) {
        for f in fns {
            if let Some(shared) = self.shared.get_mut(&f.site) {
                shared.users = shared.users.saturating_sub(1);
            }
        }
    }

    /// Calls of every probed function by traced processes so far (exited
    /// ones included), by (library, function), as the kernel counted them:
    /// records dropped on the way are still counted here.
    pub fn hits(&self, bpf: &Ebpf) -> HashMap<(&'static str, &'static str), u64> {
        let mut out = HashMap::new();
        for shared in self.shared.values() {
            *out.entry(shared.name).or_default() += read_hits(bpf, shared.slot);
        }
        out
    }

    /// Calls of each probe of process `pid`, by probe address.
    pub fn hits_by_address(&self, bpf: &Ebpf, pid: u32) -> HashMap<u64, u64> {
        self.procs
            .get(&pid)
            .into_iter()
            .flatten()
            .flat_map(|l| &l.fns)
            .filter_map(|f| {
                let slot = self.shared.get(&f.site)?.slot;
                Some((f.key.probe_ip, read_hits(bpf, slot)))
            })
            .collect()
    }

    /// Silences every probe, then hands the links to a child process that
    /// closes them after the agent exits.
    ///
    /// Closing a uprobe perf event waits for an RCU tasks-trace grace
    /// period under a kernel-wide mutex (about 90 ms each on 6.18): 92
    /// probes of one rank would hold the agent for 8 s. With the specs
    /// zeroed the probes push nothing, so nothing is lost by closing later.
    pub fn detach_all(&mut self, bpf: &mut Ebpf) {
        self.procs.clear();
        let shared: Vec<SharedProbe> = self.shared.drain().map(|(_, s)| s).collect();
        for s in &shared {
            silence(bpf, s.slot);
        }
        let links = take_links(bpf, shared);
        if links.is_empty() {
            return;
        }
        close_after_exit(links);
    }
}

/// Keeps a reference to every link's file in a child process that waits
/// for this process to exit (its end of a pipe closes), then exits itself:
/// the last reference, and the slow release, is the child's.
fn close_after_exit(links: Vec<UProbeLink>) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return; // the links are closed (slowly) when dropped
    }
    // SAFETY: the child only calls async-signal-safe functions (close,
    // read, _exit) before exiting.
    match unsafe { libc::fork() } {
        0 => unsafe {
            libc::prctl(libc::PR_SET_NAME, c"xpuscope-close".as_ptr());
            libc::close(fds[1]);
            let mut b = 0u8;
            while libc::read(fds[0], (&raw mut b).cast(), 1) != 0 {
                if *libc::__errno_location() != libc::EINTR {
                    break;
                }
            }
            libc::_exit(0);
        },
        -1 => {
            // SAFETY: our own descriptors.
            unsafe {
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
        }
        child => {
            tracing::debug!("device probes: pid {child} closes the uprobe links");
            // SAFETY: our own descriptor; the write end stays open until exit.
            unsafe { libc::close(fds[0]) };
            // The child holds references: these closes are cheap.
            drop(links);
        }
    }
}

/// Takes ownership of the links of `probes` (to close them later).
fn take_links(bpf: &mut Ebpf, probes: Vec<SharedProbe>) -> Vec<UProbeLink> {
    let mut links = Vec::with_capacity(probes.len() * 2);
    let mut rets = Vec::with_capacity(probes.len());
    for f in probes {
        if let Ok(p) = uprobe(bpf, ENTRY_PROGRAM) {
            match p.take_link(f.entry) {
                Ok(l) => links.push(l),
                Err(e) => tracing::debug!("detaching {ENTRY_PROGRAM}: {e}"),
            }
        }
        rets.push(f.ret);
    }
    if let Ok(p) = uprobe(bpf, RETURN_PROGRAM) {
        for id in rets {
            match p.take_link(id) {
                Ok(l) => links.push(l),
                Err(e) => tracing::debug!("detaching {RETURN_PROGRAM}: {e}"),
            }
        }
    }
    links
}

fn uprobe<'a>(bpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    Ok(bpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()?)
}

fn load_programs(bpf: &mut Ebpf) -> Result<()> {
    for name in [ENTRY_PROGRAM, RETURN_PROGRAM] {
        uprobe(bpf, name)?
            .load()
            .with_context(|| format!("verifying/loading {name}"))?;
    }
    Ok(())
}

fn attach_one(
    bpf: &mut Ebpf,
    program: &str,
    offset: u64,
    path: &str,
    scope: UProbeScope,
    slot: u32,
) -> Result<UProbeLinkId> {
    let point = UProbeAttachPoint {
        location: offset.into(),
        cookie: Some(u64::from(slot)),
    };
    Ok(uprobe(bpf, program)?.attach(point, path, scope)?)
}

fn detach_one(bpf: &mut Ebpf, program: &str, id: UProbeLinkId) {
    if let Ok(p) = uprobe(bpf, program)
        && let Err(e) = p.detach(id)
    {
        tracing::debug!("detaching {program}: {e}");
    }
}

fn specs(bpf: &mut Ebpf) -> Result<Array<&mut MapData, ProbeSpec>> {
    Ok(Array::try_from(
        bpf.map_mut(maps::UPROBE_SPECS)
            .context("UPROBE_SPECS map missing")?,
    )?)
}

/// Calls counted at probe slot `slot`, summed over CPUs.
fn read_hits(bpf: &Ebpf, slot: u32) -> u64 {
    let Some(map) = bpf.map(maps::UPROBE_HITS) else {
        return 0;
    };
    let Ok(hits) = PerCpuArray::<&MapData, u64>::try_from(map) else {
        return 0;
    };
    hits.get(&slot, 0)
        .map(|per_cpu| per_cpu.iter().sum())
        .unwrap_or(0)
}

fn write_spec(bpf: &mut Ebpf, slot: u32, spec: ProbeSpec) -> Result<()> {
    specs(bpf)?
        .set(slot, spec, 0)
        .with_context(|| format!("writing UPROBE_SPECS[{slot}]"))
}

/// Makes the probe at `slot` record nothing (an all-zero spec).
fn silence(bpf: &mut Ebpf, slot: u32) {
    let off = ProbeSpec {
        level_bit: 0,
        ..ProbeSpec::default()
    };
    if let Err(e) = write_spec(bpf, slot, off) {
        tracing::debug!("silencing probe slot {slot}: {e:#}");
    }
}
