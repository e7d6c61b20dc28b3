/* fetch.c -- fetching an exporter's fds: the fd server's client (it checks who serves the
 * socket before it sends the token), and the choice of transport ("auto": pidfd, falling
 * back to the fd server where the kernel refuses pidfd_getfd or the exporter's pid is not
 * visible here; when both fail, one error names both causes and the fix).  The one client:
 * the C API's cip_fetch_fds and Python's _transport.fetch_fds both call cipi_fetch. */
#include "cip_internal.h"

/* A failure with its errno: *err = e, then cipi_fail. */
#define FAIL(e, st, ...) (*err = (e), cipi_fail((st), __VA_ARGS__))

/* Receive exactly n bytes of a stream socket, appending arriving fds to fds[*nfds] (at most
 * maxfds: one more is refused, and closed). */
static cip_status
recv_exact(int s, uint8_t *buf, size_t n, long long deadline, int *fds, size_t *nfds,
           size_t maxfds, const struct cipi_fetch *f, int *err)
{
    const char *path = f->socket_path;
    size_t got = 0;
    int reset = 0, excess = 0;
    union {
        char buf[CMSG_SPACE(CIP_WIRE_SCM_MAX_FD * sizeof(int))];
        struct cmsghdr align;
    } control;
    while (got < n) {
        struct pollfd pfd = {s, POLLIN, 0};
        int r = poll(&pfd, 1, cipi_left_ms(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0)
            return FAIL(ETIMEDOUT, CIP_ERR_TIMEOUT, "fd server %s did not answer within %g s",
                        path, f->timeout_ms / 1000.0);
        int flags = 0;
        ssize_t k = cipi_recv_with_fds(s, buf + got, n - got, control.buf, sizeof control.buf,
                                       fds, nfds, maxfds, &excess, &flags);
        if (k < 0) {
            int e = errno;
            if (e == EAGAIN || e == EINTR)
                continue;
            if (e == ECONNRESET && !reset) {
                reset = 1; /* what the server sent before may still be queued */
                continue;
            }
            const char *name = cipi_errname(e);
            return FAIL(e, CIP_ERR_TRANSPORT, "fd server %s: %s: %s", path, name ? name : "?",
                        strerror(e));
        }
        if (excess || (flags & MSG_CTRUNC))
            return FAIL(EPROTO, CIP_ERR_TRANSPORT, "fd server %s sent more fds than expected",
                        path);
        if (k == 0)
            return FAIL(ECONNRESET, CIP_ERR_TRANSPORT,
                        "fd server %s closed the connection mid-reply (exporter exiting?)", path);
        got += (size_t)k;
    }
    return CIP_OK;
}

static cip_status
connect_failed(cip_status st, int e, const char *path, int *err)
{
    if (st == CIP_ERR_TIMEOUT)
        return FAIL(ETIMEDOUT, CIP_ERR_TIMEOUT, "connecting to fd server %s timed out", path);
    if (st == CIP_ERR_INVALID_ARGUMENT) { /* a path no socket fits: its message stands */
        *err = e;
        return st;
    }
    if (e == ECONNREFUSED || e == ENOENT)
        return FAIL(e, CIP_ERR_TRANSPORT,
                    "no fd server at %s: the exporter has exited or closed its fd server", path);
    if (e == EACCES)
        return FAIL(e, CIP_ERR_TRANSPORT,
                    "cannot connect to fd server %s: the socket's file permissions refuse this "
                    "user (uid %u); the exporter must allow this uid (allowed_uids)",
                    path, (unsigned)geteuid());
    const char *name = cipi_errname(e);
    return FAIL(e, CIP_ERR_TRANSPORT, "cannot connect to fd server %s: %s: %s", path,
                name ? name : "?", strerror(e));
}

/* Refuse a socket not served by the exporter: of the exporter's uid when it is known, of
 * its pid when that process is visible here with its start time, else of this euid or
 * root.  Nothing has been sent yet. */
static cip_status
check_server(int s, const struct cipi_fetch *f, enum cipi_where where, int *err)
{
    const char *path = f->socket_path;
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0)
        return FAIL(errno, CIP_ERR_TRANSPORT, "SO_PEERCRED on %s: %s", path, strerror(errno));
    if (f->exporter_uid >= 0 && (long long)cred.uid != f->exporter_uid)
        return FAIL(EPERM, CIP_ERR_REFUSED,
                    "the fd server %s runs as uid %u, but the exporter runs as uid %lld: "
                    "someone else owns the socket path; nothing was sent to it",
                    path, (unsigned)cred.uid, f->exporter_uid);
    /* a pid of another PID namespace proves nothing about who serves the socket here */
    if (where != CIPI_WHERE_OTHER && f->pid > 0 && f->start_time >= 0) {
        long long now = -1;
        int serr;
        if (cipi_process_start_time(f->pid, &now, &serr) == CIP_OK && now == f->start_time) {
            if (cred.pid != (pid_t)f->pid)
                return FAIL(EPERM, CIP_ERR_REFUSED,
                            "the fd server %s is process %d, not the exporter (process %d): "
                            "someone else owns the socket path; nothing was sent to it",
                            path, (int)cred.pid, f->pid);
            return CIP_OK;
        }
    }
    if (f->exporter_uid < 0 && cred.uid != geteuid() && cred.uid != 0)
        return FAIL(EPERM, CIP_ERR_REFUSED,
                    "the fd server %s runs as uid %u, neither this process's uid %u nor root, "
                    "and the exporter's uid is not known: nothing was sent to it (pass the "
                    "exporter's uid)",
                    path, (unsigned)cred.uid, (unsigned)geteuid());
    return CIP_OK;
}

