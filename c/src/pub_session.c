/* pub_session.c -- the publisher's adopted subscribers: their sockets (owned: closed when
 * they leave), who leaves and why, eviction (a lease held past lease_timeout, a socket that
 * stays full past send_timeout), the notice an evicted subscriber is told before its leases
 * come back, and the BYE at close.  Over the per-frame wire (pub_wire.c) and the lease book
 * (leases.c).  No GPU, no threads, no lock: one owner calls it; a wait lets others run only
 * through the caller's cipi_waiting (cip_internal.h says what the modules share).
 *
 * A subscriber leaves in one of two steps.  Dropped without notice (a BYE, a hang-up, a
 * message it may not send, a failed send): its socket is shut down and closed, then its
 * leases come back to the ring.  Evicted: a REFUSE naming why is queued behind the frames
 * already queued for it and the connection is shut down before the leases come back, so
 * the subscriber, seeing the hang-up, reads everything queued, finds the notice, and hands
 * out none of those frames (their slots may be rewritten from then on).  A notice that
 * does not fit (a full socket whose buffer cannot grow) keeps the subscriber's leases,
 * suspended, and it gets no frame more, until a later try queues it. */
#include "cip_internal.h"

#ifndef SO_SNDBUFFORCE
#define SO_SNDBUFFORCE 32 /* Linux; CAP_NET_ADMIN */
#endif

/* CLOCK_MONOTONIC in seconds: the clock of the lease book's lease times (Python's
 * time.monotonic() reads the same). */
static double
now_s(void)
{
    return (double)cipi_now_ns() / 1e9;
}

cip_status
cipi_pubsession_init(struct cipi_pubsession *s, struct cipi_leasebook *b, double lease_timeout,
                     double send_timeout)
{
    memset(s, 0, sizeof *s);
    s->book = b;
    s->lease_timeout = lease_timeout;
    s->send_timeout = send_timeout;
    s->freed = malloc((b->num_slots ? b->num_slots : 1) * sizeof *s->freed);
    s->published = calloc(b->num_slots ? b->num_slots : 1, sizeof *s->published);
    if (s->freed == NULL || s->published == NULL) {
        free(s->freed);
        free(s->published);
        memset(s, 0, sizeof *s);
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory making a publisher session");
    }
    return CIP_OK;
}

void
cipi_pubsession_forget(struct cipi_pubsession *s)
{
    for (uint32_t i = 0; i < s->wire.n; i++)
        close(s->wire.set[i].fd);
    for (uint32_t i = 0; i < s->nnotices; i++)
        close(s->notices[i].fd);
    s->wire.n = 0;
    s->nnotices = 0;
}

/* Close every socket still open (no BYE: cipi_pubsession_close says it) and free. */
void
cipi_pubsession_free(struct cipi_pubsession *s)
{
    cipi_pubsession_forget(s);
    cipi_pubwire_free(&s->wire);
    free(s->notices);
    free(s->left);
    free(s->freed);
    free(s->published);
    memset(s, 0, sizeof *s);
}

/* Room for every subscriber to leave, or be evicted, at once: reserved when one is added,
 * so that a departure never needs memory. */
static cip_status
reserve(struct cipi_pubsession *s, uint32_t need)
{
    if (need > s->notices_cap) {
        uint32_t cap = need < 8 ? 8 : 2 * need;
        struct cipi_notice *nv = realloc(s->notices, cap * sizeof *nv);
        if (nv == NULL)
            return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory adding a subscriber");
        s->notices = nv;
        s->notices_cap = cap;
    }
    if (s->nleft + need > s->left_cap) {
        uint32_t cap = 2 * (s->nleft + need);
        struct cipi_departure *lv = realloc(s->left, cap * sizeof *lv);
        if (lv == NULL)
            return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory adding a subscriber");
        s->left = lv;
        s->left_cap = cap;
    }
    return CIP_OK;
}

/* Adopt subscriber `sub_id` (mode CIPI_LEASE_*, the credit it was granted) on socket `fd`,
 * which the session owns from here on, whatever the answer (closed on failure). */
cip_status
cipi_pubsession_add(struct cipi_pubsession *s, uint32_t sub_id, int mode, long long credit,
                    int fd)
{
    cip_status st = reserve(s, s->wire.n + s->nnotices + 1);
    uint32_t granted;
    if (st == CIP_OK)
        st = cipi_leases_add(s->book, sub_id, mode, credit, &granted);
    if (st == CIP_OK && (st = cipi_pubwire_add(&s->wire, sub_id, fd)) != CIP_OK) {
        uint32_t n;
        cipi_leases_remove(s->book, sub_id, s->freed, &n);
    }
    if (st != CIP_OK)
        close(fd);
    return st;
}

