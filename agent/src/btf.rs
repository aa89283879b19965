//! Just enough of a BTF reader to find `task_struct` field offsets, and
//! the facts [`crate::kernel::features`] checks (enumerators, tracepoint
//! signatures).
//!
//! Rust eBPF programs get no CO-RE relocations, so the agent reads the
//! offsets of the fields its programs need from the running kernel's BTF
//! (`/sys/kernel/btf/vmlinux`) and hands them over as load-time globals.
//!
//! Why not a library's BTF reader: `aya-obj` 0.3 (already a dependency)
//! parses BTF but keeps its types, members and strings crate-private (its
//! public API finds a type id by name and nothing more), so it cannot give a
//! member's offset; `btf-rs` 2.0 can, but is LGPL-2.1-or-later, which the
//! Apache-2.0 agent would link statically. This reader stays, bounded
//! against hostile input (`--kernel-btf` is a user-given file): every read
//! is bounds-checked, offsets are checked sums, and nesting of anonymous
//! members is depth-limited. It is fuzzed (`tests/fuzz`, target `btf`).

use std::path::{Path, PathBuf};

use xpuscope_common::TaskOffsets;

/// The running kernel's BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error(
        "this kernel exposes no BTF at {path}; xpuscope needs a kernel built with \
         CONFIG_DEBUG_INFO_BTF=y (most distribution kernels since 5.4 are), or a BTF file for \
         this kernel given with --kernel-btf (e.g. from BTFHub)"
    )]
    NoKernelBtf { path: PathBuf },
    #[error(
        "the BTF file {path} does not exist; give --kernel-btf the path of a BTF file for this \
         kernel (e.g. from BTFHub), or leave it out to use {VMLINUX_BTF}"
    )]
    FileMissing { path: PathBuf },
    /// The OS error is the source (printed once, after this message).
    #[error("cannot read the BTF file {path}")]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a BTF file: {what}")]
    NotBtf { path: PathBuf, what: String },
    #[error("{path} is not a valid BTF file: {what}")]
    Malformed { path: PathBuf, what: String },
    #[error("the kernel's BTF has no `{0}`: this kernel is not supported")]
    MissingField(String),
}

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_PTR: u32 = 2;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_ENUM64: u32 = 19;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_TYPE_TAG: u32 = 18;

#[derive(Debug, Clone)]
struct Member {
    name_off: u32,
    type_id: u32,
    bit_offset: u32,
}

#[derive(Debug, Clone)]
struct Type {
    name_off: u32,
    kind: u32,
    /// Referenced type for modifiers and typedefs.
    type_ref: u32,
    /// A struct's or union's members; an enum's enumerators and a function
    /// prototype's parameters (names and, for parameters, types; no
    /// offsets).
    members: Vec<Member>,
}

/// A parsed BTF blob (types and strings).
pub struct Btf {
    /// Index = type id; id 0 is `void`.
    types: Vec<Type>,
    strings: Vec<u8>,
}

fn u16_at(d: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(d.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(d: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(d.get(o..o + 4)?.try_into().ok()?))
}

/// Why bytes are not BTF we can read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// Not BTF at all (wrong magic, too short).
    NotBtf(String),
    /// BTF whose header or type section is inconsistent.
    Malformed(String),
}

/// The BTF header's fixed part: magic, version, flags, hdr_len and four
/// section offsets/lengths.
const HEADER_LEN: usize = 24;
/// How deep anonymous structs/unions may nest inside each other (the
/// kernel's own types nest a few levels; a loop must not recurse forever).
const MAX_NESTING: u32 = 32;
/// Members one lookup may visit: anonymous members that point at each
/// other fan out exponentially within [`MAX_NESTING`] (found by fuzzing:
/// a 246-byte file took minutes); the kernel's `task_struct` needs a few
/// hundred.
const MAX_VISITS: u32 = 100_000;

