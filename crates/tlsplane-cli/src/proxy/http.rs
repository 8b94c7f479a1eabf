//! HTTP mode (`--mode http`): an HTTP/1.1 reverse proxy.
//!
//! One request at a time per client connection (pipelined requests wait in the client's
//! buffer): its head is parsed and written again for the backend (`tlsplane_http::forward`),
//! its body moved as it comes, framed but unread; then the response the same way. Backend
//! connections are kept alive between requests in a per-thread idle list. A request that
//! asks for a websocket `Upgrade` and gets `101` turns the connection into a TCP-mode relay
//! (other upgrades, h2c, are not forwarded: see `tlsplane_http::forward`). On a site whose
//! backends speak h2c, each request goes as an h2 stream instead (`h1_to_h2c`).
//!
//! Failures answer with a status when nothing of the response has reached the client yet: 502
//! when the backend fails or answers with something that is not HTTP/1, 504 when it does not
//! answer within --backend-timeout. Once the response has begun, a backend failure resets the
//! client's connection, so a truncated body is never taken for a whole one.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tlsplane::TlsStream;
use tlsplane_http::forward::{self, BodyFraming, Framing, Head, Origin, RequestHead, ResponseHead};
use tlsplane_http::{error_response, Body, HeadReader, Limits};
use tokio::time::{timeout, timeout_at, Instant};

use super::backend::BackendConn;
use super::h1_to_h2c::InterimBudget;
use super::tcp::relay;
use super::{reset, Ended, Proxy, Responses, Unavailable};
use tlsplane_server::access_log::{Entry, RequestLine};
use tlsplane_server::runtime::ConnContext;

/// Largest response head accepted from a backend.
pub(super) const MAX_RESPONSE_HEAD: usize = 65536;
pub(super) const MAX_RESPONSE_FIELDS: usize = 128;

/// Bytes read from one side and not yet used: `data[start..end]`. Allocated when bytes
/// come, grown (to `limit`) when they fill it, given back when empty between requests: an
/// idle keep-alive connection holds no buffer.
pub(super) struct Buf {
    data: Vec<u8>,
    start: usize,
    end: usize,
    initial: usize,
    limit: usize,
}

impl Buf {
    pub(super) fn new(initial: usize, limit: usize) -> Self {
        Self {
            data: Vec::new(),
            start: 0,
            end: 0,
            initial: initial.min(limit),
            limit,
        }
    }

    /// Gives the memory back if nothing is held.
    fn release(&mut self) {
        if self.is_empty() {
            self.data = Vec::new();
        }
    }

