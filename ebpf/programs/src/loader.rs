//! The dynamic loader's debugger hook: `_dl_debug_state` in
//! `ld-linux-x86-64.so.2`, which glibc calls (it is `r_debug.r_brk`, where
//! debuggers break to follow loads) before and after every change to a
//! process's link map: at start-up around mapping the program's
//! `DT_NEEDED` libraries, and at every `dlopen` and `dlclose`. A traced
//! process calling it tells the agent to rescan that process's maps now
//! instead of at its next periodic round, so a library `dlopen` just
//! mapped has its probes before the caller's first call.
//!
//! Attached once per loader file for all processes; others are ignored.

use aya_ebpf::{
    bindings::BPF_RB_FORCE_WAKEUP,
    helpers::{bpf_get_current_pid_tgid, bpf_get_smp_processor_id},
    macros::uprobe,
    programs::ProbeContext,
};
use xpuscope_common::{EventKind, LinkMapChange};

use crate::{
    maps::is_target,
    ring::{Ring, now, reserve},
};

#[uprobe]
pub fn loader_link_map(_ctx: ProbeContext) -> u32 {
    try_link_map().unwrap_or(0)
}

fn try_link_map() -> Option<u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    if !is_target(tgid) {
        return Some(0);
    }
    // SAFETY: helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let mut entry = reserve::<LinkMapChange>(Ring::Sched, EventKind::LinkMapChange, cpu, now())?;
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` points into the reserved ring-buffer record.
    unsafe {
        (*rec).tid = tid;
        (*rec).tgid = tgid;
    }
    // Always a wakeup: rare, and the agent acts on it at once (the ring's
    // usual policy would leave it for the reader's next timer round).
    entry.submit(BPF_RB_FORCE_WAKEUP as u64);
    Some(0)
}
