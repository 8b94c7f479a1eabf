//! Handshake and record errors that must end with the alert RFC 8446 asks for, not a bare
//! close (found by a TLS conformance suite): records interleaved in the handshake, a record
//! with no content type, ChangeCipherSpec floods. Scripted clients send raw records.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};

use crate::support::client::{tcp_connect, ClientOpts, Tls};
use crate::support::Server;

const UNEXPECTED_MESSAGE: u8 = 10;

fn client(v: Tls) -> rustls::ClientConnection {
    let mut opts = ClientOpts::version(v);
    opts.suites = Some(vec![match v {
        Tls::V13 => rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256,
        Tls::V12 => {
            rustls::crypto::aws_lc_rs::cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        }
    }]);
    let mut config = (*opts.config()).clone();
    config.enable_secret_extraction = true;
    rustls::ClientConnection::new(
        Arc::new(config),
        rustls_pki_types::ServerName::try_from("localhost")
            .expect("name")
            .to_owned(),
    )
    .expect("client")
}

fn flush(c: &mut rustls::ClientConnection, s: &mut std::net::TcpStream) {
    while c.wants_write() {
        c.write_tls(s).expect("write");
    }
}

/// Everything the server sends until it closes (or `limit` passes).
fn rest(s: &mut std::net::TcpStream, limit: Duration) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let (mut out, end) = (Vec::new(), Instant::now() + limit);
    let mut buf = [0u8; 16384];
    while Instant::now() < end {
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return out,
        }
    }
    panic!("the server did not close within {limit:?}; sent {out:?}");
}

fn records(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 5 {
        let len = u16::from_be_bytes([b[3], b[4]]) as usize;
        let end = (5 + len).min(b.len());
        out.push((b[0], b[5..end].to_vec()));
        b = &b[end..];
    }
    out
}

/// The server's first flight, read until it is complete enough for the client to answer.
fn after_client_hello(v: Tls, port: u16) -> (rustls::ClientConnection, std::net::TcpStream) {
    let mut c = client(v);
    let mut s = tcp_connect(port);
    flush(&mut c, &mut s);
    // Let rustls read the flight, but keep its reply (our Finished) to ourselves.
    while c.is_handshaking() && !c.wants_write() {
        c.read_tls(&mut s).expect("flight");
        c.process_new_packets().expect("flight ok");
    }
    (c, s)
}

#[test]
fn application_data_interleaved_in_the_handshake_gets_unexpected_message() {
    let server = Server::start();
    for (v, record) in [
        (Tls::V12, &b"\x17\x03\x03\x00\x00"[..]),
        (Tls::V12, b"\x17\x03\x03\x00\x03\x00\x00\x00"),
        (Tls::V13, b"\x17\x03\x03\x00\x00"),
        (Tls::V13, b"\x17\x03\x03\x00\x13\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"),
    ] {
        let (_c, mut s) = after_client_hello(v, server.port());
        s.write_all(record).expect("interleaved record");
        let reply = records(&rest(&mut s, Duration::from_secs(5)));
        match v {
            // Before ChangeCipherSpec everything is plaintext: the alert can be read.
            Tls::V12 => assert_eq!(
                reply,
                [(21, vec![2, UNEXPECTED_MESSAGE])],
                "{v:?} {record:?}"
            ),
            // TLS 1.3 encrypts it under the handshake key: one record of a 2-byte alert,
            // its content type and a 16-byte tag.
            Tls::V13 => assert!(
                reply.len() == 1 && reply[0].0 == 23 && reply[0].1.len() == 2 + 1 + 16,
                "{v:?} {record:?}: expected one encrypted alert, got {reply:?}"
            ),
        }
    }
    server.stop();
}

/// The same, inside the ClientHello: its handshake message split over two records with an
/// application data record between them (RFC 8446 §5.1 forbids the interleaving).
#[test]
fn application_data_inside_a_fragmented_client_hello_gets_unexpected_message() {
    let server = Server::start();
    for (v, record) in [
        (Tls::V13, &b"\x17\x03\x03\x00\x00"[..]),
        (Tls::V12, b"\x17\x03\x03\x00\x03\x00\x00\x00"),
    ] {
        let mut c = client(v);
        let mut hello = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut hello).expect("hello");
        }
        // One handshake record -> two, the application data record between them.
        let body = &hello[5..];
        let cut = body.len() / 2;
        let frag = |part: &[u8]| {
            let mut r = vec![22, 3, 1, (part.len() >> 8) as u8, part.len() as u8];
            r.extend_from_slice(part);
            r
        };
        let bytes = [frag(&body[..cut]), record.to_vec(), frag(&body[cut..])].concat();
        let mut s = tcp_connect(server.port());
        s.write_all(&bytes).expect("send");
        assert_eq!(
            records(&rest(&mut s, Duration::from_secs(5))),
            [(21, vec![2, UNEXPECTED_MESSAGE])],
            "{v:?}"
        );
    }
    server.stop();
}

