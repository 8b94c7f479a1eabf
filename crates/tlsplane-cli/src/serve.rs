//! `tlsplane serve`: an HTTPS static-file server.
//!
//! One event loop per worker thread (a current-thread tokio runtime), each with its own
//! `SO_REUSEPORT` listening socket per address, so the kernel spreads connections across
//! workers without a shared accept lock. HTTP/1.1 is parsed by `tlsplane-http`; responses are
//! written here so that file bodies can follow the headers by `sendfile(2)`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use clap::Args;
use futures_util::FutureExt;
use tlsplane::{Acceptor, DataPlanePolicy, ServerOptions, TlsStream};
use tlsplane_http::{error_response, parse_request, respond, Body, DocRoot, Limits, Parsed};
use tokio::sync::watch;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Directory to serve.
    #[arg(default_value = ".")]
    pub dir: PathBuf,
    /// Address to listen on (repeatable; IPv6 as [::1]:8443). Port 0 picks a free port.
    #[arg(long = "listen", default_value = "127.0.0.1:8443")]
    pub listen: Vec<SocketAddr>,
    /// Certificate chain (PEM). Without --cert/--key a certificate for localhost, issued by a
    /// local CA made for the purpose, is generated once and reused (both paths are printed).
    #[arg(long, requires = "key")]
    pub cert: Option<PathBuf>,
    /// Private key (PEM: PKCS#8, SEC1 or PKCS#1; ECDSA P-256/P-384, Ed25519 or RSA).
    #[arg(long, requires = "cert")]
    pub key: Option<PathBuf>,
    /// Worker threads, each an event loop with its own listening socket [default: CPU count].
    #[arg(long, value_parser = parse_workers)]
    pub workers: Option<usize>,
    /// Record layer: `auto` (kernel kTLS when possible, per connection), `kernel` (required:
    /// refuse to start without a TLS ULP, close connections it cannot take), `user`.
    #[arg(long, default_value = "auto")]
    pub data_plane: DataPlanePolicy,
    /// Log one line per request at info level.
    #[arg(long)]
    pub access_log: bool,
    /// Follow symlinks that lead outside DIR (refused by default).
    #[arg(long)]
    pub allow_symlinks_outside: bool,
    /// Seconds a TLS handshake may take.
    #[arg(long, default_value_t = 10)]
    pub handshake_timeout: u64,
    /// Seconds from the first byte of a request to the end of its headers (one deadline for
    /// the whole head, however the client spreads it over reads).
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Seconds a connection may wait for the first byte of its next request (after the
    /// handshake, and between keep-alive requests).
    #[arg(long, default_value_t = 60)]
    pub idle_timeout: u64,
    /// Seconds in-flight responses get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
    /// TLS 1.3 session tickets sent after a full handshake (0 disables TLS 1.3 resumption).
    #[arg(long, default_value_t = 1)]
    pub tls13_tickets: usize,
    /// Testing aid: records per key before the kernel plane re-keys or closes (default: the
    /// suite's AEAD confidentiality limit).
    #[arg(long, hide = true)]
    pub aead_record_limit: Option<u64>,
    /// Print the counters as one JSON line to stderr at exit.
    #[arg(long)]
    pub stats: bool,
}

