//! The kernel plane: rustls hands its traffic secrets to Linux kTLS, which then encrypts and
//! decrypts application records itself. We keep rustls' `KernelConnection` to derive the next
//! secrets on KeyUpdate, and handle every non-data record the kernel passes up.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use rustls::kernel::KernelConnection;
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::ConnectionTrafficSecrets;
use tlsplane_sys::{self as sys, CryptoInfo, Direction, KernelCipher, TlsVersion};
use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::buf::Pending;
use crate::handshake::{send_with, write_all_with};
use crate::stats::{bump, global};
use crate::Error;

/// TLS content types (RFC 8446 §5.1).
const CT_ALERT: u8 = 21;
const CT_HANDSHAKE: u8 = 22;
const CT_APPLICATION_DATA: u8 = 23;
/// Alert descriptions we send.
const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_UNEXPECTED_MESSAGE: u8 = 10;
const ALERT_BAD_RECORD_MAC: u8 = 20;
const ALERT_RECORD_OVERFLOW: u8 = 22;
const ALERT_DECODE_ERROR: u8 = 50;
const ALERT_NO_RENEGOTIATION: u8 = 100;
const HS_KEY_UPDATE: u8 = 24;
/// Largest plaintext per record; the kernel fills records up to this.
const MAX_FRAGMENT: u64 = 16384;

/// Builds the kernel's crypto-info for one direction from rustls' extracted secrets.
///
/// For TLS 1.2 AES-GCM the kernel sends an *incrementing* explicit nonce starting from the IV we
/// give it, while rustls used `explicit_base XOR seq` for the records it already sent under this
/// key. Starting the kernel at `explicit_base` would reuse a nonce rustls used (its Finished),
/// which breaks GCM. So the kernel starts just past the aligned block of values rustls can have
/// used; it would take ~2^64 records to wrap back into it.
pub(crate) fn crypto_info(
    version: TlsVersion,
    secrets: &ConnectionTrafficSecrets,
    seq: u64,
    direction: Direction,
) -> Result<CryptoInfo, Error> {
    let (cipher, key, iv) = kernel_cipher(secrets)?;
    let salt_len = cipher.salt_len();
    let (salt, rest) = iv.split_at(salt_len);
    let mut explicit = [0u8; 12];
    let rest_len = rest.len();
    explicit[..rest_len].copy_from_slice(rest);
    if version == TlsVersion::Tls12 && salt_len == 4 && direction == Direction::Tx {
        let base = u64::from_be_bytes(explicit[..8].try_into().expect("8-byte explicit nonce"));
        explicit[..8].copy_from_slice(&tls12_gcm_kernel_nonce_start(base, seq).to_be_bytes());
    }
    CryptoInfo::new(version, cipher, key, salt, &explicit[..rest_len], seq)
        .map_err(|e| Error::Config(e.to_string()))
}

/// The kernel's cipher for these secrets, with their key and IV.
fn kernel_cipher(
    secrets: &ConnectionTrafficSecrets,
) -> Result<(KernelCipher, &[u8], &[u8]), Error> {
    Ok(match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => {
            (KernelCipher::Aes128Gcm, key.as_ref(), iv.as_ref())
        }
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => {
            (KernelCipher::Aes256Gcm, key.as_ref(), iv.as_ref())
        }
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
            (KernelCipher::Chacha20Poly1305, key.as_ref(), iv.as_ref())
        }
        _ => return Err(Error::KernelRequired("suite has no kernel implementation")),
    })
}

/// Records sent under the current TX key, against the AEAD limit. Each write adds an upper
/// bound of the records it made (n/16384 rounded up, + 1 for a record left open by an earlier
/// write with MSG_MORE); a 1-byte write so counts 2 where the kernel makes 1, alerts and
/// KeyUpdates count nothing. Before the bound is allowed to end the key, the kernel is asked
/// its own count (its next record sequence number: a getsockopt, so only then): a
/// connection re-keys or closes at the records it sent, and asks at most about log2(limit)
/// times per key (each time the bound is off by at most half of what is left).
struct TxRecords {
    sent: u64,
    limit: u64,
}

impl TxRecords {
    /// Bytes of `want` that may be written now without passing the limit; `None`: none, by
    /// the bound (ask the kernel, then re-key or close). One record is kept for the KeyUpdate
    /// message, which goes out under the old key, and one for a record left open.
    fn budget(&self, want: usize) -> Option<usize> {
        let remaining = self.limit.saturating_sub(self.sent);
        (remaining > 2).then(|| {
            let budget = (remaining - 2).saturating_mul(MAX_FRAGMENT);
            want.min(usize::try_from(budget).unwrap_or(usize::MAX))
        })
    }

    fn wrote(&mut self, n: usize) {
        self.sent += (n as u64).div_ceil(MAX_FRAGMENT) + 1;
    }

    /// The kernel's count, exact where the bound was not.
    fn sync(&mut self, kernel_seq: u64) {
        self.sent = kernel_seq;
    }
}

