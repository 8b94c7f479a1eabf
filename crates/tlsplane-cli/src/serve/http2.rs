//! HTTP/2 for `serve`, for operators who opt in by ALPN (`--alpn h2,http/1.1`, or a site's
//! `alpn`; docs/HTTP2.md).
//!
//! hyperium's `h2` does the framing, HPACK, flow control and the protocol's own hardening.
//! Requests are planned by `tlsplane-http` exactly as over HTTP/1.1 ([`respond`]: status,
//! validators, conditionals, ranges, path safety), and the planned header fields are sent as
//! HTTP/2 fields ([`tlsplane_http::Response::fields`]); nothing of the planning is repeated
//! here. File bodies are given to h2 as placeholders and put in by the transport
//! ([`h2_transport`]): by `sendfile` on the kernel plane, read once on the user plane.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use tlsplane::{ConnectionInfo, TlsStream};
use tlsplane_http::{error_response, respond, Body, Method, Request, Response};
use tokio::sync::watch;

use super::{body_len, count_status, Serve};
use crate::h2_transport::{self, FileBodies, H2Body, H2Io};
use crate::{h2_connection, h2_settings};
use tlsplane_server::access_log::{Entry, RequestLine};
use tlsplane_server::runtime::{ConnContext, Idle};

/// Body bytes h2 queues per stream before it stops granting capacity (h2's default ~400 KB;
/// the other settings are every product's: h2_settings). File bodies are queued as placeholders that hold no memory (h2_transport), and other
/// bodies are small planned texts, so this bounds how far ahead of the client h2 schedules,
/// not memory: a larger queue means fewer wake-ups per byte.
const FILE_SEND_BUFFER: usize = 1024 * 1024;
/// Most body bytes handed to h2 at once for one stream (h2 cuts them into frames of the
/// client's SETTINGS_MAX_FRAME_SIZE, within the flow-control windows).
const CHUNK: usize = 256 * 1024;
/// Most request body bytes read (and dropped) before a request whose HEADERS did not end its
/// stream is answered: serve takes no request bodies, so any byte means 413 (GET, HEAD) or the
/// planned 405, and a client streaming a body cannot make us read it for long.
const MAX_DRAINED_BODY: usize = 64 * 1024;

/// Serves one connection whose client chose `h2`, to its end.
pub(super) async fn serve(
    mut tls: TlsStream,
    peer: SocketAddr,
    shared: &Serve,
    ctx: &mut ConnContext,
) -> io::Result<()> {
    let info = tls.info().clone();
    let plane = tls.plane().as_str();
    // A client that stops taking our bytes, or leaves a stream without window, is given up
    // after this long without progress.
    let stall = Duration::from_secs(shared.args.server.idle_timeout.max(1));
    let (stop, idle) = (&mut ctx.stop, &ctx.idle);
    let (conn, pumped) = h2_transport::run(&mut tls, stall, |io| {
        connection(io, &info, plane, peer, shared, stop, idle)
    })
    .await;
    if let Err(e) = conn {
        tracing::debug!(%peer, error = %e, "h2 connection ended with error");
    }
    if let Err(e) = &pumped {
        if e.kind() == io::ErrorKind::TimedOut {
            shared.stats.h2.stalls.fetch_add(1, Relaxed);
        }
    }
    pumped?;
    Box::pin(tls.close()).await
}

/// The h2 side: settings, the handshake, then each stream as it comes, until the connection
/// ends (the client's GOAWAY or end, ours after the idle timeout or at shutdown, an error).
async fn connection(
    io: H2Io,
    info: &ConnectionInfo,
    plane: &'static str,
    peer: SocketAddr,
    shared: &Serve,
    stop: &mut watch::Receiver<bool>,
    idle: &Idle,
) -> Result<(), h2::Error> {
    let args = &shared.args;
    // The client's preface and SETTINGS are its first request head: the header timeout.
    let header_timeout = Duration::from_secs(args.header_timeout);
    let files = io.file_bodies();
    shared.stats.h2.connections.fetch_add(1, Relaxed);
    let handshake = h2_settings::server(FILE_SEND_BUFFER).handshake::<_, H2Body>(io);
    let mut conn = match tokio::time::timeout(header_timeout, handshake).await {
        Ok(c) => c.inspect_err(|e| shared.stats.h2.count_end(e))?,
        Err(_) => {
            shared.stats.timeouts.fetch_add(1, Relaxed);
            return Ok(());
        }
    };
    let responded = AtomicBool::new(false);
    let life = h2_connection::Lifetime {
        idle_timeout: Duration::from_secs(args.server.idle_timeout),
        stop,
        idle,
        stats: &shared.stats.h2,
        timeouts: &shared.stats.timeouts,
    };
    let (files, responded) = (&files, &responded);
    h2_connection::run(&mut conn, life, |request, send| {
        let stream = Stream {
            info,
            plane,
            peer,
            shared,
            files,
            responded,
        };
        stream.serve(request, send)
    })
    .await
}

/// What each stream of a connection shares.
struct Stream<'a> {
    info: &'a ConnectionInfo,
    plane: &'static str,
    peer: SocketAddr,
    shared: &'a Serve,
    files: &'a FileBodies,
    /// The connection has had a response (its time to first byte is recorded).
    responded: &'a AtomicBool,
}

