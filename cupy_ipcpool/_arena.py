"""The slot arena: a stream-ordered bump allocator over one slot, and the CuPy hook on it.

:class:`SlotArena` hands out blocks of one slot.  A freed block's space comes
back when the blocks above it are gone (a bump allocator reclaims from the
top).  Reuse is **stream-ordered**, as in CuPy's ``MemoryPool``: every block
remembers the stream it was allocated on; space freed by stream ``T`` is
reused by an allocation on the same stream at once (stream order makes the
new work run after the old), and by an allocation on another stream ``S``
only after ``S`` has been made to wait (``cudaStreamWaitEvent``, on the GPU;
the host never blocks) on an event recorded on ``T`` after the free.  The
event is recorded lazily, when another stream first reuses the space, so a
single-stream producer pays nothing.

:class:`AllocationScope` is what ``token.allocating()`` / ``pool.allocating()``
installs as this thread's CuPy allocator: every allocation is carved out of
the slot as ``MemoryPointer(UnownedMemory(ptr, size, owner, device_id), 0)``,
and its owner (a :class:`Block`) counts as a local reference to the slot.

:class:`SlotArenas` holds a pool's arenas, one per slot, and the array each
slot keeps for its next frame (:class:`ReusableView`): what ``token.array()``
carves from.
"""

from __future__ import annotations

import threading
from contextlib import suppress
from typing import Any

from ._arrays import KeptArray, SlotRef, SlotRefs, cupy_module, normalize_dtype, normalize_shape
from ._errors import SlotFullError, UsageError

ALIGNMENT = 256
OVERFLOW_POLICIES = ("raise", "spill")


class _Fence:
    """Space freed by one stream: ``[0, hi)`` holds blocks that stream freed.

    ``event`` (a raw ``cudaEvent_t``, 0 before the first cross-stream reuse)
    was recorded on the stream after those frees unless ``stale`` (a free came
    after the record).  ``stream`` keeps the stream object alive so that the
    event can still be recorded on it.
    """

    __slots__ = ("event", "hi", "stale", "stream")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.hi = 0
        self.event = 0
        self.stale = True


