//! `bench handshake`: connect, handshake, optional request, close; repeat.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::{ClientConfig, ClientConnection, HandshakeKind};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::engine::Control;
use crate::http::{parse_head, read_head};
use crate::stats::{Failure, Negotiated, Stats};

use crate::http::MAX_HEAD;

pub(crate) struct HsParams {
    /// The server, or the fleet's servers taken in turn by each loop (`--also`).
    pub addrs: Vec<SocketAddr>,
    pub server_name: ServerName<'static>,
    /// Complete `GET ... Connection: close` request, if `--request`.
    pub request: Option<Vec<u8>>,
    pub timeout: Duration,
}

/// Result of one connect-handshake-close cycle.
#[derive(Default)]
struct Cycle {
    /// Handshake completed: kind, what was negotiated, connect-to-done time.
    handshake: Option<(Option<HandshakeKind>, Negotiated, Duration)>,
    /// Connect start to end of a good response, and body bytes.
    response: Option<(Duration, u64)>,
    failure: Option<Failure>,
}

impl Cycle {
    fn failed(f: Failure) -> Cycle {
        Cycle {
            failure: Some(f),
            ..Cycle::default()
        }
    }

    fn record(self, st: &mut Stats, ctl: &Control) {
        if let Some((kind, neg, lat)) = self.handshake {
            st.handshake(kind, neg, lat, true);
        }
        let mut bytes = 0;
        if let Some((total, body)) = self.response {
            st.response(total, body);
            bytes = body;
        }
        if let Some(f) = &self.failure {
            st.failure(f);
        }
        ctl.note(self.failure.is_none(), bytes);
    }
}

// ---------------------------------------------------------------- blocking

pub(crate) fn blocking_loop(p: &HsParams, ctl: &Control, cfg: Arc<ClientConfig>) -> Stats {
    let mut st = Stats::default();
    // One read buffer per loop, reused by every cycle.
    let mut buf = vec![0u8; if p.request.is_some() { 64 * 1024 } else { 4096 }];
    let mut turn = 0usize;
    while let Some(measured) = ctl.next() {
        let addr = p.addrs[turn % p.addrs.len()];
        turn = turn.wrapping_add(1);
        let c = blocking_cycle(p, addr, &cfg, &mut buf);
        if measured {
            c.record(&mut st, ctl);
        }
    }
    st
}

fn blocking_cycle(
    p: &HsParams,
    addr: SocketAddr,
    cfg: &Arc<ClientConfig>,
    buf: &mut [u8],
) -> Cycle {
    let t0 = Instant::now();
    let mut sock = match crate::net::connect(&addr, p.timeout) {
        Ok(s) => s,
        Err(e) => return Cycle::failed(Failure::from_connect(e)),
    };
    let mut conn = match ClientConnection::new(cfg.clone(), p.server_name.clone()) {
        Ok(c) => c,
        Err(e) => return Cycle::failed(Failure::Handshake(e)),
    };
    if let Err(e) = blocking_handshake(&mut conn, &mut sock) {
        return Cycle::failed(Failure::from_io(e, true));
    }
    let hs_time = t0.elapsed();
    let mut cycle = Cycle {
        handshake: Some((conn.handshake_kind(), Negotiated::of(&conn), hs_time)),
        ..Cycle::default()
    };
    if hs_time > p.timeout {
        cycle.failure = Some(Failure::Timeout);
        return cycle;
    }
    let mut peer_closed = false;
    if let Some(req) = &p.request {
        match blocking_request(&mut conn, &mut sock, req, buf) {
            Ok(body) => {
                cycle.response = Some((t0.elapsed(), body));
                peer_closed = true;
            }
            Err(f) => {
                cycle.failure = Some(f);
                return cycle;
            }
        }
    }
    if let Err(e) = blocking_close(&mut conn, &mut sock, buf, peer_closed) {
        cycle.failure = Some(Failure::from_io(e, false));
    } else if t0.elapsed() > p.timeout {
        cycle.failure = Some(Failure::Timeout);
    }
    cycle
}

