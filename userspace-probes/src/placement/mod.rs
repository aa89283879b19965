//! Probe placement: where in a function the uprobe goes, so that the kernel
//! emulates the probed instruction instead of single-stepping it.
//!
//! On x86-64 (kernel 6.18, measured on this project's machines) a uprobe hit
//! costs about 0.5 us when the kernel emulates the probed instruction
//! (`push %reg`, `nop`, `jmp`/`call`/`jcc` rel), about 0.2 us on a 5-byte
//! nop (the optimized path), and 16-18 us when it must single-step it out
//! of line (`endbr64`, `sub`, `mov`, `lea`, ...); a few it refuses outright
//! (segment-prefixed or `notrack` branches, `int3`, ...). Functions built
//! with `-fcf-protection` start with `endbr64`, which changes nothing: the
//! probe goes after it, onto the `push %rbp`.
//!
//! Instructions are decoded by iced-x86 ([`x86`]); the kernel's rules on
//! top of it are in [`uprobe_rules`] (restated from
//! `arch/x86/kernel/uprobes.c`).
//!
//! [`place`] walks at most [`MAX_SKIP`] instructions from the entry and
//! stops at the first emulated one, skipping only instructions that
//! - change no register the decoder reads (the function's argument
//!   registers, see [`crate::catalog::FunctionSpec::reads`]),
//! - never touch rsp (the return probe hijacks the return address at `sp`,
//!   and stack arguments are read relative to it), store to memory or
//!   branch.
//!
//! If none is found the probe stays on the entry. `sp_delta` (bytes the
//! stack grew between entry and probe) is therefore 0 for every placement
//! this module makes; decoders still read stack arguments at
//! `sp + 8 + sp_delta + 8 * slot`.
//!
//! ```
//! use xpuscope_probes::placement::{place, ProbeCost, Reg, RegSet};
//! // endbr64; push %rbp; mov %rsp,%rbp
//! let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5];
//! let p = place(&code, 0x1000, RegSet::EMPTY.with(Reg::Rdi));
//! assert_eq!((p.offset, p.first_insn.as_str(), p.probed_insn.as_str()), (4, "endbr64", "push %rbp"));
//! assert_eq!(p.cost, ProbeCost::Emulated);
//! ```

mod uprobe_rules;
mod x86;

use std::fmt;

use x86::Kind;
pub use x86::{Insn, Reg, RegSet, decode};

/// Most instructions skipped before giving up on finding an emulated one.
pub const MAX_SKIP: usize = 4;
/// Most bytes past the entry a probe may move.
pub const MAX_WINDOW: usize = 24;
/// Bytes of a function's start that [`place`] wants to see.
pub const CODE_BYTES: usize = 48;

/// What a uprobe on an instruction costs per hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProbeCost {
    /// A 5-byte nop: the kernel's optimized uprobe (~0.2 us).
    Optimized,
    /// Emulated in the kernel (~0.5 us).
    Emulated,
    /// Single-stepped out of line (~16 us).
    SingleStepped,
    /// The kernel refuses a uprobe here (attaching fails).
    Refused,
}

impl ProbeCost {
    /// Whether the kernel handles a hit without single-stepping.
    pub fn is_emulated(self) -> bool {
        matches!(self, ProbeCost::Optimized | ProbeCost::Emulated)
    }
}

/// Where the probe of one function goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Bytes past the function's start.
    pub offset: u64,
    /// The function's first instruction, as objdump spells it.
    pub first_insn: String,
    /// The instruction under the probe.
    pub probed_insn: String,
    /// Whether the kernel emulates (or optimizes) the probed instruction.
    pub emulated: bool,
    pub cost: ProbeCost,
    /// Bytes the stack grew between the entry and the probe: stack
    /// argument `slot` is at `sp + 8 + sp_delta + 8 * slot`.
    pub sp_delta: i64,
    /// The instructions the probe was moved past.
    pub skipped: Vec<String>,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cost = match self.cost {
            ProbeCost::Optimized => "optimized",
            ProbeCost::Emulated => "emulated",
            ProbeCost::SingleStepped => "single-step",
            ProbeCost::Refused => "refused",
        };
        write!(f, "+{} {} ({cost})", self.offset, self.probed_insn)?;
        if self.sp_delta != 0 {
            write!(f, " sp+{}", self.sp_delta)?;
        }
        Ok(())
    }
}

