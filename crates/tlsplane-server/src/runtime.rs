//! The runtime every product shares: listeners, the threads that accept and handshake, the
//! threads that serve established connections, signals and graceful shutdown. A product plugs
//! in as a handler: "given an established `TlsStream`, serve it".
//!
//! Each worker is two event loops (current-thread tokio runtimes) on two threads:
//!
//! - the **handshake loop** owns the worker's `SO_REUSEPORT` listeners, accepts, and runs TLS
//!   handshakes; it runs at a lower scheduling priority (`--handshake-nice`);
//! - the **connection loop** receives each connection once its handshake is done and it has
//!   to wait for its client (the socket moves between the loops' epoll sets), and runs the
//!   handler on it from there on.
//!
//! Why: a handshake step is public-key crypto that no event loop can interrupt. When
//! both kinds of work shared one loop, every established connection's next request queued
//! behind all the handshake steps that were ready first; a flood of cheap fake ClientHellos
//! (no crypto on the attacker's side) cut a keep-alive client from 11k to ~110 requests/s.
//! With the split the kernel's scheduler arbitrates: the connection loop, mostly asleep and
//! then briefly busy, runs as soon as it has work, and handshakes take the rest of the CPU.
//! The handler serves whatever the client sent with its Finished on the handshake loop, so a
//! connection that ends there (a single request with `Connection: close`, a client that only
//! wanted the handshake) never moves; a keep-alive connection moves once, at its first wait.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures_util::FutureExt;
use tlsplane::{Acceptor, DetachedTlsStream, TlsStream};

use crate::limits::{self, Admission, LimitArgs, Ticket};
use tokio::sync::{mpsc, watch};

/// What the runtime needs to know; products build it from their flags (or, later, a file).
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    pub listen: Vec<SocketAddr>,
    pub workers: usize,
    pub handshake_timeout: Duration,
    /// `TCP_USER_TIMEOUT` of the listening sockets, inherited by each connection (None: the
    /// kernel's default): see `ServerArgs::send_timeout`.
    pub send_timeout: Option<Duration>,
    pub shutdown_grace: Duration,
    /// Nice value of the handshake threads (0: same priority as the connection threads).
    pub handshake_nice: i32,
    pub limits: LimitArgs,
    /// Written with the server's pid once it listens (removed at exit), for `tlsplane reload`;
    /// the outcome of each reload goes to the same path with `.reload` appended.
    pub pid_file: Option<std::path::PathBuf>,
    /// Who the server becomes once it listens (`--user`).
    pub run_as: Option<crate::privileges::RunAs>,
    /// Descriptors one client connection may hold at once (its socket, and in the proxy its
    /// backend's): divides the open-files limit into the default --max-connections.
    pub descriptors_per_connection: usize,
    /// --fleet-limits: the exchange of per-client counts with the fleet's store.
    pub limit_sync: Option<crate::limit_sync::LimitSync>,
}

pub use crate::stats::RuntimeStats;

/// Where a handler runs a connection.
pub enum Phase<P> {
    /// On the handshake loop, right after the handshake. Serve what the client already sent;
    /// as soon as serving would mean waiting for the client, return the connection with
    /// [`Served::Park`]. Short connections (one request with `Connection: close`, a client
    /// that closes) so end where they started, without moving.
    Handshake,
    /// On a connection loop, with what the handler parked: serve until the end.
    Moved(P),
}

/// How a handler's turn with a connection ended.
// Returned once per handler turn and moved straight on: boxing `Park` to keep `Done` small
// would cost an allocation for every connection that moves to the connection loop.
#[allow(clippy::large_enum_variant)]
pub enum Served<P> {
    /// The connection is finished (closed, or failed).
    Done,
    /// Only from [`Phase::Handshake`]: move it to a connection loop, with this state.
    Park(TlsStream, P),
}

/// What the runtime gives a handler along with each connection.
pub struct ConnContext {
    /// Turns true when the server starts shutting down: finish what is in flight, then close.
    pub stop: watch::Receiver<bool>,
    pub idle: Idle,
    /// On the handshake loop only: see [`ConnContext::first_request_here`].
    first_request: Option<FirstRequestWait>,
}

/// What a connection that has just finished its handshake needs in order to wait on the
/// handshake loop for its first request.
struct FirstRequestWait {
    /// Full handshakes in progress on this loop, and a signal each time one starts.
    full: Arc<AtomicUsize>,
    full_started: Arc<tokio::sync::Notify>,
    /// Connections waiting so on this loop (at most [`FIRST_REQUEST_WAITERS`]).
    waiting: Arc<AtomicUsize>,
    stats: Arc<RuntimeStats>,
}

/// At most this many connections per handshake loop wait there for their first request
/// (each still holds a place among the loop's handshakes, under
/// --max-handshakes-per-worker).
const FIRST_REQUEST_WAITERS: usize = 64;

/// What [`ConnContext::first_request_here`] found.
pub enum FirstRequest {
    /// Bytes (or the client's end) came, or the idle deadline passed: read here.
    Here,
    /// Park the connection ([`Served::Park`]).
    Move,
    /// Evicted to make room under --max-connections, or the server is stopping: close.
    Close,
}

