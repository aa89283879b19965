//! Applying a [`Plan`] through an [`Attacher`]: the uprobe pairs attached
//! per [`ProbeSite`], their specs written or silenced, their hits read.
//! [`AyaAttacher`] does it over an `aya::Ebpf`; [`FakeAttacher`] (tests)
//! records every call, fails when told to, and keeps hit counts, so the
//! bookkeeping is tested without root (as aya's own `sys` fake does for
//! its loaders).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use aya::Ebpf;
use aya::maps::{Array, Map, MapData, PerCpuArray};
use aya::programs::UProbe;
use aya::programs::uprobe::{UProbeAttachPoint, UProbeLink, UProbeScope};
use xpuscope_common::maps;
use xpuscope_common::uprobe::ProbeSpec;

use super::closer;
use super::plan::{FileId, FileRelease, Plan, ProbeSite, SiteWork};
use super::uprobe_multi;
use crate::kernel::config_map;
use crate::kernel::error::KernelError;

pub const ENTRY_PROGRAM: &str = "device_call_entry";
pub const RETURN_PROGRAM: &str = "device_call_return";

/// Which half of a probed call a program sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProbeEnd {
    Entry,
    Return,
}

impl ProbeEnd {
    pub fn program(self) -> &'static str {
        match self {
            ProbeEnd::Entry => ENTRY_PROGRAM,
            ProbeEnd::Return => RETURN_PROGRAM,
        }
    }
}

/// The kernel effects of the device probes.
pub trait Attacher {
    /// An attached program; dropping it (or [`Attacher::detach`]) detaches.
    type Link;

    /// Verifies and loads the entry and return programs (once, when the
    /// first library is found: no device library, no cost).
    fn load_programs(&mut self) -> Result<(), KernelError>;

    /// Attaches `end`'s program at `path` + `offset` for every process,
    /// with `cookie` (the probe's slot) as its attach cookie.
    fn attach(
        &mut self,
        end: ProbeEnd,
        path: &str,
        offset: u64,
        cookie: u32,
    ) -> Result<Self::Link, KernelError>;

    /// Attaches `end`'s program at every `(offset, cookie)` of `path` as
    /// one link (a uprobe-multi link: released at once, see
    /// [`uprobe_multi`]). `None` where this attacher has no such links; the
    /// sites are then attached one by one, as they are when this fails.
    fn attach_many(
        &mut self,
        end: ProbeEnd,
        path: &str,
        sites: &[(u64, u32)],
    ) -> Option<Result<Self::Link, KernelError>> {
        let _ = (end, path, sites);
        None
    }

    /// Detaches now (slow: see [`closer`]).
    fn detach(&mut self, link: Self::Link);

    /// Writes what the probe at `slot` copies; an all-zero spec silences it.
    fn write_spec(&mut self, slot: u32, spec: ProbeSpec) -> Result<(), KernelError>;

    /// Calls the kernel counted at `slot` (entries by traced processes).
    fn read_hits(&self, slot: u32) -> u64;

    /// Writes `CONFIG.probe_levels`.
    fn set_probe_levels(&mut self, mask: u32) -> Result<(), KernelError>;

    /// Hands `links` over to be closed after the agent exits.
    fn release(&mut self, links: Vec<Self::Link>);

    /// Closes `links` off the calling thread (each close waits for the
    /// kernel, see [`closer`]), then calls `closed`.
    fn close_soon(&mut self, links: Vec<Self::Link>, closed: Box<dyn FnOnce() + Send>);
}

/// Counters for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceProbeStats {
    /// Functions made live (entry and return) for a process, over all
    /// processes (a function re-enabled by a raised level counts again).
    pub attached: u64,
    /// Single functions (or whole libraries) that could not be attached.
    pub attach_failures: u64,
    pub libraries: u64,
    /// Library files probed ahead of any traced process mapping them
    /// (predicted from a starting program's dependencies).
    pub files_ahead: u64,
    /// Links made: one per probe end and function, or one per probe end
    /// and library file where the kernel has uprobe-multi links.
    pub links: u64,
    /// Of `links`, the uprobe-multi ones.
    pub multi_links: u64,
    /// Library files whose probes took longer than [`SLOW_ATTACH`] to
    /// attach (the kernel busy releasing other probes): calls in that time
    /// went unrecorded.
    pub slow_attaches: u64,
    /// Probe slots held now (of [`xpuscope_common::MAX_PROBE_SLOTS`] - 1).
    pub slots_in_use: u64,
    /// Library files whose probes were released: no traced process used
    /// them for a while (see [`super::plan::RELEASE_AFTER`]).
    pub files_released: u64,
}

