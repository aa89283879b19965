//! What the x86-64 kernel does with a uprobe on one instruction: optimize,
//! emulate, single-step out of line, or refuse it. These are the rules of
//! `arch/x86/kernel/uprobes.c` (Linux 6.18: `uprobe_init_insn`,
//! `can_optimize`, `branch_setup_xol_ops`, `push_setup_xol_ops`), restated
//! over the raw bytes and iced-x86's decoding.
//!
//! - Refused (registration fails): an instruction the kernel's decoder
//!   cannot decode, one with an ES/CS/SS/DS segment or LOCK prefix
//!   (`notrack jmp` and branch hints included), one whose first opcode byte
//!   is invalid in 64-bit mode or faults or traps in user space (`int3`,
//!   `int N`, `hlt`, `in`/`out`, ...), and a relative branch with a 0x66
//!   operand-size prefix; also (our addition) an instruction the kernel
//!   would emulate as something else: `41 90` (`xchg %eax,%r8d`, taken for
//!   a nop) and VEX-encoded opcodes that read as branches (`vzeroupper`).
//! - Optimized (6.18): a 5-byte `nop`/`nopl` that does not cross a page.
//! - Emulated: the kernel's canonical nops of 1 to 8 bytes and any `0x90`
//!   opcode, relative `jmp`/`call`/`jcc`, and `push %reg` of one byte or
//!   with a lone REX.B prefix (`41 5x`).
//! - Everything else is single-stepped out of line.

use super::ProbeCost;

/// First opcode bytes `uprobe_init_insn` refuses in 64-bit processes:
/// invalid in long mode (06 07 0e 16 17 1e 1f 27 2f 37 3f 60 61 62 82 9a
/// ce d4 d5 d6 ea), or faulting/trapping in user space (6c-6f ins/outs,
/// cc int3, cd int N, cf iret, e4-e7 and ec-ef in/out, f1 int1, f4 hlt,
/// fa cli, fb sti). Every two-byte opcode (0x0f ..) passes this check.
const REFUSED_OPCODES: [u8; 40] = [
    0x06, 0x07, 0x0e, 0x16, 0x17, 0x1e, 0x1f, 0x27, 0x2f, 0x37, 0x3f, 0x60, 0x61, 0x62, 0x6c, 0x6d,
    0x6e, 0x6f, 0x82, 0x9a, 0xcc, 0xcd, 0xce, 0xcf, 0xd4, 0xd5, 0xd6, 0xe4, 0xe5, 0xe6, 0xe7, 0xea,
    0xec, 0xed, 0xee, 0xef, 0xf1, 0xf4, 0xfa, 0xfb,
];

/// The kernel's canonical x86-64 nops (`x86_nops[1..=8]`), which it
/// emulates as a jump to the next instruction.
const KERNEL_NOPS: [&[u8]; 8] = [
    &[0x90],
    &[0x66, 0x90],
    &[0x0f, 0x1f, 0x00],
    &[0x0f, 0x1f, 0x40, 0x00],
    &[0x0f, 0x1f, 0x44, 0x00, 0x00],
    &[0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00],
    &[0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00],
    &[0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00],
];

const PAGE_SIZE: u64 = 4096;

/// The byte layout of one instruction as the kernel's decoder sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// Legacy prefixes (0x26 0x2e 0x36 0x3e 0x64 0x65 0x66 0x67 0xf0 0xf2 0xf3).
    prefixes: u16,
    has_opsize: bool,
    bad_prefix: bool,
    /// The REX byte, if any (0x40..=0x4f right before the opcode).
    rex: Option<u8>,
    /// The first opcode byte (for VEX/EVEX/XOP: the byte after their payload).
    opcode: u8,
    /// The second opcode byte of a 0x0f-escaped legacy opcode.
    opcode2: Option<u8>,
    /// The ModRM `reg` field following a two-byte opcode.
    modrm_reg: Option<u8>,
    /// VEX, EVEX or XOP encoded.
    vex: bool,
}

impl Layout {
    /// Splits `bytes` (exactly one instruction) into prefixes and opcode;
    /// `None` when the bytes end before an opcode.
    pub(super) fn of(bytes: &[u8]) -> Option<Layout> {
        let mut pos = 0;
        let mut layout = Layout {
            prefixes: 0,
            has_opsize: false,
            bad_prefix: false,
            rex: None,
            opcode: 0,
            opcode2: None,
            modrm_reg: None,
            vex: false,
        };
        while let Some(&b) = bytes.get(pos) {
            match b {
                0x26 | 0x2e | 0x36 | 0x3e | 0xf0 => layout.bad_prefix = true,
                0x66 => layout.has_opsize = true,
                0x64 | 0x65 | 0x67 | 0xf2 | 0xf3 => {}
                _ => break,
            }
            layout.prefixes += 1;
            pos += 1;
        }
        let mut b = *bytes.get(pos)?;
        if (0x40..=0x4f).contains(&b) {
            layout.rex = Some(b);
            pos += 1;
            b = *bytes.get(pos)?;
        }
        // VEX (c4 3-byte, c5 2-byte), EVEX (62, 4-byte), XOP (8f with
        // map select >= 8): the kernel checks the opcode after the payload.
        let payload = match b {
            0xc5 => Some(2),
            0xc4 => Some(3),
            0x62 => Some(4),
            0x8f if bytes.get(pos + 1).is_some_and(|m| m & 0x1f >= 8) => Some(3),
            _ => None,
        };
        if let Some(skip) = payload {
            layout.vex = true;
            // EVEX keeps its own entry (0x62 is refused outright).
            layout.opcode = if b == 0x62 {
                0x62
            } else {
                *bytes.get(pos + skip)?
            };
            return Some(layout);
        }
        layout.opcode = b;
        if b == 0x0f {
            let op2 = *bytes.get(pos + 1)?;
            layout.opcode2 = Some(op2);
            layout.modrm_reg = bytes.get(pos + 2).map(|m| (m >> 3) & 7);
        }
        Some(layout)
    }
}

