/* pub_wire.c -- the publisher's per-frame wire: the FRAME to every subscriber the lease book
 * names, and what the subscribers send back.  A RELEASE goes into the lease book here;
 * whatever else ends a subscriber (a BYE, a hang-up, a message a subscriber may not send, a
 * RELEASE the book cannot explain, a failed send or receive) comes back as an event for the
 * caller, which drops that subscriber.  No GPU, no threads, no lock: one owner calls it, and
 * only cipi_pubwire_poll waits (cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* A FRAME, ready to send to any number of sockets: its head, and the payload gathered
 * after it (no copy). */
struct frame_msg {
    uint8_t head[CIP_WIRE_FRAME_SIZE];
    struct iovec iov[2];
    struct msghdr mh;
    size_t total;
};

static void
frame_msg(struct frame_msg *f, uint64_t seq, uint32_t slot, const void *payload, size_t len)
{
    cipi_put_frame_head(f->head, seq, slot, len);
    f->iov[0] = (struct iovec){f->head, sizeof f->head};
    f->iov[1] = (struct iovec){(void *)payload, len};
    memset(&f->mh, 0, sizeof f->mh);
    f->mh.msg_iov = f->iov;
    f->mh.msg_iovlen = len ? 2 : 1;
    f->total = sizeof f->head + len;
}

/* Send it on `fd` without waiting: 0 sent, else the errno (EAGAIN: the socket is full;
 * EMSGSIZE for a partial send, which a datagram socket never makes). */
static int
frame_send(int fd, const struct frame_msg *f)
{
    ssize_t sent;
    do
        sent = sendmsg(fd, &f->mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    if (sent == (ssize_t)f->total)
        return 0;
    return sent < 0 ? (errno == EWOULDBLOCK ? EAGAIN : errno) : EMSGSIZE;
}

/* CIP_OK for a FRAME payload of `len` bytes, else CIP_ERR_INVALID_ARGUMENT in the words
 * of the Python API (every way a publisher sends a frame asks this first). */
cip_status
cipi_frame_payload_fits(size_t len)
{
    if (len > CIP_WIRE_MAX_FRAME_PAYLOAD)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "frame payload is %zu bytes, more than the limit of %u", len,
                         CIP_WIRE_MAX_FRAME_PAYLOAD);
    return CIP_OK;
}

/* Send frame `seq` to subscriber `sub_id`, whose socket was full, waiting for room for up
 * to `timeout_ns`: 0 sent, ETIMEDOUT (its socket stayed full), EINTR (a signal came: the
 * caller looks at it and calls again with what is left), EBADF (not on the wire), or the
 * errno of a failed send. */
int
cipi_pubwire_send_within(const struct cipi_pubwire *w, uint32_t sub_id, uint64_t seq,
                         uint32_t slot, const void *payload, size_t len, long long timeout_ns)
{
    int fd = cipi_pubwire_fd(w, sub_id);
    if (fd < 0)
        return EBADF;
    struct frame_msg f;
    frame_msg(&f, seq, slot, payload, len);
    long long deadline = cipi_now_ns() + timeout_ns;
    for (;;) {
        int err = frame_send(fd, &f);
        if (err != EAGAIN)
            return err;
        long long left = deadline - cipi_now_ns();
        if (left <= 0)
            return ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = POLLOUT, .revents = 0};
        struct timespec ts = cipi_timespec_of_ns(left);
        if (ppoll(&p, 1, &ts, NULL) < 0)
            return errno;
    }
}

void
cipi_pubwire_free(struct cipi_pubwire *w)
{
    free(w->set);
    free(w->ids);
    free(w->events);
    free(w->receivers);
    memset(w, 0, sizeof *w);
}

static long
index_of(const struct cipi_pubwire *w, uint32_t sub_id)
{
    for (uint32_t i = 0; i < w->n; i++)
        if (w->ids[i] == sub_id)
            return (long)i;
    return -1;
}

int
cipi_pubwire_fd(const struct cipi_pubwire *w, uint32_t sub_id)
{
    long i = index_of(w, sub_id);
    return i < 0 ? -1 : w->set[i].fd;
}

/* Read subscriber `sub_id`'s messages from `fd` from now on (and send it the frames the
 * book gives it).  CIP_ERR_INVALID_ARGUMENT for a subscriber or fd there already. */
