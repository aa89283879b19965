//! Byte bounds on what the agent keeps because a traced process handed it
//! something: Python code objects, the CFI of mapped files, the symbol
//! tables read to find an interpreter.
//!
//! The agent runs as root and any local user can become traced, so each
//! such cache is bounded in bytes (not only in entries: one entry's size is
//! the process's choice), per process and overall, and says what it
//! evicted and refused through [`CacheStats`], atomics the agent publishes
//! from another thread. Sizes a file's headers claim are checked against
//! the file's length *and* a cap before anything is allocated: a sparse
//! file makes a huge length free to fake.

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use object::read::{ReadCache, ReadCacheOps, ReadRef};

/// What one cache holds and has let go of, updated as it changes.
#[derive(Debug, Default)]
pub struct CacheStats {
    bytes: AtomicU64,
    peak_bytes: AtomicU64,
    entries: AtomicU64,
    evicted: AtomicU64,
    evicted_bytes: AtomicU64,
    refused: AtomicU64,
}

/// A reading of [`CacheStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheFigures {
    /// Bytes held now, and the most held at any time.
    pub bytes: u64,
    pub peak_bytes: u64,
    /// Entries held now.
    pub entries: u64,
    /// Entries let go of to stay within a bound, and their bytes.
    pub evicted: u64,
    pub evicted_bytes: u64,
    /// Items not kept (never read) because they were larger than their
    /// cap, or than the room a bound left.
    pub refused: u64,
}

impl CacheStats {
    pub fn figures(&self) -> CacheFigures {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheFigures {
            bytes: load(&self.bytes),
            peak_bytes: load(&self.peak_bytes),
            entries: load(&self.entries),
            evicted: load(&self.evicted),
            evicted_bytes: load(&self.evicted_bytes),
            refused: load(&self.refused),
        }
    }

    /// An entry of `bytes` kept.
    pub fn added(&self, bytes: u64) {
        let now = self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes.fetch_max(now, Ordering::Relaxed);
        self.entries.fetch_add(1, Ordering::Relaxed);
    }

    /// Entries dropped because what they describe is gone (a process
    /// exited, a file no longer mapped): not an eviction.
    pub fn dropped(&self, entries: u64, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.entries.fetch_sub(entries, Ordering::Relaxed);
    }

    /// An entry of `bytes` let go of to stay within a bound.
    pub fn evicted(&self, bytes: u64) {
        self.dropped(1, bytes);
        self.evicted.fetch_add(1, Ordering::Relaxed);
        self.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Items not kept, for their size.
    pub fn refused(&self, items: u64) {
        self.refused.fetch_add(items, Ordering::Relaxed);
    }
}

/// A [`ReadRef`] over a [`ReadCache`] that refuses any single read longer
/// than `max` (and notes that it did). `object` sizes its reads of headers
/// and tables from the file's own fields, checked only against the file's
/// length; this puts a cap of the caller's choice on each. (Strings are
/// read piecewise up to a delimiter, at most 4 KiB each, by the cache.)
#[derive(Debug)]
pub(crate) struct CappedRead<'a, R: ReadCacheOps> {
    cache: &'a ReadCache<R>,
    max: u64,
    over: &'a Cell<bool>,
}

impl<R: ReadCacheOps> Clone for CappedRead<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: ReadCacheOps> Copy for CappedRead<'_, R> {}

impl<'a, R: ReadCacheOps> CappedRead<'a, R> {
    pub(crate) fn new(cache: &'a ReadCache<R>, max: u64, over: &'a Cell<bool>) -> Self {
        Self { cache, max, over }
    }
}

impl<'a, R: ReadCacheOps> ReadRef<'a> for CappedRead<'a, R> {
    fn len(self) -> Result<u64, ()> {
        self.cache.len()
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'a [u8], ()> {
        if size > self.max {
            self.over.set(true);
            return Err(());
        }
        self.cache.read_bytes_at(offset, size)
    }

    fn read_bytes_at_until(self, range: Range<u64>, delimiter: u8) -> Result<&'a [u8], ()> {
        self.cache.read_bytes_at_until(range, delimiter)
    }
}

