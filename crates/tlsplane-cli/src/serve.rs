//! `tlsplane serve`: an HTTPS static-file server.
//!
//! Listeners, handshakes and workers are the shared runtime's (`tlsplane_server::runtime`);
//! this module is the handler it runs on each established connection. HTTP/1.1 is parsed by
//! `tlsplane-http`; responses are written here so that file bodies can follow the headers by
//! `sendfile(2)`. A client that chose `h2` by ALPN (offered only when the operator named it)
//! is served by [`http2`], with the same response planning.

mod http2;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::Args;
use tlsplane::sites::SiteNames;
use tlsplane::stats::Counter;
use tlsplane::TlsStream;
use tlsplane_http::{
    error_response, parse_request, respond, Body, DocRoot, HeadReader, Limits, Parsed,
};

use crate::h2_connection;
use tlsplane_server::access_log::{self, AccessLog, Entry, RequestLine};
use tlsplane_server::config::{Origin, SiteNeeds, Sites};
use tlsplane_server::runtime::{ConnContext, FirstRequest, Handler, Phase, RuntimeStats, Served};
use tlsplane_server::server::{Product, ServerArgs};

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Directory to serve (without --config: one site, whatever the name asked for).
    #[arg(default_value = ".")]
    pub dir: PathBuf,
    /// Follow symlinks that lead outside DIR (refused by default).
    #[arg(long)]
    pub allow_symlinks_outside: bool,
    /// Serve dot-files and dot-directories (`/.git/config`, `/.env`): by default a path with
    /// a segment starting with `.` is answered 404, except under `/.well-known/`. A site's
    /// `serve-dotfiles` key says it for that site.
    #[arg(long)]
    pub serve_dotfiles: bool,
    /// Seconds from the first byte of a request to the end of its headers (one deadline for
    /// the whole head, however the client spreads it over reads).
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    #[command(flatten)]
    pub server: ServerArgs,
}

/// HTTP-level counters; TLS counters live in `tlsplane::stats`.
#[derive(Default)]
pub struct HttpStats {
    requests: Counter,
    responses_2xx: Counter,
    responses_3xx: Counter,
    responses_4xx: Counter,
    responses_5xx: Counter,
    timeouts: Counter,
    io_errors: Counter,
    h2: crate::h2_connection::H2Stats,
}

/// The `serve` product under one configuration: the runtime hands it established
/// connections.
pub struct Serve {
    /// Document roots by site number (the acceptor's).
    roots: Vec<DocRoot>,
    names: Arc<SiteNames>,
    args: ServeArgs,
    limits: Limits,
    /// Kept across reloads.
    stats: Arc<HttpStats>,
    /// Time to the first byte of a connection's first response (shared with /metrics).
    ttfb: prometheus_client::metrics::histogram::Histogram,
    /// Opened again with each generation (a reload re-opens the file).
    access_log: Option<AccessLog>,
}

/// A connection waiting for its client, as it moves to the connection loop: between
/// requests, or part-way through a request head.
pub struct Parked {
    /// The request buffer, and the bytes of a request head read so far.
    buf: Vec<u8>,
    used: usize,
    /// What the connection was waiting for, and until when (a trickled head keeps its
    /// header deadline across the move).
    deadline: Option<(bool, tokio::time::Instant)>,
    /// It has had a response already (its time to first byte is recorded).
    responded: bool,
}

impl Parked {
    /// Nothing read yet, no buffer held.
    fn empty() -> Self {
        Parked {
            buf: Vec::new(),
            used: 0,
            deadline: None,
            responded: false,
        }
    }
}

impl Product for Serve {
    type Args = ServeArgs;
    type Stats = HttpStats;
    const COMMAND: &'static str = "serve";

    fn server(args: &ServeArgs) -> &ServerArgs {
        &args.server
    }

    fn refuse_with_config(explicit: &dyn Fn(&str) -> bool) -> anyhow::Result<()> {
        if explicit("dir") {
            anyhow::bail!(
                "a DIR argument and --config: with a configuration file each site has its root"
            );
        }
        Ok(())
    }

    fn site_needs(args: &ServeArgs) -> SiteNeeds {
        SiteNeeds::Root {
            allow_symlinks_outside: args.allow_symlinks_outside,
            serve_dotfiles: args.serve_dotfiles,
        }
    }

    fn alpn(args: &ServeArgs) -> tlsplane_server::server::Alpn {
        tlsplane_server::server::Alpn::new(
            args.server.alpn.as_deref(),
            &tlsplane_server::server::HTTP1_ALPN,
            Some(&tlsplane_server::server::SERVE_ALPN),
        )
    }

