//! Admission limits: each fires, is counted, refuses before any TLS work (the refused client
//! sees its connection reset without a ServerHello), spares other client addresses, and never
//! closes a connection it already admitted.

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::time::Duration;

use crate::support::client::{tcp_connect, tcp_connect_from, ClientOpts, Tls, TlsClient};
use crate::support::{fixtures, Server};

const FIRST: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const SECOND: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// A full TLS 1.3 handshake that stalls after the server's flight (it never sends its
/// Finished): it holds a place among the server's full handshakes in progress.
fn stalled_full_handshake(port: u16) -> TlsClient {
    let mut c = TlsClient::new(port, ClientOpts::version(Tls::V13).config());
    c.flush_tls().expect("ClientHello");
    c.read_tls_once().expect("the server's flight");
    c
}

/// A full handshake + GET from `source`; false if the server refused the connection.
pub(crate) fn served_from(source: Ipv4Addr, port: u16) -> bool {
    let Ok(sock) = tcp_connect_from(source, port) else {
        return false;
    };
    let mut c = TlsClient::over(sock, ClientOpts::version(Tls::V13).config());
    if c.handshake().is_err() {
        return false;
    }
    let ok = c.get(&fixtures::get().hello.url).status == 200;
    c.close();
    ok
}

#[test]
fn client_handshake_rate_refuses_a_burst_and_spares_other_clients() {
    let server = Server::builder()
        .arg("--client-handshake-rate")
        .arg("2")
        .arg("--client-handshake-burst")
        .arg("10")
        .start();
    let port = server.port();
    let started = std::time::Instant::now();
    let served = (0..50).filter(|_| served_from(FIRST, port)).count();
    // 10 from the burst, plus what 2/s refilled while the 50 attempts ran.
    let refill = (2.0 * started.elapsed().as_secs_f64()).ceil() as usize;
    assert!(
        (10..=10 + refill).contains(&served),
        "{served} of a burst of 50 handshakes from one address were served (burst 10, 2/s, \
         {:?})",
        started.elapsed()
    );
    assert!(served_from(SECOND, port), "another address was refused too");
    let stats = server.stop();
    assert_eq!(
        stats["limit_client_handshake_rate"],
        50 - served as u64,
        "every refusal counted: {stats:?}"
    );
    assert_eq!(
        stats["handshakes"],
        served as u64 + 1,
        "refused connections must cost no handshake: {stats:?}"
    );
}

#[test]
fn client_connection_limit_keeps_admitted_connections() {
    let server = Server::builder()
        .arg("--client-max-connections")
        .arg("3")
        .start();
    let port = server.port();
    let hello = &fixtures::get().hello;
    let mut held: Vec<TlsClient> = (0..3)
        .map(|_| TlsClient::connect_version(port, Tls::V13))
        .collect();
    for c in &mut held {
        assert_eq!(c.get(&hello.url).status, 200);
    }
    assert!(!served_from(FIRST, port), "a 4th connection was admitted");
    assert!(served_from(SECOND, port), "another address was refused");
    // The admitted ones are untouched by the refusal, and a place frees when one closes.
    for c in &mut held {
        assert_eq!(c.get(&hello.url).status, 200);
    }
    held.pop().expect("one").close();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        served_from(FIRST, port),
        "a freed place was not given again"
    );
    for c in held {
        c.close();
    }
    let stats = server.stop();
    assert_eq!(stats["limit_client_max_connections"], 1, "{stats:?}");
}

#[test]
fn incomplete_handshakes_close_the_door_for_that_client() {
    let server = Server::builder()
        .arg("--client-incomplete-rate")
        .arg("2")
        .start();
    let port = server.port();
    // Four connections (the burst: 2 × rate) that never finish a handshake.
    for _ in 0..4 {
        let mut s = tcp_connect(port);
        // A record cut short, then EOF: the handshake fails without a ClientHello.
        s.write_all(b"\x16\x03\x01\x00\x05").expect("send");
        s.shutdown(std::net::Shutdown::Write).expect("FIN");
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !served_from(FIRST, port),
        "served after 4 incomplete handshakes"
    );
    assert!(served_from(SECOND, port), "another address was refused");
    std::thread::sleep(Duration::from_millis(700));
    assert!(served_from(FIRST, port), "the budget did not refill (2/s)");
    let stats = server.stop();
    assert_eq!(stats["limit_client_incomplete_rate"], 1, "{stats:?}");
}

