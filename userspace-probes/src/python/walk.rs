//! The walk itself, over any [`Memory`]: interpreters -> thread states ->
//! frames -> code objects -> strings and line tables. Every pointer comes
//! from the target and may be garbage (a race with the running thread, or
//! a hostile process): every loop is bounded, every size capped, and a
//! value that does not check out ends the walk with an error.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::layout::{
    BYTES_DATA, BYTES_SIZE, EntryMark, FrameRoot, INT_DIGITS, INT_SIZE, IntLayout, Layout,
    PTHREAD_SELF, PTHREAD_TID, TUPLE_SIZE, UNICODE_LENGTH, UNICODE_STATE,
};
use super::linetable;
use super::memory::{Memory, ReadError};
use super::{PyError, PyFrame, STEP_LOCALS, StepLocal};
use crate::bounds::CacheStats;
use crate::bytes::{i32_at, u32_at, u64_at};

/// The deepest Python stack returned (recursion limit is 1,000 by
/// default; a deeper walk is cut here).
pub const MAX_PY_FRAMES: usize = 1024;
/// Interpreters and threads followed before the lists count as looping.
const MAX_INTERPRETERS: usize = 256;
const MAX_THREADS: usize = 65_536;
/// Longest function or file name read (characters).
const MAX_STRING_CHARS: u64 = 4096;
/// Largest line table read (bytes).
const MAX_LINETABLE: u64 = 1 << 20;
/// Local variable names looked through for a step counter: the training
/// loop's own locals come first in its code's names.
const MAX_LOCAL_NAMES: u64 = 64;
/// Bytes of code objects (names and line tables) cached per process: a
/// large training program runs a few tens of thousands of functions with
/// tables of a few hundred bytes, a few MB in all; each entry's size is
/// the target's choice (a line table up to [`MAX_LINETABLE`]).
pub const CODE_CACHE_PROCESS_BYTES: u64 = 64 << 20;
/// During one stack walk, memory is read by whole pages and kept: the
/// frames of a thread sit next to each other on its data stack (3.11+) and
/// code objects of a module share pages, so a 40-frame stack costs a few
/// page reads instead of two reads per frame. A syscall costs far more
/// than copying 4 KiB.
const PAGE: u64 = 4096;
/// A page of the target: its address and bytes.
type Page = (u64, Box<[u8]>);
/// Pages kept during one walk (256 KiB).
const MAX_PAGES: usize = 64;

/// Type objects of the interpreter (from its ELF symbols) that objects
/// read from the target must have; `None` skips the check (fuzzing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KnownTypes {
    pub code: Option<u64>,
    pub unicode: Option<u64>,
    pub bytes: Option<u64>,
    /// `PyLong_Type`: a step counter must be an exact `int` (not a `bool`,
    /// not a subclass).
    pub int: Option<u64>,
    pub tuple: Option<u64>,
}

/// One thread state of the thread list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadState {
    pub addr: u64,
    /// The kernel tid (3.11+ `native_thread_id`; 3.10 read from the
    /// thread's glibc `struct pthread`); `None` if it could not be found.
    pub tid: Option<u32>,
}

