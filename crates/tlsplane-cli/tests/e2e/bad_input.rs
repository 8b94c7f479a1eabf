//! Test 6: hostile or broken clients. After each, the server is alive and serves a normal
//! request on a new connection, and its counters say what happened.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use crate::support::client::{assert_file_body, fetch, tcp_connect, End, Tls, TlsClient, BOTH};
use crate::support::fixtures;
use crate::support::{Server, Stats};

/// Reads raw bytes until EOF/reset; panics if the server keeps the connection open past
/// `limit`. Returns what arrived and how long it took.
fn read_until_closed(sock: &mut std::net::TcpStream, limit: Duration) -> (Vec<u8>, Duration) {
    let start = Instant::now();
    sock.set_read_timeout(Some(limit)).expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                panic!("the server kept the connection open for {limit:?} (received {got:?})")
            }
            Err(_) => break, // reset: closed as well
        }
        assert!(
            start.elapsed() <= limit,
            "the server kept the connection open for {limit:?}"
        );
    }
    (got, start.elapsed())
}

/// Whatever arrived must be TLS alert records (content type 21) and nothing else.
fn assert_only_alerts(got: &[u8]) {
    let records = crate::support::client::RecordLog::parse(got);
    assert!(
        records.iter().all(|(t, len)| *t == 21 && *len == 2),
        "expected nothing or plaintext alert records, got {records:?} ({got:?})"
    );
}

fn still_serving(server: &mut Server) {
    server.assert_alive();
    let fx = fixtures::get();
    for v in BOTH {
        assert_file_body(
            &fetch(server.port(), v, &fx.hello.url),
            &fx.hello,
            "normal request after the bad client",
        );
    }
    server.assert_alive();
}

fn handshake_failure_counted(stats: &Stats) {
    assert_eq!(
        stats["handshakes"], 2,
        "only the two good clients completed handshakes"
    );
    assert_eq!(stats["handshake_failures"], 1, "{stats:?}");
    assert_eq!(
        stats["handshake_peer_errors"], 1,
        "the failure is the peer's fault: {stats:?}"
    );
    assert_eq!(stats["http_handshake_errors"], 1, "{stats:?}");
    assert_eq!(stats["http_requests"], 2);
}

#[test]
fn plaintext_http_instead_of_client_hello() {
    let mut server = Server::start();
    let mut sock = tcp_connect(server.port());
    sock.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .expect("write");
    let (got, took) = read_until_closed(&mut sock, Duration::from_secs(2));
    // Answered in kind, as nginx and Go do: a plain 400 that says to use https, then close.
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 400 ") && text.contains("https://"),
        "plaintext HTTP got {text:?}"
    );
    eprintln!(
        "plaintext HTTP: {} bytes then close after {took:?}",
        got.len()
    );
    still_serving(&mut server);
    let stats = server.stop();
    assert_eq!(stats["plain_http_requests"], 1, "{stats:?}");
    handshake_failure_counted(&stats);
}

#[test]
fn truncated_record_then_close() {
    let mut server = Server::start();
    let mut sock = tcp_connect(server.port());
    // A handshake record header claiming 100 bytes, 10 of them, then FIN.
    let mut rec = vec![22u8, 3, 1, 0, 100];
    rec.extend_from_slice(&[1, 0, 0, 96, 3, 3, 0, 0, 0, 0]);
    sock.write_all(&rec).expect("write");
    sock.shutdown(Shutdown::Write).expect("shutdown");
    let (got, _) = read_until_closed(&mut sock, Duration::from_secs(2));
    assert_only_alerts(&got);
    still_serving(&mut server);
    handshake_failure_counted(&server.stop());
}

