//! Facts about this host and its clocks, for the trace header.

use xpuscope_perfetto::{ClockSnapshot, SystemInfo};

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_BOOTTIME, the clock of every timestamp in the trace.
pub fn boottime_ns() -> u64 {
    clock_ns(libc::CLOCK_BOOTTIME)
}

pub fn clock_snapshot() -> ClockSnapshot {
    ClockSnapshot {
        boottime_ns: boottime_ns(),
        monotonic_ns: clock_ns(libc::CLOCK_MONOTONIC),
        realtime_ns: clock_ns(libc::CLOCK_REALTIME),
    }
}

fn field(raw: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

pub fn system_info() -> SystemInfo {
    // SAFETY: uname fills the struct we own; zeroed is a valid initial state.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::uname(&mut uts) };
    // SAFETY: sysconf has no memory-safety preconditions.
    let (hz, page, cpus) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
            libc::sysconf(libc::_SC_NPROCESSORS_CONF),
        )
    };
    SystemInfo {
        sysname: field(&uts.sysname),
        version: field(&uts.version),
        release: field(&uts.release),
        machine: field(&uts.machine),
        hz: hz.max(0),
        page_size: page.max(0) as u32,
        num_cpus: cpus.max(1) as u32,
        machine_name: Some(field(&uts.nodename)),
    }
}

/// The node's name for the metrics and dumps: `NODE_NAME` where set (the
/// DaemonSet sets it from the pod's `spec.nodeName`: inside a pod the host
/// name is the pod's), else the host name. At most 128 characters.
pub fn node_name() -> String {
    node_name_from(std::env::var("NODE_NAME").ok(), system_info().machine_name)
}

fn node_name_from(env: Option<String>, hostname: Option<String>) -> String {
    env.map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .or(hostname)
        .unwrap_or_default()
        .chars()
        .take(128)
        .collect()
}

/// Number of possible CPUs (per-CPU map values come in this many).
pub fn possible_cpus() -> usize {
    aya::util::nr_cpus().unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_is_named_by_node_name_else_the_host_name() {
        let host = Some("pod-xyz".to_string());
        assert_eq!(
            node_name_from(Some("gpu-node-7".into()), host.clone()),
            "gpu-node-7"
        );
        assert_eq!(node_name_from(Some("  ".into()), host.clone()), "pod-xyz");
        assert_eq!(node_name_from(None, host), "pod-xyz");
        assert_eq!(node_name_from(Some("n".repeat(300)), None).len(), 128);
    }
}
