//! [`PacketReader`]: the `Trace.packet = 1` records of a trace file, one at a
//! time, with memory bounded by the largest packet (never the whole file).
//!
//! A file cut short (a crashed writer, a copy still in progress) ends at its
//! last complete packet; [`PacketReader::truncated`] then says where and how
//! much is missing.

use std::io::{self, BufRead, BufReader, Read};

/// Tag of `Trace.packet` (field 1, wire type 2).
const TRACE_PACKET_TAG: u8 = 0x0A;

/// Larger packets are refused: the writer keeps packets far smaller, so one
/// this large means a corrupt length.
pub const MAX_PACKET_BYTES: u64 = 256 << 20;

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    #[error("reading the trace: {0}")]
    Io(#[from] io::Error),
    #[error(
        "byte {offset}: expected a Trace.packet record (0x0a), found {byte:#04x}: not a native Perfetto trace, or corrupt there"
    )]
    NotATrace { offset: u64, byte: u8 },
    #[error("the trace is {0}-compressed: decompress it first (e.g. `{1}`)")]
    Compressed(&'static str, &'static str),
    #[error("byte {offset}: a packet of {len} bytes (over {MAX_PACKET_BYTES}): corrupt length")]
    PacketTooLarge { offset: u64, len: u64 },
}

/// Where a truncated trace stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncated {
    /// Offset of the first byte after the last complete packet.
    pub complete_bytes: u64,
    /// Bytes of the cut packet that are present.
    pub partial_bytes: u64,
}

/// Reads packets from a trace file.
pub struct PacketReader<R: Read> {
    input: BufReader<R>,
    offset: u64,
    packets: u64,
    buf: Vec<u8>,
    truncated: Option<Truncated>,
}

impl<R: Read> PacketReader<R> {
    pub fn new(input: R) -> Self {
        PacketReader {
            input: BufReader::with_capacity(1 << 20, input),
            offset: 0,
            packets: 0,
            buf: Vec::new(),
            truncated: None,
        }
    }

    /// Bytes of complete packets read so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Packets read so far.
    pub fn packets(&self) -> u64 {
        self.packets
    }

    /// Set once the input ended inside a packet.
    pub fn truncated(&self) -> Option<Truncated> {
        self.truncated
    }

    /// The next packet's bytes (without the framing), or `None` at the end
    /// of the input (check [`Self::truncated`]).
    pub fn next_packet(&mut self) -> Result<Option<&[u8]>, ReadError> {
        if self.truncated.is_some() {
            return Ok(None);
        }
        let tag = match self.read_byte()? {
            None => return Ok(None),
            Some(t) => t,
        };
        if tag != TRACE_PACKET_TAG {
            return Err(self.not_a_trace(tag));
        }
        let mut len = 0u64;
        let mut header = 1u64;
        for shift in (0..64).step_by(7) {
            let Some(b) = self.read_byte()? else {
                self.truncated = Some(Truncated {
                    complete_bytes: self.offset,
                    partial_bytes: header,
                });
                return Ok(None);
            };
            header += 1;
            len |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
        }
        if len > MAX_PACKET_BYTES {
            return Err(ReadError::PacketTooLarge {
                offset: self.offset,
                len,
            });
        }
        self.buf.clear();
        let got = (&mut self.input).take(len).read_to_end(&mut self.buf)? as u64;
        if got < len {
            self.truncated = Some(Truncated {
                complete_bytes: self.offset,
                partial_bytes: header + got,
            });
            return Ok(None);
        }
        self.offset += header + len;
        self.packets += 1;
        Ok(Some(&self.buf))
    }

    fn read_byte(&mut self) -> io::Result<Option<u8>> {
        let available = self.input.fill_buf()?;
        let Some(&b) = available.first() else {
            return Ok(None);
        };
        self.input.consume(1);
        Ok(Some(b))
    }

    fn not_a_trace(&self, byte: u8) -> ReadError {
        if self.offset == 0 {
            if byte == 0x1f {
                return ReadError::Compressed("gzip", "gunzip -k trace.pftrace.gz");
            }
            if byte == 0x28 {
                return ReadError::Compressed("zstd", "zstd -d trace.pftrace.zst");
            }
        }
        ReadError::NotATrace {
            offset: self.offset,
            byte,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(payloads: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in payloads {
            out.push(TRACE_PACKET_TAG);
            prost::encoding::encode_varint(p.len() as u64, &mut out);
            out.extend_from_slice(p);
        }
        out
    }

    #[test]
    fn reads_packets_back_to_back() {
        let big = vec![7u8; 300];
        let bytes = framed(&[b"ab", &big, b""]);
        let mut r = PacketReader::new(bytes.as_slice());
        assert_eq!(r.next_packet().unwrap(), Some(&b"ab"[..]));
        assert_eq!(r.next_packet().unwrap().map(<[u8]>::len), Some(300));
        assert_eq!(r.next_packet().unwrap(), Some(&b""[..]));
        assert_eq!(r.next_packet().unwrap(), None);
        assert_eq!(r.truncated(), None);
        assert_eq!(r.offset(), bytes.len() as u64);
        assert_eq!(r.packets(), 3);
    }

    #[test]
    fn a_cut_packet_ends_the_trace_and_is_reported() {
        let bytes = framed(&[b"abc", b"defgh"]);
        let cut = &bytes[..bytes.len() - 2];
        let mut r = PacketReader::new(cut);
        assert_eq!(r.next_packet().unwrap(), Some(&b"abc"[..]));
        assert_eq!(r.next_packet().unwrap(), None);
        assert_eq!(
            r.truncated(),
            Some(Truncated {
                complete_bytes: 5,
                partial_bytes: 5
            })
        );
        // Cut inside the length varint.
        let mut long = framed(&[&[1u8; 200]]);
        long.truncate(2);
        let mut r = PacketReader::new(long.as_slice());
        assert_eq!(r.next_packet().unwrap(), None);
        assert_eq!(r.truncated().map(|t| t.complete_bytes), Some(0));
    }

    #[test]
    fn other_files_are_refused_by_name() {
        let err = |b: &[u8]| PacketReader::new(b).next_packet().unwrap_err().to_string();
        assert!(err(&[0x1f, 0x8b, 0]).contains("gzip"));
        assert!(err(&[0x28, 0xb5, 0x2f, 0xfd]).contains("zstd"));
        assert!(err(b"{\"json\": 1}").contains("not a native Perfetto trace"));
        let mut bytes = framed(&[b"ok"]);
        bytes.push(0x12);
        let mut r = PacketReader::new(bytes.as_slice());
        r.next_packet().unwrap();
        assert!(matches!(
            r.next_packet(),
            Err(ReadError::NotATrace { offset: 4, .. })
        ));
    }
}
