//! User stacks without frame pointers: unwinding a copy of the top of a
//! thread's stack from the CFI of the mapped ELF files.
//!
//! The kernel side copies the registers at the sample (`rip`, `rsp`, `rbp`)
//! and the top of the user stack from `rsp`; this module turns them into
//! return addresses, leaf first, the way `perf record --call-graph dwarf`
//! does. Each frame is unwound from the `.eh_frame` (through
//! `.eh_frame_hdr`) or `.debug_frame` rule for its address; only code the
//! CFI does not cover (no entry, or a file without CFI) unwinds by frame
//! pointer. The rule interpreter is framehop (gimli underneath).
//!
//! Costs, and why they stay small in steady state:
//! - [`Unwinder`] keeps each file's CFI sections once, keyed by path and
//!   inode (a file replaced on disk has a new inode), shared by every
//!   process that maps it; bounded in bytes ([`CfiBounds`]: a section over
//!   256 MiB is refused unread, one process pins at most 512 MiB, the
//!   cache holds at most 1 GiB, evicting files no process uses, least
//!   recently used first). Code whose CFI was refused unwinds by frame
//!   pointer.
//! - [`ProcessUnwinder`] is built per process from its [`ProcessMaps`] (one
//!   framehop module per executable mapping, cheap: sections are shared) and
//!   holds framehop's per-address rule cache, so a return address seen
//!   before costs a hash lookup plus executing its rule.
//!
//! Not covered: code without a file (JIT, `[vdso]`) unwinds by frame
//! pointer; a frame whose caller's slots lie outside the copy ends the
//! stack ([`Unwound::truncated`]).
//!
//! # Measured (release build, this 2-vCPU VM; `tests/tests/unwind.rs`)
//! Stacks of a program built with `-O2 -fomit-frame-pointer`, stopped with
//! ptrace in glibc (nanosleep, a mutex, a condvar, read on a pipe) and
//! inside the real PyPI libnccl 2.21.5 / libcudart 12.9 (a call that the
//! fixture makes block inside the library):
//!
//! | stack | frames | CFI unwind, steady state | frame-pointer walk | stack bytes read |
//! |---|---|---|---|---|
//! | fixture, nanosleep | 10 | 85-103 ns (9-10 ns/frame) | 11-23 ns, 2 frames | 376 |
//! | through libnccl | 15 | 124-125 ns (8 ns/frame) | 10 ns, 1 frame | 808 |
//! | through libcudart | 18 | 136-198 ns (8-11 ns/frame) | 12-17 ns, 1 frame | 2,520 |
//!
//! - Frames: the CFI unwind returns every frame gdb's `bt` shows that has
//!   a return address on the stack, identical addresses, down to `_start`
//!   (gdb adds inlined calls and tail calls it rebuilds from libc's debug
//!   info). Frame pointers alone recover 0 of the fixture's 5-8 functions.
//! - First stack of a process: 1.5-3.6 ms while the mapped files' CFI is
//!   read (once per file: libc, libnccl, libcudart...); a further process
//!   mapping the same files, 4-7 us (its unwinder plus a first stack with
//!   an empty rule cache).
//! - Two runs; ranges are the spread between them.
//! - Steady state means framehop's rule cache is warm (a thread blocked at
//!   the same call site, the common case for off-CPU stacks).

mod elf_cfi;
mod frame_pointer;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _};

pub use elf_cfi::{CfiError, CfiLimits, FileCfi, MAX_SECTION_BYTES, MAX_TEXT_BYTES};
pub use frame_pointer::frame_pointer_walk;

use crate::bounds::CacheStats;
use crate::maps::{MappedFiles, ProcessMaps};

/// The deepest stack returned, as the kernel's `PERF_MAX_STACK_DEPTH`.
pub const MAX_FRAMES: usize = 127;

/// The registers at the sample that unwinding needs on x86-64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// A copy of the user stack: `bytes[0]` is the byte at address `base`
/// (normally the sampled `rsp`).
#[derive(Clone, Copy, Debug)]
pub struct StackCopy<'a> {
    pub base: u64,
    pub bytes: &'a [u8],
}

