"""The lanes of the comparative benchmark: ways of handing a GPU frame to another process.

Every lane writes each frame on the GPU with the same trivial kernel (fill with
the frame's value, :class:`GpuWork`), hands it over, and the consumer verifies
it with the same check: on timed frames a kernel enqueued on the consumer's
stream compares :data:`CHECK_SAMPLES` evenly spaced elements (the first and the
last among them) with the value and adds mismatches to a device-side counter,
read back once at the end of each timed phase; on warm-up and check frames a
full, synchronous comparison of every element.

No lane waits for the GPU per frame unless its own correctness needs it; each
lane's :attr:`~.harness.Lane.sync_note` says which synchronisation it keeps
and why (and the report prints it).  A host synchronisation that waits for the
other process's kernel pays GPU context switches (two processes' kernels are
time-sliced without MPS), which would measure the GPU scheduler, not the
handoff.

Lanes import CuPy, torch, cuda.core and the channel layer of cupy_ipcpool only
inside the spawned processes, so this module imports on machines without them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import mmap
import os
import socket
import struct
import time
import warnings
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Protocol

from .harness import (
    BenchConfig,
    ConsumerSide,
    Lane,
    LaneUnavailable,
    ProducerSide,
    expect,
    raw_socket,
    recv_exact,
    with_copy,
)

MiB = 1 << 20
_VALUE = struct.Struct("<q")
_DONE = b"d"
#: What the ordered floor's producer sends with the page's fd: its size, the
#: consumer's row of read flags, how many rows there are, and the ring's slots.
_ORDERED_HEAD = struct.Struct("<QIII")
_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ------------------------------------------------------------ verification
#: Elements the timed-frame check compares: evenly spaced, first and last included.
CHECK_SAMPLES = 64
FILL_THREADS = 256
FILL_MAX_BLOCKS = 4096

#: The one fill kernel and the one check kernel every lane and floor uses.
KERNEL_SOURCE = r"""
extern "C" __global__ void cipbench_fill(int* __restrict__ a, unsigned long long n, int value)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride)
        a[i] = value;
}

