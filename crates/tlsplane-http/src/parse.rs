use crate::rules::{classify_version, skip_leading_newlines, trim_ows, Version};
use crate::HttpError;

/// Bounds on what a client may send before its request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest request line, without its line ending (414 beyond). Default 8192.
    pub max_request_line: usize,
    /// Largest whole head, request line and final empty line included
    /// (431 beyond). Default 16384.
    pub max_head_bytes: usize,
    /// Most header fields (431 beyond). Default 64.
    pub max_headers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_request_line: 8192,
            max_head_bytes: 16384,
            max_headers: 64,
        }
    }
}

/// The request method. Methods are case-sensitive, so `get` is `Other`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    /// `GET`
    Get,
    /// `HEAD`
    Head,
    /// Any other method; answered with 405.
    Other(String),
}

impl Method {
    /// The method as sent on the wire.
    pub fn as_str(&self) -> &str {
        match self {
            Method::Get => "GET",
            Method::Head => "HEAD",
            Method::Other(m) => m,
        }
    }
}

/// A parsed request head: just what a static-file server needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The request method.
    pub method: Method,
    /// The raw request-target, still percent-encoded.
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1 and for the later HTTP/1 minor
    /// versions served as 1.1 (`HTTP/1.2` ...).
    pub minor_version: u8,
    /// Whether the connection may carry another request after this one:
    /// HTTP/1.1 unless `Connection: close`, HTTP/1.0 only with
    /// `Connection: keep-alive`.
    pub keep_alive: bool,
    /// `If-None-Match`; several fields are joined with `, `.
    pub if_none_match: Option<String>,
    /// `If-Modified-Since`.
    pub if_modified_since: Option<String>,
    /// `Range`; several fields are joined with `, ` (and then ignored as a
    /// multi-range request).
    pub range: Option<String>,
    /// `If-Range`.
    pub if_range: Option<String>,
    /// `Host`, as sent (at most one is accepted).
    pub host: Option<String>,
}

impl Request {
    /// The host name of the `Host` field, without its port (and without the brackets of an
    /// IPv6 literal); `None` without a `Host`.
    pub fn host_name(&self) -> Option<&str> {
        let h = self.host.as_deref()?;
        if let Some(rest) = h.strip_prefix('[') {
            return rest.split_once(']').map(|(ip, _)| ip);
        }
        Some(match h.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => h,
        })
    }
}

/// Outcome of [`parse_request`] on the bytes received so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// No complete head yet; read more and call again with the whole buffer.
    Incomplete,
    /// A complete head of `head_len` bytes; a pipelined next request starts
    /// at `buf[head_len..]`.
    Complete {
        /// Length of the head, final empty line included.
        head_len: usize,
        /// The request.
        request: Request,
    },
}

// Enough slots for the default limit without touching the heap.
const STACK_HEADERS: usize = 64;

/// Parses one request head from the start of `buf`.
///
/// Limits are enforced on incomplete input too, so a client cannot make the
/// caller buffer without bound: a first line longer than
/// `max_request_line` is 414 as soon as that is evident, and more than
/// `max_head_bytes` without a complete head is 431.
///
/// `HTTP/1.0` and `HTTP/1.1` are parsed as they are, a later HTTP/1 minor
/// version (`HTTP/1.2`) as `HTTP/1.1` (RFC 9112 §2.3); another major version
/// is 505, a malformed request line (a space in the target, a version outside
/// `HTTP/DIGIT.DIGIT`) 400.
///
/// A `GET` or `HEAD` announcing a body is refused (`Transfer-Encoding`: 501,
/// `Content-Length` > 0: 413), because this server never reads bodies and
/// could not otherwise find where the next request starts. Any other method
/// is returned whatever its framing, to be answered 405; if it announces a
/// body its `keep_alive` is false, since the connection must close after the
/// answer.
pub fn parse_request(buf: &[u8], limits: &Limits) -> Result<Parsed, HttpError> {
    // Nothing past max_head_bytes can belong to an acceptable head, so the
    // parser never looks further; this bounds the work per call.
    let view = &buf[..buf.len().min(limits.max_head_bytes)];
    check_request_line(view, limits.max_request_line)?;
    let parsed = match parse_head(view, limits.max_headers)? {
        Some(parsed) => parsed,
        None => match classify_version(view) {
            Version::Later1x(at) => {
                // RFC 9112 §2.3: served as HTTP/1.1. httparse knows only 1.0 and 1.1, so parse
                // a copy whose minor digit reads 1. Rare, so the usual path never copies.
                let mut copy = view.to_vec();
                copy[at] = b'1';
                parse_head(&copy, limits.max_headers)?
                    .ok_or(HttpError::BadRequest("malformed HTTP version"))?
            }
            Version::Unfinished => Parsed::Incomplete,
            Version::Refused(e) => return Err(e),
        },
    };
    if matches!(parsed, Parsed::Incomplete) && buf.len() > limits.max_head_bytes {
        return Err(HttpError::HeadTooLarge);
    }
    Ok(parsed)
}