/// What the frame walk keeps of a code object.
#[derive(Debug)]
struct CodeInfo {
    function: String,
    file: String,
    firstlineno: i32,
    linetable: Vec<u8>,
    /// The slot and name of the code's step counter local, if it has one
    /// (the first of [`STEP_LOCALS`] among its local names).
    step_local: Option<(u64, &'static str)>,
}

impl CodeInfo {
    /// What the cache holds for it: its strings and table, the entry, its
    /// key (in the map and in the eviction queue) and the `Arc`'s counts.
    fn cost(&self) -> u64 {
        let fixed = std::mem::size_of::<Self>()
            + std::mem::size_of::<Cached>()
            + 2 * std::mem::size_of::<CodeKey>()
            + 16;
        (fixed + self.function.capacity() + self.file.capacity() + self.linetable.capacity()) as u64
    }
}

#[derive(Debug)]
struct Cached {
    info: Arc<CodeInfo>,
    bytes: u64,
    /// Used since the eviction queue last passed it: it gets another turn.
    used: bool,
}

/// The code objects of one process, bounded in bytes. Eviction is
/// second-chance (clock) over insertion order: a code object on every
/// stack (the training loop's) keeps its place, a flood of code run once
/// goes first, and a hit costs a flag, not a reordering.
#[derive(Debug)]
struct CodeCache {
    map: HashMap<CodeKey, Cached>,
    order: VecDeque<CodeKey>,
    bytes: u64,
    limit: u64,
    stats: Arc<CacheStats>,
}

impl CodeCache {
    fn new(limit: u64, stats: Arc<CacheStats>) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            limit,
            stats,
        }
    }

    fn get(&mut self, key: &CodeKey) -> Option<Arc<CodeInfo>> {
        let c = self.map.get_mut(key)?;
        c.used = true;
        Some(c.info.clone())
    }

    fn insert(&mut self, key: CodeKey, info: Arc<CodeInfo>) {
        let bytes = info.cost();
        if bytes > self.limit {
            self.stats.refused(1);
            return;
        }
        self.evict(self.bytes.saturating_add(bytes).saturating_sub(self.limit));
        if let Some(old) = self.map.insert(
            key,
            Cached {
                info,
                bytes,
                used: false,
            },
        ) {
            // Not reached (a hit is never inserted again), kept exact.
            self.bytes -= old.bytes;
            self.stats.dropped(1, old.bytes);
        } else {
            self.order.push_back(key);
        }
        self.bytes += bytes;
        self.stats.added(bytes);
    }

    /// Evicts entries until at least `want` bytes are freed (or none is
    /// left); returns the bytes freed.
    fn evict(&mut self, want: u64) -> u64 {
        let mut freed = 0;
        while freed < want {
            let Some(key) = self.order.pop_front() else {
                break;
            };
            let Some(c) = self.map.get_mut(&key) else {
                continue;
            };
            if c.used {
                c.used = false;
                self.order.push_back(key);
                continue;
            }
            let bytes = c.bytes;
            self.map.remove(&key);
            self.bytes -= bytes;
            self.stats.evicted(bytes);
            freed += bytes;
        }
        freed
    }
}

impl Drop for CodeCache {
    fn drop(&mut self) {
        self.stats.dropped(self.map.len() as u64, self.bytes);
    }
}

/// The fields of a code object header that identify what was cached: a
/// freed code object whose address is reused has other names and tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct CodeKey {
    addr: u64,
    filename: u64,
    name: u64,
    linetable: u64,
    firstlineno: i32,
}

/// Reads Python stacks of one process.
#[derive(Debug)]
pub struct FrameReader<M> {
    pub(crate) mem: M,
    layout: Layout,
    runtime: u64,
    types: KnownTypes,
    code: CodeCache,
    /// Pages read during the current walk, `None` outside a walk.
    pages: RefCell<Option<Vec<Page>>>,
}

impl<M: Memory> FrameReader<M> {
    /// `runtime` is the address of `_PyRuntime` in the target.
    pub fn new(mem: M, layout: Layout, runtime: u64, types: KnownTypes) -> Self {
        Self {
            mem,
            layout,
            runtime,
            types,
            code: CodeCache::new(CODE_CACHE_PROCESS_BYTES, Arc::default()),
            pages: RefCell::new(None),
        }
    }

    /// Caches at most `limit` bytes of code objects, counting into `stats`
    /// (shared by the readers of every process, for the agent's figures).
    pub fn with_code_cache(mut self, limit: u64, stats: Arc<CacheStats>) -> Self {
        self.code = CodeCache::new(limit, stats);
        self
    }

    /// Bytes of code objects cached.
    pub fn code_bytes(&self) -> u64 {
        self.code.bytes
    }

    /// Caches `n` made-up code objects with `table`-byte line tables.
    #[cfg(test)]
    pub(crate) fn cache_made_up_code(&mut self, n: u64, table: usize) {
        for i in 0..n {
            let key = CodeKey {
                addr: i,
                filename: 0,
                name: 0,
                linetable: 0,
                firstlineno: 0,
            };
            let info = CodeInfo {
                function: String::new(),
                file: String::new(),
                firstlineno: 0,
                linetable: vec![0; table],
                step_local: None,
            };
            self.code.insert(key, Arc::new(info));
        }
    }

