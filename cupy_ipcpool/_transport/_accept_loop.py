"""One accept loop: a listening socket and the connections it accepted, on one thread.

The remote server (``cupy_ipcpool.remote._accept.Acceptor``) serves a listening
socket and the connections it accepted from one daemon thread that never blocks
on a connection (the fd server's and the channel publisher's threads of this kind
are the engine's: ``c/src/fdserver.c``, ``c/src/acceptor.c``).  :class:`AcceptLoop`
is that thread; what a connection does once
accepted (a request, a handshake, a wait for a hang-up) is its user's, in
callbacks.  The loop owns:

- the ``poll`` set: the listener, a wake pipe, and each connection its user
  watches, registered under its fd *with its owner object*.  An event is
  handed to the owner registered under that fd when ``poll`` returned, and
  only while it still is: handling one event of a batch may end a connection,
  and the kernel gives its number to the next one accepted, maybe in the same
  batch; the old event is not the newcomer's.
- accept: at most :data:`ACCEPT_BATCH` connections a turn, each non-blocking
  and handed to ``on_accept``.  When accept fails for want of fds or memory
  (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) the queued connection stays
  queued and the listener stays readable: the loop stops polling the
  listener for :data:`ACCEPT_BACKOFF_S` instead of spinning on it, and keeps
  serving the connections it has (and its wake pipe) meanwhile.
- deadlines: the user's book (:class:`~._admission.Admission` or one built on
  it) bounds each ``poll``; the keys it reports expired go to ``on_expired``.
- stop and wake: :meth:`stop` ends the thread at once (also during a
  back-off), joins it, and closes the listener; :meth:`wake` makes the thread
  call ``on_wake``.
- failure: an exception out of a callback is a bug of its user; the thread
  ends, says so (``failure``, and a :class:`RuntimeWarning`), and ``on_exit``
  still runs.  Callbacks catch what a connection may legitimately raise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from .._errors import TeardownWarning, UsageError

__all__ = ["ACCEPT_BACKOFF_S", "ACCEPT_BATCH", "HANDSHAKE_TIMEOUT", "STOP_TIMEOUT_S", "AcceptLoop"]

#: Seconds a connecting peer has, from accept, to finish its handshake: the
#: channel's HELLO, the remote server's HELLO and PROOF (one deadline, not per read).
HANDSHAKE_TIMEOUT = 5.0

#: Seconds the loop leaves its listener alone after accept(2) failed for want of
#: fds or memory: the connection stays queued and would make ``poll`` return at
#: once.  It is accepted on the first try after that once fds are free again.
ACCEPT_BACKOFF_S = 0.05

#: Most connections accepted in one turn; then the connections already watched have theirs.
ACCEPT_BATCH = 64

#: Seconds :meth:`AcceptLoop.stop` waits for the thread (only a blocked callback takes longer).
STOP_TIMEOUT_S = 5.0

#: accept(2) errors that mean this process or the kernel is out of fds or memory.
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

T = TypeVar("T")


class Deadlines(Protocol):
    """What the loop asks of its user's book of deadlines."""

    def next_deadline(self) -> float | None: ...

    def expired(self, now: float) -> list[int]: ...


