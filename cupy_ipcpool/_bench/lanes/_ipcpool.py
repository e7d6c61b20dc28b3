"""cupy_ipcpool's own lanes: publish/subscribe over a ring of slots (block mode and frames
handed out ahead), and the attach scan."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from ..interface import BenchConfig, ConsumerSide, Lane, ProducerSide, expect
from ._common import VALUE, GpuWork, check_frame, check_frame_size, has_module


class _CipProducer(ProducerSide):
    # Per frame: acquire a slot (its stream waits on the subscribers' read flags
    # of the slot's previous frame), fill it, publish (writes the frame flag).
    # No host synchronisation: the sync page's flags order both directions.
    def __init__(
        self,
        links: Sequence[Connection],
        cfg: BenchConfig,
        nbytes: int,
        *,
        ahead: bool = False,
        spin_us: float = 0.0,
    ) -> None:
        super().__init__()
        import cupy

        import cupy_ipcpool as cip

        self.cp = cupy
        self.nelem = check_frame_size(nbytes)
        self.timeout = cfg.frame_timeout
        self.nsubs = len(links)
        self.work = GpuWork(cupy, cfg.device)
        address = os.path.join(cfg.workdir, f"cip-{nbytes}.sock")
        self.pool = cip.IpcPool(cfg.num_slots, nbytes, device=cfg.device)
        self.pub: Any = None
        self.slot = 0  # the last frame's
        try:
            self.pub = cip.Publisher(self.pool, address, ahead=ahead, spin_us=spin_us)
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
            frame.publish(a, metadata=VALUE.pack(value))
            del a  # the slot is free again once the subscribers release it
        self.slot = frame.slot

    def wait_done(self, value: int, *, full: bool) -> None:
        deadline = time.monotonic() + self.timeout
        returned = 0
        while returned < self.nsubs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                held = self.pub.leases(self.slot)
                raise TimeoutError(
                    f"frame {value}: {returned} of {self.nsubs} leases returned "
                    f"within {self.timeout} s; slot {self.slot} has {held} lease(s) left"
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
    mode = "block"
    subscribe_options: dict[str, Any] = {}

    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        import cupy

        import cupy_ipcpool as cip

        self.nelem = check_frame_size(nbytes)
        self.timeout = cfg.frame_timeout
        self.work = GpuWork(cupy, cfg.device)
        address = expect(link, b"listening ", self.timeout)[len(b"listening ") :].decode()
        self.sub = cip.subscribe(address, mode=self.mode, **self.subscribe_options)
        link.send_bytes(b"subscribed")

    def step(self, *, full: bool) -> tuple[int, bool]:
        stream = self.work.stream
        f = self.sub.recv(timeout=self.timeout, stream=stream)
        try:
            value, agrees = self.frame_value(f)
            if not agrees:
                return value, False
            a = f.arrays[0]
            ok = check_frame(self.work, a, value, self.nelem, full=full)
            del a
        finally:
            f.release(stream=stream)
        return value, ok

    def frame_value(self, f: Any) -> tuple[int, bool]:
        """The value frame ``f`` must hold (its metadata's), and whether it is the one expected.

        ``(value, False)``: ``value`` is not what was expected; the frame is not checked.
        """
        (value,) = VALUE.unpack(bytes(f.metadata)[: VALUE.size])
        return value, True

    def flush_checks(self) -> int:
        return self.work.flush()

    def close(self) -> None:
        self.work.stream.synchronize()
        self.sub.close()


class _CipAheadConsumer(_CipConsumer):
    # Per frame: recv (handed out ahead once the slot's previous frame came by message: no
    # wait for the FRAME message), enqueue the check, release (the read flag now, the RELEASE
    # once the message is here). The producer's values are consecutive within a size, so a
    # frame's value is the first frame's plus its sequence number; the first frame always
    # comes by message (nothing predicts it), and each confirmed frame's metadata must agree.
    mode = "ahead"
    # One frame ahead at most: the harness's producer waits for each latency frame's lease
    # before it writes the next, while the consumer waits for its checks (flush_checks) at
    # the end of a phase.  The lease ends at the read flag (Publisher(ahead=True)), but a
    # producer without spin_us looks at the flags only between growing steps of its wait
    # (20 us to 16 ms) when no message wakes it; deeper, the consumer would queue waits on the
    # GPU for frames the producer has not written and send its RELEASEs later, and the
    # round trip would measure those steps (docs/protocol.md, "Frames handed out ahead").
    subscribe_options: dict[str, Any] = {"depth": 1}

    def __init__(self, link: Connection, cfg: BenchConfig, nbytes: int) -> None:
        super().__init__(link, cfg, nbytes)
        self.base: int | None = None
        self.mismatched: list[str] = []
        self.unconfirmed: list[tuple[Any, int]] = []  # handed out ahead, metadata still due

    def frame_value(self, f: Any) -> tuple[int, bool]:
        if f.confirmed:
            (value,) = VALUE.unpack(bytes(f.metadata)[: VALUE.size])
            if self.base is None:
                self.base = value - f.seq
        elif self.base is None:
            raise RuntimeError(f"frame {f.seq} handed out ahead before any came by message")
        expected = self.base + f.seq
        if f.confirmed and value != expected:
            return value, False
        if not f.confirmed:
            self.unconfirmed.append((f, expected))
        self._settle_confirmations()
        return expected, True

    def _settle_confirmations(self) -> None:
        """The metadata of frames handed out ahead and confirmed since: it must agree."""
        while self.unconfirmed and self.unconfirmed[0][0].confirmed:
            f, expected = self.unconfirmed.pop(0)
            (value,) = VALUE.unpack(bytes(f.metadata)[: VALUE.size])
            if value != expected:
                self.mismatched.append(f"frame {f.seq}: handed out as {expected}, sent {value}")

    def flush_checks(self) -> int:
        mismatches = self.work.flush()
        self._settle_confirmations()
        if self.mismatched:
            raise RuntimeError("; ".join(self.mismatched[:5]))
        return mismatches

    def close(self) -> None:
        self.unconfirmed.clear()  # frames never confirmed: the size ended with them
        super().close()


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
        if not has_module("cupy"):
            return "cupy is not installed"
        try:
            import cupy_ipcpool as cip
        except ImportError as exc:
            return f"cupy_ipcpool is not importable: {exc}"
        missing = [n for n in ("IpcPool", "Publisher", "subscribe") if not hasattr(cip, n)]
        if missing:
            return f"cupy_ipcpool has no {', '.join(missing)} (publish/subscribe layer not built)"
        return None

    #: The publisher's options (``Publisher(**publisher_options)``) and the consumer side.
    publisher_options: dict[str, Any] = {}
    consumer_side: type[_CipConsumer] = _CipConsumer

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        return _CipProducer(links, cfg, nbytes, **self.publisher_options)

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        return self.consumer_side(link, cfg, nbytes)


class CupyIpcPoolAheadLane(CupyIpcPoolLane):
    """The channel with frames handed out ahead of their messages (``mode="ahead"``)."""

    name = "cupy_ipcpool_ahead"
    title = "cupy_ipcpool, frames handed out ahead"
    sync_note = (
        "none per frame, and the consumer's host does not wait for the FRAME message: the "
        "publisher keeps a fixed slot schedule (ahead=True), so recv() hands frame k+n out "
        "once frame k of the same slot came by message, its stream waiting on the GPU for the "
        "frame flag of the next generation; the message confirms it later (its metadata). "
        "release() sends the RELEASE at once, often before the frame is published. "
        "depth=1: one frame ahead of its message at most. The value checked is the "
        "first frame's (by message) plus the sequence number, and the metadata once confirmed."
    )
    publisher_options: dict[str, Any] = {"ahead": True}
    consumer_side = _CipAheadConsumer


#: The ``spin_us`` of :class:`CupyIpcPoolAheadSpinLane`'s publisher.
PRODUCER_SPIN_US = 200.0


class CupyIpcPoolAheadSpinLane(CupyIpcPoolAheadLane):
    """Frames handed out ahead, the producer's host busy-polling for its leases (``spin_us``)."""

    name = "cupy_ipcpool_ahead_spin"
    title = "cupy_ipcpool, frames handed out ahead, producer spin_us=200"
    sync_note = (
        "as cupy_ipcpool_ahead, and the producer's wait for each latency frame's lease "
        "busy-polls for up to 200 us (Publisher(spin_us=200)) its sockets and the "
        "subscribers' read flags: with ahead=True a lease ends at the read flag, which the "
        "consumer's stream writes after its check; a frame released before it was published "
        "is free as it is published."
    )
    publisher_options: dict[str, Any] = {"ahead": True, "spin_us": PRODUCER_SPIN_US}


class AttachScanLane(Lane):
    """Attach cost against slot count: ``cip.attach(desc)`` + ``close()`` in the consumer.

    ``cfg.extra``: ``slot_counts`` (tuple of int), ``slot_nbytes``, ``attach_iters``.
    The consumer returns ``{str(slots): [ns, ...]}``.
    """

    name = "attach_scan"
    title = "cupy_ipcpool attach + close"

    def available(self) -> str | None:
        return CupyIpcPoolLane().available() if has_module("cupy") else "cupy is not installed"

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
