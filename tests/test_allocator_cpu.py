"""CPU tier: the slot arena behind the allocator hook and ``token.array()`` (runs on CI).

:class:`SlotArena` is pure logic.  :class:`SlotArenas` builds real
``cupy.ndarray`` objects over slot addresses that nothing here dereferences
(CuPy makes arrays over ``UnownedMemory`` without a device), so the rules of
the kept array are checked here on the CPU; ``tests/test_reusable_view_gpu.py``
checks them over real slots.
"""

from __future__ import annotations

import gc

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool import SlotFullError
from cupy_ipcpool._arena import SlotArena, SlotArenas
from cupy_ipcpool._slots import SlotTable


def test_blocks_are_aligned_and_bump_upwards():
    arena = SlotArena(4096, slot=2)
    a = arena.alloc(1)
    b = arena.alloc(300)
    c = arena.alloc(0)
    assert (a, b, c) == (0, 256, 768)
    assert all(off % 256 == 0 for off in (a, b, c))
    assert arena.live_blocks == 3


def test_top_space_is_reused_after_free():
    arena = SlotArena(1024)
    a = arena.alloc(256)
    b = arena.alloc(512)
    arena.free(b)
    assert arena.alloc(512) == b  # freed top block's space reused at once
    assert arena.top == 768
    del a


def test_space_below_a_live_block_is_reclaimed_when_the_top_goes():
    arena = SlotArena(1024)
    a = arena.alloc(256)
    b = arena.alloc(256)
    arena.free(a)
    assert arena.top == 512  # a is below live b: not yet reusable
    arena.free(b)
    assert arena.top == 0 and arena.live_blocks == 0


def test_overflow_names_requested_and_remaining_bytes():
    arena = SlotArena(1000, slot=5)
    arena.alloc(600)
    with pytest.raises(SlotFullError) as info:
        arena.alloc(500)
    err = info.value
    assert (err.requested, err.remaining, err.slot, err.slot_nbytes) == (500, 232, 5, 1000)
    assert "500 bytes" in str(err) and "232 of 1000" in str(err)


def test_bad_requests():
    arena = SlotArena(1024)
    with pytest.raises(ValueError):
        arena.alloc(-1)
    with pytest.raises(ValueError):
        arena.free(128)
    with pytest.raises(ValueError):
        SlotArena(1024, alignment=100)
    with pytest.raises(TypeError):
        SlotArena(1024, 2)  # slot and alignment are keyword-only


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000)), max_size=60))
def test_live_blocks_never_overlap_and_stay_inside(ops):
    arena = SlotArena(1 << 14)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            try:
                off = arena.alloc(n)
            except SlotFullError:
                continue
            assert off % 256 == 0 and off + n <= arena.capacity
            for o, size in live.items():
                assert off + n <= o or o + size <= off or n == 0 or size == 0
            live[off] = n
        else:
            victim = sorted(live)[n % len(live)]
            arena.free(victim)
            del live[victim]
    for off in list(live):
        arena.free(off)
    assert arena.top == 0


# ------------------------------------------------------- the slots' arenas, token.array()


class _PoolMemory:
    """What the arenas keep alive and ask whether the pool is closing."""

    close_requested = False


SLOT = 1 << 16
F4 = numpy.float32  # one object: the fast path compares the dtype by identity


def _arenas(num_slots: int = 2) -> tuple[SlotTable, SlotArenas, _PoolMemory, list[int]]:
    table = SlotTable(num_slots)
    memory = _PoolMemory()
    ptrs = [(slot + 1) << 32 for slot in range(num_slots)]  # never dereferenced
    return table, SlotArenas(memory, table, table.views, ptrs, SLOT, 0), memory, ptrs


def test_a_slot_hands_its_first_array_out_again_for_its_next_frame():
    table, arenas, _, ptrs = _arenas()
    a = arenas.array(1, (64,), F4, 0, None)
    view = table.views[1]
    assert view is not None and a is view.array and a.data.ptr == ptrs[1]
    assert table.view_in_use(1) and table.is_busy(1) and table.local_refs(1) == 1
    del a  # the frame is over: nothing outside the pool refers to the array
    assert not table.is_busy(1)
    assert arenas.array(1, (64,), F4, 0, None) is view.array  # the same call
    assert arenas.array(1, [64], numpy.dtype("float32"), 0, None) is view.array  # normalised
    assert table.counts == [0, 0]  # a kept array is not a counted reference


def test_a_view_in_use_is_not_handed_out_twice():
    table, arenas, _, _ = _arenas()
    held = arenas.array(0, (64,), F4, 0, None)
    other = arenas.array(0, (64,), F4, 0, None)
    assert other is not held and other.data.ptr >= held.data.ptr + 64 * 4  # no overlap
    assert table.counts[0] == 1 and table.local_refs(0) == 2
    del other
    gc.collect()
    assert table.counts[0] == 0 and arenas.arena(0).top == 256  # only the kept view is left
    del held


def test_another_shape_replaces_an_idle_view_and_frees_its_block():
    table, arenas, _, ptrs = _arenas()
    first = arenas.array(0, (64,), F4, 0, None)
    del first  # idle now
    b = arenas.array(0, (8, 4), numpy.float64, 0, None)
    view = table.views[0]
    assert view is not None and b is view.array and view.key[0] == (8, 4)
    assert b.data.ptr == ptrs[0]  # the old view's block was given back first


def test_nothing_is_kept_once_the_pool_is_closing():
    table, arenas, memory, _ = _arenas()
    memory.close_requested = True
    a = arenas.array(1, (16,), F4, 0, None)
    assert table.views[1] is None and table.counts[1] == 1  # an ordinary counted array
    del a
    gc.collect()
    assert table.counts[1] == 0 and arenas.arena(1).top == 0


def test_allocating_takes_the_kept_views_space():
    table, arenas, _, _ = _arenas()
    first = arenas.array(0, (64,), F4, 0, None)
    del first  # idle now
    scope = arenas.scope(0, "raise")
    assert table.views[0] is None and scope.arena is arenas.arena(0) and scope.arena.top == 0
    assert scope.slot == 0 and scope.overflow == "raise" and scope.spills == 0


def test_an_array_that_does_not_fit_says_so():
    table, arenas, _, _ = _arenas()
    with pytest.raises(SlotFullError) as info:
        arenas.array(0, (SLOT // 8 + 1,), numpy.float64, 0, None)
    assert info.value.slot == 0 and info.value.remaining == SLOT
    assert table.views[0] is None and arenas.arena(0).top == 0
