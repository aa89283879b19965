//! The device-call programs as uprobe-multi programs: one link per library
//! file and program end instead of one perf event per function.
//!
//! Why: the kernel releases a perf-event uprobe one at a time, each waiting
//! for an RCU tasks-trace grace period under a kernel-wide mutex (about
//! 90 ms on 6.18), so the ~90 probes of one rank take seconds to go away,
//! and an agent starting meanwhile waits behind them. A uprobe-multi link
//! (Linux 6.6) unregisters all of its uprobes and then waits once.
//!
//! aya 0.14 loads uprobe programs without the expected attach type the
//! kernel requires of a uprobe-multi program (`BPF_TRACE_UPROBE_MULTI`), so
//! the two programs are loaded a second time here, from the same embedded
//! object, with the maps aya created: [`link_program`] resolves the
//! program's map references to those maps' descriptors and appends the
//! functions it calls, and [`load`] and [`attach`] are the two `bpf(2)`
//! commands. Anything the linker does not understand is an error, and the
//! caller falls back to aya's perf-event uprobes (so do kernels before 6.6,
//! which reject the attach type).

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use object::{Object, ObjectSection, ObjectSymbol, RelocationFlags, RelocationTarget};

/// One eBPF instruction (struct bpf_insn): 8 bytes.
const INSN: usize = 8;
/// `BPF_LD | BPF_IMM | BPF_DW`: the first half of a 64-bit immediate load.
const LD_IMM64: u8 = 0x18;
/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = 0x85;
/// `src_reg` of a call to another eBPF function (not a helper).
const PSEUDO_CALL: u8 = 1;
/// `src_reg` of a 64-bit load whose immediate is a map's descriptor.
const PSEUDO_MAP_FD: u8 = 1;
/// ELF relocation types of the BPF target.
const R_BPF_64_64: u32 = 1;
const R_BPF_64_32: u32 = 10;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const BPF_TRACE_UPROBE_MULTI: u32 = 48;
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;

/// Why a program could not be linked from the object.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("the eBPF object does not parse: {0}")]
    Object(#[from] object::Error),
    #[error("no program {0} in the eBPF object")]
    NoProgram(String),
    #[error("{0}: {1}")]
    Unsupported(String, String),
}

/// A program's instructions, ready for `BPF_PROG_LOAD`.
#[derive(Debug)]
pub struct LinkedProgram {
    pub insns: Vec<[u8; INSN]>,
    pub license: CString,
}

/// A function of the object: its section and byte range there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Function {
    section: object::SectionIndex,
    start: u64,
    size: u64,
}

