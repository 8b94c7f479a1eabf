//! The access log written to a file (`--access-log-file`, `--access-log-format`): its fields in
//! each format, the file opened again at a reload (log rotation), and the proxy's lines.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::sites::{scratch, write_config, SiteSpec};
use crate::support::client::{Tls, TlsClient};
use crate::support::fixtures::{self, CertKind};
use crate::support::{keep_alive_backend, Server};

const UA: &str = "probe/1.0 (\"quoted\")";
const REFERER: &str = "https://ref.example/page";

/// One GET with a User-Agent and a Referer; returns the body's length.
fn get_with_headers(port: u16, path: &str) -> usize {
    let mut c = TlsClient::connect_version(port, Tls::V13);
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: localhost:{port}\r\nUser-Agent: {UA}\r\nReferer: {REFERER}\r\n\r\n"
    );
    c.write_all(req.as_bytes()).expect("request");
    let resp = c.read_response(false).expect("response");
    assert_eq!(resp.status, 200);
    c.close();
    resp.body.len()
}

/// The file's lines once it has `n` (lines are written after the response, so they may trail
/// the client by a moment).
fn wait_lines(path: &Path, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        if lines.len() >= n {
            assert!(text.ends_with('\n'), "a partial line: {text:?}");
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "{}: {} lines, wanted {n}: {text:?}",
            path.display(),
            lines.len()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn hello_len() -> usize {
    fixtures::HELLO.len()
}

#[test]
fn access_log_file_in_text_format_has_host_bytes_duration_and_user_agent() {
    let dir = scratch("access_log_text");
    let log = dir.join("access.log");
    let server = Server::builder()
        .arg("--access-log-file")
        .arg(log.to_str().unwrap())
        .start();
    let port = server.port();
    assert_eq!(get_with_headers(port, "/hello.txt"), hello_len());
    let line = &wait_lines(&log, 1)[0];
    for want in [
        format!("host=localhost:{port}"),
        "method=GET".into(),
        "target=/hello.txt".into(),
        "protocol=HTTP/1.1".into(),
        "status=200".into(),
        format!("bytes={}", hello_len()),
        "user_agent=\"probe/1.0 (\\x22quoted\\x22)\"".into(),
        format!("referer=\"{REFERER}\""),
        format!("plane={}", crate::support::mode().as_str()),
        "server_name=localhost".into(),
        " duration=0.".into(),
    ] {
        assert!(line.contains(&want), "{want} not in {line}");
    }
    // The file takes the lines: none on stderr.
    assert!(
        !server
            .stderr_lines()
            .iter()
            .any(|l| l.contains("/hello.txt")),
        "{:?}",
        server.stderr_lines()
    );
    server.stop();
}

/// nginx's `combined`: `$remote_addr - - [$time_local] "$request" $status $body_bytes_sent
/// "$http_referer" "$http_user_agent"`, `"` in a value escaped as `\x22`.
#[test]
fn access_log_combined_format_is_nginx_shaped() {
    let dir = scratch("access_log_combined");
    let log = dir.join("access.log");
    let server = Server::builder()
        .arg("--access-log-file")
        .arg(log.to_str().unwrap())
        .arg("--access-log-format")
        .arg("combined")
        .start();
    let port = server.port();
    assert_eq!(get_with_headers(port, "/hello.txt"), hello_len());
    let line = wait_lines(&log, 1).remove(0);
    let (addr, rest) = line.split_once(" - - [").expect(&line);
    assert_eq!(addr, "127.0.0.1", "{line}");
    let (time, rest) = rest.split_once("] ").expect(&line);
    // 26/Nov/2026:01:22:57 +0000
    let b = time.as_bytes();
    assert_eq!(b.len(), 26, "{time}");
    assert!(
        b[2] == b'/' && b[6] == b'/' && b[11] == b':' && b[14] == b':' && b[17] == b':',
        "{time}"
    );
    assert!(b[3..6].iter().all(u8::is_ascii_alphabetic), "{time}");
    assert!(time.ends_with(" +0000"), "{time}");
    assert_eq!(
        rest,
        format!(
            "\"GET /hello.txt HTTP/1.1\" 200 {} \"{REFERER}\" \"probe/1.0 (\\x22quoted\\x22)\"",
            hello_len()
        ),
        "{line}"
    );
    server.stop();
}

/// JSON, set from the configuration file's `[server]` keys.
#[test]
fn access_log_json_format_from_the_config_file_parses() {
    let dir = scratch("access_log_json");
    let log = dir.join("access.log");
    let config = write_config(
        &dir,
        &format!(
            "access-log-file = {:?}\naccess-log-format = \"json\"",
            log.to_str().unwrap()
        ),
        &[SiteSpec {
            names: &["localhost"],
            default: true,
            certs: vec![fixtures::pki().issue_in(&dir, "leaf", &["localhost"], CertKind::P256)],
            content: "jsonsite",
        }],
    );
    let server = Server::builder().config_file(&config).start();
    let port = server.port();
    assert_eq!(get_with_headers(port, "/index.html"), "jsonsite".len());
    let line = wait_lines(&log, 1).remove(0);
    let v: serde_json::Value = serde_json::from_str(&line).expect(&line);
    assert_eq!(v["status"], 200, "{line}");
    assert_eq!(v["bytes"], "jsonsite".len(), "{line}");
    assert_eq!(v["method"], "GET", "{line}");
    assert_eq!(v["target"], "/index.html", "{line}");
    assert_eq!(v["protocol"], "HTTP/1.1", "{line}");
    assert_eq!(v["host"], format!("localhost:{port}"), "{line}");
    assert_eq!(v["user_agent"], UA, "{line}");
    assert_eq!(v["referer"], REFERER, "{line}");
    assert_eq!(v["server_name"], "localhost", "{line}");
    assert!(
        v["peer"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{line}"
    );
    let secs = v["duration"].as_f64().expect(&line);
    assert!((0.0..5.0).contains(&secs), "{line}");
    server.stop();
}

/// Log rotation: the file renamed away, a reload, and the next line lands in a new file at
/// the path (the renamed one keeps what it had).
#[test]
fn access_log_file_is_opened_again_at_a_reload() {
    let dir = scratch("access_log_rotate");
    let log = dir.join("access.log");
    let rotated = dir.join("access.log.1");
    let mut server = Server::builder()
        .arg("--access-log-file")
        .arg(log.to_str().unwrap())
        .start();
    let port = server.port();
    get_with_headers(port, "/hello.txt");
    wait_lines(&log, 1);
    fs::rename(&log, &rotated).expect("rename");
    let status = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !server
        .stderr_lines()
        .iter()
        .any(|l| l.contains("configuration reloaded"))
    {
        assert!(Instant::now() < deadline, "{:?}", server.stderr_lines());
        std::thread::sleep(Duration::from_millis(20));
    }
    server.assert_alive();
    get_with_headers(port, "/hello.txt");
    assert_eq!(wait_lines(&log, 1).len(), 1, "the new file");
    assert_eq!(
        fs::read_to_string(&rotated).unwrap().lines().count(),
        1,
        "a line went to the renamed file"
    );
    server.stop();
}

#[test]
fn proxy_http_access_log_names_the_backend_and_the_bytes() {
    const BODY: &[u8] = b"twenty-three bytes long";
    let to = keep_alive_backend(BODY).to_string();
    let dir = scratch("access_log_proxy");
    let log = dir.join("access.log");
    let server = Server::builder()
        .proxy(std::slice::from_ref(&to))
        .arg("--mode")
        .arg("http")
        .arg("--access-log-file")
        .arg(log.to_str().unwrap())
        .arg("--access-log-format")
        .arg("json")
        .start();
    assert_eq!(get_with_headers(server.port(), "/x"), BODY.len());
    let line = wait_lines(&log, 1).remove(0);
    let v: serde_json::Value = serde_json::from_str(&line).expect(&line);
    assert_eq!(v["backend"], to, "{line}");
    assert_eq!(v["bytes"], BODY.len(), "{line}");
    assert_eq!(v["status"], 200, "{line}");
    assert_eq!(v["target"], "/x", "{line}");
    assert_eq!(v["user_agent"], UA, "{line}");
    assert_eq!(v["referer"], REFERER, "{line}");
    server.stop();
}
