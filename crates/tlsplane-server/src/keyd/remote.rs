//! `keyd --listen-tls`: servers on other hosts, over TCP and TLS 1.3, one thread per
//! connection.
//!
//! Anyone who can reach the port can open connections before any certificate is checked, so
//! what an unauthenticated peer can hold is bounded: its handshake has an absolute deadline
//! from the accept (not a timeout per read, which one byte every few seconds would renew for
//! ever); its address may hold `--max-tls-connections-per-address` (an IPv6 address is counted
//! by its `--tls-ipv6-prefix`, a /64 by default, which one host usually has whole); and when
//! `--max-tls-handshakes` are in progress a new connection takes the place of one only as
//! [`State::victim`] says, which never cuts short a server's handshake for a flood's.
//!
//! A certificate of the client CA is not a grant: one that no `--authorize` rule names is told
//! so and closed right after its handshake. An established connection with no request for
//! `--tls-idle-timeout` is closed (a server's pool opens another when it needs one), and one
//! client name holds at most `--max-tls-connections-per-client`, so that one host's
//! certificate cannot take every one of `--max-tls-connections` from the others. Each refusal
//! is counted, and logged at most once a second per kind.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tlsplane::keyd::{self as proto, op};

use super::counters::{counters, more, LogLimit};
use super::grants::{CertNames, Clients, Grant, Rule};
use super::{answer, Caller, Source, Store};

/// How long a reply may wait for the client to take it.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the TLS listener admits.
#[derive(Clone, Debug)]
pub struct Limits {
    pub handshake_timeout: Duration,
    /// How young a handshake is never cut short for a new connection's (but by one from a
    /// host that holds an established connection, or of an address with fewer).
    pub handshake_grace: Duration,
    pub max_handshakes: usize,
    pub max_connections: usize,
    pub max_per_address: usize,
    pub max_per_client: usize,
    /// Bits of an IPv6 address that make one "address" for the caps.
    pub ipv6_prefix: u8,
    /// How long an established connection may go without a request.
    pub idle_timeout: Duration,
}

/// What every connection's thread shares.
pub struct Shared {
    pub config: Arc<rustls::ServerConfig>,
    pub store: Arc<RwLock<Store>>,
    pub source: Arc<Source>,
    pub rules: Vec<Rule>,
    pub clients: Arc<Clients>,
    /// Signatures a second per client (0: no limit).
    pub sign_rate: u32,
    pub limits: Limits,
}

static REFUSED_LOG: LogLimit = LogLimit::new();
static HANDSHAKE_LOG: LogLimit = LogLimit::new();
static ACCEPT_LOG: LogLimit = LogLimit::new();
static CLIENT_LOG: LogLimit = LogLimit::new();
static EVICTED_LOG: LogLimit = LogLimit::new();

