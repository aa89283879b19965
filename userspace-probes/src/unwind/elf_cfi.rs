//! What one ELF file contributes to unwinding: its CFI sections
//! (`.eh_frame_hdr`, `.eh_frame`, `.debug_frame`), the `.text` bytes that
//! framehop reads to recognise prologues and epilogues at the first frame,
//! and the load segments that turn a mapping into the file's load bias.
//!
//! Read once per file and shared (`Arc`) by every process that maps it. The
//! file's headers are read through [`ReadCache`], a limited number of bytes
//! (`read_budget`), and only the sections named here are read: a 200 MB
//! libnccl costs its CFI and `.text`, not its device code; a `.text` over
//! [`MAX_TEXT_BYTES`] is not read.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object::read::ReadCache;
use object::{Object, ObjectSection, ObjectSegment};

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
}

/// The largest `.text` read (see [`FileCfi::read`]).
pub const MAX_TEXT_BYTES: u64 = 32 << 20;

/// The most read through the cache: the file's headers, section headers
/// and section names (at most 65,535 headers of 64 bytes).
const MAX_HEADER_READ: u64 = 16 << 20;

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
}

#[derive(Clone, Copy, Debug)]
struct LoadSegment {
    offset: u64,
    vaddr: u64,
    executable: bool,
}

/// Where a section says it lives; `None` for a range past the end of the
/// address space (a corrupt header).
fn svma<'d>(s: &impl ObjectSection<'d>) -> Option<Range<u64>> {
    Some(s.address()..s.address().checked_add(s.size())?)
}

impl FileCfi {
    /// Reads the sections of `path` (as seen by the agent: for another
    /// mount namespace, `/proc/PID/root/<path>`).
    pub fn read(path: &Path) -> Result<Self, CfiError> {
        Self::read_with_text_limit(path, MAX_TEXT_BYTES)
    }

    /// [`Self::read`], reading `.text` only up to `max_text` bytes.
    pub(crate) fn read_with_text_limit(path: &Path, max_text: u64) -> Result<Self, CfiError> {
        let file = crate::regular_file::open(path).map_err(|source| CfiError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let cache = ReadCache::new(ReadBudget::new(&file, limit_for(file_len, MAX_HEADER_READ)));
        let elf = object::File::parse(&cache).map_err(|source| CfiError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        // A section the file claims but cannot deliver (truncated file,
        // compressed .debug_frame) is treated as absent: the unwinder then
        // falls back to frame pointers for that code, it does not fail the
        // whole process.
        let bytes = |s: &object::Section<'_, '_, &ReadCache<ReadBudget<&File>>>| -> Option<Bytes> {
            // Uncompressed (every CFI and code section in practice): read
            // straight into the shared buffer, not through the cache (which
            // would hold a second copy until this returns).
            let range = s.compressed_file_range().ok()?;
            if range.format == object::CompressionFormat::None {
                let end = range.offset.checked_add(range.uncompressed_size)?;
                if end > file_len {
                    return None;
                }
                let mut data = vec![0u8; usize::try_from(range.uncompressed_size).ok()?];
                file.read_exact_at(&mut data, range.offset).ok()?;
                return Some(Arc::from(data));
            }
            let data = s.uncompressed_data().ok()?;
            Some(Arc::from(&*data))
        };
        // An empty section is no section: framehop takes an empty
        // `.eh_frame` over a `.debug_frame` that has the entries (code
        // built with `-fno-asynchronous-unwind-tables -g` has both).
        let section = |name: &str| -> Option<Section> {
            let s = elf.section_by_name(name)?;
            Some(Section {
                svma: svma(&s)?,
                data: bytes(&s).filter(|d| !d.is_empty())?,
            })
        };
        // Code is read for the unwinder's look at the first frame's
        // instructions (a prologue or epilogue where CFI is missing), and
        // only up to MAX_TEXT_BYTES: PyTorch's libtorch_cuda and
        // libtorch_cpu hold hundreds of MB of it, which read whole took
        // 0.87 GB of the agent's heap on a GPU node (commit 8b803c1). Bigger
        // code unwinds by its CFI alone.
        let text = elf.section_by_name(".text");
        let text_svma = text.as_ref().and_then(svma);
        let text = text
            .filter(|s| s.size() <= max_text)
            .and_then(|s| bytes(&s));
        let load_segments = elf
            .segments()
            .map(|seg| LoadSegment {
                offset: seg.file_range().0,
                vaddr: seg.address(),
                executable: matches!(
                    seg.flags(),
                    object::SegmentFlags::Elf { p_flags } if p_flags & object::elf::PF_X != 0
                ),
            })
            .collect();
        Ok(Self {
            eh_frame_hdr: section(".eh_frame_hdr"),
            eh_frame: section(".eh_frame"),
            debug_frame: section(".debug_frame").map(|s| s.data),
            text_svma,
            text,
            got: elf.section_by_name(".got").as_ref().and_then(svma),
            load_segments,
        })
    }

    /// Bytes of the file's sections held: what keeping this file costs.
    pub fn held_bytes(&self) -> u64 {
        let len = |b: Option<&Bytes>| b.map_or(0, |b| b.len() as u64);
        len(self.eh_frame_hdr.as_ref().map(|s| &s.data))
            + len(self.eh_frame.as_ref().map(|s| &s.data))
            + len(self.debug_frame.as_ref())
            + len(self.text.as_ref())
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
