//! HTTP mode for clients that chose h2 (ALPN): each stream is one request, forwarded as
//! HTTP/1.1 over the backend keep-alive pool (as nginx does), or, with
//! `--backend-protocol h2c`, as a stream of an h2c connection to the backend (gRPC).
//!
//! The forwarding rules are HTTP/1.1's, not a copy of them: a stream's head is written as an
//! HTTP/1.1 head (`Host` from `:authority`, RFC 9113 §8.3.1; `Cookie` fields joined with `; `,
//! §8.2.3; `Transfer-Encoding: chunked` when a body comes without `Content-Length`) and read
//! by [`forward::parse_request_head`], so hop-by-hop fields, `Forwarded`/`X-Forwarded-*`,
//! smuggling shapes and limits are exactly the HTTP/1.1 path's. Responses come back through
//! [`forward::parse_response_head`] and [`forward::BodyFraming`] as there, and go to the client
//! without the connection-specific fields h2 forbids (RFC 9113 §8.2.2). Trailers go both ways
//! (a chunked body's trailer section and h2 trailers), without the fields a trailer may not
//! carry, and a backend's interim responses (103 Early Hints) go to the client, as with h2c
//! backends ([`InterimBudget`]).
//!
//! Failures touch one stream only: 502 when the backend fails or answers with what is not
//! HTTP, 504 when it does not answer within --backend-timeout, 503 when every backend is at
//! its connection limit; once the response has begun, a reset of that stream
//! (RST_STREAM(INTERNAL_ERROR)) so that a truncated body is never taken for a whole one.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use tlsplane::{ConnectionInfo, TlsStream};
use tlsplane_http::forward::{self, BodyFraming, Framing, Head, Origin, RequestHead};
use tlsplane_http::{error_response, Body, Limits};
use tokio::sync::watch;
use tokio::time::{timeout, timeout_at, Instant};

use super::h1_to_h2c::{last_chunk, next_answer, relayable_trailers, Answer, InterimBudget};
use super::http::MAX_RESPONSE_HEAD;
use super::http::{error_body_len, host_name, read_response_head, Buf, Fail, Progress};
use super::{BackendProtocol, Ended, Proxy, Responses, Unavailable};
use crate::h2_connection;
use tlsplane_h2::transport::{self, H2Io, StreamEnds, Woken};
use tlsplane_server::access_log::{Entry, RequestLine};
use tlsplane_server::runtime::{ConnContext, Idle};

/// A wait that something else bounds (`head_due`): long, and still far from overflowing an
/// `Instant`.
const UNBOUNDED: Duration = Duration::from_secs(365 * 24 * 3600);

/// How long the backend has for its response head from now. `--backend-timeout` counts from
/// the end of the request body, as over HTTP/1.1: while the body still goes out, each write
/// to the backend and each wait for the client have their own timeouts, and an upload longer
/// than `--backend-timeout` is not a backend that does not answer.
fn head_wait(body_done: bool, backend_timeout: Duration) -> Duration {
    if body_done {
        backend_timeout
    } else {
        UNBOUNDED
    }
}

/// Fields HTTP/2 forbids (RFC 9113 §8.2.2), dropped from what a backend sends; `TE` is
/// forbidden but for `trailers`, which only requests carry.
const CONNECTION_SPECIFIC: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
];

/// Serves one client connection that chose h2, to its end.
pub(super) async fn serve(
    proxy: &Proxy,
    mut tls: TlsStream,
    woken: Woken,
    peer: SocketAddr,
    ctx: &mut ConnContext,
) -> Ended {
    let info = tls.info().clone();
    let plane = tls.plane().as_str();
    // A client that stops taking our bytes, or leaves a stream without window, is given up
    // after this long without progress.
    let stall = Duration::from_secs(proxy.args.server.idle_timeout.max(1));
    let (stop, idle) = (&mut ctx.stop, &ctx.idle);
    let (conn, pumped) = transport::run(&mut tls, woken, stall, |io| {
        connection(io, &info, plane, peer, proxy, stop, idle)
    })
    .await;
    if let Err(e) = conn {
        tracing::debug!(%peer, error = %e, "h2 connection ended with error");
    }
    if let Err(e) = pumped {
        tracing::debug!(%peer, error = %e, "h2 client connection failed");
        proxy.stats.client_errors.fetch_add(1, Relaxed);
        return Ended::ClientError;
    }
    let _ = Box::pin(tls.close()).await;
    Ended::Closed
}

/// The h2 side: settings, the handshake, then each stream as it comes, until the connection
/// ends (the client's GOAWAY or end, ours after the idle timeout or at shutdown, an error).
async fn connection(
    io: H2Io,
    info: &ConnectionInfo,
    plane: &'static str,
    peer: SocketAddr,
    proxy: &Proxy,
    stop: &mut watch::Receiver<bool>,
    idle: &Idle,
) -> Result<(), h2::Error> {
    let args = &proxy.args;
    // The client's preface and SETTINGS are its first request head: the header timeout.
    let header_timeout = Duration::from_secs(args.header_timeout);
    let flush = io.flusher();
    let floods = io.floods();
    let ends = io.stream_ends();
    let handshake =
        tlsplane_h2::settings::server(tlsplane_h2::settings::SEND_BUFFER).handshake::<_, Bytes>(io);
    let mut conn = match timeout(header_timeout, handshake).await {
        Ok(c) => c.inspect_err(|e| proxy.stats.h2.count_end(e))?,
        Err(_) => {
            proxy.stats.http_refused.fetch_add(1, Relaxed);
            return Ok(());
        }
    };
    let responses = Responses::new(proxy, info);
    let shared = Shared {
        proxy,
        info,
        plane,
        peer,
        responses: &responses,
        ends: &ends,
    };
    let life = h2_connection::Lifetime {
        idle_timeout: Duration::from_secs(args.server.idle_timeout),
        stop,
        idle,
        stats: &proxy.stats.h2,
        timeouts: &proxy.stats.idle_timeouts,
        flush,
        floods,
    };
    h2_connection::run(&mut conn, life, |request, send| {
        shared.stream(request, send)
    })
    .await
}

/// What every stream of a connection shares.
#[derive(Clone, Copy)]
struct Shared<'a> {
    proxy: &'a Proxy,
    info: &'a ConnectionInfo,
    plane: &'static str,
    peer: SocketAddr,
    /// The connection's responses, counted as they begin.
    responses: &'a Responses<'a>,
    /// When a stream's last byte went to the client (the access log's duration ends there).
    ends: &'a StreamEnds,
}

/// How a stream ended, for the access log.
struct Outcome {
    /// The status sent, if a response began.
    status: Option<u16>,
    /// Body bytes relayed (or of the proxy's own error page).
    bytes: u64,
    /// The backend that answered.
    backend: Option<String>,
}

impl Outcome {
    /// No response went whole: none began, or it was cut (a reset).
    fn cut() -> Self {
        Self {
            status: None,
            bytes: 0,
            backend: None,
        }
    }

    /// The proxy answered `status` itself.
    fn own(status: u16, sent: bool) -> Self {
        Self {
            status: Some(status),
            bytes: if sent { error_body_len(status) } else { 0 },
            backend: None,
        }
    }
}

