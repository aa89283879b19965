//! Everything the agent does to the kernel: loading the eBPF object and
//! attaching its tracepoint programs ([`load`], one program table), the
//! traced set, counters and runtime configuration ([`KernelControl`]), the
//! capture levels ([`levels`]), and the device-library uprobes ([`probes`]:
//! planning, attaching, closing). The rest of the agent talks to the kernel
//! only through these types, and each has an in-memory fake
//! ([`control::FakeKernel`], [`probes::attach::FakeAttacher`]) so the logic
//! above them is tested without root.
//!
//! # Bounded state
//! A traced process leaves `TARGETS` when its last thread exits (the
//! `sched_process_exit` program, `group_dead`; before Linux 6.16, whose
//! tracepoint lacks it, `signal->live`), so the map holds the live
//! traced processes, however many come and go in a long run, and a pid the
//! kernel hands out again is not traced as if it were the old process.
//! [`probes::Planner::plan`] forgets processes no longer in `TARGETS`.
//!
//! # Adding a kind of kernel program
//! 1. ABI (`ebpf/common`): the record (`#[repr(C)]`, explicit padding, an
//!    [`xpuscope_common::EventHeader`] first, a compile-time size check), a
//!    new [`xpuscope_common::EventKind`] (also in `EventKind::ALL`; below
//!    `DROP_SLOTS`, its drop-counter slot), and any map name or limit.
//! 2. Kernel program (`ebpf/programs`): one file per probe family; a thin
//!    entry point calling a `try_*` function that filters, stamps, copies
//!    raw values and submits through `ring::reserve`/`submit` (which count
//!    a failed reserve as a drop of its kind).
//! 3. This module: a tracepoint program is one row of [`load::PROGRAMS`]
//!    (name, tracepoint, kind): it is then attached, detached, and its
//!    skipped runs counted as drops of its kind. A uprobe family gets its
//!    programs in an [`probes::Attacher`] instead.
//! 4. Collect: the record's byte layout is decoded in one place (today
//!    `events.rs`, the pipeline's collect stage).
//! 5. Interpret: raw record -> a typed record with meaning.
//! 6. The sinks that care (the trace writer, the summary's per-kind
//!    counts follow from `EventKind::ALL`).
//!
//! Nothing else changes: drops, skips and the per-kind summary are indexed
//! by `EventKind`.

pub mod config_map;
pub mod control;
pub mod error;
pub mod features;
pub mod levels;
pub mod load;
pub mod misses;
pub mod object;
pub mod probes;
pub mod stack_ends;

pub use control::KernelControl;
pub use levels::{CaptureLevels, DeviceLevel};
pub use load::{Kernel, KernelRings, LoadOptions};
pub use object::EBPF_OBJECT;