impl StackCopy<'_> {
    /// The little-endian word at `addr`, if all 8 bytes are in the copy.
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let off = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        let word = self.bytes.get(off..off.checked_add(8)?)?;
        // `get` returned exactly 8 bytes, so the conversion cannot fail.
        Some(u64::from_le_bytes(word.try_into().ok()?))
    }
}

/// An unwound stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unwound {
    /// `frames[0]` is the sampled instruction pointer, then return
    /// addresses, innermost first.
    pub frames: Vec<u64>,
    /// True when the walk stopped early (a read outside the stack copy, a
    /// rule that failed, or [`MAX_FRAMES`]) rather than at the outermost
    /// frame (a CFI entry saying the return address is undefined, as
    /// `_start` and `clone3` do, or a zero return address).
    pub truncated: bool,
    /// Bytes of the stack copy above `rsp` the walk read: how much of the
    /// copy this stack needed (sizes the kernel's copy).
    pub stack_bytes_used: u64,
}

/// Identity of a mapped file for the CFI cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FileKey {
    path: String,
    dev: u64,
    inode: u64,
}

/// The most CFI bytes (sections and `.text`) one process's unwinder may
/// pin: a PyTorch CUDA process maps a few hundred MB of it at most.
pub const CFI_PROCESS_BYTES: u64 = 512 << 20;
/// The most CFI bytes the cache holds for all processes together (a
/// node's ranks share their libraries, each file held once).
pub const CFI_TOTAL_BYTES: u64 = 1 << 30;

/// The CFI cache's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CfiBounds {
    /// The largest CFI section read ([`MAX_SECTION_BYTES`]).
    pub section: u64,
    pub per_process: u64,
    pub total: u64,
}

impl Default for CfiBounds {
    fn default() -> Self {
        Self {
            section: MAX_SECTION_BYTES,
            per_process: CFI_PROCESS_BYTES,
            total: CFI_TOTAL_BYTES,
        }
    }
}

/// A file in the CFI cache.
#[derive(Debug)]
struct CachedFile {
    /// `None`: unreadable, or not read for want of room.
    cfi: Option<Arc<FileCfi>>,
    /// Not read for want of room: tried again when a process asks for it
    /// (room may have been freed since), unlike an unreadable file.
    no_room: bool,
    /// When a process last asked for it (a counter): the least recently
    /// used file goes first.
    used: u64,
}

impl CachedFile {
    fn bytes(&self) -> u64 {
        self.cfi.as_ref().map_or(0, |c| c.bytes())
    }

    /// Held by no process's unwinder, so evicting it frees its bytes.
    fn idle(&self) -> bool {
        self.cfi.as_ref().is_some_and(|c| Arc::strong_count(c) == 1)
    }
}

/// The per-file CFI cache, shared by the per-process unwinders.
///
/// Bounded in bytes: a traced process chooses the files it maps, and a
/// sparse file can claim sections of any size at no cost on disk. A file
/// past the room left once idle files (held by no process) are evicted,
/// least recently used first, is not read, and neither is a file past
/// what its process may pin; its code unwinds by frame pointer.
#[derive(Debug, Default)]
pub struct Unwinder {
    files: HashMap<FileKey, CachedFile>,
    bounds: CfiBounds,
    stats: Arc<CacheStats>,
    /// Bytes of every file held.
    held: u64,
    clock: u64,
}

impl Drop for Unwinder {
    fn drop(&mut self) {
        let entries = self.files.values().filter(|f| f.cfi.is_some()).count();
        self.stats.dropped(entries as u64, self.held);
    }
}

