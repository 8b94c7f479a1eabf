/*
 * tlsplane_preload.c - LD_PRELOAD shim: an unmodified, dynamically linked server receives the
 * connections `tlsplane handoff` hands off, on a listening socket it names (issue 21).
 *
 *   cc -shared -fPIC -O2 -o libtlsplane_preload.so tlsplane_preload.c -ldl -pthread
 *   TLSPLANE_HANDOFF=/tmp/app.sock TLSPLANE_LISTEN=127.0.0.1:8000 \
 *     LD_PRELOAD=./libtlsplane_preload.so python3 -m http.server 8000 --bind 127.0.0.1
 *
 * TLSPLANE_HANDOFF  the hand-off Unix socket of `tlsplane handoff` (--handoff-socket).
 * TLSPLANE_LISTEN   which listening socket to take over: PORT, IPV4:PORT or [IPV6]:PORT, as
 *                   the program binds it. Either unset: the shim does nothing.
 *
 * listen(2) on a TCP socket bound to that address connects to the hand-off socket instead and
 * dup2s the connection onto the program's descriptor (keeping its O_NONBLOCK and
 * close-on-exec), so the program's own poll/select/epoll on it wakes when tlsplane hands a
 * connection over. accept(2)/accept4(2) on it read one whole frame at a time (docs/HANDOFF.md):
 * a CONNECTION frame gives the descriptor, made blocking or not and close-on-exec or not as
 * accept4's flags say, with the TLS client's address in *addr (IPv4 as ::ffff:a.b.c.d when the
 * program's socket is IPv6); any other frame (a REPLY) is skipped whole, closing a descriptor
 * that came with it; a CONNECTION with a bad body is dropped (its descriptor closed) and the
 * next frame read. In non-blocking mode accept returns EAGAIN when no frame is queued.
 * getsockname(2) on the taken-over descriptor returns the address the program bound.
 *
 * What the program then sees on an accepted descriptor: on the user relay plane (2, the one
 * `tlsplane handoff` uses today) one end of a socketpair carrying plaintext; end of stream is
 * the client's close_notify or TCP close. getpeername/getsockname on it report an AF_UNIX
 * socket, and TCP socket options fail (EOPNOTSUPP): the client's address is the one accept
 * returned. The shim does nothing more for it (no frame is sent when it is closed).
 *
 * Kernel plane (1): the descriptor is the kTLS TCP socket, and tlsplane keeps a duplicate of
 * it and the traffic secrets. A plain read fails with EIO at a control record; the shim
 * handles those so that the program sees a plain byte stream:
 *   - accept/accept4 remember a plane-1 descriptor: its connection id, the hand-off
 *     connection it came from, the accepting pid and the socket's inode, in a static array
 *     indexed by descriptor (no allocation; lookups are lock-free atomic loads, and cost one
 *     load while no kernel-plane descriptor is open). Descriptors 65536 and above are still
 *     returned but not remembered: their control records reach the program as EIO and closing
 *     them sends no CLOSE (logged once).
 *   - read, recv, recvfrom, readv (and __read_chk, __recv_chk, __recvfrom_chk, which
 *     _FORTIFY_SOURCE calls) on a remembered descriptor call the real function; on EIO the
 *     shim reads the control record alone with recvmsg(MSG_DONTWAIT) and a control buffer
 *     (SOL_TLS 282 / TLS_GET_RECORD_TYPE 2):
 *       close_notify (alert, bytes [level, 0])  -> 0, end of stream; later reads return 0;
 *       any other alert                         -> -1 ECONNRESET, and later reads too;
 *       a handshake record (a KeyUpdate)        -> a KEY_UPDATE frame (the connection id, the
 *         plaintext as recvmsg returned it) on the hand-off connection, without waiting for
 *         the REPLY (accept skips it: waiting would mean reading frames that CONNECTIONs are
 *         interleaved with, and frames the shim consumed would no longer wake the program's
 *         poll/epoll on the listening socket); then the read is retried: while it fails with
 *         EKEYEXPIRED (Linux 6.14+ pauses the receive side until tlsplane installs the next
 *         key) the shim sleeps 1 ms, doubling to 10 ms, for 5 s at most, then fails it with
 *         ECONNRESET (and later reads too). Any other result goes to the program (EAGAIN on a
 *         non-blocking socket with nothing to read). A non-blocking descriptor waits the same.
 *       anything else (an alert of the wrong size, an empty handshake record, a content type
 *         with no business after the handshake) -> -1 EPROTO, and later reads too.
 *     A read that gets EKEYEXPIRED first (another thread forwarded the KeyUpdate) waits the
 *     same way. The control record is read into the shim's own buffer (under a mutex) with
 *     the read's length as room, at least 64 bytes (a 1-byte read takes a whole alert or
 *     KeyUpdate) and at most 16384; a handshake record longer than that room (never seen: a
 *     KeyUpdate is 5 bytes) would go to tlsplane in pieces it refuses, and the read would
 *     end with ECONNRESET after the 5 s bound. If data comes instead (another thread read the control record
 *     meanwhile) it is the caller's, but a read of under 64 bytes then loses what did not
 *     fit. recvmsg and recvmmsg are not intercepted:
 *     a program calling them on the connection sees the kernel's behaviour (EIO without a
 *     control buffer). When the descriptor's inode is no longer the remembered socket's (it
 *     was closed where the shim cannot see, e.g. by fclose, and its number reused), the EIO
 *     goes to the program untouched.
 *   - close, and dup2/dup3 onto a remembered descriptor, send a CLOSE frame (tlsplane then
 *     sends close_notify on its duplicate after everything the program wrote, and does a
 *     lingering close), forget the descriptor, and really close it; the REPLY is not awaited.
 *     shutdown(SHUT_WR or SHUT_RDWR) sends CLOSE at once and does not shut the socket's
 *     sending side (its TCP FIN would precede tlsplane's close_notify; SHUT_RDWR still shuts
 *     the receiving side); the later close sends no second CLOSE. What the program writes
 *     after that shutdown would follow the close_notify: don't. Copies made with dup(),
 *     fcntl(F_DUPFD) or received otherwise are not remembered: reads on them are not handled
 *     and closing them sends nothing. A process that exits without closing sends no CLOSE.
 *   - Frames go out whole, one at a time (a mutex), with MSG_NOSIGNAL; the hand-off
 *     connection keeps the program's O_NONBLOCK, so on EAGAIN the shim polls for POLLOUT, 2 s
 *     at most, holding the shim's table lock (accept waits meanwhile); a frame cut short then
 *     would misframe the stream, so the shim shuts the connection down and accept sees it end.
 *     When the hand-off connection the descriptor came from is gone (tlsplane stopped or
 *     restarted: accept saw it end, whether or not the shim has reconnected since; or the
 *     program closed its listening socket), or the send fails (EPIPE: tlsplane died and accept
 *     has not noticed yet), nothing is sent: a KeyUpdate then fails the read with ECONNRESET
 *     at once (nobody can re-key the connection), a close just closes. If tlsplane
 *     restarts after a KEY_UPDATE went out, or the shim reconnects between the check and the
 *     send, the new tlsplane answers REPLY status 1 (unknown connection), which accept skips,
 *     and the read keeps getting EKEYEXPIRED until the 5 s bound -> ECONNRESET.
 *   - fork: only the process that accepted a connection sends its CLOSE; a child (fork, or a
 *     vfork child sharing the parent's memory) closing its copy sends nothing, so a threaded
 *     server that spawns subprocesses is unaffected. An accept-then-fork server (the parent
 *     closes its copy at once, the child serves) is not supported on the kernel plane: the
 *     parent's close sends CLOSE while the child still serves the connection. A child still
 *     forwards KeyUpdates on the inherited hand-off connection.
 *   - The documented limit of the kernel plane: a client KeyUpdate with update_requested makes
 *     tlsplane send our KeyUpdate on its duplicate under the old TX key and install the next;
 *     the reading thread waits meanwhile, but a program writing from another thread during
 *     that brief window may have a record encrypted under the old key land after ours, and
 *     the client then fails the connection.
 *
 * Limits: one hand-off connection per taken-over socket, read by one thread at a time (a
 * mutex; a non-blocking accept while another thread reads returns EAGAIN); processes that
 * fork after listen() and accept on the shared descriptor would interleave frames and are
 * not supported. When tlsplane closes the hand-off connection (it stops or restarts) or sends
 * a prefix that cannot be framed, accept fails once with ECONNABORTED, the descriptor is
 * replaced by a socket that never becomes readable (accept meanwhile blocks, or returns
 * EAGAIN when non-blocking), and a thread of the shim's (signals blocked) connects again every
 * 200 ms, then puts the new connection on the descriptor. Each replacement makes the
 * descriptor a new file: poll and select see it at their next call, but an epoll set that
 * held the descriptor has lost it (add the socket to epoll after listen(); after a tlsplane
 * restart an epoll program gets no more connections). Programs that make system calls without
 * the C library (Go, static binaries) are not affected by LD_PRELOAD at all.
 *
 * This is a second reader of the frame format beside the Rust one (crates/tlsplane-handoff):
 * it decodes only the CONNECTION frame's prefix, connection id, plane and peer address, and
 * encodes KEY_UPDATE and CLOSE; it must run before the program's own code with no
 * allocation and no runtime, which the Rust C library (a blocking client that owns its
 * socket, 2.4 MB with Rust's std) does not offer.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#define FRAME_MAX 16448
#define KIND_CONNECTION 1
#define KIND_KEY_UPDATE 3
#define KIND_CLOSE 4
#define PLANE_KERNEL 1
#define MAX_TAKEN 16
/* Kernel-plane descriptors remembered: those below this number (an array indexed by fd). */
#define MAX_KFD 65536
#define RECORD_MAX 16384 /* the largest TLS record plaintext */
#define SOL_TLS_ 282
#define TLS_GET_RECORD_TYPE_ 2

