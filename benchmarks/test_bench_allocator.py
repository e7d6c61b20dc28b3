"""Allocator-hook benchmarks: small-op loops (the hot path) and large ops vs the default pool."""

from __future__ import annotations

import contextlib

import pytest

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


@pytest.mark.parametrize("hook", [False, True], ids=["default", "hook"])
@pytest.mark.benchmark(group="large-ops")
def test_matmul_8192(benchmark, record, pool, hook):
    import cupy as cp

    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32)
    b = cp.random.standard_normal((8192, 8192), dtype=cp.float32)

    def run():
        with _scope(pool, hook):
            c = a @ b
        cp.cuda.Device(0).synchronize()
        del c

    run()
    benchmark.pedantic(run, rounds=10, warmup_rounds=2)
    record("matmul_hook" if hook else "matmul_default")


@pytest.mark.parametrize("hook", [False, True], ids=["default", "hook"])
@pytest.mark.benchmark(group="large-ops")
def test_elementwise_1gib(benchmark, record, pool, hook):
    import cupy as cp

    x = cp.ones(256 * MiB, dtype=cp.float32)  # 1 GiB

    def run():
        with _scope(pool, hook):
            y = x * 3.0
        cp.cuda.Device(0).synchronize()
        del y

    run()
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    record("ew1g_hook" if hook else "ew1g_default")
