//! Drives rustls' unbuffered server connection through the handshake.
//!
//! Reads are greedy (one `read` per flight). A client usually sends its first request in the
//! same segment as its Finished, so when the handshake completes our buffer may already hold
//! records that follow it, the last one possibly cut short. Before the kernel takes the
//! connection, [`settle`] reads exactly the rest of that last record (never beyond), lets
//! rustls decrypt everything buffered, and keeps the plaintext for the application: the socket
//! then sits on a record boundary and the sequence number rustls hands over counts every record
//! it decrypted. (An earlier version read record by record during the handshake; that was
//! byte-exact too, but cost four extra `read` calls per handshake.)

use std::io;

use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use tokio::net::TcpStream;

use crate::buf::OutBuf;
use crate::hello::{self, HelloInfo, Peek};
use crate::stats::{bump, global};
use crate::Error;

/// TLS record header length.
pub(crate) const HEADER_LEN: usize = 5;
/// Largest record a peer may send (RFC 8446: 2^14 + 256 of ciphertext expansion; TLS 1.2 allows
/// 2^14 + 2048). Anything claiming more is rejected by rustls before we read it.
pub(crate) const MAX_RECORD_LEN: usize = HEADER_LEN + 16384 + 2048;

/// Bytes received from the peer that rustls has not consumed yet.
pub(crate) struct Incoming {
    pub(crate) buf: Vec<u8>,
    pub(crate) used: usize,
    /// An error a non-blocking read met (`try_read_more`), for the next read to report: the
    /// kernel reports a reset once.
    error: Option<io::Error>,
}

/// Input buffer size to start with: a ClientHello (~1.5 KB with a post-quantum key share) or
/// a request record fits.
const INCOMING_START: usize = 4096;

impl Incoming {
    pub(crate) fn new() -> Self {
        Self {
            buf: vec![0; INCOMING_START],
            used: 0,
            error: None,
        }
    }

