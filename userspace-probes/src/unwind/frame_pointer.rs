//! The frame-pointer walk over a stack copy: what `bpf_get_stack` does in
//! the kernel today, kept here as the baseline the CFI unwinder is measured
//! against (frames recovered, time per stack).

use super::{StackCopy, UserRegs};

/// Walks the `rbp` chain: frame 0 is `regs.ip`, then the return address
/// saved above each frame pointer. Stops where the chain leaves the copy,
/// stops growing (a corrupt or absent chain), or after `max_frames`.
pub fn frame_pointer_walk(regs: UserRegs, stack: &StackCopy<'_>, max_frames: usize) -> Vec<u64> {
    let mut frames = Vec::with_capacity(16);
    if max_frames == 0 {
        return frames;
    }
    frames.push(regs.ip);
    let mut bp = regs.bp;
    while frames.len() < max_frames {
        let (Some(next_bp), Some(ret)) = (stack.read_u64(bp), stack.read_u64(bp.wrapping_add(8)))
        else {
            break;
        };
        if ret == 0 {
            break;
        }
        frames.push(ret);
        // The stack grows down: a caller's frame is always above.
        if next_bp <= bp {
            break;
        }
        bp = next_bp;
    }
    frames
}
