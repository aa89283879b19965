//! Events the kernel skipped: a raw tracepoint program is not re-entered on
//! the same CPU (a wakeup fired from an interrupt while the waking program
//! runs, say), and the kernel counts each skip in the program's
//! `recursion_misses`. Read through `BPF_OBJ_GET_INFO_BY_FD`, they join the
//! drop counts so that no loss goes unreported.

use std::os::fd::RawFd;

use aya_obj::generated::{bpf_cmd, bpf_prog_info};

/// `union bpf_attr` for `BPF_OBJ_GET_INFO_BY_FD`.
#[repr(C)]
struct InfoByFd {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The program's `recursion_misses`, or `None` if the kernel says nothing.
pub fn recursion_misses(prog_fd: RawFd) -> Option<u64> {
    // SAFETY: bpf_prog_info is plain data; zero is a valid value.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut attr = InfoByFd {
        bpf_fd: prog_fd as u32,
        info_len: size_of::<bpf_prog_info>() as u32,
        info: &mut info as *mut bpf_prog_info as u64,
    };
    // SAFETY: the attr and the info buffer outlive the call, and info_len
    // bounds what the kernel writes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD as libc::c_long,
            &mut attr as *mut InfoByFd,
            size_of::<InfoByFd>() as libc::c_long,
        )
    };
    (rc == 0).then_some(info.recursion_misses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_fd_says_nothing() {
        assert_eq!(recursion_misses(-1), None);
    }
}
