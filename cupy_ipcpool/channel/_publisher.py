"""The producer side of the channel: :class:`Publisher` and :class:`PublishFrame`.

The GPU layer over :mod:`cupy_ipcpool.channel._session` (sockets, leases),
:mod:`cupy_ipcpool._peer` (imports) and :mod:`cupy_ipcpool.channel._syncpage`
(cross-process ordering):

* the producer's :class:`Publisher` owns a :class:`SyncPage` of 32-bit flags
  in shared host memory, registered for the GPU.  The WELCOME message carries the pool descriptor,
  the slot fds and the page's fd, and the subscriber's index in the page.
* publishing makes the producer's stream write the slot's generation into the
  slot's frame flag (after the kernels that wrote the frame) and sends a FRAME
  message (seq, slot, flag index, generation, array handles, metadata); the
  subscriber's stream waits on that flag before its work touches the frame —
  the GPU waits, the host never does (and where the host sees the flag set
  already, nobody waits).
* releasing makes the subscriber's stream write the generation into its read
  flag for the slot and sends RELEASE; before the producer writes the slot
  again, its stream waits on the read flags of every subscriber that read it.
  A slot is reused only when all its leases are back and no local array
  refers to it.

See ``docs/wire.md`` for the sequence of messages and ``docs/protocol.md`` for the guide.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, overload

from .._args import deprecated, keyword_only_signature, moved_to_keywords
from .._arrays import cupy_module, stream_ptr
from .._errors import (
    PoolClosedError,
    TeardownWarning,
    UsageError,
)
from .._handles import ArrayHandle
from .._pool import DEFAULT_TIMEOUT, IpcPool, SlotToken
from .._transport._closing import ClosedFlag
from ._handshake import SubscriberInfo, Welcome
from ._payload import (
    FRAME_HEAD,
    FRAME_VOID,
    MAX_ARRAYS,
    MAX_CHANNEL_SLOTS,
    MAX_METADATA,
    WELCOME_HEAD,
    WELCOME_ROW_AT,
)
from ._publisher_core import PublisherCore
from ._settle import CLOSE_GRACE, PageStreams, reader_rows, settle_page
from ._syncpage import SyncPage

#: What a publisher refuses, by subscriber mode: one that keeps no fixed slot schedule, and
#: one that does (``ahead=True``), for which a ``"latest"`` subscriber would make it wait.
_BLOCK_REFUSES = {
    "ahead": "this publisher keeps no fixed slot schedule: 'ahead' subscribers need a "
    "Publisher made with ahead=True (subscribe with mode='block')"
}
_AHEAD_REFUSES = {
    "latest": "this publisher keeps a fixed slot schedule (ahead=True), for which a "
    "'latest' subscriber would make it wait: subscribe with mode='block' or 'ahead'"
}
_TEMPLATES = 1024  # most array geometries whose wire form a publisher keeps

#: Sync pages kept mapped because a live subscriber's read flag was still awaited by
#: one of the publisher's streams when it closed: never unmapped while registered.
_KEPT_PAGES: list[SyncPage] = []


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

    def array(self, shape: Any, dtype: Any = "float64") -> Any:
        """A new ``cupy.ndarray`` in this frame's slot (uninitialised), as ``cupy.empty``.

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
        # frame()'s stream is the token's: its pointer is known (default: the current
        # stream at publish time)
        raw = None if self._stream is None else self.token.stream_ptr
        self.seq = self._publisher._publish(arrays, metadata, self._stream, raw)
        return self.seq

    def __enter__(self) -> PublishFrame:
        return self

    def __exit__(self, *exc: object) -> None:
        self._publisher._give_back(self.token)


