"""The pool descriptor: everything a peer needs to import a pool, and its wire format.

:class:`PoolDescriptor` says who exports the pool (pid, start time, uid, PID
namespace), on which device, how many slots of which size, and where the
file descriptors of the slots can be fetched.  Decoding
(:meth:`PoolDescriptor.from_bytes`) and unpickling raise only
:class:`~cupy_ipcpool._errors.DescriptorError`; they check every count
against a small hard limit before reading what the count announces, and
reject truncated input and trailing bytes.

Wire layout (all little-endian).  Pool descriptor, format version 2::

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
"""

from __future__ import annotations

import contextlib
import os
import struct
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any, Protocol

from cupy_ipcpool._errors import DescriptorError

from ._validate import (
    _I32_MAX,
    _U32_MAX,
    _U64_MAX,
    DEVICE_UUID_NBYTES,
    MAX_SLOT_NBYTES,
    MAX_SLOTS,
    MAX_SOCKET_PATH,
    POOL_ID_NBYTES,
    _as_bytes,
    _as_int,
    _as_int_tuple,
    _as_view,
    _encode_socket_path,
)

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_VERSIONS",
    "PoolDescriptor",
    "own_pid_namespace",
]

FORMAT_VERSION = 2
"""Version of the descriptor wire format written by :meth:`PoolDescriptor.to_bytes`."""

SUPPORTED_VERSIONS: tuple[int, ...] = (2,)
"""Descriptor format versions :meth:`PoolDescriptor.from_bytes` accepts."""

_MAGIC = b"IPCP"
_KIND_POOL = 1

# magic, version, kind, reserved, pool_id, pid, uid, start_time, uuid, ordinal,
# num_slots, slot_nbytes, alloc_nbytes, pid_namespace
_DESC_HEADER = struct.Struct("<4sHBB16sIIQ16sIIQQQ")

_U16 = struct.Struct("<H")


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
