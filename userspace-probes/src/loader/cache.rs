//! `/etc/ld.so.cache`: the loader's map from a library's name to its file,
//! written by `ldconfig`. Only glibc's "new" format (`glibc-ld.so.cache1.1`,
//! alone or after the old `ld.so-1.7.0` table) is read; a file in any other
//! shape is an error and the caller falls back to the default directories.
//!
//! The file is read in a privileged agent on behalf of a traced process
//! (its own root's cache), so every offset and count is checked against
//! the file's length before use, and the file itself is bounded.

/// Largest cache file read (glibc's own are tens of KiB; a distribution
/// with every package installed stays well below this).
pub const MAX_CACHE_BYTES: usize = 16 << 20;
/// Longest library name or path kept.
const MAX_STRING: usize = 4096;

const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
const OLD_MAGIC: &[u8] = b"ld.so-1.7.0";
/// `struct cache_file_new`: magic and version (20), nlibs, len_strings,
/// flags + 3 padding, extension_offset, 3 unused words.
const NEW_HEADER: usize = 48;
/// `struct file_entry_new`: flags, key, value, osversion, hwcap.
const NEW_ENTRY: usize = 24;
/// `struct cache_file` (old): magic (11) + padding to 12, nlibs.
const OLD_HEADER: usize = 16;
/// `struct file_entry` (old): flags, key, value.
const OLD_ENTRY: usize = 12;
/// `FLAG_ELF_LIBC6 | FLAG_X8664_LIB64`: an x86-64 glibc library.
const X86_64_LIBC6: u32 = 0x0303;
/// `cache_file_new.flags` endianness values: unset (old writers) or little.
const ENDIAN_UNSET: u8 = 0;
const ENDIAN_LITTLE: u8 = 2;

/// Why a cache file was not read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("not a glibc ld.so.cache (no `glibc-ld.so.cache1.1` header)")]
    Format,
    #[error("an ld.so.cache for another byte order")]
    Endian,
    #[error("ld.so.cache is {0} bytes, over the {MAX_CACHE_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("ld.so.cache is cut short: {0}")]
    Truncated(&'static str),
}

/// The x86-64 entries of a loader cache, in the file's order (the
/// loader's own preference order: the first match wins).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LdCache {
    entries: Vec<(String, String)>,
}

impl LdCache {
    /// Parses a cache file's bytes.
    pub fn parse(data: &[u8]) -> Result<Self, CacheError> {
        if data.len() > MAX_CACHE_BYTES {
            return Err(CacheError::TooLarge(data.len()));
        }
        let start = if data.starts_with(NEW_MAGIC) {
            0
        } else if data.starts_with(OLD_MAGIC) {
            // The old table first, then the new header at the next 8-byte
            // boundary (how ldconfig wrote both formats).
            let n = read_u32(data, 12).ok_or(CacheError::Truncated("old header"))? as usize;
            let old_end = n
                .checked_mul(OLD_ENTRY)
                .and_then(|b| b.checked_add(OLD_HEADER))
                .ok_or(CacheError::Truncated("old entry count"))?;
            let new = old_end.checked_add(7).ok_or(CacheError::Format)? & !7;
            if !data.get(new..).is_some_and(|d| d.starts_with(NEW_MAGIC)) {
                return Err(CacheError::Format);
            }
            new
        } else {
            return Err(CacheError::Format);
        };
        let new = &data[start..];
        if new.len() < NEW_HEADER {
            return Err(CacheError::Truncated("header"));
        }
        match new[28] {
            ENDIAN_UNSET | ENDIAN_LITTLE => {}
            _ => return Err(CacheError::Endian),
        }
        let nlibs = read_u32(new, 20).ok_or(CacheError::Truncated("header"))? as usize;
        let table_end = nlibs
            .checked_mul(NEW_ENTRY)
            .and_then(|b| b.checked_add(NEW_HEADER))
            .filter(|&end| end <= new.len())
            .ok_or(CacheError::Truncated("entry table"))?;
        let mut entries = Vec::new();
        for e in new[NEW_HEADER..table_end].chunks_exact(NEW_ENTRY) {
            let flags = read_u32(e, 0).unwrap_or(0);
            if flags != X86_64_LIBC6 {
                continue;
            }
            // String offsets are from the start of the new header.
            let (Some(key), Some(value)) = (
                string_at(new, read_u32(e, 4).unwrap_or(u32::MAX)),
                string_at(new, read_u32(e, 8).unwrap_or(u32::MAX)),
            ) else {
                continue; // one bad entry must not hide the others
            };
            entries.push((key, value));
        }
        Ok(Self { entries })
    }

