use std::fs::{File, Metadata};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::date::{parse_http_date_secs, unix_secs, write_http_date};
use crate::resolve::{parse_target, resolve, Resolved};
use crate::{content_type, DocRoot, Method, Request};

/// What to send after [`Response::head`].
#[derive(Debug)]
pub enum Body {
    /// Nothing (HEAD, 304, empty files).
    Empty,
    /// A small in-memory body, e.g. an error text.
    Bytes(Vec<u8>),
    /// `len` bytes of `file` starting at `offset`, meant for `sendfile`.
    File {
        /// The opened regular file.
        file: File,
        /// First byte to send.
        offset: u64,
        /// Number of bytes to send; `Content-Length` announced exactly this.
        len: u64,
    },
}

/// A planned response.
#[derive(Debug)]
pub struct Response {
    /// The status code, also present in `head`.
    pub status: u16,
    /// Status line and header fields, ending in an empty line.
    pub head: Vec<u8>,
    /// The body to send after `head`.
    pub body: Body,
    /// Whether the connection may carry another request; `head` says
    /// `Connection: keep-alive` or `Connection: close` accordingly.
    pub keep_alive: bool,
}

impl Response {
    /// The header fields of [`Response::head`], in order, as (name, value): what the same
    /// response carries over HTTP/2, where the status is a pseudo-header and `Connection`
    /// (hop-by-hop, which HTTP/2 forbids: RFC 9113 §8.2.2) has no place, so it is left out.
    /// One planning for both protocols: HTTP/2 renders these fields, HTTP/1.1 sends `head`.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        fields_of(&self.head)
    }
}

/// The header fields of a planned head ([`Response::head`], or its bytes moved elsewhere), in
/// order, as (name, value), less `Connection`: see [`Response::fields`].
pub fn fields_of(head: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    // The head is ours (see `Head`): a status line, then `Name: value` lines, each ending in
    // CRLF, then an empty line. Nothing here is the client's. Past the status line:
    let rest = memchr::memchr(b'\n', head).map_or(&[][..], |n| &head[n + 1..]);
    Fields { rest }
}

/// [`fields_of`]'s iterator: a line at a time, found with `memchr` (an h2 response renders
/// its fields from the planned head, so this runs for every one).
struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Fields<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let end = memchr::memchr(b'\n', self.rest)?;
            let line = &self.rest[..end];
            self.rest = &self.rest[end + 1..];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                self.rest = &[];
                return None;
            }
            let Some(colon) = memchr::memchr(b':', line) else {
                continue;
            };
            let (name, value) = (&line[..colon], &line[colon + 1..]);
            if name.eq_ignore_ascii_case(b"connection") {
                continue;
            }
            return Some((name, value.strip_prefix(b" ").unwrap_or(value)));
        }
    }
}

/// The reason phrase for `status` ("Unknown" for codes this server never sends).
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        301 => "Moved Permanently",
        304 => "Not Modified",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        414 => "URI Too Long",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Decides how to answer a `GET` or `HEAD` for a file under `root`; `now`
/// becomes the `Date` header. Never fails: every problem becomes an error
/// response.
pub fn respond(request: &Request, root: &DocRoot, now: SystemTime) -> Response {
    let keep_alive = request.keep_alive;
    let head_only = match request.method {
        Method::Get => false,
        Method::Head => true,
        Method::Other(_) => return error_response_at(405, keep_alive, now),
    };
    let resolved = parse_target(&request.target).and_then(|t| resolve(root, &t));
    let mut response = match resolved {
        Ok(Resolved::File {
            file,
            meta,
            type_name,
        }) => serve_file(request, file, &meta, &type_name, now),
        Ok(Resolved::Redirect(location)) => redirect(&location, keep_alive, now),
        Err(e) => error_response_at(e.status(), keep_alive, now),
    };
    // HEAD keeps every header, Content-Length included (RFC 9110 §9.3.2).
    if head_only {
        response.body = Body::Empty;
    }
    response
}

/// A short `text/plain` error response such as `404 Not Found\n`, dated now.
/// `Connection: close` when `!keep_alive`; 405 carries `Allow: GET, HEAD`.
pub fn error_response(status: u16, keep_alive: bool) -> Response {
    error_response_at(status, keep_alive, SystemTime::now())
}

