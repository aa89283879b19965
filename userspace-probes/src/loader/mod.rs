//! Which libraries a program will load, found before it loads them: the
//! dynamic loader's own search, replayed over the program's files.
//!
//! Uprobes on a library file apply to every process that maps it later, so
//! knowing at `exec` which device libraries a program will map lets their
//! probes be in place before its first call (a rank that sets up its
//! communicator 14 ms after it starts). The search follows glibc's
//! `ld.so` for every `DT_NEEDED` name, recursively:
//!
//! 1. a name with a `/` is a path;
//! 2. `DT_RPATH` of the object needing it and of the objects that loaded
//!    it, up to the program (only when the object has no `DT_RUNPATH`);
//! 3. `LD_LIBRARY_PATH` from the process's environment;
//! 4. `DT_RUNPATH` of the object needing it;
//! 5. the loader cache ([`cache::LdCache`], `/etc/ld.so.cache`), unless
//!    the object says `DF_1_NODEFLIB`;
//! 6. the default directories.
//!
//! `$ORIGIN` expands to the needing object's directory; a path entry with
//! another token (`$LIB`, `$PLATFORM`) is skipped, as are the
//! `glibc-hwcaps` subdirectories and `LD_PRELOAD`. A candidate that is not
//! an x86-64 ELF file is skipped, as the loader does. The search is a
//! prediction: `dlopen` and anything the search misses are still found
//! by the agent's rescan of the process's maps.
//!
//! Every path is looked up under a root ([`Search::root`]): the traced
//! process's `/proc/PID/root` when it lives in another mount namespace.

pub mod cache;
pub mod dynamic;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::catalog::Library;
pub use cache::LdCache;
pub use dynamic::DynamicInfo;

/// Most objects followed for one program (a PyTorch process maps a few
/// hundred).
pub const MAX_OBJECTS: usize = 1024;
/// Most bytes of `/proc/PID/environ` looked at.
pub const MAX_ENVIRON: usize = 1 << 20;
/// Longest `LD_LIBRARY_PATH` value kept.
const MAX_PATH_LIST: usize = 64 << 10;
/// Most directories taken from one search list.
const MAX_DIRS: usize = 64;

/// The directories glibc searches last on Debian/Ubuntu x86-64 (multiarch
/// first), and the classic ones.
pub const DEFAULT_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// `LD_LIBRARY_PATH`'s value in a process's environment (`NAME=value`
/// strings separated by NULs, as `/proc/PID/environ` holds them). Looks at
/// no more than [`MAX_ENVIRON`] bytes; a value that is too long or not
/// UTF-8 counts as unset.
pub fn ld_library_path(environ: &[u8]) -> Option<String> {
    let environ = &environ[..environ.len().min(MAX_ENVIRON)];
    environ
        .split(|&b| b == 0)
        .filter_map(|var| var.strip_prefix(b"LD_LIBRARY_PATH="))
        // The loader takes the first; so does this.
        .next()
        .filter(|v| v.len() <= MAX_PATH_LIST)
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_string)
}

/// One object the program will map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The `DT_NEEDED` name that led to it.
    pub name: String,
    /// Its path as the process sees it.
    pub path: String,
    /// The catalog library it is, if any.
    pub library: Option<Library>,
    /// How it was found.
    pub via: Via,
}

/// Which step of the search found an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Path,
    Rpath,
    LdLibraryPath,
    Runpath,
    Cache,
    Default,
}

/// The result of a search.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prediction {
    /// The program's interpreter (`PT_INTERP`), e.g. the loader whose
    /// debugger hook reports later `dlopen`s.
    pub interpreter: Option<String>,
    /// Every object found, in load order (breadth first, as the loader).
    pub objects: Vec<Found>,
    /// `DT_NEEDED` names found nowhere (the program would fail to start,
    /// or the search missed a step it does not replay).
    pub missing: Vec<String>,
}

impl Prediction {
    /// The catalog libraries among the objects: (library, path).
    pub fn catalog(&self) -> impl Iterator<Item = (Library, &str)> {
        self.objects
            .iter()
            .filter_map(|f| Some((f.library?, f.path.as_str())))
    }
}

/// How to search for one program.
#[derive(Clone, Debug)]
pub struct Search {
    /// Paths are looked up under this directory (`/` for the agent's own
    /// mount namespace, else `/proc/PID/root`).
    pub root: PathBuf,
    /// The process's `LD_LIBRARY_PATH`.
    pub ld_library_path: Option<String>,
    /// The loader cache of the process's root (`None`: unreadable; the
    /// default directories are still searched).
    pub cache: Option<LdCache>,
}

impl Search {
    /// A search in the agent's own root with no `LD_LIBRARY_PATH` and the
    /// cache at `/etc/ld.so.cache` if it reads.
    pub fn host() -> Self {
        let root = PathBuf::from("/");
        let cache = read_cache(&root);
        Self {
            root,
            ld_library_path: None,
            cache,
        }
    }

    /// The file at `path` (as the process sees it) in the agent's view.
    pub fn host_path(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }

