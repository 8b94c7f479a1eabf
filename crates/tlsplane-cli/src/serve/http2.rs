//! HTTP/2 for `serve`, for operators who opt in by ALPN (`--alpn h2,http/1.1`, or a site's
//! `alpn`; docs/HTTP2.md). The first step of issue 22.
//!
//! hyperium's `h2` does the framing, HPACK, flow control and the protocol's own hardening.
//! Requests are planned by `tlsplane-http` exactly as over HTTP/1.1 ([`respond`]: status,
//! validators, conditionals, ranges, path safety), and the planned header fields are sent as
//! HTTP/2 fields ([`tlsplane_http::Response::fields`]); nothing of the planning is repeated
//! here. The transport h2 runs on (file bodies carried by the outbox, by `sendfile` on the
//! kernel plane) and the conversion of requests and responses are `tlsplane-h2`'s, which the
//! fuzz targets drive too; this module adds what is the product's: sites, counters, the
//! access log, the connection's life.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, SystemTime};

use h2::server::SendResponse;
use h2::RecvStream;
use tlsplane::{ConnectionInfo, TlsStream};
use tlsplane_h2::serve::{drain, field, refused, request, send_response, FILE_SEND_BUFFER};
use tlsplane_h2::settings;
use tlsplane_h2::transport::{self, FileBodies, H2Body, H2Io, StreamEnds, Woken};
use tlsplane_http::{error_response, respond};
use tokio::sync::watch;

use super::{body_len, count_status, Serve};
use crate::h2_connection;
use tlsplane_server::access_log::{Entry, RequestLine};
use tlsplane_server::runtime::{ConnContext, Idle};

/// Serves one connection whose client chose `h2`, to its end.
pub(super) async fn serve(
    mut tls: TlsStream,
    woken: Woken,
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
    let (conn, pumped) = transport::run(&mut tls, woken, stall, |io| {
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
    let ends = io.stream_ends();
    let flush = io.flusher();
    let floods = io.floods();
    let handshake = settings::server(FILE_SEND_BUFFER).handshake::<_, H2Body>(io);
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
        flush,
        floods,
    };
    let (files, ends, responded) = (&files, &ends, &responded);
    h2_connection::run(&mut conn, life, |request, send| {
        let stream = Stream {
            info,
            plane,
            peer,
            shared,
            files,
            ends,
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
    /// When a response's last byte went out (the access log's duration ends there).
    ends: &'a StreamEnds,
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
        // With the access log the stream is served until its last byte has gone to the
        // client, as over HTTP/1.1: a duration that stopped when the body was handed to h2
        // said nothing of the transfer.
        let mut end = started.map(|_| self.ends.watch(send.stream_id()));
        let request = request(&req);
        let site = self.info.site;
        let resp = if let Some(refusal) = refused(&request, had_body) {
            refusal
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
        let sent = send_response(&mut send, resp, self.files, stall, end.as_mut()).await;
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
