//! Findings from device health (NVML's samples and Xid events per GPU,
//! DCMI's samples and error codes per Ascend NPU), joined to the ranks
//! whose processes run on each device:
//! - `device_throttled`: a rank's device whose clock (a GPU's SM clock, an
//!   NPU's AI Core frequency) stayed below its peers' (the median of the
//!   other devices of its vendor the job's ranks run on, or the device's
//!   own highest clock when it has no peer) by more than
//!   [`GpuHealthConfig::clock_gap_pct`] for [`GpuHealthConfig::persist`],
//!   while slowed rather than idle: a GPU needs a reason from NVML other
//!   than idleness or a clock setting (thermal, power cap, hardware
//!   slowdown, ...), named in the finding; DCMI gives no reason, so an NPU
//!   needs its AI Cores busy ([`BUSY_PCT`]) and the finding says "frequency
//!   below peers". Once per slowdown: the device must come back to its
//!   peers' clock before another is reported.
//! - `device_error`: an Xid error, new uncorrected ECC errors, an error
//!   code an NPU newly lists, once per device and code (ECC: each time the
//!   count grows); and an NPU whose DCMI health turns to an alarm with no
//!   error code listed since its last sample (with one, that code's finding
//!   says it), once per rise.
//!
//! A device with no rank of the traced job on it gives no finding. State
//! is per device; the ranks come from [`Ranks`], which forgets a process at
//! its exit.

use foldhash::HashMap;
use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;

use super::Ranks;
use crate::model::gpu::{GpuSample, GpuXid, Vendor, health_name, reason_names};
use crate::model::{Finding, FindingKind};

/// `device_throttled`'s thresholds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuHealthConfig {
    /// How far below its peers' clock a GPU must be, percent.
    pub clock_gap_pct: u32,
    /// For how long.
    pub persist: Duration,
}

impl Default for GpuHealthConfig {
    fn default() -> Self {
        Self {
            clock_gap_pct: 10,
            persist: Duration::from_secs(5),
        }
    }
}

/// A peer's clock older than this is not compared with (its GPU left the
/// job or NVML stopped answering for it).
const PEER_FRESH_NS: u64 = 5_000_000_000;
/// An NPU whose AI Cores are busy at least this share (percent) while its
/// frequency is below its peers' is slowed, not idling for its host (DCMI
/// gives no reason for a lowered frequency).
pub const BUSY_PCT: u32 = 50;

#[derive(Default)]
struct GpuState {
    /// The last sample's clock, time and whether a rank runs on it.
    clock: Option<u32>,
    ts: u64,
    ranked: bool,
    /// Since when it has been below its peers, and the lowest clock and
    /// the reasons seen since.
    below_since: Option<u64>,
    lowest: u32,
    reasons: u64,
    reported: bool,
    /// The last sample at its peers' clock: the slowdown began after it.
    last_normal: Option<u64>,
    ecc: Option<u64>,
    /// The time of the sample before this one, and of the last error code.
    prev_ts: Option<u64>,
    last_error: Option<u64>,
    /// The health level last reported or explained by an error code.
    health: u32,
}

#[derive(Default)]
pub struct GpuHealthDetector {
    cfg: GpuHealthConfig,
    gpus: HashMap<(Vendor, u32), GpuState>,
    xids: HashSet<(Vendor, u32, u64)>,
}

/// The traced ranks and their processes among `pids`, rank order.
fn ranks_on(pids: &[u32], ranks: &Ranks) -> Vec<(u32, u32)> {
    let mut r: Vec<(u32, u32)> = pids
        .iter()
        .filter_map(|&p| ranks.of(p).map(|r| (r, p)))
        .collect();
    r.sort_unstable();
    r
}

fn median(mut v: Vec<u32>) -> Option<u32> {
    v.sort_unstable();
    let n = v.len();
    (n > 0).then(|| {
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2
        }
    })
}

