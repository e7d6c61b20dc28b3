/* listen.c -- a listening Unix socket at a path: bound so that the file never exists with a
 * wider mode than asked nor before the socket listens, a stale file replaced, the publisher's
 * socket (its mode by who may connect, its backlog), and the file removed at teardown only
 * while it is still ours.  The Python library
 * calls these for the fd server and the publisher (cupy_ipcpool._transport._unix,
 * channel._handshake); errno of a failure goes to *err. */
#include "cip_internal.h"

#include <libgen.h>
#include <limits.h>
#include <sys/stat.h>

/* errno's symbol and text, as the Python library says an OSError: "[Errno 13] ...". */
static const char *
say(int err, char *buf, size_t size)
{
    snprintf(buf, size, "[Errno %d] %s", err, strerror(err));
    return buf;
}

/* A transport failure: errno e into *err, the message from the format. */
#define FAIL(err, e, ...) (*(err) = (e), cipi_fail(CIP_ERR_TRANSPORT, __VA_ARGS__))

/* bind(fd, path); a failure says the path and what to do. */
static cip_status
bind_at(int fd, const char *path, int *err)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, path, strlen(path) + 1);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0)
        return CIP_OK;
    int e = errno;
    if (e == EADDRINUSE)
        return FAIL(err, e, "%s exists; remove it or choose another path", path);
    return FAIL(err, e, "cannot bind a socket at %s: %s", path, strerror(e));
}

/* The directory `path` is in, absolute (a relative path is taken from the working
 * directory), into out (PATH_MAX); 0 or -1 (errno). */
static int
parent_of(const char *path, char *out)
{
    char joined[PATH_MAX];
    if (path[0] == '/') {
        if (strlen(path) >= sizeof joined)
            return errno = ENAMETOOLONG, -1;
        strcpy(joined, path);
    } else {
        char cwd[PATH_MAX];
        if (getcwd(cwd, sizeof cwd) == NULL)
            return -1;
        if ((size_t)snprintf(joined, sizeof joined, "%s/%s", cwd, path) >= sizeof joined)
            return errno = ENAMETOOLONG, -1;
    }
    strcpy(out, dirname(joined));
    return 0;
}

cip_status
cipi_bind_listen(int fd, const char *path, unsigned mode, int backlog, uint64_t *dev,
                 uint64_t *ino, int *err)
{
    *err = 0;
    cip_status st = cipi_check_socket_path(path);
    if (st != CIP_OK)
        return st;
    char parent[PATH_MAX], tmpdir[PATH_MAX + 16], tmp[PATH_MAX + 24], text[96];
    if (parent_of(path, parent) != 0 || mkdtemp(strcat(strcpy(tmpdir, parent), "/.ipcpXXXXXX")) == NULL)
        return FAIL(err, errno, "cannot create a directory next to %s: %s", path,
                    strerror(errno));
    snprintf(tmp, sizeof tmp, "%s/s", tmpdir);
    if (strlen(tmp) > CIP_WIRE_MAX_SOCKET_PATH) {
        /* no room for the temporary path: the mode set before binding in place (Linux gives
         * it to the new file), listening right after */
        if (fchmod(fd, mode) != 0)
            st = FAIL(err, errno, "cannot set the mode of the socket for %s: %s", path,
                            strerror(errno));
        else if ((st = bind_at(fd, path, err)) == CIP_OK &&
                 (chmod(path, mode) != 0 || listen(fd, backlog) != 0)) {
            st = FAIL(err, errno, "cannot listen at %s: %s", path, strerror(errno));
            unlink(path);
        }
    } else if ((st = bind_at(fd, tmp, err)) == CIP_OK) {
        if (chmod(tmp, mode) != 0 || listen(fd, backlog) != 0) {
            st = FAIL(err, errno, "cannot listen at %s: %s", tmp, strerror(errno));
        } else if (link(tmp, path) != 0) {
            int e = errno;
            if (e == EEXIST) {
                st = FAIL(err, EADDRINUSE, "%s was created by someone else while binding",
                                path);
            } else if (e != EPERM && e != EOPNOTSUPP && e != EXDEV && e != EMLINK) {
                st = FAIL(err, e, "cannot create %s: %s", path, strerror(e));
            } else { /* no hard links on this file system: move it into place instead */
                struct stat there;
                if (lstat(path, &there) == 0)
                    st = FAIL(err, EADDRINUSE,
                                    "%s was created by someone else while binding", path);
                else if (rename(tmp, path) != 0)
                    st = FAIL(err, errno, "cannot create %s: %s", path, strerror(errno));
            }
        }
        unlink(tmp); /* (gone already after a rename) */
    }
    rmdir(tmpdir);
    if (st != CIP_OK)
        return st;
    struct stat bound;
    if (lstat(path, &bound) != 0)
        return FAIL(err, errno, "cannot look at %s after binding it: %s", path,
                          say(errno, text, sizeof text));
    *dev = (uint64_t)bound.st_dev;
    *ino = (uint64_t)bound.st_ino;
    return CIP_OK;
}