impl Shared<'_> {
    async fn stream(self, req: http::Request<RecvStream>, mut send: SendResponse<Bytes>) {
        let proxy = self.proxy;
        proxy.stats.http_requests.fetch_add(1, Relaxed);
        // Only with the access log: no clock read per request otherwise. The stream is then
        // served until its last byte has gone to the client, where the logged duration ends,
        // as over HTTP/1.1.
        let started = proxy.access_log.as_ref().map(|_| Instant::now());
        let mut end = started.map(|_| self.ends.watch(send.stream_id()));
        let (parts, body) = req.into_parts();
        let (request, outcome) = self.answer_stream(&parts, body, &mut send).await;
        if let Some(end) = &mut end {
            if outcome.status.is_some() && !end.sent().await {
                // Reset before its end reached the client: not a whole response.
                return self.log(&parts, request.as_ref(), started, Outcome::cut());
            }
        }
        self.log(&parts, request.as_ref(), started, outcome);
    }

    /// Answers one stream: the request as the HTTP/1.1 rules read it (when they do), and how
    /// its answer went.
    async fn answer_stream(
        &self,
        parts: &http::request::Parts,
        body: RecvStream,
        send: &mut SendResponse<Bytes>,
    ) -> (Option<RequestHead>, Outcome) {
        let proxy = self.proxy;
        if parts.method == http::Method::CONNECT {
            // A tunnel (RFC 9113 §8.5): the proxy has none to offer, and forwarded as a
            // request it would ask an HTTP/1.1 backend for one. Refused as nginx refuses it.
            proxy.stats.http_refused.fetch_add(1, Relaxed);
            proxy.stats.connect_refused.fetch_add(1, Relaxed);
            return (None, Outcome::own(405, answer(send, self.responses, 405)));
        }
        let head = http1_head(parts, !body.is_end_stream());
        let request = match forward::parse_request_head(&head, &Limits::default(), proxy.forwarded)
        {
            Ok(Head::Complete(request, _)) => request,
            // Not reached: the head ends with its empty line, or is too large (an error).
            Ok(Head::Incomplete) => {
                proxy.stats.http_refused.fetch_add(1, Relaxed);
                return (None, Outcome::own(400, answer(send, self.responses, 400)));
            }
            Err(e) => {
                proxy.stats.http_refused.fetch_add(1, Relaxed);
                let sent = answer(send, self.responses, e.status());
                return (None, Outcome::own(e.status(), sent));
            }
        };
        let site = self.info.site;
        let misdirected = request
            .host
            .as_deref()
            .is_some_and(|h| proxy.names.lookup(host_name(h)) != Some(site));
        let outcome = if misdirected {
            // The authority belongs to another site than the one the TLS connection was set
            // up for (RFC 9110 §15.5.20).
            proxy.stats.http_refused.fetch_add(1, Relaxed);
            Outcome::own(421, answer(send, self.responses, 421))
        } else {
            if request.expect_continue && request.framing != Framing::Empty {
                // The proxy answers the expectation itself, as over HTTP/1.1.
                let mut interim = http::Response::new(());
                *interim.status_mut() = http::StatusCode::CONTINUE;
                let _ = send.send_informational(interim);
            }
            let te_trailers = parts
                .headers
                .get_all(http::header::TE)
                .iter()
                .any(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
            match proxy.protocols[self.info.site] {
                BackendProtocol::Http1 => self.via_http1(&request, body, send).await,
                BackendProtocol::H2c => self.via_h2c(&request, te_trailers, body, send).await,
            }
        };
        (Some(request), outcome)
    }

    fn log(
        &self,
        parts: &http::request::Parts,
        request: Option<&RequestHead>,
        started: Option<Instant>,
        outcome: Outcome,
    ) {
        let (Some(log), Some(started)) = (&self.proxy.access_log, started) else {
            return;
        };
        let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let host = request
            .and_then(|r| r.host.as_deref())
            .or_else(|| parts.uri.authority().map(|a| a.as_str()));
        let field = |name| {
            parts
                .headers
                .get(name)
                .map(|v: &http::HeaderValue| v.as_bytes())
        };
        log.write(&Entry {
            peer: self.peer,
            host: host.map(str::as_bytes),
            request: Some(RequestLine {
                method: parts.method.as_str(),
                target,
                protocol: "HTTP/2.0",
            }),
            status: outcome.status,
            bytes: outcome.bytes,
            duration: started.elapsed(),
            user_agent: field(http::header::USER_AGENT),
            referer: field(http::header::REFERER),
            plane: self.plane,
            server_name: self.info.server_name.as_deref(),
            backend: outcome.backend.as_deref(),
            outcome: None,
        });
    }

    /// The HTTP/1.1 head the backend gets for `request` (forwarding fields added as the
    /// HTTP/1.1 path adds them); the h2c path starts from it too.
    fn encode(&self, request: &RequestHead) -> Vec<u8> {
        let mut head = Vec::with_capacity(1024);
        let origin = Origin {
            client: self.peer.ip(),
            proto: "https",
        };
        request.encode(origin, self.proxy.forwarded, &mut head);
        head
    }

    /// Forwards one stream's request to an HTTP/1.1 backend, with a retry on a new connection
    /// when a reused one turns out closed (as HTTP/1.1 clients' requests are).
    async fn via_http1(
        &self,
        request: &RequestHead,
        mut body: RecvStream,
        send: &mut SendResponse<Bytes>,
    ) -> Outcome {
        let proxy = self.proxy;
        let site = self.info.site;
        let head = self.encode(request);
        let deadline = request_deadline(proxy);
        let capacity = (proxy.args.buffer as usize).max(Limits::default().max_head_bytes);
        let mut retried = false;
        let (fail, label) = loop {
            let (conn, which, reused) = match proxy.backend_for(site, !retried).await {
                Ok(c) => c,
                Err(why) => return self.unavailable(why, send),
            };
            proxy.stats.forwarded.fetch_add(1, Relaxed);
            if reused {
                proxy.stats.backend_reused.fetch_add(1, Relaxed);
            }
            let label = proxy.pools[site].backends[which].to_string();
            let mut backend = Buf::new(capacity, capacity.max(MAX_RESPONSE_HEAD));
            let progress = Step::new(Progress::Waiting);
            let forwarded = self.forward_http1(
                request,
                &head,
                &mut body,
                send,
                &conn,
                &mut backend,
                &progress,
            );
            let outcome = within(deadline, &progress, forwarded).await;
            match outcome {
                Ok(done) => {
                    if done.reusable {
                        proxy.pools[site].put_idle(
                            which,
                            conn,
                            proxy.args.backend_keepalive,
                            Duration::from_secs(proxy.args.backend_idle_timeout),
                        );
                    }
                    return Outcome {
                        status: Some(done.status),
                        bytes: done.bytes,
                        backend: Some(label),
                    };
                }
                Err(Fail::Stale) if reused && !retried && request.is_retryable() => {
                    // The backend closed an idle connection as we reused it: once more on a
                    // new one.
                    proxy.stats.backend_retries.fetch_add(1, Relaxed);
                    retried = true;
                }
                Err(Fail::Stale) => {
                    break (
                        Fail::BadGateway(format!("{label}: closed before a response")),
                        label,
                    )
                }
                Err(Fail::Timeout) => {
                    proxy.pools[site]
                        .mark_down(which, Duration::from_secs(proxy.args.backend_down_time));
                    break (Fail::Timeout, label);
                }
                Err(Fail::BadGateway(why)) => {
                    break (Fail::BadGateway(format!("{label}: {why}")), label)
                }
                Err(other) => {
                    // The backend has part of a request or of a response (a deadline, the
                    // client's side failed, the backend failed midway): it cannot be reused,
                    // and must not take what it got for a whole request.
                    conn.reset_on_close();
                    break (other, label);
                }
            }
        };
        self.failed(fail, Some(label), send)
    }

    /// No backend would take the request: 503 when all are at their connection limit, 502
    /// when none could be reached.
    fn unavailable(&self, why: Unavailable, send: &mut SendResponse<Bytes>) -> Outcome {
        let stats = &self.proxy.stats;
        stats.no_backend.fetch_add(1, Relaxed);
        let status = match why {
            Unavailable::Full => 503,
            Unavailable::Down => {
                stats.http_502.fetch_add(1, Relaxed);
                502
            }
        };
        Outcome::own(status, answer(send, self.responses, status))
    }

    /// Answers a failed exchange on its stream only, and counts it by its side, as the
    /// HTTP/1.1 path does.
    fn failed(
        &self,
        fail: Fail,
        backend: Option<String>,
        send: &mut SendResponse<Bytes>,
    ) -> Outcome {
        let stats = &self.proxy.stats;
        let peer = self.peer;
        if let Fail::Deadline(progress) = &fail {
            stats.request_timeouts.fetch_add(1, Relaxed);
            tracing::debug!(%peer, ?progress, "request past --request-timeout");
        }
        let mut outcome = match fail {
            Fail::BadGateway(why) => {
                tracing::warn!(%peer, error = %why, "bad gateway");
                stats.backend_errors.fetch_add(1, Relaxed);
                stats.http_502.fetch_add(1, Relaxed);
                Outcome::own(502, answer(send, self.responses, 502))
            }
            Fail::Timeout | Fail::Deadline(Progress::Waiting) => {
                stats.http_504.fetch_add(1, Relaxed);
                Outcome::own(504, answer(send, self.responses, 504))
            }
            Fail::BadBody => {
                stats.http_refused.fetch_add(1, Relaxed);
                Outcome::own(400, answer(send, self.responses, 400))
            }
            Fail::Deadline(Progress::Receiving) => {
                stats.http_refused.fetch_add(1, Relaxed);
                Outcome::own(408, answer(send, self.responses, 408))
            }
            Fail::Midway(why) => {
                tracing::warn!(%peer, error = %why, "backend failed in the middle of a response");
                stats.backend_errors.fetch_add(1, Relaxed);
                stats.h2_streams_reset.fetch_add(1, Relaxed);
                // Part of the response is out: only a reset says it is not whole.
                send.send_reset(Reason::INTERNAL_ERROR);
                Outcome {
                    status: None,
                    bytes: 0,
                    backend: None,
                }
            }
            Fail::Deadline(Progress::Responding) => {
                stats.h2_streams_reset.fetch_add(1, Relaxed);
                send.send_reset(Reason::INTERNAL_ERROR);
                Outcome {
                    status: None,
                    bytes: 0,
                    backend: None,
                }
            }
            Fail::Client | Fail::Stale => {
                stats.client_errors.fetch_add(1, Relaxed);
                send.send_reset(Reason::CANCEL);
                Outcome {
                    status: None,
                    bytes: 0,
                    backend: None,
                }
            }
        };
        if outcome.status.is_some_and(|s| s != 408) {
            outcome.backend = backend;
        }
        outcome
    }

    /// Sends the request head and body to an HTTP/1.1 backend, and relays its response.
    #[allow(clippy::too_many_arguments)]
    async fn forward_http1(
        &self,
        request: &RequestHead,
        head: &[u8],
        body: &mut RecvStream,
        send: &mut SendResponse<Bytes>,
        conn: &super::backend::BackendConn,
        backend: &mut Buf,
        progress: &Step,
    ) -> Result<Relayed, Fail> {
        let proxy = self.proxy;
        let backend_timeout = Duration::from_secs(proxy.args.backend_timeout);
        progress.set(Progress::Waiting);
        match timeout(backend_timeout, conn.write_all(head)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(Fail::Stale),
            Err(_) => return Err(Fail::Timeout),
        }
        proxy
            .stats
            .bytes_to_backend_copied
            .fetch_add(head.len() as u64, Relaxed);
        // The body and the response head at once: a backend may answer before it has the
        // whole body (413, 401, a redirect), and the body then stops.
        let answered_early;
        let response = {
            let chunked = request.framing == Framing::Chunked;
            let sending = self.body_to_http1(body, conn, chunked, progress);
            let reading = async {
                // No clock of its own: `head_due` below bounds the whole wait, however many
                // interim responses come in it.
                let mut interim = InterimBudget::default();
                let mut any_interim = false;
                loop {
                    let r =
                        read_response_head(conn, backend, request, UNBOUNDED, any_interim).await?;
                    if !r.is_interim() {
                        return Ok::<_, Fail>(r);
                    }
                    any_interim = true;
                    // 103 Early Hints and the like, as HEADERS without END_STREAM (as from
                    // h2c backends, and to HTTP/1.1 clients).
                    if interim.admits(r.status) {
                        self.responses.begin(r.status);
                        let mut encoded = Vec::with_capacity(256);
                        r.encode(1, true, &mut encoded);
                        send.send_informational(response_head(r.status, &encoded))
                            .map_err(|_| Fail::Client)?;
                    }
                }
            };
            let mut body_done = request.framing == Framing::Empty;
            let mut body_failed = None;
            let head_due = tokio::time::sleep(head_wait(body_done, backend_timeout));
            tokio::pin!(sending, reading, head_due);
            loop {
                tokio::select! {
                    sent = &mut sending, if !body_done => {
                        body_done = true;
                        head_due.as_mut().reset(Instant::now() + backend_timeout);
                        progress.set(Progress::Waiting);
                        match sent {
                            Ok(()) => {}
                            // The backend may have answered, and reset what it would not
                            // read: its answer, if it comes, is the response.
                            Err(Fail::BadGateway(why)) => body_failed = Some(why),
                            Err(e) => return Err(e),
                        }
                    }
                    head = &mut reading => {
                        answered_early = !body_done || body_failed.is_some();
                        let head = match (head, body_failed) {
                            (Ok(h), _) => h,
                            (Err(_), Some(why)) => return Err(Fail::BadGateway(why)),
                            (Err(e), None) => return Err(e),
                        };
                        break head;
                    }
                    () = &mut head_due, if body_done => {
                        return Err(match body_failed {
                            Some(why) => Fail::BadGateway(why),
                            None => Fail::Timeout,
                        });
                    }
                }
            }
        };
        if answered_early {
            proxy.stats.early_responses.fetch_add(1, Relaxed);
        }
        if response.status == 101 {
            // No request over h2 asks for an upgrade (h2 carries no `Upgrade`).
            return Err(Fail::BadGateway(
                "101 to a request that asked for no upgrade".into(),
            ));
        }
        let mut framing = BodyFraming::new(response.framing);
        // Nothing has reached the client yet: broken framing here is still a 502.
        let n = framing
            .advance(backend.bytes())
            .map_err(|e| Fail::BadGateway(e.to_string()))?;
        let mut encoded = Vec::with_capacity(512);
        response.encode(1, true, &mut encoded);
        let h2_head = response_head(response.status, &encoded);
        let end = response.framing == Framing::Empty;
        self.responses.begin(response.status);
        let mut stream = send.send_response(h2_head, end).map_err(|_| Fail::Client)?;
        progress.set(Progress::Responding);
        let stall = Duration::from_secs(proxy.args.server.idle_timeout.max(1));
        let mut dechunk = Dechunk::new(response.framing == Framing::Chunked).keeping_trailers();
        let mut sent = 0u64;
        let mut content = Vec::new();
        dechunk.content(&backend.bytes()[..n], &mut content);
        backend.consume(n);
        sent += send_all(&mut stream, &mut content, stall, &proxy.stats).await?;
        while !framing.is_done() {
            match timeout(backend_timeout, conn.read(backend.spare())).await {
                Ok(Ok(0)) if framing.until_close() => break,
                Ok(Ok(0)) => return Err(Fail::Midway("closed in the middle of the body".into())),
                Ok(Ok(n)) => backend.filled(n),
                Ok(Err(e)) => return Err(Fail::Midway(e.to_string())),
                Err(_) => return Err(Fail::Midway("timed out in the middle of the body".into())),
            }
            let n = framing
                .advance(backend.bytes())
                .map_err(|e| Fail::Midway(e.to_string()))?;
            dechunk.content(&backend.bytes()[..n], &mut content);
            backend.consume(n);
            sent += send_all(&mut stream, &mut content, stall, &proxy.stats).await?;
        }
        if !end {
            // The trailers of a chunked body end the stream (RFC 9113 §8.1), whether or not
            // the client sent `TE: trailers`: h2 frames them apart from the content, so any h2
            // client can read them or leave them, and nothing of the body's framing depends on
            // them as in HTTP/1.1 (the h2c path relays them so too). Too many fields: broken
            // off, as a malformed section is (by `framing`), never ended as if whole.
            let trailers = dechunk
                .trailers()
                .map_err(|TooManyTrailers| Fail::Midway("too many trailer fields".into()))?;
            if trailers.is_empty() {
                stream.send_data(Bytes::new(), true)
            } else {
                stream.send_trailers(trailers)
            }
            .map_err(|_| Fail::Client)?;
        }
        Ok(Relayed {
            status: response.status,
            bytes: sent,
            reusable: response.keep_alive
                && !answered_early
                && response.framing != Framing::UntilClose
                && backend.is_empty(),
        })
    }

    /// Moves the request body from the client's stream to an HTTP/1.1 backend (chunked when
    /// the client gave no length), releasing the client's flow-control window only as the
    /// backend takes the bytes: a slow backend slows the client down, nothing piles up here.
    /// Request trailers end a chunked body as its trailer section ([`chunked_end`]); a body
    /// sent with its `Content-Length` has no place for them in HTTP/1.1, and they are dropped
    /// (RFC 9110 §6.5.1 lets an intermediary do so).
    async fn body_to_http1(
        &self,
        body: &mut RecvStream,
        conn: &super::backend::BackendConn,
        chunked: bool,
        progress: &Step,
    ) -> Result<(), Fail> {
        let proxy = self.proxy;
        let idle = Duration::from_secs(proxy.args.server.idle_timeout);
        let backend_timeout = Duration::from_secs(proxy.args.backend_timeout);
        let write = |bytes: &[u8]| {
            let bytes = bytes.to_vec();
            async move {
                match timeout(backend_timeout, conn.write_all(&bytes)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(Fail::BadGateway(format!("writing the request body: {e}"))),
                    Err(_) => Err(Fail::Timeout),
                }
            }
        };
        loop {
            progress.set(Progress::Receiving);
            let data = match timeout(idle, body.data()).await {
                Ok(None) => break,
                Ok(Some(Ok(d))) => d,
                Ok(Some(Err(_))) | Err(_) => return Err(Fail::Client),
            };
            progress.set(Progress::Waiting);
            let n = data.len();
            if n == 0 {
                continue;
            }
            if chunked {
                let mut framed = Vec::with_capacity(n + 20);
                framed.extend_from_slice(format!("{n:x}\r\n").as_bytes());
                framed.extend_from_slice(&data);
                framed.extend_from_slice(b"\r\n");
                write(&framed).await?;
            } else {
                write(&data).await?;
            }
            let _ = body.flow_control().release_capacity(n);
            proxy
                .stats
                .bytes_to_backend_copied
                .fetch_add(n as u64, Relaxed);
        }
        let trailers = match timeout(idle, body.trailers()).await {
            Ok(Ok(t)) => t,
            Ok(Err(_)) | Err(_) => return Err(Fail::Client),
        };
        if chunked {
            // Past the bounds, 400 and the backend's connection reset: it has a body not ended.
            let end = chunked_end(trailers.as_ref()).map_err(|TooManyTrailers| Fail::BadBody)?;
            write(&end).await?;
        }
        Ok(())
    }
}

