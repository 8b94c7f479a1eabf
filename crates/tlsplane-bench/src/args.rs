//! Command-line arguments and their validation into a [`Plan`].

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;

use crate::tls;

/// TLS protocol version selectable with `--tls`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum TlsVersion {
    /// TLS 1.2 only.
    #[value(name = "1.2")]
    V12,
    /// TLS 1.3 only.
    #[value(name = "1.3")]
    V13,
}

impl TlsVersion {
    pub(crate) fn flag(self) -> &'static str {
        match self {
            TlsVersion::V12 => "1.2",
            TlsVersion::V13 => "1.3",
        }
    }
}

/// Key-exchange group selectable with `--group`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Group {
    #[value(name = "x25519")]
    X25519,
    /// Hybrid post-quantum group (TLS 1.3 only).
    #[value(name = "x25519mlkem768")]
    X25519Mlkem768,
    #[value(name = "secp256r1")]
    Secp256r1,
    #[value(name = "secp384r1")]
    Secp384r1,
}

/// Session resumption mode for `bench handshake --resume`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum ResumeMode {
    /// Every handshake is a full one: the client session cache is disabled.
    #[default]
    None,
    /// TLS 1.2 session resumption (tickets, or session ids if the server
    /// sends no ticket). Implies `--tls 1.2`.
    Tickets,
    /// TLS 1.3 PSK resumption from the server's NewSessionTicket messages.
    /// Implies `--tls 1.3`.
    Psk,
}

/// I/O engine running the connection loops.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum EngineChoice {
    /// `blocking` when every connection loop has its own OS thread
    /// (`--connections` <= `--threads`), else `tokio`.
    #[default]
    Auto,
    /// One OS thread per connection loop, blocking std::net sockets driving
    /// rustls directly. Requires `--connections` <= `--threads`.
    Blocking,
    /// `--threads` current-thread tokio runtimes multiplexing the loops
    /// (rustls driven by hand for handshakes, tokio-rustls for throughput).
    Tokio,
}

/// The engine actually used.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Engine {
    Blocking,
    Tokio,
}

impl Engine {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Engine::Blocking => "blocking",
            Engine::Tokio => "tokio",
        }
    }
}

/// Load-shape options shared by both benchmarks.
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Concurrent connection loops.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub connections: u32,
    /// OS threads (each blocking loop, or each tokio runtime, gets one).
    #[arg(long, value_name = "T", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub threads: u32,
    /// Measured run time in seconds (default 10 unless --count is given).
    #[arg(long, value_name = "SECS", value_parser = parse_positive_secs)]
    pub duration: Option<f64>,
    /// Seconds of unmeasured load before measuring starts.
    #[arg(long, value_name = "SECS", default_value = "0", value_parser = parse_non_negative_secs)]
    pub warmup: f64,
    /// Time limit per handshake cycle / per request, in seconds; exceeding
    /// it counts as a "timeout" failure.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = parse_positive_secs)]
    pub timeout: f64,
    /// Print one JSON object on stdout instead of the human-readable report.
    #[arg(long)]
    pub json: bool,
    /// I/O engine.
    #[arg(long, value_enum, default_value_t = EngineChoice::Auto)]
    pub engine: EngineChoice,
}

/// TLS options shared by both benchmarks.
#[derive(Args, Debug, Clone)]
pub struct TlsArgs {
    /// Offer only this TLS version (default: offer 1.3 and 1.2).
    #[arg(long = "tls", value_enum, value_name = "VERSION")]
    pub tls: Option<TlsVersion>,
    /// Offer only this key-exchange group.
    #[arg(long, value_enum)]
    pub group: Option<Group>,
    /// Offer only this cipher suite (rustls name, case-insensitive), e.g.
    /// TLS13_AES_128_GCM_SHA256 or TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256.
    #[arg(long, value_name = "NAME")]
    pub cipher: Option<String>,
    /// Server name sent as SNI and verified against the certificate
    /// (default: the target host if it is a DNS name, else "localhost").
    #[arg(long, value_name = "NAME")]
    pub sni: Option<String>,
    /// PEM file with the trust anchor(s) for verifying the server certificate.
    #[arg(long, value_name = "PEM")]
    pub cacert: Option<PathBuf>,
    /// Do not verify the server certificate (handshake signatures are still
    /// checked). One of --cacert or this flag is required.
    #[arg(long, conflicts_with = "cacert")]
    pub insecure_no_verify: bool,
    /// Connect to ADDR for NAME:PORT instead of resolving NAME, as curl's --resolve (the
    /// name is still sent as SNI and checked in the certificate). Repeatable.
    #[arg(long, value_name = "NAME:PORT:ADDR")]
    pub resolve: Vec<String>,
}

