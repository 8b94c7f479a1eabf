//! The admin endpoint (`--admin`): `GET /metrics` in the OpenMetrics text format
//! (prometheus-client) and `GET /healthz`, on loopback or a Unix socket, plain HTTP, on a
//! thread of its own so that a scrape never waits behind connection work.
//!
//! One source of truth: the counters `--stats` prints are read at scrape time by a collector
//! (nothing is counted twice); counters that belong together become one labelled family
//! (`fallback_suite`, `fallback_policy` ... → `tlsplane_fallbacks_total{reason=...}`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where the admin endpoint listens.
#[derive(Clone, Debug)]
pub enum AdminAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl FromStr for AdminAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            return Ok(AdminAddr::Unix(PathBuf::from(path)));
        }
        let addr: SocketAddr = s
            .parse()
            .map_err(|e| format!("{e} (expected ADDR:PORT on loopback, or unix:PATH)"))?;
        if !addr.ip().is_loopback() {
            return Err(format!(
                "{addr} is not a loopback address: the admin endpoint has no authentication \
                 (use 127.0.0.1:PORT, [::1]:PORT or unix:PATH)"
            ));
        }
        Ok(AdminAddr::Tcp(addr))
    }
}

/// Counter names (as `--stats` prints them) that share a prefix become one family: (prefix,
/// family name, labels). With two labels the rest of the name is split at its first `_`.
const FAMILIES: &[(&str, &str, &[&str])] = &[
    ("fallback_", "fallbacks", &["reason"]),
    ("plane_", "connections_by_plane", &["plane"]),
    ("limit_", "limit_refused", &["limit"]),
    ("http_responses_", "http_responses", &["class"]),
    ("bytes_", "app_bytes", &["direction", "plane"]),
];

/// Reads a list of named values at scrape time.
pub struct SnapshotCollector {
    counters: Box<dyn Fn() -> Vec<(&'static str, u64)> + Send + Sync>,
    gauges: Box<dyn Fn() -> Vec<(&'static str, &'static str, i64)> + Send + Sync>,
}

impl std::fmt::Debug for SnapshotCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SnapshotCollector")
    }
}

impl SnapshotCollector {
    /// `counters` gives (name, value) pairs, the same the `--stats` line prints; `gauges` gives
    /// (name, help, value).
    pub fn new(
        counters: impl Fn() -> Vec<(&'static str, u64)> + Send + Sync + 'static,
        gauges: impl Fn() -> Vec<(&'static str, &'static str, i64)> + Send + Sync + 'static,
    ) -> Self {
        SnapshotCollector {
            counters: Box::new(counters),
            gauges: Box::new(gauges),
        }
    }
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counters = (self.counters)();
        for &(prefix, family, labels) in FAMILIES {
            let members: Vec<_> = counters
                .iter()
                .filter_map(|(n, v)| n.strip_prefix(prefix).map(|rest| (rest, *v)))
                .collect();
            if members.is_empty() {
                continue;
            }
            let help = format!("{family} by {}", labels.join(" and "));
            let mut m = encoder.encode_descriptor(
                family,
                &help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (rest, v) in members {
                let values: Vec<&str> = if labels.len() == 1 {
                    vec![rest]
                } else {
                    rest.splitn(labels.len(), '_').collect()
                };
                let set: Vec<(&str, &str)> = labels.iter().copied().zip(values).collect();
                ConstCounter::new(v).encode(m.encode_family(&set)?)?;
            }
        }
        for (name, v) in counters
            .iter()
            .filter(|(n, _)| !FAMILIES.iter().any(|(p, _, _)| n.starts_with(p)))
        {
            let c = ConstCounter::new(*v);
            c.encode(encoder.encode_descriptor(name, name, None, c.metric_type())?)?;
        }
        for (name, help, v) in (self.gauges)() {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

/// Latency histograms observed on the connection path.
#[derive(Clone)]
pub struct Histograms {
    /// Seconds from accept to the end of the TLS handshake.
    pub handshake: Histogram,
    /// Seconds from accept to the first byte of the connection's first response (the
    /// handshake and the first request included: what a new client waits for).
    pub first_response: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Histograms {
            // 50 µs .. ~3.3 s
            handshake: Histogram::new(exponential_buckets(50e-6, 2.0, 17)),
            first_response: Histogram::new(exponential_buckets(50e-6, 2.0, 17)),
        }
    }
}

impl Histograms {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "handshake_duration_seconds",
            "Time from accept to the end of the TLS handshake",
            self.handshake.clone(),
        );
        registry.register(
            "time_to_first_byte_seconds",
            "Time from accept to the first byte of the connection's first response",
            self.first_response.clone(),
        );
    }
}

/// The admin endpoint while it serves: a Unix socket's file is removed when this is dropped
/// (the server's orderly exit), so that the next start finds the path free.
pub struct Endpoint(Option<PathBuf>);

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Refuses a Unix path that another server listens on, or a file that is not a socket.
/// Returns whether a stale socket is there (left by a server that was killed, which could not
/// remove it; nobody listens on it).
fn unix_path_in_use(p: &std::path::Path) -> anyhow::Result<bool> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(p) else {
        return Ok(false);
    };
    if !meta.file_type().is_socket() {
        bail!(
            "admin endpoint: {} exists and is not a socket; remove it or choose another path",
            p.display()
        );
    }
    if std::os::unix::net::UnixStream::connect(p).is_ok() {
        bail!(
            "admin endpoint: a server already listens on {}",
            p.display()
        );
    }
    Ok(true)
}