    /// Evicts cached code objects (least used first) until at least `want`
    /// bytes are freed or none is left; returns the bytes freed. For a
    /// bound over several processes.
    pub fn evict_code(&mut self, want: u64) -> u64 {
        self.code.evict(want)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn read_vec(&self, addr: u64, len: usize) -> Result<Vec<u8>, ReadError> {
        let mut buf = vec![0; len];
        self.read(addr, &mut buf)?;
        Ok(buf)
    }

    fn read_u64(&self, addr: u64) -> Result<u64, ReadError> {
        let mut buf = [0; 8];
        self.read(addr, &mut buf)?;
        Ok(u64::from_le_bytes(buf))
    }

    /// A read, through the walk's pages when one is under way and the read
    /// is small (a long line table is read directly).
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let mut pages = self.pages.borrow_mut();
        let Some(pages) = pages.as_mut() else {
            return self.mem.read(addr, buf);
        };
        let err = ReadError {
            addr,
            len: buf.len(),
        };
        let end = addr.checked_add(buf.len() as u64).ok_or(err)?;
        let first = addr & !(PAGE - 1);
        if end.saturating_sub(first) > 2 * PAGE {
            return self.mem.read(addr, buf);
        }
        let mut page = first;
        let mut done = 0;
        while page < end {
            let idx = match pages.iter().position(|(p, _)| *p == page) {
                Some(i) => i,
                None => {
                    let mut bytes = vec![0u8; PAGE as usize].into_boxed_slice();
                    if self.mem.read(page, &mut bytes).is_err() {
                        // Part of the page is not there (the end of an
                        // image): read just what was asked.
                        return self.mem.read(addr, buf);
                    }
                    if pages.len() >= MAX_PAGES {
                        pages.remove(0);
                    }
                    pages.push((page, bytes));
                    pages.len() - 1
                }
            };
            // The last page of the address space has no end address.
            let page_end = page.saturating_add(PAGE);
            let from = addr.max(page);
            let to = end.min(page_end);
            let n = (to - from) as usize;
            let off = (from - page) as usize;
            buf[done..done + n].copy_from_slice(&pages[idx].1[off..off + n]);
            done += n;
            page = page_end;
        }
        Ok(())
    }

    /// Every thread state of every interpreter.
    pub fn thread_states(&self) -> Result<Vec<ThreadState>, PyError> {
        let l = self.layout;
        let mut out = Vec::new();
        let mut interp = self.read_u64(add(self.runtime, l.runtime_interpreters_head)?)?;
        for _ in 0..MAX_INTERPRETERS {
            if interp == 0 {
                return Ok(out);
            }
            let mut ts = self.read_u64(add(interp, l.interp_threads_head)?)?;
            while ts != 0 {
                if out.len() >= MAX_THREADS {
                    return Err(PyError::Malformed("the thread list does not end"));
                }
                let raw = self.read_vec(ts, l.tstate_size())?;
                let tid = match l.tstate_native_thread_id {
                    Some(off) => field(&raw, off)?.try_into().ok(),
                    None => self.pthread_tid(field(&raw, l.tstate_thread_id)?),
                };
                out.push(ThreadState { addr: ts, tid });
                ts = field(&raw, l.tstate_next)?;
            }
            interp = self.read_u64(add(interp, l.interp_next)?)?;
        }
        Err(PyError::Malformed("the interpreter list does not end"))
    }

    /// The kernel tid of a glibc thread, from its `pthread_t` (the address
    /// of its `struct pthread`, which starts with a pointer to itself).
    fn pthread_tid(&self, pthread: u64) -> Option<u32> {
        let end = usize::try_from(PTHREAD_TID).ok()? + 4;
        let raw = self.read_vec(pthread, end).ok()?;
        if u64_at(&raw, PTHREAD_SELF as usize)? != pthread {
            return None;
        }
        let tid = u32_at(&raw, PTHREAD_TID as usize)?;
        (tid != 0).then_some(tid)
    }

