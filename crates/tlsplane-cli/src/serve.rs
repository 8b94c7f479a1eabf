//! `tlsplane serve`: an HTTPS static-file server.
//!
//! Listeners, handshakes and workers are the shared runtime's (`crate::runtime`); this module
//! is the handler it runs on each established connection. HTTP/1.1 is parsed by
//! `tlsplane-http`; responses are written here so that file bodies can follow the headers by
//! `sendfile(2)`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::Args;
use tlsplane::sites::SiteNames;
use tlsplane::{Acceptor, DataPlanePolicy, ServerOptions, TlsStream};
use tlsplane_http::{error_response, parse_request, respond, Body, Limits, Parsed};

use crate::config::{ConfigFile, SiteServe, Sites};
use crate::keys::Keys;
use crate::runtime::{
    self, ConnContext, Generation, Handler, Phase, RuntimeConfig, RuntimeStats, Served,
};

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Directory to serve (without --config: one site, whatever the name asked for).
    #[arg(default_value = ".")]
    pub dir: PathBuf,
    /// Configuration file (TOML): sites by server name, each with its certificates and
    /// document root, and global options under [server] (a flag given here wins over the
    /// file). See docs/CONFIG.md. SIGHUP re-reads it.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["cert", "key"])]
    pub config: Option<PathBuf>,
    /// Where private keys live: `on` starts a key daemon (`tlsplane keyd`, a child process that
    /// alone reads the key files and signs for the server, restarted if it dies); `off` reads
    /// them into this process (weaker: a memory disclosure here would disclose them);
    /// `unix:PATH` uses a daemon started by hand with `tlsplane keyd --socket PATH`.
    #[arg(long, default_value = "on", value_name = "on|off|unix:PATH")]
    pub keyd: crate::keys::KeydMode,
    /// Write the server's pid here once it listens (removed at exit), for `tlsplane reload`.
    #[arg(long, value_name = "FILE")]
    pub pid_file: Option<PathBuf>,
    /// A ClientHello whose server name matches no site when there is no default site (or that
    /// sends none): `alert` answers unrecognized_name, `reset` resets without a reply.
    #[arg(long, default_value = "alert")]
    pub unknown_name: tlsplane::sites::UnknownName,
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
    /// Nice value of the threads that accept and run handshakes, relative to the threads that
    /// serve established connections. When both have work, established connections come
    /// first (at 5 handshakes still get about a quarter of a busy core); 0 is equal priority.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub handshake_nice: i32,
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
    #[command(flatten)]
    pub limits: crate::limits::LimitArgs,
    /// Serve /metrics (OpenMetrics text) and /healthz over plain HTTP at ADDR:PORT (loopback
    /// only) or unix:PATH. Off by default.
    #[arg(long, value_name = "ADDR:PORT|unix:PATH")]
    pub admin: Option<crate::admin::AdminAddr>,
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
    requests: AtomicU64,
    responses_2xx: AtomicU64,
    responses_3xx: AtomicU64,
    responses_4xx: AtomicU64,
    responses_5xx: AtomicU64,
    timeouts: AtomicU64,
    io_errors: AtomicU64,
}

/// The `serve` product under one configuration: the runtime hands it established
/// connections.
struct Serve {
    /// By site number (the acceptor's).
    sites: Vec<SiteServe>,
    names: Arc<SiteNames>,
    args: ServeArgs,
    limits: Limits,
    /// Kept across reloads.
    stats: Arc<HttpStats>,
    /// Time to the first byte of a connection's first response (shared with /metrics).
    ttfb: prometheus_client::metrics::histogram::Histogram,
}

/// A keep-alive connection between requests, as it moves to the connection loop.
pub struct Parked {
    /// The request buffer (empty: a connection parks only between requests).
    buf: Vec<u8>,
    /// It has had a response already (its time to first byte is recorded).
    responded: bool,
}

/// The `serve` flags, standalone, to parse a configuration file's `[server]` table with.
#[derive(clap::Parser, Debug)]
#[command(name = "serve", no_binary_name = true)]
struct ServeFlags {
    #[command(flatten)]
    args: ServeArgs,
}

