"""One death watch, one value per wait, the same in Python and in the C library (no GPU).

:func:`~cupy_ipcpool.channel._settle.exited` and
:func:`~cupy_ipcpool.channel._settle.settle_if_dead` are what every Python
caller asks about a peer's death; :data:`DEATH_WAIT`, :data:`CLOSE_GRACE`
and ``_vmm.DRAIN_TIMEOUT`` are generated into ``cupy_ipcpool_wire.h`` and the
C source keeps no copy of its own.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cupy_ipcpool import _vmm
from cupy_ipcpool.channel import _publisher, _settle
from cupy_ipcpool.channel._settle import (
    CLOSE_GRACE,
    DEATH_WAIT,
    STREAMS_KEPT,
    PageStreams,
    close_pidfd,
    exited,
    open_pidfd,
    settle_if_dead,
)
from cupy_ipcpool.channel._syncpage import FlagLayout, FrameWaits, SharedFlags

C_DIR = Path(__file__).resolve().parent.parent / "c"


def _child(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_exited_waits_for_the_pidfd_and_sees_the_exit() -> None:
    assert not exited(-1) and not exited(-1, 0.05)
    child = _child(60)
    pidfd = open_pidfd(child.pid)
    try:
        assert pidfd >= 0
        start = time.monotonic()
        assert not exited(pidfd, 0.1)
        assert time.monotonic() - start >= 0.09
        child.kill()
        assert exited(pidfd, 10.0)
        assert exited(pidfd)  # and stays readable
    finally:
        child.kill()
        child.wait()
        close_pidfd(pidfd)


def test_exited_takes_a_pidfd_past_fd_setsize() -> None:
    """``select`` cannot watch fd 1024 and above; a busy process hands out such fds."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 1100:
        pytest.skip(f"RLIMIT_NOFILE {soft}: no fd past 1024 here")
    child = _child(60)
    pidfd = open_pidfd(child.pid)
    high = os.dup2(pidfd, 1090)
    try:
        assert not exited(high)
        child.kill()
        assert exited(high, 10.0)
    finally:
        child.kill()
        child.wait()
        close_pidfd(pidfd)
        close_pidfd(high)


def test_settle_if_dead_waits_only_while_a_flag_is_awaited() -> None:
    layout = FlagLayout(4, 2)
    page = SharedFlags.create(layout.nbytes)
    child = _child(60)
    pidfd = open_pidfd(child.pid)
    try:
        waits = FrameWaits(layout)
        # nothing awaited: no reason to wait, whatever the caller offers
        start = time.monotonic()
        assert not settle_if_dead(page, waits, pidfd, DEATH_WAIT)
        assert time.monotonic() - start < 1.0
        # a stream waits on slot 2's flag: the wait is spent on a live producer, nothing forced
        waits.note(2, 7)
        start = time.monotonic()
        assert not settle_if_dead(page, waits, pidfd, 0.2)
        assert time.monotonic() - start >= 0.19
        assert waits.forced == 0 and page.load(layout.frame_offset(2)) == 0
        # it dies: the awaited flag is forced, so that the stream's wait ends
        child.kill()
        assert settle_if_dead(page, waits, pidfd, DEATH_WAIT)
        assert waits.forced == 1 and not waits.pending(page)
        # no pidfd: a death cannot be seen, nothing is forced
        waits.note(3, 1)
        assert not settle_if_dead(page, waits, -1, 0.05)
        assert waits.pending(page) == [3]
    finally:
        child.kill()
        child.wait()
        close_pidfd(pidfd)
        page.close()


def test_page_streams_keep_one_entry_and_the_object_per_stream() -> None:
    streams = PageStreams()
    assert streams.idle() and len(streams) == 0
    held = object()
    streams.note(0x1000, held)
    streams.note(0x1000, object())  # known: neither replaced nor counted twice
    streams.note(0x2000)  # a raw handle, no object to keep
    assert streams.ptrs == {0x1000: held, 0x2000: None}
    streams.clear()
    assert len(streams) == 0
    streams.synchronize()  # nothing tracked: no CUDA call
    assert STREAMS_KEPT == 16


def test_one_close_grace_for_both_ends() -> None:
    import inspect

    assert inspect.signature(_publisher.Publisher.close).parameters["timeout"].default == (
        CLOSE_GRACE
    )
    assert _settle.CLOSE_GRACE < _vmm.DRAIN_TIMEOUT


def test_the_c_library_uses_the_generated_waits_only() -> None:
    header = (C_DIR / "include" / "cupy_ipcpool_wire.h").read_text()
    for name, seconds in (
        ("DEATH_WAIT_MS", DEATH_WAIT),
        ("CLOSE_WAIT_MS", CLOSE_GRACE),
        ("UNMAP_WAIT_MS", _vmm.DRAIN_TIMEOUT),
    ):
        assert f"#define CIP_WIRE_{name} {round(seconds * 1000)}u" in header, name
    source = "".join(path.read_text() for path in sorted((C_DIR / "src").glob("*.[ch]")))
    own = re.findall(r"#define\s+(CIP_\w*(?:_WAIT_MS|GRACE|_TIMEOUT\w*))\b", source)
    assert not own, f"the C source defines its own waits: {own}"
    for name in ("DEATH_WAIT_MS", "CLOSE_WAIT_MS", "UNMAP_WAIT_MS"):
        assert f"CIP_WIRE_{name}" in source, name