impl Shared<'_> {
    /// Forwards one stream to an h2c backend as a stream of its own: the body both ways as
    /// it comes, within both sides' flow-control windows, and trailers both ways (gRPC's
    /// `grpc-status`). A connection h2 finds dead before the request went is left and the
    /// request tried once more on another.
    async fn via_h2c(
        &self,
        request: &RequestHead,
        te_trailers: bool,
        mut body: RecvStream,
        send: &mut SendResponse<Bytes>,
    ) -> Outcome {
        let proxy = self.proxy;
        let encoded = self.encode(request);
        let deadline = request_deadline(proxy);
        let ended = body.is_end_stream();
        let opened = open_h2c_stream(
            proxy,
            self.info.site,
            &encoded,
            request,
            te_trailers,
            ended,
            NoAuthority::Refused,
        );
        let H2cStream {
            lease,
            label,
            response,
            upstream,
        } = match opened.await {
            Ok(s) => s,
            Err(NotOpened::Refused) => {
                proxy.stats.http_refused.fetch_add(1, Relaxed);
                return Outcome::own(400, answer(send, self.responses, 400));
            }
            Err(NotOpened::Unavailable(why)) => return self.unavailable(why, send),
            Err(NotOpened::Failed(fail, label)) => return self.failed(fail, Some(label), send),
        };
        let progress = Step::new(Progress::Waiting);
        let exchange = self.exchange_h2c(&mut body, upstream, response, send, &progress, ended);
        let outcome = within(deadline, &progress, exchange).await;
        match outcome {
            Ok(done) => Outcome {
                status: Some(done.status),
                bytes: done.bytes,
                backend: Some(label),
            },
            Err(fail) => {
                if matches!(fail, Fail::BadGateway(_) | Fail::Midway(_)) {
                    // The stream failed; the connection may have too (h2 says so to the
                    // next stream, which then takes another).
                    drop(lease);
                }
                self.failed(fail, Some(label), send)
            }
        }
    }

    /// The two halves of an h2c exchange at once: the request body to the backend, and its
    /// response to the client. Ends when the response has ended (a backend may end it before
    /// the request's end: a gRPC status while the client still streams), or fails.
    async fn exchange_h2c(
        &self,
        body: &mut RecvStream,
        mut upstream: SendStream<Bytes>,
        response: h2::client::ResponseFuture,
        send: &mut SendResponse<Bytes>,
        progress: &Step,
        ended: bool,
    ) -> Result<Relayed, Fail> {
        let proxy = self.proxy;
        let backend_timeout = Duration::from_secs(proxy.args.backend_timeout);
        let stall = Duration::from_secs(proxy.args.server.idle_timeout.max(1));
        let sending = self.body_to_h2c(body, &mut upstream, ended);
        // Set once the final response head is in: until then `head_due` bounds the wait.
        let head_in = AtomicBool::new(false);
        let relaying = async {
            let mut response = response;
            let mut interim = InterimBudget::default();
            let response = loop {
                match next_answer(&mut response).await {
                    Answer::Final(Err(e)) => return Err(Fail::BadGateway(e.to_string())),
                    Answer::Final(Ok(r)) => break r,
                    // 103 Early Hints and the like, as for HTTP/1.1 clients.
                    Answer::Interim(head) => {
                        if interim.admits(head.status().as_u16()) {
                            self.responses.begin(head.status().as_u16());
                            send.send_informational(head).map_err(|_| Fail::Client)?;
                        }
                    }
                }
            };
            head_in.store(true, Relaxed);
            let (parts, mut from) = response.into_parts();
            let status = parts.status.as_u16();
            // h2 has refused any connection-specific field from the backend already.
            let head = http::Response::from_parts(parts, ());
            let end = from.is_end_stream();
            self.responses.begin(status);
            let mut to = send.send_response(head, end).map_err(|_| Fail::Client)?;
            progress.set(Progress::Responding);
            let mut bytes = 0u64;
            if end {
                return Ok(Relayed {
                    status,
                    bytes,
                    reusable: true,
                });
            }
            loop {
                let data = match timeout(backend_timeout, from.data()).await {
                    Err(_) => {
                        return Err(Fail::Midway("timed out in the middle of the body".into()))
                    }
                    Ok(None) => break,
                    Ok(Some(Err(e))) => return Err(Fail::Midway(e.to_string())),
                    Ok(Some(Ok(d))) => d,
                };
                let n = data.len();
                send_granted(&mut to, data, stall, Some(&proxy.stats.h2.stalls)).await?;
                // The backend may send more only as the client takes it.
                let _ = from.flow_control().release_capacity(n);
                proxy
                    .stats
                    .bytes_to_client_copied
                    .fetch_add(n as u64, Relaxed);
                bytes += n as u64;
            }
            match timeout(backend_timeout, from.trailers()).await {
                Err(_) => return Err(Fail::Midway("timed out before the trailers".into())),
                Ok(Err(e)) => return Err(Fail::Midway(e.to_string())),
                Ok(Ok(trailers)) => match trailers.and_then(relayable_trailers) {
                    Some(trailers) => to.send_trailers(trailers),
                    None => to.send_data(Bytes::new(), true),
                }
                .map_err(|_| Fail::Client)?,
            }
            Ok(Relayed {
                status,
                bytes,
                reusable: true,
            })
        };
        let mut body_done = ended;
        let head_due = tokio::time::sleep(head_wait(body_done, backend_timeout));
        tokio::pin!(sending, relaying, head_due);
        loop {
            tokio::select! {
                sent = &mut sending, if !body_done => {
                    body_done = true;
                    head_due.as_mut().reset(Instant::now() + backend_timeout);
                    match sent {
                        Ok(()) => progress.set(match progress.get() {
                            Progress::Receiving => Progress::Waiting,
                            p => p,
                        }),
                        Err(Side::Client) => return Err(Fail::Client),
                        // The backend stopped taking the body: its response says why.
                        Err(Side::Backend) => {}
                    }
                }
                relayed = &mut relaying => return relayed,
                () = &mut head_due, if body_done && !head_in.load(Relaxed) => {
                    return Err(Fail::Timeout);
                }
            }
        }
    }

    /// Moves the request body and trailers from the client's stream to the backend's,
    /// releasing the client's window only as the backend's window takes the bytes.
    async fn body_to_h2c(
        &self,
        body: &mut RecvStream,
        upstream: &mut SendStream<Bytes>,
        ended: bool,
    ) -> Result<(), Side> {
        if ended {
            return Ok(());
        }
        let proxy = self.proxy;
        let idle = Duration::from_secs(proxy.args.server.idle_timeout);
        let stall = Duration::from_secs(proxy.args.backend_timeout.max(1));
        loop {
            let data = match timeout(idle, body.data()).await {
                Ok(None) => break,
                Ok(Some(Ok(d))) => d,
                Ok(Some(Err(_))) | Err(_) => return Err(Side::Client),
            };
            let n = data.len();
            send_granted(upstream, data, stall, None)
                .await
                .map_err(|_| Side::Backend)?;
            let _ = body.flow_control().release_capacity(n);
            proxy
                .stats
                .bytes_to_backend_copied
                .fetch_add(n as u64, Relaxed);
        }
        match timeout(idle, body.trailers()).await {
            Ok(Ok(trailers)) => match trailers.and_then(relayable_trailers) {
                Some(trailers) => upstream.send_trailers(trailers),
                None => upstream.send_data(Bytes::new(), true),
            },
            Ok(Err(_)) | Err(_) => return Err(Side::Client),
        }
        .map_err(|_| Side::Backend)
    }
}