impl ConnContext {
    /// For a handler in [`Phase::Handshake`] about to park a new connection that has sent
    /// nothing since its handshake: while this loop has no full handshake in progress, waits
    /// here for the client's first bytes (or its end) until `idle_until`, and says
    /// [`FirstRequest::Move`] as soon as a full handshake starts on this loop. A connection
    /// that then sends one request and closes never moves (the move costs two `epoll_ctl`, an
    /// eventfd write, a wait and a thread switch); a TLS 1.2 client, which waits for the
    /// server's Finished, sends its request a round trip after the handshake ends. Under a
    /// handshake flood connections move at once, as they did before. Once per connection.
    pub async fn first_request_here(
        &mut self,
        tls: &mut TlsStream,
        idle_until: tokio::time::Instant,
    ) -> FirstRequest {
        let Some(w) = self.first_request.take() else {
            return FirstRequest::Move;
        };
        if w.full.load(Relaxed) > 0 || w.waiting.load(Relaxed) >= FIRST_REQUEST_WAITERS {
            return FirstRequest::Move;
        }
        let _waiting = Counted::new(w.waiting.clone());
        // A `Notified` sees every `notify_waiters` from its creation on, polled or not: a full
        // handshake that starts from here on moves this connection.
        let started = w.full_started.notified();
        let (stop, idle) = (&mut self.stop, &self.idle);
        let wait = idle.wait(async {
            tokio::select! {
                _ = tls.input_by(idle_until) => FirstRequest::Here,
                _ = started => FirstRequest::Move,
                _ = stop.changed() => FirstRequest::Close,
            }
        });
        let found = wait.await.unwrap_or(FirstRequest::Close);
        match found {
            FirstRequest::Here => w.stats.first_request_here.fetch_add(1, Relaxed),
            FirstRequest::Move => w.stats.first_request_moved.fetch_add(1, Relaxed),
            FirstRequest::Close => {}
        };
        found
    }
}

/// The server's list of idle connections (see [`Idle::wait`]).
#[derive(Clone)]
pub struct Idle(Arc<IdleList>);

impl Idle {
    /// Runs `wait`, a wait for the client's next request, as an idle wait: when the server is
    /// at its connection limit, the oldest idle waits are ended to make room for a new
    /// connection (`None`: close this one). Never use it for a wait in the middle of work.
    pub async fn wait<F: Future>(&self, wait: F) -> Option<F::Output> {
        let entry = self.0.enter();
        let evicted = entry.notify.clone();
        tokio::select! {
            r = wait => Some(r),
            _ = evicted.notified() => None,
        }
    }
}

/// Waits that may be ended to make room for a new connection, oldest first: idle keep-alive
/// connections (one list per server), handshakes in progress (one per handshake loop).
#[derive(Default)]
struct EvictionList {
    next: std::sync::atomic::AtomicU64,
    waiting: std::sync::Mutex<std::collections::BTreeMap<u64, (Instant, Arc<tokio::sync::Notify>)>>,
}

type IdleList = EvictionList;

/// A place in an [`EvictionList`]; `notify` fires when it is evicted. Leaves the list when
/// dropped.
struct EvictionEntry {
    list: Arc<EvictionList>,
    seq: u64,
    notify: Arc<tokio::sync::Notify>,
}

impl EvictionEntry {
    /// Moves to `list`, keeping its age and its notification.
    fn move_to(&mut self, list: &Arc<EvictionList>) {
        let Some(at) = self.list.lock().remove(&self.seq).map(|(at, _)| at) else {
            return; // evicted already: the notification is pending
        };
        let seq = list.next.fetch_add(1, Relaxed);
        list.lock().insert(seq, (at, self.notify.clone()));
        self.list = list.clone();
        self.seq = seq;
    }
}

impl Drop for EvictionEntry {
    fn drop(&mut self) {
        self.list.lock().remove(&self.seq);
    }
}

impl EvictionList {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        std::collections::BTreeMap<u64, (Instant, Arc<tokio::sync::Notify>)>,
    > {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn enter(self: &Arc<Self>) -> EvictionEntry {
        let seq = self.next.fetch_add(1, Relaxed);
        let notify = Arc::new(tokio::sync::Notify::new());
        self.lock().insert(seq, (Instant::now(), notify.clone()));
        EvictionEntry {
            list: self.clone(),
            seq,
            notify,
        }
    }

    /// When the oldest wait began.
    fn oldest_since(&self) -> Option<Instant> {
        self.lock().first_key_value().map(|(_, (at, _))| *at)
    }

    /// Ends the oldest wait, if any.
    fn evict_oldest(&self) -> bool {
        self.evict_oldest_older_than(Duration::ZERO)
    }

    /// Ends the oldest wait if it began at least `age` ago.
    fn evict_oldest_older_than(&self, age: Duration) -> bool {
        let mut waiting = self.lock();
        match waiting.first_key_value() {
            Some((_, (since, _))) if since.elapsed() >= age => {
                if let Some((_, (_, n))) = waiting.pop_first() {
                    // notify_one stores a permit: the entry's owner sees it even if it is not
                    // waiting at this very moment.
                    n.notify_one();
                }
                true
            }
            _ => false,
        }
    }
}

/// Serves an established connection.
pub trait Handler: Send + Sync + 'static {
    /// What a connection carries from the handshake loop to its connection loop.
    type Parked: Send + 'static;

    fn serve(
        self: Arc<Self>,
        tls: TlsStream,
        peer: SocketAddr,
        phase: Phase<Self::Parked>,
        ctx: ConnContext,
    ) -> impl Future<Output = Served<Self::Parked>> + Send;
}

/// The configuration connections are accepted under: replaced whole by a reload. A
/// connection keeps the generation it was accepted under (its site, its document root) to
/// its end; new connections take the new one.
pub struct Generation<H> {
    pub acceptor: Acceptor,
    pub handler: Arc<H>,
}

