"""A relay: receive a remote stream once, republish it to local subscribers zero-copy.

The relay is one remote subscriber whose receive ring *is* a local channel's
ring: a frame arrives (UCX writes it into a slot of the local pool), then the
relay publishes that same slot to the local subscribers.  One network
transfer per node, whatever the number of local readers.  The relay grants
the server a slot only when the local channel hands it a free one, so local
readers that hold frames slow the remote stream exactly as they would slow a
local producer (``block``), or make it skip (``latest``).
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from typing import Any

from .._args import DeviceLike, device_ordinal
from .._errors import (
    EndOfStream,
    IpcPoolError,
    ProtocolError,
    SlotBusyError,
    SlotFullError,
    UsageError,
)
from .._transport import check_socket_path
from .._transport._closing import ClosesOnExit
from . import _wire as wire
from ._credit import ClientBook
from ._session import ClientSession, Received

#: Extra bytes per local slot (alignment of several arrays in one slot).
_SLACK = 64 * 1024


class _PublisherSink:
    """What both sinks share: a local publisher ``pub`` (None until :meth:`setup`)."""

    pub: Any

    def service(self) -> None:
        self.pub.poll(0.0)

    @property
    def subscribers(self) -> list[Any]:
        return [] if self.pub is None else self.pub.subscribers

    def close(self, linger: float) -> None:
        """Close the local publisher (if set up), giving its subscribers ``linger`` seconds."""
        if self.pub is not None:
            self.pub.close(linger=linger)


class _HostSink(_PublisherSink):
    """Republish into a :class:`HostChannelPublisher` (memfd slots): several slots in flight."""

    def __init__(self, path: str, num_slots: int, kwargs: dict[str, Any]) -> None:
        self.path = path
        self.num_slots = num_slots
        self._kwargs = kwargs
        self.pub: Any = None
        self.relayed = 0

    def setup(self, max_frame: int) -> None:
        from ._host import HostChannelPublisher

        self.pub = HostChannelPublisher(
            self.path, self.num_slots, max(max_frame, 1) + _SLACK, **self._kwargs
        )

    def grantable(self, book: ClientBook) -> list[int]:
        out: list[int] = []
        while len(book.granted) + len(book.receiving) + len(out) < self.num_slots:
            try:
                out.append(self.pub.acquire(timeout=0.0))
            except SlotBusyError:
                break
        return out

    def arrays(self, slot: int, specs: tuple[wire.ArraySpec, ...]) -> list[Any]:
        return self.pub.arrays(slot, specs)

    def deliver(self, frame: Received, book: ClientBook) -> None:
        book.release(frame.slot)  # the local channel's leases guard the slot from here on
        self.pub.publish(frame.slot, frame.specs, metadata=frame.metadata)
        self.relayed += 1

    def abandon(self, slot: int) -> None:
        self.pub.abandon(slot)


class _DeviceSink(_PublisherSink):
    """Republish into a :class:`cupy_ipcpool.Publisher` over an IpcPool: one slot in flight.

    The publisher hands out one slot at a time (``acquire`` then ``publish``),
    so the relay grants one slot at a time.
    """

    def __init__(self, path: str, num_slots: int, device: int, kwargs: dict[str, Any]) -> None:
        self.path = path
        self.num_slots = num_slots
        self.device = device
        self._kwargs = kwargs
        self.pool: Any = None
        self.pub: Any = None
        self._frame: Any = None
        self.relayed = 0

    def setup(self, max_frame: int) -> None:
        from .._pool import IpcPool
        from ..channel import Publisher

        self.pool = IpcPool(self.num_slots, max(max_frame, 1) + _SLACK, device=self.device)
        try:
            self.pub = Publisher(self.pool, self.path, **self._kwargs)
        except BaseException:
            self.pool.close()
            raise

    def grantable(self, book: ClientBook) -> list[int]:
        if self._frame is not None:
            return []
        try:
            self._frame = self.pub.frame(timeout=0.0)
        except SlotBusyError:
            return []
        return [self._frame.slot]

    def arrays(self, slot: int, specs: tuple[wire.ArraySpec, ...]) -> list[Any]:
        frame = self._frame
        if frame is None or frame.slot != slot:
            raise ProtocolError(f"frame sent into slot {slot}, which the relay did not grant")
        try:
            return [frame.array(spec.shape, spec.typestr) for spec in specs]
        except SlotFullError as exc:
            raise ProtocolError(f"the frame does not fit a relay slot: {exc}") from None

    def deliver(self, frame: Received, book: ClientBook) -> None:
        current, self._frame = self._frame, None
        book.release(frame.slot)
        current.publish(*frame.arrays, metadata=frame.metadata)
        frame.arrays.clear()
        self.relayed += 1

    def abandon(self, slot: int) -> None:
        self._frame = None

    def close(self, linger: float) -> None:
        self._frame = None
        if self.pub is not None:
            self.pub.close(timeout=linger)  # a Publisher's close calls its linger a timeout
        if self.pool is not None:
            self.pool.close()


class Relay(ClosesOnExit):
    """Receive ``remote`` once and republish it at the local socket ``path``.

    Parameters
    ----------
    remote:
        ``ucx://host:port`` of a :class:`~cupy_ipcpool.remote.RemoteServer`.
    path:
        Local socket path of the republished channel, at most 107 bytes (a
        longer one is a :class:`~cupy_ipcpool.UsageError`, before anything
        connects).  Local subscribers use
        :func:`cupy_ipcpool.subscribe` (``memory="device"``) or
        :class:`~cupy_ipcpool.remote.HostChannelSubscriber` (``memory="host"``).
    secret, insecure, mode, timeout:
        As for :func:`cupy_ipcpool.remote.subscribe`.
    slots:
        Slots of the local ring (and the relay's credit on the host path).
    memory:
        ``"device"``: an IpcPool on ``device`` and a :class:`~cupy_ipcpool.Publisher`;
        ``"host"``: memfd slots and a :class:`HostChannelPublisher` (no GPU).
    device:
        GPU of the local ring, an ordinal or a ``cupy.cuda.Device``.
    linger:
        On close, seconds local subscribers get to hang up.
    **publisher:
        Passed to the local publisher (``allowed_uids``, ``max_subscribers``...).

    Notes
    -----
    A background thread drives both the remote session and the local
    publisher.  :meth:`wait` returns when the remote stream ends; local
    subscribers then get an end of stream when the relay closes.
    """

    def __init__(
        self,
        remote: str,
        path: str | os.PathLike[str],
        *,
        secret: str | bytes | None = None,
        insecure: bool = False,
        mode: str = "block",
        slots: int = 4,
        memory: str = "device",
        device: DeviceLike = 0,
        timeout: float = 10.0,
        linger: float = 5.0,
        **publisher: Any,
    ) -> None:
        wire.parse_address(remote)  # before anything: an address no server can be at
        local = check_socket_path(path)  # before the network: a path no one could reach
        device = device_ordinal(device)
        self.sink: _HostSink | _DeviceSink
        if memory == "host":
            self.sink = _HostSink(local, slots, publisher)
        elif memory == "device":
            self.sink = _DeviceSink(local, slots, device, publisher)
        else:
            raise UsageError(f"memory must be 'device' or 'host', not {memory!r}")
        self.path = local
        self.remote = remote
        self._memory = memory
        self._device = device
        self._linger = linger
        self._stop = False
        self._closed = False
        self.session = ClientSession(
            remote, self.sink, secret=secret, insecure=insecure, mode=mode, timeout=timeout
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._run, name="ipcpool-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        session = self.session
        poller = select.poll()
        for fd in session.fds():
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        if self._memory == "device":
            from .._arrays import cupy_module

            cupy_module().cuda.Device(self._device).use()
        try:
            while not self._stop and session.ended is None:
                session.step(poller, 5)  # local releases are seen within 5 ms
                self.sink.service()
        except Exception as exc:
            session._end(f"the relay failed: {exc!r}", False)

    @property
    def relayed(self) -> int:
        """Frames republished so far."""
        return self.sink.relayed

    @property
    def staged(self) -> bool | None:
        """Whether device frames come through a staging buffer (None before the first one)."""
        return self.session.staged

    @property
    def subscribers(self) -> list[Any]:
        """Local subscribers of the republished channel."""
        return self.sink.subscribers

    @property
    def ended(self) -> IpcPoolError | None:
        """How the remote stream ended (None while it runs).

        An :class:`~cupy_ipcpool.EvictedError` when the server evicted the
        relay, a :class:`~cupy_ipcpool.ProtocolError` when it spoke out of
        protocol, else an :class:`~cupy_ipcpool.EndOfStream`.
        """
        end = self.session.ended
        if end is None:
            return None
        failure = self.session.failure
        return failure if failure is not None else EndOfStream(end[0], end[1])

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the remote stream to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Leave the remote server and close the local channel (BYE). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(10.0)
        self.session.close()
        self.sink.close(self._linger)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def relay(remote: str, path: str | os.PathLike[str], **kwargs: Any) -> Relay:
    """Start a :class:`Relay` (see there for the arguments)."""
    return Relay(remote, path, **kwargs)
