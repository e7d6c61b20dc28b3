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
reads anything.  One thread (the transport's accept loop, :mod:`._accept_loop`)
serves every connection without blocking, each with one overall deadline, at
most :data:`MAX_PENDING_PER_UID` per uid.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence

from cupy_ipcpool._errors import TeardownWarning, TransportError, UsageError, UsageTypeError

from ._accept_loop import AcceptLoop
from ._admission import MAX_PENDING_PER_UID, Admission
from ._closing import ClosesOnExit
from ._unix import (
    _close_all,
    accept_peer,
    allowed_uid_set,
    bind_unix,
    check_socket_path,
    recv_fds,
    unlink_if_ours,
)

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

#: What :meth:`_FdConn.read_request` returns when the client hung up before its
#: request was complete (never sent: not a status of the protocol).
_HUNG_UP = -1

#: Deadline of one connection to the server, from accept to the last fd sent.
REQUEST_TIMEOUT_S = 5.0

#: Listen backlog of the server.
LISTEN_BACKLOG = 512

_COUNT = struct.Struct("!I")


def _check_token(token: bytes) -> bytes:
    if not isinstance(token, (bytes, bytearray)):
        raise UsageTypeError(f"token must be bytes, not {type(token).__name__}")
    if len(token) > MAX_TOKEN_LEN:
        raise UsageError(f"token is {len(token)} bytes; at most {MAX_TOKEN_LEN} allowed")
    return bytes(token)


def _remove_files(path: str | None, ino: tuple[int, int] | None, directory: str | None) -> None:
    """Unlink the server's socket (if it is still ours) and remove its directory."""
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


class _FdConn:
    """One client connection of an :class:`FdServer` (owned by its serving thread)."""

    __slots__ = ("buf", "fd", "out", "sock", "uid")

    def __init__(self, sock: socket.socket, uid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.uid = uid
        self.buf = b""
        self.out: list[tuple[bytes, list[int]]] = []

    def read_request(self, token: bytes) -> int | None:
        """Read what has arrived; return a status once the request is complete (None: wait).

        :data:`_HUNG_UP` when the client hung up before its request was complete.
        """
        head = len(MAGIC) + 1
        while True:
            if len(self.buf) < head:
                want = head - len(self.buf)
            else:
                want = head + self.buf[head - 1] - len(self.buf)
            if want <= 0:
                break
            try:
                chunk, fds = recv_fds(self.sock, want, 0)
            except BlockingIOError:
                return None
            if fds:  # unreachable with maxfds=0 (MSG_CTRUNC), kept for safety
                _close_all(fds)
                return STATUS_BAD_REQUEST
            if not chunk:
                return _HUNG_UP
            self.buf += chunk
            if len(self.buf) >= head and (
                self.buf[: len(MAGIC)] != MAGIC or self.buf[head - 1] > MAX_TOKEN_LEN
            ):
                return STATUS_BAD_REQUEST
        if not hmac.compare_digest(self.buf[head:], token):
            return STATUS_BAD_TOKEN
        return STATUS_OK


def _refuse_now(sock: socket.socket, status: int) -> None:
    """Tell a client ``status`` and close, without waiting for it.

    What the client sent so far is read first (without waiting): closing a
    Unix socket with unread data would reset the connection and the client
    would see ``ECONNRESET`` instead of the status.
    """
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        while sock.recv(4096):
            pass
    with contextlib.suppress(OSError):
        sock.send(bytes([status]))
    sock.close()


def _refuse_uid(sock: socket.socket, _uid: int) -> None:
    _refuse_now(sock, STATUS_UID_REFUSED)


class FdServer(ClosesOnExit):
    """Serve a fixed list of fds over a Unix socket with ``SCM_RIGHTS``.

    The exporter side of the socket transport.  One daemon thread serves every
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
    Call :meth:`close` (or use ``with``): the accept thread keeps the server
    alive until then.  If it is forgotten, the socket file and directory are
    still removed at interpreter exit.

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
        self._admission = Admission(MAX_PENDING_PER_UID, REQUEST_TIMEOUT_S)
        self._conns: dict[int, _FdConn] = {}  # owned by the serving thread
        self._dir: str | None = None
        self._sock: socket.socket | None = None
        self._ino: tuple[int, int] | None = None
        self._finalizer: weakref.finalize[..., FdServer] | None = None
        self._loop: AcceptLoop[_FdConn] | None = None
        try:
            if path is None:
                self._dir = tempfile.mkdtemp(prefix="cupy_ipcpool-")  # mode 0700
                self.path = os.path.join(self._dir, "fds.sock")
            else:
                self.path = os.fspath(path)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._bind(shared)
            # the serving thread keeps this object alive, so the finalizer is
            # what removes the files at interpreter exit if close() is forgotten
            self._finalizer = weakref.finalize(self, _remove_files, self.path, self._ino, self._dir)
            if self._dir is not None and shared:
                os.chmod(self._dir, 0o711)
            self._sock.listen(LISTEN_BACKLOG)  # the private directory's (bind_unix listens itself)
            self._sock.setblocking(False)
            self._loop = AcceptLoop(
                self._sock,
                name=f"cupy_ipcpool-FdServer({self.path})",
                on_accept=self._accepted,
                on_event=self._step,
                deadlines=self._admission,
                on_expired=self._expired,
                on_exit=self._finish_all,
            )
            self._loop.start()
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

    # -- serving: what a connection does once the accept loop accepted it ------

    def _accepted(self, sock: socket.socket, _address: object) -> None:
        # a refused uid costs nothing: nothing is read or kept
        peer = accept_peer(sock, self.allowed_uids, _refuse_uid)
        if peer is None:
            return
        _pid, uid = peer
        conn = _FdConn(sock, uid)
        for fd in self._admission.admit(conn.fd, uid, time.monotonic()):
            old = self._conns.get(fd)
            if old is not None:
                self._finish(old, STATUS_BUSY)
        self._conns[conn.fd] = conn
        assert self._loop is not None
        self._loop.watch(conn.fd, conn, select.POLLIN)
        self._step(conn, select.POLLIN)

    def _expired(self, fd: int) -> None:
        conn = self._conns.get(fd)
        if conn is not None:
            self._finish(conn, STATUS_TOO_SLOW)

    def _finish_all(self) -> None:
        for conn in list(self._conns.values()):
            self._finish(conn, None)

    def _step(self, conn: _FdConn, events: int) -> None:
        """Advance one connection: read its request, or send more of its reply."""
        try:
            if conn.out:
                self._send_more(conn)
                return
            if events & select.POLLIN or events & (select.POLLHUP | select.POLLERR):
                status = conn.read_request(self._token)
                if status is None:
                    return  # wait for more bytes
                if status == _HUNG_UP:
                    self._finish(conn, None)  # nobody to tell
                    return
                if status != STATUS_OK:
                    self._finish(conn, status)
                    return
                conn.out = [(bytes([STATUS_OK]) + _COUNT.pack(len(self._fds)), [])]
                for i in range(0, len(self._fds), FDS_PER_MESSAGE):
                    conn.out.append((b"F", list(self._fds[i : i + FDS_PER_MESSAGE])))
                self._send_more(conn)
        except OSError:
            self._finish(conn, None)

    def _send_more(self, conn: _FdConn) -> None:
        while conn.out:
            data, fds = conn.out[0]
            try:
                sent = socket.send_fds(conn.sock, [data], fds) if fds else conn.sock.send(data)
            except BlockingIOError:
                assert self._loop is not None
                self._loop.modify(conn.fd, conn, select.POLLOUT)
                return
            if sent < len(data):
                conn.out[0] = (data[sent:], [])  # the fds went with the first byte
            else:
                conn.out.pop(0)
        self._finish(conn, None)

    def _finish(self, conn: _FdConn, status: int | None) -> None:
        """Forget a connection, tell it ``status`` (if any) and close it."""
        self._admission.remove(conn.fd)
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
        if self._loop is not None:
            self._loop.forget(conn.fd, conn)
        if status is None:
            conn.sock.close()
        else:
            _refuse_now(conn.sock, status)

    # -- teardown --------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, unlink the socket and remove the directory made for it.

        Idempotent; never raises (failures warn with :class:`TeardownWarning`).
        The served fds are not closed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._loop is not None:
            self._loop.stop()  # joins the serving thread, closes the socket
        elif self._sock is not None:
            self._sock.close()
        self._sock = None
        if self._finalizer is not None:
            self._finalizer()  # runs _remove_files once
        else:
            _remove_files(None, None, self._dir)
        self._dir = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<FdServer {self.path!r} fds={len(self._fds)} {state}>"