/// `tlsplane bench handshake TARGET`
#[derive(Args, Debug, Clone)]
pub struct HandshakeArgs {
    /// Server address as host:port (e.g. 127.0.0.1:8443).
    pub target: String,
    #[command(flatten)]
    pub load: LoadArgs,
    /// Total measured handshakes (instead of --duration).
    #[arg(long, value_name = "N", conflicts_with = "duration",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Session resumption (per connection loop, via rustls' client session store).
    #[arg(long, value_enum, default_value_t = ResumeMode::None)]
    pub resume: ResumeMode,
    /// ALPN protocols to offer, comma-separated ("" offers none).
    #[arg(long, value_name = "LIST", default_value = "http/1.1")]
    pub alpn: String,
    /// After the handshake, GET this path (Connection: close) and read the
    /// whole response; a non-2xx status counts as a failure.
    #[arg(long, value_name = "PATH")]
    pub request: Option<String>,
    /// More servers of the same fleet (comma list or repeated): each connection loop connects
    /// to TARGET and these in turn, with one server name and one session store, as a client
    /// behind a round-robin balancer would (so `--resume` shows how many resumptions survive
    /// landing on another server).
    #[arg(long, value_name = "HOST:PORT", value_delimiter = ',')]
    pub also: Vec<String>,
}

/// `tlsplane bench throughput URL`
#[derive(Args, Debug, Clone)]
pub struct ThroughputArgs {
    /// https://host:port/path to GET repeatedly over keep-alive connections.
    pub url: String,
    #[command(flatten)]
    pub load: LoadArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Hash every response body and count a mismatch with this SHA-256 (hex) as a failure.
    #[arg(long, value_name = "HEX", value_parser = parse_sha256_hex)]
    pub verify_sha256: Option<[u8; 32]>,
}

/// `tlsplane bench flood TARGET`
#[derive(Args, Debug, Clone)]
pub struct FloodArgs {
    /// Server address as host:port (e.g. 127.0.0.1:8443).
    pub target: String,
    /// Connections kept in flight (each: connect, canned ClientHello, read the
    /// server's first flight, reset; repeat).
    #[arg(long, value_name = "C", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub concurrency: u32,
    /// OS threads, each a current-thread tokio runtime with its share of the
    /// connections.
    #[arg(long, value_name = "T", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub threads: u32,
    /// Measured run time in seconds (default 10 unless --count is given).
    #[arg(long, value_name = "SECS", value_parser = parse_positive_secs)]
    pub duration: Option<f64>,
    /// Total measured attempts (instead of --duration).
    #[arg(long, value_name = "N", conflicts_with = "duration",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
    /// Seconds of unmeasured flood before measuring starts.
    #[arg(long, value_name = "SECS", default_value = "0", value_parser = parse_non_negative_secs)]
    pub warmup: f64,
    /// Time limit per attempt (connect to the end of the server's first
    /// flight), in seconds; exceeding it counts as a "timeout" failure.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = parse_positive_secs)]
    pub timeout: f64,
    /// Offer only this TLS version in the ClientHello (default: 1.3 and 1.2).
    #[arg(long = "tls", value_enum, value_name = "VERSION")]
    pub tls: Option<TlsVersion>,
    /// Offer (and send a key share for) only this group.
    #[arg(long, value_enum)]
    pub group: Option<Group>,
    /// Offer only this cipher suite (rustls name, case-insensitive).
    #[arg(long, value_name = "NAME")]
    pub cipher: Option<String>,
    /// Server name sent as SNI (default: the target host if it is a DNS name,
    /// else "localhost").
    #[arg(long, value_name = "NAME")]
    pub sni: Option<String>,
    /// Connect to ADDR for NAME:PORT instead of resolving NAME, as curl's --resolve.
    /// Repeatable.
    #[arg(long, value_name = "NAME:PORT:ADDR")]
    pub resolve: Vec<String>,
    /// ALPN protocols to offer, comma-separated ("" offers none).
    #[arg(long, value_name = "LIST", default_value = "http/1.1")]
    pub alpn: String,
    /// Records that make up the server's first flight. Default: learnt from
    /// one probe handshake with the canned ClientHello before the flood; give
    /// it to skip the probe.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub flight_records: Option<u32>,
    /// Print one JSON object on stdout instead of the human-readable report.
    #[arg(long)]
    pub json: bool,
}

/// `tlsplane bench hold TARGET`
#[derive(Args, Debug, Clone)]
pub struct HoldArgs {
    /// Server address as host:port (e.g. 127.0.0.1:8443).
    pub target: String,
    /// Connections to open and hold (each: handshake, one keep-alive GET).
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub connections: u32,
    /// OS threads opening connections in parallel.
    #[arg(long, value_name = "T", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: u32,
    /// Local addresses to connect from, in turn: a comma-separated list of addresses and
    /// IPv4 ranges, e.g. `127.0.0.2-127.0.0.9` (one address has ~28,000 source ports
    /// towards one server). Default: the kernel's choice.
    #[arg(long, value_name = "LIST")]
    pub sources: Option<String>,
    /// Path each connection GETs once (the response must keep the connection open).
    #[arg(long, value_name = "PATH", default_value = "/")]
    pub request: String,
    /// Process id(s) of the server whose resident set (VmRSS) is read before the first
    /// connection and after the last: the report divides the growth by the connections held.
    #[arg(long = "server-pid", value_name = "PID")]
    pub server_pids: Vec<u32>,
    /// Seconds between the last connection opening and the server's RSS being read.
    #[arg(long, value_name = "SECS", default_value = "0.5", value_parser = parse_non_negative_secs)]
    pub settle: f64,
    /// Seconds to keep every connection open after the checks (e.g. to look at the server).
    #[arg(long, value_name = "SECS", default_value = "0", value_parser = parse_non_negative_secs)]
    pub hold: f64,
    /// Time limit per connect, and per read or write, in seconds.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = parse_positive_secs)]
    pub timeout: f64,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Session resumption across the held connections (one client session store):
    /// `tickets` (TLS 1.2) and `psk` (TLS 1.3) make all but the first few connections cheap
    /// to open, which matters where handshakes are slow (emulated guests).
    #[arg(long, value_enum, default_value_t = ResumeMode::None)]
    pub resume: ResumeMode,
    /// ALPN protocols to offer, comma-separated ("" offers none).
    #[arg(long, value_name = "LIST", default_value = "http/1.1")]
    pub alpn: String,
    /// Print one JSON object on stdout instead of the human-readable report.
    #[arg(long)]
    pub json: bool,
}

