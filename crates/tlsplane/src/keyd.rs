//! Private keys in another process: the key daemon's wire protocol, and the signing key the
//! handshake uses in its place ([`RemoteKey`]), which asks the daemon for each signature.
//!
//! The daemon (`tlsplane keyd`) alone reads key files. A worker holds, per key, a handle, the
//! key's algorithm, the signature schemes it can make and its public key (so rustls can check
//! that it belongs to the certificate), never the key. The design is neverbleed's (h2o): a
//! private Unix socket (in a 0700 directory), the peer's user id checked by the daemon
//! (`SO_PEERCRED`) and a random token per start, sent first on every connection, and only to
//! a daemon whose user id the client checked the same way (root, its own, or the one it was
//! told): whoever could put another socket in the daemon's place gets no token.
//!
//! The socket is `SOCK_SEQPACKET`: one request or reply per message, so framing needs no
//! length prefix and a short read cannot split one. Requests: `[op][payload]`; replies:
//! `[0][payload]` (ok) or `[1][utf-8 reason]`.
//!
//! rustls signs synchronously, inside the handshake step that needs the signature: the
//! handshake thread sends the request and blocks on the reply (one round trip, a few µs of
//! system calls plus the daemon's signature). The other handshakes of that thread wait that
//! long, as they would for a signature made in-thread; established connections are served by
//! their own threads and do not wait. A daemon that does not answer within the client's
//! timeout ([`DEFAULT_SIGN_TIMEOUT`] unless set) fails the handshake (an alert) instead of
//! holding the thread, and is counted ([`KeydClient::timeouts`]) so that whoever started the
//! daemon can replace it.

use std::io::{self, Read};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::sign::{Signer, SigningKey};
use rustls::{SignatureAlgorithm, SignatureScheme};
use rustls_pki_types::SubjectPublicKeyInfoDer;
use socket2::{Domain, SockAddr, Socket, Type};

pub mod tls;

/// Length of the per-start authentication token.
pub const TOKEN_LEN: usize = 32;
/// Longest message either side sends (a signature is at most 512 bytes for RSA-4096; the
/// message signed, TLS 1.3's 64 + 34 + 48 bytes or TLS 1.2's randoms and parameters, is
/// smaller still; a key path can be long).
pub const MAX_MESSAGE: usize = 8192;
/// How long a handshake waits for a signature before it fails, unless the client is given
/// another: a daemon that is alive but does not answer (stopped, deadlocked, swapped out). A
/// dead one fails at once (its socket is closed).
/// Generous enough for emulated guests under load, where a signature has taken most of a
/// second, and where a 2 s limit most likely failed one handshake in CI (kernel 7.3 under
/// TCG; no other failure path fits what it logged); well under the handshake deadline (10 s
/// by default), so a stalled daemon still ends handshakes with an alert, not a silent timeout.
pub const DEFAULT_SIGN_TIMEOUT: Duration = Duration::from_secs(5);

/// Request codes.
pub mod op {
    /// `[token]`: must come first on a connection.
    pub const HELLO: u8 = 1;
    /// `[path]` → `[handle u32][algorithm u8][n u8][schemes u16 × n][public key]`.
    pub const KEY: u8 = 2;
    /// `[handle u32][scheme u16][message]` → `[signature]`.
    pub const SIGN: u8 = 3;
    /// `[]` → `[generation u32]`: re-read every key file, as a new generation (nothing is
    /// dropped yet).
    pub const RELOAD: u8 = 4;
    /// `[generation u32]` → `[]`: that generation is in force; keys neither it nor the one
    /// committed before it use may go.
    pub const COMMIT: u8 = 5;
    /// `[]` → the daemon's whole key store, keys included, in several messages: asked only by
    /// the daemon that will stand in for this one, and refused to anyone else (the daemon
    /// checks the asking process, see `tlsplane keyd`).
    pub const HANDOFF: u8 = 6;
    /// `[]` → `[]`: the daemon answers (a client over TLS checks with it that the daemon took
    /// its certificate).
    pub const PING: u8 = 7;
}

