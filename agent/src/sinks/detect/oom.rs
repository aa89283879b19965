//! `device_oom`: a device allocation failed for want of memory (the
//! library's out-of-memory status; any other status is a `device_error`), and the process did not get
//! the memory on retry. The finding names the request, the allocating
//! stack and the largest live sites on that device (what holds the
//! memory), as the interpret stage attached them.
//!
//! Why a failure waits before it is reported: the frameworks' caching
//! allocators answer a failed `cudaMalloc` / `aclrtMalloc` by releasing
//! their cached blocks and trying once more (PyTorch's
//! `release_cached_blocks`; seen on an H100 with PyTorch 2.11: two failed
//! `cudaMalloc`s of the same size 10 ms apart, 128 MiB released between
//! them, for the one `torch.OutOfMemoryError` the job saw). So a failure
//! is held for [`SETTLE_NS`]: an allocation of at least the failed size
//! by the same process on the same device in that time means the retry
//! worked (no finding: the job never saw an error); another failure of the
//! same process and device is the retry failing, and joins the first. The
//! finding comes when the time is up, when the process exits (so a crash
//! that follows is explained by it), or at the end.

use foldhash::HashMap;

use serde_json::json;
use xpuscope_probes::catalog::{Vendor, status};
use xpuscope_probes::decode::memory::Device;

use super::Ranks;
use crate::model::{DeviceCallRecord, Finding, FindingKind, site_label};

/// How long a failed allocation waits for the allocator's retry.
pub const SETTLE_NS: u64 = 1_000_000_000;

/// A process's failed allocation on one device, not yet reported.
struct Pending {
    /// The last failed call (its stack and live sites are the finding's).
    last: Box<DeviceCallRecord>,
    requested: u64,
    attempts: u32,
    /// Bytes held after the first failure (what the retries released is
    /// the difference).
    first_held: u64,
    /// When the first failure returned.
    end: u64,
}

#[derive(Default)]
pub struct OomDetector {
    pending: HashMap<(u32, Device), Pending>,
    /// Failed allocations the process got on retry (no finding).
    pub recovered: u64,
}

impl OomDetector {
    pub fn device_call(&mut self, c: &DeviceCallRecord, ranks: &Ranks, out: &mut Vec<Finding>) {
        let call = &c.call;
        // Anything that waited its time out is settled first.
        self.tick(call.start_ts, ranks, out);
        let Some(m) = &call.memory else {
            return;
        };
        let key = (call.tgid, m.device);
        // An allocation that failed for another reason than memory (a lost
        // device, a sticky error of an earlier kernel) is a device error
        // (`device_error.rs`), and no retry of the allocator mends it.
        let out_of_memory = call
            .ret
            .is_some_and(|code| status::is_out_of_memory(call.library, code));
        match m.failed_request {
            Some(_) if !out_of_memory => {}
            Some(requested) => {
                let end = c.end_ts();
                match self.pending.get_mut(&key) {
                    // The retry: it joins the first failure, whose time it
                    // does not extend (a process that retries for good is
                    // still reported once a settling time has passed).
                    Some(p) if p.requested == requested => {
                        p.attempts += 1;
                        *p.last = c.clone();
                    }
                    _ => {
                        // A different request: the earlier one stands alone.
                        if let Some(p) = self.pending.remove(&key) {
                            out.push(finding(&p, call.start_ts, ranks));
                        }
                        self.pending.insert(
                            key,
                            Pending {
                                last: Box::new(c.clone()),
                                requested,
                                attempts: 1,
                                first_held: m.held_after,
                                end,
                            },
                        );
                    }
                }
            }
            None => {
                let got = u64::try_from(m.delta).unwrap_or(0);
                if self
                    .pending
                    .get(&key)
                    .is_some_and(|p| !call.error && got >= p.requested)
                {
                    self.pending.remove(&key);
                    self.recovered += 1;
                }
            }
        }
    }

    /// Reports the failures whose time to recover is up at `now`.
    pub fn tick(&mut self, now: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        self.report(
            |_, p| now.saturating_sub(p.end) >= SETTLE_NS,
            now,
            ranks,
            out,
        );
    }

    /// The process is gone: its failures are final (reported before the
    /// detectors forget its rank).
    pub fn process_ended(&mut self, tgid: u32, ts: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        self.report(|k, _| k.0 == tgid, ts, ranks, out);
    }

    /// The end: every failure still waiting is reported.
    pub fn finish(&mut self, end: u64, ranks: &Ranks, out: &mut Vec<Finding>) {
        self.report(|_, _| true, end, ranks, out);
    }

    /// Reports (and forgets) the failures `due` picks, oldest first, as
    /// known at `now`.
    fn report(
        &mut self,
        due: impl Fn(&(u32, Device), &Pending) -> bool,
        now: u64,
        ranks: &Ranks,
        out: &mut Vec<Finding>,
    ) {
        if self.pending.is_empty() {
            return;
        }
        let mut keys: Vec<(u32, Device)> = self
            .pending
            .iter()
            .filter(|(k, p)| due(k, p))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_by_key(|k| self.pending[k].end);
        for k in keys {
            if let Some(p) = self.pending.remove(&k) {
                out.push(finding(&p, now, ranks));
            }
        }
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.pending.keys().any(|k| k.0 == tgid)
    }
}

/// The finding of a failure that stands, known at `now` (at most its
/// settling time after the last attempt).
fn finding(p: &Pending, now: u64, ranks: &Ranks) -> Finding {
    let c = &p.last;
    let call = &c.call;
    let held = call.memory.as_ref().map_or(0, |m| m.held_after);
    let device = format!(
        "{}{}",
        match call.memory.as_ref().map(|m| m.device.vendor) {
            Some(Vendor::Ascend) => "npu",
            _ => "gpu",
        },
        call.memory.as_ref().map_or(0, |m| m.device.index)
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
    let released = p.first_held.saturating_sub(held);
    let retried = match p.attempts {
        1 => String::new(),
        n => format!(
            " ({n} attempts; {} MiB released between them)",
            released >> 20
        ),
    };
    Finding {
        link: Default::default(),
        kind: FindingKind::DeviceOom,
        ranks: ranks.of(call.tgid).into_iter().collect(),
        comm: None,
        seq: None,
        step: None,
        start_ns: call.start_ts,
        end_ns: Some(c.end_ts()),
        summary: format!(
            "device_oom: {who} failed to allocate {} MiB on {device} in {}{retried} at {stack} \
             with {} MiB held{largest}",
            p.requested >> 20,
            call.function,
            held >> 20,
        ),
        evidence: json!({
            "pid": call.tgid,
            "tid": call.tid,
            "function": call.function,
            "device": device,
            "requested_bytes": p.requested,
            "held_bytes": held,
            "attempts": p.attempts,
            "released_between_attempts_bytes": released,
            "return": call.ret,
            "stack": stack,
            "largest_live_sites": live,
        }),
        detected_ns: now.clamp(p.end, p.end.saturating_add(SETTLE_NS)),
    }
}
