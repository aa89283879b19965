//! `cargo xtask <task>`: everything needed to go from a fresh clone to a
//! traced demo or a full test run, idempotently.
//!
//! - `setup`: nightly `rust-src` and `bpf-linker` built against the nightly's
//!   own libLLVM (see `docs/src/development/toolchain.md`);
//! - `build-ebpf`: the kernel programs, for `bpfel-unknown-none`;
//! - `build`: kernel programs, the agent (release) and the test fixtures;
//! - `demo`: build, start the bundled workload, attach to it, write a trace;
//! - `test`: build everything and run every test;
//! - `bench`: the overhead and throughput benchmarks;
//! - `fuzz`: the parsers of untrusted input under libFuzzer (`tests/fuzz`);
//! - `install`: the agent as a systemd service (binary, unit, default
//!   configuration), or `--uninstall`;
//! - `package`: the agent as a Debian package (`target/debian/*.deb`).

mod bench;
mod bench_floor;
mod bench_merge;
mod bench_probes;
mod bench_service;
mod bench_soak;
mod build;
mod fuzz;
mod install;
mod kernels;
#[cfg(test)]
mod layering;
mod measure;
mod package;
mod setup;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "xpuscope developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the kernel side needs (idempotent).
    Setup,
    /// Build the eBPF programs.
    BuildEbpf,
    /// Build the eBPF programs, the agent (release) and the test fixtures.
    Build,
    /// Build, then trace the bundled demo workload and write a trace.
    Demo {
        /// Where to write the trace.
        #[arg(short, long, default_value = "xpuscope-demo.pftrace")]
        output: PathBuf,
        /// How long to record.
        #[arg(long, default_value = "5s")]
        duration: String,
    },
    /// Build everything and run all tests.
    Test {
        /// Instead: the agent's core checks on a distribution's kernel of
        /// this series (5.15: Ubuntu 22.04's; 6.1, 6.12: Debian's) in a
        /// QEMU virtual machine; repeatable.
        #[arg(long = "kernel", value_name = "SERIES")]
        kernels: Vec<String>,
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Run the benchmarks and print their figures.
    Bench {
        /// Seconds per measured phase.
        #[arg(long, default_value_t = 3)]
        seconds: u64,
        /// Only this part: `pingpong` (the scheduling capture overhead
        /// table), `probes` (device-library probe costs), `merge`
        /// (agent merge on 16 node traces, see --trace-mb),
        /// `soak` (agent service always on; --minutes long), `service`
        /// (its CPU per record by thread, and the flight recorder's
        /// window; with --compare-agent, against another build).
        only: Option<String>,
        /// Length of the soak (`bench soak`), in minutes.
        #[arg(long, default_value_t = 30)]
        minutes: u64,
        /// Another agent binary (e.g. a build of the previous version) to
        /// measure in the same run: interleaved in the ping-pong rounds
        /// and the service rounds (`bench service`),
        /// back to back in the system-wide recordings.
        #[arg(long)]
        compare_agent: Option<PathBuf>,
        /// `merge`: MB of each node trace (recorded from a simulated job
        /// long enough, kept in target/bench/merge-traces/<N>mb).
        #[arg(long, default_value_t = 100)]
        trace_mb: u64,
    },
    /// Fuzz the parsers of untrusted input with libFuzzer (nightly,
    /// cargo-fuzz, installed on first use).
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Fold new inputs that add coverage into the kept corpus
        /// (tests/fuzz/corpus).
        #[arg(long)]
        merge: bool,
        /// Only this target (default: all).
        target: Option<String>,
    },
    /// Build the agent and install it as a systemd service: the binary to
    /// PREFIX/bin/agent, the unit to /etc/systemd/system, the default
    /// configuration to /etc/xpuscope/agent.toml if none exists.
    Install {
        /// Where the binary goes (PREFIX/bin/agent; the unit runs it there).
        #[arg(long, default_value = install::DEFAULT_PREFIX)]
        prefix: PathBuf,
        /// Stage every file under this directory instead of / (packages,
        /// images, tests); systemd is not told.
        #[arg(long)]
        root: Option<PathBuf>,
        /// Remove what install placed (an edited configuration, drop-ins and
        /// the dumps in /var/lib/xpuscope stay).
        #[arg(long)]
        uninstall: bool,
        /// Install this agent binary instead of building the release one
        /// (a binary built elsewhere, or the one a test run built).
        #[arg(long, value_name = "PATH", conflicts_with = "uninstall")]
        binary: Option<PathBuf>,
    },
    /// Build the Debian package `target/debian/xpuscope_<version>_amd64.deb`
    /// (binary, unit, configuration as a conffile, manual page,
    /// completions).
    Package {
        /// Package this agent binary instead of building the release one.
        #[arg(long, value_name = "PATH")]
        binary: Option<PathBuf>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.task {
        Task::Setup => setup::run(),
        Task::BuildEbpf => build::ebpf(),
        Task::Build => build::all(),
        Task::Demo { output, duration } => build::demo(&output, &duration),
        Task::Test { kernels, args } if kernels.is_empty() => {
            kernels::test_here_and_on_the_default_kernel(&args)
        }
        Task::Test { kernels, args } => {
            anyhow::ensure!(
                args.is_empty(),
                "--kernel runs a fixed set of checks: no cargo test arguments ({args:?})"
            );
            kernels::test(&kernels)
        }
        Task::Bench {
            seconds,
            minutes,
            only,
            compare_agent,
            trace_mb,
        } => bench::run(
            seconds,
            minutes,
            only.as_deref(),
            compare_agent.as_deref(),
            trace_mb,
        ),
        Task::Fuzz {
            seconds,
            merge,
            target,
        } => fuzz::run(seconds, target.as_deref(), merge),
        Task::Install {
            prefix,
            root,
            uninstall,
            binary,
        } => install::run(&prefix, root.as_deref(), uninstall, binary.as_deref()),
        Task::Package { binary } => package::run(binary.as_deref()).map(|_| ()),
    }
}

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// A command with the variables a parent `cargo run` sets removed, so nested
/// cargo invocations pick their own toolchain and target dir.
pub fn clean_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key == "RUSTUP_TOOLCHAIN"
            || key == "RUSTFLAGS"
            || key == "RUSTC"
            || key == "RUSTDOC"
            || key == "CARGO_ENCODED_RUSTFLAGS"
            || key.starts_with("CARGO_PKG_")
            || key == "CARGO_MANIFEST_DIR"
            || key == "CARGO_MANIFEST_PATH"
            || key == "CARGO_PRIMARY_PACKAGE"
        {
            cmd.env_remove(&key);
        }
    }
    cmd.current_dir(root());
    cmd
}

/// Runs `cmd`, failing with its description if it does not succeed.
pub fn run_checked(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("could not start {what} ({cmd:?})"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}
