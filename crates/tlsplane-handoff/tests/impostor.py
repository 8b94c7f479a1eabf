"""Not tlsplane, listening at the hand-off path: the receivers' trust tests run it (the Rust
client's, the Python module's, the C library's and the LD_PRELOAD shim's).

    python3 impostor.py SOCKET UID [REQUEST]

Run as root: drops to UID (group UID, no supplementary groups), binds SOCKET (its directory
must be writable by UID), prints "listening uid=UID", then for each receiver that connects
sends one forged CONNECTION frame (user relay plane, peer 203.0.113.7:4242, server name
forged.example, ALPN http/1.1) with one end of a socketpair, writes REQUEST on its own end,
and prints what came back as "conn N reply HEX" (empty: the receiver never took the
connection). Stops after 20 s.
"""
import os
import socket
import struct
import sys


def drop_to(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def forged_connection(conn_id):
    def addr(ip, port):
        return struct.pack("!BBH", 4, 0, port) + socket.inet_aton(ip) + bytes(12)

    name, alpn = b"forged.example", b"http/1.1"
    body = struct.pack("!QBBHH", conn_id, 2, 0, 0x0304, 0x1301)
    body += addr("203.0.113.7", 4242) + addr("127.0.0.1", 443)
    body += bytes([len(name)]) + name + bytes([len(alpn)]) + alpn
    return b"TLPH" + struct.pack("!BBH", 1, 1, 8 + len(body)) + body


def serve_one(sock, n, request):
    ours, theirs = socket.socketpair()
    try:
        socket.send_fds(sock, [forged_connection(n)], [theirs.fileno()])
    except OSError:
        pass  # the receiver hung up at once
    theirs.close()
    reply = b""
    try:
        ours.settimeout(5)
        if request:
            ours.sendall(request)
        while True:
            chunk = ours.recv(65536)
            if not chunk:
                break
            reply += chunk
    except OSError:
        pass
    print("conn %d reply %s" % (n, reply.hex()), flush=True)
    ours.close()


def main():
    path, uid = sys.argv[1], int(sys.argv[2])
    request = sys.argv[3].encode() if len(sys.argv) > 3 else b""
    drop_to(uid)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(20)
    print("listening uid=%d" % os.geteuid(), flush=True)
    n = 0
    while True:
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            return
        n += 1
        serve_one(sock, n, request)
        sock.close()


main()