/// Reply status bytes.
pub const OK: u8 = 0;
pub const ERR: u8 = 1;

/// Candidate schemes in rustls' own preference order, for a daemon to say which a key can make.
pub const SCHEMES: [SignatureScheme; 10] = [
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ECDSA_NISTP521_SHA512,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA512,
    SignatureScheme::RSA_PSS_SHA384,
    SignatureScheme::RSA_PSS_SHA256,
    SignatureScheme::RSA_PKCS1_SHA512,
    SignatureScheme::RSA_PKCS1_SHA384,
    SignatureScheme::RSA_PKCS1_SHA256,
];

/// Where a daemon listens, who it runs as, and how to prove we may use it.
#[derive(Clone)]
pub struct Endpoint {
    pub socket: PathBuf,
    pub token: zeroize::Zeroizing<[u8; TOKEN_LEN]>,
    /// The daemon's user id when it is neither root nor this process's user (a daemon started
    /// by hand by another user). A listener of any other user gets no token.
    pub daemon_uid: Option<u32>,
}

impl Endpoint {
    /// Whether a listener of user `uid` may be this endpoint's daemon.
    fn trusts(&self, uid: u32) -> bool {
        uid == 0 || uid == tlsplane_sys::current_uid() || self.daemon_uid == Some(uid)
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Endpoint")
            .field("socket", &self.socket)
            .field("daemon_uid", &self.daemon_uid)
            .finish_non_exhaustive()
    }
}

/// A connection to the daemon, authenticated, and how long one call on it may wait.
struct Conn(Socket, Duration);

impl Conn {
    fn open(ep: &Endpoint, timeout: Duration) -> io::Result<Conn> {
        Self::open_with(ep, timeout, |sock| tlsplane_sys::peer_uid(sock.as_fd()))
    }

    /// [`Conn::open`], with the listener's user id as `listener_uid` says it.
    fn open_with(
        ep: &Endpoint,
        timeout: Duration,
        listener_uid: impl FnOnce(&Socket) -> io::Result<u32>,
    ) -> io::Result<Conn> {
        let sock = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)?;
        sock.set_read_timeout(Some(timeout))?;
        sock.set_write_timeout(Some(timeout))?;
        sock.connect(&SockAddr::unix(&ep.socket)?)?;
        // Before the token leaves: the listener's user as the kernel recorded it at listen().
        let uid = listener_uid(&sock)?;
        if !ep.trusts(uid) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} is listened on by user id {uid}, not root, this process's user or the \
                     daemon's (--keyd-uid): no token sent",
                    ep.socket.display()
                ),
            ));
        }
        let mut c = Conn(sock, timeout);
        let mut hello = vec![op::HELLO];
        hello.extend_from_slice(ep.token.as_ref());
        c.call(&hello).map_err(|e| {
            if is_refusal(&e) {
                // The daemon says no more than that, on purpose.
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "keyd refused the connection: not its token, or not an allowed user",
                )
            } else {
                e
            }
        })?;
        Ok(c)
    }

    /// One request, one reply; the reply's payload (after its OK byte).
    ///
    /// A signal handled by this thread interrupts the wait even under `SA_RESTART` (a socket
    /// with a receive timeout is never restarted: signal(7)); the wait then goes on for what
    /// is left of the timeout, so that a reload's SIGHUP cannot fail a handshake.
    fn call(&mut self, request: &[u8]) -> io::Result<Vec<u8>> {
        let deadline = std::time::Instant::now() + self.1;
        let mut shortened = false;
        let result = self.exchange(request, deadline, &mut shortened);
        if shortened && result.is_ok() {
            // The next call starts with the whole timeout again.
            self.0.set_read_timeout(Some(self.1))?;
            self.0.set_write_timeout(Some(self.1))?;
        }
        result
    }

    fn exchange(
        &mut self,
        request: &[u8],
        deadline: std::time::Instant,
        shortened: &mut bool,
    ) -> io::Result<Vec<u8>> {
        // After an interruption the socket's timeouts are set to what is left.
        let timeout = self.1;
        let retry = |sock: &Socket, shortened: &mut bool| -> io::Result<()> {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(timed_out(timeout));
            }
            sock.set_read_timeout(Some(left))?;
            sock.set_write_timeout(Some(left))?;
            *shortened = true;
            Ok(())
        };
        loop {
            match self.0.send(request) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => retry(&self.0, shortened)?,
                Err(e) => return Err(as_timeout(e, timeout)),
            }
        }
        let mut buf = vec![0u8; MAX_MESSAGE];
        let n = loop {
            match (&self.0).read(&mut buf) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => retry(&self.0, shortened)?,
                Err(e) => return Err(as_timeout(e, timeout)),
            }
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "keyd closed the connection",
            ));
        }
        buf.truncate(n);
        match buf[0] {
            OK => Ok(buf.split_off(1)),
            _ => Err(io::Error::other(Refused(format!(
                "keyd: {}",
                String::from_utf8_lossy(&buf[1..])
            )))),
        }
    }
}

