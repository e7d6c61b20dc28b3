/* owed.c -- the RELEASEs a subscriber owes: sent without waiting, kept in order while the
 * publisher's socket is full, bounded (no GPU) (cip_internal.h says what the modules
 * share). */
#include "cip_internal.h"

/* Each frame is released once, so an honest publisher's leases bound what is owed:
 * past CIP_WIRE_MAX_CREDIT + num_slots, no credit explains it. */
void
cipi_owed_init(struct cipi_owed *o, uint32_t num_slots)
{
    memset(o, 0, sizeof *o);
    o->limit = (size_t)CIP_WIRE_MAX_CREDIT + num_slots;
}

/* Forget what is owed (the connection ended: its end returned every lease). */
void
cipi_owed_clear(struct cipi_owed *o)
{
    o->head = o->len = 0;
}

void
cipi_owed_free(struct cipi_owed *o)
{
    free(o->ring);
    o->ring = NULL;
    o->head = o->len = o->alloc = 0;
}

/* One RELEASE, without waiting: 1 sent, 0 no room in the socket, -1 failed (errno). */
int
cipi_try_send_release(int sock, uint64_t seq, uint32_t slot)
{
    uint8_t msg[CIP_WIRE_RELEASE_SIZE];
    cipi_put_release(msg, seq, slot);
    for (;;) {
        if (send(sock, msg, sizeof msg, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof msg)
            return 1;
        if (errno == EINTR)
            continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    }
}

/* Keep the RELEASE of frame `seq` in `slot`, behind those owed already.  CIP_ERR_TRANSPORT
 * (nothing kept) past the limit: the publisher has not read for longer than any credit
 * explains, and the subscription ends. */
cip_status
cipi_owed_push(struct cipi_owed *o, uint64_t seq, uint32_t slot)
{
    if (o->len >= o->limit)
        return cipi_fail(CIP_ERR_TRANSPORT,
                         "the publisher has not read this subscriber's messages for %zu "
                         "RELEASEs, more than any credit allows (its socket stays full); "
                         "the subscription is closed",
                         o->len);
    if (o->len == o->alloc) {
        size_t alloc = o->alloc ? 2 * o->alloc : 16;
        struct owed_release *r = (struct owed_release *)cipi_ring_regrow(
            o->ring, sizeof *r, &o->head, o->len, &o->alloc, alloc);
        if (r == NULL)
            return cipi_fail(CIP_ERR_NO_MEMORY,
                             "out of memory keeping a RELEASE the publisher's socket did not take");
        o->ring = r;
    }
    struct owed_release *r = &o->ring[(o->head + o->len) % o->alloc];
    r->seq = seq;
    r->slot = slot;
    o->len++;
    return CIP_OK;
}

/* Send what is owed, oldest first, as far as `sock` takes it now: 1 none is owed any
 * more, 0 the socket is full (the rest kept, in order), -1 a send failed (errno; the
 * rest kept: the caller decides, the connection's end returned every lease). */
int
cipi_owed_flush(struct cipi_owed *o, int sock)
{
    while (o->len) {
        const struct owed_release *r = &o->ring[o->head];
        int sent = cipi_try_send_release(sock, r->seq, r->slot);
        if (sent <= 0)
            return sent;
        o->head = (o->head + 1) % o->alloc;
        o->len--;
    }
    return 1;
}

/* The RELEASE of frame `seq` in `slot`, behind every one owed, without waiting.  *sent:
 * 1 it went (with every one owed), 0 kept (the socket is full), -1 a send failed (errno).
 * CIP_ERR_TRANSPORT or CIP_ERR_NO_MEMORY from keeping it (cipi_owed_push). */
cip_status
cipi_owed_send(struct cipi_owed *o, int sock, uint64_t seq, uint32_t slot, int *sent)
{
    if (o->len == 0) {
        *sent = cipi_try_send_release(sock, seq, slot);
        if (*sent != 0)
            return CIP_OK;
    }
    cip_status st = cipi_owed_push(o, seq, slot);
    *sent = st == CIP_OK ? cipi_owed_flush(o, sock) : 0;
    return st;
}