cip_status
cipi_pubwire_add(struct cipi_pubwire *w, uint32_t sub_id, int fd)
{
    if (fd < 0)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "fd must be an open descriptor, not %d", fd);
    for (uint32_t i = 0; i < w->n; i++)
        if (w->ids[i] == sub_id || w->set[i].fd == fd)
            return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                             "subscriber %u (fd %d) is on the wire already", w->ids[i],
                             w->set[i].fd);
    if (w->n == w->cap) {
        uint32_t cap = w->cap ? 2 * w->cap : 8;
        struct pollfd *set = realloc(w->set, cap * sizeof *set);
        if (set != NULL)
            w->set = set;
        uint32_t *ids = realloc(w->ids, cap * sizeof *ids);
        if (ids != NULL)
            w->ids = ids;
        struct cipi_pubevent *ev = realloc(w->events, cap * sizeof *ev);
        if (ev != NULL)
            w->events = ev;
        if (set == NULL || ids == NULL || ev == NULL)
            return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory adding subscriber %u", sub_id);
        w->cap = cap;
    }
    w->set[w->n] = (struct pollfd){.fd = fd, .events = POLLIN, .revents = 0};
    w->ids[w->n] = sub_id;
    w->n++;
    return CIP_OK;
}

/* Stop reading subscriber `sub_id` (its fd stays open: the caller closes it); 1 when it
 * was on the wire.  The order of the others is kept: they are read in the order added. */
int
cipi_pubwire_remove(struct cipi_pubwire *w, uint32_t sub_id)
{
    long i = index_of(w, sub_id);
    if (i < 0)
        return 0;
    memmove(w->set + i, w->set + i + 1, (w->n - (uint32_t)i - 1) * sizeof *w->set);
    memmove(w->ids + i, w->ids + i + 1, (w->n - (uint32_t)i - 1) * sizeof *w->ids);
    w->n--;
    return 1;
}

static void
event(struct cipi_pubwire *w, uint32_t sub_id, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void
event(struct cipi_pubwire *w, uint32_t sub_id, int err, const char *fmt, ...)
{
    struct cipi_pubevent *ev = &w->events[w->nevents++];
    ev->sub_id = sub_id;
    ev->err = err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ev->why, sizeof ev->why, fmt, ap);
    va_end(ap);
}

/* Publish frame `seq` in `slot` (cipi_leases_publishing decides who receives it) and send
 * its FRAME to each receiver on the wire, without waiting.  A "latest" subscriber whose
 * socket is full skips the frame (its lease is cancelled); any other failed send is an
 * event: err EAGAIN for a "block" or "ahead" subscriber's full socket (the caller may wait
 * for room, then drop it), else the errno, and the subscriber is to be dropped.  A receiver
 * not on the wire (dropped, its notice not queued yet) is not sent to. */
cip_status
cipi_pubwire_send(struct cipi_pubwire *w, struct cipi_leasebook *b, uint32_t slot, uint64_t seq,
                  double now, int on_schedule, const void *payload, size_t len)
{
    w->nevents = 0;
    cip_status st = cipi_frame_payload_fits(len);
    if (st != CIP_OK)
        return st;
    if (w->receivers_cap < b->nsubs) {
        uint32_t *r = realloc(w->receivers, b->nsubs * sizeof *r);
        if (r == NULL)
            return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory publishing frame %llu",
                             (unsigned long long)seq);
        w->receivers = r;
        w->receivers_cap = b->nsubs;
    }
    uint32_t n;
    st = cipi_leases_publishing(b, slot, seq, now, on_schedule, w->receivers, &n);
    if (st != CIP_OK || n == 0)
        return st;
    struct frame_msg f;
    frame_msg(&f, seq, slot, payload, len);
    /* the book names receivers in the order they were added to it, which is the wire's
     * order too: each is looked for from where the last was found (one pass, usually) */
    uint32_t at = 0;
    for (uint32_t r = 0; r < n; r++) {
        uint32_t id = w->receivers[r];
        long i = -1;
        for (uint32_t k = 0; k < w->n; k++) {
            uint32_t j = (at + k) % w->n;
            if (w->ids[j] == id) {
                i = (long)j;
                at = j + 1;
                break;
            }
        }
        if (i < 0)
            continue;
        int err = frame_send(w->set[i].fd, &f);
        if (err == 0)
            continue;
        struct cipi_lsub *sub = cipi_leases_sub(b, id);
        if (err == EAGAIN && sub != NULL && sub->latest) {
            int out;
            cipi_leases_cancel(b, id, seq, slot, &out); /* it holds it: just granted */
        } else if (err == EAGAIN) {
            event(w, id, err, "its socket is full");
        } else {
            event(w, id, err, "send failed: %s", strerror(err));
        }
    }
    return CIP_OK;
}

