/* pub_poll.c -- the publisher's wait for a lease to end (cipi_pubsession_poll).  Over the session (pub_session.c): its sockets'
 * messages (take), the read flags (settle), lease_timeout (expire) and the notices that wait
 * for room (retry_notices).  No GPU, no threads, no lock: the session's one owner calls
 * them; a wait lets others run only through the caller's cipi_waiting, and only while it
 * sleeps in ppoll (the lease book is changed with it held).  A spin holds it throughout.
 *
 * A flag set on the GPU wakes no one: while leases that may end at their read flags are
 * held, a waiting poll looks at the flags between growing steps, from
 * CIPI_SETTLE_RECHECK_FIRST_NS up to CIPI_SETTLE_RECHECK_LAST_NS, each step
 * CIPI_SETTLE_RECHECK_GROWTH times the last: a flag set t after the wait began is seen by
 * about 1.25 t + 20 us, in about 30 looks up to the longest step, then some 60 a second. */
#include "cip_internal.h"

/* timeout_ns (-1: none) cut to end when the oldest lease may be overdue. */
static long long
until_expiry(const struct cipi_pubsession *s, long long timeout_ns)
{
    if (s->next_expiry == 0.0)
        return timeout_ns;
    double left = s->next_expiry - (double)cipi_now_ns() / 1e9;
    long long left_ns = left > 0 ? (long long)(left * 1e9) : 0;
    return timeout_ns < 0 || left_ns < timeout_ns ? left_ns : timeout_ns;
}

/* timeout_ns (-1: none) cut to CIPI_NOTICE_RETRY_NS while a notice waits for room. */
static long long
until_notice_retry(const struct cipi_pubsession *s, long long timeout_ns)
{
    if (s->nnotices && (timeout_ns < 0 || timeout_ns > CIPI_NOTICE_RETRY_NS))
        return CIPI_NOTICE_RETRY_NS;
    return timeout_ns;
}

/* Wait up to wait_ns for a message: a wait takes one from each socket that wakes it (the
 * caller wants the first, and more are found by the next poll at once, which spares the
 * failing recv that would end a drain); no wait takes all. */
static cip_status
take(struct cipi_pubsession *s, long long wait_ns, const struct cipi_waiting *waiting)
{
    return cipi_pubsession_take(s, wait_ns, wait_ns == 0 ? LONG_MAX : 1, waiting);
}

/* Look at the read flags, when the caller settles by them. */
static cip_status
look(struct cipi_pubsession *s, int settle)
{
    if (!settle)
        return CIP_OK;
    uint32_t ended;
    s->flag_looks++;
    return cipi_pubsession_settle(s, -1, &ended);
}

/* Every message that came, then the flags. */
static cip_status
look_now(struct cipi_pubsession *s, int settle)
{
    cip_status st = cipi_pubsession_take(s, 0, LONG_MAX, NULL);
    return st != CIP_OK ? st : look(s, settle);
}

/* Busy-look for up to spin_ns: 1 once a lease ended since the book counted `before`. */
static cip_status
spin(struct cipi_pubsession *s, long long spin_ns, int settle, uint64_t before, int *ended)
{
    long long end = cipi_now_ns() + spin_ns;
    for (;;) {
        cip_status st = look_now(s, settle);
        if (st != CIP_OK)
            return st;
        if ((*ended = s->book->ended != before) || cipi_now_ns() >= end)
            return CIP_OK;
    }
}

/* Wait up to timeout_ns (-1: none) for a lease to end: woken by the sockets (a RELEASE, a
 * departure), looking at the flags between growing steps. */
static cip_status
wait_settling(struct cipi_pubsession *s, long long timeout_ns, uint64_t before,
              const struct cipi_waiting *waiting)
{
    int limited = timeout_ns >= 0; /* a round may end past the deadline: left < 0 then */
    long long deadline = limited ? cipi_now_ns() + timeout_ns : 0;
    double step = CIPI_SETTLE_RECHECK_FIRST_NS;
    for (;;) {
        long long left = limited ? deadline - cipi_now_ns() : 0;
        long long wait = (long long)step;
        if (limited && left < wait)
            wait = left > 0 ? left : 0;
        cip_status st = take(s, wait, waiting);
        if (st == CIP_OK)
            st = look(s, 1);
        if (st != CIP_OK || s->book->ended != before || (limited && left <= wait))
            return st;
        step *= CIPI_SETTLE_RECHECK_GROWTH;
        if (step > CIPI_SETTLE_RECHECK_LAST_NS)
            step = CIPI_SETTLE_RECHECK_LAST_NS;
    }
}

/* Wait up to timeout_ns (-1: without limit, 0: not at all) for a lease to end, however it
 * ends: a RELEASE, a read flag (with `settle`: Publisher(ahead=True)), a departure (a BYE, a
 * hang-up, an eviction past lease_timeout).  What ended is counted in the lease book, who
 * left in the departures.  First the notices that wait for room are tried again (while one
 * still waits, the wait is cut to CIPI_NOTICE_RETRY_NS); with spin_ns, a wait first looks
 * for up to spin_ns without sleeping (a quicker answer for a core).
 * CIPI_ERR_INTERRUPTED when waiting->interrupted stopped a wait. */
cip_status
cipi_pubsession_poll(struct cipi_pubsession *s, long long timeout_ns, long long spin_ns,
                     int settle, const struct cipi_waiting *waiting)
{
    uint64_t before = s->book->ended; /* a notice that goes now gives leases back too */
    if (s->nnotices) {
        cipi_pubsession_retry_notices(s);
        if (s->book->ended != before)
            return cipi_pubsession_expire(s);
        timeout_ns = until_notice_retry(s, timeout_ns);
    }
    int spinning = spin_ns > 0 && timeout_ns != 0 && s->wire.n > 0;
    cip_status st = CIP_OK;
    if (settle && !spinning) { /* a spin's first round looks too */
        st = look_now(s, settle);
        if (st != CIP_OK)
            return st;
        if (s->book->ended != before || timeout_ns == 0)
            return cipi_pubsession_expire(s);
    }
    if (spinning) {
        int ended;
        if (timeout_ns > 0 && timeout_ns < spin_ns)
            spin_ns = timeout_ns;
        st = spin(s, spin_ns, settle, before, &ended);
        if (st != CIP_OK)
            return st;
        if (ended)
            return cipi_pubsession_expire(s);
        if (timeout_ns > 0)
            timeout_ns -= spin_ns;
    }
    if (settle && cipi_leases_any_leased(s->book))
        st = wait_settling(s, until_expiry(s, timeout_ns), before, waiting);
    else if (s->next_expiry == 0.0)
        return take(s, timeout_ns, waiting);
    else
        st = take(s, until_expiry(s, timeout_ns), waiting);
    return st != CIP_OK ? st : cipi_pubsession_expire(s);
}
