//! Kernel-plane hand-offs: what tlsplane keeps of a connection whose kTLS socket a program
//! now owns (docs/HANDOFF.md, plane 1).
//!
//! The program reads and writes the socket; tlsplane copies nothing. It keeps a duplicate of
//! the descriptor and the connection's traffic secrets, to serve the program's KEY_UPDATE
//! (install the next keys on the shared socket) and CLOSE (send close_notify), and to reset
//! the connection when its program went without a CLOSE for it (its client must not take
//! what it got for a whole response). A record tlsplane sends on the socket (close_notify,
//! its own KeyUpdate, an alert) that finds no room waits here, watched for room, never on
//! the thread that reads requests: a KEY_UPDATE's REPLY then goes once the new keys are in.
//! A duplicate is let go when the program asks (CLOSE, after a lingering close), when its
//! receiver goes (reset, or left to the program: see [`Keeper::receiver_gone`]), or 30 s
//! after the client's end of the connection was seen (its FIN or a reset: nothing more can
//! come that would need a key, and a program that closed its descriptor without a CLOSE
//! must not leave the connection open through ours). So tlsplane holds at most one
//! descriptor per client connection still open (or ended less than 30 s ago), whatever the
//! program does, and at most --handoff-max-kept of them (past it, connections are relayed).
//!
//! One thread watches every kept socket with an epoll set that asks for the peer's end only
//! (`EPOLLRDHUP`), so that the program's traffic never wakes it; sockets in a lingering close
//! are watched for input too, which is read and dropped (a bounded amount per wake-up, never
//! under the table's lock) until the client closes or the linger time ends.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tlsplane::{HandedKeyError, HandedKeys, ReKeyed};
use tlsplane_handoff::Status;
use tlsplane_sys::PeerEndWatch;

/// How long a connection closed at a program's request (or for a receiver that went) is
/// read and drained before its last descriptor closes, at most: as nginx's
/// `lingering_timeout`, so that input the client still sends does not turn the close into a
/// reset that destroys the response in flight.
const LINGER: Duration = Duration::from_secs(5);

/// How long a kept socket whose client has ended (FIN or reset) waits for the program's
/// CLOSE before tlsplane lets its duplicate go: a client that half-closes after its request
/// still gets its response and close_notify from a program that answers within it, while a
/// program that closed its descriptor without a CLOSE leaves the connection open through
/// tlsplane's duplicate no longer than this after the client went.
const PEER_END_GRACE: Duration = Duration::from_secs(30);

/// How long a record tlsplane sends (a close_notify the program asked for, tlsplane's own
/// KeyUpdate, an alert) may wait for room in the socket (a client that reads slowly, a
/// response still in flight), at most: then the connection is reset. The kernel drops a
/// client that takes nothing for --send-timeout before this, unless it is off.
const CONTROL_RECORD_WAIT: Duration = Duration::from_secs(120);

/// Kernel-plane counters (kept with the product's across reloads).
#[derive(Default)]
pub struct KeptStats {
    /// Duplicates held now.
    pub kept: AtomicU64,
    pub key_updates: AtomicU64,
    /// KEY_UPDATE requests not served (not a KeyUpdate, rate limit, unsupported kernel,
    /// a failed system call).
    pub key_update_failures: AtomicU64,
    /// CLOSE requests served.
    pub closes: AtomicU64,
    /// Connections reset because their close_notify found no room for CONTROL_RECORD_WAIT.
    pub close_notify_timeouts: AtomicU64,
    /// KEY_UPDATE requests whose KeyUpdate (or alert) tlsplane sends waited for room in the
    /// socket: their REPLY went once it was sent.
    pub key_update_waits: AtomicU64,
    /// Connections reset because tlsplane's KeyUpdate or alert found no room for
    /// CONTROL_RECORD_WAIT (the KEY_UPDATE is answered 4, failed).
    pub key_update_timeouts: AtomicU64,
    /// Duplicates let go at the client's end of the connection.
    pub released_peer_end: AtomicU64,
    /// Connections reset (no close_notify) because their receiver went without a CLOSE for
    /// them: it announced ENDS_WITH_CLOSE, its program exited or died, or tlsplane dropped
    /// it.
    pub released_receiver_gone: AtomicU64,
    /// Duplicates let go because their receiver's connection ended while its program (one
    /// that promised no CLOSE) lives on: the connection is the program's.
    pub released_receiver_left: AtomicU64,
}

/// Where a KEY_UPDATE's answer goes when it comes after the request was read: the REPLY.
pub type Answer = Box<dyn FnOnce(Status) + Send>;

