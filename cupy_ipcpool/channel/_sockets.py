"""What the channel's handshake thread and both session cores share: compiled calls, ends.

The engine's per-frame socket calls of the subscriber (``cupy_ipcpool._engine``:
``recv_frame``, ``release_frame``, ``pollfds``) are loaded here, once, at the
first session (:func:`_load_frameio`), and used from here by
:mod:`._subscriber_core`; the publisher's are its lease book's wire
(:meth:`LeaseBook.wire`).  The helper below ends
a connection without losing what the peer must still read (the BYE of a
clean close); the publisher's session ends its subscribers' in the engine
(``c/src/pub_session.c``).
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
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


def _say_bye_and_close(sock: socket.socket) -> None:
    # Drain what the peer sent first: closing with unread data resets the peer,
    # which would then lose the frames still queued for it and the BYE.
    with contextlib.suppress(OSError):
        sock.setblocking(False)  # with a timeout set, Python would wait before each call
        while sock.recv(proto.MAX_FRAME_SIZE, socket.MSG_DONTWAIT):
            pass
    with contextlib.suppress(OSError):
        sock.send(proto.bye_message(), socket.MSG_DONTWAIT)
    sock.close()


__all__ = ["DEFAULT_BLOCK_CREDIT", "MAX_FDS", "MAX_SPIN_US"]