static cip_status
refusal(unsigned status, const char *path, int *err)
{
    if (status == CIP_WIRE_FDSERVER_STATUS_UID_REFUSED)
        return FAIL(EACCES, CIP_ERR_REFUSED,
                    "the exporter's fd server %s refused this process's uid %u; the exporter "
                    "must allow it (allowed_uids=...)",
                    path, (unsigned)geteuid());
    if (status == CIP_WIRE_FDSERVER_STATUS_BAD_TOKEN)
        return FAIL(EACCES, CIP_ERR_REFUSED,
                    "the exporter's fd server %s refused the token (descriptor stale or from a "
                    "different pool)",
                    path);
    if (status == CIP_WIRE_FDSERVER_STATUS_BAD_REQUEST)
        return FAIL(EPROTO, CIP_ERR_REFUSED, "fd server %s refused a malformed request", path);
    if (status == CIP_WIRE_FDSERVER_STATUS_BUSY)
        return FAIL(EBUSY, CIP_ERR_TRANSPORT,
                    "fd server %s is serving %u other connections of this uid and dropped this "
                    "one, the oldest; retry",
                    path, CIP_WIRE_FDSERVER_MAX_PENDING_PER_UID);
    if (status == CIP_WIRE_FDSERVER_STATUS_TOO_SLOW)
        return FAIL(ETIMEDOUT, CIP_ERR_TIMEOUT,
                    "fd server %s gave up on this connection after %g s", path,
                    CIP_WIRE_FDSERVER_REQUEST_TIMEOUT_MS / 1000.0);
    return FAIL(EPROTO, CIP_ERR_TRANSPORT, "fd server %s sent unknown status %u", path, status);
}

