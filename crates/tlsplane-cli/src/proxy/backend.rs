//! Backends: the rotation with passive health checks, connections of either kind (TCP or
//! Unix), and the keep-alive connections kept idle for reuse (HTTP mode).

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::Interest;

use tlsplane_server::config::Backend;

/// One site's backends, in rotation, with what passive health checking learnt.
pub(super) struct Pool {
    /// Tells this pool's idle connections from those of pools replaced by a reload.
    id: u64,
    pub(super) backends: Vec<Backend>,
    /// By backend: the addresses a TCP backend's name resolved to when the configuration was
    /// loaded (none for a Unix socket), and the one that last took a connection (tried first).
    addrs: Vec<(Vec<SocketAddr>, AtomicUsize)>,
    next: AtomicUsize,
    /// By backend: left out of the rotation until then.
    down_until: Vec<Mutex<Option<Instant>>>,
    /// By backend: connections open (in use or idle) across workers, and how idle ones held
    /// by other workers are asked back.
    shared: Vec<Arc<BackendShared>>,
}

/// `HOST:PORT` -> its addresses (a literal address costs no lookup).
fn resolve(host_port: &str) -> anyhow::Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = host_port
        .to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("backend {host_port}: cannot resolve its host name: {e}"))?
        .collect();
    if addrs.is_empty() {
        anyhow::bail!("backend {host_port}: its host name resolves to no address");
    }
    Ok(addrs)
}

/// What the workers share about one backend's connections.
#[derive(Default)]
pub(super) struct BackendShared {
    /// Open, in use or idle (what --backend-max-connections bounds).
    open: AtomicUsize,
    /// Of those, idle in some worker's keep-alive list.
    idle: AtomicUsize,
    /// Idle connections other workers asked to have closed (a worker at the limit, with none
    /// idle of its own): the worker holding one closes its oldest and takes one off.
    evict_wanted: AtomicUsize,
    /// Woken when a connection closes (a place under the limit is free).
    freed: tokio::sync::Notify,
}

impl Pool {
    /// Resolves the backends' host names now, once (as nginx does for an upstream without a
    /// `resolver`): a connection then never waits for a lookup, nor fails because DNS does,
    /// and a name that resolves to several addresses does not cost a refused connect to the
    /// first of them per connection. A reload resolves again.
    pub(super) fn new(backends: Vec<Backend>) -> anyhow::Result<Self> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let addrs = backends
            .iter()
            .map(|b| match b {
                Backend::Tcp(hp) => resolve(hp).map(|a| (a, AtomicUsize::new(0))),
                Backend::Unix(_) => Ok((Vec::new(), AtomicUsize::new(0))),
            })
            .collect::<anyhow::Result<_>>()?;
        let down_until = backends.iter().map(|_| Mutex::new(None)).collect();
        let shared = backends.iter().map(|_| Arc::default()).collect();
        Ok(Self {
            id: NEXT_ID.fetch_add(1, Relaxed),
            backends,
            addrs,
            next: AtomicUsize::new(0),
            down_until,
            shared,
        })
    }

    /// Tells this pool from those a reload replaced (keys per-thread connection lists).
    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// TCP backend `i`'s addresses, in the order to try them: the one that took the last
    /// connection first.
    pub(super) fn addrs(&self, i: usize) -> impl Iterator<Item = (usize, SocketAddr)> + '_ {
        let (addrs, last) = &self.addrs[i];
        let first = last.load(Relaxed);
        (0..addrs.len()).map(move |k| {
            let j = (first + k) % addrs.len();
            (j, addrs[j])
        })
    }

    /// Address `j` of backend `i` took a connection.
    pub(super) fn connected_at(&self, i: usize, j: usize) {
        self.addrs[i].1.store(j, Relaxed);
    }

    fn is_down(&self, i: usize, now: Instant) -> bool {
        let g = self.down_until[i].lock().unwrap_or_else(|e| e.into_inner());
        g.is_some_and(|until| until > now)
    }

    pub(super) fn mark_down(&self, i: usize, for_: Duration) {
        if for_.is_zero() {
            return;
        }
        *self.down_until[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + for_);
    }

    /// The order to try backends in for one connection: from the next in rotation, those up
    /// first, then those marked down (a last resort rather than no service at all).
    pub(super) fn order(&self) -> Vec<usize> {
        let n = self.backends.len();
        let start = self.next.fetch_add(1, Relaxed);
        let now = Instant::now();
        let (mut up, down): (Vec<usize>, Vec<usize>) = (0..n)
            .map(|k| (start + k) % n)
            .partition(|&i| !self.is_down(i, now));
        up.extend(down);
        up
    }
}