/* Why a subscriber leaves, into out (CIPI_WHY_SIZE): a longer text is cut before the
 * character it would split (a REFUSE's reason must stay UTF-8). */
static void
copy_why(char *out, const char *why)
{
    size_t n = cipi_utf8_cut(why, strlen(why), CIPI_WHY_SIZE - 1);
    memcpy(out, why, n);
    out[n] = '\0';
}

/* `sub_id` is gone: its socket is closed and its leases are back; the caller hears why. */
static void
gone(struct cipi_pubsession *s, uint32_t sub_id, int fd, const char *why)
{
    shutdown(fd, SHUT_RDWR); /* the peer sees the end even if a copy of the fd lives on */
    close(fd);
    uint32_t n;
    cipi_leases_remove(s->book, sub_id, s->freed, &n);
    s->departures++;
    struct cipi_departure *d = &s->left[s->nleft++]; /* reserved by add */
    d->sub_id = sub_id;
    copy_why(d->why, why);
}

/* Read and discard what the peer sent: closing with unread data resets the peer, which
 * then loses what is queued for it (the frames, the notice, the BYE). */
static void
drain(int fd)
{
    uint8_t buf[CIP_WIRE_RELEASE_SIZE + 64];
    while (recv(fd, buf, sizeof buf, MSG_DONTWAIT) > 0)
        ;
}

/* Queue the REFUSE `msg` behind what is queued on `fd`: 1 queued (or the peer can no
 * longer read anything: then nothing queued is ever handed out), 0 it did not fit.  A full
 * socket gets room for one message more by growing its send buffer (the kernel admits a
 * message while the bytes queued are below it): within net.core.wmem_max first, then past
 * it where the process may (SO_SNDBUFFORCE). */
static int
queue_notice(int fd, const uint8_t *msg, size_t len)
{
    drain(fd);
    static const int grow[] = {0, SO_SNDBUF, SO_SNDBUFFORCE};
    for (size_t i = 0; i < sizeof grow / sizeof grow[0]; i++) {
        if (grow[i]) {
            int size;
            socklen_t sl = sizeof size;
            if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, &sl) == 0)
                (void)setsockopt(fd, SOL_SOCKET, grow[i], &size, sizeof size); /* doubled */
        }
        ssize_t sent;
        do
            sent = send(fd, msg, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR);
        if (sent >= 0)
            return 1;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            continue;
        return errno == EPIPE || errno == ECONNRESET || errno == ECONNREFUSED ||
               errno == ENOTCONN;
    }
    return 0;
}

/* The REFUSE telling `why` (CIPI_WHY_SIZE at most, copy_why's), at p (room for
 * CIP_WIRE_REFUSE_SIZE + CIPI_WHY_SIZE); its size. */
static size_t
notice_of(uint8_t *p, const char *why)
{
    return cipi_put_refuse(p, why, strlen(why));
}

/* Drop subscriber `sub_id` (nothing when it is not on the wire), for `why`.  With `notify`
 * it is evicted (see the top of this file): told why behind what is queued for it, or, if
 * that does not fit yet, suspended with its leases until cipi_pubsession_retry_notices
 * queues it.  Returns 1 when it was on the wire. */
int
cipi_pubsession_drop(struct cipi_pubsession *s, uint32_t sub_id, const char *why, int notify)
{
    int fd = cipi_pubwire_fd(&s->wire, sub_id);
    if (fd < 0)
        return 0;
    cipi_pubwire_remove(&s->wire, sub_id);
    char text[CIPI_WHY_SIZE];
    copy_why(text, why);
    if (notify) {
        uint8_t msg[CIP_WIRE_REFUSE_SIZE + CIPI_WHY_SIZE];
        if (!queue_notice(fd, msg, notice_of(msg, text))) {
            cipi_leases_suspend(s->book, sub_id);
            struct cipi_notice *nt = &s->notices[s->nnotices++]; /* reserved by add */
            nt->sub_id = sub_id;
            nt->fd = fd;
            memcpy(nt->why, text, sizeof text);
            return 1;
        }
    }
    gone(s, sub_id, fd, text);
    return 1;
}