/* The fd server's client: f->n fds from the server at f->socket_path into out. */
static cip_status
fetch_socket(const struct cipi_fetch *f, enum cipi_where where, int *out, int *err)
{
    const char *path = f->socket_path;
    long long deadline = cipi_deadline_of(f->timeout_ms);
    size_t n = (size_t)f->n;
    int s = -1, e = 0;
    cip_status st = cipi_connect_unix(path, SOCK_STREAM, deadline, &s, &e);
    if (st != CIP_OK)
        return connect_failed(st, e, path, err);
    st = check_server(s, f, where, err);
    if (st != CIP_OK) {
        close(s);
        return st;
    }
    uint8_t req[4 + 1 + 255];
    memcpy(req, CIP_WIRE_FDSERVER_MAGIC, 4);
    req[4] = (uint8_t)f->token_len;
    if (f->token_len)
        memcpy(req + 5, f->token, f->token_len);
    /* refused before the request arrived: the status byte still says why */
    (void)!send(s, req, 5 + f->token_len, MSG_NOSIGNAL);
    size_t nfds = 0;
    uint8_t head[5];
    st = recv_exact(s, head, 1, deadline, out, &nfds, n, f, err);
    if (st == CIP_OK && head[0] != CIP_WIRE_FDSERVER_STATUS_OK)
        st = refusal(head[0], path, err);
    if (st == CIP_OK)
        st = recv_exact(s, head + 1, 4, deadline, out, &nfds, n, f, err);
    if (st == CIP_OK) {
        uint32_t announced = ((uint32_t)head[1] << 24) | ((uint32_t)head[2] << 16) |
                             ((uint32_t)head[3] << 8) | head[4];
        if (announced != n)
            st = FAIL(EPROTO, CIP_ERR_TRANSPORT,
                      "fd server %s serves %u fds, expected %zu (descriptor from a different "
                      "pool?)",
                      path, announced, n);
    }
    if (st == CIP_OK) {
        size_t nmsg = (n + CIP_WIRE_FDSERVER_FDS_PER_MESSAGE - 1) /
                      CIP_WIRE_FDSERVER_FDS_PER_MESSAGE;
        uint8_t *tags = malloc(nmsg ? nmsg : 1);
        st = tags == NULL ? FAIL(ENOMEM, CIP_ERR_NO_MEMORY, "out of memory")
                          : recv_exact(s, tags, nmsg, deadline, out, &nfds, n, f, err);
        free(tags);
    }
    if (st == CIP_OK && nfds != n)
        st = FAIL(EPROTO, CIP_ERR_TRANSPORT, "fd server %s sent %zu fds, expected %zu", path,
                  nfds, n);
    close(s);
    if (st != CIP_OK)
        cipi_close_fds(out, nfds);
    return st;
}

/* The exporter's pid is of another PID namespace: pidfd cannot name it from here. */
static cip_status
foreign_pid(const struct cipi_fetch *f, int *err)
{
    if (f->socket_path == NULL)
        return FAIL(ESRCH, CIP_ERR_TRANSPORT,
                    "pidfd_getfd cannot reach the exporter: it runs in another PID namespace "
                    "than this process (a container, or unshare --pid), so its pid %d names no "
                    "process here, and the descriptor offers no fd server socket: %s",
                    f->pid, cipi_shared_socket_fix);
    return FAIL(ESRCH, CIP_ERR_TRANSPORT,
                "pidfd_getfd cannot reach the exporter: it runs in another PID namespace than "
                "this process (a container, or unshare --pid), so its pid %d names no process "
                "here; use the socket transport (transport=\"auto\" or \"socket\") at %s",
                f->pid, f->socket_path);
}

/* "auto" fell back and the socket failed too: one error naming both causes, of the socket's
 * status and errno, except that "no process pid here" and "no fd server at path" together
 * are ESRCH: the exporter has exited. */
static cip_status
both_failed(const char *first, int first_err, cip_status st, const struct cipi_fetch *f,
            enum cipi_where where, int *err)
{
    char second[sizeof cipi_tls_error];
    memcpy(second, cipi_tls_error, sizeof second);
    const char *path = f->socket_path, *fix = cipi_shared_socket_fix;
    int no_server = *err == ENOENT || *err == ECONNREFUSED;
    if (where == CIPI_WHERE_OTHER) {
        const char *head = "pidfd_getfd could not see the exporter: it runs in another PID "
                           "namespace than this process (a container, or unshare --pid), so "
                           "its pid";
        if (no_server)
            return cipi_fail(st,
                             "%s %d names no process here; the fallback to the socket transport "
                             "failed too: %s. If the exporter is alive, %s is not visible from "
                             "this process (not in a directory both mount namespaces share): %s",
                             head, f->pid, second, path, fix);
        if (*err == EACCES)
            return cipi_fail(st,
                             "%s %d names no process here; the fallback to the socket transport "
                             "failed too: %s. Fix: %s",
                             head, f->pid, second, fix);
        return cipi_fail(st,
                         "%s %d names no process here; the fallback to the socket transport "
                         "failed too: %s",
                         head, f->pid, second);
    }
    if (first_err == ESRCH && no_server) {
        *err = ESRCH;
        return cipi_fail(st,
                         "the exporter has exited: no process %d with its start time here, and "
                         "no fd server at %s (%s). If it is alive, it runs in another PID "
                         "namespace (the descriptor does not say which) and %s is not shared "
                         "with this process: %s",
                         f->pid, path, second, path, fix);
    }
    if (first_err == ESRCH)
        return cipi_fail(st,
                         "pidfd_getfd found no exporter process %d here (it has exited, or it "
                         "runs in another PID namespace: the descriptor does not say which); "
                         "the fallback to the socket transport failed too: %s",
                         f->pid, second);
    return cipi_fail(st, "%s; the fallback to the socket transport failed too: %s", first,
                     second);
}