/// An attach slower than this is counted and reported: a rank calls its
/// libraries within milliseconds of mapping them.
pub const SLOW_ATTACH: std::time::Duration = std::time::Duration::from_secs(1);

/// A site with its uprobe pair attached, shared by the traced processes
/// mapping it.
struct LinkedSite {
    slot: u32,
    /// Its spec is written (not silenced).
    live: bool,
    /// Its return end is attached (a launch counted below the capture
    /// level has its entry only, until the level rises).
    has_return: bool,
    name: (&'static str, &'static str),
    /// The slot's hit count when this site got it (a released site's slot
    /// is handed out again; the kernel's counter goes on).
    hits_base: u64,
}

/// The attached uprobe pairs. A pair stays attached while a traced process
/// uses its file: a lowered level silences it, a raised one re-enables it;
/// the planner releases a file's pairs once no process has used it for a
/// while.
pub struct ProbeLinks<L> {
    loaded: bool,
    /// Loading the programs failed: no further attempts.
    disabled: bool,
    sites: HashMap<ProbeSite, LinkedSite>,
    /// Every link (a site's entry or return, or a library's many) by the
    /// file it sits on, kept until the file is released or
    /// [`ProbeLinks::detach_all`].
    links: HashMap<FileId, Vec<L>>,
    /// Hits of released sites, by (library, function).
    released_hits: HashMap<(&'static str, &'static str), u64>,
    /// Slots of released sites whose links are closed (filled by the
    /// closing thread).
    closed_slots: Arc<Mutex<Vec<u32>>>,
    pub stats: DeviceProbeStats,
}

impl<L> Default for ProbeLinks<L> {
    fn default() -> Self {
        Self {
            loaded: false,
            disabled: false,
            sites: HashMap::new(),
            links: HashMap::new(),
            released_hits: HashMap::new(),
            closed_slots: Arc::default(),
            stats: DeviceProbeStats::default(),
        }
    }
}

impl<L> ProbeLinks<L> {
    /// Attaches, re-enables and silences what `plan` says (send
    /// `plan.updates` to the trace stage first).
    pub fn apply<A: Attacher<Link = L>>(
        &mut self,
        attacher: &mut A,
        plan: Plan,
    ) -> Result<(), KernelError> {
        if let Some(mask) = plan.probe_levels {
            attacher.set_probe_levels(mask)?;
        }
        for file in &plan.release {
            self.release_file(attacher, file);
        }
        for (site, slot) in &plan.silence {
            if let Some(s) = self.sites.get_mut(site)
                && s.live
            {
                silence(attacher, *slot);
                s.live = false;
            }
        }
        if !plan.live.is_empty() {
            self.load(attacher)?;
        }
        if !self.disabled {
            // Set-up calls first: see `SiteWork::urgent`.
            let (urgent, rest): (Vec<&SiteWork>, Vec<&SiteWork>) =
                plan.live.iter().partition(|w| w.urgent);
            for works in [urgent, rest] {
                let mut new: Vec<&SiteWork> = Vec::new();
                for work in works {
                    if self.sites.contains_key(&work.site) {
                        self.re_enable(attacher, work);
                    } else {
                        new.push(work);
                    }
                }
                // One batch per file, in the order the plan named them.
                let mut paths: Vec<&str> = Vec::new();
                for w in &new {
                    if !paths.contains(&w.path.as_str()) {
                        paths.push(&w.path);
                    }
                }
                for path in paths {
                    let batch: Vec<&SiteWork> =
                        new.iter().copied().filter(|w| w.path == path).collect();
                    self.attach_new(attacher, path, &batch);
                }
            }
        }
        for (_, site) in &plan.uses {
            if self.sites.get(site).is_some_and(|s| s.live) {
                self.stats.attached += 1;
            }
        }
        for (pid, path, functions, sites) in &plan.libraries {
            // This library's sites only (a process maps several libraries).
            let live = sites
                .iter()
                .filter(|s| self.sites.get(s).is_some_and(|s| s.live))
                .count();
            tracing::info!(
                "device probes: pid {pid}: {path} ({live} of {functions} functions live)"
            );
            self.stats.libraries += 1;
        }
        for (path, functions) in &plan.files {
            tracing::info!(
                "device probes: {path} probed ahead of its first mapping ({functions} functions)"
            );
            self.stats.files_ahead += 1;
        }
        Ok(())
    }

