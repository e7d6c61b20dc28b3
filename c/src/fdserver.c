/* fdserver.c -- the exporter side of the socket transport: serve a fixed list of fds over a
 * listening Unix stream socket with SCM_RIGHTS (the protocol: _transport/_fdserver.py's
 * docstring and docs/wire.md; fetch.c is its client).
 *
 * One thread (cipi_fdserver_start) serves every connection without blocking on any: a
 * connection's uid is checked as soon as it is accepted (a refused uid is told so and
 * closed, nothing is read from it); each connection has one deadline from accept
 * (CIP_WIRE_FDSERVER_REQUEST_TIMEOUT_MS: then STATUS_TOO_SLOW); at most
 * CIP_WIRE_FDSERVER_MAX_PENDING_PER_UID connections of one uid are served at once (one more
 * makes the oldest of that uid go, told STATUS_BUSY).  The request is checked as it arrives
 * and the token compared in constant time; the reply (status, count, then one-byte messages
 * each carrying up to CIP_WIRE_FDSERVER_FDS_PER_MESSAGE fds) is sent as the socket takes it.
 * The served fds are the caller's: never closed here, to be kept open while it serves.  The
 * thread calls no user code; only `live` and `stopping` are shared (atomics). */
#include "cip_internal.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#define REQUEST_HEAD 5 /* magic, token length */

struct fdconn {
    int fd;
    uint64_t key;
    uint8_t req[REQUEST_HEAD + CIP_WIRE_FDSERVER_MAX_TOKEN_LEN];
    size_t got;    /* request bytes read */
    int replying;  /* the request was good: the reply is being sent */
    size_t msg;    /* the reply's next message: 0 the head, k >= 1 the k-th batch of fds */
    size_t offset; /* bytes of the head sent */
};

struct cipi_fdserver {
    int listener, wake;
    const int *fds; /* the caller's */
    size_t nfds;
    uint8_t token[CIP_WIRE_FDSERVER_MAX_TOKEN_LEN];
    size_t token_len;
    uint32_t *uids;
    size_t nuids;
    struct cipi_admission *adm;
    struct fdconn *conns;
    size_t nconns, cap;
    uint64_t *keys, *gone; /* expired (cap), made room (per uid) */
    uint64_t next_key;
    long long backoff_until;
    pthread_t thread;
    int started, forked;
    pid_t owner;
    int stopping, live; /* atomics: stop asked; connections being served */
    char failure[160];
};

static double
now_s(void)
{
    return (double)cipi_now_ns() / 1e9;
}

static void
set_live(struct cipi_fdserver *s)
{
    __atomic_store_n(&s->live, (int)s->nconns, __ATOMIC_RELEASE);
}

/* Tell `status` and close, without waiting: what the client sent is read first (closing a
 * Unix socket with unread data resets the peer, which then never sees the status). */
