//! A ClientHello refused before rustls sees it gets the alert its fault calls for, and the
//! client reads it: a plaintext record over 2^14 bytes is record_overflow (RFC 8446 §5.1), and
//! a hello spread over too many records is unexpected_message followed by a lingering close,
//! not a reset that would destroy the alert while the client is still sending.

use std::io::{Read, Write};
use std::time::Duration;

use crate::hello_records::{padded_client_hello, records};
use crate::support::client::tcp_connect;
use crate::support::client::Tls;
use crate::support::Server;

const RECORD_OVERFLOW: [u8; 7] = [21, 3, 3, 0, 2, 2, 22];
const UNEXPECTED_MESSAGE: [u8; 7] = [21, 3, 3, 0, 2, 2, 10];
const ILLEGAL_PARAMETER: [u8; 7] = [21, 3, 3, 0, 2, 2, 47];

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

/// A real ClientHello with a pre_shared_key extension (last, as RFC 8446 §4.2.11 requires)
/// offering `n` made-up session tickets of 200 bytes each.
fn hello_offering_tickets(n: usize) -> Vec<u8> {
    let wire = crate::mutated_hellos::client_hello(Tls::V13);
    let mut msg = wire[5..].to_vec();
    let mut at = 4 + 34;
    at += 1 + msg[at] as usize;
    at += 2 + u16::from_be_bytes([msg[at], msg[at + 1]]) as usize;
    at += 1 + msg[at] as usize;
    let mut identities = Vec::new();
    for i in 0..n {
        identities.extend_from_slice(&200u16.to_be_bytes());
        identities.extend_from_slice(&[i as u8; 200]);
        identities.extend_from_slice(&[0, 0, 0, 1]); // obfuscated_ticket_age
    }
    let mut binders = Vec::new();
    for _ in 0..n {
        binders.push(32);
        binders.extend_from_slice(&[0u8; 32]);
    }
    let mut data = (identities.len() as u16).to_be_bytes().to_vec();
    data.extend_from_slice(&identities);
    data.extend_from_slice(&(binders.len() as u16).to_be_bytes());
    data.extend_from_slice(&binders);
    let added = 4 + data.len();
    let exts = u16::from_be_bytes([msg[at], msg[at + 1]]) as usize + added;
    msg[at..at + 2].copy_from_slice(&(exts as u16).to_be_bytes());
    msg.extend_from_slice(&41u16.to_be_bytes()); // pre_shared_key
    msg.extend_from_slice(&(data.len() as u16).to_be_bytes());
    msg.extend_from_slice(&data);
    let body = (msg.len() - 4) as u32;
    msg[1..4].copy_from_slice(&body.to_be_bytes()[1..]);
    records(&msg, 16384)
}

/// rustls tries to open every ticket a ClientHello offers: more than `--max-psk-identities`
/// (4) is refused with illegal_parameter before any is tried, and counted; 4 are not.
#[test]
fn a_hello_offering_too_many_tickets_is_refused_before_they_are_tried() {
    let server = Server::start();
    let port = server.port();
    let (reply, end) = exchange(port, &hello_offering_tickets(60));
    assert!(
        reply == ILLEGAL_PARAMETER,
        "60 tickets offered: {} bytes in reply, starting {:?}",
        reply.len(),
        &reply[..reply.len().min(7)]
    );
    assert!(end.is_ok(), "60 tickets: the connection ended with {end:?}");
    let (reply, _) = exchange(port, &hello_offering_tickets(4));
    assert_ne!(
        reply.get(..7),
        Some(&ILLEGAL_PARAMETER[..]),
        "4 tickets refused as too many"
    );
    let lines = server.stderr_lines();
    assert!(
        !lines.iter().any(|l| l.contains("panicked")),
        "{}",
        lines.join("\n")
    );
    let stats = server.stop();
    assert_eq!(stats["limit_max_psk_identities"], 1, "{stats:?}");
}
