//! Where a compiler put the rest of the evaluation loop.
//!
//! GCC splits a large function into a hot part, under its own name, and
//! parts it moves elsewhere in `.text` (`.cold`, `.part.N`): a stripped
//! interpreter names only the hot part in `.dynsym`. Debian's CPython 3.14
//! is built that way: its `_PyEval_EvalFrameDefault` is a 1 KiB entry that
//! jumps into an 84 KiB unnamed part where the loop runs, so the return
//! addresses of a blocked Python thread lie in that part, not in the named
//! range.
//!
//! A split part is reached from the function by a jump (a call would make
//! it a function of its own), into its middle (a jump to a function's
//! first instruction is a tail call to another function). So: the named
//! range's instructions are decoded, every near jump out of it is taken,
//! and the function that contains each target (its extent from
//! `.eh_frame_hdr`'s sorted table: to the next function's start) is added
//! unless the target is that function's start.

use std::ops::Range;

use iced_x86::{Decoder, DecoderOptions, FlowControl, OpKind};

/// The most bytes of the named function decoded (CPython's entry part is a
/// few KiB; an unsplit loop of hundreds is not scanned past this).
const MAX_SCANNED: u64 = 256 << 10;
/// The most split parts kept.
const MAX_PARTS: usize = 2;
/// The largest part taken (the 3.14 loop's is under 100 KiB).
const MAX_PART: u64 = 4 << 20;

/// `.eh_frame_hdr` encodings GNU ld and lld write: a 4-byte count
/// (`DW_EH_PE_udata4`) and a table of 4-byte offsets from the header's
/// start (`DW_EH_PE_datarel | DW_EH_PE_sdata4`).
const UDATA4: u8 = 0x03;
const DATAREL_SDATA4: u8 = 0x3b;

/// The parts of the function at `named` (link-time addresses) that it
/// jumps into elsewhere. `code` is its bytes; `hdr` the `.eh_frame_hdr`
/// section's bytes, at link-time address `hdr_addr`.
pub fn split_parts(named: &Range<u64>, code: &[u8], hdr: &[u8], hdr_addr: u64) -> Vec<Range<u64>> {
    let Some(starts) = function_starts(hdr, hdr_addr) else {
        return Vec::new();
    };
    let scanned = &code[..code.len().min(MAX_SCANNED as usize)];
    let mut decoder = Decoder::with_ip(64, scanned, named.start, DecoderOptions::NONE);
    let mut parts: Vec<Range<u64>> = Vec::new();
    while decoder.can_decode() && parts.len() < MAX_PARTS {
        let insn = decoder.decode();
        if insn.is_invalid() {
            continue;
        }
        if !matches!(
            insn.flow_control(),
            FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch
        ) || insn.op0_kind() != OpKind::NearBranch64
        {
            continue;
        }
        let target = insn.near_branch_target();
        if named.contains(&target) || parts.iter().any(|p| p.contains(&target)) {
            continue;
        }
        // The function holding the target: the last start at or before it,
        // up to the next start.
        let i = starts.partition_point(|&s| s <= target);
        let (Some(&start), Some(&end)) =
            (i.checked_sub(1).and_then(|i| starts.get(i)), starts.get(i))
        else {
            continue;
        };
        if start == target || end - start > MAX_PART || (start..end).contains(&named.start) {
            continue;
        }
        parts.push(start..end);
    }
    parts
}

/// The sorted function starts of an `.eh_frame_hdr` (link-time
/// addresses), when it is in the encoding every GNU linker writes.
fn function_starts(hdr: &[u8], hdr_addr: u64) -> Option<Vec<u64>> {
    let &[version, _eh_frame_ptr_enc, count_enc, table_enc] = hdr.get(..4)? else {
        return None;
    };
    if version != 1 || count_enc != UDATA4 || table_enc != DATAREL_SDATA4 {
        return None;
    }
    // The encoded .eh_frame pointer (4 bytes in these encodings), then the
    // count, then (initial location, FDE address) pairs.
    let count = u32::from_le_bytes(hdr.get(8..12)?.try_into().ok()?) as usize;
    let table = hdr.get(12..)?;
    if table.len() / 8 < count {
        return None;
    }
    let mut starts: Vec<u64> = table
        .chunks_exact(8)
        .take(count)
        .map(|pair| {
            let rel = i32::from_le_bytes(pair[..4].try_into().expect("4 bytes"));
            hdr_addr.wrapping_add_signed(i64::from(rel))
        })
        .collect();
    // Sorted by the linker; a crafted table is sorted here so the search
    // stays meaningful.
    starts.sort_unstable();
    Some(starts)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `.eh_frame_hdr` at `at` for functions starting at `starts`.
    fn hdr(at: u64, starts: &[u64]) -> Vec<u8> {
        let mut out = vec![1, 0x1b, UDATA4, DATAREL_SDATA4];
        out.extend_from_slice(&0i32.to_le_bytes());
        out.extend_from_slice(&(starts.len() as u32).to_le_bytes());
        for &s in starts {
            out.extend_from_slice(&((s as i64 - at as i64) as i32).to_le_bytes());
            out.extend_from_slice(&0i32.to_le_bytes());
        }
        out
    }

    /// `jmp rel32` from `from` (5 bytes) to `to`.
    fn jmp(from: u64, to: u64) -> Vec<u8> {
        let mut out = vec![0xe9];
        out.extend_from_slice(&((to as i64 - (from as i64 + 5)) as i32).to_le_bytes());
        out
    }

    #[test]
    fn jumps_into_the_middle_of_a_function_are_its_split_parts() {
        // Named part at 0x5000..0x5020; a cold part 0x1000..0x3000 jumped
        // into at 0x1100; a tail call to 0x7000 (a function's start); a
        // call (e8) into 0x8000's middle.
        let named = 0x5000..0x5020;
        let mut code = jmp(0x5000, 0x1100);
        code.extend(jmp(0x5005, 0x7000));
        code.push(0xe8);
        code.extend_from_slice(&((0x8010i64 - (0x500a + 5)) as i32).to_le_bytes());
        // je rel32 into the cold part again: kept once.
        code.extend([0x0f, 0x84]);
        code.extend_from_slice(&((0x1200i64 - (0x500f + 6)) as i32).to_le_bytes());
        code.resize(0x20, 0xcc);
        let table = hdr(
            0x9000,
            &[0x1000, 0x3000, 0x5000, 0x5020, 0x7000, 0x8000, 0x8100],
        );
        assert_eq!(
            split_parts(&named, &code, &table, 0x9000),
            vec![0x1000..0x3000]
        );
    }

    #[test]
    fn tables_it_cannot_read_give_nothing() {
        let named = 0x5000..0x5005;
        let code = jmp(0x5000, 0x1100);
        assert!(split_parts(&named, &code, &[], 0).is_empty());
        let mut other = hdr(0x9000, &[0x1000, 0x3000]);
        other[3] = 0x1b;
        assert!(split_parts(&named, &code, &other, 0x9000).is_empty());
        // A count past the table's end.
        let mut long = hdr(0x9000, &[0x1000, 0x3000]);
        long[8..12].copy_from_slice(&1000u32.to_le_bytes());
        assert!(split_parts(&named, &code, &long, 0x9000).is_empty());
        // A target past the last function start has no known end.
        let last = hdr(0x9000, &[0x1000]);
        assert!(split_parts(&named, &code, &last, 0x9000).is_empty());
    }
}
