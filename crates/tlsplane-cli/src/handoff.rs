//! `tlsplane handoff`: established TLS connections handed to other programs (issue 21).
//!
//! Listeners, handshakes, sites, keys and reload are the shared server's (`crate::server`).
//! Each site names a Unix socket that tlsplane listens on (in a directory no other user can
//! write: `tlsplane_server::unix_socket`); programs ("receivers") connect to it, are checked
//! by `SO_PEERCRED`/`SO_PEERGROUPS` against the site's allowed user and group ids (again at
//! each reload), and receive each established connection as a CONNECTION frame with a
//! descriptor (`SCM_RIGHTS`, docs/HANDOFF.md).
//!
//! Where the kernel took the connection the program gets the kTLS socket itself, and
//! tlsplane keeps a duplicate and the keys (`keeper`). Elsewhere it gets one end of a
//! `socketpair(AF_UNIX, SOCK_STREAM)` and tlsplane relays between the other end and the TLS
//! stream with the proxy's TCP-mode relay (half-closes kept: the program's
//! `shutdown(SHUT_WR)` or close becomes close_notify, the client's close_notify becomes EOF
//! on the program's end).
//!
//! Per socket, one thread accepts receivers (at most --handoff-max-receivers); per receiver,
//! one thread writes its frames (CONNECTION frames and replies, from bounded queues: the
//! event loops and the reading thread only queue) and one reads its requests and notices
//! its end. Requests are read without waiting (one reader at a time, under a lock), so that
//! the judge of a relay's end can serve those already queued first (`hangups`). A receiver
//! that announced ENDS_WITH_CLOSE (HELLO) ends every connection with a CLOSE: one that ends
//! without is reset. For one that did not, the connections it was given and did not end are
//! reset when its program went holding them. A client must not take a cut for an end.

mod hangups;
mod keeper;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tlsplane::stats::Counter;
use tlsplane::{PlaneKind, TlsStream};
use tlsplane_handoff::wire::{self, Prefix};
use tlsplane_handoff::{ConnInfo, Message, Plane, Reply, Status};

use crate::proxy::backend::{BackendConn, Io};
use crate::proxy::{Ended, ProxyStats};
use hangups::{Hangups, Program};
use keeper::{Keeper, KeptSocket, KeptStats};
use tlsplane_server::config::{HandoffTarget, Origin, SiteNeeds, Sites};
use tlsplane_server::runtime::{ConnContext, Handler, Phase, RuntimeStats, Served, Throttled};
use tlsplane_server::server::{Product, ServerArgs};

#[derive(Args, Debug, Clone)]
pub struct HandoffArgs {
    /// Unix socket that receivers connect to, to be handed the established connections (see
    /// docs/HANDOFF.md). With --config, sites name their own (`handoff-socket = "PATH"`) and
    /// this serves the sites that do not. Its directory must be one that only root or
    /// tlsplane's user can write (it is created, mode 755, when missing); tlsplane refuses
    /// to start otherwise (e.g. /tmp). Default: $RUNTIME_DIRECTORY/handoff.sock, else
    /// /run/tlsplane/handoff.sock. Receivers get connections least pending first (the one
    /// with the fewest hand-offs queued and not yet written to it; ties in turn).
    #[arg(long, value_name = "PATH")]
    pub handoff_socket: Option<PathBuf>,
    /// User id allowed to receive connections (repeatable; checked with SO_PEERCRED when a
    /// receiver connects: any other is closed at once and gets nothing). With neither this nor
    /// --handoff-allow-gid: only the user tlsplane runs as (--user, else its own).
    #[arg(long = "handoff-allow-uid", value_name = "UID")]
    pub handoff_allow_uid: Vec<u32>,
    /// Group id allowed to receive connections (repeatable; a receiver with one of these among
    /// its groups, effective or supplementary, is allowed). A reload that removes an id
    /// disconnects the receivers it allowed, and resets the connections they hold.
    #[arg(long = "handoff-allow-gid", value_name = "GID")]
    pub handoff_allow_gid: Vec<u32>,
    /// Hand-offs queued per receiver and not yet written to it. When the least pending
    /// receiver has this many, the connection is refused (closed with close_notify, counted).
    #[arg(long, default_value_t = 64, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub handoff_queue: u32,
    /// Replies to a receiver's requests queued and not yet written to it (it sends requests
    /// and reads nothing). Past this, the receiver is disconnected (counted) and the
    /// connections it holds are reset: tlsplane never waits for a receiver to read.
    #[arg(long, default_value_t = 1024, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1048576))]
    pub handoff_reply_queue: u32,
    /// Receivers connected to one hand-off socket, at most (each costs tlsplane two
    /// threads). Past it, an allowed receiver is closed at connect (counted, logged at most
    /// once a second).
    #[arg(long, default_value_t = 128, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub handoff_max_receivers: u32,
    /// Kernel-plane connections whose socket duplicate (and keys) tlsplane keeps after the
    /// hand-off, at most; past it, a kernel-plane connection is handed over the user relay
    /// instead (counted). Each kept duplicate holds a descriptor after the connection has left
    /// --max-connections' count. 0: a quarter of the open-files limit (--max-connections'
    /// default then leaves a descriptor per connection for it).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub handoff_max_kept: u64,
    /// Bytes buffered per direction per relayed connection. (A relayed connection with no
    /// byte moving either way for --idle-timeout is closed, as in proxy.)
    #[arg(long, default_value_t = 16384, value_name = "BYTES", value_parser = clap::value_parser!(u32).range(1024..=1048576))]
    pub buffer: u32,
    #[command(flatten)]
    pub server: ServerArgs,
}

/// Request bytes a receiver's reading thread serves per turn of its lock, at most: the
/// judge of a relay's end waits for that lock, and a receiver that sends without pause must
/// not hold it.
const READ_TURN: usize = 65536;

/// The ids allowed by default: the user tlsplane serves as.
fn default_ids(args: &HandoffArgs) -> (Vec<u32>, Vec<u32>) {
    if !args.handoff_allow_uid.is_empty() || !args.handoff_allow_gid.is_empty() {
        return (
            args.handoff_allow_uid.clone(),
            args.handoff_allow_gid.clone(),
        );
    }
    let uid = match &args.server.user {
        Some(run_as) => run_as.uid,
        None => tlsplane_sys::current_uid(),
    };
    (vec![uid], Vec::new())
}

/// The socket and ids of the flags (the default for sites that name none).
pub fn default_target(args: &HandoffArgs) -> HandoffTarget {
    let (uids, gids) = default_ids(args);
    HandoffTarget {
        socket: args
            .handoff_socket
            .clone()
            .unwrap_or_else(|| tlsplane_server::unix_socket::default_dir().join("handoff.sock")),
        uids,
        gids,
    }
}

pub fn site_needs(args: &HandoffArgs) -> SiteNeeds {
    SiteNeeds::Handoff {
        default: default_target(args),
    }
}

