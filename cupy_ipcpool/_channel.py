"""Publish / subscribe frames between processes: leases, GPU-side ordering, backpressure.

The GPU layer over :mod:`cupy_ipcpool._session` (sockets, leases),
:mod:`cupy_ipcpool._peer` (imports) and :mod:`cupy_ipcpool._syncpage`
(cross-process ordering):

* the producer's :class:`Publisher` owns a :class:`SyncPage` of 32-bit flags
  in shared device memory.  The WELCOME message carries the pool descriptor,
  the slot fds and the page's fd, and the subscriber's index in the page.
* publishing makes the producer's stream write the slot's generation into the
  slot's frame flag (after the kernels that wrote the frame) and sends a FRAME
  message (seq, slot, flag index, generation, array handles, metadata); the
  subscriber's stream waits on that flag before its work touches the frame —
  the GPU waits, the host never does.
* releasing makes the subscriber's stream write the generation into its read
  flag for the slot and sends RELEASE; before the producer writes the slot
  again, its stream waits on the read flags of every subscriber that read it.
  A slot is reused only when all its leases are back and no local array
  refers to it.

See ``docs/protocol.md`` for the sequence diagram.
"""

from __future__ import annotations

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

from ._arrays import array_info, cupy_module, stream_ptr
from ._errors import (
    DescriptorError,
    EndOfStream,
    NotShareableError,
    PeerRefusedError,
    PoolClosedError,
    ProtocolError,
    TeardownWarning,
    UsageError,
)
from ._handles import ArrayHandle, PoolDescriptor
from ._peer import PeerPool, attach_fds
from ._pool import DEFAULT_TIMEOUT, IpcPool, SlotToken
from ._session import PublisherCore, SubscriberCore, SubscriberInfo
from ._syncpage import SyncPage
from ._transport import SCM_MAX_FD

#: Most bytes of user metadata per frame.
MAX_METADATA = 16384
#: Most arrays per frame.
MAX_ARRAYS = 64
#: Most slots a published pool may have: the WELCOME message carries one fd per
#: slot and the sync page's, in one ``SCM_RIGHTS`` message (``SCM_MAX_FD`` fds).
MAX_CHANNEL_SLOTS = SCM_MAX_FD - 1
#: Most streams a subscriber tracks before it forgets those with no work left.
_STREAMS_KEPT = 8

# WELCOME payload: descriptor length u32, num_slots u32, max_subscribers u32, this
# subscriber's index in the sync page u32, sync page bytes u64, then the descriptor.
# Its fds: one per slot, then the sync page's.
_WELCOME_HEAD = struct.Struct("<IIIIQ")
# FRAME payload: flag index u32 (the slot), generation u32 (low bits), number of
# arrays u16, metadata length u16, then the packed array handles, then the metadata.
_FRAME_HEAD = struct.Struct("<IIHH")


# ----------------------------------------------------------------------- producer


class PublishFrame:
    """The slot being written, from :meth:`Publisher.frame` (a slot token plus publish).

    Attributes
    ----------
    slot:
        The slot acquired for this frame (also ``pool.current``).
    generation:
        The slot's generation for this frame.
    token:
        The :class:`~cupy_ipcpool._pool.SlotToken` of the slot.
    seq:
        The sequence number once published, else None.
    """

    def __init__(self, publisher: Publisher, token: SlotToken, stream: Any) -> None:
        self._publisher = publisher
        self._stream = stream
        self.token = token
        self.slot = token.slot
        self.generation = token.generation
        self.seq: int | None = None

    def array(self, shape: Any, dtype: Any = "float32") -> Any:
        """A new ``cupy.ndarray`` carved out of this frame's slot (uninitialised).

        Several arrays of one frame do not overlap (they share the slot's arena
        with ``allocating()``).
        """
        return self.token.array(shape, dtype)

    def allocating(self, *, overflow: str = "raise") -> Any:
        """Place this thread's CuPy allocations in this frame's slot (``token.allocating``)."""
        return self.token.allocating(overflow=overflow)

    def publish(self, *arrays: Any, metadata: bytes = b"") -> int:
        """Publish ``arrays`` (all in this frame's slot) with ``metadata``.

        The frame flag is set on the stream given to :meth:`Publisher.frame`
        (default: CuPy's current stream at publish time).

        Returns
        -------
        int
            The frame's sequence number (also stored in :attr:`seq`).

        Raises
        ------
        UsageError
            The frame was published already.
        """
        if self.seq is not None:
            raise UsageError(f"frame in slot {self.slot} was already published as {self.seq}")
        self.seq = self._publisher.publish(*arrays, metadata=metadata, stream=self._stream)
        return self.seq

    def __enter__(self) -> PublishFrame:
        return self

    def __exit__(self, *exc: object) -> None:
        self._publisher._end_write(self.token)