/// The kernel's treatment of a uprobe on `bytes` (one whole instruction,
/// as iced-x86 measured it) at virtual address `addr`.
pub(super) fn probe_cost(bytes: &[u8], addr: u64) -> ProbeCost {
    let Some(l) = Layout::of(bytes) else {
        return ProbeCost::Refused;
    };
    if l.bad_prefix || REFUSED_OPCODES.contains(&l.opcode) {
        return ProbeCost::Refused;
    }
    // The kernel's branch and nop set-up reads the opcode byte of a
    // VEX-encoded instruction as if it were a legacy one (`vzeroupper`,
    // c5 f8 77, as `ja`): it would emulate the wrong instruction, so no
    // probe may sit there.
    if l.vex && matches!(l.opcode, 0x70..=0x7f | 0x90 | 0xe8 | 0xe9 | 0xeb) {
        return ProbeCost::Refused;
    }
    let len = bytes.len() as u64;
    let is_nop = l.opcode == 0x90 && l.opcode2.is_none();
    let is_nopl = l.opcode2 == Some(0x1f) && l.modrm_reg == Some(0);
    // `41 90` is `xchg %eax,%r8d`, but the kernel's branch set-up sees
    // opcode 0x90 and would skip it as a nop: a probe there would corrupt
    // the program, so it is treated as refused.
    if is_nop && l.rex.is_some_and(|r| r & 1 != 0) {
        return ProbeCost::Refused;
    }
    if len == 5 && (is_nop || is_nopl) && PAGE_SIZE - (addr % PAGE_SIZE) >= 5 {
        return ProbeCost::Optimized;
    }
    if KERNEL_NOPS.get(bytes.len().wrapping_sub(1)) == Some(&bytes) || is_nop {
        return ProbeCost::Emulated;
    }
    let relative_branch = matches!(
        (l.opcode, l.opcode2),
        (0xeb | 0xe9 | 0xe8 | 0x70..=0x7f, None) | (0x0f, Some(0x80..=0x8f))
    );
    if relative_branch {
        return if l.has_opsize {
            ProbeCost::Refused
        } else {
            ProbeCost::Emulated
        };
    }
    let push_reg = (0x50..=0x57).contains(&l.opcode)
        && l.opcode2.is_none()
        && (len == 1 || (len == 2 && bytes[0] == 0x41));
    if push_reg {
        return ProbeCost::Emulated;
    }
    ProbeCost::SingleStepped
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProbeCost::*;

    #[test]
    fn kernel_classes() {
        let cases: &[(&[u8], u64, ProbeCost)] = &[
            (&[0x55], 0, Emulated),
            (&[0x41, 0x57], 0, Emulated),
            // REX.W push and an operand-size push: single-stepped.
            (&[0x48, 0x55], 0, SingleStepped),
            (&[0x66, 0x55], 0, SingleStepped),
            (&[0x90], 0, Emulated),
            (&[0x66, 0x90], 0, Emulated),
            (&[0x0f, 0x1f, 0x40, 0x00], 0, Emulated),
            (&[0x0f, 0x1f, 0x44, 0x00, 0x00], 0x1000, Optimized),
            // Crossing a page: no optimization, but still a canonical nop.
            (&[0x0f, 0x1f, 0x44, 0x00, 0x00], 0x1ffd, Emulated),
            // A 5-byte nopw is optimized although it is not canonical.
            (&[0x66, 0x0f, 0x1f, 0x40, 0x00], 0, Optimized),
            // A 9-byte nopw is neither.
            (&[0x66, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0], 0, SingleStepped),
            (&[0xeb, 0x10], 0, Emulated),
            (&[0xe8, 0, 0, 0, 0], 0, Emulated),
            (&[0x0f, 0x84, 0, 0, 0, 0], 0, Emulated),
            (&[0x66, 0xe9, 0, 0], 0, Refused),
            // notrack jmp *%rax (DS prefix) and a CS-prefixed nop.
            (&[0x3e, 0xff, 0xe0], 0, Refused),
            (&[0x2e, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0], 0, Refused),
            (&[0xf0, 0x48, 0x0f, 0xb1, 0x17], 0, Refused),
            (&[0xcc], 0, Refused),
            (&[0xf4], 0, Refused),
            (&[0x41, 0x90], 0, Refused),
            (&[0xf3, 0x0f, 0x1e, 0xfa], 0, SingleStepped),
            (&[0x48, 0x89, 0xe5], 0, SingleStepped),
            (&[0xc3], 0, SingleStepped),
            // vzeroupper (VEX, opcode 0x77) would be emulated as `ja`;
            // vmovups (VEX, 0x10) is single-stepped; EVEX is refused.
            (&[0xc5, 0xf8, 0x77], 0, Refused),
            (&[0xc5, 0xf8, 0x10, 0x07], 0, SingleStepped),
            (&[0x62, 0xf1, 0x7c, 0x48, 0x10, 0x07], 0, Refused),
            (&[], 0, Refused),
        ];
        for (bytes, addr, want) in cases {
            assert_eq!(probe_cost(bytes, *addr), *want, "{bytes:02x?} at {addr:#x}");
        }
    }
}
