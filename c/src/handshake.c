/* handshake.c -- opening a subscription: options, the handshake, the raw open
 * (cip_internal.h says what the modules share). */
#include "cip_internal.h"

void
cip_sub_options_init(cip_sub_options *opts)
{
    if (opts == NULL)
        return;
    memset(opts, 0, sizeof *opts);
    opts->mode = CIP_MODE_BLOCK;
    opts->timeout_ms = 10000;
    opts->device = -1;
}

/* `p[0..n)` as Python's repr of bytes writes it, into out (`cap` bytes, NUL-terminated). */
static void
bytes_repr(const uint8_t *p, size_t n, char *out, size_t cap)
{
    int squote = memchr(p, '\'', n) != NULL, dquote = memchr(p, '"', n) != NULL;
    char quote = squote && !dquote ? '"' : '\'';
    size_t k = (size_t)snprintf(out, cap, "b%c", quote);
    for (size_t i = 0; i < n && k + 5 < cap; i++) {
        uint8_t c = p[i];
        if (c == quote || c == '\\')
            k += (size_t)snprintf(out + k, cap - k, "\\%c", c);
        else if (c == '\t' || c == '\n' || c == '\r')
            k += (size_t)snprintf(out + k, cap - k, "\\%c", c == '\t' ? 't' : c == '\n' ? 'n' : 'r');
        else if (c < 0x20 || c >= 0x7F)
            k += (size_t)snprintf(out + k, cap - k, "\\x%02x", c);
        else
            out[k++] = (char)c;
    }
    snprintf(out + k, cap - k, "%c", quote);
}

/* Send the HELLO, waiting for room until the deadline; a publisher that refuses at once
 * may have closed already (its REFUSE is queued for us): not an error here. */
