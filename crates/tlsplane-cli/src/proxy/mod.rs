//! `tlsplane proxy`: TLS termination in front of a plain TCP (or Unix socket) backend.
//!
//! Listeners, handshakes, sites, keys and reload are the shared server's (`tlsplane_server::server`);
//! this module picks a backend for each established connection and moves bytes both ways
//! unchanged (TCP mode, the hitch/stunnel model), keeping half-closes: the client's
//! close_notify becomes `shutdown(SHUT_WR)` towards the backend, the backend's EOF becomes a
//! close_notify to the client, and a reset on either side resets the other.

pub(crate) mod backend;
mod h1_to_h2c;
mod h2;
mod h2c;
mod http;
pub mod proxy_protocol;
pub(crate) mod tcp;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use tlsplane::stats::Counter;
use tlsplane::TlsStream;

use backend::{BackendConn, Io, Pool};
use proxy_protocol::TlsFacts;
use tcp::{relay, Pipes};
pub use tlsplane_server::config::BackendProtocol;
use tlsplane_server::config::{Backend, Origin, SiteNeeds, Sites};
use tlsplane_server::runtime::{ConnContext, Handler, Phase, RuntimeStats, Served};
use tlsplane_server::server::{Product, ServerArgs};

#[derive(Args, Debug, Clone)]
pub struct ProxyArgs {
    /// Backend to forward to: HOST:PORT or unix:PATH. Repeat for several (round robin; one
    /// that fails to connect is skipped for --backend-down-time). With --config, sites name
    /// their own (`to = [...]`) and these serve the sites that do not.
    #[arg(long = "to", value_name = "HOST:PORT|unix:PATH")]
    pub to: Vec<Backend>,
    /// tcp: bytes both ways unchanged (spliced on the kernel plane). http: an HTTP/1.1
    /// reverse proxy (heads parsed and rewritten, keep-alive to clients and backends).
    #[arg(long, value_enum, default_value_t = Mode::Tcp)]
    pub mode: Mode,
    /// HTTP mode: what the proxy speaks to backends (with --config, to those of the sites
    /// that do not say: a site's `backend-protocol`). http1: HTTP/1.1 (keep-alive pool), for
    /// HTTP/1.1 and h2 clients alike. h2c: cleartext HTTP/2 (prior knowledge), many streams on
    /// one connection per backend, trailers relayed: gRPC end to end. An HTTP/1.1 client's
    /// request becomes an h2 stream too (its body as DATA, the response chunked with its
    /// trailers when the client sent `TE: trailers`); the ALPN offered becomes `h2, http/1.1,
    /// http/1.0` unless --alpn (or the site's `alpn`) says otherwise.
    #[arg(long, value_enum, default_value_t = BackendProtocol::Http1)]
    pub backend_protocol: BackendProtocol,
    /// HTTP mode: the client's own Forwarded / X-Forwarded-For / X-Forwarded-Proto fields are
    /// replaced by the proxy's (replace; X-Real-IP, X-Forwarded-Host, X-Forwarded-Port and the
    /// spellings with `_` such as X_Forwarded_For are dropped too), kept with the proxy's added
    /// after them (append: a trusted proxy stands in front), or passed through with none added
    /// (off).
    #[arg(long, value_enum, default_value_t = ForwardedArg::Replace)]
    pub forwarded: ForwardedArg,
    /// HTTP mode: seconds from the first byte of a request to the end of its head.
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// HTTP mode: seconds to wait for the backend to take each write of the request, for the
    /// response head once the request body has ended, and between reads of the response body
    /// (504 before the response begins).
    #[arg(long, default_value_t = 60)]
    pub backend_timeout: u64,
    /// HTTP mode: seconds a request may take in all, from the end of its head to the end of
    /// its response (0: no total, each wait is bounded by its own timeout). Past it: 408 while
    /// the client is still sending its body, 504 while the backend has not answered, a reset
    /// once the response has begun.
    #[arg(long, default_value_t = 0)]
    pub request_timeout: u64,
    /// HTTP mode: idle keep-alive connections kept per backend per worker (0: a new backend
    /// connection for every request).
    #[arg(long, default_value_t = 32)]
    pub backend_keepalive: usize,
    /// HTTP mode: seconds an idle backend connection is kept for reuse.
    #[arg(long, default_value_t = 30)]
    pub backend_idle_timeout: u64,
    /// Send a PROXY protocol header (v1: text; v2: binary, with the ALPN, the server name and
    /// the TLS version and cipher) to the backend before the client's bytes.
    #[arg(long, value_name = "v1|v2")]
    pub proxy_protocol: Option<proxy_protocol::Version>,
    /// Seconds to wait for a backend to accept a connection before trying the next.
    #[arg(long, default_value_t = 5)]
    pub connect_timeout: u64,
    /// Connections open to one backend at most, across workers, idle keep-alive ones
    /// included (0: no limit). A worker that finds a backend at its limit while other workers
    /// hold idle connections to it has one of those closed and takes its place; a backend at
    /// its limit with none idle is passed over; when all are, the client gets 503 (HTTP
    /// mode) or is closed (TCP mode).
    #[arg(long, default_value_t = 0)]
    pub backend_max_connections: usize,
    /// Seconds a backend that refused or timed out is left out of the rotation (0: never).
    #[arg(long, default_value_t = 10)]
    pub backend_down_time: u64,
    /// Bytes buffered per direction per connection (the most read from one side before it
    /// is written to the other).
    #[arg(long, default_value_t = 16384, value_parser = clap::value_parser!(u32).range(1024..=1048576))]
    pub buffer: u32,
    #[command(flatten)]
    pub server: ServerArgs,
}

