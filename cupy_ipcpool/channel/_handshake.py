"""The publisher's listening side: binding, the accept thread, the handshake, admission.

:class:`_Acceptor` owns the listening socket and a daemon thread (the
transport's :class:`~cupy_ipcpool._transport._accept_loop.AcceptLoop`) that
welcomes subscribers for :class:`~._publisher_core.PublisherCore`.  Limits that keep any
client, honest or hostile, from locking others out: a connection's uid is
checked before anything it sent is read; handshakes run concurrently, each
with one deadline (:data:`HANDSHAKE_TIMEOUT`), at most
:data:`MAX_PENDING_PER_UID` per uid; every resource the ``welcome`` callback
took for a subscriber comes back however its connection ends before adoption.

A connection is known by its object (a handshake by a key of its own), never
by its fd number: the producer closes the sockets it adopted while this
thread may still have their numbers in its ``poll`` set, and the kernel gives
a closed number to the next connection accepted, so every event (a ``poll``
result, a hang-up, a deadline) is matched to the connection it was raised for
(the loop hands a ``poll`` event to the owner watched under its fd when
``poll`` returned, and only while it still is).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import stat
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import ProtocolError, TransportError, UsageError
from .._transport import MAX_PENDING_PER_UID, Admission, accept_peer
from .._transport._accept_loop import HANDSHAKE_TIMEOUT, AcceptLoop
from . import _protocol as proto
from ._leases import granted_credit
from ._sockets import _POLLIN, _POLLRDHUP, MAX_FDS, _say_bye_and_close


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
    peer_pid:
        The pid from ``SO_PEERCRED`` alone: 0 where the kernel cannot name the
        subscriber's process in this PID namespace.  Only this pid may be
        watched for the subscriber's death (``pid`` may be its claim, a
        number of another namespace that names some other process here).
    """

    sub_id: int
    pid: int
    uid: int
    mode: str
    credit: int
    hello: bytes = b""
    peer_pid: int = 0


class _Conn:
    """Producer-side state of one welcomed subscriber."""

    __slots__ = ("fd", "info", "sock")

    def __init__(self, info: SubscriberInfo, sock: socket.socket) -> None:
        self.info = info
        self.sock = sock
        self.fd = sock.fileno()


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


