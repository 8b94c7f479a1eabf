//! `bench hold`: open N keep-alive TLS connections, GET once on each, and keep them all open
//! and idle; then measure what they cost the server (its resident set) and check that it
//! still serves both the oldest of them and a new connection.
//!
//! The client keeps only the socket of each held connection: its TLS state is dropped once
//! the response is in (the server cannot tell), so the client's own memory does not limit N.
//! The oldest connection keeps its TLS state, to be asked again at the end.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use rustls::{ClientConfig, ClientConnection, HandshakeKind};
use rustls_pki_types::ServerName;
use serde::Serialize;

use crate::http::read_head;
use crate::stats::Failure;

/// Everything a hold run needs, validated (see `HoldArgs::plan`).
pub(crate) struct HoldPlan {
    pub target_label: String,
    pub addr: SocketAddr,
    pub server_name: ServerName<'static>,
    pub connections: usize,
    pub threads: usize,
    pub sources: Vec<IpAddr>,
    /// `GET <path> HTTP/1.1` with keep-alive.
    pub request: Vec<u8>,
    pub path: String,
    pub timeout: Duration,
    pub config: Arc<ClientConfig>,
    pub server_pids: Vec<u32>,
    pub settle: Duration,
    pub hold: Duration,
}

/// The outcome of a hold run.
#[derive(Debug, Serialize)]
pub struct HoldReport {
    pub target: String,
    pub threads: usize,
    pub path: String,
    pub wanted: usize,
    pub held: usize,
    /// Seconds to open (handshake + GET) all held connections.
    pub open_secs: f64,
    pub full_handshakes: u64,
    pub resumed_handshakes: u64,
    /// The first failure that stopped the run, as "connection #i: reason".
    pub failure: Option<String>,
    pub server_pids: Vec<u32>,
    pub server_rss_before_kib: Option<u64>,
    pub server_rss_after_kib: Option<u64>,
    /// Growth of the servers' resident set divided by the connections held.
    pub server_kib_per_connection: Option<f64>,
    /// Of the held connections, those the server still had open at the end (it had sent
    /// neither an end nor anything else on them): a server that closes idle connections to
    /// make room shows here, not as a failure of the client.
    pub still_open: usize,
    /// The oldest connection, asked again once all are open: milliseconds to its response.
    pub oldest_served_ms: Option<f64>,
    pub oldest_failure: Option<String>,
    /// A new connection (handshake + GET) once all are open.
    pub new_served_ms: Option<f64>,
    pub new_failure: Option<String>,
}

impl HoldReport {
    /// Every connection held and both checks served.
    pub fn ok(&self) -> bool {
        self.held == self.wanted
            && self.still_open == self.held
            && self.failure.is_none()
            && self.oldest_served_ms.is_some()
            && self.new_served_ms.is_some()
    }

    pub fn to_text(&self) -> String {
        let mut s = format!(
            "hold bench  {}  threads={}\n  held           {} of {} connections in {:.1} s ({:.0}/s), each after a GET of {} (handshakes: full {}, resumed {})\n",
            self.target,
            self.threads,
            self.held,
            self.wanted,
            self.open_secs,
            self.held as f64 / self.open_secs.max(1e-9),
            self.path,
            self.full_handshakes,
            self.resumed_handshakes,
        );
        if let Some(f) = &self.failure {
            s += &format!("  stopped by     {f}\n");
        }
        s += &format!(
            "  still open     {} of {} at the end{}\n",
            self.still_open,
            self.held,
            if self.still_open < self.held {
                ": the server closed the others"
            } else {
                ""
            }
        );
        if let (Some(b), Some(a)) = (self.server_rss_before_kib, self.server_rss_after_kib) {
            s += &format!(
                "  server RSS     {b} KiB -> {a} KiB: {:.1} KiB per held connection (pid {})\n",
                self.server_kib_per_connection.unwrap_or(f64::NAN),
                self.server_pids
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(" + "),
            );
        }
        match (&self.oldest_served_ms, &self.oldest_failure) {
            (Some(ms), _) => s += &format!("  oldest         served again in {ms:.1} ms\n"),
            (None, Some(f)) => s += &format!("  oldest         NOT served: {f}\n"),
            (None, None) => {}
        }
        match (&self.new_served_ms, &self.new_failure) {
            (Some(ms), _) => s += &format!("  new            served in {ms:.1} ms\n"),
            (None, Some(f)) => s += &format!("  new            NOT served: {f}\n"),
            (None, None) => {}
        }
        s
    }
}

