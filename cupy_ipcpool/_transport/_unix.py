"""Unix-socket helpers: ``SCM_RIGHTS``, peer credentials, binding and connecting.

Shared by the fd server and its client (:mod:`._fdserver`, :mod:`._fetch`) and
by the channel's sockets.  Every fd received is close-on-exec and closed on
every error path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence

from cupy_ipcpool._compiled import loader
from cupy_ipcpool._errors import (
    PeerRefusedError,
    TransportError,
    TransportTimeoutError,
    UsageError,
    UsageTypeError,
)

#: The engine, for the socket path rules it holds (c/src/sockets.c, c/src/listen.c).
_engine = loader("cupy_ipcpool._engine")

__all__ = [
    "SCM_MAX_FD",
    "accept_peer",
    "allowed_uid_set",
    "bind_unix",
    "check_peer",
    "check_socket_path",
    "connect_unix",
    "peer_credentials",
    "recv_fds",
    "send_fds",
    "unlink_if_ours",
]

#: Kernel limit on fds in one SCM_RIGHTS message.
SCM_MAX_FD = 253

_CRED = struct.Struct("3i")
_INT = struct.Struct("i")


def _errname(err: int) -> str:
    return errno.errorcode.get(err, str(err))


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def send_fds(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """Send ``data`` with ``fds`` attached in one ``SCM_RIGHTS`` message.

    Parameters
    ----------
    sock:
        A connected ``AF_UNIX`` socket.
    data:
        At least one byte when ``fds`` is not empty (a stream socket carries
        ancillary data only with data).
    fds:
        At most 253 (``SCM_MAX_FD``) fds; the caller keeps ownership.

    Raises
    ------
    UsageError
        Too many fds, or fds without data (also a ``ValueError``).
    OSError
        From the socket.
    """
    fds = [int(fd) for fd in fds]
    if len(fds) > SCM_MAX_FD:
        raise UsageError(f"at most {SCM_MAX_FD} fds fit in one SCM_RIGHTS message, got {len(fds)}")
    if fds and not data:
        raise UsageError("fds need at least one byte of data to travel with")
    if not fds:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_fds(sock: socket.socket, maxlen: int, maxfds: int) -> tuple[bytes, list[int]]:
    """Receive up to ``maxlen`` bytes and up to ``maxfds`` fds.

    Received fds are close-on-exec and owned by the caller.  On every error
    path the fds that arrived are closed.

    Parameters
    ----------
    sock:
        A connected ``AF_UNIX`` socket.
    maxlen:
        Most bytes to read.
    maxfds:
        Most fds expected.

    Returns
    -------
    tuple[bytes, list[int]]
        The data (empty at end of stream) and the fds.

    Raises
    ------
    TransportError
        ``EMSGSIZE`` when more fds were sent than ``maxfds`` (the control data
        was truncated).
    OSError
        From the socket.
    """
    # socket.recv_fds ignores its flags argument before Python 3.12, so call
    # recvmsg directly to pass MSG_CMSG_CLOEXEC.  CMSG_LEN (not CMSG_SPACE)
    # makes the kernel install at most ``maxfds`` fds and flag MSG_CTRUNC beyond.
    data, ancdata, flags, _ = sock.recvmsg(
        maxlen, socket.CMSG_LEN(maxfds * _INT.size), socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % _INT.size
            fds.extend(struct.unpack(f"{whole // _INT.size}i", payload[:whole]))
    if flags & socket.MSG_CTRUNC or len(fds) > maxfds:
        _close_all(fds)
        raise TransportError(
            errno.EMSGSIZE,
            f"received more fds than the {maxfds} expected (control data truncated); "
            "the peer does not speak this protocol",
        )
    return data, fds


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """Return ``(pid, uid, gid)`` of the peer of a connected Unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid


def accept_peer(
    sock: socket.socket,
    allowed_uids: frozenset[int],
    refuse: Callable[[socket.socket, int], None],
) -> tuple[int, int] | None:
    """The ``(pid, uid)`` of a connection just accepted, if its uid is allowed; else None.

    The one uid check of the serving threads (the fd server, the channel's
    publisher), made before anything the peer sent is read.  When its
    credentials cannot be read the socket is closed; when its uid is not in
    ``allowed_uids``, ``refuse(sock, uid)`` tells it so in the caller's
    protocol and closes it.  Never raises ``OSError``.
    """
    try:
        pid, uid, _gid = peer_credentials(sock)
    except OSError:
        sock.close()
        return None
    if uid not in allowed_uids:
        refuse(sock, uid)
        return None
    return pid, uid


def check_peer(sock: socket.socket, allowed_uids: frozenset[int]) -> tuple[int, int, int]:
    """Return the peer's ``(pid, uid, gid)`` if its uid is in ``allowed_uids``.

    Raises
    ------
    PeerRefusedError
        The peer's uid is not allowed; the message names its pid and uid and
        the allowed uids.
    """
    pid, uid, gid = peer_credentials(sock)
    if uid not in allowed_uids:
        raise PeerRefusedError(
            f"peer process {pid} runs as uid {uid}, which is not allowed "
            f"(allowed uids: {sorted(allowed_uids)})"
        )
    return pid, uid, gid


