"""Sharing benchmarks: attach cost, per-frame handle -> array, legacy CUDA IPC per frame.

The exporter is a real second process (spawned), as in deployment.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _driver
from cupy_ipcpool._transport import pidfd_getfd

MiB = 1 << 20
SLOTS = 8
SLOT_NBYTES = 64 * MiB


def _exporter(conn):
    import cupy as cp

    pool = cip.IpcPool(SLOTS, SLOT_NBYTES)
    legacy = cp.zeros(SLOT_NBYTES // 4, dtype=cp.float32)
    legacy_handle = cp.cuda.runtime.ipcGetMemHandle(legacy.data.ptr)
    conn.send((pool.descriptor(transport="pidfd").to_bytes(), bytes(legacy_handle)))
    conn.recv()  # wait until the benchmarks are done
    pool.close()


@pytest.fixture(scope="module")
def exporter():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exporter, args=(child,))
    proc.start()
    desc_bytes, legacy_handle = parent.recv()
    yield cip.PoolDescriptor.from_bytes(desc_bytes), legacy_handle
    parent.send("done")
    proc.join(30)


@pytest.mark.benchmark(group="attach")
def test_attach_pool(benchmark, record, exporter):
    desc, _ = exporter
    cip.attach(desc, transport="pidfd").close()

    def run():
        cip.attach(desc, transport="pidfd").close()

    benchmark.pedantic(run, rounds=50, warmup_rounds=2)
    record("attach_pool", 1 / SLOTS)


@pytest.mark.benchmark(group="attach")
def test_attach_raw_sequence(benchmark, record, exporter):
    desc, _ = exporter
    d = _driver.driver_module()
    _driver.use_device(0)
    access = [_driver.access_desc(0)]
    fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    size = desc.alloc_nbytes

    def run():
        made = []
        for remote_fd in desc.fds:
            fd = pidfd_getfd(desc.exporter_pid, remote_fd)
            _, h = d.cuMemImportFromShareableHandle(fd, fd_type)
            _, ptr = d.cuMemAddressReserve(size, 0, 0, 0)
            d.cuMemMap(ptr, size, 0, h, 0)
            d.cuMemSetAccess(ptr, size, access, 1)
            os.close(fd)
            made.append((h, ptr))
        for h, ptr in made:
            d.cuMemUnmap(ptr, size)
            d.cuMemAddressFree(ptr, size)
            d.cuMemRelease(h)

    benchmark.pedantic(run, rounds=50, warmup_rounds=2)
    record("attach_raw", 1 / SLOTS)


@pytest.mark.benchmark(group="per-frame")
def test_frame_handle_to_array(benchmark, record, exporter):
    """Consumer side of a frame: packed handle bytes -> usable cupy.ndarray."""
    desc, _ = exporter
    with cip.attach(desc) as peer:
        wire = cip.ArrayHandle.contiguous(3, 0, (1080, 1920, 4), np.uint8).to_bytes()
        owner = object()

        def run():
            return peer._arrays_from_wire(wire, 0, 1, owner)

        benchmark(run)
        record("frame_handle_to_array")


@pytest.mark.benchmark(group="per-frame")
def test_frame_ours_both_sides(benchmark, record, exporter):
    """Per-frame cost on both sides: producer array -> handle bytes, consumer bytes -> array."""
    desc, _ = exporter
    with cip.IpcPool(1, 64 * MiB) as local, cip.attach(desc) as peer:
        frame = local.array((1080, 1920, 4), np.uint8)
        owner = object()

        def run():
            wire = local.handle(frame).pack()
            return peer._arrays_from_wire(wire, 0, 1, owner)

        benchmark(run)
        record("frame_ours")


@pytest.mark.benchmark(group="per-frame")
def test_frame_legacy_ipc(benchmark, record, exporter):
    """Per-frame legacy CUDA IPC: ipcGetMemHandle (producer) + open/view/close (consumer)."""
    import cupy as cp

    _, legacy_handle = exporter
    cp.cuda.Device(0).use()
    local = cp.zeros(SLOT_NBYTES // 4, dtype=cp.float32)  # producer-side buffer

    def run():
        cp.cuda.runtime.ipcGetMemHandle(local.data.ptr)
        ptr = cp.cuda.runtime.ipcOpenMemHandle(legacy_handle)
        mem = cp.cuda.UnownedMemory(ptr, SLOT_NBYTES, None, 0)
        cp.ndarray((1080, 1920, 4), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
        cp.cuda.runtime.ipcCloseMemHandle(ptr)

    benchmark(run)
    record("frame_legacy_ipc")
