//! `bench handshake`: connect, handshake, optional request, close; repeat.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::{ClientConfig, ClientConnection, HandshakeKind};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::engine::Control;
use crate::http::parse_head;
use crate::stats::{Failure, Negotiated, Stats};

/// Largest response head accepted.
const MAX_HEAD: usize = 16 * 1024;

pub(crate) struct HsParams {
    pub addr: SocketAddr,
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
    while let Some(measured) = ctl.next() {
        let c = blocking_cycle(p, &cfg, &mut buf);
        if measured {
            c.record(&mut st, ctl);
        }
    }
    st
}

fn blocking_cycle(p: &HsParams, cfg: &Arc<ClientConfig>, buf: &mut [u8]) -> Cycle {
    let t0 = Instant::now();
    let mut sock = match crate::net::connect(&p.addr, p.timeout) {
        Ok(s) => s,
        Err(e) => return Cycle::failed(Failure::from_connect(e)),
    };
    let mut conn = match ClientConnection::new(cfg.clone(), p.server_name.clone()) {
        Ok(c) => c,
        Err(e) => return Cycle::failed(Failure::Handshake(e)),
    };
    while conn.is_handshaking() {
        if let Err(e) = conn.complete_io(&mut sock) {
            return Cycle::failed(Failure::from_io(e, true));
        }
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

/// Sends the request and reads the whole response (until close_notify or
/// EOF). Returns the number of body bytes.
fn blocking_request(
    conn: &mut ClientConnection,
    sock: &mut TcpStream,
    req: &[u8],
    buf: &mut [u8],
) -> Result<u64, Failure> {
    let mut s = rustls::Stream::new(conn, sock);
    s.write_all(req).map_err(|e| Failure::from_io(e, false))?;
    let mut filled = 0;
    let head = loop {
        let limit = buf.len().min(MAX_HEAD);
        if filled == limit {
            return Err(Failure::BadResponse("response head too large"));
        }
        match s.read(&mut buf[filled..limit]) {
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

/// Sends close_notify and a FIN, then reads until the server closes too.
/// Reading to the end consumes TLS 1.3 NewSessionTicket messages (needed for
/// `--resume psk`) and avoids the RST a close with unread data would cause.
fn blocking_close(
    conn: &mut ClientConnection,
    sock: &mut TcpStream,
    buf: &mut [u8],
    peer_closed: bool,
) -> io::Result<()> {
    conn.send_close_notify();
    while conn.wants_write() {
        if let Err(e) = conn.write_tls(sock) {
            // The server may already be gone after a Connection: close response.
            return if peer_closed { Ok(()) } else { Err(e) };
        }
    }
    if peer_closed {
        return Ok(());
    }
    let _ = sock.shutdown(Shutdown::Write);
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
    let connector = tokio_rustls::TlsConnector::from(cfg);
    let mut st = Stats::default();
    let mut buf = vec![0u8; if p.request.is_some() { 64 * 1024 } else { 4096 }];
    while let Some(measured) = ctl.next() {
        let mut c = Cycle::default();
        let t0 = Instant::now();
        if tokio::time::timeout(p.timeout, tokio_cycle(&p, &connector, &mut buf, t0, &mut c))
            .await
            .is_err()
        {
            c.failure = Some(Failure::Timeout);
        }
        if measured {
            c.record(&mut st, &ctl);
        }
    }
    st
}

async fn tokio_cycle(
    p: &HsParams,
    connector: &tokio_rustls::TlsConnector,
    buf: &mut [u8],
    t0: Instant,
    c: &mut Cycle,
) {
    let tcp = match tokio::net::TcpStream::connect(p.addr).await {
        Ok(s) => s,
        Err(e) => return c.failure = Some(Failure::from_connect(e)),
    };
    let _ = tcp.set_nodelay(true);
    let mut tls = match connector.connect(p.server_name.clone(), tcp).await {
        Ok(t) => t,
        Err(e) => return c.failure = Some(Failure::from_io(e, true)),
    };
    {
        let conn = tls.get_ref().1;
        c.handshake = Some((conn.handshake_kind(), Negotiated::of(conn), t0.elapsed()));
    }
    let mut peer_closed = false;
    if let Some(req) = &p.request {
        match tokio_request(&mut tls, req, buf).await {
            Ok(body) => {
                c.response = Some((t0.elapsed(), body));
                peer_closed = true;
            }
            Err(f) => return c.failure = Some(f),
        }
    }
    // close_notify + FIN, then read until the server closes (see blocking_close).
    if let Err(e) = tls.shutdown().await {
        if !peer_closed {
            c.failure = Some(Failure::from_io(e, false));
        }
        return;
    }
    if peer_closed {
        return;
    }
    loop {
        match tls.read(buf).await {
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

async fn tokio_request<S>(tls: &mut S, req: &[u8], buf: &mut [u8]) -> Result<u64, Failure>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    tls.write_all(req)
        .await
        .map_err(|e| Failure::from_io(e, false))?;
    tls.flush().await.map_err(|e| Failure::from_io(e, false))?;
    let mut filled = 0;
    let head = loop {
        let limit = buf.len().min(MAX_HEAD);
        if filled == limit {
            return Err(Failure::BadResponse("response head too large"));
        }
        match tls.read(&mut buf[filled..limit]).await {
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
        match tls.read(buf).await {
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
