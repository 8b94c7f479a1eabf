//! Backends: the rotation with passive health checks, connections of either kind (TCP or
//! Unix), and the keep-alive connections kept idle for reuse (HTTP mode).

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::Interest;

use super::Backend;

/// One site's backends, in rotation, with what passive health checking learnt.
pub(super) struct Pool {
    /// Tells this pool's idle connections from those of pools replaced by a reload.
    id: u64,
    pub(super) backends: Vec<Backend>,
    next: AtomicUsize,
    /// By backend: left out of the rotation until then.
    down_until: Vec<Mutex<Option<Instant>>>,
    /// By backend: connections open (in use or idle), across workers.
    open: Vec<Arc<AtomicUsize>>,
}

impl Pool {
    pub(super) fn new(backends: Vec<Backend>) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let down_until = backends.iter().map(|_| Mutex::new(None)).collect();
        let open = backends.iter().map(|_| Arc::default()).collect();
        Self {
            id: NEXT_ID.fetch_add(1, Relaxed),
            backends,
            next: AtomicUsize::new(0),
            down_until,
            open,
        }
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
pub(super) struct BackendConn {
    io: Io,
    _slot: Slot,
}

/// One of a backend's connections under --backend-max-connections; given back when dropped.
pub(super) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// A backend connection's socket, whichever kind.
pub(super) enum Io {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl BackendConn {
    /// Makes the close that follows a reset (the client reset: the backend must not take
    /// the truncated stream for a complete one).
    pub(super) fn reset_on_close(&self) {
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

/// Idle connections by (pool, backend), newest last, with when each went idle.
type IdleLists = HashMap<(u64, usize), Vec<(BackendConn, Instant)>>;

thread_local! {
    /// Idle keep-alive backend connections, by (pool, backend), newest last. Per thread: a
    /// connection belongs to the event loop it was registered with, and each connection loop
    /// is one thread.
    static IDLE: RefCell<IdleLists> = RefCell::new(HashMap::new());
}

impl Pool {
    /// An idle connection to backend `i` that is still usable, if this thread holds one
    /// younger than `max_idle`.
    pub(super) fn take_idle(&self, i: usize, max_idle: Duration) -> Option<BackendConn> {
        IDLE.with_borrow_mut(|idle| {
            let list = idle.get_mut(&(self.id, i))?;
            while let Some((conn, since)) = list.pop() {
                if since.elapsed() < max_idle && conn.is_reusable() {
                    return Some(conn);
                }
            }
            None
        })
    }

    /// Keeps `conn` (to backend `i`, at the end of a response) for the next request, up to
    /// `keep` per backend; expired ones of every pool go at the same time.
    pub(super) fn put_idle(&self, i: usize, conn: BackendConn, keep: usize, max_idle: Duration) {
        if keep == 0 {
            return;
        }
        IDLE.with_borrow_mut(|idle| {
            idle.retain(|_, list| {
                list.retain(|(_, since)| since.elapsed() < max_idle);
                !list.is_empty()
            });
            let list = idle.entry((self.id, i)).or_default();
            if list.len() >= keep {
                list.remove(0);
            }
            list.push((conn, Instant::now()));
        });
    }
}

impl Pool {
    /// A place for one more connection to backend `i`, unless it has `max` open already
    /// (0: no limit).
    pub(super) fn slot(&self, i: usize, max: usize) -> Option<Slot> {
        let open = &self.open[i];
        let before = open.fetch_add(1, Relaxed);
        let slot = Slot(open.clone());
        (max == 0 || before < max).then_some(slot)
    }
}

impl BackendConn {
    pub(super) fn new(io: Io, slot: Slot) -> Self {
        Self { io, _slot: slot }
    }
}
