//! Closing with the client's input unread (issue 19, item 1): a server that closes a socket
//! whose receive queue holds bytes makes the kernel reset the connection, and the reset
//! destroys the response still queued. Each case here leaves bytes unread at the close and
//! checks that the client still gets every byte, then close_notify, then a clean EOF; the
//! slow readers are the ones a reset hurts most (most of the response is still queued).

use std::io::{Read, Write};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use crate::support::client::{tcp_connect, ClientOpts, Tls, TlsClient};
use crate::support::{fixtures, Server};

/// The response body of every case: the first 8 MiB of the 64 MiB fixture, by a Range.
const BODY: usize = 8 << 20;

fn expected_body() -> &'static [u8] {
    static BODY_BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BODY_BYTES.get_or_init(|| {
        let mut f = std::fs::File::open(&fixtures::get().big().path).expect("the 64 MiB fixture");
        let mut b = vec![0u8; BODY];
        f.read_exact(&mut b).expect("reading the fixture");
        b
    })
}

fn big_get(extra: &str) -> Vec<u8> {
    let url = &fixtures::get().big().url;
    format!(
        "GET {url} HTTP/1.1\r\nHost: localhost\r\nRange: bytes=0-{}\r\n{extra}\r\n",
        BODY - 1
    )
    .into_bytes()
}

/// One client: sends `first`, then `later` from another thread after `delay` (while it reads,
/// or not), reading at `rate` bytes a second (None: as fast as it can).
struct Case {
    what: String,
    first: Vec<u8>,
    later: Vec<u8>,
    delay: Duration,
    rate: Option<f64>,
}

/// What a client got: the plaintext, and how the stream ended (Ok: close_notify).
struct Got {
    what: String,
    plain: Vec<u8>,
    end: Result<(), String>,
}

/// TLS records for `data`, made now (in sequence) and sent later by another thread.
fn encrypt(c: &mut TlsClient, mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let n = c.conn.writer().write(data).expect("queueing plaintext");
        data = &data[n..];
        while c.conn.wants_write() {
            c.conn.write_tls(&mut out).expect("encrypting");
        }
    }
    out
}

fn run(port: u16, case: Case) -> Got {
    let mut c = TlsClient::connect(port, &ClientOpts::version(Tls::V13));
    c.io.sock
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read timeout");
    c.write_all(&case.first).expect("sending the first request");
    let later = encrypt(&mut c, &case.later);
    let mut sock = c.io.sock.try_clone().expect("socket clone");
    let delay = case.delay;
    let sender = thread::spawn(move || {
        thread::sleep(delay);
        // The server may be gone by now in a failing run: its reset is what is tested.
        let _ = sock.write_all(&later);
    });
    let started = Instant::now();
    let mut plain = Vec::with_capacity(BODY + 4096);
    let mut buf = vec![0u8; 64 * 1024];
    let end = loop {
        let want = match case.rate {
            Some(_) => 16 * 1024,
            None => buf.len(),
        };
        match c.read_plain(&mut buf[..want]) {
            Ok(0) => break Ok(()),
            Ok(n) => plain.extend_from_slice(&buf[..n]),
            Err(e) => break Err(format!("{:?}: {e}", e.kind())),
        }
        if let Some(rate) = case.rate {
            let due = Duration::from_secs_f64(plain.len() as f64 / rate);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                thread::sleep(wait);
            }
        }
    };
    let _ = sender.join();
    Got {
        what: case.what,
        plain,
        end,
    }
}

/// Splits `plain` into responses: (status, body).
fn responses(mut plain: &[u8]) -> Vec<(u16, Vec<u8>)> {
    let mut out = Vec::new();
    while !plain.is_empty() {
        let Some(end) = plain.windows(4).position(|w| w == b"\r\n\r\n") else {
            out.push((0, plain.to_vec()));
            break;
        };
        let head = String::from_utf8_lossy(&plain[..end]).to_string();
        let status: u16 = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        let len = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            })
            .unwrap_or(0);
        let body_end = (end + 4 + len).min(plain.len());
        out.push((status, plain[end + 4..body_end].to_vec()));
        plain = &plain[body_end..];
    }
    out
}

/// Runs the cases at once, each on its own connection, and checks that each got the whole
/// 8 MiB body, then responses with `then` statuses, then close_notify.
fn check_all(port: u16, cases: Vec<Case>, then: &[&[u16]]) {
    check_all_or(port, cases, then, None)
}

