//! Whether a program ended a relayed connection or went away holding it.
//!
//! A program that closes a connection and one killed while it holds the connection look
//! alike on the socketpair: its end closes. What differs is the program's process: a dying
//! process is marked exiting (`PF_EXITING`, in `/proc/PID/stat`) before the kernel releases
//! any of its descriptors. So one thread watches the hang-up of every relayed socketpair end
//! (one epoll set) and looks at the process that connected as the connection's receiver the
//! moment it sees one:
//! - alive, or exiting with status 0: the program closed or shut down its end, or ended
//!   with everything it held: it ended the connection (its client gets close_notify);
//! - exiting on a signal (killed, crashed) or with a failure status, or gone: the end came
//!   with its death, unless it asked first, with a CLOSE request for the connection.
//!   Requests it sent before dying are still in its receiver connection, so the answer
//!   waits for that connection's requests to be read to its end. Asked: close_notify; else
//!   the client gets a reset.
//!
//! A connection whose receiver tlsplane disconnected (a reload revoked its ids, it read no
//! replies) is reset at once. One whose receiver connection the program itself closed while
//! it lives on is the program's to end, as before.

use std::collections::{HashMap, HashSet};
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tlsplane_sys::PeerEndWatch;
use tokio::sync::watch;

/// How a relayed connection's program end stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Open, or ended while its process was exiting and its receiver's requests are not all
    /// read yet.
    Open,
    /// Closed or shut down by its program, or asked to (CLOSE).
    Orderly,
    /// Its program died holding it, or tlsplane disconnected its receiver.
    Abandoned,
}

pub struct Hangups {
    watch: PeerEndWatch,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Receivers whose requests are still being read.
    reading: HashSet<u64>,
    /// Open relays by token.
    relays: HashMap<u64, Relay>,
    /// Relay tokens by receiver and connection id, for CLOSE requests.
    by_conn: HashMap<(u64, u64), u64>,
    next: u64,
}

struct Relay {
    receiver: u64,
    conn_id: u64,
    /// The process that connected as its receiver.
    pid: u32,
    close_requested: bool,
    /// Its end came while its process was exiting: decided once its receiver's requests are
    /// all read.
    ended_exiting: bool,
    end: Arc<watch::Sender<End>>,
}

impl Table {
    /// Decides `token`'s end and forgets it.
    fn decide(&mut self, token: u64, end: End) {
        if let Some(r) = self.relays.remove(&token) {
            self.by_conn.remove(&(r.receiver, r.conn_id));
            r.end.send_replace(end);
        }
    }
}

/// A relay's end, as the watching thread decides it.
pub struct RelayEnd {
    token: u64,
    end: Arc<watch::Sender<End>>,
    hangups: Arc<Hangups>,
}

