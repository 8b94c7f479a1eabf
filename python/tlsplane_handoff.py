"""Receive established TLS connections from tlsplane (hand-off, issue 21).

Standard library only. tlsplane runs the handshake and keeps the keys; this module connects to
its hand-off Unix socket and receives each connection as a ready socket with a small header
(see docs/HANDOFF.md for the byte layout)::

    import tlsplane_handoff
    client = tlsplane_handoff.connect("/run/tlsplane/app.sock")
    while True:
        with client.accept() as (sock, info):
            print(info.server_name, info.alpn, info.peer)
            ...  # sock.recv / sock.sendall plaintext

Every connection must end through the module: ``client.close(sock, info)``, or leaving the
``with`` block without an exception. Either sends tlsplane a CLOSE for it before closing the
socket, so that tlsplane sends its client close_notify after the last byte: :func:`connect`
announced (HELLO, ENDS_WITH_CLOSE) that this program ends its connections so. A socket that
goes without one (``sock.close()`` directly, the socket object collected, an exception out of
the ``with`` block, the process dying) was abandoned: tlsplane resets its connection (a TCP
RST), and the client cannot take a cut-short response for a complete one.

On the user plane (``PLANE_USER``) the socket is one end of a socketpair that tlsplane relays:
read and write it as any socket. On the kernel plane (``PLANE_KERNEL``) it is the kTLS socket
itself: ``sock.recv`` raises ``OSError(EIO)`` at a control record (close_notify, KeyUpdate); a
program that wants those handled reads with :meth:`Client.recv`, which forwards a KeyUpdate to
tlsplane and reports close_notify as end of stream.

A ``Client`` is for one thread at a time.

Only tlsplane may answer at the path: :func:`connect` checks the listening process's user id
(``SO_PEERCRED``) and raises ``PermissionError`` for any but root and the ids tlsplane may run
as: ``server_uids`` when given, else ``TLSPLANE_HANDOFF_UID`` (decimal ids separated by
commas, e.g. ``999,1000``), else this process's own effective uid. Whoever binds the path
while tlsplane is away (a restart removes the socket) could otherwise hand the program forged
connections and read its answers.
"""

import errno
import ipaddress
import os
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass
from typing import Optional, Tuple

MAGIC = b"TLPH"
VERSION = 1
PREFIX_LEN = 8
MAX_FRAME_LEN = 16448
MAX_RECORD_PLAINTEXT = 16384

CONNECTION, REPLY, KEY_UPDATE, CLOSE, HELLO = 1, 2, 3, 4, 5
ENDS_WITH_CLOSE = 1
PLANE_KERNEL, PLANE_USER, PLANE_RAW_TCP = 1, 2, 3

STATUS_OK = 0
STATUS_UNKNOWN_CONNECTION = 1
STATUS_BAD_REQUEST = 2
STATUS_UNSUPPORTED = 3
STATUS_FAILED = 4
STATUS_REFUSED = 5

_SOL_TLS = 282
_TLS_GET_RECORD_TYPE = 2

SERVER_UID_ENV = "TLSPLANE_HANDOFF_UID"
MAX_SERVER_UIDS = 16
DEFAULT_QUEUE_LIMIT = 64


class ProtocolError(Exception):
    """tlsplane sent something this module cannot decode."""


@dataclass(frozen=True)
class ConnInfo:
    conn_id: int
    plane: int
    tls_version: int
    cipher_suite: int
    peer: Optional[Tuple[str, int]]
    local: Optional[Tuple[str, int]]
    server_name: Optional[str]
    alpn: Optional[bytes]


def _addr(b: bytes) -> Optional[Tuple[str, int]]:
    family, _reserved, port = struct.unpack("!BBH", b[:4])
    raw = b[4:20]
    if family == 0 and port == 0 and raw == bytes(16):
        return None
    if family == 4 and raw[4:] == bytes(12):
        return (str(ipaddress.IPv4Address(raw[:4])), port)
    if family == 6:
        return (str(ipaddress.IPv6Address(raw)), port)
    raise ProtocolError("bad socket address")


