//! `TlsStream`: one type for the application whichever plane carries the records.

use std::fs::File;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use rustls::server::UnbufferedServerConnection;
use rustls::{HandshakeKind, ProtocolVersion};
use tokio::net::TcpStream;

use crate::buf::Pending;
use crate::config::{Acceptor, DataPlanePolicy};
use crate::handshake::{self, Incoming};
use crate::hello::HelloInfo;
use crate::linger::{self, Linger};
pub use crate::plane::kernel::Spliced;
use crate::plane::kernel::{HandedKeys, KernelPlane};
use crate::plane::user::UserPlane;
use crate::plane::{confidentiality_limit, kernel_suite, FallbackReason, PlaneKind};
use crate::sites::UnknownName;
use crate::stats::{add, bump, global};
use crate::tickets::TicketIssuer;
use crate::Error;

/// What was negotiated, and which plane the connection got.
#[derive(Clone, Debug)]
pub struct ConnectionInfo {
    pub version: ProtocolVersion,
    pub suite: rustls::CipherSuite,
    pub resumed: bool,
    pub alpn: Option<Vec<u8>>,
    pub plane: PlaneKind,
    /// Set when the connection is on the user plane for a reason other than being asked to.
    pub fallback: Option<FallbackReason>,
    pub handshake_time: std::time::Duration,
    /// When the handshake began (the connection was handed to the acceptor): the start of
    /// what a new client waits for.
    pub accepted_at: Instant,
    /// The site the connection is for (its number in `ServerOptions::sites`), chosen by its
    /// server name.
    pub site: usize,
    /// The server name the client asked for (SNI), lowercased.
    pub server_name: Option<Box<str>>,
}

enum Plane {
    Kernel(Box<KernelPlane>),
    User(Box<UserPlane>),
}

/// A server-side TLS connection after its handshake.
pub struct TlsStream {
    sock: TcpStream,
    plane: Plane,
    /// Counts it in `stats::open_by_plane` while it lives.
    _open: crate::stats::OpenGuard,
    info: ConnectionInfo,
    /// For reads into caller buffers too small to hold a control record (kernel plane).
    small: Pending,
    /// TLS 1.3, first read not done yet: see [`TlsStream::read`].
    ack_before_wait: bool,
    /// The client sent close_notify with (or right after) its Finished.
    peer_closed: bool,
    /// How [`TlsStream::close`] waits for the client's input.
    linger: Arc<Linger>,
    /// A read returned the end of the stream: nothing more will come.
    read_ended: bool,
    /// close_notify was sent and the write side shut down.
    write_shut: bool,
}

/// A connection's first bytes, read right after accept: when the ClientHello is already
/// there (it usually is, it comes right behind the TCP handshake), this read replaces both the
/// look at whether the client spoke and the handshake's first wait for readiness (an
/// `epoll_wait` and a read each).
pub struct Received(Incoming);

impl Received {
    /// One non-blocking read on an accepted, non-blocking socket. `Ok(None)`: nothing has
    /// arrived yet. A connection that has ended gives an empty `Received` (its handshake then
    /// reports the end).
    pub fn read(tcp: &std::net::TcpStream) -> io::Result<Option<Received>> {
        Ok(Incoming::read_first(tcp)?.map(Received))
    }
}

impl Acceptor {
    /// Runs the TLS handshake on an accepted TCP connection and sets up its data plane.
    ///
    /// Time limits are the caller's (wrap in `tokio::time::timeout`); on a peer error an alert
    /// has been sent where TLS allows it.
    pub async fn accept(&self, sock: TcpStream) -> Result<TlsStream, Error> {
        self.accept_with(sock, &mut |_| true).await
    }

    /// As [`Acceptor::accept`], with an admission check: once the whole ClientHello is in,
    /// and before rustls spends any crypto on it, `admit` sees what it offers (size, a
    /// resumable ticket of ours) and may refuse it (the connection is then reset and
    /// [`Error::Refused`] returned). Not called for input that is no ClientHello.
    pub async fn accept_with(
        &self,
        sock: TcpStream,
        admit: &mut (dyn FnMut(&HelloInfo) -> bool + Send),
    ) -> Result<TlsStream, Error> {
        self.accept_received(sock, None, admit).await
    }

