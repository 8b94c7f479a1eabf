//! `tlsplane handoff`: established TLS connections handed to other programs (issue 21).
//!
//! Listeners, handshakes, sites, keys and reload are the shared server's (`crate::server`).
//! Each site names a Unix socket that tlsplane listens on; programs ("receivers") connect to
//! it, are checked by `SO_PEERCRED` against the site's allowed user and group ids, and
//! receive each established connection as a CONNECTION frame with a descriptor
//! (`SCM_RIGHTS`, docs/HANDOFF.md).
//!
//! This build hands every connection off on the **user relay** plane: the program gets one
//! end of a `socketpair(AF_UNIX, SOCK_STREAM)` and tlsplane relays between the other end and
//! the TLS stream with the proxy's TCP-mode relay (half-closes kept: the program's
//! `shutdown(SHUT_WR)` or close becomes close_notify, the client's close_notify becomes EOF
//! on the program's end). A kernel-plane connection is relayed the same way (the kernel
//! plane's own hand-off, the kTLS socket itself, is not built yet).
//!
//! Per socket, one thread accepts receivers; per receiver, one thread writes its CONNECTION
//! frames (blocking writes, off the event loops: a connection loop only queues a hand-off,
//! with a bounded queue) and one reads its requests and notices its end. When a receiver
//! goes away, the relays of the connections it was given end: their clients get close_notify.

mod keeper;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::mpsc::{sync_channel, Receiver as JobQueue, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tlsplane::stats::Counter;
use tlsplane::{PlaneKind, TlsStream};
use tlsplane_handoff::{ConnInfo, Message, Plane, Reply, Status};

use crate::proxy::backend::{BackendConn, Io};
use crate::proxy::{Ended, ProxyStats};
use keeper::{Keeper, KeptSocket, KeptStats};
use tlsplane_server::config::{HandoffTarget, Origin, SiteNeeds, Sites};
use tlsplane_server::runtime::{ConnContext, Handler, Phase, RuntimeStats, Served};
use tlsplane_server::server::{Product, ServerArgs};

#[derive(Args, Debug, Clone)]
pub struct HandoffArgs {
    /// Unix socket that receivers connect to, to be handed the established connections (see
    /// docs/HANDOFF.md). With --config, sites name their own (`handoff-socket = "PATH"`) and
    /// this serves the sites that do not. Receivers get connections least pending first
    /// (the one with the fewest hand-offs queued and not yet written to it; ties in turn).
    #[arg(long, value_name = "PATH")]
    pub handoff_socket: Option<PathBuf>,
    /// User id allowed to receive connections (repeatable; checked with SO_PEERCRED when a
    /// receiver connects: any other is closed at once and gets nothing). With neither this nor
    /// --handoff-allow-gid: only the user tlsplane runs as (--user, else its own).
    #[arg(long = "handoff-allow-uid", value_name = "UID")]
    pub handoff_allow_uid: Vec<u32>,
    /// Group id allowed to receive connections (repeatable; a receiver whose primary group is
    /// one of these is allowed).
    #[arg(long = "handoff-allow-gid", value_name = "GID")]
    pub handoff_allow_gid: Vec<u32>,
    /// Hand-offs queued per receiver and not yet written to it. When the least pending
    /// receiver has this many, the connection is refused (closed with close_notify, counted).
    #[arg(long, default_value_t = 64, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub handoff_queue: u32,
    /// Bytes buffered per direction per relayed connection. (A relayed connection with no
    /// byte moving either way for --idle-timeout is closed, as in proxy.)
    #[arg(long, default_value_t = 16384, value_name = "BYTES", value_parser = clap::value_parser!(u32).range(1024..=1048576))]
    pub buffer: u32,
    #[command(flatten)]
    pub server: ServerArgs,
}

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
        socket: args.handoff_socket.clone().unwrap_or_default(),
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
    fn allows(&self, uid: u32, gid: u32) -> bool {
        self.uids.contains(&uid) || self.gids.contains(&gid)
    }
}

