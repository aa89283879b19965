//! Python frames of a live CPython process, read from outside: no ptrace
//! stop, no `LD_PRELOAD`, no `sys.setprofile`, the way py-spy reads them.
//!
//! - [`PythonProcess::attach`] finds the interpreter in the process's
//!   mappings (the executable or a `libpython3.X.so` whose ELF symbols
//!   hold `_PyRuntime`), its version (`Py_Version`, 3.11+; the file name
//!   for 3.10) and the address range of `_PyEval_EvalFrameDefault`
//!   ([`Interpreter::find`]; fuzzed by `tests/fuzz`'s `python_interpreter`
//!   target: any process may map a file called `python3`).
//! - [`PythonProcess::frames`] maps a kernel tid to its thread state
//!   (interpreters -> thread list; `native_thread_id` on 3.11+, the tid in
//!   glibc's `struct pthread` on 3.10) and walks its frames (3.11+
//!   `_PyInterpreterFrame`s, 3.10 frame objects), giving each frame's
//!   function (`co_qualname`; 3.10 `co_name`), file and current line (from
//!   the frame's instruction pointer and the code's line table), and its
//!   step counter: the value of a local of [`STEP_LOCALS`] holding a
//!   non-negative `int` ([`step_of`]: the outermost frame's, the training
//!   loop's).
//! - [`interleave`] merges them into a native stack at the interpreter's
//!   evaluation frames ("mixed" stacks).
//!
//! Everything is read through `/proc/PID/mem` while the thread runs, so a
//! stack can be torn by a concurrent call or return (an error or a stale
//! frame, never a crash); every pointer is untrusted and every read
//! bounded ([`walk`]; fuzzed by `tests/fuzz`'s `python_frames` target).
//!
//! Supported: CPython 3.10 and later, x86-64, default (GIL) builds: 3.10-3.12
//! by the tables in [`layout`], 3.13 and later by the layout the
//! interpreter publishes ([`debug_offsets`]). Tested against 3.11 (Debian)
//! and 3.14 (Debian unstable, in a root of its own) in CI, and 3.10.13,
//! 3.11.7, 3.12.1 and 3.13.0 where pyenv has them
//! (`tests/tests/python_frames.rs`).
//!
//! Cost per stack in steady state (code objects cached): the thread state,
//! then the frames and code object headers, read by 4 KiB page during the
//! walk (a thread's frames sit together on its data stack): 6-7 reads
//! (syscalls) and 8-10 us for a 3-frame stack, 11-16 reads and 24-29 us for
//! 40 frames (release, 2-vCPU VM; docs/src/measurements/stacks.md, "Reading Python frames").

pub mod debug_offsets;
pub mod layout;
pub mod linetable;
pub mod memory;
pub mod split_parts;
pub mod walk;

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use object::Endianness;
use object::elf::{FileHeader64, PT_LOAD, SHT_DYNSYM, SHT_SYMTAB};
use object::read::elf::{FileHeader, ProgramHeader, SectionHeader, Sym};
use object::read::{ReadCache, ReadRef};

use crate::bounds::{CacheStats, CappedRead};
use crate::maps::{MappedFiles, ProcessMaps};
use crate::read_budget::{ReadBudget, limit_for};
use memory::{Memory, ProcMem, ReadError};
use walk::{CODE_CACHE_PROCESS_BYTES, FrameReader, KnownTypes};

/// One Python frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyFrame {
    /// `co_qualname` (3.11+, e.g. `Model.forward`) or `co_name` (3.10).
    pub function: String,
    /// `co_filename`.
    pub file: String,
    /// The line being executed; `None` where the line table has none.
    pub line: Option<u32>,
    /// The first frame of its `_PyEval_EvalFrameDefault` call (its caller
    /// is native code): where a run of Python frames ends in a mixed stack.
    pub entry: bool,
    /// The frame's step counter: a local of [`STEP_LOCALS`] holding a
    /// non-negative `int` (the training loop's `for step in ...`).
    pub step: Option<StepLocal>,
}

/// Local variable names a training loop counts its steps in, preferred
/// first when a function has several.
pub const STEP_LOCALS: [&str; 6] = [
    "global_step",
    "step",
    "iteration",
    "step_idx",
    "train_step",
    "iter_num",
];

