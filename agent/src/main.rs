//! `agent`: xpuscope's privileged agent.
//!
//! `sudo agent attach --pid <PID> [-o trace.pftrace] [--duration 30s]`
//! attaches eBPF programs to the scheduler tracepoints, follows the process
//! and its children, and writes a native Perfetto trace. Requires Linux with
//! BTF (`/sys/kernel/btf/vmlinux`) and root or CAP_BPF + CAP_PERFMON.

mod analysis;
mod btf;
mod cli;
mod config;
mod diagnose;
mod events;
mod health;
mod host;
mod kernel;
mod merge;
mod model;
mod own_usage;
mod pipeline;
mod preflight;
mod probes_cmd;
mod procfs;
mod service;
mod session;
mod sinks;
mod state;
mod stop;
mod summary;
mod supervise;
mod trace_file;
mod trace_schema;
mod wallclock;

use std::process::ExitCode;

/// jemalloc, not glibc's allocator: the service frees what the flight
/// recorder evicts (100 k+ records a second) on other threads than those
/// that allocated it, between the long-lived allocations of each job.
/// Measured with jobs started back to back (commit bbcec80), glibc's arenas
/// grew without end around that free space (the bytes in use flat) and the
/// resident size crept up even with `malloc_trim` every 10 s; jemalloc's
/// size-class slabs and page purging held it flat.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use clap::Parser;

use cli::{Cli, Command};

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only for a person at a terminal: journald and Kubernetes keep
    // stderr as text, where escape codes are noise (NO_COLOR turns it off
    // at a terminal too).
    use std::io::IsTerminal;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
}

fn main() -> ExitCode {
    // First: a stop during start-up must still leave a valid trace.
    stop::install();
    let cli = Cli::parse();
    init_logging(cli.verbose);
    // A panicking stage must not leave a half-written trace behind silently.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        eprintln!("xpuscope: internal error; please report it with the message above");
    }));
    match cli.command {
        Command::Probes(args) => match probes_cmd::run(args.pid, args.duration) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xpuscope: error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Service(args) => match service::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xpuscope: error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Ctl(args) => service::control::client::run(&args),
        Command::Merge(args) => run_merge(args),
        Command::Diagnose(args) => run_diagnose(args),
        Command::Man => {
            use clap::CommandFactory;
            let mut out = std::io::stdout().lock();
            match clap_mangen::Man::new(Cli::command()).render(&mut out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xpuscope: error: writing the manual page: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "agent", &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Command::Attach(args) => {
            let cfg = args.into_config();
            let stats_path = cfg.stats_json.clone();
            match session::run(cfg) {
                Ok(summary) => {
                    summary.print();
                    if let Some(path) = stats_path {
                        let json = serde_json::to_string_pretty(&summary).unwrap_or_default();
                        if let Err(e) = std::fs::write(&path, json) {
                            eprintln!("xpuscope: error: writing {}: {e}", path.display());
                            return ExitCode::FAILURE;
                        }
                    }
                    if summary.stop_reason == summary::StopReason::Failed {
                        return ExitCode::FAILURE;
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("xpuscope: error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn run_diagnose(args: cli::DiagnoseArgs) -> ExitCode {
    let opts = diagnose::DiagnoseOptions {
        traces: args.traces,
        json: args.json,
        detect: sinks::detect::DetectConfig {
            hang_timeout: args.hang_timeout,
            collective: sinks::detect::collective::CollectiveConfig {
                late_min: args.late_min,
                slow_rank_persist: args.slow_rank_persist,
                slow_link_ratio: args.slow_link_ratio,
                ..Default::default()
            },
            // The host-side detectors read scheduling and memory records,
            // which the replay does not rebuild yet: defaults, unused.
            host: Default::default(),
            gpu: Default::default(),
        },
    };
    match diagnose::run(&opts) {
        Ok(outcome) if outcome.roots > 0 => ExitCode::from(diagnose::EXIT_ROOT_FINDING),
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xpuscope: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_merge(args: cli::MergeArgs) -> ExitCode {
    let opts = merge::MergeOptions {
        inputs: args.traces,
        output: args.output,
        force: args.force,
        no_sched: args.no_sched,
        steps_csv: args.steps_csv,
    };
    let result = merge::run(&opts).and_then(|report| {
        report.print();
        if let Some(path) = &args.stats_json {
            // Written as serialized: the step table is read back row by row.
            let file = std::fs::File::create(path)
                .map_err(|e| anyhow::anyhow!("creating {}: {e}", path.display()))?;
            let mut w = std::io::BufWriter::new(file);
            serde_json::to_writer_pretty(&mut w, &report)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
            std::io::Write::flush(&mut w)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        }
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xpuscope: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