    /// Loads the probe programs if they are not yet: at the first probe,
    /// or ahead of it when a new process's probes must be attached within
    /// milliseconds (verifying them takes a few).
    pub fn load<A: Attacher<Link = L>>(&mut self, attacher: &mut A) -> Result<(), KernelError> {
        if self.disabled || self.loaded {
            return Ok(());
        }
        if let Err(e) = attacher.load_programs() {
            // The scheduler recording goes on without device calls.
            self.disabled = true;
            self.stats.attach_failures += 1;
            return Err(e);
        }
        self.loaded = true;
        Ok(())
    }

    /// Silences a released file's sites, then closes its links off this
    /// thread; its slots are free once they are closed
    /// ([`Self::take_closed_slots`]).
    fn release_file<A: Attacher<Link = L>>(&mut self, attacher: &mut A, file: &FileRelease) {
        let mut slots = Vec::with_capacity(file.sites.len());
        for (site, slot) in &file.sites {
            if let Some(s) = self.sites.remove(site) {
                silence(attacher, s.slot);
                let hits = attacher.read_hits(s.slot).saturating_sub(s.hits_base);
                *self.released_hits.entry(s.name).or_default() += hits;
            }
            slots.push(*slot);
        }
        let links = self.links.remove(&file.file).unwrap_or_default();
        tracing::info!(
            "device probes: releasing {} probes and {} links of file {}:{} (no traced process uses it)",
            slots.len(),
            links.len(),
            file.file.0,
            file.file.1
        );
        let closed = self.closed_slots.clone();
        let done: Box<dyn FnOnce() + Send> = Box::new(move || {
            if let Ok(mut c) = closed.lock() {
                c.extend(slots);
            }
        });
        if links.is_empty() {
            done();
        } else {
            attacher.close_soon(links, done);
        }
    }

    /// Slots of released probes whose links are closed since the last
    /// call.
    pub fn take_closed_slots(&self) -> Vec<u32> {
        self.closed_slots
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default()
    }

    /// A site attached before and silenced: its spec written again; an
    /// entry-only site the level now records gets its return end.
    fn re_enable<A: Attacher<Link = L>>(&mut self, attacher: &mut A, work: &SiteWork) {
        let Some(s) = self.sites.get_mut(&work.site) else {
            return;
        };
        if !s.has_return && !work.entry_only {
            match attacher.attach(ProbeEnd::Return, &work.path, work.site.offset, work.slot) {
                Ok(link) => {
                    self.links.entry(work.site.file()).or_default().push(link);
                    self.stats.links += 1;
                    s.has_return = true;
                }
                Err(e) => {
                    tracing::warn!(
                        "device probes: attaching the return of {} at {}+{:#x}: {e:#}",
                        work.name.1,
                        work.path,
                        work.site.offset
                    );
                    self.stats.attach_failures += 1;
                }
            }
        }
        if !s.live {
            match attacher.write_spec(s.slot, work.spec) {
                Ok(()) => s.live = true,
                Err(e) => {
                    tracing::warn!("device probes: {}: {e:#}", work.name.1);
                    self.stats.attach_failures += 1;
                }
            }
        }
    }

    /// New sites of one file: their specs written, then attached as one
    /// link per end where the attacher can, else one by one.
    fn attach_new<A: Attacher<Link = L>>(
        &mut self,
        attacher: &mut A,
        path: &str,
        works: &[&SiteWork],
    ) {
        let mut ready: Vec<&SiteWork> = Vec::with_capacity(works.len());
        for work in works {
            match attacher.write_spec(work.slot, work.spec) {
                Ok(()) => ready.push(work),
                Err(e) => {
                    tracing::warn!("device probes: {}: {e:#}", work.name.1);
                    self.stats.attach_failures += 1;
                }
            }
        }
        if ready.is_empty() {
            return;
        }
        let started = std::time::Instant::now();
        self.attach_ready(attacher, path, ready);
        let took = started.elapsed();
        if took > SLOW_ATTACH {
            self.stats.slow_attaches += 1;
            tracing::warn!(
                "device probes: attaching {} functions at {path} took {took:.1?} (the kernel was busy, \
                 e.g. releasing other agents' probes): their calls in that time were not recorded",
                works.len()
            );
        }
    }