impl HoldArgs {
    pub(crate) fn plan(&self) -> Result<crate::hold::HoldPlan> {
        let (host, port) = split_host_port(&self.target)?;
        let path = self.request.clone();
        check_request_path(&path)?;
        let verify = tls::verify_mode(&self.tls)?;
        let (config, _) =
            tls::build_config(&self.tls, self.resume, parse_alpn(&self.alpn)?, verify)?;
        let config = tls::loop_config(&config, self.resume != ResumeMode::None);
        let addr = resolve(&host, port, &self.tls.resolve)?;
        let sources = match &self.sources {
            None => Vec::new(),
            Some(list) => parse_sources(list)?,
        };
        if let Some(bad) = sources.iter().find(|s| s.is_ipv4() != addr.is_ipv4()) {
            bail!("--sources: {bad} is not of the target's address family ({addr})");
        }
        let host_header = host_header(&host, self.tls.sni.as_deref(), port);
        Ok(crate::hold::HoldPlan {
            target_label: self.target.trim().to_string(),
            addr,
            server_name: server_name_for(&host, self.tls.sni.as_deref())?,
            connections: self.connections as usize,
            threads: (self.threads as usize).min(self.connections as usize),
            sources,
            request: format!("GET {path} HTTP/1.1\r\nHost: {host_header}\r\n\r\n").into_bytes(),
            path,
            timeout: Duration::from_secs_f64(self.timeout),
            config,
            server_pids: self.server_pids.clone(),
            settle: Duration::from_secs_f64(self.settle),
            hold: Duration::from_secs_f64(self.hold),
        })
    }
}

/// `--request PATH`: an absolute path, nothing that would break the request line.
fn check_request_path(path: &str) -> Result<()> {
    if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
        bail!("--request: expected an absolute path like /index.html, got `{path}`");
    }
    Ok(())
}

/// `127.0.0.2-127.0.0.9,::1` -> the addresses, ranges expanded (IPv4 only, at most 1,024).
pub(crate) fn parse_sources(list: &str) -> Result<Vec<IpAddr>> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = || anyhow!("--sources: `{item}` is not an address or an IPv4 range A-B");
        match item.split_once('-') {
            None => out.push(item.parse::<IpAddr>().map_err(|_| bad())?),
            Some((a, b)) => {
                let a: std::net::Ipv4Addr = a.trim().parse().map_err(|_| bad())?;
                let b: std::net::Ipv4Addr = b.trim().parse().map_err(|_| bad())?;
                let (a, b) = (u32::from(a), u32::from(b));
                if b < a || b - a >= 1024 {
                    bail!("--sources: `{item}`: the range must go up, by at most 1,024 addresses");
                }
                out.extend((a..=b).map(|v| IpAddr::V4(v.into())));
            }
        }
    }
    if out.is_empty() {
        bail!("--sources: no address in `{list}`");
    }
    Ok(out)
}

fn parse_secs(s: &str, allow_zero: bool) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !v.is_finite() || v < 0.0 || (!allow_zero && v == 0.0) || v > 1.0e7 {
        return Err(format!(
            "`{s}` is out of range (seconds, {})",
            if allow_zero { ">= 0" } else { "> 0" }
        ));
    }
    Ok(v)
}

fn parse_positive_secs(s: &str) -> Result<f64, String> {
    parse_secs(s, false)
}

fn parse_non_negative_secs(s: &str) -> Result<f64, String> {
    parse_secs(s, true)
}

pub(crate) fn parse_sha256_hex(s: &str) -> Result<[u8; 32], String> {
    let s = s.trim();
    if s.len() != 64 || !s.is_ascii() {
        return Err("expected 64 hex digits".into());
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
            .map_err(|_| "expected 64 hex digits".to_string())?;
    }
    Ok(out)
}

/// When the measured phase ends.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) enum Stop {
    After(Duration),
    Count(u64),
}

/// Everything a run needs, validated.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub target_label: String,
    pub addr: SocketAddr,
    pub server_name: ServerName<'static>,
    /// Value of the Host header.
    pub host_header: String,
    pub connections: usize,
    pub threads: usize,
    pub engine: Engine,
    pub stop: Stop,
    pub warmup: Duration,
    pub timeout: Duration,
    /// Base client config; each loop clones it with its own session store.
    pub config: Arc<ClientConfig>,
    /// Whether each loop gets a client session cache (resumption on).
    pub session_cache: bool,
    /// The only version offered, or `None` for both 1.3 and 1.2.
    #[cfg_attr(not(test), allow(dead_code))]
    pub version: Option<TlsVersion>,
}