def decode_prefix(b: bytes) -> Tuple[int, int]:
    """(kind, frame length) from a frame's first 8 bytes, checked."""
    if len(b) < PREFIX_LEN:
        raise ProtocolError("truncated frame")
    if b[:4] != MAGIC:
        raise ProtocolError("bad magic")
    if b[4] != VERSION:
        raise ProtocolError("unsupported version %d" % b[4])
    (length,) = struct.unpack("!H", b[6:8])
    if not PREFIX_LEN <= length <= MAX_FRAME_LEN:
        raise ProtocolError("bad frame length %d" % length)
    return b[5], length


def decode_connection(frame: bytes) -> ConnInfo:
    """A whole CONNECTION frame's header; strict, as the Rust decoder."""
    kind, length = decode_prefix(frame)
    if kind != CONNECTION:
        raise ProtocolError("not a CONNECTION frame")
    if length < 64 or len(frame) < length:
        raise ProtocolError("bad frame length %d" % length)
    f = frame[:length]
    conn_id, plane, _reserved, version, suite = struct.unpack("!QBBHH", f[8:22])
    if plane not in (PLANE_KERNEL, PLANE_USER, PLANE_RAW_TCP):
        raise ProtocolError("unknown plane %d" % plane)
    peer, local = _addr(f[22:42]), _addr(f[42:62])
    n = f[62]
    if 63 + n + 1 > length:
        raise ProtocolError("truncated frame")
    name = f[63:63 + n]
    m = f[63 + n]
    if 64 + n + m > length:
        raise ProtocolError("truncated frame")
    alpn = f[64 + n:64 + n + m]
    if any(not 0x21 <= c <= 0x7E for c in name):
        raise ProtocolError("bad server name")
    return ConnInfo(conn_id, plane, version, suite, peer, local,
                    name.decode("ascii") if n else None, alpn if m else None)


def encode_hello(flags: int = ENDS_WITH_CLOSE) -> bytes:
    """The HELLO frame a receiver sends first."""
    return MAGIC + struct.pack("!BBHI", VERSION, HELLO, PREFIX_LEN + 4, flags)


def encode_request(kind: int, request_id: int, conn_id: int, plaintext: bytes = b"") -> bytes:
    """A KEY_UPDATE (with the record plaintext) or CLOSE frame."""
    if kind == KEY_UPDATE:
        if not 1 <= len(plaintext) <= MAX_RECORD_PLAINTEXT:
            raise ValueError("record plaintext must be 1 to 16384 bytes")
        body = struct.pack("!IQH", request_id, conn_id, len(plaintext)) + plaintext
    elif kind == CLOSE:
        body = struct.pack("!IQ", request_id, conn_id)
    else:
        raise ValueError("not a request kind")
    return MAGIC + struct.pack("!BBH", VERSION, kind, PREFIX_LEN + len(body)) + body


def parse_server_uids(text: str) -> frozenset:
    """``TLSPLANE_HANDOFF_UID``'s syntax, strictly (a mistake must not trust someone else):
    decimal user ids separated by commas, no spaces, at most 16. Root is always added."""
    items = text.split(",")
    if len(items) > MAX_SERVER_UIDS:
        raise ValueError("%s=%r: more than 16 user ids" % (SERVER_UID_ENV, text))
    uids = {0}
    for item in items:
        if not item or not all("0" <= c <= "9" for c in item):
            raise ValueError("%s=%r: expected decimal user ids separated by commas"
                             % (SERVER_UID_ENV, text))
        if int(item) >= 0xFFFFFFFF:
            raise ValueError("%s=%r: a user id out of range" % (SERVER_UID_ENV, text))
        uids.add(int(item))
    return frozenset(uids)


def server_uids_from_env() -> frozenset:
    """Root, and ``TLSPLANE_HANDOFF_UID``'s ids, or when it is unset or empty this process's
    effective uid."""
    text = os.environ.get(SERVER_UID_ENV, "")
    return parse_server_uids(text) if text else frozenset({0, os.geteuid()})


def _describe(uids) -> str:
    others = sorted(u for u in uids if u != 0)
    if not others:
        return "root"
    return "root or uid%s %s" % ("s" if len(others) > 1 else "", ", ".join(map(str, others)))


