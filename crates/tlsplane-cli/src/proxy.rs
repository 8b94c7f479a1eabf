//! `tlsplane proxy`: TLS termination in front of a plain TCP (or Unix socket) backend.
//!
//! Listeners, handshakes, sites, keys and reload are the shared server's (`crate::server`);
//! this module picks a backend for each established connection and moves bytes both ways
//! unchanged (TCP mode, the hitch/stunnel model), keeping half-closes: the client's
//! close_notify becomes `shutdown(SHUT_WR)` towards the backend, the backend's EOF becomes a
//! close_notify to the client, and a reset on either side resets the other.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use tlsplane::TlsStream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::config::{Origin, SiteNeeds, Sites};
use crate::proxy_protocol::{self, TlsFacts};
use crate::runtime::{ConnContext, Handler, Phase, RuntimeStats, Served};
use crate::server::{Product, ServerArgs};

#[derive(Args, Debug, Clone)]
pub struct ProxyArgs {
    /// Backend to forward to: HOST:PORT or unix:PATH. Repeat for several (round robin; one
    /// that fails to connect is skipped for --backend-down-time). With --config, sites name
    /// their own (`to = [...]`) and these serve the sites that do not.
    #[arg(long = "to", value_name = "HOST:PORT|unix:PATH")]
    pub to: Vec<Backend>,
    /// Send a PROXY protocol header (v1: text; v2: binary, with the ALPN, the server name and
    /// the TLS version and cipher) to the backend before the client's bytes.
    #[arg(long, value_name = "v1|v2")]
    pub proxy_protocol: Option<proxy_protocol::Version>,
    /// Seconds to wait for a backend to accept a connection before trying the next.
    #[arg(long, default_value_t = 5)]
    pub connect_timeout: u64,
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

/// Where a proxy forwards a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `HOST:PORT`, resolved at each connect.
    Tcp(String),
    Unix(PathBuf),
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Tcp(a) => f.write_str(a),
            Backend::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse_in(s, None)
    }
}

impl Backend {
    /// Parses `HOST:PORT` or `unix:PATH`; a relative PATH is relative to `base` if given
    /// (a configuration file's directory).
    pub fn parse_in(s: &str, base: Option<&Path>) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a path".into());
            }
            let p = Path::new(path);
            return Ok(Backend::Unix(match base {
                Some(dir) if p.is_relative() => dir.join(p),
                _ => p.to_path_buf(),
            }));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?}: expected HOST:PORT or unix:PATH"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{s:?}: no host"));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => Ok(Backend::Tcp(s.to_string())),
            _ => Err(format!("{s:?}: {port:?} is not a port")),
        }
    }
}

/// The backends of `args` as the default for sites of a configuration file.
pub fn site_needs(args: &ProxyArgs) -> SiteNeeds {
    SiteNeeds::Backends {
        default: args.to.clone(),
    }
}

/// Proxy counters, kept across reloads.
#[derive(Default)]
pub struct ProxyStats {
    connections: AtomicU64,
    /// Connections that reached a backend.
    forwarded: AtomicU64,
    /// Connects to a backend that failed or timed out (each attempt).
    backend_connect_failures: AtomicU64,
    /// Connections closed because no backend would take them.
    no_backend: AtomicU64,
    /// Connections ended by an error on the client's side (a reset, a bad record).
    client_errors: AtomicU64,
    /// Connections ended by an error on the backend's side (a reset).
    backend_errors: AtomicU64,
    /// Connections closed after --idle-timeout with no byte moving.
    idle_timeouts: AtomicU64,
    bytes_to_backend_copied: AtomicU64,
    bytes_to_client_copied: AtomicU64,
}

/// One site's backends, in rotation, with what passive health checking learnt.
struct Pool {
    backends: Vec<Backend>,
    next: AtomicUsize,
    /// By backend: left out of the rotation until then.
    down_until: Vec<Mutex<Option<Instant>>>,
}

impl Pool {
    fn new(backends: Vec<Backend>) -> Self {
        let down_until = backends.iter().map(|_| Mutex::new(None)).collect();
        Self {
            backends,
            next: AtomicUsize::new(0),
            down_until,
        }
    }

    fn is_down(&self, i: usize, now: Instant) -> bool {
        let g = self.down_until[i].lock().unwrap_or_else(|e| e.into_inner());
        g.is_some_and(|until| until > now)
    }

    fn mark_down(&self, i: usize, for_: Duration) {
        if for_.is_zero() {
            return;
        }
        *self.down_until[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + for_);
    }

    /// The order to try backends in for one connection: from the next in rotation, those up
    /// first, then those marked down (a last resort rather than no service at all).
    fn order(&self) -> Vec<usize> {
        let n = self.backends.len();
        let start = self.next.fetch_add(1, Relaxed);
        let now = Instant::now();
        let (mut up, down): (Vec<usize>, Vec<usize>) = (0..n)
            .map(|k| (start + k) % n)
            .partition(|&i| !self.is_down(i, now));
        up.extend(down);
        up
    }
}