cip_status
cipi_fetch(const struct cipi_fetch *f, int *out, int *err)
{
    *err = 0;
    if (f->n < 0 || f->n > CIP_WIRE_FDSERVER_MAX_FDS_PER_REPLY)
        return FAIL(EINVAL, CIP_ERR_INVALID_ARGUMENT, "count must be in [0, %u], got %lld",
                    CIP_WIRE_FDSERVER_MAX_FDS_PER_REPLY, f->n);
    if (f->token_len > 255 || (f->token_len && f->token == NULL))
        return FAIL(EINVAL, CIP_ERR_INVALID_ARGUMENT, "a token of %zu bytes cannot be sent",
                    f->token_len);
    if (f->method < CIP_TRANSPORT_AUTO || f->method > CIP_TRANSPORT_SOCKET)
        return FAIL(EINVAL, CIP_ERR_INVALID_ARGUMENT, "unknown transport %d", f->method);
    enum cipi_where where = f->where;
    if (f->method == CIP_TRANSPORT_SOCKET) {
        if (f->socket_path == NULL)
            return FAIL(EINVAL, CIP_ERR_TRANSPORT,
                        "socket transport requested but the exporter offers no fd server "
                        "socket; export with an fd server or use transport=\"pidfd\"");
        return fetch_socket(f, where, out, err);
    }
    cip_status st;
    if (where == CIPI_WHERE_OTHER) {
        st = foreign_pid(f, err);
        if (f->method == CIP_TRANSPORT_PIDFD || f->socket_path == NULL)
            return st;
    } else {
        st = cipi_getfd_all(f->pid, f->fds, (size_t)f->n, f->start_time, where, out, err);
        if (st == CIP_OK || f->method == CIP_TRANSPORT_PIDFD || f->socket_path == NULL)
            return st;
        int invisible = *err == ESRCH && where == CIPI_WHERE_UNKNOWN;
        if (*err != EPERM && *err != ENOSYS && !invisible)
            return st;
    }
    char first[sizeof cipi_tls_error];
    memcpy(first, cipi_tls_error, sizeof first);
    int first_err = *err;
    st = fetch_socket(f, where, out, err);
    return st == CIP_OK ? CIP_OK : both_failed(first, first_err, st, f, where, err);
}

cip_status
cip_fetch_fds(const void *desc_bytes, size_t len, int transport, int timeout_ms, int *fds,
              size_t cap, size_t *count)
{
    cip_descriptor d;
    cip_status st = cip_parse_descriptor(desc_bytes, len, &d);
    if (st != CIP_OK)
        return st;
    if (fds == NULL || count == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_fetch_fds: NULL argument");
    if (cap < d.num_slots)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "room for %zu fds; the pool has %u slots",
                         cap, d.num_slots);
    *count = 0;
    uint32_t *targets = malloc((d.num_slots ? d.num_slots : 1) * sizeof *targets);
    if (targets == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    for (uint32_t i = 0; i < d.num_slots; i++)
        targets[i] = (uint32_t)rd(d.fds_le + 4 * i, 4);
    struct cipi_fetch f = {
        .pid = (int)d.exporter_pid,
        .start_time = (long long)d.exporter_start_time,
        .fds = targets,
        .n = d.num_slots,
        .socket_path = d.socket_path[0] != '\0' ? d.socket_path : NULL,
        .token = d.pool_id,
        .token_len = sizeof d.pool_id,
        .method = transport,
        .exporter_uid = (long long)d.exporter_uid,
        .where = cipi_where_of(d.exporter_pid_namespace),
        .timeout_ms = timeout_ms,
    };
    int err;
    st = cipi_fetch(&f, fds, &err);
    free(targets);
    if (st == CIP_OK)
        *count = d.num_slots;
    return st;
}
