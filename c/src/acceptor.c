/* acceptor.c -- the publisher's listening side: the accept thread, admission, the handshake.
 *
 * One thread (cipi_acceptor_start) serves the listening socket and the connections it
 * accepted, and never blocks on one: a connection's uid is checked before anything it sent
 * is read (SO_PEERCRED); each handshake has one deadline from accept; at most `per_uid`
 * handshakes of one uid are in progress (one more makes the oldest of that uid go); a HELLO
 * is answered with a WELCOME composed from data given at start (the payload, the fds, a row
 * of read flags from the rows hooks, the modes refused): the thread calls no user code and
 * holds no lock across a wait.  A welcomed subscriber waits among the pending, watched for a
 * hang-up, until the producer takes it (cipi_acceptor_take); one that goes first is
 * abandoned: its row goes back at once and the producer hears of it at its next take.
 *
 * The pending and abandoned lists, the subscriber count and `stopping` are under `lock`;
 * everything else the thread owns.  A connection is matched by its key or sub_id, never by
 * its fd number: the producer closes sockets it took while this thread may still have the
 * numbers in its poll set, and the kernel gives a freed number to the next accept. */
#include "cip_internal.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#define HELLO_BUF (CIP_WIRE_HELLO_SIZE + CIP_WIRE_MAX_HELLO_PAYLOAD + 1)

static void
drain(int fd)
{
    static __thread uint8_t sink[4096];
    for (int i = 0; i < 64; i++) { /* a HELLO and what may follow; the kernel caps the rest */
        ssize_t r = recv(fd, sink, sizeof sink, MSG_DONTWAIT);
        if (r <= 0)
            break;
    }
}

/* Send REFUSE (`reason`, cut to the protocol's limit) and close, without waiting; what the
 * peer sent is read first (closing a Unix socket with unread data resets the peer, which then
 * never sees the REFUSE). */