/// A frame's step counter and its value when the frames were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLocal {
    pub name: &'static str,
    pub value: u64,
}

/// The step counter of a stack (innermost first): the outermost frame's
/// that has one (the training loop, not a helper's own `step`).
pub fn step_of(frames: &[PyFrame]) -> Option<StepLocal> {
    frames.iter().rev().find_map(|f| f.step)
}

#[derive(Debug, thiserror::Error)]
pub enum PyError {
    #[error(
        "opening /proc/{pid}/mem: {source} (reading another process needs root or CAP_SYS_PTRACE)"
    )]
    Open {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: CPython {major}.{minor} is not supported (3.10 and later are)")]
    Unsupported { path: String, major: u8, minor: u8 },
    #[error("{path}: Python {major}.{minor}: layout not understood ({why})")]
    LayoutNotUnderstood {
        path: String,
        major: u8,
        minor: u8,
        #[source]
        why: debug_offsets::NotUnderstood,
    },
    #[error(
        "{path}: the CPython version could not be found (no Py_Version symbol, no version in the file name)"
    )]
    NoVersion { path: String },
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("the interpreter's state does not check out: {0}")]
    Malformed(&'static str),
}

/// The interpreter found in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interpreter {
    /// The mapped file holding `_PyRuntime` (as `/proc/PID/maps` names it).
    pub path: String,
    pub version: (u8, u8, u8),
    /// Address of `_PyRuntime` in the process.
    pub runtime: u64,
    /// Where `_PyEval_EvalFrameDefault` (and its `.cold` part where the
    /// symbol table has one) lies in the process: at most
    /// [`MAX_EVAL_FRAMES`] ranges.
    pub eval_frames: Vec<Range<u64>>,
    types: KnownTypes,
    layout: layout::Layout,
    /// Where the layout came from.
    pub layout_source: LayoutSource,
}

/// Where an interpreter's layout came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutSource {
    /// This project's per-version table (3.10-3.12).
    Table,
    /// The interpreter's own `_Py_DebugOffsets` (3.13+).
    DebugOffsets,
}

/// The most evaluation-loop ranges kept from a file's symbols: a real
/// one has the function and its `.cold` part, once in `.dynsym` and once
/// in `.symtab`; a crafted one may repeat them without end.
pub const MAX_EVAL_FRAMES: usize = 4;

impl Interpreter {
    /// The CPython interpreter of a process whose mappings are `maps`: the
    /// first mapped file (as `/proc/PID/maps` names it, opened as `files`
    /// says) whose ELF symbols hold `_PyRuntime`, its version read
    /// through the memory `open` gives (opened only once a file is found),
    /// and the layout of that version. `Ok(None)` when no such file is
    /// mapped.
    pub fn find<M: Memory>(
        maps: &ProcessMaps,
        files: MappedFiles,
        open: impl FnOnce() -> Result<M, PyError>,
    ) -> Result<Option<(Interpreter, M)>, PyError> {
        Self::find_counting(maps, files, open, &CacheStats::default())
    }

    /// [`Self::find`], counting a symbol table refused for its size into
    /// `stats`.
    fn find_counting<M: Memory>(
        maps: &ProcessMaps,
        files: MappedFiles,
        open: impl FnOnce() -> Result<M, PyError>,
        stats: &CacheStats,
    ) -> Result<Option<(Interpreter, M)>, PyError> {
        let Some(found) = find_interpreter(maps, files, stats) else {
            return Ok(None);
        };
        let mem = open()?;
        let (major, minor, micro) = match found.py_version {
            Some(addr) => {
                let mut b = [0; 8];
                mem.read(addr, &mut b)?;
                let hex = u64::from_le_bytes(b);
                ((hex >> 24) as u8, (hex >> 16) as u8, (hex >> 8) as u8)
            }
            None => version_from_name(&found.path).ok_or_else(|| PyError::NoVersion {
                path: found.path.clone(),
            })?,
        };
        let (layout, layout_source) = match debug_offsets::Table::for_minor(minor) {
            Some(table) if major == 3 => (
                layout_from_debug_offsets(&mem, found.runtime, table, major, minor).map_err(
                    |why| PyError::LayoutNotUnderstood {
                        path: found.path.clone(),
                        major,
                        minor,
                        why,
                    },
                )?,
                LayoutSource::DebugOffsets,
            ),
            _ => (
                *layout::for_version(major, minor).ok_or_else(|| PyError::Unsupported {
                    path: found.path.clone(),
                    major,
                    minor,
                })?,
                LayoutSource::Table,
            ),
        };
        let interpreter = Interpreter {
            path: found.path,
            version: (major, minor, micro),
            runtime: found.runtime,
            eval_frames: found.eval_frames,
            types: found.types,
            layout,
            layout_source,
        };
        Ok(Some((interpreter, mem)))
    }

