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

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

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

/// The trims so far, for `agent ctl status` (a trim holds the allocator's
/// locks while it runs: a long one would stall every allocating thread).
#[derive(Default)]
pub struct TrimStats {
    trims: AtomicU64,
    released: AtomicU64,
    last_us: AtomicU64,
    max_us: AtomicU64,
    total_us: AtomicU64,
}

impl TrimStats {
    pub fn add(&self, t: Trimmed) {
        let us = t.took.as_micros() as u64;
        self.trims.fetch_add(1, Ordering::Relaxed);
        self.released
            .fetch_add(t.released as u64, Ordering::Relaxed);
        self.last_us.store(us, Ordering::Relaxed);
        self.max_us.fetch_max(us, Ordering::Relaxed);
        self.total_us.fetch_add(us, Ordering::Relaxed);
    }

    pub fn json(&self) -> Value {
        let n = self.trims.load(Ordering::Relaxed);
        json!({
            "trims": n,
            "trims_that_released": self.released.load(Ordering::Relaxed),
            "last_trim_us": self.last_us.load(Ordering::Relaxed),
            "max_trim_us": self.max_us.load(Ordering::Relaxed),
            "mean_trim_us": self.total_us.load(Ordering::Relaxed).checked_div(n).unwrap_or(0),
        })
    }
}

/// The agent's resident memory by kind, from `/proc/self/status` and
/// `/proc/self/smaps`: `ring_mapped_bytes` is the part that is the kernel
/// ring buffers' pages (mapped twice, so counted twice in the resident
/// size), which is no heap of the agent's.
pub fn resident() -> Value {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .map_or(0, |n| n << 10)
    };
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    json!({
        "resident_bytes": kb("VmRSS:"),
        "anon_bytes": kb("RssAnon:"),
        "file_bytes": kb("RssFile:"),
        "ring_mapped_bytes": ring_mapped(&smaps),
        "heap": allocator(),
    })
}

/// What glibc's allocator holds, to tell a leak (bytes in use grow) from
/// fragmentation (arenas grow around free space): `in_use_bytes` are the
/// live allocations, `free_bytes` the arenas' free chunks, `mmapped_bytes`
/// the large blocks allocated with their own mapping.
fn allocator() -> Value {
    // SAFETY: mallinfo2 reads the allocator's statistics under its locks;
    // no preconditions.
    let m = unsafe { libc::mallinfo2() };
    json!({
        "in_use_bytes": m.uordblks + m.hblkhd,
        "free_bytes": m.fordblks,
        "mmapped_bytes": m.hblkhd,
        "arena_bytes": m.arena,
    })
}

/// The resident bytes of the BPF map mappings (the ring buffers) in an
/// smaps text.
fn ring_mapped(smaps: &str) -> u64 {
    let mut total = 0;
    let mut in_map = false;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && first.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
            // A mapping's header: range perms offset dev inode [path].
            in_map = words.nth(4) == Some("anon_inode:bpf-map");
        } else if in_map && first == "Rss:" {
            total += words
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0)
                << 10;
        }
    }
    total
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

    #[test]
    fn ring_mappings_are_summed_from_smaps() {
        let smaps = "\
7f00-7f10 r--p 00000000 00:0f 1053 anon_inode:bpf-map
Size:                 64 kB
Rss:                  64 kB
7f10-7f20 rw-s 00000000 00:0f 1053 anon_inode:bpf-map
Rss:                   8 kB
7f20-7f30 rw-p 00000000 00:00 0 [heap]
Rss:                 100 kB
7f30-7f40 r-xp 00000000 fd:00 42 /usr/bin/agent
Rss:                  12 kB
";
        assert_eq!(ring_mapped(smaps), 72 << 10);
        let here = resident();
        assert!(here["resident_bytes"].as_u64().unwrap() > 0, "{here}");
    }

    #[test]
    fn trim_stats_sum_up() {
        let s = TrimStats::default();
        s.add(Trimmed {
            released: true,
            took: Duration::from_micros(300),
        });
        s.add(Trimmed {
            released: false,
            took: Duration::from_micros(100),
        });
        let j = s.json();
        assert_eq!(
            (
                j["trims"].as_u64(),
                j["max_trim_us"].as_u64(),
                j["mean_trim_us"].as_u64()
            ),
            (Some(2), Some(300), Some(200))
        );
        assert_eq!(j["trims_that_released"], 1);
    }
}