#[test]
fn handshakes_in_progress_are_capped_per_worker() {
    let server = Server::builder()
        .arg("--max-handshakes-per-worker")
        .arg("2")
        .arg("--max-full-handshakes-per-worker")
        .arg("2")
        .arg("--handshake-evict-after")
        .arg("0")
        .start();
    let port = server.port();
    // Two connections that stay in their handshake past the ClientHello (they never send
    // their Finished): they do not give way (see slow_handshakes_give_way_...).
    let idle: Vec<TlsClient> = (0..2).map(|_| stalled_full_handshake(port)).collect();
    std::thread::sleep(Duration::from_millis(200));
    assert!(!served_from(SECOND, port), "a 3rd handshake was admitted");
    drop(idle);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        served_from(SECOND, port),
        "not admitted once the others ended"
    );
    let stats = server.stop();
    assert_eq!(stats["limit_max_handshakes_per_worker"], 1, "{stats:?}");
}

/// Established connections that trickle their first request head leave the handshake loop
/// (with the bytes they sent and their header deadline): they hold no place among its
/// handshakes, so they do not make it refuse new connections, and their requests are served.
#[test]
fn trickled_request_heads_hold_no_handshake_places() {
    let server = Server::builder()
        .workers(1)
        .arg("--max-handshakes-per-worker")
        .arg("2")
        .start();
    let port = server.port();
    let hello = &fixtures::get().hello;
    let head = format!("GET {} HTTP/1.1\r\nHost: localhost\r\n\r\n", hello.url);
    let (start, rest) = head.split_at(10);
    let mut trickling: Vec<TlsClient> = (0..3)
        .map(|_| {
            let mut c = TlsClient::connect_version(port, Tls::V13);
            c.write_all(start.as_bytes()).expect("the head's start");
            std::thread::sleep(Duration::from_millis(50));
            c
        })
        .collect();
    // A fourth client, from another address: admitted and served.
    assert!(served_from(SECOND, port), "refused behind trickled heads");
    for c in &mut trickling {
        c.write_all(rest.as_bytes()).expect("the head's rest");
        let r = c.read_response(false).expect("a response");
        assert_eq!(r.status, 200);
        assert_eq!(fixtures::sha256(&r.body), hello.sha256, "the whole file");
    }
    let stats = server.stop();
    assert_eq!(stats["limit_max_handshakes_per_worker"], 0, "{stats:?}");
    assert_eq!(stats["http_responses_2xx"], 4, "{stats:?}");
}

#[test]
fn total_connection_limit_evicts_the_oldest_idle_connection_then_refuses() {
    let server = Server::builder().arg("--max-connections").arg("2").start();
    let port = server.port();
    let hello = &fixtures::get().hello;
    // Two keep-alive connections, idle after a request each; the first is the older.
    let mut oldest = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(oldest.get(&hello.url).status, 200);
    std::thread::sleep(Duration::from_millis(50));
    let mut newer = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(newer.get(&hello.url).status, 200);
    std::thread::sleep(Duration::from_millis(50));
    // A third client is served: the oldest idle connection makes room.
    assert!(
        served_from(SECOND, port),
        "refused although a connection was idle"
    );
    let (_, end) = oldest.read_to_end();
    assert!(
        matches!(end, crate::support::client::End::CloseNotify),
        "the evicted connection should end with close_notify: {end:?}"
    );
    assert_eq!(
        newer.get(&hello.url).status,
        200,
        "the newer idle one was closed"
    );

    // Connections in the middle of a request are not idle: nothing to evict, so refuse.
    newer.close();
    std::thread::sleep(Duration::from_millis(100));
    let mut busy: Vec<TlsClient> = (0..2)
        .map(|_| {
            let mut c = TlsClient::connect_version(port, Tls::V13);
            c.write_all(b"GET /hello.txt HTTP/1.1\r\nHost: x\r\n")
                .expect("part of a head");
            // Until the server has read it, this connection still looks idle.
            std::thread::sleep(Duration::from_millis(100));
            c
        })
        .collect();
    assert!(
        !served_from(SECOND, port),
        "admitted past the limit with nobody idle"
    );
    for c in &mut busy {
        c.write_all(b"\r\n").expect("end of head");
        let (status, _) = c.read_head().expect("response");
        assert_eq!(
            status, 200,
            "a connection in the middle of a request was disturbed"
        );
    }
    drop(busy);
    let stats = server.stop();
    assert_eq!(stats["idle_evicted"], 1, "{stats:?}");
    assert_eq!(stats["limit_max_connections"], 1, "{stats:?}");
}

