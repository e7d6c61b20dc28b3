/* pidfd.c -- what names an exporter process (its pid, its start time, its PID namespace)
 * and the pidfd transport: copying its fds with pidfd_open + pidfd_getfd.  Every failure
 * says why and what to do; fetch.c falls back to the fd server on some of them. */
#include "cip_internal.h"

/* The fix for a peer that cannot reach the exporter by pid. */
#define SHARED_SOCKET_FIX                                                                      \
    "create the pool with socket_path= in a directory both processes see (a shared mount, "   \
    "e.g. docker run -v /run/ipcpool:/run/ipcpool), export it with transport=\"auto\" or "    \
    "\"socket\", and list this uid in allowed_uids= if it differs"

const char cipi_shared_socket_fix[] = SHARED_SOCKET_FIX;

const char *
cipi_errname(int err)
{
    switch (err) {
#define NAME(e)                                                                                \
    case e:                                                                                    \
        return #e;
        NAME(EPERM) NAME(ENOENT) NAME(ESRCH) NAME(EINTR) NAME(EIO) NAME(EBADF) NAME(EAGAIN)
        NAME(ENOMEM) NAME(EACCES) NAME(EFAULT) NAME(EBUSY) NAME(EEXIST) NAME(ENOTDIR)
        NAME(EISDIR) NAME(EINVAL) NAME(ENFILE) NAME(EMFILE) NAME(ENOSPC) NAME(EPIPE)
        NAME(ENAMETOOLONG) NAME(ENOSYS) NAME(ELOOP) NAME(EPROTO) NAME(ENOTSOCK)
        NAME(EOPNOTSUPP) NAME(EADDRINUSE) NAME(ECONNRESET) NAME(ENOBUFS) NAME(ENOTCONN)
        NAME(ETIMEDOUT) NAME(ECONNREFUSED) NAME(EMSGSIZE) NAME(EXDEV)
#undef NAME
    default:
        return NULL;
    }
}

/* "<call>(pid=P, fd=F)": the failing call, for every message below. */
static void
call_name(char *out, size_t size, const char *call, int pid, int fd)
{
    snprintf(out, size, "%s(pid=%d, fd=%d)", call, pid, fd);
}

cip_status
cipi_pidfd_fail(int err, int pid, int fd, const char *call, enum cipi_where where)
{
    char who[96];
    call_name(who, sizeof who, call, pid, fd);
    if (err == EPERM)
        return cipi_fail(CIP_ERR_TRANSPORT,
                         "%s: the kernel's ptrace access check refused (Yama "
                         "kernel.yama.ptrace_scope >= 1 for non-descendant processes, a "
                         "different uid, or no CAP_SYS_PTRACE in a container); run both "
                         "processes as the same user with ptrace_scope 0, add CAP_SYS_PTRACE "
                         "(docker run --cap-add=SYS_PTRACE), or use the socket transport "
                         "(transport=\"socket\")",
                         who);
    if (err == ENOSYS)
        return cipi_fail(CIP_ERR_TRANSPORT,
                         "%s: not supported by this kernel (pidfd_getfd needs Linux >= 5.6); "
                         "use the socket transport (transport=\"socket\")",
                         who);
    if (err == ESRCH && where == CIPI_WHERE_SAME)
        return cipi_fail(CIP_ERR_TRANSPORT, "%s: the exporter process has exited", who);
    if (err == ESRCH)
        return cipi_fail(CIP_ERR_TRANSPORT,
                         "%s: no process %d here: the exporter has exited, or it runs in another "
                         "PID namespace (a container, or unshare --pid), where pidfd_getfd "
                         "cannot reach it: then " SHARED_SOCKET_FIX,
                         who, pid);
    if (err == EBADF)
        return cipi_fail(CIP_ERR_TRANSPORT,
                         "%s: fd %d is no longer open in the exporter (pool closed?)", who, fd);
    const char *name = cipi_errname(err);
    if (name != NULL)
        return cipi_fail(CIP_ERR_TRANSPORT, "%s: %s: %s", who, name, strerror(err));
    return cipi_fail(CIP_ERR_TRANSPORT, "%s: %d: %s", who, err, strerror(err));
}