static void
refuse_and_close(int fd, const char *reason)
{
    uint8_t msg[CIP_WIRE_REFUSE_SIZE + CIP_WIRE_MAX_REFUSE_REASON];
    size_t n = cipi_put_refuse(msg, reason, strlen(reason));
    drain(fd);
    (void)!send(fd, msg, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    close(fd);
}

/* Close a connection whose handshake will not be finished (closing): no REFUSE, the
 * subscriber sees the publisher go and one that waits for a publisher tries again. */
static void
end_and_close(int fd)
{
    drain(fd);
    close(fd);
}

static void
welcomed_free(struct cipi_welcomed *w)
{
    free(w->hello);
    w->hello = NULL;
    if (w->fd >= 0)
        close(w->fd);
    w->fd = -1;
}

static int
push(struct cipi_welcomed **list, size_t *n, size_t *cap, const struct cipi_welcomed *w)
{
    if (*n == *cap) {
        size_t grown = *cap ? 2 * *cap : 8;
        void *p = realloc(*list, grown * sizeof **list);
        if (p == NULL)
            return -1;
        *list = p;
        *cap = grown;
    }
    (*list)[(*n)++] = *w;
    return 0;
}

/* The subscriber `w` will never be adopted: its row back now, its socket closed, and the
 * producer told at its next take (without memory to queue it, it is only forgotten). */
static void
abandon(struct cipi_acceptor *a, struct cipi_welcomed *w)
{
    if (w->row >= 0)
        a->hooks.drop(a->hooks.ctx, w->sub_id);
    if (w->fd >= 0)
        close(w->fd);
    w->fd = -1;
    pthread_mutex_lock(&a->lock);
    if (push(&a->abandoned, &a->nabandoned, &a->abandoned_cap, w) == 0) {
        w->hello = NULL; /* the list's now */
        __atomic_store_n(&a->news, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&a->lock);
    free(w->hello);
}

/* ---- the handshakes in progress: their fds by key; admission.c has the rest ---------- */

static long
handshake_at(const struct cipi_acceptor *a, uint64_t key)
{
    for (size_t i = 0; i < a->nhs; i++)
        if (a->hs[i].key == key)
            return (long)i;
    return -1;
}

/* Handshake `key` ends (its HELLO came, or it must go): out of the book (under lock); its
 * fd, or -1 if it was not there. */
static int
forget_handshake(struct cipi_acceptor *a, uint64_t key)
{
    pthread_mutex_lock(&a->lock);
    long i = handshake_at(a, key);
    int fd = -1;
    if (i >= 0) {
        fd = a->hs[i].fd;
        memmove(&a->hs[i], &a->hs[i + 1], (a->nhs - (size_t)i - 1) * sizeof *a->hs);
        a->nhs--;
        (void)cipi_admission_remove(a->adm, key);
    }
    pthread_mutex_unlock(&a->lock);
    return fd;
}

size_t
cipi_acceptor_handshakes(struct cipi_acceptor *a, long long uid)
{
    pthread_mutex_lock(&a->lock);
    size_t n = cipi_admission_count(a->adm, uid < 0, (uint64_t)uid);
    pthread_mutex_unlock(&a->lock);
    return n;
}

static double
now_s(void)
{
    return (double)cipi_now_ns() / 1e9;
}

/* ---- the welcome --------------------------------------------------------------------- */

static void
welcome(struct cipi_acceptor *a, int fd, const struct cipi_handshake *hs, const uint8_t *data,
        size_t n)
{
    pthread_mutex_lock(&a->lock);
    int full = a->count >= a->max_subscribers, stopping = a->stopping;
    pthread_mutex_unlock(&a->lock);
    char why[CIP_WIRE_MAX_REFUSE_REASON + 1];
    if (stopping) {
        close(fd);
        return;
    }
    if (full) {
        snprintf(why, sizeof why, "the publisher already has max_subscribers=%u",
                 a->max_subscribers);
        refuse_and_close(fd, why);
        return;
    }
    struct cipi_msg hello;
    if (cipi_decode(data, n, &hello) != CIP_OK) {
        snprintf(why, sizeof why, "bad HELLO: %s", cip_last_error());
        refuse_and_close(fd, why);
        return;
    }
    if (hello.type != CIP_WIRE_HELLO) {
        snprintf(why, sizeof why, "bad HELLO: expected HELLO, got %s", cipi_type_name(hello.type));
        refuse_and_close(fd, why);
        return;
    }
    if (a->refuse[hello.mode] != NULL) {
        refuse_and_close(fd, a->refuse[hello.mode]);
        return;
    }
    struct cipi_welcomed w = {
        .sub_id = a->next_id, .fd = fd, .pid = hs->pid ? hs->pid : (int)hello.pid,
        .peer_pid = hs->pid, .uid = hs->uid, .mode = hello.mode,
        .credit = cipi_granted_credit(hello.credit, a->max_credit), .row = -1,
    };
    uint32_t row = 0;
    if (a->row_at >= 0) {
        int got = a->hooks.assign(a->hooks.ctx, w.sub_id, hs->pid, &row);
        if (got != 0) {
            refuse_and_close(fd, got > 0 ? "no free subscriber row in the sync page"
                                         : "the publisher is closing");
            return;
        }
        w.row = row;
    }
    a->next_id++; /* its id is taken (a refused one's is not) */
    __atomic_add_fetch(&a->welcomed, 1, __ATOMIC_RELAXED);
    /* from here on every way out that does not hand it to the producer abandons it */
    size_t len = CIP_WIRE_WELCOME_SIZE + a->payload_len;
    uint8_t *msg = malloc(len);
    w.hello = hello.len ? malloc(hello.len) : NULL;
    uint64_t next_seq = __atomic_load_n(&a->next_seq, __ATOMIC_ACQUIRE);
    if (msg == NULL || (hello.len && w.hello == NULL) ||
        cipi_put_welcome(msg, w.sub_id, a->num_slots, next_seq, w.credit, a->lease_timeout_ms,
                         a->payload_len) != CIP_OK) {
        snprintf(why, sizeof why, "the publisher could not welcome this subscriber: %s",
                 msg == NULL || (hello.len && w.hello == NULL) ? "out of memory"
                                                                 : cip_last_error());
        free(msg);
        refuse_and_close(fd, why);
        w.fd = -1;
        abandon(a, &w);
        return;
    }
    w.hello_len = hello.len;
    if (hello.len)
        memcpy(w.hello, hello.payload, hello.len);
    memcpy(msg + CIP_WIRE_WELCOME_SIZE, a->payload, a->payload_len);
    if (a->row_at >= 0) {
        uint8_t *at = msg + CIP_WIRE_WELCOME_SIZE + a->row_at;
        for (int i = 0; i < 4; i++)
            at[i] = (uint8_t)(row >> (8 * i));
    }
    int sndbuf = 0;
    socklen_t sl = sizeof sndbuf;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &sl) == 0 && (size_t)sndbuf < len + 4096) {
        int need = (int)(len + 4096);
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &need, sizeof need);
    }
    struct iovec iov = {msg, len};
    union {
        char buf[CMSG_SPACE(sizeof(int) * CIP_WIRE_MAX_FDS)];
        struct cmsghdr align;
    } control;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (a->nfds) {
        mh.msg_control = control.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * a->nfds);
        memset(control.buf, 0, mh.msg_controllen);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * a->nfds);
        memcpy(CMSG_DATA(c), a->fds, sizeof(int) * a->nfds);
    }
    int err = 0;
    /* Under the lock, a send that does not wait: stop sets `stopping` under it too, so a
     * WELCOME is either sent before the stop began (and the subscriber is pending, which
     * the stop returns) or not at all. */
    pthread_mutex_lock(&a->lock);
    stopping = a->stopping;
    if (!stopping) {
        if (sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
            err = errno;
        } else if (push(&a->pending, &a->npending, &a->pending_cap, &w) == 0) {
            a->count++;
            __atomic_store_n(&a->news, 1, __ATOMIC_RELEASE);
            w.fd = -1;
            w.hello = NULL; /* the pending list's now */
        } else {
            err = ENOMEM;
        }
    }
    pthread_mutex_unlock(&a->lock);
    free(msg);
    if (!stopping && err == 0)
        return;
    if (err == EMSGSIZE) {
        snprintf(why, sizeof why,
                 "the WELCOME (%zu bytes) exceeds the socket buffer limit; raise "
                 "net.core.wmem_max or send a smaller welcome payload",
                 len);
        refuse_and_close(fd, why);
        w.fd = -1;
    } /* else: closing (the subscriber tries again), or it left before the WELCOME */
    abandon(a, &w);
}

