//! One x86-64 instruction at a function's start, decoded by iced-x86: its
//! length, its text (AT&T syntax, GNU `as` style), what it writes (for the
//! skip rule) and what a uprobe on it costs ([`super::uprobe_rules`]).
//! Bytes iced-x86 cannot decode, or that end mid-instruction, come back
//! with `len: None`, which placement never moves past.

use iced_x86::{
    Decoder, DecoderError, DecoderOptions, FlowControl, Formatter, GasFormatter, Instruction,
    InstructionInfoFactory, Mnemonic, OpAccess, OpKind, Register,
};

use super::ProbeCost;
use super::uprobe_rules::probe_cost;

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

    /// The 64-bit general-purpose register `r` is part of (`%esi` -> rsi).
    fn of(r: Register) -> Option<Reg> {
        Some(match r.full_register() {
            Register::RAX => Reg::Rax,
            Register::RCX => Reg::Rcx,
            Register::RDX => Reg::Rdx,
            Register::RBX => Reg::Rbx,
            Register::RSP => Reg::Rsp,
            Register::RBP => Reg::Rbp,
            Register::RSI => Reg::Rsi,
            Register::RDI => Reg::Rdi,
            Register::R8 => Reg::R8,
            Register::R9 => Reg::R9,
            Register::R10 => Reg::R10,
            Register::R11 => Reg::R11,
            Register::R12 => Reg::R12,
            Register::R13 => Reg::R13,
            Register::R14 => Reg::R14,
            Register::R15 => Reg::R15,
            _ => return None,
        })
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

/// One decoded instruction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Insn {
    /// Length in bytes, when known.
    pub len: Option<usize>,
    /// AT&T syntax (immediates and targets in hex), as iced-x86's GNU
    /// `as` formatter spells it.
    pub text: String,
    pub cost: ProbeCost,
    pub(super) kind: Kind,
    effect: Effect,
}

/// The few shapes [`super::tail_call_target`] recognizes.
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
    /// These general-purpose registers (and flags), nothing else.
    Writes(RegSet),
    /// Control flow, the stack pointer, memory stores, any other register,
    /// or unknown.
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

    /// Bytes that are not (or not wholly) an instruction. Truncated bytes
    /// may be a valid instruction we cannot see the end of: single-stepped
    /// at worst. Invalid ones the kernel refuses to probe.
    fn unknown(code: &[u8], error: DecoderError) -> Insn {
        let bytes: Vec<String> = code.iter().take(4).map(|b| format!("{b:02x}")).collect();
        Insn {
            len: None,
            text: if bytes.is_empty() {
                "(none)".to_string()
            } else {
                format!("(bytes {})", bytes.join(" "))
            },
            cost: if error == DecoderError::NoMoreBytes {
                ProbeCost::SingleStepped
            } else {
                ProbeCost::Refused
            },
            kind: Kind::Other,
            effect: Effect::Unsafe,
        }
    }
}

/// Objdump-like AT&T text: hex everywhere, no spaces after commas,
/// rip-relative operands as `disp(%rip)`, zero displacements shown.
fn formatter() -> GasFormatter {
    let mut f = GasFormatter::new();
    let o = f.options_mut();
    o.set_hex_prefix("0x");
    o.set_hex_suffix("");
    o.set_uppercase_hex(false);
    o.set_small_hex_numbers_in_decimal(false);
    o.set_add_leading_zero_to_hex_numbers(false);
    o.set_branch_leading_zeros(false);
    o.set_leading_zeros(false);
    o.set_space_after_operand_separator(false);
    o.set_rip_relative_addresses(true);
    o.set_show_zero_displacements(true);
    o.set_signed_memory_displacements(true);
    o.set_show_branch_size(false);
    f
}

/// Decodes the instruction at the start of `code` (at address `addr`).
/// Unknown or truncated encodings come back with `len: None`.
pub fn decode(code: &[u8], addr: u64) -> Insn {
    let mut decoder = Decoder::with_ip(64, code, addr, DecoderOptions::NONE);
    let instr = decoder.decode();
    if instr.is_invalid() {
        return Insn::unknown(code, decoder.last_error());
    }
    let len = instr.len();
    let mut text = String::new();
    formatter().format(&instr, &mut text);
    Insn {
        len: Some(len),
        text,
        // `len` bytes were decoded from `code`, so the slice is in bounds.
        cost: probe_cost(&code[..len], addr),
        kind: kind(&instr),
        effect: effect(&instr),
    }
}

fn kind(instr: &Instruction) -> Kind {
    let reg0 = || Reg::of(instr.op0_register());
    match instr.mnemonic() {
        Mnemonic::Endbr64 => Kind::Endbr64,
        Mnemonic::Push if instr.op0_kind() == OpKind::Register => {
            reg0().map_or(Kind::Other, Kind::Push)
        }
        Mnemonic::Pop if instr.op0_kind() == OpKind::Register => {
            reg0().map_or(Kind::Other, Kind::Pop)
        }
        Mnemonic::Mov
            if instr.op0_kind() == OpKind::Register
                && instr.op1_kind() == OpKind::Register
                && instr.op0_register().size() == 8 =>
        {
            match (reg0(), Reg::of(instr.op1_register())) {
                (Some(dst), Some(src)) => Kind::MovRegReg { dst, src },
                _ => Kind::Other,
            }
        }
        Mnemonic::Jmp if instr.flow_control() == FlowControl::UnconditionalBranch => {
            Kind::Jmp(instr.near_branch_target())
        }
        _ => Kind::Other,
    }
}

