//! What the kernel programs need of the running kernel, checked at start
//! from its BTF, so that a kernel too old for them is named with what it
//! lacks, instead of a verifier log.
//!
//! The kernel's BTF lists what it can do: `enum bpf_func_id` has one
//! enumerator per BPF helper it has, `enum bpf_map_type` one per map type,
//! `enum bpf_attach_type` one per attach type, and each raw tracepoint a
//! `btf_trace_<name>` typedef of its probe's signature. Version numbers
//! below are the mainline releases that added each; distribution kernels
//! backport, which is why the check reads the facts and not the version.

use crate::btf::Btf;

/// How a kernel shows it has a feature, in its BTF.
#[derive(Clone, Copy, Debug)]
enum Evidence {
    /// Enum `.0` has enumerator `.1`.
    Enumerator(&'static str, &'static str),
    /// Raw tracepoint `.0` exists and hands its programs at least `.1`
    /// arguments.
    TracepointArgs(&'static str, usize),
    /// A struct of this name exists (a subsystem built into the kernel).
    Struct(&'static str),
}

impl Evidence {
    fn holds(self, btf: &Btf) -> bool {
        match self {
            Evidence::Enumerator(e, v) => btf.has_enumerator(e, v),
            Evidence::TracepointArgs(tp, n) => btf.tracepoint_args(tp).is_some_and(|a| a >= n),
            Evidence::Struct(s) => btf.has_struct(s),
        }
    }
}

/// A kernel feature and the release that brought it.
#[derive(Clone, Copy, Debug)]
struct Feature {
    what: &'static str,
    since: &'static str,
    evidence: Evidence,
}

const fn helper(what: &'static str, since: &'static str, id: &'static str) -> Feature {
    Feature {
        what,
        since,
        evidence: Evidence::Enumerator("bpf_func_id", id),
    }
}

/// Without any of these the kernel programs do not load.
const REQUIRED: &[Feature] = &[
    Feature {
        what: "BTF-typed scheduler tracepoints (tp_btf on sched_switch)",
        since: "5.5",
        evidence: Evidence::TracepointArgs("sched_switch", 3),
    },
    Feature {
        what: "BPF ring buffers",
        since: "5.8",
        evidence: Evidence::Enumerator("bpf_map_type", "BPF_MAP_TYPE_RINGBUF"),
    },
    helper(
        "the bpf_probe_read_user helper",
        "5.5",
        "BPF_FUNC_probe_read_user",
    ),
    helper(
        "the bpf_ktime_get_boot_ns helper",
        "5.8",
        "BPF_FUNC_ktime_get_boot_ns",
    ),
    helper(
        "the bpf_get_current_task_btf helper",
        "5.11",
        "BPF_FUNC_get_current_task_btf",
    ),
    helper(
        "the bpf_task_pt_regs helper",
        "5.15",
        "BPF_FUNC_task_pt_regs",
    ),
    helper(
        "the bpf_get_attach_cookie helper",
        "5.15",
        "BPF_FUNC_get_attach_cookie",
    ),
    helper("the bpf_get_func_ip helper", "5.15", "BPF_FUNC_get_func_ip"),
];

/// The oldest mainline release with every [`REQUIRED`] feature.
pub const MINIMUM_KERNEL: &str = "5.15";

/// Without these the agent works with less; each says what.
const OPTIONAL: &[(Feature, &str)] = &[
    (
        Feature {
            what: "uprobes (CONFIG_UPROBE_EVENTS)",
            since: "4.x",
            evidence: Evidence::Struct("trace_uprobe"),
        },
        "no device-library calls are recorded (scheduling and stacks are)",
    ),
    (
        Feature {
            what: "uprobe-multi links",
            since: "6.6",
            evidence: Evidence::Enumerator("bpf_attach_type", "BPF_TRACE_UPROBE_MULTI"),
        },
        "device-library probes are one perf event per function: attaching and releasing a \
         library's probes take longer",
    ),
    (
        Feature {
            what: "`group_dead` on the sched_process_exit tracepoint",
            since: "6.16",
            evidence: Evidence::TracepointArgs("sched_process_exit", 2),
        },
        "a process's last exiting thread is read from its live-thread count instead",
    ),
    (
        Feature {
            what: "`prev_state` on the sched_switch tracepoint",
            since: "5.18",
            evidence: Evidence::TracepointArgs("sched_switch", 4),
        },
        "a switched-out thread's state is read from the task itself",
    ),
];

/// What the running kernel has of [`OPTIONAL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    pub uprobes: bool,
    pub uprobe_multi: bool,
    pub exit_group_dead: bool,
    pub switch_prev_state: bool,
}

/// The kernel lacks what the kernel programs need.
#[derive(Debug, thiserror::Error)]
#[error(
    "this kernel lacks what xpuscope's kernel programs need: {}. xpuscope needs Linux \
     {MINIMUM_KERNEL} or later (or a distribution kernel with these backported), built with BTF",
    .missing.join("; ")
)]
pub struct MissingFeatures {
    /// Each missing feature with the release that added it.
    pub missing: Vec<String>,
}