    /// [`Self::attach_new`]'s links, the specs written.
    fn attach_ready<A: Attacher<Link = L>>(
        &mut self,
        attacher: &mut A,
        path: &str,
        ready: Vec<&SiteWork>,
    ) {
        let sites: Vec<(u64, u32)> = ready.iter().map(|w| (w.site.offset, w.slot)).collect();
        let returns: Vec<(u64, u32)> = ready
            .iter()
            .filter(|w| !w.entry_only)
            .map(|w| (w.site.offset, w.slot))
            .collect();
        match attacher.attach_many(ProbeEnd::Entry, path, &sites) {
            None => {}
            Some(Ok(entry)) if returns.is_empty() => {
                self.links
                    .entry(ready[0].site.file())
                    .or_default()
                    .push(entry);
                self.stats.links += 1;
                self.stats.multi_links += 1;
                for work in ready {
                    self.insert(attacher, work);
                }
                return;
            }
            Some(Ok(entry)) => match attacher.attach_many(ProbeEnd::Return, path, &returns) {
                Some(Ok(ret)) => {
                    let file = ready[0].site.file();
                    self.links.entry(file).or_default().extend([entry, ret]);
                    self.stats.links += 2;
                    self.stats.multi_links += 2;
                    for work in ready {
                        self.insert(attacher, work);
                    }
                    return;
                }
                other => {
                    if let Some(Err(e)) = other {
                        tracing::info!(
                            "device probes: one link for {} returns at {path}: {e:#}; one per function",
                            sites.len()
                        );
                    }
                    attacher.detach(entry);
                }
            },
            Some(Err(e)) => tracing::info!(
                "device probes: one link for {} functions at {path}: {e:#}; one per function",
                sites.len()
            ),
        }
        for work in ready {
            self.attach_one(attacher, work);
        }
    }

    fn insert<A: Attacher<Link = L>>(&mut self, attacher: &A, work: &SiteWork) {
        self.sites.insert(
            work.site,
            LinkedSite {
                slot: work.slot,
                live: true,
                has_return: !work.entry_only,
                name: work.name,
                hits_base: attacher.read_hits(work.slot),
            },
        );
    }

    /// One site's uprobe pair, its spec already written.
    fn attach_one<A: Attacher<Link = L>>(&mut self, attacher: &mut A, work: &SiteWork) {
        let entry = attacher.attach(ProbeEnd::Entry, &work.path, work.site.offset, work.slot);
        let ret = if work.entry_only {
            Ok(None)
        } else {
            attacher
                .attach(ProbeEnd::Return, &work.path, work.site.offset, work.slot)
                .map(Some)
        };
        match (entry, ret) {
            (Ok(entry), Ok(ret)) => {
                let links = self.links.entry(work.site.file()).or_default();
                links.push(entry);
                self.stats.links += 1;
                if let Some(ret) = ret {
                    links.push(ret);
                    self.stats.links += 1;
                }
                self.insert(attacher, work);
            }
            (entry, ret) => {
                let err = entry.as_ref().err().or(ret.as_ref().err());
                tracing::warn!(
                    "device probes: attaching {} at {}+{:#x}: {}",
                    work.name.1,
                    work.path,
                    work.site.offset,
                    err.map(|e| format!("{e:#}")).unwrap_or_default()
                );
                self.stats.attach_failures += 1;
                if let Ok(link) = entry {
                    attacher.detach(link);
                }
                if let Ok(Some(link)) = ret {
                    attacher.detach(link);
                }
                silence(attacher, work.slot);
            }
        }
    }

    /// Calls of a live site by traced processes since it got its slot.
    pub fn live_hits<A: Attacher<Link = L>>(&self, attacher: &A, site: &ProbeSite) -> Option<u64> {
        self.sites
            .get(site)
            .filter(|s| s.live)
            .map(|s| attacher.read_hits(s.slot).saturating_sub(s.hits_base))
    }

    /// Calls of every attached probe by traced processes so far (exited
    /// ones included), by (library, function), as the kernel counted them:
    /// records dropped on the way are still counted here.
    pub fn hits<A: Attacher<Link = L>>(
        &self,
        attacher: &A,
    ) -> HashMap<(&'static str, &'static str), u64> {
        let mut out = self.released_hits.clone();
        for s in self.sites.values() {
            *out.entry(s.name).or_default() +=
                attacher.read_hits(s.slot).saturating_sub(s.hits_base);
        }
        out
    }