/* Handshake `i` may have its HELLO: read it (without waiting) and answer. */
static void
on_hello(struct cipi_acceptor *a, size_t i, uint8_t *buf)
{
    struct cipi_handshake hs = a->hs[i];
    ssize_t n = recv(hs.fd, buf, HELLO_BUF, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    (void)forget_handshake(a, hs.key);
    pthread_mutex_lock(&a->lock);
    int stopping = a->stopping;
    pthread_mutex_unlock(&a->lock);
    if (n <= 0 || stopping) {
        close(hs.fd);
        return;
    }
    welcome(a, hs.fd, &hs, buf, (size_t)n);
}

/* Room for one more handshake (under lock): 0, or -1 without memory (nothing changed). */
static int
room_for_one(struct cipi_acceptor *a)
{
    if (a->nhs < a->hs_cap)
        return 0;
    size_t grown = a->hs_cap ? 2 * a->hs_cap : 16;
    struct cipi_handshake *hs = realloc(a->hs, grown * sizeof *a->hs);
    if (hs == NULL)
        return -1;
    a->hs = hs;
    uint64_t *keys = realloc(a->keys, grown * sizeof *a->keys);
    if (keys == NULL)
        return -1;
    a->keys = keys;
    a->hs_cap = grown;
    return 0;
}

static void
accepted(struct cipi_acceptor *a, int fd, uint8_t *buf)
{
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
        close(fd);
        return;
    }
    if (!cipi_uid_in(a->uids, a->nuids, cred.uid)) {
        char why[96];
        snprintf(why, sizeof why, "uid %u is not allowed to subscribe", (unsigned)cred.uid);
        refuse_and_close(fd, why);
        return;
    }
    uint64_t key = a->next_key++;
    size_t ngone = 0;
    pthread_mutex_lock(&a->lock);
    cip_status st = CIP_ERR_NO_MEMORY;
    if (room_for_one(a) == 0)
        st = cipi_admission_admit(a->adm, key, cred.uid, now_s(), a->gone, &ngone);
    if (st == CIP_OK)
        a->hs[a->nhs++] = (struct cipi_handshake){fd, key, (uint32_t)cred.uid, (int)cred.pid};
    pthread_mutex_unlock(&a->lock);
    for (size_t k = 0; k < ngone; k++) { /* the longest waiting of its uid made room */
        int gone = forget_handshake(a, a->gone[k]);
        char why[160];
        snprintf(why, sizeof why,
                 "%u handshakes of uid %u were in progress; this one, the oldest, made room "
                 "for a newer one",
                 a->per_uid, (unsigned)cred.uid);
        if (gone >= 0)
            refuse_and_close(gone, why);
    }
    if (st != CIP_OK) {
        close(fd);
        return;
    }
    on_hello(a, a->nhs - 1, buf); /* the HELLO is often there already */
}

