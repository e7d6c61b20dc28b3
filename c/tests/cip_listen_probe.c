/*
 * The order of binding a listening socket (c/src/listen.c), for
 * tests/test_socket_paths_cpu.py: link() is this program's own, so it sees the socket and
 * the temporary file at the moment the path appears.
 *
 *   cip_listen_probe PATH MODE  -> "at link: listening=1 mode=600", then "ok" once a client
 *                                  connected at PATH (or "err STATUS ERRNO why")
 *   cip_listen_probe PATH MODE publisher
 *                               -> the same through cipi_publisher_listen (a stale file at
 *                                  PATH replaced, a live one refused; MODE 600: no other uid
 *                                  allowed, 666: another uid allowed)
 *
 * With CIP_PROBE_LINK_ERRNO=N in the environment, link() says "at link: ..." and then fails
 * with errno N (EPERM, EXDEV, ...: a file system without hard links) without linking, so
 * the socket must reach PATH another way.
 */
#include "../src/cip_internal.h"

static int sock = -1;

int
link(const char *from, const char *to)
{
    int on = -1;
    socklen_t len = sizeof on;
    struct stat st;
    if (sock >= 0) {
        getsockopt(sock, SOL_SOCKET, SO_ACCEPTCONN, &on, &len);
    } else { /* cipi_publisher_listen's own socket: listening if a client can connect */
        int client = -1, e = 0;
        on = cipi_connect_unix(from, SOCK_SEQPACKET, cipi_deadline_of(1000), &client, &e) ==
             CIP_OK;
        if (client >= 0)
            close(client);
    }
    printf("at link: listening=%d mode=%03o\n", on,
           stat(from, &st) == 0 ? (unsigned)(st.st_mode & 0777) : 01000);
    const char *fail = getenv("CIP_PROBE_LINK_ERRNO");
    if (fail != NULL && *fail != '\0') {
        errno = (int)strtol(fail, NULL, 10);
        return -1;
    }
    return linkat(AT_FDCWD, from, AT_FDCWD, to, 0);
}

int
main(int argc, char **argv)
{
    if (argc != 3 && !(argc == 4 && strcmp(argv[3], "publisher") == 0))
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    unsigned mode = (unsigned)strtoul(argv[2], NULL, 8);
    uint64_t dev, ino;
    int err = 0;
    cip_status st;
    int fd = -1;
    if (argc == 4) {
        uint32_t other = (uint32_t)geteuid() + 1;
        st = cipi_publisher_listen(argv[1], &other, mode == 0666 ? 1 : 0, 4, &fd, &dev, &ino,
                                   &err);
    } else {
        fd = sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        st = cipi_bind_listen(sock, argv[1], mode, 4, &dev, &ino, &err);
    }
    if (st != CIP_OK) {
        printf("err %d %d %s\n", (int)st, err, cip_last_error());
        return 1;
    }
    int client = -1;
    st = cipi_connect_unix(argv[1], SOCK_SEQPACKET, cipi_deadline_of(1000), &client, &err);
    printf(st == CIP_OK ? "ok\n" : "err %d %d connect\n", (int)st, err);
    if (client >= 0)
        close(client);
    close(fd);
    return st == CIP_OK ? 0 : 1;
}
