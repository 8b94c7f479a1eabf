/* Receives connections from a (fake) tlsplane through the C library and prints what it saw,
 * one "key=value" line per fact, for tests/c_abi.rs to check. Usage: accept_read SOCKET_PATH */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tlsplane.h"

static int count_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    struct dirent *e;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory's own descriptor */
}

static const char *err(int e) {
    switch (e) {
    case EBADF: return "EBADF";
    case EINVAL: return "EINVAL";
    case EPROTO: return "EPROTO";
    case ECONNRESET: return "ECONNRESET";
    case ENOENT: return "ENOENT";
    default: return strerror(e);
    }
}

int main(int argc, char **argv) {
    struct tlsplane_conn_info info;
    char buf[4096], data[65536];
    size_t got = 0;
    ssize_t n;
    int fd, r, before;

    if (argc != 2) return 2;
    printf("size_ok=%d\n", sizeof info == tlsplane_conn_info_size());
    errno = 0;
    printf("connect_missing=%s\n",
           tlsplane_connect("/nonexistent/tlsplane.sock") == NULL ? err(errno) : "handle");
    before = count_fds();

    tlsplane_handle *h = tlsplane_connect(argv[1]);
    if (!h) { printf("connect=%s\n", err(errno)); return 1; }

    memset(&info, 0xee, sizeof info);
    fd = tlsplane_accept(h, &info);
    if (fd < 0) { printf("accept=%s\n", err(errno)); return 1; }
    printf("conn_id=%llu plane=%u version=%04x suite=%04x\n", (unsigned long long)info.conn_id,
           info.plane, info.tls_version, info.cipher_suite);
    printf("sni=%s sni_len=%u alpn=%.*s\n", info.server_name, info.server_name_len,
           (int)info.alpn_len, (const char *)info.alpn);
    printf("peer=%u.%u.%u.%u:%u family=%u local_family=%u\n", info.peer.addr[0],
           info.peer.addr[1], info.peer.addr[2], info.peer.addr[3], info.peer.port,
           info.peer.family, info.local.family);

    /* Small reads on purpose: the data comes in several calls. */
    while ((n = tlsplane_read(h, fd, buf, 16)) > 0) {
        memcpy(data + got, buf, (size_t)n);
        got += (size_t)n;
    }
    if (n < 0) { printf("read=%s\n", err(errno)); return 1; }
    printf("data=%.*s\n", (int)got, data);
    printf("short_read=%s\n", tlsplane_read(h, fd, buf, 8) < 0 ? err(errno) : "ok");
    if (write(fd, "pong", 4) != 4) { printf("write=%s\n", err(errno)); return 1; }
    r = tlsplane_close(h, fd);
    printf("close=%d\n", r);
    printf("read_after_close=%s\n", tlsplane_read(h, fd, buf, sizeof buf) < 0 ? err(errno) : "ok");
    printf("close_unknown=%s\n", tlsplane_close(h, 12345) < 0 ? err(errno) : "ok");

    /* A user-plane connection: answered, then ended through the library too. */
    fd = tlsplane_accept(h, &info);
    if (fd < 0) { printf("accept=%s\n", err(errno)); return 1; }
    if (write(fd, "relayed", 7) != 7) { printf("write=%s\n", err(errno)); return 1; }
    printf("plane=%u close=%d\n", info.plane, tlsplane_close(h, fd));

    /* A header the library refuses, then tlsplane going away. */
    printf("accept_bad=%s\n", tlsplane_accept(h, &info) < 0 ? err(errno) : "fd");
    printf("accept_gone=%s\n", tlsplane_accept(h, &info) < 0 ? err(errno) : "fd");
    tlsplane_disconnect(h);
    printf("fds_leaked=%d\n", count_fds() - before);
    return 0;
}
