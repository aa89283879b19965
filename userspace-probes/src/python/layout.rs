//! Where CPython keeps what a frame walk needs, per minor version (x86-64,
//! default build: no `Py_DEBUG`, no free threading).
//!
//! Facts from each version's published headers (`pycore_runtime.h`,
//! `pycore_interp.h`, `cpython/pystate.h`, `pycore_frame.h` /
//! `cpython/frameobject.h`, `cpython/code.h`, `cpython/unicodeobject.h`).
//! A layout is stable across the patch releases of a minor version, which
//! is all CPython promises. 3.10-3.12 are read with these tables; 3.13 and
//! later with what the interpreter publishes in its `_Py_DebugOffsets`
//! ([`super::debug_offsets`]), which the 3.13 and 3.14 tables here are
//! checked against.

/// How a thread state leads to its innermost frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameRoot {
    /// 3.10: `tstate->frame`, a `PyFrameObject*` linked by `f_back`.
    FrameObject { frame: u64 },
    /// 3.11, 3.12: `tstate->cframe->current_frame`, a `_PyInterpreterFrame*`.
    CFrame { cframe: u64, current_frame: u64 },
    /// 3.13: `tstate->current_frame`.
    Direct { current_frame: u64 },
}

/// How a code object's line table is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineTableFormat {
    /// 3.10 `co_linetable`: (byte delta, signed line delta) pairs.
    Pairs310,
    /// 3.11+ `co_linetable`: the location table (`Objects/locations.md`).
    Locations311,
}

/// Where each frame records that it was entered from C (the first Python
/// frame a `_PyEval_EvalFrameDefault` call runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMark {
    /// 3.10: every frame object has its own evaluation call.
    EveryFrame,
    /// 3.11: the frame's `is_entry` byte.
    IsEntryByte(u64),
    /// 3.12+: the frame's caller is a frame that runs no Python: a shim
    /// owned by the C stack, or (3.14+) the interpreter's base frame at
    /// the bottom of each thread. Such frames have `owner >= cstack`
    /// ([`FIRST_NON_PYTHON_OWNER`]) and are skipped.
    CStackOwner { owner: u64, cstack: u8 },
}

/// How an `int` (`PyLongObject`) says its sign and digit count; its
/// 30-bit digits follow at [`INT_DIGITS`] in every version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntLayout {
    /// 3.10, 3.11: `ob_size` is the digit count, negative for a negative
    /// number.
    SignedSize,
    /// 3.12+: `long_value.lv_tag`: the digit count shifted left by 3, the
    /// sign in the low 2 bits (0 positive, 1 zero, 2 negative).
    Tagged,
}

/// Offsets (bytes) of one minor version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub version: (u8, u8),
    /// `_PyRuntime.interpreters.head`.
    pub runtime_interpreters_head: u64,
    /// `PyInterpreterState.next`.
    pub interp_next: u64,
    /// `PyInterpreterState.threads.head` (3.10: `tstate_head`).
    pub interp_threads_head: u64,
    /// `PyThreadState.next`.
    pub tstate_next: u64,
    /// `PyThreadState.thread_id` (the `pthread_t`).
    pub tstate_thread_id: u64,
    /// `PyThreadState.native_thread_id` (3.11+): the kernel tid.
    pub tstate_native_thread_id: Option<u64>,
    pub frame_root: FrameRoot,
    /// The frame's caller (`previous`; 3.10 `f_back`).
    pub frame_previous: u64,
    /// The frame's code object (`f_code`; 3.13 `f_executable`).
    pub frame_code: u64,
    /// 3.11+: `prev_instr` (3.13 `instr_ptr`), a pointer into the code's
    /// `co_code_adaptive`; 3.10: `f_lasti`, an int in code units.
    pub frame_instr: u64,
    /// `owner` (3.11+).
    pub frame_owner: Option<u64>,
    pub entry: EntryMark,
    /// Bytes of a frame read at once (covers every field above).
    pub frame_size: usize,
    pub code_filename: u64,
    pub code_name: u64,
    /// `co_qualname` (3.11+).
    pub code_qualname: Option<u64>,
    pub code_linetable: u64,
    pub code_firstlineno: u64,
    /// `co_code_adaptive` (3.11+): where the instructions start.
    pub code_instructions: Option<u64>,
    /// Bytes of a code object read at once.
    pub code_size: usize,
    pub linetable: LineTableFormat,
    /// The names of the frame's local variables (and cells), a tuple of
    /// `str` whose order is the frame's slots': 3.11+
    /// `co_localsplusnames`, 3.10 `co_varnames`.
    pub code_local_names: u64,
    /// Where a frame's local variable slots start: 3.11+ `localsplus`
    /// (right after the `_PyInterpreterFrame` fields), 3.10 the frame
    /// object's `f_localsplus`.
    pub frame_locals: u64,
    /// How an `int` keeps its sign and size.
    pub int_layout: IntLayout,
    /// Size of `PyASCIIObject` (compact ASCII data follows it).
    pub ascii_header: u64,
    /// Size of `PyCompactUnicodeObject` (other compact data follows it).
    pub compact_header: u64,
    /// 3.14+: a frame's executable and its locals are `_PyStackRef`s, an
    /// object pointer with a reference-kind tag in its low bit, or a
    /// tagged int (low two bits set, the value above them).
    pub stack_refs: bool,
    /// `PyTupleObject.ob_item`: [`TUPLE_ITEMS`] until 3.13; 3.14 put a
    /// cached hash before the items.
    pub tuple_items: u64,
}

