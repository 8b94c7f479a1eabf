/*
 * Test-only stand-in for a kTLS socket's receive side, for tests/preload.rs: preloaded after
 * the shim (LD_PRELOAD="shim.so fake_ktls.so"), so that the shim's real read/recv/recvfrom/
 * readv and its recvmsg come here. On a TCP socket (SO_DOMAIN AF_INET/AF_INET6) the byte
 * stream is read as records: 1 byte content type, 2 bytes length (big-endian), the payload.
 * Like kTLS: a read returns application data (type 23) and fails with EIO, consuming
 * nothing, when the next record is another type; recvmsg with a control buffer returns a
 * control record alone with its type in a SOL_TLS/TLS_GET_RECORD_TYPE cmsg; after a
 * handshake record (22) the next 3 reads fail with EKEYEXPIRED (the pause until tlsplane
 * installs the next key). Other descriptors, and everything else, pass through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAXFD 1024

static struct {
    int type;      /* the current record's type; 0: none started */
    size_t left;   /* its payload bytes not read yet */
    int expired;   /* reads still to fail with EKEYEXPIRED */
} st[MAXFD];

static ssize_t (*next_recv)(int, void *, size_t, int);
static ssize_t (*next_recvfrom)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
static ssize_t (*next_recvmsg)(int, struct msghdr *, int);
static ssize_t (*next_read)(int, void *, size_t);
static ssize_t (*next_readv)(int, const struct iovec *, int);

static void resolve(void) {
    if (!next_recv) {
        next_read = dlsym(RTLD_NEXT, "read");
        next_readv = dlsym(RTLD_NEXT, "readv");
        next_recvfrom = dlsym(RTLD_NEXT, "recvfrom");
        next_recvmsg = dlsym(RTLD_NEXT, "recvmsg");
        next_recv = dlsym(RTLD_NEXT, "recv");
    }
}

static int faked(int fd) {
    int dom = 0;
    socklen_t len = sizeof dom;
    return fd >= 0 && fd < MAXFD && getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &len) == 0 &&
           (dom == AF_INET || dom == AF_INET6);
}

/* Starts the next record if none is current. 0: end of stream; -1: error; 1: ready. */
static int next_record(int fd) {
    if (st[fd].type)
        return 1;
    unsigned char h[3];
    ssize_t n = next_recv(fd, h, 3, MSG_WAITALL);
    if (n <= 0)
        return (int)n;
    if (n != 3) {
        errno = EPROTO;
        return -1;
    }
    st[fd].type = h[0];
    st[fd].left = (size_t)(h[1] << 8 | h[2]);
    return 1;
}

/* Reads up to len bytes of the current record's payload. */
static ssize_t payload(int fd, void *buf, size_t len) {
    size_t want = len < st[fd].left ? len : st[fd].left;
    ssize_t n = want ? next_recv(fd, buf, want, MSG_WAITALL) : 0;
    if (n < 0)
        return -1;
    st[fd].left -= (size_t)n;
    int type = st[fd].type;
    if (st[fd].left == 0) {
        st[fd].type = 0;
        if (type == 22)
            st[fd].expired = 3;
    }
    return n;
}

static ssize_t data(int fd, void *buf, size_t len) {
    if (st[fd].expired > 0) {
        st[fd].expired--;
        errno = EKEYEXPIRED;
        return -1;
    }
    for (;;) {
        int r = next_record(fd);
        if (r <= 0)
            return r;
        if (st[fd].type != 23) {
            errno = EIO;
            return -1;
        }
        if (st[fd].left > 0 || len == 0)
            return payload(fd, buf, len);
        st[fd].type = 0; /* an empty data record */
    }
}

ssize_t read(int fd, void *buf, size_t len) {
    resolve();
    return faked(fd) ? data(fd, buf, len) : next_read(fd, buf, len);
}

ssize_t recv(int fd, void *buf, size_t len, int flags) {
    resolve();
    return faked(fd) ? data(fd, buf, len) : next_recv(fd, buf, len, flags);
}

ssize_t recvfrom(int fd, void *buf, size_t len, int flags, struct sockaddr *from,
                 socklen_t *fromlen) {
    resolve();
    if (!faked(fd))
        return next_recvfrom(fd, buf, len, flags, from, fromlen);
    return data(fd, buf, len);
}

ssize_t readv(int fd, const struct iovec *iov, int iovcnt) {
    resolve();
    if (!faked(fd) || iovcnt < 1)
        return next_readv(fd, iov, iovcnt);
    return data(fd, iov[0].iov_base, iov[0].iov_len); /* the first buffer: enough here */
}

ssize_t recvmsg(int fd, struct msghdr *m, int flags) {
    resolve();
    if (!faked(fd))
        return next_recvmsg(fd, m, flags);
    if (st[fd].expired > 0) {
        st[fd].expired--;
        errno = EKEYEXPIRED;
        return -1;
    }
    int r = next_record(fd);
    if (r <= 0)
        return r;
    int type = st[fd].type;
    if (type != 23 &&
        (!m->msg_control || m->msg_controllen < CMSG_SPACE(1) || m->msg_iovlen < 1)) {
        errno = EIO;
        return -1;
    }
    ssize_t n = payload(fd, m->msg_iov[0].iov_base, m->msg_iov[0].iov_len);
    if (n < 0)
        return -1;
    if (m->msg_control && m->msg_controllen >= CMSG_SPACE(1)) {
        struct cmsghdr *c = CMSG_FIRSTHDR(m);
        c->cmsg_level = 282; /* SOL_TLS */
        c->cmsg_type = 2;    /* TLS_GET_RECORD_TYPE */
        c->cmsg_len = CMSG_LEN(1);
        *CMSG_DATA(c) = (unsigned char)type;
        m->msg_controllen = CMSG_SPACE(1);
    } else {
        m->msg_controllen = 0;
    }
    m->msg_flags = 0;
    return n;
}
