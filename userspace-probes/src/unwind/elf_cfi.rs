//! What one ELF file contributes to unwinding: its CFI sections
//! (`.eh_frame_hdr`, `.eh_frame`, `.debug_frame`), the `.text` bytes that
//! framehop reads to recognise prologues and epilogues at the first frame,
//! and the load segments that turn a mapping into the file's load bias.
//!
//! Read once per file and shared (`Arc`) by every process that maps it. The
//! file's headers are read through [`ReadCache`], a limited number of bytes
//! (`read_budget`), and only the sections named here are read: a 200 MB
//! libnccl costs its CFI and `.text`, not its device code; a `.text` over
//! [`MAX_TEXT_BYTES`] is not read, a CFI section over [`MAX_SECTION_BYTES`]
//! is refused, and a file whose CFI exceeds the room its cache leaves
//! ([`CfiLimits::room`]) is not read at all.

use std::cell::Cell;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object::elf::{FileHeader64, PF_X, PT_LOAD, SHF_COMPRESSED, SHT_NOBITS};
use object::read::ReadCache;
use object::read::elf::{FileHeader, ProgramHeader, SectionHeader};
use object::{Endianness, elf};

use crate::bounds::CappedRead;
use crate::read_budget::{ReadBudget, limit_for};

/// Errors reading a file's unwind tables.
#[derive(Debug, thiserror::Error)]
pub enum CfiError {
    #[error("opening {path} for its unwind tables: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not an ELF file the unwinder can read: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: object::read::Error,
    },
    #[error(
        "{path}: its unwind tables take {bytes} bytes, more than the {room} the CFI cache has room for: not read"
    )]
    TooLarge {
        path: PathBuf,
        bytes: u64,
        room: u64,
    },
    #[error("{path}: a header table over {max} bytes: not read")]
    HeadersTooLarge { path: PathBuf, max: u64 },
}

/// The largest `.text` read (see [`FileCfi::read`]).
pub const MAX_TEXT_BYTES: u64 = 32 << 20;
/// The largest CFI section read. The biggest real ones are tens of MB
/// (libtorch_cuda's `.eh_frame`); a larger one is refused unread and the
/// file's code unwinds by frame pointer, as for a file without CFI.
pub const MAX_SECTION_BYTES: u64 = 256 << 20;
/// The largest header table (section or program headers) read: 65,535
/// section headers take 4 MiB.
const MAX_HEADER_BYTES: u64 = 16 << 20;
/// The most read through the cache in all: the file's headers, section
/// headers and section names (at most 65,535 headers of 64 bytes).
const MAX_HEADER_READ: u64 = 16 << 20;

/// How much of a file [`FileCfi::read_limited`] may read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CfiLimits {
    /// The largest CFI section; a larger one is refused (counted in
    /// [`FileCfi::refused`]).
    pub section: u64,
    /// The largest `.text`; a larger one is left out (framehop then reads
    /// no instructions there: not counted, PyTorch's code is that big).
    pub text: u64,
    /// The most bytes the file may take in all: a file whose CFI is larger
    /// is [`CfiError::TooLarge`]; `.text` is left out first.
    pub room: u64,
}

impl Default for CfiLimits {
    fn default() -> Self {
        Self {
            section: MAX_SECTION_BYTES,
            text: MAX_TEXT_BYTES,
            room: u64::MAX,
        }
    }
}

/// Section bytes shared between every module built from one file.
pub(crate) type Bytes = Arc<[u8]>;

/// One section: where the file says it lives, and its bytes.
#[derive(Clone, Debug)]
pub(crate) struct Section {
    pub svma: Range<u64>,
    pub data: Bytes,
}

/// The unwind-relevant content of one ELF file.
#[derive(Debug)]
pub struct FileCfi {
    pub(crate) eh_frame_hdr: Option<Section>,
    pub(crate) eh_frame: Option<Section>,
    pub(crate) debug_frame: Option<Bytes>,
    /// Where `.text` is, and its bytes (up to [`MAX_TEXT_BYTES`]).
    pub(crate) text_svma: Option<Range<u64>>,
    pub(crate) text: Option<Bytes>,
    pub(crate) got: Option<Range<u64>>,
    /// Each load segment, to find the load bias of a mapping from its
    /// file offset.
    load_segments: Vec<LoadSegment>,
    /// CFI sections left unread for being over their cap.
    refused: u64,
}

