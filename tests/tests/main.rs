//! The end-to-end tests: the real agent loading its eBPF programs (root, a
//! kernel with BTF) on real workloads, the simulated training job and the
//! stand-in device libraries, each decoded and checked with the independent
//! decoder (`xpuscope_tests::trace_check`).
//!
//! One test binary with a module per subject, so the whole suite is linked
//! once. It is built only with the `e2e` feature, which `cargo xtask test`
//! turns on (as root); plain `cargo test` runs the tests that need no root.
//! Tests that record take [`xpuscope_tests::agent::exclusive`], so
//! recordings never overlap; the others run beside them. A test that cannot
//! load its programs fails: none of these ever skips.
//!
//! Filter by module: `cargo test -p xpuscope-tests --features e2e -- attach::`.

mod attach;
mod attach_steps;
mod churn;
mod deploy;
mod device_memory;
mod device_probes;
mod diagnose;
mod driver_api;
mod faults;
mod findings;
mod flight_recorder;
mod gpu_health;
mod host_findings;
mod hostile;
mod levels;
mod merge;
mod npu_health;
mod probe_hits;
mod probe_levels;
mod probes_catalog;
mod probes_early;
mod python_frames;
mod python_stacks;
mod root_cause;
mod service;
mod shared_runs;
mod sim;
mod standins;
mod step_markers;
mod storm;
mod systemd;
mod unwind;
