"""Type stub of the compiled module ``cupy_ipcpool._engine`` (source: ``c/python/engine.c``
over the C library's ``c/src``)."""

#: The layouts and limits the engine was built for (``cupy_ipcpool._compiled.load`` checks them).
FRAME_HEAD_SIZE: int
FRAME_VOID: int
MAX_ARRAYS: int
MAX_METADATA: int
HANDLE_SIZE: int
WIRE_VERSION: int

def frame_head(
    payload: bytes | bytearray | memoryview, seq: int, slot: int, /
) -> tuple[int, int, int, bool]:
    """Check a FRAME payload's head; return (generation, count, metadata_len, void)."""

def check_frame(
    payload: bytes | bytearray | memoryview, seq: int, slot: int, slot_nbytes: int, /
) -> tuple[int, int, int, bool]:
    """Check a whole FRAME payload (head, handles, metadata length); as :func:`frame_head`."""