/// What running `instr` changes besides flags: only general-purpose
/// registers other than rsp make it skippable.
fn effect(instr: &Instruction) -> Effect {
    if instr.flow_control() != FlowControl::Next
        || instr.stack_pointer_increment() != 0
        || instr.is_stack_instruction()
        || instr.is_privileged()
        || instr.has_lock_prefix()
    {
        return Effect::Unsafe;
    }
    let mut factory = InstructionInfoFactory::new();
    let info = factory.info(instr);
    let writes = |a: OpAccess| {
        matches!(
            a,
            OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
        )
    };
    if info.used_memory().iter().any(|m| writes(m.access())) {
        return Effect::Unsafe;
    }
    let mut written = RegSet::EMPTY;
    for used in info.used_registers().iter().filter(|u| writes(u.access())) {
        match Reg::of(used.register()) {
            Some(Reg::Rsp) | None => return Effect::Unsafe,
            Some(r) => written = written.with(r),
        }
    }
    if written == RegSet::EMPTY {
        Effect::Nothing
    } else {
        Effect::Writes(written)
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
    fn decodes_prologue_instructions() {
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
                &[0x48, 0xb8, 0xef, 0xbe, 0xfe, 0xca, 0x59, 0x56, 0x00, 0x00],
                "movabs $0x5659cafebeef,%rax",
                10,
                SingleStepped,
            ),
            (&[0x31, 0xc0], "xor %eax,%eax", 2, SingleStepped),
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
                &[0x48, 0x89, 0x7c, 0x24, 0x08],
                "mov %rdi,0x8(%rsp)",
                5,
                SingleStepped,
            ),
            (&[0x90], "nop", 1, Emulated),
            (&[0x66, 0x90], "xchg %ax,%ax", 2, Emulated),
            (
                &[0x0f, 0x1f, 0x44, 0x00, 0x00],
                "nopl 0x0(%rax,%rax)",
                5,
                Optimized,
            ),
            (&[0x0f, 0x1f, 0x40, 0x00], "nopl 0x0(%rax)", 4, Emulated),
            (
                &[0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00],
                "nopw 0x0(%rax,%rax)",
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
            (&[0xff, 0x75, 0x18], "pushq 0x18(%rbp)", 3, SingleStepped),
            (&[0xcc], "int3", 1, Refused),
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
    fn effects_decide_what_may_be_skipped() {
        let args = RegSet::EMPTY.with(Reg::Rdi).with(Reg::Rsi);
        let skippable = |code: &[u8]| decode(code, 0).skippable(args);
        assert!(skippable(&[0xf3, 0x0f, 0x1e, 0xfa]), "endbr64");
        assert!(skippable(&[0x48, 0x85, 0xff]), "test reads only");
        assert!(skippable(&[0x31, 0xc0]), "xor %eax,%eax: rax is not read");
        assert!(!skippable(&[0x31, 0xf6]), "xor %esi,%esi: rsi is read");
        assert!(!skippable(&[0x48, 0x83, 0xec, 0x08]), "rsp");
        assert!(!skippable(&[0x55]), "push moves rsp");
        assert!(!skippable(&[0x48, 0x89, 0x7c, 0x24, 0x08]), "a store");
        assert!(!skippable(&[0x74, 0x09]), "a branch");
        assert!(!skippable(&[0x0f, 0x05]), "syscall");
        // movq %xmm0,%rax writes rax only; movq %rax,%xmm0 writes xmm0.
        assert!(skippable(&[0x66, 0x48, 0x0f, 0x7e, 0xc0]));
        assert!(!skippable(&[0x66, 0x48, 0x0f, 0x6e, 0xc0]));
    }

    #[test]
    fn unknown_and_truncated_bytes_are_not_trusted() {
        for code in [
            &[][..],
            &[0x0f][..],
            &[0xe9, 0x01][..],
            &[0x48][..],
            &[0x66; 8][..],
        ] {
            let i = decode(code, 0);
            assert_eq!(i.len, None, "{code:02x?}");
            assert_eq!(i.cost, ProbeCost::SingleStepped, "{code:02x?}");
        }
        // Invalid in 64-bit mode: the kernel refuses it.
        let i = decode(&[0x06, 0x55], 0);
        assert_eq!((i.len, i.cost), (None, ProbeCost::Refused));
        assert_eq!(i.text, "(bytes 06 55)");
        // xchg %eax,%r8d is not a nop, though the kernel would treat it as one.
        assert_eq!(decode(&[0x41, 0x90], 0).cost, ProbeCost::Refused);
    }
}
