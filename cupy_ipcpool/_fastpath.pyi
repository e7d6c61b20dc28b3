"""Type stub of the compiled module ``cupy_ipcpool._fastpath`` (source: ``_fastpath.c``)."""

#: Most waits one ``wait_all`` call takes (``cuStreamBatchMemOp``: "count must be less than 256").
MAX_BATCH: int

def memop(fn: int, stream: int, addr: int, value: int, flags: int, /) -> int:
    """Call a driver stream memory operation at ``fn``; return its CUresult (0 on success)."""

def wait_all(
    fn: int, stream: int, addrs: tuple[int, ...] | list[int], value: int, flags: int, /
) -> int:
    """Enqueue 32-bit waits on every address in one ``cuStreamBatchMemOp`` at ``fn``."""
