//! `bench flood` against an in-process tokio-rustls server on 127.0.0.1 that counts
//! what it sees, and against scripted fake servers for each failure kind.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use rustls::crypto::aws_lc_rs as provider;
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tlsplane_bench::{BenchCommand, FloodReport};

#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    cmd: BenchCommand,
}

fn flood(target: &str, extra: &[&str]) -> anyhow::Result<FloodReport> {
    let mut v = vec!["bench", "flood", target];
    v.extend_from_slice(extra);
    let cli = Cli::try_parse_from(v).unwrap_or_else(|e| panic!("{e}"));
    let BenchCommand::Flood(a) = cli.cmd else {
        unreachable!()
    };
    let r = tlsplane_bench::run_flood(&a)?;
    eprintln!("{}", r.to_text());
    Ok(r)
}

/// What the server saw, per TCP connection.
#[derive(Default)]
struct Seen {
    accepted: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
}

/// A tokio-rustls server (ECDSA P-256 from rcgen) that completes handshakes if the
/// client lets it, and counts them.
fn rustls_server(
    groups: Option<Vec<&'static dyn rustls::crypto::SupportedKxGroup>>,
) -> (SocketAddr, Arc<Seen>) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der()));
    let mut prov = provider::default_provider();
    if let Some(g) = groups {
        prov.kx_groups = g;
    }
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(prov))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![ck.cert.der().clone()], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let seen = Arc::new(Seen::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let s = seen.clone();
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
                s.accepted.fetch_add(1, Ordering::SeqCst);
                let (acc, s) = (acceptor.clone(), s.clone());
                tokio::spawn(async move {
                    let r = tokio::time::timeout(Duration::from_secs(10), acc.accept(tcp)).await;
                    match r {
                        Ok(Ok(_)) => s.completed.fetch_add(1, Ordering::SeqCst),
                        _ => s.failed.fetch_add(1, Ordering::SeqCst),
                    };
                });
            }
        });
    });
    (rx.recv().unwrap(), seen)
}

