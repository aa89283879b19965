//! NVML's readings -> [`GpuSample`]s and [`GpuXid`]s: the one place
//! they are bounded and given meaning. What NVML hands back is the
//! library's to fill: a clock past [`MAX_MHZ`], a utilization past 100 %,
//! memory used past the total are dropped as readings, never trusted.

use crate::model::gpu::{GpuSample, GpuXid, MAX_SAMPLE_PIDS};

use super::nvml::Nvml;

/// No GPU clocks its SMs near this (MHz).
pub const MAX_MHZ: u32 = 20_000;
/// Longest name or UUID kept.
const MAX_TEXT: usize = 96;

/// What does not change per GPU, read once; the pids each GPU showed
/// last (an Xid names the processes then on its GPU).
pub struct Reader {
    gpus: Vec<Fixed>,
}

struct Fixed {
    name: String,
    uuid: String,
    max_mhz: Option<u32>,
    last_pids: Vec<u32>,
}

fn bounded(s: Option<String>) -> String {
    s.unwrap_or_default().chars().take(MAX_TEXT).collect()
}

/// A reading's bounds, in one place per reading.
pub fn clock(mhz: Option<u32>) -> Option<u32> {
    mhz.filter(|&m| m > 0 && m < MAX_MHZ)
}

pub fn utilization(pct: Option<u32>) -> Option<u32> {
    pct.filter(|&p| p <= 100)
}

pub fn memory(m: Option<(u64, u64)>) -> (Option<u64>, Option<u64>) {
    match m {
        Some((used, total)) if used <= total => (Some(used), Some(total)),
        Some((_, total)) => (None, Some(total)),
        None => (None, None),
    }
}

/// Pids as a sorted, deduplicated, bounded list (0 is no process).
pub fn pids(mut p: Vec<u32>) -> Vec<u32> {
    p.retain(|&pid| pid != 0);
    p.sort_unstable();
    p.dedup();
    p.truncate(MAX_SAMPLE_PIDS);
    p
}

impl Reader {
    pub fn new(nvml: &Nvml) -> Self {
        let gpus = (0..nvml.gpus())
            .map(|g| Fixed {
                name: bounded(nvml.name(g)),
                uuid: bounded(nvml.uuid(g)),
                max_mhz: clock(nvml.max_sm_clock_mhz(g)),
                last_pids: Vec::new(),
            })
            .collect();
        Self { gpus }
    }

    /// Every GPU's readings now.
    pub fn samples(&mut self, nvml: &Nvml, ts: u64) -> Vec<GpuSample> {
        self.gpus
            .iter_mut()
            .enumerate()
            .map(|(g, fixed)| {
                let gpu = g as u32;
                let (used, total) = memory(nvml.memory(gpu));
                let pids = pids(nvml.processes(gpu).unwrap_or_default());
                fixed.last_pids.clone_from(&pids);
                GpuSample {
                    ts,
                    gpu,
                    name: fixed.name.clone(),
                    uuid: fixed.uuid.clone(),
                    sm_clock_mhz: clock(nvml.sm_clock_mhz(gpu)),
                    max_sm_clock_mhz: fixed.max_mhz,
                    clock_event_reasons: nvml.clock_event_reasons(gpu),
                    utilization_pct: utilization(nvml.utilization_pct(gpu)),
                    memory_used_bytes: used,
                    memory_total_bytes: total,
                    ecc_uncorrected: nvml.ecc_uncorrected(gpu),
                    pids,
                }
            })
            .collect()
    }

    /// The next Xid error waiting, if any.
    pub fn next_xid(&self, nvml: &Nvml, ts: u64) -> Option<GpuXid> {
        let (gpu, xid) = nvml.next_xid()?;
        Some(GpuXid {
            ts,
            gpu,
            xid,
            pids: self
                .gpus
                .get(gpu as usize)
                .map(|f| f.last_pids.clone())
                .unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_out_of_range_are_dropped() {
        assert_eq!(clock(Some(1980)), Some(1980));
        assert_eq!(clock(Some(0)), None);
        assert_eq!(clock(Some(u32::MAX)), None);
        assert_eq!(utilization(Some(101)), None);
        assert_eq!(utilization(Some(100)), Some(100));
        assert_eq!(memory(Some((10, 5))), (None, Some(5)));
        assert_eq!(memory(Some((5, 10))), (Some(5), Some(10)));
    }

    #[test]
    fn pids_are_bounded_and_deduplicated() {
        assert_eq!(pids(vec![7, 0, 3, 7]), vec![3, 7]);
        assert_eq!(pids((1..1000).collect()).len(), MAX_SAMPLE_PIDS);
    }
}