    /// Whether the thread state at `ts` still belongs to kernel thread
    /// `tid` (a cached mapping is checked before each use).
    pub fn tstate_is(&self, ts: u64, tid: u32) -> Result<Option<Vec<u8>>, PyError> {
        let l = self.layout;
        let raw = self.read_vec(ts, l.tstate_size())?;
        let now = match l.tstate_native_thread_id {
            Some(off) => u32::try_from(field(&raw, off)?).ok(),
            None => self.pthread_tid(field(&raw, l.tstate_thread_id)?),
        };
        Ok((now == Some(tid)).then_some(raw))
    }

    /// The Python frames of the thread state at `ts`, innermost first.
    pub fn frames_at(&mut self, ts: u64) -> Result<Vec<PyFrame>, PyError> {
        let raw = self.read_vec(ts, self.layout.tstate_size())?;
        self.frames(&raw)
    }

    /// The Python frames of the thread state whose bytes are `tstate`,
    /// innermost first.
    pub fn frames(&mut self, tstate: &[u8]) -> Result<Vec<PyFrame>, PyError> {
        *self.pages.borrow_mut() = Some(Vec::new());
        let frames = self.walk(tstate);
        *self.pages.borrow_mut() = None;
        frames
    }

    fn walk(&mut self, tstate: &[u8]) -> Result<Vec<PyFrame>, PyError> {
        let l = self.layout;
        let mut addr = match l.frame_root {
            FrameRoot::FrameObject { frame }
            | FrameRoot::Direct {
                current_frame: frame,
            } => field(tstate, frame)?,
            FrameRoot::CFrame {
                cframe,
                current_frame,
            } => match field(tstate, cframe)? {
                0 => 0,
                cf => self.read_u64(add(cf, current_frame)?)?,
            },
        };
        let mut out: Vec<PyFrame> = Vec::new();
        // Shim frames (3.12+) count toward the bound too.
        for _ in 0..MAX_PY_FRAMES * 2 {
            if addr == 0 || out.len() >= MAX_PY_FRAMES {
                break;
            }
            let frame_addr = addr;
            let raw = self.read_vec(addr, l.frame_size)?;
            addr = field(&raw, l.frame_previous)?;
            let owner = l.frame_owner.and_then(|o| raw.get(o as usize).copied());
            if let EntryMark::CStackOwner { cstack, .. } = l.entry
                && owner.is_some_and(|o| o >= cstack)
            {
                // The shim a C caller pushed: the frame run inside it was
                // the first of its evaluation call.
                if let Some(last) = out.last_mut() {
                    last.entry = true;
                }
                continue;
            }
            let Some(code_addr) = object_ref(&l, field(&raw, l.frame_code)?) else {
                continue;
            };
            let Some(code) = self.code(code_addr)? else {
                // 3.13: a frame running something other than a code object.
                continue;
            };
            let lasti = match l.code_instructions {
                Some(start) => {
                    let instr = field(&raw, l.frame_instr)?;
                    let start = add(code_addr, start)?;
                    if instr < start {
                        // Pushed but not started (3.11/3.12 "incomplete"
                        // frames): tracebacks skip them too.
                        continue;
                    }
                    Some((instr - start) / 2)
                }
                None => {
                    let lasti = raw
                        .get(l.frame_instr as usize..)
                        .and_then(|b| i32_at(b, 0))
                        .ok_or(PyError::Malformed("short frame"))?;
                    u64::try_from(lasti).ok()
                }
            };
            let line = match lasti {
                Some(lasti) => {
                    linetable::line_for(l.linetable, &code.linetable, code.firstlineno, lasti)
                }
                None => u32::try_from(code.firstlineno).ok(),
            };
            let entry = match l.entry {
                EntryMark::EveryFrame => true,
                EntryMark::IsEntryByte(off) => raw.get(off as usize).is_some_and(|&b| b != 0),
                EntryMark::CStackOwner { .. } => false,
            };
            let step = match code.step_local {
                Some((slot, name)) => self
                    .step_value(frame_addr, slot)
                    .ok()
                    .flatten()
                    .map(|value| StepLocal { name, value }),
                None => None,
            };
            out.push(PyFrame {
                function: code.function.clone(),
                file: code.file.clone(),
                line,
                entry,
                step,
            });
        }
        Ok(out)
    }