/// [`error_response`] with an explicit `Date`. A status outside 100..=999
/// cannot be written in a status line and becomes 500.
pub fn error_response_at(status: u16, keep_alive: bool, now: SystemTime) -> Response {
    let status = if (100..=999).contains(&status) {
        status
    } else {
        500
    };
    let mut head = Head::new(status, now);
    if status == 405 {
        head.header(b"Allow", b"GET, HEAD");
    }
    // These statuses must not carry content (RFC 9110 §6.4.1).
    let body = if (100..200).contains(&status) || status == 204 || status == 304 {
        Body::Empty
    } else {
        let text = status_text(status);
        head.header(b"Content-Type", b"text/plain; charset=utf-8");
        head.header_u64(b"Content-Length", text.len() as u64);
        Body::Bytes(text)
    };
    Response {
        status,
        head: head.finish(keep_alive),
        body,
        keep_alive,
    }
}

fn status_text(status: u16) -> Vec<u8> {
    let reason = reason_phrase(status);
    let mut text = Vec::with_capacity(reason.len() + 5);
    push_u64(&mut text, u64::from(status));
    text.push(b' ');
    text.extend_from_slice(reason.as_bytes());
    text.push(b'\n');
    text
}

fn redirect(location: &[u8], keep_alive: bool, now: SystemTime) -> Response {
    let text = status_text(301);
    let mut head = Head::new(301, now);
    head.header(b"Location", location);
    head.header(b"Content-Type", b"text/plain; charset=utf-8");
    head.header_u64(b"Content-Length", text.len() as u64);
    Response {
        status: 301,
        head: head.finish(keep_alive),
        body: Body::Bytes(text),
        keep_alive,
    }
}

fn serve_file(
    request: &Request,
    file: File,
    meta: &Metadata,
    type_name: &Path,
    now: SystemTime,
) -> Response {
    let keep_alive = request.keep_alive;
    let size = meta.len();
    let mtime = meta.modified().ok();
    let mtime_secs = mtime.map(unix_secs);
    let etag = make_etag(mtime, size);

    // RFC 9110 §13.2.2: If-None-Match wins over If-Modified-Since, and both
    // are evaluated before Range.
    let not_modified = match (&request.if_none_match, &request.if_modified_since) {
        (Some(inm), _) => if_none_match_matches(inm, &etag),
        (None, Some(ims)) => match (parse_http_date_secs(ims), mtime_secs) {
            (Some(since), Some(modified)) => modified <= since,
            _ => false,
        },
        (None, None) => false,
    };
    if not_modified {
        let mut head = Head::new(304, now);
        head.header(b"ETag", etag.as_bytes());
        if let Some(m) = mtime {
            head.date_header(b"Last-Modified", m);
        }
        return Response {
            status: 304,
            head: head.finish(keep_alive),
            body: Body::Empty,
            keep_alive,
        };
    }

    // Range is defined for GET only; an empty file has no range to describe.
    let range = match &request.range {
        Some(range)
            if request.method == Method::Get
                && size > 0
                && if_range_allows(request.if_range.as_deref(), &etag, mtime_secs) =>
        {
            parse_range(range, size)
        }
        _ => RangeSpec::Ignore,
    };

    let (status, offset, len) = match range {
        RangeSpec::Unsatisfiable => {
            let text = status_text(416);
            let mut head = Head::new(416, now);
            head.header(b"Content-Type", b"text/plain; charset=utf-8");
            head.header_u64(b"Content-Length", text.len() as u64);
            head.start_header(b"Content-Range");
            head.buf.extend_from_slice(b"bytes */");
            push_u64(&mut head.buf, size);
            head.buf.extend_from_slice(b"\r\n");
            head.header(b"Accept-Ranges", b"bytes");
            return Response {
                status: 416,
                head: head.finish(keep_alive),
                body: Body::Bytes(text),
                keep_alive,
            };
        }
        RangeSpec::Satisfiable { first, last } => (206, first, last - first + 1),
        RangeSpec::Ignore => (200, 0, size),
    };

    let mut head = Head::new(status, now);
    head.header(b"Content-Type", content_type(type_name).as_bytes());
    head.header_u64(b"Content-Length", len);
    if let Some(m) = mtime {
        head.date_header(b"Last-Modified", m);
    }
    head.header(b"ETag", etag.as_bytes());
    head.header(b"Accept-Ranges", b"bytes");
    if status == 206 {
        head.start_header(b"Content-Range");
        head.buf.extend_from_slice(b"bytes ");
        push_u64(&mut head.buf, offset);
        head.buf.push(b'-');
        push_u64(&mut head.buf, offset + len - 1);
        head.buf.push(b'/');
        push_u64(&mut head.buf, size);
        head.buf.extend_from_slice(b"\r\n");
    }
    // Content types come from the file name, so browsers must not second-guess them.
    head.header(b"X-Content-Type-Options", b"nosniff");
    let body = if len == 0 {
        Body::Empty
    } else {
        Body::File { file, offset, len }
    };
    Response {
        status,
        head: head.finish(keep_alive),
        body,
        keep_alive,
    }
}

