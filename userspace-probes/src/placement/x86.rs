//! A small x86-64 decoder for the instructions functions start with:
//! enough to name them as objdump does, know their length, what they
//! write, and whether the kernel emulates a uprobe on them. Anything else
//! decodes as unknown (`len: None`), which placement never moves past.

use super::ProbeCost;

/// General-purpose registers, in x86 encoding order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Reg {
    Rax = 0,
    Rcx,
    Rdx,
    Rbx,
    Rsp,
    Rbp,
    Rsi,
    Rdi,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
}

impl Reg {
    const ALL: [Reg; 16] = [
        Reg::Rax,
        Reg::Rcx,
        Reg::Rdx,
        Reg::Rbx,
        Reg::Rsp,
        Reg::Rbp,
        Reg::Rsi,
        Reg::Rdi,
        Reg::R8,
        Reg::R9,
        Reg::R10,
        Reg::R11,
        Reg::R12,
        Reg::R13,
        Reg::R14,
        Reg::R15,
    ];

    fn from_num(n: u8) -> Reg {
        Reg::ALL[(n & 15) as usize]
    }

    /// System V integer argument register `i` (0 = rdi ... 5 = r9); any
    /// other index maps to rsp, which is never skipped over anyway.
    pub fn arg(i: u8) -> Reg {
        match i {
            0 => Reg::Rdi,
            1 => Reg::Rsi,
            2 => Reg::Rdx,
            3 => Reg::Rcx,
            4 => Reg::R8,
            5 => Reg::R9,
            _ => Reg::Rsp,
        }
    }
}

/// A set of [`Reg`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RegSet(u16);

impl RegSet {
    pub const EMPTY: RegSet = RegSet(0);

    pub const fn with(self, r: Reg) -> RegSet {
        RegSet(self.0 | 1 << r as u8)
    }

    pub fn contains(self, r: Reg) -> bool {
        self.0 & (1 << r as u8) != 0
    }

    pub fn intersects(self, other: RegSet) -> bool {
        self.0 & other.0 != 0
    }
}

/// One decoded instruction (the few forms function prologues use).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Insn {
    /// Length in bytes, when known.
    pub len: Option<usize>,
    /// AT&T syntax, as objdump prints it (immediates and targets in hex).
    pub text: String,
    pub cost: ProbeCost,
    pub(super) kind: Kind,
    effect: Effect,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Endbr64,
    Push(Reg),
    Pop(Reg),
    MovRegReg { dst: Reg, src: Reg },
    Jmp(u64),
    Other,
}

/// What executing the instruction changes, for the skip rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    /// Flags at most (endbr64, nop, test, cmp).
    Nothing,
    /// These registers (and flags), nothing else.
    Writes(RegSet),
    /// Control flow, stack, memory stores, or unknown.
    Unsafe,
}

impl Insn {
    pub(super) fn skippable(&self, reads: RegSet) -> bool {
        match self.effect {
            Effect::Nothing => true,
            Effect::Writes(w) => !w.intersects(reads) && !w.contains(Reg::Rsp),
            Effect::Unsafe => false,
        }
    }

    fn unknown(code: &[u8]) -> Insn {
        let bytes: Vec<String> = code.iter().take(4).map(|b| format!("{b:02x}")).collect();
        Insn {
            len: None,
            text: if bytes.is_empty() {
                "(none)".to_string()
            } else {
                format!("(bytes {})", bytes.join(" "))
            },
            cost: ProbeCost::SingleStepped,
            kind: Kind::Other,
            effect: Effect::Unsafe,
        }
    }
}

const REG64: [&str; 16] = [
    "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15",
];
const REG32: [&str; 16] = [
    "eax", "ecx", "edx", "ebx", "esp", "ebp", "esi", "edi", "r8d", "r9d", "r10d", "r11d", "r12d",
    "r13d", "r14d", "r15d",
];
const REG16: [&str; 16] = [
    "ax", "cx", "dx", "bx", "sp", "bp", "si", "di", "r8w", "r9w", "r10w", "r11w", "r12w", "r13w",
    "r14w", "r15w",
];
const REG8: [&str; 16] = [
    "al", "cl", "dl", "bl", "spl", "bpl", "sil", "dil", "r8b", "r9b", "r10b", "r11b", "r12b",
    "r13b", "r14b", "r15b",
];
const CC: [&str; 16] = [
    "o", "no", "b", "ae", "e", "ne", "be", "a", "s", "ns", "p", "np", "l", "ge", "le", "g",
];

