//! HTTP/1.1 forwarding for a reverse proxy (`tlsplane proxy --mode http`); no I/O.
//!
//! Request and response heads are parsed with httparse and written out again in canonical
//! form (CRLF line endings, one field per line), so what the backend sees never depends on how
//! leniently this parser read the client's bytes. On the way:
//!
//! * hop-by-hop fields are dropped (RFC 9110 §7.6.1: `Connection` and every field it names,
//!   `Keep-Alive`, `Proxy-Connection`, `TE`, `Transfer-Encoding`, `Upgrade`, `HTTP2-Settings`),
//!   and the framing fields are written again from the parsed framing. `Connection` cannot
//!   take `Host` away: a field every recipient needs is not a connection option (RFC 9110
//!   §7.6.1), and a request without it is invalid (RFC 9112 §3.2). The framing fields it
//!   names are written again anyway, from the framing the proxy parsed;
//! * an absolute-form target (`GET http://example.com/p HTTP/1.1`) is sent in origin-form
//!   (`/p`) with `Host` taken from it (RFC 9112 §3.2.2: its authority wins over any `Host`);
//!   a scheme other than http or https, or a user in the authority, is 400;
//! * `Upgrade` is forwarded only for `websocket` (the only protocol the proxy tunnels, and
//!   only after the backend's `101`); any other (`h2c`) is dropped with its `Connection`
//!   token, and the request goes as a plain one;
//! * `Forwarded`, `X-Forwarded-For` and `X-Forwarded-Proto` are set from the client's address
//!   ([`ForwardedPolicy`]: the client's own are replaced by default; replacing drops
//!   `X-Real-IP`, `X-Forwarded-Host` and `X-Forwarded-Port` as well, and the spellings with
//!   `_` for `-`, which nginx and Apache configurations read as the same field);
//! * bodies are framed by `Content-Length` or `chunked` (RFC 9112 §6), and [`BodyFraming`]
//!   follows the framing without looking at the content, so the caller moves body bytes
//!   unchanged.
//!
//! Requests that could be read two ways by two parsers are refused with 400 rather than
//! repaired (request smuggling): `Content-Length` together with `Transfer-Encoding`,
//! `Content-Length` values that differ, one that is not a plain decimal number, a
//! `Transfer-Encoding` whose last coding is not `chunked` or that names a coding other than
//! gzip, deflate or compress before it (`identity` included), chunk sizes that are not hex, do
//! not fit in 64 bits or are followed by anything but `;` and an extension, chunk lines not
//! ended by CRLF, and trailer fields that are malformed or that framing, routing, forwarding
//! or authentication depend on (RFC 9110 §6.5.1: `Content-Length`, `Host`, ...). Those are
//! refused rather than dropped because the body, trailers included, moves as it came.
//!
//! The HTTP version and `Content-Length` rules are serve's ([`crate::parse_request`]): HTTP/1.2
//! to 1.9 are served as 1.1, identical `Content-Length` values (`5, 5`) are one.

use std::net::IpAddr;

use crate::rules::{classify_version, Version};
use crate::{HttpError, Limits};

/// How a message's body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding` ending in `chunked`.
    Chunked,
    /// Until the sender closes (responses only).
    UntilClose,
}

/// What to do with the client's own `Forwarded` / `X-Forwarded-*` fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardedPolicy {
    /// Drop them and send ours (the client cannot forge its address).
    #[default]
    Replace,
    /// Keep theirs and add ours after them (a trusted proxy stands in front).
    Append,
    /// Pass the client's fields through and add none.
    Off,
}

/// A request head as it will be forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// The method, as sent.
    pub method: String,
    /// The request-target as it is forwarded: as sent, or the origin-form of an absolute-form
    /// one.
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// How the request body is delimited: never [`Framing::UntilClose`].
    pub framing: Framing,
    /// Whether the client allows another request on this connection.
    pub keep_alive: bool,
    /// `Expect: 100-continue` was sent (and is not forwarded: the proxy answers it).
    pub expect_continue: bool,
    /// `TE` names `trailers`: the client takes trailer fields (RFC 9110 §10.1.4). `TE` itself
    /// is hop-by-hop and not forwarded; an h2 backend is told again (the one `TE` h2 allows).
    pub te_trailers: bool,
    /// The protocol asked for in `Upgrade`, when `Connection` names `upgrade` (HTTP/1.1 only).
    pub upgrade: Option<String>,
    /// `Host`, as sent, or the authority of an absolute-form target.
    pub host: Option<String>,
    /// The end-to-end fields, in order.
    fields: Vec<(String, Vec<u8>)>,
    /// The client's `Transfer-Encoding` codings, to forward with the body they describe.
    transfer_codings: Option<String>,
}

/// A response head as it will be forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// The status code.
    pub status: u16,
    /// The reason phrase, as sent.
    pub reason: String,
    /// How the body is delimited, given the request it answers.
    pub framing: Framing,
    /// Whether the backend allows another request on this connection.
    pub keep_alive: bool,
    /// The protocol the backend switched to (status 101).
    pub upgrade: Option<String>,
    fields: Vec<(String, Vec<u8>)>,
    transfer_codings: Option<String>,
}

/// A complete head and how many bytes of the buffer it took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head<T> {
    /// Read more and call again with the whole buffer.
    Incomplete,
    /// The head, and its length (the body or the next message starts after it).
    Complete(T, usize),
}

/// Why a backend's response cannot be forwarded (answered 502).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BadResponse {
    /// Not an HTTP/1 response head; the text says what was wrong.
    Malformed(&'static str),
    /// The head is larger than the limit.
    TooLarge,
}