// One block of CHECK_SAMPLES threads; thread k reads element k * (n - 1) / (CHECK_SAMPLES - 1).
extern "C" __global__ void cipbench_check(const int* __restrict__ a, unsigned long long n,
                                          int value, unsigned long long* __restrict__ errors)
{
    unsigned long long k = threadIdx.x;
    unsigned long long idx = (n > 1 && blockDim.x > 1) ? k * (n - 1) / (blockDim.x - 1) : 0;
    int bad = a[idx] != value;
    int nbad = __syncthreads_count(bad);
    if (threadIdx.x == 0 && nbad)
        atomicAdd(errors, (unsigned long long)nbad);
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


class GpuWork:
    """The per-frame GPU work common to every lane, on one stream.

    :meth:`fill` writes a frame; :meth:`enqueue_check` compares
    :data:`CHECK_SAMPLES` elements without the host waiting, adding mismatches
    to a device-side counter; :meth:`flush` synchronises the stream once and
    returns the mismatches since the previous flush; :meth:`full_check`
    compares every element and waits for the answer.

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
        with self.stream:
            self.errors = cp.zeros(1, dtype=cp.uint64)
        self.stream.synchronize()

    def fill(self, a: Any, value: int) -> None:
        """Enqueue the fill of the int32 CuPy array ``a`` with ``value``."""
        import numpy

        n = int(a.size)
        with self.stream:
            self._fill((fill_blocks(n),), (FILL_THREADS,), (a, numpy.uint64(n), numpy.int32(value)))

    def enqueue_check(self, a: Any, value: int) -> None:
        """Enqueue the sampled comparison of ``a`` with ``value`` (the host does not wait)."""
        import numpy

        with self.stream:
            self._check(
                (1,),
                (CHECK_SAMPLES,),
                (a, numpy.uint64(a.size), numpy.int32(value), self.errors),
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


def _cupy_view(cp: Any, ptr: int, nbytes: int, owner: Any, device: int) -> Any:
    """An int32 ``cupy.ndarray`` over ``nbytes`` of device memory at ``ptr`` (not owned)."""
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device_id=device)
    return cp.ndarray((nbytes // 4,), dtype=cp.int32, memptr=cp.cuda.MemoryPointer(mem, 0))


def _check_frame_size(nbytes: int) -> int:
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"frame size must be a positive multiple of 4 bytes, got {nbytes}")
    return nbytes // 4


def _cupy_or_skip() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise LaneUnavailable(f"cupy is not importable: {exc}") from exc
    return cupy


class _SocketDone:
    """Done signal over the raw link: one byte back per frame and consumer."""

    def __init__(self, links: Sequence[Connection], timeout: float) -> None:
        self.socks = [raw_socket(link) for link in links]
        for s in self.socks:
            s.settimeout(timeout)

    def wait(self) -> None:
        for s in self.socks:
            if recv_exact(s, 1) != _DONE:
                raise RuntimeError("bad done signal from the consumer")

    def close(self) -> None:
        for s in self.socks:
            s.close()


# ==================================================== 1. cupy_ipcpool pub/sub
class CupyIpcPoolLane(Lane):
    """Publish/subscribe over a ring of VMM slots: the frame never moves."""

    name = "cupy_ipcpool"
    title = "cupy_ipcpool publish/subscribe"
    pipelined = True
    sync_note = (
        "none per frame: the library's flags in its shared sync page order both directions "
        "(the subscriber's stream waits on the slot's frame flag; the publisher's stream "
        "waits on the read flag written at release, after the check; neither waits when "
        "the host sees the flag set already), so the consumer enqueues its check and "
        "calls frame.release() without waiting."
    )

    def available(self) -> str | None:
        if not _has_module("cupy"):
            return "cupy is not installed"
        try:
            import cupy_ipcpool as cip
        except ImportError as exc:
            return f"cupy_ipcpool is not importable: {exc}"
        missing = [n for n in ("IpcPool", "Publisher", "subscribe") if not hasattr(cip, n)]
        if missing:
            return f"cupy_ipcpool has no {', '.join(missing)} (publish/subscribe layer not built)"
        return None

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _CipProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _CipConsumer(link, cfg, nbytes)


class _CipProducer(ProducerSide):
    # Per frame: acquire a slot (its stream waits on the subscribers' read flags
    # of the slot's previous frame), fill it, publish (writes the frame flag).
    # No host synchronisation: the sync page's flags order both directions.
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        import cupy

        import cupy_ipcpool as cip

        self.cp = cupy
        self.nelem = _check_frame_size(nbytes)
        self.timeout = cfg.frame_timeout
        self.nsubs = len(links)
        self.work = GpuWork(cupy, cfg.device)
        address = os.path.join(cfg.workdir, f"cip-{nbytes}.sock")
        self.pool = cip.IpcPool(cfg.num_slots, nbytes, device=cfg.device)
        self.pub: Any = None
        try:
            self.pub = cip.Publisher(self.pool, address)
            for link in links:
                link.send_bytes(b"listening " + address.encode())
            for link in links:
                expect(link, b"subscribed", self.timeout)
            self.pub.poll(timeout=0.0)  # adopt the subscribers before the first frame
        except BaseException:
            self.close()
            raise

    def send(self, value: int) -> None:
        with self.pub.frame(timeout=self.timeout, stream=self.work.stream) as frame:
            a = frame.array((self.nelem,), self.cp.int32)
            self.work.fill(a, value)
            frame.publish(a, metadata=_VALUE.pack(value))
            del a  # the slot is free again once the subscribers release it

    def wait_done(self, value: int, *, full: bool) -> None:
        deadline = time.monotonic() + self.timeout
        returned = 0
        while returned < self.nsubs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"frame {value}: {returned} of {self.nsubs} leases returned "
                    f"within {self.timeout} s"
                )
            returned += int(self.pub.poll(timeout=remaining) or 0)

    def drain(self) -> None:
        while self.pub.poll(timeout=0.0):
            pass

    def close(self) -> None:
        if self.pub is not None:
            self.pub.close()
            self.pub = None
        self.pool.close()


class _CipConsumer(ConsumerSide):
    # Per frame: recv (the stream waits on the frame event), enqueue the check,
    # release (records the read event after the check). No host synchronisation.
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        import cupy

        import cupy_ipcpool as cip

        self.nelem = _check_frame_size(nbytes)
        self.timeout = cfg.frame_timeout
        self.work = GpuWork(cupy, cfg.device)
        address = expect(link, b"listening ", self.timeout)[len(b"listening ") :].decode()
        self.sub = cip.subscribe(address, mode="block")
        link.send_bytes(b"subscribed")

    def step(self, *, full: bool) -> tuple[int, bool]:
        stream = self.work.stream
        f = self.sub.recv(timeout=self.timeout, stream=stream)
        try:
            (value,) = _VALUE.unpack(bytes(f.metadata)[: _VALUE.size])
            a = f.arrays[0]
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        finally:
            f.release(stream=stream)
        return value, ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.work.stream.synchronize()
        self.sub.close()


# ====================================================== 2. host staging
class HostStagingLane(Lane):
    """Device -> pinned shared memory -> device: the best version of the naive way.

    The producer copies the frame into a ``memfd`` mapping registered as pinned
    memory (``cudaHostRegister``), synchronises and sends the value (8 bytes)
    over the socket; the consumer, with its own pinned registration of the
    same pages, copies it into its device buffer, waits for that copy,
    enqueues its check and answers one byte.
    """

    name = "host_staging"
    title = "host staging (pinned shared memory)"
    sync_note = (
        "two per frame, both needed: the producer waits for its D2H copy before it "
        "signals (the host buffer must hold the frame), and the consumer waits for its "
        "H2D copy (an event recorded after the copy, not after the check) before it "
        "answers, since the producer then overwrites the shared host buffer. That is "
        "the real cost of the naive way."
    )

    def available(self) -> str | None:
        return None if _has_module("cupy") else "cupy is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _StagingProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _StagingConsumer(link, cfg, nbytes)


class _PinnedMapping:
    """A shared mapping of a memfd, registered with CUDA as pinned host memory."""

    def __init__(self, cp: Any, fd: int, nbytes: int) -> None:
        self.cp = cp
        self.mm = mmap.mmap(fd, nbytes)
        self._anchor: Any = ctypes.c_char.from_buffer(self.mm)
        self.ptr = ctypes.addressof(self._anchor)
        self.registered = False
        cp.cuda.runtime.hostRegister(self.ptr, nbytes, 0)
        self.registered = True

    def close(self) -> None:
        if self.registered:
            self.registered = False
            with contextlib.suppress(Exception):
                self.cp.cuda.runtime.hostUnregister(self.ptr)
        self._anchor = None
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()


class _StagingProducer(ProducerSide):
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        cp = _cupy_or_skip()
        self.cp = cp
        self.nbytes = nbytes
        self.work = GpuWork(cp, cfg.device)
        self.dev = cp.empty(_check_frame_size(nbytes), dtype=cp.int32)
        fd = os.memfd_create("cipbench-staging")
        try:
            os.ftruncate(fd, nbytes)
            self.host = _PinnedMapping(cp, fd, nbytes)
            links[0].send_bytes(b"staging")
            send_handle(links[0], fd, 0)
        finally:
            os.close(fd)
        self.done = _SocketDone(links, cfg.frame_timeout)
        self.sock = self.done.socks[0]

    def send(self, value: int) -> None:
        stream = self.work.stream
        self.work.fill(self.dev, value)
        self.cp.cuda.runtime.memcpyAsync(
            self.host.ptr, self.dev.data.ptr, self.nbytes, _D2H, stream.ptr
        )
        # Needed: the consumer reads the host buffer as soon as it has the value.
        stream.synchronize()
        self.sock.sendall(_VALUE.pack(value))

    def wait_done(self, value: int, *, full: bool) -> None:
        self.done.wait()

    def close(self) -> None:
        self.done.close()
        self.work.stream.synchronize()
        self.host.close()
        del self.dev


class _StagingConsumer(ConsumerSide):
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        cp = _cupy_or_skip()
        self.cp = cp
        self.nbytes = nbytes
        self.nelem = _check_frame_size(nbytes)
        self.work = GpuWork(cp, cfg.device)
        self.dev = cp.empty(self.nelem, dtype=cp.int32)
        self.copied = cp.cuda.Event(block=False, disable_timing=True)
        expect(link, b"staging", cfg.frame_timeout)
        fd = recv_handle(link)
        try:
            self.host = _PinnedMapping(cp, fd, nbytes)
        finally:
            os.close(fd)
        self.sock = raw_socket(link)
        self.sock.settimeout(cfg.frame_timeout)

    def step(self, *, full: bool) -> tuple[int, bool]:
        (value,) = _VALUE.unpack(recv_exact(self.sock, _VALUE.size))
        stream = self.work.stream
        self.cp.cuda.runtime.memcpyAsync(
            self.dev.data.ptr, self.host.ptr, self.nbytes, _H2D, stream.ptr
        )
        self.copied.record(stream)
        ok = check_frame(self.work, self.dev, value, self.nelem, full=full)
        # Needed: the producer overwrites the shared host buffer once we answer, so the
        # H2D copy (not the check, which reads our own device buffer) must be complete.
        self.copied.synchronize()
        self.sock.sendall(_DONE)
        return value, ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.sock.close()
        self.work.stream.synchronize()
        self.host.close()
        del self.dev


# ================================================ 3. legacy CUDA IPC per frame
class LegacyIpcLane(Lane):
    """``cudaIpcGetMemHandle`` per frame; the consumer opens, uses and closes it per frame."""

    name = "legacy_ipc"
    title = "legacy CUDA IPC, per message"
    sync_note = (
        "two per frame, both needed: the producer waits for its fill before it sends the "
        "handle (a memory handle carries no ordering), and the consumer waits for its "
        "check before cudaIpcCloseMemHandle (the kernel must not read an unmapped buffer); "
        "that wait also keeps the producer's next fill from racing the check."
    )

    def available(self) -> str | None:
        return None if _has_module("cupy") else "cupy is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _LegacyProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _LegacyConsumer(link, cfg, nbytes)


class _LegacyProducer(ProducerSide):
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        cp = _cupy_or_skip()
        self.cp = cp
        _check_frame_size(nbytes)
        self.work = GpuWork(cp, cfg.device)
        self.ptr = cp.cuda.runtime.malloc(nbytes)  # a plain cudaMalloc: IPC-exportable
        self.arr = _cupy_view(cp, self.ptr, nbytes, self, cfg.device)
        self.done = _SocketDone(links, cfg.frame_timeout)
        self.sock = self.done.socks[0]

    def send(self, value: int) -> None:
        self.work.fill(self.arr, value)
        # Needed: nothing orders the consumer's kernels after this fill but the host.
        self.work.stream.synchronize()
        handle = bytes(self.cp.cuda.runtime.ipcGetMemHandle(self.ptr))
        self.sock.sendall(handle + _VALUE.pack(value))

    def wait_done(self, value: int, *, full: bool) -> None:
        self.done.wait()

    def close(self) -> None:
        self.done.close()
        del self.arr
        self.cp.cuda.runtime.deviceSynchronize()
        self.cp.cuda.runtime.free(self.ptr)


class _LegacyConsumer(ConsumerSide):
    HANDLE_BYTES = 64

    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        self.cp = _cupy_or_skip()
        self.nbytes = nbytes
        self.nelem = _check_frame_size(nbytes)
        self.device = cfg.device
        self.work = GpuWork(self.cp, cfg.device)
        self.sock = raw_socket(link)
        self.sock.settimeout(cfg.frame_timeout)

    def step(self, *, full: bool) -> tuple[int, bool]:
        msg = recv_exact(self.sock, self.HANDLE_BYTES + _VALUE.size)
        (value,) = _VALUE.unpack(msg[self.HANDLE_BYTES :])
        rt = self.cp.cuda.runtime
        ptr = rt.ipcOpenMemHandle(msg[: self.HANDLE_BYTES])
        try:
            a = _cupy_view(self.cp, ptr, self.nbytes, None, self.device)
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        finally:
            # Needed: the check kernel may still read the mapping; close only after it.
            self.work.stream.synchronize()
            rt.ipcCloseMemHandle(ptr)
        self.sock.sendall(_DONE)
        return value, ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.work.stream.synchronize()
        self.sock.close()


# ================================================ 4. torch.multiprocessing
class TorchQueueLane(Lane):
    """A ``torch.multiprocessing`` queue carrying a CUDA tensor per frame.

    torch shares the storage with CUDA IPC and an interprocess event that the
    consumer's stream waits on; the producer reuses one tensor (the consumer
    drops each frame before it signals done).  The fill and the check are the
    common kernels (:class:`GpuWork`), launched on torch's current stream.
    """

    name = "torch_mp"
    title = "torch.multiprocessing queue"
    queue: Any = None
    sync_note = (
        "torch's own: the consumer's stream waits on the producer's event (no host wait), "
        "and freeing a received CUDA storage synchronises the consumer's current stream "
        "before torch drops its IPC reference, so dropping the tensor after enqueuing the "
        "check waits for the check. The lane adds only a stream synchronize after that "
        "(nothing is left to wait for by then); it guards the reuse of the producer's tensor."
    )

    def available(self) -> str | None:
        if not _has_module("torch"):
            return "torch is not installed"
        return None if _has_module("cupy") else "cupy is not installed (the common kernels)"

    def prepare(self, ctx: Any) -> Lane:
        return with_copy(self, queue=ctx.Queue())

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _TorchProducer(self.queue, links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _TorchConsumer(self.queue, link, cfg, nbytes)


def _torch_or_skip(device: int) -> Any:
    try:
        import torch
        import torch.multiprocessing  # registers the CUDA tensor reducers
    except ImportError as exc:
        raise LaneUnavailable(f"torch is not importable: {exc}") from exc
    if not torch.cuda.is_available():
        raise LaneUnavailable(f"torch {torch.__version__} has no CUDA device available")
    torch.cuda.set_device(device)
    return torch


def _torch_work(torch: Any, device: int) -> GpuWork:
    """:class:`GpuWork` on torch's current stream (the one torch's IPC events order)."""
    cp = _cupy_or_skip()
    ptr = int(torch.cuda.current_stream(device).cuda_stream)
    return GpuWork(cp, device, external_stream(cp, ptr, device))


class _TorchProducer(ProducerSide):
    def __init__(
        self, queue: Any, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> None:
        super().__init__()
        self.torch = _torch_or_skip(cfg.device)
        self.work = _torch_work(self.torch, cfg.device)
        self.queue = queue
        self.t = self.torch.empty(
            _check_frame_size(nbytes), dtype=self.torch.int32, device=f"cuda:{cfg.device}"
        )
        self.arr = _cupy_view(self.work.cp, self.t.data_ptr(), nbytes, self.t, cfg.device)
        self.done = _SocketDone(links, cfg.frame_timeout)

    def send(self, value: int) -> None:
        self.work.fill(self.arr, value)
        self.queue.put((value, self.t))  # torch records its event when it pickles the tensor

    def wait_done(self, value: int, *, full: bool) -> None:
        self.done.wait()

    def close(self) -> None:
        self.done.close()
        self.torch.cuda.synchronize()
        del self.arr
        del self.t


class _TorchConsumer(ConsumerSide):
    def __init__(self, queue: Any, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        self.torch = _torch_or_skip(cfg.device)
        self.work = _torch_work(self.torch, cfg.device)
        self.queue = queue
        self.nbytes = nbytes
        self.nelem = _check_frame_size(nbytes)
        self.device = cfg.device
        self.timeout = cfg.frame_timeout
        self.sock = raw_socket(link)
        self.sock.settimeout(cfg.frame_timeout)

    def step(self, *, full: bool) -> tuple[int, bool]:
        value, t = self.queue.get(timeout=self.timeout)
        torch = self.torch
        ok = bool(t.is_cuda and t.dtype == torch.int32 and t.numel() == self.nelem)
        if ok:
            a = _cupy_view(self.work.cp, t.data_ptr(), self.nbytes, t, self.device)
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        del t  # torch synchronises its current stream as it frees the received storage
        # Needed for the producer's reuse of its tensor; finds nothing pending after torch's.
        self.work.stream.synchronize()
        self.sock.sendall(_DONE)
        return int(value), ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.work.stream.synchronize()
        self.sock.close()


# ======================================================== 5. cuda.core IPC
def _cuda_core() -> Any:
    """The cuda.core namespace with an IPC memory-resource API, or LaneUnavailable.

    Two spellings exist: methods (``DeviceMemoryResource.get_allocation_handle()``,
    ``Buffer.get_ipc_descriptor()``, in the experimental namespace) and properties
    (``DeviceMemoryResource.allocation_handle``, ``Buffer.ipc_descriptor``, in
    cuda.core 1.x); either is accepted (see :func:`_allocation_handle`,
    :func:`_ipc_descriptor`).
    """
    cc: Any = None
    errors = []
    for modname in ("cuda.core", "cuda.core.experimental"):
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:
            errors.append(f"{modname}: {exc}")
            continue
        if hasattr(mod, "DeviceMemoryResource"):
            cc = mod
            break
    if cc is None:
        raise LaneUnavailable("cuda.core is not importable: " + "; ".join(errors))
    missing = [
        n
        for n in ("Device", "DeviceMemoryResource", "DeviceMemoryResourceOptions", "Buffer")
        if not hasattr(cc, n)
    ]
    if not missing:
        missing = ipc_api_missing(cc.DeviceMemoryResource, cc.Buffer)
    if missing:
        version = getattr(importlib.import_module("cuda.core"), "__version__", "?")
        raise LaneUnavailable(
            f"cuda.core {version} lacks the IPC memory-resource API ({', '.join(missing)})"
        )
    return cc


def ipc_api_missing(mr_cls: Any, buffer_cls: Any) -> list[str]:
    """What of the IPC API the classes lack, naming both spellings where either would do."""
    missing = []
    if not (hasattr(mr_cls, "allocation_handle") or hasattr(mr_cls, "get_allocation_handle")):
        missing.append(
            "DeviceMemoryResource.allocation_handle / DeviceMemoryResource.get_allocation_handle"
        )
    if not hasattr(mr_cls, "from_allocation_handle"):
        missing.append("DeviceMemoryResource.from_allocation_handle")
    if not hasattr(buffer_cls, "from_ipc_descriptor"):
        missing.append("Buffer.from_ipc_descriptor")
    if not (hasattr(buffer_cls, "ipc_descriptor") or hasattr(buffer_cls, "get_ipc_descriptor")):
        missing.append("Buffer.ipc_descriptor / Buffer.get_ipc_descriptor")
    return missing


def _allocation_handle(mr: Any) -> tuple[Any, bool]:
    """``(handle, owned_by_caller)``: the memory resource's shareable allocation handle.

    cuda.core 1.x caches the handle in the resource (a property; the resource
    closes it); the older method returned one for the caller to close.
    """
    getter = getattr(type(mr), "get_allocation_handle", None)
    if callable(getter):
        return mr.get_allocation_handle(), True
    return mr.allocation_handle, False


def _ipc_descriptor(buf: Any) -> Any:
    getter = getattr(type(buf), "get_ipc_descriptor", None)
    return buf.get_ipc_descriptor() if callable(getter) else buf.ipc_descriptor


def _handle_fd(handle: Any) -> int:
    inner = getattr(handle, "handle", None)
    return int(inner) if inner is not None else int(handle)


class CudaCoreLane(Lane):
    """cuda.core IPC-enabled memory pool; a buffer descriptor sent per frame.

    The producer maps its pool into the consumer once (allocation handle /
    ``from_allocation_handle``), keeps one buffer, and sends its IPC descriptor
    with each frame; the consumer imports it (``Buffer.from_ipc_descriptor``),
    checks it and closes it per frame.
    """

    name = "cuda_core"
    title = "cuda.core IPC buffers"
    sync_note = (
        "two per frame, both needed: a buffer descriptor carries no ordering, so the "
        "producer waits for its fill before it sends it, and the consumer waits for its "
        "check (after the stream-ordered close of the imported buffer) before it answers, "
        "since the producer then rewrites the same buffer."
    )

    def available(self) -> str | None:
        if not _has_module("cuda.core"):
            return "cuda-core is not installed"
        return None if _has_module("cupy") else "cupy is not installed (the common kernels)"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _CoreProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _CoreConsumer(link, cfg, nbytes)


def _close_quietly(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()


class _CoreProducer(ProducerSide):
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        cc = _cuda_core()
        cp = _cupy_or_skip()
        self.cp = cp
        self.link = links[0]
        self.timeout = cfg.frame_timeout
        _check_frame_size(nbytes)
        dev = cc.Device(cfg.device)
        dev.set_current()
        self.stream = dev.create_stream()
        self.work = GpuWork(
            cp, cfg.device, external_stream(cp, int(self.stream.handle), cfg.device)
        )
        opts = cc.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * nbytes + 64 * MiB)
        self.mr = cc.DeviceMemoryResource(dev, options=opts)
        self.alloc_handle: Any = None
        self.buf: Any = None
        if not getattr(self.mr, "is_ipc_enabled", True):
            raise LaneUnavailable("cuda.core made a memory resource that is not IPC-enabled")
        handle, owned = _allocation_handle(self.mr)
        if owned:
            self.alloc_handle = handle
        self.link.send_bytes(b"mr")
        send_handle(self.link, _handle_fd(handle), 0)
        self.buf = self.mr.allocate(nbytes, stream=self.stream)
        self.stream.sync()
        self.arr = _cupy_view(cp, int(self.buf.handle), nbytes, self.buf, cfg.device)

    def send(self, value: int) -> None:
        self.work.fill(self.arr, value)
        # Needed: the descriptor carries no event; the consumer may read at once.
        self.stream.sync()
        self.link.send((value, _ipc_descriptor(self.buf)))

    def wait_done(self, value: int, *, full: bool) -> None:
        expect(self.link, _DONE, self.timeout)

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.arr
        self.cp.cuda.runtime.deviceSynchronize()
        if self.buf is not None:
            self.buf.close(self.stream)
            self.stream.sync()
        for obj in (self.alloc_handle, self.mr):
            if obj is not None:
                _close_quietly(obj)


class _CoreConsumer(ConsumerSide):
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        self.cc = cc = _cuda_core()
        self.cp = cp = _cupy_or_skip()
        self.link = link
        self.timeout = cfg.frame_timeout
        self.nbytes = nbytes
        self.nelem = _check_frame_size(nbytes)
        self.device = cfg.device
        dev = cc.Device(cfg.device)
        dev.set_current()
        self.stream = dev.create_stream()
        self.work = GpuWork(
            cp, cfg.device, external_stream(cp, int(self.stream.handle), cfg.device)
        )
        expect(link, b"mr", self.timeout)
        fd = recv_handle(link)
        try:
            self.mr = cc.DeviceMemoryResource.from_allocation_handle(dev, fd)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def step(self, *, full: bool) -> tuple[int, bool]:
        if not self.link.poll(self.timeout):
            raise TimeoutError(f"no frame within {self.timeout} s")
        value, desc = self.link.recv()
        buf = self.cc.Buffer.from_ipc_descriptor(self.mr, desc, stream=self.stream)
        try:
            a = _cupy_view(self.cp, int(buf.handle), self.nbytes, buf, self.device)
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        finally:
            buf.close(self.stream)  # stream-ordered: after the check
        # Needed: the producer rewrites the same buffer once we answer.
        self.stream.sync()
        self.link.send_bytes(_DONE)
        return int(value), ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.stream.sync()
        _close_quietly(self.mr)


# ============================================================= 6. the floors
def wire_sizes() -> tuple[int, int]:
    """Bytes of cupy_ipcpool's FRAME message (one 1-D array, 8 metadata bytes) and RELEASE.

    Computed with the library's own encoders; ``(96, 16)`` if they are not there.
    """
    try:
        import numpy

        from .._handles import ArrayHandle
        from ..channel import _payload, _protocol

        h = ArrayHandle(
            slot=0, generation=1, offset=0, shape=(1 << 24,), strides=(4,), dtype=numpy.dtype("i4")
        )
        payload = _payload.FRAME_HEAD.pack(0, 1, _VALUE.size) + h.pack() + bytes(_VALUE.size)
        return len(_protocol.encode_frame(1, 0, payload)), len(_protocol.encode_release(1, 0))
    except Exception:
        return 96, 16


class SocketFloorLane(Lane):
    """A bare Unix-socket round trip, as cupy_ipcpool's channel sends it. No GPU.

    Same socket kind (``SOCK_SEQPACKET`` on a filesystem path), a message the
    size of a FRAME out, one the size of a RELEASE back.
    """

    name = "socket_floor"
    title = "floor: bare Unix-socket round trip"
    sync_note = "none: no GPU work; the consumer compares the message bytes on the host."

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _SocketFloorProducer(links, cfg)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _SocketFloorConsumer(link, cfg)


def _floor_message(value: int, nbytes: int) -> bytes:
    body = bytes((value + i) & 0xFF for i in range(max(nbytes - _VALUE.size, 0)))
    return _VALUE.pack(value) + body


class _SocketFloorProducer(ProducerSide):
    """The floors' producer socket: a FRAME-sized message out, a RELEASE-sized one back."""

    def __init__(self, links: Sequence[Connection], cfg: BenchConfig) -> None:
        super().__init__()
        self.msg_bytes, self.reply_bytes = wire_sizes()
        path = os.path.join(cfg.workdir, "floor.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.socks: list[socket.socket] = []
        try:
            listener.bind(path)
            listener.listen(len(links))
            listener.settimeout(cfg.frame_timeout)
            for link in links:
                link.send_bytes(b"listening " + path.encode())
            for _ in links:
                conn, _addr = listener.accept()
                conn.settimeout(cfg.frame_timeout)
                self.socks.append(conn)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)

    def send(self, value: int) -> None:
        msg = _floor_message(value, self.msg_bytes)
        for s in self.socks:
            s.send(msg)

    def wait_done(self, value: int, *, full: bool) -> None:
        for s in self.socks:
            if len(s.recv(self.reply_bytes)) != self.reply_bytes:
                raise RuntimeError("bad done signal from the consumer")

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


