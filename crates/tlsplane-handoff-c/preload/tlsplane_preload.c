/*
 * tlsplane_preload.c - LD_PRELOAD shim: an unmodified, dynamically linked server receives the
 * connections `tlsplane handoff` hands off, on a listening socket it names (issue 21).
 *
 *   cc -shared -fPIC -O2 -o libtlsplane_preload.so tlsplane_preload.c -ldl -pthread
 *   TLSPLANE_HANDOFF=/run/tlsplane/app.sock TLSPLANE_LISTEN=127.0.0.1:8000 \
 *     LD_PRELOAD=./libtlsplane_preload.so python3 -m http.server 8000 --bind 127.0.0.1
 *
 * TLSPLANE_HANDOFF      the hand-off Unix socket of `tlsplane handoff` (--handoff-socket).
 * TLSPLANE_LISTEN       which listening socket to take over: PORT, IPV4:PORT or [IPV6]:PORT,
 *                       as the program binds it. Either unset: the shim does nothing.
 * TLSPLANE_HANDOFF_UID  the user ids tlsplane may run as: decimal, separated by commas, no
 *                       spaces (999 or 999,1000), at most 16. Unset or empty: the program's
 *                       own effective uid. Root is trusted either way. Malformed: listen on
 *                       the socket fails with EINVAL.
 *
 * Who answers at the path: anyone can bind it while tlsplane is away (a restart removes the
 * socket), and whatever that process handed over would reach the program with a forged
 * client address and be answered with what the program serves. So before the shim uses a
 * hand-off connection (at listen, and at each reconnect) it checks the listening process's
 * user id (SO_PEERCRED) against root and TLSPLANE_HANDOFF_UID's ids. Another user: listen
 * fails with EPERM; while reconnecting, the connection is closed before a byte is read and the
 * shim tries again 200 ms later. Both say so on stderr ("tlsplane-preload: refusing the
 * hand-off socket PATH: it is served by uid N, not root ..."), while reconnecting once per
 * 10 s at most, with the number refused meanwhile. Once the check passes, the shim's first
 * frame is a HELLO with ENDS_WITH_CLOSE (docs/HANDOFF.md): it promises a CLOSE before every
 * connection it was handed ends, on both planes, so tlsplane resets a connection whose end
 * comes without one (a process killed or crashed holding it): a cut answer never looks whole.
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
 * What the program then sees on an accepted descriptor: on the user relay plane (2) one end
 * of a socketpair carrying plaintext; end of stream is the client's close_notify or TCP close.
 * getpeername/getsockname on it report an AF_UNIX socket, and TCP socket options fail
 * (EOPNOTSUPP): the client's address is the one accept returned. The shim remembers it as
 * below (kernel plane), to send its CLOSE: close, dup2/dup3 over it, or shutdown(SHUT_WR or
 * SHUT_RDWR) sends a CLOSE (tlsplane then relays close_notify after everything the program
 * wrote) before the descriptor goes or the socket is shut down. Reads are not intercepted.
 *
 * Kernel plane (1): the descriptor is the kTLS TCP socket, and tlsplane keeps a duplicate of
 * it and the traffic secrets. A plain read fails with EIO at a control record; the shim
 * handles those so that the program sees a plain byte stream:
 *   - accept/accept4 remember a handed descriptor (both planes): its connection id, plane, the
 *     hand-off connection it came from, the accepting pid and the socket's inode, in a static
 *     array indexed by descriptor (no allocation; lookups are lock-free atomic loads, and cost
 *     one load while no handed descriptor is open). Descriptors 65536 and above are still
 *     returned but not remembered: their control records reach the program as EIO and closing
 *     them sends no CLOSE, so tlsplane resets them (logged once).
 *   - read, recv, recvfrom, readv (and __read_chk, __recv_chk, __recvfrom_chk, which
 *     _FORTIFY_SOURCE calls) on a remembered descriptor call the real function; on EIO the
 *     shim reads the control record alone with recvmsg(MSG_DONTWAIT) and a control buffer
 *     (SOL_TLS 282 / TLS_GET_RECORD_TYPE 2) into 64 bytes of its own stack:
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
 *       anything else (an alert of the wrong size, a handshake record that is empty or fills
 *         the 64 bytes (a KeyUpdate has 5), a content type with no business after the
 *         handshake) -> -1 EPROTO, and later reads too.
 *     A read that gets EKEYEXPIRED first (another thread forwarded the KeyUpdate) waits the
 *     same way. If data comes instead of the control record (another thread read it
 *     meanwhile) it is the caller's, 64 bytes at most; a read of fewer bytes then loses the
 *     rest. recvmsg and recvmmsg are not intercepted: a program calling them on the
 *     connection sees the kernel's behaviour (EIO without a control buffer). When the
 *     descriptor's inode is no longer the remembered socket's (it was closed where the shim
 *     cannot see, e.g. by fclose, and its number reused), the EIO goes to the program
 *     untouched.
 *   - close, and dup2/dup3 onto a remembered descriptor, send a CLOSE frame (tlsplane then
 *     sends close_notify on its duplicate after everything the program wrote, and does a
 *     lingering close), forget the descriptor, and really close it; the REPLY is not awaited.
 *     The CLOSE is queued on the hand-off connection before the descriptor goes (tlsplane
 *     reads the requests already queued before it judges an end): when the non-blocking send
 *     finds no room, a private duplicate of the descriptor keeps the connection open and a
 *     thread of the shim's (started then, signals blocked) sends the CLOSE, then closes the
 *     duplicate; the program's close returns at once.
 *     shutdown(SHUT_WR or SHUT_RDWR) sends CLOSE at once and does not shut the socket's
 *     sending side (its TCP FIN would precede tlsplane's close_notify; SHUT_RDWR still shuts
 *     the receiving side); the later close sends no second CLOSE. What the program writes
 *     after that shutdown would follow the close_notify: don't. Copies made with dup(),
 *     fcntl(F_DUPFD) or received otherwise are not remembered: reads on them are not handled
 *     and closing them sends nothing. A process that exits (exit, _exit) holding a connection
 *     it accepted sends no CLOSE for it: tlsplane resets it.
 *   - Frames (CLOSE: 20 bytes, KEY_UPDATE: 86 at most) go out in one non-blocking send(2)
 *     each, with MSG_NOSIGNAL: on a Unix stream socket a message that small is queued whole
 *     or not at all, so frames of several threads or processes never interleave, and no lock
 *     is held while sending. On EAGAIN (tlsplane is not reading) the sending thread alone (the
 *     shim's sender for a close, see above) waits for room, 2 s at most, then gives up: the
 *     connection then ends without a CLOSE (a reset), a KeyUpdate fails the read with
 *     ECONNRESET. The same when the hand-off connection the descriptor came
 *     from is gone (tlsplane stopped or restarted: accept saw it end, whether or not the shim
 *     has reconnected since) or the send fails (EPIPE): nothing can be sent. A program that
 *     closes its listening socket while connections it was handed remain open (a forked child
 *     that closes it, then serves) keeps a duplicate of the hand-off connection for their
 *     CLOSEs until the last of them goes. If tlsplane restarts after a KEY_UPDATE went out, the
 *     new one answers REPLY status 1 (unknown connection), which accept skips, and the read
 *     keeps getting EKEYEXPIRED until the 5 s bound -> ECONNRESET.
 *   - fork: a connection that several processes hold (accepted, then forked) gets its CLOSE
 *     from the last of them to let go, once. Each has a count of the processes holding it, in
 *     memory shared with every process forked after the shim loaded (4096 connections open
 *     at once at most; past that a close sends CLOSE at once, logged once): accept counts 1; a
 *     fork counts 1 more for each connection the parent holds, in the pthread_atfork prepare
 *     handler, so before the child exists and before any close in the parent (the child
 *     then corrects for a connection another thread accepted or closed during the fork);
 *     close, dup2/dup3 over it, exec (execve, execv, execvp, execvpe, fexecve: the new
 *     program cannot close what it does not know of), and a voluntary exit (exit, _exit,
 *     _Exit) of a process that inherited it count 1 less. So an accept-then-fork server
 *     (socketserver.ForkingMixIn: the parent closes its copy at once, the child serves and
 *     closes) gets its close_notify at the child's close, and a threaded server whose
 *     children exit or exec at its parent's. A child killed by a signal counts nothing
 *     less: its connection gets no CLOSE, and its client a reset. No kcmp(2) is needed (it
 *     fails with EPERM once a server drops root, and under seccomp), no bound on children,
 *     no watcher thread. Not seen: children of vfork and posix_spawn (they share or copy no
 *     count; their exec closes close-on-exec copies), and execl, execlp and execle (glibc
 *     calls its own execve): a child that execs through them keeps its count, and the
 *     connection gets no CLOSE once its parent closes it (a reset). A child forwards
 *     KeyUpdates on the inherited hand-off connection.
 *   - The documented limit of the kernel plane: a client KeyUpdate with update_requested makes
 *     tlsplane send our KeyUpdate on its duplicate under the old TX key and install the next;
 *     the reading thread waits meanwhile, but a program writing from another thread during
 *     that brief window may have a record encrypted under the old key land after ours, and
 *     the client then fails the connection.
 *
 * Threads, signals and fork:
 *   - close, read, recv, recvfrom, readv (and the _chk forms), shutdown, dup2 and dup3 take no
 *     lock: the tables are read and changed with atomics, so these stay as safe in a signal
 *     handler as the calls they wrap, and a child forked while another thread was inside one
 *     inherits no held lock. close() of the taken-over socket waits only for another thread
 *     that is, that very moment, putting a connection on the descriptor, reading a frame
 *     already queued on it, or sending a frame on it (a dup3, recvmsg or a non-blocking
 *     send, with signals blocked: never the thread the close interrupted), so that the
 *     number never names another file while the shim uses it.
 *   - accept/accept4 read frames under a lock that every process forked after listen shares
 *     (a robust, process-shared mutex in shared memory), held only while reading a frame
 *     already queued: so a pre-fork server, whose processes accept on the shared socket
 *     (blocking, or non-blocking after poll), gets whole frames in each. A non-blocking accept
 *     while another thread or process holds it returns EAGAIN; a blocking one waits in poll(2)
 *     for the next frame (a signal ends it with EINTR when a handler without SA_RESTART is
 *     installed, and it goes on otherwise, as accept(2) would). A process that dies holding it
 *     in the middle of a frame leaves a stream that cannot be framed: the next holder shuts it
 *     down, and each process reconnects.
 *   - A child forked while tlsplane was away starts its own reconnecting thread (threads are
 *     not inherited). fork(2) (and any fork that runs pthread_atfork handlers, daemon(3)'s)
 *     is counted (see above); vfork, posix_spawn and clone are not, and need not be: their
 *     children exec. A vfork child shares the parent's memory, so its exec gives back
 *     nothing (no fork handler ran in it: the shim sees the pid is not its own).
 *
 * Limits: one hand-off connection per taken-over socket and process (processes forked after
 * listen share it until tlsplane restarts; then each connects on its own). When tlsplane closes
 * the hand-off connection (it stops or restarts) or sends a prefix that cannot be framed,
 * accept fails once with ECONNABORTED, the descriptor is replaced by a socket that never
 * becomes readable (accept meanwhile blocks, or returns EAGAIN when non-blocking), and a
 * thread of the shim's (signals blocked) connects again every 200 ms, then puts the new
 * connection on the descriptor. Each replacement makes the descriptor a new file: poll and
 * select see it at their next call, but an epoll set that held the descriptor has lost it (add
 * the socket to epoll after listen(); after a tlsplane restart an epoll program gets no more
 * connections). Programs that make system calls without the C library (Go, static binaries)
 * are not affected by LD_PRELOAD at all.
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
#include <semaphore.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
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
/* Room for a control record: an alert has 2 bytes, a KeyUpdate 5. */
#define CTL_ROOM 64
#define SOL_TLS_ 282
#define TLS_GET_RECORD_TYPE_ 2
#define MAX_UIDS 16
/* Connections whose holders (processes) are counted across fork, open at once. */
#define HOLD_SLOTS 4096
#define HOLD_SENT 0x80000000ull
#define HOLD_COUNT 0x7fffffffull
#define KIND_HELLO 5
#define ENDS_WITH_CLOSE 1
/* The rest of a frame whose first bytes came: tlsplane sends each in one sendmsg. */
#define FRAME_TAIL_MS 2000
#define SEND_WAIT_MS 2000
#define RECONNECT_NS (200 * 1000 * 1000)
#define REFUSAL_LOG_SECONDS 10

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
static pid_t (*real_fork)(void);
static void (*real__exit)(int);
static int (*real_execve)(const char *, char *const[], char *const[]);
static int (*real_execv)(const char *, char *const[]);
static int (*real_execvp)(const char *, char *const[]);
static int (*real_execvpe)(const char *, char *const[], char *const[]);
static int (*real_fexecve)(int, char *const[], char *const[]);

