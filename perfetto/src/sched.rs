//! Per-CPU `FtraceEventBundle`s: `CompactSched` columns for switch/waking and
//! plain `FtraceEvent`s for thread lifetimes, in time order per CPU.
//!
//! Steady state allocates nothing: column vectors keep their capacity across
//! bundles, and comm strings of the bundle-local intern table are recycled.

use crate::proto::{CompactSched, FtraceEvent, FtraceEventBundle, TracePacket};

/// The importer rejects bundles for CPUs at or above this.
pub(crate) const MAX_CPUS: u32 = 1024;

/// Kernel comm buffer size, terminator included.
const TASK_COMM_LEN: usize = 16;

/// The comm intern table of one bundle: strings in `CompactSched.intern_table`
/// order, found through an open-addressing index.
#[derive(Default)]
struct CommTable {
    /// Slot `i` holds `index + 1`, or 0 when free. Length is a power of two.
    slots: Vec<u32>,
    /// Cleared strings from earlier bundles, reused to avoid allocation.
    spare: Vec<String>,
}

fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl CommTable {
    /// Index of `comm` in `table`, adding it if absent.
    fn index(&mut self, table: &mut Vec<String>, comm: &str) -> u32 {
        if (table.len() + 1) * 2 > self.slots.len() {
            self.grow(table);
        }
        let mask = self.slots.len() - 1;
        let mut pos = fnv1a(comm) as usize & mask;
        loop {
            match self.slots[pos] {
                0 => break,
                slot => {
                    let idx = slot - 1;
                    if table[idx as usize] == comm {
                        return idx;
                    }
                }
            }
            pos = (pos + 1) & mask;
        }
        let idx = table.len() as u32;
        // Recycled strings hold any comm of up to TASK_COMM_LEN bytes.
        let mut s = self
            .spare
            .pop()
            .unwrap_or_else(|| String::with_capacity(TASK_COMM_LEN));
        s.push_str(comm);
        table.push(s);
        self.slots[pos] = idx + 1;
        idx
    }

    fn grow(&mut self, table: &[String]) {
        let size = (self.slots.len() * 2).max(64);
        self.slots.clear();
        self.slots.resize(size, 0);
        let mask = size - 1;
        for (idx, s) in table.iter().enumerate() {
            let mut pos = fnv1a(s) as usize & mask;
            while self.slots[pos] != 0 {
                pos = (pos + 1) & mask;
            }
            self.slots[pos] = idx as u32 + 1;
        }
    }

    /// Empties `table` into the spare pool and frees every slot.
    fn reset(&mut self, table: &mut Vec<String>) {
        self.spare.extend(table.drain(..).map(|mut s| {
            s.clear();
            s
        }));
        self.slots.fill(0);
    }
}

/// The open bundle of one CPU.
#[derive(Default)]
pub(crate) struct CpuBundle {
    compact: CompactSched,
    events: Vec<FtraceEvent>,
    comms: CommTable,
    /// Absolute time of the last switch / waking (delta chain bases).
    last_switch: Option<u64>,
    last_waking: Option<u64>,
    /// Latest timestamp of any event in the bundle.
    last_ts: Option<u64>,
    lost_events: bool,
    len: usize,
}

impl CpuBundle {
    /// Events held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether an event at `ts` would go back in time within this bundle.
    pub(crate) fn goes_backwards(&self, ts: u64) -> bool {
        self.last_ts.is_some_and(|last| ts < last)
    }

    /// Whether flushing would write anything.
    pub(crate) fn has_data(&self) -> bool {
        self.len > 0 || self.lost_events
    }

    /// Flags the next bundle written for this CPU as having lost events.
    pub(crate) fn mark_lost_events(&mut self) {
        self.lost_events = true;
    }

    fn note(&mut self, ts: u64) {
        self.last_ts = Some(ts);
        self.len += 1;
    }

    /// Appends a switch. The caller checked [`Self::goes_backwards`].
    pub(crate) fn push_switch(
        &mut self,
        ts: u64,
        prev_state: i64,
        next_pid: i32,
        next_prio: i32,
        next_comm: &str,
    ) {
        let c = &mut self.compact;
        c.switch_timestamp
            .push(ts - self.last_switch.unwrap_or_default());
        c.switch_prev_state.push(prev_state);
        c.switch_next_pid.push(next_pid);
        c.switch_next_prio.push(next_prio);
        let idx = self.comms.index(&mut c.intern_table, next_comm);
        c.switch_next_comm_index.push(idx);
        self.last_switch = Some(ts);
        self.note(ts);
    }

    /// Appends a waking. The caller checked [`Self::goes_backwards`].
    pub(crate) fn push_waking(
        &mut self,
        ts: u64,
        pid: i32,
        target_cpu: i32,
        prio: i32,
        comm: &str,
    ) {
        let c = &mut self.compact;
        c.waking_timestamp
            .push(ts - self.last_waking.unwrap_or_default());
        c.waking_pid.push(pid);
        c.waking_target_cpu.push(target_cpu);
        c.waking_prio.push(prio);
        let idx = self.comms.index(&mut c.intern_table, comm);
        c.waking_comm_index.push(idx);
        self.last_waking = Some(ts);
        self.note(ts);
    }