class _SocketFloorConsumer(ConsumerSide):
    """The floors' consumer socket: :meth:`receive` the message, :meth:`reply` to it."""

    def __init__(self, link: Connection, cfg: BenchConfig) -> None:
        self.msg_bytes, self.reply_bytes = wire_sizes()
        path = expect(link, b"listening ", cfg.frame_timeout)[len(b"listening ") :].decode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(cfg.frame_timeout)
        self.sock.connect(path)
        self.reply_msg = bytes(self.reply_bytes)

    def receive(self) -> tuple[int, bool]:
        """The next message's value, and whether its bytes are the ones sent for it."""
        msg = self.sock.recv(self.msg_bytes + 1)
        if len(msg) < _VALUE.size:
            raise EOFError("the producer closed the floor socket")
        (value,) = _VALUE.unpack(msg[: _VALUE.size])
        return value, msg == _floor_message(value, self.msg_bytes)

    def reply(self) -> None:
        """Send the RELEASE-sized answer."""
        self.sock.send(self.reply_msg)

    def step(self, *, full: bool) -> tuple[int, bool]:
        value, ok = self.receive()
        self.reply()
        return value, ok

    def close(self) -> None:
        self.sock.close()


class SocketGpuFloorLane(Lane):
    """socket_floor's round trip plus the same kernels, each process on its own memory.

    The IPC-free floor of "two processes each launching one kernel per frame
    plus one socket round trip": per frame the producer enqueues the common
    fill (:meth:`GpuWork.fill`) of its own int32 array with the frame's value
    and sends the FRAME-sized message exactly as :class:`SocketFloorLane`
    does; the consumer receives it, compares its bytes, enqueues the same
    sampled check kernel (:func:`check_frame`, same grid) on its own
    zero-filled int32 array of the frame's length, compared with 0 (a real
    check that must count no mismatch), and sends the RELEASE-sized reply.
    No data are shared: each process reads and writes only its own memory, so
    the difference to cupy_ipcpool is the cost of sharing the frame (the
    mapping, the interprocess ordering, the channel's bookkeeping), not of the
    kernels or of the socket.  Neither side waits for the GPU per frame; the
    counter is read at the end of each timed phase, as in every lane.
    """

    name = "socket_gpu_floor"
    title = "floor: Unix-socket round trip + the same kernels"
    sync_note = (
        "none per frame: the IPC-free floor of two processes each launching one kernel per "
        "frame plus one socket round trip. The producer enqueues the fill of its own array "
        "and sends; the consumer enqueues the same sampled check on its own zero-filled "
        "array (value 0: it must count no mismatch) and answers without waiting. No data "
        "are shared (each process uses its own memory). Each side synchronises once at "
        "the end of each timed phase."
    )

    def available(self) -> str | None:
        return None if _has_module("cupy") else "cupy is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _SocketGpuFloorProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _SocketGpuFloorConsumer(link, cfg, nbytes)


