"""The exporter side of the socket transport: :class:`FdServer` and its protocol.

The exporter serves its slot fds on a Unix socket and passes them with
``SCM_RIGHTS``; :func:`~cupy_ipcpool._transport.fetch_fds_over_socket` is the
client.

Socket protocol (all integers big-endian)::

    request   b"FDS1" | u8 token_len (<= 64) | token
    refusal   u8 status (1 = uid refused, 2 = bad token, 3 = bad request,
              4 = too many connections from this uid, 5 = too slow), then close
    reply     u8 status (0) | u32 count, then ceil(count / 250) one-byte messages
              b"F", each carrying up to 250 fds in one SCM_RIGHTS message

The client checks who serves the socket (``SO_PEERCRED``) before it sends the
token; the server checks the client's uid as soon as it accepts, before it
reads anything.  One thread serves every connection without blocking, each with
one overall deadline, at most :data:`MAX_PENDING_PER_UID` per uid: the engine's
(``c/src/fdserver.c``, bound as ``_engine.FdServer``), as the client is
(``c/src/fetch.c``).  This module makes and binds the socket and removes its
files.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import struct
import tempfile
import threading
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from cupy_ipcpool._errors import TeardownWarning, TransportError, UsageError, UsageTypeError

from .._compiled import loader
from ._admission import MAX_PENDING_PER_UID
from ._closing import ClosesOnExit, close_in_forked_children
from ._unix import allowed_uid_set, bind_unix, check_socket_path, unlink_if_ours

__all__ = [
    "FDS_PER_MESSAGE",
    "LISTEN_BACKLOG",
    "MAGIC",
    "MAX_FDS_PER_REPLY",
    "MAX_PENDING_PER_UID",
    "MAX_TOKEN_LEN",
    "REQUEST_TIMEOUT_S",
    "STATUS_BAD_REQUEST",
    "STATUS_BAD_TOKEN",
    "STATUS_BUSY",
    "STATUS_OK",
    "STATUS_TOO_SLOW",
    "STATUS_UID_REFUSED",
    "FdServer",
]

#: Request magic of the socket protocol, version 1.
MAGIC = b"FDS1"

#: Longest token the socket protocol accepts.
MAX_TOKEN_LEN = 64

#: Most fds sent in one SCM_RIGHTS message (the kernel's SCM_MAX_FD is 253).
FDS_PER_MESSAGE = 250

#: Most fds one reply may announce; guards the receiver against absurd counts.
MAX_FDS_PER_REPLY = 1 << 16

STATUS_OK = 0
STATUS_UID_REFUSED = 1
STATUS_BAD_TOKEN = 2
STATUS_BAD_REQUEST = 3
STATUS_BUSY = 4
STATUS_TOO_SLOW = 5

#: Deadline of one connection to the server, from accept to the last fd sent.
REQUEST_TIMEOUT_S = 5.0

#: Listen backlog of the server.
LISTEN_BACKLOG = 512

_COUNT = struct.Struct("!I")

_engine = loader("cupy_ipcpool._engine")


def _check_token(token: bytes) -> bytes:
    if not isinstance(token, (bytes, bytearray)):
        raise UsageTypeError(f"token must be bytes, not {type(token).__name__}")
    if len(token) > MAX_TOKEN_LEN:
        raise UsageError(f"token is {len(token)} bytes; at most {MAX_TOKEN_LEN} allowed")
    return bytes(token)


def _stop_and_remove(
    server: Any, owner: int, path: str | None, ino: tuple[int, int] | None, directory: str | None
) -> None:
    """Stop the engine's server (its thread joined, every connection closed), then unlink the
    socket (if it is still ours) and remove its directory.  In a process forked from the
    one that made it (``owner``), only this process's copies of the fds are closed: the
    files and the connections are the parent's."""
    if server is not None:
        server.stop()
    if os.getpid() != owner:
        return
    if path is not None and ino is not None:
        try:
            unlink_if_ours(path, ino)
        except OSError as exc:
            warnings.warn(f"FdServer: cannot unlink {path}: {exc}", TeardownWarning, stacklevel=2)
    if directory is not None:
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(
                f"FdServer: cannot remove {directory}: {exc}", TeardownWarning, stacklevel=2
            )