    /// One non-blocking read of a connection's first bytes, on the socket as accepted (not yet
    /// registered with an event loop). `None`: nothing has arrived yet.
    pub(crate) fn read_first(tcp: &std::net::TcpStream) -> io::Result<Option<Self>> {
        use std::io::Read;
        let mut first = Self::new();
        match (&*tcp).read(&mut first.buf) {
            Ok(n) => {
                first.used = n;
                Ok(Some(first))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Frees the buffer while nothing is in it (an idle connection); [`Incoming::read_more`]
    /// allocates again once the peer sends.
    pub(crate) fn release(&mut self) {
        if self.used == 0 {
            self.buf = Vec::new();
        }
    }

    pub(crate) fn discard(&mut self, n: usize) {
        if n > 0 {
            self.buf.copy_within(n..self.used, 0);
            self.used -= n;
        }
    }

    /// Where the first incomplete record starts and how far the buffer must be filled to
    /// complete it (its header first, if even that is cut). When every buffered record is
    /// whole, the start is the end of the buffer.
    fn next_boundary(&self) -> (usize, usize) {
        let mut pos = 0;
        while pos + HEADER_LEN <= self.used {
            let len =
                HEADER_LEN + u16::from_be_bytes([self.buf[pos + 3], self.buf[pos + 4]]) as usize;
            if pos + len > self.used {
                return (pos, pos + len.min(MAX_RECORD_LEN));
            }
            pos += len;
        }
        (pos, pos + HEADER_LEN)
    }

    /// If the last buffered record is incomplete, reads exactly its missing bytes (header
    /// first), never beyond it. Returns false on EOF.
    async fn complete_last_record(&mut self, sock: &TcpStream) -> io::Result<bool> {
        loop {
            let (start, need) = self.next_boundary();
            if start == self.used || self.used >= need {
                return Ok(true);
            }
            if self.buf.len() < need {
                self.buf.resize(need, 0);
            }
            let n = read_some(sock, &mut self.buf[self.used..need]).await?;
            if n == 0 {
                return Ok(false);
            }
            self.used += n;
        }
    }

    /// Greedy read for the user plane, where nothing is handed to the kernel.
    /// One non-blocking read for the user plane, without waiting for readiness: what a
    /// `FIONREAD` would tell, with the bytes read as well. `None`: nothing has arrived;
    /// `Some(0)`: the end, or an error kept for `read_more` to report.
    pub(crate) fn try_read_more(&mut self, sock: &TcpStream) -> io::Result<Option<usize>> {
        use std::io::Read;
        if self.buf.is_empty() {
            self.buf = vec![0; INCOMING_START];
        }
        if self.buf.len() - self.used < 1024 {
            let grow = (self.buf.len() * 2).min(4 * MAX_RECORD_LEN);
            self.buf.resize(grow.max(self.used + 1024), 0);
        }
        // Past tokio's readiness: it may say "not ready" for bytes that arrived since the
        // event loop last looked.
        match (&*socket2::SockRef::from(sock)).read(&mut self.buf[self.used..]) {
            Ok(n) => {
                self.used += n;
                Ok(Some(n))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // And it may say "ready" from an event already consumed: clear that, so that
                // a wait that follows waits for the next arrival instead of returning at once.
                let _ = sock.try_io(tokio::io::Interest::READABLE, || {
                    Err::<(), _>(io::ErrorKind::WouldBlock.into())
                });
                self.release();
                Ok(None)
            }
            Err(e) => {
                self.error = Some(e);
                Ok(Some(0))
            }
        }
    }

    pub(crate) async fn read_more(&mut self, sock: &TcpStream) -> io::Result<usize> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if self.buf.is_empty() {
            // Released while idle: allocate only once there is something to read.
            sock.readable().await?;
            self.buf = vec![0; INCOMING_START];
        }
        // Grow in steps: a fresh 37 KB zero-filled buffer per connection showed up in
        // handshake profiles (memset and page faults) although a ClientHello fits in 4 KB.
        if self.buf.len() - self.used < 1024 {
            let grow = (self.buf.len() * 2).min(4 * MAX_RECORD_LEN);
            self.buf.resize(grow.max(self.used + 1024), 0);
        }
        read_some(sock, &mut self.buf[self.used..])
            .await
            .inspect(|&n| self.used += n)
    }
}

impl Incoming {
    /// Reads the client's records without going past the end of its handshake (see
    /// `ServerOptions::exact_handshake_reads`): peeks at what has arrived, then reads whole
    /// records up to the first that may end the handshake. TLS 1.3: up to and including the
    /// first encrypted record (type 23: the client's Finished, or a 0-RTT record rustls
    /// skips, after which the next read goes on); TLS 1.2: every record before the first of
    /// application data (type 23 comes only after the Finished there). A record cut short is
    /// read as far as it has arrived. Returns the bytes read; 0 at EOF.
    pub(crate) async fn read_handshake_records(
        &mut self,
        sock: &TcpStream,
        tls13: bool,
    ) -> io::Result<usize> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let want = self.used + MAX_RECORD_LEN;
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
        let peeked = sock.peek(&mut self.buf[self.used..want]).await?;
        if peeked == 0 {
            return Ok(0);
        }
        let end = exact_end(&self.buf[..self.used + peeked], self.used, tls13);
        let n = read_some(sock, &mut self.buf[self.used..end]).await?;
        self.used += n;
        Ok(n)
    }
}

/// Where an exact read of `buf` (`consumed` bytes already read, the rest peeked) stops: see
/// [`Incoming::read_handshake_records`]. Always past `consumed` when anything was peeked.
fn exact_end(buf: &[u8], consumed: usize, tls13: bool) -> usize {
    let mut pos = 0;
    while pos + HEADER_LEN <= buf.len() {
        let typ = buf[pos];
        if !tls13 && typ == 23 && pos >= consumed {
            // Application data before the handshake ended is rustls' to refuse: read it.
            return if pos > consumed { pos } else { buf.len() };
        }
        let end = pos + HEADER_LEN + u16::from_be_bytes([buf[pos + 3], buf[pos + 4]]) as usize;
        if end >= buf.len() {
            return buf.len();
        }
        pos = end;
        if tls13 && typ == 23 && pos > consumed {
            return pos;
        }
    }
    buf.len()
}

pub(crate) async fn read_some(sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        sock.readable().await?;
        match sock.try_read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

pub(crate) async fn write_all(sock: &TcpStream, buf: &[u8]) -> io::Result<()> {
    write_all_with(sock, buf, |b| socket2::SockRef::from(sock).send(b)).await
}

/// Writes all of `buf` with `send`, a non-blocking send on `sock` (plain, record-typed or
/// `MSG_MORE`), waiting for writability between partial sends.
pub(crate) async fn write_all_with(
    sock: &TcpStream,
    mut buf: &[u8],
    mut send: impl FnMut(&[u8]) -> io::Result<usize>,
) -> io::Result<()> {
    while !buf.is_empty() {
        match send_with(sock, || send(buf)).await? {
            0 => return Err(io::ErrorKind::WriteZero.into()),
            n => buf = &buf[n..],
        }
    }
    Ok(())
}

/// Runs `send`, a non-blocking send of some kind on `sock`, until it does not meet
/// WouldBlock, waiting for writability in between. The first try goes ahead without asking
/// tokio: a socket's send buffer usually has room, and a socket new to the event loop has no
/// readiness recorded until its first event, so asking first cost an `epoll_wait` per
/// connection for nothing.
pub(crate) async fn send_with<T>(
    sock: &TcpStream,
    mut send: impl FnMut() -> io::Result<T>,
) -> io::Result<T> {
    match send() {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        r => return counted(r),
    }
    loop {
        // Readiness recorded before the WouldBlock above may be stale: the try below then
        // meets WouldBlock again and clears it.
        sock.writable().await?;
        match sock.try_io(tokio::io::Interest::WRITABLE, &mut send) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => return counted(r),
        }
    }
}

/// ETIMEDOUT from a send: the kernel ended the connection because the peer took none of our
/// bytes for the send timeout (`TCP_USER_TIMEOUT`, set on the listening sockets).
fn counted<T>(r: io::Result<T>) -> io::Result<T> {
    if let Err(e) = &r {
        if e.kind() == io::ErrorKind::TimedOut {
            crate::stats::bump(&crate::stats::global().send_timeouts);
        }
    }
    r
}

/// Appends an encoded TLS message from rustls to `out`, growing it as rustls asks.
pub(crate) fn encode_into(
    state: &mut rustls::unbuffered::EncodeTlsData<'_, rustls::server::ServerConnectionData>,
    out: &mut OutBuf,
) -> Result<(), Error> {
    let mut want = 1024;
    loop {
        match state.encode(out.spare(want)) {
            Ok(n) => {
                out.commit(n);
                return Ok(());
            }
            Err(EncodeError::InsufficientSize(s)) => want = s.required_size,
            Err(e) => return Err(Error::Io(io::Error::other(e.to_string()))),
        }
    }
}

/// Sends whatever rustls queued after a failure (normally the alert telling the peer why), best
/// effort: the connection is ending anyway.
///
/// rustls must be handed the same buffer as before the failure (minus what it said to
/// discard): its handshake deframer may still point into it, and an empty slice made it index
/// out of bounds (a panic from nine bytes of input).
pub(crate) async fn flush_alert(
    conn: &mut UnbufferedServerConnection,
    sock: &TcpStream,
    incoming: &mut Incoming,
    failure: Option<(&rustls::Error, bool)>,
) {
    let mut out = OutBuf::new();
    // rustls hands out a queued alert before it looks at the input again, so one call gets
    // it. Never a second: rustls would re-read the bad input and fail again, and after a
    // record it decrypted (its sequence number moved on) that failure is a misleading
    // bad_record_mac.
    let UnbufferedStatus { discard, state } =
        conn.process_tls_records(&mut incoming.buf[..incoming.used]);
    match state {
        Ok(ConnectionState::EncodeTlsData(mut s)) => {
            let _ = encode_into(&mut s, &mut out);
        }
        Ok(ConnectionState::TransmitTlsData(t)) => t.done(),
        _ => {}
    }
    incoming.discard(discard);
    if let Some((e, true)) = failure {
        // The client has seen nothing from us: an alert rustls encrypted (its keys exist once
        // it built a TLS 1.3 flight) is noise to it. Keep rustls' alert only if it is plain.
        if out.filled().first() != Some(&21) {
            out.clear();
            if let Some(desc) = plaintext_alert_for(e) {
                // Fatal alert, TLS 1.2 record version as every ClientHello reply uses.
                out.spare(7)[..7].copy_from_slice(&[21, 3, 3, 0, 2, 2, desc]);
                out.commit(7);
            }
        }
    }
    if !out.is_empty() {
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            write_all(sock, out.filled()),
        )
        .await;
    }
}