/// Accepts connections, each served by a thread of its own.
pub fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let admission = Arc::new(Admission::new(shared.limits.clone()));
    loop {
        let (tcp, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                if let Some(n) = ACCEPT_LOG.allow() {
                    tracing::warn!(error = %e, "keyd: accept failed{}", more(n));
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let slot = match admission.admit(&tcp, peer.ip()) {
            Ok(slot) => slot,
            Err(refusal) => {
                refusal.count();
                if let Some(n) = REFUSED_LOG.allow() {
                    tracing::warn!("keyd: connection from {peer} refused: {refusal}{}", more(n));
                }
                continue;
            }
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("keyd-tls-conn".into())
            .spawn(move || serve_conn(tcp, peer.to_string(), slot, &shared));
        if let Err(e) = spawned {
            if let Some(n) = ACCEPT_LOG.allow() {
                tracing::warn!(error = %e, "keyd: no thread for a connection{}", more(n));
            }
        }
    }
}

/// One connection: the handshake within its deadline, then, for a client the rules grant keys,
/// requests until it closes or goes idle.
fn serve_conn(tcp: TcpStream, peer: String, mut slot: Slot, shared: &Shared) {
    let _ = tcp.set_nodelay(true);
    let deadline = slot.accepted + shared.limits.handshake_timeout;
    let tls = match handshake(&tcp, shared.config.clone(), deadline, &slot.progress) {
        Ok(tls) => tls,
        Err(e) => {
            let c = counters();
            let (counter, what) = if slot.evicted() {
                // Counted when it was cut short.
                return;
            } else if e.kind() == io::ErrorKind::TimedOut {
                (&c.tls_handshakes_timed_out, "not done in time")
            } else {
                (&c.tls_handshakes_failed, "failed")
            };
            counter.fetch_add(1, Relaxed);
            if let Some(n) = HANDSHAKE_LOG.allow() {
                tracing::warn!("keyd: TLS handshake from {peer} {what}: {e}{}", more(n));
            }
            return;
        }
    };
    let names = tls
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|leaf| CertNames::of(leaf.as_ref()))
        .unwrap_or_default();
    let grant = Grant::for_names(&shared.rules, &names);
    if grant.is_empty() {
        counters().tls_refused_no_grant.fetch_add(1, Relaxed);
        if let Some(n) = CLIENT_LOG.allow() {
            tracing::warn!(
                "keyd: client {} from {peer} matches no --authorize rule: closed{}",
                names.first(),
                more(n)
            );
        }
        // Said to the client (its server logs it), as the answer to its first request.
        let why = format!(
            "client {} may use no key of this daemon (keyd --authorize)",
            names.first()
        );
        refuse(tcp, tls, &why);
        return;
    }
    if let Err(refusal) = slot.established(&grant.client) {
        refusal.count();
        if let Some(n) = REFUSED_LOG.allow() {
            tracing::warn!("keyd: connection from {peer} closed: {refusal}{}", more(n));
        }
        return;
    }
    let client = shared.clients.get(&grant.client, shared.sign_rate);
    if let Err(e) = requests(tcp, tls, shared, &grant, &client) {
        tracing::debug!(
            "keyd: connection from {peer} ({}) closed: {e}",
            grant.client
        );
    }
}

/// The TLS handshake, every read and write within what is left until `deadline`; `progress`
/// says how far it got.
fn handshake(
    tcp: &TcpStream,
    config: Arc<rustls::ServerConfig>,
    deadline: Instant,
    progress: &AtomicU8,
) -> io::Result<rustls::ServerConnection> {
    let mut tls = rustls::ServerConnection::new(config).map_err(io::Error::other)?;
    let mut io = UntilDeadline {
        tcp,
        deadline,
        progress,
    };
    while tls.is_handshaking() {
        if let Err(e) = tls.complete_io(&mut io) {
            // The alert, if rustls made one (a refused certificate), before the close.
            let _ = tls.write_tls(&mut io);
            return Err(e);
        }
    }
    Ok(tls)
}

/// An error frame with `why`, then close_notify, on a connection that is closed next.
fn refuse(tcp: TcpStream, tls: rustls::ServerConnection, why: &str) {
    if tcp.set_write_timeout(Some(Duration::from_secs(1))).is_err() {
        return;
    }
    let mut stream = rustls::StreamOwned::new(tls, tcp);
    if stream
        .write_all(&proto::tls::frame(&super::err(why)))
        .is_ok()
    {
        close_notify(&mut stream);
    }
}

fn close_notify(stream: &mut rustls::StreamOwned<rustls::ServerConnection, TcpStream>) {
    stream.conn.send_close_notify();
    let _ = stream.flush();
}

/// Framed requests, each answered as over the Unix socket but for what this client may do.
fn requests(
    tcp: TcpStream,
    tls: rustls::ServerConnection,
    shared: &Shared,
    grant: &Grant,
    client: &super::grants::Client,
) -> io::Result<()> {
    // Servers keep connections between signatures; one idle for longer than the limit is
    // closed (the server's next call on it is made again on a new one), so that neither an
    // idle pool nor a peer gone silently holds a thread for ever.
    tcp.set_read_timeout(Some(shared.limits.idle_timeout))?;
    tcp.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))?;
    let mut stream = rustls::StreamOwned::new(tls, tcp);
    let mut request = Vec::with_capacity(proto::MAX_MESSAGE);
    let caller = Caller::Remote {
        grant,
        client,
        sign_rate: shared.sign_rate,
    };
    loop {
        match proto::tls::read_frame(&mut stream, &mut request) {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                counters().tls_idle_closed.fetch_add(1, Relaxed);
                close_notify(&mut stream);
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        let reply = match request.as_slice() {
            [op::PING] => vec![proto::OK],
            _ => answer(&request, &shared.store, &shared.source, &caller),
        };
        stream.write_all(&proto::tls::frame(&reply))?;
        stream.flush()?;
    }
}