/// Hand-made ELF files for tests of what the agent reads of them.
#[cfg(test)]
pub(crate) mod test_elf {
    use std::path::{Path, PathBuf};

    /// A section: name, type, file offset, size; its bytes are left as
    /// the file has them (zeros, or a hole).
    pub struct Sec<'a> {
        pub name: &'a str,
        pub kind: u32,
        pub offset: u64,
        pub size: u64,
    }

    /// Writes an x86-64 ELF shared object at `path`: one load segment
    /// (file offset 0 at address 0), the sections given, a section name
    /// table, and `len` bytes in all (sparse past what is written: a
    /// section may claim more bytes than the disk holds).
    pub fn write(path: &Path, sections: &[Sec<'_>], len: u64) -> PathBuf {
        let mut names = vec![0u8];
        let mut name_at = Vec::new();
        for s in sections.iter().map(|s| s.name).chain([".shstrtab"]) {
            name_at.push(names.len() as u32);
            names.extend_from_slice(s.as_bytes());
            names.push(0);
        }
        // Header, one program header, the names, then the section headers.
        let names_at = 64 + 56;
        let shoff = (names_at + names.len() as u64).next_multiple_of(8);
        let shnum = sections.len() as u16 + 2;
        let mut out = Vec::new();
        out.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&3u16.to_le_bytes()); // ET_DYN
        out.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes()); // entry
        out.extend_from_slice(&64u64.to_le_bytes()); // phoff
        out.extend_from_slice(&shoff.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // flags
        for half in [64u16, 56, 1, 64, shnum, shnum - 1] {
            out.extend_from_slice(&half.to_le_bytes());
        }
        // PT_LOAD, r-x, offset 0 at address 0.
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&5u32.to_le_bytes());
        for word in [0u64, 0, 0, len, len, 0x1000] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(&names);
        out.resize(shoff as usize, 0);
        out.extend_from_slice(&[0u8; 64]);
        let shstrtab = Sec {
            name: ".shstrtab",
            kind: 3,
            offset: names_at,
            size: names.len() as u64,
        };
        for (s, name) in sections.iter().chain([&shstrtab]).zip(&name_at) {
            out.extend_from_slice(&name.to_le_bytes());
            out.extend_from_slice(&s.kind.to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes()); // flags
            out.extend_from_slice(&s.offset.to_le_bytes()); // addr = offset
            out.extend_from_slice(&s.offset.to_le_bytes());
            out.extend_from_slice(&s.size.to_le_bytes());
            out.extend_from_slice(&[0u8; 8]); // link, info
            out.extend_from_slice(&8u64.to_le_bytes());
            let entsize: u64 = if matches!(s.kind, 2 | 11) { 24 } else { 0 };
            out.extend_from_slice(&entsize.to_le_bytes());
        }
        let file = std::fs::File::create(path).expect("create");
        std::io::Write::write_all(&mut &file, &out).expect("write");
        file.set_len(len.max(out.len() as u64)).expect("set_len");
        path.to_path_buf()
    }

    /// A fresh directory for one test's files.
    pub fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("xpuscope-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_follow_additions_evictions_and_drops() {
        let s = CacheStats::default();
        s.added(100);
        s.added(50);
        s.evicted(100);
        s.refused(2);
        s.dropped(1, 50);
        assert_eq!(
            s.figures(),
            CacheFigures {
                bytes: 0,
                peak_bytes: 150,
                entries: 0,
                evicted: 1,
                evicted_bytes: 100,
                refused: 2,
            }
        );
    }

    #[test]
    fn a_capped_read_refuses_long_reads_and_says_so() {
        let data: Vec<u8> = (0..=255).collect();
        let cache = ReadCache::new(std::io::Cursor::new(data));
        let over = Cell::new(false);
        let r = CappedRead::new(&cache, 16, &over);
        assert_eq!(
            r.read_bytes_at(4, 16),
            Ok(&(4..20).collect::<Vec<u8>>()[..])
        );
        assert!(!over.get());
        assert!(r.read_bytes_at(0, 17).is_err());
        assert!(over.get());
        assert_eq!(r.len(), Ok(256));
    }
}
