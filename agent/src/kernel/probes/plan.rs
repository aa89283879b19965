//! Probe planning, pure: which device libraries each traced process maps,
//! which of their functions the current capture level records, the slot of
//! each probe, and what the trace stage must learn before the probes fire
//! ([`TableUpdate`]). What the planner reads about processes and files comes
//! through [`ProcessSource`] ([`LiveProcesses`] reads `/proc` and the ELF
//! files), so it is tested with made-up maps and resolved libraries.
//!
//! A probe sits on a library FILE: (device, inode, file offset), a
//! [`ProbeSite`]. Every traced process mapping that file shares the site,
//! its slot (the attach cookie naming the probe's spec and hit counter in
//! the kernel arrays) and its uprobe pair.
//!
//! A file no traced process maps (or is predicted to map) for
//! [`RELEASE_AFTER`] has its probes released ([`Plan::release`]): its
//! uprobes detached, its slots handed out again once they are. Without it,
//! distinct copies of a library (per-job virtual environments, container
//! layers) would use up the slots for good, and each attachment would keep
//! a deleted file's inode alive.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xpuscope_common::MAX_PROBE_SLOTS;
use xpuscope_common::uprobe::{
    COUNT_LAUNCH_LOWER, COUNT_LAUNCH_UPPER, ProbeSpec, RETURN_USER_STACK,
};
use xpuscope_probes::catalog::{CallKind, Library};
use xpuscope_probes::decode::table::{AttachedProbe, ProbeTable, ProbeTarget, file_probes};
use xpuscope_probes::discover::{self, LoadedLibrary};
use xpuscope_probes::loader;
use xpuscope_probes::maps::ProcessMaps;
use xpuscope_probes::resolve::{self, ResolvedLibrary};

use crate::kernel::levels::{CaptureLevels, DeviceLevel};
use crate::model::RankIdentity;

/// (device, inode) of a file.
pub type FileId = (u64, u64);

/// Where a uprobe pair sits: a file offset of one library file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProbeSite {
    pub dev: u64,
    pub ino: u64,
    pub offset: u64,
}

/// What the planner reads about processes and library files.
pub trait ProcessSource {
    /// `pid`'s memory map; `None` if it exited (or is a kernel thread).
    fn maps(&mut self, pid: u32) -> Option<ProcessMaps>;
    /// Rank identity from `pid`'s environment (default if unreadable).
    fn identity(&mut self, pid: u32) -> RankIdentity;
    /// The path to open `lib` by as `pid` maps it; `None` if it cannot be.
    fn open_path(&mut self, pid: u32, lib: &LoadedLibrary) -> Option<String>;
    /// The (device, inode) of the file at `path`.
    fn file_id(&mut self, path: &str) -> std::io::Result<FileId>;
    /// The catalog of `library` resolved against the file at `path`.
    fn resolve(&mut self, path: &str, library: Library) -> Result<ResolvedLibrary, String>;
    /// What `pid`'s program will load, predicted from its files
    /// ([`xpuscope_probes::loader`]); `None` if it cannot be read (exited,
    /// statically linked, not an x86-64 ELF).
    fn predict(&mut self, pid: u32) -> Option<Predicted>;
}

/// What a process's program will load, as paths the agent can open.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Predicted {
    /// The catalog libraries among its `DT_NEEDED` chain.
    pub libraries: Vec<(Library, String)>,
    /// Its dynamic loader (`PT_INTERP`), whose debugger hook reports its
    /// `dlopen`s.
    pub interpreter: Option<String>,
}

/// The real [`ProcessSource`]: `/proc` and the library files.
pub struct LiveProcesses;

impl ProcessSource for LiveProcesses {
    fn maps(&mut self, pid: u32) -> Option<ProcessMaps> {
        ProcessMaps::read(pid).ok()
    }

    fn identity(&mut self, pid: u32) -> RankIdentity {
        RankIdentity::read(pid)
    }