    /// As [`Acceptor::accept_with`], for a connection whose first bytes were read already.
    pub async fn accept_received(
        &self,
        sock: TcpStream,
        received: Option<Received>,
        admit: &mut (dyn FnMut(&HelloInfo) -> bool + Send),
    ) -> Result<TlsStream, Error> {
        let started = Instant::now();
        let mut incoming = received.map_or_else(Incoming::new, |r| r.0);
        let gate = handshake::Gate {
            plain_http_response: self.plain_http_response.as_deref(),
            max_client_hello: self.max_client_hello,
            max_client_hello_records: self.max_client_hello_records,
            max_psk_identities: self.max_psk_identities,
            ticketer: (self.ticketer.as_ref(), self.ticket_ring.as_deref()),
            admit,
        };
        let failed = |e: Error| {
            if !matches!(e, Error::Refused) {
                bump(&global().handshake_failures);
                if e.is_peer_fault() {
                    bump(&global().handshake_peer_errors);
                }
            }
            e
        };
        let hello = match handshake::receive_hello(&sock, &mut incoming, gate).await {
            Ok(h) => h,
            Err(e) => return Err(self.close_refused(&sock, failed(e)).await),
        };
        let issuer = hello.as_ref().and_then(|h| h.ticket_issuer);
        let (site, server_name) = match hello {
            // Not a ClientHello: any site's rustls refuses it as well.
            None => (Some(self.names.default_site().unwrap_or(0)), None),
            Some(h) => match h.server_name {
                Some(name) => (self.names.lookup(&name), Some(name.into_boxed_str())),
                None => (self.names.default_site(), None),
            },
        };
        let site = match site {
            Some(s) => s,
            None => {
                bump(&global().unknown_server_names);
                match self.unknown_name {
                    UnknownName::Alert => {
                        handshake::plaintext_alert(&sock, handshake::ALERT_UNRECOGNIZED_NAME).await
                    }
                    UnknownName::Reset => {
                        handshake::reset_on_close(&sock);
                        return Err(failed(Error::UnknownServerName(
                            server_name.map(String::from),
                        )));
                    }
                }
                let e = failed(Error::UnknownServerName(server_name.map(String::from)));
                return Err(self.close_refused(&sock, e).await);
            }
        };
        // Only now, with a whole ClientHello admitted, does the connection cost a rustls state.
        let mut conn = UnbufferedServerConnection::new(self.sites[site].clone())?;
        // Exact reads only matter where the kernel may take the socket.
        let exact =
            self.exact_handshake_reads && self.policy != DataPlanePolicy::User && self.kernel.ulp;
        let driven = match handshake::drive(&mut conn, &sock, &mut incoming, exact).await {
            Ok(d) => d,
            Err(e) => return Err(self.close_refused(&sock, failed(e)).await),
        };
        bump(&global().handshakes);
        let resumed = conn.handshake_kind() == Some(HandshakeKind::Resumed);
        if resumed {
            bump(&global().handshakes_resumed);
            match issuer {
                Some(TicketIssuer::Here) => bump(&global().handshakes_resumed_local),
                Some(TicketIssuer::Elsewhere) => bump(&global().handshakes_resumed_remote),
                None => {}
            }
        }
        let version = conn
            .protocol_version()
            .unwrap_or(ProtocolVersion::Unknown(0));
        let suite = conn
            .negotiated_cipher_suite()
            .ok_or(Error::Protocol(rustls::Error::HandshakeNotComplete))?;
        let mut info = ConnectionInfo {
            version,
            suite: suite.suite(),
            resumed,
            alpn: conn.alpn_protocol().map(|p| p.to_vec()),
            plane: PlaneKind::User,
            fallback: None,
            handshake_time: std::time::Duration::ZERO,
            accepted_at: started,
            site,
            server_name,
        };

        let kernel = kernel_suite(version, suite);
        let mut deferred = driven.unsent;
        if driven.peer_closed {
            bump(&global().close_notify_received);
        }
        let mut fallback = if self.policy == DataPlanePolicy::User {
            Some(FallbackReason::Policy)
        } else if !self.kernel.ulp {
            Some(FallbackReason::NoUlp)
        } else if !kernel.is_some_and(|(v, c)| self.kernel.supports(v, c)) {
            Some(FallbackReason::Suite)
        } else {
            None
        };
        let mut settled = handshake::Settled {
            plain: Vec::new(),
            peer_closed: driven.peer_closed,
        };
        if fallback.is_none() && !driven.peer_closed {
            settled = match handshake::settle(&mut conn, &sock, &mut incoming, &mut deferred).await
            {
                Ok(s) => s,
                Err(e) => return Err(self.close_refused(&sock, e).await),
            };
            if incoming.used > 0 {
                fallback = Some(FallbackReason::Buffered);
            } else if let Err(e) = tlsplane_sys::attach_tls_ulp(std::os::fd::AsFd::as_fd(&sock)) {
                tracing::debug!(error = %e, "TCP_ULP tls failed on this socket");
                fallback = Some(FallbackReason::UlpAttach);
            }
        }

        let plane = match (fallback, kernel) {
            (None, Some((v, _))) => {
                let limit = self
                    .aead_record_limit
                    .unwrap_or_else(|| confidentiality_limit(suite));
                if !deferred.is_empty() {
                    // Records rustls encrypted itself must precede anything the kernel sends.
                    handshake::write_all(&sock, deferred.filled()).await?;
                }
                let rekey = crate::plane::kernel::Rekey {
                    supported: self.kernel.tls13_rekey,
                    key_updates_per_second: self.key_updates_per_second,
                };
                match KernelPlane::install(conn, &sock, v, limit, rekey, settled) {
                    Ok(k) => {
                        bump(&global().plane_kernel);
                        info.plane = PlaneKind::Kernel;
                        Plane::Kernel(Box::new(k))
                    }
                    Err(e) => {
                        bump(&global().kernel_setup_failures);
                        tracing::warn!(error = %e, "handing keys to the kernel failed; connection closed");
                        return Err(e);
                    }
                }
            }
            (reason, _) => {
                let reason = reason.unwrap_or(FallbackReason::Suite);
                if self.policy == DataPlanePolicy::Kernel {
                    bump(&global().kernel_required_refused);
                    let mut user = UserPlane::new(conn, incoming, deferred, settled);
                    if user.shutdown(&sock).await.is_ok() {
                        linger::close_plain(&sock, &self.linger).await;
                    }
                    return Err(Error::KernelRequired(reason.as_str()));
                }
                match reason {
                    FallbackReason::Policy => bump(&global().fallback_policy),
                    FallbackReason::NoUlp => bump(&global().fallback_no_ulp),
                    FallbackReason::Suite => bump(&global().fallback_suite),
                    FallbackReason::UlpAttach => bump(&global().fallback_ulp_attach),
                    FallbackReason::Buffered => bump(&global().fallback_buffered),
                }
                bump(&global().plane_user);
                if reason != FallbackReason::Policy {
                    info.fallback = Some(reason);
                }
                Plane::User(Box::new(UserPlane::new(conn, incoming, deferred, settled)))
            }
        };
        info.handshake_time = started.elapsed();
        tracing::debug!(plane = ?info.plane, fallback = ?info.fallback, version = ?info.version, suite = ?info.suite, resumed, "handshake complete");
        Ok(TlsStream {
            sock,
            plane,
            _open: crate::stats::OpenGuard::new(info.plane),
            ack_before_wait: version == ProtocolVersion::TLSv1_3 && !driven.peer_closed,
            peer_closed: driven.peer_closed,
            info,
            small: Pending::default(),
            linger: self.linger.clone(),
            read_ended: false,
            write_shut: false,
        })
    }

