//! The layout CPython 3.13 and later publishes for out-of-process readers:
//! `_Py_DebugOffsets`, the first member of `_PyRuntime`. It starts with a
//! cookie (`xdebugpy`), the interpreter's `PY_VERSION_HEX` and whether the
//! build is free-threaded, then, per structure a frame walk touches (the
//! runtime, interpreter and thread states, the interpreter frame, code,
//! tuple, int, bytes and str objects), its size and the offsets of its
//! fields. CPython's own remote tools read it; so does py-spy.
//!
//! The table itself grows between minor versions (3.14 added fields in
//! the middle of it), so where each of its entries sits is known per minor
//! version ([`TABLE_313`], [`TABLE_314`]); a newer interpreter is read with
//! the newest table, and taken only when everything read checks out: the
//! cookie, the version, a default (GIL) build, every structure's size
//! within bounds and every offset inside its structure, and the fixed
//! object headers the walk relies on where they always were. Anything else
//! is "layout not understood": no frames rather than wrong ones.
//!
//! Facts from `Include/internal/pycore_runtime.h` (3.13) and
//! `pycore_debug_offsets.h` (3.14).

use super::layout::{
    BYTES_DATA, BYTES_SIZE, EntryMark, FrameRoot, INT_DIGITS, INT_SIZE, IntLayout, Layout,
    LineTableFormat, TUPLE_SIZE, UNICODE_LENGTH, UNICODE_STATE,
};

/// What the table starts with.
pub const COOKIE: &[u8; 8] = b"xdebugpy";

/// Where one version's `_Py_DebugOffsets` keeps each entry: the groups in
/// order, each a list of its `uint64_t` fields (every group but the cookie
/// and header starts with its structure's `size`, except the list node
/// and debugger groups, which have none).
#[derive(Debug)]
pub struct Table {
    pub minor: u8,
    groups: &'static [(&'static str, &'static [&'static str])],
}

/// 3.13's table.
pub const TABLE_313: Table = Table {
    minor: 13,
    groups: &[
        ("header", &["cookie", "version", "free_threaded"]),
        (
            "runtime_state",
            &["size", "finalizing", "interpreters_head"],
        ),
        (
            "interpreter_state",
            &[
                "size",
                "id",
                "next",
                "threads_head",
                "gc",
                "imports_modules",
                "sysdict",
                "builtins",
                "ceval_gil",
                "gil_runtime_state",
                "gil_runtime_state_enabled",
                "gil_runtime_state_locked",
                "gil_runtime_state_holder",
            ],
        ),
        (
            "thread_state",
            &[
                "size",
                "prev",
                "next",
                "interp",
                "current_frame",
                "thread_id",
                "native_thread_id",
                "datastack_chunk",
                "status",
            ],
        ),
        (
            "interpreter_frame",
            &[
                "size",
                "previous",
                "executable",
                "instr_ptr",
                "localsplus",
                "owner",
            ],
        ),
        (
            "code_object",
            &[
                "size",
                "filename",
                "name",
                "qualname",
                "linetable",
                "firstlineno",
                "argcount",
                "localsplusnames",
                "localspluskinds",
                "co_code_adaptive",
            ],
        ),
        ("pyobject", &["size", "ob_type"]),
        ("type_object", &["size", "tp_name", "tp_repr", "tp_flags"]),
        ("tuple_object", &["size", "ob_item", "ob_size"]),
        ("list_object", &["size", "ob_item", "ob_size"]),
        ("dict_object", &["size", "ma_keys", "ma_values"]),
        ("float_object", &["size", "ob_fval"]),
        ("long_object", &["size", "lv_tag", "ob_digit"]),
        ("bytes_object", &["size", "ob_size", "ob_sval"]),
        (
            "unicode_object",
            &["size", "state", "length", "asciiobject_size"],
        ),
        ("gc", &["size", "collecting"]),
    ],
};

