//! Device-library probes: finds the catalog libraries (libcudart, libnccl,
//! libcupti, libascendcl, libhccl, libmspti) mapped by each traced process,
//! attaches the generic `device_call_entry` / `device_call_return` programs
//! at every probed function of the current capture level, and writes what
//! each probe copies into `UPROBE_SPECS`.
//!
//! - [`plan`]: which probes, where, with which slot (pure, behind
//!   [`ProcessSource`]);
//! - [`attach`]: applying a plan through an [`Attacher`] (aya, or a fake);
//! - [`closer`]: why links are closed after the agent exits.
//!
//! Probes are attached per library FILE (device, inode, offset) for all
//! processes, and shared by every traced process mapping that file; the
//! programs ignore processes not traced. Each probe has a slot, passed to
//! the programs as its attach cookie: its spec and hit counter sit at that
//! index of two arrays, and records carry it, so a traced process whose
//! maps the agent has not read yet still decodes. The price of file scope:
//! a process not traced that calls a probed function of the same file takes
//! the trap (about 1 us) and records nothing.
//!
//! Costless when no device library is present: the uprobe programs are
//! loaded only when the first library is found. Each round is split in two
//! so the trace stage learns a probe's meaning before the kernel can report
//! a hit on it: [`DeviceProbes::plan`] (or [`DeviceProbes::set_device_level`])
//! returns the table updates to send, then [`DeviceProbes::apply`] attaches
//! and writes the specs. A probe the level drops is silenced, not
//! detached: a raised level reuses it (a second probe on the same place
//! would record every call twice). A file no traced process has used for
//! [`plan::RELEASE_AFTER`] has its probes detached (off the kernel side's
//! thread) and their slots handed out again once they are.

pub mod attach;
pub mod closer;
#[cfg(test)]
mod fake_source;
pub mod plan;
pub mod uprobe_multi;

use std::collections::HashMap;

pub use attach::{Attacher, AyaAttacher, DeviceLink, DeviceProbeStats, MultiPrograms, ProbeLinks};
pub use plan::{LiveProcesses, Plan, Planner, ProcessSource, RELEASE_AFTER, TableUpdate};

use super::error::KernelError;
use super::levels::{CaptureLevels, DeviceLevel};

/// The device probes over a loaded object ([`AyaAttacher`]).
pub type AyaDeviceProbes = DeviceProbes<DeviceLink>;

/// The device probes of one recording: the plan and the attached links.
/// `L` is the [`Attacher`]'s link type.
pub struct DeviceProbes<L> {
    planner: Planner,
    links: ProbeLinks<L>,
}

impl<L> DeviceProbes<L> {
    /// Probes the device functions of `levels`; with `alloc_stacks`,
    /// allocations carry the caller's stack (allocation sites, an OOM's).
    pub fn new(levels: CaptureLevels, alloc_stacks: bool) -> Self {
        Self {
            planner: Planner::new(levels, alloc_stacks),
            links: ProbeLinks::default(),
        }
    }

    /// At most `slots` probe slots (1 to `MAX_PROBE_SLOTS` - 1), and files
    /// unused for `release_after` have their probes released.
    pub fn with_capacity(mut self, slots: u32, release_after: std::time::Duration) -> Self {
        self.planner = self
            .planner
            .with_slot_limit(slots.saturating_add(1))
            .with_release_after(release_after);
        self
    }

    /// The capture levels now (what `CONFIG` holds once applied).
    pub fn levels(&self) -> CaptureLevels {
        self.planner.levels()
    }

    /// Reads the libraries of `pids` (the traced processes now) and
    /// returns what changed; processes not in `pids` are forgotten.
    pub fn plan(&mut self, pids: &[u32], source: &mut impl ProcessSource) -> Plan {
        self.planner.slots_closed(self.links.take_closed_slots());
        self.planner.plan(pids, source)
    }

    /// A traced process started a program or its loader reported first:
    /// probes for the libraries its program will load, by file, before it
    /// maps them (see [`Planner::plan_early`]).
    pub fn plan_early(&mut self, pid: u32, exec: bool, source: &mut impl ProcessSource) -> Plan {
        self.planner.plan_early(pid, exec, source)
    }

    /// The loader files whose debugger hook is attached now
    /// (`Kernel::hooked_loaders`; see [`Planner::loaders_hooked`]).
    pub fn loaders_hooked(&mut self, files: &[(u64, u64)]) {
        self.planner.loaders_hooked(files);
    }

    /// Switches the device capture level of the running recording: the
    /// returned plan attaches the probes the new level adds in every traced
    /// process (their table updates first), silences those it drops, and
    /// writes the level mask to `CONFIG`. Nothing restarts; a probe
    /// silenced before is re-enabled, never attached twice. A call in
    /// flight when its probe is silenced keeps its entry record without a
    /// return (the summary counts such entries).
    pub fn set_device_level(
        &mut self,
        level: DeviceLevel,
        source: &mut impl ProcessSource,
    ) -> Plan {
        self.planner.set_device_level(level, source)
    }

    /// Applies `plan` (send `plan.updates` to the trace stage first).
    pub fn apply<A: Attacher<Link = L>>(
        &mut self,
        attacher: &mut A,
        plan: Plan,
    ) -> Result<(), KernelError> {
        self.links.apply(attacher, plan)
    }

    /// Loads the probe programs now rather than at the first library
    /// found (see [`ProbeLinks::load`]).
    pub fn load_programs<A: Attacher<Link = L>>(
        &mut self,
        attacher: &mut A,
    ) -> Result<(), KernelError> {
        self.links.load(attacher)
    }

    /// Calls of every probed function by traced processes so far, by
    /// (library, function), as the kernel counted them.
    pub fn hits<A: Attacher<Link = L>>(
        &self,
        attacher: &A,
    ) -> HashMap<(&'static str, &'static str), u64> {
        self.links.hits(attacher)
    }

    /// Calls of each live probe of process `pid`, by probe address.
    pub fn hits_by_address<A: Attacher<Link = L>>(
        &self,
        attacher: &A,
        pid: u32,
    ) -> HashMap<u64, u64> {
        self.planner
            .probes_of(pid)
            .filter_map(|(ip, site)| Some((ip, self.links.live_hits(attacher, &site)?)))
            .collect()
    }

    /// Silences every probe and hands the links to the closer.
    pub fn detach_all<A: Attacher<Link = L>>(&mut self, attacher: &mut A) {
        self.links.detach_all(attacher);
    }

    pub fn stats(&self) -> DeviceProbeStats {
        let mut stats = self.links.stats;
        let plan = self.planner.stats();
        stats.attach_failures += plan.library_failures + plan.slots_exhausted;
        stats.slots_in_use = plan.slots_in_use;
        stats.files_released = plan.files_released;
        stats
    }
}

#[cfg(test)]
mod tests;
