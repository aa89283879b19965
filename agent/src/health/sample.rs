//! NVML's and DCMI's readings -> [`GpuSample`]s and [`GpuXid`]s: the one
//! place they are bounded and given meaning. What a library hands back is
//! its to fill: a clock past [`MAX_MHZ`], a utilization past 100 %, memory
//! used past the total, a health level DCMI does not define are dropped as
//! readings, never trusted.

use std::collections::HashSet;

use crate::model::gpu::{GpuSample, GpuXid, HEALTH_LEVELS, MAX_SAMPLE_PIDS, Vendor};

use super::dcmi::{Dcmi, MAX_ERROR_CODES};
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

/// DCMI's health level, when it is one DCMI defines (`0xffffffff` is
/// "no such device").
pub fn health(level: Option<u32>) -> Option<u32> {
    level.filter(|&l| (l as usize) < HEALTH_LEVELS.len())
}

/// DCMI's HBM (used, total) in MB, as bytes.
pub fn megabytes(m: Option<(u64, u64)>) -> Option<(u64, u64)> {
    m.map(|(used, total)| (used.saturating_mul(1 << 20), total.saturating_mul(1 << 20)))
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
                    vendor: Vendor::Nvidia,
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
                    health: None,
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
            vendor: Vendor::Nvidia,
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

/// DCMI's readings: what does not change per NPU, read once, and the
/// error codes each NPU listed at the last reading (a code is reported
/// when it appears, not again while it stays listed).
pub struct DcmiReader {
    npus: Vec<Npu>,
}

struct Npu {
    name: String,
    id: String,
    max_mhz: Option<u32>,
    codes: HashSet<u32>,
}

impl DcmiReader {
    pub fn new(dcmi: &Dcmi) -> Self {
        let npus = (0..dcmi.npus())
            .map(|n| Npu {
                name: bounded(dcmi.name(n)),
                id: dcmi
                    .card_device(n)
                    .map(|(c, d)| format!("card {c} device {d}"))
                    .unwrap_or_default(),
                max_mhz: clock(dcmi.aicore_max_mhz(n)),
                codes: HashSet::new(),
            })
            .collect();
        Self { npus }
    }

    /// Every NPU's readings now, and the error codes that appeared since
    /// the last reading (a code of 0 is no error), each naming the
    /// processes on its NPU now.
    pub fn samples(&mut self, dcmi: &Dcmi, ts: u64) -> (Vec<GpuSample>, Vec<GpuXid>) {
        let mut samples = Vec::with_capacity(self.npus.len());
        let mut errors = Vec::new();
        for (n, npu) in self.npus.iter_mut().enumerate() {
            let gpu = n as u32;
            // Health before the error codes: an alarm raised between the
            // two reads then shows with its code, never without it.
            let health = health(dcmi.health(gpu));
            let (used, total) = memory(megabytes(dcmi.hbm_mb(gpu)));
            let pids = pids(dcmi.processes(gpu).unwrap_or_default());
            if let Some(mut codes) = dcmi.error_codes(gpu) {
                codes.retain(|&c| c != 0);
                codes.truncate(MAX_ERROR_CODES);
                let now: HashSet<u32> = codes.iter().copied().collect();
                for &code in &codes {
                    if !npu.codes.contains(&code) {
                        errors.push(GpuXid {
                            ts,
                            vendor: Vendor::Ascend,
                            gpu,
                            xid: u64::from(code),
                            pids: pids.clone(),
                        });
                    }
                }
                npu.codes = now;
            }
            samples.push(GpuSample {
                ts,
                vendor: Vendor::Ascend,
                gpu,
                name: npu.name.clone(),
                uuid: npu.id.clone(),
                sm_clock_mhz: clock(dcmi.aicore_mhz(gpu)),
                max_sm_clock_mhz: npu.max_mhz,
                clock_event_reasons: None,
                utilization_pct: utilization(dcmi.aicore_utilization_pct(gpu)),
                memory_used_bytes: used,
                memory_total_bytes: total,
                ecc_uncorrected: None,
                health,
                pids,
            });
        }
        (samples, errors)
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
        assert_eq!(health(Some(3)), Some(3));
        assert_eq!(health(Some(0xffff_ffff)), None);
        assert_eq!(megabytes(Some((1, 2))), Some((1 << 20, 2 << 20)));
        assert_eq!(megabytes(Some((u64::MAX, 1))), Some((u64::MAX, 1 << 20)));
        assert_eq!(
            memory(megabytes(Some((u64::MAX, 1)))),
            (None, Some(1 << 20)),
            "an HBM use past its size is no reading"
        );
    }

    #[test]
    fn pids_are_bounded_and_deduplicated() {
        assert_eq!(pids(vec![7, 0, 3, 7]), vec![3, 7]);
        assert_eq!(pids((1..1000).collect()).len(), MAX_SAMPLE_PIDS);
    }
}
