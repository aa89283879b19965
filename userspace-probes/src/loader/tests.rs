//! The search over real ELF files built here with the system's C compiler
//! (as the loader would see them), under a scratch root.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::*;

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "xpuscope-loader-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// `path` (as the process sees it) under the root.
    fn at(&self, path: &str) -> PathBuf {
        self.0.join(path.trim_start_matches('/'))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compiles `source` into `out` with `args` (e.g. `-shared`, `-l...`).
fn cc(out: &Path, source: &str, args: &[String]) {
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let src = out.with_extension("c");
    std::fs::write(&src, source).unwrap();
    let status = Command::new("cc")
        .arg("-o")
        .arg(out)
        .arg(&src)
        // Debian's default --as-needed would drop libraries nothing calls.
        .arg("-Wl,--no-as-needed")
        .args(args)
        .status()
        .expect("run cc (the C compiler; Debian: apt-get install -y gcc)");
    assert!(status.success(), "cc {args:?}");
}

/// A shared library `file` in `dir` (under the root) with soname `file`,
/// linked against `deps` (sonames in `link_dir`) with `extra` flags.
fn library(s: &Scratch, dir: &str, file: &str, deps: &[&str], extra: &[String]) {
    let mut args = vec![
        "-shared".into(),
        "-fPIC".into(),
        format!("-Wl,-soname,{file}"),
    ];
    for d in deps {
        args.push(format!("-l:{d}"));
    }
    args.extend(extra.iter().cloned());
    cc(
        &s.at(&format!("{dir}/{file}")),
        &format!(
            "int f_{}(void) {{ return 1; }}\n",
            file.replace(['.', '-'], "_")
        ),
        &args,
    );
}

fn program(s: &Scratch, path: &str, deps: &[&str], extra: &[String]) {
    let mut args: Vec<String> = deps.iter().map(|d| format!("-l:{d}")).collect();
    args.extend(extra.iter().cloned());
    cc(&s.at(path), "int main(void) { return 0; }\n", &args);
}

fn search(s: &Scratch, ld_library_path: Option<&str>, cache: Option<LdCache>) -> Search {
    Search {
        root: s.0.clone(),
        ld_library_path: ld_library_path.map(str::to_string),
        cache,
    }
}

fn link_dir(s: &Scratch, dir: &str) -> String {
    format!("-L{}", s.at(dir).display())
}

fn found<'a>(p: &'a Prediction, name: &str) -> Option<&'a Found> {
    p.objects.iter().find(|f| f.name == name)
}

/// The simulator's layout: a rank program with `RUNPATH
/// $ORIGIN/../lib`; libhccl needs libascendcl through its own RUNPATH.
#[test]
fn runpath_with_origin_recursively() {
    let s = Scratch::new("runpath");
    library(&s, "/opt/job/lib", "libascendcl.so", &[], &[]);
    library(
        &s,
        "/opt/job/lib",
        "libhccl.so",
        &["libascendcl.so"],
        &[
            link_dir(&s, "/opt/job/lib"),
            "-Wl,--enable-new-dtags,-rpath,$ORIGIN".into(),
        ],
    );
    library(&s, "/opt/job/lib", "libnccl.so.2", &[], &[]);
    program(
        &s,
        "/opt/job/bin/rank",
        &["libhccl.so", "libnccl.so.2"],
        &[
            link_dir(&s, "/opt/job/lib"),
            "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../lib".into(),
        ],
    );
    let p = search(&s, None, None).predict("/opt/job/bin/rank").unwrap();
    assert!(
        p.interpreter
            .as_deref()
            .is_some_and(|i| i.ends_with("ld-linux-x86-64.so.2")),
        "{p:?}"
    );
    let hccl = found(&p, "libhccl.so").unwrap_or_else(|| panic!("libhccl: {p:?}"));
    assert_eq!(
        (hccl.path.as_str(), hccl.library, hccl.via),
        (
            "/opt/job/bin/../lib/libhccl.so",
            Some(Library::Hccl),
            Via::Runpath
        )
    );
    let acl = found(&p, "libascendcl.so").expect("libascendcl, needed by libhccl");
    assert_eq!(acl.path, "/opt/job/bin/../lib/libascendcl.so");
    assert_eq!(acl.library, Some(Library::AscendCl));
    // libc is not under the scratch root: missing there, as nothing else is.
    assert_eq!(p.missing, vec!["libc.so.6".to_string()], "{p:?}");
    let mut catalog: Vec<Library> = p.catalog().map(|(l, _)| l).collect();
    catalog.sort_by_key(|l| l.name());
    assert_eq!(catalog.len(), 3, "{catalog:?}");
}

