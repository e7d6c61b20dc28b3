"""Plain data that crosses process boundaries, its binary wire format, and validation.

This is the bottom layer of cupy_ipcpool: it needs no GPU and imports nothing from
the library except :mod:`cupy_ipcpool._errors`.

* :class:`PoolDescriptor` says everything a peer needs to import a pool: who
  exports it, on which device, how many slots of which size, and where the file
  descriptors of the slots can be fetched.
* :class:`ArrayHandle` names one array inside one slot: slot, generation, byte
  offset, shape, strides and dtype.

Every byte string that comes from another process is untrusted.  Decoding
(:meth:`PoolDescriptor.from_bytes`, :meth:`ArrayHandle.unpack_from`) raises only
:class:`~cupy_ipcpool._errors.DescriptorError`, checks every count against a small
hard limit before it reads the array that the count announces, and rejects
truncated input and trailing bytes.

Wire layout (all little-endian)
-------------------------------
Pool descriptor, format version 2::

    offset size  field
    0      4     magic b"IPCP"
    4      2     u16 format version
    6      1     u8  kind (1 = pool descriptor)
    7      1     u8  reserved, must be 0
    8      16    pool_id
    24     4     u32 exporter_pid
    28     4     u32 exporter_uid
    32     8     u64 exporter_start_time
    40     16    device_uuid
    56     4     u32 device_ordinal
    60     4     u32 num_slots
    64     8     u64 slot_nbytes
    72     8     u64 alloc_nbytes
    80     8     u64 exporter_pid_namespace (0 = unknown)
    88     4*n   u32 fds[num_slots]
    ...    2     u16 path length in bytes (0 = no socket path)
    ...    len   UTF-8 socket path

Array handle (no header; it is embedded in per-frame messages)::

    u32 slot, u64 generation, u64 offset, u8 ndim, u8 dtype code,
    u64 shape[ndim], i64 strides[ndim]
"""

from __future__ import annotations

import contextlib
import operator
import os
import struct
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any, Literal, Protocol

import numpy

from ._errors import DescriptorError, StaleHandleError

FORMAT_VERSION = 2
"""Version of the descriptor wire format written by :meth:`PoolDescriptor.to_bytes`."""

SUPPORTED_VERSIONS: tuple[int, ...] = (2,)
"""Descriptor format versions :meth:`PoolDescriptor.from_bytes` accepts."""

MAX_SLOTS = 65536
"""Most slots a pool may have: the one slot-count limit of the library (descriptors,
pools, the channel's protocol)."""
MAX_NDIM = 16
MAX_SLOT_NBYTES = 1 << 44
MAX_SOCKET_PATH = 107
POOL_ID_NBYTES = 16
DEVICE_UUID_NBYTES = 16

_MAGIC = b"IPCP"
_KIND_POOL = 1

_U16_MAX = (1 << 16) - 1
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
_I32_MAX = (1 << 31) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1

# magic, version, kind, reserved, pool_id, pid, uid, start_time, uuid, ordinal,
# num_slots, slot_nbytes, alloc_nbytes, pid_namespace
_DESC_HEADER = struct.Struct("<4sHBB16sIIQ16sIIQQQ")
_U16 = struct.Struct("<H")
# slot, generation, offset, ndim, dtype code
_HANDLE_HEADER = struct.Struct("<IQQBB")

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


# ---------------------------------------------------------------------------
# Small validation helpers: every one raises DescriptorError and nothing else.


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


def own_pid_namespace() -> int:
    """Return the id of this process's PID namespace, or 0 if it cannot be read.

    The id is the inode number of ``/proc/self/ns/pid``: two processes see the
    same pid numbers exactly when they report the same id.  A process never
    changes its own PID namespace, but the value is read afresh on each call
    (cheap) so that a forked child in a new namespace reports its own.

    Returns
    -------
    int
        A positive id, or 0 where ``/proc`` is not mounted or not readable.
    """
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


