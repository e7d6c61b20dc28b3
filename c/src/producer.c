/* producer.c -- the producer's calls over its accept thread (acceptor.c) and its session
 * (pub_session.c): the welcomed adopted into the session, the next frame's seq, the
 * round-robin pick of a free slot and the wait for one, and the count of leases ended since
 * the last poll's answer.  The Python publisher (cupy_ipcpool._engine.Producer) and a C
 * one call these; neither keeps a copy of their rules.
 *
 * No GPU, no thread of its own, no lock: the producer's one thread calls it, and a wait lets
 * others run only through the caller's cipi_waiting.  Who joined (adopted) and who went
 * before adoption are kept until the caller takes them (cipi_producer_take_news), with the
 * session's departures: the caller tells its user in its own thread.  Each adopted
 * subscriber's record (as it was welcomed, its HELLO kept) stays until it leaves: who
 * is on the wire, and who left (cipi_producer_leaver), are told from it. */
#include "cip_internal.h"

void
cipi_producer_init(struct cipi_producer *p, struct cipi_pubsession *s, struct cipi_acceptor *acc)
{
    memset(p, 0, sizeof *p);
    p->s = s;
    p->acc = acc;
    p->last_slot = s->book->num_slots - 1;
}

void
cipi_producer_free(struct cipi_producer *p)
{
    cipi_acceptor_free_list(p->joined, p->njoined);
    cipi_acceptor_free_list(p->gone, p->ngone);
    cipi_acceptor_free_list(p->known, p->nknown);
    p->joined = p->gone = p->known = NULL;
    p->njoined = p->ngone = p->nknown = p->known_cap = 0;
}

const struct cipi_welcomed *
cipi_producer_known(const struct cipi_producer *p, uint32_t sub_id)
{
    for (size_t k = 0; k < p->nknown; k++)
        if (p->known[k].sub_id == sub_id)
            return &p->known[k];
    return NULL;
}

int
cipi_producer_leaver(struct cipi_producer *p, uint32_t i, struct cipi_welcomed *out)
{
    uint32_t sub_id = p->s->left[i].sub_id;
    for (size_t k = 0; k < p->nknown; k++)
        if (p->known[k].sub_id == sub_id) {
            *out = p->known[k];
            p->known[k] = p->known[--p->nknown];
            return 1;
        }
    memset(out, 0, sizeof *out);
    out->sub_id = sub_id;
    out->fd = -1;
    out->row = -1;
    return 0;
}

/* Room in the record for n more; 0, or -1 (out of memory). */
static int
reserve_known(struct cipi_producer *p, size_t n)
{
    if (p->nknown + n <= p->known_cap)
        return 0;
    size_t cap = p->known_cap ? p->known_cap : 8;
    while (cap < p->nknown + n)
        cap *= 2;
    struct cipi_welcomed *grown = realloc(p->known, cap * sizeof *grown);
    if (grown == NULL)
        return -1;
    p->known = grown;
    p->known_cap = cap;
    return 0;
}

/* w's record, its HELLO copied, appended (room reserved); 0, or -1 (out of memory). */
static int
keep_record(struct cipi_producer *p, const struct cipi_welcomed *w)
{
    struct cipi_welcomed rec = *w;
    rec.fd = -1;
    if (w->hello_len) {
        if ((rec.hello = malloc(w->hello_len)) == NULL)
            return -1;
        memcpy(rec.hello, w->hello, w->hello_len);
    }
    p->known[p->nknown++] = rec;
    return 0;
}

/* The session's departures since the last look, each one fewer for max_subscribers. */
static void
count_departures(struct cipi_producer *p)
{
    for (; p->departed < p->s->departures; p->departed++)
        cipi_acceptor_dropped(p->acc);
}

/* Append n welcomed to *list (its length *len); 0, or -1 with nothing appended. */
static int
append(struct cipi_welcomed **list, size_t *len, const struct cipi_welcomed *w, size_t n)
{
    if (n == 0)
        return 0;
    struct cipi_welcomed *grown = realloc(*list, (*len + n) * sizeof *grown);
    if (grown == NULL)
        return -1;
    memcpy(grown + *len, w, n * sizeof *w);
    *list = grown;
    *len += n;
    return 0;
}

/* Take what the accept thread has: the welcomed join the session (`join`: told as joined,
 * their records kept, else only added, for the BYE at close), those gone before adoption are
 * told as gone.  A subscriber the session cannot add or keep a record of (out of memory) is
 * gone too: its socket closed, its row given back.  Out of memory keeping the news:
 * CIP_ERR_NO_MEMORY, nothing lost but the news (every welcomed is in the session with its
 * record, or closed). */
