//! Enrichment: what the record stream needs from the live system, read on
//! the pipeline thread the moment a record needs it, before any sink sees
//! the record: symbolized stacks (blazesym), process command lines, kernel
//! names in the applications' memory. (Rank identity is read earlier still,
//! when device probes are planned: see `TableUpdate`; and here, for a
//! process whose calls come before its plan does.)
//!
//! The interpret stage asks through the [`Enrich`] trait, so it stays pure
//! and testable with [`fake::FakeEnricher`]; [`LiveEnricher`] is the real
//! one. Caches are per process and dropped when the interpret stage says a
//! process ended (every earlier record of it has been enriched by then:
//! records arrive in order), so a reused pid starts clean.

pub mod python;
pub mod stack_ends;
pub mod symbolize;
pub mod unwind;

use xpuscope_probes::activity::names::RemoteStrings;
use xpuscope_probes::maps::ProcessMaps;

use std::sync::Arc;

use crate::events::UserCopy;
use crate::model::SymFrame;
use crate::model::identity::{RankIdentity, default_job_env};
use crate::procfs;
use python::{PyOutcome, PythonStacks};
use symbolize::StackSymbolizer;
use unwind::CfiUnwind;

/// A user stack unwound from the CFI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnwoundUser {
    /// The sampled ip, then return addresses, leaf first.
    pub frames: Vec<u64>,
    /// The walk stopped before the outermost frame (the stack is deeper
    /// than the copy, or a rule failed).
    pub truncated: bool,
    /// Bytes of the copy above `sp` the walk read.
    pub stack_bytes_used: u64,
}

pub use crate::model::counters::{CacheCounters, CacheReport};

/// What interpretation may ask of the live system.
pub trait Enrich {
    fn kernel_frames(&mut self, addrs: &[u64]) -> Vec<SymFrame>;
    /// Frames of `addrs` (leaf first) in process `tgid`.
    fn user_frames(&mut self, tgid: u32, addrs: &[u64]) -> Vec<SymFrame>;
    /// Frames of thread `tid`'s stack `addrs` (leaf first): with its Python
    /// frames in place of the interpreter's evaluation frames where it is
    /// a CPython thread ([`python`]).
    fn thread_user_frames(
        &mut self,
        tgid: u32,
        _tid: u32,
        addrs: &[u64],
    ) -> (Vec<SymFrame>, PyOutcome) {
        (self.user_frames(tgid, addrs), PyOutcome::Native)
    }
    /// Time spent reading Python frames so far (ns).
    fn python_read_ns(&self) -> u64 {
        0
    }
    /// The caches' figures so far.
    fn caches(&self) -> CacheReport {
        CacheReport::default()
    }
    /// The time now (CLOCK_BOOTTIME ns): when a read of the live process
    /// was done.
    fn clock_ns(&self) -> u64 {
        crate::host::boottime_ns()
    }
    /// Thread `tid`'s Python frames now (innermost first), where process
    /// `tgid` is CPython and the thread runs Python: what a thread off CPU
    /// without a stack sampled is doing (hang evidence).
    fn python_frames_now(&mut self, _tgid: u32, _tid: u32) -> Option<Vec<SymFrame>> {
        None
    }
    /// Addresses (leaf first) unwound from the code's CFI over a copy of
    /// the top of a stack of process `tgid` taken at `ts`; `None` leaves
    /// the frame-pointer stack taken with it.
    fn unwind_user(&mut self, tgid: u32, ts: u64, copy: &UserCopy) -> Option<UnwoundUser>;
    /// A NUL-terminated string at `ptr` in process `tgid` (kernel names).
    fn remote_string(&mut self, tgid: u32, ptr: u64) -> Result<String, String>;
    /// Rank identity from process `pid`'s environment; `None` when it
    /// cannot be read (gone).
    fn identity(&mut self, _pid: u32) -> Option<RankIdentity> {
        None
    }
    /// argv of process `pid` (empty when gone).
    fn cmdline(&mut self, pid: u32) -> Vec<String>;
    /// The parent of process `pid` (0 when gone).
    fn ppid(&mut self, pid: u32) -> u32;
    /// `child` was forked from `parent` (same address space until exec).
    fn process_forked(&mut self, child: u32, parent: u32);
    /// `tgid` exec'd: addresses cached for the old program mean nothing now.
    fn process_exec(&mut self, tgid: u32);
    /// `tgid` ended and its records are out: forget it.
    fn process_ended(&mut self, tgid: u32);
    /// `tgid`'s loader changed its link map (libraries mapped or unmapped).
    fn link_map_changed(&mut self, _tgid: u32) {}
    /// A user stack of thread `tid` was unwound from its copy: how much of
    /// its stack the kernel copies next ([`stack_ends`]).
    fn stack_unwound(&mut self, _stack: stack_ends::UnwoundCopy) {}
    /// Thread `tid` exited.
    fn thread_exited(&mut self, _tid: u32) {}
    /// `tgid`'s memory map, read while it certainly lived (at probe
    /// planning), for stacks that arrive after it exited.
    fn remember_maps(&mut self, tgid: u32, maps: ProcessMaps);
}