/* Pending subscriber `sub_id` hung up: reap it if the producer has not taken it. */
static void
on_hangup(struct cipi_acceptor *a, uint32_t sub_id)
{
    struct cipi_welcomed w;
    int found = 0;
    pthread_mutex_lock(&a->lock);
    for (size_t i = 0; i < a->npending; i++) {
        if (a->pending[i].sub_id == sub_id) {
            w = a->pending[i];
            memmove(&a->pending[i], &a->pending[i + 1], (a->npending - i - 1) * sizeof w);
            a->npending--;
            a->count--;
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&a->lock);
    if (found)
        abandon(a, &w);
}

/* ---- the thread ---------------------------------------------------------------------- */

enum { OWN_WAKE, OWN_LISTENER, OWN_HANDSHAKE, OWN_PENDING };
struct owner {
    int kind;
    uint64_t id; /* a handshake's key, a pending subscriber's sub_id */
};

static void *
run(void *arg)
{
    struct cipi_acceptor *a = arg;
    uint8_t *buf = malloc(HELLO_BUF);
    struct pollfd *fds = NULL;
    struct owner *own = NULL;
    size_t cap = 0;
    if (buf == NULL) {
        snprintf(a->failure, sizeof a->failure, "out of memory");
        goto out;
    }
    for (;;) {
        long long now = cipi_now_ns();
        pthread_mutex_lock(&a->lock);
        if (a->stopping) {
            pthread_mutex_unlock(&a->lock);
            break;
        }
        size_t want = 2 + a->nhs + a->npending;
        if (want > cap) {
            size_t grown = want * 2;
            void *f = realloc(fds, grown * sizeof *fds), *o = f ? realloc(own, grown * sizeof *own)
                                                                : NULL;
            if (f)
                fds = f;
            if (o)
                own = o;
            if (f == NULL || o == NULL) {
                pthread_mutex_unlock(&a->lock);
                snprintf(a->failure, sizeof a->failure, "out of memory for the poll set");
                break;
            }
            cap = grown;
        }
        size_t n = 0;
        fds[n] = (struct pollfd){a->wake, POLLIN, 0};
        own[n++] = (struct owner){OWN_WAKE, 0};
        if (now >= a->backoff_until) {
            fds[n] = (struct pollfd){a->listener, POLLIN, 0};
            own[n++] = (struct owner){OWN_LISTENER, 0};
        }
        for (size_t i = 0; i < a->nhs; i++) {
            fds[n] = (struct pollfd){a->hs[i].fd, POLLIN, 0};
            own[n++] = (struct owner){OWN_HANDSHAKE, a->hs[i].key};
        }
        for (size_t i = 0; i < a->npending; i++) {
            fds[n] = (struct pollfd){a->pending[i].fd, POLLRDHUP, 0};
            own[n++] = (struct owner){OWN_PENDING, a->pending[i].sub_id};
        }
        double first;
        long long until = cipi_admission_next_deadline(a->adm, &first) ? (long long)(first * 1e9)
                                                                        : -1;
        pthread_mutex_unlock(&a->lock);
        int ready = poll(fds, n, cipi_accept_wait_ms(now, until, a->backoff_until));
        if (ready < 0 && errno != EINTR) {
            snprintf(a->failure, sizeof a->failure, "poll failed: %s", strerror(errno));
            break;
        }
        for (size_t k = 0; ready > 0 && k < n; k++) {
            if (fds[k].revents == 0)
                continue;
            if (own[k].kind == OWN_WAKE) {
                uint64_t v;
                (void)!read(a->wake, &v, sizeof v);
            } else if (own[k].kind == OWN_LISTENER) {
                int got[CIP_WIRE_ACCEPT_BATCH];
                int ngot = cipi_accept_batch(a->listener, &a->backoff_until, got,
                                             (int)CIP_WIRE_ACCEPT_BATCH);
                for (int j = 0; j < ngot; j++)
                    accepted(a, got[j], buf);
            } else if (own[k].kind == OWN_HANDSHAKE) {
                long i = handshake_at(a, own[k].id); /* still in progress: the same fd */
                if (i >= 0)
                    on_hello(a, (size_t)i, buf);
            } else {
                on_hangup(a, (uint32_t)own[k].id);
            }
        }
        pthread_mutex_lock(&a->lock);
        size_t nexpired = cipi_admission_expired(a->adm, now_s(), a->keys);
        pthread_mutex_unlock(&a->lock);
        for (size_t k = 0; k < nexpired; k++) {
            int fd = forget_handshake(a, a->keys[k]);
            char why[96], secs[32];
            cipi_fmt_seconds(secs, sizeof secs, (double)a->handshake_ns / 1e9);
            snprintf(why, sizeof why, "no HELLO within %s s", secs);
            if (fd >= 0)
                refuse_and_close(fd, why);
        }
    }
out:
    /* the handshakes in progress end without a WELCOME */
    while (a->nhs)
        end_and_close(forget_handshake(a, a->hs[0].key));
    if (a->failure[0] != '\0') { /* ended by a failure: a connect is refused, not left queued */
        close(a->listener);
        a->listener = -1; /* (read by stop once it has joined this thread) */
    }
    free(buf);
    free(fds);
    free(own);
    return NULL;
}

/* ---- the producer's side ---------------------------------------------------------------- */

static void release(struct cipi_acceptor *a);

static cip_status
init(struct cipi_acceptor *a, const struct cipi_acceptor_config *cfg)
{
    a->listener = -1;
    a->wake = -1;
    if (cfg->nfds > CIP_WIRE_MAX_FDS)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "%zu fds do not fit one message (at most %u)",
                         cfg->nfds, CIP_WIRE_MAX_FDS);
    if (cfg->payload_len > CIP_WIRE_MAX_WELCOME_PAYLOAD)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "welcome payload is %zu bytes, more than the limit of %u",
                         cfg->payload_len, CIP_WIRE_MAX_WELCOME_PAYLOAD);
    if (cfg->row_at >= 0 && (size_t)cfg->row_at + 4 > cfg->payload_len)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "row_at=%ld leaves no 4 bytes for the row in a payload of %zu bytes",
                         cfg->row_at, cfg->payload_len);
    if (cfg->per_uid < 1 || cfg->max_subscribers < 1 || cfg->handshake_ns <= 0)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "max_pending_per_uid, max_subscribers and the handshake timeout must "
                         "be positive");
    a->num_slots = cfg->num_slots;
    a->max_subscribers = cfg->max_subscribers;
    a->max_credit = cfg->max_credit;
    a->lease_timeout_ms = cfg->lease_timeout_ms;
    a->per_uid = cfg->per_uid;
    a->handshake_ns = cfg->handshake_ns;
    a->row_at = cfg->row_at;
    a->hooks = cfg->hooks;
    a->next_id = 1;
    a->payload_len = cfg->payload_len;
    cip_status st = cipi_admission_new(cfg->per_uid, (double)cfg->handshake_ns / 1e9, &a->adm);
    if (st != CIP_OK) {
        release(a);
        return st;
    }
    a->payload = malloc(cfg->payload_len ? cfg->payload_len : 1);
    a->uids = malloc((cfg->nuids ? cfg->nuids : 1) * sizeof *a->uids);
    a->fds = malloc((cfg->nfds ? cfg->nfds : 1) * sizeof *a->fds);
    a->gone = malloc(cfg->per_uid * sizeof *a->gone);
    if (a->payload == NULL || a->uids == NULL || a->fds == NULL || a->gone == NULL) {
        release(a);
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    }
    memcpy(a->payload, cfg->payload, cfg->payload_len);
    memcpy(a->uids, cfg->uids, cfg->nuids * sizeof *a->uids);
    a->nuids = cfg->nuids;
    for (size_t i = 0; i < cfg->nfds; i++) { /* ours: the caller may close its own */
        a->fds[i] = fcntl(cfg->fds[i], F_DUPFD_CLOEXEC, 3);
        if (a->fds[i] < 0) {
            int e = errno;
            a->nfds = i;
            release(a);
            return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "fd %d cannot be duplicated: %s",
                             cfg->fds[i], strerror(e));
        }
        a->nfds = i + 1;
    }
    for (int m = 0; m < 3; m++) {
        if (cfg->refuse[m] != NULL && (a->refuse[m] = strdup(cfg->refuse[m])) == NULL) {
            release(a);
            return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
        }
    }
    a->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->wake < 0) {
        int e = errno;
        release(a);
        return cipi_fail(CIP_ERR_TRANSPORT, "eventfd: %s", strerror(e));
    }
    pthread_mutex_init(&a->lock, NULL);
    a->lock_made = 1;
    a->listener = cfg->listener; /* ours from here on */
    return CIP_OK;
}