/// Splits `host:port` (IPv6 as `[addr]:port`).
pub(crate) fn split_host_port(s: &str) -> Result<(String, u16)> {
    let s = s.trim();
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| anyhow!("`{s}`: missing `]`"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| anyhow!("`{s}`: expected [ipv6]:port"))?;
        (h, port)
    } else {
        s.rsplit_once(':')
            .ok_or_else(|| anyhow!("`{s}`: expected host:port"))?
    };
    if host.is_empty() {
        bail!("`{s}`: empty host");
    }
    if !s.starts_with('[') && host.contains(':') {
        bail!("`{s}`: write IPv6 addresses as [addr]:port");
    }
    let port: u16 = port
        .parse()
        .map_err(|_| anyhow!("`{s}`: bad port `{port}`"))?;
    if port == 0 {
        bail!("`{s}`: port 0");
    }
    Ok((host.to_string(), port))
}

/// Parsed `https://host[:port][/path]`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HttpsUrl {
    pub host: String,
    pub port: u16,
    pub path: String,
}

pub(crate) fn parse_https_url(url: &str) -> Result<HttpsUrl> {
    let rest = url
        .trim()
        .strip_prefix("https://")
        .ok_or_else(|| anyhow!("`{url}`: only https:// URLs are supported"))?;
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_string()),
        Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
        None => (rest, "/".to_string()),
    };
    if authority.contains('@') {
        bail!("`{url}`: user info is not supported");
    }
    let has_port = if let Some(after) = authority.strip_prefix('[') {
        after.contains("]:")
    } else {
        authority.contains(':')
    };
    let (host, port) = if has_port {
        split_host_port(authority)?
    } else {
        let h = authority.trim_start_matches('[').trim_end_matches(']');
        if h.is_empty() {
            bail!("`{url}`: empty host");
        }
        (h.to_string(), 443)
    };
    if path.bytes().any(|b| b <= b' ' || b == 0x7f) {
        bail!("`{url}`: the path must not contain spaces or control characters");
    }
    Ok(HttpsUrl { host, port, path })
}

/// `--resolve NAME:PORT:ADDR` entries, as curl takes them (ADDR may be an IPv6 address in
/// brackets); a NAME of `*` matches every host.
fn resolve_override(entries: &[String], host: &str, port: u16) -> Result<Option<SocketAddr>> {
    for e in entries {
        let mut parts = e.splitn(3, ':');
        let (Some(name), Some(p), Some(addr)) = (parts.next(), parts.next(), parts.next()) else {
            bail!("--resolve `{e}`: expected NAME:PORT:ADDR");
        };
        let p: u16 = p
            .parse()
            .map_err(|_| anyhow!("--resolve `{e}`: bad port `{p}`"))?;
        let addr = addr.trim_start_matches('[').trim_end_matches(']');
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| anyhow!("--resolve `{e}`: `{addr}` is not an IP address"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if p == port && (name == "*" || name.eq_ignore_ascii_case(host)) {
            return Ok(Some(SocketAddr::new(ip, port)));
        }
    }
    Ok(None)
}

fn resolve(host: &str, port: u16, overrides: &[String]) -> Result<SocketAddr> {
    if let Some(addr) = resolve_override(overrides, host, port)? {
        return Ok(addr);
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (host, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {host}"))?
        .next()
        .ok_or_else(|| anyhow!("{host}: no addresses"))
}

/// SNI: explicit `--sni`, else the host if it is a DNS name, else "localhost".
pub(crate) fn server_name_for(host: &str, sni: Option<&str>) -> Result<ServerName<'static>> {
    let name = match sni {
        Some(n) => n.to_string(),
        None if host.parse::<IpAddr>().is_ok() => "localhost".to_string(),
        None => host.to_string(),
    };
    // Leaked once per run so per-handshake clones of the name are free.
    let name: &'static str = Box::leak(name.into_boxed_str());
    ServerName::try_from(name).map_err(|e| anyhow!("invalid server name `{name}`: {e}"))
}

fn host_header(host: &str, sni: Option<&str>, port: u16) -> String {
    let h = sni.unwrap_or(host);
    let h = if h.contains(':') && !h.starts_with('[') {
        format!("[{h}]")
    } else {
        h.to_string()
    };
    if port == 443 {
        h
    } else {
        format!("{h}:{port}")
    }
}

/// Picks the engine and the effective thread count.
pub(crate) fn choose_engine(
    choice: EngineChoice,
    connections: u32,
    threads: u32,
) -> Result<(Engine, usize)> {
    let threads = threads.min(connections) as usize;
    let one_per_thread = connections as usize <= threads;
    match choice {
        EngineChoice::Auto if one_per_thread => Ok((Engine::Blocking, threads)),
        EngineChoice::Auto | EngineChoice::Tokio => Ok((Engine::Tokio, threads)),
        EngineChoice::Blocking if one_per_thread => Ok((Engine::Blocking, threads)),
        EngineChoice::Blocking => bail!(
            "--engine blocking runs one connection loop per OS thread: \
             use --threads {connections} (or --engine tokio)"
        ),
    }
}

/// Which versions end up offered, given all flags that constrain them.
pub(crate) fn resolve_version(
    tls: Option<TlsVersion>,
    cipher_version: Option<TlsVersion>,
    group: Option<Group>,
    resume: ResumeMode,
) -> Result<Option<TlsVersion>> {
    let mut v: Option<(TlsVersion, String)> = tls.map(|t| (t, format!("--tls {}", t.flag())));
    let mut constrain = |want: TlsVersion, why: String| -> Result<()> {
        match &v {
            Some((have, by)) if *have != want => bail!(
                "{why} needs TLS {}, but {by} selects TLS {}",
                want.flag(),
                have.flag()
            ),
            Some(_) => Ok(()),
            None => {
                v = Some((want, why));
                Ok(())
            }
        }
    };
    if let Some(cv) = cipher_version {
        constrain(cv, "--cipher".into())?;
    }
    match resume {
        ResumeMode::Tickets => constrain(TlsVersion::V12, "--resume tickets".into())?,
        ResumeMode::Psk => constrain(TlsVersion::V13, "--resume psk".into())?,
        ResumeMode::None => {}
    }
    if group == Some(Group::X25519Mlkem768) {
        constrain(TlsVersion::V13, "--group x25519mlkem768".into())?;
    }
    Ok(v.map(|(t, _)| t))
}

#[allow(clippy::too_many_arguments)]
fn common_plan(
    label: String,
    host: &str,
    port: u16,
    load: &LoadArgs,
    tls_args: &TlsArgs,
    resume: ResumeMode,
    session_cache: bool,
    alpn: Vec<Vec<u8>>,
    stop: Stop,
) -> Result<Plan> {
    let verify = tls::verify_mode(tls_args)?;
    let (engine, threads) = choose_engine(load.engine, load.connections, load.threads)?;
    let (config, version) = tls::build_config(tls_args, resume, alpn, verify)?;
    let server_name = server_name_for(host, tls_args.sni.as_deref())?;
    let addr = resolve(host, port, &tls_args.resolve)?;
    Ok(Plan {
        target_label: label,
        addr,
        server_name,
        host_header: host_header(host, tls_args.sni.as_deref(), port),
        connections: load.connections as usize,
        threads,
        engine,
        stop,
        warmup: Duration::from_secs_f64(load.warmup),
        timeout: Duration::from_secs_f64(load.timeout),
        config: Arc::new(config),
        session_cache,
        version,
    })
}

pub(crate) fn parse_alpn(list: &str) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for p in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if p.len() > 255 {
            bail!("--alpn: protocol `{p}` is longer than 255 bytes");
        }
        out.push(p.as_bytes().to_vec());
    }
    Ok(out)
}