/// 3.14's table: new fields in the interpreter state, frame and code
/// groups, a set group, and generator, list-node and debugger groups at
/// the end.
pub const TABLE_314: Table = Table {
    minor: 14,
    groups: &[
        ("header", &["cookie", "version", "free_threaded"]),
        (
            "runtime_state",
            &["size", "finalizing", "interpreters_head"],
        ),
        (
            "interpreter_state",
            &[
                "size",
                "id",
                "next",
                "threads_head",
                "threads_main",
                "gc",
                "imports_modules",
                "sysdict",
                "builtins",
                "ceval_gil",
                "gil_runtime_state",
                "gil_runtime_state_enabled",
                "gil_runtime_state_locked",
                "gil_runtime_state_holder",
                "code_object_generation",
                "tlbc_generation",
            ],
        ),
        (
            "thread_state",
            &[
                "size",
                "prev",
                "next",
                "interp",
                "current_frame",
                "thread_id",
                "native_thread_id",
                "datastack_chunk",
                "status",
            ],
        ),
        (
            "interpreter_frame",
            &[
                "size",
                "previous",
                "executable",
                "instr_ptr",
                "localsplus",
                "owner",
                "stackpointer",
                "tlbc_index",
            ],
        ),
        (
            "code_object",
            &[
                "size",
                "filename",
                "name",
                "qualname",
                "linetable",
                "firstlineno",
                "argcount",
                "localsplusnames",
                "localspluskinds",
                "co_code_adaptive",
                "co_tlbc",
            ],
        ),
        ("pyobject", &["size", "ob_type"]),
        ("type_object", &["size", "tp_name", "tp_repr", "tp_flags"]),
        ("tuple_object", &["size", "ob_item", "ob_size"]),
        ("list_object", &["size", "ob_item", "ob_size"]),
        ("set_object", &["size", "used", "table", "mask"]),
        ("dict_object", &["size", "ma_keys", "ma_values"]),
        ("float_object", &["size", "ob_fval"]),
        ("long_object", &["size", "lv_tag", "ob_digit"]),
        ("bytes_object", &["size", "ob_size", "ob_sval"]),
        (
            "unicode_object",
            &["size", "state", "length", "asciiobject_size"],
        ),
        ("gc", &["size", "collecting"]),
        (
            "gen_object",
            &["size", "gi_name", "gi_iframe", "gi_frame_state"],
        ),
        ("llist_node", &["next", "prev"]),
        (
            "debugger_support",
            &[
                "eval_breaker",
                "remote_debugger_support",
                "remote_debugging_enabled",
                "debugger_pending_call",
                "debugger_script_path",
                "debugger_script_path_size",
            ],
        ),
    ],
};

impl Table {
    /// The table that describes minor version `minor` (3.13+): its own,
    /// or the newest known for a newer one.
    pub fn for_minor(minor: u8) -> Option<&'static Table> {
        match minor {
            0..=12 => None,
            13 => Some(&TABLE_313),
            _ => Some(&TABLE_314),
        }
    }

    /// Bytes of the table.
    pub fn len(&self) -> usize {
        self.groups.iter().map(|(_, f)| f.len() * 8).sum()
    }

    /// Never: every table has its header.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where entry `group.field` sits in the table.
    fn position(&self, group: &str, field: &str) -> Option<usize> {
        let mut at = 0;
        for (name, fields) in self.groups {
            if *name == group {
                return fields.iter().position(|f| *f == field).map(|i| at + i * 8);
            }
            at += fields.len() * 8;
        }
        None
    }
}

/// Why a table was not taken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotUnderstood {
    #[error("no debug offsets at _PyRuntime (cookie {0:?})")]
    Cookie(String),
    #[error("the debug offsets say version {0}.{1}, the interpreter {2}.{3}")]
    Version(u8, u8, u8, u8),
    #[error("a free-threaded build (only default builds are read)")]
    FreeThreaded,
    #[error("{0}.size is {1}, beyond what a CPython structure takes")]
    Size(&'static str, u64),
    #[error("{0}.{1} is {2}, outside its structure ({3} bytes)")]
    Offset(&'static str, &'static str, u64, u64),
    #[error("{0}.{1} is {2}, where every version since 3.12 has {3}")]
    Fixed(&'static str, &'static str, u64, u64),
    #[error("the debug offsets are shorter than their table ({0} of {1} bytes)")]
    Short(usize, usize),
    #[error("the debug offsets at _PyRuntime could not be read")]
    Unreadable,
}