    /// The library's path when that is still the mapped file, else the
    /// process's `map_files` link (deleted, replaced, or in another mount
    /// namespace).
    fn open_path(&mut self, pid: u32, lib: &LoadedLibrary) -> Option<String> {
        if !lib.deleted
            && std::fs::metadata(&lib.path)
                .map(|m| m.ino() == lib.inode)
                .unwrap_or(false)
        {
            return Some(lib.path.clone());
        }
        lib.map_files_path(pid)
    }

    fn file_id(&mut self, path: &str) -> std::io::Result<FileId> {
        std::fs::metadata(path).map(|m| (m.dev(), m.ino()))
    }

    fn resolve(&mut self, path: &str, library: Library) -> Result<ResolvedLibrary, String> {
        resolve::resolve(Path::new(path), library).map_err(|e| e.to_string())
    }

    /// Replays the loader's search over `/proc/PID/exe`'s dependencies,
    /// with `LD_LIBRARY_PATH` from its environment and the loader cache of
    /// its root (a process in another mount namespace is read through
    /// `/proc/PID/root`).
    fn predict(&mut self, pid: u32) -> Option<Predicted> {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
        let exe = exe.to_str()?;
        if exe.ends_with(" (deleted)") {
            return None; // a replaced program: its libraries are found in its maps
        }
        let same_root = |a: &str, b: &str| {
            let (Ok(a), Ok(b)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
                return false;
            };
            (a.dev(), a.ino()) == (b.dev(), b.ino())
        };
        let (root, exe) = if same_root(&format!("/proc/{pid}/root"), "/") {
            (std::path::PathBuf::from("/"), exe.to_string())
        } else {
            (
                std::path::PathBuf::from(format!("/proc/{pid}/root")),
                path_inside_root(pid, exe),
            )
        };
        // Bounded: the environment is the traced process's to fill.
        let environ = read_bounded(&format!("/proc/{pid}/environ"), loader::MAX_ENVIRON);
        let search = loader::Search {
            cache: loader::read_cache(&root),
            ld_library_path: environ.as_deref().and_then(loader::ld_library_path),
            root,
        };
        let prediction = match search.predict(&exe) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!("device probes: pid {pid}: predicting its libraries: {e}");
                return None;
            }
        };
        let host = |p: &str| search.host_path(p).to_string_lossy().into_owned();
        Some(Predicted {
            libraries: prediction
                .catalog()
                .map(|(library, path)| (library, host(path)))
                .collect(),
            interpreter: prediction.interpreter.as_deref().map(host),
        })
    }
}

/// `path`, as the agent sees a file of process `pid`, as the process sees
/// it: a chrooted process's files are named by their paths from the
/// agent's root (`/srv/root/usr/bin/python3` for its `/usr/bin/python3`);
/// its root's own path is stripped. A process in another mount namespace
/// is named by its own paths already.
fn path_inside_root(pid: u32, path: &str) -> String {
    let Ok(root) = std::fs::read_link(format!("/proc/{pid}/root")) else {
        return path.to_string();
    };
    match root.to_str() {
        Some(r) if r != "/" => match path.strip_prefix(r) {
            Some(rest) if rest.starts_with('/') => rest.to_string(),
            _ => path.to_string(),
        },
        _ => path.to_string(),
    }
}

/// At most `limit` bytes of the file at `path`.
fn read_bounded(path: &str, limit: usize) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(limit as u64)
        .read_to_end(&mut out)
        .ok()?;
    Some(out)
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

/// A probe to make live: attached at `path` + `site.offset` if it never
/// was, else its silenced spec written back.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteWork {
    pub site: ProbeSite,
    pub path: String,
    pub slot: u32,
    pub spec: ProbeSpec,
    /// (library, function): what its hits are counted under.
    pub name: (&'static str, &'static str),
    /// Only its entry end is needed: a launch below the capture level,
    /// counted in the kernel, not recorded (a return probe would double
    /// the cost of every launch).
    pub entry_only: bool,
    /// A communicator set-up call (unique id, init): attached before the
    /// others of its plan (each attach takes about a millisecond, and a
    /// starting rank sets up its communicators within milliseconds).
    pub urgent: bool,
}

