"""What a survivor does when a session ends: the flags a dead peer never writes.

A stream may wait on a flag in the sync page that only the peer process
writes: the subscriber's stream on a frame flag (set by the producer's
stream), the producer's stream on a read flag (set by a subscriber's stream
on release).  When that process dies, its queued writes die with its CUDA
context and such a wait would never end; the sync page is shared host
memory, so the survivor writes the flag itself from the host.  A flag is
forced only once its writer is dead (a pidfd says so): while the writer
lives, others wait on the same flags for its data.

This module needs no GPU: it works on :class:`~._syncpage.SharedFlags` and
on stream trackers that answer ``idle()`` and ``synchronize()``; the
subscriber and the publisher pass theirs.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import time
from typing import Protocol

from .._arrays import cupy_module
from ._syncpage import FlagLayout, FrameWaits, SharedFlags

#: Most streams a publisher tracks before it forgets idle ones.
STREAMS_KEPT = 16


def open_pidfd(pid: int) -> int:
    """A pidfd of ``pid`` (readable once it exits), or -1 where none can be had."""
    if pid <= 0:
        return -1
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


def close_pidfd(pidfd: int) -> None:
    """Close ``pidfd`` unless it is -1; never raises."""
    if pidfd >= 0:
        with contextlib.suppress(OSError):
            os.close(pidfd)


def exited(pidfd: int) -> bool:
    """True once the process of ``pidfd`` has exited."""
    return pidfd >= 0 and bool(select.select([pidfd], [], [], 0)[0])


class DepartedReader:
    """A subscriber that left while the publisher's streams may still wait on its read flags.

    Its row is kept out of reuse until its flags are seen at ``values`` (the
    generations the publisher may wait for), or its process has exited (then
    they are forced: the writes died with its CUDA context), or the row is
    needed for a newcomer, or the publisher closes.
    """

    __slots__ = ("index", "pidfd", "values")

    def __init__(self, index: int, pidfd: int, values: list[int]) -> None:
        self.index = index
        self.pidfd = pidfd
        self.values = values

    def settled(self, flags: SharedFlags, layout: FlagLayout) -> bool:
        """True once every flag of the row is at its value (nothing to wait for)."""
        return all(
            flags.reached(layout.read_offset(self.index, slot), value)
            for slot, value in enumerate(self.values)
        )

    def force(self, flags: SharedFlags, layout: FlagLayout) -> int:
        """Write the row's flags from the host; return how many had to be written."""
        return sum(
            flags.force(layout.read_offset(self.index, slot), value)
            for slot, value in enumerate(self.values)
        )

    def close(self) -> None:
        close_pidfd(self.pidfd)
        self.pidfd = -1


class PageStreams:
    """Raw streams the publisher queued flag operations on (frame-flag writes, read-flag waits).

    Closing the publisher waits for them before it unmaps the sync page.
    """

    __slots__ = ("ptrs",)

    def __init__(self) -> None:
        self.ptrs: dict[int, None] = {}

    def note(self, ptr: int) -> None:
        ptrs = self.ptrs
        if ptr in ptrs:
            return
        if len(ptrs) >= STREAMS_KEPT:
            for known in [p for p in ptrs if self._idle(p)]:
                del ptrs[known]
        ptrs[ptr] = None

    @staticmethod
    def _idle(ptr: int) -> bool:
        try:
            return bool(cupy_module().cuda.runtime.streamQuery(ptr) == 0)
        except Exception:  # not a valid stream any more
            return True

    def idle(self) -> bool:
        return all(self._idle(p) for p in self.ptrs)

    def synchronize(self) -> None:
        if not self.ptrs:
            return
        rt = cupy_module().cuda.runtime
        ptrs, self.ptrs = self.ptrs, {}
        for ptr in ptrs:
            with contextlib.suppress(Exception):  # destroyed meanwhile: nothing to wait for
                rt.streamSynchronize(ptr)


class Streams(Protocol):
    """A tracker of the streams that queued flag operations (subscriber's or publisher's)."""

    def idle(self) -> bool: ...

    def synchronize(self) -> None: ...


def settle_streams(
    flags: SharedFlags, streams: Streams, waits: FrameWaits, pidfd: int, grace: float
) -> bool:
    """Wait until no stream of this subscriber has a flag operation left that may not end.

    While the producer lives, every frame flag our streams wait on gets set.
    Once it is dead (its pidfd readable, now or while we wait), the flags
    still awaited are forced (:meth:`FrameWaits.resolve`), so those waits end.
    A flag is never forced while the producer may still write it: other
    subscribers' streams wait on the same flag for the producer's data.

    Returns
    -------
    bool
        True when the streams are done with the page; False when a live
        producer (or one that cannot be watched: no pidfd) left a flag unset
        for ``grace`` seconds while a stream of ours still waits.
    """
    watch = [pidfd] if pidfd >= 0 else []
    if watch and select.select(watch, [], [], 0)[0]:
        waits.resolve(flags)
        streams.synchronize()
        return True
    deadline = time.monotonic() + (grace if math.isfinite(grace) else 3600.0)
    pause = 0.0005
    while waits.pending(flags) and not streams.idle():
        if time.monotonic() >= deadline:
            return False
        if watch:
            if select.select(watch, [], [], pause)[0]:  # it died: its flags will never come
                waits.resolve(flags)
                break
        else:
            time.sleep(pause)
        pause = min(pause * 2, 0.01)
    streams.synchronize()  # every flag they wait on is set now: this ends
    return True


def settle_page(
    flags: SharedFlags,
    layout: FlagLayout,
    streams: Streams,
    gone: list[DepartedReader],
    grace: float,
) -> bool:
    """Wait until no stream of the publisher has a flag operation left on the page.

    The read flags of subscribers that died are forced (their writes died with
    them); a live one's are awaited.  False if a stream still waits on a live
    subscriber's flag after ``grace`` seconds.
    """
    deadline = time.monotonic() + grace
    pause = 0.0005
    while True:
        for d in gone:
            if exited(d.pidfd):
                d.force(flags, layout)
        if streams.idle() or all(d.settled(flags, layout) for d in gone):
            streams.synchronize()  # every flag they may wait on is in: this ends
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