#[derive(Clone, Copy, Debug)]
struct LoadSegment {
    offset: u64,
    vaddr: u64,
    executable: bool,
}

type Shdr = elf::SectionHeader64<Endianness>;

/// A section as its header describes it, before any of it is read.
struct Planned<'a> {
    header: &'a Shdr,
    /// Its bytes' place in the file; `None` when there is nothing to read
    /// (no bytes in the file, compressed, past the file's end).
    range: Option<(u64, u64)>,
}

impl Planned<'_> {
    fn len(&self) -> u64 {
        self.range.map_or(0, |(_, len)| len)
    }
}

impl FileCfi {
    /// Reads the sections of `path` (as seen by the agent: for another
    /// mount namespace, `/proc/PID/root/<path>`).
    pub fn read(path: &Path) -> Result<Self, CfiError> {
        Self::read_limited(path, &CfiLimits::default())
    }

    /// [`Self::read`] within `limits`. Every size comes from the file's
    /// headers, so each is checked against the file's length and its cap
    /// before a byte of it is read.
    pub fn read_limited(path: &Path, limits: &CfiLimits) -> Result<Self, CfiError> {
        let over = Cell::new(false);
        let parse = |source| match over.get() {
            true => CfiError::HeadersTooLarge {
                path: path.to_path_buf(),
                max: MAX_HEADER_BYTES,
            },
            false => CfiError::Parse {
                path: path.to_path_buf(),
                source,
            },
        };
        let file = crate::regular_file::open(path).map_err(|source| CfiError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
        // Only the headers go through the cache, each read capped, and all
        // of them together (the cache keeps every range and string it
        // reads): the sections are read below, straight into their shared
        // buffers. No symbol table is read (`object::File::parse` reads
        // them whole).
        let cache = ReadCache::new(ReadBudget::new(&file, limit_for(file_len, MAX_HEADER_READ)));
        let data = CappedRead::new(&cache, MAX_HEADER_BYTES, &over);
        let header = FileHeader64::<Endianness>::parse(data).map_err(parse)?;
        let endian = header.endian().map_err(parse)?;
        let sections = header.sections(endian, data).map_err(parse)?;
        let load_segments = header
            .program_headers(endian, data)
            .map_err(parse)?
            .iter()
            .filter(|ph| ph.p_type(endian) == PT_LOAD)
            .map(|ph| LoadSegment {
                offset: ph.p_offset(endian),
                vaddr: ph.p_vaddr(endian),
                executable: ph.p_flags(endian) & PF_X != 0,
            })
            .collect();
        let find = |name: &str| -> Option<Planned<'_>> {
            let (_, header) = sections.section_by_name(endian, name.as_bytes())?;
            // A section the file claims but cannot deliver (truncated
            // file; compressed, which the unwinder has no decompressor
            // for) is treated as absent: the unwinder then falls back to
            // frame pointers for that code, it does not fail the process.
            let compressed = header.sh_flags(endian) & u64::from(SHF_COMPRESSED) != 0;
            let (offset, len) = (header.sh_offset(endian), header.sh_size(endian));
            let in_file = header.sh_type(endian) != SHT_NOBITS
                && !compressed
                && offset.checked_add(len).is_some_and(|end| end <= file_len);
            Some(Planned {
                header,
                range: in_file.then_some((offset, len)),
            })
        };
        // Where a section says it lives; `None` for a range past the end
        // of the address space (a corrupt header): the section is absent.
        let svma = |p: &Planned<'_>| {
            let start = p.header.sh_addr(endian);
            Some(start..start.checked_add(p.header.sh_size(endian))?)
        };
        let mut refused = 0;
        // An empty section is no section: framehop takes an empty
        // `.eh_frame` over a `.debug_frame` that has the entries (code
        // built with `-fno-asynchronous-unwind-tables -g` has both).
        let mut cfi = |name: &str| -> Option<Planned<'_>> {
            let p = find(name).filter(|p| svma(p).is_some())?;
            if p.len() > limits.section {
                refused += 1;
                return None;
            }
            (p.len() > 0).then_some(p)
        };
        let eh_frame_hdr = cfi(".eh_frame_hdr");
        let eh_frame = cfi(".eh_frame");
        let debug_frame = cfi(".debug_frame");
        let needed: u64 = [&eh_frame_hdr, &eh_frame, &debug_frame]
            .iter()
            .map(|p| p.as_ref().map_or(0, Planned::len))
            .sum();
        if needed > limits.room {
            return Err(CfiError::TooLarge {
                path: path.to_path_buf(),
                bytes: needed,
                room: limits.room,
            });
        }
        // Code is read for the unwinder's look at the first frame's
        // instructions (a prologue or epilogue where CFI is missing), and
        // only up to MAX_TEXT_BYTES: PyTorch's libtorch_cuda and
        // libtorch_cpu hold hundreds of MB of it, which read whole took
        // 0.87 GB of the agent's heap on a GPU node (commit 8b803c1). Bigger
        // code unwinds by its CFI alone.
        let text = find(".text");
        let text_svma = text.as_ref().and_then(svma);
        let text = text.filter(|t| t.len() <= limits.text && needed + t.len() <= limits.room);
        let read = |p: &Planned<'_>| -> Option<Bytes> {
            let (offset, len) = p.range?;
            let mut data = vec![0u8; usize::try_from(len).ok()?];
            file.read_exact_at(&mut data, offset).ok()?;
            Some(Arc::from(data))
        };
        let section = |p: Option<Planned<'_>>| -> Option<Section> {
            let p = p?;
            Some(Section {
                svma: svma(&p)?,
                data: read(&p)?,
            })
        };
        Ok(Self {
            eh_frame_hdr: section(eh_frame_hdr),
            eh_frame: section(eh_frame),
            debug_frame: debug_frame.as_ref().and_then(read),
            text_svma,
            text: text.as_ref().and_then(read),
            got: find(".got").as_ref().and_then(svma),
            load_segments,
            refused,
        })
    }

    /// Bytes of the file's sections held: what keeping this file costs.
    pub fn bytes(&self) -> u64 {
        let len = |d: Option<&Bytes>| d.map_or(0, |d| d.len() as u64);
        len(self.eh_frame_hdr.as_ref().map(|s| &s.data))
            + len(self.eh_frame.as_ref().map(|s| &s.data))
            + len(self.debug_frame.as_ref())
            + len(self.text.as_ref())
    }

    /// CFI sections left unread for being over their cap: their code
    /// unwinds by frame pointer.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Whether the file carries any CFI at all (else every frame in it
    /// unwinds by frame pointer).
    pub fn has_cfi(&self) -> bool {
        self.eh_frame.is_some() || self.debug_frame.is_some()
    }

    /// The load bias (address of virtual address 0) of an executable
    /// mapping of this file that starts at `start` with file offset
    /// `offset`, from the load segment holding that offset. `None` when no
    /// segment holds it.
    pub fn load_bias(&self, start: u64, offset: u64) -> Option<u64> {
        // The segment with the greatest file offset not above `offset`: the
        // kernel maps a segment from its page-aligned file offset, so the
        // mapping's offset may sit up to a page below p_offset. Where
        // segments share a page (a small library linked without separate
        // code pages: its data segment starts in the code's last page), the
        // executable one is the mapping's.
        let page = 4096;
        let holds = |s: &&LoadSegment| s.offset & !(page - 1) <= offset;
        let seg = self
            .load_segments
            .iter()
            .filter(|s| s.executable)
            .filter(holds)
            .max_by_key(|s| s.offset)
            .or_else(|| {
                self.load_segments
                    .iter()
                    .filter(holds)
                    .max_by_key(|s| s.offset)
            })?;
        // avma = bias + svma, and file offset `offset` is at svma
        // seg.vaddr + (offset - seg.offset).
        Some(
            start
                .wrapping_sub(seg.vaddr)
                .wrapping_sub(offset)
                .wrapping_add(seg.offset),
        )
    }
}