/// Drives the handshake until the client has the server's last flight, leaving the client's
/// own last flight (Finished) queued: it leaves with the request or the close_notify that
/// follows, in one segment, as an efficient client's would. Costs the server one wakeup and
/// one read less per connection than a Finished sent on its own.
fn blocking_handshake(conn: &mut ClientConnection, sock: &mut TcpStream) -> io::Result<()> {
    while conn.is_handshaking() {
        if conn.wants_write() {
            conn.write_tls(sock)?;
            continue;
        }
        if conn.read_tls(sock)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if let Err(e) = conn.process_new_packets() {
            // Best effort: let the server see the alert rustls queued.
            let _ = conn.write_tls(sock);
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
    }
    Ok(())
}

/// Writes everything rustls has queued in one send, with MSG_MORE, then shuts down the write
/// side: the kernel attaches the FIN to that segment instead of sending it on its own.
fn send_with_fin(conn: &mut ClientConnection, sock: &TcpStream) -> io::Result<()> {
    let out = drain_tls(conn)?;
    let s = socket2::SockRef::from(sock);
    let mut pos = 0;
    while pos < out.len() {
        match s.send_with_flags(&out[pos..], libc::MSG_MORE) {
            Ok(n) => pos += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    sock.shutdown(Shutdown::Write)
}

/// Everything rustls has queued for the socket, in order.
fn drain_tls(conn: &mut ClientConnection) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(512);
    while conn.wants_write() {
        conn.write_tls(&mut out)?;
    }
    Ok(out)
}

/// Sends the request and reads the whole response (until close_notify or
/// EOF). Returns the number of body bytes.
fn blocking_request(
    conn: &mut ClientConnection,
    sock: &mut TcpStream,
    req: &[u8],
    buf: &mut [u8],
) -> Result<u64, Failure> {
    // The request shares a write (and a segment) with the queued Finished.
    let out = conn
        .writer()
        .write_all(req)
        .and_then(|_| drain_tls(conn))
        .map_err(|e| Failure::from_io(e, false))?;
    sock.write_all(&out)
        .map_err(|e| Failure::from_io(e, false))?;
    let mut s = rustls::Stream::new(conn, sock);
    let (head, filled) = read_head(&mut s, buf)?;
    let mut body = (filled - head.len) as u64;
    loop {
        match s.read(buf) {
            Ok(0) => break,
            Ok(n) => body += n as u64,
            // Closed without close_notify after the response: fine here.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(Failure::from_io(e, false)),
        }
    }
    if !(200..300).contains(&head.status) {
        return Err(Failure::BadStatus(head.status));
    }
    Ok(body)
}

/// Sends close_notify and a FIN (with the Finished if still queued, in one segment), then
/// reads until the server closes too. Reading to the end consumes TLS 1.3 NewSessionTicket
/// messages (needed for `--resume psk`) and avoids the RST a close with unread data would
/// cause.
fn blocking_close(
    conn: &mut ClientConnection,
    sock: &mut TcpStream,
    buf: &mut [u8],
    peer_closed: bool,
) -> io::Result<()> {
    conn.send_close_notify();
    if peer_closed {
        // The server is gone after its Connection: close response; the alert is a courtesy.
        while conn.wants_write() {
            if conn.write_tls(sock).is_err() {
                break;
            }
        }
        return Ok(());
    }
    send_with_fin(conn, sock)?;
    loop {
        match conn.read_tls(sock) {
            Ok(0) => return Ok(()),
            Ok(_) => {
                if conn.process_new_packets().is_err() {
                    return Ok(()); // the handshake succeeded; ignore late junk
                }
                while let Ok(n) = conn.reader().read(buf) {
                    if n == 0 {
                        break;
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

// ---------------------------------------------------------------- tokio

pub(crate) async fn tokio_loop(
    p: Arc<HsParams>,
    ctl: Arc<Control>,
    cfg: Arc<ClientConfig>,
) -> Stats {
    let mut st = Stats::default();
    let mut buf = vec![0u8; if p.request.is_some() { 64 * 1024 } else { 4096 }];
    let mut net = vec![0u8; NET_READ];
    let mut turn = 0usize;
    while let Some(measured) = ctl.next() {
        let mut c = Cycle::default();
        let t0 = Instant::now();
        let addr = p.addrs[turn % p.addrs.len()];
        turn = turn.wrapping_add(1);
        let cycle = tokio_cycle(&p, addr, &cfg, &mut buf, &mut net, t0, &mut c);
        if tokio::time::timeout(p.timeout, cycle).await.is_err() {
            c.failure = Some(Failure::Timeout);
        }
        if measured {
            c.record(&mut st, &ctl);
        }
    }
    st
}

/// Socket reads of the tokio engine. Reads happen only once rustls has handed out all the
/// plaintext it holds, so what one read decrypts to always fits rustls' plaintext buffer.
const NET_READ: usize = 16 * 1024;

/// A rustls client on a tokio socket, driven by hand (not tokio-rustls) so that, as in the
/// blocking engine, the client's last handshake flight waits for the request or close_notify
/// and leaves in the same segment.
struct AsyncClient {
    conn: ClientConnection,
    tcp: tokio::net::TcpStream,
}

impl AsyncClient {
    async fn handshake(&mut self, net: &mut [u8]) -> io::Result<()> {
        while self.conn.is_handshaking() {
            if self.conn.wants_write() {
                self.flush().await?;
            } else if !self.fill(net).await? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(())
    }

    /// Writes everything rustls has queued, in one write.
    async fn flush(&mut self) -> io::Result<()> {
        let out = drain_tls(&mut self.conn)?;
        self.tcp.write_all(&out).await
    }

    /// Reads once from the socket and lets rustls process it. `false` at TCP EOF (rustls is
    /// told, so a later plaintext read reports a missing close_notify).
    async fn fill(&mut self, net: &mut [u8]) -> io::Result<bool> {
        let n = self.tcp.read(net).await?;
        let mut rd = &net[..n];
        loop {
            self.conn.read_tls(&mut rd)?;
            self.conn
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if rd.is_empty() {
                return Ok(n > 0);
            }
        }
    }

    /// Application data; 0 after close_notify, `UnexpectedEof` at EOF without it.
    async fn read(&mut self, out: &mut [u8], net: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.conn.reader().read(out) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            self.fill(net).await?;
        }
    }

    /// close_notify and FIN in one segment (with the Finished if still queued).
    async fn close_write(&mut self) -> io::Result<()> {
        self.conn.send_close_notify();
        let out = drain_tls(&mut self.conn)?;
        let mut pos = 0;
        while pos < out.len() {
            self.tcp.writable().await?;
            let sock = &self.tcp;
            match sock.try_io(tokio::io::Interest::WRITABLE, || {
                socket2::SockRef::from(sock).send_with_flags(&out[pos..], libc::MSG_MORE)
            }) {
                Ok(n) => pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        socket2::SockRef::from(&self.tcp).shutdown(Shutdown::Write)
    }
}

async fn tokio_cycle(
    p: &HsParams,
    addr: SocketAddr,
    cfg: &Arc<ClientConfig>,
    buf: &mut [u8],
    net: &mut [u8],
    t0: Instant,
    c: &mut Cycle,
) {
    let tcp = match tokio::net::TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => return c.failure = Some(Failure::from_connect(e)),
    };
    let _ = tcp.set_nodelay(true);
    let conn = match ClientConnection::new(cfg.clone(), p.server_name.clone()) {
        Ok(conn) => conn,
        Err(e) => return c.failure = Some(Failure::Handshake(e)),
    };
    let mut tls = AsyncClient { conn, tcp };
    if let Err(e) = tls.handshake(net).await {
        return c.failure = Some(Failure::from_io(e, true));
    }
    c.handshake = Some((
        tls.conn.handshake_kind(),
        Negotiated::of(&tls.conn),
        t0.elapsed(),
    ));
    if let Some(req) = &p.request {
        match tokio_request(&mut tls, req, buf, net).await {
            Ok(body) => c.response = Some((t0.elapsed(), body)),
            Err(f) => c.failure = Some(f),
        }
        // The server is gone after its Connection: close response; the alert is a courtesy.
        let _ = tls.close_write().await;
        return;
    }
    // close_notify + FIN, then read until the server closes (see blocking_close).
    if let Err(e) = tls.close_write().await {
        return c.failure = Some(Failure::from_io(e, false));
    }
    loop {
        match tls.read(buf, net).await {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                ) =>
            {
                return
            }
            Err(e) => return c.failure = Some(Failure::from_io(e, false)),
        }
    }
}

async fn tokio_request(
    tls: &mut AsyncClient,
    req: &[u8],
    buf: &mut [u8],
    net: &mut [u8],
) -> Result<u64, Failure> {
    // The request shares a write (and a segment) with the queued Finished.
    tls.conn
        .writer()
        .write_all(req)
        .map_err(|e| Failure::from_io(e, false))?;
    tls.flush().await.map_err(|e| Failure::from_io(e, false))?;
    let mut filled = 0;
    let head = loop {
        let limit = buf.len().min(MAX_HEAD);
        if filled == limit {
            return Err(Failure::BadResponse("response head too large"));
        }
        match tls.read(&mut buf[filled..limit], net).await {
            Ok(0) => return Err(Failure::BadResponse("closed before the response head")),
            Ok(n) => filled += n,
            Err(e) => return Err(Failure::from_io(e, false)),
        }
        if let Some(h) = parse_head(&buf[..filled])? {
            break h;
        }
    };
    let mut body = (filled - head.len) as u64;
    loop {
        match tls.read(buf, net).await {
            Ok(0) => break,
            Ok(n) => body += n as u64,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(Failure::from_io(e, false)),
        }
    }
    if !(200..300).contains(&head.status) {
        return Err(Failure::BadStatus(head.status));
    }
    Ok(body)
}
