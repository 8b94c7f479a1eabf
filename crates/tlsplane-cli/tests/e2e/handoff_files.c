/*
 * A tiny HTTP/1.1 file server on the hand-off C library (include/tlsplane.h), for the
 * e2e tests of handoff_c.rs: `handoff_files SOCKET DIR CONNECTIONS`.
 *
 * Receives CONNECTIONS connections one after another from `tlsplane handoff`, makes each
 * descriptor blocking, and answers every `GET /NAME` with the file DIR/NAME by sendfile(2)
 * (on the kernel plane the kTLS socket itself: the kernel encrypts, nothing is copied).
 * Requests are read with tlsplane_read, which hands a client's KeyUpdate to tlsplane and
 * returns 0 at its close_notify; the connection then ends with tlsplane_close (close_notify
 * from tlsplane). One line per connection on stdout:
 *   conn ID plane P version V requests N end EOF|ERR:errno
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tlsplane.h"

static int write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Answers one request head; -1 on a write error. */
static int answer(int fd, const char *dir, const char *head) {
    char name[256], path[1024], hdr[256];
    if (sscanf(head, "GET /%255[^ ] HTTP/1.1", name) != 1 || strstr(name, "..")) {
        const char *bad = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
        return write_all(fd, bad, strlen(bad));
    }
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int file = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (file < 0 || fstat(file, &st) < 0) {
        const char *nf = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
        if (file >= 0)
            close(file);
        return write_all(fd, nf, strlen(nf));
    }
    int n = snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nContent-Length: %lld\r\n\r\n",
                     (long long)st.st_size);
    int rc = write_all(fd, hdr, (size_t)n);
    off_t off = 0;
    while (rc == 0 && off < st.st_size) {
        ssize_t s = sendfile(fd, file, &off, (size_t)(st.st_size - off));
        if (s < 0 && errno == EINTR)
            continue;
        if (s <= 0)
            rc = -1;
    }
    close(file);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: handoff_files SOCKET DIR CONNECTIONS\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    tlsplane_handle *h = tlsplane_connect(argv[1]);
    if (!h) {
        perror("tlsplane_connect");
        return 1;
    }
    for (int k = atoi(argv[3]); k > 0; k--) {
        struct tlsplane_conn_info info;
        int fd = tlsplane_accept(h, &info);
        if (fd < 0) {
            perror("tlsplane_accept");
            return 1;
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        char buf[16384];
        size_t used = 0;
        int requests = 0, err = 0;
        for (;;) {
            char *end = memmem(buf, used, "\r\n\r\n", 4);
            if (end) {
                *end = 0;
                if (answer(fd, argv[2], buf) < 0) {
                    err = errno;
                    break;
                }
                requests++;
                size_t head = (size_t)(end + 4 - buf);
                memmove(buf, buf + head, used - head);
                used -= head;
                continue;
            }
            if (used == sizeof buf) {
                err = EMSGSIZE;
                break;
            }
            ssize_t n = tlsplane_read(h, fd, buf + used, sizeof buf - used);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0) {
                err = errno;
                break;
            }
            if (n == 0)
                break;
            used += (size_t)n;
        }
        if (err)
            printf("conn %llu plane %u version %#x requests %d end ERR:%s\n",
                   (unsigned long long)info.conn_id, info.plane, info.tls_version, requests,
                   strerror(err));
        else
            printf("conn %llu plane %u version %#x requests %d end EOF\n",
                   (unsigned long long)info.conn_id, info.plane, info.tls_version, requests);
        if (tlsplane_close(h, fd) < 0)
            perror("tlsplane_close");
    }
    tlsplane_disconnect(h);
    return 0;
}
