"""IpcPool: the ring of shareable slots, arrays over slots, export of descriptors."""

from __future__ import annotations

import os
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from types import TracebackType
from typing import Any

import numpy

from . import _driver
from ._arrays import SlotRef, SlotRefs, make_array, normalize_dtype, normalize_shape
from ._errors import (
    ForkedProcessError,
    NotShareableError,
    PoolClosedError,
    SlotBusyError,
    StaleHandleError,
    TeardownWarning,
)
from ._handles import MAX_SLOT_NBYTES, MAX_SLOTS, ArrayHandle, PoolDescriptor
from ._transport import FdServer, process_start_time
from ._vmm import Allocation, UndoStack, round_up

TRANSPORTS = ("auto", "pidfd", "socket")


class _PoolMemory:
    """The allocations of a pool; released when closed and no array uses them.

    Arrays hold a :class:`SlotRef` whose ``keepalive`` is this object, so the
    mappings outlive :meth:`IpcPool.close` for as long as an array needs them
    (a leak is preferred to a dangling pointer).
    """

    def __init__(self, num_slots: int, pid: int) -> None:
        self.allocations: list[Allocation] = []
        self.refs = SlotRefs(num_slots)
        self.refs.on_zero = self._on_slot_unused
        self.pid = pid
        self.close_requested = False
        self.released = False
        self.fd_server: FdServer | None = None

    def _on_slot_unused(self, slot: int) -> None:
        if self.close_requested and not any(self.refs.counts):
            self.release()

    def request_close(self) -> None:
        """Release now, or as soon as the last array over the pool is gone."""
        with self.refs.cond:
            self.close_requested = True
            if self.fd_server is not None:
                if os.getpid() == self.pid:  # a forked child must not unlink the parent's socket
                    self.fd_server.close()
                self.fd_server = None
            if not any(self.refs.counts):
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
        for alloc in self.allocations:
            alloc.close()


