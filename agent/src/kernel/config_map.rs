//! The runtime configuration the kernel programs read at every run
//! (`CONFIG[0]`): written whole at load, then changed one field at a time
//! (stack mode, scheduler records, probe levels). The loader, the uprobe
//! attacher and `agent probes` all go through here, so the map's
//! read-modify-write exists once.

use aya::Ebpf;
use aya::maps::{Array, MapData};
use xpuscope_common::{Config, maps};

use super::error::KernelError;

fn array(bpf: &Ebpf) -> Result<Array<&MapData, Config>, KernelError> {
    let map = bpf
        .map(maps::CONFIG)
        .ok_or_else(|| KernelError::Missing(format!("map {}", maps::CONFIG)))?;
    Array::try_from(map).map_err(KernelError::map("opening CONFIG"))
}

/// The configuration the programs read now.
pub fn read(bpf: &Ebpf) -> Result<Config, KernelError> {
    array(bpf)?
        .get(&0, 0)
        .map_err(KernelError::map("reading CONFIG"))
}

/// Writes the whole configuration; the programs read it at every run, so a
/// change applies at once.
pub fn write(bpf: &mut Ebpf, config: Config) -> Result<(), KernelError> {
    let map = bpf
        .map_mut(maps::CONFIG)
        .ok_or_else(|| KernelError::Missing(format!("map {}", maps::CONFIG)))?;
    let mut array: Array<&mut MapData, Config> =
        Array::try_from(map).map_err(KernelError::map("opening CONFIG"))?;
    array
        .set(0, config, 0)
        .map_err(KernelError::map("writing CONFIG"))
}

/// Changes some fields and keeps the others as the programs have them.
pub fn update(bpf: &mut Ebpf, change: impl FnOnce(&mut Config)) -> Result<(), KernelError> {
    let mut config = read(bpf)?;
    change(&mut config);
    write(bpf, config)
}
