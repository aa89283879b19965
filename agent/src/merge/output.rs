//! The merged trace's file: packets encoded and written as they come.

use std::fs::File;
use std::io::{BufWriter, Write};

use anyhow::{Context, Result};
use xpuscope_perfetto::rewrite::Packet;

/// Buffers encoded packets for the output file.
pub struct Output {
    out: BufWriter<File>,
    buf: Vec<u8>,
    pub bytes: u64,
}

impl Output {
    pub fn create(path: &std::path::Path) -> Result<Output> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Output {
            out: BufWriter::with_capacity(1 << 20, file),
            buf: Vec::with_capacity(1 << 16),
            bytes: 0,
        })
    }

    pub fn write(&mut self, p: &Packet) -> Result<()> {
        self.buf.clear();
        p.encode_framed(&mut self.buf);
        self.bytes += self.buf.len() as u64;
        self.out
            .write_all(&self.buf)
            .context("writing the merged trace")
    }

    pub fn finish(mut self) -> Result<()> {
        self.out.flush().context("writing the merged trace")
    }
}