/// httparse on `view`; `Ok(None)` when it refused the HTTP version, which
/// [`classify_version`] then looks at.
fn parse_head(view: &[u8], max_headers: usize) -> Result<Option<Parsed>, HttpError> {
    // A header field needs at least 3 bytes ("a:\n"), so more slots than
    // that could never fill; this keeps a huge configured limit from turning
    // into a huge allocation.
    let slots = max_headers.min(view.len() / 3 + 1);
    let mut stack = [httparse::EMPTY_HEADER; STACK_HEADERS];
    let mut heap = Vec::new();
    let headers: &mut [httparse::Header<'_>] = if slots <= STACK_HEADERS {
        &mut stack[..slots]
    } else {
        heap.resize(slots, httparse::EMPTY_HEADER);
        &mut heap
    };
    let mut req = httparse::Request::new(headers);
    match req.parse(view) {
        Ok(httparse::Status::Partial) => Ok(Some(Parsed::Incomplete)),
        Ok(httparse::Status::Complete(head_len)) => {
            let request = build_request(&req)?;
            Ok(Some(Parsed::Complete { head_len, request }))
        }
        Err(httparse::Error::TooManyHeaders) => Err(HttpError::TooManyHeaders),
        Err(httparse::Error::Version) => Ok(None),
        Err(_) => Err(HttpError::BadRequest("malformed request head")),
    }
}

fn check_request_line(buf: &[u8], max: usize) -> Result<(), HttpError> {
    let line = skip_leading_newlines(buf);
    // One byte of CR and one of LF may follow a line of exactly `max` bytes.
    let window = &line[..line.len().min(max.saturating_add(2))];
    let len = match window.iter().position(|&b| b == b'\n') {
        Some(lf) => lf,
        None => window.len(),
    };
    let len = if len > 0 && window.get(len - 1) == Some(&b'\r') {
        len - 1
    } else {
        len
    };
    if len > max {
        Err(HttpError::RequestLineTooLong)
    } else {
        Ok(())
    }
}

fn build_request(req: &httparse::Request<'_, '_>) -> Result<Request, HttpError> {
    let method = match req.method {
        Some("GET") => Method::Get,
        Some("HEAD") => Method::Head,
        Some(other) => Method::Other(other.to_owned()),
        None => return Err(HttpError::BadRequest("missing method")),
    };
    let target = req
        .path
        .ok_or(HttpError::BadRequest("missing request-target"))?
        .to_owned();
    let minor_version = req
        .version
        .ok_or(HttpError::BadRequest("missing HTTP version"))?;

    let mut close = false;
    let mut keep = false;
    let mut hosts = 0usize;
    let mut transfer_encoding = false;
    let mut content_lengths: Vec<&[u8]> = Vec::new();
    let mut request = Request {
        method,
        target,
        minor_version,
        keep_alive: false,
        if_none_match: None,
        if_modified_since: None,
        range: None,
        if_range: None,
        host: None,
    };

    for h in req.headers.iter() {
        let name = h.name.as_bytes();
        let value = trim_ows(h.value);
        if name.eq_ignore_ascii_case(b"connection") {
            for token in value.split(|&b| b == b',') {
                let token = trim_ows(token);
                close |= token.eq_ignore_ascii_case(b"close");
                keep |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        } else if name.eq_ignore_ascii_case(b"host") {
            hosts += 1;
            request.host = Some(String::from_utf8_lossy(value).into_owned());
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            transfer_encoding = true;
        } else if name.eq_ignore_ascii_case(b"content-length") {
            content_lengths.push(value);
        } else if name.eq_ignore_ascii_case(b"if-none-match") {
            append_field(&mut request.if_none_match, value);
        } else if name.eq_ignore_ascii_case(b"if-modified-since") {
            append_field(&mut request.if_modified_since, value);
        } else if name.eq_ignore_ascii_case(b"range") {
            append_field(&mut request.range, value);
        } else if name.eq_ignore_ascii_case(b"if-range") {
            append_field(&mut request.if_range, value);
        }
    }

    // Disagreeing lengths are the classic request-smuggling vector: the proxy's rule.
    let content_length =
        crate::rules::content_length(content_lengths).map_err(HttpError::BadRequest)?;
    let has_body = transfer_encoding || content_length.is_some_and(|len| len > 0);
    if has_body && matches!(request.method, Method::Other(_)) {
        // Answered 405 whatever it carries; the body is never read, so the connection
        // cannot go on after the answer.
        request.keep_alive = false;
        return check_host(request, minor_version, hosts);
    }
    // Checked before Content-Length: when both are present Transfer-Encoding
    // governs the framing (RFC 9112 §6.3), and we implement none.
    if transfer_encoding {
        return Err(HttpError::TransferEncodingNotSupported);
    }
    if content_length.is_some_and(|len| len > 0) {
        return Err(HttpError::BodyNotAccepted);
    }
    request.keep_alive = if minor_version >= 1 {
        !close
    } else {
        keep && !close
    };
    check_host(request, minor_version, hosts)
}

fn check_host(request: Request, minor_version: u8, hosts: usize) -> Result<Request, HttpError> {
    if minor_version >= 1 && hosts != 1 {
        return Err(HttpError::BadRequest("HTTP/1.1 needs exactly one Host"));
    }
    if minor_version == 0 && hosts > 1 {
        return Err(HttpError::BadRequest("more than one Host"));
    }
    Ok(request)
}

/// Repeated list-valued fields are equivalent to one field joined by commas
/// (RFC 9110 §5.3).
fn append_field(slot: &mut Option<String>, value: &[u8]) {
    let value = String::from_utf8_lossy(value);
    match slot {
        Some(existing) => {
            existing.push_str(", ");
            existing.push_str(&value);
        }
        None => *slot = Some(value.into_owned()),
    }
}