/// A request's stream on an h2c backend connection, its head sent.
pub(super) struct H2cStream {
    /// The stream's place on the connection (held to the end of the exchange).
    pub(super) lease: super::h2c::Lease,
    /// The backend, as named in logs.
    pub(super) label: String,
    pub(super) response: h2::client::ResponseFuture,
    pub(super) upstream: SendStream<Bytes>,
}

/// Why no stream was opened for a request on an h2c backend.
pub(super) enum NotOpened {
    /// The request cannot be written as an h2 request (no authority, a method h2 refuses):
    /// 400.
    Refused,
    /// No backend would take it (503 or 502).
    Unavailable(Unavailable),
    /// The backend failed or did not take it in time (with its label).
    Failed(Fail, String),
}

/// What stands for the `:authority` of a request that names none itself (h2 requires one for
/// an `http` request, RFC 9113 §8.3.1).
#[derive(Clone, Copy)]
pub(super) enum NoAuthority<'a> {
    /// None: the request is refused (400). An h2 client's request without `:authority` nor
    /// `Host`, an HTTP/1.1 one without `Host` (RFC 9112 §3.2; refused before this anyway).
    Refused,
    /// An HTTP/1.0 request without `Host` (which HTTP/1.0 allows): the server name the client
    /// asked for in TLS (SNI), the name it meant, as an h2 client's `:authority` is; without
    /// SNI, the backend's `HOST:PORT`, as nginx sends by default (`proxy_set_header Host
    /// $proxy_host`), `localhost` for a Unix socket.
    ServerName(Option<&'a str>),
}

