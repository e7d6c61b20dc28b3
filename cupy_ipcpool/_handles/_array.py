"""The array handle: one array inside one slot, and its compact wire format.

:class:`ArrayHandle` names the slot, the slot's generation, the byte offset,
shape, strides and dtype.  Decoding (:meth:`ArrayHandle.unpack_from`) raises
only :class:`~cupy_ipcpool._errors.DescriptorError`; :meth:`ArrayHandle.check_fits`
checks that the array lies inside its slot before any pointer is formed.

Array handle (no header; it is embedded in per-frame messages)::

    u32 slot, u64 generation, u64 offset, u8 ndim, u8 dtype code,
    u64 shape[ndim], i64 strides[ndim]
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy

from cupy_ipcpool._errors import DescriptorError, StaleHandleError

from ._validate import (
    _CODE_OF_DTYPE,
    _DTYPE_CLASSES,
    _DTYPES,
    _I64_MAX,
    _I64_MIN,
    _ITEMSIZES,
    _NUM_DTYPES,
    _U64_MAX,
    MAX_NDIM,
    MAX_SLOTS,
    _as_int,
    _as_int_tuple,
    _as_view,
    validate_dtype,
)

__all__ = [
    "ArrayHandle",
]

# slot, generation, offset, ndim, dtype code
_HANDLE_HEADER = struct.Struct("<IQQBB")

# The whole packed handle, one precompiled Struct per ndim:
# header, then u64 shape[ndim], then i64 strides[ndim].
_HANDLE_STRUCTS: tuple[struct.Struct, ...] = tuple(
    struct.Struct(f"<IQQBB{ndim}Q{ndim}q") for ndim in range(MAX_NDIM + 1)
)

_GENERATION_AT = 4  # byte offsets of the fields inside the header
_OFFSET_AT = 12
_NDIM_AT = 20
_CODE_AT = 21

_U64 = struct.Struct("<Q")


def _check_nbytes(shape: tuple[int, ...], dtype: numpy.dtype[Any]) -> None:
    """Raise DescriptorError if an array of ``shape`` and ``dtype`` has over 2**63-1 bytes."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= max(n, 1)
        if nbytes > _I64_MAX:
            raise DescriptorError(f"array of shape {shape} and dtype {dtype} is too large")


