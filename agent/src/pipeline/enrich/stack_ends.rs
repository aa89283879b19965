//! How much of a thread's user stack the kernel copies: learned from the
//! thread's unwound stacks.
//!
//! A stack's CFI unwind ends at the thread's outermost frame (`_start`,
//! `clone3`), whose slots lie at the same address for the thread's whole
//! life; so once one of its stacks unwound to that frame, every later one
//! needs the copy only from `sp` up to there, whatever its depth. The
//! kernel copies up to that end ([`xpuscope_common::maps::STACK_ENDS`])
//! instead of a fixed 8 KiB, and skips the frame-pointer walk where the
//! copy holds the whole stack: the two costs of a stack at every switch
//! that grow with the stack copy rather than the frames.
//!
//! The end only grows (a larger one costs bytes, never frames): a stack
//! from another region (a signal's, a coroutine's) at most leaves the
//! thread with full copies. A short copy whose unwind was cut off (the
//! end was learned from a stack that did not reach the real outermost
//! frame) forgets the end, so the next copy is whole again.

use rustc_hash::FxHashMap;
use xpuscope_common::{MAX_STACK_ENDS, USER_STACK_COPY};

/// The kernel's per-thread stack ends (a BPF map in the agent; memory in
/// tests).
pub trait StackEndsMap: Send {
    fn set(&mut self, tid: u32, end: u64) -> Result<(), String>;
    fn remove(&mut self, tid: u32);
}

impl StackEndsMap for crate::kernel::stack_ends::StackEndsMap {
    fn set(&mut self, tid: u32, end: u64) -> Result<(), String> {
        crate::kernel::stack_ends::StackEndsMap::set(self, tid, end).map_err(|e| e.to_string())
    }
    fn remove(&mut self, tid: u32) {
        crate::kernel::stack_ends::StackEndsMap::remove(self, tid);
    }
}

/// One unwound stack of a thread, as the learning needs it.
#[derive(Clone, Copy, Debug)]
pub struct UnwoundCopy {
    pub tid: u32,
    /// The copy's base (`sp` at the sample).
    pub sp: u64,
    /// Bytes the kernel copied.
    pub copied: usize,
    /// Bytes above `sp` the unwind read.
    pub used: u64,
    /// The unwind stopped before the outermost frame.
    pub truncated: bool,
}

/// The learned ends, and the map they are written to.
#[derive(Default)]
pub struct StackEnds {
    map: Option<Box<dyn StackEndsMap>>,
    /// What was written for each thread (the kernel removes a thread's
    /// entry at its exit; [`StackEnds::thread_exited`] drops it here).
    learned: FxHashMap<u32, u64>,
    /// Ends written, and writes that failed.
    pub writes: u64,
    pub write_errors: u64,
}

impl StackEnds {
    pub fn new(map: Box<dyn StackEndsMap>) -> Self {
        Self {
            map: Some(map),
            ..Self::default()
        }
    }

    /// Learns from one unwound stack.
    pub fn unwound(&mut self, u: UnwoundCopy) {
        let Some(map) = self.map.as_mut() else {
            return;
        };
        if u.truncated {
            // A short copy that did not hold the stack: copy it whole again.
            if u.copied < USER_STACK_COPY && self.learned.remove(&u.tid).is_some() {
                map.remove(u.tid);
            }
            return;
        }
        if u.used == 0 {
            return;
        }
        let end = u.sp.saturating_add(u.used);
        if self.learned.get(&u.tid).is_some_and(|&e| e >= end) {
            return;
        }
        if self.learned.len() >= MAX_STACK_ENDS as usize && !self.learned.contains_key(&u.tid) {
            // As many threads as the kernel's LRU map holds: it evicts
            // itself; here, start over rather than grow without bound.
            self.learned.clear();
        }
        match map.set(u.tid, end) {
            Ok(()) => {
                self.learned.insert(u.tid, end);
                self.writes += 1;
            }
            Err(_) => self.write_errors += 1,
        }
    }

    /// Thread `tid` exited: its tid may come back as another thread.
    pub fn thread_exited(&mut self, tid: u32) {
        self.learned.remove(&tid);
    }

    /// Threads with an end learned.
    #[cfg(test)]
    pub fn threads(&self) -> usize {
        self.learned.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Mem(Arc<Mutex<FxHashMap<u32, u64>>>);

    impl StackEndsMap for Mem {
        fn set(&mut self, tid: u32, end: u64) -> Result<(), String> {
            self.0.lock().unwrap().insert(tid, end);
            Ok(())
        }
        fn remove(&mut self, tid: u32) {
            self.0.lock().unwrap().remove(&tid);
        }
    }

    fn stack(tid: u32, sp: u64, copied: usize, used: u64, truncated: bool) -> UnwoundCopy {
        UnwoundCopy {
            tid,
            sp,
            copied,
            used,
            truncated,
        }
    }

    #[test]
    fn a_complete_unwind_sets_the_end_once_and_it_only_grows() {
        let mem = Mem::default();
        let mut e = StackEnds::new(Box::new(mem.clone()));
        e.unwound(stack(7, 0x7000, USER_STACK_COPY, 0x500, false));
        assert_eq!(mem.0.lock().unwrap()[&7], 0x7500);
        // A deeper stack of the same thread ends at the same place: nothing
        // to write.
        e.unwound(stack(7, 0x6800, 2048, 0xd00, false));
        // One that ended lower (another region) does not shrink it.
        e.unwound(stack(7, 0x6000, 2048, 0x100, false));
        assert_eq!(e.writes, 1);
        assert_eq!(mem.0.lock().unwrap()[&7], 0x7500);
        // One reaching higher grows it.
        e.unwound(stack(7, 0x7000, 2048, 0x600, false));
        assert_eq!((e.writes, mem.0.lock().unwrap()[&7]), (2, 0x7600));
    }

    #[test]
    fn a_short_copy_cut_off_forgets_the_end_and_a_full_one_does_not() {
        let mem = Mem::default();
        let mut e = StackEnds::new(Box::new(mem.clone()));
        e.unwound(stack(7, 0x7000, USER_STACK_COPY, 0x500, false));
        // Truncated, but the copy was whole: the stack is deeper than any
        // copy, and the end still stands.
        e.unwound(stack(7, 0x5000, USER_STACK_COPY, 0x2000, true));
        assert!(mem.0.lock().unwrap().contains_key(&7));
        e.unwound(stack(7, 0x6c00, 1024, 0x400, true));
        assert!(mem.0.lock().unwrap().is_empty());
        assert_eq!(e.threads(), 0);
        // Learned again from the next complete unwind.
        e.unwound(stack(7, 0x6c00, USER_STACK_COPY, 0x900, false));
        assert_eq!(mem.0.lock().unwrap()[&7], 0x7500);
    }

    #[test]
    fn an_exited_thread_is_forgotten_so_its_reused_tid_learns_anew() {
        let mem = Mem::default();
        let mut e = StackEnds::new(Box::new(mem.clone()));
        e.unwound(stack(7, 0x7000, USER_STACK_COPY, 0x500, false));
        // The kernel removed its entry at the exit.
        mem.0.lock().unwrap().remove(&7);
        e.thread_exited(7);
        e.unwound(stack(7, 0x3000, USER_STACK_COPY, 0x200, false));
        assert_eq!(mem.0.lock().unwrap()[&7], 0x3200);
    }

    #[test]
    fn without_a_map_nothing_is_learned() {
        let mut e = StackEnds::default();
        e.unwound(stack(7, 0x7000, USER_STACK_COPY, 0x500, false));
        assert_eq!((e.threads(), e.writes), (0, 0));
    }
}
