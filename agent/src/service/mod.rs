//! `agent service`: the always-on agent of a training node. Its parts:
//! - [`config`]: `/etc/xpuscope/agent.toml`, validated with file, line and
//!   key in every error;
//! - [`control`]: the local control API (HTTP/JSON over a Unix socket) and
//!   its `agent ctl` client;
//! - [`http`]: the small HTTP/1.1 responder both the control API and
//!   `/metrics` use.
//!
//! The flight recorder and the metrics are sinks of the record stream
//! (`crate::sinks::flight_recorder`, `crate::sinks::metrics`).

pub mod config;
pub mod control;
pub mod http;
pub mod metrics_endpoint;
pub mod wallclock;

use anyhow::Result;

use crate::cli::ServiceArgs;

/// `agent service`.
pub fn run(args: &ServiceArgs) -> Result<()> {
    let cfg = config::ServiceConfig::load(&args.config)?;
    if args.check_config {
        println!("{}: the configuration is valid", args.config.display());
        return Ok(());
    }
    let _ = cfg;
    anyhow::bail!("`agent service` is not implemented yet; --check-config works")
}
