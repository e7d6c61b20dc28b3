"""Waiting for a publisher that is not up yet (no GPU here).

:func:`connect_waiting` retries a subscription while nobody listens at the
address yet (the socket file is missing, or left behind by a publisher that
exited: ``ENOENT`` / ``ECONNREFUSED``), or while the publisher there goes away
during the handshake; ``subscribe(..., wait=seconds)`` uses it, and so does
:class:`~cupy_ipcpool.channel.Follower` between two publishers.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import TypeVar

from .._errors import ChannelTimeoutError, EndOfStream, TransportError, UsageError

T = TypeVar("T")

#: errno values of a connect that found nobody listening (yet) at the address.
NOT_UP = frozenset({errno.ENOENT, errno.ECONNREFUSED})
#: First and longest pause between two attempts to connect, in seconds.
_FIRST_PAUSE = 0.002
_LONGEST_PAUSE = 0.05


def check_wait(wait: float, name: str = "wait") -> float:
    """``wait`` as seconds (``math.inf``: no limit); a negative or NaN value is a UsageError."""
    try:
        seconds = float(wait)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be seconds (a number, or math.inf), not {wait!r}") from None
    if not seconds >= 0.0:
        raise UsageError(f"{name} must be 0 or more seconds (math.inf: no limit), not {wait!r}")
    return seconds


def connect_waiting(connect: Callable[[], T], address: str, wait: float) -> T:
    """Call ``connect()`` until a publisher answers at ``address``, for up to ``wait`` seconds.

    Retried: a connect that finds nobody listening (:data:`NOT_UP`) and an
    :class:`EndOfStream` during the handshake (the publisher closed or died
    just then).  Everything else (a refusal, a uid not allowed, a malformed
    WELCOME) is raised at once.  With ``wait=0``, ``connect()`` is called once.

    Raises
    ------
    ChannelTimeoutError
        No publisher answered within ``wait`` seconds (the message has the
        last attempt's error).
    """
    wait = check_wait(wait)
    if wait == 0.0:
        return connect()
    deadline = time.monotonic() + wait
    pause = _FIRST_PAUSE
    while True:
        try:
            return connect()
        except TransportError as exc:
            if exc.errno not in NOT_UP:
                raise
            last: Exception = exc
        except EndOfStream as exc:  # it went away during the handshake: the next one may come
            last = exc
        left = deadline - time.monotonic()
        if left <= 0.0:
            raise ChannelTimeoutError(
                f"no publisher answered at {address} within {wait} s (last attempt: {last})"
            ) from None
        time.sleep(min(pause, left))
        pause = min(pause * 2, _LONGEST_PAUSE)