impl NoAuthority<'_> {
    /// The authority for a request without one sent to `backend`, if any.
    fn for_backend(self, backend: &tlsplane_server::config::Backend) -> Option<String> {
        use tlsplane_server::config::Backend;
        match (self, backend) {
            (NoAuthority::Refused, _) => None,
            (NoAuthority::ServerName(Some(name)), _) => Some(name.to_string()),
            (NoAuthority::ServerName(None), Backend::Tcp(host_port)) => Some(host_port.clone()),
            (NoAuthority::ServerName(None), Backend::Unix(_)) => Some("localhost".into()),
        }
    }
}

/// Opens a stream for `request` (its HTTP/1.1 head as the proxy encoded it, `encoded`) on an
/// h2c connection to one of `site`'s backends and sends its head (`ended`: there is no body).
/// A connection h2 finds dead before the request went is left and the request tried once more
/// on another. For h2 and HTTP/1.1 clients alike; `no_authority` says what to do for a request
/// that names no authority.
#[allow(clippy::too_many_arguments)]
pub(super) async fn open_h2c_stream(
    proxy: &Proxy,
    site: usize,
    encoded: &[u8],
    request: &RequestHead,
    te_trailers: bool,
    ended: bool,
    no_authority: NoAuthority<'_>,
) -> Result<H2cStream, NotOpened> {
    // Whether it can be written as an h2 request at all (the authority itself is checked
    // below, for the backend it goes to).
    let checked = match no_authority {
        NoAuthority::Refused => None,
        NoAuthority::ServerName(_) => Some("localhost"),
    };
    if h2c_request(encoded, request, te_trailers, checked).is_none() {
        return Err(NotOpened::Refused);
    }
    let backend_timeout = Duration::from_secs(proxy.args.backend_timeout);
    let mut retried = false;
    loop {
        let lease = proxy
            .h2c_backend(site)
            .await
            .map_err(NotOpened::Unavailable)?;
        proxy.stats.forwarded.fetch_add(1, Relaxed);
        if lease.reused {
            proxy.stats.backend_reused.fetch_add(1, Relaxed);
        }
        let label = proxy.pools[site].backends[lease.which].to_string();
        let authority = match request.host {
            Some(_) => None,
            None => no_authority.for_backend(&proxy.pools[site].backends[lease.which]),
        };
        let req = h2c_request(encoded, request, te_trailers, authority.as_deref())
            .ok_or(NotOpened::Refused)?;
        let sent = match timeout(backend_timeout, lease.send.clone().ready()).await {
            Err(_) => return Err(NotOpened::Failed(Fail::Timeout, label)),
            Ok(Ok(mut ready)) => ready.send_request(req, ended),
            Ok(Err(e)) => Err(e),
        };
        match sent {
            Ok((response, upstream)) => {
                return Ok(H2cStream {
                    lease,
                    label,
                    response,
                    upstream,
                })
            }
            Err(e) => {
                lease.close();
                if retried {
                    let why = format!("{label}: {e}");
                    return Err(NotOpened::Failed(Fail::BadGateway(why), label));
                }
                proxy.stats.backend_retries.fetch_add(1, Relaxed);
                retried = true;
            }
        }
    }
}