class _PublisherLeases:
    """The publisher's side of the pool's lease-source protocol (``IpcPool.add_lease_source``).

    Counts the subscribers' leases from the session's lease book, collects
    returned leases from their sockets, and orders a new writer's stream after
    the read flags of the subscribers that read the slot.
    """

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = weakref.ref(publisher)
        self.lock = threading.RLock()  # serialises the (single-threaded) session core

    def leases(self, slot: int) -> int:
        pub = self._publisher()
        return 0 if pub is None or pub._closed else len(pub._book.leases(slot))

    def collect(self, timeout: float | None) -> int:
        pub = self._publisher()
        if pub is None or pub._closed:
            return 0
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            return 0
        try:
            return pub._core.poll(timeout) if not pub._core.closed else 0
        finally:
            self.lock.release()

    def order_write(self, slot: int, stream: int) -> None:
        pub = self._publisher()
        if pub is not None and not pub._closed:
            pub._order_write(slot, stream)

    def describe(self, slot: int) -> str:
        pub = self._publisher()
        if pub is None:
            return ""
        infos = {info.sub_id: info for info in pub._core.subscribers}
        parts = []
        for sub_id, _seq in pub._book.leases(slot):
            info = infos.get(sub_id)
            who = f"pid {info.pid}, {info.mode}" if info is not None else "gone"
            parts.append(f"subscriber {sub_id}, {who}")
        return "; ".join(parts)


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
    max_credit:
        Cap on a subscriber's credit (default: ``num_slots - 2``, at least 1);
        ``"latest"`` subscribers never make the producer wait, whatever they ask.
    lease_timeout:
        Seconds a subscriber may hold a frame before it is evicted (its next
        call raises :class:`~cupy_ipcpool.EvictedError`); None: no limit.

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
        max_credit: int | None = None,
        lease_timeout: float | None = None,
    ) -> None:
        n = pool.num_slots
        if n > MAX_CHANNEL_SLOTS:
            raise UsageError(
                f"a channel carries at most {MAX_CHANNEL_SLOTS} slots (one fd per slot in one "
                f"SCM_RIGHTS message); this pool has {n}"
            )
        cp = cupy_module()
        self._cp = cp
        self._pool = pool
        self._device = pool.device
        self._lock = threading.Lock()
        self._indices: dict[int, int] = {}  # sub_id -> row of read flags in the sync page
        self._next_index = 0
        self._max_subscribers = max_subscribers
        self._closed = False
        self._token: SlotToken | None = None  # the slot being written
        self._published = [0] * n  # generation of each slot's last published frame
        desc = pool.descriptor(transport="pidfd").to_bytes()  # raises if the pool is closed
        self._sync = sync = SyncPage.create(n, max_subscribers, self._device)
        self._desc_bytes = desc
        self._welcome_fds = [pool.fd(i) for i in range(n)] + [sync.fd]
        try:
            self._core = PublisherCore(
                address,
                n,
                welcome=self._welcome,
                allowed_uids=allowed_uids,
                on_leave=self._on_leave,
                max_subscribers=max_subscribers,
                send_timeout=send_timeout,
                max_credit=max_credit,
                lease_timeout=lease_timeout,
            )
        except BaseException:
            sync.close()
            raise
        self.address = self._core.address
        self._book = self._core.lease_book
        self._leases = _PublisherLeases(self)
        pool.add_lease_source(self._leases)
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(
            self, _close_publisher, self._core, sync, pool, self._leases, self._pid
        )

    # -- accept thread / callbacks --

    def _welcome(self, info: SubscriberInfo) -> tuple[bytes, list[int]]:
        # Rows are handed out round-robin, so a departed subscriber's row is reused
        # as late as possible (its last flag writes may still be in flight).
        with self._lock:
            used = set(self._indices.values())
            for step in range(self._max_subscribers):
                index = (self._next_index + step) % self._max_subscribers
                if index not in used:
                    break
            else:
                raise PeerRefusedError("no free subscriber row in the sync page")
            self._next_index = index + 1
            self._indices[info.sub_id] = index
        head = _WELCOME_HEAD.pack(
            len(self._desc_bytes),
            self._pool.num_slots,
            self._max_subscribers,
            index,
            self._sync.alloc.size,
        )
        return head + self._desc_bytes, self._welcome_fds

    def _on_leave(self, info: SubscriberInfo) -> None:
        with self._lock:
            self._indices.pop(info.sub_id, None)

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

    def _order_write(self, slot: int, stream: int) -> None:
        """Make ``stream`` wait for the read flags of every subscriber that read ``slot``."""
        with self._leases.lock:
            readers = self._book.readers_to_wait(slot)
        if not readers:
            return
        # every reader wrote the generation it was sent into its read flag on release
        last = self._published[slot]
        sync = self._sync
        with self._lock:
            rows = [self._indices.get(sub_id) for sub_id in readers]
        for index in rows:
            if index is not None:
                sync.wait(stream, sync.read_flag(index, slot), last)

    def _end_write(self, token: SlotToken) -> None:
        token.release()
        if self._token is token:
            self._token = None

    # -- hot path --

    def acquire(self, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None) -> int:
        """Take a free slot for the next frame and make it the pool's current slot.

        The same call as ``pool.acquire(timeout=timeout, stream=stream)``: a
        slot is free when no subscriber holds a lease on it, no local array
        refers to it and no other token writes it.  ``stream`` (default:
        CuPy's current stream) is made to wait (on the GPU) for the read flags
        of every subscriber that read the slot, so work enqueued on it
        afterwards cannot overwrite data a reader is still using; the host
        does not block.  A slot acquired before and not published is given
        back first.

        Returns
        -------
        int
            The slot.

        Raises
        ------
        SlotBusyError
            No slot became free within ``timeout`` seconds (``block``
            subscribers hold them, or local arrays do); the message says who.
        """
        return self._acquire(timeout, stream).slot

    def _acquire(self, timeout: float | None, stream: Any) -> SlotToken:
        self._check()
        previous = self._token
        if previous is not None:
            self._end_write(previous)
        token = self._pool.acquire(timeout=timeout, stream=stream)
        self._token = token
        return token

    def frame(self, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None) -> PublishFrame:
        """:meth:`acquire` a slot and return a :class:`PublishFrame` for it.

        Use as ``with pub.frame() as f: ...; f.publish(y)``; allocations under
        ``f.allocating()`` (or ``pool.allocating()``) inside the block land in
        ``f.slot``.  Leaving the block without publishing gives the slot back.
        """
        return PublishFrame(self, self._acquire(timeout, stream), stream)

    def publish(self, *arrays: Any, metadata: bytes = b"", stream: Any = None) -> int:
        """Publish ``arrays`` (all in the slot taken by :meth:`acquire`) as one frame.

        Makes ``stream`` (default: CuPy's current stream; it must be the stream
        that wrote the arrays, or one ordered after it) set the slot's frame
        flag after that work, and sends the frame to the subscribers that take it.

        Returns
        -------
        int
            The frame's sequence number.

        Raises
        ------
        NotShareableError
            An array does not lie in the acquired slot, or is no device array.
        UsageError
            No slot was acquired, too many arrays or too much metadata.
        """
        if self._closed:
            raise PoolClosedError("the Publisher is closed")
        token = self._token
        if token is None:
            raise UsageError(
                "publish() needs a slot taken with acquire() or frame() first; a slot can be "
                "published once per acquire"
            )
        if len(arrays) > MAX_ARRAYS:
            raise UsageError(f"at most {MAX_ARRAYS} arrays per frame, got {len(arrays)}")
        metadata = bytes(metadata)
        if len(metadata) > MAX_METADATA:
            raise UsageError(f"metadata is {len(metadata)} bytes; at most {MAX_METADATA}")
        pool = self._pool
        slot = token.slot
        base = pool.ptr(slot)
        limit = pool.slot_nbytes
        generation = token.generation
        parts = [_FRAME_HEAD.pack(slot, generation & 0xFFFFFFFF, len(arrays), len(metadata))]
        for a in arrays:
            info = array_info(a)
            offset = info.ptr - base
            if not 0 <= offset < limit:
                where = pool.locate(info.ptr)
                raise NotShareableError(
                    f"array lies in slot {where[0]}, but this frame was acquired in slot {slot}"
                    if where is not None
                    else "array does not lie in the pool; allocate it with frame.array() or "
                    "under pool.allocating()"
                )
            try:
                handle = ArrayHandle(slot, generation, offset, info.shape, info.strides, info.dtype)
                handle.check_fits(limit)
            except DescriptorError as exc:
                raise NotShareableError(f"array extends beyond slot {slot}: {exc}") from None
            parts.append(handle.pack())
        parts.append(metadata)
        sptr = stream_ptr(stream)
        self._sync.write(sptr, self._sync.frame_flag(slot), generation)
        self._published[slot] = generation
        with self._leases.lock:
            seq = self._core.publish(slot, b"".join(parts))
        self._end_write(token)
        return seq

    def poll(self, timeout: float | None = 0.0) -> int:
        """Adopt new subscribers and collect returned leases; return how many came back.

        Returns as soon as a message from a subscriber has been handled (a
        returned lease, a goodbye), or after ``timeout`` seconds (``None``:
        no limit; ``0``: do not wait).  Threads waiting in ``pool.acquire()``
        or ``pool.next()`` are woken when leases came back.
        """
        self._check()
        returned = self._leases.collect(timeout)
        self._pool.notify_released()
        return returned

    def leases(self, slot: int) -> int:
        """Number of subscriber leases on ``slot``."""
        return len(self._book.leases(slot))

    # -- teardown --

    def close(self, timeout: float = 5.0) -> None:
        """Say goodbye to every subscriber, close the socket, free the sync page.

        Subscribers get a clean end of stream after the frames already sent;
        frames they hold stay readable (they mapped the memory themselves).
        ``close`` waits up to ``timeout`` seconds for every subscriber to
        disconnect, because their streams may still write and wait on the
        shared sync page until then.  If some are still connected after that,
        the page is kept mapped (leaked, with a :class:`TeardownWarning`)
        rather than freed under them.  Idempotent; never raises.
        """
        if self._closed:
            return
        self._closed = True
        all_gone = self._core.close(linger=timeout)
        if not all_gone:
            warnings.warn(
                f"subscribers still connected {timeout} s after the publisher said goodbye; "
                "the shared sync page is kept mapped (leaked) rather than freed under them",
                TeardownWarning,
                stacklevel=2,
            )
        self._finalizer.detach()
        _close_publisher(
            self._core, self._sync if all_gone else None, self._pool, self._leases, self._pid
        )

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
    sync: SyncPage | None,
    pool: IpcPool,
    leases: _PublisherLeases,
    pid: int,
) -> None:
    try:
        all_gone = core.close()
    except Exception as exc:  # pragma: no cover - core.close never raises
        warnings.warn(f"closing the publisher socket failed: {exc}", TeardownWarning, stacklevel=2)
        all_gone = False
    pool.remove_lease_source(leases)
    # Subscribers may still wait on the page for frames queued before the BYE:
    # freeing it under them would be a dangling mapping, so it is leaked instead.
    if sync is not None and all_gone and os.getpid() == pid:
        sync.close()


