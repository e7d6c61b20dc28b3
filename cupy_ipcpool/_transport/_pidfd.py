"""The ``pidfd`` transport: copy an exporter's fds with ``pidfd_open`` + ``pidfd_getfd``.

Also what names the exporter process: its pid and its start time
(:func:`process_start_time`, so a recycled pid is never taken for it).

The kernel applies a ptrace access check to ``pidfd_getfd``: it fails with
``EPERM`` under Yama ``ptrace_scope`` >= 1 (non-descendants), across uids, or
in a container without ``CAP_SYS_PTRACE``; every error says why and what to do.
The rules are the engine's (``c/src/pidfd.c``), which the C library's
``cip_fetch_fds`` runs too.
"""

from __future__ import annotations

from .._compiled import loader

__all__ = [
    "pidfd_getfd",
    "process_start_time",
]

_engine = loader("cupy_ipcpool._engine")

#: pidfd_getfd's syscall number by machine (for c/gen_wire.py: the engine's build checks it).
_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438, "arm64": 438}


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
    return int(_engine().process_start_time(int(pid)))


def pidfd_getfd(pid: int, target_fd: int, *, start_time: int | None = None) -> int:
    """Duplicate fd ``target_fd`` of process ``pid`` (of this PID namespace) into this process.

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
    (fd,) = _engine().fetch_fds(
        pid=int(pid),
        start_time=start_time,
        fds=(int(target_fd),),
        count=1,
        socket_path=None,
        token=b"",
        method=_engine().TRANSPORT_PIDFD,
        exporter_uid=None,
        pid_namespace=None,
        same_namespace=True,
        timeout=0.0,
    )
    return int(fd)