/// The daemon answered, with a refusal (an unknown handle, a key it could not load): the
/// connection itself is fine.
#[derive(Debug)]
pub(crate) struct Refused(pub(crate) String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

pub(crate) fn is_refusal(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|r| r.is::<Refused>())
}

/// A socket timeout reads as EAGAIN ("resource temporarily unavailable"): say what it means.
fn as_timeout(e: io::Error, timeout: Duration) -> io::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => timed_out(timeout),
        _ => e,
    }
}

pub(crate) fn timed_out(timeout: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("keyd did not answer within {} s", timeout.as_secs_f64()),
    )
}

/// A client of a daemon: a few authenticated connections, reused (each handshake thread
/// takes one for its round trip; no lock is held while waiting). The daemon it talks to can
/// be replaced by one holding the same keys under the same handles ([`KeydClient::switch`]):
/// the keys already handed out ([`RemoteKey`]) then sign through the new one.
#[derive(Debug)]
pub struct KeydClient {
    timeout: Duration,
    target: std::sync::RwLock<Arc<Target>>,
}

/// One daemon: where it is, the idle connections to it, and how calls to it failed.
#[derive(Debug)]
struct Target {
    endpoint: Endpoint,
    idle: Mutex<Vec<Socket>>,
    /// Calls that got no answer within `timeout`.
    timeouts: AtomicU64,
    /// Calls that failed for the connection's sake: no answer, a closed connection, no daemon
    /// listening, a token it did not take (not an answer that refuses one request).
    broken: AtomicU64,
}

impl Target {
    fn new(endpoint: Endpoint, first: Socket) -> Arc<Target> {
        Arc::new(Target {
            endpoint,
            idle: Mutex::new(vec![first]),
            timeouts: AtomicU64::new(0),
            broken: AtomicU64::new(0),
        })
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Conn")
    }
}

impl KeydClient {
    /// Connects once to check the endpoint and the token. Each call then waits at most
    /// `timeout` for the daemon's answer.
    pub fn connect(endpoint: Endpoint, timeout: Duration) -> io::Result<Arc<Self>> {
        let first = Conn::open(&endpoint, timeout)?;
        Ok(Arc::new(Self {
            timeout,
            target: std::sync::RwLock::new(Target::new(endpoint, first.0)),
        }))
    }

    /// From now on, talks to the daemon at `endpoint` (checked by connecting once), which
    /// holds the same keys under the same handles: the keys handed out keep working. The
    /// counts of [`KeydClient::timeouts`] and [`KeydClient::broken`] start again from zero.
    pub fn switch(&self, endpoint: Endpoint) -> io::Result<()> {
        let first = Conn::open(&endpoint, self.timeout)?;
        *self.target.write().unwrap_or_else(|e| e.into_inner()) = Target::new(endpoint, first.0);
        Ok(())
    }

