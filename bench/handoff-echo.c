/* The tiny server (and plain-TCP client) of bench/handoff (issue 21, native user plane).
 *
 * Per connection: read one request, which ends with "\r\n\r\n" (bench/handoff sends an HTTP
 * GET padded to exactly 1024 bytes, so that `tlsplane bench handshake --request` can be the
 * TLS client), write exactly 1024 bytes back (an HTTP 200 response, Connection: close), close.
 * The whole request is read before the close, and the client sends nothing after it, so no
 * input is ever left unread at close: no RST can destroy the reply (lingering close).
 *
 * Single-threaded, one connection at a time, blocking (a read that finds nothing waits in
 * poll(2)); both server modes run the same loop and differ only in where connections come from:
 *
 *   handoff-echo tcp PORT          plain TCP on 127.0.0.1:PORT, accept4(2), close(2)
 *   handoff-echo handoff SOCKET    receiver of `tlsplane handoff`: tlsplane_connect /
 *                                  tlsplane_accept / tlsplane_read / tlsplane_close (tlsplane.h)
 *
 * SIGUSR1 writes "conns=N req_bytes=N resp_bytes=N failures=N" (totals since start) on stdout.
 *
 *   handoff-echo client PORT SECONDS LOOPS REQ_BYTES
 *
 * is the plain-TCP load generator for the no-TLS floor: LOOPS threads, each connect, send the
 * same REQ_BYTES-byte GET, read to EOF (expects 1024 bytes), close; repeat for SECONDS. Prints
 * one JSON line: {"connections":N,"failures":N,"duration_s":S}.
 *
 * Build: cc -O2 -I crates/tlsplane-handoff-c/include bench/handoff-echo.c \
 *          target/release/libtlsplane_handoff_c.a -lpthread -ldl -lm
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tlsplane.h"

#define REPLY_LEN 1024

static char reply[REPLY_LEN];
static volatile unsigned long long n_conns, n_req, n_resp, n_fail;

static void build_reply(void) {
    const char *fmt = "HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n";
    char head[128];
    int h = snprintf(head, sizeof head, fmt, 0);
    /* The body length's digits change the head's length: settle it. */
    int body = REPLY_LEN - h;
    for (int i = 0; i < 3; i++) {
        h = snprintf(head, sizeof head, fmt, body);
        body = REPLY_LEN - h;
    }
    memcpy(reply, head, (size_t)h);
    memset(reply + h, 'x', (size_t)body);
}

static void put_num(char **p, const char *key, unsigned long long v) {
    char tmp[24];
    int n = 0;
    while (*key) *(*p)++ = *key++;
    do { tmp[n++] = (char)('0' + v % 10); v /= 10; } while (v);
    while (n) *(*p)++ = tmp[--n];
}

static void on_usr1(int sig) {
    (void)sig;
    char buf[160], *p = buf;
    int e = errno;
    put_num(&p, "conns=", n_conns);
    put_num(&p, " req_bytes=", n_req);
    put_num(&p, " resp_bytes=", n_resp);
    put_num(&p, " failures=", n_fail);
    *p++ = '\n';
    (void)!write(1, buf, (size_t)(p - buf));
    errno = e;
}

static int wait_fd(int fd, short ev) {
    struct pollfd pfd = {.fd = fd, .events = ev};
    int r;
    while ((r = poll(&pfd, 1, 10000)) < 0 && errno == EINTR) {}
    return r > 0 ? 0 : -1;
}

/* One connection: read until the request's "\r\n\r\n", write the reply. 0 on success. */
static int serve(tlsplane_handle *h, int fd) {
    char buf[4096];
    size_t got = 0;
    for (;;) {
        ssize_t n = h ? tlsplane_read(h, fd, buf + got, sizeof buf - got) : read(fd, buf + got, sizeof buf - got);
        if (n > 0) {
            got += (size_t)n;
            n_req += (unsigned long long)n;
            if (got >= 4 && memcmp(buf + got - 4, "\r\n\r\n", 4) == 0) break;
            if (got == sizeof buf) return -1;
        } else if (n == 0) {
            return -1;
        } else if (errno == EAGAIN) {
            if (wait_fd(fd, POLLIN)) return -1;
        } else if (errno != EINTR) {
            return -1;
        }
    }
    size_t off = 0;
    while (off < REPLY_LEN) {
        ssize_t n = write(fd, reply + off, REPLY_LEN - off);
        if (n > 0) {
            off += (size_t)n;
            n_resp += (unsigned long long)n;
        } else if (n < 0 && errno == EAGAIN) {
            if (wait_fd(fd, POLLOUT)) return -1;
        } else if (n < 0 && errno == EINTR) {
        } else {
            return -1;
        }
    }
    return 0;
}

