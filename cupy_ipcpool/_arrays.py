"""Building ``cupy.ndarray`` views over mapped slot memory (shared by pool and peer).

Each view is backed by ``cupy.cuda.UnownedMemory`` whose owner is a
:class:`SlotRef`: while any array (or view of it) is alive, the ref keeps the
mapping alive and counts as a local reference to the slot, so the ring never
recycles the slot under it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy

from ._errors import DescriptorError, NotShareableError, UsageTypeError
from ._handles import ArrayHandle, validate_dtype

_cupy: Any = None
_refcount = sys.getrefcount


def cupy_module() -> Any:
    """Import CuPy lazily (it is heavy, and optional until a GPU call)."""
    global _cupy
    if _cupy is None:
        from ._errors import CudaUnavailableError

        try:
            import cupy
        except Exception as exc:
            raise CudaUnavailableError(
                f"CuPy cannot be imported ({exc}); install the GPU stack of your CUDA major "
                "(cupy-cuda13x or cupy-cuda12x): from the source tree, python3 -m pip install "
                "-e '.[cu13]' (CUDA 13) or -e '.[cu12]' (CUDA 12)"
            ) from None
        _cupy = cupy
    return _cupy


class SlotRefs:
    """Per-slot counts of live local references, with a condition to wait on.

    ``on_zero`` is called when a count drops to zero; threads waiting on
    ``cond`` (counted in ``waiters``) are notified then.
    """

    def __init__(self, num_slots: int) -> None:
        self.counts = [0] * num_slots
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.waiters = 0
        self.on_zero: Callable[[int], None] | None = None

    def incr(self, slot: int) -> None:
        with self.lock:
            self.counts[slot] += 1

    def decr(self, slot: int) -> None:
        with self.lock:
            count = self.counts[slot] - 1
            self.counts[slot] = count
            if count == 0:
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


class KeptArray:
    """A ``cupy.ndarray`` over mapped slot memory that its keeper hands out again.

    The pool's reusable views and the subscriber's kept arrays are this.  The
    array is *in use* while anything but this object refers to it, to its
    ``MemoryPointer`` or to its memory (a variable, a slice or view of it, a
    DLPack capsule, a torch tensor made from it): the reference counts of
    those three are compared with the ones taken when only this object held
    the array.

    Parameters
    ----------
    cp:
        The ``cupy`` module.
    ptr, size:
        The memory's device address and size (``UnownedMemory``).
    owner:
        The memory's owner (keeps the mapping alive).
    device:
        CUDA device ordinal.
    offset, shape, dtype, strides:
        The array inside the memory (``strides`` None: C-contiguous).
    """

    __slots__ = ("_mem", "_memptr", "_n_array", "_n_mem", "_n_memptr", "array")

    def __init__(
        self,
        cp: Any,
        ptr: int,
        size: int,
        owner: Any,
        device: int,
        offset: int,
        shape: tuple[int, ...],
        dtype: Any,
        strides: tuple[int, ...] | None = None,
    ) -> None:
        mem = cp.cuda.UnownedMemory(ptr, size, owner, device)
        self.array = a = cp.ndarray(
            shape, dtype, cp.cuda.MemoryPointer(mem, offset), strides=strides
        )
        del mem
        # The array's MemoryPointer and memory, held here too so that in_use() reads
        # three reference counts with no attribute lookups through CuPy (per frame);
        # the counts taken now, with only this object holding the three, are the base.
        self._memptr = a.data
        self._mem = self._memptr.mem
        del a
        self._n_array = _refcount(self.array)
        self._n_memptr = _refcount(self._memptr)
        self._n_mem = _refcount(self._mem)

    def in_use(self) -> bool:
        """True while anything besides this object refers to the array or its memory."""
        return (
            _refcount(self.array) != self._n_array
            or _refcount(self._memptr) != self._n_memptr
            or _refcount(self._mem) != self._n_mem
        )


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
    if type(shape) is tuple:
        for n in shape:
            if type(n) is not int or n < 0:
                break
        else:
            return shape  # the common case: already a tuple of non-negative ints
    if isinstance(shape, (int, numpy.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(n) for n in shape)
    except TypeError:
        raise UsageTypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(n < 0 for n in out):
        raise DescriptorError(f"negative dimension in shape {out}")
    return out


_DTYPE_CACHE: dict[Any, numpy.dtype] = {}
_DTYPE_CACHE_MAX = 256


def normalize_dtype(dtype: Any) -> numpy.dtype:
    """Return the numpy dtype, restricted to the library's shareable dtypes.

    Answers for the dtype objects, types and strings seen before come from a
    small cache (one dict lookup: this runs for every array made per frame).
    """
    try:
        return _DTYPE_CACHE[dtype]
    except (KeyError, TypeError):  # unseen, or unhashable (then validated each time)
        pass
    dt = validate_dtype(dtype)
    if len(_DTYPE_CACHE) < _DTYPE_CACHE_MAX:
        with contextlib.suppress(TypeError):
            _DTYPE_CACHE[dtype] = dt
    return dt


# ------------------------------------------------------------------ interop


class ArrayInfo(NamedTuple):
    """Where an array's memory is and how it is laid out (byte strides)."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: numpy.dtype[Any]


