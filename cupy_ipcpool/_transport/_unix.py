"""Unix-socket helpers: the socket path check, binding, the allowed uids, removal at teardown.

Shared by the fd server (:mod:`._fdserver`) and the channel's publisher.  The rules are the
engine's (``c/src/sockets.c``, ``c/src/listen.c``); passing fds, reading a peer's
credentials and connecting are too (``c/src/fetch.c``, ``c/src/fdserver.c``, the
channel's handshake), with no Python copy.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

from cupy_ipcpool._compiled import loader
from cupy_ipcpool._errors import (
    UsageError,
    UsageTypeError,
)

#: The engine, for the socket path rules it holds (c/src/sockets.c, c/src/listen.c).
_engine = loader("cupy_ipcpool._engine")

__all__ = [
    "SCM_MAX_FD",
    "allowed_uid_set",
    "bind_unix",
    "check_socket_path",
    "unlink_if_ours",
]

#: Kernel limit on fds in one SCM_RIGHTS message.
SCM_MAX_FD = 253


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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


def unlink_if_ours(path: str, ident: tuple[int, int]) -> None:
    """Remove the socket file at ``path`` if it is still the one bound as ``ident``.

    ``ident`` is ``(st_dev, st_ino)`` of the file right after ``bind``.  The
    path is looked at with ``lstat``: a file or symlink someone put in its
    place is not ours and stays.  A file already gone is fine; any other
    ``OSError`` is the caller's to report (the fd server and the publisher
    warn with their own words).
    """
    _engine().unlink_if_ours(path, *ident)  # c/src/listen.c
