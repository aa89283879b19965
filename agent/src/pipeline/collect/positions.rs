//! Whether a kernel ring buffer still holds records after a read stopped.
//!
//! A ring's reader stops at the first record that is reserved but not yet
//! submitted (its program is still filling it), even when records reserved
//! after it are complete. To the reader that looks like an empty ring, yet
//! the records behind it can be from any CPU and stamped well before the
//! reader's clock (a program's virtual CPU can be held by the hypervisor
//! between reserve and submit for milliseconds: once in CI, a CPU's earlier
//! switch came out 3.5 ms after its later one). The two position counters
//! tell the cases apart: the producer's moves on at reserve, the
//! consumer's as records are read, so they differ while anything is
//! unread. aya keeps both mappings private; this maps the two pages again,
//! read-only.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// The consumer and producer position pages of one ring buffer, mapped
/// read-only.
pub(crate) struct RingPositions {
    base: *mut libc::c_void,
    page: usize,
}

// SAFETY: the mapping is read through atomics only and unmapped once, on
// drop; the kernel keeps the pages alive while they are mapped.
unsafe impl Send for RingPositions {}
// SAFETY: as above; `&self` only loads.
unsafe impl Sync for RingPositions {}

impl RingPositions {
    /// Maps the position pages of the ring buffer map `fd` (the consumer
    /// page, then the producer page, at the map's start).
    pub(crate) fn new(fd: BorrowedFd<'_>) -> io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .map_err(|_| io::Error::other("the page size is unknown"))?;
        // SAFETY: a fresh read-only shared mapping of two pages of a BPF
        // ring buffer map, which allows read-only maps from offset 0.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { base, page })
    }

    fn position(&self, page: usize) -> u64 {
        // SAFETY: each page starts with the kernel's 8-byte aligned
        // position counter, mapped for as long as `self` lives; the kernel
        // and aya's reader write it atomically.
        unsafe {
            (*(self.base.cast::<u8>().add(page * self.page) as *const AtomicU64))
                .load(Ordering::Acquire)
        }
    }

    /// Whether records are reserved that the reader has not consumed: one
    /// still being filled, and everything behind it. (Just after a read, a
    /// record reserved since also counts: the caller then only waits for
    /// the next read.)
    pub(crate) fn unread(&self) -> bool {
        let consumer = self.position(0);
        let producer = self.position(1);
        producer != consumer
    }
}

impl Drop for RingPositions {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped only here.
        unsafe { libc::munmap(self.base, 2 * self.page) };
    }
}