# ---------------------------------------------------------------------------
# File descriptors received by unpickling.


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _LocalFds:
    """File descriptors that live in this process, owned until someone takes them.

    A finalizer closes them if nobody calls :meth:`take` before the owner dies.
    """

    __slots__ = ("__weakref__", "_fds", "_finalizer")

    def __init__(self, fds: Iterable[int]) -> None:
        self._fds = list(fds)
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)

    def peek(self) -> list[int] | None:
        """Return the fds (still owned here), or None if they were taken or closed."""
        return list(self._fds) if self._finalizer.alive else None

    def take(self) -> list[int] | None:
        """Transfer ownership of the fds to the caller; None after the first call."""
        if self._finalizer.detach() is None:
            return None
        return list(self._fds)

    def close(self) -> None:
        """Close the fds unless they were taken.  Idempotent."""
        self._finalizer()


class _FdCarrier(Protocol):
    def detach(self) -> int: ...


# ---------------------------------------------------------------------------
# PoolDescriptor


@dataclass(frozen=True)
class PoolDescriptor:
    """Everything a peer needs to import a pool.

    Parameters
    ----------
    pool_id:
        16 random bytes, unique per pool instance.
    exporter_pid:
        Pid of the exporting process.
    exporter_start_time:
        Start time of the exporter in clock ticks (field 22 of ``/proc/<pid>/stat``);
        with the pid it identifies the exporter even if the pid is reused.
    exporter_uid:
        Uid of the exporting process.
    device_uuid:
        16-byte UUID of the exporter's CUDA device.
    device_ordinal:
        The exporter's device ordinal; a hint only, ordinals differ between
        processes with different ``CUDA_VISIBLE_DEVICES``.
    num_slots:
        Number of slots, ``1 <= num_slots <= MAX_SLOTS``.
    slot_nbytes:
        Usable bytes per slot.
    alloc_nbytes:
        Mapped bytes per slot (``>= slot_nbytes``, granule-rounded); what the
        importer must map.
    fds:
        One fd number per slot, valid *in the exporter process* (for ``pidfd_getfd``).
    socket_path:
        Path of the exporter's ``SCM_RIGHTS`` fd server, or None.
    exporter_pid_namespace:
        Id of the exporter's PID namespace (:func:`own_pid_namespace`), so a
        peer can tell a pid of another namespace (a container) from a pid
        that has exited or was reused; 0 when unknown.  Default (None): this
        process's namespace if ``exporter_pid`` is this process's pid, else 0.

    Notes
    -----
    **A pickled descriptor is a live capability to the memory.**  Pickled by
    ``multiprocessing`` (``Process`` arguments, ``Queue.put``, ``Pipe.send``: its
    ``ForkingPickler``), it carries duplicates of the slot fds, sent with
    ``SCM_RIGHTS``, when the pickling process owns them: either it is the
    exporter, or it unpickled the descriptor itself and has not taken the fds
    yet.  Whoever unpickles it can map and write the pool's memory.  Send it
    only to processes you trust with that.  A plain ``pickle.dumps`` carries no
    fds (nothing would collect them: they would leak); the receiver then
    fetches them like a peer decoding :meth:`to_bytes`.

    The fds received by unpickling are available once through
    :meth:`take_local_fds`; if nobody takes them they are closed when the
    descriptor is garbage-collected.  :meth:`to_bytes` carries no fds: a peer
    decoding those bytes fetches them with ``pidfd_getfd`` or over ``socket_path``.
    """

    pool_id: bytes
    exporter_pid: int
    exporter_start_time: int
    exporter_uid: int
    device_uuid: bytes
    device_ordinal: int
    num_slots: int
    slot_nbytes: int
    alloc_nbytes: int
    fds: tuple[int, ...]
    socket_path: str | None = None
    exporter_pid_namespace: int | None = None
    _local: _LocalFds | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Normalise lists of fds and numpy integers, then check everything.
        if isinstance(self.fds, list):
            object.__setattr__(self, "fds", tuple(self.fds))
        if self.exporter_pid_namespace is None:
            mine = type(self.exporter_pid) is int and self.exporter_pid == os.getpid()
            object.__setattr__(self, "exporter_pid_namespace", own_pid_namespace() if mine else 0)
        self.validate()

    def validate(self) -> None:
        """Check types, ranges and consistency of every field.

        Raises
        ------
        DescriptorError
            A field has the wrong type or is out of range, ``alloc_nbytes <
            slot_nbytes``, ``len(fds) != num_slots``, or the socket path is empty,
            contains NUL, is not UTF-8 encodable or is longer than
            ``MAX_SOCKET_PATH`` bytes.
        """
        _as_bytes(self.pool_id, "pool_id", POOL_ID_NBYTES)
        _as_int(self.exporter_pid, "exporter_pid", 1, _I32_MAX)
        _as_int(self.exporter_start_time, "exporter_start_time", 0, _U64_MAX)
        _as_int(self.exporter_uid, "exporter_uid", 0, _U32_MAX - 1)
        _as_bytes(self.device_uuid, "device_uuid", DEVICE_UUID_NBYTES)
        _as_int(self.device_ordinal, "device_ordinal", 0, _I32_MAX)
        num_slots = _as_int(self.num_slots, "num_slots", 1, MAX_SLOTS)
        slot_nbytes = _as_int(self.slot_nbytes, "slot_nbytes", 1, MAX_SLOT_NBYTES)
        alloc_nbytes = _as_int(self.alloc_nbytes, "alloc_nbytes", 1, MAX_SLOT_NBYTES)
        if alloc_nbytes < slot_nbytes:
            raise DescriptorError(
                f"alloc_nbytes={alloc_nbytes} is smaller than slot_nbytes={slot_nbytes}"
            )
        if not isinstance(self.fds, tuple):
            raise DescriptorError(f"fds must be a tuple, not {type(self.fds).__name__}")
        fds = _as_int_tuple(self.fds, "fds", 0, _I32_MAX, MAX_SLOTS)
        if len(fds) != num_slots:
            raise DescriptorError(f"{len(fds)} fds for num_slots={num_slots}; need one per slot")
        if self.socket_path is not None:
            _encode_socket_path(self.socket_path)
        _as_int(self.exporter_pid_namespace, "exporter_pid_namespace", 0, _U64_MAX)

    # -- wire format ---------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Encode in the current wire format (:data:`FORMAT_VERSION`).

        Returns
        -------
        bytes
            The header, the fd array and the length-prefixed UTF-8 socket path
            (see the module docstring for the layout).  No fds travel with it.
        """
        path = b"" if self.socket_path is None else _encode_socket_path(self.socket_path)
        return b"".join(
            (
                _DESC_HEADER.pack(
                    _MAGIC,
                    FORMAT_VERSION,
                    _KIND_POOL,
                    0,
                    self.pool_id,
                    self.exporter_pid,
                    self.exporter_uid,
                    self.exporter_start_time,
                    self.device_uuid,
                    self.device_ordinal,
                    self.num_slots,
                    self.slot_nbytes,
                    self.alloc_nbytes,
                    self.exporter_pid_namespace,
                ),
                struct.pack(f"<{self.num_slots}I", *self.fds),
                _U16.pack(len(path)),
                path,
            )
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> PoolDescriptor:
        """Decode and validate a descriptor from untrusted bytes.

        Parameters
        ----------
        data:
            Output of :meth:`to_bytes`, possibly from another process.

        Returns
        -------
        PoolDescriptor
            A validated descriptor (without local fds).

        Raises
        ------
        DescriptorError
            For anything malformed: wrong magic, unsupported version or kind,
            truncated input, trailing bytes, counts over the limits, invalid
            UTF-8, or fields that fail :meth:`validate`.  Nothing else is raised.
        """
        view = _as_view(data, "pool descriptor")
        n = len(view)
        if n < len(_MAGIC) or bytes(view[:4]) != _MAGIC:
            raise DescriptorError(
                "not a cupy_ipcpool pool descriptor (bad magic"
                + (", input truncated)" if n < len(_MAGIC) else ")")
            )
        if n < 6:
            raise DescriptorError(f"pool descriptor truncated: {n} bytes")
        (version,) = _U16.unpack_from(view, 4)
        if version not in SUPPORTED_VERSIONS:
            supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
            raise DescriptorError(
                f"unsupported pool descriptor format version {version}; this build of "
                f"cupy_ipcpool supports version {supported}: use the same cupy_ipcpool "
                f"version in every process"
            )
        if n < _DESC_HEADER.size:
            raise DescriptorError(
                f"pool descriptor truncated: {n} bytes, the header alone is {_DESC_HEADER.size}"
            )
        (
            _magic,
            _version,
            kind,
            reserved,
            pool_id,
            pid,
            uid,
            start_time,
            uuid,
            ordinal,
            num_slots,
            slot_nbytes,
            alloc_nbytes,
            pid_namespace,
        ) = _DESC_HEADER.unpack_from(view, 0)
        if kind != _KIND_POOL:
            raise DescriptorError(f"wrong message kind {kind} for a pool descriptor")
        if reserved != 0:
            raise DescriptorError(f"reserved header byte is {reserved}, must be 0")
        if not 1 <= num_slots <= MAX_SLOTS:
            raise DescriptorError(f"num_slots={num_slots} is out of range [1, {MAX_SLOTS}]")
        pos = _DESC_HEADER.size
        end_fds = pos + 4 * num_slots
        if n < end_fds + _U16.size:
            raise DescriptorError(
                f"pool descriptor truncated: {n} bytes, {num_slots} fds need {end_fds + 2}"
            )
        fds = struct.unpack_from(f"<{num_slots}I", view, pos)
        (path_len,) = _U16.unpack_from(view, end_fds)
        pos = end_fds + _U16.size
        if path_len > MAX_SOCKET_PATH:
            raise DescriptorError(
                f"socket path length {path_len} exceeds the limit of {MAX_SOCKET_PATH} bytes"
            )
        if n < pos + path_len:
            raise DescriptorError(
                f"pool descriptor truncated: {n} bytes, the socket path needs {pos + path_len}"
            )
        if n > pos + path_len:
            raise DescriptorError(
                f"pool descriptor has {n - pos - path_len} trailing bytes after its end"
            )
        socket_path: str | None = None
        if path_len:
            try:
                socket_path = bytes(view[pos : pos + path_len]).decode("utf-8")
            except UnicodeDecodeError:
                raise DescriptorError("socket path is not valid UTF-8") from None
        return cls(
            pool_id=pool_id,
            exporter_pid=pid,
            exporter_start_time=start_time,
            exporter_uid=uid,
            device_uuid=uuid,
            device_ordinal=ordinal,
            num_slots=num_slots,
            slot_nbytes=slot_nbytes,
            alloc_nbytes=alloc_nbytes,
            fds=fds,
            socket_path=socket_path,
            exporter_pid_namespace=pid_namespace,
        )

    # -- fds that live in this process --------------------------------------

    def take_local_fds(self) -> list[int] | None:
        """Take ownership of the slot fds received by unpickling, once.

        Returns
        -------
        list of int or None
            One fd per slot, valid in this process and now owned (to be closed) by
            the caller; None if this descriptor was not unpickled with fds or
            they were already taken.
        """
        return None if self._local is None else self._local.take()

    def __reduce__(self) -> tuple[Any, ...]:
        # A plain pickle (pickle.dumps, copy, a pickle file) carries no fds: nothing
        # would ever collect them, so each pickle would leak one duplicate per slot in
        # multiprocessing's fd sharer.  The receiver fetches them (pidfd or socket).
        return (_rebuild_descriptor, (self.to_bytes(), None))


def _reduce_with_fds(desc: PoolDescriptor) -> tuple[Any, ...]:
    """How multiprocessing pickles a descriptor: with duplicates of the slot fds.

    Registered with :class:`multiprocessing.reduction.ForkingPickler`, which
    pickles ``Process`` arguments and ``Queue``/``Pipe`` items; the receiving
    process collects the fds while unpickling.
    """
    fds: Sequence[int] | None = None
    if desc._local is not None:
        fds = desc._local.peek()
    if fds is None and _is_exporter(desc):
        fds = desc.fds
    carriers = None if fds is None else tuple(reduction.DupFd(fd) for fd in fds)
    return (_rebuild_descriptor, (desc.to_bytes(), carriers))


def _is_exporter(desc: PoolDescriptor) -> bool:
    """Whether this process is ``desc``'s exporter (its pid in its PID namespace)."""
    if os.getpid() != desc.exporter_pid:
        return False
    ns = desc.exporter_pid_namespace
    return not ns or ns == own_pid_namespace()


