//! A `TlsStream::read` dropped while its reply is half written (the TCP relay drops its read
//! whenever the backend has data) must finish that reply later, never send it again.
//!
//! The reply here is the user plane's answer to a TLS 1.2 renegotiation request: rustls' 31-byte
//! no_renegotiation warning alert, the one record a read writes there (a KeyUpdate answer waits
//! for the next write). For its send to be partial the server's socket must be out of send
//! memory with room for a few bytes left in its last queued segment (Linux appends to that
//! segment without a memory check, and refuses a new one). The test builds that state on the
//! server's socket with raw filler bytes while the client does not read, and the client, which
//! knows the filler's length, skips them. The client's record layer is its own (rustls' keys,
//! extracted after the handshake): rustls' client cannot send a renegotiation request.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::crypto::cipher::{InboundOpaqueMessage, OutboundChunks, OutboundPlainMessage};
use rustls::{ConnectionTrafficSecrets, ContentType, ProtocolVersion, SupportedCipherSuite};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tlsplane::{Acceptor, DataPlanePolicy, PlaneKind, ServerOptions};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const FILL: u8 = b'~';
/// Bytes of room left in the last queued segment: the alert's send stops after about these.
const ROOM: usize = 10;
/// A TLS 1.2 AES-GCM alert record: header, explicit nonce, two bytes, tag.
const ALERT_RECORD: usize = 5 + 8 + 2 + 16;
const CLIENT_RCVBUF: usize = 8192;
const STEP: Duration = Duration::from_secs(5);

const SUITE: SupportedCipherSuite =
    rustls::crypto::aws_lc_rs::cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256;

#[derive(Debug, PartialEq)]
enum FromClient {
    /// Handshake done, renegotiation request sent.
    Ready,
    /// Bytes past the filler that reached the client while the server's read was cancelled.
    AlertBytesSeen(usize),
}

/// Connections tried: the socket state this needs depends on the kernel's timers (a delayed
/// ACK may reopen the window meanwhile), so an attempt may miss it; every attempt still checks
/// the record stream.
const ATTEMPTS: usize = 5;

#[tokio::test]
async fn a_cancelled_read_finishes_its_half_sent_reply_and_never_resends_it() {
    let generated = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let cert_der = generated.cert.der().clone();
    let key = PrivateKeyDer::try_from(generated.key_pair.serialize_der()).unwrap();
    let cert = tlsplane::cert::certified_key(vec![cert_der.clone()], key).unwrap();
    let mut opts = ServerOptions::new(cert);
    opts.policy = DataPlanePolicy::User;
    let acceptor = Acceptor::new(opts).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();

    let mut sent = Vec::new();
    for _ in 0..ATTEMPTS {
        let n = attempt(&acceptor, &listener, cert_der.clone()).await;
        sent.push(n);
        if n > 0 && n < ALERT_RECORD {
            return;
        }
    }
    panic!("no cancelled read sent part of its alert (bytes sent per attempt: {sent:?})");
}