impl Stream<'_> {
    async fn serve(self, mut req: http::Request<RecvStream>, mut send: SendResponse<H2Body>) {
        let shared = self.shared;
        let stall = Duration::from_secs(shared.args.server.idle_timeout.max(1));
        // A request ends with END_STREAM, on its HEADERS or on a DATA frame after them (an
        // empty one is valid: RFC 9113 §8.1). Answer at its end, not before: answering early
        // resets the stream (NO_ERROR), after which the client's errors on it go unnoticed
        // (h2spec's cases that send HEADERS, then a bad frame on the open stream).
        let had_body = !req.body().is_end_stream() && drain(req.body_mut(), stall).await;
        shared.stats.requests.fetch_add(1, Relaxed);
        let started = shared
            .access_log
            .as_ref()
            .map(|_| tokio::time::Instant::now());
        let request = request(&req);
        let site = self.info.site;
        let get_or_head = matches!(request.method, Method::Get | Method::Head);
        let resp = if get_or_head && had_body {
            // A GET or HEAD with a body, refused as over HTTP/1.1 (its bytes are dropped).
            error_response(413, true)
        } else if request
            .host_name()
            .is_some_and(|host| shared.names.lookup(host) != Some(site))
        {
            // The authority belongs to another site (or none) than the one the TLS
            // connection was set up for (RFC 9110 15.5.20).
            error_response(421, true)
        } else {
            respond(&request, &shared.roots[site], SystemTime::now())
        };
        count_status(&shared.stats, resp.status);
        if !self.responded.swap(true, Relaxed) {
            shared
                .ttfb
                .observe(self.info.accepted_at.elapsed().as_secs_f64());
        }
        let (status, len) = (resp.status, body_len(&resp));
        let sent = send_response(&mut send, resp, self.files, stall).await;
        if sent.is_err() {
            shared.stats.h2.stalls.fetch_add(1, Relaxed);
        }
        if let (Some(log), Some(started)) = (&shared.access_log, started) {
            let user_agent = field(&req, http::header::USER_AGENT);
            let referer = field(&req, http::header::REFERER);
            log.write(&Entry {
                peer: self.peer,
                host: request.host.as_deref().map(str::as_bytes),
                request: Some(RequestLine {
                    method: request.method.as_str(),
                    target: &request.target,
                    protocol: "HTTP/2.0",
                }),
                status: Some(status),
                bytes: if sent == Ok(true) { len } else { 0 },
                duration: started.elapsed(),
                user_agent: user_agent.as_deref().map(str::as_bytes),
                referer: referer.as_deref().map(str::as_bytes),
                plane: self.plane,
                server_name: self.info.server_name.as_deref(),
                backend: None,
                outcome: None,
            });
        }
    }
}

/// Reads a request body to its end and drops it, for at most `stall` and [`MAX_DRAINED_BODY`]
/// bytes: true when it had any bytes.
async fn drain(body: &mut RecvStream, stall: Duration) -> bool {
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
fn request(req: &http::Request<RecvStream>) -> Request {
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
fn field<T>(req: &http::Request<T>, name: http::header::HeaderName) -> Option<String> {
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

/// Sends the planned response on its stream: `Ok(true)` when all of it was handed to h2,
/// `Err(Stalled)` when the client granted no window for `stall`.
async fn send_response(
    send: &mut SendResponse<H2Body>,
    resp: Response,
    files: &FileBodies,
    stall: Duration,
) -> Result<bool, Stalled> {
    let mut head = http::Response::new(());
    *head.status_mut() =
        http::StatusCode::from_u16(resp.status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    let fields = head.headers_mut();
    for (name, value) in resp.fields() {
        // Our own fields, all valid; one that were not would be left out, never a panic.
        if let (Ok(name), Ok(value)) = (
            http::header::HeaderName::from_bytes(name),
            http::header::HeaderValue::from_bytes(value),
        ) {
            fields.append(name, value);
        }
    }
    let end = matches!(resp.body, Body::Empty);
    let mut stream = match send.send_response(head, end) {
        Ok(s) => s,
        Err(_) => return Ok(false), // the client reset the stream, or the connection is gone
    };
    let sent = match resp.body {
        Body::Empty => Ok(()),
        Body::Bytes(b) => {
            let b = Bytes::from(b);
            send_data(&mut stream, b.len() as u64, stall, usize::MAX, |at, n| {
                let at = at as usize;
                H2Body::Bytes(b.slice(at..at + n))
            })
            .await
        }
        Body::File { file, offset, len } => {
            // The outbox puts the file's bytes in place of the placeholders, by sendfile on
            // the kernel plane (h2_transport).
            let id = stream.stream_id();
            files.carry(id, Arc::new(file), offset, len);
            let frame = files.frame_limit();
            let sent = send_data(&mut stream, len, stall, frame, |_, n| H2Body::file(n)).await;
            if sent.is_err() {
                files.forget(id);
            }
            sent
        }
    };
    match sent {
        Ok(()) => Ok(true),
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

/// A stream given up for want of flow-control window.
#[derive(Debug, PartialEq)]
struct Stalled;

/// Sends `len` bytes, `chunk(at, n)` giving `n` of them from `at`, within the stream's
/// flow-control window: never more than h2 has granted, so nothing queues beyond
/// [`FILE_SEND_BUFFER`]. A stream granted no window for `stall` is reset (a zero-window reader
/// cannot hold it forever). No piece handed to h2 is longer than `frame`
/// ([`FileBodies::frame_limit`]).
async fn send_data(
    stream: &mut SendStream<H2Body>,
    len: u64,
    stall: Duration,
    frame: usize,
    mut chunk: impl FnMut(u64, usize) -> H2Body,
) -> io::Result<()> {
    let mut at = 0u64;
    while at < len {
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