/// Work found by [`Planner::plan`] or [`Planner::set_device_level`]: send
/// `updates` to the trace stage first, then apply the rest.
#[derive(Debug, Default)]
pub struct Plan {
    pub updates: Vec<TableUpdate>,
    /// The new `CONFIG.probe_levels` (a level change), written first.
    pub probe_levels: Option<u32>,
    /// Probes to make live, one per site.
    pub live: Vec<SiteWork>,
    /// Sites to silence (a lowered level): (site, slot).
    pub silence: Vec<(ProbeSite, u32)>,
    /// Each process's use of a site at the current level (counted as an
    /// attached function once the site is live).
    pub uses: Vec<(u32, ProbeSite)>,
    /// Libraries newly found: (pid, path, functions planned at the level,
    /// the sites of those functions).
    pub libraries: Vec<(u32, String, usize, Vec<ProbeSite>)>,
    /// Processes no longer traced, forgotten.
    pub gone: Vec<u32>,
    /// Slots of probes attached by file ahead of any process mapping it,
    /// and what each is: the trace stage learns them before they fire.
    pub slots: Vec<(u32, ProbeTarget)>,
    /// Library files probed ahead: (path, functions planned at the level).
    pub files: Vec<(String, usize)>,
    /// Dynamic loaders whose debugger hook to probe (a predicted
    /// program's interpreter).
    pub loaders: Vec<String>,
    /// Library files no traced process has used for [`RELEASE_AFTER`]:
    /// their probes to detach, their slots to free once detached.
    pub release: Vec<FileRelease>,
}

/// The probes of one library file to release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRelease {
    pub file: FileId,
    /// Every site of the file with a slot (live or silenced).
    pub sites: Vec<(ProbeSite, u32)>,
}

/// How long a library file's probes stay attached after the last traced
/// process using it is gone: longer than records take through the
/// pipeline, and long enough that a job restarted at once finds them in
/// place (attaching a file's probes again costs a few milliseconds).
pub const RELEASE_AFTER: Duration = Duration::from_secs(10);

/// How often the periodic rounds ([`Planner::plan`]) read again the maps
/// of a process whose loader reported a link-map change. Its debugger
/// hook works, so each `dlopen` and `dlclose` of it is announced and
/// rescanned at once ([`Planner::plan_early`]); the rounds are only the
/// safety net for code mapped without the loader and for a notice lost to
/// a full queue (`NOTICE_QUEUE`). A real training rank's
/// `/proc/PID/maps` runs to thousands of lines: read for every rank at
/// every round (four a second), it cost the always-on service more than
/// anything it learned. A process counts as reporting once its loader
/// reported, or once a round read its maps while it was traced and they
/// map a loader whose hook is attached ([`Planner::loaders_hooked`]):
/// every later change of its link map is announced. That is the usual
/// case of a process found by the service's discovery or given to
/// `agent attach`, whose start-up reports came before it was traced. A
/// process whose loader has no hook (another loader file, not predicted)
/// is read every round.
pub const HOOKED_RESCAN: Duration = Duration::from_secs(5);

impl ProbeSite {
    pub fn file(&self) -> FileId {
        (self.dev, self.ino)
    }
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
            && self.probe_levels.is_none()
            && self.live.is_empty()
            && self.silence.is_empty()
            && self.uses.is_empty()
            && self.libraries.is_empty()
            && self.gone.is_empty()
            && self.slots.is_empty()
            && self.files.is_empty()
            && self.loaders.is_empty()
            && self.release.is_empty()
    }

    fn add_live(&mut self, work: SiteWork) {
        if !self.live.iter().any(|w| w.site == work.site) {
            self.live.push(work);
        }
    }
}

/// Failures found while planning (they count as attach failures).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Libraries that could not be resolved or opened.
    pub library_failures: u64,
    /// Functions left without a probe: every slot was in use.
    pub slots_exhausted: u64,
    /// Slots held by probes now (live, silenced, or being released).
    pub slots_in_use: u64,
    /// Library files whose probes were released (no traced process used
    /// them for [`RELEASE_AFTER`]).
    pub files_released: u64,
}

/// One probe of a traced library, at every level.
#[derive(Clone, Copy, Debug)]
struct SiteProbe {
    probe: AttachedProbe,
    site: ProbeSite,
}

