/*
 * A plain TCP echo server that knows nothing of tlsplane, for the LD_PRELOAD shim's test
 * (handoff_preload.rs): `preload_echo PORT`.
 *
 * Connection 1: the listening socket non-blocking, poll(2), accept4(SOCK_CLOEXEC |
 * SOCK_NONBLOCK), then accept4 again at once (nothing queued: EAGAIN). Connection 2: the
 * listening socket blocking, plain accept(2). Each is echoed to its end; one line per
 * connection says the peer address and descriptor flags it saw.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void die(const char *what) {
    printf("error %s: %s\n", what, strerror(errno));
    exit(1);
}

static void echo(int c) {
    char buf[65536];
    for (;;) {
        ssize_t n = read(c, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            die("read");
        if (n == 0)
            break;
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(c, buf + off, (size_t)(n - off));
            if (w < 0 && errno != EINTR)
                die("write");
            if (w > 0)
                off += w;
        }
    }
    close(c);
}

static void report(int i, int c, const struct sockaddr_in *peer, socklen_t len) {
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &peer->sin_addr, ip, sizeof ip);
    printf("conn%d family=%s peer=%s:%d len_ok=%d cloexec=%d nonblock=%d\n", i,
           peer->sin_family == AF_INET ? "inet" : "other", ip, ntohs(peer->sin_port),
           len == sizeof *peer, (fcntl(c, F_GETFD) & FD_CLOEXEC) != 0,
           (fcntl(c, F_GETFL) & O_NONBLOCK) != 0);
}

int main(int argc, char **argv) {
    if (argc != 2)
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((unsigned short)atoi(argv[1]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) < 0)
        die("bind");
    fcntl(l, F_SETFL, O_NONBLOCK);
    if (listen(l, 16) < 0)
        die("listen");
    struct sockaddr_in b;
    socklen_t blen = sizeof b;
    if (getsockname(l, (struct sockaddr *)&b, &blen) < 0)
        die("getsockname");
    printf("listening port=%d\n", ntohs(b.sin_port));

    struct pollfd p = {l, POLLIN, 0};
    if (poll(&p, 1, 20000) != 1)
        die("poll (timeout?)");
    struct sockaddr_in peer;
    socklen_t plen = sizeof peer;
    int c = accept4(l, (struct sockaddr *)&peer, &plen, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0)
        die("accept4");
    report(1, c, &peer, plen);
    int again = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    printf("then=%s\n", again < 0 && errno == EAGAIN ? "EAGAIN" : "other");
    fcntl(c, F_SETFL, 0);
    echo(c);

    fcntl(l, F_SETFL, 0);
    plen = sizeof peer;
    c = accept(l, (struct sockaddr *)&peer, &plen);
    if (c < 0)
        die("accept");
    report(2, c, &peer, plen);
    echo(c);
    close(l);
    printf("done\n");
    return 0;
}