/// A TLS 1.3 client that keeps its session tickets between connections.
fn resuming_client() -> std::sync::Arc<rustls::ClientConfig> {
    ClientOpts::version(Tls::V13).config()
}

/// A handshake + GET with `config`; `Some(resumed)` when served, `None` when refused.
fn get_with(port: u16, config: &std::sync::Arc<rustls::ClientConfig>) -> Option<bool> {
    let mut c = TlsClient::over(tcp_connect(port), config.clone());
    // Refusals are expected; say what they were, for a failure that was not one.
    c.handshake()
        .map_err(|e| eprintln!("get_with: handshake ended: {e:?}"))
        .ok()?;
    let resumed = c.conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    let ok = c.get(&fixtures::get().hello.url).status == 200;
    c.close();
    ok.then_some(resumed)
}

#[test]
fn full_and_resumed_handshakes_have_separate_client_rates() {
    // Budgets of 2 that refill one every 10 s (6/min): an emulated guest's handshakes, half
    // a second each, cannot see a refill within the test, so the outcome does not depend on
    // the machine's speed.
    let server = Server::builder()
        .arg("--client-handshake-rate")
        .arg("1/min")
        .arg("--client-handshake-burst")
        .arg("2")
        .arg("--client-resumed-rate")
        .arg("1/min")
        .start();
    let port = server.port();
    let config = resuming_client();
    // The full handshakes' budget is drained first, then the resumptions' (burst 2), which
    // the first did not touch. (That a client which resumed lately is heard out to its
    // ClientHello is for the unit tests.)
    let started = std::time::Instant::now();
    let outcomes = [
        get_with(port, &config),
        get_with(port, &resuming_client()),
        get_with(port, &resuming_client()),
        get_with(port, &config),
        get_with(port, &config),
        get_with(port, &config),
    ];
    assert_eq!(
        outcomes,
        [Some(false), Some(false), None, Some(true), Some(true), None],
        "full, full, refused full, resumed, resumed, refused resumption ({:?})",
        started.elapsed()
    );
    assert!(served_from(SECOND, port), "another address was refused");
    let stats = server.stop();
    assert_eq!(stats["limit_client_resumed_rate"], 1, "{stats:?}");
    assert_eq!(stats["limit_client_handshake_rate"], 1, "{stats:?}");
    assert_eq!(stats["handshakes_resumed"], 2, "{stats:?}");
    assert_eq!(
        stats["handshakes"], 5,
        "refusals must cost no handshake: {stats:?}"
    );
}

#[test]
fn resumptions_are_served_while_full_handshakes_fill_the_worker() {
    let server = Server::builder()
        .workers(1)
        .arg("--max-handshakes-per-worker")
        .arg("8")
        .arg("--max-full-handshakes-per-worker")
        .arg("2")
        .start();
    let port = server.port();
    let config = resuming_client();
    assert_eq!(get_with(port, &config), Some(false));
    // Two full handshakes that stall after the server's flight hold the full places.
    let stalled: Vec<TlsClient> = (0..2).map(|_| stalled_full_handshake(port)).collect();
    assert_eq!(
        get_with(port, &resuming_client()),
        None,
        "a 3rd full handshake was served"
    );
    assert_eq!(
        get_with(port, &config),
        Some(true),
        "a resumption must be served while full handshakes fill the worker"
    );
    drop(stalled);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        get_with(port, &resuming_client()),
        Some(false),
        "places not freed"
    );
    let stats = server.stop();
    assert_eq!(
        stats["limit_max_full_handshakes_per_worker"], 1,
        "{stats:?}"
    );
    assert_eq!(stats["handshakes_resumed"], 1, "{stats:?}");
}

