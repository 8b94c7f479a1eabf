//! Test 1: what arrives is byte-for-byte the file, for every client and both TLS versions.
//! Sizes straddle the 16 KiB record size; 64 MiB only with curl and rustls (time).

use std::process::Command;
use std::time::Duration;

use crate::support::client::{assert_file_body, Tls, TlsClient};
use crate::support::fixtures::{self, hex, sha256, DocFile};
use crate::support::tools::{self, header, split_http};
use crate::support::Server;

/// `clean`: every connection ended with a close_notify exchange before the server was stopped
/// (external clients close on their own schedule, which can race with the SIGTERM).
fn check_counts(stats: &crate::support::Stats, n: usize, clean: bool) {
    assert_eq!(stats["handshakes"], n as u64, "one handshake per fetch");
    assert_eq!(stats["handshake_failures"], 0);
    assert_eq!(stats["http_requests"], n as u64, "one request per fetch");
    assert_eq!(stats["http_responses_4xx"], 0);
    if crate::support::mode() == crate::support::Mode::Kernel {
        // File bodies went by sendfile: not a byte of them was read into the server.
        assert_eq!(stats["file_bytes_copied"], 0, "{stats:?}");
    }
    if clean {
        assert_eq!(stats["http_io_errors"], 0);
        assert_eq!(stats["close_notify_received"], n as u64);
    }
}

fn curl(v: Tls) {
    if !tools::require("curl") {
        return;
    }
    let fx = fixtures::get();
    let server = Server::start();
    let port = server.port();
    for f in &fx.files {
        let url = format!("https://localhost:{port}{}", f.url);
        let mut cmd = v.curl(port, 60);
        cmd.args(["-o", "-", &url]);
        let out = tools::run(cmd, b"", Duration::from_secs(90));
        assert!(
            out.status.success(),
            "curl {url} failed:\n{}",
            out.describe()
        );
        let err = out.stderr_text();
        assert!(
            err.contains(&format!("SSL connection using {} /", v.name())),
            "curl did not negotiate {}:\n{err}",
            v.name()
        );
        assert_eq!(out.stdout.len() as u64, f.size, "curl {url}: length");
        assert!(
            sha256(&out.stdout) == f.sha256,
            "curl {url}: SHA-256 {} differs from the file's {}",
            hex(&sha256(&out.stdout)),
            hex(&f.sha256)
        );
    }
    check_counts(&server.stop(), fx.files.len(), false);
}

#[test]
fn content_curl_tls13() {
    curl(Tls::V13);
}

#[test]
fn content_curl_tls12() {
    curl(Tls::V12);
}

/// `openssl s_client -brief -ign_eof` (-brief is -quiet plus a connection summary on stderr).
pub fn s_client_get(port: u16, v: Tls, path: &str, extra: &[&str]) -> tools::Output {
    let mut cmd = Command::new("openssl");
    cmd.args([
        "s_client",
        "-connect",
        &format!("127.0.0.1:{port}"),
        "-servername",
        "localhost",
        "-CAfile",
    ])
    .arg(&fixtures::pki().ca_pem)
    .args([
        "-verify_return_error",
        v.openssl_flag(),
        "-brief",
        "-ign_eof",
    ])
    .args(extra);
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    tools::run(cmd, req.as_bytes(), Duration::from_secs(20))
}

fn openssl(v: Tls) {
    if !tools::require("openssl") {
        return;
    }
    let fx = fixtures::get();
    let server = Server::start();
    let files: Vec<&DocFile> = fx.small_files().collect();
    for f in &files {
        let out = s_client_get(server.port(), v, &f.url, &[]);
        assert!(
            out.status.success(),
            "s_client {} failed:\n{}",
            f.url,
            out.describe()
        );
        let err = out.stderr_text();
        assert_eq!(
            tools::line_value(&err, &["Protocol version:"]).as_deref(),
            Some(v.name()),
            "s_client summary:\n{err}"
        );
        let (status, headers, body) = split_http(&out.stdout);
        assert_eq!(status, 200, "s_client {}", f.url);
        assert_eq!(
            header(&headers, "content-length"),
            Some(f.size.to_string().as_str())
        );
        assert_eq!(body.len() as u64, f.size, "s_client {}: body length", f.url);
        assert!(
            sha256(&body) == f.sha256,
            "s_client {}: content differs",
            f.url
        );
    }
    let stats = server.stop();
    check_counts(&stats, files.len(), false);
}

