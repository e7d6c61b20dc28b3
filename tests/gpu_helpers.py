"""Helpers shared by the GPU-tier tests (imported lazily: CuPy kernels need a device)."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

import pytest

SPAWN = mp.get_context("spawn")

FILL_SRC = r"""
extern "C" __global__ void fill(unsigned int* out, unsigned long long n, unsigned int seed) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) out[i] = seed * 2654435761u + (unsigned int)i;
}
"""

#: Kernels that spin ``cycles`` clock ticks first, so that one side of a channel runs
#: behind the other on the GPU: ``spin_fill`` writes ``value`` into ``out``;
#: ``spin_check`` adds the words of ``a`` other than ``value`` into ``*bad``.
SPIN_SRC = r"""
extern "C" __global__ void spin_fill(unsigned int* out, unsigned long long n,
                                     unsigned int value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x) out[i] = value;
}
extern "C" __global__ void spin_check(const unsigned int* a, unsigned long long n,
                                      unsigned int value, long long cycles,
                                      unsigned int* bad) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned int wrong = 0;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x) wrong += a[i] != value;
    if (wrong) atomicAdd(bad, wrong);
}
"""

#: How long the late kernel (:data:`LATE_SRC`) waits before it touches memory: 200 ms.
DELAY_NS = 200_000_000

#: ``late(mem, out, ns)`` waits ``ns`` on the GPU's clock, then reads the first word of
#: ``mem`` and writes it + 1 into ``out`` (a plain allocation), and 7 into ``mem[0]``: the
#: tests of a close under queued work queue it on memory the close would unmap.
LATE_SRC = r"""
extern "C" __global__ void late(unsigned int* mem, unsigned int* out, unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    out[0] = mem[0] + 1u;
    mem[0] = 7u;
}
"""

# -- the death case: a producer SIGKILLed with hundreds of frames not yet written ------
# Block mode, 8 slots of 1 MiB, a consumer whose GPU check is slower than the
# producer's fill; the consumer SIGKILLs the producer after DEATH_KILL_AT frames.
# test_death_answers_gpu.py (the Python subscriber) and test_c_library_gpu.py (the
# C one) each check the library's answers against what the checks saw.

DEATH_SLOTS, DEATH_SLOT_BYTES = 8, 1 << 20
DEATH_N = DEATH_SLOT_BYTES // 4  # uint32 elements per frame
DEATH_KILL_AT = 1500  # frames received when the consumer SIGKILLs the producer
DEATH_CAP = 1 << 16  # entries of the result array (more than can be received)
DEATH_CHECK_US = 300  # the check kernel's spin: far slower than the producer's 1 MiB fill

#: result[seq]: bit 0: the check ran; bit 1: the slot did not hold frame seq's values
SLOW_CHECK_SRC = r"""
extern "C" __global__ void slow_check(const unsigned int* a, unsigned long long n,
                                      unsigned int seed, long long cycles,
                                      unsigned int* result, unsigned long long seq,
                                      unsigned long long cap) {
    if (seq >= cap) return;
    if (threadIdx.x == 0) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }
    __syncthreads();
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        if (a[i] != seed * 2654435761u + (unsigned int)i) { atomicOr(&result[seq], 2u); break; }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(&result[seq], 1u);
}
"""


class PipeQueue:
    """A pipe's end with a queue's ``put``: :func:`death_producer` reports through a pipe."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put(self, msg: Any) -> None:
        self.conn.send(msg)