impl std::fmt::Display for BadResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadResponse::Malformed(why) => write!(f, "malformed response: {why}"),
            BadResponse::TooLarge => f.write_str("response head too large"),
        }
    }
}

impl std::error::Error for BadResponse {}

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "transfer-encoding",
    "upgrade",
    "content-length",
    // Belongs to an h2c upgrade (RFC 7540 §3.2.1: connection-specific), never forwarded.
    "http2-settings",
];

/// Fields `Connection` may name without their being dropped: needed end to end.
const NEVER_CONNECTION_OPTIONS: &[&str] = &["host"];

/// The only protocol an `Upgrade` is forwarded for.
const WEBSOCKET: &str = "websocket";

/// Transfer codings accepted before the final `chunked` (RFC 9112 §7). `identity` is not one
/// (it left the registry with RFC 7230) and is refused: parsers that read it as "no coding"
/// disagree with those that refuse it.
const KNOWN_CODINGS: &[&str] = &["gzip", "x-gzip", "deflate", "compress", "x-compress"];

/// The tokens of a comma-separated list field, trimmed and lower-cased.
fn tokens(value: &[u8]) -> impl Iterator<Item = String> + '_ {
    value
        .split(|&b| b == b',')
        .map(|t| String::from_utf8_lossy(t).trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
}

/// What the fields of a message say about its framing and connection.
#[derive(Default)]
struct FieldFacts {
    content_length: Vec<Vec<u8>>,
    transfer_codings: Vec<String>,
    connection: Vec<String>,
    upgrade: Option<String>,
    expect_continue: bool,
    te_trailers: bool,
    hosts: Vec<String>,
}

fn collect(headers: &[httparse::Header<'_>], request: bool) -> Result<FieldFacts, &'static str> {
    let mut f = FieldFacts::default();
    for h in headers {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            f.content_length.push(h.value.to_vec());
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            f.transfer_codings.extend(tokens(h.value));
        } else if name.eq_ignore_ascii_case("connection") {
            f.connection.extend(tokens(h.value));
        } else if name.eq_ignore_ascii_case("upgrade") {
            let v = String::from_utf8_lossy(h.value).trim().to_string();
            f.upgrade = Some(match f.upgrade.take() {
                Some(prev) => format!("{prev}, {v}"),
                None => v,
            });
        } else if request && name.eq_ignore_ascii_case("expect") {
            if h.value.trim_ascii().eq_ignore_ascii_case(b"100-continue") {
                f.expect_continue = true;
            } else {
                return Err("unsupported expectation");
            }
        } else if request && name.eq_ignore_ascii_case("te") {
            f.te_trailers |= tokens(h.value).any(|t| t == "trailers");
        } else if request && name.eq_ignore_ascii_case("host") {
            f.hosts.push(String::from_utf8_lossy(h.value).into_owned());
        }
    }
    Ok(f)
}

/// The `Content-Length` fields of a message: serve's rule (see [`crate::rules`]).
fn content_length(values: &[Vec<u8>]) -> Result<Option<u64>, &'static str> {
    crate::rules::content_length(values.iter().map(Vec::as_slice))
}

/// Whether `name` is a field this proxy drops or writes itself.
fn is_hop_by_hop(name: &str, connection: &[String], forwarded: ForwardedPolicy) -> bool {
    HOP_BY_HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
        || (connection.iter().any(|c| name.eq_ignore_ascii_case(c))
            && !NEVER_CONNECTION_OPTIONS
                .iter()
                .any(|k| name.eq_ignore_ascii_case(k)))
        || (forwarded == ForwardedPolicy::Replace && is_forwarding_field(name.as_bytes()))
}

/// Fields that say who the client is or how it came; a client's own are dropped under
/// [`ForwardedPolicy::Replace`] (the proxy writes the first three) and refused in trailers.
const FORWARDING_FIELDS: &[&str] = &[
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-forwarded-port",
    "x-real-ip",
];

/// `name` is `want` (lower case), without case and with `_` read as `-`: nginx (with
/// `underscores_in_headers`), Apache CGI and PHP's `$_SERVER` make `X_Forwarded_For` the same
/// variable as `X-Forwarded-For`.
fn same_field_loosely(name: &[u8], want: &str) -> bool {
    name.len() == want.len()
        && name.iter().zip(want.bytes()).all(|(&a, b)| {
            let a = if a == b'_' { b'-' } else { a };
            a.eq_ignore_ascii_case(&b)
        })
}

fn is_forwarding_field(name: &[u8]) -> bool {
    FORWARDING_FIELDS
        .iter()
        .any(|f| same_field_loosely(name, f))
}

/// Splits an absolute-form request-target (`http://host:port/path?q`) into its authority
/// and its origin-form (`/path?q`), RFC 9112 §3.2.2.
fn absolute_form(target: &str) -> Result<(String, String), HttpError> {
    let bad = HttpError::BadRequest("request-target neither origin-form nor an http(s) URI");
    let (scheme, rest) = target.split_once("://").ok_or(bad)?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err(bad);
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.is_empty() || authority.contains('@') || path.starts_with('#') {
        return Err(HttpError::BadRequest(
            "no host, or a user, in an absolute-form target",
        ));
    }
    let path = match path.as_bytes().first() {
        None => "/".to_string(),
        Some(b'?') => format!("/{path}"),
        Some(_) => path.to_string(),
    };
    Ok((authority.to_string(), path))
}