/* Try again to queue the notices that did not fit; each that goes ends its subscriber. */
void
cipi_pubsession_retry_notices(struct cipi_pubsession *s)
{
    uint32_t kept = 0;
    for (uint32_t i = 0; i < s->nnotices; i++) {
        struct cipi_notice nt = s->notices[i];
        uint8_t msg[CIP_WIRE_REFUSE_SIZE + CIPI_WHY_SIZE];
        if (queue_notice(nt.fd, msg, notice_of(msg, nt.why)))
            gone(s, nt.sub_id, nt.fd, nt.why);
        else
            s->notices[kept++] = nt;
    }
    s->nnotices = kept;
}

/* Why a subscriber whose frame a signal kept from going is evicted. */
static const char interrupted_why[] = "evicted: the publisher was interrupted (a signal) while "
                                      "waiting for room in its full socket";

/* Wait for room in subscriber `sub_id`'s full socket and send it frame `seq`, up to
 * send_timeout; evict it when its socket stays full, drop it when the send fails.  A signal
 * the caller's waiting->interrupted says stops the wait ends it too, told why: it holds a
 * lease on a frame it will never receive. */
static int
send_stalled(struct cipi_pubsession *s, uint32_t sub_id, uint64_t seq, uint32_t slot,
             const void *payload, size_t len, const struct cipi_waiting *waiting)
{
    long long deadline = cipi_now_ns() + (long long)(s->send_timeout * 1e9);
    int err;
    for (;;) {
        long long left = deadline - cipi_now_ns();
        void *token = waiting ? waiting->release() : NULL;
        err = cipi_pubwire_send_within(&s->wire, sub_id, seq, slot, payload, len,
                                       left > 0 ? left : 0);
        if (waiting)
            waiting->reacquire(token);
        if (err != EINTR)
            break;
        if (waiting && waiting->interrupted()) {
            cipi_pubsession_drop(s, sub_id, interrupted_why, 1);
            return 1;
        }
    }
    if (err == ETIMEDOUT) {
        char t[32], why[96];
        cipi_fmt_seconds(t, sizeof t, s->send_timeout);
        snprintf(why, sizeof why, "evicted: its socket stayed full for %s s", t);
        s->evictions++;
        cipi_pubsession_drop(s, sub_id, why, 1);
    } else if (err) {
        char why[96];
        snprintf(why, sizeof why, "send failed: %s", strerror(err));
        cipi_pubsession_drop(s, sub_id, why, 0);
    }
    return 0;
}

/* Publish frame `seq` in `slot` and send it to every subscriber the lease book names
 * (cipi_pubwire_send), then settle what failed: a full "block"/"ahead" socket is waited
 * for (send_stalled), any other failure drops its subscriber.  While RELEASEs of leases
 * settled at read flags are due, the sockets are read once a ring (a producer that never
 * waits would otherwise read none, and the subscriber's socket would fill).
 * CIPI_ERR_INTERRUPTED when waiting->interrupted stopped a wait (every failure is settled
 * first: the subscribers whose frame did not go are evicted). */
cip_status
cipi_pubsession_publish(struct cipi_pubsession *s, uint32_t slot, uint64_t seq,
                        uint32_t generation, int on_schedule, const void *payload, size_t len,
                        const struct cipi_waiting *waiting)
{
    double now = s->lease_timeout > 0 ? now_s() : 0.0;
    cip_status st =
        cipi_pubwire_send(&s->wire, s->book, slot, seq, now, on_schedule, payload, len);
    if (st != CIP_OK)
        return st;
    s->published[slot] = generation; /* what its readers' flags will say once they are done */
    /* dropping a subscriber or waiting for one leaves the wire's events as they are */
    int interrupted = 0;
    for (uint32_t i = 0; i < s->wire.nevents; i++) {
        const struct cipi_pubevent *ev = &s->wire.events[i];
        if (ev->err != EAGAIN)
            cipi_pubsession_drop(s, ev->sub_id, ev->why, 0);
        else if (interrupted)
            cipi_pubsession_drop(s, ev->sub_id, interrupted_why, 1);
        else
            interrupted = send_stalled(s, ev->sub_id, seq, slot, payload, len, waiting);
    }
    if (s->lease_timeout > 0 && s->next_expiry == 0.0 && cipi_leases_any_leased(s->book))
        s->next_expiry = now + s->lease_timeout;
    if (s->book->releases_due && ++s->since_drain >= s->book->num_slots) {
        s->since_drain = 0;
        st = cipi_pubsession_take(s, 0, LONG_MAX, NULL);
        if (st != CIP_OK)
            return st;
    }
    return interrupted ? cipi_fail(CIPI_ERR_INTERRUPTED, "interrupted") : CIP_OK;
}