impl HandshakeArgs {
    /// The addresses of `--also`, resolved as TARGET is.
    pub(crate) fn also_addrs(&self) -> Result<Vec<SocketAddr>> {
        self.also
            .iter()
            .map(|t| {
                let (host, port) = split_host_port(t)?;
                resolve(&host, port, &self.tls.resolve)
            })
            .collect()
    }

    pub(crate) fn plan(&self) -> Result<(Plan, Option<Vec<u8>>)> {
        let (host, port) = split_host_port(&self.target)?;
        let stop = match (self.count, self.load.duration) {
            (Some(_), Some(_)) => bail!("use either --count or --duration, not both"),
            (Some(n), None) => Stop::Count(n),
            (None, d) => Stop::After(Duration::from_secs_f64(d.unwrap_or(10.0))),
        };
        let alpn = parse_alpn(&self.alpn)?;
        let plan = common_plan(
            self.target.trim().to_string(),
            &host,
            port,
            &self.load,
            &self.tls,
            self.resume,
            self.resume != ResumeMode::None,
            alpn,
            stop,
        )?;
        let request = match &self.request {
            None => None,
            Some(path) => {
                check_request_path(path)?;
                Some(
                    format!(
                        "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                        plan.host_header
                    )
                    .into_bytes(),
                )
            }
        };
        Ok((plan, request))
    }
}

/// Everything a flood run needs, validated.
#[derive(Debug, Clone)]
pub(crate) struct FloodPlan {
    pub target_label: String,
    pub addr: SocketAddr,
    pub server_name: ServerName<'static>,
    pub concurrency: usize,
    pub threads: usize,
    pub stop: Stop,
    pub warmup: Duration,
    pub timeout: Duration,
    /// Client config the canned ClientHello is built from (the certificate
    /// is never checked: the flood never gets that far, and the probe only
    /// needs the flight's shape).
    pub config: Arc<ClientConfig>,
    pub flight_records: Option<u32>,
}

