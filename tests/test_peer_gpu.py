"""GPU tier: attaching a pool from another process (real spawned children)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _driver, _peer
from tests._fds import fd_count
from tests.gpu_helpers import (
    device_free,
    expected,
    fill,
    report_exception,
    run_child_for_result,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

MiB = 1 << 20
SPAWN = mp.get_context("spawn")


def _child_read_write(desc_bytes, transport, queue):
    try:
        import cupy as cp

        desc = desc_bytes
        if isinstance(desc_bytes, bytes):
            desc = cip.PoolDescriptor.from_bytes(desc_bytes)
        with cip.attach(desc, transport=transport) as peer:
            n = peer.slot_nbytes // 4
            for slot in range(peer.num_slots):
                h = cip.ArrayHandle.contiguous(slot, 0, (n,), np.uint32)
                a = peer.array(h)
                got = cp.asnumpy(a)
                if not np.array_equal(got, expected(n, slot + 10)):
                    raise AssertionError(f"slot {slot}: child read wrong data")
                fill(a, slot + 100)
            cp.cuda.Device(peer.device).synchronize()
            del a
        queue.put(("ok",))
    except BaseException:
        report_exception(queue)


def _run_child(target, *args, timeout=90):
    """The child's one message (:func:`run_child_for_result`); its exception fails the test."""
    result, _exitcode = run_child_for_result(target, *args, timeout=timeout)
    if result[0] == "error":
        pytest.fail(f"child raised {result[1]}: {result[2]}\n{result[3]}")
    return result


@pytest.mark.parametrize("transport", ["pidfd", "socket", "auto"])
def test_child_reads_and_writes_back_every_slot(transport):
    import cupy as cp

    with cip.IpcPool(3, 2 * MiB + 4) as pool:
        for slot in range(3):
            fill(pool.array(dtype=np.uint32, slot=slot), slot + 10)
        cp.cuda.Device(0).synchronize()
        desc = pool.descriptor(transport="pidfd" if transport == "pidfd" else "socket")
        _run_child(_child_read_write, desc.to_bytes(), transport)
        for slot in range(3):
            a = pool.array(dtype=np.uint32, slot=slot)
            np.testing.assert_array_equal(cp.asnumpy(a), expected(a.size, slot + 100))


def _child_from_queue(desc_queue, queue):
    try:
        desc = desc_queue.get(timeout=60)
        # transport="socket" with no socket offered: only the pickled fds can work
        _child_read_write(desc, "socket", queue)
    except BaseException:
        report_exception(queue)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_descriptor_through_multiprocessing_queue(method):
    import cupy as cp

    ctx = mp.get_context(method)
    with cip.IpcPool(2, MiB) as pool:
        for slot in range(2):
            fill(pool.array(dtype=np.uint32, slot=slot), slot + 10)
        cp.cuda.Device(0).synchronize()
        desc_queue, queue = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_child_from_queue, args=(desc_queue, queue))
        proc.start()
        desc_queue.put(pool.descriptor(transport="pidfd"))
        result = queue.get(timeout=90)
        proc.join(60)
        assert result[0] == "ok", result
        for slot in range(2):
            a = pool.array(dtype=np.uint32, slot=slot)
            np.testing.assert_array_equal(cp.asnumpy(a), expected(a.size, slot + 100))


def _child_producer(queue):
    try:
        import cupy as cp

        pool = cip.IpcPool(2, 4 * MiB)
        for slot in range(2):
            fill(pool.array(dtype=np.uint32, slot=slot), slot + 7)
        cp.cuda.Device(0).synchronize()
        queue.put(("desc", pool.descriptor(transport="pidfd").to_bytes()))
        signal.pause()  # wait to be killed
    except BaseException:
        report_exception(queue)