    /// Full size, for moving a body.
    pub(super) fn grow_to_limit(&mut self) {
        if self.data.len() < self.limit {
            self.data.resize(self.limit, 0);
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    pub(super) fn is_empty(&self) -> bool {
        self.start == self.end
    }

    pub(super) fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start >= self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// Room to read into; the held bytes move to the front when the tail is full, and the
    /// buffer grows when they fill it.
    pub(super) fn spare(&mut self) -> &mut [u8] {
        if self.data.is_empty() {
            self.data.resize(self.initial, 0);
        }
        if self.end == self.data.len() && self.start > 0 {
            self.data.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.data.len() && self.data.len() < self.limit {
            self.data.resize((self.data.len() * 2).min(self.limit), 0);
        }
        &mut self.data[self.end..]
    }

    pub(super) fn filled(&mut self, n: usize) {
        self.end += n;
    }
}

/// Why an exchange with the backend stopped.
pub(super) enum Fail {
    /// The backend connection failed before any byte of the response: worth one retry on a
    /// new connection when it was a reused one.
    Stale,
    /// The backend failed or sent what is not an HTTP/1 response, before the response
    /// began (502).
    BadGateway(String),
    /// No response head within --backend-timeout (504).
    Timeout,
    /// The client failed, went away or sent a broken body: nothing more to say to it.
    Client,
    /// The client's request body is malformed (400 if nothing was answered yet).
    BadBody,
    /// The backend failed after the response began: the client is reset.
    Midway(String),
    /// Past --request-timeout: 408, 504 or a reset, by how far the request got.
    Deadline(Progress),
}

/// How far a request got, for what to do at its --request-timeout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Progress {
    /// The proxy was waiting for more of the client's body (408).
    Receiving,
    /// The request was with the backend, no response yet (504).
    Waiting,
    /// Something of the response had been sent to the client (reset).
    Responding,
}

/// How the client's connection goes on after one request.
pub(super) enum Next {
    /// Read the next request.
    KeepAlive,
    /// The connection has ended this way.
    End(Ended),
}

/// Serves requests on one established client connection until it ends.
pub(super) async fn serve(
    proxy: &Proxy,
    tls: &mut TlsStream,
    peer: SocketAddr,
    ctx: &mut ConnContext,
) -> Ended {
    let capacity = (proxy.args.buffer as usize).max(Limits::default().max_head_bytes);
    let mut client = Buf::new(2048, capacity);
    let mut backend = Buf::new(capacity, capacity.max(MAX_RESPONSE_HEAD));
    let responses = Responses::new(proxy, tls.info());
    loop {
        let request = match read_request(proxy, tls, peer, &mut client, ctx, &responses).await {
            Ok(r) => r,
            Err(ended) => return ended,
        };
        proxy.stats.http_requests.fetch_add(1, Relaxed);
        // Only with the access log: no clock read per request otherwise.
        let started = proxy.access_log.as_ref().map(|_| Instant::now());
        // Boxed: the exchange's state is large and only lives while a request is served,
        // not while the connection waits for the next one.
        match Box::pin(exchange(
            proxy,
            tls,
            peer,
            &request,
            started,
            &mut client,
            &mut backend,
            ctx,
            &responses,
        ))
        .await
        {
            Next::KeepAlive => backend.release(),
            Next::End(ended) => return ended,
        }
    }
}

/// Reads the next request head: waits idle for its first byte (the wait a full server may
/// end to make room), then at most --header-timeout for the rest.
async fn read_request(
    proxy: &Proxy,
    tls: &mut TlsStream,
    peer: SocketAddr,
    client: &mut Buf,
    ctx: &mut ConnContext,
    responses: &Responses<'_>,
) -> Result<RequestHead, Ended> {
    let limits = Limits::default();
    let mut deadline: Option<(bool, Instant)> = None;
    // Looks at each byte of the head once; parses it a bounded number of times (not per read).
    let mut head = HeadReader::new();
    loop {
        let parsed = head.read(client.bytes(), &limits, |b| {
            Ok(
                match forward::parse_request_head(b, &limits, proxy.forwarded)? {
                    Head::Complete(request, len) => Some((request, len)),
                    Head::Incomplete => None,
                },
            )
        });
        match parsed {
            Ok(Some((request, len))) => {
                client.consume(len);
                return Ok(request);
            }
            Ok(None) => {}
            Err(e) => {
                proxy.stats.http_refused.fetch_add(1, Relaxed);
                let started = proxy.access_log.as_ref().map(|_| Instant::now());
                let sent = Box::pin(answer(tls, responses, e.status(), false)).await;
                if let (Some(log), Some(started)) = (&proxy.access_log, started) {
                    // Refused unparsed: no request fields, the reason instead.
                    let why = e.to_string();
                    let bytes = if sent.is_ok() {
                        error_body_len(e.status())
                    } else {
                        0
                    };
                    log.write(&Entry::refused(
                        tls,
                        peer,
                        e.status(),
                        bytes,
                        started.elapsed(),
                        &why,
                    ));
                }
                return Err(Ended::ClientError);
            }
        }
        let in_head = !client.is_empty();
        if *ctx.stop.borrow() && !in_head {
            let _ = Box::pin(tls.shutdown()).await;
            return Err(Ended::Closed);
        }
        let until = match deadline {
            Some((phase, at)) if phase == in_head => at,
            _ => {
                let secs = if in_head {
                    proxy.args.header_timeout
                } else {
                    proxy.args.server.idle_timeout
                };
                let at = Instant::now() + Duration::from_secs(secs);
                deadline = Some((in_head, at));
                at
            }
        };
        let (stop, idle) = (&mut ctx.stop, &ctx.idle);
        let read = if in_head {
            Some(timeout_at(until, Box::pin(tls.read(client.spare()))).await)
        } else {
            // Between requests: no buffer until the next one starts to come.
            client.release();
            let read = timeout_at(until, async {
                tls.readable().await?;
                Box::pin(tls.read(client.spare())).await
            });
            tokio::select! {
                r = idle.wait(read) => r,
                _ = stop.changed() => None,
            }
        };
        match read {
            // Evicted to make room, or shutting down: close between requests.
            None => {
                let _ = Box::pin(tls.shutdown()).await;
                return Err(Ended::Closed);
            }
            Some(Ok(Ok(0))) => {
                if in_head {
                    return Err(Ended::ClientError);
                }
                let _ = Box::pin(tls.shutdown()).await;
                return Err(Ended::Closed);
            }
            Some(Ok(Ok(n))) => client.filled(n),
            Some(Ok(Err(_))) => return Err(Ended::ClientError),
            Some(Err(_)) if in_head => {
                proxy.stats.http_refused.fetch_add(1, Relaxed);
                let _ = Box::pin(answer(tls, responses, 408, false)).await;
                return Err(Ended::ClientError);
            }
            Some(Err(_)) => {
                proxy.stats.idle_timeouts.fetch_add(1, Relaxed);
                let _ = Box::pin(tls.shutdown()).await;
                return Err(Ended::IdleTimeout);
            }
        }
    }
}

/// Sends a response the proxy makes itself (an error), then closes unless `keep_alive`
/// (lingering: the request's body, or more requests, may still be coming).
pub(super) async fn answer(
    tls: &mut TlsStream,
    responses: &Responses<'_>,
    status: u16,
    keep_alive: bool,
) -> std::io::Result<()> {
    responses.begin(status);
    let r = error_response(status, keep_alive);
    let mut out = r.head;
    if let Body::Bytes(b) = r.body {
        out.extend_from_slice(&b);
    }
    tls.write_all(&out).await?;
    if !keep_alive {
        tls.close().await?;
    }
    Ok(())
}

/// Forwards one request and its response.
#[allow(clippy::too_many_arguments)]
async fn exchange(
    proxy: &Proxy,
    tls: &mut TlsStream,
    peer: SocketAddr,
    request: &RequestHead,
    started: Option<Instant>,
    client: &mut Buf,
    backend: &mut Buf,
    ctx: &ConnContext,
    responses: &Responses<'_>,
) -> Next {
    let site = tls.info().site;
    let keep_alive = request.keep_alive && !*ctx.stop.borrow();
    let has_body = request.framing != Framing::Empty;
    // `bytes`: the body relayed, or `None` for an answer of the proxy's own (its error page).
    let log = |tls: &TlsStream, status: u16, backend: &str, bytes: Option<u64>| {
        if let (Some(log), Some(started)) = (&proxy.access_log, started) {
            log.write(&Entry {
                peer,
                host: request.host.as_deref().map(str::as_bytes),
                request: Some(RequestLine {
                    method: &request.method,
                    target: &request.target,
                    protocol: tlsplane_server::access_log::http1(request.minor_version),
                }),
                status: Some(status),
                bytes: bytes.unwrap_or_else(|| error_body_len(status)),
                duration: started.elapsed(),
                user_agent: request.field("user-agent"),
                referer: request.field("referer"),
                plane: tls.plane().as_str(),
                server_name: tls.info().server_name.as_deref(),
                backend: (backend != "-").then_some(backend),
                outcome: None,
            });
        }
    };
    if request.method == "CONNECT" {
        // A tunnel to the target (RFC 9110 §9.3.6), which the proxy does not make: forwarded,
        // the backend would be asked for one. Refused as nginx refuses it; what the client
        // sends next would be the tunnel's bytes, not a request: close after.
        proxy.stats.http_refused.fetch_add(1, Relaxed);
        proxy.stats.connect_refused.fetch_add(1, Relaxed);
        let _ = answer(tls, responses, 405, false).await;
        log(tls, 405, "-", None);
        return Next::End(Ended::Closed);
    }
    let misdirected = request.host.as_deref().is_some_and(|h| {
        let name = host_name(h);
        proxy.names.lookup(name) != Some(site)
    });
    if misdirected {
        // The Host belongs to another site than the one the TLS connection was set up for
        // (RFC 9110 §15.5.20). The body, if any, was not read: close after.
        proxy.stats.http_refused.fetch_add(1, Relaxed);
        let sent = answer(tls, responses, 421, keep_alive && !has_body).await;
        log(tls, 421, "-", None);
        return match sent {
            Ok(()) if keep_alive && !has_body => Next::KeepAlive,
            _ => Next::End(Ended::Closed),
        };
    }
    if request.expect_continue && has_body {
        // The proxy answers the expectation itself (and does not forward it): the body is
        // read now whatever the backend would have said.
        if tls
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .is_err()
        {
            return Next::End(Ended::ClientError);
        }
    }
    let mut head = Vec::with_capacity(1024);
    let origin = Origin {
        client: peer.ip(),
        proto: "https",
    };
    request.encode(origin, proxy.forwarded, &mut head);
    if proxy.protocols[site] == super::BackendProtocol::H2c {
        // The request becomes a stream to an h2c backend (docs/HTTP2.md, "Proxy").
        return Box::pin(super::h1_to_h2c::exchange(
            proxy, tls, peer, request, &head, client, keep_alive, &log, responses,
        ))
        .await;
    }
    let deadline = (proxy.args.request_timeout > 0)
        .then(|| Instant::now() + Duration::from_secs(proxy.args.request_timeout));
    let mut retried = false;
    let fail = loop {
        let (conn, which, reused) = match proxy.backend_for(site, !retried).await {
            Ok(c) => c,
            Err(why) => {
                let keep = keep_alive && !has_body;
                return unavailable(proxy, tls, responses, why, keep, &log).await;
            }
        };
        proxy.stats.forwarded.fetch_add(1, Relaxed);
        if reused {
            proxy.stats.backend_reused.fetch_add(1, Relaxed);
        }
        backend.clear();
        let label = proxy.pools[site].backends[which].to_string();
        let mut progress = Progress::Waiting;
        let forwarded = forward_one(
            proxy,
            tls,
            request,
            &head,
            client,
            backend,
            &conn,
            keep_alive,
            &mut progress,
            responses,
        );
        // A deadline over the whole exchange, and not only over its waits: a backend that
        // trickles its response, or a client its body, is still cut off.
        let outcome = match deadline {
            None => forwarded.await,
            Some(at) => match timeout_at(at, forwarded).await {
                Ok(r) => r,
                Err(_) => Err(Fail::Deadline(progress)),
            },
        };
        match outcome {
            Ok(Forwarded::Done {
                status,
                reusable,
                keep,
                bytes,
            }) => {
                log(tls, status, &label, Some(bytes));
                if reusable {
                    proxy.pools[site].put_idle(
                        which,
                        conn,
                        proxy.args.backend_keepalive,
                        Duration::from_secs(proxy.args.backend_idle_timeout),
                    );
                }
                if keep {
                    return Next::KeepAlive;
                }
                // Lingering: the rest of a body answered early, or pipelined requests, may
                // still be coming.
                let _ = Box::pin(tls.close()).await;
                return Next::End(Ended::Closed);
            }
            Ok(Forwarded::Upgraded(status)) => {
                log(tls, status, &label, Some(0));
                proxy.stats.upgrades.fetch_add(1, Relaxed);
                return Next::End(tunnel(proxy, tls, client, backend, &conn).await);
            }
            Err(Fail::Stale) if reused && !retried && request.is_retryable() => {
                // The backend closed an idle connection as we reused it: once more on a new one.
                proxy.stats.backend_retries.fetch_add(1, Relaxed);
                retried = true;
            }
            Err(Fail::Stale) => {
                break Fail::BadGateway(format!("{label}: closed before a response"))
            }
            Err(Fail::Timeout) => {
                proxy.pools[site]
                    .mark_down(which, Duration::from_secs(proxy.args.backend_down_time));
                log(tls, 504, &label, None);
                break Fail::Timeout;
            }
            Err(Fail::BadGateway(why)) => break Fail::BadGateway(format!("{label}: {why}")),
            Err(Fail::Deadline(progress)) => {
                // The backend has part of a request or of a response: it cannot be reused.
                conn.reset_on_close();
                match progress {
                    Progress::Receiving => log(tls, 408, &label, None),
                    Progress::Waiting => log(tls, 504, &label, None),
                    // Like a backend failing midway: a reset, and no status to log.
                    Progress::Responding => {}
                }
                break Fail::Deadline(progress);
            }
            Err(Fail::Midway(why)) => {
                conn.reset_on_close();
                break Fail::Midway(format!("{label}: {why}"));
            }
            Err(other) => {
                // The client's side failed: the backend must not take what it got for a
                // whole request.
                conn.reset_on_close();
                break other;
            }
        }
    };
    failed(proxy, tls, responses, peer, fail, &log).await
}

/// What `exchange` logs a request with: its status, the backend (`-`: none), the body bytes
/// relayed (`None`: the proxy's own error page).
pub(super) type Log<'a> = dyn Fn(&TlsStream, u16, &str, Option<u64>) + Sync + 'a;

/// No backend would take the request: 503 when backends are at their connection limit (try
/// again later), 502 when none could be reached. `keep`: the connection may go on (nothing of
/// a body is left unread).
pub(super) async fn unavailable(
    proxy: &Proxy,
    tls: &mut TlsStream,
    responses: &Responses<'_>,
    why: Unavailable,
    keep: bool,
    log: &Log<'_>,
) -> Next {
    proxy.stats.no_backend.fetch_add(1, Relaxed);
    let status = match why {
        Unavailable::Full => 503,
        Unavailable::Down => {
            proxy.stats.http_502.fetch_add(1, Relaxed);
            502
        }
    };
    let sent = answer(tls, responses, status, keep).await;
    log(tls, status, "-", None);
    match sent {
        Ok(()) if keep => Next::KeepAlive,
        _ => Next::End(Ended::NoBackend),
    }
}

/// Answers a failed exchange (a status while nothing of the response is out, else a reset)
/// and ends the connection; counted by its side. What a failure logs with its backend is
/// logged by the caller first.
pub(super) async fn failed(
    proxy: &Proxy,
    tls: &mut TlsStream,
    responses: &Responses<'_>,
    peer: SocketAddr,
    fail: Fail,
    log: &Log<'_>,
) -> Next {
    if let Fail::Deadline(progress) = &fail {
        proxy.stats.request_timeouts.fetch_add(1, Relaxed);
        tracing::debug!(%peer, ?progress, "request past --request-timeout");
    }
    match fail {
        Fail::BadGateway(why) => {
            tracing::warn!(%peer, error = %why, "bad gateway");
            proxy.stats.backend_errors.fetch_add(1, Relaxed);
            proxy.stats.http_502.fetch_add(1, Relaxed);
            let _ = answer(tls, responses, 502, false).await;
            log(tls, 502, "-", None);
            Next::End(Ended::BackendError)
        }
        Fail::Timeout | Fail::Deadline(Progress::Waiting) => {
            proxy.stats.http_504.fetch_add(1, Relaxed);
            let _ = answer(tls, responses, 504, false).await;
            Next::End(Ended::BackendError)
        }
        Fail::BadBody => {
            proxy.stats.http_refused.fetch_add(1, Relaxed);
            let _ = answer(tls, responses, 400, false).await;
            log(tls, 400, "-", None);
            Next::End(Ended::ClientError)
        }
        Fail::Midway(why) => {
            tracing::warn!(%peer, error = %why, "backend failed in the middle of a response");
            proxy.stats.backend_errors.fetch_add(1, Relaxed);
            reset(tls);
            Next::End(Ended::BackendError)
        }
        Fail::Client | Fail::Stale => {
            proxy.stats.client_errors.fetch_add(1, Relaxed);
            Next::End(Ended::ClientError)
        }
        Fail::Deadline(Progress::Receiving) => {
            proxy.stats.http_refused.fetch_add(1, Relaxed);
            let _ = answer(tls, responses, 408, false).await;
            Next::End(Ended::ClientError)
        }
        Fail::Deadline(Progress::Responding) => {
            // Part of the response is out: only a reset says it is not whole.
            reset(tls);
            Next::End(Ended::BackendError)
        }
    }
}

/// Body bytes of the error page the proxy sends for `status`.
pub(super) fn error_body_len(status: u16) -> u64 {
    match error_response(status, false).body {
        Body::Bytes(b) => b.len() as u64,
        _ => 0,
    }
}

/// The host name of a `Host` value (no port, no IPv6 brackets).
pub(super) fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(ip, _)| ip);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// How one forwarded exchange ended.
enum Forwarded {
    /// The response went to the client whole. `reusable`: the backend connection may carry
    /// another request; `keep`: the client's connection goes on.
    Done {
        status: u16,
        reusable: bool,
        keep: bool,
        /// Response body bytes relayed to the client.
        bytes: u64,
    },
    /// `101`: both sides now speak another protocol.
    Upgraded(u16),
}

/// Sends the request (head and body) and relays the response.
#[allow(clippy::too_many_arguments)]
async fn forward_one(
    proxy: &Proxy,
    tls: &mut TlsStream,
    request: &RequestHead,
    head: &[u8],
    client: &mut Buf,
    backend: &mut Buf,
    conn: &BackendConn,
    keep_alive: bool,
    progress: &mut Progress,
    responses: &Responses<'_>,
) -> Result<Forwarded, Fail> {
    let backend_timeout = Duration::from_secs(proxy.args.backend_timeout);
    let stats = &proxy.stats;

    // Until the response begins, a deadline is the backend's to answer for (504), except
    // while the proxy waits for more of the client's body (408).
    *progress = Progress::Waiting;
    // The head, with the body bytes already at hand, in one write.
    let mut body = BodyFraming::new(request.framing);
    let n = body.advance(client.bytes()).map_err(|_| Fail::BadBody)?;
    let mut out = Vec::with_capacity(head.len() + n);
    out.extend_from_slice(head);
    out.extend_from_slice(&client.bytes()[..n]);
    client.consume(n);
    match timeout(backend_timeout, conn.write_all(&out)).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return Err(Fail::Stale),
        Err(_) => return Err(Fail::Timeout),
    }
    stats
        .bytes_to_backend_copied
        .fetch_add(out.len() as u64, Relaxed);
    drop(out);
    if !body.is_done() {
        client.grow_to_limit();
    }
    let answered_early = match send_body(
        proxy, tls, request, &mut body, client, backend, conn, progress,
    )
    .await?
    {
        BodySent::All => false,
        BodySent::AnsweredEarly => true,
    };
    if answered_early {
        stats.early_responses.fetch_add(1, Relaxed);
    }

