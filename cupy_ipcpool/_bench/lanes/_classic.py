"""The classic ways: host staging through pinned shared memory, legacy CUDA IPC per frame."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

from ..interface import (
    BenchConfig,
    ConsumerSide,
    Lane,
    ProducerSide,
    expect,
    raw_socket,
    recv_exact,
)
from ._common import (
    DONE,
    VALUE,
    GpuWork,
    SocketDone,
    check_frame,
    check_frame_size,
    cupy_or_skip,
    cupy_view,
    has_module,
)

_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


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
        return None if has_module("cupy") else "cupy is not installed"

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
        cp = cupy_or_skip()
        self.cp = cp
        self.nbytes = nbytes
        self.work = GpuWork(cp, cfg.device)
        self.dev = cp.empty(check_frame_size(nbytes), dtype=cp.int32)
        fd = os.memfd_create("cipbench-staging")
        try:
            os.ftruncate(fd, nbytes)
            self.host = _PinnedMapping(cp, fd, nbytes)
            links[0].send_bytes(b"staging")
            send_handle(links[0], fd, 0)
        finally:
            os.close(fd)
        self.done = SocketDone(links, cfg.frame_timeout)
        self.sock = self.done.socks[0]

    def send(self, value: int) -> None:
        stream = self.work.stream
        self.work.fill(self.dev, value)
        self.cp.cuda.runtime.memcpyAsync(
            self.host.ptr, self.dev.data.ptr, self.nbytes, _D2H, stream.ptr
        )
        # Needed: the consumer reads the host buffer as soon as it has the value.
        stream.synchronize()
        self.sock.sendall(VALUE.pack(value))

    def wait_done(self, value: int, *, full: bool) -> None:
        self.done.wait()

    def close(self) -> None:
        self.done.close()
        self.work.stream.synchronize()
        self.host.close()
        del self.dev


class _StagingConsumer(ConsumerSide):
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        cp = cupy_or_skip()
        self.cp = cp
        self.nbytes = nbytes
        self.nelem = check_frame_size(nbytes)
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
        (value,) = VALUE.unpack(recv_exact(self.sock, VALUE.size))
        stream = self.work.stream
        self.cp.cuda.runtime.memcpyAsync(
            self.dev.data.ptr, self.host.ptr, self.nbytes, _H2D, stream.ptr
        )
        self.copied.record(stream)
        ok = check_frame(self.work, self.dev, value, self.nelem, full=full)
        # Needed: the producer overwrites the shared host buffer once we answer, so the
        # H2D copy (not the check, which reads our own device buffer) must be complete.
        self.copied.synchronize()
        self.sock.sendall(DONE)
        return value, ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.sock.close()
        self.work.stream.synchronize()
        self.host.close()
        del self.dev


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
        return None if has_module("cupy") else "cupy is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _LegacyProducer(links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return _LegacyConsumer(link, cfg, nbytes)


class _LegacyProducer(ProducerSide):
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        cp = cupy_or_skip()
        self.cp = cp
        check_frame_size(nbytes)
        self.work = GpuWork(cp, cfg.device)
        self.ptr = cp.cuda.runtime.malloc(nbytes)  # a plain cudaMalloc: IPC-exportable
        self.arr = cupy_view(cp, self.ptr, nbytes, self, cfg.device)
        self.done = SocketDone(links, cfg.frame_timeout)
        self.sock = self.done.socks[0]

    def send(self, value: int) -> None:
        self.work.fill(self.arr, value)
        # Needed: nothing orders the consumer's kernels after this fill but the host.
        self.work.stream.synchronize()
        handle = bytes(self.cp.cuda.runtime.ipcGetMemHandle(self.ptr))
        self.sock.sendall(handle + VALUE.pack(value))

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
        self.cp = cupy_or_skip()
        self.nbytes = nbytes
        self.nelem = check_frame_size(nbytes)
        self.device = cfg.device
        self.work = GpuWork(self.cp, cfg.device)
        self.sock = raw_socket(link)
        self.sock.settimeout(cfg.frame_timeout)

    def step(self, *, full: bool) -> tuple[int, bool]:
        msg = recv_exact(self.sock, self.HANDLE_BYTES + VALUE.size)
        (value,) = VALUE.unpack(msg[self.HANDLE_BYTES :])
        rt = self.cp.cuda.runtime
        ptr = rt.ipcOpenMemHandle(msg[: self.HANDLE_BYTES])
        try:
            a = cupy_view(self.cp, ptr, self.nbytes, None, self.device)
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        finally:
            # Needed: the check kernel may still read the mapping; close only after it.
            self.work.stream.synchronize()
            rt.ipcCloseMemHandle(ptr)
        self.sock.sendall(DONE)
        return value, ok

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.work.stream.synchronize()
        self.sock.close()
