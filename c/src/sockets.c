/* sockets.c -- Unix sockets: the socket path check, connecting, receiving fds
 * (cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* The one check of a socket path this library connects to: not empty, and short enough for
 * sun_path with its NUL (CIP_WIRE_MAX_SOCKET_PATH, 107 bytes, Python's limit too).  The
 * message gives the limit, the path's length and the fix. */
cip_status
cipi_check_socket_path(const char *path)
{
    size_t len = strlen(path);
    if (len == 0)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "the socket path is empty");
    if (len > CIP_WIRE_MAX_SOCKET_PATH)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                    "the socket path %.200s%s is %zu bytes long; a Unix socket path holds at most "
                    "%u bytes (sun_path): use a shorter path, e.g. in a directory under /tmp or "
                    "$XDG_RUNTIME_DIR",
                    path, len > 200 ? "..." : "", len, CIP_WIRE_MAX_SOCKET_PATH);
    return CIP_OK;
}

/* Connect a non-blocking Unix socket of `type`, retrying a full backlog until the deadline. */
cip_status
cipi_connect_unix(const char *path, int type, long long deadline, int *out, int *err)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    cip_status st = cipi_check_socket_path(path);
    if (st != CIP_OK) {
        *err = ENAMETOOLONG;
        return st;
    }
    memcpy(addr.sun_path, path, strlen(path));
    int s = socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) {
        *err = errno;
        return cipi_fail(CIP_ERR_TRANSPORT, "socket: %s", strerror(errno));
    }
    long delay = 1000;
    for (;;) {
        if (connect(s, (struct sockaddr *)&addr, sizeof addr) == 0)
            break;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN) {
            *err = errno;
            close(s);
            return CIP_ERR_TRANSPORT;
        }
        if (deadline >= 0 && cipi_now_ms() >= deadline) {
            *err = ETIMEDOUT;
            close(s);
            return CIP_ERR_TIMEOUT;
        }
        cipi_sleep_us(delay);
        delay = delay * 2 > 50000 ? 50000 : delay * 2;
    }
    *out = s;
    return CIP_OK;
}

/* One recvmsg (MSG_CMSG_CLOEXEC | MSG_DONTWAIT) of up to `n` bytes into `buf`, its control
 * data into `control` (`control_len` bytes).  The fds of its SCM_RIGHTS go to fds[*nfds]
 * on, `maxfds` in all at most; those beyond are closed and `*excess` set.  Returns
 * recvmsg's result (when negative, errno says why and no fd came); `*msg_flags` gets the
 * message's flags (MSG_CTRUNC, MSG_TRUNC) when it is not. */
ssize_t
cipi_recv_with_fds(int s, void *buf, size_t n, void *control, size_t control_len, int *fds,
              size_t *nfds, size_t maxfds, int *excess, int *msg_flags)
{
    struct iovec iov = {buf, n};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = control_len;
    ssize_t k = recvmsg(s, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (k < 0)
        return k;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int *in = (int *)CMSG_DATA(c);
        for (size_t i = 0; i < count; i++) {
            if (*nfds < maxfds) {
                fds[(*nfds)++] = in[i];
            } else {
                close(in[i]);
                *excess = 1;
            }
        }
    }
    *msg_flags = msg.msg_flags;
    return k;
}