/// A hand-off socket and the receivers connected to it.
struct HandoffSocket {
    path: PathBuf,
    /// Replaced by a reload.
    allowed: Mutex<Allowed>,
    /// --handoff-queue, replaced by a reload.
    queue: AtomicUsize,
    receivers: Mutex<Vec<Arc<ReceiverHandle>>>,
    /// Where the next tie among least pending receivers starts.
    turn: AtomicUsize,
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

/// A connected receiver, as the connection loops see it.
struct ReceiverHandle {
    id: u64,
    /// Hand-offs queued and not yet written to it.
    pending: Arc<AtomicUsize>,
    jobs: SyncSender<Job>,
    /// Turns true (or its sender is dropped) when the receiver is gone: relays of the
    /// connections it was given end.
    gone: tokio::sync::watch::Receiver<bool>,
}

impl HandoffSocket {
    /// Binds `path` (a stale socket left by a killed server is replaced) and starts
    /// accepting receivers.
    fn open(
        path: &Path,
        allowed: Allowed,
        queue: usize,
        stats: &Arc<HandoffStats>,
    ) -> anyhow::Result<Arc<Self>> {
        free_unix_path(path)?;
        let listener = UnixListener::bind(path)
            .with_context(|| format!("hand-off socket {}", path.display()))?;
        // Anyone may connect: SO_PEERCRED decides who is served, and says so in the log.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .with_context(|| format!("hand-off socket {}: chmod", path.display()))?;
        let socket = Arc::new(Self {
            path: path.to_path_buf(),
            allowed: Mutex::new(allowed),
            queue: AtomicUsize::new(queue),
            receivers: Mutex::new(Vec::new()),
            turn: AtomicUsize::new(0),
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
            let ids = tlsplane_sys::peer_ids(sock.as_fd());
            let allowed = self
                .allowed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            match ids {
                Ok((uid, gid)) if allowed.allows(uid, gid) => {
                    stats.receivers_accepted.fetch_add(1, Relaxed);
                    // Logged once it can be given connections (tests wait for this line).
                    match self.add_receiver(sock, stats) {
                        Ok(()) => {
                            tracing::info!(socket = %self.path.display(), uid, gid, "hand-off receiver connected")
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "hand-off receiver: could not start it")
                        }
                    }
                }
                Ok((uid, gid)) => {
                    stats.receivers_refused.fetch_add(1, Relaxed);
                    tracing::warn!(socket = %self.path.display(), uid, gid, "hand-off receiver refused: uid/gid not allowed");
                    drop(sock);
                }
                Err(e) => {
                    stats.receivers_refused.fetch_add(1, Relaxed);
                    tracing::warn!(error = %e, "hand-off receiver refused: SO_PEERCRED failed");
                }
            }
        }
    }

    fn add_receiver(
        self: &Arc<Self>,
        sock: UnixStream,
        stats: &Arc<HandoffStats>,
    ) -> std::io::Result<()> {
        let id = stats.next_receiver.fetch_add(1, Relaxed);
        let queue = self.queue.load(Relaxed).max(1);
        let (jobs, queued) = sync_channel::<Job>(queue);
        let (gone_tx, gone) = tokio::sync::watch::channel(false);
        let pending = Arc::new(AtomicUsize::new(0));
        // Frames to the receiver go out whole: the writer's CONNECTION frames and the
        // reader's replies take turns under this lock.
        let writer = Arc::new(Mutex::new(()));
        let sock = Arc::new(sock);
        let handle = Arc::new(ReceiverHandle {
            id,
            pending: pending.clone(),
            jobs,
            gone,
        });
        self.receivers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle);
        let gone_tx = Arc::new(gone_tx);
        {
            let (socket, stats, sock, writer, gone_tx) = (
                self.clone(),
                Arc::downgrade(stats),
                sock.clone(),
                writer.clone(),
                gone_tx.clone(),
            );
            std::thread::Builder::new()
                .name("handoff-send".into())
                .spawn(move || {
                    write_loop(&sock, &writer, queued, &pending);
                    socket.lose(id, &stats, &sock, &gone_tx);
                })?;
        }
        let (socket, stats) = (self.clone(), Arc::downgrade(stats));
        std::thread::Builder::new()
            .name("handoff-recv".into())
            .spawn(move || {
                read_loop(id, &sock, &writer, &stats);
                socket.lose(id, &stats, &sock, &gone_tx);
            })?;
        Ok(())
    }