def allowed_uid_set(allowed_uids: object, default: int) -> frozenset[int]:
    """The uids in ``allowed_uids`` (an iterable of ints; None: ``{default}``), checked.

    The one reading of every ``allowed_uids`` argument (publisher, subscriber,
    pool fd server).

    Raises
    ------
    UsageTypeError
        ``allowed_uids`` is not an iterable of ints (a bare uid, a string).
    UsageError
        A uid is negative.
    """
    if allowed_uids is None:
        return frozenset({default})
    if isinstance(allowed_uids, (str, bytes)) or not hasattr(allowed_uids, "__iter__"):
        raise UsageTypeError(
            f"allowed_uids must be an iterable of uids, e.g. [{default}], "
            f"not {type(allowed_uids).__name__}"
        )
    uids = []
    for uid in allowed_uids:
        if isinstance(uid, bool) or not isinstance(uid, int):
            raise UsageTypeError(f"allowed_uids holds {uid!r}: each uid is an int")
        if uid < 0:
            raise UsageError(f"allowed_uids holds {uid}: a uid is 0 or more")
        uids.append(uid)
    return frozenset(uids)


def check_socket_path(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """``path`` as a str, if a Unix socket can be bound or reached there; else a clear error.

    The one check of a socket path given to the library, made where it is
    given (every bind and connect goes through :func:`bind_unix` or
    :func:`connect_unix`, which call it); its length rule is the engine's
    (``c/src/sockets.c``), which the C library's subscriber follows too.  The
    kernel's ``sun_path`` holds 108 bytes; a path must leave room for its NUL
    (as Python's ``socket`` module and the C library require), so at most
    :data:`MAX_SOCKET_PATH` (107) bytes, counted as the path is given
    (relative to the working directory when relative).

    Raises
    ------
    UsageError
        The path is empty, holds a NUL character, or is longer than
        :data:`MAX_SOCKET_PATH` bytes; the message gives the limit, the
        path's length and the fix (a shorter path).
    UsageTypeError
        Not a path at all (also a ``TypeError``).
    """
    try:
        path = os.fsdecode(path)  # as the socket module takes it: str, bytes or path-like
    except TypeError:
        raise UsageTypeError(
            f"a socket path must be a str or path-like, not {type(path).__name__}"
        ) from None
    if "\x00" in path:
        raise UsageError(f"the socket path {path!r} holds a NUL character")
    _engine().check_socket_path(path)  # empty, or longer than MAX_SOCKET_PATH bytes
    return path


def bind_unix(sock: socket.socket, address: str, mode: int, *, backlog: int) -> tuple[int, int]:
    """Bind ``sock`` at ``address`` and listen, so that the file never exists with a wider
    mode than ``mode``, nor before the socket listens.

    The socket is bound inside a fresh 0700 directory (``mkdtemp``) next to
    ``address``, chmod-ed to ``mode``, set listening (``backlog``), then
    hard-linked into place (renamed where the file system has no hard links);
    ``EADDRINUSE`` if someone took the path meanwhile.  So a client that waits
    for the path to appear finds it accepting connections.  When that
    temporary path would not fit ``sun_path``, the socket's mode is set with
    ``fchmod`` before binding it in place (Linux applies it to the new file)
    and it listens right after.  The process umask is never changed.  The
    rule is the engine's (``c/src/listen.c``), which the C library follows too.

    Returns
    -------
    tuple[int, int]
        ``(st_dev, st_ino)`` of the bound file, to recognise it at teardown.

    Raises
    ------
    UsageError
        A path no socket can be bound at (:func:`check_socket_path`).
    TransportError
        ``EADDRINUSE`` when the path exists; the errno of a failing call
        otherwise.
    """
    address = check_socket_path(address)
    dev, ino = _engine().bind_listen(sock.fileno(), address, mode, backlog)  # c/src/listen.c
    return dev, ino


def connect_unix(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect ``sock`` to ``path``, retrying while the listen backlog is full (``EAGAIN``).

    The first attempt is made even when ``deadline`` has passed: a timeout of
    0 means "do not wait", so a missing or refusing peer still answers with
    its own error (``ENOENT``, ``ECONNREFUSED``), not a timeout.

    Raises
    ------
    UsageError
        A path no socket can be reached at (:func:`check_socket_path`).
    TransportTimeoutError
        The backlog stayed full until ``deadline`` (``ETIMEDOUT``; also a
        ``TimeoutError``).
    OSError
        Any other failure of ``connect``.
    """
    path = check_socket_path(path)
    delay = 0.001
    tried = False  # one attempt even when the deadline has passed already (timeout=0)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 and tried:
            raise TransportTimeoutError(errno.ETIMEDOUT, "the listen backlog stayed full")
        tried = True
        sock.settimeout(max(remaining, 0.0))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            pass  # EAGAIN: the backlog is full; try again
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)


def unlink_if_ours(path: str, ident: tuple[int, int]) -> None:
    """Remove the socket file at ``path`` if it is still the one bound as ``ident``.

    ``ident`` is ``(st_dev, st_ino)`` of the file right after ``bind``.  The
    path is looked at with ``lstat``: a file or symlink someone put in its
    place is not ours and stays.  A file already gone is fine; any other
    ``OSError`` is the caller's to report (the fd server and the publisher
    warn with their own words).
    """
    _engine().unlink_if_ours(path, *ident)  # c/src/listen.c