    /// Silences every probe, then hands the links over to be closed after
    /// the agent exits (see [`closer`] for why not now).
    pub fn detach_all<A: Attacher<Link = L>>(&mut self, attacher: &mut A) {
        for (_, s) in self.sites.drain() {
            silence(attacher, s.slot);
        }
        let links: Vec<L> = std::mem::take(&mut self.links)
            .into_values()
            .flatten()
            .collect();
        if !links.is_empty() {
            attacher.release(links);
        }
    }
}

/// Makes the probe at `slot` record nothing: `level_bit` 0 (the default
/// spec is level 0's, which records).
fn silence<A: Attacher>(attacher: &mut A, slot: u32) {
    let off = ProbeSpec {
        level_bit: 0,
        ..ProbeSpec::default()
    };
    if let Err(e) = attacher.write_spec(slot, off) {
        tracing::debug!("silencing probe slot {slot}: {e:#}");
    }
}

/// A device-call probe's link in the kernel: dropping it detaches.
#[derive(Debug)]
#[expect(dead_code, reason = "held only to be dropped: closing detaches")]
pub enum DeviceLink {
    /// One function's entry or return, through a perf event (aya's).
    PerfEvent(UProbeLink),
    /// Many functions of one file: a uprobe-multi link's descriptor.
    Multi(OwnedFd),
}

impl closer::HeldLink for DeviceLink {
    fn own_fd(&self) -> Option<std::os::fd::RawFd> {
        match self {
            DeviceLink::PerfEvent(_) => None,
            DeviceLink::Multi(fd) => Some(std::os::fd::AsRawFd::as_raw_fd(fd)),
        }
    }
}

/// The device-call programs loaded as uprobe-multi programs, beside aya's
/// (see [`uprobe_multi`]); kept with the [`Ebpf`] whose maps they use.
#[derive(Debug, Default)]
pub struct MultiPrograms {
    state: MultiState,
    /// Maps taken out of the [`Ebpf`] (the rings, read elsewhere): their
    /// descriptors, duplicated when taken, for the programs to use.
    taken: Vec<(String, OwnedFd)>,
}

#[derive(Debug, Default)]
enum MultiState {
    /// Not tried yet (the programs load with the first library found).
    #[default]
    NotTried,
    Loaded {
        entry: OwnedFd,
        ret: OwnedFd,
    },
    /// The kernel or the object does not allow them: perf events only.
    Unavailable,
}

/// Set to `perf-event` to attach one perf event per function even where
/// uprobe-multi links work: how the tests cover the path older kernels
/// (before 6.6) take.
pub const UPROBE_LINKS_ENV: &str = "XPUSCOPE_UPROBE_LINKS";

impl MultiPrograms {
    /// Keeps a descriptor of `map` before it leaves the [`Ebpf`] under
    /// `name`.
    pub fn keep_map(&mut self, name: &str, map: &Map) -> std::io::Result<()> {
        let fd = map_data(map).fd().as_fd().try_clone_to_owned()?;
        self.taken.push((name.to_string(), fd));
        Ok(())
    }

    /// Links and loads both programs against `bpf`'s maps.
    fn load(&self, bpf: &Ebpf) -> Result<MultiState, String> {
        if std::env::var(UPROBE_LINKS_ENV).is_ok_and(|v| v == "perf-event") {
            return Err(format!("{UPROBE_LINKS_ENV}=perf-event"));
        }
        let map_fd = |name: &str| {
            bpf.map(name)
                .map(|m| map_data(m).fd().as_fd().as_raw_fd())
                .or_else(|| {
                    let (_, fd) = self.taken.iter().find(|(n, _)| n == name)?;
                    Some(fd.as_raw_fd())
                })
        };
        let load = |name: &str| -> Result<OwnedFd, String> {
            let program =
                uprobe_multi::link_program(crate::kernel::object::EBPF_OBJECT, name, &map_fd)
                    .map_err(|e| e.to_string())?;
            uprobe_multi::load(name, &program).map_err(|e| format!("loading {name}: {e}"))
        };
        Ok(MultiState::Loaded {
            entry: load(ENTRY_PROGRAM)?,
            ret: load(RETURN_PROGRAM)?,
        })
    }
}

