//! Findings: what the detectors (`crate::sinks::detect`) concluded from the
//! record stream, in the JSON contract other tools read
//! (`xpuscope-findings/1`, documented in the book: `docs/src/reference/findings-json.md`).

use serde::Serialize;
use serde_json::Value;

/// The findings JSON's schema name.
pub const FINDINGS_SCHEMA: &str = "xpuscope-findings/1";

/// What was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// A collective or sync in flight longer than the hang timeout.
    Hang,
    /// A device allocation failed for want of memory.
    DeviceOom,
    /// A device-library call failed with an error that is not out of
    /// memory (a lost device, an illegal address, an ECC error, ...).
    DeviceError,
    /// A traced process was killed by a signal.
    Crash,
    /// A rank's GPU ran its SMs below its peers' clock for a while (a
    /// thermal or power slowdown, as NVML names it).
    DeviceThrottled,
    /// A rank's training thread kept off its CPU by other processes.
    HostContention,
    /// A rank's training thread busy in its own host code while its
    /// device and peers wait (its steps turned host-bound, its peers' not).
    HostBound,
    /// A rank's training thread waited for its data loader.
    DataloaderStall,
    /// A rank's device memory growing every step at one site.
    MemoryLeak,
    /// A rank persistently arrives last at a communicator's collectives.
    SlowRank,
    /// A rank arrived late at one collective.
    LateArrival,
    /// Collectives of the communicators through one rank are slow for
    /// every member, nobody arriving late.
    SlowLink,
}

impl FindingKind {
    pub const ALL: [FindingKind; 12] = [
        FindingKind::Hang,
        FindingKind::DeviceOom,
        FindingKind::DeviceError,
        FindingKind::Crash,
        FindingKind::HostContention,
        FindingKind::HostBound,
        FindingKind::DataloaderStall,
        FindingKind::MemoryLeak,
        FindingKind::SlowRank,
        FindingKind::LateArrival,
        FindingKind::SlowLink,
        FindingKind::DeviceThrottled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::Hang => "hang",
            FindingKind::DeviceOom => "device_oom",
            FindingKind::DeviceError => "device_error",
            FindingKind::Crash => "crash",
            FindingKind::HostContention => "host_contention",
            FindingKind::HostBound => "host_bound",
            FindingKind::DataloaderStall => "dataloader_stall",
            FindingKind::MemoryLeak => "memory_leak",
            FindingKind::SlowRank => "slow_rank",
            FindingKind::LateArrival => "late_arrival",
            FindingKind::SlowLink => "slow_link",
            FindingKind::DeviceThrottled => "device_throttled",
        }
    }
}

/// Where a finding stands among the others of its document: `id`,
/// `incident` and `cause` are set when the findings are grouped into
/// incidents (`crate::sinks::detect::incidents`: `agent diagnose`, the end
/// of `agent attach`), absent on a finding streamed the moment it was made
/// (the trace's track, a service dump's trigger), when its consequences
/// were not known yet; such a finding has `follows_from` instead when an
/// earlier one explains it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IncidentLink {
    /// The finding's number in its document (1-based).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<u32>,
    /// The incident it belongs to: one per fault (1-based, roots' order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub incident: Option<u32>,
    /// The `id` of the finding it follows from; absent on a root.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<u32>,
    /// On a finding streamed the moment it was made (a service's log,
    /// dumps and metrics, a trace's findings track): the headline of an
    /// earlier finding of the same run of the same job that explains it,
    /// so a consequence (a peer that waited for the slow rank, a hang
    /// waiting for the crashed one) says so when it comes out, before the
    /// run's findings are all known. A grouped document has `cause`
    /// instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub follows_from: Option<String>,
}

/// One finding, as the contract has it (`detected_ns` is not part of it:
/// when the detector fired, for the record stream's order).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    #[serde(flatten)]
    pub link: IncidentLink,
    pub kind: FindingKind,
    /// Global ranks (`RANK` of the processes' environment).
    pub ranks: Vec<u32>,
    /// The communicator's kind and identity as the trace shows it
    /// (`nccl:<comm_hash>`), for collective findings.
    pub comm: Option<String>,
    /// The operation's sequence number on `comm`.
    pub seq: Option<u64>,
    /// The training step, when known.
    pub step: Option<u64>,
    /// CLOCK_BOOTTIME ns.
    pub start_ns: u64,
    pub end_ns: Option<u64>,
    /// A sentence a person can act on.
    pub summary: String,
    /// The numbers and names that fired it (a JSON object).
    pub evidence: Value,
    #[serde(skip)]
    pub detected_ns: u64,
}

impl Finding {
    /// The summary as a line that starts with the kind ("hang: ..."):
    /// most summaries begin with it, the rest ("rank 1 arrived ...") get it.
    pub fn headline(&self) -> String {
        let kind = self.kind.as_str();
        match self.summary.strip_prefix(kind) {
            Some(rest) if rest.starts_with(": ") => self.summary.clone(),
            _ => format!("{kind}: {}", self.summary),
        }
    }
}

/// The findings JSON document.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FindingsDoc<'a> {
    pub schema: &'static str,
    pub findings: &'a [Finding],
}

impl<'a> FindingsDoc<'a> {
    pub fn new(findings: &'a [Finding]) -> Self {
        Self {
            schema: FINDINGS_SCHEMA,
            findings,
        }
    }
}

/// A communicator as findings (and the trace's `comm_hash`) name it.
pub fn comm_name(library: &str, id_hash: u64) -> String {
    format!("{library}:{id_hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializes_to_the_contract() {
        let f = Finding {
            link: Default::default(),
            kind: FindingKind::DeviceOom,
            ranks: vec![3],
            comm: None,
            seq: None,
            step: Some(7),
            start_ns: 10,
            end_ns: Some(20),
            summary: "s".into(),
            evidence: serde_json::json!({"bytes": 5}),
            detected_ns: 20,
        };
        let v = serde_json::to_value(FindingsDoc::new(std::slice::from_ref(&f))).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"schema": "xpuscope-findings/1", "findings": [{
                "kind": "device_oom", "ranks": [3], "comm": null, "seq": null, "step": 7,
                "start_ns": 10, "end_ns": 20, "summary": "s", "evidence": {"bytes": 5}}]})
        );
    }
}
