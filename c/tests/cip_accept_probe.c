/*
 * The publisher's accept thread (c/src/acceptor.c) driven by line commands, for
 * tests/test_c_acceptor_cpu.py: the clients are real sockets of the test process, the rows
 * of read flags are c/src/reader_rows.c's over a page of this program, reached through hooks
 * under a mutex as the Python binding reaches a ReaderRows.  The sanitizer lanes build it
 * with AddressSanitizer + UndefinedBehaviorSanitizer and with ThreadSanitizer.
 *
 *   listen PATH ROWS PER_UID HANDSHAKE_MS MAX_SUBS  -> ok        (ROWS 0: no rows)
 *   start | stop | quit                              -> ok
 *   take    -> ok N id:row:mode:credit:hello ... / M id:row ...   (N welcomed, M gone)
 *   drop ID -> ok       a taken subscriber leaves: its socket closed, its row back
 *   hs UID  -> ok N     handshakes in progress (UID -1: all)
 *   state   -> ok LIVE_ROWS WELCOMED NEWS FAILURE
 *   seq N   -> ok       the next frame's seq, told in each WELCOME
 *   fds     -> ok N     this process's open fds
 *   starve  -> ok N     RLIMIT_NOFILE lowered and the fd table filled (N held): accept fails
 *   feed    -> ok       the held fds closed, the limit back
 *   cpu     -> ok NS    this process's CPU time
 *   forkstop -> ok STATUS  a child forked now stops, takes and frees the acceptor (as a
 *                      forked Python process would at exit): its exit status, 0 if it did
 *                      so within 5 s
 */
#include "../src/cip_internal.h"
#include "probe_util.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <sys/un.h>
#include <time.h>

/* The payload: "pay", the row (4 bytes little endian), "!" */
#define ROW_AT 3

static struct cipi_rows rows;
static uint32_t *page;
static pthread_mutex_t rows_lock = PTHREAD_MUTEX_INITIALIZER;
static int rows_made;

static int
hook_assign(void *ctx, uint32_t sub_id, int pid, uint32_t *row)
{
    (void)ctx;
    pthread_mutex_lock(&rows_lock);
    cip_status st = cipi_rows_assign(&rows, sub_id, pid, row);
    pthread_mutex_unlock(&rows_lock);
    return st == CIP_OK ? 0 : st == CIP_ERR_PROTOCOL ? 1 : -1;
}

static void
hook_drop(void *ctx, uint32_t sub_id)
{
    (void)ctx;
    pthread_mutex_lock(&rows_lock);
    (void)cipi_rows_drop(&rows, sub_id);
    pthread_mutex_unlock(&rows_lock);
}

struct taken {
    uint32_t sub_id;
    int fd;
};
static struct taken adopted[1024];
static size_t nadopted;

static int starved[4096];
static size_t nstarved;
static struct rlimit nofile;

static const char *const MODES[3] = {"block", "latest", "ahead"};

static void
print_list(const struct cipi_welcomed *w, size_t n, int full)
{
    printf(" %zu", n);
    for (size_t i = 0; i < n; i++) {
        printf(" %u:%ld", w[i].sub_id, w[i].row);
        if (full) {
            printf(":%s:%u:", MODES[w[i].mode], w[i].credit);
            for (uint32_t k = 0; k < w[i].hello_len; k++)
                printf("%02x", w[i].hello[k]);
        }
    }
}