    /// Predicts what `program` (its path as the process sees it) will load.
    pub fn predict(&self, program: &str) -> Result<Prediction, dynamic::ReadError> {
        let exe = DynamicInfo::read(&self.host_path(program))?;
        let mut out = Prediction {
            interpreter: exe.interpreter.clone(),
            ..Prediction::default()
        };
        // (path, facts, index of the object that needed it) in load order;
        // index 0 is the program.
        let mut objects: Vec<(String, DynamicInfo, Option<usize>)> =
            vec![(program.to_string(), exe, None)];
        let mut names_seen: HashSet<String> = HashSet::new();
        let mut paths_seen: HashSet<String> = HashSet::from([program.to_string()]);
        let ld_dirs: Vec<String> = self
            .ld_library_path
            .as_deref()
            .map(|v| split_list(v, &dir_of(program)))
            .unwrap_or_default();
        let mut next = 0;
        while next < objects.len() && objects.len() < MAX_OBJECTS {
            let needed = objects[next].1.needed.clone();
            for name in needed {
                if !names_seen.insert(name.clone()) {
                    continue; // loaded once, by whichever object asked first
                }
                match self.find(&name, next, &objects, &ld_dirs) {
                    Some((path, info, via)) => {
                        if !paths_seen.insert(path.clone()) {
                            continue;
                        }
                        out.objects.push(Found {
                            library: Library::from_path(&path),
                            name,
                            path: path.clone(),
                            via,
                        });
                        objects.push((path, info, Some(next)));
                        if objects.len() >= MAX_OBJECTS {
                            break;
                        }
                    }
                    None => out.missing.push(name),
                }
            }
            next += 1;
        }
        Ok(out)
    }

    /// Where the loader finds `name` for object `by` of `objects`.
    fn find(
        &self,
        name: &str,
        by: usize,
        objects: &[(String, DynamicInfo, Option<usize>)],
        ld_dirs: &[String],
    ) -> Option<(String, DynamicInfo, Via)> {
        if name.contains('/') {
            // A relative one is relative to the process's working
            // directory, which is not followed.
            return name
                .starts_with('/')
                .then(|| self.candidate(name.to_string()))
                .flatten()
                .map(|(p, i)| (p, i, Via::Path));
        }
        let (requester_path, requester, _) = &objects[by];
        let mut dirs: Vec<(String, Via)> = Vec::new();
        if requester.runpath.is_none() {
            // RPATH of the requester, then of each object up the chain
            // that loaded it, then the program's.
            let mut at = Some(by);
            while let Some(i) = at {
                let (path, info, parent) = &objects[i];
                if info.runpath.is_none()
                    && let Some(r) = &info.rpath
                {
                    dirs.extend(
                        split_list(r, &dir_of(path))
                            .into_iter()
                            .map(|d| (d, Via::Rpath)),
                    );
                }
                at = *parent;
            }
        }
        dirs.extend(ld_dirs.iter().map(|d| (d.clone(), Via::LdLibraryPath)));
        if let Some(r) = &requester.runpath {
            dirs.extend(
                split_list(r, &dir_of(requester_path))
                    .into_iter()
                    .map(|d| (d, Via::Runpath)),
            );
        }
        for (dir, via) in dirs {
            if let Some((p, i)) = self.candidate(format!("{}/{name}", dir.trim_end_matches('/'))) {
                return Some((p, i, via));
            }
        }
        if requester.nodeflib {
            return None;
        }
        if let Some(path) = self.cache.as_ref().and_then(|c| c.lookup(name))
            && let Some((p, i)) = self.candidate(path.to_string())
        {
            return Some((p, i, Via::Cache));
        }
        DEFAULT_DIRS.iter().find_map(|dir| {
            self.candidate(format!("{dir}/{name}"))
                .map(|(p, i)| (p, i, Via::Default))
        })
    }

    /// `path` if it is a readable x86-64 ELF object.
    fn candidate(&self, path: String) -> Option<(String, DynamicInfo)> {
        let info = DynamicInfo::read(&self.host_path(&path)).ok()?;
        Some((path, info))
    }
}

/// The loader cache under `root`, if it reads and parses.
pub fn read_cache(root: &Path) -> Option<LdCache> {
    let path = root.join("etc/ld.so.cache");
    let data = crate::regular_file::read_bounded(&path, cache::MAX_CACHE_BYTES as u64).ok()?;
    LdCache::parse(&data).ok()
}

/// The directory of `path` (`/` for a file at the top).
fn dir_of(path: &str) -> String {
    match path.rsplit_once('/') {
        Some(("", _)) | None => "/".to_string(),
        Some((dir, _)) => dir.to_string(),
    }
}

/// A search list (`:` or `;` separated) with `$ORIGIN` expanded to
/// `origin`; empty entries (the working directory), relative ones and ones
/// with other tokens are left out. At most [`MAX_DIRS`].
pub fn split_list(list: &str, origin: &str) -> Vec<String> {
    list.split([':', ';'])
        .filter_map(|d| {
            let d = d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin);
            (d.starts_with('/') && !d.contains('$')).then_some(d)
        })
        .take(MAX_DIRS)
        .collect()
}

#[cfg(test)]
mod tests;