impl Btf {
    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let data = std::fs::read(path).map_err(|source| {
            let path = path.to_path_buf();
            match source.kind() {
                std::io::ErrorKind::NotFound if path == Path::new(VMLINUX_BTF) => {
                    BtfError::NoKernelBtf { path }
                }
                std::io::ErrorKind::NotFound => BtfError::FileMissing { path },
                _ => BtfError::Unreadable { path, source },
            }
        })?;
        Self::parse(&data).map_err(|e| match e {
            ParseError::NotBtf(what) => BtfError::NotBtf {
                path: path.to_path_buf(),
                what,
            },
            ParseError::Malformed(what) => BtfError::Malformed {
                path: path.to_path_buf(),
                what,
            },
        })
    }

    pub fn parse(d: &[u8]) -> Result<Self, ParseError> {
        Self::check_magic(d)?;
        Self::parse_inner(d).map_err(ParseError::Malformed)
    }

    /// Checks the magic; everything after it is [`ParseError::Malformed`].
    fn check_magic(d: &[u8]) -> Result<(), ParseError> {
        let first: Vec<String> = d.iter().take(4).map(|b| format!("{b:02x}")).collect();
        let first = first.join(" ");
        match u16_at(d, 0) {
            Some(BTF_MAGIC) if d.len() >= HEADER_LEN => Ok(()),
            Some(BTF_MAGIC) => Err(ParseError::NotBtf(format!(
                "it is {} bytes long, shorter than a BTF header ({HEADER_LEN} bytes)",
                d.len()
            ))),
            Some(m) if m == BTF_MAGIC.swap_bytes() => Err(ParseError::NotBtf(
                "it is big-endian BTF (from a big-endian machine); xpuscope reads little-endian \
                 BTF of the kernel it runs on"
                    .to_string(),
            )),
            _ if d.starts_with(b"\x7fELF") => Err(ParseError::NotBtf(
                "it is an ELF file; give the raw BTF (e.g. `objcopy -O binary --only-section=.BTF \
                 vmlinux vmlinux.btf`)"
                    .to_string(),
            )),
            _ if d.is_empty() => Err(ParseError::NotBtf("it is empty".to_string())),
            _ => Err(ParseError::NotBtf(format!(
                "it starts with bytes {first}, not the BTF magic 9f eb"
            ))),
        }
    }

    fn parse_inner(d: &[u8]) -> Result<Self, String> {
        // check_magic made sure the fixed header is there.
        let field = |o: usize| u32_at(d, o).map(|v| v as usize).ok_or("short header");
        let (hdr_len, type_off, type_len) = (field(4)?, field(8)?, field(12)?);
        let (str_off, str_len) = (field(16)?, field(20)?);
        let types_start = hdr_len + type_off;
        let types_end = types_start + type_len;
        if types_end > d.len() {
            return Err(format!(
                "its type section (bytes {types_start}..{types_end}) runs past the end of the \
                 file ({} bytes): truncated?",
                d.len()
            ));
        }
        let strings = d
            .get(hdr_len + str_off..hdr_len + str_off + str_len)
            .ok_or_else(|| {
                format!(
                    "its string section (bytes {}..{}) runs past the end of the file ({} bytes): \
                     truncated?",
                    hdr_len + str_off,
                    hdr_len + str_off + str_len,
                    d.len()
                )
            })?
            .to_vec();
        let mut types = vec![Type {
            name_off: 0,
            kind: 0,
            type_ref: 0,
            members: Vec::new(),
        }];
        let mut o = types_start;
        while o < types_end {
            let name_off = u32_at(d, o).ok_or("truncated type")?;
            let info = u32_at(d, o + 4).ok_or("truncated type")?;
            let size_or_type = u32_at(d, o + 8).ok_or("truncated type")?;
            o += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            let mut members = Vec::new();
            let extra = match kind {
                1 => 4,  // INT
                3 => 12, // ARRAY
                KIND_STRUCT | KIND_UNION => {
                    for i in 0..vlen {
                        let m = o + i * 12;
                        let raw = u32_at(d, m + 8).ok_or("truncated member")?;
                        members.push(Member {
                            name_off: u32_at(d, m).ok_or("truncated member")?,
                            type_id: u32_at(d, m + 4).ok_or("truncated member")?,
                            bit_offset: if kind_flag { raw & 0x00ff_ffff } else { raw },
                        });
                    }
                    vlen * 12
                }
                KIND_ENUM | KIND_FUNC_PROTO | KIND_ENUM64 => {
                    // (name, value) or (name, type); ENUM64 adds the
                    // value's high half.
                    let size = if kind == KIND_ENUM64 { 12 } else { 8 };
                    for i in 0..vlen {
                        let m = o + i * size;
                        members.push(Member {
                            name_off: u32_at(d, m).ok_or("truncated enumerator or parameter")?,
                            type_id: u32_at(d, m + 4).ok_or("truncated enumerator or parameter")?,
                            bit_offset: 0,
                        });
                    }
                    vlen * size
                }
                14 => 4,         // VAR
                15 => vlen * 12, // DATASEC
                17 => 4,         // DECL_TAG
                2 | 7 | 8 | 9 | 10 | 11 | 12 | 16 | 18 => 0,
                other => return Err(format!("unknown BTF kind {other}")),
            };
            o += extra;
            types.push(Type {
                name_off,
                kind,
                type_ref: size_or_type,
                members,
            });
        }
        Ok(Self { types, strings })
    }

    fn name(&self, off: u32) -> &str {
        let start = off as usize;
        let Some(rest) = self.strings.get(start..) else {
            return "";
        };
        let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    fn struct_id(&self, name: &str) -> Option<u32> {
        self.types
            .iter()
            .position(|t| {
                t.kind == KIND_STRUCT && !t.members.is_empty() && self.name(t.name_off) == name
            })
            .map(|i| i as u32)
    }

    /// Follows typedefs and qualifiers.
    fn resolve(&self, mut id: u32) -> Option<&Type> {
        for _ in 0..32 {
            let t = self.types.get(id as usize)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.type_ref
                }
                _ => return Some(t),
            }
        }
        None
    }

    /// Byte offset of member `name` in the struct/union `ty`, looking
    /// through anonymous nested structs and unions (at most
    /// [`MAX_NESTING`] deep, so a type that contains itself ends).
    fn member_offset(&self, ty: &Type, name: &str, depth: u32, budget: &mut u32) -> Option<u32> {
        if depth > MAX_NESTING {
            return None;
        }
        for m in &ty.members {
            *budget = budget.checked_sub(1)?;
            let member_name = self.name(m.name_off);
            if member_name == name {
                return Some(m.bit_offset / 8);
            }
            if member_name.is_empty()
                && let Some(inner) = self.resolve(m.type_id)
                && matches!(inner.kind, KIND_STRUCT | KIND_UNION)
                && let Some(off) = self.member_offset(inner, name, depth + 1, budget)
            {
                return (m.bit_offset / 8).checked_add(off);
            }
        }
        None
    }

    fn member_type(&self, ty: &Type, name: &str, depth: u32, budget: &mut u32) -> Option<&Type> {
        if depth > MAX_NESTING {
            return None;
        }
        for m in &ty.members {
            *budget = budget.checked_sub(1)?;
            let member_name = self.name(m.name_off);
            if member_name == name {
                return self.resolve(m.type_id);
            }
            if member_name.is_empty()
                && let Some(inner) = self.resolve(m.type_id)
                && matches!(inner.kind, KIND_STRUCT | KIND_UNION)
                && let Some(t) = self.member_type(inner, name, depth + 1, budget)
            {
                return Some(t);
            }
        }
        None
    }

    /// Whether the kernel's enum `enum_name` has the enumerator `value`
    /// (`bpf_func_id` has `BPF_FUNC_task_pt_regs` where the kernel has that
    /// helper).
    pub fn has_enumerator(&self, enum_name: &str, value: &str) -> bool {
        self.types.iter().any(|t| {
            matches!(t.kind, KIND_ENUM | KIND_ENUM64)
                && self.name(t.name_off) == enum_name
                && t.members.iter().any(|m| self.name(m.name_off) == value)
        })
    }

    /// Whether the kernel has a struct named `name` (with members).
    pub fn has_struct(&self, name: &str) -> bool {
        self.struct_id(name).is_some()
    }

    /// The arguments raw tracepoint `name` hands its programs: the
    /// parameters of its `btf_trace_<name>` typedef (a pointer to a
    /// function prototype) after the first (the probe's own data). `None`
    /// when the kernel has no such tracepoint.
    pub fn tracepoint_args(&self, name: &str) -> Option<usize> {
        let typedef = format!("btf_trace_{name}");
        let t = self
            .types
            .iter()
            .find(|t| t.kind == KIND_TYPEDEF && self.name(t.name_off) == typedef)?;
        let ptr = self.types.get(t.type_ref as usize)?;
        if ptr.kind != KIND_PTR {
            return None;
        }
        let proto = self.types.get(ptr.type_ref as usize)?;
        if proto.kind != KIND_FUNC_PROTO {
            return None;
        }
        proto.members.len().checked_sub(1)
    }

    /// Offset of a dotted member path (`"thread_info.cpu"`) in struct `strukt`.
    pub fn offset_of(&self, strukt: &str, path: &str) -> Option<u32> {
        let mut ty = self.types.get(self.struct_id(strukt)? as usize)?;
        let mut total: u32 = 0;
        let parts: Vec<&str> = path.split('.').collect();
        let mut budget = MAX_VISITS;
        for (i, part) in parts.iter().enumerate() {
            total = total.checked_add(self.member_offset(ty, part, 0, &mut budget)?)?;
            if i + 1 < parts.len() {
                ty = self.member_type(ty, part, 0, &mut budget)?;
            }
        }
        Some(total)
    }
}

