//! The `cfi` target: a file a traced process maps, read for its unwind
//! tables (`.eh_frame_hdr`, `.eh_frame`, `.debug_frame`, `.text`) and
//! then used: mapped into a process whose stacks are unwound from
//! instruction pointers all over the mapping, through a stack of return
//! addresses into it, so the tables' entries are looked up, parsed and run.
//!
//! The kept seeds are small shared objects built from one C file (a leaf,
//! a function saving six registers, one with `alloca`, one with two
//! epilogues; `-O2 -fPIC -shared -nostdlib -fomit-frame-pointer`,
//! stripped): `eh-frame` with `.eh_frame_hdr` and `.eh_frame`;
//! `debug-frame` built with `-fno-asynchronous-unwind-tables -g`, all but
//! `.debug_frame` stripped; `debug-frame-zlib` the same compressed
//! (`objcopy --compress-debug-sections=zlib`). [`SEED_FRAMES`] are their
//! known frames.

use std::path::{Path, PathBuf};

use xpuscope_probes::maps::{MappedFiles, ProcessMaps};
use xpuscope_probes::unwind::{FileCfi, MAX_FRAMES, StackCopy, Unwinder, UserRegs};

/// Where the file is mapped (offset 0, executable).
pub const MAPPED_AT: u64 = 0x7f00_0000_0000;
/// Where the stack copy starts (`rsp`).
pub const STACK_AT: u64 = 0x7ffd_0000_0000;
/// The file's name under the scratch root, as the maps line names it.
pub const FILE: &str = "libfuzzed.so";

/// Instruction pointers spread over the mapping.
const IPS: u64 = 64;
/// Words of the stack copy.
const STACK_WORDS: u64 = 64;

/// Per seed file: an address in the body of the function saving six
/// registers (its CFA 64 bytes above `rsp`), and the return address into
/// its caller (whose CFA is 32 bytes above that), both file-relative.
pub const SEED_FRAMES: [(&str, u64, u64); 2] =
    [("debug-frame", 0x2c0, 0x377), ("eh-frame", 0x300, 0x3b7)];

pub fn cfi(data: &[u8]) {
    thread_local! {
        static ROOT: PathBuf = std::env::temp_dir().join(format!(
            "xpuscope-fuzz-cfi-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
    }
    ROOT.with(|root| {
        let written =
            std::fs::create_dir_all(root).and_then(|()| std::fs::write(root.join(FILE), data));
        if written.is_ok() {
            unwind_all(root, data.len() as u64);
        }
    });
}

/// The file under `root` read and unwound through; `len` is its size.
fn unwind_all(root: &Path, len: u64) {
    let Ok(cfi) = FileCfi::read(&root.join(FILE)) else {
        return;
    };
    // At most four sections are held, none larger than the file.
    assert!(cfi.bytes() <= 4 * len, "{} of {len}", cfi.bytes());
    for offset in [0, 0x1000, len, u64::MAX] {
        let _ = cfi.load_bias(MAPPED_AT, offset);
    }
    let span = len.next_multiple_of(0x1000).max(0x1000);
    let maps = ProcessMaps::parse(&format!(
        "{MAPPED_AT:x}-{:x} r-xp 00000000 08:01 7 /{FILE}\n",
        MAPPED_AT + span
    ));
    let mut unwinder = Unwinder::new();
    let mut process = unwinder.process(&maps, MappedFiles::Root(root));
    let stack: Vec<u8> = (0..STACK_WORDS)
        .flat_map(|i| (MAPPED_AT + (i * 0x61 + 5) % span).to_le_bytes())
        .collect();
    let copy = StackCopy {
        base: STACK_AT,
        bytes: &stack,
    };
    for k in 0..IPS {
        let regs = UserRegs {
            ip: MAPPED_AT + k * span / IPS,
            sp: STACK_AT + (k % 4) * 8,
            bp: STACK_AT + 16,
        };
        let u = process.unwind(regs, &copy, MAX_FRAMES);
        assert!(!u.frames.is_empty() && u.frames.len() <= MAX_FRAMES);
        assert!(u.stack_bytes_used <= stack.len() as u64, "{u:?}");
    }
}
