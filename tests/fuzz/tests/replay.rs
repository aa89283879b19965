//! The stable, bounded run of every fuzz target inside `cargo test`: the
//! kept corpus (`tests/fuzz/corpus/<target>/`, including every crash found
//! so far) replayed, then a fixed number of seeded mutations of it. A panic,
//! or a case whose heap peaks above [`memory_bound`] of its input, fails
//! the test with the input saved under `target/fuzz-failures/` (a panic's
//! also in hex), ready to become a unit test.
//!
//! `XPUSCOPE_FUZZ_CASES` changes the number of mutated inputs per target
//! (default 4,000; the targets that read a file run a tenth: each case
//! writes one).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use xpuscope_fuzz::mutate::{Rng, mutate};

/// Targets that write each input to a file (slower per case).
const FILE_TARGETS: [&str; 3] = ["elf", "cfi", "python_interpreter"];

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = fuzz_dir().join("corpus").join(target);
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the kept corpus {} ({e})", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    entries.sort();
    entries
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display())))
        .collect()
}

fn save_failure(target: &str, input: &[u8]) -> PathBuf {
    let dir = fuzz_dir().join("../../target/fuzz-failures");
    let _ = std::fs::create_dir_all(&dir);
    let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    });
    let path = dir.join(format!("{target}-{hash:016x}"));
    let _ = std::fs::write(&path, input);
    path
}

/// Counts each thread's live heap bytes and their peak, so a case's peak
/// memory is known (every target runs on its test's thread).
struct Counting;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn count(delta: i64) {
    let _ = LIVE.try_with(|l| {
        l.set(l.get() + delta);
        let _ = PEAK.try_with(|p| p.set(p.get().max(l.get())));
    });
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        // SAFETY: the caller's contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as i64));
        // SAFETY: the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as i64 - layout.size() as i64);
        // SAFETY: the caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Peak heap bytes above the start while `f` runs on this thread.
fn peak_during(f: impl FnOnce()) -> i64 {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    f();
    PEAK.with(Cell::get) - start
}

/// What a case may hold at its peak: a parser keeps what it read of its
/// input, in proportion to it, never what the input claims.
fn memory_bound(input: &[u8]) -> i64 {
    (1 << 20) + 64 * input.len() as i64
}

fn run_one(target: &str, f: xpuscope_fuzz::Target, input: &[u8], what: &str) {
    let mut peak = 0;
    let ran = catch_unwind(AssertUnwindSafe(|| peak = peak_during(|| f(input))));
    if ran.is_ok() && peak > memory_bound(input) {
        let saved = save_failure(target, input);
        panic!(
            "fuzz target {target} held {peak} bytes at its peak on {what} ({} bytes, saved as {})",
            input.len(),
            saved.display()
        );
    }
    if ran.is_err() {
        let saved = save_failure(target, input);
        let hex: Vec<String> = input.iter().map(|b| format!("{b:02x}")).collect();
        panic!(
            "fuzz target {target} panicked on {what} ({} bytes, saved as {}): {}",
            input.len(),
            saved.display(),
            hex.join("")
        );
    }
}

fn replay(target: &str) {
    let f = xpuscope_fuzz::target(target).expect("a known target");
    let kept = corpus(target);
    assert!(!kept.is_empty(), "{target}: the kept corpus is empty");
    for (i, input) in kept.iter().enumerate() {
        run_one(target, f, input, &format!("corpus entry {i}"));
    }
    let cases: usize = std::env::var("XPUSCOPE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4_000);
    let cases = if FILE_TARGETS.contains(&target) {
        cases / 10
    } else {
        cases
    };
    // One seed per target, so a failure reproduces with the same run.
    let seed = target
        .bytes()
        .fold(17u64, |h, b| h.wrapping_mul(131) + u64::from(b));
    let mut rng = Rng::new(seed);
    let max_len = kept.iter().map(Vec::len).max().unwrap_or(0).max(256) * 2;
    for case in 0..cases {
        let input = mutate(&mut rng, &kept, max_len);
        run_one(target, f, &input, &format!("mutation {case} (seed {seed})"));
    }
}

#[test]
fn every_target_has_a_test_and_a_corpus() {
    let names: Vec<&str> = xpuscope_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "activity",
            "device_calls",
            "elf",
            "placement",
            "maps",
            "procfs",
            "btf",
            "environ",
            "ld_cache",
            "elf_dynamic",
            "python_frames",
            "cfi",
            "python_interpreter"
        ]
    );
    for n in names {
        assert!(
            Path::new(&fuzz_dir().join("corpus").join(n)).is_dir(),
            "{n}"
        );
        assert!(
            fuzz_dir()
                .join(format!("libfuzzer/fuzz_targets/{n}.rs"))
                .is_file(),
            "{n} has a libFuzzer entry point"
        );
    }
}

#[test]
fn activity() {
    replay("activity");
}

#[test]
fn device_calls() {
    replay("device_calls");
}

#[test]
fn elf() {
    replay("elf");
}

#[test]
fn placement() {
    replay("placement");
}

#[test]
fn maps() {
    replay("maps");
}

#[test]
fn procfs() {
    replay("procfs");
}

#[test]
fn environ() {
    replay("environ");
}

#[test]
fn btf() {
    replay("btf");
}

#[test]
fn ld_cache() {
    replay("ld_cache");
}

#[test]
fn elf_dynamic() {
    replay("elf_dynamic");
}

#[test]
fn python_frames() {
    replay("python_frames");
}