/// Builds the next generation on SIGHUP (re-reading the configuration); an error leaves the
/// current one in force.
/// Returns the new generation, and what of the new configuration it could not apply (which
/// `tlsplane reload` reports as a failure: the operator asked for it).
pub type Reload<H> = Box<dyn FnMut() -> anyhow::Result<(Generation<H>, Option<String>)> + Send>;

struct Shared<H> {
    current: std::sync::RwLock<Arc<Generation<H>>>,
    config: RuntimeConfig,
    stats: Arc<RuntimeStats>,
    /// `stats.open`, shared with the connection guards.
    in_flight: Arc<AtomicUsize>,
    admission: Arc<Admission>,
    idle: Arc<IdleList>,
    /// Out of descriptors, accept would fail and leave the connection queued; giving this one
    /// back for a moment lets it be accepted and reset instead (nginx, libuv).
    spare: std::sync::Mutex<Option<std::fs::File>>,
    accept_failures: std::sync::Mutex<Throttled>,
}

/// Binds the listeners, starts the workers and serves until SIGTERM or SIGINT, then drains
/// for up to the shutdown grace. Returns once every worker has stopped. `reload` runs on
/// SIGHUP and on each message of `requests` (the product's own reasons, e.g. a restarted key
/// daemon), which names the reason in the log.
pub fn run<H: Handler>(
    mut config: RuntimeConfig,
    first: Generation<H>,
    mut reload: Reload<H>,
    requests: Option<mpsc::UnboundedReceiver<&'static str>>,
    stats: Arc<RuntimeStats>,
) -> anyhow::Result<()> {
    if config.listen.is_empty() {
        bail!("no --listen address");
    }
    // The signal handlers before anything says we listen (the port line, the pid file): a
    // SIGHUP from `tlsplane reload` right after start-up must reload, not kill the server
    // with the default action.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut term, mut int, mut hup) = {
        use tokio::signal::unix::{signal, SignalKind};
        let _in_rt = rt.enter();
        (
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
            signal(SignalKind::hangup())?,
        )
    };
    let per_worker = bind_all(&config.listen, config.workers, config.send_timeout)?;
    let mut pid_file = config
        .pid_file
        .as_deref()
        .map(PidFile::create)
        .transpose()?;
    let spare = open_spare();
    if config.limits.max_connections == 0 {
        config.limits.max_connections = default_max_connections(&config)?;
    }
    // Everything that needs root is done: the ports are bound, the key daemon runs, the pid
    // file is written.
    if let Some(user) = &config.run_as {
        user.switch()?;
    }
    // Said once the server is what it will stay (the user it runs as included): scripts and
    // tests take this line for "ready" (a log line at info level: with TLSPLANE_LOG above
    // info, the pid file says it instead).
    for l in per_worker.first().into_iter().flatten() {
        tracing::info!("listening on https://{}", l.local_addr()?);
    }
    let shared = Arc::new(Shared {
        current: std::sync::RwLock::new(Arc::new(first)),
        config: config.clone(),
        in_flight: stats.open.clone(),
        admission: Admission::new(config.limits.clone(), stats.limits.client_table.clone()),
        stats,
        idle: Arc::default(),
        spare: std::sync::Mutex::new(spare),
        accept_failures: std::sync::Mutex::new(Throttled::default()),
    });
    if let Some(sync) = config.limit_sync.clone() {
        if shared.admission.fleet_limits() {
            sync.start(shared.admission.clone())?;
        }
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut threads = Vec::new();
    for (i, listeners) in per_worker.into_iter().enumerate() {
        let (to_conn, from_hs) = mpsc::unbounded_channel();
        let (s, stop) = (shared.clone(), stop_rx.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("conn-{i}"))
                .spawn(move || connection_loop(from_hs, s, stop))?,
        );
        let (s, stop) = (shared.clone(), stop_rx.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("handshake-{i}"))
                .spawn(move || handshake_loop(listeners, to_conn, s, stop))?,
        );
    }

    rt.block_on(async {
        let mut requests = requests;
        loop {
            let why = tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = hup.recv() => "SIGHUP",
                Some(why) = async { match requests.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                } } => why,
            };
            tracing::info!("{why}: reloading the configuration");
            let status = match reload() {
                Ok((next, not_applied)) => {
                    *shared.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
                    shared.stats.reloads.fetch_add(1, Relaxed);
                    tracing::info!(
                        "configuration reloaded: new connections use it, established ones keep theirs"
                    );
                    match not_applied {
                        None => "ok".to_string(),
                        Some(what) => {
                            tracing::warn!("not applied by the reload: {what}");
                            format!("partial: {}", what.replace('\n', "; "))
                        }
                    }
                }
                Err(e) => {
                    shared.stats.reload_failures.fetch_add(1, Relaxed);
                    let why = format!("{e:#}");
                    tracing::error!(
                        "reload failed, the previous configuration stays in force: {why}"
                    );
                    format!("failed: {}", why.replace('\n', "; "))
                }
            };
            if let Some(p) = &mut pid_file {
                p.record_reload(&status);
            }
        }
        anyhow::Ok(())
    })?;
    tracing::info!(
        "shutting down: no new connections; in-flight responses get {} s",
        config.shutdown_grace.as_secs()
    );
    let _ = stop_tx.send(true);
    for t in threads {
        let _ = t.join();
    }
    drop(pid_file);
    Ok(())
}

/// The pid file (and its reload-outcome file): written once the server listens, removed when
/// it exits.
struct PidFile {
    path: std::path::PathBuf,
    reload_path: std::path::PathBuf,
    reloads: u64,
}