/* Wait up to timeout_ns (-1: without limit, 0: not at all) for a subscriber's message, then
 * take up to `limit` from each readable socket: each RELEASE into the lease book, and what
 * ends a subscriber drops it.  CIPI_ERR_INTERRUPTED when waiting->interrupted stopped the
 * wait; CIP_ERR_TRANSPORT when ppoll failed. */
cip_status
cipi_pubsession_take(struct cipi_pubsession *s, long long timeout_ns, long limit,
                     const struct cipi_waiting *waiting)
{
    if (s->wire.n == 0 && timeout_ns == 0)
        return CIP_OK;
    long long deadline = timeout_ns > 0 ? cipi_now_ns() + timeout_ns : 0;
    int r;
    for (;;) {
        void *token = waiting && timeout_ns != 0 ? waiting->release() : NULL;
        r = cipi_pubwire_poll(&s->wire, timeout_ns);
        if (waiting && timeout_ns != 0)
            waiting->reacquire(token);
        if (r != -EINTR)
            break;
        if (waiting && waiting->interrupted())
            return cipi_fail(CIPI_ERR_INTERRUPTED, "interrupted");
        if (timeout_ns > 0 && (timeout_ns = deadline - cipi_now_ns()) <= 0)
            timeout_ns = 0;
    }
    if (r < 0)
        return cipi_fail(CIP_ERR_TRANSPORT, "waiting for the subscribers' messages: %s",
                         strerror(-r));
    if (r == 0)
        return CIP_OK;
    uint32_t taken;
    cip_status st = cipi_pubwire_take(&s->wire, s->book, limit, &taken);
    for (uint32_t i = 0; i < s->wire.nevents; i++) /* each ends its subscriber, untold */
        cipi_pubsession_drop(s, s->wire.events[i].sub_id, s->wire.events[i].why, 0);
    return st;
}

/* Once the oldest lease may be overdue (next_expiry passed): take in the RELEASEs that
 * came (they are in time), then evict every subscriber that holds a frame longer than
 * lease_timeout, and look when the next may be. */