/// `LD_LIBRARY_PATH` comes before `RUNPATH` (how a job swaps libraries),
/// a file that is not an x86-64 ELF is passed over, and `DT_RPATH`
/// comes before `LD_LIBRARY_PATH`.
#[test]
fn ld_library_path_rpath_and_skipped_candidates() {
    let s = Scratch::new("order");
    library(&s, "/runpath", "libcudart.so.12", &[], &[]);
    library(&s, "/override", "libcudart.so.12", &[], &[]);
    std::fs::create_dir_all(s.at("/bogus")).unwrap();
    std::fs::write(s.at("/bogus/libcudart.so.12"), b"not an ELF file").unwrap();
    program(
        &s,
        "/bin/uses-runpath",
        &["libcudart.so.12"],
        &[
            link_dir(&s, "/runpath"),
            "-Wl,--enable-new-dtags,-rpath,/runpath".into(),
        ],
    );
    let env = "/bogus::relative/dir:/override";
    let p = search(&s, Some(env), None)
        .predict("/bin/uses-runpath")
        .unwrap();
    let c = found(&p, "libcudart.so.12").unwrap();
    assert_eq!(
        (c.path.as_str(), c.via),
        ("/override/libcudart.so.12", Via::LdLibraryPath)
    );
    let p = search(&s, None, None).predict("/bin/uses-runpath").unwrap();
    assert_eq!(found(&p, "libcudart.so.12").unwrap().via, Via::Runpath);

    program(
        &s,
        "/bin/uses-rpath",
        &["libcudart.so.12"],
        &[
            link_dir(&s, "/runpath"),
            "-Wl,--disable-new-dtags,-rpath,/runpath".into(),
        ],
    );
    let p = search(&s, Some(env), None)
        .predict("/bin/uses-rpath")
        .unwrap();
    let c = found(&p, "libcudart.so.12").unwrap();
    assert_eq!(
        (c.path.as_str(), c.via),
        ("/runpath/libcudart.so.12", Via::Rpath)
    );
}

/// Without any search path the loader cache of the process's root names
/// the file; without a cache entry, the default directories.
#[test]
fn loader_cache_then_default_directories() {
    let s = Scratch::new("cache");
    library(&s, "/opt/cuda/lib", "libcupti.so.12", &[], &[]);
    library(&s, "/usr/lib/x86_64-linux-gnu", "libmspti.so", &[], &[]);
    program(
        &s,
        "/usr/bin/trainer",
        &["libcupti.so.12", "libmspti.so"],
        &[
            link_dir(&s, "/opt/cuda/lib"),
            link_dir(&s, "/usr/lib/x86_64-linux-gnu"),
        ],
    );
    let cache = LdCache::parse(&cache::build(&[(
        cache::FLAGS_X86_64,
        "libcupti.so.12",
        "/opt/cuda/lib/libcupti.so.12",
    )]))
    .unwrap();
    std::fs::create_dir_all(s.at("/etc")).unwrap();
    std::fs::write(
        s.at("/etc/ld.so.cache"),
        cache::build(&[(
            cache::FLAGS_X86_64,
            "libcupti.so.12",
            "/opt/cuda/lib/libcupti.so.12",
        )]),
    )
    .unwrap();
    assert_eq!(read_cache(&s.0), Some(cache.clone()));
    let p = search(&s, None, Some(cache))
        .predict("/usr/bin/trainer")
        .unwrap();
    let cupti = found(&p, "libcupti.so.12").unwrap();
    assert_eq!(
        (cupti.path.as_str(), cupti.via),
        ("/opt/cuda/lib/libcupti.so.12", Via::Cache)
    );
    let mspti = found(&p, "libmspti.so").unwrap();
    assert_eq!(
        (mspti.path.as_str(), mspti.via),
        ("/usr/lib/x86_64-linux-gnu/libmspti.so", Via::Default)
    );
    // Without the cache, libcupti is nowhere the loader would look.
    let p = search(&s, None, None).predict("/usr/bin/trainer").unwrap();
    assert!(p.missing.contains(&"libcupti.so.12".to_string()), "{p:?}");
}

#[test]
fn environment_and_search_lists() {
    assert_eq!(
        ld_library_path(b"A=1\0LD_LIBRARY_PATH=/a:/b\0LD_LIBRARY_PATH=/c\0"),
        Some("/a:/b".into())
    );
    assert_eq!(ld_library_path(b"XLD_LIBRARY_PATH=/a\0"), None);
    assert_eq!(ld_library_path(b"LD_LIBRARY_PATH=\xff\0"), None);
    let mut long = b"LD_LIBRARY_PATH=".to_vec();
    long.extend(std::iter::repeat_n(b'/', MAX_PATH_LIST + 1));
    assert_eq!(ld_library_path(&long), None);
    assert_eq!(
        split_list(
            "$ORIGIN/../lib:;rel:/x/${ORIGIN}:/p/$PLATFORM:/y/",
            "/opt/bin"
        ),
        vec!["/opt/bin/../lib", "/x//opt/bin", "/y/"]
    );
    assert_eq!(split_list(&"/d:".repeat(1000), "/").len(), MAX_DIRS);
    assert_eq!(dir_of("/prog"), "/");
    assert_eq!(dir_of("/a/b/prog"), "/a/b");
}

/// This machine's loader finds libc for the test binary itself through
/// the real cache or default directories.
#[test]
fn predicts_the_test_binary_on_this_machine() {
    let exe = std::env::current_exe().unwrap();
    let p = Search::host().predict(exe.to_str().unwrap()).unwrap();
    let libc = found(&p, "libc.so.6").expect("libc");
    assert!(matches!(libc.via, Via::Cache | Via::Default), "{libc:?}");
    assert!(p.missing.is_empty(), "{p:?}");
}
