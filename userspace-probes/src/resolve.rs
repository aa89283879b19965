//! ELF resolution: a library's exported functions from `.dynsym`, their file
//! offsets, aliases deduplicated by address, and probe placement.
//!
//! Only `.dynsym` is read, never DWARF or `.symtab`: NCCL carries debug info
//! in which internal C++ functions (`ncclGroupEndInternal`, `.cold` parts)
//! match public names. The file is read through [`object::read::ReadCache`],
//! so only headers, the dynamic symbol table and the first bytes of each
//! probed function are read (libnccl is 200+ MB).
//!
//! ```no_run
//! use xpuscope_probes::{catalog::Library, resolve::resolve};
//! let lib = resolve("/usr/lib/libnccl.so.2".as_ref(), Library::Nccl).unwrap();
//! for p in &lib.probes {
//!     println!("{} at file offset {:#x}", p.function.name, p.probe_file_offset());
//! }
//! print!("{lib}"); // the placement table
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use object::elf::{PF_X, PT_LOAD, SHN_UNDEF, STB_GLOBAL, STB_WEAK, STT_FUNC};
use object::read::ReadCache;
use object::read::elf::{ElfFile64, ProgramHeader, Sym};
use object::{Architecture, Endianness, Object, ObjectSymbol, ReadRef};

use crate::catalog::{FunctionSpec, Library};
use crate::placement::{CODE_BYTES, Placement, place, tail_call_target};
use crate::read_budget::{ReadBudget, limit_for};

/// Errors resolving a library; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("opening {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path} as a 64-bit ELF: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: object::Error,
    },
    #[error("{path} is a {arch:?} ELF; probe placement supports x86-64 only")]
    Architecture { path: PathBuf, arch: Architecture },
}

/// An exported function of `.dynsym`: defined, global or weak, `STT_FUNC`
/// (GNU ifuncs are left out: their address is the resolver's), inside an
/// executable `PT_LOAD` segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedFunction {
    /// The name without its version (`cudaLaunchKernel`, not
    /// `cudaLaunchKernel@@libcudart.so.12`).
    pub name: String,
    pub vaddr: u64,
    pub size: u64,
    /// Where `vaddr` is in the file (what a uprobe is attached by).
    pub file_offset: u64,
}

/// The exported functions of the ELF file at `path`, sorted by address
/// then name.
pub fn exported_functions(path: &Path) -> Result<Vec<ExportedFunction>, ResolveError> {
    let file = crate::regular_file::open(path).map_err(|source| ResolveError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let cache = ReadCache::new(ReadBudget::new(file, limit_for(len, MAX_RESOLVE_READ)));
    let elf = parse(path, &cache)?;
    Ok(Image::new(&elf).exports)
}

/// One function to probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedProbe {
    pub function: &'static FunctionSpec,
    /// The exported name found (the public one, or an alias if only that
    /// is exported).
    pub symbol: String,
    /// Every other exported name at the same address (e.g. `pncclAllReduce`).
    pub other_names: Vec<String>,
    pub vaddr: u64,
    /// File offset of the function's start.
    pub file_offset: u64,
    pub placement: Placement,
}

impl ResolvedProbe {
    /// File offset to attach the uprobe (and uretprobe) at.
    pub fn probe_file_offset(&self) -> u64 {
        self.file_offset + self.placement.offset
    }

    /// Virtual address of the probe in the ELF's address space.
    pub fn probe_vaddr(&self) -> u64 {
        self.vaddr + self.placement.offset
    }
}

