//! The transport `h2` runs on, over a [`TlsStream`] of either plane, shared by every product
//! that speaks HTTP/2.
//!
//! `h2` wants an `AsyncRead + AsyncWrite` transport, while [`TlsStream`] has async `read` and
//! `write_all`. A pump in the connection's own task moves the bytes between the two through
//! an in-memory pipe (`tokio::io::duplex`); h2 runs in the same task ([`run`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tlsplane::TlsStream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};

/// The in-memory pipe between h2 and the TLS stream, each way.
const PIPE: usize = 32 * 1024;
/// What one TLS read or write moves (a record's plaintext).
const IO_BUF: usize = 16 * 1024;

/// What h2 reads the client's bytes from and writes its own to.
pub(crate) struct H2Io(DuplexStream);

impl AsyncRead for H2Io {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for H2Io {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Runs `conn` (h2's side of one connection, given its transport) and the pump between that
/// transport and `tls`, in the calling task, until both end: `conn`'s output, and how the
/// pump ended (an error from the client's side, or a client that took none of our bytes for
/// `stall`).
pub(crate) async fn run<F, Fut>(
    tls: &mut TlsStream,
    stall: Duration,
    conn: F,
) -> (Fut::Output, io::Result<()>)
where
    F: FnOnce(H2Io) -> Fut,
    Fut: Future,
{
    let (ours, theirs) = tokio::io::duplex(PIPE);
    tokio::join!(conn(H2Io(theirs)), pump(tls, ours, stall))
}

/// Moves bytes between the client (`tls`) and h2 (`io`) until h2 is done with the
/// connection; reads from the client never wait on writes to it, nor the other way round,
/// so neither direction can stop the other. A client that takes none of our bytes for
/// `stall` ends the connection.
async fn pump(tls: &mut TlsStream, io: DuplexStream, stall: Duration) -> io::Result<()> {
    let (mut from_h2, mut to_h2) = tokio::io::split(io);
    // Read into `inbound`; what is read waits in `pending` until h2 takes it.
    let mut inbound = vec![0u8; IO_BUF];
    let mut pending = vec![0u8; IO_BUF];
    let (mut taken, mut held) = (0usize, 0usize);
    let mut outbound = vec![0u8; IO_BUF];
    // The client's input ended, or h2 takes no more of it.
    let mut input_done = false;
    loop {
        tokio::select! {
            read = tls.read(&mut inbound), if taken == held && !input_done => match read? {
                0 => {
                    input_done = true;
                    // h2 sees the end of the client's input.
                    let _ = to_h2.shutdown().await;
                }
                n => {
                    std::mem::swap(&mut inbound, &mut pending);
                    (taken, held) = (0, n);
                }
            },
            wrote = to_h2.write(&pending[taken..held]), if taken < held => match wrote {
                Ok(n) if n > 0 => taken += n,
                // h2 is finished with the connection: drop the rest, send what it wrote.
                _ => {
                    (taken, held) = (0, 0);
                    input_done = true;
                }
            },
            read = from_h2.read(&mut outbound) => match read? {
                0 => return Ok(()),
                n => match tokio::time::timeout(stall, tls.write_all(&outbound[..n])).await {
                    Ok(wrote) => wrote?,
                    Err(_) => {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the client took none of our bytes",
                        ))
                    }
                },
            },
        }
    }
}
