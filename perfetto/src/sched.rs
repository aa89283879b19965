//! Per-CPU `FtraceEventBundle`s: `CompactSched` columns for switch/waking and
//! plain `FtraceEvent`s for thread lifetimes, in time order per CPU.
//!
//! Steady state allocates nothing: column vectors keep their capacity across
//! bundles, and comm strings of the bundle-local intern table are recycled.

use prost::Message;

use crate::proto::{CompactSched, FtraceEvent};
#[cfg(test)]
use crate::proto::{FtraceEventBundle, TracePacket};

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

/// The slot hash of a comm: every switch and waking names a task, and a
/// byte-at-a-time hash was most of the interning's cost. A task name is
/// at most 15 bytes: it is read as two words (overlapping where shorter
/// than 16 bytes, which together cover every byte), with no copy; a
/// longer string (the API takes any) is hashed a byte at a time.
fn comm_hash(s: &str) -> u64 {
    const MIX: u64 = 0x9e37_79b9_7f4a_7c15;
    let b = s.as_bytes();
    let n = b.len();
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let half = |at: usize| {
        u64::from(u32::from_le_bytes(
            b[at..at + 4].try_into().expect("4 bytes"),
        ))
    };
    let (lo, hi) = match n {
        0 => (0, 0),
        1..=3 => (
            u64::from(b[0]) | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1]) << 16,
            0,
        ),
        4..=7 => (half(0), half(n - 4)),
        8..=TASK_COMM_LEN => (word(0), word(n - 8)),
        _ => {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for c in b {
                h ^= u64::from(*c);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            return h;
        }
    };
    // The length tells apart names whose words coincide.
    let h = (lo ^ hi.rotate_left(32) ^ (n as u64) << 56).wrapping_mul(MIX);
    // The slot is taken from the low bits: fold the high ones in.
    h ^ (h >> 29)
}

/// Whether two names are equal, for a task name by the same words
/// [`comm_hash`] reads (a byte-slice comparison calls `memcmp`, a few
/// percent of the agent's time at a million switches a second).
fn same_comm(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word = |s: &[u8], at: usize| u64::from_le_bytes(s[at..at + 8].try_into().expect("8 bytes"));
    let half = |s: &[u8], at: usize| u32::from_le_bytes(s[at..at + 4].try_into().expect("4 bytes"));
    match n {
        0 => true,
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        4..=7 => half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4),
        8..=TASK_COMM_LEN => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        _ => a == b,
    }
}

