//! Blocking TCP connect tuned for the handshake loop.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};

/// Connects with TCP_NODELAY and read/write timeouts set *before* connect():
/// on Linux a blocking connect() honours SO_SNDTIMEO, so this needs no
/// non-blocking connect + poll + mode switches (std's `connect_timeout`
/// costs 3 more syscalls per connection). A timed-out connect fails with
/// EINPROGRESS, reported here as `TimedOut`.
pub(crate) fn connect(addr: &SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    connect_from(addr, None, timeout)
}

/// [`connect`] from a chosen local address (any port), e.g. one of 127.0.0.2-9 to have more
/// source ports towards one server than one address has.
pub(crate) fn connect_from(
    addr: &SocketAddr,
    source: Option<IpAddr>,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let sock = Socket::new(
        Domain::for_address(*addr),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(timeout))?;
    sock.set_write_timeout(Some(timeout))?;
    if let Some(ip) = source {
        sock.bind(&SocketAddr::new(ip, 0).into())?;
    }
    match sock.connect(&(*addr).into()) {
        Ok(()) => Ok(sock.into()),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {
            Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
        }
        Err(e) => Err(e),
    }
}