#[test]
fn oversized_client_hello_gets_illegal_parameter_from_its_header() {
    let server = Server::builder()
        .arg("--max-client-hello")
        .arg("4096")
        .start();
    let port = server.port();
    let mut s = tcp_connect(port);
    // A handshake record whose ClientHello claims 5,000 bytes; only its start is sent.
    s.write_all(&[22, 3, 1, 0, 9, 1, 0, 0x13, 0x88, 3, 3, 0, 0, 0])
        .expect("send");
    let mut reply = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = s.read_to_end(&mut reply);
    assert_eq!(
        reply,
        [21, 3, 3, 0, 2, 2, 47],
        "expected an illegal_parameter alert at once"
    );
    // A real ClientHello (~1.5 KB with its X25519MLKEM768 key share) is served.
    assert!(served_from(FIRST, port));
    let stats = server.stop();
    assert_eq!(stats["limit_max_client_hello"], 1, "{stats:?}");
}

#[test]
fn first_byte_deadline_closes_silent_connections_only() {
    let server = Server::builder()
        .arg("--first-byte-timeout")
        .arg("0.5")
        .arg("--handshake-timeout")
        .arg("10")
        .start();
    let port = server.port();
    let started = std::time::Instant::now();
    let mut silent = tcp_connect(port);
    let mut talking = tcp_connect(port);
    // A first byte in time: from then on only the handshake deadline applies.
    talking.write_all(&[22, 3, 1]).expect("send");
    let mut buf = [0u8; 16];
    let n = silent.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "the silent connection got bytes");
    let closed_after = started.elapsed();
    assert!(
        (Duration::from_millis(400)..Duration::from_secs(3)).contains(&closed_after),
        "silent connection closed after {closed_after:?}, expected about 0.5 s"
    );
    talking
        .set_read_timeout(Some(Duration::from_millis(700)))
        .expect("timeout");
    let e = talking.read(&mut buf).expect_err("still open");
    assert!(
        matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "the connection that spoke was closed: {e}"
    );
    drop(talking);
    let stats = server.stop();
    assert_eq!(stats["first_byte_timeouts"], 1, "{stats:?}");
}

/// `--first-byte-timeout 0` leaves a silent connection to the handshake deadline (before, it
/// had none: it stayed in the lobby for ever).
#[test]
fn without_a_first_byte_deadline_the_handshake_deadline_closes_silent_connections() {
    let server = Server::builder()
        .arg("--first-byte-timeout")
        .arg("0")
        .arg("--handshake-timeout")
        .arg("1")
        .start();
    let started = std::time::Instant::now();
    let mut silent = tcp_connect(server.port());
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 16];
    let n = silent.read(&mut buf);
    let closed_after = started.elapsed();
    assert!(
        matches!(n, Ok(0)) && closed_after < Duration::from_secs(3),
        "silent connection: {n:?} after {closed_after:?}, expected closed after about 1 s"
    );
    let stats = server.stop();
    assert_eq!(stats["first_byte_timeouts"], 0, "{stats:?}");
    assert_eq!(stats["http_timeouts"], 1, "{stats:?}");
}

#[test]
fn slow_handshakes_give_way_to_new_connections_at_the_cap() {
    let server = Server::builder()
        .workers(1)
        .arg("--max-handshakes-per-worker")
        .arg("2")
        .arg("--max-full-handshakes-per-worker")
        .arg("2")
        .arg("--handshake-evict-after")
        .arg("0.5")
        .start();
    let port = server.port();
    let mut buf = [0u8; 8];
    // Before their ClientHello is whole (nothing sent; a record header), handshakes give way
    // at once, oldest first.
    let mut silent = tcp_connect(port);
    std::thread::sleep(Duration::from_millis(50));
    let mut partial = tcp_connect(port);
    partial.write_all(&[22, 3, 1]).expect("send");
    std::thread::sleep(Duration::from_millis(50));
    silent
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    partial
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    assert!(
        served_from(SECOND, port),
        "a silent connection kept a client out"
    );
    assert_eq!(
        silent.read(&mut buf).ok(),
        Some(0),
        "the oldest should be closed"
    );
    // The cap is full again with a newer silent connection: now the partial one is oldest.
    let newer = tcp_connect(port);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        served_from(SECOND, port),
        "a partial ClientHello kept a client out"
    );
    assert_eq!(
        partial.read(&mut buf).ok(),
        Some(0),
        "the partial one should be closed"
    );
    drop(newer);
    std::thread::sleep(Duration::from_millis(100));

    // Past their ClientHello (the server spent its crypto), they give way only once older
    // than --handshake-evict-after.
    let stalled: Vec<TlsClient> = (0..2).map(|_| stalled_full_handshake(port)).collect();
    assert!(!served_from(SECOND, port), "a young handshake was evicted");
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        served_from(SECOND, port),
        "an old stalled handshake kept a client out"
    );
    drop(stalled);
    let stats = server.stop();
    assert_eq!(stats["handshakes_evicted"], 3, "{stats:?}");
    assert_eq!(stats["limit_max_handshakes_per_worker"], 1, "{stats:?}");
}