class SlotArena:
    """Stream-ordered bump allocator over one slot: ``[0, capacity)`` bytes, blocks aligned.

    Allocation takes the space above the highest live block.  Freeing the top
    block gives its space back (and any freed blocks directly below it); a
    block freed below a live one is reclaimed when everything above it is
    freed.  Space freed on one stream and reused on another is ordered on the
    GPU (see the module docstring).

    Parameters
    ----------
    capacity:
        Usable bytes of the slot.
    slot:
        The slot index (for error messages).
    alignment:
        Alignment of every block (a power of two, at least 256).
    """

    def __init__(self, capacity: int, *, slot: int = 0, alignment: int = ALIGNMENT) -> None:
        if alignment < ALIGNMENT or alignment & (alignment - 1):
            raise UsageError(f"alignment must be a power of two >= {ALIGNMENT}, got {alignment}")
        self.capacity = capacity
        self.slot = slot
        self.alignment = alignment
        # [offset, size, live, stream ptr, stream object]; offsets increasing
        self._blocks: list[list[Any]] = []
        self._top = 0
        self._fences: dict[int, _Fence] = {}
        self._lock = threading.RLock()

    @property
    def top(self) -> int:
        """First byte above the highest block that is not yet reclaimed."""
        return self._top

    @property
    def live_blocks(self) -> int:
        """Number of blocks allocated and not freed."""
        return sum(1 for b in self._blocks if b[2])

    def remaining(self) -> int:
        """Bytes still available above the top (after alignment)."""
        start = -(-self._top // self.alignment) * self.alignment
        return max(0, self.capacity - start)

    def alloc(self, nbytes: int, stream: int = 0, stream_obj: Any = None) -> int:
        """Reserve ``nbytes`` for work on ``stream`` and return the block's offset.

        Parameters
        ----------
        nbytes:
            Bytes to reserve (0 takes one byte, so every block has its own offset).
        stream:
            The raw ``cudaStream_t`` that will use the block (0: the legacy
            default stream).
        stream_obj:
            The object behind ``stream``, kept alive while its frees are pending.

        Raises
        ------
        SlotFullError
            The request does not fit above the top; the error names the
            requested and remaining bytes.
        """
        if nbytes < 0:
            raise UsageError(f"cannot allocate a negative size ({nbytes})")
        with self._lock:
            align = self.alignment
            start = (self._top + align - 1) & -align
            if start + nbytes > self.capacity:
                raise SlotFullError(nbytes, self.remaining(), self.slot, self.capacity)
            end = start + (nbytes or 1)
            fences = self._fences
            if fences and (len(fences) > 1 or stream not in fences):
                self._order_after_others(start, stream)
            self._blocks.append([start, end - start, 1, stream, stream_obj])
            self._top = end
            return start

    def free(self, offset: int) -> None:
        """Free the block at ``offset``; reclaim freed space at the top."""
        with self._lock:
            blocks = self._blocks
            if blocks and blocks[-1][0] == offset and blocks[-1][2]:
                block = blocks.pop()  # the common case: the newest block goes first
            else:
                for i in range(len(blocks) - 1, -1, -1):
                    block = blocks[i]
                    if block[0] == offset and block[2]:
                        block[2] = 0
                        break
                else:
                    raise UsageError(f"no live block at offset {offset} in slot {self.slot}")
            fence = self._fences.get(block[3])
            if fence is None:
                fence = self._fences[block[3]] = _Fence(block[4])
            end = block[0] + block[1]
            if end > fence.hi:
                fence.hi = end
            fence.stale = True
            while blocks and not blocks[-1][2]:
                blocks.pop()
            self._top = blocks[-1][0] + blocks[-1][1] if blocks else 0

    def _order_after_others(self, start: int, stream: int) -> None:
        """Make ``stream`` wait for the frees of other streams below ``start``'s block."""
        rt = cupy_module().cuda.runtime
        for key in list(self._fences):
            if key == stream:
                continue
            fence = self._fences[key]
            if fence.hi <= start:
                continue
            if not fence.stale and fence.event and rt.eventQuery(fence.event) == 0:
                # everything that stream did before its frees has run: nothing to order
                del self._fences[key]
                rt.eventDestroy(fence.event)
                continue
            if fence.event == 0:
                fence.event = rt.eventCreateWithFlags(rt.eventDisableTiming)
            if fence.stale:
                rt.eventRecord(fence.event, key)
                fence.stale = False
            rt.streamWaitEvent(stream, fence.event, 0)

    def close(self) -> None:
        """Destroy the arena's events (never raises)."""
        with self._lock:
            fences, self._fences = self._fences, {}
        events = [f.event for f in fences.values() if f.event]
        if events:
            rt = cupy_module().cuda.runtime
            for event in events:
                with suppress(Exception):
                    rt.eventDestroy(event)


class Block(SlotRef):
    """Owner of one arena block: frees the arena space when collected."""

    __slots__ = ("arena", "offset")

    def __init__(
        self, keepalive: Any, refs: SlotRefs, slot: int, arena: SlotArena, offset: int
    ) -> None:
        super().__init__(keepalive, refs, slot)
        self.arena = arena
        self.offset = offset

    def __del__(self) -> None:
        with suppress(Exception):
            self.arena.free(self.offset)
        super().__del__()


class ViewOwner:
    """Owner of a :class:`ReusableView`'s memory: keeps the mapping alive, uncounted.

    A reusable view is not counted as a local reference while the pool keeps it
    (its use is seen by :meth:`ReusableView.in_use`).  When the pool closes
    while the view is in use, :meth:`count` makes it a counted reference, so
    the mapping outlives the pool until the view is gone.
    """

    __slots__ = ("__weakref__", "counted", "keepalive", "refs", "slot")

    def __init__(self, keepalive: Any, refs: SlotRefs, slot: int) -> None:
        self.keepalive = keepalive
        self.refs = refs
        self.slot = slot
        self.counted = False

    def count(self) -> None:
        """Count this owner as a local reference from now on (hold ``refs.lock``)."""
        if not self.counted:
            self.counted = True
            self.refs.counts[self.slot] += 1

    def __del__(self) -> None:
        if self.counted:
            try:  # noqa: SIM105 - cheaper than contextlib.suppress in a finalizer
                self.refs.decr(self.slot)
            except Exception:  # interpreter shutdown
                pass


class ReusableView(KeptArray):
    """The first array of a frame in a slot, kept to be handed out again.

    A producer that writes one array of the same shape and dtype per frame
    gets this same ``cupy.ndarray`` back the next time the slot is written
    (``token.array``), instead of a new array, a new arena block and a new
    owner each frame.  The view occupies the arena's first block for as long
    as the pool keeps it.  A slot whose view is in use
    (:meth:`~cupy_ipcpool._arrays.KeptArray.in_use`) is busy, exactly like a
    slot with a live array.

    Parameters
    ----------
    cp:
        The ``cupy`` module.
    ptr, nbytes:
        The block's device address and size.
    owner:
        The memory's :class:`ViewOwner`.
    device:
        CUDA device ordinal.
    shape, dtype:
        The array's (normalised) shape and dtype.
    offset:
        The block's offset in the slot's arena.
    stream:
        The raw stream the block was allocated for; the view is handed out
        again only to a writer on the same stream.
    """

    __slots__ = ("end", "given", "key", "offset", "owner", "stream", "wire")

    def __init__(
        self,
        cp: Any,
        ptr: int,
        nbytes: int,
        owner: ViewOwner,
        device: int,
        shape: tuple[int, ...],
        dtype: Any,
        offset: int,
        stream: int,
    ) -> None:
        super().__init__(cp, ptr, nbytes, owner, device, 0, shape, dtype)
        self.key = (shape, dtype)
        self.offset = offset
        self.end = offset + max(nbytes, 1)  # the arena's top while the view is its only block
        self.owner = owner
        self.stream = stream
        #: ``(shape, dtype)`` exactly as the call that made the view passed them
        #: (a tuple shape only), so that the same call finds it again without
        #: normalising them; None when not comparable that way.
        self.given: tuple[Any, Any] | None = None
        #: What a channel publisher caches here: the view's handle in wire form.
        self.wire: Any = None

    def free_for(self, stream: int, arena_top: int) -> bool:
        """True when a writer on ``stream`` may have the array again (same shape and
        dtype checked by the caller): same stream, still the arena's only block,
        and nothing outside the pool refers to it."""
        return self.stream == stream and arena_top == self.end and not self.in_use()


def block_pointer(
    arena: SlotArena,
    base: int,
    keepalive: Any,
    refs: SlotRefs,
    device: int,
    nbytes: int,
    stream: int,
    stream_obj: Any,
) -> Any:
    """Allocate ``nbytes`` in ``arena`` and return a ``cupy.cuda.MemoryPointer`` to it."""
    cp = cupy_module()
    offset = arena.alloc(nbytes, stream, stream_obj)
    owner = Block(keepalive, refs, arena.slot, arena, offset)
    return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(base + offset, nbytes, owner, device), 0)


