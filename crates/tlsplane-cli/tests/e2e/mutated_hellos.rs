//! A few hundred mutated ClientHellos against the real server: random bytes inside the
//! handshake record, corrupted length fields, truncations, splits into several writes. The
//! process must stay up and serve a normal request afterwards, no connection task may panic
//! (`Server::stop` checks `task_panics` and the server's stderr), and every connection must end
//! promptly (an alert, a ServerHello the client then abandons, or a close), never hang.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use crate::support::client::{fetch, tcp_connect, ClientOpts, Tls};
use crate::support::{fixtures, Server};

/// xorshift64*: deterministic, so a failure names a reproducible case number.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The first flight of a real rustls client (one ClientHello record).
pub fn client_hello(v: Tls) -> Vec<u8> {
    let config: Arc<rustls::ClientConfig> = ClientOpts::version(v).config();
    let mut conn = rustls::ClientConnection::new(
        config,
        rustls_pki_types::ServerName::try_from("localhost")
            .expect("name")
            .to_owned(),
    )
    .expect("client");
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).expect("write_tls");
    }
    out
}

/// One mutation of `hello`, and where to split it into writes.
fn mutate(hello: &[u8], rng: &mut Rng) -> (Vec<u8>, Vec<usize>) {
    let mut m = hello.to_vec();
    match rng.below(6) {
        // A few random bytes anywhere inside the handshake record.
        0 => {
            for _ in 0..1 + rng.below(4) {
                let i = 5 + rng.below(m.len() - 5);
                m[i] = rng.next() as u8;
            }
        }
        // The record length.
        1 => {
            let len = rng.next() as u16;
            m[3..5].copy_from_slice(&len.to_be_bytes());
        }
        // The handshake message length (24 bits).
        2 => {
            let len = rng.next().to_be_bytes();
            m[6..9].copy_from_slice(&len[..3]);
        }
        // Some two-byte field past the fixed part (extension and list lengths live there).
        3 => {
            let i = 43 + rng.below(m.len() - 45);
            let v = match rng.below(3) {
                0 => 0u16,
                1 => 0xffff,
                _ => rng.next() as u16,
            };
            m[i..i + 2].copy_from_slice(&v.to_be_bytes());
        }
        // Truncated.
        4 => m.truncate(1 + rng.below(m.len() - 1)),
        // Random bytes inserted.
        _ => {
            let at = rng.below(m.len());
            let junk: Vec<u8> = (0..1 + rng.below(64)).map(|_| rng.next() as u8).collect();
            m.splice(at..at, junk);
        }
    }
    let mut splits: Vec<usize> = (0..rng.below(4)).map(|_| rng.below(m.len())).collect();
    splits.sort_unstable();
    splits.dedup();
    (m, splits)
}

#[test]
fn mutated_client_hellos_never_panic_or_hang_the_server() {
    let mut server = Server::start();
    let port = server.port();
    let mut rng = Rng(0x7e57_c0de_1234_5678);
    let hellos = [client_hello(Tls::V13), client_hello(Tls::V12)];
    let (mut alerts, mut server_hellos, mut silent) = (0, 0, 0);
    for case in 0..300 {
        let (bytes, splits) = mutate(&hellos[case % 2], &mut rng);
        let mut s = tcp_connect(port);
        s.set_read_timeout(Some(Duration::from_secs(15)))
            .expect("timeout");
        let mut from = 0;
        for &at in splits.iter().chain(std::iter::once(&bytes.len())) {
            if s.write_all(&bytes[from..at]).is_err() {
                break; // the server already gave up on us
            }
            from = at;
        }
        let _ = s.shutdown(Shutdown::Write);
        let mut reply = Vec::new();
        match s.read_to_end(&mut reply) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("case {case}: the server neither answered nor closed: {e}"),
        }
        match reply.first() {
            Some(21) => alerts += 1,
            Some(22) => server_hellos += 1,
            // A reset from the server (it closed with our junk unread) can discard part of
            // what it sent before; what arrived must still be TLS records.
            Some(20..=24) => {}
            Some(b) => panic!("case {case}: the reply starts with {b}, not a TLS record"),
            None => silent += 1,
        }
    }
    eprintln!("300 mutated ClientHellos: {alerts} alerts, {server_hellos} ServerHellos, {silent} closed without a record");
    assert!(
        alerts > 150,
        "most malformed ClientHellos deserve an alert; got {alerts}"
    );
    server.assert_alive();
    assert_eq!(
        fetch(port, Tls::V13, &fixtures::get().hello.url).status,
        200
    );
    server.stop();
}
