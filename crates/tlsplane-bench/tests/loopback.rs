//! Runs the benchmarks against an in-process tokio-rustls server on
//! 127.0.0.1 with a self-signed rcgen certificate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use clap::Parser;
use rustls::crypto::aws_lc_rs as provider;
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tlsplane_bench::{BenchCommand, Report};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    cmd: BenchCommand,
}

struct Server {
    addr: SocketAddr,
    ca: PathBuf,
    other_ca: PathBuf,
    big_sha256: String,
}

const BIG_LEN: usize = 256 * 1024 + 17;

fn big_body() -> &'static [u8] {
    static BIG: OnceLock<Vec<u8>> = OnceLock::new();
    BIG.get_or_init(|| (0..BIG_LEN).map(|i| (i * 7 % 251) as u8).collect())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(start_server)
}

fn start_server() -> Server {
    let dir = std::env::temp_dir().join(format!("tlsplane-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, ck.cert.pem()).unwrap();
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let other_ca = dir.join("other.pem");
    std::fs::write(&other_ca, other.cert.pem()).unwrap();

    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config(&ck)));

    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acc = acceptor.clone();
                tokio::spawn(async move {
                    let _ = serve_conn(acc, tcp).await;
                });
            }
        });
    });
    let addr = rx.recv().unwrap();
    Server {
        addr,
        ca,
        other_ca,
        big_sha256: sha256_hex(big_body()),
    }
}

fn server_config(ck: &rcgen::CertifiedKey) -> rustls::ServerConfig {
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der()));
    let mut cfg =
        rustls::ServerConfig::builder_with_provider(Arc::new(provider::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
    cfg.ticketer = provider::Ticketer::new().unwrap();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    cfg
}

fn sha256_hex(b: &[u8]) -> String {
    hex(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b).as_ref())
}

async fn serve_conn(
    acc: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
) -> std::io::Result<()> {
    tcp.set_nodelay(true)?;
    let mut s = acc.accept(tcp).await?;
    let mut buf = vec![0u8; 8192];
    let mut filled = 0;
    loop {
        let end = loop {
            if let Some(p) = buf[..filled].windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let n = s.read(&mut buf[filled..]).await?;
            if n == 0 {
                // close_notify from the client: answer with ours.
                return s.shutdown().await;
            }
            filled += n;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        buf.copy_within(end..filled, 0);
        filled -= end;
        let path = head.split(' ').nth(1).unwrap_or("/").to_string();
        // "/bye": a keep-alive response, then the server closes the idle connection anyway.
        let close = head.contains("connection: close");
        let bye = path == "/bye";
        let (status, body): (&str, &[u8]) = match path.as_str() {
            "/big" => ("200 OK", big_body()),
            "/missing" => ("404 Not Found", b"nope"),
            _ => ("200 OK", b"hello"),
        };
        let resp = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\n{}\r\n",
            body.len(),
            if close { "Connection: close\r\n" } else { "" }
        );
        s.write_all(resp.as_bytes()).await?;
        s.write_all(body).await?;
        s.flush().await?;
        if close || bye {
            return s.shutdown().await;
        }
    }
}

fn bench(args: &[&str]) -> Report {
    let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{e}"));
    let r = match cli.cmd {
        BenchCommand::Handshake(a) => tlsplane_bench::run_handshake(&a),
        BenchCommand::Throughput(a) => tlsplane_bench::run_throughput(&a),
        BenchCommand::Flood(_) => panic!("bench flood has its own report: see tests/flood.rs"),
        BenchCommand::Hold(_) => panic!("bench hold has its own report: see hold()"),
    }
    .unwrap();
    eprintln!("{}", r.to_text());
    r
}

fn hs(extra: &[&str]) -> Report {
    let s = server();
    let target = s.addr.to_string();
    let ca = s.ca.to_str().unwrap().to_string();
    let mut v = vec!["bench", "handshake", &target, "--cacert", &ca];
    v.extend_from_slice(extra);
    bench(&v)
}

#[test]
fn handshake_without_resumption_is_all_full() {
    let r = hs(&["--count", "50", "--resume", "none"]);
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert_eq!(r.handshakes, 50);
    assert_eq!(r.full, 50);
    assert_eq!(r.resumed, 0);
    assert_eq!(r.versions.get("TLSv1.3"), Some(&50));
    assert_eq!(r.groups.get("X25519MLKEM768"), Some(&50));
    assert!(r.latency_us.p50 > 0 && r.latency_us.max >= r.latency_us.p99);
    assert!(r.rate_per_s > 0.0);
    assert!(r.client_cpu_us_per_handshake.is_some());
    assert_eq!(r.engine, "blocking");
}

#[test]
fn handshake_tls12_tickets_resume() {
    let r = hs(&["--count", "50", "--resume", "tickets"]);
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert_eq!(r.handshakes, 50);
    assert_eq!(r.versions.get("TLSv1.2"), Some(&50));
    assert!(r.resumed > 0, "resumed {}", r.resumed);
    assert_eq!(r.full + r.resumed, 50);
}

