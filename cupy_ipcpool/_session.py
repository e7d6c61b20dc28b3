"""Publish/subscribe sessions over a Unix ``SOCK_SEQPACKET`` socket, without the GPU parts.

:class:`PublisherCore` listens on a filesystem path, welcomes subscribers
(handshake on a daemon thread), hands out free slots, publishes frames and
collects leases back; :class:`SubscriberCore` connects, receives frames and
releases them.  The GPU layer wraps both: it fills the opaque payloads (event
handles, pool descriptor, array handles) and provides the slot fds.

Hot path (``acquire``/``publish``/``poll`` on the producer, ``recv``/``release``
on the consumer): the caller's thread, one ``send``/``recv`` per message,
fixed ``struct`` layouts, ``poll(2)`` for waiting; no pickle, no sleeps, no
thread hand-off.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import select
import socket
import stat
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import NoReturn

from cupy_ipcpool import _protocol as proto
from cupy_ipcpool._errors import (
    EndOfStream,
    PeerRefusedError,
    PoolClosedError,
    ProtocolError,
    SlotBusyError,
    TeardownWarning,
    TransportError,
)
from cupy_ipcpool._leases import LeaseBook
from cupy_ipcpool._protocol import Frame
from cupy_ipcpool._transport import peer_credentials

#: Seconds a connecting peer has to send its HELLO.
HANDSHAKE_TIMEOUT = 5.0
#: Most fds one SCM_RIGHTS message carries on Linux (``SCM_MAX_FD``).
MAX_FDS = 253
#: Default credit of a ``"block"`` subscriber (informational; the ring bounds it).
DEFAULT_BLOCK_CREDIT = 64

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_RELEASE_RECV = proto.MAX_RELEASE_SIZE + 1  # one more byte so oversize messages fail to decode


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
        Most frames it holds at once (enforced for ``"latest"``).
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


_UMASK_LOCK = threading.Lock()


def _bind(sock: socket.socket, address: str, mode: int) -> None:
    """Bind ``sock`` at ``address`` so that the file never exists with a wider mode than ``mode``.

    The socket is bound inside a fresh 0700 directory next to ``address``,
    chmod-ed, then hard-linked into place (``EEXIST`` if someone took the path
    meanwhile).  When that temporary path would not fit ``sun_path``, binds
    under ``umask(0o177)`` instead.
    """
    parent = os.path.dirname(os.path.abspath(address))
    tmpdir = tempfile.mkdtemp(prefix=".ipcp", dir=parent)
    try:
        tmp = os.path.join(tmpdir, "s")
        if len(os.fsencode(tmp)) >= 108:
            with _UMASK_LOCK:
                old = os.umask(0o177)
                try:
                    sock.bind(address)
                finally:
                    os.umask(old)
            os.chmod(address, mode)
            return
        sock.bind(tmp)
        os.chmod(tmp, mode)
        try:
            os.link(tmp, address)
        except FileExistsError:
            raise TransportError(
                errno.EADDRINUSE, f"{address} was created by someone else while binding"
            ) from None
        except OSError:
            # No hard links on this filesystem: move it into place instead.
            if os.path.lexists(address):
                raise TransportError(
                    errno.EADDRINUSE, f"{address} was created by someone else while binding"
                ) from None
            os.rename(tmp, address)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    finally:
        os.rmdir(tmpdir)


# -- accept thread -----------------------------------------------------------------


class _Acceptor:
    """The listening socket and the daemon thread that welcomes subscribers.

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
    ) -> None:
        self.listener = listener
        self.num_slots = num_slots
        self.welcome = welcome
        self.allowed_uids = allowed_uids
        self.max_subscribers = max_subscribers
        self.lock = threading.Lock()
        self.pending: list[_Conn] = []
        self.count = 0  # welcomed and not yet dropped (pending + adopted)
        self.next_seq = 0
        self.stopping = False
        self._next_id = 1
        self._current: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        self.thread = threading.Thread(target=self._run, name="ipcpool-accept", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Wake and join the thread, close the listener and every pending connection."""
        self.stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        current = self._current
        if current is not None:
            with contextlib.suppress(OSError):
                current.shutdown(socket.SHUT_RDWR)
        if self.thread.is_alive():
            self.thread.join(HANDSHAKE_TIMEOUT + 1.0)
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

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.listener, _POLLIN)
        poller.register(self._wake_r, _POLLIN)
        while not self.stopping:
            try:
                poller.poll()
            except OSError:
                return
            if self.stopping:
                return
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if self.stopping:
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of fds: back off instead of spinning on the pending connection.
                    select.select([self._wake_r], [], [], 0.1)
                    continue
                return
            self._current = conn
            try:
                self._handshake(conn)
            except Exception:
                conn.close()
            finally:
                self._current = None

    def _handshake(self, conn: socket.socket) -> None:
        pid, uid, _gid = peer_credentials(conn)
        conn.settimeout(HANDSHAKE_TIMEOUT)
        # Read the HELLO before any refusal: closing a Unix socket with unread data
        # resets the peer, which would then never see the REFUSE.
        try:
            data = conn.recv(proto.MAX_HELLO_SIZE + 1)
        except OSError:
            conn.close()  # timeout, reset, or shut down by close()
            return
        if not data or self.stopping:
            conn.close()
            return
        if uid not in self.allowed_uids:
            _refuse(conn, f"uid {uid} is not allowed to subscribe")
            return
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
            pid=pid or hello.pid,
            uid=uid,
            mode=proto.MODE_NAMES[hello.mode],
            credit=hello.credit,
            hello=hello.payload,
        )
        try:
            payload, fds = self.welcome(info)
            if len(fds) > MAX_FDS:
                raise ValueError(f"{len(fds)} fds do not fit one message (at most {MAX_FDS})")
            msg = proto.encode_welcome(sub_id, self.num_slots, self.next_seq, payload)
        except Exception as exc:
            _refuse(conn, f"the publisher could not welcome this subscriber: {exc}")
            return
        need = len(msg) + 4096
        if conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < need:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, need)
        with self.lock:
            self.count += 1
        try:
            if fds:
                socket.send_fds(conn, [msg], list(fds))
            else:
                conn.send(msg)
            conn.setblocking(False)
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
                conn.close()
            return
        with self.lock:
            if self.stopping:
                self.count -= 1
                stop = True
            else:
                self.pending.append(_Conn(info, conn))
                stop = False
        if stop:
            _say_bye_and_close(conn)


def _refuse(conn: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError):
        conn.send(proto.encode_refuse(reason))
    conn.close()


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
    acc: _Acceptor, conns: dict[int, _Conn], address: str, ident: tuple[int, int]
) -> None:
    """Tear a publisher down (also its finalizer); warns instead of raising."""
    try:
        acc.stop()
    except Exception as exc:
        _warn(f"stopping the accept thread failed: {exc!r}")
    for conn in list(conns.values()):
        try:
            _say_bye_and_close(conn.sock)
        except Exception as exc:
            _warn(f"closing subscriber {conn.info.sub_id} failed: {exc!r}")
    conns.clear()
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
        error, out-of-protocol message).  Exceptions become ``RuntimeWarning``.
    max_subscribers:
        Further subscribers are refused.
    send_timeout:
        How long a ``"block"`` subscriber's full socket may stall ``publish``
        before that subscriber is dropped.

    Notes
    -----
    Not thread-safe: call every method from one thread.  The accept thread only
    appends to a lock-protected pending list.
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
    ) -> None:
        self.address = os.fspath(address)
        self.num_slots = int(num_slots)
        self._book = LeaseBook(self.num_slots)
        if not 1 <= self.num_slots <= proto.MAX_SLOTS:
            raise ValueError(f"num_slots must be in 1..{proto.MAX_SLOTS}, not {num_slots}")
        euid = os.geteuid()
        allowed = frozenset({euid} if allowed_uids is None else (int(u) for u in allowed_uids))
        self.allowed_uids = allowed
        self._on_join = on_join
        self._on_leave = on_leave
        self._send_timeout = send_timeout
        self._conns: dict[int, _Conn] = {}
        self._by_fd: dict[int, _Conn] = {}
        self._poller = select.poll()
        self._last_slot = self.num_slots - 1
        self._closed = False
        self.last_leave_reason = ""

        _remove_stale(self.address)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            _bind(listener, self.address, 0o600 if allowed <= {euid} else 0o666)
            try:
                st = os.lstat(self.address)
                ident = (st.st_dev, st.st_ino)
                listener.listen(min(max_subscribers, socket.SOMAXCONN))
                listener.setblocking(False)
            except BaseException:
                os.unlink(self.address)
                raise
        except BaseException:
            listener.close()
            raise
        try:
            self._acc = _Acceptor(listener, self.num_slots, welcome, allowed, max_subscribers)
        except BaseException:
            listener.close()
            os.unlink(self.address)
            raise
        self._finalizer = weakref.finalize(
            self, _close_publisher, self._acc, self._conns, self.address, ident
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
        self._check_open()
        if self._acc.pending:
            self._adopt()
        return self._wait(timeout)

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
            slot = book.pick_free_slot(self._last_slot + 1)
            if slot is not None:
                return slot, book.readers_to_wait(slot)
            remaining = None
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0.0:
                    raise SlotBusyError(self._busy_message(timeout))
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
        ValueError
            The payload is too large.
        RuntimeError
            The slot still has leases.
        PoolClosedError
            The publisher is closed.
        """
        self._check_open()
        acc = self._acc
        if acc.pending:
            self._adopt()
        seq = acc.next_seq
        msg = proto.encode_frame(seq, slot, payload)
        receivers = self._book.publishing(slot, seq)
        acc.next_seq = seq + 1
        self._last_slot = slot
        conns = self._conns
        for sub_id in receivers:
            conn = conns.get(sub_id)
            if conn is None:
                continue  # dropped while sending to an earlier receiver
            try:
                conn.sock.send(msg)
            except BlockingIOError:
                if conn.info.mode == "latest":
                    self._book.cancel(sub_id, seq, slot)
                else:
                    self._send_stalled(conn, msg)
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
        return seq

    # -- internals --

    def _send_stalled(self, conn: _Conn, msg: bytes) -> None:
        deadline = time.monotonic() + self._send_timeout
        poller = select.poll()
        poller.register(conn.fd, _POLLOUT)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0.0:
                self._drop(conn, f"its socket stayed full for {self._send_timeout} s")
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
        for conn in new:
            info = conn.info
            self._conns[info.sub_id] = conn
            self._by_fd[conn.fd] = conn
            self._poller.register(conn.fd, _POLLIN)
            self._book.add_subscriber(info.sub_id, info.mode, info.credit)
            self._callback(self._on_join, info, "on_join")

    def _wait(self, timeout: float | None) -> int:
        if not self._by_fd and timeout == 0.0:
            return 0
        released = 0
        for fd, _events in self._poller.poll(_ms(timeout)):
            conn = self._by_fd.get(fd)
            if conn is not None:
                released += self._drain(conn)
        return released

    def _drain(self, conn: _Conn) -> int:
        sock = conn.sock
        book = self._book
        sub_id = conn.info.sub_id
        released = 0
        while True:
            try:
                data = sock.recv(_RELEASE_RECV)
            except (BlockingIOError, InterruptedError):
                return released
            except OSError as exc:
                self._drop(conn, f"receive failed: {exc}")
                return released
            if not data:
                self._drop(conn, "disconnected")
                return released
            try:
                msg = proto.decode(data)
                if type(msg) is proto.Release:
                    book.release(sub_id, msg.seq, msg.slot)
                    released += 1
                    continue
                if type(msg) is proto.Bye:
                    self._drop(conn, "said BYE")
                    return released
                raise ProtocolError(f"unexpected {type(msg).__name__} from a subscriber")
            except ProtocolError as exc:
                self._drop(conn, f"protocol error: {exc}")
                return released

    def _drop(self, conn: _Conn, reason: str) -> None:
        info = conn.info
        if self._conns.pop(info.sub_id, None) is None:
            return
        self._by_fd.pop(conn.fd, None)
        with contextlib.suppress(KeyError, ValueError):
            self._poller.unregister(conn.fd)
        self._book.remove_subscriber(info.sub_id)
        conn.sock.close()
        with self._acc.lock:
            self._acc.count -= 1
        self.last_leave_reason = reason
        self._callback(self._on_leave, info, "on_leave")

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
    hello:
        Opaque bytes for the publisher (at most 64 KiB).
    timeout:
        Seconds for connect and handshake; also how long ``release`` may wait
        for room in the socket.
    allowed_uids:
        Uids the publisher may run as (``SO_PEERCRED``); default: own euid.

    Raises
    ------
    PeerRefusedError
        The publisher refused (the reason is in the message) or runs as a uid
        not allowed here.
    TransportError
        Connecting failed (no publisher, no permission).
    ProtocolError
        The publisher's reply is malformed.
    EndOfStream
        The publisher closed the connection during the handshake.
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
    ) -> None:
        if mode not in proto.MODE_CODES:
            raise ValueError(f"mode must be 'block' or 'latest', not {mode!r}")
        if credit is None:
            credit = 1 if mode == "latest" else DEFAULT_BLOCK_CREDIT
        self.address = os.fspath(address)
        self.mode = mode
        self.credit = int(credit)
        self._timeout = timeout
        hello_msg = proto.encode_hello(proto.MODE_CODES[mode], self.credit, os.getpid(), hello)
        allowed = frozenset({os.geteuid()} if allowed_uids is None else allowed_uids)
        self._held: dict[int, int] = {}
        self._eos: str | None = None
        self._eos_clean = False
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
        self.welcome_payload = welcome.payload
        self._buf = bytearray(proto.MAX_FRAME_SIZE + 1)
        self._view = memoryview(self._buf)
        self._poller = select.poll()
        self._poller.register(self._sock, _POLLIN)

    def _handshake(self, hello_msg: bytes, allowed: frozenset[int]) -> proto.Welcome:
        sock = self._sock
        sock.settimeout(self._timeout)
        try:
            sock.connect(self.address)
        except TimeoutError:
            raise
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
        sock.send(hello_msg)
        data, fds, flags, _ = socket.recv_fds(sock, proto.MAX_WELCOME_SIZE + 1, MAX_FDS)
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
        sock.setblocking(False)
        return msg

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
        EndOfStream
            The publisher said BYE, closed or died (and on every later call).
        TimeoutError
            No frame within ``timeout``.
        ProtocolError
            The publisher sent something malformed; the connection is closed.
        PoolClosedError
            This subscriber is closed.
        """
        if self._closed:
            raise PoolClosedError("the subscriber is closed")
        if self._eos is not None:
            raise EndOfStream(self._eos, self._eos_clean)
        sock = self._sock
        deadline = None
        while True:
            try:
                n = sock.recv_into(self._buf)
                break
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                self._end(f"the connection to the publisher failed: {exc}")
            if timeout is not None:
                if deadline is None:
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0.0:
                    raise TimeoutError(f"no frame within {timeout} s")
                self._poller.poll(_ms(remaining))
            else:
                self._poller.poll(-1)
        if n == 0:
            self._end("the publisher closed the connection")
        try:
            msg = proto.decode(self._view[:n])
            if type(msg) is Frame:
                if msg.slot >= self.num_slots:
                    raise ProtocolError(
                        f"frame {msg.seq} names slot {msg.slot} of {self.num_slots}"
                    )
                if msg.seq in self._held:
                    raise ProtocolError(f"frame {msg.seq} received twice")
                self._held[msg.seq] = msg.slot
                return msg
            if type(msg) is proto.Bye:
                self._end("the publisher said BYE", clean=True)
            raise ProtocolError(f"unexpected {type(msg).__name__} from the publisher")
        except ProtocolError as exc:
            self._eos = f"the connection was closed after a protocol error: {exc}"
            _close_subscriber(self._sock, [])
            raise

    def _end(self, reason: str, clean: bool = False) -> NoReturn:
        self._eos = reason
        self._eos_clean = clean
        raise EndOfStream(reason, clean)

    def release(self, seq: int, slot: int) -> None:
        """Return the lease on frame ``seq`` in ``slot``.

        After the publisher ended, releasing only forgets the frame locally.

        Raises
        ------
        ProtocolError
            This subscriber does not hold that frame (never received, released
            twice, wrong slot); nothing is sent.
        TimeoutError
            The publisher did not drain its socket within ``timeout``.
        PoolClosedError
            This subscriber is closed.
        """
        if self._closed:
            raise PoolClosedError("the subscriber is closed")
        held = self._held.get(seq)
        if held is None or held != slot:
            raise ProtocolError(f"release of frame {seq} in slot {slot}, which is not held")
        del self._held[seq]
        if self._eos is not None:
            return
        msg = proto.encode_release(seq, slot)
        try:
            self._sock.send(msg)
        except BlockingIOError:
            self._send_stalled(msg)
        except OSError:
            pass  # the publisher is gone; the next recv reports the end

    def _send_stalled(self, msg: bytes) -> None:
        poller = select.poll()
        poller.register(self._sock, _POLLOUT)
        deadline = time.monotonic() + self._timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0.0:
                raise TimeoutError(f"the publisher did not take a RELEASE within {self._timeout} s")
            poller.poll(_ms(remaining))
            try:
                self._sock.send(msg)
                return
            except BlockingIOError:
                continue
            except OSError:
                return


__all__ = ["Frame", "PublisherCore", "SubscriberCore", "SubscriberInfo"]