impl PidFile {
    fn create(path: &std::path::Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("cannot write the pid file {}", path.display()))?;
        let reload_path = reload_status_path(path);
        let _ = std::fs::remove_file(&reload_path);
        Ok(Self {
            path: path.to_path_buf(),
            reload_path,
            reloads: 0,
        })
    }

    /// `<attempt number> ok` or `<attempt number> failed: <why>`, replaced atomically so
    /// that `tlsplane reload` never reads half a line.
    fn record_reload(&mut self, status: &str) {
        self.reloads += 1;
        let tmp = self.reload_path.with_extension("reload.tmp");
        let line = format!("{} {status}\n", self.reloads);
        if let Err(e) =
            std::fs::write(&tmp, line).and_then(|()| std::fs::rename(&tmp, &self.reload_path))
        {
            tracing::warn!(error = %e, path = %self.reload_path.display(), "cannot record the reload's outcome");
        }
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(&self.reload_path);
    }
}

/// Where a server with pid file `pid_file` records the outcome of its reloads.
pub fn reload_status_path(pid_file: &std::path::Path) -> std::path::PathBuf {
    let mut p = pid_file.as_os_str().to_owned();
    p.push(".reload");
    p.into()
}

/// Binds every address once per worker, before any worker starts, so that address errors stop
/// start-up and port 0 resolves once for all workers.
fn bind_all(
    listen: &[SocketAddr],
    workers: usize,
    send_timeout: Option<Duration>,
) -> anyhow::Result<Vec<Vec<std::net::TcpListener>>> {
    // All probes before any bind: our own sockets for one address must not look like
    // another server to the probe of an overlapping one (0.0.0.0:443 and 127.0.0.1:443).
    refuse_taken(listen)?;
    let mut per_worker: Vec<Vec<std::net::TcpListener>> =
        (0..workers).map(|_| Vec::new()).collect();
    for addr in listen {
        let mut actual = *addr;
        for (i, slot) in per_worker.iter_mut().enumerate() {
            let l = bind_reuseport(actual, send_timeout)
                .with_context(|| format!("cannot listen on {actual}"))?;
            if i == 0 {
                actual = l.local_addr()?;
            }
            slot.push(l);
        }
    }
    Ok(per_worker)
}

/// Fails if another program already listens on one of these addresses (see
/// [`refuse_if_listened`]). Products call it first thing, before costly start-up work (the kTLS
/// probe, certificates); [`run`] checks again right before binding.
pub fn refuse_taken(listen: &[SocketAddr]) -> anyhow::Result<()> {
    for addr in listen.iter().filter(|a| a.port() != 0) {
        refuse_if_listened(*addr)?;
    }
    Ok(())
}

/// Our listeners set SO_REUSEPORT so that each worker has its own socket; the price is that
/// the kernel would also let a second server (same user) join the port and silently take part
/// of its connections. A socket without SO_REUSEPORT cannot bind where anyone listens, so a
/// throw-away one tells whether the port is free before our workers bind it.
fn refuse_if_listened(addr: SocketAddr) -> anyhow::Result<()> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    // Connections of an earlier run lingering in TIME_WAIT must not count as a listener.
    s.set_reuse_address(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    match s.bind(&addr.into()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => bail!(
            "cannot listen on {addr}: address already in use (another server listens there; \
             refusing to share the port with it)"
        ),
        Err(e) => Err(e).with_context(|| format!("cannot listen on {addr}")),
    }
}

fn bind_reuseport(
    addr: SocketAddr,
    send_timeout: Option<Duration>,
) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.set_nonblocking(true)?;
    // Accepted sockets inherit TCP_NODELAY from the listener: one setsockopt per listener
    // instead of one per connection.
    s.set_nodelay(true)?;
    // ... and TCP_USER_TIMEOUT (the send timeout), as HAProxy's `tcp-ut` does.
    if send_timeout.is_some() {
        s.set_tcp_user_timeout(send_timeout)?;
    }
    s.bind(&addr.into())?;
    s.listen(1024)?;
    Ok(s.into())
}

fn current_thread_runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            tracing::error!(error = %e, "worker runtime failed to start");
            None
        }
    }
}

/// Keeps a timer pending in the event loop that is always due sooner than the per-connection
/// deadlines (handshake, idle, header and lingering timeouts, all 1 s or more by default).
/// Why: tokio writes to its own eventfd whenever a new timer becomes the loop's earliest, even
/// from the loop's own thread; on a quiet loop every connection's first deadline did, one
/// `write(2)` (and the wakeup it causes) per connection. The anchor costs a wakeup a second.
fn spawn_timer_anchor() {
    tokio::spawn(async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}

/// One unit of a count for as long as it lives (however the task holding it ends).
struct Counted(Arc<AtomicUsize>);
impl Counted {
    fn new(count: Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Relaxed);
        Self(count)
    }
}
impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Runs `task`; a panic in it is counted (the panic hook has logged one line) and goes no
/// further: the connection's socket closes as the task's state drops.
async fn contain_panics(stats: &RuntimeStats, task: impl Future<Output = ()>) {
    if std::panic::AssertUnwindSafe(task)
        .catch_unwind()
        .await
        .is_err()
    {
        stats.task_panics.fetch_add(1, Relaxed);
    }
}

/// A connection on its way from the handshake loop to the connection loop, still counted in
/// flight.
type Established<H, P> = (DetachedTlsStream, SocketAddr, P, Admitted, Arc<H>);

