//! Counters the pipeline keeps and others read: the interpret stage's
//! (the summary, the service's status and metrics) and the byte accounting
//! of the caches traced processes feed. Here, below the pipeline and the
//! sinks, so a sink can read them without importing the pipeline.

use std::sync::Arc;

use serde::Serialize;
use xpuscope_probes::bounds::{CacheFigures, CacheStats};

/// What interpretation counted that no record carries (the rest of the
/// summary is counted from the records themselves).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct InterpretCounters {
    /// Off-CPU stacks taken, those the kernel could not take (in part), and
    /// those whose switch-out was not found.
    pub stacks: u64,
    pub stack_errors: u64,
    pub stacks_unmatched: u64,
    /// Off-CPU stacks whose addresses were seen before in their process:
    /// the symbolized stack was reused, not built again.
    pub stacks_memoized: u64,
    /// User stacks (off-CPU and allocating) whose frames came from the CFI
    /// unwind of the stack copy rather than the frame-pointer walk.
    pub user_stacks_cfi: u64,
    /// Of those, stacks whose unwind stopped early (deeper than the copy).
    pub user_stacks_truncated: u64,
    /// Of those, stacks the kernel copied only up to the thread's learned
    /// stack end, without a frame-pointer walk (see
    /// `pipeline::enrich::stack_ends`).
    pub user_stacks_short_copies: u64,
    /// Of those, stacks taken inside a return-probed call, unwound past it
    /// with the real return address the kernel's trampoline stood for.
    pub user_stacks_past_uretprobes: u64,
    /// Ring bytes of the off-CPU stack records (each in its size class).
    pub stack_record_bytes: u64,
    /// Off-CPU stacks with Python frames interleaved, those whose Python
    /// frames could not be read, and the time spent reading them (ns).
    pub python_stacks: u64,
    pub python_stack_errors: u64,
    pub python_read_ns: u64,
    /// What the caches that traced processes feed held, evicted and
    /// refused (read from the enricher at the end).
    pub caches: CacheReport,

    /// Distinct threads seen.
    pub threads_seen: u64,
    /// Allocating stacks taken, and those the kernel could not take.
    pub alloc_stacks: u64,
    pub alloc_stack_errors: u64,
    /// Allocating stacks not given a site (too many distinct sites).
    pub alloc_sites_over_limit: u64,
    /// Returns whose entry was not seen (attached mid-call, or lost).
    pub returns_without_entry: u64,
    /// Activity records decoded, not copied, not decodable.
    pub activities: u64,
    pub activity_unread: u64,
    pub activity_errors: u64,
    /// Activity records of kinds not drawn (not a loss).
    pub activity_other_kinds: u64,
    /// Records at an address no probe is known at.
    pub unknown_probes: u64,
    /// Calls of the activity iterators (no slice each: their records are
    /// the device work).
    pub cupti_reads: u64,
    pub mspti_reads: u64,
    /// Driver calls made inside a runtime call of their sort, folded into
    /// it (one call, not two; not a loss).
    pub driver_calls_folded: u64,
}

/// The byte accounting of the caches that traced processes feed (Python
/// code objects, files' CFI), shared with whoever reports it: the caches
/// live on the pipeline thread, the figures are read elsewhere.
#[derive(Clone, Debug, Default)]
pub struct CacheCounters {
    pub python: Arc<CacheStats>,
    pub cfi: Arc<CacheStats>,
}

impl CacheCounters {
    pub fn report(&self) -> CacheReport {
        CacheReport {
            python: self.python.figures().into(),
            cfi: self.cfi.figures().into(),
        }
    }
}

/// [`CacheCounters`] read, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheReport {
    pub python: CacheFigure,
    pub cfi: CacheFigure,
}

/// One cache's figures (see `xpuscope_probes::bounds::CacheFigures`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheFigure {
    pub bytes: u64,
    pub peak_bytes: u64,
    pub entries: u64,
    pub evicted: u64,
    pub evicted_bytes: u64,
    pub refused: u64,
}

impl From<CacheFigures> for CacheFigure {
    fn from(f: CacheFigures) -> Self {
        Self {
            bytes: f.bytes,
            peak_bytes: f.peak_bytes,
            entries: f.entries,
            evicted: f.evicted,
            evicted_bytes: f.evicted_bytes,
            refused: f.refused,
        }
    }
}
