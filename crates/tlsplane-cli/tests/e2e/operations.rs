//! What an operator meets: deadlines that hold against trickling clients, first responses
//! without a Nagle stall, a port that is already taken, SIGHUP, and start-up errors that say
//! what is wrong.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::client::{fetch, Tls, TlsClient};
use crate::support::fixtures::{self, CertKind};
use crate::support::{info_message, server_bin, tools, Server};

/// A client that, like many, never sets TCP_NODELAY: after the handshake its request waits
/// until the server acknowledges its Finished. The server must not leave that to its delayed
/// ACK (~40 ms).
const PYTHON_NO_NODELAY: &str = r#"
import json, socket, ssl, sys, time
port, ca, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ctx = ssl.create_default_context(cafile=ca)
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
times, version = [], None
for _ in range(n):
    raw = socket.create_connection(("127.0.0.1", port))
    assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    s = ctx.wrap_socket(raw, server_hostname="localhost")
    t0 = time.perf_counter()
    s.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: localhost\r\n\r\n")
    first = s.recv(1)
    times.append((time.perf_counter() - t0) * 1000.0)
    assert first == b"H", first
    version = s.version()
    s.close()
print(json.dumps({"version": version, "ms": times}))
"#;

fn first_response_without_nodelay(tickets: &str) {
    if !tools::require("python3") {
        return;
    }
    let server = Server::builder()
        .arg("--tls13-tickets")
        .arg(tickets)
        .start();
    let mut cmd = Command::new("python3");
    cmd.args(["-c", PYTHON_NO_NODELAY, &server.port().to_string()])
        .arg(&fixtures::pki().ca_pem)
        .arg("20");
    let out = tools::run(cmd, b"", Duration::from_secs(60));
    assert!(
        out.status.success(),
        "python client failed:\n{}",
        out.describe()
    );
    let v: serde_json::Value =
        serde_json::from_str(out.stdout_text().trim()).expect("python output");
    assert_eq!(v["version"], "TLSv1.3");
    let mut ms: Vec<f64> = v["ms"]
        .as_array()
        .expect("times")
        .iter()
        .map(|t| t.as_f64().expect("a number"))
        .collect();
    ms.sort_by(f64::total_cmp);
    let median = ms[ms.len() / 2];
    eprintln!("tickets {tickets}: time to first response byte, ms: {ms:?}");
    assert!(
        median < 5.0,
        "tickets {tickets}: median time to the first response byte is {median:.1} ms (a Nagle \
         stall behind the server's delayed ACK); all: {ms:?}"
    );
    server.stop();
}

#[test]
fn tls13_first_response_without_nodelay_with_tickets() {
    first_response_without_nodelay("1");
}

#[test]
fn tls13_first_response_without_nodelay_without_tickets() {
    first_response_without_nodelay("0");
}

/// Keeps fetching from `port` on fresh connections until told to stop; returns how many
/// fetches succeeded. Any failure fails the test.
fn background_client(port: u16, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut served = 0;
        while !stop.load(Ordering::Relaxed) {
            let r = fetch(port, Tls::V13, &fixtures::get().hello.url);
            assert_eq!(
                r.status, 200,
                "the normal client was refused during the test"
            );
            served += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        served
    })
}