/// A strong validator: any write that changes the file moves its mtime (at
/// nanosecond resolution) or its size.
fn make_etag(mtime: Option<SystemTime>, size: u64) -> String {
    let nanos = mtime
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    // By hand rather than `format!`: `u128`'s formatting showed in serve's profile of small
    // requests over h2 (docs/BENCHMARKS.md, "HTTP/2 against peers").
    let mut tag = String::with_capacity(2 + 32 + 1 + 16);
    tag.push('"');
    push_hex(&mut tag, nanos);
    tag.push('-');
    push_hex(&mut tag, u128::from(size));
    tag.push('"');
    tag
}

/// `v` in lower-case hexadecimal, no leading zeros (as `{:x}`).
fn push_hex(out: &mut String, v: u128) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let digits = (128 - v.leading_zeros()).div_ceil(4).max(1);
    for i in (0..digits).rev() {
        out.push(char::from(DIGITS[((v >> (i * 4)) & 0xf) as usize]));
    }
}

/// Weak comparison against a list of entity-tags or `*` (RFC 9110 §13.1.2).
/// A malformed list stops matching at the first malformed member, which can
/// only cost a 200 where a 304 would have done.
fn if_none_match_matches(header: &str, etag: &str) -> bool {
    let ours = opaque_tag(etag.as_bytes());
    let mut rest = header.as_bytes();
    loop {
        while let [b' ' | b'\t' | b',', tail @ ..] = rest {
            rest = tail;
        }
        if rest.is_empty() {
            return false;
        }
        if rest[0] == b'*' {
            return true;
        }
        let tag = rest.strip_prefix(b"W/").unwrap_or(rest);
        let Some(after_quote) = tag.strip_prefix(b"\"") else {
            return false;
        };
        let Some(close) = after_quote.iter().position(|&b| b == b'"') else {
            return false;
        };
        if Some(&after_quote[..close]) == ours {
            return true;
        }
        rest = &after_quote[close + 1..];
    }
}

fn opaque_tag(etag: &[u8]) -> Option<&[u8]> {
    etag.strip_prefix(b"\"")?.strip_suffix(b"\"")
}

/// If-Range needs a strong match: the same strong entity-tag, or exactly the
/// Last-Modified date (RFC 9110 §13.1.5). Anything else means "send it all".
fn if_range_allows(if_range: Option<&str>, etag: &str, mtime_secs: Option<i64>) -> bool {
    let Some(value) = if_range else {
        return true;
    };
    let value = value.trim_matches([' ', '\t']);
    if value.starts_with('"') || value.starts_with("W/") {
        return value == etag;
    }
    match (parse_http_date_secs(value), mtime_secs) {
        (Some(date), Some(modified)) => date == modified,
        _ => false,
    }
}

#[derive(Debug, PartialEq, Eq)]
enum RangeSpec {
    /// Serve the whole file: no usable range (absent, malformed, several).
    Ignore,
    /// 416.
    Unsatisfiable,
    /// 206 for bytes `first..=last`, already clamped to the file.
    Satisfiable { first: u64, last: u64 },
}

