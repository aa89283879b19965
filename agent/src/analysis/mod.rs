//! Analyses of a training job that both drivers share: `agent attach`
//! feeds them from the live record stream (a sink), `agent merge` from
//! recorded traces. They see only what both have, never a trace's bytes
//! or a ring's.
//!
//! - [`groups`]: the job's TP/PP/DP groups from its communicators;
//! - [`jobs`]: which job a traced process is of (its rank identity's
//!   label, or its parent's);
//! - [`offcpu`]: a thread's time off CPU from the switches that take it
//!   off and put it back (live from the kernel's switches, offline from a
//!   trace's);
//! - [`steps`]: each rank's step breakdown from its main thread's calls
//!   and time off CPU.

pub mod groups;
pub mod jobs;
pub mod offcpu;
pub mod steps;