#[test]
fn change_cipher_spec_flood_with_the_client_hello_gets_an_alert_at_once() {
    let server = Server::start();
    for v in [Tls::V13, Tls::V12] {
        let mut c = client(v);
        let mut hello = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut hello).expect("hello");
        }
        hello.extend(b"\x14\x03\x03\x00\x01\x01".repeat(3));
        let mut s = tcp_connect(server.port());
        s.write_all(&hello).expect("send");
        let started = Instant::now();
        let reply = rest(&mut s, Duration::from_secs(5));
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{v:?}: sat on a buffered record"
        );
        // Nothing from the server reached the client before the failure, so the alert it
        // gets is one it can read.
        assert_eq!(
            records(&reply),
            [(21, vec![2, UNEXPECTED_MESSAGE])],
            "{v:?}"
        );
    }
    server.stop();
}

/// TLS 1.3 record protection (RFC 8446 §5.2-5.3) with AES-128-GCM, for records rustls would
/// refuse to build.
struct Protector {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Protector {
    fn new(secrets: (u64, rustls::ConnectionTrafficSecrets)) -> Self {
        let (seq, rustls::ConnectionTrafficSecrets::Aes128Gcm { key, iv }) = secrets else {
            panic!("AES-128-GCM was the only suite offered")
        };
        Protector {
            key: LessSafeKey::new(UnboundKey::new(&AES_128_GCM, key.as_ref()).expect("key")),
            iv: iv.as_ref().try_into().expect("12-byte iv"),
            seq,
        }
    }

    fn nonce(&mut self) -> Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq += 1;
        Nonce::assume_unique_for_key(n)
    }

    fn seal(&mut self, inner: &[u8]) -> Vec<u8> {
        let len = (inner.len() + 16) as u16;
        let header = [23, 3, 3, (len >> 8) as u8, len as u8];
        let mut body = inner.to_vec();
        let nonce = self.nonce();
        self.key
            .seal_in_place_append_tag(nonce, Aad::from(header), &mut body)
            .expect("seal");
        [header.to_vec(), body].concat()
    }

    /// Decrypts one record; returns (content type, content).
    fn open(&mut self, payload: &[u8]) -> (u8, Vec<u8>) {
        let len = payload.len() as u16;
        let header = [23, 3, 3, (len >> 8) as u8, len as u8];
        let mut body = payload.to_vec();
        let nonce = self.nonce();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(header), &mut body)
            .expect("open");
        let end = plain.iter().rposition(|&b| b != 0).expect("content type");
        (plain[end], plain[..end].to_vec())
    }
}

/// Not met yet: rustls 0.23.46 reports an inner plaintext without a content type
/// (IllegalTlsInnerPlaintext) without queueing the alert, and its unbuffered API offers no way
/// to send a fatal alert under the traffic key. Before the fix in flush_alert this test showed
/// a misleading bad_record_mac; now the connection closes without an alert.
#[test]
#[ignore = "needs rustls to queue unexpected_message for IllegalTlsInnerPlaintext"]
fn tls13_record_without_a_content_type_gets_unexpected_message() {
    let server = Server::start();
    let (mut c, mut s) = after_client_hello(Tls::V13, server.port());
    flush(&mut c, &mut s); // our Finished
    let secrets = c.dangerous_extract_secrets().expect("secrets");
    let (mut tx, mut rx) = (Protector::new(secrets.tx), Protector::new(secrets.rx));
    // All-zero inner plaintext: no non-zero octet, so no content type (RFC 8446 §5.4).
    s.write_all(&tx.seal(&[0, 0, 0, 0])).expect("record");
    let reply = records(&rest(&mut s, Duration::from_secs(5)));
    let opened: Vec<(u8, Vec<u8>)> = reply.iter().map(|(_, p)| rx.open(p)).collect();
    assert!(
        opened.contains(&(21, vec![2, UNEXPECTED_MESSAGE])),
        "expected a fatal unexpected_message alert, got {opened:?}"
    );
    server.stop();
}