static int run_tcp(int port) {
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 4096)) {
        perror("listen");
        return 1;
    }
    for (;;) {
        int fd = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EINTR && errno != ECONNABORTED) perror("accept4");
            continue;
        }
        if (serve(NULL, fd) == 0) n_conns++; else n_fail++;
        close(fd);
    }
}

static int run_handoff(const char *path) {
    tlsplane_handle *h = tlsplane_connect(path);
    if (!h) {
        perror("tlsplane_connect");
        return 1;
    }
    if (tlsplane_conn_info_size() != sizeof(struct tlsplane_conn_info)) {
        fprintf(stderr, "tlsplane_conn_info size mismatch\n");
        return 1;
    }
    fprintf(stderr, "connected to %s\n", path);
    for (;;) {
        struct tlsplane_conn_info info;
        int fd = tlsplane_accept(h, &info);
        if (fd < 0) {
            if (errno == EINTR) continue;
            perror("tlsplane_accept");
            return 1;
        }
        if (serve(h, fd) == 0) n_conns++; else n_fail++;
        tlsplane_close(h, fd);
    }
}

/* ---------------------------------------------------------------- client */

static int c_port, c_req_len;
static double c_end;
static char *c_req;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

struct loop_stats { unsigned long long conns, fails; };

static void *client_loop(void *arg) {
    struct loop_stats *st = arg;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char buf[4096];
    while (now() < c_end) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), ok = 0;
        size_t got = 0;
        if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
            write(fd, c_req, (size_t)c_req_len) == c_req_len) {
            ssize_t n;
            while ((n = read(fd, buf, sizeof buf)) > 0) got += (size_t)n;
            ok = n == 0 && got == REPLY_LEN;
        }
        if (fd >= 0) close(fd);
        if (ok) st->conns++; else st->fails++;
    }
    return NULL;
}

static int run_client(int port, double secs, int loops, int req_len) {
    char host[64];
    int h = snprintf(host, sizeof host, "127.0.0.1:%d", port);
    /* "GET /aaa... HTTP/1.1\r\nHost: H\r\nConnection: close\r\n\r\n", padded to req_len,
     * as bench/handoff asks tlsplane bench for on the TLS side. */
    int fixed = (int)strlen("GET / HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n") + h;
    if (req_len < fixed) return 2;
    c_req = malloc((size_t)req_len + 1);
    int pad = req_len - fixed;
    char *path = malloc((size_t)pad + 1);
    memset(path, 'a', (size_t)pad);
    path[pad] = 0;
    snprintf(c_req, (size_t)req_len + 1, "GET /%s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, host);
    c_port = port;
    c_req_len = req_len;
    pthread_t th[64];
    struct loop_stats st[64] = {0};
    if (loops < 1 || loops > 64) return 2;
    double t0 = now();
    c_end = t0 + secs;
    for (int i = 0; i < loops; i++) pthread_create(&th[i], NULL, client_loop, &st[i]);
    unsigned long long c = 0, f = 0;
    for (int i = 0; i < loops; i++) {
        pthread_join(th[i], NULL);
        c += st[i].conns;
        f += st[i].fails;
    }
    printf("{\"connections\":%llu,\"failures\":%llu,\"duration_s\":%.6f}\n", c, f, now() - t0);
    return 0;
}

int main(int argc, char **argv) {
    build_reply();
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_usr1, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    if (argc == 3 && strcmp(argv[1], "tcp") == 0) return run_tcp(atoi(argv[2]));
    if (argc == 3 && strcmp(argv[1], "handoff") == 0) return run_handoff(argv[2]);
    if (argc == 6 && strcmp(argv[1], "client") == 0)
        return run_client(atoi(argv[2]), atof(argv[3]), atoi(argv[4]), atoi(argv[5]));
    fprintf(stderr, "usage: %s tcp PORT | handoff SOCKET | client PORT SECONDS LOOPS REQ_BYTES\n", argv[0]);
    return 2;
}