static void
send_hello(int sock, const uint8_t *hello, size_t len, long long deadline)
{
    for (;;) {
        if (send(sock, hello, len, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0)
            return;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return;
        struct pollfd p = {sock, POLLOUT, 0};
        if (poll(&p, 1, cipi_left_ms(deadline)) == 0)
            return; /* no answer will come either: the wait for it says so */
    }
}

/* The subscriber's half of the handshake, for the C and the Python subscriber: connect to
 * `path` (a full listen backlog retried until the deadline), learn who is there
 * (SO_PEERCRED: a uid not in `allowed` gets nothing, not even a BYE), send `hello` (a HELLO
 * datagram), and take the reply: a WELCOME, decoded, with its fds.  `timeout_ms`: for it
 * all (-1: no limit).  On success the caller owns out->sock, out->buf and out->fds; on
 * failure nothing is left open and the status says what went wrong: CIP_ERR_TIMEOUT,
 * CIP_ERR_TRANSPORT (out->err: the errno), CIP_ERR_REFUSED (a uid not allowed, a REFUSE),
 * CIP_ERR_PROTOCOL (out->foreign: the peer answered in another protocol),
 * CIP_ERR_PUBLISHER_GONE (it closed or reset during the handshake). */
cip_status
cipi_handshake(const char *path, const uint8_t *hello, size_t hello_len, const uint32_t *allowed,
               size_t n_allowed, int timeout_ms, struct cipi_joined *out)
{
    memset(out, 0, sizeof *out);
    out->sock = -1;
    char within[32];
    snprintf(within, sizeof within, "%g s", timeout_ms / 1000.0);
    long long deadline = cipi_deadline_of(timeout_ms);
    int sock = -1;
    cip_status st = cipi_connect_unix(path, SOCK_SEQPACKET, deadline, &sock, &out->err);
    if (st == CIP_ERR_TIMEOUT)
        return cipi_fail(st, "cannot connect to the publisher at %s within %s: its listen backlog "
                             "stayed full",
                         path, within);
    if (st != CIP_OK) {
        if (st != CIP_ERR_TRANSPORT)
            return st;
        int err = out->err;
        if (err == EPROTOTYPE)
            return cipi_fail(st, "%s is not a cupy_ipcpool publisher: its socket is of another "
                                 "type (a channel's is a SOCK_SEQPACKET socket)",
                             path);
        const char *hint = err == EACCES ? " (the socket is private to the publisher's uid: "
                                           "allow yours there)"
                           : (err == ENOENT || err == ECONNREFUSED) ? " (is the publisher running?)"
                                                                    : "";
        return cipi_fail(st, "cannot connect to the publisher at %s: %s%s", path, strerror(err),
                         hint);
    }
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
        out->err = errno;
        close(sock);
        return cipi_fail(CIP_ERR_TRANSPORT, "SO_PEERCRED on %s: %s; nothing was sent to it", path,
                         strerror(out->err));
    }
    out->pid = cred.pid;
    out->uid = cred.uid;
    int ok = 0;
    char uids[256];
    size_t k = (size_t)snprintf(uids, sizeof uids, "[");
    for (size_t i = 0; i < n_allowed; i++) {
        ok |= allowed[i] == cred.uid;
        if (k < sizeof uids)
            k += (size_t)snprintf(uids + k, sizeof uids - k, "%s%u", i ? ", " : "", allowed[i]);
    }
    if (k < sizeof uids)
        snprintf(uids + k, sizeof uids - k, "]");
    if (!ok) {
        close(sock);
        return cipi_fail(CIP_ERR_REFUSED,
                         "the publisher at %s runs as uid %u, which is not in allowed_uids %s; "
                         "nothing was sent to it",
                         path, (unsigned)cred.uid, uids);
    }
    send_hello(sock, hello, hello_len, deadline);

    size_t cap = CIP_WIRE_MAX_WELCOME_SIZE + 1;
    uint8_t *buf = (uint8_t *)malloc(cap);
    if (buf == NULL) {
        close(sock);
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    }
    union {
        char buf[CMSG_SPACE(CIP_WIRE_MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    int reset = 0, excess = 0; /* excess: not looked at (more fds than fit: MSG_CTRUNC) */
    ssize_t n;
    int flags = 0;
    for (;;) {
        struct pollfd p = {sock, POLLIN, 0};
        int r = poll(&p, 1, cipi_left_ms(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0) {
            st = cipi_fail(CIP_ERR_TIMEOUT, "the publisher at %s did not answer within %s", path,
                           within);
            goto fail;
        }
        n = cipi_recv_with_fds(sock, buf, cap, control.buf, sizeof control.buf, out->fds,
                               &out->nfds, CIP_WIRE_MAX_FDS, &excess, &flags);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n < 0 && errno == ECONNRESET && !reset) {
            reset = 1; /* reported once; a REFUSE may still be queued behind it */
            continue;
        }
        if (n < 0) {
            out->err = errno;
            if (out->err == ECONNRESET)
                st = cipi_fail(CIP_ERR_PUBLISHER_GONE,
                               "the publisher at %s reset the connection during the handshake "
                               "(it exited or was killed)",
                               path);
            else
                st = cipi_fail(CIP_ERR_TRANSPORT, "the handshake with %s failed: %s", path,
                               strerror(out->err));
            goto fail;
        }
        break;
    }
    struct cipi_msg *m = &out->welcome;
    if (flags & MSG_CTRUNC)
        st = cipi_fail(CIP_ERR_PROTOCOL, "the WELCOME carried more fds than fit (MSG_CTRUNC)");
    else if ((flags & MSG_TRUNC) || (size_t)n >= cap)
        st = cipi_fail(CIP_ERR_PROTOCOL, "the WELCOME is larger than the protocol allows");
    else if (n == 0)
        st = cipi_fail(CIP_ERR_PUBLISHER_GONE, "the publisher at %s closed during the handshake",
                       path);
    /* a reply in another protocol: the peer is no publisher (said before the decoder's
     * words, which speak of a malformed message) */
    else if (n < 2 || RD(buf, HEADER_MAGIC) != CIP_WIRE_MAGIC) {
        char said[24 * 4 + 8], magic[16] = "none";
        bytes_repr(buf, (size_t)n < 24 ? (size_t)n : 24, said, sizeof said);
        if (n >= 2)
            snprintf(magic, sizeof magic, "0x%04x", (unsigned)(buf[0] | buf[1] << 8));
        out->foreign = 1;
        st = cipi_fail(CIP_ERR_PROTOCOL,
                       "%s is not a cupy_ipcpool publisher: it answered %s%s, not the channel "
                       "protocol's messages (bad magic %s, expected 0x%04x)",
                       path, said, n > 24 ? "..." : "", magic, CIP_WIRE_MAGIC);
    } else
        st = cipi_decode(buf, (size_t)n, m);
    if (st == CIP_OK && m->type == CIP_WIRE_REFUSE) {
        char reason[CIP_WIRE_MAX_REFUSE_REASON + 1];
        cipi_refuse_reason(m, reason, sizeof reason);
        st = cipi_fail(CIP_ERR_REFUSED, "the publisher at %s refused: %s", path, reason);
    } else if (st == CIP_OK && m->type != CIP_WIRE_WELCOME) {
        st = cipi_fail(CIP_ERR_PROTOCOL, "expected WELCOME, got %s", cipi_type_name(m->type));
    }
    if (st != CIP_OK)
        goto fail;
    out->sock = sock;
    out->buf = buf;
    out->len = (size_t)n;
    return CIP_OK;
fail:
    free(buf);
    cipi_close_fds(out->fds, out->nfds);
    out->nfds = 0;
    close(sock);
    memset(&out->welcome, 0, sizeof out->welcome);
    return st;
}

static cip_status
handshake(cip_sub *sub, const cip_sub_options *o)
{
    uint8_t hello[CIP_WIRE_HELLO_SIZE];
    cip_status st = cipi_put_hello(hello, (unsigned)o->mode, sub->info.credit,
                                   (uint32_t)getpid(), 0);
    if (st != CIP_OK)
        return st;
    uint32_t own = (uint32_t)geteuid();
    struct cipi_joined j;
    st = cipi_handshake(sub->path, hello, sizeof hello,
                                   o->allowed_uids ? o->allowed_uids : &own,
                                   o->allowed_uids ? o->n_allowed_uids : 1, o->timeout_ms, &j);
    if (st != CIP_OK)
        return st;
    sub->sock = j.sock;
    sub->info.producer_pid = j.pid;
    sub->info.producer_uid = j.uid;
    sub->pidfd = cipi_pidfd_open(j.pid); /* readable once the producer exits */
    const struct cipi_msg *m = &j.welcome;
    sub->info.sub_id = m->sub_id;
    sub->info.num_slots = m->num_slots;
    sub->info.next_seq = m->seq;
    sub->info.credit = m->credit;
    sub->info.lease_timeout_ms = m->lease_timeout_ms;
    sub->welcome = (uint8_t *)malloc(m->len ? m->len : 1);
    sub->fds = (int *)malloc((j.nfds ? j.nfds : 1) * sizeof(int));
    sub->held = (struct held *)calloc(m->num_slots, sizeof(struct held));
    if (!sub->welcome || !sub->fds || !sub->held) {
        st = cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    } else if ((st = cipi_ledger_init(&sub->ledger, m->num_slots, m->seq)) == CIP_OK) {
        cipi_owed_init(&sub->owed, m->num_slots);
        memcpy(sub->welcome, m->payload, m->len);
        sub->welcome_len = m->len;
        memcpy(sub->fds, j.fds, j.nfds * sizeof(int));
        sub->nfds = j.nfds;
        j.nfds = 0;
    }
    free(j.buf);
    cipi_close_fds(j.fds, j.nfds);
    return st;
}

cip_status
cipi_sub_open_raw(const char *path, const cip_sub_options *opts, cip_sub **out)
{
    cip_sub_options o;
    if (path == NULL || out == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_open: NULL argument");
    *out = NULL;
    if (opts == NULL)
        cip_sub_options_init(&o);
    else
        o = *opts;
    if (o.mode != CIP_MODE_BLOCK && o.mode != CIP_MODE_LATEST)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "mode must be CIP_MODE_BLOCK or CIP_MODE_LATEST");
    if (o.credit > CIP_WIRE_MAX_CREDIT)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "credit must be in 1..%u, not %u",
                    CIP_WIRE_MAX_CREDIT, o.credit);
    if (o.allowed_uids == NULL && o.n_allowed_uids)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "allowed_uids is NULL");
    cip_status checked = cipi_check_socket_path(path); /* before it is copied into sub->path */
    if (checked != CIP_OK)
        return checked;
    cip_sub *sub = (cip_sub *)calloc(1, sizeof *sub);
    if (sub == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    sub->sock = sub->pidfd = -1;
    sub->owner = getpid();
    sub->info.mode = o.mode;
    sub->info.credit = o.credit ? o.credit
                                : (o.mode == CIP_MODE_LATEST ? 1 : CIP_WIRE_DEFAULT_BLOCK_CREDIT);
    snprintf(sub->path, sizeof sub->path, "%s", path);
    sub->buf = (uint8_t *)malloc(CIP_WIRE_MAX_FRAME_SIZE + 1);
    cip_status st = sub->buf ? handshake(sub, &o) : cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    if (st != CIP_OK) {
        cip_sub_free(sub);
        return st;
    }
    cipi_sub_watch_fork(sub);
    *out = sub;
    return CIP_OK;
}

cip_status
cip_sub_open_raw(const char *path, const cip_sub_options *opts, cip_sub **out)
{
    return cipi_sub_open_raw(path, opts, out);
}
