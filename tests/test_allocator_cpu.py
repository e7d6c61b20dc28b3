"""CPU tier: the slot arena behind the allocator hook (pure logic, runs on CI)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool import SlotFullError
from cupy_ipcpool._arena import SlotArena


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
