"""The consumer side of the channel: :func:`subscribe`, :class:`Subscriber`, :class:`Frame`.

See :mod:`._publisher` for the protocol in short and ``docs/protocol.md`` for
the sequence diagram.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, overload

from .._args import (
    DeviceLike,
    deprecated,
    keyword_only_signature,
    moved_to_keywords,
    optional_device,
)
from .._arrays import cupy_module, stream_ptr
from .._errors import (
    ChannelTimeoutError,
    DescriptorError,
    EndOfStream,
    PoolClosedError,
    ProtocolError,
    TeardownWarning,
    UsageError,
)
from .._handles import PoolDescriptor
from .._peer import PeerPool, attach_fds
from .._transport._closing import ClosedFlag
from ._ahead import AheadInbox, AheadSchedule, Predicted
from ._iterate import frames_until_clean_end
from ._payload import FRAME_HEAD, check_frame, check_welcome
from ._settle import (
    CLOSE_GRACE,
    DEATH_WAIT,
    PageStreams,
    exited,
    settle_if_dead,
    settle_streams,
    settle_unpublished,
)
from ._subscriber_core import SubscriberCore
from ._syncpage import FrameWaits, SyncPage, frame_state, raise_driver_error
from ._waiting import connect_waiting


class FrameLease(Protocol):
    """What a :class:`Frame` holds: its lease, returned once (here or by a remote subscriber)."""

    released: bool

    def release(self, stream: Any = None) -> None: ...


class _Lease:
    """Owner of a received frame's arrays: returns the lease when released or collected.

    It also pins the mapped slot (``PeerPool._pin``), so closing the subscriber never
    unmaps memory that a frame's arrays still use.
    """

    __slots__ = (
        "__weakref__",
        "confirmed",
        "generation",
        "pin",
        "released",
        "released_on",
        "seq",
        "slot",
        "subscriber",
        "void",
    )

    def __init__(
        self,
        subscriber: Subscriber,
        seq: int,
        slot: int,
        generation: int,
        pin: object,
        confirmed: bool = True,
    ) -> None:
        self.subscriber = subscriber
        self.seq = seq
        self.slot = slot
        self.generation = generation
        self.pin = pin
        self.released = False
        #: False while the frame was handed out ahead of its message ("ahead" mode)
        self.confirmed = confirmed
        #: released ahead of its message: the stream its read flag was written on (None:
        #: not released so; 0 is a stream too, CuPy's default one)
        self.released_on: int | None = None
        self.void = False  # a void frame (FRAME_VOID): taken and not published, never written

    def release(self, stream: Any = None) -> None:
        if self.released:
            return
        self.released = True
        if self.confirmed:
            self.subscriber._release(self.seq, self.slot, self.generation, stream)
        else:
            self.released_on = self.subscriber._release_ahead(
                self.seq, self.slot, self.generation, stream
            )

    @property
    def complete(self) -> bool | None:
        if self.void:
            return False
        return self.subscriber._frame_complete(self.slot, self.generation)

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
        The user bytes sent with the frame.  A frame handed out ahead of its
        message (``mode="ahead"``) has ``b""`` until the message arrives
        (:attr:`confirmed`; a later ``recv`` takes it in).

    Notes
    -----
    :attr:`complete` says whether the producer finished writing the frame;
    it matters only for frames received before the producer died, and stays
    exact after :meth:`release` and after the subscriber's ``close()``.

    Release the frame (:meth:`release`, or leave a ``with`` block) when done:
    the producer cannot reuse the slot before.  The lease is also returned
    when the frame and all of its arrays are gone (garbage collected, noticed
    at the latest by the next :meth:`Subscriber.recv`: the arrays are kept
    and handed out again for the next frame of the same slot and layout).  Using
    the arrays after :meth:`release` is a bug: the producer may overwrite them.
    """

    __slots__ = ("_lease", "arrays", "metadata", "seq", "slot")

    def __init__(
        self, seq: int, slot: int, arrays: tuple[Any, ...], metadata: bytes, lease: FrameLease
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

    @property
    def confirmed(self) -> bool:
        """False while the frame was handed out ahead of its FRAME message (``mode="ahead"``).

        Its arrays and its stream's wait are already right; the message brings
        :attr:`metadata` (and whether the frame is void).  True otherwise.
        """
        return bool(getattr(self._lease, "confirmed", True))

    @property
    def complete(self) -> bool | None:
        """Whether the producer's stream set this frame's flag, i.e. finished writing it.

        True: it did (every write the producer queued before publishing had
        finished, and is what the arrays held at that point).  False: the
        producer died before its stream got there, and a survivor (this
        subscriber or another) set the flag itself so that queued waits end:
        the arrays hold whatever the producer's kernels had written by then
        (partly the new frame, partly older data), and work queued on them
        ran on that; also False for a *void* frame of an ``ahead=True``
        publisher (taken and not published: the slot's old contents).  None:
        not known yet (the producer is alive, or not seen
        dead, and its stream has not set the flag yet; work on the stream of
        :meth:`Subscriber.recv` waits for it on the GPU).  Exact for every
        frame received, held or released, also after the subscriber closed
        (:attr:`Subscriber.incomplete_frames` lists the False ones).  Frames
        of a remote subscriber are always True.
        """
        probe = getattr(self._lease, "complete", True)  # a remote lease: copied, so complete
        return None if probe is None else bool(probe)

    @overload
    def release(self, *, stream: Any = None) -> None: ...
    @overload
    @deprecated("pass stream by keyword: release(stream=...)")
    def release(self, *args: Any, stream: Any = None) -> None: ...
    @keyword_only_signature
    def release(self, *args: Any, stream: Any = None) -> None:
        """Return the lease: set the read flag on ``stream`` (default: current) and
        tell the producer.  Idempotent."""
        if args:
            (stream,) = moved_to_keywords(Frame.release, args, stream=stream)
        self._lease.release(stream)

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(a.shape)) for a in self.arrays)
        return f"{type(self).__name__}(seq={self.seq}, slot={self.slot}, arrays=[{shapes}])"


