//! `cargo xtask install [--prefix DIR] [--root DIR] [--uninstall]`: the
//! agent as a systemd service.
//!
//! | file | from | install | uninstall |
//! |---|---|---|---|
//! | `$prefix/bin/agent` | the release build (the eBPF programs are embedded) | replaced when it differs (renamed into place: a running agent keeps its old file) | removed if it is an xpuscope agent |
//! | `/etc/systemd/system/xpuscope-agent.service` | `deploy/systemd/` (ExecStart rewritten for another prefix) | replaced when it differs | removed |
//! | `/etc/xpuscope/agent.toml` | `deploy/agent.toml` | written only if none exists (then checked with `agent service --check-config`) | removed only if unedited; an edited one is kept and named |
//!
//! Drop-ins (`systemctl edit`) and `/var/lib/xpuscope` (the dumps) are the
//! user's: never touched. Both directions are idempotent. `--root` stages
//! the files under a directory (packages, containers, tests) and never
//! talks to systemd; otherwise `systemctl daemon-reload` (and, on
//! uninstall, `disable --now`) runs only when systemd manages this system
//! (`/run/systemd/system` exists, as `sd_booted()` checks), and says so
//! when it does not.

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{build, root};

pub const UNIT_NAME: &str = "xpuscope-agent.service";
pub const UNIT_DIR: &str = "/etc/systemd/system";
pub const CONFIG_PATH: &str = "/etc/xpuscope/agent.toml";
pub const DEFAULT_PREFIX: &str = "/usr/local";

/// Where files go: `prefix` as the installed system sees it, staged under
/// `root` (`/` for a real install).
pub struct Layout {
    pub prefix: PathBuf,
    pub root: PathBuf,
}

impl Layout {
    pub fn new(prefix: &Path, root: Option<&Path>) -> Result<Layout> {
        if !prefix.is_absolute() {
            bail!(
                "--prefix {} must be an absolute path (it is written into the unit's ExecStart)",
                prefix.display()
            );
        }
        if prefix
            .to_str()
            .is_none_or(|p| p.contains(char::is_whitespace))
        {
            bail!(
                "--prefix {} must be UTF-8 without spaces (it is written into the unit's ExecStart)",
                prefix.display()
            );
        }
        let root = match root {
            Some(r) => std::path::absolute(r).with_context(|| format!("--root {}", r.display()))?,
            None => PathBuf::from("/"),
        };
        Ok(Layout {
            prefix: prefix.to_path_buf(),
            root,
        })
    }

    fn staged(&self) -> bool {
        self.root != Path::new("/")
    }

    /// `path` (as the installed system sees it) under the root.
    pub fn under_root(&self, path: &Path) -> PathBuf {
        self.root.join(
            path.strip_prefix("/")
                .expect("installed paths are absolute"),
        )
    }

    /// The binary as the installed system runs it.
    pub fn binary(&self) -> PathBuf {
        self.prefix.join("bin/agent")
    }

    pub fn unit(&self) -> PathBuf {
        Path::new(UNIT_DIR).join(UNIT_NAME)
    }
}

/// The unit file for `prefix`: the shipped one, its ExecStart binary moved
/// there.
pub fn unit_text(shipped: &str, prefix: &Path) -> Result<String> {
    let default_bin = format!("{DEFAULT_PREFIX}/bin/agent");
    let bin = prefix.join("bin/agent");
    let mut found = false;
    let text: Vec<String> = shipped
        .lines()
        .map(|l| match l.strip_prefix("ExecStart=") {
            Some(cmd) => {
                found = true;
                let rest = cmd
                    .strip_prefix(&default_bin)
                    .expect("the shipped ExecStart runs /usr/local/bin/agent");
                format!("ExecStart={}{rest}", bin.display())
            }
            None => l.to_string(),
        })
        .collect();
    if !found {
        bail!("the shipped unit has no ExecStart line");
    }
    Ok(text.join("\n") + "\n")
}

/// What one step did, for the report.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Written,
    UpToDate,
    /// An existing file left as it is (the reason).
    Kept(&'static str),
    Removed,
    Absent,
}

/// Writes `bytes` to `path` (mode `mode`) unless it holds them already;
/// through a temporary file renamed into place, so a running binary or a
/// reader never sees half a file.
fn place(path: &Path, bytes: &[u8], mode: u32) -> Result<Outcome> {
    if fs::read(path).is_ok_and(|old| old == bytes) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
        return Ok(Outcome::UpToDate);
    }
    let dir = path.parent().expect("installed paths have a directory");
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = path.file_name().expect("a file name").to_string_lossy();
    let tmp = dir.join(format!(".{name}.xtask-install"));
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))?;
    fs::rename(&tmp, path).with_context(|| format!("placing {}", path.display()))?;
    Ok(Outcome::Written)
}

