/*
 * Echo servers of the shapes people preload the shim into, knowing nothing of tlsplane:
 * `shim_servers PORT MODE [N]`, listening on 127.0.0.1:PORT.
 *
 *   threads N   N threads, each in a blocking accept(2) on the one listening socket
 *   prefork N   N processes forked after listen, each in a blocking accept(2) on it
 *   forkper     one process polls the (non-blocking) socket, accept4s, and forks a child per
 *               connection, closing its own copy at once (socketserver.ForkingMixIn's shape)
 *
 * Each connection is echoed to its end, then closed. With SHIM_STRESS=1 (threads mode), while
 * the threads serve: a thread forks 200 children that each close the listening socket and a
 * pipe and exit (a child not gone within 2 s is counted hung, then killed; the third hung one
 * ends the forking); another closes a
 * duplicate of a pipe every millisecond and keeps the longest close; two more call
 * getsockname and close without pause while the forking goes on; and the hand-off connection's
 * send buffer is made as small as the kernel allows. With SHIM_DROP_UID=N, right after listen
 * the server drops root for uid and gid N, as daemons do (the process is then not dumpable:
 * kcmp(2) on its children fails with EPERM). At the end of stdin: prints "served=N"
 * (and "forks=F hung=H close_max_ms=M"), then "done".
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int l;
static int *served; /* shared with forked children */
static int pipefd[2];
static volatile int stopping;
static volatile int forking_done;
static int forks, hung;
static long close_max_ms;

static void die(const char *what) {
    printf("error %s: %s\n", what, strerror(errno));
    exit(1);
}

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void echo(int c) {
    char buf[16384];
    for (;;) {
        ssize_t n = read(c, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(c, buf + off, (size_t)(n - off));
            if (w < 0 && errno != EINTR)
                goto out;
            if (w > 0)
                off += w;
        }
    }
out:
    close(c);
    __atomic_add_fetch(served, 1, __ATOMIC_RELAXED);
}

static void *accepting(void *arg) {
    (void)arg;
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c >= 0)
            echo(c);
        else if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN)
            return NULL;
    }
}

/* Forks children that close what a child of a server closes, and waits for each. */
static void *forking(void *arg) {
    (void)arg;
    for (int i = 0; i < 200 && hung < 3; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            close(pipefd[0]);
            close(l);
            _exit(0);
        }
        if (pid < 0)
            continue;
        forks++;
        long deadline = now_ms() + 2000;
        while (waitpid(pid, NULL, WNOHANG) == 0) {
            if (now_ms() > deadline) {
                hung++;
                kill(pid, SIGKILL);
                waitpid(pid, NULL, 0);
                break;
            }
            usleep(1000);
        }
        usleep(2000);
    }
    forking_done = 1;
    return NULL;
}

static void *timing_close(void *arg) {
    (void)arg;
    while (!stopping) {
        int d = dup(pipefd[1]);
        long t0 = now_ms();
        close(d);
        long took = now_ms() - t0;
        if (took > close_max_ms)
            close_max_ms = took;
        usleep(1000);
    }
    return NULL;
}

/* Calls on the listening socket and closes, without pause, while the children are forked:
 * a fork then often lands while this thread is inside the shim. */
static void *hammering(void *arg) {
    (void)arg;
    while (!forking_done) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        getsockname(l, (struct sockaddr *)&ss, &len);
        close(dup(pipefd[0]));
    }
    return NULL;
}

static pthread_t spawn(void *(*f)(void *)) {
    pthread_t t;
    if (pthread_create(&t, NULL, f, NULL) != 0)
        die("pthread_create");
    return t;
}

static void fork_per_connection(void) {
    fcntl(l, F_SETFL, O_NONBLOCK);
    for (;;) {
        struct pollfd p[2] = {{l, POLLIN, 0}, {0, POLLIN, 0}};
        if (poll(p, 2, 1000) < 0 && errno != EINTR)
            die("poll");
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        if (p[1].revents) {
            char b[64];
            if (read(0, b, sizeof b) <= 0)
                return;
        }
        if (!(p[0].revents & POLLIN))
            continue;
        int c = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0)
            continue; /* EAGAIN: nothing after all; ECONNABORTED: tlsplane went away */
        pid_t pid = fork();
        if (pid == 0) {
            echo(c);
            _exit(0);
        }
        close(c);
    }
}

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argv[2];
    int n = argc > 3 ? atoi(argv[3]) : 1;
    int stress = getenv("SHIM_STRESS") && !strcmp(getenv("SHIM_STRESS"), "1");
    served = mmap(NULL, sizeof *served, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1,
                  0);
    if (served == MAP_FAILED || pipe(pipefd) < 0)
        die("setup");
    l = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((unsigned short)atoi(argv[1]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) < 0)
        die("bind");
    if (listen(l, 64) < 0)
        die("listen");
    const char *drop = getenv("SHIM_DROP_UID");
    if (drop && *drop) {
        unsigned id = (unsigned)atoi(drop);
        if (setgroups(0, NULL) < 0 || setgid(id) < 0 || setuid(id) < 0)
            die("dropping root");
    }
    if (stress) {
        int small = 1; /* the kernel's minimum: a few frames fill it */
        setsockopt(l, SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
    }
    printf("listening\n");

    pid_t kids[64];
    int n_kids = 0;
    pthread_t forker = 0;
    if (!strcmp(mode, "threads")) {
        for (int i = 0; i < n; i++)
            pthread_detach(spawn(accepting));
        if (stress) {
            forker = spawn(forking);
            pthread_detach(spawn(timing_close));
            pthread_detach(spawn(hammering));
            pthread_detach(spawn(hammering));
        }
    } else if (!strcmp(mode, "prefork")) {
        for (int i = 0; i < n && i < 64; i++) {
            pid_t pid = fork();
            if (pid == 0) {
                accepting(NULL);
                _exit(1);
            }
            if (pid > 0)
                kids[n_kids++] = pid;
        }
    } else if (!strcmp(mode, "forkper")) {
        fork_per_connection();
    } else {
        return 2;
    }
    if (strcmp(mode, "forkper") != 0) {
        char b[64];
        while (read(0, b, sizeof b) > 0)
            ;
    }
    stopping = 1;
    if (forker)
        pthread_join(forker, NULL);
    for (int i = 0; i < n_kids; i++) {
        kill(kids[i], SIGKILL);
        waitpid(kids[i], NULL, 0);
    }
    printf("served=%d\n", __atomic_load_n(served, __ATOMIC_RELAXED));
    if (stress)
        printf("forks=%d hung=%d close_max_ms=%ld\n", forks, hung, close_max_ms);
    printf("done\n");
    return 0;
}
