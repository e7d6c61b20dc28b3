"""attach(): import a pool's slots in another process, map them, view them as arrays."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

from . import _driver
from ._args import DeviceLike, optional_device
from ._arrays import KeptArray, SlotRef, SlotRefs, cupy_module, view_unchecked
from ._errors import (
    DescriptorError,
    ForkedProcessError,
    PoolClosedError,
    SlotIndexError,
    StaleHandleError,
    UnsupportedDeviceError,
    UsageTypeError,
)
from ._handles import ArrayHandle, PoolDescriptor
from ._transport import fetch_fds
from ._transport._closing import FinalizedResource
from ._vmm import Allocation, UndoStack, release_after_queued_work

_CacheKey = tuple[bytes, int, int, int]
_GEOMETRY_CACHE = 1024


class _Holder:
    """Owner of a kept view's memory: refers to the owner of the frame it was handed out with."""

    __slots__ = ("owner",)

    def __init__(self, owner: Any) -> None:
        self.owner = owner


class _KeptView(KeptArray):
    """The array built for a received handle, kept to be handed out again for the same geometry.

    Handing it out again points its memory's owner (a :class:`_Holder`) at
    the new frame's owner.
    """

    __slots__ = ("holder", "key")

    def __init__(
        self, cp: Any, base_ptr: int, size: int, device: int, key: bytes, geometry: Any, owner: Any
    ) -> None:
        holder = _Holder(owner)
        super().__init__(
            cp, base_ptr, size, holder, device, geometry[1], geometry[2], geometry[4], geometry[3]
        )
        self.key = key
        self.holder = holder


class _ImportedSlots:
    """The imported, mapped slots of one exporter pool on one local device.

    Shared by every :class:`PeerPool` of the same pool in this process (the
    import cache) and kept alive by the arrays over it.  Released when no peer
    pool and no array uses it any more.
    """

    def __init__(self, key: _CacheKey, allocations: list[Allocation], pid: int) -> None:
        self.key = key
        self.allocations = allocations
        self.ptrs = [a.ptr for a in allocations]
        self.refs = SlotRefs(len(allocations))
        self.refs.on_zero = self._maybe_release
        self.attached = 0
        self.pid = pid
        self.released = False

    def _maybe_release(self, _slot: int = -1) -> None:
        # Per received frame (a slot's count drops to zero): while a peer pool is
        # attached there is nothing to release, and detach() looks again itself.
        if self.attached:
            return
        with _cache_lock:
            if self.attached or any(self.refs.counts) or self.released:
                return
            self.released = True
            if _cache.get(self.key) is self:
                del _cache[self.key]
        if os.getpid() == self.pid:  # outside the lock: this waits for queued GPU work
            release_after_queued_work(self.allocations)

    def detach(self) -> None:
        with _cache_lock:
            self.attached -= 1
        self._maybe_release()


_cache: dict[_CacheKey, _ImportedSlots] = {}
_cache_lock = threading.RLock()


def _resolve_device(desc: PoolDescriptor, device: int | None) -> int:
    home = _driver.ordinal_of_uuid(desc.device_uuid)
    if device is None:
        if home is None:
            raise UnsupportedDeviceError(
                "the exporter's GPU (uuid " + desc.device_uuid.hex() + ") is not visible in "
                "this process; check CUDA_VISIBLE_DEVICES or pass device= with peer access"
            )
        return home
    _driver.get_device(device)  # range check
    if home is None:
        raise UnsupportedDeviceError(
            f"the exporter's GPU (uuid {desc.device_uuid.hex()}) is not visible here, so "
            f"device {device} cannot be granted access to its memory"
        )
    if device != home and not _driver.can_access_peer(device, home):
        raise UnsupportedDeviceError(
            f"device {device} has no peer access to device {home}, where the pool lives"
        )
    return device


