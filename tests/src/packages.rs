//! Debian packages a test needs (bpftool, prometheus, ...), installed when
//! missing. A fresh machine's package index can be stale (its files gone
//! from the mirror: `404 Not Found`): a failed install refreshes the index
//! (`apt-get update`) and tries once more.

use std::process::{Command, Stdio};

fn apt_get(args: &[&str]) -> bool {
    Command::new("apt-get")
        // Another test (or a root's maker) may hold dpkg's lock: wait.
        .args(["-o", "DPkg::Lock::Timeout=300"])
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Installs `packages`; panics naming them when that fails even after
/// refreshing the package index.
pub fn apt_install(packages: &[&str]) {
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend_from_slice(packages);
    if apt_get(&args) {
        return;
    }
    let updated = apt_get(&["update", "-q"]);
    assert!(
        updated && apt_get(&args),
        "installing Debian's {} failed (apt-get update {}; see apt-get's output above)",
        packages.join(" "),
        if updated { "worked" } else { "failed too" }
    );
}

/// `program` runnable (`program --version` succeeds), installing Debian's
/// `package` when it is not; panics naming both when that fails.
pub fn ensure_tool(program: &'static str, package: &str) -> &'static str {
    let have = || {
        Command::new(program)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !have() {
        apt_install(&[package]);
    }
    assert!(
        have(),
        "{program} is not runnable after installing {package}"
    );
    program
}
