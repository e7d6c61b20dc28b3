"""GPU tier: the slot arena orders reuse by stream (the race of issue 9).

A kernel on stream A spins ~100 ms, then reads a temporary from the arena.
The temporary is freed on the host right after the launch; an allocation of
the same size on stream B lands at the same place and is written at once.
Without stream ordering B's write lands before A's kernel reads, and A reads
the wrong values.  This test uses only ``pool.allocating()`` so that it runs
against older versions of the package too (it fails on them).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import cupy_ipcpool as cip

pytestmark = pytest.mark.gpu

MiB = 1 << 20

SPIN_COPY_SRC = r"""
extern "C" __global__ void spin_then_copy(const unsigned int* src, unsigned int* dst,
                                          unsigned long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


@pytest.fixture
def cp():
    import cupy

    return cupy


def _spin_kernel(cp):
    return cp.RawKernel(SPIN_COPY_SRC, "spin_then_copy")


def _cycles(cp, seconds: float) -> int:
    clock_hz = cp.cuda.Device(0).attributes["ClockRate"] * 1000
    return int(seconds * clock_hz)


def test_reuse_on_another_stream_waits_for_the_first_streams_reader(cp):
    n = 1 << 20
    kernel = _spin_kernel(cp)
    a = cp.cuda.Stream(non_blocking=True)
    b = cp.cuda.Stream(non_blocking=True)
    with cip.IpcPool(1, 64 * MiB) as pool:
        dst = cp.zeros(n, dtype=cp.uint32)  # outside the pool
        # warm up: load the kernel modules (loading waits for queued work)
        with a, pool.allocating():
            warm = cp.full(n, 1, dtype=cp.uint32)
            kernel((132,), (256,), (warm, dst, cp.uint64(n), cp.int64(0)))
            warm.fill(2)
            del warm
        cp.cuda.Device(0).synchronize()

        spin = _cycles(cp, 0.1)
        with pool.allocating():
            with a:
                tmp = cp.full(n, 7, dtype=cp.uint32)
                kernel((132,), (256,), (tmp, dst, cp.uint64(n), cp.int64(spin)))
                ptr = tmp.data.ptr
                t0 = time.monotonic()
                del tmp  # freed on the host while A's kernel has not read it yet
            with b:
                other = cp.empty(n, dtype=cp.uint32)
                assert other.data.ptr == ptr  # the same place: this is the race
                other.fill(13)
                t_launched = time.monotonic() - t0
        a.synchronize()
        b.synchronize()
        got = cp.asnumpy(dst)
        assert (got == 7).all(), (
            f"A's kernel read {np.unique(got)[:4]} instead of 7: "
            "B overwrote the temporary before A had read it"
        )
        assert float(other[0]) == 13
        # B was ordered on the GPU, not by blocking the host
        assert t_launched < 0.05, t_launched
        del other


def test_reuse_on_the_same_stream_is_immediate_and_correct(cp):
    n = 1 << 20
    kernel = _spin_kernel(cp)
    a = cp.cuda.Stream(non_blocking=True)
    with cip.IpcPool(1, 64 * MiB) as pool:
        dst = cp.zeros(n, dtype=cp.uint32)
        with a, pool.allocating():
            tmp = cp.full(n, 7, dtype=cp.uint32)
            kernel((132,), (256,), (tmp, dst, cp.uint64(n), cp.int64(_cycles(cp, 0.05))))
            ptr = tmp.data.ptr
            del tmp
            again = cp.empty(n, dtype=cp.uint32)
            assert again.data.ptr == ptr
            again.fill(13)  # stream order puts this after the kernel
        a.synchronize()
        assert (cp.asnumpy(dst) == 7).all()
        del again


def test_token_arrays_are_ordered_on_the_token_stream(cp):
    n = 1 << 18
    kernel = _spin_kernel(cp)
    a = cp.cuda.Stream(non_blocking=True)
    b = cp.cuda.Stream(non_blocking=True)
    with cip.IpcPool(2, 16 * MiB) as pool:
        dst = cp.zeros(n, dtype=cp.uint32)
        with pool.acquire(stream=a) as token:
            assert token.stream_ptr == a.ptr
            src = token.array((n,), cp.uint32)
            with a:
                src.fill(5)
                kernel((132,), (256,), (src, dst, cp.uint64(n), cp.int64(_cycles(cp, 0.05))))
            del src
        with pool.acquire(stream=b, slot=token.slot) as again:
            reused = again.array((n,), cp.uint32)
            with b:
                reused.fill(9)
        b.synchronize()
        a.synchronize()
        assert (cp.asnumpy(dst) == 5).all()
        del reused
