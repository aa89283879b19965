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
