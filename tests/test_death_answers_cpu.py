"""After a producer's death every answer is exact: which received frames were written.

When the producer dies with frames received but not yet written (both hosts
run ahead of their GPUs), a survivor forces each slot's frame flag to the
last generation the producer really wrote there plus ``FORCED``; every
process that maps the page then tells, frame by frame, whether the frame was
written before the death (``frame_state``), also after the page is unmapped
(the frozen words), and the subscriber names the frames that were not
(``FrameWaits.answers``, carried by ``EndOfStream.incomplete``).

The last test runs it for real without a GPU: a producer process over memfd
slots and a real sync page whose "stream" (fill, then set the frame flag,
after waiting for every reader's read flag) lags its host, two subscriber
processes whose "streams" wait on the frame flags and then check the slot's
bytes, the producer SIGKILLed; each subscriber's answers are compared, frame by
frame, with what its checks saw.  The GPU version is
``tests/test_death_answers_gpu.py``.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import struct
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_ipcpool._errors import EndOfStream, EvictedError
from cupy_ipcpool.channel._handshake import Welcome
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._settle import (
    close_pidfd,
    exited,
    open_pidfd,
    reader_rows,
    settle_streams,
)
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from cupy_ipcpool.channel._syncpage import (
    _SET_WINDOW,
    FORCED,
    RECORD_CAP,
    FlagLayout,
    FrameWaits,
    SharedFlags,
    frame_state,
)
from cupy_ipcpool.channel._waiting import connect_waiting
from tests._memfd_backend import MemfdSlots, pattern
from tests._pipe_child import PipeChild

M = 0xFFFFFFFF


# -- the decode table -------------------------------------------------------------------


@pytest.mark.parametrize("gen", [0, 1, 1000, 0x7FFFFFFF, 0xFFFFFFF0, M])
@pytest.mark.parametrize(
    ("distance", "says"),
    [
        (0, True),  # the producer's stream set it for this frame
        (1, True),  # ... or for a later frame of the slot
        ((1 << 29) - 1, True),
        (1 << 29, False),  # forced, the last real write far before this frame
        (FORCED - 1, False),  # forced, the last real write the frame before this one
        (FORCED, True),  # forced, this frame was the last one written
        (FORCED + 5, True),  # forced, written five generations before the last one
        ((1 << 31) - 1, True),
        (1 << 31, None),  # not set yet
        (M, None),  # the generation before this one
    ],
)
def test_frame_state_decodes_each_window(gen: int, distance: int, says: bool | None) -> None:
    assert frame_state((gen + distance) & M, gen) is says


@given(
    last=st.integers(0, M),
    unwritten=st.integers(1, 1 << 16),
    other=st.integers(0, 1 << 16),
    before=st.integers(0, 1 << 28),
)
def test_a_forced_word_answers_every_frame_of_the_slot(
    last: int, unwritten: int, other: int, before: int
) -> None:
    """``last + FORCED``: written up to ``last``, not after; every nearby wait satisfied."""
    word = (last + FORCED) & M
    assert frame_state(word, (last - before) & M) is True
    assert frame_state(word, (last + unwritten) & M) is False
    # a wait for any generation near the awaited one (another subscriber's) ends
    assert ((word - (last + unwritten + other)) & M) < (1 << 31)


def test_the_h200_case_a_slot_with_written_and_unwritten_frames() -> None:
    """Five frames of one slot received, the producer wrote two: True, True, False x3.

    (The old rule stored the awaited generation plus FORCED: every earlier
    frame of the slot, the two written ones included, then read as forced.)
    """
    layout = FlagLayout(8, 1)
    page = SharedFlags.create(layout.nbytes)
    try:
        waits = FrameWaits(layout)
        off = layout.frame_offset(3)
        for gen in range(1, 6):
            waits.track(page, 100 + gen, 3, gen)
            if gen <= 2:
                page.store(off, gen)  # the producer's stream got to these two
        page.store(off, 2)
        assert waits.resolve(page) == [3]
        assert page.load(off) == 2 + FORCED
        assert [waits.state(page, 3, g) for g in range(1, 6)] == [True, True, False, False, False]
        assert waits.answers(page) == ((103, 104, 105), ())
    finally:
        page.close()


# -- forcing and a second survivor ------------------------------------------------------


def test_resolve_forces_from_the_last_real_value_and_a_second_survivor_agrees() -> None:
    layout = FlagLayout(4, 2)
    page = SharedFlags.create(layout.nbytes)
    other = SharedFlags.open(page.fd, layout.nbytes)  # the second subscriber's mapping
    try:
        mine, theirs = FrameWaits(layout), FrameWaits(layout)
        page.store(layout.frame_offset(0), 7)  # slot 0: all written (7 received)
        page.store(layout.frame_offset(1), 4)  # slot 1: 5 and 6 received, never written
        page.store(layout.frame_offset(2), M)  # slot 2: wraps; 0 and 1 never written
        for seq, (slot, gen) in enumerate([(0, 7), (1, 5), (1, 6), (2, 0), (2, 1), (3, 1)]):
            mine.track(page, seq, slot, gen)
        theirs.track(other, 0, 1, 6)  # the other one received the same slot-1 frame
        theirs.track(other, 1, 3, 2)  # and one of slot 3 this one has not seen yet
        assert mine.pending(page) == [1, 2, 3]
        assert mine.resolve(page) == [1, 2, 3] and mine.forced == 3
        assert [other.load(layout.frame_offset(s)) for s in range(4)] == [
            7,
            4 + FORCED,
            (M + FORCED) & M,
            FORCED,  # slot 3's flag was never written at all: 0 + FORCED
        ]
        assert mine.answers(page) == ((1, 2, 3, 4, 5), ())
        # the second survivor finds every flag it waits on forced already: its waits
        # end, it forces nothing, and it decodes the same words the same way
        assert theirs.pending(other) == []
        assert theirs.resolve(other) == [] and theirs.forced == 0
        assert theirs.answers(other) == ((0, 1), ())
        assert theirs.state(other, 1, 4) is True and mine.state(page, 0, 7) is True
        # read flags are no frame flags: untouched
        assert other.load(layout.read_offset(1, 1)) == 0
    finally:
        other.close()
        page.close()


def test_answers_stay_exact_after_the_page_is_unmapped() -> None:
    layout = FlagLayout(2, 1)
    page = SharedFlags.create(layout.nbytes)
    waits = FrameWaits(layout)
    page.store(layout.frame_offset(0), 10)
    for seq, gen in enumerate(range(9, 13)):
        waits.track(page, seq, 0, gen)
    waits.track(page, 4, 1, 1)  # slot 1: set before the end, so complete
    page.store(layout.frame_offset(1), 1)
    waits.resolve(page)
    live = [waits.state(page, 0, g) for g in range(9, 13)], waits.answers(page)
    waits.freeze(page)
    page.close()
    assert live == ([True, True, False, False], ((2, 3), ()))
    for flags in (page, None):  # closed, or no mapping at all: the frozen words answer
        assert [waits.state(flags, 0, g) for g in range(9, 13)] == live[0]
        assert waits.state(flags, 1, 1) is True
        assert waits.answers(flags) == live[1]


def test_before_the_end_nothing_is_called_incomplete() -> None:
    """While the producer lives, frames not set yet are pending, never incomplete."""
    layout = FlagLayout(2, 1)
    page = SharedFlags.create(layout.nbytes)
    try:
        waits = FrameWaits(layout)
        waits.track(page, 0, 0, 1)
        waits.track(page, 1, 1, 1)
        page.store(layout.frame_offset(1), 1)
        assert waits.answers(page) == ((), (0,))
        page.close()
        assert waits.answers(page) == ((), (0, 1))  # unmapped, never frozen: nothing known
    finally:
        page.close()


# -- the bounded record -------------------------------------------------------------------


def test_the_record_is_pruned_from_the_front_as_flags_are_set() -> None:
    layout = FlagLayout(4, 1)
    page = SharedFlags.create(layout.nbytes)
    try:
        waits = FrameWaits(layout)
        for seq in range(4):
            waits.track(page, seq, seq, 1)
        assert [e[0] for e in waits.record] == [0, 1, 2, 3]
        page.store(layout.frame_offset(0), 1)
        page.store(layout.frame_offset(2), 1)  # set, but behind a frame not set yet
        waits.prune(page)
        assert [e[0] for e in waits.record] == [1, 2, 3]
        page.store(layout.frame_offset(1), 1)
        waits.track(page, 4, 0, 2)  # track prunes first: 1 and 2 go
        assert [e[0] for e in waits.record] == [3, 4]
        assert waits.generations == [2, 1, 1, 1]
        # a forced flag is never taken for the producer's write: the frame stays
        page.store(layout.frame_offset(3), FORCED)  # 0 + FORCED: generation 1 not written
        waits.prune(page)
        assert [e[0] for e in waits.record] == [3, 4]
        # nor one forced after the frame was written: it stays, and answers True
        page.store(layout.frame_offset(3), 1 + FORCED)
        waits.prune(page)
        assert [e[0] for e in waits.record] == [3, 4]
        assert waits.answers(page) == ((), (4,))
        assert waits.untracked == 0
    finally:
        page.close()


def test_a_full_record_drops_its_oldest_and_counts_it() -> None:
    layout = FlagLayout(2, 1)
    page = SharedFlags.create(layout.nbytes)
    try:
        waits = FrameWaits(layout, record_cap=3)
        for seq in range(5):
            waits.track(page, seq, 0, seq + 1)  # never set
        assert [e[0] for e in waits.record] == [2, 3, 4] and waits.untracked == 2
        page.store(layout.frame_offset(0), 4)
        waits.track(page, 5, 1, 1)  # room again after the prune: nothing dropped
        assert [e[0] for e in waits.record] == [4, 5] and waits.untracked == 2
        waits.resolve(page)
        assert waits.answers(page) == ((4, 5), ())
        assert FrameWaits(layout).record_cap == RECORD_CAP == 65536
        with pytest.raises(ValueError, match="record_cap"):
            FrameWaits(layout, record_cap=0)
    finally:
        page.close()


def test_a_steady_stream_keeps_the_record_short() -> None:
    """Each frame set a few frames after it arrived: the record never grows past that lag."""
    layout = FlagLayout(8, 1)
    page = SharedFlags.create(layout.nbytes)
    try:
        waits = FrameWaits(layout)
        longest = 0
        for seq in range(10_000):
            slot, gen = seq % 8, seq // 8 + 1
            waits.track(page, seq, slot, gen)
            if seq >= 3:  # the producer's stream, three frames behind
                page.store(layout.frame_offset((seq - 3) % 8), (seq - 3) // 8 + 1)
            longest = max(longest, len(waits.record))
        assert longest <= 4 and waits.untracked == 0
    finally:
        page.close()


# -- EndOfStream carries the answers --------------------------------------------------------


def test_end_of_stream_carries_and_pickles_the_answers() -> None:
    plain = EndOfStream("gone")
    assert (plain.clean, plain.incomplete, plain.pending, plain.untracked) == (False, (), (), 0)
    exc = EndOfStream("died", False, (4, 5, 9), (11,), 3)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is EndOfStream and str(back) == "died"
    assert (back.clean, back.incomplete, back.pending, back.untracked) == (
        False,
        (4, 5, 9),
        (11,),
        3,
    )
    # set after construction, as the subscriber does: pickled too
    evicted = EvictedError("evicted")
    evicted.incomplete, evicted.untracked = (1,), 2
    back = pickle.loads(pickle.dumps(evicted))
    assert type(back) is EvictedError and back.incomplete == (1,) and back.untracked == 2
    assert isinstance(back, EndOfStream)


# -- for real: a producer process killed while its "stream" lags its host -----------------

SLOTS, ROWS, READERS, SLOT_SIZE = 8, 4, 2, 4096
# WELCOME payload of this test: slot size, slots, rows, this subscriber's row
HEAD = struct.Struct("<QIII")
GEN = struct.Struct("<I")


def _producer(conn: Connection, address: str, frames: int, lag: int, base: int) -> None:
    """Publish ``frames`` frames; the stream fills and sets flags ``lag`` frames behind.

    The stream (what the GPU does in order on the producer's stream): wait
    until every reader's read flag of the slot is at the slot's previous
    generation, fill the slot with the frame's pattern, set the frame flag.
    It runs a step only when the host publishes, up to ``lag`` frames behind;
    after the last publish it stops, and the process waits to be killed.
    """
    layout = FlagLayout(SLOTS, ROWS)
    page = SharedFlags.create(layout.nbytes)
    slots = MemfdSlots(SLOTS, SLOT_SIZE)
    welcome = Welcome(
        HEAD.pack(SLOT_SIZE, SLOTS, ROWS, 0),
        (*slots.fds, page.fd),
        rows=reader_rows(page, layout),  # each subscriber its own row, round-robin
        row_at=HEAD.size - 4,
    )
    core = PublisherCore(address, SLOTS, welcome=welcome)
    try:
        for slot in range(SLOTS):  # every flag holds the slot's last generation
            page.store(layout.frame_offset(slot), base)
            for row in range(ROWS):
                page.store(layout.read_offset(row, slot), base)
        deadline = time.monotonic() + 30
        while len(core.subscribers) < READERS:
            assert time.monotonic() < deadline, "the subscribers did not join"
            core.poll(0.01)
        gens = [base] * SLOTS
        stream: deque[tuple[int, int, int, int, int]] = deque()

        def run(upto: int) -> None:
            while stream and stream[0][0] <= upto:
                _i, slot, seq, gen, previous = stream[0]
                if not all(
                    page.reached(layout.read_offset(r, slot), previous) for r in range(READERS)
                ):
                    return  # a reader's GPU still reads the slot's previous frame
                slots.write(slot, seq)
                page.store(layout.frame_offset(slot), gen)
                stream.popleft()

        for i in range(frames):
            slot, _readers = core.acquire(10.0)
            seq = core.next_seq
            previous, gens[slot] = gens[slot], (gens[slot] + 1) & M
            stream.append((i, slot, seq, gens[slot], previous))
            core.publish(slot, GEN.pack(gens[slot]))
            run(i - lag)
        conn.send(("published", len(stream)))
        conn.recv()  # SIGKILLed here: what the stream still had queued dies with it
    finally:
        core.close()
        slots.close()
        page.close()


class _Stream:
    """A subscriber's 'stream': waits on frame flags, checks, read-flag writes, in order."""

    def __init__(self, owner: _Reader) -> None:
        self.owner = owner
        self.ops: deque[tuple[str, int, int]] = deque()

    def run(self) -> None:
        owner, ops = self.owner, self.ops
        while ops:
            kind, a, b = ops[0]
            if kind == "wait":  # cuStreamWaitValue32 GEQ: cyclic
                if not owner.flags.reached(a, b):
                    return
            elif kind == "check":  # the check kernel: the slot holds the frame's pattern
                owner.results[a] = owner.maps[b][:] == pattern(a, owner.size)
            else:  # the read-flag write of the release
                owner.flags.store(a, b)
            ops.popleft()

    def idle(self) -> bool:
        self.run()
        return not self.ops

    def synchronize(self) -> None:
        deadline = time.monotonic() + 10.0
        while not self.idle():
            assert time.monotonic() < deadline, f"the stream never ends: {list(self.ops)[:4]}"
            time.sleep(0.001)


class _Reader:
    """What the GPU Subscriber does per frame, with the same library code and no GPU."""

    def __init__(self, address: str) -> None:
        self.core = SubscriberCore(address, timeout=10.0)
        fds = self.core.take_fds()
        try:
            self.size, n, rows, self.row = HEAD.unpack(self.core.welcome_payload)
            self.maps = [mmap.mmap(fd, self.size, prot=mmap.PROT_READ) for fd in fds[:-1]]
            self.layout = FlagLayout(n, rows)
            self.flags = SharedFlags.open(fds[-1], self.layout.nbytes)
        finally:
            for fd in fds:
                os.close(fd)
        self.waits = FrameWaits(self.layout)
        self.stream = _Stream(self)
        self.results: dict[int, bool] = {}
        self.received: list[tuple[int, int, int]] = []
        self.pidfd = open_pidfd(self.core.producer_pid)
        self.core.watch(self.pidfd)

    def recv(self) -> None:
        frame = self.core.recv(30.0)
        (gen,) = GEN.unpack(frame.payload)
        seq, slot = frame.seq, frame.slot
        offset = self.layout.frame_offset(slot)
        # Subscriber._written: after the death, a queued frame the producer's stream never
        # wrote is dropped (and the rest with it); one it wrote is handed out
        written = frame_state(self.flags.load(offset), gen) is True
        if self.core.alarm and not written and exited(self.pidfd):
            raise EndOfStream("the publisher exited", False)
        # SyncPage.order: no wait only for the producer's own write
        if ((self.flags.load(offset) - gen) & M) >= _SET_WINDOW:
            self.stream.ops.append(("wait", offset, gen))
            self.waits.track(self.flags, seq, slot, gen)
        elif self.waits.record:
            self.waits.prune(self.flags)
        self.stream.ops.append(("check", seq, slot))
        self.stream.ops.append(("write", self.layout.read_offset(self.row, slot), gen))
        self.core.release(seq, slot)  # at once, as the GPU consumer after queuing its check
        self.received.append((seq, slot, gen))
        self.stream.run()

    def states(self, flags: SharedFlags | None) -> dict[int, bool | None]:
        return {seq: self.waits.state(flags, slot, gen) for seq, slot, gen in self.received}

    def close(self) -> None:
        self.core.close()
        self.flags.close()
        for m in self.maps:
            m.close()
        close_pidfd(self.pidfd)


def _reader(conn: Connection, address: str, frames: int) -> None:
    try:
        reader = connect_waiting(lambda: _Reader(address), address, 30.0)
        for _ in range(frames):
            reader.recv()
        conn.send(("holding", len(reader.waits.record)))
        assert conn.recv() == "killed"
        try:
            reader.recv()
            raise AssertionError("a frame after the last one")
        except EndOfStream as exc:
            assert not exc.clean
        assert select_readable(reader.pidfd, 5.0), "the producer's pidfd never fired"
        # what Subscriber._settle_if_dead and its teardown do
        assert settle_streams(reader.flags, reader.stream, reader.waits, reader.pidfd, 5.0)
        live = reader.states(reader.flags)
        answers = reader.waits.answers(reader.flags)
        words = [reader.flags.load(reader.layout.frame_offset(s)) for s in range(SLOTS)]
        reader.waits.freeze(reader.flags)
        reader.close()
        frozen = reader.states(None)
        conn.send(
            (
                "done",
                reader.received,
                reader.results,
                live,
                frozen,
                answers,
                reader.waits.untracked,
                reader.waits.forced,
                words,
            )
        )
    except BaseException as exc:
        import traceback

        conn.send(("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def select_readable(fd: int, timeout: float) -> bool:
    import select

    return bool(select.select([fd], [], [], timeout)[0])


class _Child(PipeChild):
    """A child that sends ``(what, *values)``, or ``("error", type name, message)``."""

    def expect(self, what: str, timeout: float = 60.0) -> Any:
        msg = self.recv(timeout, f"{what}: nothing within {timeout} s")
        if msg[0] == "error":
            raise AssertionError(f"child failed: {msg[1]}: {msg[2]}")
        assert msg[0] == what, msg
        return msg[1:]


@pytest.fixture
def children() -> Iterator[list[_Child]]:
    made: list[_Child] = []
    yield made
    for child in made:
        # Process.kill, not os.kill of the pid: a forkserver child is reaped by the
        # forkserver, so its pid can be gone while is_alive() still says True
        child.proc.kill()
        child.finish()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("lag", "base"),
    [(3, 1), (17, M - 10)],
    ids=["lag-3", "lag-17-more-than-the-ring-wrapping"],
)
def test_two_survivors_answer_every_frame_as_their_checks_saw_it(
    tmp_path: Any, children: list[_Child], lag: int, base: int
) -> None:
    frames = 400
    address = str(tmp_path / "chan.sock")
    producer = _Child(_producer, address, frames, lag, base)
    children.append(producer)
    readers = [_Child(_reader, address, frames) for _ in range(READERS)]
    children.extend(readers)
    (unwritten,) = producer.expect("published")
    assert unwritten >= lag  # the stream was that far behind when it stopped
    for r in readers:
        r.expect("holding")
    assert producer.proc.pid is not None
    os.kill(producer.proc.pid, signal.SIGKILL)
    producer.proc.join(10)
    # one survivor at a time: the second finds every flag it waits on forced already
    reports = []
    for r in readers:
        r.conn.send("killed")
        reports.append(r.expect("done"))
    first, second = reports
    assert first[6] > 0 and second[6] == 0, "the second survivor forced flags again"
    for received, results, live, frozen, (incomplete, pending), untracked, _f, words in reports:
        seqs = [seq for seq, _slot, _gen in received]
        assert seqs == list(range(frames))
        assert sorted(results) == seqs, "a check never ran: a wait was left"
        bad = [seq for seq in seqs if not results[seq]]
        good = [seq for seq in seqs if results[seq]]
        assert len(bad) >= lag and good, (len(bad), len(good))
        # frame by frame: no frame called complete that was bad, none incomplete that was good
        assert {seq: live[seq] for seq in seqs} == {seq: results[seq] for seq in seqs}
        assert frozen == live  # after the page is unmapped, the same answers
        assert list(incomplete) == bad and pending == () and untracked == 0
        # frames written before the death in slots that were forced (the case the old
        # rule called incomplete): complete, decoded from the forced word
        forced = {slot for seq, slot, _gen in received if not results[seq]}
        assert all(frame_state(words[s], words[s]) is True for s in forced)
        assert any(slot in forced and results[seq] for seq, slot, _gen in received)
        assert all(
            ((words[s] - gen) & M) >= FORCED
            for s in forced
            for _q, sl, gen in received
            if sl == s and results[_q]
        )
    # the same frames, the same data: the two survivors give the same answers
    assert first[1] == second[1] and first[3] == second[3] and first[4] == second[4]
