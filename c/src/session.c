/* session.c -- the channel's socket session: the end of a stream, the backlog, hang-ups,
 * releases owed, judging messages, the next frame (cip_internal.h says what the modules
 * share). */
#include "cip_internal.h"

/* ---- the channel: frames, hang-ups, releases ----------------------------------------- */

/* The stream ends with `status`: remembered, and reported by every later call. */
cip_status
cipi_sub_end(cip_sub *sub, cip_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sub->error, sizeof sub->error, fmt, ap);
    va_end(ap);
    sub->ended = status;
    return cipi_fail(status, "%s", sub->error);
}

void
cipi_backlog_clear(cip_sub *sub)
{
    for (size_t i = 0; i < sub->bl_len; i++)
        free(sub->backlog[(sub->bl_head + i) % sub->bl_cap].data);
    sub->bl_head = sub->bl_len = 0;
}

static int
backlog_push(cip_sub *sub, const uint8_t *data, size_t len)
{
    if (sub->bl_len == sub->bl_cap) {
        size_t cap = sub->bl_cap ? 2 * sub->bl_cap : 16;
        struct msgbuf *b = (struct msgbuf *)cipi_ring_regrow(sub->backlog, sizeof *b, &sub->bl_head,
                                                        sub->bl_len, &sub->bl_cap, cap);
        if (b == NULL)
            return -1;
        sub->backlog = b;
    }
    uint8_t *copy = (uint8_t *)malloc(len ? len : 1);
    if (copy == NULL)
        return -1;
    memcpy(copy, data, len);
    struct msgbuf *slot = &sub->backlog[(sub->bl_head + sub->bl_len) % sub->bl_cap];
    slot->data = copy;
    slot->len = len;
    sub->bl_len++;
    return 0;
}

/* A REFUSE's reason (m: a REFUSE from cipi_decode), printable, into out. */
void
cipi_refuse_reason(const struct cipi_msg *m, char *out, size_t cap)
{
    size_t k = 0;
    for (uint32_t i = 0; i < m->len && k + 1 < cap; i++) {
        uint8_t c = m->payload[i];
        out[k++] = (c < 0x20 || c == 0x7F) ? '?' : (char)c;
    }
    out[k] = '\0';
}

int
cipi_producer_dead(cip_sub *sub)
{
    return cipi_pidfd_exited(sub->pidfd);
}

/* Whether the producer's pidfd becomes readable (it exited) within `ms`. */
static int
producer_dies_within(cip_sub *sub, int ms)
{
    if (sub->pidfd < 0)
        return 0;
    long long deadline = cipi_now_ms() + ms;
    for (;;) {
        struct pollfd p = {sub->pidfd, POLLIN, 0};
        int r = poll(&p, 1, cipi_left_ms(deadline));
        if (r > 0)
            return 1;
        if (r == 0 || errno != EINTR)
            return 0;
    }
}

/* Whether a stream of ours waits (or may wait) on a frame flag that is not set. */
static int
waits_pending(const cip_sub *sub)
{
    return sub->page != NULL && cipi_book_pending(&sub->book, sub->page);
}

/* The producer is dead: write, from the host, every frame flag a stream of ours waits
 * on and that it will never write, so that no stream waits forever: the flag's last
 * real value plus CIP_WIRE_SYNC_FORCED (cip_flag_force), as the Python subscriber
 * does, which satisfies every wait on it (GEQ, cyclic) and keeps cip_flag_state
 * exact, in every process that maps the page, for every frame of the slot. */
void
cipi_resolve_waits(cip_sub *sub)
{
    if (sub->page == NULL || !cipi_producer_dead(sub))
        return;
    cipi_book_resolve(&sub->book, sub->page);
}

static int
keep_queued(void *sub, const uint8_t *p, size_t n)
{
    return backlog_push((cip_sub *)sub, p, n);
}

/* The publisher hung up (or died): read everything still queued.  An eviction notice
 * among it means no queued frame may be used (a malformed one: the protocol error,
 * reported now); a BYE keeps the frames before it; a hang-up without either ends the
 * stream, queued frames dropped. */
