//! The rules both request-head readers apply, serve's ([`crate::parse_request`]) and the
//! proxy's ([`crate::forward::parse_request_head`]): one request must mean the same to both,
//! since a request two parsers read two ways is how smuggling starts.

use crate::HttpError;

/// What to do when httparse refused a request's HTTP version (it knows only 1.0 and 1.1).
pub(crate) enum Version {
    /// HTTP/1.x with x > 1: answered as HTTP/1.1 (RFC 9112 §2.3: a recipient of a later minor
    /// version of its major treats it as the highest minor it implements). The offset of x in
    /// the buffer, for a copy that httparse reads as 1.1.
    Later1x(usize),
    /// The line has not ended and could still turn out either way: read more.
    Unfinished,
    /// The error to answer with: 505 for another major version, 400 for garbage.
    Refused(HttpError),
}

/// Skips the empty lines RFC 9112 §2.2 lets a client send before a request.
pub(crate) fn skip_leading_newlines(buf: &[u8]) -> &[u8] {
    let start = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    &buf[start..]
}

/// Tells apart, in a request line httparse refused for its version, a later HTTP/1 minor
/// version (served as 1.1), a well-formed other major version (505), and garbage, including
/// a request-target with a space in it (400).
///
/// The answer does not depend on how the request was cut into reads: while the line could
/// still become either (`HTTP/2` may go on as `HTTP/2.0` or as `HTTP/2x`), it waits.
pub(crate) fn classify_version(buf: &[u8]) -> Version {
    let rest = skip_leading_newlines(buf);
    let skipped = buf.len() - rest.len();
    let line_end = rest
        .iter()
        .position(|&b| b == b'\r' || b == b'\n')
        .unwrap_or(rest.len());
    let line = &rest[..line_end];
    let bad = Version::Refused(HttpError::BadRequest("malformed request line"));
    // method SP request-target SP HTTP-version: exactly two spaces, and more bytes never
    // take a space away.
    if line.iter().filter(|&&b| b == b' ').count() != 2 {
        return bad;
    }
    let sp = line.iter().rposition(|&b| b == b' ').unwrap_or(0);
    let version = &line[sp + 1..];
    match version.strip_prefix(b"HTTP/") {
        // httparse, on the copy, decides the rest of the line as for HTTP/1.1.
        Some([b'1', b'.', minor]) if minor.is_ascii_digit() && *minor > b'1' => {
            return Version::Later1x(skipped + sp + 1 + "HTTP/1.".len());
        }
        // Another major, with its minor or without (HTTP/2 and HTTP/3 are often written
        // so); "HTTP/1" is not one, it is a malformed version of ours.
        Some([major] | [major, b'.', b'0'..=b'9']) if major.is_ascii_digit() && *major != b'1' => {
            // The line must end as any request line: LF or CR LF.
            return match &rest[line_end..] {
                [] | [b'\r'] => Version::Unfinished,
                [b'\n', ..] | [b'\r', b'\n', ..] => {
                    Version::Refused(HttpError::VersionNotSupported)
                }
                _ => bad,
            };
        }
        _ => {}
    }
    if line_end == rest.len() && could_become_version(version) {
        return Version::Unfinished;
    }
    Version::Refused(HttpError::BadRequest("malformed HTTP version"))
}

/// Whether more bytes could still make `v` read `HTTP/DIGIT` or `HTTP/DIGIT.DIGIT`.
fn could_become_version(v: &[u8]) -> bool {
    const SHAPE: &[u8] = b"HTTP/9.9";
    v.len() <= SHAPE.len()
        && v.iter().zip(SHAPE).all(|(&b, &s)| {
            if s == b'9' {
                b.is_ascii_digit()
            } else {
                b == s
            }
        })
}

/// Trims optional whitespace (SP, HTAB) from both ends of a field value.
pub(crate) fn trim_ows(v: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = v.iter().position(|b| !is_ows(b)).unwrap_or(v.len());
    let end = v.iter().rposition(|b| !is_ows(b)).map_or(start, |i| i + 1);
    &v[start..end.max(start)]
}

/// The body length the `Content-Length` fields of a message give (`None` without one).
///
/// RFC 9110 §8.6 lets a recipient take a list of identical values (`5, 5`, or the field
/// repeated with the same value, as a proxy that merged fields sends) as that one value, or
/// refuse it: it is taken, since both readers write or use one canonical value afterwards and
/// no reader downstream can see two. Differing values, an empty item, a sign, hex or any other
/// non-digit are refused. A number too large for 64 bits reads as `u64::MAX`: more than any
/// body either reader accepts.
pub(crate) fn content_length<'a>(
    values: impl IntoIterator<Item = &'a [u8]>,
) -> Result<Option<u64>, &'static str> {
    let mut result: Option<u64> = None;
    for value in values {
        for item in value.split(|&b| b == b',') {
            let item = trim_ows(item);
            if item.is_empty() || !item.iter().all(u8::is_ascii_digit) {
                return Err("invalid Content-Length");
            }
            let n = item
                .iter()
                .try_fold(0u64, |acc, &d| {
                    acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
                })
                .unwrap_or(u64::MAX);
            if result.is_some_and(|prev| prev != n) {
                return Err("conflicting Content-Length");
            }
            result = Some(n);
        }
    }
    Ok(result)
}