#[test]
fn handshake_tls13_psk_resume() {
    let r = hs(&["--count", "50", "--resume", "psk"]);
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert_eq!(r.versions.get("TLSv1.3"), Some(&50));
    assert!(r.resumed > 0, "resumed {}", r.resumed);
    assert_eq!(r.full + r.resumed, 50);
}

#[test]
fn handshake_tokio_engine_multiplexes_loops() {
    let r = hs(&[
        "--count",
        "60",
        "--connections",
        "4",
        "--threads",
        "2",
        "--resume",
        "psk",
    ]);
    assert_eq!(r.engine, "tokio");
    assert_eq!(r.threads, 2);
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert_eq!(r.handshakes, 60);
    assert!(r.resumed > 0);
    let r = hs(&[
        "--count",
        "20",
        "--engine",
        "tokio",
        "--tls",
        "1.2",
        "--request",
        "/",
    ]);
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert_eq!((r.handshakes, r.requests, r.full), (20, 20, 20));
}

#[test]
fn handshake_with_request_and_options() {
    let r = hs(&[
        "--count",
        "20",
        "--request",
        "/",
        "--group",
        "secp256r1",
        "--cipher",
        "tls13_aes_128_gcm_sha256",
        "--connections",
        "2",
        "--threads",
        "2",
    ]);
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert_eq!(r.requests, 20);
    assert_eq!(r.bytes, 20 * 5);
    assert_eq!(r.groups.get("secp256r1"), Some(&20));
    assert_eq!(r.suites.get("TLS13_AES_128_GCM_SHA256"), Some(&20));
    let resp = r.response_latency_us.unwrap();
    assert!(resp.p50 >= r.latency_us.p50);

    let r = hs(&["--count", "10", "--request", "/missing", "--tls", "1.2"]);
    assert_eq!(
        r.failures.get("bad_status: 404"),
        Some(&10),
        "{:?}",
        r.failures
    );
    assert_eq!(r.handshakes, 10);
    assert_eq!(r.requests, 0);
}

#[test]
fn handshake_failures_are_classified() {
    let s = server();
    let target = s.addr.to_string();
    let other = s.other_ca.to_str().unwrap().to_string();
    let r = bench(&[
        "bench",
        "handshake",
        &target,
        "--cacert",
        &other,
        "--count",
        "5",
    ]);
    assert_eq!(r.handshakes, 0);
    let (reason, n) = r.failures.iter().next().unwrap();
    assert_eq!(*n, 5);
    assert!(
        reason.starts_with("handshake: invalid peer certificate"),
        "{reason}"
    );

    // Wrong name but --insecure-no-verify: works.
    let r = bench(&[
        "bench",
        "handshake",
        &target,
        "--insecure-no-verify",
        "--sni",
        "wrong.example",
        "--count",
        "5",
    ]);
    assert_eq!((r.handshakes, r.failures_total), (5, 0));

    // Nothing listening.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap().to_string();
    drop(closed);
    let r = bench(&[
        "bench",
        "handshake",
        &dead,
        "--insecure-no-verify",
        "--count",
        "3",
    ]);
    assert_eq!(
        r.failures.get("connect: ConnectionRefused"),
        Some(&3),
        "{:?}",
        r.failures
    );
}

#[test]
fn throughput_reads_and_verifies_bodies() {
    let s = server();
    let url = format!("https://{}/big", s.addr);
    let ca = s.ca.to_str().unwrap().to_string();
    let r = bench(&[
        "bench",
        "throughput",
        &url,
        "--cacert",
        &ca,
        "--duration",
        "1",
        "--connections",
        "2",
        "--threads",
        "2",
        "--verify-sha256",
        &s.big_sha256,
    ]);
    assert_eq!(r.mode, "throughput");
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert!(r.requests > 0);
    assert_eq!(r.bytes, r.requests * BIG_LEN as u64);
    assert!(r.gbytes_per_s > 0.0);
    assert_eq!(r.handshakes, 2);
    assert!(r.client_cpu_s_per_gb.is_some());

    // Tokio engine, TLS 1.2, and a wrong digest: every response fails.
    let wrong = "00".repeat(32);
    let r = bench(&[
        "bench",
        "throughput",
        &url,
        "--cacert",
        &ca,
        "--duration",
        "0.5",
        "--connections",
        "2",
        "--tls",
        "1.2",
        "--verify-sha256",
        &wrong,
    ]);
    assert_eq!(r.engine, "tokio");
    assert_eq!(r.requests, 0);
    assert!(
        r.failures.get("sha256_mismatch").copied().unwrap_or(0) > 0,
        "{:?}",
        r.failures
    );
    assert_eq!(r.versions.keys().collect::<Vec<_>>(), vec!["TLSv1.2"]);
}

#[test]
fn silent_server_times_out() {
    // Accepts connections (kernel backlog) but never answers the ClientHello.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = silent.local_addr().unwrap().to_string();
    for engine in ["blocking", "tokio"] {
        let t0 = std::time::Instant::now();
        let r = bench(&[
            "bench",
            "handshake",
            &target,
            "--insecure-no-verify",
            "--count",
            "2",
            "--timeout",
            "0.3",
            "--engine",
            engine,
        ]);
        assert_eq!(
            r.failures.get("timeout"),
            Some(&2),
            "{engine}: {:?}",
            r.failures
        );
        assert_eq!(r.handshakes, 0);
        let took = t0.elapsed().as_secs_f64();
        assert!((0.55..3.0).contains(&took), "{engine}: {took}");
    }
    drop(silent);
}

