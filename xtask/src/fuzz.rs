//! `cargo xtask fuzz [--seconds N] [TARGET]`: runs the fuzz targets of
//! `tests/fuzz` under libFuzzer (cargo-fuzz, nightly), each for N seconds,
//! seeded with the kept corpus `tests/fuzz/corpus/<target>`. New inputs go
//! to `target/fuzz/corpus/<target>` (not the repository); a crash stops the
//! run with its input under `target/fuzz/artifacts/<target>/`: add it to
//! the kept corpus and a unit test. `--merge` folds what a run found that
//! adds coverage back into the kept corpus (minimized by libFuzzer).
//!
//! `cargo xtask test` runs the same targets the stable way (`cargo test -p
//! xpuscope-fuzz`: the kept corpus plus seeded mutations, no nightly).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{clean_command, root, run_checked};

/// The targets, as named in `tests/fuzz/src/lib.rs`.
pub const TARGETS: &[&str] = &[
    "activity",
    "device_calls",
    "elf",
    "placement",
    "maps",
    "procfs",
    "btf",
    "environ",
    "ld_cache",
    "elf_dynamic",
    "python_frames",
    "cfi",
    "python_interpreter",
];

fn fuzz_dir() -> PathBuf {
    root().join("tests/fuzz/libfuzzer")
}

/// Installs cargo-fuzz if `cargo fuzz` is missing (about a minute, once).
fn ensure_cargo_fuzz() -> Result<()> {
    let has = clean_command("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if has {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-fuzz (once)");
    run_checked(
        clean_command("cargo").args(["install", "--locked", "cargo-fuzz"]),
        "cargo install cargo-fuzz",
    )
}

pub fn run(seconds: u64, only: Option<&str>, merge: bool) -> Result<()> {
    let targets: Vec<&str> = match only {
        Some(t) if TARGETS.contains(&t) => vec![t],
        Some(t) => bail!(
            "no fuzz target {t:?}; the targets are {}",
            TARGETS.join(", ")
        ),
        None => TARGETS.to_vec(),
    };
    ensure_cargo_fuzz()?;
    for t in targets {
        let kept = root().join("tests/fuzz/corpus").join(t);
        let scratch = root().join("target/fuzz/corpus").join(t);
        let artifacts = root().join("target/fuzz/artifacts").join(t);
        std::fs::create_dir_all(&scratch).with_context(|| scratch.display().to_string())?;
        std::fs::create_dir_all(&artifacts).with_context(|| artifacts.display().to_string())?;
        eprintln!("xtask: fuzzing {t} for {seconds} s");
        let mut cmd = fuzz_command(t);
        cmd.arg(&scratch)
            .arg(&kept)
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .arg("-timeout=10")
            .arg("-rss_limit_mb=4096")
            .arg("-print_final_stats=1");
        run_checked(&mut cmd, &format!("fuzzing {t}"))?;
        if merge {
            // -merge=1 keeps only inputs that add coverage, into the first dir.
            let mut cmd = fuzz_command(t);
            cmd.arg(&kept).arg(&scratch).arg("--").arg("-merge=1");
            run_checked(&mut cmd, &format!("merging the {t} corpus"))?;
        }
    }
    Ok(())
}

fn fuzz_command(target: &str) -> Command {
    let mut cmd = clean_command("cargo");
    cmd.args(["+nightly", "fuzz", "run", "--fuzz-dir"])
        .arg(fuzz_dir())
        // Its own target dir: sanitizer builds must not evict the main ones.
        .arg("--target-dir")
        .arg(root().join("target/fuzz/build"))
        .arg(target);
    cmd
}