def test_data_survives_sigkill_of_the_producer():
    import cupy as cp

    queue = SPAWN.Queue()
    proc = SPAWN.Process(target=_child_producer, args=(queue,))
    proc.start()
    tag, payload = queue.get(timeout=90)[:2]
    assert tag == "desc", payload
    desc = cip.PoolDescriptor.from_bytes(payload)
    peer = cip.attach(desc)
    n = desc.slot_nbytes // 4
    arrays = [peer.array(cip.ArrayHandle.contiguous(s, 0, (n,), np.uint32)) for s in range(2)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    for slot, a in enumerate(arrays):
        np.testing.assert_array_equal(cp.asnumpy(a), expected(n, slot + 7))
    # still writable and readable after the exporter is gone
    arrays[0][:4] = 1
    assert int(arrays[0][:4].sum()) == 4
    # a new attach fails clearly: the exporter has exited
    with pytest.raises(cip.TransportError, match="exited"):
        _attach_fresh(desc)
    del arrays
    peer.close()


def _attach_fresh(desc):
    # a descriptor for the same exporter but a different pool id skips the import cache
    import dataclasses

    other = dataclasses.replace(desc, pool_id=os.urandom(16))
    return cip.attach(other, transport="pidfd")


def _child_cycles(desc_bytes, cycles, queue):
    try:
        desc = cip.PoolDescriptor.from_bytes(desc_bytes)
        with cip.attach(desc, transport="pidfd") as peer:  # warm up the context
            peer.array(cip.ArrayHandle.contiguous(0, 0, (4,), np.uint8))
        gc.collect()
        fds0, free0 = fd_count(), device_free()
        for _ in range(cycles):
            peer = cip.attach(desc, transport="pidfd")
            a = peer.array(cip.ArrayHandle.contiguous(1, 0, (4,), np.uint8))
            del a
            peer.close()
        gc.collect()
        queue.put(("ok", fds0, fd_count(), free0, device_free(), _peer.cached_imports()))
    except BaseException:
        report_exception(queue)


@pytest.mark.device_memory
def test_500_attach_close_cycles_do_not_grow():
    with cip.IpcPool(2, 8 * MiB) as pool:
        _, fds0, fds1, free0, free1, cached = _run_child(
            _child_cycles, pool.descriptor(transport="pidfd").to_bytes(), 500, timeout=300
        )
        assert fds1 == fds0
        assert abs(free1 - free0) <= _driver.granularity(0)
        assert cached == 0


def test_import_cache_and_handle_checks():
    with cip.IpcPool(2, MiB) as pool:
        desc = pool.descriptor(transport="pidfd")
        data = desc.to_bytes()
        p1 = cip.attach(cip.PoolDescriptor.from_bytes(data))
        p2 = cip.attach(cip.PoolDescriptor.from_bytes(data))
        assert p1.ptr(0) == p2.ptr(0)  # imported once
        assert _peer.cached_imports() == 1
        good = cip.ArrayHandle.contiguous(1, 5, (16,), np.float32)
        p1.array(good)
        with pytest.raises(cip.StaleHandleError):
            p1.array(cip.ArrayHandle.contiguous(1, 4, (16,), np.float32))
        with pytest.raises(cip.DescriptorError):
            p1.array(cip.ArrayHandle.contiguous(2, 0, (16,), np.float32))  # no slot 2
        with pytest.raises(cip.DescriptorError):
            p1.array(cip.ArrayHandle.contiguous(0, 0, (MiB,), np.float32))  # too large
        p1.close()
        p2.close()
        gc.collect()
        assert _peer.cached_imports() == 0
        with pytest.raises(cip.PoolClosedError):
            p1.array(good)


def test_a_cupy_device_is_taken_wherever_a_device_ordinal_is():
    """``device=cupy.cuda.Device(0)`` as CuPy users write it: the pool, the seed façade,
    attach and the remote tier's device ring (issue 45, point 5)."""
    import cupy as cp

    from cupy_ipcpool.remote import DeviceSlots

    dev = cp.cuda.Device(0)
    with cip.IpcPool(2, MiB, device=dev) as pool:
        assert pool.device == 0 and type(pool.device) is int
        fill(pool.array(dtype=np.uint32, slot=1), 7)
        dev.synchronize()
        desc = cip.PoolDescriptor.from_bytes(pool.descriptor(transport="pidfd").to_bytes())
        with cip.attach(desc, device=dev) as peer:
            assert peer.device == 0
            got = peer.array(cip.ArrayHandle.contiguous(1, 0, (MiB // 4,), np.uint32))
            np.testing.assert_array_equal(cp.asnumpy(got), expected(MiB // 4, 7))
            del got
    with cip.IPCBufferManager(2, MiB, device=dev) as seed:
        assert seed.device == 0
    slots = DeviceSlots(2, MiB, device=dev)
    try:
        assert slots.device == 0 and slots.pool.device == 0
    finally:
        slots.close()
    gc.collect()


def _child_second_gpu(desc_bytes, queue):
    try:
        import cupy as cp

        desc = cip.PoolDescriptor.from_bytes(desc_bytes)
        with cip.attach(desc, device=1) as peer:
            n = desc.slot_nbytes // 4
            a = peer.array(cip.ArrayHandle.contiguous(0, 0, (n,), np.uint32))
            with cp.cuda.Device(1):
                total = int(a.astype(cp.uint64).sum())
            del a
        queue.put(("ok", total))
    except BaseException:
        report_exception(queue)


@pytest.mark.multigpu
def test_consumer_on_a_second_gpu_maps_and_reads():
    import cupy as cp

    if _driver.device_count() < 2:
        pytest.skip("needs two GPUs (run on the two-GPU machine)")
    if not _driver.can_access_peer(1, 0):
        pytest.skip("device 1 has no peer access to device 0")
    with cip.IpcPool(1, MiB) as pool:
        a = pool.array(dtype=np.uint32)
        fill(a, 3)
        cp.cuda.Device(0).synchronize()
        want = int(expected(a.size, 3).astype(np.uint64).sum())
        _, total = _run_child(_child_second_gpu, pool.descriptor(transport="pidfd").to_bytes())
        assert total == want
