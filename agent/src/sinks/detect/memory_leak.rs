//! `memory_leak`: a rank's device memory growing every step at one
//! allocation site.
//!
//! Live bytes per (device, allocation site) come from the memory effect
//! each allocation and free call carries (the interpret stage's ledger:
//! bytes added or released, and the site of the allocation). At the end of
//! each step (`host_steps`), a site whose live bytes grew by at least
//! `leak_min_per_step` since the previous step continues its run; any
//! other step ends it. A run of `leak_min_steps` steps fires, once per
//! run: the rank, the site's stack, the rate (MiB per step over the run),
//! the step it started at, and what the rank holds. A warm-up that grows
//! for a few steps and then holds steady (a caching allocator filling
//! up) stays under the run length.

use foldhash::HashMap;

use serde_json::json;
use xpuscope_probes::catalog::Vendor;
use xpuscope_probes::decode::memory::Device;

use super::Ranks;
use super::host_config::HostDetectConfig;
use super::host_steps::Window;
use crate::model::{DeviceCallRecord, Finding, FindingKind, site_label};

/// Sites followed per rank (the rest are not judged).
const MAX_SITES: usize = 4096;

#[derive(Default)]
struct SiteGrowth {
    /// Live bytes now.
    bytes: i64,
    /// Live bytes at the end of the previous step.
    at_step_end: i64,
    label: Option<String>,
    run_from_step: u64,
    run_from_bytes: i64,
    run_start_ns: u64,
    run_steps: u32,
    reported: bool,
}

#[derive(Default)]
struct RankMemory {
    sites: HashMap<(Device, Option<u64>), SiteGrowth>,
    /// Bytes held per device, as the last call saw it.
    held: HashMap<Device, u64>,
}

#[derive(Default)]
pub struct LeakDetector {
    ranks: HashMap<u32, RankMemory>,
}

fn device_name(d: Device) -> String {
    let kind = match d.vendor {
        Vendor::Nvidia => "gpu",
        Vendor::Ascend => "npu",
    };
    format!("{kind}{}", d.index)
}

impl LeakDetector {
    pub fn forget(&mut self, tgid: u32) {
        self.ranks.remove(&tgid);
    }

    /// An allocation or free of a followed rank (`follows`: it has a rank).
    pub fn device_call(&mut self, c: &DeviceCallRecord, follows: bool) {
        let call = &c.call;
        let Some(m) = &call.memory else {
            return;
        };
        if !follows || m.delta == 0 {
            return;
        }
        let r = self.ranks.entry(call.tgid).or_default();
        r.held.insert(m.device, m.held_after);
        let key = (m.device, m.site);
        if r.sites.len() >= MAX_SITES && !r.sites.contains_key(&key) {
            return;
        }
        let s = r.sites.entry(key).or_default();
        s.bytes += m.delta;
        if s.label.is_none() && m.delta > 0 {
            s.label = Some(site_label(c.site.as_ref()));
        }
    }

    pub fn step_ended(
        &mut self,
        w: &Window,
        cfg: &HostDetectConfig,
        ranks: &Ranks,
        out: &mut Vec<Finding>,
    ) {
        let Some(r) = self.ranks.get_mut(&w.tgid) else {
            return;
        };
        let min = i64::try_from(cfg.leak_min_per_step).unwrap_or(i64::MAX);
        let mut keys: Vec<_> = r.sites.keys().copied().collect();
        keys.sort_unstable();
        for key in keys {
            let s = r.sites.get_mut(&key).expect("listed");
            let grew = s.bytes - s.at_step_end;
            if grew >= min {
                if s.run_steps == 0 {
                    s.run_from_step = w.step;
                    s.run_from_bytes = s.at_step_end;
                    s.run_start_ns = w.start;
                }
                s.run_steps += 1;
            } else {
                s.run_steps = 0;
                s.reported = false;
            }
            s.at_step_end = s.bytes;
            if s.reported || s.run_steps < cfg.leak_min_steps.max(1) {
                continue;
            }
            s.reported = true;
            let rate = (s.bytes - s.run_from_bytes) as f64 / f64::from(s.run_steps);
            let mib = |b: f64| b / (1u64 << 20) as f64;
            let stack = s.label.clone().unwrap_or_else(|| site_label(None));
            let device = device_name(key.0);
            let held = r.held.get(&key.0).copied().unwrap_or(0);
            let who = ranks.describe(w.tgid);
            out.push(Finding {
                link: Default::default(),
                kind: FindingKind::MemoryLeak,
                ranks: ranks.of(w.tgid).into_iter().collect(),
                comm: None,
                seq: None,
                step: Some(s.run_from_step),
                start_ns: s.run_start_ns,
                end_ns: Some(w.end),
                summary: format!(
                    "memory_leak: {who}'s {device} memory grows {:.1} MiB per step at {stack}, \
                     {} steps in a row from step {}; it holds {:.0} MiB there ({:.0} MiB on \
                     {device})",
                    mib(rate),
                    s.run_steps,
                    s.run_from_step,
                    mib(s.bytes as f64),
                    mib(held as f64)
                ),
                evidence: json!({
                    "pid": w.tgid,
                    "device": device,
                    "stack": stack,
                    "start_step": s.run_from_step,
                    "steps": s.run_steps,
                    "mb_per_step": mib(rate),
                    "bytes_per_step": rate as u64,
                    "site_bytes": s.bytes,
                    "held_bytes": held,
                    "leak_min_per_step_bytes": cfg.leak_min_per_step,
                    "leak_min_steps": cfg.leak_min_steps,
                }),
                detected_ns: w.end,
            });
        }
    }
}
