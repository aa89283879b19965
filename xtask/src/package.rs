//! `cargo xtask package [--binary PATH]`: the agent as a Debian package,
//! `target/debian/xpuscope_<version>_amd64.deb`, built with Debian's own
//! `dpkg-deb` from the files `cargo xtask install` stages:
//!
//! | file | what |
//! |---|---|
//! | `/usr/bin/agent` | the agent (release build, eBPF programs embedded) |
//! | `/lib/systemd/system/xpuscope-agent.service` | the unit (ExecStart `/usr/bin/agent`) |
//! | `/etc/xpuscope/agent.toml` | the default configuration, a conffile (an edited one survives upgrades) |
//! | `/usr/share/man/man1/agent.1.gz` | the manual page (`agent man`) |
//! | `/usr/share/bash-completion/completions/agent`, `/usr/share/zsh/vendor-completions/_agent`, `/usr/share/fish/vendor_completions.d/agent.fish` | completions (`agent completions SHELL`) |
//! | `/usr/share/doc/xpuscope/copyright` | the licence (`LICENSE`) |
//!
//! The package depends on glibc and procps (the unit reloads with
//! `/bin/kill`) only: no toolchain, no test tool. Its
//! maintainer scripts tell systemd about the unit (reload at install and
//! removal, stop at removal) and never start it: the node's owner decides.

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::install::{self, Layout};
use crate::{build, root, run_checked};

/// Where the package goes, by version.
pub fn deb_path(version: &str) -> PathBuf {
    root()
        .join("target/debian")
        .join(format!("xpuscope_{version}_amd64.deb"))
}

/// The workspace's version (`[workspace.package] version`).
pub fn version() -> Result<String> {
    let text = fs::read_to_string(root().join("Cargo.toml")).context("reading Cargo.toml")?;
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "version").then(|| v.trim().trim_matches('"').to_string())
        })
        .context("no version in Cargo.toml")
}

pub fn run(binary: Option<&Path>) -> Result<PathBuf> {
    let binary = build::agent_or(binary)?;
    let version = version()?;
    let stage = root().join("target/debian/stage");
    let _ = fs::remove_dir_all(&stage);
    fs::create_dir_all(&stage).with_context(|| format!("creating {}", stage.display()))?;
    // The files `install` places, for prefix /usr; the unit then moves to
    // where packages keep theirs (/etc/systemd/system is the admin's).
    let layout = Layout::new(Path::new("/usr"), Some(&stage))?;
    let (unit, config) = install::shipped()?;
    install::install_files(&layout, &binary, &unit, &config)?;
    let etc_unit = layout.under_root(&layout.unit());
    let lib_unit = stage.join("lib/systemd/system").join(install::UNIT_NAME);
    fs::create_dir_all(lib_unit.parent().expect("a parent"))?;
    fs::rename(&etc_unit, &lib_unit).context("moving the unit to /lib/systemd/system")?;
    let _ = fs::remove_dir(etc_unit.parent().expect("a parent"));
    let _ = fs::remove_dir(stage.join("etc/systemd"));
    let agent = stage.join("usr/bin/agent");
    run_checked(
        Command::new(&agent)
            .args(["service", "--check-config", "--config"])
            .arg(stage.join(install::CONFIG_PATH.trim_start_matches('/'))),
        "checking the packaged configuration with the packaged agent",
    )?;

    // The manual page and completions, from the agent's own CLI.
    let output = |args: &[&str]| -> Result<Vec<u8>> {
        let out = Command::new(&agent)
            .args(args)
            .output()
            .with_context(|| format!("running {} {}", agent.display(), args.join(" ")))?;
        anyhow::ensure!(out.status.success(), "agent {} failed", args.join(" "));
        Ok(out.stdout)
    };
    let man = output(&["man"])?;
    let man_path = stage.join("usr/share/man/man1/agent.1.gz");
    fs::create_dir_all(man_path.parent().expect("a parent"))?;
    let mut gz = Command::new("gzip")
        .args(["-9n"])
        .stdin(std::process::Stdio::piped())
        .stdout(fs::File::create(&man_path)?)
        .spawn()
        .context("running gzip")?;
    gz.stdin.take().expect("piped").write_all(&man)?;
    anyhow::ensure!(gz.wait()?.success(), "gzip failed");
    for (shell, path) in [
        ("bash", "usr/share/bash-completion/completions/agent"),
        ("zsh", "usr/share/zsh/vendor-completions/_agent"),
        ("fish", "usr/share/fish/vendor_completions.d/agent.fish"),
    ] {
        let target = stage.join(path);
        fs::create_dir_all(target.parent().expect("a parent"))?;
        fs::write(&target, output(&["completions", shell])?)?;
    }
    let doc = stage.join("usr/share/doc/xpuscope");
    fs::create_dir_all(&doc)?;
    fs::copy(root().join("LICENSE"), doc.join("copyright")).context("copying LICENSE")?;

    // Package metadata.
    let debian = stage.join("DEBIAN");
    fs::create_dir_all(&debian)?;
    let installed_kib: u64 = walk_size(&stage)? / 1024;
    fs::write(
        debian.join("control"),
        format!(
            "Package: xpuscope\n\
             Version: {version}\n\
             Architecture: amd64\n\
             Maintainer: xpuscope developers <xpuscope@localhost>\n\
             Installed-Size: {installed_kib}\n\
             Depends: libc6 (>= 2.34), procps\n\
             Section: admin\n\
             Priority: optional\n\
             Homepage: https://github.com/xpuscope/xpuscope\n\
             Description: eBPF observability agent for AI training nodes\n \
             xpuscope attaches to running training processes (no restart, no\n \
             LD_PRELOAD) and writes Perfetto traces of their scheduling, device-library\n \
             calls and stacks; as a systemd service it finds training jobs by itself,\n \
             serves Prometheus metrics and keeps a flight recorder.\n"
        ),
    )?;
    fs::write(
        debian.join("conffiles"),
        format!("{}\n", install::CONFIG_PATH),
    )?;
    let script = |name: &str, body: &str| -> Result<()> {
        let path = debian.join(name);
        fs::write(&path, format!("#!/bin/sh\nset -e\n{body}"))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
        Ok(())
    };
    // systemd is told only where it runs the system (a container or a
    // chroot has none); the unit is never started by the package.
    let reload = "if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi\n";
    script("postinst", reload)?;
    script(
        "prerm",
        &format!(
            "if [ -d /run/systemd/system ] && [ \"$1\" = remove ]; then\n    \
             systemctl disable --now {} || true\nfi\n",
            install::UNIT_NAME
        ),
    )?;
    script("postrm", reload)?;

    let deb = deb_path(&version);
    run_checked(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&stage)
            .arg(&deb),
        "dpkg-deb --build",
    )?;
    let size = fs::metadata(&deb)?.len();
    println!(
        "xtask: {} ({:.1} MB; install with `sudo apt install {}`)",
        deb.display(),
        size as f64 / 1e6,
        deb.display()
    );
    Ok(deb)
}

/// Bytes of the files under `dir`.
fn walk_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            walk_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}
