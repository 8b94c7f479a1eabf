//! The send timeout (`--send-timeout`, TCP_USER_TIMEOUT on the listening sockets): a client
//! that stops reading is cut off once it has taken none of our bytes for that long, however
//! faithfully its TCP answers the window probes; and only then (0 turns it off).

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::client::{ClientOpts, Tls, TlsClient};
use crate::support::{fixtures, Server};

/// A TLS client with a small receive window that asks for the 64 MiB fixture and reads
/// nothing of it.
fn stalled_download(port: u16) -> TlsClient {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.set_recv_buffer_size(8192).unwrap();
    s.connect(&SocketAddr::from(([127, 0, 0, 1], port)).into())
        .unwrap();
    let mut c = TlsClient::over(s.into(), ClientOpts::version(Tls::V13).config());
    c.handshake().expect("handshake");
    let url = &fixtures::get().big().url;
    c.write_all(format!("GET {url} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .expect("the request");
    c
}

/// What the client finds when it reads again after `pause`: Err (the reset its window update
/// met: the server's end is gone) once it has drained what its socket held, or Ok (the
/// response went on) once it has read 1 MiB.
fn read_after(c: &mut TlsClient, pause: Duration) -> Result<usize, std::io::Error> {
    use std::io::Read;
    std::thread::sleep(pause);
    c.io.sock
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = vec![0u8; 64 << 10];
    let mut got = 0;
    while got < 1 << 20 {
        match c.io.sock.read(&mut buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[test]
fn a_client_that_stops_reading_is_reset_at_the_send_timeout() {
    let server = Server::builder().arg("--send-timeout").arg("1").start();
    let mut c = stalled_download(server.port());
    // The response fills the client's window and the server's send buffer at once (loopback);
    // from then on the server's TCP probes a zero window, which the client's TCP answers. At
    // the timeout the server's kernel drops the connection without a word (no reset is sent:
    // the client is not reading anyway); the client learns it when it reads again.
    let read = read_after(&mut c, Duration::from_secs(3));
    assert!(
        matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "reading again 3 s after the window closed (--send-timeout 1): {read:?}"
    );
    drop(c);
    let stats = server.stop();
    assert_eq!(stats["send_timeouts"], 1, "{stats:?}");
}

#[test]
fn without_a_send_timeout_a_client_that_stops_reading_keeps_its_connection() {
    let server = Server::builder().arg("--send-timeout").arg("0").start();
    let mut c = stalled_download(server.port());
    let read = read_after(&mut c, Duration::from_secs(3));
    assert!(
        read.is_ok(),
        "reading again 3 s after the window closed (--send-timeout 0): {read:?}"
    );
    drop(c);
    let stats = server.stop();
    assert_eq!(stats["send_timeouts"], 0, "{stats:?}");
}
