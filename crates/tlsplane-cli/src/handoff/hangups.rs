//! Whether a program ended a relayed connection or abandoned it.
//!
//! A program that closes a connection and one that lets go of it (killed, crashed, exited,
//! or a raw `close(2)` that bypassed its library) look alike on the socketpair: its end
//! closes. So one thread watches the hang-up of every relayed socketpair end (one epoll set)
//! and, when it sees one, first serves the requests already queued on the receiver's
//! connection (a receiver sends its CLOSE before it lets go of the descriptor, and a Unix
//! stream send is queued at the peer at once: if a CLOSE was sent, it is there now; nothing
//! is waited for), then judges:
//! - a CLOSE for the connection: the end is orderly (its client gets close_notify);
//! - else, if the receiver announced `ENDS_WITH_CLOSE` (HELLO): abandoned (a reset);
//! - else (a receiver that promised nothing: a program speaking the protocol by hand, an old
//!   library) by the process that connected as the receiver, through a pidfd taken at
//!   connect time: alive (or unknown: /proc hidden), the program ended it; exiting
//!   (`PF_EXITING`, set before the kernel releases any of its descriptors) or gone, it died
//!   holding it. That fallback cannot see a connection held by another process than the
//!   one that connected (a daemon's child, a worker): docs/HANDOFF.md.
//!
//! A connection whose receiver tlsplane disconnected (a reload revoked its ids, it read no
//! replies, it broke the protocol) is reset at once. One whose receiver connection ended
//! otherwise is judged as above when its own end comes.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tlsplane_sys::PeerEndWatch;
use tokio::sync::watch;

/// How a relayed connection's program end stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Open, or not judged yet.
    Open,
    /// Ended after a CLOSE for it, or by a program judged alive.
    Orderly,
    /// Ended without a CLOSE by a receiver that promised one, or by a program that died
    /// holding it; or tlsplane disconnected its receiver.
    Abandoned,
}

/// The reader of one receiver's requests, as the judge of a relay's end reaches it.
pub trait Requests: Send + Sync {
    /// Reads and serves every request already queued on the receiver's connection, without
    /// waiting for more.
    fn serve_queued(&self);
}

pub struct Hangups {
    watch: PeerEndWatch,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Receivers whose requests are still being read.
    receivers: HashMap<u64, Receiver>,
    /// Open relays by token.
    relays: HashMap<u64, Relay>,
    /// Relay tokens by receiver and connection id, for CLOSE requests.
    by_conn: HashMap<(u64, u64), u64>,
    next: u64,
}

struct Receiver {
    requests: Weak<dyn Requests>,
    program: Arc<Program>,
    ends_with_close: bool,
}

struct Relay {
    receiver: u64,
    conn_id: u64,
    program: Arc<Program>,
    /// Its receiver announced ENDS_WITH_CLOSE.
    ends_with_close: bool,
    close_requested: bool,
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

    /// Receiver `id`'s requests are being read by `requests` (before it is given any
    /// connection); `program` is the process that connected.
    pub fn receiver_reading(&self, id: u64, requests: Weak<dyn Requests>, program: Arc<Program>) {
        self.table().receivers.insert(
            id,
            Receiver {
                requests,
                program,
                ends_with_close: false,
            },
        );
    }

    /// Receiver `id` announced ENDS_WITH_CLOSE: its connections that end without a CLOSE
    /// were abandoned.
    pub fn ends_with_close(&self, id: u64) {
        let mut t = self.table();
        if let Some(r) = t.receivers.get_mut(&id) {
            r.ends_with_close = true;
        }
        for r in t.relays.values_mut().filter(|r| r.receiver == id) {
            r.ends_with_close = true;
        }
    }

    /// Receiver `id`'s requests are all read (its connection ended). With `abandon`
    /// (tlsplane disconnected it) its open connections are reset now; the others are judged
    /// when their end comes.
    pub fn receiver_done(&self, id: u64, abandon: bool) {
        let mut t = self.table();
        t.receivers.remove(&id);
        if !abandon {
            return;
        }
        let mine: Vec<u64> = t
            .relays
            .iter()
            .filter(|(_, r)| r.receiver == id)
            .map(|(&token, _)| token)
            .collect();
        for token in mine {
            t.decide(token, End::Abandoned);
        }
    }

