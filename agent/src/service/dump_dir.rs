//! The dump directory, made ready once at start. Dumps are written there
//! by root for months and old ones are removed from it, so it must be the
//! directory itself (not a symlink someone can point elsewhere) and belong
//! to root (or the agent's own user): another owner could swap dumps for
//! links, or let others do so.

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

/// Creates `dir` (mode 0750) if missing, and refuses one that is a
/// symlink, not a directory, owned by another user, or writable by
/// others. The directories above it may be symlinks (a data disk mounted
/// elsewhere): an administrator sets those up, and only root writes
/// `/var/lib`.
pub fn prepare(dir: &Path) -> Result<(), String> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| {
            format!(
                "dump_dir {}: creating {}: {e}",
                dir.display(),
                parent.display()
            )
        })?;
    }
    // mkdir never follows a symlink in the last component: one there is
    // reported below, not written through.
    match std::fs::DirBuilder::new().mode(0o750).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("dump_dir {}: creating it: {e}", dir.display())),
    }
    let meta = dir
        .symlink_metadata()
        .map_err(|e| format!("dump_dir {}: {e}", dir.display()))?;
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(dir)
            .map(|t| format!(" (to {})", t.display()))
            .unwrap_or_default();
        return Err(format!(
            "dump_dir {} is a symlink{target}; dumps are written only into a real directory: \
             set dump_dir to the directory itself",
            dir.display()
        ));
    }
    if !meta.is_dir() {
        return Err(format!(
            "dump_dir {} exists and is not a directory; remove it or set dump_dir",
            dir.display()
        ));
    }
    // SAFETY: geteuid has no preconditions.
    let own = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != own {
        return Err(format!(
            "dump_dir {} is owned by uid {}, not root: its owner could replace dumps with \
             links; `chown root:root {}` it or set dump_dir to a directory root owns",
            dir.display(),
            meta.uid(),
            dir.display()
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o002 != 0 {
        return Err(format!(
            "dump_dir {} is writable by others (mode {mode:04o}); `chmod o-w {}` it",
            dir.display(),
            dir.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("xpuscope-dumpdir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_missing_dump_dir_is_created_private_and_a_symlink_is_refused() {
        let base = scratch("link");
        let dumps = base.join("a/b/dumps");
        prepare(&dumps).unwrap();
        let meta = std::fs::symlink_metadata(&dumps).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.permissions().mode() & 0o027, 0, "not open to others");
        prepare(&dumps).unwrap();

        let elsewhere = base.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let link = base.join("linked");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        let e = prepare(&link).unwrap_err();
        assert!(
            e.contains(&format!(
                "dump_dir {} is a symlink (to {})",
                link.display(),
                elsewhere.display()
            )) && e.contains("set dump_dir to the directory itself"),
            "{e}"
        );
        // A dangling one is not created through either.
        let dangling = base.join("dangling");
        std::os::unix::fs::symlink(base.join("nowhere"), &dangling).unwrap();
        assert!(prepare(&dangling).unwrap_err().contains("is a symlink"));
        assert!(!base.join("nowhere").exists());

        let file = base.join("file");
        std::fs::write(&file, "x").unwrap();
        assert!(prepare(&file).unwrap_err().contains("is not a directory"));

        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(
            prepare(&open)
                .unwrap_err()
                .contains("writable by others (mode 0777)")
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    #[cfg(feature = "root-tests")]
    fn a_dump_dir_owned_by_another_user_is_refused() {
        assert_eq!(unsafe { libc::geteuid() }, 0, "run as root");
        let base = scratch("owner");
        let dumps = base.join("dumps");
        std::fs::create_dir(&dumps).unwrap();
        std::os::unix::fs::chown(&dumps, Some(65534), Some(65534)).unwrap();
        let e = prepare(&dumps).unwrap_err();
        assert!(
            e.contains("is owned by uid 65534, not root") && e.contains("chown root:root"),
            "{e}"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }
}