/// What the proxy forwards.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Tcp,
    Http,
}

/// ALPN of sites whose backends speak h2c when --alpn and the site's `alpn` do not say: h2
/// first (an h2 client's streams go to the backend as they are), then HTTP/1 (each request
/// made a stream).
const H2C_SITE_ALPN: [&[u8]; 3] = [b"h2", b"http/1.1", b"http/1.0"];

/// `--forwarded`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardedArg {
    Replace,
    Append,
    Off,
}

/// The backends of `args` as the default for sites of a configuration file.
pub fn site_needs(args: &ProxyArgs) -> SiteNeeds {
    SiteNeeds::Backends {
        default: args.to.clone(),
        protocol: (args.mode == Mode::Http).then_some(args.backend_protocol),
    }
}

/// Proxy counters, kept across reloads.
#[derive(Default)]
pub struct ProxyStats {
    connections: Counter,
    /// Connections that reached a backend.
    forwarded: Counter,
    /// Connects to a backend that failed or timed out (each attempt).
    backend_connect_failures: Counter,
    /// Connections closed because no backend would take them.
    no_backend: Counter,
    /// Backends passed over at their --backend-max-connections.
    backend_full: Counter,
    /// Idle backend connections closed in one worker to make room under
    /// --backend-max-connections for a request in another.
    backend_idle_evicted: Counter,
    /// Connections ended by an error on the client's side (a reset, a bad record).
    client_errors: Counter,
    /// Connections ended by an error on the backend's side (a reset).
    backend_errors: Counter,
    /// Connections closed after --idle-timeout with no byte moving.
    idle_timeouts: Counter,
    pub(crate) bytes_to_backend_copied: Counter,
    /// Responses a backend began before it had the whole request body (the rest of the
    /// body was not sent, the client's connection closed after the response).
    early_responses: Counter,
    pub(crate) bytes_to_client_copied: Counter,
    bytes_to_backend_spliced: Counter,
    bytes_to_client_spliced: Counter,
    /// HTTP mode: requests read from clients.
    http_requests: Counter,
    /// HTTP mode: requests the proxy answered itself with a 4xx (malformed, smuggling
    /// attempts, misdirected, timed out).
    http_refused: Counter,
    /// HTTP mode: 502 answers (backend failed or sent no valid response).
    http_502: Counter,
    /// HTTP mode: 504 answers (no response within --backend-timeout).
    http_504: Counter,
    /// HTTP mode: requests past --request-timeout (answered 408 or 504, or reset).
    request_timeouts: Counter,
    /// HTTP mode: requests sent on a kept-alive backend connection.
    backend_reused: Counter,
    /// HTTP mode: requests sent again on a new connection after a reused one was closed.
    backend_retries: Counter,
    /// HTTP mode: connections switched to TCP mode by `101 Switching Protocols`.
    upgrades: Counter,
    /// HTTP mode, h2 clients: connections (by ALPN), streams, GOAWAYs by reason, stalls,
    /// evictions (as `proxy_h2_*`).
    pub(crate) h2: crate::h2_connection::H2Stats,
    /// HTTP mode: h2 streams reset by the proxy after their response had begun (the
    /// backend failed or timed out midway; the h2 form of HTTP/1.1's connection reset).
    h2_streams_reset: Counter,
    /// h2c backend connections opened (each carries many streams).
    h2c_connections: Counter,
    /// HTTP mode: CONNECT requests refused with 405, from HTTP/1.1 and h2 clients (the proxy
    /// tunnels nothing but a websocket after its backend's 101; counted in `http_refused`
    /// too).
    connect_refused: Counter,
    /// HTTP mode: responses sent to clients (the backends' and the proxy's own), by status
    /// class, as serve counts its own (`tlsplane_http_responses_total{class}`).
    responses_2xx: Counter,
    responses_3xx: Counter,
    responses_4xx: Counter,
    responses_5xx: Counter,
}

