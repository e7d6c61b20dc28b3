"""A single-producer / single-consumer control ring in shared memory, with an eventfd doorbell.

One ring per subscriber carries the per-frame control messages that today
travel as ``SOCK_SEQPACKET`` datagrams: FRAME records from the publisher to
the subscriber, RELEASE records back.  The socket stays for the handshake,
control messages and death detection; the ring's three fds (a sealed memfd
and two eventfds) travel over it once, with ``SCM_RIGHTS``.

Layout of the memfd (little-endian; every offset 64-byte aligned so that the
two processes' counters never share a cache line)::

    0     header     magic u32 'CPCR', version u16, header bytes u16,
                     frame capacity u32, release capacity u32,
                     frame record bytes u32, release record bytes u32,
                     inline payload max u32, num_slots u32, total bytes u64
    64    frame lane head   u64  (publisher writes: records written)
    128   frame lane tail   u64  (subscriber writes: records consumed)
    192   release lane head u64  (subscriber writes)
    256   release lane tail u64  (publisher writes)
    320   frame records:   capacity x [pos u64, seq u64, slot u32, generation u32,
                                       reserved u32 = 0, payload bytes u32, payload]
    ...   release records: capacity x [pos u64, seq u64, slot u32, generation u32]

The four counters are u64 in native order (little-endian wherever CUDA runs),
each stored and loaded with one 8-byte access (see ``_U64``).
``pos`` is the record's position in its lane (0, 1, 2...): a record is valid
only if it carries the position the reader expects.

**Trust.** Either side may be hostile or broken.  Each side keeps its own
counter in a local variable and never reads it back; the peer's counter,
every record field and the header are validated (``0 <= head - tail <=
capacity``, ``pos``, slot range, payload length) before use, and read once
(fields are unpacked into local ints, the payload is copied out), so a peer
that rewrites the memory after the check changes nothing.  Every access is at
an offset computed from validated local values, inside a mapping whose size
the creator sealed (``F_SEAL_SHRINK``/``F_SEAL_GROW``), so neither side can
make the other touch unmapped memory.  Anything wrong raises
:class:`~cupy_ipcpool._errors.ProtocolError`.

**Ordering and wake-up.** The writer stores the record, then the head, then
writes the reader's eventfd (one ``write(2)``, always: there is no "is the
reader asleep" flag, which would need a store-load fence that Python cannot
issue).  The reader first looks at the head without a system call (valid on
x86-64's total store order); on other architectures it reads the eventfd
first, whose kernel lock orders the writer's stores before the reader's
loads.  A blocked reader sleeps in ``poll(2)`` on the eventfd (no CPU while
idle); an optional short spin (``spin_us``, off by default) polls the ring
before sleeping.  A writer that finds the lane full either drops (``full=
"drop"``) or waits: the reader rings the writer's doorbell when it consumes
from a lane it saw full, and the writer re-checks every millisecond as well
(a full lane is backpressure, not the fast path).

**Hot path.** ``send_*`` is one ``struct.pack_into`` for the record, one for
the head and one ``eventfd_write``; ``try_recv_*`` is two ``unpack_from``
calls and one ``pack_into``.  Structs and views are made once; what remains
per call are the small objects Python makes for any call (the ints and the
result tuple).  Not thread-safe: one thread per end.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import platform
import select
import struct
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence
from types import TracebackType

from .._errors import PoolClosedError, ProtocolError, TeardownWarning, UsageError
from .._handles import MAX_SLOTS as HANDLES_MAX_SLOTS

MAGIC = 0x52435043  # 'CPCR'
VERSION = 1
HEADER_BYTES = 64
#: Most records a lane may hold (a power of two).
MAX_CAPACITY = 1 << 16
#: Most inline payload bytes per FRAME record.
MAX_INLINE = 64 * 1024
#: Most slots a ring may name.
MAX_SLOTS = HANDLES_MAX_SLOTS  # the one slot-count limit (cupy_ipcpool._handles)
#: Largest memfd a subscriber accepts.
MAX_TOTAL = 1 << 30

_HEADER = struct.Struct("<IHHIIIIIIQ")
# The four counters are stored in native format: struct's standard-size formats ("<Q")
# pack and unpack byte by byte, so the other process could see a torn value; the native
# format copies the 8 aligned bytes with one memcpy (one load or store).  Native order is
# little-endian on every platform CUDA runs on.
_U64 = struct.Struct("Q")
_FRAME = struct.Struct("<QQIIII")  # pos, seq, slot, generation, reserved, payload bytes
_RELEASE = struct.Struct("<QQII")  # pos, seq, slot, generation
_FRAME_HEAD, _FRAME_TAIL, _RELEASE_HEAD, _RELEASE_TAIL = 64, 128, 192, 256
_RECORDS = 320
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1

#: True where the CPU keeps stores in order as seen by other cores (x86 TSO), so the
#: reader may look at the head without a system call first.
STRONG_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

_POLLIN = select.POLLIN
_WATCH = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL
_FULL_RECHECK_S = 0.001


def _round64(n: int) -> int:
    return (n + 63) & ~63


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def layout(
    num_slots: int, frame_capacity: int, release_capacity: int, inline_max: int
) -> dict[str, int]:
    """Sizes and offsets of a ring (pure; validates its arguments).

    Raises
    ------
    UsageError
        A capacity not a power of two or out of range, a bad ``inline_max`` or
        ``num_slots``.
    """
    for name, cap in (("frame_capacity", frame_capacity), ("release_capacity", release_capacity)):
        if not 1 <= cap <= MAX_CAPACITY or cap & (cap - 1):
            raise UsageError(f"{name} must be a power of two in 1..{MAX_CAPACITY}, got {cap}")
    if not 0 <= inline_max <= MAX_INLINE or inline_max % 8:
        raise UsageError(f"inline_max must be a multiple of 8 in 0..{MAX_INLINE}, got {inline_max}")
    if not 1 <= num_slots <= MAX_SLOTS:
        raise UsageError(f"num_slots must be in 1..{MAX_SLOTS}, got {num_slots}")
    frame_rec = _round64(_FRAME.size + inline_max)
    release_rec = 32
    release_off = _RECORDS + frame_capacity * frame_rec
    total = _round64(release_off + release_capacity * release_rec)
    return {
        "frame_record": frame_rec,
        "release_record": release_rec,
        "frame_records": _RECORDS,
        "release_records": release_off,
        "total": total,
    }


def _fd_kind(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise ProtocolError(f"fd {fd} cannot be inspected: {exc}") from None


class _Lane:
    """One direction of the ring, seen from one end (writer or reader).

    ``doorbell`` is the reader's eventfd: the writer rings it after each record.
    ``wake_writer`` is the writer's eventfd: the reader rings it when it frees
    space in a lane it saw full.
    """

    __slots__ = (
        "buf",
        "cap",
        "doorbell",
        "head_off",
        "mask",
        "name",
        "pos",
        "rec",
        "rec_off",
        "seen_full",
        "seen_head",
        "tail_off",
        "wake_writer",
    )

    def __init__(
        self,
        name: str,
        buf: memoryview,
        cap: int,
        rec: int,
        rec_off: int,
        head_off: int,
        tail_off: int,
        doorbell: int,
        wake_writer: int,
    ) -> None:
        self.name = name
        self.buf = buf
        self.cap = cap
        self.mask = cap - 1
        self.rec = rec
        self.rec_off = rec_off
        self.head_off = head_off
        self.tail_off = tail_off
        self.doorbell = doorbell
        self.wake_writer = wake_writer
        self.pos = 0  # writer: records written; reader: records consumed (local, authoritative)
        self.seen_head = 0  # reader: the head validated last
        self.seen_full = False  # reader: the lane was full at that read

    # -- writer --

    def space(self) -> int:
        """Free records, from the peer's tail (validated)."""
        (tail,) = _U64.unpack_from(self.buf, self.tail_off)
        used = self.pos - tail
        if not 0 <= used <= self.cap:
            time.sleep(0)  # re-read once: a value caught mid-store cannot last
            (tail,) = _U64.unpack_from(self.buf, self.tail_off)
            used = self.pos - tail
        if not 0 <= used <= self.cap:
            raise ProtocolError(
                f"{self.name} lane: the reader's tail {tail} is not within {self.cap} records "
                f"behind the head {self.pos}"
            )
        return self.cap - used

    def slot_offset(self) -> int:
        return self.rec_off + (self.pos & self.mask) * self.rec

    def commit(self) -> None:
        """Publish the record at ``pos``: store the head, ring the reader's doorbell."""
        self.pos += 1
        _U64.pack_into(self.buf, self.head_off, self.pos)
        os.eventfd_write(self.doorbell, 1)

    # -- reader --

    def available(self) -> int:
        """Records ready to read (refreshing the validated head when the last batch is used up)."""
        n = self.seen_head - self.pos
        if n:
            return n
        if not STRONG_ORDER:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self.doorbell)  # orders the writer's stores before our loads
        (head,) = _U64.unpack_from(self.buf, self.head_off)
        n = head - self.pos
        if not 0 <= n <= self.cap:
            time.sleep(0)  # re-read once: a value caught mid-store cannot last
            (head,) = _U64.unpack_from(self.buf, self.head_off)
            n = head - self.pos
        if not 0 <= n <= self.cap:
            raise ProtocolError(
                f"{self.name} lane: the writer's head {head} is not within {self.cap} records "
                f"ahead of the tail {self.pos}"
            )
        self.seen_head = head
        self.seen_full = n == self.cap
        return n

    def record_offset(self) -> int:
        return self.rec_off + (self.pos & self.mask) * self.rec

    def consumed(self) -> None:
        self.pos += 1
        _U64.pack_into(self.buf, self.tail_off, self.pos)
        if self.seen_full:
            self.seen_full = False
            os.eventfd_write(self.wake_writer, 1)