/// Hand-off counters, and the hand-off sockets, kept across reloads.
#[derive(Default)]
pub struct HandoffStats {
    /// Established connections this product was given.
    established: Counter,
    handed_off_user: Counter,
    handed_off_kernel: Counter,
    /// Connections closed because no receiver was connected to their site's socket.
    refused_no_receiver: Counter,
    /// Connections closed because every receiver had --handoff-queue hand-offs pending.
    refused_queue_full: Counter,
    /// Connections that could not be handed off for want of a socketpair (descriptors).
    failed: Counter,
    receivers_accepted: Counter,
    /// Receivers closed at connect: their uid/gid is not allowed.
    receivers_refused: Counter,
    /// Receivers disconnected by a reload that no longer allows their ids.
    receivers_revoked: Counter,
    /// Receivers disconnected for --handoff-reply-queue replies unread.
    receivers_reply_overflow: Counter,
    /// Allowed receivers closed at connect: --handoff-max-receivers were connected.
    receivers_over_limit: Counter,
    /// Receivers disconnected for a protocol error (a HELLO after their first frame).
    receivers_protocol_errors: Counter,
    /// Receivers that announced ENDS_WITH_CLOSE.
    receivers_ends_with_close: Counter,
    /// Relayed connections reset because their receiver went without ending them.
    relay_reset_receiver_gone: Counter,
    /// Receivers that went away (closed, died, or could not be written to).
    receivers_lost: Counter,
    /// KEY_UPDATE and CLOSE requests answered.
    requests: Counter,
    client_errors: Counter,
    program_errors: Counter,
    idle_timeouts: Counter,
    /// Relayed bytes (the relay's to-backend/to-client copy counters: program/client).
    relay: ProxyStats,
    /// Kernel-plane connections that went to the user relay: input was already buffered
    /// (the client's data arrived with its close, or rustls holds plaintext).
    kernel_relayed: Counter,
    /// Kernel-plane connections that went to the user relay because --handoff-max-kept
    /// duplicates were kept.
    kernel_relayed_kept_full: Counter,
    kernel: Arc<KeptStats>,
    /// Kernel-plane hand-offs kept, started at the first one (`None`: epoll refused; those
    /// connections are relayed).
    keeper: OnceLock<Option<Arc<Keeper>>>,
    /// Connection ids: unique while the process runs, and unlike those of an earlier run
    /// (the top half is random): a program that kept connections across a restart cannot
    /// name another program's.
    id_base: OnceLock<u64>,
    next_id: AtomicU64,
    /// Receiver ids, to find one in its socket's list.
    next_receiver: AtomicU64,
    /// The order of receivers' and relayed connections' ends, started at the first build.
    hangups: OnceLock<Arc<Hangups>>,
    /// Open hand-off sockets by path: bound at the first configuration that names them,
    /// kept (with their receivers) across reloads.
    sockets: Mutex<HashMap<PathBuf, Arc<HandoffSocket>>>,
    files: Mutex<Weak<SocketFiles>>,
}

/// The hand-off sockets' files, removed when the last configuration generation that uses
/// them is dropped: the server's orderly exit, so that the next start finds the paths free
/// (a killed server's are replaced at the next start). Every generation holds it (a reload
/// builds the next one while the previous one still does); the stats only point at it,
/// since the admin endpoint may hold the stats to the very end.
#[derive(Default)]
struct SocketFiles(Mutex<Vec<PathBuf>>);

impl Drop for SocketFiles {
    fn drop(&mut self) {
        let paths = self.0.get_mut().unwrap_or_else(|e| e.into_inner());
        for path in paths.iter() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Who may connect to a hand-off socket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Allowed {
    uids: Vec<u32>,
    gids: Vec<u32>,
}

impl Allowed {
    /// By user id, or by any of the peer's groups: its effective group or a supplementary one.
    fn allows(&self, peer: &Peer) -> bool {
        self.uids.contains(&peer.uid)
            || std::iter::once(&peer.gid)
                .chain(&peer.groups)
                .any(|g| self.gids.contains(g))
    }
}

/// A receiver's credentials, as the kernel recorded them when it connected.
#[derive(Clone, Debug, Default)]
struct Peer {
    pid: u32,
    uid: u32,
    gid: u32,
    /// Its supplementary groups (`SO_PEERGROUPS`; none where the kernel cannot say).
    groups: Vec<u32>,
}

impl Peer {
    fn of(sock: &UnixStream) -> std::io::Result<Self> {
        let (uid, gid) = tlsplane_sys::peer_ids(sock.as_fd())?;
        let (pid, _) = tlsplane_sys::peer_cred(sock.as_fd())?;
        let groups = tlsplane_sys::peer_groups(sock.as_fd()).unwrap_or_default();
        Ok(Self {
            pid,
            uid,
            gid,
            groups,
        })
    }
}

/// A hand-off socket and the receivers connected to it.
struct HandoffSocket {
    path: PathBuf,
    /// Replaced by a reload (receivers it no longer allows are disconnected); held while a
    /// receiver is checked and added, so that none slips in under ids a reload removed.
    allowed: Mutex<Allowed>,
    /// --handoff-queue, --handoff-reply-queue and --handoff-max-receivers, replaced by a
    /// reload (the reply queue's bound is shared with the receivers).
    queue: AtomicUsize,
    reply_queue: Arc<AtomicUsize>,
    max_receivers: AtomicUsize,
    receivers: Mutex<Vec<Arc<ReceiverHandle>>>,
    /// Where the next tie among least pending receivers starts.
    turn: AtomicUsize,
    /// Refused receivers are logged at most once a second.
    refusals: Mutex<Throttled>,
}

/// One hand-off of a connection to a receiver.
struct Job {
    fd: JobFd,
    info: ConnInfo,
}

/// The descriptor a CONNECTION frame carries.
enum JobFd {
    /// The program's end of a relay's socketpair: ours to close once sent.
    Relay(OwnedFd),
    /// The kTLS socket, which tlsplane keeps a duplicate of.
    Kernel(Arc<KeptSocket>),
}

impl AsFd for JobFd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            JobFd::Relay(fd) => fd.as_fd(),
            JobFd::Kernel(k) => k.as_fd(),
        }
    }
}

/// A frame for a receiver's writing thread.
enum Frame {
    Connection(Job),
    Reply(Reply),
}

/// Why a frame was not queued.
enum NotQueued {
    Full,
    Gone,
}

/// What waits for a receiver's writing thread: CONNECTION frames (at most --handoff-queue)
/// and replies (at most --handoff-reply-queue), replies first. Queuing never waits: the
/// event loops queue hand-offs and the reading thread replies, and neither may stop for a
/// receiver that does not read.
#[derive(Default)]
struct Outbox {
    queued: Mutex<Queued>,
    ready: Condvar,
}

#[derive(Default)]
struct Queued {
    jobs: VecDeque<Job>,
    replies: VecDeque<Reply>,
    closed: bool,
}