    /// The structure layout of its version.
    pub fn layout(&self) -> &layout::Layout {
        &self.layout
    }
}

/// The layout a 3.13+ interpreter publishes at the start of `_PyRuntime`
/// (read through `mem`), checked ([`debug_offsets`]).
fn layout_from_debug_offsets<M: Memory>(
    mem: &M,
    runtime: u64,
    table: &'static debug_offsets::Table,
    major: u8,
    minor: u8,
) -> Result<layout::Layout, debug_offsets::NotUnderstood> {
    let mut raw = vec![0u8; table.len()];
    if mem.read(runtime, &mut raw).is_err() {
        return Err(debug_offsets::NotUnderstood::Unreadable);
    }
    debug_offsets::DebugOffsets::new(table, &raw)?.layout(major, minor)
}

/// A CPython process being read.
#[derive(Debug)]
pub struct PythonProcess {
    pid: u32,
    interpreter: Interpreter,
    reader: FrameReader<ProcMem>,
    /// tid -> thread state, checked before each use.
    threads: HashMap<u32, u64>,
    /// When the thread list was last walked, and the tids asked for then
    /// that had no thread state: a native thread of a Python process (a
    /// NCCL or CUDA thread) does not cost a walk per stack.
    listed: Option<Instant>,
    absent: HashSet<u32>,
    /// Whether the process runs in a pid namespace of its own (a
    /// container's): its thread states hold its own thread ids, not the
    /// kernel's ones the agent sees.
    own_pid_namespace: bool,
    /// The agent's tid -> the process's own, read from `NSpid` and kept
    /// until the thread list is walked again (tids are reused).
    own_tids: HashMap<u32, u32>,
}

/// How long a tid without a thread state is taken to have none (a native
/// thread may later call into Python and get one).
const ABSENT_FOR: Duration = Duration::from_secs(1);

impl PythonProcess {
    /// `Ok(None)` when the process has no CPython interpreter mapped.
    pub fn attach(pid: u32) -> Result<Option<Self>, PyError> {
        Self::attach_with(pid, CODE_CACHE_PROCESS_BYTES, &Arc::default())
    }