/// The largest size taken for each structure read: far above any real
/// build's (a 3.14 `_PyRuntimeState` is under 200 KiB, a thread state
/// under 2 KiB), well below what would let an offset reach anywhere.
fn size_cap(group: &str) -> u64 {
    match group {
        "runtime_state" | "interpreter_state" => 4 << 20,
        "thread_state" => 64 << 10,
        _ => 4 << 10,
    }
}

/// A table's bytes, read from the target, with the interpreter's own
/// version (from `Py_Version`) to check it against.
pub struct DebugOffsets<'a> {
    table: &'static Table,
    raw: &'a [u8],
}

impl<'a> DebugOffsets<'a> {
    /// `raw`: at least `table.len()` bytes from the start of `_PyRuntime`.
    pub fn new(table: &'static Table, raw: &'a [u8]) -> Result<Self, NotUnderstood> {
        if raw.len() < table.len() {
            return Err(NotUnderstood::Short(raw.len(), table.len()));
        }
        if &raw[..8] != COOKIE {
            return Err(NotUnderstood::Cookie(
                String::from_utf8_lossy(&raw[..8]).into_owned(),
            ));
        }
        Ok(Self { table, raw })
    }

    fn entry(&self, group: &'static str, field: &'static str) -> u64 {
        let at = self
            .table
            .position(group, field)
            .expect("the walk reads only entries every table has");
        u64::from_le_bytes(self.raw[at..at + 8].try_into().expect("8 bytes"))
    }

    /// The `PY_VERSION_HEX` the table was written by.
    pub fn version_hex(&self) -> u64 {
        self.entry("header", "version")
    }

    /// `group.field`, checked to lie inside its structure (8 bytes of it
    /// are read, or 1 for the `one_byte` fields).
    fn offset(&self, group: &'static str, field: &'static str) -> Result<u64, NotUnderstood> {
        let size = self.entry(group, "size");
        if size == 0 || size > size_cap(group) {
            return Err(NotUnderstood::Size(group, size));
        }
        let off = self.entry(group, field);
        let width = if matches!((group, field), ("interpreter_frame", "owner")) {
            1
        } else {
            8
        };
        if off.checked_add(width).is_none_or(|end| end > size) {
            return Err(NotUnderstood::Offset(group, field, off, size));
        }
        Ok(off)
    }

    /// An offset the walk takes as fixed (object headers): checked equal.
    fn fixed(
        &self,
        group: &'static str,
        field: &'static str,
        want: u64,
    ) -> Result<(), NotUnderstood> {
        let got = self.entry(group, field);
        if got != want {
            return Err(NotUnderstood::Fixed(group, field, got, want));
        }
        Ok(())
    }

