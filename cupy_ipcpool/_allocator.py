"""CuPy allocator hook: ``allocating(pool)`` puts this thread's allocations in a slot.

``with cupy_ipcpool.allocating(pool): y = f(x)`` (the same as
``pool.allocating()``, or ``token.allocating()`` for an acquired slot) installs,
for the current thread only, a CuPy allocator that carves every allocation
out of the slot with the slot's stream-ordered arena.  The arena and the hook
belong to the pool, which owns each slot's life (:mod:`cupy_ipcpool._arena`);
this module is the allocator layer's entry point and keeps the names that
lived here importable.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from ._arena import ALIGNMENT, OVERFLOW_POLICIES, AllocationScope, SlotArena

if TYPE_CHECKING:
    from ._pool import IpcPool, SlotToken


def allocating(
    target: IpcPool | SlotToken, *, overflow: str = "raise"
) -> AbstractContextManager[AllocationScope]:
    """Install a thread-local CuPy allocator that allocates in a slot of the pool.

    Parameters
    ----------
    target:
        A pool (allocations go to its current slot as of entering the block)
        or a slot token from ``pool.acquire()`` (its slot).
    overflow:
        ``"raise"`` (default): an allocation that does not fit raises
        :class:`SlotFullError` naming the requested and remaining bytes.
        ``"spill"``: it is served by the allocator that was current when the
        block was entered (CuPy's default pool, RMM, ...) and counted in the
        yielded scope's ``spills``; ``pool.handle()`` of such an array raises
        :class:`NotShareableError`.

    Notes
    -----
    Semantics of ``cupy.cuda.using_allocator``: only this thread is affected,
    blocks nest, and the previous allocator is restored on exit, also when an
    exception leaves the block.  Every CuPy allocation in the block lands in
    the slot, temporaries included (reduction scratch, cuFFT work areas, sort
    buffers); they are freed, and their space reused, when CuPy drops them —
    on the same stream at once, on another stream after that stream waits (on
    the GPU) for the first.
    """
    return target.allocating(overflow=overflow)


__all__ = ["ALIGNMENT", "OVERFLOW_POLICIES", "AllocationScope", "SlotArena", "allocating"]
