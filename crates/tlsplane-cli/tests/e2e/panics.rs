//! Inputs that once panicked a connection task. Each must now end with the connection closed
//! and nothing else: `Server::stop` fails the test if `task_panics` moved or the server's
//! stderr says "panicked".

use std::io::{Read, Write};
use std::time::Duration;

use crate::support::client::{fetch, tcp_connect, Tls};
use crate::support::{fixtures, Server};

/// A handshake record whose handshake message claims 0xadbeef bytes: rustls' deframer fails,
/// and the driver then handed rustls an empty buffer while its deframer still pointed into
/// the old one (index out of bounds in rustls, conn.rs).
const NINE_BYTES: &[u8] = b"\x16\x03\x01\x00\x04\xde\xad\xbe\xef";

#[test]
fn nine_bytes_do_not_panic_a_connection_task() {
    let mut server = Server::start();
    let port = server.port();
    for _ in 0..5 {
        let mut s = tcp_connect(port);
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(NINE_BYTES).expect("send");
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        // rustls reports this without queueing an alert; nginx answers decode_error, so do we.
        assert_eq!(reply, [21, 3, 3, 0, 2, 2, 50], "a fatal decode_error alert");
    }
    server.assert_alive();
    assert_eq!(
        fetch(port, Tls::V13, &fixtures::get().hello.url).status,
        200
    );
    let stats = server.stop();
    assert_eq!(stats["handshake_peer_errors"], 5, "{stats:?}");
}