#[test]
fn content_openssl_tls13() {
    openssl(Tls::V13);
}

#[test]
fn content_openssl_tls12() {
    openssl(Tls::V12);
}

const PYTHON_CLIENT: &str = r#"
import sys, ssl, http.client, hashlib, json
port, cafile, ver = int(sys.argv[1]), sys.argv[2], sys.argv[3]
v = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}[ver]
ctx = ssl.create_default_context(cafile=cafile)
ctx.minimum_version = v
ctx.maximum_version = v
for path in sys.argv[4:]:
    c = http.client.HTTPSConnection("localhost", port, context=ctx, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    body = r.read()
    print(json.dumps({"path": path, "status": r.status, "len": len(body),
                      "sha256": hashlib.sha256(body).hexdigest(),
                      "version": c.sock.version(), "content_length": r.getheader("Content-Length")}))
    c.close()
"#;

fn python(v: Tls) {
    if !tools::require("python3") {
        return;
    }
    let fx = fixtures::get();
    let server = Server::start();
    let files: Vec<&DocFile> = fx.small_files().collect();
    let mut cmd = Command::new("python3");
    cmd.args(["-c", PYTHON_CLIENT, &server.port().to_string()])
        .arg(&fixtures::pki().ca_pem)
        .arg(match v {
            Tls::V12 => "1.2",
            Tls::V13 => "1.3",
        })
        .args(files.iter().map(|f| f.url.as_str()));
    let out = tools::run(cmd, b"", Duration::from_secs(60));
    assert!(
        out.status.success(),
        "python client failed:\n{}",
        out.describe()
    );
    let lines: Vec<serde_json::Value> = out
        .stdout_text()
        .lines()
        .map(|l| serde_json::from_str(l).expect("python output line"))
        .collect();
    assert_eq!(
        lines.len(),
        files.len(),
        "one line per file:\n{}",
        out.describe()
    );
    for (f, l) in files.iter().zip(&lines) {
        assert_eq!(l["path"], f.url.as_str());
        assert_eq!(l["status"], 200, "python {}", f.url);
        assert_eq!(l["version"], v.name(), "python {}", f.url);
        assert_eq!(l["len"], f.size, "python {}: length", f.url);
        assert_eq!(
            l["content_length"],
            f.size.to_string().as_str(),
            "python {}",
            f.url
        );
        assert_eq!(
            l["sha256"],
            hex(&f.sha256).as_str(),
            "python {}: content differs",
            f.url
        );
    }
    check_counts(&server.stop(), files.len(), false);
}

#[test]
fn content_python_tls13() {
    python(Tls::V13);
}

#[test]
fn content_python_tls12() {
    python(Tls::V12);
}

fn rustls_client(v: Tls) {
    let fx = fixtures::get();
    let server = Server::start();
    for f in &fx.files {
        let mut c = TlsClient::connect_version(server.port(), v);
        assert_eq!(c.conn.protocol_version(), Some(v.protocol()));
        let resp = c.get(&f.url);
        assert_file_body(&resp, f, "rustls");
        assert!(c.leftover().is_empty(), "bytes after the body of {}", f.url);
        c.close();
    }
    check_counts(&server.stop(), fx.files.len(), true);
}

#[test]
fn content_rustls_tls13() {
    rustls_client(Tls::V13);
}

#[test]
fn content_rustls_tls12() {
    rustls_client(Tls::V12);
}