class Subscriber(ClosedFlag):
    """The consumer end of a channel; made by :func:`subscribe`."""

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        mode: str = "block",
        credit: int | None = None,
        device: DeviceLike | None = None,
        timeout: float = 10.0,
        allowed_uids: Iterable[int] | None = None,
        spin_us: float = 0.0,
        depth: int | None = None,
    ) -> None:
        ordinal = optional_device(device)  # before anything is connected or a GPU looked for
        if depth is not None and (mode != "ahead" or isinstance(depth, bool) or depth < 1):
            raise UsageError(
                f"depth={depth!r}: a positive number of frames, and only with mode='ahead'"
            )
        cp = cupy_module()
        self._cp = cp
        self._closed = False
        self._peer: PeerPool | None = None
        self._sync: SyncPage | None = None
        self._index = 0
        self._streams = PageStreams()  # streams this subscriber enqueued flag operations on
        self._waits: FrameWaits | None = None  # the frame flags those streams may wait on
        self._last_stream: Any = None  # the stream of the last recv/release, and its handle
        self._last_ptr = 0
        self._core = SubscriberCore(
            address,
            mode=mode,
            credit=credit,
            timeout=timeout,
            allowed_uids=allowed_uids,
            spin_us=spin_us,
        )
        self._pidfd = -1
        try:
            if self._core.producer_pid > 0:
                # readable once the producer exits: frames still queued then must not be
                # used, their flags will never be written
                self._pidfd = os.pidfd_open(self._core.producer_pid)
                # the core's per-frame hang-up check covers the pidfd too: recv looks
                # at it on its own only once that check has fired (core.alarm)
                self._core.watch(self._pidfd)
            self._setup(ordinal)
        except BaseException:
            self._teardown()
            raise
        self.mode = mode
        self.address = self._core.address
        #: mode="ahead": the schedule predicted, and the messages taken (channel/_ahead.py)
        self._ahead: AheadSchedule | None = None
        self._inbox: AheadInbox | None = None
        if mode == "ahead":
            n = self._core.num_slots
            self._ahead = AheadSchedule(n, min(n, depth if depth is not None else n))
            self._inbox = AheadInbox(self._ahead, self._message, self._confirmed)
        self._finalizer = weakref.finalize(
            self,
            _teardown_subscriber,
            self._core,
            self._sync,
            self._peer,
            self._pidfd,
            self._streams,
            self._waits,
            CLOSE_GRACE,
            os.getpid(),
        )

    def _setup(self, device: int | None) -> None:
        core = self._core
        payload = core.welcome_payload
        fds = core.take_fds()
        try:
            n = core.num_slots
            # the engine's check of the payload (its head, the descriptor, the page's size)
            index, max_subs, _sync_nbytes, at, desc_len = check_welcome(payload, n, len(fds))
            try:  # the descriptor as the pool layer reads it, which the engine accepted
                desc = PoolDescriptor.from_bytes(payload[at : at + desc_len])
            except DescriptorError as exc:
                raise ProtocolError(f"bad pool descriptor in WELCOME: {exc}") from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        sync_fd = fds.pop()
        try:
            self._peer = peer = attach_fds(desc, fds, device=device)
            self._sync = sync = SyncPage.import_fd(sync_fd, n, max_subs, peer.device)
        finally:
            os.close(sync_fd)
        self._index = index
        self._waits = waits = FrameWaits(sync.layout)
        # per frame that had to wait: note it and record it until its flag is seen set
        self._flags = sync.flags
        self._track = waits.track
        self._record = waits  # true while its record holds a frame
        self._prune = waits.prune
        # per-frame lookups, made once
        self._frame_flags = [sync.frame_flag(i) for i in range(n)]
        self._read_flags = [sync.read_flag(index, i) for i in range(n)]
        self._order = sync.order  # waits on the GPU only if the host does not see the flag set
        self._write_fn, self._wflags = sync.write_op

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

    # -- hot path --

    @overload
    def recv(self, *, timeout: float | None = None, stream: Any = None) -> Frame: ...
    @overload
    @deprecated("pass timeout by keyword: recv(timeout=...)")
    def recv(self, *args: Any, timeout: float | None = None, stream: Any = None) -> Frame: ...
    @keyword_only_signature
    def recv(self, *args: Any, timeout: float | None = None, stream: Any = None) -> Frame:
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
            If it died, the frame flags it never set are set by this
            subscriber, so no stream waits for them any more, and the
            exception's ``incomplete`` names the frames received (held or
            released) that were not completely written: discard or recompute
            what was computed on them (see :attr:`Frame.complete`).
        ChannelTimeoutError
            No frame within ``timeout`` seconds (also a ``TimeoutError``).
        ProtocolError
            The publisher sent a malformed frame; the subscription is closed.
        """
        if args:
            (timeout,) = moved_to_keywords(Subscriber.recv, args, timeout=timeout)
        if self._closed:
            raise PoolClosedError("the Subscriber is closed")
        peer = self._peer
        assert peer is not None
        peer._drop_idle_owners()  # frames dropped without release() go back now, as collected
        if self._ahead is not None:
            return self._recv_ahead(timeout, stream)
        got = self._message(timeout)  # its payload: valid until the next recv
        if got is None:
            raise ChannelTimeoutError.no_frame(timeout)
        return self._hand_out(*got, stream)

    def _message(self, timeout: float | None) -> tuple[int, int, memoryview | bytes] | None:
        """The next FRAME message from the core (None: none within ``timeout``); every way
        the session ends, answered."""
        core = self._core
        try:
            got = core.next_view(timeout)  # its payload: valid until the next recv
        except ProtocolError:
            self.close()
            raise
        except EndOfStream as exc:
            # hung up without a BYE: the producer is dying (its sockets close just
            # before its pidfd says so); give it DEATH_WAIT, then settle the flags
            self._settle_if_dead(0.0 if exc.clean or core.evicted else DEATH_WAIT)
            if self._ahead is not None:
                self._end_ahead()
            self._answer(exc)
            raise
        if got is not None and core.alarm and not self._written(got) and exited(self._pidfd):
            self.close()
            raise self._answer(
                EndOfStream(
                    f"the publisher (pid {self._core.producer_pid}) exited before frame "
                    f"{got[0]} was complete; frames still queued are dropped",
                    False,
                )
            )
        return got

    def _written(self, got: tuple[int, int, memoryview | bytes]) -> bool:
        """Whether the frame flag of message ``got`` says the producer's stream wrote it
        (a frame queued before a BYE of a producer that has exited since is handed out
        then; a payload too short for its head is left to :meth:`_hand_out`)."""
        _seq, slot, payload = got
        if len(payload) < FRAME_HEAD.size or self._sync is None:
            return True
        generation = FRAME_HEAD.unpack_from(payload)[1]
        word = self._flags.load(self._sync.layout.frame_offset(slot))
        return frame_state(word, generation) is True

    def _hand_out(self, seq: int, slot: int, payload: memoryview | bytes, stream: Any) -> Frame:
        """Frame ``seq`` from its payload: its arrays, and ``stream`` made to wait for its flag."""
        peer = self._peer
        assert peer is not None
        try:
            generation, count, _meta_len, void = check_frame(seq, slot, payload, peer.slot_nbytes)
            lease = _Lease(self, seq, slot, generation, peer._pin(slot))
            if void:
                lease.void = True
            arrays, pos = self._arrays(seq, payload, FRAME_HEAD.size, count, lease)
        except ProtocolError:
            self.close()
            raise
        return self._ordered(seq, slot, generation, arrays, bytes(payload[pos:]), lease, stream)

    def _arrays(
        self, seq: int, wire: memoryview | bytes, pos: int, count: int, lease: _Lease
    ) -> tuple[list[Any], int]:
        """Frame ``seq``'s ``count`` arrays from the handles at ``wire[pos:]``, owned by ``lease``
        (the end of the handles second); a bad handle is a :class:`ProtocolError`."""
        assert self._peer is not None
        try:
            return self._peer._arrays_from_wire(wire, pos, count, lease)
        except DescriptorError as exc:
            lease.released = True
            raise ProtocolError(f"frame {seq}: {exc}") from None

    def _ordered(
        self,
        seq: int,
        slot: int,
        generation: int,
        arrays: list[Any],
        metadata: bytes,
        lease: _Lease,
        stream: Any,
    ) -> Frame:
        """Frame ``seq``, with ``stream`` made to wait for its flag to reach ``generation``."""
        sptr = self._stream_ptr(stream)
        if self._order(sptr, self._frame_flags[slot], generation):
            self._track(self._flags, seq, slot, generation)
        elif self._record:
            self._prune(self._flags)
        return Frame(seq, slot, tuple(arrays), metadata, lease)

    # -- mode="ahead": frames handed out ahead of their messages (channel/_ahead.py) --

    def _recv_ahead(self, timeout: float | None, stream: Any) -> Frame:
        """The next frame: from a message already here, else predicted, else the next message."""
        assert self._inbox is not None
        try:
            got = self._inbox.next(timeout)
        except ProtocolError:
            self.close()
            raise
        if isinstance(got, Predicted):
            frame = self._hand_out_ahead(got, stream)
        else:
            frame = self._hand_out(*got, stream)
        assert self._ahead is not None
        self._ahead.handed(frame.slot)  # none of its slot's next use ahead until released
        return frame

    def _hand_out_ahead(self, entry: Predicted, stream: Any) -> Frame:
        """Frame ``entry`` before its message: arrays from the predicted handles (the
        slot's layout at the predicted generation: no FRAME head to read)."""
        peer = self._peer
        assert peer is not None
        seq, slot = entry.seq, entry.slot
        generation = entry.generation & 0xFFFFFFFF
        lease = _Lease(self, seq, slot, generation, peer._pin(slot), False)
        try:
            arrays, _end = self._arrays(seq, entry.handles, 0, entry.count, lease)
        except ProtocolError:
            self.close()
            raise
        frame = self._ordered(seq, slot, generation, arrays, b"", lease, stream)
        entry.frame = frame
        return frame

    def _release_ahead(self, seq: int, slot: int, generation: int, stream: Any) -> int | None:
        """Release frame ``seq``, handed out ahead of its message: its read flag on
        ``stream``, then its RELEASE at once (:meth:`SubscriberCore.release_ahead`).

        The publisher (``ahead=True``) ends the lease as it publishes the frame;
        the producer's stream still waits for the read flag before it writes the
        slot again.  Returns the stream's handle (the read flag is rewritten
        there if the frame's message names a later generation; 0, CuPy's
        default stream, included), or None when closed (nothing was written).
        """
        if self._closed:
            return None
        sptr = self._stream_ptr(stream)
        assert self._sync is not None
        self._sync.write(sptr, self._read_flags[slot], generation)
        assert self._ahead is not None
        self._ahead.released(slot)
        try:
            self._core.release_ahead(seq, slot)
        except EndOfStream:  # the producer is gone: nobody to return it to
            self._settle_if_dead()
        return sptr

    def _confirmed(self, entry: Predicted) -> None:
        """Frame ``entry``'s message arrived: its metadata, and its generation if later."""
        frame = entry.frame
        entry.frame = None
        if frame is None:
            return
        lease = frame._lease
        generation = (entry.confirmed_generation or entry.generation) & 0xFFFFFFFF
        frame.metadata = entry.metadata
        lease.void = entry.void
        if generation != lease.generation:
            # a later generation than predicted (the pool was used outside the publisher):
            # the wait was still exact (channel/_ahead.py); the read flag must say this one
            lease.generation = generation
            if self._waits is not None and not entry.void:
                self._waits.note(entry.slot, generation)
            if lease.released and lease.released_on is not None and self._sync is not None:
                self._sync.write(lease.released_on, self._read_flags[entry.slot], generation)
        lease.confirmed = True  # released already: its RELEASE went at release()

    def _end_ahead(self) -> None:
        """The publisher is gone: end the waits on frames handed out ahead that never came.

        After a death :meth:`_settle_if_dead` forced every awaited flag.  After
        a clean end (BYE), :func:`~._settle.settle_unpublished` forces the flags
        of the frames never published, so no stream waits for them and their
        :attr:`Frame.complete` is False.
        """
        ahead, sync = self._ahead, self._sync
        if ahead is None or not ahead.outstanding or sync is None or sync.flags.closed:
            return
        if settle_unpublished(sync.flags, sync.layout, ahead.outstanding, CLOSE_GRACE):
            ahead.outstanding.clear()

    def _stream_ptr(self, stream: Any) -> int:
        """``stream``'s raw handle (default: CuPy's current stream), noted as in use.

        The last stream seen is remembered (and held, as :class:`PageStreams`
        holds it anyway): a loop that passes the same stream object each frame,
        or uses CuPy's current stream, pays one identity check.
        """
        if stream is None:
            stream = self._cp.cuda.get_current_stream()
        if stream is self._last_stream:
            return self._last_ptr
        sptr = stream_ptr(stream)
        self._streams.note(sptr, stream)
        self._last_stream, self._last_ptr = stream, sptr
        return sptr

    def _release(self, seq: int, slot: int, generation: int, stream: Any) -> None:
        if self._closed:
            return
        sptr = self._stream_ptr(stream)
        # The read-flag write and the RELEASE in one compiled call; the write is
        # skipped once the publisher hung up (after an eviction the row may have
        # been given to another subscriber).
        try:
            rc = self._core.release_with_write(
                seq, slot, self._write_fn, sptr, self._read_flags[slot], generation, self._wflags
            )
        except EndOfStream:  # the producer is gone: nobody to return it to
            self._settle_if_dead()
            return
        if rc:
            raise_driver_error("cuStreamWriteValue32", rc)
        if self._ahead is not None:
            self._ahead.released(slot)

    # -- the producer's death --

    def _settle_if_dead(self, wait: float = 0.0) -> None:
        """If the producer died, set the frame flags it never wrote that our streams await.

        ``wait``: seconds to wait for its pidfd while such a flag is unset
        (:func:`~._settle.settle_if_dead`, the death watch).  Afterwards no
        stream of this subscriber waits for the dead producer: work on held
        frames runs (see :attr:`Frame.complete` for what they hold).
        """
        sync, waits = self._sync, self._waits
        if sync is not None and waits is not None and not sync.flags.closed:
            settle_if_dead(sync.flags, waits, self._pidfd, wait)

    def _frame_complete(self, slot: int, generation: int) -> bool | None:
        """:attr:`Frame.complete` of the frame of ``generation`` in ``slot``."""
        waits = self._waits
        if waits is None:
            return None
        flags = None if self._sync is None else self._sync.flags
        state = waits.state(flags, slot, generation)
        if state is None and not self._closed:
            self._settle_if_dead()
            state = waits.state(flags, slot, generation)
        return state

    def _answers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(incomplete, pending)`` seqs of the frames received (:meth:`FrameWaits.answers`)."""
        waits = self._waits
        if waits is None:
            return (), ()
        return waits.answers(None if self._sync is None else self._sync.flags)

    def _answer(self, exc: EndOfStream) -> EndOfStream:
        """Put on ``exc`` which received frames were never written, or are not known yet."""
        exc.incomplete, exc.pending = self._answers()
        exc.untracked = self.untracked_frames
        return exc

    @property
    def forced_flags(self) -> int:
        """How many frame flags this subscriber set itself because the producer died."""
        return 0 if self._waits is None else self._waits.forced

    @property
    def incomplete_frames(self) -> tuple[int, ...]:
        """Seqs of the received frames (held or released) the producer never finished writing.

        Empty while the producer lives; once it died and the flags it left
        unset were forced (at the :class:`EndOfStream`, at the latest at
        :meth:`close`), the frames whose :attr:`Frame.complete` is False, in
        the order received.  A void frame (``Publisher(ahead=True)``: taken and
        not published; :attr:`Frame.complete` False) is not listed: the
        producer's stream set its flag; it is listed only if the producer died
        before that, as any frame.  Frames past the record's bound are not
        listed (:attr:`untracked_frames`).  Also after :meth:`close`.
        """
        if not self._closed:
            self._settle_if_dead()
        return self._answers()[0]

    @property
    def untracked_frames(self) -> int:
        """Frames received but left out of :attr:`incomplete_frames` (the record was full)."""
        return 0 if self._waits is None else self._waits.untracked

    def __iter__(self) -> Iterator[Frame]:
        """Yield frames until the publisher closes.

        A clean close ends the iteration; a publisher that died raises
        :class:`EndOfStream` with ``clean=False``; a malformed message raises
        :class:`ProtocolError` and closes this subscriber.
        """
        return frames_until_clean_end(self.recv)

    # -- teardown --

    def close(self) -> None:
        """Say goodbye and drop the mapping (once no frame's arrays use it).

        Idempotent; never raises.  Frames still alive keep their slots mapped
        until they are collected; their leases are not returned any more.
        Where a stream of ours still waits on a flag of a live producer after
        :data:`~._settle.CLOSE_GRACE` seconds (5), the sync page and the slots'
        mappings are kept, with a :class:`TeardownWarning`.
        """
        if self._closed:
            return
        if self._inbox is not None and self._inbox.schedule.outstanding:
            # frames handed out ahead: a BYE already here lets their waits end now
            with contextlib.suppress(Exception):
                self._inbox.take()
        self._closed = True
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        _teardown_subscriber(
            self._core,
            self._sync,
            self._peer,
            self._pidfd,
            self._streams,
            self._waits,
            CLOSE_GRACE,
            os.getpid(),
        )


#: Sync pages and slot mappings kept because a live but silent producer might still
#: let a stream of ours wait on a flag: kept here so that they are never unmapped
#: while a queued wait or the work behind it may touch them (collecting the page's
#: mapping would leave its registration behind; unmapping a slot would wait for
#: that work, i.e. forever).
_KEPT_PAGES: list[SyncPage] = []
_KEPT_PEERS: list[PeerPool] = []


def _teardown_subscriber(
    core: SubscriberCore,
    sync: SyncPage | None,
    peer: PeerPool | None,
    pidfd: int,
    streams: PageStreams,
    waits: FrameWaits | None,
    grace: float,
    pid: int,
) -> None:
    """Close a subscriber (also its finalizer); never raises.

    Order: wait for the flag operations queued on our streams (forcing the
    frame flags of a dead producer, so that none waits forever), then BYE
    (the publisher then finds every read flag of ours written), then
    unregister and unmap the sync page, close the pidfd, detach the pool.
    Where a stream may still wait on a live producer's flag (not settled),
    neither the page nor the slots' mappings are given back: both are kept
    for the life of the process.
    """
    if os.getpid() != pid:  # a forked child: nothing of the parent's GPU state is ours
        core.close()
        return
    settled = True
    try:
        if sync is not None and waits is not None and not sync.flags.closed:
            try:
                settled = settle_streams(sync.flags, streams, waits, pidfd, grace)
                waits.freeze(sync.flags)
            except Exception as exc:
                settled = False
                warnings.warn(
                    f"waiting for the subscriber's streams failed: {exc}",
                    TeardownWarning,
                    stacklevel=2,
                )
        core.close()
        streams.clear()
        if sync is not None:
            if settled:
                sync.close()
            else:
                _KEPT_PAGES.append(sync)
                warnings.warn(
                    f"a stream of this subscriber still waits on a frame flag of the publisher "
                    f"(pid {core.producer_pid}), which is alive but did not set it within "
                    f"{grace} s: the sync page and the slots' mappings are kept (leaked) "
                    "rather than unmapped under that wait",
                    TeardownWarning,
                    stacklevel=2,
                )
    finally:
        if pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(pidfd)
        if peer is not None:
            if settled:
                peer.close()
            else:
                _KEPT_PEERS.append(peer)


def subscribe(
    address: str | os.PathLike[str],
    *,
    mode: str = "block",
    credit: int | None = None,
    device: DeviceLike | None = None,
    timeout: float = 10.0,
    allowed_uids: Iterable[int] | None = None,
    spin_us: float = 0.0,
    wait: float = 0.0,
    depth: int | None = None,
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
        it holds ``credit`` of them are skipped.  ``"ahead"`` (a publisher
        made with ``ahead=True``): as ``"block"``, and ``recv`` hands frames
        out before their messages arrive, up to ``depth`` of them, with the
        stream already waiting on the GPU for each frame's data; the host never
        waits for the producer's host (docs/protocol.md, "Frames handed out ahead").
    credit:
        Most frames held at once (default 1 for ``latest``).
    device:
        Local GPU to map on, an ordinal or a ``cupy.cuda.Device`` (default:
        the producer's GPU, by UUID).
    timeout:
        Seconds for connecting and the handshake.
    allowed_uids:
        Uids the publisher may run as (default: this process's euid).
    spin_us:
        Microseconds ``recv`` busy-polls for the next frame before it sleeps
        (default 0: sleep at once; an idle subscriber then uses no CPU).  Tens
        of microseconds cut the wake-up latency of a high-rate stream; see
        docs/performance.md.
    wait:
        Seconds to wait for a publisher that is not up yet (no socket at
        ``address``, or one left by a publisher that exited), or that goes
        away during the handshake; ``math.inf``: no limit.  Default 0: fail
        at once.
    depth:
        ``mode="ahead"`` only: most frames handed out ahead of their messages
        at once (default and most: the ring's slots).

    Raises
    ------
    TransportError
        No publisher at ``address`` (with ``wait=0``), or no permission to connect.
    ChannelTimeoutError
        No publisher answered within ``wait`` seconds.
    PeerRefusedError
        The publisher refused this subscriber (uid, capacity), or runs as a
        uid not allowed here.
    UsageError
        An argument out of range (checked before anything is connected).
    """
    device = optional_device(device)
    return connect_waiting(
        lambda: Subscriber(
            address,
            mode=mode,
            credit=credit,
            device=device,
            timeout=timeout,
            allowed_uids=allowed_uids,
            spin_us=spin_us,
            depth=depth,
        ),
        os.fspath(address),
        wait,
    )