/// A handed connection tlsplane still keeps.
struct Kept {
    receiver: u64,
    socket: TcpStream,
    keys: Mutex<HandedKeys>,
}

enum Entry {
    Kept {
        kept: Arc<Kept>,
        /// When the client's end (FIN or reset) was seen.
        peer_ended: Option<Instant>,
        /// A record of ours waits for room (the socket is watched for it).
        sending: Option<Sending>,
    },
    /// Asked to close: close_notify waits for room in the socket (watched for it).
    Closing { kept: Arc<Kept>, until: Instant },
    /// close_notify sent and our side shut down: input is drained until the client closes.
    Lingering {
        socket: Arc<TcpStream>,
        until: Instant,
    },
}

/// A KeyUpdate or alert of tlsplane's that waits for room in a kept socket.
struct Sending {
    until: Instant,
    /// The KEY_UPDATE's answer, given once the new keys are in (none for an alert: its
    /// request was answered at once).
    answer: Option<Answer>,
}

impl Sending {
    fn answer(self, status: Status) {
        if let Some(a) = self.answer {
            a(status);
        }
    }
}

/// How a kept connection ends for tlsplane.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// The program asked (CLOSE): close_notify after all it wrote, then a lingering close.
    CloseNotify,
    /// Nothing more can need a key: our duplicate goes, the connection is the program's.
    Release,
    /// Its owner went without asking: a reset, so that the client sees a cut, not an end.
    Reset,
}

/// Reads a lingering socket may take per wake-up: a client that keeps sending cannot hold
/// the keeper's thread (the rest is read at the next turn, within the linger time).
const DRAIN_READS: usize = 16;

/// Every kernel-plane hand-off of the process (kept across reloads, like the sockets).
pub struct Keeper {
    watch: PeerEndWatch,
    /// By connection id (the epoll token).
    entries: Mutex<HashMap<u64, Entry>>,
    stats: Weak<KeptStats>,
}

impl Keeper {
    /// Starts the watching thread. Fails where epoll or a thread cannot be had; the product
    /// then relays kernel-plane connections instead.
    pub fn start(stats: &Arc<KeptStats>) -> std::io::Result<Arc<Self>> {
        let keeper = Arc::new(Self {
            watch: PeerEndWatch::new()?,
            entries: Mutex::new(HashMap::new()),
            stats: Arc::downgrade(stats),
        });
        let weak = Arc::downgrade(&keeper);
        std::thread::Builder::new()
            .name("handoff-keeper".into())
            .spawn(move || watch_loop(&weak))?;
        Ok(keeper)
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, f: impl FnOnce(&KeptStats)) {
        if let Some(s) = self.stats.upgrade() {
            f(&s);
        }
    }

    /// Keeps connection `id`, about to be handed to `receiver`: the socket (the descriptor
    /// the frame carries) and its keys. Returns the socket to send.
    pub fn keep(
        &self,
        id: u64,
        receiver: u64,
        socket: TcpStream,
        keys: HandedKeys,
    ) -> std::io::Result<Arc<KeptSocket>> {
        let kept = Arc::new(Kept {
            receiver,
            socket,
            keys: Mutex::new(keys),
        });
        // In the table before the program can ask about it, and watched after: an end
        // already seen is reported at once.
        self.entries().insert(
            id,
            Entry::Kept {
                kept: kept.clone(),
                peer_ended: None,
                sending: None,
            },
        );
        if let Err(e) = self.watch.watch(kept.socket.as_fd(), id, false) {
            self.entries().remove(&id);
            return Err(e);
        }
        self.count(|s| {
            s.kept.fetch_add(1, Relaxed);
        });
        Ok(Arc::new(KeptSocket(kept)))
    }

    /// The program's KEY_UPDATE for connection `id`, after it read `message` from it: its
    /// status now, or `None` when tlsplane's own KeyUpdate waits for room in the socket, in
    /// which case `answer` gets it once the keys are in (never waiting here).
    pub fn key_update(
        &self,
        receiver: u64,
        id: u64,
        message: &[u8],
        answer: Answer,
    ) -> Option<Status> {
        let kept = match self.kept(receiver, id) {
            Ok(k) => k,
            Err(s) => return Some(s),
        };
        let mut keys = kept.keys.lock().unwrap_or_else(|e| e.into_inner());
        let r = keys.key_update(kept.socket.as_fd(), message);
        let waiting = keys.is_waiting();
        drop(keys);
        let status = match r {
            Ok(ReKeyed::Done) => {
                self.count(|s| {
                    s.key_updates.fetch_add(1, Relaxed);
                });
                Some(Status::Ok)
            }
            Ok(ReKeyed::WaitingForRoom) => None,
            Err(e) => {
                self.count(|s| {
                    s.key_update_failures.fetch_add(1, Relaxed);
                });
                tracing::debug!(conn = id, error = %e, "hand-off: KeyUpdate not served");
                Some(match e {
                    HandedKeyError::NotKeyUpdate => Status::BadRequest,
                    HandedKeyError::Unsupported => Status::Unsupported,
                    _ => Status::Failed,
                })
            }
        };
        if waiting {
            self.count(|s| {
                s.key_update_waits.fetch_add(1, Relaxed);
            });
            self.wait_for_room(id, &kept, status.is_none().then_some(answer));
        }
        status
    }