static int (*real_listen)(int, int);
static int (*real_accept4)(int, struct sockaddr *, socklen_t *, int);
static int (*real_accept)(int, struct sockaddr *, socklen_t *);
static int (*real_getsockname)(int, struct sockaddr *, socklen_t *);
static int (*real_close)(int);
static int (*real_dup2)(int, int);
static int (*real_dup3)(int, int, int);
static int (*real_shutdown)(int, int);
static ssize_t (*real_read)(int, void *, size_t);
static ssize_t (*real_recv)(int, void *, size_t, int);
static ssize_t (*real_recvfrom)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
static ssize_t (*real_readv)(int, const struct iovec *, int);
static ssize_t (*real_read_chk)(int, void *, size_t, size_t);
static ssize_t (*real_recv_chk)(int, void *, size_t, size_t, int);
static ssize_t (*real_recvfrom_chk)(int, void *, size_t, size_t, int, struct sockaddr *,
                                    socklen_t *);

static struct {
    int enabled;
    struct sockaddr_un path;
    socklen_t path_len;
    uint16_t port;
    int family; /* 0: any address; AF_INET/AF_INET6: addr must match */
    unsigned char addr[16];
} cfg;

/* A taken-over listening descriptor and the address the program bound it to. */
struct taken {
    int fd; /* -1: free */
    unsigned gen; /* claims of this slot, so that a reconnecting thread knows its own */
    int lost;     /* the hand-off connection is gone; a thread reconnects (atomic) */
    unsigned epoch; /* hand-off connections lost on this slot (atomic): a connection handed
                     * over before the last loss belongs to a tlsplane that is gone */
    struct sockaddr_storage bound;
    socklen_t bound_len;
    /* One frame reader at a time per socket (frames and descriptors stay aligned). */
    pthread_mutex_t lock;
    unsigned char frame[FRAME_MAX];
};