/// Whether a connection's first bytes are an HTTP/1 request line rather than a TLS record: a
/// method token and a space. A TLS record starts with its content type (20..=24), never with
/// an uppercase letter, so this never misreads TLS.
fn is_plain_http(first: &[u8]) -> bool {
    const METHODS: [&[u8]; 9] = [
        b"GET ",
        b"HEAD ",
        b"POST ",
        b"PUT ",
        b"DELETE ",
        b"OPTIONS ",
        b"PATCH ",
        b"CONNECT ",
        b"TRACE ",
    ];
    first.first().is_some_and(u8::is_ascii_uppercase)
        && METHODS.iter().any(|m| first.starts_with(m))
}

/// Writes `resp` in the clear and ends the connection (FIN), best effort and bounded.
async fn answer_plain(sock: &TcpStream, resp: &[u8]) {
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), write_all(sock, resp)).await;
    let _ = socket2::SockRef::from(sock).shutdown(std::net::Shutdown::Write);
}

/// The alert for a failure rustls reported without queueing one itself, which it does for
/// some errors its deframer finds (a handshake message claiming more bytes than allowed,
/// records interleaved with a fragmented handshake message, empty-fragment floods): a
/// connection closed without a word looks like a network fault to the client. Only used
/// while nothing has been sent yet, when an alert is a plain 7-byte record (no keys exist, so
/// nothing here is cryptographic); later ones would need rustls' record layer.
fn plaintext_alert_for(e: &rustls::Error) -> Option<u8> {
    use rustls::Error as E;
    const UNEXPECTED_MESSAGE: u8 = 10;
    const RECORD_OVERFLOW: u8 = 22;
    const HANDSHAKE_FAILURE: u8 = 40;
    const DECODE_ERROR: u8 = 50;
    const INTERNAL_ERROR: u8 = 80;
    const NO_APPLICATION_PROTOCOL: u8 = 120;
    match e {
        E::InvalidMessage(_) => Some(DECODE_ERROR),
        E::PeerSentOversizedRecord => Some(RECORD_OVERFLOW),
        E::PeerMisbehaved(_) | E::InappropriateMessage { .. } => Some(UNEXPECTED_MESSAGE),
        E::InappropriateHandshakeMessage { .. } => Some(UNEXPECTED_MESSAGE),
        E::PeerIncompatible(_) => Some(HANDSHAKE_FAILURE),
        // TLS 1.3: rustls chooses the protocol after its ServerHello, so its alert is
        // encrypted under keys the client does not have yet (that ServerHello is not sent).
        E::NoApplicationProtocol => Some(NO_APPLICATION_PROTOCOL),
        // Our side failed, e.g. the key daemon did not sign: say so rather than vanish.
        E::General(_) => Some(INTERNAL_ERROR),
        _ => None,
    }
}

