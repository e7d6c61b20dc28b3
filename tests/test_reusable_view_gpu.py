"""GPU tier: the producer's reusable view (``token.array`` hands the slot's last array back).

A producer that writes one array of the same shape and dtype per frame gets
the same ``cupy.ndarray`` back each time a slot comes round, instead of a new
array, arena block and owner per frame.  The promise that matters: a slot is
never handed out while anything still refers to its view (the array, a slice,
a view of it, a DLPack consumer), and closing the pool never unmaps a view in
use.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import cupy_ipcpool as cip

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def cp():
    import cupy

    return cupy


def _frame(pool, shape, dtype, stream=None):
    """One frame's first array: acquire, token.array, release the token (the array lives on)."""
    with pool.acquire(timeout=1.0, stream=stream) as token:
        return token.slot, token.array(shape, dtype)


def test_same_shape_gets_the_same_array_back(cp):
    with cip.IpcPool(2, MiB) as pool:
        slot0, a = _frame(pool, (256,), cp.float32)
        a.fill(1.5)
        first = weakref.ref(a)  # does not keep it in use
        assert pool.local_refs(slot0) == 1
        del a
        assert pool.local_refs(slot0) == 0 and not pool.is_busy(slot0)
        _, b = _frame(pool, (256,), cp.float32)  # the other slot (round-robin)
        del b
        slot2, c = _frame(pool, (256,), cp.float32)
        assert slot2 == slot0 and c is first()  # the kept view, not a new array
        assert c.data.ptr == pool.ptr(slot0)
        np.testing.assert_array_equal(cp.asnumpy(c), np.full(256, 1.5, np.float32))


@pytest.mark.parametrize("hold", ["array", "slice", "view", "dlpack"])
def test_anything_referring_to_the_view_keeps_the_slot_busy(cp, hold):
    with cip.IpcPool(2, MiB) as pool:
        slot, a = _frame(pool, (1024,), cp.int32)
        if hold == "array":
            kept = a
        elif hold == "slice":
            kept = a[10:20]
        elif hold == "view":
            kept = a.view(cp.uint32)
        else:
            kept = a.__dlpack__()  # a DLPack capsule refers to the array
        del a
        gc.collect()
        assert pool.is_busy(slot) and pool.local_refs(slot) == 1
        for _ in range(3):  # the ring skips the held slot every time
            other, b = _frame(pool, (1024,), cp.int32)
            assert other != slot
            del b
        with pytest.raises(cip.SlotBusyError):
            pool.acquire(timeout=0.0, slot=slot)
        del kept
        gc.collect()
        assert not pool.is_busy(slot)
        with pool.acquire(timeout=0.0, slot=slot):
            pass


def test_another_shape_or_stream_gets_a_new_array(cp):
    with cip.IpcPool(1, MiB) as pool:
        _, a = _frame(pool, (100,), cp.float32)
        first = weakref.ref(a)
        del a
        _, b = _frame(pool, (200,), cp.float32)  # another shape: the view is replaced
        assert b is not first() and b.shape == (200,)
        assert first() is None  # the old view is gone
        b.fill(2.0)
        second = weakref.ref(b)
        del b
        other = cp.cuda.Stream(non_blocking=True)
        _, c = _frame(pool, (200,), cp.float32, stream=other)  # another stream: new array
        assert c is not second()
        del c
        other.synchronize()


def test_two_arrays_in_one_frame_do_not_overlap(cp):
    with cip.IpcPool(1, MiB) as pool:
        _, a = _frame(pool, (64,), cp.float64)
        del a
        with pool.acquire(timeout=1.0) as token:
            x = token.array((64,), cp.float64)  # the kept view
            y = token.array((64,), cp.float64)  # the view is in use: a new block after it
            assert x.data.ptr != y.data.ptr
            assert y.data.ptr >= x.data.ptr + x.nbytes
            x.fill(1.0)
            y.fill(2.0)
            assert float(x.sum()) == 64.0 and float(y.sum()) == 128.0


def test_allocating_gets_the_whole_slot_back(cp):
    """A kept view does not shrink what allocations under allocating() may use."""
    with cip.IpcPool(1, 4 * MiB) as pool:
        _, a = _frame(pool, (MiB,), cp.uint8)
        del a
        with pool.acquire(timeout=1.0) as token, token.allocating():
            big = cp.zeros(4 * MiB, dtype=cp.uint8)  # the whole slot: no reservation left
            assert big.data.ptr == pool.ptr(token.slot)
            del big


def test_closing_the_pool_keeps_a_view_in_use_mapped(cp):
    pool = cip.IpcPool(1, MiB)
    _, a = _frame(pool, (1000,), cp.int64)
    a.fill(7)
    pool.close()
    a += 1  # still mapped: a leak until the array goes, never a dangling pointer
    np.testing.assert_array_equal(cp.asnumpy(a), np.full(1000, 8, np.int64))
    del a
    gc.collect()


def test_publisher_reuses_the_view_and_every_frame_arrives(cp, tmp_path):
    """End to end: frames of one shape, the view handed out again, every value checked."""
    import multiprocessing as mp

    from tests.gpu_helpers import run_consumer_checking_values

    address = str(tmp_path / "views.sock")
    ctx = mp.get_context("spawn")
    with cip.IpcPool(3, MiB) as pool, cip.Publisher(pool, address) as pub:
        q = ctx.Queue()
        proc = ctx.Process(target=run_consumer_checking_values, args=(address, 30, q))
        proc.start()
        assert q.get(timeout=120) == "ready"
        while not pub.subscribers:
            pub.poll(0.05)
        last: dict[int, weakref.ref] = {}
        reused = 0
        for value in range(30):
            with pub.frame(timeout=10) as f:
                a = f.array((4096,), cp.int32)
                a.fill(value)
                previous = last.get(f.slot)
                reused += previous is not None and previous() is a
                last[f.slot] = weakref.ref(a)
                f.publish(a)
                del a
        assert reused >= 30 - 2 * pool.num_slots  # the kept arrays, handed out again
        assert q.get(timeout=60) == list(range(30))
        proc.join(30)


@pytest.mark.parametrize("release", [True, False], ids=["released", "dropped"])
def test_subscriber_hands_its_arrays_out_again(cp, tmp_path, release):
    """The subscriber keeps one array per slot and layout; frames dropped unreleased come back.

    ``dropped``: the consumer never calls release(); with 3 slots and 40
    frames the producer would stall after 1 frame if leases of dropped frames
    did not come back (they do, at the consumer's next recv at the latest).
    """
    import multiprocessing as mp

    from tests.gpu_helpers import run_consumer_tracking_arrays

    address = str(tmp_path / "sub-views.sock")
    ctx = mp.get_context("spawn")
    frames = 40
    with cip.IpcPool(3, MiB) as pool, cip.Publisher(pool, address) as pub:
        q = ctx.Queue()
        proc = ctx.Process(target=run_consumer_tracking_arrays, args=(address, frames, release, q))
        proc.start()
        assert q.get(timeout=120) == "ready"
        while not pub.subscribers:
            pub.poll(0.05)
        for value in range(frames):
            with pub.frame(timeout=20) as f:
                a = f.array((1024,), cp.int32)
                a.fill(value)
                f.publish(a)
                del a
        got = q.get(timeout=60)
        proc.join(30)
    assert not (isinstance(got, tuple) and got and got[0] == "error"), got
    values, reused = got
    assert values == list(range(frames))
    assert reused >= frames - 2 * pool.num_slots  # one array per slot, handed out again