class AllocationScope:
    """What ``allocating()`` yields: the slot in use and spill statistics.

    Attributes
    ----------
    slot:
        The slot allocations are carved from.
    arena:
        The slot's :class:`SlotArena`.
    overflow:
        ``"raise"`` or ``"spill"``.
    spills:
        Number of allocations that did not fit and went to the allocator that
        was current when the scope was entered (only with ``overflow="spill"``);
        such arrays are not shareable.
    spilled_bytes:
        Their total size.
    """

    def __init__(
        self,
        arena: SlotArena,
        base: int,
        keepalive: Any,
        refs: SlotRefs,
        device: int,
        overflow: str,
    ) -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise UsageError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        self.slot = arena.slot
        self.arena = arena
        self.overflow = overflow
        self.spills = 0
        self.spilled_bytes = 0
        cp = cupy_module()
        self._previous = cp.cuda.get_allocator()  # what spills go to
        unowned = cp.cuda.UnownedMemory
        memory_pointer = cp.cuda.MemoryPointer
        current_stream = cp.cuda.get_current_stream
        slot = arena.slot
        spill = self._previous

        def allocate(nbytes: int) -> Any:
            stream = current_stream()
            ptr = stream.ptr
            try:
                offset = arena.alloc(nbytes, ptr, stream)
            except SlotFullError:
                if overflow != "spill":
                    raise
                self.spills += 1
                self.spilled_bytes += nbytes
                return spill(nbytes)
            owner = Block(keepalive, refs, slot, arena, offset)
            return memory_pointer(unowned(base + offset, nbytes, owner, device), 0)

        #: The allocator function installed with ``cupy.cuda.using_allocator``.
        self._allocate = allocate


