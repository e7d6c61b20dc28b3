"""Python peers of the C++ ``IPCBufferManager``: import ``{pid, fd}`` pairs as arrays.

The seed class hands its peers one ``{pid, fd}`` pair per buffer and nothing
else: no pool identity, no device UUID, no allocation size.  A peer turns each
pair into its own fd with ``pidfd_open`` + ``pidfd_getfd``, imports it with
``cuMemImportFromShareableHandle`` and maps it; to map it, the peer must know
the size the exporter created, which it derives from the ``bufferStep`` the
two sides agreed on and the device's allocation granularity, rounded the way
the exporter rounded (:func:`seed_alloc_nbytes`).

:func:`import_seed_buffers` does that, with this library's rules: every input
is checked before it is used, every step registers its undo (a failure leaves
no fd, handle or mapping behind), and the result owns its mappings
(:meth:`SeedBuffers.close`, a context manager, a finalizer).
"""

from __future__ import annotations

import errno
import os
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy

from . import _driver
from ._args import DeviceLike, device_ordinal
from ._arrays import SlotRef, SlotRefs, make_array, normalize_dtype, normalize_shape
from ._errors import (
    CudaError,
    DescriptorError,
    ForkedProcessError,
    PoolClosedError,
    SlotIndexError,
    TeardownWarning,
    TransportError,
    UsageError,
    UsageTypeError,
)
from ._handles import MAX_SLOT_NBYTES, MAX_SLOTS
from ._transport import fetch_fds
from ._transport._closing import FinalizedResource
from ._vmm import Allocation, UndoStack, release_after_queued_work, round_up

__all__ = ["SeedBuffers", "fetch_seed_fds", "import_seed_buffers", "seed_alloc_nbytes"]

#: Highest pid the kernel can hand out (``PID_MAX_LIMIT`` on 64-bit Linux).
PID_MAX_LIMIT = 1 << 22
#: Highest fd number a pair may name (fds are C ``int``).
FD_MAX = (1 << 31) - 1
#: The rounding rules :func:`seed_alloc_nbytes` knows.
ROUNDINGS = ("seed", "exact")

Rounding = Literal["seed", "exact"]

_NO_SOCKET = (
    "; a {pid, fd} pair offers no socket: the socket transport needs an exporter that "
    "serves its fds (a cupy_ipcpool pool: attach(pool.descriptor())), which the C++ "
    "IPCBufferManager does not"
)
_SIZE_FIX = (
    "the exporter's allocation is most likely of another size: pass the bufferStep it used, "
    "and rounding='seed' for the C++ IPCBufferManager, rounding='exact' for this library's "
    "pools, or alloc_nbytes= with the exporter's allocation size"
)
_PID_HERE = (
    "; a {pid, fd} pair names its exporter by pid, so it works only in the exporter's PID "
    "namespace (not across containers with their own)"
)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, numpy.integer)) and not isinstance(value, bool)


def _as_int(value: object, name: str) -> int:
    """``value`` as an int, or :class:`UsageTypeError` (a bool is not an int here)."""
    if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
        raise UsageTypeError(f"{name} must be an int, not {type(value).__name__}")
    return int(value)


def seed_alloc_nbytes(buffer_step: int, granularity: int, rounding: Rounding = "seed") -> int:
    """The bytes an exporter allocated for a buffer of ``buffer_step`` bytes.

    Parameters
    ----------
    buffer_step:
        The usable bytes per buffer (the seed's ``bufferStep``).
    granularity:
        The device's minimum allocation granularity for pinned device memory
        exportable as a POSIX fd (what the seed queries).
    rounding:
        ``"seed"``: the C++ ``IPCBufferManager``'s rule,
        ``bufferStep - bufferStep % granularity + granularity``, which gives an
        already aligned size a whole extra granule.  ``"exact"``: round up to
        the granularity, an aligned size unchanged (this library's
        ``IpcPool`` and ``IPCBufferManager``).

    Returns
    -------
    int
        A positive multiple of ``granularity``, at least ``buffer_step``.

    Raises
    ------
    UsageError, UsageTypeError
        A size that is not a positive int, or an unknown ``rounding``.
    """
    buffer_step = _as_int(buffer_step, "buffer_step")
    granularity = _as_int(granularity, "granularity")
    if not 1 <= buffer_step <= MAX_SLOT_NBYTES:
        raise UsageError(f"buffer_step must be in 1..{MAX_SLOT_NBYTES}, got {buffer_step}")
    if granularity <= 0:
        raise UsageError(f"granularity must be positive, got {granularity}")
    if rounding == "seed":
        return buffer_step - buffer_step % granularity + granularity
    if rounding == "exact":
        return round_up(buffer_step, granularity)
    raise UsageError(f'rounding must be "seed" or "exact", got {rounding!r}')