fn who(on: &[(u32, u32)]) -> String {
    let ranks: Vec<String> = on.iter().map(|(r, _)| r.to_string()).collect();
    match ranks.len() {
        1 => format!("rank {}", ranks[0]),
        _ => format!("ranks {}", ranks.join(",")),
    }
}

impl GpuHealthDetector {
    pub fn new(cfg: GpuHealthConfig) -> Self {
        Self {
            cfg,
            ..Self::default()
        }
    }

    /// A sample: its clock against its peers', its ECC count against its
    /// last. `step_of(pid, ts)`: the rank's step then.
    pub fn sample(
        &mut self,
        s: &GpuSample,
        ranks: &Ranks,
        step_of: &dyn Fn(u32, u64) -> Option<u64>,
        out: &mut Vec<Finding>,
    ) {
        let on = ranks_on(&s.pids, ranks);
        let peers: Vec<u32> = self
            .gpus
            .iter()
            .filter(|((v, g), st)| {
                *v == s.vendor
                    && *g != s.gpu
                    && st.ranked
                    && s.ts.saturating_sub(st.ts) < PEER_FRESH_NS
            })
            .filter_map(|(_, st)| st.clock)
            .collect();
        let peer_clock = median(peers.clone());
        let device = s.vendor.device();
        let state = self.gpus.entry((s.vendor, s.gpu)).or_default();
        state.clock = s.sm_clock_mhz;
        state.prev_ts = (state.ts > 0).then_some(state.ts);
        state.ts = s.ts;
        state.ranked = !on.is_empty();

        match s.health {
            Some(level) if level > state.health && !on.is_empty() => {
                let explained = match (state.last_error, state.prev_ts) {
                    (Some(e), Some(p)) => e >= p,
                    (Some(_), None) => true,
                    _ => false,
                };
                state.health = level;
                if !explained {
                    let (rank, pid) = on[0];
                    let step = step_of(pid, s.ts);
                    let name = health_name(level).unwrap_or("alarm");
                    out.push(Finding {
                        link: Default::default(),
                        kind: FindingKind::DeviceError,
                        ranks: on.iter().map(|(r, _)| *r).collect(),
                        comm: None,
                        seq: None,
                        step,
                        start_ns: s.ts,
                        end_ns: Some(s.ts),
                        summary: format!(
                            "device_error: {}'s {device} {} reported health {name}{}",
                            who(&on),
                            s.gpu,
                            step.map(|s| format!(" in step {s}")).unwrap_or_default()
                        ),
                        evidence: json!({
                            "source": s.vendor.source(),
                            "vendor": s.vendor.name(),
                            "gpu": s.gpu,
                            "gpu_name": s.name,
                            "gpu_uuid": s.uuid,
                            "health": level,
                            "health_name": name,
                            "pids": on.iter().map(|(_, p)| p).collect::<Vec<_>>(),
                            "rank": rank,
                        }),
                        detected_ns: s.ts,
                    });
                }
            }
            Some(level) => state.health = level,
            None => {}
        }

        if let Some(ecc) = s.ecc_uncorrected {
            if let Some(before) = state.ecc
                && ecc > before
                && !on.is_empty()
            {
                let (rank, pid) = on[0];
                let step = step_of(pid, s.ts);
                out.push(Finding {
                    link: Default::default(),
                    kind: FindingKind::DeviceError,
                    ranks: on.iter().map(|(r, _)| *r).collect(),
                    comm: None,
                    seq: None,
                    step,
                    start_ns: s.ts,
                    end_ns: Some(s.ts),
                    summary: format!(
                        "device_error: {}'s {device} {} reported {} new uncorrected ECC errors ({} in all){}",
                        who(&on),
                        s.gpu,
                        ecc - before,
                        ecc,
                        step.map(|s| format!(" in step {s}")).unwrap_or_default()
                    ),
                    evidence: json!({
                        "source": s.vendor.source(),
                        "gpu": s.gpu,
                        "gpu_uuid": s.uuid,
                        "ecc_uncorrected": ecc,
                        "new_ecc_uncorrected": ecc - before,
                        "pids": on.iter().map(|(_, p)| p).collect::<Vec<_>>(),
                        "rank": rank,
                    }),
                    detected_ns: s.ts,
                });
            }
            state.ecc = Some(ecc);
        }

        // Below whom: its peers' median, or its own highest clock.
        let reference = peer_clock.or(s.max_sm_clock_mhz);
        // Slowed, not idle: a GPU waiting for its host (a pipeline bubble,
        // data loading) also clocks down, with no reason but idleness. An
        // NPU has no reasons: busy AI Cores tell slowed from idle.
        let slowed = match s.clock_event_reasons {
            Some(_) => s.slowdown_reasons() != 0,
            None => s.utilization_pct.is_some_and(|u| u >= BUSY_PCT),
        };
        let below = match (s.sm_clock_mhz, reference) {
            (Some(clock), Some(reference)) if !on.is_empty() && slowed => {
                u64::from(clock) * 100
                    < u64::from(reference) * u64::from(100 - self.cfg.clock_gap_pct.min(99))
            }
            _ => false,
        };
        if !below {
            state.last_normal = Some(s.ts);
            state.below_since = None;
            state.reported = false;
            state.reasons = 0;
            return;
        }
        let clock = s.sm_clock_mhz.unwrap_or(0);
        if state.below_since.is_none() {
            state.lowest = clock;
            state.reasons = 0;
        }
        let since = *state.below_since.get_or_insert(s.ts);
        state.lowest = state.lowest.min(clock);
        state.reasons |= s.slowdown_reasons();
        if state.reported || s.ts.saturating_sub(since) < self.cfg.persist.as_nanos() as u64 {
            return;
        }
        state.reported = true;
        let (rank, pid) = on[0];
        let step = step_of(pid, since);
        // Sampled once an interval: the slowdown began between the last
        // sample at the peers' clock and the first below it.
        let onset_after_step = state.last_normal.and_then(|t| step_of(pid, t));
        let reasons = reason_names(state.reasons);
        let why = match s.clock_event_reasons {
            Some(_) => format!("slowed by {reasons}"),
            None => format!(
                "frequency below peers (no reason given; its AI Cores {} % busy)",
                s.utilization_pct.unwrap_or(0)
            ),
        };
        let what = match s.vendor {
            Vendor::Nvidia => "ran its SMs",
            Vendor::Ascend => "ran its AI Cores",
        };
        let against = match peer_clock {
            Some(p) => format!(
                "its peers' {p} MHz (median of {} peer {device}{})",
                peers.len(),
                if peers.len() == 1 { "" } else { "s" }
            ),
            None => format!(
                "its own {} {} MHz",
                match s.vendor {
                    Vendor::Nvidia => "highest",
                    Vendor::Ascend => "rated",
                },
                reference.unwrap_or(0)
            ),
        };
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::DeviceThrottled,
            ranks: on.iter().map(|(r, _)| *r).collect(),
            comm: None,
            seq: None,
            step,
            start_ns: since,
            end_ns: None,
            summary: format!(
                "device_throttled: {}'s {device} {} {what} at {} MHz for {:.1} s against {against}, {why}{}",
                who(&on),
                s.gpu,
                clock,
                s.ts.saturating_sub(since) as f64 / 1e9,
                step.map(|s| format!(", from step {s}")).unwrap_or_default()
            ),
            evidence: json!({
                "source": s.vendor.source(),
                "gpu": s.gpu,
                "gpu_name": s.name,
                "gpu_uuid": s.uuid,
                "sm_clock_mhz": clock,
                "lowest_sm_clock_mhz": state.lowest,
                "peer_sm_clock_mhz": peer_clock,
                "peer_gpus": peers.len(),
                "vendor": s.vendor.name(),
                "utilization_pct": s.utilization_pct,
                "max_sm_clock_mhz": s.max_sm_clock_mhz,
                "reasons": reasons.split(',').filter(|r| !r.is_empty()).collect::<Vec<_>>(),
                "reason_bits": state.reasons,
                "seconds": s.ts.saturating_sub(since) as f64 / 1e9,
                "first_seen_ns": since,
                "onset_after_step": onset_after_step,
                "pids": on.iter().map(|(_, p)| p).collect::<Vec<_>>(),
                "rank": rank,
            }),
            detected_ns: s.ts,
        });
    }

    /// An Xid error: a `device_error` of the ranks on its GPU, once per
    /// GPU and Xid.
    pub fn xid(
        &mut self,
        x: &GpuXid,
        ranks: &Ranks,
        step_of: &dyn Fn(u32, u64) -> Option<u64>,
        out: &mut Vec<Finding>,
    ) {
        let on = ranks_on(&x.pids, ranks);
        let state = self.gpus.entry((x.vendor, x.gpu)).or_default();
        state.last_error = Some(x.ts);
        // DCMI lists the codes a device has, read once an interval: the
        // code appeared after the device's last sample (0: none yet).
        let last_sample = (x.vendor == Vendor::Ascend && state.ts > 0).then_some(state.ts);
        if on.is_empty() || !self.xids.insert((x.vendor, x.gpu, x.xid)) {
            return;
        }
        let (raised, code) = match x.vendor {
            Vendor::Nvidia => ("raised Xid", x.xid.to_string()),
            Vendor::Ascend => ("listed error code", format!("0x{:X}", x.xid)),
        };
        let (rank, pid) = on[0];
        let step = step_of(pid, x.ts);
        let listed_after_step = last_sample.and_then(|t| step_of(pid, t));
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::DeviceError,
            ranks: on.iter().map(|(r, _)| *r).collect(),
            comm: None,
            seq: None,
            step,
            start_ns: x.ts,
            end_ns: Some(x.ts),
            summary: format!(
                "device_error: {}'s {} {} {raised} {code}{}",
                who(&on),
                x.vendor.device(),
                x.gpu,
                step.map(|s| format!(" in step {s}")).unwrap_or_default()
            ),
            evidence: json!({
                "source": x.vendor.source(),
                "vendor": x.vendor.name(),
                "gpu": x.gpu,
                "xid": x.xid,
                "error_code": (x.vendor == Vendor::Ascend).then(|| format!("0x{:X}", x.xid)),
                "listed_after_step": listed_after_step,
                "pids": on.iter().map(|(_, p)| p).collect::<Vec<_>>(),
                "rank": rank,
            }),
            detected_ns: x.ts,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RankIdentity;

    const S: u64 = 1_000_000_000;

    fn ranks(pairs: &[(u32, u32)]) -> Ranks {
        let mut r = Ranks::default();
        for &(pid, rank) in pairs {
            r.identity(
                pid,
                &RankIdentity {
                    rank: Some(rank.to_string()),
                    ..RankIdentity::default()
                },
            );
        }
        r
    }

    /// An NPU's sample as DCMI's reader makes it: no reasons.
    fn npu(n: u32, ts: u64, mhz: u32, util: u32, health: u32, pid: u32) -> GpuSample {
        GpuSample {
            ts,
            vendor: Vendor::Ascend,
            gpu: n,
            sm_clock_mhz: Some(mhz),
            max_sm_clock_mhz: Some(1800),
            utilization_pct: Some(util),
            health: Some(health),
            pids: vec![pid],
            ..GpuSample::default()
        }
    }

    #[test]
    fn a_busy_npu_below_its_peers_is_throttled_without_a_reason() {
        let r = ranks(&[(10, 0), (11, 1), (12, 2)]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        for t in 0..12 {
            for n in 0..3 {
                let mhz = if n == 1 && t >= 4 { 900 } else { 1800 };
                d.sample(
                    &npu(n, t * S + u64::from(n), mhz, 90, 0, 10 + n),
                    &r,
                    &step,
                    &mut out,
                );
            }
            // A GPU of the same index at a lower clock is no peer of theirs.
            d.sample(&sample(1, t * S + 5, 1200, 0, 99), &r, &step, &mut out);
        }
        assert_eq!(out.len(), 1, "{out:#?}");
        let f = &out[0];
        assert_eq!(f.kind, FindingKind::DeviceThrottled);
        assert_eq!(f.ranks, vec![1]);
        assert_eq!(f.step, Some(4));
        assert_eq!(f.evidence["source"], json!("dcmi"));
        assert_eq!(f.evidence["peer_sm_clock_mhz"], json!(1800));
        assert_eq!(f.evidence["reasons"], json!([]));
        assert!(
            f.summary
                .starts_with("device_throttled: rank 1's NPU 1 ran its AI Cores at 900 MHz"),
            "{}",
            f.summary
        );
        assert!(f.summary.contains("frequency below peers"), "{}", f.summary);
    }

    #[test]
    fn an_idle_npu_clocked_down_is_not_throttled() {
        let r = ranks(&[(10, 0), (11, 1)]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        for t in 0..10 {
            d.sample(&npu(0, t * S, 1800, 90, 0, 10), &r, &step, &mut out);
            d.sample(&npu(1, t * S + 1, 600, 3, 0, 11), &r, &step, &mut out);
        }
        assert!(out.is_empty(), "{out:#?}");
    }

    #[test]
    fn an_npu_error_code_names_its_rank_and_explains_its_health_alarm() {
        let r = ranks(&[(10, 0), (11, 1)]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        d.sample(&npu(1, 6 * S, 1800, 90, 0, 11), &r, &step, &mut out);
        // The reader hands the code before the sample that shows the alarm.
        d.xid(
            &GpuXid {
                ts: 7 * S,
                vendor: Vendor::Ascend,
                gpu: 1,
                xid: 0x80E0_1801,
                pids: vec![11],
            },
            &r,
            &step,
            &mut out,
        );
        d.sample(&npu(1, 7 * S, 1800, 90, 2, 11), &r, &step, &mut out);
        d.sample(&npu(1, 8 * S, 1800, 90, 2, 11), &r, &step, &mut out);
        assert_eq!(out.len(), 1, "{out:#?}");
        assert_eq!(
            out[0].summary,
            "device_error: rank 1's NPU 1 listed error code 0x80E01801 in step 7"
        );
        assert_eq!(out[0].evidence["error_code"], json!("0x80E01801"));
        // An alarm with no code: its own finding, once per rise.
        d.sample(&npu(0, 8 * S, 1800, 90, 0, 10), &r, &step, &mut out);
        for t in 9..12 {
            d.sample(&npu(0, t * S, 1800, 90, 1, 10), &r, &step, &mut out);
        }
        d.sample(&npu(0, 12 * S, 1800, 90, 3, 10), &r, &step, &mut out);
        let health: Vec<&str> = out[1..].iter().map(|f| f.summary.as_str()).collect();
        assert_eq!(
            health,
            [
                "device_error: rank 0's NPU 0 reported health minor alarm in step 9",
                "device_error: rank 0's NPU 0 reported health critical alarm in step 12",
            ]
        );
    }

    fn sample(gpu: u32, ts: u64, mhz: u32, reasons: u64, pid: u32) -> GpuSample {
        GpuSample {
            ts,
            gpu,
            sm_clock_mhz: Some(mhz),
            max_sm_clock_mhz: Some(1980),
            clock_event_reasons: Some(reasons),
            pids: vec![pid],
            ..GpuSample::default()
        }
    }

    fn step(_pid: u32, ts: u64) -> Option<u64> {
        Some(ts / S)
    }

    /// Four GPUs, one rank each; GPU 2 drops to `mhz` from second `from`.
    fn run(mhz: u32, from: u64, seconds: u64) -> Vec<Finding> {
        let r = ranks(&[(10, 0), (11, 1), (12, 2), (13, 3)]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        for t in 0..seconds {
            for g in 0..4 {
                let (clock, reasons) = if g == 2 && t >= from {
                    (mhz, 0x20)
                } else {
                    (1980, 0)
                };
                d.sample(
                    &sample(g, t * S + u64::from(g), clock, reasons, 10 + g),
                    &r,
                    &step,
                    &mut out,
                );
            }
        }
        out
    }

    #[test]
    fn a_gpu_below_its_peers_for_long_enough_is_throttled_with_its_reason() {
        let out = run(990, 3, 12);
        assert_eq!(out.len(), 1, "{out:#?}");
        let f = &out[0];
        assert_eq!(f.kind, FindingKind::DeviceThrottled);
        assert_eq!(f.ranks, vec![2]);
        assert_eq!(f.step, Some(3));
        assert_eq!(
            f.evidence["onset_after_step"],
            json!(2),
            "the last sample at full clock"
        );
        assert_eq!(f.evidence["reasons"], json!(["sw_thermal_slowdown"]));
        assert_eq!(f.evidence["peer_sm_clock_mhz"], json!(1980));
        assert_eq!(f.evidence["sm_clock_mhz"], json!(990));
        assert!(
            f.summary.contains("rank 2's GPU 2 ran its SMs at 990 MHz"),
            "{}",
            f.summary
        );
        assert!(f.summary.contains("sw_thermal_slowdown"), "{}", f.summary);
    }

    #[test]
    fn a_short_dip_or_a_small_gap_is_nothing() {
        assert!(run(990, 9, 12).is_empty(), "3 s below: under the 5 s");
        assert!(run(1900, 0, 12).is_empty(), "4 % below: under the 10 %");
        assert!(run(1980, 0, 12).is_empty());
    }

    #[test]
    fn a_gpu_clocked_down_for_no_reason_but_idleness_is_not_throttled() {
        let r = ranks(&[(10, 0), (11, 1)]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        for t in 0..10 {
            d.sample(&sample(0, t * S, 1980, 0, 10), &r, &step, &mut out);
            d.sample(&sample(1, t * S + 1, 345, 0x1, 11), &r, &step, &mut out);
        }
        assert!(out.is_empty(), "{out:#?}");
    }

    #[test]
    fn a_gpu_without_a_rank_gives_nothing() {
        let r = ranks(&[]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        for t in 0..10 {
            d.sample(&sample(0, t * S, 500, 0x40, 99), &r, &step, &mut out);
        }
        d.xid(
            &GpuXid {
                ts: 0,
                vendor: Vendor::Nvidia,
                gpu: 0,
                xid: 79,
                pids: vec![99],
            },
            &r,
            &step,
            &mut out,
        );
        assert!(out.is_empty(), "{out:#?}");
    }

    #[test]
    fn an_xid_names_the_rank_on_its_gpu_once() {
        let r = ranks(&[(10, 0), (11, 1)]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        let x = GpuXid {
            ts: 7 * S,
            vendor: Vendor::Nvidia,
            gpu: 1,
            xid: 79,
            pids: vec![11],
        };
        d.xid(&x, &r, &step, &mut out);
        d.xid(&x, &r, &step, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].kind, FindingKind::DeviceError);
        assert_eq!(out[0].ranks, vec![1]);
        assert_eq!(out[0].step, Some(7));
        assert_eq!(
            out[0].summary,
            "device_error: rank 1's GPU 1 raised Xid 79 in step 7"
        );
    }

    #[test]
    fn new_ecc_errors_are_a_device_error() {
        let r = ranks(&[(10, 0)]);
        let mut d = GpuHealthDetector::default();
        let mut out = Vec::new();
        for (t, ecc) in [(0, 0), (1, 0), (2, 2)] {
            let mut s = sample(0, t * S, 1980, 0, 10);
            s.ecc_uncorrected = Some(ecc);
            d.sample(&s, &r, &step, &mut out);
        }
        assert_eq!(out.len(), 1, "{out:#?}");
        assert!(
            out[0].summary.contains("2 new uncorrected ECC errors"),
            "{}",
            out[0].summary
        );
    }
}