fn parse_workers(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// HTTP-level counters; TLS counters live in `tlsplane::stats`.
#[derive(Default)]
struct HttpStats {
    /// Connection tasks that panicked (a bug: the network must never be able to cause one).
    task_panics: AtomicU64,
    connections: AtomicU64,
    requests: AtomicU64,
    responses_4xx: AtomicU64,
    responses_5xx: AtomicU64,
    timeouts: AtomicU64,
    handshake_errors: AtomicU64,
    io_errors: AtomicU64,
}

struct Shared {
    acceptor: Acceptor,
    root: DocRoot,
    args: ServeArgs,
    limits: Limits,
    stats: HttpStats,
    in_flight: AtomicUsize,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    match tlsplane_sys::raise_nofile_limit() {
        Ok(n) => tracing::debug!(open_files = n, "open-files limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
    }
    let root = DocRoot::new(&args.dir, args.allow_symlinks_outside)
        .with_context(|| format!("cannot serve {}", args.dir.display()))?;
    let cert = match (&args.cert, &args.key) {
        (Some(c), Some(k)) => tlsplane::cert::load_pem(c, k)?,
        _ => {
            let dir = tlsplane::cert::default_state_dir();
            let g = tlsplane::cert::ensure_localhost_cert(&dir)?;
            eprintln!(
                "certificate: {} ({} for localhost, 127.0.0.1, ::1, issued by a local CA; trust it with e.g. curl --cacert {} https://localhost:PORT/)",
                g.cert.display(),
                if g.created { "generated" } else { "reusing" },
                g.ca.display()
            );
            tlsplane::cert::load_pem(&g.cert, &g.key)?
        }
    };
    let mut opts = ServerOptions::new(cert);
    opts.policy = args.data_plane;
    opts.tls13_tickets = args.tls13_tickets;
    opts.aead_record_limit = args.aead_record_limit;
    let acceptor = Acceptor::new(opts)?;
    eprintln!(
        "data plane: {} ({})",
        args.data_plane,
        acceptor.kernel_support().reason
    );

    let workers = args
        .workers
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
        .max(1);
    if args.listen.is_empty() {
        bail!("no --listen address");
    }
    // Bind everything before starting workers so that address errors stop start-up, and so
    // that port 0 resolves once and every worker shares the port.
    let mut per_worker: Vec<Vec<std::net::TcpListener>> =
        (0..workers).map(|_| Vec::new()).collect();
    // All probes before any bind: our own sockets for one address must not look like
    // another server to the probe of an overlapping one (0.0.0.0:443 and 127.0.0.1:443).
    for addr in args.listen.iter().filter(|a| a.port() != 0) {
        refuse_if_listened(*addr)?;
    }
    for addr in &args.listen {
        let mut actual = *addr;
        for (i, slot) in per_worker.iter_mut().enumerate() {
            let l = bind_reuseport(actual).with_context(|| format!("cannot listen on {actual}"))?;
            if i == 0 {
                actual = l.local_addr()?;
                eprintln!("listening on https://{actual}");
            }
            slot.push(l);
        }
    }

    let shared = Arc::new(Shared {
        acceptor,
        root,
        limits: Limits::default(),
        stats: HttpStats::default(),
        in_flight: AtomicUsize::new(0),
        args: args.clone(),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut threads = Vec::new();
    for (i, listeners) in per_worker.into_iter().enumerate() {
        let shared = shared.clone();
        let stop = stop_rx.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("worker-{i}"))
                .spawn(move || worker(listeners, shared, stop))?,
        );
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        // SIGHUP's default action would kill the server and every connection with it.
        let mut hup = signal(SignalKind::hangup())?;
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = hup.recv() => {
                    tracing::warn!("SIGHUP received: configuration reload is not supported yet; ignored, still serving");
                }
            }
        }
        anyhow::Ok(())
    })?;
    eprintln!(
        "shutting down: no new connections; in-flight responses get {} s",
        args.shutdown_grace
    );
    let _ = stop_tx.send(true);
    for t in threads {
        let _ = t.join();
    }
    if args.stats {
        eprintln!("tlsplane-stats {}", stats_json(&shared.stats));
    }
    Ok(())
}

fn stats_json(h: &HttpStats) -> String {
    let mut pairs = tlsplane::stats::global().snapshot();
    pairs.extend([
        ("http_connections", h.connections.load(Relaxed)),
        ("http_requests", h.requests.load(Relaxed)),
        ("http_responses_4xx", h.responses_4xx.load(Relaxed)),
        ("http_responses_5xx", h.responses_5xx.load(Relaxed)),
        ("http_timeouts", h.timeouts.load(Relaxed)),
        ("http_handshake_errors", h.handshake_errors.load(Relaxed)),
        ("http_io_errors", h.io_errors.load(Relaxed)),
        ("task_panics", h.task_panics.load(Relaxed)),
    ]);
    tlsplane::stats::to_json(&pairs)
}

