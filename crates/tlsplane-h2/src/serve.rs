//! `serve`'s answers over HTTP/2: a request as `tlsplane-http` plans it, and the planned
//! response sent on its h2 stream, a file body as placeholders whose bytes the outbox puts
//! in ([`transport`](crate::transport)). The product adds what is its own (which site a name
//! belongs to, counters, the access log).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use tlsplane_http::{error_response, Body, Method, Request, Response};

use crate::transport::{EndWatch, FileBodies, H2Body};

/// Body bytes h2 queues per stream before it stops granting capacity (h2's default ~400 KB;
/// the other settings are every product's: [`settings`](crate::settings)). File bodies are
/// queued as placeholders that hold no memory ([`transport`](crate::transport)), and other
/// bodies are small planned texts, so this bounds how far ahead of the client h2 schedules,
/// not memory: a larger queue means fewer wake-ups per byte.
pub const FILE_SEND_BUFFER: usize = 1024 * 1024;
/// Most body bytes handed to h2 at once for one stream (h2 cuts them into frames of the
/// client's SETTINGS_MAX_FRAME_SIZE, within the flow-control windows).
const CHUNK: usize = 256 * 1024;
/// Most request body bytes read (and dropped) before a request whose HEADERS did not end its
/// stream is answered: serve takes no request bodies, so any byte means 413 (GET, HEAD) or the
/// planned 405, and a client streaming a body cannot make us read it for long.
const MAX_DRAINED_BODY: usize = 64 * 1024;

/// The answer to a GET or HEAD that came with a body: 413, as over HTTP/1.1 (serve takes no
/// request bodies; the bytes were dropped). `None`: plan the request.
pub fn refused(request: &Request, had_body: bool) -> Option<Response> {
    let get_or_head = matches!(request.method, Method::Get | Method::Head);
    (get_or_head && had_body).then(|| error_response(413, true))
}

