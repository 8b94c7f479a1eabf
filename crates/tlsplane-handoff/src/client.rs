//! Blocking I/O over the wire protocol: the receiver ([`HandoffClient`]) and the sender-side
//! helpers the runtime calls ([`send_connection`], [`send_reply`], [`read_frame`]).

use std::collections::{HashSet, VecDeque};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use crate::trust::ServerUids;
use crate::wire::{
    self, classify_record, ConnInfo, Message, Plane, Prefix, RecordAction, Reply, Status,
};

/// How many received connections a [`HandoffClient`] queues for `accept` by default.
pub const DEFAULT_QUEUE_LIMIT: usize = 64;

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// `send(2)` with `MSG_NOSIGNAL`: a program linked with the C library keeps the default
/// `SIGPIPE` disposition, and tlsplane going away must be `EPIPE`, not a killed program.
fn send_all(sock: &UnixStream, mut bytes: &[u8]) -> io::Result<()> {
    let s = socket2::SockRef::from(sock);
    while !bytes.is_empty() {
        match s.send_with_flags(bytes, libc::MSG_NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Sends one connection: its CONNECTION frame with `fd` attached. The caller's `fd` stays
/// open (the receiver gets its own copy, sharing the open file description: `O_NONBLOCK` is
/// one flag for both). Blocks until the frame is queued: for a blocking socket. On a
/// non-blocking one, `WouldBlock` may come after part of the frame went out; an event loop
/// encodes with [`Message::encode`] and sends with `tlsplane_sys::send_with_fd`, keeping the
/// unsent tail for later.
pub fn send_connection(sock: &UnixStream, fd: BorrowedFd<'_>, info: &ConnInfo) -> io::Result<()> {
    let mut buf = [0u8; 1024];
    let n = Message::Connection(info.clone())
        .encode(&mut buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let sent = loop {
        match tlsplane_sys::send_with_fd(sock.as_fd(), &buf[..n], fd) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    send_all(sock, &buf[sent..n])
}

/// Sends one REPLY frame.
pub fn send_reply(sock: &UnixStream, reply: &Reply) -> io::Result<()> {
    let mut buf = [0u8; 32];
    let n = Message::Reply(*reply).encode(&mut buf).map_err(invalid)?;
    send_all(sock, &buf[..n])
}

/// Reads exactly `buf.len()` bytes, collecting at most one descriptor on the way (a second
/// one, anywhere, closes both and fails). `Ok(false)`: end of stream before the first byte.
fn read_exact_fd(sock: &UnixStream, buf: &mut [u8], fd: &mut Option<OwnedFd>) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let (n, new_fd) = match tlsplane_sys::recv_with_fd(sock.as_fd(), &mut buf[got..]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => r?,
        };
        if let Some(new_fd) = new_fd {
            if fd.is_some() {
                *fd = None;
                drop(new_fd);
                return Err(invalid("two descriptors in one hand-off frame"));
            }
            *fd = Some(new_fd);
        }
        if n == 0 {
            if got == 0 && fd.is_none() {
                return Ok(false);
            }
            *fd = None;
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "hand-off connection closed inside a frame",
            ));
        }
        got += n;
    }
    Ok(true)
}

/// Reads one whole frame into `frame` (resized to it) with the descriptor that came with it.
/// `Ok(None)`: the peer closed the connection between frames. An error means the stream can no
/// longer be framed (bad magic, version or length; end of stream or a second descriptor inside
/// a frame): close the connection. The frame's body is not checked here: see
/// [`Message::decode`].
pub fn read_frame(
    sock: &UnixStream,
    frame: &mut Vec<u8>,
) -> io::Result<Option<(Prefix, Option<OwnedFd>)>> {
    let mut fd = None;
    frame.clear();
    frame.resize(wire::PREFIX_LEN, 0);
    if !read_exact_fd(sock, frame, &mut fd)? {
        return Ok(None);
    }
    let prefix = Prefix::decode(frame).map_err(invalid)?; // drops `fd` on error
    frame.resize(prefix.len, 0);
    read_exact_fd(sock, &mut frame[wire::PREFIX_LEN..], &mut fd)?;
    Ok(Some((prefix, fd)))
}

/// One connection received from tlsplane: its descriptor ([`AsFd`]) and header (`info`).
///
/// Its end is the library's: [`HandoffClient::close`] ends it, and so does dropping it, which
/// first sends tlsplane a CLOSE for it (without waiting: if the hand-off connection has no
/// room at that moment, or its client was dropped, none is sent). tlsplane resets a
/// connection whose descriptor ends without a CLOSE, taking it for abandoned; so a
/// descriptor taken out of the connection ([`into_parts`](Self::into_parts),
/// `into_tcp_stream`) and closed directly ends it with a reset.
/// [`HandoffClient::adopt`] gives it back to the library.
#[derive(Debug)]
pub struct Connection {
    // Dropped first (fields drop in declaration order): the CLOSE is queued on the hand-off
    // connection before the descriptor goes. `fd` is private so that it cannot be moved out
    // with `end` left armed, which would send the CLOSE while the descriptor lives on.
    end: Ending,
    fd: OwnedFd,
    pub info: ConnInfo,
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl std::os::fd::AsRawFd for Connection {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.fd)
    }
}