/// Links `name` from the eBPF object `elf`: each map reference becomes a
/// load of the descriptor `map_fd` gives for that map's name, and every
/// function it calls (transitively) is appended after it, calls pointing
/// at the copies.
pub fn link_program(
    elf: &[u8],
    name: &str,
    map_fd: &dyn Fn(&str) -> Option<RawFd>,
) -> Result<LinkedProgram, LinkError> {
    let file = object::File::parse(elf)?;
    let unsupported = |what: String| LinkError::Unsupported(name.to_string(), what);
    let function_at = |section: object::SectionIndex, offset: u64| -> Option<Function> {
        file.symbols().find_map(|s| {
            (s.kind() == object::SymbolKind::Text
                && s.section_index() == Some(section)
                && s.address() == offset
                && s.size() > 0)
                .then(|| Function {
                    section,
                    start: offset,
                    size: s.size(),
                })
        })
    };
    let main = file
        .symbols()
        .find(|s| s.name() == Ok(name) && s.kind() == object::SymbolKind::Text)
        .and_then(|s| {
            Some(Function {
                section: s.section_index()?,
                start: s.address(),
                size: s.size(),
            })
        })
        .ok_or_else(|| LinkError::NoProgram(name.to_string()))?;

    let mut insns: Vec<[u8; INSN]> = Vec::new();
    // Where each appended function starts, in instructions.
    let mut placed: HashMap<Function, usize> = HashMap::new();
    let mut queue = vec![main];
    // (instruction index of a call, the function it calls).
    let mut calls: Vec<(usize, Function)> = Vec::new();
    while let Some(func) = queue.pop() {
        if placed.contains_key(&func) {
            continue;
        }
        let section = file.section_by_index(func.section)?;
        let data = section.data()?;
        let bytes = usize::try_from(func.start)
            .ok()
            .zip(usize::try_from(func.start + func.size).ok())
            .and_then(|(a, b)| data.get(a..b))
            .filter(|b| b.len() % INSN == 0)
            .ok_or_else(|| unsupported(format!("function at {:#x} out of bounds", func.start)))?;
        let base = insns.len();
        placed.insert(func, base);
        insns.extend(bytes.chunks_exact(INSN).map(|c| {
            let mut i = [0u8; INSN];
            i.copy_from_slice(c);
            i
        }));
        let relocations: HashMap<u64, (RelocationTarget, u32)> = section
            .relocations()
            .filter(|(off, _)| (func.start..func.start + func.size).contains(off))
            .map(|(off, r)| {
                let kind = match r.flags() {
                    RelocationFlags::Elf { r_type } => r_type,
                    _ => 0,
                };
                (off, (r.target(), kind))
            })
            .collect();
        for k in 0..bytes.len() / INSN {
            let at = base + k;
            let offset = func.start + (k * INSN) as u64;
            let code = insns[at][0];
            let src = insns[at][1] >> 4;
            let imm = i32::from_le_bytes(insns[at][4..8].try_into().unwrap());
            match relocations.get(&offset) {
                Some((RelocationTarget::Symbol(idx), R_BPF_64_64)) => {
                    let sym = file.symbol_by_index(*idx)?;
                    let map = sym.name()?;
                    let in_maps = sym
                        .section_index()
                        .and_then(|i| file.section_by_index(i).ok())
                        .is_some_and(|s| matches!(s.name(), Ok("maps" | ".maps")));
                    if !in_maps {
                        return Err(unsupported(format!("a reference to {map:?}, not a map")));
                    }
                    if code != LD_IMM64 {
                        return Err(unsupported(format!("map {map} outside a 64-bit load")));
                    }
                    let fd =
                        map_fd(map).ok_or_else(|| unsupported(format!("no map named {map:?}")))?;
                    insns[at][1] = (insns[at][1] & 0x0f) | (PSEUDO_MAP_FD << 4);
                    insns[at][4..8].copy_from_slice(&fd.to_le_bytes());
                }
                Some((RelocationTarget::Symbol(idx), R_BPF_64_32)) if code == CALL => {
                    let sym = file.symbol_by_index(*idx)?;
                    let target_section = sym
                        .section_index()
                        .ok_or_else(|| unsupported("a call to an undefined function".into()))?;
                    // A section symbol is followed by a pc-relative offset;
                    // a function symbol is the callee itself.
                    let target = if sym.kind() == object::SymbolKind::Section {
                        relative(sym.address(), imm)
                    } else {
                        Some(sym.address())
                    }
                    .ok_or_else(|| unsupported("a call before its section".into()))?;
                    let callee = function_at(target_section, target)
                        .ok_or_else(|| unsupported(format!("no function at {target:#x}")))?;
                    calls.push((at, callee));
                    queue.push(callee);
                }
                Some((_, kind)) => {
                    return Err(unsupported(format!(
                        "relocation type {kind} at {offset:#x}"
                    )));
                }
                None if code == CALL && src == PSEUDO_CALL => {
                    // A call within the section, relative to the next instruction.
                    let target = relative(offset, imm)
                        .ok_or_else(|| unsupported("a call before its section".into()))?;
                    let callee = function_at(func.section, target)
                        .ok_or_else(|| unsupported(format!("no function at {target:#x}")))?;
                    calls.push((at, callee));
                    queue.push(callee);
                }
                None => {}
            }
        }
    }
    for (at, callee) in calls {
        let to = placed[&callee] as i64 - (at as i64 + 1);
        let imm = i32::try_from(to).map_err(|_| unsupported("a call too far".into()))?;
        insns[at][1] = (insns[at][1] & 0x0f) | (PSEUDO_CALL << 4);
        insns[at][4..8].copy_from_slice(&imm.to_le_bytes());
    }
    let license = file
        .section_by_name("license")
        .and_then(|s| s.data().ok())
        .map(|d| d.split(|b| *b == 0).next().unwrap_or_default().to_vec())
        .filter(|l| !l.is_empty())
        .ok_or_else(|| unsupported("no license section".into()))?;
    Ok(LinkedProgram {
        insns,
        license: CString::new(license).map_err(|_| unsupported("bad license".into()))?,
    })
}