def _check_pairs(pairs: object) -> tuple[int, list[int]]:
    """Validate ``pairs`` (a sequence of ``[pid, fd]``); return ``(pid, fds)``.

    Raises
    ------
    UsageTypeError
        Not a sequence of two-int sequences.
    DescriptorError
        A pid or fd out of range, pairs of several processes, a pair repeated,
        no pairs or more than ``MAX_SLOTS``.
    """
    if isinstance(pairs, (str, bytes, bytearray, memoryview)) or not isinstance(
        pairs, (Sequence, numpy.ndarray)
    ):
        raise UsageTypeError(
            f"pairs must be a sequence of [pid, fd] pairs, not {type(pairs).__name__}"
        )
    if len(pairs) == 2 and all(_is_int(v) for v in pairs):
        raise UsageTypeError(
            "pairs must be a sequence of [pid, fd] pairs; for one buffer pass "
            "[handle] (a list holding getCurIpcMemHandle()'s pair), not the pair itself"
        )
    if not 1 <= len(pairs) <= MAX_SLOTS:
        raise DescriptorError(f"got {len(pairs)} pairs; between 1 and {MAX_SLOTS} are accepted")
    pid = -1
    fds: list[int] = []
    seen: dict[int, int] = {}
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (Sequence, numpy.ndarray)):
            raise UsageTypeError(f"pairs[{i}] must be a [pid, fd] pair, not {type(pair).__name__}")
        if len(pair) != 2:
            raise DescriptorError(f"pairs[{i}] has {len(pair)} items; a pair is [pid, fd]")
        p, fd = pair[0], pair[1]
        if not (_is_int(p) and _is_int(fd)):
            raise UsageTypeError(
                f"pairs[{i}] must hold two ints, not ({type(p).__name__}, {type(fd).__name__})"
            )
        p, fd = int(p), int(fd)
        if not 1 <= p <= PID_MAX_LIMIT:
            raise DescriptorError(f"pairs[{i}]: pid {p} is out of range [1, {PID_MAX_LIMIT}]")
        if not 0 <= fd <= FD_MAX:
            raise DescriptorError(f"pairs[{i}]: fd {fd} is out of range [0, {FD_MAX}]")
        if pid < 0:
            pid = p
        elif p != pid:
            raise DescriptorError(
                f"pairs[{i}] names process {p}, pairs[0] process {pid}: import the buffers "
                "of each process with a call of its own"
            )
        if fd in seen:
            raise DescriptorError(
                f"pairs[{i}] repeats pairs[{seen[fd]}] ({pid}, {fd}): each buffer's pair is "
                "taken once (the seed's getCurIpcMemHandle() after each next())"
            )
        seen[fd] = i
        fds.append(fd)
    return pid, fds


def fetch_seed_fds(pairs: Sequence[Sequence[int]]) -> list[int]:
    """Validate ``pairs`` and duplicate each pair's fd into this process (``pidfd_getfd``).

    The fd half of :func:`import_seed_buffers`, which calls it; it needs no GPU.

    Parameters
    ----------
    pairs:
        ``[pid, fd]`` pairs of one process, as the seed's ``getCurIpcMemHandle()``
        returns them.

    Returns
    -------
    list[int]
        New close-on-exec fds owned by the caller, one per pair, in order.

    Raises
    ------
    UsageTypeError, DescriptorError
        As :func:`import_seed_buffers`.
    TransportError
        With the errno and the fix, as :func:`cupy_ipcpool.attach` words it
        (``EPERM``: ptrace policy or ``CAP_SYS_PTRACE``; ``ESRCH``: the
        exporter has exited; ``EBADF``: the fd is not open in the exporter).
        Nothing fetched is left open.
    """
    pid, fds = _check_pairs(pairs)
    return _fetch(pid, fds)


