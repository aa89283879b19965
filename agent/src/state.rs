//! Kernel task states: from the raw `__state` the sched_switch tracepoint
//! passes to the "report" encoding ftrace and Perfetto use (one bit per
//! letter: 0 R, 0x1 S, 0x2 D, 0x4 T, 0x8 t, 0x10 X, 0x20 Z, 0x40 P, 0x80 I,
//! 0x100 R+), as the kernel's `__trace_sched_switch_state` does.

const TASK_REPORT: u32 = 0x7f;
const TASK_DEAD: u32 = 0x80;
const TASK_NOLOAD: u32 = 0x400;
const TASK_UNINTERRUPTIBLE: u32 = 0x2;
const TASK_IDLE: u32 = TASK_UNINTERRUPTIBLE | TASK_NOLOAD;
const TASK_RTLOCK_WAIT: u32 = 0x1000;

/// Report value for a switched-out task.
pub const REPORT_PREEMPTED: i64 = 0x100;
pub const REPORT_IDLE: i64 = 0x80;
pub const REPORT_DEAD: i64 = 0x10;
pub const REPORT_ZOMBIE: i64 = 0x20;

/// The report-format state of a task switched out with raw state `raw`.
pub fn report_state(raw: u32, preempt: bool) -> i64 {
    if preempt {
        return REPORT_PREEMPTED;
    }
    if raw == TASK_IDLE {
        return REPORT_IDLE;
    }
    if raw == TASK_RTLOCK_WAIT {
        return TASK_UNINTERRUPTIBLE as i64;
    }
    if raw & TASK_DEAD != 0 {
        // Its exit_state (zombie or dead) is not carried; it will not run again.
        return REPORT_DEAD;
    }
    let bits = raw & TASK_REPORT;
    if bits == 0 {
        return 0;
    }
    1i64 << (31 - bits.leading_zeros())
}

/// A human label for a report state (for summaries).
pub fn label(report: i64) -> &'static str {
    match report {
        0 => "runnable",
        0x1 => "sleeping",
        0x2 => "uninterruptible",
        0x4 => "stopped",
        0x8 => "traced",
        0x10 => "dead",
        0x20 => "zombie",
        0x40 => "parked",
        0x80 => "idle",
        0x100 => "preempted",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_kernel_states_like_ftrace() {
        assert_eq!(report_state(0, true), 0x100, "preempted wins");
        assert_eq!(report_state(0, false), 0);
        assert_eq!(report_state(0x1, false), 0x1);
        assert_eq!(report_state(0x2, false), 0x2);
        assert_eq!(report_state(0x102, false), 0x2, "TASK_KILLABLE is D");
        assert_eq!(report_state(0x2001, false), 0x1, "freezable sleep is S");
        assert_eq!(report_state(0x402, false), 0x80, "TASK_IDLE is I");
        assert_eq!(report_state(0x1000, false), 0x2, "rtlock wait is D");
        assert_eq!(report_state(0x80, false), 0x10, "TASK_DEAD");
        assert_eq!(report_state(0x40, false), 0x40, "parked");
        assert_eq!(label(report_state(0x1, false)), "sleeping");
    }
}