impl Unwinder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache within `bounds`, counting into `stats`.
    pub fn with_bounds(bounds: CfiBounds, stats: Arc<CacheStats>) -> Self {
        Self {
            files: HashMap::new(),
            bounds,
            stats,
            held: 0,
            clock: 0,
        }
    }

    /// Files whose CFI is held (read, or found unreadable).
    pub fn cached_files(&self) -> usize {
        self.files.len()
    }

    /// Bytes of CFI held.
    pub fn cached_bytes(&self) -> u64 {
        self.held
    }

    /// Keeps only the files `keep(path, inode)` says are still mapped by
    /// some process (the cache would otherwise hold every binary an
    /// always-on agent ever unwound).
    pub fn retain_files(&mut self, keep: impl Fn(&str, u64, u64) -> bool) {
        let (held, stats) = (&mut self.held, &self.stats);
        self.files.retain(|k, f| {
            let kept = keep(&k.path, k.dev, k.inode);
            if !kept && f.cfi.is_some() {
                *held -= f.bytes();
                stats.dropped(1, f.bytes());
            }
            kept
        });
    }

    /// An unwinder for one process, from its mappings, each file opened
    /// as `files` says (a live process's own files, wherever its root). A file
    /// that cannot be read is remembered as such and its code unwinds by
    /// frame pointer: one unreadable library must not cost every stack.
    pub fn process(&mut self, maps: &ProcessMaps, files: MappedFiles) -> ProcessUnwinder {
        let mut unwinder = UnwinderX86_64::new();
        let mut modules = 0;
        let mut pinned: Vec<Arc<FileCfi>> = Vec::new();
        let mut pinned_bytes = 0;
        for m in maps
            .mappings()
            .iter()
            .filter(|m| m.is_executable() && m.is_file())
        {
            let key = FileKey {
                path: m.path.clone(),
                dev: m.dev,
                inode: m.inode,
            };
            self.clock += 1;
            let room = self.bounds.per_process.saturating_sub(pinned_bytes);
            let cfi = match self.files.get_mut(&key) {
                Some(f) if !f.no_room => {
                    f.used = self.clock;
                    f.cfi.clone()
                }
                _ => self.load(key, &files.path(m), room),
            };
            let Some(cfi) = cfi else { continue };
            if !pinned.iter().any(|p| Arc::ptr_eq(p, &cfi)) {
                if pinned_bytes + cfi.bytes() > self.bounds.per_process {
                    // Read for another process, over this one's share.
                    self.stats.refused(1);
                    continue;
                }
                pinned_bytes += cfi.bytes();
                pinned.push(cfi.clone());
            }
            let Some(bias) = cfi.load_bias(m.start, m.offset) else {
                continue;
            };
            unwinder.add_module(module_for(&m.path, m.start..m.end, bias, &cfi));
            modules += 1;
        }
        ProcessUnwinder {
            unwinder,
            cache: CacheX86_64::new(),
            modules,
            _pinned: pinned,
        }
    }

    /// Reads a file into the cache, within `room` (what its process may
    /// still pin) and the cache's own bound, evicting idle files for it.
    fn load(&mut self, key: FileKey, path: &Path, room: u64) -> Option<Arc<FileCfi>> {
        let idle: u64 = self
            .files
            .values()
            .filter(|f| f.idle())
            .map(CachedFile::bytes)
            .sum();
        let free = self.bounds.total.saturating_sub(self.held - idle);
        let limits = CfiLimits {
            section: self.bounds.section,
            room: room.min(free),
            ..CfiLimits::default()
        };
        let (cfi, no_room) = match FileCfi::read_limited(path, &limits) {
            Ok(cfi) => {
                self.stats.refused(cfi.refused());
                let bytes = cfi.bytes();
                self.evict_for(bytes);
                self.held += bytes;
                self.stats.added(bytes);
                (Some(Arc::new(cfi)), false)
            }
            Err(CfiError::TooLarge { .. }) => {
                self.stats.refused(1);
                (None, true)
            }
            Err(CfiError::HeadersTooLarge { .. }) => {
                self.stats.refused(1);
                (None, false)
            }
            Err(_) => (None, false),
        };
        let file = CachedFile {
            cfi: cfi.clone(),
            no_room,
            used: self.clock,
        };
        if let Some(old) = self.files.insert(key, file)
            && old.cfi.is_some()
        {
            self.held -= old.bytes();
            self.stats.dropped(1, old.bytes());
        }
        cfi
    }

    /// Evicts idle files, least recently used first, until `bytes` more
    /// fit the total bound (or none is idle).
    fn evict_for(&mut self, bytes: u64) {
        while self.held + bytes > self.bounds.total {
            let Some(key) = self
                .files
                .iter()
                .filter(|(_, f)| f.idle())
                .min_by_key(|(_, f)| f.used)
                .map(|(k, _)| k.clone())
            else {
                return;
            };
            if let Some(f) = self.files.remove(&key) {
                self.held -= f.bytes();
                self.stats.evicted(f.bytes());
            }
        }
    }
}