/// One blocking rustls server connection that records whether the client's Finished,
/// close_notify and FIN arrived in a single read (one segment).
fn serve_and_check_last_flight(
    cfg: &Arc<rustls::ServerConfig>,
    mut tcp: std::net::TcpStream,
) -> bool {
    use std::io::{Read, Write};
    let mut conn = rustls::ServerConnection::new(cfg.clone()).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut same_read = false;
    while conn.is_handshaking() {
        if conn.wants_write() {
            conn.write_tls(&mut tcp).unwrap();
            continue;
        }
        let n = tcp.read(&mut buf).unwrap();
        assert!(n > 0, "client closed during the handshake");
        let mut rd = &buf[..n];
        while !rd.is_empty() {
            conn.read_tls(&mut rd).unwrap();
        }
        let state = conn.process_new_packets().unwrap();
        same_read = !conn.is_handshaking() && state.peer_has_closed();
    }
    // The FIN came with that segment: the socket is at EOF without waiting.
    tcp.set_nonblocking(true).unwrap();
    let eof_now = matches!(tcp.read(&mut buf), Ok(0));
    tcp.set_nonblocking(false).unwrap();
    conn.send_close_notify();
    while conn.wants_write() {
        if conn.write_tls(&mut tcp).is_err() {
            break;
        }
    }
    let _ = tcp.flush();
    same_read && eof_now
}

#[test]
fn client_last_flight_close_notify_and_fin_share_one_segment() {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cfg = Arc::new(server_config(&ck));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap().to_string();
    let per_engine = 6;
    let server = std::thread::spawn(move || {
        (0..2 * per_engine)
            .map(|_| {
                let (tcp, _) = listener.accept().unwrap();
                tcp.set_nodelay(true).unwrap();
                serve_and_check_last_flight(&cfg, tcp)
            })
            .collect::<Vec<bool>>()
    });
    for engine in ["blocking", "tokio"] {
        let r = bench(&[
            "bench",
            "handshake",
            &target,
            "--insecure-no-verify",
            "--tls",
            "1.3",
            "--count",
            "6",
            "--engine",
            engine,
        ]);
        assert_eq!(r.failures_total, 0, "{engine}: {:?}", r.failures);
        assert_eq!(r.handshakes, 6, "{engine}");
    }
    let seen = server.join().unwrap();
    assert!(seen.iter().all(|&b| b), "per connection: {seen:?}");
}

fn hold(extra: &[&str]) -> tlsplane_bench::HoldReport {
    let s = server();
    let target = s.addr.to_string();
    let ca = s.ca.to_str().unwrap().to_string();
    let mut v = vec!["bench", "hold", &target, "--cacert", &ca];
    if !extra.contains(&"--settle") {
        v.extend(["--settle", "0"]);
    }
    v.extend_from_slice(extra);
    let cli = Cli::try_parse_from(&v).unwrap_or_else(|e| panic!("{e}"));
    let BenchCommand::Hold(a) = cli.cmd else {
        unreachable!()
    };
    let r = tlsplane_bench::run_hold(&a).unwrap();
    eprintln!("{}", r.to_text());
    r
}

#[test]
fn hold_keeps_every_connection_and_still_serves_the_oldest_and_a_new_one() {
    let pid = std::process::id().to_string();
    let r = hold(&[
        "--connections",
        "40",
        "--threads",
        "2",
        "--sources",
        "127.0.0.2-127.0.0.3",
        "--request",
        "/big",
        "--resume",
        "tickets",
        "--server-pid",
        &pid,
    ]);
    assert!(r.ok(), "{}", r.to_text());
    assert_eq!((r.wanted, r.held, r.still_open), (40, 40, 40));
    assert_eq!(r.full_handshakes + r.resumed_handshakes, 40);
    assert!(
        r.resumed_handshakes > 0,
        "one session store for all connections"
    );
    assert!(r.server_rss_before_kib.is_some() && r.server_kib_per_connection.is_some());
    assert!(r.oldest_served_ms.is_some() && r.new_served_ms.is_some());
}

#[test]
fn hold_stops_at_the_first_connection_not_served() {
    let r = hold(&["--connections", "5", "--request", "/missing"]);
    assert!(!r.ok());
    assert_eq!(r.held, 0);
    assert_eq!(r.failure.as_deref(), Some("connection #0: bad_status: 404"));
    assert!(r.oldest_failure.is_some() && r.new_failure.is_some());
}

#[test]
fn hold_counts_the_connections_the_server_closed_while_held() {
    let r = hold(&["--connections", "6", "--request", "/bye", "--settle", "0.3"]);
    assert_eq!((r.held, r.still_open), (6, 0), "{}", r.to_text());
    assert!(r.failure.is_none());
    assert!(!r.ok());
    assert!(r.to_text().contains("the server closed the others"));
}
