"""A host-memory channel: the session core with memfd slots, frames as NumPy arrays.

The GPU channel (:class:`cupy_ipcpool.Publisher`) carries device frames; this
one carries host frames over the same session core
(:mod:`cupy_ipcpool.channel._publisher_core` and
:mod:`~cupy_ipcpool.channel._subscriber_core`: Unix socket, leases,
``block``/``latest``), with one memfd per slot handed to subscribers once.
The remote layer uses it as the GPU-free source and sink of a
:class:`~cupy_ipcpool.remote.RemoteServer` and a :class:`~cupy_ipcpool.remote.Relay`
(``memory="host"``); it needs no GPU and is what the CPU tier of the tests runs.

Conventions: the WELCOME payload is the slot size (``u64``), its fds the
memfds; a FRAME payload is ``count u16, metadata length u32``, the array specs
of :mod:`cupy_ipcpool.remote._wire`, then the metadata.  Arrays are packed in
the slot as :func:`cupy_ipcpool.remote._wire.layout` says.  The payload is written
and read by the engine (``c/src/host_frame.c``), as C publishers write it
(``cip_host_frame_encode``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from typing import Any, overload

import numpy

from .._args import deprecated, keyword_only_signature, moved_to_keywords
from .._errors import EndOfStream, ProtocolError, UsageError
from .._transport._closing import ClosesOnExit
from ..channel._handshake import SubscriberInfo, Welcome
from ..channel._iterate import frames_until_clean_end
from ..channel._publisher_core import PublisherCore
from ..channel._subscriber_core import SubscriberCore
from . import _wire as wire
from ._memory import HostSlots

_WELCOME = struct.Struct("<Q")
#: A host FRAME payload's head: array count, metadata length (the layout's one source:
#: c/gen_wire.py puts it in cupy_ipcpool_wire.h for c/src/host_frame.c).
_HEAD = struct.Struct("<HI")


def spec_of(array: Any) -> wire.ArraySpec:
    """The wire spec of a NumPy or CuPy array."""
    return wire.ArraySpec(numpy.dtype(array.dtype).str, tuple(int(d) for d in array.shape))


def encode_payload(specs: tuple[wire.ArraySpec, ...], metadata: bytes) -> bytes:
    """A host FRAME payload (the engine's, ``c/src/host_frame.c``: ``cip_host_frame_encode``)."""
    return wire._engine().encode_host_frame(wire.pairs(specs), metadata)


def decode_payload(
    payload: bytes, slot_nbytes: int
) -> tuple[tuple[wire.ArraySpec, ...], list[int], bytes]:
    """Decode and check a host FRAME payload against the slot size (ProtocolError if bad):
    the arrays' specs, where each sits in the slot, the metadata."""
    raw, offsets, metadata = wire._engine().decode_host_frame(payload, slot_nbytes)
    return tuple(wire.ArraySpec(ts, shape) for ts, shape in raw), offsets, metadata


class HostChannelPublisher(ClosesOnExit):
    """Publish host frames to local :class:`HostChannelSubscriber` processes.

    Parameters
    ----------
    address:
        Filesystem path of the Unix socket (mode 0600).
    num_slots, slot_nbytes:
        The ring of memfd slots.
    **kwargs:
        Passed to :class:`cupy_ipcpool.channel._publisher_core.PublisherCore`
        (``allowed_uids``, ``max_subscribers``, ``send_timeout``, ``on_join``, ``on_leave``).

    Notes
    -----
    One thread drives it.  Several slots may be acquired before they are
    published (each stays reserved until :meth:`publish` or :meth:`abandon`).
    """

    def __init__(
        self, address: str | os.PathLike[str], num_slots: int, slot_nbytes: int, **kwargs: Any
    ) -> None:
        self.slots = HostSlots(num_slots, slot_nbytes)
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        try:
            welcome = Welcome(_WELCOME.pack(slot_nbytes), tuple(self.slots.fds))
            self.core = PublisherCore(address, num_slots, welcome=welcome, **kwargs)
        except BaseException:
            self.slots.close()
            raise
        self.address = self.core.address
        self._reserved: set[int] = set()

    @property
    def subscribers(self) -> list[SubscriberInfo]:
        """Adopted subscribers."""
        return self.core.subscribers

    @overload
    def acquire(self, *, timeout: float | None = 5.0) -> int: ...
    @overload
    @deprecated("pass timeout by keyword: acquire(timeout=...)")
    def acquire(self, *args: Any, timeout: float | None = 5.0) -> int: ...
    @keyword_only_signature
    def acquire(self, *args: Any, timeout: float | None = 5.0) -> int:
        """Reserve a free slot (no leases, not reserved) and return it.

        Raises
        ------
        SlotBusyError
            None became free within ``timeout``.
        """
        if args:
            (timeout,) = moved_to_keywords(HostChannelPublisher.acquire, args, timeout=timeout)
        slot, _readers = self.core.acquire(timeout)
        self.core.hold(slot)
        self._reserved.add(slot)
        return slot

    def arrays(self, slot: int, specs: tuple[wire.ArraySpec, ...]) -> list[numpy.ndarray]:
        """Writable views of ``specs`` packed in reserved ``slot``."""
        return self.slots.arrays(slot, specs)

    @overload
    def publish(
        self, slot: int, specs: tuple[wire.ArraySpec, ...], *, metadata: bytes = b""
    ) -> int: ...
    @overload
    @deprecated("pass metadata by keyword: publish(slot, specs, metadata=...)")
    def publish(
        self, slot: int, specs: tuple[wire.ArraySpec, ...], *args: Any, metadata: bytes = b""
    ) -> int: ...
    @keyword_only_signature
    def publish(
        self, slot: int, specs: tuple[wire.ArraySpec, ...], *args: Any, metadata: bytes = b""
    ) -> int:
        """Publish reserved ``slot`` holding ``specs``; return the seq.

        Raises
        ------
        UsageError
            ``slot`` was not reserved by :meth:`acquire` (or was published or
            abandoned since).
        """
        if args:
            (metadata,) = moved_to_keywords(HostChannelPublisher.publish, args, metadata=metadata)
        if slot not in self._reserved:
            raise UsageError(f"slot {slot} was not acquired")
        payload = encode_payload(specs, metadata)
        self._reserved.discard(slot)
        self.core.unhold(slot)
        return self.core.publish(slot, payload)

    def abandon(self, slot: int) -> None:
        """Give a reserved slot back unpublished."""
        if slot in self._reserved:
            self._reserved.discard(slot)
            self.core.unhold(slot)

    def send(self, *arrays: Any, metadata: bytes = b"", timeout: float | None = 5.0) -> int:
        """Copy ``arrays`` into a free slot and publish them (a convenience; one copy)."""
        specs = tuple(spec_of(a) for a in arrays)
        slot = self.acquire(timeout=timeout)
        try:
            for dst, src in zip(self.arrays(slot, specs), arrays, strict=True):
                dst[...] = src
        except BaseException:
            self.abandon(slot)
            raise
        return self.publish(slot, specs, metadata=metadata)

    def poll(self, timeout: float | None = 0.0) -> int:
        """Adopt subscribers and collect releases; return how many leases came back."""
        return self.core.poll(timeout)

    def leases(self, slot: int) -> int:
        """Subscriber leases on ``slot``."""
        return self.core.lease_book.lease_count(slot)

    @overload
    def close(self, *, linger: float = 0.0) -> None: ...
    @overload
    @deprecated("pass linger by keyword: close(linger=...)")
    def close(self, *args: Any, linger: float = 0.0) -> None: ...
    @keyword_only_signature
    def close(self, *args: Any, linger: float = 0.0) -> None:
        """Say BYE to every subscriber and free the slots (they stay mapped where used)."""
        if args:
            (linger,) = moved_to_keywords(HostChannelPublisher.close, args, linger=linger)
        self.core.close(linger=linger)
        self.slots.close()


class HostFrame:
    """A received host frame: read-only NumPy views of the shared slot, under a lease."""

    __slots__ = ("_sub", "arrays", "metadata", "released", "seq", "slot")

    def __init__(
        self,
        sub: HostChannelSubscriber,
        seq: int,
        slot: int,
        arrays: tuple[numpy.ndarray, ...],
        metadata: bytes,
    ) -> None:
        self._sub = sub
        self.seq = seq
        self.slot = slot
        self.arrays = arrays
        self.metadata = metadata
        self.released = False

    @property
    def array(self) -> numpy.ndarray:
        """The first array."""
        return self.arrays[0]

    @overload
    def release(self, *, stream: Any = None) -> None: ...
    @overload
    @deprecated("pass stream by keyword: release(stream=...)")
    def release(self, *args: Any, stream: Any = None) -> None: ...
    @keyword_only_signature
    def release(self, *args: Any, stream: Any = None) -> None:
        """Return the lease (idempotent); ``stream`` is taken for the GPU frame's signature."""
        if args:
            (stream,) = moved_to_keywords(HostFrame.release, args, stream=stream)
        if self.released:
            return
        self.released = True
        self._sub._release(self.seq, self.slot)

    def __enter__(self) -> HostFrame:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostChannelSubscriber(ClosesOnExit):
    """Subscribe to a :class:`HostChannelPublisher`; frames are NumPy views of its memfds.

    Parameters
    ----------
    address:
        The publisher's socket path.
    mode, credit, timeout, allowed_uids:
        As for :class:`cupy_ipcpool.channel._subscriber_core.SubscriberCore`.
    writable:
        Map the slots read-write (the remote server's bridge does: UCX
        registers read-only mappings poorly and falls back to copies, about
        2x slower on TCP).  Readers never need it.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        mode: str = "block",
        credit: int | None = None,
        timeout: float = 10.0,
        allowed_uids: Iterable[int] | None = None,
        writable: bool = False,
    ) -> None:
        self.core = SubscriberCore(
            address, mode=mode, credit=credit, timeout=timeout, allowed_uids=allowed_uids
        )
        self._bases: list[numpy.ndarray] = []
        try:
            payload = self.core.welcome_payload
            fds = self.core.take_fds()
            try:
                if len(payload) != _WELCOME.size or len(fds) != self.core.num_slots:
                    raise ProtocolError("host channel WELCOME does not match its slots")
                (self.slot_nbytes,) = _WELCOME.unpack(payload)
                for fd in fds:
                    if os.fstat(fd).st_size < self.slot_nbytes:
                        raise ProtocolError("a host channel slot is smaller than announced")
                    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                    m = mmap.mmap(
                        fd, self.slot_nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot
                    )
                    self._bases.append(numpy.frombuffer(m, dtype=numpy.uint8))
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            self.core.close()
            raise
        self.num_slots = self.core.num_slots
        self.mode = mode

    def fileno(self) -> int:
        """Readable when a frame (or the end) is waiting."""
        return self.core.fileno()

    @overload
    def recv(self, *, timeout: float | None = None) -> HostFrame: ...
    @overload
    @deprecated("pass timeout by keyword: recv(timeout=...)")
    def recv(self, *args: Any, timeout: float | None = None) -> HostFrame: ...
    @keyword_only_signature
    def recv(self, *args: Any, timeout: float | None = None) -> HostFrame:
        """Wait for the next frame.

        Raises
        ------
        EndOfStream
            The publisher closed (``clean``) or went away.
        TimeoutError
            Nothing within ``timeout``.
        ProtocolError
            A malformed frame; the subscription is closed.
        """
        if args:
            (timeout,) = moved_to_keywords(HostChannelSubscriber.recv, args, timeout=timeout)
        msg = self.core.recv(timeout)
        try:
            specs, offsets, metadata = decode_payload(msg.payload, self.slot_nbytes)
        except ProtocolError:
            self.close()
            raise
        base = self._bases[msg.slot]
        arrays = tuple(
            base[o : o + s.nbytes].view(numpy.dtype(s.typestr)).reshape(s.shape)
            for o, s in zip(offsets, specs, strict=True)
        )
        return HostFrame(self, msg.seq, msg.slot, arrays, metadata)

    def _release(self, seq: int, slot: int) -> None:
        if self.core.closed:
            return
        with contextlib.suppress(EndOfStream):
            self.core.release(seq, slot)

    def __iter__(self) -> Iterator[HostFrame]:
        """Frames until the publisher closes cleanly (an unclean end raises EndOfStream)."""
        return frames_until_clean_end(self.recv)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self.core.closed

    def close(self) -> None:
        """Say BYE and close the socket; mappings stay while frames use them."""
        self.core.close()
        self._bases = []