    fn flag_origin(args: &ServeArgs) -> anyhow::Result<Origin> {
        use anyhow::Context;
        let root = DocRoot::new(&args.dir, args.allow_symlinks_outside)
            .with_context(|| format!("cannot serve {}", args.dir.display()))?
            .serve_dotfiles(args.serve_dotfiles);
        Ok(Origin::Root(root))
    }

    fn build(
        args: &ServeArgs,
        sites: Sites,
        stats: &Arc<HttpStats>,
        runtime: &Arc<RuntimeStats>,
    ) -> anyhow::Result<Self> {
        let roots = sites
            .serve
            .into_iter()
            .map(|s| match s.origin {
                Origin::Root(r) => Ok(r),
                _ => Err(anyhow::anyhow!("site {}: no root", s.label)),
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            roots,
            names: sites.names,
            args: args.clone(),
            limits: Limits::default(),
            stats: stats.clone(),
            ttfb: runtime.histograms.first_response.clone(),
            access_log: args.server.access_log()?,
        })
    }

    fn counters(h: &HttpStats, r: &RuntimeStats) -> Vec<(&'static str, u64)> {
        vec![
            ("http_connections", r.connections.load(Relaxed)),
            ("http_requests", h.requests.load(Relaxed)),
            ("http_responses_2xx", h.responses_2xx.load(Relaxed)),
            ("http_responses_3xx", h.responses_3xx.load(Relaxed)),
            ("http_responses_4xx", h.responses_4xx.load(Relaxed)),
            ("http_responses_5xx", h.responses_5xx.load(Relaxed)),
            (
                "http_timeouts",
                h.timeouts.load(Relaxed) + r.handshake_timeouts.load(Relaxed),
            ),
            ("http_handshake_errors", r.handshake_errors.load(Relaxed)),
            ("http_io_errors", h.io_errors.load(Relaxed)),
        ]
        .into_iter()
        .chain(h.h2.counters(&crate::h2_connection::H2Stats::SERVE))
        .collect()
    }
}

impl Handler for Serve {
    type Parked = Parked;

    async fn serve(
        self: Arc<Self>,
        tls: TlsStream,
        peer: SocketAddr,
        phase: Phase<Parked>,
        mut ctx: ConnContext,
    ) -> Served<Parked> {
        if tls.info().alpn.as_deref() == Some(b"h2".as_slice()) {
            let Phase::Moved(_) = phase else {
                // Long-lived and multiplexed: served on a connection loop from the start.
                return Served::Park(tls, Parked::empty());
            };
            let mut tls = tls;
            // h2 and its buffers only once the client asks for something.
            let opening = h2_connection::Opening {
                header_timeout: Duration::from_secs(self.args.header_timeout),
                idle_timeout: Duration::from_secs(self.args.server.idle_timeout),
                stop: &mut ctx.stop,
                idle: &ctx.idle,
                stats: &self.stats.h2,
                header_timeouts: &self.stats.timeouts,
                timeouts: &self.stats.timeouts,
            };
            // Boxed, and gone once h2 starts: not carried by every connection's task.
            let opened = Box::pin(h2_connection::open(&mut tls, opening)).await;
            let served = match opened {
                // Boxed: HTTP/1.1 connections' futures, and h2 connections' openings, do not
                // carry h2's state.
                Ok(Some(woken)) => Box::pin(http2::serve(tls, woken, peer, &self, &mut ctx)).await,
                Ok(None) => Box::pin(tls.close()).await,
                Err(e) => Err(e),
            };
            if let Err(e) = served {
                self.stats.io_errors.fetch_add(1, Relaxed);
                tracing::debug!(%peer, error = %e, "h2 connection ended with error");
            }
            return Served::Done;
        }
        match http_loop(tls, peer, &self, phase, &mut ctx).await {
            Ok(served) => served,
            Err(e) => {
                self.stats.io_errors.fetch_add(1, Relaxed);
                tracing::debug!(%peer, error = %e, "connection ended with error");
                Served::Done
            }
        }
    }
}

