"""Moving file descriptors between processes on one machine.

Two transports carry the POSIX fds that back a pool's slots from the exporter
to a peer:

``pidfd``
    The peer takes a copy of the exporter's fd directly with ``pidfd_open`` +
    ``pidfd_getfd`` (Linux >= 5.6).  No cooperation from the exporter is needed,
    but the kernel applies a ptrace access check: it fails with ``EPERM`` under
    Yama ``ptrace_scope`` >= 1 (non-descendants), across uids, or in a container
    without ``CAP_SYS_PTRACE``.
``socket``
    The exporter runs an :class:`FdServer` on a Unix socket and passes the fds
    with ``SCM_RIGHTS``.  Works wherever both processes see the socket file.

:func:`fetch_fds` picks one (``method="auto"`` tries ``pidfd`` first and falls
back to the socket on ``EPERM``/``ENOSYS``).

Socket protocol (all integers big-endian)::

    request   b"FDS1" | u8 token_len (<= 64) | token
    refusal   u8 status (1 = uid refused, 2 = bad token, 3 = bad request,
              4 = too many connections from this uid, 5 = too slow), then close
    reply     u8 status (0) | u32 count, then ceil(count / 250) one-byte messages
              b"F", each carrying up to 250 fds in one SCM_RIGHTS message

The client checks who serves the socket (``SO_PEERCRED``) before it sends the
token; the server checks the client's uid as soon as it accepts, before it
reads anything.  One thread serves every connection without blocking, each
with one overall deadline, at most :data:`MAX_PENDING_PER_UID` per uid.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hmac
import os
import platform
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType

from cupy_ipcpool._errors import PeerRefusedError, TeardownWarning, TransportError
from cupy_ipcpool._handles import own_pid_namespace

__all__ = [
    "Admission",
    "FdServer",
    "bind_unix",
    "check_peer",
    "connect_unix",
    "fetch_fds",
    "fetch_fds_over_socket",
    "peer_credentials",
    "pidfd_getfd",
    "process_start_time",
    "recv_fds",
    "send_fds",
]

#: Request magic of the socket protocol, version 1.
MAGIC = b"FDS1"
#: Longest token the socket protocol accepts.
MAX_TOKEN_LEN = 64
#: Most fds sent in one SCM_RIGHTS message (the kernel's SCM_MAX_FD is 253).
FDS_PER_MESSAGE = 250
#: Kernel limit on fds in one SCM_RIGHTS message.
SCM_MAX_FD = 253
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
#: Most connections of one uid the server serves at once; a further one makes
#: the oldest of that uid go (it is told ``STATUS_BUSY``).
MAX_PENDING_PER_UID = 8
#: Listen backlog of the server.
LISTEN_BACKLOG = 512

_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438, "arm64": 438}
_COUNT = struct.Struct("!I")
_CRED = struct.Struct("3i")
_INT = struct.Struct("i")

# The raw pidfd_getfd(pidfd, targetfd, flags) call, made once by _getfd_syscall().
_getfd_call: Callable[[int, int], int] | None = None


def _errname(err: int) -> str:
    return errno.errorcode.get(err, str(err))


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
    ValueError
        Too many fds, or fds without data.
    OSError
        From the socket.
    """
    fds = [int(fd) for fd in fds]
    if len(fds) > SCM_MAX_FD:
        raise ValueError(f"at most {SCM_MAX_FD} fds fit in one SCM_RIGHTS message, got {len(fds)}")
    if fds and not data:
        raise ValueError("fds need at least one byte of data to travel with")
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