cip_status
cipi_pubsession_expire(struct cipi_pubsession *s)
{
    if (s->lease_timeout <= 0 || s->next_expiry == 0.0)
        return CIP_OK;
    double now = now_s();
    if (now < s->next_expiry)
        return CIP_OK;
    cip_status st = cipi_pubsession_take(s, 0, LONG_MAX, NULL);
    if (st != CIP_OK)
        return st;
    struct cipi_leasebook *b = s->book;
    uint32_t n, *ids = malloc((b->nsubs ? b->nsubs : 1) * sizeof *ids);
    if (ids == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory looking at the leases");
    cipi_leases_overdue(b, now, s->lease_timeout, ids, &n);
    char t[32];
    cipi_fmt_seconds(t, sizeof t, s->lease_timeout);
    for (uint32_t i = 0; i < n; i++) {
        const struct cipi_lsub *sub = cipi_leases_sub(b, ids[i]);
        if (cipi_pubwire_fd(&s->wire, ids[i]) < 0) {
            uint32_t nf;
            cipi_leases_remove(b, ids[i], s->freed, &nf); /* in the book only */
            continue;
        }
        char why[128]; /* its leases are kept oldest first */
        snprintf(why, sizeof why, "evicted: held frame %llu for more than lease_timeout=%s s",
                 (unsigned long long)sub->leases.v[0].seq, t);
        s->evictions++;
        cipi_pubsession_drop(s, ids[i], why, 1);
    }
    free(ids);
    if (!cipi_leases_next_expiry(b, s->lease_timeout, &s->next_expiry))
        s->next_expiry = 0.0;
    return CIP_OK;
}

/* Say BYE to every subscriber (those whose notice waits too), then wait up to linger_ns
 * for all to hang up, and close every socket.  1 when every one had hung up. */
int
cipi_pubsession_close(struct cipi_pubsession *s, long long linger_ns,
                      const struct cipi_waiting *waiting)
{
    uint32_t n = s->wire.n + s->nnotices;
    struct pollfd *set = calloc(n ? n : 1, sizeof *set);
    uint8_t bye[CIP_WIRE_HEADER_SIZE];
    cipi_put_bye(bye);
    uint32_t waitn = 0;
    for (uint32_t i = 0; i < n; i++) {
        int fd = i < s->wire.n ? s->wire.set[i].fd : s->notices[i - s->wire.n].fd;
        drain(fd);
        ssize_t sent = send(fd, bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
        if ((sent >= 0 || errno == EAGAIN || errno == EWOULDBLOCK) && set != NULL)
            set[waitn++] = (struct pollfd){.fd = fd, .events = POLLIN, .revents = 0};
    }
    int all_gone = set != NULL || n == 0;
    long long deadline = cipi_now_ns() + linger_ns;
    while (waitn && all_gone) {
        long long left = deadline - cipi_now_ns();
        if (left <= 0) {
            all_gone = 0;
            break;
        }
        struct timespec ts = cipi_timespec_of_ns(left);
        void *token = waiting ? waiting->release() : NULL;
        int r = ppoll(set, waitn, &ts, NULL);
        int err = errno; /* before reacquire, which may change it */
        if (waiting)
            waiting->reacquire(token);
        if (r < 0 && err == EINTR && waiting && waiting->interrupted()) {
            all_gone = 0;
            break;
        }
        for (uint32_t i = 0; r > 0 && i < waitn;) {
            uint8_t buf[64];
            ssize_t got = 1;
            if (set[i].revents)
                while ((got = recv(set[i].fd, buf, sizeof buf, MSG_DONTWAIT)) > 0)
                    ;
            if (set[i].revents && (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)))
                set[i] = set[--waitn]; /* hung up */
            else
                i++;
        }
    }
    free(set);
    for (uint32_t i = 0; i < s->wire.n; i++)
        close(s->wire.set[i].fd);
    for (uint32_t i = 0; i < s->nnotices; i++)
        close(s->notices[i].fd);
    s->wire.n = 0;
    s->nnotices = 0;
    return all_gone;
}

/* ---- leases that end at the read flags (Publisher(ahead=True)) -------------------------- */

/* Read the subscribers' flags from `page` (the sync page's host mapping, `nbytes` long,
 * alive until the session is freed or given another): `rows` rows of num_slots flags from
 * byte `reads_offset` on. */
cip_status
cipi_pubsession_flags(struct cipi_pubsession *s, const void *page, size_t nbytes,
                      size_t reads_offset, uint32_t rows)
{
    size_t n = s->book->num_slots;
    if (page == NULL || reads_offset % CIP_WIRE_SYNC_FLAG_BYTES || rows == 0 ||
        reads_offset > nbytes ||
        (nbytes - reads_offset) / CIP_WIRE_SYNC_FLAG_BYTES / n < rows)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "%u rows of %zu read flags from byte %zu do not fit a page of %zu bytes",
                         rows, n, reads_offset, nbytes);
    s->page = (const uint32_t *)page;
    s->reads_at = reads_offset / CIP_WIRE_SYNC_FLAG_BYTES;
    s->rows = rows;
    return CIP_OK;
}

/* Subscriber `sub_id` writes its read flags in row `row`. */
cip_status
cipi_pubsession_set_row(struct cipi_pubsession *s, uint32_t sub_id, uint32_t row)
{
    struct cipi_lsub *sub = cipi_leases_sub(s->book, sub_id);
    if (sub == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "subscriber %u is not in the lease book",
                         sub_id);
    if (s->page == NULL || row >= s->rows)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "row %u is not one of the page's %u rows",
                         row, s->rows);
    sub->row = row;
    return CIP_OK;
}

/* Whether sub_id's read flag of slot holds the generation published there, or a later one
 * (cyclic, as on the GPU): only that generation counts; a subscriber never writes one it
 * was not sent, and the older values (a previous owner's, an earlier round's) are behind. */
static int
read_flag_done(void *ctx, uint64_t sub_id, uint32_t slot)
{
    const struct cipi_pubsession *s = (const struct cipi_pubsession *)ctx;
    const struct cipi_lsub *sub = cipi_leases_sub(s->book, sub_id);
    if (sub == NULL || sub->row >= s->rows)
        return 0;
    uint32_t word = __atomic_load_n(
        &s->page[s->reads_at + (size_t)sub->row * s->book->num_slots + slot], __ATOMIC_ACQUIRE);
    return (int32_t)(word - s->published[slot]) >= 0;
}

/* End every lease (of `slot`, or of every slot for -1) whose read flag is done
 * (cipi_leases_settle_flagged); *ended how many.  Nothing without a page. */
cip_status
cipi_pubsession_settle(struct cipi_pubsession *s, long long slot, uint32_t *ended)
{
    *ended = 0;
    if (s->page == NULL)
        return CIP_OK;
    return cipi_leases_settle_flagged(s->book, read_flag_done, s, slot, ended);
}
