//! Where an accepted connection that has sent nothing yet waits for its first byte: in one
//! epoll set per handshake loop, watched by one task, with no task, buffer or tokio
//! registration of its own. A silent connection then costs its descriptor and an entry here
//! (~0.1 KiB of the server's memory) instead of a task and a registration (~1.7 KiB, measured
//! with 10,000 of them), so a slowloris holds less than nginx would give it.
//!
//! A connection leaves the lobby when its first byte (or its end) arrives, and is handed to
//! `ready`, which gives it a task; when it is the oldest and room is needed
//! ([`Lobby::evict_oldest`]); or when its first-byte deadline passes. Both of the latter close
//! it (it has been sent nothing).

use std::collections::{HashMap, VecDeque};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Token};

struct Waiting<W> {
    sock: TcpStream,
    item: W,
}

struct Inner<W> {
    waiting: HashMap<usize, Waiting<W>>,
    /// Tokens by arrival (some may have left already): for deadlines and eviction.
    order: VecDeque<(Instant, usize)>,
    next: usize,
}

/// The connections of one handshake loop that wait for their first byte. `W` is what each
/// carries along (its admission guards).
pub struct Lobby<W> {
    inner: Mutex<Inner<W>>,
    registry: mio::Registry,
}

impl<W> Lobby<W> {
    /// The lobby, and the epoll instance that [`Lobby::watch`] waits on.
    pub fn new() -> std::io::Result<(Arc<Self>, mio::Poll)> {
        let poll = mio::Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let lobby = Lobby {
            inner: Mutex::new(Inner {
                waiting: HashMap::new(),
                order: VecDeque::new(),
                next: 0,
            }),
            registry,
        };
        Ok((Arc::new(lobby), poll))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<W>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts a connection (non-blocking) in the lobby; on failure it is closed.
    pub fn enter(&self, sock: TcpStream, item: W) -> std::io::Result<()> {
        let mut inner = self.lock();
        let token = inner.next;
        inner.next = inner.next.wrapping_add(1);
        self.registry.register(
            &mut SourceFd(&sock.as_raw_fd()),
            Token(token),
            Interest::READABLE,
        )?;
        inner.waiting.insert(token, Waiting { sock, item });
        inner.order.push_back((Instant::now(), token));
        Ok(())
    }

    fn take(&self, inner: &mut Inner<W>, token: usize) -> Option<(TcpStream, W)> {
        let w = inner.waiting.remove(&token)?;
        let _ = self.registry.deregister(&mut SourceFd(&w.sock.as_raw_fd()));
        Some((w.sock, w.item))
    }

    /// When the connection that has waited longest arrived.
    pub fn oldest_since(&self) -> Option<Instant> {
        let mut inner = self.lock();
        while let Some(&(at, token)) = inner.order.front() {
            if inner.waiting.contains_key(&token) {
                return Some(at);
            }
            inner.order.pop_front();
        }
        None
    }

    /// Closes the connection that has waited longest, if any.
    pub fn evict_oldest(&self) -> bool {
        let mut inner = self.lock();
        while let Some((_, token)) = inner.order.pop_front() {
            if let Some((sock, item)) = self.take(&mut inner, token) {
                drop(inner);
                drop((sock, item));
                return true;
            }
        }
        false
    }

    /// Closes the connections that have waited `limit` or longer; returns how many.
    fn expire(&self, limit: Duration) -> usize {
        let mut closed = Vec::new();
        {
            let mut inner = self.lock();
            while let Some(&(at, token)) = inner.order.front() {
                if !inner.waiting.contains_key(&token) {
                    inner.order.pop_front();
                    continue;
                }
                if at.elapsed() < limit {
                    break;
                }
                inner.order.pop_front();
                closed.extend(self.take(&mut inner, token));
            }
        }
        closed.len()
    }

    /// Hands every connection that has input (or its end) to `ready`.
    fn drain(
        &self,
        poll: &mut mio::Poll,
        events: &mut Events,
        ready: &mut impl FnMut(TcpStream, W),
    ) -> bool {
        if poll.poll(events, Some(Duration::ZERO)).is_err() {
            return false;
        }
        let mut any = false;
        for ev in events.iter() {
            any = true;
            let taken = {
                let mut inner = self.lock();
                self.take(&mut inner, ev.token().0)
            };
            if let Some((sock, item)) = taken {
                ready(sock, item);
            }
        }
        any
    }

    /// The lobby's task: hands connections over as their first byte arrives, closes those past
    /// `first_byte` (counted with `on_expired`), until `stop`.
    pub async fn watch(
        self: Arc<Self>,
        poll: tokio::io::unix::AsyncFd<mio::Poll>,
        first_byte: Option<Duration>,
        mut ready: impl FnMut(TcpStream, W),
        on_expired: impl Fn(usize),
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut poll = poll;
        let mut events = Events::with_capacity(256);
        // Deadlines are checked on a tick: a connection may outstay its deadline by up to
        // a tenth of it (at most 100 ms).
        let tick = first_byte.map_or(Duration::from_secs(3600), |d| {
            (d / 10).min(Duration::from_millis(100))
        });
        let mut ticker = tokio::time::interval(tick.max(Duration::from_millis(1)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                r = poll.readable_mut() => {
                    let Ok(mut guard) = r else { break };
                    // Drain until the epoll instance has nothing more (try_io then clears the
                    // readiness without losing an event that came meanwhile); wait again.
                    while guard
                        .try_io(|fd| {
                            if self.drain(fd.get_mut(), &mut events, &mut ready) {
                                Ok(())
                            } else {
                                Err(std::io::ErrorKind::WouldBlock.into())
                            }
                        })
                        .is_ok()
                    {}
                }
                _ = ticker.tick() => {
                    if let Some(limit) = first_byte {
                        let n = self.expire(limit);
                        if n > 0 {
                            on_expired(n);
                        }
                    }
                }
                _ = stop.changed() => break,
            }
        }
        // Shutting down: whoever has not spoken yet is closed.
        let mut inner = self.lock();
        let tokens: Vec<usize> = inner.waiting.keys().copied().collect();
        for t in tokens {
            drop(self.take(&mut inner, t));
        }
    }
}
