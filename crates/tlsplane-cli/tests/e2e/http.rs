//! Tests 2 and 4: keep-alive, pipelining, Range, conditional requests, HEAD, error statuses.

use crate::support::client::{assert_file_body, End, Tls, TlsClient, BOTH};
use crate::support::fixtures::{self, DocFile};
use crate::support::{get_request, Server};

/// The files the keep-alive and pipelining tests cycle through (distinct contents).
fn cycle() -> Vec<&'static DocFile> {
    let fx = fixtures::get();
    let mut v: Vec<&DocFile> = fx.small_files().collect();
    v.push(&fx.hello);
    v.push(&fx.text);
    v
}

#[test]
fn keep_alive_100_requests() {
    for v in BOTH {
        let server = Server::start();
        let files = cycle();
        let mut c = TlsClient::connect_version(server.port(), v);
        for i in 0..100 {
            let f = files[i % files.len()];
            let resp = c.get(&f.url);
            assert_file_body(&resp, f, &format!("{v:?} keep-alive request {i}"));
            assert_ne!(
                resp.header("connection")
                    .map(str::to_ascii_lowercase)
                    .as_deref(),
                Some("close"),
                "request {i}"
            );
        }
        assert!(c.leftover().is_empty());
        c.close();
        let stats = server.stop();
        assert_eq!(stats["handshakes"], 1, "{v:?}: all on one connection");
        assert_eq!(stats["http_connections"], 1);
        assert_eq!(stats["http_requests"], 100);
        assert_eq!(stats["http_responses_4xx"], 0);
        assert_eq!(stats["http_io_errors"], 0);
    }
}

#[test]
fn pipelined_10_requests_in_one_write() {
    for v in BOTH {
        let server = Server::start();
        let files = cycle();
        let mut c = TlsClient::connect_version(server.port(), v);
        let order: Vec<&DocFile> = (0..10).map(|i| files[(i * 3) % files.len()]).collect();
        let mut all = Vec::new();
        for (i, f) in order.iter().enumerate() {
            let extra = if i == 9 { "Connection: close\r\n" } else { "" };
            all.extend_from_slice(&get_request(&f.url, extra));
        }
        let writes_before = c.io.writes.len();
        c.write_all(&all).expect("sending the pipelined requests");
        assert_eq!(
            c.io.writes.len(),
            writes_before + 1,
            "{v:?}: the 10 requests must leave in one socket write"
        );
        for (i, f) in order.iter().enumerate() {
            let resp = c
                .read_response(false)
                .unwrap_or_else(|e| panic!("{v:?}: pipelined response {i}: {e}"));
            assert_file_body(&resp, f, &format!("{v:?} pipelined response {i}"));
        }
        let (rest, end) = c.read_to_end();
        assert!(
            rest.is_empty(),
            "{v:?}: {} bytes after the 10th response",
            rest.len()
        );
        assert!(
            matches!(end, End::CloseNotify),
            "{v:?}: after `Connection: close` the server must send close_notify, got {end:?}"
        );
        let stats = server.stop();
        assert_eq!(stats["handshakes"], 1);
        assert_eq!(stats["http_requests"], 10);
        assert_eq!(stats["http_io_errors"], 0);
    }
}

fn request(
    c: &mut TlsClient,
    method: &str,
    path: &str,
    extra: &str,
) -> crate::support::client::Response {
    let req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n");
    c.write_all(req.as_bytes()).expect("sending a request");
    c.read_response(method == "HEAD")
        .unwrap_or_else(|e| panic!("{method} {path} [{extra:?}]: {e}"))
}