int
main(void)
{
    char line[4096], path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    struct cipi_acceptor *acc = NULL;
    int made = 0, memfd = -1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = 0;
        char cmd[32] = "";
        int used = 0;
        if (sscanf(line, "%31s%n", cmd, &used) != 1)
            continue;
        const char *rest = line + used;
        long long a = 0, b = 0, c = 0, d = 0;
        if (!strcmp(cmd, "quit")) {
            break;
        } else if (!strcmp(cmd, "listen") && !made &&
                   sscanf(rest, "%107s %lld %lld %lld %lld", path, &a, &b, &c, &d) == 5) {
            int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            uint64_t dev, ino; /* bound and listening as a publisher's is (c/src/listen.c) */
            int err = 0;
            if (s < 0 || cipi_bind_listen(s, path, 0600, 256, &dev, &ino, &err) != CIP_OK) {
                printf("err -1 cannot listen at %s: %s\n", path, strerror(s < 0 ? errno : err));
                if (s >= 0)
                    close(s);
                continue;
            }
            if (a > 0) {
                page = calloc((size_t)(a * 4 + 64), sizeof *page);
                cip_status st = cipi_rows_init(&rows, (uint32_t)a, 4, page,
                                               (size_t)(a * 4 + 64) * sizeof *page, 64 * 4);
                if (st != CIP_OK) {
                    printf("err %d %s\n", (int)st, cip_last_error());
                    close(s);
                    continue;
                }
                rows_made = 1;
            }
            memfd = memfd_create("probe-slot", MFD_CLOEXEC);
            uint32_t uid = (uint32_t)getuid();
            uint8_t payload[] = {'p', 'a', 'y', 0, 0, 0, 0, '!'};
            struct cipi_acceptor_config cfg = {
                .listener = s, .num_slots = 4, .max_subscribers = (uint32_t)d, .max_credit = 2,
                .lease_timeout_ms = 0, .per_uid = (uint32_t)b, .handshake_ns = c * 1000000LL,
                .uids = &uid, .nuids = 1, .payload = payload, .payload_len = sizeof payload,
                .row_at = a > 0 ? ROW_AT : -1, .fds = &memfd, .nfds = 1,
                .refuse = {NULL, "no latest here", NULL},
                .hooks = {NULL, hook_assign, hook_drop},
            };
            cip_status st = cipi_acceptor_new(&cfg, &acc);
            if (st != CIP_OK) {
                printf("err %d %s\n", (int)st, cip_last_error());
                close(s);
                continue;
            }
            made = 1;
            printf("ok\n");
        } else if (!strcmp(cmd, "start") && made) {
            cip_status st = cipi_acceptor_start(acc);
            if (st != CIP_OK)
                printf("err %d %s\n", (int)st, cip_last_error());
            else
                printf("ok\n");
        } else if (!strcmp(cmd, "take") && made) {
            struct cipi_welcomed *w, *gone;
            size_t n, ngone;
            cipi_acceptor_take(acc, &w, &n, &gone, &ngone);
            printf("ok");
            print_list(w, n, 1);
            printf(" /");
            print_list(gone, ngone, 0);
            printf("\n");
            for (size_t i = 0; i < n; i++) {
                if (nadopted < sizeof adopted / sizeof *adopted) {
                    adopted[nadopted++] = (struct taken){w[i].sub_id, w[i].fd};
                    w[i].fd = -1; /* ours */
                }
                if (w[i].row >= 0) {
                    pthread_mutex_lock(&rows_lock);
                    (void)cipi_rows_adopt(&rows, w[i].sub_id);
                    pthread_mutex_unlock(&rows_lock);
                }
            }
            cipi_acceptor_free_list(w, n);
            cipi_acceptor_free_list(gone, ngone);
        } else if (!strcmp(cmd, "drop") && made && sscanf(rest, "%lld", &a) == 1) {
            size_t i = 0;
            while (i < nadopted && adopted[i].sub_id != (uint32_t)a)
                i++;
            if (i == nadopted) {
                printf("err -1 no subscriber %lld\n", a);
                continue;
            }
            close(adopted[i].fd);
            adopted[i] = adopted[--nadopted];
            if (rows_made) {
                uint32_t none[4] = {0, 0, 0, 0};
                pthread_mutex_lock(&rows_lock);
                cipi_rows_leave(&rows, (uint32_t)a, none, 1);
                pthread_mutex_unlock(&rows_lock);
            }
            cipi_acceptor_dropped(acc);
            printf("ok\n");
        } else if (!strcmp(cmd, "hs") && made && sscanf(rest, "%lld", &a) == 1) {
            printf("ok %zu\n", cipi_acceptor_handshakes(acc, a));
        } else if (!strcmp(cmd, "state") && made) {
            pthread_mutex_lock(&rows_lock);
            uint32_t live = rows_made ? rows.nlive : 0;
            pthread_mutex_unlock(&rows_lock);
            const char *why = cipi_acceptor_failure(acc);
            printf("ok %u %llu %d %s\n", live, (unsigned long long)cipi_acceptor_welcomed(acc),
                   cipi_acceptor_news(acc), why == NULL ? "-" : why);
        } else if (!strcmp(cmd, "seq") && made && sscanf(rest, "%lld", &a) == 1) {
            cipi_acceptor_set_next_seq(acc, (uint64_t)a);
            printf("ok\n");
        } else if (!strcmp(cmd, "stop") && made) {
            cipi_acceptor_stop(acc);
            printf("ok\n");
        } else if (!strcmp(cmd, "starve") && nstarved == 0) {
            struct rlimit low;
            getrlimit(RLIMIT_NOFILE, &nofile);
            low = nofile;
            low.rlim_cur = (rlim_t)count_fds() + 64;
            setrlimit(RLIMIT_NOFILE, &low);
            int fd;
            while (nstarved < sizeof starved / sizeof *starved &&
                   (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
                starved[nstarved++] = fd;
            printf("ok %zu\n", nstarved);
        } else if (!strcmp(cmd, "feed")) {
            while (nstarved)
                close(starved[--nstarved]);
            setrlimit(RLIMIT_NOFILE, &nofile);
            printf("ok\n");
        } else if (!strcmp(cmd, "forkstop") && made) {
            pid_t child = fork();
            if (child == 0) {
                alarm(5); /* a join of the parent's thread, or a lock held at the fork, hangs */
                struct cipi_welcomed *w, *gone;
                size_t n, ngone;
                cipi_acceptor_stop(acc);
                cipi_acceptor_take(acc, &w, &n, &gone, &ngone);
                cipi_acceptor_free_list(w, n);
                cipi_acceptor_free_list(gone, ngone);
                cipi_acceptor_free(acc);
                _exit(n == 0 && ngone == 0 ? 0 : 3);
            }
            int status = 0;
            waitpid(child, &status, 0);
            printf("ok %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        } else if (!strcmp(cmd, "cpu")) {
            struct timespec t;
            clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
            printf("ok %lld\n", (long long)t.tv_sec * 1000000000LL + t.tv_nsec);
        } else if (!strcmp(cmd, "fds")) {
            printf("ok %d\n", count_fds());
        } else {
            printf("err -1 unknown command: %s\n", line);
        }
    }
    cipi_acceptor_free(acc);
    for (size_t i = 0; i < nadopted; i++)
        close(adopted[i].fd);
    if (memfd >= 0)
        close(memfd);
    if (rows_made)
        cipi_rows_free(&rows);
    free(page);
    return 0;
}
