//! The `python_frames` target: a memory image read as a CPython process's
//! interpreter state (thread list, frames, code objects, strings, line
//! tables) through every version's layout.
//!
//! Input: byte 0 picks the layout (3.10-3.14), the rest is the memory at
//! [`BASE`], where `_PyRuntime` is. [`seed`] builds a well-formed image
//! (one thread, two Python frames) so mutations start deep in the walk.

use xpuscope_probes::python::layout::{self, EntryMark, FrameRoot, Layout, LineTableFormat};
use xpuscope_probes::python::linetable;
use xpuscope_probes::python::memory::ImageMemory;
use xpuscope_probes::python::walk::{FrameReader, KnownTypes};

/// Where the image is mapped (and `_PyRuntime` is).
pub const BASE: u64 = 0x10_0000;

pub const LAYOUTS: [&Layout; 5] = [
    &layout::PY310,
    &layout::PY311,
    &layout::PY312,
    &layout::PY313,
    &layout::PY314,
];

pub fn python_frames(data: &[u8]) {
    let Some((&v, image)) = data.split_first() else {
        return;
    };
    let layout = LAYOUTS[usize::from(v) % LAYOUTS.len()];
    let mut mem = ImageMemory::new();
    mem.map(BASE, image.to_vec());
    let mut reader = FrameReader::new(mem, *layout, BASE, KnownTypes::default());
    if let Ok(threads) = reader.thread_states() {
        for t in threads.iter().take(8) {
            if let Ok(frames) = reader.frames_at(t.addr) {
                assert!(frames.len() <= xpuscope_probes::python::walk::MAX_PY_FRAMES);
            }
        }
    }
    // The image as a line table too, in both encodings.
    for format in [LineTableFormat::Pairs310, LineTableFormat::Locations311] {
        for lasti in [0, 1, 7, 100, u64::MAX / 2, u64::MAX] {
            let _ = linetable::line_for(format, image, 1, lasti);
            let _ = linetable::line_for(format, image, i32::MIN, lasti);
        }
    }
}

// Offsets of the seed's objects inside the image.
const INTERP: u64 = 0x300;
const TSTATE: u64 = 0x2000;
const CFRAME: u64 = 0x20f0;
const PTHREAD: u64 = 0x2100;
const FRAMES: [u64; 3] = [0x2400, 0x2480, 0x2500];
const CODE: u64 = 0x2600;
const NAME: u64 = 0x2700;
const FILE: u64 = 0x2780;
const TABLE: u64 = 0x2800;
const END: usize = 0x2900;
/// The seed thread's kernel tid.
pub const SEED_TID: u32 = 4242;
pub const SEED_FUNCTION: &str = "train_step";
pub const SEED_FILE: &str = "/job/train.py";

fn put(img: &mut [u8], at: u64, bytes: &[u8]) {
    img[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
}

fn ptr(img: &mut [u8], at: u64, to: u64) {
    put(img, at, &(BASE + to).to_le_bytes());
}

fn ascii(img: &mut [u8], l: &Layout, at: u64, s: &str) {
    put(img, at + 16, &(s.len() as u64).to_le_bytes());
    // kind 1, compact, ascii
    put(img, at + 32, &(1u32 << 2 | 1 << 5 | 1 << 6).to_le_bytes());
    put(img, at + l.ascii_header, s.as_bytes());
}

/// A well-formed image for layout `v`: one thread (tid [`SEED_TID`]) in
/// two frames of [`SEED_FUNCTION`] at instructions 2 and 5 (lines 11 and
/// 12 with 3.10's table, 11 and 11 with 3.11+'s), the outer one entered
/// from C.
pub fn seed(v: u8) -> Vec<u8> {
    let l = LAYOUTS[usize::from(v) % LAYOUTS.len()];
    let mut img = vec![0u8; END];
    ptr(&mut img, l.runtime_interpreters_head, INTERP);
    ptr(&mut img, INTERP + l.interp_threads_head, TSTATE);
    match l.tstate_native_thread_id {
        Some(off) => put(&mut img, TSTATE + off, &u64::from(SEED_TID).to_le_bytes()),
        None => {
            ptr(&mut img, TSTATE + l.tstate_thread_id, PTHREAD);
            ptr(&mut img, PTHREAD + layout::PTHREAD_SELF, PTHREAD);
            put(
                &mut img,
                PTHREAD + layout::PTHREAD_TID,
                &SEED_TID.to_le_bytes(),
            );
        }
    }
    match l.frame_root {
        FrameRoot::FrameObject { frame }
        | FrameRoot::Direct {
            current_frame: frame,
        } => ptr(&mut img, TSTATE + frame, FRAMES[0]),
        FrameRoot::CFrame {
            cframe,
            current_frame,
        } => {
            ptr(&mut img, TSTATE + cframe, CFRAME);
            ptr(&mut img, CFRAME + current_frame, FRAMES[0]);
        }
    }
    ptr(&mut img, FRAMES[0] + l.frame_previous, FRAMES[1]);
    for (i, lasti) in [(0, 2u64), (1, 5)] {
        let f = FRAMES[i];
        ptr(&mut img, f + l.frame_code, CODE);
        match l.code_instructions {
            Some(start) => ptr(&mut img, f + l.frame_instr, CODE + start + 2 * lasti),
            None => put(&mut img, f + l.frame_instr, &(lasti as i32).to_le_bytes()),
        }
    }
    match l.entry {
        EntryMark::EveryFrame => {}
        EntryMark::IsEntryByte(off) => img[(FRAMES[1] + off) as usize] = 1,
        EntryMark::CStackOwner { owner, cstack } => {
            ptr(&mut img, FRAMES[1] + l.frame_previous, FRAMES[2]);
            img[(FRAMES[2] + owner) as usize] = cstack;
        }
    }
    ptr(&mut img, CODE + l.code_filename, FILE);
    ptr(
        &mut img,
        CODE + l.code_qualname.unwrap_or(l.code_name),
        NAME,
    );
    ptr(&mut img, CODE + l.code_linetable, TABLE);
    put(&mut img, CODE + l.code_firstlineno, &10i32.to_le_bytes());
    ascii(&mut img, l, NAME, SEED_FUNCTION);
    ascii(&mut img, l, FILE, SEED_FILE);
    let table: &[u8] = match l.linetable {
        LineTableFormat::Pairs310 => &[8, 1, 8, 1],
        LineTableFormat::Locations311 => &[0x80 | 13 << 3 | 3, 2, 0x80 | 3, 0x11],
    };
    put(&mut img, TABLE + 16, &(table.len() as u64).to_le_bytes());
    put(&mut img, TABLE + 32, table);
    let mut input = vec![v];
    input.extend(img);
    input
}
