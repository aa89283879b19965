//! `crash`: a traced process killed by a signal (the exit code its last
//! thread left, read by the kernel's exit program).
//!
//! A job in trouble is stopped from outside: after one rank crashed or a
//! collective hung, the launcher (torchrun, mpirun, the scheduler) sends
//! its other ranks SIGTERM, then SIGKILL. Those deaths are the
//! consequence, not more crashes: once a job has a `hang`, `crash` or
//! `device_oom` finding, its ranks killed by a stop signal (SIGTERM, SIGINT, SIGHUP,
//! SIGKILL) are counted in `stopped_after_trouble`, not reported. A fault
//! signal (SIGSEGV, SIGABRT, SIGBUS, ...) is always a crash. The trouble
//! ends when the job gets a new rank (an elastic restart).
//!
//! A traced process that is no rank (a launcher's helper, a tool it
//! started) stopped by a stop signal is how a launcher tidies up at the
//! end of a job, not a fault: counted in `stopped_without_rank`, not
//! reported.

use foldhash::HashMap;

use serde_json::json;

use super::Ranks;
use crate::events::Exit;
use crate::model::sched::signal_name;
use crate::model::{Finding, FindingKind};

#[derive(Default)]
pub struct CrashDetector {
    /// Jobs (by label, see [`Ranks::job_of`]) with a hang, crash or
    /// device OOM finding: the finding's kind and ranks.
    troubled: HashMap<String, (FindingKind, Vec<u32>)>,
    /// Ranks killed by a stop signal in a troubled job (not reported).
    pub stopped_after_trouble: u64,
    /// Processes without a rank killed by a stop signal (not reported).
    pub stopped_without_rank: u64,
}

/// Signals another process sends to stop a job (a launcher, an operator,
/// the OOM killer), as opposed to a fault of the process itself.
fn is_stop_signal(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGKILL
    )
}

impl CrashDetector {
    /// New findings: a `hang`, `crash` or `device_oom` puts its job in
    /// trouble.
    pub fn note_trouble(&mut self, new: &[Finding], ranks: &Ranks) {
        for f in new {
            if !matches!(
                f.kind,
                FindingKind::Hang
                    | FindingKind::Crash
                    | FindingKind::DeviceOom
                    | FindingKind::DeviceError
            ) {
                continue;
            }
            // A crash names its process; a hang its stuck members.
            let pid = f
                .evidence
                .get("pid")
                .or_else(|| f.evidence["stuck"].get(0)?.get("pid"));
            let job = pid
                .and_then(|p| p.as_u64())
                .map(|pid| ranks.job_of(pid as u32))
                .or_else(|| f.ranks.first().and_then(|&r| ranks.job_of_rank(r)))
                .unwrap_or("");
            self.troubled
                .entry(job.to_string())
                .or_insert_with(|| (f.kind, f.ranks.clone()));
        }
    }

    /// A new rank of `job` appeared: the job runs again.
    pub fn job_restarted(&mut self, job: &str) {
        self.troubled.remove(job);
    }

    /// The last thread of a process exited (at `step` of its training,
    /// where known).
    pub fn process_ended(
        &mut self,
        exit: &Exit,
        step: Option<u64>,
        ranks: &Ranks,
        out: &mut Vec<Finding>,
    ) {
        let Some(sig) = exit.killed_by() else {
            return;
        };
        let sent = is_stop_signal(sig);
        if sent && ranks.of(exit.tgid).is_none() {
            self.stopped_without_rank += 1;
            return;
        }
        if sent && self.troubled.contains_key(ranks.job_of(exit.tgid)) {
            self.stopped_after_trouble += 1;
            return;
        }
        let code = exit.exit_code.unwrap_or(0);
        let core = code & 0x80 != 0;
        let name = signal_name(sig);
        out.push(Finding {
            link: Default::default(),
            kind: FindingKind::Crash,
            ranks: ranks.of(exit.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step,
            start_ns: exit.ts,
            end_ns: Some(exit.ts),
            summary: format!(
                "crash: {} (pid {}) was killed by {name}{}{}{}",
                ranks.describe(exit.tgid),
                exit.tgid,
                match step {
                    Some(s) => format!(" in step {s}"),
                    None => String::new(),
                },
                if core { ", core dumped" } else { "" },
                if sent {
                    " (usually sent by another process: a launcher stopping the job, \
                     an operator, the OOM killer)"
                } else {
                    ""
                }
            ),
            evidence: json!({
                "step_source": super::collective::step_source(exit.tgid, ranks),
                "pid": exit.tgid,
                "tid": exit.tid,
                // The last thread to exit (not necessarily the one the
                // signal hit).
                "last_thread": exit.comm.as_str(),
                "signal": sig,
                "signal_name": name,
                "core_dumped": core,
                "stop_signal": sent,
            }),
            detected_ns: exit.ts,
        });
    }
}