/// One connection: the server's read is cancelled while it sends its alert, the next read
/// finishes it, then data goes both ways. Returns the alert bytes sent before the cancel.
async fn attempt(
    acceptor: &Acceptor,
    listener: &TcpListener,
    cert: CertificateDer<'static>,
) -> usize {
    let addr = listener.local_addr().unwrap();
    let (to_server, mut from_client) = tokio::sync::mpsc::unbounded_channel();
    let (to_client, from_server) = std::sync::mpsc::channel();
    let client = std::thread::spawn(move || client(addr, cert, to_server, from_server));

    let (tcp, _) = timeout(STEP, listener.accept()).await.unwrap().unwrap();
    let mut tls = timeout(STEP, acceptor.accept(tcp)).await.unwrap().unwrap();
    assert_eq!(tls.plane(), PlaneKind::User);
    match timeout(STEP, from_client.recv()).await {
        Ok(Some(FromClient::Ready)) => {}
        other => client_failed(client, format!("client not ready: {other:?}")),
    }

    let filler = leave_room_in_full_socket(tls.tcp(), ROOM);

    let mut buf = vec![0u8; 16384];
    let cancelled = timeout(Duration::from_millis(30), tls.read(&mut buf)).await;
    assert!(
        cancelled.is_err(),
        "the read should have blocked: {cancelled:?}"
    );
    to_client.send(filler).unwrap();
    let sent = match timeout(STEP, from_client.recv()).await {
        Ok(Some(FromClient::AlertBytesSeen(n))) => n,
        other => client_failed(client, format!("client did not drain: {other:?}")),
    };

    // The next read finishes the alert, then gets the client's data.
    let n = match timeout(STEP, tls.read(&mut buf)).await {
        Ok(Ok(n)) => n,
        other => client_failed(client, format!("read after the cancelled one: {other:?}")),
    };
    if &buf[..n] != b"ping" {
        client_failed(
            client,
            format!("read {:?}", String::from_utf8_lossy(&buf[..n])),
        );
    }
    timeout(STEP, tls.write_all(b"pong"))
        .await
        .unwrap()
        .unwrap();
    client.join().unwrap();
    sent
}

/// A failure on the client side (a record that does not decrypt) is the one to report.
fn client_failed(client: std::thread::JoinHandle<()>, what: String) -> ! {
    if let Err(panic) = client.join() {
        std::panic::resume_unwind(panic);
    }
    panic!("{what}");
}

/// Leaves `sock` out of send memory (the client does not read) with about `room` bytes of
/// space in its last queued segment (8 of 10 measured on Linux 6.18), so that a longer send
/// sends only those. Returns the filler bytes written.
fn leave_room_in_full_socket(sock: &TcpStream, room: usize) -> usize {
    let raw = socket2::SockRef::from(sock);
    let send = |data: &[u8]| match raw.send(data) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => panic!("send: {e}"),
    };
    // The kernel's minimum (4608 bytes) when small, its maximum (wmem_max) when large.
    let small = || raw.set_send_buffer_size(0).unwrap();
    let large = || raw.set_send_buffer_size(1 << 24).unwrap();
    let mut filler = 0;

    // Fill until a send takes nothing: the last segment is full and no new one may be queued.
    // ACKs still on their way could free memory after that: fill again until it stays full.
    small();
    let deadline = Instant::now() + STEP;
    loop {
        let before = filler;
        loop {
            let n = send(&[FILL; 4096]);
            if n == 0 {
                break;
            }
            filler += n;
        }
        if filler == before {
            break;
        }
        assert!(Instant::now() < deadline, "the socket never stayed full");
        std::thread::sleep(Duration::from_millis(20));
    }

    // How large the kernel makes a segment here (its size goal: a multiple of the MSS, at most
    // half the client's window): open a new one with one byte, then count what it still takes.
    large();
    filler += send(&[FILL]);
    small();
    let mut goal = 1;
    while send(&[FILL]) == 1 {
        goal += 1;
    }
    filler += goal - 1;

    // A new segment with `room` bytes left in it, and no memory for another.
    if goal > room {
        large();
        filler += send(&vec![FILL; goal - room]);
        small();
    }
    filler
}