    /// Watches kept connection `id` for room for the record its keys hold.
    fn wait_for_room(&self, id: u64, kept: &Arc<Kept>, answer: Option<Answer>) {
        let sending = Sending {
            until: Instant::now() + CONTROL_RECORD_WAIT,
            answer,
        };
        let mut entries = self.entries();
        let watched = match entries.get_mut(&id) {
            Some(Entry::Kept {
                kept: k,
                sending: s @ None,
                ..
            }) if Arc::ptr_eq(k, kept) => {
                let _ = self.watch.forget(kept.socket.as_fd());
                if self.watch.watch_output(kept.socket.as_fd(), id).is_ok() {
                    *s = Some(sending);
                    return;
                }
                // Not watched at all now: the connection cannot be kept working.
                let _ = self.watch.watch(kept.socket.as_fd(), id, false);
                false
            }
            // Ended meanwhile (a CLOSE, its receiver gone).
            _ => true,
        };
        drop(entries);
        if !watched {
            reset(kept);
        }
        sending.answer(Status::Failed);
    }

    /// The program's CLOSE for connection `id`: close_notify after all it wrote, then a
    /// lingering close of our duplicate.
    pub fn close(&self, receiver: u64, id: u64) -> Status {
        if let Err(s) = self.kept(receiver, id) {
            return s;
        }
        if self.end(id, Ending::CloseNotify) {
            self.count(|s| {
                s.closes.fetch_add(1, Relaxed);
            });
        }
        Status::Ok
    }