impl Connection {
    /// The descriptor as a `TcpStream`, on the planes where it is the TCP socket (kernel and
    /// raw TCP); on the user-relay plane (a socketpair end) the connection is given back.
    /// A `TcpStream`'s `Read` is a plain read: on the kernel plane, control records then
    /// fail it with `EIO`; use [`HandoffClient::read`] to have them handled. The library
    /// no longer ends it: see [`Connection`].
    pub fn into_tcp_stream(self) -> Result<(std::net::TcpStream, ConnInfo), Box<Self>> {
        match self.info.plane {
            Plane::Kernel | Plane::RawTcp => {
                let (fd, info) = self.into_parts();
                Ok((fd.into(), info))
            }
            Plane::UserRelay => Err(Box::new(self)),
        }
    }

    /// The descriptor as a `UnixStream`, on the user-relay plane; otherwise given back. The
    /// library no longer ends it: see [`Connection`].
    pub fn into_unix_stream(self) -> Result<(UnixStream, ConnInfo), Box<Self>> {
        match self.info.plane {
            Plane::UserRelay => {
                let (fd, info) = self.into_parts();
                Ok((fd.into(), info))
            }
            _ => Err(Box::new(self)),
        }
    }

    /// The descriptor and its header, the library's part in its end given up: closing the
    /// descriptor then abandons the connection (see [`Connection`]).
    pub fn into_parts(mut self) -> (OwnedFd, ConnInfo) {
        self.end.conn_id = None;
        (self.fd, self.info)
    }
}

/// Sends a connection's CLOSE when dropped, unless its end was already seen to.
#[derive(Debug)]
struct Ending {
    requests: Weak<Requests>,
    /// None: nothing to send (raw TCP, or already ended).
    conn_id: Option<u64>,
}

impl Drop for Ending {
    fn drop(&mut self) {
        if let (Some(conn_id), Some(requests)) = (self.conn_id, self.requests.upgrade()) {
            requests.send_close(conn_id, libc::MSG_DONTWAIT);
        }
    }
}

/// The sending half of the hand-off connection, which a [`Connection`] keeps a weak
/// reference to: a connection outliving its client sends nothing.
#[derive(Debug)]
struct Requests {
    sock: UnixStream,
    send_lock: Mutex<()>,
    next_request: AtomicU32,
}

impl Requests {
    fn request_id(&self) -> u32 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends one whole frame: requests of several threads never interleave.
    fn send(&self, frame: &[u8], flags: libc::c_int) -> io::Result<()> {
        let _g = self.send_lock.lock().unwrap_or_else(|p| p.into_inner());
        if flags & libc::MSG_DONTWAIT == 0 {
            return send_all(&self.sock, frame);
        }
        // A frame this small is queued whole or not at all on a Unix stream socket.
        match socket2::SockRef::from(&self.sock).send_with_flags(frame, flags | libc::MSG_NOSIGNAL)
        {
            Ok(n) if n == frame.len() => Ok(()),
            Ok(_) => Err(io::ErrorKind::WriteZero.into()),
            Err(e) => Err(e),
        }
    }

    /// A CLOSE whose reply nobody waits for (the reader drops replies not asked for).
    fn send_close(&self, conn_id: u64, flags: libc::c_int) -> bool {
        let msg = Message::Close {
            request_id: self.request_id(),
            conn_id,
        };
        let mut buf = [0u8; 32];
        match msg.encode(&mut buf) {
            Ok(n) => self.send(&buf[..n], flags).is_ok(),
            Err(_) => false,
        }
    }
}