    /// [`Self::attach`], caching at most `code_cache` bytes of code
    /// objects; the cache, and a symbol table refused for its size, count
    /// into `stats`.
    fn attach_with(
        pid: u32,
        code_cache: u64,
        stats: &Arc<CacheStats>,
    ) -> Result<Option<Self>, PyError> {
        let Ok(maps) = ProcessMaps::read(pid) else {
            return Ok(None);
        };
        let open = || ProcMem::open(pid).map_err(|source| PyError::Open { pid, source });
        let Some((interpreter, mem)) =
            Interpreter::find_counting(&maps, MappedFiles::Process(pid), open, stats)?
        else {
            return Ok(None);
        };
        Ok(Some(Self {
            pid,
            reader: FrameReader::new(
                mem,
                interpreter.layout,
                interpreter.runtime,
                interpreter.types,
            )
            .with_code_cache(code_cache, stats.clone()),
            interpreter,
            threads: HashMap::new(),
            listed: None,
            absent: HashSet::new(),
            own_pid_namespace: ns_pids(&format!("/proc/{pid}/status")).is_some_and(|p| p.len() > 1),
            own_tids: HashMap::new(),
        }))
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn interpreter(&self) -> &Interpreter {
        &self.interpreter
    }

    /// Whether a native return address lies in the evaluation loop.
    pub fn is_eval_frame(&self, addr: u64) -> bool {
        self.interpreter
            .eval_frames
            .iter()
            .any(|r| r.contains(&addr))
    }

    /// Reads of the target's memory so far (one syscall each).
    pub fn reads(&self) -> u64 {
        self.reader.mem.reads()
    }

    /// The Python frames of thread `tid`, innermost first; empty for a
    /// thread that has no Python thread state or runs no Python code.
    pub fn frames(&mut self, tid: u32) -> Result<Vec<PyFrame>, PyError> {
        let tid = self.own_tid(tid);
        if let Some(&ts) = self.threads.get(&tid)
            && let Some(raw) = self.reader.tstate_is(ts, tid)?
        {
            return self.reader.frames(&raw);
        }
        let recent = self.listed.is_some_and(|t| t.elapsed() < ABSENT_FOR);
        if recent && self.absent.contains(&tid) {
            return Ok(Vec::new());
        }
        if !recent {
            self.absent.clear();
            self.own_tids.clear();
        }
        // Unknown or stale: list the threads again (threads come and go).
        self.listed = Some(Instant::now());
        self.threads = self
            .reader
            .thread_states()?
            .into_iter()
            .filter_map(|t| Some((t.tid?, t.addr)))
            .collect();
        match self.threads.get(&tid) {
            Some(&ts) => match self.reader.tstate_is(ts, tid)? {
                Some(raw) => self.reader.frames(&raw),
                None => Ok(Vec::new()),
            },
            None => {
                self.absent.insert(tid);
                Ok(Vec::new())
            }
        }
    }

    /// Kernel thread `tid` (as the agent sees it) as the process numbers
    /// it: the innermost of its `NSpid` ids in a pid namespace of its own.
    fn own_tid(&mut self, tid: u32) -> u32 {
        if !self.own_pid_namespace {
            return tid;
        }
        if let Some(&own) = self.own_tids.get(&tid) {
            return own;
        }
        let own = ns_pids(&format!("/proc/{}/task/{tid}/status", self.pid))
            .and_then(|ids| ids.last().copied())
            .unwrap_or(tid);
        if self.own_tids.len() < MAX_THREADS_NAMED {
            self.own_tids.insert(tid, own);
        }
        own
    }

    /// Every Python thread's tid, as the process numbers them (in a pid
    /// namespace of its own, not the kernel's).
    pub fn threads(&mut self) -> Result<Vec<u32>, PyError> {
        let mut tids: Vec<u32> = self
            .reader
            .thread_states()?
            .into_iter()
            .filter_map(|t| t.tid)
            .collect();
        tids.sort_unstable();
        Ok(tids)
    }
}

/// The most tid translations kept per process (a thread list is far
/// shorter; walking it again clears them).
const MAX_THREADS_NAMED: usize = 4096;

/// The `NSpid` ids of a `/proc/.../status` file: the task's id in each pid
/// namespace it is in, from the reader's to its own.
fn ns_pids(status: &str) -> Option<Vec<u32>> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(status)
        .ok()?
        .take(8192)
        .read_to_string(&mut text)
        .ok()?;
    parse_ns_pids(&text)
}

fn parse_ns_pids(text: &str) -> Option<Vec<u32>> {
    let line = text.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let ids: Vec<u32> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    (!ids.is_empty()).then_some(ids)
}

/// Bytes of code objects cached for all Python processes together.
pub const CODE_CACHE_TOTAL_BYTES: u64 = 256 << 20;

/// Bounds of the code-object caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeCacheBounds {
    pub per_process: u64,
    pub total: u64,
}

impl Default for CodeCacheBounds {
    fn default() -> Self {
        Self {
            per_process: CODE_CACHE_PROCESS_BYTES,
            total: CODE_CACHE_TOTAL_BYTES,
        }
    }
}

/// Python processes by pid, attached on first use. A process that is not
/// Python is remembered as such; [`PythonProcesses::forget`] drops a pid
/// at its exit (a reused pid is attached afresh).
///
/// Each process's code-object cache is bounded ([`CodeCacheBounds`]); past
/// the total, the process caching the most gives up its least used code
/// objects ([`PythonProcesses::trim`]).
#[derive(Debug, Default)]
pub struct PythonProcesses {
    procs: HashMap<u32, Option<PythonProcess>>,
    bounds: CodeCacheBounds,
    stats: Arc<CacheStats>,
}