    /// Receiver `receiver` went, its requests all read. With `abandoned` (it promised a
    /// CLOSE for each connection, its program went holding them, or tlsplane dropped it),
    /// each of its connections that it did not CLOSE is reset, so that the client can tell
    /// the cut from an end; else the program lives on and owns them: our duplicates just go.
    pub fn receiver_gone(&self, receiver: u64, abandoned: bool) {
        let ids: Vec<u64> = self
            .entries()
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Kept { kept, .. } if kept.receiver == receiver => Some(*id),
                _ => None,
            })
            .collect();
        let ending = if abandoned {
            Ending::Reset
        } else {
            Ending::Release
        };
        for id in ids {
            if self.end(id, ending) {
                self.count(|s| {
                    match ending {
                        Ending::Reset => &s.released_receiver_gone,
                        _ => &s.released_receiver_left,
                    }
                    .fetch_add(1, Relaxed);
                });
            }
        }
    }

    /// Connection `id` not handed after all (its frame was never queued): close_notify, as
    /// any refused connection gets.
    pub fn not_handed(&self, id: u64) {
        self.end(id, Ending::CloseNotify);
    }

    fn kept(&self, receiver: u64, id: u64) -> Result<Arc<Kept>, Status> {
        match self.entries().get(&id) {
            Some(Entry::Kept { kept, .. }) if kept.receiver == receiver => Ok(kept.clone()),
            Some(Entry::Kept { .. }) => Err(Status::Refused),
            _ => Err(Status::UnknownConnection),
        }
    }

    /// Stops keeping connection `id` as `ending` says. False if it was not kept. Never waits:
    /// a close_notify without room now is sent by the watching thread once there is.
    fn end(&self, id: u64, ending: Ending) -> bool {
        let (kept, sending) = {
            let mut entries = self.entries();
            if !matches!(entries.get(&id), Some(Entry::Kept { .. })) {
                return false;
            }
            let Some(Entry::Kept { kept, sending, .. }) = entries.remove(&id) else {
                return false;
            };
            (kept, sending)
        };
        let _ = self.watch.forget(kept.socket.as_fd());
        self.count(|s| {
            s.kept.fetch_sub(1, Relaxed);
        });
        if let Some(s) = sending {
            s.answer(Status::Failed);
        }
        match ending {
            Ending::Reset => reset(&kept),
            Ending::Release => {}
            Ending::CloseNotify => {
                self.send_close_notify(id, kept, Instant::now() + CONTROL_RECORD_WAIT)
            }
        }
        true
    }

    /// close_notify on `kept` if there is room now, then our side's shutdown and a lingering
    /// close; otherwise it waits for room, until `until`. A failure resets the connection.
    fn send_close_notify(&self, id: u64, kept: Arc<Kept>, until: Instant) {
        let sent = kept
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .try_close_notify(kept.socket.as_fd());
        match sent {
            Ok(true) => self.linger(id, &kept),
            Ok(false) => {
                let mut entries = self.entries();
                if self.watch.watch_output(kept.socket.as_fd(), id).is_ok() {
                    entries.insert(id, Entry::Closing { kept, until });
                } else {
                    reset(&kept);
                }
            }
            Err(_) => reset(&kept),
        }
    }

    /// After close_notify: shuts our side and drains input until the client closes (the
    /// program's last CONNECTION frame write may still hold `kept`: a duplicate then).
    fn linger(&self, id: u64, kept: &Kept) {
        let Ok(socket) = kept.socket.try_clone() else {
            return;
        };
        if socket.shutdown(Shutdown::Write).is_err() {
            return;
        }
        let mut entries = self.entries();
        if self.watch.watch(socket.as_fd(), id, true).is_ok() {
            entries.insert(
                id,
                Entry::Lingering {
                    socket: Arc::new(socket),
                    until: Instant::now() + LINGER,
                },
            );
        }
    }

    /// An event on `id`: a kept socket's client ended (noted: let go after
    /// [`PEER_END_GRACE`]), or a lingering one has input or its end (drained, outside the
    /// table's lock; closed at the end). True: input is left to drain at the next turn.
    fn on_event(&self, id: u64) -> bool {
        let socket = {
            let mut entries = self.entries();
            match entries.get_mut(&id) {
                Some(Entry::Kept {
                    kept,
                    sending: Some(_),
                    ..
                }) => {
                    let kept = kept.clone();
                    drop(entries);
                    self.send_waiting(id, &kept);
                    return false;
                }
                Some(Entry::Kept { peer_ended, .. }) => {
                    peer_ended.get_or_insert_with(Instant::now);
                    return false;
                }
                Some(Entry::Lingering { socket, .. }) => socket.clone(),
                Some(Entry::Closing { .. }) => {
                    // Room for the close_notify (or an error, which the send will report).
                    let Some(Entry::Closing { kept, until }) = entries.remove(&id) else {
                        return false;
                    };
                    drop(entries);
                    let _ = self.watch.forget(kept.socket.as_fd());
                    self.send_close_notify(id, kept, until);
                    return false;
                }
                None => return false,
            }
        };
        match drain(&socket, DRAIN_READS) {
            Drained::Ended => {
                self.forget_lingering(id);
                false
            }
            Drained::Empty => false,
            Drained::More => true,
        }
    }

    /// Room (or an end, or an error) on kept socket `id` whose record waits: sends it, and
    /// once nothing waits, answers and watches the socket for its client's end again (an
    /// end already seen is reported at once).
    fn send_waiting(&self, id: u64, kept: &Arc<Kept>) {
        let r = kept
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send_waiting(kept.socket.as_fd());
        let status = match r {
            Ok(false) => return,
            Ok(true) => Status::Ok,
            Err(e) => {
                tracing::debug!(conn = id, error = %e, "hand-off: a waiting record failed");
                Status::Failed
            }
        };
        let Some(sending) = self.stop_sending(id, kept) else {
            return;
        };
        // (An alert's request was answered, and counted, when it was read.)
        if sending.answer.is_some() {
            self.count(|s| {
                match status {
                    Status::Ok => &s.key_updates,
                    _ => &s.key_update_failures,
                }
                .fetch_add(1, Relaxed);
            });
        }
        sending.answer(status);
    }

    /// Kept socket `id` (still `kept`) no longer waits for room: watched for its client's
    /// end again. `None`: it was not waiting (ended meanwhile).
    fn stop_sending(&self, id: u64, kept: &Arc<Kept>) -> Option<Sending> {
        let mut entries = self.entries();
        let Some(Entry::Kept {
            kept: k, sending, ..
        }) = entries.get_mut(&id)
        else {
            return None;
        };
        if !Arc::ptr_eq(k, kept) {
            return None;
        }
        let taken = sending.take()?;
        let _ = self.watch.forget(kept.socket.as_fd());
        if self.watch.watch(kept.socket.as_fd(), id, false).is_err() {
            reset(kept);
        }
        Some(taken)
    }

    /// Kept sockets whose client ended more than [`PEER_END_GRACE`] ago, without a CLOSE.
    fn abandoned(&self, now: Instant) -> Vec<u64> {
        self.entries()
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Kept {
                    peer_ended: Some(at),
                    ..
                } if now.duration_since(*at) >= PEER_END_GRACE => Some(*id),
                _ => None,
            })
            .collect()
    }

    /// Kept sockets whose record found no room for [`CONTROL_RECORD_WAIT`]: reset, the
    /// KEY_UPDATE answered 4 (failed).
    fn sending_expired(&self, now: Instant) {
        let late: Vec<(u64, Arc<Kept>)> = self
            .entries()
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Kept {
                    kept,
                    sending: Some(s),
                    ..
                } if s.until <= now => Some((*id, kept.clone())),
                _ => None,
            })
            .collect();
        for (id, kept) in late {
            if let Some(sending) = self.stop_sending(id, &kept) {
                reset(&kept);
                self.count(|s| {
                    s.key_update_timeouts.fetch_add(1, Relaxed);
                });
                sending.answer(Status::Failed);
            }
        }
    }

    fn forget_lingering(&self, id: u64) {
        let mut entries = self.entries();
        match entries.remove(&id) {
            Some(Entry::Lingering { socket, .. }) => {
                let _ = self.watch.forget(socket.as_fd());
            }
            Some(Entry::Closing { kept, .. }) => {
                let _ = self.watch.forget(kept.socket.as_fd());
                drop(entries);
                self.count(|s| {
                    s.close_notify_timeouts.fetch_add(1, Relaxed);
                });
                reset(&kept);
            }
            Some(other) => {
                entries.insert(id, other);
            }
            None => {}
        }
    }

    /// Lingering sockets, and close_notify waits, whose time is up.
    fn expired(&self, now: Instant) -> Vec<u64> {
        self.entries()
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Lingering { until, .. } | Entry::Closing { until, .. } if *until <= now => {
                    Some(*id)
                }
                _ => None,
            })
            .collect()
    }
}

