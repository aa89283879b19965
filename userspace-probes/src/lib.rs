//! User-space probes of device runtime libraries (CUDA runtime, NCCL, CUPTI,
//! AscendCL, HCCL, MSPTI): everything about them that needs neither root nor
//! the kernel.
//!
//! - [`catalog`]: which exported functions to probe per library, where their
//!   arguments are (System V x86-64), what to copy through pointers at entry
//!   or return, and at which capture level.
//! - [`resolve`]: a library file's `.dynsym` functions (never DWARF), file
//!   offsets, aliases deduplicated by address, tail-call thunks skipped.
//! - [`placement`]: where in each function the probe goes so the kernel
//!   emulates the probed instruction (about 0.5 us) instead of
//!   single-stepping it (about 16 us), e.g. past a leading `endbr64`.
//! - [`discover`] / [`maps`]: which catalog libraries a process has mapped
//!   (`/proc/PID/maps`), and what changed since the last scan (`dlopen`,
//!   a library replaced at a new inode).
//! - [`decode`]: raw `xpuscope_common::uprobe` records -> typed
//!   [`decode::DeviceCall`]s (entries and returns paired per thread),
//!   communicator identity and collective sequence numbers, device memory
//!   accounting.
//! - [`activity`]: CUPTI and MSPTI activity records (true device times) read
//!   where the application consumes them.
//!
//! ```no_run
//! use xpuscope_probes::{decode::table::ProbeTable, discover, maps::ProcessMaps, resolve};
//! let pid = 4242;
//! let mut table = ProbeTable::new();
//! for lib in discover::discover(&ProcessMaps::read(pid).unwrap()) {
//!     let resolved = resolve::resolve(lib.path.as_ref(), lib.library).unwrap();
//!     for probe in table.add_library(pid, &lib, &resolved) {
//!         // attach a uprobe + uretprobe at probe.file_offset (aya, root),
//!         // write probe.key -> probe.spec into UPROBE_SPECS.
//!         println!("{} at {:#x}", probe.target.function.name, probe.key.probe_ip);
//!     }
//! }
//! ```
//!
//! Kernel requirements (for the probes this crate describes, not for the
//! crate): x86-64 uprobes and uretprobes; the cost figures assume the
//! instruction emulation of Linux 6.x (`push`, `nop`, relative branches) and
//! the optimized nop5 path of 6.18.

pub mod activity;
pub mod bounds;
mod bytes;
pub mod catalog;
pub mod decode;
pub mod discover;
pub mod enums;
pub mod loader;
pub mod maps;
pub mod placement;
pub mod python;
mod read_budget;
pub mod regular_file;
pub mod resolve;
pub mod unwind;
