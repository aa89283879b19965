//! How far the three rings are read: the time below which no unread
//! record can be stamped, per ring, and so the watermark up to which
//! collect can hand records on in time order.

/// How long after a record's timestamp it is surely reserved in its ring:
/// a program stamps, then reserves within microseconds; a millisecond
/// leaves a wide margin. (Between reserve and submit no margin is assumed:
/// a ring whose reader stopped at an unsubmitted record is [`ReadEnd::Blocked`].)
pub(crate) const COMMIT_SLACK_NS: u64 = 1_000_000;

/// Why one read of a ring stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadEnd {
    /// Nothing was left: every record reserved before the read is read.
    Empty,
    /// The read took a whole batch; more may wait (read on at once).
    BatchFull,
    /// The reader met a record still being filled; records behind it (any
    /// CPU's, stamped any time since the last one read) wait with it.
    Blocked,
}

/// What one read of a ring saw.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingRead {
    pub end: ReadEnd,
    /// The timestamp of the last record read (in ring order), if any.
    pub last_ts: Option<u64>,
}

/// Per ring (device, scheduler, bystander), the time below which none of
/// its unread records is stamped. Each only rises.
#[derive(Debug, Default)]
pub(crate) struct Floors([u64; 3]);

impl Floors {
    /// Notes a read of ring `ring` that began at `now` (taken before any
    /// ring was read).
    ///
    /// - Read to empty: what is unread was reserved after the read began,
    ///   so stamped after `now` less the slack.
    /// - Stopped early (a batch, or a record being filled): what is unread
    ///   was reserved after the last record read, so stamped after that
    ///   one's time less the slack; with nothing read, the floor stays
    ///   (nothing can have been stamped below it unread then, or now).
    pub(crate) fn note(&mut self, ring: usize, read: RingRead, now: u64) {
        let floor = match read.end {
            ReadEnd::Empty => Some(now),
            ReadEnd::BatchFull | ReadEnd::Blocked => read.last_ts,
        };
        if let Some(t) = floor {
            let f = &mut self.0[ring];
            *f = (*f).max(t.saturating_sub(COMMIT_SLACK_NS));
        }
    }

    /// Every record stamped at or before this was read (the lowest floor).
    pub(crate) fn watermark(&self) -> u64 {
        self.0.iter().copied().min().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn read(end: ReadEnd, last_ts: Option<u64>) -> RingRead {
        RingRead { end, last_ts }
    }

    /// CI's case: the bystander ring's reader stops at another CPU's
    /// record still being filled (its virtual CPU held by the hypervisor),
    /// with cpu 0's switch at 10 ms complete behind it; the scheduler ring
    /// meanwhile has cpu 0's switch at 13.5 ms. Nothing after the last
    /// bystander record read may go out, however late the clock is, until
    /// the blocked ring is read past the stall.
    #[test]
    fn a_ring_stopped_at_a_record_being_filled_holds_the_watermark() {
        let mut f = Floors::default();
        let now = 9 * MS;
        f.note(0, read(ReadEnd::Empty, None), now);
        f.note(1, read(ReadEnd::Empty, Some(8 * MS)), now);
        f.note(2, read(ReadEnd::Empty, Some(8 * MS + 500_000)), now);
        assert_eq!(f.watermark(), 8 * MS, "read to empty: now less the slack");
        // Next read at 15 ms: the bystander ring is blocked after its
        // record at 9.5 ms; the other two read to empty.
        let now = 15 * MS;
        f.note(0, read(ReadEnd::Empty, None), now);
        f.note(1, read(ReadEnd::Empty, Some(13 * MS + 500_000)), now);
        f.note(2, read(ReadEnd::Blocked, Some(9 * MS + 500_000)), now);
        let w = f.watermark();
        assert!(w < 10 * MS, "cpu 0's 10 ms switch is still unread: {w}");
        // Still blocked, nothing read: the floor stays where it was.
        f.note(2, read(ReadEnd::Blocked, None), 20 * MS);
        assert_eq!(f.watermark(), w);
        // The stalled record is submitted and the ring read to empty.
        f.note(2, read(ReadEnd::Empty, Some(14 * MS)), 21 * MS);
        f.note(0, read(ReadEnd::Empty, None), 21 * MS);
        f.note(1, read(ReadEnd::Empty, None), 21 * MS);
        assert_eq!(f.watermark(), 20 * MS);
    }

    /// A ring read a batch at a time holds the others to its last record
    /// (less the slack); a floor never falls.
    #[test]
    fn a_full_batch_holds_the_watermark_to_its_last_record() {
        let mut f = Floors::default();
        assert_eq!(f.watermark(), 0, "nothing read yet");
        for ring in 0..3 {
            f.note(ring, read(ReadEnd::Empty, None), 50 * MS);
        }
        f.note(1, read(ReadEnd::BatchFull, Some(30 * MS)), 60 * MS);
        assert_eq!(f.watermark(), 49 * MS, "a floor never falls");
        f.note(0, read(ReadEnd::Empty, None), 70 * MS);
        f.note(2, read(ReadEnd::Empty, None), 70 * MS);
        f.note(1, read(ReadEnd::BatchFull, Some(65 * MS)), 70 * MS);
        assert_eq!(f.watermark(), 64 * MS);
        f.note(1, read(ReadEnd::Empty, Some(69 * MS)), 70 * MS);
        assert_eq!(f.watermark(), 69 * MS);
    }
}
