//! Framing: each `TracePacket` becomes one `Trace.packet = 1` record
//! (`0x0A <varint length> <packet bytes>`), buffered before reaching the
//! caller's writer.

use std::io::{self, Write};

use prost::Message;

use crate::proto::TracePacket;

/// Tag of `Trace.packet` (field 1, wire type 2).
const TRACE_PACKET_TAG: u8 = 0x0A;

/// Buffered bytes are handed to the writer once they reach this size.
const FLUSH_THRESHOLD: usize = 256 * 1024;

/// Encodes packets into a reusable buffer and writes it out in large chunks.
pub(crate) struct PacketSink<W: Write> {
    out: W,
    buf: Vec<u8>,
    written: u64,
    machine_id: Option<u32>,
}

impl<W: Write> PacketSink<W> {
    pub(crate) fn new(out: W, machine_id: Option<u32>) -> Self {
        PacketSink {
            out,
            buf: Vec::with_capacity(FLUSH_THRESHOLD + 64 * 1024),
            written: 0,
            machine_id,
        }
    }

    /// Appends `packet` (stamped with the machine id) to the stream.
    pub(crate) fn write(&mut self, packet: &mut TracePacket) -> io::Result<()> {
        packet.machine_id = self.machine_id;
        let before = self.buf.len();
        self.buf.push(TRACE_PACKET_TAG);
        // The length, then the packet: one pass computing the length (an
        // explicit `encoded_len` then `encode` took two, each as costly as
        // encoding a compact sched bundle's packed arrays).
        packet
            .encode_length_delimited(&mut self.buf)
            .map_err(|e| io::Error::other(format!("encoding a TracePacket: {e}")))?;
        self.written += (self.buf.len() - before) as u64;
        if self.buf.len() >= FLUSH_THRESHOLD {
            self.flush_buffer()?;
        }
        Ok(())
    }

    /// Appends a packet its caller encodes: `encode` gets the buffer, just
    /// after the `Trace.packet` tag, and the machine id to stamp, and
    /// appends the packet's length and bytes.
    pub(crate) fn write_encoded(
        &mut self,
        encode: impl FnOnce(&mut Vec<u8>, Option<u32>),
    ) -> io::Result<()> {
        let before = self.buf.len();
        self.buf.push(TRACE_PACKET_TAG);
        encode(&mut self.buf, self.machine_id);
        self.written += (self.buf.len() - before) as u64;
        if self.buf.len() >= FLUSH_THRESHOLD {
            self.flush_buffer()?;
        }
        Ok(())
    }

    /// Bytes of complete packets produced so far (written or buffered).
    pub(crate) fn bytes_written(&self) -> u64 {
        self.written
    }

    fn flush_buffer(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.out.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    /// Hands every buffered byte to the writer and flushes it.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.flush_buffer()?;
        self.out.flush()
    }

    /// Flushes and returns the writer.
    pub(crate) fn into_inner(mut self) -> io::Result<W> {
        self.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads one varint, returning it and the bytes it took.
    fn read_varint(bytes: &[u8]) -> (u64, usize) {
        let mut value = 0u64;
        for (i, b) in bytes.iter().enumerate() {
            value |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return (value, i + 1);
            }
        }
        panic!("truncated varint");
    }

    #[test]
    fn frames_packets_as_trace_field_one() {
        let mut sink = PacketSink::new(Vec::new(), Some(7));
        let mut p = TracePacket {
            timestamp: Some(300),
            ..TracePacket::default()
        };
        sink.write(&mut p).unwrap();
        let n = sink.bytes_written();
        let bytes = sink.into_inner().unwrap();
        assert_eq!(bytes.len() as u64, n);
        assert_eq!(bytes[0], 0x0A);
        let (len, used) = read_varint(&bytes[1..]);
        assert_eq!(1 + used + len as usize, bytes.len());
        // timestamp = 8 (varint 300 = ac 02), machine_id = 98 (tag 0x90 0x06).
        assert_eq!(&bytes[1 + used..], &[0x40, 0xac, 0x02, 0x90, 0x06, 7]);
    }

    #[test]
    fn long_packets_get_multibyte_lengths() {
        let mut sink = PacketSink::new(Vec::new(), None);
        let mut p = TracePacket {
            system_info: Some(crate::proto::SystemInfo {
                machine_name: Some("x".repeat(300)),
                ..Default::default()
            }),
            ..TracePacket::default()
        };
        sink.write(&mut p).unwrap();
        let bytes = sink.into_inner().unwrap();
        let (len, used) = read_varint(&bytes[1..]);
        assert_eq!(used, 2);
        assert_eq!(1 + used + len as usize, bytes.len());
    }
}