def _import_all(
    desc: PoolDescriptor, device: int, transport: str, fds: list[int] | None
) -> list[Allocation]:
    if fds is None:
        fds = desc.take_local_fds()
    if fds is None:
        fds = fetch_fds(
            pid=desc.exporter_pid,
            start_time=desc.exporter_start_time,
            fds=desc.fds,
            socket_path=desc.socket_path,
            token=desc.pool_id,
            method=transport,
            exporter_uid=desc.exporter_uid,
            pid_namespace=desc.exporter_pid_namespace,
        )
    try:
        if len(fds) != desc.num_slots:
            raise DescriptorError(f"got {len(fds)} fds for a pool of {desc.num_slots} slots")
        _driver.use_device(device)
        access = [_driver.access_desc(device)]
        with UndoStack() as undo:
            allocations = []
            for fd in fds:
                alloc = Allocation.import_fd(fd, desc.alloc_nbytes, device, access=access)
                undo.push(alloc.close)
                allocations.append(alloc)
            undo.commit()
        return allocations
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class PeerPool(FinalizedResource):
    """A pool exported by another process, mapped into this one.

    Made by :func:`attach`.  Hands out ``cupy.ndarray`` views from
    :class:`ArrayHandle` objects with the same bounds checks as the producer.
    The mapped memory stays valid after the exporter exits (even if killed):
    the import holds the physical memory.
    """

    def __init__(self, desc: PoolDescriptor, slots: _ImportedSlots, device: int) -> None:
        self._desc = desc
        self._slots = slots
        self._device = device
        self._epoch = _driver.fork_epoch()
        self._seen_generation = [0] * desc.num_slots
        self._geometry: dict[bytes, tuple[Any, ...]] = {}
        self._views: dict[bytes, _KeptView] = {}  # by geometry: arrays to hand out again
        self._lent: list[_KeptView] = []  # views handed out since the last _drop_idle_owners
        self._closed = False
        self._cp = cupy_module()
        self._finalizer = weakref.finalize(self, slots.detach)

    @property
    def descriptor(self) -> PoolDescriptor:
        """The descriptor this peer pool was attached from."""
        return self._desc

    @property
    def num_slots(self) -> int:
        """Number of slots."""
        return self._desc.num_slots

    @property
    def slot_nbytes(self) -> int:
        """Usable bytes per slot."""
        return self._desc.slot_nbytes

    @property
    def device(self) -> int:
        """The local device ordinal the slots are mapped for."""
        return self._device

    def _check(self) -> None:
        if self._closed:
            raise PoolClosedError("the PeerPool is closed")
        if _driver._fork_epoch != self._epoch:
            raise ForkedProcessError(
                "this PeerPool was attached in another process; attach again in the child"
            )

    def ptr(self, slot: int) -> int:
        """Device pointer of ``slot`` in this process."""
        self._check()
        if not 0 <= slot < self._desc.num_slots:
            raise SlotIndexError(f"slot {slot} out of range for {self._desc.num_slots} slots")
        return self._slots.ptrs[slot]

    def _pin(self, slot: int) -> SlotRef:
        """An owner object that keeps ``slot`` mapped while it lives.

        It counts as a local reference to the slot (:meth:`local_refs`), and
        keeps the mapping alive after :meth:`close` until it is collected —
        what a received frame's lease holds.
        """
        if not 0 <= slot < self._desc.num_slots:
            raise SlotIndexError(f"slot {slot} out of range for {self._desc.num_slots} slots")
        return SlotRef(self._slots, self._slots.refs, slot)

    def array(self, handle: ArrayHandle) -> Any:
        """The ``cupy.ndarray`` that ``handle`` describes, over the mapped slot.

        Raises
        ------
        DescriptorError
            The handle's slot, offset, shape or strides do not fit the pool.
        StaleHandleError
            A newer generation of the slot has been seen already.
        """
        self._check()
        slot = handle.slot
        if slot >= self._desc.num_slots:
            raise DescriptorError(
                f"handle names slot {slot}; the pool has {self._desc.num_slots} slots"
            )
        seen = self._seen_generation[slot]
        if handle.generation < seen:
            raise StaleHandleError(
                f"handle for slot {slot} is of generation {handle.generation}; generation "
                f"{seen} has been received since, so its memory was reused"
            )
        handle.check_fits(self._desc.slot_nbytes)
        self._seen_generation[slot] = handle.generation
        owner = SlotRef(self._slots, self._slots.refs, slot)
        return view_unchecked(
            self._cp, self._slots.ptrs[slot], self._desc.slot_nbytes, owner, self._device, handle
        )

    def _arrays_from_wire(
        self, data: bytes | memoryview, pos: int, count: int, owner: Any
    ) -> tuple[list[Any], int]:
        """Decode ``count`` packed handles at ``pos`` into arrays (the per-frame hot path).

        Each array's memory is owned by ``owner`` (the frame's lease), which
        must keep this peer pool alive.  A handle's geometry (slot, offset,
        shape, strides, dtype) is validated against the slot once and cached;
        the generation is checked on every call.  The array built for a
        geometry is kept and handed out again the next time that geometry
        arrives, when nothing refers to it any more (no new ``cupy.ndarray``
        per frame); call :meth:`_drop_idle_owners` before waiting for the next
        frame, so that an owner is not kept alive by the cache.

        Returns
        -------
        (arrays, position after the last handle)

        Raises
        ------
        DescriptorError, StaleHandleError
            As :meth:`array`.
        """
        self._check()
        cp = self._cp
        cache = self._geometry
        views = self._views
        lent = self._lent
        seen = self._seen_generation
        ptrs = self._slots.ptrs
        size = self._desc.slot_nbytes
        device = self._device
        out = []
        peek = ArrayHandle.peek
        for _ in range(count):
            key, generation, end = peek(data, pos)
            geometry = cache.get(key)
            if geometry is None:
                handle, end = ArrayHandle.unpack_from(data, pos)
                if handle.slot >= self._desc.num_slots:
                    raise DescriptorError(
                        f"handle names slot {handle.slot}; the pool has {self._desc.num_slots}"
                    )
                handle.check_fits(size)
                geometry = (handle.slot, handle.offset, handle.shape, handle.strides, handle.dtype)
                if len(cache) >= _GEOMETRY_CACHE:
                    cache.clear()
                cache[key] = geometry
            slot = geometry[0]
            if generation < seen[slot]:
                raise StaleHandleError(
                    f"handle for slot {slot} is of generation {generation}; generation "
                    f"{seen[slot]} has been received since, so its memory was reused"
                )
            seen[slot] = generation
            view = views.get(key)
            if view is not None and not view.in_use():
                view.holder.owner = owner  # the same array again, now owned by this frame
            else:
                view = _KeptView(cp, ptrs[slot], size, device, key, geometry, owner)
                if len(views) >= _GEOMETRY_CACHE:
                    views.clear()
                views[key] = view  # one in use lives on with its user
            lent.append(view)
            out.append(view.array)
            pos = end
        return out, pos

    def _drop_idle_owners(self) -> None:
        """Let go of the owners of handed-out arrays that nothing uses any more.

        A kept array's memory refers to the owner it was last handed out with
        (a frame's lease), which would otherwise live on in the cache.  Called
        before waiting for the next frame, this does what collecting the array
        would have done: an owner that nothing else holds is collected then.
        """
        lent = self._lent
        if lent:
            views = self._views
            keep = []
            for view in lent:
                if views.get(view.key) is not view:
                    continue  # no longer kept: it goes, with its owner, when its users drop it
                if not view.in_use():
                    view.holder.owner = None
                else:
                    keep.append(view)
            lent[:] = keep

    def local_refs(self, slot: int) -> int:
        """Number of live arrays over ``slot`` in this process."""
        return self._slots.refs.counts[slot]

    def close(self) -> None:
        """Detach; the mappings go when no peer pool or array in this process uses them.

        Idempotent and never raises.
        """
        if self._closed:
            return
        self._closed = True
        self._views.clear()  # kept arrays in use live on with their owners
        self._lent.clear()
        self._finalize("PeerPool")

    def __repr__(self) -> str:
        return (
            f"PeerPool(exporter_pid={self._desc.exporter_pid}, num_slots={self.num_slots}, "
            f"slot_nbytes={self.slot_nbytes}, device={self._device}"
            f"{', closed' if self._closed else ''})"
        )