@dataclass(frozen=True)
class ArrayHandle:
    """One array inside one slot of a pool.

    Parameters
    ----------
    slot:
        Slot index, ``0 <= slot < MAX_SLOTS``.
    generation:
        The slot's generation when the array was published (u64); see
        :meth:`check_generation`.
    offset:
        Byte offset of element ``[0, ..., 0]`` from the start of the slot.
    shape:
        Non-negative extents, at most ``MAX_NDIM`` of them.
    strides:
        Byte strides, one per dimension; may be negative or zero.
    dtype:
        Anything :func:`validate_dtype` accepts; stored as the canonical dtype.

    Notes
    -----
    Construction checks the ranges of every field, but not that the array fits a
    slot: call :meth:`check_fits` with the slot size before forming a pointer.
    """

    slot: int
    generation: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: numpy.dtype[Any]

    def __post_init__(self) -> None:
        # Fast path: fields that already have their exact types (int, tuple, a
        # whitelisted dtype) and are in range are kept as they are; only the dtype
        # is swapped for its canonical instance.  Anything else goes through the
        # full validation, which normalises or raises the detailed error.
        shape, strides, dtype = self.shape, self.strides, self.dtype
        slot, generation, offset = self.slot, self.generation, self.offset
        if (
            type(slot) is int
            and type(generation) is int
            and type(offset) is int
            and type(shape) is tuple
            and type(strides) is tuple
            and type(dtype) in _DTYPE_CLASSES
            and 0 <= slot < MAX_SLOTS
            and 0 <= generation <= _U64_MAX
            and 0 <= offset <= _U64_MAX
            and len(shape) == len(strides) <= MAX_NDIM
            and (code := _CODE_OF_DTYPE.get(dtype)) is not None
        ):
            nbytes = _ITEMSIZES[code]
            for n, st in zip(shape, strides, strict=True):
                if (
                    type(n) is not int
                    or type(st) is not int
                    or not 0 <= n <= _I64_MAX
                    or not _I64_MIN <= st <= _I64_MAX
                ):
                    break
                if n > 1:
                    nbytes *= n
            else:
                # every factor is >= 1: the product exceeds the limit iff a prefix does
                if nbytes <= _I64_MAX:
                    if dtype is not _DTYPES[code]:
                        object.__setattr__(self, "dtype", _DTYPES[code])
                    return
        self._validate_and_normalise()

    def _validate_and_normalise(self) -> None:
        """Check every field, convert it to its canonical type, or raise DescriptorError."""
        set_ = object.__setattr__
        set_(self, "slot", _as_int(self.slot, "slot", 0, MAX_SLOTS - 1))
        set_(self, "generation", _as_int(self.generation, "generation", 0, _U64_MAX))
        set_(self, "offset", _as_int(self.offset, "offset", 0, _U64_MAX))
        shape = _as_int_tuple(self.shape, "shape", 0, _I64_MAX, MAX_NDIM)
        strides = _as_int_tuple(self.strides, "strides", _I64_MIN, _I64_MAX, MAX_NDIM)
        if len(strides) != len(shape):
            raise DescriptorError(
                f"{len(strides)} strides for {len(shape)} dimensions; need one per dimension"
            )
        dtype = validate_dtype(self.dtype)
        _check_nbytes(shape, dtype)
        set_(self, "shape", shape)
        set_(self, "strides", strides)
        set_(self, "dtype", dtype)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        size = 1
        for n in self.shape:
            size *= n
        return size

    @property
    def nbytes(self) -> int:
        """Number of bytes of the elements (not of the memory range they span)."""
        return self.size * self.dtype.itemsize

    @classmethod
    def contiguous(
        cls,
        slot: int,
        generation: int,
        shape: Sequence[int],
        dtype: object,
        *,
        offset: int = 0,
        order: Literal["C", "F"] = "C",
    ) -> ArrayHandle:
        """Build a handle of a C- or Fortran-contiguous array.

        Parameters
        ----------
        slot, generation, shape, dtype, offset:
            As in the class.
        order:
            ``"C"`` (last index fastest) or ``"F"`` (first index fastest).

        Returns
        -------
        ArrayHandle

        Raises
        ------
        DescriptorError
            Invalid fields or ``order``.
        """
        if order not in ("C", "F"):
            raise DescriptorError(f"order must be 'C' or 'F', not {order!r}")
        dt = validate_dtype(dtype)
        dims = _as_int_tuple(shape, "shape", 0, _I64_MAX, MAX_NDIM)
        strides = [0] * len(dims)
        step = dt.itemsize
        indices = range(len(dims) - 1, -1, -1) if order == "C" else range(len(dims))
        for i in indices:
            strides[i] = step
            step *= max(dims[i], 1)
        return cls(slot, generation, offset, dims, tuple(strides), dt)

    # -- geometry -------------------------------------------------------------

    def extent(self) -> tuple[int, int]:
        """Return the half-open byte range ``[lo, hi)`` the array touches.

        Returns
        -------
        tuple of int
            Bounds relative to the slot start; ``(offset, offset)`` for a
            zero-size array, which touches nothing.
        """
        lo = hi = offset = self.offset
        strides = self.strides
        i = 0
        for n in self.shape:
            if n > 1:
                s = strides[i]
                if s < 0:
                    lo += s * (n - 1)
                else:
                    hi += s * (n - 1)
            elif n == 0:
                return (offset, offset)
            i += 1  # noqa: SIM113 -- a counter is cheaper than enumerate on this path
        return (lo, hi + self.dtype.itemsize)

    def check_fits(self, slot_nbytes: int) -> None:
        """Check that the array lies inside a slot of ``slot_nbytes`` and is aligned.

        Parameters
        ----------
        slot_nbytes:
            Usable bytes of the slot.

        Raises
        ------
        DescriptorError
            The byte range from :meth:`extent` leaves ``[0, slot_nbytes)``, or the
            offset or a stride (of a dimension longer than 1) is not a multiple of
            the item size: a misaligned GPU access would poison the CUDA context.
        """
        # One pass computes the extent (as extent() does) and ORs together the
        # strides that matter (of axes longer than 1, and only if the array is not
        # empty): item sizes are powers of two, so some stride is misaligned iff
        # their OR is.
        itemsize = self.dtype.itemsize
        lo = hi = offset = self.offset
        if offset % itemsize:
            raise DescriptorError(
                f"offset {offset} is not a multiple of the item size {itemsize} "
                f"of {self.dtype}; offsets and strides must be multiples of the item size"
            )
        shape, strides = self.shape, self.strides
        used = 0
        i = 0
        for n in shape:
            if n > 1:
                s = strides[i]
                used |= s
                if s < 0:
                    lo += s * (n - 1)
                else:
                    hi += s * (n - 1)
            elif n == 0:
                lo = hi = offset
                break
            i += 1  # noqa: SIM113 -- a counter is cheaper than enumerate on this path
        else:
            if used & (itemsize - 1):
                axis = next(
                    i
                    for i, (n, s) in enumerate(zip(shape, strides, strict=True))
                    if n > 1 and s % itemsize
                )
                raise DescriptorError(
                    f"stride {strides[axis]} of axis {axis} is not a multiple of the item "
                    f"size {itemsize} of {self.dtype}; offsets and strides must be "
                    f"multiples of the item size"
                )
            hi += itemsize
        if lo < 0 or hi > slot_nbytes:
            raise DescriptorError(
                f"array touches bytes [{lo}, {hi}) which do not fit in a slot of "
                f"{slot_nbytes} bytes"
            )

    def check_generation(self, current: int) -> None:
        """Raise :class:`StaleHandleError` unless the handle is of generation ``current``.

        Parameters
        ----------
        current:
            The slot's current generation.

        Raises
        ------
        StaleHandleError
            The slot was recycled since the handle was made.
        """
        if self.generation != current:
            raise StaleHandleError(
                f"handle of slot {self.slot} is of generation {self.generation}, the slot "
                f"is now at generation {current}: the slot was recycled"
            )

    # -- wire format ------------------------------------------------------------

    def pack(self) -> bytes:
        """Encode in the compact fixed layout (see the module docstring).

        Returns
        -------
        bytes
            ``22 + 16 * ndim`` bytes.
        """
        shape = self.shape
        ndim = len(shape)
        return _HANDLE_STRUCTS[ndim].pack(
            self.slot,
            self.generation,
            self.offset,
            ndim,
            _CODE_OF_DTYPE[self.dtype],
            *shape,
            *self.strides,
        )

    def to_bytes(self) -> bytes:
        """Encode one handle; the same bytes as :meth:`pack`."""
        return self.pack()

    @classmethod
    def unpack_from(
        cls, data: bytes | bytearray | memoryview, pos: int = 0
    ) -> tuple[ArrayHandle, int]:
        """Decode and validate one handle from untrusted bytes at ``pos``.

        Parameters
        ----------
        data:
            Buffer holding the packed handle, possibly among other fields.
        pos:
            Byte position where the handle starts.

        Returns
        -------
        tuple of (ArrayHandle, int)
            The handle and the position just after it.

        Raises
        ------
        DescriptorError
            Truncated data, ``ndim > MAX_NDIM``, unknown dtype code or fields out of
            range.  Nothing else is raised.
        """
        view = data if type(data) is bytes else _as_view(data, "array handle")
        if type(pos) is not int and (isinstance(pos, bool) or not isinstance(pos, int)):
            raise DescriptorError(f"array handle position {pos!r} is outside the data")
        return cls._unpack(view, pos)

    @classmethod
    def _unpack(cls, view: bytes | memoryview, pos: int) -> tuple[ArrayHandle, int]:
        """:meth:`unpack_from` on a flat byte buffer and an int position."""
        n = len(view)
        if not 0 <= pos <= n:
            raise DescriptorError(f"array handle position {pos!r} is outside the data")
        if n - pos < _HANDLE_HEADER.size:
            raise DescriptorError(f"array handle truncated: {n - pos} bytes at position {pos}")
        ndim = view[pos + _NDIM_AT]
        code = view[pos + _CODE_AT]
        if ndim > MAX_NDIM:
            raise DescriptorError(f"array handle ndim={ndim} exceeds the limit {MAX_NDIM}")
        if code >= _NUM_DTYPES:
            raise DescriptorError(f"unknown dtype code {code} in array handle")
        layout = _HANDLE_STRUCTS[ndim]
        if n - pos < layout.size:
            raise DescriptorError(
                f"array handle truncated: {ndim} dimensions need {16 * ndim} bytes, "
                f"{n - pos - _HANDLE_HEADER.size} remain"
            )
        values = layout.unpack_from(view, pos)
        # struct gives exact ints and tuples and the table a canonical dtype:
        # the constructor's validation (its fast path) checks the ranges
        handle = cls(
            values[0],
            values[1],
            values[2],
            values[5 : 5 + ndim],
            values[5 + ndim :],
            _DTYPES[code],
        )
        return handle, pos + layout.size

    def pack_parts(self) -> tuple[bytes, bytes]:
        """The packed handle split around its generation: ``(head, tail)``.

        ``head + pack_generation(g) + tail`` is the packed handle of the same
        array with generation ``g``: a sender that publishes the same geometry
        frame after frame validates it once and packs only the generation.
        """
        packed = self.pack()
        return packed[:_GENERATION_AT], packed[_OFFSET_AT:]

    @staticmethod
    def pack_generation(generation: int) -> bytes:
        """The generation field as :meth:`pack_parts` expects it (u64).

        Raises
        ------
        struct.error
            ``generation`` outside 0..2**64-1.
        """
        return _U64.pack(generation)

    @staticmethod
    def parts_at(data: bytes | memoryview, pos: int = 0) -> tuple[bytes, bytes, int, int]:
        """One packed handle at ``pos`` split as :meth:`pack_parts` splits it, without decoding.

        Returns
        -------
        (head, tail, generation, end)
            ``head + pack_generation(g) + tail`` is the same handle with
            generation ``g``; ``end`` is the position after the handle.

        Raises
        ------
        DescriptorError
            The data ends before the handle does.
        """
        _geometry, generation, end = ArrayHandle.peek(data, pos)
        return (
            bytes(data[pos : pos + _GENERATION_AT]),
            bytes(data[pos + _OFFSET_AT : end]),
            generation,
            end,
        )

    @staticmethod
    def peek(data: bytes | memoryview, pos: int = 0) -> tuple[bytes, int, int]:
        """Split one packed handle at ``pos`` without decoding it (the per-frame cache key).

        Returns
        -------
        (geometry, generation, end)
            ``geometry`` is the packed handle without its generation (the same
            bytes for the same slot, offset, shape, strides and dtype), so a
            receiver can cache the validated geometry of a handle under it and
            check only the generation for each frame; ``end`` is the position
            after the handle.  Decode with :meth:`unpack_from` on a cache miss.

        Raises
        ------
        DescriptorError
            The data ends before the handle does.
        """
        n = len(data)
        if n - pos < _HANDLE_HEADER.size:
            raise DescriptorError(f"array handle truncated at byte {pos} of {n}")
        end = pos + _HANDLE_HEADER.size + 16 * data[pos + _NDIM_AT]
        if end > n:
            raise DescriptorError(f"array handle truncated at byte {pos} of {n}")
        (generation,) = _U64.unpack_from(data, pos + _GENERATION_AT)
        geometry = bytes(data[pos : pos + _GENERATION_AT]) + bytes(data[pos + _OFFSET_AT : end])
        return geometry, generation, end

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ArrayHandle:
        """Decode exactly one handle; trailing bytes are an error.

        Raises
        ------
        DescriptorError
            As :meth:`unpack_from`, or bytes left after the handle.
        """
        if cls is not ArrayHandle:  # honour a subclass's own unpack_from
            handle, end = cls.unpack_from(data, 0)
            n = len(_as_view(data, "array handle"))
        else:
            view = data if type(data) is bytes else _as_view(data, "array handle")
            handle, end = cls._unpack(view, 0)
            n = len(view)
        if end != n:
            raise DescriptorError(f"array handle has {n - end} trailing bytes after its end")
        return handle
