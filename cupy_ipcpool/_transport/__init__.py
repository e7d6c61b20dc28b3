"""Moving file descriptors between processes on one machine.

Two transports carry the POSIX fds that back a pool's slots from the exporter
to a peer:

``pidfd`` (:mod:`._pidfd`)
    The peer takes a copy of the exporter's fd directly with ``pidfd_open`` +
    ``pidfd_getfd`` (Linux >= 5.6).  No cooperation from the exporter is needed,
    but the kernel applies a ptrace access check, and the exporter's pid must
    be of this process's PID namespace.
``socket`` (:mod:`._fdserver`, :mod:`._fetch`)
    The exporter runs an :class:`FdServer` on a Unix socket and passes the fds
    with ``SCM_RIGHTS``.  Works wherever both processes see the socket file,
    in any PID namespace.

:func:`fetch_fds` picks one.  Both, and the fd server's thread, are the engine's
(``c/src/pidfd.c``, ``c/src/fetch.c``, ``c/src/fdserver.c``).  :mod:`._unix` holds the
socket path helpers (check, bind, the allowed uids) the channel uses too, and
:mod:`._admission` the per-uid admission of waiting connections.
"""

from __future__ import annotations

from ._admission import MAX_PENDING_PER_UID, Admission
from ._fdserver import (
    FDS_PER_MESSAGE,
    LISTEN_BACKLOG,
    MAGIC,
    MAX_FDS_PER_REPLY,
    MAX_TOKEN_LEN,
    REQUEST_TIMEOUT_S,
    STATUS_BAD_REQUEST,
    STATUS_BAD_TOKEN,
    STATUS_BUSY,
    STATUS_OK,
    STATUS_TOO_SLOW,
    STATUS_UID_REFUSED,
    FdServer,
)
from ._fetch import fetch_fds, fetch_fds_over_socket
from ._pidfd import _SYS_PIDFD_GETFD as _SYS_PIDFD_GETFD
from ._pidfd import pidfd_getfd, process_start_time
from ._unix import (
    SCM_MAX_FD,
    allowed_uid_set,
    bind_unix,
    check_socket_path,
)

__all__ = [
    "FDS_PER_MESSAGE",
    "LISTEN_BACKLOG",
    "MAGIC",
    "MAX_FDS_PER_REPLY",
    "MAX_PENDING_PER_UID",
    "MAX_TOKEN_LEN",
    "REQUEST_TIMEOUT_S",
    "SCM_MAX_FD",
    "STATUS_BAD_REQUEST",
    "STATUS_BAD_TOKEN",
    "STATUS_BUSY",
    "STATUS_OK",
    "STATUS_TOO_SLOW",
    "STATUS_UID_REFUSED",
    "Admission",
    "FdServer",
    "allowed_uid_set",
    "bind_unix",
    "check_socket_path",
    "fetch_fds",
    "fetch_fds_over_socket",
    "pidfd_getfd",
    "process_start_time",
]