static cip_status
adopt(struct cipi_producer *p, int join)
{
    struct cipi_welcomed *pending, *gone;
    size_t npending, ngone;
    cipi_acceptor_take(p->acc, &pending, &npending, &gone, &ngone);
    cip_status st = CIP_OK;
    size_t kept = 0; /* pending[0..kept): added and to be told as joined */
    int room = !join || reserve_known(p, npending) == 0;
    for (size_t i = 0; i < npending; i++) {
        struct cipi_welcomed w = pending[i];
        cip_status added = CIP_ERR_NO_MEMORY;
        if (room && (!join || keep_record(p, &w) == 0)) {
            added = cipi_pubsession_add(p->s, w.sub_id, (int)w.mode, w.credit, w.fd);
            if (added != CIP_OK && join) /* its record goes with it (the last kept) */
                free(p->known[--p->nknown].hello);
        } else {
            close(w.fd);
        }
        w.fd = -1; /* the session's now, or closed */
        if (added != CIP_OK) {
            if (p->acc->hooks.drop != NULL)
                p->acc->hooks.drop(p->acc->hooks.ctx, w.sub_id);
            cipi_acceptor_dropped(p->acc);
            if (append(&gone, &ngone, &w, 1) < 0) {
                free(w.hello);
                st = CIP_ERR_NO_MEMORY;
            }
            continue;
        }
        pending[kept++] = w;
    }
    if (!join) { /* closing: added for the BYE, not told */
        cipi_acceptor_free_list(pending, kept);
        pending = NULL;
        kept = 0;
    }
    if (append(&p->joined, &p->njoined, pending, kept) < 0) {
        cipi_acceptor_free_list(pending, kept);
        st = CIP_ERR_NO_MEMORY;
    } else {
        free(pending);
    }
    if (append(&p->gone, &p->ngone, gone, ngone) < 0) {
        cipi_acceptor_free_list(gone, ngone);
        st = CIP_ERR_NO_MEMORY;
    } else {
        free(gone);
    }
    return st == CIP_OK ? CIP_OK : cipi_fail(st, "out of memory adopting subscribers");
}

static cip_status
adopt_news(struct cipi_producer *p)
{
    return cipi_acceptor_news(p->acc) ? adopt(p, 1) : CIP_OK;
}

int
cipi_producer_has_news(const struct cipi_producer *p)
{
    return p->njoined != 0 || p->ngone != 0 || p->s->nleft != 0;
}

void
cipi_producer_take_news(struct cipi_producer *p, struct cipi_welcomed **joined, size_t *njoined,
                        struct cipi_welcomed **gone, size_t *ngone)
{
    *joined = p->joined;
    *njoined = p->njoined;
    *gone = p->gone;
    *ngone = p->ngone;
    p->joined = p->gone = NULL;
    p->njoined = p->ngone = 0;
}

cip_status
cipi_producer_poll(struct cipi_producer *p, long long timeout_ns, long long spin_ns, int settle,
                   const struct cipi_waiting *waiting, uint64_t *returned)
{
    struct cipi_leasebook *b = p->s->book;
    if (b->ended != p->reported)
        timeout_ns = 0; /* leases ended outside a poll: report them now */
    cip_status st = adopt_news(p);
    if (st == CIP_OK)
        st = cipi_pubsession_poll(p->s, timeout_ns, spin_ns, settle, waiting);
    count_departures(p);
    *returned = b->ended - p->reported;
    p->reported = b->ended;
    return st;
}

cip_status
cipi_producer_acquire(struct cipi_producer *p, long long timeout_ns,
                      const struct cipi_waiting *waiting, uint32_t *slot)
{
    long long deadline = timeout_ns < 0 ? -1 : cipi_now_ns() + timeout_ns;
    for (;;) {
        cip_status st = adopt_news(p);
        if (st == CIP_OK)
            st = cipi_pubsession_poll(p->s, 0, 0, 0, waiting);
        count_departures(p);
        if (st != CIP_OK)
            return st;
        long free_slot = cipi_leases_pick_free(p->s->book, (uint64_t)p->last_slot + 1);
        if (free_slot >= 0) {
            *slot = (uint32_t)free_slot;
            return CIP_OK;
        }
        long long wait_ns = -1;
        if (deadline >= 0) {
            wait_ns = deadline - cipi_now_ns();
            if (wait_ns <= 0)
                return cipi_fail(CIP_ERR_TIMEOUT, "no slot became free in time");
        }
        st = cipi_pubsession_poll(p->s, wait_ns, 0, 0, waiting);
        count_departures(p);
        if (st != CIP_OK)
            return st;
    }
}

cip_status
cipi_producer_publish(struct cipi_producer *p, uint32_t slot, uint32_t generation,
                      int on_schedule, const void *payload, size_t len,
                      const struct cipi_waiting *waiting, uint64_t *seq_out)
{
    cip_status st = adopt_news(p);
    if (st != CIP_OK)
        return st;
    struct cipi_leasebook *b = p->s->book;
    uint64_t seq = cipi_acceptor_next_seq(p->acc);
    st = cipi_pubsession_publish(p->s, slot, seq, generation, on_schedule, payload, len,
                                 waiting);
    count_departures(p);
    /* refused before publishing (payload, slot, leases) leaves the seq; interrupted after
     * it (a signal while a full socket was waited for), the frame is out */
    if (st == CIP_OK || (b->have_last && b->last_seq == seq && b->last_slot == slot)) {
        cipi_acceptor_set_next_seq(p->acc, seq + 1);
        p->last_slot = slot;
        *seq_out = seq;
    }
    return st;
}

void
cipi_producer_stop(struct cipi_producer *p)
{
    cipi_acceptor_stop(p->acc);
    adopt(p, 0); /* out of memory loses only the news of those gone */
}
