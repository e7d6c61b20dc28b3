"""Publish / subscribe frames between processes: leases, events, backpressure.

The GPU layer over :mod:`cupy_ipcpool._session` (sockets, leases) and
:mod:`cupy_ipcpool._peer` (imports):

* the producer's :class:`Publisher` owns one interprocess CUDA event per slot
  (*frame events*) and, per subscriber, one per slot (*read events*).  The
  WELCOME message carries the pool descriptor, the slot fds, and the handles of
  both sets of events; the subscriber opens them once.
* publishing records the slot's frame event on the producer's stream and sends
  a FRAME message (seq, slot, event index, array handles, metadata); the
  subscriber's stream waits on that event before its work touches the frame —
  the host never blocks.
* releasing records the subscriber's read event for the slot on its stream and
  sends RELEASE; before the producer writes the slot again, its stream waits on
  the read events of every subscriber that read it.  A slot is reused only when
  all its leases are back and no local array refers to it.

See ``docs/protocol.md`` for the sequence diagram.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import struct
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

from . import _driver
from ._allocator import _Block, arena_for
from ._arrays import SlotRef, cupy_module
from ._errors import (
    DescriptorError,
    EndOfStream,
    NotShareableError,
    PoolClosedError,
    ProtocolError,
    TeardownWarning,
)
from ._handles import ArrayHandle, PoolDescriptor
from ._peer import PeerPool, attach_fds
from ._pool import IpcPool
from ._session import PublisherCore, SubscriberCore, SubscriberInfo

#: Size of a CUDA interprocess event handle.
EVENT_HANDLE_NBYTES = 64
#: Most bytes of user metadata per frame.
MAX_METADATA = 16384
#: Most arrays per frame.
MAX_ARRAYS = 64
#: Most slots a published pool may have (Linux passes at most 253 fds per message).
MAX_CHANNEL_SLOTS = 253

# WELCOME payload: descriptor length u32, num_slots u32, then descriptor bytes,
# num_slots frame-event handles, num_slots read-event handles.
_WELCOME_HEAD = struct.Struct("<II")
# FRAME payload: event index u32, number of arrays u16, metadata length u16,
# then the packed array handles, then the metadata.
_FRAME_HEAD = struct.Struct("<IHH")


def _event_flags(rt: Any) -> int:
    return int(rt.eventDisableTiming | rt.eventInterprocess)


def _destroy_events(rt: Any, events: Iterable[int]) -> None:
    for ev in events:
        try:
            rt.eventDestroy(ev)
        except Exception as exc:
            warnings.warn(f"cudaEventDestroy failed: {exc}", TeardownWarning, stacklevel=2)


# ----------------------------------------------------------------------- producer


class PublishFrame:
    """The slot being written, from :meth:`Publisher.frame`.

    Attributes
    ----------
    slot:
        The slot acquired for this frame (also ``pool.current``).
    seq:
        The sequence number once published, else None.
    """

    def __init__(self, publisher: Publisher, slot: int, stream: Any) -> None:
        self._publisher = publisher
        self._stream = stream
        self.slot = slot
        self.seq: int | None = None

    def array(self, shape: Any, dtype: Any = "float32") -> Any:
        """A new ``cupy.ndarray`` carved out of this frame's slot (uninitialised).

        Several arrays of one frame do not overlap (they share the slot's bump
        allocator with ``pool.allocating()``).
        """
        return self._publisher._new_array(self.slot, shape, dtype)

    def publish(self, *arrays: Any, metadata: bytes = b"") -> int:
        """Publish ``arrays`` (all in this frame's slot) with ``metadata``; return the seq.

        The frame event is recorded on the stream given to :meth:`Publisher.frame`
        (default: CuPy's current stream at publish time).
        """
        if self.seq is not None:
            raise RuntimeError(f"frame in slot {self.slot} was already published as {self.seq}")
        self.seq = self._publisher.publish(*arrays, metadata=metadata, stream=self._stream)
        return self.seq

    def __enter__(self) -> PublishFrame:
        return self

    def __exit__(self, *exc: object) -> None:
        self._publisher._writing = None


class Publisher:
    """Publish frames from an :class:`IpcPool` to subscriber processes.

    Parameters
    ----------
    pool:
        The ring whose slots carry the frames.
    address:
        Filesystem path of the Unix socket subscribers connect to (created
        with mode 0600; a stale socket file is replaced, a live one refused).
    allowed_uids:
        Uids that may subscribe (checked with ``SO_PEERCRED``); default: this
        process's effective uid.
    max_subscribers:
        Further subscribers are refused.
    send_timeout:
        How long a ``"block"`` subscriber's full socket may stall a publish
        before it is dropped.

    Notes
    -----
    One thread drives a publisher (``frame``/``acquire``/``publish``/``poll``);
    subscribers are accepted on a background thread.  Subscribers that join
    receive frames published after they are adopted (at the next call).
    A publisher holds the pool's slots through its leases: close it before
    the pool.
    """

    def __init__(
        self,
        pool: IpcPool,
        address: str | os.PathLike[str],
        *,
        allowed_uids: Iterable[int] | None = None,
        max_subscribers: int = 64,
        send_timeout: float = 5.0,
    ) -> None:
        pool._check()
        n = pool.num_slots
        if n > MAX_CHANNEL_SLOTS:
            raise ValueError(
                f"a channel carries at most {MAX_CHANNEL_SLOTS} slots (one fd per slot in one "
                f"SCM_RIGHTS message); this pool has {n}"
            )
        cp = cupy_module()
        self._cp = cp
        self._rt = rt = cp.cuda.runtime
        self._pool = pool
        self._device = pool.device
        self._lock = threading.Lock()
        self._read_events: dict[int, list[int]] = {}
        self._closed = False
        self._writing: int | None = None
        with cp.cuda.Device(self._device):
            self._frame_events: list[int] = []
            try:
                for _ in range(n):
                    self._frame_events.append(rt.eventCreateWithFlags(_event_flags(rt)))
                handles = b"".join(rt.ipcGetEventHandle(ev) for ev in self._frame_events)
            except BaseException:
                _destroy_events(rt, self._frame_events)
                raise
        desc = pool.descriptor(transport="pidfd").to_bytes()
        self._welcome_head = _WELCOME_HEAD.pack(len(desc), n) + desc + handles
        self._slot_fds = [pool.fd(i) for i in range(n)]
        try:
            self._core = PublisherCore(
                address,
                n,
                welcome=self._welcome,
                allowed_uids=allowed_uids,
                on_leave=self._on_leave,
                max_subscribers=max_subscribers,
                send_timeout=send_timeout,
            )
        except BaseException:
            _destroy_events(rt, self._frame_events)
            raise
        self.address = self._core.address
        book = self._core.lease_book
        self._book = book
        pool._lease_probe = lambda slot: len(book.leases(slot))
        refs = pool._mem.refs
        self._transitions: collections.deque[int] = collections.deque()
        refs.transitions = self._transitions
        for slot in range(n):
            if refs.counts[slot]:
                book.hold(slot)
        self._finalizer = weakref.finalize(
            self,
            _close_publisher,
            self._core,
            rt,
            self._frame_events,
            self._read_events,
            pool,
            self._device,
        )

    # -- accept thread / callbacks --

    def _welcome(self, info: SubscriberInfo) -> tuple[bytes, list[int]]:
        rt = self._rt
        events: list[int] = []
        with self._cp.cuda.Device(self._device):
            try:
                for _ in range(self._pool.num_slots):
                    events.append(rt.eventCreateWithFlags(_event_flags(rt)))
                handles = b"".join(rt.ipcGetEventHandle(ev) for ev in events)
            except BaseException:
                _destroy_events(rt, events)
                raise
        with self._lock:
            self._read_events[info.sub_id] = events
        return self._welcome_head + handles, self._slot_fds

    def _on_leave(self, info: SubscriberInfo) -> None:
        with self._lock:
            events = self._read_events.pop(info.sub_id, None)
        if events:
            with self._cp.cuda.Device(self._device):
                _destroy_events(self._rt, events)

    # -- state --

    @property
    def pool(self) -> IpcPool:
        """The pool frames are published from."""
        return self._pool

    @property
    def subscribers(self) -> list[SubscriberInfo]:
        """Subscribers adopted so far (pid, uid, mode, credit)."""
        return self._core.subscribers

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise PoolClosedError("the Publisher is closed")
        self._pool._check()

    def _sync_holds(self) -> None:
        """Mirror the pool's local references (live arrays) into the lease book."""
        transitions = self._transitions
        if not transitions:
            return
        counts = self._pool._mem.refs.counts
        book = self._book
        seen = set()
        while transitions:
            slot = transitions.popleft()
            if slot in seen:
                continue
            seen.add(slot)
            held = book.holds(slot) > 0
            if counts[slot] > 0 and not held:
                book.hold(slot)
            elif counts[slot] == 0 and held:
                while book.holds(slot):
                    book.unhold(slot)

    # -- hot path --

    def acquire(self, timeout: float | None = 5.0, stream: Any = None) -> int:
        """Take a free slot for the next frame and make it the pool's current slot.

        A slot is free when no subscriber holds a lease on it and no local
        array refers to it.  ``stream`` (default: CuPy's current stream) is
        made to wait on the read events of every subscriber that read the
        slot, so work enqueued on it afterwards cannot overwrite data a reader
        is still using; the host does not block.

        Raises
        ------
        SlotBusyError
            No slot became free within ``timeout`` seconds (``block``
            subscribers hold them, or local arrays do); the message says who.
        """
        if self._closed:
            raise PoolClosedError("the Publisher is closed")
        pool = self._pool
        if pool._closed or pool._epoch != _driver._fork_epoch:
            pool._check()
        if self._transitions:
            self._sync_holds()
        slot, readers = self._core.acquire(timeout)
        counts = pool._mem.refs.counts
        while counts[slot]:  # an array appeared in that slot since the last sync
            self._sync_holds()
            slot, readers = self._core.acquire(timeout)
        pool._take(slot)
        if readers:
            sptr = (self._cp.cuda.get_current_stream() if stream is None else stream).ptr
            rt = self._rt
            read_events = self._read_events
            for sub_id in readers:
                events = read_events.get(sub_id)
                if events is not None:
                    rt.streamWaitEvent(sptr, events[slot])
        self._writing = slot
        return slot

    def frame(self, timeout: float | None = 5.0, stream: Any = None) -> PublishFrame:
        """:meth:`acquire` a slot and return a :class:`PublishFrame` for it.

        Use as ``with pub.frame() as f: ...; f.publish(y)``; allocations under
        ``pool.allocating()`` inside the block land in ``f.slot``.
        """
        return PublishFrame(self, self.acquire(timeout, stream), stream)

    def _new_array(self, slot: int, shape: Any, dtype: Any) -> Any:
        import numpy

        cp = self._cp
        pool = self._pool
        dt = numpy.dtype(dtype)
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = dt.itemsize
        for n in shape_t:
            nbytes *= n
        arena = arena_for(pool, slot)
        offset = arena.alloc(nbytes)
        owner = _Block(pool._mem, pool._mem.refs, slot, arena, offset)
        mem = cp.cuda.UnownedMemory(pool._ptrs[slot] + offset, max(nbytes, 1), owner, pool.device)
        return cp.ndarray(shape_t, dt, cp.cuda.MemoryPointer(mem, 0))

    def publish(self, *arrays: Any, metadata: bytes = b"", stream: Any = None) -> int:
        """Publish ``arrays`` (all in the slot taken by :meth:`acquire`) as one frame.

        Records the slot's frame event on ``stream`` (default: CuPy's current
        stream; it must be the stream that wrote the arrays, or one ordered
        after it) and sends the frame to the subscribers that take it.

        Returns
        -------
        int
            The frame's sequence number.

        Raises
        ------
        NotShareableError
            An array does not lie in the acquired slot.
        ValueError
            Too many arrays or too much metadata.
        """
        if self._closed:
            raise PoolClosedError("the Publisher is closed")
        slot = self._writing
        if slot is None:
            raise RuntimeError(
                "publish() needs a slot taken with acquire() or frame() first; a slot can be "
                "published once per acquire"
            )
        if len(arrays) > MAX_ARRAYS:
            raise ValueError(f"at most {MAX_ARRAYS} arrays per frame, got {len(arrays)}")
        metadata = bytes(metadata)
        if len(metadata) > MAX_METADATA:
            raise ValueError(f"metadata is {len(metadata)} bytes; at most {MAX_METADATA}")
        pool = self._pool
        base = pool._ptrs[slot]
        limit = pool.slot_nbytes
        generation = pool._generation[slot]
        parts = [_FRAME_HEAD.pack(slot, len(arrays), len(metadata))]
        for a in arrays:
            offset = a.data.ptr - base
            if not 0 <= offset < limit:
                where = pool.locate(a.data.ptr)
                raise NotShareableError(
                    f"array lies in slot {where[0]}, but this frame was acquired in slot {slot}"
                    if where is not None
                    else "array does not lie in the pool; allocate it with frame.array() or "
                    "under pool.allocating()"
                )
            try:
                handle = ArrayHandle(slot, generation, offset, a.shape, a.strides, a.dtype)
                handle.check_fits(limit)
            except DescriptorError as exc:
                raise NotShareableError(f"array extends beyond slot {slot}: {exc}") from None
            parts.append(handle.pack())
        parts.append(metadata)
        sptr = (self._cp.cuda.get_current_stream() if stream is None else stream).ptr
        self._rt.eventRecord(self._frame_events[slot], sptr)
        if self._transitions:
            self._sync_holds()
        seq = self._core.publish(slot, b"".join(parts))
        self._writing = None
        return seq

    def poll(self, timeout: float | None = 0.0) -> int:
        """Adopt new subscribers and collect returned leases; return how many came back."""
        self._check()
        return self._core.poll(timeout)

    def leases(self, slot: int) -> int:
        """Number of subscriber leases on ``slot``."""
        return len(self._book.leases(slot))

    # -- teardown --

    def close(self, timeout: float = 5.0) -> None:
        """Say goodbye to every subscriber, close the socket, destroy the events.

        Subscribers get a clean end of stream after the frames already sent;
        frames they hold stay readable (they mapped the memory themselves).
        ``close`` waits up to ``timeout`` seconds for every subscriber to
        disconnect, because they may still order their work on this
        publisher's events until then.  If some are still connected after
        that, the events are kept (leaked, with a :class:`TeardownWarning`)
        rather than destroyed under them.  Idempotent; never raises.
        """
        if self._closed:
            return
        self._closed = True
        all_gone = self._core.close(linger=timeout)
        if not all_gone:
            warnings.warn(
                f"{len(self._read_events)} subscriber(s) still connected {timeout} s after "
                "the publisher said goodbye; its CUDA events are leaked so that they do not "
                "wait on destroyed events",
                TeardownWarning,
                stacklevel=2,
            )
            self._frame_events.clear()
            self._read_events.clear()
        self._finalizer()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _close_publisher(
    core: PublisherCore,
    rt: Any,
    frame_events: list[int],
    read_events: dict[int, list[int]],
    pool: IpcPool,
    device: int,
) -> None:
    try:
        all_gone = core.close()
    except Exception as exc:  # pragma: no cover - core.close never raises
        warnings.warn(f"closing the publisher socket failed: {exc}", TeardownWarning, stacklevel=2)
        all_gone = False
    pool._lease_probe = None
    pool._mem.refs.transitions = None
    if os.getpid() != pool._pid or not all_gone:
        # Subscribers may still wait on these events for frames queued before the
        # BYE; destroying an exported event under an importer is undefined
        # behaviour, so they are leaked (a few bytes each) instead.
        frame_events.clear()
        read_events.clear()
        return
    try:
        import cupy

        with cupy.cuda.Device(device):
            _destroy_events(rt, frame_events)
            for events in read_events.values():
                _destroy_events(rt, events)
    except Exception as exc:
        warnings.warn(f"destroying publisher events failed: {exc}", TeardownWarning, stacklevel=2)
    frame_events.clear()
    read_events.clear()


# ----------------------------------------------------------------------- consumer


class _Lease:
    """Owner of a received frame's arrays: returns the lease when released or collected.

    It also pins the mapped slot (``pin``), so closing the subscriber never
    unmaps memory that a frame's arrays still use.
    """

    __slots__ = ("__weakref__", "pin", "released", "seq", "slot", "subscriber")

    def __init__(self, subscriber: Subscriber, seq: int, slot: int, pin: SlotRef) -> None:
        self.subscriber = subscriber
        self.seq = seq
        self.slot = slot
        self.pin = pin
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
            except Exception:  # the subscriber is gone or closed: nothing to return
                pass


class Frame:
    """A received frame: arrays over the producer's slot, held under a lease.

    Attributes
    ----------
    seq:
        Sequence number (increasing; gaps mean skipped frames in ``latest`` mode).
    slot:
        The slot the frame lives in.
    arrays:
        The published arrays, as ``cupy.ndarray`` views of the shared slot
        (no copy).  The current stream at :meth:`Subscriber.recv` already waits
        for the producer's writes.
    metadata:
        The user bytes sent with the frame.

    Notes
    -----
    Release the frame (:meth:`release`, or leave a ``with`` block) when done:
    the producer cannot reuse the slot before.  The lease is also returned
    when the frame and all of its arrays have been garbage collected.  Using
    the arrays after :meth:`release` is a bug: the producer may overwrite them.
    """

    __slots__ = ("_lease", "arrays", "metadata", "seq", "slot")

    def __init__(
        self, seq: int, slot: int, arrays: tuple[Any, ...], metadata: bytes, lease: _Lease
    ) -> None:
        self.seq = seq
        self.slot = slot
        self.arrays = arrays
        self.metadata = metadata
        self._lease = lease

    @property
    def array(self) -> Any:
        """The first (often only) array."""
        return self.arrays[0]

    @property
    def released(self) -> bool:
        """True once the lease was returned."""
        return self._lease.released

    def release(self, stream: Any = None) -> None:
        """Return the lease: record the read event on ``stream`` (default: current) and
        tell the producer.  Idempotent."""
        self._lease.release(stream)

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(a.shape)) for a in self.arrays)
        return f"Frame(seq={self.seq}, slot={self.slot}, arrays=[{shapes}])"


