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
//! Supported: CPython 3.10-3.13, x86-64, default (GIL) builds; layouts in
//! [`layout`]. Tested against 3.11 (Debian) in CI and 3.10.13, 3.11.7,
//! 3.12.1 and 3.13.0 where pyenv has them (`tests/tests/python_frames.rs`).
//!
//! Cost per stack in steady state (code objects cached): the thread state,
//! then the frames and code object headers, read by 4 KiB page during the
//! walk (a thread's frames sit together on its data stack): 6-7 reads
//! (syscalls) and 8-10 us for a 3-frame stack, 11-16 reads and 24-29 us for
//! 40 frames (release, 2-vCPU VM; docs/src/measurements/stacks.md, "Reading Python frames").

pub mod layout;
pub mod linetable;
pub mod memory;
pub mod walk;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::time::{Duration, Instant};

use object::elf::PT_LOAD;
use object::read::ReadCache;
use object::read::elf::{ElfFile64, ProgramHeader};
use object::{Endianness, Object, ObjectSymbol};

use crate::maps::ProcessMaps;
use crate::read_budget::{ReadBudget, limit_for};
use memory::{Memory, ProcMem, ReadError};
use walk::{FrameReader, KnownTypes};

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
    #[error("{path}: CPython {major}.{minor} is not supported (3.10-3.13 are)")]
    Unsupported { path: String, major: u8, minor: u8 },
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
    layout: &'static layout::Layout,
}

/// The most evaluation-loop ranges kept from a file's symbols: a real
/// one has the function and its `.cold` part, once in `.dynsym` and once
/// in `.symtab`; a crafted one may repeat them without end.
pub const MAX_EVAL_FRAMES: usize = 4;

impl Interpreter {
    /// The CPython interpreter of a process whose mappings are `maps`: the
    /// first mapped file (as `/proc/PID/maps` names it, opened under
    /// `root`) whose ELF symbols hold `_PyRuntime`, its version read
    /// through the memory `open` gives (opened only once a file is found),
    /// and the layout of that version. `Ok(None)` when no such file is
    /// mapped.
    pub fn find<M: Memory>(
        maps: &ProcessMaps,
        root: &Path,
        open: impl FnOnce() -> Result<M, PyError>,
    ) -> Result<Option<(Interpreter, M)>, PyError> {
        let Some(found) = find_interpreter(maps, root) else {
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
        let layout = layout::for_version(major, minor).ok_or_else(|| PyError::Unsupported {
            path: found.path.clone(),
            major,
            minor,
        })?;
        let interpreter = Interpreter {
            path: found.path,
            version: (major, minor, micro),
            runtime: found.runtime,
            eval_frames: found.eval_frames,
            types: found.types,
            layout,
        };
        Ok(Some((interpreter, mem)))
    }

    /// The structure layout of its version.
    pub fn layout(&self) -> &'static layout::Layout {
        self.layout
    }
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
}

/// How long a tid without a thread state is taken to have none (a native
/// thread may later call into Python and get one).
const ABSENT_FOR: Duration = Duration::from_secs(1);

impl PythonProcess {
    /// `Ok(None)` when the process has no CPython interpreter mapped.
    pub fn attach(pid: u32) -> Result<Option<Self>, PyError> {
        let Ok(maps) = ProcessMaps::read(pid) else {
            return Ok(None);
        };
        let root = format!("/proc/{pid}/root");
        let open = || ProcMem::open(pid).map_err(|source| PyError::Open { pid, source });
        let Some((interpreter, mem)) = Interpreter::find(&maps, Path::new(&root), open)? else {
            return Ok(None);
        };
        Ok(Some(Self {
            pid,
            reader: FrameReader::new(
                mem,
                interpreter.layout,
                interpreter.runtime,
                interpreter.types,
            ),
            interpreter,
            threads: HashMap::new(),
            listed: None,
            absent: HashSet::new(),
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

    /// Every Python thread's kernel tid.
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

/// Python processes by pid, attached on first use. A process that is not
/// Python is remembered as such; [`PythonProcesses::forget`] drops a pid
/// at its exit (a reused pid is attached afresh).
#[derive(Debug, Default)]
pub struct PythonProcesses {
    procs: HashMap<u32, Option<PythonProcess>>,
}

impl PythonProcesses {
    pub fn new() -> Self {
        Self::default()
    }

    /// The Python process `pid`, or `None` if it is not one (or attaching
    /// failed: the error is returned once, then `None`).
    pub fn get(&mut self, pid: u32) -> Result<Option<&mut PythonProcess>, PyError> {
        let entry = match self.procs.entry(pid) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => match PythonProcess::attach(pid) {
                Ok(p) => e.insert(p),
                Err(err) => {
                    e.insert(None);
                    return Err(err);
                }
            },
        };
        Ok(entry.as_mut())
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

fn find_interpreter(maps: &ProcessMaps, root: &Path) -> Option<Found> {
    let mut seen: Vec<&str> = Vec::new();
    for m in maps.mappings() {
        if !m.is_file() || !candidate(&m.path) || seen.contains(&m.path.as_str()) {
            continue;
        }
        seen.push(&m.path);
        if let Some(f) = symbols_of(maps, root, &m.path) {
            return Some(f);
        }
    }
    None
}

/// The most read of a candidate file's headers and symbols (a real
/// interpreter's, tens of MB with its full symbol table, read a few MB).
const MAX_SYMBOL_READ: u64 = 64 << 20;

fn symbols_of(maps: &ProcessMaps, root: &Path, path: &str) -> Option<Found> {
    let file = crate::regular_file::open(&root.join(path.trim_start_matches('/'))).ok()?;
    let len = file.metadata().ok()?.len();
    let cache = ReadCache::new(ReadBudget::new(file, limit_for(len, MAX_SYMBOL_READ)));
    let elf = ElfFile64::<Endianness, _>::parse(&cache).ok()?;
    let endian = elf.endian();
    // Load bias from the first PT_LOAD and the lowest mapping of the file.
    let first = elf
        .elf_program_headers()
        .iter()
        .find(|ph| ph.p_type(endian) == PT_LOAD)?;
    let base = maps.base_of(path)?;
    let bias = base
        .wrapping_add(first.p_offset(endian))
        .wrapping_sub(first.p_vaddr(endian));
    let mut runtime = None;
    let mut py_version = None;
    let mut eval_frames = Vec::new();
    let mut types = KnownTypes::default();
    for sym in elf.dynamic_symbols().chain(elf.symbols()) {
        let Ok(name) = sym.name() else { continue };
        let addr = bias.wrapping_add(sym.address());
        match name {
            "_PyRuntime" => runtime = Some(addr),
            "Py_Version" => py_version = Some(addr),
            "_PyEval_EvalFrameDefault" | "_PyEval_EvalFrameDefault.cold"
                if eval_frames.len() < MAX_EVAL_FRAMES =>
            {
                // A range that wraps around the address space holds no
                // return address.
                let Some(end) = addr.checked_add(sym.size()).filter(|&e| e > addr) else {
                    continue;
                };
                if !eval_frames.contains(&(addr..end)) {
                    eval_frames.push(addr..end);
                }
            }
            "PyCode_Type" => types.code = Some(addr),
            "PyUnicode_Type" => types.unicode = Some(addr),
            "PyBytes_Type" => types.bytes = Some(addr),
            "PyLong_Type" => types.int = Some(addr),
            "PyTuple_Type" => types.tuple = Some(addr),
            _ => {}
        }
    }
    Some(Found {
        path: path.to_string(),
        runtime: runtime?,
        py_version,
        eval_frames,
        types,
    })
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
