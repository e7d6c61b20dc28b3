"""A subscriber on another machine: the local subscriber's API over a remote session."""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
import time
from collections.abc import Iterator
from typing import Any, overload

from .._args import (
    DeviceLike,
    deprecated,
    device_ordinal,
    keyword_only_signature,
    moved_to_keywords,
)
from .._errors import (
    ChannelTimeoutError,
    EndOfStream,
    EvictedError,
    PoolClosedError,
    ProtocolError,
    UsageError,
)
from .._transport._closing import ClosedFlag
from ..channel import Frame
from ..channel._iterate import frames_until_clean_end
from . import _wire as wire
from ._credit import ClientBook
from ._memory import DeviceSlots, HostSlots
from ._session import ClientSession, Received

#: Receive slots of a remote subscriber by default.
DEFAULT_SLOTS = 4


class _Lease:
    """Owner of a received frame's arrays: returns the slot when released or collected."""

    __slots__ = ("__weakref__", "released", "seq", "slot", "subscriber")

    def __init__(self, subscriber: RemoteSubscriber, seq: int, slot: int) -> None:
        self.subscriber = subscriber
        self.seq = seq
        self.slot = slot
        self.released = False

    def release(self, stream: Any = None) -> None:
        if self.released:
            return
        self.released = True
        self.subscriber._release(self.seq, self.slot, stream)

    def __del__(self) -> None:
        if not self.released:
            try:  # noqa: SIM105 - cheaper than contextlib.suppress in a finalizer
                self.release()
            except Exception:
                pass


class RemoteFrame(Frame):
    """A frame received from a remote server, in one slot of this process's receive ring.

    Attributes
    ----------
    seq:
        The producer's sequence number (gaps: frames skipped in ``latest`` mode).
    slot:
        The receive slot it occupies.
    arrays:
        ``cupy.ndarray`` (device ring) or ``numpy.ndarray`` (host ring) views
        of the slot, C-contiguous; no copy after UCX wrote them.
    metadata:
        The producer's bytes.

    Notes
    -----
    Release it (:meth:`release` or a ``with`` block) when done: the slot is
    granted to the server again only then (and, on a GPU, once the work queued
    on the release stream has finished).  It is also released when the frame
    and all of its arrays are garbage collected.
    """

    __slots__ = ()