static struct {
    int enabled;
    int fail; /* an errno that listen on the named socket fails with: the shim cannot serve */
    struct sockaddr_un path;
    socklen_t path_len;
    uint16_t port;
    int family; /* 0: any address; AF_INET/AF_INET6: addr must match */
    unsigned char addr[16];
    uid_t uids[MAX_UIDS]; /* trusted besides root */
    int n_uids;
} cfg;

/* A taken-over listening descriptor and the address the program bound it to. Every field
 * another thread may change is read and written with atomics: nothing here takes a lock. */
struct taken {
    int fd;         /* -1: free; -2: being claimed by listen */
    unsigned gen;   /* claims of this slot, so that a reconnecting thread knows its own */
    int lost;       /* the hand-off connection is gone; a thread reconnects */
    unsigned epoch; /* hand-off connections lost on this slot: a connection handed over
                     * before the last loss belongs to a tlsplane that is gone */
    int busy;       /* threads between checking fd and a dup3 or send on it: close waits */
    uint64_t conn_ino; /* the hand-off connection's inode */
    int keep;          /* atomic: a duplicate of the hand-off connection, kept after the
                        * program closed the socket while connections it was handed remain
                        * (their CLOSEs go out on it), else -1 */
    struct sockaddr_storage bound;
    socklen_t bound_len;
    unsigned char frame[FRAME_MAX]; /* the frame being read, under the slot's frame lock */
};

/* The frame lock of a slot, in memory shared with the processes forked after listen. */
struct frame_lock {
    pthread_mutex_t m; /* robust, process-shared, error-checking */
    uint64_t reading;  /* atomic: the inode of the connection the holder is reading a frame
                        * of, 0 between frames */
};

static struct taken taken[MAX_TAKEN];
static int n_taken; /* atomic: slots in use, a fast path for every close */
static struct frame_lock *frame_locks; /* MAX_TAKEN, shared */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void note(const char *what, int e) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "tlsplane-preload: %s%s%s\n", what, e ? ": " : "",
                     e ? strerror(e) : "");
    if (n > 0)
        (void)!write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t inode_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (uint64_t)st.st_ino : 0;
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
    int closed;    /* atomic: a CLOSE was sent (at shutdown; only when hold is -1) */
    int kernel;    /* plane 1: reads handle control records */
    int fd;
    int hold;      /* its slot in `holders`, -1 if none was free */
    uint32_t hold_gen; /* the slot's claim this connection is */
    unsigned prep; /* the fork whose prepare handler counted it */
    pid_t pid;     /* the process that accepted it */
    int slot;
    unsigned gen, epoch;
    uint64_t conn_id;
    uint64_t ino; /* the socket's inode: a descriptor closed behind the shim's back and its
                   * number reused is not taken for the connection */
};

static struct kconn kconns[MAX_KFD];
static int n_kernel; /* remembered descriptors (atomic) */
static pid_t my_pid; /* atomic: set at init and in each forked child */
static int n_pending; /* atomic: CLOSEs queued for the sender thread (see send_close) */
static int kfd_high; /* 1 + the highest fd ever remembered (atomic) */
static int warned_kfd; /* the bound was logged (atomic) */
static int warned_holders; /* the holders' bound was logged (atomic) */
static unsigned next_request; /* request ids of KEY_UPDATE/CLOSE frames (atomic) */

static struct kconn *kfind(int fd) {
    if ((unsigned)fd >= MAX_KFD || __atomic_load_n(&n_kernel, __ATOMIC_ACQUIRE) == 0 ||
        !__atomic_load_n(&kconns[fd].state, __ATOMIC_ACQUIRE))
        return NULL;
    return &kconns[fd];
}