def attach(
    descriptor: PoolDescriptor, *, device: DeviceLike | None = None, transport: str = "auto"
) -> PeerPool:
    """Map a peer's pool into this process.

    Fetches the slot fds (``pidfd_getfd``, or ``SCM_RIGHTS`` over the exporter's
    socket; ``"auto"`` tries pidfd then falls back on ``EPERM``/``ENOSYS`` and
    when the exporter's pid is not visible here, e.g. another PID namespace),
    imports each with ``cuMemImportFromShareableHandle``, reserves and maps an
    address range, grants read-write access on ``device`` and closes the fds.
    Each slot is imported once per process and local device: attaching the
    same pool again reuses the mappings (the cache key holds the pool's random
    id, the exporter pid and its start time, so a recycled pid or a recreated
    pool never hits a stale entry).

    Parameters
    ----------
    descriptor:
        From :meth:`IpcPool.descriptor` (bytes via ``PoolDescriptor.from_bytes``,
        or unpickled, in which case it carries its fds).
    device:
        Local device to map on, an ordinal or a ``cupy.cuda.Device``; default:
        the exporter's device (by UUID).  Another GPU works where it has peer
        access to that one.
    transport:
        ``"auto"``, ``"pidfd"`` or ``"socket"``.

    Raises
    ------
    UsageError, UsageTypeError
        Not a descriptor, or ``device`` is not a device (checked before any
        GPU is looked for).
    TransportError
        The fds could not be fetched (the message says why and what to do).
    UnsupportedDeviceError
        ``device`` cannot access the pool's GPU.
    CudaError
        Import or mapping failed; nothing is left mapped.
    """
    return attach_fds(descriptor, None, device=device, transport=transport)