/// The socket as the handshake sees it: each read and write waits at most what is left until
/// the deadline, and one a signal interrupted is made again with what is left then. Bytes
/// read, then bytes written (the answer to a whole ClientHello), are progress.
struct UntilDeadline<'a> {
    tcp: &'a TcpStream,
    deadline: Instant,
    progress: &'a AtomicU8,
}

fn past_deadline() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "past the handshake's deadline")
}

impl UntilDeadline<'_> {
    fn timed(
        &self,
        set_timeout: impl Fn(&TcpStream, Duration) -> io::Result<()>,
        mut f: impl FnMut(&TcpStream) -> io::Result<usize>,
        progress: u8,
    ) -> io::Result<usize> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(past_deadline());
            }
            set_timeout(self.tcp, left)?;
            match f(self.tcp) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(past_deadline()),
                Ok(n) if n > 0 => {
                    self.progress.fetch_max(progress, Relaxed);
                    return Ok(n);
                }
                r => return r,
            }
        }
    }
}

impl Read for UntilDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.timed(
            |s, t| s.set_read_timeout(Some(t)),
            |mut s| s.read(buf),
            progress::HELLO_STARTED,
        )
    }
}

impl Write for UntilDeadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.timed(
            |s, t| s.set_write_timeout(Some(t)),
            |mut s| s.write(buf),
            progress::ANSWERED,
        )
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// How far a handshake got, least first.
mod progress {
    /// Nothing received.
    pub const NOTHING: u8 = 0;
    /// Bytes received, not yet a whole ClientHello.
    pub const HELLO_STARTED: u8 = 1;
    /// The ClientHello answered: the client's certificate is awaited.
    pub const ANSWERED: u8 = 2;
}

/// Where a peer's connections are counted: its IPv4 address, or the first `prefix` bits of its
/// IPv6 address (one host is usually given a whole /64, and can pick any address in it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Bucket {
    net: IpAddr,
    prefix: u8,
}

impl Bucket {
    fn of(addr: IpAddr, ipv6_prefix: u8) -> Bucket {
        match addr.to_canonical() {
            IpAddr::V4(a) => Bucket {
                net: IpAddr::V4(a),
                prefix: 32,
            },
            IpAddr::V6(a) => {
                let prefix = ipv6_prefix.clamp(1, 128);
                let mask = u128::MAX << (128 - u32::from(prefix));
                Bucket {
                    net: IpAddr::V6((u128::from(a) & mask).into()),
                    prefix,
                }
            }
        }
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.net {
            IpAddr::V6(_) if self.prefix < 128 => write!(f, "{}/{}", self.net, self.prefix),
            _ => write!(f, "{}", self.net),
        }
    }
}

/// Why a connection was closed, and what counts it (none: counted already).
struct Refusal {
    counter: Option<&'static AtomicU64>,
    why: String,
}

impl Refusal {
    fn new(counter: &'static AtomicU64, why: String) -> Refusal {
        Refusal {
            counter: Some(counter),
            why,
        }
    }

    fn count(&self) {
        if let Some(c) = self.counter {
            c.fetch_add(1, Relaxed);
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.why)
    }
}

/// The connections open: per address, per client, and which are still in their handshake.
struct Admission {
    limits: Limits,
    state: Mutex<State>,
}

/// One address's connections.
#[derive(Default)]
struct PerBucket {
    /// Open, handshakes included.
    open: usize,
    /// Established (each a client the rules grant keys): a server that is in already.
    established: usize,
}

/// A handshake in progress.
struct Handshake {
    bucket: Bucket,
    /// Shut down if it must give way.
    sock: TcpStream,
    accepted: Instant,
    progress: Arc<AtomicU8>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    buckets: HashMap<Bucket, PerBucket>,
    /// By id, oldest first.
    handshakes: BTreeMap<u64, Handshake>,
    established: usize,
    per_client: HashMap<String, usize>,
}

