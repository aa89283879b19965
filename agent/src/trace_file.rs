//! Keeping a trace file valid when writing it fails part-way (a full disk,
//! a quota): the file is cut back to the end of its last complete packet.
//!
//! A Perfetto trace is a sequence of `Trace.packet` records, each the tag
//! byte 0x0A, a varint length and that many bytes; a prefix that ends on a
//! record boundary is itself a valid trace.

use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

const PACKET_TAG: u8 = 0x0a;

fn read_varint(r: &mut impl Read) -> io::Result<Option<u64>> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let mut byte = [0u8];
        if r.read(&mut byte)? == 0 {
            return Ok(None);
        }
        value |= u64::from(byte[0] & 0x7f) << shift;
        if byte[0] & 0x80 == 0 {
            return Ok(Some(value));
        }
    }
    Ok(None)
}

/// Length of the longest prefix of `file` made of complete packets.
pub fn complete_prefix(file: &mut File) -> io::Result<u64> {
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(0))?;
    let mut reader = BufReader::new(file);
    let mut pos = 0u64;
    loop {
        let mut tag = [0u8];
        if reader.read(&mut tag)? == 0 || tag[0] != PACKET_TAG {
            return Ok(pos);
        }
        let Some(size) = read_varint(&mut reader)? else {
            return Ok(pos);
        };
        let header = 1 + varint_len(size);
        let end = pos + header + size;
        if end > len {
            return Ok(pos);
        }
        reader.seek_relative(size as i64)?;
        pos = end;
    }
}

fn varint_len(mut v: u64) -> u64 {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// Cuts `path` back to its last complete packet; returns the new length.
pub fn cut_to_complete_packets(path: &Path) -> io::Result<u64> {
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    let keep = complete_prefix(&mut file)?;
    file.set_len(keep)?;
    file.sync_all()?;
    Ok(keep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn packet(payload: &[u8]) -> Vec<u8> {
        let mut v = vec![PACKET_TAG];
        let mut n = payload.len() as u64;
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            v.push(if n > 0 { b | 0x80 } else { b });
            if n == 0 {
                break;
            }
        }
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn cuts_a_torn_packet_and_keeps_whole_ones() {
        let dir = std::env::temp_dir().join(format!("xpuscope-cut-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.pftrace");
        let a = packet(&[1; 10]);
        let b = packet(&[2; 300]);
        let c = packet(&[3; 50]);
        let mut f = File::create(&path).unwrap();
        f.write_all(&a).unwrap();
        f.write_all(&b).unwrap();
        f.write_all(&c[..20]).unwrap(); // torn by a full disk
        drop(f);
        assert_eq!(
            cut_to_complete_packets(&path).unwrap(),
            (a.len() + b.len()) as u64
        );
        let mut whole = a.clone();
        whole.extend_from_slice(&b);
        assert_eq!(std::fs::read(&path).unwrap(), whole);
        // Already whole: unchanged.
        assert_eq!(cut_to_complete_packets(&path).unwrap(), whole.len() as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
