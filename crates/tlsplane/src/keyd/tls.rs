//! Key daemons on other hosts: the requests and replies of the Unix protocol (see the parent
//! module), over TCP with mutual TLS, to one daemon or several for failover.
//!
//! A TCP stream has no message boundaries, so each message is framed: `[length u32,
//! big-endian][message]`, the length between 1 and [`MAX_MESSAGE`]; anything else ends the
//! connection. There is no HELLO and no token: the client's certificate, issued by the CA the
//! daemon is given, is what authenticates it (and the daemon's, by the CA the client is given,
//! the daemon), and the names it bears decide which keys it may use (the daemon's
//! `--authorize`). HANDOFF, RELOAD and COMMIT are never served over TLS: keys do not leave a
//! remote daemon, and no client makes one drop or re-read keys that other servers use (its
//! host reloads it). A server's reload only asks the daemons for its keys again (KEY).
//!
//! Several daemons ([`KeydFleet`]) are used in turn, each signature on one. A call that is lost
//! (connection closed or reset, no daemon listening) is tried again at once on the next daemon,
//! and the daemon that lost it is taken out of use (counted in `keyd_failovers`); a call that
//! is not answered within the timeout fails its handshake (waiting on another daemon as well
//! would pass the handshake's own deadline), and takes that daemon out of use too. A daemon
//! out of use is tried again by [`KeydFleet::probe`] (connect, TLS handshake, PING), with a
//! growing delay; once it answers it is used again. Each daemon numbers its keys its own way,
//! so a key knows its handle per daemon, asked (KEY) the first time it signs there and again
//! after that daemon came back; a daemon that holds another key under that path (its files
//! differ) is not used for that key.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::sign::{CertifiedKey, Signer, SigningKey, SingleCertAndKey};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig};
use rustls::{SignatureAlgorithm, SignatureScheme};
use rustls_pki_types::{ServerName, SubjectPublicKeyInfoDer};

use super::{is_refusal, op, parse_key_reply, sign_request, timed_out, Refused, MAX_MESSAGE, OK};

/// How `--keyd` names a daemon reached over TLS: `tls://HOST:PORT`.
pub const URL_PREFIX: &str = "tls://";

/// Reads one framed message into `buf`. False: the peer closed the connection between two
/// messages. A length out of bounds is an error (the caller closes the connection).
pub fn read_frame(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<bool> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a message of {n} bytes (1 to {MAX_MESSAGE})"),
        ));
    }
    buf.resize(n, 0);
    r.read_exact(buf)?;
    Ok(true)
}

/// `message` with its length in front, as [`read_frame`] reads it.
pub fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + message.len());
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A certificate chain and its key from PEM files (the key zeroized once parsed).
fn certified(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, String> {
    let chain = crate::cert::load_chain(cert).map_err(|e| e.to_string())?;
    let key = crate::cert::load_transport_key(key).map_err(|e| e.to_string())?;
    Ok(Arc::new(CertifiedKey::new(chain, key)))
}

fn roots(ca: &Path) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    for c in crate::cert::load_chain(ca).map_err(|e| e.to_string())? {
        roots
            .add(c)
            .map_err(|e| format!("{}: not a CA certificate: {e}", ca.display()))?;
    }
    Ok(Arc::new(roots))
}

/// The daemon's TLS configuration: its certificate, and only clients with a certificate
/// issued by `client_ca` (TLS 1.3 only: both ends are ours).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<Arc<ServerConfig>, String> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(client_ca)?, provider())
            .build()
            .map_err(|e| format!("{}: {e}", client_ca.display()))?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(SingleCertAndKey::from(certified(cert, key)?)));
    Ok(Arc::new(config))
}

/// The server's TLS configuration towards its daemons: its client certificate, and daemons
/// whose certificate `ca` issued.
pub fn client_config(cert: &Path, key: &Path, ca: &Path) -> Result<Arc<ClientConfig>, String> {
    let config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca)?)
        .with_client_cert_resolver(Arc::new(SingleCertAndKey::from(certified(cert, key)?)));
    Ok(Arc::new(config))
}

