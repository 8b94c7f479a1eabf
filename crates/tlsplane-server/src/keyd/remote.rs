//! `keyd --listen-tls`: servers on other hosts, over TCP and TLS 1.3, one thread per
//! connection.
//!
//! Anyone who can reach the port can open connections before any certificate is checked, so
//! what an unauthenticated peer can hold is bounded three ways: its handshake has an absolute
//! deadline from the accept (not a timeout per read, which one byte every few seconds would
//! renew for ever); its address may hold `--max-tls-connections-per-address` at most; and
//! when `--max-tls-handshakes` are in progress a new connection makes room by cutting short
//! the oldest handshake of the address that has the most, so that peers sending slowly from
//! many addresses cannot keep a server's connection out. Established connections (each a
//! client certificate of the client CA) have their own cap, `--max-tls-connections`. Each
//! refusal is counted, and logged at most once a second per kind.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
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
    pub max_handshakes: usize,
    pub max_connections: usize,
    pub max_per_address: usize,
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
        let addr = peer.ip().to_canonical();
        let slot = match admission.admit(&tcp, addr) {
            Ok(slot) => slot,
            Err(why) => {
                counters().tls_refused_per_address.fetch_add(1, Relaxed);
                if let Some(n) = REFUSED_LOG.allow() {
                    tracing::warn!("keyd: connection from {peer} refused: {why}{}", more(n));
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

/// One connection: the handshake within its deadline, then requests until the client closes.
fn serve_conn(tcp: TcpStream, peer: String, mut slot: Slot, shared: &Shared) {
    let _ = tcp.set_nodelay(true);
    let deadline = slot.accepted + shared.limits.handshake_timeout;
    let tls = match handshake(&tcp, shared.config.clone(), deadline) {
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
    if let Err(why) = slot.established() {
        if !slot.evicted() {
            counters().tls_refused_full.fetch_add(1, Relaxed);
        }
        if let Some(n) = REFUSED_LOG.allow() {
            tracing::warn!("keyd: connection from {peer} closed: {why}{}", more(n));
        }
        return;
    }
    let names = tls
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|leaf| CertNames::of(leaf.as_ref()))
        .unwrap_or_default();
    let grant = Grant::for_names(&shared.rules, &names);
    if grant.is_empty() {
        if let Some(n) = CLIENT_LOG.allow() {
            tracing::warn!(
                "keyd: client {} from {peer} matches no --authorize rule: it may use no key{}",
                names.first(),
                more(n)
            );
        }
    }
    let client = shared.clients.get(&grant.client, shared.sign_rate);
    if let Err(e) = requests(tcp, tls, shared, &grant, &client) {
        tracing::debug!(
            "keyd: connection from {peer} ({}) closed: {e}",
            grant.client
        );
    }
}

/// The TLS handshake, every read and write within what is left until `deadline`.
fn handshake(
    tcp: &TcpStream,
    config: Arc<rustls::ServerConfig>,
    deadline: Instant,
) -> io::Result<rustls::ServerConnection> {
    let mut tls = rustls::ServerConnection::new(config).map_err(io::Error::other)?;
    let mut io = UntilDeadline { tcp, deadline };
    while tls.is_handshaking() {
        if let Err(e) = tls.complete_io(&mut io) {
            // The alert, if rustls made one (a refused certificate), before the close.
            let _ = tls.write_tls(&mut io);
            return Err(e);
        }
    }
    Ok(tls)
}

/// Framed requests, each answered as over the Unix socket but for what this client may do.
fn requests(
    tcp: TcpStream,
    tls: rustls::ServerConnection,
    shared: &Shared,
    grant: &Grant,
    client: &super::grants::Client,
) -> io::Result<()> {
    // Servers keep idle connections for their next signatures: no read deadline from now on.
    // A peer gone silently is found by keepalive.
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))?;
    let _ = socket2::SockRef::from(&tcp).set_keepalive(true);
    let mut stream = rustls::StreamOwned::new(tls, tcp);
    let mut request = Vec::with_capacity(proto::MAX_MESSAGE);
    let caller = Caller::Remote {
        grant,
        client,
        sign_rate: shared.sign_rate,
    };
    while proto::tls::read_frame(&mut stream, &mut request)? {
        let reply = match request.as_slice() {
            [op::PING] => vec![proto::OK],
            _ => answer(&request, &shared.store, &shared.source, &caller),
        };
        stream.write_all(&proto::tls::frame(&reply))?;
        stream.flush()?;
    }
    Ok(())
}

/// The socket as the handshake sees it: each read and write waits at most what is left until
/// the deadline, and one a signal interrupted is made again with what is left then.
struct UntilDeadline<'a> {
    tcp: &'a TcpStream,
    deadline: Instant,
}

fn past_deadline() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "past the handshake's deadline")
}

impl UntilDeadline<'_> {
    fn timed<T>(
        &self,
        set_timeout: impl Fn(&TcpStream, Duration) -> io::Result<()>,
        mut f: impl FnMut(&TcpStream) -> io::Result<T>,
    ) -> io::Result<T> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(past_deadline());
            }
            set_timeout(self.tcp, left)?;
            match f(self.tcp) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(past_deadline()),
                r => return r,
            }
        }
    }
}