/// Reads a request body to its end and drops it, for at most `stall` and [`MAX_DRAINED_BODY`]
/// bytes: true when it had any bytes.
pub async fn drain(body: &mut RecvStream, stall: Duration) -> bool {
    let mut seen = 0usize;
    let read = async {
        while let Some(Ok(data)) = body.data().await {
            seen += data.len();
            let _ = body.flow_control().release_capacity(data.len());
            if seen > MAX_DRAINED_BODY {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(stall, read).await;
    seen > 0
}

/// The request as the HTTP/1.1 planning knows it: the same fields, from HTTP/2's
/// pseudo-header fields (`:method`, `:path`, `:authority`) and header fields.
pub fn request(req: &http::Request<RecvStream>) -> Request {
    let method = match *req.method() {
        http::Method::GET => Method::Get,
        http::Method::HEAD => Method::Head,
        ref other => Method::Other(other.as_str().to_owned()),
    };
    let target = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    // RFC 9113 §8.3.1: `:authority`, else `Host`.
    let host = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| field(req, http::header::HOST));
    Request {
        method,
        target,
        minor_version: 1,
        keep_alive: true,
        if_none_match: field(req, http::header::IF_NONE_MATCH),
        if_modified_since: field(req, http::header::IF_MODIFIED_SINCE),
        range: field(req, http::header::RANGE),
        if_range: field(req, http::header::IF_RANGE),
        host,
    }
}

/// A field's values joined with `, ` (RFC 9110 §5.3), as the HTTP/1.1 parser joins them.
pub fn field<T>(req: &http::Request<T>, name: http::header::HeaderName) -> Option<String> {
    let mut joined: Option<String> = None;
    for value in req.headers().get_all(name) {
        let value = String::from_utf8_lossy(value.as_bytes());
        match &mut joined {
            Some(j) => {
                j.push_str(", ");
                j.push_str(&value);
            }
            None => joined = Some(value.into_owned()),
        }
    }
    joined
}

/// Sends the planned response on its stream: `Ok(true)` when all of it was handed to h2 (and,
/// with `end`, the watch of this stream's end, once its last byte has gone to the client),
/// `Err(Stalled)` when the client granted no window for `stall`.
pub async fn send_response(
    send: &mut SendResponse<H2Body>,
    mut resp: Response,
    files: &FileBodies,
    stall: Duration,
    end: Option<&mut EndWatch>,
) -> Result<bool, Stalled> {
    let mut head = http::Response::new(());
    *head.status_mut() =
        http::StatusCode::from_u16(resp.status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    let fields = head.headers_mut();
    // Room for serve's fields at once (a file response has nine), not grown one by one.
    fields.reserve(FIELDS);
    // The values are slices of the planned head, shared rather than copied one by one.
    let planned = Bytes::from(std::mem::take(&mut resp.head));
    for (name, value) in tlsplane_http::fields_of(&planned) {
        let at = value.as_ptr() as usize - planned.as_ptr() as usize;
        // Our own fields, all valid; one that were not would be left out, never a panic.
        if let (Some(name), Ok(value)) = (
            field_name(name),
            http::header::HeaderValue::from_maybe_shared(planned.slice(at..at + value.len())),
        ) {
            fields.append(name, value);
        }
    }
    let empty = matches!(resp.body, Body::Empty);
    let mut stream = match send.send_response(head, empty) {
        Ok(s) => s,
        Err(_) => return Ok(false), // the client reset the stream, or the connection is gone
    };
    let id = stream.stream_id();
    let sent = match resp.body {
        Body::Empty => Ok(()),
        Body::Bytes(b) => {
            let b = Bytes::from(b);
            let bytes = |at: u64, n| {
                let at = at as usize;
                H2Body::Bytes(b.slice(at..at + n))
            };
            send_data(
                &mut stream,
                b.len() as u64,
                stall,
                usize::MAX,
                bytes,
                || false,
            )
            .await
        }
        Body::File { file, offset, len } => {
            // The outbox puts the file's bytes in place of the placeholders, by sendfile on
            // the kernel plane ([`transport`](crate::transport)).
            files.carry(id, Arc::new(file), offset, len);
            let frame = files.frame_limit();
            let placeholders = |_, n| H2Body::file(n);
            let refused = || files.refused(id);
            let sent = send_data(&mut stream, len, stall, frame, placeholders, refused).await;
            if sent.is_err() {
                files.forget(id);
            }
            sent
        }
    };
    match sent {
        Ok(()) => match end {
            Some(end) => Ok(end.sent().await),
            None => Ok(true),
        },
        Err(e) => {
            tracing::debug!(error = %e, "h2 stream ended early");
            if e.kind() == io::ErrorKind::TimedOut {
                Err(Stalled)
            } else {
                Ok(false)
            }
        }
    }
}

/// Fields a planned response may carry, to reserve room for at once.
const FIELDS: usize = 12;

/// The name of one of serve's planned fields, the ones it always writes without parsing them
/// again (as `Head` in `tlsplane-http` spells them), any other by `http`'s parser.
fn field_name(name: &[u8]) -> Option<http::header::HeaderName> {
    use http::header;
    Some(match name {
        b"Server" => header::SERVER,
        b"Date" => header::DATE,
        b"Content-Type" => header::CONTENT_TYPE,
        b"Content-Length" => header::CONTENT_LENGTH,
        b"Last-Modified" => header::LAST_MODIFIED,
        b"ETag" => header::ETAG,
        b"Accept-Ranges" => header::ACCEPT_RANGES,
        b"X-Content-Type-Options" => header::X_CONTENT_TYPE_OPTIONS,
        _ => return header::HeaderName::from_bytes(name).ok(),
    })
}

/// A stream given up for want of flow-control window.
#[derive(Debug, PartialEq)]
pub struct Stalled;

/// Sends `len` bytes, `chunk(at, n)` giving `n` of them from `at`, within the stream's
/// flow-control window: never more than h2 has granted, so nothing queues beyond
/// [`FILE_SEND_BUFFER`]. A stream granted no window for `stall` is reset (a zero-window reader
/// cannot hold it forever). No piece handed to h2 is longer than `frame`
/// ([`FileBodies::frame_limit`]). A stream the outbox `refused` (its frames did not match its
/// file body) is reset in h2 too, which then frames no more of it.
async fn send_data(
    stream: &mut SendStream<H2Body>,
    len: u64,
    stall: Duration,
    frame: usize,
    mut chunk: impl FnMut(u64, usize) -> H2Body,
    refused: impl Fn() -> bool,
) -> io::Result<()> {
    let mut at = 0u64;
    while at < len {
        if refused() {
            stream.send_reset(Reason::INTERNAL_ERROR);
            return Err(io::Error::other(
                "the stream's frames did not match its file body",
            ));
        }
        let want = (len - at).min(CHUNK as u64) as usize;
        stream.reserve_capacity(want);
        let granted = loop {
            let capacity = stream.capacity();
            if capacity > 0 {
                break capacity.min(want);
            }
            let grant = std::future::poll_fn(|cx| stream.poll_capacity(cx));
            match tokio::time::timeout(stall, grant).await {
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(e))) => return Err(io::Error::other(e)),
                Ok(None) => return Err(io::Error::other("stream closed")),
                Err(_) => {
                    stream.send_reset(Reason::CANCEL);
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no flow-control window granted",
                    ));
                }
            }
        };
        let mut left = granted;
        while left > 0 {
            let n = left.min(frame);
            let data = chunk(at, n);
            at += n as u64;
            left -= n;
            stream
                .send_data(data, at == len)
                .map_err(io::Error::other)?;
        }
    }
    Ok(())
}