class _End:
    """What both ends share: the mapping, the fds, waiting, closing.

    Not constructed directly: use :meth:`PublisherRing.create` or
    :meth:`SubscriberRing.attach`.
    """

    _closed = True

    def __init__(
        self,
        mm: mmap.mmap,
        memfd: int,
        pub_efd: int,
        sub_efd: int,
        num_slots: int,
        frame_capacity: int,
        release_capacity: int,
        inline_max: int,
        lay: dict[str, int],
        *,
        spin_us: float,
        full: str,
    ) -> None:
        if full not in ("block", "drop"):
            raise UsageError(f"full must be 'block' or 'drop', got {full!r}")
        if spin_us < 0:
            raise UsageError(f"spin_us must be >= 0, got {spin_us}")
        self._mm = mm
        self._buf = memoryview(mm)
        self._memfd = memfd
        self._pub_efd = pub_efd
        self._sub_efd = sub_efd
        # my doorbell: records for me, or space for me
        my_efd = pub_efd if isinstance(self, PublisherRing) else sub_efd
        self._my_efd = my_efd
        self.num_slots = num_slots
        self.inline_max = inline_max
        self.spin_s = spin_us / 1e6
        self.full = full
        self._poll = select.poll()
        self._poll.register(my_efd, _POLLIN)
        self._watched: list[int] = []
        self._frame = _Lane(
            "frame",
            self._buf,
            frame_capacity,
            lay["frame_record"],
            lay["frame_records"],
            _FRAME_HEAD,
            _FRAME_TAIL,
            doorbell=self._sub_efd,
            wake_writer=self._pub_efd,
        )
        self._release = _Lane(
            "release",
            self._buf,
            release_capacity,
            lay["release_record"],
            lay["release_records"],
            _RELEASE_HEAD,
            _RELEASE_TAIL,
            doorbell=self._pub_efd,
            wake_writer=self._sub_efd,
        )
        self._frame_rec = struct.Struct(f"<QQIIII{inline_max}s")
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _release_resources, self._buf, mm, [memfd, pub_efd, sub_efd]
        )

    # -- state --

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def fileno(self) -> int:
        """This end's doorbell eventfd: readable when a record (or space) may be waiting."""
        self._check()
        return self._my_efd

    def _check(self) -> None:
        if self._closed:
            raise PoolClosedError("the control ring is closed")

    # -- waiting --

    def _watch(self, watch: Iterable[int]) -> None:
        fds = list(watch)
        if fds == self._watched:
            return
        for fd in self._watched:
            self._poll.unregister(fd)
        for fd in fds:
            self._poll.register(fd, _WATCH)
        self._watched = fds

    def _sleep(self, deadline: float | None, cap: float | None = None) -> bool:
        """Sleep until the doorbell rings, a watched fd is ready, or the deadline; True if a
        watched fd is ready."""
        if deadline is None:
            ms = -1 if cap is None else max(1, int(cap * 1000))
        else:
            left = deadline - time.monotonic()
            if cap is not None:
                left = min(left, cap)
            ms = max(0, int(left * 1000 + 0.999))
        for fd, _ev in self._poll.poll(ms):
            if fd == self._my_efd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)
            else:
                return True
        return False

    def _wait_records(self, lane: _Lane, timeout: float | None, watch: Iterable[int]) -> bool:
        """Wait until ``lane`` has a record; False on timeout or a ready watched fd."""
        self._check()
        if lane.available():
            return True
        if self.spin_s:
            end = time.perf_counter() + self.spin_s
            while time.perf_counter() < end:
                if lane.available():
                    return True
        if timeout is not None and timeout <= 0:
            return False
        self._watch(watch)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._sleep(deadline):
                return bool(lane.available())
            if lane.available():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _wait_space(self, lane: _Lane, timeout: float | None, watch: Iterable[int]) -> bool:
        if lane.space():
            return True
        if self.full == "drop" or (timeout is not None and timeout <= 0):
            return False
        self._watch(watch)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._sleep(deadline, _FULL_RECHECK_S):
                return bool(lane.space())
            if lane.space():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    # -- teardown --

    def close(self) -> None:
        """Unmap the ring and close its fds.  Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> _End:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _release_resources(buf: memoryview, mm: mmap.mmap, fds: list[int]) -> None:
    try:
        buf.release()
        mm.close()
    except Exception as exc:  # pragma: no cover - only if a view escaped
        warnings.warn(f"unmapping the control ring failed: {exc}", TeardownWarning, stacklevel=2)
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError as exc:
                warnings.warn(f"closing ring fd {fd} failed: {exc}", TeardownWarning, stacklevel=2)


class PublisherRing(_End):
    """The publisher's end: writes FRAME records, reads RELEASE records.

    Made with :meth:`create`; send :meth:`fds` to the subscriber (``SCM_RIGHTS``),
    which opens its end with :meth:`SubscriberRing.attach`.
    """

    @classmethod
    def create(
        cls,
        num_slots: int,
        *,
        capacity: int | None = None,
        inline_max: int = 256,
        spin_us: float = 0.0,
        full: str = "block",
    ) -> PublisherRing:
        """Create the shared memory (sealed memfd) and the two eventfds.

        Parameters
        ----------
        num_slots:
            Slots of the pool: FRAME and RELEASE records must name one below it.
        capacity:
            Records per lane (a power of two); default: ``num_slots`` rounded up,
            so a channel whose frames each hold a slot can never fill it.
        inline_max:
            Most payload bytes in a FRAME record (a multiple of 8).
        spin_us:
            Microseconds to poll the ring before sleeping in ``poll(2)``
            (0: sleep at once; an idle end then uses no CPU).
        full:
            ``"block"``: a send to a full lane waits (up to its timeout);
            ``"drop"``: it returns False at once.

        Raises
        ------
        UsageError
            A bad layout parameter.
        OSError
            ``memfd_create``/``eventfd`` failed.
        """
        cap = _pow2(num_slots) if capacity is None else capacity
        lay = layout(num_slots, cap, cap, inline_max)
        memfd = pub = sub = -1
        mm = None
        try:
            memfd = os.memfd_create("cupy_ipcpool-ctlring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(memfd, lay["total"])
            fcntl.fcntl(
                memfd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
            )
            mm = mmap.mmap(memfd, lay["total"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _HEADER.pack_into(
                mm,
                0,
                MAGIC,
                VERSION,
                HEADER_BYTES,
                cap,
                cap,
                lay["frame_record"],
                lay["release_record"],
                inline_max,
                num_slots,
                lay["total"],
            )
            pub = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            sub = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            return cls(
                mm,
                memfd,
                pub,
                sub,
                num_slots,
                cap,
                cap,
                inline_max,
                lay,
                spin_us=spin_us,
                full=full,
            )
        except BaseException:
            if mm is not None:
                mm.close()
            for fd in (memfd, pub, sub):
                if fd >= 0:
                    os.close(fd)
            raise

    def fds(self) -> list[int]:
        """``[memfd, publisher eventfd, subscriber eventfd]``, to send with ``SCM_RIGHTS``
        (still owned by this end)."""
        self._check()
        return [self._memfd, self._pub_efd, self._sub_efd]

    def send_frame(
        self,
        seq: int,
        slot: int,
        generation: int,
        payload: bytes = b"",
        *,
        timeout: float | None = None,
        watch: Iterable[int] = (),
    ) -> bool:
        """Append a FRAME record and ring the subscriber; False if the lane stayed full.

        Raises
        ------
        UsageError
            A field out of range (a caller's bug, checked before anything is written).
        ProtocolError
            The subscriber corrupted the lane's tail.
        """
        self._check()
        n = len(payload)
        if n > self.inline_max:
            raise UsageError(f"payload is {n} bytes; this ring carries at most {self.inline_max}")
        if (
            not 0 <= slot < self.num_slots
            or not 0 <= seq <= _U64_MAX
            or not 0 <= generation <= _U32_MAX
        ):
            raise UsageError(
                f"FRAME field out of range: seq {seq}, slot {slot}, generation {generation}"
            )
        lane = self._frame
        if not lane.space() and not self._wait_space(lane, timeout, watch):
            return False
        self._frame_rec.pack_into(
            lane.buf, lane.slot_offset(), lane.pos, seq, slot, generation, 0, n, payload
        )
        lane.commit()
        return True

    def try_recv_release(self) -> tuple[int, int, int] | None:
        """The next RELEASE record as ``(seq, slot, generation)``, or None if none is waiting."""
        self._check()
        lane = self._release
        if not lane.available():
            return None
        pos, seq, slot, generation = _RELEASE.unpack_from(lane.buf, lane.record_offset())
        if pos != lane.pos or slot >= self.num_slots:
            raise ProtocolError(
                f"release lane record {lane.pos}: position {pos}, slot {slot} of {self.num_slots}"
            )
        lane.consumed()
        return seq, slot, generation

    def recv_release(
        self, timeout: float | None = None, *, watch: Iterable[int] = ()
    ) -> tuple[int, int, int] | None:
        """Wait for a RELEASE record; None on timeout or when a ``watch`` fd becomes ready.

        ``watch`` takes the subscriber's socket or pidfd: when one of them is
        readable the wait ends, so the caller can read a control message or
        see that the subscriber is gone.
        """
        if not self._wait_records(self._release, timeout, watch):
            return None
        return self.try_recv_release()


class SubscriberRing(_End):
    """The subscriber's end: reads FRAME records, writes RELEASE records."""

    @classmethod
    def attach(
        cls,
        fds: Sequence[int],
        num_slots: int,
        *,
        spin_us: float = 0.0,
        full: str = "block",
    ) -> SubscriberRing:
        """Open the subscriber's end from the three fds of :meth:`PublisherRing.fds`.

        Takes ownership of the fds (they are closed on failure and by
        :meth:`close`).  ``num_slots`` is what the handshake announced.

        Raises
        ------
        ProtocolError
            The fds are not a sealed memfd and two eventfds, or the header does
            not describe a ring this process can use safely.
        """
        fds = list(fds)
        mm = None
        try:
            if len(fds) != 3:
                raise ProtocolError(f"a control ring comes as 3 fds, got {len(fds)}")
            memfd, pub, sub = fds
            for fd in fds:
                os.set_inheritable(fd, False)
            if not _fd_kind(memfd).startswith("/memfd:"):
                raise ProtocolError(f"ring memory is not a memfd: {_fd_kind(memfd)}")
            for fd in (pub, sub):
                if _fd_kind(fd) != "anon_inode:[eventfd]":
                    raise ProtocolError(f"ring doorbell is not an eventfd: {_fd_kind(fd)}")
            seals = fcntl.fcntl(memfd, fcntl.F_GET_SEALS)
            need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            if seals & need != need:
                raise ProtocolError("ring memfd is not sealed against shrinking and growing")
            size = os.fstat(memfd).st_size
            if not HEADER_BYTES <= size <= MAX_TOTAL:
                raise ProtocolError(f"ring memfd has {size} bytes")
            mm = mmap.mmap(memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            magic, version, hbytes, fcap, rcap, frec, rrec, inline_max, n, total = (
                _HEADER.unpack_from(mm, 0)
            )
            if magic != MAGIC or version != VERSION or hbytes != HEADER_BYTES:
                raise ProtocolError(
                    f"ring header: magic {magic:#x}, version {version}, {hbytes} bytes"
                )
            if n != num_slots:
                raise ProtocolError(f"ring names {n} slots, the handshake {num_slots}")
            try:
                lay = layout(n, fcap, rcap, inline_max)
            except ValueError as exc:
                raise ProtocolError(f"ring header: {exc}") from None
            if (frec, rrec, total) != (
                lay["frame_record"],
                lay["release_record"],
                lay["total"],
            ) or size < total:
                raise ProtocolError(
                    f"ring header does not add up: records {frec}/{rrec} bytes, "
                    f"{total} of {size} bytes"
                )
            counters = [
                _U64.unpack_from(mm, off)[0]
                for off in (_FRAME_HEAD, _FRAME_TAIL, _RELEASE_HEAD, _RELEASE_TAIL)
            ]
            if counters[1:] != [0, 0, 0] or counters[0] > fcap:
                raise ProtocolError(f"a new ring must start empty; counters are {counters}")
            self = cls(
                mm, memfd, pub, sub, n, fcap, rcap, inline_max, lay, spin_us=spin_us, full=full
            )
        except BaseException:
            if mm is not None:
                mm.close()
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        # the mapping holds the memory: the memfd itself is not needed any more
        os.close(memfd)
        self._memfd = -1
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release_resources, self._buf, mm, [sub, pub])
        return self

    def try_recv_frame(self) -> tuple[int, int, int, bytes] | None:
        """The next FRAME record as ``(seq, slot, generation, payload)``, or None."""
        self._check()
        lane = self._frame
        if not lane.available():
            return None
        off = lane.record_offset()
        pos, seq, slot, generation, reserved, n = _FRAME.unpack_from(lane.buf, off)
        if pos != lane.pos or slot >= self.num_slots or reserved or n > self.inline_max:
            raise ProtocolError(
                f"frame lane record {lane.pos}: position {pos}, slot {slot} of {self.num_slots}, "
                f"reserved {reserved}, {n} payload bytes (at most {self.inline_max})"
            )
        payload = bytes(lane.buf[off + _FRAME.size : off + _FRAME.size + n]) if n else b""
        lane.consumed()
        return seq, slot, generation, payload

    def recv_frame(
        self, timeout: float | None = None, *, watch: Iterable[int] = ()
    ) -> tuple[int, int, int, bytes] | None:
        """Wait for a FRAME record; None on timeout or when a ``watch`` fd becomes ready."""
        if not self._wait_records(self._frame, timeout, watch):
            return None
        return self.try_recv_frame()

    def send_release(
        self,
        seq: int,
        slot: int,
        generation: int,
        *,
        timeout: float | None = None,
        watch: Iterable[int] = (),
    ) -> bool:
        """Append a RELEASE record and ring the publisher; False if the lane stayed full."""
        self._check()
        if (
            not 0 <= slot < self.num_slots
            or not 0 <= seq <= _U64_MAX
            or not 0 <= generation <= _U32_MAX
        ):
            raise UsageError(
                f"RELEASE field out of range: seq {seq}, slot {slot}, generation {generation}"
            )
        lane = self._release
        if not lane.space() and not self._wait_space(lane, timeout, watch):
            return False
        _RELEASE.pack_into(lane.buf, lane.slot_offset(), lane.pos, seq, slot, generation)
        lane.commit()
        return True


__all__ = ["MAX_CAPACITY", "MAX_INLINE", "PublisherRing", "SubscriberRing", "layout"]