/// Whether a TCP connection from `source` is made within `wait` (a dropped SYN is not
/// retransmitted before a second). One that is made is read until the server ends it (the
/// reset of a refusal), so that the next attempt comes after the server's decision.
fn syn_answered(source: Ipv4Addr, port: u16, wait: Duration) -> bool {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&std::net::SocketAddr::from((source, 0)).into())
        .unwrap();
    let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    match s.connect_timeout(&to.into(), wait) {
        Ok(()) => {}
        // The handshake completed and the server's refusal at accept (a reset) arrived before
        // the connect was reported: the SYN was answered.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
        Err(_) => return false,
    }
    let mut tcp: std::net::TcpStream = s.into();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = tcp.read(&mut [0u8; 1]);
    true
}

#[test]
fn client_block_drops_a_refused_address_until_its_next_token() {
    let server = Server::builder()
        .arg("--client-incomplete-rate")
        .arg("30/min")
        .arg("--client-block")
        .start();
    let port = server.port();
    let hello = &fixtures::get().hello.url;
    let sock = tcp_connect_from(SECOND, port).expect("connect");
    let mut kept = TlsClient::over(sock, ClientOpts::version(Tls::V13).config());
    assert_eq!(kept.get(hello).status, 200);
    // Two handshakes left unfinished spend the address's incomplete budget (burst 2) ...
    for _ in 0..2 {
        let sock = tcp_connect_from(SECOND, port).expect("connect");
        let mut c = TlsClient::over(sock, ClientOpts::version(Tls::V13).config());
        c.flush_tls().expect("ClientHello");
        c.read_tls_once().expect("the server's flight");
    }
    // ... so it is refused at accept (reset), and then its SYNs are dropped: a connection
    // attempt is not even answered. (Refusals come first while the server notices the two
    // closes and attaches the listener's filter.)
    let blocked = (0..20).any(|_| !syn_answered(SECOND, port, Duration::from_millis(700)));
    assert!(
        blocked,
        "the refused address's connections were still answered"
    );
    // Other addresses are served, and so is the blocked address's established connection.
    assert!(served_from(FIRST, port), "another address was blocked too");
    assert_eq!(
        kept.get(hello).status,
        200,
        "an established connection was hit"
    );
    kept.close();
    // A token comes back within 2 s, and with it the address.
    let until = std::time::Instant::now() + Duration::from_secs(15);
    while !served_from(SECOND, port) {
        assert!(
            std::time::Instant::now() < until,
            "the address stayed blocked past its next token"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let stats = server.stop();
    assert!(stats["client_blocks"] >= 1, "{stats:?}");
    assert!(stats["limit_client_incomplete_rate"] >= 1, "{stats:?}");
}

/// A handshake + GET from `source` on a connection kept open (keep-alive).
fn kept_open_from(source: Ipv4Addr, port: u16) -> TlsClient {
    let sock = tcp_connect_from(source, port).expect("connect");
    let mut c = TlsClient::over(sock, ClientOpts::version(Tls::V13).config());
    c.handshake().expect("handshake");
    assert_eq!(c.get(&fixtures::get().hello.url).status, 200);
    c
}

#[test]
fn a_client_refused_by_its_own_rate_evicts_nobody() {
    if crate::support::mode() == crate::support::Mode::Kernel {
        // Admission happens before any plane exists; under the guests' emulation this test
        // outlasts the flooder's 10 s refill, which it counts on.
        eprintln!("SKIPPED: admission order, run natively (user plane)");
        return;
    }
    // The server is full: at --max-connections with a good client's idle keep-alive
    // connections, and at its handshake cap with that client's connection that has not
    // spoken yet. Both would make room for a connection that the limits admit.
    let server = Server::builder()
        .workers(1)
        .arg("--max-connections")
        .arg("3")
        .arg("--max-handshakes-per-worker")
        .arg("1")
        .arg("--first-byte-timeout")
        .arg("30")
        .arg("--client-handshake-rate")
        .arg("6/min")
        .arg("--client-handshake-burst")
        .arg("3")
        .start();
    let port = server.port();
    // The flooder spends its budget first (3, then one back every 10 s) on handshakes it
    // never finishes (one that finished lately would be heard out: it may resume).
    for _ in 0..3 {
        let sock = tcp_connect_from(SECOND, port).expect("connect");
        let mut c = TlsClient::over(sock, ClientOpts::version(Tls::V13).config());
        c.flush_tls().expect("ClientHello");
        c.read_tls_once().expect("the server's flight");
    }
    let mut idle: Vec<TlsClient> = (0..2).map(|_| kept_open_from(FIRST, port)).collect();
    let mut silent = tcp_connect_from(FIRST, port).expect("connect");
    std::thread::sleep(Duration::from_millis(100));
    // Each of its connections is refused by its rate: none may cost the good client one.
    let answered = (0..20)
        .filter(|_| syn_answered(SECOND, port, Duration::from_secs(2)))
        .count();
    for c in &mut idle {
        assert_eq!(
            c.get(&fixtures::get().hello.url).status,
            200,
            "an idle connection was evicted for a refused one"
        );
    }
    silent
        .set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let e = silent
        .read(&mut [0u8; 8])
        .map(|n| format!("read {n}"))
        .expect_err("the silent connection was evicted for a refused one");
    assert!(
        matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "the silent connection was evicted for a refused one: {e}"
    );
    drop(silent);
    for c in idle {
        c.close();
    }
    let stats = server.stop();
    assert_eq!(stats["idle_evicted"], 0, "{stats:?}");
    assert_eq!(stats["handshakes_evicted"], 0, "{stats:?}");
    assert_eq!(answered, 20);
    assert_eq!(stats["limit_client_handshake_rate"], 20, "{stats:?}");
}

#[test]
fn many_sources_fill_the_client_table_to_its_size_and_new_clients_are_still_served() {
    const SIZE: u64 = 64;
    const SOURCES: u32 = 400;
    let server = Server::builder()
        .arg("--client-table-size")
        .arg(SIZE.to_string())
        .arg("--client-handshake-rate")
        .arg("1/min")
        .arg("--client-handshake-burst")
        .arg("1")
        .arg("--admin")
        .arg("127.0.0.1:0")
        .start();
    let port = server.port();
    let admin_port = crate::metrics::admin_port(&server);
    // Linux routes all of 127/8 to lo: each source is a client of its own. Each connects,
    // says nothing and closes; waiting for the server's close makes sure it was admitted.
    for i in 0..SOURCES {
        let source = Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 0, 1, 0)) + i);
        let mut s = tcp_connect_from(source, port).expect("connect");
        s.shutdown(std::net::Shutdown::Write).expect("FIN");
        let _ = s.read_to_end(&mut Vec::new());
    }
    // A client the table has never seen is served, and so is one it forgot.
    assert!(served_from(FIRST, port), "a new client was refused");
    assert!(
        served_from(Ipv4Addr::new(127, 0, 1, 0), port),
        "a forgotten client was refused"
    );
    let metrics = crate::metrics::http_get(admin_port, "/metrics");
    assert!(
        metrics.contains("# TYPE tlsplane_client_table_size gauge")
            && metrics.contains(&format!("\ntlsplane_client_table_size {SIZE}\n")),
        "{metrics}"
    );
    let stats = server.stop();
    assert_eq!(stats["client_table_size"], SIZE, "{stats:?}");
    // 401 addresses through a table of 64, the first one twice.
    assert_eq!(
        stats["client_table_evictions"],
        u64::from(SOURCES) + 2 - SIZE,
        "{stats:?}"
    );
    assert_eq!(
        stats["client_table_hot_evictions"], 0,
        "none had spent a token: {stats:?}"
    );
    assert_eq!(stats["client_table_untracked"], 0, "{stats:?}");
    assert_eq!(stats["limit_client_handshake_rate"], 0, "{stats:?}");
}
