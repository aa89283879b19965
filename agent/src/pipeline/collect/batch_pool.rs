//! Emptied batch vectors the pipeline hands back, reused by collect's next
//! reads. A new vector per batch started empty and grew by doubling: every
//! record was copied once more on the way, and its memory was cold. A
//! reused one has room for a batch, in memory the reader touched lately.
//!
//! One free list for the process (every recording's collect and pipeline
//! share it), bounded in count and in what each vector may hold, so a
//! storm's large batches are not kept once it passes.

use std::sync::Mutex;

use crate::events::Event;

/// Vectors kept at most.
const KEPT: usize = 8;
/// Largest capacity kept: a few batches (see `BATCH`).
const MAX_CAPACITY: usize = 4 * super::BATCH;

static FREE: Mutex<Vec<Vec<Event>>> = Mutex::new(Vec::new());

/// An empty vector: a reused one when there is one.
pub fn take() -> Vec<Event> {
    FREE.lock()
        .ok()
        .and_then(|mut free| free.pop())
        .unwrap_or_default()
}

/// Hands back a vector whose records were moved out (any left are
/// dropped).
pub fn give(mut v: Vec<Event>) {
    if v.capacity() == 0 || v.capacity() > MAX_CAPACITY {
        return;
    }
    v.clear();
    if let Ok(mut free) = FREE.lock()
        && free.len() < KEPT
    {
        free.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What comes back is empty whatever went in, and neither an empty
    /// vector nor one grown past the bound is kept.
    #[test]
    fn a_vector_comes_back_empty_and_only_within_bounds() {
        let mut v = Vec::with_capacity(16);
        v.push(Event::Rename(crate::events::Rename {
            cpu: 0,
            ts: 1,
            tid: 1,
            tgid: 1,
            old_comm: Default::default(),
            new_comm: Default::default(),
        }));
        give(v);
        give(Vec::new());
        give(Vec::with_capacity(MAX_CAPACITY + 1));
        // Other tests of this process share the list: every vector in it
        // must be empty and within the bound.
        let mut seen = Vec::new();
        loop {
            let v = take();
            if v.capacity() == 0 {
                break;
            }
            assert!(v.is_empty());
            assert!(v.capacity() <= MAX_CAPACITY);
            seen.push(v);
        }
        assert!(!seen.is_empty(), "the vector given back is reused");
    }
}