/// With `--config`: the file's `[server]` options under the command line's (a flag given on
/// the command line wins), and the file itself.
pub fn with_config_file(
    args: ServeArgs,
    given: &clap::ArgMatches,
) -> anyhow::Result<(ServeArgs, Option<ConfigFile>)> {
    let Some(path) = args.config.clone() else {
        return Ok((args, None));
    };
    let explicit =
        |id: &str| given.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    if explicit("dir") {
        anyhow::bail!(
            "a DIR argument and --config: with a configuration file each site has its root"
        );
    }
    let file = ConfigFile::read(&path).map_err(anyhow::Error::msg)?;
    // The command line as given after `serve`: parsed again behind the file's options.
    let cli: Vec<std::ffi::OsString> = std::env::args_os()
        .skip(1)
        .skip_while(|a| a != "serve")
        .skip(1)
        .collect();
    let merged = server_options_of(&file, &explicit, cli)?;
    Ok((merged, Some(file)))
}

/// The global options of `file` (its `[server]` table) followed by the command-line tokens
/// `cli`, whose options (`explicit`) the file's do not repeat.
pub fn server_options_of(
    file: &ConfigFile,
    explicit: &dyn Fn(&str) -> bool,
    cli: Vec<std::ffi::OsString>,
) -> anyhow::Result<ServeArgs> {
    use clap::{CommandFactory, FromArgMatches};
    let mut cmd = ServeFlags::command();
    let mut tokens = file
        .server_args(&cmd, explicit)
        .map_err(anyhow::Error::msg)?;
    // The file's options alone first, so that an error in them names the file.
    cmd.try_get_matches_from_mut(tokens.clone()).map_err(|e| {
        let detail = e.to_string();
        let first = detail.lines().next().unwrap_or_default().to_string();
        anyhow::anyhow!(
            "{}: [server]: {}",
            file.path.display(),
            first.trim_start_matches("error: ")
        )
    })?;
    tokens.extend(cli);
    let matches = cmd.try_get_matches_from_mut(tokens)?;
    Ok(ServeFlags::from_arg_matches(&matches)?.args)
}