struct TracedLibrary {
    lib: LoadedLibrary,
    path: String,
    /// The file its probes sit on.
    file: FileId,
    probes: Vec<SiteProbe>,
}

/// A site's slot and the level bit of its function.
#[derive(Clone, Copy, Debug)]
struct SiteSlot {
    slot: u32,
    level_bit: u32,
    /// A launch the kernel counts at every level: never silenced.
    counts: bool,
}

/// Whether the probe counts launches in the kernel (at every level).
fn counts_launches(spec: &ProbeSpec) -> bool {
    spec.flags & (COUNT_LAUNCH_UPPER | COUNT_LAUNCH_LOWER) != 0
}

/// Whether the probe is live at `levels`: its function is recorded there,
/// or it counts launches and launches are counted.
fn planned(spec: &ProbeSpec, levels: CaptureLevels) -> bool {
    spec.level_bit & levels.device.mask() != 0 || (levels.launch_counts && counts_launches(spec))
}

pub struct Planner {
    levels: CaptureLevels,
    /// Take the caller's stack at every device-memory allocation.
    alloc_stacks: bool,
    /// Slots 1..slot_limit are handed out (0 means none).
    slot_limit: u32,
    /// The next slot never handed out.
    next_slot: u32,
    /// Slots of released probes whose links are closed: handed out first.
    free_slots: Vec<u32>,
    /// Slots of released probes whose links are still being closed.
    closing_slots: u64,
    /// How long an unused file keeps its probes.
    release_after: Duration,
    /// Library files with probes that no traced process uses, since when.
    idle_since: HashMap<FileId, Instant>,
    /// Files probed ahead for each process predicted to map them.
    ahead: HashMap<u32, Vec<FileId>>,
    /// (path, inode) -> the resolved library (None: resolution failed).
    cache: HashMap<(String, u64), Option<Arc<ResolvedLibrary>>>,
    procs: HashMap<u32, Vec<TracedLibrary>>,
    slots: HashMap<ProbeSite, SiteSlot>,
    /// Library files probed ahead of their first mapping, with the level
    /// mask they were planned at.
    files: HashMap<FileId, u32>,
    /// Processes whose program's libraries were predicted (until it execs
    /// again or is forgotten).
    predicted: HashSet<u32>,
    /// Processes whose link-map changes are reported (see
    /// [`HOOKED_RESCAN`]) since their program started, and when each
    /// traced process's maps were last read.
    hooked: HashSet<u32>,
    /// Loader files whose debugger hook is attached, as maps name them
    /// (`Mapping::dev`, inode).
    hooked_loaders: HashSet<(u64, u64)>,
    scanned_at: HashMap<u32, Instant>,
    hooked_rescan: Duration,
    pub stats: PlanStats,
}

impl Planner {
    /// Plans the device functions of `levels`; with `alloc_stacks`,
    /// allocations carry the caller's stack (allocation sites, an OOM's).
    pub fn new(levels: CaptureLevels, alloc_stacks: bool) -> Self {
        Self {
            levels,
            alloc_stacks,
            slot_limit: MAX_PROBE_SLOTS,
            next_slot: 1,
            free_slots: Vec::new(),
            closing_slots: 0,
            release_after: RELEASE_AFTER,
            idle_since: HashMap::new(),
            ahead: HashMap::new(),
            cache: HashMap::new(),
            procs: HashMap::new(),
            slots: HashMap::new(),
            files: HashMap::new(),
            predicted: HashSet::new(),
            hooked: HashSet::new(),
            hooked_loaders: HashSet::new(),
            scanned_at: HashMap::new(),
            hooked_rescan: HOOKED_RESCAN,
            stats: PlanStats::default(),
        }
    }

    /// The loader files (`stat`'s device and inode) whose debugger hook
    /// is attached now: a traced process whose maps hold one reports its
    /// link-map changes from the next read of its maps on.
    pub fn loaders_hooked(&mut self, files: &[(u64, u64)]) {
        self.hooked_loaders = files
            .iter()
            .map(|&(dev, ino)| (maps_dev(dev), ino))
            .collect();
    }

