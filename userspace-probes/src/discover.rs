//! Which catalog libraries a process has mapped, and what changed since the
//! last look.
//!
//! The agent rescans `/proc/PID/maps` (at attach, after `dlopen`-heavy
//! phases, on a timer) and [`diff`]s the result: a library loaded later is
//! `added` (attach probes), one unloaded is `removed` (detach), and one whose
//! file was swapped for a copy at a new inode (a package upgrade, a container
//! layer) or remapped at a new address is `replaced`: existing probes get no
//! hits on a new inode, and probe addresses move with a new base.
//!
//! ```
//! use xpuscope_probes::{discover, maps::ProcessMaps};
//! let maps = ProcessMaps::parse(
//!     "7f0000000000-7f0000010000 r--p 00000000 fe:01 42 /venv/nvidia/nccl/lib/libnccl.so.2\n\
//!      7f0000010000-7f0000090000 r-xp 00010000 fe:01 42 /venv/nvidia/nccl/lib/libnccl.so.2\n",
//! );
//! let libs = discover::discover(&maps);
//! assert_eq!(libs[0].library, xpuscope_probes::catalog::Library::Nccl);
//! assert_eq!((libs[0].inode, libs[0].base), (42, 0x7f0000000000));
//! let d = discover::diff(&[], &libs);
//! assert_eq!(d.added.len(), 1);
//! ```

use crate::catalog::Library;
use crate::maps::{Mapping, ProcessMaps};

/// One mapped range of a loaded library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRange {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    pub executable: bool,
}

/// A catalog library mapped into a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedLibrary {
    pub library: Library,
    /// The path as the process sees it, without a ` (deleted)` suffix.
    pub path: String,
    pub inode: u64,
    /// The file was deleted or replaced on disk after it was mapped: attach
    /// through [`LoadedLibrary::map_files_path`], not `path`.
    pub deleted: bool,
    /// Address of file offset 0 (lowest `start - offset`).
    pub base: u64,
    /// The mappings of this file (same path and inode), by address.
    pub ranges: Vec<MappedRange>,
}

impl LoadedLibrary {
    /// The address at which file offset `file_offset` is mapped executable,
    /// e.g. a probe's `bpf_get_func_ip` value from its file offset.
    pub fn address_of(&self, file_offset: u64) -> Option<u64> {
        self.ranges
            .iter()
            .filter(|r| r.executable)
            .find(|r| file_offset >= r.offset && file_offset - r.offset < r.end - r.start)
            .map(|r| r.start + (file_offset - r.offset))
    }

    /// The file offset mapped at `addr`, if `addr` is in an executable range.
    pub fn file_offset_of(&self, addr: u64) -> Option<u64> {
        self.ranges
            .iter()
            .find(|r| r.executable && (r.start..r.end).contains(&addr))
            .map(|r| addr - r.start + r.offset)
    }

    /// `/proc/<pid>/map_files/<start>-<end>` of the first executable range:
    /// the exact mapped file (right inode, inside the process's mount
    /// namespace) even when `path` was replaced or deleted. Needs root.
    pub fn map_files_path(&self, pid: u32) -> Option<String> {
        let r = self.ranges.iter().find(|r| r.executable)?;
        Some(format!("/proc/{pid}/map_files/{:x}-{:x}", r.start, r.end))
    }

    fn key(&self) -> (&str, u64, u64) {
        (&self.path, self.inode, self.base)
    }
}

/// The catalog libraries in `maps`, one per (path, inode), sorted by path,
/// inode and base. Anonymous and pseudo mappings are ignored, and so is a
/// file mapped without an executable range: the process reads it (a
/// symbolizer, a packager, a test reading the library's symbols), it does
/// not run it.
pub fn discover(maps: &ProcessMaps) -> Vec<LoadedLibrary> {
    let mut libs: Vec<LoadedLibrary> = Vec::new();
    for m in maps.mappings().iter().filter(|m| m.is_file()) {
        let Some(library) = Library::from_path(&m.path) else {
            continue;
        };
        let (path, deleted) = match m.path.strip_suffix(" (deleted)") {
            Some(p) => (p, true),
            None => (m.path.as_str(), false),
        };
        let range = range_of(m);
        let base = m.start.wrapping_sub(m.offset);
        match libs
            .iter_mut()
            .find(|l| l.path == path && l.inode == m.inode)
        {
            Some(l) => {
                l.ranges.push(range);
                l.base = l.base.min(base);
                l.deleted |= deleted;
            }
            None => libs.push(LoadedLibrary {
                library,
                path: path.to_string(),
                inode: m.inode,
                deleted,
                base,
                ranges: vec![range],
            }),
        }
    }
    libs.retain(|l| l.ranges.iter().any(|r| r.executable));
    libs.sort_by(|a, b| a.key().cmp(&b.key()));
    libs
}