/// The lowest `owner` of a frame that runs no Python: 3.12 and 3.13's
/// `FRAME_OWNED_BY_CSTACK`, 3.14's `FRAME_OWNED_BY_INTERPRETER` (then
/// `FRAME_OWNED_BY_CSTACK` is 4).
pub const FIRST_NON_PYTHON_OWNER: u8 = 3;

/// `PyVarObject.ob_size` and `PyBytesObject.ob_sval`, the same in 3.10-3.14
/// (checked against the debug offsets from 3.13 on).
pub const BYTES_SIZE: u64 = 16;
pub const BYTES_DATA: u64 = 32;
/// `PyTupleObject`: `ob_size`, then (until 3.13) the items.
pub const TUPLE_SIZE: u64 = 16;
pub const TUPLE_ITEMS: u64 = 24;
/// `PyLongObject`: `ob_size` (3.10, 3.11) or `lv_tag` (3.12+), then the
/// digits.
pub const INT_SIZE: u64 = 16;
pub const INT_DIGITS: u64 = 24;
/// `PyASCIIObject.length` and `.state`.
pub const UNICODE_LENGTH: u64 = 16;
pub const UNICODE_STATE: u64 = 32;

/// Bytes of a thread state read at once.
impl Layout {
    pub fn tstate_size(&self) -> usize {
        let root = match self.frame_root {
            FrameRoot::FrameObject { frame } => frame,
            FrameRoot::CFrame { cframe, .. } => cframe,
            FrameRoot::Direct { current_frame } => current_frame,
        };
        let last = [
            self.tstate_next,
            self.tstate_thread_id,
            self.tstate_native_thread_id.unwrap_or(0),
            root,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        last as usize + 8
    }
}

pub const PY310: Layout = Layout {
    version: (3, 10),
    runtime_interpreters_head: 40,
    interp_next: 0,
    interp_threads_head: 8,
    tstate_next: 8,
    tstate_thread_id: 176,
    tstate_native_thread_id: None,
    frame_root: FrameRoot::FrameObject { frame: 24 },
    frame_previous: 24,
    frame_code: 32,
    frame_instr: 96,
    frame_owner: None,
    entry: EntryMark::EveryFrame,
    frame_size: 104,
    code_filename: 104,
    code_name: 112,
    code_qualname: None,
    code_linetable: 120,
    code_firstlineno: 40,
    code_instructions: None,
    code_size: 128,
    linetable: LineTableFormat::Pairs310,
    code_local_names: 72,
    frame_locals: 352,
    int_layout: IntLayout::SignedSize,
    ascii_header: 48,
    compact_header: 72,
    stack_refs: false,
    tuple_items: TUPLE_ITEMS,
};

pub const PY311: Layout = Layout {
    version: (3, 11),
    runtime_interpreters_head: 40,
    interp_next: 0,
    interp_threads_head: 16,
    tstate_next: 8,
    tstate_thread_id: 152,
    tstate_native_thread_id: Some(160),
    frame_root: FrameRoot::CFrame {
        cframe: 56,
        current_frame: 8,
    },
    frame_previous: 48,
    frame_code: 32,
    frame_instr: 56,
    frame_owner: Some(69),
    entry: EntryMark::IsEntryByte(68),
    frame_size: 72,
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_linetable: 136,
    code_firstlineno: 72,
    code_instructions: Some(184),
    code_size: 144,
    linetable: LineTableFormat::Locations311,
    code_local_names: 96,
    frame_locals: 72,
    int_layout: IntLayout::SignedSize,
    ascii_header: 48,
    compact_header: 72,
    stack_refs: false,
    tuple_items: TUPLE_ITEMS,
};

pub const PY312: Layout = Layout {
    version: (3, 12),
    runtime_interpreters_head: 48,
    interp_next: 0,
    interp_threads_head: 72,
    tstate_next: 8,
    tstate_thread_id: 136,
    tstate_native_thread_id: Some(144),
    frame_root: FrameRoot::CFrame {
        cframe: 56,
        current_frame: 0,
    },
    frame_previous: 8,
    frame_code: 0,
    frame_instr: 56,
    frame_owner: Some(70),
    entry: EntryMark::CStackOwner {
        owner: 70,
        cstack: FIRST_NON_PYTHON_OWNER,
    },
    frame_size: 72,
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_linetable: 136,
    code_firstlineno: 68,
    code_instructions: Some(192),
    code_size: 144,
    linetable: LineTableFormat::Locations311,
    code_local_names: 96,
    frame_locals: 72,
    int_layout: IntLayout::Tagged,
    ascii_header: 40,
    compact_header: 56,
    stack_refs: false,
    tuple_items: TUPLE_ITEMS,
};

pub const PY313: Layout = Layout {
    version: (3, 13),
    runtime_interpreters_head: 0x278,
    interp_next: 0x1c60,
    interp_threads_head: 0x1cb0,
    tstate_next: 8,
    tstate_thread_id: 0x98,
    tstate_native_thread_id: Some(0xa0),
    frame_root: FrameRoot::Direct {
        current_frame: 0x48,
    },
    frame_previous: 8,
    frame_code: 0,
    frame_instr: 0x38,
    frame_owner: Some(0x46),
    entry: EntryMark::CStackOwner {
        owner: 0x46,
        cstack: FIRST_NON_PYTHON_OWNER,
    },
    frame_size: 0x48,
    code_filename: 0x70,
    code_name: 0x78,
    code_qualname: Some(0x80),
    code_linetable: 0x88,
    code_firstlineno: 0x44,
    code_instructions: Some(0xc8),
    code_size: 0x90,
    linetable: LineTableFormat::Locations311,
    code_local_names: 96,
    frame_locals: 72,
    int_layout: IntLayout::Tagged,
    ascii_header: 40,
    compact_header: 56,
    stack_refs: false,
    tuple_items: TUPLE_ITEMS,
};

/// 3.14 as its `_Py_DebugOffsets` give it (3.14.10, Debian unstable):
/// 3.14 is read from those offsets, this table is what
/// `tests/tests/python_frames.rs` checks them against and what the
/// `python_frames` fuzz target walks. New in 3.14: tagged stack references
/// in frames, the frame's `owner` moved, tuples' items after a cached hash.
pub const PY314: Layout = Layout {
    version: (3, 14),
    runtime_interpreters_head: 0x328,
    interp_next: 0x1c68,
    interp_threads_head: 0x1cb0,
    tstate_next: 8,
    tstate_thread_id: 0x98,
    tstate_native_thread_id: Some(0xa0),
    frame_root: FrameRoot::Direct {
        current_frame: 0x48,
    },
    frame_previous: 8,
    frame_code: 0,
    frame_instr: 0x38,
    frame_owner: Some(0x4a),
    entry: EntryMark::CStackOwner {
        owner: 0x4a,
        cstack: FIRST_NON_PYTHON_OWNER,
    },
    frame_size: 0x50,
    code_filename: 0x70,
    code_name: 0x78,
    code_qualname: Some(0x80),
    code_linetable: 0x88,
    code_firstlineno: 0x44,
    code_instructions: Some(0xd0),
    code_size: 0x90,
    linetable: LineTableFormat::Locations311,
    code_local_names: 0x60,
    frame_locals: 0x50,
    int_layout: IntLayout::Tagged,
    ascii_header: 40,
    compact_header: 56,
    stack_refs: true,
    tuple_items: 0x20,
};

/// The table of a minor version (3.10-3.13), if this project has one
/// (3.14's is a check, not used to read):
/// 3.13 and later are read from the interpreter's own debug offsets.
pub fn for_version(major: u8, minor: u8) -> Option<&'static Layout> {
    match (major, minor) {
        (3, 10) => Some(&PY310),
        (3, 11) => Some(&PY311),
        (3, 12) => Some(&PY312),
        (3, 13) => Some(&PY313),
        _ => None,
    }
}

/// glibc x86-64 `struct pthread`: `header.self` (the `pthread_t` points at
/// its own thread control block) and `tid`. Stable since glibc 2.x; used
/// only for 3.10, whose thread states hold no kernel tid.
pub const PTHREAD_SELF: u64 = 0x10;
pub const PTHREAD_TID: u64 = 0x2d0;
