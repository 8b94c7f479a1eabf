/*
 * tlsplane.h - receive established TLS connections from tlsplane (hand-off, issue 21).
 *
 * tlsplane runs the TLS handshake and keeps the keys; a program connects to its hand-off Unix
 * socket and receives each connection as a ready descriptor (SCM_RIGHTS) with a small header
 * (struct tlsplane_conn_info). The program reads and writes plaintext on the descriptor:
 *
 *   - TLSPLANE_PLANE_KERNEL: the descriptor is the kTLS socket itself. write(2), send(2),
 *     sendfile(2) and splice(2) work as on any socket, the kernel encrypting. Read with
 *     tlsplane_read(): a plain read(2) fails with EIO when the next record is not application
 *     data (close_notify, another alert, a KeyUpdate), and a KeyUpdate must reach tlsplane,
 *     which alone holds the traffic secrets, for reading to go on.
 *   - TLSPLANE_PLANE_USER: one end of a socketpair that tlsplane relays through its own
 *     record layer. Any read/write call works; tlsplane_read() is a plain read.
 *   - TLSPLANE_PLANE_RAW_TCP: the TCP socket with the ClientHello unread, for programs with
 *     their own TLS library. tlsplane_read() is a plain read.
 *
 * Link: -ltlsplane_handoff_c (shared), or libtlsplane_handoff_c.a with -lpthread -ldl -lm.
 *
 * Who may answer at the path: anyone can bind it while tlsplane is away (a restart removes
 * the socket), and would then hand the program forged connections and read its answers. So
 * tlsplane_connect checks the listening process's user id (SO_PEERCRED) before reading a byte
 * and refuses (EPERM) any but root and the ids tlsplane may run as: those of the environment
 * variable TLSPLANE_HANDOFF_UID (decimal ids separated by commas, no spaces, at most 16: e.g.
 * "999" or "999,1000"), or when it is unset or empty this process's effective uid.
 * tlsplane_connect_uids names them instead. A refusal, or a malformed TLSPLANE_HANDOFF_UID
 * (EINVAL), is also said on stderr ("tlsplane: refusing the hand-off socket PATH: it is
 * served by uid N, ...", at most once per 10 s).
 *
 * Errors: functions returning int or ssize_t return -1 and set errno; tlsplane_connect
 * returns NULL and sets errno. Besides the errno values of the underlying system calls
 * (connect(2), recvmsg(2), sendmsg(2); EINTR and EAGAIN are passed through, as read(2) does):
 *   EPERM        tlsplane_connect*: the socket at path is served by a user id not trusted
 *   EBADF        tlsplane_read/tlsplane_close on a descriptor this handle did not accept (or
 *                already closed)
 *   EINVAL       a NULL handle or path; a malformed TLSPLANE_HANDOFF_UID; a kernel-plane
 *                read with len < 16
 *   EPROTO       tlsplane sent a header this library cannot decode (its descriptor was
 *                closed; the handle stays usable unless the stream itself is broken), or the
 *                peer sent a TLS record that has no business after the handshake
 *   ECONNRESET   tlsplane closed the hand-off connection (the handle is then unusable)
 *   EPIPE        a request (KeyUpdate, close) sent after tlsplane closed the connection
 *   ECONNABORTED the TLS peer sent a fatal alert, or tlsplane could not re-key after a
 *                KeyUpdate (it closes the connection)
 *   EMSGSIZE     a handshake record larger than the read buffer
 *   ENOENT/EPERM/EOPNOTSUPP  tlsplane's answer to a close: unknown connection / not this
 *                program's / not supported
 *
 * Thread safety: a handle may be used from any number of threads at once. One thread at a
 * time reads the hand-off socket for all of them, so a thread blocked in tlsplane_accept()
 * does not hold up another thread's tlsplane_read() that must send tlsplane a KeyUpdate.
 * Connections that arrive while a thread waits for tlsplane's answer to a KeyUpdate or close
 * and no thread accepts are queued, 64 at most; past that each is ended on arrival (its client
 * gets close_notify), so that a flood cannot take the program's memory and descriptors.
 * Two threads reading the same descriptor at once get what read(2) would give them.
 *
 * All calls block unless the descriptor they read is non-blocking (then EAGAIN as usual);
 * tlsplane_accept() and the KeyUpdate/close requests always block on the hand-off socket.
 * Descriptors are received close-on-exec. A program that never calls these functions and
 * only read(2)s sees EIO at the first control record; nothing else breaks.
 *
 * Ending a connection: tlsplane_connect tells tlsplane (a HELLO frame, ENDS_WITH_CLOSE) that
 * this program ends every connection through tlsplane_close, which queues a CLOSE request
 * for it before closing the descriptor, on both planes. tlsplane then knows a finished
 * connection from an abandoned one: a descriptor that ends without a CLOSE (a plain close(2)
 * that bypasses tlsplane_close, a crash, an exit, tlsplane_disconnect with connections still
 * open) is taken for abandoned, and its client gets a reset (TCP RST), never close_notify,
 * which would tell it that the response was complete.
 */