/// The `task_struct` offsets the kernel programs need.
pub fn task_offsets(btf: &Btf) -> Result<TaskOffsets, BtfError> {
    let field = |path: &str| {
        btf.offset_of("task_struct", path)
            .ok_or_else(|| BtfError::MissingField(format!("task_struct.{path}")))
    };
    let optional =
        |strukt: &str, path: &str| btf.offset_of(strukt, path).unwrap_or(TaskOffsets::ABSENT);
    Ok(TaskOffsets {
        pid: field("pid")?,
        tgid: field("tgid")?,
        prio: field("prio")?,
        comm: field("comm")?,
        cpu: btf
            .offset_of("task_struct", "thread_info.cpu")
            .or_else(|| btf.offset_of("task_struct", "cpu"))
            .unwrap_or(TaskOffsets::ABSENT),
        // Only the crash detector needs it: its absence is not an error.
        exit_code: optional("task_struct", "exit_code"),
        // Only stacks inside return-probed calls need these (the real
        // return addresses behind the uretprobe trampoline): optional.
        utask: optional("task_struct", "utask"),
        return_instances: optional("uprobe_task", "return_instances"),
        ri_stack: optional("return_instance", "stack"),
        ri_orig_ret_vaddr: optional("return_instance", "orig_ret_vaddr"),
        ri_next: optional("return_instance", "next"),
        // Only kernels before 6.16 need these (whether an exit is its
        // process's last): optional.
        signal: optional("task_struct", "signal"),
        signal_live: optional("signal_struct", "live"),
        // Only kernels before 5.18 need it (no `prev_state` on
        // sched_switch): optional.
        state: optional("task_struct", "__state"),
    })
}

