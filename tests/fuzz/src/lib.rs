//! Fuzz targets: each takes arbitrary bytes and feeds them to one parser of
//! input that a traced process or a file controls. A target passes when it
//! returns; a panic (or, under libFuzzer, a crash or timeout) is a bug.
//!
//! | target | what it parses |
//! |---|---|
//! | `activity` | CUPTI/MSPTI activity records read from target memory |
//! | `device_calls` | raw `UprobeEntry`/`UprobeReturn` records against a probe table of the whole catalog |
//! | `elf` | a library file: `.dynsym`, program headers, probe placement |
//! | `placement` | a function's first bytes: x86-64 decoding, placement, thunks |
//! | `maps` | `/proc/PID/maps` and library discovery |
//! | `procfs` | `/proc/PID/stat` (as the process model and service discovery read it), `status`, `cmdline` |
//! | `btf` | a `--kernel-btf` file |
//! | `environ` | `/proc/PID/environ`: a rank's identity (`RANK`, `WORLD_SIZE`, job) |
//! | `ld_cache` | a process's `/etc/ld.so.cache` (the loader cache) |
//! | `python_frames` | a CPython process's memory: thread list, frames, code objects, strings, line tables (3.10-3.14 layouts) |
//! | `python_interpreter` | the files a process maps, taken for a CPython interpreter: `_PyRuntime`, `Py_Version`, the evaluation loop and type objects in their symbols, the version in the name |
//! | `cfi` | a mapped file's unwind tables (`.eh_frame_hdr`, `.eh_frame`, `.debug_frame`), read and unwound through |
//! | `elf_dynamic` | a program's or library's `PT_INTERP`, `DT_NEEDED`, `DT_RPATH`/`DT_RUNPATH`, and `LD_LIBRARY_PATH` from its environment |
//!
//! Run them with `cargo xtask fuzz [--seconds N] [TARGET]` (libFuzzer,
//! nightly) or replay the kept corpus with `cargo test -p xpuscope-fuzz`.

pub mod agent;
pub mod cfi;
mod device_calls;
pub mod mutate;
pub mod python_frames;
pub mod python_interpreter;

use std::io::Write;

use xpuscope_probes::activity::{self, ActivityApi};
use xpuscope_probes::catalog::Library;
use xpuscope_probes::loader::{self, DynamicInfo, LdCache};
use xpuscope_probes::placement::{self, Reg, RegSet};
use xpuscope_probes::{discover, maps::ProcessMaps, resolve};

pub use cfi::cfi;
pub use device_calls::device_calls;
pub use python_frames::python_frames;
pub use python_interpreter::python_interpreter;

/// A fuzz target: returns, or panics on a bug.
pub type Target = fn(&[u8]);

/// Every target by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("activity", activity),
    ("device_calls", device_calls),
    ("elf", elf),
    ("placement", placement),
    ("maps", maps),
    ("procfs", procfs),
    ("btf", btf),
    ("environ", environ),
    ("ld_cache", ld_cache),
    ("elf_dynamic", elf_dynamic),
    ("python_frames", python_frames),
    ("cfi", cfi),
    ("python_interpreter", python_interpreter),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// An activity record of either API (the first byte picks it).
pub fn activity(data: &[u8]) {
    let Some((&which, record)) = data.split_first() else {
        return;
    };
    let api = if which & 1 == 0 {
        ActivityApi::Cupti
    } else {
        ActivityApi::Mspti
    };
    if let Ok(a) = activity::parse(api, record) {
        // What the trace stage reads of a parsed record.
        let _ = (a.kind, a.start, a.end, a.device, a.stream, format!("{a:?}"));
    }
}

/// A library file: written to a scratch file (resolution reads a path),
/// then resolved against every catalog library.
pub fn elf(data: &[u8]) {
    thread_local! {
        static SCRATCH: std::path::PathBuf = std::env::temp_dir().join(format!(
            "xpuscope-fuzz-elf-{}-{:?}.so",
            std::process::id(),
            std::thread::current().id()
        ));
    }
    SCRATCH.with(|path| {
        let written = std::fs::File::create(path).and_then(|mut f| f.write_all(data));
        if written.is_err() {
            return;
        }
        let _ = resolve::exported_functions(path);
        for lib in Library::ALL {
            if let Ok(r) = resolve::resolve(path, lib) {
                let _ = (r.report(), r.to_string());
            }
        }
    });
}