/// The `proxy` product under one configuration.
pub struct Proxy {
    /// By site number.
    pools: Vec<Pool>,
    args: ProxyArgs,
    stats: Arc<ProxyStats>,
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

    fn flag_origin(args: &ProxyArgs) -> anyhow::Result<Origin> {
        if args.to.is_empty() {
            anyhow::bail!("no backend: give --to HOST:PORT (or unix:PATH), or --config");
        }
        Ok(Origin::Backends(args.to.clone()))
    }

    fn build(
        args: &ProxyArgs,
        sites: Sites,
        stats: &Arc<ProxyStats>,
        _runtime: &Arc<RuntimeStats>,
    ) -> anyhow::Result<Self> {
        let pools = sites
            .serve
            .into_iter()
            .map(|s| match s.origin {
                Origin::Backends(b) => Ok(Pool::new(b)),
                Origin::Root(_) => Err(anyhow::anyhow!("site {}: no backends", s.label)),
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            pools,
            args: args.clone(),
            stats: stats.clone(),
        })
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
            ("proxy_client_errors", p.client_errors.load(Relaxed)),
            ("proxy_backend_errors", p.backend_errors.load(Relaxed)),
            ("proxy_idle_timeouts", p.idle_timeouts.load(Relaxed)),
            (
                "proxy_bytes_to_backend_copied",
                p.bytes_to_backend_copied.load(Relaxed),
            ),
            (
                "proxy_bytes_to_client_copied",
                p.bytes_to_client_copied.load(Relaxed),
            ),
        ]
    }

    fn describe(args: &ProxyArgs, sites: &Sites) {
        let mut all: Vec<String> = Vec::new();
        for s in &sites.serve {
            if let Origin::Backends(b) = &s.origin {
                all.extend(b.iter().map(|b| b.to_string()));
            }
        }
        all.dedup();
        eprintln!(
            "proxy: TCP to {}{}",
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
        _ctx: ConnContext,
    ) -> Served<()> {
        if let Phase::Handshake = phase {
            // Connecting to a backend and relaying are waits: off the handshake loop.
            return Served::Park(tls, ());
        }
        self.stats.connections.fetch_add(1, Relaxed);
        let started = Instant::now();
        let outcome = self.forward(tls, peer).await;
        if self.args.server.access_log {
            tracing::info!(%peer, outcome = ?outcome, secs = started.elapsed().as_secs_f64(), "proxied");
        }
        Served::Done
    }
}

/// How a proxied connection ended.
#[derive(Debug)]
enum Ended {
    /// Both directions reached their end.
    Closed,
    NoBackend,
    ClientError,
    BackendError,
    IdleTimeout,
}

/// What the client → backend half of the relay did.
enum Up {
    Read(std::io::Result<usize>),
    Wrote(std::io::Result<usize>),
}

/// A connected backend, whichever kind.
enum BackendConn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl BackendConn {
    /// Makes the close that follows a reset (the client reset: the backend must not take
    /// the truncated stream for a complete one).
    fn reset_on_close(&self) {
        let r = match self {
            BackendConn::Tcp(s) => socket2::SockRef::from(s).set_linger(Some(Duration::ZERO)),
            // A Unix stream has no reset; its close is an EOF.
            BackendConn::Unix(_) => Ok(()),
        };
        if let Err(e) = r {
            tracing::debug!(error = %e, "SO_LINGER on the backend socket failed");
        }
    }
}