/// What an admitted connection holds until it closes: its place in the in-flight count and in
/// the per-client limits.
struct Admitted {
    _in_flight: Counted,
    ticket: Ticket,
}

/// An admitted connection on its way to its handshake: its guards.
struct Arriving {
    peer: SocketAddr,
    guard: Admitted,
    /// Its place among the loop's handshakes in progress.
    counted: Counted,
}

/// What a handshake loop needs to give a connection its handshake task.
struct HandshakeStart<H: Handler> {
    shared: Arc<Shared<H>>,
    to_conn: mpsc::UnboundedSender<Established<H, H::Parked>>,
    stop: watch::Receiver<bool>,
    full: Arc<AtomicUsize>,
    /// Signalled when a full handshake starts, and the connections waiting for their first
    /// request on this loop (see [`ConnContext::first_request_here`]).
    full_started: Arc<tokio::sync::Notify>,
    first_request_waiting: Arc<AtomicUsize>,
    pre_hello: Arc<EvictionList>,
    post_hello: Arc<EvictionList>,
}

impl<H: Handler> HandshakeStart<H> {
    /// Spawns the task of a connection whose first byte (or end) has arrived.
    /// `received`: its first bytes, when they were read at accept.
    fn start(&self, tcp: std::net::TcpStream, a: Arriving, received: Option<tlsplane::Received>) {
        let (s, to_conn, stop) = (self.shared.clone(), self.to_conn.clone(), self.stop.clone());
        let entry = self.pre_hello.enter();
        let (post_hello, full) = (self.post_hello.clone(), self.full.clone());
        let (full_started, first_request_waiting) = (
            self.full_started.clone(),
            self.first_request_waiting.clone(),
        );
        tokio::spawn(async move {
            let Arriving {
                peer,
                mut guard,
                counted,
            } = a;
            let _counted = counted;
            let tcp = match tokio::net::TcpStream::from_std(tcp) {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "connection registration failed");
                    return;
                }
            };
            let stats = s.stats.clone();
            // The handshake's state is boxed and freed before the handler's is allocated.
            contain_panics(&stats, async move {
                let Some((tls, handler)) = Box::pin(handshake(
                    tcp,
                    peer,
                    received,
                    &s,
                    &mut guard,
                    full.clone(),
                    &full_started,
                    entry,
                    post_hello,
                ))
                .await
                else {
                    return;
                };
                let ctx = ConnContext {
                    stop,
                    idle: Idle(s.idle.clone()),
                    first_request: Some(FirstRequestWait {
                        full,
                        full_started,
                        waiting: first_request_waiting,
                        stats: s.stats.clone(),
                    }),
                };
                serve_first(tls, peer, handler, guard, to_conn, ctx).await;
            })
            .await;
        });
    }
}

/// Closes the oldest connection that has not sent a whole ClientHello: silent (in the lobby)
/// or part-way (its handshake task waiting for the rest), whichever arrived first.
fn evict_oldest_unspoken(lobby: &crate::lobby::Lobby<Arriving>, pre_hello: &EvictionList) -> bool {
    match (lobby.oldest_since(), pre_hello.oldest_since()) {
        (Some(a), Some(b)) if b < a => pre_hello.evict_oldest(),
        (Some(_), _) => lobby.evict_oldest(),
        (None, _) => pre_hello.evict_oldest(),
    }
}