    /// Before a refused handshake's socket is dropped: when the client was told why (an
    /// alert, the plain-HTTP answer), a lingering close, so that its unread input does not
    /// make the kernel reset the connection before the client reads the reason. Returns `e`.
    async fn close_refused(&self, sock: &TcpStream, e: Error) -> Error {
        let told = matches!(
            e,
            Error::Protocol(_)
                | Error::PlainHttp
                | Error::ClientHelloTooLarge(_)
                | Error::ClientHelloTooManyRecords(_)
                | Error::ClientHelloTooManyPskIdentities(_)
                | Error::UnknownServerName(_)
        );
        if told {
            linger::close_plain(sock, &self.linger).await;
        }
        e
    }
}

/// A kernel-plane connection given up for hand-off ([`TlsStream::into_kernel_handoff`]).
pub struct KernelHandoff {
    /// The kTLS socket, non-blocking, on no event loop. The program gets a duplicate; this
    /// one is for re-keying and close_notify on its behalf.
    pub socket: std::net::TcpStream,
    pub keys: HandedKeys,
    pub info: ConnectionInfo,
}

/// A [`TlsStream`] taken off its tokio runtime (see [`TlsStream::detach`]), to be carried to
/// another thread and resumed there with [`DetachedTlsStream::attach`].
pub struct DetachedTlsStream {
    sock: std::net::TcpStream,
    plane: Plane,
    _open: crate::stats::OpenGuard,
    info: ConnectionInfo,
    small: Pending,
    ack_before_wait: bool,
    peer_closed: bool,
    linger: Arc<Linger>,
    read_ended: bool,
    write_shut: bool,
}