# ----------------------------------------------------------------------- consumer


class _StreamsInUse:
    """Streams a subscriber enqueued flag operations on, which may still run them.

    Closing the subscriber synchronizes these before it unmaps the sync page.
    The set stays small: when it reaches ``_STREAMS_KEPT`` entries, streams
    with no work left (``cudaStreamQuery``) are forgotten.  The stream objects
    are kept, so that a CuPy or torch stream is not destroyed while tracked.
    """

    __slots__ = ("_streams",)

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def note(self, ptr: int, stream: Any) -> None:
        streams = self._streams
        if ptr in streams:
            return
        if len(streams) >= _STREAMS_KEPT:
            rt = cupy_module().cuda.runtime
            for known in list(streams):
                try:
                    idle = rt.streamQuery(known) == 0
                except Exception:  # not a valid stream any more: nothing to wait for
                    idle = True
                if idle:
                    del streams[known]
        streams[ptr] = stream

    def __len__(self) -> int:
        return len(self._streams)

    def synchronize(self) -> None:
        rt = cupy_module().cuda.runtime
        streams, self._streams = self._streams, {}
        for ptr in streams:
            rt.streamSynchronize(ptr)

    def clear(self) -> None:
        self._streams.clear()


class _Lease:
    """Owner of a received frame's arrays: returns the lease when released or collected.

    It also pins the mapped slot (``pin``), so closing the subscriber never
    unmaps memory that a frame's arrays still use.
    """

    __slots__ = ("__weakref__", "generation", "pin", "released", "seq", "slot", "subscriber")

    def __init__(
        self, subscriber: Subscriber, seq: int, slot: int, generation: int, pin: object
    ) -> None:
        self.subscriber = subscriber
        self.seq = seq
        self.slot = slot
        self.generation = generation
        self.pin = pin
        self.released = False

    def release(self, stream: Any = None) -> None:
        if self.released:
            return
        self.released = True
        self.subscriber._release(self.seq, self.slot, self.generation, stream)

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
        """Return the lease: set the read flag on ``stream`` (default: current) and
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
        self._closed = False
        self._peer: PeerPool | None = None
        self._sync: SyncPage | None = None
        self._index = 0
        self._streams = _StreamsInUse()  # streams this subscriber enqueued flag operations on
        self._core = SubscriberCore(
            address, mode=mode, credit=credit, timeout=timeout, allowed_uids=allowed_uids
        )
        self._alive = select.poll()
        self._pidfd = -1
        try:
            if self._core.producer_pid > 0:
                # readable once the producer exits: frames still queued then must not be
                # used, their flags will never be written
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
            _teardown_subscriber,
            self._core,
            self._sync,
            self._peer,
            self._pidfd,
            self._streams,
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
            desc_len, n_slots, max_subs, index, sync_nbytes = _WELCOME_HEAD.unpack_from(payload)
            if (
                n_slots != n
                or len(payload) != _WELCOME_HEAD.size + desc_len
                or not 0 <= index < max_subs <= 1 << 16
                or len(fds) != n + 1
            ):
                raise ProtocolError(
                    f"WELCOME does not add up: {n_slots} slots (session says {n}), "
                    f"{len(payload)} payload bytes for a {desc_len}-byte descriptor, "
                    f"row {index} of {max_subs}, {len(fds)} fds"
                )
            try:
                desc = PoolDescriptor.from_bytes(payload[_WELCOME_HEAD.size :])
            except DescriptorError as exc:
                raise ProtocolError(f"bad pool descriptor in WELCOME: {exc}") from None
            if desc.num_slots != n:
                raise ProtocolError(f"WELCOME announces {n} slots, the descriptor {desc.num_slots}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        sync_fd = fds.pop()
        try:
            self._peer = peer = attach_fds(desc, fds, device=device)
            self._sync = SyncPage.import_fd(sync_fd, sync_nbytes, n, max_subs, peer.device)
        finally:
            os.close(sync_fd)
        self._index = index

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
        producer's frame flag (on the GPU); the host does not block.

        Raises
        ------
        EvictedError
            The publisher evicted this subscriber (it held a frame longer than
            the publisher's ``lease_timeout``, or its socket stayed full): the
            frames it holds may be overwritten; subscribe again.  A subclass of
            :class:`EndOfStream` with ``clean`` False.
        EndOfStream
            The publisher closed (``clean`` True) or died (``clean`` False).
        ChannelTimeoutError
            No frame within ``timeout`` seconds (also a ``TimeoutError``).
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
                "are dropped (their flags will never be set)",
                False,
            )
        seq, slot, payload = msg.seq, msg.slot, msg.payload
        try:
            if len(payload) < _FRAME_HEAD.size:
                raise ProtocolError(f"frame {seq}: payload too short")
            flag, generation, count, meta_len = _FRAME_HEAD.unpack_from(payload, 0)
            if flag != slot:
                raise ProtocolError(f"frame {seq} in slot {slot} names flag {flag}")
            if count > MAX_ARRAYS or meta_len > MAX_METADATA:
                raise ProtocolError(f"frame {seq}: {count} arrays, {meta_len} metadata bytes")
            assert self._peer is not None
            lease = _Lease(self, seq, slot, generation, self._peer.pin(slot))
            try:
                arrays, pos = self._peer.arrays_from_wire(payload, _FRAME_HEAD.size, count, lease)
            except DescriptorError as exc:
                lease.released = True
                raise ProtocolError(f"frame {seq}: {exc}") from None
            if len(payload) - pos != meta_len:
                lease.released = True
                raise ProtocolError(f"frame {seq}: metadata length does not match")
        except ProtocolError:
            self.close()
            raise
        if stream is None:
            stream = self._cp.cuda.get_current_stream()
        sptr = stream_ptr(stream)
        self._streams.note(sptr, stream)
        sync = self._sync
        assert sync is not None
        sync.wait(sptr, sync.frame_flag(slot), generation)
        return Frame(seq, slot, tuple(arrays), bytes(payload[pos:]), lease)

    def _release(self, seq: int, slot: int, generation: int, stream: Any) -> None:
        if self._closed:
            return
        if stream is None:
            stream = self._cp.cuda.get_current_stream()
        sptr = stream_ptr(stream)
        self._streams.note(sptr, stream)
        sync = self._sync
        assert sync is not None
        sync.write(sptr, sync.read_flag(self._index, slot), generation)
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
        _teardown_subscriber(
            self._core, self._sync, self._peer, self._pidfd, self._streams, os.getpid()
        )

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _teardown_subscriber(
    core: SubscriberCore,
    sync: SyncPage | None,
    peer: PeerPool | None,
    pidfd: int,
    streams: _StreamsInUse,
    pid: int,
) -> None:
    """Close a subscriber (also its finalizer); never raises."""
    core.close()
    if os.getpid() != pid:
        return
    producer_alive = True
    if pidfd >= 0:
        producer_alive = not select.select([pidfd], [], [], 0)[0]
        with contextlib.suppress(OSError):
            os.close(pidfd)
    # Flag operations still queued on our streams must not hit an unmapped page.
    # If the producer died, a queued wait may never be satisfied: keep the page
    # mapped (leaked) rather than block here forever or unmap it under the GPU.
    if sync is not None and producer_alive:
        try:
            streams.synchronize()
            sync.close()
        except Exception as exc:
            warnings.warn(f"closing the sync page failed: {exc}", TeardownWarning, stacklevel=2)
    streams.clear()
    if peer is not None:
        peer.close()


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
