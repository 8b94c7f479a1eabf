/*
 * Run under the LD_PRELOAD shim against a fake tlsplane (tests/preload.rs): `preload_frames
 * PORT`. Binds 127.0.0.1:PORT and listens (the shim takes the socket over), accepts until
 * accept fails, printing each connection's peer and the byte waiting on it, then checks that
 * the socket, now lost, answers a non-blocking accept with EAGAIN and that no descriptor leaked.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int open_fds(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

int main(int argc, char **argv) {
    if (argc != 2)
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((unsigned short)atoi(argv[1]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 4) < 0) {
        printf("listen: %s\n", strerror(errno));
        return 1;
    }
    int before = open_fds();
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int c = accept4(l, (struct sockaddr *)&ss, &len, SOCK_CLOEXEC);
        if (c < 0) {
            printf("end=%s\n", errno == ECONNABORTED ? "ECONNABORTED" : strerror(errno));
            break;
        }
        char ip[INET6_ADDRSTRLEN] = "?";
        int port = 0;
        if (ss.ss_family == AF_INET && len == sizeof(struct sockaddr_in)) {
            struct sockaddr_in *p = (void *)&ss;
            inet_ntop(AF_INET, &p->sin_addr, ip, sizeof ip);
            port = ntohs(p->sin_port);
        } else if (ss.ss_family == AF_INET6 && len == sizeof(struct sockaddr_in6)) {
            struct sockaddr_in6 *p = (void *)&ss;
            inet_ntop(AF_INET6, &p->sin6_addr, ip, sizeof ip);
            port = ntohs(p->sin6_port);
        }
        char b = '?';
        if (read(c, &b, 1) != 1)
            b = '!';
        printf("peer=%s port=%d data=%c\n", ip, port, b);
        close(c);
    }
    fcntl(l, F_SETFL, O_NONBLOCK);
    int c = accept(l, NULL, NULL);
    printf("after=%s\n", c < 0 && errno == EAGAIN ? "EAGAIN" : "other");
    printf("leaked=%d\n", open_fds() - before);
    return 0;
}