cip_status
cipi_process_start_time(int pid, long long *out, int *err)
{
    char path[64], buf[1024];
    /* this process through /proc/self: right even where /proc belongs to another PID
     * namespace than this process's (a container without its own /proc) */
    if (pid == getpid())
        snprintf(path, sizeof path, "/proc/self/stat");
    else
        snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
    int e = errno;
    if (fd >= 0)
        close(fd);
    if (n < 0 && (fd < 0 ? (e == ENOENT || e == ESRCH) : e == ESRCH)) {
        *err = ESRCH;
        return cipi_fail(CIP_ERR_TRANSPORT, "process %d does not exist (the exporter has exited)",
                         pid);
    }
    if (n < 0) {
        *err = e ? e : EIO;
        return cipi_fail(CIP_ERR_TRANSPORT, "cannot read /proc/%d/stat: %s", pid, strerror(*err));
    }
    buf[n] = '\0';
    /* comm (field 2) may hold spaces and parentheses: fields counted after the last ')' */
    char *p = strrchr(buf, ')');
    if (p != NULL) {
        p++;
        for (int field = 3; field < 22 && *p; field++) {
            while (*p == ' ')
                p++;
            while (*p && *p != ' ')
                p++;
        }
        while (*p == ' ')
            p++;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end != p && errno == 0 && (*end == ' ' || *end == '\0' || *end == '\n')) {
            *out = v;
            return CIP_OK;
        }
    }
    *err = EPROTO;
    return cipi_fail(CIP_ERR_TRANSPORT, "cannot parse /proc/%d/stat", pid);
}

/* Whether pid has exited (reaped, zombie or dead). */
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
    return *p == 'Z' || *p == 'X' || *p == 'x' || *p == '\0';
}

enum cipi_where
cipi_where_of(unsigned long long pid_namespace)
{
    if (pid_namespace == 0)
        return CIPI_WHERE_UNKNOWN;
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0 || st.st_ino == 0)
        return CIPI_WHERE_UNKNOWN;
    return (unsigned long long)st.st_ino == pid_namespace ? CIPI_WHERE_SAME : CIPI_WHERE_OTHER;
}

static cip_status
reused_pid(int pid, enum cipi_where where)
{
    if (where == CIPI_WHERE_SAME)
        return cipi_fail(CIP_ERR_TRANSPORT,
                         "exporter exited and its pid was reused: process %d has a different "
                         "start time than the exporter",
                         pid);
    return cipi_fail(CIP_ERR_TRANSPORT,
                     "process %d here is not the exporter (another start time): the exporter "
                     "has exited and its pid was reused, or it runs in another PID namespace (a "
                     "container, or unshare --pid), where pidfd_getfd cannot reach it: then "
                     SHARED_SOCKET_FIX,
                     pid);
}

cip_status
cipi_getfd_all(int pid, const uint32_t *targets, size_t n, long long start_time,
               enum cipi_where where, int *out, int *err)
{
    *err = 0;
    if (n == 0)
        return CIP_OK;
    int pidfd = (int)syscall(CIP_SYS_PIDFD_OPEN, pid, 0);
    if (pidfd < 0) {
        *err = errno ? errno : EIO;
        return cipi_pidfd_fail(*err, pid, (int)targets[0], "pidfd_open", where);
    }
    (void)fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    /* checked after the pidfd is open: a recycled pid never yields another process's fd */
    if (start_time >= 0) {
        long long now = -1;
        int serr = 0;
        cip_status st = cipi_process_start_time(pid, &now, &serr);
        if (st != CIP_OK || now != start_time) {
            close(pidfd);
            *err = st != CIP_OK ? serr : ESRCH; /* (gone since the pidfd_open: it says so) */
            return st != CIP_OK ? st : reused_pid(pid, where);
        }
    }
    for (size_t i = 0; i < n; i++) {
        int fd = (int)syscall(CIP_SYS_PIDFD_GETFD, pidfd, (int)targets[i], 0);
        if (fd < 0) {
            *err = errno ? errno : EIO;
            if (*err == EBADF && process_gone(pid))
                *err = ESRCH; /* older kernels say EBADF for an exiting process */
            cip_status st = cipi_pidfd_fail(*err, pid, (int)targets[i], "pidfd_getfd", where);
            cipi_close_fds(out, i);
            close(pidfd);
            return st;
        }
        out[i] = fd;
    }
    close(pidfd);
    return CIP_OK;
}
