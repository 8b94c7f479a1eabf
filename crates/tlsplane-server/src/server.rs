//! What every product (`serve`, `proxy`) starts the same way: the global flags, the
//! configuration file behind them, the key daemon, the sites and their certificates, the
//! acceptor, `/metrics`, reload on SIGHUP, and the shared runtime. A product brings its own
//! flags, what it needs of each site, and the handler it runs on established connections.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tlsplane::tickets::{TicketKeyRing, TicketKeys};
use tlsplane::{Acceptor, DataPlanePolicy, ServerOptions};

// Alpn and HTTP1_ALPN live with the configuration that checks them; products name them here.
pub use crate::config::{Alpn, HTTP1_ALPN, SERVE_ALPN};
use crate::config::{ConfigFile, Origin, SiteNeeds, Sites};
use crate::keys::Keys;
use crate::runtime::{self, Generation, Handler, RuntimeConfig, RuntimeStats};
use crate::served_secrets::ServedSecrets;

/// The options every product has: listeners, certificates and keys, the data plane, limits,
/// timeouts, observability. In a configuration file they go under `[server]`.
#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// Configuration file (TOML): sites by server name, each with its certificates and what it
    /// serves, and global options under [server] (a flag given here wins over the file). See
    /// docs/CONFIG.md. SIGHUP re-reads it.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["cert", "key"])]
    pub config: Option<PathBuf>,
    /// Where private keys live: `on` starts a key daemon (`tlsplane keyd`, a child process that
    /// alone reads the key files and signs for the server, restarted if it dies); `off` reads
    /// them into this process (weaker: a memory disclosure here would disclose them);
    /// `unix:PATH` uses a daemon started by hand with `tlsplane keyd --socket PATH`;
    /// `tls://HOST:PORT[,tls://HOST:PORT...]` uses daemons on other hosts (`tlsplane keyd
    /// --listen-tls`) over mutual TLS, in turn, a signature one loses made by the next.
    #[arg(
        long,
        default_value = "on",
        value_name = "on|off|unix:PATH|tls://HOST:PORT,..."
    )]
    pub keyd: crate::keys::KeydMode,
    /// With --keyd tls://: the certificate (PEM) this server shows the key daemons, issued by
    /// their --client-ca.
    #[arg(long, value_name = "PEM")]
    pub keyd_tls_cert: Option<PathBuf>,
    /// The private key of --keyd-tls-cert (PEM). It is read into this process, and whoever
    /// holds it can have the daemons sign: issue its certificate for this server alone.
    #[arg(long, value_name = "PEM")]
    pub keyd_tls_key: Option<PathBuf>,
    /// With --keyd tls://: the CA (PEM) that issued the key daemons' certificates.
    #[arg(long, value_name = "PEM")]
    pub keyd_ca: Option<PathBuf>,
    /// Seconds a handshake waits for the key daemon's signature before it fails with an
    /// internal_error alert. A daemon this server started that lets a signature time out is
    /// stuck: it is replaced, as a dead one is.
    #[arg(long, default_value_t = 5.0, value_name = "S", value_parser = parse_keyd_timeout)]
    pub keyd_timeout: f64,
    /// With --keyd unix:PATH: the user id the daemon runs as, if neither root nor this
    /// server's user. The server checks who listens on the socket (SO_PEERCRED) before it
    /// sends the daemon's token: a listener of any other user gets nothing.
    #[arg(long, value_name = "UID")]
    pub keyd_uid: Option<u32>,
    /// Once its ports are bound, switch to this user (NAME, with its groups, or UID[:GID]);
    /// needs root. The key daemon keeps root and the keys: the server cannot read them. The
    /// configuration, certificates and what is served must be readable by this user (a reload
    /// reads them again), and the pid file's directory writable by it.
    #[arg(long, value_name = "NAME|UID[:GID]")]
    pub user: Option<crate::privileges::RunAs>,
    /// Write the server's pid here once it listens (removed at exit), for `tlsplane reload`.
    #[arg(long, value_name = "FILE")]
    pub pid_file: Option<PathBuf>,
    /// A ClientHello whose server name matches no site when there is no default site (or that
    /// sends none): `alert` answers unrecognized_name, `reset` resets without a reply.
    #[arg(long, default_value = "alert", value_name = "alert|reset")]
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
    #[arg(long, default_value = "auto", value_name = "auto|kernel|user")]
    pub data_plane: DataPlanePolicy,
    /// Log one line per request (serve, proxy HTTP mode) or connection (proxy TCP mode):
    /// to stderr at info level, unless --access-log-file is given.
    #[arg(long)]
    pub access_log: bool,
    /// Append the access log to FILE instead (implies --access-log): one write per line,
    /// O_APPEND. Opened again at each reload, so to rotate: rename FILE, then reload (with
    /// --user, that user must be able to write FILE).
    #[arg(long, value_name = "FILE")]
    pub access_log_file: Option<PathBuf>,
    /// Access log lines as `text` (key=value), `combined` (nginx's) or `json`.
    #[arg(long, default_value = "text", value_name = "text|combined|json")]
    pub access_log_format: crate::access_log::Format,
    /// Seconds a TLS handshake may take.
    #[arg(long, default_value_t = 10)]
    pub handshake_timeout: u64,
    /// Seconds a connection may stay idle: serve, waiting for the first byte of its next
    /// request (after the handshake, and between keep-alive requests); proxy, with no byte
    /// moving either way.
    #[arg(long, default_value_t = 60)]
    pub idle_timeout: u64,
    /// Seconds a client may take none of our bytes (its window closed: it stopped reading; or
    /// no acknowledgement: it is gone) before the kernel drops the connection; it sends
    /// nothing then, and the client's next packet meets a reset (nginx's send_timeout,
    /// HAProxy's tcp-ut). Counted as `send_timeouts`. Without it a
    /// client that stops reading holds its connection, and everything queued for it, as long
    /// as it answers TCP's window probes. Set as TCP_USER_TIMEOUT on the listening sockets:
    /// no system call per connection. 0: the kernel's default (no limit while probes are
    /// answered).
    #[arg(long, default_value_t = 60.0, value_name = "S", value_parser = parse_send_timeout)]
    pub send_timeout: f64,
    /// Nice value of the threads that accept and run handshakes, relative to the threads that
    /// serve established connections. When both have work, established connections come
    /// first (at 5 handshakes still get about a quarter of a busy core); 0 is equal priority.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub handshake_nice: i32,
    /// Seconds in-flight work gets to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
    /// Lingering close: after its last response (or a handshake's alert), a connection sends
    /// close_notify and FIN, then reads and drops what the client still sends until the
    /// client closes, so that unread input does not make the kernel reset the connection and
    /// destroy the response on its way. Seconds it waits for the client's next bytes (nginx's
    /// lingering_timeout).
    #[arg(long, default_value_t = 5.0, value_name = "S", value_parser = parse_linger_seconds)]
    pub linger_timeout: f64,
    /// ... and seconds it lingers in all (nginx's lingering_time); 0 turns lingering off.
    #[arg(long, default_value_t = 30.0, value_name = "S", value_parser = parse_linger_seconds)]
    pub linger_time: f64,
    /// ... and bytes it reads and drops at most.
    #[arg(long, default_value_t = tlsplane::linger::DEFAULT_LINGER.max_bytes, value_name = "BYTES")]
    pub linger_max_bytes: u64,
    /// TLS 1.3 session tickets sent after a full handshake (0 disables TLS 1.3 resumption).
    #[arg(long, default_value_t = 1)]
    pub tls13_tickets: usize,
    /// Session-ticket keys from FILE, so that tickets resume on every server given the same
    /// file and after a restart (nginx's ssl_session_ticket_key, HAProxy's tls-ticket-keys).
    /// One key per line, base64 of 80 random bytes (`openssl rand 80 | base64 -w0`); the last
    /// three count and the one before the last encrypts (previous, current, next). To rotate:
    /// append a new key, drop the first, reload every server, no more often than every 6
    /// hours. Read again at each reload. Default: random keys made by this process.
    #[arg(long, value_name = "FILE")]
    pub ticket_keys: Option<PathBuf>,
    #[command(flatten)]
    pub store: crate::ticket_store::TicketStoreArgs,
    /// Testing aid: records per key before the kernel plane re-keys or closes (default: the
    /// suite's AEAD confidentiality limit).
    #[arg(long, hide = true)]
    pub aead_record_limit: Option<u64>,
    #[command(flatten)]
    pub limits: crate::limits::LimitArgs,
    /// ALPN protocols offered, most preferred first (comma list, or `none`), by every site
    /// whose `alpn` key does not say otherwise. Default: `http/1.1,http/1.0` for serve and
    /// HTTP mode, none in TCP mode (a client offering any ALPN or none is then served);
    /// serve also speaks `h2` when it is named (opt-in, e.g. `h2,http/1.1`).
    /// A client offering only other protocols gets a no_application_protocol alert.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub alpn: Option<Vec<String>>,
    /// Serve /metrics (OpenMetrics text) and /healthz over plain HTTP at ADDR:PORT (loopback
    /// only) or unix:PATH. Off by default.
    #[arg(long, value_name = "ADDR:PORT|unix:PATH")]
    pub admin: Option<crate::admin::AdminAddr>,
    /// Print the counters as one JSON line to stderr at exit.
    #[arg(long)]
    pub stats: bool,
}