    // The response head, after any interim ones: one --backend-timeout for the whole wait,
    // however many interim responses come in it, and at most four of them relayed, as on
    // every other pair of protocols (`InterimBudget`).
    let head_due = Instant::now() + backend_timeout;
    let mut interim = InterimBudget::default();
    let mut any_interim = false;
    let response = loop {
        let wait = head_due.saturating_duration_since(Instant::now());
        let response = read_response_head(conn, backend, request, wait, any_interim).await?;
        if !response.is_interim() {
            break response;
        }
        any_interim = true;
        // 100 Continue was the proxy's to send; others (103 Early Hints) go to 1.1 clients.
        if request.minor_version == 1 && interim.admits(response.status) {
            *progress = Progress::Responding;
            responses.begin(response.status);
            let mut out = Vec::new();
            response.encode(1, true, &mut out);
            tls.write_all(&out).await.map_err(|_| Fail::Client)?;
        }
    };
    if response.status == 101 {
        if request.upgrade.is_none() {
            return Err(Fail::BadGateway(
                "101 to a request that asked for no upgrade".into(),
            ));
        }
        // Only a websocket tunnel was asked for (see forward::RequestHead::upgrade).
        if !response
            .upgrade
            .as_deref()
            .is_some_and(|p| p.trim().eq_ignore_ascii_case("websocket"))
        {
            return Err(Fail::BadGateway(
                "101 to another protocol than websocket".into(),
            ));
        }
        *progress = Progress::Responding;
        responses.begin(response.status);
        let mut out = Vec::new();
        response.encode(1, true, &mut out);
        tls.write_all(&out).await.map_err(|_| Fail::Client)?;
        return Ok(Forwarded::Upgraded(101));
    }
    let keep = keep_alive && !answered_early && response.framing != Framing::UntilClose;
    *progress = Progress::Responding;
    responses.begin(response.status);
    let bytes = relay_response(proxy, tls, &response, backend, conn, keep, backend_timeout).await?;
    Ok(Forwarded::Done {
        bytes,
        status: response.status,
        reusable: response.keep_alive
            && !answered_early
            && response.framing != Framing::UntilClose
            && backend.is_empty(),
        keep,
    })
}