/// What decides, before any crypto, whether a connection's handshake goes ahead.
pub(crate) struct Gate<'a> {
    /// See `ServerOptions::plain_http_response`.
    pub(crate) plain_http_response: Option<&'a [u8]>,
    /// See `ServerOptions::max_client_hello`.
    pub(crate) max_client_hello: usize,
    /// See `ServerOptions::max_client_hello_records`.
    pub(crate) max_client_hello_records: usize,
    /// See `ServerOptions::max_psk_identities`.
    pub(crate) max_psk_identities: usize,
    pub(crate) ticketer: hello::Ticketer<'a>,
    /// The caller's admission decision on the ClientHello (true: go ahead).
    pub(crate) admit: &'a mut (dyn FnMut(&HelloInfo) -> bool + Send),
}

const ALERT_UNEXPECTED_MESSAGE: u8 = 10;
const ALERT_RECORD_OVERFLOW: u8 = 22;
const ALERT_ILLEGAL_PARAMETER: u8 = 47;
pub(crate) const ALERT_UNRECOGNIZED_NAME: u8 = 112;

/// The first step of a handshake, before rustls exists for the connection (a connection that
/// trickles or never completes its ClientHello costs only the input buffer): the first read,
/// the plain-HTTP answer, then [`admit_hello`]. (A deadline for the first byte is the
/// caller's: the runtime keeps silent connections in its lobby until then.)
pub(crate) async fn receive_hello(
    sock: &TcpStream,
    incoming: &mut Incoming,
    mut gate: Gate<'_>,
) -> Result<Option<HelloInfo>, Error> {
    // Usually read already, right after accept (see `Received`).
    if incoming.used == 0 && incoming.read_more(sock).await? == 0 {
        return Err(Error::PeerClosedInHandshake);
    }
    if let Some(resp) = gate.plain_http_response {
        if is_plain_http(&incoming.buf[..incoming.used]) {
            bump(&global().plain_http_requests);
            answer_plain(sock, resp).await;
            return Err(Error::PlainHttp);
        }
    }
    admit_hello(sock, incoming, &mut gate).await
}