    /// The code object at `addr`, from the cache when its identifying
    /// fields are unchanged; `None` if it is not a code object.
    fn code(&mut self, addr: u64) -> Result<Option<Arc<CodeInfo>>, PyError> {
        let l = self.layout;
        let raw = self.read_vec(addr, l.code_size)?;
        if let Some(ty) = self.types.code
            && field(&raw, 8)? != ty
        {
            return Ok(None);
        }
        let name_ptr = match l.code_qualname {
            Some(q) => field(&raw, q)?,
            None => field(&raw, l.code_name)?,
        };
        let firstlineno = raw
            .get(l.code_firstlineno as usize..)
            .and_then(|b| i32_at(b, 0))
            .ok_or(PyError::Malformed("short code object"))?;
        let key = CodeKey {
            addr,
            filename: field(&raw, l.code_filename)?,
            name: name_ptr,
            linetable: field(&raw, l.code_linetable)?,
            firstlineno,
        };
        if let Some(info) = self.code.get(&key) {
            return Ok(Some(info));
        }
        let info = Arc::new(CodeInfo {
            function: self.string(key.name)?,
            file: self.string(key.filename)?,
            firstlineno,
            linetable: self.bytes(key.linetable)?,
            // A step counter is extra: names that do not read leave the
            // frame without one, not the walk without the frame.
            step_local: field(&raw, l.code_local_names)
                .and_then(|names| self.step_local(names))
                .ok()
                .flatten(),
        });
        self.code.insert(key, info.clone());
        Ok(Some(info))
    }

    /// The slot of the first of [`STEP_LOCALS`] among a code object's
    /// local names (the tuple at `names`; its first [`MAX_LOCAL_NAMES`]).
    fn step_local(&self, names: u64) -> Result<Option<(u64, &'static str)>, PyError> {
        let head = self.read_vec(names, self.layout.tuple_items as usize)?;
        if let Some(ty) = self.types.tuple
            && field(&head, 8)? != ty
        {
            return Err(PyError::Malformed("local names that are not a tuple"));
        }
        let n = field(&head, TUPLE_SIZE)?.min(MAX_LOCAL_NAMES);
        let items = self.read_vec(add(names, self.layout.tuple_items)?, (n * 8) as usize)?;
        let mut best: Option<(usize, u64)> = None;
        for slot in 0..n {
            let name = self.string(field(&items, slot * 8)?)?;
            if let Some(rank) = STEP_LOCALS.iter().position(|w| *w == name)
                && best.is_none_or(|(r, _)| rank < r)
            {
                best = Some((rank, slot));
            }
        }
        Ok(best.map(|(rank, slot)| (slot, STEP_LOCALS[rank])))
    }

    /// The value of the frame's local in `slot` when it is a non-negative
    /// `int` below 2^60 (two digits); `None` for anything else (unset, a
    /// cell, another type).
    fn step_value(&self, frame: u64, slot: u64) -> Result<Option<u64>, PyError> {
        let l = self.layout;
        let at = add(add(frame, l.frame_locals)?, slot * 8)?;
        let raw = self.read_u64(at)?;
        if l.stack_refs && raw & STACK_REF_INT == STACK_REF_INT {
            // A tagged int: the value is in the bits above the tag.
            return Ok(u64::try_from((raw as i64) >> 2).ok());
        }
        let Some(obj) = object_ref(&l, raw) else {
            return Ok(None);
        };
        let head = self.read_vec(obj, (INT_DIGITS + 8) as usize)?;
        match self.types.int {
            Some(ty) if field(&head, 8)? != ty => return Ok(None),
            _ => {}
        }
        let size = field(&head, INT_SIZE)?;
        let digits = match l.int_layout {
            IntLayout::SignedSize => {
                let size = size as i64;
                if size < 0 {
                    return Ok(None);
                }
                size as u64
            }
            IntLayout::Tagged => match size & 3 {
                0 => size >> 3,
                1 => 0,
                _ => return Ok(None),
            },
        };
        let digit = |i: usize| {
            u32_at(&head, INT_DIGITS as usize + 4 * i).map(|d| u64::from(d & ((1 << 30) - 1)))
        };
        Ok(match digits {
            0 => Some(0),
            1 => digit(0),
            2 => Some(digit(0).unwrap_or(0) | digit(1).unwrap_or(0) << 30),
            _ => None,
        })
    }