def death_producer(address: str, queue: Any) -> None:
    """Publish frames (frame i filled with seed i + 1, sent as metadata) until killed.

    Puts ``("ready",)`` once its fill kernel is loaded; it publishes once a
    subscriber joined.
    """
    try:
        import struct

        import cupy as cp

        import cupy_ipcpool as cip

        stream = cp.cuda.Stream(non_blocking=True)
        with cip.IpcPool(DEATH_SLOTS, DEATH_SLOT_BYTES) as pool, stream:
            pub = cip.Publisher(pool, address)
            warm = cp.zeros(DEATH_N, cp.uint32)
            fill(warm, 0)  # load the kernel now: a first launch waits for queued work
            cp.cuda.Device().synchronize()
            del warm
            queue.put(("ready",))
            deadline = time.monotonic() + 60
            while not pub.subscribers:
                pub.poll(0.01)
                assert time.monotonic() < deadline, "no subscriber"
            for i in range(DEATH_CAP):  # SIGKILLed long before the end
                with pub.frame(timeout=60, stream=stream) as f:
                    a = f.array((DEATH_N,), cp.uint32)
                    fill(a, i + 1)
                    f.publish(a, metadata=struct.pack("<I", i + 1))
                del a
            queue.put(("published all",))
            time.sleep(300)
    except BaseException:
        report_exception(queue)


def slow_check_kernel(dev: Any) -> tuple[Any, int, int, Any]:
    """The death case's check on ``dev``, loaded: ``(kernel, grid, cycles, result)``.

    ``grid``: one block per SM (the spins overlap); ``cycles``: DEATH_CHECK_US of
    its clock; ``result``: DEATH_CAP zeros.  Launch it as ``kernel((grid,), (256,),
    (data, uint64(DEATH_N), uint32(seed), int64(cycles), result, uint64(seq),
    uint64(DEATH_CAP)))``.
    """
    import cupy as cp

    grid = int(dev.attributes["MultiProcessorCount"])  # one block per SM: the spins overlap
    cycles = int(DEATH_CHECK_US * 1e-6 * dev.attributes["ClockRate"] * 1000)
    check = cp.RawKernel(SLOW_CHECK_SRC, "slow_check")
    result = cp.zeros(DEATH_CAP, cp.uint32)
    dummy = cp.zeros(DEATH_N, cp.uint32)
    # load the kernel before any wait is queued (module loading waits for queued work)
    no_seq = cp.uint64(DEATH_CAP)  # seq >= cap: the kernel returns at once
    args = (dummy, cp.uint64(DEATH_N), cp.uint32(0), cp.int64(0), result, no_seq, no_seq)
    check((grid,), (256,), args)
    dev.synchronize()
    return check, grid, cycles, result


_kernels: dict[str, Any] = {}


def spin_kernel(name: str) -> Any:
    """``spin_fill`` or ``spin_check`` of :data:`SPIN_SRC`, its module loaded and run once.

    A module is loaded when first launched, and loading waits for the
    context's queued work: a test that loads it in the middle of a stream
    (behind a producer's wait) would stall there.
    """
    import cupy as cp

    k = _kernels.get(name)
    if k is None:
        module = _kernels.get("spin module")
        if module is None:
            module = _kernels["spin module"] = cp.RawModule(code=SPIN_SRC)
        k = _kernels[name] = module.get_function(name)
        scratch = cp.zeros(256, dtype=cp.uint32)
        args: tuple[Any, ...] = (scratch, cp.uint64(256), cp.uint32(0), cp.int64(0))
        k((1,), (32,), args if name == "spin_fill" else (*args, scratch[:1]))
        cp.cuda.Device().synchronize()
    return k


