//! Drives rustls' unbuffered server connection through the handshake.
//!
//! Reads are *exact*: we never read past the end of the TLS record rustls is waiting for. When
//! the handshake completes, every byte the client sent after its Finished (typically the first
//! HTTP request, in the same TCP segment) is therefore still in the socket, where the kernel
//! plane will decrypt it with the sequence number rustls hands over. This costs a few more
//! `read` calls per handshake but makes the hand-off byte-exact by construction rather than by
//! replaying buffered plaintext.

use std::io;

use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use tokio::net::TcpStream;

use crate::buf::OutBuf;
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
}

impl Incoming {
    pub(crate) fn new() -> Self {
        Self { buf: vec![0; 2048], used: 0 }
    }

    pub(crate) fn discard(&mut self, n: usize) {
        if n > 0 {
            self.buf.copy_within(n..self.used, 0);
            self.used -= n;
        }
    }

    /// How far the buffer must be filled for rustls to make progress: to the end of the first
    /// incomplete record, or to the end of the next header when every buffered record is whole
    /// (rustls keeps a handshake message split over records in our buffer until it is whole).
    /// Also returns where that record's header starts.
    fn next_boundary(&self) -> (usize, usize) {
        let mut pos = 0;
        while pos + HEADER_LEN <= self.used {
            let len = HEADER_LEN + u16::from_be_bytes([self.buf[pos + 3], self.buf[pos + 4]]) as usize;
            if pos + len > self.used {
                return (pos, pos + len.min(MAX_RECORD_LEN));
            }
            pos += len;
        }
        (pos, pos + HEADER_LEN)
    }

    /// Reads until the next record boundary, never beyond it. Returns false on EOF.
    async fn read_to_record_boundary(&mut self, sock: &TcpStream) -> io::Result<bool> {
        loop {
            let (start, need) = self.next_boundary();
            if self.used >= need {
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
            // Let rustls judge a header as soon as it is complete: garbage in place of a
            // ClientHello is rejected after 5 bytes instead of waiting for a bogus length.
            if self.used == start + HEADER_LEN || self.used == need {
                return Ok(true);
            }
        }
    }

    /// Greedy read for the user plane, where nothing is handed to the kernel.
    pub(crate) async fn read_more(&mut self, sock: &TcpStream) -> io::Result<usize> {
        if self.buf.len() - self.used < 4096 {
            let grow = (self.buf.len() * 2).clamp(2 * MAX_RECORD_LEN, 4 * MAX_RECORD_LEN);
            self.buf.resize(grow.max(self.used + 4096), 0);
        }
        read_some(sock, &mut self.buf[self.used..]).await.inspect(|&n| self.used += n)
    }
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

pub(crate) async fn write_all(sock: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        sock.writable().await?;
        match sock.try_write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Appends an encoded TLS message from rustls to `out`, growing it as rustls asks.
pub(crate) fn encode_into(state: &mut rustls::unbuffered::EncodeTlsData<'_, rustls::server::ServerConnectionData>, out: &mut OutBuf) -> Result<(), Error> {
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
pub(crate) async fn flush_alert(conn: &mut UnbufferedServerConnection, sock: &TcpStream) {
    let mut out = OutBuf::new();
    for _ in 0..4 {
        let UnbufferedStatus { state, .. } = conn.process_tls_records(&mut []);
        match state {
            Ok(ConnectionState::EncodeTlsData(mut s)) => {
                if encode_into(&mut s, &mut out).is_err() {
                    break;
                }
            }
            Ok(ConnectionState::TransmitTlsData(t)) => t.done(),
            _ => break,
        }
    }
    if !out.is_empty() {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), write_all(sock, out.filled())).await;
    }
}

/// Runs the handshake to completion. On return rustls has consumed every byte read.
///
/// What rustls produced after the handshake completed (TLS 1.3 session tickets) is returned
/// unsent: the client does not wait for it, so the user plane sends it with the first response
/// (or the close_notify) in one write instead of a write of its own; the kernel plane must
/// write it before it installs the keys.
pub(crate) async fn drive(conn: &mut UnbufferedServerConnection, sock: &TcpStream, incoming: &mut Incoming) -> Result<OutBuf, Error> {
    let mut out = OutBuf::new();
    loop {
        let UnbufferedStatus { discard, state } = conn.process_tls_records(&mut incoming.buf[..incoming.used]);
        enum Next {
            Read,
            Flush,
            Done,
            Continue,
        }
        let next = match state {
            Err(e) => {
                incoming.discard(discard);
                flush_alert(conn, sock).await;
                return Err(Error::Protocol(e));
            }
            Ok(ConnectionState::EncodeTlsData(mut s)) => {
                encode_into(&mut s, &mut out)?;
                Next::Continue
            }
            Ok(ConnectionState::TransmitTlsData(t)) => {
                // We own the bytes in `out` from here on and write them before reading again.
                t.done();
                if conn.is_handshaking() {
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
                incoming.discard(discard);
                return Err(Error::PeerClosedInHandshake);
            }
            Ok(_) => {
                incoming.discard(discard);
                return Err(Error::Io(io::Error::other("unexpected TLS state during handshake")));
            }
        };
        incoming.discard(discard);
        match next {
            Next::Continue => {}
            Next::Flush => {
                write_all(sock, out.filled()).await?;
                out.clear();
            }
            Next::Read => {
                if !out.is_empty() {
                    write_all(sock, out.filled()).await?;
                    out.clear();
                }
                if !incoming.read_to_record_boundary(sock).await? {
                    return Err(Error::PeerClosedInHandshake);
                }
            }
            Next::Done => return Ok(out),
        }
    }
}