/// Ends `kept` with a reset: set on the socket, not our descriptor, so that whichever copy
/// closes last sends it (ours now if the program died; the program's when it closes, if it
/// lives on).
fn reset(kept: &Kept) {
    let _ = socket2::SockRef::from(&kept.socket).set_linger(Some(Duration::ZERO));
}

/// A kept socket, as the frame that hands it over borrows it.
pub struct KeptSocket(Arc<Kept>);

impl AsFd for KeptSocket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.socket.as_fd()
    }
}

/// What a drain of a lingering socket found.
enum Drained {
    /// The client's FIN, an error, or a record the kernel will not decrypt past (a
    /// KeyUpdate): nothing more to wait for.
    Ended,
    /// All read; more will wake the watch.
    Empty,
    /// `reads` records read and more may be there (the watch is edge-triggered: no new wake).
    More,
}

/// Reads and drops up to `reads` records of what a lingering socket holds (non-blocking).
fn drain(socket: &TcpStream, reads: usize) -> Drained {
    let mut buf = [0u8; 16384];
    for _ in 0..reads {
        match tlsplane_sys::recv_record(socket.as_fd(), &mut buf) {
            Ok((0, _)) => return Drained::Ended,
            Ok((_, 23)) => {}
            // An alert (the client's close_notify) or a handshake record.
            Ok(_) => return Drained::Ended,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Drained::Empty,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Drained::Ended,
        }
    }
    Drained::More
}

fn watch_loop(keeper: &Weak<Keeper>) {
    let mut ready = Vec::new();
    let mut again = Vec::new();
    loop {
        let Some(k) = keeper.upgrade() else {
            return;
        };
        ready.clear();
        // Wakes at least twice a second for linger deadlines; at once if input is left.
        let wait = if again.is_empty() { 500 } else { 0 };
        if let Err(e) = k.watch.wait(&mut ready, wait) {
            tracing::warn!(error = %e, "hand-off: epoll_wait failed");
            std::thread::sleep(Duration::from_millis(100));
        }
        ready.append(&mut again);
        ready.sort_unstable();
        ready.dedup();
        for &id in &ready {
            if k.on_event(id) {
                again.push(id);
            }
        }
        let now = Instant::now();
        for id in k.expired(now) {
            k.forget_lingering(id);
        }
        k.sending_expired(now);
        for id in k.abandoned(now) {
            if k.end(id, Ending::Release) {
                k.count(|s| {
                    s.released_peer_end.fetch_add(1, Relaxed);
                });
            }
        }
    }
}