pub fn run(args: ServeArgs, given: &clap::ArgMatches) -> anyhow::Result<()> {
    let (args, file) = with_config_file(args, given)?;
    // Before the kTLS probe and the certificates: a taken port is the cheapest error to find.
    runtime::refuse_taken(&args.listen)?;
    match tlsplane_sys::raise_nofile_limit() {
        Ok(n) => tracing::debug!(open_files = n, "open-files limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
    }
    let (flag_chain, flag_key) = match &file {
        Some(_) => (PathBuf::new(), PathBuf::new()),
        None => flag_cert_paths(&args)?,
    };
    let daemon_args: Vec<std::ffi::OsString> = match &file {
        Some(f) => vec!["--config".into(), f.path.clone().into()],
        None => vec!["--key".into(), flag_key.clone().into()],
    };
    let keys = Keys::start(args.keyd.clone(), daemon_args)?;
    eprintln!(
        "private keys: {}",
        match &args.keyd {
            crate::keys::KeydMode::On =>
                "in a key daemon (tlsplane keyd) started for this server".to_string(),
            crate::keys::KeydMode::Off => "read into this process (--keyd off)".to_string(),
            crate::keys::KeydMode::Unix(p) => format!("in the key daemon at {}", p.display()),
        }
    );
    let loader = |p: &std::path::Path| keys.load(p);
    let sites = load_sites(&args, file.as_ref(), (&flag_chain, &flag_key), &loader)?;
    for w in &sites.warnings {
        tracing::warn!("{w}");
    }
    let acceptor = Acceptor::new(server_options(&args, &sites))?;
    eprintln!(
        "data plane: {} ({})",
        args.data_plane,
        acceptor.kernel_support().reason
    );
    if file.is_some() {
        eprintln!(
            "sites: {} ({})",
            sites.serve.len(),
            sites
                .serve
                .iter()
                .map(|s| s.label.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    let workers = args.workers.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let config = RuntimeConfig {
        listen: args.listen.clone(),
        workers,
        handshake_timeout: Duration::from_secs(args.handshake_timeout),
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        handshake_nice: args.handshake_nice,
        limits: args.limits.clone(),
        pid_file: args.pid_file.clone(),
    };
    let runtime_stats = Arc::new(RuntimeStats::default());
    let stats = Arc::new(HttpStats::default());
    let serve = Arc::new(Serve::new(
        sites,
        &args,
        stats.clone(),
        runtime_stats.histograms.first_response.clone(),
    ));
    if let Some(addr) = &args.admin {
        let mut registry = prometheus_client::registry::Registry::with_prefix("tlsplane");
        let (s, r) = (stats.clone(), runtime_stats.clone());
        let open = runtime_stats.open.clone();
        registry.register_collector(Box::new(crate::admin::SnapshotCollector::new(
            move || counters(&s, &r),
            move || {
                let by_plane = tlsplane::stats::open_by_plane();
                vec![
                    (
                        "connections_open",
                        "Connections accepted and not yet closed",
                        open.load(Relaxed) as i64,
                    ),
                    (
                        "connections_open_kernel_plane",
                        "Established connections whose records the kernel encrypts",
                        by_plane.kernel.load(Relaxed),
                    ),
                    (
                        "connections_open_user_plane",
                        "Established connections on the user-space record layer",
                        by_plane.user.load(Relaxed),
                    ),
                ]
            },
        )));
        runtime_stats.histograms.register(&mut registry);
        crate::admin::start(addr, registry)?;
    }
    // SIGHUP re-reads the configuration file, or without one the --cert/--key files (a
    // renewed certificate) and the document root.
    let reload: runtime::Reload<Serve> = {
        let (args, stats, ttfb) = (
            args.clone(),
            stats.clone(),
            runtime_stats.histograms.first_response.clone(),
        );
        let mut current = acceptor.clone();
        let keys = keys.clone();
        Box::new(move || {
            let key_generation = keys.reload()?;
            let reread = match &file {
                Some(first) => {
                    let f = ConfigFile::read(&first.path).map_err(anyhow::Error::msg)?;
                    if f.server != first.server {
                        tracing::warn!(
                            "{}: [server] changed; global options take effect at the next restart (sites, certificates and roots are reloaded now)",
                            first.path.display()
                        );
                    }
                    Some(f)
                }
                None => None,
            };
            let loader = |p: &std::path::Path| keys.load(p);
            let sites = load_sites(&args, reread.as_ref(), (&flag_chain, &flag_key), &loader)?;
            for w in &sites.warnings {
                tracing::warn!("{w}");
            }
            let acceptor = current.reload(server_options(&args, &sites))?;
            current = acceptor.clone();
            let handler = Arc::new(Serve::new(sites, &args, stats.clone(), ttfb.clone()));
            // Installed by the runtime as soon as this returns.
            keys.commit(key_generation);
            Ok(Generation { acceptor, handler })
        })
    };
    let (restarted, requests) = tokio::sync::mpsc::unbounded_channel();
    keys.supervise(restarted, runtime_stats.clone());
    let served = runtime::run(
        config,
        Generation {
            acceptor,
            handler: serve,
        },
        reload,
        Some(requests),
        runtime_stats.clone(),
    );
    keys.stop();
    served?;
    if args.stats {
        let pairs = counters(&stats, &runtime_stats);
        eprintln!("tlsplane-stats {}", tlsplane::stats::to_json(&pairs));
    }
    Ok(())
}

/// The certificate and key of a server without --config: --cert/--key, or the generated
/// localhost certificate (made on first use).
fn flag_cert_paths(args: &ServeArgs) -> anyhow::Result<(PathBuf, PathBuf)> {
    if let (Some(c), Some(k)) = (&args.cert, &args.key) {
        return Ok((c.clone(), k.clone()));
    }
    let dir = tlsplane::cert::default_state_dir();
    let g = tlsplane::cert::ensure_localhost_cert(&dir)?;
    eprintln!(
        "certificate: {} ({} for localhost, 127.0.0.1, ::1, issued by a local CA; trust it with e.g. curl --cacert {} https://localhost:PORT/)",
        g.cert.display(),
        if g.created { "generated" } else { "reusing" },
        g.ca.display()
    );
    Ok((g.cert, g.key))
}

/// The sites to serve: from the configuration file, else one from the command line (DIR and
/// the `flag` certificate and key).
fn load_sites(
    args: &ServeArgs,
    file: Option<&ConfigFile>,
    flag: (&std::path::Path, &std::path::Path),
    keys: crate::config::KeyLoader,
) -> anyhow::Result<Sites> {
    if let Some(file) = file {
        return crate::config::load_sites(file, args.allow_symlinks_outside, keys)
            .map_err(|errors| anyhow::anyhow!("{}", errors.join("\n")));
    }
    crate::config::single_site(&args.dir, args.allow_symlinks_outside, flag.0, flag.1, keys)
}

/// The acceptor's options: the sites' TLS and the global TLS options.
fn server_options(args: &ServeArgs, sites: &Sites) -> ServerOptions {
    ServerOptions {
        sites: sites.tls.clone(),
        names: sites.names.clone(),
        unknown_name: args.unknown_name,
        policy: args.data_plane,
        tls13_tickets: args.tls13_tickets,
        aead_record_limit: args.aead_record_limit,
        plain_http_response: Some(plain_http_response().into()),
        max_client_hello: args.limits.max_client_hello,
        key_updates_per_second: args.limits.key_updates_per_second,
    }
}

impl Serve {
    fn new(
        sites: Sites,
        args: &ServeArgs,
        stats: Arc<HttpStats>,
        ttfb: prometheus_client::metrics::histogram::Histogram,
    ) -> Self {
        Self {
            sites: sites.serve,
            names: sites.names,
            args: args.clone(),
            limits: Limits::default(),
            stats,
            ttfb,
        }
    }
}

/// The answer to a client that speaks plain HTTP to the TLS port (curl http://...), as nginx
/// and Go's net/http give, rather than a TLS alert such a client would show as garbage.
fn plain_http_response() -> Vec<u8> {
    let body = "This port speaks HTTPS: use https:// instead of http://.\n";
    format!(
        "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Every counter, as `--stats` prints them and `/metrics` exposes them.
fn counters(h: &HttpStats, r: &RuntimeStats) -> Vec<(&'static str, u64)> {
    let mut pairs = tlsplane::stats::global().snapshot();
    pairs.extend([
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
        ("task_panics", r.task_panics.load(Relaxed)),
        ("idle_evicted", r.idle_evicted.load(Relaxed)),
        ("first_byte_timeouts", r.first_byte_timeouts.load(Relaxed)),
        ("handshakes_evicted", r.handshakes_evicted.load(Relaxed)),
        ("reloads", r.reloads.load(Relaxed)),
        ("reload_failures", r.reload_failures.load(Relaxed)),
        ("keyd_restarts", r.keyd_restarts.load(Relaxed)),
    ]);
    pairs.extend(r.limits.snapshot());
    pairs
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
    let (mut buf, park_when_idle, mut responded) = match phase {
        Phase::Handshake => (vec![0u8; max_buf.min(1024)], true, false),
        Phase::Moved(p) => (p.buf, false, p.responded),
    };
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
                    respond(&request, &shared.sites[site].root, SystemTime::now())
                };
                count_status(&shared.stats, resp.status);
                if args.access_log {
                    tracing::info!(%peer, method = ?request.method, target = %request.target, status = resp.status, plane = ?tls.plane(), "request");
                }
                if !std::mem::replace(&mut responded, true) {
                    shared
                        .ttfb
                        .observe(tls.info().accepted_at.elapsed().as_secs_f64());
                }
                if !resp.keep_alive {
                    return Box::pin(send_last_response(&mut tls, &resp))
                        .await
                        .map(|()| Served::Done);
                }
                Box::pin(send_response(&mut tls, &resp)).await?;
                buf.copy_within(head_len..used, 0);
                used -= head_len;
                deadline = None;
                if *ctx.stop.borrow() && used == 0 {
                    // Draining after SIGTERM: the response in flight is done, nothing else
                    // was asked for; end the connection with close_notify now.
                    return tls.shutdown().await.map(|()| Served::Done);
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
                    return Box::pin(send_last_response(&mut tls, &resp))
                        .await
                        .map(|()| Served::Done);
                }
                if park_when_idle && used == 0 && !tls.input_pending() {
                    // Between requests with nothing to read: wait on a connection loop, not
                    // on the handshake loop.
                    return Ok(Served::Park(tls, Parked { buf, responded }));
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
                        let _ = tls.close().await;
                        return Ok(Served::Done);
                    }
                    Ok(Ok(n)) => used += n,
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        shared.stats.timeouts.fetch_add(1, Relaxed);
                        if used > 0 {
                            let resp = error_response(408, false);
                            tls.final_writes();
                            let _ = Box::pin(send_response(&mut tls, &resp)).await;
                        }
                        return tls.shutdown().await.map(|()| Served::Done);
                    }
                }
                if *stop.borrow() && used == 0 {
                    return tls.shutdown().await.map(|()| Served::Done);
                }
            }
            Err(e) => {
                let status = e.status();
                count_status(&shared.stats, status);
                if args.access_log {
                    tracing::info!(%peer, status, error = %e, "bad request");
                }
                return Box::pin(send_last_response(&mut tls, &error_response(status, false)))
                    .await
                    .map(|()| Served::Done);
            }
        }
    }
}

fn count_status(stats: &HttpStats, status: u16) {
    match status {
        200..=299 => stats.responses_2xx.fetch_add(1, Relaxed),
        300..=399 => stats.responses_3xx.fetch_add(1, Relaxed),
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
