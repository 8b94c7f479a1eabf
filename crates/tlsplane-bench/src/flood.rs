//! `bench flood`: the cheap side of a handshake flood.
//!
//! An attacker does no cryptography: it replays one ClientHello, built once, on
//! every connection, waits until the server's first flight is there (the server
//! has by then paid for an ECDHE key exchange and a signature) and resets the
//! connection. This module does the same, to measure what such a flood costs a
//! server and what is left for legitimate clients.
//!
//! * The ClientHello is made once by a rustls client in memory, so `--tls`,
//!   `--group`, `--cipher`, `--sni` and `--alpn` shape it as they shape `bench
//!   handshake`'s. Its key share is reused on every connection; servers accept
//!   that (nothing in a full handshake detects a replayed ClientHello).
//! * The end of the server's first flight: TLS 1.3 encrypts most of it
//!   (EncryptedExtensions .. Finished travel as records of type 23), so its end
//!   cannot be seen in the bytes, and the number of records depends on the
//!   server (one per message for rustls and OpenSSL, plus a middlebox
//!   ChangeCipherSpec). So before the flood, one *probe* connection sends the
//!   same canned ClientHello and feeds the answer, record by record, to the
//!   rustls client that built it, until that client has the whole flight (TLS
//!   1.3: the server's Finished; TLS 1.2: ServerHelloDone). The number of
//!   records that took is the flight's shape; every flood connection then
//!   reads until that many complete records have arrived, counting record
//!   headers only (no parsing, no decryption). `--flight-records N` skips the
//!   probe. A probe answered with a HelloRetryRequest or an alert stops the
//!   run: such a flood would not make the server do the expensive part.
//! * Then `SO_LINGER` 0 and close: the kernel sends a RST, so neither side
//!   keeps a TIME_WAIT entry and the client never runs out of ports.
//! * Engine: `--threads` current-thread tokio runtimes, each with its share
//!   of the `--concurrency` connection loops. One attempt is about ten
//!   syscalls (socket, setsockopt, connect, epoll_ctl, getsockopt, write, one
//!   or two reads, close) and no crypto, so one client core keeps hundreds of
//!   connections in flight for a small fraction of what the server spends on
//!   each; the report gives the client's own CPU so a run can show it.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use rustls::{ClientConnection, HandshakeKind, ProtocolVersion};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::args::FloodPlan;
use crate::cpu::process_cpu_time;
use crate::engine::{progress, progress_every, Control};
use crate::stats::{FlightShape, FloodFailure, FloodStats, Negotiated};

/// Record content types.
const ALERT: u8 = 21;

/// Socket reads: a whole first flight (a certificate chain or two) fits.
const READ_BUF: usize = 16 * 1024;

/// What every flood connection does.
pub(crate) struct FloodParams {
    pub addr: SocketAddr,
    /// The canned ClientHello (one or more TLS records, as sent).
    pub hello: Vec<u8>,
    /// Complete server records that make up the first flight.
    pub flight_records: u32,
    pub timeout: Duration,
}

/// Builds the ClientHello once. The connection that made it is returned too:
/// the probe continues it.
pub(crate) fn canned_hello(plan: &FloodPlan) -> Result<(Vec<u8>, ClientConnection)> {
    let mut conn = ClientConnection::new(plan.config.clone(), plan.server_name.clone())
        .context("building the ClientHello")?;
    let mut hello = Vec::with_capacity(2048);
    while conn.wants_write() {
        conn.write_tls(&mut hello)
            .context("building the ClientHello")?;
    }
    Ok((hello, conn))
}

/// Counts complete TLS records in a byte stream fed in arbitrary pieces.
#[derive(Default, Debug)]
pub(crate) struct RecordCounter {
    header: [u8; 5],
    header_len: usize,
    body_left: usize,
    /// Complete records so far.
    pub records: u32,
    /// A complete alert record has been seen.
    pub alert: bool,
}

impl RecordCounter {
    pub(crate) fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.header_len < 5 {
                let n = (5 - self.header_len).min(data.len());
                self.header[self.header_len..self.header_len + n].copy_from_slice(&data[..n]);
                self.header_len += n;
                data = &data[n..];
                if self.header_len == 5 {
                    self.body_left =
                        usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                    if self.body_left == 0 {
                        self.complete();
                    }
                }
            } else {
                let n = self.body_left.min(data.len());
                self.body_left -= n;
                data = &data[n..];
                if self.body_left == 0 {
                    self.complete();
                }
            }
        }
    }

    fn complete(&mut self) {
        self.alert |= self.header[0] == ALERT;
        self.records += 1;
        self.header_len = 0;
    }
}

