//! `device_error`: a device-library call failed with a status that is not
//! out of memory and not a routine "not yet" (`catalog::status`): a lost
//! or missing device, a driver too old, an illegal address, an ECC error,
//! a failed launch, a communicator's system error. Most of these are
//! sticky (every later call of the process fails the same way), so the
//! finding is once per process and code, at the first failure; later
//! failures with that code are counted, not reported.
//!
//! A failed allocation with such a code is this finding, never
//! `device_oom` (`oom.rs` leaves it): the memory was not the problem.

use foldhash::HashMap;
use std::collections::HashSet;

use serde_json::json;
use xpuscope_probes::catalog::status;

use super::Ranks;
use crate::model::{DeviceCallRecord, Finding, FindingKind, site_label};

#[derive(Default)]
pub struct DeviceErrorDetector {
    /// (process, library name, code) already reported.
    reported: HashSet<(u32, &'static str, i64)>,
    /// Later failures with a reported code, per process (not findings).
    pub repeats: HashMap<u32, u64>,
}

/// Whether `c` failed with a device error (not out of memory on an
/// allocation, not a routine answer): its code.
pub fn device_error_code(c: &DeviceCallRecord) -> Option<i64> {
    let call = &c.call;
    let code = call.ret.filter(|_| call.error)?;
    if status::is_routine(call.library, code) {
        return None;
    }
    let allocation = call
        .memory
        .as_ref()
        .is_some_and(|m| m.failed_request.is_some());
    if allocation && status::is_out_of_memory(call.library, code) {
        return None;
    }
    Some(code)
}

impl DeviceErrorDetector {
    pub fn device_call(
        &mut self,
        c: &DeviceCallRecord,
        step: Option<u64>,
        ranks: &Ranks,
        out: &mut Vec<Finding>,
    ) {
        let Some(code) = device_error_code(c) else {
            return;
        };
        let call = &c.call;
        if !self.reported.insert((call.tgid, call.library.name(), code)) {
            *self.repeats.entry(call.tgid).or_default() += 1;
            return;
        }
        let name = status::status_name(call.library, code);
        let who = ranks.describe(call.tgid);
        let stack = c.site.as_ref().map(|s| site_label(Some(s)));
        let at = stack
            .as_deref()
            .map(|s| format!(" at {s}"))
            .unwrap_or_default();
        let in_step = step.map(|s| format!(" in step {s}")).unwrap_or_default();
        let allocation = call
            .memory
            .as_ref()
            .and_then(|m| m.failed_request)
            .map(|bytes| format!(" (an allocation of {} MiB; not out of memory)", bytes >> 20))
            .unwrap_or_default();
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::DeviceError,
            ranks: ranks.of(call.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step,
            start_ns: call.start_ts,
            end_ns: Some(c.end_ts()),
            summary: format!(
                "device_error: {who}'s {} returned {name} ({code}){in_step}{allocation}{at}",
                call.function
            ),
            evidence: json!({
                "pid": call.tgid,
                "tid": call.tid,
                "library": call.library.name(),
                "function": call.function,
                "code": code,
                "code_name": name,
                "requested_bytes": call.memory.as_ref().and_then(|m| m.failed_request),
                "stack": stack,
            }),
            detected_ns: c.end_ts(),
        });
    }

    pub fn process_ended(&mut self, tgid: u32) {
        self.reported.retain(|k| k.0 != tgid);
        self.repeats.remove(&tgid);
    }

    #[cfg(test)]
    pub fn forgot(&self, tgid: u32) -> bool {
        !self.reported.iter().any(|k| k.0 == tgid) && !self.repeats.contains_key(&tgid)
    }
}
