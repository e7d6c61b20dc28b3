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

static cip_status
handshake(cip_sub *sub, const cip_sub_options *o)
{
    long long deadline = cipi_deadline_of(o->timeout_ms);
    int err = 0;
    cip_status st = cipi_connect_unix(sub->path, SOCK_SEQPACKET, deadline, &sub->sock, &err);
    if (st == CIP_ERR_TIMEOUT)
        return cipi_fail(st, "cannot connect to the publisher at %s within %d ms: its listen backlog "
                        "stayed full",
                    sub->path, o->timeout_ms);
    if (st != CIP_OK) {
        if (st != CIP_ERR_TRANSPORT)
            return st;
        const char *hint = err == EACCES ? " (the socket is private to the publisher's uid: "
                                           "allow yours there)"
                           : (err == ENOENT || err == ECONNREFUSED) ? " (is the publisher running?)"
                                                                    : "";
        return cipi_fail(st, "cannot connect to the publisher at %s: %s%s", sub->path, strerror(err),
                    hint);
    }
    /* who is there, before anything is sent to it or read from it: a peer that is not
     * allowed gets nothing, not even a BYE (the socket is closed here) */
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(sub->sock, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
        int e = errno;
        close(sub->sock);
        sub->sock = -1;
        return cipi_fail(CIP_ERR_TRANSPORT, "SO_PEERCRED on %s: %s; nothing was sent to it",
                    sub->path, strerror(e));
    }
    sub->info.producer_pid = cred.pid;
    sub->info.producer_uid = cred.uid;
    uint32_t own = (uint32_t)geteuid();
    const uint32_t *allowed = o->allowed_uids ? o->allowed_uids : &own;
    size_t n_allowed = o->allowed_uids ? o->n_allowed_uids : 1;
    int ok = 0;
    for (size_t i = 0; i < n_allowed; i++)
        ok |= allowed[i] == cred.uid;
    if (!ok) {
        close(sub->sock);
        sub->sock = -1;
        return cipi_fail(CIP_ERR_REFUSED,
                    "the publisher at %s runs as uid %u, which is not among the allowed uids; "
                    "nothing was sent to it",
                    sub->path, (unsigned)cred.uid);
    }
    if (cred.pid > 0) {
        /* readable once the producer exits */
        sub->pidfd = (int)syscall(CIP_SYS_PIDFD_OPEN, cred.pid, 0);
        if (sub->pidfd >= 0)
            fcntl(sub->pidfd, F_SETFD, FD_CLOEXEC);
    }
    uint8_t hello[CIP_WIRE_HELLO_SIZE];
    memset(hello, 0, sizeof hello);
    WR(hello, HELLO_MAGIC, CIP_WIRE_MAGIC);
    WR(hello, HELLO_VERSION, CIP_WIRE_VERSION);
    WR(hello, HELLO_TYPE, CIP_WIRE_HELLO);
    WR(hello, HELLO_MODE, (uint64_t)o->mode);
    WR(hello, HELLO_CREDIT, sub->info.credit);
    WR(hello, HELLO_PID, (uint64_t)getpid());
    WR(hello, HELLO_LEN, 0);
    /* a publisher that refuses at once may close before the HELLO: its REFUSE is queued */
    (void)!send(sub->sock, hello, sizeof hello, MSG_NOSIGNAL);

    size_t cap = CIP_WIRE_MAX_WELCOME_SIZE + 1;
    uint8_t *buf = (uint8_t *)malloc(cap);
    if (buf == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    union {
        char buf[CMSG_SPACE(CIP_WIRE_MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    int fds[CIP_WIRE_MAX_FDS + 1];
    size_t nfds = 0;
    int reset = 0, excess = 0; /* excess: not looked at (more fds than fit: MSG_CTRUNC) */
    ssize_t n;
    int flags = 0;
    for (;;) {
        struct pollfd p = {sub->sock, POLLIN, 0};
        int r = poll(&p, 1, cipi_left_ms(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0) {
            free(buf);
            return cipi_fail(CIP_ERR_TIMEOUT, "the publisher at %s did not answer within %d ms",
                        sub->path, o->timeout_ms);
        }
        n = cipi_recv_with_fds(sub->sock, buf, cap, control.buf, sizeof control.buf, fds, &nfds,
                          CIP_WIRE_MAX_FDS, &excess, &flags);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n < 0 && errno == ECONNRESET && !reset) {
            reset = 1; /* reported once; a REFUSE may still be queued behind it */
            continue;
        }
        if (n < 0) {
            int e = errno;
            free(buf);
            if (e == ECONNRESET)
                return cipi_fail(CIP_ERR_PUBLISHER_GONE,
                            "the publisher at %s reset the connection during the handshake (it "
                            "exited or was killed)",
                            sub->path);
            return cipi_fail(CIP_ERR_TRANSPORT, "the handshake with %s failed: %s", sub->path,
                        strerror(e));
        }
        break;
    }
    st = CIP_OK;
    struct cipi_msg m = {0};
    if (flags & MSG_CTRUNC)
        st = cipi_fail(CIP_ERR_PROTOCOL, "the WELCOME carried more fds than fit (MSG_CTRUNC)");
    else if ((flags & MSG_TRUNC) || (size_t)n >= cap)
        st = cipi_fail(CIP_ERR_PROTOCOL, "the WELCOME is larger than the protocol allows");
    else if (n == 0)
        st = cipi_fail(CIP_ERR_PUBLISHER_GONE, "the publisher at %s closed during the handshake",
                  sub->path);
    /* a reply in another protocol: the peer is no publisher (said before the decoder's
     * words, which speak of a malformed message) */
    else if ((size_t)n >= CIP_WIRE_HEADER_SIZE && RD(buf, HEADER_MAGIC) != CIP_WIRE_MAGIC)
        st = cipi_fail(CIP_ERR_PROTOCOL,
                  "%s is not a cupy_ipcpool publisher: it answered in another protocol "
                  "(bad magic 0x%04llx, expected 0x%04x)",
                  sub->path, (unsigned long long)RD(buf, HEADER_MAGIC), CIP_WIRE_MAGIC);
    else
        st = cipi_decode(buf, (size_t)n, &m);
    if (st == CIP_OK && m.type == CIP_WIRE_REFUSE) {
        char reason[CIP_WIRE_MAX_REFUSE_REASON + 1];
        cipi_refuse_reason(&m, reason, sizeof reason);
        st = cipi_fail(CIP_ERR_REFUSED, "the publisher at %s refused: %s", sub->path, reason);
    } else if (st == CIP_OK && m.type != CIP_WIRE_WELCOME) {
        st = cipi_fail(CIP_ERR_PROTOCOL, "expected WELCOME, got a message of type %u", m.type);
    } else if (st == CIP_OK) {
        sub->info.sub_id = m.sub_id;
        sub->info.num_slots = m.num_slots;
        sub->info.next_seq = m.seq;
        sub->info.credit = m.credit;
        sub->info.lease_timeout_ms = m.lease_timeout_ms;
        sub->welcome = (uint8_t *)malloc(m.len ? m.len : 1);
        sub->fds = (int *)malloc((nfds ? nfds : 1) * sizeof(int));
        sub->held = (struct held *)calloc(m.num_slots, sizeof(struct held));
        if (!sub->welcome || !sub->fds || !sub->held) {
            st = cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
        } else if ((st = cipi_ledger_init(&sub->ledger, m.num_slots, m.seq)) == CIP_OK) {
            cipi_owed_init(&sub->owed, m.num_slots);
            memcpy(sub->welcome, m.payload, m.len);
            sub->welcome_len = m.len;
            memcpy(sub->fds, fds, nfds * sizeof(int));
            sub->nfds = nfds;
            nfds = 0;
        }
    }
    free(buf);
    cipi_close_fds(fds, nfds);
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
    *out = sub;
    return CIP_OK;
}

cip_status
cip_sub_open_raw(const char *path, const cip_sub_options *opts, cip_sub **out)
{
    return cipi_sub_open_raw(path, opts, out);
}