impl PythonProcesses {
    pub fn new() -> Self {
        Self::default()
    }

    /// Code caches within `bounds`, counting into `stats`.
    pub fn with_bounds(bounds: CodeCacheBounds, stats: Arc<CacheStats>) -> Self {
        Self {
            procs: HashMap::new(),
            bounds,
            stats,
        }
    }

    /// The Python process `pid`, or `None` if it is not one (or attaching
    /// failed: the error is returned once, then `None`).
    pub fn get(&mut self, pid: u32) -> Result<Option<&mut PythonProcess>, PyError> {
        self.trim();
        let entry = match self.procs.entry(pid) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                match PythonProcess::attach_with(pid, self.bounds.per_process, &self.stats) {
                    Ok(p) => e.insert(p),
                    Err(err) => {
                        e.insert(None);
                        return Err(err);
                    }
                }
            }
        };
        Ok(entry.as_mut())
    }

    /// Brings the code caches back within the total bound: the process
    /// caching the most evicts first. Call after reading frames (each
    /// process keeps its own bound as it reads).
    pub fn trim(&mut self) {
        let caches = || self.procs.values().flatten().map(|p| p.reader.code_bytes());
        let mut held: u64 = caches().sum();
        while held > self.bounds.total {
            let Some(biggest) = self
                .procs
                .values_mut()
                .flatten()
                .max_by_key(|p| p.reader.code_bytes())
            else {
                return;
            };
            let freed = biggest.reader.evict_code(held - self.bounds.total);
            if freed == 0 {
                return;
            }
            held -= freed;
        }
    }

    /// Bytes of code objects cached for every process.
    pub fn code_bytes(&self) -> u64 {
        self.procs
            .values()
            .flatten()
            .map(|p| p.reader.code_bytes())
            .sum()
    }

    pub fn forget(&mut self, pid: u32) {
        self.procs.remove(&pid);
    }
}

/// A frame of a mixed stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MixedFrame {
    Native(u64),
    Python(PyFrame),
}

/// Native return addresses (innermost first) with the Python frames
/// (innermost first) put in place of the evaluation frames that run them:
/// each native frame in `_PyEval_EvalFrameDefault` stands for the Python
/// frames up to and including the next one marked [`PyFrame::entry`].
/// Python frames left when the native stack ends (a truncated native
/// stack) are appended; an evaluation frame without Python frames left
/// stays native.
pub fn interleave(
    native: &[u64],
    python: &[PyFrame],
    is_eval: impl Fn(u64) -> bool,
) -> Vec<MixedFrame> {
    let mut out = Vec::with_capacity(native.len() + python.len());
    let mut py = python.iter().peekable();
    for &addr in native {
        if is_eval(addr) && py.peek().is_some() {
            for f in py.by_ref() {
                let entry = f.entry;
                out.push(MixedFrame::Python(f.clone()));
                if entry {
                    break;
                }
            }
        } else {
            out.push(MixedFrame::Native(addr));
        }
    }
    out.extend(py.cloned().map(MixedFrame::Python));
    out
}

/// What the ELF symbols of the interpreter's file give, relocated.
struct Found {
    path: String,
    runtime: u64,
    py_version: Option<u64>,
    eval_frames: Vec<Range<u64>>,
    types: KnownTypes,
}

/// The file that may hold the interpreter: the executable (`python3.X`)
/// or a `libpython3.X.so`.
fn candidate(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("libpython3") || name.starts_with("python3") || name == "python"
}

fn find_interpreter(maps: &ProcessMaps, files: MappedFiles, stats: &CacheStats) -> Option<Found> {
    let mut seen: Vec<&str> = Vec::new();
    for m in maps.mappings() {
        if !m.is_file() || !candidate(&m.path) || seen.contains(&m.path.as_str()) {
            continue;
        }
        seen.push(&m.path);
        let symbols = symbols_of(&files.path(m), MAX_SYMBOL_TABLE);
        stats.refused(symbols.refused);
        if let Some(f) = symbols.found.and_then(|s| s.relocated(maps, &m.path)) {
            return Some(f);
        }
    }
    None
}