class AcceptLoop(Generic[T]):
    """Accept connections on ``listener`` and drive them from one daemon thread.

    Parameters
    ----------
    listener:
        A bound, listening socket, non-blocking; :meth:`stop` closes it.
    name:
        The thread's name (and what warnings call it).
    on_accept:
        ``on_accept(sock, address)`` for each connection accepted (``sock``
        already non-blocking); the socket is the callback's from then on.
    on_event:
        ``on_event(owner, events)`` for each ``poll`` event of a connection
        that the user :meth:`watch` es.
    deadlines, on_expired:
        ``poll`` waits at most until ``deadlines.next_deadline()``; after each
        turn every key of ``deadlines.expired(now)`` goes to ``on_expired``.
    on_wake:
        Called on the thread after :meth:`wake` (not after :meth:`stop`).
    on_exit:
        Called last on the thread, however it ends: the user ends what it
        still holds.
    backoff:
        Seconds of the back-off after an out-of-resources accept
        (:data:`ACCEPT_BACKOFF_S`).

    Attributes
    ----------
    failure:
        Why the thread ended by itself (a callback raised); None otherwise.
    backoffs:
        How many times accept failed for want of fds or memory.
    """

    def __init__(
        self,
        listener: socket.socket,
        *,
        name: str,
        on_accept: Callable[[socket.socket, Any], None],
        on_event: Callable[[T, int], None],
        deadlines: Deadlines | None = None,
        on_expired: Callable[[int], None] | None = None,
        on_wake: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        backoff: float = ACCEPT_BACKOFF_S,
    ) -> None:
        if not backoff > 0:
            raise UsageError(f"backoff must be positive, not {backoff}")
        self.listener = listener
        self.name = name
        self.backoff = float(backoff)
        self.stopping = False
        self.failure: str | None = None
        self.backoffs = 0
        self._on_accept = on_accept
        self._on_event = on_event
        self._deadlines = deadlines
        self._on_expired = on_expired
        self._on_wake = on_wake
        self._on_exit = on_exit
        self._listen_fd = listener.fileno()
        self._owners: dict[int, T] = {}  # fd -> the connection it is watched for
        self._poller = select.poll()
        self._resume_at: float | None = None  # the listener is left alone until then
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._stopped = False
        self._exited = False  # the thread ran its last line
        self._orphaned = False  # stop() gave up waiting: the thread closes the pipe
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- the user's side --

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def wake(self) -> None:
        """Make the thread call ``on_wake`` (soon; several calls may make one)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"w")

    def stop(self) -> None:
        """End the thread, join it, close the listener and the wake pipe.

        Idempotent.  Warns (:class:`TeardownWarning`) if the thread is still
        running after :data:`STOP_TIMEOUT_S` (a callback blocks); it then
        closes its wake pipe itself when it ends.
        """
        self.stopping = True
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        thread = self.thread
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(STOP_TIMEOUT_S)
            if thread.is_alive():
                with contextlib.suppress(Exception):
                    warnings.warn(
                        f"{self.name}: the accept thread did not stop within {STOP_TIMEOUT_S} s",
                        TeardownWarning,
                        stacklevel=2,
                    )
        self.listener.close()
        with self._lock:
            close_now = self._exited or thread.ident is None
            self._orphaned = not close_now
        if close_now:
            self._close_pipe()

    def watch(self, fd: int, owner: T, events: int) -> None:
        """Poll ``fd`` for ``events`` on behalf of ``owner`` (on the thread).

        Whatever was watched under that number before is replaced: its socket
        was closed (the kernel gives a closed number to the next one opened).
        """
        self._owners[fd] = owner
        self._poller.register(fd, events)

    def modify(self, fd: int, owner: T, events: int) -> None:
        """Poll ``owner``'s ``fd`` for ``events`` instead (if it is still watched for it)."""
        if self._owners.get(fd) is owner:
            self._poller.modify(fd, events)

    def forget(self, fd: int, owner: T) -> bool:
        """Stop polling ``fd`` if it is still watched for ``owner``; True if it was."""
        if self._owners.get(fd) is not owner:
            return False
        del self._owners[fd]
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._poller.unregister(fd)
        return True

    def watched(self) -> list[T]:
        """The owners watched now."""
        return list(self._owners.values())

    # -- the thread --

    def _run(self) -> None:
        try:
            self._poller.register(self._listen_fd, select.POLLIN)
            self._poller.register(self._wake_r, select.POLLIN)
            while self._turn():
                pass
        except Exception as exc:  # a bug of a callback: say so instead of dying silently
            self.failure = f"the accept thread failed: {exc!r}"
            with contextlib.suppress(Exception):
                warnings.warn(f"{self.name}: {self.failure}", RuntimeWarning, stacklevel=1)
        finally:
            try:
                if self._on_exit is not None:
                    self._on_exit()
            finally:
                self._owners.clear()
                with self._lock:
                    self._exited = True
                    orphaned = self._orphaned
                if orphaned:
                    self._close_pipe()

    def _turn(self) -> bool:
        """One ``poll`` and what it reported; False when the thread should stop."""
        if self.stopping:
            return False
        now = time.monotonic()
        if self._resume_at is not None and now >= self._resume_at:
            self._resume_at = None
            self._poller.register(self._listen_fd, select.POLLIN)
        deadline = None if self._deadlines is None else self._deadlines.next_deadline()
        if self._resume_at is not None and (deadline is None or self._resume_at < deadline):
            deadline = self._resume_at
        # +1 ms: wake just after the deadline, not just before it
        timeout = -1 if deadline is None else max(0, int((deadline - now) * 1000.0) + 1)
        events = self._poller.poll(timeout)
        if self.stopping:
            return False
        # Each event belongs to the connection watched under its fd when poll returned;
        # handling an earlier event of the batch may end that connection and give its
        # number to a newcomer, which the later event was not raised for.
        batch = [(fd, ev, self._owners.get(fd)) for fd, ev in events]
        for fd, ev, owner in batch:
            if fd == self._listen_fd:
                self._accept_all()
            elif fd == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                if self.stopping:
                    return False
                if self._on_wake is not None:
                    self._on_wake()
            elif owner is None or self._owners.get(fd) is not owner:
                continue  # raised for a connection that is gone
            else:
                self._on_event(owner, ev)
        if self._deadlines is not None and self._on_expired is not None:
            for key in self._deadlines.expired(time.monotonic()):
                self._on_expired(key)
        return True

    def _accept_all(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._back_off()
                    return
                # that connection's own error (ECONNABORTED, or a network error
                # accept(2) passes on): the next one
                continue
            sock.setblocking(False)
            self._on_accept(sock, address)

    def _back_off(self) -> None:
        """Leave the listener alone for :attr:`backoff` seconds (out of fds or memory)."""
        self.backoffs += 1
        self._resume_at = time.monotonic() + self.backoff
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._poller.unregister(self._listen_fd)

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
