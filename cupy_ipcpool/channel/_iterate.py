"""Iterating a subscription: frames until the stream ends (no GPU here).

Every subscriber (:class:`~cupy_ipcpool.channel.Subscriber`,
:class:`~cupy_ipcpool.channel.Follower`, the remote and host-memory ones)
iterates the same way: :func:`frames_until_clean_end` over its ``recv``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from .._errors import EndOfStream

__all__ = ["frames_until_clean_end"]

F = TypeVar("F")


def frames_until_clean_end(recv: Callable[[], F]) -> Iterator[F]:
    """Yield ``recv()`` until it raises :class:`EndOfStream`.

    A clean end (``exc.clean``) ends the iteration; any other end, and any
    other exception, propagates.  ``recv`` is called once per frame, with no
    layer between it and the loop.
    """
    while True:
        try:
            frame = recv()
        except EndOfStream as exc:
            if exc.clean:
                return
            raise
        yield frame
