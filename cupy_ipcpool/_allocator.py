"""CuPy allocator hook: allocations land inside the current slot.

``with pool.allocating(): y = f(x)`` installs, for the current thread only, a
CuPy allocator that carves every allocation out of the pool's current slot with
a bump allocator (:class:`SlotArena`).  Each allocation is returned as
``MemoryPointer(UnownedMemory(ptr, size, owner, device_id), 0)``; its owner
counts as a local reference to the slot, so the ring never recycles the slot
while the result (or any view of it) is alive.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from ._arrays import SlotRef, SlotRefs, cupy_module
from ._errors import SlotFullError

if TYPE_CHECKING:
    from ._pool import IpcPool

ALIGNMENT = 256
OVERFLOW_POLICIES = ("raise", "spill")


class SlotArena:
    """Bump allocator over one slot: ``[0, capacity)`` bytes, blocks aligned.

    Allocation takes the space above the highest live block.  Freeing the top
    block gives its space back at once (and any freed blocks directly below
    it); a block freed below a live one is reclaimed when everything above it
    is freed.  The arena is empty again when all its blocks are freed.

    Parameters
    ----------
    capacity:
        Usable bytes of the slot.
    slot:
        The slot index (for error messages).
    alignment:
        Alignment of every block (a power of two, at least 256).
    """

    def __init__(self, capacity: int, slot: int = 0, alignment: int = ALIGNMENT) -> None:
        if alignment < ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= {ALIGNMENT}, got {alignment}")
        self.capacity = capacity
        self.slot = slot
        self.alignment = alignment
        self._blocks: list[list[int]] = []  # [offset, size, live]; offsets increasing
        self._top = 0
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

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` and return the block's offset in the slot.

        Raises
        ------
        SlotFullError
            The request does not fit above the top; the error names the
            requested and remaining bytes.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        with self._lock:
            align = self.alignment
            start = (self._top + align - 1) & -align
            if start + nbytes > self.capacity:
                raise SlotFullError(nbytes, self.remaining(), self.slot, self.capacity)
            # a zero-byte block still takes one byte, so every live block has its own offset
            end = start + (nbytes or 1)
            self._blocks.append([start, end - start, 1])
            self._top = end
            return start

    def free(self, offset: int) -> None:
        """Free the block at ``offset``; reclaim freed space at the top."""
        with self._lock:
            blocks = self._blocks
            if blocks and blocks[-1][0] == offset and blocks[-1][2]:
                blocks.pop()  # the common case: the newest block goes first
            else:
                for i in range(len(blocks) - 1, -1, -1):
                    block = blocks[i]
                    if block[0] == offset and block[2]:
                        block[2] = 0
                        break
                else:
                    raise ValueError(f"no live block at offset {offset} in slot {self.slot}")
            while blocks and not blocks[-1][2]:
                blocks.pop()
            self._top = blocks[-1][0] + blocks[-1][1] if blocks else 0


class _Block(SlotRef):
    """Owner of one allocator block: frees the arena space when collected."""

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


class AllocationScope:
    """What ``pool.allocating()`` yields: the slot in use and spill statistics.

    Attributes
    ----------
    slot:
        The slot allocations are carved from.
    arena:
        The slot's :class:`SlotArena`.
    spills:
        Number of allocations that did not fit and went to CuPy's default pool
        (only with ``overflow="spill"``); such arrays are not shareable.
    spilled_bytes:
        Their total size.
    """

    def __init__(self, pool: IpcPool, slot: int, arena: SlotArena, overflow: str) -> None:
        self.pool = pool
        self.slot = slot
        self.arena = arena
        self.overflow = overflow
        self.spills = 0
        self.spilled_bytes = 0
        cp = cupy_module()
        mem = pool._mem
        base = pool._ptrs[slot]
        device = pool.device
        unowned = cp.cuda.UnownedMemory
        memory_pointer = cp.cuda.MemoryPointer
        refs = mem.refs

        def allocate(nbytes: int) -> Any:
            try:
                offset = arena.alloc(nbytes)
            except SlotFullError:
                if overflow != "spill":
                    raise
                self.spills += 1
                self.spilled_bytes += nbytes
                return cp.get_default_memory_pool().malloc(nbytes)
            owner = _Block(mem, refs, slot, arena, offset)
            return memory_pointer(unowned(base + offset, nbytes, owner, device), 0)

        self.allocate = allocate


def arena_for(pool: IpcPool, slot: int) -> SlotArena:
    """The pool's arena for ``slot`` (created on first use)."""
    arenas: dict[int, SlotArena] = pool.__dict__.setdefault("_arenas", {})
    arena = arenas.get(slot)
    if arena is None:
        arena = arenas[slot] = SlotArena(pool.slot_nbytes, slot)
    return arena


@contextmanager
def allocating(pool: IpcPool, *, overflow: str = "raise") -> Iterator[AllocationScope]:
    """Install a thread-local CuPy allocator that allocates in the pool's current slot.

    Parameters
    ----------
    pool:
        The pool; allocations go to ``pool.current`` as of entering the block.
    overflow:
        ``"raise"`` (default): an allocation that does not fit raises
        :class:`SlotFullError` naming the requested and remaining bytes.
        ``"spill"``: it is served by CuPy's default memory pool instead and
        counted in the yielded scope's ``spills``; ``pool.handle()`` of such an
        array raises :class:`NotShareableError`.

    Notes
    -----
    Semantics of ``cupy.cuda.using_allocator``: only this thread is affected,
    blocks nest, and the previous allocator is restored on exit, also when an
    exception leaves the block.  Every CuPy allocation in the block lands in
    the slot, temporaries included (reduction scratch, cuFFT work areas, sort
    buffers); they are freed, and their space reused, when CuPy drops them.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    pool._check()
    slot = pool.current
    scope = AllocationScope(pool, slot, arena_for(pool, slot), overflow)
    cp = cupy_module()
    with cp.cuda.Device(pool.device), cp.cuda.using_allocator(scope.allocate):
        yield scope
