"""The exception hierarchy of cupy_ipcpool.

Every error the library raises derives from :class:`IpcPoolError`.  All of them
pickle (so they cross process boundaries in worker pools and tests): each class
either keeps the default ``Exception`` pickling (one message argument) or
defines ``__reduce__``.
"""

from __future__ import annotations

import errno as _errno
from typing import Any


class IpcPoolError(Exception):
    """Base class of every error raised by cupy_ipcpool."""


class CudaUnavailableError(IpcPoolError):
    """No usable CUDA driver, device, or binding package in this process.

    Raised by every GPU entry point when the machine has no driver, no device,
    or when ``cuda-bindings`` / ``cupy`` cannot be imported.  The message says
    what is missing.
    """


class CudaError(IpcPoolError):
    """A CUDA driver call failed.

    Attributes
    ----------
    call:
        Name of the driver function, e.g. ``"cuMemMap"``.
    code:
        The numeric ``CUresult``.
    name:
        The enum name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
    """

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = int(code)
        self.name = name
        self.detail = detail
        msg = f"{call}: {name} ({self.code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.code, self.name, self.detail))


class CudaOutOfMemoryError(CudaError, MemoryError):
    """The device could not provide the requested physical memory."""


_MPS_FAULT = (
    "under the MPS daemon, a fatal fault in any client of the GPU is reported to every "
    "client of that GPU, and the server takes no new client until all of them have exited"
)
_STICKY = (
    "a kernel on this process's context faulted; the context cannot be used again: "
    "restart the process (" + _MPS_FAULT + ")"
)
#: What to do about a driver error, by its enum name (see :func:`cuda_error_hint`).
CUDA_ERROR_HINTS: dict[str, str] = {
    "CUDA_ERROR_ILLEGAL_ADDRESS": _STICKY,
    "CUDA_ERROR_LAUNCH_FAILED": _STICKY,
    "CUDA_ERROR_ILLEGAL_INSTRUCTION": _STICKY,
    "CUDA_ERROR_MISALIGNED_ADDRESS": _STICKY,
    "CUDA_ERROR_HARDWARE_STACK_ERROR": _STICKY,
    "CUDA_ERROR_MPS_CONNECTION_FAILED": (
        "the MPS control daemon or its server could not be reached: start it "
        "('nvidia-cuda-mps-control -d', with the same CUDA_MPS_PIPE_DIRECTORY as this "
        "process), or run without MPS"
    ),
    "CUDA_ERROR_MPS_RPC_FAILURE": "the MPS server stopped answering; restart the process",
    "CUDA_ERROR_MPS_SERVER_NOT_READY": (
        "the MPS server is recovering from a client's fatal GPU fault; " + _MPS_FAULT
    ),
    "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED": "the MPS server takes no more clients on this GPU",
    "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED": "the MPS server takes no more connections",
    "CUDA_ERROR_MPS_CLIENT_TERMINATED": (
        "the MPS server ended this process's GPU work, most likely because another client "
        "of the GPU faulted; restart the process (" + _MPS_FAULT + ")"
    ),
}


def cuda_error_hint(name: str) -> str:
    """What to do about the driver error ``name`` (``""`` when there is nothing to add)."""
    return CUDA_ERROR_HINTS.get(name, "")


def cuda_error(call: str, code: int, name: str) -> CudaError:
    """The library's exception for driver error ``name`` (``code``) from ``call``, with its hint.

    :class:`CudaOutOfMemoryError` for ``CUDA_ERROR_OUT_OF_MEMORY``, else
    :class:`CudaError`; the message carries :func:`cuda_error_hint`.
    """
    cls = CudaOutOfMemoryError if name == "CUDA_ERROR_OUT_OF_MEMORY" else CudaError
    return cls(call, code, name, cuda_error_hint(name))


class UnsupportedDeviceError(IpcPoolError):
    """The device lacks a capability the library needs (VMM, POSIX-fd handles...)."""


class PoolClosedError(IpcPoolError):
    """The pool (or peer pool, publisher, subscriber) was used after ``close()``."""


class ForkedProcessError(IpcPoolError):
    """A pool was used in a child created by ``fork``.

    CUDA state does not survive ``fork``; use the ``spawn`` or ``forkserver``
    start method and share the pool with a descriptor instead.
    """


class DescriptorError(IpcPoolError, ValueError):
    """A descriptor, array handle or wire message is malformed or inconsistent.

    Raised for every input from another process that fails validation: bad
    version, truncated or oversized data, out-of-range fields, shapes or offsets
    that do not fit the slot.
    """


class StaleHandleError(DescriptorError):
    """An array handle refers to an older generation of its slot."""


class TransportError(IpcPoolError, OSError):
    """Moving file descriptors between processes failed.

    Keeps the ``errno`` of the failing system call and adds the fix to the
    message, e.g. ``EPERM`` from ``pidfd_getfd`` names the ptrace policy,
    ``CAP_SYS_PTRACE`` and the socket transport.
    """

    def __init__(self, err: int, message: str) -> None:
        super().__init__(err, message)

    def __str__(self) -> str:
        name = _errno.errorcode.get(self.errno or 0, str(self.errno))
        return f"[{name}] {self.strerror}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errno, self.strerror))


class TransportTimeoutError(TransportError, TimeoutError):
    """Moving file descriptors did not finish in time (``ETIMEDOUT``).

    A :class:`TransportError` that is also a :class:`TimeoutError`, so
    ``except TimeoutError`` keeps catching it: a listen backlog that stayed
    full until the deadline, or an fd server that did not answer in time.
    """