fn remove(path: &Path) -> Result<Outcome> {
    match fs::remove_file(path) {
        Ok(()) => Ok(Outcome::Removed),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(Outcome::Absent),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

/// Whether `path` is an xpuscope agent binary (not another program that
/// happens to be called `agent`).
fn is_our_agent(path: &Path) -> Result<bool> {
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let marker = b"xpuscope";
    Ok(bytes.windows(marker.len()).any(|w| w == marker))
}

/// The shipped files: (unit, default config).
pub fn shipped() -> Result<(String, String)> {
    let read = |p: &str| {
        let path = root().join(p);
        fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    };
    Ok((
        read("deploy/systemd/xpuscope-agent.service")?,
        read("deploy/agent.toml")?,
    ))
}

/// Places the binary, the unit and (if none exists) the configuration.
pub fn install_files(
    layout: &Layout,
    binary: &Path,
    unit: &str,
    config: &str,
) -> Result<Vec<(PathBuf, Outcome)>> {
    let mut done = Vec::new();
    let bin = fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let target = layout.under_root(&layout.binary());
    done.push((layout.binary(), place(&target, &bin, 0o755)?));
    let unit = unit_text(unit, &layout.prefix)?;
    let target = layout.under_root(&layout.unit());
    done.push((layout.unit(), place(&target, unit.as_bytes(), 0o644)?));
    let target = layout.under_root(Path::new(CONFIG_PATH));
    let outcome = if target.exists() {
        Outcome::Kept("it exists; compare with deploy/agent.toml for new keys")
    } else {
        place(&target, config.as_bytes(), 0o644)?
    };
    done.push((PathBuf::from(CONFIG_PATH), outcome));
    Ok(done)
}

/// Removes what [`install_files`] placed, keeping an edited configuration.
pub fn uninstall_files(layout: &Layout, config: &str) -> Result<Vec<(PathBuf, Outcome)>> {
    let mut done = Vec::new();
    let bin = layout.under_root(&layout.binary());
    let outcome = if !bin.exists() {
        Outcome::Absent
    } else if !is_our_agent(&bin)? {
        Outcome::Kept("not an xpuscope agent")
    } else {
        remove(&bin)?
    };
    done.push((layout.binary(), outcome));
    done.push((layout.unit(), remove(&layout.under_root(&layout.unit()))?));
    let cfg = layout.under_root(Path::new(CONFIG_PATH));
    let outcome = match fs::read(&cfg) {
        Err(e) if e.kind() == ErrorKind::NotFound => Outcome::Absent,
        Err(e) => return Err(e).with_context(|| format!("reading {}", cfg.display())),
        Ok(text) if text == config.as_bytes() => remove(&cfg)?,
        Ok(_) => Outcome::Kept("edited (differs from the default); remove it by hand"),
    };
    done.push((PathBuf::from(CONFIG_PATH), outcome));
    // Its directory too, once empty (an edited config or a token file stays).
    let dir = cfg.parent().expect("a directory");
    if fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none()) {
        fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(done)
}

/// Whether systemd manages this system (`sd_booted()`).
fn systemd_running() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

fn report(done: &[(PathBuf, Outcome)], layout: &Layout) {
    for (path, outcome) in done {
        let shown = layout.under_root(path);
        let what = match outcome {
            Outcome::Written => "installed".to_string(),
            Outcome::UpToDate => "up to date".to_string(),
            Outcome::Kept(why) => format!("kept: {why}"),
            Outcome::Removed => "removed".to_string(),
            Outcome::Absent => "not there".to_string(),
        };
        println!("xtask: {}: {what}", shown.display());
    }
}

fn systemctl(args: &[&str]) -> Result<()> {
    crate::run_checked(
        Command::new("systemctl").args(args),
        &format!("systemctl {}", args.join(" ")),
    )
}

pub fn run(
    prefix: &Path,
    root_dir: Option<&Path>,
    uninstall: bool,
    binary: Option<&Path>,
) -> Result<()> {
    let layout = Layout::new(prefix, root_dir)?;
    let (unit, config) = shipped()?;
    let manage = !layout.staged() && systemd_running();
    if uninstall {
        if manage {
            // Stopped before its unit goes; "not loaded" is fine.
            let _ = Command::new("systemctl")
                .args(["disable", "--now", UNIT_NAME])
                .status();
        }
        let done = uninstall_files(&layout, &config)?;
        report(&done, &layout);
        println!(
            "xtask: left alone: {}.d/ drop-ins and /var/lib/xpuscope (dumps), if any",
            layout.unit().display()
        );
    } else {
        let binary = build::agent_or(binary)?;
        let done = install_files(&layout, &binary, &unit, &config)?;
        report(&done, &layout);
        let bin = layout.under_root(&layout.binary());
        let cfg = layout.under_root(Path::new(CONFIG_PATH));
        crate::run_checked(
            Command::new(&bin)
                .args(["service", "--check-config", "--config"])
                .arg(&cfg),
            &format!("checking {} with the installed agent", cfg.display()),
        )?;
    }
    if layout.staged() {
        println!(
            "xtask: staged under {} (systemd not told)",
            layout.root.display()
        );
    } else if manage {
        systemctl(&["daemon-reload"])?;
        if !uninstall {
            println!(
                "xtask: start it with `sudo systemctl enable --now {UNIT_NAME}` \
                 (running already? `sudo systemctl restart {UNIT_NAME}` picks up the new binary)"
            );
        }
    } else {
        println!(
            "xtask: systemd is not running this system (no /run/systemd/system): \
             no `systemctl daemon-reload`; on a systemd host run it, then \
             `systemctl enable --now {UNIT_NAME}`"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-install-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn exec_start_follows_the_prefix() {
        let (unit, _) = shipped().unwrap();
        let same = unit_text(&unit, Path::new(DEFAULT_PREFIX)).unwrap();
        assert_eq!(same, unit);
        let opt = unit_text(&unit, Path::new("/opt/xpuscope")).unwrap();
        let exec: Vec<&str> = opt
            .lines()
            .filter(|l| l.starts_with("ExecStart="))
            .collect();
        assert_eq!(
            exec,
            ["ExecStart=/opt/xpuscope/bin/agent service --config /etc/xpuscope/agent.toml"]
        );
        assert_eq!(opt.lines().count(), unit.lines().count());
        assert!(Layout::new(Path::new("opt"), None).is_err());
        assert!(Layout::new(Path::new("/opt/x y"), None).is_err());
    }

    /// Install twice, edit the config, uninstall twice: every step's
    /// outcome and the files left.
    #[test]
    fn install_and_uninstall_are_idempotent_and_keep_an_edited_config() {
        let dir = scratch("cycle");
        let stage = dir.join("root");
        // A stand-in binary carrying the marker an agent build has.
        let bin = dir.join("agent");
        fs::write(&bin, b"\x7fELF... xpuscope-agent ...").unwrap();
        let (unit, config) = shipped().unwrap();
        let layout = Layout::new(Path::new("/opt/x"), Some(&stage)).unwrap();
        let outcomes =
            |d: Vec<(PathBuf, Outcome)>| d.into_iter().map(|(_, o)| o).collect::<Vec<_>>();

        let first = outcomes(install_files(&layout, &bin, &unit, &config).unwrap());
        assert_eq!(
            first,
            [Outcome::Written, Outcome::Written, Outcome::Written]
        );
        let installed_bin = stage.join("opt/x/bin/agent");
        assert_eq!(fs::read(&installed_bin).unwrap(), fs::read(&bin).unwrap());
        let mode = fs::metadata(&installed_bin).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        let unit_file =
            fs::read_to_string(stage.join("etc/systemd/system/xpuscope-agent.service")).unwrap();
        assert!(
            unit_file.contains("\nExecStart=/opt/x/bin/agent service"),
            "{unit_file}"
        );
        let cfg = stage.join("etc/xpuscope/agent.toml");
        assert_eq!(fs::read_to_string(&cfg).unwrap(), config);

        let again = outcomes(install_files(&layout, &bin, &unit, &config).unwrap());
        assert!(matches!(
            again.as_slice(),
            [Outcome::UpToDate, Outcome::UpToDate, Outcome::Kept(_)]
        ));

        // A new build replaces the binary; the user's config stays as edited.
        fs::write(&bin, b"\x7fELF... xpuscope-agent v2").unwrap();
        fs::write(&cfg, "level = 2\n").unwrap();
        let upgrade = outcomes(install_files(&layout, &bin, &unit, &config).unwrap());
        assert!(matches!(
            upgrade.as_slice(),
            [Outcome::Written, Outcome::UpToDate, Outcome::Kept(_)]
        ));
        assert_eq!(fs::read_to_string(&cfg).unwrap(), "level = 2\n");

        let removed = outcomes(uninstall_files(&layout, &config).unwrap());
        assert!(matches!(
            removed.as_slice(),
            [Outcome::Removed, Outcome::Removed, Outcome::Kept(_)]
        ));
        assert!(!installed_bin.exists());
        assert!(cfg.exists(), "an edited config is kept");

        // Unedited, it goes, and its directory with it.
        fs::write(&cfg, &config).unwrap();
        let removed = outcomes(uninstall_files(&layout, &config).unwrap());
        assert_eq!(
            removed,
            [Outcome::Absent, Outcome::Absent, Outcome::Removed]
        );
        assert!(!stage.join("etc/xpuscope").exists());
        let nothing = outcomes(uninstall_files(&layout, &config).unwrap());
        assert_eq!(nothing, [Outcome::Absent, Outcome::Absent, Outcome::Absent]);

        // Someone else's `agent` is not removed.
        fs::create_dir_all(stage.join("opt/x/bin")).unwrap();
        fs::write(&installed_bin, b"#!/bin/sh\necho another agent\n").unwrap();
        let kept = outcomes(uninstall_files(&layout, &config).unwrap());
        assert!(matches!(kept[0], Outcome::Kept("not an xpuscope agent")));
        assert!(installed_bin.exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
