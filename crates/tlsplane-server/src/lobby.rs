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

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Token};

struct Waiting<W> {
    sock: TcpStream,
    item: W,
    /// Tells this entry from earlier ones in the same slot (see `Token`).
    generation: u32,
}

/// Slots rather than a map: 10,000 silent connections are the case this exists for, and a
/// hash map at that size carries twice the room it uses.
struct Inner<W> {
    slots: Vec<Option<Waiting<W>>>,
    free: Vec<u32>,
    /// Arrival order (entries may have left already; the generation tells): for deadlines and
    /// eviction.
    order: VecDeque<(Instant, u64)>,
    generation: u32,
}

/// A waiting connection's name, for mio and `order`: slot and generation.
fn token(slot: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(slot)
}

impl<W> Inner<W> {
    fn contains(&self, t: u64) -> bool {
        waits(&self.slots, t)
    }
}

/// Whether the connection named `t` is still in `slots`.
fn waits<W>(slots: &[Option<Waiting<W>>], t: u64) -> bool {
    matches!(slots.get(t as u32 as usize), Some(Some(w)) if w.generation == (t >> 32) as u32)
}

/// The connections of one handshake loop that wait for their first byte. `W` is what each
/// carries along (its admission guards).
pub struct Lobby<W> {
    inner: Mutex<Inner<W>>,
    registry: mio::Registry,
    /// Wakes the watcher's deadline ticks when the lobby stops being empty.
    entered: tokio::sync::Notify,
}