/// Whether the client has the server's whole first flight.
fn has_first_flight(conn: &ClientConnection) -> bool {
    // TLS 1.3: the server's Finished completes the handshake on the client's side.
    // TLS 1.2: after ServerHelloDone the client queues its second flight (and only
    // then: a TLS 1.3 client queues its middlebox ChangeCipherSpec earlier, after
    // the ServerHello, hence the version check).
    !conn.is_handshaking()
        || (conn.protocol_version() == Some(ProtocolVersion::TLSv1_2) && conn.wants_write())
}

/// One real connection with the canned ClientHello, continued by the rustls client that
/// made it until the server's first flight is complete, then reset. Learns how many
/// records the flight takes, and checks that the server does the expensive part for this
/// ClientHello (no HelloRetryRequest, no alert).
pub(crate) fn probe(
    addr: SocketAddr,
    timeout: Duration,
    mut conn: ClientConnection,
    hello: &[u8],
) -> Result<FlightShape> {
    let mut sock = crate::net::connect(&addr, timeout)
        .with_context(|| format!("probe: connecting to {addr}"))?;
    socket2::SockRef::from(&sock).set_linger(Some(Duration::ZERO))?;
    sock.write_all(hello)
        .context("probe: sending the ClientHello")?;
    let deadline = Instant::now() + timeout;
    let mut shape = FlightShape::default();
    let mut pending: Vec<u8> = Vec::with_capacity(READ_BUF);
    let mut buf = vec![0u8; READ_BUF];
    loop {
        while pending.len() >= 5 {
            let len = 5 + usize::from(u16::from_be_bytes([pending[3], pending[4]]));
            if pending.len() < len {
                break;
            }
            shape.records += 1;
            shape.bytes += len;
            shape.record_types.push(pending[0]);
            let mut rd = &pending[..len];
            while !rd.is_empty() {
                conn.read_tls(&mut rd).context("probe: rustls")?;
            }
            pending.drain(..len);
            if let Err(e) = conn.process_new_packets() {
                bail!("probe: the server did not take the canned ClientHello: {e}");
            }
            if conn.handshake_kind() == Some(HandshakeKind::FullWithHelloRetryRequest) {
                bail!(
                    "probe: the server answered the canned ClientHello with a \
                     HelloRetryRequest (it wants a key share the ClientHello does not \
                     carry), which costs it no key exchange: pick a --group it accepts"
                );
            }
            if shape.records > 64 {
                bail!("probe: no end of the server's first flight after 64 records");
            }
            if has_first_flight(&conn) {
                let n = Negotiated::of(&conn);
                shape.version = n.version_name();
                shape.suite = n.suite_name();
                shape.group = n.group_name();
                return Ok(shape); // dropping the socket resets it
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("probe: no complete first flight from the server within --timeout");
        }
        sock.set_read_timeout(Some(left))?;
        match sock.read(&mut buf) {
            Ok(0) => bail!(
                "probe: the server closed the connection after {} records of its first flight",
                shape.records
            ),
            Ok(n) => pending.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                bail!("probe: no complete first flight from the server within --timeout")
            }
            Err(e) => return Err(e).context("probe: reading the server's first flight"),
        }
    }
}

/// One flood attempt: connect, send the canned ClientHello, read until the first flight
/// is complete. The socket is dropped (reset) on every path.
async fn attempt(p: &FloodParams, buf: &mut [u8]) -> Result<(), FloodFailure> {
    let sock = if p.addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .map_err(|e| FloodFailure::from_connect(&e))?;
    // Abortive close: dropping the socket sends a RST, as the attacker does.
    socket2::SockRef::from(&sock)
        .set_linger(Some(Duration::ZERO))
        .map_err(|e| FloodFailure::from_connect(&e))?;
    let mut tcp = sock
        .connect(p.addr)
        .await
        .map_err(|e| FloodFailure::from_connect(&e))?;
    tcp.write_all(&p.hello)
        .await
        .map_err(|e| FloodFailure::from_io(&e))?;
    let mut rc = RecordCounter::default();
    loop {
        let n = tcp.read(buf).await.map_err(|e| FloodFailure::from_io(&e))?;
        if n == 0 {
            return Err(FloodFailure::ClosedEarly);
        }
        rc.feed(&buf[..n]);
        if rc.alert {
            return Err(FloodFailure::Alert);
        }
        if rc.records >= p.flight_records {
            return Ok(());
        }
    }
}