def _rebuild_descriptor(data: bytes, carriers: tuple[_FdCarrier, ...] | None) -> PoolDescriptor:
    """Unpickle a :class:`PoolDescriptor`, receiving the fds its carriers bring.

    What unpickling runs, so its arguments are untrusted: anything malformed
    (``data`` that does not decode, ``carriers`` that are not a tuple of one
    carrier per slot, a carrier without a working ``detach()`` or whose
    ``detach()`` gives anything but a distinct open fd) raises
    :class:`DescriptorError`.  Every carrier is detached even when an earlier
    one failed, and every fd received is closed on failure: nothing leaks and
    no finalizer is left holding something that is not an fd.
    """
    received: list[int] = []
    try:
        problem = _detach_all(carriers, received)
        desc = PoolDescriptor.from_bytes(data)
        if problem is not None:
            raise DescriptorError(f"pickled descriptor: {problem}")
        if carriers is not None and len(received) != desc.num_slots:
            raise DescriptorError(
                f"pickled descriptor carries {len(received)} fds for {desc.num_slots} slots"
            )
    except BaseException:
        _close_fds(received)
        raise
    if carriers is not None:
        object.__setattr__(desc, "_local", _LocalFds(received))
    return desc


def _detach_all(carriers: object, received: list[int]) -> str | None:
    """Detach every carrier into ``received`` (distinct open fds only); return the first problem.

    Only exceptions that are not errors (``KeyboardInterrupt``...) propagate;
    ``received`` then holds what arrived so far, for the caller to close.
    """
    if carriers is None:
        return None
    if type(carriers) is not tuple:
        return f"fd carriers must be a tuple, not {type(carriers).__name__}"
    if len(carriers) > MAX_SLOTS:
        return f"{len(carriers)} fd carriers, more than the {MAX_SLOTS} slots a pool may have"
    problem: str | None = None
    for i, carrier in enumerate(carriers):
        try:
            fd = carrier.detach()
        except Exception as exc:
            problem = problem or f"fd carrier {i} failed: {type(exc).__name__}: {_short(exc, str)}"
            continue
        if type(fd) is not int or not 0 <= fd <= _I32_MAX:
            problem = problem or (
                f"fd carrier {i} gave {type(fd).__name__} {_short(fd, repr)}, not an fd number"
            )
            continue  # nothing this process could close: not ours to keep either
        if fd in received:
            problem = problem or f"fd carrier {i} gave fd {fd} again"
            continue
        try:
            os.fstat(fd)
        except OSError:
            problem = problem or f"fd carrier {i} gave fd {fd}, which is not open"
            continue
        received.append(fd)
    return problem


def _short(value: object, show: Callable[[object], str]) -> str:
    """``show(value)`` cut to 40 characters; never raises (``value`` is untrusted)."""
    try:
        text = show(value)
        if type(text) is not str:
            return "(unprintable)"
    except Exception:
        return "(unprintable)"
    return text if len(text) <= 40 else text[:37] + "..."


reduction.ForkingPickler.register(PoolDescriptor, _reduce_with_fds)


# ---------------------------------------------------------------------------
# ArrayHandle


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


__all__ = [
    "DEVICE_UUID_NBYTES",
    "FORMAT_VERSION",
    "MAX_NDIM",
    "MAX_SLOTS",
    "MAX_SLOT_NBYTES",
    "MAX_SOCKET_PATH",
    "POOL_ID_NBYTES",
    "SUPPORTED_VERSIONS",
    "ArrayHandle",
    "PoolDescriptor",
    "own_pid_namespace",
    "validate_dtype",
]