fn end_to_end(
    headers: &[httparse::Header<'_>],
    connection: &[String],
    forwarded: ForwardedPolicy,
    drop_expect: bool,
) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|h| !is_hop_by_hop(h.name, connection, forwarded))
        .filter(|h| !(drop_expect && h.name.eq_ignore_ascii_case("expect")))
        .map(|h| (h.name.to_string(), h.value.to_vec()))
        .collect()
}

/// Parses a request head from the start of `buf`.
///
/// `Err` is the status to answer with (and then close): 400 for anything malformed or
/// ambiguous, 431 for a head over `limits`, 501 for a transfer coding or expectation this
/// proxy cannot forward, 505 for another HTTP version.
pub fn parse_request_head(
    buf: &[u8],
    limits: &Limits,
    forwarded: ForwardedPolicy,
) -> Result<Head<RequestHead>, HttpError> {
    let view = &buf[..buf.len().min(limits.max_head_bytes)];
    let incomplete = || {
        if view.len() < limits.max_head_bytes {
            Ok(Head::Incomplete)
        } else {
            Err(HttpError::HeadTooLarge)
        }
    };
    let mut headers = vec![httparse::EMPTY_HEADER; limits.max_headers];
    let mut later_headers = Vec::new();
    let copy: Vec<u8>;
    let mut req = httparse::Request::new(&mut headers);
    let mut parsed = req.parse(view);
    if parsed == Err(httparse::Error::Version) {
        // serve's rule: a later HTTP/1 minor version is 1.1, another major 505.
        match classify_version(view) {
            Version::Later1x(at) => {
                let mut c = view.to_vec();
                c[at] = b'1';
                copy = c;
                later_headers.resize(limits.max_headers, httparse::EMPTY_HEADER);
                req = httparse::Request::new(&mut later_headers);
                parsed = req.parse(&copy);
                if parsed == Err(httparse::Error::Version) {
                    return Err(HttpError::BadRequest("malformed HTTP version"));
                }
            }
            Version::Unfinished => return incomplete(),
            Version::Refused(e) => return Err(e),
        }
    }
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return incomplete(),
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::TooManyHeaders),
        Err(_) => return Err(HttpError::BadRequest("malformed request head")),
    };
    let method = req.method.unwrap_or_default().to_string();
    let mut target = req.path.unwrap_or_default().to_string();
    let minor_version = req.version.unwrap_or(1);
    let facts = collect(req.headers, true).map_err(|why| match why {
        "unsupported expectation" => HttpError::ExpectationFailed,
        why => HttpError::BadRequest(why),
    })?;
    if minor_version == 1 && facts.hosts.len() != 1 {
        return Err(HttpError::BadRequest("HTTP/1.1 needs exactly one Host"));
    }
    if facts.hosts.len() > 1 {
        return Err(HttpError::BadRequest("more than one Host"));
    }
    let length = content_length(&facts.content_length).map_err(HttpError::BadRequest)?;
    if length.is_some_and(|n| n > i64::MAX as u64) {
        // More than any backend's file offsets can count (nginx: 400 too).
        return Err(HttpError::BadRequest("Content-Length too large"));
    }
    let framing = if !facts.transfer_codings.is_empty() {
        if length.is_some() {
            return Err(HttpError::BadRequest(
                "both Content-Length and Transfer-Encoding",
            ));
        }
        if minor_version == 0 {
            return Err(HttpError::BadRequest("Transfer-Encoding in HTTP/1.0"));
        }
        let chunked = facts
            .transfer_codings
            .iter()
            .filter(|c| *c == "chunked")
            .count();
        if chunked != 1 || facts.transfer_codings.last().map(String::as_str) != Some("chunked") {
            return Err(HttpError::BadRequest(
                "Transfer-Encoding must end in chunked, once",
            ));
        }
        // Not empty: it ends in chunked.
        let before = &facts.transfer_codings[..facts.transfer_codings.len() - 1];
        if before.iter().any(|c| !KNOWN_CODINGS.contains(&c.as_str())) {
            return Err(HttpError::BadRequest(
                "unknown transfer coding before chunked",
            ));
        }
        Framing::Chunked
    } else {
        match length {
            None | Some(0) => Framing::Empty,
            Some(n) => Framing::Length(n),
        }
    };
    let close = facts.connection.iter().any(|c| c == "close");
    let keep_alive = if minor_version == 0 {
        !close && facts.connection.iter().any(|c| c == "keep-alive")
    } else {
        !close
    };
    // Only websocket is tunnelled: after any other protocol's 101 (h2c) the bytes that follow
    // would be requests the proxy no longer reads, rewrites or checks.
    let upgrade = match &facts.upgrade {
        Some(u)
            if minor_version == 1
                && facts.connection.iter().any(|c| c == "upgrade")
                && tokens(u.as_bytes()).any(|p| p == WEBSOCKET) =>
        {
            Some(WEBSOCKET.to_string())
        }
        _ => None,
    };
    let expect_continue = facts.expect_continue && minor_version == 1;
    let mut host = facts.hosts.into_iter().next();
    let mut fields = end_to_end(req.headers, &facts.connection, forwarded, true);
    if !target.starts_with('/') && target != "*" && method != "CONNECT" {
        let (authority, origin_form) = absolute_form(&target)?;
        match fields
            .iter_mut()
            .find(|(name, _)| name.eq_ignore_ascii_case("host"))
        {
            Some((_, value)) => *value = authority.clone().into_bytes(),
            None => fields.push(("Host".into(), authority.clone().into_bytes())),
        }
        host = Some(authority);
        target = origin_form;
    }
    Ok(Head::Complete(
        RequestHead {
            method,
            target,
            minor_version,
            framing,
            keep_alive,
            expect_continue,
            te_trailers: facts.te_trailers,
            upgrade,
            host,
            fields,
            transfer_codings: (framing == Framing::Chunked)
                .then(|| facts.transfer_codings.join(", ")),
        },
        len,
    ))
}