/// How the request body's sending ended.
enum BodySent {
    All,
    /// The backend gave its final response first; the rest of the body was not sent.
    AnsweredEarly,
}

/// Sends the rest of the request body, reading it from the client as it comes.
///
/// A backend may answer before it has the whole body (413, 401, a redirect) and stop
/// reading it: the proxy then stops sending it, relays that answer and closes the client's
/// connection, whose body it has not read to its end. It watches for that answer while it
/// writes to the backend and while it waits for the client.
#[allow(clippy::too_many_arguments)]
async fn send_body(
    proxy: &Proxy,
    tls: &mut TlsStream,
    request: &RequestHead,
    body: &mut BodyFraming,
    client: &mut Buf,
    backend: &mut Buf,
    conn: &BackendConn,
    progress: &mut Progress,
) -> Result<BodySent, Fail> {
    let backend_timeout = Duration::from_secs(proxy.args.backend_timeout);
    let idle = Duration::from_secs(proxy.args.server.idle_timeout);
    while !body.is_done() {
        if backend_answered(conn, backend, request)? {
            return Ok(BodySent::AnsweredEarly);
        }
        *progress = Progress::Receiving;
        // The backend may answer while the client is slow to send the rest: the client read
        // then gives way (a TLS read is cancel-safe, as TCP mode's relay relies on too).
        tokio::select! {
            r = timeout(idle, tls.read(client.spare())) => match r {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(Fail::Client),
                Ok(Ok(n)) => client.filled(n),
            },
            // Readable: checked at the top of the loop.
            _ = conn.readable() => continue,
        }
        *progress = Progress::Waiting;
        let n = body.advance(client.bytes()).map_err(|_| Fail::BadBody)?;
        let until = Instant::now() + backend_timeout;
        let mut sent = 0;
        while sent < n {
            tokio::select! {
                r = timeout_at(until, conn.write(&client.bytes()[sent..n])) => match r {
                    Ok(Ok(0)) => return Err(Fail::BadGateway("the backend took no more of the body".into())),
                    Ok(Ok(k)) => sent += k,
                    // It may have answered, and reset what it would not read.
                    Ok(Err(_)) if backend_answered(conn, backend, request)? => {
                        return Ok(BodySent::AnsweredEarly)
                    }
                    Ok(Err(e)) => {
                        return Err(Fail::BadGateway(format!("writing the request body: {e}")))
                    }
                    Err(_) => return Err(Fail::Timeout),
                },
                r = conn.readable() => {
                    if r.is_ok() && backend_answered(conn, backend, request)? {
                        return Ok(BodySent::AnsweredEarly);
                    }
                }
            }
        }
        proxy
            .stats
            .bytes_to_backend_copied
            .fetch_add(n as u64, Relaxed);
        client.consume(n);
    }
    Ok(BodySent::All)
}