/// The byte offset a call's `imm` points at: `imm + 1` instructions after
/// `base` (the call itself, or the section symbol it is relative to), or
/// `None` before the section's start.
fn relative(base: u64, imm: i32) -> Option<u64> {
    let target = base as i64 + (i64::from(imm) + 1) * INSN as i64;
    u64::try_from(target).ok()
}

fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a union bpf_attr prefix of the length passed; the
    // pointers inside it outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as RawFd) })
}

fn put_u32(attr: &mut [u8], at: usize, v: u32) {
    attr[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(attr: &mut [u8], at: usize, v: u64) {
    attr[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Loads `program` as a uprobe-multi program. The verifier's log is read
/// on failure only (a second load with a log buffer).
pub fn load(name: &str, program: &LinkedProgram) -> io::Result<OwnedFd> {
    let try_load = |log: Option<&mut Vec<u8>>| {
        // union bpf_attr, the BPF_PROG_LOAD part up to expected_attach_type.
        let mut attr = [0u8; 72];
        put_u32(&mut attr, 0, BPF_PROG_TYPE_KPROBE);
        put_u32(&mut attr, 4, program.insns.len() as u32);
        put_u64(&mut attr, 8, program.insns.as_ptr() as u64);
        put_u64(&mut attr, 16, program.license.as_ptr() as u64);
        if let Some(log) = log {
            put_u32(&mut attr, 24, 1);
            put_u32(&mut attr, 28, log.len() as u32);
            put_u64(&mut attr, 32, log.as_mut_ptr() as u64);
        }
        let short: Vec<u8> = name.bytes().take(15).collect();
        attr[48..48 + short.len()].copy_from_slice(&short);
        put_u32(&mut attr, 68, BPF_TRACE_UPROBE_MULTI);
        bpf(BPF_PROG_LOAD, &mut attr)
    };
    try_load(None).map_err(|e| {
        let mut log = vec![0u8; 1 << 20];
        if try_load(Some(&mut log)).is_err() {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let tail: Vec<&str> = text.lines().rev().take(8).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            if !tail.is_empty() {
                return io::Error::new(e.kind(), format!("{e}; verifier: {}", tail.join(" | ")));
            }
        }
        e
    })
}

/// Attaches `program` at every `(offset, cookie)` of the file at `path`,
/// for all processes, as one link (`ret`: at the functions' returns).
pub fn attach(
    program: BorrowedFd<'_>,
    path: &str,
    sites: &[(u64, u64)],
    ret: bool,
) -> io::Result<OwnedFd> {
    let path = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let offsets: Vec<u64> = sites.iter().map(|s| s.0).collect();
    let cookies: Vec<u64> = sites.iter().map(|s| s.1).collect();
    // union bpf_attr, the BPF_LINK_CREATE part up to uprobe_multi.pid.
    let mut attr = [0u8; 64];
    put_u32(&mut attr, 0, program.as_raw_fd() as u32);
    put_u32(&mut attr, 8, BPF_TRACE_UPROBE_MULTI);
    put_u64(&mut attr, 16, path.as_ptr() as u64);
    put_u64(&mut attr, 24, offsets.as_ptr() as u64);
    put_u64(&mut attr, 40, cookies.as_ptr() as u64);
    put_u32(&mut attr, 48, sites.len() as u32);
    put_u32(
        &mut attr,
        52,
        if ret { BPF_F_UPROBE_MULTI_RETURN } else { 0 },
    );
    bpf(BPF_LINK_CREATE, &mut attr)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(feature = "root-tests")]
    use crate::kernel::object::EBPF_OBJECT;
    #[cfg(feature = "root-tests")]
    use crate::kernel::probes::attach::{ENTRY_PROGRAM, RETURN_PROGRAM};

    #[cfg(feature = "root-tests")]
    fn insn_fields(i: &[u8; INSN]) -> (u8, u8, i32) {
        (
            i[0],
            i[1] >> 4,
            i32::from_le_bytes(i[4..8].try_into().unwrap()),
        )
    }

    /// Both device-call programs link from the real object: every map
    /// reference gets the descriptor of the map it names, every call of
    /// another function lands on the first instruction of an appended copy,
    /// and the program proper comes first. (In the root tier: it needs the
    /// built eBPF object, which `cargo xtask test` builds.)
    #[cfg(feature = "root-tests")]
    #[test]
    fn the_device_call_programs_link_from_the_object() {
        if EBPF_OBJECT.is_empty() {
            panic!("the eBPF object is not built: run `cargo xtask build-ebpf`");
        }
        let fd_of = |m: &str| -> Option<RawFd> {
            // Any map name the object uses gets a distinct fake descriptor.
            Some(1000 + m.bytes().map(i32::from).sum::<i32>())
        };
        let mut all_calls = 0;
        for name in [ENTRY_PROGRAM, RETURN_PROGRAM] {
            let p = link_program(EBPF_OBJECT, name, &fd_of).expect(name);
            let file = object::File::parse(EBPF_OBJECT).unwrap();
            let own = file
                .symbols()
                .find(|s| s.name() == Ok(name))
                .map(|s| s.size() as usize / INSN)
                .unwrap();
            assert_eq!(p.license.to_str().unwrap(), "GPL");
            let mut map_loads = 0;
            let mut calls = 0;
            for (k, i) in p.insns.iter().enumerate() {
                let (code, src, imm) = insn_fields(i);
                if code == LD_IMM64 && src == PSEUDO_MAP_FD {
                    map_loads += 1;
                    assert!(imm >= 1000, "insn {k}: map fd {imm}");
                }
                if code == CALL && src == PSEUDO_CALL {
                    calls += 1;
                    // Calls land on an appended copy, after the program.
                    let to = k as i64 + 1 + i64::from(imm);
                    assert!(
                        to >= own as i64 && (to as usize) < p.insns.len(),
                        "{name}: call {k} -> {to}"
                    );
                }
            }
            assert!(map_loads >= 5, "{name}: {map_loads} map loads");
            all_calls += calls;
            let specs = fd_of("UPROBE_SPECS").unwrap();
            assert!(
                p.insns
                    .iter()
                    .any(|i| insn_fields(i) == (LD_IMM64, PSEUDO_MAP_FD, specs)),
                "{name} reads UPROBE_SPECS"
            );
        }
        // The entry program calls memset (a function of `.text`): the
        // appending is exercised.
        assert!(all_calls >= 1);
    }

    /// A map the agent did not create is an error naming it, not a load
    /// of descriptor 0.
    #[cfg(feature = "root-tests")]
    #[test]
    fn an_unknown_map_is_an_error() {
        if EBPF_OBJECT.is_empty() {
            panic!("the eBPF object is not built: run `cargo xtask build-ebpf`");
        }
        let err =
            link_program(EBPF_OBJECT, ENTRY_PROGRAM, &|m| (m != "DROPS").then_some(7)).unwrap_err();
        assert!(err.to_string().contains("DROPS"), "{err}");
        assert!(matches!(
            link_program(EBPF_OBJECT, "no_such_program", &|_| Some(7)),
            Err(LinkError::NoProgram(_))
        ));
    }

    #[test]
    fn relative_offsets_count_instructions_after_the_call() {
        // A call at byte 16 with imm 2 lands at byte 16 + 8 + 16 = 40.
        assert_eq!(relative(16, 2), Some(40));
        assert_eq!(relative(0, -2), None);
    }
}
