"""The peer side: fetch an exporter's fds over its fd server, or pick a transport.

:func:`fetch_fds_over_socket` is the client of :class:`~._fdserver.FdServer`:
it checks who serves the socket before it sends the token.  :func:`fetch_fds`
picks the transport: ``"auto"`` tries ``pidfd`` and falls back to the socket
on ``EPERM``/``ENOSYS`` and when the exporter's pid is not visible here; when
both fail, one error names both causes and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Sequence

from cupy_ipcpool._errors import (
    PeerRefusedError,
    TransportError,
    TransportTimeoutError,
    UsageError,
)

from ._fdserver import (
    _COUNT,
    FDS_PER_MESSAGE,
    MAGIC,
    MAX_FDS_PER_REPLY,
    MAX_PENDING_PER_UID,
    REQUEST_TIMEOUT_S,
    STATUS_BAD_REQUEST,
    STATUS_BAD_TOKEN,
    STATUS_BUSY,
    STATUS_OK,
    STATUS_TOO_SLOW,
    STATUS_UID_REFUSED,
    _check_token,
)
from ._pidfd import _SHARED_SOCKET_FIX, _getfd_all, _namespace_of, process_start_time
from ._unix import SCM_MAX_FD, _close_all, _errname, connect_unix, peer_credentials, recv_fds

__all__ = [
    "fetch_fds",
    "fetch_fds_over_socket",
]


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
    count = int(count)
    if not 0 <= count <= MAX_FDS_PER_REPLY:
        raise UsageError(f"count must be in [0, {MAX_FDS_PER_REPLY}], got {count}")
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            connect_unix(sock, path, deadline)
        except OSError as exc:
            raise _connect_error(exc, path) from None
        _check_server(sock, path, server_uid, server_pid, server_start_time)
        try:
            # refused before the request arrived: the status byte still tells why
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(MAGIC + bytes([len(token)]) + token)
            status = _recv_reply(sock, path, 1, deadline, fds)[0]
            if status != STATUS_OK:
                raise _refusal(status, path)
            (announced,) = _COUNT.unpack(_recv_reply(sock, path, _COUNT.size, deadline, fds))
            if announced != count:
                raise TransportError(
                    errno.EPROTO,
                    f"fd server {path} serves {announced} fds, expected {count} "
                    "(descriptor from a different pool?)",
                )
            nmsg = -(-count // FDS_PER_MESSAGE)
            _recv_reply(sock, path, nmsg, deadline, fds)
            if len(fds) != count:
                raise TransportError(
                    errno.EPROTO, f"fd server {path} sent {len(fds)} fds, expected {count}"
                )
            return fds
        except BaseException as exc:
            _close_all(fds)
            if isinstance(exc, TimeoutError):
                raise TransportTimeoutError(
                    errno.ETIMEDOUT, f"fd server {path} did not answer within {timeout} s"
                ) from None
            if isinstance(exc, OSError) and not isinstance(exc, TransportError):
                err = exc.errno or errno.EIO
                raise TransportError(
                    err, f"fd server {path}: {_errname(err)}: {exc.strerror}"
                ) from exc
            raise


def _check_server(
    sock: socket.socket,
    path: str,
    server_uid: int | None,
    server_pid: int | None,
    server_start_time: int | None,
) -> None:
    """Refuse a socket that is not served by the exporter (see :func:`fetch_fds_over_socket`)."""
    pid, uid, _gid = peer_credentials(sock)
    if server_uid is not None and uid != server_uid:
        raise PeerRefusedError(
            f"the fd server {path} runs as uid {uid}, but the exporter runs as uid "
            f"{server_uid}: someone else owns the socket path; nothing was sent to it",
            errno.EPERM,
        )
    if server_pid is not None and server_start_time is not None:
        try:
            visible = process_start_time(server_pid) == server_start_time
        except TransportError:
            visible = False
        if visible:
            if pid != server_pid:
                raise PeerRefusedError(
                    f"the fd server {path} is process {pid}, not the exporter (process "
                    f"{server_pid}): someone else owns the socket path; nothing was sent to it",
                    errno.EPERM,
                )
            return
    if server_uid is None and uid not in (os.geteuid(), 0):
        raise PeerRefusedError(
            f"the fd server {path} runs as uid {uid}, neither this process's uid "
            f"{os.geteuid()} nor root, and the exporter's uid is not known: "
            "nothing was sent to it (pass the exporter's uid)",
            errno.EPERM,
        )


def _recv_reply(sock: socket.socket, path: str, n: int, deadline: float, fds: list[int]) -> bytes:
    """Read exactly ``n`` bytes, appending every fd that arrives to ``fds``."""
    buf = b""
    reset = False
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportTimeoutError(errno.ETIMEDOUT, "timed out")
        sock.settimeout(remaining)
        try:
            chunk, got = recv_fds(sock, n - len(buf), SCM_MAX_FD)
        except ConnectionResetError:
            if reset:
                raise
            reset = True  # reported once; what the server sent before may still be queued
            continue
        fds.extend(got)
        if len(fds) > MAX_FDS_PER_REPLY:
            raise TransportError(errno.EPROTO, "fd server sent too many fds")
        if not chunk:
            raise TransportError(
                errno.ECONNRESET,
                f"fd server {path} closed the connection mid-reply (exporter exiting?)",
            )
        buf += chunk
    return buf


def _connect_error(exc: OSError, path: str) -> TransportError:
    err = exc.errno or errno.EIO
    if err in (errno.ECONNREFUSED, errno.ENOENT):
        msg = f"no fd server at {path}: the exporter has exited or closed its fd server"
    elif err == errno.EACCES:
        msg = (
            f"cannot connect to fd server {path}: the socket's file permissions refuse "
            f"this user (uid {os.geteuid()}); the exporter must allow this uid "
            "(allowed_uids)"
        )
    elif isinstance(exc, TimeoutError):
        return TransportTimeoutError(errno.ETIMEDOUT, f"connecting to fd server {path} timed out")
    else:
        msg = f"cannot connect to fd server {path}: {_errname(err)}: {exc.strerror}"
    return TransportError(err, msg)


def _refusal(status: int, path: str) -> TransportError:
    if status == STATUS_UID_REFUSED:
        return PeerRefusedError(
            f"the exporter's fd server {path} refused this process's uid {os.geteuid()}; "
            "the exporter must allow it (allowed_uids=...)"
        )
    if status == STATUS_BAD_TOKEN:
        return PeerRefusedError(
            f"the exporter's fd server {path} refused the token "
            "(descriptor stale or from a different pool)"
        )
    if status == STATUS_BAD_REQUEST:
        return PeerRefusedError(f"fd server {path} refused a malformed request", errno.EPROTO)
    if status == STATUS_BUSY:
        return TransportError(
            errno.EBUSY,
            f"fd server {path} is serving {MAX_PENDING_PER_UID} other connections of this "
            "uid and dropped this one, the oldest; retry",
        )
    if status == STATUS_TOO_SLOW:
        return TransportTimeoutError(
            errno.ETIMEDOUT,
            f"fd server {path} gave up on this connection after {REQUEST_TIMEOUT_S} s",
        )
    return TransportError(errno.EPROTO, f"fd server {path} sent unknown status {status}")


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
        socket's (its type and errno), its message says why each transport
        failed and what to do, and it is chained to the pidfd error.  ``ESRCH``
        when the exporter's pid is of another PID namespace and no socket is
        offered (``"pidfd"``, or a descriptor without a socket path).
    """
    if method not in ("auto", "pidfd", "socket"):
        raise UsageError(f'method must be "auto", "pidfd" or "socket", got {method!r}')
    where = _namespace_of(pid_namespace)
    if method == "socket":
        if socket_path is None:
            raise TransportError(
                errno.EINVAL,
                "socket transport requested but the exporter offers no fd server socket; "
                'export with an fd server or use transport="pidfd"',
            )
        return _fetch_socket(socket_path, token, len(fds), pid, start_time, exporter_uid, where)
    if where == "other":
        pidfd_exc = _foreign_pid_error(pid, socket_path)
        if method == "pidfd" or socket_path is None:
            raise pidfd_exc
    else:
        try:
            return _getfd_all(pid, fds, start_time, where)
        except TransportError as exc:
            if method == "pidfd" or socket_path is None:
                raise
            invisible = exc.errno == errno.ESRCH and where == "unknown"
            if exc.errno not in (errno.EPERM, errno.ENOSYS) and not invisible:
                raise
            pidfd_exc = exc
    try:
        return _fetch_socket(socket_path, token, len(fds), pid, start_time, exporter_uid, where)
    except TransportError as exc:
        raise _both_failed(pidfd_exc, exc, pid, socket_path, where) from pidfd_exc