class _PublisherLeases:
    """The publisher's side of the pool's lease-source protocol (``IpcPool.add_lease_source``).

    Counts the subscribers' leases from the session's lease book, collects
    returned leases from their sockets, and orders a new writer's stream after
    the read flags of the subscribers that read the slot.
    """

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = weakref.ref(publisher)
        self._book = publisher._book
        self._core = publisher._core
        # the publisher's per-frame state, shared (not copied): what order_write needs
        self._published = publisher._published
        self._rows = publisher._rows
        self._read_flag = publisher._sync.read_flag
        self._order_all = publisher._sync.order_all
        self._settle = weakref.WeakMethod(publisher._settle_departed)  # no cycle to it
        self._streams = publisher._streams
        # ahead=True: a lease also ends when its read flag is seen set (PublisherCore.settle)
        self._by_flags = publisher._ahead
        self.closed = False  # set by the publisher's close
        self.lock = threading.RLock()  # serialises the (single-threaded) session core

    def leases(self, slot: int) -> int:
        if self.closed:
            return 0
        count = self._book.lease_count(slot)
        if count and self._by_flags and self.lock.acquire(blocking=False):
            try:
                self._core.settle(slot)
                count = self._book.lease_count(slot)
            finally:
                self.lock.release()
        return count

    def collect(self, timeout: float | None) -> int:
        """Adopt new subscribers and take back returned leases (:meth:`PublisherCore.poll`)."""
        if self.closed or self._core.closed:
            return 0
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            return 0
        try:
            if self._core.closed:
                return 0
            return self._core.poll(timeout, self._by_flags)
        finally:
            self.lock.release()

    def order_write(self, slot: int, stream: int) -> None:
        """Make ``stream`` wait for the read flags of every subscriber that read ``slot``."""
        if self.closed:
            return
        if self._rows.departed:
            settle = self._settle()
            if settle is not None:
                settle()
        with self.lock:
            readers = self._book.readers_to_wait(slot)
        if not readers:
            return
        # every reader wrote the generation it was sent into its read flag on release;
        # order_all skips the flags the host sees set already (the usual case with one
        # subscriber: the slot was read a whole ring ago)
        rows = self._rows
        addrs = [self._read_flag(i, slot) for i in map(rows.index, readers) if i is not None]
        if addrs and self._order_all(stream, addrs, self._published[slot]):
            self._streams.note(stream)

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


