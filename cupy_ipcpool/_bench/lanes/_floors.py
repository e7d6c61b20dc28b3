"""The floors: what no handoff can beat (bare socket, with GPU work, ordered, in-process).

Each floor does what a lane must at least do, with nothing else: the bare
Unix-socket round trip the channel's messages take, the same round trip with
the fill and check kernels around it, the same again ordered by flags in a
shared sync page as the channel orders its frames, and the GPU work alone in
one process.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

from ..interface import BenchConfig, ConsumerSide, Lane, ProducerSide, expect
from ._common import VALUE, GpuWork, check_frame, check_frame_size, cupy_or_skip, has_module

#: What the ordered floor's producer sends with the page's fd: its size, the
#: consumer's row of read flags, how many rows there are, and the ring's slots.
_ORDERED_HEAD = struct.Struct("<QIII")


def wire_sizes() -> tuple[int, int]:
    """Bytes of cupy_ipcpool's FRAME message (one 1-D array, 8 metadata bytes) and RELEASE.

    Computed with the library's own encoders; ``(96, 16)`` if they are not there.
    """
    try:
        import numpy

        from ..._handles import ArrayHandle
        from ...channel import _payload, _protocol

        h = ArrayHandle(
            slot=0, generation=1, offset=0, shape=(1 << 24,), strides=(4,), dtype=numpy.dtype("i4")
        )
        payload = _payload.FRAME_HEAD.pack(0, 1, VALUE.size) + h.pack() + bytes(VALUE.size)
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
    body = bytes((value + i) & 0xFF for i in range(max(nbytes - VALUE.size, 0)))
    return VALUE.pack(value) + body


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
        if len(msg) < VALUE.size:
            raise EOFError("the producer closed the floor socket")
        (value,) = VALUE.unpack(msg[: VALUE.size])
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
        return None if has_module("cupy") else "cupy is not installed"

    def sides(self) -> tuple[type[_SocketGpuFloorProducer], type[_SocketGpuFloorConsumer]]:
        """The producer's and the consumer's side classes (OrderedFloorLane names its own)."""
        return _SocketGpuFloorProducer, _SocketGpuFloorConsumer

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return self.sides()[0](links, cfg, nbytes)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return self.sides()[1](link, cfg, nbytes)


def _own_int32(cfg: BenchConfig, nelem: int, *, zeroed: bool) -> tuple[GpuWork, Any]:
    """A :class:`GpuWork` on ``cfg.device`` and an int32 array of ``nelem`` made on its stream."""
    cp = cupy_or_skip()
    work = GpuWork(cp, cfg.device)
    with work.stream:
        arr = cp.zeros(nelem, dtype=cp.int32) if zeroed else cp.empty(nelem, dtype=cp.int32)
    work.stream.synchronize()
    return work, arr


def _close_gpu_side(side: Any, close_socket: Callable[[], None], array: str) -> None:
    """Close a GPU floor side: its stream synchronised, then its socket, its ``array`` dropped.

    The socket is closed and the array dropped even when the synchronisation fails.
    """
    try:
        side.work.stream.synchronize()
    finally:
        close_socket()
        setattr(side, array, None)


class _SocketGpuFloorProducer(_SocketFloorProducer):
    # Per frame: enqueue the fill of our own array, send the floor message. No host wait.
    def __init__(self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int) -> None:
        self.nelem = check_frame_size(nbytes)
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
        _close_gpu_side(self, super().close, "arr")


class _SocketGpuFloorConsumer(_SocketFloorConsumer):
    # Per frame: receive, enqueue the sampled check of our own zeros, reply. No host wait.
    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        self.nelem = check_frame_size(nbytes)
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
        _close_gpu_side(self, super().close, "local")


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
    (docs/performance.md, "The floors").  Each process still uses its own memory.
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

    def sides(self) -> tuple[type[_SocketGpuFloorProducer], type[_SocketGpuFloorConsumer]]:
        return _OrderedFloorProducer, _OrderedFloorConsumer


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


def _stream_handle(work: GpuWork) -> int:
    """The raw handle of ``work``'s stream, for the sync page's flag operations."""
    return int(work.stream.ptr)


def _close_flags(side: _OrderedFloorProducer | _OrderedFloorConsumer) -> None:
    """Close an ordered floor side's sync page, once (after its stream is synchronised)."""
    flags = getattr(side, "flags", None)
    if flags is not None:
        flags.close()
        side.flags = None  # type: ignore[assignment]


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
        from ...channel._syncpage import SyncPage

        return SyncPage.create(cfg.num_slots, consumers, cfg.device)

    def stream_handle(self) -> int:
        """The raw handle of the work's stream (overridden by the CPU tests)."""
        return _stream_handle(self.work)

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
            _close_flags(self)


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
        from ...channel._syncpage import SyncPage

        return SyncPage.import_fd(fd, slots, consumers, cfg.device)

    def stream_handle(self) -> int:
        """The raw handle of the work's stream (overridden by the CPU tests)."""
        return _stream_handle(self.work)

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
            _close_flags(self)


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
        return None if has_module("cupy") else "cupy is not installed"

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _InProcessSide(cfg, nbytes)


class _InProcessSide(ProducerSide):
    def __init__(self, cfg: BenchConfig, nbytes: int) -> None:
        super().__init__()
        cp = cupy_or_skip()
        self.nelem = check_frame_size(nbytes)
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
