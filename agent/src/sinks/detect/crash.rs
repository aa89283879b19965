//! `crash`: a traced process killed by a signal (the exit code its last
//! thread left, read by the kernel's exit program).

use serde_json::json;

use super::Ranks;
use crate::events::Exit;
use crate::model::{Finding, FindingKind};

pub struct CrashDetector;

/// A signal's name ("SIGABRT"), or its number.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

impl CrashDetector {
    /// The last thread of a process exited.
    pub fn process_ended(&mut self, exit: &Exit, ranks: &Ranks, out: &mut Vec<Finding>) {
        let Some(sig) = exit.killed_by() else {
            return;
        };
        let code = exit.exit_code.unwrap_or(0);
        let core = code & 0x80 != 0;
        let name = signal_name(sig);
        // Signals another process sends to stop a job (a launcher, an
        // operator) are told apart from a fault of the process itself.
        let sent = matches!(
            sig,
            libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGKILL
        );
        out.push(Finding {
            kind: FindingKind::Crash,
            ranks: ranks.of(exit.tgid).into_iter().collect(),
            comm: None,
            seq: None,
            step: None,
            start_ns: exit.ts,
            end_ns: Some(exit.ts),
            summary: format!(
                "crash: {} ({}) was killed by {name}{}{}",
                ranks.describe(exit.tgid),
                exit.comm.as_str(),
                if core { ", core dumped" } else { "" },
                if sent {
                    " (usually sent by another process: a launcher stopping the job, \
                     an operator, the OOM killer)"
                } else {
                    ""
                }
            ),
            evidence: json!({
                "pid": exit.tgid,
                "tid": exit.tid,
                "name": exit.comm.as_str(),
                "signal": sig,
                "signal_name": name,
                "core_dumped": core,
            }),
            detected_ns: exit.ts,
        });
    }
}
