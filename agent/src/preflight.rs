//! Checks before anything is loaded, each failing with what is wrong and
//! what to do about it.

use std::fs::File;
use std::path::Path;

use crate::procfs;

#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error(
        "xpuscope needs root (or the CAP_BPF and CAP_PERFMON capabilities, plus CAP_SYS_ADMIN \
         for device-library uprobes) to load its eBPF programs; run it with sudo"
    )]
    NotPrivileged,
    #[error(
        "no process with pid {0}: check the pid (e.g. `ps -p {0}`) and that it is still running"
    )]
    NoSuchProcess(u32),
    #[error("pid {0} is a zombie (it has exited); nothing left to trace")]
    Zombie(u32),
    /// The OS error is part of the message and deliberately not a
    /// `#[source]`: printed as a chain (`{:#}`) it would appear twice.
    #[error("cannot write the trace to {path}: {error}; choose a writable path with -o")]
    Output { path: String, error: std::io::Error },
    #[error(
        "the eBPF programs are not built into this agent: run `cargo xtask build-ebpf`, then rebuild the agent"
    )]
    NoEbpfObject,
}

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Effective capabilities from `/proc/self/status`.
fn effective_caps() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("CapEff:"))?.to_string();
            u64::from_str_radix(line.split_whitespace().nth(1)?, 16).ok()
        })
        .unwrap_or(0)
}

pub fn check_privileges() -> Result<(), PreflightError> {
    let privileges = privileges(effective_caps());
    if privileges == Privileges::SchedulerOnly {
        tracing::warn!(
            "CAP_BPF and CAP_PERFMON without CAP_SYS_ADMIN: scheduling is recorded, but the \
             kernel's uprobes ask for CAP_SYS_ADMIN, so no device-library call will be; run \
             with sudo or add CAP_SYS_ADMIN"
        );
    }
    match privileges {
        Privileges::None => Err(PreflightError::NotPrivileged),
        _ => Ok(()),
    }
}

/// What a set of effective capabilities lets the agent record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Privileges {
    /// Neither root-equivalent nor CAP_BPF with CAP_PERFMON.
    None,
    /// The eBPF programs and tracepoints load, but the uprobe PMU checks
    /// CAP_SYS_ADMIN: device-library probes would fail.
    SchedulerOnly,
    All,
}

fn privileges(caps: u64) -> Privileges {
    let has = |cap: u32| caps & (1 << cap) != 0;
    if has(CAP_SYS_ADMIN) {
        Privileges::All
    } else if has(CAP_BPF) && has(CAP_PERFMON) {
        Privileges::SchedulerOnly
    } else {
        Privileges::None
    }
}

/// Resolves the pid to trace: the process (tgid) owning it.
pub fn check_target(pid: u32) -> Result<u32, PreflightError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|_| PreflightError::NoSuchProcess(pid))?;
    let tgid = status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(pid);
    if !procfs::is_alive(tgid) {
        return Err(PreflightError::Zombie(tgid));
    }
    Ok(tgid)
}

/// Creates (truncates) the output file now, so a bad path fails before
/// anything is attached.
pub fn open_output(path: &Path) -> Result<File, PreflightError> {
    File::create(path).map_err(|error| PreflightError::Output {
        path: path.display().to_string(),
        error,
    })
}

pub fn check_object(object: &[u8]) -> Result<(), PreflightError> {
    if object.is_empty() {
        Err(PreflightError::NoEbpfObject)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_pid_is_named() {
        let err = check_target(u32::MAX - 1).unwrap_err();
        assert!(err.to_string().contains("no process with pid 4294967294"));
    }

    #[test]
    fn own_process_resolves_to_itself() {
        assert_eq!(
            check_target(std::process::id()).unwrap(),
            std::process::id()
        );
    }

    #[test]
    fn unwritable_output_is_named() {
        let err = open_output(Path::new("/nonexistent-dir/x.pftrace")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("/nonexistent-dir/x.pftrace") && msg.contains("-o"),
            "{msg}"
        );
        // Printed as main prints it (the whole chain), the OS error shows once.
        let chain = format!("{:#}", anyhow::Error::from(err));
        assert_eq!(
            chain.matches("No such file or directory").count(),
            1,
            "{chain}"
        );
    }

    #[test]
    fn a_process_whose_main_thread_exited_is_traceable() {
        let bin = xpuscope_tests::fixtures::build_all()
            .join("workloads")
            .join("xpuscope-main-exits");
        let mut child = std::process::Command::new(&bin)
            .arg("5")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("piped")),
            &mut line,
        )
        .expect("the survivor reports");
        let pid = child.id();
        let result = check_target(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(line.contains("\"leader_state\":\"Z\""), "{line}");
        assert_eq!(
            result.ok(),
            Some(pid),
            "the leader is a zombie, the process lives"
        );
    }

    #[test]
    fn missing_object_says_how_to_build() {
        assert!(
            check_object(&[])
                .unwrap_err()
                .to_string()
                .contains("cargo xtask build-ebpf")
        );
    }

    #[test]
    fn capabilities_say_what_can_be_recorded() {
        let cap = |c: u32| 1u64 << c;
        assert_eq!(privileges(0), Privileges::None);
        assert_eq!(privileges(cap(CAP_BPF)), Privileges::None, "CAP_BPF alone");
        assert_eq!(
            privileges(cap(CAP_BPF) | cap(CAP_PERFMON)),
            Privileges::SchedulerOnly,
            "uprobes need CAP_SYS_ADMIN"
        );
        assert_eq!(privileges(cap(CAP_SYS_ADMIN)), Privileges::All);
        assert_eq!(privileges(u64::MAX), Privileges::All);
    }
}