    /// Forgets receiver `id` (once, from whichever of its threads sees it go first): its
    /// queued hand-offs are dropped (their relays see the program's end close), its socket is
    /// shut down (the other thread wakes), and the relays it was given end.
    fn lose(
        &self,
        id: u64,
        stats: &Weak<HandoffStats>,
        sock: &UnixStream,
        gone: &tokio::sync::watch::Sender<bool>,
    ) {
        let removed = {
            let mut list = self.receivers.lock().unwrap_or_else(|e| e.into_inner());
            let before = list.len();
            list.retain(|r| r.id != id);
            before != list.len()
        };
        // Not under the write lock: a write blocked on a receiver that stopped reading holds
        // it, and this shutdown is what wakes it (EPIPE).
        let _ = sock.shutdown(std::net::Shutdown::Both);
        gone.send_replace(true);
        if let (true, Some(stats)) = (removed, stats.upgrade()) {
            stats.receivers_lost.fetch_add(1, Relaxed);
            // Its kernel-plane connections end too (its queue is gone: nothing more is
            // handed to it).
            if let Some(Some(keeper)) = stats.keeper.get() {
                keeper.receiver_gone(id);
            }
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

/// Writes the receiver's CONNECTION frames until its queue closes or a write fails.
fn write_loop(sock: &UnixStream, writer: &Mutex<()>, queued: JobQueue<Job>, pending: &AtomicUsize) {
    for job in queued {
        let sent = {
            let _turn = writer.lock().unwrap_or_else(|e| e.into_inner());
            tlsplane_handoff::send_connection(sock, job.fd.as_fd(), &job.info)
        };
        pending.fetch_sub(1, Relaxed);
        // Our copy of the program's end of a relay goes: the program holds the only one now
        // (a kernel-plane socket stays kept).
        drop(job.fd);
        if let Err(e) = sent {
            tracing::debug!(error = %e, "hand-off: writing to a receiver failed");
            return;
        }
    }
}

/// Reads the receiver's requests until it closes its connection (or breaks the framing).
fn read_loop(receiver: u64, reader: &UnixStream, writer: &Mutex<()>, stats: &Weak<HandoffStats>) {
    let mut frame = Vec::new();
    loop {
        let (_prefix, fd) = match tlsplane_handoff::read_frame(reader, &mut frame) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "hand-off receiver: unreadable request");
                return;
            }
        };
        // No request carries a descriptor.
        drop(fd);
        let Some(stats) = stats.upgrade() else {
            return;
        };
        // Connections on the user relay are not kept: re-keyed by tlsplane's record layer,
        // ended by shutting down the program's end, they are unknown to requests.
        let keeper = stats.keeper.get().cloned().flatten();
        let (request_id, conn_id, status) = match Message::decode(&frame) {
            Ok(Some(Message::KeyUpdate {
                request_id,
                conn_id,
                record_plaintext,
            })) => (
                request_id,
                conn_id,
                keeper.map_or(Status::UnknownConnection, |k| {
                    k.key_update(receiver, conn_id, record_plaintext)
                }),
            ),
            Ok(Some(Message::Close {
                request_id,
                conn_id,
            })) => (
                request_id,
                conn_id,
                keeper.map_or(Status::UnknownConnection, |k| k.close(receiver, conn_id)),
            ),
            // Kinds a receiver does not send, or a later revision's: skipped.
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!(error = %e, "hand-off receiver: bad request");
                continue;
            }
        };
        stats.requests.fetch_add(1, Relaxed);
        drop(stats);
        let reply = Reply {
            request_id,
            conn_id,
            status,
        };
        let _turn = writer.lock().unwrap_or_else(|e| e.into_inner());
        if tlsplane_handoff::send_reply(reader, &reply).is_err() {
            return;
        }
    }
}

/// Refuses a path that is not a socket or that a live server listens on; removes a stale one.
fn free_unix_path(p: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(p) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        anyhow::bail!(
            "hand-off socket: {} exists and is not a socket; remove it or choose another path",
            p.display()
        );
    }
    if UnixStream::connect(p).is_ok() {
        anyhow::bail!(
            "hand-off socket: something already listens on {}",
            p.display()
        );
    }
    std::fs::remove_file(p)
        .with_context(|| format!("hand-off socket: cannot remove the stale {}", p.display()))
}

/// The `handoff` product under one configuration.
pub struct Handoff {
    /// By site number.
    sockets: Vec<Arc<HandoffSocket>>,
    args: HandoffArgs,
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