    /// Rounds read the maps of a process whose loader reports only this
    /// often (see [`HOOKED_RESCAN`]).
    #[cfg(test)]
    pub fn with_hooked_rescan(mut self, every: Duration) -> Self {
        self.hooked_rescan = every;
        self
    }

    /// At most `limit - 1` slots (1 to [`MAX_PROBE_SLOTS`]).
    pub fn with_slot_limit(mut self, limit: u32) -> Self {
        self.slot_limit = limit.clamp(1, MAX_PROBE_SLOTS);
        self
    }

    /// Files unused this long have their probes released.
    pub fn with_release_after(mut self, after: Duration) -> Self {
        self.release_after = after;
        self
    }

    /// Slots whose released probes are now detached: free to hand out.
    pub fn slots_closed(&mut self, slots: Vec<u32>) {
        self.closing_slots = self.closing_slots.saturating_sub(slots.len() as u64);
        self.free_slots.extend(slots);
    }

    /// The planning counters now.
    pub fn stats(&self) -> PlanStats {
        PlanStats {
            slots_in_use: self.slots.len() as u64 + self.closing_slots,
            ..self.stats
        }
    }

    pub fn levels(&self) -> CaptureLevels {
        self.levels
    }

    /// Reads the maps of `pids` (the traced processes now), resolves new
    /// libraries, and returns what changed. Processes not in `pids`
    /// (exited) are forgotten.
    pub fn plan(&mut self, pids: &[u32], source: &mut impl ProcessSource) -> Plan {
        let mut plan = Plan::default();
        let wanted: HashSet<u32> = pids.iter().copied().collect();
        let mut gone: Vec<u32> = self
            .procs
            .keys()
            .copied()
            .filter(|p| !wanted.contains(p))
            .collect();
        gone.sort_unstable();
        for pid in &gone {
            self.procs.remove(pid);
            self.predicted.remove(pid);
            self.hooked.remove(pid);
            self.scanned_at.remove(pid);
        }
        // Predicted, never mapped, and gone: its files are not held.
        self.ahead.retain(|pid, _| wanted.contains(pid));
        plan.gone = gone;
        let now = Instant::now();
        for &pid in pids {
            let fresh = self
                .scanned_at
                .get(&pid)
                .is_some_and(|at| now.duration_since(*at) < self.hooked_rescan);
            if fresh && self.hooked.contains(&pid) {
                continue;
            }
            self.scan(pid, source, &mut plan);
        }
        self.release_unused(Instant::now(), &mut plan);
        plan
    }

    /// Files with probes that no traced process maps or is predicted to
    /// map: idle from now, released once idle for `release_after`.
    fn release_unused(&mut self, now: Instant, plan: &mut Plan) {
        let used: HashSet<FileId> = self
            .procs
            .values()
            .flatten()
            .map(|l| l.file)
            .chain(self.ahead.values().flatten().copied())
            .collect();
        let mut probed: HashMap<FileId, Vec<(ProbeSite, u32)>> = HashMap::new();
        for (site, s) in &self.slots {
            probed.entry(site.file()).or_default().push((*site, s.slot));
        }
        self.idle_since
            .retain(|f, _| probed.contains_key(f) && !used.contains(f));
        let mut release: Vec<FileRelease> = Vec::new();
        for (file, mut sites) in probed {
            if used.contains(&file) {
                continue;
            }
            let since = *self.idle_since.entry(file).or_insert(now);
            if now.duration_since(since) < self.release_after {
                continue;
            }
            sites.sort_unstable();
            release.push(FileRelease { file, sites });
        }
        release.sort_unstable_by_key(|r| r.file);
        for r in &release {
            self.idle_since.remove(&r.file);
            for (site, _) in &r.sites {
                self.slots.remove(site);
            }
            self.closing_slots += r.sites.len() as u64;
            self.files.remove(&r.file);
            // Its resolution too: a later file at this inode is another.
            self.cache.retain(|(_, ino), _| *ino != r.file.1);
            self.stats.files_released += 1;
        }
        plan.release = release;
    }

