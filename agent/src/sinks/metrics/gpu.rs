//! Device health families, for NVIDIA GPUs (NVML) and Ascend NPUs (DCMI)
//! alike, told apart by the `vendor` label (`nvidia`, `ascend`; `gpu` is
//! the device's index of its vendor), one series per device and rank on it
//! (a device no rank of a traced job runs on has one series with empty
//! rank labels):
//! - `xpuscope_gpu_sm_clock_mhz`, `xpuscope_gpu_max_sm_clock_mhz`: a GPU's
//!   SM clock, an NPU's AI Core frequency (its rated one as the max);
//! - `xpuscope_gpu_throttle_reasons`: NVML's clock-event reason bits
//!   (`nvmlClocksEventReason*`; 0: none); none for an NPU;
//! - `xpuscope_gpu_utilization_ratio` (0..1; an NPU's AI Cores);
//! - `xpuscope_gpu_memory_used_bytes`, `xpuscope_gpu_memory_total_bytes`
//!   (an NPU's HBM);
//! - `xpuscope_gpu_ecc_uncorrected_errors`: the driver's volatile count (GPU);
//! - `xpuscope_gpu_health`: DCMI's health level (NPU; 0 ok .. 3 critical);
//! - `xpuscope_gpu_xid_errors_total`: device errors since the agent
//!   started (Xid errors; error codes an NPU newly listed).
//!
//! A device's series follow the ranks on it: when a rank leaves the device
//! (its process exited) its series go at the next sample. Bounded by the
//! libraries' devices (64 each at most) times the pids a sample keeps.

use foldhash::{HashMap, HashMapExt};
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::RankLabels;
use crate::model::gpu::{GpuSample, GpuXid, Vendor};

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    pub training_job: String,
    pub rank: String,
    pub local_rank: String,
    pub node: String,
    pub vendor: String,
    pub gpu: String,
    pub gpu_uuid: String,
}

pub struct GpuMetrics {
    sm_clock: Family<GpuLabels, Gauge>,
    max_sm_clock: Family<GpuLabels, Gauge>,
    reasons: Family<GpuLabels, Gauge>,
    utilization: Family<GpuLabels, Gauge<f64, AtomicU64>>,
    memory_used: Family<GpuLabels, Gauge>,
    memory_total: Family<GpuLabels, Gauge>,
    ecc: Family<GpuLabels, Gauge>,
    health: Family<GpuLabels, Gauge>,
    xids: Family<GpuLabels, Counter>,
    /// Each device's label sets now.
    series: HashMap<(Vendor, u32), Vec<GpuLabels>>,
}