impl ProxyStats {
    fn count_status(&self, status: u16) {
        let class = match status {
            200..=299 => &self.responses_2xx,
            300..=399 => &self.responses_3xx,
            400..=499 => &self.responses_4xx,
            500..=599 => &self.responses_5xx,
            _ => return,
        };
        class.fetch_add(1, Relaxed);
    }
}

/// A client connection's responses as they begin (HTTP mode): counted by status class, and
/// the first one's time from accept observed as the connection's time to first byte
/// (`tlsplane_time_to_first_byte_seconds`), as serve observes it.
pub(crate) struct Responses<'a> {
    proxy: &'a Proxy,
    accepted_at: std::time::Instant,
    /// The connection has had a response (its time to first byte is recorded).
    responded: AtomicBool,
}

impl<'a> Responses<'a> {
    pub(crate) fn new(proxy: &'a Proxy, info: &tlsplane::ConnectionInfo) -> Self {
        Responses {
            proxy,
            accepted_at: info.accepted_at,
            responded: AtomicBool::new(false),
        }
    }

    /// A response with `status` begins to go to the client (its head, or an interim one's).
    pub(crate) fn begin(&self, status: u16) {
        if !self.responded.swap(true, Relaxed) {
            let waited = self.accepted_at.elapsed().as_secs_f64();
            self.proxy.ttfb.observe(waited);
        }
        self.proxy.stats.count_status(status);
    }
}

/// The `proxy` product under one configuration.
pub struct Proxy {
    /// By site number.
    pools: Vec<Pool>,
    /// What each site's backends speak (HTTP mode), by site number.
    protocols: Vec<BackendProtocol>,
    names: Arc<tlsplane::sites::SiteNames>,
    forwarded: tlsplane_http::forward::ForwardedPolicy,
    args: ProxyArgs,
    stats: Arc<ProxyStats>,
    /// Opened again with each generation (a reload re-opens the file).
    access_log: Option<tlsplane_server::access_log::AccessLog>,
    /// Time to the first byte of a connection's first response (shared with /metrics).
    ttfb: prometheus_client::metrics::histogram::Histogram,
}

impl Product for Proxy {
    type Args = ProxyArgs;
    type Stats = ProxyStats;
    const COMMAND: &'static str = "proxy";

    fn server(args: &ProxyArgs) -> &ServerArgs {
        &args.server
    }

    fn site_needs(args: &ProxyArgs) -> SiteNeeds {
        site_needs(args)
    }