def check_server(sock: socket.socket, path: str, uids) -> None:
    """Raises PermissionError unless the process listening at the other end of ``sock`` runs
    as one of ``uids`` (root always counts)."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", cred)
    uid &= 0xFFFFFFFF
    uids = frozenset(uids) | {0}
    if uid not in uids:
        raise PermissionError(
            errno.EPERM,
            "refusing the hand-off socket %s: it is served by uid %d, not %s (%s names the "
            "user ids tlsplane may run as)" % (path, uid, _describe(uids), SERVER_UID_ENV))


class Accepted(tuple):
    """``(sock, info)``, as :meth:`Client.accept` returns a connection; as a context manager,
    ends it on leaving: :meth:`Client.close` when the block completes, a plain close (an
    abandoned connection, reset) when an exception leaves it."""

    def __new__(cls, client, sock: socket.socket, info: ConnInfo):
        self = super().__new__(cls, (sock, info))
        self._client = client
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self._client.close(*self)
        else:
            self[0].close()
        return False


class Client:
    """One connection to tlsplane's hand-off socket. Sends the HELLO at once: every
    connection it hands out is to be ended through :meth:`close` (see the module's doc).

    Connections that arrive while a request waits for its reply are queued for
    :meth:`accept`, ``queue_limit`` at most; past it one is ended at once (its client gets
    close_notify) and counted in ``dropped``. Also a context manager (:meth:`disconnect`
    on leaving)."""

    def __init__(self, sock: socket.socket, queue_limit: int = DEFAULT_QUEUE_LIMIT):
        self.sock = sock
        self._next_request = 1
        self._conns = deque()  # connections that arrived while waiting for a reply
        self._lock = threading.Lock()
        self.queue_limit = max(1, queue_limit)
        self.dropped = 0
        sock.sendall(encode_hello())

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.disconnect()
        return False

    def _read_exact(self, n: int, fds: list) -> bytes:
        data = b""
        while len(data) < n:
            chunk, new_fds, flags, _ = socket.recv_fds(
                self.sock, n - len(data), 1, socket.MSG_CMSG_CLOEXEC)
            fds.extend(new_fds)
            if flags & socket.MSG_CTRUNC or len(fds) > 1:
                raise ProtocolError("more than one descriptor in a frame")
            if not chunk:
                if data or fds:
                    raise ProtocolError("hand-off connection closed inside a frame")
                raise ConnectionResetError(errno.ECONNRESET, "tlsplane closed the hand-off connection")
            data += chunk
        return data

    def _read_frame(self):
        """(kind, frame bytes, descriptor or None). Closes any descriptor on error."""
        fds = []
        try:
            prefix = self._read_exact(PREFIX_LEN, fds)
            kind, length = decode_prefix(prefix)
            frame = prefix + self._read_exact(length - PREFIX_LEN, fds)
        except BaseException:
            for fd in fds:
                socket.close(fd)
            raise
        return kind, frame, (fds[0] if fds else None)

    def _next(self):
        """One frame: ('conn', (sock, info)) / ('reply', tuple) / ('error', exc) / None."""
        kind, frame, fd = self._read_frame()
        if kind == CONNECTION:
            try:
                if fd is None:
                    raise ProtocolError("CONNECTION without a descriptor")
                info = decode_connection(frame)
            except ProtocolError as e:
                if fd is not None:
                    socket.close(fd)
                return ("error", e)
            return ("conn", Accepted(self, socket.socket(fileno=fd), info))
        if fd is not None:
            socket.close(fd)
        if kind == REPLY:
            if len(frame) < 22:
                raise ProtocolError("bad REPLY frame")
            return ("reply", struct.unpack("!IQH", frame[8:22]))
        if kind in (KEY_UPDATE, CLOSE):
            raise ProtocolError("a request kind sent to the program")
        return None  # a kind from a later version: skipped

    def accept(self) -> Accepted:
        """Waits for the next connection: ``(sock, info)``, also a context manager that
        ends it (:class:`Accepted`). A header that does not decode raises ProtocolError (its
        descriptor closed); the client stays usable."""
        with self._lock:
            while True:
                if self._conns:
                    item = self._conns.popleft()
                else:
                    item = self._next()
                if item is None or item[0] == "reply":
                    continue  # a reply nobody waits for
                if item[0] == "error":
                    raise item[1]
                return item[1]

    def _new_request_id(self) -> int:
        request_id = self._next_request
        self._next_request = (self._next_request + 1) & 0xFFFFFFFF
        return request_id

    def _request(self, kind: int, conn_id: int, plaintext: bytes = b"") -> int:
        with self._lock:
            request_id = self._new_request_id()
            self.sock.sendall(encode_request(kind, request_id, conn_id, plaintext))
            while True:
                item = self._next()
                if item is None:
                    continue
                if item[0] == "reply" and item[1][0] == request_id:
                    return item[1][2]
                if item[0] == "reply":
                    continue
                if len(self._conns) < self.queue_limit:
                    self._conns.append(item)
                else:
                    self._drop(item)

    def _drop(self, item) -> None:
        """Ends a connection that found the queue full; its reply, if any, is not awaited."""
        self.dropped += 1
        if item[0] != "conn":
            return
        self._end_unanswered(*item[1])

    def _end_unanswered(self, sock: socket.socket, info: ConnInfo) -> None:
        """Ends a connection with a CLOSE whose reply is not awaited (the reader skips it),
        queued before the socket goes; a relayed one is also shut down for writing."""
        try:
            if info.plane in (PLANE_KERNEL, PLANE_USER):
                self.sock.sendall(encode_request(CLOSE, self._new_request_id(), info.conn_id))
            if info.plane == PLANE_USER:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            sock.close()

    def key_update(self, conn_id: int, record_plaintext: bytes) -> int:
        """Asks tlsplane to re-key after a handshake record; returns its STATUS_*."""
        return self._request(KEY_UPDATE, conn_id, record_plaintext)

    def close_notify(self, conn_id: int) -> int:
        """Asks tlsplane to send close_notify; returns its STATUS_*."""
        return self._request(CLOSE, conn_id)

    def recv(self, sock: socket.socket, info: ConnInfo, bufsize: int = 65536) -> bytes:
        """Reads plaintext; b"" at end of stream (close_notify on the kernel plane). On the
        kernel plane a KeyUpdate goes to tlsplane and reading goes on; another alert raises
        ConnectionAbortedError."""
        if info.plane != PLANE_KERNEL:
            return sock.recv(bufsize)
        while True:
            data, anc, _flags, _ = sock.recvmsg(max(bufsize, 16), socket.CMSG_SPACE(1))
            rtype = 23
            for level, ctype, cdata in anc:
                if level == _SOL_TLS and ctype == _TLS_GET_RECORD_TYPE and cdata:
                    rtype = cdata[0]
            if rtype == 23:
                return data
            if rtype == 21 and len(data) == 2:
                if data[1] == 0:
                    return b""
                raise ConnectionAbortedError(errno.ECONNABORTED, "TLS alert %d" % data[1])
            if rtype == 22 and data:
                status = self.key_update(info.conn_id, data)
                if status != STATUS_OK:
                    raise ConnectionAbortedError(errno.ECONNABORTED, "re-key refused: %d" % status)
                continue
            raise ProtocolError("unexpected TLS record type %d" % rtype)

    def close(self, sock: socket.socket, info: ConnInfo) -> int:
        """Ends a connection: a CLOSE to tlsplane, then the socket closed. On the kernel
        plane it waits for tlsplane's answer (close_notify sent after everything written) and
        returns its STATUS_*; on the user plane the CLOSE is not waited for (it is queued
        before the socket goes, which is all tlsplane needs), writing is shut down, and the
        relay sends close_notify after the last byte: STATUS_OK."""
        if info.plane != PLANE_KERNEL:
            with self._lock:
                self._end_unanswered(sock, info)
            return STATUS_OK
        try:
            return self.close_notify(info.conn_id)
        finally:
            sock.close()

    def disconnect(self) -> None:
        self.sock.close()


def connect(path: str, server_uids=None, queue_limit: int = DEFAULT_QUEUE_LIMIT) -> Client:
    """Connects to tlsplane's hand-off Unix socket at ``path``. ``server_uids``: the user
    ids tlsplane may run as (root is always trusted); None: ``TLSPLANE_HANDOFF_UID``, or
    this process's effective uid. Raises PermissionError when another user listens there,
    ValueError when ``TLSPLANE_HANDOFF_UID`` does not parse."""
    uids = server_uids_from_env() if server_uids is None else frozenset(server_uids)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        check_server(s, path, uids)
    except BaseException:
        s.close()
        raise
    return Client(s, queue_limit)
