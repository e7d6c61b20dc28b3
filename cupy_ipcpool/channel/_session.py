"""Publish/subscribe sessions over a Unix ``SOCK_SEQPACKET`` socket, without the GPU parts.

:class:`PublisherCore` listens on a filesystem path, welcomes subscribers
(handshakes on a daemon thread), hands out free slots, publishes frames and
collects leases back; :class:`SubscriberCore` connects, receives frames and
releases them.  The GPU layer wraps both: it fills the opaque payloads (event
handles, pool descriptor, array handles) and provides the slot fds.

Limits that keep any client, honest or hostile, from locking others out: a
connection's uid is checked before anything it sent is read; handshakes run
concurrently, each with one deadline (:data:`HANDSHAKE_TIMEOUT`), at most
:data:`MAX_PENDING_PER_UID` per uid; every resource taken for a subscriber
comes back however its connection ends; a ``"latest"`` subscriber's credit is
capped so that it never makes the producer wait; an optional lease timeout
evicts a subscriber that holds a frame too long.

Hot path (``acquire``/``publish``/``poll`` on the producer, ``recv``/``release``
on the consumer): the caller's thread, one ``send``/``recv`` per message,
fixed layouts, ``poll(2)`` for waiting; no pickle, no sleeps, no thread
hand-off.  The socket work of each step is one call into the compiled
:mod:`._frameio` (``recv_frame``, ``release_frame``, ``send_frame``,
``wait_releases``); everything it hands back that is not a well-formed FRAME
or RELEASE is decoded and judged here.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import math
import os
import select
import socket
import stat
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

from .._errors import (
    ChannelTimeoutError,
    EndOfStream,
    EvictedError,
    PeerRefusedError,
    PoolClosedError,
    ProtocolError,
    SlotBusyError,
    TeardownWarning,
    TransportError,
    UsageError,
)
from .._transport import Admission, bind_unix, connect_unix, peer_credentials
from . import _protocol as proto
from ._leases import LeaseBook
from ._protocol import Frame

if TYPE_CHECKING:  # imported at the first session (_load_frameio)
    from ._frameio import pollfds, recv_frame, release_frame, send_frame, wait_releases

#: Seconds a connecting peer has, from accept, to send its HELLO.
HANDSHAKE_TIMEOUT = 5.0
#: Most handshakes of one uid in progress at once; one more makes the oldest go.
MAX_PENDING_PER_UID = 8
#: Most fds one SCM_RIGHTS message carries on Linux (``SCM_MAX_FD``).
MAX_FDS = 253
#: Default credit of a ``"block"`` subscriber (informational; the ring bounds it).
DEFAULT_BLOCK_CREDIT = 64

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_POLLRDHUP = select.POLLRDHUP
_DONTWAIT = socket.MSG_DONTWAIT
#: Longest busy-poll a ``spin_us`` argument may ask for (10 ms).
MAX_SPIN_US = 10_000
_INT_SIZE = struct.calcsize("i")
_FRAME_HEAD_SIZE = proto.MAX_FRAME_SIZE - proto.MAX_FRAME_PAYLOAD
#: Seconds between attempts to queue an eviction notice that did not fit (rare: see _drop).
_NOTICE_RETRY = 0.05
#: Most fds :meth:`SubscriberCore.watch` takes (the compiled poll set holds 16, the socket too).
_MAX_WATCHED = 15

# The compiled per-frame calls (channel/_frameio.c) read and write FRAME and RELEASE
# datagrams themselves: a build that disagrees is refused.
_PROTOCOL = (
    proto.MAGIC,
    proto.VERSION,
    proto.FRAME,
    proto.RELEASE,
    _FRAME_HEAD_SIZE,
    proto.MAX_RELEASE_SIZE,
    proto.MAX_FRAME_PAYLOAD,
)


def _load_frameio() -> None:
    """Import the compiled calls into this module's namespace (at the first session).

    Not at import time: ``import cupy_ipcpool`` (and ``python -m cupy_ipcpool
    info``, which reports a missing build) works without them.

    Raises
    ------
    ImportError
        The extension is not built, or was built for another protocol.
    """
    global pollfds, recv_frame, release_frame, send_frame, wait_releases
    if "recv_frame" in globals():
        return
    from .._compiled import load

    _frameio = load("cupy_ipcpool.channel._frameio", PROTOCOL=_PROTOCOL)
    pollfds, recv_frame, release_frame = (
        _frameio.pollfds,
        _frameio.recv_frame,
        _frameio.release_frame,
    )
    send_frame, wait_releases = _frameio.send_frame, _frameio.wait_releases


def _spin_ns(spin_us: float) -> int:
    """Validate a ``spin_us`` argument; return it in nanoseconds."""
    if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)):
        raise UsageError(f"spin_us must be a number of microseconds, not {spin_us!r}")
    if not 0 <= spin_us <= MAX_SPIN_US:
        raise UsageError(f"spin_us must be in 0..{MAX_SPIN_US}, got {spin_us}")
    return int(spin_us * 1000)


def _ms(timeout: float | None) -> int:
    """Convert seconds (None = forever) to a ``poll(2)`` timeout in milliseconds."""
    if timeout is None:
        return -1
    return max(0, math.ceil(timeout * 1000.0))


def _warn(message: str) -> None:
    warnings.warn(message, TeardownWarning, stacklevel=3)


@dataclass(frozen=True)
class SubscriberInfo:
    """What the producer knows about one subscriber.

    Attributes
    ----------
    sub_id:
        Id assigned by the producer (unique for the publisher's lifetime).
    pid:
        The subscriber's pid from ``SO_PEERCRED`` (the pid it claimed in HELLO
        when the kernel reports 0, e.g. across pid namespaces).
    uid:
        The subscriber's uid from ``SO_PEERCRED``.
    mode:
        ``"block"`` or ``"latest"``.
    credit:
        Most frames it holds at once (enforced for ``"latest"``): the credit
        it asked for, capped at the publisher's ``max_credit``.
    hello:
        The opaque HELLO payload (the GPU layer's event handles).
    """

    sub_id: int
    pid: int
    uid: int
    mode: str
    credit: int
    hello: bytes = b""


class _Conn:
    """Producer-side state of one welcomed subscriber."""

    __slots__ = ("fd", "info", "sock")

    def __init__(self, info: SubscriberInfo, sock: socket.socket) -> None:
        self.info = info
        self.sock = sock
        self.fd = sock.fileno()


# -- binding -------------------------------------------------------------------


def _remove_stale(address: str) -> None:
    """Unlink ``address`` if it is a socket nobody listens on; refuse a live one."""
    try:
        st = os.lstat(address)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportError(
            errno.EEXIST, f"{address} exists and is not a socket; remove it or choose another path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.settimeout(1.0)
        probe.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # stale: nothing listens there
    except TimeoutError:
        raise TransportError(
            errno.EADDRINUSE,
            f"a publisher is already listening at {address} (its backlog is full); "
            "close it or choose another address",
        ) from None
    except OSError as exc:
        raise TransportError(
            exc.errno or errno.EADDRINUSE,
            f"cannot tell whether {address} is in use ({exc}); remove it or choose another path",
        ) from None
    else:
        raise TransportError(
            errno.EADDRINUSE,
            f"a publisher is already listening at {address}; close it or choose another address",
        )
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)


# -- accept thread -----------------------------------------------------------------


class _Handshake:
    """A connection accepted and not yet welcomed (owned by the accept thread)."""

    __slots__ = ("fd", "pid", "sock", "uid")

    def __init__(self, sock: socket.socket, pid: int, uid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.pid = pid
        self.uid = uid


class _Acceptor:
    """The listening socket and the daemon thread that welcomes subscribers.

    One thread drives every handshake without blocking on any: a connection's
    uid is checked as soon as it is accepted (a refused uid is told so and
    closed; nothing it sent is looked at), every handshake has one deadline
    (``handshake_timeout`` from accept), and at most ``max_pending_per_uid``
    handshakes of one uid are in progress (one more makes the oldest of that
    uid go).  Welcomed subscribers wait in ``pending`` for the producer to adopt
    them; one that hangs up meanwhile is reaped here, and ``on_abandon`` gives
    its resources back.

    Shared with the producer's thread: ``pending`` and ``count`` under ``lock``;
    ``next_seq`` is written by the producer only.
    """

    def __init__(
        self,
        listener: socket.socket,
        num_slots: int,
        welcome: Callable[[SubscriberInfo], tuple[bytes, list[int]]],
        allowed_uids: frozenset[int],
        max_subscribers: int,
        *,
        on_abandon: Callable[[SubscriberInfo], object] | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending_per_uid: int = MAX_PENDING_PER_UID,
        max_credit: int = proto.MAX_CREDIT,
        lease_timeout_ms: int = 0,
    ) -> None:
        self.listener = listener
        self.num_slots = num_slots
        self.welcome = welcome
        self.allowed_uids = allowed_uids
        self.max_subscribers = max_subscribers
        self.on_abandon = on_abandon
        self.handshake_timeout = handshake_timeout
        self.max_credit = max_credit
        self.lease_timeout_ms = lease_timeout_ms
        self.lock = threading.Lock()
        self.pending: list[_Conn] = []
        self.count = 0  # welcomed and not yet dropped (pending + adopted)
        self.next_seq = 0
        self.stopping = False
        self.abandoned = 0  # welcomed subscribers given back before adoption
        self._next_id = 1
        self._admission = Admission(max_pending_per_uid, handshake_timeout)
        self._handshakes: dict[int, _Handshake] = {}
        self._watch: dict[int, _Conn] = {}  # pending connections watched for a hang-up
        self._poller = select.poll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.thread = threading.Thread(target=self._run, name="ipcpool-accept", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Wake and join the thread, close the listener and every pending connection."""
        self.stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(5.0)
            if self.thread.is_alive():
                _warn("ipcpool accept thread did not stop in time")
        self.listener.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        with self.lock:
            pending, self.pending = self.pending, []
        for conn in pending:
            _say_bye_and_close(conn.sock)

    def adopted(self) -> None:
        """The producer took the pending list: stop watching those connections.

        A socket in another thread's ``poll`` set stays open in the kernel
        until that ``poll`` returns, even once closed: without this wake-up a
        subscriber the producer drops would not see the end until the accept
        thread next woke.
        """
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"a")

    def pending_handshakes(self, uid: int | None = None) -> int:
        """Handshakes in progress (of ``uid``, or in all); for tests and diagnostics."""
        return self._admission.count(uid)

    # -- the thread --

    def _run(self) -> None:
        poller = self._poller
        poller.register(self.listener, _POLLIN)
        poller.register(self._wake_r, _POLLIN)
        listen_fd = self.listener.fileno()
        admission = self._admission
        try:
            while not self.stopping:
                deadline = admission.next_deadline()
                timeout = -1 if deadline is None else _ms(deadline - time.monotonic())
                try:
                    events = poller.poll(timeout)
                except OSError:
                    return
                if self.stopping:
                    return
                for fd, _ev in events:
                    if fd == listen_fd:
                        self._accept_all()
                    elif fd in self._handshakes:
                        self._on_hello(self._handshakes[fd])
                    elif fd in self._watch:
                        self._on_hangup(fd)
                    elif fd == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                        if self.stopping:
                            return
                        self._unwatch_adopted()
                for fd in admission.expired(time.monotonic()):
                    hs = self._handshakes.pop(fd)
                    self._unregister(hs.fd)
                    _refuse(hs.sock, f"no HELLO within {self.handshake_timeout} s")
        except Exception as exc:  # pragma: no cover - a bug; say so instead of dying silently
            with contextlib.suppress(Exception):
                _warn(f"ipcpool accept thread failed: {exc!r}")
        finally:
            for hs in list(self._handshakes.values()):
                hs.sock.close()
            self._handshakes.clear()
            self._watch.clear()

    def _unwatch_adopted(self) -> None:
        with self.lock:
            ours = {id(c) for c in self.pending}
        for fd, c in list(self._watch.items()):
            if id(c) not in ours:
                del self._watch[fd]
                self._unregister(fd)

    def _unregister(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._poller.unregister(fd)

    def _accept_all(self) -> None:
        for _ in range(64):  # then let the handshakes in progress have a turn
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of fds: back off instead of spinning on the queued connection.
                    select.select([self._wake_r], [], [], 0.05)
                return
            conn.setblocking(False)
            try:
                pid, uid, _gid = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if uid not in self.allowed_uids:
                _refuse(conn, f"uid {uid} is not allowed to subscribe")
                continue
            fd = conn.fileno()
            stale = self._watch.pop(fd, None)  # the fd number of an adopted, closed connection
            if stale is not None:
                self._unregister(fd)
            for old in self._admission.admit(fd, uid, time.monotonic()):
                hs = self._handshakes.pop(old)
                self._unregister(hs.fd)
                _refuse(
                    hs.sock,
                    f"{self._admission.per_uid} handshakes of uid {uid} were in progress; "
                    "this one, the oldest, made room for a newer one",
                )
            hs = _Handshake(conn, pid, uid)
            self._handshakes[fd] = hs
            self._poller.register(fd, _POLLIN)
            self._on_hello(hs)  # the HELLO is often there already

    def _on_hello(self, hs: _Handshake) -> None:
        conn = hs.sock
        try:
            data = conn.recv(proto.MAX_HELLO_SIZE + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self._admission.remove(hs.fd)
        del self._handshakes[hs.fd]
        self._unregister(hs.fd)
        if not data or self.stopping:
            conn.close()
            return
        self._welcome(conn, hs, data)

    def _welcome(self, conn: socket.socket, hs: _Handshake, data: bytes) -> None:
        with self.lock:
            full = self.count >= self.max_subscribers
        if full:
            _refuse(conn, f"the publisher already has max_subscribers={self.max_subscribers}")
            return
        try:
            hello = proto.decode(data)
            if not isinstance(hello, proto.Hello):
                raise ProtocolError(f"expected HELLO, got {type(hello).__name__}")
        except ProtocolError as exc:
            _refuse(conn, f"bad HELLO: {exc}")
            return
        sub_id = self._next_id
        self._next_id += 1
        info = SubscriberInfo(
            sub_id=sub_id,
            pid=hs.pid or hello.pid,
            uid=hs.uid,
            mode=proto.MODE_NAMES[hello.mode],
            credit=max(1, min(hello.credit, self.max_credit)),
            hello=hello.payload,
        )
        try:
            payload, fds = self.welcome(info)
        except Exception as exc:
            _refuse(conn, f"the publisher could not welcome this subscriber: {exc}")
            return
        # From here on the welcome callback holds resources for this subscriber:
        # every way out that does not hand it to the producer gives them back.
        try:
            if len(fds) > MAX_FDS:
                raise UsageError(f"{len(fds)} fds do not fit one message (at most {MAX_FDS})")
            msg = proto.encode_welcome(
                sub_id,
                self.num_slots,
                self.next_seq,
                payload,
                credit=info.credit,
                lease_timeout_ms=self.lease_timeout_ms,
            )
        except Exception as exc:
            _refuse(conn, f"the publisher could not welcome this subscriber: {exc}")
            self._abandon(info)
            return
        need = len(msg) + 4096
        with contextlib.suppress(OSError):
            if conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < need:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, need)
        with self.lock:
            self.count += 1
        try:
            if fds:
                socket.send_fds(conn, [msg], list(fds), socket.MSG_DONTWAIT)
            else:
                conn.send(msg, socket.MSG_DONTWAIT)
        except OSError as exc:
            with self.lock:
                self.count -= 1
            if exc.errno == errno.EMSGSIZE:
                _refuse(
                    conn,
                    f"the WELCOME ({len(msg)} bytes) exceeds the socket buffer limit; "
                    "raise net.core.wmem_max or send a smaller welcome payload",
                )
            else:
                conn.close()  # hung up (or timed out and left) before the WELCOME
            self._abandon(info)
            return
        c = _Conn(info, conn)
        with self.lock:
            stop = self.stopping
            if stop:
                self.count -= 1
            else:
                self.pending.append(c)
        if stop:
            _say_bye_and_close(conn)
            self._abandon(info)
            return
        self._watch[c.fd] = c
        self._poller.register(c.fd, _POLLRDHUP)

    def _on_hangup(self, fd: int) -> None:
        """A pending connection hung up (or was adopted and then closed): reap it if still ours."""
        c = self._watch.pop(fd)
        self._unregister(fd)
        with self.lock:
            for i, other in enumerate(self.pending):
                if other is c:
                    del self.pending[i]
                    self.count -= 1
                    break
            else:
                return  # adopted by the producer meanwhile: it sees the hang-up itself
        c.sock.close()
        self._abandon(c.info)

    def _abandon(self, info: SubscriberInfo) -> None:
        """Give back what ``welcome`` took for a subscriber that will never be adopted."""
        self.abandoned += 1
        if self.on_abandon is None:
            return
        try:
            self.on_abandon(info)
        except Exception as exc:
            with contextlib.suppress(Exception):
                warnings.warn(f"on_leave callback raised {exc!r}", RuntimeWarning, stacklevel=2)


def _refuse(conn: socket.socket, reason: str) -> None:
    """Send REFUSE and close, without waiting.

    What the peer sent so far is read first (without waiting): closing a Unix
    socket with unread data resets the peer, which would then never see the
    REFUSE.
    """
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        while conn.recv(proto.MAX_HELLO_SIZE + 1):
            pass
    with contextlib.suppress(OSError):
        conn.send(proto.encode_refuse(reason), socket.MSG_DONTWAIT)
    conn.close()


#: Errors of a send that mean the subscriber can no longer read what is queued for it.
_PEER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ECONNREFUSED, errno.ENOTCONN})
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # Linux; CAP_NET_ADMIN