class FdServer(ClosesOnExit):
    """Serve a fixed list of fds over a Unix socket with ``SCM_RIGHTS``.

    The exporter side of the socket transport.  One thread (the engine's) serves every
    connection without blocking on any: the client's uid is checked as soon as
    it is accepted (a refused uid is told so and closed, nothing is read from
    it), each connection has one overall deadline of
    :data:`REQUEST_TIMEOUT_S`, and at most :data:`MAX_PENDING_PER_UID`
    connections of one uid are served at once (one more makes the oldest of
    that uid go: it is told ``STATUS_BUSY``).  A slow, idle or malformed
    client never delays another.

    Parameters
    ----------
    fds:
        The fds to serve, in order.  The server does not own them and never
        closes them; keep them open while the server runs.
    token:
        Shared secret (at most 64 bytes) a client must present.
    path:
        Where to bind the socket.  By default a private directory is made with
        ``tempfile.mkdtemp(prefix="cupy_ipcpool-")`` and the socket is
        ``fds.sock`` inside it.
    allowed_uids:
        Uids allowed to fetch (checked with ``SO_PEERCRED``).  The server's own
        effective uid is always allowed (a same-uid process can read this
        process's memory anyway).

    Attributes
    ----------
    path:
        The socket's path.

    Notes
    -----
    Call :meth:`close` (or use ``with``).  If it is forgotten, the server stops and
    the socket file and directory are removed when it is collected, or at
    interpreter exit.

    Permissions.  When only our own euid is allowed, the directory made by the
    server is mode 0700 and the socket 0600: the file system already refuses
    everyone else.  When other uids are allowed, the directory is 0711
    (traversable, not listable) and the socket 0666, so other users can
    connect; the uid check then rests on ``SO_PEERCRED`` (and the token).  The
    socket is bound while its directory is still 0700 (with ``path`` given:
    in a fresh 0700 directory, then linked into place, see :func:`bind_unix`),
    so it is never briefly more open than intended; the umask is not touched.
    With an explicit ``path`` the caller's directory must be traversable by
    the allowed uids.
    """

    def __init__(
        self,
        fds: Sequence[int],
        *,
        token: bytes,
        path: str | None = None,
        allowed_uids: Iterable[int] | None = None,
    ) -> None:
        self._fds = tuple(int(fd) for fd in fds)
        if any(fd < 0 for fd in self._fds):
            raise UsageError(f"fds must be non-negative, got {self._fds}")
        self._token = _check_token(token)
        euid = os.geteuid()
        self.allowed_uids: frozenset[int] = allowed_uid_set(allowed_uids, euid) | {euid}
        shared = self.allowed_uids != {euid}
        self._closed = False
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self._dir: str | None = None
        self._sock: socket.socket | None = None
        self._ino: tuple[int, int] | None = None
        self._finalizer: weakref.finalize[..., FdServer] | None = None
        self._server: Any = None  # the engine's FdServer, which serves
        try:
            if path is None:
                self._dir = tempfile.mkdtemp(prefix="cupy_ipcpool-")  # mode 0700
                self.path = os.path.join(self._dir, "fds.sock")
            else:
                self.path = os.fspath(path)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._bind(shared)
            self._finalizer = weakref.finalize(
                self, _stop_and_remove, None, os.getpid(), self.path, self._ino, self._dir
            )
            if self._dir is not None and shared:
                os.chmod(self._dir, 0o711)
            self._sock.listen(LISTEN_BACKLOG)  # the private directory's (bind_unix listens itself)
            self._sock.setblocking(False)
            self._server = _engine().FdServer(
                self._sock.fileno(), self._fds, self._token, sorted(self.allowed_uids)
            )
            self._sock.detach()  # the engine's from here: closed by its stop()
            self._sock = None
            self._finalizer.detach()  # the one below stops the server too
            self._finalizer = weakref.finalize(
                self, _stop_and_remove, self._server, os.getpid(), self.path, self._ino, self._dir
            )
            self._server.start()
            close_in_forked_children(self)  # a child's copy would keep the socket live
        except BaseException:
            self._teardown()
            raise

    def _bind(self, shared: bool) -> None:
        assert self._sock is not None
        mode = 0o666 if shared else 0o600
        if self._dir is not None:
            check_socket_path(self.path)  # a long $TMPDIR
            try:
                self._sock.bind(self.path)  # the directory is still 0700
            except OSError as exc:
                raise TransportError(
                    exc.errno or errno.EIO,
                    f"cannot bind fd server socket {self.path}: {exc.strerror}",
                ) from exc
            os.chmod(self.path, mode)
            st = os.stat(self.path)
            self._ino = (st.st_dev, st.st_ino)
        else:
            self._ino = bind_unix(self._sock, self.path, mode, backlog=LISTEN_BACKLOG)

    @property
    def connections(self) -> int:
        """Connections being served now (accepted, not yet answered and closed)."""
        return 0 if self._server is None else int(self._server.connections)

    # -- teardown --------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, unlink the socket and remove the directory made for it.

        Idempotent; never raises (failures warn with :class:`TeardownWarning`).
        The served fds are not closed.
        """
        if os.getpid() != self._owner:  # a forked child (at the fork): our copies only,
            self._closed = True  # and no lock, which another thread may have held then
            self._teardown()
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._sock is not None:  # (not handed to the engine yet)
            self._sock.close()
        self._sock = None
        if self._finalizer is not None:
            self._finalizer()  # stops the server, removes the files, once
        else:
            _stop_and_remove(None, os.getpid(), None, None, self._dir)
        self._dir = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<FdServer {self.path!r} fds={len(self._fds)} {state}>"