/* A new acceptor of `cfg` into *out (the listener is its own from here on), or an error
 * with nothing kept (the listener is still the caller's). */
cip_status
cipi_acceptor_new(const struct cipi_acceptor_config *cfg, struct cipi_acceptor **out)
{
    struct cipi_acceptor *a = calloc(1, sizeof *a);
    if (a == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    cip_status st = init(a, cfg);
    if (st != CIP_OK) {
        free(a);
        return st;
    }
    *out = a;
    return CIP_OK;
}

int
cipi_acceptor_news(struct cipi_acceptor *a)
{
    return __atomic_load_n(&a->news, __ATOMIC_ACQUIRE);
}

uint64_t
cipi_acceptor_next_seq(struct cipi_acceptor *a)
{
    return __atomic_load_n(&a->next_seq, __ATOMIC_ACQUIRE);
}

void
cipi_acceptor_set_next_seq(struct cipi_acceptor *a, uint64_t seq)
{
    __atomic_store_n(&a->next_seq, seq, __ATOMIC_RELEASE);
}

uint64_t
cipi_acceptor_welcomed(struct cipi_acceptor *a)
{
    return __atomic_load_n(&a->welcomed, __ATOMIC_RELAXED);
}

/* Why the thread ended before it was stopped, once it has been (NULL: it did not, or it
 * was not stopped yet). */
const char *
cipi_acceptor_failure(struct cipi_acceptor *a)
{
    return a->started || a->failure[0] == '\0' ? NULL : a->failure;
}

cip_status
cipi_acceptor_start(struct cipi_acceptor *a)
{
    if (a->started)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "the accept thread is started already");
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals are the caller's threads' */
    int e = pthread_create(&a->thread, NULL, run, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e != 0)
        return cipi_fail(CIP_ERR_TRANSPORT, "cannot start the accept thread: %s", strerror(e));
    a->started = 1;
    a->owner = getpid();
    return CIP_OK;
}

