//! What the loader reads of an ELF object before mapping its dependencies:
//! `PT_INTERP`, and from `PT_DYNAMIC` the `DT_NEEDED` names, `DT_RPATH`,
//! `DT_RUNPATH` and `DF_1_NODEFLIB`. Read as the loader does, through the
//! program headers (section headers may be stripped), and through a
//! [`ReadRef`] so that only the headers, the dynamic segment and the
//! strings are read of a 200 MB library.

use object::elf::{
    DF_1_NODEFLIB, DT_FLAGS_1, DT_NEEDED, DT_NULL, DT_RPATH, DT_RUNPATH, DT_STRSZ, DT_STRTAB,
    PT_LOAD,
};
use object::read::elf::{Dyn, ElfFile64, ProgramHeader};
use object::{Architecture, Endianness, Object, ReadRef};

/// Most `DT_NEEDED` entries kept per object (real ones have tens).
const MAX_NEEDED: usize = 256;
/// Longest string read from the dynamic string table.
const MAX_STRING: u64 = 4096;
/// Most dynamic entries looked at.
const MAX_DYNAMIC: usize = 4096;

/// Why an object's dependencies could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DynamicError {
    #[error("not a 64-bit ELF file: {0}")]
    Parse(#[from] object::Error),
    #[error("a {0:?} ELF file; only x86-64 is followed")]
    Architecture(Architecture),
    #[error("its dynamic string table is not inside a loaded segment")]
    Strings,
}

/// The dynamic-loading facts of one ELF object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DynamicInfo {
    /// `PT_INTERP`: the program interpreter (executables only).
    pub interpreter: Option<String>,
    /// `DT_NEEDED`, in order.
    pub needed: Vec<String>,
    /// `DT_RPATH` (used only when the object has no `DT_RUNPATH`).
    pub rpath: Option<String>,
    /// `DT_RUNPATH`.
    pub runpath: Option<String>,
    /// `DF_1_NODEFLIB`: the loader cache and default directories are not
    /// searched for this object's dependencies.
    pub nodeflib: bool,
}

impl DynamicInfo {
    /// Reads an ELF object's dynamic-loading facts. A statically linked
    /// program (no `PT_DYNAMIC`) has none.
    pub fn parse<'data, R: ReadRef<'data>>(data: R) -> Result<Self, DynamicError> {
        let elf = ElfFile64::<Endianness, R>::parse(data)?;
        if elf.architecture() != Architecture::X86_64 {
            return Err(DynamicError::Architecture(elf.architecture()));
        }
        let endian = elf.endian();
        let mut info = DynamicInfo::default();
        let mut dynamic = None;
        let mut loads = Vec::new();
        for ph in elf.elf_program_headers() {
            if let Some(interp) = ph.interpreter(endian, data)? {
                info.interpreter = Some(String::from_utf8_lossy(interp).into_owned());
            }
            if let Some(d) = ph.dynamic(endian, data)? {
                dynamic = Some(d);
            }
            if ph.p_type(endian) == PT_LOAD {
                loads.push((ph.p_vaddr(endian), ph.p_offset(endian), ph.p_filesz(endian)));
            }
        }
        let Some(dynamic) = dynamic else {
            return Ok(info);
        };
        let (mut strtab, mut strsz) = (None, 0u64);
        let (mut needed, mut rpath, mut runpath) = (Vec::new(), None, None);
        for d in dynamic.iter().take(MAX_DYNAMIC) {
            let (tag, val) = (d.tag32(endian), d.d_val(endian));
            match tag {
                Some(DT_NULL) => break,
                Some(DT_STRTAB) => strtab = Some(val),
                Some(DT_STRSZ) => strsz = val,
                Some(DT_NEEDED) if needed.len() < MAX_NEEDED => needed.push(val),
                Some(DT_RPATH) => rpath = Some(val),
                Some(DT_RUNPATH) => runpath = Some(val),
                Some(DT_FLAGS_1) => info.nodeflib = val & u64::from(DF_1_NODEFLIB) != 0,
                _ => {}
            }
        }
        if needed.is_empty() && rpath.is_none() && runpath.is_none() {
            return Ok(info);
        }
        // DT_STRTAB is an address: find the file bytes of the segment
        // holding it, and read no further than that segment and DT_STRSZ.
        let addr = strtab.ok_or(DynamicError::Strings)?;
        // Checked: a hostile file's offsets and sizes may overflow.
        let (start, avail) = loads
            .iter()
            .find(|(vaddr, _, filesz)| addr >= *vaddr && addr - vaddr < *filesz)
            .and_then(|(vaddr, offset, filesz)| {
                Some((offset.checked_add(addr - vaddr)?, filesz - (addr - vaddr)))
            })
            .ok_or(DynamicError::Strings)?;
        let size = if strsz == 0 { avail } else { strsz.min(avail) };
        let string = |off: u64| -> Option<String> {
            if off >= size {
                return None;
            }
            let from = start.checked_add(off)?;
            let to = from.checked_add((size - off).min(MAX_STRING))?;
            let bytes = data.read_bytes_at_until(from..to, 0).ok()?;
            (!bytes.is_empty()).then(|| String::from_utf8_lossy(bytes).into_owned())
        };
        info.needed = needed.into_iter().filter_map(string).collect();
        info.rpath = rpath.and_then(string);
        info.runpath = runpath.and_then(string);
        Ok(info)
    }

    /// Reads the ELF file at `path` (only the parts needed).
    pub fn read(path: &std::path::Path) -> Result<Self, ReadError> {
        let file = crate::regular_file::open(path).map_err(|source| ReadError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        // Bounded: any file a traced process's search path names is read.
        let cache = object::read::ReadCache::new(crate::read_budget::ReadBudget::new(
            file,
            crate::read_budget::limit_for(len, 64 << 20),
        ));
        Self::parse(&cache).map_err(|source| ReadError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// [`DynamicInfo::read`]'s errors, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("opening {path}: {source}")]
    Open {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: std::path::PathBuf,
        #[source]
        source: DynamicError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test binary itself: a dynamically linked x86-64 program.
    #[test]
    fn reads_a_real_program() {
        let exe = std::env::current_exe().unwrap();
        let info = DynamicInfo::read(&exe).unwrap();
        assert!(
            info.interpreter
                .as_deref()
                .is_some_and(|i| i.contains("ld-linux-x86-64.so.2")),
            "{info:?}"
        );
        assert!(info.needed.iter().any(|n| n == "libc.so.6"), "{info:?}");
    }

    /// Found by `cargo xtask fuzz elf_dynamic`: a string table in a
    /// segment whose file offset plus the table's distance overflows.
    #[test]
    fn a_string_table_past_the_end_of_the_address_space_is_an_error() {
        let crash =
            include_bytes!("../../../tests/fuzz/corpus/elf_dynamic/crash-strtab-offset-overflow");
        assert!(matches!(
            DynamicInfo::parse(&crash[..]),
            Err(DynamicError::Strings | DynamicError::Parse(_))
        ));
    }

    #[test]
    fn reads_a_real_library_and_refuses_non_elf() {
        let info = DynamicInfo::read("/lib/x86_64-linux-gnu/libm.so.6".as_ref()).unwrap();
        assert_eq!(info.interpreter, None);
        assert!(info.needed.iter().any(|n| n == "libc.so.6"), "{info:?}");
        assert!(matches!(
            DynamicInfo::parse(&b"#!/bin/sh\n"[..]),
            Err(DynamicError::Parse(_))
        ));
        let err = DynamicInfo::read("/nonexistent/libx.so".as_ref()).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/libx.so"), "{err}");
    }
}