class PeerRefusedError(TransportError):
    """A peer was refused: its uid is not allowed, or it spoke out of protocol."""

    def __init__(self, message: str, err: int = _errno.EACCES) -> None:
        super().__init__(err, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.strerror, self.errno))


class SlotBusyError(IpcPoolError, TimeoutError):
    """No slot became free in time: local arrays or peer leases still hold them."""


class SlotFullError(IpcPoolError, MemoryError):
    """An allocation does not fit in the remaining space of the current slot."""

    def __init__(self, requested: int, remaining: int, slot: int, slot_nbytes: int) -> None:
        self.requested = requested
        self.remaining = remaining
        self.slot = slot
        self.slot_nbytes = slot_nbytes
        super().__init__(
            f"allocation of {requested} bytes does not fit in slot {slot}: "
            f"{remaining} of {slot_nbytes} bytes remain; use a larger slot_nbytes, "
            f"release arrays allocated in this slot, or pass overflow='spill'"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.requested, self.remaining, self.slot, self.slot_nbytes))


class NotShareableError(IpcPoolError, ValueError):
    """The array's memory does not lie inside the pool, so no peer can map it."""


class CompiledPartError(IpcPoolError, ImportError):
    """A compiled part of the package is not built, does not load, or was built
    from other sources than this code; the message says how to rebuild it.
    Also an :class:`ImportError`."""


class ProtocolError(IpcPoolError):
    """A peer sent a message that is malformed or out of protocol."""


class ForeignPeerError(ProtocolError):
    """The peer answered in another protocol: it is no cupy_ipcpool publisher (or remote
    server) at all, as opposed to one that broke the protocol.

    Raised by a subscriber's handshake, with the address and the first bytes
    the peer sent.  Not exported: catch :class:`ProtocolError`.
    """


class EndOfStream(IpcPoolError):
    """The publisher closed or died: no more frames will arrive.

    Frames already received stay readable.  ``clean`` is True when the
    publisher said goodbye (``close()``), False when the connection broke
    (the publisher died, or a protocol error closed it).

    Attributes
    ----------
    clean:
        The publisher said goodbye.
    incomplete:
        Sequence numbers of the frames this subscriber received (held or
        already released) that the producer never finished writing: it died
        before its stream set their flags.  Results computed on them are
        undefined: discard or recompute them.  Empty when none was.
    pending:
        Sequence numbers of received frames whose flags were neither set by
        the producer nor forced yet when this was raised (the producer was not
        seen dead: alive, or its pid not visible here); the subscriber's
        ``incomplete_frames`` after ``close()`` has the final answer.
    untracked:
        Frames received but not tracked (the subscriber's record was full):
        ask their ``Frame.complete``.
    """

    def __init__(
        self,
        message: str,
        clean: bool = False,
        incomplete: tuple[int, ...] = (),
        pending: tuple[int, ...] = (),
        untracked: int = 0,
    ) -> None:
        self.clean = clean
        self.incomplete = tuple(incomplete)
        self.pending = tuple(pending)
        self.untracked = int(untracked)
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (str(self), self.clean, self.incomplete, self.pending, self.untracked),
        )


class UsageError(IpcPoolError, ValueError):
    """A call the library cannot accept: an argument out of range, or a call made
    in the wrong state (``publish`` before ``acquire``, a frame published twice,
    a released slot token used again).  Also a :class:`ValueError`."""


class UsageTypeError(UsageError, TypeError):
    """An argument of the wrong type.  Also a :class:`TypeError`."""


class SlotIndexError(UsageError, IndexError):
    """A slot index outside ``0 .. num_slots - 1``.  Also an :class:`IndexError`."""


class TeardownWarning(RuntimeWarning):
    """Releasing a resource failed during teardown; the resource may have leaked."""


class ChannelTimeoutError(IpcPoolError, TimeoutError):
    """A channel step did not finish in time: no frame arrived, the handshake or a
    release could not complete within the caller's timeout."""

    @classmethod
    def no_frame(cls, timeout: float | None) -> ChannelTimeoutError:
        """The answer of a receive that found no frame within ``timeout`` seconds."""
        return cls(f"no frame within {timeout} s")


class EvictedError(EndOfStream):
    """The publisher evicted this subscriber: it held a frame longer than the
    publisher's ``lease_timeout``.

    Every lease it held was taken back, so the slots of the frames it still
    holds may already carry newer data: those frames must not be read any
    more.  Frames it released before the eviction were intact up to their
    release.  Raised on the subscriber's next call and on every later one;
    subscribe again to resume.
    """


class LeaseStateError(IpcPoolError, RuntimeError):
    """The lease accounting was misused by its owner: a slot published while
    subscribers still hold it, or a local hold dropped that was never taken."""


__all__ = [
    "ChannelTimeoutError",
    "CompiledPartError",
    "CudaError",
    "CudaOutOfMemoryError",
    "CudaUnavailableError",
    "DescriptorError",
    "EndOfStream",
    "EvictedError",
    "ForkedProcessError",
    "IpcPoolError",
    "LeaseStateError",
    "NotShareableError",
    "PeerRefusedError",
    "PoolClosedError",
    "ProtocolError",
    "SlotBusyError",
    "SlotFullError",
    "SlotIndexError",
    "StaleHandleError",
    "TeardownWarning",
    "TransportError",
    "TransportTimeoutError",
    "UnsupportedDeviceError",
    "UsageError",
    "UsageTypeError",
]