/* A vfork child (Python's subprocess, posix_spawn) shares this memory with its parent, whose
 * tables these are: it runs no fork handler, so my_pid still names the parent. What it
 * closes before its exec is its own copy, nothing to count. */
static int in_vfork_child(void) {
    return getpid() != __atomic_load_n(&my_pid, __ATOMIC_ACQUIRE);
}

/* A remembered kernel-plane descriptor: its reads handle control records. */
static struct kconn *kfind_kernel(int fd) {
    struct kconn *k = kfind(fd);
    return k && k->kernel ? k : NULL;
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

/* ---- Using a slot's descriptor without a lock ----
 *
 * A thread that puts a connection on the program's descriptor (dup3) or sends a frame on it
 * must not do so after the program closed it: the number may already name another file. So
 * it counts itself in `busy`, then checks that the slot still holds the descriptor; close()
 * first clears the slot, then waits for `busy` to drop to 0 before really closing. Both
 * orders are sequentially consistent, so one of the two sees the other. Signals are blocked
 * in between: a handler that closes the socket on this thread cannot then wait for it. */
static int enter(struct taken *t, int fd, unsigned gen, sigset_t *old) {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, old);
    __atomic_add_fetch(&t->busy, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&t->fd, __ATOMIC_SEQ_CST) == fd &&
        __atomic_load_n(&t->gen, __ATOMIC_ACQUIRE) == gen)
        return 1;
    __atomic_sub_fetch(&t->busy, 1, __ATOMIC_SEQ_CST);
    pthread_sigmask(SIG_SETMASK, old, NULL);
    return 0;
}

static void leave(struct taken *t, const sigset_t *old) {
    __atomic_sub_fetch(&t->busy, 1, __ATOMIC_SEQ_CST);
    pthread_sigmask(SIG_SETMASK, old, NULL);
}

/* As enter, for the duplicate kept after the program closed the socket: *fd is set to it. */
static int enter_keep(struct taken *t, unsigned gen, int *fd, sigset_t *old) {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, old);
    __atomic_add_fetch(&t->busy, 1, __ATOMIC_SEQ_CST);
    int kf = __atomic_load_n(&t->keep, __ATOMIC_SEQ_CST);
    if (kf >= 0 && __atomic_load_n(&t->gen, __ATOMIC_ACQUIRE) == gen) {
        *fd = kf;
        return 1;
    }
    __atomic_sub_fetch(&t->busy, 1, __ATOMIC_SEQ_CST);
    pthread_sigmask(SIG_SETMASK, old, NULL);
    return 0;
}