impl DetachedTlsStream {
    pub fn info(&self) -> &ConnectionInfo {
        &self.info
    }

    /// Registers the socket with the current thread's tokio runtime (must be called inside
    /// one). Nothing was read or written while detached, so the TLS state is intact.
    pub fn attach(self) -> io::Result<TlsStream> {
        Ok(TlsStream {
            sock: TcpStream::from_std(self.sock)?,
            plane: self.plane,
            _open: self._open,
            info: self.info,
            small: self.small,
            ack_before_wait: self.ack_before_wait,
            peer_closed: self.peer_closed,
            linger: self.linger,
            read_ended: self.read_ended,
            write_shut: self.write_shut,
        })
    }
}

impl TlsStream {
    /// Takes the connection off this thread's runtime (its socket leaves the runtime's epoll
    /// set), so that another runtime can go on with it: handshakes and established
    /// connections can then be served by different event loops.
    pub fn detach(self) -> io::Result<DetachedTlsStream> {
        Ok(DetachedTlsStream {
            sock: self.sock.into_std()?,
            plane: self.plane,
            _open: self._open,
            info: self.info,
            small: self.small,
            ack_before_wait: self.ack_before_wait,
            peer_closed: self.peer_closed,
            linger: self.linger,
            read_ended: self.read_ended,
            write_shut: self.write_shut,
        })
    }

    pub fn info(&self) -> &ConnectionInfo {
        &self.info
    }

    /// Gives the connection up to be handed to another program as the kTLS socket itself:
    /// taken off the event loop (it stays non-blocking), with the keys that re-key it. Only a
    /// kernel-plane connection whose input is all still in the socket qualifies (see
    /// `ServerOptions::exact_handshake_reads`); any other comes back as `Err`, unchanged.
    /// `Ok(Err)`: taking the socket off its event loop failed and the connection is lost.
    pub fn into_kernel_handoff(self) -> Result<io::Result<KernelHandoff>, Box<TlsStream>> {
        let bare = self.small.is_empty()
            && !self.read_ended
            && !self.write_shut
            && !self.peer_closed
            && matches!(&self.plane, Plane::Kernel(k) if k.is_bare());
        if !bare {
            return Err(Box::new(self));
        }
        let TlsStream {
            sock,
            plane,
            _open,
            info,
            ..
        } = self;
        let keys = match plane {
            Plane::Kernel(k) => k.into_handed(),
            // Not reached: checked above.
            Plane::User(_) => return Ok(Err(io::Error::other("not a kernel-plane connection"))),
        };
        // Leaves the open-connection gauge: the connection is the program's now.
        drop(_open);
        // Deregistration fails only for a socket the loop does not know; tokio then closes it.
        Ok(sock
            .into_std()
            .map(|socket| KernelHandoff { socket, keys, info }))
    }

    /// Whether a read would return at once rather than wait for the peer: input buffered in
    /// the record layer, or bytes in the socket's receive queue. Costs at most one system
    /// call: on the user plane a non-blocking read into the record layer (which also finds
    /// the peer's end), on the kernel plane a `FIONREAD` (a peer's EOF alone does not count
    /// there: the read that finds it may as well come later).
    pub fn input_pending(&mut self) -> bool {
        let buffered = match &mut self.plane {
            Plane::User(u) => return u.input_ready(&self.sock),
            Plane::Kernel(k) => k.has_buffered_input() || !self.small.is_empty(),
        };
        if buffered {
            return true;
        }
        // An error is for the next read to report.
        tlsplane_sys::queued_bytes(std::os::fd::AsFd::as_fd(&self.sock)).map_or(true, |n| n > 0)
    }

