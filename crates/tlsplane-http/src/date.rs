//! HTTP-date (RFC 9110 §5.6.7) formatting and parsing, done by hand so that
//! the hot path needs no date crate and no allocation.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

const DAY_NAMES: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
const LONG_DAY_NAMES: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTH_NAMES: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// Formats `t` as an IMF-fixdate, e.g. `Sun, 06 Nov 1994 08:49:37 GMT`.
///
/// Times before 1970 are clamped to the epoch: the server never has a reason
/// to announce them, and clamping keeps the output a valid HTTP-date.
pub fn http_date(t: SystemTime) -> String {
    let mut out = Vec::with_capacity(29);
    write_http_date(&mut out, t);
    // Every byte written is ASCII.
    String::from_utf8(out).unwrap_or_default()
}

/// Appends the IMF-fixdate of `t` to `out`.
pub(crate) fn write_http_date(out: &mut Vec<u8>, t: SystemTime) {
    let secs = unix_secs(t).max(0);
    let days = secs.div_euclid(86_400);
    let of_day = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 4).rem_euclid(7) as usize;
    out.extend_from_slice(DAY_NAMES[weekday].as_bytes());
    out.extend_from_slice(b", ");
    push_2(out, day as u64);
    out.push(b' ');
    out.extend_from_slice(MONTH_NAMES[(month - 1) as usize].as_bytes());
    out.push(b' ');
    if (0..10_000).contains(&year) {
        push_2(out, (year / 100) as u64);
        push_2(out, (year % 100) as u64);
    } else {
        out.extend_from_slice(year.to_string().as_bytes());
    }
    out.push(b' ');
    push_2(out, (of_day / 3600) as u64);
    out.push(b':');
    push_2(out, (of_day / 60 % 60) as u64);
    out.push(b':');
    push_2(out, (of_day % 60) as u64);
    out.extend_from_slice(b" GMT");
}

fn push_2(out: &mut Vec<u8>, v: u64) {
    out.push(b'0' + (v / 10 % 10) as u8);
    out.push(b'0' + (v % 10) as u8);
}

/// Parses an HTTP-date in any of the three forms RFC 9110 §5.6.7 obliges
/// recipients to accept (IMF-fixdate, RFC 850, asctime). `None` if invalid.
pub fn parse_http_date(s: &str) -> Option<SystemTime> {
    let secs = parse_http_date_secs(s)?;
    if secs >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(secs.unsigned_abs()))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs()))
    }
}

/// Whole seconds since the epoch, rounded down (HTTP dates have no finer unit).
pub(crate) fn unix_secs(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => {
            let d = e.duration();
            let whole = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            // Rounding down means one more second back when there is a fraction.
            -whole - i64::from(d.subsec_nanos() > 0)
        }
    }
}

pub(crate) fn parse_http_date_secs(s: &str) -> Option<i64> {
    let b = s.trim_matches([' ', '\t']).as_bytes();
    if b.len() == 29 && b.get(3) == Some(&b',') {
        parse_imf_fixdate(b)
    } else if b.len() == 24 {
        parse_asctime(b)
    } else {
        parse_rfc850(b)
    }
}

// "Sun, 06 Nov 1994 08:49:37 GMT"
fn parse_imf_fixdate(b: &[u8]) -> Option<i64> {
    name_index(&DAY_NAMES, b.get(0..3)?)?;
    if b.get(3..5)? != b", " || b[7] != b' ' || b[11] != b' ' || b[16] != b' ' {
        return None;
    }
    if b.get(25..29)? != b" GMT" {
        return None;
    }
    let day = digits(&b[5..7])?;
    let month = name_index(&MONTH_NAMES, &b[8..11])? as i64 + 1;
    let year = digits(&b[12..16])?;
    let time = parse_time(&b[17..25])?;
    to_secs(year, month, day, time)
}

