//! Steps both supervisors (`agent attach`'s `session` and `agent
//! service`'s kernel side) take with the running kernel side and the
//! pipeline: announcing device probes before they can fire, and
//! forwarding the kernel's drop counters.

use anyhow::{Result, anyhow};
use tokio::sync::mpsc;

use crate::host;
use crate::kernel::probes::{AyaDeviceProbes, Plan, ProcessSource};
use crate::kernel::{Kernel, KernelControl};
use crate::pipeline::collect::LoaderNotice;
use crate::pipeline::{Announcements, PipelineMsg};

/// Sends a plan's table updates to the pipeline (a probe's meaning must be
/// known before it can fire), then applies it.
pub async fn announce_and_apply(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &Announcements,
    mut plan: Plan,
) -> Result<()> {
    if plan.is_empty() {
        return Ok(());
    }
    let slots = std::mem::take(&mut plan.slots);
    if !slots.is_empty() {
        tx.send(PipelineMsg::ProbeSlots(slots))
            .map_err(|_| anyhow!("the pipeline stopped"))?;
    }
    for update in std::mem::take(&mut plan.updates) {
        tx.send(PipelineMsg::Probes(update))
            .map_err(|_| anyhow!("the pipeline stopped"))?;
    }
    let loaders = std::mem::take(&mut plan.loaders);
    device.apply(&mut probes.attacher(), plan)?;
    let mut hooked = false;
    for path in loaders {
        match probes.hook_loader(&path) {
            Ok(new) => hooked |= new,
            Err(e) => tracing::warn!("loader hook: {e:#}"),
        }
    }
    if hooked {
        device.loaders_hooked(probes.hooked_loaders());
    }
    Ok(())
}

/// Acts on loader notices read by collect: for each traced process that
/// started a program or changed its link map, the libraries its program
/// will load are probed by file (once per program start) and its maps
/// rescanned now. Notices of one process are coalesced. `source` reads the
/// processes (the service's labels its jobs as configured).
pub async fn on_loader_notices(
    device: &mut AyaDeviceProbes,
    probes: &mut Kernel,
    tx: &Announcements,
    notices: &[LoaderNotice],
    source: &mut impl ProcessSource,
) -> Result<()> {
    let traced: std::collections::HashSet<u32> = probes.targets().into_iter().collect();
    let mut by_pid: Vec<(u32, bool)> = Vec::new();
    for n in notices.iter().filter(|n| traced.contains(&n.tgid)) {
        match by_pid.iter_mut().find(|(p, _)| *p == n.tgid) {
            Some((_, exec)) => *exec |= n.exec,
            None => by_pid.push((n.tgid, n.exec)),
        }
    }
    for (pid, exec) in by_pid {
        let started = std::time::Instant::now();
        let plan = device.plan_early(pid, exec, source);
        let work = (plan.live.len(), plan.files.len(), plan.libraries.len());
        let planned = started.elapsed();
        announce_and_apply(device, probes, tx, plan).await?;
        tracing::debug!(
            "loader notice: pid {pid} (exec {exec}) at {} (started {}): {} probes made live, {} files ahead, \
             {} libraries mapped, planned in {planned:?}, done in {:?}",
            crate::host::boottime_ns(),
            crate::host::boottime_ns() - started.elapsed().as_nanos() as u64,
            work.0,
            work.1,
            work.2,
            started.elapsed()
        );
    }
    Ok(())
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