/// Chooses the probe offset in a function whose first bytes are `code`
/// (at virtual address `addr`), never moving past an instruction that
/// writes a register in `reads`, touches rsp, stores or branches.
pub fn place(code: &[u8], addr: u64, reads: RegSet) -> Placement {
    let first = decode(code, addr);
    let at_entry = Placement {
        offset: 0,
        first_insn: first.text.clone(),
        probed_insn: first.text.clone(),
        emulated: first.cost.is_emulated(),
        cost: first.cost,
        sp_delta: 0,
        skipped: Vec::new(),
    };
    let mut insn = first;
    let mut offset = 0usize;
    let mut skipped = Vec::new();
    loop {
        if insn.cost.is_emulated() {
            return Placement {
                offset: offset as u64,
                probed_insn: insn.text,
                emulated: true,
                cost: insn.cost,
                skipped,
                ..at_entry
            };
        }
        let Some(len) = insn.len else {
            return at_entry;
        };
        if skipped.len() == MAX_SKIP || !insn.skippable(reads) || offset + len >= MAX_WINDOW {
            return at_entry;
        }
        offset += len;
        skipped.push(insn.text);
        insn = decode(
            code.get(offset..).unwrap_or(&[]),
            addr.wrapping_add(offset as u64),
        );
    }
}