    /// Appends a plain event. The caller checked [`Self::goes_backwards`].
    pub(crate) fn push_event(&mut self, event: FtraceEvent) {
        let ts = event.timestamp.unwrap_or_default();
        self.events.push(event);
        self.note(ts);
    }

    /// Moves the bundle's contents into a packet for `cpu`; hand the packet
    /// back to [`Self::recycle`] once encoded.
    pub(crate) fn take_packet(&mut self, cpu: u32) -> TracePacket {
        let has_compact =
            !self.compact.switch_timestamp.is_empty() || !self.compact.waking_timestamp.is_empty();
        let compact = has_compact.then(|| std::mem::take(&mut self.compact));
        TracePacket {
            ftrace_events: Some(FtraceEventBundle {
                cpu: Some(cpu),
                event: std::mem::take(&mut self.events),
                lost_events: self.lost_events.then_some(true),
                compact_sched: compact,
            }),
            ..TracePacket::default()
        }
    }

    /// Takes the buffers back from a written packet and starts a new bundle.
    pub(crate) fn recycle(&mut self, packet: TracePacket) {
        if let Some(bundle) = packet.ftrace_events {
            if let Some(compact) = bundle.compact_sched {
                self.compact = compact;
            }
            self.events = bundle.event;
        }
        let c = &mut self.compact;
        self.comms.reset(&mut c.intern_table);
        c.switch_timestamp.clear();
        c.switch_prev_state.clear();
        c.switch_next_pid.clear();
        c.switch_next_prio.clear();
        c.switch_next_comm_index.clear();
        c.waking_timestamp.clear();
        c.waking_pid.clear();
        c.waking_target_cpu.clear();
        c.waking_prio.clear();
        c.waking_comm_index.clear();
        self.events.clear();
        self.last_switch = None;
        self.last_waking = None;
        self.last_ts = None;
        self.lost_events = false;
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_table_dedupes_and_grows() {
        let mut t = CommTable::default();
        let mut table = Vec::new();
        assert_eq!(t.index(&mut table, "a"), 0);
        assert_eq!(t.index(&mut table, "b"), 1);
        assert_eq!(t.index(&mut table, "a"), 0);
        for i in 0..200 {
            t.index(&mut table, &format!("comm{i}"));
        }
        assert_eq!(table.len(), 202);
        for i in 0..200 {
            assert_eq!(t.index(&mut table, &format!("comm{i}")), i + 2);
        }
        assert_eq!(t.index(&mut table, "b"), 1);
    }

    #[test]
    fn comm_table_reset_recycles_strings() {
        let mut t = CommTable::default();
        let mut table = Vec::new();
        t.index(&mut table, "python3");
        t.index(&mut table, "kworker/0:1");
        t.reset(&mut table);
        assert!(table.is_empty());
        assert_eq!(t.spare.len(), 2);
        assert_eq!(t.index(&mut table, "kworker/0:1"), 0);
        assert_eq!(t.spare.len(), 1);
        assert_eq!(table, vec!["kworker/0:1".to_string()]);
    }

    #[test]
    fn timestamps_are_delta_encoded_per_chain() {
        let mut b = CpuBundle::default();
        b.push_switch(1000, 0, 10, 120, "a");
        b.push_waking(1005, 11, 1, 120, "b");
        b.push_switch(1010, 1, 11, 120, "b");
        b.push_waking(1030, 10, 0, 120, "a");
        b.push_switch(1050, 0, 10, 120, "a");
        assert_eq!(b.compact.switch_timestamp, vec![1000, 10, 40]);
        assert_eq!(b.compact.waking_timestamp, vec![1005, 25]);
        assert_eq!(b.compact.switch_next_comm_index, vec![0, 1, 0]);
        assert_eq!(b.compact.waking_comm_index, vec![1, 0]);
        assert_eq!(b.len(), 5);
        assert!(b.goes_backwards(1049));
        assert!(!b.goes_backwards(1050));
    }

    #[test]
    fn take_and_recycle_starts_a_fresh_bundle() {
        let mut b = CpuBundle::default();
        b.mark_lost_events();
        b.push_switch(5, 0, 1, 120, "x");
        let p = b.take_packet(3);
        let bundle = p.ftrace_events.as_ref().unwrap();
        assert_eq!(bundle.cpu, Some(3));
        assert_eq!(bundle.lost_events, Some(true));
        assert_eq!(bundle.compact_sched.as_ref().unwrap().intern_table, ["x"]);
        b.recycle(p);
        assert!(!b.has_data());
        assert!(b.compact.switch_timestamp.capacity() > 0);
        b.push_switch(7, 0, 2, 120, "y");
        assert_eq!(b.compact.switch_timestamp, vec![7]);
        assert_eq!(b.compact.intern_table, ["y"]);
        let p = b.take_packet(3);
        assert_eq!(p.ftrace_events.as_ref().unwrap().lost_events, None);
    }

    #[test]
    fn plain_only_bundle_has_no_compact_sched() {
        let mut b = CpuBundle::default();
        b.push_event(FtraceEvent {
            timestamp: Some(9),
            pid: Some(1),
            ..FtraceEvent::default()
        });
        let p = b.take_packet(0);
        let bundle = p.ftrace_events.unwrap();
        assert!(bundle.compact_sched.is_none());
        assert_eq!(bundle.event.len(), 1);
    }
}