/// Our listeners set SO_REUSEPORT so that each worker has its own socket; the price is that
/// the kernel would also let a second server (same user) join the port and silently take part
/// of its connections. A socket without SO_REUSEPORT cannot bind where anyone listens, so a
/// throw-away one tells whether the port is free before our workers bind it.
fn refuse_if_listened(addr: SocketAddr) -> anyhow::Result<()> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    // Connections of an earlier run lingering in TIME_WAIT must not count as a listener.
    s.set_reuse_address(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    match s.bind(&addr.into()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => bail!(
            "cannot listen on {addr}: address already in use (another server listens there; \
             refusing to share the port with it)"
        ),
        Err(e) => Err(e).with_context(|| format!("cannot listen on {addr}")),
    }
}

fn bind_reuseport(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.set_nonblocking(true)?;
    // Accepted sockets inherit TCP_NODELAY from the listener: one setsockopt per listener
    // instead of one per connection.
    s.set_nodelay(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    Ok(s.into())
}

fn worker(listeners: Vec<std::net::TcpListener>, shared: Arc<Shared>, stop: watch::Receiver<bool>) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "worker runtime failed to start");
            return;
        }
    };
    rt.block_on(async move {
        let mut accepts = Vec::new();
        for l in listeners {
            let l = match tokio::net::TcpListener::from_std(l) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "listener registration failed");
                    continue;
                }
            };
            let shared = shared.clone();
            let mut stop = stop.clone();
            accepts.push(tokio::spawn(async move {
                loop {
                    tokio::select! {
                        r = l.accept() => match r {
                            Ok((tcp, peer)) => {
                                let shared = shared.clone();
                                let stop = stop.clone();
                                tokio::spawn(async move {
                                    // A panic here is a bug whatever the peer sent: count it
                                    // (the panic hook has logged one line) and let the others
                                    // carry on; the socket closes as the task's state drops.
                                    let task = std::panic::AssertUnwindSafe(connection(tcp, peer, shared.clone(), stop));
                                    if task.catch_unwind().await.is_err() {
                                        shared.stats.task_panics.fetch_add(1, Relaxed);
                                    }
                                });
                            }
                            Err(e) => {
                                // EMFILE and friends: back off instead of spinning.
                                tracing::warn!(error = %e, "accept failed");
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        },
                        _ = stop.changed() => break,
                    }
                }
            }));
        }
        for a in accepts {
            let _ = a.await;
        }
        // Listeners are closed; give in-flight connections the grace period.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(shared.args.shutdown_grace);
        while shared.in_flight.load(Relaxed) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// Decrements the in-flight count however the connection task ends.
struct InFlight<'a>(&'a AtomicUsize);
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

async fn connection(
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    shared.in_flight.fetch_add(1, Relaxed);
    let _guard = InFlight(&shared.in_flight);
    shared.stats.connections.fetch_add(1, Relaxed);
    let args = &shared.args;
    let tls = match tokio::time::timeout(
        Duration::from_secs(args.handshake_timeout),
        shared.acceptor.accept(tcp),
    )
    .await
    {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            shared.stats.handshake_errors.fetch_add(1, Relaxed);
            tracing::debug!(%peer, error = %e, "handshake failed");
            return;
        }
        Err(_) => {
            shared.stats.timeouts.fetch_add(1, Relaxed);
            tracing::debug!(%peer, "handshake timed out");
            return;
        }
    };
    if let Err(e) = http_loop(tls, peer, &shared, &mut stop).await {
        shared.stats.io_errors.fetch_add(1, Relaxed);
        tracing::debug!(%peer, error = %e, "connection ended with error");
    }
}

