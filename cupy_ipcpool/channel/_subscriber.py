"""The consumer side of the channel: :func:`subscribe`, :class:`Subscriber`, :class:`Frame`.

See :mod:`._publisher` for the protocol in short and ``docs/protocol.md`` for
the sequence diagram.
"""

from __future__ import annotations

import contextlib
import os
import select
import warnings
import weakref
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, Protocol

from .._arrays import cupy_module, stream_ptr
from .._errors import (
    DescriptorError,
    EndOfStream,
    PoolClosedError,
    ProtocolError,
    TeardownWarning,
)
from .._handles import PoolDescriptor
from .._peer import PeerPool, attach_fds
from ._payload import FRAME_HEAD, MAX_ARRAYS, MAX_METADATA, WELCOME_HEAD, hotpath
from ._session import SubscriberCore
from ._syncpage import SyncPage, raise_driver_error

#: Most streams a subscriber tracks before it forgets those with no work left.
_STREAMS_KEPT = 8


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


class FrameLease(Protocol):
    """What a :class:`Frame` holds: its lease, returned once (here or by a remote subscriber)."""

    released: bool

    def release(self, stream: Any = None) -> None: ...


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
        return f"{type(self).__name__}(seq={self.seq}, slot={self.slot}, arrays=[{shapes}])"


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
        spin_us: float = 0.0,
    ) -> None:
        cp = cupy_module()
        self._cp = cp
        self._closed = False
        self._peer: PeerPool | None = None
        self._sync: SyncPage | None = None
        self._index = 0
        self._streams = _StreamsInUse()  # streams this subscriber enqueued flag operations on
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
        self._alive = select.poll()
        self._pidfd = -1
        try:
            if self._core.producer_pid > 0:
                # readable once the producer exits: frames still queued then must not be
                # used, their flags will never be written
                self._pidfd = os.pidfd_open(self._core.producer_pid)
                self._alive.register(self._pidfd, select.POLLIN)
                # the core's per-frame hang-up check covers the pidfd too: recv looks
                # at it on its own only once that check has fired (core.alarm)
                self._core.watch(self._pidfd)
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
            if len(payload) < WELCOME_HEAD.size:
                raise ProtocolError("WELCOME payload too short")
            desc_len, n_slots, max_subs, index, sync_nbytes = WELCOME_HEAD.unpack_from(payload)
            if (
                n_slots != n
                or len(payload) != WELCOME_HEAD.size + desc_len
                or not 0 <= index < max_subs <= 1 << 16
                or len(fds) != n + 1
            ):
                raise ProtocolError(
                    f"WELCOME does not add up: {n_slots} slots (session says {n}), "
                    f"{len(payload)} payload bytes for a {desc_len}-byte descriptor, "
                    f"row {index} of {max_subs}, {len(fds)} fds"
                )
            try:
                desc = PoolDescriptor.from_bytes(payload[WELCOME_HEAD.size :])
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
            self._sync = sync = SyncPage.import_fd(sync_fd, sync_nbytes, n, max_subs, peer.device)
        finally:
            os.close(sync_fd)
        self._index = index
        # per-frame lookups, made once
        self._frame_flags = [sync.frame_flag(i) for i in range(n)]
        self._read_flags = [sync.read_flag(index, i) for i in range(n)]
        self._order = sync.order  # waits on the GPU only if the host does not see the flag set
        self._write_fn, self._wflags = sync.write_op
        # recv's steady state in one compiled call (_hotpath.take_frame)
        self._take_frame = hotpath().take_frame
        self._frame_ctx = (
            *peer.wire_state(),
            *sync.wait_op[:2],
            self._frame_flags,
            *sync.wait_op[2:],
        )

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
        core = self._core
        peer = self._peer
        assert peer is not None
        peer.drop_idle_owners()  # frames dropped without release() go back now, as collected
        try:
            seq, slot, payload = core.recv_view(timeout)  # payload: valid until the next recv
        except ProtocolError:
            self.close()
            raise
        if core.alarm and self._alive.poll(0):
            self.close()
            raise EndOfStream(
                f"the publisher (pid {self._core.producer_pid}) exited; frames still queued "
                "are dropped (their flags will never be set)",
                False,
            )
        # The steady state: every array's geometry seen before and its kept array
        # free (else nothing is changed and the Python path below decides).
        lease = _Lease(self, seq, slot, 0, peer.pin(slot))
        sptr = self._stream_ptr(stream)
        got = self._take_frame(self._frame_ctx, payload, slot, lease, sptr)
        if got is not None:
            lease.generation, arrays_t, metadata, _waited, rc = got
            if rc:
                raise_driver_error("cuStreamWaitValue32", rc)
            return Frame(seq, slot, arrays_t, metadata, lease)
        lease.released = True  # not handed out: the Python path makes the frame's lease
        del lease
        try:
            if len(payload) < FRAME_HEAD.size:
                raise ProtocolError(f"frame {seq}: payload too short")
            flag, generation, count, meta_len = FRAME_HEAD.unpack_from(payload, 0)
            if flag != slot:
                raise ProtocolError(f"frame {seq} in slot {slot} names flag {flag}")
            if count > MAX_ARRAYS or meta_len > MAX_METADATA:
                raise ProtocolError(f"frame {seq}: {count} arrays, {meta_len} metadata bytes")
            assert self._peer is not None
            lease = _Lease(self, seq, slot, generation, self._peer.pin(slot))
            try:
                arrays, pos = self._peer.arrays_from_wire(payload, FRAME_HEAD.size, count, lease)
            except DescriptorError as exc:
                lease.released = True
                raise ProtocolError(f"frame {seq}: {exc}") from None
            if len(payload) - pos != meta_len:
                lease.released = True
                raise ProtocolError(f"frame {seq}: metadata length does not match")
        except ProtocolError:
            self.close()
            raise
        sptr = self._stream_ptr(stream)
        self._order(sptr, self._frame_flags[slot], generation)
        return Frame(seq, slot, tuple(arrays), bytes(payload[pos:]), lease)

    def _stream_ptr(self, stream: Any) -> int:
        """``stream``'s raw handle (default: CuPy's current stream), noted as in use.

        The last stream seen is remembered (and held, as :class:`_StreamsInUse`
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
            return
        if rc:
            raise_driver_error("cuStreamWriteValue32", rc)

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
    spin_us: float = 0.0,
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
    spin_us:
        Microseconds ``recv`` busy-polls for the next frame before it sleeps
        (default 0: sleep at once; an idle subscriber then uses no CPU).  Tens
        of microseconds cut the wake-up latency of a high-rate stream; see
        docs/performance.md.

    Raises
    ------
    TransportError
        No publisher at ``address``, or no permission to connect.
    PeerRefusedError
        The publisher refused this subscriber (uid, capacity), or runs as a
        uid not allowed here.
    """
    return Subscriber(
        address,
        mode=mode,
        credit=credit,
        device=device,
        timeout=timeout,
        allowed_uids=allowed_uids,
        spin_us=spin_us,
    )