static void
refuse_now(int fd, unsigned status)
{
    static __thread uint8_t sink[512];
    for (int i = 0; i < 16 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++)
        ;
    uint8_t b = (uint8_t)status;
    (void)!send(fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    close(fd);
}

static long
conn_at(const struct cipi_fdserver *s, uint64_t key)
{
    for (size_t i = 0; i < s->nconns; i++)
        if (s->conns[i].key == key)
            return (long)i;
    return -1;
}

/* Forget connection i, tell it `status` (negative: nothing) and close it. */
static void
finish(struct cipi_fdserver *s, size_t i, int status)
{
    struct fdconn c = s->conns[i];
    s->conns[i] = s->conns[--s->nconns];
    cipi_admission_remove(s->adm, c.key);
    set_live(s);
    if (status < 0)
        close(c.fd);
    else
        refuse_now(c.fd, (unsigned)status);
}

/* Send what the socket takes of connection i's reply; 1 when the reply is all out. */
static int
send_more(struct cipi_fdserver *s, struct fdconn *c)
{
    size_t batches = (s->nfds + CIP_WIRE_FDSERVER_FDS_PER_MESSAGE - 1) /
                     CIP_WIRE_FDSERVER_FDS_PER_MESSAGE;
    while (c->msg <= batches) {
        ssize_t r;
        if (c->msg == 0) {
            uint8_t head[5] = {CIP_WIRE_FDSERVER_STATUS_OK, (uint8_t)(s->nfds >> 24),
                               (uint8_t)(s->nfds >> 16), (uint8_t)(s->nfds >> 8),
                               (uint8_t)s->nfds};
            r = send(c->fd, head + c->offset, sizeof head - c->offset,
                     MSG_DONTWAIT | MSG_NOSIGNAL);
            if (r > 0 && (c->offset += (size_t)r) < sizeof head)
                continue;
        } else {
            size_t first = (c->msg - 1) * CIP_WIRE_FDSERVER_FDS_PER_MESSAGE;
            size_t n = s->nfds - first < CIP_WIRE_FDSERVER_FDS_PER_MESSAGE
                           ? s->nfds - first
                           : CIP_WIRE_FDSERVER_FDS_PER_MESSAGE;
            union {
                char buf[CMSG_SPACE(CIP_WIRE_FDSERVER_FDS_PER_MESSAGE * sizeof(int))];
                struct cmsghdr align;
            } control;
            char tag = 'F';
            struct iovec iov = {&tag, 1};
            struct msghdr m = {0};
            m.msg_iov = &iov;
            m.msg_iovlen = 1;
            m.msg_control = control.buf;
            m.msg_controllen = CMSG_SPACE(n * sizeof(int));
            struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(n * sizeof(int));
            memcpy(CMSG_DATA(cm), s->fds + first, n * sizeof(int));
            r = sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        }
        if (r < 0)
            return errno == EAGAIN || errno == EINTR ? 0 : -1;
        c->msg++;
    }
    return 1;
}

/* Advance connection i (the socket is ready): read its request, or send more of its reply. */
static void
step(struct cipi_fdserver *s, size_t i)
{
    struct fdconn *c = &s->conns[i];
    if (!c->replying) {
        for (;;) {
            size_t want = c->got < REQUEST_HEAD ? REQUEST_HEAD - c->got
                                                : REQUEST_HEAD + c->req[4] - c->got;
            if (want == 0)
                break;
            ssize_t r = recv(c->fd, c->req + c->got, want, MSG_DONTWAIT);
            if (r < 0 && (errno == EAGAIN || errno == EINTR))
                return; /* the rest later */
            if (r <= 0) {
                finish(s, i, -1); /* hung up (or failed) before the request was whole */
                return;
            }
            c->got += (size_t)r;
            if (c->got >= REQUEST_HEAD &&
                (memcmp(c->req, CIP_WIRE_FDSERVER_MAGIC, 4) != 0 ||
                 c->req[4] > CIP_WIRE_FDSERVER_MAX_TOKEN_LEN)) {
                finish(s, i, CIP_WIRE_FDSERVER_STATUS_BAD_REQUEST);
                return;
            }
        }
        /* the token, compared in constant time (of the longer length) */
        size_t len = c->req[4];
        unsigned diff = len != s->token_len;
        for (size_t k = 0; k < CIP_WIRE_FDSERVER_MAX_TOKEN_LEN; k++) {
            uint8_t a = k < len ? c->req[REQUEST_HEAD + k] : 0;
            uint8_t b = k < s->token_len ? s->token[k] : 0;
            diff |= (unsigned)(a ^ b);
        }
        if (diff != 0) {
            finish(s, i, CIP_WIRE_FDSERVER_STATUS_BAD_TOKEN);
            return;
        }
        c->replying = 1;
    }
    int done = send_more(s, c);
    if (done != 0)
        finish(s, i, -1); /* all out (or the client went): nothing more to tell */
}

static void
accepted(struct cipi_fdserver *s, int fd)
{
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
        close(fd);
        return;
    }
    if (!cipi_uid_in(s->uids, s->nuids, cred.uid)) { /* nothing is read or kept */
        refuse_now(fd, CIP_WIRE_FDSERVER_STATUS_UID_REFUSED);
        return;
    }
    if (s->nconns == s->cap) {
        size_t grown = s->cap ? 2 * s->cap : 16;
        struct fdconn *c = realloc(s->conns, grown * sizeof *c);
        uint64_t *k = c == NULL ? NULL : realloc(s->keys, grown * sizeof *k);
        if (c != NULL)
            s->conns = c;
        if (k == NULL) {
            close(fd); /* out of memory: this one is not served */
            return;
        }
        s->keys = k;
        s->cap = grown;
    }
    uint64_t key = s->next_key++;
    size_t ngone = 0;
    if (cipi_admission_admit(s->adm, key, cred.uid, now_s(), s->gone, &ngone) != CIP_OK) {
        close(fd);
        return;
    }
    s->conns[s->nconns++] = (struct fdconn){.fd = fd, .key = key};
    set_live(s);
    for (size_t k = 0; k < ngone; k++) { /* the oldest of its uid made room */
        long j = conn_at(s, s->gone[k]);
        if (j >= 0)
            finish(s, (size_t)j, CIP_WIRE_FDSERVER_STATUS_BUSY);
    }
    long j = conn_at(s, key);
    if (j >= 0)
        step(s, (size_t)j); /* the request is often there already */
}

