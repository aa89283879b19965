//! Roots of their own standing in for container images and other machines:
//! a Debian unstable root (another glibc, CPython 3.14) and a Debian 12 one
//! made by `tests/roots/make-root.sh` (debootstrap, cached under
//! /var/cache/xpuscope-test between runs), and
//! processes started inside it the way a container runtime starts them: in
//! a mount namespace of their own, with that root as theirs (`unshare
//! --mount --root`), or with only `chroot`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::fixtures;

/// The Debian unstable root, made on first use (once per run; a concurrent
/// maker waits on the script's lock).
pub fn sid() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let dir = made("sid", "XPUSCOPE_SID_ROOT");
        mount_proc(&dir);
        dir
    })
}

/// A Debian 12 root with systemd and procps (the distribution fleets run, without
/// this machine's toolchain), made on first use.
pub fn bookworm() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| made("bookworm", "XPUSCOPE_BOOKWORM_ROOT"))
}

/// Root `name` made by `tests/roots/make-root.sh`, in the directory `var`
/// names or its default.
fn made(name: &str, var: &str) -> PathBuf {
    let dir = PathBuf::from(
        std::env::var(var).unwrap_or_else(|_| format!("/var/cache/xpuscope-test/{name}")),
    );
    let script = fixtures::repo_root().join("tests/roots/make-root.sh");
    let out = Command::new("sh")
        .arg(&script)
        .arg(name)
        .arg(&dir)
        .output()
        .expect("run tests/roots/make-root.sh");
    assert!(
        out.status.success(),
        "making the Debian {name} root at {} failed ({}):\n{}",
        dir.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// `/proc` inside `root` for processes that enter it by `chroot` (those
/// in a mount namespace of their own mount their own): a container has
/// one, and Python's threading reads it. Mounted once in the host's
/// namespace and left for later runs (the root-making script unmounts it
/// before it ever replaces the root).
fn mount_proc(root: &Path) {
    let target = root.join("proc");
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("/proc/self/mounts");
    let want = format!(" {} proc ", target.display());
    if mounts.lines().any(|l| l.contains(&want)) {
        return;
    }
    let status = Command::new("mount")
        .args(["-t", "proc", "proc"])
        .arg(&target)
        .status()
        .expect("run mount");
    assert!(status.success(), "mount -t proc proc {}", target.display());
}

/// How a process enters the other root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// `chroot`: the host's mount namespace, another root directory.
    Chroot,
    /// `unshare --mount --root`: a mount namespace of its own, its root
    /// a directory the host sees too.
    MountNamespace,
    /// What a container runtime does: a mount namespace of its own, the
    /// root an overlay of the image (writes go to a tmpfs) that only that
    /// namespace has, switched to with `pivot_root`. Its maps name its
    /// files by their paths inside it (`/usr/lib/x86_64-linux-gnu/libc.so.6`),
    /// where the host has other files of the same names.
    Container,
    /// [`Entry::Container`] with a pid namespace of its own too, as
    /// Docker and Kubernetes give by default: the program is pid 1 there,
    /// and sees its own thread ids. The command's child is `unshare`; the
    /// program is its only child ([`Entry::program_pid`]).
    ContainerPidNamespace,
}

/// The container entry's set-up, run by `sh -c` in the new mount
/// namespace; `$0` and its arguments are the program to run inside.
const CONTAINER_SETUP: &str = r#"set -e
image=$1; shift
mount -t tmpfs xpuscope-container /mnt
mkdir /mnt/upper /mnt/work /mnt/merged
mount -t overlay overlay -o "lowerdir=$image,upperdir=/mnt/upper,workdir=/mnt/work" /mnt/merged
mount -t proc proc /mnt/merged/proc
# The fixtures' directory as a volume: what the job writes there, the test
# reads on the host.
if [ -d "$image/xpuscope" ]; then mount --bind "$image/xpuscope" /mnt/merged/xpuscope; fi
mkdir /mnt/merged/.host
cd /mnt/merged
pivot_root . .host
cd /
exec "$0" "$@""#;

impl Entry {
    pub const ALL: [Entry; 4] = [
        Entry::Chroot,
        Entry::MountNamespace,
        Entry::Container,
        Entry::ContainerPidNamespace,
    ];

    /// `program` (a path inside `root`) with `args`, run inside `root`.
    /// The process that runs `program` is the command's own (each tool
    /// execs the next), so the child's pid is the program's.
    pub fn command(self, root: &Path, program: &str) -> Command {
        let mut cmd = match self {
            Entry::Chroot => {
                let mut c = Command::new("chroot");
                c.arg(root);
                c
            }
            Entry::MountNamespace => {
                let mut c = Command::new("unshare");
                c.arg("--mount")
                    .arg(format!("--root={}", root.display()))
                    .arg("--mount-proc");
                c
            }
            Entry::Container | Entry::ContainerPidNamespace => {
                let mut c = Command::new("unshare");
                c.args(["--mount", "--propagation", "private"]);
                if self == Entry::ContainerPidNamespace {
                    c.args(["--pid", "--fork", "--kill-child"]);
                }
                c.args(["sh", "-c"])
                    .arg(CONTAINER_SETUP)
                    .arg(program)
                    .arg(root);
                return c;
            }
        };
        cmd.arg(program);
        cmd
    }
}

impl Entry {
    /// The host pid of the program a command of this entry runs, given the
    /// command's child (they differ only with a pid namespace, where
    /// `unshare` forks it); waits up to 10 s for it.
    pub fn program_pid(self, child: u32) -> u32 {
        if self != Entry::ContainerPidNamespace {
            return child;
        }
        let started = std::time::Instant::now();
        loop {
            let children = std::fs::read_to_string(format!("/proc/{child}/task/{child}/children"))
                .unwrap_or_default();
            if let Some(pid) = children
                .split_whitespace()
                .next()
                .and_then(|p| p.parse().ok())
            {
                return pid;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(10),
                "unshare ({child}) started no program"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

/// The host tid of the thread process `pid` numbers `own` in its own pid
/// namespace (the last of its `NSpid` ids); `own` itself outside one.
pub fn host_tid(pid: u32, own: u32) -> u32 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return own;
    };
    for task in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        let last = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|ids| ids.split_whitespace().last())
            .and_then(|id| id.parse::<u32>().ok());
        if last == Some(own) {
            return task.file_name().to_string_lossy().parse().unwrap_or(own);
        }
    }
    own
}

/// Copies `files` into `root`'s `/xpuscope/<dir>/` (made fresh; a
/// volume of [`Entry::Container`]'s containers); returns
/// that directory as the processes inside see it.
pub fn place(root: &Path, dir: &str, files: &[&Path]) -> String {
    let inside = format!("/xpuscope/{dir}");
    let host = root.join(inside.trim_start_matches('/'));
    let _ = std::fs::remove_dir_all(&host);
    std::fs::create_dir_all(&host).expect("make the fixture directory in the root");
    for f in files {
        let name = f.file_name().expect("a file name");
        std::fs::copy(f, host.join(name))
            .unwrap_or_else(|e| panic!("copy {} into {}: {e}", f.display(), host.display()));
    }
    inside
}
