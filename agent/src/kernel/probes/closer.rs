//! Closing uprobe links after the agent exits.
//!
//! Releasing a uprobe waits for the kernel's uprobe SRCU and RCU
//! tasks-trace grace periods (about 90 ms per perf-event probe on 6.18; a
//! uprobe-multi link, where the kernel has them, waits once for all of a
//! file's probes: see [`super::uprobe_multi`]): the 92 probes of one rank
//! would hold the agent for 8 s at the end of a recording. With their
//! specs zeroed the probes push nothing, so nothing is lost by closing
//! them later: a forked child (`xpuscope-close`) keeps a reference to every
//! link's file and waits for the agent to exit (its end of a pipe closes).
//! Then it releases them in parallel: a process of its own per link it can
//! name, whose grace periods overlap (one process exiting releases its
//! files one after another: 0.45-0.52 s for a 2-rank job's links, against
//! 0.05-0.08 s in parallel), and it exits once they all have.
//! This is also why a lowered capture level silences probes instead of
//! detaching them.
//!
//! A closer that has exited has released everything, though it stays in
//! `/proc` until reaped, by the init process once the agent is gone (a
//! second or two on some machines): waits look at its state, not its name.

use std::os::fd::RawFd;

/// A link handed to the closer: its own descriptor when it has one the
/// agent can name (a uprobe-multi link's), which a process of its own then
/// releases in parallel with the others.
pub trait HeldLink {
    fn own_fd(&self) -> Option<RawFd>;
}

impl HeldLink for aya::programs::uprobe::UProbeLink {
    fn own_fd(&self) -> Option<RawFd> {
        None // aya keeps a perf-event link's descriptors to itself
    }
}

/// Hands `links` (anything holding the links' descriptors) to the closer
/// child; if it cannot be started they are closed here, slowly.
///
/// Each release waits for its own grace periods, and one process exiting
/// releases its links one after another: the entry and return links of a
/// 2-rank job's four libraries took 0.46-0.52 s. So once the agent has
/// exited, the closer forks a process per link it can name, each keeping
/// that link's descriptor alone, and they all exit at once: their grace
/// periods overlap (0.05-0.08 s).
pub fn close_after_exit<T: HeldLink>(links: Vec<T>) {
    if links.is_empty() {
        return;
    }
    // Named before the fork: the child may not allocate. At most
    // `MAX_OWN` links get a process of their own; the rest go with the
    // closer's own exit.
    let mut own = [-1 as RawFd; MAX_OWN];
    let mut n_own = 0;
    for fd in links.iter().filter_map(HeldLink::own_fd).take(MAX_OWN) {
        own[n_own] = fd;
        n_own += 1;
    }
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return; // the links are closed (slowly) when dropped
    }
    // SAFETY: the child only calls async-signal-safe functions (prctl,
    // close, close_range, read, pipe2, fork, waitpid, _exit) before
    // exiting.
    match unsafe { libc::fork() } {
        0 => unsafe {
            libc::prctl(libc::PR_SET_NAME, c"xpuscope-close".as_ptr());
            libc::close(fds[1]);
            wait_for_eof(fds[0]);
            libc::close(fds[0]);
            release_in_parallel(&own[..n_own]);
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

/// Links released by processes of their own, at most.
const MAX_OWN: usize = 64;

/// Blocks until every writer of the pipe `fd` is gone.
///
/// # Safety
/// Async-signal-safe: callable in a forked child.
unsafe fn wait_for_eof(fd: RawFd) {
    let mut b = 0u8;
    // SAFETY: a read into a local byte.
    while unsafe { libc::read(fd, (&raw mut b).cast(), 1) } != 0 {
        // SAFETY: errno of this thread.
        if unsafe { *libc::__errno_location() } != libc::EINTR {
            break;
        }
    }
}

/// In the closer, once the agent is gone: a process per descriptor of
/// `own`, keeping that one alone, and one more keeping everything else
/// the closer held (links it cannot name); all of them let go at once,
/// after the closer dropped its own copies (the last holder of a link
/// releases it). The closer waits for them: while it lives, releases are
/// in progress.
///
/// # Safety
/// Async-signal-safe: callable in a forked child.
unsafe fn release_in_parallel(own: &[RawFd]) {
    if own.is_empty() {
        return; // all of it goes at the closer's exit
    }
    let mut gate = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(gate.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return;
    }
    for &fd in own {
        // SAFETY: as the caller's.
        if unsafe { libc::fork() } == 0 {
            unsafe {
                keep_only(&[fd, gate[0]]);
                wait_for_eof(gate[0]);
                libc::_exit(0);
            }
        }
    }
    // SAFETY: as the caller's.
    if unsafe { libc::fork() } == 0 {
        unsafe {
            for &fd in own {
                libc::close(fd);
            }
            libc::close(gate[1]);
            wait_for_eof(gate[0]);
            libc::_exit(0);
        }
    }
    // SAFETY: the closer's own copies of everything; closing the gate's
    // write end opens it. Then its children are waited for.
    unsafe {
        keep_only(&[]);
        while libc::waitpid(-1, std::ptr::null_mut(), 0) > 0
            || *libc::__errno_location() == libc::EINTR
        {}
    }
}

/// Closes every descriptor but those of `keep` (stdin, stdout and stderr
/// included: nothing is written).
///
/// # Safety
/// Async-signal-safe: callable in a forked child.
unsafe fn keep_only(keep: &[RawFd]) {
    let mut sorted = [0 as RawFd; 2];
    let n = keep.len().min(2);
    sorted[..n].copy_from_slice(&keep[..n]);
    sorted[..n].sort_unstable();
    let mut from: u32 = 0;
    for &k in &sorted[..n] {
        if k as u32 > from {
            // SAFETY: closing descriptors of this process.
            unsafe { libc::syscall(libc::SYS_close_range, from, k as u32 - 1, 0) };
        }
        from = k as u32 + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0) };
}

/// The process name of a closer child.
const CLOSER_COMM: &str = "xpuscope-close";

/// Pids of closer children releasing now (any agent's): the kernel is
/// still releasing their uprobes.
pub fn releases_in_progress() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| is_closer(pid))
        .collect()
}