    /// HTTP mode speaks HTTP/1, and h2 when the operator names it in --alpn (or a site's
    /// `alpn`), as `serve` does; a site with h2c backends offers h2 first by default. TCP mode does not
    /// know what it carries, so it offers no ALPN unless told (a client offering any, or none,
    /// is served).
    fn alpn(args: &ProxyArgs) -> tlsplane_server::server::Alpn {
        use tlsplane_server::server::{Alpn, HTTP1_ALPN, SERVE_ALPN};
        let flag = args.server.alpn.as_deref();
        if args.mode != Mode::Http {
            return Alpn::new(flag, &[], None);
        }
        let mut alpn = Alpn::new(flag, &HTTP1_ALPN, Some(&SERVE_ALPN));
        if flag.is_none() {
            alpn.h2c_default = Some(H2C_SITE_ALPN.iter().map(|p| p.to_vec()).collect());
        }
        alpn
    }

    fn check_args(args: &ProxyArgs, with_config: bool) -> anyhow::Result<()> {
        if args.to.is_empty() && !with_config {
            anyhow::bail!("no backend: give --to HOST:PORT (or unix:PATH), or --config");
        }
        if args.mode == Mode::Http && args.proxy_protocol.is_some() {
            // Backend connections are reused across clients in HTTP mode: a PROXY header
            // names one client per connection. Forwarded / X-Forwarded-For name each.
            anyhow::bail!("--proxy-protocol is for --mode tcp; HTTP mode sends the client address in Forwarded and X-Forwarded-For");
        }
        if args.mode != Mode::Http && args.backend_protocol != BackendProtocol::Http1 {
            anyhow::bail!(
                "--backend-protocol is for --mode http (TCP mode forwards bytes unchanged)"
            );
        }
        Ok(())
    }

    fn flag_origin(args: &ProxyArgs) -> anyhow::Result<Origin> {
        Ok(Origin::Backends {
            to: args.to.clone(),
            protocol: args.backend_protocol,
        })
    }

    fn build(
        args: &ProxyArgs,
        sites: Sites,
        stats: &Arc<ProxyStats>,
        runtime: &Arc<RuntimeStats>,
    ) -> anyhow::Result<Self> {
        let mut pools = Vec::new();
        let mut protocols = Vec::new();
        for s in sites.serve {
            match s.origin {
                Origin::Backends { to, protocol } => {
                    pools.push(Pool::new(to)?);
                    protocols.push(protocol);
                }
                _ => anyhow::bail!("site {}: no backends", s.label),
            }
        }
        use tlsplane_http::forward::ForwardedPolicy;
        Ok(Self {
            pools,
            protocols,
            names: sites.names,
            forwarded: match args.forwarded {
                ForwardedArg::Replace => ForwardedPolicy::Replace,
                ForwardedArg::Append => ForwardedPolicy::Append,
                ForwardedArg::Off => ForwardedPolicy::Off,
            },
            args: args.clone(),
            stats: stats.clone(),
            access_log: args.server.access_log()?,
            ttfb: runtime.histograms.first_response.clone(),
        })
    }

    /// The client's socket and its backend's; in TCP mode on the kernel plane, two pipes
    /// more while the relay splices.
    fn descriptors_per_connection(args: &ProxyArgs, kernel_plane: bool) -> usize {
        if args.mode == Mode::Tcp && kernel_plane {
            6
        } else {
            2
        }
    }