class SlotArenas:
    """The arenas of a pool's slots, and the array each slot keeps for its next frame.

    What ``token.array()`` and ``allocating()`` carve from.  Each slot's
    :class:`SlotArena` is made on first use; its first array (a
    :class:`ReusableView`) is kept in ``views`` and handed out again for the
    slot's next frame of the same shape, dtype and stream.

    Parameters
    ----------
    keepalive:
        What arrays over the slots keep alive (the pool's memory); its
        ``close_requested`` attribute is true once the pool is closing.
    refs:
        The local reference counts of the slots (the pool's slot table).
    views:
        Per slot, the kept view or None: the slot table's list, changed here
        in place only, so that the table sees a view in use as holding the slot.
    ptrs:
        Device address of each slot.
    slot_nbytes:
        Usable bytes per slot.
    device:
        CUDA device ordinal.
    """

    def __init__(
        self,
        keepalive: Any,
        refs: SlotRefs,
        views: list[ReusableView | None],
        ptrs: list[int],
        slot_nbytes: int,
        device: int,
    ) -> None:
        self.keepalive = keepalive
        self.refs = refs
        self.views = views
        self.ptrs = ptrs
        self.slot_nbytes = slot_nbytes
        self.device = device
        self.arenas: list[SlotArena | None] = [None] * len(ptrs)
        self._lock = threading.Lock()

    def arena(self, slot: int) -> SlotArena:
        """``slot``'s arena (made on first use)."""
        arenas = self.arenas
        arena = arenas[slot]
        if arena is None:
            with self._lock:
                arena = arenas[slot]
                if arena is None:
                    arena = arenas[slot] = SlotArena(self.slot_nbytes, slot=slot)
        return arena

    def array(self, slot: int, shape: Any, dtype: Any, stream: int, stream_obj: Any) -> Any:
        """A ``cupy.ndarray`` of ``shape`` and ``dtype`` carved from ``slot`` for ``stream``.

        The slot's kept view when it is free for this call, else a new block
        (which becomes the kept view when the slot was empty).

        Raises
        ------
        SlotFullError
            It does not fit in what is left of the slot.
        """
        view = self.views[slot]
        if (
            view is not None
            and view.given is not None
            and type(shape) is tuple
            and view.given[1] is dtype
            and view.given[0] == shape
            and view.free_for(stream, self.arenas[slot].top)  # type: ignore[union-attr]
        ):
            # the same call as the one that made the view, for the slot's next frame:
            # no need to normalise shape and dtype
            return view.array
        cp = cupy_module()
        dt = normalize_dtype(dtype)
        shape_t = normalize_shape(shape)
        nbytes = dt.itemsize
        for n in shape_t:
            nbytes *= n
        arena = self.arena(slot)
        views = self.views
        view = views[slot]
        if view is not None:
            if view.key == (shape_t, dt) and view.free_for(stream, arena.top):
                return view.array  # the slot's last frame had this shape: hand it out again
            if not view.in_use():
                self.drop_view(slot)
                view = views[slot]
        keepalive = self.keepalive
        if view is None and arena.top == 0 and not keepalive.close_requested:
            # the first array of an empty slot: keep it for the slot's next frame
            # (not once the pool is closing: an uncounted view could outlive the mapping)
            offset = arena.alloc(nbytes, stream, stream_obj)
            owner = ViewOwner(keepalive, self.refs, slot)
            try:
                view = ReusableView(
                    cp,
                    self.ptrs[slot] + offset,
                    nbytes,
                    owner,
                    self.device,
                    shape_t,
                    dt,
                    offset,
                    stream,
                )
            except BaseException:
                arena.free(offset)
                raise
            if type(shape) is tuple and shape == shape_t:
                view.given = (shape, dtype)  # dtype compared by identity: any object will do
            with self.refs.lock:
                if keepalive.close_requested:
                    view.owner.count()  # closed meanwhile: an ordinary counted array
                else:
                    views[slot] = view
            return view.array
        memptr = block_pointer(
            arena,
            self.ptrs[slot],
            keepalive,
            self.refs,
            self.device,
            nbytes,
            stream,
            stream_obj,
        )
        return cp.ndarray(shape_t, dt, memptr)

    def drop_view(self, slot: int) -> None:
        """Forget ``slot``'s kept view if nothing uses it; its arena block is freed."""
        refs = self.refs
        with refs.lock:
            view = self.views[slot]
            if view is None or view.in_use():
                return
            self.views[slot] = None
        self.arena(slot).free(view.offset)

    def scope(self, slot: int, overflow: str) -> AllocationScope:
        """An :class:`AllocationScope` over ``slot`` (its kept view is dropped first:
        the arena's space goes to the allocations)."""
        self.drop_view(slot)
        return AllocationScope(
            self.arena(slot), self.ptrs[slot], self.keepalive, self.refs, self.device, overflow
        )

    def close(self) -> None:
        """Destroy the arenas' events (never raises)."""
        for arena in self.arenas:
            if arena is not None:
                arena.close()


__all__ = [
    "ALIGNMENT",
    "OVERFLOW_POLICIES",
    "AllocationScope",
    "Block",
    "ReusableView",
    "SlotArena",
    "SlotArenas",
    "ViewOwner",
]