class Admission:
    """Connections waiting for something (a handshake, a request), per uid, each with a deadline.

    A pure state machine (no I/O, no clock: the caller passes ``now``).  At most
    ``per_uid`` connections of one uid wait at once: admitting one more makes
    the oldest of that uid go, so an idle or hostile client of one uid can
    never keep out a client of another uid, and keeps out a fresh client of its
    own uid only for as long as that client is slower than the idle ones.

    Parameters
    ----------
    per_uid:
        Most waiting connections per uid (at least 1).
    timeout:
        Seconds each connection may wait, from admission.

    Notes
    -----
    Keys are fds; remove a key before its fd is closed, so a recycled fd
    number is never confused with it.
    """

    def __init__(self, per_uid: int, timeout: float) -> None:
        if per_uid < 1:
            raise ValueError(f"per_uid must be at least 1, not {per_uid}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        self.per_uid = int(per_uid)
        self.timeout = float(timeout)
        self._entries: dict[int, tuple[int, float]] = {}  # key -> (uid, deadline), by age
        self._by_uid: dict[int, dict[int, None]] = {}

    def admit(self, key: int, uid: int, now: float) -> list[int]:
        """Admit ``key`` for ``uid``; return the keys that must go to make room (oldest first).

        Raises
        ------
        ValueError
            ``key`` is already admitted.
        """
        if key in self._entries:
            raise ValueError(f"{key!r} is already admitted")
        same = self._by_uid.setdefault(uid, {})
        evicted: list[int] = []
        while len(same) >= self.per_uid:
            oldest = next(iter(same))
            self.remove(oldest)
            evicted.append(oldest)
        same = self._by_uid.setdefault(uid, {})
        same[key] = None
        self._entries[key] = (uid, now + self.timeout)
        return evicted

    def remove(self, key: int) -> bool:
        """Forget ``key``; True if it was admitted."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        same = self._by_uid[entry[0]]
        del same[key]
        if not same:
            del self._by_uid[entry[0]]
        return True

    def expired(self, now: float) -> list[int]:
        """Remove and return the keys whose deadline has passed (oldest first)."""
        out = []
        for key, (_uid, deadline) in self._entries.items():
            if deadline > now:
                break  # admitted in order with one timeout: deadlines increase
            out.append(key)
        for key in out:
            self.remove(key)
        return out

    def next_deadline(self) -> float | None:
        """Return the earliest deadline (None when nothing waits)."""
        for _uid, deadline in self._entries.values():
            return deadline
        return None

    def count(self, uid: int | None = None) -> int:
        """Return how many connections wait (of ``uid``, or in all)."""
        if uid is None:
            return len(self._entries)
        return len(self._by_uid.get(uid, ()))

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


def bind_unix(sock: socket.socket, address: str, mode: int) -> tuple[int, int]:
    """Bind ``sock`` at ``address`` so that the file never exists with a wider mode than ``mode``.

    The socket is bound inside a fresh 0700 directory (``mkdtemp``) next to
    ``address``, chmod-ed to ``mode``, then hard-linked into place (renamed
    where the file system has no hard links); ``EADDRINUSE`` if someone took
    the path meanwhile.  When that temporary path would not fit ``sun_path``,
    the socket's mode is set with ``fchmod`` before binding it in place
    (Linux applies it to the new file).  The process umask is never changed.

    Returns
    -------
    tuple[int, int]
        ``(st_dev, st_ino)`` of the bound file, to recognise it at teardown.

    Raises
    ------
    TransportError
        ``EADDRINUSE`` when the path exists; the errno of a failing call
        otherwise.
    """
    parent = os.path.dirname(os.path.abspath(address))
    try:
        tmpdir = tempfile.mkdtemp(prefix=".ipcp", dir=parent)
    except OSError as exc:
        raise TransportError(
            exc.errno or errno.EIO, f"cannot create a directory next to {address}: {exc.strerror}"
        ) from None
    try:
        tmp = os.path.join(tmpdir, "s")
        if len(os.fsencode(tmp)) >= 108:
            os.fchmod(sock.fileno(), mode)
            _bind_or_raise(sock, address)
            os.chmod(address, mode)
        else:
            _bind_or_raise(sock, tmp)
            os.chmod(tmp, mode)
            try:
                os.link(tmp, address)
            except FileExistsError:
                raise TransportError(
                    errno.EADDRINUSE, f"{address} was created by someone else while binding"
                ) from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise TransportError(
                        exc.errno or errno.EIO, f"cannot create {address}: {exc.strerror}"
                    ) from None
                # No hard links on this file system: move it into place instead.
                if os.path.lexists(address):
                    raise TransportError(
                        errno.EADDRINUSE, f"{address} was created by someone else while binding"
                    ) from None
                os.rename(tmp, address)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        st = os.lstat(address)
        return st.st_dev, st.st_ino
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(tmpdir)


def _bind_or_raise(sock: socket.socket, path: str) -> None:
    try:
        sock.bind(path)
    except OSError as exc:
        err = exc.errno or errno.EIO
        if err == errno.EADDRINUSE:
            raise TransportError(err, f"{path} exists; remove it or choose another path") from None
        raise TransportError(err, f"cannot bind a socket at {path}: {exc.strerror}") from None


def _check_token(token: bytes) -> bytes:
    if not isinstance(token, (bytes, bytearray)):
        raise TypeError(f"token must be bytes, not {type(token).__name__}")
    if len(token) > MAX_TOKEN_LEN:
        raise ValueError(f"token is {len(token)} bytes; at most {MAX_TOKEN_LEN} allowed")
    return bytes(token)


def _remove_files(path: str | None, ino: tuple[int, int] | None, directory: str | None) -> None:
    """Unlink the server's socket (if it is still ours) and remove its directory."""
    if path is not None and ino is not None:
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
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


def _ms_until(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000.0) + 1)


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

        Raises
        ------
        EOFError
            The client hung up before its request was complete.
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
                raise EOFError
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


