//! Building the kernel programs, the agent and the fixtures; the demo and
//! the full test run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{clean_command, root, run_checked, setup};

/// Where `build-ebpf` leaves the object the agent embeds.
pub fn ebpf_object() -> PathBuf {
    root().join("ebpf/programs/target/bpfel-unknown-none/release/xpuscope-ebpf")
}

pub fn ebpf() -> Result<()> {
    setup::run()?;
    run_checked(
        clean_command("cargo")
            .current_dir(root().join("ebpf/programs"))
            .env(
                "CARGO_ENCODED_RUSTFLAGS",
                [
                    "--cfg=bpf_target_arch=\"x86_64\"",
                    "-Cdebuginfo=2",
                    "-Clink-arg=--btf",
                ]
                .join("\x1f"),
            )
            // Always release: debug builds fail the verifier.
            .args([
                "+nightly",
                "build",
                "--target",
                "bpfel-unknown-none",
                "-Z",
                "build-std=core",
                "--release",
            ]),
        "building the eBPF programs",
    )?;
    let obj = ebpf_object();
    if !obj.exists() {
        bail!("the eBPF build finished but {} is missing", obj.display());
    }
    Ok(())
}

pub fn fixtures() -> Result<()> {
    for dir in ["workloads", "standins", "sim"] {
        let src = root().join("tests").join(dir);
        if !src.join("Makefile").exists() {
            continue;
        }
        let out = root().join("target/fixtures").join(dir);
        std::fs::create_dir_all(&out)?;
        run_checked(
            Command::new("make")
                .arg("-s")
                .arg("-C")
                .arg(&src)
                .arg(format!("OUT={}", out.display())),
            &format!("building fixtures in tests/{dir}"),
        )?;
    }
    Ok(())
}

pub fn agent_release() -> Result<()> {
    run_checked(
        clean_command("cargo").args(["build", "--release", "-p", "xpuscope-agent"]),
        "building the agent",
    )
}

pub fn all() -> Result<()> {
    ebpf()?;
    agent_release()?;
    fixtures()
}

/// The agent binary `build` produces.
pub fn agent_binary() -> PathBuf {
    root().join("target/release/agent")
}

/// The cargo profile `cargo xtask test` builds in (see `Cargo.toml`).
pub const TEST_PROFILE: &str = "testing";

/// The agent binary the tests run.
pub fn test_agent_binary() -> PathBuf {
    root().join("target").join(TEST_PROFILE).join("agent")
}

/// The agent binary to install or package: `binary` (`--binary`, built
/// elsewhere) when given, else the release build, made now.
pub fn agent_or(binary: Option<&Path>) -> Result<PathBuf> {
    match binary {
        Some(path) => {
            anyhow::ensure!(
                path.is_file(),
                "--binary {}: no such file (build the agent first)",
                path.display()
            );
            Ok(path.to_path_buf())
        }
        None => {
            ebpf()?;
            agent_release()?;
            Ok(agent_binary())
        }
    }
}