    fn counters(p: &ProxyStats, r: &RuntimeStats) -> Vec<(&'static str, u64)> {
        vec![
            ("proxy_connections", r.connections.load(Relaxed)),
            ("proxy_handshake_errors", r.handshake_errors.load(Relaxed)),
            (
                "proxy_handshake_timeouts",
                r.handshake_timeouts.load(Relaxed),
            ),
            ("proxy_established", p.connections.load(Relaxed)),
            ("proxy_forwarded", p.forwarded.load(Relaxed)),
            (
                "proxy_backend_connect_failures",
                p.backend_connect_failures.load(Relaxed),
            ),
            ("proxy_no_backend", p.no_backend.load(Relaxed)),
            ("proxy_backend_full", p.backend_full.load(Relaxed)),
            (
                "proxy_backend_idle_evicted",
                p.backend_idle_evicted.load(Relaxed),
            ),
            ("proxy_client_errors", p.client_errors.load(Relaxed)),
            ("proxy_backend_errors", p.backend_errors.load(Relaxed)),
            ("proxy_idle_timeouts", p.idle_timeouts.load(Relaxed)),
            ("proxy_early_responses", p.early_responses.load(Relaxed)),
            (
                "proxy_bytes_to_backend_copied",
                p.bytes_to_backend_copied.load(Relaxed),
            ),
            (
                "proxy_bytes_to_client_copied",
                p.bytes_to_client_copied.load(Relaxed),
            ),
            (
                "proxy_bytes_to_backend_spliced",
                p.bytes_to_backend_spliced.load(Relaxed),
            ),
            (
                "proxy_bytes_to_client_spliced",
                p.bytes_to_client_spliced.load(Relaxed),
            ),
            ("proxy_http_requests", p.http_requests.load(Relaxed)),
            ("proxy_http_refused", p.http_refused.load(Relaxed)),
            ("proxy_http_502", p.http_502.load(Relaxed)),
            ("proxy_http_504", p.http_504.load(Relaxed)),
            ("proxy_request_timeouts", p.request_timeouts.load(Relaxed)),
            ("proxy_backend_reused", p.backend_reused.load(Relaxed)),
            ("proxy_backend_retries", p.backend_retries.load(Relaxed)),
            ("proxy_upgrades", p.upgrades.load(Relaxed)),
            ("proxy_h2_streams_reset", p.h2_streams_reset.load(Relaxed)),
            ("proxy_h2c_connections", p.h2c_connections.load(Relaxed)),
            ("proxy_connect_refused", p.connect_refused.load(Relaxed)),
            // serve's names: one `tlsplane_http_responses_total{class}` for either product.
            ("http_responses_2xx", p.responses_2xx.load(Relaxed)),
            ("http_responses_3xx", p.responses_3xx.load(Relaxed)),
            ("http_responses_4xx", p.responses_4xx.load(Relaxed)),
            ("http_responses_5xx", p.responses_5xx.load(Relaxed)),
        ]
        .into_iter()
        .chain(p.h2.counters(&crate::h2_connection::H2Stats::PROXY))
        .collect()
    }

    fn describe(args: &ProxyArgs, sites: &Sites) {
        let mut all: Vec<String> = Vec::new();
        for s in &sites.serve {
            if let Origin::Backends { to, protocol } = &s.origin {
                let spoken = match (args.mode, protocol) {
                    (Mode::Tcp, _) => "",
                    (Mode::Http, BackendProtocol::Http1) => " (HTTP/1.1)",
                    (Mode::Http, BackendProtocol::H2c) => " (h2c)",
                };
                all.extend(to.iter().map(|b| format!("{b}{spoken}")));
            }
        }
        all.dedup();
        tracing::info!(
            "proxy: {} to {}{}",
            match args.mode {
                Mode::Tcp => "TCP",
                Mode::Http => "HTTP",
            },
            all.join(", "),
            match args.proxy_protocol {
                Some(v) => format!(" (PROXY protocol {v:?})"),
                None => String::new(),
            }
        );
    }
}

impl Handler for Proxy {
    type Parked = ();