#[derive(Default)]
struct Shared {
    /// A thread is blocked reading the socket for everyone.
    reading: bool,
    conns: VecDeque<Result<Connection, wire::Error>>,
    /// Requests sent and not yet answered; replies to anything else are dropped.
    pending: HashSet<u32>,
    replies: Vec<Reply>,
    /// Set once the stream is unusable; every later call fails with it.
    broken: Option<(io::ErrorKind, String)>,
}

/// A program's connection to tlsplane's hand-off socket: receives connections, and asks
/// tlsplane to re-key or close them.
///
/// Blocking, and safe to share between threads: one thread at a time reads the socket for all
/// the others, queueing connections for [`accept`](Self::accept) and replies for the request
/// that waits on them, so a thread blocked in `accept` does not hold up another's KeyUpdate.
///
/// Connections queue only while a request waits for its reply and no thread accepts; past
/// the queue's limit ([`DEFAULT_QUEUE_LIMIT`], [`with_queue_limit`](Self::with_queue_limit))
/// a connection is ended at once (close_notify to its client, by tlsplane on the kernel
/// plane) and counted in [`connections_dropped`](Self::connections_dropped), so that a
/// flood of connections cannot take the program's memory and descriptors.
pub struct HandoffClient {
    requests: Arc<Requests>,
    shared: Mutex<Shared>,
    turn: Condvar,
    queue_limit: usize,
    dropped: AtomicU64,
}

impl HandoffClient {
    /// Connects to tlsplane's hand-off socket at `path`, trusting the user ids
    /// [`ServerUids::from_env`] names (`TLSPLANE_HANDOFF_UID`, by default this process's
    /// own, and root). Another process listening there is refused (`PermissionDenied`).
    pub fn connect(path: impl AsRef<Path>) -> io::Result<Self> {
        Self::connect_trusting(path, &ServerUids::from_env()?)
    }

    /// Connects to tlsplane's hand-off socket at `path`, refusing (`PermissionDenied`) a
    /// listening process whose user id `server` does not trust.
    pub fn connect_trusting(path: impl AsRef<Path>, server: &ServerUids) -> io::Result<Self> {
        let path = path.as_ref();
        let sock = UnixStream::connect(path)?;
        server.check(&sock, path)?;
        Ok(Self::from_stream(sock))
    }

    /// Uses an already connected (blocking) stream. Its peer is not checked: the caller
    /// vouches for it (see [`ServerUids::check`]). Sends the HELLO first: this client ends
    /// every connection it hands out with a CLOSE ([`wire::ENDS_WITH_CLOSE`]). If that send
    /// fails, so does every later call.
    pub fn from_stream(sock: UnixStream) -> Self {
        let client = Self {
            requests: Arc::new(Requests {
                sock,
                send_lock: Mutex::new(()),
                next_request: AtomicU32::new(1),
            }),
            shared: Mutex::default(),
            turn: Condvar::new(),
            queue_limit: DEFAULT_QUEUE_LIMIT,
            dropped: AtomicU64::new(0),
        };
        let mut hello = [0u8; 16];
        let sent = Message::Hello {
            flags: wire::ENDS_WITH_CLOSE,
        }
        .encode(&mut hello)
        .map_err(invalid)
        .and_then(|n| client.requests.send(&hello[..n], 0));
        if let Err(e) = sent {
            client.lock().broken = Some((e.kind(), e.to_string()));
        }
        client
    }

    /// Gives the library back a connection's descriptor and header (from
    /// [`Connection::into_parts`], or kept apart as the C library does): the connection it
    /// returns is ended as any other.
    pub fn adopt(&self, fd: OwnedFd, info: ConnInfo) -> Connection {
        Connection {
            end: self.ending(&info),
            fd,
            info,
        }
    }

    fn ending(&self, info: &ConnInfo) -> Ending {
        Ending {
            requests: Arc::downgrade(&self.requests),
            conn_id: (info.plane != Plane::RawTcp).then_some(info.conn_id),
        }
    }

    /// Queues at most `limit` (at least 1) received connections for `accept`.
    pub fn with_queue_limit(mut self, limit: usize) -> Self {
        self.queue_limit = limit.max(1);
        self
    }

