//! Opening a file whose path a traced process chose.
//!
//! The agent is privileged and reads files named by traced processes: the
//! libraries their `LD_LIBRARY_PATH`, RPATH and maps point at, their
//! loader cache, their interpreter. Any local user can become traced, so
//! such a path may name a FIFO (`open` waits for a writer: forever), a
//! terminal or another device (opening one runs its driver), or a socket.
//! Every such open here goes through [`open`]: only regular files are
//! opened, and the open itself never waits.

use std::fs::File;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Opens `path` for reading if it is a regular file (symbolic links
/// followed: libraries are reached through them). Anything else is an
/// `InvalidInput` error naming what it is, and is never opened.
///
/// The type is checked before the open (so a device's driver is never
/// called) and again on the open descriptor (a path swapped in between is
/// refused); `O_NONBLOCK` keeps a FIFO swapped in between from blocking
/// the open itself.
pub fn open(path: &Path) -> io::Result<File> {
    let before = std::fs::metadata(path)?;
    if !before.is_file() {
        return Err(not_regular(&before));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let after = file.metadata()?;
    if !after.is_file() {
        return Err(not_regular(&after));
    }
    if (after.dev(), after.ino()) != (before.dev(), before.ino()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "replaced while being opened",
        ));
    }
    Ok(file)
}

/// At most `limit` bytes of the regular file at `path`; a longer file is
/// an error (`FileTooLarge`), so a caller never parses a cut copy.
pub fn read_bounded(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let file = open(path)?;
    let len = file.metadata()?.len();
    if len > limit {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("{len} bytes, more than the {limit} read"),
        ));
    }
    let mut out = Vec::with_capacity(len as usize);
    // `take`: the file may grow after the size was read.
    file.take(limit + 1).read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("grew past the {limit} bytes read"),
        ));
    }
    Ok(out)
}

fn not_regular(meta: &std::fs::Metadata) -> io::Error {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    let what = if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    };
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file: not read"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "xpuscope-regular-file-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = temp_dir("fifo");
        let fifo = dir.join("libc.so.6");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = Instant::now();
        let err = open(&fifo).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("a FIFO"), "{err}");
        let err = read_bounded(&fifo, 1 << 20).unwrap_err();
        assert!(err.to_string().contains("a FIFO"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devices_and_directories_are_refused() {
        for (path, what) in [
            ("/dev/null", "a character device"),
            ("/dev/tty", "a character device"),
            ("/", "a directory"),
        ] {
            let err = open(Path::new(path)).unwrap_err();
            assert!(err.to_string().contains(what), "{path}: {err}");
        }
    }

    #[test]
    fn regular_files_and_links_to_them_read() {
        let dir = temp_dir("regular");
        let file = dir.join("libfoo.so.1.2");
        std::fs::write(&file, b"0123456789").unwrap();
        let link = dir.join("libfoo.so.1");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_bounded(&link, 10).unwrap(), b"0123456789");
        let err = read_bounded(&link, 9).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::FileTooLarge);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