class Subscriber:
    """The consumer end of a channel; made by :func:`subscribe`."""

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        mode: str = "block",
        credit: int | None = None,
        device: int | None = None,
        timeout: float = 10.0,
        allowed_uids: Iterable[int] | None = None,
    ) -> None:
        cp = cupy_module()
        self._cp = cp
        self._rt = rt = cp.cuda.runtime
        self._closed = False
        self._frame_events: list[int] = []
        self._read_events: list[int] = []
        self._peer: PeerPool | None = None
        self._core = SubscriberCore(
            address, mode=mode, credit=credit, timeout=timeout, allowed_uids=allowed_uids
        )
        self._alive = select.poll()
        self._pidfd = -1
        try:
            if self._core.producer_pid > 0:
                # readable once the producer exits: frames still queued then must not be
                # used, their events died with it
                self._pidfd = os.pidfd_open(self._core.producer_pid)
                self._alive.register(self._pidfd, select.POLLIN)
            self._setup(device)
        except BaseException:
            self._teardown()
            raise
        self.mode = mode
        self.address = self._core.address
        self._finalizer = weakref.finalize(
            self,
            Subscriber._teardown_parts,
            self._core,
            rt,
            self._frame_events,
            self._read_events,
            self._peer,
            os.getpid(),
        )

    def _setup(self, device: int | None) -> None:
        core = self._core
        payload = core.welcome_payload
        fds = core.take_fds()
        try:
            n = core.num_slots
            if len(payload) < _WELCOME_HEAD.size:
                raise ProtocolError("WELCOME payload too short")
            desc_len, n_events = _WELCOME_HEAD.unpack_from(payload, 0)
            want = _WELCOME_HEAD.size + desc_len + 2 * n * EVENT_HANDLE_NBYTES
            if n_events != n or len(payload) != want:
                raise ProtocolError(
                    f"WELCOME payload of {len(payload)} bytes does not match {n} slots "
                    f"and a {desc_len}-byte descriptor"
                )
            pos = _WELCOME_HEAD.size
            try:
                desc = PoolDescriptor.from_bytes(payload[pos : pos + desc_len])
            except DescriptorError as exc:
                raise ProtocolError(f"bad pool descriptor in WELCOME: {exc}") from None
            if desc.num_slots != n or len(fds) != n:
                raise ProtocolError(
                    f"WELCOME announces {n} slots, the descriptor {desc.num_slots}, "
                    f"and carries {len(fds)} fds"
                )
            pos += desc_len
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._peer = peer = attach_fds(desc, fds, device=device)
        self._slots = peer._slots
        rt = self._rt
        with self._cp.cuda.Device(peer.device):
            for i in range(n):
                h = payload[pos + i * EVENT_HANDLE_NBYTES : pos + (i + 1) * EVENT_HANDLE_NBYTES]
                self._frame_events.append(rt.ipcOpenEventHandle(bytes(h)))
            pos += n * EVENT_HANDLE_NBYTES
            for i in range(n):
                h = payload[pos + i * EVENT_HANDLE_NBYTES : pos + (i + 1) * EVENT_HANDLE_NBYTES]
                self._read_events.append(rt.ipcOpenEventHandle(bytes(h)))

    # -- state --

    @property
    def peer(self) -> PeerPool:
        """The producer's pool as mapped in this process."""
        assert self._peer is not None
        return self._peer

    @property
    def producer_pid(self) -> int:
        """Pid of the publishing process."""
        return int(self._core.producer_pid)

    @property
    def held(self) -> dict[int, int]:
        """Frames received and not released, as ``{seq: slot}``."""
        return self._core.held

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    # -- hot path --

    def recv(self, timeout: float | None = None, stream: Any = None) -> Frame:
        """Wait for the next frame.

        ``stream`` (default: CuPy's current stream) is made to wait on the
        producer's frame event; the host does not block for the GPU.

        Raises
        ------
        EndOfStream
            The publisher closed (``clean`` True) or died (``clean`` False).
        TimeoutError
            No frame within ``timeout`` seconds.
        ProtocolError
            The publisher sent a malformed frame; the subscription is closed.
        """
        if self._closed:
            raise PoolClosedError("the Subscriber is closed")
        try:
            msg = self._core.recv(timeout)
        except ProtocolError:
            self.close()
            raise
        if self._alive.poll(0):
            self.close()
            raise EndOfStream(
                f"the publisher (pid {self._core.producer_pid}) exited; frames still queued "
                "are dropped (their events died with it)",
                False,
            )
        seq, slot, payload = msg.seq, msg.slot, msg.payload
        slots = self._slots
        lease = _Lease(self, seq, slot, SlotRef(slots, slots.refs, slot))
        try:
            if len(payload) < _FRAME_HEAD.size:
                raise ProtocolError(f"frame {seq}: payload too short")
            event, count, meta_len = _FRAME_HEAD.unpack_from(payload, 0)
            if event != slot:
                raise ProtocolError(f"frame {seq} in slot {slot} names event {event}")
            if count > MAX_ARRAYS or meta_len > MAX_METADATA:
                raise ProtocolError(f"frame {seq}: {count} arrays, {meta_len} metadata bytes")
            assert self._peer is not None
            try:
                arrays, pos = self._peer.arrays_from_wire(payload, _FRAME_HEAD.size, count, lease)
            except DescriptorError as exc:
                raise ProtocolError(f"frame {seq}: {exc}") from None
            if len(payload) - pos != meta_len:
                raise ProtocolError(f"frame {seq}: metadata length does not match")
        except ProtocolError:
            lease.released = True
            self.close()
            raise
        sptr = (self._cp.cuda.get_current_stream() if stream is None else stream).ptr
        self._rt.streamWaitEvent(sptr, self._frame_events[slot])
        return Frame(seq, slot, tuple(arrays), bytes(payload[pos:]), lease)

    def _release(self, seq: int, slot: int, stream: Any) -> None:
        if self._closed:
            return
        sptr = (self._cp.cuda.get_current_stream() if stream is None else stream).ptr
        self._rt.eventRecord(self._read_events[slot], sptr)
        with contextlib.suppress(EndOfStream):  # the producer is gone: nobody to return it to
            self._core.release(seq, slot)

    def __iter__(self) -> Iterator[Frame]:
        """Yield frames until the publisher closes.

        A clean close ends the iteration; a publisher that died raises
        :class:`EndOfStream` with ``clean=False``; a malformed message raises
        :class:`ProtocolError` and closes this subscriber.
        """
        while True:
            try:
                frame = self.recv()
            except EndOfStream as exc:
                if exc.clean:
                    return
                raise
            yield frame

    # -- teardown --

    def close(self) -> None:
        """Say goodbye and drop the mapping (once no frame's arrays use it).

        Idempotent; never raises.  Frames still alive keep their slots mapped
        until they are collected; their leases are not returned any more.
        """
        if self._closed:
            return
        self._closed = True
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        Subscriber._teardown_parts(
            self._core, self._rt, self._frame_events, self._read_events, self._peer, os.getpid()
        )

    @staticmethod
    def _teardown_parts(
        core: SubscriberCore,
        rt: Any,
        frame_events: list[int],
        read_events: list[int],
        peer: PeerPool | None,
        pid: int,
    ) -> None:
        core.close()
        if os.getpid() == pid:
            _destroy_events(rt, frame_events)
            _destroy_events(rt, read_events)
        frame_events.clear()
        read_events.clear()
        if peer is not None:
            peer.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def subscribe(
    address: str | os.PathLike[str],
    *,
    mode: str = "block",
    credit: int | None = None,
    device: int | None = None,
    timeout: float = 10.0,
    allowed_uids: Iterable[int] | None = None,
) -> Subscriber:
    """Connect to a :class:`Publisher` and map its pool; frames arrive with ``recv()``.

    Parameters
    ----------
    address:
        The publisher's socket path.
    mode:
        ``"block"``: receive every frame; the producer waits (with a timeout)
        for a free slot when this subscriber holds them all.  ``"latest"``:
        the producer never waits for this subscriber; frames published while
        it holds ``credit`` of them are skipped.
    credit:
        Most frames held at once (default 1 for ``latest``).
    device:
        Local GPU to map on (default: the producer's GPU, by UUID).
    timeout:
        Seconds for connecting and the handshake.
    allowed_uids:
        Uids the publisher may run as (default: this process's euid).

    Raises
    ------
    TransportError
        No publisher at ``address``, or no permission to connect.
    PeerRefusedError
        The publisher refused this subscriber (uid, capacity), or runs as a
        uid not allowed here.
    """
    return Subscriber(
        address, mode=mode, credit=credit, device=device, timeout=timeout, allowed_uids=allowed_uids
    )
