"""What every lane shares: the fill and check kernels, the frame checks, the done signal.

Every lane writes each frame on the GPU with the same trivial kernel (fill with
the frame's value, :class:`GpuWork`), hands it over, and the consumer verifies
it with the same check: on timed frames a kernel enqueued on the consumer's
stream compares :data:`CHECK_SAMPLES` evenly spaced elements (the first and the
last among them) with the value and adds mismatches to a device-side counter,
read back once at the end of each timed phase; on warm-up and check frames a
full, synchronous comparison of every element.
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
import warnings
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from ..interface import LaneUnavailable, raw_socket, recv_exact

MiB = 1 << 20
#: A frame's value on the wire (what it was filled with).
VALUE = struct.Struct("<q")
#: The consumer's done signal, one byte per frame.
DONE = b"d"


def has_module(name: str) -> bool:
    """Whether ``name`` could be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: Elements the timed-frame check compares: evenly spaced, first and last included.
CHECK_SAMPLES = 64
FILL_THREADS = 256
FILL_MAX_BLOCKS = 4096

#: The one fill kernel and the one check kernel every lane and floor uses, and the
#: same two with a GPU timestamp (``%globaltimer``: nanoseconds, one clock for
#: every context on the GPU) for the gpu-clock measurement (:class:`GpuClock`):
#: ``cipbench_fill_clock`` raises ``end_ns[index]`` to the time each block has
#: issued its last write of the frame (the largest over the blocks: the fill's
#: end), ``cipbench_check_clock`` writes ``start_ns[index]`` before its first read.
#: The plain kernels are unchanged by the clocked ones (same bodies, inlined).
KERNEL_SOURCE = r"""
__device__ __forceinline__ unsigned long long cipbench_globaltimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
    return t;
}

__device__ __forceinline__ void cipbench_fill_body(int* __restrict__ a, unsigned long long n,
                                                   int value)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride)
        a[i] = value;
}

// One block of CHECK_SAMPLES threads; thread k reads element k * (n - 1) / (CHECK_SAMPLES - 1).
__device__ __forceinline__ void cipbench_check_body(const int* __restrict__ a,
                                                    unsigned long long n, int value,
                                                    unsigned long long* __restrict__ errors)
{
    unsigned long long k = threadIdx.x;
    unsigned long long idx = (n > 1 && blockDim.x > 1) ? k * (n - 1) / (blockDim.x - 1) : 0;
    int bad = a[idx] != value;
    int nbad = __syncthreads_count(bad);
    if (threadIdx.x == 0 && nbad)
        atomicAdd(errors, (unsigned long long)nbad);
}

extern "C" __global__ void cipbench_fill(int* __restrict__ a, unsigned long long n, int value)
{
    cipbench_fill_body(a, n, value);
}

extern "C" __global__ void cipbench_check(const int* __restrict__ a, unsigned long long n,
                                          int value, unsigned long long* __restrict__ errors)
{
    cipbench_check_body(a, n, value, errors);
}

// The fill, then the time its block issued its last write; end_ns[index] ends as the
// latest over the blocks (it must start at 0).
extern "C" __global__ void cipbench_fill_clock(int* __restrict__ a, unsigned long long n,
                                               int value, unsigned long long* __restrict__ end_ns,
                                               unsigned int index)
{
    cipbench_fill_body(a, n, value);
    __syncthreads();
    if (threadIdx.x == 0)
        atomicMax(end_ns + index, cipbench_globaltimer());
}

// The time the check starts, before any of its reads, then the check.
extern "C" __global__ void cipbench_check_clock(const int* __restrict__ a, unsigned long long n,
                                                int value, unsigned long long* __restrict__ errors,
                                                unsigned long long* __restrict__ start_ns,
                                                unsigned int index)
{
    if (threadIdx.x == 0)
        start_ns[index] = cipbench_globaltimer();
    __syncthreads();
    cipbench_check_body(a, n, value, errors);
}
"""


