//! The user plane: rustls' own record layer (unbuffered API), with buffers we own and reuse.
//!
//! `pump` is the state machine step and does no I/O; the async methods around it move bytes
//! between the socket and the buffers.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncryptError, UnbufferedStatus};
use tokio::net::TcpStream;

use crate::buf::{OutBuf, Pending};
use crate::handshake::{encode_into, flush_alert, Incoming};
use crate::stats::{bump, global};
use crate::Error;

/// Plaintext encrypted per socket write: sixteen full records (fewer, larger writes measured
/// cheaper per byte than 64 KiB ones on loopback).
const CHUNK: usize = 16 * 16384;
/// Buffers larger than this are freed once a response is done rather than kept for the next.
const IDLE_BUFFER_MAX: usize = 64 * 1024;
/// Worst-case per-record expansion (TLS 1.2 GCM: 5 header + 8 explicit nonce + 16 tag; TLS 1.3
/// adds a content-type byte instead of the nonce).
const RECORD_OVERHEAD: usize = 5 + 8 + 16 + 1;

enum Pumped {
    /// Plaintext bytes of `send` that were encrypted into `out`.
    Wrote(usize),
    /// rustls needs more bytes from the peer to make progress.
    NeedInput,
    /// The peer sent close_notify.
    PeerClosed,
}

pub(crate) struct UserPlane {
    conn: UnbufferedServerConnection,
    incoming: Incoming,
    /// TLS bytes waiting to be written, in order.
    out: OutBuf,
    /// `out` holds only what the peer does not wait for (session tickets): it may ride along
    /// with the next write instead of costing a write (and a loopback/wire packet) of its own.
    out_deferrable: bool,
    /// Bytes at the start of `out` already written: a flush cancelled part-way (a relay drops
    /// a read that had a reply to send) goes on from here next time, never sends them twice.
    out_sent: usize,
    /// Decrypted bytes not yet delivered to the application.
    plain: Pending,
    /// File chunks are read here before encryption; sized to the response, kept for the next
    /// one only while small (`IDLE_BUFFER_MAX`).
    file_buf: Vec<u8>,
    peer_closed: bool,
    /// The application's next writes are its last before `shutdown` (see
    /// [`TlsStream::final_writes`](crate::TlsStream::final_writes)): send with MSG_MORE.
    final_writes: bool,
    /// rustls failed: the connection is dead. Asking rustls anything more would make it
    /// re-read the bad input and fail (and alert) a second time, so later calls get this.
    failed: Option<rustls::Error>,
    /// The alert for `failed` went out (see `fail`).
    alerted: bool,
}

impl UserPlane {
    /// `pending` is TLS output from the handshake that has not been written yet, `plain`
    /// application data already decrypted.
    pub(crate) fn new(
        conn: UnbufferedServerConnection,
        incoming: Incoming,
        pending: OutBuf,
        settled: crate::handshake::Settled,
    ) -> Self {
        Self {
            conn,
            incoming,
            out_deferrable: !pending.is_empty(),
            out: pending,
            out_sent: 0,
            plain: Pending::from_vec(settled.plain),
            file_buf: Vec::new(),
            peer_closed: settled.peer_closed,
            final_writes: false,
            failed: None,
            alerted: false,
        }
    }

