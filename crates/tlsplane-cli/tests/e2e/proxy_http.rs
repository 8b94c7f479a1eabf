//! `tlsplane proxy --mode http`: an HTTP/1.1 reverse proxy in front of real backends (Python's
//! http.server, and a keep-alive test backend that records what it was sent), with curl,
//! Python, openssl s_client and rustls as clients.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::client::{End, Tls, TlsClient};
use crate::support::fixtures::{self, sha256};
use crate::support::tools::{self, require};
use crate::support::Server;

/// What the keep-alive test backend saw.
#[derive(Default)]
struct Seen {
    connections: AtomicUsize,
    /// Request heads, as received.
    heads: Mutex<Vec<String>>,
}

/// A keep-alive HTTP/1.1 backend. Paths:
/// - `/bytes/N`: N deterministic bytes, Content-Length;
/// - `/chunked/N`: the same N bytes, chunked, in pieces of varying size;
/// - `/close/N`: the same N bytes, no Content-Length, then close;
/// - `/echo`: the request body (Content-Length or chunked) back, Content-Length;
/// - `/die`: a head announcing 1 MB, 1000 bytes of it, then a reset;
/// - `/silent`: reads the request and closes without a response;
/// - `POST /reject`: 413 at once, without reading the body; then 3 s without reading;
/// - `/slow`: answers after 3 s;
/// - `/trickle`: 100 bytes announced, one every 100 ms;
/// - `/ws`: with `Upgrade`, `101 Switching Protocols` to the protocol asked for (whatever
///   it is, as a careless backend would), then echoes bytes; without, 404.
fn http_backend() -> (SocketAddr, Arc<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let seen = Arc::new(Seen::default());
    let s = seen.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { break };
            s.connections.fetch_add(1, SeqCst);
            let s = s.clone();
            std::thread::spawn(move || backend_conn(c, &s));
        }
    });
    (addr, seen)
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 253) as u8).collect()
}

