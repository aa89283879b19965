//! `/proc/PID/maps`: which file backs which address range of a process.
//!
//! The file's content comes from the traced process's address space, so it
//! is parsed defensively: malformed lines are skipped, never trusted.

use std::path::PathBuf;

/// Errors reading a process's mappings.
#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// One mapping line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// Offset in the backing file of `start`.
    pub offset: u64,
    pub perms: [u8; 4],
    /// The backing file's device (`major << 32 | minor`) and inode: which
    /// file it is, wherever its path leads (the same path in two
    /// containers names two files).
    pub dev: u64,
    pub inode: u64,
    /// The backing path, a pseudo name such as `[vdso]`, or empty.
    pub path: String,
}

impl Mapping {
    pub fn is_executable(&self) -> bool {
        self.perms[2] == b'x'
    }

    /// Whether this mapping is backed by a file (not anonymous or a pseudo map).
    pub fn is_file(&self) -> bool {
        self.path.starts_with('/')
    }

    /// A path that opens the very file this mapping of process `pid` maps,
    /// whatever root or mount namespace the process runs in: its
    /// `/proc/PID/map_files/START-END` link while it is mapped (root
    /// only), else the mapped path under the process's own root
    /// (`/proc/PID/root`), else in the agent's, each taken only when it
    /// leads to the mapped inode. A process in a container maps files the
    /// host may have too, under the same names, with other contents; a
    /// chrooted one's maps name its files by their host paths.
    pub fn file_path(&self, pid: u32) -> Option<PathBuf> {
        use std::os::unix::fs::MetadataExt;
        if !self.is_file() {
            return None;
        }
        let candidates = [
            PathBuf::from(format!(
                "/proc/{pid}/map_files/{:x}-{:x}",
                self.start, self.end
            )),
            PathBuf::from(format!("/proc/{pid}/root")).join(self.path.trim_start_matches('/')),
            PathBuf::from(&self.path),
        ];
        candidates
            .into_iter()
            .find(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == self.inode))
    }

    /// The file offset of address `addr` inside this mapping.
    pub fn file_offset_of(&self, addr: u64) -> u64 {
        addr.wrapping_sub(self.start).wrapping_add(self.offset)
    }
}

/// All mappings of a process, sorted by start address.
#[derive(Clone, Debug, Default)]
pub struct ProcessMaps {
    mappings: Vec<Mapping>,
}

impl ProcessMaps {
    /// Reads `/proc/<pid>/maps`.
    pub fn read(pid: u32) -> Result<Self, MapsError> {
        let path = PathBuf::from(format!("/proc/{pid}/maps"));
        // Not read_to_string: a mapped file's name may be any bytes, and one
        // odd name must not hide every library of the process.
        let raw = std::fs::read(&path).map_err(|source| MapsError::Read { path, source })?;
        Ok(Self::parse(&String::from_utf8_lossy(&raw)))
    }

    /// Parses the text of a maps file, skipping lines that do not parse.
    pub fn parse(text: &str) -> Self {
        let mut mappings: Vec<Mapping> = text.lines().filter_map(parse_line).collect();
        mappings.sort_by_key(|m| m.start);
        Self { mappings }
    }

    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    /// The mapping containing `addr`.
    pub fn find(&self, addr: u64) -> Option<&Mapping> {
        let idx = self.mappings.partition_point(|m| m.start <= addr);
        let m = self.mappings.get(idx.checked_sub(1)?)?;
        (addr < m.end).then_some(m)
    }

    /// The lowest address at which `path` is mapped, with its file offset 0
    /// mapping: the base that ELF virtual addresses are relative to.
    pub fn base_of(&self, path: &str) -> Option<u64> {
        self.mappings
            .iter()
            .filter(|m| m.path == path)
            .map(|m| m.start.wrapping_sub(m.offset))
            .min()
    }
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let dev = fields.next()?;
    let inode = fields.next()?;
    let path = fields.next().unwrap_or("").trim_start().to_string();
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    if end <= start {
        return None;
    }
    let perms: [u8; 4] = perms.as_bytes().try_into().ok()?;
    Some(Mapping {
        start,
        end,
        offset: u64::from_str_radix(offset, 16).ok()?,
        perms,
        dev: parse_dev(dev)?,
        inode: inode.parse().ok()?,
        path,
    })
}

