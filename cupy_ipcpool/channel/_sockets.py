"""What the channel's handshake thread and both session cores share: compiled calls, ends.

The engine's per-frame socket calls of the subscriber (``cupy_ipcpool._engine``:
``recv_frame``, ``release_frame``, ``pollfds``) are loaded here, once, at the
first session (:func:`_load_frameio`), and used from here by
:mod:`._subscriber_core`; the publisher's are its lease book's wire
(:meth:`LeaseBook.wire`).  The helpers below end
a connection without losing what the peer must still read: the BYE of a
clean close, the eviction notice of a dropped subscriber.
"""

from __future__ import annotations

import contextlib
import errno
import math
import select
import socket
import time
import warnings
from typing import TYPE_CHECKING

from .._errors import TeardownWarning, UsageError
from . import _protocol as proto

if TYPE_CHECKING:  # imported at the first session (_load_frameio), used by the two cores
    from .._engine import pollfds, recv_frame, release_frame  # noqa: F401

#: Most fds one SCM_RIGHTS message carries on Linux (``SCM_MAX_FD``).
MAX_FDS = 253
#: Default credit of a ``"block"`` subscriber (informational; the ring bounds it).
DEFAULT_BLOCK_CREDIT = 64
#: Longest busy-poll a ``spin_us`` argument may ask for (10 ms).
MAX_SPIN_US = 10_000

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_POLLRDHUP = select.POLLRDHUP
_DONTWAIT = socket.MSG_DONTWAIT
_FRAME_HEAD_SIZE = proto.MAX_FRAME_SIZE - proto.MAX_FRAME_PAYLOAD

# The engine's per-frame calls (c/python/frameio.c) write FRAME and RELEASE datagrams
# themselves: a build that disagrees is refused.
_PROTOCOL = proto.ENGINE_PROTOCOL


def _load_frameio() -> None:
    """Import the compiled calls into this module's namespace (at the first session).

    Not at import time: ``import cupy_ipcpool`` (and ``python -m cupy_ipcpool
    info``, which reports a missing build) works without them.

    Raises
    ------
    ImportError
        The extension is not built, or was built for another protocol.
    """
    global pollfds, recv_frame, release_frame
    if "recv_frame" in globals():
        return
    from .._compiled import load

    engine = load("cupy_ipcpool._engine", PROTOCOL=_PROTOCOL)
    pollfds, recv_frame, release_frame = (
        engine.pollfds,
        engine.recv_frame,
        engine.release_frame,
    )


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


def _us(timeout: float | None) -> int:
    """Convert seconds (None = forever) to a wait's timeout in microseconds (-1: forever)."""
    if timeout is None:
        return -1
    return max(0, math.ceil(timeout * 1e6))


def _warn(message: str) -> None:
    warnings.warn(message, TeardownWarning, stacklevel=3)


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


def _linger(socks: list[socket.socket], linger: float) -> bool:
    """Send BYE on each socket and wait up to ``linger`` s for all peers to hang up."""
    if not socks:
        return True
    poller = select.poll()
    waiting: dict[int, socket.socket] = {}
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            while sock.recv(proto.MAX_FRAME_SIZE, socket.MSG_DONTWAIT):
                pass
        try:
            sock.send(proto.encode_bye(), socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError:
            continue  # already gone
        waiting[sock.fileno()] = sock
        poller.register(sock, _POLLIN)
    deadline = time.monotonic() + linger
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        for fd, _events in poller.poll(_ms(remaining)):
            sock = waiting[fd]
            try:
                while True:
                    data = sock.recv(proto.MAX_FRAME_SIZE, socket.MSG_DONTWAIT)
                    if not data:
                        raise ConnectionResetError
            except BlockingIOError:
                continue
            except OSError:
                poller.unregister(fd)
                del waiting[fd]
    return True


__all__ = ["DEFAULT_BLOCK_CREDIT", "MAX_FDS", "MAX_SPIN_US"]
