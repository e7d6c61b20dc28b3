"""Following a publisher across restarts (no GPU here).

:class:`Follower` receives frames across publisher restarts: when a
subscription ends other than by a clean close, it closes the old subscriber
and subscribes again, to whichever publisher comes up at the address next.

It is written against a ``connect`` callable and a subscriber with
``recv`` and ``close``, so the same code serves the GPU :class:`Subscriber`
(:func:`follow`) and the GPU-free session core (the CPU tests).
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar, overload

from .._args import deprecated, keyword_only_signature, moved_to_keywords, optional_device
from .._errors import ChannelTimeoutError, EndOfStream, PoolClosedError, UsageError
from .._transport._closing import ClosedFlag
from ._iterate import frames_until_clean_end
from ._subscriber import subscribe
from ._waiting import check_wait, connect_waiting


class _Receiver(Protocol):
    def recv(self, *, timeout: float | None = ...) -> Any: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=_Receiver)


class Follower(ClosedFlag, Generic[S]):
    """Frames from whichever publisher serves an address, across its restarts.

    Made by :func:`cupy_ipcpool.follow`.  It subscribes at the first
    :meth:`recv` (waiting up to ``wait`` seconds for a publisher), and when
    the subscription ends with ``EndOfStream(clean=False)`` -- the publisher
    died, was killed, hung up, or evicted this subscriber -- it closes that
    subscriber and subscribes again, waiting for the next publisher at the
    same address.  A clean close of the publisher (BYE) ends the iteration,
    unless ``restart_on_close`` is set.

    Parameters
    ----------
    connect:
        Makes one subscription (raises as ``subscribe`` does).
    address:
        The address, for messages.
    wait:
        Seconds to wait for a publisher each time one is needed (the first,
        and each after a restart); ``math.inf`` (default): no limit.
    restart_on_close:
        Also wait for the next publisher after a clean close.

    Attributes
    ----------
    reconnects:
        Subscriptions made after the first: how many times a publisher was
        replaced (or this subscriber re-admitted after an eviction).
    last_end:
        The :class:`EndOfStream` that ended the previous subscription, or None.

    Notes
    -----
    Each subscription has its own publisher, pool and sequence numbers: after
    a restart ``seq`` starts again from the new publisher's first frame, and
    the frames' slots belong to the new pool.  Frames received before a
    restart stay valid memory until they are released or dropped (their
    slots stay mapped); releasing them does nothing (their publisher is
    gone).  Compare :attr:`reconnects` (or :attr:`subscriber`) before and
    after a :meth:`recv` to see that a frame comes from a new publisher.
    """

    def __init__(
        self,
        connect: Callable[[], S],
        address: str,
        *,
        wait: float = math.inf,
        restart_on_close: bool = False,
    ) -> None:
        self._connect = connect
        self.address = address
        self.wait = check_wait(wait)
        self.restart_on_close = bool(restart_on_close)
        self._sub: S | None = None
        self._sessions = 0
        self._closed = False
        self._ended = False
        self.last_end: EndOfStream | None = None

    @property
    def subscriber(self) -> S | None:
        """The current subscription (None before the first and between two)."""
        return self._sub

    @property
    def reconnects(self) -> int:
        """Subscriptions made after the first."""
        return max(0, self._sessions - 1)

    @overload
    def recv(self, *, timeout: float | None = None, **kwargs: Any) -> Any: ...
    @overload
    @deprecated("pass timeout by keyword: recv(timeout=...)")
    def recv(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any: ...
    @keyword_only_signature
    def recv(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """The next frame, from this publisher or the next one.

        Parameters
        ----------
        timeout:
            Seconds to wait for a frame (None: no limit), waiting for a new
            publisher included (which ``wait`` also bounds).
        **kwargs:
            Passed to the subscriber's ``recv`` (``stream=``).

        Raises
        ------
        EndOfStream
            The publisher closed cleanly (``clean=True``; unless
            ``restart_on_close``), and on every later call.
        ChannelTimeoutError
            No frame within ``timeout``, or no publisher within ``wait``; the
            follower stays usable.
        ProtocolError
            A publisher sent a malformed message (that subscription is closed;
            the next call subscribes again).
        PoolClosedError
            The follower is closed.
        """
        if args:
            (timeout,) = moved_to_keywords(Follower.recv, args, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise PoolClosedError("the follower is closed")
            if self._ended:
                assert self.last_end is not None
                raise EndOfStream(str(self.last_end), True)
            sub = self._sub
            if sub is None:
                sub = self._subscribe(deadline)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            receive: Any = sub.recv  # with the subscriber's own keywords (stream=)
            try:
                return receive(timeout=left, **kwargs)
            except EndOfStream as exc:
                self._drop(exc)
                if exc.clean and not self.restart_on_close:
                    self._ended = True
                    raise
            except BaseException as exc:
                if getattr(sub, "closed", False) and not isinstance(exc, ChannelTimeoutError):
                    self._drop(None)  # it closed itself (a malformed message): start over next time
                raise

    def _subscribe(self, deadline: float | None) -> S:
        wait = self.wait
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        sub = connect_waiting(self._connect, self.address, wait if wait > 0.0 else 1e-9)
        if self._closed:  # closed from another thread meanwhile
            sub.close()
            raise PoolClosedError("the follower is closed")
        self._sub = sub
        self._sessions += 1
        return sub

    def _drop(self, end: EndOfStream | None) -> None:
        sub, self._sub = self._sub, None
        if end is not None:
            self.last_end = end
        if sub is not None:
            sub.close()

    def __iter__(self) -> Iterator[Any]:
        """Yield frames until a publisher closes cleanly (or forever, with ``restart_on_close``)."""
        return frames_until_clean_end(self.recv)

    def close(self) -> None:
        """Close the current subscription and stop.  Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self._drop(None)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "subscribed" if self._sub is not None else "waiting"
        return f"Follower({self.address!r}, {state}, reconnects={self.reconnects})"


def follow(
    address: str | os.PathLike[str],
    *,
    wait: float = math.inf,
    restart_on_close: bool = False,
    **options: Any,
) -> Follower[Any]:
    """A :class:`Follower` over :func:`~cupy_ipcpool.channel.subscribe` (``options``: its own)."""
    text = os.fspath(address)
    try:  # the options are checked now, not at the first recv
        inspect.signature(subscribe).bind(text, **options)
    except TypeError as exc:
        raise UsageError(f"follow(): {exc}") from None
    if "device" in options:
        options["device"] = optional_device(options["device"])
    mode = options.get("mode", "block")
    if mode not in ("block", "latest", "ahead"):
        raise UsageError(f"mode must be 'block', 'latest' or 'ahead', not {mode!r}")
    return Follower(
        lambda: subscribe(text, **options), text, wait=wait, restart_on_close=restart_on_close
    )