// "Sunday, 06-Nov-94 08:49:37 GMT"
fn parse_rfc850(b: &[u8]) -> Option<i64> {
    let comma = b.iter().position(|&c| c == b',')?;
    name_index(&LONG_DAY_NAMES, &b[..comma])?;
    let rest = b.get(comma..)?;
    if rest.len() != 24 || &rest[..2] != b", " {
        return None;
    }
    if rest[4] != b'-' || rest[8] != b'-' || rest[11] != b' ' || &rest[20..] != b" GMT" {
        return None;
    }
    let day = digits(&rest[2..4])?;
    let month = name_index(&MONTH_NAMES, &rest[5..8])? as i64 + 1;
    let yy = digits(&rest[9..11])?;
    // Two-digit years are ambiguous; the Unix era makes this split the useful one.
    let year = if yy < 70 { 2000 + yy } else { 1900 + yy };
    let time = parse_time(&rest[12..20])?;
    to_secs(year, month, day, time)
}

// "Sun Nov  6 08:49:37 1994"
fn parse_asctime(b: &[u8]) -> Option<i64> {
    name_index(&DAY_NAMES, &b[0..3])?;
    if b[3] != b' ' || b[7] != b' ' || b[10] != b' ' || b[19] != b' ' {
        return None;
    }
    let month = name_index(&MONTH_NAMES, &b[4..7])? as i64 + 1;
    let day = if b[8] == b' ' {
        digits(&b[9..10])?
    } else {
        digits(&b[8..10])?
    };
    let time = parse_time(&b[11..19])?;
    let year = digits(&b[20..24])?;
    to_secs(year, month, day, time)
}

fn name_index(names: &[&str], b: &[u8]) -> Option<usize> {
    names.iter().position(|n| n.as_bytes() == b)
}

fn digits(b: &[u8]) -> Option<i64> {
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        b.iter()
            .fold(0i64, |acc, &c| acc * 10 + i64::from(c - b'0')),
    )
}

// "HH:MM:SS" → seconds into the day
fn parse_time(b: &[u8]) -> Option<i64> {
    if b.len() != 8 || b[2] != b':' || b[5] != b':' {
        return None;
    }
    let (h, m, s) = (digits(&b[0..2])?, digits(&b[3..5])?, digits(&b[6..8])?);
    // 60 is a leap second, which HTTP-date permits.
    if h > 23 || m > 59 || s > 60 {
        return None;
    }
    Some(h * 3600 + m * 60 + s)
}

fn to_secs(year: i64, month: i64, day: i64, time: i64) -> Option<i64> {
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + time)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

// Proleptic Gregorian calendar conversions (Howard Hinnant's algorithms),
// exact for every i64 day count this crate can produce.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn formats_known_dates() {
        assert_eq!(http_date(at(0)), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(http_date(at(784_111_777)), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(http_date(at(951_782_400)), "Tue, 29 Feb 2000 00:00:00 GMT");
        assert_eq!(
            http_date(at(253_402_300_799)),
            "Fri, 31 Dec 9999 23:59:59 GMT"
        );
        assert_eq!(
            http_date(UNIX_EPOCH - Duration::from_secs(10)),
            "Thu, 01 Jan 1970 00:00:00 GMT"
        );
    }

    #[test]
    fn parses_all_three_forms() {
        let want = Some(784_111_777);
        assert_eq!(parse_http_date_secs("Sun, 06 Nov 1994 08:49:37 GMT"), want);
        assert_eq!(parse_http_date_secs("Sunday, 06-Nov-94 08:49:37 GMT"), want);
        assert_eq!(parse_http_date_secs("Sun Nov  6 08:49:37 1994"), want);
        assert_eq!(
            parse_http_date(&http_date(at(1_700_000_000))),
            Some(at(1_700_000_000))
        );
    }

    #[test]
    fn rejects_invalid_dates() {
        for bad in [
            "",
            "yesterday",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 31 Feb 1994 08:49:37 GMT",
            "Sun, 06 Foo 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 24:00:00 GMT",
            "Xyz, 06 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 08:49:37 GMTX",
            "Sunday, 06-Nov-94 08:49:37 UTC",
            "Sun Nov 36 08:49:37 1994",
            "Sun, +6 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 08:49:37 G\u{e9}",
        ] {
            assert_eq!(parse_http_date_secs(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn round_trips_across_centuries() {
        for days in (-800_000i64..3_000_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn unix_secs_rounds_down() {
        assert_eq!(unix_secs(UNIX_EPOCH - Duration::from_millis(1)), -1);
        assert_eq!(unix_secs(UNIX_EPOCH + Duration::from_millis(1999)), 1);
    }
}