impl State {
    /// The handshake a new connection from `from` takes the place of, when the handshakes in
    /// progress are at their cap; none: the new connection is refused.
    ///
    /// 1. A connection from a host that holds an established connection (a server that is
    ///    in) displaces any handshake of a host that holds none: however many addresses a
    ///    flood comes from, it keeps no server that is in from opening more connections.
    /// 2. Among the handshakes it may displace (those of hosts that hold none, unless it is
    ///    from one that holds one), the address with the most gives way if it has more than
    ///    the new connection's would: one address (or IPv6 prefix) keeps no other out.
    /// 3. Otherwise a handshake past the grace period gives way: one younger (a server's
    ///    takes a few round trips) is never cut short for a peer spread as thin.
    ///
    /// Each takes, of those it may, one past the grace period first, then the least advanced
    /// (nothing received, then a ClientHello not yet whole, then one answered), then the
    /// oldest.
    fn victim(&self, from: Bucket, grace: Duration, now: Instant) -> Option<u64> {
        let is_in = |b: &Bucket| self.buckets.get(b).is_some_and(|c| c.established > 0);
        let young = |h: &Handshake| now.saturating_duration_since(h.accepted) < grace;
        let first = |may: &dyn Fn(&Handshake) -> bool| {
            self.handshakes
                .iter()
                .filter(|(_, h)| may(h))
                .min_by_key(|(id, h)| (young(h), h.progress.load(Relaxed), **id))
                .map(|(id, _)| *id)
        };
        let from_in = is_in(&from);
        if from_in {
            if let Some(v) = first(&|h| !is_in(&h.bucket)) {
                return Some(v);
            }
        }
        let may = |h: &Handshake| from_in || !is_in(&h.bucket);
        // Handshakes per address, and each one's oldest (the tie-break: the longest held).
        let mut per: HashMap<Bucket, (usize, std::cmp::Reverse<u64>)> = HashMap::new();
        for (&id, h) in self.handshakes.iter().filter(|(_, h)| may(h)) {
            per.entry(h.bucket).or_insert((0, std::cmp::Reverse(id))).0 += 1;
        }
        let own = per.get(&from).map_or(0, |p| p.0);
        if let Some((&most, _)) = per
            .iter()
            .filter(|(_, p)| p.0 > own + 1)
            .max_by_key(|(_, p)| **p)
        {
            return first(&|h| h.bucket == most);
        }
        first(&|h| may(h) && !young(h))
    }
}

