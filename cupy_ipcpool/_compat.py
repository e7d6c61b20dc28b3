"""A seed-compatible façade: ``IPCBufferManager`` for people porting the C++ class.

See ``docs/porting.md`` for the mapping table.
"""

from __future__ import annotations

from ._args import DeviceLike
from ._pool import IpcPool


class IPCBufferManager(IpcPool):
    """The C++ ``IPCBufferManager(size, bufferStep)`` on top of :class:`IpcPool`.

    Parameters
    ----------
    size:
        Number of buffers in the pool (the seed's ``size``).
    buffer_step:
        Bytes per buffer (the seed's ``bufferStep``).
    device:
        CUDA device ordinal, or a ``cupy.cuda.Device`` (the seed hard-coded device 0).

    Notes
    -----
    Unlike the seed, :meth:`next` refuses to recycle a buffer that a live
    array or a peer lease still uses (:class:`SlotBusyError`), driver failures
    raise instead of being printed, and :meth:`close` (or the context manager)
    releases everything.
    """

    def __init__(self, size: int, buffer_step: int, *, device: DeviceLike = 0) -> None:
        super().__init__(size, buffer_step, device=device)

    def getCurBufferPtr(self) -> int:
        """Device pointer of the current buffer (the seed's ``getCurBufferPtr``)."""
        return self.ptr()

    def getCurIpcMemHandle(self) -> list[int]:
        """``[pid, fd]`` of the current buffer (the seed's ``getCurIpcMemHandle``)."""
        return list(self.ipc_handle())
