//! The admin endpoint: /metrics parsed by a real OpenMetrics parser (Python's
//! prometheus_client), values that move with traffic and agree with `--stats`, /healthz.

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use crate::support::client::{fetch, Tls, TlsClient};
use crate::support::{fixtures, tools, Server};

/// Scrapes /metrics and prints {"family{label=value,...}": value} as JSON.
const SCRAPE: &str = r#"
import json, sys, urllib.request
from prometheus_client.openmetrics.parser import text_string_to_metric_families
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
out = {}
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        out[f"{s.name}{{{labels}}}"] = s.value
print(json.dumps(out))
"#;

/// A Python that has prometheus_client: the one in PATH, or Debian's (python3-prometheus-client).
pub(crate) fn python_with_parser() -> Option<&'static str> {
    ["python3", "/usr/bin/python3"].into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import prometheus_client"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

pub(crate) fn scrape(py: &str, url: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut cmd = Command::new(py);
    cmd.args(["-c", SCRAPE, url]);
    let out = tools::run(cmd, b"", Duration::from_secs(30));
    assert!(out.status.success(), "scrape failed:\n{}", out.describe());
    match serde_json::from_str(out.stdout_text().trim()).expect("scrape output") {
        serde_json::Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

pub(crate) fn value(m: &serde_json::Map<String, serde_json::Value>, key: &str) -> f64 {
    m.get(key)
        .and_then(|v| v.as_f64())
        .unwrap_or_else(|| panic!("no sample {key} in /metrics: {:?}", m.keys()))
}

/// The port of a server's admin endpoint (`--admin 127.0.0.1:0`), from its start-up line.
pub fn admin_port(server: &Server) -> u16 {
    server
        .stderr_lines()
        .iter()
        .find_map(|l| {
            crate::support::info_message(l)?
                .strip_prefix("admin endpoint on http://127.0.0.1:")
                .and_then(|r| r.strip_suffix("/metrics"))
                .and_then(|p| p.parse().ok())
        })
        .expect("the server printed its admin address")
}

/// Plain HTTP GET of the admin endpoint: the response, whole.
pub fn http_get(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("admin connect");
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn metrics_move_with_traffic_and_agree_with_stats() {
    if !tools::require("python3") {
        return;
    }
    let Some(py) = python_with_parser() else {
        panic!("this test needs Python's prometheus_client (apt-get install python3-prometheus-client)");
    };
    let server = Server::builder().arg("--admin").arg("127.0.0.1:0").start();
    let admin_port = admin_port(&server);
    let url = format!("http://127.0.0.1:{admin_port}/metrics");
    let before = scrape(py, &url);

    let port = server.port();
    for _ in 0..3 {
        assert_eq!(
            fetch(port, Tls::V13, &fixtures::get().hello.url).status,
            200
        );
    }
    let mut c = TlsClient::connect_version(port, Tls::V12);
    assert_eq!(c.get("/no-such-file").status, 404);
    // While it is open, it is one of the connections open on its plane.
    let during = scrape(py, &url);
    let open = |m: &serde_json::Map<String, serde_json::Value>| {
        value(m, "tlsplane_connections_open_kernel_plane{}")
            + value(m, "tlsplane_connections_open_user_plane{}")
    };
    assert_eq!(open(&during), 1.0, "one established connection open");
    c.close();

    let after = scrape(py, &url);
    let moved = |k: &str| value(&after, k) - value(&before, k);
    assert_eq!(moved("tlsplane_handshakes_total{}"), 4.0);
    assert_eq!(moved("tlsplane_http_responses_total{class=2xx}"), 3.0);
    assert_eq!(moved("tlsplane_http_responses_total{class=4xx}"), 1.0);
    assert_eq!(
        moved("tlsplane_connections_by_plane_total{plane=user}") as u64
            + moved("tlsplane_connections_by_plane_total{plane=kernel}") as u64,
        4
    );
    assert_eq!(moved("tlsplane_handshake_duration_seconds_count{}"), 4.0);
    // Every connection had one first response (a keep-alive one counts once).
    assert_eq!(moved("tlsplane_time_to_first_byte_seconds_count{}"), 4.0);
    assert!(
        moved("tlsplane_time_to_first_byte_seconds_sum{}")
            >= moved("tlsplane_handshake_duration_seconds_sum{}"),
        "the first byte cannot come before the end of the handshake"
    );
    let tx = moved("tlsplane_app_bytes_total{direction=tx,plane=user}")
        + moved("tlsplane_app_bytes_total{direction=tx,plane=kernel}");
    let hello = fixtures::get().hello.size as f64;
    assert!(
        tx >= 3.0 * hello,
        "application bytes sent moved by {tx}, less than three bodies of {hello}"
    );
    assert!(after.contains_key("tlsplane_connections_open{}"));
    assert!(after.contains_key("tlsplane_limit_refused_total{limit=client_handshake_rate}"));

    let health = http_get(admin_port, "/healthz");
    assert!(
        health.starts_with("HTTP/1.1 200") && health.ends_with("ok\n"),
        "{health}"
    );
    assert!(http_get(admin_port, "/nope").starts_with("HTTP/1.1 404"));

    let stats = server.stop();
    // One source of truth: the exit line and the last scrape read the same counters.
    assert_eq!(
        value(&after, "tlsplane_handshakes_total{}") as u64,
        stats["handshakes"]
    );
    assert_eq!(
        value(&after, "tlsplane_http_requests_total{}") as u64,
        stats["http_requests"]
    );
}

#[test]
fn admin_refuses_a_non_loopback_address() {
    let mut cmd = Command::new(crate::support::server_bin());
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "0.0.0.0:9100",
    ]);
    let out = tools::run(cmd, b"", Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2), "{}", out.describe());
    assert!(
        out.stderr_text().contains("not a loopback"),
        "{}",
        out.describe()
    );
}

#[test]
fn an_admin_unix_socket_is_removed_at_exit_and_a_stale_one_is_replaced() {
    let dir = crate::sites::scratch("admin-unix");
    let path = dir.join("admin.sock");
    let addr = format!("unix:{}", path.display());
    let start = || Server::builder().arg("--admin").arg(&addr).start();
    let server = start();
    assert!(path.exists());
    server.stop();
    assert!(!path.exists(), "the admin socket was left behind");
    // Started again on the same path; another server on that path meanwhile is refused.
    let server = start();
    let mut cmd = Command::new(crate::support::server_bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--admin", &addr]);
    let out = tools::run(cmd, b"", Duration::from_secs(20));
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text().contains("already listens") && !out.stderr_text().contains("data plane:"),
        "refused before any start-up work (the kernel probe, the key daemon): {}",
        out.describe()
    );
    server.stop();
    // A socket nobody listens on (a server that was killed leaves one): replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    start().stop();
    assert!(!path.exists());
    // A file that is not a socket is not removed.
    std::fs::write(&path, "not a socket").unwrap();
    let mut cmd = Command::new(crate::support::server_bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--admin", &addr]);
    let out = tools::run(cmd, b"", Duration::from_secs(20));
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text().contains("is not a socket"),
        "{}",
        out.describe()
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
}