fn handshake_loop<H: Handler>(
    listeners: Vec<std::net::TcpListener>,
    to_conn: mpsc::UnboundedSender<Established<H, H::Parked>>,
    shared: Arc<Shared<H>>,
    stop: watch::Receiver<bool>,
) {
    if shared.config.handshake_nice != 0 {
        if let Err(e) = tlsplane_sys::set_current_thread_nice(shared.config.handshake_nice) {
            tracing::warn!(error = %e, "cannot lower the handshake threads' priority");
        }
    }
    let Some(rt) = current_thread_runtime() else {
        return;
    };
    // Handshakes of this loop still in progress, from accept (connections it handed over no
    // longer count).
    let handshaking = Arc::new(AtomicUsize::new(0));
    let starter = Arc::new(HandshakeStart {
        shared: shared.clone(),
        to_conn,
        stop: stop.clone(),
        // Of those, the ones known to be full handshakes.
        full: Arc::new(AtomicUsize::new(0)),
        full_started: Arc::new(tokio::sync::Notify::new()),
        first_request_waiting: Arc::new(AtomicUsize::new(0)),
        // By stage: past the first byte but before a whole ClientHello (no crypto spent yet),
        // and after it. Before the first byte they wait in the lobby.
        pre_hello: Arc::new(EvictionList::default()),
        post_hello: Arc::new(EvictionList::default()),
    });
    rt.block_on(async move {
        spawn_timer_anchor();
        let (lobby, poll) = match crate::lobby::Lobby::<Arriving>::new()
            .and_then(|(l, p)| Ok((l, tlsplane_sys::async_epoll(p)?)))
        {
            Ok(x) => x,
            Err(e) => {
                tracing::error!(error = %e, "cannot create the lobby's epoll instance");
                return;
            }
        };
        let watcher = {
            let (starter, stats) = (starter.clone(), shared.stats.clone());
            let first_byte_deadline = shared.config.limits.first_byte_timeout();
            tokio::spawn(lobby.clone().watch(
                poll,
                // At --first-byte-timeout 0 the handshake deadline still applies to a
                // connection that never speaks (and it counts as a handshake timeout).
                first_byte_deadline.unwrap_or(shared.config.handshake_timeout),
                move |tcp, a| starter.start(tcp, a, None),
                move |n| {
                    let counter = match first_byte_deadline {
                        Some(_) => &stats.first_byte_timeouts,
                        None => &stats.handshake_timeouts,
                    };
                    counter.fetch_add(n as u64, Relaxed);
                },
                stop.clone(),
            ))
        };
        let mut accepts = Vec::new();
        for l in listeners {
            let l = match tlsplane_sys::async_listener(l) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "listener registration failed");
                    continue;
                }
            };
            let (shared, starter, lobby, mut stop) =
                (shared.clone(), starter.clone(), lobby.clone(), stop.clone());
            let handshaking = handshaking.clone();
            accepts.push(tokio::spawn(async move {
                // --client-block: this listener's drop filter follows the blocked addresses,
                // re-made when one is added and when the first of them is due to leave.
                let mut blocks = shared.admission.subscribe_blocks();
                let mut unblock_at: Option<tokio::time::Instant> = None;
                loop {
                    tokio::select! {
                        Ok(()) = blocks.changed() => {
                            unblock_at = refilter(&l, &shared.admission);
                        }
                        _ = sleep_until_some(unblock_at) => {
                            unblock_at = refilter(&l, &shared.admission);
                        }
                        r = accept_unregistered(&l) => match r {
                            Ok((tcp, peer)) => {
                                let refuse = |tcp, refusal| {
                                    shared.stats.limits.count(refusal);
                                    tracing::debug!(%peer, ?refusal, "connection refused by a limit");
                                    limits::reset(tcp);
                                    if shared.admission.block_refused(peer, refusal) {
                                        shared.stats.limits.client_blocks.fetch_add(1, Relaxed);
                                    }
                                };
                                // The client's own limits first: a connection they refuse
                                // must not cost another client its connection (the evictions
                                // below).
                                let ticket = match shared.admission.admit_client(peer) {
                                    Ok(t) => t,
                                    Err(refusal) => {
                                        refuse(tcp, refusal);
                                        continue;
                                    }
                                };
                                let mut open = shared.in_flight.load(Relaxed);
                                let max = shared.config.limits.max_connections;
                                // An evicted connection closes in a moment and this one
                                // takes its place. Until its task has run it still counts
                                // as open: then the next one evicted stands for it (as
                                // nginx drains reusable connections), rather than a client
                                // being refused while idle connections are there to close.
                                while max > 0 && open >= max && shared.idle.evict_oldest() {
                                    shared.stats.idle_evicted.fetch_add(1, Relaxed);
                                    open -= 1;
                                }
                                let mut hs = handshaking.load(Relaxed);
                                let cap = shared.config.limits.max_handshakes_per_worker;
                                if cap > 0
                                    && hs >= cap
                                    && (evict_oldest_unspoken(&lobby, &starter.pre_hello)
                                        || shared.config.limits.handshake_evict_after().is_some_and(|age| starter.post_hello.evict_oldest_older_than(age)))
                                {
                                    // A connection that has not sent a whole ClientHello gives
                                    // way (silent or trickling: slowloris), else one stuck
                                    // past it for long; else this connection is refused.
                                    shared.stats.handshakes_evicted.fetch_add(1, Relaxed);
                                    hs -= 1;
                                }
                                if let Err(refusal) = shared.admission.admit_global(open, hs) {
                                    ticket.refused();
                                    refuse(tcp, refusal);
                                    continue;
                                }
                                shared.stats.connections.fetch_add(1, Relaxed);
                                let arriving = Arriving {
                                    peer,
                                    guard: Admitted {
                                        _in_flight: Counted::new(shared.in_flight.clone()),
                                        ticket,
                                    },
                                    counted: Counted::new(handshaking.clone()),
                                };
                                // A connection that has spoken (or ended) goes straight to its
                                // handshake, with what it sent; a silent one to the lobby.
                                match tlsplane::Received::read(&tcp) {
                                    Ok(Some(received)) => starter.start(tcp, arriving, Some(received)),
                                    Ok(None) => {
                                        if let Err(e) = lobby.enter(tcp, arriving) {
                                            tracing::debug!(%peer, error = %e, "lobby registration failed");
                                        }
                                    }
                                    Err(_) => {}
                                }
                            }
                            Err(e) => {
                                if !accept_with_spare(&l, &e, &shared).await {
                                    // Nothing could be taken off the queue: back off
                                    // instead of spinning.
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                }
                            }
                        },
                        _ = stop.changed() => break,
                    }
                }
            }));
        }
        drop(starter);
        for a in accepts {
            let _ = a.await;
        }
        let _ = watcher.await;
        // Listeners are closed; handshakes in progress still finish (or time out: each has
        // its own timeout) and go to the connection loop, which drains them. A connection
        // whose first request this loop is answering is in flight like any other and gets
        // the grace: with only the handshake timeout, a large first response was cut off
        // (the runtime drops what is left) when it outlasted that.
        let deadline = tokio::time::Instant::now()
            + shared
                .config
                .shutdown_grace
                .max(shared.config.handshake_timeout);
        while handshaking.load(Relaxed) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// Descriptors a server needs besides its connections, per worker, made after
/// [`default_max_connections`] counts those already open: two event loops and the lobby's
/// epoll instance (measured: 9 to 10 per worker with 1 and 4 workers).
const DESCRIPTORS_PER_WORKER: u64 = 10;