def fill(array: Any, seed: int) -> None:
    """Write ``seed * 2654435761 + i`` into a uint32 array with a RawKernel."""
    import cupy as cp

    k = _kernels.get("fill")
    if k is None:
        k = _kernels["fill"] = cp.RawKernel(FILL_SRC, "fill")
    n = array.size
    k((min(1024, max(1, (n + 255) // 256)),), (256,), (array, cp.uint64(n), cp.uint32(seed)))


def expected(n: int, seed: int) -> Any:
    """The host-side values :func:`fill` writes."""
    import numpy as np

    i = np.arange(n, dtype=np.uint64)
    return ((seed * 2654435761 + i) & 0xFFFFFFFF).astype(np.uint32)


def device_free(device: int = 0) -> int:
    """Free device memory in bytes (driver view)."""
    from cupy_ipcpool import _driver

    return _driver.mem_info(device)[0]


def report_exception(queue: Any) -> None:
    """Send the current exception to the parent as (type name, message, traceback)."""
    import sys

    exc = sys.exc_info()[1]
    queue.put(("error", type(exc).__name__, str(exc), traceback.format_exc()))


def run_consumer_checking_values(address: str, frames: int, queue: Any) -> None:
    """Subscribe, receive ``frames`` frames of constant arrays; put the list of their values.

    Each frame's array must hold one value everywhere (checked on the GPU,
    waited for); the value is ``int(array[0])``.  Puts ``"ready"`` first, and
    an error tuple (see :func:`report_exception`) if anything fails.
    """
    try:
        import cupy as cp

        import cupy_ipcpool as cip

        values = []
        with cip.subscribe(address) as sub:
            queue.put("ready")
            for _ in range(frames):
                with sub.recv(timeout=60) as frame:
                    a = frame.array
                    first = int(a[0])
                    if not bool((a == first).all()):
                        raise AssertionError(f"frame {frame.seq} is not constant")
                    values.append(first)
                    del a
            cp.cuda.get_current_stream().synchronize()
        queue.put(values)
    except BaseException:
        report_exception(queue)


def run_consumer_tracking_arrays(address: str, frames: int, release: bool, queue: Any) -> None:
    """Receive ``frames`` frames; put ``(values, frames whose array was the slot's last one)``.

    ``release``: release each frame explicitly; else drop it (and its array)
    without releasing, relying on the lease coming back when both are gone.
    Arrays are compared by identity through weak references (which do not
    keep them in use).
    """
    try:
        import weakref

        import cupy as cp

        import cupy_ipcpool as cip

        values, reused = [], 0
        last: dict[int, Any] = {}
        with cip.subscribe(address) as sub:
            queue.put("ready")
            for _ in range(frames):
                frame = sub.recv(timeout=30)
                a = frame.array
                previous = last.get(frame.slot)
                reused += previous is not None and previous() is a
                last[frame.slot] = weakref.ref(a)
                values.append(int(a[0]))
                if release:
                    frame.release()
                del a, frame
            cp.cuda.get_current_stream().synchronize()
        queue.put((values, reused))
    except BaseException:
        report_exception(queue)


def start_child(target: Any, *args: Any) -> tuple[Any, Any]:
    """Start ``target(*args, queue)`` in a spawned process; returns ``(process, queue)``."""
    q = SPAWN.Queue()
    p = SPAWN.Process(target=target, args=(*args, q))
    p.start()
    return p, q


def run_child_for_result(target: Any, *args: Any, timeout: float = 90) -> tuple[Any, Any]:
    """Run ``target(*args, queue)`` in a spawned process; ``(its one message, its exit code)``.

    Waits ``timeout`` seconds for the message, then up to 30 s for the exit (killed after).
    """
    q = SPAWN.Queue()
    p = SPAWN.Process(target=target, args=(*args, q))
    p.start()
    try:
        result = q.get(timeout=timeout)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    return result, p.exitcode


def child_message(q: Any, timeout: float = 120) -> Any:
    """The child's next message; a child's exception (:func:`report_exception`) fails the test."""
    msg = q.get(timeout=timeout)
    if msg[0] == "error":
        pytest.fail(f"child raised {msg[1]}: {msg[2]}\n{msg[3]}")
    return msg


def wait_subscribers(pub: Any, n: int, timeout: float = 60) -> None:
    """Poll ``pub`` until ``n`` subscribers joined (fails the test after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while len(pub.subscribers) < n:
        pub.poll(0.05)
        assert time.monotonic() < deadline, "subscribers did not join"


def publish_41s_to_first_subscriber(pub: Any, who: str) -> None:
    """Wait (60 s at most) for ``who`` to subscribe to ``pub``; publish one frame of 1024 41s."""
    import cupy as cp

    deadline = time.monotonic() + 60
    while not pub.subscribers:
        pub.poll(0.01)
        assert time.monotonic() < deadline, f"{who} never joined"
    with pub.frame(timeout=10) as f:
        a = f.array((1024,), cp.uint32)
        a.fill(41)
        f.publish(a)
        del a
