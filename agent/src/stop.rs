//! Stop requests that arrive before the supervisor listens for them.
//!
//! `main` installs these handlers first thing, so a SIGINT/SIGTERM during
//! start-up (checks, BTF, loading the programs: ~100 ms) is remembered
//! instead of killing the agent with a 0-byte trace; the supervisor then
//! stops at once and finishes a valid trace. tokio's own handlers, added
//! later, keep calling these (signal-hook chains to the previous handler).

use std::sync::atomic::{AtomicI32, Ordering};

static REQUESTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn remember(signal: libc::c_int) {
    // Async-signal-safe: a single atomic store.
    REQUESTED.store(signal, Ordering::Relaxed);
}

/// Installs the handlers for SIGINT and SIGTERM.
pub fn install() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a handler that only stores an
        // atomic is a valid argument; the old action is not needed.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = remember as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The stop signal received so far, if any.
pub fn requested() -> Option<i32> {
    match REQUESTED.load(Ordering::Relaxed) {
        0 => None,
        s => Some(s),
    }
}