impl<W> Lobby<W> {
    /// The lobby, and the epoll instance that [`Lobby::watch`] waits on.
    pub fn new() -> std::io::Result<(Arc<Self>, mio::Poll)> {
        let poll = mio::Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let lobby = Lobby {
            inner: Mutex::new(Inner {
                slots: Vec::new(),
                free: Vec::new(),
                order: VecDeque::new(),
                generation: 0,
            }),
            registry,
            entered: tokio::sync::Notify::new(),
        };
        Ok((Arc::new(lobby), poll))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<W>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts a connection (non-blocking) in the lobby; on failure it is closed.
    pub fn enter(&self, sock: TcpStream, item: W) -> std::io::Result<()> {
        let mut inner = self.lock();
        inner.generation = inner.generation.wrapping_add(1);
        let generation = inner.generation;
        let slot = match inner.free.pop() {
            Some(s) => s,
            None => {
                inner.slots.push(None);
                (inner.slots.len() - 1) as u32
            }
        };
        let t = token(slot, generation);
        if let Err(e) = self.registry.register(
            &mut SourceFd(&sock.as_raw_fd()),
            Token(t as usize),
            Interest::READABLE,
        ) {
            inner.free.push(slot);
            return Err(e);
        }
        inner.slots[slot as usize] = Some(Waiting {
            sock,
            item,
            generation,
        });
        inner.order.push_back((Instant::now(), t));
        if inner.order.len() == 1 {
            self.entered.notify_one();
        }
        // Entries of connections that left stay in `order` until they reach its front; behind
        // one that stays (a long deadline), they would pile up. Dropped once they outnumber
        // those still waiting: amortised O(1) per connection, `order` at most twice the lobby.
        let waiting = inner.slots.len() - inner.free.len();
        if inner.order.len() > 2 * waiting + 64 {
            let Inner { order, slots, .. } = &mut *inner;
            order.retain(|&(_, t)| waits(slots, t));
        }
        Ok(())
    }

    fn take(&self, inner: &mut Inner<W>, t: u64) -> Option<(TcpStream, W)> {
        if !inner.contains(t) {
            return None;
        }
        let slot = t as u32;
        let w = inner.slots[slot as usize].take()?;
        inner.free.push(slot);
        let _ = self.registry.deregister(&mut SourceFd(&w.sock.as_raw_fd()));
        Some((w.sock, w.item))
    }

    /// When the connection that has waited longest arrived.
    pub fn oldest_since(&self) -> Option<Instant> {
        let mut inner = self.lock();
        while let Some(&(at, t)) = inner.order.front() {
            if inner.contains(t) {
                return Some(at);
            }
            inner.order.pop_front();
        }
        None
    }

    /// Closes the connection that has waited longest, if any.
    pub fn evict_oldest(&self) -> bool {
        let mut inner = self.lock();
        while let Some((_, t)) = inner.order.pop_front() {
            if let Some((sock, item)) = self.take(&mut inner, t) {
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
            while let Some(&(at, t)) = inner.order.front() {
                if !inner.contains(t) {
                    inner.order.pop_front();
                    continue;
                }
                if at.elapsed() < limit {
                    break;
                }
                inner.order.pop_front();
                closed.extend(self.take(&mut inner, t));
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
                self.take(&mut inner, ev.token().0 as u64)
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
        first_byte: Duration,
        mut ready: impl FnMut(TcpStream, W),
        on_expired: impl Fn(usize),
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut poll = poll;
        let mut events = Events::with_capacity(256);
        // Deadlines are checked on a tick: a connection may outstay its deadline by up to
        // a tenth of it (at most 100 ms).
        let tick = (first_byte / 10).min(Duration::from_millis(100));
        let mut ticker = tokio::time::interval(tick.max(Duration::from_millis(1)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Ticks only while someone waits: an idle server's loop sleeps (each tick costs
            // it a wakeup, and tokio a write to its own eventfd to re-arm the timer).
            let empty = self.lock().order.is_empty();
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
                _ = ticker.tick(), if !empty => {
                    let n = self.expire(first_byte);
                    if n > 0 {
                        on_expired(n);
                    }
                }
                _ = self.entered.notified(), if empty => {}
                _ = stop.changed() => break,
            }
        }
        // Shutting down: whoever has not spoken yet is closed.
        let mut inner = self.lock();
        let left: Vec<u64> = inner.order.iter().map(|&(_, t)| t).collect();
        for t in left {
            drop(self.take(&mut inner, t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    /// A connected pair: (server side, client side).
    fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        (s, c)
    }

    fn closed(c: &mut TcpStream) -> bool {
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        matches!(c.read(&mut [0u8; 1]), Ok(0))
    }

    #[test]
    fn evicts_oldest_first_and_a_reused_slot_is_not_mistaken_for_its_old_entry() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (lobby, _poll) = Lobby::<u32>::new().unwrap();
        let (s1, mut c1) = pair(&l);
        let (s2, mut c2) = pair(&l);
        lobby.enter(s1, 1).unwrap();
        lobby.enter(s2, 2).unwrap();
        assert!(lobby.evict_oldest());
        assert!(closed(&mut c1), "the oldest goes first");
        // Slot 0 is free again; a third connection takes it. The second is still the oldest.
        let (s3, mut c3) = pair(&l);
        lobby.enter(s3, 3).unwrap();
        assert!(lobby.evict_oldest());
        assert!(closed(&mut c2));
        assert!(lobby.evict_oldest());
        assert!(closed(&mut c3));
        assert!(!lobby.evict_oldest(), "empty");
    }

    #[test]
    fn arrival_order_stays_bounded_behind_a_connection_that_stays() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (lobby, _poll) = Lobby::<u32>::new().unwrap();
        let (stays, _c) = pair(&l);
        lobby.enter(stays, 0).unwrap();
        for i in 1..=1000 {
            let (s, _c) = pair(&l);
            lobby.enter(s, i).unwrap();
            // Its first byte came: it leaves, as `drain` takes it.
            let mut inner = lobby.lock();
            let t = inner.order.back().unwrap().1;
            assert!(lobby.take(&mut inner, t).is_some());
        }
        let order = lobby.lock().order.len();
        assert!(
            order <= 2 + 64 + 1,
            "{order} entries for 1 waiting connection"
        );
        assert!(lobby.evict_oldest(), "the one that stayed is still there");
        assert!(!lobby.evict_oldest());
    }

    #[test]
    fn expires_only_those_past_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (lobby, _poll) = Lobby::<u32>::new().unwrap();
        let (s1, mut c1) = pair(&l);
        lobby.enter(s1, 1).unwrap();
        std::thread::sleep(Duration::from_millis(60));
        let (s2, _c2) = pair(&l);
        lobby.enter(s2, 2).unwrap();
        assert_eq!(lobby.expire(Duration::from_millis(50)), 1);
        assert!(closed(&mut c1));
        assert!(lobby.oldest_since().is_some(), "the younger one stays");
    }
}