impl Outbox {
    fn queued(&self) -> std::sync::MutexGuard<'_, Queued> {
        self.queued.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job`, or drops it (its descriptor closes) and says why not.
    fn push_job(&self, job: Job, limit: usize) -> Result<(), NotQueued> {
        let mut q = self.queued();
        if q.closed {
            return Err(NotQueued::Gone);
        }
        if q.jobs.len() >= limit {
            return Err(NotQueued::Full);
        }
        q.jobs.push_back(job);
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    /// Queues `reply`, or says why not: full (the receiver reads nothing), or gone (its
    /// writing thread lost it: the requests still queued are served all the same).
    fn push_reply(&self, reply: Reply, limit: usize) -> Result<(), NotQueued> {
        let mut q = self.queued();
        if q.closed {
            return Err(NotQueued::Gone);
        }
        if q.replies.len() >= limit {
            return Err(NotQueued::Full);
        }
        q.replies.push_back(reply);
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    /// The next frame to write, waiting for one; `None` once closed.
    fn next(&self) -> Option<Frame> {
        let mut q = self.queued();
        loop {
            if q.closed {
                return None;
            }
            if let Some(r) = q.replies.pop_front() {
                return Some(Frame::Reply(r));
            }
            if let Some(j) = q.jobs.pop_front() {
                return Some(Frame::Connection(j));
            }
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Closes it; the hand-offs still queued are returned, to be dropped by the caller.
    fn close(&self) -> VecDeque<Job> {
        let mut q = self.queued();
        q.closed = true;
        q.replies.clear();
        let jobs = std::mem::take(&mut q.jobs);
        drop(q);
        self.ready.notify_all();
        jobs
    }
}

/// A connected receiver.
struct ReceiverHandle {
    id: u64,
    /// Itself, for answers given after a request was read.
    me: Weak<ReceiverHandle>,
    peer: Peer,
    /// The process that connected, for the judgement of a receiver that promised no CLOSE.
    program: Arc<Program>,
    sock: UnixStream,
    /// Hand-offs queued or being written to it.
    pending: AtomicUsize,
    outbox: Outbox,
    /// Its requests, read so far: one reader at a time (its reading thread, or the judge of
    /// a relay's end serving what is queued).
    inbound: Mutex<Inbound>,
    /// It announced ENDS_WITH_CLOSE.
    ends_with_close: AtomicBool,
    /// tlsplane disconnected it (revoked, it read no replies, it broke the protocol): the
    /// connections it holds are reset.
    dropped: AtomicBool,
    socket: Weak<HandoffSocket>,
    stats: Weak<HandoffStats>,
}

#[derive(Default)]
struct Inbound {
    /// Bytes read and not served yet: the start of a frame.
    buf: Vec<u8>,
    /// Frames served.
    frames: u64,
    /// Its end was read, or its stream broke: nothing more is read.
    ended: bool,
}

/// What a turn of reading a receiver's requests came to.
#[derive(PartialEq, Eq)]
enum Turn {
    /// Everything queued was served.
    Idle,
    /// The turn's bytes were served; more may be queued.
    More,
    /// Its end was read, its stream broke, or tlsplane disconnected it.
    Ended,
}

impl ReceiverHandle {
    /// Ends its connection to us for good: the connections it holds are reset.
    fn drop_it(&self) {
        self.dropped.store(true, Release);
        self.disconnect();
    }

    /// Reads and serves its queued requests, `limit` bytes at most, never waiting.
    fn read_queued(&self, limit: usize) -> Turn {
        let mut inbound = self.inbound.lock().unwrap_or_else(|e| e.into_inner());
        if inbound.ended {
            return Turn::Ended;
        }
        let Some(stats) = self.stats.upgrade() else {
            inbound.ended = true;
            return Turn::Ended;
        };
        let mut read = 0;
        let turn = loop {
            if !self.serve_frames(&mut inbound, &stats) {
                break Turn::Ended;
            }
            if read >= limit {
                break Turn::More;
            }
            let buf = &mut inbound.buf;
            let old = buf.len();
            buf.resize(old + 16384, 0);
            let got = tlsplane_sys::recv_nonblocking(self.sock.as_fd(), &mut buf[old..]);
            buf.truncate(old + *got.as_ref().unwrap_or(&0));
            match got {
                Ok(0) => break Turn::Ended,
                Ok(n) => read += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break Turn::Idle,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(error = %e, "hand-off receiver: unreadable request");
                    break Turn::Ended;
                }
            }
        };
        if turn == Turn::Ended {
            inbound.ended = true;
        }
        turn
    }

    /// Serves the whole frames read. False: the stream cannot be framed any more, or the
    /// receiver was disconnected.
    fn serve_frames(&self, inbound: &mut Inbound, stats: &HandoffStats) -> bool {
        let mut at = 0;
        let mut going = true;
        while going {
            let rest = &inbound.buf[at..];
            if rest.len() < wire::PREFIX_LEN {
                break;
            }
            let len = match Prefix::decode(rest) {
                Ok(p) if rest.len() >= p.len => p.len,
                Ok(_) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "hand-off receiver: unreadable request");
                    going = false;
                    break;
                }
            };
            going = self.serve(&rest[..len], inbound.frames == 0, stats);
            inbound.frames += 1;
            at += len;
        }
        inbound.buf.drain(..at);
        going
    }

    /// Serves one request frame. False: the receiver was disconnected.
    fn serve(&self, frame: &[u8], first: bool, stats: &HandoffStats) -> bool {
        if let Ok(Some(Message::Hello { flags })) = Message::decode(frame) {
            return self.hello(flags, first, stats);
        }
        let Some(reply) = self.answer(frame, stats) else {
            return true;
        };
        stats.requests.fetch_add(1, Relaxed);
        self.reply(reply)
    }

    /// Its HELLO: at most one, as its first frame; else a protocol error that disconnects it.
    fn hello(&self, flags: u32, first: bool, stats: &HandoffStats) -> bool {
        if !first {
            stats.receivers_protocol_errors.fetch_add(1, Relaxed);
            if let Some(socket) = self.socket.upgrade() {
                socket.log_refusal(
                    Some(&self.peer),
                    "a HELLO after its first frame; disconnected",
                );
            }
            self.drop_it();
            return false;
        }
        if flags & wire::ENDS_WITH_CLOSE != 0 {
            self.ends_with_close.store(true, Release);
            stats.receivers_ends_with_close.fetch_add(1, Relaxed);
            if let Some(h) = stats.hangups.get() {
                h.ends_with_close(self.id);
            }
        }
        true
    }

    /// Queues `reply`. False: its replies pile up unread, and it was disconnected. (A
    /// receiver its writing thread lost has its requests served all the same, unanswered.)
    fn reply(&self, reply: Reply) -> bool {
        let limit = self
            .socket
            .upgrade()
            .map_or(usize::MAX, |s| s.reply_queue.load(Relaxed));
        match self.outbox.push_reply(reply, limit) {
            Ok(()) | Err(NotQueued::Gone) => true,
            Err(NotQueued::Full) => {
                // Counted and logged before the receiver can see its end.
                if let Some(stats) = self.stats.upgrade() {
                    stats.receivers_reply_overflow.fetch_add(1, Relaxed);
                }
                if let Some(socket) = self.socket.upgrade() {
                    tracing::warn!(socket = %socket.path.display(), uid = self.peer.uid,
                        "hand-off receiver disconnected: it reads none of its replies");
                }
                self.drop_it();
                false
            }
        }
    }

    /// Ends its connection to us; its threads then forget it.
    fn disconnect(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

impl hangups::Requests for ReceiverHandle {
    fn serve_queued(&self) {
        // What is queued now, whole: everything the program sent before the end being
        // judged. (Not more: a receiver that keeps sending must not hold the judge.)
        let queued = tlsplane_sys::queued_bytes(self.sock.as_fd()).unwrap_or(0);
        let _ = self.read_queued(queued.max(1));
    }
}

/// The bounds a socket's receivers live under (the flags; a reload replaces them).
struct Bounds {
    queue: usize,
    reply_queue: usize,
    max_receivers: usize,
}

impl Bounds {
    fn of(args: &HandoffArgs) -> Self {
        Self {
            queue: args.handoff_queue as usize,
            reply_queue: args.handoff_reply_queue as usize,
            max_receivers: args.handoff_max_receivers as usize,
        }
    }
}

impl HandoffSocket {
    /// Binds `path` in a directory only root or this user can write (docs/HANDOFF.md) and
    /// starts accepting receivers.
    fn open(
        path: &Path,
        allowed: Allowed,
        bounds: &Bounds,
        stats: &Arc<HandoffStats>,
    ) -> anyhow::Result<Arc<Self>> {
        // Anyone may connect: SO_PEERCRED decides who is served, and says so in the log.
        let listener = tlsplane_server::unix_socket::bind("hand-off socket", path, 0o666)?;
        let socket = Arc::new(Self {
            path: path.to_path_buf(),
            allowed: Mutex::new(allowed),
            queue: AtomicUsize::new(bounds.queue),
            reply_queue: Arc::new(AtomicUsize::new(bounds.reply_queue)),
            max_receivers: AtomicUsize::new(bounds.max_receivers),
            receivers: Mutex::new(Vec::new()),
            turn: AtomicUsize::new(0),
            refusals: Mutex::new(Throttled::default()),
        });
        // Threads hold the stats weakly: nothing here keeps them alive past the server.
        let (s, st) = (socket.clone(), Arc::downgrade(stats));
        std::thread::Builder::new()
            .name("handoff-accept".into())
            .spawn(move || s.accept_loop(listener, &st))
            .context("hand-off socket: thread")?;
        Ok(socket)
    }

    fn accept_loop(self: Arc<Self>, listener: UnixListener, stats: &Weak<HandoffStats>) {
        loop {
            let sock = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::warn!(socket = %self.path.display(), error = %e, "hand-off accept failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let Some(stats) = stats.upgrade() else {
                return;
            };
            let stats = &stats;
            let peer = match Peer::of(&sock) {
                Ok(p) => p,
                Err(e) => {
                    stats.receivers_refused.fetch_add(1, Relaxed);
                    self.log_refusal(None, &format!("SO_PEERCRED failed: {e}"));
                    continue;
                }
            };
            let allowed = self.allowed.lock().unwrap_or_else(|e| e.into_inner());
            if !allowed.allows(&peer) {
                drop(allowed);
                stats.receivers_refused.fetch_add(1, Relaxed);
                self.log_refusal(Some(&peer), "uid/gid not allowed");
                continue;
            }
            let connected = self
                .receivers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len();
            if connected >= self.max_receivers.load(Relaxed) {
                drop(allowed);
                stats.receivers_over_limit.fetch_add(1, Relaxed);
                self.log_refusal(
                    Some(&peer),
                    "--handoff-max-receivers receivers are connected to this socket",
                );
                continue;
            }
            stats.receivers_accepted.fetch_add(1, Relaxed);
            let (uid, gid) = (peer.uid, peer.gid);
            let added = self.add_receiver(sock, peer, stats);
            drop(allowed);
            // Logged once it can be given connections (tests wait for this line).
            match added {
                Ok(()) => {
                    tracing::info!(socket = %self.path.display(), uid, gid, "hand-off receiver connected")
                }
                Err(e) => tracing::warn!(error = %e, "hand-off receiver: could not start it"),
            }
        }
    }

    /// At most a line a second: anyone may connect, and each refusal would log.
    fn log_refusal(&self, peer: Option<&Peer>, why: &str) {
        let pass = self
            .refusals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pass(std::time::Instant::now());
        let Some(suppressed) = pass else {
            return;
        };
        match peer {
            Some(p) => tracing::warn!(socket = %self.path.display(), uid = p.uid, gid = p.gid,
                groups = ?p.groups, suppressed, "hand-off receiver refused: {why}"),
            None => tracing::warn!(socket = %self.path.display(), suppressed,
                "hand-off receiver refused: {why}"),
        }
    }

    /// A reload's ids: receivers connected under ids no longer allowed are disconnected
    /// (their connections are reset as they go).
    fn set_allowed(&self, allowed: Allowed, stats: &HandoffStats) {
        let mut current = self.allowed.lock().unwrap_or_else(|e| e.into_inner());
        let revoked: Vec<Arc<ReceiverHandle>> = self
            .receivers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|r| !allowed.allows(&r.peer))
            .cloned()
            .collect();
        *current = allowed;
        drop(current);
        for r in revoked {
            stats.receivers_revoked.fetch_add(1, Relaxed);
            tracing::warn!(socket = %self.path.display(), uid = r.peer.uid, gid = r.peer.gid,
                "hand-off receiver disconnected: the reloaded configuration no longer allows its ids");
            r.drop_it();
        }
    }

    fn add_receiver(
        self: &Arc<Self>,
        sock: UnixStream,
        peer: Peer,
        stats: &Arc<HandoffStats>,
    ) -> std::io::Result<()> {
        // Now, while it is surely connected: a pidfd names it however long it takes to end.
        let program = Arc::new(Program::of(sock.as_fd(), peer.pid));
        let handle = Arc::new_cyclic(|me| ReceiverHandle {
            id: stats.next_receiver.fetch_add(1, Relaxed),
            me: me.clone(),
            peer,
            program,
            sock,
            pending: AtomicUsize::new(0),
            outbox: Outbox::default(),
            inbound: Mutex::default(),
            ends_with_close: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
            socket: Arc::downgrade(self),
            stats: Arc::downgrade(stats),
        });
        if let Some(h) = stats.hangups.get() {
            let requests: Weak<dyn hangups::Requests> = handle.me.clone();
            h.receiver_reading(handle.id, requests, handle.program.clone());
        }
        self.receivers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle.clone());
        let weak = Arc::downgrade(stats);
        let (socket, h, w) = (self.clone(), handle.clone(), weak.clone());
        let sending = std::thread::Builder::new()
            .name("handoff-send".into())
            .spawn(move || {
                let unsent = write_loop(&h.sock, &h);
                socket.lose(&h, unsent, &w);
            });
        let (socket, h, w) = (self.clone(), handle.clone(), weak.clone());
        let receiving = sending.and_then(|_| {
            std::thread::Builder::new()
                .name("handoff-recv".into())
                .spawn(move || {
                    read_loop(&h);
                    socket.lose(&h, None, &w);
                    finished(&h, &w);
                })
        });
        if let Err(e) = receiving {
            self.lose(&handle, None, &weak);
            finished(&handle, &weak);
            return Err(e);
        }
        Ok(())
    }

    /// Forgets a receiver (once, from whichever of its threads sees it go first): its socket
    /// is shut down (the other thread wakes; requests already queued are still read), and
    /// the hand-offs never written to it (`unsent`, those still queued) end as a refused
    /// connection does, with close_notify: nothing was sent on them.
    fn lose(&self, receiver: &ReceiverHandle, unsent: Option<Job>, stats: &Weak<HandoffStats>) {
        let removed = {
            let mut list = self.receivers.lock().unwrap_or_else(|e| e.into_inner());
            let before = list.len();
            list.retain(|r| r.id != receiver.id);
            before != list.len()
        };
        receiver.disconnect();
        let stats = stats.upgrade();
        let jobs = unsent.into_iter().chain(receiver.outbox.close());
        for job in jobs {
            if let Some(stats) = &stats {
                not_handed(stats, receiver.id, &job);
            }
        }
        if let (true, Some(stats)) = (removed, stats) {
            stats.receivers_lost.fetch_add(1, Relaxed);
            tracing::info!(socket = %self.path.display(), "hand-off receiver gone");
        }
    }

    /// The receiver with the fewest hand-offs pending, ties in turn.
    fn pick(&self) -> Option<Arc<ReceiverHandle>> {
        let list = self.receivers.lock().unwrap_or_else(|e| e.into_inner());
        if list.is_empty() {
            return None;
        }
        let start = self.turn.fetch_add(1, Relaxed) % list.len();
        (0..list.len())
            .map(|k| &list[(start + k) % list.len()])
            .min_by_key(|r| r.pending.load(Relaxed))
            .cloned()
    }
}

impl ReceiverHandle {
    /// Serves one KEY_UPDATE or CLOSE; `None` for a frame that is not one, or a KEY_UPDATE
    /// answered later (once tlsplane's own KeyUpdate found room in the socket).
    fn answer(&self, frame: &[u8], stats: &HandoffStats) -> Option<Reply> {
        // Connections on the user relay are re-keyed by tlsplane's record layer (a KEY_UPDATE
        // does not know them); a CLOSE marks the end the program gives them as orderly.
        let keeper = stats.keeper.get().cloned().flatten();
        let receiver = self.id;
        let (request_id, conn_id, status) = match Message::decode(frame) {
            Ok(Some(Message::KeyUpdate {
                request_id,
                conn_id,
                record_plaintext,
            })) => {
                let me = self.me.clone();
                let later: keeper::Answer = Box::new(move |status| {
                    if let Some(r) = me.upgrade() {
                        r.reply(Reply {
                            request_id,
                            conn_id,
                            status,
                        });
                    }
                });
                let status = match keeper {
                    Some(k) => k.key_update(receiver, conn_id, record_plaintext, later)?,
                    None => Status::UnknownConnection,
                };
                (request_id, conn_id, status)
            }
            Ok(Some(Message::Close {
                request_id,
                conn_id,
            })) => (
                request_id,
                conn_id,
                match keeper.map_or(Status::UnknownConnection, |k| k.close(receiver, conn_id)) {
                    Status::UnknownConnection
                        if stats
                            .hangups
                            .get()
                            .is_some_and(|h| h.close_requested(receiver, conn_id)) =>
                    {
                        Status::Ok
                    }
                    status => status,
                },
            ),
            // Kinds a receiver does not send, or a later revision's: skipped.
            Ok(_) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "hand-off receiver: bad request");
                return None;
            }
        };
        Some(Reply {
            request_id,
            conn_id,
            status,
        })
    }
}

/// Reads the receiver's requests until its end (or broken framing, or tlsplane disconnects
/// it), waiting only while nothing is queued.
fn read_loop(receiver: &ReceiverHandle) {
    loop {
        match receiver.read_queued(READ_TURN) {
            Turn::Ended => return,
            Turn::More => {}
            Turn::Idle => {
                if let Err(e) = tlsplane_sys::wait_readable(receiver.sock.as_fd(), -1) {
                    tracing::warn!(error = %e, "hand-off receiver: poll failed");
                    return;
                }
            }
        }
    }
}

/// A receiver's requests are all read (its connection ended): the connections it was given
/// and did not end are decided. Kernel plane: reset if tlsplane dropped it, it promised a
/// CLOSE for each (ENDS_WITH_CLOSE), or its program went holding them; else left to the
/// program, which lives on and owns the socket. User relay: each when its end comes
/// (`hangups`).
fn finished(receiver: &ReceiverHandle, stats: &Weak<HandoffStats>) {
    let Some(stats) = stats.upgrade() else {
        return;
    };
    let dropped = receiver.dropped.load(Acquire);
    if let Some(Some(keeper)) = stats.keeper.get() {
        let abandoned = dropped
            || receiver.ends_with_close.load(Acquire)
            || receiver.program.state().ended_holding();
        keeper.receiver_gone(receiver.id, abandoned);
    }
    if let Some(h) = stats.hangups.get() {
        h.receiver_done(receiver.id, dropped);
    }
}

/// A hand-off that never reached receiver `receiver` (it went first) ends with close_notify,
/// as a refused connection does.
fn not_handed(stats: &HandoffStats, receiver: u64, job: &Job) {
    match &job.fd {
        JobFd::Kernel(_) => {
            if let Some(Some(keeper)) = stats.keeper.get() {
                keeper.not_handed(job.info.conn_id);
            }
        }
        JobFd::Relay(_) => {
            if let Some(h) = stats.hangups.get() {
                h.not_handed(receiver, job.info.conn_id);
            }
        }
    }
}

/// Writes the receiver's frames until its outbox closes or a write fails (then: the
/// hand-off whose frame failed, if one did). Only this thread writes to the receiver, so
/// frames go out whole; its writes block (a receiver that reads nothing holds this thread
/// only, until the receiver is lost or disconnected).
fn write_loop(sock: &UnixStream, receiver: &ReceiverHandle) -> Option<Job> {
    while let Some(frame) = receiver.outbox.next() {
        let sent = match frame {
            Frame::Reply(reply) => tlsplane_handoff::send_reply(sock, &reply),
            Frame::Connection(job) => {
                let sent = tlsplane_handoff::send_connection(sock, job.fd.as_fd(), &job.info);
                receiver.pending.fetch_sub(1, Relaxed);
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "hand-off: writing to a receiver failed");
                    return Some(job);
                }
                // Our copy of the program's end of a relay goes: the program holds the only
                // one now (a kernel-plane socket stays kept).
                drop(job);
                Ok(())
            }
        };
        if let Err(e) = sent {
            tracing::debug!(error = %e, "hand-off: writing to a receiver failed");
            return None;
        }
    }
    None
}

/// --handoff-max-kept; 0: a quarter of the open-files limit (as the server raised it).
fn max_kept(args: &HandoffArgs) -> u64 {
    match args.handoff_max_kept {
        0 => tlsplane_sys::nofile_limit().map_or(1024, |n| (n / 4).max(1)),
        n => n,
    }
}

/// The `handoff` product under one configuration.
pub struct Handoff {
    /// By site number.
    sockets: Vec<Arc<HandoffSocket>>,
    args: HandoffArgs,
    /// --handoff-max-kept, resolved.
    max_kept: u64,
    stats: Arc<HandoffStats>,
    _files: Arc<SocketFiles>,
}

impl Product for Handoff {
    type Args = HandoffArgs;
    type Stats = HandoffStats;
    const COMMAND: &'static str = "handoff";

    fn server(args: &HandoffArgs) -> &ServerArgs {
        &args.server
    }

    fn site_needs(args: &HandoffArgs) -> SiteNeeds {
        site_needs(args)
    }

    /// The program decides what it speaks: no ALPN unless told (as the proxy's TCP mode).
    fn alpn(args: &HandoffArgs) -> tlsplane_server::server::Alpn {
        tlsplane_server::server::Alpn::new(args.server.alpn.as_deref(), &[], None)
    }

    fn check_args(_args: &HandoffArgs, _with_config: bool) -> anyhow::Result<()> {
        Ok(())
    }

    fn flag_origin(args: &HandoffArgs) -> anyhow::Result<Origin> {
        Ok(Origin::Handoff(default_target(args)))
    }

    fn build(
        args: &HandoffArgs,
        sites: Sites,
        stats: &Arc<HandoffStats>,
        _runtime: &Arc<RuntimeStats>,
    ) -> anyhow::Result<Self> {
        let mut seen: HashMap<PathBuf, Allowed> = HashMap::new();
        let mut targets = Vec::new();
        for s in sites.serve {
            let Origin::Handoff(t) = s.origin else {
                anyhow::bail!("site {}: no hand-off socket", s.label);
            };
            let allowed = Allowed {
                uids: t.uids,
                gids: t.gids,
            };
            if let Some(other) = seen.get(&t.socket) {
                if *other != allowed {
                    anyhow::bail!(
                        "site {}: hand-off socket {} is shared with another site that allows other ids",
                        s.label,
                        t.socket.display()
                    );
                }
            }
            seen.insert(t.socket.clone(), allowed.clone());
            targets.push((t.socket, allowed));
        }
        if stats.hangups.get().is_none() {
            let h = Hangups::start().context("hand-off: watching receivers' ends")?;
            let _ = stats.hangups.set(h);
        }
        let bounds = Bounds::of(args);
        let files = {
            let mut weak = stats.files.lock().unwrap_or_else(|e| e.into_inner());
            weak.upgrade().unwrap_or_else(|| {
                let f = Arc::new(SocketFiles::default());
                *weak = Arc::downgrade(&f);
                f
            })
        };
        let mut open = stats.sockets.lock().unwrap_or_else(|e| e.into_inner());
        let mut sockets = Vec::new();
        for (path, allowed) in targets {
            let socket = match open.get(&path) {
                Some(s) => {
                    s.set_allowed(allowed, stats);
                    s.queue.store(bounds.queue, Relaxed);
                    s.reply_queue.store(bounds.reply_queue, Relaxed);
                    s.max_receivers.store(bounds.max_receivers, Relaxed);
                    s.clone()
                }
                None => {
                    let s = HandoffSocket::open(&path, allowed, &bounds, stats)?;
                    files
                        .0
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(path.clone());
                    open.insert(path, s.clone());
                    s
                }
            };
            sockets.push(socket);
        }
        drop(open);
        Ok(Self {
            sockets,
            args: args.clone(),
            max_kept: max_kept(args),
            stats: stats.clone(),
            _files: files,
        })
    }

    /// The client's socket, tlsplane's end of the socketpair, and the program's end until
    /// its frame is written; on the kernel plane, room for a kept duplicate too (at most
    /// --handoff-max-kept's default, a quarter of the open-files limit, of them).
    fn descriptors_per_connection(_args: &HandoffArgs, kernel_plane: bool) -> usize {
        if kernel_plane {
            4
        } else {
            3
        }
    }

    const HANDS_OFF_SOCKETS: bool = true;

    fn counters(h: &HandoffStats, r: &RuntimeStats) -> Vec<(&'static str, u64)> {
        let to_program = h.relay.bytes_to_backend_copied.load(Relaxed);
        let to_client = h.relay.bytes_to_client_copied.load(Relaxed);
        vec![
            ("handoff_connections", r.connections.load(Relaxed)),
            ("handoff_handshake_errors", r.handshake_errors.load(Relaxed)),
            (
                "handoff_handshake_timeouts",
                r.handshake_timeouts.load(Relaxed),
            ),
            ("handoff_established", h.established.load(Relaxed)),
            ("handoff_user_plane", h.handed_off_user.load(Relaxed)),
            ("handoff_kernel_plane", h.handed_off_kernel.load(Relaxed)),
            (
                "handoff_refused_no_receiver",
                h.refused_no_receiver.load(Relaxed),
            ),
            (
                "handoff_refused_queue_full",
                h.refused_queue_full.load(Relaxed),
            ),
            ("handoff_failed", h.failed.load(Relaxed)),
            (
                "handoff_receivers_accepted",
                h.receivers_accepted.load(Relaxed),
            ),
            (
                "handoff_receivers_refused",
                h.receivers_refused.load(Relaxed),
            ),
            ("handoff_receivers_lost", h.receivers_lost.load(Relaxed)),
            (
                "handoff_receivers_revoked",
                h.receivers_revoked.load(Relaxed),
            ),
            (
                "handoff_receivers_reply_overflow",
                h.receivers_reply_overflow.load(Relaxed),
            ),
            (
                "handoff_receivers_over_limit",
                h.receivers_over_limit.load(Relaxed),
            ),
            (
                "handoff_receivers_protocol_errors",
                h.receivers_protocol_errors.load(Relaxed),
            ),
            (
                "handoff_receivers_ends_with_close",
                h.receivers_ends_with_close.load(Relaxed),
            ),
            (
                "handoff_relay_reset_receiver_gone",
                h.relay_reset_receiver_gone.load(Relaxed),
            ),
            ("handoff_requests", h.requests.load(Relaxed)),
            ("handoff_client_errors", h.client_errors.load(Relaxed)),
            ("handoff_program_errors", h.program_errors.load(Relaxed)),
            ("handoff_idle_timeouts", h.idle_timeouts.load(Relaxed)),
            ("handoff_kernel_relayed", h.kernel_relayed.load(Relaxed)),
            (
                "handoff_kernel_relayed_kept_full",
                h.kernel_relayed_kept_full.load(Relaxed),
            ),
            (
                "handoff_kernel_key_updates",
                h.kernel.key_updates.load(Relaxed),
            ),
            (
                "handoff_kernel_key_update_failures",
                h.kernel.key_update_failures.load(Relaxed),
            ),
            ("handoff_kernel_closes", h.kernel.closes.load(Relaxed)),
            (
                "handoff_kernel_close_notify_timeouts",
                h.kernel.close_notify_timeouts.load(Relaxed),
            ),
            (
                "handoff_kernel_key_update_waits",
                h.kernel.key_update_waits.load(Relaxed),
            ),
            (
                "handoff_kernel_key_update_timeouts",
                h.kernel.key_update_timeouts.load(Relaxed),
            ),
            (
                "handoff_kernel_released_peer_end",
                h.kernel.released_peer_end.load(Relaxed),
            ),
            (
                "handoff_kernel_released_receiver_gone",
                h.kernel.released_receiver_gone.load(Relaxed),
            ),
            (
                "handoff_kernel_released_receiver_left",
                h.kernel.released_receiver_left.load(Relaxed),
            ),
            ("handoff_relayed_bytes", to_program + to_client),
            ("handoff_relayed_bytes_to_program", to_program),
            ("handoff_relayed_bytes_to_client", to_client),
        ]
    }

    fn gauges(h: &HandoffStats) -> Vec<(&'static str, &'static str, i64)> {
        vec![(
            "handoff_kernel_kept",
            "Kernel-plane connections handed off whose socket duplicate and keys tlsplane keeps",
            h.kernel.kept.load(Relaxed) as i64,
        )]
    }

    fn describe(_args: &HandoffArgs, sites: &Sites) {
        for s in &sites.serve {
            if let Origin::Handoff(t) = &s.origin {
                tracing::info!(
                    "handoff: site {} to receivers on {} (uids {:?}, gids {:?})",
                    s.label,
                    t.socket.display(),
                    t.uids,
                    t.gids
                );
            }
        }
    }
}

impl Handler for Handoff {
    type Parked = ();

    async fn serve(
        self: Arc<Self>,
        tls: TlsStream,
        peer: SocketAddr,
        phase: Phase<()>,
        _ctx: ConnContext,
    ) -> Served<()> {
        if let Phase::Handshake = phase {
            // Handing off and relaying are waits: off the handshake loop.
            return Served::Park(tls, ());
        }
        self.stats.established.fetch_add(1, Relaxed);
        self.hand_off(tls, peer).await;
        Served::Done
    }
}

impl Handoff {
    async fn hand_off(&self, mut tls: TlsStream, peer: SocketAddr) {
        let socket = &self.sockets[tls.info().site];
        let Some(receiver) = socket.pick() else {
            self.stats.refused_no_receiver.fetch_add(1, Relaxed);
            let _ = Box::pin(tls.close()).await;
            return;
        };
        if receiver.pending.load(Relaxed) >= socket.queue.load(Relaxed) {
            self.stats.refused_queue_full.fetch_add(1, Relaxed);
            let _ = Box::pin(tls.close()).await;
            return;
        }
        tls = if tls.plane() == PlaneKind::Kernel {
            match self.hand_off_kernel(tls, peer, &receiver, socket.queue.load(Relaxed)) {
                Some(tls) => tls,
                None => return,
            }
        } else {
            tls
        };
        let (ours, theirs) = match UnixStream::pair() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "hand-off: no socketpair");
                self.stats.failed.fetch_add(1, Relaxed);
                let _ = Box::pin(tls.close()).await;
                return;
            }
        };
        let Some(hangups) = self.stats.hangups.get() else {
            self.stats.failed.fetch_add(1, Relaxed);
            let _ = Box::pin(tls.close()).await;
            return;
        };
        let info = self.conn_info(&tls, peer, Plane::UserRelay);
        let end = match hangups.watch_relay(receiver.id, info.conn_id, ours.as_fd()) {
            Ok(end) => end,
            Err(e) => {
                tracing::warn!(error = %e, "hand-off: the relay could not be watched");
                self.stats.failed.fetch_add(1, Relaxed);
                let _ = Box::pin(tls.close()).await;
                return;
            }
        };
        receiver.pending.fetch_add(1, Relaxed);
        let job = Job {
            fd: JobFd::Relay(OwnedFd::from(theirs)),
            info,
        };
        if let Err(why) = receiver.outbox.push_job(job, socket.queue.load(Relaxed)) {
            receiver.pending.fetch_sub(1, Relaxed);
            self.count_refusal(&why);
            let _ = Box::pin(tls.close()).await;
            return;
        }
        self.stats.handed_off_user.fetch_add(1, Relaxed);
        drop(receiver);
        let ours = ours
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(ours));
        let program = match ours {
            Ok(s) => BackendConn::unpooled(Io::Unix(s)),
            Err(e) => {
                tracing::warn!(error = %e, "hand-off: socketpair not registered");
                self.stats.failed.fetch_add(1, Relaxed);
                let _ = Box::pin(tls.close()).await;
                return;
            }
        };
        let ended = {
            // The program's end of stream is passed on as close_notify only if the program
            // ended the connection, rather than abandoned it (hangups.rs).
            let idle = Duration::from_secs(self.args.server.idle_timeout);
            let relay = crate::proxy::tcp::relay_ending(
                &mut tls,
                &program,
                None,
                self.args.buffer as usize,
                idle,
                &self.stats.relay,
                end.orderly(idle),
            );
            tokio::select! {
                ended = Box::pin(relay) => ended,
                // Its program died holding it, or tlsplane dropped its receiver: a reset.
                () = end.abandoned() => Ended::BackendError,
            }
        };
        match ended {
            Ended::ClientError => {
                self.stats.client_errors.fetch_add(1, Relaxed);
            }
            Ended::BackendError => {
                if end.is_abandoned() {
                    self.stats.relay_reset_receiver_gone.fetch_add(1, Relaxed);
                } else {
                    self.stats.program_errors.fetch_add(1, Relaxed);
                }
                // The program reset or went away: the client must not take the truncated
                // stream for a complete one.
                let _ = socket2::SockRef::from(tls.tcp()).set_linger(Some(Duration::ZERO));
            }
            Ended::IdleTimeout => {
                self.stats.idle_timeouts.fetch_add(1, Relaxed);
                let _ = Box::pin(tls.close()).await;
            }
            _ => {
                let _ = Box::pin(tls.close()).await;
            }
        }
    }

    fn count_refusal(&self, why: &NotQueued) {
        match why {
            NotQueued::Full => &self.stats.refused_queue_full,
            NotQueued::Gone => &self.stats.refused_no_receiver,
        }
        .fetch_add(1, Relaxed);
    }

    /// Hands a kernel-plane connection over as its kTLS socket, keeping a duplicate and the
    /// keys. `Some`: it cannot go bare (input already buffered, or no keeper): relay it.
    fn hand_off_kernel(
        &self,
        tls: TlsStream,
        peer: SocketAddr,
        receiver: &ReceiverHandle,
        queue: usize,
    ) -> Option<TlsStream> {
        let Some(keeper) = self.keeper() else {
            return Some(tls);
        };
        if self.stats.kernel.kept.load(Relaxed) >= self.max_kept {
            self.stats.kernel_relayed_kept_full.fetch_add(1, Relaxed);
            return Some(tls);
        }
        let info = self.conn_info(&tls, peer, Plane::Kernel);
        let handed = match tls.into_kernel_handoff() {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "hand-off: the socket could not leave its event loop");
                self.stats.failed.fetch_add(1, Relaxed);
                return None;
            }
            Err(tls) => {
                self.stats.kernel_relayed.fetch_add(1, Relaxed);
                return Some(*tls);
            }
        };
        let id = info.conn_id;
        // Blocking, as accept(2) gives it and as the relay's socketpair end is: the mode is
        // the program's from here on (the flag is shared with our duplicate, on which every
        // call of ours is non-blocking by its own flags).
        if let Err(e) = handed.socket.set_nonblocking(false) {
            tracing::warn!(error = %e, "hand-off: the socket's mode could not be set");
            self.stats.failed.fetch_add(1, Relaxed);
            return None;
        }
        let kept = match keeper.keep(id, receiver.id, handed.socket, handed.keys) {
            Ok(k) => k,
            Err(e) => {
                // The socket and keys are dropped: the client sees the connection close.
                tracing::warn!(error = %e, "hand-off: the socket could not be watched");
                self.stats.failed.fetch_add(1, Relaxed);
                return None;
            }
        };
        receiver.pending.fetch_add(1, Relaxed);
        let job = Job {
            fd: JobFd::Kernel(kept),
            info,
        };
        if let Err(why) = receiver.outbox.push_job(job, queue) {
            receiver.pending.fetch_sub(1, Relaxed);
            self.count_refusal(&why);
            keeper.not_handed(id);
            return None;
        }
        self.stats.handed_off_kernel.fetch_add(1, Relaxed);
        None
    }

    /// The process's keeper of kernel-plane hand-offs, started at the first.
    fn keeper(&self) -> Option<Arc<Keeper>> {
        self.stats
            .keeper
            .get_or_init(|| match Keeper::start(&self.stats.kernel) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(error = %e, "hand-off: no keeper for kernel-plane connections; they are relayed");
                    None
                }
            })
            .clone()
    }

    /// The CONNECTION header of `tls`.
    fn conn_info(&self, tls: &TlsStream, peer: SocketAddr, plane: Plane) -> ConnInfo {
        let i = tls.info();
        let base = *self.stats.id_base.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            let random = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            random & 0xffff_ffff_0000_0000
        });
        let mut info = ConnInfo {
            conn_id: base.wrapping_add(self.stats.next_id.fetch_add(1, Relaxed) + 1),
            plane,
            tls_version: u16::from(i.version),
            cipher_suite: u16::from(i.suite),
            peer: Some(peer),
            local: tls.tcp().local_addr().ok(),
            server_name: i.server_name.as_deref().map(str::to_string),
            alpn: i.alpn.clone(),
        };
        // A name the header cannot carry (not printable ASCII) is left out rather than
        // failing the hand-off.
        if Message::Connection(info.clone()).encoded_len().is_err() {
            info.server_name = None;
        }
        info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket_with(pending: &[usize]) -> HandoffSocket {
        let list = pending
            .iter()
            .enumerate()
            .map(|(id, &p)| receiver(id as u64, UnixStream::pair().unwrap().0, p, Weak::new()))
            .collect();
        HandoffSocket {
            path: PathBuf::from("/nonexistent"),
            allowed: Mutex::new(Allowed::default()),
            queue: AtomicUsize::new(4),
            reply_queue: Arc::new(AtomicUsize::new(4)),
            max_receivers: AtomicUsize::new(4),
            receivers: Mutex::new(list),
            turn: AtomicUsize::new(0),
            refusals: Mutex::new(Throttled::default()),
        }
    }

    fn receiver(
        id: u64,
        sock: UnixStream,
        pending: usize,
        stats: Weak<HandoffStats>,
    ) -> Arc<ReceiverHandle> {
        Arc::new_cyclic(|me| ReceiverHandle {
            id,
            me: me.clone(),
            peer: Peer::default(),
            program: Arc::new(Program::of(sock.as_fd(), std::process::id())),
            sock,
            pending: AtomicUsize::new(pending),
            outbox: Outbox::default(),
            inbound: Mutex::default(),
            ends_with_close: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
            socket: Weak::new(),
            stats,
        })
    }

    #[test]
    fn the_least_pending_receiver_is_picked() {
        let socket = socket_with(&[3, 1, 2]);
        for _ in 0..5 {
            assert_eq!(socket.pick().unwrap().id, 1);
        }
    }

    #[test]
    fn ties_are_taken_in_turn() {
        let socket = socket_with(&[0, 0, 0]);
        let ids: Vec<u64> = (0..6).map(|_| socket.pick().unwrap().id).collect();
        assert_eq!(ids, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn no_receiver_no_pick() {
        assert!(socket_with(&[]).pick().is_none());
    }

    #[test]
    fn allowed_by_uid_or_any_group() {
        let a = Allowed {
            uids: vec![1000],
            gids: vec![50],
        };
        let peer = |uid, gid, groups: &[u32]| Peer {
            pid: 1,
            uid,
            gid,
            groups: groups.to_vec(),
        };
        assert!(a.allows(&peer(1000, 1, &[])));
        assert!(a.allows(&peer(7, 50, &[])));
        assert!(a.allows(&peer(7, 8, &[9, 50])));
        assert!(!a.allows(&peer(0, 0, &[1, 2])));
        assert!(!Allowed::default().allows(&peer(0, 0, &[0])));
    }

    #[test]
    fn replies_never_wait_and_are_bounded() {
        let outbox = Outbox::default();
        let reply = |n| Reply {
            request_id: n,
            conn_id: 1,
            status: Status::Ok,
        };
        assert!(outbox.push_reply(reply(1), 2).is_ok());
        assert!(outbox.push_reply(reply(2), 2).is_ok());
        assert!(
            matches!(outbox.push_reply(reply(3), 2), Err(NotQueued::Full)),
            "over the bound"
        );
        assert!(matches!(outbox.next(), Some(Frame::Reply(r)) if r.request_id == 1));
        assert!(outbox.push_reply(reply(3), 2).is_ok());
        drop(outbox.close());
        assert!(outbox.next().is_none());
        // Closed is not full: the receiver is not to be taken for one that reads nothing.
        assert!(matches!(
            outbox.push_reply(reply(4), 2),
            Err(NotQueued::Gone)
        ));
    }
}
