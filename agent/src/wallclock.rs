//! Wall-clock times as people and file names write them: RFC 3339 in
//! (`agent ctl dump --at`), a compact UTC stamp out (dump names). Civil
//! dates from day numbers with the proleptic Gregorian calendar.

const NS: i64 = 1_000_000_000;

/// Days since 1970-01-01 of a civil date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date of a day number.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (
        if m <= 2 {
            yoe + era * 400 + 1
        } else {
            yoe + era * 400
        },
        m,
        d,
    )
}

/// `2026-03-01T12:00:00Z`, `2026-03-01T13:00:00.5+01:00` -> ns since the
/// Unix epoch (CLOCK_REALTIME).
pub fn parse_rfc3339(text: &str) -> Result<u64, String> {
    let bad = || format!("`{text}` is not an RFC 3339 time such as 2026-03-01T12:00:00Z");
    let b = text.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return Err(bad());
    }
    let num = |r: std::ops::Range<usize>| -> Result<i64, String> {
        let s = text.get(r).ok_or_else(bad)?;
        if !s.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        s.parse().map_err(|_| bad())
    };
    let (y, mo, d, h, mi, s) = (
        num(0..4)?,
        num(5..7)?,
        num(8..10)?,
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
    );
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return Err(bad());
    }
    let mut rest = &text[19..];
    let mut frac_ns = 0i64;
    if let Some(r) = rest.strip_prefix('.') {
        let digits = r.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(bad());
        }
        let mut scale = NS / 10;
        for c in r[..digits].bytes().take(9) {
            frac_ns += i64::from(c - b'0') * scale;
            scale /= 10;
        }
        rest = &r[digits..];
    }
    let offset_s = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6
            && matches!(rest.as_bytes()[0], b'+' | b'-')
            && rest.as_bytes()[3] == b':' =>
        {
            let oh: i64 = rest[1..3].parse().map_err(|_| bad())?;
            let om: i64 = rest[4..6].parse().map_err(|_| bad())?;
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            sign * (oh * 3600 + om * 60)
        }
        _ => return Err(bad()),
    };
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + s.min(59) - offset_s;
    if secs < 0 {
        return Err(format!("`{text}` is before 1970"));
    }
    Ok((secs * NS + frac_ns) as u64)
}

/// `20260301T120000Z` (for file names: no `:`).
pub fn compact_utc(realtime_ns: u64) -> String {
    let secs = (realtime_ns / NS as u64) as i64;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

/// CLOCK_REALTIME now, in ns.
pub fn realtime_ns() -> u64 {
    crate::host::clock_snapshot().realtime_ns
}

/// A CLOCK_REALTIME instant as CLOCK_BOOTTIME (the records' clock), by the
/// offset between the two clocks now.
pub fn realtime_to_boottime(realtime: u64) -> u64 {
    let now = crate::host::clock_snapshot();
    let offset = now.realtime_ns as i128 - now.boottime_ns as i128;
    (realtime as i128 - offset).max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(
            parse_rfc3339("2000-03-01T00:00:00Z"),
            Ok(951_868_800 * NS as u64)
        );
        assert_eq!(
            parse_rfc3339("2026-03-01T13:00:00.25+01:00"),
            Ok(1_772_366_400 * NS as u64 + 250_000_000)
        );
        for bad in [
            "2026-03-01",
            "2026-13-01T00:00:00Z",
            "2026-03-01T00:00:00",
            "yesterday",
            "2026-03-01T00:00:00.Z",
        ] {
            assert!(
                parse_rfc3339(bad).unwrap_err().contains("RFC 3339"),
                "{bad}"
            );
        }
    }

    #[test]
    fn compact() {
        assert_eq!(compact_utc(0), "19700101T000000Z");
        assert_eq!(
            compact_utc(1_772_366_400 * NS as u64 + 5),
            "20260301T120000Z"
        );
        let now = realtime_ns();
        assert_eq!(
            parse_rfc3339(&{
                let c = compact_utc(now);
                format!(
                    "{}-{}-{}T{}:{}:{}Z",
                    &c[0..4],
                    &c[4..6],
                    &c[6..8],
                    &c[9..11],
                    &c[11..13],
                    &c[13..15]
                )
            }),
            Ok(now / NS as u64 * NS as u64)
        );
    }
}