    fn target(&self) -> Arc<Target> {
        self.target
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// How many calls the daemon left unanswered past the timeout: a daemon that is alive
    /// but stuck, which its supervisor may replace.
    pub fn timeouts(&self) -> u64 {
        self.target().timeouts.load(Ordering::Relaxed)
    }

    /// How many calls failed because the daemon could not be reached or did not answer
    /// (timeouts included): a daemon that died, or was restarted with a new token, which the
    /// server then connects to again.
    pub fn broken(&self) -> u64 {
        self.target().broken.load(Ordering::Relaxed)
    }

    fn call(&self, request: &[u8]) -> io::Result<Vec<u8>> {
        let target = self.target();
        let pooled = target.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut conn = match pooled {
            Some(s) => Conn(s, self.timeout),
            None => Conn::open(&target.endpoint, self.timeout).inspect_err(|_| {
                // Refused at HELLO too: a daemon with another token.
                target.broken.fetch_add(1, Ordering::Relaxed);
            })?,
        };
        // On any error the connection is dropped, not pooled: its state is unknown.
        let reply = conn.call(request).inspect_err(|e| {
            if e.kind() == io::ErrorKind::TimedOut {
                target.timeouts.fetch_add(1, Ordering::Relaxed);
            }
            if !is_refusal(e) {
                target.broken.fetch_add(1, Ordering::Relaxed);
            }
        })?;
        target
            .idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(conn.0);
        Ok(reply)
    }

    /// The key the daemon loaded from `path` (as its configuration names it).
    pub fn key(self: &Arc<Self>, path: &Path) -> io::Result<Arc<RemoteKey>> {
        let mut req = vec![op::KEY];
        req.extend_from_slice(path.as_os_str().as_encoded_bytes());
        let r = self.call(&req)?;
        let k = parse_key_reply(&r)?;
        Ok(Arc::new(RemoteKey {
            client: self.clone(),
            handle: k.handle,
            algorithm: k.algorithm,
            schemes: k.schemes,
            public_key: k.public_key,
        }))
    }

    /// Asks the daemon to re-read its key files; the generation they form (see
    /// [`KeydClient::commit`]).
    pub fn reload(&self) -> io::Result<u32> {
        let r = self.call(&[op::RELOAD])?;
        r.get(..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "keyd: malformed reply"))
    }

    /// Tells the daemon that generation `g` is in force.
    pub fn commit(&self, g: u32) -> io::Result<()> {
        let mut req = vec![op::COMMIT];
        req.extend_from_slice(&g.to_be_bytes());
        self.call(&req).map(drop)
    }

    /// The daemon it talks to now.
    pub fn endpoint(&self) -> Endpoint {
        self.target().endpoint.clone()
    }
}

/// What a daemon says of one of its keys (its answer to KEY).
pub(crate) struct KeyInfo {
    pub handle: u32,
    pub algorithm: SignatureAlgorithm,
    /// Schemes the key can make, most preferred first.
    pub schemes: Vec<SignatureScheme>,
    /// SubjectPublicKeyInfo, DER.
    pub public_key: Vec<u8>,
}

/// A KEY reply's payload (after its OK byte).
pub(crate) fn parse_key_reply(r: &[u8]) -> io::Result<KeyInfo> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "keyd: malformed KEY reply");
    if r.len() < 6 {
        return Err(bad());
    }
    let handle = u32::from_be_bytes([r[0], r[1], r[2], r[3]]);
    let algorithm = SignatureAlgorithm::from(r[4]);
    let n = r[5] as usize;
    let schemes_end = 6 + 2 * n;
    if r.len() < schemes_end {
        return Err(bad());
    }
    let schemes = r[6..schemes_end]
        .chunks(2)
        .map(|c| SignatureScheme::from(u16::from_be_bytes([c[0], c[1]])))
        .collect();
    Ok(KeyInfo {
        handle,
        algorithm,
        schemes,
        public_key: r[schemes_end..].to_vec(),
    })
}