fn backend_conn(c: TcpStream, seen: &Seen) {
    let mut r = BufReader::new(c.try_clone().expect("clone"));
    let mut w = c;
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            match r.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        seen.heads.lock().unwrap().push(head.clone());
        if head.starts_with("POST /reject") {
            // Answers before the body and reads none of it, holding the connection a while.
            let _ =
                w.write_all(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 5\r\n\r\nlarge");
            std::thread::sleep(std::time::Duration::from_secs(3));
            return;
        }
        let field = |name: &str| {
            head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
        };
        let mut body = Vec::new();
        if let Some(n) = field("content-length") {
            body.resize(n.parse().expect("CL"), 0);
            if r.read_exact(&mut body).is_err() {
                // The proxy gave up on the request (its --request-timeout).
                return;
            }
        } else if field("transfer-encoding").is_some() {
            loop {
                let mut line = String::new();
                r.read_line(&mut line).expect("chunk size");
                let size = usize::from_str_radix(line.trim().split(';').next().unwrap(), 16)
                    .expect("hex size");
                let mut chunk = vec![0; size + 2];
                if size == 0 {
                    // Trailers until the empty line.
                    let mut t = String::new();
                    while r.read_line(&mut t).expect("trailer") > 0 && t != "\r\n" {
                        t.clear();
                    }
                    break;
                }
                r.read_exact(&mut chunk).expect("chunk");
                body.extend_from_slice(&chunk[..size]);
            }
        }
        let target = head.split(' ').nth(1).unwrap_or("/").to_string();
        let n = |prefix: &str| {
            target
                .strip_prefix(prefix)
                .and_then(|n| n.parse::<usize>().ok())
        };
        let ok = |w: &mut TcpStream, body: &[u8]| {
            write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Backend: test\r\n\r\n",
                body.len()
            )
            .and_then(|()| w.write_all(body))
        };
        let r2 = if let Some(len) = n("/bytes/") {
            ok(&mut w, &pattern(len))
        } else if target == "/echo" {
            ok(&mut w, &body)
        } else if let Some(len) = n("/chunked/") {
            let data = pattern(len);
            let mut out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            let mut at = 0;
            let mut step = 1;
            while at < data.len() {
                let take = step.min(data.len() - at);
                out.extend_from_slice(format!("{take:x};ext=1\r\n").as_bytes());
                out.extend_from_slice(&data[at..at + take]);
                out.extend_from_slice(b"\r\n");
                at += take;
                step = step * 3 + 1;
            }
            out.extend_from_slice(b"0\r\nX-Trailer: t\r\n\r\n");
            w.write_all(&out)
        } else if let Some(len) = n("/close/") {
            let _ = write!(w, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
            let _ = w.write_all(&pattern(len));
            return;
        } else if target == "/die" {
            let _ = write!(w, "HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n");
            let _ = w.write_all(&pattern(1000));
            std::thread::sleep(Duration::from_millis(100));
            let _ = socket2::SockRef::from(&w).set_linger(Some(Duration::ZERO));
            return;
        } else if target == "/silent" {
            return;
        } else if target == "/slow" {
            std::thread::sleep(Duration::from_secs(3));
            ok(&mut w, b"late")
        } else if target == "/trickle" {
            let _ = write!(w, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n");
            for b in pattern(100) {
                if w.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        } else if target == "/ws" && field("upgrade").is_some() {
            let _ = write!(
                w,
                "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {}\r\n\r\n",
                field("upgrade").unwrap_or_default()
            );
            let mut buf = [0u8; 4096];
            loop {
                match r.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if w.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = w.shutdown(Shutdown::Write);
            return;
        } else {
            write!(w, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        };
        if r2.is_err() {
            return;
        }
    }
}

fn http_proxy(to: &str) -> crate::support::ServerBuilder {
    Server::builder()
        .proxy(&[to.to_string()])
        .arg("--mode")
        .arg("http")
}

fn curl(port: u16) -> std::process::Command {
    Tls::V13.curl(port, 30)
}

#[test]
fn python_http_server_behind_the_proxy_for_curl_python_and_openssl() {
    if !require("python3") {
        return;
    }
    let dir = tempdir("pyhttp");
    let data = pattern((1 << 20) + 13);
    std::fs::write(dir.join("f.bin"), &data).expect("write");
    let port = free_port();
    let mut py = std::process::Command::new("python3")
        .args([
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3 -m http.server");
    wait_port(port);
    let server = http_proxy(&format!("127.0.0.1:{port}")).start();
    let url = format!("https://localhost:{}/f.bin", server.port());

    let mut c = curl(server.port());
    c.arg(&url);
    let out = tools::run(c, b"", Duration::from_secs(30));
    assert!(out.status.success(), "curl: {}", out.describe());
    assert!(sha256(&out.stdout) == sha256(&data), "curl got other bytes");

    let script = format!(
        "import ssl, http.client, hashlib, sys\n\
         ctx = ssl.create_default_context(cafile={ca:?})\n\
         c = http.client.HTTPSConnection('localhost', {port}, context=ctx)\n\
         for _ in range(3):\n\
         \x20   c.request('GET', '/f.bin')\n\
         \x20   r = c.getresponse()\n\
         \x20   print(r.status, hashlib.sha256(r.read()).hexdigest())\n",
        ca = fixtures::pki().ca_pem.display().to_string(),
        port = server.port()
    );
    let mut p = std::process::Command::new("python3");
    p.args(["-c", &script]);
    let out = tools::run(p, b"", Duration::from_secs(30));
    assert!(out.status.success(), "python: {}", out.describe());
    let want = hex(&sha256(&data));
    assert_eq!(
        out.stdout_text(),
        format!("200 {want}\n").repeat(3),
        "python"
    );

    let mut o = std::process::Command::new("openssl");
    o.args(["s_client", "-quiet", "-connect"])
        .arg(format!("127.0.0.1:{}", server.port()))
        .args(["-servername", "localhost", "-CAfile"])
        .arg(&fixtures::pki().ca_pem);
    let out = tools::run(
        o,
        b"GET /f.bin HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        Duration::from_secs(30),
    );
    let (status, _, body) = tools::split_http(&out.stdout);
    assert_eq!(status, 200, "openssl s_client: {}", out.describe());
    assert!(sha256(&body) == sha256(&data), "openssl got other bytes");

    let _ = py.kill();
    let _ = py.wait();
    let stats = server.stop();
    assert_eq!(stats["proxy_http_requests"], 5, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
}

#[test]
fn keep_alive_100_requests_on_one_backend_connection() {
    let (backend, seen) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    for i in 0..100 {
        let r = c.get(&format!("/bytes/{}", i * 97));
        assert_eq!(r.status, 200);
        assert!(r.body == pattern(i * 97), "request {i}: other bytes");
        assert_eq!(r.header("x-backend"), Some("test"));
    }
    c.close();
    assert_eq!(
        seen.connections.load(SeqCst),
        1,
        "one backend connection for all"
    );
    let stats = server.stop();
    assert_eq!(stats["proxy_http_requests"], 100);
    assert_eq!(stats["proxy_backend_reused"], 99, "{stats:?}");
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let (backend, _) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V12);
    let mut all = Vec::new();
    for i in 0..10 {
        all.extend(crate::support::get_request(
            &format!("/bytes/{}", 1000 + i),
            "",
        ));
    }
    c.write_all(&all).expect("write");
    for i in 0..10 {
        let r = c.read_response(false).expect("response");
        assert_eq!(r.body.len(), 1000 + i, "response {i} out of order");
    }
    c.close();
    server.stop();
}

#[test]
fn forwarding_fields_are_the_proxys_and_hop_by_hop_fields_are_dropped() {
    let request = "GET /bytes/1 HTTP/1.1\r\nHost: localhost\r\nX-Forwarded-For: 6.6.6.6\r\n\
                   Forwarded: for=6.6.6.6\r\nX-Forwarded-Proto: http\r\nConnection: keep-alive, X-Secret\r\n\
                   X-Secret: s\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nX-Kept: k\r\n\r\n";
    for (policy, want_client_fields) in [("replace", false), ("append", true)] {
        let (backend, seen) = http_backend();
        let server = http_proxy(&backend.to_string())
            .arg("--forwarded")
            .arg(policy)
            .start();
        let mut c = TlsClient::connect_version(server.port(), Tls::V13);
        c.write_all(request.as_bytes()).expect("write");
        assert_eq!(c.read_response(false).expect("response").status, 200);
        c.close();
        server.stop();
        let head = seen.heads.lock().unwrap()[0].clone();
        assert!(
            head.contains("X-Forwarded-For: 127.0.0.1\r\n"),
            "{policy}: {head}"
        );
        assert!(
            head.contains("X-Forwarded-Proto: https\r\n"),
            "{policy}: {head}"
        );
        assert!(
            head.contains("Forwarded: for=127.0.0.1;proto=https;host=\"localhost\"\r\n"),
            "{policy}: {head}"
        );
        assert_eq!(
            head.contains("6.6.6.6"),
            want_client_fields,
            "{policy}: {head}"
        );
        assert!(head.contains("X-Kept: k\r\n"), "{policy}: {head}");
        for gone in ["X-Secret", "Keep-Alive", "TE:", "Connection"] {
            assert!(!head.contains(gone), "{policy}: {gone} forwarded: {head}");
        }
    }
}

#[test]
fn bodies_both_ways_by_content_length_and_chunked() {
    let (backend, seen) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let dir = tempdir("bodies");
    let data = pattern(3 * 65536 + 5);
    let file = dir.join("up.bin");
    std::fs::write(&file, &data).expect("write");
    let url = |p: &str| format!("https://localhost:{}{p}", server.port());
    for chunked in [false, true] {
        let mut c = curl(server.port());
        // Expect: 100-continue, and a client that would wait 10 s for the 100.
        c.args(["--data-binary", &format!("@{}", file.display())])
            .args(["-H", "Expect: 100-continue", "--expect100-timeout", "10"]);
        if chunked {
            c.args(["-H", "Transfer-Encoding: chunked"]);
        }
        c.arg(url("/echo"));
        let started = Instant::now();
        let out = tools::run(c, b"", Duration::from_secs(30));
        assert!(out.status.success(), "curl POST: {}", out.describe());
        assert!(
            sha256(&out.stdout) == sha256(&data),
            "chunked={chunked}: echo differs"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the proxy must answer 100-continue itself"
        );
    }
    for path in ["/chunked/1000000", "/close/1000000"] {
        let mut c = curl(server.port());
        c.arg(url(path));
        let out = tools::run(c, b"", Duration::from_secs(30));
        assert!(out.status.success(), "curl {path}: {}", out.describe());
        assert!(
            sha256(&out.stdout) == sha256(&pattern(1_000_000)),
            "{path}: other bytes"
        );
    }
    let heads = seen.heads.lock().unwrap().clone();
    assert!(
        heads[1].contains("Transfer-Encoding: chunked\r\n"),
        "{}",
        heads[1]
    );
    assert!(
        heads.iter().all(|h| !h.contains("Expect")),
        "Expect forwarded: {heads:?}"
    );
    let stats = server.stop();
    assert_eq!(stats["proxy_http_requests"], 4);
}

#[test]
fn request_smuggling_shapes_get_400_and_never_reach_the_backend() {
    let (backend, seen) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let cases: &[&str] = &[
        "POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde",
        "POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
        "POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n",
        "GET /bytes/1 HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    ];
    for raw in cases {
        let mut c = TlsClient::connect_version(server.port(), Tls::V13);
        c.write_all(raw.as_bytes()).expect("write");
        let r = c.read_response(false).expect("response");
        assert_eq!(r.status, 400, "{raw:?}");
        let (rest, end) = c.read_to_end();
        assert!(
            rest.is_empty() && matches!(end, End::CloseNotify),
            "{raw:?}: must close: {end:?}"
        );
    }
    assert_eq!(
        seen.connections.load(SeqCst),
        0,
        "a refused request reached the backend"
    );
    // A broken chunk size after a forwarded head: 400 to the client, the backend's
    // connection reset (it must not take the partial body for a whole one).
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    c.write_all(b"POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n")
        .expect("write");
    assert_eq!(c.read_response(false).expect("response").status, 400);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_refused"], 6, "{stats:?}");
}

/// Sends `raw` on a new connection; the status, and whether the backend saw a new head.
fn one_request(port: u16, raw: &[u8], seen: &Seen) -> (u16, Option<String>) {
    let before = seen.heads.lock().unwrap().len();
    let mut c = TlsClient::connect_version(port, Tls::V13);
    c.write_all(raw).expect("write");
    let r = c.read_response(false).expect("response");
    drop(c);
    let heads = seen.heads.lock().unwrap();
    (r.status, heads.get(before).cloned())
}

#[test]
fn what_reaches_the_backend_is_one_valid_request() {
    let (backend, seen) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let port = server.port();
    // `Connection: Host` cannot take Host away.
    let (status, head) = one_request(
        port,
        b"GET /bytes/1 HTTP/1.1\r\nHost: localhost\r\nConnection: Host\r\n\r\n",
        &seen,
    );
    let head = head.expect("forwarded");
    assert_eq!(status, 200);
    assert!(head.contains("Host: localhost\r\n"), "{head}");
    // An absolute-form target goes in origin-form, Host from it.
    let (status, head) = one_request(
        port,
        b"GET http://localhost:1/bytes/2 HTTP/1.1\r\nHost: other\r\n\r\n",
        &seen,
    );
    let head = head.expect("forwarded");
    assert_eq!(status, 200, "{head}");
    assert!(
        head.starts_with("GET /bytes/2 HTTP/1.1\r\nHost: localhost:1\r\n"),
        "{head}"
    );
    // Every spelling of the client's forwarding fields goes under --forwarded replace.
    let (_, head) = one_request(
        port,
        b"GET /bytes/1 HTTP/1.1\r\nHost: localhost\r\nX_Forwarded_For: 6.6.6.6\r\nX-Real-IP: 6.6.6.6\r\n\r\n",
        &seen,
    );
    let head = head.expect("forwarded");
    assert!(!head.contains("6.6.6.6"), "{head}");
    // HTTP/1.2 is served as 1.1, as serve does; `Content-Length: 5, 5` is 5, as serve reads it.
    let (status, head) = one_request(
        port,
        b"GET /bytes/1 HTTP/1.2\r\nHost: localhost\r\n\r\n",
        &seen,
    );
    assert_eq!(status, 200);
    assert!(head
        .expect("forwarded")
        .starts_with("GET /bytes/1 HTTP/1.1\r\n"));
    let (status, head) = one_request(
        port,
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5, 5\r\n\r\nhello",
        &seen,
    );
    assert_eq!(status, 200);
    assert!(head.expect("forwarded").contains("Content-Length: 5\r\n"));

    // h2c: no tunnel; the request goes as a plain one, and the pipelined one after it is
    // read, rewritten and answered as a request.
    let mut c = TlsClient::connect_version(port, Tls::V13);
    let before = seen.heads.lock().unwrap().len();
    c.write_all(
        b"GET /ws HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\n\
          Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n\
          GET /bytes/3 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    )
    .expect("write");
    let first = c.read_response(false).expect("first response");
    assert_eq!(first.status, 404, "no 101: the backend saw no Upgrade");
    let second = c.read_response(false).expect("second response");
    assert_eq!((second.status, second.body.len()), (200, 3));
    c.close();
    let heads = seen.heads.lock().unwrap()[before..].to_vec();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(
        !heads[0].to_ascii_lowercase().contains("upgrade") && !heads[0].contains("HTTP2-Settings"),
        "{heads:?}"
    );
    assert!(
        heads[1].contains("X-Forwarded-For: 127.0.0.1\r\n"),
        "{heads:?}"
    );

    // Refused with 400 before the backend sees a head.
    let refused: &[&[u8]] = &[
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: identity, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nContent-Length: 50\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nno colon\r\n\r\n",
        b"GET ftp://localhost/bytes/1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    ];
    for raw in refused {
        let (status, head) = one_request(port, raw, &seen);
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(raw));
        assert_eq!(head, None, "{}", String::from_utf8_lossy(raw));
    }
    let stats = server.stop();
    assert_eq!(
        stats["proxy_http_refused"],
        refused.len() as u64,
        "{stats:?}"
    );
    assert_eq!(stats["proxy_upgrades"], 0, "{stats:?}");
}

#[test]
fn backend_failures_give_502_504_or_a_reset_never_a_truncated_success() {
    let (backend, _) = http_backend();
    let server = http_proxy(&backend.to_string())
        .arg("--backend-timeout")
        .arg("1")
        .start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    c.write_all(&crate::support::get_request("/silent", ""))
        .expect("write");
    assert_eq!(c.read_response(false).expect("response").status, 502);
    drop(c);

    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    let started = Instant::now();
    c.write_all(&crate::support::get_request("/slow", ""))
        .expect("write");
    assert_eq!(c.read_response(false).expect("response").status, 504);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "504 after --backend-timeout 1"
    );
    drop(c);

    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    c.write_all(&crate::support::get_request("/die", ""))
        .expect("write");
    let (status, headers) = c.read_head().expect("head");
    assert_eq!(status, 200);
    assert!(headers
        .iter()
        .any(|(k, v)| k == "content-length" && v == "1000000"));
    let (rest, end) = c.read_to_end();
    assert!(rest.len() < 1_000_000, "the body cannot be whole");
    assert!(
        !matches!(end, End::CloseNotify),
        "a backend dying mid-response must not look like a clean end to the client"
    );
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 1, "{stats:?}");
    assert_eq!(stats["proxy_http_504"], 1, "{stats:?}");

    // Nothing listening: 502, and the connection stays usable for the next request.
    let dead = free_port();
    let server = http_proxy(&format!("127.0.0.1:{dead}")).start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V12);
    for _ in 0..2 {
        c.write_all(&crate::support::get_request("/", ""))
            .expect("write");
        assert_eq!(c.read_response(false).expect("response").status, 502);
    }
    c.close();
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 2, "{stats:?}");
}

#[test]
fn websocket_upgrade_switches_to_tcp_mode() {
    let (backend, seen) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    c.write_all(
        b"GET /ws HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .expect("write");
    let (status, headers) = c.read_head().expect("head");
    assert_eq!(status, 101);
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "upgrade" && v == "websocket"),
        "{headers:?}"
    );
    // In rounds (the test client does not read while it writes).
    for round in 0..10 {
        let payload = pattern(20_000 + round);
        c.write_all(&payload).expect("write");
        let mut got = Vec::new();
        c.read_body_with(payload.len() as u64, |b| got.extend_from_slice(b))
            .expect("echo");
        assert!(got == payload, "round {round}: tunnelled bytes differ");
    }
    c.close();
    assert!(seen.heads.lock().unwrap()[0].contains("Upgrade: websocket\r\n"));
    let stats = server.stop();
    assert_eq!(stats["proxy_upgrades"], 1, "{stats:?}");
}

#[test]
fn proxy_protocol_with_http_mode_is_refused_at_start() {
    let out = std::process::Command::new(crate::support::server_bin())
        .args([
            "proxy",
            "--mode",
            "http",
            "--proxy-protocol",
            "v1",
            "--to",
            "127.0.0.1:9",
        ])
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--proxy-protocol is for --mode tcp"), "{err}");
    assert_no_start_up_work(&err);
}

/// An argument error is found before the server does any work: no certificate made or
/// read, no key daemon started (its socket directory would be made for nothing).
fn assert_no_start_up_work(stderr: &str) {
    for line in ["certificate:", "keyd:", "private keys:"] {
        assert!(
            !stderr.contains(line),
            "{line:?} before the error:\n{stderr}"
        );
    }
}

#[test]
fn proxy_without_a_backend_is_refused_before_any_start_up_work() {
    let out = std::process::Command::new(crate::support::server_bin())
        .args(["proxy", "--listen", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no backend: give --to"), "{err}");
    assert_no_start_up_work(&err);
}

fn tempdir(what: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tlsplane-proxy-http-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn wait_port(port: u16) {
    let until = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < until, "nothing listening on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_backend_at_its_connection_limit_gets_no_more_503_instead() {
    let (backend, seen) = http_backend();
    let server = http_proxy(&backend.to_string())
        .arg("--backend-max-connections")
        .arg("1")
        .start();
    let port = server.port();
    // The other client's handshake first: in a slow guest it could outlast the 3 s below.
    let mut c = TlsClient::connect_version(port, Tls::V12);
    // One request holds the backend's only connection for 3 s ...
    let slow = std::thread::spawn(move || {
        let mut c = TlsClient::connect_version(port, Tls::V13);
        let r = c.get("/slow");
        c.close();
        r.status
    });
    let until = Instant::now() + Duration::from_secs(20);
    while !seen
        .heads
        .lock()
        .unwrap()
        .iter()
        .any(|h| h.contains("/slow"))
    {
        assert!(
            Instant::now() < until,
            "the slow request never reached the backend"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // ... so another client is told to come back later, and its connection stays usable.
    assert_eq!(c.get("/bytes/10").status, 503);
    assert_eq!(slow.join().expect("slow client"), 200);
    // The connection is free again (idle, and reused).
    assert_eq!(c.get("/bytes/10").status, 200);
    c.close();
    assert_eq!(seen.connections.load(SeqCst), 1, "the limit was exceeded");
    let stats = server.stop();
    assert_eq!(stats["proxy_backend_full"], 1, "{stats:?}");
}

#[test]
fn an_idle_backend_connection_in_one_worker_leaves_room_for_another() {
    let (backend, seen) = http_backend();
    let server = http_proxy(&backend.to_string())
        .workers(2)
        .arg("--backend-max-connections")
        .arg("1")
        .start();
    let port = server.port();
    // New client connections land on either worker (SO_REUSEPORT hashes the address pair),
    // and each request leaves its backend connection idle in the worker that served it: the
    // other worker must not find the backend full (the chance that all 24 land on one worker
    // is 2^-23).
    for n in 0..24 {
        let mut c = TlsClient::connect_version(port, Tls::V13);
        assert_eq!(c.get("/bytes/10").status, 200, "request {n}");
        c.close();
    }
    let stats = server.stop();
    assert_eq!(stats["proxy_backend_full"], 0, "{stats:?}");
    let evicted = stats["proxy_backend_idle_evicted"];
    assert!(evicted >= 1, "both workers served requests: {stats:?}");
    // Every other request reused the one idle connection of its worker: the limit held.
    assert_eq!(
        seen.connections.load(SeqCst) as u64,
        evicted + 1,
        "{stats:?}"
    );
}

#[test]
fn a_backend_answering_before_the_whole_body_is_heard_at_once() {
    let (backend, _) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let port = server.port();
    // More than the sockets on the way hold, so that the proxy cannot just write it all.
    let upload = std::env::temp_dir().join(format!("tlsplane-upload-{}", std::process::id()));
    std::fs::write(&upload, vec![b'x'; 32 << 20]).expect("upload file");
    let started = Instant::now();
    let out = curl(port)
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--data-binary",
        ])
        .arg(format!("@{}", upload.display()))
        .arg(format!("https://localhost:{port}/reject"))
        .output()
        .expect("curl");
    let took = started.elapsed();
    let _ = std::fs::remove_file(&upload);
    let code = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(code, "413", "curl: {out:?}");
    // 22: --fail's HTTP error, i.e. the exchange ended cleanly; not 55/56 (a send or receive
    // failure: the connection reset under curl's upload, which the proxy's lingering close
    // avoids).
    assert_eq!(out.status.code(), Some(22), "curl: {out:?}");
    assert!(
        took < Duration::from_millis(2500),
        "the answer waited for the backend to give up: {took:?}"
    );
    let stats = server.stop();
    assert_eq!(stats["proxy_early_responses"], 1, "{stats:?}");
}

#[test]
fn a_backend_answering_while_the_client_pauses_its_body_is_heard_at_once() {
    let (backend, _) = http_backend();
    let server = http_proxy(&backend.to_string()).start();
    let port = server.port();
    let mut c = TlsClient::connect_version(port, Tls::V13);
    // 10 bytes of a 100-byte body, then nothing: the backend answers without waiting for
    // the rest, and so must the proxy, not after the client's next bytes or its timeout.
    c.write_all(
        format!(
            "POST /reject HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Length: 100\r\n\r\n0123456789"
        )
        .as_bytes(),
    )
    .expect("request");
    let started = Instant::now();
    let r = c.read_response(false).expect("the backend's answer");
    assert_eq!(r.status, 413);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let stats = server.stop();
    assert_eq!(stats["proxy_early_responses"], 1, "{stats:?}");
}

#[test]
fn request_timeout_bounds_a_request_as_a_whole() {
    let (backend, _) = http_backend();
    let server = http_proxy(&backend.to_string())
        .arg("--request-timeout")
        .arg("1")
        .start();
    let port = server.port();

    // A backend that answers after 3 s: 504 at the deadline, not after --backend-timeout (60).
    let mut c = TlsClient::connect_version(port, Tls::V13);
    let asked = Instant::now();
    assert_eq!(c.get("/slow").status, 504);
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2900),
        "504 after {took:?}"
    );
    drop(c);

    // A response that trickles (each wait well within its own timeout): cut off with a
    // reset at the deadline, never taken for whole.
    let mut c = TlsClient::connect_version(port, Tls::V13);
    c.write_all(&crate::support::get_request("/trickle", ""))
        .expect("write");
    let (status, _) = c.read_head().expect("head");
    assert_eq!(status, 200);
    let (rest, end) = c.read_to_end();
    assert!(
        rest.len() < 100,
        "the body cannot be whole: {} bytes",
        rest.len()
    );
    assert!(
        !matches!(end, End::CloseNotify),
        "a response cut off at the deadline must not end cleanly"
    );

    // A client that sends 10 bytes of a 100-byte body and then nothing: 408.
    let mut c = TlsClient::connect_version(port, Tls::V13);
    c.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        .expect("write");
    let (status, _) = c.read_head().expect("head");
    assert_eq!(status, 408);
    drop(c);

    let stats = server.stop();
    assert_eq!(stats["proxy_request_timeouts"], 3, "{stats:?}");
    assert_eq!(stats["proxy_http_504"], 1, "{stats:?}");
}