    /// The file the loader would map for the library name `name`.
    pub fn lookup(&self, name: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// (name, path) of every x86-64 entry.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn read_u32(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(b.try_into().ok()?))
}

/// The NUL-terminated UTF-8 string at `off`: `None` if it runs past the
/// data or `MAX_STRING`, is empty, or is not UTF-8.
fn string_at(data: &[u8], off: u32) -> Option<String> {
    let rest = data.get(off as usize..)?;
    let rest = &rest[..rest.len().min(MAX_STRING + 1)];
    let len = rest.iter().position(|&b| b == 0)?;
    if len == 0 {
        return None;
    }
    std::str::from_utf8(&rest[..len]).ok().map(str::to_string)
}

/// A cache file with `entries` ((flags, name, path)), as ldconfig writes
/// it: for tests and fuzz seeds.
pub fn build(entries: &[(u32, &str, &str)]) -> Vec<u8> {
    let table = NEW_HEADER + entries.len() * NEW_ENTRY;
    let mut strings: Vec<u8> = Vec::new();
    let mut rows = Vec::new();
    for (flags, key, value) in entries {
        let k = table + strings.len();
        strings.extend_from_slice(key.as_bytes());
        strings.push(0);
        let v = table + strings.len();
        strings.extend_from_slice(value.as_bytes());
        strings.push(0);
        rows.push((*flags, k as u32, v as u32));
    }
    let mut out = Vec::with_capacity(table + strings.len());
    out.extend_from_slice(NEW_MAGIC);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    out.extend_from_slice(&[ENDIAN_LITTLE, 0, 0, 0]);
    out.extend_from_slice(&[0; 16]); // extension offset, unused
    for (flags, k, v) in rows {
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&k.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
        out.extend_from_slice(&[0; 12]); // osversion, hwcap
    }
    out.extend_from_slice(&strings);
    out
}

/// [`build`]'s flags for an x86-64 glibc library.
pub const FLAGS_X86_64: u32 = X86_64_LIBC6;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_x86_64_entries_in_order() {
        let data = build(&[
            (FLAGS_X86_64, "libnccl.so.2", "/opt/nccl/lib/libnccl.so.2"),
            (0x0003, "libnccl.so.2", "/usr/lib32/libnccl.so.2"), // i386
            (FLAGS_X86_64, "libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
            (FLAGS_X86_64, "libnccl.so.2", "/second/libnccl.so.2"),
        ]);
        let c = LdCache::parse(&data).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c.lookup("libnccl.so.2"), Some("/opt/nccl/lib/libnccl.so.2"));
        assert_eq!(
            c.lookup("libc.so.6"),
            Some("/lib/x86_64-linux-gnu/libc.so.6")
        );
        assert_eq!(c.lookup("libcudart.so.12"), None);
    }

    #[test]
    fn reads_the_new_table_after_an_old_one() {
        let new = build(&[(FLAGS_X86_64, "libhccl.so", "/usr/local/Ascend/libhccl.so")]);
        let mut data = OLD_MAGIC.to_vec();
        data.push(0);
        data.extend_from_slice(&1u32.to_le_bytes());
        data.extend_from_slice(&[0; OLD_ENTRY]);
        while !data.len().is_multiple_of(8) {
            data.push(0);
        }
        data.extend_from_slice(&new);
        let c = LdCache::parse(&data).unwrap();
        assert_eq!(c.lookup("libhccl.so"), Some("/usr/local/Ascend/libhccl.so"));
    }

    #[test]
    fn bad_files_are_errors_and_bad_entries_skipped() {
        assert_eq!(LdCache::parse(b"hello"), Err(CacheError::Format));
        let data = build(&[(FLAGS_X86_64, "a.so", "/a.so")]);
        assert_eq!(
            LdCache::parse(&data[..40]),
            Err(CacheError::Truncated("header"))
        );
        assert_eq!(
            LdCache::parse(&data[..NEW_HEADER + 10]),
            Err(CacheError::Truncated("entry table"))
        );
        let mut big_endian = data.clone();
        big_endian[28] = 3;
        assert_eq!(LdCache::parse(&big_endian), Err(CacheError::Endian));
        // A key offset past the end: that entry is skipped.
        let mut bad = build(&[
            (FLAGS_X86_64, "a.so", "/a.so"),
            (FLAGS_X86_64, "b.so", "/b.so"),
        ]);
        bad[NEW_HEADER + 4..NEW_HEADER + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        let c = LdCache::parse(&bad).unwrap();
        assert_eq!((c.len(), c.lookup("b.so")), (1, Some("/b.so")));
        // A huge entry count is refused before anything is allocated.
        let mut many = data.clone();
        many[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            LdCache::parse(&many),
            Err(CacheError::Truncated("entry table"))
        );
    }

    /// The machine's own cache (glibc systems have one; Debian's holds libc).
    #[test]
    fn reads_this_machines_cache() {
        let data = std::fs::read("/etc/ld.so.cache").expect("/etc/ld.so.cache (run ldconfig)");
        let c = LdCache::parse(&data).expect("the system's cache parses");
        assert!(
            c.lookup("libc.so.6")
                .is_some_and(|p| p.ends_with("/libc.so.6")),
            "{:?}",
            c.entries().take(5).collect::<Vec<_>>()
        );
    }
}
