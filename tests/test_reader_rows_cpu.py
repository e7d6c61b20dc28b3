"""The publisher's rows of read flags (``_engine.ReaderRows``, ``c/src/reader_rows.c``).

Which subscriber writes which row of read flags in the sync page, and the rows of
subscribers that left while the publisher's streams may still wait on them: kept
out of reuse until their flags are in, their process dies (then forced), the
streams are idle, or the row is needed (the oldest is forced).  A real memfd
page, real processes and their pidfds.  The close path with a stream that waits
on a departed row: ``test_restart_cpu.test_a_dead_readers_flags_are_forced_a_live_ones_never``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from cupy_ipcpool._errors import UsageError
from cupy_ipcpool.channel._settle import reader_rows
from cupy_ipcpool.channel._syncpage import FlagLayout, SharedFlags

SLOTS, ROWS = 4, 3
LAYOUT = FlagLayout(SLOTS, ROWS)


@pytest.fixture
def page() -> Iterator[SharedFlags]:
    flags = SharedFlags.create(LAYOUT.nbytes)
    yield flags
    flags.close()


@pytest.fixture
def live() -> Iterator[subprocess.Popen[bytes]]:
    """A subscriber process that lives until the test ends."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _row(page: SharedFlags, row: int) -> list[int]:
    return [page.load(LAYOUT.read_offset(row, s)) for s in range(SLOTS)]


def _write_row(page: SharedFlags, row: int, values: list[int]) -> None:
    for s, v in enumerate(values):
        page.store(LAYOUT.read_offset(row, s), v)


def test_rows_go_round_robin_and_one_never_adopted_is_free_at_once(page: SharedFlags) -> None:
    rows = reader_rows(page, LAYOUT)
    try:
        assert [rows.assign(i, os.getpid()) for i in (1, 2)] == [0, 1]
        rows.leave(1, [5] * SLOTS, False)  # never adopted: it read nothing
        assert rows.departed == 0 and rows.index(1) is None
        assert rows.assign(3, os.getpid()) == 2  # round-robin: the freed row 0 comes last
        assert rows.assign(4, os.getpid()) == 0
        assert rows.assign(5, os.getpid()) is None  # every row is live
        assert rows.live == 3 and rows.index(4) == 0
        rows.leave(99, [5] * SLOTS, False)  # unknown: nothing
    finally:
        rows.release_page()


def test_a_live_departed_row_waits_for_its_flags(
    page: SharedFlags, live: subprocess.Popen[bytes]
) -> None:
    rows = reader_rows(page, LAYOUT)
    try:
        assert rows.assign(1, live.pid) == 0
        rows.adopt(1)
        rows.leave(1, [7, 8, 9, 2**32 + 3], False)  # generations, taken modulo 2**32
        assert rows.departed == 1 and rows.settle(False) == 1
        _write_row(page, 0, [7, 8, 9, 2])
        assert rows.settle(False) == 1  # slot 3 still behind
        _write_row(page, 0, [7, 8, 9, 3])
        assert rows.settle(False) == 0 and rows.forced == 0  # its own writes came
        assert [rows.assign(i, live.pid) for i in (2, 3, 4)] == [1, 2, 0]  # row 0 is free
        assert rows.assign(5, live.pid) is None
    finally:
        rows.release_page()


def test_idle_streams_let_a_departed_row_go(
    page: SharedFlags, live: subprocess.Popen[bytes]
) -> None:
    rows = reader_rows(page, LAYOUT)
    try:
        rows.assign(1, live.pid)
        rows.adopt(1)
        rows.leave(1, [4] * SLOTS, True)  # nothing of ours waits: done at once
        assert rows.departed == 0
        rows.assign(2, live.pid)
        rows.adopt(2)
        rows.leave(2, [4] * SLOTS, False)
        assert rows.settle(True) == 0 and rows.forced == 0 and _row(page, 1) == [0] * SLOTS
    finally:
        rows.release_page()


def test_a_dead_readers_flags_are_forced_where_it_never_wrote_them(page: SharedFlags) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    rows = reader_rows(page, LAYOUT)
    try:
        rows.assign(1, proc.pid)
        rows.adopt(1)
        _write_row(page, 0, [6, 0, 0, 0])  # its stream's write that landed
        page.store(LAYOUT.read_offset(0, 3), 3)  # past 2**32 - 5, cyclically: left alone
        proc.kill()
        proc.wait()
        rows.leave(1, [6, 6, 6, 2**32 - 5], False)
        assert rows.departed == 0 and rows.forced == 2
        assert _row(page, 0) == [6, 6, 6, 3]
        assert _row(page, 1) == [0] * SLOTS  # other rows untouched
    finally:
        rows.release_page()


def test_a_departed_row_is_looked_at_when_due_and_then_dies(page: SharedFlags) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    rows = reader_rows(page, LAYOUT)
    try:
        assert not rows.due()  # nothing departed
        rows.assign(1, proc.pid)
        rows.adopt(1)
        rows.leave(1, [5] * SLOTS, False)
        assert rows.due() and not rows.due()  # at most every 10 ms
        time.sleep(0.011)
        assert rows.due()
        proc.kill()
        proc.wait()
        assert rows.settle(False) == 0 and rows.forced == SLOTS
        assert _row(page, 0) == [5] * SLOTS
    finally:
        rows.release_page()


def test_with_no_free_row_the_oldest_departed_is_forced_and_taken(
    page: SharedFlags, live: subprocess.Popen[bytes]
) -> None:
    rows = reader_rows(page, LAYOUT)
    try:
        for sub_id in (1, 2, 3):
            assert rows.assign(sub_id, live.pid) == sub_id - 1
            rows.adopt(sub_id)
        rows.leave(2, [3] * SLOTS, False)
        rows.leave(1, [4] * SLOTS, False)  # row 0 departed after row 1
        assert rows.departed == 2
        assert rows.assign(4, live.pid) == 1  # the oldest departed row, forced
        assert _row(page, 1) == [3] * SLOTS and _row(page, 0) == [0] * SLOTS
        assert rows.departed == 1 and rows.forced == SLOTS
    finally:
        rows.release_page()


def test_close_departs_every_adopted_row(page: SharedFlags, live: subprocess.Popen[bytes]) -> None:
    rows = reader_rows(page, LAYOUT)
    try:
        rows.assign(1, live.pid)
        rows.adopt(1)
        rows.assign(2, live.pid)  # welcomed, never adopted: nothing waits on it
        rows.close([1] * SLOTS)
        assert rows.live == 0 and rows.departed == 1 and not rows.all_settled()
        _write_row(page, 0, [1] * SLOTS)
        assert rows.all_settled() and rows.forced == 0
    finally:
        rows.release_page()


def test_the_rows_refuse_what_they_cannot_keep(page: SharedFlags) -> None:
    with pytest.raises(UsageError, match="do not fit a page"):
        from cupy_ipcpool._engine import ReaderRows

        ReaderRows(page.mapping, LAYOUT.reads_offset, 1000, SLOTS)
    rows = reader_rows(page, LAYOUT)
    try:
        rows.assign(1, os.getpid())
        with pytest.raises(UsageError, match="has a row already"):
            rows.assign(1, os.getpid())
        with pytest.raises(UsageError, match="has no row"):
            rows.adopt(2)
        with pytest.raises(ValueError, match="one per slot"):
            rows.leave(1, [1], False)
        assert rows.index(1) == 0  # nothing changed
    finally:
        rows.release_page()
    with pytest.raises(RuntimeError, match="let go of their page"):
        rows.assign(2, os.getpid())
    assert rows.departed == 0 and not rows.due()
