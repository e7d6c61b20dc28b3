"""IpcPool: the ring of shareable slots, arrays over slots, export of descriptors.

The pool is the one owner of each slot's life: :meth:`IpcPool.acquire` hands
out a :class:`~._slots.SlotToken` for a slot that no local array, allocator
block, writer or peer lease holds (the bookkeeping is
:class:`~._slots.SlotTable`), and everything that writes a slot —
``pool.next()``, the seed façade, the channel's publisher, the allocator hook
— goes through it.  What ``token.array()`` and ``allocating()`` carve from is
:class:`~._arena.SlotArenas`.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import numpy

from . import _driver
from ._arena import AllocationScope, ReusableView, SlotArenas
from ._args import DeviceLike, device_ordinal
from ._arrays import (
    SlotRef,
    array_info,
    cupy_module,
    make_array,
    normalize_dtype,
    normalize_shape,
    stream_ptr,
)
from ._errors import (
    DescriptorError,
    ForkedProcessError,
    NotShareableError,
    PoolClosedError,
    SlotIndexError,
    StaleHandleError,
    UsageError,
    UsageTypeError,
)
from ._handles import MAX_SLOT_NBYTES, MAX_SLOTS, ArrayHandle, PoolDescriptor
from ._slots import LeaseSource, SlotTable, SlotToken
from ._transport import FdServer, allowed_uid_set, process_start_time
from ._transport._closing import FinalizedResource
from ._vmm import Allocation, UndoStack, release_after_queued_work, round_up

#: Seconds :meth:`IpcPool.acquire`, :meth:`IpcPool.next` and ``Publisher.acquire``
#: wait for a free slot unless told otherwise.
DEFAULT_TIMEOUT = 5.0

TRANSPORTS = ("auto", "pidfd", "socket")


class _PoolMemory:
    """The allocations of a pool; released when closed and no array uses them.

    Arrays hold a :class:`SlotRef` whose ``keepalive`` is this object, so the
    mappings outlive :meth:`IpcPool.close` for as long as an array needs them
    (a leak is preferred to a dangling pointer).
    """

    def __init__(self, num_slots: int, pid: int) -> None:
        self.allocations: list[Allocation] = []
        self.table = SlotTable(num_slots)
        self.table.on_zero = self._on_slot_unused
        #: The slots' arenas and kept arrays (set once the slots are mapped).
        self.arenas: SlotArenas | None = None
        self.pid = pid
        self.close_requested = False
        self.released = False
        self.fd_server: FdServer | None = None

    def _on_slot_unused(self, slot: int) -> None:
        if self.close_requested and not any(self.table.counts):
            self.release()

    def request_close(self) -> None:
        """Release now, or as soon as the last array over the pool is gone."""
        with self.table.lock:
            self.close_requested = True
            # Reusable views the user still holds become counted references (the
            # mapping stays until they are gone); idle ones are simply dropped.
            views = self.table.views
            for slot, view in enumerate(views):
                if view is not None:
                    views[slot] = None
                    if view.in_use():
                        view.owner.count()
                    del view
            if self.fd_server is not None:
                if os.getpid() == self.pid:  # a forked child must not unlink the parent's socket
                    self.fd_server.close()
                self.fd_server = None
            if not any(self.table.counts):
                self.release()

    def release(self) -> None:
        """Unmap and free every allocation (in this process only; never raises)."""
        if self.released:
            return
        self.released = True
        if os.getpid() != self.pid:
            # A forked child owns copies of the fds but no CUDA state.
            for alloc in self.allocations:
                if alloc.fd >= 0:
                    with suppress(OSError):
                        os.close(alloc.fd)
            return
        if self.arenas is not None:
            self.arenas.close()
        release_after_queued_work(self.allocations)


class IpcPool(FinalizedResource):
    """A ring of ``num_slots`` shareable device buffers of ``slot_nbytes`` each.

    Each slot is one ``cuMemCreate`` allocation with the POSIX file-descriptor
    handle type, mapped read-write into its own address range on ``device`` and
    exported as an fd that peers import (see :func:`cupy_ipcpool.attach`).

    Parameters
    ----------
    num_slots:
        Number of slots in the ring (1 .. 65536).  For a stream of frames to
        another process, the slots the producer can run ahead by (the ring
        less what consumers hold) bound how many frames the GPU carries per
        switch between the two processes' contexts: give it at least 8 (see
        docs/performance.md, "Sizing the ring").
    slot_nbytes:
        Usable bytes per slot; each slot's allocation is rounded up to the
        device's allocation granularity (an aligned size is kept as is).
    device:
        CUDA device ordinal, or a ``cupy.cuda.Device``.
    allowed_uids:
        Uids whose processes may fetch the slot fds over the socket transport
        (default: this process's effective uid only).
    socket_path:
        Where the socket transport's fd server listens when it is started
        (default: a private temporary directory).

    Raises
    ------
    UsageError, UsageTypeError
        Bad arguments (checked before anything is allocated); also
        ``ValueError`` / ``TypeError``.
    CudaUnavailableError
        No driver or device.
    UnsupportedDeviceError
        The device lacks VMM or POSIX-fd handle support.
    CudaError
        A driver call failed; nothing is left allocated.

    Notes
    -----
    The pool belongs to the process that created it: using it in a child made
    by ``fork`` raises :class:`ForkedProcessError`.  Share it with a descriptor
    (:meth:`descriptor`) instead.
    """

    def __init__(
        self,
        num_slots: int,
        slot_nbytes: int,
        *,
        device: DeviceLike = 0,
        allowed_uids: Iterable[int] | None = None,
        socket_path: str | None = None,
    ) -> None:
        for name, value in (("num_slots", num_slots), ("slot_nbytes", slot_nbytes)):
            if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
                raise UsageTypeError(f"{name} must be an int, not {type(value).__name__}")
        num_slots, slot_nbytes = int(num_slots), int(slot_nbytes)
        if not 1 <= num_slots <= MAX_SLOTS:
            raise UsageError(f"num_slots must be in 1..{MAX_SLOTS}, got {num_slots}")
        if not 1 <= slot_nbytes <= MAX_SLOT_NBYTES:
            raise UsageError(f"slot_nbytes must be in 1..{MAX_SLOT_NBYTES}, got {slot_nbytes}")
        device = device_ordinal(device)
        self._allowed_uids = allowed_uid_set(allowed_uids, os.geteuid())
        self._socket_path = socket_path

        info = _driver.require_vmm_device(device)
        gran = info.granularity or 0
        alloc_nbytes = round_up(slot_nbytes, gran)
        if alloc_nbytes * num_slots > info.total_memory:
            raise UsageError(
                f"{num_slots} slots of {alloc_nbytes} bytes need "
                f"{alloc_nbytes * num_slots} bytes; device {device} has {info.total_memory}"
            )
        self._device = device
        self._device_uuid = info.uuid
        self._slot_nbytes = slot_nbytes
        self._alloc_nbytes = alloc_nbytes
        self._granularity = gran
        self._pid = os.getpid()
        self._epoch = _driver.fork_epoch()
        self._pool_id = secrets.token_bytes(16)
        self._lock = threading.RLock()
        mem = _PoolMemory(num_slots, self._pid)
        _driver.use_device(device)
        prop = _driver.allocation_prop(device)
        access = [_driver.access_desc(device)]
        with UndoStack() as undo:
            for _ in range(num_slots):
                alloc = Allocation.create(alloc_nbytes, device, prop=prop, access=access)
                undo.push(alloc.close)
                mem.allocations.append(alloc)
            undo.commit()
        self._mem = mem
        self._table = mem.table
        self._ptrs = [a.ptr for a in mem.allocations]
        self._arenas = mem.arenas = SlotArenas(
            mem, mem.table, mem.table.views, self._ptrs, slot_nbytes, device
        )
        self._token: SlotToken | None = None  # the one pool.next() holds
        self._closed = False
        self._finalizer = weakref.finalize(self, mem.request_close)

    # ------------------------------------------------------------------ state
    def _check(self) -> None:
        if _driver._fork_epoch != self._epoch:
            raise ForkedProcessError(
                f"this IpcPool was created in process {self._pid} and cannot be used in "
                f"forked child {os.getpid()}: CUDA state does not survive fork; use the "
                "'spawn' or 'forkserver' start method and pass pool.descriptor() instead"
            )
        if self._closed:
            raise PoolClosedError("the IpcPool is closed")

    def _check_slot(self, slot: int) -> int:
        if not isinstance(slot, (int, numpy.integer)) or isinstance(slot, bool):
            raise UsageTypeError(f"slot must be an int, not {type(slot).__name__}")
        n = len(self._ptrs)
        if not -n <= slot < n:
            raise SlotIndexError(f"slot {slot} out of range for a pool of {n} slots")
        return int(slot) % n

    @property
    def num_slots(self) -> int:
        """Number of slots in the ring."""
        return len(self._ptrs)

    @property
    def slot_nbytes(self) -> int:
        """Usable bytes per slot (as requested)."""
        return self._slot_nbytes

    @property
    def alloc_nbytes(self) -> int:
        """Mapped bytes per slot (``slot_nbytes`` rounded up to the granularity)."""
        return self._alloc_nbytes

    @property
    def granularity(self) -> int:
        """The device's minimum allocation granularity for shareable memory."""
        return self._granularity

    @property
    def device(self) -> int:
        """The CUDA device ordinal the slots live on."""
        return self._device

    @property
    def pool_id(self) -> bytes:
        """16 random bytes identifying this pool instance."""
        return self._pool_id

    @property
    def current(self) -> int:
        """Index of the current slot: the one acquired last (0 before the first)."""
        self._check()
        return self._table.current

    # ------------------------------------------------------------------- ring
    def ptr(self, slot: int | None = None) -> int:
        """Device pointer of ``slot`` (default: the current slot)."""
        self._check()
        return self._ptrs[self._table.current if slot is None else self._check_slot(slot)]

    def fd(self, slot: int | None = None) -> int:
        """The exported POSIX fd of ``slot`` in this process (default: current)."""
        self._check()
        index = self._table.current if slot is None else self._check_slot(slot)
        return self._mem.allocations[index].fd

    def ipc_handle(self, slot: int | None = None) -> tuple[int, int]:
        """``(pid, fd)`` of ``slot`` for a peer's ``pidfd_getfd`` (the seed's handle)."""
        return (self._pid, self.fd(slot))

    def generation(self, slot: int | None = None) -> int:
        """How many times ``slot`` has been acquired for writing."""
        self._check()
        return self._table.generation[
            self._table.current if slot is None else self._check_slot(slot)
        ]

    def local_refs(self, slot: int) -> int:
        """Number of live local owners (arrays, allocator blocks) in ``slot``."""
        return self._table.local_refs(self._check_slot(slot))

    def remote_leases(self, slot: int) -> int:
        """Number of peer leases held on ``slot`` (over every registered lease source)."""
        return self._table.leases(self._check_slot(slot))

    def is_busy(self, slot: int) -> bool:
        """True while an array, allocator block, open token or peer lease holds ``slot``."""
        return self._table.is_busy(self._check_slot(slot))

    def acquire(
        self,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        stream: Any = None,
        slot: int | None = None,
    ) -> SlotToken:
        """Take a free slot for writing and return its :class:`SlotToken`.

        The slot is the first free one after the current slot, round-robin
        (or exactly ``slot``); it becomes the current slot and its generation
        is bumped.  A slot is free when no local array, allocator block, open
        token or peer lease holds it (leases that came back are taken in when
        no slot is known to be free, all at once).  While none is free the call waits —
        without polling: local releases and returned leases wake it — for at
        most ``timeout`` seconds (``None``: no limit, ``0``: not at all).

        Parameters
        ----------
        timeout:
            Seconds to wait for a free slot.
        stream:
            The stream that will write the slot: a CuPy stream, an object with
            ``__cuda_stream__``, a torch stream or a raw ``cudaStream_t``
            (default: CuPy's current stream).  It is made to wait, on the GPU,
            for every peer that read the slot (registered lease sources); the
            host does not block.
        slot:
            Take this slot rather than the next free one.

        Returns
        -------
        SlotToken
            Use it as a context manager; ``token.array()``,
            ``token.allocating()`` and ``token.handle()`` work in its slot.

        Raises
        ------
        SlotBusyError
            Nothing became free in time; the message says who holds what.
        PoolClosedError, ForkedProcessError
            The pool is closed, or this is a forked child.
        """
        if self._closed or _driver._fork_epoch != self._epoch:
            self._check()  # raises
        if slot is not None:
            slot = self._check_slot(slot)
        ptr = stream_ptr(stream)
        table = self._table
        index, generation = table.take(timeout, slot)
        token = SlotToken(self, index, generation, stream, ptr)
        sources = table.sources
        if sources:
            try:
                for source in sources:
                    source.order_write(index, ptr)
            except BaseException:
                token.release()
                raise
        return token

    def next(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> int:
        """Advance to the next free slot of the ring (the seed's ``next()``); return its index.

        A thin wrapper over :meth:`acquire`: the pool releases the token it
        took at the previous ``next()`` and keeps the new one (so the slot
        stays reserved for you until the next call), and the current slot is
        the returned one.  Busy slots are skipped; while every slot is busy it
        waits up to ``timeout`` seconds, like :meth:`acquire`.

        Raises
        ------
        SlotBusyError
            Every slot is still held when the timeout expires.
        """
        self._check()
        with self._lock:
            previous, self._token = self._token, None
            if previous is not None:
                previous.release()
            self._token = self.acquire(timeout=timeout)
            return self._token.slot

    def add_lease_source(self, source: LeaseSource) -> None:
        """Count the peer leases of ``source`` (a :class:`~._slots.LeaseSource`) as holding slots.

        A :class:`~cupy_ipcpool.Publisher` registers itself here while it is
        open; anything else that lends slots to peers can do the same.
        """
        self._check()
        if not isinstance(source, LeaseSource):
            raise UsageTypeError(
                f"{type(source).__name__} is not a lease source: it needs leases(slot), "
                "collect(timeout) and order_write(slot, stream)"
            )
        self._table.add_source(source)

    def remove_lease_source(self, source: LeaseSource) -> None:
        """Stop counting the leases of ``source``.  Idempotent."""
        self._table.remove_source(source)

    def notify_released(self) -> None:
        """Wake threads waiting in :meth:`acquire`: a lease came back outside it."""
        self._table.notify()

    def _release_writer(self, slot: int) -> None:
        self._table.release_writer(slot)

    # ----------------------------------------------------------------- arrays
    def _owner(self, slot: int) -> SlotRef:
        return SlotRef(self._mem, self._table, slot)

    def array(
        self,
        shape: Any = None,
        dtype: Any = numpy.float64,
        *,
        slot: int | None = None,
        offset: int = 0,
        strides: tuple[int, ...] | None = None,
    ) -> Any:
        """A ``cupy.ndarray`` view of a region of a slot (default: the whole current slot).

        A view, not an allocation: two calls may overlap.  For non-overlapping
        new arrays use ``token.array()`` or ``allocating()``.

        Parameters
        ----------
        shape:
            Array shape; default: as many items of ``dtype`` as fit in the slot.
        dtype:
            A numeric numpy dtype (default ``float64``, as ``cupy.empty``).
        slot:
            Slot index (default: the current slot).
        offset:
            Byte offset from the slot start (a multiple of the item size).
        strides:
            Byte strides (default: C-contiguous).

        Raises
        ------
        DescriptorError
            The region does not fit in the slot or is misaligned.
        """
        self._check()
        index = self._table.current if slot is None else self._check_slot(slot)
        dt = normalize_dtype(dtype)
        if shape is None:
            shape = ((self._slot_nbytes - offset) // dt.itemsize,)
        return make_array(
            self._ptrs[index],
            self._slot_nbytes,
            self._owner(index),
            self._device,
            normalize_shape(shape),
            dt,
            int(offset),
            strides,
        )

    def _kept_view(self, slot: int) -> ReusableView | None:
        """``slot``'s reusable view (what ``token.array`` hands out again), or None.

        For the channel's publisher, which caches a view's wire form on it.
        """
        return self._table.views[slot]

    def locate(self, ptr: int) -> tuple[int, int] | None:
        """Return ``(slot, offset)`` of a device pointer inside the pool, or None."""
        ptrs, size = self._ptrs, self._slot_nbytes
        current = self._table.current
        base = ptrs[current]
        if base <= ptr < base + size:  # the common case: the current slot
            return current, ptr - base
        for i, base in enumerate(ptrs):
            if base <= ptr < base + size:
                return i, ptr - base
        return None

    def handle(self, array: Any) -> ArrayHandle:
        """The :class:`ArrayHandle` of an array whose memory lies in the pool.

        ``array`` is any device array: a ``cupy.ndarray``, or any object with
        ``__cuda_array_interface__`` or ``__dlpack__`` (torch tensors
        included).  Views, slices and non-contiguous strides work; a peer
        rebuilds exactly this array with ``peer.array(handle)``.

        Raises
        ------
        NotShareableError
            The array's memory is not (entirely) inside one slot of this pool,
            or it is no device array.
        """
        self._check()
        info = array_info(array)
        where = self.locate(info.ptr)
        if where is None:
            raise NotShareableError(
                f"array at 0x{info.ptr:x} does not lie in this pool's slots; allocate it with "
                "token.array(), pool.array() or under allocating()"
            )
        slot, offset = where
        try:
            handle = ArrayHandle(
                slot=slot,
                generation=self._table.generation[slot],
                offset=offset,
                shape=info.shape,
                strides=info.strides,
                dtype=info.dtype,
            )
            handle.check_fits(self._slot_nbytes)
        except DescriptorError as exc:
            raise NotShareableError(f"array extends beyond slot {slot}: {exc}") from None
        return handle

    def array_from_handle(self, handle: ArrayHandle) -> Any:
        """Rebuild the array of ``handle`` in this process (checks generation and bounds)."""
        self._check()
        slot = self._check_slot(handle.slot)
        current = self._table.generation[slot]
        if handle.generation != current:
            raise StaleHandleError(
                f"handle for slot {slot} is of generation {handle.generation}; the slot is "
                f"now at generation {current}"
            )
        return self.array(
            handle.shape, handle.dtype, slot=slot, offset=handle.offset, strides=handle.strides
        )

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.num_slots))

    def __len__(self) -> int:
        return self.num_slots

    # ---------------------------------------------------------------- sharing
    def descriptor(self, *, transport: str = "auto") -> PoolDescriptor:
        """Everything a peer needs to :func:`~cupy_ipcpool.attach` this pool.

        ``transport`` is ``"pidfd"`` (peers fetch fds with ``pidfd_getfd``),
        ``"socket"`` or ``"auto"`` (both offered): the latter two start an fd
        server on a Unix socket (mode 0600, peers' uid checked).

        Notes
        -----
        A descriptor is a live capability: whoever holds it (and passes the
        transport's checks) can read and write the pool's memory.
        """
        self._check()
        if transport not in TRANSPORTS:
            raise UsageError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        path = None
        if transport != "pidfd":
            path = self._ensure_fd_server().path
        return PoolDescriptor(
            pool_id=self._pool_id,
            exporter_pid=self._pid,
            exporter_start_time=process_start_time(self._pid),
            exporter_uid=os.geteuid(),
            device_uuid=self._device_uuid,
            device_ordinal=self._device,
            num_slots=self.num_slots,
            slot_nbytes=self._slot_nbytes,
            alloc_nbytes=self._alloc_nbytes,
            fds=tuple(a.fd for a in self._mem.allocations),
            socket_path=path,
        )

    def _ensure_fd_server(self) -> FdServer:
        with self._lock:
            if self._mem.fd_server is None:
                self._mem.fd_server = FdServer(
                    [a.fd for a in self._mem.allocations],
                    token=self._pool_id,
                    path=self._socket_path,
                    allowed_uids=self._allowed_uids,
                )
            return self._mem.fd_server

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Release the slots: unmap, free address ranges, release handles, close fds.

        Idempotent and never raises.  Arrays still alive keep their slot memory
        mapped until they are garbage collected; the release happens then.
        """
        if self._closed:
            return
        self._closed = True
        self._finalize("IpcPool")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"current={self._table.current}"
        return (
            f"IpcPool(num_slots={self.num_slots}, slot_nbytes={self._slot_nbytes}, "
            f"device={self._device}, {state})"
        )

    # ------------------------------------------------------------- allocator
    def allocating(self, *, overflow: str = "raise") -> Any:
        """Place this thread's CuPy allocations inside the current slot.

        Installs (for this thread only, nesting, restored on exit also after an
        exception — the semantics of ``cupy.cuda.using_allocator``) an
        allocator that carves every CuPy allocation out of the slot's arena,
        temporaries included; a block's space is reused once CuPy drops it,
        ordered by stream (see :class:`~._arena.SlotArena`).  Yields an
        :class:`~._arena.AllocationScope`.

        Parameters
        ----------
        overflow:
            ``"raise"`` (default): an allocation that does not fit raises
            :class:`SlotFullError` naming the requested and remaining bytes.
            ``"spill"``: it goes to the allocator that was current when the
            block was entered (CuPy's pool, RMM, ...), counted in the scope's
            ``spills``; ``pool.handle()`` of such an array raises
            :class:`NotShareableError`.
        """
        self._check()
        with self._table.lock:
            slot = self._table.current
        return self._allocating(slot, overflow)

    @contextmanager
    def _allocating(self, slot: int, overflow: str) -> Iterator[AllocationScope]:
        self._check()
        scope = self._arenas.scope(slot, overflow)
        cp = cupy_module()
        with cp.cuda.Device(self._device), cp.cuda.using_allocator(scope._allocate):
            yield scope