static void
wake(struct cipi_acceptor *a)
{
    uint64_t one = 1;
    if (a->wake >= 0)
        (void)!write(a->wake, &one, sizeof one);
}

/* Take the subscribers welcomed since the last take (`*pending`, `*npending`: the caller's,
 * each fd and hello too) and those that went before they were taken (`*gone`, fds -1). */
void
cipi_acceptor_take(struct cipi_acceptor *a, struct cipi_welcomed **pending, size_t *npending,
                   struct cipi_welcomed **gone, size_t *ngone)
{
    if (a->forked) { /* the parent's subscribers: none of them is this process's to adopt */
        *pending = *gone = NULL;
        *npending = *ngone = 0;
        return;
    }
    pthread_mutex_lock(&a->lock);
    *pending = a->pending;
    *npending = a->npending;
    *gone = a->abandoned;
    *ngone = a->nabandoned;
    a->pending = a->abandoned = NULL;
    a->npending = a->nabandoned = a->pending_cap = a->abandoned_cap = 0;
    __atomic_store_n(&a->news, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&a->lock);
    if (*npending)
        wake(a); /* stop watching them: a closed fd in a poll set stays open */
}

void
cipi_acceptor_dropped(struct cipi_acceptor *a)
{
    pthread_mutex_lock(&a->lock);
    if (a->count)
        a->count--;
    pthread_mutex_unlock(&a->lock);
}

