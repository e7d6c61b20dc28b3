"""Building ``cupy.ndarray`` views over mapped slot memory (shared by pool and peer).

Each view is backed by ``cupy.cuda.UnownedMemory`` whose owner is a
:class:`SlotRef`: while any array (or view of it) is alive, the ref keeps the
mapping alive and counts as a local reference to the slot, so the ring never
recycles the slot under it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy

from ._errors import DescriptorError
from ._handles import ArrayHandle, validate_dtype

_cupy: Any = None


def cupy_module() -> Any:
    """Import CuPy lazily (it is heavy, and optional until a GPU call)."""
    global _cupy
    if _cupy is None:
        from ._errors import CudaUnavailableError

        try:
            import cupy
        except Exception as exc:
            raise CudaUnavailableError(
                f"CuPy cannot be imported ({exc}); install cupy-cuda13x (or cupy-cuda12x)"
            ) from None
        _cupy = cupy
    return _cupy


class SlotRefs:
    """Per-slot counts of live local references, with a condition to wait on.

    ``transitions``, when set (a ``collections.deque``), receives the slot
    index each time a count goes 0 -> 1 or 1 -> 0; the publisher drains it to
    keep its lease book's local holds in step.  ``on_zero`` is called when a
    count drops to zero.
    """

    def __init__(self, num_slots: int) -> None:
        self.counts = [0] * num_slots
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.waiters = 0
        self.on_zero: Callable[[int], None] | None = None
        self.transitions: deque[int] | None = None

    def incr(self, slot: int) -> None:
        with self.lock:
            count = self.counts[slot] + 1
            self.counts[slot] = count
            if count == 1 and self.transitions is not None:
                self.transitions.append(slot)

    def decr(self, slot: int) -> None:
        with self.lock:
            count = self.counts[slot] - 1
            self.counts[slot] = count
            if count == 0:
                if self.transitions is not None:
                    self.transitions.append(slot)
                if self.waiters:
                    self.cond.notify_all()
                if self.on_zero is not None:
                    self.on_zero(slot)


class SlotRef:
    """Owner object of every array view over a slot.

    Holds ``keepalive`` (the object that owns the mapping) and counts itself in
    ``refs`` until it is garbage collected, i.e. until the last array using it
    is gone.
    """

    __slots__ = ("__weakref__", "keepalive", "refs", "slot")

    def __init__(self, keepalive: Any, refs: SlotRefs, slot: int) -> None:
        self.keepalive = keepalive
        self.refs = refs
        self.slot = slot
        refs.incr(slot)

    def __del__(self) -> None:
        try:  # noqa: SIM105 - cheaper than contextlib.suppress on this hot path
            self.refs.decr(self.slot)
        except Exception:  # interpreter shutdown: nothing sensible left to do
            pass


def make_array(
    base_ptr: int,
    slot_nbytes: int,
    owner: SlotRef,
    device: int,
    shape: tuple[int, ...],
    dtype: numpy.dtype,
    offset: int,
    strides: tuple[int, ...] | None,
) -> Any:
    """Return a ``cupy.ndarray`` over ``[base_ptr + offset, ...)`` with bounds checked.

    The checks are those of :class:`ArrayHandle` (dtype whitelist, alignment to
    the item size, every touched byte inside the slot).
    """
    cp = cupy_module()
    handle = ArrayHandle(
        slot=0,
        generation=0,
        offset=offset,
        shape=shape,
        strides=strides if strides is not None else _c_strides(shape, dtype.itemsize),
        dtype=dtype,
    )
    handle.check_fits(slot_nbytes)
    return view_unchecked(cp, base_ptr, slot_nbytes, owner, device, handle)


def view_unchecked(
    cp: Any, base_ptr: int, slot_nbytes: int, owner: SlotRef, device: int, handle: ArrayHandle
) -> Any:
    """Build the array for an already validated handle (the hot path)."""
    mem = cp.cuda.UnownedMemory(base_ptr, slot_nbytes, owner, device)
    memptr = cp.cuda.MemoryPointer(mem, handle.offset)
    return cp.ndarray(handle.shape, handle.dtype, memptr, strides=handle.strides)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    acc = itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def normalize_shape(shape: Any) -> tuple[int, ...]:
    """Accept an int or a sequence of ints; return a tuple of non-negative ints."""
    if isinstance(shape, (int, numpy.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(n) for n in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(n < 0 for n in out):
        raise DescriptorError(f"negative dimension in shape {out}")
    return out


def normalize_dtype(dtype: Any) -> numpy.dtype:
    """Return the numpy dtype, restricted to the library's shareable dtypes."""
    return validate_dtype(dtype)