/// Whether the backend has begun its final response while the request body is still being
/// sent: reads what it sent without waiting. Interim responses (100 Continue) are dropped
/// (the proxy answers Expect itself) and sending goes on.
fn backend_answered(
    conn: &BackendConn,
    backend: &mut Buf,
    request: &RequestHead,
) -> Result<bool, Fail> {
    loop {
        if backend.is_empty() {
            backend.grow_to_limit();
        }
        match conn.try_read(backend.spare()) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            // Closed or reset without a word (a reused connection the backend had closed
            // while idle, as the head's write can still succeed then): a retry where one is
            // possible, else a 502, as when it happens after the body.
            Ok(0) | Err(_) if backend.is_empty() => return Err(Fail::Stale),
            Ok(0) | Err(_) => {}
            Ok(n) => {
                backend.filled(n);
                continue;
            }
        }
        if backend.is_empty() {
            return Ok(false);
        }
        match forward::parse_response_head(
            backend.bytes(),
            request,
            MAX_RESPONSE_HEAD,
            MAX_RESPONSE_FIELDS,
        ) {
            Ok(Head::Complete(response, len)) if response.is_interim() => {
                backend.consume(len);
            }
            // A final response: what follows reads it.
            Ok(Head::Complete(..)) => return Ok(true),
            // Which one it is shows when the rest of its head comes (the socket is then
            // readable again).
            Ok(Head::Incomplete) => return Ok(false),
            Err(e) => return Err(Fail::BadGateway(e.to_string())),
        }
    }
}

