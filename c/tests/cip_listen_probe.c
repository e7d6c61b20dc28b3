/*
 * The order of binding a listening socket (c/src/listen.c), for
 * tests/test_socket_paths_cpu.py: link() is this program's own, so it sees the socket and
 * the temporary file at the moment the path appears.
 *
 *   cip_listen_probe PATH MODE  -> "at link: listening=1 mode=600", then "ok" once a client
 *                                  connected at PATH (or "err STATUS ERRNO why")
 */
#include "../src/cip_internal.h"

static int sock = -1;

int
link(const char *from, const char *to)
{
    int on = -1;
    socklen_t len = sizeof on;
    struct stat st;
    getsockopt(sock, SOL_SOCKET, SO_ACCEPTCONN, &on, &len);
    printf("at link: listening=%d mode=%03o\n", on,
           stat(from, &st) == 0 ? (unsigned)(st.st_mode & 0777) : 01000);
    return linkat(AT_FDCWD, from, AT_FDCWD, to, 0);
}

int
main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    uint64_t dev, ino;
    int err = 0;
    cip_status st = cipi_bind_listen(sock, argv[1], (unsigned)strtoul(argv[2], NULL, 8), 4,
                                     &dev, &ino, &err);
    if (st != CIP_OK) {
        printf("err %d %d %s\n", (int)st, err, cip_last_error());
        return 1;
    }
    int client = -1;
    st = cipi_connect_unix(argv[1], SOCK_SEQPACKET, cipi_deadline_of(1000), &client, &err);
    printf(st == CIP_OK ? "ok\n" : "err %d %d connect\n", (int)st, err);
    if (client >= 0)
        close(client);
    close(sock);
    return st == CIP_OK ? 0 : 1;
}