/// The map behind any of aya's map kinds.
fn map_data(map: &Map) -> &MapData {
    match map {
        Map::Array(m)
        | Map::ArrayOfMaps(m)
        | Map::BloomFilter(m)
        | Map::CgroupArray(m)
        | Map::CgroupStorage(m)
        | Map::CgrpStorage(m)
        | Map::CpuMap(m)
        | Map::DevMap(m)
        | Map::DevMapHash(m)
        | Map::HashMap(m)
        | Map::HashOfMaps(m)
        | Map::InodeStorage(m)
        | Map::LpmTrie(m)
        | Map::LruHashMap(m)
        | Map::PerCpuArray(m)
        | Map::PerCpuCgroupStorage(m)
        | Map::PerCpuHashMap(m)
        | Map::PerCpuLruHashMap(m)
        | Map::PerfEventArray(m)
        | Map::ProgramArray(m)
        | Map::Queue(m)
        | Map::ReusePortSockArray(m)
        | Map::RingBuf(m)
        | Map::SockHash(m)
        | Map::SockMap(m)
        | Map::SkStorage(m)
        | Map::Stack(m)
        | Map::StackTraceMap(m)
        | Map::Unsupported(m)
        | Map::XskMap(m) => m,
    }
}

/// [`Attacher`] over a loaded object.
pub struct AyaAttacher<'a> {
    bpf: &'a mut Ebpf,
    multi: &'a mut MultiPrograms,
}

impl<'a> AyaAttacher<'a> {
    pub fn new(bpf: &'a mut Ebpf, multi: &'a mut MultiPrograms) -> Self {
        Self { bpf, multi }
    }

    fn uprobe(&mut self, name: &str) -> Result<&mut UProbe, KernelError> {
        self.bpf
            .program_mut(name)
            .ok_or_else(|| KernelError::Missing(format!("program {name}")))?
            .try_into()
            .map_err(KernelError::program(format!("{name} is not a uprobe")))
    }
}

impl Attacher for AyaAttacher<'_> {
    type Link = DeviceLink;

    fn load_programs(&mut self) -> Result<(), KernelError> {
        for name in [ENTRY_PROGRAM, RETURN_PROGRAM] {
            self.uprobe(name)?
                .load()
                .map_err(KernelError::program(format!("verifying/loading {name}")))?;
        }
        if matches!(self.multi.state, MultiState::NotTried) {
            self.multi.state = self.multi.load(self.bpf).unwrap_or_else(|why| {
                tracing::info!(
                    "device probes: one perf event per function (no uprobe-multi links: {why})"
                );
                MultiState::Unavailable
            });
        }
        Ok(())
    }

    fn attach_many(
        &mut self,
        end: ProbeEnd,
        path: &str,
        sites: &[(u64, u32)],
    ) -> Option<Result<DeviceLink, KernelError>> {
        let MultiState::Loaded { entry, ret } = &self.multi.state else {
            return None;
        };
        let program = match end {
            ProbeEnd::Entry => entry,
            ProbeEnd::Return => ret,
        };
        let sites: Vec<(u64, u64)> = sites.iter().map(|&(o, c)| (o, u64::from(c))).collect();
        Some(
            uprobe_multi::attach(program.as_fd(), path, &sites, end == ProbeEnd::Return)
                .map(DeviceLink::Multi)
                .map_err(|source| KernelError::Syscall {
                    what: format!(
                        "attaching {} at {} functions of {path}",
                        end.program(),
                        sites.len()
                    ),
                    source,
                }),
        )
    }

    fn attach(
        &mut self,
        end: ProbeEnd,
        path: &str,
        offset: u64,
        cookie: u32,
    ) -> Result<DeviceLink, KernelError> {
        let point = UProbeAttachPoint {
            location: offset.into(),
            cookie: Some(u64::from(cookie)),
        };
        let what = || format!("attaching {} at {path}+{offset:#x}", end.program());
        // Every process: a probe scoped to one process is a perf event on
        // its main thread, rescheduled at each of that thread's switches
        // (microseconds per switch with 100 probes); the programs filter
        // traced processes instead.
        let program = self.uprobe(end.program())?;
        let id = program
            .attach(point, path, UProbeScope::AllProcesses)
            .map_err(KernelError::program(what()))?;
        program
            .take_link(id)
            .map(DeviceLink::PerfEvent)
            .map_err(KernelError::program(what()))
    }

    fn detach(&mut self, link: DeviceLink) {
        drop(link);
    }

    fn write_spec(&mut self, slot: u32, spec: ProbeSpec) -> Result<(), KernelError> {
        let map = self
            .bpf
            .map_mut(maps::UPROBE_SPECS)
            .ok_or_else(|| KernelError::Missing(format!("map {}", maps::UPROBE_SPECS)))?;
        let mut specs: Array<&mut MapData, ProbeSpec> =
            Array::try_from(map).map_err(KernelError::map("opening UPROBE_SPECS"))?;
        specs
            .set(slot, spec, 0)
            .map_err(KernelError::map(format!("writing UPROBE_SPECS[{slot}]")))
    }

    fn read_hits(&self, slot: u32) -> u64 {
        let Some(map) = self.bpf.map(maps::UPROBE_HITS) else {
            return 0;
        };
        let Ok(hits) = PerCpuArray::<&MapData, u64>::try_from(map) else {
            return 0;
        };
        hits.get(&slot, 0)
            .map(|per_cpu| per_cpu.iter().sum())
            .unwrap_or(0)
    }

    fn set_probe_levels(&mut self, mask: u32) -> Result<(), KernelError> {
        config_map::update(self.bpf, |c| c.probe_levels = mask)
    }

    fn release(&mut self, links: Vec<DeviceLink>) {
        closer::close_after_exit(links);
    }

    fn close_soon(&mut self, links: Vec<DeviceLink>, closed: Box<dyn FnOnce() + Send>) {
        // A thread of the agent's own (its name marks it as the agent's
        // for the contention detector): the kernel side goes on attaching
        // while the kernel waits on each close.
        let release = Closing {
            links,
            closed: Some(closed),
        };
        let spawned = std::thread::Builder::new()
            .name("xpuscope-release".into())
            .spawn(move || drop(release));
        if let Err(e) = spawned {
            // The release was dropped with the thread's closure: closed
            // here, slowly.
            tracing::warn!("device probes: no thread to release probes on ({e}); released here");
        }
    }
}

