//! The memory bound of the hand-off from collect to the pipeline.
//!
//! The channel between them holds a few batches, and a batch a few
//! thousand events; a scheduler record is a few dozen bytes, but an
//! off-CPU stack event owns a copy of the thread's stack (up to 10 KiB).
//! Counted in batches alone, a pipeline that falls behind on stacks (a
//! Python job flooding the code cache, a slow symbolization) would hold
//! hundreds of MiB in the queue. So each batch also holds its share of a
//! budget in bytes while it waits: collect waits for room before it sends,
//! and the share comes back when the pipeline is done with the batch. The
//! kernel rings stay the real buffer, and count what they cannot hold.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::events::Event;

/// Bytes of events queued between collect and the pipeline, at most.
/// Scheduler batches (about 400 KiB each) never come near it; it bounds
/// batches of stacks to a few.
pub const QUEUE_BYTES: u32 = 64 << 20;

/// The budget collect and the pipeline share.
#[derive(Clone)]
pub struct QueueBudget {
    room: Arc<Semaphore>,
    bytes: u32,
}

impl Default for QueueBudget {
    fn default() -> Self {
        Self::new(QUEUE_BYTES)
    }
}

impl QueueBudget {
    pub fn new(bytes: u32) -> Self {
        Self {
            room: Arc::new(Semaphore::new(bytes as usize)),
            bytes,
        }
    }

    /// Waits until the budget has room for `events` and takes it; the
    /// share is given back when it is dropped. A batch larger than the
    /// whole budget takes all of it (it then goes alone).
    pub async fn hold(&self, events: &[Event]) -> QueueShare {
        let bytes: usize = events.iter().map(Event::bytes).sum();
        let want = bytes.min(self.bytes as usize) as u32;
        // The semaphore is never closed: it lives as long as `self`.
        let permit = self.room.clone().acquire_many_owned(want).await.ok();
        QueueShare { _held: permit }
    }

    /// Bytes held by batches not yet done with.
    #[cfg(test)]
    fn queued(&self) -> u64 {
        u64::from(self.bytes).saturating_sub(self.room.available_permits() as u64)
    }
}

/// A batch's share of the [`QueueBudget`], held while it waits and is
/// interpreted, given back when dropped (the default holds none: a batch
/// that did not come through collect).
#[derive(Debug, Default)]
pub struct QueueShare {
    _held: Option<OwnedSemaphorePermit>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Comm, Rename, StackCapture};

    fn rename(ts: u64) -> Event {
        Event::Rename(Rename {
            cpu: 0,
            ts,
            tid: 1,
            tgid: 1,
            old_comm: Comm::default(),
            new_comm: Comm::default(),
        })
    }

    fn stack(ts: u64, user_words: usize) -> Event {
        Event::Stack(Box::new(StackCapture {
            cpu: 0,
            ts,
            tid: 1,
            tgid: 1,
            kernel: Ok(vec![0; 8]),
            user: Ok(vec![0; user_words]),
            user_copy: None,
            record_bytes: 0,
        }))
    }

    /// Batches of stacks fill the budget and collect waits for the
    /// pipeline to be done with one; small batches pass beside them; a
    /// batch larger than the whole budget still goes, alone.
    #[tokio::test]
    async fn stacks_wait_for_room_and_room_comes_back_when_a_batch_is_done() {
        let budget = QueueBudget::new(1 << 20);
        let big: Vec<Event> = (0..100).map(|t| stack(t, 1000)).collect();
        let big_bytes: u64 = big.iter().map(|e| e.bytes() as u64).sum();
        assert!(big_bytes > 800_000, "{big_bytes}");
        let first = budget.hold(&big).await;
        assert_eq!(budget.queued(), big_bytes);
        // A second batch of stacks has no room until the first is done.
        let waiting =
            tokio::time::timeout(std::time::Duration::from_millis(50), budget.hold(&big)).await;
        assert!(waiting.is_err(), "no room for a second batch of stacks");
        // Scheduler-sized events fit beside it.
        let small: Vec<Event> = (0..100).map(rename).collect();
        let beside = budget.hold(&small).await;
        drop(first);
        drop(beside);
        assert_eq!(budget.queued(), 0, "every share came back");
        let second = budget.hold(&big).await;
        assert_eq!(budget.queued(), big_bytes);
        drop(second);
        // Larger than the budget: it takes all of it, and goes.
        let huge: Vec<Event> = (0..200).map(|t| stack(t, 1000)).collect();
        let alone = budget.hold(&huge).await;
        assert_eq!(budget.queued(), 1 << 20);
        drop(alone);
        assert_eq!(budget.queued(), 0);
    }
}