impl Admission {
    fn new(limits: Limits) -> Self {
        Admission {
            limits,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a connection from `addr` in its handshake, or why there is none.
    fn admit(self: &Arc<Self>, tcp: &TcpStream, addr: IpAddr) -> Result<Slot, Refusal> {
        let c = counters();
        let bucket = Bucket::of(addr, self.limits.ipv6_prefix);
        let watch = tcp.try_clone().map_err(|e| {
            Refusal::new(
                &c.tls_handshakes_failed,
                format!("cannot keep its socket: {e}"),
            )
        })?;
        let mut s = self.lock();
        let open = s.buckets.get(&bucket).map_or(0, |b| b.open);
        if open >= self.limits.max_per_address {
            return Err(Refusal::new(
                &c.tls_refused_per_address,
                format!(
                    "{open} connections from {bucket} already (--max-tls-connections-per-address)"
                ),
            ));
        }
        let now = Instant::now();
        if s.handshakes.len() >= self.limits.max_handshakes {
            let Some(victim) = s.victim(bucket, self.limits.handshake_grace, now) else {
                return Err(Refusal::new(
                    &c.tls_refused_handshakes_full,
                    format!(
                        "{} TLS handshakes in progress (--max-tls-handshakes), none of which may \
                         give way (--tls-handshake-grace)",
                        s.handshakes.len()
                    ),
                ));
            };
            if let Some(h) = s.handshakes.remove(&victim) {
                // Wakes its thread, blocked in a read, with an end of file.
                let _ = h.sock.shutdown(std::net::Shutdown::Both);
                c.tls_handshakes_evicted.fetch_add(1, Relaxed);
                if let Some(n) = EVICTED_LOG.allow() {
                    tracing::warn!(
                        "keyd: {} TLS handshakes in progress (--max-tls-handshakes): one from \
                         {} gave way to a new connection from {bucket}{}",
                        self.limits.max_handshakes,
                        h.bucket,
                        more(n)
                    );
                }
            }
        }
        s.next_id += 1;
        let id = s.next_id;
        let progress = Arc::new(AtomicU8::new(progress::NOTHING));
        s.handshakes.insert(
            id,
            Handshake {
                bucket,
                sock: watch,
                accepted: now,
                progress: progress.clone(),
            },
        );
        s.buckets.entry(bucket).or_default().open += 1;
        Ok(Slot {
            admission: self.clone(),
            id,
            bucket,
            accepted: now,
            progress,
            stage: Stage::Handshake,
        })
    }
}

/// Where an admitted connection is.
#[derive(Debug, PartialEq, Eq)]
enum Stage {
    Handshake,
    /// Its handshake is over (or was cut short), and it is not established.
    Closing,
    /// Established, as this client.
    Established(String),
}

/// One admitted connection; its place is given back when dropped.
struct Slot {
    admission: Arc<Admission>,
    id: u64,
    bucket: Bucket,
    accepted: Instant,
    progress: Arc<AtomicU8>,
    stage: Stage,
}

impl Slot {
    /// Whether its handshake was cut short for another connection.
    fn evicted(&self) -> bool {
        self.stage == Stage::Handshake && !self.admission.lock().handshakes.contains_key(&self.id)
    }

    /// Its handshake is done, by `client`, whom the rules grant keys: it becomes an
    /// established connection, if there is room.
    fn established(&mut self, client: &str) -> Result<(), Refusal> {
        let limits = &self.admission.limits;
        let c = counters();
        let mut s = self.admission.lock();
        let was_handshake = s.handshakes.remove(&self.id).is_some();
        self.stage = Stage::Closing;
        if !was_handshake {
            return Err(Refusal {
                counter: None,
                why: "its handshake was cut short for another connection".into(),
            });
        }
        if s.established >= limits.max_connections {
            return Err(Refusal::new(
                &c.tls_refused_full,
                format!(
                    "{} connections established already (--max-tls-connections)",
                    s.established
                ),
            ));
        }
        let of_client = s.per_client.get(client).copied().unwrap_or(0);
        if of_client >= limits.max_per_client {
            return Err(Refusal::new(
                &c.tls_refused_per_client,
                format!(
                    "{of_client} connections of client {client} already \
                     (--max-tls-connections-per-client)"
                ),
            ));
        }
        s.established += 1;
        *s.per_client.entry(client.to_string()).or_insert(0) += 1;
        s.buckets.entry(self.bucket).or_default().established += 1;
        self.stage = Stage::Established(client.to_string());
        Ok(())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.admission.lock();
        match &self.stage {
            Stage::Handshake => {
                s.handshakes.remove(&self.id);
            }
            Stage::Closing => {}
            Stage::Established(client) => {
                s.established -= 1;
                if let Some(n) = s.per_client.get_mut(client) {
                    *n -= 1;
                    if *n == 0 {
                        s.per_client.remove(client);
                    }
                }
                if let Some(b) = s.buckets.get_mut(&self.bucket) {
                    b.established -= 1;
                }
            }
        }
        if let Some(b) = s.buckets.get_mut(&self.bucket) {
            b.open -= 1;
            if b.open == 0 {
                s.buckets.remove(&self.bucket);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_handshakes: usize, max_per_address: usize) -> Limits {
        Limits {
            handshake_timeout: Duration::from_secs(10),
            handshake_grace: Duration::from_secs(2),
            max_handshakes,
            max_connections: 2,
            max_per_address,
            max_per_client: 1,
            ipv6_prefix: 64,
            idle_timeout: Duration::from_secs(600),
        }
    }

    /// A connected pair on loopback, the accepted end first.
    fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (listener.accept().unwrap().0, client)
    }

    /// A connection admitted as if from `addr`, or the refusal; the peer's end is dropped.
    fn admit(
        admission: &Arc<Admission>,
        listener: &TcpListener,
        addr: &str,
    ) -> Result<Slot, String> {
        let (s, _client) = pair(listener);
        admission
            .admit(&s, addr.parse().unwrap())
            .map_err(|r| r.why)
    }

    #[test]
    fn a_full_house_makes_the_address_with_the_most_handshakes_give_way() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let admission = Arc::new(Admission::new(limits(4, 3)));
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        );
        let mut keep = Vec::new();
        let mut slots = Vec::new();
        for addr in [b, a, a, a] {
            let (s, client) = pair(&listener);
            slots.push(admission.admit(&s, addr).ok().unwrap());
            keep.push((s, client));
        }
        // A fourth from a: over its cap.
        let (s, _client) = pair(&listener);
        let refused = admission.admit(&s, a).err().expect("over the cap").why;
        assert!(refused.contains("3 connections from 10.0.0.1"), "{refused}");
        // c comes in: a's oldest gives way, young as it is, not b's single one.
        let (s, _c) = pair(&listener);
        let c_slot = admission.admit(&s, c).ok().unwrap();
        assert!(slots[1].evicted() && !slots[0].evicted() && !slots[2].evicted());
        // The evicted one's socket was shut down: its client reads the end.
        let mut buf = [0u8; 1];
        keep[1]
            .1
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        assert_eq!(keep[1].1.read(&mut buf).unwrap(), 0);
        // Established ones no longer count as handshakes, and are capped apart: in all, and
        // per client.
        let mut b_slot = slots.remove(0);
        b_slot.established("x").ok().unwrap();
        let mut c_slot = c_slot;
        let per_client = c_slot.established("x").err().unwrap().why;
        assert!(
            per_client.contains("--max-tls-connections-per-client"),
            "{per_client}"
        );
        let mut third = slots.remove(1);
        third.established("y").ok().unwrap();
        let mut fourth = slots.remove(1);
        let full = fourth.established("z").err().unwrap().why;
        assert!(full.contains("--max-tls-connections)"), "{full}");
        drop((b_slot, c_slot, third, fourth, slots));
        let s = admission.lock();
        assert!(s.handshakes.is_empty() && s.buckets.is_empty() && s.established == 0);
        assert!(s.per_client.is_empty());
    }

    #[test]
    fn ipv6_peers_are_counted_by_their_prefix() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let admission = Arc::new(Admission::new(limits(100, 2)));
        let admit = |addr: &str| admit(&admission, &listener, addr);
        let _kept = [admit("2001:db8::1"), admit("2001:db8::ffff:2")];
        let refused = admit("2001:db8::3").err().expect("a third from the /64");
        assert!(
            refused.contains("2 connections from 2001:db8::/64"),
            "{refused}"
        );
        let _other_prefix = admit("2001:db8:0:1::1").expect("another /64");
        // IPv4 addresses, also written as IPv4-mapped IPv6 ones, each count alone.
        let _v4 = [admit("10.0.0.1"), admit("::ffff:10.0.0.1")];
        let refused = admit("10.0.0.1").err().expect("a third from 10.0.0.1");
        assert!(
            refused.contains("2 connections from 10.0.0.1 "),
            "{refused}"
        );
        let _v4_other = admit("10.0.0.2").expect("another address");
        let bucket = |a: &str, bits| Bucket::of(a.parse().unwrap(), bits).to_string();
        assert_eq!(bucket("2001:db8:1:2:3::1", 48), "2001:db8:1::/48");
        assert_eq!(bucket("2001:db8::1", 128), "2001:db8::1");
    }