    fn check_args(args: &HandoffArgs, with_config: bool) -> anyhow::Result<()> {
        if args.handoff_socket.is_none() && !with_config {
            anyhow::bail!("no hand-off socket: give --handoff-socket PATH, or --config");
        }
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
        let queue = args.handoff_queue as usize;
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
                    *s.allowed.lock().unwrap_or_else(|e| e.into_inner()) = allowed;
                    s.queue.store(queue, Relaxed);
                    s.clone()
                }
                None => {
                    let s = HandoffSocket::open(&path, allowed, queue, stats)?;
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
            stats: stats.clone(),
            _files: files,
        })
    }

    /// The client's socket, tlsplane's end of the socketpair, and the program's end until
    /// its frame is written.
    fn descriptors_per_connection(_args: &HandoffArgs, _kernel_plane: bool) -> usize {
        3
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
            ("handoff_requests", h.requests.load(Relaxed)),
            ("handoff_client_errors", h.client_errors.load(Relaxed)),
            ("handoff_program_errors", h.program_errors.load(Relaxed)),
            ("handoff_idle_timeouts", h.idle_timeouts.load(Relaxed)),
            ("handoff_kernel_relayed", h.kernel_relayed.load(Relaxed)),
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
                "handoff_kernel_released_peer_end",
                h.kernel.released_peer_end.load(Relaxed),
            ),
            (
                "handoff_kernel_released_receiver_gone",
                h.kernel.released_receiver_gone.load(Relaxed),
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
            match self.hand_off_kernel(tls, peer, &receiver) {
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
        let info = self.conn_info(&tls, peer, Plane::UserRelay);
        receiver.pending.fetch_add(1, Relaxed);
        match receiver.jobs.try_send(Job {
            fd: JobFd::Relay(OwnedFd::from(theirs)),
            info,
        }) {
            Ok(()) => {}
            Err(e) => {
                receiver.pending.fetch_sub(1, Relaxed);
                match e {
                    TrySendError::Full(_) => &self.stats.refused_queue_full,
                    TrySendError::Disconnected(_) => &self.stats.refused_no_receiver,
                }
                .fetch_add(1, Relaxed);
                let _ = Box::pin(tls.close()).await;
                return;
            }
        }
        self.stats.handed_off_user.fetch_add(1, Relaxed);
        let mut gone = receiver.gone.clone();
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
            let mut relay = Box::pin(crate::proxy::tcp::relay(
                &mut tls,
                &program,
                None,
                self.args.buffer as usize,
                Duration::from_secs(self.args.server.idle_timeout),
                &self.stats.relay,
            ));
            let receiver_gone = async {
                // (The guard `wait_for` returns is not Send: dropped here.)
                let _ = gone.wait_for(|gone| *gone).await.is_ok();
            };
            tokio::select! {
                ended = &mut relay => ended,
                () = receiver_gone => {
                    // The receiver died: its connections end. The relay reads EOF from the
                    // program's end and sends the client close_notify.
                    let _ = program.shutdown_both();
                    relay.await
                }
            }
        };
        match ended {
            Ended::ClientError => {
                self.stats.client_errors.fetch_add(1, Relaxed);
            }
            Ended::BackendError => {
                self.stats.program_errors.fetch_add(1, Relaxed);
                // The program reset: the client must not take the truncated stream for a
                // complete one.
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

    /// Hands a kernel-plane connection over as its kTLS socket, keeping a duplicate and the
    /// keys. `Some`: it cannot go bare (input already buffered, or no keeper): relay it.
    fn hand_off_kernel(
        &self,
        tls: TlsStream,
        peer: SocketAddr,
        receiver: &ReceiverHandle,
    ) -> Option<TlsStream> {
        let Some(keeper) = self.keeper() else {
            return Some(tls);
        };
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
        if let Err(e) = receiver.jobs.try_send(Job {
            fd: JobFd::Kernel(kept),
            info,
        }) {
            receiver.pending.fetch_sub(1, Relaxed);
            match e {
                TrySendError::Full(_) => &self.stats.refused_queue_full,
                TrySendError::Disconnected(_) => &self.stats.refused_no_receiver,
            }
            .fetch_add(1, Relaxed);
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

    fn socket_with(pending: &[usize]) -> (HandoffSocket, Vec<JobQueue<Job>>) {
        let mut queues = Vec::new();
        let mut list = Vec::new();
        for (id, &p) in pending.iter().enumerate() {
            let (jobs, queued) = sync_channel(4);
            let (_gone_tx, gone) = tokio::sync::watch::channel(false);
            queues.push(queued);
            list.push(Arc::new(ReceiverHandle {
                id: id as u64,
                pending: Arc::new(AtomicUsize::new(p)),
                jobs,
                gone,
            }));
        }
        let socket = HandoffSocket {
            path: PathBuf::from("/nonexistent"),
            allowed: Mutex::new(Allowed::default()),
            queue: AtomicUsize::new(4),
            receivers: Mutex::new(list),
            turn: AtomicUsize::new(0),
        };
        (socket, queues)
    }

    #[test]
    fn the_least_pending_receiver_is_picked() {
        let (socket, _q) = socket_with(&[3, 1, 2]);
        for _ in 0..5 {
            assert_eq!(socket.pick().unwrap().id, 1);
        }
    }

    #[test]
    fn ties_are_taken_in_turn() {
        let (socket, _q) = socket_with(&[0, 0, 0]);
        let ids: Vec<u64> = (0..6).map(|_| socket.pick().unwrap().id).collect();
        assert_eq!(ids, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn no_receiver_no_pick() {
        let (socket, _q) = socket_with(&[]);
        assert!(socket.pick().is_none());
    }

    #[test]
    fn allowed_by_uid_or_gid() {
        let a = Allowed {
            uids: vec![1000],
            gids: vec![50],
        };
        assert!(a.allows(1000, 1));
        assert!(a.allows(7, 50));
        assert!(!a.allows(0, 0));
        assert!(!Allowed::default().allows(0, 0));
    }
}