static struct taken taken[MAX_TAKEN];
static int n_taken; /* read without the lock as a fast path; changed under it */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void note(const char *what, int e) {
    char buf[256];
    int n = snprintf(buf, sizeof buf, "tlsplane-preload: %s%s%s\n", what, e ? ": " : "",
                     e ? strerror(e) : "");
    if (n > 0)
        (void)!write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* ---- Kernel-plane connections (plane 1): the descriptor is the kTLS socket ----
 *
 * kconns[fd] remembers a kernel-plane descriptor accept returned: its connection id and the
 * hand-off connection it came from (slot, gen, epoch). `state` is written last on
 * remembering (release) and cleared first on forgetting, so the intercepted reads need no
 * lock: n_kernel == 0 (nothing remembered) costs one atomic load, otherwise one more. */
struct kconn {
    int state;     /* atomic: 0 free, 1 remembered */
    int end;       /* atomic: 0 live, -1 end of stream (close_notify), >0 errno to repeat */
    int closed;    /* atomic: a CLOSE was sent (at shutdown) */
    pid_t pid;     /* the process that accepted it: only it sends CLOSE */
    int slot;
    unsigned gen, epoch;
    uint64_t conn_id;
    uint64_t ino; /* the socket's inode: a descriptor closed behind the shim's back and its
                   * number reused is not taken for the connection */
};

static struct kconn kconns[MAX_KFD];
static int n_kernel; /* remembered descriptors (atomic) */
static int kfd_high; /* 1 + the highest fd ever remembered (atomic) */
static int warned_kfd; /* the bound was logged (atomic) */
static unsigned next_request; /* request ids of KEY_UPDATE/CLOSE frames (atomic) */

/* One frame out at a time, in whole; also guards ctl_frame, where a control record is read
 * and the KEY_UPDATE frame built around it. */
static pthread_mutex_t send_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char ctl_frame[22 + RECORD_MAX];

/* A child is not forked while another thread holds send_lock (it would never be unlocked). */
static void fork_prepare(void) { pthread_mutex_lock(&send_lock); }
static void fork_done(void) { pthread_mutex_unlock(&send_lock); }

static struct kconn *kfind(int fd) {
    if ((unsigned)fd >= MAX_KFD || __atomic_load_n(&n_kernel, __ATOMIC_ACQUIRE) == 0 ||
        !__atomic_load_n(&kconns[fd].state, __ATOMIC_ACQUIRE))
        return NULL;
    return &kconns[fd];
}

/* The real function, looked up on first use: the read calls work before (and without)
 * init, which an allocator that reads a file while the shim initialises would otherwise
 * deadlock on. */
#define REAL_AS(f, name)                                                                   \
    (__atomic_load_n(&real_##f, __ATOMIC_ACQUIRE)                                          \
         ? real_##f                                                                        \
         : (__atomic_store_n(&real_##f, (__typeof__(real_##f))dlsym(RTLD_NEXT, name),      \
                             __ATOMIC_RELEASE),                                            \
            real_##f))
#define REAL(f) REAL_AS(f, #f)

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static void put_u64(unsigned char *p, uint64_t v) {
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

/* The frame prefix and the request and connection ids, common to KEY_UPDATE and CLOSE. */
static void frame_head(unsigned char *f, int kind, size_t len, uint64_t conn_id) {
    memcpy(f, "TLPH", 4);
    f[4] = 1;
    f[5] = (unsigned char)kind;
    f[6] = (unsigned char)(len >> 8);
    f[7] = (unsigned char)len;
    put_u32(f + 8, __atomic_add_fetch(&next_request, 1, __ATOMIC_RELAXED));
    put_u64(f + 12, conn_id);
}

static int send_all(int fd, const unsigned char *f, size_t n) {
    size_t off = 0;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while (off < n) {
        ssize_t r = send(fd, f + off, n - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r > 0) {
            off += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            long ms = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
            if (ms < 2000) {
                struct pollfd p = {fd, POLLOUT, 0};
                poll(&p, 1, (int)(2000 - ms));
                continue;
            }
        }
        if (off > 0)
            real_shutdown(fd, SHUT_RDWR);
        return -1;
    }
    return 0;
}

/* Sends frame f (n bytes) on the hand-off connection connection k came from; send_lock held.
 * Returns -1 when that connection is gone (tlsplane stopped, restarted, or the program closed
 * the socket): nothing is sent. The socket may be non-blocking: on EAGAIN it waits for room,
 * 2 s at most; a frame cut short then would misframe the stream, so the connection is shut
 * down instead and accept sees it end (and reconnects). */
static int send_frame(const struct kconn *k, const unsigned char *f, size_t n) {
    struct taken *t = &taken[k->slot];
    /* Held throughout: the program cannot close the socket (and its number be reused) nor
     * the shim replace the connection meanwhile. */
    pthread_mutex_lock(&table_lock);
    int fd = t->fd;
    int ok = fd >= 0 && t->gen == k->gen &&
             __atomic_load_n(&t->epoch, __ATOMIC_ACQUIRE) == k->epoch &&
             !__atomic_load_n(&t->lost, __ATOMIC_ACQUIRE);
    int ret = ok ? send_all(fd, f, n) : -1;
    pthread_mutex_unlock(&table_lock);
    return ret;
}

static void send_close(struct kconn *k) {
    if (__atomic_exchange_n(&k->closed, 1, __ATOMIC_ACQ_REL))
        return;
    unsigned char f[20];
    frame_head(f, KIND_CLOSE, sizeof f, k->conn_id);
    pthread_mutex_lock(&send_lock);
    send_frame(k, f, sizeof f);
    pthread_mutex_unlock(&send_lock);
}

/* Forgets descriptor fd (about to be closed or replaced), sending CLOSE unless sent. */
static void kforget(int fd) {
    struct kconn *k = kfind(fd);
    /* A child (fork, or vfork, sharing this table) closing its copy leaves the connection
     * to the process that accepted it. */
    if (!k || k->pid != getpid() || !__atomic_exchange_n(&k->state, 0, __ATOMIC_ACQ_REL))
        return;
    __atomic_sub_fetch(&n_kernel, 1, __ATOMIC_RELEASE);
    /* The fields stay valid: fd is not reused before the caller really closes it. */
    send_close(k);
}

static uint64_t inode_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* Remembers kernel-plane descriptor fd, just received from hand-off slot t. */
static void kremember(int fd, struct taken *t, uint64_t conn_id) {
    if ((unsigned)fd >= MAX_KFD) {
        if (!__atomic_exchange_n(&warned_kfd, 1, __ATOMIC_RELAXED))
            note("a kernel-plane descriptor is above the shim's bound (65535): its control "
                 "records are not handled (logged once)",
                 0);
        return;
    }
    kforget(fd); /* a stale entry: the number was closed behind the shim's back */
    struct kconn *k = &kconns[fd];
    if (__atomic_exchange_n(&k->state, 0, __ATOMIC_ACQ_REL))
        __atomic_sub_fetch(&n_kernel, 1, __ATOMIC_RELEASE); /* another process's */
    k->slot = (int)(t - taken);
    k->gen = t->gen;
    k->epoch = __atomic_load_n(&t->epoch, __ATOMIC_ACQUIRE);
    k->conn_id = conn_id;
    k->ino = inode_of(fd);
    __atomic_store_n(&k->end, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&k->closed, 0, __ATOMIC_RELAXED);
    k->pid = getpid();
    int hi = __atomic_load_n(&kfd_high, __ATOMIC_RELAXED);
    while (hi < fd + 1 &&
           !__atomic_compare_exchange_n(&kfd_high, &hi, fd + 1, 0, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED))
        ;
    __atomic_add_fetch(&n_kernel, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&k->state, 1, __ATOMIC_RELEASE);
}

/* One intercepted read, whichever call it came through. */
struct rd {
    int op; /* 0 read, 1 recv, 2 recvfrom, 3 readv */
    int fd, flags;
    void *buf;
    size_t len;
    struct sockaddr *from;
    socklen_t *fromlen;
    const struct iovec *iov;
    int iovcnt;
};

static ssize_t rd_real(const struct rd *a) {
    switch (a->op) {
    case 0:
        return REAL(read)(a->fd, a->buf, a->len);
    case 1:
        return REAL(recv)(a->fd, a->buf, a->len, a->flags);
    case 2:
        return REAL(recvfrom)(a->fd, a->buf, a->len, a->flags, a->from, a->fromlen);
    default:
        return REAL(readv)(a->fd, a->iov, a->iovcnt);
    }
}

static size_t rd_len(const struct rd *a) {
    if (a->op != 3)
        return a->len;
    size_t n = 0;
    for (int i = 0; i < a->iovcnt; i++)
        n += a->iov[i].iov_len;
    return n;
}

static void rd_copy(const struct rd *a, const unsigned char *src, size_t n) {
    if (a->op != 3) {
        memcpy(a->buf, src, n);
        return;
    }
    for (int i = 0; i < a->iovcnt && n > 0; i++) {
        size_t c = a->iov[i].iov_len < n ? a->iov[i].iov_len : n;
        memcpy(a->iov[i].iov_base, src, c);
        src += c;
        n -= c;
    }
}

static ssize_t fail(int e) {
    errno = e;
    return -1;
}

/* Sticky: later reads see the same end. */
static ssize_t end_with(struct kconn *k, int e) {
    __atomic_store_n(&k->end, e ? e : -1, __ATOMIC_RELEASE);
    return e ? fail(e) : 0;
}

/* A read on a remembered kernel-plane descriptor. */
static ssize_t kread(struct kconn *k, const struct rd *a) {
    struct timespec start = {0, 0};
    long nap = 0; /* ns; > 0 while waiting for tlsplane to install the next RX key */
    for (;;) {
        int end = __atomic_load_n(&k->end, __ATOMIC_ACQUIRE);
        if (end)
            return end < 0 ? 0 : fail(end);
        ssize_t r = rd_real(a);
        if (r >= 0 || (errno != EIO && errno != EKEYEXPIRED))
            return r;
        int e = errno;
        if (k->ino != inode_of(a->fd))
            return fail(e); /* not the remembered socket any more */
        if (e == EKEYEXPIRED) {
            /* Paused after a KeyUpdate (this thread's or another's): tlsplane re-keys. */
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            if (nap == 0) {
                start = now;
                nap = 1000 * 1000;
            } else if (now.tv_sec - start.tv_sec > 5 ||
                       (now.tv_sec - start.tv_sec == 5 && now.tv_nsec >= start.tv_nsec)) {
                return end_with(k, ECONNRESET);
            }
            struct timespec ts = {0, nap};
            nanosleep(&ts, NULL);
            nap = nap * 2 > 10 * 1000 * 1000 ? 10 * 1000 * 1000 : nap * 2;
            continue;
        }
        /* EIO: a control record is next. Read it alone, with its content type. At least 64
         * bytes of room, so that a small read takes a whole alert or KeyUpdate (5 bytes). */
        nap = 0;
        size_t want = rd_len(a);
        want = want < 64 ? 64 : want > RECORD_MAX ? RECORD_MAX : want;
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = {ctl_frame + 22, want};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = ctl.b;
        m.msg_controllen = sizeof ctl.b;
        pthread_mutex_lock(&send_lock);
        ssize_t n = recvmsg(a->fd, &m, MSG_DONTWAIT);
        if (n < 0) {
            e = errno;
            pthread_mutex_unlock(&send_lock);
            if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                continue; /* another thread took the record: read again */
            return fail(e);
        }
        int type = 23;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_TLS_ && c->cmsg_type == TLS_GET_RECORD_TYPE_ &&
                c->cmsg_len >= CMSG_LEN(1))
                type = *(unsigned char *)CMSG_DATA(c);
        const unsigned char *p = ctl_frame + 22;
        if (type == 23) {
            /* Data after all (another thread read the control record): the caller's. Only
             * a read of under 64 bytes can get more than it asked for; the rest is lost. */
            size_t c = (size_t)n < rd_len(a) ? (size_t)n : rd_len(a);
            rd_copy(a, p, c);
            pthread_mutex_unlock(&send_lock);
            return (ssize_t)c;
        }
        if (type == 21 && n == 2) {
            int desc = p[1];
            pthread_mutex_unlock(&send_lock);
            return end_with(k, desc == 0 ? 0 : ECONNRESET); /* close_notify: end of stream */
        }
        if (type == 22 && n > 0) {
            /* A KeyUpdate: tlsplane installs the next RX key (and, if asked, sends ours).
             * The REPLY is not awaited (accept skips it); the read waits for the key. */
            frame_head(ctl_frame, KIND_KEY_UPDATE, 22 + (size_t)n, k->conn_id);
            ctl_frame[20] = (unsigned char)(n >> 8);
            ctl_frame[21] = (unsigned char)n;
            int sent = send_frame(k, ctl_frame, 22 + (size_t)n);
            pthread_mutex_unlock(&send_lock);
            if (sent < 0)
                return end_with(k, ECONNRESET); /* nobody can re-key it */
            continue;
        }
        pthread_mutex_unlock(&send_lock);
        return end_with(k, EPROTO); /* an alert of the wrong size, an empty handshake record
                                     * or a content type with no business here */
    }
}

static void init(void) {
    real_listen = dlsym(RTLD_NEXT, "listen");
    real_accept4 = dlsym(RTLD_NEXT, "accept4");
    real_accept = dlsym(RTLD_NEXT, "accept");
    real_getsockname = dlsym(RTLD_NEXT, "getsockname");
    real_close = dlsym(RTLD_NEXT, "close");
    real_dup2 = dlsym(RTLD_NEXT, "dup2");
    real_dup3 = dlsym(RTLD_NEXT, "dup3");
    real_shutdown = dlsym(RTLD_NEXT, "shutdown");
    real_read = dlsym(RTLD_NEXT, "read");
    real_recv = dlsym(RTLD_NEXT, "recv");
    real_recvfrom = dlsym(RTLD_NEXT, "recvfrom");
    real_readv = dlsym(RTLD_NEXT, "readv");
    real_read_chk = dlsym(RTLD_NEXT, "__read_chk");
    real_recv_chk = dlsym(RTLD_NEXT, "__recv_chk");
    real_recvfrom_chk = dlsym(RTLD_NEXT, "__recvfrom_chk");
    pthread_atfork(fork_prepare, fork_done, fork_done);
    for (int i = 0; i < MAX_TAKEN; i++) {
        taken[i].fd = -1;
        pthread_mutex_init(&taken[i].lock, NULL);
    }

    const char *path = getenv("TLSPLANE_HANDOFF");
    const char *listen_on = getenv("TLSPLANE_LISTEN");
    if (!path || !*path || !listen_on || !*listen_on)
        return;
    if (strlen(path) >= sizeof cfg.path.sun_path) {
        note("TLSPLANE_HANDOFF is too long; shim disabled", 0);
        return;
    }
    cfg.path.sun_family = AF_UNIX;
    strcpy(cfg.path.sun_path, path);
    cfg.path_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(path) + 1);

    char host[64] = "";
    const char *port = listen_on;
    const char *colon = strrchr(listen_on, ':');
    if (colon) {
        size_t n = (size_t)(colon - listen_on);
        const char *h = listen_on;
        if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
            h++;
            n -= 2;
        }
        if (n >= sizeof host) {
            note("TLSPLANE_LISTEN: bad address; shim disabled", 0);
            return;
        }
        memcpy(host, h, n);
        host[n] = 0;
        port = colon + 1;
    }
    char *end;
    long p = strtol(port, &end, 10);
    if (*port == 0 || *end || p < 1 || p > 65535) {
        note("TLSPLANE_LISTEN: bad port; shim disabled", 0);
        return;
    }
    cfg.port = (uint16_t)p;
    if (*host && strcmp(host, "*") != 0) {
        if (inet_pton(AF_INET, host, cfg.addr) == 1)
            cfg.family = AF_INET;
        else if (inet_pton(AF_INET6, host, cfg.addr) == 1)
            cfg.family = AF_INET6;
        else {
            note("TLSPLANE_LISTEN: bad address; shim disabled", 0);
            return;
        }
    }
    cfg.enabled = 1;
}

static int matches(const struct sockaddr_storage *ss) {
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const void *)ss;
        if (ntohs(a->sin_port) != cfg.port)
            return 0;
        return cfg.family == 0 || (cfg.family == AF_INET && !memcmp(&a->sin_addr, cfg.addr, 4));
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const void *)ss;
        if (ntohs(a->sin6_port) != cfg.port)
            return 0;
        return cfg.family == 0 ||
               (cfg.family == AF_INET6 && !memcmp(&a->sin6_addr, cfg.addr, 16));
    }
    return 0;
}

