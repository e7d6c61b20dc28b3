"""Cross-process GPU ordering with stream memory operations on a shared flag page.

A :class:`SyncPage` holds 32-bit flags in a page of *host* memory shared by
the publisher and its subscribers (a sealed memfd, :class:`SharedFlags`),
registered with CUDA in each process (``cuMemHostRegister``, ``DEVICEMAP |
PORTABLE``) so that their streams can write and wait on it:

* one *frame flag* per slot: the producer's stream writes the slot's
  generation there after the kernels that filled it
  (``cuStreamWriteValue32``); a subscriber's stream waits until the flag has
  reached that generation (``cuStreamWaitValue32`` with ``GEQ``) before its
  work touches the frame;
* one *read flag* per (subscriber row, slot): the subscriber's stream writes
  the generation it read there when it releases the frame; before the
  producer writes the slot again, its stream waits for every reader's flag.

Neither host blocks.  Because the flags are in host memory, each side first
looks at the flag itself (:meth:`SyncPage.order`): when it already holds the
value — the frame flag has usually landed by the time the subscriber receives
the frame, and a reader's release long before the producer comes round the
ring to that slot again — no wait is enqueued at all.  A write is made with a
memory barrier (the driver's default), so once the host sees the value, the
work before the write is done and its memory visible to every device.
In device memory the host could not look at a flag, and every frame would
need both waits on the GPU; interprocess CUDA events would make a host block.
(docs/performance.md, "The floors", says where the ordering's cost comes
from; how much a skipped wait saves is not in its committed results.)

The comparison is the driver's cyclic ``(int32_t)(*flag - value) >= 0``, so
generations may wrap around 2**32.  The stream memory operations go through
:mod:`cupy_ipcpool._fastpath` (compiled), not the binding.

When a peer dies, the flags it would have written never come, and a stream
of the survivor may be waiting for one: the survivor writes them itself
from the host (the page is shared host memory), so that every queued wait
ends and the page can be unregistered and unmapped.  A frame flag forced that
way holds the last generation the producer really wrote there plus
:data:`FORCED` (:meth:`SharedFlags.force_frame`), so every process that maps
the page can tell, for each frame of that slot, whether the producer's stream
wrote it before it died (:func:`frame_state`, :class:`FrameWaits`); a read
flag is forced to the generation the producer may wait for (the engine's
rows of read flags, :func:`~._settle.reader_rows`).  Those parts need no GPU.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from .. import _driver
from .._compiled import loader
from .._errors import UsageError

if TYPE_CHECKING:  # the engine is loaded at first use (_engine below)
    from .._engine import FrameBook

_FLAG = 4
#: Read-flag rows start at this alignment after the frame flags.
_READS_ALIGN = 256
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_HALF = 1 << 31
_MASK = 0xFFFFFFFF
#: Most operations one cuStreamBatchMemOp takes ("count must be less than 256").
_MAX_BATCH = 255
#: Added to the frame flag's last real value when a survivor forces a flag that the
#: producer, dead, never set (:meth:`SharedFlags.force_frame`): far enough ahead of
#: every real value to be told apart (:func:`frame_state`), close enough to satisfy
#: every wait queued on that flag (cyclic), this subscriber's and others'.
FORCED = 3 << 29
#: Distance (cyclic) from a frame's generation below which the flag counts as the
#: producer's own write; from here to :data:`FORCED` it was forced before the frame
#: was written, from :data:`FORCED` to 2**31 forced after it was.
_SET_WINDOW = 1 << 29
#: Most frames a :class:`FrameWaits` records as not yet seen complete.
RECORD_CAP = 65536

#: The engine, loaded at the first use of a rule it keeps (layout, flag states, forcing),
#: built for these constants (:mod:`._protocol` and :mod:`._payload` check their own).
_engine = loader(
    "cupy_ipcpool._engine",
    SYNC_FORCED=FORCED,
    SYNC_SET_WINDOW=_SET_WINDOW,
    SYNC_READS_ALIGN=_READS_ALIGN,
    SYNC_RECORD_CAP=RECORD_CAP,
)
#: :func:`frame_state`'s answer for the engine's (``cip_flag_state``).
_STATES: dict[int, bool | None] = {1: True, 0: False, -1: None}


def frame_state(word: int, generation: int) -> bool | None:
    """What frame flag value ``word`` says about the frame of ``generation``.

    With ``d = (word - generation) mod 2**32``:

    ============================  =====  ===========================================
    ``d``                         says   because
    ============================  =====  ===========================================
    ``[2**31, 2**32)``            None   not set yet (the producer's stream is behind)
    ``[0, 2**29)``                True   the producer's stream set it (at or after
                                         ``generation``)
    ``[2**29, FORCED)``           False  forced after the death to ``w + FORCED``
                                         with ``w < generation``: never written
    ``[FORCED, 2**31)``           True   forced with ``w >= generation``: the
                                         producer wrote this frame before it died
    ============================  =====  ===========================================

    Returns
    -------
    bool or None
        True: the producer's stream set the flag for this frame, so its writes
        to the frame had finished.  False: it died before that, and a survivor
        forced the flag (:meth:`SharedFlags.force_frame`): the frame's contents
        are whatever the producer's kernels had written by then.  None: not
        set yet.  The engine's rule (``cip_flag_state``), the C subscriber's too.
    """
    return _STATES[_engine().flag_state(word, generation)]


class FlagLayout:
    """Where the flags of a channel lie in its page.

    Frame flags first (one per slot), then ``max_subscribers`` rows of
    ``num_slots`` read flags, starting 256-byte aligned; the page is a whole
    number of host pages.
    """

    __slots__ = ("max_subscribers", "nbytes", "num_slots", "reads_offset")

    def __init__(self, num_slots: int, max_subscribers: int) -> None:
        self.num_slots = num_slots
        self.max_subscribers = max_subscribers
        # the engine's layout (cip_sync_layout): it refuses counts out of range
        self.reads_offset, self.nbytes = _engine().sync_layout(num_slots, max_subscribers)

    def frame_offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s frame flag."""
        return slot * _FLAG

    def read_offset(self, row: int, slot: int) -> int:
        """Byte offset of subscriber row ``row``'s read flag for ``slot``."""
        return self.reads_offset + (row * self.num_slots + slot) * _FLAG


