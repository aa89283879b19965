//! The agent's memory, as the allocator and the kernel see it.
//!
//! The agent runs on jemalloc (see `main.rs`). Freed pages go back to the
//! system as they age (jemalloc's decay, 10 s by default); the service
//! turns on jemalloc's background thread so that this also happens while
//! the service is idle (decay otherwise advances only when a thread
//! allocates).

use serde_json::{Value, json};

/// Purges freed pages from a thread of the allocator's own, even while no
/// thread allocates.
pub fn purge_in_background() -> Result<(), String> {
    tikv_jemalloc_ctl::background_thread::write(true).map_err(|e| e.to_string())
}

/// What the allocator holds, to tell a leak (`allocated_bytes` grows) from
/// fragmentation (`active_bytes` or `resident_bytes` grow around it):
/// `allocated` is the live allocations, `active` the pages of the slabs and
/// runs holding them, `resident` the allocator's pages in memory (its
/// metadata included), `retained` virtual memory kept unmapped for reuse.
pub fn allocator() -> Value {
    // The statistics are a snapshot taken when the epoch advances.
    let _ = tikv_jemalloc_ctl::epoch::advance();
    use tikv_jemalloc_ctl::stats;
    let read = |r: tikv_jemalloc_ctl::Result<usize>| r.map_or(0, |v| v as u64);
    json!({
        "allocated_bytes": read(stats::allocated::read()),
        "active_bytes": read(stats::active::read()),
        "resident_bytes": read(stats::resident::read()),
        "metadata_bytes": read(stats::metadata::read()),
        "retained_bytes": read(stats::retained::read()),
        "background_purge": tikv_jemalloc_ctl::background_thread::read().unwrap_or(false),
    })
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
    fn the_allocator_counts_what_is_allocated_and_freed() {
        let allocated = || allocator()["allocated_bytes"].as_u64().unwrap();
        let before = allocated();
        // Large enough that other tests allocating meanwhile cannot hide it.
        let block = vec![1u8; 256 << 20];
        let during = allocated();
        assert!(during >= before + (200 << 20), "{before} -> {during}");
        drop(block);
        let after = allocated();
        assert!(after + (200 << 20) <= during, "{during} -> {after}");
        assert!(allocator()["resident_bytes"].as_u64().unwrap() > 0);
    }

    #[test]
    fn background_purging_turns_on() {
        purge_in_background().unwrap();
        assert_eq!(allocator()["background_purge"], true);
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
}
