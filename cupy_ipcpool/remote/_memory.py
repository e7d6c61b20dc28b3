"""Receive-slot memory behind one small interface: host (memfd + NumPy) or device (IpcPool + CuPy).

A :class:`SlotMemory` is a ring of ``num_slots`` buffers of ``slot_nbytes``;
:meth:`SlotMemory.arrays` carves a frame's arrays out of one slot (packed,
each aligned to 256 bytes).  The arrays are what UCX receives into and what
the user reads: no copy in between.  A slot's arrays keep the memory alive
after :meth:`SlotMemory.close` (the last one to go frees it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy

from .._args import DeviceLike, device_ordinal
from .._errors import UsageError
from . import _wire as wire


class SlotMemory(Protocol):
    """What a remote subscriber receives into."""

    num_slots: int
    slot_nbytes: int
    kind: str  # "host" or "device"

    def arrays(
        self, slot: int, specs: tuple[wire.ArraySpec, ...], owner: object = None
    ) -> list[Any]:
        """Views of ``specs`` packed in ``slot`` (ProtocolError when they do not fit).

        Each view keeps ``owner`` alive (a frame's lease: it returns the slot
        when the last view is gone).
        """
        ...

    def ready(self, slot: int) -> bool:
        """True when no reader's GPU work on ``slot`` is pending (it may be written)."""
        ...

    def reading(self, slot: int, stream: Any) -> None:
        """Note that work on ``stream`` may still read ``slot`` (checked by :meth:`ready`)."""
        ...

    def close(self) -> None:
        """Release the memory once no array of it is alive. Idempotent."""
        ...


class _HostView:
    """Exposes one array of a slot through ``__array_interface__`` and keeps ``owner`` alive."""

    __slots__ = ("__array_interface__", "base", "owner")

    def __init__(self, base: numpy.ndarray, offset: int, spec: wire.ArraySpec, owner: object):
        self.base = base
        self.owner = owner
        self.__array_interface__ = {
            "data": (base.ctypes.data + offset, False),
            "shape": spec.shape,
            "typestr": spec.typestr,
            "version": 3,
        }


def _view(
    base: numpy.ndarray, offset: int, spec: wire.ArraySpec, owner: object = None
) -> numpy.ndarray:
    if owner is None:
        dt = numpy.dtype(spec.typestr)
        return base[offset : offset + spec.nbytes].view(dt).reshape(spec.shape)
    return numpy.asarray(_HostView(base, offset, spec, owner))


class HostSlots:
    """Slots in host memory: one memfd per slot, mapped read-write.

    The pages are committed when the slots are made, not at a frame's first
    write or receive into them.

    The memfds (:attr:`fds`) let a host relay hand the same pages to local
    subscribers (see :class:`cupy_ipcpool.remote.HostChannelPublisher`).
    """

    kind = "host"

    def __init__(self, num_slots: int, slot_nbytes: int) -> None:
        if num_slots < 1 or slot_nbytes < 1:
            raise UsageError("num_slots and slot_nbytes must be at least 1")
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._bases: list[numpy.ndarray] = []
        try:
            for i in range(num_slots):
                fd = os.memfd_create(f"ipcpool-remote{i}", os.MFD_CLOEXEC)
                self.fds.append(fd)
                os.ftruncate(fd, slot_nbytes)
                # Committed now (MAP_POPULATE): a first lap of frames that faults in
                # fresh pages costs more than the transfer itself at 256 MiB.
                m = mmap.mmap(fd, slot_nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE)
                self._maps.append(m)
                self._bases.append(numpy.frombuffer(m, dtype=numpy.uint8))
        except BaseException:
            self.close()
            raise

    def base(self, slot: int) -> numpy.ndarray:
        """The whole slot as a ``uint8`` array."""
        return self._bases[slot]

    def arrays(
        self, slot: int, specs: tuple[wire.ArraySpec, ...], owner: object = None
    ) -> list[Any]:
        offsets = wire.layout(specs, self.slot_nbytes)
        base = self._bases[slot]
        return [_view(base, off, spec, owner) for off, spec in zip(offsets, specs, strict=True)]

    def ready(self, slot: int) -> bool:
        return True

    def reading(self, slot: int, stream: Any) -> None:
        pass

    def close(self) -> None:
        """Close the fds; the mappings go when their last array does."""
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)
        self._bases = []
        maps, self._maps = self._maps, []
        for m in maps:
            with contextlib.suppress(BufferError):  # arrays use it: freed with the last one
                m.close()


