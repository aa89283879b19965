//! Steps both supervisors (`agent attach`'s `session` and `agent
//! service`'s kernel side) take with the running kernel side and the
//! pipeline: announcing device probes before they can fire, and
//! forwarding the kernel's drop counters.

use anyhow::{Result, anyhow};
use tokio::sync::mpsc;

use crate::host;
use crate::kernel::probes::{AyaDeviceProbes, Plan};
use crate::kernel::{Kernel, KernelControl};
use crate::pipeline::PipelineMsg;

/// Sends a plan's table updates to the pipeline (a probe's meaning must be
/// known before it can fire), then applies it.
pub async fn announce_and_apply(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &mpsc::Sender<PipelineMsg>,
    mut plan: Plan,
) -> Result<()> {
    if plan.is_empty() {
        return Ok(());
    }
    for update in std::mem::take(&mut plan.updates) {
        tx.send(PipelineMsg::Probes(update))
            .await
            .map_err(|_| anyhow!("the pipeline stopped"))?;
    }
    Ok(device.apply(&mut probes.attacher(), plan)?)
}

/// Sends new per-CPU drops to the pipeline; `seen` holds what was sent
/// before, per CPU.
pub async fn send_drops(
    probes: &impl KernelControl,
    seen: &mut [u64],
    tx: &mpsc::Sender<PipelineMsg>,
) {
    let per_kind = probes.drops();
    let mut per_cpu = vec![0u64; seen.len()];
    for (slot, cpus) in per_kind.iter().enumerate() {
        if slot as u32 == xpuscope_common::DROP_SLOT_STACK_ERRORS {
            continue; // stacks that failed inside a written record: not lost records
        }
        for (cpu, n) in cpus.iter().enumerate() {
            if let Some(c) = per_cpu.get_mut(cpu) {
                *c += n;
            }
        }
    }
    let changed: Vec<u32> = (0..seen.len())
        .filter(|&c| per_cpu[c] > seen[c])
        .map(|c| c as u32)
        .collect();
    if changed.is_empty() {
        return;
    }
    seen.copy_from_slice(&per_cpu);
    let total = per_cpu.iter().sum();
    let _ = tx
        .send(PipelineMsg::Drops {
            ts: host::boottime_ns(),
            cpus: changed,
            total,
        })
        .await;
}