static struct taken *find(int fd) {
    if (fd < 0 || __atomic_load_n(&n_taken, __ATOMIC_ACQUIRE) == 0)
        return NULL;
    struct taken *t = NULL;
    pthread_mutex_lock(&table_lock);
    for (int i = 0; i < MAX_TAKEN; i++)
        if (taken[i].fd == fd)
            t = &taken[i];
    pthread_mutex_unlock(&table_lock);
    return t;
}

/* Puts `with` on descriptor `fd` in place of what is there, keeping fd's O_NONBLOCK and
 * FD_CLOEXEC. Closes `with`. */
static int replace(int fd, int with) {
    int fl = fcntl(fd, F_GETFL);
    int fdfl = fcntl(fd, F_GETFD);
    if (fl < 0 || fdfl < 0 || (fl & O_NONBLOCK && fcntl(with, F_SETFL, O_NONBLOCK) < 0) ||
        real_dup3(with, fd, fdfl & FD_CLOEXEC ? O_CLOEXEC : 0) < 0) {
        int e = errno;
        real_close(with);
        errno = e;
        return -1;
    }
    real_close(with);
    return 0;
}

int listen(int fd, int backlog) {
    pthread_once(&once, init);
    if (!cfg.enabled)
        return real_listen(fd, backlog);
    if (find(fd))
        return 0; /* listen again on a taken-over socket */
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int type = 0;
    socklen_t tlen = sizeof type;
    if (real_getsockname(fd, (struct sockaddr *)&ss, &len) < 0 || !matches(&ss) ||
        getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) < 0 || type != SOCK_STREAM)
        return real_listen(fd, backlog);

    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&cfg.path, cfg.path_len) < 0) {
        int e = errno;
        real_close(s);
        note("cannot connect to TLSPLANE_HANDOFF", e);
        errno = e;
        return -1;
    }
    pthread_mutex_lock(&table_lock);
    int slot = -1;
    for (int i = 0; i < MAX_TAKEN && slot < 0; i++)
        if (taken[i].fd < 0)
            slot = i;
    if (slot < 0) {
        pthread_mutex_unlock(&table_lock);
        real_close(s);
        errno = EMFILE;
        return -1;
    }
    if (replace(fd, s) < 0) {
        pthread_mutex_unlock(&table_lock);
        return -1;
    }
    taken[slot].fd = fd;
    taken[slot].gen++;
    __atomic_store_n(&taken[slot].lost, 0, __ATOMIC_RELEASE);
    taken[slot].bound = ss;
    taken[slot].bound_len = len;
    __atomic_add_fetch(&n_taken, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&table_lock);
    return 0;
}