fn module_for(
    name: &str,
    avma: std::ops::Range<u64>,
    bias: u64,
    cfi: &FileCfi,
) -> Module<Arc<[u8]>> {
    let info = ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: cfi.text_svma.clone(),
        text: cfi.text.clone(),
        got_svma: cfi.got.clone(),
        eh_frame_svma: cfi.eh_frame.as_ref().map(|s| s.svma.clone()),
        eh_frame: cfi.eh_frame.as_ref().map(|s| s.data.clone()),
        eh_frame_hdr_svma: cfi.eh_frame_hdr.as_ref().map(|s| s.svma.clone()),
        eh_frame_hdr: cfi.eh_frame_hdr.as_ref().map(|s| s.data.clone()),
        debug_frame: cfi.debug_frame.clone(),
        ..Default::default()
    };
    Module::new(name.to_string(), avma, bias, info)
}

/// Unwinds the stacks of one process (one snapshot of its mappings: build
/// a new one when the process maps or unmaps code).
pub struct ProcessUnwinder {
    unwinder: UnwinderX86_64<Arc<[u8]>>,
    cache: CacheX86_64,
    modules: usize,
    /// The files its modules read from: what the CFI cache must not count
    /// as idle (their bytes stay in memory while this unwinder lives).
    _pinned: Vec<Arc<FileCfi>>,
}

impl ProcessUnwinder {
    /// Executable file mappings that have unwind tables.
    pub fn modules(&self) -> usize {
        self.modules
    }

