/* publisher.c -- the C API's raw publisher (cip_pub_*): a listening socket at a path
 * (listen.c), the accept thread (acceptor.c), the lease book (leases.c), the adopted
 * subscribers' session (pub_session.c) and the producer's calls over them (producer.c),
 * with the caller's slots and WELCOME payload.  The Python publisher runs the same modules
 * through cupy_ipcpool._engine.  No GPU; the accept thread is the only other thread. */
#include "cip_internal.h"

struct cip_pub {
    struct cipi_leasebook book;
    struct cipi_pubsession session;
    struct cipi_acceptor *acc;
    struct cipi_producer prod;
    char path[CIP_WIRE_MAX_SOCKET_PATH + 1];
    uint64_t dev, ino; /* the socket file's, to remove it only while it is ours */
    void (*on_join)(void *ctx, const cip_pub_subscriber *sub);
    void (*on_leave)(void *ctx, const cip_pub_subscriber *sub, int joined, const char *why);
    void *ctx;
    pid_t owner; /* the process that opened it: a child forked from it may not use it */
};

/* In a child just forked (forked.c): close its copy of the listening socket, which would
 * keep the path live after this process died (a publisher restarted there refused). */
static void
close_listener_in_child(void *pub)
{
    cipi_acceptor_close_listener(((cip_pub *)pub)->acc);
}

void
cip_pub_options_init(cip_pub_options *opts)
{
    if (opts == NULL)
        return;
    memset(opts, 0, sizeof *opts);
    opts->max_subscribers = 64;
    opts->send_timeout_s = 5.0;
    opts->handshake_timeout_s = 5.0;
    opts->max_pending_per_uid = 8;
}

cip_status
cipi_pub_check_options(const cip_pub_options *o)
{
    if (o->num_slots < 1 || o->num_slots > CIP_WIRE_MAX_SLOTS)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "num_slots must be in 1..%u, not %u",
                         CIP_WIRE_MAX_SLOTS, o->num_slots);
    if (o->max_subscribers < 1)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "max_subscribers must be at least 1, not %u",
                         o->max_subscribers);
    if (o->max_credit > CIP_WIRE_MAX_CREDIT)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "max_credit must be at most %u, not %u",
                         CIP_WIRE_MAX_CREDIT, o->max_credit);
    if (!(o->lease_timeout_s >= 0.0 && o->lease_timeout_s < 4294967.0))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "lease_timeout must be below 4294967 seconds, not %g", o->lease_timeout_s);
    if (!(o->send_timeout_s >= 0.0 && o->send_timeout_s <= 1e9))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "send_timeout must be 0..1e9 seconds, not %g",
                         o->send_timeout_s);
    if (!(o->handshake_timeout_s > 0.0 && o->handshake_timeout_s <= 1e9))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "handshake_timeout must be positive seconds up to 1e9, not %g",
                         o->handshake_timeout_s);
    if (o->max_pending_per_uid < 1)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "max_pending_per_uid must be at least 1, not %u", o->max_pending_per_uid);
    if (o->n_allowed_uids && o->allowed_uids == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "allowed_uids is NULL, n_allowed_uids %zu",
                         o->n_allowed_uids);
    return CIP_OK;
}

/* Seconds as whole milliseconds, rounded up (below 2**32: checked). */
static uint32_t
ms_up(double seconds)
{
    uint32_t ms = (uint32_t)(seconds * 1000.0);
    return (double)ms < seconds * 1000.0 ? ms + 1 : ms;
}

/* The engine's own statuses (a lease the caller assumed, a slot outside the ring) are the
 * API's CIP_ERR_INVALID_ARGUMENT, with their message. */
static cip_status
public_status(cip_status st)
{
    return (int)st >= 100 ? CIP_ERR_INVALID_ARGUMENT : st;
}