fn range_of(m: &Mapping) -> MappedRange {
    MappedRange {
        start: m.start,
        end: m.end,
        offset: m.offset,
        executable: m.is_executable(),
    }
}

/// What changed between two scans of one process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LibraryDiff {
    /// Newly mapped: attach.
    pub added: Vec<LoadedLibrary>,
    /// No longer mapped: detach.
    pub removed: Vec<LoadedLibrary>,
    /// `(old, new)`: the same path now maps a different inode, or the same
    /// file at a new base address. Detach the old, attach the new.
    pub replaced: Vec<(LoadedLibrary, LoadedLibrary)>,
}

impl LibraryDiff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.replaced.is_empty()
    }
}

/// Compares two scans. A library unchanged in path, inode and base is in no
/// list (a file deleted on disk but still mapped is unchanged: its probes
/// still fire). When both an old file and its replacement are mapped, the
/// replacement is `added`.
pub fn diff(old: &[LoadedLibrary], new: &[LoadedLibrary]) -> LibraryDiff {
    let mut old_left: Vec<&LoadedLibrary> = old.iter().collect();
    let mut fresh = Vec::new();
    for n in new {
        match old_left.iter().position(|o| o.key() == n.key()) {
            Some(i) => {
                old_left.swap_remove(i);
            }
            None => fresh.push(n),
        }
    }
    let mut out = LibraryDiff::default();
    for n in fresh {
        match old_left
            .iter()
            .position(|o| o.path == n.path && o.library == n.library)
        {
            Some(i) => {
                let o = old_left.swap_remove(i);
                out.replaced.push((o.clone(), n.clone()));
            }
            None => out.added.push(n.clone()),
        }
    }
    out.removed = old_left.into_iter().cloned().collect();
    out.removed.sort_by(|a, b| a.key().cmp(&b.key()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUDART: &str = "/venv/nvidia/cuda_runtime/lib/libcudart.so.12";
    const NCCL: &str = "/venv/nvidia/nccl/lib/libnccl.so.2";

    fn maps(text: &str) -> Vec<LoadedLibrary> {
        discover(&ProcessMaps::parse(text))
    }

    fn scan(cudart_inode: u64, cudart_base: u64, nccl: bool) -> Vec<LoadedLibrary> {
        let mut text = format!(
            "{:x}-{:x} r--p 00000000 fe:01 {cudart_inode} {CUDART}\n\
             {:x}-{:x} r-xp 00020000 fe:01 {cudart_inode} {CUDART}\n\
             {:x}-{:x} rw-p 000a0000 fe:01 {cudart_inode} {CUDART}\n\
             7f9000000000-7f9000001000 rw-p 00000000 00:00 0\n",
            cudart_base,
            cudart_base + 0x20000,
            cudart_base + 0x20000,
            cudart_base + 0x90000,
            cudart_base + 0xa0000,
            cudart_base + 0xa2000,
        );
        if nccl {
            text.push_str(&format!(
                "7f7000000000-7f7000040000 r--p 00000000 fe:01 77 {NCCL}\n\
                 7f7000040000-7f7000200000 r-xp 00040000 fe:01 77 {NCCL}\n"
            ));
        }
        maps(&text)
    }

    #[test]
    fn finds_catalog_libraries_with_base_inode_and_ranges() {
        let libs = scan(11, 0x7f1000000000, true);
        assert_eq!(libs.len(), 2);
        let c = libs.iter().find(|l| l.library == Library::Cudart).unwrap();
        assert_eq!(
            (c.path.as_str(), c.inode, c.base, c.deleted),
            (CUDART, 11, 0x7f1000000000, false)
        );
        assert_eq!(c.ranges.len(), 3);
        assert_eq!(c.address_of(0x20010), Some(0x7f1000020010));
        assert_eq!(c.address_of(0x10), None, "not executable");
        assert_eq!(c.address_of(0x90000), None, "past the text");
        assert_eq!(c.file_offset_of(0x7f1000020010), Some(0x20010));
        assert_eq!(c.file_offset_of(0x7f1000000010), None);
        assert_eq!(
            c.map_files_path(7).as_deref(),
            Some("/proc/7/map_files/7f1000020000-7f1000090000")
        );
    }

    #[test]
    fn ignores_other_files_and_pseudo_maps() {
        let libs = maps(
            "7f0000000000-7f0000001000 r-xp 00000000 fe:01 5 /usr/lib/libc.so.6\n\
             7f0000001000-7f0000002000 r-xp 00000000 fe:01 6 /x/libnccl-net.so\n\
             7f0000002000-7f0000003000 r-xp 00000000 00:00 0 [vdso]\n\
             7f0000003000-7f0000004000 r-xp 00000000 00:00 0\n",
        );
        assert!(libs.is_empty());
    }

    #[test]
    fn a_library_mapped_only_for_reading_is_not_loaded() {
        // A process that reads the file's symbols through mmap (one
        // read-only mapping at offset 0) does not run it; the loader's
        // mappings of it do, once the executable segment is mapped.
        let read = format!("7f0000000000-7f0000100000 r--p 00000000 fe:01 9 {CUDART}\n");
        assert!(maps(&read).is_empty());
        let loaded = format!(
            "{read}7f1000000000-7f1000010000 r--p 00000000 fe:01 9 {CUDART}\n\
             7f1000010000-7f1000090000 r-xp 00010000 fe:01 9 {CUDART}\n"
        );
        let libs = maps(&loaded);
        assert_eq!(libs.len(), 1, "{libs:?}");
        assert_eq!(libs[0].address_of(0x10000), Some(0x7f1000010000));
    }

    #[test]
    fn deleted_file_keeps_its_identity() {
        let libs = maps(&format!(
            "7f0000000000-7f0000010000 r-xp 00000000 fe:01 9 {CUDART} (deleted)\n\
             7f1000000000-7f1000010000 r-xp 00000000 fe:01 10 {CUDART}\n"
        ));
        assert_eq!(libs.len(), 2, "old and new inode are two libraries");
        assert!(
            libs.iter()
                .all(|l| l.path == CUDART && l.library == Library::Cudart)
        );
        assert!(libs.iter().find(|l| l.inode == 9).unwrap().deleted);
        assert!(!libs.iter().find(|l| l.inode == 10).unwrap().deleted);
    }

    #[test]
    fn diff_added_removed_replaced() {
        let a = scan(11, 0x7f1000000000, false);
        let b = scan(11, 0x7f1000000000, true);
        assert!(diff(&a, &a).is_empty());
        // dlopen of libnccl.
        let d = diff(&a, &b);
        assert_eq!(
            d.added.iter().map(|l| l.library).collect::<Vec<_>>(),
            [Library::Nccl]
        );
        assert!(d.removed.is_empty() && d.replaced.is_empty());
        // dlclose.
        let d = diff(&b, &a);
        assert_eq!(
            d.removed.iter().map(|l| l.library).collect::<Vec<_>>(),
            [Library::Nccl]
        );
        assert!(d.added.is_empty() && d.replaced.is_empty());
        // The same path at a new inode.
        let c = scan(12, 0x7f1000000000, true);
        let d = diff(&b, &c);
        assert_eq!(d.replaced.len(), 1);
        assert_eq!((d.replaced[0].0.inode, d.replaced[0].1.inode), (11, 12));
        assert!(d.added.is_empty() && d.removed.is_empty());
        // The same file at a new base (dlclose + dlopen between scans).
        let e = scan(12, 0x7f2000000000, true);
        let d = diff(&c, &e);
        assert_eq!(d.replaced.len(), 1);
        assert_eq!(d.replaced[0].1.base, 0x7f2000000000);
        // Everything gone (exec or exit).
        let d = diff(&e, &[]);
        assert_eq!(d.removed.len(), 2);
    }

    #[test]
    fn diff_when_the_old_file_stays_mapped_beside_its_replacement() {
        let old = maps(&format!(
            "7f0000000000-7f0000010000 r-xp 00000000 fe:01 9 {CUDART}\n"
        ));
        let both = maps(&format!(
            "7f0000000000-7f0000010000 r-xp 00000000 fe:01 9 {CUDART} (deleted)\n\
             7f1000000000-7f1000010000 r-xp 00000000 fe:01 10 {CUDART}\n"
        ));
        let d = diff(&old, &both);
        assert_eq!(d.added.iter().map(|l| l.inode).collect::<Vec<_>>(), [10]);
        assert!(d.removed.is_empty() && d.replaced.is_empty(), "{d:?}");
    }
}