/// Before rustls sees the connection's first bytes (so before its ECDHE and signature): reads
/// until the ClientHello is whole, refuses one over the size cap (from its header, without
/// reading the rest) and asks the caller whether to go ahead. Input that is no ClientHello is
/// left to rustls to reject (`None`).
async fn admit_hello(
    sock: &TcpStream,
    incoming: &mut Incoming,
    gate: &mut Gate<'_>,
) -> Result<Option<HelloInfo>, Error> {
    // Kept across reads: each read costs only what it brought.
    let mut reader = hello::HelloReader::default();
    loop {
        match reader.peek(
            &incoming.buf[..incoming.used],
            gate.max_client_hello,
            gate.max_client_hello_records,
            gate.ticketer,
        ) {
            Peek::More => {
                if incoming.read_more(sock).await? == 0 {
                    return Err(Error::PeerClosedInHandshake);
                }
            }
            Peek::TooLarge(len) => {
                plaintext_alert(sock, ALERT_ILLEGAL_PARAMETER).await;
                return Err(Error::ClientHelloTooLarge(len));
            }
            Peek::RecordOverflow(_) => {
                plaintext_alert(sock, ALERT_RECORD_OVERFLOW).await;
                return Err(Error::Protocol(rustls::Error::PeerSentOversizedRecord));
            }
            Peek::TooManyRecords(records) => {
                // As OpenSSL answers a flood of empty records.
                plaintext_alert(sock, ALERT_UNEXPECTED_MESSAGE).await;
                return Err(Error::ClientHelloTooManyRecords(records));
            }
            Peek::Hello(info) if info.psk_identities > gate.max_psk_identities => {
                plaintext_alert(sock, ALERT_ILLEGAL_PARAMETER).await;
                return Err(Error::ClientHelloTooManyPskIdentities(info.psk_identities));
            }
            Peek::Hello(info) => {
                if !(gate.admit)(&info) {
                    // Refused like a connection at accept: a reset, no TLS reply at all.
                    reset_on_close(sock);
                    return Err(Error::Refused);
                }
                return Ok(Some(info));
            }
            Peek::NotHello => return Ok(None),
        }
    }
}

/// A fatal alert in a plaintext record, for a ClientHello refused before rustls has seen it
/// (the client has no key yet). Bounded in time: the connection is closing anyway.
pub(crate) async fn plaintext_alert(sock: &TcpStream, description: u8) {
    let alert = [21, 3, 3, 0, 2, 2, description];
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), write_all(sock, &alert)).await;
}

/// Makes the coming close a reset (linger 0): no reply, no TIME_WAIT.
pub(crate) fn reset_on_close(sock: &TcpStream) {
    let _ = socket2::SockRef::from(sock).set_linger(Some(std::time::Duration::ZERO));
}

