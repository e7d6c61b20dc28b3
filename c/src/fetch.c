/* fetch.c -- fetching a pool's fds: pidfd_getfd, the fd server (cip_internal.h says what
 * the modules share). */
#include "cip_internal.h"

/* ---- fetching fds: pidfd_getfd, the fd server -------------------------------------- */

/* Field 22 (starttime) of /proc/<pid>/stat; -1 if the process is not there. */
static long long
process_start_time(int pid)
{
    char path[64], buf[1024];
    if (pid == getpid())
        snprintf(path, sizeof path, "/proc/self/stat");
    else
        snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return -1;
    p++;
    /* p is before field 3; field 22 is the 20th after the ')' */
    for (int field = 3; field < 22; field++) {
        while (*p == ' ')
            p++;
        while (*p && *p != ' ')
            p++;
    }
    while (*p == ' ')
        p++;
    char *end;
    long long v = strtoll(p, &end, 10);
    return end == p ? -1 : v;
}

static int
process_gone(int pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return 1;
    while (*++p == ' ')
        ;
    return *p == 'Z' || *p == 'X' || *p == 'x';
}

static unsigned long long
own_pid_namespace(void)
{
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0)
        return 0;
    return (unsigned long long)st.st_ino;
}

enum where { WHERE_SAME, WHERE_OTHER, WHERE_UNKNOWN };

#define SHARED_SOCKET_FIX                                                                  \
    "publish with an fd server whose socket lies in a directory both processes see (a "    \
    "shared volume) and use the socket transport"

static cip_status
pidfd_error(int err, int pid, unsigned fd, const char *call, enum where where)
{
    if (err == EPERM)
        return cipi_fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): the kernel's ptrace access check refused (Yama "
                    "kernel.yama.ptrace_scope >= 1 for non-descendant processes, a different "
                    "uid, or no CAP_SYS_PTRACE in a container); run both processes as the same "
                    "user with ptrace_scope 0, add CAP_SYS_PTRACE (docker run "
                    "--cap-add=SYS_PTRACE), or use the socket transport",
                    call, pid, fd);
    if (err == ENOSYS)
        return cipi_fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): not supported by this kernel (pidfd_getfd needs Linux >= "
                    "5.6); use the socket transport",
                    call, pid, fd);
    if (err == ESRCH && where == WHERE_SAME)
        return cipi_fail(CIP_ERR_TRANSPORT, "%s(pid=%d, fd=%u): the exporter process has exited",
                    call, pid, fd);
    if (err == ESRCH)
        return cipi_fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): no process %d here: the exporter has exited, or it runs "
                    "in another PID namespace (a container, or unshare --pid), where pidfd_getfd "
                    "cannot reach it: then " SHARED_SOCKET_FIX,
                    call, pid, fd, pid);
    if (err == EBADF)
        return cipi_fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): fd %u is no longer open in the exporter (pool closed?)",
                    call, pid, fd, fd);
    return cipi_fail(CIP_ERR_TRANSPORT, "%s(pid=%d, fd=%u): %s", call, pid, fd, strerror(err));
}

/* pidfd_getfd of every fd; *err = the errno of the failure.  Nothing left open on failure. */
static cip_status
getfd_all(const cip_descriptor *d, int *out, enum where where, int *err)
{
    int pid = (int)d->exporter_pid;
    uint32_t n = d->num_slots;
    unsigned first = (unsigned)rd(d->fds_le, 4);
    *err = 0;
    int pidfd = (int)syscall(CIP_SYS_PIDFD_OPEN, pid, 0);
    if (pidfd < 0) {
        *err = errno;
        return pidfd_error(*err, pid, first, "pidfd_open", where);
    }
    fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    if (process_start_time(pid) != (long long)d->exporter_start_time) {
        close(pidfd);
        *err = ESRCH;
        if (where == WHERE_SAME)
            return cipi_fail(CIP_ERR_TRANSPORT,
                        "exporter exited and its pid was reused: process %d has a different start "
                        "time than the exporter",
                        pid);
        return cipi_fail(CIP_ERR_TRANSPORT,
                    "process %d here is not the exporter (another start time): the exporter has "
                    "exited and its pid was reused, or it runs in another PID namespace (a "
                    "container, or unshare --pid), where pidfd_getfd cannot reach it: "
                    "then " SHARED_SOCKET_FIX,
                    pid);
    }
    for (uint32_t i = 0; i < n; i++)
        out[i] = -1;
    for (uint32_t i = 0; i < n; i++) {
        unsigned target = (unsigned)rd(d->fds_le + 4 * i, 4);
        int fd = (int)syscall(CIP_SYS_PIDFD_GETFD, pidfd, (int)target, 0);
        if (fd < 0) {
            *err = errno;
            if (*err == EBADF && process_gone(pid))
                *err = ESRCH;
            cip_status st = pidfd_error(*err, pid, target, "pidfd_getfd", where);
            cipi_close_fds(out, i);
            close(pidfd);
            return st;
        }
        out[i] = fd;
    }
    close(pidfd);
    return CIP_OK;
}