#ifndef TLSPLANE_H
#define TLSPLANE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TLSPLANE_PLANE_KERNEL 1
#define TLSPLANE_PLANE_USER 2
#define TLSPLANE_PLANE_RAW_TCP 3

#define TLSPLANE_AF_NONE 0
#define TLSPLANE_AF_INET 4
#define TLSPLANE_AF_INET6 6

/* A socket address: family TLSPLANE_AF_*, port in host byte order, address in network byte
 * order (IPv4 in addr[0..4]). Family TLSPLANE_AF_NONE: no address known. */
struct tlsplane_addr {
    uint8_t family;
    uint8_t reserved;
    uint16_t port;
    uint8_t addr[16];
};

/* What tlsplane tells about each connection (sizeof: 576 on Linux ABIs with an 8-byte
 * aligned uint64_t; check with tlsplane_conn_info_size()). */
struct tlsplane_conn_info {
    uint64_t conn_id;       /* tlsplane's id, unique while tlsplane runs */
    uint8_t plane;          /* TLSPLANE_PLANE_* */
    uint8_t reserved;
    uint16_t tls_version;   /* 0x0303 TLS 1.2, 0x0304 TLS 1.3; 0 on the raw TCP plane */
    uint16_t cipher_suite;  /* IANA value, e.g. 0x1301; 0 on the raw TCP plane */
    uint16_t reserved2;
    struct tlsplane_addr peer;
    struct tlsplane_addr local;
    uint8_t server_name_len;  /* 0: the client sent no SNI */
    char server_name[256];    /* NUL-terminated, printable ASCII */
    uint8_t alpn_len;         /* 0: no ALPN protocol negotiated */
    uint8_t alpn[255];        /* not NUL-terminated */
};

typedef struct tlsplane_handle tlsplane_handle;

/* sizeof(struct tlsplane_conn_info) as the library was built: compare with your sizeof. */
size_t tlsplane_conn_info_size(void);

/* Connects to tlsplane's hand-off Unix socket at `path`, trusting root and the user ids of
 * TLSPLANE_HANDOFF_UID (or this process's effective uid; see above). Returns a handle, or NULL
 * with errno set (from connect(2), e.g. ENOENT, ECONNREFUSED, EACCES; EPERM: another user
 * listens there; EINVAL: TLSPLANE_HANDOFF_UID does not parse). */
tlsplane_handle *tlsplane_connect(const char *path);

/* The same, trusting root and the n_uids user ids at uids (TLSPLANE_HANDOFF_UID is not read):
 * e.g. the uid tlsplane runs as, when it is not this program's. */
tlsplane_handle *tlsplane_connect_uids(const char *path, const uid_t *uids, size_t n_uids);

/* Waits for the next connection. Returns its descriptor (owned by the caller; end it with
 * tlsplane_close()) and fills *out (if out is not NULL), or returns -1 with errno set.
 * The descriptor is close-on-exec and shares O_NONBLOCK with tlsplane's copy: it arrives in
 * whatever mode tlsplane left it; set the one you want with fcntl(F_SETFL). */
int tlsplane_accept(tlsplane_handle *h, struct tlsplane_conn_info *out);

/* Reads plaintext from a descriptor tlsplane_accept() returned. Returns the number of bytes
 * read (> 0), 0 at end of stream (the peer's close_notify on the kernel plane, or TCP EOF),
 * or -1 with errno set. On the kernel plane, a KeyUpdate from the peer is sent to tlsplane,
 * which re-keys the socket (RX, and TX when the peer asked) before this call reads on; the
 * caller sees only application data. len must be at least 16 there (room for a control
 * record). */
ssize_t tlsplane_read(tlsplane_handle *h, int fd, void *buf, size_t len);

/* Ends a connection, the one way to end it orderly (see "Ending a connection" above): sends
 * tlsplane a CLOSE for it, then closes fd. On the kernel plane it waits for tlsplane's answer
 * (tlsplane sends close_notify after what the program already wrote); on the user plane it
 * shuts down writing, and tlsplane's relay sends close_notify after the last byte. fd is
 * closed whatever the return value. When tlsplane has stopped or restarted since the
 * hand-off (it can no longer be asked, or no longer knows the connection), the library sends
 * the kernel-plane close_notify itself on fd. Returns 0, or -1 with errno set (EBADF: not a
 * descriptor this handle accepted; it is then left alone). */
int tlsplane_close(tlsplane_handle *h, int fd);

/* Closes the hand-off connection and frees the handle. End the connections first with
 * tlsplane_close: tlsplane resets those this program has not ended when its hand-off
 * connection ends (kernel plane: at once; user plane: when the descriptor is closed), and
 * tlsplane_read/tlsplane_close can no longer be used on them. No other call may be running on
 * h or made with it afterwards. */
void tlsplane_disconnect(tlsplane_handle *h);

#ifdef __cplusplus
}
#endif

#endif /* TLSPLANE_H */