/// The backend's next response head, within `wait`. A close before any of it is a connection
/// the backend had closed while idle ([`Fail::Stale`], retried where possible), unless
/// `answered`: an interim response to this request came first, so the close is the backend
/// failing.
pub(super) async fn read_response_head(
    conn: &BackendConn,
    backend: &mut Buf,
    request: &RequestHead,
    wait: Duration,
    answered: bool,
) -> Result<ResponseHead, Fail> {
    let until = Instant::now() + wait;
    let mut any = !backend.is_empty();
    loop {
        match forward::parse_response_head(
            backend.bytes(),
            request,
            MAX_RESPONSE_HEAD,
            MAX_RESPONSE_FIELDS,
        ) {
            Ok(Head::Complete(response, len)) => {
                backend.consume(len);
                return Ok(response);
            }
            Ok(Head::Incomplete) => {}
            Err(e) => return Err(Fail::BadGateway(e.to_string())),
        }
        match timeout_at(until, conn.read(backend.spare())).await {
            Err(_) => return Err(Fail::Timeout),
            Ok(Ok(0)) | Ok(Err(_)) if !any && answered => {
                return Err(Fail::BadGateway("closed after an interim response".into()))
            }
            Ok(Ok(0)) | Ok(Err(_)) if !any => return Err(Fail::Stale),
            Ok(Ok(0)) => return Err(Fail::BadGateway("closed within the response head".into())),
            Ok(Err(e)) => return Err(Fail::BadGateway(e.to_string())),
            Ok(Ok(n)) => {
                any = true;
                backend.filled(n);
            }
        }
    }
}