class RemoteSubscriber(ClosedFlag):
    """Receive a :class:`~cupy_ipcpool.remote.RemoteServer`'s frames; made by :func:`subscribe`.

    Frames land in a receive ring of ``slots`` slots (an
    :class:`~cupy_ipcpool.IpcPool` on ``device``, or host memory), each slot as
    large as the producer's.  A background thread drives the session (UCX
    progress, credit, frame headers); :meth:`recv` takes complete frames in order.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        insecure: bool = False,
        mode: str = "block",
        slots: int = DEFAULT_SLOTS,
        memory: str = "device",
        device: DeviceLike = 0,
        timeout: float = 10.0,
    ) -> None:
        wire.parse_address(address)  # before anything else: an address no server can be at
        device = device_ordinal(device)
        if memory not in ("device", "host"):
            raise UsageError(f"memory must be 'device' or 'host', not {memory!r}")
        if not 1 <= slots <= wire.MAX_RING_SLOTS:
            raise UsageError(f"slots must be in 1..{wire.MAX_RING_SLOTS}, not {slots}")
        self.num_slots = slots
        self.mode = mode
        self.address = address
        self._kind = memory
        self._device = device
        self._memory: DeviceSlots | HostSlots | None = None
        self._ready: collections.deque[Received] = collections.deque()
        self._released: collections.deque[int] = collections.deque()
        self._held: dict[int, int] = {}  # seq -> slot, received by the user and not released
        self._cond = threading.Condition()
        self._closed = False
        self._stop = False
        self._session = ClientSession(
            address, self, secret=secret, insecure=insecure, mode=mode, timeout=timeout
        )
        self.sub_id = self._session.sub_id
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the loop
        self._wake_lock = threading.Lock()  # the pipe's fds are closed under it
        self._thread = threading.Thread(target=self._run, name="ipcpool-remote-sub", daemon=True)
        self._thread.start()

    # -- the sink (called on the session thread) --

    def setup(self, max_frame: int) -> None:
        if self._kind == "device":
            self._memory = DeviceSlots(
                self.num_slots, max(max_frame, 1), device=self._device, notify=self._wake
            )
        else:
            self._memory = HostSlots(self.num_slots, max(max_frame, 1))

    def grantable(self, book: ClientBook) -> list[int]:
        memory = self._memory
        assert memory is not None
        while self._released:
            slot = self._released.popleft()
            book.release(slot)
        out = []
        for slot in book.free():
            if memory.ready(slot):  # else the memory's notify wakes this thread
                out.append(slot)
        return out

    def arrays(self, slot: int, specs: tuple[wire.ArraySpec, ...]) -> list[Any]:
        assert self._memory is not None
        return self._memory.arrays(slot, specs)

    def deliver(self, frame: Received, book: ClientBook) -> None:
        with self._cond:
            self._ready.append(frame)
            self._cond.notify_all()

    def abandon(self, slot: int) -> None:
        pass

    # -- session thread --

    def _wake(self) -> None:
        # also called from the receive ring's thread (DeviceSlots' notify), maybe after
        # close(): never write to the fd number once it is closed (it may be reused)
        with self._wake_lock, contextlib.suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        session = self._session
        poller = select.poll()
        for fd in session.fds():
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        if self._kind == "device":
            from .._arrays import cupy_module

            cupy_module().cuda.Device(self._device).use()
        try:
            while not self._stop and session.ended is None:
                session.step(poller, -1)
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
        except Exception as exc:
            session._end(f"the session failed: {exc}", False)
        finally:
            with self._cond:
                self._cond.notify_all()

    # -- user API --

    @property
    def memory(self) -> DeviceSlots | HostSlots:
        """The receive ring."""
        assert self._memory is not None
        return self._memory

    @property
    def staged(self) -> bool | None:
        """Whether device frames come through a staging buffer (None before the first one).

        True when the server is on this machine, UCX may use ``cuda_ipc`` and
        cannot export the receive ring's slots (docs/remote.md).
        """
        return self._session.staged

    @property
    def held(self) -> dict[int, int]:
        """Frames received and not released, as ``{seq: slot}``."""
        with self._cond:
            return dict(self._held)

    @overload
    def recv(self, *, timeout: float | None = None, stream: Any = None) -> RemoteFrame: ...
    @overload
    @deprecated("pass timeout by keyword: recv(timeout=...)")
    def recv(self, *args: Any, timeout: float | None = None, stream: Any = None) -> RemoteFrame: ...
    @keyword_only_signature
    def recv(self, *args: Any, timeout: float | None = None, stream: Any = None) -> RemoteFrame:
        """Wait for the next complete frame.

        ``stream`` is accepted for the local subscriber's signature: a remote
        frame is complete in this process's memory when it is handed out.

        Raises
        ------
        EvictedError
            The server evicted this subscriber (a frame's send to it did not
            complete within the server's ``send_timeout``); raised on this call
            and every later one, frames not yet handed out are dropped.
            Subscribe again to resume.
        EndOfStream
            The server said goodbye (``clean``) or the connection was lost
            (``clean=False``); frames already received stay readable.
        ChannelTimeoutError
            No frame within ``timeout`` seconds (also a ``TimeoutError``).
        ProtocolError
            The server spoke out of protocol (after the frames received before
            that); the subscription is closed.
        PoolClosedError
            This subscriber is closed.
        """
        if args:
            (timeout,) = moved_to_keywords(RemoteSubscriber.recv, args, timeout=timeout)
        if self._closed:
            raise PoolClosedError("the remote subscriber is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        broken: ProtocolError | None = None
        with self._cond:
            while True:
                failure = self._session.failure
                if isinstance(failure, EvictedError):
                    self._ready.clear()
                    raise EvictedError(str(failure), False)
                if self._ready:
                    break
                ended = self._session.ended
                if ended is not None and not self._thread.is_alive():
                    if isinstance(failure, ProtocolError):
                        broken = failure
                        break
                    raise EndOfStream(ended[0], ended[1])
                if self._closed:
                    raise PoolClosedError("the remote subscriber is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ChannelTimeoutError.no_frame(timeout)
                self._cond.wait(0.5 if remaining is None else min(remaining, 0.5))
            if broken is None:
                got = self._ready.popleft()
                self._held[got.seq] = got.slot
        if broken is not None:
            self.close()
            raise ProtocolError(str(broken))
        assert self._memory is not None
        lease = _Lease(self, got.seq, got.slot)
        arrays = tuple(self._memory.arrays(got.slot, got.specs, owner=lease))
        return RemoteFrame(got.seq, got.slot, arrays, got.metadata, lease)

    def _release(self, seq: int, slot: int, stream: Any) -> None:
        with self._cond:
            self._held.pop(seq, None)
        if self._closed or self._memory is None:
            return
        self._memory.reading(slot, stream)
        self._released.append(slot)
        self._wake()

    def __iter__(self) -> Iterator[RemoteFrame]:
        """Frames until the server closes cleanly; a lost connection raises EndOfStream."""
        return frames_until_clean_end(self.recv)

    def close(self) -> None:
        """Say BYE, stop the session thread, free the ring once no frame uses it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._wake()
        self._thread.join(10.0)
        self._session.close()
        with self._cond:
            self._ready.clear()
            self._cond.notify_all()
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_w = -1
        if self._memory is not None:
            self._memory.close()


def subscribe(
    address: str,
    *,
    secret: str | bytes | None = None,
    insecure: bool = False,
    mode: str = "block",
    slots: int = DEFAULT_SLOTS,
    memory: str = "device",
    device: DeviceLike = 0,
    timeout: float = 10.0,
) -> RemoteSubscriber:
    """Subscribe to a remote server at ``ucx://host:port``.

    Parameters
    ----------
    address:
        ``ucx://host:port`` of a :class:`~cupy_ipcpool.remote.RemoteServer`.
    secret:
        The shared secret (default ``$CUPY_IPCPOOL_SECRET``); required unless
        ``insecure=True`` and the server serves without one.
    mode:
        ``"block"``: every frame (the producer may wait for this subscriber);
        ``"latest"``: frames arriving while every receive slot is busy are
        skipped for this subscriber only.
    slots:
        Receive slots: this subscriber's credit (frames in flight plus held).
    memory:
        ``"device"`` (an IpcPool on ``device``; frames are ``cupy.ndarray``)
        or ``"host"`` (frames are ``numpy.ndarray``; no GPU needed).
    device:
        The GPU that receives, an ordinal or a ``cupy.cuda.Device``.
    timeout:
        Seconds for connecting and the handshake.

    Returns
    -------
    RemoteSubscriber
        Iterate it, or call ``recv()``; frames behave like local ones.
    """
    return RemoteSubscriber(
        address,
        secret=secret,
        insecure=insecure,
        mode=mode,
        slots=slots,
        memory=memory,
        device=device,
        timeout=timeout,
    )
