"""Driven by crates/tlsplane-handoff/tests/python.rs (a fake tlsplane): receives, reads,
answers and closes through tlsplane_handoff, printing one fact per line."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tlsplane_handoff as th  # noqa: E402


def count_fds():
    return len(os.listdir("/proc/self/fd"))


def main():
    path = sys.argv[1]
    before = count_fds()
    client = th.connect(path)
    sock, info = client.accept()
    print("info=%d %d %04x %04x %s %s %s" % (info.conn_id, info.plane, info.tls_version,
                                             info.cipher_suite, info.server_name,
                                             info.alpn.decode(), info.peer[0]))
    got = b""
    while True:
        chunk = client.recv(sock, info, 7)
        if not chunk:
            break
        got += chunk
    print("data=%s" % got.decode())
    sock.sendall(b"pong")
    print("close=%d" % client.close(sock, info))
    try:
        client.accept()
        print("accept_bad=accepted")
    except th.ProtocolError as e:
        print("accept_bad=ProtocolError(%s)" % e)
    try:
        client.accept()
        print("accept_gone=accepted")
    except ConnectionResetError:
        print("accept_gone=ConnectionResetError")
    client.disconnect()
    print("fds_leaked=%d" % (count_fds() - before))
    # Local decoding checks: strict, never a crash.
    for bad in (b"", b"XLPH\x01\x01\x00\x40", b"TLPH\x02\x01\x00\x40", b"TLPH\x01\x01\xff\xff"):
        try:
            th.decode_connection(bad + bytes(64))
            print("decode=accepted")
        except th.ProtocolError:
            pass
    # Random and mutated frames: ProtocolError or a ConnInfo, never another exception.
    import random
    rng = random.Random(21)
    good = bytes.fromhex(sys.argv[2])
    assert th.decode_connection(good).server_name == "py.example"
    accepted = 0
    for i in range(20000):
        if i % 3 == 0:
            b = bytes(rng.getrandbits(8) for _ in range(rng.randrange(100)))
        else:
            b = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                j = rng.randrange(len(b))
                b[j] = rng.getrandbits(8)
            b = bytes(b[:rng.randrange(len(b) + 1)]) if rng.random() < 0.3 else bytes(b)
        try:
            th.decode_connection(b)
            accepted += 1
        except th.ProtocolError:
            pass
    print("fuzz_accepted_some=%s" % (accepted > 100))
    print("control_records=%s" % control_records())
    print("queue_bound=%s" % queue_bound())
    print("ends=%s" % ends())
    print("done")


class ScriptedSocket:
    """Plays records as a kTLS socket's recvmsg returns them: (content type, plaintext)."""

    def __init__(self, records):
        self.records = list(records)

    def recvmsg(self, bufsize, ancbufsize):
        rtype, data = self.records.pop(0)
        anc = [] if rtype == 23 else [(282, 2, bytes([rtype]))]
        return data[:bufsize], anc, 0, None


def control_records():
    """Client.recv on the kernel plane: a KeyUpdate reaches a fake tlsplane (a thread on a
    socketpair) and reading goes on; close_notify is b""; an alert raises."""
    import socket
    import struct
    import threading
    ours, theirs = socket.socketpair()
    asked = []

    def fake():
        while True:
            head = theirs.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            kind, length = th.decode_prefix(head)
            body = theirs.recv(length - 8, socket.MSG_WAITALL)
            if kind == th.HELLO:
                continue
            request_id, conn_id, plen = struct.unpack("!IQH", body[:14])
            asked.append((kind, conn_id, body[14:14 + plen]))
            theirs.sendall(th.MAGIC + struct.pack("!BBHIQH", 1, th.REPLY, 22, request_id, conn_id, 0))

    t = threading.Thread(target=fake)
    t.start()
    client = th.Client(ours)
    info = th.ConnInfo(8, th.PLANE_KERNEL, 0x0304, 0x1301, None, None, None, None)
    ku = bytes([24, 0, 0, 1, 0])
    sock = ScriptedSocket([(23, b"one"), (22, ku), (23, b"two"), (21, bytes([1, 0]))])
    reads = []
    while True:
        data = client.recv(sock, info)
        if not data:
            break
        reads.append(data)
    try:
        client.recv(ScriptedSocket([(21, bytes([2, 40]))]), info)
        alert = "none"
    except ConnectionAbortedError:
        alert = "aborted"
    client.disconnect()
    t.join()
    theirs.close()
    return "%s %s %s" % (reads == [b"one", b"two"], asked == [(th.KEY_UPDATE, 8, ku)], alert)


