//! The agent's own CPU time and memory, read one way for every place that
//! reports them (the attach summary, the service's metrics).

/// What the agent has used so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OwnUsage {
    /// User plus system CPU seconds of every thread.
    pub cpu_seconds: f64,
    /// Resident bytes now.
    pub resident_bytes: u64,
    /// The most resident bytes at any time so far.
    pub peak_resident_bytes: u64,
}

impl OwnUsage {
    pub fn now() -> Self {
        // SAFETY: getrusage fills the struct we own.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        OwnUsage {
            cpu_seconds: secs(ru.ru_utime) + secs(ru.ru_stime),
            resident_bytes: resident_bytes().unwrap_or(0),
            peak_resident_bytes: peak_resident_bytes().unwrap_or(ru.ru_maxrss.max(0) as u64 * 1024),
        }
    }
}

/// The most resident bytes of this program so far (`/proc/self/status`'
/// `VmHWM`). Not getrusage's `ru_maxrss`: that keeps the peak of the
/// memory the process had before its `exec`, and a process started by
/// `vfork` or `posix_spawn` (Python's `subprocess`, Rust's `Command`) had
/// its parent's memory until then, so an agent started by a 600 MiB
/// program reported a 600 MiB peak of its own.
fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_peak(&status)
}

/// `VmHWM` of a `/proc/PID/status` text, in bytes.
fn parse_peak(status: &str) -> Option<u64> {
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// Resident pages now (`/proc/self/statm`'s second field), in bytes:
/// getrusage has only the peak.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(0) as u64)
}

/// When this process started, in seconds since the Unix epoch: its start
/// in clock ticks after boot (`/proc/self/stat` field 22) plus the boot
/// time (`btime` of `/proc/stat`).
pub fn start_time_unix_seconds() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces: fields count after its ')'.
    let after = stat.rsplit_once(')')?.1;
    let start_ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let boot: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|&h| h > 0)?;
    Some(boot + start_ticks / hz)
}

/// How many file descriptors this process has open.
pub fn open_fds() -> Option<u64> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read() {
        // Burn a little CPU so the figure is not zero.
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let u = OwnUsage::now();
        assert!(u.cpu_seconds > 0.0);
        assert!(u.resident_bytes > 0);
        assert!(u.peak_resident_bytes >= u.resident_bytes / 2);
    }

    #[test]
    fn the_peak_is_read_from_vmhwm() {
        let status = "Name:\tagent\nVmPeak:\t  900000 kB\nVmHWM:\t   271176 kB\nVmRSS:\t  100 kB\n";
        assert_eq!(parse_peak(status), Some(271_176 * 1024));
        assert_eq!(parse_peak("VmHWM:\t12 MB\n"), None, "only kB");
        assert_eq!(parse_peak("VmRSS:\t12 kB\n"), None);
        assert_eq!(parse_peak("VmHWM:\t99999999999999999999 kB\n"), None);
    }
}