/// First explicit nonce for the kernel's TLS 1.2 GCM sender, given that rustls used
/// `base ^ j` for j in 0..used.
pub(crate) fn tls12_gcm_kernel_nonce_start(base: u64, used: u64) -> u64 {
    let mask = used.max(1).next_power_of_two() - 1;
    (base | mask).wrapping_add(1)
}

/// What the kernel plane may do about KeyUpdate.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rekey {
    /// The kernel can replace TLS 1.3 keys (Linux 6.14+).
    pub(crate) supported: bool,
    /// See `ServerOptions::key_updates_per_second`.
    pub(crate) key_updates_per_second: u32,
}

/// A token bucket of KeyUpdates: `rate` a second, at most `rate` at once.
struct KeyUpdateBudget {
    tokens: f64,
    at: std::time::Instant,
}

impl KeyUpdateBudget {
    fn take(&mut self, rate: u32) -> bool {
        if rate == 0 {
            return true;
        }
        let now = std::time::Instant::now();
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * rate as f64).min(rate as f64);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What one [`KernelPlane::splice_out`] (or [`crate::TlsStream::splice_out`]) moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spliced {
    /// Bytes now in the pipe.
    Pipe(usize),
    /// Bytes in the caller's spill buffer (read the ordinary way).
    Buf(usize),
    /// The end of the stream (close_notify or TCP FIN).
    End,
}

impl Spliced {
    fn read(n: usize) -> Self {
        if n == 0 {
            Spliced::End
        } else {
            Spliced::Buf(n)
        }
    }
}

pub(crate) struct KernelPlane {
    kconn: KernelConnection<ServerConnectionData>,
    version: TlsVersion,
    tx_records: TxRecords,
    /// The TX key's cipher (to ask the kernel its record count).
    tx_cipher: KernelCipher,
    rekey: Rekey,
    key_updates: KeyUpdateBudget,
    read_closed: bool,
    write_closed: bool,
    /// The peer asked for our KeyUpdate and its receive key is installed, but ours is not sent
    /// yet (the operation that was sending it was cancelled): the next operation sends it.
    tx_update_pending: bool,
    /// Application data rustls decrypted before the hand-off; delivered before the kernel's.
    early: Pending,
}

impl KernelPlane {
    /// Hands the connection's keys to the kernel. The socket must already have the TLS ULP.
    /// Past `dangerous_into_kernel_connection` there is no way back to rustls' record layer, so
    /// a failure here ends the connection (the probe makes it rare).
    pub(crate) fn install(
        conn: UnbufferedServerConnection,
        sock: &TcpStream,
        version: TlsVersion,
        tx_limit: u64,
        rekey: Rekey,
        settled: crate::handshake::Settled,
    ) -> Result<Self, Error> {
        let (secrets, kconn) = conn.dangerous_into_kernel_connection()?;
        // Records rustls already sent under this key (Finished, tickets) count too.
        let tx_records = TxRecords {
            sent: secrets.tx.0,
            limit: tx_limit,
        };
        let tx_cipher = kernel_cipher(&secrets.tx.1)?.0;
        let tx = crypto_info(version, &secrets.tx.1, secrets.tx.0, Direction::Tx)?;
        let rx = crypto_info(version, &secrets.rx.1, secrets.rx.0, Direction::Rx)?;
        drop(secrets);
        sys::set_crypto_info(sock.as_fd(), Direction::Tx, &tx)?;
        sys::set_crypto_info(sock.as_fd(), Direction::Rx, &rx)?;
        Ok(Self {
            kconn,
            version,
            tx_records,
            tx_cipher,
            rekey,
            key_updates: KeyUpdateBudget {
                tokens: rekey.key_updates_per_second as f64,
                at: std::time::Instant::now(),
            },
            read_closed: settled.peer_closed,
            write_closed: false,
            tx_update_pending: false,
            early: Pending::from_vec(settled.plain),
        })
    }

    /// Reads application data. Control records are handled here: close_notify is EOF, a fatal
    /// alert or a decryption failure is an error, KeyUpdate re-keys the kernel (or ends the
    /// connection cleanly where the kernel cannot re-key).
    /// Input this plane holds that a read would return without the socket: plaintext rustls
    /// decrypted before the hand-off, or the end of the stream.
    pub(crate) fn has_buffered_input(&self) -> bool {
        !self.early.is_empty() || self.read_closed
    }

