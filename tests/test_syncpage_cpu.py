"""The sync page's host side, for real: memfds, seals, mappings shared between processes.

The flags that order the GPU work of a channel live in a sealed memfd that the
publisher creates and every subscriber maps (``channel/_syncpage.py``).  What a
subscriber receives is untrusted: anything but a memfd sealed against
shrinking and growing, of exactly the announced size, is refused before it is
mapped.  The GPU side (registration, stream writes and waits) is in
``tests/test_syncpage_gpu.py``.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import textwrap

import pytest

from cupy_ipcpool._errors import ProtocolError, UsageError
from cupy_ipcpool.channel._syncpage import FlagLayout, SharedFlags, SyncPage


def test_layout_puts_frame_flags_first_and_rows_after_256_bytes() -> None:
    layout = FlagLayout(5, 3)
    assert [layout.frame_offset(s) for s in range(5)] == [0, 4, 8, 12, 16]
    assert layout.reads_offset == 256
    assert layout.read_offset(0, 0) == 256
    assert layout.read_offset(2, 4) == 256 + (2 * 5 + 4) * 4
    assert layout.nbytes % os.sysconf("SC_PAGE_SIZE") == 0
    assert layout.nbytes >= layout.read_offset(2, 4) + 4


@pytest.mark.parametrize(
    ("slots", "rows", "words"),
    [
        (0, 1, "1..65536 slots and 1..65536 subscriber rows, not 0 and 1"),
        (1, 0, "not 1 and 0"),
        (65537, 1, "not 65537 and 1"),
        (1, 65537, "not 1 and 65537"),
        (-1, 4, "no -1 slots or subscriber rows"),
        (1, 2**32, "no 4294967296 slots"),
    ],
)
def test_layout_needs_a_slot_and_a_row_within_the_limits(slots: int, rows: int, words: str) -> None:
    with pytest.raises(UsageError, match=re.escape(words)):
        FlagLayout(slots, rows)
    assert FlagLayout(65536, 1).reads_offset == 65536 * 4


def test_created_page_is_zeroed_and_sealed() -> None:
    page = SharedFlags.create(FlagLayout(4, 2).nbytes)
    try:
        seals = fcntl.fcntl(page.fd, fcntl.F_GET_SEALS)
        for seal in (fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SEAL):
            assert seals & seal
        assert all(page.load(off) == 0 for off in range(0, page.nbytes, 4))
        # the publisher itself cannot shrink it under its subscribers
        with pytest.raises(PermissionError):
            os.ftruncate(page.fd, 0)
        assert not os.get_inheritable(page.fd)  # close-on-exec
        assert os.readlink(f"/proc/self/fd/{page.fd}").startswith("/memfd:cupy_ipcpool-sync")
        # what the page's creator makes, its readers accept (one rule each side, the engine's)
        SharedFlags.open(page.fd, page.nbytes).close()
    finally:
        page.close()


@pytest.mark.parametrize("nbytes", [0, -1, 1 << 41])
def test_a_page_of_no_size_or_too_large_is_refused(nbytes: int) -> None:
    with pytest.raises(UsageError, match="cip_sync_create"):
        SharedFlags.create(nbytes)


def test_reached_compares_cyclically_like_the_gpu() -> None:
    page = SharedFlags.create(4096)
    try:
        page.store(8, 7)
        assert page.reached(8, 7) and page.reached(8, 6) and not page.reached(8, 8)
        page.store(8, 0xFFFFFFFF)
        assert page.reached(8, 0xFFFFFFFE) and not page.reached(8, 0)
        page.store(8, 3)  # wrapped past 2**32: 3 comes after 0xFFFFFFFF
        assert page.reached(8, 0xFFFFFFFF) and page.reached(8, 1 << 32 | 3)
        assert page.load(8) == 3 and page.load(4) == 0
    finally:
        page.close()


def test_a_second_mapping_sees_the_same_flags_and_owns_its_fd(fd_count) -> None:  # type: ignore[no-untyped-def]
    before = fd_count()
    page = SharedFlags.create(8192)
    other = SharedFlags.open(page.fd, 8192)
    try:
        assert other.fd != page.fd  # a dup: the caller keeps its fd
        page.store(4100, 42)
        assert other.load(4100) == 42
        other.store(0, 9)
        assert page.reached(0, 9)
    finally:
        other.close()
        other.close()  # idempotent
        page.close()
    assert fd_count() == before


def _in_another_process(page: SharedFlags, body: str) -> None:
    """Run ``body`` in a child Python with ``page`` (4096 bytes) mapped there as ``page``.

    The child opens the page from its fd (passed at exec) and closes it after
    ``body``; a failed assertion there fails the run (``check=True``).
    """
    os.set_inheritable(page.fd, True)
    code = (
        "from cupy_ipcpool.channel._syncpage import SharedFlags\n"
        f"page = SharedFlags.open({page.fd}, 4096)\n" + textwrap.dedent(body) + "page.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, pass_fds=[page.fd], timeout=60)


def test_another_process_maps_the_page_from_its_fd() -> None:
    """The flag a child process stores is what this process loads (fd passed at exec)."""
    page = SharedFlags.create(4096)
    try:
        page.store(16, 5)
        _in_another_process(
            page,
            """
            assert page.load(16) == 5
            page.store(20, 0xDEADBEEF)
            """,
        )
        assert page.load(20) == 0xDEADBEEF
    finally:
        page.close()


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize(
    "seals",
    [0, fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_WRITE],
    ids=["none", "shrink-only", "grow-only", "seal+write"],
)
def test_a_page_that_could_be_truncated_is_refused(seals: int, fd_count) -> None:  # type: ignore[no-untyped-def]
    fd = _memfd(4096, seals)
    before = fd_count()
    try:
        with pytest.raises(ProtocolError, match="not sealed"):
            SharedFlags.open(fd, 4096)
        assert fd_count() == before
    finally:
        os.close(fd)


def test_a_page_of_another_size_is_refused() -> None:
    fd = _memfd(8192, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        with pytest.raises(ProtocolError, match="8192 bytes, the WELCOME says 4096"):
            SharedFlags.open(fd, 4096)
    finally:
        os.close(fd)


def test_fds_that_are_no_memfd_are_refused(tmp_path: os.PathLike[str]) -> None:
    r, w = os.pipe()
    path = os.path.join(os.fspath(tmp_path), "flags")
    with open(path, "wb") as fh:
        fh.write(bytes(4096))
    f = os.open(path, os.O_RDWR)
    try:
        for fd in (r, f):
            with pytest.raises(ProtocolError, match="sync page"):
                SharedFlags.open(fd, 4096)
    finally:
        for fd in (r, w, f):
            os.close(fd)


def test_import_refuses_a_size_that_does_not_fit_the_layout_before_mapping() -> None:
    """Checked against the layout first: no mapping, no driver call."""
    layout = FlagLayout(4, 2)
    fd = _memfd(layout.nbytes * 2, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        with pytest.raises(ProtocolError, match=f"is {layout.nbytes * 2} bytes, the WELCOME says"):
            SyncPage.import_fd(fd, 4, 2, 0)
    finally:
        os.close(fd)


# ------------------------------------------ order_all: which flags go to the GPU, and how
def _page_calling_recorders(flags: SharedFlags, wait: object, batch: object) -> SyncPage:
    """A SyncPage over ``flags`` whose driver entry points are the ctypes recorders.

    The page is not registered with CUDA (there is no GPU here): what is tested
    is the host's choice of the flags still to wait for and the calls made
    through the real ``_fastpath`` trampolines, not the driver's waits (those
    run in ``tests/test_channel_gpu.py``).
    """
    from cupy_ipcpool._fastpath import memop, wait_all

    page = object.__new__(SyncPage)
    page.flags = flags
    page._words = flags.words
    page._base = 0x7F00_0000_0000  # stands for the page's device address
    page._memop, page._wait_fn, page._geq = memop, wait.address, 1  # type: ignore[attr-defined]
    page._wait_all, page._batch_fn = wait_all, batch.address  # type: ignore[attr-defined]
    return page


def test_order_all_waits_only_for_unset_flags_in_one_batched_call() -> None:
    from tests.test_fastpath_cpu import _BatchRecorder, _Recorder

    flags = SharedFlags.create(4096)
    try:
        wait, batch = _Recorder(), _BatchRecorder()
        page = _page_calling_recorders(flags, wait, batch)
        base = page._base
        for off in (0, 8, 16, 24):
            flags.store(off, 5)
        flags.store(8, 7)  # reached already: no wait
        addrs = [base + off for off in (0, 8, 16, 24)]
        assert page.order_all(0xABC, addrs, 7) == 3
        assert wait.calls == []
        ((stream, _, ops),) = batch.calls
        assert stream == 0xABC
        assert [(op[1], op[2], op[3]) for op in ops] == [
            (base, 7, 1),
            (base + 16, 7, 1),
            (base + 24, 7, 1),
        ]
        # one flag left unset: the single wait, not a batch of one
        flags.store(0, 7)
        flags.store(16, 7)
        assert page.order_all(0xABC, addrs, 7) == 1
        assert wait.calls == [(0xABC, base + 24, 7, 1)] and len(batch.calls) == 1
        # all set (the value is compared modulo 2**32): no driver call at all
        flags.store(24, 7)
        assert page.order_all(0xABC, addrs, (1 << 32) + 7) == 0
        assert len(wait.calls) == 1 and len(batch.calls) == 1
    finally:
        flags.close()


def test_order_all_splits_more_than_255_waits() -> None:
    from tests.test_fastpath_cpu import _BatchRecorder, _Recorder

    flags = SharedFlags.create(4096)
    try:
        wait, batch = _Recorder(), _BatchRecorder()
        page = _page_calling_recorders(flags, wait, batch)
        addrs = [page._base + 4 * i for i in range(600)]
        assert page.order_all(1, addrs, 1) == 600
        assert [len(ops) for _, _, ops in batch.calls] == [255, 255, 90]
        assert [op[1] for _, _, ops in batch.calls for op in ops] == addrs  # in order
    finally:
        flags.close()


# ------------------------------- force_frame: what a survivor writes when the producer died
_M = 0xFFFFFFFF


@pytest.mark.parametrize("last", [0, 7, 0xFFFFFFFE, 0xFFFFFFFF, 0x7FFFFFFF])
def test_force_frame_stores_the_last_real_value_plus_forced(last: int) -> None:
    from cupy_ipcpool.channel._syncpage import FORCED, frame_state

    page = SharedFlags.create(4096)
    other = SharedFlags.open(page.fd, 4096)  # a second survivor's mapping of the same page
    try:
        page.store(12, last)  # the last generation the producer's stream wrote in this slot
        awaited = (last + 3) & _M  # three frames of the slot never written
        assert page.force_frame(12, awaited)
        assert other.load(12) == (last + FORCED) & _M
        # every wait queued on that flag ends (the GPU's cyclic GEQ), also the second one's
        for gen in range(last - 2, last + 4):
            assert other.reached(12, gen & _M)
        # and each frame of the slot is told apart, by either mapping
        word = other.load(12)
        assert [frame_state(word, (last + k) & _M) for k in range(-2, 4)] == [
            True,  # written before the death, long ago
            True,
            True,  # the last one written
            False,  # never written
            False,
            False,
        ]
        # the second survivor finds it forced (reached): it is left alone, also for a
        # generation of its own a little further on
        assert not other.force_frame(12, awaited)
        assert not other.force_frame(12, (awaited + 2) & _M)
        assert page.load(12) == word
    finally:
        other.close()
        page.close()


def test_force_frame_leaves_a_flag_that_reached_its_value_and_never_moves_back() -> None:
    page = SharedFlags.create(4096)
    try:
        page.store(0, 9)
        assert not page.force_frame(0, 9)  # set by the producer: nothing to force
        assert not page.force_frame(0, 5)
        assert page.load(0) == 9
        page.store(4, 3)  # the other words are not touched
        assert page.force_frame(0, 10)
        assert page.load(4) == 3
    finally:
        page.close()


def test_force_frame_in_another_process_is_seen_here() -> None:
    """A survivor process forces the flag; this process decodes what it wrote."""
    from cupy_ipcpool.channel._syncpage import FORCED, frame_state

    page = SharedFlags.create(4096)
    try:
        page.store(8, 0xFFFFFFFD)
        _in_another_process(
            page,
            """
            assert page.force_frame(8, 0xFFFFFFFF)  # awaited, wrapped past the last real one
            """,
        )
        word = page.load(8)
        assert word == (0xFFFFFFFD + FORCED) & _M
        assert frame_state(word, 0xFFFFFFFD) is True
        assert frame_state(word, 0xFFFFFFFE) is False and frame_state(word, 0xFFFFFFFF) is False
        assert not page.force_frame(8, 0xFFFFFFFF)
    finally:
        page.close()


def test_order_waits_on_a_forced_flag_so_the_frame_is_recorded() -> None:
    """SyncPage.order skips the GPU wait only for the producer's own write.

    A flag a survivor forced is waited on (the wait ends at once on the GPU):
    the subscriber then notes and records the frame like any it waited for, so
    a frame received between another survivor's forcing and this subscriber's
    noticing the death is still named among the incomplete ones.
    """
    from cupy_ipcpool.channel._syncpage import FORCED
    from tests.test_fastpath_cpu import _BatchRecorder, _Recorder

    flags = SharedFlags.create(4096)
    try:
        wait, batch = _Recorder(), _BatchRecorder()
        page = _page_calling_recorders(flags, wait, batch)
        base = page._base
        flags.store(0, 5)
        assert not page.order(0xABC, base, 5)  # the producer's own write: no wait
        assert not page.order(0xABC, base, 4)
        assert page.order(0xABC, base, 6)  # not set yet: a wait
        flags.store(0, (5 + FORCED) & _M)  # forced after the death; frames 5 and 6 both
        assert page.order(0xABC, base, 6)  # never written: a wait, recorded
        assert page.order(0xABC, base, 5)  # written, but forced since: a wait too
        assert wait.calls == [(0xABC, base, 6, 1)] * 2 + [(0xABC, base, 5, 1)]
    finally:
        flags.close()