    /// A `str` object's text (compact strings: every string a code object
    /// names is one).
    fn string(&self, addr: u64) -> Result<String, PyError> {
        let l = self.layout;
        let head = self.read_vec(addr, l.compact_header as usize)?;
        if let Some(ty) = self.types.unicode
            && field(&head, 8)? != ty
        {
            return Err(PyError::Malformed("a name that is not a str"));
        }
        let len = field(&head, UNICODE_LENGTH)?;
        let state = u32_at(&head, UNICODE_STATE as usize).ok_or(PyError::Malformed("short str"))?;
        let kind = u64::from((state >> 2) & 7);
        let compact = state & (1 << 5) != 0;
        let ascii = state & (1 << 6) != 0;
        if !compact || !matches!(kind, 1 | 2 | 4) || (ascii && kind != 1) {
            return Err(PyError::Malformed("a str that is not compact"));
        }
        if len > MAX_STRING_CHARS {
            return Err(PyError::Malformed("a name longer than 4096 characters"));
        }
        let data = if ascii {
            l.ascii_header
        } else {
            l.compact_header
        };
        let raw = self.read_vec(add(addr, data)?, (len * kind) as usize)?;
        Ok(match kind {
            1 => raw.iter().map(|&b| char::from(b)).collect(),
            2 => char::decode_utf16(
                raw.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]])),
            )
            .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
            .collect(),
            _ => raw
                .chunks_exact(4)
                .map(|c| {
                    char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .unwrap_or(char::REPLACEMENT_CHARACTER)
                })
                .collect(),
        })
    }

    /// A `bytes` object's content.
    fn bytes(&self, addr: u64) -> Result<Vec<u8>, PyError> {
        let head = self.read_vec(addr, BYTES_DATA as usize)?;
        if let Some(ty) = self.types.bytes
            && field(&head, 8)? != ty
        {
            return Err(PyError::Malformed("a line table that is not bytes"));
        }
        let len = field(&head, BYTES_SIZE)?;
        if len > MAX_LINETABLE {
            self.code.stats.refused(1);
            return Err(PyError::Malformed("a line table over 1 MiB"));
        }
        Ok(self.read_vec(add(addr, BYTES_DATA)?, len as usize)?)
    }
}

/// 3.14+ `Py_INT_TAG`: both low bits set marks a tagged int.
const STACK_REF_INT: u64 = 3;

/// The object a frame slot refers to: the pointer itself before 3.14; from
/// 3.14 a `_PyStackRef` with its reference-kind bit cleared. `None` for
/// NULL (also `PyStackRef_NULL`, the tag alone) and a tagged int.
fn object_ref(l: &Layout, raw: u64) -> Option<u64> {
    let obj = if l.stack_refs {
        if raw & STACK_REF_INT == STACK_REF_INT {
            return None;
        }
        raw & !1
    } else {
        raw
    };
    (obj != 0).then_some(obj)
}

fn add(base: u64, off: u64) -> Result<u64, PyError> {
    base.checked_add(off)
        .ok_or(PyError::Malformed("an address past the end of memory"))
}

fn field(raw: &[u8], off: u64) -> Result<u64, PyError> {
    usize::try_from(off)
        .ok()
        .and_then(|o| u64_at(raw, o))
        .ok_or(PyError::Malformed("a field outside the object read"))
}

#[cfg(test)]
mod tests {
    use super::super::layout::PY311;
    use super::super::memory::ImageMemory;
    use super::*;

