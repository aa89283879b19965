//! `device_oom`: a device allocation failed. The finding names the
//! request, the allocating stack and the largest live sites on that
//! device (what holds the memory), as the interpret stage attached them.

use serde_json::json;
use xpuscope_probes::catalog::Vendor;

use super::Ranks;
use crate::model::{DeviceCallRecord, Finding, FindingKind, site_label};

pub struct OomDetector;

impl OomDetector {
    pub fn device_call(&mut self, c: &DeviceCallRecord, ranks: &Ranks, out: &mut Vec<Finding>) {
        let call = &c.call;
        let Some(m) = &call.memory else {
            return;
        };
        let Some(requested) = m.failed_request else {
            return;
        };
        let device = format!(
            "{}{}",
            match m.device.vendor {
                Vendor::Nvidia => "gpu",
                Vendor::Ascend => "npu",
            },
            m.device.index
        );
        let stack = site_label(c.site.as_ref());
        let live: Vec<_> = c
            .oom
            .iter()
            .flatten()
            .map(|r| {
                json!({
                    "bytes": r.bytes,
                    "allocations": r.allocations,
                    "stack": site_label(r.site.as_ref()),
                })
            })
            .collect();
        let who = ranks.describe(call.tgid);
        let largest = c
            .oom
            .as_ref()
            .and_then(|rows| rows.first())
            .map(|r| {
                format!(
                    "; the largest live site holds {} MiB ({})",
                    r.bytes >> 20,
                    site_label(r.site.as_ref())
                )
            })
            .unwrap_or_default();
        out.push(Finding {
            kind: FindingKind::DeviceOom,
            ranks: ranks.of(call.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step: None,
            start_ns: call.start_ts,
            end_ns: Some(c.end_ts()),
            summary: format!(
                "device_oom: {who} failed to allocate {} MiB on {device} in {} at {stack} \
                 with {} MiB held{largest}",
                requested >> 20,
                call.function,
                m.held_after >> 20,
            ),
            evidence: json!({
                "pid": call.tgid,
                "tid": call.tid,
                "function": call.function,
                "device": device,
                "requested_bytes": requested,
                "held_bytes": m.held_after,
                "return": call.ret,
                "stack": stack,
                "largest_live_sites": live,
            }),
            detected_ns: c.end_ts(),
        });
    }
}
