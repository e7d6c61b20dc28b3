"""The peer side: fetch an exporter's fds over its fd server, or pick a transport.

:func:`fetch_fds_over_socket` is the client of :class:`~._fdserver.FdServer`:
it checks who serves the socket before it sends the token.  :func:`fetch_fds`
picks the transport: ``"auto"`` tries ``pidfd`` and falls back to the socket
on ``EPERM``/``ENOSYS`` and when the exporter's pid is not visible here; when
both fail, one error names both causes and the fix.  Both are the engine's
(``c/src/fetch.c``, the one client: the C library's ``cip_fetch_fds`` too).
"""

from __future__ import annotations

from collections.abc import Sequence

from cupy_ipcpool._errors import UsageError

from .._compiled import loader
from ._fdserver import _check_token

__all__ = [
    "fetch_fds",
    "fetch_fds_over_socket",
]

_engine = loader("cupy_ipcpool._engine")

#: The transports by name.
_METHODS = ("auto", "pidfd", "socket")


def _method_code(method: str) -> int:
    """The engine's number of transport ``method`` (``cip_transport``)."""
    if method == "pidfd":
        return int(_engine().TRANSPORT_PIDFD)
    if method == "socket":
        return int(_engine().TRANSPORT_SOCKET)
    return int(_engine().TRANSPORT_AUTO)


def fetch_fds_over_socket(
    path: str,
    token: bytes,
    count: int,
    *,
    timeout: float = 10.0,
    server_uid: int | None = None,
    server_pid: int | None = None,
    server_start_time: int | None = None,
) -> list[int]:
    """Fetch ``count`` fds from the :class:`FdServer` at ``path``.

    Before the token is sent, the process serving the socket is checked
    (``SO_PEERCRED``): it must run as ``server_uid`` when given; it must be
    process ``server_pid`` when that process is visible here with start time
    ``server_start_time`` (same pid namespace); with neither proof it must run
    as this process's euid or as root.  So a process of another uid squatting
    the path never sees the token, and its fds are never accepted.

    Parameters
    ----------
    path:
        The server's socket path.
    token:
        The server's token.
    count:
        How many fds the server must send.
    timeout:
        Seconds for the whole exchange (connect retries ``EAGAIN`` until then).
    server_uid:
        The exporter's uid (the descriptor's ``exporter_uid``).
    server_pid, server_start_time:
        The exporter process (the descriptor's ``exporter_pid`` and
        ``exporter_start_time``).

    Returns
    -------
    list[int]
        Close-on-exec fds owned by the caller, in the server's order.

    Raises
    ------
    PeerRefusedError
        The server refused this uid (``EACCES``) or the token (``EACCES``), or
        the request (``EPROTO``); or the socket is served by a process that
        is not the exporter (``EPERM``; nothing was sent to it).
    TransportError
        ``ECONNREFUSED``/``ENOENT``: the exporter has exited or closed its fd
        server; ``EACCES``: the socket's file permissions refuse this user;
        ``ETIMEDOUT`` (a :class:`TransportTimeoutError`, also a
        ``TimeoutError``): the connect or the reply did not finish within
        ``timeout``; ``EBUSY``: the server is serving too many connections of
        this uid; ``EPROTO``: the reply was malformed or had the wrong number
        of fds.
    """
    token = _check_token(token)
    return _engine().fetch_fds(
        pid=0 if server_pid is None else int(server_pid),
        start_time=None if server_pid is None else server_start_time,
        fds=None,
        count=int(count),
        socket_path=path,
        token=token,
        method=_method_code("socket"),
        exporter_uid=server_uid,
        pid_namespace=None,
        same_namespace=False,
        timeout=float(timeout),
    )


def fetch_fds(
    *,
    pid: int,
    start_time: int | None,
    fds: Sequence[int],
    socket_path: str | None,
    token: bytes,
    method: str = "auto",
    exporter_uid: int | None = None,
    pid_namespace: int | None = None,
) -> list[int]:
    """Fetch an exporter's fds by ``pidfd_getfd`` or over its :class:`FdServer`.

    Parameters
    ----------
    pid, start_time:
        The exporter process (``start_time`` guards against pid reuse; may be
        None to skip the check).
    fds:
        The fd numbers in the exporter, in the order wanted.
    socket_path:
        The exporter's fd server socket, or None if it runs none.
    token:
        The fd server's token.
    method:
        ``"pidfd"``, ``"socket"`` or ``"auto"``: pidfd, falling back to the
        socket (when ``socket_path`` is given) on ``EPERM``/``ENOSYS``, and
        when the exporter's pid is not visible here: it lives in another PID
        namespace, or, where the namespace is not known, there is no process
        ``pid`` with ``start_time`` here.
    exporter_uid:
        The exporter's uid; the socket's server must run as it (see
        :func:`fetch_fds_over_socket` for the checks made without it).
    pid_namespace:
        The exporter's PID namespace (the descriptor's
        ``exporter_pid_namespace``); None or 0 when unknown.  When it is not
        this process's namespace, ``pid`` means nothing here: pidfd is not
        tried.

    Returns
    -------
    list[int]
        Close-on-exec fds owned by the caller, one per entry of ``fds``.

    Raises
    ------
    UsageError
        Unknown ``method`` (also a ``ValueError``).
    TransportError
        As :func:`pidfd_getfd` or :func:`fetch_fds_over_socket`.  When
        ``"auto"`` fell back and the socket failed too, the error is the
        socket's (its type and errno), and its message says why each transport
        failed and what to do.  ``ESRCH``
        when the exporter's pid is of another PID namespace and no socket is
        offered (``"pidfd"``, or a descriptor without a socket path).
    """
    if method not in _METHODS:
        raise UsageError(f'method must be "auto", "pidfd" or "socket", got {method!r}')
    return _engine().fetch_fds(
        pid=int(pid),
        start_time=start_time,
        fds=[int(fd) for fd in fds],
        count=len(fds),
        socket_path=socket_path,
        token=_check_token(token),
        method=_method_code(method),
        exporter_uid=exporter_uid,
        pid_namespace=pid_namespace,
        same_namespace=False,
        timeout=10.0,
    )
