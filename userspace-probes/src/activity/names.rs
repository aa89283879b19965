//! Strings in the traced process: kernel names, API names, communicator
//! names, marker messages that activity records point to.
//!
//! The names CUPTI and MSPTI hand out stay valid (and unchanged) for the
//! life of the process, so each `(pid, pointer)` is read once, from
//! `/proc/PID/mem` (needs ptrace access: root for other users' processes,
//! nothing for one's own), and cached. The cache is bounded; a process's
//! entries go when it exits.
//!
//! Proposed use by the agent: read lazily, off the hot path, when a record
//! with a new `name_ptr` arrives; label the slice `kernel@0x...` when the
//! read fails (process gone).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::bytes::c_string;

/// Longest string read (bytes before the NUL).
pub const MAX_NAME: usize = 1024;
/// Default cache size (strings).
pub const DEFAULT_ENTRIES: usize = 65536;

/// A string that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NameError {
    #[error("reading /proc/{pid}/mem at {addr:#x}: {source}")]
    Read {
        pid: u32,
        addr: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("null name pointer (pid {pid})")]
    Null { pid: u32 },
}

/// A bounded cache of strings read from other processes.
#[derive(Debug)]
pub struct RemoteStrings {
    cache: HashMap<(u32, u64), Arc<str>>,
    max_entries: usize,
}

impl Default for RemoteStrings {
    fn default() -> Self {
        Self::new(DEFAULT_ENTRIES)
    }
}

impl RemoteStrings {
    pub fn new(max_entries: usize) -> Self {
        Self {
            cache: HashMap::new(),
            max_entries: max_entries.max(1),
        }
    }

    /// The NUL-terminated string at `addr` in process `pid` (at most
    /// [`MAX_NAME`] bytes, lossily decoded).
    pub fn get(&mut self, pid: u32, addr: u64) -> Result<Arc<str>, NameError> {
        if addr == 0 {
            return Err(NameError::Null { pid });
        }
        if let Some(s) = self.cache.get(&(pid, addr)) {
            return Ok(s.clone());
        }
        let s: Arc<str> = read_c_string(pid, addr)?.into();
        if self.cache.len() >= self.max_entries {
            // Simple and bounded: start over rather than track recency.
            self.cache.clear();
        }
        self.cache.insert((pid, addr), s.clone());
        Ok(s)
    }

    /// Drops the strings of an exited process.
    pub fn forget_process(&mut self, pid: u32) {
        self.cache.retain(|(p, _), _| *p != pid);
    }

    pub fn len(&self) -> usize {
        self.cache.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

/// Reads a C string page by page, so a string ending just before an
/// unmapped page is still read.
fn read_c_string(pid: u32, addr: u64) -> Result<String, NameError> {
    let err = |source| NameError::Read { pid, addr, source };
    let mem = File::open(format!("/proc/{pid}/mem")).map_err(err)?;
    let mut buf = Vec::with_capacity(64);
    let mut at = addr;
    while buf.len() < MAX_NAME {
        let to_page_end = 4096 - (at % 4096) as usize;
        let mut chunk = vec![0u8; to_page_end.min(MAX_NAME - buf.len())];
        let n = match mem.read_at(&mut chunk, at) {
            Ok(n) => n,
            Err(e) if buf.is_empty() => return Err(err(e)),
            Err(_) => 0,
        };
        if n == 0 {
            if buf.is_empty() {
                return Err(err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)));
            }
            break;
        }
        chunk.truncate(n);
        let nul = chunk.iter().position(|&b| b == 0);
        buf.extend_from_slice(&chunk[..nul.unwrap_or(n)]);
        if nul.is_some() {
            break;
        }
        at = at.wrapping_add(n as u64);
    }
    Ok(c_string(&buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_strings_and_caches() {
        let pid = std::process::id();
        let name = std::ffi::CString::new("ncclDevKernel_AllReduce_Sum_bf16_RING_LL").unwrap();
        let addr = name.as_ptr() as u64;
        let mut names = RemoteStrings::new(2);
        assert_eq!(
            &*names.get(pid, addr).unwrap(),
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
        );
        assert_eq!(names.len(), 1);
        // Cached: the same answer without reading again.
        assert_eq!(
            &*names.get(pid, addr).unwrap(),
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
        );
        // A long string is cut at MAX_NAME.
        let long = std::ffi::CString::new(vec![b'x'; MAX_NAME + 100]).unwrap();
        assert_eq!(
            names.get(pid, long.as_ptr() as u64).unwrap().len(),
            MAX_NAME
        );
        // Bounded.
        let third = std::ffi::CString::new("third").unwrap();
        names.get(pid, third.as_ptr() as u64).unwrap();
        assert!(names.len() <= 2);
        names.forget_process(pid);
        assert!(names.is_empty());
    }

    #[test]
    fn bad_pointers_are_errors() {
        let pid = std::process::id();
        let mut names = RemoteStrings::default();
        assert!(matches!(names.get(pid, 0), Err(NameError::Null { .. })));
        let err = names.get(pid, 8).unwrap_err();
        assert!(
            err.to_string().contains(&format!("/proc/{pid}/mem")),
            "{err}"
        );
        assert!(names.get(u32::MAX, 0x1000).is_err());
    }
}