static void
scan_after_hangup(cip_sub *sub)
{
    if (sub->sock >= 0)
        cipi_hangup_drain(sub->sock, sub->buf, CIP_WIRE_MAX_FRAME_SIZE + 1, keep_queued, sub);
    size_t at;
    enum cipi_hangup verdict =
        cipi_hangup_verdict(sub->backlog, sub->bl_head, sub->bl_len, sub->bl_cap, &at);
    if (verdict == CIPI_HANGUP_BAD_NOTICE) {
        cipi_protocol_error(sub); /* clears the backlog: no queued frame is handed out */
        return;
    }
    if (verdict == CIPI_HANGUP_EVICTED) {
        const struct msgbuf *notice = &sub->backlog[(sub->bl_head + at) % sub->bl_cap];
        struct cipi_msg msg;
        (void)cipi_decode(notice->data, notice->len, &msg); /* decoded by the verdict */
        char reason[CIP_WIRE_MAX_REFUSE_REASON + 1];
        cipi_refuse_reason(&msg, reason, sizeof reason);
        cipi_backlog_clear(sub);
        cipi_sub_end(sub, CIP_ERR_EVICTED, "the publisher evicted this subscriber: %s", reason);
        return;
    }
    if (verdict == CIPI_HANGUP_DROP) {
        cipi_backlog_clear(sub);
        /* its sockets close before its pidfd says it exited: while a stream of ours
         * waits on a flag, give its exit a moment to show, then set that flag */
        if (cipi_producer_dead(sub) ||
            (waits_pending(sub) && producer_dies_within(sub, (int)CIP_WIRE_DEATH_WAIT_MS))) {
            cipi_resolve_waits(sub);
            cipi_sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                    "the publisher (pid %d) exited; frames still queued are dropped (their flags "
                    "may never be set)",
                    (int)sub->info.producer_pid);
        } else {
            cipi_sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                    "the publisher hung up without BYE (it exited, or dropped this subscriber); "
                    "frames still queued are dropped");
        }
        return;
    }
    while (sub->bl_len > at + 1) { /* nothing after a BYE counts */
        sub->bl_len--;
        free(sub->backlog[(sub->bl_head + sub->bl_len) % sub->bl_cap].data);
    }
}

/* One poll(0) of the socket's hang-up and the producer's pidfd. */
static int
hung_up(cip_sub *sub)
{
    struct pollfd p[2] = {{sub->sock, POLLRDHUP, 0}, {sub->pidfd, POLLIN, 0}};
    int n = sub->pidfd >= 0 ? 2 : 1;
    int r;
    do {
        r = poll(p, (nfds_t)n, 0);
    } while (r < 0 && errno == EINTR);
    return r > 0;
}

