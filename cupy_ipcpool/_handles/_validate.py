"""Limits and validation shared by descriptors and array handles.

Every helper raises :class:`~cupy_ipcpool._errors.DescriptorError` and nothing
else, whatever it is given: what it checks comes from another process.  The
dtype whitelist and its wire codes live here too.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy

from cupy_ipcpool._errors import DescriptorError

__all__ = [
    "DEVICE_UUID_NBYTES",
    "MAX_NDIM",
    "MAX_SLOTS",
    "MAX_SLOT_NBYTES",
    "MAX_SOCKET_PATH",
    "POOL_ID_NBYTES",
    "validate_dtype",
]

MAX_SLOTS = 65536
"""Most slots a pool may have: the one slot-count limit of the library (descriptors,
pools, the channel's protocol)."""

MAX_NDIM = 16
MAX_SLOT_NBYTES = 1 << 44
MAX_SOCKET_PATH = 107
POOL_ID_NBYTES = 16
DEVICE_UUID_NBYTES = 16

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
_I32_MAX = (1 << 31) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1

# Wire code -> dtype.  Codes are part of the wire format: append, never reorder.
_DTYPES: tuple[numpy.dtype[Any], ...] = tuple(
    numpy.dtype(s)
    for s in (
        "|b1",
        "|i1",
        "<i2",
        "<i4",
        "<i8",
        "|u1",
        "<u2",
        "<u4",
        "<u8",
        "<f2",
        "<f4",
        "<f8",
        "<c8",
        "<c16",
    )
)

_DTYPE_CODES: dict[str, int] = {dt.str: code for code, dt in enumerate(_DTYPES)}

# Hot-path tables.  A dtype equal to a whitelisted one maps to its code (dtype
# equality ignores only what validate_dtype ignores too: metadata, "=" vs "<").
_CODE_OF_DTYPE: dict[numpy.dtype[Any], int] = {dt: code for code, dt in enumerate(_DTYPES)}

_DTYPE_CLASSES: frozenset[type] = frozenset(type(dt) for dt in _DTYPES)

_ITEMSIZES: tuple[int, ...] = tuple(dt.itemsize for dt in _DTYPES)

assert all(size & (size - 1) == 0 for size in _ITEMSIZES), "check_fits needs powers of two"

_NUM_DTYPES = len(_DTYPES)


def _as_int(value: object, name: str, lo: int, hi: int) -> int:
    """Return ``value`` as a Python int in ``[lo, hi]`` or raise DescriptorError."""
    if isinstance(value, bool):
        raise DescriptorError(f"{name} must be an integer, not bool")
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise DescriptorError(f"{name} must be an integer, not {type(value).__name__}") from None
    if not lo <= result <= hi:
        raise DescriptorError(f"{name}={result} is out of range [{lo}, {hi}]")
    return result


def _as_int_tuple(value: object, name: str, lo: int, hi: int, max_len: int) -> tuple[int, ...]:
    """Return ``value`` as a tuple of ints in ``[lo, hi]`` of length <= ``max_len``."""
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(
        value, (tuple, list, Sequence)
    ):
        raise DescriptorError(f"{name} must be a sequence of integers, not {type(value).__name__}")
    try:
        n = len(value)
    except Exception:  # a hostile Sequence subclass; len() is all we ask of it
        raise DescriptorError(f"{name} has no usable length") from None
    if n > max_len:
        raise DescriptorError(f"{name} has {n} entries, more than the limit {max_len}")
    return tuple(_as_int(v, f"{name}[{i}]", lo, hi) for i, v in enumerate(value))


def _as_bytes(value: object, name: str, nbytes: int) -> bytes:
    if not isinstance(value, bytes):
        raise DescriptorError(f"{name} must be bytes, not {type(value).__name__}")
    if len(value) != nbytes:
        raise DescriptorError(f"{name} must be {nbytes} bytes long, got {len(value)}")
    return value


def _as_view(data: object, what: str) -> memoryview:
    """Return a flat byte view of ``data`` or raise DescriptorError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DescriptorError(
            f"{what} must be decoded from bytes, bytearray or memoryview, not {type(data).__name__}"
        )
    try:
        return memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise DescriptorError(f"{what}: unusable buffer ({exc})") from None


def _encode_socket_path(path: object) -> bytes:
    if not isinstance(path, str):
        raise DescriptorError(f"socket_path must be str or None, not {type(path).__name__}")
    if not path:
        raise DescriptorError("socket_path must not be empty (use None for no socket)")
    if "\x00" in path:
        raise DescriptorError("socket_path must not contain NUL characters")
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DescriptorError(f"socket_path is not encodable as UTF-8: {exc}") from None
    if len(raw) > MAX_SOCKET_PATH:
        raise DescriptorError(
            f"socket_path is {len(raw)} bytes long in UTF-8; the limit is {MAX_SOCKET_PATH} "
            f"(sun_path); use a shorter directory, e.g. under /tmp or $XDG_RUNTIME_DIR"
        )
    return raw


def validate_dtype(obj: object) -> numpy.dtype[Any]:
    """Return the canonical :class:`numpy.dtype` for ``obj`` if it may cross the wire.

    Parameters
    ----------
    obj:
        Anything :class:`numpy.dtype` accepts (``"float32"``, ``numpy.int8``, a dtype).

    Returns
    -------
    numpy.dtype
        The whitelisted dtype: bool, int8..int64, uint8..uint64, float16/32/64 or
        complex64/128, little-endian.

    Raises
    ------
    DescriptorError
        ``obj`` is None, not a dtype, or a dtype outside the whitelist (structured,
        object, string, datetime, subarray, big-endian...).
    """
    if obj is None:
        raise DescriptorError("dtype must not be None")
    try:
        dt = numpy.dtype(obj)  # type: ignore[call-overload]
    except Exception as exc:  # numpy raises TypeError, ValueError, ... for junk
        raise DescriptorError(f"not a dtype: {obj!r} ({type(exc).__name__})") from None
    code = _DTYPE_CODES.get(dt.str)
    if code is None or not dt.isnative or dt.fields is not None or dt.subdtype is not None:
        raise DescriptorError(
            f"dtype {dt!s} ({dt.str}) cannot be shared; supported are bool, int8..int64, "
            f"uint8..uint64, float16/32/64 and complex64/128 in native little-endian order"
        )
    return _DTYPES[code]