def _queue_notice(sock: socket.socket, notice: bytes) -> bool:
    """Queue ``notice`` (a REFUSE) behind the frames already queued; False if it did not fit.

    True also when the subscriber can no longer read anything (its side is
    closed): then nothing queued will ever be handed out.  A full socket gets
    room for one more message by growing its send buffer (the kernel admits a
    message while the bytes queued are below the buffer size): within
    ``net.core.wmem_max`` first, then past it where the process may
    (``SO_SNDBUFFORCE``).
    """
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        while sock.recv(proto.MAX_FRAME_SIZE, socket.MSG_DONTWAIT):
            pass  # unread data would reset the peer, which would then lose the notice
    for grow in (0, socket.SO_SNDBUF, _SO_SNDBUFFORCE):
        if grow:
            with contextlib.suppress(OSError):
                size = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                sock.setsockopt(socket.SOL_SOCKET, grow, size)  # the kernel doubles it
        try:
            sock.send(notice, socket.MSG_DONTWAIT)
            return True
        except BlockingIOError:
            continue
        except OSError as exc:
            return exc.errno in _PEER_GONE
    return False


def _shut_and_close(sock: socket.socket) -> None:
    """Hang up at once (``shutdown``: the peer sees it even if the fd lives on), then close."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _say_bye_and_close(sock: socket.socket) -> None:
    # Drain what the peer sent first: closing with unread data resets the peer,
    # which would then lose the frames still queued for it and the BYE.
    with contextlib.suppress(OSError):
        sock.setblocking(False)  # with a timeout set, Python would wait before each call
        while sock.recv(proto.MAX_FRAME_SIZE, socket.MSG_DONTWAIT):
            pass
    with contextlib.suppress(OSError):
        sock.send(proto.encode_bye(), socket.MSG_DONTWAIT)
    sock.close()


def _linger(conns: list[_Conn], linger: float) -> bool:
    """Send BYE to each connection and wait up to ``linger`` s for all to hang up."""
    if not conns:
        return True
    poller = select.poll()
    waiting = {}
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.sock.setblocking(False)
            while conn.sock.recv(proto.MAX_FRAME_SIZE, socket.MSG_DONTWAIT):
                pass
        try:
            conn.sock.send(proto.encode_bye(), socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError:
            continue  # already gone
        waiting[conn.fd] = conn
        poller.register(conn.fd, _POLLIN)
    deadline = time.monotonic() + linger
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        for fd, _events in poller.poll(_ms(remaining)):
            conn = waiting[fd]
            try:
                while True:
                    data = conn.sock.recv(proto.MAX_FRAME_SIZE, socket.MSG_DONTWAIT)
                    if not data:
                        raise ConnectionResetError
            except BlockingIOError:
                continue
            except OSError:
                poller.unregister(fd)
                del waiting[fd]
    return True


def _close_publisher(
    acc: _Acceptor,
    conns: dict[int, _Conn],
    evicting: dict[int, tuple[_Conn, bytes]],
    address: str,
    ident: tuple[int, int],
) -> None:
    """Tear a publisher down (also its finalizer); warns instead of raising."""
    try:
        acc.stop()
    except Exception as exc:
        _warn(f"stopping the accept thread failed: {exc!r}")
    for conn in [*conns.values(), *(c for c, _notice in evicting.values())]:
        try:
            _say_bye_and_close(conn.sock)
        except Exception as exc:
            _warn(f"closing subscriber {conn.info.sub_id} failed: {exc!r}")
    conns.clear()
    evicting.clear()
    try:
        st = os.lstat(address)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(address)
    except FileNotFoundError:
        pass
    except OSError as exc:
        _warn(f"could not remove the socket file {address}: {exc}")


# -- publisher ---------------------------------------------------------------------


class PublisherCore:
    """The producer side of a channel: listen, welcome, lease slots, publish frames.

    Parameters
    ----------
    address:
        Filesystem path of the Unix socket.  A stale socket file (nobody
        listening) is replaced; a live one is refused.
    num_slots:
        Number of slots in the ring.
    welcome:
        Called on the accept thread for each new subscriber with its
        :class:`SubscriberInfo`; returns ``(payload, fds)`` for the WELCOME
        message.  The fds stay owned by the caller (the kernel duplicates them
        into the subscriber).  An exception refuses that subscriber.
    allowed_uids:
        Uids that may subscribe (``SO_PEERCRED``); default: this process's
        effective uid only, and the socket file is mode 0600.  When other uids
        are allowed the file is 0666 and the uid check alone decides.
    on_join, on_leave:
        Called in the producer's thread when a subscriber is adopted (at the
        next ``poll``/``acquire``/``publish``) and when it leaves (BYE, EOF,
        error, out-of-protocol message, eviction).  ``on_leave`` is also called
        for a subscriber that ``welcome`` accepted but that is never adopted
        (the WELCOME could not be sent, or it hung up before adoption): then
        on the accept thread, without an ``on_join`` before it, so that what
        ``welcome`` took is given back; it must be thread-safe.  Exceptions
        become ``RuntimeWarning``.
    max_subscribers:
        Further subscribers are refused.
    send_timeout:
        How long a ``"block"`` subscriber's full socket may stall ``publish``
        before that subscriber is dropped.
    max_credit:
        Cap on a subscriber's credit (default
        :func:`~cupy_ipcpool.channel._leases.default_max_credit`: ``num_slots - 2``, at
        least 1).  Together with the ring's reserve (``"latest"`` subscribers
        never lease the last two slots) it makes ``"latest"`` never stall the
        producer, whatever credit a subscriber asks for.
    lease_timeout:
        Seconds a subscriber may hold a frame; one that holds a frame longer
        is evicted (told why, disconnected, its leases taken back).  None (the
        default): no limit, a ``"block"`` subscriber that never releases
        stalls the producer until ``acquire`` times out.
    handshake_timeout:
        Seconds a connection has, from accept, to send its HELLO.
    max_pending_per_uid:
        Most handshakes of one uid in progress at once; one more makes the
        oldest of that uid go.
    spin_us:
        Microseconds :meth:`poll` with a timeout busy-polls the subscribers'
        sockets before it sleeps (default 0: no spin, no CPU while waiting).

    Notes
    -----
    Not thread-safe: call every method from one thread.  The accept thread only
    appends to a lock-protected pending list (and reaps entries that hang up).
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        num_slots: int,
        *,
        welcome: Callable[[SubscriberInfo], tuple[bytes, list[int]]],
        allowed_uids: Iterable[int] | None = None,
        on_join: Callable[[SubscriberInfo], object] | None = None,
        on_leave: Callable[[SubscriberInfo], object] | None = None,
        max_subscribers: int = 64,
        send_timeout: float = 5.0,
        max_credit: int | None = None,
        lease_timeout: float | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending_per_uid: int = MAX_PENDING_PER_UID,
        spin_us: float = 0.0,
    ) -> None:
        _load_frameio()
        self._spin_ns = _spin_ns(spin_us)
        self.address = os.fspath(address)
        self.num_slots = int(num_slots)
        if not 1 <= self.num_slots <= proto.MAX_SLOTS:
            raise UsageError(f"num_slots must be in 1..{proto.MAX_SLOTS}, not {num_slots}")
        if max_credit is not None and not 1 <= max_credit <= proto.MAX_CREDIT:
            raise UsageError(f"max_credit must be in 1..{proto.MAX_CREDIT}, not {max_credit}")
        if lease_timeout is not None and not 0 < lease_timeout < (1 << 32) / 1000:
            raise UsageError(f"lease_timeout must be positive seconds or None, not {lease_timeout}")
        if not handshake_timeout > 0:
            raise UsageError(f"handshake_timeout must be positive, not {handshake_timeout}")
        if max_subscribers < 1:
            raise UsageError(f"max_subscribers must be at least 1, not {max_subscribers}")
        self._book = LeaseBook(self.num_slots, max_credit=max_credit)
        self.max_credit = self._book.max_credit
        self.lease_timeout = lease_timeout
        self._next_expiry: float | None = None
        self._evictions = 0
        euid = os.geteuid()
        allowed = frozenset({euid} if allowed_uids is None else (int(u) for u in allowed_uids))
        self.allowed_uids = allowed
        self._on_join = on_join
        self._on_leave = on_leave
        self._send_timeout = send_timeout
        self._conns: dict[int, _Conn] = {}
        self._by_fd: dict[int, _Conn] = {}
        #: dropped subscribers whose notice did not fit their socket yet (keep their leases)
        self._evicting: dict[int, tuple[_Conn, bytes]] = {}
        #: the subscribers' sockets as the compiled wait_releases polls them
        self._poll_set = bytearray()
        self._last_slot = self.num_slots - 1
        self._closed = False
        self.last_leave_reason = ""

        _remove_stale(self.address)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ident = bind_unix(listener, self.address, 0o600 if allowed <= {euid} else 0o666)
            try:
                # Well above the subscriber limit: the accept thread drains the
                # queue at once, so only a burst ever sits in it.
                listener.listen(min(max(4 * max_subscribers, 256), socket.SOMAXCONN))
                listener.setblocking(False)
            except BaseException:
                os.unlink(self.address)
                raise
        except BaseException:
            listener.close()
            raise
        try:
            self._acc = _Acceptor(
                listener,
                self.num_slots,
                welcome,
                allowed,
                max_subscribers,
                on_abandon=on_leave,
                handshake_timeout=handshake_timeout,
                max_pending_per_uid=max_pending_per_uid,
                max_credit=self.max_credit,
                lease_timeout_ms=0 if lease_timeout is None else math.ceil(lease_timeout * 1000),
            )
        except BaseException:
            listener.close()
            os.unlink(self.address)
            raise
        self._finalizer = weakref.finalize(
            self, _close_publisher, self._acc, self._conns, self._evicting, self.address, ident
        )
        self._acc.start()

    # -- context manager / teardown --

    def __enter__(self) -> PublisherCore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self, linger: float = 0.0) -> bool:
        """Say BYE to every subscriber, close every socket, stop the accept thread.

        Parameters
        ----------
        linger:
            Seconds to wait, after the BYE, for every subscriber (adopted or
            still pending) to disconnect before the sockets are closed.

        Returns
        -------
        bool
            True when every subscriber had disconnected (always True with
            ``linger=0`` and no subscribers; False when some were still
            connected when the sockets were closed).

        Idempotent; never raises (problems become :class:`TeardownWarning`).
        """
        if self._closed:
            return True
        self._closed = True
        self._by_fd.clear()
        with self._acc.lock:
            pending, self._acc.pending = self._acc.pending, []
        for conn in pending:
            self._conns[conn.info.sub_id] = conn
        all_gone = _linger(list(self._conns.values()), linger)
        self._finalizer()
        return all_gone

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError(f"publisher at {self.address} is closed")

    # -- state --

    @property
    def subscribers(self) -> list[SubscriberInfo]:
        """The adopted subscribers."""
        return [conn.info for conn in self._conns.values()]

    @property
    def lease_book(self) -> LeaseBook:
        """The lease accounting (read it; mutate only through this class)."""
        return self._book

    @property
    def next_seq(self) -> int:
        """Sequence number the next :meth:`publish` assigns."""
        return self._acc.next_seq

    @property
    def evictions(self) -> int:
        """Subscribers evicted so far: held a frame past ``lease_timeout``, or a full socket.

        Each was told why (an eviction notice behind the frames queued for it,
        none of which it hands out) before its leases came back to the ring.
        """
        return self._evictions

    def hold(self, slot: int) -> None:
        """Count a local reference (a live producer array) to ``slot``."""
        self._book.hold(slot)

    def unhold(self, slot: int) -> bool:
        """Drop a local reference to ``slot``; True when the slot became free."""
        return self._book.unhold(slot)

    # -- hot path --

    def poll(self, timeout: float | None = 0.0) -> int:
        """Adopt new subscribers and process their messages.

        Parameters
        ----------
        timeout:
            Seconds to wait for a message (None: until one arrives; 0: do not wait).

        Returns
        -------
        int
            Number of leases returned.
        """
        if self._closed:
            self._check_open()  # raises
        if self._acc.pending:
            self._adopt()
        if self._evicting:
            timeout = self._retry_notices(timeout)
        if self._spin_ns and timeout != 0.0 and self._by_fd:
            released = self._spin(timeout)
            if released:
                if self._next_expiry is not None:
                    self._check_leases()
                return released
            if timeout is not None:
                timeout = max(0.0, timeout - self._spin_ns / 1e9)
        if self._next_expiry is None:
            return self._wait(timeout)
        released = self._wait(self._until_expiry(timeout))
        self._check_leases()
        return released

    def _spin(self, timeout: float | None) -> int:
        """Busy-poll the sockets for up to ``spin_us`` (and ``timeout``); leases returned."""
        spin = self._spin_ns if timeout is None else min(self._spin_ns, int(timeout * 1e9))
        end = time.perf_counter_ns() + spin
        while True:
            released = self._wait(0.0)
            if released or time.perf_counter_ns() >= end:
                return released

    def acquire(self, timeout: float | None = None) -> tuple[int, list[int]]:
        """Return a free slot to write the next frame into.

        Slots are scanned round-robin after the last published one.  While
        none is free, waits for subscribers' releases (or departures).

        Parameters
        ----------
        timeout:
            Seconds to wait (None: forever).

        Returns
        -------
        slot : int
            A slot with no leases and no local holds.
        readers : list[int]
            Subscribers that read the slot since it was last published: the
            producer must wait on their read flags before writing it.

        Raises
        ------
        SlotBusyError
            No slot became free in time; the message says who holds what.
        PoolClosedError
            The publisher is closed.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        book = self._book
        while True:
            if self._acc.pending:
                self._adopt()
            self._wait(0.0)
            if self._next_expiry is not None:
                self._check_leases()
            if self._evicting:
                self._retry_notices(None)
            slot = book.pick_free_slot(self._last_slot + 1)
            if slot is not None:
                return slot, book.readers_to_wait(slot)
            remaining = None
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0.0:
                    raise SlotBusyError(self._busy_message(timeout))
            if self._next_expiry is not None:
                remaining = self._until_expiry(remaining)
            if self._evicting:
                remaining = _NOTICE_RETRY if remaining is None else min(remaining, _NOTICE_RETRY)
            self._wait(remaining)

    def publish(self, slot: int, payload: bytes = b"") -> int:
        """Send frame ``(next seq, slot, payload)`` to the subscribers that take it.

        Every ``"block"`` subscriber receives it (a full socket stalls up to
        ``send_timeout``, then that subscriber is dropped); a ``"latest"``
        subscriber receives it while it holds fewer than ``credit`` frames and
        its socket has room, and otherwise skips it.

        Parameters
        ----------
        slot:
            The slot written (usually from :meth:`acquire`); it must have no leases.
        payload:
            Opaque bytes, at most 64 KiB.

        Returns
        -------
        int
            The frame's sequence number.

        Raises
        ------
        UsageError
            The payload is too large.
        LeaseStateError
            The slot still has leases.
        PoolClosedError
            The publisher is closed.
        """
        self._check_open()
        acc = self._acc
        if acc.pending:
            self._adopt()
        seq = acc.next_seq
        if type(payload) is not bytes:
            payload = bytes(payload)
        if len(payload) > proto.MAX_FRAME_PAYLOAD:
            proto.encode_frame(seq, slot, payload)  # raises UsageError
        if self.lease_timeout is None:
            receivers = self._book.publishing(slot, seq)
        else:
            now = time.monotonic()
            receivers = self._book.publishing(slot, seq, now)
            if receivers and self._next_expiry is None:
                self._next_expiry = now + self.lease_timeout
        acc.next_seq = seq + 1
        self._last_slot = slot
        conns = self._conns
        targets = [conn for sub_id in receivers if (conn := conns.get(sub_id)) is not None]
        if not targets:
            return seq
        failed = send_frame(tuple(c.fd for c in targets), seq, slot, payload)
        if failed:
            msg = proto.encode_frame(seq, slot, payload)
            for index, err in failed:
                conn = targets[index]
                if conn.info.sub_id not in conns:
                    continue  # dropped while sending to an earlier receiver
                if err == errno.EAGAIN:
                    if conn.info.mode == "latest":
                        self._book.cancel(conn.info.sub_id, seq, slot)
                    else:
                        self._send_stalled(conn, msg)
                else:
                    self._drop(conn, f"send failed: {os.strerror(err)}")
        return seq

    # -- internals --

    def _until_expiry(self, timeout: float | None) -> float | None:
        """``timeout`` shortened to end when the oldest lease becomes overdue."""
        if self._next_expiry is None:
            return timeout
        left = max(0.0, self._next_expiry - time.monotonic())
        return left if timeout is None else min(timeout, left)

    def _check_leases(self) -> None:
        """Evict every subscriber that holds a frame longer than ``lease_timeout``."""
        timeout = self.lease_timeout
        if timeout is None or self._next_expiry is None:
            return
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._wait(0.0)  # releases that already arrived are in time
        for sub_id in self._book.overdue(now, timeout):
            conn = self._conns.get(sub_id)
            if conn is not None:
                seq = min(self._book.held_by(sub_id))
                self._evictions += 1
                self._drop(
                    conn,
                    f"evicted: held frame {seq} for more than lease_timeout={timeout} s",
                    notify=True,
                )
            else:
                self._book.remove_subscriber(sub_id)
        self._next_expiry = self._book.next_expiry(timeout)

    def _send_stalled(self, conn: _Conn, msg: bytes) -> None:
        deadline = time.monotonic() + self._send_timeout
        poller = select.poll()
        poller.register(conn.fd, _POLLOUT)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0.0:
                self._evictions += 1
                self._drop(
                    conn, f"evicted: its socket stayed full for {self._send_timeout} s", notify=True
                )
                return
            poller.poll(_ms(remaining))
            try:
                conn.sock.send(msg)
                return
            except BlockingIOError:
                continue
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
                return

    def _adopt(self) -> None:
        acc = self._acc
        with acc.lock:
            new, acc.pending = acc.pending, []
        acc.adopted()
        for conn in new:
            info = conn.info
            self._conns[info.sub_id] = conn
            self._by_fd[conn.fd] = conn
            self._book.add_subscriber(info.sub_id, info.mode, info.credit)
            self._callback(self._on_join, info, "on_join")
        self._set_poll_set()

    def _set_poll_set(self) -> None:
        self._poll_set = bytearray(pollfds([(fd, _POLLIN) for fd in self._by_fd]))

    def _wait(self, timeout: float | None) -> int:
        """Wait up to ``timeout`` for the subscribers' messages and handle them; leases returned.

        One compiled call (``_frameio.wait_releases``) polls the sockets and
        receives; a RELEASE comes back decoded, anything else as its bytes.
        """
        if not self._by_fd and timeout == 0.0:
            return 0
        # A blocking wait takes one message per ready socket (a caller that waits
        # wants the first one; more are found by the next poll at once), which
        # spares the failing recv that would end a drain; poll(0) drains all.
        got = wait_releases(self._poll_set, _ms(timeout), 1 << 30 if timeout == 0.0 else 1)
        if not got:
            return 0
        book = self._book
        by_fd = self._by_fd
        released = 0
        for fd, seq, what in got:
            conn = by_fd.get(fd)
            if conn is None:
                continue  # dropped by an earlier message of this batch
            if seq >= 0:
                try:
                    book.release(conn.info.sub_id, seq, what)
                except ProtocolError as exc:
                    self._drop(conn, f"protocol error: {exc}")
                    continue
                released += 1
            elif seq == -1:
                self._other_message(conn, what)
            else:
                self._drop(conn, f"receive failed: {os.strerror(what)}")
        return released

    def _other_message(self, conn: _Conn, data: bytes) -> None:
        """A subscriber sent something other than a RELEASE (``data``; b"": it hung up)."""
        if not data:
            self._drop(conn, "disconnected")
            return
        try:
            msg = proto.decode(data)
            if type(msg) is proto.Bye:
                self._drop(conn, "said BYE")
                return
            raise ProtocolError(f"unexpected {type(msg).__name__} from a subscriber")
        except ProtocolError as exc:
            self._drop(conn, f"protocol error: {exc}")

    def _drop(self, conn: _Conn, reason: str, notify: bool = False) -> None:
        """Forget a subscriber: close its socket, then take its leases back.

        With ``notify`` (the publisher drops a subscriber that is still there,
        possibly holding frames and with frames queued in its socket), a
        REFUSE with ``reason`` is queued behind those frames and the
        connection is shut down before the leases return to the ring: the
        subscriber, seeing the hang-up, reads everything queued, finds the
        notice and hands out none of those frames (their slots may be
        rewritten from then on).  If the notice cannot be queued (the socket
        is full and its buffer cannot grow), the subscriber keeps its leases
        and gets no further frame until it fits (:meth:`_retry_notices`).
        """
        info = conn.info
        if self._conns.pop(info.sub_id, None) is None:
            return
        if self._by_fd.pop(conn.fd, None) is not None:
            self._set_poll_set()
        self.last_leave_reason = reason
        if notify:
            notice = proto.encode_refuse(reason)
            if not _queue_notice(conn.sock, notice):
                self._book.suspend(info.sub_id)
                self._evicting[info.sub_id] = (conn, notice)
                return
        self._gone(conn)

    def _gone(self, conn: _Conn) -> None:
        """The connection is over (and told so): hang up, then give back what it held."""
        _shut_and_close(conn.sock)
        self._book.remove_subscriber(conn.info.sub_id)
        with self._acc.lock:
            self._acc.count -= 1
        self._callback(self._on_leave, conn.info, "on_leave")

    def _retry_notices(self, timeout: float | None) -> float | None:
        """Try again to queue the notices that did not fit; ``timeout``, capped while some wait."""
        for sub_id, (conn, notice) in list(self._evicting.items()):
            if _queue_notice(conn.sock, notice):
                del self._evicting[sub_id]
                self._gone(conn)
        if self._evicting and (timeout is None or timeout > _NOTICE_RETRY):
            return _NOTICE_RETRY
        return timeout

    @staticmethod
    def _callback(
        func: Callable[[SubscriberInfo], object] | None, info: SubscriberInfo, name: str
    ) -> None:
        if func is None:
            return
        try:
            func(info)
        except Exception as exc:
            warnings.warn(f"{name} callback raised {exc!r}", RuntimeWarning, stacklevel=4)

    def _busy_message(self, timeout: float | None) -> str:
        book = self._book
        by_sub: dict[int, list[int]] = {}
        for slot in range(self.num_slots):
            for sub_id, _seq in book.leases(slot):
                by_sub.setdefault(sub_id, []).append(slot)
        parts = []
        for sub_id, slots in sorted(by_sub.items()):
            conn = self._conns.get(sub_id)
            who = f"pid {conn.info.pid}, {conn.info.mode}" if conn else "gone"
            parts.append(f"subscriber {sub_id} ({who}) holds slots {slots}")
        local = [s for s in range(self.num_slots) if book.holds(s)]
        if local:
            parts.append(f"local arrays hold slots {local}")
        return (
            f"no slot became free within {timeout} s: all {self.num_slots} slots are in use "
            f"({'; '.join(parts)}); subscribers must release their frames (or use "
            "mode='latest'), or give the pool more slots"
        )


# -- subscriber --------------------------------------------------------------------


def _close_subscriber(sock: socket.socket, fds: list[int]) -> None:
    """Tear a subscriber down (also its finalizer); warns instead of raising."""
    try:
        if sock.fileno() >= 0:
            _say_bye_and_close(sock)
    except Exception as exc:
        _warn(f"closing the subscriber socket failed: {exc!r}")
    while fds:
        fd = fds.pop()
        try:
            os.close(fd)
        except OSError as exc:
            _warn(f"closing slot fd {fd} failed: {exc}")


class SubscriberCore:
    """The consumer side of a channel: subscribe, receive frames, release them.

    Parameters
    ----------
    address:
        Filesystem path of the publisher's socket.
    mode:
        ``"block"``: receive every frame, the producer waits for releases;
        ``"latest"``: frames are skipped while ``credit`` are held.
    credit:
        Most frames held at once; default 1 for ``"latest"``, 64 for ``"block"``.
        The publisher may grant less (its ``max_credit``): :attr:`credit` is
        the credit granted.
    hello:
        Opaque bytes for the publisher (at most 64 KiB).
    timeout:
        Seconds for connect and handshake together (a full listen backlog is
        retried until then); also how long ``release`` may wait for room in
        the socket.
    allowed_uids:
        Uids the publisher may run as (``SO_PEERCRED``); default: own euid.
    spin_us:
        Microseconds :meth:`recv` busy-polls the socket before it sleeps in
        ``poll(2)`` (default 0: sleep at once, no CPU while idle).  A few tens
        of microseconds save the scheduler's wake-up latency when frames come
        at a high rate, at the cost of that much CPU per call.

    Attributes
    ----------
    credit:
        The credit the publisher granted.
    lease_timeout:
        Seconds the publisher lets this subscriber hold a frame before it
        evicts it (None: no limit).

    Raises
    ------
    PeerRefusedError
        The publisher refused (the reason is in the message) or runs as a uid
        not allowed here.
    TransportError
        Connecting failed (no publisher, no permission).
    ChannelTimeoutError
        No WELCOME within ``timeout`` (or the backlog stayed full).
    ProtocolError
        The publisher's reply is malformed.
    EndOfStream
        The publisher closed or reset the connection during the handshake.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        mode: str = "block",
        credit: int | None = None,
        hello: bytes = b"",
        timeout: float = 10.0,
        allowed_uids: Iterable[int] | None = None,
        spin_us: float = 0.0,
    ) -> None:
        _load_frameio()
        if mode not in proto.MODE_CODES:
            raise UsageError(f"mode must be 'block' or 'latest', not {mode!r}")
        self.spin_ns = _spin_ns(spin_us)
        if credit is None:
            credit = 1 if mode == "latest" else DEFAULT_BLOCK_CREDIT
        self.address = os.fspath(address)
        self.mode = mode
        self.credit = int(credit)
        self.lease_timeout: float | None = None
        self._timeout = timeout
        hello_msg = proto.encode_hello(proto.MODE_CODES[mode], self.credit, os.getpid(), hello)
        allowed = frozenset({os.geteuid()} if allowed_uids is None else allowed_uids)
        self._held: dict[int, int] = {}
        self._eos: str | None = None
        self._eos_clean = False
        self._evicted = False
        self._backlog: collections.deque[bytes] = collections.deque()
        self._closed = False
        self._fds: list[int] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._finalizer = weakref.finalize(self, _close_subscriber, self._sock, self._fds)
        try:
            welcome = self._handshake(hello_msg, allowed)
        except BaseException:
            self.close()
            raise
        self.sub_id = welcome.sub_id
        self.num_slots = welcome.num_slots
        self.next_seq = welcome.next_seq
        self.credit = welcome.credit
        if welcome.lease_timeout_ms:
            self.lease_timeout = welcome.lease_timeout_ms / 1000.0
        self.welcome_payload = welcome.payload
        self._buf = bytearray(proto.MAX_FRAME_SIZE + 1)
        self._view = memoryview(self._buf)
        self._hangup = select.poll()
        self._hangup.register(self._sock, _POLLRDHUP)
        self._sock_fd = self._sock.fileno()
        # the same check for the compiled per-frame calls (recv_frame, release_frame)
        self._hup_pairs: list[tuple[int, int]] = [(self._sock_fd, _POLLRDHUP)]
        self._hup_set = pollfds(self._hup_pairs)
        self._waited = False  # the last recv had to wait for its frame
        #: True once a hang-up (or a watched fd, :meth:`watch`) was seen: from then on
        #: the caller should look at its own death signals for every frame.
        self.alarm = False

    def watch(self, fd: int) -> None:
        """Add ``fd`` (readable = trouble, e.g. the producer's pidfd) to the hang-up check.

        The check that :meth:`recv` and :meth:`connected` make anyway (one
        ``poll(0)``) then covers it too: when it fires, :attr:`alarm` is set
        and :meth:`connected` answers False.  This saves the caller a system
        call per frame.
        """
        pairs = [p for p in self._hup_pairs if p[0] != fd] + [(fd, select.POLLIN)]
        if len(pairs) > _MAX_WATCHED + 1:
            raise UsageError(f"at most {_MAX_WATCHED} fds can be watched")
        self._hangup.register(fd, select.POLLIN)
        self._hup_pairs = pairs
        self._hup_set = pollfds(pairs)

    def _hung_up(self) -> bool:
        """One ``poll(0)`` of the socket's hang-up and the watched fds; True if any fired.

        Reads what is still queued when the socket itself hung up (to notice an
        eviction notice).
        """
        ready = self._hangup.poll(0)
        if not ready:
            return False
        self.alarm = True
        if any(fd == self._sock_fd for fd, _ev in ready):
            self._scan_after_hangup()
        return True

    def _handshake(self, hello_msg: bytes, allowed: frozenset[int]) -> proto.Welcome:
        sock = self._sock
        deadline = time.monotonic() + self._timeout
        try:
            connect_unix(sock, self.address, deadline)
        except TimeoutError:
            raise ChannelTimeoutError(
                f"cannot connect to the publisher at {self.address} within {self._timeout} s: "
                "its listen backlog stayed full"
            ) from None
        except OSError as exc:
            hint = ""
            if exc.errno == errno.EACCES:
                hint = " (the socket is private to the publisher's uid: allow yours there)"
            elif exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                hint = " (is the publisher running?)"
            raise TransportError(
                exc.errno or errno.EIO,
                f"cannot connect to the publisher at {self.address}: {exc.strerror}{hint}",
            ) from None
        self.producer_pid, self.producer_uid, _gid = peer_credentials(sock)
        if self.producer_uid not in allowed:
            raise PeerRefusedError(
                f"the publisher at {self.address} runs as uid {self.producer_uid}, "
                f"which is not in allowed_uids {sorted(allowed)}"
            )
        # A publisher that refuses at once (uid, too many handshakes) may close
        # before the HELLO arrives: the REFUSE is still queued for us.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(hello_msg)
        data, fds, flags = self._recv_welcome(deadline)
        try:
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("the WELCOME carried more fds than fit (MSG_CTRUNC)")
            if flags & socket.MSG_TRUNC:
                raise ProtocolError("the WELCOME is larger than the protocol allows")
            if not data:
                raise EndOfStream(f"the publisher at {self.address} closed during the handshake")
            msg = proto.decode(data)
            if isinstance(msg, proto.Refuse):
                raise PeerRefusedError(f"the publisher at {self.address} refused: {msg.reason}")
            if not isinstance(msg, proto.Welcome):
                raise ProtocolError(f"expected WELCOME, got {type(msg).__name__}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._fds.extend(fds)
        # Blocking from now on: recv() without a timeout sleeps in recv itself; every
        # call that must not wait passes MSG_DONTWAIT.
        sock.setblocking(True)
        return msg

    def _recv_welcome(self, deadline: float) -> tuple[bytes, list[int], int]:
        """Receive the publisher's reply, its fds close-on-exec."""
        sock = self._sock
        space = socket.CMSG_SPACE(MAX_FDS * _INT_SIZE)
        reset = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeoutError(
                    f"the publisher at {self.address} did not answer within {self._timeout} s"
                )
            sock.settimeout(remaining)
            try:
                data, ancdata, flags, _ = sock.recvmsg(
                    proto.MAX_WELCOME_SIZE + 1, space, socket.MSG_CMSG_CLOEXEC
                )
            except TimeoutError:
                continue
            except ConnectionResetError:
                if reset:
                    raise EndOfStream(
                        f"the publisher at {self.address} reset the connection during the "
                        "handshake (it exited or was killed)"
                    ) from None
                reset = True  # reported once; a REFUSE may still be queued behind it
                continue
            except OSError as exc:
                raise TransportError(
                    exc.errno or errno.EIO,
                    f"the handshake with {self.address} failed: {exc.strerror}",
                ) from None
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    whole = len(payload) - len(payload) % _INT_SIZE
                    fds.extend(struct.unpack(f"{whole // _INT_SIZE}i", payload[:whole]))
            return data, fds, flags

    # -- context manager / teardown --

    def __enter__(self) -> SubscriberCore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Say BYE, close the socket and every fd not taken. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def fileno(self) -> int:
        """The socket's fd, readable when a frame (or the end) is waiting."""
        return self._sock.fileno()

    def take_fds(self) -> list[int]:
        """Return the slot fds from the WELCOME; the caller owns (and closes) them now."""
        fds = list(self._fds)
        self._fds.clear()
        return fds

    @property
    def held(self) -> dict[int, int]:
        """Frames received and not yet released, as ``{seq: slot}``."""
        return dict(self._held)

    # -- hot path --

    def recv(self, timeout: float | None = None) -> Frame:
        """Wait for the next frame; the caller holds a lease on it until :meth:`release`.

        Parameters
        ----------
        timeout:
            Seconds to wait (None: forever).

        Returns
        -------
        Frame
            ``(seq, slot, payload)``.

        Raises
        ------
        EvictedError
            The publisher dropped this subscriber while it held frames (lease
            timeout, full socket): the frames it holds may be overwritten and
            must not be read (and on every later call).
        EndOfStream
            The publisher said BYE, closed or died (and on every later call).
        ChannelTimeoutError
            No frame within ``timeout`` (also a ``TimeoutError``).
        ProtocolError
            The publisher sent something malformed; the connection is closed.
        PoolClosedError
            This subscriber is closed.
        """
        seq, slot, payload = self.recv_view(timeout)
        return Frame(seq, slot, bytes(payload))

    def recv_view(self, timeout: float | None = None) -> tuple[int, int, memoryview | bytes]:
        """:meth:`recv`, answering ``(seq, slot, payload)`` without a :class:`Frame` object.

        ``payload`` may be a view of this subscriber's receive buffer: it is
        valid until the next ``recv``/``recv_view`` (copy what must last).
        The per-frame path of the GPU subscriber.  Raises as :meth:`recv`.
        """
        if self._closed:
            raise PoolClosedError("the subscriber is closed")
        if self._eos is not None:
            self._raise_end()
        if self._backlog:
            return self._from_backlog()
        # One compiled call: the wait (poll(2) of the socket and the hang-up set),
        # the receive, the FRAME's header, and the hang-up check if it did not wait;
        # with spin_us, non-blocking receives of the same call first.
        try:
            if self.spin_ns and timeout != 0:
                got = self._recv_frame_spinning(timeout)
            else:
                got = recv_frame(
                    self._sock_fd,
                    self._buf,
                    -1 if timeout is None else _ms(timeout),
                    self._waited,
                    self._hup_set,
                )
        except OSError as exc:
            self._failed_recv(exc)
            return self._from_backlog()
        if got is None:
            self._waited = True
            raise ChannelTimeoutError(f"no frame within {timeout} s")
        n, seq, slot, self._waited = got
        if seq >= 0:
            # a well-formed FRAME and no hang-up: what _accept checks besides
            if slot >= self.num_slots:
                self._protocol_error(f"frame {seq} names slot {slot} of {self.num_slots}")
            held = self._held
            if seq in held:
                self._protocol_error(f"frame {seq} received twice")
            held[seq] = slot
            return seq, slot, self._view[_FRAME_HEAD_SIZE:n]
        if n == 0:
            self._end("the publisher closed the connection")
        msg = self._accept(self._view[:n])
        return msg.seq, msg.slot, msg.payload

    def _from_backlog(self) -> tuple[int, int, bytes]:
        msg = self._accept(self._backlog.popleft())
        return msg.seq, msg.slot, msg.payload

    def _recv_frame_spinning(self, timeout: float | None) -> tuple[int, int, int, bool] | None:
        """``recv_frame``, busy-polling (non-blocking receives) up to ``spin_us`` first.

        Returns what ``recv_frame`` returns; None when nothing came within
        ``timeout``.  A frame taken while spinning gets the same compiled header
        and hang-up checks as one that was waited for.
        """
        fd, buf, hup = self._sock_fd, self._buf, self._hup_set
        clock = time.perf_counter_ns
        start = clock()
        spin = self.spin_ns if timeout is None else min(self.spin_ns, int(timeout * 1e9))
        end = start + spin
        while True:
            got = recv_frame(fd, buf, 0, False, hup)
            if got is not None:
                return got
            now = clock()
            if now >= end:
                break
        if timeout is None:
            return recv_frame(fd, buf, -1, True, hup)
        left = timeout - (now - start) / 1e9
        if left <= 0.0:
            return None
        return recv_frame(fd, buf, _ms(left), True, hup)

    def _failed_recv(self, exc: OSError) -> None:
        """A receive failed: return if frames are queued behind a reset (take those), else end."""
        if isinstance(exc, ConnectionResetError):
            # Reported once, before what is still queued (a dropped subscriber's
            # notice among it): look there first.
            self._scan_after_hangup()
            if self._evicted:
                self._raise_end()
            if self._backlog:
                return
            self._end("the connection to the publisher was reset")
        self._end(f"the connection to the publisher failed: {exc}")

    def _protocol_error(self, exc: ProtocolError | str) -> NoReturn:
        """Close the connection after a protocol error and raise it."""
        if isinstance(exc, str):
            exc = ProtocolError(exc)
        self._eos = f"the connection was closed after a protocol error: {exc}"
        _close_subscriber(self._sock, [])
        raise exc

    def _accept(self, data: bytes | memoryview) -> Frame:
        """Decode one message from the publisher; return it if it is a frame we may use."""
        try:
            msg = proto.decode(data)
            if type(msg) is Frame:
                if msg.slot >= self.num_slots:
                    raise ProtocolError(
                        f"frame {msg.seq} names slot {msg.slot} of {self.num_slots}"
                    )
                if msg.seq in self._held:
                    raise ProtocolError(f"frame {msg.seq} received twice")
                if self._revoked():
                    self._raise_end()
                self._held[msg.seq] = msg.slot
                return msg
            if type(msg) is proto.Bye:
                self._end("the publisher said BYE", clean=True)
            if type(msg) is proto.Refuse:
                self._evict(msg.reason)
            raise ProtocolError(f"unexpected {type(msg).__name__} from the publisher")
        except ProtocolError as exc:
            self._protocol_error(exc)

    def _revoked(self) -> bool:
        """Whether a FRAME just taken from the socket (or the backlog) must not be handed out.

        The one rule for every frame: it is handed out only if, after it was
        received, the connection had not hung up, or had hung up with no
        eviction notice queued (a clean BYE or a dead publisher: the frame's
        lease was not revoked).  The publisher queues the notice and hangs up
        before it takes an evicted subscriber's leases back, so a hang-up not
        seen here came after the frame was handed out.  After a hang-up
        everything still queued is read (:meth:`_scan_after_hangup`); frames
        in the backlog come from such a complete read that found no notice.
        (The compiled ``recv_frame`` makes the same check after its receive
        and hands every frame it cannot vouch for to this one.)
        """
        if self._evicted:
            return True
        if self._backlog:
            return False  # read after the hang-up, all of it, and no notice was among it
        return self._hung_up() and self._evicted

    def _scan_after_hangup(self) -> None:
        """Read everything still queued (the publisher has hung up); note an eviction notice."""
        self.alarm = True
        reset = False
        got: list[bytes] = []
        while True:
            try:
                data = self._sock.recv(proto.MAX_FRAME_SIZE + 1, socket.MSG_DONTWAIT)
            except ConnectionResetError:
                if reset:
                    break
                reset = True
                continue
            except OSError:
                break
            if not data:
                break
            got.append(data)
        for data in got:
            try:
                msg = proto.decode(data)
            except ProtocolError:
                continue  # reported when it is reached
            if type(msg) is proto.Refuse:
                self._evicted = True
                self._eos = f"the publisher evicted this subscriber: {msg.reason}"
                self._backlog.clear()
                return
        self._backlog.extend(got)

    def _evict(self, reason: str) -> NoReturn:
        self._evicted = True
        self._eos = f"the publisher evicted this subscriber: {reason}"
        self._backlog.clear()
        self._raise_end()

    def _raise_end(self) -> NoReturn:
        assert self._eos is not None
        if self._evicted:
            raise EvictedError(self._eos, False)
        raise EndOfStream(self._eos, self._eos_clean)

    def _end(self, reason: str, clean: bool = False) -> NoReturn:
        self._eos = reason
        self._eos_clean = clean
        raise EndOfStream(reason, clean)

    @property
    def evicted(self) -> bool:
        """True once the publisher evicted this subscriber (see :class:`EvictedError`)."""
        return self._evicted

    def connected(self) -> bool:
        """False once the publisher has hung up on this subscriber (ended, died or evicted it).

        One ``poll(0)``; after a hang-up it reads what is still queued, to
        notice an eviction notice (frames queued before a BYE stay for
        :meth:`recv`).  The GPU subscriber asks before it writes its read flag
        in the sync page: an evicted subscriber's row may already belong to a
        newer subscriber, which a late write of an older generation would
        disturb.  (A publisher that evicts between this call and the write is
        not caught: the window is one flag write.)
        """
        if self._closed or self._eos is not None:
            return False
        return not self._hung_up()

    def release(self, seq: int, slot: int) -> None:
        """Return the lease on frame ``seq`` in ``slot``.

        After the publisher ended, releasing only forgets the frame locally.

        Raises
        ------
        EvictedError
            The publisher evicted this subscriber: the lease had already been
            taken back, the frame's slot may have been overwritten before this
            release (the frame is forgotten locally all the same).
        ProtocolError
            This subscriber does not hold that frame (never received, released
            twice, wrong slot); nothing is sent.
        ChannelTimeoutError
            The publisher did not drain its socket within ``timeout``.
        PoolClosedError
            This subscriber is closed.
        """
        self._check_held(seq, slot)
        del self._held[seq]
        if self._eos is not None:
            if self._evicted:
                self._raise_end()
            return
        try:
            self._sock.send(proto.encode_release(seq, slot), _DONTWAIT)
        except OSError as exc:
            self._release_not_sent(exc, seq, slot)

    def release_with_write(
        self, seq: int, slot: int, fn: int, stream: int, addr: int, value: int, flags: int
    ) -> int:
        """:meth:`release`, preceded by a stream memory operation unless the publisher hung up.

        The GPU subscriber's release in one compiled call
        (``_frameio.release_frame``): the hang-up check of :meth:`connected`;
        if the publisher is still there, ``fn(stream, addr, value, flags)``
        (the driver's ``cuStreamWriteValue32`` of the read flag, as
        ``_fastpath.memop`` calls it); then the RELEASE.  After a hang-up the
        operation is skipped (an evicted subscriber's row may belong to
        another subscriber by now) and the frame is released as by
        :meth:`release`.

        Returns
        -------
        int
            0, or the driver's error code: then nothing was written or sent
            and the frame is still held.

        Raises
        ------
        As :meth:`release`.
        """
        self._check_held(seq, slot)
        if self._eos is not None:
            self.release(seq, slot)
            return 0
        try:
            rc = release_frame(
                self._sock_fd, self._hup_set, fn, stream, addr, value, flags, seq, slot
            )
        except OSError as exc:  # the flag was written; the RELEASE did not go
            del self._held[seq]
            self._release_not_sent(exc, seq, slot)
            return 0
        if rc < 0:  # hung up: no write (as connected() answers False)
            self._hung_up()
            self.release(seq, slot)
            return 0
        if rc == 0:
            del self._held[seq]
        return rc

    def _check_held(self, seq: int, slot: int) -> None:
        """Raise unless this open subscriber holds frame ``seq`` in ``slot``."""
        if self._closed:
            raise PoolClosedError("the subscriber is closed")
        held = self._held.get(seq)
        if held is None or held != slot:
            raise ProtocolError(f"release of frame {seq} in slot {slot}, which is not held")

    def _release_not_sent(self, exc: OSError, seq: int, slot: int) -> None:
        """A RELEASE's send failed: wait for room, or find out whether we were dropped."""
        if isinstance(exc, BlockingIOError):
            self._send_stalled(proto.encode_release(seq, slot))
            return
        # The publisher is gone; was this subscriber dropped?
        self._scan_after_hangup()
        if self._evicted:
            self._raise_end()

    def _send_stalled(self, msg: bytes) -> None:
        poller = select.poll()
        poller.register(self._sock, _POLLOUT)
        deadline = time.monotonic() + self._timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0.0:
                raise ChannelTimeoutError(
                    f"the publisher did not take a RELEASE within {self._timeout} s"
                )
            poller.poll(_ms(remaining))
            try:
                self._sock.send(msg, _DONTWAIT)
                return
            except BlockingIOError:
                continue
            except OSError:
                return


__all__ = [
    "HANDSHAKE_TIMEOUT",
    "MAX_PENDING_PER_UID",
    "Frame",
    "PublisherCore",
    "SubscriberCore",
    "SubscriberInfo",
]
