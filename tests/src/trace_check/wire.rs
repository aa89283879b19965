//! A minimal protobuf wire reader for fields newer than the v51 schema of
//! `perfetto_protos`, which rust-protobuf keeps as unknown fields
//! (`TracePacket.stack_sample = 135`, `TrackEvent.callstack_iid = 56`, ...).

use protobuf::UnknownFields;
use protobuf::UnknownValueRef;

/// One field value as found on the wire.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Wire<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

impl Wire<'_> {
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match *self {
            Wire::Varint(v) | Wire::Fixed64(v) => Some(v),
            Wire::Fixed32(v) => Some(u64::from(v)),
            Wire::Bytes(_) => None,
        }
    }
}

fn varint(bytes: &[u8], pos: &mut usize) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*pos).ok_or("truncated varint")?;
        *pos += 1;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("varint longer than 10 bytes".into())
}

fn take<'a>(bytes: &'a [u8], pos: &mut usize, n: usize) -> Result<&'a [u8], String> {
    let end = pos.checked_add(n).filter(|&e| e <= bytes.len());
    let end = end.ok_or_else(|| format!("field of {n} bytes runs past the message"))?;
    let out = &bytes[*pos..end];
    *pos = end;
    Ok(out)
}

/// Every `(field number, value)` of a serialized message, in order.
pub(crate) fn fields(bytes: &[u8]) -> Result<Vec<(u32, Wire<'_>)>, String> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let key = varint(bytes, &mut pos)?;
        let number = u32::try_from(key >> 3).map_err(|_| "field number too large")?;
        let value = match key & 7 {
            0 => Wire::Varint(varint(bytes, &mut pos)?),
            1 => Wire::Fixed64(u64::from_le_bytes(
                take(bytes, &mut pos, 8)?.try_into().expect("8 bytes"),
            )),
            2 => {
                let n = usize::try_from(varint(bytes, &mut pos)?).map_err(|_| "length")?;
                Wire::Bytes(take(bytes, &mut pos, n)?)
            }
            5 => Wire::Fixed32(u32::from_le_bytes(
                take(bytes, &mut pos, 4)?.try_into().expect("4 bytes"),
            )),
            w => return Err(format!("unsupported wire type {w} for field {number}")),
        };
        out.push((number, value));
    }
    Ok(out)
}

/// The last scalar value of field `n` in `fields`.
pub(crate) fn last_u64(fields: &[(u32, Wire<'_>)], n: u32) -> Option<u64> {
    fields
        .iter()
        .rev()
        .find(|(num, _)| *num == n)
        .and_then(|(_, v)| v.as_u64())
}

/// Every length-delimited value of field `n` in `fields`.
pub(crate) fn all_bytes<'a>(fields: &[(u32, Wire<'a>)], n: u32) -> Vec<&'a [u8]> {
    fields
        .iter()
        .filter(|(num, _)| *num == n)
        .filter_map(|(_, v)| match v {
            Wire::Bytes(b) => Some(*b),
            _ => None,
        })
        .collect()
}

/// The last length-delimited value of field `n`, as UTF-8 (lossy).
pub(crate) fn last_string(fields: &[(u32, Wire<'_>)], n: u32) -> Option<String> {
    all_bytes(fields, n)
        .last()
        .map(|b| String::from_utf8_lossy(b).into_owned())
}

/// The last scalar of unknown field `n` (e.g. a field newer than v51).
pub(crate) fn unknown_u64(unknown: &UnknownFields, n: u32) -> Option<u64> {
    unknown
        .iter()
        .filter(|(num, _)| *num == n)
        .filter_map(|(_, v)| match v {
            UnknownValueRef::Varint(v) | UnknownValueRef::Fixed64(v) => Some(v),
            UnknownValueRef::Fixed32(v) => Some(u64::from(v)),
            UnknownValueRef::LengthDelimited(_) => None,
        })
        .last()
}

/// The last length-delimited value of unknown field `n`.
pub(crate) fn unknown_bytes(unknown: &UnknownFields, n: u32) -> Option<&[u8]> {
    unknown
        .iter()
        .filter(|(num, _)| *num == n)
        .filter_map(|(_, v)| match v {
            UnknownValueRef::LengthDelimited(b) => Some(b),
            _ => None,
        })
        .last()
}

/// Encoders for hand-built test messages.
#[cfg(test)]
pub(crate) mod encode {
    pub(crate) fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    pub(crate) fn varint_field(n: u32, v: u64, out: &mut Vec<u8>) {
        varint(u64::from(n) << 3, out);
        varint(v, out);
    }

    pub(crate) fn bytes_field(n: u32, b: &[u8], out: &mut Vec<u8>) {
        varint((u64::from(n) << 3) | 2, out);
        varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }
}

#[cfg(test)]
mod tests {
    use super::encode::*;
    use super::*;

    #[test]
    fn reads_every_wire_type() {
        let mut b = Vec::new();
        varint_field(1, 300, &mut b);
        bytes_field(2, b"hi", &mut b);
        b.push((3 << 3) | 1);
        b.extend_from_slice(&7u64.to_le_bytes());
        b.push((4 << 3) | 5);
        b.extend_from_slice(&9u32.to_le_bytes());
        let f = fields(&b).unwrap();
        assert_eq!(f[0], (1, Wire::Varint(300)));
        assert_eq!(f[1], (2, Wire::Bytes(b"hi")));
        assert_eq!(f[2], (3, Wire::Fixed64(7)));
        assert_eq!(f[3], (4, Wire::Fixed32(9)));
        assert_eq!(last_u64(&f, 1), Some(300));
        assert_eq!(last_string(&f, 2).as_deref(), Some("hi"));
    }

    #[test]
    fn rejects_truncation() {
        assert!(fields(&[0x08]).is_err());
        assert!(fields(&[0x12, 0x05, b'a']).is_err());
        assert!(fields(&[0x08, 0xff]).is_err());
    }
}