    /// Connections ended on arrival because the queue was full.
    pub fn connections_dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn socket(&self) -> &UnixStream {
        &self.requests.sock
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `take` finds what the caller wants, reading frames (for everyone) while no
    /// other thread does.
    fn wait_for<T>(&self, mut take: impl FnMut(&mut Shared) -> Option<T>) -> io::Result<T> {
        let mut g = self.lock();
        loop {
            if let Some(t) = take(&mut g) {
                return Ok(t);
            }
            if let Some((kind, msg)) = &g.broken {
                return Err(io::Error::new(*kind, msg.clone()));
            }
            if g.reading {
                g = self.turn.wait(g).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            g.reading = true;
            drop(g);
            let r = self.read_one();
            g = self.lock();
            g.reading = false;
            let full = g.conns.len() >= self.queue_limit;
            let mut refused = None;
            match r {
                Ok(Some(Ok(Incoming::Conn(c)))) if full => refused = Some(c),
                Ok(Some(Ok(Incoming::Conn(c)))) => g.conns.push_back(Ok(c)),
                Ok(Some(Ok(Incoming::Reply(r)))) => {
                    if g.pending.remove(&r.request_id) {
                        g.replies.push(r);
                    }
                }
                Ok(Some(Err(_))) if full => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(Err(e))) => g.conns.push_back(Err(e)),
                Ok(None) => {}
                Err(e) => g.broken = Some((e.kind(), e.to_string())),
            }
            self.turn.notify_all();
            if let Some(conn) = refused {
                // Not under the lock: ending it may send tlsplane a CLOSE.
                drop(g);
                self.drop_connection(conn);
                g = self.lock();
            }
        }
    }

    /// Ends a connection that found the queue full, without waiting for tlsplane's answer
    /// (the thread that read it may be the one waiting for a reply).
    fn drop_connection(&self, conn: Connection) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        self.end_unanswered(conn);
    }

    /// Ends a connection with a CLOSE whose reply is not awaited (a relayed one also shut
    /// down for writing, so that its end comes even if the program kept a copy).
    fn end_unanswered(&self, mut conn: Connection) {
        if let Some(conn_id) = conn.end.conn_id.take() {
            self.requests.send_close(conn_id, 0);
        }
        if conn.info.plane == Plane::UserRelay {
            let _ = socket2::SockRef::from(&conn.fd).shutdown(std::net::Shutdown::Write);
        }
    }