/// Which side of an exchange failed.
enum Side {
    Client,
    Backend,
}

/// The h2 request for an h2c backend: the HTTP/1.1 head the proxy wrote ([`RequestHead::encode`],
/// so the forwarding rules are the HTTP/1.1 path's) as h2 fields: `Host` as `:authority`,
/// without the connection-specific fields, and `TE: trailers` again when the client sent it
/// (gRPC servers want it; it is the only `TE` h2 allows). A request without `Host` has
/// `authority` as its `:authority`, or is refused (`None`) when there is none.
pub(super) fn h2c_request(
    encoded: &[u8],
    request: &RequestHead,
    te_trailers: bool,
    authority: Option<&str>,
) -> Option<http::Request<()>> {
    let host = request.host.as_deref().or(authority)?;
    let uri = if request.method == "CONNECT" {
        http::Uri::builder().authority(host).build()
    } else {
        http::Uri::builder()
            .scheme("http")
            .authority(host)
            .path_and_query(request.target.as_str())
            .build()
    }
    .ok()?;
    let method = http::Method::from_bytes(request.method.as_bytes()).ok()?;
    let mut req = http::Request::builder()
        .method(method)
        .uri(uri)
        .body(())
        .ok()?;
    let fields = req.headers_mut();
    for (name, value) in encoded_fields(encoded) {
        if is_connection_specific(name) || name.eq_ignore_ascii_case(b"host") {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            http::header::HeaderName::from_bytes(name),
            http::header::HeaderValue::from_bytes(value),
        ) {
            fields.append(name, value);
        }
    }
    if te_trailers {
        fields.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    }
    Some(req)
}

/// When a request must be done by (`--request-timeout`; none when 0).
pub(super) fn request_deadline(proxy: &Proxy) -> Option<Instant> {
    (proxy.args.request_timeout > 0)
        .then(|| Instant::now() + Duration::from_secs(proxy.args.request_timeout))
}

/// Runs one exchange with a backend to its end or `deadline`, which fails it with where it
/// stood (`progress`).
pub(super) async fn within<T>(
    deadline: Option<Instant>,
    progress: &Step,
    exchange: impl std::future::Future<Output = Result<T, Fail>>,
) -> Result<T, Fail> {
    match deadline {
        None => exchange.await,
        Some(at) => timeout_at(at, exchange)
            .await
            .unwrap_or_else(|_| Err(Fail::Deadline(progress.get()))),
    }
}

/// How far a stream's exchange got ([`Progress`]), readable when a deadline cuts it off.
pub(super) struct Step(AtomicU8);

impl Step {
    pub(super) fn new(p: Progress) -> Self {
        let s = Self(AtomicU8::new(0));
        s.set(p);
        s
    }

    pub(super) fn set(&self, p: Progress) {
        self.0.store(
            match p {
                Progress::Receiving => 0,
                Progress::Waiting => 1,
                Progress::Responding => 2,
            },
            Relaxed,
        );
    }

    pub(super) fn get(&self) -> Progress {
        match self.0.load(Relaxed) {
            0 => Progress::Receiving,
            1 => Progress::Waiting,
            _ => Progress::Responding,
        }
    }
}

/// A response relayed whole.
pub(super) struct Relayed {
    pub(super) status: u16,
    pub(super) bytes: u64,
    /// The backend connection may carry another request.
    pub(super) reusable: bool,
}

/// Sends `content` (emptied) on the client's stream within its flow-control window: never
/// more than h2 has granted, so nothing queues beyond the send buffer. A stream granted no
/// window for `stall` is reset (a zero-window reader cannot hold it, nor the backend
/// connection behind it, forever).
async fn send_all(
    stream: &mut SendStream<Bytes>,
    content: &mut Vec<u8>,
    stall: Duration,
    stats: &super::ProxyStats,
) -> Result<u64, Fail> {
    if content.is_empty() {
        return Ok(0);
    }
    let data = Bytes::from(std::mem::take(content));
    let n = data.len() as u64;
    send_granted(stream, data, stall, Some(&stats.h2.stalls)).await?;
    stats.bytes_to_client_copied.fetch_add(n, Relaxed);
    Ok(n)
}

/// Sends `data` on `stream` as its flow-control window is granted ([`grant`]); a failure to
/// send is [`Fail::Client`], whichever side `stream` goes to (callers say which it was).
pub(super) async fn send_granted(
    stream: &mut SendStream<Bytes>,
    mut data: Bytes,
    stall: Duration,
    stalls: Option<&tlsplane::stats::Counter>,
) -> Result<(), Fail> {
    while !data.is_empty() {
        let granted = grant(stream, data.len(), stall, stalls).await?;
        stream
            .send_data(data.split_to(granted), false)
            .map_err(|_| Fail::Client)?;
    }
    Ok(())
}

/// Waits until `stream` may send some of `want` bytes; how many. A stream reset for want of
/// window is counted in `stalls` (a client's stream: `proxy_h2_stalls`, as serve counts its
/// own).
pub(super) async fn grant(
    stream: &mut SendStream<Bytes>,
    want: usize,
    stall: Duration,
    stalls: Option<&tlsplane::stats::Counter>,
) -> Result<usize, Fail> {
    stream.reserve_capacity(want);
    loop {
        let capacity = stream.capacity();
        if capacity > 0 {
            return Ok(capacity.min(want));
        }
        let granted = std::future::poll_fn(|cx| stream.poll_capacity(cx));
        match timeout(stall, granted).await {
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(_))) | Ok(None) => return Err(Fail::Client),
            Err(_) => {
                stream.send_reset(Reason::CANCEL);
                if let Some(stalls) = stalls {
                    stalls.fetch_add(1, Relaxed);
                }
                return Err(Fail::Client);
            }
        }
    }
}

