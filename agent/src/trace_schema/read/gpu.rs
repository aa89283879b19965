//! Device health read back from a trace: each GPU or NPU track's `gpu sample`
//! instants into [`GpuSample`]s and its `Xid N` instants into
//! [`GpuXid`]s, as the health sampler handed them to the sinks (the
//! Perfetto sink's `gpu` module writes them). The trace is input like any
//! other: a pid list or a reading that does not parse is left out.

use xpuscope_perfetto::rewrite::EventView;

use crate::model::gpu::{GpuSample, GpuXid, MAX_SAMPLE_PIDS, Vendor, health_name};
use crate::trace_schema::keys as k;
use crate::trace_schema::names as n;

/// The pids of a `pids` argument (`"12,34"`), mapped by `pid`, bounded.
fn pids_of(event: &EventView<'_>, pid: impl Fn(i32) -> u32) -> Vec<u32> {
    k::GPU_PIDS
        .read(event)
        .unwrap_or("")
        .split(',')
        .filter_map(|p| p.trim().parse::<i32>().ok())
        .filter(|&p| p > 0)
        .take(MAX_SAMPLE_PIDS)
        .map(pid)
        .collect()
}

/// A `gpu sample` instant on device `gpu`'s track.
pub fn sample(
    event: &EventView<'_>,
    (vendor, gpu): (Vendor, u32),
    pid: impl Fn(i32) -> u32,
) -> Option<GpuSample> {
    if event.name != Some(n::GPU_SAMPLE_EVENT) {
        return None;
    }
    let u32_of = |key: crate::trace_schema::Key<crate::trace_schema::Uint>| {
        key.read(event).and_then(|v| u32::try_from(v).ok())
    };
    Some(GpuSample {
        ts: event.ts,
        vendor,
        gpu,
        name: k::GPU_NAME.read(event).unwrap_or("").to_owned(),
        uuid: k::GPU_UUID.read(event).unwrap_or("").to_owned(),
        sm_clock_mhz: u32_of(k::SM_CLOCK_MHZ),
        max_sm_clock_mhz: u32_of(k::MAX_SM_CLOCK_MHZ),
        clock_event_reasons: k::CLOCK_EVENT_REASONS.read(event),
        utilization_pct: u32_of(k::UTILIZATION_PCT),
        memory_used_bytes: k::MEMORY_USED_BYTES.read(event),
        memory_total_bytes: k::MEMORY_TOTAL_BYTES.read(event),
        ecc_uncorrected: k::ECC_UNCORRECTED.read(event),
        health: u32_of(k::HEALTH).filter(|&l| health_name(l).is_some()),
        pids: pids_of(event, pid),
    })
}

/// An `Xid N` instant on a GPU's track, an `error code 0x...` one on an
/// NPU's.
pub fn xid(
    event: &EventView<'_>,
    (vendor, gpu): (Vendor, u32),
    pid: impl Fn(i32) -> u32,
) -> Option<GpuXid> {
    let (prefix, key) = match vendor {
        Vendor::Nvidia => (n::GPU_XID_EVENT, k::XID),
        Vendor::Ascend => (n::NPU_ERROR_EVENT, k::ERROR_CODE),
    };
    event.name?.strip_prefix(prefix)?;
    Some(GpuXid {
        ts: event.ts,
        vendor,
        gpu,
        xid: key.read(event)?,
        pids: pids_of(event, pid),
    })
}