    /// One frame. `Ok(None)`: skipped (unknown kind). `Ok(Some(Err))`: a malformed CONNECTION
    /// body (its descriptor closed); the stream is still framed.
    fn read_one(&self) -> io::Result<Option<Result<Incoming, wire::Error>>> {
        let mut frame = Vec::new();
        let Some((prefix, fd)) = read_frame(&self.requests.sock, &mut frame)? else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "tlsplane closed the hand-off connection",
            ));
        };
        match (Message::decode(&frame), fd) {
            (Ok(Some(Message::Connection(info))), Some(fd)) => {
                Ok(Some(Ok(Incoming::Conn(self.adopt(fd, info)))))
            }
            (Ok(Some(Message::Connection(_))), None) => {
                Ok(Some(Err(wire::Error::WrongKind(prefix.kind))))
            }
            (Err(e), _) if prefix.kind == wire::kind::CONNECTION => Ok(Some(Err(e))),
            // A descriptor that came with a reply is closed (dropped here) and ignored.
            (Ok(Some(Message::Reply(r))), _) => Ok(Some(Ok(Incoming::Reply(r)))),
            (Ok(None), _) => Ok(None),
            // A reply that does not decode, or a request kind sent to the program: tlsplane
            // is not speaking this protocol.
            (Ok(Some(m)), _) => Err(invalid(wire::Error::WrongKind(m.kind()))),
            (Err(e), _) => Err(invalid(e)),
        }
    }

    /// Waits for the next connection. A connection whose header did not decode is closed
    /// and reported as `InvalidData`; the client stays usable.
    pub fn accept(&self) -> io::Result<Connection> {
        self.wait_for(|s| s.conns.pop_front())?.map_err(invalid)
    }

    /// Sends one request and waits for its reply.
    fn call(&self, msg: &Message<'_>, request_id: u32) -> io::Result<Status> {
        let mut buf = vec![0u8; msg.encoded_len().map_err(invalid)?];
        msg.encode(&mut buf).map_err(invalid)?;
        self.lock().pending.insert(request_id);
        let sent = self.requests.send(&buf, 0);
        if let Err(e) = sent {
            self.lock().pending.remove(&request_id);
            return Err(e);
        }
        let r = self.wait_for(|s| {
            let i = s.replies.iter().position(|r| r.request_id == request_id)?;
            Some(s.replies.swap_remove(i))
        });
        if r.is_err() {
            self.lock().pending.remove(&request_id);
        }
        Ok(r?.status)
    }

    fn request_id(&self) -> u32 {
        self.requests.request_id()
    }

    /// Asks tlsplane to re-key connection `conn_id` after the handshake record
    /// `record_plaintext` read from it (kernel plane). Returns tlsplane's status.
    pub fn key_update(&self, conn_id: u64, record_plaintext: &[u8]) -> io::Result<Status> {
        let request_id = self.request_id();
        let msg = Message::KeyUpdate {
            request_id,
            conn_id,
            record_plaintext,
        };
        self.call(&msg, request_id)
    }

    /// Asks tlsplane to send close_notify on connection `conn_id`.
    pub fn close_notify(&self, conn_id: u64) -> io::Result<Status> {
        let request_id = self.request_id();
        self.call(
            &Message::Close {
                request_id,
                conn_id,
            },
            request_id,
        )
    }

    /// Reads plaintext from a received connection. Kernel plane: `recvmsg` with the record
    /// type: application data is returned, close_notify is end of stream (`Ok(0)`), a
    /// handshake record (KeyUpdate) goes to tlsplane and reading goes on, another alert is
    /// `ConnectionAborted`. Other planes: a plain read. Honours the descriptor's blocking
    /// mode, and returns `Interrupted` and `WouldBlock` as `read` does. On the kernel plane
    /// `buf` must hold at least 16 bytes, room for a control record.
    pub fn read(&self, fd: BorrowedFd<'_>, info: &ConnInfo, buf: &mut [u8]) -> io::Result<usize> {
        if info.plane != Plane::Kernel {
            // On a socket without kTLS this is a plain recvmsg.
            return tlsplane_sys::recv_record_blocking(fd, buf).map(|(n, _)| n);
        }
        self.read_records(info.conn_id, buf, |buf| {
            tlsplane_sys::recv_record_blocking(fd, buf)
        })
    }

    /// The kernel-plane read over `recv`, which reads one record's bytes and reports its
    /// content type: apart so that tests can play records a socket without kTLS cannot make.
    fn read_records(
        &self,
        conn_id: u64,
        buf: &mut [u8],
        mut recv: impl FnMut(&mut [u8]) -> io::Result<(usize, u8)>,
    ) -> io::Result<usize> {
        if buf.len() < 16 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a kernel-plane read needs a buffer of at least 16 bytes",
            ));
        }
        loop {
            let (n, ty) = recv(buf)?;
            match classify_record(ty, &buf[..n]) {
                RecordAction::Data => return Ok(n),
                RecordAction::CloseNotify => return Ok(0),
                RecordAction::Alert { description, .. } => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        format!("the peer sent TLS alert {description}"),
                    ))
                }
                RecordAction::Handshake(_) if n == buf.len() => {
                    return Err(io::Error::from_raw_os_error(libc::EMSGSIZE))
                }
                RecordAction::Handshake(p) => match self.key_update(conn_id, p)? {
                    Status::Ok => continue,
                    s => {
                        return Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            format!("tlsplane could not re-key the connection: {s:?}"),
                        ))
                    }
                },
                RecordAction::Malformed(t) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unexpected TLS record type {t}"),
                    ))
                }
            }
        }
    }

    /// Ends a received connection with a CLOSE, then closes its descriptor. On the kernel
    /// plane it waits for tlsplane's answer, the close_notify then sent (its status is
    /// returned; the descriptor is closed either way); when tlsplane cannot be asked (it
    /// stopped) or no longer knows the connection (it restarted), the close_notify is sent
    /// here, on the program's descriptor (an alert needs no key of ours: the kernel
    /// encrypts it), and that is `Ok`. On the user-relay plane the CLOSE is not waited for
    /// (it is queued before the descriptor goes, which is all the order tlsplane needs):
    /// writing is shut down, and tlsplane's relay sends close_notify after the last byte.
    pub fn close(&self, mut conn: Connection) -> io::Result<Status> {
        if conn.info.plane != Plane::Kernel {
            self.end_unanswered(conn);
            return Ok(Status::Ok);
        }
        conn.end.conn_id = None;
        match self.close_notify(conn.info.conn_id) {
            Ok(Status::UnknownConnection) | Err(_) => {
                tlsplane_sys::send_record(conn.fd.as_fd(), 21, &[1, 0]).map(|_| Status::Ok)
            }
            other => other,
        }
    }
}