/// The HTTP/1.1 head of an h2 request, for the HTTP/1.1 rules to read: `Host` from
/// `:authority` (RFC 9113 §8.3.1: it wins over a `Host` field), `Cookie` fields joined
/// (§8.2.3), and `Transfer-Encoding: chunked` when a body follows without `Content-Length`
/// (h2 itself checks a `Content-Length` against the DATA that comes).
fn http1_head(parts: &http::request::Parts, body_follows: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    let authority = parts.uri.authority().map(|a| a.as_str());
    if parts.method == http::Method::CONNECT {
        out.extend_from_slice(authority.unwrap_or("").as_bytes());
    } else {
        let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        out.extend_from_slice(target.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let mut field = |name: &[u8], value: &[u8]| {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    if let Some(a) = authority {
        field(b"host", a.as_bytes());
    }
    let mut cookie: Option<Vec<u8>> = None;
    for (name, value) in &parts.headers {
        if *name == http::header::HOST && authority.is_some() {
            continue;
        }
        if *name == http::header::COOKIE {
            match &mut cookie {
                Some(c) => {
                    c.extend_from_slice(b"; ");
                    c.extend_from_slice(value.as_bytes());
                }
                None => cookie = Some(value.as_bytes().to_vec()),
            }
            continue;
        }
        field(name.as_str().as_bytes(), value.as_bytes());
    }
    if let Some(c) = cookie {
        field(b"cookie", &c);
    }
    if body_follows && !parts.headers.contains_key(http::header::CONTENT_LENGTH) {
        field(b"transfer-encoding", b"chunked");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// The fields of a head the proxy encoded itself (`forward::*::encode`: one `Name: value`
/// line each, CRLF), after its first line.
pub(super) fn encoded_fields(encoded: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    encoded
        .split(|&b| b == b'\n')
        .skip(1)
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .filter_map(|line| {
            let at = line.windows(2).position(|w| w == b": ")?;
            Some((&line[..at], &line[at + 2..]))
        })
}

/// Whether h2 forbids `name` in a message (RFC 9113 §8.2.2).
pub(super) fn is_connection_specific(name: &[u8]) -> bool {
    CONNECTION_SPECIFIC
        .iter()
        .any(|c| name.eq_ignore_ascii_case(c.as_bytes()))
}

/// The h2 response head for `status` and the fields of an encoded HTTP/1.1 head, without
/// the connection-specific ones.
fn response_head(status: u16, encoded: &[u8]) -> http::Response<()> {
    let mut head = http::Response::new(());
    *head.status_mut() =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::BAD_GATEWAY);
    let fields = head.headers_mut();
    for (name, value) in encoded_fields(encoded) {
        if is_connection_specific(name) {
            continue;
        }
        // Parsed by httparse already; one h2 would not take is left out, never a panic.
        if let (Ok(name), Ok(value)) = (
            http::header::HeaderName::from_bytes(name),
            http::header::HeaderValue::from_bytes(value),
        ) {
            fields.append(name, value);
        }
    }
    head
}

/// Sends a response the proxy makes itself (an error page) on the stream; whether it went.
pub(super) fn answer(send: &mut SendResponse<Bytes>, responses: &Responses, status: u16) -> bool {
    responses.begin(status);
    let r = error_response(status, true);
    let mut head = http::Response::new(());
    *head.status_mut() =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::BAD_GATEWAY);
    for (name, value) in r.fields() {
        if is_connection_specific(name) {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            http::header::HeaderName::from_bytes(name),
            http::header::HeaderValue::from_bytes(value),
        ) {
            head.headers_mut().append(name, value);
        }
    }
    let body = match r.body {
        Body::Bytes(b) => Bytes::copy_from_slice(&b),
        _ => Bytes::new(),
    };
    let end = body.is_empty();
    match send.send_response(head, end) {
        // Small, within any initial window: h2 sends it as the window allows.
        Ok(mut stream) if !end => stream.send_data(body, true).is_ok(),
        Ok(_) => true,
        Err(_) => false,
    }
}

/// The content of a chunked body, from bytes [`BodyFraming`] has checked and delimited
/// (so that nothing here needs to refuse anything): chunk-size lines, extensions, the CRLF
/// after each chunk and the trailer section are left out. The trailer section is kept when
/// asked for ([`Self::keeping_trailers`]: an HTTP/1.1 client's chunked request to an h2c
/// backend, an HTTP/1.1 backend's chunked response to an h2 client), for h2 trailers.
pub(super) struct Dechunk {
    state: Chunk,
    /// The trailer section's bytes as they came, when kept.
    trailers: Option<Vec<u8>>,
}

/// The end of a chunked request body for an HTTP/1.1 backend: the last chunk, then an h2
/// client's trailers as the trailer section, without the fields a trailer may not carry
/// ([`forward::may_be_trailer`]: a backend that merges trailers into the head would take them
/// for fields the proxy had checked). Within the bounds a chunked request's trailers have on
/// the HTTP/1.1 path: a head's field count (64), and the proxy's own chunked parser
/// ([`BodyFraming`], 4 KiB) reads the section as a backend would; past either, an error.
fn chunked_end(trailers: Option<&http::HeaderMap>) -> Result<Vec<u8>, TooManyTrailers> {
    if trailers.is_some_and(|t| t.len() > Limits::default().max_headers) {
        return Err(TooManyTrailers);
    }
    let mut out = Vec::new();
    last_chunk(trailers, &mut out);
    let mut framing = BodyFraming::new(Framing::Chunked);
    match framing.advance(&out) {
        Ok(n) if n == out.len() && framing.is_done() => Ok(out),
        _ => Err(TooManyTrailers),
    }
}

/// Most bytes of a trailer section kept: a request head's limit. [`BodyFraming`] refuses a
/// trailer section longer than its own, smaller bound first; this one only makes sure that
/// nothing here grows past what a head may.
const MAX_TRAILER_SECTION: usize = 16 * 1024;

/// A trailer section with more fields than a request head may have, or longer than allowed.
#[derive(Debug, PartialEq)]
pub(super) struct TooManyTrailers;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Chunk {
    /// Not chunked: everything is content.
    Plain,
    /// In a chunk-size line: the size so far, and whether past it (in an extension).
    Size(u64, bool),
    /// After the size line's CR.
    SizeLf(u64),
    Data(u64),
    /// The CRLF after a chunk's data: bytes of it left.
    DataEnd(u8),
    /// In the trailer section: whether at the start of a line.
    Trailers(bool),
    Done,
}

impl Dechunk {
    pub(super) fn new(chunked: bool) -> Self {
        Self {
            state: if chunked {
                Chunk::Size(0, false)
            } else {
                Chunk::Plain
            },
            trailers: None,
        }
    }

    /// Keeps the trailer section, for [`Self::trailers`].
    pub(super) fn keeping_trailers(mut self) -> Self {
        self.trailers = Some(Vec::new());
        self
    }

    /// The fields of the trailer section kept (none when it was empty or not kept), as h2
    /// fields: without those a trailer may not carry ([`forward::may_be_trailer`]; the chunked
    /// parser refused them already). More fields than a request head may have, or a section
    /// longer than a head, is an error.
    pub(super) fn trailers(&self) -> Result<http::HeaderMap, TooManyTrailers> {
        let mut fields = http::HeaderMap::new();
        let Some(section) = &self.trailers else {
            return Ok(fields);
        };
        if section.len() > MAX_TRAILER_SECTION {
            return Err(TooManyTrailers);
        }
        let mut count = 0;
        for line in section.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(colon) = line.iter().position(|&b| b == b':') else {
                continue;
            };
            count += 1;
            if count > Limits::default().max_headers {
                return Err(TooManyTrailers);
            }
            let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
            if !forward::may_be_trailer(name) {
                continue;
            }
            if let (Ok(name), Ok(value)) = (
                http::header::HeaderName::from_bytes(name),
                http::header::HeaderValue::from_bytes(value),
            ) {
                fields.append(name, value);
            }
        }
        Ok(fields)
    }

    /// Appends the content among `buf` (the next bytes of the body) to `out`.
    pub(super) fn content(&mut self, mut buf: &[u8], out: &mut Vec<u8>) {
        if self.state == Chunk::Plain {
            out.extend_from_slice(buf);
            return;
        }
        while let Some((&b, rest)) = buf.split_first() {
            self.state = match self.state {
                Chunk::Data(n) => {
                    let take = (n.min(buf.len() as u64)) as usize;
                    out.extend_from_slice(&buf[..take]);
                    buf = &buf[take..];
                    self.state = if n == take as u64 {
                        Chunk::DataEnd(2)
                    } else {
                        Chunk::Data(n - take as u64)
                    };
                    continue;
                }
                Chunk::Size(n, false) if b.is_ascii_hexdigit() => {
                    let d = (b as char).to_digit(16).unwrap_or(0) as u64;
                    Chunk::Size(n.wrapping_shl(4) | d, false)
                }
                Chunk::Size(n, _) if b == b'\r' => Chunk::SizeLf(n),
                Chunk::Size(n, _) => Chunk::Size(n, true),
                Chunk::SizeLf(0) => Chunk::Trailers(true),
                Chunk::SizeLf(n) => Chunk::Data(n),
                Chunk::DataEnd(1) => Chunk::Size(0, false),
                Chunk::DataEnd(k) => Chunk::DataEnd(k - 1),
                Chunk::Trailers(_) => {
                    if let Some(t) = &mut self.trailers {
                        // One byte past the bound is enough to tell it was passed.
                        if t.len() <= MAX_TRAILER_SECTION {
                            t.push(b);
                        }
                    }
                    match self.state {
                        Chunk::Trailers(true) if b == b'\r' => Chunk::Trailers(true),
                        Chunk::Trailers(true) if b == b'\n' => Chunk::Done,
                        _ => Chunk::Trailers(b == b'\n'),
                    }
                }
                Chunk::Plain | Chunk::Done => Chunk::Done,
            };
            buf = rest;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunk_leaves_the_content_whatever_the_pieces() {
        let body =
            b"5\r\nhello\r\n1a; ext=\"x\"\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Sum: t\r\n\r\n";
        for step in [1, 2, 3, 7, 100] {
            let mut d = Dechunk::new(true);
            let mut out = Vec::new();
            for piece in body.chunks(step) {
                d.content(piece, &mut out);
            }
            assert_eq!(out, b"helloabcdefghijklmnopqrstuvwxyz", "step {step}");
            assert_eq!(d.state, Chunk::Done, "step {step}");
        }
        let mut d = Dechunk::new(false);
        let mut out = Vec::new();
        d.content(b"0\r\n", &mut out);
        assert_eq!(out, b"0\r\n");
    }

    #[test]
    fn dechunk_keeps_the_trailers_when_asked_without_the_forbidden_ones() {
        let body = b"3\r\nabc\r\n0\r\nX-Sum: t \r\nGrpc-Foo:1\r\nx-sum: u\r\n\r\n";
        for step in [1, 4, 100] {
            let mut d = Dechunk::new(true).keeping_trailers();
            let mut out = Vec::new();
            for piece in body.chunks(step) {
                d.content(piece, &mut out);
            }
            assert_eq!(out, b"abc", "step {step}");
            assert_eq!(d.state, Chunk::Done, "step {step}");
            let t = d.trailers().unwrap();
            let got: Vec<_> = t.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect();
            assert_eq!(
                got,
                [
                    ("x-sum", &b"t"[..]),
                    ("x-sum", &b"u"[..]),
                    ("grpc-foo", &b"1"[..])
                ],
                "step {step}"
            );
        }
        // Not kept unless asked; none when there were none.
        let mut d = Dechunk::new(true);
        d.content(body, &mut Vec::new());
        assert!(d.trailers().unwrap().is_empty());
        let mut d = Dechunk::new(true).keeping_trailers();
        d.content(b"1\r\na\r\n0\r\n\r\n", &mut Vec::new());
        assert!(d.trailers().unwrap().is_empty());
        // What a trailer may not carry is left out (had the parser let it through).
        let mut d = Dechunk::new(true).keeping_trailers();
        d.content(
            b"0\r\nHost: evil\r\nContent-Length: 9\r\nX-Ok: 1\r\n\r\n",
            &mut Vec::new(),
        );
        let t = d.trailers().unwrap();
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t["x-ok"], "1");
        // More fields than a head may have, or more bytes: an error.
        let max = Limits::default().max_headers;
        let many: String = (0..=max).map(|i| format!("x-{i}: 1\r\n")).collect();
        let mut d = Dechunk::new(true).keeping_trailers();
        d.content(format!("0\r\n{many}\r\n").as_bytes(), &mut Vec::new());
        assert_eq!(d.trailers(), Err(TooManyTrailers));
        let long = format!("0\r\nx-a: {}\r\n\r\n", "v".repeat(MAX_TRAILER_SECTION));
        let mut d = Dechunk::new(true).keeping_trailers();
        d.content(long.as_bytes(), &mut Vec::new());
        assert_eq!(d.trailers(), Err(TooManyTrailers));
    }

    #[test]
    fn h2_trailers_end_a_chunked_body_within_bounds_without_the_forbidden_ones() {
        let mut t = http::HeaderMap::new();
        for (name, value) in [
            ("x-sum", "1"),
            ("host", "evil"),
            ("authorization", "x"),
            ("x-forwarded-for", "6.6.6.6"),
            ("grpc-status", "0"),
        ] {
            t.append(
                http::header::HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        assert_eq!(
            chunked_end(Some(&t)).unwrap(),
            b"0\r\nx-sum: 1\r\ngrpc-status: 0\r\n\r\n"
        );
        assert_eq!(chunked_end(None).unwrap(), b"0\r\n\r\n");
        // A head's field count, and the chunked parser's 4 KiB, and no more.
        let max = Limits::default().max_headers;
        let many = |n: usize| {
            let mut t = http::HeaderMap::new();
            for i in 0..n {
                let name = http::header::HeaderName::from_bytes(format!("x-{i}").as_bytes());
                t.append(name.unwrap(), http::HeaderValue::from_static("1"));
            }
            t
        };
        assert!(chunked_end(Some(&many(max))).is_ok());
        assert_eq!(chunked_end(Some(&many(max + 1))), Err(TooManyTrailers));
        let long = |n: usize| {
            let mut t = http::HeaderMap::new();
            t.append("x-a", http::HeaderValue::from_str(&"v".repeat(n)).unwrap());
            t
        };
        assert!(chunked_end(Some(&long(4000))).is_ok());
        assert_eq!(chunked_end(Some(&long(5000))), Err(TooManyTrailers));
    }

    #[test]
    fn the_http1_head_of_an_h2_request_takes_host_from_the_authority() {
        let req = http::Request::builder()
            .method("POST")
            .uri("https://example.com:8443/p?q=1")
            .header("host", "evil.example")
            .header("cookie", "a=1")
            .header("cookie", "b=2")
            .header("x-forwarded-for", "6.6.6.6")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let head = http1_head(&parts, true);
        let Ok(Head::Complete(r, _)) = forward::parse_request_head(
            &head,
            &Limits::default(),
            forward::ForwardedPolicy::Replace,
        ) else {
            panic!("{}", String::from_utf8_lossy(&head));
        };
        assert_eq!(r.host.as_deref(), Some("example.com:8443"));
        assert_eq!(r.framing, Framing::Chunked);
        assert_eq!(r.field("cookie"), Some(&b"a=1; b=2"[..]));
        let mut out = Vec::new();
        r.encode(
            Origin {
                client: "192.0.2.7".parse().unwrap(),
                proto: "https",
            },
            forward::ForwardedPolicy::Replace,
            &mut out,
        );
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("POST /p?q=1 HTTP/1.1\r\n"), "{text}");
        assert!(
            !text.contains("evil") && !text.contains("6.6.6.6"),
            "{text}"
        );
        assert!(text.contains("X-Forwarded-For: 192.0.2.7\r\n"), "{text}");
        let fields: Vec<_> = encoded_fields(text.as_bytes()).collect();
        assert!(fields.contains(&(&b"Transfer-Encoding"[..], &b"chunked"[..])));
    }
}
