//! A ClientHello refused before rustls sees it gets the alert its fault calls for, and the
//! client reads it: a plaintext record over 2^14 bytes is record_overflow (RFC 8446 §5.1), and
//! a hello spread over too many records is unexpected_message followed by a lingering close,
//! not a reset that would destroy the alert while the client is still sending.

use std::io::{Read, Write};
use std::time::Duration;

use crate::hello_records::{padded_client_hello, records};
use crate::support::client::tcp_connect;
use crate::support::Server;

const RECORD_OVERFLOW: [u8; 7] = [21, 3, 3, 0, 2, 2, 22];
const UNEXPECTED_MESSAGE: [u8; 7] = [21, 3, 3, 0, 2, 2, 10];

/// Sends `wire` in one go (what the server does not read stays queued at it), then reads
/// until the server closes: its bytes, and whether it ended with a FIN (not a reset).
fn exchange(port: u16, wire: &[u8]) -> (Vec<u8>, std::io::Result<()>) {
    let mut s = tcp_connect(port);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A server that resets mid-way fails the write: what it said is still to be read.
    let _ = s.write_all(wire);
    let mut reply = Vec::new();
    let end = s.read_to_end(&mut reply).map(|_| ());
    (reply, end)
}

#[test]
fn refused_hellos_get_their_alert_and_a_clean_close() {
    let server = Server::start();
    let port = server.port();

    // 2^14 bytes in one record is a hello like any other; one byte more overflows.
    let mut s = tcp_connect(port);
    s.write_all(&records(&padded_client_hello(16384), 16384))
        .unwrap();
    let mut head = [0u8; 1];
    s.read_exact(&mut head).unwrap();
    drop(s);
    assert_eq!(
        head.first(),
        Some(&22),
        "a 16384-byte record was not answered with a ServerHello"
    );
    let (reply, end) = exchange(port, &records(&padded_client_hello(16385), 16385));
    assert!(
        reply == RECORD_OVERFLOW,
        "16385-byte plaintext record: {} bytes in reply, starting {:?}",
        reply.len(),
        &reply[..reply.len().min(7)]
    );
    assert!(
        end.is_ok(),
        "16385-byte record: the connection ended with {end:?}"
    );

    // 16 KB of hello in 1-byte records (the cap is 16): all sent before the server answers.
    let (reply, end) = exchange(port, &records(&padded_client_hello(16000), 1));
    assert_eq!(reply, UNEXPECTED_MESSAGE, "too many records");
    assert!(
        end.is_ok(),
        "too many records: the connection ended with {end:?}, not the server's FIN"
    );

    let lines = server.stderr_lines();
    assert!(
        !lines.iter().any(|l| l.contains("panicked")),
        "{}",
        lines.join("\n")
    );
    let stats = server.stop();
    assert_eq!(stats["limit_max_client_hello_records"], 1);
}
