//! Closing uprobe links after the agent exits.
//!
//! Closing a uprobe perf event waits for an RCU tasks-trace grace period
//! under a kernel-wide mutex (about 90 ms each on 6.18): the 92 probes of
//! one rank would hold the agent for 8 s at the end of a recording (a
//! uprobe-multi link, where the kernel has them, waits once for all of a
//! file's probes: see [`super::uprobe_multi`]). With
//! their specs zeroed the probes push nothing, so nothing is lost by closing
//! them later: a forked child (`xpuscope-close`) keeps a reference to every
//! link's file, waits for the agent to exit (its end of a pipe closes), and
//! exits itself; the last reference, and the slow release, is the child's.
//! This is also why a lowered capture level silences probes instead of
//! detaching them.

/// Hands `links` (anything holding the links' descriptors) to the closer
/// child; if it cannot be started they are closed here, slowly.
pub fn close_after_exit<T>(links: Vec<T>) {
    if links.is_empty() {
        return;
    }
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return; // the links are closed (slowly) when dropped
    }
    // SAFETY: the child only calls async-signal-safe functions (prctl,
    // close, read, _exit) before exiting.
    match unsafe { libc::fork() } {
        0 => unsafe {
            libc::prctl(libc::PR_SET_NAME, c"xpuscope-close".as_ptr());
            libc::close(fds[1]);
            let mut b = 0u8;
            while libc::read(fds[0], (&raw mut b).cast(), 1) != 0 {
                if *libc::__errno_location() != libc::EINTR {
                    break;
                }
            }
            libc::_exit(0);
        },
        -1 => {
            // SAFETY: our own descriptors.
            unsafe {
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
        }
        child => {
            tracing::debug!("device probes: pid {child} closes the uprobe links");
            // SAFETY: our own descriptor; the write end stays open until exit.
            unsafe { libc::close(fds[0]) };
            // The child holds references: these closes are cheap.
            drop(links);
        }
    }
}

/// The process name of a closer child.
const CLOSER_COMM: &str = "xpuscope-close";

/// Pids of closer children alive now (any agent's): the kernel is still
/// releasing their uprobes.
pub fn releases_in_progress() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| is_closer(pid))
        .collect()
}

fn is_closer(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == CLOSER_COMM)
}

/// How a wait for earlier agents' releases ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ReleaseWait {
    /// None were in progress.
    None,
    /// They finished after this long.
    Done {
        closers: usize,
        waited: std::time::Duration,
    },
    /// Still going at the limit (or a stop was asked for): attaching now.
    GaveUp {
        closers: usize,
        waited: std::time::Duration,
    },
}

/// Waits (up to `limit`, or until `stop` says so) for earlier agents'
/// uprobe releases to end. Registering a uprobe takes the kernel-wide
/// mutex each release holds for a grace period, so probes attached
/// meanwhile land seconds late, and a job starting now loses its first
/// calls; waiting before recording starts loses none. `say` is told the
/// closers' pids first, when there are any.
pub fn wait_for_releases(
    limit: std::time::Duration,
    stop: impl Fn() -> bool,
    say: impl FnOnce(&[u32]),
) -> ReleaseWait {
    let closers = releases_in_progress();
    if closers.is_empty() {
        return ReleaseWait::None;
    }
    say(&closers);
    let started = std::time::Instant::now();
    loop {
        let alive = closers.iter().filter(|&&p| is_closer(p)).count();
        let waited = started.elapsed();
        if alive == 0 {
            return ReleaseWait::Done {
                closers: closers.len(),
                waited,
            };
        }
        if waited >= limit || stop() {
            return ReleaseWait::GaveUp {
                closers: alive,
                waited,
            };
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