/* Reads exactly n bytes of the current frame, collecting at most one descriptor into *cfd.
 * `first`: the read starts a frame, the only place a descriptor may come. Returns 1 when done,
 * and when `first` 0 at end of stream before any byte or -1 with errno EAGAIN/EINTR before
 * any byte; -2 when the stream can no longer be framed. */
static int read_exact(int fd, unsigned char *buf, size_t n, int *cfd, int cloexec, int first) {
    size_t got = 0;
    while (got < n) {
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int) * 4)];
        } ctl;
        struct iovec iov = {buf + got, n - got};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = ctl.b;
        m.msg_controllen = sizeof ctl.b;
        ssize_t r = recvmsg(fd, &m, cloexec ? MSG_CMSG_CLOEXEC : 0);
        if (r < 0) {
            if (first && got == 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
                return -1;
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                /* The rest of a frame tlsplane sent in one sendmsg: wait for it. */
                struct pollfd p = {fd, POLLIN, 0};
                poll(&p, 1, 1000);
                continue;
            }
            return -2;
        }
        int broken = (m.msg_flags & MSG_CTRUNC) != 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int d;
                memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
                if (*cfd < 0 && got == 0 && first) {
                    *cfd = d;
                } else {
                    real_close(d);
                    broken = 1;
                }
            }
        }
        if (broken)
            return -2;
        if (r == 0)
            return got == 0 && first ? 0 : -2;
        got += (size_t)r;
    }
    return 1;
}