/// Whether `pid` is a closer still releasing. One that has exited holds
/// nothing (a process's files are released before it becomes a zombie),
/// though it stays listed until its parent reaps it: after the agent's
/// exit that is the init process, which may take a second or more.
fn is_closer(pid: u32) -> bool {
    crate::procfs::stat(pid).is_some_and(|s| closer_releasing(&s))
}

/// Whether a process of `/proc/PID/stat` `stat` is a closer that has not
/// exited.
fn closer_releasing(stat: &crate::procfs::Stat) -> bool {
    stat.comm == CLOSER_COMM && !crate::procfs::is_dead(stat.state)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    #[test]
    fn a_closer_is_releasing_until_it_exits_whatever_its_reaping() {
        let releasing = |line: &str| closer_releasing(&crate::procfs::parse_stat(line).unwrap());
        assert!(releasing("4242 (xpuscope-close) D 1 4242 0"));
        assert!(releasing("4242 (xpuscope-close) S 1 4242 0"));
        assert!(!releasing("4242 (xpuscope-close) Z 1 4242 0"));
        assert!(!releasing("4242 (xpuscope-close) X 1 4242 0"));
        // Another process, whatever its name holds.
        assert!(!releasing("7 (python3) S 1 7 0"));
        assert!(!releasing("7 (a) xpuscope-close) S 1 7 0"));
    }

    /// The closer and its helpers, for real: links held by a forked
    /// closer are all released once the "agent" (here, a child process
    /// standing for it) exits, and the closer is gone with them.
    #[test]
    fn the_closer_outlives_the_agent_until_its_links_are_released() {
        // Pipes stand in for links: each helper keeps one read end, and
        // the write end, kept here, sees when no reader is left.
        let mut links = Vec::new();
        let mut writers = Vec::new();
        for _ in 0..3 {
            let mut p = [0i32; 2];
            // SAFETY: pipe2 into our array.
            assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            // SAFETY: fresh descriptors, owned once each.
            links.push(TestLink(unsafe { std::os::fd::OwnedFd::from_raw_fd(p[0]) }));
            writers.push(unsafe { std::os::fd::OwnedFd::from_raw_fd(p[1]) });
        }
        // The "agent": a child that hands the links over and exits.
        // SAFETY: the child calls close_after_exit (fork, pipe, close)
        // and _exit; the test's process is the parent.
        let agent = unsafe { libc::fork() };
        assert!(agent >= 0);
        if agent == 0 {
            close_after_exit(links);
            unsafe { libc::_exit(0) };
        }
        drop(links);
        let mut status = 0;
        // SAFETY: our child.
        assert_eq!(unsafe { libc::waitpid(agent, &mut status, 0) }, agent);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for w in &writers {
            // Every reader end goes once the helpers exit.
            loop {
                // A pipe's write end polls POLLERR once no reader is left.
                let mut pfd = libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(w),
                    events: 0,
                    revents: 0,
                };
                // SAFETY: one pollfd of ours.
                unsafe { libc::poll(&mut pfd, 1, 50) };
                if pfd.revents & libc::POLLERR != 0 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "a link was never released"
                );
            }
        }
    }

    struct TestLink(std::os::fd::OwnedFd);

    impl HeldLink for TestLink {
        fn own_fd(&self) -> Option<RawFd> {
            Some(std::os::fd::AsRawFd::as_raw_fd(&self.0))
        }
    }
}