enum { OWN_WAKE, OWN_LISTENER, OWN_CONN };

static void *
run(void *arg)
{
    struct cipi_fdserver *s = arg;
    struct pollfd *pfds = NULL;
    uint64_t *own = NULL; /* per poll entry: OWN_WAKE, OWN_LISTENER, or OWN_CONN + key */
    size_t pcap = 0;
    while (!__atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE)) {
        long long now = cipi_now_ns();
        size_t want = 2 + s->nconns;
        if (want > pcap) {
            size_t grown = 2 * want;
            struct pollfd *p = realloc(pfds, grown * sizeof *p);
            uint64_t *o = p == NULL ? NULL : realloc(own, grown * sizeof *o);
            if (p != NULL)
                pfds = p;
            if (o == NULL) {
                snprintf(s->failure, sizeof s->failure, "out of memory for the poll set");
                break;
            }
            own = o;
            pcap = grown;
        }
        size_t n = 0;
        pfds[n] = (struct pollfd){s->wake, POLLIN, 0};
        own[n++] = OWN_WAKE;
        if (now >= s->backoff_until) {
            pfds[n] = (struct pollfd){s->listener, POLLIN, 0};
            own[n++] = OWN_LISTENER;
        }
        for (size_t i = 0; i < s->nconns; i++) {
            pfds[n] = (struct pollfd){s->conns[i].fd, s->conns[i].replying ? POLLOUT : POLLIN,
                                      0};
            own[n++] = OWN_CONN + s->conns[i].key;
        }
        double first;
        long long until = cipi_admission_next_deadline(s->adm, &first) ? (long long)(first * 1e9)
                                                                        : -1;
        int ready = poll(pfds, n, cipi_accept_wait_ms(now, until, s->backoff_until));
        if (ready < 0 && errno != EINTR) {
            snprintf(s->failure, sizeof s->failure, "poll failed: %s", strerror(errno));
            break;
        }
        for (size_t k = 0; ready > 0 && k < n; k++) {
            if (pfds[k].revents == 0)
                continue;
            if (own[k] == OWN_WAKE) {
                uint64_t v;
                (void)!read(s->wake, &v, sizeof v);
            } else if (own[k] == OWN_LISTENER) {
                int got[CIP_WIRE_ACCEPT_BATCH];
                int ngot = cipi_accept_batch(s->listener, &s->backoff_until, got,
                                             (int)CIP_WIRE_ACCEPT_BATCH);
                for (int j = 0; j < ngot; j++)
                    accepted(s, got[j]);
            } else {
                long i = conn_at(s, own[k] - OWN_CONN); /* still served: the same fd */
                if (i >= 0)
                    step(s, (size_t)i);
            }
        }
        size_t nexpired = cipi_admission_expired(s->adm, now_s(), s->keys);
        for (size_t k = 0; k < nexpired; k++) {
            long i = conn_at(s, s->keys[k]);
            if (i >= 0) {
                /* (admission forgot it already: finish's remove is a no-op) */
                finish(s, (size_t)i, CIP_WIRE_FDSERVER_STATUS_TOO_SLOW);
            }
        }
    }
    while (s->nconns) /* stopping: the connections end without a word */
        finish(s, s->nconns - 1, -1);
    free(pfds);
    free(own);
    return NULL;
}