    /// Waits until a read would not wait for the peer, holding no buffer meanwhile (a relay
    /// lends its buffers only to connections with bytes to move). It may return early on the
    /// kernel plane (readiness there is the socket's); the read that follows then waits.
    pub async fn readable(&mut self) -> io::Result<()> {
        loop {
            if self.input_pending() {
                return Ok(());
            }
            self.sock.readable().await?;
            if matches!(self.plane, Plane::Kernel(_)) {
                return Ok(());
            }
            // Readiness may be stale on the user plane: the read in `input_pending` finds
            // out, and clears it when nothing came.
        }
    }

    /// Waits until `deadline` at most for the client's next bytes (or its end), holding no
    /// buffer: true when a read would now not wait for the client. Unlike
    /// [`TlsStream::readable`], stale readiness on the kernel plane does not end the wait
    /// early (a non-blocking peek there finds out, and clears it). Cancel-safe: it only
    /// reads into the record layer, and waits for readiness.
    pub async fn input_by(&mut self, deadline: tokio::time::Instant) -> bool {
        loop {
            // Callers usually have just asked `input_pending`: the socket is read again only
            // once it is readable.
            let buffered = match &mut self.plane {
                Plane::User(u) => u.has_buffered_input(),
                Plane::Kernel(k) => k.has_buffered_input() || !self.small.is_empty(),
            };
            if buffered {
                return true;
            }
            self.ack_before_first_wait();
            let ready = match self.plane {
                Plane::User(_) => tokio::time::timeout_at(deadline, self.sock.readable()).await,
                // A peek is 0 at the client's end and an error at a control record (the read
                // that follows reports it): either way there is something to read.
                Plane::Kernel(_) => {
                    let mut one = [0u8; 1];
                    match tokio::time::timeout_at(deadline, self.sock.peek(&mut one)).await {
                        Ok(_) => return true,
                        Err(e) => Err(e),
                    }
                }
            };
            match ready {
                Err(_) => return false,
                // The next read reports the error.
                Ok(Err(_)) => return true,
                // User plane: the readiness may be stale; `input_pending` reads to find out
                // (and clears it when nothing came).
                Ok(Ok(())) => {
                    if self.input_pending() {
                        return true;
                    }
                }
            }
        }
    }

