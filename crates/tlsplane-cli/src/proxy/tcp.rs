//! TCP mode: bytes both ways unchanged, by splice through pipes on the kernel plane and by
//! copies through bounded buffers on the user plane, keeping half-closes.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tlsplane::{Spliced, TlsStream};

use super::backend::BackendConn;
use super::{Ended, ProxyStats};

/// Bytes taken from one side and not yet given to the other.
#[derive(Clone, Copy, Debug)]
enum Held {
    Nothing,
    /// `buf[at..len]` of the direction's buffer.
    Buf {
        at: usize,
        len: usize,
    },
    /// This many bytes in the direction's pipe.
    Pipe(usize),
}

/// The two pipes of a spliced connection (kernel plane), one per direction.
pub(crate) struct Pipes {
    up: tlsplane_sys::Pipe,
    down: tlsplane_sys::Pipe,
    /// Bytes one splice into a pipe may move (the pipe's capacity: it is always empty then).
    capacity: usize,
}

impl Pipes {
    pub(super) fn new() -> std::io::Result<Self> {
        let up = tlsplane_sys::Pipe::new()?;
        let capacity = up.capacity()?;
        Ok(Self {
            up,
            down: tlsplane_sys::Pipe::new()?,
            capacity,
        })
    }
}

/// What the client → backend half of the relay did.
enum Up {
    Read(std::io::Result<Spliced>),
    /// Bytes written to the backend, and whether from the pipe.
    Wrote(std::io::Result<usize>, bool),
}

/// Writes (part of) what is held for the backend.
async fn to_backend(
    backend: &BackendConn,
    held: Held,
    buf: &[u8],
    pipes: Option<&Pipes>,
) -> (std::io::Result<usize>, bool) {
    match (held, pipes) {
        (Held::Buf { at, len }, _) => (backend.write(&buf[at..len]).await, false),
        (Held::Pipe(n), Some(p)) => (backend.splice_from(p.up.read.as_fd(), n).await, true),
        _ => std::future::pending().await,
    }
}

/// Accounts for `n` bytes written to the backend from `held`.
fn wrote_to_backend(held: &mut Held, n: usize, spliced: bool, stats: &ProxyStats) {
    *held = match *held {
        Held::Buf { at, len } if at + n < len => Held::Buf { at: at + n, len },
        Held::Pipe(m) if m > n => Held::Pipe(m - n),
        _ => Held::Nothing,
    };
    if spliced {
        stats.bytes_to_backend_spliced.fetch_add(n as u64, Relaxed);
    } else {
        stats.bytes_to_backend_copied.fetch_add(n as u64, Relaxed);
    }
}

/// Moves bytes both ways until both directions have ended (or one side fails).
///
/// With `pipes` (the kernel plane) bytes go by `splice(2)` through a pipe per direction and
/// never enter this process, except the few around a control record the kernel hands up.
///
/// The TLS stream is one object (its record layer serves both directions), so its reads and
/// writes take turns; the backend's are independent. A read from the client is cancelled
/// (it is cancel-safe) when the backend has something for the client; a write to the client is
/// never cancelled, and while it waits (a client not reading) the proxy stops reading from
/// that client too (backpressure) but goes on writing what it holds to the backend.
pub(crate) async fn relay(
    tls: &mut TlsStream,
    backend: &BackendConn,
    pipes: Option<&Pipes>,
    buffer: usize,
    idle: Duration,
    stats: &ProxyStats,
) -> Ended {
    relay_ending(
        tls,
        backend,
        pipes,
        buffer,
        idle,
        stats,
        std::future::ready(true),
    )
    .await
}