/// Waits (bounded) until every accepted connection has ended one way or the other.
fn settle(seen: &Seen, accepted: u64) -> (u64, u64, u64) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let a = seen.accepted.load(Ordering::SeqCst);
        let c = seen.completed.load(Ordering::SeqCst);
        let f = seen.failed.load(Ordering::SeqCst);
        if (a >= accepted && c + f == a) || Instant::now() > end {
            return (a, c, f);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn flood_counts_first_flights_and_no_handshake_completes() {
    for (tls, n) in [("1.3", 200u64), ("1.2", 120)] {
        let (addr, seen) = rustls_server(None);
        let target = addr.to_string();
        let count = n.to_string();
        let r = flood(
            &target,
            &[
                "--concurrency",
                "16",
                "--count",
                &count,
                "--tls",
                tls,
                "--group",
                "x25519",
                "--sni",
                "localhost",
            ],
        )
        .unwrap();
        assert_eq!(r.mode, "flood");
        assert_eq!(r.failures_total, 0, "{tls}: {:?}", r.failures);
        assert_eq!((r.attempts, r.flights), (n, n), "{tls}");
        assert!(r.rate_per_s > 0.0);
        assert!(r.latency_us.p50 > 0 && r.latency_us.max >= r.latency_us.p99);
        assert!(r.client_cpu_us_per_flight.is_some());
        let probe = r.probe.as_ref().expect("probe ran");
        assert_eq!(probe.records, r.flight_records);
        assert_eq!(probe.record_types.len() as u32, probe.records);
        assert_eq!(probe.record_types[0], 22, "starts with the ServerHello");
        assert_eq!(probe.group, "X25519");
        if tls == "1.3" {
            assert_eq!(probe.version, "TLSv1.3");
            // The rest of the flight is encrypted.
            assert_eq!(*probe.record_types.last().unwrap(), 23, "{probe:?}");
        } else {
            assert_eq!(probe.version, "TLSv1.2");
            assert!(probe.record_types.iter().all(|&t| t == 22), "{probe:?}");
        }
        // The server accepted the probe and every flood connection, and none of them
        // ever finished its handshake.
        let (accepted, completed, failed) = settle(&seen, n + 1);
        assert_eq!(accepted, n + 1, "{tls}");
        assert_eq!(completed, 0, "{tls}");
        assert_eq!(failed, n + 1, "{tls}");
    }
}

#[test]
fn flood_with_a_duration_and_threads() {
    let (addr, seen) = rustls_server(None);
    let t0 = Instant::now();
    let r = flood(
        &addr.to_string(),
        &["--concurrency", "8", "--threads", "2", "--duration", "0.5"],
    )
    .unwrap();
    let took = t0.elapsed().as_secs_f64();
    assert!((0.5..5.0).contains(&took), "{took}");
    assert_eq!(r.threads, 2);
    assert_eq!(r.failures_total, 0, "{:?}", r.failures);
    assert!(r.flights > 8, "{}", r.flights);
    // Default ClientHello: the hybrid post-quantum share, which rustls servers pick.
    assert_eq!(r.probe.as_ref().unwrap().group, "X25519MLKEM768");
    assert!(r.client_hello_bytes > 1200, "{}", r.client_hello_bytes);
    let (_, completed, _) = settle(&seen, r.attempts + 1);
    assert_eq!(completed, 0);
}

#[test]
fn probe_refuses_a_hello_retry_request() {
    // The server only has P-256: the default ClientHello (hybrid + X25519 shares)
    // gets a HelloRetryRequest, which costs the server no key exchange.
    let (addr, _) = rustls_server(Some(vec![provider::kx_group::SECP256R1]));
    let e = flood(&addr.to_string(), &["--count", "5"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("HelloRetryRequest"), "{e}");
    // With the group it has, the flood works.
    let r = flood(
        &addr.to_string(),
        &["--count", "5", "--group", "secp256r1", "--concurrency", "1"],
    )
    .unwrap();
    assert_eq!((r.flights, r.failures_total), (5, 0), "{:?}", r.failures);
}

fn read_record(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut hdr = [0u8; 5];
    s.read_exact(&mut hdr)?;
    let mut body = vec![0u8; usize::from(u16::from_be_bytes([hdr[3], hdr[4]]))];
    s.read_exact(&mut body)?;
    Ok(body)
}

fn record(kind: u8, len: usize) -> Vec<u8> {
    let mut r = vec![kind, 3, 3, (len >> 8) as u8, len as u8];
    r.resize(5 + len, 7);
    r
}

#[test]
fn failures_are_classified() {
    // A fake server that takes the whole ClientHello and then, connection by connection:
    // sends a three-record "flight" in small pieces, closes (FIN), resets, or sends an alert.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap().to_string();
    let rounds = 6;
    let server = std::thread::spawn(move || {
        for i in 0..4 * rounds {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            read_record(&mut s).unwrap();
            match i % 4 {
                0 => {
                    let mut flight = record(22, 90);
                    flight.extend(record(20, 1));
                    flight.extend(record(23, 300));
                    for piece in flight.chunks(100) {
                        s.write_all(piece).unwrap();
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    // Wait for the client's RST.
                    let _ = s.read(&mut [0u8; 16]);
                }
                1 => drop(s),
                2 => {
                    socket2::SockRef::from(&s)
                        .set_linger(Some(Duration::ZERO))
                        .unwrap();
                    drop(s);
                }
                _ => {
                    s.write_all(&record(21, 2)).unwrap();
                    let _ = s.read(&mut [0u8; 16]);
                }
            }
        }
    });
    let count = (4 * rounds).to_string();
    let r = flood(
        &target,
        &[
            "--concurrency",
            "1",
            "--count",
            &count,
            "--flight-records",
            "3",
        ],
    )
    .unwrap();
    server.join().unwrap();
    assert!(r.probe.is_none());
    assert_eq!(r.flights, rounds, "{:?}", r.failures);
    assert_eq!(
        r.failures.get("closed_early"),
        Some(&rounds),
        "{:?}",
        r.failures
    );
    assert_eq!(
        r.failures.get("reset_by_server"),
        Some(&rounds),
        "{:?}",
        r.failures
    );
    assert_eq!(r.failures.get("alert"), Some(&rounds), "{:?}", r.failures);
    assert_eq!(r.failures_total, 3 * rounds);

    // Accepted by the kernel, never answered.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let target = silent.local_addr().unwrap().to_string();
    let r = flood(
        &target,
        &[
            "--concurrency",
            "2",
            "--count",
            "2",
            "--timeout",
            "0.3",
            "--flight-records",
            "3",
        ],
    )
    .unwrap();
    assert_eq!(r.failures.get("timeout"), Some(&2), "{:?}", r.failures);
    assert_eq!(r.flights, 0);
    // The probe gives up within --timeout too.
    let t0 = Instant::now();
    let e = flood(&target, &["--count", "1", "--timeout", "0.3"]).unwrap_err();
    assert!(e.to_string().contains("probe"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
    drop(silent);

    // Nothing listening.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap().to_string();
    drop(closed);
    let r = flood(
        &dead,
        &[
            "--concurrency",
            "2",
            "--count",
            "6",
            "--flight-records",
            "3",
        ],
    )
    .unwrap();
    assert_eq!(
        r.failures.get("connect_refused"),
        Some(&6),
        "{:?}",
        r.failures
    );
    let e = flood(&dead, &["--count", "1"]).unwrap_err();
    assert!(format!("{e:#}").contains("probe: connecting"), "{e:#}");
}