/// Checks the kernel's BTF for every [`REQUIRED`] feature; logs each
/// missing [`OPTIONAL`] one with what it costs.
pub fn check(btf: &Btf) -> Result<KernelFeatures, MissingFeatures> {
    let missing: Vec<String> = REQUIRED
        .iter()
        .filter(|f| !f.evidence.holds(btf))
        .map(|f| format!("{} (Linux {})", f.what, f.since))
        .collect();
    if !missing.is_empty() {
        return Err(MissingFeatures { missing });
    }
    let has = |i: usize| {
        let (f, without) = OPTIONAL[i];
        let present = f.evidence.holds(btf);
        if !present {
            tracing::info!(
                "this kernel has no {} (Linux {}): {without}",
                f.what,
                f.since
            );
        }
        present
    };
    Ok(KernelFeatures {
        uprobes: has(0),
        uprobe_multi: has(1),
        exit_group_dead: has(2),
        switch_prev_state: has(3),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running_kernel() -> Btf {
        Btf::from_file(std::path::Path::new(crate::btf::VMLINUX_BTF)).unwrap()
    }

    /// (Also run on 6.1 and 6.12 by `cargo xtask test --kernel`.)
    #[test]
    fn every_required_feature_is_here() {
        let btf = running_kernel();
        check(&btf).expect("every required feature");
        assert!(btf.tracepoint_args("sched_switch").is_some_and(|n| n >= 3));
        assert_eq!(btf.tracepoint_args("no_such_tracepoint"), None);
        assert!(!btf.has_enumerator("bpf_func_id", "BPF_FUNC_no_such_helper"));
    }

    #[test]
    fn this_kernel_has_the_optional_ones_too() {
        // The machines this project is built and tested on run 6.18.
        let btf = running_kernel();
        let features = check(&btf).expect("every required feature");
        assert_eq!(
            features,
            KernelFeatures {
                uprobes: true,
                uprobe_multi: true,
                exit_group_dead: true,
                switch_prev_state: true,
            }
        );
        assert_eq!(btf.tracepoint_args("sched_process_exit"), Some(2));
        assert_eq!(btf.tracepoint_args("sched_switch"), Some(4));
    }

    /// A BTF blob with `enum bpf_func_id { BPF_FUNC_probe_read_user }`
    /// and nothing else.
    fn one_helper() -> Vec<u8> {
        let strings = b"\0bpf_func_id\0BPF_FUNC_probe_read_user\0";
        let mut types = Vec::new();
        // 1: enum bpf_func_id, 4 bytes, one enumerator (= 112).
        for w in [1u32, (6 << 24) | 1, 4, 13, 112] {
            types.extend_from_slice(&w.to_le_bytes());
        }
        crate::btf::test_blob(&types, strings)
    }

    #[test]
    fn an_old_kernel_is_told_what_it_lacks_and_since_when() {
        let btf = Btf::parse(&one_helper()).unwrap();
        assert!(btf.has_enumerator("bpf_func_id", "BPF_FUNC_probe_read_user"));
        let err = check(&btf).unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains("bpf_probe_read_user helper"), "{msg}");
        for expected in [
            "BPF ring buffers (Linux 5.8)",
            "the bpf_task_pt_regs helper (Linux 5.15)",
            "tp_btf on sched_switch) (Linux 5.5)",
            "xpuscope needs Linux 5.15 or later",
        ] {
            assert!(msg.contains(expected), "{expected:?} in {msg}");
        }
        assert_eq!(err.missing.len(), REQUIRED.len() - 1);
    }
}