/// [`relay`], where the backend's end of stream is passed on as close_notify only if
/// `orderly_end` (awaited when it is read) says so; otherwise the relay ends as
/// [`Ended::BackendError`] (the caller resets the client's connection), so that a backend
/// that went away without ending its stream is not taken for one that finished.
pub(crate) async fn relay_ending(
    tls: &mut TlsStream,
    backend: &BackendConn,
    pipes: Option<&Pipes>,
    buffer: usize,
    idle: Duration,
    stats: &ProxyStats,
    orderly_end: impl std::future::Future<Output = bool>,
) -> Ended {
    let mut orderly_end = Some(orderly_end);
    // Buffers are lent to a direction only while bytes move, so an idle connection holds
    // none (on the kernel plane, pipes carry the bytes: `up` only takes what splice cannot).
    // Client → backend.
    let mut up: Vec<u8> = Vec::new();
    let mut up_held = Held::Nothing;
    let mut client_done = false; // the client will send nothing more
    let mut backend_shut = false; // ... and the backend was told so
                                  // Backend → client.
    let mut down: Vec<u8> = Vec::new();
    // The last read from the backend filled the buffer: more is likely on its way, so the
    // buffer is kept over the next wait.
    let mut down_streaming = false;
    let mut backend_done = false;
    let mut client_shut = false;
    let mut deadline = tokio::time::Instant::now() + idle;
    loop {
        let up_empty = matches!(up_held, Held::Nothing);
        if client_done && up_empty && !backend_shut {
            backend_shut = true;
            if backend.shutdown_write().is_err() {
                return Ended::BackendError;
            }
        }
        if backend_shut && backend_done {
            if !client_shut {
                let _ = Box::pin(tls.shutdown()).await;
            }
            return Ended::Closed;
        }
        if backend_done && !client_shut {
            client_shut = true;
            if let Err(e) = Box::pin(tls.shutdown()).await {
                tracing::debug!(error = %e, "relay: close_notify to the client failed");
                return Ended::ClientError;
            }
        }
        // Client → backend is one of: read from the client (nothing held), or write what is
        // held to the backend; one future, since both use the same buffer.
        let up_op = async {
            match (up_held, pipes) {
                (Held::Nothing, _) if client_done => std::future::pending().await,
                (Held::Nothing, Some(p)) => {
                    // Control records and what came with the Finished: a few bytes at a time.
                    up.resize(512, 0);
                    if !tls.input_pending() {
                        tls.readable().await.ok();
                    }
                    Up::Read(
                        Box::pin(tls.splice_out(p.up.write.as_fd(), p.capacity, &mut up)).await,
                    )
                }
                (Held::Nothing, None) => {
                    Up::Read(lent_read(tls, &mut up, buffer).await.map(|n| match n {
                        0 => Spliced::End,
                        n => Spliced::Buf(n),
                    }))
                }
                (held, _) => {
                    let (r, spliced) = to_backend(backend, held, &up, pipes).await;
                    Up::Wrote(r, spliced)
                }
            }
        };
        let down_op = async {
            match pipes {
                Some(p) => backend
                    .splice_to(p.down.write.as_fd(), p.capacity)
                    .await
                    .map(|n| (n, Held::Pipe(n))),
                None => backend
                    .read_lent(&mut down, buffer, down_streaming)
                    .await
                    .map(|n| (n, Held::Buf { at: 0, len: n })),
            }
        };
        tokio::select! {
            up_done = up_op => match up_done {
                Up::Read(Ok(Spliced::End)) => client_done = true,
                Up::Read(Ok(Spliced::Buf(n))) => {
                    up_held = Held::Buf { at: 0, len: n };
                    deadline = tokio::time::Instant::now() + idle;
                }
                Up::Read(Ok(Spliced::Pipe(n))) => {
                    up_held = Held::Pipe(n);
                    deadline = tokio::time::Instant::now() + idle;
                }
                Up::Read(Err(e)) => {
                    tracing::debug!(error = %e, "relay: reading the client failed");
                    return Ended::ClientError;
                }
                // The backend has said all it had to (its EOF, passed on with close_notify) and
                // takes no more: a clean end for the client, whose remaining input is dropped.
                Up::Wrote(Ok(0) | Err(_), _) if backend_done && client_shut => return Ended::Closed,
                Up::Wrote(Ok(0) | Err(_), _) => return Ended::BackendError,
                Up::Wrote(Ok(n), spliced) => {
                    wrote_to_backend(&mut up_held, n, spliced, stats);
                    deadline = tokio::time::Instant::now() + idle;
                }
            },
            r = down_op, if !backend_done => match r {
                Ok((0, _)) => {
                    if let Some(orderly) = orderly_end.take() {
                        if !Box::pin(orderly).await {
                            return Ended::BackendError;
                        }
                    }
                    backend_done = true;
                }
                Ok((n, held)) => {
                    deadline = tokio::time::Instant::now() + idle;
                    down_streaming = n == buffer;
                    // Write it all to the client; meanwhile keep the backend fed.
                    let spliced = matches!(held, Held::Pipe(_));
                    // Boxed, as the reads are: a future's size counts in every connection's
                    // task, idle or not.
                    let mut write = Box::pin(async {
                        match (held, pipes) {
                            (Held::Pipe(n), Some(p)) => tls.splice_in(p.down.read.as_fd(), n).await,
                            _ => tls.write_all(&down[..n]).await,
                        }
                    });
                    loop {
                        tokio::select! {
                            w = &mut write => {
                                if let Err(e) = w {
                                    tracing::debug!(error = %e, "relay: writing to the client failed");
                                    return Ended::ClientError;
                                }
                                break;
                            }
                            (r, from_pipe) = to_backend(backend, up_held, &up, pipes),
                                if !matches!(up_held, Held::Nothing) => match r {
                                Ok(0) | Err(_) => return Ended::BackendError,
                                Ok(m) => {
                                    wrote_to_backend(&mut up_held, m, from_pipe, stats);
                                    deadline = tokio::time::Instant::now() + idle;
                                }
                            },
                            _ = tokio::time::sleep_until(deadline) => return Ended::IdleTimeout,
                        }
                    }
                    if spliced {
                        stats.bytes_to_client_spliced.fetch_add(n as u64, Relaxed);
                    } else {
                        stats.bytes_to_client_copied.fetch_add(n as u64, Relaxed);
                    }
                    deadline = tokio::time::Instant::now() + idle;
                }
                Err(_) => return Ended::BackendError,
            },
            _ = tokio::time::sleep_until(deadline) => return Ended::IdleTimeout,
        }
    }
}

/// Reads from the client into `buf`, sized to `size` only once there is something to read
/// (and given back when there is not).
async fn lent_read(tls: &mut TlsStream, buf: &mut Vec<u8>, size: usize) -> std::io::Result<usize> {
    if !tls.input_pending() {
        *buf = Vec::new();
        tls.readable().await?;
    }
    buf.resize(size, 0);
    Box::pin(tls.read(buf)).await
}
