"""Type stub of the compiled module ``cupy_ipcpool._fastpath`` (source: ``_fastpath.c``)."""

def memop(fn: int, stream: int, addr: int, value: int, flags: int, /) -> int:
    """Call a driver stream memory operation at ``fn``; return its CUresult (0 on success)."""

def wait_all(
    fn: int, stream: int, addrs: tuple[int, ...] | list[int], value: int, flags: int, /
) -> int:
    """Enqueue 32-bit waits on every address in one ``cuStreamBatchMemOp`` at ``fn``."""

#: (magic, version, FRAME, RELEASE, FRAME header size, RELEASE size, most FRAME payload bytes)
PROTOCOL: tuple[int, int, int, int, int, int, int]

def pollfds(pairs: object, /) -> bytes:
    """Pack ``(fd, events)`` pairs (at most 16) as a ``struct pollfd`` array."""

def recv_frame(
    fd: int, buf: bytearray, timeout_ms: int, poll_first: bool, hup: bytes, /
) -> tuple[int, int, int, bool] | None:
    """Wait for one datagram; ``(n, seq, slot, waited)``, seq -1 when not a FRAME to take."""

def release_frame(
    fd: int,
    hup: bytes,
    fn: int,
    stream: int,
    addr: int,
    value: int,
    flags: int,
    seq: int,
    slot: int,
    /,
) -> int:
    """Hang-up check, read-flag write, RELEASE; -1 after a hang-up, else the CUresult."""