/// Where a process's rank identity comes from: its environment in
/// `/proc` (with the job label's variables as configured now: the service
/// reloads them); a table in tests.
pub type IdentitySource = Box<dyn FnMut(u32) -> Option<RankIdentity> + Send>;

/// An [`IdentitySource`] reading `/proc/PID/environ`, the job label from
/// the first of `job_env()`'s variables the process sets.
pub fn identities_from_proc(
    job_env: impl Fn() -> Arc<[String]> + Send + 'static,
) -> IdentitySource {
    Box::new(move |pid| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        Some(RankIdentity::from_environ_with(&environ, &job_env()))
    })
}

/// The real enricher: blazesym, `/proc`, `/proc/PID/mem`.
pub struct LiveEnricher {
    symbolizer: StackSymbolizer,
    strings: RemoteStrings,
    unwind: CfiUnwind,
    python: PythonStacks,
    caches: CacheCounters,
    identities: IdentitySource,
    stack_ends: stack_ends::StackEnds,
    /// Where the map comes from when the kernel programs load after the
    /// pipeline starts (the service).
    stack_ends_later: Option<std::sync::mpsc::Receiver<crate::kernel::stack_ends::StackEndsMap>>,
}

impl Default for LiveEnricher {
    fn default() -> Self {
        Self::with_caches(CacheCounters::default())
    }
}

impl LiveEnricher {
    /// An enricher whose caches count into `caches`.
    pub fn with_caches(caches: CacheCounters) -> Self {
        Self {
            symbolizer: StackSymbolizer::default(),
            strings: RemoteStrings::default(),
            unwind: CfiUnwind::with_stats(caches.cfi.clone()),
            python: PythonStacks::with_stats(caches.python.clone()),
            caches,
            identities: identities_from_proc(|| default_job_env().into()),
            stack_ends: stack_ends::StackEnds::default(),
            stack_ends_later: None,
        }
    }

    /// Learned stack ends written to `map` (the kernel's
    /// [`xpuscope_common::maps::STACK_ENDS`]).
    pub fn with_stack_ends(mut self, map: Box<dyn stack_ends::StackEndsMap>) -> Self {
        self.stack_ends = stack_ends::StackEnds::new(map);
        self
    }

    /// The stack-ends map, once it comes on `rx`.
    pub fn with_stack_ends_later(
        mut self,
        rx: std::sync::mpsc::Receiver<crate::kernel::stack_ends::StackEndsMap>,
    ) -> Self {
        self.stack_ends_later = Some(rx);
        self
    }

    /// Rank identities from `source`.
    pub fn with_identities(mut self, source: IdentitySource) -> Self {
        self.identities = source;
        self
    }
}

impl Enrich for LiveEnricher {
    fn kernel_frames(&mut self, addrs: &[u64]) -> Vec<SymFrame> {
        self.symbolizer.kernel_frames(addrs)
    }

    fn user_frames(&mut self, tgid: u32, addrs: &[u64]) -> Vec<SymFrame> {
        self.symbolizer.user_frames(tgid, addrs)
    }

    fn thread_user_frames(
        &mut self,
        tgid: u32,
        tid: u32,
        addrs: &[u64],
    ) -> (Vec<SymFrame>, PyOutcome) {
        let frames = self.symbolizer.user_frames(tgid, addrs);
        self.python.mix(tgid, tid, addrs, frames)
    }

    fn python_read_ns(&self) -> u64 {
        self.python.read_ns
    }

    fn caches(&self) -> CacheReport {
        self.caches.report()
    }

    fn python_frames_now(&mut self, tgid: u32, tid: u32) -> Option<Vec<SymFrame>> {
        self.python.frames_now(tgid, tid)
    }

    fn unwind_user(&mut self, tgid: u32, ts: u64, copy: &UserCopy) -> Option<UnwoundUser> {
        self.unwind.unwind(tgid, ts, copy)
    }

    fn stack_unwound(&mut self, stack: stack_ends::UnwoundCopy) {
        if let Some(rx) = &self.stack_ends_later
            && let Ok(map) = rx.try_recv()
        {
            self.stack_ends = stack_ends::StackEnds::new(Box::new(map));
            self.stack_ends_later = None;
        }
        self.stack_ends.unwound(stack);
    }

    fn thread_exited(&mut self, tid: u32) {
        self.stack_ends.thread_exited(tid);
    }

    fn remote_string(&mut self, tgid: u32, ptr: u64) -> Result<String, String> {
        self.strings
            .get(tgid, ptr)
            .map(|s| s.to_string())
            .map_err(|e| e.to_string())
    }