def _fetch(pid: int, fds: list[int]) -> list[int]:
    """``pidfd_getfd`` every fd of ``pid`` (one pidfd), errors worded as attach()'s."""
    try:
        return fetch_fds(
            pid=pid, start_time=None, fds=fds, socket_path=None, token=b"", method="pidfd"
        )
    except TransportError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSYS):
            raise TransportError(exc.errno, (exc.strerror or "") + _NO_SOCKET) from exc
        if exc.errno == errno.ESRCH:
            raise TransportError(exc.errno, (exc.strerror or "") + _PID_HERE) from exc
        raise


class _SeedMemory:
    """The mappings of one import, released once closed and no array uses them."""

    def __init__(self, allocations: list[Allocation]) -> None:
        self.allocations = allocations
        self.refs = SlotRefs(len(allocations))
        self.refs.on_zero = self._maybe_release
        self.pid = os.getpid()
        self.closing = False
        self.released = False

    def request_close(self) -> None:
        with self.refs.lock:
            self.closing = True
        self._maybe_release()

    def _maybe_release(self, _slot: int = -1) -> None:
        with self.refs.lock:
            if not self.closing or self.released or any(self.refs.counts):
                return
            self.released = True
        if os.getpid() != self.pid:
            return  # a forked child: the parent's driver state is not ours to release
        release_after_queued_work(self.allocations)


