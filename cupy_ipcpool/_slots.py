"""Who holds each slot of a ring, handing out free slots, and the writer's token.

:class:`SlotTable` is the one owner of a slot's life on the producer side.  A
slot is *busy* while any of these hold it:

* local references: arrays and allocator blocks over the slot (counted by the
  :class:`~cupy_ipcpool._arrays.SlotRef` owners of their memory);
* a writer: an open slot token (:meth:`SlotTable.take` until :meth:`release_writer`);
* peer leases, reported by the :class:`LeaseSource` objects registered with
  :meth:`SlotTable.add_source` (a :class:`~cupy_ipcpool.Publisher` is one).

:meth:`SlotTable.take` hands out the first free slot after the current one
(round-robin); returned leases are taken in when no slot is known to be free,
all at once.  While none is free it waits without polling: on the table's
condition, which local releases and returned leases notify, or inside the
lease source (``collect``) when only peer leases stand in the way, since in
the common single-threaded program nothing else could free a slot.  (A
reusable view, the pool's kept array, frees its slot without a notification:
while one is in use the wait looks again every 5 ms.)

:class:`SlotToken` is what :meth:`IpcPool.acquire` returns for a slot the
table handed out: the writer's right to the slot, released back to the table.
The table needs no GPU; a token only reaches CuPy through its pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy

from ._arrays import SlotRefs, as_cupy_stream
from ._errors import NotShareableError, PoolClosedError, SlotBusyError

if TYPE_CHECKING:
    from ._arena import AllocationScope, SlotArenas
    from ._handles import ArrayHandle

#: While a reusable view is in use, a waiting ``take`` looks again this often (s).
_VIEW_RECHECK_S = 0.005


@runtime_checkable
class LeaseSource(Protocol):
    """What a pool asks of whoever lends its slots to peers (the channel's publisher).

    Register one with :meth:`IpcPool.add_lease_source`; the pool then counts
    its leases as holding slots, lets it collect returned leases while
    :meth:`IpcPool.acquire` waits, and lets it order a new writer's stream
    after the peers that read the slot.  All three are called from the thread
    that acquires; an implementation serialises them with its own work.
    """

    def leases(self, slot: int) -> int:
        """Number of peer leases held on ``slot`` now."""
        ...

    def collect(self, timeout: float | None) -> int:
        """Process leases that came back, waiting up to ``timeout`` seconds for the first.

        ``0`` must not block; ``None`` waits without limit.  Return how many
        came back.  An implementation that collects outside ``acquire`` calls
        :meth:`IpcPool.notify_released` afterwards, so other waiting threads
        look again.
        """
        ...

    def order_write(self, slot: int, stream: int) -> None:
        """Make ``stream`` (a raw ``cudaStream_t``) wait on the GPU for every peer
        that read ``slot`` since it was last written; the host must not block."""
        ...


# A source may also offer ``describe(slot) -> str`` naming the peers that hold
# ``slot``; SlotBusyError messages then say who they are.


def first_free_slot(start: int, num_slots: int, busy: Callable[[int], object]) -> int | None:
    """The ring's one slot-pick rule: the first slot from ``start`` on, round-robin, not ``busy``.

    Looks at ``start % num_slots``, then the next ones modulo ``num_slots``,
    each once; returns the first for which ``busy(slot)`` is false, or None
    when every slot is busy.  :meth:`SlotTable.take` (a pool's slots: start
    after the slot taken last) and the host channel's
    :meth:`~cupy_ipcpool.channel._leases.LeaseBook.pick_free_slot` (start
    after the slot published last) both pick with it; what makes a slot busy
    is each one's own.
    """
    for i in range(start, start + num_slots):
        slot = i % num_slots
        if not busy(slot):
            return slot
    return None


class SlotTable(SlotRefs):
    """Local references, writers, generations and lease sources of ``num_slots`` slots.

    Thread-safe: every state change holds :attr:`lock`; :attr:`cond` is
    notified when a slot may have become free.

    Attributes
    ----------
    generation:
        Per slot: how many times it was taken for writing.
    writing:
        Per slot: True while a writer (slot token) holds it.
    current:
        The slot taken last (the ring's cursor); 0 before the first take.
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.generation = [0] * num_slots
        self.writing = [False] * num_slots
        self.current = 0
        #: Per slot: an object with ``in_use() -> bool`` that holds the slot while
        #: in use without being counted (the pool's reusable view), or None.
        self.views: list[Any] = [None] * num_slots
        #: The registered lease sources (a tuple, replaced whole under the lock).
        self.sources: tuple[LeaseSource, ...] = ()
        self._collecting = False

    # -- lease sources -------------------------------------------------------

    def add_source(self, source: LeaseSource) -> None:
        """Count ``source``'s leases from now on."""
        with self.lock:
            if source not in self.sources:
                self.sources = (*self.sources, source)

    def remove_source(self, source: LeaseSource) -> None:
        """Stop counting ``source``'s leases (unknown sources are ignored)."""
        with self.lock:
            self.sources = tuple(s for s in self.sources if s is not source)
            self.notify()

    def leases(self, slot: int) -> int:
        """Peer leases held on ``slot``, over every source."""
        n = 0
        for source in self.sources:
            n += source.leases(slot)
        return n

    # -- state ---------------------------------------------------------------

    def is_busy(self, slot: int) -> bool:
        """True while a local reference, a writer or a peer lease holds ``slot``."""
        return bool(
            self.counts[slot] or self.writing[slot] or self.view_in_use(slot) or self.leases(slot)
        )

    def view_in_use(self, slot: int) -> bool:
        """True while ``slot``'s reusable view (if any) is referenced outside the pool."""
        view = self.views[slot]
        return view is not None and bool(view.in_use())

    def local_refs(self, slot: int) -> int:
        """Counted local references to ``slot``, plus one for a view in use."""
        return self.counts[slot] + (1 if self.view_in_use(slot) else 0)

    def notify(self) -> None:
        """Wake the threads waiting in :meth:`take` so that they look again."""
        with self.lock:
            if self.waiters:
                self.cond.notify_all()

    def release_writer(self, slot: int) -> None:
        """End the write of ``slot`` (the token was released)."""
        with self.lock:
            self.writing[slot] = False
            if self.waiters:
                self.cond.notify_all()

    def take(self, timeout: float | None, slot: int | None = None) -> tuple[int, int]:
        """Take a free slot for writing: mark it written, bump its generation.

        A slot is free when nothing holds it as far as the table knows: leases
        that came back are taken in (``collect``) only when no slot is known
        to be free, all at once, so a producer that runs ahead of its
        subscribers collects their releases in batches rather than one poll
        per frame.

        Parameters
        ----------
        timeout:
            Seconds to wait while no slot is free (``None``: no limit; ``0``:
            do not wait).
        slot:
            Take exactly this slot; default: the first free slot after
            :attr:`current`, round-robin.

        Returns
        -------
        (slot, generation)

        Raises
        ------
        SlotBusyError
            Nothing became free in time; the message says who holds what.
        """
        deadline: float | None = None
        collected = False
        while True:
            with self.lock:
                found = self._pick(slot)
                if found is not None:
                    self.writing[found] = True
                    generation = self.generation[found] + 1
                    self.generation[found] = generation
                    self.current = found
                    return found, generation
            if not collected:
                # Nothing known to be free: the clock starts, and every lease that came
                # back is taken in (all at once, so a producer running ahead collects
                # in batches).
                collected = True
                if timeout is not None:
                    deadline = time.monotonic() + timeout
                for known in self.sources:
                    known.collect(0.0)
                continue
            with self.lock:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0.0:
                    raise SlotBusyError(self.busy_message(timeout, slot))
                source: LeaseSource | None = None
                if not self._collecting:
                    source = self._lease_bound(slot)
                if source is None:
                    # A reusable view becomes free without a notification (nothing
                    # runs when its last outside reference goes): while one is in
                    # use, look again every few milliseconds.
                    step = remaining
                    if any(v is not None for v in self.views):
                        step = _VIEW_RECHECK_S if step is None else min(step, _VIEW_RECHECK_S)
                    self.waiters += 1
                    try:
                        self.cond.wait(step)
                    finally:
                        self.waiters -= 1
                    continue
                self._collecting = True
            try:
                source.collect(remaining)
            finally:
                with self.lock:
                    self._collecting = False
                    if self.waiters:
                        self.cond.notify_all()

    def _pick(self, slot: int | None) -> int | None:
        """``slot`` when it is free, else (no ``slot``) the first free one after :attr:`current`."""
        if slot is not None:
            return None if self.is_busy(slot) else slot
        return first_free_slot(self.current + 1, len(self.counts), self.is_busy)

    def _lease_bound(self, slot: int | None) -> LeaseSource | None:
        """A source whose returned lease would free a slot (only leases hold it), or None."""
        n = len(self.counts)
        for s in range(n) if slot is None else (slot,):
            if self.counts[s] or self.writing[s] or self.view_in_use(s):
                continue
            for source in self.sources:
                if source.leases(s):
                    return source
        return None

    def busy_message(self, timeout: float | None, slot: int | None = None) -> str:
        """Say who holds the slots (for :class:`SlotBusyError`)."""
        parts = []
        for s in range(len(self.counts)) if slot is None else (slot,):
            held = []
            if self.writing[s]:
                held.append("an open slot token writes it")
            if self.counts[s] or self.view_in_use(s):
                held.append(f"{self.local_refs(s)} local array(s) or allocator block(s)")
            leases = self.leases(s)
            if leases:
                who = [
                    describe(s)
                    for source in self.sources
                    if (describe := getattr(source, "describe", None)) is not None
                ]
                held.append(f"{leases} peer lease(s)" + (f" ({', '.join(who)})" if who else ""))
            parts.append(f"slot {s}: {', '.join(held) or 'free'}")
        what = f"slot {slot} is" if slot is not None else f"all {len(self.counts)} slots are"
        return (
            f"no slot became free within {timeout} s: {what} in use ({'; '.join(parts)}); "
            "drop those arrays, release the slot tokens and frames (subscribers: "
            "frame.release(), or mode='latest'), pass a longer timeout, or give the pool "
            "more slots"
        )


class _TokenPool(Protocol):
    """What a :class:`SlotToken` asks of its pool (an :class:`IpcPool`)."""

    _arenas: SlotArenas

    @property
    def device(self) -> int: ...

    def ptr(self, slot: int | None = None) -> int: ...

    def handle(self, array: Any) -> ArrayHandle: ...

    def _allocating(self, slot: int, overflow: str) -> AbstractContextManager[AllocationScope]: ...

    def _release_writer(self, slot: int) -> None: ...


class SlotToken:
    """The right to write one slot, from :meth:`IpcPool.acquire`.

    While the token is open the slot counts as busy (nobody else acquires
    it); arrays made from it hold the slot on their own for as long as they
    live.  Release it with :meth:`release` or by leaving a ``with`` block; a
    token that is garbage collected is released too.

    Attributes
    ----------
    slot:
        The slot index.
    generation:
        The slot's generation for this write (it goes into every
        :class:`ArrayHandle` made from the token).
    """

    __slots__ = (
        "__weakref__",
        "_pool",
        "_released",
        "_stream",
        "_stream_ptr",
        "generation",
        "slot",
    )

    def __init__(self, pool: _TokenPool, slot: int, generation: int, stream: Any, ptr: int) -> None:
        self._pool = pool
        self.slot = slot
        self.generation = generation
        self._stream = stream
        self._stream_ptr = ptr
        self._released = False

    @property
    def released(self) -> bool:
        """True once the token was released."""
        return self._released

    @property
    def stream(self) -> Any:
        """The stream the slot was acquired for, as a CuPy stream object."""
        if self._stream is None or not hasattr(self._stream, "ptr"):
            self._stream = as_cupy_stream(
                self._stream_ptr if self._stream is None else self._stream, self._pool.device
            )
        return self._stream

    @property
    def stream_ptr(self) -> int:
        """The raw ``cudaStream_t`` of :attr:`stream`."""
        return self._stream_ptr

    @property
    def ptr(self) -> int:
        """Device pointer of the slot."""
        return self._pool.ptr(self.slot)

    def _check(self) -> None:
        if self._released:
            raise PoolClosedError(
                f"the token of slot {self.slot} (generation {self.generation}) was released; "
                "acquire a new one"
            )

    def array(self, shape: Any, dtype: Any = numpy.float64) -> Any:
        """A ``cupy.ndarray`` carved out of the slot (uninitialised), as ``cupy.empty``.

        Arrays of one token do not overlap: they come from the slot's arena,
        as allocations under :meth:`allocating` do, ordered on :attr:`stream`.
        The first array of a slot is kept by the pool: when the slot is
        written again with the same shape, dtype and stream and nothing refers
        to that array any more, the same ``cupy.ndarray`` object is returned
        (its contents are what the last frame left), which spares building an
        array per frame.  While anything refers to it (the array, a slice or
        view of it, a DLPack capsule or tensor made from it) the slot stays
        busy, as with any live array.

        Parameters
        ----------
        shape:
            Array shape (an int or a tuple of ints).
        dtype:
            A numeric numpy dtype (default ``float64``, as ``cupy.empty``).

        Raises
        ------
        SlotFullError
            It does not fit in what is left of the slot.
        """
        if self._released:
            self._check()
        return self._pool._arenas.array(self.slot, shape, dtype, self._stream_ptr, self._stream)

    @contextmanager
    def allocating(self, *, overflow: str = "raise") -> Iterator[AllocationScope]:
        """Place this thread's CuPy allocations inside the slot (see :meth:`IpcPool.allocating`)."""
        self._check()
        with self._pool._allocating(self.slot, overflow) as scope:
            yield scope

    def handle(self, array: Any) -> ArrayHandle:
        """The :class:`ArrayHandle` of an array in this slot (any device array type).

        Raises
        ------
        NotShareableError
            The array does not lie (entirely) in this token's slot.
        """
        self._check()
        handle = self._pool.handle(array)
        if handle.slot != self.slot:
            raise NotShareableError(
                f"array lies in slot {handle.slot}, but this token writes slot {self.slot}"
            )
        return handle

    def release(self) -> None:
        """Give the slot back (it stays busy while its arrays live).  Idempotent."""
        if not self._released:
            self._released = True
            self._pool._release_writer(self.slot)

    close = release

    def __enter__(self) -> SlotToken:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if not self._released:
            with suppress(Exception):
                self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "open"
        return f"SlotToken(slot={self.slot}, generation={self.generation}, {state})"


__all__ = ["LeaseSource", "SlotTable", "SlotToken"]
