//! User stacks from the code's CFI: the kernel copies each stacked
//! thread's registers and the top of its user stack ([`UserCopy`]); here
//! that copy is unwound with `xpuscope_probes::unwind` (framehop over the
//! mapped files' `.eh_frame`/`.debug_frame`), so code built without frame
//! pointers (glibc, libnccl, libcudart, most training binaries) keeps every
//! caller.
//!
//! One [`ProcessUnwinder`] per process, built from its maps when its first
//! stack arrives and dropped with the process (or at exec); the files' CFI
//! is shared by all processes ([`Unwinder`]). A process that maps new code
//! (`dlopen`) gets a new one when a stack taken after its maps were read
//! leads into code those maps do not have.

use std::collections::HashMap;
use std::sync::Arc;

use xpuscope_probes::bounds::CacheStats;
use xpuscope_probes::maps::{MappedFiles, ProcessMaps};
use xpuscope_probes::unwind::{CfiBounds, ProcessUnwinder, StackCopy, Unwinder, UserRegs};

use super::UnwoundUser;
use crate::events::UserCopy;

/// Deepest stack kept (the frame-pointer walk keeps 64 as well).
const MAX_FRAMES: usize = xpuscope_common::MAX_STACK_DEPTH;

/// Least time between two re-reads of a process's maps for a stack that
/// leads into unmapped code.
const MISS_REREAD_NS: u64 = 1_000_000_000;

struct ProcessEntry {
    unwinder: ProcessUnwinder,
    maps: ProcessMaps,
    /// CLOCK_BOOTTIME ns when `maps` was read.
    read_at: u64,
}

/// The CFI unwinders of the traced processes.
#[derive(Default)]
pub struct CfiUnwind {
    files: Unwinder,
    processes: HashMap<u32, ProcessEntry>,
    /// Stacks unwound from the CFI, and those left to frame pointers.
    pub unwound: u64,
    pub fallbacks: u64,
}