    async fn serve(
        self: Arc<Self>,
        tls: TlsStream,
        peer: SocketAddr,
        phase: Phase<()>,
        mut ctx: ConnContext,
    ) -> Served<()> {
        if let Phase::Handshake = phase {
            // Connecting to a backend and relaying are waits: off the handshake loop.
            return Served::Park(tls, ());
        }
        self.stats.connections.fetch_add(1, Relaxed);
        match self.args.mode {
            Mode::Tcp => {
                // Only with the access log: no clock read or copy per connection otherwise.
                let logged = self.access_log.as_ref().map(|log| {
                    let name = tls.info().server_name.clone();
                    (log, Instant::now(), tls.plane().as_str(), name)
                });
                let outcome = self.forward(tls, peer).await;
                if let Some((log, started, plane, name)) = logged {
                    let outcome = format!("{outcome:?}");
                    log.write(&tlsplane_server::access_log::Entry {
                        peer,
                        host: None,
                        request: None,
                        status: None,
                        bytes: 0,
                        duration: started.elapsed(),
                        user_agent: None,
                        referer: None,
                        plane,
                        server_name: name.as_deref(),
                        backend: None,
                        outcome: Some(&outcome),
                    });
                }
            }
            Mode::Http if tls.info().alpn.as_deref() == Some(b"h2".as_slice()) => {
                // h2 and its buffers only once the client asks for something.
                let mut tls = tls;
                let opening = crate::h2_connection::Opening {
                    header_timeout: Duration::from_secs(self.args.header_timeout),
                    idle_timeout: Duration::from_secs(self.args.server.idle_timeout),
                    stop: &mut ctx.stop,
                    idle: &ctx.idle,
                    stats: &self.stats.h2,
                    header_timeouts: &self.stats.http_refused,
                    timeouts: &self.stats.idle_timeouts,
                };
                // Boxed, and gone once h2 starts: not carried by every connection's task.
                let opened = Box::pin(crate::h2_connection::open(&mut tls, opening)).await;
                match opened {
                    // One access-log line per stream (h2.rs). Boxed: HTTP/1.1 connections'
                    // futures, and h2 connections' openings, do not carry h2's state.
                    Ok(Some(woken)) => {
                        let _ = Box::pin(h2::serve(&self, tls, woken, peer, &mut ctx)).await;
                    }
                    Ok(None) => {
                        let _ = Box::pin(tls.close()).await;
                    }
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "h2 client connection failed");
                        self.stats.client_errors.fetch_add(1, Relaxed);
                    }
                }
            }
            Mode::Http => {
                // One access-log line per request (http.rs).
                let mut tls = tls;
                let _ = http::serve(&self, &mut tls, peer, &mut ctx).await;
            }
        }
        Served::Done
    }
}

/// Why no backend took a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unavailable {
    /// None could be connected to.
    Down,
    /// Some were at --backend-max-connections (and the others down).
    Full,
}

/// How a proxied connection ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// Both directions reached their end.
    Closed,
    NoBackend,
    ClientError,
    BackendError,
    IdleTimeout,
}