cip_status
cip_pub_open_raw(const char *path, const cip_pub_options *opts, const void *payload, size_t len,
                 const int *fds, size_t nfds, cip_pub **out)
{
    if (path == NULL || opts == NULL || out == NULL || (len && payload == NULL) ||
        (nfds && fds == NULL))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_pub_open_raw: a NULL argument");
    *out = NULL;
    cip_status st = cipi_pub_check_options(opts);
    if (st != CIP_OK)
        return st;
    cip_pub *p = calloc(1, sizeof *p);
    if (p == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory making a publisher");
    long long max_credit = opts->max_credit ? (long long)opts->max_credit : -1; /* -1: default */
    st = cipi_leases_init(&p->book, opts->num_slots, max_credit, -1);
    if (st != CIP_OK) {
        free(p);
        return st;
    }
    st = cipi_pubsession_init(&p->session, &p->book, opts->lease_timeout_s, opts->send_timeout_s);
    if (st != CIP_OK) {
        cipi_leases_free(&p->book);
        free(p);
        return st;
    }
    uint32_t own = (uint32_t)geteuid();
    const uint32_t *uids = opts->allowed_uids ? opts->allowed_uids : &own;
    size_t nuids = opts->allowed_uids ? opts->n_allowed_uids : 1;
    int listener = -1, err;
    st = cipi_publisher_listen(path, uids, nuids, opts->max_subscribers, &listener, &p->dev,
                               &p->ino, &err);
    if (st == CIP_OK) {
        strcpy(p->path, path); /* (checked: it fits) */
        struct cipi_acceptor_config cfg = {
            .listener = listener,
            .num_slots = opts->num_slots,
            .max_subscribers = opts->max_subscribers,
            .max_credit = p->book.max_credit,
            .lease_timeout_ms = ms_up(opts->lease_timeout_s),
            .per_uid = opts->max_pending_per_uid,
            .handshake_ns = (long long)(opts->handshake_timeout_s * 1e9),
            .uids = uids,
            .nuids = nuids,
            .payload = payload,
            .payload_len = len,
            .row_at = -1,
            .fds = fds,
            .nfds = nfds,
            .refuse = {NULL, NULL, "this publisher has no read flags: subscribe with "
                                   "mode 'block' or 'latest'"},
        };
        st = cipi_acceptor_new(&cfg, &p->acc);
        if (st != CIP_OK)
            close(listener); /* (the acceptor's only once made) */
        else if ((st = cipi_acceptor_start(p->acc)) != CIP_OK)
            cipi_acceptor_free(p->acc);
        if (st != CIP_OK)
            cipi_unlink_if_ours(p->path, p->dev, p->ino);
    }
    if (st != CIP_OK) {
        cipi_pubsession_free(&p->session);
        cipi_leases_free(&p->book);
        free(p);
        return st;
    }
    cipi_producer_init(&p->prod, &p->session, p->acc);
    p->owner = getpid();
    p->on_join = opts->on_join;
    p->on_leave = opts->on_leave;
    p->ctx = opts->ctx;
    cipi_fork_watch(p, close_listener_in_child);
    *out = p;
    return CIP_OK;
}

static cip_pub_subscriber
info_of(const struct cipi_welcomed *w)
{
    return (cip_pub_subscriber){w->sub_id, w->pid, w->uid, (int)w->mode, w->credit};
}

/* Tell the caller's callbacks what happened since the last call: who joined, who went before
 * adoption, who left (as it joined: the producer's record of it). */
static void
tell(cip_pub *p)
{
    if (!cipi_producer_has_news(&p->prod))
        return;
    struct cipi_welcomed *joined, *gone;
    size_t njoined, ngone;
    cipi_producer_take_news(&p->prod, &joined, &njoined, &gone, &ngone);
    for (size_t i = 0; i < njoined; i++) {
        cip_pub_subscriber sub = info_of(&joined[i]);
        if (p->on_join != NULL)
            p->on_join(p->ctx, &sub);
    }
    for (size_t i = 0; i < ngone; i++) {
        cip_pub_subscriber sub = info_of(&gone[i]);
        if (p->on_leave != NULL)
            p->on_leave(p->ctx, &sub, 0, "it went before it was adopted");
    }
    struct cipi_pubsession *s = &p->session;
    for (uint32_t i = 0; i < s->nleft; i++) {
        struct cipi_welcomed rec;
        if (cipi_producer_leaver(&p->prod, i, &rec)) { /* else never told as joined */
            cip_pub_subscriber sub = info_of(&rec);
            if (p->on_leave != NULL)
                p->on_leave(p->ctx, &sub, 1, s->left[i].why);
            free(rec.hello);
        }
    }
    s->nleft = 0;
    cipi_acceptor_free_list(joined, njoined);
    cipi_acceptor_free_list(gone, ngone);
}

/* CIP_OK while `pub` may be used here: in the process that opened it. */
static cip_status
usable(const cip_pub *pub)
{
    if (getpid() == pub->owner)
        return CIP_OK;
    return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                     "this publisher was opened by process %d; a child created by fork may not "
                     "use it (open one in the child)",
                     (int)pub->owner);
}

