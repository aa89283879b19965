//! The kernel's learned stack end per thread (`STACK_ENDS`): a second
//! handle on the map, for the pipeline thread that learns them (see
//! `pipeline::enrich::stack_ends`), while the [`Ebpf`](aya::Ebpf) object
//! stays with the session.

use std::os::fd::AsFd;

use aya::maps::{HashMap, Map, MapData};
use xpuscope_common::maps;

use super::error::KernelError;

/// Writes and removes threads' stack ends.
pub struct StackEndsMap(HashMap<MapData, u32, u64>);

impl StackEndsMap {
    pub fn set(&mut self, tid: u32, end: u64) -> Result<(), KernelError> {
        self.0.insert(tid, end, 0).map_err(KernelError::map(format!(
            "learning thread {tid}'s stack end"
        )))
    }

    pub fn remove(&mut self, tid: u32) {
        // Gone already: the thread exited, or the LRU map evicted it.
        let _ = self.0.remove(&tid);
    }
}

/// A handle on `STACK_ENDS` of its own (a duplicated descriptor of the
/// map in `bpf`).
pub(super) fn open(bpf: &aya::Ebpf) -> Result<StackEndsMap, KernelError> {
    let map = bpf
        .map(maps::STACK_ENDS)
        .ok_or_else(|| KernelError::Missing(format!("map {}", maps::STACK_ENDS)))?;
    let Map::LruHashMap(data) = map else {
        return Err(KernelError::Missing(format!(
            "map {} as an LRU hash map",
            maps::STACK_ENDS
        )));
    };
    let fd = data.fd().as_fd().try_clone_to_owned().map_err(|e| {
        KernelError::Missing(format!("a duplicate of map {}: {e}", maps::STACK_ENDS))
    })?;
    let data = MapData::from_fd(fd).map_err(KernelError::map("reopening STACK_ENDS"))?;
    HashMap::try_from(Map::LruHashMap(data))
        .map(StackEndsMap)
        .map_err(KernelError::map("opening STACK_ENDS"))
}