impl Hangups {
    pub fn start() -> std::io::Result<Arc<Self>> {
        let h = Arc::new(Self {
            watch: PeerEndWatch::new()?,
            table: Mutex::new(Table::default()),
        });
        let weak = Arc::downgrade(&h);
        std::thread::Builder::new()
            .name("handoff-hangups".into())
            .spawn(move || watch_loop(&weak))?;
        Ok(h)
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Receiver `id`'s requests are being read (before it is given any connection).
    pub fn receiver_reading(&self, id: u64) {
        self.table().reading.insert(id);
    }

    /// Receiver `id`'s requests are all read (its connection ended). Its connections that
    /// ended while their process was exiting are decided; with `abandon` (tlsplane
    /// disconnected it) so are those still open: they are reset.
    pub fn receiver_done(&self, id: u64, abandon: bool) {
        let mut t = self.table();
        t.reading.remove(&id);
        let mine: Vec<(u64, End)> = t
            .relays
            .iter()
            .filter(|(_, r)| r.receiver == id)
            .filter_map(
                |(&token, r)| match (r.close_requested, r.ended_exiting, abandon) {
                    (true, true, _) => Some((token, End::Orderly)),
                    (_, _, true) | (false, true, _) => Some((token, End::Abandoned)),
                    _ => None,
                },
            )
            .collect();
        for (token, end) in mine {
            t.decide(token, end);
        }
    }

    /// Watches `ours`, tlsplane's end of the relay of connection `conn_id`, about to be
    /// handed to receiver `receiver` of process `pid` (before the program has its end).
    pub fn watch_relay(
        self: &Arc<Self>,
        receiver: u64,
        pid: u32,
        conn_id: u64,
        ours: BorrowedFd<'_>,
    ) -> std::io::Result<RelayEnd> {
        let mut t = self.table();
        t.next += 1;
        let token = t.next;
        let end = Arc::new(watch::channel(End::Open).0);
        t.relays.insert(
            token,
            Relay {
                receiver,
                conn_id,
                pid,
                close_requested: false,
                ended_exiting: false,
                end: end.clone(),
            },
        );
        t.by_conn.insert((receiver, conn_id), token);
        drop(t);
        if let Err(e) = self.watch.watch(ours, token, false) {
            self.table().decide(token, End::Abandoned);
            return Err(e);
        }
        Ok(RelayEnd {
            token,
            end,
            hangups: self.clone(),
        })
    }

    /// A CLOSE request from `receiver` for relayed connection `conn_id`: its end, when it
    /// comes, is an orderly one. False: not a relayed connection of this receiver's.
    pub fn close_requested(&self, receiver: u64, conn_id: u64) -> bool {
        let mut t = self.table();
        let Some(&token) = t.by_conn.get(&(receiver, conn_id)) else {
            return false;
        };
        let ended = match t.relays.get_mut(&token) {
            Some(r) => {
                r.close_requested = true;
                r.ended_exiting
            }
            None => return false,
        };
        if ended {
            t.decide(token, End::Orderly);
        }
        true
    }

    /// Hang-ups of relays' program ends.
    fn on_events(&self, tokens: &[u64]) {
        for &token in tokens {
            let Some((pid, receiver)) =
                self.table().relays.get(&token).map(|r| (r.pid, r.receiver))
            else {
                continue;
            };
            // Outside the table's lock: a read of /proc.
            let dying = process(pid) == Process::Died;
            let mut t = self.table();
            let reading = t.reading.contains(&receiver);
            let Some(r) = t.relays.get_mut(&token) else {
                continue;
            };
            match (r.close_requested, dying, reading) {
                (true, _, _) | (false, false, _) => t.decide(token, End::Orderly),
                (false, true, true) => r.ended_exiting = true,
                (false, true, false) => t.decide(token, End::Abandoned),
            }
        }
    }
}

impl RelayEnd {
    /// Whether the program ended the connection in order: waits for the watching thread to
    /// have decided (the caller read the end already), at most `limit` (then: not in order).
    pub async fn orderly(&self, limit: Duration) -> bool {
        let mut rx = self.end.subscribe();
        let seen = tokio::time::timeout(limit, async {
            rx.wait_for(|e| *e != End::Open).await.map(|e| *e)
        })
        .await;
        matches!(seen, Ok(Ok(End::Orderly)))
    }

    pub fn is_abandoned(&self) -> bool {
        *self.end.borrow() == End::Abandoned
    }

    /// Resolves once the connection is known to be abandoned.
    pub async fn abandoned(&self) {
        let mut rx = self.end.subscribe();
        let _ = rx.wait_for(|e| *e == End::Abandoned).await;
    }
}

impl Drop for RelayEnd {
    /// (Its descriptor leaves the epoll set when it closes, after this.)
    fn drop(&mut self) {
        let mut t = self.hangups.table();
        if let Some(r) = t.relays.remove(&self.token) {
            t.by_conn.remove(&(r.receiver, r.conn_id));
        }
    }
}

/// Where a receiver's process stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Process {
    Alive,
    /// Exiting (or exited, not yet reaped) with status 0: it ended on its own terms.
    ExitedOk,
    /// Exiting on a signal or with a failure status, or gone (its status unknown).
    Died,
}