/// A BTF blob of `types` (the encoded type section) and `strings`, for
/// tests that build one by hand.
#[cfg(test)]
pub(crate) fn test_blob(types: &[u8], strings: &[u8]) -> Vec<u8> {
    let mut blob = BTF_MAGIC.to_le_bytes().to_vec();
    blob.extend_from_slice(&[1, 0]);
    for w in [
        HEADER_LEN as u32,
        0,
        types.len() as u32,
        types.len() as u32,
        strings.len() as u32,
    ] {
        blob.extend_from_slice(&w.to_le_bytes());
    }
    blob.extend_from_slice(types);
    blob.extend_from_slice(strings);
    blob
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a tiny BTF blob: int, struct inner { int a; int cpu; },
    /// struct task_struct { int x; union { int pid; }; int tgid; struct inner thread_info; }.
    fn sample() -> Vec<u8> {
        let mut strings =
            b"\0int\0inner\0a\0cpu\0task_struct\0x\0pid\0tgid\0thread_info\0".to_vec();
        strings.push(0);
        let s = |name: &str| {
            let hay = b"\0int\0inner\0a\0cpu\0task_struct\0x\0pid\0tgid\0thread_info\0";
            let pos = hay
                .windows(name.len() + 1)
                .position(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0)
                .unwrap();
            pos as u32
        };
        let mut types = Vec::new();
        let mut push = |words: &[u32]| {
            for w in words {
                types.extend_from_slice(&w.to_le_bytes());
            }
        };
        // 1: int
        push(&[s("int"), 1 << 24, 4, 32]);
        // 2: struct inner { a@0, cpu@32bits }
        push(&[s("inner"), (KIND_STRUCT << 24) | 2, 8]);
        push(&[s("a"), 1, 0, s("cpu"), 1, 32]);
        // 3: anonymous union { pid }
        push(&[0, (KIND_UNION << 24) | 1, 4]);
        push(&[s("pid"), 1, 0]);
        // 4: struct task_struct
        push(&[s("task_struct"), (KIND_STRUCT << 24) | 4, 20]);
        push(&[
            s("x"),
            1,
            0,
            0,
            3,
            32,
            s("tgid"),
            1,
            64,
            s("thread_info"),
            2,
            96,
        ]);
        test_blob(&types, &strings)
    }

    #[test]
    fn finds_nested_and_anonymous_members() {
        let btf = Btf::parse(&sample()).unwrap();
        assert_eq!(btf.offset_of("task_struct", "x"), Some(0));
        assert_eq!(
            btf.offset_of("task_struct", "pid"),
            Some(4),
            "through the anonymous union"
        );
        assert_eq!(btf.offset_of("task_struct", "tgid"), Some(8));
        assert_eq!(btf.offset_of("task_struct", "thread_info.cpu"), Some(16));
        assert_eq!(btf.offset_of("task_struct", "nope"), None);
        assert!(
            matches!(task_offsets(&btf), Err(BtfError::MissingField(f)) if f == "task_struct.prio")
        );
    }

    fn not_btf(d: &[u8]) -> String {
        match Btf::parse(d) {
            Err(ParseError::NotBtf(what)) => what,
            Err(e) => panic!("{d:02x?}: {e:?}"),
            Ok(_) => panic!("{d:02x?} parsed"),
        }
    }

    #[test]
    fn garbage_is_named_as_not_btf() {
        assert_eq!(
            not_btf(b"not btf at all, not even close"),
            "it starts with bytes 6e 6f 74 20, not the BTF magic 9f eb"
        );
        assert_eq!(not_btf(b""), "it is empty");
        assert!(not_btf(b"\x7fELF\x02\x01").contains("ELF file"));
        assert!(not_btf(&[0xeb, 0x9f, 1, 0]).contains("big-endian"));
        assert!(not_btf(&[0x9f, 0xeb, 1, 0]).contains("shorter than a BTF header"));
        // Sections past the end: valid magic, damaged file.
        let mut cut = sample();
        cut.truncate(cut.len() - 10);
        assert!(
            matches!(Btf::parse(&cut), Err(ParseError::Malformed(w)) if w.contains("string section")),
        );
    }

    #[test]
    fn file_errors_name_the_file_and_the_problem() {
        let dir = std::env::temp_dir().join(format!("xpuscope-btf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("no-such.btf");
        let msg = Btf::from_file(&missing).err().unwrap().to_string();
        assert!(
            msg.contains(&format!(
                "the BTF file {} does not exist",
                missing.display()
            )) && !msg.contains("this kernel exposes no BTF"),
            "{msg}"
        );
        let garbage = dir.join("garbage.btf");
        std::fs::write(&garbage, b"hello, world").unwrap();
        let msg = Btf::from_file(&garbage).err().unwrap().to_string();
        assert_eq!(
            msg,
            format!(
                "{} is not a BTF file: it starts with bytes 68 65 6c 6c, not the BTF magic 9f eb",
                garbage.display()
            )
        );
        // A directory: the OS error is the source, not repeated in the message.
        let err = Btf::from_file(&dir).err().unwrap();
        assert_eq!(
            err.to_string(),
            format!("cannot read the BTF file {}", dir.display())
        );
        assert!(std::error::Error::source(&err).is_some());
        std::fs::remove_dir_all(&dir).unwrap();
        // The kernel's own path keeps the kernel-level explanation.
        let err = BtfError::NoKernelBtf {
            path: PathBuf::from(VMLINUX_BTF),
        };
        assert!(err.to_string().contains("CONFIG_DEBUG_INFO_BTF"));
    }

    #[test]
    fn anonymous_members_fanning_out_end_quickly() {
        // Found by `cargo xtask fuzz btf` (a libFuzzer timeout): structs
        // whose anonymous members point at each other, 32 levels deep.
        let blob = include_bytes!("../../tests/fuzz/corpus/btf/timeout-anonymous-fanout");
        let btf = Btf::parse(blob).unwrap();
        // Before the visit budget this call did not return for minutes.
        let result = task_offsets(&btf);
        assert!(
            matches!(result, Err(BtfError::MissingField(_))),
            "{result:?}"
        );
    }

    #[test]
    fn a_struct_containing_itself_anonymously_ends() {
        // struct task_struct { <anonymous> struct task_struct; } (type 1).
        let strings = b"\0task_struct\0".to_vec();
        let mut types = Vec::new();
        for w in [1u32, (KIND_STRUCT << 24) | 1, 8, 0, 1, 0] {
            types.extend_from_slice(&w.to_le_bytes());
        }
        let btf = Btf::parse(&test_blob(&types, &strings)).unwrap();
        assert_eq!(btf.offset_of("task_struct", "pid"), None);
        assert_eq!(btf.offset_of("task_struct", "a.b"), None);
    }

    #[test]
    fn running_kernel_offsets_are_plausible() {
        // Every machine this project runs on has BTF (the agent needs it).
        let btf = Btf::from_file(Path::new(VMLINUX_BTF)).expect("kernel BTF");
        let off = task_offsets(&btf).expect("task_struct fields");
        assert_eq!(
            off.tgid,
            off.pid + 4,
            "pid and tgid are adjacent pid_t fields"
        );
        assert!(off.comm > off.tgid && off.prio > 0);
        assert_ne!(off.cpu, TaskOffsets::ABSENT);
        assert_ne!(off.exit_code, TaskOffsets::ABSENT, "task_struct.exit_code");
    }
}