/// Parses a single `bytes=` range against a file of `size` > 0 bytes.
fn parse_range(value: &str, size: u64) -> RangeSpec {
    let Some((unit, set)) = value.trim_matches([' ', '\t']).split_once('=') else {
        return RangeSpec::Ignore;
    };
    // Answering several ranges needs multipart bodies, which sendfile of one
    // extent cannot express; RFC 9110 §14.2 lets us ignore the header instead.
    if !unit.eq_ignore_ascii_case("bytes") || set.contains(',') || size == 0 {
        return RangeSpec::Ignore;
    }
    let Some((first, last)) = set.split_once('-') else {
        return RangeSpec::Ignore;
    };
    if first.is_empty() {
        let Some(suffix) = parse_digits(last) else {
            return RangeSpec::Ignore;
        };
        if suffix == 0 {
            return RangeSpec::Unsatisfiable;
        }
        return RangeSpec::Satisfiable {
            first: size - suffix.min(size),
            last: size - 1,
        };
    }
    let Some(first) = parse_digits(first) else {
        return RangeSpec::Ignore;
    };
    let last = if last.is_empty() {
        None
    } else {
        match parse_digits(last) {
            Some(l) if l >= first => Some(l),
            // Invalid rather than unsatisfiable: RFC 9110 §14.1.1.
            _ => return RangeSpec::Ignore,
        }
    };
    if first >= size {
        return RangeSpec::Unsatisfiable;
    }
    RangeSpec::Satisfiable {
        first,
        last: last.map_or(size - 1, |l| l.min(size - 1)),
    }
}

/// Decimal digits only; values beyond u64 saturate, which clamps them to the
/// file like any other too-large position.
fn parse_digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.bytes().fold(0u64, |acc, d| {
        acc.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    }))
}

/// Builds a head into one buffer, sized so that typical heads never regrow.
struct Head {
    buf: Vec<u8>,
}

impl Head {
    fn new(status: u16, now: SystemTime) -> Head {
        let mut buf = Vec::with_capacity(320);
        buf.extend_from_slice(b"HTTP/1.1 ");
        push_u64(&mut buf, u64::from(status));
        buf.push(b' ');
        buf.extend_from_slice(reason_phrase(status).as_bytes());
        buf.extend_from_slice(b"\r\nServer: tlsplane\r\n");
        let mut head = Head { buf };
        head.date_header(b"Date", now);
        head
    }

    fn start_header(&mut self, name: &[u8]) {
        self.buf.extend_from_slice(name);
        self.buf.extend_from_slice(b": ");
    }

    fn header(&mut self, name: &[u8], value: &[u8]) {
        self.start_header(name);
        self.buf.extend_from_slice(value);
        self.buf.extend_from_slice(b"\r\n");
    }

    fn header_u64(&mut self, name: &[u8], value: u64) {
        self.start_header(name);
        push_u64(&mut self.buf, value);
        self.buf.extend_from_slice(b"\r\n");
    }

    fn date_header(&mut self, name: &[u8], t: SystemTime) {
        self.start_header(name);
        write_http_date(&mut self.buf, t);
        self.buf.extend_from_slice(b"\r\n");
    }

    fn finish(mut self, keep_alive: bool) -> Vec<u8> {
        self.buf.extend_from_slice(if keep_alive {
            b"Connection: keep-alive\r\n\r\n".as_slice()
        } else {
            b"Connection: close\r\n\r\n".as_slice()
        });
        self.buf
    }
}

fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sat(first: u64, last: u64) -> RangeSpec {
        RangeSpec::Satisfiable { first, last }
    }

    #[test]
    fn range_forms() {
        assert_eq!(parse_range("bytes=0-4", 10), sat(0, 4));
        assert_eq!(parse_range("bytes=3-", 10), sat(3, 9));
        assert_eq!(parse_range("bytes=-3", 10), sat(7, 9));
        assert_eq!(parse_range("bytes=-30", 10), sat(0, 9));
        assert_eq!(parse_range("bytes=5-500", 10), sat(5, 9));
        assert_eq!(parse_range("Bytes=9-9", 10), sat(9, 9));
        assert_eq!(
            parse_range("bytes=0-99999999999999999999999", 10),
            sat(0, 9)
        );
    }

    #[test]
    fn range_unsatisfiable_and_ignored() {
        assert_eq!(parse_range("bytes=-0", 10), RangeSpec::Unsatisfiable);
        assert_eq!(parse_range("bytes=10-", 10), RangeSpec::Unsatisfiable);
        assert_eq!(parse_range("bytes=10-20", 10), RangeSpec::Unsatisfiable);
        assert_eq!(
            parse_range("bytes=99999999999999999999999-", 10),
            RangeSpec::Unsatisfiable
        );
        for ignored in [
            "bytes=5-4",
            "bytes=0-1,3-4",
            "bytes=0-1,",
            "bytes=-",
            "bytes=",
            "bytes=a-b",
            "bytes=1-x",
            "bytes= 1-2",
            "bytes=+1-2",
            "items=0-1",
            "bytes",
            "",
        ] {
            assert_eq!(parse_range(ignored, 10), RangeSpec::Ignore, "{ignored:?}");
        }
    }

    #[test]
    fn if_none_match_lists() {
        let etag = "\"abc-1\"";
        assert!(if_none_match_matches("\"abc-1\"", etag));
        assert!(if_none_match_matches("W/\"abc-1\"", etag));
        assert!(if_none_match_matches("\"x\", \"abc-1\"", etag));
        assert!(if_none_match_matches("\"a,b\",W/\"abc-1\"", etag));
        assert!(if_none_match_matches("*", etag));
        assert!(!if_none_match_matches("\"abc-2\"", etag));
        assert!(!if_none_match_matches("abc-1", etag));
        assert!(!if_none_match_matches("\"abc-1", etag));
        assert!(!if_none_match_matches("", etag));
    }

    #[test]
    fn if_range_is_strong() {
        let etag = "\"abc-1\"";
        assert!(if_range_allows(None, etag, None));
        assert!(if_range_allows(Some("\"abc-1\""), etag, None));
        assert!(!if_range_allows(Some("W/\"abc-1\""), etag, None));
        assert!(!if_range_allows(Some("\"other\""), etag, Some(0)));
        assert!(if_range_allows(
            Some("Thu, 01 Jan 1970 00:00:00 GMT"),
            etag,
            Some(0)
        ));
        assert!(!if_range_allows(
            Some("Thu, 01 Jan 1970 00:00:01 GMT"),
            etag,
            Some(0)
        ));
        assert!(!if_range_allows(Some("garbage"), etag, Some(0)));
    }

    #[test]
    fn fields_are_the_head_without_status_line_and_connection() {
        let now = UNIX_EPOCH;
        let resp = error_response_at(405, true, now);
        let fields: Vec<(String, String)> = resp
            .fields()
            .map(|(n, v)| {
                (
                    String::from_utf8_lossy(n).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                )
            })
            .collect();
        let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["Server", "Date", "Allow", "Content-Type", "Content-Length"]
        );
        assert_eq!(fields[1].1, "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(fields[2].1, "GET, HEAD");
        assert_eq!(fields[4].1, "23");
        let redirect = redirect(b"/dir/", false, now);
        assert!(redirect
            .fields()
            .any(|(n, v)| n == b"Location" && v == b"/dir/"));
        assert!(!redirect
            .fields()
            .any(|(n, _)| n.eq_ignore_ascii_case(b"connection")));
    }

    #[test]
    fn push_hex_is_lower_hex() {
        for v in [
            0,
            1,
            0xf,
            0x10,
            0xabc,
            u128::from(u64::MAX),
            u128::MAX,
            1 << 64,
        ] {
            let mut out = String::new();
            push_hex(&mut out, v);
            assert_eq!(out, format!("{v:x}"));
        }
        let t = UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 123);
        assert_eq!(
            make_etag(Some(t), 1024),
            format!("\"{:x}-400\"", 1_700_000_000_000_000_123u128)
        );
        assert_eq!(make_etag(None, 0), "\"0-0\"");
    }

    #[test]
    fn push_u64_edges() {
        let mut out = Vec::new();
        push_u64(&mut out, 0);
        out.push(b' ');
        push_u64(&mut out, u64::MAX);
        assert_eq!(out, b"0 18446744073709551615");
    }
}