fn reg_name(n: u8, size: u8) -> String {
    let n = (n & 15) as usize;
    let name = match size {
        8 => REG64[n],
        4 => REG32[n],
        2 => REG16[n],
        _ => REG8[n],
    };
    format!("%{name}")
}

fn hex(v: i64) -> String {
    if v < 0 {
        format!("-{:#x}", v.unsigned_abs())
    } else {
        format!("{v:#x}")
    }
}

/// A bounds-checked little-endian cursor over the instruction bytes.
struct Cursor<'a> {
    code: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn u8(&mut self) -> Option<u8> {
        let b = *self.code.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    fn imm(&mut self, bytes: usize) -> Option<i64> {
        let s = self.code.get(self.pos..self.pos + bytes)?;
        self.pos += bytes;
        Some(match bytes {
            1 => s[0] as i8 as i64,
            2 => i16::from_le_bytes([s[0], s[1]]) as i64,
            4 => i32::from_le_bytes([s[0], s[1], s[2], s[3]]) as i64,
            _ => i64::from_le_bytes(s.try_into().ok()?),
        })
    }
}

/// A decoded ModRM operand.
struct ModRm {
    /// The `reg` field with REX.R.
    reg: u8,
    /// The register operand when `mod == 3`.
    rm_reg: Option<u8>,
    /// AT&T text of the r/m operand (memory form), empty for registers.
    mem: String,
}

fn modrm(c: &mut Cursor<'_>, rex: u8) -> Option<ModRm> {
    let b = c.u8()?;
    let (md, reg, rm) = (b >> 6, ((b >> 3) & 7) | (rex & 4) << 1, b & 7);
    if md == 3 {
        return Some(ModRm {
            reg,
            rm_reg: Some(rm | (rex & 1) << 3),
            mem: String::new(),
        });
    }
    let mut base = Some(rm | (rex & 1) << 3);
    let mut index = None;
    let mut scale = 1;
    let mut rip = false;
    if rm == 4 {
        let sib = c.u8()?;
        scale = 1 << (sib >> 6);
        let idx = ((sib >> 3) & 7) | (rex & 2) << 2;
        if idx != 4 {
            index = Some(idx);
        }
        base = Some((sib & 7) | (rex & 1) << 3);
        if sib & 7 == 5 && md == 0 {
            base = None;
        }
    } else if rm == 5 && md == 0 {
        rip = true;
        base = None;
    }
    let disp = match md {
        1 => c.imm(1)?,
        2 => c.imm(4)?,
        _ if rip || base.is_none() => c.imm(4)?,
        _ => 0,
    };
    let mut mem = String::new();
    if md != 0 || rip || base.is_none() {
        mem.push_str(&hex(disp));
    }
    if rip {
        mem.push_str("(%rip)");
    } else if base.is_some() || index.is_some() {
        mem.push('(');
        if let Some(b) = base {
            mem.push_str(&reg_name(b, 8));
        }
        if let Some(i) = index {
            mem.push_str(&format!(",{},{scale}", reg_name(i, 8)));
        }
        mem.push(')');
    }
    Some(ModRm {
        reg,
        rm_reg: None,
        mem,
    })
}

impl ModRm {
    fn rm_text(&self, size: u8) -> String {
        match self.rm_reg {
            Some(r) => reg_name(r, size),
            None => self.mem.clone(),
        }
    }
}

/// Decodes the instruction at the start of `code` (at address `addr`).
/// Unknown or truncated encodings come back with `len: None`.
pub fn decode(code: &[u8], addr: u64) -> Insn {
    decode_known(code, addr).unwrap_or_else(|| Insn::unknown(code))
}