static void wait_idle(struct taken *t) {
    while (__atomic_load_n(&t->busy, __ATOMIC_SEQ_CST) > 0) {
        struct timespec ts = {0, 50 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* No connection is remembered any more: the duplicates kept for their CLOSEs go. */
static void drop_keeps(void) {
    if (__atomic_load_n(&n_kernel, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&n_pending, __ATOMIC_ACQUIRE))
        return;
    for (int i = 0; i < MAX_TAKEN; i++) {
        if (__atomic_load_n(&taken[i].keep, __ATOMIC_ACQUIRE) < 0)
            continue;
        int kf = __atomic_exchange_n(&taken[i].keep, -1, __ATOMIC_SEQ_CST);
        if (kf >= 0) {
            wait_idle(&taken[i]);
            REAL(close)(kf);
        }
    }
}

/* Sends frame f (n bytes, one send: see the header) on the hand-off connection connection k
 * came from. Returns -1 when that connection is gone (tlsplane stopped, restarted, or the
 * program closed the socket), or no room came within SEND_WAIT_MS. */
static int send_frame(const struct kconn *k, const unsigned char *f, size_t n, int wait) {
    struct taken *t = &taken[k->slot];
    long deadline = now_ms() + SEND_WAIT_MS;
    for (;;) {
        int fd = __atomic_load_n(&t->fd, __ATOMIC_ACQUIRE);
        sigset_t old;
        if ((fd < 0 || !enter(t, fd, k->gen, &old)) && !enter_keep(t, k->gen, &fd, &old))
            return -1;
        if (__atomic_load_n(&t->epoch, __ATOMIC_ACQUIRE) != k->epoch ||
            __atomic_load_n(&t->lost, __ATOMIC_ACQUIRE)) {
            leave(t, &old);
            return -1;
        }
        ssize_t r = send(fd, f, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        int e = errno;
        if (r >= 0 && (size_t)r < n)
            real_shutdown(fd, SHUT_RDWR); /* never seen: the stream would be misframed */
        leave(t, &old);
        if (r >= 0)
            return (size_t)r == n ? 0 : -1;
        long left = deadline - now_ms();
        if (e != EAGAIN && e != EWOULDBLOCK && e != EINTR)
            return -1;
        if (!wait && e != EINTR)
            return -2;
        if (left <= 0)
            return -1;
        /* Waiting for room holds nothing: the descriptor may be closed meanwhile, which
         * poll reports (POLLNVAL) and the next check sees. */
        struct pollfd p = {fd, POLLOUT, 0};
        poll(&p, 1, (int)left);
    }
}

/* CLOSEs that found no room when the program closed the descriptor: a private duplicate
 * of the descriptor keeps the connection from ending before its CLOSE is queued, and the
 * sender thread sends each (waiting for room, SEND_WAIT_MS at most), then closes the
 * duplicate. */
#define MAX_PENDING 256
static struct pending {
    int state; /* atomic: 0 free, 1 being filled, 2 queued, 3 being sent */
    int dup;
    struct kconn k;
} pending[MAX_PENDING];
static sem_t pending_sem; /* posted per queued CLOSE (sem_post is async-signal-safe) */
static pid_t sender_pid;  /* atomic: the process whose sender thread runs */

static void *send_pending(void *arg) {
    (void)arg;
    for (;;) {
        while (sem_wait(&pending_sem) < 0)
            ;
        for (int i = 0; i < MAX_PENDING; i++) {
            struct pending *p = &pending[i];
            int queued = 2;
            if (!__atomic_compare_exchange_n(&p->state, &queued, 3, 0, __ATOMIC_ACQ_REL,
                                             __ATOMIC_RELAXED))
                continue;
            unsigned char f[20];
            frame_head(f, KIND_CLOSE, sizeof f, p->k.conn_id);
            send_frame(&p->k, f, sizeof f, 1);
            REAL(close)(p->dup);
            __atomic_store_n(&p->state, 0, __ATOMIC_RELEASE);
            __atomic_sub_fetch(&n_pending, 1, __ATOMIC_ACQ_REL);
            drop_keeps();
        }
    }
    return NULL;
}

/* Hands the CLOSE of connection k, open at fd, to the sender thread: 0 if it cannot. */
static int queue_close(const struct kconn *k, int fd) {
    pid_t self = getpid();
    pid_t was = __atomic_load_n(&sender_pid, __ATOMIC_ACQUIRE);
    if (was != self) {
        /* The first time in this process (threads are not inherited across fork); another
         * thread that got here first starts it. */
        if (!__atomic_compare_exchange_n(&sender_pid, &was, self, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            goto queue;
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t attr;
        pthread_t th;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&th, &attr, send_pending, NULL) == 0;
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!ok) {
            __atomic_store_n(&sender_pid, was, __ATOMIC_RELEASE);
            return 0;
        }
    }
queue:
    for (int i = 0; i < MAX_PENDING; i++) {
        struct pending *p = &pending[i];
        int free_slot = 0;
        if (!__atomic_compare_exchange_n(&p->state, &free_slot, 1, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_RELAXED))
            continue;
        p->dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (p->dup < 0) {
            __atomic_store_n(&p->state, 0, __ATOMIC_RELEASE);
            return 0;
        }
        p->k = *k;
        __atomic_add_fetch(&n_pending, 1, __ATOMIC_ACQ_REL);
        __atomic_store_n(&p->state, 2, __ATOMIC_RELEASE);
        sem_post(&pending_sem);
        return 1;
    }
    return 0;
}

/* Sends connection k's CLOSE. With fd (the program's descriptor of it, still open) and no
 * room now, the sender thread sends it while a duplicate of fd holds the connection open;
 * otherwise (fd -1, or the sender cannot take it) this thread waits for room. */
static void send_close(const struct kconn *k, int fd) {
    unsigned char f[20];
    frame_head(f, KIND_CLOSE, sizeof f, k->conn_id);
    if (fd >= 0 && (send_frame(k, f, sizeof f, 0) != -2 || queue_close(k, fd)))
        return;
    send_frame(k, f, sizeof f, 1);
}

/* ---- Who holds a connection: counts shared across fork ----
 *
 * Each remembered connection has a slot in `holders` (memory shared with every process
 * forked after init): how many processes hold it, and whether its CLOSE went out. accept
 * counts 1; a fork counts 1 more for each connection the parent holds (in the prepare
 * handler, before the child exists, so that no close in the parent can precede it); a close,
 * dup2/dup3 over it, exec, or a voluntary exit counts 1 less. Whoever brings it to 0 sends
 * the CLOSE. A process killed by a signal counts nothing less: the connections it held get
 * no CLOSE, and tlsplane resets them (the receiver announced ENDS_WITH_CLOSE). */
/* A slot: the claim's generation << 32 | HOLD_SENT | the count (0: free). The generation
 * keeps a late count (a fork counting a connection another thread just let go) off the next
 * connection to claim the slot. */
static uint64_t *holders; /* HOLD_SLOTS, shared */
static unsigned next_hold; /* atomic: where the next claim starts looking */

/* Claims a free slot for a new connection (count 1): its index, or -1. */
static int hold_claim(uint32_t *gen) {
    if (!holders)
        return -1;
    unsigned start = __atomic_fetch_add(&next_hold, 1, __ATOMIC_RELAXED);
    for (unsigned i = 0; i < HOLD_SLOTS; i++) {
        unsigned at = (start + i) % HOLD_SLOTS;
        uint64_t v = __atomic_load_n(&holders[at], __ATOMIC_ACQUIRE);
        if (v & HOLD_COUNT)
            continue;
        uint32_t g = (uint32_t)(v >> 32) + 1;
        if (__atomic_compare_exchange_n(&holders[at], &v, (uint64_t)g << 32 | 1, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            *gen = g;
            return (int)at;
        }
    }
    if (!__atomic_exchange_n(&warned_holders, 1, __ATOMIC_RELAXED))
        note("more connections open than the shim counts holders of (4096): closing one of "
             "them sends its CLOSE at once, wherever else it is held (logged once)",
             0);
    return -1;
}

/* One more process holds connection k: 0 if it was let go meanwhile (nothing counted). */
static int hold_more(const struct kconn *k) {
    uint64_t *h = &holders[k->hold];
    uint64_t v = __atomic_load_n(h, __ATOMIC_ACQUIRE);
    do {
        if ((uint32_t)(v >> 32) != k->hold_gen || !(v & HOLD_COUNT))
            return 0;
    } while (!__atomic_compare_exchange_n(h, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return 1;
}

/* CLOSE now (shutdown): unless it went out already, from any process. */
static void close_now(struct kconn *k) {
    if (k->hold < 0) {
        if (!__atomic_exchange_n(&k->closed, 1, __ATOMIC_ACQ_REL))
            send_close(k, -1);
        return;
    }
    uint64_t *h = &holders[k->hold];
    uint64_t v = __atomic_load_n(h, __ATOMIC_ACQUIRE);
    do {
        if ((uint32_t)(v >> 32) != k->hold_gen || !(v & HOLD_COUNT) || (v & HOLD_SENT))
            return;
    } while (!__atomic_compare_exchange_n(h, &v, v | HOLD_SENT, 0, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE));
    send_close(k, -1);
}

/* This process lets go of connection k (a copy: its kconns entry is forgotten): the last
 * holder sends the CLOSE, unless `send` is 0 (a process exiting with a connection it accepted
 * still open: a cut answer must not look whole) or it went out already. fd: the program's
 * descriptor of it, still open (see send_close), or -1. */
static void let_go(const struct kconn *k, int send, int fd) {
    if (k->hold < 0) {
        if (send && !__atomic_load_n(&k->closed, __ATOMIC_ACQUIRE))
            send_close(k, fd);
        return;
    }
    uint64_t *h = &holders[k->hold];
    uint64_t v = __atomic_load_n(h, __ATOMIC_ACQUIRE), next;
    do {
        if ((uint32_t)(v >> 32) != k->hold_gen || !(v & HOLD_COUNT))
            return;
        next = (v & HOLD_COUNT) == 1 ? v & ~(HOLD_COUNT | HOLD_SENT) : v - 1;
    } while (!__atomic_compare_exchange_n(h, &v, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    if (!(next & HOLD_COUNT) && send && !(v & HOLD_SENT))
        send_close(k, fd);
}

/* Forgets fd's connection; 1 with a copy of it in *out, 0 if none was remembered there. */
static int kforget(int fd, struct kconn *out) {
    struct kconn *k = kfind(fd);
    if (!k || !__atomic_exchange_n(&k->state, 0, __ATOMIC_ACQ_REL))
        return 0;
    /* Copied before anything closes fd: until then no accept can be given this number and
     * overwrite the entry. */
    *out = *k;
    __atomic_sub_fetch(&n_kernel, 1, __ATOMIC_RELEASE);
    return 1;
}

/* Closes (or, for dup2/dup3, replaces) descriptor fd through `op`, forgetting its connection:
 * its CLOSE, if this process is the last to hold it, is sent before fd goes (tlsplane reads
 * the requests queued before it judges an end, so it sees the CLOSE first). Only atomics and
 * system calls: safe in a signal handler. */
static int kclose(int fd, int (*op)(int, int, int), int a, int b, int c) {
    struct kconn k;
    if (!kfind(fd) || in_vfork_child() || !kforget(fd, &k))
        return op(a, b, c);
    if (inode_of(fd) != k.ino) {
        /* Closed where the shim could not see, and the number reused: let go of it all the
         * same, and close what is there now. */
        int r = op(a, b, c);
        int e = errno;
        let_go(&k, 1, -1);
        errno = e;
        return r;
    }
    let_go(&k, 1, fd);
    drop_keeps();
    return op(a, b, c);
}

static int op_close(int fd, int unused1, int unused2) {
    (void)unused1;
    (void)unused2;
    return REAL(close)(fd);
}

static int op_dup3(int old, int fd, int flags) {
    return REAL(dup3)(old, fd, flags);
}

/* fd was just received, so a connection still remembered there was closed where the shim
 * could not see (fclose, close_range) and the number reused: this process let go of it. */
static void kforget_stale(int fd) {
    struct kconn k;
    if (kforget(fd, &k))
        let_go(&k, 1, -1);
}

/* Remembers descriptor fd, a connection on `plane` just received from hand-off slot t. */
static void kremember(int fd, struct taken *t, uint64_t conn_id, int plane) {
    if ((unsigned)fd >= MAX_KFD) {
        if (!__atomic_exchange_n(&warned_kfd, 1, __ATOMIC_RELAXED))
            note("a handed descriptor is above the shim's bound (65535): its control records "
                 "are not handled, and closing it sends no CLOSE (logged once)",
                 0);
        return;
    }
    kforget_stale(fd);
    struct kconn *k = &kconns[fd];
    k->slot = (int)(t - taken);
    k->gen = __atomic_load_n(&t->gen, __ATOMIC_ACQUIRE);
    k->epoch = __atomic_load_n(&t->epoch, __ATOMIC_ACQUIRE);
    k->conn_id = conn_id;
    k->kernel = plane == PLANE_KERNEL;
    k->fd = fd;
    k->ino = inode_of(fd);
    k->hold = hold_claim(&k->hold_gen);
    k->prep = 0;
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

/* Lets go of every connection this process holds: at exec (`send` 1: the new program
 * cannot close what it does not know of) or at a voluntary exit (`send` 0 for the ones it
 * accepted itself; 1 for those it inherited, which their owner may be done with). */
static void let_go_all(int exec) {
    pid_t self = getpid();
    if (!__atomic_load_n(&n_kernel, __ATOMIC_ACQUIRE) || in_vfork_child())
        return;
    int hi = __atomic_load_n(&kfd_high, __ATOMIC_ACQUIRE);
    for (int fd = 0; fd < hi; fd++) {
        struct kconn k;
        if (__atomic_load_n(&kconns[fd].state, __ATOMIC_ACQUIRE) && kforget(fd, &k))
            let_go(&k, exec || k.pid != self, -1);
    }
    drop_keeps();
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

/* Waits out EKEYEXPIRED after a KeyUpdate: 0 to read again, -1 past the 5 s bound. */
static int key_wait(struct timespec *start, long *nap) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (*nap == 0) {
        *start = now;
        *nap = 1000 * 1000;
    } else if (now.tv_sec - start->tv_sec > 5 ||
               (now.tv_sec - start->tv_sec == 5 && now.tv_nsec >= start->tv_nsec)) {
        return -1;
    }
    struct timespec ts = {0, *nap};
    nanosleep(&ts, NULL);
    *nap = *nap * 2 > 10 * 1000 * 1000 ? 10 * 1000 * 1000 : *nap * 2;
    return 0;
}

/* A read on a remembered kernel-plane descriptor. Its buffers are on this stack: a read in a
 * signal handler, or in two threads at once, shares nothing. */
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
            if (key_wait(&start, &nap) < 0)
                return end_with(k, ECONNRESET);
            continue;
        }
        /* EIO: a control record is next. Read it alone, with its content type, into the
         * KEY_UPDATE frame it may become. */
        nap = 0;
        unsigned char f[22 + CTL_ROOM];
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = {f + 22, CTL_ROOM};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = ctl.b;
        m.msg_controllen = sizeof ctl.b;
        ssize_t n = recvmsg(a->fd, &m, MSG_DONTWAIT);
        if (n < 0) {
            e = errno;
            if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                continue; /* another thread took the record: read again */
            return fail(e);
        }
        int type = 23;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_TLS_ && c->cmsg_type == TLS_GET_RECORD_TYPE_ &&
                c->cmsg_len >= CMSG_LEN(1))
                type = *(unsigned char *)CMSG_DATA(c);
        const unsigned char *p = f + 22;
        if (type == 23) {
            /* Data after all (another thread read the control record): the caller's. Only
             * a read of under CTL_ROOM bytes can get more than it asked for; the rest is
             * lost. */
            size_t c = (size_t)n < rd_len(a) ? (size_t)n : rd_len(a);
            rd_copy(a, p, c);
            return (ssize_t)c;
        }
        if (type == 21 && n == 2)
            return end_with(k, p[1] == 0 ? 0 : ECONNRESET); /* close_notify: end of stream */
        if (type == 22 && n > 0 && n < CTL_ROOM) {
            /* A KeyUpdate: tlsplane installs the next RX key (and, if asked, sends ours).
             * The REPLY is not awaited (accept skips it); the read waits for the key. */
            frame_head(f, KIND_KEY_UPDATE, 22 + (size_t)n, k->conn_id);
            f[20] = (unsigned char)(n >> 8);
            f[21] = (unsigned char)n;
            if (send_frame(k, f, 22 + (size_t)n, 1) < 0)
                return end_with(k, ECONNRESET); /* nobody can re-key it */
            continue;
        }
        return end_with(k, EPROTO); /* an alert of the wrong size, a handshake record that
                                     * is empty or too long for a KeyUpdate, or a content
                                     * type with no business here */
    }
}

/* ---- fork ---- */

/* The connections the prepare handler counted for the child about to be forked: the child
 * reconciles them with what it really inherited (another thread may have closed or accepted
 * one between the count and the fork); a failed fork takes them back. */
static struct kconn prepared[HOLD_SLOTS];
static int n_prepared;
static unsigned fork_seq;

static void fork_prepare(void) {
    unsigned seq = ++fork_seq;
    n_prepared = 0;
    int hi = __atomic_load_n(&kfd_high, __ATOMIC_ACQUIRE);
    for (int fd = 0; fd < hi && n_prepared < HOLD_SLOTS; fd++) {
        struct kconn *k = &kconns[fd];
        if (!__atomic_load_n(&k->state, __ATOMIC_ACQUIRE))
            continue;
        struct kconn c = *k;
        if (c.hold < 0 || !hold_more(&c))
            continue;
        k->prep = seq;
        prepared[n_prepared++] = c;
    }
}

static void start_reconnect(struct taken *t, int fd);

pid_t fork(void) {
    pid_t pid = REAL(fork)();
    if (pid < 0) {
        int e = errno;
        for (int i = 0; i < n_prepared; i++)
            let_go(&prepared[i], 1, -1);
        errno = e;
    }
    return pid;
}

/* The child: only the forking thread exists here. Counts of other threads' work on a slot are
 * stale, a half-claimed slot will never be finished, and a reconnecting thread is missing. */
static void fork_child(void) {
    __atomic_store_n(&my_pid, getpid(), __ATOMIC_RELEASE);
    /* The parent's sender sends those CLOSEs; this process's copies of their duplicates go. */
    for (int i = 0; i < MAX_PENDING; i++) {
        if (__atomic_load_n(&pending[i].state, __ATOMIC_ACQUIRE) >= 2)
            REAL(close)(pending[i].dup);
        __atomic_store_n(&pending[i].state, 0, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&n_pending, 0, __ATOMIC_RELEASE);
    sem_init(&pending_sem, 0, 0);
    for (int i = 0; i < MAX_TAKEN; i++) {
        struct taken *t = &taken[i];
        __atomic_store_n(&t->busy, 0, __ATOMIC_RELEASE);
        int fd = __atomic_load_n(&t->fd, __ATOMIC_ACQUIRE);
        if (fd == -2) {
            __atomic_store_n(&t->fd, -1, __ATOMIC_RELEASE);
            __atomic_sub_fetch(&n_taken, 1, __ATOMIC_RELEASE);
        } else if (fd >= 0 && __atomic_load_n(&t->lost, __ATOMIC_ACQUIRE)) {
            start_reconnect(t, fd);
        }
    }
    /* Accepted after the count: this process holds it too. */
    int hi = __atomic_load_n(&kfd_high, __ATOMIC_ACQUIRE);
    for (int fd = 0; fd < hi; fd++) {
        struct kconn *k = &kconns[fd];
        if (__atomic_load_n(&k->state, __ATOMIC_ACQUIRE) && k->hold >= 0 &&
            k->prep != fork_seq && !hold_more(k)) {
            /* Its CLOSE went out meanwhile: this copy is no longer the shim's. */
            __atomic_store_n(&k->state, 0, __ATOMIC_RELEASE);
            __atomic_sub_fetch(&n_kernel, 1, __ATOMIC_RELEASE);
        }
    }
    /* Counted but closed before the fork: never this process's; if the parent's close left
     * the count to this process, the CLOSE is its to send. */
    for (int i = 0; i < n_prepared; i++) {
        const struct kconn *p = &prepared[i];
        const struct kconn *k = &kconns[p->fd];
        if (!__atomic_load_n(&k->state, __ATOMIC_ACQUIRE) || k->hold != p->hold ||
            k->hold_gen != p->hold_gen ||
            k->prep != fork_seq)
            let_go(p, 1, -1);
    }
}

/* A process that exits by exit(3) or _exit(2) lets go of what it holds; one killed by a
 * signal does not (see "Who holds a connection"). */
__attribute__((destructor)) static void at_exit(void) {
    let_go_all(0);
}

void _exit(int status) {
    let_go_all(0);
    REAL(_exit)(status);
    __builtin_unreachable();
}

void _Exit(int status) {
    let_go_all(0);
    REAL_AS(_exit, "_exit")(status);
    __builtin_unreachable();
}

/* exec: the new program knows nothing of the connections (and close-on-exec ones go). The
 * counts are given back first; if the exec fails, the descriptors stay open but are no longer
 * the shim's (closing them sends nothing). */
int execve(const char *path, char *const argv[], char *const envp[]) {
    let_go_all(1);
    return REAL(execve)(path, argv, envp);
}

int execv(const char *path, char *const argv[]) {
    let_go_all(1);
    return REAL(execv)(path, argv);
}

int execvp(const char *file, char *const argv[]) {
    let_go_all(1);
    return REAL(execvp)(file, argv);
}

int execvpe(const char *file, char *const argv[], char *const envp[]) {
    let_go_all(1);
    return REAL(execvpe)(file, argv, envp);
}

int fexecve(int fd, char *const argv[], char *const envp[]) {
    let_go_all(1);
    return REAL(fexecve)(fd, argv, envp);
}

/* ---- Configuration ---- */

static int parse_uids(const char *s) {
    if (!s || !*s) {
        cfg.uids[0] = geteuid();
        cfg.n_uids = 1;
        return 0;
    }
    cfg.n_uids = 0;
    for (;;) {
        const char *p = s;
        unsigned long long v = 0;
        while (*p >= '0' && *p <= '9' && v < 0xFFFFFFFFull)
            v = v * 10 + (unsigned)(*p++ - '0');
        if (p == s || v >= 0xFFFFFFFFull || (*p && *p != ',') || cfg.n_uids == MAX_UIDS)
            return -1;
        cfg.uids[cfg.n_uids++] = (uid_t)v;
        if (!*p)
            return 0;
        s = p + 1;
    }
}

static int trusted(uid_t uid) {
    if (uid == 0)
        return 1;
    for (int i = 0; i < cfg.n_uids; i++)
        if (cfg.uids[i] == uid)
            return 1;
    return 0;
}

/* "refusing the hand-off socket PATH: it is served by uid N, not root or uid(s) ..." */
static void describe_refusal(char *buf, size_t size, uid_t uid) {
    char ids[MAX_UIDS * 12] = "";
    size_t used = 0;
    int others = 0;
    for (int i = 0; i < cfg.n_uids; i++) {
        if (cfg.uids[i] == 0)
            continue;
        int n = snprintf(ids + used, sizeof ids - used, "%s%u", others ? ", " : "",
                         (unsigned)cfg.uids[i]);
        if (n > 0 && (size_t)n < sizeof ids - used)
            used += (size_t)n;
        others++;
    }
    snprintf(buf, size,
             "refusing the hand-off socket %s: it is served by uid %u, not root%s%s%s "
             "(TLSPLANE_HANDOFF_UID names the user ids tlsplane may run as)",
             cfg.path.sun_path, (unsigned)uid, others ? " or uid" : "",
             others > 1 ? "s " : others ? " " : "", ids);
}

/* Connects to the hand-off socket and checks who listens there. Returns the socket, or -1
 * with errno set (EPERM: another user, whose id is then in *refused). */
static int dial(uid_t *refused) {
    /* The first frame: HELLO, ENDS_WITH_CLOSE (every connection ends with a CLOSE). */
    static const unsigned char hello[12] = {'T', 'L', 'P', 'H', 1, KIND_HELLO, 0, 12,
                                            0,   0,   0,   ENDS_WITH_CLOSE};
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -1;
    struct ucred cred;
    socklen_t len = sizeof cred;
    int e = 0;
    if (connect(s, (struct sockaddr *)&cfg.path, cfg.path_len) < 0 ||
        getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
        e = errno;
    else if (!trusted(cred.uid)) {
        *refused = cred.uid;
        e = EPERM;
    } else if (send(s, hello, sizeof hello, MSG_NOSIGNAL) != (ssize_t)sizeof hello) {
        e = errno ? errno : EPIPE; /* a fresh connection has room for 12 bytes */
    }
    if (e) {
        real_close(s);
        errno = e;
        return -1;
    }
    return s;
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
    real_fork = dlsym(RTLD_NEXT, "fork");
    real__exit = dlsym(RTLD_NEXT, "_exit");
    real_execve = dlsym(RTLD_NEXT, "execve");
    real_execv = dlsym(RTLD_NEXT, "execv");
    real_execvp = dlsym(RTLD_NEXT, "execvp");
    real_execvpe = dlsym(RTLD_NEXT, "execvpe");
    real_fexecve = dlsym(RTLD_NEXT, "fexecve");
    for (int i = 0; i < MAX_TAKEN; i++) {
        taken[i].fd = -1;
        taken[i].keep = -1;
    }
    __atomic_store_n(&my_pid, getpid(), __ATOMIC_RELEASE);
    sem_init(&pending_sem, 0, 0);

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
    /* From here on a mistake fails the listen: the program must not serve the port in the
     * clear, nor trust someone by accident. */
    if (parse_uids(getenv("TLSPLANE_HANDOFF_UID")) < 0) {
        note("TLSPLANE_HANDOFF_UID: expected decimal user ids separated by commas (at most "
             "16); listen will fail",
             0);
        cfg.fail = EINVAL;
        return;
    }
    void *shared = mmap(NULL, sizeof(struct frame_lock) * MAX_TAKEN + 8 * HOLD_SLOTS,
                        PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pthread_mutexattr_t attr;
    if (shared == MAP_FAILED || pthread_mutexattr_init(&attr) != 0) {
        note("cannot allocate the shared frame locks; listen will fail", errno);
        cfg.fail = ENOMEM;
        return;
    }
    frame_locks = shared;
    holders = (uint64_t *)(frame_locks + MAX_TAKEN);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    for (int i = 0; i < MAX_TAKEN; i++)
        pthread_mutex_init(&frame_locks[i].m, &attr);
    pthread_mutexattr_destroy(&attr);
    pthread_atfork(fork_prepare, NULL, fork_child);
}

/* At load, not on first use: the real functions are then looked up before a signal handler
 * might be the first to call one (dlsym is not async-signal-safe). */
__attribute__((constructor)) static void at_load(void) {
    pthread_once(&once, init);
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
    for (int i = 0; i < MAX_TAKEN; i++)
        if (__atomic_load_n(&taken[i].fd, __ATOMIC_ACQUIRE) == fd)
            return &taken[i];
    return NULL;
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
    if (cfg.fail) {
        errno = cfg.fail;
        return -1;
    }
    uid_t refused = 0;
    int s = dial(&refused);
    if (s < 0) {
        int e = errno;
        char what[512];
        if (e == EPERM)
            describe_refusal(what, sizeof what, refused);
        else
            snprintf(what, sizeof what, "cannot connect to TLSPLANE_HANDOFF");
        note(what, e == EPERM ? 0 : e);
        errno = e;
        return -1;
    }
    struct taken *t = NULL;
    for (int i = 0; i < MAX_TAKEN && !t; i++) {
        int free_slot = -1;
        if (__atomic_compare_exchange_n(&taken[i].fd, &free_slot, -2, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            t = &taken[i];
    }
    if (!t) {
        real_close(s);
        errno = EMFILE;
        return -1;
    }
    __atomic_add_fetch(&n_taken, 1, __ATOMIC_RELEASE);
    t->bound = ss;
    t->bound_len = len;
    __atomic_store_n(&t->conn_ino, inode_of(s), __ATOMIC_RELEASE);
    __atomic_add_fetch(&t->gen, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&t->lost, 0, __ATOMIC_RELEASE);
    if (replace(fd, s) < 0) {
        int e = errno;
        __atomic_store_n(&t->fd, -1, __ATOMIC_RELEASE);
        __atomic_sub_fetch(&n_taken, 1, __ATOMIC_RELEASE);
        errno = e;
        return -1;
    }
    __atomic_store_n(&t->fd, fd, __ATOMIC_RELEASE);
    return 0;
}

/* ---- Reading frames ---- */

/* One recvmsg of up to n bytes into buf, collecting at most one descriptor, and only with the
 * frame's first byte (`first`). Returns the byte count (0: end of stream), -1 with errno, or
 * -2 when descriptors came where none may (each is closed). */
static ssize_t recv_part(int fd, unsigned char *buf, size_t n, int *cfd, int cloexec,
                         int first, int flags) {
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int) * 4)];
    } ctl;
    struct iovec iov = {buf, n};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl.b;
    m.msg_controllen = sizeof ctl.b;
    ssize_t r = recvmsg(fd, &m, flags | (cloexec ? MSG_CMSG_CLOEXEC : 0));
    if (r < 0)
        return -1;
    int broken = (m.msg_flags & MSG_CTRUNC) != 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int d;
            memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
            if (*cfd < 0 && first && r > 0) {
                *cfd = d;
            } else {
                real_close(d);
                broken = 1;
            }
        }
    }
    return broken ? -2 : r;
}

/* Reads into buf until *got reaches want (a descriptor only with the frame's first byte).
 * 1: done; 0: nothing was queued (only before the frame's first byte); -2: the stream ended,
 * broke, or the rest of a frame did not come by `deadline`. */
static int read_more(int fd, unsigned char *buf, size_t *got, size_t want, int *cfd,
                     int cloexec, long deadline) {
    while (*got < want) {
        ssize_t r = recv_part(fd, buf + *got, want - *got, cfd, cloexec, *got == 0,
                              MSG_DONTWAIT);
        if (r == -1 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            long left = deadline - now_ms();
            if (*got == 0)
                return 0;
            if (left <= 0)
                return -2;
            struct pollfd p = {fd, POLLIN, 0};
            poll(&p, 1, (int)left);
            continue;
        }
        if (r <= 0)
            return -2;
        *got += (size_t)r;
    }
    return 1;
}

/* Reads one whole frame into t->frame, the frame lock held. 1: a frame (its descriptor, if
 * any, in *cfd); 0: nothing queued; -2: the stream ended or can no longer be framed. */
static int read_frame(struct taken *t, struct frame_lock *fl, int fd, int *cfd, int cloexec) {
    unsigned char *f = t->frame;
    /* Set before the first byte: a holder that dies from here on may have left half a
     * frame, and the next holder then resets the stream rather than misread it. */
    __atomic_store_n(&fl->reading, __atomic_load_n(&t->conn_ino, __ATOMIC_ACQUIRE),
                     __ATOMIC_RELEASE);
    size_t got = 0;
    long deadline = now_ms() + FRAME_TAIL_MS;
    int r = read_more(fd, f, &got, 8, cfd, cloexec, deadline);
    if (r == 1) {
        size_t len = (size_t)(f[6] << 8 | f[7]);
        if (memcmp(f, "TLPH", 4) != 0 || f[4] != 1 || len < 8 || len > FRAME_MAX)
            return -2;
        r = read_more(fd, f, &got, len, cfd, cloexec, deadline);
    }
    if (r >= 0)
        __atomic_store_n(&fl->reading, 0, __ATOMIC_RELEASE);
    return r;
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

/* ---- Losing and regaining the hand-off connection ---- */

struct again {
    int slot, fd;
    unsigned gen;
};

/* Says, at most once per REFUSAL_LOG_SECONDS, that a reconnect found another user there. */
static void log_refused(uid_t uid) {
    static long next_ms;  /* atomic */
    static unsigned quiet; /* atomic: refusals not logged since the last line */
    long now = now_ms(), next = __atomic_load_n(&next_ms, __ATOMIC_RELAXED);
    if (now < next ||
        !__atomic_compare_exchange_n(&next_ms, &next, now + REFUSAL_LOG_SECONDS * 1000, 0,
                                     __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        __atomic_add_fetch(&quiet, 1, __ATOMIC_RELAXED);
        return;
    }
    char what[640];
    describe_refusal(what, sizeof what - 96, uid);
    unsigned more = __atomic_exchange_n(&quiet, 0, __ATOMIC_RELAXED);
    if (more)
        snprintf(what + strlen(what), 96, "; %u more refused since the last such line", more);
    note(what, 0);
}

/* Connects to the hand-off socket again every 200 ms (tlsplane restarting removes and
 * re-creates it) and puts the connection on the program's descriptor, unless the program
 * closed it meanwhile. Runs with every signal blocked. */
static void *reconnect(void *arg) {
    struct again a = *(struct again *)arg;
    free(arg);
    struct taken *t = &taken[a.slot];
    for (;;) {
        struct timespec ts = {0, RECONNECT_NS};
        nanosleep(&ts, NULL);
        if (__atomic_load_n(&t->fd, __ATOMIC_ACQUIRE) != a.fd ||
            __atomic_load_n(&t->gen, __ATOMIC_ACQUIRE) != a.gen)
            return NULL;
        uid_t refused = 0;
        int s = dial(&refused);
        if (s < 0) {
            if (errno == EPERM)
                log_refused(refused);
            continue;
        }
        uint64_t ino = inode_of(s);
        sigset_t old;
        if (!enter(t, a.fd, a.gen, &old)) {
            real_close(s);
            return NULL;
        }
        __atomic_store_n(&t->conn_ino, ino, __ATOMIC_RELEASE);
        int ok = replace(a.fd, s) == 0; /* (closes s either way) */
        leave(t, &old);
        if (ok) {
            __atomic_store_n(&t->lost, 0, __ATOMIC_RELEASE);
            note("reconnected to TLSPLANE_HANDOFF", 0);
            return NULL;
        }
    }
}

static void start_reconnect(struct taken *t, int fd) {
    struct again *a = malloc(sizeof *a);
    if (!a)
        return;
    a->slot = (int)(t - taken);
    a->fd = fd;
    a->gen = __atomic_load_n(&t->gen, __ATOMIC_ACQUIRE);
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

/* The hand-off connection is gone: accept fails once, and until a thread has reconnected
 * nothing arrives. The frame lock is held. */
static int lose(struct taken *t, int fd, unsigned gen) {
    note("the hand-off connection is closed or broken; reconnecting", 0);
    /* A listening Unix socket on an unnamed abstract address: never readable (an unconnected
     * stream socket would report POLLHUP and spin the program's poll loop). */
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sa_family_t unnamed = AF_UNIX;
    sigset_t old;
    if (s >= 0 && bind(s, (struct sockaddr *)&unnamed, sizeof unnamed) == 0 &&
        real_listen(s, 0) == 0 && enter(t, fd, gen, &old)) {
        replace(fd, s);
        leave(t, &old);
    } else if (s >= 0) {
        real_close(s);
    }
    __atomic_add_fetch(&t->epoch, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&t->lost, 1, __ATOMIC_RELEASE);
    if (__atomic_load_n(&t->fd, __ATOMIC_ACQUIRE) == fd)
        start_reconnect(t, fd);
    errno = ECONNABORTED;
    return -1;
}

/* ---- accept ---- */

/* poll(2) is never restarted after a signal handler; accept(2) is, when the handler has
 * SA_RESTART. So a blocking accept goes on unless some installed handler lacks it. */
static int handlers_restart(void) {
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction sa;
        if (sig == SIGKILL || sig == SIGSTOP || sigaction(sig, NULL, &sa) < 0)
            continue;
        if (sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN &&
            !(sa.sa_flags & SA_RESTART))
            return 0;
    }
    return 1;
}

/* Takes slot t's frame lock: 1 held; 0 another holds it (`wait` 0); -1 with errno. */
static int lock_frames(struct taken *t, int fd, int wait) {
    struct frame_lock *fl = &frame_locks[t - taken];
    int r = wait ? pthread_mutex_lock(&fl->m) : pthread_mutex_trylock(&fl->m);
    if (r == EBUSY)
        return 0;
    if (r == EOWNERDEAD) {
        /* Its holder died. In the middle of a frame of this connection, the stream cannot be
         * framed any more: end it for every process that shares it (each then reconnects). */
        uint64_t ino = __atomic_load_n(&fl->reading, __ATOMIC_ACQUIRE);
        if (ino && ino == __atomic_load_n(&t->conn_ino, __ATOMIC_ACQUIRE))
            real_shutdown(fd, SHUT_RDWR);
        __atomic_store_n(&fl->reading, 0, __ATOMIC_RELEASE);
        pthread_mutex_consistent(&fl->m);
        return 1;
    }
    if (r != 0) {
        errno = r; /* EDEADLK: a signal handler's accept while this thread reads */
        return -1;
    }
    return 1;
}

/* The CONNECTION in t->frame, with its descriptor cfd: returned to the program, or -1 when
 * the frame is something else or its body is bad (the descriptor closed). */
static int take_connection(struct taken *t, int cfd, struct sockaddr *addr,
                           socklen_t *addrlen, int flags) {
    const unsigned char *f = t->frame;
    size_t len = (size_t)(f[6] << 8 | f[7]);
    if (f[5] != KIND_CONNECTION || cfd < 0) {
        if (cfd >= 0)
            real_close(cfd); /* a REPLY or a later kind: skipped whole */
        return -1;
    }
    /* CONNECTION: v1 minimum 64 + n + m; plane 1..3. */
    if (len < 64 || len < 64u + f[62] || len < 64u + f[62] + f[63 + f[62]] || f[16] < 1 ||
        f[16] > 3 || fill_addr(f + 22, t->bound.ss_family, addr, addrlen) < 0) {
        real_close(cfd);
        return -1;
    }
    int fl = fcntl(cfd, F_GETFL);
    int want = flags & SOCK_NONBLOCK ? fl | O_NONBLOCK : fl & ~O_NONBLOCK;
    if (fl < 0 || (want != fl && fcntl(cfd, F_SETFL, want) < 0)) {
        real_close(cfd);
        return -1;
    }
    uint64_t id = 0;
    for (int i = 8; i < 16; i++)
        id = id << 8 | f[i];
    kremember(cfd, t, id, f[16]);
    return cfd;
}

static int handoff_accept(struct taken *t, int fd, struct sockaddr *addr, socklen_t *addrlen,
                          int flags) {
    unsigned gen = __atomic_load_n(&t->gen, __ATOMIC_ACQUIRE);
    int cloexec = (flags & SOCK_CLOEXEC) != 0;
    for (;;) {
        if (__atomic_load_n(&t->fd, __ATOMIC_ACQUIRE) != fd) {
            errno = EBADF; /* another thread closed the socket */
            return -1;
        }
        int fl = fcntl(fd, F_GETFL);
        int nonblock = fl >= 0 && (fl & O_NONBLOCK);
        if (__atomic_load_n(&t->lost, __ATOMIC_ACQUIRE)) {
            if (nonblock) {
                errno = EAGAIN;
                return -1;
            }
            struct timespec ts = {0, 100 * 1000 * 1000};
            if (nanosleep(&ts, NULL) < 0 && errno == EINTR && !handlers_restart())
                return -1;
            continue;
        }
        if (!nonblock) {
            /* Wait without the lock: it is held only while a queued frame is read. The
             * timeout notices a descriptor replaced meanwhile (lost, then reconnected). */
            struct pollfd p = {fd, POLLIN, 0};
            int r = poll(&p, 1, 1000);
            if (r < 0 && errno == EINTR && !handlers_restart())
                return -1;
            if (r <= 0)
                continue;
        }
        /* From here to the frame's end the descriptor is read: close() waits for it (a
         * frame already queued), so its number cannot meanwhile name another file. */
        sigset_t old;
        if (!enter(t, fd, gen, &old)) {
            errno = EBADF; /* another thread closed the socket */
            return -1;
        }
        int locked = lock_frames(t, fd, !nonblock);
        if (locked <= 0) {
            int e = locked == 0 ? EAGAIN : errno;
            leave(t, &old);
            errno = e;
            return -1;
        }
        if (__atomic_load_n(&t->lost, __ATOMIC_ACQUIRE)) {
            pthread_mutex_unlock(&frame_locks[t - taken].m);
            leave(t, &old);
            continue;
        }
        int cfd = -1;
        int r = read_frame(t, &frame_locks[t - taken], fd, &cfd, cloexec);
        int ret = -1;
        if (r == -2) {
            if (cfd >= 0)
                real_close(cfd);
            ret = lose(t, fd, gen);
        } else if (r == 1) {
            ret = take_connection(t, cfd, addr, addrlen, flags);
        }
        pthread_mutex_unlock(&frame_locks[t - taken].m);
        int e = errno;
        leave(t, &old);
        errno = e;
        if (r == -2 || ret >= 0)
            return ret;
        if (r == 0 && nonblock) {
            errno = EAGAIN;
            return -1;
        }
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

/* The program is closing fd (or putting another file on it): if it is a taken-over socket,
 * the slot is freed first, then any thread still putting a connection on it or sending on it
 * is waited for (a dup3 or a non-blocking send: a moment). */
static void release_taken(int fd) {
    if (fd < 0 || __atomic_load_n(&n_taken, __ATOMIC_ACQUIRE) == 0)
        return;
    for (int i = 0; i < MAX_TAKEN; i++) {
        if (__atomic_load_n(&taken[i].fd, __ATOMIC_ACQUIRE) != fd)
            continue;
        if (in_vfork_child())
            return; /* its own copy of the descriptor; the slot is the parent's */
        /* Connections it handed over are still open here: their CLOSEs need the hand-off
         * connection after the program's descriptor is gone (a forked child that closes
         * the listening socket, then serves). */
        int kf = __atomic_load_n(&n_kernel, __ATOMIC_ACQUIRE) &&
                         __atomic_load_n(&taken[i].keep, __ATOMIC_ACQUIRE) < 0
                     ? fcntl(fd, F_DUPFD_CLOEXEC, 0)
                     : -1;
        int want = fd;
        if (!__atomic_compare_exchange_n(&taken[i].fd, &want, -1, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST)) {
            if (kf >= 0)
                REAL(close)(kf);
            continue;
        }
        int none = -1;
        if (kf >= 0 && !__atomic_compare_exchange_n(&taken[i].keep, &none, kf, 0,
                                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            REAL(close)(kf);
        __atomic_sub_fetch(&n_taken, 1, __ATOMIC_RELEASE);
        wait_idle(&taken[i]);
    }
}

int close(int fd) {
    release_taken(fd);
    return kclose(fd, op_close, fd, 0, 0);
}

ssize_t read(int fd, void *buf, size_t len) {
    struct kconn *k = kfind_kernel(fd);
    if (!k)
        return REAL(read)(fd, buf, len);
    struct rd a = {.op = 0, .fd = fd, .buf = buf, .len = len};
    return kread(k, &a);
}

ssize_t recv(int fd, void *buf, size_t len, int flags) {
    struct kconn *k = kfind_kernel(fd);
    if (!k)
        return REAL(recv)(fd, buf, len, flags);
    struct rd a = {.op = 1, .fd = fd, .buf = buf, .len = len, .flags = flags};
    return kread(k, &a);
}

ssize_t recvfrom(int fd, void *buf, size_t len, int flags, struct sockaddr *from,
                 socklen_t *fromlen) {
    struct kconn *k = kfind_kernel(fd);
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
    struct kconn *k = kfind_kernel(fd);
    if (!k)
        return REAL(readv)(fd, iov, iovcnt);
    struct rd a = {.op = 3, .fd = fd, .iov = iov, .iovcnt = iovcnt};
    return kread(k, &a);
}

/* _FORTIFY_SOURCE turns read/recv/recvfrom with a buffer of known size into these. */
ssize_t __read_chk(int fd, void *buf, size_t len, size_t buflen) {
    struct kconn *k = kfind_kernel(fd);
    if (!k || len > buflen)
        return REAL_AS(read_chk, "__read_chk")(fd, buf, len, buflen);
    struct rd a = {.op = 0, .fd = fd, .buf = buf, .len = len};
    return kread(k, &a);
}

ssize_t __recv_chk(int fd, void *buf, size_t len, size_t buflen, int flags) {
    struct kconn *k = kfind_kernel(fd);
    if (!k || len > buflen)
        return REAL_AS(recv_chk, "__recv_chk")(fd, buf, len, buflen, flags);
    struct rd a = {.op = 1, .fd = fd, .buf = buf, .len = len, .flags = flags};
    return kread(k, &a);
}

ssize_t __recvfrom_chk(int fd, void *buf, size_t len, size_t buflen, int flags,
                       struct sockaddr *from, socklen_t *fromlen) {
    struct kconn *k = kfind_kernel(fd);
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
    struct kconn *k = kfind(fd);
    if (!k || how == SHUT_RD)
        return REAL(shutdown)(fd, how);
    if (how != SHUT_WR && how != SHUT_RDWR)
        return (int)fail(EINVAL);
    if (!k->kernel) {
        /* The relay: the CLOSE first, then the end tlsplane relays close_notify after. */
        close_now(k);
        return REAL(shutdown)(fd, how);
    }
    if (how == SHUT_RDWR && REAL(shutdown)(fd, SHUT_RD) < 0)
        return -1;
    close_now(k);
    return 0;
}

/* Whether a dup2/dup3 of `old` onto fd closes one of the shim's descriptors. */
static int replaces_ours(int old, int fd) {
    return old != fd && (kfind(fd) || find(fd)) && fcntl(old, F_GETFD) >= 0;
}

int dup2(int old, int fd) {
    if (!replaces_ours(old, fd))
        return REAL(dup2)(old, fd);
    release_taken(fd);
    return kclose(fd, op_dup3, old, fd, 0);
}

int dup3(int old, int fd, int flags) {
    if (!replaces_ours(old, fd))
        return REAL(dup3)(old, fd, flags);
    release_taken(fd);
    return kclose(fd, op_dup3, old, fd, flags);
}