/// A function's first bytes: decoded, placed for every read set the
/// catalog uses, and checked for a tail call. The first 8 bytes are the
/// address (branch targets wrap around it).
pub fn placement(data: &[u8]) {
    let (addr, code) = match data.split_first_chunk::<8>() {
        Some((a, code)) => (u64::from_le_bytes(*a), code),
        None => (0x1000, data),
    };
    for n in 0..=6u8 {
        let reads = (0..n).fold(RegSet::EMPTY.with(Reg::Rsp), |s, i| s.with(Reg::arg(i)));
        let p = placement::place(code, addr, reads);
        assert!(
            p.offset as usize <= code.len().min(placement::MAX_WINDOW),
            "{p:?}"
        );
        assert!(
            p.offset == 0 || p.emulated,
            "moved onto a non-emulated instruction: {p:?}"
        );
        let _ = p.to_string();
    }
    let _ = placement::tail_call_target(code, addr);
    let _ = placement::decode(code, addr);
}

/// `/proc/PID/maps` text (any bytes: file names are), then discovery and
/// address lookups.
pub fn maps(data: &[u8]) {
    let maps = ProcessMaps::parse(&String::from_utf8_lossy(data));
    let libs = discover::discover(&maps);
    let _ = discover::diff(&libs, &[]);
    for m in maps.mappings() {
        let _ = maps.find(m.start);
        let _ = maps.find(m.end.wrapping_sub(1));
        let _ = m.file_offset_of(m.start);
        let _ = maps.base_of(&m.path);
    }
    for l in &libs {
        let _ = l.address_of(0);
        let _ = l.address_of(u64::MAX);
    }
}

/// `/proc/PID/stat`, `status` and `cmdline` text; and the bytes as a
/// process's own name in a well-formed `stat`, whose fields it must not
/// shift.
pub fn procfs(data: &[u8]) {
    use agent::procfs::{ProcStat, parse_stat};
    let text = String::from_utf8_lossy(data);
    let stat = parse_stat(&text);
    if let Some(s) = &stat {
        assert!(text.contains(&s.comm));
    }
    if let Some(p) = ProcStat::parse(&text) {
        assert!(text.contains(&p.comm));
        if let Some(s) = stat {
            assert_eq!(s.comm, p.comm, "one comm for both parsers");
        }
    }
    let comm: String = text.chars().filter(|&c| c != '\0').collect();
    let line = format!(
        "4242 ({comm}) S 7 4242 4242 0 -1 4194304 1 0 0 0 3 4 0 0 20 0 2 0 777 123456 100\n"
    );
    let s = parse_stat(&line).expect("a stat line");
    assert_eq!((s.comm.as_str(), s.state, s.ppid), (comm.as_str(), 'S', 7));
    assert_eq!(
        ProcStat::parse(&line),
        Some(ProcStat {
            comm,
            start_time: 777,
            vsize: 123456
        })
    );
    let _ = agent::procfs::parse_status_uid(&text);
    let _ = agent::procfs::parse_cmdline(data);
}

/// `/proc/PID/environ`: the rank identity the agent labels processes with
/// (values bounded, names and labels well formed).
pub fn environ(data: &[u8]) {
    let id =
        agent::identity::RankIdentity::from_environ_with(data, &agent::identity::default_job_env());
    for v in [&id.rank, &id.local_rank, &id.world_size, &id.job]
        .into_iter()
        .flatten()
    {
        assert!(v.chars().count() <= 128, "{v:?}");
    }
    let _ = id.name();
    assert!(id.labels().len() <= 4);
}

/// A BTF file, and the lookups the agent makes in it.
pub fn btf(data: &[u8]) {
    if let Ok(b) = agent::btf::Btf::parse(data) {
        let _ = agent::btf::task_offsets(&b);
        let _ = b.offset_of("task_struct", "thread_info.cpu");
        let _ = b.offset_of("task_struct", "a.b.c.d");
    }
}

/// A loader cache file, and the lookups the search makes in it.
pub fn ld_cache(data: &[u8]) {
    if let Ok(c) = LdCache::parse(data) {
        for (name, path) in c.entries() {
            assert!(!name.is_empty() && !path.is_empty());
            assert!(c.lookup(name).is_some());
        }
        let _ = c.lookup("libnccl.so.2");
    }
}

/// An ELF object's dynamic-loading facts (read from memory, as through
/// the file cache), its search lists expanded, and the same bytes as an
/// environment's `LD_LIBRARY_PATH`.
pub fn elf_dynamic(data: &[u8]) {
    if let Ok(info) = DynamicInfo::parse(data) {
        assert!(info.needed.len() <= 256);
        for list in [&info.rpath, &info.runpath].into_iter().flatten() {
            for dir in loader::split_list(list, "/origin") {
                assert!(dir.starts_with('/') && !dir.contains('$'), "{dir:?}");
            }
        }
    }
    if let Some(v) = loader::ld_library_path(data) {
        let _ = loader::split_list(&v, "/origin");
    }
}