/// CLOCK_BOOTTIME now, in ns (the clock of the records' timestamps).
fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec passed.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl CfiUnwind {
    /// A CFI cache within the default bounds, counting into `stats`.
    pub fn with_stats(stats: Arc<CacheStats>) -> Self {
        Self {
            files: Unwinder::with_bounds(CfiBounds::default(), stats),
            ..Self::default()
        }
    }

    /// Frames of the thread of `tgid` whose copy was taken at `ts` (the
    /// sampled ip, then return addresses, leaf first), or `None` when no
    /// unwind is possible (nothing copied, the process gone before its
    /// maps were read): the caller keeps the frame-pointer stack.
    pub fn unwind(&mut self, tgid: u32, ts: u64, copy: &UserCopy) -> Option<UnwoundUser> {
        let Ok(bytes) = &copy.stack else {
            self.fallbacks += 1;
            return None;
        };
        if copy.ip == 0 || bytes.is_empty() {
            self.fallbacks += 1;
            return None;
        }
        let regs = UserRegs {
            ip: copy.ip,
            sp: copy.sp,
            bp: copy.bp,
        };
        let stack = StackCopy {
            base: copy.sp,
            bytes,
        };
        // Maps read before the stack was taken may lack code it runs. A
        // library mapped by the loader is announced (`link_map_changed`);
        // this catches the rest (a plain mmap of code), at most once a
        // second per process: a walk that goes astray in code without CFI
        // must not re-read the maps at every stack.
        let stale = |e: &ProcessEntry, addr: u64| {
            e.maps.find(addr).is_none() && ts > e.read_at.saturating_add(MISS_REREAD_NS)
        };
        if self.processes.get(&tgid).is_none_or(|e| stale(e, copy.ip)) {
            self.rebuild(tgid);
        }
        let entry = self.processes.get_mut(&tgid)?;
        let mut unwound = entry.unwinder.unwind(regs, &stack, MAX_FRAMES);
        // A walk that ended early in code the maps do not know: read them
        // again once (a library mapped since) and retry.
        if unwound.truncated
            && unwound
                .frames
                .last()
                .is_some_and(|&ret| stale(entry, ret.saturating_sub(1)))
        {
            self.rebuild(tgid);
            let entry = self.processes.get_mut(&tgid)?;
            unwound = entry.unwinder.unwind(regs, &stack, MAX_FRAMES);
        }
        self.unwound += 1;
        Some(UnwoundUser {
            frames: unwound.frames,
            truncated: unwound.truncated,
            stack_bytes_used: unwound.stack_bytes_used,
        })
    }

    fn rebuild(&mut self, tgid: u32) {
        let read_at = boottime_ns();
        let Ok(maps) = ProcessMaps::read(tgid) else {
            return;
        };
        // The process's own files, wherever its root (a container's).
        let unwinder = self.files.process(&maps, MappedFiles::Process(tgid));
        self.processes.insert(
            tgid,
            ProcessEntry {
                unwinder,
                maps,
                read_at,
            },
        );
    }

    /// `tgid`'s loader changed its link map (start-up, `dlopen`,
    /// `dlclose`): its next stack gets an unwinder from fresh maps.
    pub fn link_map_changed(&mut self, tgid: u32) {
        self.processes.remove(&tgid);
    }

    /// `tgid` ended or exec'd: its unwinder describes nothing now.
    pub fn forget_process(&mut self, tgid: u32) {
        if self.processes.remove(&tgid).is_none() {
            return;
        }
        // Files no remaining process maps leave the CFI cache.
        let mapped: std::collections::HashSet<(&str, u64, u64)> = self
            .processes
            .values()
            .flat_map(|e| e.maps.mappings().iter())
            .filter(|m| m.is_executable() && m.is_file())
            .map(|m| (m.path.as_str(), m.dev, m.inode))
            .collect();
        self.files
            .retain_files(|path, dev, inode| mapped.contains(&(path, dev, inode)));
    }

    /// Files whose CFI is cached (tests).
    #[cfg(test)]
    pub fn cached_files(&self) -> usize {
        self.files.cached_files()
    }

    /// Processes with an unwinder (tests).
    #[cfg(test)]
    pub fn processes(&self) -> usize {
        self.processes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test's own stack, copied the way the kernel does: registers of
    /// a known point and the bytes above its stack pointer.
    #[inline(never)]
    fn own_copy() -> UserCopy {
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers, touches no memory.
        unsafe {
            std::arch::asm!(
                "lea {ip}, [rip]",
                "mov {sp}, rsp",
                "mov {bp}, rbp",
                ip = out(reg) ip,
                sp = out(reg) sp,
                bp = out(reg) bp,
            );
        }
        // Up to 8 KiB, as the kernel copies, but not past the end of this
        // thread's stack mapping (a test thread's frames are few).
        let maps = ProcessMaps::read(std::process::id()).expect("own maps");
        let end = maps.find(sp).expect("the stack is mapped").end;
        let mut bytes = vec![0u8; (end - sp).min(8192) as usize];
        // SAFETY: the live stack from our own sp to at most its mapping's end.
        unsafe { std::ptr::copy_nonoverlapping(sp as *const u8, bytes.as_mut_ptr(), bytes.len()) };
        UserCopy {
            ip,
            sp,
            bp,
            stack: Ok(bytes),
            restored_returns: 0,
        }
    }

    #[inline(never)]
    fn caller_of_own_copy() -> (UserCopy, u64) {
        let c = own_copy();
        (c, caller_of_own_copy as *const () as usize as u64)
    }

    #[test]
    fn unwinds_own_stack_through_the_caller_and_forgets_the_process() {
        let pid = std::process::id();
        let stats = Arc::new(CacheStats::default());
        let mut u = CfiUnwind::with_stats(stats.clone());
        let (copy, caller) = caller_of_own_copy();
        let frames = u.unwind(pid, 0, &copy).expect("unwound").frames;
        assert_eq!(frames[0], copy.ip);
        // The return address into caller_of_own_copy is found, whatever
        // this build's frame pointers.
        assert!(
            frames[1..].iter().any(|&r| r > caller && r < caller + 4096),
            "{frames:#x?} lacks a return into {caller:#x}"
        );
        assert!(frames.len() > 3, "{frames:#x?}");
        assert_eq!(u.processes(), 1);
        assert!(u.cached_files() > 0, "the test binary's CFI is cached");
        let held = stats.figures();
        assert!(held.bytes > 0 && held.entries > 0, "{held:?}");
        u.forget_process(pid);
        assert_eq!(u.processes(), 0);
        assert_eq!(u.cached_files(), 0, "no process maps them: the CFI goes");
        let after = stats.figures();
        assert_eq!((after.bytes, after.entries, after.evicted), (0, 0, 0));
    }

    #[test]
    fn no_copy_means_the_frame_pointer_stack_stays() {
        let mut u = CfiUnwind::default();
        let copy = UserCopy {
            ip: 0x1000,
            sp: 0x2000,
            bp: 0,
            stack: Err(-14),
            restored_returns: 0,
        };
        assert_eq!(u.unwind(std::process::id(), 0, &copy), None);
        assert_eq!(u.fallbacks, 1);
        assert_eq!(u.processes(), 0, "nothing built for nothing to unwind");
    }
}
