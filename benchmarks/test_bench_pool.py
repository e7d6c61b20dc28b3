"""Foundation benchmarks: slot write bandwidth and construction cost, each beside its baseline."""

from __future__ import annotations

import os

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _driver

MiB = 1 << 20
REPEAT_KERNELS = 20


def _writer():
    import cupy as cp

    return cp.ElementwiseKernel(
        "uint32 seed", "uint32 out", "out = seed + (unsigned int)i", "bench_write"
    )


@pytest.mark.parametrize(("label", "nbytes"), [("64MiB", 64 * MiB), ("1GiB", 1024 * MiB)])
@pytest.mark.parametrize("where", ["slot", "plain"])
@pytest.mark.benchmark(group="write-bandwidth")
def test_write_bandwidth(benchmark, record, where, label, nbytes):
    import cupy as cp

    kernel = _writer()
    pool = None
    if where == "slot":
        pool = cip.IpcPool(1, nbytes)
        out = pool.array((nbytes // 4,), cp.uint32)
    else:
        out = cp.empty(nbytes // 4, dtype=cp.uint32)
    seed = cp.uint32(7)
    kernel(seed, out)
    cp.cuda.Device(0).synchronize()

    def run():
        for _ in range(REPEAT_KERNELS):
            kernel(seed, out)
        cp.cuda.Device(0).synchronize()

    benchmark.pedantic(run, rounds=30, warmup_rounds=3)
    record(f"write_{where}_{label}", 1 / REPEAT_KERNELS)
    benchmark.extra_info["GB/s"] = nbytes * REPEAT_KERNELS / benchmark.stats.stats.median / 1e9
    out = None
    if pool is not None:
        pool.close()


SLOTS = 8
SLOT_NBYTES = 2 * MiB


@pytest.mark.benchmark(group="construction")
def test_construct_pool(benchmark, record):
    cip.IpcPool(1, SLOT_NBYTES).close()

    def run():
        cip.IpcPool(SLOTS, SLOT_NBYTES).close()

    benchmark.pedantic(run, rounds=50, warmup_rounds=3)
    record("construct_pool", 1 / SLOTS)


@pytest.mark.benchmark(group="construction")
def test_construct_raw_driver_sequence(benchmark, record):
    d = _driver.driver_module()
    _driver.use_device(0)
    prop = _driver.allocation_prop(0)
    access = [_driver.access_desc(0)]
    fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    gran = _driver.granularity(0)
    size = -(-SLOT_NBYTES // gran) * gran

    def run():
        made = []
        for _ in range(SLOTS):
            _, h = d.cuMemCreate(size, prop, 0)
            _, ptr = d.cuMemAddressReserve(size, 0, 0, 0)
            d.cuMemMap(ptr, size, 0, h, 0)
            d.cuMemSetAccess(ptr, size, access, 1)
            _, fd = d.cuMemExportToShareableHandle(h, fd_type, 0)
            made.append((h, ptr, fd))
        for h, ptr, fd in made:
            d.cuMemUnmap(ptr, size)
            d.cuMemAddressFree(ptr, size)
            d.cuMemRelease(h)
            os.close(fd)

    benchmark.pedantic(run, rounds=50, warmup_rounds=3)
    record("construct_raw", 1 / SLOTS)


ACQUIRES = 1000


@pytest.mark.benchmark(group="slot-token")
def test_acquire_release_token(benchmark, record):
    """pool.acquire() + release of a token: the per-frame cost of taking a slot (<= 10 us)."""
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    with cip.IpcPool(4, MiB) as pool:

        def run():
            for _ in range(ACQUIRES):
                pool.acquire(timeout=0, stream=stream).release()

        benchmark.pedantic(run, rounds=30, warmup_rounds=3)
        record("acquire_release_token", 1 / ACQUIRES)
        benchmark.extra_info["us_per_token"] = benchmark.stats.stats.median / ACQUIRES * 1e6


@pytest.mark.benchmark(group="slot-token")
def test_acquire_release_baseline_lock(benchmark, record):
    """Baseline: a lock taken and released, the floor of any slot hand-off."""
    import threading

    lock = threading.Lock()

    def run():
        for _ in range(ACQUIRES):
            lock.acquire()
            lock.release()

    benchmark.pedantic(run, rounds=30, warmup_rounds=3)
    record("acquire_release_lock", 1 / ACQUIRES)


@pytest.mark.benchmark(group="slot-token")
def test_next_seed_facade(benchmark, record):
    """pool.next(), the seed's call, over the same token machinery."""
    with cip.IpcPool(4, MiB) as pool:

        def run():
            for _ in range(ACQUIRES):
                pool.next(timeout=0)

        benchmark.pedantic(run, rounds=30, warmup_rounds=3)
        record("next", 1 / ACQUIRES)