cip_status
cipi_fdserver_new(int listener, const int *fds, size_t nfds, const uint8_t *token,
                  size_t token_len, const uint32_t *uids, size_t nuids,
                  struct cipi_fdserver **out)
{
    *out = NULL;
    if (token_len > CIP_WIRE_FDSERVER_MAX_TOKEN_LEN)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "token is %zu bytes; at most %u allowed",
                         token_len, CIP_WIRE_FDSERVER_MAX_TOKEN_LEN);
    if (nfds > CIP_WIRE_FDSERVER_MAX_FDS_PER_REPLY)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "%zu fds; at most %u may be served", nfds,
                         CIP_WIRE_FDSERVER_MAX_FDS_PER_REPLY);
    for (size_t i = 0; i < nfds; i++)
        if (fds[i] < 0)
            return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "fds must be non-negative, got %d",
                             fds[i]);
    struct cipi_fdserver *s = calloc(1, sizeof *s);
    if (s == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory making an fd server");
    s->listener = -1;
    s->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->fds = fds;
    s->nfds = nfds;
    memcpy(s->token, token, token_len);
    s->token_len = token_len;
    s->uids = malloc((nuids ? nuids : 1) * sizeof *s->uids);
    s->gone = malloc(CIP_WIRE_FDSERVER_MAX_PENDING_PER_UID * sizeof *s->gone);
    cip_status st = CIP_OK;
    if (s->wake < 0)
        st = cipi_fail(CIP_ERR_TRANSPORT, "eventfd: %s", strerror(errno));
    else if (s->uids == NULL || s->gone == NULL)
        st = cipi_fail(CIP_ERR_NO_MEMORY, "out of memory making an fd server");
    else
        st = cipi_admission_new(CIP_WIRE_FDSERVER_MAX_PENDING_PER_UID,
                                CIP_WIRE_FDSERVER_REQUEST_TIMEOUT_MS / 1000.0, &s->adm);
    if (st != CIP_OK) {
        cipi_fdserver_free(s);
        return st;
    }
    if (nuids)
        memcpy(s->uids, uids, nuids * sizeof *uids);
    s->nuids = nuids;
    s->listener = listener; /* ours from here: closed by stop */
    *out = s;
    return CIP_OK;
}

cip_status
cipi_fdserver_start(struct cipi_fdserver *s)
{
    if (s->started)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "the fd server is started already");
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals are the caller's threads' */
    int e = pthread_create(&s->thread, NULL, run, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e != 0)
        return cipi_fail(CIP_ERR_TRANSPORT, "cannot start the fd server's thread: %s",
                         strerror(e));
    s->started = 1;
    s->owner = getpid();
    return CIP_OK;
}

int
cipi_fdserver_live(const struct cipi_fdserver *s)
{
    return __atomic_load_n(&s->live, __ATOMIC_ACQUIRE);
}

const char *
cipi_fdserver_failure(const struct cipi_fdserver *s)
{
    return s->failure[0] != '\0' && !__atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE)
               ? s->failure
               : NULL;
}

void
cipi_fdserver_stop(struct cipi_fdserver *s)
{
    if (s->started && getpid() != s->owner) {
        s->forked = 1; /* a child forked while it served: the thread is not here */
        for (size_t i = 0; i < s->nconns; i++) /* our copies of the parent's connections */
            close(s->conns[i].fd);
        s->nconns = 0;
    } else if (s->started) {
        __atomic_store_n(&s->stopping, 1, __ATOMIC_RELEASE);
        uint64_t one = 1;
        (void)!write(s->wake, &one, sizeof one);
        pthread_join(s->thread, NULL); /* it closes its connections */
    }
    s->started = 0;
    if (s->listener >= 0)
        close(s->listener);
    s->listener = -1;
    if (s->wake >= 0)
        close(s->wake);
    s->wake = -1;
}

void
cipi_fdserver_free(struct cipi_fdserver *s)
{
    if (s == NULL)
        return;
    cipi_fdserver_stop(s);
    for (size_t i = 0; i < s->nconns; i++) /* (never started: none) */
        close(s->conns[i].fd);
    cipi_admission_free(s->adm);
    free(s->conns);
    free(s->keys);
    free(s->gone);
    free(s->uids);
    free(s);
}
