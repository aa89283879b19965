//! Ring-buffer plumbing: reserve (counting failures) and submit with a
//! wakeup policy that keeps the agent from tracing itself into a storm.

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::bpf_ktime_get_boot_ns,
    maps::{RingBuf, ring_buf::RingBufEntry},
};
use xpuscope_common::{Config, EventHeader, EventKind};

use crate::maps::{BYSTANDER_EVENTS, DEVICE_EVENTS, EVENTS, LAST_WAKEUP, count_drop};

/// Which ring a record goes to.
#[derive(Clone, Copy)]
pub enum Ring {
    /// Scheduler and process records.
    Sched = 0,
    /// Device-library call records.
    Device = 1,
    /// Switches where neither task is traced.
    Bystander = 2,
}

impl Ring {
    #[inline(always)]
    fn map(self) -> &'static RingBuf {
        match self {
            Ring::Sched => &EVENTS,
            Ring::Device => &DEVICE_EVENTS,
            Ring::Bystander => &BYSTANDER_EVENTS,
        }
    }

    #[inline(always)]
    fn wakeup_bytes(self, config: &Config) -> u64 {
        match self {
            Ring::Sched => config.wakeup_bytes,
            Ring::Device => config.device_wakeup_bytes,
            Ring::Bystander => config.bystander_wakeup_bytes,
        }
    }
}

/// Reserves a record of type `T` (whose first field is an [`EventHeader`])
/// in `ring` and fills the header; `None` (counted as a drop of `kind`) if
/// full.
#[inline(always)]
pub fn reserve<T: 'static>(
    ring: Ring,
    kind: EventKind,
    cpu: u32,
    ts: u64,
) -> Option<RingBufEntry<T>> {
    match ring.map().reserve::<T>(0) {
        Some(mut entry) => {
            let header = entry.as_mut_ptr() as *mut EventHeader;
            // SAFETY: every record type starts with an EventHeader (repr(C)),
            // and the entry is at least that large.
            unsafe {
                (*header).kind = kind as u32;
                (*header).cpu = cpu;
                (*header).ts = ts;
            }
            Some(entry)
        }
        None => {
            count_drop(kind as u32);
            None
        }
    }
}

/// Least time between two wakeups forced by one CPU.
const WAKEUP_GAP_NS: u64 = 1_000_000;

/// Submits a record reserved by [`reserve`] in `ring`, waking the reader only once
/// enough data is waiting, and then at most once a millisecond per CPU;
/// the reader also drains on a short timer. (A forced wakeup costs the
/// submitting CPU several microseconds: forcing one per record while a
/// reader lags made every record that expensive.)
///
/// The per-CPU time check comes first and reuses the record's own
/// timestamp: most records are submitted within a millisecond of this
/// CPU's last wakeup and then cost neither a fill query nor a clock read.
#[inline(always)]
pub fn submit<T>(ring: Ring, entry: RingBufEntry<T>, config: &Config) {
    // SAFETY: `reserve` wrote the header at the start of the record.
    let ts = unsafe { (*(entry.as_ptr() as *const EventHeader)).ts };
    entry.submit(submit_flags(ring, config, ts));
}

#[inline(always)]
fn submit_flags(ring: Ring, config: &Config, ts: u64) -> u64 {
    let Some(last) = LAST_WAKEUP.get_ptr_mut(ring as u32) else {
        return BPF_RB_FORCE_WAKEUP as u64;
    };
    // SAFETY: this CPU's slot; a race with a preempted program on the same
    // CPU at worst forces one more wakeup or skips one (the timer drains).
    unsafe {
        if ts.wrapping_sub(*last) < WAKEUP_GAP_NS {
            return BPF_RB_NO_WAKEUP as u64;
        }
        if ring.map().query(BPF_RB_AVAIL_DATA as u64) < ring.wakeup_bytes(config) {
            return BPF_RB_NO_WAKEUP as u64;
        }
        *last = ts;
    }
    BPF_RB_FORCE_WAKEUP as u64
}

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_boot_ns() }
}
