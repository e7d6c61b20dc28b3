"""GPU tier: the CuPy allocator hook puts outputs straight into the current slot."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading

import numpy as np
import pytest

import cupy_ipcpool as cip
from tests.gpu_helpers import report_exception

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.fixture
def pool():
    with cip.IpcPool(2, 64 * MiB) as p:
        yield p


def _inside(pool, array, slot=None):
    slot = pool.current if slot is None else slot
    base = pool.ptr(slot)
    return base <= array.data.ptr < base + pool.slot_nbytes


def test_outputs_of_common_ops_land_in_the_slot(cp, pool):
    rng = np.random.default_rng(0)
    a_h = rng.standard_normal((256, 256)).astype(np.float32)
    b_h = rng.standard_normal((256, 256)).astype(np.float32)
    a, b = cp.asarray(a_h), cp.asarray(b_h)
    square = cp.RawKernel(
        r'extern "C" __global__ void sq(const float* x, float* y, int n) {'
        r" int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = x[i] * x[i]; }",
        "sq",
    )
    with pool.allocating():
        ew = cp.sin(a) + 2 * b
        red = a.sum(axis=0)
        full = cp.sum(a * b)
        mm = a @ b
        ff = cp.fft.fft(a[0])
        raw = cp.empty_like(a)
        square((256,), (256,), (a, raw, cp.int32(a.size)))
    for arr in (ew, red, full, mm, ff, raw):
        assert _inside(pool, arr), "output allocated outside the slot"
    np.testing.assert_allclose(cp.asnumpy(ew), np.sin(a_h) + 2 * b_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(red), a_h.sum(axis=0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(float(full), float((a_h * b_h).sum()), rtol=1e-3)
    ref = a_h.astype(np.float64) @ b_h.astype(np.float64)
    rel = np.linalg.norm(cp.asnumpy(mm) - ref) / np.linalg.norm(ref)
    assert rel < 1e-3
    np.testing.assert_allclose(cp.asnumpy(ff), np.fft.fft(a_h[0]), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(cp.asnumpy(raw), a_h * a_h, rtol=1e-6)


def test_allocations_outside_the_block_are_unaffected(cp, pool):
    with pool.allocating():
        inside = cp.ones(1000)
    outside = cp.ones(1000)
    assert _inside(pool, inside)
    assert not _inside(pool, outside)


def test_nesting_and_restore(cp, pool):
    with cip.IpcPool(1, 8 * MiB) as other:
        with pool.allocating():
            first = cp.ones(10)
            with other.allocating():
                inner = cp.ones(10)
            after = cp.ones(10)
        assert _inside(pool, first) and _inside(pool, after)
        assert _inside(other, inner, slot=0)


def test_thread_locality(cp, pool):
    seen = {}
    started, release = threading.Event(), threading.Event()

    def other_thread():
        started.wait(10)
        seen["array"] = cp.ones(1000)
        release.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with pool.allocating():
        started.set()
        release.wait(10)
        mine = cp.ones(1000)
    t.join(10)
    assert _inside(pool, mine)
    assert not _inside(pool, seen["array"])


def test_previous_allocator_restored_after_exception(cp, pool):
    with pytest.raises(RuntimeError), pool.allocating():
        cp.ones(10)
        raise RuntimeError("user code failed")
    assert not _inside(pool, cp.ones(10))


def test_overflow_raises_with_requested_and_remaining(cp):
    with cip.IpcPool(1, 2 * MiB) as pool, pool.allocating():
        keep = cp.empty(MiB, dtype=cp.uint8)
        with pytest.raises(cip.SlotFullError) as info:
            cp.empty(2 * MiB, dtype=cp.uint8)
        assert info.value.requested >= 2 * MiB
        assert info.value.remaining <= MiB
        del keep


def test_spill_policy_reports_not_shareable(cp):
    with cip.IpcPool(1, 2 * MiB) as pool:
        with pool.allocating(overflow="spill") as scope:
            fits = cp.ones(1024, dtype=cp.float32)
            spilled = cp.ones(MiB, dtype=cp.float32)  # 4 MiB: does not fit
        assert scope.spills == 1 and scope.spilled_bytes >= 4 * MiB
        pool.handle(fits)
        with pytest.raises(cip.NotShareableError):
            pool.handle(spilled)
        assert float(spilled.sum()) == MiB


def test_freed_space_is_reused(cp, pool):
    with pool.allocating():
        x = cp.empty(1000, dtype=cp.float32)
        ptr = x.data.ptr
        del x
        y = cp.empty(1000, dtype=cp.float32)
    assert y.data.ptr == ptr


def test_a_slot_with_a_live_array_is_not_recycled(cp, pool):
    with pool.allocating():
        y = cp.arange(100)
    assert pool.local_refs(0) >= 1
    assert pool.next() == 1
    z = pool.array(slot=1)  # now both slots are held by arrays
    with pytest.raises(cip.SlotBusyError, match="slot 0: 1 local array"):
        pool.next(timeout=0)
    del y
    gc.collect()
    assert pool.local_refs(0) == 0
    assert pool.next() == 0
    del z


def _child_read_handles(desc_bytes, handle_bytes, queue):
    try:
        import cupy as cp

        desc = cip.PoolDescriptor.from_bytes(desc_bytes)
        with cip.attach(desc) as peer:
            out = [cp.asnumpy(peer.array(cip.ArrayHandle.from_bytes(h))) for h in handle_bytes]
        queue.put(("ok", out))
    except BaseException:
        report_exception(queue)


@pytest.mark.timeout(120)
def test_handles_of_views_round_trip_through_a_second_process(cp, pool):
    with pool.allocating():
        y = cp.arange(24 * 20, dtype=cp.float64).reshape(24, 20) * 1.5
        views = [y, y[3:17:2, 1::3], y.T, y[::-1, 5], y[7]]
    handles = [pool.handle(v) for v in views]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(
        target=_child_read_handles,
        args=(
            pool.descriptor(transport="pidfd").to_bytes(),
            [h.to_bytes() for h in handles],
            queue,
        ),
    )
    proc.start()
    result = queue.get(timeout=100)
    proc.join(30)
    assert result[0] == "ok", result
    for view, got in zip(views, result[1], strict=True):
        np.testing.assert_array_equal(got, cp.asnumpy(view))


def test_spill_goes_to_the_allocator_current_at_entry(cp):
    calls = []
    default = cp.get_default_memory_pool()

    def counting(nbytes):
        calls.append(nbytes)
        return default.malloc(nbytes)

    with cip.IpcPool(1, 2 * MiB) as pool:
        with cp.cuda.using_allocator(counting), pool.allocating(overflow="spill") as scope:
            spilled = cp.ones(MiB, dtype=cp.float32)  # 4 MiB: does not fit
        assert scope.spills == 1
        assert calls and calls[-1] >= 4 * MiB  # not CuPy's default pool directly
        assert float(spilled.sum()) == MiB


def test_token_allocating_lands_in_the_token_slot(cp):
    with cip.IpcPool(3, 8 * MiB) as pool:
        with pool.acquire(slot=2) as token:
            with token.allocating():
                y = cp.arange(1000, dtype=cp.float32) * 2
            assert token.handle(y).generation == token.generation
        assert pool.locate(y.data.ptr)[0] == 2
        with pytest.raises(cip.PoolClosedError):
            token.array((4,))  # released