def _own_int32(cfg: BenchConfig, nelem: int, *, zeroed: bool) -> tuple[GpuWork, Any]:
    """A :class:`GpuWork` on ``cfg.device`` and an int32 array of ``nelem`` made on its stream."""
    cp = _cupy_or_skip()
    work = GpuWork(cp, cfg.device)
    with work.stream:
        arr = cp.zeros(nelem, dtype=cp.int32) if zeroed else cp.empty(nelem, dtype=cp.int32)
    work.stream.synchronize()
    return work, arr


class _SocketGpuFloorProducer(_SocketFloorProducer):
    # Per frame: enqueue the fill of our own array, send the floor message. No host wait.
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        self.nelem = _check_frame_size(nbytes)
        self.work, self.arr = self.open_gpu(cfg, self.nelem)
        super().__init__(links, cfg)

    def open_gpu(self, cfg: BenchConfig, nelem: int) -> tuple[Any, Any]:
        """The work and the producer's own array (overridden by the CPU tests)."""
        return _own_int32(cfg, nelem, zeroed=False)

    def send(self, value: int) -> None:
        self.work.fill(self.arr, value)
        super().send(value)

    def flush_checks(self) -> int:
        # Waits for the fills: a timed phase ends with this side's GPU work done.
        return int(self.work.flush())

    def close(self) -> None:
        try:
            self.work.stream.synchronize()
        finally:
            super().close()
            self.arr = None