/* Fills the caller's sockaddr with the 20-byte wire address `w` (family 4/6/0), in the family
 * of the program's listening socket. Returns -1 on a malformed address. */
static int fill_addr(const unsigned char *w, int listen_family, struct sockaddr *addr,
                     socklen_t *addrlen) {
    struct sockaddr_storage ss;
    socklen_t len;
    memset(&ss, 0, sizeof ss);
    uint16_t port = (uint16_t)(w[2] << 8 | w[3]);
    static const unsigned char zero[12];
    if (w[0] == 4 && memcmp(w + 8, zero, 12) != 0)
        return -1;
    if (w[0] != 0 && w[0] != 4 && w[0] != 6)
        return -1;
    if (listen_family == AF_INET6 || w[0] == 6) {
        struct sockaddr_in6 *a = (void *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(port);
        if (w[0] == 6) {
            memcpy(&a->sin6_addr, w + 4, 16);
        } else if (w[0] == 4) {
            a->sin6_addr.s6_addr[10] = 0xff;
            a->sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a->sin6_addr.s6_addr[12], w + 4, 4);
        }
        len = sizeof *a;
    } else {
        struct sockaddr_in *a = (void *)&ss;
        a->sin_family = AF_INET;
        a->sin_port = htons(port);
        memcpy(&a->sin_addr, w + 4, 4);
        len = sizeof *a;
    }
    if (addr && addrlen) {
        memcpy(addr, &ss, *addrlen < len ? *addrlen : len);
        *addrlen = len;
    }
    return 0;
}