/// Sends the response head and body to the client as the backend delivers them.
async fn relay_response(
    proxy: &Proxy,
    tls: &mut TlsStream,
    response: &ResponseHead,
    backend: &mut Buf,
    conn: &BackendConn,
    keep: bool,
    wait: Duration,
) -> Result<u64, Fail> {
    let stats = &proxy.stats;
    let mut body = BodyFraming::new(response.framing);
    // Nothing has reached the client yet: broken framing here is still a 502.
    let n = body
        .advance(backend.bytes())
        .map_err(|e| Fail::BadGateway(e.to_string()))?;
    let mut out = Vec::with_capacity(512 + n);
    response.encode(1, keep, &mut out);
    out.extend_from_slice(&backend.bytes()[..n]);
    backend.consume(n);
    let mut body_sent = n as u64;
    tls.write_all(&out).await.map_err(|_| Fail::Client)?;
    stats
        .bytes_to_client_copied
        .fetch_add(out.len() as u64, Relaxed);
    drop(out);
    while !body.is_done() {
        match timeout(wait, conn.read(backend.spare())).await {
            Ok(Ok(0)) if body.until_close() => break,
            Ok(Ok(0)) => return Err(Fail::Midway("closed in the middle of the body".into())),
            Ok(Ok(n)) => backend.filled(n),
            Ok(Err(e)) => return Err(Fail::Midway(e.to_string())),
            Err(_) => return Err(Fail::Midway("timed out in the middle of the body".into())),
        }
        let n = body
            .advance(backend.bytes())
            .map_err(|e| Fail::Midway(e.to_string()))?;
        tls.write_all(&backend.bytes()[..n])
            .await
            .map_err(|_| Fail::Client)?;
        stats.bytes_to_client_copied.fetch_add(n as u64, Relaxed);
        body_sent += n as u64;
        backend.consume(n);
    }
    Ok(body_sent)
}

/// After `101 Switching Protocols`: what each side sent past the heads, then TCP mode.
async fn tunnel(
    proxy: &Proxy,
    tls: &mut TlsStream,
    client: &mut Buf,
    backend: &mut Buf,
    conn: &BackendConn,
) -> Ended {
    if !backend.is_empty() {
        if tls.write_all(backend.bytes()).await.is_err() {
            return Ended::ClientError;
        }
        backend.clear();
    }
    if !client.is_empty() {
        if conn.write_all(client.bytes()).await.is_err() {
            return Ended::BackendError;
        }
        client.clear();
    }
    let ended = relay(
        tls,
        conn,
        None,
        proxy.args.buffer as usize,
        Duration::from_secs(proxy.args.server.idle_timeout),
        &proxy.stats,
    )
    .await;
    proxy.settle(ended, tls, conn).await
}