impl CommTable {
    /// Index of `comm` in `table`, adding it if absent.
    fn index(&mut self, table: &mut Vec<String>, comm: &str) -> u32 {
        if (table.len() + 1) * 2 > self.slots.len() {
            self.grow(table);
        }
        let mask = self.slots.len() - 1;
        let mut pos = comm_hash(comm) as usize & mask;
        loop {
            match self.slots[pos] {
                0 => break,
                slot => {
                    let idx = slot - 1;
                    if same_comm(table[idx as usize].as_bytes(), comm.as_bytes()) {
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
            let mut pos = comm_hash(s) as usize & mask;
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

    /// Appends the bundle as one framed `Trace.packet` record for `cpu`
    /// (`TracePacket { ftrace_events, trusted_packet_sequence_id,
    /// machine_id }`) to `out`: byte for byte what prost writes for the
    /// packet [`Self::take_packet`] builds (a test holds it to that), in
    /// one pass over each column. prost sizes every nesting level before
    /// writing it (`encoded_len` of the packet, the bundle, the compact
    /// message and each packed column, then the varints again as it
    /// writes): about 10% of `agent attach --system`'s CPU went there.
    pub(crate) fn encode_packet(
        &self,
        cpu: u32,
        sequence_id: u32,
        machine_id: Option<u32>,
        scratch: &mut EncodeScratch,
        out: &mut Vec<u8>,
    ) {
        let c = &self.compact;
        let EncodeScratch {
            column,
            compact,
            bundle,
        } = scratch;
        compact.clear();
        packed(compact, column, 1, c.switch_timestamp.iter().copied());
        packed(
            compact,
            column,
            2,
            c.switch_prev_state.iter().map(|&v| v as u64),
        );
        packed(
            compact,
            column,
            3,
            c.switch_next_pid.iter().map(|&v| i64::from(v) as u64),
        );
        packed(
            compact,
            column,
            4,
            c.switch_next_prio.iter().map(|&v| i64::from(v) as u64),
        );
        for comm in &c.intern_table {
            bytes_field(compact, 5, comm.as_bytes());
        }
        packed(
            compact,
            column,
            6,
            c.switch_next_comm_index.iter().map(|&v| u64::from(v)),
        );
        packed(compact, column, 7, c.waking_timestamp.iter().copied());
        packed(
            compact,
            column,
            8,
            c.waking_pid.iter().map(|&v| i64::from(v) as u64),
        );
        packed(
            compact,
            column,
            9,
            c.waking_target_cpu.iter().map(|&v| i64::from(v) as u64),
        );
        packed(
            compact,
            column,
            10,
            c.waking_prio.iter().map(|&v| i64::from(v) as u64),
        );
        packed(
            compact,
            column,
            11,
            c.waking_comm_index.iter().map(|&v| u64::from(v)),
        );

        bundle.clear();
        varint_field(bundle, 1, u64::from(cpu));
        for event in &self.events {
            key(bundle, 2, WIRE_LEN);
            // Thread lifetimes only: a few per bundle, left to prost.
            let _ = event.encode_length_delimited(bundle);
        }
        if self.lost_events {
            varint_field(bundle, 3, 1);
        }
        if !compact.is_empty() {
            bytes_field(bundle, 4, compact);
        }

        // TracePacket: ftrace_events = 1, trusted_packet_sequence_id = 10,
        // machine_id = 98, in field order as prost writes them.
        let tail = |v: u64, field: u32| key_len(field) + varint_len(v);
        let packet_len = key_len(1)
            + varint_len(bundle.len() as u64)
            + bundle.len()
            + tail(u64::from(sequence_id), 10)
            + machine_id.map_or(0, |m| tail(u64::from(m), 98));
        put_varint(out, packet_len as u64);
        bytes_field(out, 1, bundle);
        varint_field(out, 10, u64::from(sequence_id));
        if let Some(m) = machine_id {
            varint_field(out, 98, u64::from(m));
        }
    }

    /// Moves the bundle's contents into a packet for `cpu`; hand the packet
    /// back to [`Self::recycle`] once encoded.
    #[cfg(test)]
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
    #[cfg(test)]
    pub(crate) fn recycle(&mut self, packet: TracePacket) {
        if let Some(bundle) = packet.ftrace_events {
            if let Some(compact) = bundle.compact_sched {
                self.compact = compact;
            }
            self.events = bundle.event;
        }
        self.clear();
    }

    /// Starts a new bundle, keeping every buffer's capacity.
    pub(crate) fn clear(&mut self) {
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

/// Reusable buffers of [`CpuBundle::encode_packet`]: one packed column,
/// the compact message, the bundle (each written once, then copied whole
/// into its parent, whose length prefix needs its size first).
#[derive(Default)]
pub(crate) struct EncodeScratch {
    column: Vec<u8>,
    compact: Vec<u8>,
    bundle: Vec<u8>,
}

/// Protobuf wire types.
const WIRE_VARINT: u32 = 0;
const WIRE_LEN: u32 = 2;

#[inline]
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn varint_len(v: u64) -> usize {
    // 1 + floor(log2(v)) / 7, with 0 taking one byte.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn key_len(field: u32) -> usize {
    varint_len(u64::from(field << 3))
}

fn key(out: &mut Vec<u8>, field: u32, wire: u32) {
    put_varint(out, u64::from(field << 3 | wire));
}

fn varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    key(out, field, WIRE_VARINT);
    put_varint(out, v);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, WIRE_LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A `[packed = true]` varint column (signed values sign-extended to 64
/// bits by the caller, as protobuf's int32 and int64 are); nothing for an
/// empty one, as prost.
fn packed(
    out: &mut Vec<u8>,
    column: &mut Vec<u8>,
    field: u32,
    values: impl ExactSizeIterator<Item = u64>,
) {
    if values.len() == 0 {
        return;
    }
    column.clear();
    column.reserve(values.len() * 2);
    for v in values {
        put_varint(column, v);
    }
    bytes_field(out, field, column);
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

    /// Names a word-wise hash could confuse (the same bytes but for
    /// trailing NULs, the two halves swapped, the empty name, every length
    /// class, names past 16 bytes) each keep an index of their own, as do many that differ
    /// in one byte (kworker/0:1 .. kworker/N:M).
    #[test]
    fn comm_table_tells_names_apart_whatever_their_bytes() {
        let mut t = CommTable::default();
        let mut table = Vec::new();
        let mut names: Vec<String> = vec![
            String::new(),
            "\0".into(),
            "a".into(),
            "a\0".into(),
            "a\0\0".into(),
            "abcdefgh12345678".into(),
            "12345678abcdefgh".into(),
            "abcdefgh12345678x".into(),
            "a name far longer than any task's comm".into(),
            "ab".into(),
            "ba".into(),
            "aba".into(),
            "java".into(),
            "javac".into(),
            "abcdefg".into(),
            "gfedcba".into(),
            "abcdabcd".into(),
        ];
        for cpu in 0..64 {
            for n in 0..8 {
                names.push(format!("kworker/{cpu}:{n}"));
            }
        }
        for (i, name) in names.iter().enumerate() {
            assert_eq!(t.index(&mut table, name), i as u32, "{name:?}");
        }
        for (i, name) in names.iter().enumerate().rev() {
            assert_eq!(t.index(&mut table, name), i as u32, "{name:?}");
        }
        assert_eq!(table, names);
    }

    /// Two names of any length up to past 16 bytes that differ in any one
    /// byte are told apart, and equal ones are equal.
    #[test]
    fn names_differing_in_any_byte_differ() {
        let base = b"abcdefghijklmnopqrstu";
        for n in 0..=base.len() {
            let a = &base[..n];
            assert!(same_comm(a, a), "{n}");
            assert!(n == 0 || !same_comm(a, &base[..n - 1]), "{n}");
            for i in 0..n {
                let mut b = a.to_vec();
                b[i] ^= 0x20;
                assert!(!same_comm(a, &b), "length {n}, byte {i}");
            }
        }
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

    /// The hand-written encoding is prost's, byte for byte: every column,
    /// negative values (10-byte varints), plain events, lost events, a
    /// machine id or none, large CPU numbers and sequence ids.
    #[test]
    fn encode_packet_writes_what_prost_writes() {
        let mut scratch = EncodeScratch::default();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..200u32 {
            let mut b = CpuBundle::default();
            let mut ts = next() % (1 << 40);
            let n = (next() % 300) as usize;
            for _ in 0..n {
                ts += next() % 5_000_000;
                let comm = format!("comm{}", next() % 20);
                match next() % 7 {
                    0 => b.push_event(FtraceEvent {
                        timestamp: Some(ts),
                        pid: Some((next() % 100_000) as u32),
                        task_newtask: Some(crate::proto::TaskNewtask {
                            pid: Some(-((next() % 5) as i32)),
                            comm: Some(comm.clone()),
                            ..Default::default()
                        }),
                        ..FtraceEvent::default()
                    }),
                    1..=3 => b.push_switch(
                        ts,
                        [0, 1, 2, 0x400, -1, i64::MIN][(next() % 6) as usize],
                        [0, 1, -1, i32::MAX, i32::MIN, 4_194_303][(next() % 6) as usize],
                        [120, 0, -100, 139][(next() % 4) as usize],
                        &comm,
                    ),
                    _ => b.push_waking(
                        ts,
                        (next() % 4_194_304) as i32 - 2,
                        (next() % 1024) as i32 - 1,
                        120,
                        &comm,
                    ),
                }
            }
            if round % 3 == 0 {
                b.mark_lost_events();
            }
            if !b.has_data() {
                continue;
            }
            let cpu = [0, 1, 127, 128, 1023][(round % 5) as usize];
            let sequence_id = [1, 127, 128, 70_000][(round % 4) as usize];
            let machine_id = [None, Some(0), Some(1), Some(300)][(round % 4) as usize];
            let mut ours = Vec::new();
            b.encode_packet(cpu, sequence_id, machine_id, &mut scratch, &mut ours);
            let mut packet = b.take_packet(cpu);
            packet.trusted_packet_sequence_id = Some(sequence_id);
            packet.machine_id = machine_id;
            let theirs = packet.encode_length_delimited_to_vec();
            assert_eq!(ours, theirs, "round {round}: {n} events");
            b.recycle(packet);
        }
    }

    #[test]
    fn varint_len_counts_bytes() {
        for (v, len) in [
            (0u64, 1),
            (127, 1),
            (128, 2),
            (16_383, 2),
            (16_384, 3),
            (u64::MAX, 10),
        ] {
            assert_eq!(varint_len(v), len, "{v}");
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), len, "{v}");
        }
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
