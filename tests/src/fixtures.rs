//! Native fixtures built from source with `make`, once per process.
//!
//! Every fixture folder under `tests/` that has a `Makefile` is built into
//! `target/fixtures/<folder>/`, so tests never depend on committed binaries.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The pinned NVIDIA wheels (PyPI) and the library each provides, relative
/// to the install folder.
pub const NVIDIA_WHEELS: &[(&str, &str)] = &[
    (
        "nvidia-cuda-runtime-cu12==12.9.79",
        "nvidia/cuda_runtime/lib/libcudart.so.12",
    ),
    ("nvidia-nccl-cu12==2.21.5", "nvidia/nccl/lib/libnccl.so.2"),
    (
        "nvidia-cuda-cupti-cu12==12.9.79",
        "nvidia/cuda_cupti/lib/libcupti.so.12",
    ),
];

/// The kernel names the simulated job launches (`tests/sim/src/rank.c`,
/// `rank.py`).
pub const SIM_KERNELS: &[&str] = &[
    "embedding_fwd",
    "attention_fwd",
    "mlp_fwd",
    "mlp_bwd",
    "attention_bwd",
    "grad_scale",
    "adam",
];

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

/// `~/.cache/xpuscope/nvidia-libs` with the pinned [`NVIDIA_WHEELS`]
/// installed. Idempotent and safe against a concurrent installer: pip
/// installs into a fresh temporary folder that is renamed into place only
/// when complete.
pub fn nvidia_libs() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let home = std::env::var_os("HOME").expect("HOME is set");
        let dir = Path::new(&home).join(".cache/xpuscope/nvidia-libs");
        let complete = |d: &Path| NVIDIA_WHEELS.iter().all(|(_, lib)| d.join(lib).is_file());
        if complete(&dir) {
            return dir;
        }
        let parent = dir.parent().expect("cache dir has a parent");
        std::fs::create_dir_all(parent).expect("create ~/.cache/xpuscope");
        let tmp = parent.join(format!("nvidia-libs.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let out = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&tmp)
            .args(NVIDIA_WHEELS.iter().map(|(wheel, _)| *wheel))
            .output()
            .expect("run python3 -m pip (is python3 with pip installed?)");
        assert!(
            out.status.success() && complete(&tmp),
            "pip install of the NVIDIA wheels into {} failed:\n{}\n{}",
            tmp.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !complete(&dir) {
            let _ = std::fs::remove_dir_all(&dir);
            if let Err(e) = std::fs::rename(&tmp, &dir) {
                assert!(
                    complete(&dir),
                    "moving {} to {}: {e}",
                    tmp.display(),
                    dir.display()
                );
            }
        }
        let _ = std::fs::remove_dir_all(&tmp);
        dir
    })
    .clone()
}
