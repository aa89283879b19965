//! Scheduler and process events as the agent means them (switches,
//! wakeups, forks, execs, exits, renames, link-map changes): filled in by
//! the collect stage's decoder (`events`, the one place that knows the
//! record bytes) and read by every later stage and sink.

use xpuscope_common::COMM_LEN;

/// A task name as the kernel stores it (NUL-padded, not always UTF-8).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Comm(pub [u8; COMM_LEN]);

impl Comm {
    #[cfg(test)]
    pub fn from_str_lossy(s: &str) -> Self {
        let mut b = [0u8; COMM_LEN];
        let n = s.len().min(COMM_LEN - 1);
        b[..n].copy_from_slice(&s.as_bytes()[..n]);
        Comm(b)
    }

    pub fn as_str(&self) -> std::borrow::Cow<'_, str> {
        // The trace sink names the next task of every switch and the woken
        // one of every waking: the 16 bytes are read as one word, to find
        // the end (the first NUL) and tell ASCII apart without a loop over
        // the bytes.
        const ONES: u128 = u128::from_le_bytes([0x01; COMM_LEN]);
        const HIGHS: u128 = u128::from_le_bytes([0x80; COMM_LEN]);
        let word = u128::from_le_bytes(self.0);
        // The lowest byte that is zero has the lowest high bit set here
        // (bits above it may be set by the borrow: only the lowest counts).
        let zeros = word.wrapping_sub(ONES) & !word & HIGHS;
        let end = if zeros == 0 {
            COMM_LEN
        } else {
            zeros.trailing_zeros() as usize / 8
        };
        let bytes = &self.0[..end];
        let below_end = if end == COMM_LEN {
            u128::MAX
        } else {
            (1u128 << (end * 8)) - 1
        };
        if word & below_end & HIGHS == 0 {
            // SAFETY: every byte of `bytes` is below 0x80: ASCII, which is
            // valid UTF-8.
            return std::borrow::Cow::Borrowed(unsafe { std::str::from_utf8_unchecked(bytes) });
        }
        // Valid UTF-8 is borrowed after the plain check, which is quicker
        // than the lossy scan.
        match std::str::from_utf8(bytes) {
            Ok(s) => std::borrow::Cow::Borrowed(s),
            Err(_) => String::from_utf8_lossy(bytes),
        }
    }
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

/// A context switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switch {
    pub cpu: u32,
    pub ts: u64,
    pub prev_tid: u32,
    pub prev_tgid: u32,
    pub prev_comm: Comm,
    /// Raw `__state` of the previous task.
    pub prev_state: u32,
    /// Priorities are 0-139 (`task_struct::prio`): i16 keeps a switch,
    /// the most common record, small (see `Record`).
    pub prev_prio: i16,
    pub next_tid: u32,
    pub next_tgid: u32,
    pub next_comm: Comm,
    pub next_prio: i16,
    pub preempt: bool,
    pub prev_target: bool,
    pub next_target: bool,
    pub stack_follows: bool,
}

impl Switch {
    /// Neither task is traced: the kernel pushed it to the bystander ring
    /// (its flags decide that, so this agrees with the record's kind).
    pub fn is_bystander(&self) -> bool {
        !self.prev_target && !self.next_target
    }

    /// The previous task's state in report format (see `state`).
    pub fn report_state(&self) -> i64 {
        crate::state::report_state(self.prev_state, self.preempt)
    }
}

/// A wakeup (`new_task`: the first wakeup of a new task).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waking {
    pub cpu: u32,
    pub ts: u64,
    pub tid: u32,
    pub tgid: u32,
    pub comm: Comm,
    pub prio: i32,
    /// `u32::MAX` if unknown.
    pub target_cpu: u32,
    pub waker_tid: u32,
    pub waker_tgid: u32,
    pub new_task: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork {
    pub cpu: u32,
    pub ts: u64,
    pub parent_tid: u32,
    pub parent_tgid: u32,
    pub child_tid: u32,
    pub child_tgid: u32,
    pub child_comm: Comm,
}