/// Why a catalog function that resolved gets no probe of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Same address as an earlier catalog function (probed once).
    SameAddressAs(&'static str),
    /// A pure tail-call thunk into another probed function, whose probe
    /// sees the same call (CUDA 12.9 `__cudaLaunchKernel`).
    TailCallTo(&'static str),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedFunction {
    pub function: &'static FunctionSpec,
    pub symbol: String,
    pub vaddr: u64,
    pub reason: SkipReason,
}

/// The catalog of one library resolved against one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedLibrary {
    pub library: Library,
    pub path: PathBuf,
    /// One per probed address, in catalog order.
    pub probes: Vec<ResolvedProbe>,
    pub skipped: Vec<SkippedFunction>,
    /// Catalog functions the file does not export.
    pub missing: Vec<&'static FunctionSpec>,
}

/// One row of the placement report: where a function's probe goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeReport {
    pub library: Library,
    pub function: &'static str,
    /// The exported name resolved.
    pub symbol: String,
    pub vaddr: u64,
    pub file_offset: u64,
    pub placement: Placement,
}

impl ResolvedLibrary {
    /// The placement report, one row per probe (also printed by `Display`).
    pub fn report(&self) -> Vec<ProbeReport> {
        self.probes
            .iter()
            .map(|p| ProbeReport {
                library: self.library,
                function: p.function.name,
                symbol: p.symbol.clone(),
                vaddr: p.vaddr,
                file_offset: p.file_offset,
                placement: p.placement.clone(),
            })
            .collect()
    }

    /// Missing functions the catalog does not mark optional (a version this
    /// catalog does not know, or a wrong file).
    pub fn missing_required(&self) -> impl Iterator<Item = &'static FunctionSpec> + '_ {
        self.missing.iter().copied().filter(|f| !f.optional)
    }

    /// The probe of catalog function `name` (also when it was skipped as an
    /// alias or thunk of the probe).
    pub fn probe(&self, name: &str) -> Option<&ResolvedProbe> {
        let target = match self.skipped.iter().find(|s| s.function.name == name) {
            Some(s) => match s.reason {
                SkipReason::SameAddressAs(t) | SkipReason::TailCallTo(t) => t,
            },
            None => name,
        };
        self.probes.iter().find(|p| p.function.name == target)
    }
}

impl fmt::Display for ResolvedLibrary {
    /// The placement table: one row per probe, then skipped and missing.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} ({}):", self.path.display(), self.library.name())?;
        writeln!(
            f,
            "  {:<34} {:>10} {:>10}  {:<24} probe",
            "function", "vaddr", "file off", "first insn"
        )?;
        for p in &self.probes {
            writeln!(
                f,
                "  {:<34} {:>#10x} {:>#10x}  {:<24} {}",
                p.function.name, p.vaddr, p.file_offset, p.placement.first_insn, p.placement
            )?;
        }
        for s in &self.skipped {
            let why = match s.reason {
                SkipReason::SameAddressAs(t) => format!("same address as {t}"),
                SkipReason::TailCallTo(t) => format!("tail-call thunk to {t}"),
            };
            writeln!(
                f,
                "  {:<34} {:>#10x}  not probed: {why}",
                s.function.name, s.vaddr
            )?;
        }
        for m in &self.missing {
            let opt = if m.optional { "optional" } else { "REQUIRED" };
            writeln!(f, "  {:<34} missing ({opt})", m.name)?;
        }
        Ok(())
    }
}

