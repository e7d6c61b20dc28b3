/*
 * A C publisher with no GPU: the producer's calls (c/src/producer.c) over a lease book, a
 * session and the accept thread, driven by line commands, for
 * tests/test_c_producer_cpu.py.  The subscribers are real sockets of the test process;
 * the sanitizer lanes build it with AddressSanitizer + UndefinedBehaviorSanitizer and with
 * ThreadSanitizer.
 *
 *   listen PATH SLOTS MAX_SUBS LEASE_TIMEOUT_MS -> ok     (4 slots, latest refused: no)
 *   acquire TIMEOUT_MS     -> ok SLOT | timeout            (-1: without limit)
 *   publish SLOT TEXT      -> ok SEQ                       (TEXT: the frame's payload)
 *   poll TIMEOUT_MS        -> ok N                         (leases ended since the last)
 *   news                   -> ok J id:mode:credit ... / G id ... / L id:why|...
 *   stop                   -> ok, then as news             (the accept thread stopped)
 *   close LINGER_MS        -> ok ALL_GONE                  (BYE, sockets closed)
 *   state                  -> ok NEXT_SEQ LAST_SLOT SUBS EVICTIONS
 *   fds | quit
 */
#include "../src/cip_internal.h"
#include "probe_util.h"

#include <sys/un.h>

static const char *const MODES[3] = {"block", "latest", "ahead"};

static void
print_news(struct cipi_producer *p)
{
    struct cipi_welcomed *joined, *gone;
    size_t njoined, ngone;
    cipi_producer_take_news(p, &joined, &njoined, &gone, &ngone);
    printf("ok %zu", njoined);
    for (size_t i = 0; i < njoined; i++)
        printf(" %u:%s:%u", joined[i].sub_id, MODES[joined[i].mode], joined[i].credit);
    printf(" / %zu", ngone);
    for (size_t i = 0; i < ngone; i++)
        printf(" %u", gone[i].sub_id);
    printf(" / %u", p->s->nleft);
    for (uint32_t i = 0; i < p->s->nleft; i++)
        printf(" %u:%s|", p->s->left[i].sub_id, p->s->left[i].why);
    p->s->nleft = 0;
    printf("\n");
    cipi_acceptor_free_list(joined, njoined);
    cipi_acceptor_free_list(gone, ngone);
}

int
main(void)
{
    char line[4096], path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    struct cipi_leasebook book;
    struct cipi_pubsession session;
    struct cipi_acceptor *acc = NULL;
    struct cipi_producer prod;
    int made = 0, memfd = -1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = 0;
        char cmd[32] = "";
        int used = 0;
        if (sscanf(line, "%31s%n", cmd, &used) != 1)
            continue;
        const char *rest = line + used;
        long long a = 0, b = 0, c = 0;
        if (!strcmp(cmd, "quit")) {
            break;
        } else if (!strcmp(cmd, "listen") && !made &&
                   sscanf(rest, "%107s %lld %lld %lld", path, &a, &b, &c) == 4) {
            int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            uint64_t dev, ino; /* bound and listening as a publisher's is (c/src/listen.c) */
            int err = 0;
            if (s < 0 || cipi_bind_listen(s, path, 0600, 256, &dev, &ino, &err) != CIP_OK) {
                printf("err -1 cannot listen at %s: %s\n", path, strerror(s < 0 ? errno : err));
                if (s >= 0)
                    close(s);
                continue;
            }
            cip_status st = cipi_leases_init(&book, (uint32_t)a, -1, -1);
            if (st == CIP_OK && (st = cipi_pubsession_init(&session, &book, c / 1000.0, 5.0)))
                cipi_leases_free(&book);
            if (st != CIP_OK) {
                printf("err %d %s\n", (int)st, cip_last_error());
                close(s);
                continue;
            }
            memfd = memfd_create("probe-slot", MFD_CLOEXEC);
            uint32_t uid = (uint32_t)getuid();
            uint8_t payload[] = {'p', 'a', 'y'};
            struct cipi_acceptor_config cfg = {
                .listener = s, .num_slots = (uint32_t)a, .max_subscribers = (uint32_t)b,
                .max_credit = book.max_credit, .lease_timeout_ms = (uint32_t)c, .per_uid = 8,
                .handshake_ns = 5000000000LL, .uids = &uid, .nuids = 1, .payload = payload,
                .payload_len = sizeof payload, .row_at = -1, .fds = &memfd, .nfds = 1,
                .refuse = {NULL, NULL, NULL},
            };
            if ((st = cipi_acceptor_new(&cfg, &acc)) != CIP_OK)
                close(s); /* (the acceptor's only once made) */
            else if ((st = cipi_acceptor_start(acc)) != CIP_OK)
                cipi_acceptor_free(acc);
            if (st != CIP_OK) {
                printf("err %d %s\n", (int)st, cip_last_error());
                acc = NULL;
                cipi_pubsession_free(&session);
                cipi_leases_free(&book);
                continue;
            }
            cipi_producer_init(&prod, &session, acc);
            made = 1;
            printf("ok\n");
        } else if (!strcmp(cmd, "acquire") && made && sscanf(rest, "%lld", &a) == 1) {
            uint32_t slot;
            cip_status st = cipi_producer_acquire(&prod, a < 0 ? -1 : a * 1000000LL, NULL, &slot);
            if (st == CIP_OK)
                printf("ok %u\n", slot);
            else if (st == CIP_ERR_TIMEOUT)
                printf("timeout\n");
            else
                printf("err %d %s\n", (int)st, cip_last_error());
        } else if (!strcmp(cmd, "publish") && made && sscanf(rest, "%lld %n", &a, &used) == 1) {
            const char *text = rest + used;
            uint64_t seq;
            cip_status st = cipi_producer_publish(&prod, (uint32_t)a, 0, 1, text, strlen(text),
                                                  NULL, &seq);
            if (st == CIP_OK)
                printf("ok %llu\n", (unsigned long long)seq);
            else
                printf("err %d %s\n", (int)st, cip_last_error());
        } else if (!strcmp(cmd, "poll") && made && sscanf(rest, "%lld", &a) == 1) {
            uint64_t n;
            cip_status st = cipi_producer_poll(&prod, a < 0 ? -1 : a * 1000000LL, 0, 0, NULL, &n);
            if (st == CIP_OK)
                printf("ok %llu\n", (unsigned long long)n);
            else
                printf("err %d %s\n", (int)st, cip_last_error());
        } else if (!strcmp(cmd, "news") && made) {
            print_news(&prod);
        } else if (!strcmp(cmd, "stop") && made) {
            cipi_producer_stop(&prod);
            print_news(&prod);
        } else if (!strcmp(cmd, "close") && made && sscanf(rest, "%lld", &a) == 1) {
            printf("ok %d\n", cipi_pubsession_close(&session, a * 1000000LL, NULL));
        } else if (!strcmp(cmd, "state") && made) {
            printf("ok %llu %u %u %llu\n", (unsigned long long)cipi_acceptor_next_seq(acc),
                   prod.last_slot, session.wire.n, (unsigned long long)session.evictions);
        } else if (!strcmp(cmd, "fds")) {
            printf("ok %d\n", count_fds());
        } else {
            printf("err -1 unknown command: %s\n", line);
        }
    }
    if (made) {
        cipi_producer_stop(&prod);
        cipi_producer_free(&prod);
        cipi_acceptor_free(acc);
        cipi_pubsession_free(&session);
        cipi_leases_free(&book);
    }
    if (memfd >= 0)
        close(memfd);
    return 0;
}