    /// The walk's layout for interpreter `(major, minor)` (as `Py_Version`
    /// gives it), from these offsets.
    pub fn layout(&self, major: u8, minor: u8) -> Result<Layout, NotUnderstood> {
        let hex = self.version_hex();
        let (t_major, t_minor) = ((hex >> 24) as u8, (hex >> 16) as u8);
        if (t_major, t_minor) != (major, minor) {
            return Err(NotUnderstood::Version(t_major, t_minor, major, minor));
        }
        if self.entry("header", "free_threaded") != 0 {
            return Err(NotUnderstood::FreeThreaded);
        }
        self.fixed("tuple_object", "ob_size", TUPLE_SIZE)?;
        self.fixed("long_object", "lv_tag", INT_SIZE)?;
        self.fixed("long_object", "ob_digit", INT_DIGITS)?;
        self.fixed("bytes_object", "ob_size", BYTES_SIZE)?;
        self.fixed("bytes_object", "ob_sval", BYTES_DATA)?;
        self.fixed("unicode_object", "length", UNICODE_LENGTH)?;
        self.fixed("unicode_object", "state", UNICODE_STATE)?;
        self.fixed("pyobject", "ob_type", 8)?;
        let ascii_header = self.offset("unicode_object", "asciiobject_size")?;
        let frame = |f| self.offset("interpreter_frame", f);
        let code = |f| self.offset("code_object", f);
        let owner = frame("owner")?;
        let localsplus = frame("localsplus")?;
        let frame_fields = [
            frame("previous")?,
            frame("executable")?,
            frame("instr_ptr")?,
        ];
        // Every frame field read lies before the locals (read with them).
        if frame_fields.iter().any(|&f| f + 8 > localsplus) || owner >= localsplus {
            return Err(NotUnderstood::Offset(
                "interpreter_frame",
                "localsplus",
                localsplus,
                frame_fields.into_iter().max().unwrap_or(0) + 8,
            ));
        }
        let code_fields = [
            code("filename")?,
            code("name")?,
            code("qualname")?,
            code("linetable")?,
            code("firstlineno")?,
            code("localsplusnames")?,
        ];
        Ok(Layout {
            version: (major, minor),
            runtime_interpreters_head: self.offset("runtime_state", "interpreters_head")?,
            interp_next: self.offset("interpreter_state", "next")?,
            interp_threads_head: self.offset("interpreter_state", "threads_head")?,
            tstate_next: self.offset("thread_state", "next")?,
            tstate_thread_id: self.offset("thread_state", "thread_id")?,
            tstate_native_thread_id: Some(self.offset("thread_state", "native_thread_id")?),
            frame_root: FrameRoot::Direct {
                current_frame: self.offset("thread_state", "current_frame")?,
            },
            frame_previous: frame_fields[0],
            frame_code: frame_fields[1],
            frame_instr: frame_fields[2],
            frame_owner: Some(owner),
            entry: EntryMark::CStackOwner {
                owner,
                cstack: super::layout::FIRST_NON_PYTHON_OWNER,
            },
            frame_size: localsplus as usize,
            code_filename: code_fields[0],
            code_name: code_fields[1],
            code_qualname: Some(code_fields[2]),
            code_linetable: code_fields[3],
            code_firstlineno: code_fields[4],
            code_instructions: Some(code("co_code_adaptive")?),
            code_size: (code_fields.into_iter().max().unwrap_or(0) + 8) as usize,
            linetable: LineTableFormat::Locations311,
            code_local_names: code_fields[5],
            frame_locals: localsplus,
            int_layout: IntLayout::Tagged,
            ascii_header,
            // `PyCompactUnicodeObject`: the ASCII header, then `utf8_length`
            // and `utf8`.
            compact_header: ascii_header + 16,
            // 3.14 made a frame's executable and locals tagged stack
            // references.
            stack_refs: minor >= 14,
            tuple_items: self.offset("tuple_object", "ob_item")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::python::layout::PY313;

    /// A table as 3.13.0 writes it (values from its headers, checked
    /// against the live interpreter by tests/tests/python_frames.rs).
    fn table_313(version: u64) -> Vec<u8> {
        let mut raw = vec![0u8; TABLE_313.len()];
        let mut set = |group: &str, field: &str, v: u64| {
            let at = TABLE_313.position(group, field).unwrap();
            raw[at..at + 8].copy_from_slice(&v.to_le_bytes());
        };
        set("header", "version", version);
        set("runtime_state", "size", 0x1_0000);
        set("runtime_state", "interpreters_head", 0x278);
        set("interpreter_state", "size", 0x2_0000);
        set("interpreter_state", "next", 0x1c60);
        set("interpreter_state", "threads_head", 0x1cb0);
        set("thread_state", "size", 0x400);
        set("thread_state", "next", 8);
        set("thread_state", "current_frame", 0x48);
        set("thread_state", "thread_id", 0x98);
        set("thread_state", "native_thread_id", 0xa0);
        set("interpreter_frame", "size", 0x50);
        set("interpreter_frame", "previous", 8);
        set("interpreter_frame", "executable", 0);
        set("interpreter_frame", "instr_ptr", 0x38);
        set("interpreter_frame", "localsplus", 0x48);
        set("interpreter_frame", "owner", 0x46);
        set("code_object", "size", 0xd0);
        set("code_object", "filename", 0x70);
        set("code_object", "name", 0x78);
        set("code_object", "qualname", 0x80);
        set("code_object", "linetable", 0x88);
        set("code_object", "firstlineno", 0x44);
        set("code_object", "localsplusnames", 0x60);
        set("code_object", "co_code_adaptive", 0xc8);
        set("pyobject", "size", 16);
        set("pyobject", "ob_type", 8);
        set("tuple_object", "size", 32);
        set("tuple_object", "ob_item", 24);
        set("tuple_object", "ob_size", 16);
        set("long_object", "size", 32);
        set("long_object", "lv_tag", 16);
        set("long_object", "ob_digit", 24);
        set("bytes_object", "size", 40);
        set("bytes_object", "ob_size", 16);
        set("bytes_object", "ob_sval", 32);
        set("unicode_object", "size", 56);
        set("unicode_object", "state", 32);
        set("unicode_object", "length", 16);
        set("unicode_object", "asciiobject_size", 40);
        raw[..8].copy_from_slice(COOKIE);
        raw
    }

    #[test]
    fn the_313_table_gives_the_313_layout() {
        let raw = table_313(0x030d00f0);
        let offsets = DebugOffsets::new(&TABLE_313, &raw).unwrap();
        assert_eq!(offsets.layout(3, 13).unwrap(), PY313);
        assert_eq!(TABLE_313.len(), 584);
        assert_eq!(TABLE_314.len(), 760);
    }

    #[test]
    fn tables_that_do_not_check_out_are_refused() {
        let raw = table_313(0x030d00f0);
        // Another version than the interpreter's own.
        let offsets = DebugOffsets::new(&TABLE_313, &raw).unwrap();
        assert!(matches!(
            offsets.layout(3, 14),
            Err(NotUnderstood::Version(3, 13, 3, 14))
        ));
        // No cookie.
        let mut bad = raw.clone();
        bad[0] = b'X';
        assert!(matches!(
            DebugOffsets::new(&TABLE_313, &bad),
            Err(NotUnderstood::Cookie(_))
        ));
        // Short.
        assert!(matches!(
            DebugOffsets::new(&TABLE_313, &raw[..100]),
            Err(NotUnderstood::Short(100, 584))
        ));
        let patched = |group: &str, field: &str, v: u64| {
            let mut r = raw.clone();
            let at = TABLE_313.position(group, field).unwrap();
            r[at..at + 8].copy_from_slice(&v.to_le_bytes());
            r
        };
        let refused = |r: &[u8]| DebugOffsets::new(&TABLE_313, r).unwrap().layout(3, 13);
        assert_eq!(
            refused(&patched("header", "free_threaded", 1)),
            Err(NotUnderstood::FreeThreaded)
        );
        // An offset past its structure's end, and one that would wrap.
        assert!(matches!(
            refused(&patched("thread_state", "native_thread_id", 0x400)),
            Err(NotUnderstood::Offset(
                "thread_state",
                "native_thread_id",
                0x400,
                0x400
            ))
        ));
        assert!(matches!(
            refused(&patched("code_object", "name", u64::MAX - 3)),
            Err(NotUnderstood::Offset("code_object", "name", _, _))
        ));
        // A structure size no build has.
        assert!(matches!(
            refused(&patched("interpreter_frame", "size", 1 << 40)),
            Err(NotUnderstood::Size("interpreter_frame", _))
        ));
        // Object headers moved.
        assert!(matches!(
            refused(&patched("long_object", "ob_digit", 32)),
            Err(NotUnderstood::Fixed("long_object", "ob_digit", 32, 24))
        ));
        // A frame field the locals would overlap.
        assert!(matches!(
            refused(&patched("interpreter_frame", "instr_ptr", 0x44)),
            Err(NotUnderstood::Offset(
                "interpreter_frame",
                "localsplus",
                _,
                _
            ))
        ));
    }

    #[test]
    fn newer_minors_use_the_newest_table() {
        assert_eq!(Table::for_minor(12).map(|t| t.minor), None);
        assert_eq!(Table::for_minor(13).map(|t| t.minor), Some(13));
        assert_eq!(Table::for_minor(14).map(|t| t.minor), Some(14));
        assert_eq!(Table::for_minor(15).map(|t| t.minor), Some(14));
    }
}