def sample_indices(nelem: int, *, samples: int = CHECK_SAMPLES) -> list[int]:
    """The element indices the check kernel compares (its formula, on the host)."""
    if nelem <= 0:
        raise ValueError(f"nelem must be positive, got {nelem}")
    return [k * (nelem - 1) // (samples - 1) if nelem > 1 else 0 for k in range(samples)]


def fill_blocks(nelem: int) -> int:
    """Blocks of :data:`FILL_THREADS` threads the fill kernel is launched with."""
    return max(1, min(-(-nelem // FILL_THREADS), FILL_MAX_BLOCKS))


class MismatchCounter:
    """Turns the cumulative device-side counter into per-phase mismatch counts."""

    def __init__(self) -> None:
        self.reported = 0

    def take(self, total: int) -> int:
        """Mismatches since the previous call, given the counter's current ``total``."""
        if total < self.reported:
            raise RuntimeError(f"the mismatch counter went back from {self.reported} to {total}")
        new, self.reported = total - self.reported, total
        return new


_MODULES: dict[int, Any] = {}


def _kernels(cp: Any) -> Any:
    """The compiled :data:`KERNEL_SOURCE` for the current device (compiled once per process)."""
    dev = cp.cuda.runtime.getDevice()
    mod = _MODULES.get(dev)
    if mod is None:
        mod = _MODULES[dev] = cp.RawModule(code=KERNEL_SOURCE)
    return mod


def external_stream(cp: Any, ptr: int, device: int) -> Any:
    """A CuPy stream object for a stream made by another library (torch, cuda.core)."""
    if ptr == 0:
        return cp.cuda.Stream.null
    with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(ptr, device)


class GpuClock:
    """Per-frame GPU timestamps of one :class:`GpuWork`, in device arrays indexed by frame.

    While :attr:`frame` is a frame index (``0 <= frame < frames``), the work's
    :meth:`GpuWork.fill` launches ``cipbench_fill_clock``, which leaves in
    ``fill_end[frame]`` the ``%globaltimer`` time (ns) at which the fill's last
    block issued its last write, and :meth:`GpuWork.enqueue_check` launches
    ``cipbench_check_clock``, which writes ``check_start[frame]`` before its
    first read.  Nothing is read back per frame: :meth:`to_host` copies both
    arrays once, at the end.  Frames never stamped read 0.

    Each array has one element more than ``frames``: the launch that loads the
    clocked kernels at :meth:`GpuWork.start_clock` stamps that one.
    """

    def __init__(self, cp: Any, frames: int, stream: Any) -> None:
        if frames <= 0:
            raise ValueError(f"frames must be positive, got {frames}")
        self.frames = frames
        self.stream = stream
        #: The frame the next fill and check stamp; -1: none (plain kernels).
        self.frame = -1
        with stream:
            self.fill_end = cp.zeros(frames + 1, dtype=cp.uint64)
            self.check_start = cp.zeros(frames + 1, dtype=cp.uint64)

    def index(self) -> int | None:
        """The element the next stamped launch writes, or None (launch the plain kernel)."""
        return self.frame if 0 <= self.frame < self.frames else None

    def to_host(self) -> dict[str, list[int]]:
        """Wait for the stream; both arrays as lists of ints (ns; 0: never stamped)."""
        self.stream.synchronize()
        with self.stream:
            end = self.fill_end[: self.frames].get()
            start = self.check_start[: self.frames].get()
        self.stream.synchronize()
        return {"fill_end_ns": [int(v) for v in end], "check_start_ns": [int(v) for v in start]}


class GpuWork:
    """The per-frame GPU work common to every lane, on one stream.

    :meth:`fill` writes a frame; :meth:`enqueue_check` compares
    :data:`CHECK_SAMPLES` elements without the host waiting, adding mismatches
    to a device-side counter; :meth:`flush` synchronises the stream once and
    returns the mismatches since the previous flush; :meth:`full_check`
    compares every element and waits for the answer.  After
    :meth:`start_clock`, the fill and the check also take GPU timestamps
    (:class:`GpuClock`).

    Parameters
    ----------
    cp:
        The ``cupy`` module.
    device:
        CUDA device ordinal (made current).
    stream:
        A CuPy stream (default: CuPy's current stream at construction).
    """

    def __init__(self, cp: Any, device: int, stream: Any = None) -> None:
        cp.cuda.Device(device).use()
        self.cp = cp
        self.stream = stream if stream is not None else cp.cuda.get_current_stream()
        mod = _kernels(cp)
        self._fill = mod.get_function("cipbench_fill")
        self._check = mod.get_function("cipbench_check")
        self._counter = MismatchCounter()
        self.clock: GpuClock | None = None
        with self.stream:
            self.errors = cp.zeros(1, dtype=cp.uint64)
        self.stream.synchronize()

    def start_clock(self, frames: int) -> GpuClock:
        """Stamp the fills and checks of frames ``0..frames-1`` from now on (:class:`GpuClock`).

        Loads the two clocked kernels now (one launch each on a scratch array,
        stamping the arrays' spare last element, and a synchronisation): the
        driver loads a kernel at its first launch, which would otherwise wait
        for the work queued before it in the first timed frame.
        """
        import numpy

        cp = self.cp
        mod = _kernels(cp)
        self._fill_clock = mod.get_function("cipbench_fill_clock")
        self._check_clock = mod.get_function("cipbench_check_clock")
        clock = GpuClock(cp, frames, self.stream)
        spare = numpy.uint32(frames)
        with self.stream:
            scratch = cp.zeros(CHECK_SAMPLES, dtype=cp.int32)
            n = numpy.uint64(scratch.size)
            self._fill_clock(
                (1,), (FILL_THREADS,), (scratch, n, numpy.int32(0), clock.fill_end, spare)
            )
            self._check_clock(
                (1,),
                (CHECK_SAMPLES,),
                (scratch, n, numpy.int32(0), self.errors, clock.check_start, spare),
            )
        self.stream.synchronize()
        del scratch
        self.clock = clock
        return clock

    def fill(self, a: Any, value: int) -> None:
        """Enqueue the fill of the int32 CuPy array ``a`` with ``value``."""
        import numpy

        n = int(a.size)
        clock = self.clock
        index = None if clock is None else clock.index()
        with self.stream:
            if index is None:
                self._fill(
                    (fill_blocks(n),), (FILL_THREADS,), (a, numpy.uint64(n), numpy.int32(value))
                )
            else:
                assert clock is not None
                self._fill_clock(
                    (fill_blocks(n),),
                    (FILL_THREADS,),
                    (a, numpy.uint64(n), numpy.int32(value), clock.fill_end, numpy.uint32(index)),
                )

    def enqueue_check(self, a: Any, value: int) -> None:
        """Enqueue the sampled comparison of ``a`` with ``value`` (the host does not wait)."""
        import numpy

        clock = self.clock
        index = None if clock is None else clock.index()
        with self.stream:
            if index is None:
                self._check(
                    (1,),
                    (CHECK_SAMPLES,),
                    (a, numpy.uint64(a.size), numpy.int32(value), self.errors),
                )
            else:
                assert clock is not None
                self._check_clock(
                    (1,),
                    (CHECK_SAMPLES,),
                    (
                        a,
                        numpy.uint64(a.size),
                        numpy.int32(value),
                        self.errors,
                        clock.check_start,
                        numpy.uint32(index),
                    ),
                )

    def full_check(self, a: Any, value: int) -> bool:
        """Whether every element of ``a`` equals ``value`` (waits for the answer)."""
        with self.stream:
            return count_mismatches(a, value) == 0

    def flush(self) -> int:
        """Wait for the stream; mismatching samples counted since the previous flush."""
        self.stream.synchronize()
        with self.stream:
            total = int(self.errors.get()[0])
        return self._counter.take(total)


def count_mismatches(a: Any, value: int) -> int:
    """Number of elements of the CuPy array ``a`` that differ from ``value`` (synchronous)."""
    import cupy

    return int(cupy.count_nonzero(a != value))


def frame_shape_ok(a: Any, nelem: int) -> bool:
    """Whether CuPy array ``a`` is ``nelem`` contiguous int32 elements (host-side)."""
    return bool(
        a.size == nelem and a.dtype.itemsize == 4 and a.dtype.kind == "i" and a.flags.c_contiguous
    )


def check_frame(work: GpuWork, a: Any, value: int, nelem: int, *, full: bool) -> bool:
    """The consumer's check of one frame, the same in every lane.

    ``full``: compare every element and wait.  Else enqueue the sampled check
    on ``work``'s stream and return True (the counter gives the verdict at the
    end of the phase).  False when the array's shape or type is wrong.
    """
    if not frame_shape_ok(a, nelem):
        return False
    if full:
        return work.full_check(a, value)
    work.enqueue_check(a, value)
    return True


def cupy_view(cp: Any, ptr: int, nbytes: int, owner: Any, device: int) -> Any:
    """An int32 ``cupy.ndarray`` over ``nbytes`` of device memory at ``ptr`` (not owned)."""
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device_id=device)
    return cp.ndarray((nbytes // 4,), dtype=cp.int32, memptr=cp.cuda.MemoryPointer(mem, 0))


def check_frame_size(nbytes: int) -> int:
    """The int32 elements of a frame of ``nbytes`` (a positive multiple of 4)."""
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"frame size must be a positive multiple of 4 bytes, got {nbytes}")
    return nbytes // 4


def cupy_or_skip() -> Any:
    """The ``cupy`` module, or :class:`LaneUnavailable` saying why not."""
    try:
        import cupy
    except ImportError as exc:
        raise LaneUnavailable(f"cupy is not importable: {exc}") from exc
    return cupy


class SocketDone:
    """Done signal over the raw link: one byte back per frame and consumer."""

    def __init__(self, links: Sequence[Connection], timeout: float) -> None:
        self.socks = [raw_socket(link) for link in links]
        for s in self.socks:
            s.settimeout(timeout)

    def wait(self) -> None:
        for s in self.socks:
            if recv_exact(s, 1) != DONE:
                raise RuntimeError("bad done signal from the consumer")

    def close(self) -> None:
        for s in self.socks:
            s.close()