/* Wait up to `timeout_ns` (-1: without limit, 0: not at all) for a subscriber's socket to
 * become readable: how many are (0: none in time), or -errno (EINTR: a signal came).  The
 * only wait of this module; it touches the wire's poll set only, not the book. */
int
cipi_pubwire_poll(struct cipi_pubwire *w, long long timeout_ns)
{
    for (uint32_t i = 0; i < w->n; i++)
        w->set[i].revents = 0;
    struct timespec ts = cipi_timespec_of_ns(timeout_ns > 0 ? timeout_ns : 0);
    /* ppoll(2), not poll(2): a wait of microseconds (a producer looking at the read flags
     * between short steps) is not rounded up to a millisecond */
    int r = ppoll(w->set, w->n, timeout_ns < 0 ? NULL : &ts, NULL);
    return r < 0 ? -errno : r;
}

/* What a subscriber's message other than a well-formed RELEASE means: an event.  `n` is
 * its size, `kept` how many of its bytes are in `buf`. */
static void
judge_other(struct cipi_pubwire *w, uint32_t id, const uint8_t *buf, size_t n, size_t kept)
{
    if (n == 0) {
        event(w, id, 0, "disconnected");
        return;
    }
    struct cipi_msg m;
    cip_status st = cipi_decode(buf, n < kept ? n : kept, &m);
    if (st == CIP_OK && m.type == CIP_WIRE_BYE)
        event(w, id, 0, "said BYE");
    else if (m.type != 0 && (st == CIP_OK || n > kept)) /* its header is sound */
        event(w, id, 0, "protocol error: unexpected %s from a subscriber", cipi_type_name(m.type));
    else
        event(w, id, 0, "protocol error: %s", cip_last_error());
}

/* After cipi_pubwire_poll found sockets readable: take up to `limit` messages from each,
 * without waiting, in the order the subscribers were added.  Each RELEASE goes into the
 * book (cipi_leases_release); anything else, and a RELEASE the book refuses, ends that
 * subscriber's reading here with an event (what follows stays queued).  *taken: how many
 * RELEASEs the book took.  CIP_ERR_NO_MEMORY when the book ran out of memory keeping one
 * (cipi_leases_release says so once): reading stops there. */
cip_status
cipi_pubwire_take(struct cipi_pubwire *w, struct cipi_leasebook *b, long limit, uint32_t *taken)
{
    w->nevents = 0;
    *taken = 0;
    uint8_t buf[CIP_WIRE_RELEASE_SIZE + 1]; /* one byte more: a longer message is not one */
    for (uint32_t i = 0; i < w->n; i++) {
        if (!w->set[i].revents)
            continue;
        int fd = w->set[i].fd;
        uint32_t id = w->ids[i];
        for (long got = 0; got < limit; got++) {
            ssize_t n;
            do /* MSG_TRUNC: the real size, so an oversize datagram cannot pass for a short one */
                n = recv(fd, buf, sizeof buf, MSG_DONTWAIT | MSG_TRUNC);
            while (n < 0 && errno == EINTR);
            if (n < 0) {
                if (errno != EAGAIN && errno != EWOULDBLOCK)
                    event(w, id, errno, "receive failed: %s", strerror(errno));
                break;
            }
            struct cipi_msg m;
            if ((size_t)n == CIP_WIRE_RELEASE_SIZE && cipi_decode(buf, (size_t)n, &m) == CIP_OK &&
                m.type == CIP_WIRE_RELEASE) {
                int out;
                cip_status st = cipi_leases_release(b, id, m.seq, m.slot, &out);
                if (st == CIP_OK) {
                    ++*taken;
                    continue;
                }
                if (st == CIP_ERR_NO_MEMORY)
                    return st;
                event(w, id, 0, "protocol error: %s", cip_last_error());
                break;
            }
            judge_other(w, id, buf, (size_t)n, sizeof buf);
            break;
        }
    }
    return CIP_OK;
}
