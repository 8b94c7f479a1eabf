//! `bench throughput`: keep-alive connections GETting one URL in a loop.
//!
//! The hot loop allocates nothing: the request bytes are built once, the
//! response is read into one reused 64 KiB buffer per connection loop and
//! discarded (or hashed for `--verify-sha256`). The socket is wrapped in a
//! 64 KiB read buffer because rustls asks for 4 KiB per `read_tls`, which
//! would otherwise cost ~4 read syscalls per 16 KiB record (against nginx,
//! 1 MiB body, one connection: 0.92-0.95 client CPU s/GB with the buffer,
//! 0.97-1.15 without). Most of the remaining cost is AES-GCM and rustls'
//! own plaintext copies.

use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_lc_rs::digest;
use rustls::{ClientConfig, ClientConnection};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::engine::Control;
use crate::http::{parse_head, Head};
use crate::stats::{Failure, Negotiated, Stats};

const BUF_SIZE: usize = 64 * 1024;
const MAX_HEAD: usize = 16 * 1024;
/// Pause after a failed connection attempt, so a dead server is not spun on.
const RECONNECT_PAUSE: Duration = Duration::from_millis(10);

pub(crate) struct TpParams {
    pub addr: SocketAddr,
    pub server_name: ServerName<'static>,
    /// `GET path HTTP/1.1` with Host, built once.
    pub request: Vec<u8>,
    pub sha256: Option<[u8; 32]>,
    pub timeout: Duration,
}

/// Result of one request on an open connection.
struct Response {
    body: u64,
    close: bool,
}

/// Consumes body bytes: optional hashing, end check.
struct Body {
    remaining: u64,
    hash: Option<digest::Context>,
}

impl Body {
    fn new(head: &Head, sha: bool) -> Result<Body, Failure> {
        if !(200..300).contains(&head.status) {
            return Err(Failure::BadStatus(head.status));
        }
        let len = head
            .content_length
            .ok_or(Failure::BadResponse("no Content-Length"))?;
        Ok(Body {
            remaining: len,
            hash: sha.then(|| digest::Context::new(&digest::SHA256)),
        })
    }

    fn take(&mut self, data: &[u8]) -> Result<(), Failure> {
        if data.len() as u64 > self.remaining {
            return Err(Failure::BadResponse("more data than Content-Length"));
        }
        self.remaining -= data.len() as u64;
        if let Some(h) = &mut self.hash {
            h.update(data);
        }
        Ok(())
    }

    fn finish(self, want: Option<&[u8; 32]>) -> Result<(), Failure> {
        if let (Some(h), Some(want)) = (self.hash, want) {
            if h.finish().as_ref() != want {
                return Err(Failure::Sha256Mismatch);
            }
        }
        Ok(())
    }

    /// How much to read next: never past the end of this body.
    fn next_len(&self) -> usize {
        self.remaining.min(BUF_SIZE as u64) as usize
    }
}

fn record_handshake(st: &mut Stats, c: &rustls::CommonState, t: Duration, measured: bool) {
    if measured {
        st.handshake(c.handshake_kind(), Negotiated::of(c), t, false);
    }
}

// ---------------------------------------------------------------- blocking

/// A socket with a read buffer; writes go straight through.
struct BufSock(BufReader<TcpStream>);

impl Read for BufSock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for BufSock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.get_mut().write(buf)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.get_mut().write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn blocking_connect(
    p: &TpParams,
    cfg: &Arc<ClientConfig>,
) -> Result<(ClientConnection, BufSock), Failure> {
    let sock = crate::net::connect(&p.addr, p.timeout).map_err(Failure::from_connect)?;
    let mut sock = BufSock(BufReader::with_capacity(BUF_SIZE, sock));
    let mut conn =
        ClientConnection::new(cfg.clone(), p.server_name.clone()).map_err(Failure::Handshake)?;
    while conn.is_handshaking() {
        conn.complete_io(&mut sock)
            .map_err(|e| Failure::from_io(e, true))?;
    }
    Ok((conn, sock))
}

fn blocking_request(
    p: &TpParams,
    conn: &mut ClientConnection,
    sock: &mut BufSock,
    buf: &mut [u8],
) -> Result<Response, Failure> {
    let mut s = rustls::Stream::new(conn, sock);
    s.write_all(&p.request)
        .map_err(|e| Failure::from_io(e, false))?;
    let mut filled = 0;
    let head = loop {
        if filled == MAX_HEAD {
            return Err(Failure::BadResponse("response head too large"));
        }
        match s.read(&mut buf[filled..MAX_HEAD]) {
            Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof)),
            Ok(n) => filled += n,
            Err(e) => return Err(Failure::from_io(e, false)),
        }
        if let Some(h) = parse_head(&buf[..filled])? {
            break h;
        }
    };
    let mut body = Body::new(&head, p.sha256.is_some())?;
    body.take(&buf[head.len..filled])?;
    let total = head.content_length.unwrap_or(0);
    while body.remaining > 0 {
        let want = body.next_len();
        match s.read(&mut buf[..want]) {
            Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof)),
            Ok(n) => body.take(&buf[..n])?,
            Err(e) => return Err(Failure::from_io(e, false)),
        }
    }
    body.finish(p.sha256.as_ref())?;
    Ok(Response {
        body: total,
        close: head.close,
    })
}

fn blocking_close(mut conn: ClientConnection, mut sock: BufSock) {
    conn.send_close_notify();
    let _ = conn.complete_io(&mut sock);
}