/* Remove `path` if it is a socket nobody listens on; a live one, or a file that is not a
 * socket, is refused. */
static cip_status
remove_stale(const char *path, int *err)
{
    *err = 0;
    cip_status st = cipi_check_socket_path(path);
    if (st != CIP_OK)
        return st;
    struct stat there;
    if (lstat(path, &there) != 0) {
        if (errno == ENOENT)
            return CIP_OK;
        return FAIL(err, errno, "cannot look at %s: %s", path, strerror(errno));
    }
    if (!S_ISSOCK(there.st_mode))
        return FAIL(err, EEXIST,
                          "%s exists and is not a socket; remove it or choose another path",
                          path);
    int probe = -1, e = 0;
    st = cipi_connect_unix(path, SOCK_SEQPACKET, cipi_deadline_of(1000), &probe, &e);
    if (st == CIP_OK) {
        close(probe);
        return FAIL(err, EADDRINUSE,
                          "a publisher is already listening at %s; close it or choose another "
                          "address",
                          path);
    }
    if (st == CIP_ERR_TIMEOUT)
        return FAIL(err, EADDRINUSE,
                          "a publisher is already listening at %s (its backlog is full); close "
                          "it or choose another address",
                          path);
    if (e != ECONNREFUSED && e != ENOENT) {
        char text[96];
        return FAIL(err, e ? e : EADDRINUSE,
                          "cannot tell whether %s is in use (%s); remove it or choose another "
                          "path",
                          path, say(e, text, sizeof text));
    }
    if (unlink(path) != 0 && errno != ENOENT) /* stale: nothing listens there */
        return FAIL(err, errno, "cannot remove the stale socket file %s: %s", path,
                          strerror(errno));
    return CIP_OK;
}

int
cipi_unlink_if_ours(const char *path, uint64_t dev, uint64_t ino)
{
    struct stat there;
    if (lstat(path, &there) != 0)
        return errno == ENOENT ? 0 : errno;
    if ((uint64_t)there.st_dev != dev || (uint64_t)there.st_ino != ino)
        return 0; /* someone else's now: it stays */
    if (unlink(path) != 0 && errno != ENOENT)
        return errno;
    return 0;
}

cip_status
cipi_publisher_listen(const char *path, const uint32_t *uids, size_t nuids,
                      uint32_t max_subscribers, int *fd, uint64_t *dev, uint64_t *ino, int *err)
{
    cip_status st = remove_stale(path, err);
    if (st != CIP_OK)
        return st;
    unsigned mode = 0600; /* others allowed: 0666, and the uid check alone decides */
    uint32_t own = (uint32_t)geteuid();
    for (size_t i = 0; i < nuids; i++)
        if (uids[i] != own)
            mode = 0666;
    /* well above the subscriber limit: the accept thread drains the queue at once, so only a
     * burst ever sits in it */
    long backlog = 4L * max_subscribers < 256 ? 256 : 4L * max_subscribers;
    if (backlog > SOMAXCONN)
        backlog = SOMAXCONN;
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0)
        return FAIL(err, errno, "cannot make a socket for %s: %s", path, strerror(errno));
    st = cipi_bind_listen(s, path, mode, (int)backlog, dev, ino, err);
    if (st != CIP_OK) {
        close(s);
        return st;
    }
    *fd = s;
    return CIP_OK;
}

int
cipi_accept_batch(int listener, long long *backoff_until, int *out, int cap)
{
    int n = 0;
    while (n < cap && n < (int)CIP_WIRE_ACCEPT_BATCH) {
        int c = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c >= 0) {
            out[n++] = c;
            continue;
        }
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
            *backoff_until = cipi_now_ns() + (long long)CIP_WIRE_ACCEPT_BACKOFF_MS * 1000000LL;
        if (errno != ECONNABORTED && errno != EINTR)
            break;
    }
    return n;
}

int
cipi_accept_wait_ms(long long now, long long deadline_ns, long long backoff_until)
{
    long long until = deadline_ns;
    if (now < backoff_until && (until < 0 || backoff_until < until))
        until = backoff_until;
    if (until < 0)
        return -1;
    return until <= now ? 0 : (int)((until - now + 999999) / 1000000);
}

int
cipi_uid_in(const uint32_t *uids, size_t n, uint32_t uid)
{
    for (size_t i = 0; i < n; i++)
        if (uids[i] == uid)
            return 1;
    return 0;
}