async fn http_loop(
    mut tls: TlsStream,
    peer: SocketAddr,
    shared: &Serve,
    phase: Phase<Parked>,
    ctx: &mut ConnContext,
) -> std::io::Result<Served<Parked>> {
    let args = &shared.args;
    // Starts small (most request heads are well under 1 KiB, nginx's client_header_buffer_size
    // too; this buffer lives as long as the connection) and grows up to the head limit only
    // for a request that needs it.
    let max_buf = shared.limits.max_head_bytes + 1024;
    // The deadline of what we are waiting for: the first byte of a request (idle timeout) or,
    // once it came, the end of the head (header timeout). Set once per phase, never per read,
    // so a client trickling a byte at a time cannot hold the connection past it.
    let (mut buf, mut used, mut deadline, park_when_waiting, mut responded) = match phase {
        Phase::Handshake => (vec![0u8; max_buf.min(1024)], 0, None, true, false),
        Phase::Moved(p) => (p.buf, p.used, p.deadline, false, p.responded),
    };
    // Looks at each byte of a head once; parses it a bounded number of times (not per read).
    let mut head = HeadReader::new();
    loop {
        let parsed = head.read(&buf[..used], &shared.limits, |b| {
            Ok(match parse_request(b, &shared.limits)? {
                Parsed::Complete { head_len, request } => Some((request, head_len)),
                Parsed::Incomplete => None,
            })
        });
        match parsed {
            Ok(Some((mut request, head_len))) => {
                shared.stats.requests.fetch_add(1, Relaxed);
                // Only with the access log: no clock read per request otherwise.
                let started = shared
                    .access_log
                    .as_ref()
                    .map(|_| tokio::time::Instant::now());
                if *ctx.stop.borrow() {
                    // Draining: answer this request with `Connection: close`, then close.
                    request.keep_alive = false;
                }
                let site = tls.info().site;
                let resp = if request
                    .host_name()
                    .is_some_and(|host| shared.names.lookup(host) != Some(site))
                {
                    // The Host belongs to another site (or none) than the one the TLS
                    // connection was set up for (RFC 9110 15.5.20).
                    error_response(421, request.keep_alive)
                } else {
                    respond(&request, &shared.roots[site], SystemTime::now())
                };
                count_status(&shared.stats, resp.status);
                let log = |tls: &TlsStream, sent: &std::io::Result<()>| {
                    if let (Some(log), Some(started)) = (&shared.access_log, started) {
                        let head = &buf[..head_len];
                        log.write(&Entry {
                            peer,
                            host: request.host.as_deref().map(str::as_bytes),
                            request: Some(RequestLine {
                                method: request.method.as_str(),
                                target: &request.target,
                                protocol: access_log::http1(request.minor_version),
                            }),
                            status: Some(resp.status),
                            bytes: if sent.is_ok() { body_len(&resp) } else { 0 },
                            duration: started.elapsed(),
                            user_agent: access_log::header(head, "user-agent"),
                            referer: access_log::header(head, "referer"),
                            plane: tls.plane().as_str(),
                            server_name: tls.info().server_name.as_deref(),
                            backend: None,
                            outcome: None,
                        });
                    }
                };
                if !std::mem::replace(&mut responded, true) {
                    shared
                        .ttfb
                        .observe(tls.info().accepted_at.elapsed().as_secs_f64());
                }
                if !resp.keep_alive {
                    // The line before the lingering close, which is no part of the response.
                    tls.final_writes();
                    let sent = Box::pin(send_response(&mut tls, &resp)).await;
                    log(&tls, &sent);
                    sent?;
                    return Box::pin(tls.close()).await.map(|()| Served::Done);
                }
                let sent = Box::pin(send_response(&mut tls, &resp)).await;
                log(&tls, &sent);
                sent?;
                buf.copy_within(head_len..used, 0);
                used -= head_len;
                deadline = None;
                if *ctx.stop.borrow() && used == 0 {
                    // Draining after SIGTERM: the response in flight is done, nothing else
                    // was asked for; end the connection with close_notify now (lingering: a
                    // request may be on its way).
                    return Box::pin(tls.close()).await.map(|()| Served::Done);
                }
            }
            Ok(None) => {
                if used == buf.len() && buf.len() < max_buf {
                    buf.resize((buf.len() * 2).min(max_buf), 0);
                }
                if used == buf.len() {
                    // The head reader enforces the head limit before this can happen; be safe.
                    let resp = error_response(431, false);
                    count_status(&shared.stats, 431);
                    return Box::pin(send_last_response(&mut tls, &resp))
                        .await
                        .map(|()| Served::Done);
                }
                let in_head = used > 0;
                let until = match deadline {
                    Some((phase, at)) if phase == in_head => at,
                    _ => {
                        let wait = if in_head {
                            args.header_timeout
                        } else {
                            args.server.idle_timeout
                        };
                        let at = tokio::time::Instant::now() + Duration::from_secs(wait);
                        deadline = Some((in_head, at));
                        at
                    }
                };
                if park_when_waiting && !tls.input_pending() {
                    // Waiting for the client (between requests, or for the rest of a head):
                    // wait on a connection loop, not on the handshake loop; for the first
                    // request, there too while that loop has no full handshake to run.
                    let wait = if responded || in_head {
                        FirstRequest::Move
                    } else {
                        ctx.first_request_here(&mut tls, until).await
                    };
                    match wait {
                        FirstRequest::Here => {}
                        FirstRequest::Move => {
                            let parked = Parked {
                                buf,
                                used,
                                deadline,
                                responded,
                            };
                            return Ok(Served::Park(tls, parked));
                        }
                        FirstRequest::Close => {
                            let _ = tls.shutdown().await;
                            return Ok(Served::Done);
                        }
                    }
                }
                let (stop, idle) = (&mut ctx.stop, &ctx.idle);
                let read = async {
                    // Boxed: the read's state (~4 KB with the planes' alert paths) would
                    // otherwise sit in every connection's task, idle or not.
                    let read = tokio::time::timeout_at(until, Box::pin(tls.read(&mut buf[used..])));
                    if in_head {
                        Some(read.await)
                    } else {
                        idle.wait(read).await
                    }
                };
                let read = tokio::select! {
                    r = read => match r {
                        Some(r) => r,
                        None => {
                            // Evicted to make room under --max-connections.
                            let _ = tls.shutdown().await;
                            return Ok(Served::Done);
                        }
                    },
                    _ = stop.changed(), if used == 0 && !*stop.borrow() => {
                        // Idle keep-alive connection during shutdown: close it now. The peer
                        // may be closing at the same moment (ENOTCONN): not an error of ours.
                        let _ = tls.shutdown().await;
                        return Ok(Served::Done);
                    }
                };
                match read {
                    Ok(Ok(0)) => {
                        // Peer finished (close_notify or FIN); answer its close_notify.
                        let _ = Box::pin(tls.close()).await;
                        return Ok(Served::Done);
                    }
                    Ok(Ok(n)) => used += n,
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        shared.stats.timeouts.fetch_add(1, Relaxed);
                        if used == 0 {
                            // Idle: nothing unread to linger for.
                            return tls.shutdown().await.map(|()| Served::Done);
                        }
                        let resp = error_response(408, false);
                        tls.final_writes();
                        let _ = Box::pin(send_response(&mut tls, &resp)).await;
                        return Box::pin(tls.close()).await.map(|()| Served::Done);
                    }
                }
                if *stop.borrow() && used == 0 {
                    return Box::pin(tls.close()).await.map(|()| Served::Done);
                }
            }
            Err(e) => {
                let status = e.status();
                count_status(&shared.stats, status);
                let started = shared
                    .access_log
                    .as_ref()
                    .map(|_| tokio::time::Instant::now());
                let resp = error_response(status, false);
                tls.final_writes();
                let sent = Box::pin(send_response(&mut tls, &resp)).await;
                if let (Some(log), Some(started)) = (&shared.access_log, started) {
                    // Refused unparsed: no request fields, the reason instead.
                    let why = e.to_string();
                    let bytes = if sent.is_ok() { body_len(&resp) } else { 0 };
                    log.write(&Entry::refused(
                        &tls,
                        peer,
                        status,
                        bytes,
                        started.elapsed(),
                        &why,
                    ));
                }
                sent?;
                return Box::pin(tls.close()).await.map(|()| Served::Done);
            }
        }
    }
}