    pub(crate) async fn read(&mut self, sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
        // Control records are a few bytes; a tiny caller buffer would split them. Callers of
        // this crate read into buffers of at least this size (TlsStream guarantees it).
        debug_assert!(buf.len() >= 64);
        self.finish_tx_update(sock).await?;
        if !self.early.is_empty() {
            return Ok(self.early.take_into(buf));
        }
        loop {
            if self.read_closed || buf.is_empty() {
                return Ok(0);
            }
            sock.readable().await?;
            let r = sock.try_io(Interest::READABLE, || sys::recv_record(sock.as_fd(), buf));
            match r {
                Ok((0, _)) => {
                    self.read_closed = true;
                    return Ok(0);
                }
                Ok((n, CT_APPLICATION_DATA)) => return Ok(n),
                Ok((n, CT_ALERT)) => return self.on_alert(sock, &buf[..n]).await,
                Ok((n, CT_HANDSHAKE)) => {
                    let msg = buf[..n].to_vec();
                    self.on_handshake(sock, &msg).await?;
                }
                Ok((_, _)) => {
                    bump(&global().kernel_unexpected_messages);
                    return Err(self
                        .fail(
                            sock,
                            ALERT_UNEXPECTED_MESSAGE,
                            "unexpected record type after handshake",
                        )
                        .await);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(self.read_failed(sock, e).await),
            }
        }
    }

    /// The error to return for a failed receive (recvmsg or splice), after the alert the
    /// failure calls for. The kernel reports a socket error once: it must not be retried.
    async fn read_failed(&mut self, sock: &TcpStream, e: io::Error) -> io::Error {
        match e.raw_os_error() {
            Some(libc_errno::EBADMSG) => {
                bump(&global().kernel_decrypt_errors);
                self.fail(
                    sock,
                    ALERT_BAD_RECORD_MAC,
                    "record failed to decrypt (bad_record_mac)",
                )
                .await
            }
            Some(libc_errno::EMSGSIZE) => {
                self.fail(sock, ALERT_RECORD_OVERFLOW, "record too large")
                    .await
            }
            _ => e,
        }
    }

    async fn on_alert(&mut self, sock: &TcpStream, alert: &[u8]) -> io::Result<usize> {
        if alert.len() == 2 && alert[1] == ALERT_CLOSE_NOTIFY {
            bump(&global().close_notify_received);
            self.read_closed = true;
            return Ok(0);
        }
        bump(&global().kernel_alerts_received);
        self.read_closed = true;
        self.write_closed = true;
        let _ = sock;
        let desc = alert.get(1).copied().unwrap_or(0);
        Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            format!("peer sent alert {desc}"),
        ))
    }

    async fn on_handshake(&mut self, sock: &TcpStream, mut msgs: &[u8]) -> io::Result<()> {
        while !msgs.is_empty() {
            if msgs.len() < 4 {
                return Err(self
                    .fail(sock, ALERT_DECODE_ERROR, "truncated handshake message")
                    .await);
            }
            let typ = msgs[0];
            let len = u32::from_be_bytes([0, msgs[1], msgs[2], msgs[3]]) as usize;
            if msgs.len() < 4 + len {
                return Err(self
                    .fail(sock, ALERT_DECODE_ERROR, "truncated handshake message")
                    .await);
            }
            let body = &msgs[4..4 + len];
            msgs = &msgs[4 + len..];
            match (typ, self.version) {
                (HS_KEY_UPDATE, TlsVersion::Tls13) if len == 1 && body[0] <= 1 => {
                    self.on_key_update(sock, body[0] == 1).await?
                }
                (HS_KEY_UPDATE, TlsVersion::Tls13) => {
                    return Err(self
                        .fail(sock, ALERT_DECODE_ERROR, "malformed KeyUpdate")
                        .await)
                }
                (1, TlsVersion::Tls12) => {
                    // A renegotiating ClientHello: refused, as rustls refuses it.
                    bump(&global().kernel_unexpected_messages);
                    bump(&global().renegotiations_refused);
                    return Err(self
                        .fail(sock, ALERT_NO_RENEGOTIATION, "renegotiation refused")
                        .await);
                }
                _ => {
                    bump(&global().kernel_unexpected_messages);
                    return Err(self
                        .fail(
                            sock,
                            ALERT_UNEXPECTED_MESSAGE,
                            "unexpected handshake message after handshake",
                        )
                        .await);
                }
            }
        }
        Ok(())
    }