struct again {
    int slot, fd;
    unsigned gen;
};

/* Connects to the hand-off socket again every 200 ms (tlsplane restarting removes and
 * re-creates it) and puts the connection on the program's descriptor, unless the program
 * closed it meanwhile. */
static void *reconnect(void *arg) {
    struct again a = *(struct again *)arg;
    free(arg);
    for (;;) {
        struct timespec ts = {0, 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s < 0)
            continue;
        int ok = connect(s, (struct sockaddr *)&cfg.path, cfg.path_len) == 0;
        pthread_mutex_lock(&table_lock);
        struct taken *t = &taken[a.slot];
        int mine = t->fd == a.fd && t->gen == a.gen;
        if (mine && ok && replace(a.fd, s) == 0) {
            __atomic_store_n(&t->lost, 0, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&table_lock);
            note("reconnected to TLSPLANE_HANDOFF", 0);
            return NULL;
        }
        pthread_mutex_unlock(&table_lock);
        if (!(mine && ok))
            real_close(s); /* (replace closed it if it failed) */
        if (!mine)
            return NULL;
    }
}

/* The hand-off connection is gone: accept fails once, and until a thread has reconnected
 * nothing arrives. */
static int lose(struct taken *t, int fd) {
    note("the hand-off connection is closed or broken; reconnecting", 0);
    /* A listening Unix socket on an unnamed abstract address: never readable (an unconnected
     * stream socket would report POLLHUP and spin the program's poll loop). */
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sa_family_t unnamed = AF_UNIX;
    if (s >= 0 && bind(s, (struct sockaddr *)&unnamed, sizeof unnamed) == 0 &&
        real_listen(s, 0) == 0)
        replace(fd, s);
    else if (s >= 0)
        real_close(s);
    __atomic_add_fetch(&t->epoch, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&t->lost, 1, __ATOMIC_RELEASE);
    struct again *a = malloc(sizeof *a);
    if (a) {
        pthread_mutex_lock(&table_lock);
        a->slot = (int)(t - taken);
        a->fd = fd;
        a->gen = t->gen;
        pthread_mutex_unlock(&table_lock);
        /* The thread takes no signals: they stay the program's threads' business. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t attr;
        pthread_t th;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &attr, reconnect, a) != 0)
            free(a);
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    errno = ECONNABORTED;
    return -1;
}

static int handoff_accept(struct taken *t, int fd, struct sockaddr *addr, socklen_t *addrlen,
                          int flags) {
    while (__atomic_load_n(&t->lost, __ATOMIC_ACQUIRE)) {
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0 && fl & O_NONBLOCK) {
            errno = EAGAIN;
            return -1;
        }
        struct timespec ts = {0, 100 * 1000 * 1000};
        if (nanosleep(&ts, NULL) < 0 && errno == EINTR)
            return -1;
    }
    int cloexec = (flags & SOCK_CLOEXEC) != 0;
    if (fcntl(fd, F_GETFL) & O_NONBLOCK) {
        /* Another thread is reading a frame: nothing for this non-blocking call. */
        if (pthread_mutex_trylock(&t->lock) != 0) {
            errno = EAGAIN;
            return -1;
        }
    } else {
        pthread_mutex_lock(&t->lock);
    }
    unsigned char *frame = t->frame;
    for (;;) {
        int cfd = -1;
        int r = read_exact(fd, frame, 8, &cfd, cloexec, 1);
        if (r == -1) {
            int e = errno;
            pthread_mutex_unlock(&t->lock);
            errno = e;
            return -1;
        }
        if (r == 0 || r == -2) {
            if (cfd >= 0)
                real_close(cfd);
            int ret = lose(t, fd);
            pthread_mutex_unlock(&t->lock);
            return ret;
        }
        size_t len = (size_t)(frame[6] << 8 | frame[7]);
        if (memcmp(frame, "TLPH", 4) != 0 || frame[4] != 1 || len < 8 || len > FRAME_MAX ||
            read_exact(fd, frame + 8, len - 8, &cfd, cloexec, 0) != 1) {
            if (cfd >= 0)
                real_close(cfd);
            int ret = lose(t, fd);
            pthread_mutex_unlock(&t->lock);
            return ret;
        }
        if (frame[5] != KIND_CONNECTION || cfd < 0) {
            if (cfd >= 0)
                real_close(cfd); /* a REPLY or a later kind: skipped whole */
            continue;
        }
        /* CONNECTION: v1 minimum 64 + n + m; plane 1..3. */
        if (len < 64 || len < 64u + frame[62] || len < 64u + frame[62] + frame[63 + frame[62]] ||
            frame[16] < 1 || frame[16] > 3 || fill_addr(frame + 22, t->bound.ss_family, addr,
                                                        addrlen) < 0) {
            real_close(cfd);
            continue;
        }
        int fl = fcntl(cfd, F_GETFL);
        int want = flags & SOCK_NONBLOCK ? fl | O_NONBLOCK : fl & ~O_NONBLOCK;
        if (fl < 0 || (want != fl && fcntl(cfd, F_SETFL, want) < 0)) {
            real_close(cfd);
            continue;
        }
        if (frame[16] == PLANE_KERNEL) {
            uint64_t id = 0;
            for (int i = 8; i < 16; i++)
                id = id << 8 | frame[i];
            kremember(cfd, t, id);
        } else {
            kforget(cfd); /* a stale entry: the number was closed behind the shim's back */
        }
        pthread_mutex_unlock(&t->lock);
        return cfd;
    }
}