/// A connection whose TLS state is kept: the oldest one.
struct Live {
    conn: ClientConnection,
    sock: TcpStream,
}

/// What the opening threads share.
struct Shared {
    stop: AtomicBool,
    opened: AtomicU64,
    full: AtomicU64,
    resumed: AtomicU64,
    /// The failure that stopped the run, with its connection's index.
    failure: Mutex<Option<(usize, String)>>,
}

impl Shared {
    fn fail(&self, index: usize, why: String) {
        self.stop.store(true, Ordering::Relaxed);
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.as_ref().is_none_or(|(i, _)| index < *i) {
            *f = Some((index, why));
        }
    }
}

pub(crate) fn run(plan: &HoldPlan) -> Result<HoldReport> {
    let need = plan.connections as u64 + 64;
    let limit = tlsplane_sys::raise_nofile_limit()?;
    if limit < need {
        bail!(
            "holding {} connections needs about {need} open files, and this process may have {limit}: \
             raise the limit (ulimit -n, or ulimit -Hn as root) and try again",
            plan.connections
        );
    }
    let before = server_rss(&plan.server_pids)?;
    let shared = Shared {
        stop: AtomicBool::new(false),
        opened: AtomicU64::new(0),
        full: AtomicU64::new(0),
        resumed: AtomicU64::new(0),
        failure: Mutex::new(None),
    };
    let t0 = Instant::now();
    let mut oldest: Option<Live> = None;
    let mut held: Vec<TcpStream> = Vec::with_capacity(plan.connections);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..plan.threads)
            .map(|t| {
                let shared = &shared;
                scope.spawn(move || open_share(plan, t, shared))
            })
            .collect();
        let mut last_report = Instant::now();
        while !workers.iter().all(|w| w.is_finished()) {
            std::thread::sleep(Duration::from_millis(100));
            if last_report.elapsed() >= Duration::from_secs(10) {
                last_report = Instant::now();
                let n = shared.opened.load(Ordering::Relaxed);
                eprintln!(
                    "bench hold: {n} of {} open after {:.0} s",
                    plan.connections,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        for w in workers {
            match w.join() {
                Ok((live, socks)) => {
                    if live.is_some() {
                        oldest = live;
                    }
                    held.extend(socks);
                }
                Err(_) => shared.fail(usize::MAX, "an opening thread panicked".into()),
            }
        }
    });
    let open_secs = t0.elapsed().as_secs_f64();
    let count = held.len() + usize::from(oldest.is_some());
    std::thread::sleep(plan.settle);
    let after = server_rss(&plan.server_pids)?;
    let per = match (before, after) {
        (Some(b), Some(a)) if count > 0 => Some((a as f64 - b as f64) / count as f64),
        _ => None,
    };
    // Before the checks, whose new connection could make a server close idle ones.
    let still_open = held.iter().filter(|s| still_open(s)).count()
        + usize::from(oldest.as_ref().is_some_and(|l| still_open(&l.sock)));
    let mut buf = vec![0u8; 64 * 1024];
    let (oldest_served_ms, oldest_failure) = match oldest.as_mut() {
        Some(live) => {
            let t = Instant::now();
            match get(&mut live.conn, &mut live.sock, &plan.request, &mut buf) {
                Ok(()) => (Some(ms(t)), None),
                Err(f) => (None, Some(f.reason())),
            }
        }
        None => (None, Some("no connection was opened".into())),
    };
    let t = Instant::now();
    let (new_served_ms, new_failure) = match open_one(plan, 0, &mut buf) {
        Ok(_) => (Some(ms(t)), None),
        Err(f) => (None, Some(f.reason())),
    };
    if !plan.hold.is_zero() {
        eprintln!(
            "bench hold: holding {count} connections for {:.0} s",
            plan.hold.as_secs_f64()
        );
        std::thread::sleep(plan.hold);
    }
    let failure = shared
        .failure
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .map(|(i, why)| format!("connection #{i}: {why}"));
    Ok(HoldReport {
        target: plan.target_label.clone(),
        threads: plan.threads,
        path: plan.path.clone(),
        wanted: plan.connections,
        held: count,
        still_open,
        open_secs,
        full_handshakes: shared.full.load(Ordering::Relaxed),
        resumed_handshakes: shared.resumed.load(Ordering::Relaxed),
        failure,
        server_pids: plan.server_pids.clone(),
        server_rss_before_kib: before,
        server_rss_after_kib: after,
        server_kib_per_connection: per,
        oldest_served_ms,
        oldest_failure,
        new_served_ms,
        new_failure,
    })
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Opens connections `t`, `t + threads`, `t + 2 threads`, ... until the plan's count or a
/// failure anywhere. Connection 0 keeps its TLS state.
fn open_share(plan: &HoldPlan, t: usize, shared: &Shared) -> (Option<Live>, Vec<TcpStream>) {
    let mut live = None;
    let mut socks = Vec::with_capacity(plan.connections / plan.threads + 1);
    let mut buf = vec![0u8; 64 * 1024];
    let mut i = t;
    while i < plan.connections && !shared.stop.load(Ordering::Relaxed) {
        match open_one(plan, i, &mut buf) {
            Ok(l) => {
                match l.conn.handshake_kind() {
                    Some(HandshakeKind::Resumed) => &shared.resumed,
                    _ => &shared.full,
                }
                .fetch_add(1, Ordering::Relaxed);
                shared.opened.fetch_add(1, Ordering::Relaxed);
                if i == 0 {
                    live = Some(l);
                } else {
                    // The TLS state goes; the connection stays open.
                    socks.push(l.sock);
                }
            }
            Err(f) => shared.fail(i, f.reason()),
        }
        i += plan.threads;
    }
    (live, socks)
}

/// Connection `i`: from source address `i mod sources`, handshake, one keep-alive GET.
fn open_one(plan: &HoldPlan, i: usize, buf: &mut [u8]) -> Result<Live, Failure> {
    let source = (!plan.sources.is_empty()).then(|| plan.sources[i % plan.sources.len()]);
    let mut sock = crate::net::connect_from(&plan.addr, source, plan.timeout)
        .map_err(Failure::from_connect)?;
    let mut conn = ClientConnection::new(plan.config.clone(), plan.server_name.clone())
        .map_err(Failure::Handshake)?;
    while conn.is_handshaking() {
        let r = if conn.wants_write() {
            conn.write_tls(&mut sock)
        } else {
            match conn.read_tls(&mut sock) {
                Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => conn
                    .process_new_packets()
                    .map(|_| n)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
                Err(e) => Err(e),
            }
        };
        r.map_err(|e| Failure::from_io(e, true))?;
    }
    get(&mut conn, &mut sock, &plan.request, buf)?;
    Ok(Live { conn, sock })
}

/// One keep-alive GET: sends the request (with the client's Finished if still queued) and
/// reads the response whole, which must keep the connection open.
fn get(
    conn: &mut ClientConnection,
    sock: &mut TcpStream,
    req: &[u8],
    buf: &mut [u8],
) -> Result<(), Failure> {
    conn.writer()
        .write_all(req)
        .map_err(|e| Failure::from_io(e, false))?;
    while conn.wants_write() {
        conn.write_tls(sock)
            .map_err(|e| Failure::from_io(e, false))?;
    }
    let mut s = rustls::Stream::new(conn, sock);
    let (head, filled) = read_head(&mut s, buf)?;
    if !(200..300).contains(&head.status) {
        return Err(Failure::BadStatus(head.status));
    }
    if head.close {
        return Err(Failure::BadResponse("the server closes the connection"));
    }
    let Some(len) = head.content_length else {
        return Err(Failure::BadResponse(
            "no Content-Length on a keep-alive response",
        ));
    };
    let mut need = len.saturating_sub((filled - head.len) as u64);
    while need > 0 {
        let want = buf.len().min(usize::try_from(need).unwrap_or(usize::MAX));
        match s.read(&mut buf[..want]) {
            Ok(0) => return Err(Failure::BadResponse("closed in the middle of the body")),
            Ok(n) => need -= n as u64,
            Err(e) => return Err(Failure::from_io(e, false)),
        }
    }
    Ok(())
}

/// Whether the server has sent nothing on this idle connection: neither an end (FIN or reset)
/// nor bytes (an alert before closing). Every response on it was read whole.
fn still_open(sock: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    if sock.set_nonblocking(true).is_err() {
        return false;
    }
    let open = matches!(sock.peek(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
    let _ = sock.set_nonblocking(false);
    open
}

/// Sum of the resident sets of `pids` (KiB), or `None` when none was given.
fn server_rss(pids: &[u32]) -> Result<Option<u64>> {
    if pids.is_empty() {
        return Ok(None);
    }
    let mut sum = 0;
    for pid in pids {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| anyhow::anyhow!("--server-pid {pid}: {e}"))?;
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .ok_or_else(|| anyhow::anyhow!("--server-pid {pid}: no VmRSS in /proc/{pid}/status"))?;
        sum += kib;
    }
    Ok(Some(sum))
}
