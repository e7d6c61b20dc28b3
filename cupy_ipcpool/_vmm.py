"""One shareable VMM allocation: create / export / import / reserve / map / access / release.

Every multi-step driver sequence runs under an :class:`UndoStack`, so a failure
at any step leaves nothing behind.  :class:`Allocation` owns a physical
allocation handle, its mapped address range and (optionally) an exported fd,
and releases them in order: unmap, free the address range, release the handle,
close the fd.  :func:`release_after_queued_work` is how every owner of mapped
memory lets it go: ``cuMemUnmap`` does not wait for kernels as ``cudaFree``
does, so memory is unmapped only once no GPU work queued in this process can
still touch it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from . import _driver
from ._errors import TeardownWarning, UsageError


def round_up(nbytes: int, granularity: int) -> int:
    """Round ``nbytes`` up to a multiple of ``granularity``.

    An already aligned size is returned unchanged (the seed added a whole extra
    granule in that case).

    Raises
    ------
    UsageError
        When ``nbytes`` is not positive or ``granularity`` is not positive.
    """
    if granularity <= 0:
        raise UsageError(f"granularity must be positive, got {granularity}")
    if nbytes <= 0:
        raise UsageError(f"size must be positive, got {nbytes}")
    return -(-nbytes // granularity) * granularity


class UndoStack:
    """Run registered undo steps in reverse unless :meth:`commit` was called.

    A thin layer over :class:`contextlib.ExitStack` (which does the ordering
    and the unwinding) that adds the library's rule: undo steps never raise.
    Use as a context manager around a multi-step driver sequence::

        with UndoStack() as undo:
            h = create(); undo.push(release, h)
            p = reserve(); undo.push(free, p)
            undo.commit()

    A failing step is reported as a :class:`TeardownWarning` and the remaining
    steps still run.  Leaving the block without :meth:`commit` (normally or by
    an exception) rolls back.
    """

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def push(self, fn: Callable[..., Any], *args: Any) -> None:
        """Register ``fn(*args)`` to run if the sequence fails."""
        self._stack.callback(_undo_quietly, fn, args)

    def commit(self) -> None:
        """Disarm: the sequence succeeded, keep everything."""
        self._stack.pop_all()

    def rollback(self) -> None:
        """Run every registered step, newest first."""
        self._stack.close()

    def __enter__(self) -> UndoStack:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.rollback()


def _undo_quietly(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception as exc:
        warnings.warn(
            f"undo step {getattr(fn, '__name__', fn)} failed: {exc}",
            TeardownWarning,
            stacklevel=3,
        )


def _posix_fd_type() -> Any:
    handle_types = _driver.driver_module().CUmemAllocationHandleType
    return handle_types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _close_fd(fd: int) -> None:
    os.close(fd)


class Allocation:
    """A physical allocation mapped read-write into this process, maybe with an fd.

    Build one with :meth:`create` (a new exportable allocation) or
    :meth:`import_fd` (map a peer's allocation).  :meth:`close` releases it.

    Attributes
    ----------
    ptr:
        Device address of the mapping.
    size:
        Mapped bytes (a multiple of the granularity).
    fd:
        The exported POSIX fd, or -1 (imports keep none).
    device:
        The ordinal of the device granted access.
    """

    __slots__ = ("_handle", "_mapped", "device", "fd", "ptr", "size")

    def __init__(self, handle: Any, ptr: int, size: int, fd: int, device: int) -> None:
        self._handle = handle
        self.ptr = ptr
        self.size = size
        self.fd = fd
        self.device = device
        self._mapped = True

    @classmethod
    def create(
        cls, size: int, device: int, *, export: bool = True, prop: Any = None, access: Any = None
    ) -> Allocation:
        """Create ``size`` bytes on ``device``, map them and export a POSIX fd.

        ``size`` must already be a multiple of the granularity.  ``prop`` and
        ``access`` (from :func:`_driver.allocation_prop` / ``access_desc``) may
        be passed in when creating many allocations; the device's context must
        then already be current.
        """
        if prop is None:
            _driver.use_device(device)
            prop = _driver.allocation_prop(device)
        with UndoStack() as undo:
            handle = _driver.call("cuMemCreate", size, prop, 0)
            undo.push(_driver.call, "cuMemRelease", handle)
            ptr = _map(handle, size, device, undo, access)
            fd = -1
            if export:
                fd = int(_driver.call("cuMemExportToShareableHandle", handle, _posix_fd_type(), 0))
                undo.push(_close_fd, fd)
            undo.commit()
        return cls(handle, ptr, size, fd, device)

    @classmethod
    def import_fd(cls, fd: int, size: int, device: int, *, access: Any = None) -> Allocation:
        """Import a peer's allocation from ``fd`` and map ``size`` bytes on ``device``.

        The fd is not closed here; the caller owns it (the import holds the
        physical memory on its own).  With ``access`` given, the device's
        context must already be current.
        """
        if access is None:
            _driver.use_device(device)
        with UndoStack() as undo:
            handle = _driver.call("cuMemImportFromShareableHandle", fd, _posix_fd_type())
            undo.push(_driver.call, "cuMemRelease", handle)
            ptr = _map(handle, size, device, undo, access)
            undo.commit()
        return cls(handle, ptr, size, -1, device)

    def close(self) -> None:
        """Unmap, free the address range, release the handle, close the fd.

        Idempotent; never raises (failures become :class:`TeardownWarning`).
        It does not wait for GPU work: call it directly only on memory that no
        kernel has been given (a rolled-back construction); everything else
        goes through :func:`release_after_queued_work`.
        """
        if not self._mapped:
            return
        self._mapped = False
        steps: Sequence[tuple[str, tuple[Any, ...]]] = (
            ("cuMemUnmap", (self.ptr, self.size)),
            ("cuMemAddressFree", (self.ptr, self.size)),
            ("cuMemRelease", (self._handle,)),
        )
        for name, args in steps:
            try:
                _driver.call(name, *args)
            except Exception as exc:
                warnings.warn(f"{name} during close failed: {exc}", TeardownWarning, stacklevel=2)
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError as exc:
                warnings.warn(
                    f"closing exported fd {self.fd} failed: {exc}", TeardownWarning, stacklevel=2
                )
            self.fd = -1

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return not self._mapped


def _map(handle: Any, size: int, device: int, undo: UndoStack, access: Any = None) -> int:
    """Reserve an address range, map ``handle`` into it and grant ``device`` access."""
    ptr = _driver.call("cuMemAddressReserve", size, 0, 0, 0)
    undo.push(_driver.call, "cuMemAddressFree", ptr, size)
    _driver.call("cuMemMap", ptr, size, 0, handle, 0)
    undo.push(_driver.call, "cuMemUnmap", ptr, size)
    if access is None:
        access = [_driver.access_desc(device)]
    _driver.call("cuMemSetAccess", ptr, size, access, 1)
    return int(ptr)


#: Seconds a close waits for this process's queued GPU work before it hands the
#: unmap to a thread that does it once the work has finished (with a warning).
#: Longer than the channel's close grace (``channel._settle.CLOSE_GRACE``): this
#: waits for the user's own kernels, which may run for seconds, and past it the
#: memory is still freed (later, by the thread), so waiting costs only the close's
#: time.  One value for the Python package and the C library
#: (``CIP_WIRE_UNMAP_WAIT_MS``, generated from this by ``c/gen_wire.py``).
DRAIN_TIMEOUT = 10.0


def release_after_queued_work(
    allocations: Sequence[Allocation], *, timeout: float = DRAIN_TIMEOUT
) -> bool:
    """Close ``allocations`` once no GPU work queued in this process can still use them.

    Waits (``cuCtxSynchronize`` on each device's primary context, the one CuPy
    and the library use) for every kernel, copy and stream operation queued
    before the call, then unmaps and releases, as ``cudaFree`` does for plain
    allocations.  A wait longer than ``timeout`` seconds (a stream waiting on a
    flag that nobody sets, a kernel that runs for minutes) is not a reason to
    unmap under it: the allocations are then released by a background thread
    as soon as the work has finished, and a :class:`TeardownWarning` says so.
    A context that already holds an error (its work can no longer run) is
    reported with a :class:`TeardownWarning` and the memory released at once.
    Never raises.

    Returns
    -------
    bool
        True when the memory was released before returning.
    """
    live = [a for a in allocations if not a.closed]
    if not live:
        return True
    devices = sorted({a.device for a in live})
    drained = threading.Event()
    lock = threading.Lock()
    handed_over = False
    errors: list[str] = []

    def drain() -> None:
        for device in devices:
            try:
                _driver.synchronize_context(device)
            except Exception as exc:  # a broken context: its work will never touch memory again
                errors.append(f"device {device}: {exc}")
        with lock:
            drained.set()
            deferred = handed_over
        if deferred:
            _close_all(live, errors)

    try:
        threading.Thread(target=drain, name="cupy_ipcpool-drain", daemon=True).start()
    except RuntimeError:  # interpreter shutdown: no new threads; wait here
        drain()
    if not drained.wait(timeout):
        with lock:
            handed_over = not drained.is_set()
        if handed_over:
            warnings.warn(
                f"GPU work queued in this process still runs {timeout:g} s after close "
                f"({len(live)} mapping(s) of {sum(a.size for a in live)} bytes on device(s) "
                f"{devices}): the memory stays mapped until that work has finished, then "
                f"is released (a stream waiting on a flag nobody sets keeps it for good)",
                TeardownWarning,
                stacklevel=2,
            )
            return False
    _close_all(live, errors)
    return True


def _close_all(allocations: Sequence[Allocation], errors: list[str]) -> None:
    for message in errors:
        warnings.warn(
            f"GPU work of this process failed before its memory was unmapped ({message}); "
            f"unmapping anyway",
            TeardownWarning,
            stacklevel=3,
        )
    for alloc in allocations:
        alloc.close()