/// What [`drive`] leaves for the data plane.
pub(crate) struct Driven {
    /// TLS output not written yet (see [`drive`]).
    pub(crate) unsent: OutBuf,
    /// The client sent close_notify right after the handshake.
    pub(crate) peer_closed: bool,
}

/// Runs the handshake to completion. On return rustls has consumed every byte read.
///
/// What rustls produced after a TLS 1.3 handshake completed (session tickets) is returned
/// unsent: the client does not wait for it, so the user plane sends it with the first response
/// (or the close_notify) in one write instead of a write of its own; the kernel plane must
/// write it before it installs the keys.
pub(crate) async fn drive(
    conn: &mut UnbufferedServerConnection,
    sock: &TcpStream,
    incoming: &mut Incoming,
    exact: bool,
) -> Result<Driven, Error> {
    let mut out = OutBuf::new();
    let mut peer_closed = false;
    // Nothing written to the socket yet: the client has no key, so only a plaintext alert
    // means anything to it (whatever rustls had encoded for it is dropped with the failure).
    let mut silent = true;
    loop {
        let UnbufferedStatus { discard, state } =
            conn.process_tls_records(&mut incoming.buf[..incoming.used]);
        enum Next {
            Read,
            Flush,
            Done,
            Continue,
        }
        let next = match state {
            Err(e) => {
                incoming.discard(discard);
                if !silent && !out.is_empty() {
                    // Records rustls already encrypted (a session ticket) precede its alert in
                    // the key's sequence: the client cannot read the alert without them.
                    let _ = write_all(sock, out.filled()).await;
                }
                flush_alert(conn, sock, incoming, Some((&e, silent))).await;
                return Err(Error::Protocol(e));
            }
            Ok(ConnectionState::EncodeTlsData(mut s)) => {
                encode_into(&mut s, &mut out)?;
                Next::Continue
            }
            Ok(ConnectionState::TransmitTlsData(t)) => {
                // We own the bytes in `out` from here on and write them before reading again.
                t.done();
                // Once a TLS 1.3 handshake is complete, rustls only emits session tickets,
                // which the client does not wait for. A TLS 1.2 server's last flight carries
                // its Finished, which the client does wait for: always send that now.
                if conn.is_handshaking()
                    || conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3)
                {
                    Next::Flush
                } else {
                    Next::Continue
                }
            }
            Ok(ConnectionState::BlockedHandshake) => Next::Read,
            Ok(ConnectionState::WriteTraffic(_)) => {
                // A TLS 1.3 server may write after its own Finished, before the client's; the
                // handshake is done only when rustls says so.
                if conn.is_handshaking() {
                    Next::Read
                } else {
                    Next::Done
                }
            }
            Ok(ConnectionState::ReadTraffic(_)) => Next::Done,
            Ok(ConnectionState::PeerClosed) | Ok(ConnectionState::Closed) => {
                if conn.is_handshaking() {
                    incoming.discard(discard);
                    return Err(Error::PeerClosedInHandshake);
                }
                // A client that only wanted the handshake sends close_notify right after its
                // Finished, often in the same segment.
                peer_closed = true;
                Next::Done
            }
            Ok(_) => {
                incoming.discard(discard);
                return Err(Error::Io(io::Error::other(
                    "unexpected TLS state during handshake",
                )));
            }
        };
        incoming.discard(discard);
        match next {
            Next::Continue => {}
            Next::Flush => {
                write_all(sock, out.filled()).await?;
                out.clear();
                silent = false;
            }
            Next::Read => {
                if !out.is_empty() {
                    write_all(sock, out.filled()).await?;
                    out.clear();
                    silent = false;
                }
                // Once the server has spoken, the client's next flight may end the handshake.
                let n = if exact && !silent {
                    let tls13 = conn.protocol_version() == Some(rustls::ProtocolVersion::TLSv1_3);
                    incoming.read_handshake_records(sock, tls13).await?
                } else {
                    incoming.read_more(sock).await?
                };
                if n == 0 {
                    return Err(Error::PeerClosedInHandshake);
                }
            }
            Next::Done => {
                return Ok(Driven {
                    unsent: out,
                    peer_closed,
                })
            }
        }
    }
}