    #[test]
    fn a_flood_spread_thin_cuts_short_no_young_handshake_and_no_server_that_is_in() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut l = limits(3, 10);
        l.max_per_client = 10;
        let grace = l.handshake_grace;
        let admission = Arc::new(Admission::new(l));
        let admit = |addr: &str| admit(&admission, &listener, addr);
        let server = "10.9.9.9";
        // A server that is in: its connection established.
        let mut pooled = admit(server).unwrap();
        pooled.established("s").ok().unwrap();
        // Three handshakes from three addresses, all young: a fourth from a fourth address is
        // refused, and none is cut short (the oldest used to give way).
        let peers: Vec<Slot> = (1..=3)
            .map(|i| admit(&format!("10.0.1.{i}")).unwrap())
            .collect();
        let refused = admit("10.0.1.4").err().expect("no room");
        assert!(refused.contains("none of which may give way"), "{refused}");
        assert!(peers.iter().all(|p| !p.evicted()));
        // Past the grace period: the least advanced gives way first, then the oldest.
        let later = Instant::now() + grace + Duration::from_secs(1);
        let newcomer = Bucket::of("10.0.1.4".parse().unwrap(), 64);
        peers[0].progress.store(progress::ANSWERED, Relaxed);
        peers[1].progress.store(progress::HELLO_STARTED, Relaxed);
        peers[2].progress.store(progress::HELLO_STARTED, Relaxed);
        let victim = |at| admission.lock().victim(newcomer, grace, at);
        assert_eq!(victim(later), Some(peers[1].id));
        peers[2].progress.store(progress::NOTHING, Relaxed);
        assert_eq!(victim(later), Some(peers[2].id));
        // The server opens another connection: it takes the place of one, young as they are...
        let second = admit(server).expect("a server that is in, kept out");
        assert!(peers[2].evicted() && !peers[0].evicted() && !peers[1].evicted());
        // ...and no peer of a host that is not in cuts its handshake short, however old.
        assert_eq!(victim(later), Some(peers[1].id));
        drop(peers);
        let lone = admit("10.0.1.5").unwrap();
        let _other = admit("10.0.1.6").unwrap();
        assert_eq!(victim(later + Duration::from_secs(60)), Some(lone.id));
        assert!(!second.evicted());
    }
}