/// A SIGN request: `[op][handle][scheme][message]`.
pub(crate) fn sign_request(handle: u32, scheme: SignatureScheme, message: &[u8]) -> Vec<u8> {
    let mut req = Vec::with_capacity(7 + message.len());
    req.push(op::SIGN);
    req.extend_from_slice(&handle.to_be_bytes());
    req.extend_from_slice(&u16::from(scheme).to_be_bytes());
    req.extend_from_slice(message);
    req
}

/// A private key held by the daemon: what rustls needs to choose a scheme and check the
/// certificate, and a handle to have it sign.
#[derive(Debug)]
pub struct RemoteKey {
    client: Arc<KeydClient>,
    handle: u32,
    algorithm: SignatureAlgorithm,
    /// Schemes the key can make, most preferred first.
    schemes: Vec<SignatureScheme>,
    /// SubjectPublicKeyInfo, DER.
    public_key: Vec<u8>,
}

impl SigningKey for RemoteKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        let scheme = *self.schemes.iter().find(|s| offered.contains(s))?;
        Some(Box::new(RemoteSigner {
            client: self.client.clone(),
            handle: self.handle,
            scheme,
        }))
    }

    fn public_key(&self) -> Option<SubjectPublicKeyInfoDer<'_>> {
        Some(SubjectPublicKeyInfoDer::from(self.public_key.as_slice()))
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        self.algorithm
    }
}

#[derive(Debug)]
struct RemoteSigner {
    client: Arc<KeydClient>,
    handle: u32,
    scheme: SignatureScheme,
}

impl Signer for RemoteSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        let req = sign_request(self.handle, self.scheme, message);
        let started = std::time::Instant::now();
        let signature = self.client.call(&req);
        if signature.is_ok() {
            let stats = crate::stats::global();
            crate::stats::bump(&stats.keyd_signatures);
            crate::stats::add(&stats.keyd_wait_ns, started.elapsed().as_nanos() as u64);
        }
        signature.map_err(|e| {
            crate::stats::bump(&crate::stats::global().keyd_sign_failures);
            warn_sign_failure(&e);
            rustls::Error::General(format!("signature by keyd failed: {e}"))
        })
    }

    fn scheme(&self) -> SignatureScheme {
        self.scheme
    }
}

/// A failed signature fails a handshake with an internal_error alert, which tells the client
/// nothing: the operator must hear why. At most one line a second (a dead daemon fails every
/// handshake); `keyd_sign_failures` counts them all.
pub(crate) fn warn_sign_failure(e: &io::Error) {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static LAST_SECOND: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST_SECOND.load(Relaxed);
    if now != last
        && LAST_SECOND
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_ok()
    {
        let failures = crate::stats::global().keyd_sign_failures.load(Relaxed);
        tracing::warn!(
            error = %e,
            failures,
            "a signature by keyd failed: the handshake ends with an internal_error alert"
        );
    }
}

/// The daemon's side of the handshake with a client: the first message must be HELLO with
/// the token, from an allowed user. Compares in constant time.
pub fn check_hello(
    sock: &Socket,
    token: &[u8; TOKEN_LEN],
    allowed_uids: &[u32],
) -> Result<(), String> {
    let uid = tlsplane_sys::peer_uid(sock.as_fd()).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if !allowed_uids.contains(&uid) {
        return Err(format!("user id {uid} may not use this key daemon"));
    }
    let mut buf = [0u8; 1 + TOKEN_LEN + 1];
    let n = (&*sock)
        .read(&mut buf)
        .map_err(|e| format!("reading HELLO: {e}"))?;
    if n != 1 + TOKEN_LEN || buf[0] != op::HELLO {
        return Err("the first message is not a HELLO".into());
    }
    let diff = buf[1..1 + TOKEN_LEN]
        .iter()
        .zip(token)
        .fold(0u8, |d, (a, b)| d | (a ^ b));
    if diff != 0 {
        return Err("wrong token".into());
    }
    sock.send(&[OK])
        .map_err(|e| format!("answering HELLO: {e}"))?;
    Ok(())
}