/// Who sent a request, for `Forwarded` / `X-Forwarded-*`.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    /// The client's address.
    pub client: IpAddr,
    /// `https` here: the proxy terminates TLS.
    pub proto: &'a str,
}

impl RequestHead {
    /// The first end-to-end field named `name` (any case), its value as sent.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// Whether a request may be sent again on another connection when the first one failed
    /// before any response byte (RFC 9110 §9.2.2), given it has no body to replay.
    pub fn is_retryable(&self) -> bool {
        self.framing == Framing::Empty
            && matches!(
                self.method.as_str(),
                "GET" | "HEAD" | "OPTIONS" | "TRACE" | "PUT" | "DELETE"
            )
    }

    /// Whether the response to this request has no body whatever its fields say.
    pub fn is_head(&self) -> bool {
        self.method == "HEAD"
    }

    /// The head to send to the backend: canonical form, framing and forwarding fields written
    /// by the proxy, the backend connection kept alive unless the request upgrades. An
    /// HTTP/1.0 request goes as HTTP/1.0 (with `Connection: keep-alive`), so that the backend
    /// answers in a framing an HTTP/1.0 client reads (never chunked).
    pub fn encode(&self, origin: Origin<'_>, forwarded: ForwardedPolicy, out: &mut Vec<u8>) {
        out.extend_from_slice(self.method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.target.as_bytes());
        out.extend_from_slice(if self.minor_version == 0 {
            b" HTTP/1.0\r\n"
        } else {
            b" HTTP/1.1\r\n"
        });
        for (name, value) in &self.fields {
            field(out, name.as_bytes(), value);
        }
        if forwarded != ForwardedPolicy::Off {
            let ip = origin.client.to_string();
            let node = match origin.client {
                IpAddr::V4(_) => ip.clone(),
                IpAddr::V6(_) => format!("\"[{ip}]\""),
            };
            let mut fwd = format!("for={node};proto={}", origin.proto);
            if let Some(host) = &self.host {
                if host
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
                {
                    fwd.push_str(&format!(";host=\"{host}\""));
                }
            }
            field(out, b"Forwarded", fwd.as_bytes());
            field(out, b"X-Forwarded-For", ip.as_bytes());
            field(out, b"X-Forwarded-Proto", origin.proto.as_bytes());
        }
        match self.framing {
            Framing::Length(n) => field(out, b"Content-Length", n.to_string().as_bytes()),
            Framing::Chunked => field(
                out,
                b"Transfer-Encoding",
                self.transfer_codings
                    .as_deref()
                    .unwrap_or("chunked")
                    .as_bytes(),
            ),
            Framing::Empty | Framing::UntilClose => {}
        }
        if let Some(proto) = &self.upgrade {
            field(out, b"Connection", b"upgrade");
            field(out, b"Upgrade", proto.as_bytes());
        } else if self.minor_version == 0 {
            field(out, b"Connection", b"keep-alive");
        }
        out.extend_from_slice(b"\r\n");
    }
}

fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Parses a response head from the start of `buf`, the answer to `request`.
pub fn parse_response_head(
    buf: &[u8],
    request: &RequestHead,
    max_head_bytes: usize,
    max_headers: usize,
) -> Result<Head<ResponseHead>, BadResponse> {
    let view = &buf[..buf.len().min(max_head_bytes)];
    let mut headers = vec![httparse::EMPTY_HEADER; max_headers];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(view) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if view.len() < max_head_bytes => {
            return Ok(Head::Incomplete)
        }
        Ok(httparse::Status::Partial) => return Err(BadResponse::TooLarge),
        Err(httparse::Error::TooManyHeaders) => return Err(BadResponse::TooLarge),
        Err(_) => return Err(BadResponse::Malformed("not an HTTP/1 response head")),
    };
    let status = resp.code.unwrap_or(0);
    let minor_version = resp.version.unwrap_or(1);
    let facts = collect(resp.headers, false).map_err(BadResponse::Malformed)?;
    let close = facts.connection.iter().any(|c| c == "close");
    let mut keep_alive = if minor_version == 0 {
        !close && facts.connection.iter().any(|c| c == "keep-alive")
    } else {
        !close
    };
    let length = content_length(&facts.content_length).map_err(BadResponse::Malformed)?;
    let no_body =
        request.is_head() || (100..200).contains(&status) || status == 204 || status == 304;
    let framing = if no_body {
        Framing::Empty
    } else if !facts.transfer_codings.is_empty() {
        if facts.transfer_codings.last().map(String::as_str) == Some("chunked") {
            if length.is_some() {
                // RFC 9112 §6.3: Transfer-Encoding wins, but the sender is not to be
                // trusted with the connection afterwards.
                keep_alive = false;
            }
            Framing::Chunked
        } else {
            keep_alive = false;
            Framing::UntilClose
        }
    } else {
        match length {
            Some(n) => Framing::Length(n),
            None => {
                keep_alive = false;
                Framing::UntilClose
            }
        }
    };
    let upgrade = (status == 101).then(|| facts.upgrade.clone().unwrap_or_default());
    // Bodiless responses keep their Content-Length: it describes the representation
    // (HEAD, 304), not this message.
    let mut fields = end_to_end(resp.headers, &facts.connection, ForwardedPolicy::Off, false);
    if no_body {
        if let Some(n) = length {
            if !(100..200).contains(&status) && status != 204 {
                fields.push(("Content-Length".into(), n.to_string().into_bytes()));
            }
        }
    }
    Ok(Head::Complete(
        ResponseHead {
            status,
            reason: resp.reason.unwrap_or_default().to_string(),
            framing,
            keep_alive,
            upgrade,
            fields,
            transfer_codings: (framing == Framing::Chunked)
                .then(|| facts.transfer_codings.join(", ")),
        },
        len,
    ))
}