impl GpuMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            sm_clock: Family::default(),
            max_sm_clock: Family::default(),
            reasons: Family::default(),
            utilization: Family::default(),
            memory_used: Family::default(),
            memory_total: Family::default(),
            ecc: Family::default(),
            health: Family::default(),
            xids: Family::default(),
            series: HashMap::new(),
        };
        r.register(
            "xpuscope_gpu_sm_clock_mhz",
            "GPU SM clock (NVML), NPU AI Core frequency (DCMI), MHz",
            m.sm_clock.clone(),
        );
        r.register(
            "xpuscope_gpu_max_sm_clock_mhz",
            "GPU SM clock's highest (NVML), NPU AI Core rated frequency (DCMI), MHz",
            m.max_sm_clock.clone(),
        );
        r.register(
            "xpuscope_gpu_throttle_reasons",
            "GPU clock-event (throttle) reason bits, nvmlClocksEventReason* (0: none)",
            m.reasons.clone(),
        );
        r.register(
            "xpuscope_gpu_utilization_ratio",
            "Share of the last sample period a kernel ran on the GPU (NVML), NPU AI Core utilization (DCMI)",
            m.utilization.clone(),
        );
        r.register(
            "xpuscope_gpu_memory_used_bytes",
            "Device memory in use, all processes (NVML; DCMI's HBM)",
            m.memory_used.clone(),
        );
        r.register(
            "xpuscope_gpu_memory_total_bytes",
            "Device memory (NVML; DCMI's HBM)",
            m.memory_total.clone(),
        );
        r.register(
            "xpuscope_gpu_ecc_uncorrected_errors",
            "GPU uncorrected ECC errors since the driver loaded (NVML, volatile)",
            m.ecc.clone(),
        );
        r.register(
            "xpuscope_gpu_health",
            "NPU health level (DCMI: 0 ok, 1 minor, 2 major, 3 critical alarm)",
            m.health.clone(),
        );
        r.register(
            "xpuscope_gpu_xid_errors",
            "Device errors seen since the agent started (NVML Xid events, DCMI error codes newly listed)",
            m.xids.clone(),
        );
        m
    }

    /// The label sets of `gpu` with the ranks of `pids` (`ranks`: the
    /// sink's labels per process, those with a rank).
    fn labels(
        node: &str,
        vendor: Vendor,
        gpu: u32,
        uuid: &str,
        pids: &[u32],
        ranks: &HashMap<u32, RankLabels>,
    ) -> Vec<GpuLabels> {
        let base = GpuLabels {
            node: node.to_owned(),
            vendor: vendor.name().to_owned(),
            gpu: gpu.to_string(),
            gpu_uuid: uuid.chars().take(128).collect(),
            ..GpuLabels::default()
        };
        let mut sets: Vec<GpuLabels> = pids
            .iter()
            .filter_map(|p| ranks.get(p))
            .filter(|r| !r.rank.is_empty())
            .map(|r| GpuLabels {
                training_job: r.training_job.clone(),
                rank: r.rank.clone(),
                local_rank: r.local_rank.clone(),
                ..base.clone()
            })
            .collect();
        sets.sort_by(|a, b| a.rank.cmp(&b.rank));
        sets.dedup();
        if sets.is_empty() {
            sets.push(base);
        }
        sets
    }

    fn remove(&self, l: &GpuLabels) {
        self.sm_clock.remove(l);
        self.max_sm_clock.remove(l);
        self.reasons.remove(l);
        self.utilization.remove(l);
        self.memory_used.remove(l);
        self.memory_total.remove(l);
        self.ecc.remove(l);
        self.health.remove(l);
        self.xids.remove(l);
    }

    pub fn sample(&mut self, node: &str, s: &GpuSample, ranks: &HashMap<u32, RankLabels>) {
        let sets = Self::labels(node, s.vendor, s.gpu, &s.uuid, &s.pids, ranks);
        if let Some(old) = self.series.get(&(s.vendor, s.gpu)) {
            for l in old.iter().filter(|l| !sets.contains(l)) {
                self.remove(l);
            }
        }
        for l in &sets {
            let set = |f: &Family<GpuLabels, Gauge>, v: Option<u64>| {
                if let Some(v) = v {
                    f.get_or_create(l).set(i64::try_from(v).unwrap_or(i64::MAX));
                }
            };
            set(&self.sm_clock, s.sm_clock_mhz.map(u64::from));
            set(&self.max_sm_clock, s.max_sm_clock_mhz.map(u64::from));
            set(&self.reasons, s.clock_event_reasons);
            set(&self.memory_used, s.memory_used_bytes);
            set(&self.memory_total, s.memory_total_bytes);
            set(&self.ecc, s.ecc_uncorrected);
            set(&self.health, s.health.map(u64::from));
            if let Some(pct) = s.utilization_pct {
                self.utilization
                    .get_or_create(l)
                    .set(f64::from(pct) / 100.0);
            }
            // Present from the first sample: a query sees 0, not nothing.
            let _ = self.xids.get_or_create(l);
        }
        self.series.insert((s.vendor, s.gpu), sets);
    }

    pub fn xid(&mut self, node: &str, x: &GpuXid, ranks: &HashMap<u32, RankLabels>) {
        let uuid = self
            .series
            .get(&(x.vendor, x.gpu))
            .and_then(|s| s.first())
            .map(|l| l.gpu_uuid.clone())
            .unwrap_or_default();
        for l in Self::labels(node, x.vendor, x.gpu, &uuid, &x.pids, ranks) {
            self.xids.get_or_create(&l).inc();
        }
    }
}
