//! Bounds-checked little-endian reads from bytes copied out of a traced
//! process (never trusted: every read may fail).

pub(crate) fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(off..off.checked_add(4)?)?.try_into().ok()?,
    ))
}

pub(crate) fn i32_at(b: &[u8], off: usize) -> Option<i32> {
    u32_at(b, off).map(|v| v as i32)
}

pub(crate) fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(off..off.checked_add(8)?)?.try_into().ok()?,
    ))
}

pub(crate) fn f64_at(b: &[u8], off: usize) -> Option<f64> {
    u64_at(b, off).map(f64::from_bits)
}

/// The NUL-terminated string at the start of `b` (all of `b` when it has
/// no NUL), lossily decoded.
pub(crate) fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_bounded() {
        let b = [1u8, 0, 0, 0, 2, 0, 0, 0, 3];
        assert_eq!(u32_at(&b, 0), Some(1));
        assert_eq!(u64_at(&b, 0), Some(1 | 2 << 32));
        assert_eq!(u64_at(&b, 2), None);
        assert_eq!(u32_at(&b, 6), None);
        assert_eq!(u32_at(&b, usize::MAX - 1), None);
        assert_eq!(i32_at(&[0xff; 4], 0), Some(-1));
        assert_eq!(f64_at(&1.5f64.to_le_bytes(), 0), Some(1.5));
        assert_eq!(c_string(b"abc\0def"), "abc");
        assert_eq!(c_string(b"abc"), "abc");
        assert_eq!(c_string(b"\xffa\0"), "\u{fffd}a");
    }
}
