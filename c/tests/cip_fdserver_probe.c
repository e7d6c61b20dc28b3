/*
 * The fd server (c/src/fdserver.c) and its client (c/src/fetch.c) in one C program, for
 * tests/test_c_fdserver_cpu.py; the sanitizer lanes build it with AddressSanitizer +
 * UndefinedBehaviorSanitizer and with ThreadSanitizer.
 *
 *   cip_fdserver_probe DIR CLIENTS ROUNDS
 *
 * serves 300 memfds (two SCM_RIGHTS batches), each holding its index, at DIR/fds.sock;
 * CLIENTS threads each fetch them ROUNDS times over the socket and check every one; a
 * wrong token is refused (CIP_ERR_REFUSED, EACCES); a client that sends half a request and
 * hangs up is forgotten; then the server stops.  Prints "ok FDS_BEFORE FDS_AFTER LIVE" (the
 * process's open fds before the server was made and after it was freed, and the
 * connections it still counted once every client was done), or "fail WHY".
 */
#include "../src/cip_internal.h"
#include "probe_util.h"

#include <sys/mman.h>
#include <sys/un.h>

enum { NFDS = 300 };

static const uint8_t TOKEN[16] = "0123456789abcdef";
static char path[108];
static int served[NFDS];
static int rounds;
static int failures;

static void
fail(const char *what, const char *why)
{
    printf("fail %s: %s\n", what, why);
    __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
}

static struct cipi_fetch
request(const uint8_t *token)
{
    return (struct cipi_fetch){
        .pid = 0,
        .start_time = -1,
        .n = NFDS,
        .socket_path = path,
        .token = token,
        .token_len = sizeof TOKEN,
        .method = CIP_TRANSPORT_SOCKET,
        .exporter_uid = (long long)geteuid(),
        .where = CIPI_WHERE_SAME,
        .timeout_ms = 10000,
    };
}

static void *
client(void *arg)
{
    (void)arg;
    int *got = malloc(NFDS * sizeof *got);
    for (int r = 0; got != NULL && r < rounds; r++) {
        struct cipi_fetch f = request(TOKEN);
        int err = 0;
        if (cipi_fetch(&f, got, &err) != CIP_OK) {
            fail("fetch", cip_last_error());
            break;
        }
        for (int i = 0; i < NFDS; i++) {
            int v = -1;
            if (pread(got[i], &v, sizeof v, 0) != (ssize_t)sizeof v || v != i)
                fail("content", "a fetched fd does not hold its index");
            close(got[i]);
        }
    }
    free(got);
    return NULL;
}

int
main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR CLIENTS ROUNDS\n", argv[0]);
        return 2;
    }
    int nclients = atoi(argv[2]);
    rounds = atoi(argv[3]);
    snprintf(path, sizeof path, "%s/fds.sock", argv[1]);
    for (int i = 0; i < NFDS; i++) {
        served[i] = memfd_create("cip-fdserver-probe", MFD_CLOEXEC);
        if (served[i] < 0 || pwrite(served[i], &i, sizeof i, 0) != (ssize_t)sizeof i) {
            printf("fail memfd\n");
            return 1;
        }
    }
    int before = count_fds();
    int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    uint64_t dev, ino;
    int err = 0;
    if (listener < 0 || cipi_bind_listen(listener, path, 0600, 64, &dev, &ino, &err) != CIP_OK) {
        printf("fail listen: %s\n", cip_last_error());
        return 1;
    }
    uint32_t uid = (uint32_t)geteuid();
    struct cipi_fdserver *s;
    if (cipi_fdserver_new(listener, served, NFDS, TOKEN, sizeof TOKEN, &uid, 1, &s) != CIP_OK ||
        cipi_fdserver_start(s) != CIP_OK) {
        printf("fail server: %s\n", cip_last_error());
        return 1;
    }
    /* half a request, then gone: forgotten, nobody else delayed */
    int half = -1;
    if (cipi_connect_unix(path, SOCK_STREAM, cipi_deadline_of(5000), &half, &err) == CIP_OK) {
        (void)!send(half, "FDS1\x10tt", 7, MSG_NOSIGNAL);
        close(half);
    } else {
        fail("connect", cip_last_error());
    }
    pthread_t *threads = calloc((size_t)nclients, sizeof *threads);
    for (int i = 0; threads != NULL && i < nclients; i++)
        pthread_create(&threads[i], NULL, client, NULL);
    for (int i = 0; threads != NULL && i < nclients; i++)
        pthread_join(threads[i], NULL);
    free(threads);
    /* a wrong token: refused, nothing fetched */
    uint8_t wrong[sizeof TOKEN];
    memcpy(wrong, TOKEN, sizeof wrong);
    wrong[0] ^= 1;
    struct cipi_fetch f = request(wrong);
    int *got = malloc(NFDS * sizeof *got);
    cip_status st = got == NULL ? CIP_ERR_NO_MEMORY : cipi_fetch(&f, got, &err);
    if (st != CIP_ERR_REFUSED || err != EACCES || strstr(cip_last_error(), "token") == NULL)
        fail("wrong token", cip_last_error());
    free(got);
    long long deadline = cipi_now_ns() + 5000000000LL; /* the server closes each at its end */
    while (cipi_fdserver_live(s) != 0 && cipi_now_ns() < deadline)
        cipi_sleep_us(1000);
    int live = cipi_fdserver_live(s);
    cipi_fdserver_stop(s);
    cipi_fdserver_free(s);
    cipi_unlink_if_ours(path, dev, ino);
    int after = count_fds();
    for (int i = 0; i < NFDS; i++)
        close(served[i]);
    if (failures == 0)
        printf("ok %d %d %d\n", before, after, live);
    return failures == 0 ? 0 : 1;
}