class _Pin:
    """Owner of a device view: keeps the pool open (and ``owner`` alive) while the view lives."""

    __slots__ = ("__weakref__", "memory", "owner")

    def __init__(self, memory: DeviceSlots, owner: object) -> None:
        self.memory = memory
        self.owner = owner


class _ReadyWatcher:
    """A thread that waits on the host for each event it is given, then calls ``notify``.

    A released slot may be written again only when the reader's GPU work on it
    has finished (an event on the release stream).  The session thread must
    not block on that (it drives UCX for the other slots), and polling the
    event on a timer adds the timer's period to every credit; this thread
    blocks in ``cudaEventSynchronize`` (without the GIL) instead and wakes the
    session the moment the work is done.  Events are waited for in the order
    they were recorded.
    """

    def __init__(
        self, notify: Callable[[], None], scope: Callable[[], AbstractContextManager[Any]]
    ) -> None:
        self._notify = notify
        self._scope = scope  # makes the events' device current on this thread
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ipcpool-ready", daemon=True)
        self._thread.start()

    def watch(self, event: Any) -> None:
        """Call ``notify`` once ``event`` has completed (or failed: ``ready`` then raises)."""
        self._events.put(event)

    def close(self) -> None:
        """Stop after the events given so far (never waits: a hung stream keeps it blocked)."""
        self._events.put(None)

    def _run(self) -> None:
        with self._scope():
            while (event := self._events.get()) is not None:
                # an error is left to ready(), which raises it on the session thread
                with contextlib.suppress(Exception):
                    event.synchronize()
                self._notify()


class DeviceSlots:
    """Slots in device memory: an :class:`~cupy_ipcpool.IpcPool` on ``device``.

    ``device`` is an ordinal or a ``cupy.cuda.Device``.  A received frame is a
    slot like any other; :attr:`pool` can be published from (the relay does).
    ``notify``, when given, is called (from a thread of this object's) as soon
    as the GPU work noted by :meth:`reading` has finished, so that a caller
    waiting for :meth:`ready` needs no timer.
    """

    kind = "device"

    def __init__(
        self,
        num_slots: int,
        slot_nbytes: int,
        *,
        device: DeviceLike = 0,
        notify: Callable[[], None] | None = None,
    ) -> None:
        device = device_ordinal(device)  # before a GPU is looked for
        from .._arrays import cupy_module
        from .._pool import IpcPool

        self._cp = cupy_module()
        self.pool = IpcPool(num_slots, slot_nbytes, device=device)
        self.num_slots = num_slots
        self.slot_nbytes = self.pool.slot_nbytes
        self.device = device
        self._pins = 0  # live views (each owns a _Pin)
        self._events: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._watcher = (
            None if notify is None else _ReadyWatcher(notify, lambda: self._cp.cuda.Device(device))
        )

    def arrays(
        self, slot: int, specs: tuple[wire.ArraySpec, ...], owner: object = None
    ) -> list[Any]:
        cp = self._cp
        offsets = wire.layout(specs, self.slot_nbytes)
        base = self.pool.ptr(slot)
        out = []
        for off, spec in zip(offsets, specs, strict=True):
            pin = _Pin(self, owner)
            with self._lock:
                self._pins += 1
            weakref.finalize(pin, self._unpinned)
            mem = cp.cuda.UnownedMemory(base + off, max(spec.nbytes, 1), pin, self.device)
            out.append(
                cp.ndarray(spec.shape, numpy.dtype(spec.typestr), cp.cuda.MemoryPointer(mem, 0))
            )
        return out

    def reading(self, slot: int, stream: Any) -> None:
        cp = self._cp
        with cp.cuda.Device(self.device):
            s = cp.cuda.get_current_stream() if stream is None else stream
            event = cp.cuda.Event(disable_timing=True)
            event.record(s)
        with self._lock:
            self._events[slot] = event
        if self._watcher is not None:
            self._watcher.watch(event)

    def ready(self, slot: int) -> bool:
        with self._lock:
            event = self._events.get(slot)
            if event is None:
                return True
            if event.done:
                del self._events[slot]
                return True
            return False

    def _unpinned(self) -> None:
        with self._lock:
            self._pins -= 1
            last = self._closing and not self._pins
        if last:
            self._close_pool()

    def _close_pool(self) -> None:
        with self._lock:
            self._events.clear()
        self.pool.close()

    def close(self) -> None:
        """Close the pool now, or when the last array carved from it is collected."""
        if self._closing:
            return
        if self._watcher is not None:
            self._watcher.close()
        with self._lock:
            self._closing = True
            last = not self._pins
        if last:
            self._close_pool()
