//! Lingering close: what a connection does after its last byte is queued.
//!
//! Closing a socket whose receive queue holds bytes makes the kernel answer with a reset, and a
//! reset discards whatever of the response is still queued or in flight: the client gets a
//! truncated body and no close_notify. This happens whenever the client sent more than we read
//! (a pipelined request after `Connection: close`, a body nobody wants, the rest of a
//! ClientHello refused from its header). So a closing connection, once everything it sends is
//! queued (close_notify included), shuts down its write side and reads and drops what the
//! client still sends until the client closes too, or until a deadline (nginx's
//! `lingering_close`, with its `lingering_timeout` and `lingering_time`), or a byte cap.
//!
//! The bytes are read into a per-thread scratch buffer during the (synchronous) receive call,
//! never held across a wait: a lingering connection holds no more memory than an idle one.

use std::io;
use std::time::Duration;

use tokio::io::{Interest, Ready};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::stats::{add, bump, global};

/// How long and how much a closing connection reads and drops of the client's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linger {
    /// Longest wait for the client's next bytes (nginx `lingering_timeout`).
    pub timeout: Duration,
    /// Longest the whole linger lasts (nginx `lingering_time`); zero: no linger at all (close
    /// at once, which resets a connection with unread input).
    pub time: Duration,
    /// Most bytes read and dropped; past it the connection closes (reset if more is queued).
    pub max_bytes: u64,
}

/// nginx's defaults: 5 s between reads, 30 s in all; 16 MiB (nginx has no byte cap): a
/// client that goes on sending that much after the response has had ample time to read it.
pub const DEFAULT_LINGER: Linger = Linger {
    timeout: Duration::from_secs(5),
    time: Duration::from_secs(30),
    max_bytes: 16 << 20,
};

impl Default for Linger {
    fn default() -> Self {
        DEFAULT_LINGER
    }
}

/// Bytes one receive call may take (one full TLS record's plaintext on the kernel plane).
const SCRATCH: usize = 16384;

thread_local! {
    /// Where this thread's lingering receives put the bytes they drop: made and zeroed once
    /// per thread. A fresh buffer on the stack of each receive call was zeroed each time, and
    /// a closing connection makes two or three of them: 32-48 KiB of stores per connection
    /// (about 33,000 of the 1.13 million instructions a new connection with one GET costs, and
    /// an L1 data cache's worth of lines). Used only inside one synchronous receive, never
    /// across a wait.
    static SCRATCH_BUF: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0u8; SCRATCH].into_boxed_slice());
}

/// Shuts down the write side of a plain socket and lingers (see the module): for the
/// handshake's refusals, sent in the clear or by rustls before a data plane exists.
pub(crate) async fn close_plain(sock: &TcpStream, linger: &Linger) {
    if socket2::SockRef::from(sock)
        .shutdown(std::net::Shutdown::Write)
        .is_err()
    {
        return;
    }
    discard_input(sock, linger, true, &mut |buf| {
        io::Read::read(&mut &*socket2::SockRef::from(sock), buf)
    })
    .await;
}

/// Reads and drops the client's input with `recv` (a non-blocking receive of at most
/// `buf.len()` bytes: `Ok(0)` at the end, `WouldBlock` when nothing is there) until the end,
/// a deadline or the byte cap of `linger`. The write side must be shut down already.
///
/// `byte_stream`: `recv` is a plain receive of the socket's bytes, so one that returns less
/// than it was offered has emptied the queue. Then, when the readiness it followed already
/// carried the client's FIN, the input has ended and the receive that would return `Ok(0)`
/// is skipped (one system call per closing connection: the common end is the client's
/// close_notify and FIN read in one receive). Not for the kernel plane, which receives one
/// record at a time. (TCP urgent data can also stop a receive short; a client that sends it
/// after its last request may get a reset, as it would from nginx.)
///
/// A receive error ends the reading but not the wait: the kernel plane cannot always read
/// what is queued (a record under a key it cannot install); the connection then waits for the
/// client's FIN, which comes once the client has read everything, before it closes.
pub(crate) async fn discard_input(
    sock: &TcpStream,
    linger: &Linger,
    byte_stream: bool,
    recv: &mut (dyn FnMut(&mut [u8]) -> io::Result<usize> + Send),
) {
    if linger.time.is_zero() {
        return;
    }
    bump(&global().lingering_closes);
    let end = Instant::now() + linger.time;
    let mut dropped = 0u64;
    let mut readable = true;
    loop {
        let until = end.min(Instant::now() + linger.timeout);
        let waited = if readable {
            tokio::time::timeout_at(until, sock.ready(Interest::READABLE)).await
        } else {
            tokio::time::timeout_at(until, peer_closed(sock))
                .await
                .map(|r| r.map(|()| Ready::READ_CLOSED))
        };
        let fin_came = match waited {
            Err(_) => {
                bump(&global().lingering_timeouts);
                break;
            }
            Ok(Err(_)) => break,
            Ok(Ok(_)) if !readable => break,
            Ok(Ok(ready)) => ready.is_read_closed(),
        };
        let got = sock.try_io(Interest::READABLE, || {
            SCRATCH_BUF.with_borrow_mut(|scratch| recv(scratch))
        });
        match got {
            Ok(0) => break,
            Ok(n) => {
                dropped += n as u64;
                if dropped >= linger.max_bytes {
                    bump(&global().lingering_byte_limits);
                    break;
                }
                if byte_stream && fin_came && n < SCRATCH {
                    // Everything up to the FIN is read: the next receive would say the end.
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::debug!(error = %e, "lingering close: input unreadable; waiting for the client's FIN");
                readable = false;
            }
        }
    }
    add(&global().lingering_bytes, dropped);
}

/// Waits for the peer's FIN without reading (the queue holds bytes that cannot be read).
async fn peer_closed(sock: &TcpStream) -> io::Result<()> {
    loop {
        let ready = sock.ready(Interest::READABLE).await?;
        if ready.is_read_closed() {
            return Ok(());
        }
        // Readable because of the unread bytes: clear the readiness and wait for the next
        // event (more bytes, or the FIN).
        let _ = sock.try_io(Interest::READABLE, || {
            Err::<(), _>(io::ErrorKind::WouldBlock.into())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts the receives a linger makes when the client's last bytes and its FIN are both
    /// in, and the readiness has seen the FIN.
    async fn receives(byte_stream: bool) -> usize {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().await.unwrap();
        socket2::SockRef::from(&server)
            .shutdown(std::net::Shutdown::Write)
            .unwrap();
        io::Write::write_all(&mut client, &[0x17; 24]).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        while !server
            .ready(Interest::READABLE)
            .await
            .unwrap()
            .is_read_closed()
        {
            tokio::task::yield_now().await;
        }
        let mut calls = 0;
        discard_input(&server, &DEFAULT_LINGER, byte_stream, &mut |buf| {
            calls += 1;
            io::Read::read(&mut &*socket2::SockRef::from(&server), buf)
        })
        .await;
        calls
    }

    #[tokio::test]
    async fn a_short_read_after_the_fin_ends_the_linger() {
        assert_eq!(receives(true).await, 1);
        // One record at a time (the kernel plane): the end must be read.
        assert_eq!(receives(false).await, 2);
    }
}