    /// The client closed (close_notify) with or right after its Finished: nothing more will
    /// come from it.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    pub fn plane(&self) -> PlaneKind {
        self.info.plane
    }

    /// The underlying TCP socket (for addresses and socket options; never read or write it).
    pub fn tcp(&self) -> &TcpStream {
        &self.sock
    }

    /// Reads decrypted application data. `Ok(0)` is the end of the stream: close_notify or, from
    /// an impolite peer, a bare TCP FIN.
    ///
    /// Cancel-safe: dropping the future before it completes loses no input (bytes are taken
    /// from the socket only in steps that finish within one poll) and leaves no reply half
    /// sent: one it had to send (a KeyUpdate answer, an alert) goes on, from where it
    /// stopped, with the next operation, never repeated.
    pub async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.read_acked(buf).await?;
        if n == 0 && !buf.is_empty() {
            self.read_ended = true;
        }
        add(
            match self.info.plane {
                PlaneKind::Kernel => &global().bytes_rx_kernel,
                PlaneKind::User => &global().bytes_rx_user,
            },
            n as u64,
        );
        Ok(n)
    }

    /// As in `read_acked`, for a wait that does not read: the client's Finished must not
    /// wait for a delayed ACK. Once, before the connection's first wait for the client.
    fn ack_before_first_wait(&mut self) {
        if std::mem::take(&mut self.ack_before_wait) {
            let _ = socket2::SockRef::from(&self.sock).set_quickack(true);
        }
    }

    async fn read_acked(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // A TLS 1.3 server sends nothing after the client's Finished (the session ticket waits
        // to ride with the first response), so nothing acknowledges that Finished but a delayed
        // ACK, and a client without TCP_NODELAY holds its request back until it comes (Nagle):
        // ~40 ms before every first response. When the request is not here yet, acknowledge at
        // once. A client that sent its request with the Finished costs nothing here.
        let ack = std::mem::take(&mut self.ack_before_wait);
        // One read future for both cases: it is the largest part of an idle connection's state.
        let mut read = std::pin::pin!(Self::read_inner(
            &self.sock,
            &mut self.plane,
            &mut self.small,
            buf
        ));
        if ack {
            let first =
                std::future::poll_fn(|cx| std::task::Poll::Ready(read.as_mut().poll(cx))).await;
            if let std::task::Poll::Ready(r) = first {
                return r;
            }
            if let Err(e) = socket2::SockRef::from(&self.sock).set_quickack(true) {
                tracing::debug!(error = %e, "TCP_QUICKACK failed");
            }
        }
        read.await
    }

    async fn read_inner(
        sock: &TcpStream,
        plane: &mut Plane,
        small: &mut Pending,
        buf: &mut [u8],
    ) -> io::Result<usize> {
        match plane {
            Plane::User(u) => u.read(sock, buf).await,
            Plane::Kernel(k) => {
                if buf.len() >= 64 && small.is_empty() {
                    return k.read(sock, buf).await;
                }
                if small.is_empty() {
                    let n = k.read(sock, small.space(16384)).await?;
                    small.filled(n);
                    if n == 0 {
                        return Ok(0);
                    }
                }
                Ok(small.take_into(buf))
            }
        }
    }

    /// Not cancel-safe: a cancelled write may have sent part of `data`; the connection can only
    /// be closed after that.
    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match &mut self.plane {
            Plane::User(u) => u.write_all(&self.sock, data).await?,
            Plane::Kernel(k) => k.write_all(&self.sock, data, false).await?,
        }
        self.count_tx(data.len() as u64);
        Ok(())
    }

    fn count_tx(&self, n: u64) {
        add(
            match self.info.plane {
                PlaneKind::Kernel => &global().bytes_tx_kernel,
                PlaneKind::User => &global().bytes_tx_user,
            },
            n,
        );
    }

    /// Sends `prefix` (e.g. response headers) and then `len` bytes of `file` from `offset`.
    /// Kernel plane: `sendfile(2)`, the bytes never enter this process; user plane: encrypted
    /// through one reused buffer.
    pub async fn write_file(
        &mut self,
        prefix: &[u8],
        file: &File,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        match &mut self.plane {
            Plane::User(u) => u.write_file(&self.sock, prefix, file, offset, len).await?,
            Plane::Kernel(k) => {
                if !prefix.is_empty() {
                    // MSG_MORE keeps the record open so the headers share it with the body.
                    k.write_all(&self.sock, prefix, len > 0).await?;
                }
                k.send_file(&self.sock, file, offset, len).await?
            }
        }
        self.count_tx(prefix.len() as u64 + len);
        Ok(())
    }

    /// Whether [`splice_out`](Self::splice_out) and [`splice_in`](Self::splice_in) move bytes
    /// without copying them here (the kernel plane); elsewhere they copy.
    pub fn can_splice(&self) -> bool {
        matches!(self.plane, Plane::Kernel(_))
    }

    /// Moves up to `max` bytes from the peer: on the kernel plane into the empty pipe `pipe`
    /// by `splice(2)` (decrypted by the kernel, never copied here), except around control
    /// records, which are handled as [`read`](Self::read) handles them and may leave data in
    /// `spill`; on the user plane always into `spill`. Cancel-safe as `read` is (a splice
    /// moves bytes within one poll).
    pub async fn splice_out(
        &mut self,
        pipe: std::os::fd::BorrowedFd<'_>,
        max: usize,
        spill: &mut [u8],
    ) -> io::Result<Spliced> {
        if tlsplane_sys::queued_bytes(std::os::fd::AsFd::as_fd(&self.sock)).unwrap_or(0) == 0 {
            self.ack_before_first_wait();
        }
        let kernel_ready = self.small.is_empty();
        let moved = match &mut self.plane {
            Plane::Kernel(k) if kernel_ready && spill.len() >= 64 => {
                k.splice_out(&self.sock, pipe, max, spill).await?
            }
            _ => match self.read(spill).await? {
                0 => Spliced::End,               // noted by read
                n => return Ok(Spliced::Buf(n)), // counted by read
            },
        };
        match moved {
            Spliced::Pipe(n) | Spliced::Buf(n) => add(&global().bytes_rx_kernel, n as u64),
            Spliced::End => self.read_ended = true,
        }
        Ok(moved)
    }

    /// Sends the `len` bytes waiting in `pipe`. Kernel plane: `splice(2)`, encrypted by the
    /// kernel; the user plane cannot (`Unsupported`: copy with [`write_all`](Self::write_all)).
    pub async fn splice_in(
        &mut self,
        pipe: std::os::fd::BorrowedFd<'_>,
        len: usize,
    ) -> io::Result<()> {
        match &mut self.plane {
            Plane::Kernel(k) => k.splice_in(&self.sock, pipe, len).await?,
            Plane::User(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "splice needs the kernel plane",
                ))
            }
        }
        self.count_tx(len as u64);
        Ok(())
    }

    /// Ends the connection the careful way (nginx's lingering close): close_notify and the
    /// write side's shutdown (unless [`shutdown`](Self::shutdown) did them already), then,
    /// unless the client's input has ended, reads and drops what the client still sends until
    /// it closes or a deadline passes (see [`crate::linger`]), holding no buffer meanwhile.
    /// When the client's input has ended already, the FIN is left to the descriptor's close:
    /// drop the stream right after.
    /// Dropping a socket with unread input instead makes the kernel reset the connection, and
    /// the reset destroys the response still queued. Nothing can be read or written after.
    ///
    /// A connection to be reset on purpose (`SO_LINGER` 0) must be dropped, not closed.
    pub async fn close(&mut self) -> io::Result<()> {
        let ended = |s: &Self| {
            s.read_ended
                || s.peer_closed
                || match &s.plane {
                    Plane::Kernel(k) => k.read_closed(),
                    Plane::User(u) => u.peer_closed(),
                }
        };
        if !self.write_shut {
            if ended(self) {
                // Nothing to linger for: the close of the descriptor (when the stream is
                // dropped) sends the FIN, with the close_notify still held back by MSG_MORE
                // if it can, one `shutdown(2)` fewer per connection.
                match &mut self.plane {
                    Plane::User(u) => u.close_notify(&self.sock).await?,
                    Plane::Kernel(k) => k.shutdown(&self.sock).await?,
                }
                self.write_shut = true;
            } else {
                self.shutdown().await?;
            }
        }
        if ended(self) {
            return Ok(());
        }
        self.small = Pending::default();
        let sock = &self.sock;
        match &mut self.plane {
            Plane::User(u) => {
                u.release_buffers();
                let mut recv =
                    |buf: &mut [u8]| io::Read::read(&mut &*socket2::SockRef::from(sock), buf);
                linger::discard_input(sock, &self.linger, true, &mut recv).await;
            }
            Plane::Kernel(k) => {
                let fd = std::os::fd::AsFd::as_fd(sock);
                let mut recv = |buf: &mut [u8]| k.discard_record(fd, buf);
                linger::discard_input(sock, &self.linger, false, &mut recv).await;
            }
        }
        self.read_ended = true;
        Ok(())
    }

    /// Declares that what is written from now on is the last this connection sends before
    /// [`shutdown`](Self::shutdown) (a `Connection: close` response, an error page). On the
    /// user plane those writes reach TCP with `MSG_MORE`, so the end of the response, the
    /// close_notify and the FIN share one segment instead of taking three. Call `shutdown`
    /// right after the last write: until then the kernel may hold the tail back (at most
    /// 200 ms). No effect on the kernel plane, where kTLS would keep a record open.
    pub fn final_writes(&mut self) {
        if let Plane::User(u) = &mut self.plane {
            u.final_writes();
        }
    }

    /// Sends close_notify and shuts down the write side of TCP: a half-close, reading may go
    /// on. To end the connection, [`close`](Self::close).
    pub async fn shutdown(&mut self) -> io::Result<()> {
        if self.write_shut {
            return Ok(());
        }
        match &mut self.plane {
            Plane::User(u) => u.shutdown(&self.sock).await?,
            Plane::Kernel(k) => k.shutdown(&self.sock).await?,
        }
        self.write_shut = true;
        Ok(())
    }
}