/// The socket as one call sees it: each system call waits at most what is left until the
/// call's deadline, and one interrupted by a signal is made again (a reload's SIGHUP must not
/// fail a handshake).
struct Timed<'a> {
    sock: &'a TcpStream,
    deadline: Instant,
    timeout: Duration,
}

impl Timed<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out(self.timeout));
        }
        Ok(left)
    }

    fn retry<T>(&mut self, mut f: impl FnMut(&TcpStream) -> io::Result<T>) -> io::Result<T> {
        loop {
            match f(self.sock) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(timed_out(self.timeout))
                }
                r => return r,
            }
        }
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_read_timeout(Some(left))?;
        self.retry(|mut s| s.read(buf))
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_write_timeout(Some(left))?;
        self.retry(|mut s| s.write(buf))
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One TLS connection to a daemon.
struct Conn {
    tls: ClientConnection,
    sock: TcpStream,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Conn")
    }
}

impl Conn {
    /// Connects, completes the TLS handshake and has the daemon answer a PING (in TLS 1.3 the
    /// client's part of the handshake ends before the daemon has checked its certificate: a
    /// refusal shows only on the first read), all within `timeout`.
    fn open(daemon: &Daemon, config: &Arc<ClientConfig>, timeout: Duration) -> io::Result<Conn> {
        let deadline = Instant::now() + timeout;
        let addrs: Vec<_> = daemon.addr.to_socket_addrs()?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
        let mut sock = None;
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out(timeout));
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    sock = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let sock = sock.ok_or(last)?;
        // Small requests each waiting for its reply: never hold one back.
        sock.set_nodelay(true)?;
        let tls =
            ClientConnection::new(config.clone(), daemon.name.clone()).map_err(io::Error::other)?;
        let mut conn = Conn { tls, sock };
        let mut timed = Timed {
            sock: &conn.sock,
            deadline,
            timeout,
        };
        while conn.tls.is_handshaking() {
            conn.tls.complete_io(&mut timed)?;
        }
        conn.exchange(&[op::PING], deadline, timeout)?;
        Ok(conn)
    }

    /// One request, one reply; the reply's payload (after its OK byte).
    fn call(&mut self, request: &[u8], timeout: Duration) -> io::Result<Vec<u8>> {
        self.exchange(request, Instant::now() + timeout, timeout)
    }

    fn exchange(
        &mut self,
        request: &[u8],
        deadline: Instant,
        timeout: Duration,
    ) -> io::Result<Vec<u8>> {
        let mut timed = Timed {
            sock: &self.sock,
            deadline,
            timeout,
        };
        let mut stream = rustls::Stream::new(&mut self.tls, &mut timed);
        stream.write_all(&frame(request))?;
        stream.flush()?;
        let mut reply = Vec::new();
        if !read_frame(&mut stream, &mut reply)? {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "keyd closed the connection",
            ));
        }
        match reply[0] {
            OK => Ok(reply.split_off(1)),
            _ => Err(io::Error::other(Refused(format!(
                "keyd: {}",
                String::from_utf8_lossy(&reply[1..])
            )))),
        }
    }
}

/// One daemon of a fleet.
#[derive(Debug)]
struct Daemon {
    /// HOST:PORT, as given.
    addr: String,
    name: ServerName<'static>,
    idle: Mutex<Vec<Conn>>,
    /// In use; false from a lost or unanswered call until a probe reaches it again.
    up: AtomicBool,
    /// When to probe it next, and the delay after that.
    retry: Mutex<(Instant, Duration)>,
    /// Bumped each time it comes back (it may have been restarted and number its keys
    /// otherwise): handles learnt before are asked again.
    epoch: AtomicU64,
}

/// Several key daemons reached over TLS, used in turn, each signature on one that is up.
#[derive(Debug)]
pub struct KeydFleet {
    daemons: Vec<Daemon>,
    config: Arc<ClientConfig>,
    timeout: Duration,
    next: AtomicUsize,
}