/// The target of a pure tail-call thunk: `[endbr64] [push %rbp; mov
/// %rsp,%rbp; pop %rbp] jmp target` (registers and stack at the target are
/// those of the thunk's entry, so probing the target sees the same call).
pub fn tail_call_target(code: &[u8], addr: u64) -> Option<u64> {
    let mut offset = 0usize;
    let mut depth = 0i32;
    for _ in 0..6 {
        let insn = decode(code.get(offset..)?, addr.wrapping_add(offset as u64));
        match insn.kind {
            Kind::Endbr64 => {}
            Kind::Push(Reg::Rbp) if depth == 0 => depth += 1,
            Kind::MovRegReg {
                dst: Reg::Rbp,
                src: Reg::Rsp,
            } if depth == 1 => {}
            Kind::Pop(Reg::Rbp) if depth == 1 => depth -= 1,
            Kind::Jmp(target) if depth == 0 => return Some(target),
            _ => return None,
        }
        offset += insn.len?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reads_args(n: u8) -> RegSet {
        (0..n).fold(RegSet::EMPTY.with(Reg::Rsp), |s, i| s.with(Reg::arg(i)))
    }

    #[test]
    fn plain_push_stays_at_entry() {
        let p = place(&[0x55, 0x48, 0x89, 0xe5], 0, reads_args(6));
        assert_eq!((p.offset, p.cost, p.sp_delta), (0, ProbeCost::Emulated, 0));
        assert_eq!(p.first_insn, "push %rbp");
        assert!(p.emulated && p.skipped.is_empty());
    }

    #[test]
    fn endbr64_then_push_moves_by_four() {
        let p = place(
            &[0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5],
            0,
            reads_args(6),
        );
        assert_eq!(
            (p.offset, p.probed_insn.as_str(), p.sp_delta),
            (4, "push %rbp", 0)
        );
        assert_eq!(p.skipped, ["endbr64"]);
        assert_eq!(p.to_string(), "+4 push %rbp (emulated)");
    }

    #[test]
    fn skips_only_writes_the_decoder_does_not_read() {
        // cudaStreamSynchronize (stand-in): mov $0x83,%edx; xor %esi,%esi; jmp stream_sync
        let code = [
            0xba, 0x83, 0, 0, 0, 0x31, 0xf6, 0xe9, 0x64, 0xed, 0xff, 0xff,
        ];
        let p = place(&code, 0x4130, reads_args(1));
        assert_eq!((p.offset, p.probed_insn.as_str()), (7, "jmp 0x2ea0"));
        assert_eq!(p.skipped, ["mov $0x83,%edx", "xor %esi,%esi"]);
        // The same code where the decoder reads rdx stays at the entry.
        let p = place(&code, 0x4130, reads_args(3));
        assert_eq!((p.offset, p.cost), (0, ProbeCost::SingleStepped));
        // ncclCommInitAll: movabs $..,%rax; push %rbp -> +10.
        let code = [0x48, 0xb8, 0xef, 0xbe, 0xfe, 0xca, 0x59, 0x56, 0, 0, 0x55];
        assert_eq!(place(&code, 0, reads_args(3)).offset, 10);
    }

    #[test]
    fn never_moves_past_stack_stores_or_branches() {
        // sub $8,%rsp; push %rbx: moving would shift sp.
        let p = place(&[0x48, 0x83, 0xec, 0x08, 0x53], 0, reads_args(1));
        assert_eq!((p.offset, p.cost), (0, ProbeCost::SingleStepped));
        // A store into the argument area.
        let p = place(&[0x48, 0x89, 0x7c, 0x24, 0x08, 0x55], 0, reads_args(0));
        assert_eq!(p.offset, 0);
        // ret ends the function.
        let p = place(
            &[0x48, 0x8d, 0x05, 0, 0, 0, 0, 0xc3, 0x55],
            0,
            reads_args(0),
        );
        assert_eq!(p.offset, 0);
        // Bytes invalid in 64-bit mode: refused, and never moved past.
        let p = place(&[0x06, 0x55], 0, reads_args(0));
        assert_eq!((p.offset, p.first_insn.as_str()), (0, "(bytes 06 55)"));
        assert_eq!((p.cost, p.emulated), (ProbeCost::Refused, false));
        // Truncated input.
        let p = place(&[0xf3, 0x0f, 0x1e, 0xfa], 0, reads_args(0));
        assert_eq!((p.offset, p.cost), (0, ProbeCost::SingleStepped));
        // Too many skips.
        let p = place(
            &[
                0x31, 0xc0, 0x31, 0xc0, 0x31, 0xc0, 0x31, 0xc0, 0x31, 0xc0, 0x55,
            ],
            0,
            reads_args(0),
        );
        assert_eq!(p.offset, 0);
    }

    #[test]
    fn test_and_jcc_probe_on_the_branch() {
        // ncclGetVersion: test %rdi,%rdi; je ...
        let p = place(&[0x48, 0x85, 0xff, 0x74, 0x09], 0, reads_args(1));
        assert_eq!((p.offset, p.probed_insn.as_str()), (3, "je 0xe"));
    }

    #[test]
    fn thunks() {
        // CUDA 12.9 __cudaLaunchKernel: push %rbp; mov %rsp,%rbp; pop %rbp; jmp cudaLaunchKernel
        let code = [0x55, 0x48, 0x89, 0xe5, 0x5d, 0xe9, 0x46, 0x91, 0x05, 0x00];
        assert_eq!(tail_call_target(&code, 0x23d30), Some(0x7ce80));
        let mut cf = vec![0xf3, 0x0f, 0x1e, 0xfa];
        cf.extend_from_slice(&code);
        assert_eq!(tail_call_target(&cf, 0x23d2c), Some(0x7ce80));
        assert_eq!(tail_call_target(&[0xe9, 0, 0, 0, 0], 0x10), Some(0x15));
        // Not a pure thunk: an argument register changes first.
        assert_eq!(
            tail_call_target(&[0xba, 0x83, 0, 0, 0, 0xe9, 0, 0, 0, 0], 0),
            None
        );
        // Unbalanced frame.
        assert_eq!(tail_call_target(&[0x55, 0xe9, 0, 0, 0, 0], 0), None);
        assert_eq!(tail_call_target(&[], 0), None);
    }
}