fn decode_known(code: &[u8], addr: u64) -> Option<Insn> {
    if code.starts_with(&[0xf3, 0x0f, 0x1e, 0xfa]) {
        return Some(insn(
            4,
            "endbr64".into(),
            ProbeCost::SingleStepped,
            Kind::Endbr64,
            Effect::Nothing,
        ));
    }
    let mut c = Cursor { code, pos: 0 };
    let mut opsize16 = false;
    let mut prefixes = 0;
    let mut b = c.u8()?;
    while matches!(
        b,
        0x66 | 0xf2 | 0xf3 | 0x2e | 0x3e | 0x26 | 0x36 | 0x64 | 0x65 | 0xf0
    ) {
        opsize16 |= b == 0x66;
        prefixes += 1;
        if prefixes > 4 {
            return None;
        }
        b = c.u8()?;
    }
    let rex = if (0x40..=0x4f).contains(&b) {
        let r = b;
        b = c.u8()?;
        r
    } else {
        0
    };
    let w = rex & 8 != 0;
    let size: u8 = if w {
        8
    } else if opsize16 {
        2
    } else {
        4
    };
    let op = b;
    let single = ProbeCost::SingleStepped;
    let writes = |r: u8| {
        let r = Reg::from_num(r);
        if r == Reg::Rsp {
            Effect::Unsafe
        } else {
            Effect::Writes(RegSet::EMPTY.with(r))
        }
    };
    let out = match op {
        0x50..=0x57 => {
            let r = Reg::from_num((op - 0x50) | (rex & 1) << 3);
            // The kernel emulates `push` only without prefixes, or with a
            // lone REX.B (0x41) for r8..r15.
            let emulated = prefixes == 0 && (rex == 0 || rex == 0x41);
            let cost = if emulated {
                ProbeCost::Emulated
            } else {
                single
            };
            insn(
                c.pos,
                format!("push %{}", REG64[r as usize]),
                cost,
                Kind::Push(r),
                Effect::Unsafe,
            )
        }
        0x58..=0x5f => {
            let r = Reg::from_num((op - 0x58) | (rex & 1) << 3);
            insn(
                c.pos,
                format!("pop %{}", REG64[r as usize]),
                single,
                Kind::Pop(r),
                Effect::Unsafe,
            )
        }
        0x90 if rex & 1 == 0 => insn(
            c.pos,
            "nop".into(),
            ProbeCost::Emulated,
            Kind::Other,
            Effect::Nothing,
        ),
        0x0f => {
            let op2 = c.u8()?;
            match op2 {
                0x1f => {
                    let m = modrm(&mut c, rex)?;
                    if m.reg & 7 != 0 {
                        return None;
                    }
                    let cost = if c.pos == 5 && code.starts_with(&[0x0f, 0x1f, 0x44, 0x00, 0x00]) {
                        ProbeCost::Optimized
                    } else {
                        ProbeCost::Emulated
                    };
                    let suffix = if opsize16 { 'w' } else { 'l' };
                    insn(
                        c.pos,
                        format!("nop{suffix} {}", m.rm_text(size)),
                        cost,
                        Kind::Other,
                        Effect::Nothing,
                    )
                }
                0x80..=0x8f => {
                    let rel = c.imm(4)?;
                    let target = addr.wrapping_add(c.pos as u64).wrapping_add(rel as u64);
                    let cost = if opsize16 {
                        single
                    } else {
                        ProbeCost::Emulated
                    };
                    insn(
                        c.pos,
                        format!("j{} {target:#x}", CC[(op2 & 15) as usize]),
                        cost,
                        Kind::Other,
                        Effect::Unsafe,
                    )
                }
                0xb6 | 0xb7 | 0xbe | 0xbf => {
                    let m = modrm(&mut c, rex)?;
                    let src = if op2 & 1 == 0 { 1 } else { 2 };
                    let name = format!(
                        "mov{}{}{}",
                        if op2 >= 0xbe { 's' } else { 'z' },
                        if src == 1 { 'b' } else { 'w' },
                        if w { 'q' } else { 'l' }
                    );
                    let text = format!("{name} {},{}", m.rm_text(src), reg_name(m.reg, size));
                    insn(c.pos, text, single, Kind::Other, writes(m.reg))
                }
                _ => return None,
            }
        }
        0x70..=0x7f | 0xeb | 0xe9 | 0xe8 => {
            let rel = c.imm(if op == 0xe9 || op == 0xe8 { 4 } else { 1 })?;
            let target = addr.wrapping_add(c.pos as u64).wrapping_add(rel as u64);
            let (name, kind) = match op {
                0xe8 => ("call".to_string(), Kind::Other),
                0xe9 | 0xeb => ("jmp".to_string(), Kind::Jmp(target)),
                _ => (format!("j{}", CC[(op & 15) as usize]), Kind::Other),
            };
            let cost = if opsize16 {
                single
            } else {
                ProbeCost::Emulated
            };
            insn(
                c.pos,
                format!("{name} {target:#x}"),
                cost,
                kind,
                Effect::Unsafe,
            )
        }
        0xc3 => insn(c.pos, "ret".into(), single, Kind::Other, Effect::Unsafe),
        0xb8..=0xbf => {
            let r = (op - 0xb8) | (rex & 1) << 3;
            let imm = c.imm(if w {
                8
            } else if opsize16 {
                2
            } else {
                4
            })?;
            let name = if w { "movabs" } else { "mov" };
            insn(
                c.pos,
                format!("{name} ${},{}", imm_text(imm, size), reg_name(r, size)),
                single,
                Kind::Other,
                writes(r),
            )
        }
        0xc7 => {
            let m = modrm(&mut c, rex)?;
            if m.reg & 7 != 0 {
                return None;
            }
            let imm = c.imm(if opsize16 { 2 } else { 4 })?;
            let (text, effect) = match m.rm_reg {
                Some(r) => (
                    format!("mov ${},{}", imm_text(imm, size), reg_name(r, size)),
                    writes(r),
                ),
                None => (
                    format!("mov{} ${},{}", suffix(size), imm_text(imm, size), m.mem),
                    Effect::Unsafe,
                ),
            };
            insn(c.pos, text, single, Kind::Other, effect)
        }
        // ALU r/m, r and r, r/m: add or and sub xor (and cmp, which only sets flags).
        0x00..=0x03 | 0x08..=0x0b | 0x20..=0x23 | 0x28..=0x2b | 0x30..=0x33 | 0x38..=0x3b => {
            let m = modrm(&mut c, rex)?;
            let opsz = if op & 1 == 0 { 1 } else { size };
            let name = ["add", "or", "adc", "sbb", "and", "sub", "xor", "cmp"][(op >> 3) as usize];
            let to_reg = op & 2 != 0;
            let (src, dst) = if to_reg {
                (m.rm_text(opsz), reg_name(m.reg, opsz))
            } else {
                (reg_name(m.reg, opsz), m.rm_text(opsz))
            };
            let effect = if name == "cmp" {
                Effect::Nothing
            } else if to_reg {
                writes(m.reg)
            } else {
                m.rm_reg.map_or(Effect::Unsafe, writes)
            };
            insn(
                c.pos,
                format!("{name} {src},{dst}"),
                single,
                Kind::Other,
                effect,
            )
        }
        0x84 | 0x85 => {
            let m = modrm(&mut c, rex)?;
            let opsz = if op == 0x84 { 1 } else { size };
            let text = format!("test {},{}", reg_name(m.reg, opsz), m.rm_text(opsz));
            insn(c.pos, text, single, Kind::Other, Effect::Nothing)
        }
        0x88 | 0x89 => {
            let m = modrm(&mut c, rex)?;
            let opsz = if op == 0x88 { 1 } else { size };
            let text = format!("mov {},{}", reg_name(m.reg, opsz), m.rm_text(opsz));
            let (kind, effect) = match m.rm_reg {
                Some(dst) if opsz == 8 => (
                    Kind::MovRegReg {
                        dst: Reg::from_num(dst),
                        src: Reg::from_num(m.reg),
                    },
                    writes(dst),
                ),
                Some(dst) => (Kind::Other, writes(dst)),
                None => (Kind::Other, Effect::Unsafe),
            };
            insn(c.pos, text, single, kind, effect)
        }
        0x8a | 0x8b | 0x8d => {
            let m = modrm(&mut c, rex)?;
            if op == 0x8d && m.rm_reg.is_some() {
                return None;
            }
            let opsz = if op == 0x8a { 1 } else { size };
            let name = if op == 0x8d { "lea" } else { "mov" };
            let text = format!("{name} {},{}", m.rm_text(opsz), reg_name(m.reg, opsz));
            insn(c.pos, text, single, Kind::Other, writes(m.reg))
        }
        0x80 | 0x81 | 0x83 => {
            let m = modrm(&mut c, rex)?;
            let opsz = if op == 0x80 { 1 } else { size };
            let imm = c.imm(if op == 0x81 {
                if opsz == 2 { 2 } else { 4 }
            } else {
                1
            })?;
            let sub = (m.reg & 7) as usize;
            let name = ["add", "or", "adc", "sbb", "and", "sub", "xor", "cmp"][sub];
            let effect = if sub == 7 {
                Effect::Nothing
            } else {
                m.rm_reg.map_or(Effect::Unsafe, writes)
            };
            let (name, dst) = match m.rm_reg {
                Some(_) => (name.to_string(), m.rm_text(opsz)),
                None => (format!("{name}{}", suffix(opsz)), m.mem.clone()),
            };
            insn(
                c.pos,
                format!("{name} ${},{dst}", imm_text(imm, opsz)),
                single,
                Kind::Other,
                effect,
            )
        }
        0x68 | 0x6a => {
            let imm = c.imm(if op == 0x68 { 4 } else { 1 })?;
            insn(
                c.pos,
                format!("push ${}", imm_text(imm, 8)),
                single,
                Kind::Other,
                Effect::Unsafe,
            )
        }
        0xff => {
            let m = modrm(&mut c, rex)?;
            let name = match m.reg & 7 {
                2 => "call",
                4 => "jmp",
                6 => "push",
                _ => return None,
            };
            let star = if name == "push" { "" } else { "*" };
            insn(
                c.pos,
                format!("{name} {star}{}", m.rm_text(8)),
                single,
                Kind::Other,
                Effect::Unsafe,
            )
        }
        _ => return None,
    };
    Some(out)
}