def connection(conn_id, plane):
    """A CONNECTION frame as tlsplane sends it."""
    import struct
    name = b"q.example"
    body = struct.pack("!QBBHH", conn_id, plane, 0, 0x0304, 0x1301) + bytes(40)
    body += bytes([len(name)]) + name + bytes([0])
    return th.MAGIC + struct.pack("!BBH", 1, th.CONNECTION, 8 + len(body)) + body


def ends():
    """HELLO (ENDS_WITH_CLOSE) comes first; then each connection's CLOSE is queued by the
    time its end reaches the relay, whether the connection is closed or its `with` block
    left, and none when an exception leaves the block or the socket is closed directly."""
    import socket
    import struct
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    client = th.Client(ours)
    hello = theirs.recv(64) == th.encode_hello()

    def handed(conn_id):
        peer, mine = socket.socketpair()
        socket.send_fds(theirs, [connection(conn_id, th.PLANE_USER)], [mine.fileno()])
        mine.close()
        peer.settimeout(5)
        return peer

    def close_queued_at_end(peer):
        while peer.recv(4096):
            pass
        theirs.setblocking(False)
        try:
            frame = theirs.recv(64)
        except BlockingIOError:
            frame = b""
        theirs.settimeout(5)
        if not frame:
            return None
        kind, _length = th.decode_prefix(frame)
        return struct.unpack("!Q", frame[12:20])[0] if kind == th.CLOSE else "kind %d" % kind

    got = []
    peer = handed(1)
    with client.accept() as (sock, info):
        sock.sendall(b"answer")
    got.append(close_queued_at_end(peer))
    peer = handed(2)
    sock, info = client.accept()
    got.append(client.close(sock, info))
    got.append(close_queued_at_end(peer))
    peer = handed(3)
    try:
        with client.accept() as (sock, info):
            raise ValueError("the handler failed")
    except ValueError:
        pass
    got.append(close_queued_at_end(peer))
    peer = handed(4)
    sock, info = client.accept()
    sock.close()
    got.append(close_queued_at_end(peer))
    client.disconnect()
    theirs.close()
    return "hello=%s %s" % (hello, got)


def queue_bound():
    """Connections that arrive while a request waits are queued up to queue_limit; past it
    each is ended at once (a kernel-plane one with a CLOSE) and counted."""
    import socket
    import struct
    import threading
    ours, theirs = socket.socketpair()
    closes = []

    def read_request():
        head = theirs.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return None
        _kind, length = th.decode_prefix(head)
        return struct.unpack("!IQ", theirs.recv(length - 8, socket.MSG_WAITALL)[:12])

    def fake():
        assert theirs.recv(12, socket.MSG_WAITALL) == th.encode_hello()
        request_id, conn_id = read_request()
        for n, plane in ((1, th.PLANE_USER), (2, th.PLANE_USER), (3, th.PLANE_KERNEL),
                         (4, th.PLANE_USER)):
            a, b = socket.socketpair()
            socket.send_fds(theirs, [connection(n, plane)], [b.fileno()])
            a.close()
            b.close()
        theirs.sendall(th.MAGIC + struct.pack("!BBHIQH", 1, th.REPLY, 22, request_id, conn_id, 0))
        while True:
            r = read_request()
            if r is None:
                return
            closes.append(r[1])

    theirs.settimeout(5)  # bounded: a client that never asks fails the test, not hangs it
    t = threading.Thread(target=fake, daemon=True)
    t.start()
    client = th.Client(ours, queue_limit=2)
    status = client.close_notify(99)
    queued = [client.accept()[1].conn_id for _ in range(2)] if status == th.STATUS_OK else []
    client.disconnect()
    t.join(5)
    theirs.close()
    return "%s dropped=%d closes=%s" % (queued, client.dropped, closes)


main()
