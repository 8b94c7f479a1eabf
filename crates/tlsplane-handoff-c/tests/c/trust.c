/* Connects through the C library to whoever listens at a path, for tests/c_abi.rs:
 * `trust SOCKET_PATH [UID]` uses tlsplane_connect (TLSPLANE_HANDOFF_UID decides), or with UID
 * tlsplane_connect_uids. Prints "refused EPERM" (or another errno's name), or "accepted" with
 * the first connection's server name and peer. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tlsplane.h"

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3)
        return 2;
    uid_t uid = argc == 3 ? (uid_t)strtoul(argv[2], NULL, 10) : 0;
    tlsplane_handle *h = argc == 3 ? tlsplane_connect_uids(argv[1], &uid, 1)
                                   : tlsplane_connect(argv[1]);
    if (!h) {
        printf("refused %s\n", errno == EPERM ? "EPERM" : errno == EINVAL ? "EINVAL"
                                                                          : strerror(errno));
        return 1;
    }
    struct tlsplane_conn_info info;
    int fd = tlsplane_accept(h, &info);
    if (fd < 0) {
        printf("accept: %s\n", strerror(errno));
        return 1;
    }
    printf("accepted %s %u.%u.%u.%u:%u\n", info.server_name, info.peer.addr[0],
           info.peer.addr[1], info.peer.addr[2], info.peer.addr[3], info.peer.port);
    close(fd);
    tlsplane_disconnect(h);
    return 0;
}