/* Stop welcoming: join the thread (the handshakes in progress end without a WELCOME), close
 * the listener, the wake-up and our copies of the WELCOME's fds: a stopped acceptor holds no
 * fd but those of the welcomed not yet taken, which are left for a last take.  Also what a
 * half-made acceptor (cipi_acceptor_new failing) gives back of its fds. */
void
cipi_acceptor_stop(struct cipi_acceptor *a)
{
    if (a->started && getpid() != a->owner) {
        /* a child forked while the thread ran: the thread is not here, and the locks it
         * takes (ours, the rows') may have been held at the fork: touch neither, nor the
         * lists the thread changes under them (the handshakes, the welcomed: the fork may
         * have caught one half changed), whose copies stay open until this process ends */
        a->forked = 1;
    } else if (a->lock_made && !a->forked) { /* (a half-made one has no lock, no thread) */
        pthread_mutex_lock(&a->lock);
        a->stopping = 1;
        pthread_mutex_unlock(&a->lock);
        if (a->started) {
            wake(a);
            pthread_join(a->thread, NULL);
        }
    }
    a->started = 0;
    if (a->listener >= 0)
        close(a->listener);
    a->listener = -1;
    for (size_t i = 0; i < a->nfds; i++)
        close(a->fds[i]);
    a->nfds = 0;
    if (a->wake >= 0)
        close(a->wake);
    a->wake = -1;
}

void
cipi_acceptor_close_listener(struct cipi_acceptor *a)
{
    if (a->listener >= 0)
        close(a->listener);
    a->listener = -1;
}

void
cipi_acceptor_free_list(struct cipi_welcomed *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        welcomed_free(&list[i]);
    free(list);
}

/* Everything of `a` but its own memory (also a half-made one's). */
static void
release(struct cipi_acceptor *a)
{
    cipi_acceptor_stop(a);
    for (size_t i = 0; i < a->npending && !a->forked; i++) { /* never taken: rows back */
        if (a->pending[i].row >= 0)
            a->hooks.drop(a->hooks.ctx, a->pending[i].sub_id);
    }
    cipi_acceptor_free_list(a->pending, a->npending);
    cipi_acceptor_free_list(a->abandoned, a->nabandoned);
    a->pending = a->abandoned = NULL;
    a->npending = a->nabandoned = 0;
    for (int m = 0; m < 3; m++) {
        free(a->refuse[m]);
        a->refuse[m] = NULL;
    }
    free(a->payload);
    free(a->uids);
    free(a->fds);
    free(a->hs);
    free(a->keys);
    free(a->gone);
    cipi_admission_free(a->adm);
    a->payload = NULL;
    a->uids = NULL;
    a->fds = NULL;
    a->hs = NULL;
    a->keys = a->gone = NULL;
    a->adm = NULL;
    if (a->lock_made)
        if (!a->forked)
            pthread_mutex_destroy(&a->lock);
    a->lock_made = 0;
}

void
cipi_acceptor_free(struct cipi_acceptor *a)
{
    if (a == NULL)
        return;
    release(a);
    free(a);
}