int accept4(int fd, struct sockaddr *addr, socklen_t *addrlen, int flags) {
    pthread_once(&once, init);
    struct taken *t = find(fd);
    if (!t)
        return real_accept4(fd, addr, addrlen, flags);
    return handoff_accept(t, fd, addr, addrlen, flags);
}

int accept(int fd, struct sockaddr *addr, socklen_t *addrlen) {
    pthread_once(&once, init);
    struct taken *t = find(fd);
    if (!t)
        return real_accept(fd, addr, addrlen);
    return handoff_accept(t, fd, addr, addrlen, 0);
}

int getsockname(int fd, struct sockaddr *addr, socklen_t *addrlen) {
    pthread_once(&once, init);
    struct taken *t = find(fd);
    if (!t)
        return real_getsockname(fd, addr, addrlen);
    if (!addr || !addrlen) {
        errno = EFAULT;
        return -1;
    }
    memcpy(addr, &t->bound, *addrlen < t->bound_len ? *addrlen : t->bound_len);
    *addrlen = t->bound_len;
    return 0;
}

int close(int fd) {
    pthread_once(&once, init);
    kforget(fd);
    if (__atomic_load_n(&n_taken, __ATOMIC_ACQUIRE) > 0) {
        pthread_mutex_lock(&table_lock);
        for (int i = 0; i < MAX_TAKEN; i++)
            if (taken[i].fd == fd) {
                taken[i].fd = -1;
                __atomic_sub_fetch(&n_taken, 1, __ATOMIC_RELEASE);
            }
        pthread_mutex_unlock(&table_lock);
    }
    return real_close(fd);
}

ssize_t read(int fd, void *buf, size_t len) {
    struct kconn *k = kfind(fd);
    if (!k)
        return REAL(read)(fd, buf, len);
    struct rd a = {.op = 0, .fd = fd, .buf = buf, .len = len};
    return kread(k, &a);
}

ssize_t recv(int fd, void *buf, size_t len, int flags) {
    struct kconn *k = kfind(fd);
    if (!k)
        return REAL(recv)(fd, buf, len, flags);
    struct rd a = {.op = 1, .fd = fd, .buf = buf, .len = len, .flags = flags};
    return kread(k, &a);
}

ssize_t recvfrom(int fd, void *buf, size_t len, int flags, struct sockaddr *from,
                 socklen_t *fromlen) {
    struct kconn *k = kfind(fd);
    if (!k)
        return REAL(recvfrom)(fd, buf, len, flags, from, fromlen);
    struct rd a = {.op = 2,
                   .fd = fd,
                   .buf = buf,
                   .len = len,
                   .flags = flags,
                   .from = from,
                   .fromlen = fromlen};
    return kread(k, &a);
}

ssize_t readv(int fd, const struct iovec *iov, int iovcnt) {
    struct kconn *k = kfind(fd);
    if (!k)
        return REAL(readv)(fd, iov, iovcnt);
    struct rd a = {.op = 3, .fd = fd, .iov = iov, .iovcnt = iovcnt};
    return kread(k, &a);
}

/* _FORTIFY_SOURCE turns read/recv/recvfrom with a buffer of known size into these. */
ssize_t __read_chk(int fd, void *buf, size_t len, size_t buflen) {
    struct kconn *k = kfind(fd);
    if (!k || len > buflen)
        return REAL_AS(read_chk, "__read_chk")(fd, buf, len, buflen);
    struct rd a = {.op = 0, .fd = fd, .buf = buf, .len = len};
    return kread(k, &a);
}

ssize_t __recv_chk(int fd, void *buf, size_t len, size_t buflen, int flags) {
    struct kconn *k = kfind(fd);
    if (!k || len > buflen)
        return REAL_AS(recv_chk, "__recv_chk")(fd, buf, len, buflen, flags);
    struct rd a = {.op = 1, .fd = fd, .buf = buf, .len = len, .flags = flags};
    return kread(k, &a);
}

ssize_t __recvfrom_chk(int fd, void *buf, size_t len, size_t buflen, int flags,
                       struct sockaddr *from, socklen_t *fromlen) {
    struct kconn *k = kfind(fd);
    if (!k || len > buflen)
        return REAL_AS(recvfrom_chk, "__recvfrom_chk")(fd, buf, len, buflen, flags, from, fromlen);
    struct rd a = {.op = 2,
                   .fd = fd,
                   .buf = buf,
                   .len = len,
                   .flags = flags,
                   .from = from,
                   .fromlen = fromlen};
    return kread(k, &a);
}

/* shutdown(SHUT_WR) would send the TCP FIN before tlsplane's close_notify: on a remembered
 * descriptor it sends CLOSE instead (tlsplane sends close_notify after what was written). */
int shutdown(int fd, int how) {
    pthread_once(&once, init);
    struct kconn *k = kfind(fd);
    if (!k || how == SHUT_RD)
        return real_shutdown(fd, how);
    if (how != SHUT_WR && how != SHUT_RDWR)
        return (int)fail(EINVAL);
    if (how == SHUT_RDWR && real_shutdown(fd, SHUT_RD) < 0)
        return -1;
    send_close(k);
    return 0;
}

int dup2(int old, int fd) {
    pthread_once(&once, init);
    if (old != fd && kfind(fd) && fcntl(old, F_GETFD) >= 0)
        kforget(fd); /* fd's connection is being closed */
    return real_dup2(old, fd);
}

int dup3(int old, int fd, int flags) {
    pthread_once(&once, init);
    if (old != fd && kfind(fd) && fcntl(old, F_GETFD) >= 0)
        kforget(fd);
    return real_dup3(old, fd, flags);
}