class _Handshake:
    """A connection accepted and not yet welcomed (owned by the accept thread).

    ``key`` (unique for the acceptor's lifetime) names it in the admission
    book; ``fd`` is only the number it is registered under in the ``poll`` set.
    """

    __slots__ = ("fd", "key", "pid", "sock", "uid")

    def __init__(self, key: int, sock: socket.socket, pid: int, uid: int) -> None:
        self.key = key
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

    Shared with the producer's thread: ``pending``, ``count`` and ``stopping``
    under ``lock`` (a WELCOME is sent only under it, so once :meth:`stop_accepting`
    has set ``stopping`` no connection is welcomed); ``next_seq`` is written by
    the producer only.
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
        self._keys = itertools.count(1)
        self._admission = Admission(max_pending_per_uid, handshake_timeout)
        self._handshakes: dict[int, _Handshake] = {}  # by key
        #: the thread; each fd it polls is watched for one connection: a handshake
        #: waiting for its HELLO, or a pending subscriber watched for a hang-up.
        #: ``stopping`` (ours, under ``lock``) is set before the loop is stopped
        self._loop: AcceptLoop[_Handshake | _Conn] = AcceptLoop(
            listener,
            name="ipcpool-accept",
            on_accept=self._accepted,
            on_event=self._on_event,
            deadlines=self._admission,
            on_expired=self._expired,
            on_wake=self._unwatch_adopted,
            on_exit=self._end_handshakes,
        )
        self.thread = self._loop.thread

    def start(self) -> None:
        self.thread.start()

    def stop_accepting(self) -> list[_Conn]:
        """Stop welcoming subscribers; return those welcomed and not yet adopted.

        Wakes and joins the thread, which ends the handshakes in progress
        without a WELCOME (their subscribers see the publisher go during the
        handshake, and one that waits for a publisher tries again), then
        closes the listener: a connect from here on is refused.  The
        connections returned are the caller's to end.  Idempotent: a second
        call returns ``[]``.
        """
        with self.lock:
            self.stopping = True
        self._loop.stop()  # joins the thread, closes the listener
        with self.lock:
            pending, self.pending = self.pending, []
        return pending

    def stop(self) -> None:
        """Stop accepting (:meth:`stop_accepting`) and say BYE to every pending connection."""
        for conn in self.stop_accepting():
            _say_bye_and_close(conn.sock)

    def adopted(self) -> None:
        """The producer took the pending list: stop watching those connections.

        A socket in another thread's ``poll`` set stays open in the kernel
        until that ``poll`` returns, even once closed: without this wake-up a
        subscriber the producer drops would not see the end until the accept
        thread next woke.
        """
        self._loop.wake()

    def pending_handshakes(self, uid: int | None = None) -> int:
        """Handshakes in progress (of ``uid``, or in all); for tests and diagnostics."""
        return self._admission.count(uid)

    # -- the thread --

    def _on_event(self, owner: _Handshake | _Conn, _events: int) -> None:
        if isinstance(owner, _Handshake):
            self._on_hello(owner)
        else:
            self._on_hangup(owner)

    def _expired(self, key: int) -> None:
        hs = self._handshakes.pop(key)
        self._loop.forget(hs.fd, hs)
        _refuse(hs.sock, f"no HELLO within {self.handshake_timeout} s")

    def _end_handshakes(self) -> None:
        for hs in list(self._handshakes.values()):
            _end_handshake(hs.sock)
        self._handshakes.clear()

    def _unwatch_adopted(self) -> None:
        with self.lock:
            ours = {id(c) for c in self.pending}
        for owner in self._loop.watched():
            if isinstance(owner, _Conn) and id(owner) not in ours:
                self._loop.forget(owner.fd, owner)

    def _accepted(self, conn: socket.socket, _address: object) -> None:
        peer = accept_peer(conn, self.allowed_uids, _refuse_uid)
        if peer is None:
            return
        pid, uid = peer
        hs = _Handshake(next(self._keys), conn, pid, uid)
        for old in self._admission.admit(hs.key, uid, time.monotonic()):
            gone = self._handshakes.pop(old)
            self._loop.forget(gone.fd, gone)
            _refuse(
                gone.sock,
                f"{self._admission.per_uid} handshakes of uid {uid} were in progress; "
                "this one, the oldest, made room for a newer one",
            )
        self._handshakes[hs.key] = hs
        self._loop.watch(hs.fd, hs, _POLLIN)
        self._on_hello(hs)  # the HELLO is often there already

    def _on_hello(self, hs: _Handshake) -> None:
        conn = hs.sock
        try:
            data = conn.recv(proto.MAX_HELLO_SIZE + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self._admission.remove(hs.key)
        del self._handshakes[hs.key]
        self._loop.forget(hs.fd, hs)
        if not data or self.stopping:
            conn.close()
            return
        self._welcome(conn, hs, data)

    def _welcome(self, conn: socket.socket, hs: _Handshake, data: bytes) -> None:
        with self.lock:
            full = self.count >= self.max_subscribers
            stopping = self.stopping
        if stopping:
            conn.close()
            return
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
            credit=granted_credit(hello.credit, self.max_credit),
            hello=hello.payload,
            peer_pid=hs.pid,
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
            msg = proto.welcome_message(
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
        c = _Conn(info, conn)
        failure: OSError | None = None
        # Under the lock (a send that does not wait): close() sets ``stopping`` under it
        # too, so a WELCOME is either sent before close began (and the subscriber is in
        # ``pending``, which close takes) or not at all.
        with self.lock:
            stopping = self.stopping
            if not stopping:
                try:
                    if fds:
                        socket.send_fds(conn, [msg], list(fds), socket.MSG_DONTWAIT)
                    else:
                        conn.send(msg, socket.MSG_DONTWAIT)
                except OSError as exc:
                    failure = exc
                else:
                    self.count += 1
                    self.pending.append(c)
        if stopping:
            conn.close()  # closing during the handshake: the subscriber tries again
            self._abandon(info)
            return
        if failure is not None:
            if failure.errno == errno.EMSGSIZE:
                _refuse(
                    conn,
                    f"the WELCOME ({len(msg)} bytes) exceeds the socket buffer limit; "
                    "raise net.core.wmem_max or send a smaller welcome payload",
                )
            else:
                conn.close()  # hung up (or timed out and left) before the WELCOME
            self._abandon(info)
            return
        self._loop.watch(c.fd, c, _POLLRDHUP)

    def _on_hangup(self, c: _Conn) -> None:
        """Pending ``c`` hung up (or was adopted and then closed): reap it if still ours."""
        self._loop.forget(c.fd, c)
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


def _end_handshake(conn: socket.socket) -> None:
    """Close a connection whose handshake the publisher will not finish (it is closing).

    No REFUSE: the subscriber sees the publisher go during its handshake
    (``EndOfStream``), which one that waits for a publisher retries.  What it
    sent is read first, so that it sees the end and not a reset.
    """
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        while conn.recv(proto.MAX_HELLO_SIZE + 1):
            pass
    conn.close()


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
        conn.send(proto.refuse_message(reason), socket.MSG_DONTWAIT)
    conn.close()


def _refuse_uid(conn: socket.socket, uid: int) -> None:
    _refuse(conn, f"uid {uid} is not allowed to subscribe")


__all__ = ["HANDSHAKE_TIMEOUT", "MAX_PENDING_PER_UID", "SubscriberInfo"]
