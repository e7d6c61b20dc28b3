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
subscriber and the publisher pass theirs (:class:`PageStreams`, the one
tracker both use; only its methods touch CUDA).

It owns the waits of this rule, each one constant, also generated into the
C library's ``cupy_ipcpool_wire.h`` by ``c/gen_wire.py``: :data:`DEATH_WAIT`
(a hang-up without BYE, before the peer's pidfd says it exited) and
:data:`CLOSE_GRACE` (a close waiting for a live peer's flag).  The death
watch itself is :func:`exited` (one pidfd, with a wait) and
:func:`settle_if_dead` (force a dead producer's flags).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .._arrays import cupy_module
from . import _syncpage
from ._syncpage import FlagLayout, FrameWaits, SharedFlags

if TYPE_CHECKING:
    from .._engine import ReaderRows

#: Seconds a subscriber waits, after the publisher hung up without BYE while a stream
#: of its own waits on a frame flag the host does not see set, for the publisher's
#: pidfd to say it exited (then the flags are forced before the end is reported).
#: A dying process's sockets close before its pidfd fires, and a CUDA process's exit
#: takes seconds while the driver tears its context down: 5 s covers that (1 s, as
#: the Python side had, reported such ends with the flags still unforced), and is
#: spent only where a stream really waits and the producer, alive, just hung up.
#: The C library's ``CIP_WIRE_DEATH_WAIT_MS``.
DEATH_WAIT = 5.0

#: Seconds a close waits for the flag operations queued on its own streams while a
#: *live* peer still has to set a flag one of them waits on; past it the sync page
#: (and a subscriber's slot mappings) are kept mapped, with a ``TeardownWarning``,
#: rather than unmapped under that wait.  A live peer sets such a flag as soon as
#: its queued work before it has run (milliseconds, usually); 5 s is ample for that
#: and keeps a close short, and leaking one page is the safe answer past it.  One
#: value for the Python subscriber (whose close waited its connect ``timeout``,
#: 10 s by default), the Python publisher (``Publisher.close``'s default) and the
#: C library (``CIP_WIRE_CLOSE_WAIT_MS``).
CLOSE_GRACE = 5.0

#: Streams a :class:`PageStreams` holds before a new one makes it forget those with
#: no work left.  Not a cap: a stream with work left is never forgotten (closing
#: must wait for it).  16 covers a stream per worker thread or a small stream pool
#: without any pruning; past it, each new stream costs one ``cudaStreamQuery`` per
#: tracked stream.  One value for subscribers and publishers (which had 8 and 16).
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


def exited(pidfd: int, wait: float = 0.0) -> bool:
    """True once the process of ``pidfd`` has exited, waiting up to ``wait`` seconds.

    The one death watch of the channel: a pidfd is readable once its process
    exited.  False for -1 (no pidfd: the death cannot be seen).  ``poll``, not
    ``select``: a pidfd may be numbered past ``FD_SETSIZE``.
    """
    if pidfd < 0:
        return False
    watch = select.poll()
    watch.register(pidfd, select.POLLIN)
    ms = -1 if not math.isfinite(wait) else math.ceil(wait * 1000) if wait > 0 else 0
    return bool(watch.poll(ms))


def settle_if_dead(flags: SharedFlags, waits: FrameWaits, pidfd: int, wait: float = 0.0) -> bool:
    """If the producer of ``pidfd`` is dead, force the frame flags our streams await.

    ``wait`` (after a hang-up without BYE: :data:`DEATH_WAIT`) is spent only
    while a stream of ours waits on a frame flag the host does not see set:
    with nothing awaited there is nothing to force, and no reason to wait.
    Afterwards no stream of this subscriber waits for the dead producer.

    Returns
    -------
    bool
        True when the producer was seen dead (and its flags forced).
    """
    if not exited(pidfd, wait if wait > 0 and waits.pending(flags) else 0.0):
        return False
    waits.resolve(flags)
    return True


def settle_unpublished(
    flags: SharedFlags, layout: FlagLayout, frames: Iterable[AheadFrame], grace: float
) -> bool:
    """After a clean end (BYE): force the frame flags of frames handed out ahead, never published.

    A subscriber in ``"ahead"`` mode hands frames out before the producer
    writes them (channel/_ahead.py); when the producer then closes, its
    streams still set the flags of the frames it did publish (its close waits
    for them), and the frames after those never come.  For each frame in
    ``frames`` the slot's flag must first show the generation before the
    predicted one (the last published there): the host waits for that, at most
    ``grace`` seconds, sleeping 1 ms between looks (an end of a session, not
    a frame's path).  Then no write of the producer is left for those slots,
    and :meth:`SharedFlags.force_frame` makes each such flag say "never
    written" (:func:`~._syncpage.frame_state` False) and ends every wait on it.

    Returns
    -------
    bool
        True when forced; False when the producer's flags did not come within
        ``grace`` (nothing forced: a stream of it is stuck, and a close then
        keeps the page mapped rather than unmapping under the waits).
    """
    frames = list(frames)
    bases = {f.slot: (f.generation - 1) & 0xFFFFFFFF for f in frames}
    deadline = time.monotonic() + grace
    while not all(flags.reached(layout.frame_offset(s), g) for s, g in bases.items()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    for f in frames:
        flags.force_frame(layout.frame_offset(f.slot), f.generation & 0xFFFFFFFF)
    return True


class AheadFrame(Protocol):
    """What :func:`settle_unpublished` needs of a frame handed out ahead."""

    slot: int
    generation: int


def reader_rows(flags: SharedFlags, layout: FlagLayout) -> ReaderRows:
    """The publisher's rows of read flags in ``flags`` (``c/src/reader_rows.c``).

    Which subscriber writes which row, and the rows of subscribers that left
    while the publisher's streams may still wait on their flags (departed
    readers): such a row is kept out of reuse until its flags are seen at the
    generations the publisher may wait for, or its process has exited (then
    they are forced: the writes died with its CUDA context), or the streams
    are idle, or the row is needed for a newcomer (the oldest is forced), or
    the publisher closes.  The page is held until ``release_page()``.
    """
    return _syncpage._engine().ReaderRows(
        flags.mapping, layout.reads_offset, layout.max_subscribers, layout.num_slots
    )


class PageStreams:
    """Streams that queued flag operations on a sync page and may still run them.

    The one tracker of the subscriber (frame-flag waits, read-flag writes)
    and of the publisher (frame-flag writes, read-flag waits): closing either
    synchronizes these before it unmaps the page.  ``ptrs`` maps each raw
    handle to the stream object it was noted with (None for a raw handle), so
    a CuPy or torch stream is not destroyed while tracked.  At
    :data:`STREAMS_KEPT` entries a new stream makes it forget those with no
    work left (``cudaStreamQuery``); streams with work are always kept.

    On failure one behaviour everywhere: a stream the runtime rejects
    (``cudaStreamQuery``/``cudaStreamSynchronize`` raise) counts as idle and is
    skipped, and the others are still waited for.  Such a failure means a
    context that holds an error (its work will never run again, so nothing
    more touches the page) or a raw handle its owner destroyed; raising
    instead would stop the wait half-way, or turn a user's earlier GPU error
    into a second, misleading one at close.
    """

    __slots__ = ("ptrs",)

    def __init__(self) -> None:
        self.ptrs: dict[int, Any] = {}

    def note(self, ptr: int, stream: Any = None) -> None:
        """Track ``ptr`` (and keep ``stream``, its object, alive while tracked)."""
        ptrs = self.ptrs
        if ptr in ptrs:
            return
        if len(ptrs) >= STREAMS_KEPT:
            for known in [p for p in ptrs if self._idle(p)]:
                del ptrs[known]
        ptrs[ptr] = stream

    def __len__(self) -> int:
        return len(self.ptrs)

    @staticmethod
    def _idle(ptr: int) -> bool:
        try:
            return bool(cupy_module().cuda.runtime.streamQuery(ptr) == 0)
        except Exception:  # not a valid stream any more: nothing to wait for
            return True

    def idle(self) -> bool:
        """True when no tracked stream has work left (``cudaStreamQuery``)."""
        return all(self._idle(p) for p in self.ptrs)

    def synchronize(self) -> None:
        """Wait for every tracked stream, then forget them all."""
        if not self.ptrs:
            return
        rt = cupy_module().cuda.runtime
        ptrs, self.ptrs = self.ptrs, {}
        for ptr in ptrs:
            with contextlib.suppress(Exception):  # rejected: see the class docstring
                rt.streamSynchronize(ptr)

    def clear(self) -> None:
        """Forget every stream (and drop the objects kept)."""
        self.ptrs.clear()


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
    if exited(pidfd):
        waits.resolve(flags)
        streams.synchronize()
        return True
    deadline = time.monotonic() + (grace if math.isfinite(grace) else 3600.0)
    pause = 0.0005
    while waits.pending(flags) and not streams.idle():
        if time.monotonic() >= deadline:
            return False
        if pidfd >= 0:
            if exited(pidfd, pause):  # it died: its flags will never come
                waits.resolve(flags)
                break
        else:
            time.sleep(pause)
        pause = min(pause * 2, 0.01)
    streams.synchronize()  # every flag they wait on is set now: this ends
    return True


class DepartedRows(Protocol):
    """What :func:`settle_page` needs of the publisher's departed readers (:func:`reader_rows`)."""

    def all_settled(self) -> bool: ...


def settle_page(streams: Streams, departed: DepartedRows, grace: float) -> bool:
    """Wait until no stream of the publisher has a flag operation left on the page.

    The read flags of departed subscribers that died are forced (their writes
    died with them); a live one's are awaited.  False if a stream still waits
    on a live subscriber's flag after ``grace`` seconds.
    """
    deadline = time.monotonic() + grace
    pause = 0.0005
    while True:
        if departed.all_settled() or streams.idle():  # the dead ones forced first
            streams.synchronize()  # every flag they may wait on is in: this ends
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