void
cipi_say_bye_and_close(cip_sub *sub)
{
    if (sub->sock < 0)
        return;
    /* the RELEASEs still owed go first, as far as the socket takes them (the hang-up
     * returns every lease anyway) */
    if (sub->ended == CIP_OK)
        (void)cipi_owed_flush(&sub->owed, sub->sock);
    cipi_owed_clear(&sub->owed);
    /* unread data would reset the peer instead of letting it read our BYE */
    while (recv(sub->sock, sub->buf, CIP_WIRE_MAX_FRAME_SIZE + 1, MSG_DONTWAIT) > 0)
        ;
    uint8_t bye[CIP_WIRE_HEADER_SIZE];
    cipi_put_bye(bye);
    (void)!send(sub->sock, bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
    close(sub->sock);
    sub->sock = -1;
}

cip_status
cipi_protocol_error(cip_sub *sub)
{
    char why[sizeof cipi_tls_error];
    memcpy(why, cipi_tls_error, sizeof why);
    cipi_backlog_clear(sub);
    cipi_say_bye_and_close(sub);
    return cipi_sub_end(sub, CIP_ERR_PROTOCOL, "the connection was closed after a protocol error: %s",
                   why);
}

/* Sending a RELEASE failed other than for room: the publisher is gone; was this
 * subscriber dropped?  Owed RELEASEs are moot (the hang-up returned every lease). */
static cip_status
release_failed(cip_sub *sub)
{
    cipi_owed_clear(&sub->owed);
    scan_after_hangup(sub);
    if (sub->ended == CIP_ERR_EVICTED)
        return cipi_fail(CIP_ERR_EVICTED, "%s", sub->error);
    return CIP_OK;
}

/* Send the RELEASEs owed, oldest first, as far as the socket takes them now. */
static cip_status
flush_owed(cip_sub *sub)
{
    if (sub->owed.len == 0)
        return CIP_OK;
    if (sub->ended != CIP_OK || sub->sock < 0) {
        cipi_owed_clear(&sub->owed); /* nobody to send them to: the end returned them */
        return CIP_OK;
    }
    return cipi_owed_flush(&sub->owed, sub->sock) < 0 ? release_failed(sub) : CIP_OK;
}

/* RELEASE of frame `seq` in `slot`, after every RELEASE still owed; never blocks. */
static cip_status
send_release(cip_sub *sub, uint64_t seq, uint32_t slot)
{
    int sent;
    cip_status st = cipi_owed_send(&sub->owed, sub->sock, seq, slot, &sent);
    if (st != CIP_OK) { /* past the limit (or out of memory): the end */
        st = cipi_sub_end(sub, st, "%s", cipi_tls_error);
        cipi_say_bye_and_close(sub);
        return st;
    }
    return sent < 0 ? release_failed(sub) : CIP_OK;
}

/* What one message of a live stream means, for both subscribers: CIP_OK a FRAME that rule 1
 * takes (the ledger's last frame now; not held yet), CIP_ERR_END_OF_STREAM a BYE,
 * CIP_ERR_EVICTED an eviction notice (a REFUSE), CIP_ERR_PROTOCOL anything else (the
 * decoder's, the ledger's or these words). */
cip_status
cipi_judge_live(const uint8_t *p, size_t n, struct cipi_ledger *ledger, struct cipi_msg *m)
{
    if (cipi_decode(p, n, m) != CIP_OK)
        return CIP_ERR_PROTOCOL;
    switch (m->type) {
    case CIP_WIRE_FRAME: return cipi_ledger_receive(ledger, m->seq, m->slot);
    case CIP_WIRE_BYE: return CIP_ERR_END_OF_STREAM;
    case CIP_WIRE_REFUSE: return CIP_ERR_EVICTED;
    default:
        return cipi_fail(CIP_ERR_PROTOCOL, "unexpected %s from the publisher",
                         cipi_type_name(m->type));
    }
}

/* Judge one message of a live stream: a FRAME we may use comes back as CIP_OK. */
static cip_status
judge(cip_sub *sub, const uint8_t *p, size_t n, uint64_t *seq, uint32_t *slot,
      const uint8_t **payload, uint32_t *plen)
{
    struct cipi_msg m;
    cip_status st = cipi_judge_live(p, n, &sub->ledger, &m);
    if (st == CIP_OK) {
        *seq = m.seq;
        *slot = m.slot;
        *payload = m.payload;
        *plen = m.len;
        return CIP_OK;
    }
    if (st == CIP_ERR_END_OF_STREAM) {
        cipi_backlog_clear(sub);
        return cipi_sub_end(sub, CIP_ERR_END_OF_STREAM, "the publisher said BYE");
    }
    if (st == CIP_ERR_EVICTED) {
        char reason[CIP_WIRE_MAX_REFUSE_REASON + 1];
        cipi_refuse_reason(&m, reason, sizeof reason);
        cipi_backlog_clear(sub);
        return cipi_sub_end(sub, CIP_ERR_EVICTED, "the publisher evicted this subscriber: %s", reason);
    }
    return cipi_protocol_error(sub);
}

/* The next frame we may use, or how the stream ended; nothing is marked held. */
cip_status
cipi_next_frame(cip_sub *sub, int timeout_ms, uint64_t *seq, uint32_t *slot, const uint8_t **payload,
           uint32_t *plen)
{
    cip_status usable = cipi_sub_usable(sub);
    if (usable != CIP_OK)
        return usable;
    if (sub->ended != CIP_OK)
        return cipi_fail(sub->ended, "%s", sub->error);
    long long deadline = cipi_deadline_of(timeout_ms);
    for (;;) {
        if (sub->bl_len) {
            struct msgbuf m = sub->backlog[sub->bl_head];
            sub->bl_head = (sub->bl_head + 1) % sub->bl_cap;
            sub->bl_len--;
            memcpy(sub->buf, m.data, m.len);
            free(m.data);
            return judge(sub, sub->buf, m.len, seq, slot, payload, plen);
        }
        if (sub->owed.len) { /* RELEASEs the socket did not take before: first */
            cip_status st = flush_owed(sub);
            if (st != CIP_OK)
                return st;
            if (sub->ended != CIP_OK)
                return cipi_fail(sub->ended, "%s", sub->error);
        }
        short events = (short)(POLLIN | (sub->owed.len ? POLLOUT : 0));
        struct pollfd p[2] = {{sub->sock, events, 0}, {sub->pidfd, POLLIN, 0}};
        int r = poll(p, sub->pidfd >= 0 ? 2 : 1, cipi_left_ms(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return cipi_sub_end(sub, CIP_ERR_TRANSPORT, "poll: %s", strerror(errno));
        if (r == 0)
            return cipi_fail(CIP_ERR_TIMEOUT, "no frame within %d ms", timeout_ms);
        if (sub->pidfd >= 0 && p[1].revents) {
            scan_after_hangup(sub); /* ends the stream: evicted, or the producer's death */
            if (sub->ended != CIP_OK)
                return cipi_fail(sub->ended, "%s", sub->error);
            continue;
        }
        if ((p[0].revents & ~POLLOUT) == 0)
            continue; /* only room for the RELEASEs owed: sent at the top */
        ssize_t n = recv(sub->sock, sub->buf, CIP_WIRE_MAX_FRAME_SIZE + 1, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n <= 0) { /* reset, closed, failed: the end, or what is still queued */
            int err = n < 0 ? errno : 0;
            scan_after_hangup(sub);
            if (sub->ended != CIP_OK)
                return cipi_fail(sub->ended, "%s", sub->error);
            if (!sub->bl_len)
                return cipi_sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                               "the connection to the publisher failed: %s",
                               err ? strerror(err) : "closed");
            continue;
        }
        /* Taken from the socket: hand it out only if the publisher has not hung up
         * meanwhile; if it has, what is queued behind it decides (an eviction notice). */
        if (hung_up(sub)) {
            if (backlog_push(sub, sub->buf, (size_t)n) != 0)
                return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
            scan_after_hangup(sub);
            if (sub->ended != CIP_OK)
                return cipi_fail(sub->ended, "%s", sub->error);
            continue;
        }
        return judge(sub, sub->buf, (size_t)n, seq, slot, payload, plen);
    }
}

/* A release: no flag write and no message once the publisher has hung up. */
cip_status
cipi_release_slot(cip_sub *sub, uint64_t seq, uint32_t slot, void *stream, int write)
{
    struct held *h = &sub->held[slot];
    if (sub->ended != CIP_OK || sub->sock < 0) {
        cipi_ledger_forget(&sub->ledger, slot);
        if (sub->ended == CIP_ERR_EVICTED)
            return cipi_fail(CIP_ERR_EVICTED, "%s", sub->error);
        return CIP_OK;
    }
    if (hung_up(sub)) {
        scan_after_hangup(sub);
        cipi_ledger_forget(&sub->ledger, slot);
        if (sub->ended == CIP_ERR_EVICTED)
            return cipi_fail(CIP_ERR_EVICTED, "%s", sub->error);
        return CIP_OK;
    }
    if (write) {
        CUdeviceptr addr = sub->page_dev + sub->reads_offset +
                           ((size_t)sub->row * sub->info.num_slots + slot) * CIP_WIRE_SYNC_FLAG_BYTES;
        CUresult rc = cipi_drv.StreamWriteValue32(stream, addr, h->generation,
                                             CIP_CU_STREAM_WRITE_VALUE_DEFAULT);
        if (rc != CIP_CUDA_SUCCESS)
            return cipi_cuda_fail("cuStreamWriteValue32", rc); /* still held */
        if (cipi_drv.EventRecord(sub->ev_write[slot], stream) == CIP_CUDA_SUCCESS)
            sub->write_recorded[slot] = 1;
        else
            sub->untracked = 1;
    }
    cipi_ledger_forget(&sub->ledger, slot);
    return send_release(sub, seq, slot);
}