def attach_fds(
    descriptor: PoolDescriptor,
    fds: list[int] | None,
    *,
    device: DeviceLike | None = None,
    transport: str = "auto",
) -> PeerPool:
    """:func:`attach` with the slot fds already in hand (``None``: fetch them).

    Takes ownership of ``fds`` (they are closed once imported).  Used by the
    channel, whose WELCOME message carries the fds.
    """
    try:
        if not isinstance(descriptor, PoolDescriptor):
            raise UsageTypeError(
                f"attach() needs a PoolDescriptor, not {type(descriptor).__name__}"
            )
        ordinal = optional_device(device)
        descriptor.validate()
        local = _resolve_device(descriptor, ordinal)
    except BaseException:
        for fd in fds or ():
            os.close(fd)
        raise
    key: _CacheKey = (
        descriptor.pool_id,
        descriptor.exporter_pid,
        descriptor.exporter_start_time,
        local,
    )
    with _cache_lock:
        slots = _cache.get(key)
        if slots is not None and not slots.released:
            slots.attached += 1
            for fd in (fds if fds is not None else descriptor.take_local_fds()) or ():
                os.close(fd)  # already mapped: not needed
            return PeerPool(descriptor, slots, local)
    allocations = _import_all(descriptor, local, transport, fds)
    with _cache_lock:
        existing = _cache.get(key)
        if existing is not None and not existing.released:
            for alloc in allocations:  # lost a race with another thread: keep theirs
                alloc.close()
            slots = existing
        else:
            slots = _cache[key] = _ImportedSlots(key, allocations, os.getpid())
        slots.attached += 1
    return PeerPool(descriptor, slots, local)


def cached_imports() -> int:
    """Number of pools currently imported in this process (for tests and debugging)."""
    with _cache_lock:
        return len(_cache)
