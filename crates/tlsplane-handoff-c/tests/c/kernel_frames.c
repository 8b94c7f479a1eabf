/*
 * Run under the LD_PRELOAD shim against a fake tlsplane (tests/preload.rs): `kernel_frames
 * PORT`. Binds 127.0.0.1:PORT and listens (the shim takes the socket over), then for each
 * connection accepted: reads one line in small pieces, through read, recv, recvfrom and
 * readv in turn, writing each piece back as it comes; a line "shut\n" is followed by
 * shutdown(SHUT_WR) and reading until end of stream, a line "dup2\n" by dup2 of /dev/null
 * onto the connection's descriptor, which is then held open until the end (so that only
 * dup2 can have ended the connection); then closes the descriptor. Prints one
 * line per connection, then how accept ended and how many descriptors leaked.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
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

static ssize_t read_piece(int c, char *buf, size_t len, int call) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    struct iovec iov[2] = {{buf, len / 2}, {buf + len / 2, len - len / 2}};
    switch (call % 4) {
    case 0:
        return read(c, buf, len);
    case 1:
        return recv(c, buf, len, 0);
    case 2:
        return recvfrom(c, buf, len, 0, (struct sockaddr *)&ss, &sl);
    default:
        return readv(c, iov, 2);
    }
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
    int held = -1;
    for (;;) {
        int c = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            printf("end=%s\n", errno == ECONNABORTED ? "ECONNABORTED" : strerror(errno));
            break;
        }
        char buf[97], first[4] = "";
        size_t total = 0;
        int calls = 0, newline = 0;
        while (!newline) {
            ssize_t n = read_piece(c, buf, sizeof buf, calls++);
            if (n <= 0) {
                printf("read=%zd %s\n", n, n < 0 ? strerror(errno) : "");
                break;
            }
            if (total < sizeof first)
                memcpy(first + total, buf,
                       (size_t)n < sizeof first - total ? (size_t)n : sizeof first - total);
            total += (size_t)n;
            newline = buf[n - 1] == '\n';
            for (ssize_t off = 0; off < n;) {
                ssize_t w = write(c, buf + off, (size_t)(n - off));
                if (w <= 0)
                    break;
                off += w;
            }
        }
        if (newline && memcmp(first, "shut", 4) == 0) {
            int s = shutdown(c, SHUT_WR);
            char b;
            ssize_t n;
            while ((n = read(c, &b, 1)) > 0)
                ;
            printf("shutdown=%d then read=%zd\n", s, n);
        }
        if (newline && memcmp(first, "dup2", 4) == 0) {
            int z = open("/dev/null", O_RDONLY | O_CLOEXEC);
            printf("dup2=%d\n", dup2(z, c) == c);
            close(z);
            held = c;
        }
        printf("line bytes=%zu\n", total);
        if (c != held)
            close(c);
    }
    if (held >= 0)
        close(held);
    printf("leaked=%d\n", open_fds() - before);
    return 0;
}
