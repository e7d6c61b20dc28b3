"""GPU tier: the VMM ring pool (needs a CUDA device with VMM + POSIX-fd handles)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _driver
from tests._fds import fd_count
from tests.gpu_helpers import device_free, expected, fill

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def cp():
    import cupy

    return cupy


def test_kernel_write_and_read_back_every_slot(cp):
    with cip.IpcPool(4, 3 * MiB + 17) as pool:
        for slot in range(pool.num_slots):
            a = pool.array(dtype=np.uint32, slot=slot)
            assert a.data.ptr == pool.ptr(slot)
            fill(a, seed=slot + 1)
        cp.cuda.Device(0).synchronize()
        for slot in range(pool.num_slots):
            a = pool.array(dtype=np.uint32, slot=slot)
            np.testing.assert_array_equal(cp.asnumpy(a), expected(a.size, slot + 1))


def test_sizes_round_up_to_granularity_without_extra_granule():
    gran = _driver.granularity(0)
    with cip.IpcPool(1, gran) as pool:
        assert pool.alloc_nbytes == gran  # aligned: no extra granule (seed bug)
    with cip.IpcPool(1, gran + 1) as pool:
        assert pool.alloc_nbytes == 2 * gran
    with cip.IpcPool(2, 1) as pool:
        assert pool.alloc_nbytes == gran
        assert pool.slot_nbytes == 1


def test_views_offsets_strides_and_bounds(cp):
    with cip.IpcPool(2, 1 * MiB) as pool:
        whole = pool.array(dtype=np.float32, slot=1)
        whole[...] = cp.arange(whole.size, dtype=cp.float32)
        view = pool.array((4, 8), np.float32, slot=1, offset=64)
        np.testing.assert_array_equal(cp.asnumpy(view).ravel(), np.arange(16, 48, dtype=np.float32))
        strided = pool.array((4,), np.float32, slot=1, strides=(16,))
        np.testing.assert_array_equal(cp.asnumpy(strided), [0, 4, 8, 12])
        with pytest.raises(cip.DescriptorError):
            pool.array((MiB // 4 + 1,), np.float32, slot=1)  # one element past the end
        with pytest.raises(cip.DescriptorError):
            pool.array((4,), np.float32, slot=1, offset=2)  # misaligned
        with pytest.raises(cip.DescriptorError):
            pool.array((2,), np.float32, slot=1, offset=MiB - 4)
        with pytest.raises(cip.SlotIndexError):  # also an IndexError
            pool.array(slot=2)


@pytest.mark.timeout(60)
def test_arrays_default_to_the_dtype_of_cupy_empty(cp):
    with cip.IpcPool(2, MiB + 4) as pool:
        whole = pool.array(slot=1)  # as many items of the default dtype as fit
        assert whole.dtype == cp.empty(1).dtype == np.float64
        assert whole.shape == ((MiB + 4) // 8,) and whole.data.ptr == pool.ptr(1)
        with pool.acquire(slot=0) as token:
            a = token.array((16, 4))
            assert a.dtype == cp.empty((16, 4)).dtype and a.shape == (16, 4)
            a[...] = 0.5
            h = token.handle(a)
            assert h.dtype == np.float64 and h.shape == (16, 4)
        assert float(pool.array_from_handle(h).sum()) == 32.0
        del whole, a


def test_next_wraps_and_tracks_generation():
    with cip.IpcPool(3, MiB) as pool:
        seen = [pool.current]
        for _ in range(4):
            seen.append(pool.next())
        assert seen == [0, 1, 2, 0, 1]
        assert pool.ptr() == pool.ptr(1)
        pid, fd = pool.ipc_handle()
        assert pid == os.getpid() and fd == pool.fd(1) and fd >= 0
        assert pool.generation(0) == 1 and pool.generation(1) == 2


def test_next_skips_a_slot_with_a_live_array_and_waits_when_all_are_held():
    with cip.IpcPool(3, MiB) as pool:
        held = pool.array(slot=1)
        assert pool.next() == 2  # slot 1 is skipped, not recycled
        held0 = pool.array(slot=0)
        held2 = pool.array(slot=2)
        with pytest.raises(cip.SlotBusyError, match="slot 1: 1 local array"):
            pool.next(timeout=0)
        del held
        gc.collect()
        assert pool.next() == 1
        del held0, held2


def test_dlpack_torch_sees_the_same_memory(cp):
    torch = pytest.importorskip("torch")
    with cip.IpcPool(1, MiB) as pool:
        a = pool.array((256,), np.float32)
        a[...] = 3.0
        t = torch.from_dlpack(a)
        assert t.data_ptr() == pool.ptr(0)
        t.add_(1.0)
        torch.cuda.synchronize()
        assert float(a.sum()) == 256 * 4.0


@pytest.mark.device_memory
def test_close_returns_device_memory_and_fds():
    gran = _driver.granularity(0)
    pool = cip.IpcPool(1, 8 * MiB)  # warm up context and module state
    pool.close()
    fds0, free0 = fd_count(), device_free()
    pool = cip.IpcPool(8, 64 * MiB)
    assert fd_count() == fds0 + 8
    assert device_free() <= free0 - 8 * 64 * MiB
    pool.close()
    pool.close()  # idempotent
    assert fd_count() == fds0
    assert abs(device_free() - free0) <= gran


def test_use_after_close_raises():
    pool = cip.IpcPool(1, MiB)
    pool.close()
    for call in (pool.next, pool.ptr, lambda: pool.array(), pool.descriptor):
        with pytest.raises(cip.PoolClosedError):
            call()


@pytest.mark.device_memory
def test_array_keeps_memory_alive_after_close(cp):
    # the same CuPy work once before free0: the modules of its kernels and its memory
    # pool's block are loaded then, not counted against the slot's memory below (run
    # first in a process, they took 4 MiB more than the slot gave back)
    src = cp.arange(4, dtype=cp.int32)
    warm = cp.empty((4,), cp.int32)
    warm[...] = src
    cp.asnumpy(warm)
    free0 = device_free()
    pool = cip.IpcPool(1, 32 * MiB)
    a = pool.array((4,), np.int32)
    a[...] = src
    pool.close()
    assert device_free() <= free0 - 32 * MiB  # still mapped: the array needs it
    np.testing.assert_array_equal(cp.asnumpy(a), [0, 1, 2, 3])
    del a
    gc.collect()
    assert abs(device_free() - free0) <= _driver.granularity(0)


@pytest.mark.device_memory
def test_finalizer_releases_a_forgotten_pool():
    fds0, free0 = fd_count(), device_free()
    pool = cip.IpcPool(2, 16 * MiB)
    del pool
    gc.collect()
    assert fd_count() == fds0
    assert abs(device_free() - free0) <= _driver.granularity(0)


@pytest.mark.device_memory
def test_200_create_close_cycles_do_not_grow():
    cip.IpcPool(2, 4 * MiB).close()
    fds0, free0 = fd_count(), device_free()
    for _ in range(200):
        with cip.IpcPool(2, 4 * MiB) as pool:
            pool.array()
    gc.collect()
    assert fd_count() == fds0
    assert abs(device_free() - free0) <= _driver.granularity(0)


@pytest.mark.device_memory
def test_failed_construction_leaves_nothing_behind(cp):
    gran = _driver.granularity(0)
    cip.IpcPool(1, MiB).close()
    free_start = device_free()
    # take most of the device so that the second slot of three cannot be created
    hog = cp.cuda.Memory(free_start // 2)
    fds0, free0 = fd_count(), device_free()
    slot = (free0 * 6 // 10) // gran * gran
    with pytest.raises(cip.CudaOutOfMemoryError):
        cip.IpcPool(3, slot)
    gc.collect()
    assert fd_count() == fds0
    assert abs(device_free() - free0) <= gran
    del hog
    total = _driver.device_info(0).total_memory
    with pytest.raises(ValueError, match="need"):
        cip.IpcPool(2, total)  # rejected before anything is allocated
    with cip.IpcPool(1, slot) as pool:  # and the device is still fully usable
        assert pool.alloc_nbytes == slot


def test_bad_device_is_rejected():
    n = _driver.device_count()
    with pytest.raises(ValueError, match="does not exist"):
        cip.IpcPool(1, MiB, device=n)


@pytest.mark.timeout(60)
def test_use_in_forked_child_raises_clearly():
    with cip.IpcPool(1, MiB) as pool:
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: 3.12+
            pid = os.fork()
        if pid == 0:  # child: touch the pool, report, leave without running finalizers
            try:
                pool.ptr()
                msg = "no error:"
            except Exception as exc:
                msg = f"{type(exc).__name__}:{exc}"
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            name, _, message = f.read().decode().partition(":")
        _, status = os.waitpid(pid, 0)
        assert name == "ForkedProcessError", message
        assert "spawn" in message
        assert os.waitstatus_to_exitcode(status) == 0
        assert pool.ptr() != 0  # the parent's pool is unharmed


def test_seed_facade():
    with cip.IPCBufferManager(3, MiB) as mgr:
        p0 = mgr.getCurBufferPtr()
        mgr.next()
        assert mgr.getCurBufferPtr() != p0
        pid, fd = mgr.getCurIpcMemHandle()
        assert pid == os.getpid() and fd == mgr.fd(1)


def test_handle_round_trip_in_process(cp):
    with cip.IpcPool(2, MiB) as pool:
        a = pool.array((16, 16), np.float32, slot=1)
        a[...] = cp.arange(256, dtype=cp.float32).reshape(16, 16)
        v = a[2:10:2, ::3]
        h = pool.handle(v)
        assert h.slot == 1 and h.strides == v.strides
        w = pool.array_from_handle(h)
        np.testing.assert_array_equal(cp.asnumpy(w), cp.asnumpy(v))
        with pytest.raises(cip.NotShareableError):
            pool.handle(cp.zeros(4))


def test_info_cli_lists_the_device():
    out = subprocess.run(
        [sys.executable, "-m", "cupy_ipcpool", "info"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "VMM=yes" in out.stdout and "POSIX-fd=yes" in out.stdout
    assert "granularity=" in out.stdout and "pidfd_getfd:" in out.stdout
    # the MPS field says what the driver says of this process's contexts, and the note on
    # time-sliced contexts comes with a device that is not shared through MPS
    mps = _driver.device_info(0).mps
    assert mps is not None, "the driver should answer CU_DEVICE_ATTRIBUTE_MPS_ENABLED"
    assert f"MPS={'yes' if mps else 'no'}" in out.stdout
    assert ("GPU sharing between processes" in out.stdout) is (not mps)