impl FloodArgs {
    pub(crate) fn plan(&self) -> Result<FloodPlan> {
        let (host, port) = split_host_port(&self.target)?;
        let stop = match (self.count, self.duration) {
            (Some(_), Some(_)) => bail!("use either --count or --duration, not both"),
            (Some(n), None) => Stop::Count(n),
            (None, d) => Stop::After(Duration::from_secs_f64(d.unwrap_or(10.0))),
        };
        let tls_args = TlsArgs {
            tls: self.tls,
            group: self.group,
            cipher: self.cipher.clone(),
            sni: self.sni.clone(),
            cacert: None,
            insecure_no_verify: true,
            resolve: Vec::new(),
        };
        let (config, _) = tls::build_config(
            &tls_args,
            ResumeMode::None,
            parse_alpn(&self.alpn)?,
            tls::Verify::Insecure,
        )?;
        let concurrency = self.concurrency as usize;
        Ok(FloodPlan {
            target_label: self.target.trim().to_string(),
            addr: resolve(&host, port, &self.resolve)?,
            server_name: server_name_for(&host, self.sni.as_deref())?,
            concurrency,
            // No idle threads: at most one per connection.
            threads: (self.threads as usize).min(concurrency),
            stop,
            warmup: Duration::from_secs_f64(self.warmup),
            timeout: Duration::from_secs_f64(self.timeout),
            config: Arc::new(config),
            flight_records: self.flight_records,
        })
    }
}

impl ThroughputArgs {
    pub(crate) fn plan(&self) -> Result<(Plan, Vec<u8>)> {
        let url = parse_https_url(&self.url)?;
        let stop = Stop::After(Duration::from_secs_f64(self.load.duration.unwrap_or(10.0)));
        let plan = common_plan(
            self.url.trim().to_string(),
            &url.host,
            url.port,
            &self.load,
            &self.tls,
            ResumeMode::None, // no version constraint
            true,             // resumption on for the (rare) reconnects
            vec![b"http/1.1".to_vec()],
            stop,
        )?;
        let request = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
            url.path, plan.host_header
        )
        .into_bytes();
        Ok((plan, request))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn resolve_takes_curl_style_overrides() {
        let e = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let list = e(&["a.test:443:127.0.0.9", "b.test:8443:[::1]", "*:9:10.0.0.1"]);
        let got = |h: &str, p: u16| resolve(h, p, &list).unwrap();
        assert_eq!(got("A.test", 443), "127.0.0.9:443".parse().unwrap());
        assert_eq!(got("b.test", 8443), "[::1]:8443".parse().unwrap());
        assert_eq!(got("anything.test", 9), "10.0.0.1:9".parse().unwrap());
        // Another port is not overridden (an address resolves as before).
        assert_eq!(
            resolve("127.0.0.1", 443, &e(&["127.0.0.1:80:10.0.0.2"])).unwrap(),
            "127.0.0.1:443".parse().unwrap()
        );
        for bad in ["a.test:443", "a.test:x:127.0.0.1", "a.test:443:nowhere"] {
            assert!(resolve("a.test", 443, &e(&[bad])).is_err(), "{bad}");
        }
    }