class Publisher(ClosedFlag):
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
        Further subscribers are refused (1..65536: the sync page's rows).
    send_timeout:
        How long a ``"block"`` subscriber's full socket may stall a publish
        before it is dropped.
    max_credit:
        Cap on a subscriber's credit (default: ``num_slots - 2``, at least 1);
        ``"latest"`` subscribers never make the producer wait, whatever they ask.
    lease_timeout:
        Seconds a subscriber may hold a frame before it is evicted (its next
        call raises :class:`~cupy_ipcpool.EvictedError`); None: no limit.
    spin_us:
        Microseconds :meth:`poll` (and a waiting ``acquire``) busy-polls the
        subscribers' sockets (with ``ahead=True``, and their read flags) before
        sleeping, in one engine call that holds the GIL meanwhile (other
        threads wait up to ``spin_us``); default 0 (no CPU while waiting).
        See docs/performance.md for what it buys.
    ahead:
        Keep a fixed schedule, so that ``"ahead"`` subscribers can take frames
        before their FRAME messages (docs/protocol.md, "Frames handed out
        ahead"): frame *k + 1* is written in the slot after frame *k*'s
        (round-robin, waiting for exactly that slot), every frame has the
        array layout of the first (another layout, or none, raises
        :class:`~cupy_ipcpool.UsageError`), and a frame taken and not published is
        sent as a *void* frame (no arrays; its subscribers' ``Frame.complete``
        is False).  Every write to the pool goes through this publisher.  A
        lease also ends when the host sees the subscriber's read flag at the
        frame's generation (its stream writes it at ``release()``, after its
        work), before the RELEASE message an ``"ahead"`` subscriber sends only
        at its next ``recv()``; a wait with no message looks at the flags
        again after 20 us, each step 1.25 times the last, up to every 16 ms
        (every round of ``spin_us``).  The publisher also takes an
        ``"ahead"`` subscriber's RELEASE of a frame not published yet, where
        the schedule puts it (the lease then ends as it is published).
        ``"latest"`` subscribers are refused (a fixed slot order would make
        the producer wait for them).  Default False: ``"ahead"`` subscribers
        are refused.

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
        spin_us: float = 0.0,
        ahead: bool = False,
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
        self._max_subscribers = max_subscribers
        self._closed = False
        self._token: SlotToken | None = None  # the slot being written
        # ahead=True: the slot the next frame must take, and the layout every frame has
        # (the wire form of each array after its slot and generation)
        self._ahead = bool(ahead)
        self._next_slot: int | None = None
        self._layout: tuple[bytes, ...] | None = None
        self._published = [0] * n  # generation of each slot's last published frame
        self._streams = PageStreams()  # streams with flag operations on the page
        desc = pool.descriptor(transport="pidfd").to_bytes()  # raises if the pool is closed
        self._sync = sync = SyncPage.create(n, max_subscribers, self._device)
        # each subscriber's row of read flags, and the rows of those that left while our
        # streams may still wait on their flags (c/src/reader_rows.c); given out (round-robin,
        # so a departed subscriber's row is reused as late as possible) and written into the
        # WELCOME by the accept thread, under the GIL; otherwise under self._lock
        self._rows = reader_rows(sync.flags, sync.layout)
        try:
            self._core = PublisherCore(
                address,
                n,
                welcome=Welcome(
                    WELCOME_HEAD.pack(len(desc), n, max_subscribers, 0, sync.nbytes) + desc,
                    (*(pool.fd(i) for i in range(n)), sync.fd),
                    rows=self._rows,
                    row_at=WELCOME_ROW_AT,
                    refuse=_AHEAD_REFUSES if self._ahead else _BLOCK_REFUSES,
                ),
                allowed_uids=allowed_uids,
                on_join=self._on_join,
                on_leave=self._on_leave,
                max_subscribers=max_subscribers,
                send_timeout=send_timeout,
                max_credit=max_credit,
                lease_timeout=lease_timeout,
                spin_us=spin_us,
            )
            # the engine reads the subscribers' read flags from the page's host mapping
            self._core.read_flags(sync.flags.mapping, sync.layout.reads_offset, max_subscribers)
        except BaseException:
            if hasattr(self, "_core"):
                self._core.close()  # lets go of the page
            self._rows.release_page()
            sync.close()
            raise
        # per-frame lookups, made once: the slots' and flags' addresses, and the
        # validated wire form of each array geometry published (see publish)
        self._ptrs = [pool.ptr(i) for i in range(n)]
        self._frame_flags = [sync.frame_flag(i) for i in range(n)]
        self._write_flag = sync.write
        self._templates: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        self.address = self._core.address
        self._book = self._core.lease_book
        self._leases = _PublisherLeases(self)
        pool.add_lease_source(self._leases)
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(
            self,
            _close_publisher,
            self._core,
            sync,
            pool,
            self._leases,
            self._pid,
            _PageState(self),
            CLOSE_GRACE,
        )

    # -- accept thread / callbacks --

    def _on_join(self, info: SubscriberInfo) -> None:
        with self._lock:
            self._rows.adopt(info.sub_id)
            index = self._rows.index(info.sub_id)
        if index is not None:  # its read flags: where the engine looks when it settles
            self._core.set_row(info.sub_id, index)

    def _on_leave(self, info: SubscriberInfo) -> None:
        # Our streams may wait on the read flags of a subscriber that read frames (it
        # was adopted): the engine writes them if it is dead, and keeps its row among
        # the departed while it lives and a stream of ours may still wait on it.
        with self._lock:
            if self._sync.flags.closed:
                return
            self._rows.leave(info.sub_id, self._published, self._streams.idle())

    def _settle_departed(self) -> None:
        """Look (at most every 10 ms) whether departed subscribers died or wrote their flags,
        or whether our streams have run past every wait (then none waits on them)."""
        with self._lock:
            if self._rows.due():
                self._rows.settle(self._streams.idle())

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
    def evictions(self) -> int:
        """Subscribers evicted so far (``lease_timeout`` passed, or a full socket)."""
        return int(self._core.evictions)

    def _check(self) -> None:
        if self._closed:
            raise PoolClosedError("the Publisher is closed")

    def _end_write(self, token: SlotToken) -> None:
        token.release()
        if self._token is token:
            self._token = None

    def _give_back(self, token: SlotToken) -> None:
        """A slot taken and not published: give it back (``ahead``: publish it void)."""
        if self._ahead and self._token is token and not self._closed:
            # "ahead" subscribers may already have handed this frame out: it is sent,
            # with no arrays, so that their waits on its flag end and they know
            self._publish((), b"", None, token.stream_ptr, void=True)
        else:
            self._end_write(token)

    def _take(self, timeout: float | None, stream: Any) -> SlotToken:
        """The pool's next slot for a frame (``ahead``: exactly the one after the last)."""
        previous = self._token
        if previous is not None:
            self._give_back(previous)
        if self._ahead and self._next_slot is not None:
            token = self._pool.acquire(timeout=timeout, stream=stream, slot=self._next_slot)
        else:
            token = self._pool.acquire(timeout=timeout, stream=stream)
        self._token = token
        return token

    # -- hot path --

    @overload
    def acquire(self, *, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None) -> int: ...
    @overload
    @deprecated("pass timeout by keyword: acquire(timeout=...)")
    def acquire(
        self, *args: Any, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None
    ) -> int: ...
    @keyword_only_signature
    def acquire(
        self, *args: Any, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None
    ) -> int:
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
        if args:
            (timeout,) = moved_to_keywords(Publisher.acquire, args, timeout=timeout)
        return self._acquire(timeout, stream).slot

    def _acquire(self, timeout: float | None, stream: Any) -> SlotToken:
        self._check()
        return self._take(timeout, stream)

    @overload
    def frame(
        self, *, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None
    ) -> PublishFrame: ...
    @overload
    @deprecated("pass timeout by keyword: frame(timeout=...)")
    def frame(
        self, *args: Any, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None
    ) -> PublishFrame: ...
    @keyword_only_signature
    def frame(
        self, *args: Any, timeout: float | None = DEFAULT_TIMEOUT, stream: Any = None
    ) -> PublishFrame:
        """:meth:`acquire` a slot and return a :class:`PublishFrame` for it.

        Use as ``with pub.frame() as f: ...; f.publish(y)``; allocations under
        ``f.allocating()`` (or ``pool.allocating()``) inside the block land in
        ``f.slot``.  Leaving the block without publishing gives the slot back
        (with ``ahead=True`` it is published as a void frame).
        """
        if args:
            (timeout,) = moved_to_keywords(Publisher.frame, args, timeout=timeout)
        if self._closed:
            raise PoolClosedError("the Publisher is closed")
        return PublishFrame(self, self._take(timeout, stream), stream)

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
        return self._publish(arrays, metadata, stream, None)

    def _publish(
        self,
        arrays: tuple[Any, ...],
        metadata: bytes,
        stream: Any,
        stream_raw: int | None,
        void: bool = False,
    ) -> int:
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
        if type(metadata) is not bytes:
            metadata = bytes(metadata)
        if len(metadata) > MAX_METADATA:
            raise UsageError(f"metadata is {len(metadata)} bytes; at most {MAX_METADATA}")
        slot = token.slot
        generation = token.generation
        base = self._ptrs[slot]
        gen = ArrayHandle.pack_generation(generation)
        flag = slot | FRAME_VOID if void else slot  # a void frame is marked on the wire
        parts = [FRAME_HEAD.pack(flag, generation & 0xFFFFFFFF, len(arrays), len(metadata))]
        ndarray = self._cp.ndarray
        templates = self._templates
        # the pool keeps each slot's reusable view for the publisher (IpcPool._kept_view)
        view = self._pool._kept_view(slot) if arrays else None
        for a in arrays:
            if view is not None and a is view.array:
                # the slot's reusable view (token.array's usual answer): its wire form
                # is kept on it, for as long as the pool keeps the view
                parts_of = view.wire
                if parts_of is None:
                    parts_of = view.wire = token.handle(a).pack_parts()
            elif type(a) is ndarray:
                # the common case: a CuPy array of a geometry published before
                key = (slot, a.data.ptr - base, a.shape, a.strides, a.dtype)
                parts_of = templates.get(key)
                if parts_of is None:
                    parts_of = token.handle(a).pack_parts()
                    if len(templates) >= _TEMPLATES:
                        templates.clear()
                    templates[key] = parts_of
            else:
                parts_of = token.handle(a).pack_parts()
            parts.append(parts_of[0])
            parts.append(gen)
            parts.append(parts_of[1])
        parts.append(metadata)
        if self._ahead:
            self._keep_schedule(slot, arrays, parts, void)
        sptr = stream_ptr(stream) if stream_raw is None else stream_raw
        self._write_flag(sptr, self._frame_flags[slot], generation)
        if sptr not in self._streams.ptrs:
            self._streams.note(sptr)
        # an "ahead" subscriber predicts the slot's next generation as the last + 1 and may
        # release the frame before it comes: that RELEASE ends the lease at once only if so
        scheduled = generation == self._published[slot] + 1
        self._published[slot] = generation
        with self._leases.lock:
            seq = self._core.publish(slot, b"".join(parts), scheduled, generation)
        self._end_write(token)
        if self._ahead:
            self._next_slot = (slot + 1) % len(self._ptrs)
        return seq

    def _keep_schedule(
        self, slot: int, arrays: tuple[Any, ...], parts: list[bytes], void: bool
    ) -> None:
        """``ahead``: raise, before anything is written or sent, if this frame breaks the
        schedule subscribers rely on (a layout other than the first frame's)."""
        if void:
            return  # a frame taken and not published: no arrays to lay out
        if not arrays:
            raise UsageError(
                "with ahead=True every frame has the arrays of the first; a frame without "
                "arrays is how subscribers learn that a frame was taken and not published "
                "(void, Frame.complete False): publish the arrays, or leave the frame block "
                "without publishing"
            )
        # parts: FRAME head, then per array (slot, generation, the rest of its wire form)
        layout = tuple(parts[3::3])
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise UsageError(
                f"with ahead=True every frame has the layout of the first (the same arrays at "
                f"the same offsets, shapes, strides and dtypes); this frame in slot {slot} "
                "differs, and subscribers have queued work on the first layout"
            )

    def poll(self, timeout: float | None = 0.0) -> int:
        """Adopt new subscribers and collect returned leases; return how many came back.

        Returns as soon as a message from a subscriber has been handled (a
        returned lease, a goodbye) or, with ``ahead=True``, a lease ended at
        its read flag, or after ``timeout`` seconds (``None``: no limit; ``0``:
        do not wait).  The count is of the leases ended since the previous
        ``poll``, each once, wherever it ended: a lease that :meth:`frame`,
        :meth:`publish` or the pool took back meanwhile (a RELEASE read, a read
        flag seen set) is counted here too, and the call then does not wait.
        Threads waiting in ``pool.acquire()`` or ``pool.next()`` are woken
        when leases came back.
        """
        if self._closed:
            self._check()  # raises
        if self._rows.departed:
            self._settle_departed()
        returned = self._leases.collect(timeout)
        self._pool.notify_released()
        return returned

    def leases(self, slot: int) -> int:
        """Number of subscriber leases on ``slot`` (with ``ahead=True``: as of the last
        look at the read flags, by :meth:`poll`, :meth:`acquire` or :meth:`frame`)."""
        return self._book.lease_count(slot)

    # -- teardown --

    @overload
    def close(self, *, timeout: float = CLOSE_GRACE) -> None: ...
    @overload
    @deprecated("pass timeout by keyword: close(timeout=...)")
    def close(self, *args: Any, timeout: float = CLOSE_GRACE) -> None: ...
    @keyword_only_signature
    def close(self, *args: Any, timeout: float = CLOSE_GRACE) -> None:
        """Say goodbye to every subscriber, close the socket, free the sync page.

        Subscribers get a clean end of stream after the frames already sent;
        frames they hold stay readable (they mapped the memory themselves).
        ``close`` waits up to ``timeout`` seconds for every subscriber to
        disconnect, then for the flag operations queued on the publisher's
        streams (frame-flag writes, waits on read flags) before it unmaps the
        page; read flags of subscribers that died are written here, so no
        such wait is left hanging.  Only a live subscriber whose read flag a
        stream of ours still waits on after another ``timeout`` keeps the page
        mapped (with a :class:`TeardownWarning`).  Idempotent; never raises.
        """
        if args:
            (timeout,) = moved_to_keywords(Publisher.close, args, timeout=timeout)
        if self._closed:
            return
        self._closed = True
        self._leases.closed = True
        self._core.close(linger=timeout)
        self._finalizer.detach()
        _close_publisher(
            self._core, self._sync, self._pool, self._leases, self._pid, _PageState(self), timeout
        )


class _PageState:
    """What closing a publisher needs of its sync-page bookkeeping (no reference to it)."""

    __slots__ = ("lock", "published", "rows", "streams")

    def __init__(self, pub: Publisher) -> None:
        self.lock = pub._lock
        self.rows = pub._rows
        self.published = pub._published
        self.streams = pub._streams


def _close_publisher(
    core: PublisherCore,
    sync: SyncPage,
    pool: IpcPool,
    leases: _PublisherLeases,
    pid: int,
    state: _PageState,
    grace: float,
) -> None:
    """Tear a publisher down (also its finalizer); never raises."""
    leases.closed = True
    try:
        core.close()
    except Exception as exc:  # pragma: no cover - core.close never raises
        warnings.warn(f"closing the publisher socket failed: {exc}", TeardownWarning, stacklevel=2)
    pool.remove_lease_source(leases)
    rows = state.rows
    try:
        if os.getpid() != pid or sync.flags.closed:
            return
        with state.lock:  # every adopted subscriber's row is departed now
            rows.close(state.published)
        try:
            settled = settle_page(state.streams, rows, grace)
        except Exception as exc:
            warnings.warn(
                f"waiting for the publisher's streams failed: {exc}", TeardownWarning, stacklevel=2
            )
            settled = False
        rows.release_page()  # the rows' pidfds closed, the page no longer held
        if settled:
            sync.close()
        else:
            _KEPT_PAGES.append(sync)
            warnings.warn(
                f"a stream of the publisher still waits on the read flag of a live subscriber "
                f"{grace} s after close; the shared sync page is kept mapped (leaked) rather "
                "than freed under it",
                TeardownWarning,
                stacklevel=3,
            )
    finally:
        rows.release_page()
