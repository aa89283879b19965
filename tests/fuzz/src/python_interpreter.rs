//! The `python_interpreter` target: the files a process maps, looked at
//! for a CPython interpreter (`_PyRuntime`, `Py_Version`, the evaluation
//! loop and the type objects in their ELF symbols, the version in the
//! file name or in `Py_Version`'s word).
//!
//! Input: byte 0 picks the mapped file's name ([`NAMES`]), the next 8
//! bytes are the word every read of the process's memory returns (so
//! `Py_Version`'s), the rest is the file. The kept seeds are small shared
//! objects defining those symbols, built from one C file (`-O2 -fPIC
//! -shared -nostdlib`, the `.cold` part in assembly), with `Py_Version`
//! (`seed-3.11`, word 3.11.7) and without (`seed-3.10`, the version from
//! the name).

use std::path::{Path, PathBuf};

use xpuscope_probes::maps::{MappedFiles, ProcessMaps};
use xpuscope_probes::python::memory::{Memory, ReadError};
use xpuscope_probes::python::{Interpreter, MAX_EVAL_FRAMES, PyError};

/// What the mapped file is called: names taken for an interpreter, with a
/// version or without, and one that is not.
pub const NAMES: [&str; 6] = [
    "libpython3.11.so.1.0",
    "libpython3.10.so.1.0",
    "python3.12",
    "python",
    "python3.9",
    "libc.so.6",
];

/// Where the file is mapped.
pub const BASE: u64 = 0x7f10_0000_0000;

/// Memory that holds one word everywhere.
struct Word([u8; 8]);

impl Memory for Word {
    fn read(&self, _addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.0[i % 8];
        }
        Ok(())
    }
}

pub fn python_interpreter(data: &[u8]) {
    thread_local! {
        static ROOT: PathBuf = std::env::temp_dir().join(format!(
            "xpuscope-fuzz-python-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
    }
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Some((word, file)) = rest.split_first_chunk::<8>() else {
        return;
    };
    let name = NAMES[usize::from(pick) % NAMES.len()];
    ROOT.with(|root| {
        let written =
            std::fs::create_dir_all(root).and_then(|()| std::fs::write(root.join(name), file));
        if written.is_ok() {
            find(root, name, *word);
        }
    });
}

/// The interpreter of a process that maps `root/name` (its first page
/// read-only, the rest executable), with `word` in its memory.
pub fn find(root: &Path, name: &str, word: [u8; 8]) -> Option<Interpreter> {
    let maps = ProcessMaps::parse(&format!(
        "{BASE:x}-{:x} r--p 00000000 08:01 9 /{name}\n\
         {:x}-{:x} r-xp 00001000 08:01 9 /{name}\n",
        BASE + 0x1000,
        BASE + 0x1000,
        BASE + 0x3000,
    ));
    match Interpreter::find(&maps, MappedFiles::Root(root), || {
        Ok::<_, PyError>(Word(word))
    }) {
        Ok(Some((i, _))) => {
            assert_eq!(i.path, format!("/{name}"));
            assert_eq!(i.version.0, 3, "{i:?}");
            assert!(i.version.1 >= 10, "{i:?}");
            assert!(i.eval_frames.len() <= MAX_EVAL_FRAMES, "{i:?}");
            assert!(i.eval_frames.iter().all(|r| r.start < r.end), "{i:?}");
            Some(i)
        }
        Ok(None) => None,
        Err(e) => {
            let _ = e.to_string();
            None
        }
    }
}
