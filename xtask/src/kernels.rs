//! `cargo xtask test --kernel SERIES`: the agent's core checks on the
//! kernels fleets run, each in a QEMU virtual machine booted on a
//! distribution's own kernel of that series (Ubuntu 22.04's 5.15, Debian's
//! 6.1 and 6.12; tests/kernels: the kernel and an initramfs made once and
//! cached, this machine's root shared read-only).
//!
//! The same test binaries as on the host run there, on a chosen set of
//! tests: every kernel program verifies and loads; scheduling and off-CPU
//! stacks under `agent attach`; processes leaving the traced set at exit;
//! the device probes on the simulated job; `agent service` finding a job,
//! serving its metrics and dumping it. TCG emulation runs code several
//! times slower than the host, so tests whose subject is speed or volume
//! stay on the host.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::build::{ROOT_TEST_FEATURES, TEST_PROFILE, test_agent_binary};
use crate::{clean_command, root};

/// The kernel series a virtual machine can boot (tests/kernels/make-kernel.sh).
pub const SERIES: &[&str] = &["5.15", "6.1", "6.12"];

/// The agent's unit tests that load programs into the running kernel.
const AGENT_KERNEL_TESTS: &[&str] = &[
    "kernel::load::tests::every_program_and_fallback_verifies_on_this_kernel",
    "kernel::features::tests::every_required_feature_is_here",
];

/// The end-to-end tests run on each kernel. Not those that race a
/// short-lived process against the agent's start or its reading
/// (`attach_records_the_known_pattern`: its target exits as soon as its
/// pattern ran, and under emulation the agent reaches its stacks after the
/// process and its mappings are gone; `system_mode_records_every_process`:
/// its 1.5 s neighbour is gone before an emulated agent has started).
const E2E_KERNEL_TESTS: &[&str] = &[
    "attach::sigterm_and_duration_leave_a_valid_trace",
    "attach::a_process_whose_main_thread_exited_is_traced",
    "unwind::omit_frame_pointer_chain_through_glibc_blocking_calls",
    "churn::churning_children_leave_the_traced_set",
    "device_probes::sim_job_all_reduces_on_every_rank",
    "service::the_service_finds_a_job_by_itself_dumps_it_serves_metrics_and_switches_levels",
];

/// Builds the test binaries (as `cargo xtask test` does, without running
/// them) and runs the kernel checks in a machine for each of `series`.
pub fn test(series: &[String]) -> Result<()> {
    for s in series {
        if !SERIES.contains(&s.as_str()) {
            bail!(
                "--kernel {s}: no such kernel series here; choose from {}",
                SERIES.join(", ")
            );
        }
    }
    build()?;
    run(series)
}

/// The kernels `cargo xtask test` checks after the host's tests: the
/// oldest series here, where every fallback is taken, and Debian 12's own.
pub const DEFAULT: &[&str] = &["5.15", "6.1"];

/// `cargo xtask test`: every test on this machine (`build::test`), then,
/// unless the run was narrowed to some tests (`args`), the core checks on
/// [`DEFAULT`] in virtual machines, whatever the host's tests gave (both
/// results are reported). The kernels are made (a download, QEMU
/// installed; cached after) while the host builds and tests.
pub fn test_here_and_on_the_default_kernel(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        return crate::build::test(args);
    }
    let mut makers = Vec::new();
    for series in DEFAULT {
        makers.push(crate::build::ChildGuard(
            clean_command("sh")
                .arg(root().join("tests/kernels/make-kernel.sh"))
                .arg(series)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("could not start tests/kernels/make-kernel.sh")?,
        ));
    }
    let host = crate::build::test(args);
    // (run-in-vm.sh makes them too, and reports a failure.)
    for maker in &mut makers {
        let _ = maker.0.wait();
    }
    let series: Vec<String> = DEFAULT.iter().map(|s| s.to_string()).collect();
    let older = run(&series);
    match (host, older) {
        (Ok(()), older) => older,
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(k)) => Err(e.context(format!("and {k:#}"))),
    }
}

/// Builds what the checks run (as `cargo xtask test` does).
fn build() -> Result<()> {
    crate::build::ebpf()?;
    crate::build::fixtures()?;
    // The tests' tools, installed here: the machine sees this root
    // read-only.
    crate::setup::ensure_gdb()?;
    crate::setup::ensure_debian_tool("bpftool", "bpftool", "the service test's program count")?;
    // The build `cargo xtask test` makes (so the two share it).
    crate::build::test_build()
}