class SeedBuffers(FinalizedResource):
    """Buffers of another process, imported from ``{pid, fd}`` pairs and mapped here.

    Made by :func:`import_seed_buffers`.  Buffer ``i`` is the one of
    ``pairs[i]``; :meth:`array` and :meth:`arrays` view it as ``cupy.ndarray``
    (read-write, bounds-checked against ``buffer_step``).  The memory stays
    valid after the exporter exits (the import holds the physical memory).
    :meth:`close` (or leaving a ``with`` block, or the finalizer) unmaps the
    buffers once no array over them is left: arrays outlive ``close()``.
    """

    def __init__(
        self,
        mem: _SeedMemory,
        pid: int,
        pairs: tuple[tuple[int, int], ...],
        buffer_step: int,
        alloc_nbytes: int,
        granularity: int,
        device: int,
    ) -> None:
        self._mem = mem
        self._ptrs = [a.ptr for a in mem.allocations]
        self._pid = pid
        self._pairs = pairs
        self._buffer_step = buffer_step
        self._alloc_nbytes = alloc_nbytes
        self._granularity = granularity
        self._device = device
        self._epoch = _driver.fork_epoch()
        self._closed = False
        self._finalizer = weakref.finalize(self, mem.request_close)

    @property
    def pid(self) -> int:
        """The exporter's process id."""
        return self._pid

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The ``(pid, fd)`` pairs the buffers were imported from (fds of the exporter)."""
        return self._pairs

    @property
    def num_buffers(self) -> int:
        """Number of buffers."""
        return len(self._ptrs)

    @property
    def buffer_step(self) -> int:
        """Usable bytes per buffer (the seed's ``bufferStep``)."""
        return self._buffer_step

    @property
    def alloc_nbytes(self) -> int:
        """Mapped bytes per buffer: the exporter's allocation size."""
        return self._alloc_nbytes

    @property
    def granularity(self) -> int:
        """The allocation granularity the size was derived from."""
        return self._granularity

    @property
    def device(self) -> int:
        """The local device ordinal the buffers are mapped for."""
        return self._device

    def __len__(self) -> int:
        return len(self._ptrs)

    def _check(self) -> None:
        if self._closed:
            raise PoolClosedError("the SeedBuffers are closed")
        if _driver.fork_epoch() != self._epoch:
            raise ForkedProcessError(
                "these SeedBuffers were imported in another process; import again in the child"
            )

    def _index(self, index: int) -> int:
        if not _is_int(index):
            raise UsageTypeError(f"index must be an int, not {type(index).__name__}")
        n = len(self._ptrs)
        if not -n <= index < n:
            raise SlotIndexError(f"buffer {index} out of range for {n} buffers")
        return int(index) % n

    def ptr(self, index: int) -> int:
        """Device pointer of buffer ``index`` in this process."""
        self._check()
        return self._ptrs[self._index(index)]

    def local_refs(self, index: int) -> int:
        """Number of live arrays over buffer ``index`` in this process."""
        return self._mem.refs.counts[self._index(index)]

    def array(
        self,
        index: int,
        dtype: Any = numpy.uint8,
        shape: Any = None,
        *,
        offset: int = 0,
        strides: tuple[int, ...] | None = None,
    ) -> Any:
        """A ``cupy.ndarray`` over buffer ``index`` (default: all of it, as bytes).

        Parameters
        ----------
        index:
            Buffer index (the position of its pair).
        dtype:
            A numeric numpy dtype.
        shape:
            Array shape; default: as many items of ``dtype`` as fit in
            ``buffer_step - offset`` bytes.
        offset:
            Byte offset from the buffer's start (a multiple of the item size).
        strides:
            Byte strides (default: C-contiguous).

        Raises
        ------
        DescriptorError
            The array does not fit in ``buffer_step`` bytes or is misaligned.
        SlotIndexError
            No such buffer.
        PoolClosedError
            After :meth:`close`.
        """
        self._check()
        i = self._index(index)
        dt = normalize_dtype(dtype)
        if not _is_int(offset):
            raise UsageTypeError(f"offset must be an int, not {type(offset).__name__}")
        if shape is None:
            shape = (max(self._buffer_step - int(offset), 0) // dt.itemsize,)
        owner = SlotRef(self._mem, self._mem.refs, i)
        return make_array(
            self._ptrs[i],
            self._buffer_step,
            owner,
            self._device,
            normalize_shape(shape),
            dt,
            int(offset),
            strides,
        )

    def arrays(self, dtype: Any = numpy.uint8, shape: Any = None) -> list[Any]:
        """One ``cupy.ndarray`` per buffer, in the order of the pairs (see :meth:`array`)."""
        return [self.array(i, dtype, shape) for i in range(len(self._ptrs))]

    def close(self) -> None:
        """Let go of the buffers; they are unmapped when no array over them is left.

        Idempotent; never raises (failures become :class:`TeardownWarning`).
        """
        if self._closed:
            return
        self._closed = True
        self._finalize("SeedBuffers")

    def __repr__(self) -> str:
        return (
            f"SeedBuffers(pid={self._pid}, num_buffers={len(self._ptrs)}, "
            f"buffer_step={self._buffer_step}, alloc_nbytes={self._alloc_nbytes}, "
            f"device={self._device}{', closed' if self._closed else ''})"
        )


def _import_buffers(
    fds: list[int], pairs: tuple[tuple[int, int], ...], alloc_nbytes: int, device: int
) -> list[Allocation]:
    """Import and map every fd on ``device``; all or nothing."""
    _driver.use_device(device)
    access = [_driver.access_desc(device)]
    with UndoStack() as undo:
        allocations = []
        for i, fd in enumerate(fds):
            try:
                alloc = Allocation.import_fd(fd, alloc_nbytes, device, access=access)
            except CudaError as exc:
                raise _explain(exc, i, pairs[i], alloc_nbytes) from exc
            undo.push(alloc.close)
            allocations.append(alloc)
        undo.commit()
    return allocations


def _explain(exc: CudaError, i: int, pair: tuple[int, int], alloc_nbytes: int) -> CudaError:
    """``exc`` with the buffer named and, where it helps, what to check."""
    where = f"buffer {i} (pid {pair[0]}, fd {pair[1]})"
    if exc.call == "cuMemImportFromShareableHandle":
        hint = f"{where}: the fd is not an exported CUDA allocation, or not one this GPU can import"
    elif exc.call == "cuMemMap":
        hint = f"{where}: mapping {alloc_nbytes} bytes failed; {_SIZE_FIX}"
    elif exc.call == "cuMemSetAccess":
        hint = (
            f"{where}: this device cannot be granted access to {alloc_nbytes} bytes of the "
            "exporter's memory: pass the device the exporter allocated on (or one with peer "
            f"access to it); or the size is not the allocation's: {_SIZE_FIX}"
        )
    else:
        hint = where
    detail = f"{exc.detail}; {hint}" if exc.detail else hint
    return type(exc)(exc.call, exc.code, exc.name, detail)


def import_seed_buffers(
    pairs: Sequence[Sequence[int]],
    buffer_step: int,
    *,
    device: DeviceLike,
    rounding: Rounding = "seed",
    alloc_nbytes: int | None = None,
) -> SeedBuffers:
    """Import the buffers that a C++ ``IPCBufferManager`` hands out as ``{pid, fd}`` pairs.

    Works for any exporter of CUDA VMM allocations as POSIX fds whose
    allocation size is known.  Each pair's fd is duplicated with
    ``pidfd_open`` + ``pidfd_getfd`` (as the seed's peers do), imported with
    ``cuMemImportFromShareableHandle``, mapped read-write on ``device`` and
    closed again (the import holds the memory).  Every step registers its
    undo: on any failure nothing stays open or mapped.  Each call maps anew
    (pairs carry no identity to cache on).

    Parameters
    ----------
    pairs:
        One ``[pid, fd]`` per buffer, all of one process, e.g. the seed's
        ``getCurIpcMemHandle()`` taken after each ``next()``.
    buffer_step:
        Usable bytes per buffer (the seed's ``bufferStep``); arrays are
        bounds-checked against it.
    device:
        Local device to map on, an ordinal or a ``cupy.cuda.Device``: the GPU
        the exporter allocated on (the seed allocates on its device 0, as
        numbered in its own process), or one with peer access to it.  Its
        granularity sizes the mapping.
    rounding:
        How the exporter sized its allocations (:func:`seed_alloc_nbytes`):
        ``"seed"`` (default) for the C++ ``IPCBufferManager``, ``"exact"`` for
        this library's ``IpcPool`` / ``IPCBufferManager``.
    alloc_nbytes:
        The exporter's allocation size in bytes, for exporters that round
        otherwise (overrides ``rounding``); a multiple of the granularity.

    Returns
    -------
    SeedBuffers
        Use as a context manager, or call ``close()``.

    Raises
    ------
    UsageError, UsageTypeError
        Bad ``buffer_step``, ``device``, ``rounding`` or ``alloc_nbytes``.
    DescriptorError
        A pid or fd out of range, pairs of several processes, a repeated pair.
    TransportError
        An fd could not be fetched: the message says why and what to do.
    CudaUnavailableError, UnsupportedDeviceError
        No driver or device, or the device lacks VMM with POSIX-fd handles.
    CudaError
        Import or mapping failed (the message names the buffer); nothing is
        left mapped.
    """
    buffer_step = _as_int(buffer_step, "buffer_step")
    if not 1 <= buffer_step <= MAX_SLOT_NBYTES:
        raise UsageError(f"buffer_step must be in 1..{MAX_SLOT_NBYTES}, got {buffer_step}")
    device = device_ordinal(device)
    if rounding not in ROUNDINGS:
        raise UsageError(f'rounding must be "seed" or "exact", got {rounding!r}')
    if alloc_nbytes is not None:
        alloc_nbytes = _as_int(alloc_nbytes, "alloc_nbytes")
        if not buffer_step <= alloc_nbytes <= MAX_SLOT_NBYTES:
            raise UsageError(
                f"alloc_nbytes must be in {buffer_step}..{MAX_SLOT_NBYTES} "
                f"(at least buffer_step), got {alloc_nbytes}"
            )
    pid, target_fds = _check_pairs(pairs)
    checked = tuple((pid, fd) for fd in target_fds)
    fds = _fetch(pid, target_fds)
    try:
        gran = _driver.require_vmm_device(device).granularity or 0
        if alloc_nbytes is None:
            size = seed_alloc_nbytes(buffer_step, gran, rounding)
        elif alloc_nbytes % gran:
            raise UsageError(
                f"alloc_nbytes={alloc_nbytes} is not a multiple of device {device}'s "
                f"granularity {gran}"
            )
        else:
            size = alloc_nbytes
        allocations = _import_buffers(fds, checked, size, device)
    finally:
        _close_quietly(fds)
    mem = _SeedMemory(allocations)
    return SeedBuffers(mem, pid, checked, buffer_step, size, gran, device)


def _close_quietly(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:  # pragma: no cover - our own fresh fds
            warnings.warn(f"closing fetched fd {fd} failed: {exc}", TeardownWarning, stacklevel=3)