#[test]
fn header_flood_gets_431_and_close() {
    for v in BOTH {
        let mut server = Server::start();
        let mut c = TlsClient::connect_version(server.port(), v);
        let mut req = b"GET /hello.txt HTTP/1.1\r\nHost: localhost\r\n".to_vec();
        let mut i = 0;
        while req.len() < 100 * 1024 {
            req.extend_from_slice(format!("X-Flood-{i:05}: {}\r\n", "f".repeat(60)).as_bytes());
            i += 1;
        }
        req.extend_from_slice(b"\r\n");
        // The server may stop reading (and reset) before all of it is written.
        let _ = c.write_all(&req);
        let (raw, end) = c.read_to_end();
        assert!(
            !raw.is_empty(),
            "{v:?}: no response to a 100 KiB head ({end:?})"
        );
        let status = super::http::status_of(&raw);
        assert!(
            status == 431 || status == 400,
            "{v:?}: status {status} for a 100 KiB head"
        );
        assert!(
            !raw.ends_with(fixtures::HELLO),
            "{v:?}: the flood must not be served"
        );
        eprintln!("{v:?} header flood: {status}, then {end:?}");
        still_serving(&mut server);
        let stats = server.stop();
        assert_eq!(stats["http_responses_4xx"], 1, "{stats:?}");
        assert_eq!(stats["handshakes"], 3);
    }
}

#[test]
fn client_drops_mid_body() {
    let fx = fixtures::get();
    let big = fx.big();
    for v in BOTH {
        let mut server = Server::start();
        let mut c = TlsClient::connect_version(server.port(), v);
        c.write_all(&crate::support::get_request(&big.url, ""))
            .expect("request");
        let (status, _) = c.read_head().expect("head");
        assert_eq!(status, 200);
        let mut got = 0u64;
        let mut first = Vec::new();
        c.read_body_with(1 << 20, |b| {
            got += b.len() as u64;
            first.extend_from_slice(b);
        })
        .expect("first MiB");
        assert_eq!(got, 1 << 20);
        let content = std::fs::read(&big.path).expect("fixture");
        assert!(first == content[..1 << 20], "{v:?}: the first MiB differs");
        drop(c); // unread data in our socket: the kernel resets the connection
        std::thread::sleep(Duration::from_millis(300));
        still_serving(&mut server);
        let stats = server.stop();
        assert_eq!(
            stats["http_io_errors"], 1,
            "{v:?}: the aborted response counts as an I/O error: {stats:?}"
        );
        assert_eq!(stats["http_requests"], 3);
        assert_eq!(stats["handshakes"], 3);
    }
}

/// A client that completes the handshake and sends half a request line, then nothing: the
/// header timeout ends it with 408 (or a plain close) and the server goes on.
#[test]
fn slow_header_times_out() {
    let mut server = Server::builder().arg("--header-timeout").arg("1").start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    c.write_all(b"GET /hello.txt HTTP/1.1\r\nHost: loc")
        .expect("partial head");
    let start = Instant::now();
    let (raw, end) = c.read_to_end();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "header timeout of 1 s took {:?}",
        start.elapsed()
    );
    if !raw.is_empty() {
        assert_eq!(super::http::status_of(&raw), 408);
    }
    assert!(matches!(end, End::CloseNotify), "{end:?}");
    still_serving(&mut server);
    let stats = server.stop();
    assert_eq!(stats["http_timeouts"], 1, "{stats:?}");
}

/// A TLS 1.2 client asking to renegotiate (`openssl s_client`'s `R` command) is refused with
/// no_renegotiation on either plane: rustls answers the first request with the warning and
/// ends the connection at a second; the kernel plane ends it at once and counts it.
#[test]
fn renegotiation_is_refused() {
    if !crate::support::tools::require("openssl") {
        return;
    }
    let server = Server::start();
    // s_client obeys `R` only without -ign_eof, and exits at the end of its input: keep that
    // open until it is done (at most 10 s).
    let mut child = std::process::Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            &format!("127.0.0.1:{}", server.port()),
            "-tls1_2",
            "-servername",
            "localhost",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("openssl s_client");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"R\n").expect("R");
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().expect("try_wait").is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(stdin);
    let out = child.wait_with_output().expect("s_client output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("RENEGOTIATING"), "{text}");
    assert!(
        text.contains("no renegotiation"),
        "the client should be told no_renegotiation:\n{text}"
    );
    let stats = server.stop();
    if crate::support::mode() == crate::support::Mode::Kernel {
        assert_eq!(stats["renegotiations_refused"], 1, "{stats:?}");
    }
}