async fn flood_loop(p: Arc<FloodParams>, ctl: Arc<Control>) -> FloodStats {
    let mut st = FloodStats::default();
    let mut buf = vec![0u8; READ_BUF];
    while let Some(measured) = ctl.next() {
        let t0 = Instant::now();
        let r = match tokio::time::timeout(p.timeout, attempt(&p, &mut buf)).await {
            Ok(r) => r,
            Err(_) => Err(FloodFailure::Timeout),
        };
        if measured {
            match r {
                Ok(()) => st.flight(t0.elapsed()),
                Err(f) => st.failure(f),
            }
            ctl.note(r.is_ok(), 0);
        }
        if r.is_err() {
            // A refused connect can fail without ever waiting: let the other loops run.
            tokio::task::yield_now().await;
        }
    }
    st
}

fn flood_thread(p: Arc<FloodParams>, ctl: Arc<Control>, loops: usize) -> Result<FloodStats> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building tokio runtime")?;
    rt.block_on(async move {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..loops {
            set.spawn(flood_loop(p.clone(), ctl.clone()));
        }
        let mut total = FloodStats::default();
        while let Some(r) = set.join_next().await {
            total.merge(r.map_err(|e| anyhow!("flood loop panicked: {e}"))?);
        }
        Ok(total)
    })
}

pub(crate) struct FloodOutcome {
    pub stats: FloodStats,
    pub elapsed: Duration,
    pub cpu: Duration,
}

/// Runs the flood to completion.
pub(crate) fn execute(plan: &FloodPlan, p: Arc<FloodParams>) -> Result<FloodOutcome> {
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    let started = Instant::now();
    let measure_from = started + plan.warmup;
    let ctl = Arc::new(Control::new(measure_from, plan.stop));
    let mut cpu_start = if plan.warmup.is_zero() {
        Some(process_cpu_time().context("reading /proc/self/stat")?)
    } else {
        None
    };
    let (tx, rx) = mpsc::channel::<Result<FloodStats>>();
    let mut handles = Vec::with_capacity(plan.threads);
    for t in 0..plan.threads {
        let loops =
            plan.concurrency / plan.threads + usize::from(t < plan.concurrency % plan.threads);
        let (tx, ctl, p) = (tx.clone(), ctl.clone(), p.clone());
        let h = std::thread::Builder::new()
            .name(format!("flood-{t}"))
            .spawn(move || {
                let _ = tx.send(flood_thread(p, ctl, loops));
            })
            .context("spawning flood thread")?;
        handles.push(h);
    }
    drop(tx);

    let tick = progress_every(terminal);
    let mut next_tick = started + tick;
    let mut merged = FloodStats::default();
    let mut first_err = None;
    let mut done = 0;
    while done < plan.threads {
        if cpu_start.is_none() && Instant::now() >= measure_from {
            cpu_start = Some(process_cpu_time()?);
        }
        let mut wake = next_tick;
        if cpu_start.is_none() {
            wake = wake.min(measure_from);
        }
        match rx.recv_timeout(wake.saturating_duration_since(Instant::now())) {
            Ok(Ok(st)) => {
                merged.merge(st);
                done += 1;
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
                done += 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if Instant::now() >= next_tick {
                    progress(&ctl, false, terminal);
                    next_tick += tick;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let finished = Instant::now();
    let cpu_end = process_cpu_time()?;
    if terminal {
        let _ = write!(std::io::stderr(), "\r\x1b[2K");
    }
    for h in handles {
        if h.join().is_err() {
            first_err.get_or_insert(anyhow!("a flood thread panicked"));
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(FloodOutcome {
        stats: merged,
        elapsed: finished.saturating_duration_since(measure_from),
        cpu: cpu_end.saturating_sub(cpu_start.unwrap_or(cpu_end)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u8, len: usize) -> Vec<u8> {
        let mut r = vec![kind, 3, 3, (len >> 8) as u8, len as u8];
        r.resize(5 + len, 0xaa);
        r
    }

    #[test]
    fn counts_records_across_arbitrary_splits() {
        let mut stream = record(22, 90);
        stream.extend(record(20, 1));
        stream.extend(record(23, 0));
        stream.extend(record(23, 700));
        for chunk in [1, 2, 3, 5, 7, 64, 4096] {
            let mut rc = RecordCounter::default();
            let mut seen = Vec::new();
            for piece in stream.chunks(chunk) {
                rc.feed(piece);
                seen.push(rc.records);
            }
            assert_eq!(rc.records, 4, "chunk {chunk}");
            assert!(!rc.alert);
            // Never counts a record before its last byte.
            let cut = stream.len() - 1;
            let mut rc = RecordCounter::default();
            rc.feed(&stream[..cut]);
            assert_eq!(rc.records, 3, "chunk {chunk}");
            assert!(seen.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn notices_alerts() {
        let mut rc = RecordCounter::default();
        rc.feed(&record(ALERT, 2)[..6]);
        assert!(!rc.alert);
        rc.feed(&[40]);
        assert!(rc.alert);
        assert_eq!(rc.records, 1);
    }
}