fn client(
    addr: SocketAddr,
    cert: CertificateDer<'static>,
    to_server: tokio::sync::mpsc::UnboundedSender<FromClient>,
    from_server: std::sync::mpsc::Receiver<usize>,
) {
    // A small window, so that the server's socket fills fast.
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(CLIENT_RCVBUF).unwrap();
    sock.connect(&addr.into()).unwrap();
    let mut tcp: std::net::TcpStream = sock.into();
    tcp.set_nodelay(true).unwrap();
    tcp.set_read_timeout(Some(STEP)).unwrap();

    let config = client_config(cert);
    let mut conn =
        rustls::ClientConnection::new(config.clone(), "localhost".try_into().unwrap()).unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp).unwrap();
    }
    let secrets = conn.dangerous_extract_secrets().unwrap();
    let SupportedCipherSuite::Tls12(suite) = SUITE else {
        unreachable!()
    };
    let (mut tx_seq, ConnectionTrafficSecrets::Aes128Gcm { key, iv }) = secrets.tx else {
        panic!("not the suite asked for")
    };
    let mut encrypter = suite
        .aead_alg
        .encrypter(key, &iv.as_ref()[..4], &iv.as_ref()[4..]);
    let (mut rx_seq, ConnectionTrafficSecrets::Aes128Gcm { key, iv }) = secrets.rx else {
        panic!("not the suite asked for")
    };
    let mut decrypter = suite.aead_alg.decrypter(key, &iv.as_ref()[..4]);
    let mut writer = tcp.try_clone().unwrap();
    let mut send_record = |typ: ContentType, payload: &[u8]| {
        let record = encrypter
            .encrypt(
                OutboundPlainMessage {
                    typ,
                    version: ProtocolVersion::TLSv1_2,
                    payload: OutboundChunks::Single(payload),
                },
                tx_seq,
            )
            .unwrap()
            .encode();
        tx_seq += 1;
        writer.write_all(&record).unwrap();
    };

    // A renegotiation request: a ClientHello (from a new rustls client) under the session's key.
    let mut hello = Vec::new();
    rustls::ClientConnection::new(config, "localhost".try_into().unwrap())
        .unwrap()
        .write_tls(&mut hello)
        .unwrap();
    assert_eq!(hello[0], 22, "a handshake record");
    send_record(ContentType::Handshake, &hello[5..]);
    to_server.send(FromClient::Ready).unwrap();

    // Only now read: the filler first, then what the cancelled read managed to send.
    let filler = from_server.recv().unwrap();
    let mut skipped = vec![0u8; filler];
    tcp.read_exact(&mut skipped).unwrap();
    assert!(skipped.iter().all(|&b| b == FILL), "filler bytes");
    let mut input = Vec::new();
    tcp.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut chunk = [0u8; 4096];
    loop {
        match tcp.read(&mut chunk) {
            Ok(0) => panic!("EOF from the server"),
            Ok(n) => input.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    tcp.set_read_timeout(Some(STEP)).unwrap();
    to_server
        .send(FromClient::AlertBytesSeen(input.len()))
        .unwrap();

    let mut next_record = |input: &mut Vec<u8>| -> (ContentType, Vec<u8>) {
        while input.len() < 5 || input.len() < 5 + u16::from_be_bytes([input[3], input[4]]) as usize
        {
            let n = tcp.read(&mut chunk).unwrap();
            assert!(n > 0, "EOF from the server");
            input.extend_from_slice(&chunk[..n]);
        }
        let len = 5 + u16::from_be_bytes([input[3], input[4]]) as usize;
        let mut record: Vec<u8> = input.drain(..len).collect();
        let typ = ContentType::from(record[0]);
        let version = ProtocolVersion::from(u16::from_be_bytes([record[1], record[2]]));
        let plain = decrypter
            .decrypt(
                InboundOpaqueMessage::new(typ, version, &mut record[5..]),
                rx_seq,
            )
            .unwrap_or_else(|e| {
                panic!("server record {rx_seq} ({typ:?}, {len} bytes) does not decrypt: {e}")
            });
        rx_seq += 1;
        (plain.typ, plain.payload.to_vec())
    };
    // The whole alert, once: warning (1), no_renegotiation (100).
    assert_eq!(next_record(&mut input), (ContentType::Alert, vec![1, 100]));
    send_record(ContentType::ApplicationData, b"ping");
    assert_eq!(
        next_record(&mut input),
        (ContentType::ApplicationData, b"pong".to_vec())
    );
    assert!(input.is_empty(), "{} stray bytes", input.len());
}

fn client_config(cert: CertificateDer<'static>) -> Arc<rustls::ClientConfig> {
    let provider = rustls::crypto::CryptoProvider {
        cipher_suites: vec![SUITE],
        ..rustls::crypto::aws_lc_rs::default_provider()
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS12])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    // Its own record layer takes over after the handshake (see the module comment).
    config.enable_secret_extraction = true;
    Arc::new(config)
}
