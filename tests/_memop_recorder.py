"""A C-callable stand-in for a driver stream memory operation, recording its arguments.

``_fastpath`` calls whatever function pointer it is given as
``int fn(void *stream, unsigned long long addr, unsigned int value, unsigned int flags)``;
on the GPU machine that is the driver's ``cuStreamWriteValue32`` /
``cuStreamWaitValue32``.  On CPU tests it is this recorder, which checks the
argument conversion and the calling convention, not the driver.
"""

from __future__ import annotations

import ctypes

MEMOP = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint
)


class MemopRecorder:
    """``address``: the function pointer; ``calls``: ``(stream, addr, value, flags)`` per call."""

    def __init__(self, result: int = 0) -> None:
        self.calls: list[tuple[int | None, int, int, int]] = []
        self.result = result
        self.fn = MEMOP(self._call)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value or 0

    def _call(self, stream: int | None, addr: int, value: int, flags: int) -> int:
        self.calls.append((stream, addr, value, flags))
        return self.result
