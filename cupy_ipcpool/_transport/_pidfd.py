"""The ``pidfd`` transport: copy an exporter's fds with ``pidfd_open`` + ``pidfd_getfd``.

Also what names the exporter process: its pid, its start time
(:func:`process_start_time`, so a recycled pid is never taken for it) and its
PID namespace (a pid of another namespace names nothing here).

The kernel applies a ptrace access check to ``pidfd_getfd``: it fails with
``EPERM`` under Yama ``ptrace_scope`` >= 1 (non-descendants), across uids, or
in a container without ``CAP_SYS_PTRACE``; every error says why and what to do.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable, Iterable

from cupy_ipcpool._errors import TransportError
from cupy_ipcpool._handles import own_pid_namespace

from ._unix import _close_all, _errname

__all__ = [
    "pidfd_getfd",
    "process_start_time",
]

_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438, "arm64": 438}

# The raw pidfd_getfd(pidfd, targetfd, flags) call, made once by _getfd_syscall().
_getfd_call: Callable[[int, int], int] | None = None


def process_start_time(pid: int) -> int:
    """Return the start time of process ``pid`` in clock ticks since boot.

    Together with the pid this names a process uniquely: a recycled pid gets a
    different start time.

    Parameters
    ----------
    pid:
        Process id.

    Returns
    -------
    int
        Field 22 (``starttime``) of ``/proc/<pid>/stat``.

    Raises
    ------
    TransportError
        ``ESRCH`` when the process does not exist; ``EPROTO`` when the stat
        file cannot be parsed.
    """
    pid = int(pid)
    # this process through /proc/self: right even where /proc belongs to another
    # PID namespace than this process's (a container without its own /proc)
    where = "self" if pid == os.getpid() else str(pid)
    try:
        with open(f"/proc/{where}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise TransportError(
            errno.ESRCH, f"process {pid} does not exist (the exporter has exited)"
        ) from None
    except OSError as exc:
        raise TransportError(
            exc.errno or errno.EIO, f"cannot read /proc/{pid}/stat: {exc.strerror}"
        ) from exc
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = stat[stat.rfind(b")") + 1 :].split()
    # rest[0] is field 3 (state), so field 22 is rest[19].
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        raise TransportError(errno.EPROTO, f"cannot parse /proc/{pid}/stat") from None


def _getfd_syscall() -> Callable[[int, int], int]:
    """Return ``call(pidfd, target_fd)``, the raw ``pidfd_getfd`` syscall.

    The call returns the new fd, or a negative number with the cause in
    ``ctypes.get_errno()``.  The ctypes function object is made on first use
    and kept for the life of the process.

    Raises
    ------
    TransportError
        ``ENOSYS`` on an architecture whose syscall number is not known here.
    """
    global _getfd_call
    if _getfd_call is not None:
        return _getfd_call
    machine = platform.machine()
    nr = _SYS_PIDFD_GETFD.get(machine)
    if nr is None:
        raise TransportError(
            errno.ENOSYS,
            f"pidfd_getfd: unknown syscall number on {machine}; "
            'use the socket transport (transport="socket")',
        )
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    c_nr = ctypes.c_long(nr)
    c_int = ctypes.c_int

    def call(pidfd: int, target_fd: int) -> int:
        return int(syscall(c_nr, c_int(pidfd), c_int(target_fd), 0))

    _getfd_call = call
    return call


def _pidfd_error(
    err: int, pid: int, target_fd: int, call: str, namespace: str = "same"
) -> TransportError:
    where = f"{call}(pid={pid}, fd={target_fd})"
    if err == errno.EPERM:
        msg = (
            f"{where}: the kernel's ptrace access check refused (Yama "
            "kernel.yama.ptrace_scope >= 1 for non-descendant processes, a different uid, "
            "or no CAP_SYS_PTRACE in a container); run both processes as the same user "
            "with ptrace_scope 0, add CAP_SYS_PTRACE (docker run --cap-add=SYS_PTRACE), "
            'or use the socket transport (transport="socket")'
        )
    elif err == errno.ENOSYS:
        msg = (
            f"{where}: not supported by this kernel (pidfd_getfd needs Linux >= 5.6); "
            'use the socket transport (transport="socket")'
        )
    elif err == errno.ESRCH and namespace == "same":
        msg = f"{where}: the exporter process has exited"
    elif err == errno.ESRCH:
        msg = (
            f"{where}: no process {pid} here: the exporter has exited, or it runs in another "
            "PID namespace (a container, or unshare --pid), where pidfd_getfd cannot reach "
            f"it: then {_SHARED_SOCKET_FIX}"
        )
    elif err == errno.EBADF:
        msg = f"{where}: fd {target_fd} is no longer open in the exporter (pool closed?)"
    else:
        msg = f"{where}: {_errname(err)}: {os.strerror(err)}"
    return TransportError(err, msg)


def pidfd_getfd(pid: int, target_fd: int, *, start_time: int | None = None) -> int:
    """Duplicate fd ``target_fd`` of process ``pid`` into this process.

    Parameters
    ----------
    pid:
        The exporter's process id.
    target_fd:
        The fd number in the exporter.
    start_time:
        The exporter's :func:`process_start_time`.  When given it is checked
        after the pidfd is open, so a recycled pid can never yield another
        process's fd.

    Returns
    -------
    int
        A new close-on-exec fd owned by the caller.

    Raises
    ------
    TransportError
        With the errno of the failing call and the fix: ``EPERM`` (ptrace
        policy, ``CAP_SYS_PTRACE``, socket transport), ``ENOSYS`` (kernel older
        than 5.6), ``ESRCH`` (exporter exited or pid reused), ``EBADF`` (fd no
        longer open in the exporter).
    """
    return _getfd_all(pid, (target_fd,), start_time, "same")[0]


def _getfd_all(
    pid: int, target_fds: Iterable[int], start_time: int | None, where: str
) -> list[int]:
    """Duplicate every fd of ``target_fds`` from process ``pid``, in order.

    One pidfd serves them all: it is opened on the first fd, the start time is
    checked once (after opening, so a recycled pid can never yield another
    process's fd), and it is closed at the end.  On any failure the fds fetched
    so far are closed.  Errors are those of :func:`pidfd_getfd`, naming the fd
    whose call failed; ``where`` (``"same"`` or ``"unknown"``: is the pid of this
    process's PID namespace?) words ``ESRCH``.
    """
    out: list[int] = []
    pidfd = -1
    try:
        for fd in target_fds:
            if pidfd >= 0:
                target_fd = int(fd)
            else:
                pid = int(pid)
                target_fd = int(fd)
                pidfd = _open_pidfd(pid, target_fd, where)
                if start_time is not None and process_start_time(pid) != start_time:
                    raise TransportError(errno.ESRCH, _reused_pid_message(pid, where))
                getfd = _getfd_syscall()
            new_fd = getfd(pidfd, target_fd)
            if new_fd < 0:
                err = ctypes.get_errno() or errno.EIO
                if err == errno.EBADF and _process_gone(pid):
                    err = errno.ESRCH  # older kernels say EBADF for an exiting process
                raise _pidfd_error(err, pid, target_fd, "pidfd_getfd", where)
            out.append(new_fd)
    except BaseException:
        _close_all(out)
        raise
    finally:
        if pidfd >= 0:
            os.close(pidfd)
    return out


def _open_pidfd(pid: int, target_fd: int, where: str) -> int:
    """``os.pidfd_open(pid)``, its errors worded for fetching ``target_fd``."""
    try:
        return os.pidfd_open(pid)
    except AttributeError:
        raise _pidfd_error(errno.ENOSYS, pid, target_fd, "pidfd_open", where) from None
    except OSError as exc:
        err = exc.errno or errno.EIO
        raise _pidfd_error(err, pid, target_fd, "pidfd_open", where) from None


def _reused_pid_message(pid: int, where: str) -> str:
    if where == "same":
        return (
            f"exporter exited and its pid was reused: process {pid} has a different start "
            "time than the exporter"
        )
    return (
        f"process {pid} here is not the exporter (another start time): the exporter has "
        "exited and its pid was reused, or it runs in another PID namespace (a container, "
        f"or unshare --pid), where pidfd_getfd cannot reach it: then {_SHARED_SOCKET_FIX}"
    )


def _process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (reaped, zombie or dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    rest = stat[stat.rfind(b")") + 1 :].split()
    return not rest or rest[0] in (b"Z", b"X", b"x")


def _namespace_of(pid_namespace: int | None) -> str:
    """Where an exporter's PID namespace is: ``"same"``, ``"other"`` or ``"unknown"``."""
    if not pid_namespace:
        return "unknown"
    mine = own_pid_namespace()
    if not mine:
        return "unknown"
    return "same" if mine == pid_namespace else "other"


#: The fix for a peer that cannot reach the exporter by pid.
_SHARED_SOCKET_FIX = (
    "create the pool with socket_path= in a directory both processes see (a shared "
    "mount, e.g. docker run -v /run/ipcpool:/run/ipcpool), export it with "
    'transport="auto" or "socket", and list this uid in allowed_uids= if it differs'
)