/// A connected backend, holding its place under --backend-max-connections.
pub(crate) struct BackendConn {
    io: Io,
    /// None: a connection no pool counts (the hand-off's socketpair end).
    _slot: Option<Slot>,
}

/// One of a backend's connections under --backend-max-connections; given back when dropped.
pub(super) struct Slot(Arc<BackendShared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
        self.0.freed.notify_waiters();
    }
}

/// A backend connection's socket, whichever kind.
pub(crate) enum Io {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl BackendConn {
    /// Makes the close that follows a reset (the client reset: the backend must not take
    /// the truncated stream for a complete one).
    pub(crate) fn reset_on_close(&self) {
        let r = match &self.io {
            Io::Tcp(s) => socket2::SockRef::from(s).set_linger(Some(Duration::ZERO)),
            // A Unix stream has no reset; its close is an EOF.
            Io::Unix(_) => Ok(()),
        };
        if let Err(e) = r {
            tracing::debug!(error = %e, "SO_LINGER on the backend socket failed");
        }
    }
}

/// Runs `$op` (a non-blocking syscall on the socket's descriptor) once the socket is ready
/// for `$interest`, again after each EAGAIN.
macro_rules! when_ready {
    ($conn:expr, $interest:expr, |$fd:ident| $op:expr) => {{
        loop {
            let r = match &$conn.io {
                Io::Tcp(s) => {
                    s.ready($interest).await?;
                    s.try_io($interest, || {
                        let $fd = s.as_fd();
                        $op
                    })
                }
                Io::Unix(s) => {
                    s.ready($interest).await?;
                    s.try_io($interest, || {
                        let $fd = s.as_fd();
                        $op
                    })
                }
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => break r,
            }
        }
    }};
}

impl BackendConn {
    pub(super) async fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let r = match &self.io {
                Io::Tcp(s) => {
                    s.readable().await?;
                    s.try_read(buf)
                }
                Io::Unix(s) => {
                    s.readable().await?;
                    s.try_read(buf)
                }
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }

    /// Reads into `buf`, sized to `size` only once there is something to read; an empty read
    /// (EAGAIN) gives the buffer back before waiting, unless `keep` (bytes are streaming).
    pub(super) async fn read_lent(
        &self,
        buf: &mut Vec<u8>,
        size: usize,
        keep: bool,
    ) -> std::io::Result<usize> {
        loop {
            let r = match &self.io {
                Io::Tcp(s) => {
                    s.readable().await?;
                    buf.resize(size, 0);
                    s.try_read(buf)
                }
                Io::Unix(s) => {
                    s.readable().await?;
                    buf.resize(size, 0);
                    s.try_read(buf)
                }
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !keep {
                        *buf = Vec::new();
                    }
                }
                r => return r,
            }
        }
    }

    /// Waits until the backend has sent something (or closed), without reading it.
    pub(super) async fn readable(&self) -> std::io::Result<()> {
        match &self.io {
            Io::Tcp(s) => s.readable().await,
            Io::Unix(s) => s.readable().await,
        }
    }