/// The largest named evaluation function scanned for split parts: an
/// entry part is a few KiB; a whole loop (hundreds) is not split.
const MAX_NAMED_EVAL: u64 = 64 << 10;

/// The largest symbol table (`.dynsym`, `.symtab`) read to find the
/// interpreter: CPython's are well under a MB. A larger one is refused
/// unread; the other table may still name `_PyRuntime`.
const MAX_SYMBOL_TABLE: u64 = 64 << 20;

/// The most read of a candidate file's headers and symbols (a real
/// interpreter's, tens of MB with its full symbol table, read a few MB).
const MAX_SYMBOL_READ: u64 = 64 << 20;

/// What the interpreter's symbols give, before relocation.
#[derive(Debug, Default)]
struct Symbols {
    /// `(p_offset, p_vaddr)` of the first load segment.
    first_load: Option<(u64, u64)>,
    runtime: Option<u64>,
    py_version: Option<u64>,
    eval_frames: Vec<Range<u64>>,
    types: KnownTypes,
}

/// [`Symbols`] of a file, and how many of its symbol tables were refused
/// as larger than the cap.
struct SymbolsRead {
    found: Option<Symbols>,
    refused: u64,
}

fn symbols_of(path: &Path, max_table: u64) -> SymbolsRead {
    let mut refused = 0;
    let over = Cell::new(false);
    let found = read_symbols(path, max_table, &over, &mut refused);
    // A header table over the cap (the symbol tables are checked first).
    refused += u64::from(over.get());
    SymbolsRead { found, refused }
}

fn read_symbols(
    path: &Path,
    max_table: u64,
    over: &Cell<bool>,
    refused: &mut u64,
) -> Option<Symbols> {
    let file = crate::regular_file::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    // Every read through the cache is capped: section and symbol tables
    // are sized by the file's headers, checked by `object` only against
    // the file's length, which a sparse file makes free. And all of them
    // together are: the cache keeps every range and string it reads.
    let cache = ReadCache::new(ReadBudget::new(file, limit_for(len, MAX_SYMBOL_READ)));
    let data = CappedRead::new(&cache, max_table, over);
    let header = FileHeader64::<Endianness>::parse(data).ok()?;
    let endian = header.endian().ok()?;
    let sections = header.sections(endian, data).ok()?;
    let first_load = header
        .program_headers(endian, data)
        .ok()?
        .iter()
        .find(|ph| ph.p_type(endian) == PT_LOAD)
        .map(|ph| (ph.p_offset(endian), ph.p_vaddr(endian)));
    let mut out = Symbols {
        first_load,
        ..Symbols::default()
    };
    let mut named_eval: Option<Range<u64>> = None;
    for kind in [SHT_DYNSYM, SHT_SYMTAB] {
        let Some(table) = sections.iter().find(|s| s.sh_type(endian) == kind) else {
            continue;
        };
        if table.sh_size(endian) > max_table {
            *refused += 1;
            continue;
        }
        let Ok(symbols) = sections.symbols(endian, data, kind) else {
            continue;
        };
        for sym in symbols.iter() {
            let Ok(name) = sym.name(endian, symbols.strings()) else {
                continue;
            };
            let (addr, size) = (sym.st_value(endian), sym.st_size(endian));
            match name {
                b"_PyRuntime" => out.runtime = Some(addr),
                b"Py_Version" => out.py_version = Some(addr),
                b"_PyEval_EvalFrameDefault" | b"_PyEval_EvalFrameDefault.cold"
                    if out.eval_frames.len() < MAX_EVAL_FRAMES =>
                {
                    // A range that wraps around the address space holds no
                    // return address (checked again where it is placed).
                    let Some(end) = addr.checked_add(size).filter(|&e| e > addr) else {
                        continue;
                    };
                    if name == b"_PyEval_EvalFrameDefault" && size <= MAX_NAMED_EVAL {
                        named_eval = Some(addr..end);
                    }
                    if !out.eval_frames.contains(&(addr..end)) {
                        out.eval_frames.push(addr..end);
                    }
                }
                b"PyCode_Type" => out.types.code = Some(addr),
                b"PyUnicode_Type" => out.types.unicode = Some(addr),
                b"PyBytes_Type" => out.types.bytes = Some(addr),
                b"PyLong_Type" => out.types.int = Some(addr),
                b"PyTuple_Type" => out.types.tuple = Some(addr),
                _ => {}
            }
        }
    }
    // A stripped interpreter names only the hot part of a split loop.
    if let Some(named) = named_eval.clone() {
        let load = header
            .program_headers(endian, data)
            .ok()?
            .iter()
            .find(|ph| {
                ph.p_type(endian) == PT_LOAD
                    && (ph.p_vaddr(endian)..ph.p_vaddr(endian).saturating_add(ph.p_filesz(endian)))
                        .contains(&named.start)
            });
        let code = load.and_then(|ph| {
            let offset = named.start - ph.p_vaddr(endian) + ph.p_offset(endian);
            data.read_bytes_at(offset, named.end - named.start).ok()
        });
        let hdr = sections
            .section_by_name(endian, b".eh_frame_hdr")
            .and_then(|(_, h)| Some((h.data(endian, data).ok()?, h.sh_addr(endian))));
        if let (Some(code), Some((hdr, hdr_addr))) = (code, hdr) {
            for part in split_parts::split_parts(&named, code, hdr, hdr_addr) {
                if out.eval_frames.len() < MAX_EVAL_FRAMES && !out.eval_frames.contains(&part) {
                    out.eval_frames.push(part);
                }
            }
        }
    }
    Some(out)
}

