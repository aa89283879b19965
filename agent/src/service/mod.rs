//! `agent service`: the always-on agent of a training node. Its parts:
//! - [`config`]: `/etc/xpuscope/agent.toml`, validated with file, line and
//!   key in every error;
//! - [`control`]: the local control API (HTTP/JSON over a Unix socket) and
//!   its `agent ctl` client;
//! - [`http`]: the small HTTP/1.1 responder both the control API and
//!   `/metrics` use.
//!
//! - [`supervisor`]: `agent service` itself: the pipeline with the flight
//!   recorder and metrics sinks, the endpoints, systemd notification,
//!   SIGHUP reload;
//! - [`kernel_side`]: the programs, collect, the runtime levels and
//!   [`discovery`] of training processes (no pid given);
//! - [`notify`] tells systemd (sd_notify);
//! - [`dump_dir`]: the dump directory, checked at start.
//!
//! The flight recorder and the metrics are sinks of the record stream
//! (`crate::sinks::flight_recorder`, `crate::sinks::metrics`).

pub mod config;
pub mod control;
pub mod discovery;
pub mod dump_dir;
#[cfg(test)]
pub(crate) mod fuzzing;
pub mod heap;
pub mod http;
pub mod kernel_side;
pub mod metrics_endpoint;
pub mod notify;
pub mod seam;
pub mod supervisor;

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

// `agent service`'s options (`cli` names the subcommand).
#[derive(Args, Debug)]
pub struct ServiceArgs {
    /// The configuration file.
    #[arg(long, default_value = config::DEFAULT_CONFIG_PATH)]
    pub config: PathBuf,
    /// Check the configuration and exit (nothing is started).
    #[arg(long)]
    pub check_config: bool,
}

/// `agent service`.
pub fn run(args: &ServiceArgs) -> Result<()> {
    let cfg = config::ServiceConfig::load(&args.config)?;
    if args.check_config {
        println!("{}: the configuration is valid", args.config.display());
        return Ok(());
    }
    supervisor::run(args.config.clone(), cfg)
}