fn parse_keyd_timeout(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if (0.01..=60.0).contains(&t) => Ok(t),
        Ok(_) => Err("must be between 0.01 and 60 seconds".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_send_timeout(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        // TCP_USER_TIMEOUT is in milliseconds (an int): at least 1 of them, at most ~24 days.
        Ok(t) if t == 0.0 || (0.001..=86400.0).contains(&t) => Ok(t),
        Ok(_) => Err("must be 0 (off) or between 0.001 and 86400 seconds".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_linger_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if (0.0..=3600.0).contains(&t) => Ok(t),
        Ok(_) => Err("must be between 0 and 3600 seconds".into()),
        Err(e) => Err(e.to_string()),
    }
}

impl ServerArgs {
    /// The access log these flags ask for, if any (its file, if any, opened now).
    pub fn access_log(&self) -> anyhow::Result<Option<crate::access_log::AccessLog>> {
        crate::access_log::AccessLog::open(
            self.access_log,
            self.access_log_file.as_deref(),
            self.access_log_format,
        )
    }
}

fn parse_workers(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A product on the shared server: its flags, what it needs of each site, its counters, and
/// its handler under one configuration.
pub trait Product: Handler + Sized {
    /// The product's flags, [`ServerArgs`] flattened into them.
    type Args: clap::Args + clap::FromArgMatches + Clone + std::fmt::Debug + Send + 'static;
    /// The product's counters, kept across reloads.
    type Stats: Default + Send + Sync + 'static;
    /// The subcommand (`serve`), to find its part of the command line.
    const COMMAND: &'static str;

    fn server(args: &Self::Args) -> &ServerArgs;
    /// Product arguments that make no sense with `--config` (given on the command line).
    fn refuse_with_config(_explicit: &dyn Fn(&str) -> bool) -> anyhow::Result<()> {
        Ok(())
    }
    fn site_needs(args: &Self::Args) -> SiteNeeds;
    /// The ALPN protocols of a site that names none: `--alpn`, else the product's default.
    fn alpn(args: &Self::Args) -> Alpn;
    /// The one site of a server without `--config`.
    fn flag_origin(args: &Self::Args) -> anyhow::Result<Origin>;
    /// Argument errors that need no file read and no process started, found before any
    /// start-up work (the key daemon, certificates): an operator's typo fails at once.
    fn check_args(_args: &Self::Args, _with_config: bool) -> anyhow::Result<()> {
        Ok(())
    }
    fn build(
        args: &Self::Args,
        sites: Sites,
        stats: &Arc<Self::Stats>,
        runtime: &Arc<RuntimeStats>,
    ) -> anyhow::Result<Self>;
    /// Every counter, as `--stats` prints them and `/metrics` exposes them (the TLS layer's
    /// and the limits' are added to these).
    fn counters(stats: &Self::Stats, runtime: &RuntimeStats) -> Vec<(&'static str, u64)>;
    /// Start-up lines about the product itself.
    fn describe(_args: &Self::Args, _sites: &Sites) {}
    /// Descriptors one client connection may hold at once (see
    /// `RuntimeConfig::descriptors_per_connection`); `kernel_plane`: connections may be on it.
    fn descriptors_per_connection(_args: &Self::Args, _kernel_plane: bool) -> usize {
        1
    }
    /// The product's gauges (values that go down as well as up), as (name, help, value):
    /// `/metrics` exposes them as gauges and `--stats` prints them with the counters.
    fn gauges(_stats: &Self::Stats) -> Vec<(&'static str, &'static str, i64)> {
        Vec::new()
    }
    /// The product hands the socket itself to another program: handshakes must leave the
    /// client's first application data in it (`ServerOptions::exact_handshake_reads`).
    const HANDS_OFF_SOCKETS: bool = false;
}

/// A product's flags, standalone, to parse a configuration file's `[server]` table with.
#[derive(clap::Parser, Debug)]
#[command(no_binary_name = true)]
struct Flags<A: clap::Args> {
    #[command(flatten)]
    args: A,
}

/// A product's options as they are with no flag given (to check a file's sites when its
/// `[server]` table does not parse).
pub fn default_options<A: clap::Args + clap::FromArgMatches>() -> anyhow::Result<A> {
    use clap::Parser;
    Ok(Flags::<A>::try_parse_from(Vec::<std::ffi::OsString>::new())?.args)
}

/// With `--config`: the file's `[server]` options under the command line's (a flag given on
/// the command line wins), and the file itself.
fn with_config_file<P: Product>(
    args: P::Args,
    given: &clap::ArgMatches,
) -> anyhow::Result<(P::Args, Option<ConfigFile>)> {
    let Some(path) = P::server(&args).config.clone() else {
        return Ok((args, None));
    };
    let explicit =
        |id: &str| given.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    P::refuse_with_config(&explicit)?;
    let file = ConfigFile::read(&path).map_err(anyhow::Error::msg)?;
    file.check_product(P::COMMAND).map_err(anyhow::Error::msg)?;
    // The command line as given after the subcommand: parsed again behind the file's options.
    let cli: Vec<std::ffi::OsString> = std::env::args_os()
        .skip(1)
        .skip_while(|a| a != P::COMMAND)
        .skip(1)
        .collect();
    let merged = server_options_of::<P::Args>(&file, &explicit, cli)?;
    Ok((merged, Some(file)))
}

/// The global options of `file` (its `[server]` table) followed by the command-line tokens
/// `cli`, whose options (`explicit`) the file's do not repeat, parsed as flags `A`.
pub fn server_options_of<A: clap::Args + clap::FromArgMatches>(
    file: &ConfigFile,
    explicit: &dyn Fn(&str) -> bool,
    cli: Vec<std::ffi::OsString>,
) -> anyhow::Result<A> {
    use clap::{CommandFactory, FromArgMatches};
    let mut cmd = Flags::<A>::command();
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
    Ok(Flags::<A>::from_arg_matches(&matches)?.args)
}

/// Starts product `P` and serves until SIGTERM/SIGINT.
pub fn run<P: Product>(args: P::Args, given: &clap::ArgMatches) -> anyhow::Result<()> {
    let (args, file) = with_config_file::<P>(args, given)?;
    P::check_args(&args, file.is_some())?;
    let server = P::server(&args).clone();
    if let Some(user) = &server.user {
        user.check_can_switch()?;
    }
    // Before the kTLS probe and the certificates: a taken port is the cheapest error to find.
    runtime::refuse_taken(&server.listen)?;
    if let Some(admin) = &server.admin {
        crate::admin::refuse_taken(admin)?;
    }
    match tlsplane_sys::raise_nofile_limit() {
        Ok(n) => tracing::debug!(open_files = n, "open-files limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
    }
    let (flag_chain, flag_key) = match &file {
        Some(_) => (PathBuf::new(), PathBuf::new()),
        None => {
            refuse_secrets_under_flag_root::<P>(&args)?;
            flag_cert_paths(&server)?
        }
    };
    let daemon_args: Vec<std::ffi::OsString> = match &file {
        Some(f) => vec!["--config".into(), f.path.clone().into()],
        None => vec!["--key".into(), flag_key.clone().into()],
    };
    let keys = Keys::start(
        server.keyd.clone(),
        daemon_args,
        server.user.as_ref(),
        Duration::from_secs_f64(server.keyd_timeout),
        &crate::keys::KeydTls {
            cert: server.keyd_tls_cert.clone(),
            key: server.keyd_tls_key.clone(),
            ca: server.keyd_ca.clone(),
        },
        server.keyd_uid,
    )?;
    tracing::info!(
        "private keys: {}",
        match &server.keyd {
            crate::keys::KeydMode::On =>
                "in a key daemon (tlsplane keyd) started for this server".to_string(),
            crate::keys::KeydMode::Off => "read into this process (--keyd off)".to_string(),
            crate::keys::KeydMode::Unix(p) => format!("in the key daemon at {}", p.display()),
            crate::keys::KeydMode::Tls(urls) =>
                format!("in the key daemons at {}", urls.join(", ")),
        }
    );
    let loader = |p: &std::path::Path| keys.load(p);
    let sites = load_sites::<P>(&args, file.as_ref(), (&flag_chain, &flag_key), &loader)?;
    for w in &sites.warnings {
        tracing::warn!("{w}");
    }
    let runtime_stats = Arc::new(RuntimeStats::default());
    // One ticketer for the server's life; a reload installs the file's keys in it, a shared
    // store's follower the store's.
    let kek = server.store.read_kek()?;
    let store = server.store.store()?;
    let ticket_ring = match read_ticket_keys(server.ticket_keys.as_deref())? {
        Some(keys) => Some(TicketKeyRing::new(keys)),
        None => crate::ticket_store::start(
            &server.store,
            store.clone(),
            kek.as_ref().map(|k| &k[..]),
            runtime_stats.ticket_store.clone(),
        )?,
    };
    let limit_sync = fleet_limits(&server, store, kek.as_ref().map(|k| &k[..]), &runtime_stats)?;
    // Both keep what they derived from it, inside aws-lc; the bytes go now.
    drop(kek);
    let acceptor = Acceptor::new(server_options(
        &server,
        &sites,
        P::HANDS_OFF_SOCKETS,
        ticket_ring.clone(),
    ))?;
    tracing::info!(
        "data plane: {} ({})",
        server.data_plane,
        acceptor.kernel_support().reason
    );
    if file.is_some() {
        tracing::info!(
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
    P::describe(&args, &sites);

    let workers = server.workers.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let config = RuntimeConfig {
        listen: server.listen.clone(),
        workers,
        handshake_timeout: Duration::from_secs(server.handshake_timeout),
        send_timeout: (server.send_timeout > 0.0)
            .then(|| Duration::from_secs_f64(server.send_timeout)),
        shutdown_grace: Duration::from_secs(server.shutdown_grace),
        handshake_nice: server.handshake_nice,
        limits: server.limits.clone(),
        pid_file: server.pid_file.clone(),
        run_as: server.user.clone(),
        descriptors_per_connection: P::descriptors_per_connection(
            &args,
            acceptor.kernel_support().ulp && server.data_plane != DataPlanePolicy::User,
        ),
        limit_sync,
    };
    let stats = Arc::new(P::Stats::default());
    let first = Arc::new(P::build(&args, sites, &stats, &runtime_stats)?);
    // Kept to the end: its Unix socket is removed when it drops.
    let mut _admin = None;
    if let Some(addr) = &server.admin {
        let mut registry = prometheus_client::registry::Registry::with_prefix("tlsplane");
        let (s, r) = (stats.clone(), runtime_stats.clone());
        let open = runtime_stats.open.clone();
        let runtime = runtime_stats.clone();
        let product = stats.clone();
        registry.register_collector(Box::new(crate::admin::SnapshotCollector::new(
            move || counters::<P>(&s, &r),
            move || {
                let by_plane = tlsplane::stats::open_by_plane();
                let mut gauges = vec![
                    (
                        "connections_open",
                        "Connections accepted and not yet closed",
                        open.load(Relaxed) as i64,
                    ),
                    (
                        "connections_open_kernel_plane",
                        "Established connections whose records the kernel encrypts",
                        by_plane.kernel.load(Relaxed) as i64,
                    ),
                    (
                        "connections_open_user_plane",
                        "Established connections on the user-space record layer",
                        by_plane.user.load(Relaxed) as i64,
                    ),
                ];
                gauges.extend(runtime.limits.gauges());
                gauges.extend(store_gauges(&runtime));
                gauges.extend(P::gauges(&product));
                gauges
            },
        )));
        runtime_stats.histograms.register(&mut registry);
        _admin = Some(crate::admin::start(addr, registry)?);
    }
    // SIGHUP re-reads the configuration file, or without one the --cert/--key files (a
    // renewed certificate) and what the product serves.
    let reload: runtime::Reload<P> = {
        let (args, stats, runtime_stats) = (args.clone(), stats.clone(), runtime_stats.clone());
        let mut current = acceptor.clone();
        let keys = keys.clone();
        Box::new(move || {
            // Read first, installed last: a reload that fails leaves the keys in force.
            let ticket_keys = read_ticket_keys(P::server(&args).ticket_keys.as_deref())?;
            let key_generation = keys.reload()?;
            let mut not_applied = None;
            let reread = match &file {
                Some(first) => {
                    let f = ConfigFile::read(&first.path).map_err(anyhow::Error::msg)?;
                    let changed = changed_keys(&first.server, &f.server);
                    if !changed.is_empty() {
                        not_applied = Some(format!(
                            "{}: [server] {} changed: global options take effect at the next restart (sites, certificates and what they serve were reloaded)",
                            first.path.display(),
                            changed.join(", ")
                        ));
                    }
                    Some(f)
                }
                None => None,
            };
            let loader = |p: &std::path::Path| keys.load(p);
            let sites = load_sites::<P>(&args, reread.as_ref(), (&flag_chain, &flag_key), &loader)?;
            for w in &sites.warnings {
                tracing::warn!("{w}");
            }
            let acceptor = current.reload(server_options(
                P::server(&args),
                &sites,
                P::HANDS_OFF_SOCKETS,
                ticket_ring.clone(),
            ))?;
            let handler = Arc::new(P::build(&args, sites, &stats, &runtime_stats)?);
            current = acceptor.clone();
            // Installed by the runtime as soon as this returns.
            keys.commit(key_generation);
            if let (Some(ring), Some(new)) = (&ticket_ring, ticket_keys) {
                ring.install(new);
            }
            Ok((Generation { acceptor, handler }, not_applied))
        })
    };
    let (restarted, requests) = tokio::sync::mpsc::unbounded_channel();
    keys.supervise(restarted, runtime_stats.clone());
    let served = runtime::run(
        config,
        Generation {
            acceptor,
            handler: first,
        },
        reload,
        Some(requests),
        runtime_stats.clone(),
    );
    keys.stop();
    served?;
    if server.stats {
        let mut pairs = counters::<P>(&stats, &runtime_stats);
        pairs.extend(
            runtime_stats
                .limits
                .gauges()
                .into_iter()
                .chain(store_gauges(&runtime_stats))
                .chain(P::gauges(&stats))
                .map(|(name, _, v)| (name, v.max(0) as u64)),
        );
        eprintln!("tlsplane-stats {}", tlsplane::stats::to_json(&pairs));
    }
    Ok(())
}

/// --fleet-limits: the exchange of per-client counts, once the flags make sense together.
fn fleet_limits(
    server: &ServerArgs,
    store: Option<crate::ticket_store::Store>,
    kek: Option<&[u8]>,
    stats: &RuntimeStats,
) -> anyhow::Result<Option<crate::limit_sync::LimitSync>> {
    check_fleet_limits(server)?;
    let l = &server.limits;
    let (true, Some(store), Some(kek)) = (l.fleet_limits, store, kek) else {
        return Ok(None);
    };
    tracing::info!(
        "fleet limits: per-client rates shared through {store}, counts exchanged every {} s",
        l.fleet_limits_period
    );
    Ok(Some(crate::limit_sync::LimitSync::new(
        store,
        &server.store.fleet,
        kek,
        Duration::from_secs_f64(l.fleet_limits_period),
        stats.limit_sync.clone(),
    )))
}

/// What `check-config` checks of the fleet's options, as a server would at start: the
/// key-encryption key reads, and --fleet-limits has what it needs.
pub fn check_fleet(server: &ServerArgs) -> anyhow::Result<()> {
    server.store.read_kek()?;
    server.store.store()?;
    check_fleet_limits(server)
}

fn check_fleet_limits(server: &ServerArgs) -> anyhow::Result<()> {
    let l = &server.limits;
    if !l.fleet_limits {
        return Ok(());
    }
    if server.store.ticket_store.is_none() {
        anyhow::bail!(
            "--fleet-limits exchanges counts through the fleet's store: give --ticket-store URL and --ticket-store-kek FILE"
        );
    }
    if !(l.fleet_limits_period > 0.0 && l.fleet_limits_period <= 60.0) {
        anyhow::bail!(
            "--fleet-limits-period {}: seconds, more than 0 and at most 60",
            l.fleet_limits_period
        );
    }
    let rates = [
        l.client_handshake_rate,
        l.client_resumed_rate,
        l.client_incomplete_rate,
    ];
    if rates.iter().all(|r| *r == crate::limits::Rate::ZERO) {
        anyhow::bail!(
            "--fleet-limits shares the per-client rates, and none is set: give --client-handshake-rate, --client-resumed-rate or --client-incomplete-rate"
        );
    }
    Ok(())
}

/// The shared ticket store's gauges.
fn store_gauges(r: &RuntimeStats) -> Vec<(&'static str, &'static str, i64)> {
    vec![
        (
            "limit_sync_lag_milliseconds",
            "Age of the fleet's per-client counts held here (--fleet-limits; -1: none yet)",
            r.limit_sync.lag_ms(),
        ),
        (
            "ticket_store_connected",
            "1 while the shared ticket-key store answers (--ticket-store)",
            r.ticket_store.connected.load(Relaxed),
        ),
        (
            "ticket_key_generation",
            "Generation of the shared ticket keys in use (0: keys of this process)",
            r.ticket_store.generation.load(Relaxed),
        ),
    ]
}

/// The keys of two `[server]` tables whose values differ (or that only one has), sorted.
fn changed_keys(before: &toml::Table, after: &toml::Table) -> Vec<String> {
    let mut keys: Vec<String> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

fn counters<P: Product>(stats: &P::Stats, r: &RuntimeStats) -> Vec<(&'static str, u64)> {
    let mut pairs = tlsplane::stats::global().snapshot();
    pairs.extend(P::counters(stats, r));
    pairs.extend([
        ("task_panics", r.task_panics.load(Relaxed)),
        ("idle_evicted", r.idle_evicted.load(Relaxed)),
        ("accept_emfile", r.accept_emfile.load(Relaxed)),
        ("first_byte_timeouts", r.first_byte_timeouts.load(Relaxed)),
        ("handshakes_evicted", r.handshakes_evicted.load(Relaxed)),
        ("first_request_here", r.first_request_here.load(Relaxed)),
        ("first_request_moved", r.first_request_moved.load(Relaxed)),
        ("reloads", r.reloads.load(Relaxed)),
        ("reload_failures", r.reload_failures.load(Relaxed)),
        ("keyd_restarts", r.keyd_restarts.load(Relaxed)),
        ("keyd_stuck", r.keyd_stuck.load(Relaxed)),
        ("keyd_reconnects", r.keyd_reconnects.load(Relaxed)),
        (
            "ticket_store_rotations",
            r.ticket_store.rotations.load(Relaxed),
        ),
        (
            "ticket_store_installs",
            r.ticket_store.installs.load(Relaxed),
        ),
        ("ticket_store_errors", r.ticket_store.errors.load(Relaxed)),
        ("ticket_store_heals", r.ticket_store.heals.load(Relaxed)),
        (
            "ticket_store_leases_cut",
            r.ticket_store.leases_cut.load(Relaxed),
        ),
        ("ticket_store_expired", r.ticket_store.expired.load(Relaxed)),
        ("limit_sync_rounds", r.limit_sync.rounds.load(Relaxed)),
        ("limit_sync_errors", r.limit_sync.errors.load(Relaxed)),
        ("limit_sync_clients", r.limit_sync.clients.load(Relaxed)),
        (
            "limit_sync_remote_tokens",
            r.limit_sync.remote_tokens.load(Relaxed),
        ),
        ("limit_sync_dropped", r.limit_sync.dropped.load(Relaxed)),
    ]);
    pairs.extend(r.limits.snapshot());
    pairs
}

/// The certificate and key of a server without --config: --cert/--key, or the generated
/// localhost certificate (made on first use).
fn flag_cert_paths(args: &ServerArgs) -> anyhow::Result<(PathBuf, PathBuf)> {
    if let (Some(c), Some(k)) = (&args.cert, &args.key) {
        return Ok((c.clone(), k.clone()));
    }
    generated_cert()
}

#[cfg(feature = "localhost-cert")]
fn generated_cert() -> anyhow::Result<(PathBuf, PathBuf)> {
    let dir = tlsplane::cert::default_state_dir();
    let g = tlsplane::cert::ensure_localhost_cert(&dir)?;
    tracing::info!(
        "certificate: {} ({} for localhost, 127.0.0.1, ::1, issued by a local CA; trust it with e.g. curl --cacert {} https://localhost:PORT/)",
        g.cert.display(),
        if g.created { "generated" } else { "reusing" },
        g.ca.display()
    );
    Ok((g.cert, g.key))
}

#[cfg(not(feature = "localhost-cert"))]
fn generated_cert() -> anyhow::Result<(PathBuf, PathBuf)> {
    anyhow::bail!(
        "give --cert and --key: this build generates no certificate (the `localhost-cert` feature is off)"
    )
}

/// The sites: from the configuration file, else one from the command line (the product's
/// origin and the `flag` certificate and key). A document root holding one of the server's
/// secrets is refused, and every root withholds them (at start and at each reload).
fn load_sites<P: Product>(
    args: &P::Args,
    file: Option<&ConfigFile>,
    flag: (&std::path::Path, &std::path::Path),
    keys: crate::config::KeyLoader,
) -> anyhow::Result<Sites> {
    let alpn = P::alpn(args);
    let mut sites = match file {
        Some(file) => crate::config::load_sites(file, &P::site_needs(args), &alpn, keys)
            .map_err(|errors| anyhow::anyhow!("{}", errors.join("\n")))?,
        None => crate::config::single_site(P::flag_origin(args)?, flag.0, flag.1, &alpn, keys)?,
    };
    let server = P::server(args);
    let state_dir = generated_cert_dir(server, file.is_some());
    ServedSecrets::of(
        server,
        file,
        file.is_none().then_some(flag.1),
        state_dir.as_deref(),
    )
    .guard(&mut sites)
    .map_err(|errors| anyhow::anyhow!("{}", errors.join("\n")))?;
    Ok(sites)
}

/// Where the generated localhost certificate and its key live, when the server uses it (no
/// --config, no --cert/--key).
fn generated_cert_dir(server: &ServerArgs, with_config: bool) -> Option<PathBuf> {
    (!with_config && server.key.is_none()).then(tlsplane::cert::default_state_dir)
}

/// Without --config, before anything is started or generated (the key daemon, the localhost
/// key in the state directory): the served directory must hold none of the server's secrets.
/// (`load_sites` checks again, as at each reload.)
fn refuse_secrets_under_flag_root<P: Product>(args: &P::Args) -> anyhow::Result<()> {
    let server = P::server(args);
    let state_dir = generated_cert_dir(server, false);
    if let Origin::Root(root) = P::flag_origin(args)? {
        let secrets = ServedSecrets::of(server, None, server.key.as_deref(), state_dir.as_deref());
        let errors = secrets.under(&root, "default");
        if !errors.is_empty() {
            let hint = if state_dir.is_some_and(|d| root.contains(&d)) {
                " (set TLSPLANE_HOME to a directory outside it, or give --cert and --key)"
            } else {
                ""
            };
            anyhow::bail!("{}{hint}", errors.join("\n"));
        }
    }
    Ok(())
}

/// The acceptor's options: the sites' TLS and the global TLS options.
fn server_options(
    args: &ServerArgs,
    sites: &Sites,
    hands_off_sockets: bool,
    ticket_keys: Option<Arc<TicketKeyRing>>,
) -> ServerOptions {
    ServerOptions {
        ticket_keys,
        sites: sites.tls.clone(),
        names: sites.names.clone(),
        unknown_name: args.unknown_name,
        policy: args.data_plane,
        tls13_tickets: args.tls13_tickets,
        aead_record_limit: args.aead_record_limit,
        plain_http_response: Some(plain_http_response().into()),
        max_client_hello: args.limits.max_client_hello,
        max_client_hello_records: args.limits.max_client_hello_records,
        max_psk_identities: args.limits.max_psk_identities,
        key_updates_per_second: args.limits.key_updates_per_second,
        linger: tlsplane::Linger {
            timeout: Duration::from_secs_f64(args.linger_timeout),
            time: Duration::from_secs_f64(args.linger_time),
            max_bytes: args.linger_max_bytes,
        },
        exact_handshake_reads: hands_off_sockets,
    }
}

/// The session-ticket keys of `--ticket-keys`, read now (at start, at each reload, and by
/// check-config).
pub fn read_ticket_keys(path: Option<&std::path::Path>) -> anyhow::Result<Option<Arc<TicketKeys>>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let context =
        |e: &dyn std::fmt::Display| anyhow::anyhow!("--ticket-keys {}: {e}", path.display());
    // A key file is a few hundred bytes.
    let file = crate::secret_file::read(path, 64 * 1024).map_err(|e| context(&e))?;
    let keys = TicketKeys::parse(file.text().map_err(|e| context(&e))?).map_err(|e| context(&e))?;
    if file.world_readable {
        tracing::warn!(
            "--ticket-keys {}: readable by every user of this machine; whoever reads it can decrypt the sessions it resumes (chmod o-r)",
            path.display()
        );
    }
    // The name is in every ticket, not a secret: it shows which key the servers encrypt with.
    let name = keys.current_name();
    tracing::info!(
        "session tickets: {} keys from {}, encrypting with the key named {:02x}{:02x}{:02x}{:02x}...",
        keys.len(),
        path.display(),
        name[0],
        name[1],
        name[2],
        name[3]
    );
    Ok(Some(Arc::new(keys)))
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