/* Receive exactly n bytes of a stream socket, appending arriving fds to fds[*nfds]. */
static cip_status
recv_exact(int s, uint8_t *buf, size_t n, long long deadline, int *fds, size_t *nfds,
           size_t maxfds, const char *path)
{
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
            return cipi_fail(CIP_ERR_TRANSPORT, "fd server %s did not answer in time", path);
        int flags = 0;
        ssize_t k = cipi_recv_with_fds(s, buf + got, n - got, control.buf, sizeof control.buf, fds,
                                  nfds, maxfds, &excess, &flags);
        if (k < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            if (errno == ECONNRESET && !reset) {
                reset = 1; /* what the server sent before may still be queued */
                continue;
            }
            return cipi_fail(CIP_ERR_TRANSPORT, "fd server %s: %s", path, strerror(errno));
        }
        if (excess)
            return cipi_fail(CIP_ERR_TRANSPORT, "fd server %s sent more fds than expected", path);
        if (flags & MSG_CTRUNC)
            return cipi_fail(CIP_ERR_TRANSPORT,
                        "fd server %s sent more fds than fit (control data truncated)", path);
        if (k == 0)
            return cipi_fail(CIP_ERR_TRANSPORT,
                        "fd server %s closed the connection mid-reply (exporter exiting?)", path);
        got += (size_t)k;
    }
    return CIP_OK;
}