class IpcPool:
    """A ring of ``num_slots`` shareable device buffers of ``slot_nbytes`` each.

    Each slot is one ``cuMemCreate`` allocation with the POSIX file-descriptor
    handle type, mapped read-write into its own address range on ``device`` and
    exported as an fd that peers import (see :func:`cupy_ipcpool.attach`).

    Parameters
    ----------
    num_slots:
        Number of slots in the ring (1 .. 65536).
    slot_nbytes:
        Usable bytes per slot; each slot's allocation is rounded up to the
        device's allocation granularity (an aligned size is kept as is).
    device:
        CUDA device ordinal.
    allowed_uids:
        Uids whose processes may fetch the slot fds over the socket transport
        (default: this process's effective uid only).
    socket_path:
        Where the socket transport's fd server listens when it is started
        (default: a private temporary directory).

    Raises
    ------
    ValueError, TypeError
        Bad arguments (checked before anything is allocated).
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
        device: int = 0,
        allowed_uids: Iterable[int] | None = None,
        socket_path: str | None = None,
    ) -> None:
        for name, value in (
            ("num_slots", num_slots),
            ("slot_nbytes", slot_nbytes),
            ("device", device),
        ):
            if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        num_slots, slot_nbytes, device = int(num_slots), int(slot_nbytes), int(device)
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in 1..{MAX_SLOTS}, got {num_slots}")
        if not 1 <= slot_nbytes <= MAX_SLOT_NBYTES:
            raise ValueError(f"slot_nbytes must be in 1..{MAX_SLOT_NBYTES}, got {slot_nbytes}")
        if device < 0:
            raise ValueError(f"device must be a non-negative ordinal, got {device}")
        self._allowed_uids = (
            frozenset({os.geteuid()}) if allowed_uids is None else frozenset(allowed_uids)
        )
        self._socket_path = socket_path

        info = _driver.require_vmm_device(device)
        gran = info.granularity or 0
        alloc_nbytes = round_up(slot_nbytes, gran)
        if alloc_nbytes * num_slots > info.total_memory:
            raise ValueError(
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
        self._current = 0
        self._generation = [0] * num_slots
        # set by a Publisher: number of peer leases on a slot
        self._lease_probe: Callable[[int], int] | None = None
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
        self._ptrs = [a.ptr for a in mem.allocations]
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
            raise TypeError(f"slot must be an int, not {type(slot).__name__}")
        n = len(self._ptrs)
        if not -n <= slot < n:
            raise IndexError(f"slot {slot} out of range for a pool of {n} slots")
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
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def current(self) -> int:
        """Index of the current slot."""
        self._check()
        return self._current

    # ------------------------------------------------------------------- ring
    def ptr(self, slot: int | None = None) -> int:
        """Device pointer of ``slot`` (default: the current slot)."""
        self._check()
        return self._ptrs[self._current if slot is None else self._check_slot(slot)]

    def fd(self, slot: int | None = None) -> int:
        """The exported POSIX fd of ``slot`` in this process (default: current)."""
        self._check()
        return self._mem.allocations[self._current if slot is None else self._check_slot(slot)].fd

    def ipc_handle(self, slot: int | None = None) -> tuple[int, int]:
        """``(pid, fd)`` of ``slot`` for a peer's ``pidfd_getfd`` (the seed's handle)."""
        return (self._pid, self.fd(slot))

    def generation(self, slot: int | None = None) -> int:
        """How many times ``slot`` has been recycled by :meth:`next`/:meth:`acquire`."""
        self._check()
        return self._generation[self._current if slot is None else self._check_slot(slot)]

    def local_refs(self, slot: int) -> int:
        """Number of live local owners (arrays, allocator blocks) in ``slot``."""
        return self._mem.refs.counts[self._check_slot(slot)]

    def remote_leases(self, slot: int) -> int:
        """Number of peer leases held on ``slot`` (through a :class:`Publisher`)."""
        slot = self._check_slot(slot)
        probe = self._lease_probe
        return 0 if probe is None else probe(slot)

    def is_busy(self, slot: int) -> bool:
        """True while a local array, allocator block or peer lease refers to ``slot``."""
        slot = self._check_slot(slot)
        return self._mem.refs.counts[slot] > 0 or self.remote_leases(slot) > 0

    def next(self, *, timeout: float | None = 0.0) -> int:
        """Advance to the next slot of the ring (wrapping) and return its index.

        The slot is only recycled when no local array, allocator block or peer
        lease refers to it.  By default a busy slot raises at once (in a single
        thread nothing can free it while you wait); pass ``timeout`` (seconds, or
        ``None`` for no limit) to wait for other threads or peers to let go.

        Raises
        ------
        SlotBusyError
            The next slot is still referenced when the timeout expires.
        """
        self._check()
        return self.acquire((self._current + 1) % self.num_slots, timeout=timeout)

    def acquire(self, slot: int, *, timeout: float | None = 0.0) -> int:
        """Make ``slot`` current for writing, bumping its generation.

        Raises :class:`SlotBusyError` like :meth:`next` when it is referenced.
        """
        self._check()
        slot = self._check_slot(slot)
        refs = self._mem.refs
        deadline = None if timeout is None else time.monotonic() + timeout
        with refs.cond:
            while self.is_busy(slot):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise SlotBusyError(
                        f"slot {slot} is still in use: {refs.counts[slot]} local array(s) or "
                        f"allocator block(s) and {self.remote_leases(slot)} peer lease(s) "
                        "refer to it; drop those arrays, release the frames, or pass a timeout"
                    )
                refs.waiters += 1
                try:
                    # peer leases come back without a notify: re-check every 10 ms
                    refs.cond.wait(0.01 if remaining is None else min(remaining, 0.01))
                finally:
                    refs.waiters -= 1
            self._generation[slot] += 1
            self._current = slot
        return slot

    def _take(self, slot: int) -> None:
        """Make a slot the caller has checked free current (the publisher's fast path)."""
        self._generation[slot] += 1
        self._current = slot

    # ----------------------------------------------------------------- arrays
    def _owner(self, slot: int) -> SlotRef:
        return SlotRef(self._mem, self._mem.refs, slot)

    def array(
        self,
        shape: Any = None,
        dtype: Any = numpy.uint8,
        *,
        slot: int | None = None,
        offset: int = 0,
        strides: tuple[int, ...] | None = None,
    ) -> Any:
        """A ``cupy.ndarray`` over a region of a slot (default: the whole current slot).

        Parameters
        ----------
        shape:
            Array shape; default: as many items of ``dtype`` as fit in the slot.
        dtype:
            A numeric numpy dtype.
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
        index = self._current if slot is None else self._check_slot(slot)
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

    def locate(self, ptr: int) -> tuple[int, int] | None:
        """Return ``(slot, offset)`` of a device pointer inside the pool, or None."""
        base = self._ptrs[self._current]
        if base <= ptr < base + self._slot_nbytes:  # the common case: the current slot
            return self._current, ptr - base
        for i, base in enumerate(self._ptrs):
            if base <= ptr < base + self._slot_nbytes:
                return i, ptr - base
        return None

    def handle(self, array: Any) -> ArrayHandle:
        """The :class:`ArrayHandle` of an array whose memory lies in the pool.

        Works for views, slices and non-contiguous strides; a peer rebuilds
        exactly this array with ``peer.array(handle)``.

        Raises
        ------
        NotShareableError
            The array's memory is not (entirely) inside one slot of this pool.
        """
        self._check()
        ptr = int(array.data.ptr)
        where = self.locate(ptr)
        if where is None:
            raise NotShareableError(
                f"array at 0x{ptr:x} does not lie in this pool's slots; allocate it with "
                "pool.array() or under pool.allocating()"
            )
        slot, offset = where
        handle = ArrayHandle(
            slot=slot,
            generation=self._generation[slot],
            offset=offset,
            shape=tuple(array.shape),
            strides=tuple(array.strides),
            dtype=normalize_dtype(array.dtype),
        )
        try:
            handle.check_fits(self._slot_nbytes)
        except ValueError as exc:
            raise NotShareableError(f"array extends beyond slot {slot}: {exc}") from None
        return handle

    def array_from_handle(self, handle: ArrayHandle) -> Any:
        """Rebuild the array of ``handle`` in this process (checks generation and bounds)."""
        self._check()
        slot = self._check_slot(handle.slot)
        if handle.generation != self._generation[slot]:
            raise StaleHandleError(
                f"handle for slot {slot} is of generation {handle.generation}; the slot is "
                f"now at generation {self._generation[slot]}"
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
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
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
        try:
            self._finalizer()
        except Exception as exc:  # pragma: no cover - defensive; teardown never raises
            warnings.warn(f"closing IpcPool failed: {exc}", TeardownWarning, stacklevel=2)

    def __enter__(self) -> IpcPool:
        self._check()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"current={self._current}"
        return (
            f"IpcPool(num_slots={self.num_slots}, slot_nbytes={self._slot_nbytes}, "
            f"device={self._device}, {state})"
        )

    # ------------------------------------------------------------- allocator
    @contextmanager
    def allocating(self, *, overflow: str = "raise") -> Iterator[Any]:
        """Place CuPy allocations of this thread inside the current slot.

        See :func:`cupy_ipcpool.allocating` for the policy details.
        """
        from ._allocator import allocating

        with allocating(self, overflow=overflow) as arena:
            yield arena