/// `tls://HOST:PORT`: HOST:PORT and the name the daemon's certificate must bear.
pub fn parse_url(url: &str) -> Result<(String, ServerName<'static>), String> {
    let addr = url
        .strip_prefix(URL_PREFIX)
        .ok_or_else(|| format!("{url:?}: expected tls://HOST:PORT"))?;
    let (host, _port) = addr
        .rsplit_once(':')
        .filter(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
        .ok_or_else(|| format!("{url:?}: expected tls://HOST:PORT"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| format!("{url:?}: {host:?} is not a host name or address: {e}"))?;
    Ok((addr.to_string(), name))
}

impl KeydFleet {
    /// The daemons at `urls` (`tls://HOST:PORT` each). Connects to each once: at least one must
    /// answer; the others are out of use until a probe reaches them.
    pub fn connect(
        urls: &[String],
        config: Arc<ClientConfig>,
        timeout: Duration,
    ) -> io::Result<Arc<KeydFleet>> {
        let mut daemons = Vec::new();
        for url in urls {
            let (addr, name) =
                parse_url(url).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            daemons.push(Daemon {
                addr,
                name,
                idle: Mutex::new(Vec::new()),
                up: AtomicBool::new(false),
                retry: Mutex::new((Instant::now(), Duration::from_millis(50))),
                epoch: AtomicU64::new(0),
            });
        }
        let fleet = Arc::new(KeydFleet {
            daemons,
            config,
            timeout,
            next: AtomicUsize::new(0),
        });
        let mut errors = Vec::new();
        for d in &fleet.daemons {
            match Conn::open(d, &fleet.config, timeout) {
                Ok(c) => {
                    lock(&d.idle).push(c);
                    d.up.store(true, Relaxed);
                }
                Err(e) => {
                    tracing::warn!("key daemon tls://{} cannot be reached: {e}", d.addr);
                    errors.push(format!("tls://{}: {e}", d.addr));
                }
            }
        }
        if errors.len() == fleet.daemons.len() {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                format!("no key daemon answers: {}", errors.join("; ")),
            ));
        }
        Ok(fleet)
    }

    /// The daemons in the order to try them: those in use, from the next in turn, then the
    /// others (a daemon may be back before a probe saw it).
    fn order(&self) -> Vec<usize> {
        let n = self.daemons.len();
        let start = self.next.fetch_add(1, Relaxed) % n;
        let turn = (0..n).map(|i| (start + i) % n);
        let (mut up, down): (Vec<usize>, Vec<usize>) =
            turn.partition(|&i| self.daemons[i].up.load(Relaxed));
        up.extend(down);
        up
    }

    /// One call on daemon `i`, on an idle connection or a new one.
    ///
    /// An idle connection may have been closed since it was last used (the daemon restarted,
    /// a firewall forgot it): a call lost on one is made once more on a new connection,
    /// unless it went unanswered (the daemon is there but stuck: waiting again would pass
    /// the handshake's deadline).
    fn call_on(&self, i: usize, request: &[u8]) -> io::Result<Vec<u8>> {
        let d = &self.daemons[i];
        let pooled = lock(&d.idle).pop();
        let reply = match pooled {
            Some(conn) => match self.call_keep(d, conn, request) {
                Err(e) if !is_refusal(&e) && e.kind() != io::ErrorKind::TimedOut => None,
                r => Some(r),
            },
            None => None,
        };
        match reply {
            Some(r) => r,
            None => self.call_keep(d, Conn::open(d, &self.config, self.timeout)?, request),
        }
    }

    /// One call on `conn`, which goes back to the idle ones if it is still fine.
    fn call_keep(&self, d: &Daemon, mut conn: Conn, request: &[u8]) -> io::Result<Vec<u8>> {
        let reply = conn.call(request, self.timeout);
        // A refusal leaves the connection fine; any other error, in an unknown state.
        if reply.is_ok() || reply.as_ref().is_err_and(is_refusal) {
            lock(&d.idle).push(conn);
        }
        reply
    }

    /// Daemon `i` lost a call: out of use until a probe reaches it.
    fn lost(&self, i: usize, e: &io::Error) {
        let d = &self.daemons[i];
        if d.up.swap(false, Relaxed) {
            lock(&d.idle).clear();
            *lock(&d.retry) = (
                Instant::now() + Duration::from_millis(50),
                Duration::from_millis(50),
            );
            crate::stats::bump(&crate::stats::global().keyd_failovers);
            tracing::warn!(
                "key daemon tls://{} lost a call ({e}): signatures go to the others until it is back",
                d.addr
            );
        }
    }

    /// Tries the daemons out of use whose time has come; how many are back in use.
    pub fn probe(&self) -> usize {
        let mut back = 0;
        for d in &self.daemons {
            if d.up.load(Relaxed) {
                continue;
            }
            let (at, delay) = *lock(&d.retry);
            if Instant::now() < at {
                continue;
            }
            match Conn::open(d, &self.config, self.timeout) {
                Ok(c) => {
                    d.epoch.fetch_add(1, Relaxed);
                    lock(&d.idle).push(c);
                    d.up.store(true, Relaxed);
                    tracing::info!("key daemon tls://{} is back in use", d.addr);
                    back += 1;
                }
                Err(_) => {
                    let delay = (delay * 2).min(Duration::from_secs(1));
                    *lock(&d.retry) = (Instant::now() + delay, delay);
                }
            }
        }
        back
    }

    /// How many daemons are in use.
    pub fn in_use(&self) -> usize {
        self.daemons.iter().filter(|d| d.up.load(Relaxed)).count()
    }

    /// The key the daemons loaded from `path`, as the first one that answers describes it.
    pub fn key(self: &Arc<Self>, path: &Path) -> io::Result<Arc<FleetKey>> {
        let mut last = None;
        for i in self.order() {
            match self.ask_key(i, path) {
                Ok(info) => {
                    let mut handles = vec![None; self.daemons.len()];
                    handles[i] = Some((self.daemons[i].epoch.load(Relaxed), info.handle));
                    return Ok(Arc::new(FleetKey {
                        state: Arc::new(KeyState {
                            fleet: self.clone(),
                            path: path.to_path_buf(),
                            algorithm: info.algorithm,
                            public_key: info.public_key,
                            handles: Mutex::new(handles),
                        }),
                        schemes: info.schemes,
                    }));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(no_daemon))
    }

    fn ask_key(&self, i: usize, path: &Path) -> io::Result<super::KeyInfo> {
        let mut req = vec![op::KEY];
        req.extend_from_slice(path.as_os_str().as_encoded_bytes());
        let reply = self.call_on(i, &req).inspect_err(|e| {
            if !is_refusal(e) {
                self.lost(i, e);
            }
        })?;
        parse_key_reply(&reply)
    }

    /// A signature by the key, on one daemon in use, or on the next if the call is lost.
    fn sign(&self, key: &KeyState, scheme: SignatureScheme, message: &[u8]) -> io::Result<Vec<u8>> {
        let mut last = None;
        for i in self.order() {
            let handle = match key.handle_on(i) {
                Ok(h) => h,
                Err(e) => {
                    let timed_out = e.kind() == io::ErrorKind::TimedOut;
                    last = Some(e);
                    if timed_out {
                        break;
                    }
                    continue;
                }
            };
            match self.call_on(i, &sign_request(handle, scheme, message)) {
                Ok(signature) => return Ok(signature),
                Err(e) if is_refusal(&e) => {
                    // Perhaps a handle it no longer has: ask for it again next time.
                    key.forget(i);
                    last = Some(e);
                }
                Err(e) => {
                    self.lost(i, &e);
                    let timed_out = e.kind() == io::ErrorKind::TimedOut;
                    last = Some(io::Error::new(
                        e.kind(),
                        format!("tls://{}: {e}", self.daemons[i].addr),
                    ));
                    // The handshake has waited the whole timeout already.
                    if timed_out {
                        break;
                    }
                }
            }
        }
        Err(last.unwrap_or_else(no_daemon))
    }
}

fn no_daemon() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "no key daemon answers")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A private key held by the daemons of a fleet (each under its own handle).
#[derive(Debug)]
pub struct FleetKey {
    state: Arc<KeyState>,
    /// Schemes the key can make, most preferred first.
    schemes: Vec<SignatureScheme>,
}

/// What a signature by the key needs; shared with its signers.
struct KeyState {
    fleet: Arc<KeydFleet>,
    path: std::path::PathBuf,
    algorithm: SignatureAlgorithm,
    /// SubjectPublicKeyInfo, DER.
    public_key: Vec<u8>,
    /// Per daemon: its handle for this key, and the daemon's epoch when it said so.
    handles: Mutex<Vec<Option<(u64, u32)>>>,
}

impl std::fmt::Debug for KeyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyState")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl KeyState {
    /// Daemon `i`'s handle for this key, asked if not known for its current epoch. A daemon
    /// that holds another key under this path is not used for it.
    fn handle_on(&self, i: usize) -> io::Result<u32> {
        let epoch = self.fleet.daemons[i].epoch.load(Relaxed);
        if let Some((e, h)) = lock(&self.handles)[i] {
            if e == epoch {
                return Ok(h);
            }
        }
        let info = self.fleet.ask_key(i, &self.path)?;
        if info.public_key != self.public_key || info.algorithm != self.algorithm {
            return Err(io::Error::other(Refused(format!(
                "key daemon tls://{} holds another key for {}",
                self.fleet.daemons[i].addr,
                self.path.display()
            ))));
        }
        lock(&self.handles)[i] = Some((epoch, info.handle));
        Ok(info.handle)
    }

    fn forget(&self, i: usize) {
        lock(&self.handles)[i] = None;
    }
}