static long long
ns_of(int timeout_ms)
{
    return timeout_ms < 0 ? -1 : (long long)timeout_ms * 1000000LL;
}

cip_status
cip_pub_acquire(cip_pub *pub, int timeout_ms, uint32_t *slot)
{
    if (pub == NULL || slot == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_pub_acquire: a NULL argument");
    if (usable(pub) != CIP_OK)
        return CIP_ERR_INVALID_ARGUMENT;
    cip_status st = cipi_producer_acquire(&pub->prod, ns_of(timeout_ms), NULL, slot);
    tell(pub);
    return public_status(st);
}

cip_status
cip_pub_publish_raw(cip_pub *pub, uint32_t slot, const void *payload, size_t len, uint64_t *seq)
{
    if (pub == NULL || (len && payload == NULL))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_pub_publish_raw: a NULL argument");
    cip_status st = usable(pub);
    if (st == CIP_OK)
        st = cipi_leases_check_slot(&pub->book, slot);
    if (st != CIP_OK)
        return public_status(st);
    uint64_t got = 0;
    st = cipi_producer_publish(&pub->prod, slot, 0, 1, payload, len, NULL, &got);
    tell(pub);
    if (st == CIP_OK && seq != NULL)
        *seq = got;
    return public_status(st);
}

cip_status
cip_pub_poll(cip_pub *pub, int timeout_ms, uint64_t *returned)
{
    if (pub == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_pub_poll: a NULL argument");
    if (usable(pub) != CIP_OK)
        return CIP_ERR_INVALID_ARGUMENT;
    uint64_t n = 0;
    cip_status st = cipi_producer_poll(&pub->prod, ns_of(timeout_ms), 0, 0, NULL, &n);
    tell(pub);
    if (returned != NULL)
        *returned = n;
    return public_status(st);
}

uint32_t
cip_pub_subscribers(const cip_pub *pub)
{
    return pub == NULL ? 0 : pub->session.wire.n;
}

cip_status
cip_pub_close(cip_pub *pub, int linger_ms)
{
    if (pub == NULL)
        return CIP_OK;
    cipi_fork_unwatch(pub);
    int all_gone = 0, child = getpid() != pub->owner;
    if (child) {
        /* a child forked from the process that opened it: the subscribers, the socket file
         * and the accept thread are the parent's; this process's copies close without a
         * word (no BYE, no unlink, no callback: the Python publisher's rule) */
        cipi_acceptor_stop(pub->acc);
        cipi_pubsession_forget(&pub->session);
    } else {
        cipi_producer_stop(&pub->prod); /* the listener closed: nobody is welcomed from here */
        cipi_unlink_if_ours(pub->path, pub->dev, pub->ino);
        tell(pub);
        all_gone = cipi_pubsession_close(&pub->session, linger_ms < 0 ? 0 : ns_of(linger_ms),
                                         NULL);
    }
    cipi_producer_free(&pub->prod);
    cipi_acceptor_free(pub->acc);
    cipi_pubsession_free(&pub->session);
    cipi_leases_free(&pub->book);
    free(pub);
    if (all_gone)
        return CIP_OK;
    return cipi_fail(CIP_ERR_TIMEOUT, "%s",
                     child ? "closed in a child forked from the process that opened it: only "
                             "this process's copies were closed; the subscribers are that "
                             "process's, still connected"
                           : "some subscribers were still connected after the linger");
}