impl ResponseHead {
    /// Whether this is an interim (1xx) response other than 101: another head follows.
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.status) && self.status != 101
    }

    /// The head to send to the client. `keep_alive`: whether the client's connection stays
    /// open after this response (said to HTTP/1.0 clients, and `close` said to all when not).
    pub fn encode(&self, client_minor_version: u8, keep_alive: bool, out: &mut Vec<u8>) {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(self.status.to_string().as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.reason.as_bytes());
        out.extend_from_slice(b"\r\n");
        for (name, value) in &self.fields {
            field(out, name.as_bytes(), value);
        }
        match self.framing {
            Framing::Length(n) => field(out, b"Content-Length", n.to_string().as_bytes()),
            Framing::Chunked => field(
                out,
                b"Transfer-Encoding",
                self.transfer_codings
                    .as_deref()
                    .unwrap_or("chunked")
                    .as_bytes(),
            ),
            Framing::Empty | Framing::UntilClose => {}
        }
        if let Some(proto) = &self.upgrade {
            field(out, b"Connection", b"upgrade");
            field(out, b"Upgrade", proto.as_bytes());
        } else if !self.is_interim() {
            if !keep_alive {
                field(out, b"Connection", b"close");
            } else if client_minor_version == 0 {
                field(out, b"Connection", b"keep-alive");
            }
        }
        out.extend_from_slice(b"\r\n");
    }
}

/// Follows a body's framing over the bytes that carry it, without copying or reading its
/// content (beyond chunk-size lines and trailers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyFraming {
    state: State,
    /// Bytes of chunk-size lines and trailer fields seen in the current line (bounded).
    line: usize,
    /// The start of the current trailer field's name, lower-cased: enough to tell a
    /// forbidden one (longer names are none of them).
    name: [u8; TRAILER_NAME_SEEN],
    /// Bytes of the name so far (may exceed what `name` keeps).
    name_len: usize,
}

/// More than the longest name in [`FORBIDDEN_TRAILERS`] and [`FORWARDING_FIELDS`].
const TRAILER_NAME_SEEN: usize = 24;

/// Fields a trailer may not carry (RFC 9110 §6.5.1): framing, routing, request modifiers,
/// authentication, response control data, how to process the content, and who the client is.
/// A recipient that merges trailers into the header section (as many backends do) would
/// otherwise let a client set them after the proxy has checked and written the head.
const FORBIDDEN_TRAILERS: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "upgrade",
    "trailer",
    "expect",
    "max-forwards",
    "cache-control",
    "pragma",
    "range",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
    "if-range",
    "authorization",
    "proxy-authorization",
    "www-authenticate",
    "proxy-authenticate",
    "cookie",
    "set-cookie",
    "age",
    "expires",
    "date",
    "location",
    "retry-after",
    "vary",
    "content-encoding",
    "content-type",
    "content-range",
    // and FORWARDING_FIELDS, checked beside this list.
];

/// Whether a field named `name` may travel in a trailer section: none of the fields
/// [`BodyFraming`] refuses there (RFC 9110 §6.5.1, and the forwarding fields). For a proxy
/// that rewrites a trailer section in another framing (an h2 trailers HEADERS frame), which
/// leaves out what may not be there rather than trusting the parser upstream alone.
pub fn may_be_trailer(name: &[u8]) -> bool {
    !(FORBIDDEN_TRAILERS
        .iter()
        .any(|f| same_field_loosely(name, f))
        || is_forwarding_field(name))
}

/// A token character (RFC 9110 §5.6.2), as a field name is made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A byte a field value may hold: HTAB, SP, visible ASCII, obs-text (as httparse allows in
/// the head).
fn is_field_value_byte(b: u8) -> bool {
    b == b'\t' || b == b' ' || b.is_ascii_graphic() || b >= 0x80
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Bytes left of a Content-Length body.
    Length(u64),
    /// Reading a chunk size: its value so far, and whether a digit was seen.
    Size(u64, bool),
    /// Past the size and its `;`, in extensions until CR.
    Extension(u64),
    /// After the CR of a chunk-size line.
    SizeLf(u64),
    /// Bytes left of a chunk's data.
    Data(u64),
    /// The CR after a chunk's data.
    DataCr,
    /// The LF after a chunk's data.
    DataLf,
    /// At the start of a trailer line (an empty one ends the body).
    TrailerStart,
    /// Inside a trailer field's name.
    TrailerName,
    /// Past the colon of a trailer field, in its value.
    Trailer,
    /// After the CR of a trailer line; whether the line was empty.
    TrailerLf(bool),
    /// Until the sender closes.
    UntilClose,
    Done,
}

/// Why a body's framing is broken (the connection cannot carry anything more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BadBody {
    /// A chunk size that is not hex, has no digit, or does not fit in 64 bits.
    ChunkSize,
    /// A line of the chunked framing not ended by CRLF.
    LineEnding,
    /// A chunk-size line or trailer section longer than allowed.
    TooLong,
    /// A trailer line that is not a field (no colon, a bad name or value, obs-fold) or a
    /// field a trailer may not carry (`Content-Length`, `Host`, ...).
    Trailer,
}