/// --max-connections 0: as many connections as the open-files limit leaves room for, so that
/// the limit (and its eviction of idle connections) comes before accept fails with EMFILE.
/// Taken off the limit: the descriptors open now (standard streams, listeners, the key
/// daemon's sockets, the admin listener, the spare), those each worker opens, and a reserve
/// for what comes and goes (a file being sent, a reload, a key daemon restart): 32 + 1/64 of
/// the limit. What is left is divided by the descriptors one connection holds.
fn default_max_connections(config: &RuntimeConfig) -> anyhow::Result<usize> {
    let limit = tlsplane_sys::nofile_limit().context("cannot read the open-files limit")?;
    let open = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as u64)
        .unwrap_or(64);
    let needed = open + DESCRIPTORS_PER_WORKER * config.workers as u64 + 32 + limit / 64;
    let per_connection = config.descriptors_per_connection.max(1) as u64;
    let max = limit.saturating_sub(needed) / per_connection;
    if max < 16 {
        bail!(
            "the open-files limit ({limit}) leaves room for {max} connections (the server needs \
             {needed} descriptors, and {per_connection} per connection); raise it (ulimit -n) \
             or set --max-connections"
        );
    }
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    tracing::info!(
        "--max-connections {max}: the open-files limit {limit}, less {needed} descriptors the \
         server needs, / {per_connection} per connection"
    );
    Ok(max)
}

/// The spare descriptor (see `Shared::spare`); without it (already out of descriptors) the
/// server runs as it would otherwise.
fn open_spare() -> Option<std::fs::File> {
    match std::fs::File::open("/dev/null") {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(error = %e, "cannot open a spare descriptor (/dev/null)");
            None
        }
    }
}

/// After accept failed with `e`: if the process or the system is out of descriptors, frees
/// the spare one, accepts the waiting connection with it and resets that connection at once
/// (a client told now can retry; one left in the queue waits until a descriptor frees up).
/// Linux fails accept with EMFILE before it looks at the queue, so the queue may also turn
/// out empty: then the listener waits for its next connection, and nothing is logged.
/// Otherwise the failure is logged, at most once a second. False: back off before the next
/// accept.
async fn accept_with_spare<H>(
    l: &tokio::io::unix::AsyncFd<std::net::TcpListener>,
    e: &std::io::Error,
    shared: &Shared<H>,
) -> bool {
    let out_of_descriptors = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
    let mut reset = false;
    if out_of_descriptors {
        let Ok(mut ready) = l.readable().await else {
            return false;
        };
        let accepted = ready.try_io(|l| {
            let mut spare = shared.spare.lock().unwrap_or_else(|e| e.into_inner());
            // Lost earlier to another thread that took the freed number: try again.
            let freed = spare
                .take()
                .or_else(|| std::fs::File::open("/dev/null").ok());
            let r = freed.map(|freed| {
                drop(freed);
                // Closed before the spare is opened again: it needs the number back.
                l.get_ref().accept().map(|(tcp, _)| limits::reset(tcp))
            });
            *spare = std::fs::File::open("/dev/null").ok();
            r.unwrap_or_else(|| Err(std::io::Error::from_raw_os_error(libc::EMFILE)))
        });
        match accepted {
            Ok(Ok(())) => {
                shared.stats.accept_emfile.fetch_add(1, Relaxed);
                reset = true;
            }
            // The queue is empty (its readiness cleared): nothing was refused.
            Err(_would_block) => return true,
            Ok(Err(_)) => {}
        }
    }
    let suppressed = shared
        .accept_failures
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pass(Instant::now());
    if let Some(suppressed) = suppressed {
        tracing::warn!(
            error = %e,
            suppressed,
            "accept failed{}",
            if reset { "; the connection was reset" } else { "" }
        );
    }
    reset
}

