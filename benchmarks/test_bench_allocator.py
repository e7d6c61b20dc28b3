"""Allocator-hook benchmarks: small-op loops (the hot path) and large ops vs the default pool."""

from __future__ import annotations

import contextlib
import statistics

import pytest
from conftest import record_value

import cupy_ipcpool as cip

MiB = 1 << 20
SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16]


@pytest.fixture(scope="module")
def pool():
    with cip.IpcPool(2, 2048 * MiB) as p:
        yield p


def _scope(pool, hook):
    return pool.allocating() if hook else contextlib.nullcontext()


@pytest.mark.parametrize("hook", [False, True], ids=["default", "hook"])
@pytest.mark.benchmark(group="small-ops")
def test_small_ops(benchmark, record, pool, hook):
    import cupy as cp

    xs = [cp.arange(n, dtype=cp.float32) for n in SIZES]

    def run():
        with _scope(pool, hook):
            for x in xs:
                y = x * 2.0 + 1.0
                z = cp.sqrt(y)
                del y, z
        cp.cuda.Device(0).synchronize()

    run()
    benchmark.pedantic(run, rounds=200, warmup_rounds=10)
    record("small_ops_hook" if hook else "small_ops_default")


def _interleaved_gpu_medians(pool, op, rounds):
    """Run ``op`` alternately under the default pool and the hook; median GPU ms of each.

    Timed with CUDA events around the op (GPU time), alternating so that clock
    or thermal drift affects both variants alike.
    """
    import cupy as cp

    times = {False: [], True: []}
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for i in range(rounds + 2):
        for hook in (False, True):
            with _scope(pool, hook):
                start.record()
                out = op()
                stop.record()
            stop.synchronize()
            if i >= 2:  # warm-up rounds
                times[hook].append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
            del out
    return statistics.median(times[False]), statistics.median(times[True])


def test_matmul_8192(pool):
    import cupy as cp

    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32)
    b = cp.random.standard_normal((8192, 8192), dtype=cp.float32)
    default, hook = _interleaved_gpu_medians(pool, lambda: a @ b, 15)
    record_value("matmul_default", default)
    record_value("matmul_hook", hook)


def test_elementwise_1gib(pool):
    import cupy as cp

    x = cp.ones(256 * MiB, dtype=cp.float32)  # 1 GiB in, 1 GiB out
    default, hook = _interleaved_gpu_medians(pool, lambda: x * 3.0, 30)
    record_value("ew1g_default", default)
    record_value("ew1g_hook", hook)


@pytest.mark.benchmark(group="hook-breakdown")
def test_hook_enter_exit(benchmark, record, pool):
    def run():
        with pool.allocating():
            pass

    benchmark(run)
    record("hook_enter_exit")


@pytest.mark.parametrize("hook", [False, True], ids=["default", "hook"])
@pytest.mark.benchmark(group="hook-breakdown")
def test_alloc_free_1kib(benchmark, record, pool, hook):
    import cupy as cp

    def run():
        for _ in range(100):
            a = cp.empty(256, dtype=cp.float32)
            del a

    with _scope(pool, hook):
        benchmark(run)
    record("alloc_free_hook" if hook else "alloc_free_default", 1 / 100)
