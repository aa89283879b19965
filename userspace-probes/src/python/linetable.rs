//! A code object's line table: which source line an instruction offset
//! belongs to. The table comes from the traced process: every step is
//! bounded and a malformed table yields `None`, never a panic.

use super::layout::LineTableFormat;

/// The line of the instruction at `lasti` (in code units, 2 bytes each),
/// or `None` when the table gives it none or is malformed.
pub fn line_for(
    format: LineTableFormat,
    table: &[u8],
    firstlineno: i32,
    lasti: u64,
) -> Option<u32> {
    let line = match format {
        LineTableFormat::Pairs310 => pairs_310(table, firstlineno, lasti.checked_mul(2)?),
        LineTableFormat::Locations311 => locations_311(table, firstlineno, lasti),
    }?;
    u32::try_from(line).ok().filter(|&l| l > 0)
}

/// 3.10: `(sdelta: u8, ldelta: i8)` pairs; an address range of `sdelta`
/// bytes has line `previous + ldelta`, or none when `ldelta == -128`.
fn pairs_310(table: &[u8], firstlineno: i32, addr: u64) -> Option<i64> {
    let mut start = 0u64;
    let mut line = i64::from(firstlineno);
    for pair in table.chunks_exact(2) {
        let end = start + u64::from(pair[0]);
        let ldelta = pair[1] as i8;
        let this = if ldelta == -128 {
            None
        } else {
            line = line.checked_add(i64::from(ldelta))?;
            Some(line)
        };
        if (start..end).contains(&addr) {
            return this;
        }
        start = end;
    }
    None
}

/// 3.11+: entries of `1 + code:4 + (length-1):3` then a code-specific
/// payload of 6-bit varints (bit 6 continues) or raw column bytes: 15 no
/// location, 14 long form, 13 line only, 10-12 one line (`code - 10`
/// lines on) with two column bytes, 0-9 short form (same line, one byte).
fn locations_311(table: &[u8], firstlineno: i32, lasti: u64) -> Option<i64> {
    let mut r = Reader { b: table, pos: 0 };
    let mut start = 0u64;
    let mut line = i64::from(firstlineno);
    while let Some(first) = r.byte() {
        if first & 0x80 == 0 {
            // Not at an entry start: the table is malformed.
            return None;
        }
        let code = (first >> 3) & 0x0f;
        let end = start + u64::from(first & 7) + 1;
        let this = match code {
            15 => None,
            14 => {
                line = line.checked_add(r.svarint()?)?;
                r.varint()?; // end line delta
                r.varint()?; // column + 1
                r.varint()?; // end column + 1
                Some(line)
            }
            13 => {
                line = line.checked_add(r.svarint()?)?;
                Some(line)
            }
            10..=12 => {
                line = line.checked_add(i64::from(code) - 10)?;
                r.byte()?;
                r.byte()?;
                Some(line)
            }
            _ => {
                r.byte()?;
                Some(line)
            }
        };
        if (start..end).contains(&lasti) {
            return this;
        }
        start = end;
    }
    None
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let v = *self.b.get(self.pos)?;
        self.pos += 1;
        Some(v)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        // 11 chunks of 6 bits cover 64 bits; a longer run is malformed.
        for shift in (0..66).step_by(6) {
            let b = self.byte()?;
            v |= u64::from(b & 0x3f).checked_shl(shift)?;
            if b & 0x40 == 0 {
                return Some(v);
            }
        }
        None
    }

    fn svarint(&mut self) -> Option<i64> {
        let v = self.varint()?;
        let mag = (v >> 1) as i64;
        Some(if v & 1 == 1 { -mag } else { mag })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_310_ranges() {
        // 0..6 line 10 (+0), 6..10 no line, 10..14 line 12 (+2), then -1.
        let t = [6, 0, 4, 0x80, 4, 2, 2, 0xff];
        let f = LineTableFormat::Pairs310;
        assert_eq!(line_for(f, &t, 10, 0), Some(10));
        assert_eq!(line_for(f, &t, 10, 2), Some(10));
        assert_eq!(line_for(f, &t, 10, 3), None);
        assert_eq!(line_for(f, &t, 10, 5), Some(12));
        assert_eq!(line_for(f, &t, 10, 6), Some(12));
        assert_eq!(line_for(f, &t, 10, 7), Some(11));
        assert_eq!(line_for(f, &t, 10, 8), None);
    }

    #[test]
    fn locations_311_forms() {
        let f = LineTableFormat::Locations311;
        let t = [
            // code 13 (no column), 1 unit, line +1 (svarint 2)
            0x80 | 13 << 3,
            2,
            // code 11 (one line, +1), 2 units, cols
            0x80 | 11 << 3 | 1,
            4,
            9,
            // code 0 (short form, same line), 1 unit
            0x80,
            0x11,
            // code 10 (one line, +0), 1 unit
            0x80 | 10 << 3,
            1,
            2,
            // code 15 (none), 1 unit
            0x80 | 15 << 3,
            // code 14 (long), 3 units, line -2 (svarint 5), end line, cols
            0x80 | 14 << 3 | 2,
            5,
            0,
            1,
            1,
            // code 13, line +100 (svarint 200 = 0b11001000: 0x48|0x40, then 3)
            0x80 | 13 << 3,
            0x48 | 0x40,
            3,
        ];
        assert_eq!(line_for(f, &t, 5, 0), Some(6));
        assert_eq!(line_for(f, &t, 5, 1), Some(7));
        assert_eq!(line_for(f, &t, 5, 2), Some(7));
        assert_eq!(line_for(f, &t, 5, 3), Some(7));
        assert_eq!(line_for(f, &t, 5, 4), Some(7));
        assert_eq!(line_for(f, &t, 5, 5), None);
        assert_eq!(line_for(f, &t, 5, 6), Some(5));
        assert_eq!(line_for(f, &t, 5, 8), Some(5));
        assert_eq!(line_for(f, &t, 5, 9), Some(105));
        assert_eq!(line_for(f, &t, 5, 10), None);
    }

    #[test]
    fn malformed_tables_give_none() {
        let f = LineTableFormat::Locations311;
        assert_eq!(line_for(f, &[0x00, 0x01], 1, 0), None);
        assert_eq!(line_for(f, &[0x80 | 14 << 3, 0x7f], 1, 0), None);
        let endless: Vec<u8> = std::iter::once(0x80 | 13 << 3)
            .chain(std::iter::repeat_n(0x40, 40))
            .collect();
        assert_eq!(line_for(f, &endless, 1, 0), None);
        assert_eq!(line_for(LineTableFormat::Pairs310, &[1], 1, 0), None);
        assert_eq!(line_for(f, &[], 1, u64::MAX), None);
        // Found by `cargo xtask fuzz python_frames`: long-form and line-only
        // entries whose line deltas add past i64::MAX (an overflow panic
        // with overflow checks on).
        let huge_delta = [
            0x80 | 13 << 3,
            0x7e,
            0x7f,
            0x7f,
            0x7f,
            0x7f,
            0x7f,
            0x7f,
            0x7f,
            0x7f,
            0x7f,
            0x3f,
        ];
        let twice: Vec<u8> = huge_delta.iter().chain(&huge_delta).copied().collect();
        assert_eq!(line_for(f, &twice, i32::MAX, 1), None);
    }
}