/// An immediate as objdump prints it: sign-extended to the operand size,
/// shown unsigned.
fn imm_text(imm: i64, size: u8) -> String {
    let bits = u32::from(size.clamp(1, 8)) * 8;
    let mask = if bits == 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    };
    format!("{:#x}", imm as u64 & mask)
}

fn suffix(size: u8) -> char {
    match size {
        8 => 'q',
        4 => 'l',
        2 => 'w',
        _ => 'b',
    }
}

fn insn(len: usize, text: String, cost: ProbeCost, kind: Kind, effect: Effect) -> Insn {
    Insn {
        len: Some(len),
        text,
        cost,
        kind,
        effect,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(code: &[u8]) -> (String, Option<usize>, ProbeCost) {
        let i = decode(code, 0x1000);
        (i.text, i.len, i.cost)
    }

    #[test]
    fn decodes_prologue_instructions_like_objdump() {
        use ProbeCost::*;
        let cases: &[(&[u8], &str, usize, ProbeCost)] = &[
            (&[0xf3, 0x0f, 0x1e, 0xfa], "endbr64", 4, SingleStepped),
            (&[0x55], "push %rbp", 1, Emulated),
            (&[0x53], "push %rbx", 1, Emulated),
            (&[0x41, 0x54], "push %r12", 2, Emulated),
            (&[0x41, 0x57], "push %r15", 2, Emulated),
            (&[0x48, 0x55], "push %rbp", 2, SingleStepped),
            (&[0x5d], "pop %rbp", 1, SingleStepped),
            (&[0x48, 0x89, 0xe5], "mov %rsp,%rbp", 3, SingleStepped),
            (&[0x49, 0x89, 0xfc], "mov %rdi,%r12", 3, SingleStepped),
            (&[0x41, 0x89, 0xd4], "mov %edx,%r12d", 3, SingleStepped),
            (&[0x89, 0xf3], "mov %esi,%ebx", 2, SingleStepped),
            (&[0x48, 0x83, 0xec, 0x08], "sub $0x8,%rsp", 4, SingleStepped),
            (
                &[0x48, 0x81, 0xec, 0x18, 0x01, 0x00, 0x00],
                "sub $0x118,%rsp",
                7,
                SingleStepped,
            ),
            (
                &[0x48, 0xc7, 0xc0, 0xff, 0xff, 0xff, 0xff],
                "mov $0xffffffffffffffff,%rax",
                7,
                SingleStepped,
            ),
            (
                &[0xb9, 0xf7, 0x00, 0x00, 0x00],
                "mov $0xf7,%ecx",
                5,
                SingleStepped,
            ),
            (
                &[0x41, 0xb9, 0xd7, 0x00, 0x00, 0x00],
                "mov $0xd7,%r9d",
                6,
                SingleStepped,
            ),
            (
                &[0x48, 0xb8, 0xef, 0xbe, 0xfe, 0xca, 0x59, 0x56, 0x00, 0x00],
                "movabs $0x5659cafebeef,%rax",
                10,
                SingleStepped,
            ),
            (&[0x31, 0xc0], "xor %eax,%eax", 2, SingleStepped),
            (&[0x31, 0xf6], "xor %esi,%esi", 2, SingleStepped),
            (&[0x48, 0x85, 0xff], "test %rdi,%rdi", 3, SingleStepped),
            (&[0x83, 0xff, 0x07], "cmp $0x7,%edi", 3, SingleStepped),
            (
                &[0x48, 0x8d, 0x05, 0x10, 0x00, 0x00, 0x00],
                "lea 0x10(%rip),%rax",
                7,
                SingleStepped,
            ),
            (&[0x8d, 0x47, 0xff], "lea -0x1(%rdi),%eax", 3, SingleStepped),
            (
                &[0x0f, 0xb6, 0x05, 0x68, 0x0e, 0x78, 0x0e],
                "movzbl 0xe780e68(%rip),%eax",
                7,
                SingleStepped,
            ),
            (
                &[0x4c, 0x8d, 0x05, 0x75, 0xfb, 0x0f, 0x00],
                "lea 0xffb75(%rip),%r8",
                7,
                SingleStepped,
            ),
            (
                &[0x48, 0x89, 0x7c, 0x24, 0x08],
                "mov %rdi,0x8(%rsp)",
                5,
                SingleStepped,
            ),
            (&[0x90], "nop", 1, Emulated),
            (&[0x66, 0x90], "nop", 2, Emulated),
            (
                &[0x0f, 0x1f, 0x44, 0x00, 0x00],
                "nopl 0x0(%rax,%rax,1)",
                5,
                Optimized,
            ),
            (&[0x0f, 0x1f, 0x40, 0x00], "nopl 0x0(%rax)", 4, Emulated),
            (
                &[0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00],
                "nopw 0x0(%rax,%rax,1)",
                6,
                Emulated,
            ),
            (&[0xe9, 0x46, 0x91, 0x05, 0x00], "jmp 0x5a14b", 5, Emulated),
            (&[0xeb, 0x10], "jmp 0x1012", 2, Emulated),
            (&[0x74, 0x09], "je 0x100b", 2, Emulated),
            (
                &[0x0f, 0x84, 0xa0, 0x00, 0x00, 0x00],
                "je 0x10a6",
                6,
                Emulated,
            ),
            (&[0xe8, 0x00, 0x00, 0x00, 0x00], "call 0x1005", 5, Emulated),
            (&[0xc3], "ret", 1, SingleStepped),
            (
                &[0x68, 0xe1, 0x00, 0x00, 0x00],
                "push $0xe1",
                5,
                SingleStepped,
            ),
            (&[0xff, 0x75, 0x18], "push 0x18(%rbp)", 3, SingleStepped),
        ];
        for (code, want, len, cost) in cases {
            assert_eq!(
                text(code),
                (want.to_string(), Some(*len), *cost),
                "{code:02x?}"
            );
        }
    }

    #[test]
    fn unknown_and_truncated_bytes_are_not_trusted() {
        for code in [
            &[][..],
            &[0x0f][..],
            &[0xe9, 0x01][..],
            &[0x48][..],
            &[0xd9, 0xee][..],
            &[0x66; 8][..],
        ] {
            let i = decode(code, 0);
            assert_eq!(i.len, None, "{code:02x?}");
            assert_eq!(i.cost, ProbeCost::SingleStepped);
        }
        // xchg %eax,%r8d is not a nop.
        assert_eq!(decode(&[0x41, 0x90], 0).cost, ProbeCost::SingleStepped);
    }
}