/// Links being closed: dropping it closes them, then reports it, wherever
/// it is dropped (on its thread, or here when no thread could start).
struct Closing<L: Send> {
    links: Vec<L>,
    closed: Option<Box<dyn FnOnce() + Send>>,
}

/// Links closed side by side, at most.
const CLOSE_SIDE_BY_SIDE: usize = 16;

impl<L: Send> Drop for Closing<L> {
    fn drop(&mut self) {
        // Each close waits for its own grace periods: closed on threads of
        // their own, the waits overlap (as the closer's at exit: see
        // `closer`). A link whose thread cannot start is closed here.
        let mut links = std::mem::take(&mut self.links);
        while !links.is_empty() {
            let batch: Vec<L> = links.drain(..links.len().min(CLOSE_SIDE_BY_SIDE)).collect();
            std::thread::scope(|scope| {
                for link in batch {
                    let _ = std::thread::Builder::new()
                        .name("xpuscope-release".into())
                        .spawn_scoped(scope, move || drop(link));
                }
            });
        }
        if let Some(closed) = self.closed.take() {
            closed();
        }
    }
}

#[cfg(test)]
mod closing_tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Link(Arc<AtomicUsize>);

    impl Drop for Link {
        fn drop(&mut self) {
            std::thread::sleep(std::time::Duration::from_millis(5));
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Every link is closed, more than a batch of them too, before the
    /// release is reported.
    #[test]
    fn every_link_is_closed_before_the_release_is_reported() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicUsize::new(usize::MAX));
        let n = 2 * CLOSE_SIDE_BY_SIDE + 3;
        let release = Closing {
            links: (0..n).map(|_| Link(dropped.clone())).collect(),
            closed: Some(Box::new({
                let (dropped, seen) = (dropped.clone(), seen.clone());
                move || seen.store(dropped.load(Ordering::SeqCst), Ordering::SeqCst)
            })),
        };
        drop(release);
        assert_eq!(seen.load(Ordering::SeqCst), n);
    }
}

/// A call [`FakeAttacher`] saw.
#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FakeCall {
    Load,
    Attach {
        end: ProbeEnd,
        path: String,
        offset: u64,
        cookie: u32,
    },
    /// One link for many sites of a file: (offset, cookie) each.
    AttachMany {
        end: ProbeEnd,
        path: String,
        sites: Vec<(u64, u32)>,
    },
    Detach(u64),
    /// A spec written; `level_bit` 0 is a silenced slot.
    WriteSpec {
        slot: u32,
        level_bit: u32,
    },
    SetProbeLevels(u32),
    Release(Vec<u64>),
    /// Links closed at once (a released file's).
    Close(Vec<u64>),
}