impl Fork {
    pub fn is_thread(&self) -> bool {
        self.child_tgid == self.parent_tgid
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exec {
    pub cpu: u32,
    pub ts: u64,
    pub tid: u32,
    pub tgid: u32,
    pub old_tid: u32,
    pub comm: Comm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    pub cpu: u32,
    pub ts: u64,
    pub tid: u32,
    pub tgid: u32,
    pub prio: i32,
    pub comm: Comm,
    /// The process's last thread: the process is gone, it left the
    /// kernel's traced set, and its pid may come back as another process.
    /// (Always false on kernels before 6.16, which do not say.)
    pub group_dead: bool,
    /// Whether the kernel said (`group_dead` is meaningful).
    pub group_known: bool,
    /// The kernel's exit code of the thread (`task->exit_code`), when read.
    pub exit_code: Option<i32>,
}

impl Exit {
    /// The signal that killed the thread (None: it exited, or the exit
    /// code is not known).
    pub fn killed_by(&self) -> Option<i32> {
        self.exit_code.map(|c| c & 0x7f).filter(|&s| s != 0)
    }

    /// Whether this is the last thread of its process to exit (the process
    /// is gone: what is kept about it can go, its pid may be reused).
    /// Kernels before 6.16 do not say: there the main thread's exit is
    /// taken as the process's (wrong only for a main thread that exits
    /// before the others).
    pub fn ends_process(&self) -> bool {
        if self.group_known {
            self.group_dead
        } else {
            self.tid == self.tgid
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rename {
    pub cpu: u32,
    pub ts: u64,
    pub tid: u32,
    pub tgid: u32,
    pub old_comm: Comm,
    pub new_comm: Comm,
}

/// A traced thread called its dynamic loader's debugger hook: its
/// process's link map changed (start-up, `dlopen`, `dlclose`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkMap {
    pub cpu: u32,
    pub ts: u64,
    pub tid: u32,
    pub tgid: u32,
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// What `as_str` gives, the plain way: up to the first NUL, lossy.
    fn plain(c: &Comm) -> String {
        let end = c.0.iter().position(|b| *b == 0).unwrap_or(COMM_LEN);
        String::from_utf8_lossy(&c.0[..end]).into_owned()
    }

    #[test]
    fn a_comm_reads_as_the_bytes_up_to_its_first_nul() {
        let mut cases: Vec<[u8; COMM_LEN]> = Vec::new();
        // Every length, and stale bytes after the NUL (a task renamed to
        // a shorter name keeps the old name's tail there).
        for len in 0..=COMM_LEN {
            let mut b = *b"pt_autograd_0xyz";
            if len < COMM_LEN {
                b[len] = 0;
            }
            cases.push(b);
            let mut b = [0u8; COMM_LEN];
            b[..len].fill(b'a');
            cases.push(b);
        }
        // UTF-8 beyond ASCII, a name cut inside a character, bytes that
        // are no UTF-8, high bytes after the NUL, 0x01 and 0x80 bytes
        // next to a NUL (the borrow of the word-wise search).
        let mut utf8 = [0u8; COMM_LEN];
        let name = "trainé_α".as_bytes();
        utf8[..name.len()].copy_from_slice(name);
        cases.push(utf8);
        let mut cut = [0u8; COMM_LEN];
        cut[..15].copy_from_slice(&"ααααααα_α".as_bytes()[..15]);
        cases.push(cut);
        cases.push([0xff; COMM_LEN]);
        let mut after = [0xc3u8; COMM_LEN];
        after[..3].copy_from_slice(b"ok\0");
        cases.push(after);
        cases.push([1, 0, 1, 0, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        cases.push([0x80, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        cases.push([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]);
        // And a spread of others.
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..20_000 {
            let mut b = [0u8; COMM_LEN];
            for v in b.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Mostly printable, some NULs and high bytes.
                *v = match x % 16 {
                    0 => 0,
                    1 => 0x80 | (x >> 8) as u8,
                    2 => 1,
                    _ => b' ' + (x >> 8) as u8 % 95,
                };
            }
            cases.push(b);
        }
        for b in cases {
            let c = Comm(b);
            assert_eq!(c.as_str(), plain(&c), "{b:?}");
        }
    }
}
