//! Embeds the kernel programs built by `cargo xtask build-ebpf`.
//!
//! The agent must still compile (check, clippy, unit tests) before the
//! object exists: then it embeds nothing and `attach` says how to build it.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    commit(&manifest);
    let default = manifest.join("../ebpf/programs/target/bpfel-unknown-none/release/xpuscope-ebpf");
    let object = std::env::var_os("XPUSCOPE_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or(default);
    println!("cargo:rerun-if-env-changed=XPUSCOPE_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", object.display());
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo")).join("xpuscope-ebpf.o");
    if object.exists() {
        std::fs::copy(&object, &out).expect("copy the eBPF object into OUT_DIR");
    } else {
        std::fs::write(&out, b"").expect("write an empty placeholder");
    }
}

/// The commit the agent is built from, for `xpuscope_build_info` and
/// `--version`: `git rev-parse --short=12 HEAD` of the repository, else
/// `unknown` (a source tarball).
fn commit(manifest: &std::path::Path) {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(manifest)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"])
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=XPUSCOPE_COMMIT={commit}");
    // A new commit or checkout changes these. Only files that exist: cargo
    // reruns the script (and rebuilds the agent) at every build for a
    // missing one, and a fresh clone keeps its refs in packed-refs.
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let mut watched = vec![format!("{dir}/HEAD"), format!("{dir}/packed-refs")];
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(format!("{dir}/{head}"));
        }
        for path in watched {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
}