impl std::fmt::Display for BadBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BadBody::ChunkSize => "bad chunk size",
            BadBody::LineEnding => "chunk framing without CRLF",
            BadBody::TooLong => "chunk line or trailers too long",
            BadBody::Trailer => "malformed or forbidden trailer field",
        })
    }
}

impl std::error::Error for BadBody {}

/// Longest chunk-size line (extensions included) or trailer section accepted.
const MAX_FRAMING_LINE: usize = 4096;

impl BodyFraming {
    /// Starts following a body framed as `framing`.
    pub fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Size(0, false),
            Framing::UntilClose => State::UntilClose,
        };
        Self {
            state,
            line: 0,
            name: [0; TRAILER_NAME_SEEN],
            name_len: 0,
        }
    }

    /// Whether the whole body has been seen.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Whether the body ends only when its sender closes.
    pub fn until_close(&self) -> bool {
        self.state == State::UntilClose
    }

    /// Takes the next bytes of the stream: returns how many of them belong to the body
    /// (the rest, after [`Self::is_done`], belongs to the next message).
    pub fn advance(&mut self, buf: &[u8]) -> Result<usize, BadBody> {
        let mut at = 0;
        while at < buf.len() {
            match self.state {
                State::Done => break,
                State::UntilClose => return Ok(buf.len()),
                State::Length(left) | State::Data(left) => {
                    let n = left.min((buf.len() - at) as u64);
                    at += n as usize;
                    let left = left - n;
                    self.state = match self.state {
                        State::Length(_) if left == 0 => State::Done,
                        State::Length(_) => State::Length(left),
                        _ if left == 0 => State::DataCr,
                        _ => State::Data(left),
                    };
                    continue;
                }
                _ => {}
            }
            let b = buf[at];
            at += 1;
            self.line += 1;
            if self.line > MAX_FRAMING_LINE {
                return Err(BadBody::TooLong);
            }
            self.state = match (self.state, b) {
                (State::Size(n, _), b) if b.is_ascii_hexdigit() => {
                    if n > (u64::MAX >> 4) {
                        return Err(BadBody::ChunkSize);
                    }
                    let d = (b as char).to_digit(16).map_or(0, u64::from);
                    State::Size(n << 4 | d, true)
                }
                (State::Size(_, false), _) => return Err(BadBody::ChunkSize),
                (State::Size(n, true), b'\r') => State::SizeLf(n),
                // Nothing but an extension after the size: `5 ` is refused, as parsers that
                // stop at the space and parsers that refuse it would frame it differently.
                (State::Size(n, true), b';') => State::Extension(n),
                (State::Size(..), _) => return Err(BadBody::ChunkSize),
                (State::Extension(n), b'\r') => State::SizeLf(n),
                (State::Extension(_), b'\n') => return Err(BadBody::LineEnding),
                (State::Extension(n), b) if is_field_value_byte(b) => State::Extension(n),
                (State::Extension(_), _) => return Err(BadBody::ChunkSize),
                (State::SizeLf(0), b'\n') => {
                    self.line = 0;
                    State::TrailerStart
                }
                (State::SizeLf(n), b'\n') => {
                    self.line = 0;
                    State::Data(n)
                }
                (State::DataCr, b'\r') => State::DataLf,
                (State::DataLf, b'\n') => {
                    self.line = 0;
                    State::Size(0, false)
                }
                (State::TrailerStart, b'\r') => State::TrailerLf(true),
                (State::TrailerStart | State::TrailerName, b) if is_tchar(b) => {
                    if self.state == State::TrailerStart {
                        self.name_len = 0;
                    }
                    if let Some(slot) = self.name.get_mut(self.name_len) {
                        *slot = b.to_ascii_lowercase();
                    }
                    self.name_len += 1;
                    State::TrailerName
                }
                (State::TrailerName, b':') => {
                    let seen = &self.name[..self.name_len.min(TRAILER_NAME_SEEN)];
                    if self.name_len <= TRAILER_NAME_SEEN
                        && (FORBIDDEN_TRAILERS
                            .iter()
                            .any(|f| same_field_loosely(seen, f))
                            || is_forwarding_field(seen))
                    {
                        return Err(BadBody::Trailer);
                    }
                    State::Trailer
                }
                (State::Trailer, b'\r') => State::TrailerLf(false),
                (State::TrailerStart | State::TrailerName | State::Trailer, b'\n') => {
                    return Err(BadBody::LineEnding)
                }
                (State::Trailer, b) if is_field_value_byte(b) => State::Trailer,
                // No colon, a space before it, obs-fold (a line starting with a space), a
                // control byte in a value.
                (State::TrailerStart | State::TrailerName | State::Trailer, _) => {
                    return Err(BadBody::Trailer)
                }
                (State::TrailerLf(true), b'\n') => State::Done,
                // The trailer section as a whole is bounded by `line`, not reset per field.
                (State::TrailerLf(false), b'\n') => State::TrailerStart,
                (State::SizeLf(_) | State::DataCr | State::DataLf | State::TrailerLf(_), _) => {
                    return Err(BadBody::LineEnding)
                }
                // Not reached: these states move whole runs of bytes above.
                (State::Length(_) | State::Data(_) | State::UntilClose | State::Done, _) => {
                    return Err(BadBody::LineEnding)
                }
            };
        }
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(raw: &str) -> Result<RequestHead, HttpError> {
        match parse_request_head(raw.as_bytes(), &Limits::default(), ForwardedPolicy::Replace)? {
            Head::Complete(h, len) => {
                assert_eq!(len, raw.find("\r\n\r\n").unwrap() + 4);
                Ok(h)
            }
            Head::Incomplete => panic!("incomplete: {raw:?}"),
        }
    }

    fn forwarded(h: &RequestHead, policy: ForwardedPolicy) -> String {
        let mut out = Vec::new();
        let origin = Origin {
            client: "192.0.2.7".parse().unwrap(),
            proto: "https",
        };
        h.encode(origin, policy, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn smuggling_shapes_are_refused() {
        for (raw, why) in [
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", "CL+TE"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", "two CLs"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 6\r\n\r\n", "CL list"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n", "signed CL"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x5\r\n\r\n", "hex CL"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n", "huge CL"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", "TE not ending in chunked"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked twice"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n", "unknown coding"),
            ("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", "TE in 1.0"),
            ("GET / HTTP/1.1\r\n\r\n", "no Host"),
            ("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "two Hosts"),
            ("GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n", "space before colon"),
        ] {
            match req(raw) {
                Err(e) => assert_eq!(e.status(), 400, "{why}: {e}"),
                Ok(h) => panic!("{why} accepted: {h:?}"),
            }
        }
    }

    #[test]
    fn framing_of_requests() {
        let h = req("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n").unwrap();
        assert_eq!(h.framing, Framing::Length(12));
        let h =
            req("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n").unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        assert!(
            forwarded(&h, ForwardedPolicy::Off).contains("Transfer-Encoding: gzip, chunked\r\n")
        );
        let h = req("GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert_eq!(h.framing, Framing::Empty);
        assert!(h.keep_alive && h.is_retryable());
        let h = req("GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(!h.keep_alive);
        let h = req("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert!(h.keep_alive);
        let h = req("GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").unwrap();
        assert!(!h.keep_alive);
        let e = req("PUT / HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\n\r\n").unwrap_err();
        assert_eq!(e.status(), 417);
        assert_eq!(
            parse_request_head(
                b"GET / HTTP/1.1\r\nHost: a\r\n",
                &Limits::default(),
                ForwardedPolicy::Replace
            ),
            Ok(Head::Incomplete)
        );
        let big = format!("GET / HTTP/1.1\r\nHost: a\r\nX: {}\r\n", "y".repeat(20000));
        assert_eq!(
            parse_request_head(big.as_bytes(), &Limits::default(), ForwardedPolicy::Replace)
                .unwrap_err()
                .status(),
            431
        );
    }

    #[test]
    fn hop_by_hop_fields_go_and_forwarding_fields_are_ours() {
        let h = req("POST /p?q HTTP/1.1\r\nhost: example.com\r\nConnection: keep-alive, X-Secret\r\n\
                     X-Secret: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Connection: x\r\n\
                     X-Forwarded-For: 6.6.6.6\r\nForwarded: for=6.6.6.6\r\nX-Forwarded-Proto: http\r\n\
                     Expect: 100-continue\r\nContent-Length: 3\r\nAccept: */*\r\n\r\n")
        .unwrap();
        assert!(h.expect_continue);
        assert!(h.te_trailers);
        let out = forwarded(&h, ForwardedPolicy::Replace);
        assert_eq!(
            out,
            "POST /p?q HTTP/1.1\r\nhost: example.com\r\nAccept: */*\r\n\
             Forwarded: for=192.0.2.7;proto=https;host=\"example.com\"\r\n\
             X-Forwarded-For: 192.0.2.7\r\nX-Forwarded-Proto: https\r\nContent-Length: 3\r\n\r\n"
        );
        let h = req("GET / HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n").unwrap();
        let h2 = parse_request_head(
            b"GET / HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n",
            &Limits::default(),
            ForwardedPolicy::Append,
        )
        .unwrap();
        let Head::Complete(h2, _) = h2 else { panic!() };
        let appended = forwarded(&h2, ForwardedPolicy::Append);
        assert!(
            appended.contains("X-Forwarded-For: 10.0.0.1\r\n"),
            "{appended}"
        );
        assert!(
            appended.contains("X-Forwarded-For: 192.0.2.7\r\n"),
            "{appended}"
        );
        let off = forwarded(&h, ForwardedPolicy::Off);
        assert!(
            !off.contains("X-Forwarded") && !off.contains("Forwarded:"),
            "{off}"
        );
        let v6 = {
            let mut out = Vec::new();
            h.encode(
                Origin {
                    client: "::1".parse().unwrap(),
                    proto: "https",
                },
                ForwardedPolicy::Replace,
                &mut out,
            );
            String::from_utf8(out).unwrap()
        };
        assert!(v6.contains("Forwarded: for=\"[::1]\";proto=https"), "{v6}");
    }

    #[test]
    fn http_1_0_goes_as_1_0_so_that_no_chunked_response_comes_back() {
        let h = req("GET /x HTTP/1.0\r\nUser-Agent: old\r\n\r\n").unwrap();
        let out = forwarded(&h, ForwardedPolicy::Off);
        assert_eq!(
            out,
            "GET /x HTTP/1.0\r\nUser-Agent: old\r\nConnection: keep-alive\r\n\r\n"
        );
        let get = req("GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert!(forwarded(&get, ForwardedPolicy::Off).starts_with("GET / HTTP/1.1\r\n"));
    }

    #[test]
    fn upgrade_needs_connection_upgrade() {
        let h =
            req("GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
                .unwrap();
        assert_eq!(h.upgrade.as_deref(), Some("websocket"));
        let out = forwarded(&h, ForwardedPolicy::Off);
        assert!(
            out.ends_with("Connection: upgrade\r\nUpgrade: websocket\r\n\r\n"),
            "{out}"
        );
        let h = req("GET /ws HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n").unwrap();
        assert_eq!(h.upgrade, None);
        assert!(!forwarded(&h, ForwardedPolicy::Off).contains("pgrade"));
    }

    fn resp(raw: &str, request: &RequestHead) -> ResponseHead {
        match parse_response_head(raw.as_bytes(), request, 16384, 64).unwrap() {
            Head::Complete(h, _) => h,
            Head::Incomplete => panic!("incomplete"),
        }
    }

    #[test]
    fn framing_of_responses() {
        let get = req("GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        let head = req("HEAD / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        let r = resp("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", &get);
        assert_eq!((r.framing, r.keep_alive), (Framing::Length(5), true));
        let r = resp("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", &head);
        assert_eq!(r.framing, Framing::Empty);
        let mut out = Vec::new();
        r.encode(1, true, &mut out);
        assert_eq!(out, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n");
        let r = resp("HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\n\r\n", &get);
        assert_eq!(r.framing, Framing::Empty);
        let r = resp("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive, foo\r\nfoo: 1\r\n\r\n", &get);
        assert_eq!((r.framing, r.keep_alive), (Framing::Chunked, true));
        let mut out = Vec::new();
        r.encode(0, false, &mut out);
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        );
        let r = resp("HTTP/1.0 200 OK\r\n\r\n", &get);
        assert_eq!((r.framing, r.keep_alive), (Framing::UntilClose, false));
        let r = resp(
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            &get,
        );
        assert_eq!((r.framing, r.keep_alive), (Framing::Chunked, false));
        let r = resp("HTTP/1.1 100 Continue\r\n\r\n", &get);
        assert!(r.is_interim());
        assert!(parse_response_head(
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            &get,
            16384,
            64
        )
        .is_err());
        assert!(parse_response_head(b"SSH-2.0-OpenSSH\r\n\r\n", &get, 16384, 64).is_err());
    }

    /// Feeds `body` in pieces of `step` bytes; returns the body length found.
    fn follow(framing: Framing, body: &[u8], step: usize) -> Result<usize, BadBody> {
        let mut f = BodyFraming::new(framing);
        let mut used = 0;
        for piece in body.chunks(step) {
            let n = f.advance(piece)?;
            used += n;
            if f.is_done() {
                return Ok(used);
            }
            assert_eq!(n, piece.len());
        }
        Ok(used)
    }

    #[test]
    fn chunked_bodies_end_where_they_end_whatever_the_pieces() {
        let body = b"5\r\nhello\r\n1a; ext=\"x\"\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Checksum: t\r\n\r\nGET /next";
        let end = body.len() - b"GET /next".len();
        for step in [1, 2, 3, 7, 100] {
            assert_eq!(follow(Framing::Chunked, body, step), Ok(end), "step {step}");
        }
        assert_eq!(follow(Framing::Chunked, b"0\r\n\r\nX", 1), Ok(5));
        assert_eq!(follow(Framing::Length(4), b"abcdefg", 3), Ok(4));
        let mut f = BodyFraming::new(Framing::Chunked);
        assert_eq!(f.advance(b"5\r\nhel"), Ok(6));
        assert!(!f.is_done());
    }

    #[test]
    fn broken_chunk_framing_is_an_error() {
        for (body, want) in [
            (&b"g\r\n"[..], BadBody::ChunkSize),
            (b"\r\n", BadBody::ChunkSize),
            (b"-1\r\n", BadBody::ChunkSize),
            (b"10000000000000000\r\n", BadBody::ChunkSize),
            (b"5\nhello\r\n", BadBody::ChunkSize),
            (b"5\r\nhelloX\r\n", BadBody::LineEnding),
            (b"5\r\nhello\n0\r\n\r\n", BadBody::LineEnding),
            (b"0\r\n\n", BadBody::LineEnding),
            (b"1;a\nx", BadBody::LineEnding),
        ] {
            assert_eq!(follow(Framing::Chunked, body, 1), Err(want), "{body:?}");
        }
        let long = format!("1;{}\r\n", "e".repeat(5000));
        assert_eq!(
            follow(Framing::Chunked, long.as_bytes(), 64),
            Err(BadBody::TooLong)
        );
    }

    #[test]
    fn te_trailers_is_seen_among_the_codings_and_not_forwarded() {
        for (te, want) in [
            ("trailers", true),
            ("gzip, Trailers", true),
            ("gzip", false),
            ("trailersx", false),
        ] {
            let h = req(&format!("GET / HTTP/1.1\r\nHost: a\r\nTE: {te}\r\n\r\n")).unwrap();
            assert_eq!(h.te_trailers, want, "{te}");
            let out = forwarded(&h, ForwardedPolicy::Off);
            assert!(!out.to_ascii_lowercase().contains("\r\nte:"), "{out}");
        }
        let h = req("GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert!(!h.te_trailers);
    }

    #[test]
    fn may_be_trailer_says_what_the_trailer_parser_takes() {
        for name in ["x-sum", "grpc-status", "X-Checksum", "digest"] {
            assert!(may_be_trailer(name.as_bytes()), "{name}");
        }
        for name in [
            "Content-Length",
            "host",
            "transfer-encoding",
            "connection",
            "te",
            "trailer",
            "authorization",
            "x_forwarded_for",
            "Forwarded",
        ] {
            assert!(!may_be_trailer(name.as_bytes()), "{name}");
            // ... the same fields the chunked parser refuses in a trailer section.
            let body = format!("0\r\n{name}: 1\r\n\r\n");
            assert_eq!(
                BodyFraming::new(Framing::Chunked).advance(body.as_bytes()),
                Err(BadBody::Trailer),
                "{name}"
            );
        }
    }
}