impl Proxy {
    /// One attempt to connect to backend `i` of `site`; a failure marks it down.
    async fn connect_to(&self, site: usize, i: usize, slot: backend::Slot) -> Option<BackendConn> {
        let pool = &self.pools[site];
        let backend = &pool.backends[i];
        let timeout = Duration::from_secs(self.args.connect_timeout.max(1));
        let attempt = async {
            match backend {
                Backend::Tcp(_) => {
                    let mut failed = None;
                    for (j, addr) in pool.addrs(i) {
                        match tokio::net::TcpStream::connect(addr).await {
                            Ok(s) => {
                                pool.connected_at(i, j);
                                s.set_nodelay(true)?;
                                return Ok::<_, std::io::Error>(Io::Tcp(s));
                            }
                            Err(e) => failed = Some(e),
                        }
                    }
                    Err(failed.unwrap_or_else(|| std::io::ErrorKind::AddrNotAvailable.into()))
                }
                Backend::Unix(p) => Ok(Io::Unix(tokio::net::UnixStream::connect(p).await?)),
            }
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(io)) => return Some(BackendConn::new(io, slot)),
            Ok(Err(e)) => {
                tracing::warn!(%backend, error = %e, "backend connect failed; trying the next");
            }
            Err(_) => {
                tracing::warn!(%backend, "backend connect timed out; trying the next");
            }
        }
        self.stats.backend_connect_failures.fetch_add(1, Relaxed);
        pool.mark_down(i, Duration::from_secs(self.args.backend_down_time));
        None
    }

    /// A connection to one of `site`'s backends, in rotation: with `reuse`, an idle
    /// keep-alive one when this thread holds one for the backend whose turn it is. Returns
    /// the backend's number and whether the connection was reused.
    async fn backend_for(
        &self,
        site: usize,
        reuse: bool,
    ) -> Result<(BackendConn, usize, bool), Unavailable> {
        let pool = &self.pools[site];
        let max_idle = Duration::from_secs(self.args.backend_idle_timeout);
        let mut full = false;
        for i in pool.order() {
            if reuse {
                if let Some(conn) = pool.take_idle(i, max_idle) {
                    return Ok((conn, i, true));
                }
            }
            let wait = Duration::from_secs(self.args.connect_timeout);
            let max = self.args.backend_max_connections;
            let evicted = &self.stats.backend_idle_evicted;
            let Some(slot) = pool.slot_or_evict(i, max, wait, evicted).await else {
                self.stats.backend_full.fetch_add(1, Relaxed);
                full = true;
                continue;
            };
            if let Some(conn) = self.connect_to(site, i, slot).await {
                return Ok((conn, i, false));
            }
        }
        Err(if full {
            Unavailable::Full
        } else {
            Unavailable::Down
        })
    }

    /// (In-flight connections during a shutdown go on until the shutdown grace ends them.)
    async fn forward(&self, mut tls: TlsStream, peer: SocketAddr) -> Ended {
        let site = tls.info().site;
        let Ok((backend, _, _)) = self.backend_for(site, false).await else {
            self.stats.no_backend.fetch_add(1, Relaxed);
            // Nothing was forwarded: tell the client the service is not there rather than
            // leave it waiting (close_notify, then FIN; lingering over what it sent already).
            let _ = Box::pin(tls.close()).await;
            return Ended::NoBackend;
        };
        self.stats.forwarded.fetch_add(1, Relaxed);
        if let Some(version) = self.args.proxy_protocol {
            let info = tls.info();
            let suite = proxy_protocol::cipher_name(info.suite);
            let tls_version = match info.version {
                rustls::ProtocolVersion::TLSv1_3 => "TLSv1.3",
                rustls::ProtocolVersion::TLSv1_2 => "TLSv1.2",
                _ => "TLS",
            };
            let local = tls.tcp().local_addr().unwrap_or(peer);
            let facts = TlsFacts {
                alpn: info.alpn.as_deref(),
                server_name: info.server_name.as_deref(),
                version: Some(tls_version),
                cipher: Some(&suite),
            };
            let header = proxy_protocol::header(version, peer, local, &facts);
            if backend.write_all(&header).await.is_err() {
                self.stats.backend_errors.fetch_add(1, Relaxed);
                reset(&tls);
                return Ended::BackendError;
            }
        }
        // The kernel plane moves bytes by splice when pipes can be had (they cost two
        // descriptors each: at the fd limit, copying still works).
        let pipes = if tls.can_splice() {
            match Pipes::new() {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::debug!(error = %e, "no pipes for splice; copying instead");
                    None
                }
            }
        } else {
            None
        };
        let ended = relay(
            &mut tls,
            &backend,
            pipes.as_ref(),
            self.args.buffer as usize,
            Duration::from_secs(self.args.server.idle_timeout),
            &self.stats,
        )
        .await;
        self.settle(ended, &mut tls, &backend).await
    }

    /// Counts how a relay ended and passes a reset on to the other side.
    async fn settle(&self, ended: Ended, tls: &mut TlsStream, backend: &BackendConn) -> Ended {
        match ended {
            Ended::ClientError => {
                self.stats.client_errors.fetch_add(1, Relaxed);
                backend.reset_on_close();
            }
            Ended::BackendError => {
                self.stats.backend_errors.fetch_add(1, Relaxed);
                reset(tls);
            }
            Ended::IdleTimeout => {
                self.stats.idle_timeouts.fetch_add(1, Relaxed);
                let _ = Box::pin(tls.close()).await;
            }
            // Lingering: the client may still be sending (the backend ended first).
            Ended::Closed => {
                let _ = Box::pin(tls.close()).await;
            }
            _ => {}
        }
        ended
    }
}

/// Ends the client's connection with a TCP reset (the backend reset its side: the client must
/// not mistake the truncated stream for a complete one).
fn reset(tls: &TlsStream) {
    let _ = socket2::SockRef::from(tls.tcp()).set_linger(Some(Duration::ZERO));
}