    async fn on_key_update(&mut self, sock: &TcpStream, update_requested: bool) -> io::Result<()> {
        if !self.key_updates.take(self.rekey.key_updates_per_second) {
            bump(&global().limit_key_updates);
            return Err(self
                .fail(
                    sock,
                    ALERT_UNEXPECTED_MESSAGE,
                    "KeyUpdate rate limit exceeded",
                )
                .await);
        }
        if !self.rekey.supported {
            // Linux < 6.14 would go on decrypting with the old key and fail; end cleanly now.
            bump(&global().key_update_unsupported);
            let _ = self.send_alert(sock, ALERT_CLOSE_NOTIFY).await;
            self.read_closed = true;
            self.write_closed = true;
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "peer sent KeyUpdate; this kernel cannot re-key TLS 1.3, connection closed with close_notify"));
        }
        let (seq, secrets) = self.kconn.update_rx_secret().map_err(io::Error::other)?;
        let info = crypto_info(self.version, &secrets, seq, Direction::Rx)?;
        drop(secrets);
        sys::set_crypto_info(sock.as_fd(), Direction::Rx, &info)?;
        if update_requested {
            self.tx_update_pending = true;
            self.update_tx(sock).await?;
        }
        bump(&global().key_updates);
        Ok(())
    }

    /// Sends the KeyUpdate a cancelled operation left unsent (see `tx_update_pending`).
    async fn finish_tx_update(&mut self, sock: &TcpStream) -> io::Result<()> {
        if self.tx_update_pending && !self.write_closed {
            self.update_tx(sock).await?;
        }
        Ok(())
    }

    /// Sends KeyUpdate(update_not_requested) under the old key, then installs the next TX key.
    /// Cancel-safe: the record goes out whole or not at all (one send), and the new key is
    /// installed in the same step as its send completes.
    async fn update_tx(&mut self, sock: &TcpStream) -> io::Result<()> {
        send_all_record(sock, CT_HANDSHAKE, &[HS_KEY_UPDATE, 0, 0, 1, 0]).await?;
        let (seq, secrets) = self.kconn.update_tx_secret().map_err(io::Error::other)?;
        let info = crypto_info(self.version, &secrets, seq, Direction::Tx)?;
        drop(secrets);
        sys::set_crypto_info(sock.as_fd(), Direction::Tx, &info)?;
        self.tx_records.sent = seq;
        self.tx_update_pending = false;
        Ok(())
    }

    /// Sends a fatal alert (best effort) and returns the error to report.
    ///
    /// After a failed decryption kTLS leaves the socket error (EBADMSG) set, which would fail
    /// the alert's sendmsg: it is read (and so cleared) first. The bad record stays unread, and
    /// close(2) with unread data sends a RST that can destroy the alert before the peer reads
    /// it; so after the alert and our FIN we linger (bounded) until the peer closes too.
    async fn fail(&mut self, sock: &TcpStream, alert: u8, why: &'static str) -> io::Error {
        let sref = socket2::SockRef::from(sock);
        let _ = sref.take_error();
        if self.send_alert(sock, alert).await.is_ok()
            && sref.shutdown(std::net::Shutdown::Write).is_ok()
        {
            linger_until_peer_closes(sock, std::time::Duration::from_secs(1)).await;
        }
        self.read_closed = true;
        self.write_closed = true;
        io::Error::new(io::ErrorKind::InvalidData, why)
    }

    /// For ends on an error (and the closes that stand for one): bounded to 1 s, since the
    /// connection is dropped right after in any case. A response's close_notify is
    /// [`shutdown`](Self::shutdown)'s, which waits as a write does.
    async fn send_alert(&mut self, sock: &TcpStream, desc: u8) -> io::Result<()> {
        if self.write_closed {
            return Ok(());
        }
        let level = if desc == ALERT_CLOSE_NOTIFY { 1 } else { 2 };
        bump(&global().kernel_alerts_sent);
        let r = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            send_all_record(sock, CT_ALERT, &[level, desc]),
        )
        .await;
        self.write_closed = true;
        r.map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
    }

    /// How many of `want` bytes may be written now without passing the AEAD limit, re-keying
    /// (TLS 1.3 on kernels that can) or closing when the limit is near (see [`TxRecords`]).
    async fn before_write(&mut self, sock: &TcpStream, want: usize) -> io::Result<usize> {
        self.finish_tx_update(sock).await?;
        if self.write_closed {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "TLS connection closed for writing",
            ));
        }
        let mut asked = false;
        loop {
            if let Some(n) = self.tx_records.budget(want) {
                return Ok(n);
            }
            if !asked {
                asked = true;
                // Without an answer the bound stands: the key ends early, never late.
                if let Ok(seq) = sys::tx_record_seq(sock.as_fd(), self.tx_cipher) {
                    self.tx_records.sync(seq);
                    continue;
                }
            }
            if self.version == TlsVersion::Tls13 && self.rekey.supported {
                self.update_tx(sock).await?;
                bump(&global().aead_limit_rekeys);
            } else {
                bump(&global().aead_limit_closes);
                let _ = self.send_alert(sock, ALERT_CLOSE_NOTIFY).await;
                return Err(io::Error::other("AEAD confidentiality limit reached and this connection cannot re-key; closed with close_notify"));
            }
        }
    }

    pub(crate) async fn write_all(
        &mut self,
        sock: &TcpStream,
        mut data: &[u8],
        more: bool,
    ) -> io::Result<()> {
        while !data.is_empty() {
            let allowed = self.before_write(sock, data.len().min(1 << 20)).await?;
            let chunk = &data[..allowed];
            let n = send_with(sock, || {
                if more {
                    sys::send_more(sock.as_fd(), chunk)
                } else {
                    socket2::SockRef::from(sock).send(chunk)
                }
            })
            .await?;
            self.tx_records.wrote(n);
            data = &data[n..];
        }
        Ok(())
    }

    /// Zero-copy file body: the kernel reads the page cache, encrypts and sends.
    pub(crate) async fn send_file(
        &mut self,
        sock: &TcpStream,
        file: &File,
        mut offset: u64,
        len: u64,
    ) -> io::Result<()> {
        let end = offset + len;
        while offset < end {
            let want = self
                .before_write(sock, (end - offset).min(1 << 22) as usize)
                .await?;
            match send_with(sock, || {
                sys::sendfile(sock.as_fd(), file.as_fd(), &mut offset, want)
            })
            .await
            {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "file shrank while being sent",
                    ))
                }
                Ok(n) => {
                    self.tx_records.wrote(n);
                    crate::stats::add(&crate::stats::global().sendfile_bytes, n as u64);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Moves up to `max` decrypted bytes from the peer into `pipe` with `splice(2)`: the
    /// kernel decrypts on the way and the bytes never enter this process. `pipe` must be empty
    /// (a full pipe's EAGAIN would read as "no data" and the wait would never end).
    ///
    /// Only application data can be spliced; when the next record is anything else (an
    /// alert, a KeyUpdate: splice fails with EINVAL) the read path takes over for one call: it
    /// handles the record as [`read`](Self::read) does (EOF, error with its alert, re-key) and
    /// may return data into `spill`. Other failures are returned as `read` returns them (the
    /// kernel reports a reset once: reading again would see a clean EOF).
    pub(crate) async fn splice_out(
        &mut self,
        sock: &TcpStream,
        pipe: BorrowedFd<'_>,
        max: usize,
        spill: &mut [u8],
    ) -> io::Result<Spliced> {
        self.finish_tx_update(sock).await?;
        if !self.early.is_empty() || self.read_closed {
            return Ok(Spliced::read(self.read(sock, spill).await?));
        }
        loop {
            sock.readable().await?;
            match sock.try_io(Interest::READABLE, || sys::splice(sock.as_fd(), pipe, max)) {
                Ok(0) => {
                    self.read_closed = true;
                    return Ok(Spliced::End);
                }
                Ok(n) => return Ok(Spliced::Pipe(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // The next record is not application data: receive it the ordinary way.
                Err(e) if e.raw_os_error() == Some(libc_errno::EINVAL) => {
                    return Ok(Spliced::read(self.read(sock, spill).await?))
                }
                Err(e) => return Err(self.read_failed(sock, e).await),
            }
        }
    }

    /// Sends the `len` bytes waiting in `pipe` with `splice(2)`; the kernel encrypts them on
    /// the way (records counted against the AEAD limit as for any write).
    pub(crate) async fn splice_in(
        &mut self,
        sock: &TcpStream,
        pipe: BorrowedFd<'_>,
        mut len: usize,
    ) -> io::Result<()> {
        while len > 0 {
            let allowed = self.before_write(sock, len).await?;
            match send_with(sock, || sys::splice(pipe, sock.as_fd(), allowed)).await {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the pipe held less than it was said to",
                    ))
                }
                Ok(n) => {
                    self.tx_records.wrote(n);
                    len -= n;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One non-blocking receive for a lingering close (see `crate::linger`): application data
    /// is dropped (its length returned), an alert ends the input (`Ok(0)`), a KeyUpdate
    /// installs the next receive key where the kernel can (our own key is not updated: after
    /// our close_notify nothing more is sent). Anything else is an error: the kernel cannot
    /// read on.
    pub(crate) fn discard_record(
        &mut self,
        sock: BorrowedFd<'_>,
        buf: &mut [u8],
    ) -> io::Result<usize> {
        if self.read_closed {
            return Ok(0);
        }
        let unreadable = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        match sys::recv_record(sock, buf)? {
            (0, _) | (_, CT_ALERT) => {
                self.read_closed = true;
                Ok(0)
            }
            (n, CT_APPLICATION_DATA) => Ok(n),
            (n, CT_HANDSHAKE) => {
                let is_key_update = n == 5 && buf[0] == HS_KEY_UPDATE && buf[1..4] == [0, 0, 1];
                if !(is_key_update && self.version == TlsVersion::Tls13 && self.rekey.supported) {
                    return Err(unreadable(
                        "a handshake message other than a KeyUpdate the kernel can follow",
                    ));
                }
                if !self.key_updates.take(self.rekey.key_updates_per_second) {
                    bump(&global().limit_key_updates);
                    return Err(unreadable("KeyUpdate rate limit exceeded"));
                }
                let (seq, secrets) = self.kconn.update_rx_secret().map_err(io::Error::other)?;
                let info = crypto_info(self.version, &secrets, seq, Direction::Rx)?;
                drop(secrets);
                sys::set_crypto_info(sock, Direction::Rx, &info)?;
                bump(&global().key_updates);
                Ok(n)
            }
            _ => Err(unreadable("unexpected record type")),
        }
    }

    /// Whether the peer's input has ended (close_notify, an alert, EOF).
    pub(crate) fn read_closed(&self) -> bool {
        self.read_closed
    }

    /// close_notify through kTLS, then TCP FIN.
    ///
    /// The close_notify waits for room as any write does, for as long: it queues behind the
    /// end of the response, which a slow client may take minutes to read (a full send buffer
    /// frees room for it only once a third of it has drained). A time limit here would drop
    /// the connection, and with it the response's last records still in kTLS's own queue:
    /// the client's download would end short, without close_notify. What bounds a client that
    /// takes nothing at all is the send timeout (`TCP_USER_TIMEOUT`), as for every write.
    pub(crate) async fn shutdown(&mut self, sock: &TcpStream) -> io::Result<()> {
        if !self.write_closed {
            // Cancel-safe: the record goes out whole or not at all, and until it has gone
            // (or failed) the write side stays open for a later try.
            let sent = send_all_record(sock, CT_ALERT, &[1, ALERT_CLOSE_NOTIFY]).await;
            bump(&global().kernel_alerts_sent);
            self.write_closed = true;
            sent?;
        }
        if self.read_closed {
            // As on the user plane: the close on drop sends the FIN.
            return Ok(());
        }
        socket2::SockRef::from(sock).shutdown(std::net::Shutdown::Write)
    }
}

impl KernelPlane {
    /// Whether everything the connection holds is in the socket: no plaintext rustls
    /// decrypted during the handshake, no KeyUpdate still to send, no end seen. Only such a
    /// connection can be handed to another program as the bare socket.
    pub(crate) fn is_bare(&self) -> bool {
        self.early.is_empty() && !self.read_closed && !self.write_closed && !self.tx_update_pending
    }

    /// What is left once the socket goes to another program (see `is_bare`): the keys, to
    /// re-key on the program's behalf.
    pub(crate) fn into_handed(self) -> HandedKeys {
        HandedKeys {
            kconn: self.kconn,
            version: self.version,
            rekey: self.rekey,
            key_updates: self.key_updates,
            write_closed: false,
            waiting: None,
        }
    }
}

/// Why [`HandedKeys::key_update`] did not re-key. Each but `Io` has already ended the
/// connection with an alert: the program should close it.
#[derive(Debug)]
#[non_exhaustive]
pub enum HandedKeyError {
    /// The record is not a TLS 1.3 KeyUpdate (unexpected_message sent).
    NotKeyUpdate,
    /// The peer sent KeyUpdates faster than `ServerOptions::key_updates_per_second`
    /// (unexpected_message sent).
    RateLimited,
    /// This kernel cannot replace TLS 1.3 keys (before Linux 6.14): close_notify sent.
    Unsupported,
    /// A system call failed; the connection's state is unknown.
    Io(io::Error),
}

impl std::fmt::Display for HandedKeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotKeyUpdate => f.write_str("not a KeyUpdate"),
            Self::RateLimited => f.write_str("KeyUpdate rate limit exceeded"),
            Self::Unsupported => f.write_str("this kernel cannot re-key TLS 1.3"),
            Self::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for HandedKeyError {}

/// The traffic secrets of a kernel-plane connection whose socket another program now reads
/// and writes: tlsplane keeps them (they never leave its process) and applies them to its
/// own duplicate of the socket when the program asks. The socket's blocking mode is the
/// program's: every call here is non-blocking and never waits. A record that finds no room
/// in the socket (a client that reads slowly) is kept to be sent by [`Self::send_waiting`]
/// once the caller sees the socket writable.
pub struct HandedKeys {
    kconn: KernelConnection<ServerConnectionData>,
    version: TlsVersion,
    rekey: Rekey,
    key_updates: KeyUpdateBudget,
    write_closed: bool,
    waiting: Option<Waiting>,
}

/// A control record that found no room in the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waiting {
    /// Our KeyUpdate (old send key); then the next send key, then the next receive key.
    KeyUpdate,
    /// An alert (it ends the stream: nothing follows it).
    Alert(u8),
}

/// How a KeyUpdate went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReKeyed {
    /// Both directions re-keyed as asked.
    Done,
    /// Our own KeyUpdate found no room: [`HandedKeys::send_waiting`] finishes it once the
    /// socket is writable. Until then the socket's receive side stays paused at the peer's
    /// KeyUpdate.
    WaitingForRoom,
}

impl HandedKeys {
    /// After the program read a handshake record from `sock` (its plaintext, `message`): a
    /// TLS 1.3 KeyUpdate installs the next receive key, and when the peer asked for ours,
    /// sends our KeyUpdate under the old send key and installs the next one (or, without
    /// room for it now, leaves both to [`Self::send_waiting`]). Anything else ends the
    /// connection with an alert (sent now, or as soon as there is room).
    pub fn key_update(
        &mut self,
        sock: BorrowedFd<'_>,
        message: &[u8],
    ) -> Result<ReKeyed, HandedKeyError> {
        if self.waiting.is_some() {
            // The peer's next KeyUpdate cannot have been read: the receive side is paused at
            // the one still being answered, or the stream was ended.
            return Err(HandedKeyError::Io(io::Error::other(
                "a KeyUpdate while the last one is unanswered",
            )));
        }
        let requested = match message {
            [HS_KEY_UPDATE, 0, 0, 1, r @ (0 | 1)] if self.version == TlsVersion::Tls13 => *r == 1,
            _ => {
                self.alert(sock, ALERT_UNEXPECTED_MESSAGE);
                return Err(HandedKeyError::NotKeyUpdate);
            }
        };
        if !self.key_updates.take(self.rekey.key_updates_per_second) {
            bump(&global().limit_key_updates);
            self.alert(sock, ALERT_UNEXPECTED_MESSAGE);
            return Err(HandedKeyError::RateLimited);
        }
        if !self.rekey.supported {
            bump(&global().key_update_unsupported);
            self.alert(sock, ALERT_CLOSE_NOTIFY);
            return Err(HandedKeyError::Unsupported);
        }
        // Our side first, while the socket's receive side is still paused at the peer's
        // KeyUpdate: a program that reads before it writes is waiting in its read, so nothing
        // of its can go out between our KeyUpdate (old key) and the new key's first record.
        if requested && !self.write_closed {
            if !try_send_record(sock, CT_HANDSHAKE, &KEY_UPDATE_NOT_REQUESTED)
                .map_err(HandedKeyError::Io)?
            {
                self.waiting = Some(Waiting::KeyUpdate);
                return Ok(ReKeyed::WaitingForRoom);
            }
            self.next_key(sock, Direction::Tx)?;
        }
        self.next_key(sock, Direction::Rx)?;
        bump(&global().key_updates);
        Ok(ReKeyed::Done)
    }

    /// Whether a record waits for room (see [`Self::send_waiting`]).
    pub fn is_waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// Sends the record that found no room before, if there is room now: `Ok(true)` once
    /// nothing waits (a KeyUpdate's keys installed), `Ok(false)` while it still has none.
    pub fn send_waiting(&mut self, sock: BorrowedFd<'_>) -> Result<bool, HandedKeyError> {
        let Some(waiting) = self.waiting else {
            return Ok(true);
        };
        let (typ, record): (u8, &[u8]) = match waiting {
            Waiting::KeyUpdate => (CT_HANDSHAKE, &KEY_UPDATE_NOT_REQUESTED),
            Waiting::Alert(desc) => (CT_ALERT, &[alert_level(desc), desc]),
        };
        let sent = try_send_record(sock, typ, record);
        if matches!(sent, Ok(false)) {
            return Ok(false);
        }
        self.waiting = None;
        sent.map_err(HandedKeyError::Io)?;
        if waiting == Waiting::KeyUpdate {
            self.next_key(sock, Direction::Tx)?;
            self.next_key(sock, Direction::Rx)?;
            bump(&global().key_updates);
        }
        Ok(true)
    }

    /// Derives the next secret of `direction` and installs it on `sock`.
    fn next_key(
        &mut self,
        sock: BorrowedFd<'_>,
        direction: Direction,
    ) -> Result<(), HandedKeyError> {
        let (seq, secrets) = match direction {
            Direction::Tx => self.kconn.update_tx_secret(),
            Direction::Rx => self.kconn.update_rx_secret(),
        }
        .map_err(|e| HandedKeyError::Io(io::Error::other(e)))?;
        let info = crypto_info(self.version, &secrets, seq, direction)
            .map_err(|e| HandedKeyError::Io(io::Error::other(e)))?;
        drop(secrets);
        sys::set_crypto_info(sock, direction, &info).map_err(HandedKeyError::Io)
    }

    /// Sends close_notify (once), after everything already written to `sock`, if the socket
    /// has room for it now, never waiting:
    /// `Ok(false)` when it has none (try again once it is writable).
    pub fn try_close_notify(&mut self, sock: BorrowedFd<'_>) -> io::Result<bool> {
        match self.waiting {
            // An alert ends the stream as well: it goes instead.
            Some(Waiting::Alert(_)) => {
                return self.send_waiting(sock).map_err(|e| match e {
                    HandedKeyError::Io(e) => e,
                    e => io::Error::other(e),
                })
            }
            // Our KeyUpdate is not sent: close_notify under the send key the peer has.
            Some(Waiting::KeyUpdate) => self.waiting = None,
            None => {}
        }
        if self.write_closed {
            return Ok(true);
        }
        loop {
            match sys::send_record(sock, CT_ALERT, &[1, ALERT_CLOSE_NOTIFY]) {
                Ok(2) => break,
                Ok(_) => {
                    self.write_closed = true;
                    return Err(io::Error::other("a control record went out in part"));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => {
                    self.write_closed = true;
                    return Err(e);
                }
            }
        }
        self.write_closed = true;
        Ok(true)
    }

    /// Sends an alert (best effort; without room now, it waits for [`Self::send_waiting`]):
    /// fatal unless it is close_notify. Nothing is sent after.
    fn alert(&mut self, sock: BorrowedFd<'_>, desc: u8) {
        if self.write_closed {
            return;
        }
        self.write_closed = true;
        bump(&global().kernel_alerts_sent);
        if let Ok(false) = try_send_record(sock, CT_ALERT, &[alert_level(desc), desc]) {
            self.waiting = Some(Waiting::Alert(desc));
        }
    }
}

/// A KeyUpdate that does not ask the peer for one back.
const KEY_UPDATE_NOT_REQUESTED: [u8; 5] = [HS_KEY_UPDATE, 0, 0, 1, 0];

fn alert_level(desc: u8) -> u8 {
    if desc == ALERT_CLOSE_NOTIFY {
        1
    } else {
        2
    }
}

/// One record of `typ` on a socket whose blocking mode is not ours, if it has room now:
/// `Ok(false)` when it has none. A record goes out whole or fails.
fn try_send_record(sock: BorrowedFd<'_>, typ: u8, data: &[u8]) -> io::Result<bool> {
    loop {
        match sys::send_record(sock, typ, data) {
            Ok(n) if n == data.len() => return Ok(true),
            Ok(_) => return Err(io::Error::other("a control record went out in part")),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        }
    }
}

/// Waits (at most `limit`) for the peer's FIN without reading: the socket may hold a record
/// the kernel refuses to return.
async fn linger_until_peer_closes(sock: &TcpStream, limit: std::time::Duration) {
    let _ = tokio::time::timeout(limit, async {
        loop {
            match sock.ready(Interest::READABLE).await {
                Ok(r) if r.is_read_closed() => return,
                Ok(_) => {
                    // Readable because of the unread record: clear the readiness and wait
                    // for the next event (the FIN).
                    let _ = sock.try_io(Interest::READABLE, || {
                        Err::<(), _>(io::ErrorKind::WouldBlock.into())
                    });
                }
                Err(_) => return,
            }
        }
    })
    .await;
}

async fn send_all_record(sock: &TcpStream, typ: u8, data: &[u8]) -> io::Result<()> {
    write_all_with(sock, data, |b| sys::send_record(sock.as_fd(), typ, b)).await
}

/// errno values we match on (Linux x86-64/generic; stable ABI).
mod libc_errno {
    pub const EBADMSG: i32 = 74;
    pub const EMSGSIZE: i32 = 90;
    pub const EINVAL: i32 = 22;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls12_kernel_nonces_never_meet_rustls_nonces() {
        for base in [
            0u64,
            1,
            2,
            3,
            0x7fff_ffff_ffff_fffe,
            u64::MAX - 1,
            u64::MAX,
            0x1234_5678_9abc_def1,
        ] {
            for used in 0u64..9 {
                let start = tls12_gcm_kernel_nonce_start(base, used);
                // The kernel sends start, start+1, ...: check a long run against every nonce
                // rustls already spent under this key.
                for k in 0..10_000u64 {
                    let kernel = start.wrapping_add(k);
                    for j in 0..used {
                        assert_ne!(kernel, base ^ j, "base={base:#x} used={used} k={k}");
                    }
                }
            }
        }
    }

    /// One connection writing 1-byte records until its key ends, the kernel making one record
    /// per write; `ask`: whether the kernel's count is read when the bound says stop.
    /// Returns the records sent under the key and how many times the kernel was asked.
    fn one_byte_writes_until_the_key_ends(limit: u64, ask: bool) -> (u64, u64) {
        let mut tx = TxRecords { sent: 0, limit };
        let (mut kernel, mut asked) = (0u64, 0u64);
        loop {
            if tx.budget(1).is_none() {
                if !ask {
                    return (kernel, asked);
                }
                asked += 1;
                tx.sync(kernel);
                if tx.budget(1).is_none() {
                    return (kernel, asked);
                }
            }
            tx.wrote(1);
            kernel += 1;
        }
    }

    #[test]
    fn the_aead_limit_counts_the_records_the_kernel_sent() {
        for limit in [10u64, 1000, 1 << 20] {
            let (sent, asked) = one_byte_writes_until_the_key_ends(limit, true);
            // Two kept back: the KeyUpdate, and a record a write may have left open.
            assert_eq!(
                sent,
                limit - 2,
                "limit {limit}: re-keyed after {sent} records"
            );
            let log2 = 64 - u64::from(limit.leading_zeros());
            assert!(
                asked <= log2 + 2,
                "limit {limit}: asked the kernel {asked} times"
            );
        }
        // The bound alone re-keys at half the limit (each 1-byte write counted 2).
        let (sent, _) = one_byte_writes_until_the_key_ends(1000, false);
        assert_eq!(sent, 499);
    }

    #[test]
    fn the_record_bound_is_never_below_what_the_kernel_makes() {
        let mut tx = TxRecords {
            sent: 0,
            limit: u64::MAX,
        };
        // A full record, one past it, a byte: the kernel makes 1, 2 and 1 records (+1 for a
        // record an earlier MSG_MORE write left open, closed by this one).
        for (n, kernel_at_most) in [(16384usize, 2u64), (16385, 3), (1, 2)] {
            let before = tx.sent;
            tx.wrote(n);
            assert!(tx.sent - before >= kernel_at_most, "{n} bytes");
        }
    }

    #[test]
    fn crypto_info_for_each_secret_kind() {
        let key32 = rustls::crypto::cipher::AeadKey::from([7u8; 32]);
        let iv = rustls::crypto::cipher::Iv::new([1u8; 12]);
        let s = ConnectionTrafficSecrets::Chacha20Poly1305 { key: key32, iv };
        assert!(crypto_info(TlsVersion::Tls13, &s, 3, Direction::Rx).is_ok());
    }
}