/// Where a process's mapped files are opened.
#[derive(Clone, Copy, Debug)]
pub enum MappedFiles<'a> {
    /// Process `pid`'s own files ([`Mapping::file_path`]).
    Process(u32),
    /// Under a directory, by the mapped path (made-up maps over files
    /// in it: tests, fuzzing).
    Root(&'a std::path::Path),
}

impl MappedFiles<'_> {
    /// The path to open for mapping `m`; for a live process one that
    /// leads to the mapped file, or (none does: it is gone) the mapped
    /// path itself, whose opening then fails or is checked by the caller.
    pub fn path(&self, m: &Mapping) -> PathBuf {
        match self {
            MappedFiles::Process(pid) => {
                m.file_path(*pid).unwrap_or_else(|| PathBuf::from(&m.path))
            }
            MappedFiles::Root(root) => root.join(m.path.trim_start_matches('/')),
        }
    }
}

/// `fe:01` (hex major and minor, as maps prints them).
fn parse_dev(dev: &str) -> Option<u64> {
    let (major, minor) = dev.split_once(':')?;
    Some(u64::from_str_radix(major, 16).ok()? << 32 | u64::from_str_radix(minor, 16).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
55d0c0a00000-55d0c0a02000 r--p 00000000 fe:01 1234  /usr/bin/cat
55d0c0a02000-55d0c0a07000 r-xp 00002000 fe:01 1234  /usr/bin/cat
7f1e2c000000-7f1e2c021000 rw-p 00000000 00:00 0
7f1e2d400000-7f1e2d428000 r--p 00000000 fe:01 99   /usr/lib/x86_64-linux-gnu/libc.so.6
7f1e2d428000-7f1e2d5bd000 r-xp 00028000 fe:01 99   /usr/lib/x86_64-linux-gnu/libc.so.6
7ffd5a1f0000-7ffd5a1f2000 r-xp 00000000 00:00 0    [vdso]
garbage line
7fff-7ff0 r-xp 00000000 00:00 0 /bad/range
";

    #[test]
    fn parses_and_finds() {
        let maps = ProcessMaps::parse(SAMPLE);
        assert_eq!(maps.mappings().len(), 6, "malformed lines are skipped");
        let m = maps.find(0x7f1e2d428010).expect("inside libc text");
        assert_eq!(m.path, "/usr/lib/x86_64-linux-gnu/libc.so.6");
        assert!(m.is_executable() && m.is_file());
        assert_eq!(m.file_offset_of(0x7f1e2d428010), 0x28010);
        assert_eq!(maps.find(0x7f1e2c000000).map(|m| m.path.as_str()), Some(""));
        assert!(maps.find(0x1000).is_none());
        assert!(maps.find(0x7f1e2c021000).is_none(), "end is exclusive");
        assert_eq!(
            maps.base_of("/usr/lib/x86_64-linux-gnu/libc.so.6"),
            Some(0x7f1e2d400000)
        );
        assert!(!maps.find(0x7ffd5a1f0001).unwrap().is_file());
    }

    #[test]
    fn reads_own_maps() {
        let maps = ProcessMaps::read(std::process::id()).unwrap();
        let here = parses_and_finds as *const () as u64;
        let m = maps.find(here).expect("this function is mapped");
        assert!(m.is_executable());
    }

    #[test]
    fn missing_process_names_the_path() {
        let err = ProcessMaps::read(u32::MAX).unwrap_err();
        assert!(err.to_string().contains("/proc/4294967295/maps"), "{err}");
    }
}