impl SigningKey for FleetKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        let scheme = *self.schemes.iter().find(|s| offered.contains(s))?;
        Some(Box::new(FleetSigner {
            key: self.state.clone(),
            scheme,
        }))
    }

    fn public_key(&self) -> Option<SubjectPublicKeyInfoDer<'_>> {
        Some(SubjectPublicKeyInfoDer::from(
            self.state.public_key.as_slice(),
        ))
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        self.state.algorithm
    }
}

#[derive(Debug)]
struct FleetSigner {
    key: Arc<KeyState>,
    scheme: SignatureScheme,
}

impl Signer for FleetSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        let started = Instant::now();
        let signature = self.key.fleet.sign(&self.key, self.scheme, message);
        let stats = crate::stats::global();
        match signature {
            Ok(s) => {
                crate::stats::bump(&stats.keyd_signatures);
                crate::stats::add(&stats.keyd_wait_ns, started.elapsed().as_nanos() as u64);
                Ok(s)
            }
            Err(e) => {
                crate::stats::bump(&stats.keyd_sign_failures);
                super::warn_sign_failure(&e);
                Err(rustls::Error::General(format!(
                    "signature by keyd failed: {e}"
                )))
            }
        }
    }

    fn scheme(&self) -> SignatureScheme {
        self.scheme
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_out_of_bounds_are_errors_not_allocations() {
        let mut buf = Vec::new();
        for len in [0u32, MAX_MESSAGE as u32 + 1, u32::MAX] {
            let mut r = &len.to_be_bytes()[..];
            let e = read_frame(&mut r, &mut buf).expect_err("a bad length");
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{len}: {e}");
            assert!(buf.capacity() <= MAX_MESSAGE);
        }
        let mut r = &frame(b"abc")[..];
        assert!(read_frame(&mut r, &mut buf).unwrap());
        assert_eq!(buf, b"abc");
        // A close between messages is not an error; inside one it is.
        assert!(!read_frame(&mut &b""[..], &mut buf).unwrap());
        assert!(read_frame(&mut &[0u8, 0][..], &mut buf).is_err());
        assert!(read_frame(&mut &[0u8, 0, 0, 5, 1][..], &mut buf).is_err());
    }

    #[test]
    fn urls_name_host_and_port() {
        let (addr, name) = parse_url("tls://keys.example:7000").unwrap();
        assert_eq!(addr, "keys.example:7000");
        assert_eq!(name.to_str(), "keys.example");
        let (addr, name) = parse_url("tls://[::1]:7000").unwrap();
        assert_eq!(addr, "[::1]:7000");
        assert_eq!(name.to_str(), "::1");
        for bad in ["keys:7000", "tls://keys", "tls://:7000", "tls://keys:x"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