static cip_status
fetch_socket(const cip_descriptor *d, enum where where, int timeout_ms, int *out)
{
    const char *path = d->socket_path;
    long long deadline = cipi_deadline_of(timeout_ms);
    uint32_t n = d->num_slots;
    int s = -1, err = 0;
    cip_status st = cipi_connect_unix(path, SOCK_STREAM, deadline, &s, &err);
    if (st == CIP_ERR_TIMEOUT)
        return cipi_fail(CIP_ERR_TRANSPORT, "connecting to fd server %s timed out", path);
    if (st != CIP_OK) {
        if (err == ECONNREFUSED || err == ENOENT)
            return cipi_fail(CIP_ERR_TRANSPORT,
                        "no fd server at %s: the exporter has exited or closed its fd server",
                        path);
        if (err == EACCES)
            return cipi_fail(CIP_ERR_TRANSPORT,
                        "cannot connect to fd server %s: the socket's file permissions refuse this "
                        "user (uid %u); the exporter must allow this uid (allowed_uids)",
                        path, (unsigned)geteuid());
        if (st == CIP_ERR_TRANSPORT)
            return cipi_fail(CIP_ERR_TRANSPORT, "cannot connect to fd server %s: %s", path,
                        strerror(err));
        return st;
    }
    /* who serves it: the exporter's uid, and the exporter's pid where it is visible here */
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
        close(s);
        return cipi_fail(CIP_ERR_TRANSPORT, "SO_PEERCRED on %s: %s", path, strerror(errno));
    }
    if (cred.uid != d->exporter_uid) {
        close(s);
        return cipi_fail(CIP_ERR_REFUSED,
                    "the fd server %s runs as uid %u, but the exporter runs as uid %u: someone "
                    "else owns the socket path; nothing was sent to it",
                    path, (unsigned)cred.uid, d->exporter_uid);
    }
    if (where != WHERE_OTHER &&
        process_start_time((int)d->exporter_pid) == (long long)d->exporter_start_time &&
        cred.pid != (pid_t)d->exporter_pid) {
        close(s);
        return cipi_fail(CIP_ERR_REFUSED,
                    "the fd server %s is process %d, not the exporter (process %u): someone else "
                    "owns the socket path; nothing was sent to it",
                    path, (int)cred.pid, d->exporter_pid);
    }
    uint8_t req[4 + 1 + 16];
    memcpy(req, CIP_WIRE_FDSERVER_MAGIC, 4);
    req[4] = 16;
    memcpy(req + 5, d->pool_id, 16);
    /* refused before the request arrived: the status byte still says why */
    (void)!send(s, req, sizeof req, MSG_NOSIGNAL);
    int *got = out;
    size_t nfds = 0;
    uint8_t head[5];
    st = recv_exact(s, head, 1, deadline, got, &nfds, n, path);
    if (st == CIP_OK && head[0] != CIP_WIRE_FDSERVER_STATUS_OK) {
        unsigned status = head[0];
        if (status == CIP_WIRE_FDSERVER_STATUS_UID_REFUSED)
            st = cipi_fail(CIP_ERR_REFUSED,
                      "the exporter's fd server %s refused this process's uid %u; the exporter "
                      "must allow it (allowed_uids=...)",
                      path, (unsigned)geteuid());
        else if (status == CIP_WIRE_FDSERVER_STATUS_BAD_TOKEN)
            st = cipi_fail(CIP_ERR_REFUSED,
                      "the exporter's fd server %s refused the token (descriptor stale or from a "
                      "different pool)",
                      path);
        else if (status == CIP_WIRE_FDSERVER_STATUS_BAD_REQUEST)
            st = cipi_fail(CIP_ERR_REFUSED, "fd server %s refused a malformed request", path);
        else if (status == CIP_WIRE_FDSERVER_STATUS_BUSY)
            st = cipi_fail(CIP_ERR_TRANSPORT,
                      "fd server %s is serving too many other connections of this uid and "
                      "dropped this one, the oldest; retry",
                      path);
        else if (status == CIP_WIRE_FDSERVER_STATUS_TOO_SLOW)
            st = cipi_fail(CIP_ERR_TRANSPORT, "fd server %s gave up on this connection", path);
        else
            st = cipi_fail(CIP_ERR_TRANSPORT, "fd server %s sent unknown status %u", path, status);
    }
    if (st == CIP_OK)
        st = recv_exact(s, head + 1, 4, deadline, got, &nfds, n, path);
    if (st == CIP_OK) {
        uint32_t announced = ((uint32_t)head[1] << 24) | ((uint32_t)head[2] << 16) |
                             ((uint32_t)head[3] << 8) | head[4];
        if (announced != n)
            st = cipi_fail(CIP_ERR_TRANSPORT,
                      "fd server %s serves %u fds, expected %u (descriptor from a different "
                      "pool?)",
                      path, announced, n);
    }
    if (st == CIP_OK) {
        size_t nmsg = (n + CIP_WIRE_FDSERVER_FDS_PER_MESSAGE - 1) / CIP_WIRE_FDSERVER_FDS_PER_MESSAGE;
        uint8_t *tags = (uint8_t *)malloc(nmsg ? nmsg : 1);
        if (tags == NULL)
            st = cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
        else
            st = recv_exact(s, tags, nmsg, deadline, got, &nfds, n, path);
        free(tags);
    }
    if (st == CIP_OK && nfds != n)
        st = cipi_fail(CIP_ERR_TRANSPORT, "fd server %s sent %zu fds, expected %u", path, nfds, n);
    close(s);
    if (st != CIP_OK)
        cipi_close_fds(got, nfds);
    return st;
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
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "room for %zu fds; the pool has %u slots", cap,
                    d.num_slots);
    if (transport < CIP_TRANSPORT_AUTO || transport > CIP_TRANSPORT_SOCKET)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "unknown transport %d", transport);
    *count = 0;
    unsigned long long mine = own_pid_namespace();
    enum where where = !d.exporter_pid_namespace || !mine           ? WHERE_UNKNOWN
                       : mine == d.exporter_pid_namespace ? WHERE_SAME
                                                          : WHERE_OTHER;
    int has_socket = d.socket_path[0] != '\0';
    if (transport == CIP_TRANSPORT_SOCKET) {
        if (!has_socket)
            return cipi_fail(CIP_ERR_TRANSPORT,
                        "socket transport requested but the exporter offers no fd server socket; "
                        "export with an fd server or use the pidfd transport");
        st = fetch_socket(&d, where, timeout_ms, fds);
    } else {
        char first[sizeof cipi_tls_error];
        int err = ESRCH;
        if (where == WHERE_OTHER) {
            st = cipi_fail(CIP_ERR_TRANSPORT,
                      "pidfd_getfd could not see the exporter: it runs in another PID namespace "
                      "than this process (a container, or unshare --pid), so its pid %u names no "
                      "process here; " SHARED_SOCKET_FIX,
                      d.exporter_pid);
        } else {
            st = getfd_all(&d, fds, where, &err);
            if (st == CIP_OK) {
                *count = d.num_slots;
                return CIP_OK;
            }
        }
        if (transport == CIP_TRANSPORT_PIDFD || !has_socket)
            return st;
        int invisible = err == ESRCH && where != WHERE_SAME;
        if (where != WHERE_OTHER && err != EPERM && err != ENOSYS && !invisible)
            return st;
        memcpy(first, cipi_tls_error, sizeof first);
        st = fetch_socket(&d, where, timeout_ms, fds);
        if (st != CIP_OK) {
            char second[sizeof cipi_tls_error];
            memcpy(second, cipi_tls_error, sizeof second);
            cipi_fail(st, "%s; the fallback to the socket transport failed too: %s", first, second);
        }
    }
    if (st == CIP_OK)
        *count = d.num_slots;
    return st;
}