impl Read for UntilDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.timed(|s, t| s.set_read_timeout(Some(t)), |mut s| s.read(buf))
    }
}

impl Write for UntilDeadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.timed(|s, t| s.set_write_timeout(Some(t)), |mut s| s.write(buf))
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The connections open: per address, and which are still in their handshake.
struct Admission {
    limits: Limits,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    per_address: HashMap<IpAddr, usize>,
    /// Handshakes in progress by id, oldest first: the address, and the socket to shut down
    /// if it must give way.
    handshakes: BTreeMap<u64, (IpAddr, TcpStream)>,
    established: usize,
}

impl State {
    /// The handshake to cut short: the oldest of the address with the most in progress.
    fn victim(&self) -> Option<u64> {
        let mut by_address: HashMap<IpAddr, (usize, u64)> = HashMap::new();
        for (&id, (addr, _)) in &self.handshakes {
            let e = by_address.entry(*addr).or_insert((0, id));
            e.0 += 1;
        }
        by_address
            .values()
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|&(_, oldest)| oldest)
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
    fn admit(self: &Arc<Self>, tcp: &TcpStream, addr: IpAddr) -> Result<Slot, String> {
        let watch = tcp
            .try_clone()
            .map_err(|e| format!("cannot keep its socket: {e}"))?;
        let mut s = self.lock();
        let open = s.per_address.get(&addr).copied().unwrap_or(0);
        if open >= self.limits.max_per_address {
            return Err(format!(
                "{open} connections from {addr} already (--max-tls-connections-per-address)"
            ));
        }
        if s.handshakes.len() >= self.limits.max_handshakes {
            if let Some(victim) = s.victim() {
                if let Some((from, sock)) = s.handshakes.remove(&victim) {
                    // Wakes its thread, blocked in a read, with an end of file.
                    let _ = sock.shutdown(std::net::Shutdown::Both);
                    counters().tls_handshakes_evicted.fetch_add(1, Relaxed);
                    if let Some(n) = EVICTED_LOG.allow() {
                        tracing::warn!(
                            "keyd: {} TLS handshakes in progress (--max-tls-handshakes): one from \
                             {from} gave way to a new connection{}",
                            self.limits.max_handshakes,
                            more(n)
                        );
                    }
                }
            }
        }
        s.next_id += 1;
        let id = s.next_id;
        s.handshakes.insert(id, (addr, watch));
        *s.per_address.entry(addr).or_insert(0) += 1;
        Ok(Slot {
            admission: self.clone(),
            id,
            addr,
            accepted: Instant::now(),
            established: false,
        })
    }
}

/// One admitted connection; its place is given back when dropped.
struct Slot {
    admission: Arc<Admission>,
    id: u64,
    addr: IpAddr,
    accepted: Instant,
    established: bool,
}

impl Slot {
    /// Whether its handshake was cut short for another connection.
    fn evicted(&self) -> bool {
        !self.established && !self.admission.lock().handshakes.contains_key(&self.id)
    }

    /// Its handshake is done: it becomes an established connection, if there is room.
    fn established(&mut self) -> Result<(), String> {
        let mut s = self.admission.lock();
        if s.handshakes.remove(&self.id).is_none() {
            return Err("its handshake was cut short for another connection".into());
        }
        if s.established >= self.admission.limits.max_connections {
            // Its place in the handshakes is gone: Drop gives back only its address's.
            self.established = true;
            s.established += 1;
            return Err(format!(
                "{} connections established already (--max-tls-connections)",
                s.established - 1
            ));
        }
        s.established += 1;
        self.established = true;
        Ok(())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.admission.lock();
        if self.established {
            s.established -= 1;
        } else {
            s.handshakes.remove(&self.id);
        }
        if let Some(n) = s.per_address.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                s.per_address.remove(&self.addr);
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
            max_handshakes,
            max_connections: 2,
            max_per_address,
        }
    }

    /// A connected pair on loopback, the accepted end first.
    fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (listener.accept().unwrap().0, client)
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
            slots.push(admission.admit(&s, addr).unwrap());
            keep.push((s, client));
        }
        // A fourth from a: over its cap.
        let (s, _client) = pair(&listener);
        let refused = admission.admit(&s, a).err().expect("over the cap");
        assert!(refused.contains("3 connections from 10.0.0.1"), "{refused}");
        // c comes in: a's oldest gives way, not b's single one.
        let (s, _c) = pair(&listener);
        let c_slot = admission.admit(&s, c).unwrap();
        assert!(slots[1].evicted() && !slots[0].evicted() && !slots[2].evicted());
        // The evicted one's socket was shut down: its client reads the end.
        let mut buf = [0u8; 1];
        keep[1]
            .1
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        assert_eq!(keep[1].1.read(&mut buf).unwrap(), 0);
        // Established ones no longer count as handshakes, and are capped apart.
        let mut b_slot = slots.remove(0);
        b_slot.established().unwrap();
        let mut c_slot = c_slot;
        c_slot.established().unwrap();
        let mut third = slots.remove(1);
        assert!(third
            .established()
            .unwrap_err()
            .contains("--max-tls-connections"));
        drop((b_slot, c_slot, third, slots));
        let s = admission.lock();
        assert!(s.handshakes.is_empty() && s.per_address.is_empty() && s.established == 0);
    }
}