#[test]
fn cfi() {
    replay("cfi");
}

#[test]
fn python_interpreter() {
    replay("python_interpreter");
}

/// The kept seeds are interpreters: found with their version (from
/// `Py_Version`, or from the file name), the evaluation loop in two
/// ranges and the type objects.
#[test]
fn python_interpreter_seeds_find() {
    use xpuscope_fuzz::python_interpreter::{BASE, NAMES, find};
    let root = std::env::temp_dir().join(format!("xpuscope-fuzz-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&root).expect("scratch");
    // (seed, version, the function, its .cold part, _PyRuntime) in the file.
    let seeds = [
        ("seed-3.10", (3, 10, 0), 0x2a0, 0x290, 0x14a0),
        ("seed-3.11", (3, 11, 7), 0x2d0, 0x2c0, 0x14e0),
    ];
    for (seed, version, eval, cold, runtime) in seeds {
        let input = std::fs::read(fuzz_dir().join("corpus/python_interpreter").join(seed))
            .expect("kept seed");
        let name = NAMES[usize::from(input[0]) % NAMES.len()];
        std::fs::write(root.join(name), &input[9..]).expect("write");
        let word = input[1..9].try_into().expect("8 bytes");
        let i = find(&root, name, word).unwrap_or_else(|| panic!("{seed}: no interpreter"));
        assert_eq!(i.version, version, "{seed}");
        assert_eq!(
            i.eval_frames,
            [BASE + eval..BASE + eval + 5, BASE + cold..BASE + cold + 2],
            "{seed}"
        );
        assert_eq!(i.runtime, BASE + runtime, "{seed}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The kept seeds' tables are read and used: from the body of the
/// function that saves six registers, the unwind finds its caller by
/// their CFI (`.eh_frame` through `.eh_frame_hdr`, or `.debug_frame`),
/// and stops at the zero return address above it.
#[test]
fn cfi_seeds_unwind() {
    use xpuscope_fuzz::cfi::{MAPPED_AT, SEED_FRAMES, STACK_AT};
    use xpuscope_probes::maps::{MappedFiles, ProcessMaps};
    use xpuscope_probes::unwind::{StackCopy, Unwinder, UserRegs};
    let root = fuzz_dir().join("corpus/cfi");
    for (seed, ip, ret) in SEED_FRAMES {
        let maps = ProcessMaps::parse(&format!(
            "{MAPPED_AT:x}-{:x} r-xp 00000000 08:01 7 /{seed}\n",
            MAPPED_AT + 0x1000
        ));
        let mut unwinder = Unwinder::new();
        let mut process = unwinder.process(&maps, MappedFiles::Root(&root));
        assert_eq!(process.modules(), 1, "{seed}");
        // The return address 56 bytes above rsp (CFA - 8), then the
        // caller's 24 bytes above its CFA... zero.
        let mut stack = vec![0u8; 128];
        stack[56..64].copy_from_slice(&(MAPPED_AT + ret).to_le_bytes());
        let copy = StackCopy {
            base: STACK_AT,
            bytes: &stack,
        };
        let regs = UserRegs {
            ip: MAPPED_AT + ip,
            sp: STACK_AT,
            bp: 0,
        };
        let u = process.unwind(regs, &copy, 127);
        assert_eq!(u.frames, [MAPPED_AT + ip, MAPPED_AT + ret], "{seed}: {u:?}");
        assert!(!u.truncated, "{seed}: {u:?}");
        assert_eq!(u.stack_bytes_used, 64 + 32, "{seed}");
    }
}

/// The kept seeds are well-formed images: every layout's walk reaches
/// both frames with their names and lines (so mutations start deep).
#[test]
fn python_frames_seeds_walk() {
    use xpuscope_fuzz::python_frames::{BASE, LAYOUTS, SEED_FILE, SEED_FUNCTION, SEED_TID, seed};
    use xpuscope_probes::python::memory::ImageMemory;
    use xpuscope_probes::python::walk::{FrameReader, KnownTypes};
    for v in 0..LAYOUTS.len() as u8 {
        let input = seed(v);
        let kept = fuzz_dir().join(format!("corpus/python_frames/seed-3.{}", 10 + v));
        if std::env::var_os("XPUSCOPE_WRITE_SEEDS").is_some() {
            std::fs::write(&kept, &input).expect("write seed");
        }
        assert_eq!(
            std::fs::read(&kept).expect("kept seed"),
            input,
            "{} is the seed (XPUSCOPE_WRITE_SEEDS=1 rewrites it)",
            kept.display()
        );
        let layout = LAYOUTS[usize::from(v)];
        let mut mem = ImageMemory::new();
        mem.map(BASE, input[1..].to_vec());
        let mut r = FrameReader::new(mem, *layout, BASE, KnownTypes::default());
        let threads = r.thread_states().expect("threads");
        assert_eq!(threads.len(), 1);
        assert_eq!(threads[0].tid, Some(SEED_TID));
        let frames = r.frames_at(threads[0].addr).expect("frames");
        let got: Vec<_> = frames
            .iter()
            .map(|f| (f.function.as_str(), f.file.as_str(), f.line, f.entry))
            .collect();
        let second = if v == 0 { 12 } else { 11 };
        assert_eq!(
            got,
            [
                (SEED_FUNCTION, SEED_FILE, Some(11), v == 0),
                (SEED_FUNCTION, SEED_FILE, Some(second), true)
            ],
            "3.{}",
            10 + v
        );
    }
}
