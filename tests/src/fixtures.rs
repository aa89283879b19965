//! Native fixtures built from source with `make`, once per process.
//!
//! Every fixture folder under `tests/` that has a `Makefile` is built into
//! `target/fixtures/<folder>/`, so tests never depend on committed binaries.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The fixture folders, in build order (later ones may use earlier outputs).
pub const FIXTURE_DIRS: &[&str] = &["workloads", "standins", "sim"];

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Where fixture `dir` is built: `target/fixtures/<dir>`.
pub fn fixture_out(dir: &str) -> PathBuf {
    repo_root().join("target").join("fixtures").join(dir)
}

/// Builds every fixture folder (idempotent: make only rebuilds what changed)
/// and returns `target/fixtures`. Panics with make's output on failure.
pub fn build_all() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            for dir in FIXTURE_DIRS {
                build_one(dir);
            }
            repo_root().join("target").join("fixtures")
        })
        .clone()
}

fn build_one(dir: &str) {
    let src = repo_root().join("tests").join(dir);
    if !src.join("Makefile").exists() {
        return;
    }
    let out = fixture_out(dir);
    std::fs::create_dir_all(&out).expect("create fixture output dir");
    let result = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(&src)
        .arg(format!("OUT={}", out.display()))
        .output()
        .expect("run make (is it installed?)");
    assert!(
        result.status.success(),
        "building fixtures in tests/{dir} failed:\n{}\n{}",
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
}