class _SocketGpuFloorConsumer(_SocketFloorConsumer):
    # Per frame: receive, enqueue the sampled check of our own zeros, reply. No host wait.
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        self.nelem = _check_frame_size(nbytes)
        self.work, self.local = self.open_gpu(cfg, self.nelem)
        super().__init__(link, cfg)

    def open_gpu(self, cfg: BenchConfig, nelem: int) -> tuple[Any, Any]:
        """The work and the consumer's own zero-filled array (overridden by the CPU tests)."""
        return _own_int32(cfg, nelem, zeroed=True)

    def step(self, *, full: bool) -> tuple[int, bool]:
        value, ok = self.receive()
        checked = check_frame(self.work, self.local, 0, self.nelem, full=full)
        self.reply()
        return value, ok and checked

    def flush_checks(self) -> int:
        return int(self.work.flush())

    def close(self) -> None:
        try:
            self.work.stream.synchronize()
        finally:
            super().close()
            self.local = None


class OrderedFloorLane(SocketGpuFloorLane):
    """socket_gpu_floor plus the channel's GPU ordering between the processes, nothing else.

    The channel must order the consumer's work after the producer's (the
    consumer must not read a frame before it is written) and the producer's
    next write of a slot after the consumer's work on it.  This lane adds
    exactly that to :class:`SocketGpuFloorLane`, through the channel's own
    :class:`~cupy_ipcpool.channel._syncpage.SyncPage` shared as the channel
    shares it, over a ring of ``cfg.num_slots`` slots (cupy_ipcpool's): the producer's
    stream waits on the read flags of the slot's previous use (unless the
    host sees them set) before its fill and writes the frame flag after it;
    the consumer's stream waits on the frame flag before its check and writes
    its read flag after it.  No slot table, lease book, tokens or payload: it
    measures what a channel with no per-frame bookkeeping at all would, so
    cupy_ipcpool's distance to it is the library's own per-frame cost
    (docs/performance.md, section 9).  Each process still uses its own memory.
    """

    name = "ordered_floor"
    title = "floor + the channel's GPU ordering (four flag operations)"
    sync_note = (
        "the channel's ordering, on the GPU only: a sync page of flags in shared host memory; "
        "the producer's stream waits on the consumers' read flags of the slot's previous use "
        "(the ring of cupy_ipcpool's lane; skipped when the host sees them set) before its "
        "fill and writes the frame flag after it; the consumer's stream waits on the frame "
        "flag before its check and writes its read flag after it. No host wait per frame."
    )

    def available(self) -> str | None:
        return None if _has_module("cupy") else "cupy is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _OrderedFloorProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _OrderedFloorConsumer(link, cfg, nbytes)