    #[test]
    fn sources_expand_ranges_and_lists() {
        let v = parse_sources("127.0.0.2-127.0.0.4, ::1").unwrap();
        let want: Vec<IpAddr> = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(v, want);
        assert!(parse_sources("127.0.0.9-127.0.0.2").is_err());
        assert!(parse_sources("10.0.0.0-10.0.8.0").is_err());
        assert!(parse_sources("localhost").is_err());
        assert!(parse_sources(" , ").is_err());
    }

    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(subcommand)]
        cmd: crate::BenchCommand,
    }

    fn hs(args: &[&str]) -> Result<HandshakeArgs, String> {
        let mut v = vec!["bench", "handshake"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v).map_err(|e| e.to_string())?.cmd {
            crate::BenchCommand::Handshake(a) => Ok(a),
            _ => unreachable!(),
        }
    }

    fn tp(args: &[&str]) -> Result<ThroughputArgs, String> {
        let mut v = vec!["bench", "throughput"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v).map_err(|e| e.to_string())?.cmd {
            crate::BenchCommand::Throughput(a) => Ok(a),
            _ => unreachable!(),
        }
    }

    fn plan_err(args: &[&str]) -> String {
        hs(args).unwrap().plan().unwrap_err().to_string()
    }

    #[test]
    fn defaults() {
        let a = hs(&["127.0.0.1:8443", "--insecure-no-verify"]).unwrap();
        assert_eq!(a.load.connections, 1);
        assert_eq!(a.load.threads, 1);
        assert_eq!(a.load.warmup, 0.0);
        assert_eq!(a.load.timeout, 10.0);
        assert_eq!(a.resume, ResumeMode::None);
        assert_eq!(a.alpn, "http/1.1");
        let (p, req) = a.plan().unwrap();
        assert_eq!(p.stop, Stop::After(Duration::from_secs(10)));
        assert_eq!(p.timeout, Duration::from_secs(10));
        assert_eq!(p.engine, Engine::Blocking);
        assert_eq!(p.server_name.to_str(), "localhost");
        assert_eq!(p.addr, "127.0.0.1:8443".parse().unwrap());
        assert!(!p.session_cache);
        assert!(req.is_none());
        assert_eq!(p.config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }

    #[test]
    fn verification_is_required() {
        let e = plan_err(&["127.0.0.1:8443"]);
        assert!(
            e.contains("--cacert") && e.contains("--insecure-no-verify"),
            "{e}"
        );
        assert!(hs(&["127.0.0.1:1", "--cacert", "x.pem", "--insecure-no-verify"]).is_err());
        let e = plan_err(&["127.0.0.1:8443", "--cacert", "/nonexistent/ca.pem"]);
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn count_duration_exclusive() {
        assert!(hs(&["127.0.0.1:1", "--count", "5", "--duration", "3"]).is_err());
        assert!(hs(&["127.0.0.1:1", "--count", "0"]).is_err());
        assert!(hs(&["127.0.0.1:1", "--duration", "0"]).is_err());
        assert!(hs(&["127.0.0.1:1", "--duration", "-1"]).is_err());
        assert!(hs(&["127.0.0.1:1", "--warmup", "nan"]).is_err());
        let (p, _) = hs(&["127.0.0.1:1", "--count", "7", "--insecure-no-verify"])
            .unwrap()
            .plan()
            .unwrap();
        assert_eq!(p.stop, Stop::Count(7));
        let (p, _) = hs(&["127.0.0.1:1", "--duration", "0.5", "--insecure-no-verify"])
            .unwrap()
            .plan()
            .unwrap();
        assert_eq!(p.stop, Stop::After(Duration::from_millis(500)));
    }

    #[test]
    fn versions_resume_cipher_group() {
        let ok = |args: &[&str]| {
            let mut v = vec!["127.0.0.1:1", "--insecure-no-verify"];
            v.extend_from_slice(args);
            hs(&v).unwrap().plan().map(|(p, _)| p)
        };
        let p = ok(&["--resume", "tickets"]).unwrap();
        assert!(p.session_cache);
        assert_eq!(p.version, Some(TlsVersion::V12));
        let p = ok(&["--resume", "psk"]).unwrap();
        assert_eq!(p.version, Some(TlsVersion::V13));
        let p = ok(&[]).unwrap();
        assert_eq!(p.version, None);

        let e = ok(&["--resume", "tickets", "--tls", "1.3"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--resume tickets") && e.contains("--tls 1.3"),
            "{e}"
        );
        assert!(ok(&["--resume", "psk", "--tls", "1.2"]).is_err());
        assert!(ok(&["--group", "x25519mlkem768", "--tls", "1.2"]).is_err());
        assert!(ok(&["--group", "secp384r1", "--tls", "1.2"]).is_ok());

        // Cipher names are case-insensitive and imply their version.
        let p = ok(&["--cipher", "tls13_aes_128_gcm_sha256"]).unwrap();
        assert_eq!(p.config.crypto_provider().cipher_suites.len(), 1);
        assert_eq!(p.version, Some(TlsVersion::V13));
        let p = ok(&["--cipher", "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"]).unwrap();
        assert_eq!(p.version, Some(TlsVersion::V12));
        let e = ok(&[
            "--cipher",
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
            "--tls",
            "1.3",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--cipher"), "{e}");
        let e = ok(&["--cipher", "RC4"]).unwrap_err().to_string();
        assert!(e.contains("TLS13_AES_256_GCM_SHA384"), "{e}");
        assert!(ok(&[
            "--cipher",
            "TLS13_CHACHA20_POLY1305_SHA256",
            "--resume",
            "tickets"
        ])
        .is_err());

        let p = ok(&["--group", "secp256r1"]).unwrap();
        let groups: Vec<_> = p
            .config
            .crypto_provider()
            .kx_groups
            .iter()
            .map(|g| g.name())
            .collect();
        assert_eq!(groups, vec![rustls::NamedGroup::secp256r1]);
        assert!(hs(&["127.0.0.1:1", "--group", "x448"]).is_err());
        assert!(hs(&["127.0.0.1:1", "--tls", "1.1"]).is_err());
    }

    #[test]
    fn alpn_sni_request() {
        let (p, req) = hs(&[
            "127.0.0.1:8443",
            "--insecure-no-verify",
            "--alpn",
            "h2, http/1.1",
            "--sni",
            "example.test",
            "--request",
            "/x?y=1",
        ])
        .unwrap()
        .plan()
        .unwrap();
        assert_eq!(
            p.config.alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        assert_eq!(p.server_name.to_str(), "example.test");
        assert_eq!(
            req.unwrap(),
            b"GET /x?y=1 HTTP/1.1\r\nHost: example.test:8443\r\nConnection: close\r\n\r\n"
        );
        let (p, _) = hs(&["127.0.0.1:8443", "--insecure-no-verify", "--alpn", ""])
            .unwrap()
            .plan()
            .unwrap();
        assert!(p.config.alpn_protocols.is_empty());
        assert!(
            plan_err(&["127.0.0.1:1", "--insecure-no-verify", "--request", "x y"])
                .contains("--request")
        );
        assert!(
            plan_err(&["127.0.0.1:1", "--insecure-no-verify", "--sni", "bad name!"])
                .contains("server name")
        );
        // A DNS target is its own SNI.
        assert_eq!(
            server_name_for("localhost", None).unwrap().to_str(),
            "localhost"
        );
        assert_eq!(
            server_name_for("a.example", None).unwrap().to_str(),
            "a.example"
        );
        assert_eq!(server_name_for("::1", None).unwrap().to_str(), "localhost");
    }

    #[test]
    fn targets_and_urls() {
        assert_eq!(
            split_host_port("127.0.0.1:8443").unwrap(),
            ("127.0.0.1".into(), 8443)
        );
        assert_eq!(split_host_port("[::1]:443").unwrap(), ("::1".into(), 443));
        assert_eq!(
            split_host_port("localhost:1").unwrap(),
            ("localhost".into(), 1)
        );
        for bad in [
            "127.0.0.1",
            ":80",
            "h:0",
            "h:99999",
            "::1:443",
            "[::1]443",
            "h:x",
        ] {
            assert!(split_host_port(bad).is_err(), "{bad}");
        }
        let u = parse_https_url("https://127.0.0.1:8443/big.bin").unwrap();
        assert_eq!(
            u,
            HttpsUrl {
                host: "127.0.0.1".into(),
                port: 8443,
                path: "/big.bin".into()
            }
        );
        let u = parse_https_url("https://example.test").unwrap();
        assert_eq!((u.port, u.path.as_str()), (443, "/"));
        let u = parse_https_url("https://[::1]?q").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("::1", 443, "/?q")
        );
        let u = parse_https_url("https://[::1]:9/").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 9));
        assert!(parse_https_url("http://127.0.0.1:80/").is_err());
        assert!(parse_https_url("https://u@h/").is_err());
        assert!(parse_https_url("https:///x").is_err());
    }

    #[test]
    fn throughput_args() {
        let a = tp(&[
            "https://127.0.0.1:8443/f",
            "--insecure-no-verify",
            "--verify-sha256",
            "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
        ])
        .unwrap();
        assert_eq!(a.verify_sha256.unwrap()[0], 0xe3);
        let (p, req) = a.plan().unwrap();
        assert_eq!(req, b"GET /f HTTP/1.1\r\nHost: 127.0.0.1:8443\r\n\r\n");
        assert!(p.session_cache);
        assert_eq!(p.version, None);
        assert!(tp(&["https://h/", "--verify-sha256", "abcd"]).is_err());
        assert!(tp(&["https://h/", "--count", "3"]).is_err());
        assert!(tp(&["https://h/", "--resume", "psk"]).is_err());
    }

    fn fl(args: &[&str]) -> Result<FloodArgs, String> {
        let mut v = vec!["bench", "flood"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v).map_err(|e| e.to_string())?.cmd {
            crate::BenchCommand::Flood(a) => Ok(a),
            _ => unreachable!(),
        }
    }

    #[test]
    fn flood_args() {
        // No trust anchor needed: the flood never checks a certificate.
        let a = fl(&["127.0.0.1:8443"]).unwrap();
        assert_eq!((a.concurrency, a.threads, a.timeout), (64, 1, 10.0));
        let p = a.plan().unwrap();
        assert_eq!(p.stop, Stop::After(Duration::from_secs(10)));
        assert_eq!(p.server_name.to_str(), "localhost");
        assert_eq!(p.flight_records, None);
        assert_eq!(p.config.alpn_protocols, vec![b"http/1.1".to_vec()]);

        let p = fl(&[
            "[::1]:9",
            "--concurrency",
            "3",
            "--threads",
            "8",
            "--count",
            "100",
            "--tls",
            "1.2",
            "--group",
            "secp256r1",
            "--sni",
            "example.test",
            "--alpn",
            "",
            "--flight-records",
            "4",
        ])
        .unwrap()
        .plan()
        .unwrap();
        assert_eq!((p.concurrency, p.threads), (3, 3));
        assert_eq!(p.stop, Stop::Count(100));
        assert_eq!(p.server_name.to_str(), "example.test");
        assert_eq!(p.flight_records, Some(4));
        assert!(p.config.alpn_protocols.is_empty());
        let groups: Vec<_> = p
            .config
            .crypto_provider()
            .kx_groups
            .iter()
            .map(|g| g.name())
            .collect();
        assert_eq!(groups, vec![rustls::NamedGroup::secp256r1]);

        assert!(fl(&["127.0.0.1:1", "--count", "5", "--duration", "3"]).is_err());
        assert!(fl(&["127.0.0.1:1", "--concurrency", "0"]).is_err());
        assert!(fl(&["127.0.0.1:1", "--flight-records", "0"]).is_err());
        assert!(fl(&["127.0.0.1:1", "--cacert", "x.pem"]).is_err());
        let e = fl(&["127.0.0.1:1", "--group", "x25519mlkem768", "--tls", "1.2"])
            .unwrap()
            .plan()
            .unwrap_err()
            .to_string();
        assert!(e.contains("x25519mlkem768"), "{e}");
    }

    #[test]
    fn engine_choice() {
        assert_eq!(
            choose_engine(EngineChoice::Auto, 1, 1).unwrap(),
            (Engine::Blocking, 1)
        );
        assert_eq!(
            choose_engine(EngineChoice::Auto, 4, 4).unwrap(),
            (Engine::Blocking, 4)
        );
        assert_eq!(
            choose_engine(EngineChoice::Auto, 8, 2).unwrap(),
            (Engine::Tokio, 2)
        );
        assert_eq!(
            choose_engine(EngineChoice::Auto, 2, 8).unwrap(),
            (Engine::Blocking, 2)
        );
        assert_eq!(
            choose_engine(EngineChoice::Tokio, 1, 1).unwrap(),
            (Engine::Tokio, 1)
        );
        assert!(choose_engine(EngineChoice::Blocking, 8, 2).is_err());
    }
}