/// Runs the checks on each of `series` (built already). Each machine
/// emulates its CPUs on one host thread (see run-in-vm.sh), so as many
/// machines as this machine has CPUs run side by side, in about the time
/// of one; their consoles are then printed one after another as each ends
/// (one machine alone prints as it goes).
pub fn run(series: &[String]) -> Result<()> {
    let (agent_tests, e2e) = test_executables()?;
    let command = format!(
        "{} --exact --test-threads 1 {}; unit=$?; {} --exact --test-threads 1 {} && exit $unit",
        agent_tests.display(),
        AGENT_KERNEL_TESTS.join(" "),
        e2e.display(),
        E2E_KERNEL_TESTS.join(" ")
    );
    let side_by_side = std::thread::available_parallelism().map_or(1, |n| n.get());
    let live = series.len() == 1;
    let mut failed = Vec::new();
    for group in series.chunks(side_by_side) {
        let passed: Vec<Result<bool>> = std::thread::scope(|scope| {
            let runs: Vec<_> = group
                .iter()
                .map(|s| scope.spawn(|| check_on(s, &command, live)))
                .collect();
            runs.into_iter()
                .map(|r| {
                    r.join()
                        .unwrap_or_else(|_| bail!("the checks' thread panicked"))
                })
                .collect()
        });
        for (s, passed) in group.iter().zip(passed) {
            if !passed? {
                failed.push(s.clone());
            }
        }
    }
    if !failed.is_empty() {
        bail!("the kernel checks failed on {}", failed.join(", "));
    }
    Ok(())
}

/// The checks in a machine on kernel `series`, once more if it stalled;
/// whether they passed. `live`: its console goes straight to this
/// process's output, else it is printed when the machine ends.
fn check_on(series: &str, command: &str, live: bool) -> Result<bool> {
    eprintln!("xtask: the kernel checks on the {series} kernel (QEMU, TCG)");
    let mut tries = 0;
    loop {
        tries += 1;
        let started = std::time::Instant::now();
        let status = run_in_vm(series, command, live)?;
        let outcome = match status.code() {
            Some(0) => "passed",
            Some(STALLED) => "STALLED",
            _ => "FAILED",
        };
        eprintln!(
            "xtask: kernel {series}: {outcome} in {:.0} s",
            started.elapsed().as_secs_f64()
        );
        // A stalled guest is the emulator's fault, not the checks': run
        // them once more, saying so; a second stall fails.
        if status.code() == Some(STALLED) && tries < STALL_TRIES {
            eprintln!(
                "xtask: kernel {series}: the emulated machine stalled (not a failed check); \
                 running the checks on it again"
            );
            continue;
        }
        return Ok(status.success());
    }
}

/// run-in-vm.sh's status when the guest stalled (its heartbeat stopped).
const STALLED: i32 = 96;

/// Runs of the checks on one kernel when the machine stalls.
const STALL_TRIES: u32 = 2;

/// Runs `command` in a machine booted on kernel `series`; its console
/// goes to this process's output as it comes (`live`), or whole once the
/// machine ends, under a line naming it.
fn run_in_vm(series: &str, command: &str, live: bool) -> Result<std::process::ExitStatus> {
    let mut vm = clean_command("sh");
    vm.arg(root().join("tests/kernels/run-in-vm.sh"))
        .arg(series)
        .arg(command)
        .current_dir(root())
        .env("CI", "true")
        .env("XPUSCOPE_AGENT_BIN", test_agent_binary())
        .env("XPUSCOPE_VM_ENV", "CI XPUSCOPE_AGENT_BIN");
    if live {
        return vm
            .status()
            .context("could not start tests/kernels/run-in-vm.sh");
    }
    let out = vm
        .output()
        .context("could not start tests/kernels/run-in-vm.sh")?;
    // One write each, so that two machines ending together do not mix.
    let mut console = format!("xtask: ---- the {series} machine's console ----\n").into_bytes();
    console.extend_from_slice(&out.stdout);
    console.extend_from_slice(&out.stderr);
    console.extend_from_slice(format!("xtask: ---- end of the {series} machine ----\n").as_bytes());
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(&console);
    let _ = stdout.flush();
    Ok(out.status)
}

/// The test executables of the agent's unit tests and of the end-to-end
/// tests, as cargo names them (already built by [`crate::build::test_build`],
/// with the same wrapper and features: this only asks).
fn test_executables() -> Result<(PathBuf, PathBuf)> {
    let out = crate::build::cargo_with_clippy(&[
        "test",
        "--no-run",
        "--profile",
        TEST_PROFILE,
        "--workspace",
        "--features",
        ROOT_TEST_FEATURES,
        "--message-format",
        "json",
    ])
    .current_dir(root())
    .stderr(std::process::Stdio::inherit())
    .output()
    .context("could not run cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --no-run failed");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let messages: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let find = |package: &str, target: &str| {
        messages
            .iter()
            .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
            .filter(|m| {
                m["target"]["name"] == target
                    && m["package_id"]
                        .as_str()
                        .is_some_and(|id| id.contains(&format!("#{package}@")))
            })
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .with_context(|| format!("cargo built no test executable for {package}'s {target}"))
    };
    Ok((
        find("xpuscope-agent", "agent")?,
        find("xpuscope-tests", "e2e")?,
    ))
}