def _foreign_pid_error(pid: int, socket_path: str | None) -> TransportError:
    """The exporter's pid is of another PID namespace: pidfd cannot name it from here."""
    msg = (
        "pidfd_getfd cannot reach the exporter: it runs in another PID namespace than this "
        f"process (a container, or unshare --pid), so its pid {pid} names no process here"
    )
    if socket_path is None:
        msg += f", and the descriptor offers no fd server socket: {_SHARED_SOCKET_FIX}"
    else:
        msg += f'; use the socket transport (transport="auto" or "socket") at {socket_path}'
    return TransportError(errno.ESRCH, msg)


def _both_failed(
    pidfd_exc: TransportError,
    sock_exc: TransportError,
    pid: int,
    path: str,
    where: str,
) -> TransportError:
    """The error of ``auto`` when the pidfd path and then the socket failed: both causes.

    Of the socket's type and errno, except that "no process ``pid`` here" and
    "no fd server at ``path``" together are ``ESRCH``: the exporter has exited.
    """
    err = sock_exc.errno or errno.EIO
    no_server = err in (errno.ENOENT, errno.ECONNREFUSED)
    if where == "other":
        msg = (
            "pidfd_getfd could not see the exporter: it runs in another PID namespace than "
            f"this process (a container, or unshare --pid), so its pid {pid} names no process "
            f"here; the fallback to the socket transport failed too: {sock_exc}"
        )
        if no_server:
            msg += (
                f". If the exporter is alive, {path} is not visible from this process (not in "
                f"a directory both mount namespaces share): {_SHARED_SOCKET_FIX}"
            )
        elif err == errno.EACCES:
            msg += f". Fix: {_SHARED_SOCKET_FIX}"
    elif pidfd_exc.errno == errno.ESRCH and no_server:
        err = errno.ESRCH
        msg = (
            f"the exporter has exited: no process {pid} with its start time here, and no fd "
            f"server at {path} ({sock_exc}). If it is alive, it runs in another PID "
            f"namespace (the descriptor does not say which) and {path} is not shared with "
            f"this process: {_SHARED_SOCKET_FIX}"
        )
    elif pidfd_exc.errno == errno.ESRCH:
        msg = (
            f"pidfd_getfd found no exporter process {pid} here (it has exited, or it runs in "
            "another PID namespace: the descriptor does not say which); the fallback to the "
            f"socket transport failed too: {sock_exc}"
        )
    else:
        msg = f"{pidfd_exc}; the fallback to the socket transport failed too: {sock_exc}"
    if isinstance(sock_exc, PeerRefusedError):
        return PeerRefusedError(msg, err)
    return TransportError(err, msg)


def _fetch_socket(
    path: str,
    token: bytes,
    count: int,
    pid: int,
    start_time: int | None,
    uid: int | None,
    where: str,
) -> list[int]:
    # a pid of another PID namespace proves nothing about who serves the socket here
    foreign = where == "other"
    return fetch_fds_over_socket(
        path,
        token,
        count,
        server_uid=uid,
        server_pid=None if foreign else pid,
        server_start_time=None if foreign else start_time,
    )
