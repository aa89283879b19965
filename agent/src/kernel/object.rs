//! The kernel programs, embedded at build time: loaded by aya in
//! [`super::load`], and read again for the uprobe-multi programs in
//! [`super::probes::uprobe_multi`].

/// The eBPF object `cargo xtask build-ebpf` built (empty if it was not:
/// the agent then says how to build it).
pub static EBPF_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xpuscope-ebpf.o"));
