"""What the frameworks offer: a ``torch.multiprocessing`` queue, cuda.core's IPC buffers."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

from ..interface import (
    BenchConfig,
    ConsumerSide,
    Lane,
    LaneUnavailable,
    ProducerSide,
    expect,
    raw_socket,
    with_copy,
)
from ._common import (
    DONE,
    GpuWork,
    MiB,
    SocketDone,
    check_frame,
    check_frame_size,
    cupy_or_skip,
    cupy_view,
    external_stream,
    has_module,
)


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
        if not has_module("torch"):
            return "torch is not installed"
        return None if has_module("cupy") else "cupy is not installed (the common kernels)"

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
    cp = cupy_or_skip()
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
            check_frame_size(nbytes), dtype=self.torch.int32, device=f"cuda:{cfg.device}"
        )
        self.arr = cupy_view(self.work.cp, self.t.data_ptr(), nbytes, self.t, cfg.device)
        self.done = SocketDone(links, cfg.frame_timeout)

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
        self.nelem = check_frame_size(nbytes)
        self.device = cfg.device
        self.timeout = cfg.frame_timeout
        self.sock = raw_socket(link)
        self.sock.settimeout(cfg.frame_timeout)

    def step(self, *, full: bool) -> tuple[int, bool]:
        value, t = self.queue.get(timeout=self.timeout)
        torch = self.torch
        ok = bool(t.is_cuda and t.dtype == torch.int32 and t.numel() == self.nelem)
        if ok:
            a = cupy_view(self.work.cp, t.data_ptr(), self.nbytes, t, self.device)
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        del t  # torch synchronises its current stream as it frees the received storage
        # Needed for the producer's reuse of its tensor; finds nothing pending after torch's.
        self.work.stream.synchronize()
        self.sock.sendall(DONE)
        return int(value), ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.work.stream.synchronize()
        self.sock.close()


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
        if not has_module("cuda.core"):
            return "cuda-core is not installed"
        return None if has_module("cupy") else "cupy is not installed (the common kernels)"

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
        cp = cupy_or_skip()
        self.cp = cp
        self.link = links[0]
        self.timeout = cfg.frame_timeout
        check_frame_size(nbytes)
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
        self.arr = cupy_view(cp, int(self.buf.handle), nbytes, self.buf, cfg.device)

    def send(self, value: int) -> None:
        self.work.fill(self.arr, value)
        # Needed: the descriptor carries no event; the consumer may read at once.
        self.stream.sync()
        self.link.send((value, _ipc_descriptor(self.buf)))

    def wait_done(self, value: int, *, full: bool) -> None:
        expect(self.link, DONE, self.timeout)

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
        self.cp = cp = cupy_or_skip()
        self.link = link
        self.timeout = cfg.frame_timeout
        self.nbytes = nbytes
        self.nelem = check_frame_size(nbytes)
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
            a = cupy_view(self.cp, int(buf.handle), self.nbytes, buf, self.device)
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        finally:
            buf.close(self.stream)  # stream-ordered: after the check
        # Needed: the producer rewrites the same buffer once we answer.
        self.stream.sync()
        self.link.send_bytes(DONE)
        return int(value), ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.stream.sync()
        _close_quietly(self.mr)
