//! Giving the allocator's free pages back to the system.
//!
//! The flight recorder frees its oldest batches as new ones arrive, on
//! another thread than the one that allocated them, and at a steady
//! 100 k+ records per second. glibc keeps what a freed allocation held in
//! the arena it came from and returns it to the system only from the top of
//! the heap: measured in the soak (`malloc_stats` every minute), the bytes in
//! use stayed flat (~450 MB) while the arenas' size grew 20 MB a minute, so
//! the resident size grew with no leak behind it. `malloc_trim` hands every
//! arena's free pages back (`MADV_DONTNEED` on whole free pages inside the
//! heap, not only its top); the service calls it every [`TRIM_EVERY`].

use std::time::{Duration, Instant};

/// How often the service trims: the growth it undoes is ~20 MB a minute,
/// and a trim costs milliseconds.
pub const TRIM_EVERY: Duration = Duration::from_secs(10);

/// What one trim did.
#[derive(Debug, Clone, Copy)]
pub struct Trimmed {
    /// Whether the allocator gave any memory back.
    pub released: bool,
    pub took: Duration,
}

/// Returns free heap pages of every arena to the system.
pub fn trim() -> Trimmed {
    let started = Instant::now();
    // SAFETY: malloc_trim only walks the allocator's own free lists under
    // its locks; it has no preconditions (pad 0: keep nothing spare).
    let released = unsafe { libc::malloc_trim(0) } == 1;
    Trimmed {
        released,
        took: started.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trim_gives_freed_memory_back() {
        // Many live blocks, then every other one freed: holes in the heap
        // that only a trim can return (the top is still in use).
        let mut blocks: Vec<Vec<u8>> = (0..4096).map(|i| vec![i as u8; 16 * 1024]).collect();
        for b in blocks.iter_mut().step_by(2) {
            *b = Vec::new();
        }
        let t = trim();
        assert!(t.released, "{t:?}");
        assert_eq!(blocks[1][0], 1);
    }
}
