"""GPU tier: the sync page's flags in registered host memory, written and waited on by streams.

What the channel relies on: a stream's write lands where the host (and any
other mapping of the page) sees it; ``order`` enqueues no wait when the host
already sees the value, and a wait it does enqueue holds the stream back until
the flag gets there; the memory operations go through the compiled
``_fastpath`` and report driver errors as :class:`CudaError`.
"""

from __future__ import annotations

import time

import pytest

from cupy_ipcpool._errors import CudaError
from cupy_ipcpool.channel._syncpage import SyncPage

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.fixture
def page():
    p = SyncPage.create(4, 2, 0)
    yield p
    p.close()


def test_a_stream_write_lands_where_the_host_and_another_mapping_see_it(cp, page):
    other = SyncPage.import_fd(page.fd, 4, 2, 0)
    try:
        stream = cp.cuda.Stream(non_blocking=True)
        flag = page.frame_flag(3)
        page.write(stream.ptr, flag, 0x1234_5678)
        page.write(stream.ptr, page.read_flag(1, 2), 9)
        stream.synchronize()
        assert page.flags.load(page.layout.frame_offset(3)) == 0x1234_5678
        assert other.flags.load(other.layout.read_offset(1, 2)) == 9
        assert page.reached(flag, 0x1234_5678) and not page.reached(flag, 0x1234_5679)
    finally:
        other.close()


def test_order_enqueues_nothing_when_the_flag_is_already_there(cp, page):
    stream = cp.cuda.Stream(non_blocking=True)
    writer = cp.cuda.Stream(non_blocking=True)
    flag = page.read_flag(0, 1)
    page.write(writer.ptr, flag, 5)
    writer.synchronize()
    assert page.order(stream.ptr, flag, 5) is False
    assert page.order(stream.ptr, flag, 4) is False
    stream.synchronize()


_SPIN = r"""
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


def test_a_wait_holds_the_stream_until_another_stream_writes_the_flag(cp, page):
    """Flags are set by streams; the host only reads them.

    The writer's work (a spin of 400 M cycles: 0.2 s at the H200's boost
    clock, longer below it, then the flag write) is enqueued before the wait,
    so the two streams cannot deadlock even if they share one of the device's
    hardware queues (in-process streams may; a publisher and a subscriber are
    separate processes).
    """
    spin = cp.RawKernel(_SPIN, "spin_cycles")
    stream = cp.cuda.Stream(non_blocking=True)
    writer = cp.cuda.Stream(non_blocking=True)
    flag = page.frame_flag(0)
    marker = cp.zeros(1, dtype=cp.int32)
    # Both kernels are loaded before the wait: with CUDA's lazy module loading, a
    # kernel's first launch loads its module and may synchronise the context,
    # which would here wait for the writer's spin and flag write (and the fill
    # would land after the wait had been released).
    spin((1,), (1,), (cp.int64(1000),), stream=writer)
    with stream:
        marker.fill(1)
    cp.cuda.Device().synchronize()
    marker.fill(0)
    cp.cuda.Device().synchronize()
    t0 = time.monotonic()
    spin((1,), (1,), (cp.int64(400_000_000),), stream=writer)
    page.write(writer.ptr, flag, 7)
    assert page.order(stream.ptr, flag, 7) is True  # the host does not see 7 yet
    with stream:
        marker.fill(1)  # behind the wait
    assert not stream.done
    stream.synchronize()
    held = time.monotonic() - t0
    writer.synchronize()
    spun = time.monotonic() - t0
    assert int(marker.get()[0]) == 1 and page.reached(flag, 7)
    assert held >= 0.9 * spun, (held, spun)  # released by the write at the end of the spin


def test_a_wait_is_ordered_after_a_write_on_another_stream(cp, page):
    """Producer stream writes after its kernel; consumer stream waits, then reads the data."""
    producer = cp.cuda.Stream(non_blocking=True)
    consumer = cp.cuda.Stream(non_blocking=True)
    data = cp.zeros(1 << 24, dtype=cp.float32)
    out = cp.zeros(1, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    flag = page.frame_flag(1)
    for gen in range(1, 21):
        with producer:
            data.fill(float(gen))
        page.write(producer.ptr, flag, gen)
        page.order(consumer.ptr, flag, gen)
        with consumer:
            out[...] = data[-1]
        consumer.synchronize()
        assert float(out.get()[0]) == float(gen)


def test_driver_errors_are_cuda_errors(cp, page):
    stream = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(CudaError, match="cuStreamWriteValue32"):
        page.write(stream.ptr, 3, 1)  # a misaligned address the driver refuses
    with pytest.raises(CudaError, match="cuStreamWaitValue32"):
        page.wait(stream.ptr, 3, 1)