    /// A traced process started a program (`exec`) or its loader reported
    /// for the first time: the catalog libraries its program will load are
    /// probed by file now, before it maps them (probes on a file apply to
    /// every process mapping it later), and its loader's debugger hook is
    /// to be probed; then its maps are rescanned. `exec`: it started a new
    /// program, predicted again even if its old one was.
    pub fn plan_early(&mut self, pid: u32, exec: bool, source: &mut impl ProcessSource) -> Plan {
        let mut plan = Plan::default();
        if exec {
            self.predicted.remove(&pid);
            self.ahead.remove(&pid);
            // A new program, maybe with another loader: not known to
            // report until it does.
            self.hooked.remove(&pid);
        } else {
            // A link-map change came from its loader's hook.
            self.hooked.insert(pid);
        }
        if self.predicted.insert(pid)
            && let Some(predicted) = source.predict(pid)
        {
            let files = self.plan_files(&predicted.libraries, source, &mut plan);
            self.ahead.insert(pid, files);
            plan.loaders.extend(predicted.interpreter);
        }
        self.scan(pid, source, &mut plan);
        plan
    }

    /// Probes of library files no traced process maps yet; returns the
    /// files (probed now or before), held while the process lives.
    fn plan_files(
        &mut self,
        files: &[(Library, String)],
        source: &mut impl ProcessSource,
        plan: &mut Plan,
    ) -> Vec<FileId> {
        let (levels, mask) = (self.levels, self.levels.device.mask());
        let mut held = Vec::new();
        for (library, path) in files {
            let id = match source.file_id(path) {
                Ok(id) => id,
                Err(e) => {
                    tracing::debug!("device probes: {path}: {e}");
                    continue;
                }
            };
            held.push(id);
            if self.files.get(&id) == Some(&mask) {
                continue;
            }
            let Some(resolved) = self.resolved_file(path, id.1, *library, source) else {
                continue;
            };
            self.files.insert(id, mask);
            let alloc_stacks = self.alloc_stacks;
            let mut n = 0;
            for (offset, mut spec, target) in file_probes(&resolved) {
                if !planned(&spec, levels) {
                    continue;
                }
                if alloc_stacks && target.function.kind == CallKind::Malloc {
                    spec.flags |= RETURN_USER_STACK;
                }
                let sp = SiteProbe {
                    probe: AttachedProbe {
                        // No process address yet: named by its slot.
                        key: xpuscope_common::uprobe::ProbeKey {
                            tgid: 0,
                            _pad: 0,
                            probe_ip: 0,
                        },
                        spec,
                        file_offset: offset,
                        target,
                    },
                    site: ProbeSite {
                        dev: id.0,
                        ino: id.1,
                        offset,
                    },
                };
                if let Some(slot) = self.slot_for(&sp) {
                    plan.slots.push((slot, target));
                    plan.add_live(site_work(&sp, path, slot, mask));
                    n += 1;
                }
            }
            plan.files.push((path.clone(), n));
        }
        held
    }

