"""Type stub of the compiled module ``cupy_ipcpool._fastpath`` (source: ``_fastpath.c``)."""

def memop(fn: int, stream: int, addr: int, value: int, flags: int, /) -> int:
    """Call a driver stream memory operation at ``fn``; return its CUresult (0 on success)."""
