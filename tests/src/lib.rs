//! Shared support for xpuscope's end-to-end tests.
//!
//! - [`agent`]: runs the real agent and workloads under guards.
//! - [`cluster`]: a simulated job over several nodes, one agent per node.
//! - [`device`]: the simulated job under the agent and device-trace lookups.
//! - [`steps`]: a step breakdown checked against the simulated ranks' logs.
//! - [`fixtures`]: builds the native fixtures (workloads, stand-in device
//!   libraries, the simulated training job) from source, once per test run.
//! - [`packages`]: Debian packages a test needs, installed when missing.
//! - [`roots`]: a Debian unstable root standing in for a container image,
//!   and processes started inside it.
//! - [`trace_check`]: decodes a trace with the official Perfetto schema (the
//!   `perfetto_protos` crate, independent of the writer's prost types) and
//!   checks the trace-processor importer's rules.

pub mod agent;
pub mod cluster;
pub mod device;
pub mod fixtures;
pub mod packages;
pub mod roots;
pub mod service_run;
pub mod steps;
pub mod trace_check;