/// [`check_all`], where `or` may also follow the first response in place of `then`.
fn check_all_or(port: u16, cases: Vec<Case>, then: &[&[u16]], or: Option<&[u16]>) {
    let handles: Vec<_> = cases
        .into_iter()
        .map(|case| thread::spawn(move || run(port, case)))
        .collect();
    let mut failures = Vec::new();
    for (h, then) in handles.into_iter().zip(then) {
        let got = h.join().expect("client thread");
        let rs = responses(&got.plain);
        let statuses: Vec<u16> = rs.iter().map(|r| r.0).collect();
        let first_ok = rs
            .first()
            .is_some_and(|(s, b)| *s == 206 && b.as_slice() == expected_body());
        let mut want = vec![206];
        want.extend_from_slice(then);
        let or_ok = or.is_some_and(|or| statuses.first() == Some(&206) && statuses[1..] == *or);
        if !first_ok || (statuses != want && !or_ok) || got.end.is_err() {
            failures.push(format!(
                "{}: {} bytes of plaintext, statuses {statuses:?} (want {want:?}), first body {} of {BODY} bytes, intact: {first_ok}; end: {:?}",
                got.what,
                got.plain.len(),
                rs.first().map_or(0, |r| r.1.len()),
                got.end
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

const RATES: [(Option<f64>, &str); 3] = [
    (None, "fast"),
    (Some(4e6), "4 MB/s"),
    (Some(1.5e6), "1.5 MB/s"),
];

#[test]
fn connection_close_then_a_second_request_loses_nothing() {
    let server = Server::start();
    let port = server.port();
    let mut cases = Vec::new();
    for (rate, name) in RATES {
        cases.push(Case {
            what: format!("Connection: close, {name}"),
            first: big_get("Connection: close\r\n"),
            later: crate::support::get_request("/hello.txt", ""),
            delay: Duration::from_millis(300),
            rate,
        });
    }
    check_all(port, cases, &[&[], &[], &[]]);
    let stats = server.stop();
    assert!(stats["lingering_closes"] >= 3, "{stats:?}");
}

#[test]
fn http_1_0_then_a_second_request_loses_nothing() {
    let server = Server::start();
    let port = server.port();
    let url = &fixtures::get().big().url;
    let mut cases = Vec::new();
    for (rate, name) in RATES {
        cases.push(Case {
            what: format!("HTTP/1.0, {name}"),
            first: format!(
                "GET {url} HTTP/1.0\r\nHost: localhost\r\nRange: bytes=0-{}\r\n\r\n",
                BODY - 1
            )
            .into_bytes(),
            later: b"GET /hello.txt HTTP/1.0\r\nHost: localhost\r\n\r\n".to_vec(),
            delay: Duration::from_millis(300),
            rate,
        });
    }
    check_all(port, cases, &[&[], &[], &[]]);
    server.stop();
}

/// A pipelined request answered with an error (and `Connection: close`) arrives while the
/// 8 MiB response is on its way, with bytes after it the server will not read: the 206 and
/// the error both arrive whole.
#[test]
fn pipelined_errors_after_a_large_response_lose_nothing() {
    let server = Server::start();
    let port = server.port();
    // More than the server reads with the failing request (one read takes up to ~74 KB of
    // records on the user plane): a POST whose 300 KB body stays unread at the close.
    let tail = [
        b"POST /hello.txt HTTP/1.1\r\nHost: localhost\r\nContent-Length: 300000\r\n\r\n".as_slice(),
        &vec![b't'; 300_000],
    ]
    .concat();
    let with_tail = |req: Vec<u8>| {
        let mut r = req;
        r.extend_from_slice(&tail);
        r
    };
    let errors: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "405 (DELETE with a body)",
            with_tail(
                [
                    b"DELETE /hello.txt HTTP/1.1\r\nHost: localhost\r\nContent-Length: 20000\r\n\r\n".as_slice(),
                    &[b'x'; 20000],
                ]
                .concat(),
            ),
            405,
        ),
        (
            "413 (GET with a body)",
            with_tail(
                [
                    b"GET /hello.txt HTTP/1.1\r\nHost: localhost\r\nContent-Length: 20000\r\n\r\n".as_slice(),
                    &[b'x'; 20000],
                ]
                .concat(),
            ),
            413,
        ),
        (
            "501 (GET with a chunked body)",
            with_tail(
                b"GET /hello.txt HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec(),
            ),
            501,
        ),
        (
            "400 (no request line)",
            with_tail(b"\x01\x02 not http at all\r\n\r\n".to_vec()),
            400,
        ),
        (
            "431 (a 20 KB header)",
            with_tail(
                format!(
                    "GET /hello.txt HTTP/1.1\r\nHost: localhost\r\nX-Big: {}\r\n\r\n",
                    "a".repeat(20000)
                )
                .into_bytes(),
            ),
            431,
        ),
    ];
    let mut cases = Vec::new();
    let mut then: Vec<&[u16]> = Vec::new();
    for (name, later, status) in &errors {
        cases.push(Case {
            what: format!("{name}, 4 MB/s"),
            first: big_get(""),
            later: later.clone(),
            delay: Duration::from_millis(300),
            rate: Some(4e6),
        });
        then.push(std::slice::from_ref(status));
    }
    check_all(port, cases, &then);
    // Not `stop`, which refuses any 5xx: the 501 is what was asked for here.
    let mut server = server;
    server.terminate();
    let status = server.wait_exit(Duration::from_secs(20));
    let lines = server.stderr_lines();
    assert!(
        status.is_some_and(|s| s.success()),
        "server exit {status:?}: {}",
        lines.join("\n")
    );
    assert!(
        !lines.iter().any(|l| l.contains("panicked")),
        "{}",
        lines.join("\n")
    );
}

/// A 200 followed at once by a POST with a 300 KB body the server never reads (405).
#[test]
fn a_post_body_left_unread_after_a_response_loses_nothing() {
    let server = Server::start();
    let port = server.port();
    let post = [
        b"POST /hello.txt HTTP/1.1\r\nHost: localhost\r\nContent-Length: 300000\r\n\r\n".as_slice(),
        &vec![b'p'; 300_000],
    ]
    .concat();
    let mut cases = Vec::new();
    for (rate, name) in RATES.into_iter().take(2) {
        cases.push(Case {
            what: format!("GET then POST, {name}"),
            first: big_get(""),
            later: post.clone(),
            delay: Duration::ZERO,
            rate,
        });
    }
    check_all(port, cases, &[&[405], &[405]]);
    server.stop();
}

/// SIGTERM while an 8 MiB response is on its way and another request is pipelined behind it:
/// the drain finishes the response and closes without a reset (the pending request is not
/// answered, unless it was read before the SIGTERM: then it is, with `Connection: close`).
#[test]
fn graceful_drain_with_a_pipelined_request_loses_nothing() {
    let mut server = Server::builder().shutdown_grace(8).start();
    let port = server.port();
    let mut cases = Vec::new();
    // Slow enough to be mid-response at the SIGTERM.
    for (rate, name) in RATES.into_iter().skip(1) {
        cases.push(Case {
            what: format!("SIGTERM drain, {name}"),
            first: big_get(""),
            later: crate::support::get_request("/hello.txt", ""),
            delay: Duration::from_millis(300),
            rate,
        });
    }
    // A request the server had already read when the SIGTERM came (under emulation, the
    // pipelined one can arrive with the first) may be answered too, with `Connection: close`:
    // nothing is lost either way.
    let clients = thread::spawn(move || check_all_or(port, cases, &[&[], &[]], Some(&[200])));
    thread::sleep(Duration::from_millis(600));
    server.terminate();
    let result = clients.join();
    let stats = server.stop();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    assert!(stats["lingering_closes"] >= 2, "{stats:?}");
}

/// Reads until EOF; the bytes, and whether the end was clean (not a reset).
fn read_until_end(s: &mut std::net::TcpStream) -> (Vec<u8>, Result<(), String>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, Ok(())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return (got, Err(format!("{:?}: {e}", e.kind()))),
        }
    }
}

/// A handshake refused with an alert while more of the client's bytes are on their way: the
/// client reads the alert and a clean end, not a reset.
#[test]
fn handshake_alerts_with_unread_input_arrive_before_a_clean_end() {
    let server = Server::builder()
        .arg("--max-client-hello")
        .arg("4096")
        .start();
    let port = server.port();
    let junk = vec![0x42u8; 60_000];

    // A ClientHello claiming 5,000 bytes (over the cap) and 60 KB after it.
    let mut s = tcp_connect(port);
    s.write_all(&[22, 3, 1, 0x13, 0x8c, 1, 0, 0x13, 0x88, 3, 3])
        .expect("send");
    s.write_all(&junk).expect("send the rest");
    let (got, end) = read_until_end(&mut s);
    assert_eq!(got, [21, 3, 3, 0, 2, 2, 47], "expected illegal_parameter");
    assert_eq!(end, Ok(()), "the alert must be followed by a clean end");
    drop(s);

    // A record over the largest TLS allows: rustls' record_overflow, then 60 KB more.
    let mut s = tcp_connect(port);
    s.write_all(&[22, 3, 1, 0x48, 0x01]).expect("send");
    s.write_all(&junk).expect("send the rest");
    let (got, end) = read_until_end(&mut s);
    assert_eq!(got.first(), Some(&21), "expected an alert: {got:?}");
    assert_eq!(end, Ok(()), "the alert must be followed by a clean end");
    drop(s);

    let stats = server.stop();
    assert!(stats["lingering_closes"] >= 2, "{stats:?}");
    assert_eq!(stats["limit_max_client_hello"], 1, "{stats:?}");
}