class _Flags(Protocol):
    """What the ordered floor uses of a sync page (a :class:`SyncPage`, or a CPU stand-in)."""

    @property
    def fd(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

    def frame_flag(self, slot: int) -> int: ...
    def read_flag(self, index: int, slot: int) -> int: ...
    def order(self, stream: int, addr: int, value: int) -> bool: ...
    def order_all(self, stream: int, addrs: Sequence[int], value: int) -> int: ...
    def write(self, stream: int, addr: int, value: int) -> None: ...
    def close(self) -> None: ...


def ring_position(frame: int, slots: int) -> tuple[int, int]:
    """The slot and generation of the ``frame``-th frame (from 0) on a ring of ``slots``.

    The channel's round-robin with one frame per slot in turn: what the ordered
    floor's sides (here and in ``scripts/timeline_hot_path.py``) write and wait for.
    """
    return frame % slots, frame // slots + 1


class _OrderedFloorProducer(_SocketGpuFloorProducer):
    # Per frame: order after the slot's last readers, fill, write the frame flag, send.
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        super().__init__(links, cfg, nbytes)
        self.frames = 0
        self.slots = cfg.num_slots
        try:
            self.flags = self.create_flags(cfg, len(self.socks))
            for row, s in enumerate(self.socks):
                head = _ORDERED_HEAD.pack(self.flags.nbytes, row, len(self.socks), self.slots)
                socket.send_fds(s, [head], [self.flags.fd])
        except BaseException:
            super().close()
            raise
        self.stream_ptr = self.stream_handle()

    def create_flags(self, cfg: BenchConfig, consumers: int) -> _Flags:
        """The sync page, one read-flag row per consumer (overridden by the CPU tests)."""
        from ..channel._syncpage import SyncPage

        return SyncPage.create(cfg.num_slots, consumers, cfg.device)

    def stream_handle(self) -> int:
        """The raw handle of the work's stream (overridden by the CPU tests)."""
        return int(self.work.stream.ptr)

    def send(self, value: int) -> None:
        slot, gen = ring_position(self.frames, self.slots)
        self.frames += 1
        flags = self.flags
        if gen > 1:  # the slot's previous frame was read by every consumer
            rows = range(len(self.socks))
            flags.order_all(self.stream_ptr, [flags.read_flag(r, slot) for r in rows], gen - 1)
        self.work.fill(self.arr, value)
        flags.write(self.stream_ptr, flags.frame_flag(slot), gen)
        _SocketFloorProducer.send(self, value)

    def close(self) -> None:
        try:
            super().close()  # synchronises the stream first: no wait left on the page
        finally:
            flags = getattr(self, "flags", None)
            if flags is not None:
                flags.close()
                self.flags = None  # type: ignore[assignment]


class _OrderedFloorConsumer(_SocketGpuFloorConsumer):
    # Per frame: receive, order after the frame flag, check, write the read flag, reply.
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        super().__init__(link, cfg, nbytes)
        self.frames = 0
        try:
            head, fds, _flags, _addr = socket.recv_fds(self.sock, _ORDERED_HEAD.size, 1)
            if len(head) != _ORDERED_HEAD.size or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise RuntimeError("the ordered floor's producer sent no sync page")
            nbytes_page, self.row, consumers, self.slots = _ORDERED_HEAD.unpack(head)
            try:
                self.flags = self.import_flags(fds[0], nbytes_page, self.slots, consumers, cfg)
            finally:
                os.close(fds[0])
        except BaseException:
            super().close()
            raise
        self.stream_ptr = self.stream_handle()

    def import_flags(
        self, fd: int, nbytes: int, slots: int, consumers: int, cfg: BenchConfig
    ) -> _Flags:
        """Map the producer's sync page (overridden by the CPU tests)."""
        from ..channel._syncpage import SyncPage

        return SyncPage.import_fd(fd, nbytes, slots, consumers, cfg.device)

    def stream_handle(self) -> int:
        """The raw handle of the work's stream (overridden by the CPU tests)."""
        return int(self.work.stream.ptr)

    def step(self, *, full: bool) -> tuple[int, bool]:
        value, ok = self.receive()
        slot, gen = ring_position(self.frames, self.slots)
        self.frames += 1
        flags = self.flags
        flags.order(self.stream_ptr, flags.frame_flag(slot), gen)
        checked = check_frame(self.work, self.local, 0, self.nelem, full=full)
        flags.write(self.stream_ptr, flags.read_flag(self.row, slot), gen)
        self.reply()
        return value, ok and checked

    def close(self) -> None:
        try:
            super().close()  # synchronises the stream first
        finally:
            flags = getattr(self, "flags", None)
            if flags is not None:
                flags.close()
                self.flags = None  # type: ignore[assignment]


class InProcessFloorLane(Lane):
    """The same fill kernel and the same check in one process: no IPC at all.

    Per frame the producer enqueues the fill and the sampled check on one
    stream and waits for neither; its round trip is the host cost of the GPU
    work every lane does, and its throughput phase ends with the same
    synchronisation and counter read as the consumers'.
    """

    name = "inprocess_floor"
    title = "floor: same kernels, one process"
    processes = 1
    sync_note = (
        "none per frame: the fill and the check share one stream; the counter is read "
        "(one synchronisation) at the end of each timed phase, as in every lane."
    )

    def available(self) -> str | None:
        return None if _has_module("cupy") else "cupy is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _InProcessSide(cfg, nbytes)


class _InProcessSide(ProducerSide):
    def __init__(self, cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        cp = _cupy_or_skip()
        self.nelem = _check_frame_size(nbytes)
        self.work = GpuWork(cp, cfg.device)
        with self.work.stream:
            self.arr = cp.empty(self.nelem, dtype=cp.int32)

    def send(self, value: int) -> None:
        self.work.fill(self.arr, value)

    def wait_done(self, value: int, *, full: bool) -> None:
        if not check_frame(self.work, self.arr, value, self.nelem, full=full):
            self.failures.append(f"value {value}: data does not hold it")

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.work.stream.synchronize()
        del self.arr


# ============================================================ scale: attach
class AttachScanLane(Lane):
    """Attach cost against slot count: ``cip.attach(desc)`` + ``close()`` in the consumer.

    ``cfg.extra``: ``slot_counts`` (tuple of int), ``slot_nbytes``, ``attach_iters``.
    The consumer returns ``{str(slots): [ns, ...]}``.
    """

    name = "attach_scan"
    title = "cupy_ipcpool attach + close"

    def available(self) -> str | None:
        return CupyIpcPoolLane().available() if _has_module("cupy") else "cupy is not installed"

    def producer(self, links: Sequence[Connection], cfg: BenchConfig) -> dict[str, Any]:
        import cupy_ipcpool as cip

        link = links[0]
        for slots in cfg.extra["slot_counts"]:
            pool = cip.IpcPool(slots, cfg.extra["slot_nbytes"], device=cfg.device)
            try:
                link.send_bytes(b"desc" + pool.descriptor(transport="auto").to_bytes())
                expect(link, b"attached", 600.0)
            finally:
                pool.close()
        return {}

    def consumer(self, link: Connection, cfg: BenchConfig) -> dict[str, Any]:
        import cupy_ipcpool as cip

        out: dict[str, Any] = {}
        for slots in cfg.extra["slot_counts"]:
            desc = cip.PoolDescriptor.from_bytes(expect(link, b"desc", 600.0)[4:])
            peer = cip.attach(desc)  # warm-up (and a check that the pool is what was sent)
            ok = peer.num_slots == slots
            peer.close()
            if not ok:
                raise RuntimeError(f"attached {peer.num_slots} slots, expected {slots}")
            times = []
            for _ in range(cfg.extra["attach_iters"]):
                t0 = time.perf_counter_ns()
                peer = cip.attach(desc)
                peer.close()
                times.append(time.perf_counter_ns() - t0)
            out[str(slots)] = times
            link.send_bytes(b"attached")
        return out


#: The handoff lanes, in report order.
ALL_LANES: tuple[Lane, ...] = (
    CupyIpcPoolLane(),
    HostStagingLane(),
    LegacyIpcLane(),
    TorchQueueLane(),
    CudaCoreLane(),
    SocketFloorLane(),
    SocketGpuFloorLane(),
    OrderedFloorLane(),
    InProcessFloorLane(),
)

LANE_NAMES: tuple[str, ...] = tuple(lane.name for lane in ALL_LANES)


def get_lanes(names: Sequence[str] | None = None) -> list[Lane]:
    """The lanes called ``names`` (all when None), in report order.

    Raises
    ------
    ValueError
        An unknown lane name (the message lists the known ones).
    """
    if names is None:
        return list(ALL_LANES)
    unknown = [n for n in names if n not in LANE_NAMES]
    if unknown:
        raise ValueError(
            f"unknown lane(s) {', '.join(unknown)}; choose from {', '.join(LANE_NAMES)}"
        )
    return [lane for lane in ALL_LANES if lane.name in names]