class SharedFlags:
    """The host side of a flag page: a sealed memfd mapped read-write.

    No GPU is involved here: the page is created by the publisher
    (:meth:`create`), received by a subscriber as an fd and checked before it
    is mapped (:meth:`open`), and read with :meth:`load` / :meth:`reached`.

    Attributes
    ----------
    address:
        The host address of the mapping.
    nbytes:
        Its size.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._fd = fd
        self.nbytes = nbytes
        self._words = memoryview(self._mm).cast("I")
        #: The page as native 32-bit words (what :class:`SyncPage` reads per frame).
        self.words = self._words
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping lives

    @classmethod
    def create(cls, nbytes: int) -> SharedFlags:
        """A zeroed page of ``nbytes`` in a new memfd, sealed against shrinking and growing
        (the engine's, ``cip_sync_create``, as :meth:`open` checks it)."""
        fd = _engine().sync_create(nbytes)
        try:
            return cls(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, fd: int, nbytes: int) -> SharedFlags:
        """Map a page received from the publisher; ``fd`` stays owned by the caller.

        Raises
        ------
        ProtocolError
            ``fd`` is no memfd sealed against shrinking and growing (the
            publisher could otherwise truncate it under this process), or its
            size is not ``nbytes``.
        """
        _engine().check_sync_fd(fd, nbytes)  # the engine's check, the C subscriber's too
        own = os.dup(fd)
        try:
            return cls(own, nbytes)
        except BaseException:
            os.close(own)
            raise

    @property
    def fd(self) -> int:
        """The memfd (owned by this object until :meth:`close`)."""
        return self._fd

    @property
    def mapping(self) -> mmap.mmap:
        """The page's host mapping: the buffer the engine reads flags from (see close)."""
        return self._mm

    def load(self, offset: int) -> int:
        """The 32-bit flag at byte ``offset`` (one aligned load)."""
        return int(self._words[offset >> 2])

    def store(self, offset: int, value: int) -> None:
        """Set the flag at ``offset`` from the host (tests and tools; the GPU writes flags)."""
        self._words[offset >> 2] = value & _MASK

    def reached(self, offset: int, value: int) -> bool:
        """True when the flag at ``offset`` is at or past ``value`` (cyclic, as on the GPU)."""
        return ((self._words[offset >> 2] - value) & _MASK) < _HALF

    def force_frame(self, offset: int, awaited: int) -> bool:
        """Force the frame flag at ``offset`` that a dead producer never set to ``awaited``.

        Unless the flag has reached ``awaited`` already (cyclic), its current
        value ``w`` -- the last generation the producer's stream really wrote
        there -- becomes ``w +`` :data:`FORCED`: every wait queued on the flag
        (for ``awaited`` or any generation near it, by any process) then goes
        on, and :func:`frame_state` tells each frame of the slot apart: at or
        before ``w`` written, after it not.  A flag another survivor forced
        already has reached ``awaited`` and is left alone.  Call only once the
        producer is dead.  True if stored.  The engine's ``cip_flag_force`` (a
        compare-and-swap), the C subscriber's too.
        """
        # a closed page's mmap gives no buffer (ValueError), as its words give no value
        return bool(_engine().flag_force(self._mm, offset, awaited))

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._fd < 0

    def close(self) -> None:
        """Unmap and close the fd (idempotent)."""
        if self._fd < 0:
            return
        self._words.release()
        self._mm.close()
        os.close(self._fd)
        self._fd = -1


class FrameWaits:
    """The frame flags a subscriber's streams may still be waiting on (no GPU here).

    Per slot, the generation of the last wait enqueued on a frame flag
    (:meth:`note`, per frame that had to wait), and a bounded record of the
    frames received that the host has not seen complete yet (:meth:`track`).
    When the producer dies, :meth:`resolve` forces the flags it never wrote,
    so that those waits end, and :meth:`answers` names the frames that were
    not written; :meth:`freeze` keeps the frame flags' last values for
    :meth:`state` and :meth:`answers` once the page is unmapped.  The
    engine's frame book (``c/src/book.c``, ``_engine.FrameBook``) keeps all of
    it, as it does for the C subscriber.

    Parameters
    ----------
    layout:
        The page's layout.
    record_cap:
        Most frames the record holds; past it the oldest is dropped and
        counted in :attr:`untracked`.
    """

    __slots__ = ("_book",)

    def __init__(self, layout: FlagLayout, *, record_cap: int = RECORD_CAP) -> None:
        self._book: FrameBook = _engine().FrameBook(layout.num_slots, record_cap=record_cap)

    def __len__(self) -> int:
        """Frames in the record."""
        return len(self._book)

    @property
    def record(self) -> tuple[tuple[int, int, int], ...]:
        """``(seq, slot, generation)`` of frames received whose flag the host did not
        see set by the producer, oldest first (see :meth:`track`)."""
        return self._book.record

    @property
    def generations(self) -> list[int]:
        """Per slot: the generation last waited for (low 32 bits), or -1."""
        return self._book.generations

    @property
    def final(self) -> list[int] | None:
        """The frame flags as they were when the page was unmapped, else None."""
        return self._book.final

    @property
    def forced(self) -> int:
        """How many frame flags :meth:`resolve` forced so far."""
        return self._book.forced

    @property
    def untracked(self) -> int:
        """Frames dropped from the record because it was full: not in :meth:`answers`."""
        return self._book.untracked

    @property
    def record_cap(self) -> int:
        """Most frames the record holds."""
        return self._book.record_cap

    def note(self, slot: int, generation: int) -> None:
        """A stream was made to wait for ``slot``'s frame flag to reach ``generation``."""
        self._book.note(slot, generation)

    def track(self, flags: SharedFlags, seq: int, slot: int, generation: int) -> None:
        """:meth:`note`, and record frame ``seq``: its flag was not seen set when received.

        First drops from the front of the record the frames whose flags the
        host now sees set by the producer (:meth:`prune`); a full record drops
        its oldest frame and counts it in :attr:`untracked`.  A frame whose flag
        the producer has set by now is neither noted nor recorded (complete).
        """
        self._book.received(flags._mm, seq, slot, generation)

    def prune(self, flags: SharedFlags) -> None:
        """Drop from the front of the record the frames the producer's stream has set.

        A flag that was forced is never taken for the producer's own write (it
        stays, for :meth:`answers`), so pruning is safe at any time.
        """
        self._book.prune(flags._mm)

    def pending(self, flags: SharedFlags) -> list[int]:
        """The slots whose last awaited generation the host does not see set yet."""
        return self._book.pending(flags._mm)

    def resolve(self, flags: SharedFlags) -> list[int]:
        """Force every frame flag still awaited (``cip_flag_force``).

        Call only once the producer is dead (or given up on): afterwards every
        stream wait this subscriber enqueued can end.  Returns the slots forced.
        """
        return self._book.resolve(flags._mm)

    def freeze(self, flags: SharedFlags) -> None:
        """Keep the frame flags' values, for :meth:`state` after the page is unmapped."""
        self._book.freeze(flags._mm)

    def _readable(self, flags: SharedFlags | None) -> bool:
        return self._book.final is not None or (flags is not None and not flags.closed)

    def state(self, flags: SharedFlags | None, slot: int, generation: int) -> bool | None:
        """:func:`frame_state` of ``slot``'s frame flag for ``generation`` (live, or frozen)."""
        if not self._readable(flags):
            return None
        return _STATES[self._book.state(flags._mm if flags is not None else None, slot, generation)]

    def answers(self, flags: SharedFlags | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(incomplete, pending)``: seqs of the recorded frames by :meth:`state`.

        ``incomplete``: frames the producer never wrote (False: forced after
        its death).  ``pending``: frames whose flag is not set yet (None), or
        every recorded frame while no flag can be read.  Every other frame
        received (the record's pruned ones, and those whose flag was set when
        they arrived) is complete; :attr:`untracked` frames are not known here.
        """
        if not self._readable(flags):
            return (), tuple(seq for seq, _slot, _generation in self._book.record)
        return self._book.answers(flags._mm if flags is not None else None)


def _memops() -> tuple[object, int, int, int, int, object, int]:
    """``(_fastpath.memop, write pointer, wait pointer, write flags, wait flags,
    _fastpath.wait_all, cuStreamBatchMemOp pointer)``."""
    from .._compiled import load

    fastpath = load("cupy_ipcpool._fastpath", MAX_BATCH=_MAX_BATCH)
    memop, wait_all = fastpath.memop, fastpath.wait_all
    write_fn, wait_fn = _driver.memop_pointers()
    driver = _driver.driver_module()
    return (
        memop,
        write_fn,
        wait_fn,
        int(driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
        int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
        wait_all,
        _driver.batch_memop_pointer(),
    )


class SyncPage:
    """The flags of one channel, mapped for the host and for ``device``'s streams.

    Parameters
    ----------
    flags:
        The host mapping (created here or received from the publisher); the
        page owns it from now on.
    layout:
        Where the flags lie.
    device:
        The device whose streams write and wait on the flags (the page is
        registered ``PORTABLE``, so other devices' streams may use it too).
    """

    def __init__(self, flags: SharedFlags, layout: FlagLayout, device: int) -> None:
        if flags.nbytes < layout.nbytes:
            raise UsageError("sync page too small for its layout")
        self.flags = flags
        self.layout = layout
        self.num_slots = layout.num_slots
        self.max_subscribers = layout.max_subscribers
        (
            self._memop,
            self._write_fn,
            self._wait_fn,
            self._plain,
            self._geq,
            self._wait_all,
            self._batch_fn,
        ) = _memops()
        driver = _driver.driver_module()
        _driver.use_device(device)
        reg = driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP
        _driver.call("cuMemHostRegister", flags.address, flags.nbytes, reg)
        try:
            self._base = int(_driver.call("cuMemHostGetDevicePointer", flags.address, 0))
        except BaseException:
            _driver.call("cuMemHostUnregister", flags.address)
            raise
        self._registered = True
        self._words = flags.words

    @classmethod
    def create(cls, num_slots: int, max_subscribers: int, device: int) -> SyncPage:
        """A zeroed page for this layout, registered for ``device``."""
        layout = FlagLayout(num_slots, max_subscribers)
        flags = SharedFlags.create(layout.nbytes)
        try:
            return cls(flags, layout, device)
        except BaseException:
            flags.close()
            raise

    @classmethod
    def import_fd(cls, fd: int, num_slots: int, max_subscribers: int, device: int) -> SyncPage:
        """Map and register the publisher's page from ``fd`` (which stays owned by the caller).

        Raises
        ------
        ProtocolError
            The fd is not a sealed memfd of exactly the layout's size.
        """
        layout = FlagLayout(num_slots, max_subscribers)
        flags = SharedFlags.open(fd, layout.nbytes)
        try:
            return cls(flags, layout, device)
        except BaseException:
            flags.close()
            raise

    @property
    def fd(self) -> int:
        """The page's memfd (sent to subscribers in the WELCOME)."""
        return self.flags.fd

    @property
    def nbytes(self) -> int:
        """The page's size in bytes."""
        return self.flags.nbytes

    def frame_flag(self, slot: int) -> int:
        """Device address of ``slot``'s frame flag."""
        return self._base + self.layout.frame_offset(slot)

    def read_flag(self, index: int, slot: int) -> int:
        """Device address of subscriber row ``index``'s read flag for ``slot``."""
        return self._base + self.layout.read_offset(index, slot)

    def reached(self, addr: int, value: int) -> bool:
        """True when the flag at device address ``addr`` already holds ``value`` or later."""
        return self.flags.reached(addr - self._base, value)

    @property
    def write_op(self) -> tuple[int, int]:
        """``(function pointer, flags)`` of :meth:`write`'s driver call, for a compiled caller.

        the engine's ``release_frame`` makes the subscriber's read-flag write and
        its RELEASE in one call; it takes the ``cuStreamWriteValue32``
        pointer and flags from here.
        """
        return self._write_fn, self._plain

    def write(self, stream: int, addr: int, value: int) -> None:
        """Enqueue on ``stream``: after prior work and a memory barrier, store ``value``."""
        rc = self._memop(self._write_fn, stream, addr, value, self._plain)  # type: ignore[operator]
        if rc:
            raise_driver_error("cuStreamWriteValue32", rc)

    def wait(self, stream: int, addr: int, value: int) -> None:
        """Enqueue on ``stream``: wait until the flag at ``addr`` reaches ``value`` (cyclic)."""
        rc = self._memop(self._wait_fn, stream, addr, value, self._geq)  # type: ignore[operator]
        if rc:
            raise_driver_error("cuStreamWaitValue32", rc)

    def order(self, stream: int, addr: int, value: int) -> bool:
        """Order ``stream`` after the frame flag at ``addr`` reaching ``value``; True if it waits.

        A wait is enqueued on the GPU (and True returned) unless the host
        already sees the value set by the producer (:func:`frame_state`'s
        first window): the write that set it came after a memory barrier, so
        the work it stands for is done and visible.
        """
        # per frame: the host's look and wait() written out (two calls fewer).  Only
        # the producer's own write counts (frame_state's first window): a flag that
        # a survivor forced, the producer dead, is waited on (the wait ends at once)
        # so that the caller notes and records the frame like any it waited for.
        if ((self._words[(addr - self._base) >> 2] - value) & _MASK) < _SET_WINDOW:
            return False
        rc = self._memop(self._wait_fn, stream, addr, value, self._geq)  # type: ignore[operator]
        if rc:
            raise_driver_error("cuStreamWaitValue32", rc)
        return True

    def order_all(self, stream: int, addrs: Sequence[int], value: int) -> int:
        """:meth:`order` for several flags and one value; return the GPU waits enqueued.

        The flags the host does not see at ``value`` yet are waited on with one
        :meth:`wait` when there is one, else in one ``cuStreamBatchMemOp`` (255
        per call), not one driver call each: the publisher's stream waits on the
        read flag of every subscriber that read the slot it reuses.
        """
        words = self._words
        base = self._base
        # the host's look of SharedFlags.reached(), per flag (read flags are never
        # forced past their value: no window here)
        pending = [a for a in addrs if ((words[(a - base) >> 2] - value) & _MASK) >= _HALF]
        if len(pending) == 1:
            self.wait(stream, pending[0], value)
        elif pending:
            for i in range(0, len(pending), _MAX_BATCH):
                chunk = pending[i : i + _MAX_BATCH]
                rc = self._wait_all(self._batch_fn, stream, chunk, value, self._geq)  # type: ignore[operator]
                if rc:
                    raise_driver_error("cuStreamBatchMemOp", rc)
        return len(pending)

    def close(self) -> None:
        """Unregister and unmap (idempotent, never raises).

        The caller makes sure no stream still has an operation on the page queued.
        """
        if self._registered:
            self._registered = False
            try:
                _driver.call("cuMemHostUnregister", self.flags.address)
            except Exception:
                # still registered: leave the mapping in place rather than unmap
                # memory the driver may touch, and keep it from being collected
                # (collecting the mmap would unmap it under the registration)
                _STILL_REGISTERED.append(self.flags)
                return
        self.flags.close()


#: Mappings whose unregistration failed: kept for the life of the process.
_STILL_REGISTERED: list[SharedFlags] = []


def raise_driver_error(call: str, rc: int) -> NoReturn:
    """Raise the library's exception for the driver's nonzero CUresult ``rc`` from ``call``."""
    driver = _driver.driver_module()
    _driver.check(call, (driver.CUresult(rc),))
    raise AssertionError(f"{call} returned {rc}, which is not an error")  # pragma: no cover
