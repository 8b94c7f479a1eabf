//! h2c backend connections (`--backend-protocol h2c`): cleartext HTTP/2 with prior knowledge
//! (RFC 9113 §3.3), over TCP or a Unix socket, driven by h2's client side.
//!
//! One connection carries up to [`MAX_BACKEND_STREAMS`] streams at once; a worker opens
//! another to the same backend when all of its connections are that busy, within
//! --backend-max-connections (each connection holds one place, as an HTTP/1.1 one does).
//! Connections are per worker thread, as the HTTP/1.1 keep-alive lists are: each is driven by
//! a task on the thread that opened it. One with no stream for --backend-idle-timeout is
//! closed (at once with --backend-keepalive 0); one h2 gave up on (GOAWAY, an error, the
//! backend closed it) is dropped from the list and never offered again.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::io::{AsyncRead, AsyncWrite};

use super::backend::{Io, Slot};
use super::{Proxy, Unavailable};
use tlsplane_h2::settings::MAX_BACKEND_STREAMS;

/// How often a connection's task looks whether it has been idle too long.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// What a connection's users and its task share.
struct ConnState {
    /// Streams in flight on it (leases held).
    streams: AtomicUsize,
    /// h2 is done with it: not to be offered again.
    closed: AtomicBool,
    /// When its last stream ended.
    last_used: Mutex<Instant>,
}

/// One backend's h2c connections in one thread.
type Conns = Vec<(SendRequest<Bytes>, Arc<ConnState>)>;

thread_local! {
    /// This thread's h2c connections, by (pool, backend).
    static CONNS: RefCell<HashMap<(u64, usize), Conns>> = RefCell::new(HashMap::new());
}

/// One stream's use of an h2c connection; counted until dropped.
pub(super) struct Lease {
    pub(super) send: SendRequest<Bytes>,
    /// The backend's number in its site's pool.
    pub(super) which: usize,
    /// The connection was open already.
    pub(super) reused: bool,
    state: Arc<ConnState>,
}

impl Lease {
    /// h2 failed on this connection: no stream is to be opened on it again.
    pub(super) fn close(&self) {
        self.state.closed.store(true, Relaxed);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        *self
            .state
            .last_used
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.state.streams.fetch_sub(1, Relaxed);
    }
}

/// A stream's place on an open connection to backend `i`, if this thread has one with room.
fn existing(pool: u64, i: usize) -> Option<Lease> {
    CONNS.with_borrow_mut(|conns| {
        let list = conns.get_mut(&(pool, i))?;
        list.retain(|(_, s)| !s.closed.load(Relaxed));
        let (send, state) = list
            .iter()
            .find(|(_, s)| s.streams.load(Relaxed) < MAX_BACKEND_STREAMS)?;
        state.streams.fetch_add(1, Relaxed);
        Some(Lease {
            send: send.clone(),
            which: i,
            reused: true,
            state: state.clone(),
        })
    })
}

impl Proxy {
    /// A stream's place on an h2c connection to one of `site`'s backends, in rotation: on
    /// one this thread has open, else on a new one.
    pub(super) async fn h2c_backend(&self, site: usize) -> Result<Lease, Unavailable> {
        let pool = &self.pools[site];
        let mut full = false;
        for i in pool.order() {
            if let Some(lease) = existing(pool.id(), i) {
                return Ok(lease);
            }
            let wait = Duration::from_secs(self.args.connect_timeout);
            let max = self.args.backend_max_connections;
            let evicted = &self.stats.backend_idle_evicted;
            let Some(slot) = pool.slot_or_evict(i, max, wait, evicted).await else {
                self.stats.backend_full.fetch_add(1, Relaxed);
                full = true;
                continue;
            };
            let Some(conn) = self.connect_to(site, i, slot).await else {
                continue;
            };
            let idle = if self.args.backend_keepalive == 0 {
                Duration::ZERO
            } else {
                Duration::from_secs(self.args.backend_idle_timeout)
            };
            let (io, slot) = conn.into_parts();
            let started = match io {
                Io::Tcp(s) => start(s, slot, idle).await,
                Io::Unix(s) => start(s, slot, idle).await,
            };
            match started {
                Ok((send, state)) => {
                    self.stats.h2c_connections.fetch_add(1, Relaxed);
                    CONNS.with_borrow_mut(|conns| {
                        let list = conns.entry((pool.id(), i)).or_default();
                        list.retain(|(_, s)| !s.closed.load(Relaxed));
                        list.push((send.clone(), state.clone()));
                    });
                    return Ok(Lease {
                        send,
                        which: i,
                        reused: false,
                        state,
                    });
                }
                Err(e) => {
                    let backend = &pool.backends[i];
                    tracing::warn!(%backend, error = %e, "h2c handshake failed; trying the next");
                    self.stats.backend_connect_failures.fetch_add(1, Relaxed);
                    pool.mark_down(i, Duration::from_secs(self.args.backend_down_time));
                }
            }
        }
        Err(if full {
            Unavailable::Full
        } else {
            Unavailable::Down
        })
    }
}

/// Starts h2's client side on `io` (its preface and SETTINGS are written; the backend's come
/// with its first response) and the task that drives the connection until h2 is done with it
/// or it has had no stream for `idle`. The task holds the connection's place (`slot`).
async fn start<T>(
    io: T,
    slot: Option<Slot>,
    idle: Duration,
) -> Result<(SendRequest<Bytes>, Arc<ConnState>), h2::Error>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = tlsplane_h2::settings::client()
        .handshake::<_, Bytes>(io)
        .await?;
    let state = Arc::new(ConnState {
        streams: AtomicUsize::new(1),
        closed: AtomicBool::new(false),
        last_used: Mutex::new(Instant::now()),
    });
    let task_state = state.clone();
    tokio::spawn(async move {
        let _slot = slot;
        let state = task_state;
        tokio::pin!(conn);
        loop {
            tokio::select! {
                ended = &mut conn => {
                    if let Err(e) = ended {
                        tracing::debug!(error = %e, "h2c backend connection ended");
                    }
                    break;
                }
                _ = tokio::time::sleep(IDLE_CHECK.min(idle.max(Duration::from_millis(100)))) => {
                    let since = *state.last_used.lock().unwrap_or_else(|e| e.into_inner());
                    if state.streams.load(Relaxed) == 0 && since.elapsed() >= idle {
                        break;
                    }
                }
            }
        }
        state.closed.store(true, Relaxed);
    });
    Ok((send, state))
}