/// [`Attacher`] in memory: links are numbers, specs and hits a map.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct FakeAttacher {
    pub calls: Vec<FakeCall>,
    next_link: u64,
    /// Links attached and not detached or released.
    pub open_links: std::collections::BTreeSet<u64>,
    pub specs: HashMap<u32, ProbeSpec>,
    pub hits: HashMap<u32, u64>,
    pub probe_levels: u32,
    pub fail_load: bool,
    /// Attaches that fail, by (end, file offset).
    pub fail_attach: Vec<(ProbeEnd, u64)>,
    /// Makes one link for many sites (a kernel with uprobe-multi links).
    pub multi: bool,
    /// Many-site attaches that fail, by end.
    pub fail_multi: Vec<ProbeEnd>,
}

#[cfg(test)]
impl FakeAttacher {
    /// (end, offset, cookie) of every attach tried, in order.
    pub fn attaches(&self) -> Vec<(ProbeEnd, u64, u32)> {
        self.calls
            .iter()
            .filter_map(|c| match c {
                FakeCall::Attach {
                    end,
                    offset,
                    cookie,
                    ..
                } => Some((*end, *offset, *cookie)),
                _ => None,
            })
            .collect()
    }

    /// Whether the probe at `slot` records (its spec is written, not zero).
    pub fn is_live(&self, slot: u32) -> bool {
        self.specs.get(&slot).is_some_and(|s| s.level_bit != 0)
    }
}

#[cfg(test)]
impl Attacher for FakeAttacher {
    type Link = u64;

    fn load_programs(&mut self) -> Result<(), KernelError> {
        self.calls.push(FakeCall::Load);
        if self.fail_load {
            return Err(KernelError::Injected("load".into()));
        }
        Ok(())
    }

    fn attach(
        &mut self,
        end: ProbeEnd,
        path: &str,
        offset: u64,
        cookie: u32,
    ) -> Result<u64, KernelError> {
        self.calls.push(FakeCall::Attach {
            end,
            path: path.to_string(),
            offset,
            cookie,
        });
        if self.fail_attach.contains(&(end, offset)) {
            return Err(KernelError::Injected(format!("{end:?} at {offset:#x}")));
        }
        self.next_link += 1;
        self.open_links.insert(self.next_link);
        Ok(self.next_link)
    }

    fn attach_many(
        &mut self,
        end: ProbeEnd,
        path: &str,
        sites: &[(u64, u32)],
    ) -> Option<Result<u64, KernelError>> {
        if !self.multi {
            return None;
        }
        self.calls.push(FakeCall::AttachMany {
            end,
            path: path.to_string(),
            sites: sites.to_vec(),
        });
        if self.fail_multi.contains(&end) {
            return Some(Err(KernelError::Injected(format!("{end:?} at {path}"))));
        }
        self.next_link += 1;
        self.open_links.insert(self.next_link);
        Some(Ok(self.next_link))
    }

    fn detach(&mut self, link: u64) {
        self.calls.push(FakeCall::Detach(link));
        self.open_links.remove(&link);
    }

    fn write_spec(&mut self, slot: u32, spec: ProbeSpec) -> Result<(), KernelError> {
        self.calls.push(FakeCall::WriteSpec {
            slot,
            level_bit: spec.level_bit,
        });
        self.specs.insert(slot, spec);
        Ok(())
    }

    fn read_hits(&self, slot: u32) -> u64 {
        self.hits.get(&slot).copied().unwrap_or(0)
    }

    fn set_probe_levels(&mut self, mask: u32) -> Result<(), KernelError> {
        self.calls.push(FakeCall::SetProbeLevels(mask));
        self.probe_levels = mask;
        Ok(())
    }

    fn release(&mut self, links: Vec<u64>) {
        for l in &links {
            self.open_links.remove(l);
        }
        self.calls.push(FakeCall::Release(links));
    }

    fn close_soon(&mut self, links: Vec<u64>, closed: Box<dyn FnOnce() + Send>) {
        for l in &links {
            self.open_links.remove(l);
        }
        self.calls.push(FakeCall::Close(links));
        closed();
    }
}