/// `--header-timeout` is one deadline from the first byte of a request to the end of its head,
/// not a fresh timeout for every read: a client sending a byte a second is closed at it.
#[test]
fn header_timeout_is_a_deadline_against_trickling_clients() {
    let header_timeout = 3.0;
    let server = Server::builder().arg("--header-timeout").arg("3").start();
    let port = server.port();
    let stop = Arc::new(AtomicBool::new(false));
    let normal = background_client(port, stop.clone());

    let mut c = TlsClient::connect_version(port, Tls::V13);
    c.io.sock
        .set_read_timeout(Some(Duration::from_millis(700)))
        .expect("read timeout");
    let head = b"GET /hello.txt HTTP/1.1\r\nHost: localhost\r\nX-Slow: ";
    let started = Instant::now();
    let mut closed_after = None;
    for (i, byte) in head.iter().cycle().take(20).enumerate() {
        if c.write_all(std::slice::from_ref(byte)).is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        // The 408, close_notify or EOF means the server gave up on us (a session ticket, sent
        // right after the handshake on the kernel plane, does not).
        match c.read_tls_once() {
            Ok(n) => {
                let st = c.conn.process_new_packets().expect("TLS state");
                if n == 0 || st.plaintext_bytes_to_read() > 0 || st.peer_has_closed() {
                    closed_after = Some(started.elapsed());
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => {
                closed_after = Some(started.elapsed());
                break;
            }
        }
        if i > 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let served = normal.join().expect("normal client");
    let closed_after = closed_after.unwrap_or_else(|| {
        panic!(
            "a client trickling its request head was still connected after {:?} with \
             --header-timeout 3",
            started.elapsed()
        )
    });
    let secs = closed_after.as_secs_f64();
    assert!(
        (header_timeout - 1.0..=header_timeout + 1.0).contains(&secs),
        "trickling client closed after {secs:.2} s; the deadline is {header_timeout} s (±1 s)"
    );
    assert!(
        served >= 5,
        "the normal client was served only {served} times"
    );
    let stats = server.stop();
    assert!(
        stats["http_timeouts"] >= 1,
        "the deadline was not counted: {stats:?}"
    );
}

/// A second server on a port that is already listened on must refuse to start, not share it
/// through SO_REUSEPORT and take part of the first one's connections.
#[test]
fn second_server_on_a_taken_port_refuses_to_start() {
    let first = Server::start();
    let port = first.port();
    let fx = fixtures::get();
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let mut second = Command::new(server_bin())
        .arg("serve")
        .arg(&fx.www)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--workers", "2"])
        .arg("--cert")
        .arg(&leaf.cert_pem)
        .arg("--key")
        .arg(&leaf.key_pem)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the second server");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = second.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = second.kill();
            let _ = second.wait();
            panic!("a second server started on 127.0.0.1:{port}, already taken by the first");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(second.stderr.as_mut().expect("stderr"), &mut err)
        .expect("stderr");
    assert!(!status.success(), "second server: {status}; stderr:\n{err}");
    assert!(
        err.contains("already in use") && err.contains(&format!("127.0.0.1:{port}")),
        "the error should name the address and say it is in use:\n{err}"
    );
    // The first server keeps all of its connections.
    for _ in 0..20 {
        assert_eq!(fetch(port, Tls::V13, &fx.hello.url).status, 200);
    }
    first.stop();

    // The workers of one server still share a fixed port.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let multi = Server::builder()
        .arg("--listen")
        .arg(format!("127.0.0.1:{free}"))
        .workers(2)
        .start();
    // start() returns at the first address's "listening" line; the second may follow later
    // (a slow guest makes the gap visible).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", free)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {free}");
        std::thread::sleep(Duration::from_millis(20));
    }
    for _ in 0..10 {
        assert_eq!(fetch(free, Tls::V13, &fx.hello.url).status, 200);
    }
    multi.stop();
}

/// SIGHUP must not kill the server (its default action): without a configuration file it
/// re-reads the certificate and the root, and connections from before it stay up.
#[test]
fn sighup_reloads_and_the_server_keeps_serving() {
    let mut server = Server::start();
    let port = server.port();
    let hello = &fixtures::get().hello;
    let mut kept = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(kept.get(&hello.url).status, 200);
    let status = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    std::thread::sleep(Duration::from_millis(300));
    server.assert_alive();
    assert_eq!(fetch(port, Tls::V13, &hello.url).status, 200);
    assert_eq!(
        kept.get(&hello.url).status,
        200,
        "a connection from before SIGHUP was dropped"
    );
    kept.close();
    server.wait_lines("configuration reloaded", 1, Duration::from_secs(20));
    server.stop();
}

/// The port line (and the pid file) come after the signal handlers: a SIGHUP the moment a
/// server says it listens reloads it. (In an emulated guest, a SIGHUP in that window killed
/// a server whose handlers were installed later.)
#[test]
fn sighup_right_after_start_reloads() {
    let mut server = Server::start();
    let status = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !server
        .stderr_lines()
        .iter()
        .any(|l| l.contains("configuration reloaded"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no reload after an early SIGHUP: {:?}",
            server.stderr_lines()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server.assert_alive();
    assert_eq!(
        fetch(server.port(), Tls::V13, &fixtures::get().hello.url).status,
        200
    );
    server.stop();
}

fn run_server(args: &[&std::ffi::OsStr]) -> tools::Output {
    let mut cmd = Command::new(server_bin());
    cmd.arg("serve")
        .args(args)
        .args(["--listen", "127.0.0.1:0"]);
    tools::run(cmd, b"", Duration::from_secs(20))
}

#[test]
fn zero_workers_is_refused() {
    let www = fixtures::get().www.as_os_str();
    let out = run_server(&[www, "--workers".as_ref(), "0".as_ref()]);
    assert_eq!(out.status.code(), Some(2), "{}", out.describe());
    assert!(
        out.stderr_text().contains("at least 1"),
        "{}",
        out.describe()
    );
}

#[test]
fn key_errors_say_what_is_wrong() {
    if !tools::require("openssl") {
        return;
    }
    let www = fixtures::get().www.as_os_str();
    let p256 = fixtures::pki().leaf(CertKind::P256);
    let p384 = fixtures::pki().leaf(CertKind::P384);

    // An encrypted PKCS#8 key: say that encryption is the problem.
    let dir = fixtures::get().base.join("encrypted-key");
    std::fs::create_dir_all(&dir).expect("dir");
    let enc = dir.join("key.pem");
    let out = tools::run(
        {
            let mut c = Command::new("openssl");
            c.args(["pkcs8", "-topk8", "-passout", "pass:secret", "-in"])
                .arg(&p256.key_pem)
                .arg("-out")
                .arg(&enc);
            c
        },
        b"",
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "openssl pkcs8: {}", out.describe());
    let out = run_server(&[
        www,
        "--cert".as_ref(),
        p256.cert_pem.as_os_str(),
        "--key".as_ref(),
        enc.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", out.describe());
    let err = out.stderr_text();
    assert!(
        err.contains("encrypted") && err.contains("not supported") && err.contains("key.pem"),
        "encrypted key: {err}"
    );

    // A key that belongs to another certificate: name both files, say it once.
    let out = run_server(&[
        www,
        "--cert".as_ref(),
        p256.cert_pem.as_os_str(),
        "--key".as_ref(),
        p384.key_pem.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", out.describe());
    let err = out.stderr_text();
    assert!(
        err.contains(&*p256.cert_pem.to_string_lossy())
            && err.contains(&*p384.key_pem.to_string_lossy())
            && err.matches("does not belong").count() == 1
            && !err.contains("do not match"),
        "mismatched key: {err}"
    );
}

/// Plain HTTP to the TLS port gets a plain 400 that says to use https (as nginx and Go answer),
/// counted, then the connection closes; the server goes on serving TLS.
#[test]
fn plain_http_on_the_tls_port_gets_a_400_that_says_https() {
    if !tools::require("curl") {
        return;
    }
    let server = Server::start();
    let port = server.port();
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}"])
        .arg(format!("http://127.0.0.1:{port}/hello.txt"));
    let out = tools::run(cmd, b"", Duration::from_secs(20));
    let text = out.stdout_text();
    assert!(
        text.ends_with("\n400") && text.contains("https://"),
        "curl over plain HTTP:\n{}",
        out.describe()
    );
    assert_eq!(
        fetch(port, Tls::V13, &fixtures::get().hello.url).status,
        200
    );
    let stats = server.stop();
    assert_eq!(stats["plain_http_requests"], 1, "{stats:?}");
}

/// The access log names the method and the plane as an operator greps for them (`GET`,
/// `kernel`/`user`), not as Rust's debug names (`Get`, `User`).
#[test]
fn access_log_lines_use_wire_names() {
    let server = Server::builder().arg("--access-log").start();
    let resp = fetch(server.port(), Tls::V13, "/hello.txt");
    assert_eq!(resp.status, 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    let line = loop {
        if let Some(l) = server
            .stderr_lines()
            .into_iter()
            .find(|l| l.contains("request"))
        {
            break l;
        }
        assert!(Instant::now() < deadline, "no access log line");
        std::thread::sleep(Duration::from_millis(20));
    };
    let plane = format!("plane={}", crate::support::mode().as_str());
    assert!(line.contains("method=GET"), "{line}");
    assert!(line.contains(&plane), "{line}");
    server.stop();
}

/// The server's start-up and shutdown lines are log lines like the others: `tracing`'s
/// format at info level, and subject to `TLSPLANE_LOG` (issue 19 §8: they were printed raw,
/// so `TLSPLANE_LOG=warn` could not quiet them). The `--stats` line, which scripts parse,
/// stays a raw line printed whatever the filter.
#[test]
fn start_up_lines_go_through_the_log_filter_and_the_stats_line_does_not() {
    let mut server = Server::builder().arg("--admin").arg("127.0.0.1:0").start();
    server.terminate();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !server
        .stderr_lines()
        .iter()
        .any(|l| l.starts_with("tlsplane-stats "))
    {
        assert!(Instant::now() < deadline, "no stats line after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    let lines = server.stderr_lines();
    for start in [
        "keyd: ",
        "private keys: ",
        "data plane: ",
        "admin endpoint on http://",
        "listening on https://",
        "shutting down: ",
    ] {
        assert!(
            lines
                .iter()
                .filter_map(|l| info_message(l))
                .any(|m| m.starts_with(start)),
            "no INFO log line {start:?}...:\n{}",
            lines.join("\n")
        );
        assert!(
            !lines.iter().any(|l| l.starts_with(start)),
            "{start:?} printed raw, not as a log line:\n{}",
            lines.join("\n")
        );
    }
    server.stop();

    // Info filtered out: nothing of the above (nor the generated certificate's line, with no
    // --cert), and the stats line still there. The pid file says when it listens.
    let dir = crate::sites::scratch("start_up_lines_filtered");
    let pid_file = dir.join("tlsplane.pid");
    let mut child = Command::new(server_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--workers",
            "1",
            "--stats",
        ])
        .args(["--admin", "127.0.0.1:0", "--pid-file"])
        .arg(&pid_file)
        .arg(&fixtures::get().www)
        .env("TLSPLANE_HOME", &dir)
        .env("TLSPLANE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&pid_file).map_or(true, |p| p.trim().is_empty()) {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("no pid file within 20 s: {:?}", child.wait_with_output());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    assert!(out.stdout.is_empty(), "stdout: {:?}", out.stdout);
    let stats: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("tlsplane-stats {"))
        .collect();
    assert_eq!(stats.len(), 1, "one raw stats line:\n{stderr}");
    assert_eq!(
        stderr.lines().count(),
        1,
        "TLSPLANE_LOG=warn: nothing but the stats line:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
