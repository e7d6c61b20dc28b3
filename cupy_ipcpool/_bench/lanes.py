"""The lanes of the comparative benchmark: ways of handing a GPU frame to another process.

Every lane writes each frame on the GPU with a trivial kernel (fill with the
frame's value), hands it over, and the consumer verifies it before it signals
done: a spot check of the first and last elements on most frames, a full
comparison (one reduction kernel) on the warm-up and check frames.

Lanes import CuPy, torch, cuda.core and the channel layer of cupy_ipcpool only
inside the spawned processes, so this module imports on machines without them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import mmap
import os
import socket
import struct
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

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
_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ------------------------------------------------------------ verification
def count_mismatches(a: Any, value: int) -> int:
    """Number of elements of the CuPy array ``a`` that differ from ``value``."""
    import cupy

    return int(cupy.count_nonzero(a != value))


def check_array(a: Any, value: int, nelem: int, *, full: bool) -> bool:
    """Whether CuPy array ``a`` has ``nelem`` int32 elements, all equal to ``value``.

    The spot check reads the first and the last element (one small copy and a
    synchronise on the current stream); ``full`` compares every element.
    """
    if a.size != nelem or a.dtype.itemsize != 4 or a.dtype.kind != "i":
        return False
    if full:
        return count_mismatches(a, value) == 0
    ends = a[:: max(nelem - 1, 1)].get()
    return bool((ends == value).all())


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
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        import cupy

        import cupy_ipcpool as cip

        self.cp = cupy
        self.nelem = _check_frame_size(nbytes)
        self.timeout = cfg.frame_timeout
        self.nsubs = len(links)
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
        with self.pub.frame(timeout=self.timeout) as frame:
            a = frame.array((self.nelem,), self.cp.int32)
            a.fill(value)
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
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        import cupy_ipcpool as cip

        self.nelem = _check_frame_size(nbytes)
        self.timeout = cfg.frame_timeout
        address = expect(link, b"listening ", self.timeout)[len(b"listening ") :].decode()
        self.sub = cip.subscribe(address, mode="block")
        link.send_bytes(b"subscribed")

    def step(self, *, full: bool) -> tuple[int, bool]:
        f = self.sub.recv(timeout=self.timeout)
        try:
            (value,) = _VALUE.unpack(bytes(f.metadata)[: _VALUE.size])
            a = f.arrays[0]
            ok = check_array(a, value, self.nelem, full=full)
            del a
        finally:
            f.release()
        return value, ok

    def close(self) -> None:
        self.sub.close()


# ====================================================== 2. host staging
class HostStagingLane(Lane):
    """Device -> pinned shared memory -> device: the best version of the naive way.

    The producer copies the frame into a ``memfd`` mapping registered as pinned
    memory (``cudaHostRegister``), synchronises and sends the value (8 bytes)
    over the socket; the consumer, with its own pinned registration of the
    same pages, copies it into its device buffer, verifies, answers one byte.
    """

    name = "host_staging"
    title = "host staging (pinned shared memory)"

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
        stream = self.cp.cuda.get_current_stream()
        self.dev.fill(value)
        self.cp.cuda.runtime.memcpyAsync(
            self.host.ptr, self.dev.data.ptr, self.nbytes, _D2H, stream.ptr
        )
        stream.synchronize()
        self.sock.sendall(_VALUE.pack(value))

    def wait_done(self, value: int, *, full: bool) -> None:
        self.done.wait()

    def close(self) -> None:
        self.done.close()
        self.host.close()
        del self.dev


class _StagingConsumer(ConsumerSide):
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        cp = _cupy_or_skip()
        self.cp = cp
        self.nbytes = nbytes
        self.nelem = _check_frame_size(nbytes)
        self.dev = cp.empty(self.nelem, dtype=cp.int32)
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
        stream = self.cp.cuda.get_current_stream()
        self.cp.cuda.runtime.memcpyAsync(
            self.dev.data.ptr, self.host.ptr, self.nbytes, _H2D, stream.ptr
        )
        ok = check_array(self.dev, value, self.nelem, full=full)
        self.sock.sendall(_DONE)
        return value, ok

    def close(self) -> None:
        self.sock.close()
        self.host.close()
        del self.dev


# ================================================ 3. legacy CUDA IPC per frame
class LegacyIpcLane(Lane):
    """``cudaIpcGetMemHandle`` per frame; the consumer opens, uses and closes it per frame."""

    name = "legacy_ipc"
    title = "legacy CUDA IPC, per message"

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
        self.ptr = cp.cuda.runtime.malloc(nbytes)  # a plain cudaMalloc: IPC-exportable
        self.arr = _cupy_view(cp, self.ptr, nbytes, self, cfg.device)
        self.done = _SocketDone(links, cfg.frame_timeout)
        self.sock = self.done.socks[0]

    def send(self, value: int) -> None:
        self.arr.fill(value)
        self.cp.cuda.get_current_stream().synchronize()
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
        self.sock = raw_socket(link)
        self.sock.settimeout(cfg.frame_timeout)

    def step(self, *, full: bool) -> tuple[int, bool]:
        msg = recv_exact(self.sock, self.HANDLE_BYTES + _VALUE.size)
        (value,) = _VALUE.unpack(msg[self.HANDLE_BYTES :])
        rt = self.cp.cuda.runtime
        ptr = rt.ipcOpenMemHandle(msg[: self.HANDLE_BYTES])
        try:
            a = _cupy_view(self.cp, ptr, self.nbytes, None, self.device)
            ok = check_array(a, value, self.nelem, full=full)
            del a
        finally:
            rt.ipcCloseMemHandle(ptr)
        self.sock.sendall(_DONE)
        return value, ok

    def close(self) -> None:
        self.sock.close()


# ================================================ 4. torch.multiprocessing
class TorchQueueLane(Lane):
    """A ``torch.multiprocessing`` queue carrying a CUDA tensor per frame.

    torch shares the storage with CUDA IPC and an interprocess event that the
    consumer's stream waits on; the producer reuses one tensor (the consumer
    drops each frame before it signals done).
    """

    name = "torch_mp"
    title = "torch.multiprocessing queue"
    queue: Any = None

    def available(self) -> str | None:
        return None if _has_module("torch") else "torch is not installed"

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


def check_tensor(t: Any, value: int, nelem: int, *, full: bool) -> bool:
    """Like :func:`check_array` for a torch tensor."""
    import torch

    if t.numel() != nelem or t.dtype != torch.int32 or not t.is_cuda:
        return False
    if full:
        return int((t != value).sum().item()) == 0
    ends = t[:: max(nelem - 1, 1)].cpu()
    return bool((ends == value).all().item())


class _TorchProducer(ProducerSide):
    def __init__(
        self, queue: Any, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> None:
        super().__init__()
        self.torch = _torch_or_skip(cfg.device)
        self.queue = queue
        self.t = self.torch.empty(
            _check_frame_size(nbytes), dtype=self.torch.int32, device=f"cuda:{cfg.device}"
        )
        self.done = _SocketDone(links, cfg.frame_timeout)

    def send(self, value: int) -> None:
        self.t.fill_(value)
        self.queue.put((value, self.t))

    def wait_done(self, value: int, *, full: bool) -> None:
        self.done.wait()

    def close(self) -> None:
        self.done.close()
        self.torch.cuda.synchronize()
        del self.t


class _TorchConsumer(ConsumerSide):
    def __init__(self, queue: Any, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        self.torch = _torch_or_skip(cfg.device)
        self.queue = queue
        self.nelem = _check_frame_size(nbytes)
        self.timeout = cfg.frame_timeout
        self.sock = raw_socket(link)
        self.sock.settimeout(cfg.frame_timeout)

    def step(self, *, full: bool) -> tuple[int, bool]:
        value, t = self.queue.get(timeout=self.timeout)
        ok = check_tensor(t, value, self.nelem, full=full)
        del t
        self.sock.sendall(_DONE)
        return int(value), ok

    def close(self) -> None:
        self.sock.close()


# ======================================================== 5. cuda.core IPC
def _cuda_core() -> Any:
    """The cuda.core namespace with the IPC memory-resource API, or LaneUnavailable."""
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
    need = {
        "": ("Device", "DeviceMemoryResource", "DeviceMemoryResourceOptions", "Buffer"),
        "DeviceMemoryResource": ("get_allocation_handle", "from_allocation_handle"),
        "Buffer": ("from_ipc_descriptor",),
    }
    missing = []
    for owner, names in need.items():
        obj = getattr(cc, owner) if owner else cc
        missing += [f"{owner}.{n}" if owner else n for n in names if not hasattr(obj, n)]
    if not hasattr(cc.Buffer, "get_ipc_descriptor") and not hasattr(cc.Buffer, "ipc_descriptor"):
        missing.append("Buffer.get_ipc_descriptor")
    if missing:
        version = getattr(importlib.import_module("cuda.core"), "__version__", "?")
        raise LaneUnavailable(
            f"cuda.core {version} lacks the IPC memory-resource API ({', '.join(missing)})"
        )
    return cc


def _ipc_descriptor(buf: Any) -> Any:
    getter = getattr(buf, "get_ipc_descriptor", None)
    return getter() if callable(getter) else buf.ipc_descriptor


class CudaCoreLane(Lane):
    """cuda.core IPC-enabled memory pool; a buffer descriptor sent per frame.

    The producer maps its pool into the consumer once (``get_allocation_handle``
    / ``from_allocation_handle``), keeps one buffer, and sends its IPC descriptor
    with each frame; the consumer imports it (``Buffer.from_ipc_descriptor``),
    verifies and closes it per frame.
    """

    name = "cuda_core"
    title = "cuda.core IPC buffers"

    def available(self) -> str | None:
        return None if _has_module("cuda.core") else "cuda-core is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _CoreProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _CoreConsumer(link, cfg, nbytes)


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
        opts = cc.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * nbytes + 64 * MiB)
        self.mr = cc.DeviceMemoryResource(dev, options=opts)
        if not getattr(self.mr, "is_ipc_enabled", True):
            raise LaneUnavailable("cuda.core made a memory resource that is not IPC-enabled")
        self.alloc_handle = self.mr.get_allocation_handle()
        self.link.send_bytes(b"mr")
        send_handle(self.link, int(getattr(self.alloc_handle, "handle", self.alloc_handle)), 0)
        self.buf = self.mr.allocate(nbytes, stream=self.stream)
        self.stream.sync()
        self.arr = _cupy_view(cp, int(self.buf.handle), nbytes, self.buf, cfg.device)

    def send(self, value: int) -> None:
        self.arr.fill(value)
        self.cp.cuda.get_current_stream().synchronize()
        self.link.send((value, _ipc_descriptor(self.buf)))

    def wait_done(self, value: int, *, full: bool) -> None:
        expect(self.link, _DONE, self.timeout)

    def close(self) -> None:
        del self.arr
        self.cp.cuda.runtime.deviceSynchronize()
        self.buf.close(self.stream)
        self.stream.sync()
        for obj in (self.alloc_handle, self.mr):
            close = getattr(obj, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()


class _CoreConsumer(ConsumerSide):
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        self.cc = cc = _cuda_core()
        self.cp = _cupy_or_skip()
        self.link = link
        self.timeout = cfg.frame_timeout
        self.nbytes = nbytes
        self.nelem = _check_frame_size(nbytes)
        self.device = cfg.device
        dev = cc.Device(cfg.device)
        dev.set_current()
        self.stream = dev.create_stream()
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
            ok = check_array(a, value, self.nelem, full=full)
            del a
        finally:
            buf.close(self.stream)
        self.link.send_bytes(_DONE)
        return int(value), ok

    def close(self) -> None:
        self.stream.sync()
        close = getattr(self.mr, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()


# ============================================================= 6. the floors
def wire_sizes() -> tuple[int, int]:
    """Bytes of cupy_ipcpool's FRAME message (one 1-D array, 8 metadata bytes) and RELEASE.

    Computed with the library's own encoders; ``(96, 16)`` if they are not there.
    """
    try:
        import numpy

        from .. import _channel, _protocol
        from .._handles import ArrayHandle

        h = ArrayHandle(
            slot=0, generation=1, offset=0, shape=(1 << 24,), strides=(4,), dtype=numpy.dtype("i4")
        )
        payload = _channel._FRAME_HEAD.pack(0, 1, _VALUE.size) + h.pack() + bytes(_VALUE.size)
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
    def __init__(self, link: Connection, cfg: BenchConfig) -> None:
        self.msg_bytes, self.reply_bytes = wire_sizes()
        path = expect(link, b"listening ", cfg.frame_timeout)[len(b"listening ") :].decode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(cfg.frame_timeout)
        self.sock.connect(path)
        self.reply = bytes(self.reply_bytes)

    def step(self, *, full: bool) -> tuple[int, bool]:
        msg = self.sock.recv(self.msg_bytes + 1)
        if len(msg) < _VALUE.size:
            raise EOFError("the producer closed the floor socket")
        (value,) = _VALUE.unpack(msg[: _VALUE.size])
        ok = msg == _floor_message(value, self.msg_bytes)
        self.sock.send(self.reply)
        return value, ok

    def close(self) -> None:
        self.sock.close()


class InProcessFloorLane(Lane):
    """The same fill kernel and verification in one process: no IPC at all."""

    name = "inprocess_floor"
    title = "floor: same kernels, one process"
    processes = 1

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
        self.arr = cp.empty(self.nelem, dtype=cp.int32)

    def send(self, value: int) -> None:
        self.arr.fill(value)

    def wait_done(self, value: int, *, full: bool) -> None:
        if not check_array(self.arr, value, self.nelem, full=full):
            self.failures.append(f"value {value}: data does not hold it")

    def close(self) -> None:
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