pub(crate) fn blocking_loop(p: &TpParams, ctl: &Control, cfg: Arc<ClientConfig>) -> Stats {
    let mut st = Stats::default();
    let mut buf = vec![0u8; BUF_SIZE];
    let mut open: Option<(ClientConnection, BufSock)> = None;
    while let Some(measured) = ctl.next() {
        let (conn, sock) = match &mut open {
            Some(o) => (&mut o.0, &mut o.1),
            None => {
                let t0 = Instant::now();
                match blocking_connect(p, &cfg) {
                    Ok((conn, sock)) => {
                        record_handshake(&mut st, &conn, t0.elapsed(), measured);
                        let o = open.insert((conn, sock));
                        (&mut o.0, &mut o.1)
                    }
                    Err(f) => {
                        if measured {
                            st.failure(&f);
                            ctl.note(false, 0);
                        }
                        std::thread::sleep(RECONNECT_PAUSE);
                        continue;
                    }
                }
            }
        };
        let t0 = Instant::now();
        match blocking_request(p, conn, sock, &mut buf) {
            Ok(r) => {
                if measured {
                    st.request(t0.elapsed(), r.body);
                    ctl.note(true, r.body);
                }
                if r.close {
                    let (c, s) = open.take().expect("open connection");
                    blocking_close(c, s);
                }
            }
            Err(f) => {
                if measured {
                    st.failure(&f);
                    ctl.note(false, 0);
                }
                // After a digest mismatch the whole body was read: the
                // connection is still usable. Anything else: reconnect.
                if !matches!(f, Failure::Sha256Mismatch) {
                    open = None;
                }
            }
        }
    }
    if let Some((c, s)) = open {
        blocking_close(c, s);
    }
    st
}

// ---------------------------------------------------------------- tokio

type TokioTls = tokio_rustls::client::TlsStream<tokio::io::BufReader<tokio::net::TcpStream>>;

async fn tokio_connect(
    p: &TpParams,
    connector: &tokio_rustls::TlsConnector,
) -> Result<TokioTls, Failure> {
    let tcp = tokio::net::TcpStream::connect(p.addr)
        .await
        .map_err(Failure::from_connect)?;
    let _ = tcp.set_nodelay(true);
    let tcp = tokio::io::BufReader::with_capacity(BUF_SIZE, tcp);
    connector
        .connect(p.server_name.clone(), tcp)
        .await
        .map_err(|e| Failure::from_io(e, true))
}

async fn tokio_request(
    p: &TpParams,
    tls: &mut TokioTls,
    buf: &mut [u8],
) -> Result<Response, Failure> {
    let io = |e| Failure::from_io(e, false);
    tls.write_all(&p.request).await.map_err(io)?;
    tls.flush().await.map_err(io)?;
    let mut filled = 0;
    let head = loop {
        if filled == MAX_HEAD {
            return Err(Failure::BadResponse("response head too large"));
        }
        match tls.read(&mut buf[filled..MAX_HEAD]).await {
            Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof)),
            Ok(n) => filled += n,
            Err(e) => return Err(io(e)),
        }
        if let Some(h) = parse_head(&buf[..filled])? {
            break h;
        }
    };
    let mut body = Body::new(&head, p.sha256.is_some())?;
    body.take(&buf[head.len..filled])?;
    let total = head.content_length.unwrap_or(0);
    while body.remaining > 0 {
        let want = body.next_len();
        match tls.read(&mut buf[..want]).await {
            Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof)),
            Ok(n) => body.take(&buf[..n])?,
            Err(e) => return Err(io(e)),
        }
    }
    body.finish(p.sha256.as_ref())?;
    Ok(Response {
        body: total,
        close: head.close,
    })
}

pub(crate) async fn tokio_loop(
    p: Arc<TpParams>,
    ctl: Arc<Control>,
    cfg: Arc<ClientConfig>,
) -> Stats {
    let connector = tokio_rustls::TlsConnector::from(cfg);
    let mut st = Stats::default();
    let mut buf = vec![0u8; BUF_SIZE];
    let mut open: Option<TokioTls> = None;
    while let Some(measured) = ctl.next() {
        let tls = match &mut open {
            Some(t) => t,
            None => {
                let t0 = Instant::now();
                let r = match tokio::time::timeout(p.timeout, tokio_connect(&p, &connector)).await {
                    Ok(r) => r,
                    Err(_) => Err(Failure::Timeout),
                };
                match r {
                    Ok(t) => {
                        record_handshake(&mut st, t.get_ref().1, t0.elapsed(), measured);
                        open.insert(t)
                    }
                    Err(f) => {
                        if measured {
                            st.failure(&f);
                            ctl.note(false, 0);
                        }
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                        continue;
                    }
                }
            }
        };
        let t0 = Instant::now();
        let r = match tokio::time::timeout(p.timeout, tokio_request(&p, tls, &mut buf)).await {
            Ok(r) => r,
            Err(_) => Err(Failure::Timeout),
        };
        match r {
            Ok(r) => {
                if measured {
                    st.request(t0.elapsed(), r.body);
                    ctl.note(true, r.body);
                }
                if r.close {
                    if let Some(mut t) = open.take() {
                        let _ = tokio::time::timeout(p.timeout, t.shutdown()).await;
                    }
                }
            }
            Err(f) => {
                if measured {
                    st.failure(&f);
                    ctl.note(false, 0);
                }
                // After a digest mismatch the whole body was read: the
                // connection is still usable. Anything else: reconnect.
                if !matches!(f, Failure::Sha256Mismatch) {
                    open = None;
                }
            }
        }
    }
    if let Some(mut t) = open {
        let _ = tokio::time::timeout(p.timeout, t.shutdown()).await;
    }
    st
}
