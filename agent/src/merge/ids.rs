//! How each node's ids and times move into the merged trace: one id
//! space and one time base (see [`super::emit`]).

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use xpuscope_perfetto::rewrite::IdMap;

use super::mix::mix;
use super::scan::NodeScan;

/// Sequence of the merger's own system packet (its SystemInfo).
pub const MERGE_SYSTEM_SEQUENCE: u32 = 1;
/// Sequence of the merger's own tracks and slices.
pub const MERGE_TRACK_SEQUENCE: u32 = 2;
/// Pids at or above this are never a real pid (`PID_MAX_LIMIT` = 2^22).
const REMAPPED_PID_BASE: i32 = 1 << 22;

/// How one node's ids and times move.
pub struct NodeMap {
    pub offset_ns: i64,
    pub sequences: HashMap<u32, u32>,
    pub salt: u64,
    pub pids: HashMap<i32, i32>,
    pub cpu_base: u32,
    next_sequence: u32,
}

impl IdMap for NodeMap {
    fn time(&mut self, ts: u64) -> u64 {
        (ts as i64).saturating_add(self.offset_ns).max(0) as u64
    }
    fn sequence(&mut self, id: u32) -> u32 {
        let next = &mut self.next_sequence;
        *self.sequences.entry(id).or_insert_with(|| {
            *next += 1;
            *next
        })
    }
    fn track(&mut self, uuid: u64) -> u64 {
        mix(uuid ^ self.salt).max(1)
    }
    fn pid(&mut self, pid: i32) -> i32 {
        // Most nodes keep their pids: no lookup per scheduler event then.
        if self.pids.is_empty() {
            return pid;
        }
        self.pids.get(&pid).copied().unwrap_or(pid)
    }
    fn cpu(&mut self, cpu: u32) -> u32 {
        self.cpu_base.saturating_add(cpu)
    }
    fn flow(&mut self, id: u64) -> u64 {
        mix(id ^ self.salt ^ 0x666c_6f77)
    }
}

/// The id maps of every node: sequences numbered after the merger's own,
/// pids moved where an earlier node has them, CPUs placed one after the
/// other.
pub fn node_maps(scans: &[NodeScan], offsets: &[i64]) -> Vec<NodeMap> {
    let mut next_sequence = MERGE_TRACK_SEQUENCE;
    let mut taken: HashSet<i32> = HashSet::default();
    let mut next_pid = REMAPPED_PID_BASE;
    let mut cpu_base = 0;
    scans
        .iter()
        .zip(offsets)
        .enumerate()
        .map(|(k, (s, &offset_ns))| {
            let mut sequences = HashMap::default();
            for &id in &s.sequences {
                next_sequence += 1;
                sequences.insert(id, next_sequence);
            }
            let mut mine: Vec<i32> = s.pids.iter().copied().collect();
            mine.sort_unstable();
            let mut pids = HashMap::default();
            for pid in mine {
                if taken.contains(&pid) {
                    pids.insert(pid, next_pid);
                    taken.insert(next_pid);
                    next_pid += 1;
                }
            }
            for &pid in &s.pids {
                if !pids.contains_key(&pid) {
                    taken.insert(pid);
                }
            }
            let map = NodeMap {
                offset_ns,
                sequences,
                salt: mix(k as u64 + 0x6e6f_6465),
                pids,
                cpu_base,
                next_sequence: 0,
            };
            cpu_base = cpu_base.saturating_add(s.cpu_span());
            map
        })
        .collect()
}