    /// Unwinds one stack: frame 0 is `regs.ip`, then return addresses,
    /// leaf first, at most `max_frames` (capped at [`MAX_FRAMES`]).
    pub fn unwind(&mut self, regs: UserRegs, stack: &StackCopy<'_>, max_frames: usize) -> Unwound {
        let max_frames = max_frames.min(MAX_FRAMES);
        let mut frames = Vec::with_capacity(32);
        let mut highest_read = None::<u64>;
        let mut read = |addr: u64| {
            let word = stack.read_u64(addr).ok_or(())?;
            highest_read = highest_read.max(Some(addr));
            Ok(word)
        };
        let mut uregs = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
        let mut address = FrameAddress::from_instruction_pointer(regs.ip);
        let truncated = loop {
            if frames.len() >= max_frames {
                break true;
            }
            frames.push(address.address());
            match self
                .unwinder
                .unwind_frame(address, &mut uregs, &mut self.cache, &mut read)
            {
                Ok(Some(ret)) if ret != 0 => match FrameAddress::from_return_address(ret) {
                    Some(next) => address = next,
                    None => break false,
                },
                // The CFI marks the outermost frame (or the return address
                // is 0): the stack is complete.
                Ok(_) => break false,
                Err(_) => break true,
            }
        };
        let stack_bytes_used = highest_read.map_or(0, |a| a + 8 - stack.base);
        Unwound {
            frames,
            truncated,
            stack_bytes_used,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn words(ws: &[u64]) -> Vec<u8> {
        ws.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn stack_copy_reads_only_whole_words_inside_the_copy() {
        let bytes = words(&[1, 2]);
        let s = StackCopy {
            base: 0x1000,
            bytes: &bytes,
        };
        assert_eq!(s.read_u64(0x1000), Some(1));
        assert_eq!(s.read_u64(0x1008), Some(2));
        assert_eq!(s.read_u64(0x1009), None, "straddles the end");
        assert_eq!(s.read_u64(0xff8), None, "below rsp");
        assert_eq!(s.read_u64(u64::MAX), None);
    }

    #[test]
    fn frame_pointer_walk_follows_the_rbp_chain_and_stops_where_it_leaves_the_copy() {
        // rsp = 0x1000; frame A's rbp at 0x1010 -> (saved rbp 0x1020, ret
        // 0xa1); frame B at 0x1020 -> (saved rbp 0x9000: outside, ret 0xb2).
        let bytes = words(&[0, 0, 0x1020, 0xa1, 0x9000, 0xb2]);
        let s = StackCopy {
            base: 0x1000,
            bytes: &bytes,
        };
        let regs = UserRegs {
            ip: 0x55,
            sp: 0x1000,
            bp: 0x1010,
        };
        assert_eq!(frame_pointer_walk(regs, &s, 127), vec![0x55, 0xa1, 0xb2]);
        assert_eq!(frame_pointer_walk(regs, &s, 2), vec![0x55, 0xa1]);
        // A chain that does not grow upwards ends the walk.
        let looping = words(&[0x1000, 0xa1]);
        let s = StackCopy {
            base: 0x1000,
            bytes: &looping,
        };
        let regs = UserRegs { bp: 0x1000, ..regs };
        assert_eq!(frame_pointer_walk(regs, &s, 127), vec![0x55, 0xa1]);
    }

    #[test]
    fn a_process_without_files_unwinds_by_frame_pointer() {
        // No mapping has a file, so framehop has no module: its fallback
        // rule is the frame-pointer walk.
        let maps = ProcessMaps::parse("1000-2000 r-xp 00000000 00:00 0 [anon]\n");
        let mut unwinder = Unwinder::new();
        let mut process = unwinder.process(&maps, MappedFiles::Root(Path::new("/")));
        assert_eq!(process.modules(), 0);
        let bytes = words(&[0, 0, 0x1020, 0xa1, 0, 0]);
        let s = StackCopy {
            base: 0x1000,
            bytes: &bytes,
        };
        let regs = UserRegs {
            ip: 0x1500,
            sp: 0x1000,
            bp: 0x1010,
        };
        let u = process.unwind(regs, &s, 127);
        assert_eq!(u.frames, vec![0x1500, 0xa1]);
    }

    use crate::bounds::test_elf::{Sec, dir, write};

    const PROGBITS: u32 = 1;

    /// A library whose `.eh_frame` is `size` bytes at offset 8192, in a
    /// file of `len` bytes.
    fn library(path: &Path, size: u64, len: u64) -> PathBuf {
        write(
            path,
            &[
                Sec {
                    name: ".eh_frame_hdr",
                    kind: PROGBITS,
                    offset: 4096,
                    size: 64,
                },
                Sec {
                    name: ".eh_frame",
                    kind: PROGBITS,
                    offset: 8192,
                    size,
                },
            ],
            len,
        )
    }

    #[test]
    fn a_cfi_section_over_its_cap_is_refused_unread() {
        let d = dir("cfi-cap");
        // 4 GiB of .eh_frame claimed in a sparse file that long: nothing on
        // disk, checked against the file's length only, it would be read.
        let huge = library(&d.join("libhuge.so"), 4 << 30, (4 << 30) + 8192);
        let cfi = FileCfi::read(&huge).expect("the headers read");
        assert!(cfi.eh_frame.is_none(), "read past its cap");
        assert_eq!(cfi.refused(), 1);
        assert_eq!(cfi.bytes(), 64, ".eh_frame_hdr alone");
        // Claimed past the file's end: absent, as before (not a refusal).
        let cut = library(&d.join("libcut.so"), 4096, 8192);
        let cfi = FileCfi::read(&cut).expect("read");
        assert!(cfi.eh_frame.is_none() && cfi.refused() == 0);
        // Within its cap and the file: read.
        let fine = library(&d.join("libfine.so"), 4096, 8192 + 4096);
        let cfi = FileCfi::read(&fine).expect("read");
        assert_eq!(cfi.eh_frame.as_ref().map(|s| s.data.len()), Some(4096));
        assert_eq!(cfi.bytes(), 4096 + 64);
        // More than the room left: not read at all.
        let small_room = CfiLimits {
            room: 4096,
            ..CfiLimits::default()
        };
        assert!(matches!(
            FileCfi::read_limited(&fine, &small_room),
            Err(CfiError::TooLarge { bytes: 4160, .. })
        ));
        // 2^28 section headers (16 GiB; extended numbering: e_shnum 0, the
        // count in section 0's sh_size) in a sparse file that long.
        let many = library(&d.join("libmany.so"), 4096, 16 << 30);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&many)
            .unwrap();
        let mut shoff = [0u8; 8];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut shoff, 40).unwrap();
        let shoff = u64::from_le_bytes(shoff);
        std::os::unix::fs::FileExt::write_all_at(&file, &0u16.to_le_bytes(), 60).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &(1u64 << 28).to_le_bytes(), shoff + 32)
            .unwrap();
        assert!(matches!(
            FileCfi::read(&many),
            Err(CfiError::HeadersTooLarge { .. })
        ));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_cfi_cache_evicts_idle_files_and_refuses_past_its_bounds() {
        let d = dir("cfi-bounds");
        let files: Vec<PathBuf> = (1..=4)
            .map(|i| library(&d.join(format!("lib{i}.so")), 936, 8192 + 936))
            .collect();
        // Each file holds 1,000 bytes (936 + the 64 of .eh_frame_hdr).
        assert_eq!(FileCfi::read(&files[0]).unwrap().bytes(), 1000);
        let maps = |which: &[usize]| {
            let text: String = which
                .iter()
                .map(|&i| {
                    let start = 0x10_0000 * (i as u64 + 1);
                    format!(
                        "{start:x}-{:x} r-xp 00000000 08:01 {} {}\n",
                        start + 0x1000,
                        i + 1,
                        files[i].display()
                    )
                })
                .collect();
            ProcessMaps::parse(&text)
        };
        let stats = Arc::new(CacheStats::default());
        let bounds = CfiBounds {
            section: 1 << 20,
            per_process: 2500,
            total: 3000,
        };
        let mut u = Unwinder::with_bounds(bounds, stats.clone());
        let root = Path::new("/");
        let a = u.process(&maps(&[0, 1]), MappedFiles::Root(root));
        assert_eq!(a.modules(), 2);
        assert_eq!(stats.figures().bytes, 2000);
        // A third file is over one process's share: not read.
        let a3 = u.process(&maps(&[0, 1, 2]), MappedFiles::Root(root));
        assert_eq!(a3.modules(), 2);
        assert_eq!((stats.figures().bytes, stats.figures().refused), (2000, 1));
        drop(a3);
        // Another process: one more file fits the total, the next does not
        // (the first two are still in use).
        let b = u.process(&maps(&[2, 3]), MappedFiles::Root(root));
        assert_eq!(b.modules(), 1);
        assert_eq!((stats.figures().bytes, stats.figures().refused), (3000, 2));
        // The first process gone, its files are idle: the least recently
        // used one is evicted for a file that now fits.
        drop(a);
        let c = u.process(&maps(&[3]), MappedFiles::Root(root));
        assert_eq!(c.modules(), 1);
        let f = stats.figures();
        assert_eq!(
            (f.bytes, f.entries, f.evicted, f.evicted_bytes, f.peak_bytes),
            (3000, 3, 1, 1000, 3000)
        );
        assert_eq!(u.cached_bytes(), 3000);
        drop((b, c));
        drop(u);
        assert_eq!(stats.figures().bytes, 0);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unreadable_files_are_remembered_not_retried() {
        let maps = ProcessMaps::parse("1000-2000 r-xp 00000000 08:01 42 /nonexistent/libgone.so\n");
        let mut unwinder = Unwinder::new();
        let process = unwinder.process(&maps, MappedFiles::Root(Path::new("/")));
        assert_eq!(process.modules(), 0);
        assert_eq!(unwinder.cached_files(), 1);
    }

    #[test]
    fn sections_read_straight_from_the_file_equal_the_whole_files_sections() {
        // Every code file this process maps (the test binary, libc, ld.so):
        // the sections FileCfi reads at their file offsets are byte for
        // byte what a parse of the whole file (read into memory) holds.
        use object::{Object, ObjectSection};
        let maps = ProcessMaps::read(std::process::id()).expect("own maps");
        let mut paths: Vec<&str> = maps
            .mappings()
            .iter()
            .filter(|m| m.is_executable() && m.path.starts_with('/'))
            .map(|m| m.path.as_str())
            .collect();
        paths.dedup();
        assert!(paths.len() >= 2, "{paths:?}");
        for path in paths {
            let cfi = FileCfi::read(Path::new(path)).expect("read");
            let whole = std::fs::read(path).expect("read whole");
            let elf = object::File::parse(&*whole).expect("parse");
            // FileCfi holds no empty section.
            let of = |name: &str| {
                elf.section_by_name(name)
                    .map(|s| s.uncompressed_data().expect("data").into_owned())
                    .filter(|d| !d.is_empty())
            };
            let ours = |s: &Option<elf_cfi::Section>| s.as_ref().map(|s| s.data.to_vec());
            assert_eq!(ours(&cfi.eh_frame), of(".eh_frame"), "{path} .eh_frame");
            assert_eq!(
                ours(&cfi.eh_frame_hdr),
                of(".eh_frame_hdr"),
                "{path} .eh_frame_hdr"
            );
            assert_eq!(
                cfi.debug_frame.as_ref().map(|d| d.to_vec()),
                of(".debug_frame"),
                "{path} .debug_frame"
            );
            assert_eq!(
                cfi.text.as_ref().map(|d| d.to_vec()),
                of(".text"),
                "{path} .text"
            );
            let text = elf.section_by_name(".text").expect(".text");
            assert_eq!(
                cfi.text_svma,
                Some(text.address()..text.address() + text.size()),
                "{path}"
            );
        }
    }

    fn corpus(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fuzz/corpus/cfi")
            .join(name)
    }

    #[test]
    fn a_code_mapping_takes_the_code_segments_bias_where_segments_share_a_page() {
        // Its code segment at file offset 0, its data segment at 0x390
        // (vaddr 0x1390): both in the file's first page.
        let cfi = FileCfi::read(&corpus("eh-frame")).expect("read");
        assert_eq!(cfi.load_bias(0x7f00_0000_0000, 0), Some(0x7f00_0000_0000));
    }

    #[test]
    fn a_section_past_the_end_of_the_address_space_is_absent() {
        // `.text` and `.eh_frame` at 0xffff_ffff_ffff_ffc0, longer than
        // the 64 bytes left.
        let cfi = FileCfi::read(&corpus("crash-section-address-overflow")).expect("read");
        assert!(cfi.text_svma.is_none() && cfi.eh_frame.is_none());
        assert!(cfi.eh_frame_hdr.is_some());
    }

    #[test]
    fn an_empty_eh_frame_leaves_the_debug_frame_in_use() {
        let cfi = FileCfi::read(&corpus("debug-frame")).expect("read");
        assert!(cfi.eh_frame.is_none() && cfi.eh_frame_hdr.is_none());
        assert!(cfi.debug_frame.is_some() && cfi.has_cfi());
        // Compressed, it is not read (object is built without
        // decompression): frame pointers then.
        let zlib = FileCfi::read(&corpus("debug-frame-zlib")).expect("read");
        assert!(!zlib.has_cfi());
    }

    #[test]
    fn this_test_binary_has_cfi_and_a_load_bias_that_matches_its_mapping() {
        let maps = ProcessMaps::read(std::process::id()).expect("own maps");
        let exe = std::env::current_exe().expect("current_exe");
        let exe = exe.to_string_lossy();
        let m = maps
            .mappings()
            .iter()
            .find(|m| m.is_executable() && m.path == exe)
            .expect("the test binary's code is mapped");
        let cfi = FileCfi::read(Path::new(&m.path)).expect("read own CFI");
        assert!(cfi.has_cfi());
        // This function's address, through the bias, is inside .text.
        let here = this_test_binary_has_cfi_and_a_load_bias_that_matches_its_mapping as *const ()
            as usize as u64;
        let bias = cfi.load_bias(m.start, m.offset).expect("bias");
        let text = cfi.text_svma.as_ref().expect(".text");
        assert!(cfi.text.is_some(), "a test binary's code is under the cap");
        assert_eq!(
            cfi.text.as_ref().map(|t| t.len() as u64),
            Some(text.end - text.start),
            "the whole section"
        );
        // Over the cap: where the code is stays known, its bytes are not
        // read, the CFI is.
        let no_text = CfiLimits {
            text: 0,
            ..CfiLimits::default()
        };
        let capped = FileCfi::read_limited(Path::new(&m.path), &no_text).expect("read");
        assert_eq!(capped.text_svma.as_ref(), Some(text));
        assert!(capped.text.is_none() && capped.has_cfi());
        assert_eq!(
            capped.eh_frame.as_ref().map(|s| s.data.len()),
            cfi.eh_frame.as_ref().map(|s| s.data.len())
        );
        assert!(
            text.contains(&(here - bias)),
            "{here:#x} - {bias:#x} in {text:#x?}"
        );
    }
}