/// Bytes of the response's body (what nginx's `$body_bytes_sent` counts once it is sent).
fn body_len(resp: &tlsplane_http::Response) -> u64 {
    match &resp.body {
        Body::Empty => 0,
        Body::Bytes(b) => b.len() as u64,
        Body::File { len, .. } => *len,
    }
}

fn count_status(stats: &HttpStats, status: u16) {
    match status {
        200..=299 => stats.responses_2xx.fetch_add(1, Relaxed),
        300..=399 => stats.responses_3xx.fetch_add(1, Relaxed),
        400..=499 => stats.responses_4xx.fetch_add(1, Relaxed),
        500..=599 => stats.responses_5xx.fetch_add(1, Relaxed),
        _ => {}
    }
}

/// The connection's last response: it, the close_notify and the FIN leave together (see
/// `TlsStream::final_writes`); then a lingering close (the client may have sent more, e.g. a
/// pipelined request, which a plain close would answer with a reset that cuts the response).
async fn send_last_response(
    tls: &mut TlsStream,
    resp: &tlsplane_http::Response,
) -> std::io::Result<()> {
    tls.final_writes();
    send_response(tls, resp).await?;
    tls.close().await
}

/// (Callers box this future: its state, several KB for a file, is needed only while sending,
/// and inline it would make every idle keep-alive connection's task that large.)
async fn send_response(tls: &mut TlsStream, resp: &tlsplane_http::Response) -> std::io::Result<()> {
    match &resp.body {
        Body::Empty => tls.write_all(&resp.head).await,
        Body::Bytes(b) => {
            let mut all = Vec::with_capacity(resp.head.len() + b.len());
            all.extend_from_slice(&resp.head);
            all.extend_from_slice(b);
            tls.write_all(&all).await
        }
        Body::File { file, offset, len } => tls.write_file(&resp.head, file, *offset, *len).await,
    }
}