    /// One step of rustls over what we have buffered. Decrypted data goes to `plain`, TLS
    /// output to `out`; with `send`, up to CHUNK bytes of it are encrypted.
    fn pump(&mut self, send: Option<&[u8]>, close_notify: bool) -> Result<Pumped, rustls::Error> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.pump_rustls(send, close_notify);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    fn pump_rustls(
        &mut self,
        send: Option<&[u8]>,
        close_notify: bool,
    ) -> Result<Pumped, rustls::Error> {
        loop {
            let UnbufferedStatus { mut discard, state } = self
                .conn
                .process_tls_records(&mut self.incoming.buf[..self.incoming.used]);
            let done = match state {
                Err(e) => {
                    self.incoming.discard(discard);
                    return Err(e);
                }
                Ok(ConnectionState::ReadTraffic(mut r)) => {
                    while let Some(rec) = r.next_record() {
                        let rec = rec?;
                        discard += rec.discard;
                        self.plain.extend(rec.payload);
                    }
                    None
                }
                Ok(ConnectionState::EncodeTlsData(mut e)) => {
                    encode_into(&mut e, &mut self.out)
                        .map_err(|e| rustls::Error::General(e.to_string()))?;
                    self.out_deferrable = false;
                    None
                }
                Ok(ConnectionState::TransmitTlsData(t)) => {
                    // `out` is flushed, in order, before any later read or write.
                    t.done();
                    None
                }
                Ok(ConnectionState::WriteTraffic(mut w)) => {
                    if close_notify {
                        let n = w
                            .queue_close_notify(self.out.spare(64))
                            .map_err(|e| rustls::Error::General(e.to_string()))?;
                        self.out.commit(n);
                        Some(Pumped::Wrote(0))
                    } else if let Some(data) = send {
                        let data = &data[..data.len().min(CHUNK)];
                        let records = data.len().div_ceil(16384).max(1);
                        let n = match w
                            .encrypt(data, self.out.spare(data.len() + records * RECORD_OVERHEAD))
                        {
                            Ok(n) => n,
                            Err(EncryptError::InsufficientSize(s)) => w
                                .encrypt(data, self.out.spare(s.required_size))
                                .map_err(|e| rustls::Error::General(e.to_string()))?,
                            Err(e) => return Err(rustls::Error::General(e.to_string())),
                        };
                        self.out.commit(n);
                        Some(Pumped::Wrote(data.len()))
                    } else {
                        Some(Pumped::NeedInput)
                    }
                }
                Ok(ConnectionState::PeerClosed) | Ok(ConnectionState::Closed) => {
                    if !self.peer_closed {
                        self.peer_closed = true;
                        bump(&global().close_notify_received);
                    }
                    if send.is_some() || close_notify {
                        // Half-closed: we may still write; ask again for WriteTraffic.
                        None
                    } else {
                        Some(Pumped::PeerClosed)
                    }
                }
                Ok(ConnectionState::BlockedHandshake) => Some(Pumped::NeedInput),
                Ok(_) => return Err(rustls::Error::General("unexpected TLS state".into())),
            };
            self.incoming.discard(discard);
            if let Some(p) = done {
                return Ok(p);
            }
        }
    }

    /// Writes `out`. Cancel-safe: progress is kept in `out_sent` after every send.
    async fn flush(&mut self, sock: &TcpStream) -> io::Result<()> {
        while self.out_sent < self.out.filled().len() {
            let rest = &self.out.filled()[self.out_sent..];
            let final_writes = self.final_writes;
            let sent = crate::handshake::send_with(sock, || {
                if final_writes {
                    // Full segments still leave at once; only the tail waits for what follows.
                    tlsplane_sys::send_more(std::os::fd::AsFd::as_fd(sock), rest)
                } else {
                    socket2::SockRef::from(sock).send(rest)
                }
            })
            .await;
            match sent {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_sent += n,
                Err(e) => return Err(e),
            }
        }
        self.out.clear();
        self.out_sent = 0;
        self.out_deferrable = false;
        Ok(())
    }

    pub(crate) fn final_writes(&mut self) {
        self.final_writes = true;
    }

    /// Before waiting for the peer: send what it may be waiting for (a KeyUpdate answer).
    async fn flush_unless_deferrable(&mut self, sock: &TcpStream) -> io::Result<()> {
        if self.out_deferrable {
            return Ok(());
        }
        self.flush(sock).await
    }

    async fn fail(&mut self, sock: &TcpStream, e: rustls::Error) -> io::Error {
        if std::mem::replace(&mut self.alerted, true) {
            return Error::Protocol(e).into();
        }
        let _ = self.flush(sock).await;
        flush_alert(&mut self.conn, sock, &mut self.incoming, None).await;
        Error::Protocol(e).into()
    }

    /// Input a read would process without the socket: plaintext (including what rustls
    /// decrypted with the handshake's last flight and still holds), bytes received and not yet
    /// decrypted (perhaps a record cut short, whose rest is on its way), or the end. No I/O.
    pub(crate) fn has_buffered_input(&mut self) -> bool {
        if self.plain.is_empty() && !self.peer_closed {
            // An error here is for the next read to report: count it as input.
            if self.pump(None, false).is_err() {
                return true;
            }
        }
        !self.plain.is_empty() || self.incoming.used > 0 || self.peer_closed
    }

    /// Whether a read would return at once: buffered input (see `has_buffered_input`), else
    /// one non-blocking read of the socket into the record layer (cheaper than asking the
    /// kernel how much is queued and then reading it). The end, or an error, counts as input:
    /// the read reports it.
    pub(crate) fn input_ready(&mut self, sock: &TcpStream) -> bool {
        if self.has_buffered_input() {
            return true;
        }
        !matches!(self.incoming.try_read_more(sock), Ok(None))
    }