/// What [`settle`] found after the handshake.
pub(crate) struct Settled {
    /// Application data the client sent with or after its Finished, decrypted by rustls.
    pub(crate) plain: Vec<u8>,
    /// The client already sent close_notify.
    pub(crate) peer_closed: bool,
}

/// Brings the connection to a record boundary before the kernel takes it: completes a record
/// cut short in our buffer (exact read), then lets rustls decrypt every buffered record.
/// Anything rustls wants to send in reply is appended to `out`. On return `incoming` is empty
/// unless rustls could not consume it (the caller then keeps the connection in user space).
pub(crate) async fn settle(
    conn: &mut UnbufferedServerConnection,
    sock: &TcpStream,
    incoming: &mut Incoming,
    out: &mut OutBuf,
) -> Result<Settled, Error> {
    let mut settled = Settled {
        plain: Vec::new(),
        peer_closed: false,
    };
    // Even with nothing left in our buffer, rustls may hold a record it already decrypted
    // while finishing the handshake (the request that came with the Finished): run it until
    // it has nothing more to say.
    if !incoming.complete_last_record(sock).await? {
        return Err(Error::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "peer closed in the middle of a record",
        )));
    }
    loop {
        let UnbufferedStatus { mut discard, state } =
            conn.process_tls_records(&mut incoming.buf[..incoming.used]);
        let mut failed = None;
        let stop = match state {
            Err(e) => {
                failed = Some(e);
                true
            }
            Ok(ConnectionState::ReadTraffic(mut r)) => {
                while let Some(rec) = r.next_record() {
                    match rec {
                        Ok(rec) => {
                            discard += rec.discard;
                            settled.plain.extend_from_slice(rec.payload);
                        }
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                failed.is_some()
            }
            Ok(ConnectionState::EncodeTlsData(mut e)) => {
                encode_into(&mut e, out)?;
                false
            }
            Ok(ConnectionState::TransmitTlsData(t)) => {
                t.done();
                false
            }
            Ok(ConnectionState::PeerClosed) => {
                settled.peer_closed = true;
                false
            }
            Ok(_) => true,
        };
        incoming.discard(discard);
        if let Some(e) = failed {
            if !out.is_empty() {
                let _ = write_all(sock, out.filled()).await;
            }
            flush_alert(conn, sock, incoming, None).await;
            return Err(Error::Protocol(e));
        }
        if stop {
            return Ok(settled);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::exact_end;

    /// A record of `typ` with `len` bytes of body.
    fn rec(typ: u8, len: usize) -> Vec<u8> {
        let mut r = vec![typ, 3, 3, (len >> 8) as u8, len as u8];
        r.resize(HEADER + len, 0xab);
        r
    }
    const HEADER: usize = super::HEADER_LEN;

    #[test]
    fn tls13_stops_after_the_first_encrypted_record() {
        // ChangeCipherSpec, Finished, then a request: read up to the Finished's end.
        let buf = [rec(20, 1), rec(23, 53), rec(23, 100)].concat();
        assert_eq!(exact_end(&buf, 0, true), 6 + 58);
        // The Finished cut short: what has arrived of it.
        assert_eq!(exact_end(&buf[..30], 0, true), 30);
        // A header cut short: read it, nothing beyond was peeked.
        assert_eq!(exact_end(&buf[..3], 0, true), 3);
        // Part of the Finished already read: its rest, not the request.
        assert_eq!(exact_end(&buf, 20, true), 6 + 58);
    }

    #[test]
    fn tls12_stops_before_application_data() {
        // ClientKeyExchange, ChangeCipherSpec, Finished, a request.
        let buf = [rec(22, 37), rec(20, 1), rec(22, 40), rec(23, 100)].concat();
        assert_eq!(exact_end(&buf, 0, false), 42 + 6 + 45);
        // Application data first is the handshake's to refuse: read, not waited on.
        let early = [rec(23, 10), rec(22, 4)].concat();
        assert_eq!(exact_end(&early, 0, false), early.len());
    }
}