/// At most one log line a second, counting the ones held back.
#[derive(Default)]
pub struct Throttled {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttled {
    /// `Some(lines held back since the last one)` when a line may be logged now.
    pub fn pass(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(1))
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// Attaches to `l` the drop filter for the addresses blocked now; when to do it again.
fn refilter(
    l: &tokio::io::unix::AsyncFd<std::net::TcpListener>,
    admission: &limits::Admission,
) -> Option<tokio::time::Instant> {
    let (program, next) = admission.block_filter(std::time::Instant::now());
    use std::os::fd::AsFd;
    if let Err(e) = tlsplane_sys::set_socket_filter(l.get_ref().as_fd(), &program) {
        // Without the filter, those clients are refused at accept as before.
        tracing::warn!(error = %e, "cannot attach the client block filter to a listener");
    }
    next.map(tokio::time::Instant::from_std)
}

/// Sleeps until `at`, or for ever.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// accept(2) without registering the new socket with the event loop: a connection refused by
/// a limit then costs accept and close only (tokio's accept registers the socket, and dropping
/// it deregisters it: two epoll_ctl calls more per refusal).
async fn accept_unregistered(
    l: &tokio::io::unix::AsyncFd<std::net::TcpListener>,
) -> std::io::Result<(std::net::TcpStream, SocketAddr)> {
    loop {
        let mut ready = l.readable().await?;
        if let Ok(r) = ready
            .try_io(|l| tlsplane_sys::accept_nonblocking(std::os::fd::AsFd::as_fd(l.get_ref())))
        {
            return r;
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn handshake<H: Handler>(
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    received: Option<tlsplane::Received>,
    shared: &Shared<H>,
    guard: &mut Admitted,
    full: Arc<AtomicUsize>,
    full_started: &tokio::sync::Notify,
    mut in_progress: EvictionEntry,
    post_hello: Arc<EvictionList>,
) -> Option<(TlsStream, Arc<H>)> {
    // The configuration in force when the handshake starts serves the connection to its end.
    let generation = shared
        .current
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let evicted = in_progress.notify.clone();
    // Holds a place among the worker's full handshakes from the ClientHello to the end of the
    // handshake.
    let mut full_place = None;
    let mut refused = None;
    let mut admit = |hello: &tlsplane::hello::HelloInfo| match guard
        .ticket
        .on_hello(hello.resumption, full.load(Relaxed))
    {
        Ok(()) => {
            if !hello.resumption {
                full_place = Some(Counted::new(full.clone()));
                // Connections waiting here for their first request move on.
                full_started.notify_waiters();
            }
            in_progress.move_to(&post_hello);
            true
        }
        Err(r) => {
            refused = Some(r);
            false
        }
    };
    let accept = tokio::time::timeout(
        shared.config.handshake_timeout,
        generation
            .acceptor
            .accept_received(tcp, received, &mut admit),
    );
    let accepted = tokio::select! {
        r = accept => r,
        // Evicted to make room (counted where it was decided): the connection closes.
        _ = evicted.notified() => return None,
    };
    drop(in_progress);
    drop(full_place);
    let tls = match accepted {
        Ok(Err(tlsplane::Error::Refused)) => {
            if let Some(r) = refused {
                shared.stats.limits.count(r);
                tracing::debug!(%peer, refusal = ?r, "ClientHello refused by a limit");
            }
            return None;
        }
        Ok(Err(e @ tlsplane::Error::ClientHelloTooLarge(_))) => {
            shared.stats.limits.count(limits::Refusal::ClientHelloSize);
            tracing::debug!(%peer, error = %e, "ClientHello refused");
            return None;
        }
        Ok(Err(e @ tlsplane::Error::ClientHelloTooManyPskIdentities(_))) => {
            shared.stats.limits.count(limits::Refusal::PskIdentities);
            tracing::debug!(%peer, error = %e, "ClientHello refused");
            return None;
        }
        Ok(Err(e @ tlsplane::Error::ClientHelloTooManyRecords(_))) => {
            shared
                .stats
                .limits
                .count(limits::Refusal::ClientHelloRecords);
            tracing::debug!(%peer, error = %e, "ClientHello refused");
            return None;
        }
        Ok(Ok(t)) => {
            guard.ticket.handshake_done();
            shared
                .stats
                .histograms
                .handshake
                .observe(t.info().handshake_time.as_secs_f64());
            t
        }
        Ok(Err(e)) => {
            shared.stats.handshake_errors.fetch_add(1, Relaxed);
            tracing::debug!(%peer, error = %e, "handshake failed");
            return None;
        }
        Err(_) => {
            shared.stats.handshake_timeouts.fetch_add(1, Relaxed);
            tracing::debug!(%peer, "handshake timed out");
            return None;
        }
    };
    Some((tls, generation.handler.clone()))
}

/// The handler's first turn with an established connection, on the handshake loop, then the
/// hand-off to the connection loop if it parks.
async fn serve_first<H: Handler>(
    tls: TlsStream,
    peer: SocketAddr,
    handler: Arc<H>,
    guard: Admitted,
    to_conn: mpsc::UnboundedSender<Established<H, H::Parked>>,
    ctx: ConnContext,
) {
    let serve = handler.clone().serve(tls, peer, Phase::Handshake, ctx);
    let (tls, parked) = match Box::pin(serve).await {
        Served::Done => return,
        Served::Park(tls, parked) => (tls, parked),
    };
    match tls.detach() {
        Ok(d) => {
            // Fails only when the connection loop is gone (shutdown): the connection drops.
            let _ = to_conn.send((d, peer, parked, guard, handler));
        }
        Err(e) => tracing::debug!(%peer, error = %e, "hand-off to the connection loop failed"),
    }
}

fn connection_loop<H: Handler>(
    mut from_hs: mpsc::UnboundedReceiver<Established<H, H::Parked>>,
    shared: Arc<Shared<H>>,
    stop: watch::Receiver<bool>,
) {
    let Some(rt) = current_thread_runtime() else {
        return;
    };
    rt.block_on(async move {
        spawn_timer_anchor();
        let start = |(d, peer, parked, guard, handler): Established<H, H::Parked>| {
            let (s, stop) = (shared.clone(), stop.clone());
            tokio::spawn(async move {
                let _guard = guard;
                let tls = match d.attach() {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "connection registration failed");
                        return;
                    }
                };
                let serve = handler.serve(
                    tls,
                    peer,
                    Phase::Moved(parked),
                    ConnContext {
                        stop,
                        idle: Idle(s.idle.clone()),
                        first_request: None,
                    },
                );
                // Boxed: inline, the serve future sat in this task twice over (~28 KB per
                // connection, measured); parking is for the handshake loop only, so a handler
                // that asks anyway gets its connection closed.
                let serve = Box::pin(serve);
                contain_panics(&s.stats, async {
                    let _ = serve.await;
                })
                .await;
            });
        };
        let mut stopping = stop.clone();
        loop {
            tokio::select! {
                c = from_hs.recv() => match c {
                    Some(c) => start(c),
                    None => break,
                },
                _ = stopping.changed() => break,
            }
        }
        // Shutdown: take what the handshake loop still hands over, give everything the grace
        // period, then return (the runtime drops what is left).
        let deadline = tokio::time::Instant::now() + shared.config.shutdown_grace;
        loop {
            while let Ok(c) = from_hs.try_recv() {
                start(c);
            }
            if shared.in_flight.load(Relaxed) == 0 || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}