    /// Reads what the backend has sent, if anything (WouldBlock if nothing).
    pub(super) fn try_read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &self.io {
            Io::Tcp(s) => s.try_read(buf),
            Io::Unix(s) => s.try_read(buf),
        }
    }

    pub(super) async fn write(&self, buf: &[u8]) -> std::io::Result<usize> {
        loop {
            let r = match &self.io {
                Io::Tcp(s) => {
                    s.writable().await?;
                    s.try_write(buf)
                }
                Io::Unix(s) => {
                    s.writable().await?;
                    s.try_write(buf)
                }
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }

    pub(super) async fn write_all(&self, mut buf: &[u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            match self.write(buf).await? {
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                n => buf = &buf[n..],
            }
        }
        Ok(())
    }

    /// Moves up to `max` bytes from the backend into the (empty) pipe.
    pub(super) async fn splice_to(
        &self,
        pipe: BorrowedFd<'_>,
        max: usize,
    ) -> std::io::Result<usize> {
        when_ready!(self, Interest::READABLE, |fd| tlsplane_sys::splice(
            fd, pipe, max
        ))
    }

    /// Moves up to `len` bytes from the pipe to the backend.
    pub(super) async fn splice_from(
        &self,
        pipe: BorrowedFd<'_>,
        len: usize,
    ) -> std::io::Result<usize> {
        when_ready!(self, Interest::WRITABLE, |fd| tlsplane_sys::splice(
            pipe, fd, len
        ))
    }

    pub(super) fn shutdown_write(&self) -> std::io::Result<()> {
        match &self.io {
            Io::Tcp(s) => socket2::SockRef::from(s).shutdown(std::net::Shutdown::Write),
            Io::Unix(s) => socket2::SockRef::from(s).shutdown(std::net::Shutdown::Write),
        }
    }
}

impl BackendConn {
    /// Whether an idle keep-alive connection can carry another request: the backend has
    /// neither closed it nor sent anything unasked.
    fn is_reusable(&self) -> bool {
        let mut byte = [std::mem::MaybeUninit::<u8>::uninit()];
        let r = match &self.io {
            Io::Tcp(s) => socket2::SockRef::from(s).peek(&mut byte),
            Io::Unix(s) => socket2::SockRef::from(s).peek(&mut byte),
        };
        matches!(r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

/// One backend's idle connections in one worker, oldest first, with when each went idle.
struct IdleList {
    shared: Arc<BackendShared>,
    conns: std::collections::VecDeque<(BackendConn, Instant)>,
}

impl IdleList {
    fn pop_newest(&mut self) -> Option<(BackendConn, Instant)> {
        let c = self.conns.pop_back()?;
        self.shared.idle.fetch_sub(1, Relaxed);
        Some(c)
    }

    fn drop_oldest(&mut self) -> bool {
        let dropped = self.conns.pop_front().is_some();
        if dropped {
            self.shared.idle.fetch_sub(1, Relaxed);
        }
        dropped
    }

    fn drop_expired(&mut self, max_idle: Duration) {
        while self
            .conns
            .front()
            .is_some_and(|(_, since)| since.elapsed() >= max_idle)
        {
            self.drop_oldest();
        }
    }

    /// Closes idle connections as long as other workers want some and this list has them.
    fn serve_evictions(&mut self) {
        while !self.conns.is_empty()
            && self
                .shared
                .evict_wanted
                .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
                .is_ok()
        {
            self.drop_oldest();
        }
    }
}

thread_local! {
    /// Idle keep-alive backend connections, by (pool, backend). Per thread: a connection
    /// belongs to the event loop it was registered with, and each connection loop is one
    /// thread.
    static IDLE: RefCell<HashMap<(u64, usize), IdleList>> = RefCell::new(HashMap::new());
    /// This thread's wake-up for eviction requests, once it holds idle connections.
    static EVICTOR: RefCell<Option<Arc<tokio::sync::Notify>>> = const { RefCell::new(None) };
}

/// The eviction wake-ups of every thread that has held idle connections.
static EVICTORS: Mutex<Vec<Arc<tokio::sync::Notify>>> = Mutex::new(Vec::new());

/// Starts this thread's evictor (once): a task that, when asked, closes idle connections
/// other workers need closed to stay under --backend-max-connections.
fn ensure_evictor() {
    EVICTOR.with_borrow_mut(|evictor| {
        if evictor.is_some() {
            return;
        }
        let wake = Arc::new(tokio::sync::Notify::new());
        *evictor = Some(wake.clone());
        EVICTORS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(wake.clone());
        tokio::spawn(async move {
            loop {
                wake.notified().await;
                IDLE.with_borrow_mut(|idle| {
                    for list in idle.values_mut() {
                        list.serve_evictions();
                    }
                });
            }
        });
    });
}

impl Pool {
    /// An idle connection to backend `i` that is still usable, if this thread holds one
    /// younger than `max_idle`.
    pub(super) fn take_idle(&self, i: usize, max_idle: Duration) -> Option<BackendConn> {
        IDLE.with_borrow_mut(|idle| {
            let list = idle.get_mut(&(self.id, i))?;
            while let Some((conn, since)) = list.pop_newest() {
                if since.elapsed() < max_idle && conn.is_reusable() {
                    return Some(conn);
                }
            }
            None
        })
    }

    /// Keeps `conn` (to backend `i`, at the end of a response) for the next request, up to
    /// `keep` per backend; expired ones of every pool go at the same time, and so do any
    /// that other workers asked for in the meantime.
    pub(super) fn put_idle(&self, i: usize, conn: BackendConn, keep: usize, max_idle: Duration) {
        if keep == 0 {
            return;
        }
        ensure_evictor();
        IDLE.with_borrow_mut(|idle| {
            idle.retain(|_, list| {
                list.drop_expired(max_idle);
                !list.conns.is_empty()
            });
            let list = idle.entry((self.id, i)).or_insert_with(|| IdleList {
                shared: self.shared[i].clone(),
                conns: Default::default(),
            });
            if list.conns.len() >= keep {
                list.drop_oldest();
            }
            list.conns.push_back((conn, Instant::now()));
            list.shared.idle.fetch_add(1, Relaxed);
            list.serve_evictions();
        });
    }
}

impl Pool {
    /// A place for one more connection to backend `i`, unless it has `max` open already
    /// (0: no limit).
    pub(super) fn slot(&self, i: usize, max: usize) -> Option<Slot> {
        let shared = &self.shared[i];
        let before = shared.open.fetch_add(1, Relaxed);
        if max == 0 || before < max {
            return Some(Slot(shared.clone()));
        }
        // Not taken, so nothing was freed: no waiter is woken (a Slot's drop would).
        shared.open.fetch_sub(1, Relaxed);
        None
    }

    /// Like [`Pool::slot`], but when the backend is at its limit with connections idle in
    /// other workers, has one of them closed and takes its place (waiting at most `wait`;
    /// `evicted` counts each such place). Idle connections must not make a backend look full
    /// to the workers that do not hold them.
    pub(super) async fn slot_or_evict(
        &self,
        i: usize,
        max: usize,
        wait: Duration,
        evicted: &tlsplane::stats::Counter,
    ) -> Option<Slot> {
        if let Some(slot) = self.slot(i, max) {
            return Some(slot);
        }
        let shared = &self.shared[i];
        let deadline = tokio::time::Instant::now() + wait;
        while shared.idle.load(Relaxed) > 0 {
            let freed = shared.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            shared.evict_wanted.fetch_add(1, Relaxed);
            for wake in EVICTORS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                wake.notify_one();
            }
            let woken = tokio::time::timeout_at(deadline, freed).await.is_ok();
            if let Some(slot) = self.slot(i, max) {
                evicted.fetch_add(1, Relaxed);
                return Some(slot);
            }
            // Nobody served the request (its connection was taken, or expired first): do not
            // leave it to close a connection later for nobody.
            let _ = shared
                .evict_wanted
                .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
            if !woken {
                break;
            }
        }
        None
    }
}

impl BackendConn {
    pub(super) fn new(io: Io, slot: Slot) -> Self {
        Self {
            io,
            _slot: Some(slot),
        }
    }

    /// The socket and its place under --backend-max-connections, for a connection another
    /// protocol runs over (an h2c backend connection, driven by h2).
    pub(super) fn into_parts(self) -> (Io, Option<Slot>) {
        (self.io, self._slot)
    }

    /// A connection outside any backend pool: `tlsplane handoff` relays a TLS connection to
    /// its end of a socketpair with the TCP mode's relay.
    pub(crate) fn unpooled(io: Io) -> Self {
        Self { io, _slot: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_resolved_when_the_configuration_loads() {
        let pool = Pool::new(vec![
            Backend::Tcp("localhost:8080".into()),
            Backend::Unix("/run/app.sock".into()),
            Backend::Tcp("[::1]:9000".into()),
        ])
        .unwrap();
        let first: Vec<SocketAddr> = pool.addrs(0).map(|(_, a)| a).collect();
        assert!(
            first.contains(&"127.0.0.1:8080".parse().unwrap()),
            "{first:?}"
        );
        assert_eq!(pool.addrs(1).count(), 0);
        let third: Vec<SocketAddr> = pool.addrs(2).map(|(_, a)| a).collect();
        assert_eq!(third, vec!["[::1]:9000".parse::<SocketAddr>().unwrap()]);
    }

    #[test]
    fn a_name_that_does_not_resolve_fails_the_load_and_says_which() {
        // An invalid name: refused by the resolver without a network query.
        let err = Pool::new(vec![Backend::Tcp("bad_host!name:80".into())])
            .err()
            .expect("no addresses")
            .to_string();
        assert!(
            err.contains("backend bad_host!name:80: cannot resolve"),
            "{err}"
        );
    }

    #[test]
    fn the_address_that_took_the_last_connection_is_tried_first() {
        let mut pool = Pool::new(vec![Backend::Tcp("127.0.0.1:1".into())]).unwrap();
        let three: Vec<SocketAddr> = ["[::1]:80", "127.0.0.1:80", "127.0.0.2:80"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        pool.addrs[0].0 = three.clone();
        let order = |p: &Pool| p.addrs(0).map(|(j, _)| j).collect::<Vec<_>>();
        assert_eq!(order(&pool), vec![0, 1, 2]);
        pool.connected_at(0, 1);
        assert_eq!(order(&pool), vec![1, 2, 0]);
        assert_eq!(pool.addrs(0).next().unwrap().1, three[1]);
    }
}