    /// Reads `pid`'s maps and plans the probes of libraries it newly maps.
    fn scan(&mut self, pid: u32, source: &mut impl ProcessSource, plan: &mut Plan) {
        let (levels, mask) = (self.levels, self.levels.device.mask());
        let Some(maps) = source.maps(pid) else {
            return; // exited, or a kernel thread
        };
        self.scanned_at.insert(pid, Instant::now());
        // Traced now and mapping a hooked loader: a change of its link
        // map after this read is announced (one before it is in `maps`).
        if maps
            .mappings()
            .iter()
            .any(|m| self.hooked_loaders.contains(&(m.dev, m.inode)))
        {
            self.hooked.insert(pid);
        }
        let now = discover::discover(&maps);
        let libs = self.procs.entry(pid).or_default();
        let old: Vec<LoadedLibrary> = libs.iter().map(|l| l.lib.clone()).collect();
        let diff = discover::diff(&old, &now);
        // A library gone or replaced: its probes stay attached (another
        // process, or this one again, may map the file; a second probe
        // on one place would record every call twice).
        let mut added = diff.added;
        let dropped = diff
            .removed
            .iter()
            .chain(diff.replaced.iter().map(|(b, _)| b));
        for lib in dropped {
            libs.retain(|l| &l.lib != lib);
        }
        added.extend(diff.replaced.into_iter().map(|(_, after)| after));
        if self.procs.get(&pid).is_some_and(|l| l.is_empty()) && added.is_empty() {
            self.procs.remove(&pid);
        }
        for lib in added {
            let Some(traced) = self.trace_library(pid, lib, source) else {
                continue;
            };
            let mut probes = Vec::new();
            let mut sites = Vec::new();
            for sp in traced
                .probes
                .iter()
                .filter(|p| planned(&p.probe.spec, levels))
            {
                if let Some(slot) = self.slot_for(sp) {
                    probes.push((sp.probe.key.probe_ip, slot, sp.probe.target));
                    plan.uses.push((pid, sp.site));
                    sites.push(sp.site);
                    plan.add_live(site_work(sp, &traced.path, slot, mask));
                }
            }
            plan.libraries
                .push((pid, traced.lib.path.clone(), probes.len(), sites));
            plan.updates.push(TableUpdate {
                tgid: pid,
                probes,
                identity: source.identity(pid),
                maps: maps.clone(),
            });
            self.procs.entry(pid).or_default().push(traced);
        }
    }

    /// Switches the device capture level: the probes the new level adds
    /// (in every traced process with their libraries) are to be made live,
    /// with their table updates; those it drops are to be silenced. The
    /// links stay: raising the level again re-enables them.
    pub fn set_device_level(
        &mut self,
        level: DeviceLevel,
        source: &mut impl ProcessSource,
    ) -> Plan {
        let mut plan = Plan::default();
        let (old, new) = (self.levels.device.mask(), level.mask());
        if old == new {
            return plan;
        }
        self.levels.device = level;
        plan.probe_levels = Some(new);
        let (raised, lowered) = (new & !old, old & !new);
        let mut pids: Vec<u32> = self.procs.keys().copied().collect();
        pids.sort_unstable();
        for pid in pids {
            let newly: Vec<(SiteProbe, String)> = self.procs[&pid]
                .iter()
                .flat_map(|l| l.probes.iter().map(move |p| (*p, l.path.clone())))
                .filter(|(p, _)| p.probe.spec.level_bit & raised != 0)
                .collect();
            if newly.is_empty() {
                continue;
            }
            let Some(maps) = source.maps(pid) else {
                continue; // exiting: the next plan forgets it
            };
            let mut probes = Vec::new();
            for (sp, path) in &newly {
                if let Some(slot) = self.slot_for(sp) {
                    probes.push((sp.probe.key.probe_ip, slot, sp.probe.target));
                    plan.uses.push((pid, sp.site));
                    plan.add_live(site_work(sp, path, slot, new));
                }
            }
            plan.updates.push(TableUpdate {
                tgid: pid,
                probes,
                identity: source.identity(pid),
                maps,
            });
        }
        let mut silence: Vec<(ProbeSite, u32)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.level_bit & lowered != 0 && !s.counts)
            .map(|(site, s)| (*site, s.slot))
            .collect();
        silence.sort_unstable();
        plan.silence = silence;
        plan
    }

    /// Probe addresses of `pid` at the current level, with their sites.
    pub fn probes_of(&self, pid: u32) -> impl Iterator<Item = (u64, ProbeSite)> + '_ {
        let levels = self.levels;
        self.procs
            .get(&pid)
            .into_iter()
            .flatten()
            .flat_map(|l| &l.probes)
            .filter(move |p| planned(&p.probe.spec, levels))
            .map(|p| (p.probe.key.probe_ip, p.site))
    }

    /// Resolves `lib` as `pid` maps it, with every probe at every level.
    fn trace_library(
        &mut self,
        pid: u32,
        lib: LoadedLibrary,
        source: &mut impl ProcessSource,
    ) -> Option<TracedLibrary> {
        let path = source.open_path(pid, &lib)?;
        let resolved = self.resolved(&path, &lib, source)?;
        let (dev, ino) = match source.file_id(&path) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!("device probes: pid {pid}: {path}: {e}");
                self.stats.library_failures += 1;
                return None;
            }
        };
        let alloc_stacks = self.alloc_stacks;
        let probes = ProbeTable::new()
            .add_library(pid, &lib, &resolved)
            .into_iter()
            .map(|mut probe| {
                // Allocations are rare next to launches (caching
                // allocators), so a stack for each costs little.
                if alloc_stacks && probe.target.function.kind == CallKind::Malloc {
                    probe.spec.flags |= RETURN_USER_STACK;
                }
                let site = ProbeSite {
                    dev,
                    ino,
                    offset: probe.file_offset,
                };
                SiteProbe { probe, site }
            })
            .collect();
        Some(TracedLibrary {
            lib,
            path,
            file: (dev, ino),
            probes,
        })
    }

    /// The slot of the probe's site, handed out at its first use.
    fn slot_for(&mut self, p: &SiteProbe) -> Option<u32> {
        if let Some(s) = self.slots.get(&p.site) {
            return Some(s.slot);
        }
        let next = match self.free_slots.pop() {
            Some(slot) => slot,
            None if self.next_slot < self.slot_limit => {
                self.next_slot += 1;
                self.next_slot - 1
            }
            None => {
                tracing::warn!(
                    "device probes: {}: all {} probe slots in use",
                    p.probe.target.function.name,
                    self.slot_limit - 1
                );
                self.stats.slots_exhausted += 1;
                return None;
            }
        };
        self.slots.insert(
            p.site,
            SiteSlot {
                slot: next,
                level_bit: p.probe.spec.level_bit,
                counts: self.levels.launch_counts && counts_launches(&p.probe.spec),
            },
        );
        Some(next)
    }

    fn resolved(
        &mut self,
        path: &str,
        lib: &LoadedLibrary,
        source: &mut impl ProcessSource,
    ) -> Option<Arc<ResolvedLibrary>> {
        let key = (lib.path.clone(), lib.inode);
        if let Some(r) = self.cache.get(&key) {
            return r.clone();
        }
        let r = match source.resolve(path, lib.library) {
            Ok(r) => {
                for f in r.missing_required() {
                    tracing::warn!("{}: {} not exported", lib.path, f.name);
                }
                Some(Arc::new(r))
            }
            Err(e) => {
                tracing::warn!("device probes: resolving {}: {e}", lib.path);
                self.stats.library_failures += 1;
                None
            }
        };
        self.cache.insert(key, r.clone());
        r
    }
}