async fn http_loop(
    mut tls: TlsStream,
    peer: SocketAddr,
    shared: &Shared,
    stop: &mut watch::Receiver<bool>,
) -> std::io::Result<()> {
    let args = &shared.args;
    // Starts small (most request heads are well under 4 KiB; this buffer lives as long as the
    // connection) and grows up to the head limit only for a request that needs it.
    let max_buf = shared.limits.max_head_bytes + 1024;
    let mut buf = vec![0u8; max_buf.min(4096)];
    let mut used = 0usize;
    // The deadline of what we are waiting for: the first byte of a request (idle timeout) or,
    // once it came, the end of the head (header timeout). Set once per phase, never per read,
    // so a client trickling a byte at a time cannot hold the connection past it.
    let mut deadline: Option<(bool, tokio::time::Instant)> = None;
    loop {
        match parse_request(&buf[..used], &shared.limits) {
            Ok(Parsed::Complete {
                head_len,
                mut request,
            }) => {
                shared.stats.requests.fetch_add(1, Relaxed);
                if *stop.borrow() {
                    // Draining: answer this request with `Connection: close`, then close.
                    request.keep_alive = false;
                }
                let resp = respond(&request, &shared.root, SystemTime::now());
                count_status(&shared.stats, resp.status);
                if args.access_log {
                    tracing::info!(%peer, method = ?request.method, target = %request.target, status = resp.status, plane = ?tls.plane(), "request");
                }
                if !resp.keep_alive {
                    return send_last_response(&mut tls, &resp).await;
                }
                send_response(&mut tls, &resp).await?;
                buf.copy_within(head_len..used, 0);
                used -= head_len;
                deadline = None;
                if *stop.borrow() && used == 0 {
                    // Draining after SIGTERM: the response in flight is done, nothing else
                    // was asked for; end the connection with close_notify now.
                    return tls.shutdown().await;
                }
            }
            Ok(Parsed::Incomplete) => {
                if used == buf.len() && buf.len() < max_buf {
                    buf.resize((buf.len() * 2).min(max_buf), 0);
                }
                if used == buf.len() {
                    // parse_request enforces the head limit before this can happen; be safe.
                    let resp = error_response(431, false);
                    count_status(&shared.stats, 431);
                    return send_last_response(&mut tls, &resp).await;
                }
                let in_head = used > 0;
                let until = match deadline {
                    Some((phase, at)) if phase == in_head => at,
                    _ => {
                        let wait = if in_head {
                            args.header_timeout
                        } else {
                            args.idle_timeout
                        };
                        let at = tokio::time::Instant::now() + Duration::from_secs(wait);
                        deadline = Some((in_head, at));
                        at
                    }
                };
                let read = tokio::select! {
                    r = tokio::time::timeout_at(until, tls.read(&mut buf[used..])) => r,
                    _ = stop.changed(), if used == 0 && !*stop.borrow() => {
                        // Idle keep-alive connection during shutdown: close it now. The peer
                        // may be closing at the same moment (ENOTCONN): not an error of ours.
                        let _ = tls.shutdown().await;
                        return Ok(());
                    }
                };
                match read {
                    Ok(Ok(0)) => {
                        // Peer finished (close_notify or FIN); answer its close_notify.
                        let _ = tls.close().await;
                        return Ok(());
                    }
                    Ok(Ok(n)) => used += n,
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        shared.stats.timeouts.fetch_add(1, Relaxed);
                        if used > 0 {
                            let resp = error_response(408, false);
                            tls.final_writes();
                            let _ = send_response(&mut tls, &resp).await;
                        }
                        return tls.shutdown().await;
                    }
                }
                if *stop.borrow() && used == 0 {
                    return tls.shutdown().await;
                }
            }
            Err(e) => {
                let status = e.status();
                count_status(&shared.stats, status);
                if args.access_log {
                    tracing::info!(%peer, status, error = %e, "bad request");
                }
                return send_last_response(&mut tls, &error_response(status, false)).await;
            }
        }
    }
}

fn count_status(stats: &HttpStats, status: u16) {
    match status {
        400..=499 => stats.responses_4xx.fetch_add(1, Relaxed),
        500..=599 => stats.responses_5xx.fetch_add(1, Relaxed),
        _ => 0,
    };
}

/// The connection's last response: it, the close_notify and the FIN leave together (see
/// `TlsStream::final_writes`).
async fn send_last_response(
    tls: &mut TlsStream,
    resp: &tlsplane_http::Response,
) -> std::io::Result<()> {
    tls.final_writes();
    send_response(tls, resp).await?;
    tls.shutdown().await
}

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