/// How process `pid` stands, from `/proc/PID/stat`: `PF_EXITING` in its flags (set before
/// the kernel releases any of its descriptors), and the exit status the kernel records as
/// it starts to exit (a signal number, or the status shifted by 8). Pid 0 (a receiver in a
/// pid namespace tlsplane cannot see into) is taken as alive.
pub fn process(pid: u32) -> Process {
    const PF_EXITING: u64 = 0x4;
    if pid == 0 {
        return Process::Alive;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Process::Died;
    };
    // After the command's closing parenthesis: state (field 3) ... flags (9) ... exit_code
    // (52).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_ascii_whitespace()
        .collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    let exiting = matches!(fields.first(), Some(&("Z" | "X" | "x")))
        || field(9).is_some_and(|f| f & PF_EXITING != 0);
    match (exiting, field(52)) {
        (false, _) => Process::Alive,
        (true, Some(0)) => Process::ExitedOk,
        (true, _) => Process::Died,
    }
}

fn watch_loop(hangups: &Weak<Hangups>) {
    let mut ready = Vec::new();
    loop {
        let Some(h) = hangups.upgrade() else {
            return;
        };
        ready.clear();
        // Wakes now and then to notice the product is gone.
        if let Err(e) = h.watch.wait(&mut ready, 1000) {
            tracing::warn!(error = %e, "hand-off: epoll_wait failed");
            std::thread::sleep(Duration::from_millis(100));
        }
        h.on_events(&ready);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_alive_exited_well_or_died() {
        assert_eq!(process(std::process::id()), Process::Alive);
        // Not reaped yet: its status is there to read.
        let mut ok = std::process::Command::new("true").spawn().unwrap();
        let mut failed = std::process::Command::new("false").spawn().unwrap();
        let mut killed = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        killed.kill().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(process(ok.id()), Process::ExitedOk);
        assert_eq!(process(failed.id()), Process::Died);
        assert_eq!(process(killed.id()), Process::Died);
        let pid = ok.id();
        ok.wait().unwrap();
        assert_eq!(process(pid), Process::Died, "reaped: its status is unknown");
        let _ = (failed.wait(), killed.wait());
    }

    fn relay(h: &Arc<Hangups>, receiver: u64, pid: u32, conn: u64) -> (RelayEnd, OwnedPair) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let end = h
            .watch_relay(receiver, pid, conn, std::os::fd::AsFd::as_fd(&ours))
            .unwrap();
        (end, (ours, theirs))
    }

    type OwnedPair = (
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
    );

    fn decided(end: &RelayEnd) -> End {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let e = *end.end.borrow();
            if e != End::Open || std::time::Instant::now() > deadline {
                return e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn ends_are_orderly_from_the_living_abandoned_from_the_dead_unless_asked() {
        let h = Hangups::start().unwrap();
        h.receiver_reading(1);
        // A live program closes its end.
        let (alive, (_o, theirs)) = relay(&h, 1, std::process::id(), 10);
        drop(theirs);
        assert_eq!(decided(&alive), End::Orderly);
        // A dead one's end waits for its requests to be read: none asked, abandoned.
        let mut child = std::process::Command::new("false").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let (cut, (_o2, theirs)) = relay(&h, 1, dead, 11);
        let (asked, (_o3, theirs3)) = relay(&h, 1, dead, 12);
        drop((theirs, theirs3));
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            *cut.end.borrow(),
            End::Open,
            "decided before the requests were read"
        );
        assert!(h.close_requested(1, 12));
        assert!(!h.close_requested(2, 11), "another receiver's connection");
        h.receiver_done(1, false);
        assert_eq!(decided(&cut), End::Abandoned);
        assert_eq!(decided(&asked), End::Orderly);
        // A receiver tlsplane disconnected: its open connections are abandoned at once.
        h.receiver_reading(2);
        let (held, _pair) = relay(&h, 2, std::process::id(), 20);
        h.receiver_done(2, true);
        assert_eq!(decided(&held), End::Abandoned);
    }
}
