/*
 * An echo server to run under the LD_PRELOAD shim on the kernel plane (for a kTLS-capable
 * guest; tests/preload.rs cannot make control records natively):
 *
 *   cc -O2 -Wall -Wextra -Werror -std=c99 -D_GNU_SOURCE -o kernel_echo kernel_echo.c
 *   TLSPLANE_HANDOFF=/tmp/app.sock TLSPLANE_LISTEN=127.0.0.1:8000 \
 *     LD_PRELOAD=./libtlsplane_preload.so ./kernel_echo 8000 [read|recv]
 *
 * Binds 127.0.0.1:PORT and listens (the shim takes the socket over), then serves one
 * connection at a time from accept4: writes back every byte it reads, with read(2) (or
 * recv(2)), until the read returns 0 (the client's close_notify, which the shim turns into
 * end of stream) or fails; then closes the connection (the shim sends tlsplane CLOSE, and
 * tlsplane close_notify). A client KeyUpdate in between is invisible here: the shim forwards
 * it and the read goes on. Prints one line per connection on stderr:
 *   conn bytes=N end=eof            the client ended with close_notify (or TCP close)
 *   conn bytes=N end=ERRNAME        the read or write failed (ECONNRESET: another alert, or
 *                                   the re-key did not happen in time; EPROTO: a malformed
 *                                   control record; EIO: a control record nobody handled)
 * and exits 0 when accept fails (tlsplane went away: ECONNABORTED).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* accept4, SOCK_CLOEXEC */
#endif
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char *errname(int e) {
    switch (e) {
    case EIO: return "EIO";
    case EPROTO: return "EPROTO";
    case ECONNRESET: return "ECONNRESET";
    case ECONNABORTED: return "ECONNABORTED";
    case EKEYEXPIRED: return "EKEYEXPIRED";
    case EAGAIN: return "EAGAIN";
    case EINTR: return "EINTR";
    case EPIPE: return "EPIPE";
    case EBADMSG: return "EBADMSG";
    case EMSGSIZE: return "EMSGSIZE";
    case EINVAL: return "EINVAL";
    case EBADF: return "EBADF";
    case ENOTCONN: return "ENOTCONN";
    case ETIMEDOUT: return "ETIMEDOUT";
    default: return strerror(e);
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: kernel_echo PORT [read|recv]\n");
        return 2;
    }
    int use_recv = argc == 3 && strcmp(argv[2], "recv") == 0;
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((unsigned short)atoi(argv[1]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (l < 0 || setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 16) < 0) {
        fprintf(stderr, "listen: %s\n", errname(errno));
        return 1;
    }
    static char buf[16384];
    for (;;) {
        int c = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EINTR)
                continue;
            fprintf(stderr, "accept: %s\n", errname(errno));
            return errno == ECONNABORTED ? 0 : 1;
        }
        unsigned long long total = 0;
        const char *end = NULL;
        while (!end) {
            ssize_t n = use_recv ? recv(c, buf, sizeof buf, 0) : read(c, buf, sizeof buf);
            if (n == 0) {
                end = "eof";
            } else if (n < 0) {
                if (errno != EINTR)
                    end = errname(errno);
            } else {
                total += (unsigned long long)n;
                for (ssize_t off = 0; off < n && !end;) {
                    ssize_t w = write(c, buf + off, (size_t)(n - off));
                    if (w < 0 && errno != EINTR)
                        end = errname(errno);
                    else if (w > 0)
                        off += w;
                }
            }
        }
        fprintf(stderr, "conn bytes=%llu end=%s\n", total, end);
        close(c);
    }
}