    fn identity(&mut self, pid: u32) -> Option<RankIdentity> {
        (self.identities)(pid)
    }

    fn cmdline(&mut self, pid: u32) -> Vec<String> {
        procfs::cmdline(pid)
    }

    fn ppid(&mut self, pid: u32) -> u32 {
        procfs::stat(pid).map(|s| s.ppid).unwrap_or(0)
    }

    fn process_forked(&mut self, child: u32, parent: u32) {
        self.symbolizer.process_forked(child, parent);
    }

    fn process_exec(&mut self, tgid: u32) {
        self.symbolizer.forget_process(tgid);
        self.strings.forget_process(tgid);
        self.unwind.forget_process(tgid);
        self.python.forget(tgid);
    }

    fn process_ended(&mut self, tgid: u32) {
        self.symbolizer.forget_process(tgid);
        self.strings.forget_process(tgid);
        self.unwind.forget_process(tgid);
        self.python.forget(tgid);
    }

    fn remember_maps(&mut self, tgid: u32, maps: ProcessMaps) {
        self.symbolizer.remember_maps(tgid, maps);
    }

    fn link_map_changed(&mut self, tgid: u32) {
        self.unwind.link_map_changed(tgid);
    }
}

#[cfg(test)]
pub mod fake {
    //! A deterministic enricher for unit tests: frames named after their
    //! addresses, strings and identities from tables.

    use std::collections::HashMap;
    use std::sync::Arc;

    use super::*;

    #[derive(Default)]
    pub struct FakeEnricher {
        pub strings: HashMap<(u32, u64), String>,
        pub cmdlines: HashMap<u32, Vec<String>>,
        /// Processes told to be forgotten.
        pub ended: Vec<u32>,
        /// Per thread: the step counter its Python frames show.
        pub python_steps: HashMap<u32, xpuscope_probes::python::StepLocal>,
        /// The clock's reading ([`Enrich::clock_ns`]).
        pub now: u64,
    }

    fn frame(module: &str, addr: u64) -> SymFrame {
        SymFrame {
            function: Arc::from(format!("fn_{addr:x}")),
            module: Arc::from(module),
            module_start: 0,
            module_end: 0,
            module_offset: 0,
            rel_pc: addr,
        }
    }

    impl Enrich for FakeEnricher {
        fn kernel_frames(&mut self, addrs: &[u64]) -> Vec<SymFrame> {
            addrs.iter().map(|a| frame("kernel", *a)).collect()
        }
        fn user_frames(&mut self, _tgid: u32, addrs: &[u64]) -> Vec<SymFrame> {
            addrs.iter().map(|a| frame("/bin/app", *a)).collect()
        }
        fn thread_user_frames(
            &mut self,
            tgid: u32,
            tid: u32,
            addrs: &[u64],
        ) -> (Vec<SymFrame>, PyOutcome) {
            let frames = self.user_frames(tgid, addrs);
            match self.python_steps.get(&tid) {
                Some(step) => (frames, PyOutcome::Mixed(Some(*step))),
                None => (frames, PyOutcome::Native),
            }
        }
        fn clock_ns(&self) -> u64 {
            self.now
        }
        fn unwind_user(&mut self, _tgid: u32, _ts: u64, copy: &UserCopy) -> Option<UnwoundUser> {
            // A copy's "unwind" in tests: its ip, then the words of its
            // stack as return addresses up to a 0 (the outermost frame);
            // without a 0 the stack is deeper than the copy.
            let bytes = copy.stack.as_ref().ok()?;
            let mut words = bytes
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
            let mut frames = vec![copy.ip];
            let mut read = 0;
            let truncated = loop {
                read += 8;
                match words.next() {
                    Some(0) => break false,
                    Some(w) => frames.push(w),
                    None => break true,
                }
            };
            Some(UnwoundUser {
                frames,
                truncated,
                stack_bytes_used: read.min(bytes.len() as u64),
            })
        }
        fn remote_string(&mut self, tgid: u32, ptr: u64) -> Result<String, String> {
            self.strings
                .get(&(tgid, ptr))
                .cloned()
                .ok_or_else(|| format!("no string at {ptr:#x}"))
        }
        fn cmdline(&mut self, pid: u32) -> Vec<String> {
            self.cmdlines.get(&pid).cloned().unwrap_or_default()
        }
        fn ppid(&mut self, _pid: u32) -> u32 {
            1
        }
        fn process_forked(&mut self, _child: u32, _parent: u32) {}
        fn process_exec(&mut self, _tgid: u32) {}
        fn process_ended(&mut self, tgid: u32) {
            self.ended.push(tgid);
        }
        fn remember_maps(&mut self, _tgid: u32, _maps: ProcessMaps) {}
    }
}
