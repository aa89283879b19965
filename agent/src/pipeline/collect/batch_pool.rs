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

/// A bounded free list of event vectors.
struct Pool(Mutex<Vec<Vec<Event>>>);

impl Pool {
    const fn new() -> Self {
        Pool(Mutex::new(Vec::new()))
    }

    fn take(&self) -> Vec<Event> {
        self.0
            .lock()
            .ok()
            .and_then(|mut free| free.pop())
            .unwrap_or_default()
    }

    fn give(&self, mut v: Vec<Event>) {
        if v.capacity() == 0 || v.capacity() > MAX_CAPACITY {
            return;
        }
        v.clear();
        if let Ok(mut free) = self.0.lock()
            && free.len() < KEPT
        {
            free.push(v);
        }
    }
}

static FREE: Pool = Pool::new();

/// An empty vector: a reused one when there is one.
pub fn take() -> Vec<Event> {
    FREE.take()
}

/// Hands back a vector whose records were moved out (any left are
/// dropped).
pub fn give(v: Vec<Event>) {
    FREE.give(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What comes back is empty whatever went in; neither an empty vector
    /// nor one grown past the bound is kept, and no more than `KEPT`.
    #[test]
    fn a_vector_comes_back_empty_and_only_within_bounds() {
        let pool = Pool::new();
        let mut v = Vec::with_capacity(16);
        v.push(Event::Rename(crate::events::Rename {
            cpu: 0,
            ts: 1,
            tid: 1,
            tgid: 1,
            old_comm: Default::default(),
            new_comm: Default::default(),
        }));
        pool.give(v);
        pool.give(Vec::new());
        pool.give(Vec::with_capacity(MAX_CAPACITY + 1));
        let reused = pool.take();
        assert!(reused.is_empty());
        assert_eq!(reused.capacity(), 16, "the vector given back is reused");
        assert_eq!(pool.take().capacity(), 0, "nothing else was kept");
        for _ in 0..KEPT + 3 {
            pool.give(Vec::with_capacity(8));
        }
        let kept = std::iter::from_fn(|| Some(pool.take()).filter(|v| v.capacity() > 0)).count();
        assert_eq!(kept, KEPT);
    }
}