    fn key(i: u64) -> CodeKey {
        CodeKey {
            addr: 0x1000 + i * 0x100,
            filename: 1,
            name: 2,
            linetable: 3,
            firstlineno: 1,
        }
    }

    fn info(table: usize) -> Arc<CodeInfo> {
        Arc::new(CodeInfo {
            function: "f".into(),
            file: "f.py".into(),
            firstlineno: 1,
            linetable: vec![0xff; table],
            step_local: None,
        })
    }

    #[test]
    fn the_code_cache_keeps_its_bytes_bound_and_evicts_code_run_once_first() {
        let stats = Arc::new(CacheStats::default());
        let each = info(1000).cost();
        let mut cache = CodeCache::new(10 * each, stats.clone());
        // The training loop's code is on every stack; a flood of code run
        // once passes through.
        let hot = key(0);
        cache.insert(hot, info(1000));
        for i in 1..=1000 {
            assert!(
                cache.get(&hot).is_some(),
                "the hot code object evicted at {i}"
            );
            assert!(cache.get(&key(i)).is_none());
            cache.insert(key(i), info(1000));
            assert!(cache.bytes <= 10 * each, "{} bytes", cache.bytes);
        }
        let f = stats.figures();
        assert_eq!(f.entries, 10);
        assert_eq!(f.bytes, 10 * each);
        assert_eq!(f.peak_bytes, 10 * each);
        assert_eq!(f.evicted, 1001 - 10);
        assert_eq!(f.evicted_bytes, (1001 - 10) * each);
        assert_eq!(f.refused, 0);
        // One entry larger than the whole bound is not kept, and counted.
        cache.insert(key(5000), info(20 * 1000));
        assert!(cache.get(&key(5000)).is_none());
        assert_eq!(stats.figures().refused, 1);
        // A bound over several processes takes what it asks for.
        assert!(cache.evict(3 * each) >= 3 * each);
        assert_eq!(stats.figures().entries, 7);
        drop(cache);
        let f = stats.figures();
        assert_eq!(
            (f.bytes, f.entries),
            (0, 0),
            "a reader dropped gives back its bytes"
        );
    }

    #[test]
    fn a_line_table_over_its_cap_is_refused_unread_and_counted() {
        let mut mem = ImageMemory::new();
        // A bytes object header claiming 2 GiB of line table.
        let mut head = vec![0u8; BYTES_DATA as usize];
        head[BYTES_SIZE as usize..][..8].copy_from_slice(&(2u64 << 30).to_le_bytes());
        mem.map(0x5000, head);
        let stats = Arc::new(CacheStats::default());
        let r = FrameReader::new(mem, PY311, 0, KnownTypes::default())
            .with_code_cache(CODE_CACHE_PROCESS_BYTES, stats.clone());
        assert!(matches!(r.bytes(0x5000), Err(PyError::Malformed(_))));
        assert_eq!(stats.figures().refused, 1);
    }

    #[test]
    fn page_reads_match_direct_reads_and_stay_in_bounds() {
        let bytes: Vec<u8> = (0..3 * PAGE).map(|i| (i % 251) as u8).collect();
        let mut mem = ImageMemory::new();
        // Not page aligned: the first and last pages are partly there.
        mem.map(0x1_0100, bytes.clone());
        let top = u64::MAX - 64;
        mem.map(top, vec![7; 64]);
        let r = FrameReader::new(mem, PY311, 0, KnownTypes::default());
        *r.pages.borrow_mut() = Some(Vec::new());
        for (addr, len) in [
            (0x1_0100, 16),
            (0x1_0ff8, 16),
            (0x1_2000, 4096),
            (0x1_3000, 200),
        ] {
            let got = r.read_vec(addr, len).expect("in the image");
            let off = (addr - 0x1_0100) as usize;
            assert_eq!(got, bytes[off..off + len], "{addr:#x}+{len}");
        }
        assert!(r.read_vec(0x1_0000, 512).is_err(), "before the image");
        assert_eq!(r.read_vec(top, 64).expect("the top"), vec![7; 64]);
        assert!(r.read_vec(top, 65).is_err());
        assert!(r.read_vec(u64::MAX - 4, 8).is_err());
    }
}