impl Symbols {
    /// Where the symbols are in the process whose `maps` map `path`.
    fn relocated(self, maps: &ProcessMaps, path: &str) -> Option<Found> {
        // Load bias from the first PT_LOAD and the lowest mapping of the file.
        let (offset, vaddr) = self.first_load?;
        let base = maps.base_of(path)?;
        let bias = base.wrapping_add(offset).wrapping_sub(vaddr);
        let at = |addr: u64| bias.wrapping_add(addr);
        let types = KnownTypes {
            code: self.types.code.map(at),
            unicode: self.types.unicode.map(at),
            bytes: self.types.bytes.map(at),
            int: self.types.int.map(at),
            tuple: self.types.tuple.map(at),
        };
        Some(Found {
            path: path.to_string(),
            runtime: at(self.runtime?),
            py_version: self.py_version.map(at),
            // Placed, a range may wrap around the address space: it holds
            // no return address.
            eval_frames: self
                .eval_frames
                .into_iter()
                .filter_map(|r| {
                    let start = at(r.start);
                    let end = start.checked_add(r.end - r.start)?;
                    Some(start..end)
                })
                .collect(),
            types,
        })
    }
}

/// `3.10` from `.../libpython3.10.so.1.0` or `.../python3.10`.
fn version_from_name(path: &str) -> Option<(u8, u8, u8)> {
    let name = path.rsplit('/').next()?;
    let rest = name.split("python3.").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((3, digits.parse().ok()?, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn py(name: &str, entry: bool) -> PyFrame {
        PyFrame {
            function: name.into(),
            file: "f.py".into(),
            line: Some(1),
            entry,
            step: None,
        }
    }

    #[test]
    fn interleaves_at_eval_frames() {
        // sleep <- eval(inner, mid) <- call_function <- eval(outer) <- main
        let native = [0x10, 0x500, 0x20, 0x510, 0x30];
        let python = [py("inner", false), py("mid", true), py("outer", true)];
        let mixed = interleave(&native, &python, |a| (0x500..0x600).contains(&a));
        assert_eq!(
            mixed,
            vec![
                MixedFrame::Native(0x10),
                MixedFrame::Python(py("inner", false)),
                MixedFrame::Python(py("mid", true)),
                MixedFrame::Native(0x20),
                MixedFrame::Python(py("outer", true)),
                MixedFrame::Native(0x30),
            ]
        );
        // A native stack cut short keeps the Python frames at its end.
        let mixed = interleave(&native[..1], &python, |_| false);
        assert_eq!(mixed.len(), 4);
    }

    /// A process that is not Python, read as if it were (this test's own
    /// memory), with `n` code objects of `table` bytes cached.
    fn process_caching(n: u64, table: usize, limit: u64, stats: &Arc<CacheStats>) -> PythonProcess {
        let pid = std::process::id();
        let mem = ProcMem::open(pid).expect("own memory");
        let mut reader = FrameReader::new(mem, layout::PY311, 0, KnownTypes::default())
            .with_code_cache(limit, stats.clone());
        reader.cache_made_up_code(n, table);
        PythonProcess {
            pid,
            interpreter: Interpreter {
                path: String::new(),
                version: (3, 11, 0),
                runtime: 0,
                eval_frames: Vec::new(),
                types: KnownTypes::default(),
                layout: layout::PY311,
                layout_source: LayoutSource::Table,
            },
            reader,
            threads: HashMap::new(),
            listed: None,
            absent: HashSet::new(),
            own_pid_namespace: false,
            own_tids: HashMap::new(),
        }
    }

    #[test]
    fn past_the_total_bound_the_process_caching_most_evicts() {
        let stats = Arc::new(CacheStats::default());
        let each = {
            let p = process_caching(1, 4096, u64::MAX, &stats);
            p.reader.code_bytes()
        };
        let bounds = CodeCacheBounds {
            per_process: 10 * each,
            total: 15 * each,
        };
        let mut procs = PythonProcesses::with_bounds(bounds, stats.clone());
        procs
            .procs
            .insert(1, Some(process_caching(12, 4096, 10 * each, &stats)));
        procs
            .procs
            .insert(2, Some(process_caching(8, 4096, 10 * each, &stats)));
        // Each within its own bound (the first evicted 2 of its 12)...
        let held = |p: &PythonProcesses, pid| p.procs[&pid].as_ref().unwrap().reader.code_bytes();
        assert_eq!((held(&procs, 1), held(&procs, 2)), (10 * each, 8 * each));
        // ...but 18 over the total of 15: the biggest gives 3 back.
        procs.trim();
        assert_eq!((held(&procs, 1), held(&procs, 2)), (7 * each, 8 * each));
        assert_eq!(procs.code_bytes(), 15 * each);
        let f = stats.figures();
        assert_eq!((f.evicted, f.bytes, f.entries), (5, 15 * each, 15));
        procs.forget(1);
        procs.forget(2);
        assert_eq!(stats.figures().bytes, 0);
    }

    #[test]
    fn a_symbol_table_over_its_cap_is_refused_unread() {
        use crate::bounds::test_elf::{Sec, dir, write};
        let d = dir("symtab-cap");
        // A 4 GiB .dynsym in a sparse file: free on disk, a cap away from
        // being read whole.
        let path = write(
            &d.join("libpython3.11.so.1.0"),
            &[
                Sec {
                    name: ".dynsym",
                    kind: SHT_DYNSYM,
                    offset: 8192,
                    size: 4 << 30,
                },
                Sec {
                    name: ".symtab",
                    kind: SHT_SYMTAB,
                    offset: 4096,
                    size: 24 * 4,
                },
            ],
            (4 << 30) + 8192,
        );
        let started = Instant::now();
        let read = symbols_of(&path, MAX_SYMBOL_TABLE);
        assert_eq!(read.refused, 1);
        let symbols = read.found.expect("the headers and .symtab read");
        assert_eq!(symbols.first_load, Some((0, 0)));
        assert!(symbols.runtime.is_none());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn thread_ids_in_pid_namespaces() {
        let status = "Name:\tpython3\nTgid:\t4100\nNSpid:\t4100\t7\nNSsid:\t1\n";
        assert_eq!(parse_ns_pids(status), Some(vec![4100, 7]));
        assert_eq!(parse_ns_pids("NSpid:\t42\n"), Some(vec![42]));
        assert_eq!(parse_ns_pids("NSpid:\t42 x\n"), None);
        assert_eq!(parse_ns_pids("Name:\tx\n"), None);
        // This test's own process is in the agent's namespace.
        let own = ns_pids(&format!("/proc/{}/status", std::process::id())).unwrap();
        assert_eq!(own[0], std::process::id());
    }

    #[test]
    fn versions_from_file_names() {
        assert_eq!(
            version_from_name("/usr/lib/libpython3.10.so.1.0"),
            Some((3, 10, 0))
        );
        assert_eq!(version_from_name("/opt/bin/python3.9"), Some((3, 9, 0)));
        assert_eq!(version_from_name("/usr/bin/python3"), None);
    }
}