class FdServer:
    """Serve a fixed list of fds over a Unix socket with ``SCM_RIGHTS``.

    The exporter side of the socket transport.  One daemon thread serves every
    connection without blocking on any: the client's uid is checked as soon as
    it is accepted (a refused uid is told so and closed, nothing is read from
    it), each connection has one overall deadline of
    :data:`REQUEST_TIMEOUT_S`, and at most :data:`MAX_PENDING_PER_UID`
    connections of one uid are served at once (one more makes the oldest of
    that uid go).  A slow, idle or malformed client never delays another.

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
            raise ValueError(f"fds must be non-negative, got {self._fds}")
        self._token = _check_token(token)
        euid = os.geteuid()
        allowed = {euid} if allowed_uids is None else {int(u) for u in allowed_uids} | {euid}
        self.allowed_uids: frozenset[int] = frozenset(allowed)
        shared = self.allowed_uids != {euid}
        self._closed = False
        self._lock = threading.Lock()
        self._admission = Admission(MAX_PENDING_PER_UID, REQUEST_TIMEOUT_S)
        self._conns: dict[int, _FdConn] = {}  # owned by the serving thread
        self._dir: str | None = None
        self._sock: socket.socket | None = None
        self._wake_r = self._wake_w = -1
        self._ino: tuple[int, int] | None = None
        self._finalizer: weakref.finalize[..., FdServer] | None = None
        self._thread: threading.Thread | None = None
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
            self._sock.listen(LISTEN_BACKLOG)
            self._sock.setblocking(False)
            self._wake_r, self._wake_w = os.pipe()
            self._thread = threading.Thread(
                target=self._serve_loop, name=f"cupy_ipcpool-FdServer({self.path})", daemon=True
            )
            self._thread.start()
        except BaseException:
            self._teardown()
            raise

    def _bind(self, shared: bool) -> None:
        assert self._sock is not None
        mode = 0o666 if shared else 0o600
        if self._dir is not None:
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
            self._ino = bind_unix(self._sock, self.path, mode)

    # -- serving ---------------------------------------------------------------

    def _serve_loop(self) -> None:
        """Accept, read requests and send replies for every client, never blocking on one."""
        assert self._sock is not None
        listener = self._sock
        poller = select.poll()
        poller.register(listener.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        admission = self._admission
        conns = self._conns
        try:
            while not self._closed:
                deadline = admission.next_deadline()
                timeout = -1 if deadline is None else _ms_until(deadline)
                try:
                    events = poller.poll(timeout)
                except InterruptedError:
                    continue
                if self._closed:
                    return
                for fd, ev in events:
                    if fd == self._wake_r:
                        return
                    if fd == listener.fileno():
                        self._accept_all(listener, poller)
                        continue
                    conn = conns.get(fd)
                    if conn is not None:
                        self._step(conn, ev, poller)
                for fd in admission.expired(time.monotonic()):
                    conn = conns.get(fd)
                    if conn is not None:
                        self._finish(conn, poller, STATUS_TOO_SLOW)
        finally:
            for conn in list(conns.values()):
                self._finish(conn, poller, None)

    def _accept_all(self, listener: socket.socket, poller: select.poll) -> None:
        for _ in range(64):  # then let the other connections have a turn
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.01)  # out of fds: do not spin on the queued connection
                return
            sock.setblocking(False)
            try:
                _pid, uid, _gid = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            if uid not in self.allowed_uids:
                _refuse_now(sock, STATUS_UID_REFUSED)  # costs nothing: nothing is read or kept
                continue
            conn = _FdConn(sock, uid)
            for fd in self._admission.admit(conn.fd, uid, time.monotonic()):
                old = self._conns.get(fd)
                if old is not None:
                    self._finish(old, poller, STATUS_BUSY)
            self._conns[conn.fd] = conn
            poller.register(conn.fd, select.POLLIN)
            self._step(conn, select.POLLIN, poller)

    def _step(self, conn: _FdConn, events: int, poller: select.poll) -> None:
        """Advance one connection: read its request, or send more of its reply."""
        try:
            if conn.out:
                self._send_more(conn, poller)
                return
            if events & select.POLLIN or events & (select.POLLHUP | select.POLLERR):
                status = conn.read_request(self._token)
                if status is None:
                    return  # wait for more bytes
                if status != STATUS_OK:
                    self._finish(conn, poller, status)
                    return
                conn.out = [(bytes([STATUS_OK]) + _COUNT.pack(len(self._fds)), [])]
                for i in range(0, len(self._fds), FDS_PER_MESSAGE):
                    conn.out.append((b"F", list(self._fds[i : i + FDS_PER_MESSAGE])))
                self._send_more(conn, poller)
        except (EOFError, OSError):
            self._finish(conn, poller, None)

    def _send_more(self, conn: _FdConn, poller: select.poll) -> None:
        while conn.out:
            data, fds = conn.out[0]
            try:
                sent = socket.send_fds(conn.sock, [data], fds) if fds else conn.sock.send(data)
            except BlockingIOError:
                poller.modify(conn.fd, select.POLLOUT)
                return
            if sent < len(data):
                conn.out[0] = (data[sent:], [])  # the fds went with the first byte
            else:
                conn.out.pop(0)
        self._finish(conn, poller, None)

    def _finish(self, conn: _FdConn, poller: select.poll, status: int | None) -> None:
        """Forget a connection, tell it ``status`` (if any) and close it."""
        self._admission.remove(conn.fd)
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
            with contextlib.suppress(KeyError, ValueError, OSError):
                poller.unregister(conn.fd)
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
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
            if thread.is_alive():
                warnings.warn(
                    f"FdServer({self.path}): serving thread did not stop", TeardownWarning, 2
                )
        self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._finalizer is not None:
            self._finalizer()  # runs _remove_files once
        else:
            _remove_files(None, None, self._dir)
        self._dir = None

    def __enter__(self) -> FdServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<FdServer {self.path!r} fds={len(self._fds)} {state}>"


# -- client --------------------------------------------------------------------


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
        ``ETIMEDOUT``; ``EBUSY``: the server is serving too many connections
        of this uid; ``EPROTO``: the reply was malformed or had the wrong
        number of fds.
    """
    token = _check_token(token)
    count = int(count)
    if not 0 <= count <= MAX_FDS_PER_REPLY:
        raise ValueError(f"count must be in [0, {MAX_FDS_PER_REPLY}], got {count}")
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
            status = _recv_reply(sock, 1, deadline, fds)[0]
            if status != STATUS_OK:
                raise _refusal(status, path)
            (announced,) = _COUNT.unpack(_recv_reply(sock, _COUNT.size, deadline, fds))
            if announced != count:
                raise TransportError(
                    errno.EPROTO,
                    f"fd server {path} serves {announced} fds, expected {count} "
                    "(descriptor from a different pool?)",
                )
            nmsg = -(-count // FDS_PER_MESSAGE)
            _recv_reply(sock, nmsg, deadline, fds)
            if len(fds) != count:
                raise TransportError(
                    errno.EPROTO, f"fd server {path} sent {len(fds)} fds, expected {count}"
                )
            return fds
        except BaseException as exc:
            _close_all(fds)
            if isinstance(exc, TimeoutError):
                raise TransportError(
                    errno.ETIMEDOUT, f"fd server {path} did not answer within {timeout} s"
                ) from None
            if isinstance(exc, EOFError):
                raise TransportError(
                    errno.ECONNRESET,
                    f"fd server {path} closed the connection mid-reply (exporter exiting?)",
                ) from None
            if isinstance(exc, OSError) and not isinstance(exc, TransportError):
                err = exc.errno or errno.EIO
                raise TransportError(
                    err, f"fd server {path}: {_errname(err)}: {exc.strerror}"
                ) from exc
            raise


def connect_unix(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect ``sock`` to ``path``, retrying while the listen backlog is full (``EAGAIN``).

    Raises
    ------
    TimeoutError
        The backlog stayed full until ``deadline``.
    OSError
        Any other failure of ``connect``.
    """
    delay = 0.001
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(errno.ETIMEDOUT, "the listen backlog stayed full")
        sock.settimeout(remaining)
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


def _recv_reply(sock: socket.socket, n: int, deadline: float, fds: list[int]) -> bytes:
    """Read exactly ``n`` bytes, appending every fd that arrives to ``fds``."""
    buf = b""
    reset = False
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
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
            raise EOFError
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
        err = errno.ETIMEDOUT
        msg = f"connecting to fd server {path} timed out"
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
        return TransportError(
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
    ValueError
        Unknown ``method``.
    TransportError
        As :func:`pidfd_getfd` or :func:`fetch_fds_over_socket`.  When
        ``"auto"`` fell back and the socket failed too, the error is the
        socket's (its type and errno), its message says why each transport
        failed and what to do, and it is chained to the pidfd error.  ``ESRCH``
        when the exporter's pid is of another PID namespace and no socket is
        offered (``"pidfd"``, or a descriptor without a socket path).
    """
    if method not in ("auto", "pidfd", "socket"):
        raise ValueError(f'method must be "auto", "pidfd" or "socket", got {method!r}')
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