def array_info(obj: Any) -> ArrayInfo:
    """Pointer, shape, byte strides and dtype of any device array.

    Accepts a ``cupy.ndarray``, any object with ``__cuda_array_interface__``
    (torch tensors, numba device arrays, ...) and any object with
    ``__dlpack__`` (read through ``cupy.from_dlpack``, which shares the memory
    and orders CuPy's current stream after the exporter's).

    Raises
    ------
    NotShareableError
        The object exposes neither interface, or its dtype cannot be shared.
    """
    cp = cupy_module()
    if isinstance(obj, cp.ndarray):
        return ArrayInfo(obj.data.ptr, obj.shape, obj.strides, normalize_dtype(obj.dtype))
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        try:
            shape = tuple(int(n) for n in cai["shape"])
            dtype = normalize_dtype(cai["typestr"])
            strides = cai.get("strides")
            strides = (
                _c_strides(shape, dtype.itemsize)
                if strides is None
                else tuple(int(s) for s in strides)
            )
            return ArrayInfo(int(cai["data"][0]), shape, strides, dtype)
        except DescriptorError as exc:
            raise NotShareableError(f"{type(obj).__name__}: {exc}") from None
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise NotShareableError(
                f"{type(obj).__name__} has a malformed __cuda_array_interface__ ({exc!r})"
            ) from None
    if hasattr(obj, "__dlpack__"):
        try:
            view = cp.from_dlpack(obj)
        except Exception as exc:
            raise NotShareableError(
                f"{type(obj).__name__} could not be read through DLPack ({exc})"
            ) from None
        return ArrayInfo(view.data.ptr, view.shape, view.strides, normalize_dtype(view.dtype))
    raise NotShareableError(
        f"{type(obj).__name__} is not a device array: it has neither "
        "__cuda_array_interface__ nor __dlpack__"
    )


class _RawStream:
    """A raw ``cudaStream_t`` seen through the CUDA stream protocol."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def stream_ptr(stream: Any) -> int:
    """The raw ``cudaStream_t`` of ``stream`` (``None``: CuPy's current stream).

    Accepts CuPy streams (``.ptr``), objects of the CUDA stream protocol
    (``__cuda_stream__`` returning ``(version, handle)``: cuda.core, recent
    torch, numba-cuda), torch streams (``.cuda_stream``) and raw integer
    handles.

    Raises
    ------
    UsageTypeError
        ``stream`` is none of these.
    """
    if stream is None:
        return int(cupy_module().cuda.get_current_stream().ptr)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        pair = proto() if callable(proto) else proto
        try:
            _version, handle = pair
            return int(handle)
        except (TypeError, ValueError):
            raise UsageTypeError(
                f"{type(stream).__name__}.__cuda_stream__ returned {pair!r}, not (version, handle)"
            ) from None
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream before the protocol
    if isinstance(handle, int):
        return handle
    raise UsageTypeError(
        f"not a CUDA stream: {type(stream).__name__}; pass a CuPy stream, an object with "
        "__cuda_stream__, a torch stream or a raw cudaStream_t int"
    )


def as_cupy_stream(stream: Any, device: int) -> Any:
    """A CuPy stream object for ``stream`` (``None``: the current CuPy stream)."""
    cp = cupy_module()
    if stream is None:
        return cp.cuda.get_current_stream()
    if isinstance(stream, cp.cuda.Stream) or type(stream).__name__ == "ExternalStream":
        return stream
    ptr = stream_ptr(stream)
    source = stream if hasattr(stream, "__cuda_stream__") else _RawStream(ptr)
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14
        return from_external(source)
    return cp.cuda.ExternalStream(ptr, device)  # pragma: no cover - CuPy 13


def dlpack_safe(array: Any, *, copy: bool = False) -> Any:
    """Return ``array`` if every framework can take it through DLPack, else refuse or copy.

    CuPy views may have negative strides (``a[::-1]``); DLPack can describe
    them but torch cannot take them, and ``torch.from_dlpack`` on such a view
    aborts the process instead of raising.  Pass received arrays through this
    function before handing them to torch or JAX.

    Parameters
    ----------
    array:
        A ``cupy.ndarray`` (a received frame's array, typically).
    copy:
        With negative strides: ``False`` raises, ``True`` returns a
        C-contiguous copy (new memory outside the slot, made on CuPy's current
        stream; it stays valid after the frame is released).

    Raises
    ------
    NotShareableError
        Negative strides and ``copy=False``.
    """
    info = array_info(array)
    if all(s >= 0 for s in info.strides):
        return array
    if not copy:
        raise NotShareableError(
            f"array of shape {info.shape} has negative strides {info.strides}: torch cannot "
            "take it through DLPack (torch.from_dlpack aborts the process on it); pass "
            "copy=True for a contiguous copy, or publish a view with non-negative strides"
        )
    return cupy_module().ascontiguousarray(array)