#[test]
fn range_conditional_and_head() {
    let fx = fixtures::get();
    let f = fx.file(16385);
    let content = std::fs::read(&f.path).expect("fixture");
    let size = content.len();
    for v in BOTH {
        let server = Server::start();
        // All on one connection: a body sent where none is due would break the next response.
        let mut c = TlsClient::connect_version(server.port(), v);
        let full = request(&mut c, "GET", &f.url, "");
        assert_file_body(&full, f, "plain GET");
        assert_eq!(full.header("accept-ranges"), Some("bytes"));
        let etag = full.header("etag").expect("ETag").to_string();
        let last_modified = full
            .header("last-modified")
            .expect("Last-Modified")
            .to_string();

        let cases: [(&str, usize, usize); 3] = [
            ("bytes=0-99", 0, 99),
            ("bytes=100-", 100, size - 1),
            ("bytes=-10", size - 10, size - 1),
        ];
        for (range, first, last) in cases {
            let r = request(&mut c, "GET", &f.url, &format!("Range: {range}\r\n"));
            assert_eq!(r.status, 206, "{v:?} {range}");
            assert_eq!(
                r.header("content-range").map(str::to_string),
                Some(format!("bytes {first}-{last}/{size}")),
                "{v:?} {range}"
            );
            assert_eq!(
                r.content_length(),
                Some((last - first + 1) as u64),
                "{v:?} {range}"
            );
            assert!(
                r.body == content[first..=last],
                "{v:?} {range}: wrong bytes"
            );
        }

        let r = request(&mut c, "GET", &f.url, "Range: bytes=999999999-\r\n");
        assert_eq!(r.status, 416, "{v:?} unsatisfiable range");
        assert_eq!(
            r.header("content-range").map(str::to_string),
            Some(format!("bytes */{size}"))
        );

        let r = request(&mut c, "GET", &f.url, &format!("If-None-Match: {etag}\r\n"));
        assert_eq!(r.status, 304, "{v:?} If-None-Match");
        assert!(r.body.is_empty());
        assert_eq!(r.header("etag"), Some(etag.as_str()));

        let r = request(
            &mut c,
            "GET",
            &f.url,
            "If-None-Match: \"some-other-tag\"\r\n",
        );
        assert_file_body(&r, f, "If-None-Match with another tag");

        let r = request(
            &mut c,
            "GET",
            &f.url,
            &format!("If-Modified-Since: {last_modified}\r\n"),
        );
        assert_eq!(r.status, 304, "{v:?} If-Modified-Since equal");
        let r = request(
            &mut c,
            "GET",
            &f.url,
            "If-Modified-Since: Fri, 01 Jan 2100 00:00:00 GMT\r\n",
        );
        assert_eq!(r.status, 304, "{v:?} If-Modified-Since in the future");
        let r = request(
            &mut c,
            "GET",
            &f.url,
            "If-Modified-Since: Mon, 01 Jan 1990 00:00:00 GMT\r\n",
        );
        assert_file_body(&r, f, "If-Modified-Since in the past");

        let h = request(&mut c, "HEAD", &f.url, "");
        assert_eq!(h.status, 200, "{v:?} HEAD");
        assert_eq!(
            h.content_length(),
            Some(f.size),
            "{v:?} HEAD Content-Length"
        );
        assert_eq!(h.header("etag"), Some(etag.as_str()));
        let h = request(&mut c, "HEAD", &f.url, "Range: bytes=0-99\r\n");
        assert!(
            h.status == 200 || h.status == 206,
            "{v:?} HEAD with Range: {}",
            h.status
        );

        // Nothing stray after the body-less responses: this one must parse and be intact.
        let after = request(&mut c, "GET", &fx.hello.url, "Connection: close\r\n");
        assert_file_body(&after, &fx.hello, "GET after 304s and HEADs");
        let (rest, end) = c.read_to_end();
        assert!(
            rest.is_empty(),
            "{v:?}: stray bytes after the last response: {:?}",
            String::from_utf8_lossy(&rest)
        );
        assert!(matches!(end, End::CloseNotify), "{v:?}: {end:?}");
        let stats = server.stop();
        assert_eq!(stats["http_requests"], 13);
        assert_eq!(stats["http_responses_4xx"], 1, "the 416");
    }
}

/// Sends one raw request on a fresh connection and reads everything until the server closes.
pub fn raw_exchange(port: u16, v: Tls, raw: &[u8]) -> (Vec<u8>, End) {
    let mut c = TlsClient::connect_version(port, v);
    c.write_all(raw).expect("sending");
    c.read_to_end()
}

pub fn status_of(raw: &[u8]) -> u16 {
    let line = raw.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    assert!(
        line.starts_with("HTTP/1.1 "),
        "no HTTP status line in {:?}",
        String::from_utf8_lossy(&raw[..raw.len().min(200)])
    );
    line[9..12].parse().expect("status code")
}