enum Incoming {
    Conn(Connection),
    Reply(Reply),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records as a kTLS socket would return them: (content type, plaintext).
    fn player(records: Vec<(u8, Vec<u8>)>) -> impl FnMut(&mut [u8]) -> io::Result<(usize, u8)> {
        let mut records = records.into_iter();
        move |buf: &mut [u8]| {
            let (ty, bytes) = records.next().expect("no read past the script");
            let n = bytes.len().min(buf.len());
            buf[..n].copy_from_slice(&bytes[..n]);
            Ok((n, ty))
        }
    }

    /// What the fake tlsplane was asked: (connection id, record plaintext) per KEY_UPDATE.
    type Asked = std::thread::JoinHandle<Vec<(u64, Vec<u8>)>>;

    /// A fake tlsplane that answers each KEY_UPDATE with `status` and records what it got.
    fn fake(status: Status) -> (HandoffClient, Asked) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let mut frame = Vec::new();
            let mut got = Vec::new();
            read_frame(&theirs, &mut frame).unwrap();
            assert_eq!(
                Message::decode(&frame),
                Ok(Some(Message::Hello {
                    flags: wire::ENDS_WITH_CLOSE
                })),
                "the HELLO first"
            );
            while let Ok(Some(_)) = read_frame(&theirs, &mut frame) {
                let Ok(Some(Message::KeyUpdate {
                    request_id,
                    conn_id,
                    record_plaintext,
                })) = Message::decode(&frame)
                else {
                    panic!("expected KEY_UPDATE");
                };
                got.push((conn_id, record_plaintext.to_vec()));
                let reply = Reply {
                    request_id,
                    conn_id,
                    status,
                };
                send_reply(&theirs, &reply).unwrap();
            }
            got
        });
        (HandoffClient::from_stream(ours), t)
    }

    const KEY_UPDATE_REQUESTED: [u8; 5] = [24, 0, 0, 1, 1];

    #[test]
    fn a_key_update_goes_to_tlsplane_and_reading_goes_on() {
        let (client, t) = fake(Status::Ok);
        let mut recv = player(vec![
            (23, b"before".to_vec()),
            (22, KEY_UPDATE_REQUESTED.to_vec()),
            (23, b"after the re-key".to_vec()),
            (21, vec![1, 0]), // close_notify
        ]);
        let mut buf = [0u8; 64];
        let mut reads = Vec::new();
        loop {
            let n = client.read_records(9, &mut buf, &mut recv).unwrap();
            if n == 0 {
                break;
            }
            reads.push(buf[..n].to_vec());
        }
        // The application sees only its data: the KeyUpdate was answered between two reads.
        assert_eq!(reads, [b"before".to_vec(), b"after the re-key".to_vec()]);
        drop(client);
        assert_eq!(t.join().unwrap(), [(9, KEY_UPDATE_REQUESTED.to_vec())]);
    }

    #[test]
    fn a_refused_re_key_or_an_alert_ends_the_read() {
        let (client, t) = fake(Status::Unsupported);
        let mut buf = [0u8; 64];
        let e = client
            .read_records(
                1,
                &mut buf,
                player(vec![(22, KEY_UPDATE_REQUESTED.to_vec())]),
            )
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        let e = client
            .read_records(1, &mut buf, player(vec![(21, vec![2, 40])]))
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        assert!(e.to_string().contains("40"), "{e}");
        for bad in [(21, vec![2]), (22, vec![]), (20, vec![1])] {
            let e = client
                .read_records(1, &mut buf, player(vec![bad]))
                .unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        }
        // A handshake record that fills the buffer may be cut short: not sent on.
        let e = client
            .read_records(1, &mut buf[..16], player(vec![(22, vec![24; 40])]))
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE));
        // Too small a buffer for a control record: refused before reading.
        let e = client
            .read_records(1, &mut buf[..15], player(vec![]))
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        drop(client);
        assert_eq!(t.join().unwrap(), [(1, KEY_UPDATE_REQUESTED.to_vec())]);
    }
}