impl AsyncRead for BackendConn {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            BackendConn::Tcp(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            BackendConn::Unix(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for BackendConn {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            BackendConn::Tcp(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            BackendConn::Unix(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            BackendConn::Tcp(s) => std::pin::Pin::new(s).poll_flush(cx),
            BackendConn::Unix(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            BackendConn::Tcp(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            BackendConn::Unix(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Proxy {
    async fn connect(&self, site: usize) -> Option<(BackendConn, &Backend)> {
        let pool = &self.pools[site];
        let timeout = Duration::from_secs(self.args.connect_timeout.max(1));
        for i in pool.order() {
            let backend = &pool.backends[i];
            let attempt = async {
                match backend {
                    Backend::Tcp(addr) => {
                        let s = tokio::net::TcpStream::connect(addr.as_str()).await?;
                        s.set_nodelay(true)?;
                        Ok::<_, std::io::Error>(BackendConn::Tcp(s))
                    }
                    Backend::Unix(p) => {
                        Ok(BackendConn::Unix(tokio::net::UnixStream::connect(p).await?))
                    }
                }
            };
            match tokio::time::timeout(timeout, attempt).await {
                Ok(Ok(io)) => return Some((io, backend)),
                Ok(Err(e)) => {
                    tracing::warn!(%backend, error = %e, "backend connect failed; trying the next");
                }
                Err(_) => {
                    tracing::warn!(%backend, "backend connect timed out; trying the next");
                }
            }
            self.stats.backend_connect_failures.fetch_add(1, Relaxed);
            pool.mark_down(i, Duration::from_secs(self.args.backend_down_time));
        }
        None
    }

    /// (In-flight connections during a shutdown go on until the shutdown grace ends them.)
    async fn forward(&self, mut tls: TlsStream, peer: SocketAddr) -> Ended {
        let site = tls.info().site;
        let Some((mut backend, _which)) = self.connect(site).await else {
            self.stats.no_backend.fetch_add(1, Relaxed);
            // Nothing was forwarded: tell the client the service is not there rather than
            // leave it waiting (close_notify, then FIN).
            let _ = tls.shutdown().await;
            return Ended::NoBackend;
        };
        self.stats.forwarded.fetch_add(1, Relaxed);
        if let Some(version) = self.args.proxy_protocol {
            let info = tls.info();
            let suite = format!("{:?}", info.suite);
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
        let ended = relay(
            &mut tls,
            &mut backend,
            self.args.buffer as usize,
            Duration::from_secs(self.args.server.idle_timeout),
            &self.stats,
        )
        .await;
        match ended {
            Ended::ClientError => {
                self.stats.client_errors.fetch_add(1, Relaxed);
                backend.reset_on_close();
            }
            Ended::BackendError => {
                self.stats.backend_errors.fetch_add(1, Relaxed);
                reset(&tls);
            }
            Ended::IdleTimeout => {
                self.stats.idle_timeouts.fetch_add(1, Relaxed);
                let _ = tls.shutdown().await;
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

/// Moves bytes both ways until both directions have ended (or one side fails).
///
/// The TLS stream is one object (its record layer serves both directions), so its reads and
/// writes take turns; the backend's are independent. A read from the client is cancelled
/// (it is cancel-safe) when the backend has something for the client; a write to the client is
/// never cancelled, and while it waits (a client not reading) the proxy stops reading from
/// that client too (backpressure) but goes on writing what it holds to the backend.
async fn relay<B: AsyncRead + AsyncWrite + Unpin + ?Sized>(
    tls: &mut TlsStream,
    backend: &mut B,
    buffer: usize,
    idle: Duration,
    stats: &ProxyStats,
) -> Ended {
    let (mut backend_r, mut backend_w) = tokio::io::split(backend);
    // Client → backend: bytes read from the client not yet written to the backend.
    let mut up = vec![0u8; buffer];
    let (mut up_at, mut up_len) = (0usize, 0usize);
    let mut client_done = false; // the client will send nothing more
    let mut backend_shut = false; // ... and the backend was told so
                                  // Backend → client.
    let mut down = vec![0u8; buffer];
    let mut backend_done = false;
    let mut client_shut = false;
    let mut deadline = tokio::time::Instant::now() + idle;
    loop {
        if client_done && up_at == up_len && !backend_shut {
            backend_shut = true;
            if backend_w.shutdown().await.is_err() {
                return Ended::BackendError;
            }
        }
        if backend_shut && backend_done {
            if !client_shut {
                let _ = tls.shutdown().await;
            }
            return Ended::Closed;
        }
        if backend_done && !client_shut {
            client_shut = true;
            if tls.shutdown().await.is_err() {
                return Ended::ClientError;
            }
        }
        // Client → backend is one of: read from the client (nothing held), or write what is
        // held to the backend; one future, since both use the same buffer.
        let up_op = async {
            if up_at < up_len {
                Up::Wrote(backend_w.write(&up[up_at..up_len]).await)
            } else if !client_done {
                Up::Read(tls.read(&mut up).await)
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            up_done = up_op => match up_done {
                Up::Read(Ok(0)) => client_done = true,
                Up::Read(Ok(n)) => {
                    (up_at, up_len) = (0, n);
                    deadline = tokio::time::Instant::now() + idle;
                }
                Up::Read(Err(_)) => return Ended::ClientError,
                Up::Wrote(Ok(0) | Err(_)) => return Ended::BackendError,
                Up::Wrote(Ok(n)) => {
                    up_at += n;
                    stats.bytes_to_backend_copied.fetch_add(n as u64, Relaxed);
                    deadline = tokio::time::Instant::now() + idle;
                }
            },
            r = backend_r.read(&mut down), if !backend_done => match r {
                Ok(0) => backend_done = true,
                Ok(n) => {
                    deadline = tokio::time::Instant::now() + idle;
                    // Write it all to the client; meanwhile keep the backend fed.
                    let mut write = std::pin::pin!(tls.write_all(&down[..n]));
                    loop {
                        tokio::select! {
                            w = &mut write => {
                                if w.is_err() {
                                    return Ended::ClientError;
                                }
                                break;
                            }
                            r = backend_w.write(&up[up_at..up_len]), if up_at < up_len => match r {
                                Ok(0) | Err(_) => return Ended::BackendError,
                                Ok(m) => {
                                    up_at += m;
                                    stats.bytes_to_backend_copied.fetch_add(m as u64, Relaxed);
                                    deadline = tokio::time::Instant::now() + idle;
                                }
                            },
                            _ = tokio::time::sleep_until(deadline) => return Ended::IdleTimeout,
                        }
                    }
                    stats.bytes_to_client_copied.fetch_add(n as u64, Relaxed);
                    deadline = tokio::time::Instant::now() + idle;
                }
                Err(_) => return Ended::BackendError,
            },
            _ = tokio::time::sleep_until(deadline) => return Ended::IdleTimeout,
        }
    }
}