    pub(crate) async fn read(&mut self, sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if !self.plain.is_empty() {
                return Ok(self.plain.take_into(buf));
            }
            if buf.is_empty() || self.peer_closed {
                // After close_notify nothing more can come; don't wait for the peer's FIN.
                return Ok(0);
            }
            match self.pump(None, false) {
                Err(e) => return Err(self.fail(sock, e).await),
                Ok(Pumped::PeerClosed) => {
                    self.flush_unless_deferrable(sock).await?;
                    if self.plain.is_empty() {
                        return Ok(0);
                    }
                }
                Ok(Pumped::Wrote(_)) => {}
                Ok(Pumped::NeedInput) => {
                    // A key-update response may be waiting to go out before the peer sends more.
                    self.flush_unless_deferrable(sock).await?;
                    if !self.plain.is_empty() {
                        continue;
                    }
                    // About to wait for the peer with nothing buffered: an idle connection
                    // keeps no buffers (as OpenSSL's SSL_MODE_RELEASE_BUFFERS, which nginx
                    // sets); they are allocated again when the peer sends.
                    self.incoming.release();
                    self.out.release_if_larger(0);
                    self.plain.release();
                    self.file_buf = Vec::new();
                    if self.incoming.read_more(sock).await? == 0 {
                        // TCP EOF without close_notify: the peer is gone; report EOF like
                        // other servers do, rather than an error for every impolite client.
                        return Ok(0);
                    }
                }
            }
        }
    }

    pub(crate) async fn write_all(&mut self, sock: &TcpStream, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            match self.pump(Some(data), false) {
                Ok(Pumped::Wrote(n)) => data = &data[n..],
                Ok(_) => return Err(io::Error::other("TLS connection not writable")),
                Err(e) => return Err(self.fail(sock, e).await),
            }
            self.flush(sock).await?;
        }
        Ok(())
    }

    /// Sends `prefix` then `len` bytes of `file` from `offset`, encrypted in CHUNK-sized pieces
    /// through one reused buffer. The prefix (response headers) shares the first record.
    pub(crate) async fn write_file(
        &mut self,
        sock: &TcpStream,
        prefix: &[u8],
        file: &File,
        mut offset: u64,
        len: u64,
    ) -> io::Result<()> {
        let mut buf = std::mem::take(&mut self.file_buf);
        // Only as large as this response needs: a 1 KiB file must not cost a zero-filled
        // 256 KiB buffer (memset and page faults showed in new-connection + small-GET profiles).
        let need = (prefix.len() as u64 + len).min(CHUNK as u64) as usize;
        if buf.len() < need {
            buf.resize(need, 0);
        }
        let cap = buf.len();
        let mut remaining = len;
        let mut first = prefix;
        let res = async {
            while remaining > 0 || !first.is_empty() {
                let head = first.len().min(cap);
                buf[..head].copy_from_slice(&first[..head]);
                first = &first[head..];
                let want = ((cap - head) as u64).min(remaining) as usize;
                let mut got = 0;
                while got < want {
                    let n = file.read_at(&mut buf[head + got..head + want], offset + got as u64)?;
                    if n == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "file shrank while being sent",
                        ));
                    }
                    got += n;
                }
                crate::stats::add(&crate::stats::global().file_bytes_copied, want as u64);
                offset += want as u64;
                remaining -= want as u64;
                self.write_all(sock, &buf[..head + want]).await?;
            }
            Ok(())
        }
        .await;
        // A connection idling in keep-alive after a large response should not keep its
        // chunk-sized buffers (two of 256 KiB); the next large response allocates again.
        if buf.len() <= IDLE_BUFFER_MAX {
            self.file_buf = buf;
        }
        self.out.release_if_larger(IDLE_BUFFER_MAX);
        res
    }

    /// Frees every buffer before a lingering close: nothing buffered will be read or sent any
    /// more (what the peer sent and rustls did not take is dropped with them).
    pub(crate) fn release_buffers(&mut self) {
        self.incoming.used = 0;
        self.incoming.release();
        self.out = OutBuf::new();
        self.out_sent = 0;
        self.plain = Pending::default();
        self.file_buf = Vec::new();
    }

    /// close_notify, then FIN. The alert goes out with MSG_MORE so that the FIN of the
    /// shutdown(2) right after joins its segment (and, after `final_writes`, the tail of the
    /// last response too): one segment where there were up to three.
    /// The peer sent close_notify: nothing more may come from it.
    pub(crate) fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Sends close_notify, held back with `MSG_MORE` for the FIN that follows (by `shutdown`,
    /// or by the descriptor's close).
    pub(crate) async fn close_notify(&mut self, sock: &TcpStream) -> io::Result<()> {
        match self.pump(None, true) {
            Ok(_) => {}
            Err(e) => return Err(self.fail(sock, e).await),
        }
        self.final_writes = true;
        self.flush(sock).await
    }

    pub(crate) async fn shutdown(&mut self, sock: &TcpStream) -> io::Result<()> {
        self.close_notify(sock).await?;
        match socket2::SockRef::from(sock).shutdown(std::net::Shutdown::Write) {
            // A peer that already closed may have reset the connection by now.
            Err(e) if self.peer_closed && e.kind() == io::ErrorKind::NotConnected => Ok(()),
            r => r,
        }
    }
}