/// Whether `p` may be bound: free, or a stale socket, which is removed.
fn free_unix_path(p: &std::path::Path) -> anyhow::Result<()> {
    if unix_path_in_use(p)? {
        std::fs::remove_file(p)
            .with_context(|| format!("admin endpoint: cannot remove the stale {}", p.display()))?;
    }
    Ok(())
}

/// Before any start-up work (the kernel probe, the key daemon, certificates): refuses an
/// admin path that is taken, as a taken listening port is, so that a second server started by
/// mistake stops at once and touches nothing.
pub fn refuse_taken(addr: &AdminAddr) -> anyhow::Result<()> {
    match addr {
        AdminAddr::Unix(p) => unix_path_in_use(p).map(|_| ()),
        AdminAddr::Tcp(_) => Ok(()),
    }
}

/// Binds the endpoint now (so that a bad address stops start-up) and serves it on a thread
/// of its own, until the process exits; keep what it returns until then.
pub fn start(addr: &AdminAddr, registry: Registry) -> anyhow::Result<Endpoint> {
    let registry = Arc::new(registry);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let listener = rt.block_on(async {
        anyhow::Ok(match addr {
            AdminAddr::Tcp(a) => {
                let l = tokio::net::TcpListener::bind(a)
                    .await
                    .with_context(|| format!("admin endpoint: cannot listen on {a}"))?;
                tracing::info!("admin endpoint on http://{}/metrics", l.local_addr()?);
                Listener::Tcp(l)
            }
            AdminAddr::Unix(p) => {
                free_unix_path(p)?;
                let l = tokio::net::UnixListener::bind(p)
                    .with_context(|| format!("admin endpoint: cannot listen on {}", p.display()))?;
                tracing::info!("admin endpoint on unix:{}", p.display());
                Listener::Unix(l)
            }
        })
    })?;
    let endpoint = Endpoint(match addr {
        AdminAddr::Unix(p) => Some(p.clone()),
        AdminAddr::Tcp(_) => None,
    });
    std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || rt.block_on(serve(listener, registry)))?;
    Ok(endpoint)
}

enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

async fn serve(listener: Listener, registry: Arc<Registry>) {
    loop {
        let accepted: std::io::Result<Box<dyn Conn>> = match &listener {
            Listener::Tcp(l) => l.accept().await.map(|(s, _)| Box::new(s) as Box<dyn Conn>),
            Listener::Unix(l) => l.accept().await.map(|(s, _)| Box::new(s) as Box<dyn Conn>),
        };
        match accepted {
            Ok(conn) => {
                let registry = registry.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_secs(10), answer(conn, &registry))
                        .await;
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

trait Conn: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Conn for T {}

/// One request per connection: read the head, answer, close.
async fn answer(mut conn: Box<dyn Conn>, registry: &Registry) -> std::io::Result<()> {
    let mut buf = vec![0u8; 8192];
    let mut used = 0;
    let head_end = loop {
        let n = conn.read(&mut buf[used..]).await?;
        if n == 0 {
            return Ok(());
        }
        used += n;
        if let Some(i) = buf[..used].windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if used == buf.len() {
            return conn.write_all(&plain(431, "head too large\n")).await;
        }
    };
    let line = String::from_utf8_lossy(&buf[..head_end]);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let resp = match (method, path) {
        ("GET", "/metrics") => {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) => response(
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    body.as_bytes(),
                ),
                Err(_) => plain(500, "encoding failed\n"),
            }
        }
        ("GET", "/healthz") => plain(200, "ok\n"),
        ("GET", _) => plain(404, "not found: try /metrics or /healthz\n"),
        _ => plain(405, "GET only\n"),
    };
    conn.write_all(&resp).await?;
    conn.shutdown().await
}

fn plain(status: u16, body: &str) -> Vec<u8> {
    response(status, "text/plain; charset=utf-8", body.as_bytes())
}

fn response(status: u16, content_type: &str, body: &[u8]) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        _ => "Internal Server Error",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_group_prefixed_counters_and_others_stay_flat() {
        let mut registry = Registry::with_prefix("tlsplane");
        registry.register_collector(Box::new(SnapshotCollector::new(
            || {
                vec![
                    ("handshakes", 7),
                    ("fallback_policy", 3),
                    ("fallback_suite", 1),
                    ("limit_client_handshake_rate", 2),
                    ("bytes_tx_kernel", 9),
                ]
            },
            || vec![("connections_open", "open", 4)],
        )));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for want in [
            "tlsplane_handshakes_total 7",
            "tlsplane_fallbacks_total{reason=\"policy\"} 3",
            "tlsplane_fallbacks_total{reason=\"suite\"} 1",
            "tlsplane_limit_refused_total{limit=\"client_handshake_rate\"} 2",
            "tlsplane_app_bytes_total{direction=\"tx\",plane=\"kernel\"} 9",
            "tlsplane_connections_open 4",
            "# EOF",
        ] {
            assert!(text.contains(want), "missing {want:?} in:\n{text}");
        }
        assert!(!text.contains("fallback_policy"), "{text}");
    }

    #[test]
    fn admin_address_must_be_loopback_or_unix() {
        assert!("127.0.0.1:9100".parse::<AdminAddr>().is_ok());
        assert!("[::1]:9100".parse::<AdminAddr>().is_ok());
        assert!(matches!(
            "unix:/run/x.sock".parse::<AdminAddr>(),
            Ok(AdminAddr::Unix(_))
        ));
        let err = "0.0.0.0:9100".parse::<AdminAddr>().unwrap_err();
        assert!(err.contains("not a loopback"), "{err}");
    }
}
