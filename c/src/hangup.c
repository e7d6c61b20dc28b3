/* hangup.c -- what the messages still queued when the publisher hung up say: handed out
 * up to a BYE, an eviction, a malformed notice, or nothing handed out (no GPU)
 * (cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* The type of a datagram with a valid header, else 0. */
static unsigned
msg_type(const uint8_t *p, size_t n)
{
    if (n < CIP_WIRE_HEADER_SIZE || RD(p, HEADER_MAGIC) != CIP_WIRE_MAGIC ||
        RD(p, HEADER_VERSION) != CIP_WIRE_VERSION)
        return 0;
    return (unsigned)RD(p, HEADER_TYPE);
}

/* The verdict on the `len` messages queued at a hang-up, oldest first (a ring of `cap`
 * from `head`): the first BYE or REFUSE among them decides, nothing after it counts.
 *   CIPI_HANGUP_BYE         a BYE at *at: the messages before it are handed out
 *   CIPI_HANGUP_EVICTED     an eviction notice at *at: nothing queued is handed out
 *   CIPI_HANGUP_BAD_NOTICE  a REFUSE at *at that does not decode (the decoder's words
 *                           are the thread's error): a protocol error, nothing handed out
 *   CIPI_HANGUP_DROP        neither: the publisher died or dropped this subscriber,
 *                           nothing queued is handed out */
enum cipi_hangup
cipi_hangup_verdict(const struct msgbuf *ring, size_t head, size_t len, size_t cap, size_t *at)
{
    for (size_t i = 0; i < len; i++) {
        const struct msgbuf *m = &ring[(head + i) % cap];
        unsigned type = msg_type(m->data, m->len);
        if (type != CIP_WIRE_REFUSE && type != CIP_WIRE_BYE)
            continue;
        *at = i;
        if (type == CIP_WIRE_BYE)
            return CIPI_HANGUP_BYE;
        struct cipi_msg msg;
        return cipi_decode(m->data, m->len, &msg) == CIP_OK ? CIPI_HANGUP_EVICTED
                                                            : CIPI_HANGUP_BAD_NOTICE;
    }
    *at = len;
    return CIPI_HANGUP_DROP;
}

/* Read everything still queued on `sock` after a hang-up, without waiting, into `buf`
 * (`cap` bytes: a datagram's most and one), handing each datagram to keep(ctx, p, n); a
 * reset is reported once, before what is still queued behind it.  Stops at the end, a
 * failure, or when keep answers nonzero (out of memory). */
void
cipi_hangup_drain(int sock, uint8_t *buf, size_t cap,
                  int (*keep)(void *ctx, const uint8_t *p, size_t n), void *ctx)
{
    int reset = 0;
    for (;;) {
        ssize_t n = recv(sock, buf, cap, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == ECONNRESET && !reset) {
            reset = 1;
            continue;
        }
        if (n <= 0 || keep(ctx, buf, (size_t)n) != 0)
            return;
    }
}