    /// Watches `ours`, tlsplane's end of the relay of connection `conn_id`, about to be
    /// handed to receiver `receiver` (before the program has its end).
    pub fn watch_relay(
        self: &Arc<Self>,
        receiver: u64,
        conn_id: u64,
        ours: BorrowedFd<'_>,
    ) -> std::io::Result<RelayEnd> {
        let mut t = self.table();
        let Some(rx) = t.receivers.get(&receiver) else {
            return Err(std::io::Error::other("the receiver is gone"));
        };
        let (program, ends_with_close) = (rx.program.clone(), rx.ends_with_close);
        t.next += 1;
        let token = t.next;
        let end = Arc::new(watch::channel(End::Open).0);
        t.relays.insert(
            token,
            Relay {
                receiver,
                conn_id,
                program,
                ends_with_close,
                close_requested: false,
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
        match t.relays.get_mut(&token) {
            Some(r) => {
                r.close_requested = true;
                true
            }
            None => false,
        }
    }

    /// Relayed connection `conn_id` of `receiver` was never written to it (the receiver went
    /// first): nothing was sent on it, its end is an orderly one.
    pub fn not_handed(&self, receiver: u64, conn_id: u64) {
        let mut t = self.table();
        if let Some(&token) = t.by_conn.get(&(receiver, conn_id)) {
            t.decide(token, End::Orderly);
        }
    }

    /// Hang-ups of relays' program ends.
    fn on_events(&self, tokens: &[u64]) {
        for &token in tokens {
            let (requests, program) = {
                let t = self.table();
                let Some(r) = t.relays.get(&token) else {
                    continue;
                };
                let requests = t.receivers.get(&r.receiver).map(|rx| rx.requests.clone());
                (requests, (!r.ends_with_close).then(|| r.program.clone()))
            };
            // Where the program stands as close to its end as can be (a program that ends a
            // connection and exits at once may be seen exiting all the same: the fallback's
            // limit), unless its receiver promised a CLOSE.
            let state = program.map(|p| p.state());
            // Outside the table's lock: serving a CLOSE takes it.
            if let Some(requests) = requests.and_then(|r| r.upgrade()) {
                requests.serve_queued();
            }
            let mut t = self.table();
            let Some(r) = t.relays.get(&token) else {
                continue;
            };
            let end = match (r.close_requested, r.ends_with_close, state) {
                (true, _, _) => End::Orderly,
                (false, true, _) => End::Abandoned,
                (false, false, Some(s)) if !s.ended_holding() => End::Orderly,
                (false, false, _) => End::Abandoned,
            };
            t.decide(token, end);
        }
    }
}

impl RelayEnd {
    /// Whether the program ended the connection in order: waits for the watching thread to
    /// have decided (the caller read the end already). Its decision never waits on anything
    /// but the requests already queued; `backstop` only guards against a watch that never
    /// answers (then: not in order).
    pub async fn orderly(&self, backstop: Duration) -> bool {
        let mut rx = self.end.subscribe();
        let seen = tokio::time::timeout(backstop, async {
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

/// The process that connected as a receiver: its pid (`SO_PEERCRED`) and, where the kernel
/// gives one, a pidfd taken at connect time, which cannot come to name another process.
pub struct Program {
    pid: u32,
    pidfd: Option<OwnedFd>,
}

impl Program {
    /// The peer of `sock`, whose `SO_PEERCRED` pid is `pid` (0: in a pid namespace tlsplane
    /// cannot see into). `SO_PEERPIDFD` (Linux 6.5) names the very process that connected;
    /// else `pidfd_open` now, right after it connected (Linux 5.3); else the pid alone.
    pub fn of(sock: BorrowedFd<'_>, pid: u32) -> Self {
        let pidfd = (pid != 0)
            .then(|| tlsplane_sys::peer_pidfd(sock).or_else(|_| tlsplane_sys::pidfd_open(pid)))
            .and_then(Result::ok);
        Self { pid, pidfd }
    }

    #[cfg(test)]
    pub fn pid(pid: u32) -> Self {
        Self {
            pid,
            pidfd: tlsplane_sys::pidfd_open(pid).ok(),
        }
    }

    /// Where the process stands now.
    pub fn state(&self) -> Process {
        if self.pid == 0 {
            return Process::Unknown;
        }
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid));
        // After the read: if the process was reaped, the pid may have named another one by
        // then; if it was not, the pid was still ours when the file was read.
        match self
            .pidfd
            .as_ref()
            .map(|fd| tlsplane_sys::pidfd_process_exists(fd.as_fd()))
        {
            Some(Ok(false)) => return Process::Gone,
            // A pidfd that answers, and a /proc that does not show the process (mounted
            // with hidepid=invisible, another pid namespace): hidden, not gone.
            Some(Ok(true)) if stat.is_err() => return Process::Unknown,
            _ => {}
        }
        match stat {
            Ok(stat) => parse_stat(&stat),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Process::Gone,
            Err(_) => Process::Unknown,
        }
    }
}

/// Where a receiver's process stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Process {
    Alive,
    /// Exiting, or exited and not reaped yet, whatever its status: what it still held was
    /// not ended by it.
    Exiting,
    /// Reaped (its pid no longer names it).
    Gone,
    /// tlsplane cannot tell (`/proc` hidden or unreadable, pid 0): taken as alive, so that a
    /// living program's ends are never cut.
    Unknown,
}

impl Process {
    /// It went while it held what it had not ended.
    pub fn ended_holding(self) -> bool {
        matches!(self, Process::Exiting | Process::Gone)
    }
}

/// A process's `/proc/PID/stat`: exiting if its state is a zombie's or a dead one's, or
/// `PF_EXITING` is among its flags (field 9, which anyone may read, set before the kernel
/// releases any of its descriptors). Not its exit code (field 52): the kernel shows that only
/// to a reader allowed to trace the process, 0 to anyone else.
fn parse_stat(stat: &str) -> Process {
    const PF_EXITING: u64 = 0x4;
    // After the command's closing parenthesis: state (field 3) ... flags (9).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_ascii_whitespace()
        .collect();
    let flags = fields.get(9 - 3).and_then(|f| f.parse::<u64>().ok());
    match (fields.first(), flags) {
        (Some(&("Z" | "X" | "x")), _) => Process::Exiting,
        (_, Some(f)) if f & PF_EXITING != 0 => Process::Exiting,
        (Some(_), Some(_)) => Process::Alive,
        _ => Process::Unknown,
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
    fn a_process_is_alive_exiting_whatever_its_status_or_gone() {
        assert_eq!(Program::pid(std::process::id()).state(), Process::Alive);
        let mut ok = std::process::Command::new("true").spawn().unwrap();
        let mut killed = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let (ok_p, killed_p) = (Program::pid(ok.id()), Program::pid(killed.id()));
        killed.kill().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        // Not reaped yet: a zombie, exited with status 0 or killed alike.
        assert_eq!(ok_p.state(), Process::Exiting);
        assert_eq!(killed_p.state(), Process::Exiting);
        ok.wait().unwrap();
        killed.wait().unwrap();
        assert_eq!(ok_p.state(), Process::Gone);
        // The exit code is not read: a stat whose flags say exiting is exiting with any code
        // (a reader not allowed to trace the process sees 0 there).
        let line = |state: &str, flags: u64| {
            let mut f = vec!["0".to_string(); 50];
            f[0] = state.to_string();
            f[6] = flags.to_string(); // field 9
            f[49] = "9".to_string(); // field 52, the exit code: ignored
            format!("123 (a (b) c) {}", f.join(" "))
        };
        assert_eq!(parse_stat(&line("S", 0x4040_0104)), Process::Exiting);
        assert_eq!(parse_stat(&line("S", 0x4040_0100)), Process::Alive);
        assert_eq!(parse_stat(&line("Z", 0)), Process::Exiting);
        assert_eq!(parse_stat("garbage"), Process::Unknown);
    }

    #[test]
    fn only_a_reaped_process_is_gone() {
        // A pid that no process has: gone. One whose pidfd says it exists but /proc does not
        // show it (hidepid=invisible): unknown, not gone.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let p = Program::pid(child.id());
        child.wait().unwrap();
        let stale = Program {
            pid: p.pid,
            pidfd: None,
        };
        assert_eq!(stale.state(), Process::Gone, "ENOENT");
        let hidden = Program {
            pid: u32::MAX / 2,
            pidfd: tlsplane_sys::pidfd_open(std::process::id()).ok(),
        };
        assert_eq!(hidden.state(), Process::Unknown);
        // A pid reused by another process: the pidfd taken before says the first one is gone.
        let reused = Program {
            pid: std::process::id(),
            pidfd: p.pidfd,
        };
        assert_eq!(reused.state(), Process::Gone);
        assert_eq!(Program::of_pid_zero().state(), Process::Unknown);
    }

    impl Program {
        fn of_pid_zero() -> Self {
            Self {
                pid: 0,
                pidfd: None,
            }
        }
    }

    /// A receiver whose queued requests are given by the test.
    struct Queued(Mutex<Vec<u64>>, Arc<Hangups>, u64);
    impl Requests for Queued {
        fn serve_queued(&self) {
            for conn in self.0.lock().unwrap().drain(..) {
                self.1.close_requested(self.2, conn);
            }
        }
    }

    fn relay(h: &Arc<Hangups>, receiver: u64, conn: u64) -> (RelayEnd, OwnedPair) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let end = h.watch_relay(receiver, conn, ours.as_fd()).unwrap();
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

    fn reader(h: &Arc<Hangups>, id: u64, pid: u32) -> Arc<Queued> {
        let q = Arc::new(Queued(Mutex::new(Vec::new()), h.clone(), id));
        let weak: Weak<dyn Requests> = Arc::downgrade(&(q.clone() as Arc<dyn Requests>));
        h.receiver_reading(id, weak, Arc::new(Program::pid(pid)));
        q
    }

    #[test]
    fn a_receiver_that_ends_with_close_has_its_queued_closes_served_before_the_judgement() {
        let h = Hangups::start().unwrap();
        let q = reader(&h, 1, std::process::id());
        h.ends_with_close(1);
        // Closed after a CLOSE still queued on the receiver's connection: orderly.
        let (asked, (_o, theirs)) = relay(&h, 1, 10);
        q.0.lock().unwrap().push(10);
        drop(theirs);
        assert_eq!(decided(&asked), End::Orderly);
        // Closed with none, by a living program: abandoned (it promised one).
        let (cut, (_o2, theirs)) = relay(&h, 1, 11);
        drop(theirs);
        assert_eq!(decided(&cut), End::Abandoned);
        // Announced after the relay was watched: the relay learns it too.
        let _q2 = reader(&h, 2, std::process::id());
        let (late, (_o3, theirs)) = relay(&h, 2, 20);
        h.ends_with_close(2);
        drop(theirs);
        assert_eq!(decided(&late), End::Abandoned);
        // Its receiver gone, a relay still open is judged when its end comes.
        let (held, (_o4, theirs)) = relay(&h, 1, 12);
        h.receiver_done(1, false);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(*held.end.borrow(), End::Open);
        drop(theirs);
        assert_eq!(decided(&held), End::Abandoned);
        drop(q);
    }

    #[test]
    fn without_the_promise_ends_are_judged_by_the_process_that_connected() {
        let h = Hangups::start().unwrap();
        let _q = reader(&h, 1, std::process::id());
        // A live program closes its end.
        let (alive, (_o, theirs)) = relay(&h, 1, 10);
        drop(theirs);
        assert_eq!(decided(&alive), End::Orderly);
        // A program that exited with status 0, and one reaped: abandoned unless asked.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let q = reader(&h, 2, child.id());
        std::thread::sleep(Duration::from_millis(200));
        let (zombie, (_o2, theirs)) = relay(&h, 2, 20);
        let (asked, (_o3, theirs3)) = relay(&h, 2, 21);
        q.0.lock().unwrap().push(21);
        drop((theirs, theirs3));
        assert_eq!(decided(&zombie), End::Abandoned);
        assert_eq!(decided(&asked), End::Orderly);
        child.wait().unwrap();
        let (reaped, (_o4, theirs)) = relay(&h, 2, 22);
        drop(theirs);
        assert_eq!(decided(&reaped), End::Abandoned);
        assert!(!h.close_requested(3, 22), "another receiver's connection");
        // A receiver tlsplane disconnected: its open connections are abandoned at once.
        let _q3 = reader(&h, 3, std::process::id());
        let (held, _pair) = relay(&h, 3, 30);
        let (never_sent, _pair2) = relay(&h, 3, 31);
        h.not_handed(3, 31);
        h.receiver_done(3, true);
        assert_eq!(decided(&held), End::Abandoned);
        assert_eq!(decided(&never_sent), End::Orderly);
    }
}