impl Planner {
    /// The catalog of `library` resolved against the file at `path`
    /// (inode `ino`), cached like a mapped library's.
    fn resolved_file(
        &mut self,
        path: &str,
        ino: u64,
        library: Library,
        source: &mut impl ProcessSource,
    ) -> Option<Arc<ResolvedLibrary>> {
        let key = (path.to_string(), ino);
        if let Some(r) = self.cache.get(&key) {
            return r.clone();
        }
        let r = match source.resolve(path, library) {
            Ok(r) => Some(Arc::new(r)),
            Err(e) => {
                tracing::warn!("device probes: resolving {path}: {e}");
                self.stats.library_failures += 1;
                None
            }
        };
        self.cache.insert(key, r.clone());
        r
    }
}

/// The work making `p` live at level `mask`.
fn site_work(p: &SiteProbe, path: &str, slot: u32, mask: u32) -> SiteWork {
    SiteWork {
        site: p.site,
        path: path.to_string(),
        slot,
        spec: p.probe.spec,
        entry_only: p.probe.spec.level_bit & mask == 0,
        name: (p.probe.target.library.name(), p.probe.target.function.name),
        urgent: matches!(
            p.probe.target.function.kind,
            CallKind::UniqueId | CallKind::CommInit(_)
        ),
    }
}

/// A `stat` device number as `/proc/PID/maps` gives it (`major << 32 |
/// minor`, see [`xpuscope_probes::maps::Mapping::dev`]).
fn maps_dev(st_dev: u64) -> u64 {
    (u64::from(libc::major(st_dev)) << 32) | u64::from(libc::minor(st_dev))
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
