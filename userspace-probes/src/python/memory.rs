//! Reading another process's memory: `/proc/PID/mem` (one `pread` per read,
//! the thread keeps running), or a byte image for tests and fuzzing.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A read of `len` bytes at `addr` that the target's memory did not satisfy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("reading {len} bytes at {addr:#x} of the target's memory failed")]
pub struct ReadError {
    pub addr: u64,
    pub len: usize,
}

/// The memory of the traced process.
pub trait Memory {
    /// Fills `buf` from `addr`, all of it or an error.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError>;
}

/// `/proc/PID/mem`, with a count of reads (each one syscall).
#[derive(Debug)]
pub struct ProcMem {
    file: File,
    reads: AtomicU64,
}

impl ProcMem {
    pub fn open(pid: u32) -> std::io::Result<Self> {
        Ok(Self {
            file: File::open(format!("/proc/{pid}/mem"))?,
            reads: AtomicU64::new(0),
        })
    }

    /// Reads (syscalls) so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

impl Memory for ProcMem {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let err = ReadError {
            addr,
            len: buf.len(),
        };
        // Addresses above i64::MAX are not user space (and pread's offset is
        // signed).
        if addr > i64::MAX as u64 {
            return Err(err);
        }
        self.reads.fetch_add(1, Ordering::Relaxed);
        match self.file.read_at(buf, addr) {
            Ok(n) if n == buf.len() => Ok(()),
            // A short read crossed into an unmapped page: the object is not
            // all there, so it is not an object.
            _ => Err(err),
        }
    }
}

/// Memory made of byte images at given addresses (tests, fuzzing).
#[derive(Clone, Debug, Default)]
pub struct ImageMemory {
    regions: Vec<(u64, Vec<u8>)>,
}

impl ImageMemory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps `bytes` at `addr`.
    pub fn map(&mut self, addr: u64, bytes: Vec<u8>) {
        self.regions.push((addr, bytes));
    }
}

impl Memory for ImageMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        for (base, bytes) in &self.regions {
            let Some(off) = addr.checked_sub(*base) else {
                continue;
            };
            let Ok(off) = usize::try_from(off) else {
                continue;
            };
            if let Some(src) = off
                .checked_add(buf.len())
                .and_then(|end| bytes.get(off..end))
            {
                buf.copy_from_slice(src);
                return Ok(());
            }
        }
        Err(ReadError {
            addr,
            len: buf.len(),
        })
    }
}
