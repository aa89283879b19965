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

/// This project's own Debian package of the agent the tests run (`cargo
/// xtask package --binary`), built once per test process: the tests that
/// install it share one file rather than rewrite it under each other.
pub fn xpuscope_deb() -> &'static std::path::Path {
    static DEB: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DEB.get_or_init(|| {
        let repo = crate::fixtures::repo_root();
        let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["xtask", "package", "--binary"])
            .arg(crate::agent::agent_bin())
            .current_dir(&repo)
            .output()
            .expect("run cargo xtask package");
        assert!(
            out.status.success(),
            "cargo xtask package failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        std::fs::read_dir(repo.join("target/debian"))
            .expect("target/debian")
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "deb"))
            .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
            .unwrap_or_else(|| panic!("cargo xtask package wrote no .deb:\n{text}"))
    })
}