/// Kills and reaps a child on drop.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn demo(output: &Path, duration: &str) -> Result<()> {
    all()?;
    let workload = root().join("target/fixtures/workloads/xpuscope-workload");
    let child = Command::new(&workload)
        .args(["loop", "60"])
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", workload.display()))?;
    let guard = ChildGuard(child);
    let pid = guard.0.id();
    // Let it start its threads, as a real job would be running already.
    std::thread::sleep(Duration::from_millis(300));
    let output = if output.is_absolute() {
        output.to_path_buf()
    } else {
        std::env::current_dir()?.join(output)
    };
    eprintln!("xtask: demo workload running as pid {pid}; attaching for {duration}");
    let started = Instant::now();
    run_checked(
        Command::new(agent_binary())
            .args([
                "attach",
                "--pid",
                &pid.to_string(),
                "--duration",
                duration,
                "-o",
            ])
            .arg(&output),
        "agent attach",
    )?;
    drop(guard);
    println!(
        "\nDemo trace written to {} ({:.1} s).\nOpen it at https://ui.perfetto.dev (\"Open trace file\"): \
         CPU tracks, the workload's threads with their states, wakeups,\n\
         off-CPU stacks (select an area on a thread's callstack track for a flamegraph).",
        output.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Builds the book under `docs/` into `target/book`. A test run builds it so
/// that a chapter or an included file that went missing fails the tests;
/// mdbook reports such problems as WARN or ERROR lines and still exits 0, so
/// its log is checked too.
fn book() -> Result<()> {
    setup::ensure_mdbook()?;
    let out = clean_command("mdbook")
        .args(["build", "docs"])
        .output()
        .context("could not start `mdbook build docs`")?;
    let log = String::from_utf8_lossy(&out.stderr);
    let complains = log
        .lines()
        .any(|line| line.contains("WARN") || line.contains("ERROR"));
    if !out.status.success() || complains {
        bail!(
            "mdbook build docs failed ({}):\n{}",
            out.status,
            log.trim_end()
        );
    }
    Ok(())
}

/// What `cargo xtask test` says, and does not go on, when not run as root.
const NEEDS_ROOT: &str = "cargo xtask test runs the eBPF end-to-end tests: run it as root \
     (sudo -E cargo xtask test); `cargo test` runs the tests that need no root";

/// The cargo features of the tests that need root: the end-to-end target
/// (`tests/tests/main.rs`) and the agent's unit tests that load its eBPF
/// object or switch uids.
/// The one build the tests run from (see [`test`]), clippy included.
pub fn test_build() -> Result<()> {
    run_checked(
        &mut cargo_with_clippy(&[
            "build",
            "--profile",
            TEST_PROFILE,
            "--workspace",
            "--all-targets",
            "--features",
            ROOT_TEST_FEATURES,
        ]),
        "cargo clippy and the build",
    )
}

pub const ROOT_TEST_FEATURES: &str = "xpuscope-tests/e2e,xpuscope-agent/root-tests";

/// Clippy as the compiler of the workspace's own crates (what `cargo
/// clippy` does on top of `cargo check`), with its lints denied: given to
/// the cargo commands that build the tests, it lints every target while
/// they compile, so the dependencies are built once instead of checked
/// once and built again. Passed as `--config`, not in the environment, so
/// the cargo commands the tests run themselves (`cargo xtask install`)
/// build as usual.
const CLIPPY_WRAPPER: &str = "build.rustc-workspace-wrapper=\"clippy-driver\"";
const CLIPPY_ARGS: &str = "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__";

/// A cargo command whose workspace crates are compiled by clippy (see
/// [`CLIPPY_WRAPPER`]).
pub fn cargo_with_clippy(args: &[&str]) -> Command {
    let mut cmd = clean_command("cargo");
    cmd.args(["--config", CLIPPY_WRAPPER])
        .args(args)
        .env("CLIPPY_ARGS", CLIPPY_ARGS);
    cmd
}

/// Every test: formatting, clippy over every target (the end-to-end one
/// included), then the unit tests, the perfetto suite, the fuzz corpus
/// replay and the end-to-end tests. Those load eBPF programs, so this
/// refuses to start without root rather than skip them.
pub fn test(extra: &[String]) -> Result<()> {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(NEEDS_ROOT);
    }
    // The Debian roots of the container and package tests (debootstrap,
    // about 40 s of downloads each on a fresh machine; cached after) are
    // made while the code builds. The tests make them themselves when they
    // are missing, and report a failure.
    let mut roots = Vec::new();
    for name in ["sid", "bookworm"] {
        roots.push(ChildGuard(
            clean_command("sh")
                .args(["tests/roots/make-root.sh", name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("could not start tests/roots/make-root.sh")?,
        ));
    }

    // Cheap checks first: a formatting slip fails in seconds, not after the builds.
    run_checked(
        clean_command("cargo").args(["fmt", "--all", "--", "--check"]),
        "cargo fmt --check",
    )?;
    // The kernel programs are a crate of their own (another target, outside
    // the workspace): checked on their own.
    run_checked(
        clean_command("cargo").args([
            "fmt",
            "--manifest-path",
            "ebpf/programs/Cargo.toml",
            "--",
            "--check",
        ]),
        "cargo fmt --check (ebpf/programs)",
    )?;
    book()?;
    ebpf()?;
    setup::ensure_gdb()?;
    setup::ensure_debian_tool("bpftool", "bpftool", "the service test's program count")?;
    fixtures()?;
    // `cargo clippy --workspace --all-targets --features xpuscope-tests/e2e
    // -- -D warnings`, folded into the one build the tests need: every
    // binary (the agent the end-to-end tests run), and every crate's tests
    // and examples as `cargo test` builds them. One cargo command in one
    // profile, so every dependency is built once, with one set of features.
    test_build()?;
    let mut cmd = cargo_with_clippy(&[
        "test",
        "--profile",
        TEST_PROFILE,
        "--workspace",
        "--no-fail-fast",
        "--features",
        ROOT_TEST_FEATURES,
    ]);
    cmd.env("XPUSCOPE_AGENT_BIN", test_agent_binary());
    // Done before the tests start their clocks (the script's lock makes
    // the tests wait anyway).
    for root in &mut roots {
        let _ = root.0.wait();
    }
    if !extra.is_empty() {
        cmd.args(extra);
    }
    run_checked(&mut cmd, "cargo test")
}
