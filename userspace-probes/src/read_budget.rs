//! A file read through `object`'s [`ReadCache`](object::read::ReadCache)
//! with a limit on the bytes read. The cache keeps every range and every
//! string it reads, each string up to 4 KiB however short the name: a
//! crafted file whose many symbols or section headers name distinct
//! offsets into long runs of text would make it hold tens of times the
//! file's size (gigabytes from a file of tens of MB). Past the limit every
//! read fails, which the parsers take as a part of the file they cannot
//! read.

use std::io::{self, Read, Seek, SeekFrom};

/// A reader that refuses reads once `limit` bytes have been read.
#[derive(Debug)]
pub(crate) struct ReadBudget<R> {
    inner: R,
    left: u64,
}

impl<R> ReadBudget<R> {
    pub(crate) fn new(inner: R, limit: u64) -> Self {
        Self { inner, left: limit }
    }
}

/// The read limit for headers and symbols of a file of `len` bytes, at
/// most `cap`. Reading a well-formed file costs far less: its tables once
/// (at most the file), a name string per symbol or section (256 bytes a
/// read, for an entry of 24 or 64 bytes), so about 12 times its length.
pub(crate) fn limit_for(len: u64, cap: u64) -> u64 {
    (1u64 << 20).saturating_add(len.saturating_mul(16)).min(cap)
}

impl<R: Read> Read for ReadBudget<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(io::Error::other("read budget spent"));
        }
        let n = self.inner.read(buf)?;
        self.left -= n as u64;
        Ok(n)
    }
}

impl<R: Seek> Seek for ReadBudget<R> {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.inner.seek(pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_grows_with_the_file_up_to_the_cap() {
        assert_eq!(limit_for(0, 64 << 20), 1 << 20);
        assert_eq!(limit_for(1 << 20, 64 << 20), 17 << 20);
        assert_eq!(limit_for(u64::MAX, 64 << 20), 64 << 20);
    }

    #[test]
    fn reads_stop_at_the_limit() {
        let data = [7u8; 100];
        let mut r = ReadBudget::new(io::Cursor::new(&data[..]), 64);
        let mut buf = [0u8; 40];
        r.read_exact(&mut buf).unwrap();
        assert!(r.read_exact(&mut buf).is_err(), "40 more of 24 left");
        r.seek(SeekFrom::Start(0)).unwrap();
        r.read_exact(&mut buf[..24]).unwrap();
        assert!(r.read(&mut buf[..1]).is_err());
    }
}