#[test]
fn error_statuses() {
    let server = Server::start();
    let port = server.port();
    let long = format!("/{}", "a".repeat(9000));
    let cases: Vec<(String, Vec<u16>)> = vec![
        (
            "GET /no-such-file HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".into(),
            vec![404],
        ),
        (
            "DELETE /hello.txt HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".into(),
            vec![405],
        ),
        (
            "PUT /hello.txt HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".into(),
            vec![405],
        ),
        (
            format!("GET {long} HTTP/1.1\r\nHost: localhost\r\n\r\n"),
            vec![414],
        ),
        ("THIS IS NOT HTTP\r\n\r\n".into(), vec![400]),
        (
            "GET /hello.txt HTTP/1.1\r\nBad Header Without Colon\r\n\r\n".into(),
            vec![400],
        ),
        (
            "GET /sub/ HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".into(),
            vec![403, 404],
        ),
        // A space inside the target is a malformed request line, not a version problem.
        (
            "GET /a b HTTP/1.1\r\nHost: localhost\r\n\r\n".into(),
            vec![400],
        ),
        // Other methods are 405 (with Allow) even with a body, which is never read: the
        // connection closes after the answer although the client asked for none of that.
        (
            "POST /hello.txt HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello".into(),
            vec![405],
        ),
    ];
    for (i, (req, want)) in cases.iter().enumerate() {
        let v = if i % 2 == 0 { Tls::V13 } else { Tls::V12 };
        let (raw, end) = raw_exchange(port, v, req.as_bytes());
        let status = status_of(&raw);
        if status == 405 {
            let text = String::from_utf8_lossy(&raw);
            assert!(
                text.contains("\r\nallow: GET, HEAD\r\n")
                    || text.contains("\r\nAllow: GET, HEAD\r\n"),
                "405 without Allow: {text}"
            );
        }
        assert!(
            want.contains(&status),
            "request {:?}: status {status}, want {want:?}",
            &req[..req.len().min(60)]
        );
        assert!(
            matches!(end, End::CloseNotify),
            "request {i}: the server must close with close_notify after an error/close: {end:?}"
        );
    }
    let stats = server.stop();
    assert_eq!(stats["http_responses_4xx"], cases.len() as u64);
    assert_eq!(stats["handshakes"], cases.len() as u64);
}

/// `serve` lifts its soft open-files limit to the hard one (one descriptor per connection; a
/// soft limit of 1024, the usual default, would cap it far below what the system allows).
#[test]
fn serve_raises_its_open_files_limit() {
    if crate::support::tools::find_in_path("prlimit").is_none() {
        eprintln!("SKIPPED: no prlimit to start the server with a low soft limit");
        return;
    }
    let limits = |pid: u32| -> (String, String) {
        let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
        let line = text
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .expect("Max open files line")
            .to_string();
        let mut f = line["Max open files".len()..].split_whitespace();
        (f.next().unwrap().to_string(), f.next().unwrap().to_string())
    };
    let hard = limits(std::process::id()).1;
    if hard == "256" || hard == "unlimited" {
        eprintln!("SKIPPED: hard limit {hard} leaves nothing to show");
        return;
    }
    let server = Server::builder().soft_nofile(256).start();
    let (soft, server_hard) = limits(server.pid());
    assert_eq!(server_hard, hard, "prlimit changed only the soft limit");
    assert_eq!(soft, hard, "the server runs with soft = hard, not 256");
    let fx = fixtures::get();
    assert_file_body(
        &crate::support::client::fetch(server.port(), Tls::V13, &fx.hello.url),
        &fx.hello,
        "after start-up",
    );
}

/// RFC 9112 §2.3: HTTP/1.2 (a later HTTP/1 minor version) is served as HTTP/1.1.
#[test]
fn later_http1_minor_version_is_served_as_11() {
    let server = Server::start();
    let hello = &fixtures::get().hello;
    let req = format!("GET {} HTTP/1.2\r\nHost: localhost\r\n\r\n", hello.url);
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    c.write_all(req.as_bytes()).expect("request");
    let resp = c.read_response(false).expect("response");
    assert_file_body(&resp, hello, "HTTP/1.2");
    // Served with 1.1 semantics: the connection stays open for the next request.
    assert_eq!(c.get(&hello.url).status, 200);
    c.close();
    server.stop();
}

/// A new connection that has sent nothing since its handshake waits for its first request
/// where its handshake ran while that loop has nothing else to do, and is served there; a
/// full handshake starting there moves the waiting connection to the connection loop, where
/// it is served all the same. On both planes (the kernel plane's wait peeks).
#[test]
fn first_request_waits_on_a_quiet_handshake_loop_and_moves_for_a_full_handshake() {
    use std::time::Duration;
    let server = Server::builder().workers(1).start();
    let f = fixtures::get().file(16383);
    // Waits (nothing else on the loop), then asks: served where its handshake ran.
    let mut a = TlsClient::connect_version(server.port(), Tls::V13);
    std::thread::sleep(Duration::from_millis(50));
    assert_file_body(&a.get(&f.url), f, "a, first");
    // Waits too; then another client's full handshake (a fresh configuration: nothing to
    // resume) moves it.
    let mut b = TlsClient::connect_version(server.port(), Tls::V13);
    std::thread::sleep(Duration::from_millis(50));
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    std::thread::sleep(Duration::from_millis(50));
    for (name, client) in [("b", &mut b), ("c", &mut c), ("a, second", &mut a)] {
        assert_file_body(&client.get(&f.url), f, name);
    }
    let stats = server.stop();
    // a and c were served where their handshakes ran; b moved when c's handshake started.
    assert_eq!(stats["first_request_here"], 2, "{stats:?}");
    assert_eq!(stats["first_request_moved"], 1, "{stats:?}");
}
