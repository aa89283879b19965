//! xpuscope's kernel programs.
//!
//! Kernel code only filters (traced processes, enabled levels), stamps
//! (CLOCK_BOOTTIME, cpu, pid/tid), copies raw values and pushes records to the
//! ring buffer; every failed reserve is counted in `DROPS`. All meaning lives
//! in the agent. One file per probe family:
//! - `sched`: `sched_switch`, `sched_waking`, `sched_wakeup_new`;
//! - `process`: fork (following traced processes into children), exec, exit,
//!   rename;
//! - `uprobes`: device-library calls (one generic entry/return pair);
//! - `loader`: the dynamic loader's debugger hook (a link map changed);
//! - `ring`, `task`, `stacks`: shared plumbing;
//! - `bench`: bare counting programs, the benchmarks' baselines only.
//!
//! Requires a kernel with BTF (`tp_btf` programs); task fields are read at
//! offsets the agent takes from `/sys/kernel/btf/vmlinux`.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// Atomic add on a map value (the kernel programs are always built by nightly).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

#[cfg(target_arch = "bpf")]
mod bench;
#[cfg(target_arch = "bpf")]
mod loader;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod process;
#[cfg(target_arch = "bpf")]
mod ring;
#[cfg(target_arch = "bpf")]
mod sched;
#[cfg(target_arch = "bpf")]
mod stacks;
#[cfg(target_arch = "bpf")]
mod task;
#[cfg(target_arch = "bpf")]
mod uprobes;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any path that could reach here.
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("xpuscope-ebpf is a BPF object: build it with `cargo xtask build-ebpf`");
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