/// Resolves `library`'s catalog against the file at `path` and places
/// each probe.
pub fn resolve(path: &Path, library: Library) -> Result<ResolvedLibrary, ResolveError> {
    let file = crate::regular_file::open(path).map_err(|source| ResolveError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let cache = ReadCache::new(ReadBudget::new(file, limit_for(len, MAX_RESOLVE_READ)));
    let elf = parse(path, &cache)?;
    if elf.architecture() != Architecture::X86_64 {
        return Err(ResolveError::Architecture {
            path: path.to_path_buf(),
            arch: elf.architecture(),
        });
    }
    let image = Image::new(&elf);

    // Catalog function -> export, first catalog entry per address wins.
    let mut probes: Vec<(&'static FunctionSpec, &ExportedFunction)> = Vec::new();
    let mut skipped = Vec::new();
    let mut missing = Vec::new();
    let mut by_vaddr: HashMap<u64, &'static str> = HashMap::new();
    for spec in library.functions() {
        let found = std::iter::once(spec.name)
            .chain(spec.aliases.iter().copied())
            .find_map(|n| image.by_name.get(n).map(|&i| &image.exports[i]));
        let Some(export) = found else {
            missing.push(spec);
            continue;
        };
        if let Some(&first) = by_vaddr.get(&export.vaddr) {
            skipped.push(SkippedFunction {
                function: spec,
                symbol: export.name.clone(),
                vaddr: export.vaddr,
                reason: SkipReason::SameAddressAs(first),
            });
            continue;
        }
        by_vaddr.insert(export.vaddr, spec.name);
        probes.push((spec, export));
    }

    let mut resolved = Vec::with_capacity(probes.len());
    for (spec, export) in probes {
        let code = image.code(&elf, export);
        if let Some(target) = tail_call_target(code, export.vaddr)
            && let Some(&to) = by_vaddr.get(&target)
            && to != spec.name
        {
            skipped.push(SkippedFunction {
                function: spec,
                symbol: export.name.clone(),
                vaddr: export.vaddr,
                reason: SkipReason::TailCallTo(to),
            });
            continue;
        }
        let other_names = image.names_at[&export.vaddr]
            .iter()
            .filter(|&&i| image.exports[i].name != export.name)
            .map(|&i| image.exports[i].name.clone())
            .collect();
        resolved.push(ResolvedProbe {
            function: spec,
            symbol: export.name.clone(),
            other_names,
            vaddr: export.vaddr,
            file_offset: export.file_offset,
            placement: place(code, export.vaddr, spec.reads()),
        });
    }
    Ok(ResolvedLibrary {
        library,
        path: path.to_path_buf(),
        probes: resolved,
        skipped,
        missing,
    })
}

/// The most read of a library's headers and dynamic symbols (a device
/// library's are a few MB; the budget keeps a crafted file from making the
/// cache hold many times its size).
const MAX_RESOLVE_READ: u64 = 256 << 20;

type Elf<'a> = ElfFile64<'a, Endianness, &'a ReadCache<ReadBudget<File>>>;

fn parse<'a>(path: &Path, cache: &'a ReadCache<ReadBudget<File>>) -> Result<Elf<'a>, ResolveError> {
    ElfFile64::parse(cache).map_err(|source| ResolveError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// An executable `PT_LOAD` segment: `[vaddr, vaddr + filesz)` at `offset`.
#[derive(Clone, Copy)]
struct TextSegment {
    vaddr: u64,
    offset: u64,
    filesz: u64,
}

struct Image {
    exports: Vec<ExportedFunction>,
    by_name: HashMap<String, usize>,
    names_at: BTreeMap<u64, Vec<usize>>,
    segments: Vec<TextSegment>,
}

impl Image {
    fn new(elf: &Elf<'_>) -> Image {
        let endian = elf.endian();
        let segments: Vec<TextSegment> = elf
            .elf_program_headers()
            .iter()
            .filter(|ph| ph.p_type(endian) == PT_LOAD && ph.p_flags(endian) & PF_X != 0)
            .map(|ph| TextSegment {
                vaddr: ph.p_vaddr(endian),
                offset: ph.p_offset(endian),
                filesz: ph.p_filesz(endian),
            })
            .collect();
        // Symbol versions: a hidden (non-default) version such as
        // `memcpy@GLIBC_2.2.5` is not what a plain name binds to.
        let versions = elf
            .elf_section_table()
            .versions(endian, elf.data())
            .ok()
            .flatten();
        let mut exports = Vec::new();
        for sym in elf.dynamic_symbols() {
            let raw = sym.elf_symbol();
            if raw.st_type() != STT_FUNC
                || !matches!(raw.st_bind(), STB_GLOBAL | STB_WEAK)
                || raw.st_shndx(endian) == SHN_UNDEF
                || versions
                    .as_ref()
                    .is_some_and(|v| v.version_index(endian, sym.index()).is_hidden())
            {
                continue;
            }
            let Ok(name) = sym.name() else { continue };
            let vaddr = sym.address();
            let Some(seg) = segments
                .iter()
                .find(|s| vaddr >= s.vaddr && vaddr - s.vaddr < s.filesz)
            else {
                continue;
            };
            exports.push(ExportedFunction {
                name: name.to_string(),
                vaddr,
                size: sym.size(),
                file_offset: seg.offset + (vaddr - seg.vaddr),
            });
        }
        exports.sort_by(|a, b| (a.vaddr, &a.name).cmp(&(b.vaddr, &b.name)));
        exports.dedup();
        let mut by_name = HashMap::new();
        let mut names_at: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (i, e) in exports.iter().enumerate() {
            by_name.entry(e.name.clone()).or_insert(i);
            names_at.entry(e.vaddr).or_default().push(i);
        }
        Image {
            exports,
            by_name,
            names_at,
            segments,
        }
    }

    /// The first bytes of `f`: at most [`CODE_BYTES`], the symbol's size
    /// when known, and never past its segment's file bytes. Empty when the
    /// file cannot be read there.
    fn code<'a>(&self, elf: &Elf<'a>, f: &ExportedFunction) -> &'a [u8] {
        let Some(seg) = self
            .segments
            .iter()
            .find(|s| f.vaddr >= s.vaddr && f.vaddr - s.vaddr < s.filesz)
        else {
            return &[];
        };
        let mut len = (CODE_BYTES as u64).min(seg.filesz - (f.vaddr - seg.vaddr));
        if f.size > 0 {
            len = len.min(f.size);
        }
        elf.data().read_bytes_at(f.file_offset, len).unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";

    #[test]
    fn reads_libc_exports_with_aliases() {
        let path = Path::new(LIBC);
        if !path.exists() {
            eprintln!("skipping: no {LIBC}");
            return;
        }
        let exports = exported_functions(path).unwrap();
        let find = |n: &str| exports.iter().find(|e| e.name == n);
        let malloc = find("malloc").expect("libc exports malloc");
        assert!(malloc.size > 0 && malloc.file_offset > 0);
        // glibc exports several names at one address (e.g. __libc_malloc? not
        // always); some alias pair always exists.
        let mut seen = HashMap::new();
        let shared = exports
            .iter()
            .any(|e| seen.insert(e.vaddr, &e.name).is_some());
        assert!(shared, "libc has aliases at one address");
        // Versions are not part of the names.
        assert!(exports.iter().all(|e| !e.name.contains('@')));
    }

    #[test]
    fn errors_name_the_path() {
        let err = resolve(Path::new("/nonexistent/libcudart.so.12"), Library::Cudart).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/libcudart.so.12"),
            "{err}"
        );
        // Not an ELF.
        let text = std::env::temp_dir().join(format!(
            "xpuscope-probes-not-an-elf-{}.txt",
            std::process::id()
        ));
        std::fs::write(&text, b"hello, not an ELF").unwrap();
        let err = resolve(&text, Library::Cudart).unwrap_err();
        assert!(matches!(err, ResolveError::Parse { .. }), "{err}");
        assert!(err.to_string().contains("not-an-elf"), "{err}");
        let _ = std::fs::remove_file(&text);
    }

    #[test]
    fn a_library_without_the_catalog_reports_everything_missing() {
        let path = Path::new(LIBC);
        if !path.exists() {
            return;
        }
        let lib = resolve(path, Library::Nccl).unwrap();
        assert!(lib.probes.is_empty());
        assert_eq!(lib.missing.len(), Library::Nccl.functions().len());
        assert!(lib.missing_required().count() > 0);
        assert!(lib.to_string().contains("missing (REQUIRED)"));
        assert!(lib.report().is_empty());
    }
}