/// The daemon's answer to KEY: `[handle][algorithm][schemes][public key]`.
pub fn key_reply(handle: u32, key: &dyn SigningKey) -> Vec<u8> {
    let schemes: Vec<SignatureScheme> = SCHEMES
        .iter()
        .copied()
        .filter(|s| key.choose_scheme(&[*s]).is_some())
        .collect();
    let mut r = vec![OK];
    r.extend_from_slice(&handle.to_be_bytes());
    r.push(u8::from(key.algorithm()));
    r.push(schemes.len() as u8);
    for s in &schemes {
        r.extend_from_slice(&u16::from(*s).to_be_bytes());
    }
    if let Some(spki) = key.public_key() {
        r.extend_from_slice(spki.as_ref());
    }
    r
}

/// Parses a SIGN request's payload (after the op byte): handle, scheme, message.
pub fn parse_sign(payload: &[u8]) -> Option<(u32, SignatureScheme, &[u8])> {
    if payload.len() < 6 {
        return None;
    }
    let handle = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
    let scheme = SignatureScheme::from(u16::from_be_bytes([payload[4], payload[5]]));
    Some((handle, scheme, &payload[6..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A new empty directory for one test's socket.
    fn scratch(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tlsplane-keyd-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    /// A daemon in `dir` that accepts one connection and any HELLO, then hands the connection
    /// to `serve`; the listener closes when `serve` returns.
    fn fake_daemon(
        dir: &Path,
        serve: impl FnOnce(Socket) + Send + 'static,
    ) -> (Endpoint, std::thread::JoinHandle<()>) {
        let path = dir.join("keyd.sock");
        let listener = Socket::new(Domain::UNIX, Type::SEQPACKET, None).expect("socket");
        listener
            .bind(&SockAddr::unix(&path).expect("address"))
            .expect("bind");
        listener.listen(4).expect("listen");
        let daemon = std::thread::spawn(move || {
            let (conn, _) = listener.accept().expect("accept");
            let mut buf = [0u8; MAX_MESSAGE];
            let _hello = (&conn).read(&mut buf).expect("hello");
            conn.send(&[OK]).expect("hello reply");
            serve(conn);
        });
        let endpoint = Endpoint {
            socket: path,
            token: zeroize::Zeroizing::new([7; TOKEN_LEN]),
            daemon_uid: None,
        };
        (endpoint, daemon)
    }

    /// A daemon that answers one request after `delay`.
    fn slow_daemon(dir: &Path, delay: Duration) -> Endpoint {
        fake_daemon(dir, move |conn| {
            let mut buf = [0u8; MAX_MESSAGE];
            let _request = (&conn).read(&mut buf).expect("request");
            std::thread::sleep(delay);
            // The client may have given up on it.
            let _ = conn.send(&[OK, 0xAB, 0xCD]);
            // Hold the connection until the client is done with it.
            let _ = (&conn).read(&mut buf);
        })
        .0
    }

    #[test]
    fn a_signal_during_the_wait_does_not_fail_the_call() {
        let dir = scratch("signal");
        // A handler as the server has (tokio's, with SA_RESTART): a blocking receive with a
        // timeout is interrupted all the same.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let kind = tokio::signal::unix::SignalKind::user_defined2();
        let _handler = rt
            .block_on(async { tokio::signal::unix::signal(kind) })
            .expect("handler");
        let client = KeydClient::connect(
            slow_daemon(&dir, Duration::from_millis(300)),
            DEFAULT_SIGN_TIMEOUT,
        )
        .expect("connect");
        let me = tlsplane_sys::thread_id();
        let signaller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            tlsplane_sys::signal_thread(me, kind.as_raw_value()).expect("tgkill");
        });
        let started = Instant::now();
        let reply = client.call(&[op::SIGN, 0, 0, 0, 1, 4, 3, b'm']);
        signaller.join().expect("signaller");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            reply.expect("the call survives the signal"),
            vec![0xAB, 0xCD]
        );
        assert!(started.elapsed() >= Duration::from_millis(250));
    }

    #[test]
    fn a_daemon_that_does_not_answer_is_reported_as_a_timeout() {
        let dir = scratch("slow");
        let client = KeydClient::connect(
            slow_daemon(&dir, Duration::from_millis(800)),
            Duration::from_millis(200),
        )
        .expect("connect");
        let started = Instant::now();
        let e = client
            .call(&[op::SIGN, 0, 0, 0, 1, 4, 3, b'm'])
            .expect_err("an answer after the timeout");
        let took = started.elapsed();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("did not answer within 0.2 s"), "{e}");
        assert!(took < Duration::from_millis(700), "waited {took:?}");
        assert_eq!(client.timeouts(), 1);
        assert_eq!(client.broken(), 1);
    }

    #[test]
    fn the_token_goes_only_to_a_daemon_of_a_trusted_user() {
        // A listener of this process's own user, taken for one of another user: what a client
        // would see if a socket of that user had been put in the daemon's place.
        let dir = scratch("peer-uid");
        let path = dir.join("keyd.sock");
        let listener = Socket::new(Domain::UNIX, Type::SEQPACKET, None).expect("socket");
        listener
            .bind(&SockAddr::unix(&path).expect("address"))
            .expect("bind");
        listener.listen(4).expect("listen");
        let received = std::thread::spawn(move || {
            let (conn, _) = listener.accept().expect("accept");
            conn.set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            let mut buf = [0u8; MAX_MESSAGE];
            (&conn).read(&mut buf).unwrap_or(0)
        });
        let me = tlsplane_sys::current_uid();
        let mut endpoint = Endpoint {
            socket: path,
            token: zeroize::Zeroizing::new([7; TOKEN_LEN]),
            daemon_uid: None,
        };
        assert!(endpoint.trusts(0) && endpoint.trusts(me));
        assert!(!endpoint.trusts(me.wrapping_add(4242)));
        endpoint.daemon_uid = Some(me.wrapping_add(4242));
        assert!(endpoint.trusts(me.wrapping_add(4242)));
        // This process may be root, whom every client trusts: the listener's user is said to
        // be one that is neither root, ours nor the endpoint's.
        let e = Conn::open_with(&endpoint, DEFAULT_SIGN_TIMEOUT, |_| Ok(me.wrapping_add(7)))
            .expect_err("a token for a listener of another user");
        let bytes = received.join().expect("listener");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        assert!(e.to_string().contains("no token sent"), "{e}");
        assert_eq!(bytes, 0, "the listener received {bytes} bytes");
    }

    #[test]
    fn a_refusal_is_not_a_broken_connection_but_a_closed_one_is() {
        let dir = scratch("refuse");
        // Refuses one request, then closes the connection and stops listening.
        let (endpoint, daemon) = fake_daemon(&dir, |conn| {
            let mut buf = [0u8; MAX_MESSAGE];
            let _request = (&conn).read(&mut buf).expect("request");
            conn.send(b"\x01no key 9").expect("refusal");
            let _request = (&conn).read(&mut buf).expect("request");
        });
        let client = KeydClient::connect(endpoint, DEFAULT_SIGN_TIMEOUT).expect("connect");
        let e = client.call(&[op::SIGN, 0, 0, 0, 9]).expect_err("refused");
        assert!(e.to_string().contains("no key 9"), "{e}");
        assert_eq!(
            client.broken(),
            0,
            "a refusal counted as a broken connection"
        );
        // The refused call's connection was dropped; the next one finds nobody listening.
        daemon.join().expect("daemon");
        let e = client.call(&[op::SIGN, 0, 0, 0, 9]).expect_err("no daemon");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(client.broken(), 1, "{e}");
    }
}
