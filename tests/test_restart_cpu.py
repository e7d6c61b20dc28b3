"""Publisher restarts and peer deaths on CPU: memfd slots and the sync page's real mapping.

A subscriber process outlives many publisher processes.  Each publisher maps a
real sync page (a sealed memfd, :class:`SharedFlags`) and memfd slots, sends
both in its WELCOME, publishes frames and sets the frame flags of some of
them from the host -- what its stream's ``cuStreamWriteValue32`` does once
the kernels before it have run -- and is SIGKILLed while the subscriber holds
frames whose flags it never set.  The subscriber does what the GPU subscriber
does with the same library code (:class:`FrameWaits`, :func:`settle_streams`):
it notes the flags its stream would wait on, forces them once the producer's
pidfd says it is dead, tells forced frames from complete ones, and closes
everything; its fds and mappings stay flat over the cycles.

A *stream* here is a stand-in with no GPU: work "queued" on it is a wait until
a flag of the real shared page reaches a value, done once the page says so.
The GPU side (a real ``cuStreamWaitValue32`` released by a forced flag) is in
``tests/test_restart_gpu.py``.
"""

from __future__ import annotations

import math
import os
import signal
import struct
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from cupy_ipcpool._errors import (
    ChannelTimeoutError,
    EndOfStream,
    PeerRefusedError,
    TransportError,
    UsageError,
)
from cupy_ipcpool.channel._follow import Follower
from cupy_ipcpool.channel._handshake import Welcome
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._settle import (
    close_pidfd,
    exited,
    open_pidfd,
    reader_rows,
    settle_page,
    settle_streams,
)
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from cupy_ipcpool.channel._syncpage import (
    FORCED,
    FlagLayout,
    FrameWaits,
    SharedFlags,
    frame_state,
)
from cupy_ipcpool.channel._waiting import check_wait, connect_waiting
from tests._fds import fd_count
from tests._memfd_backend import MemfdSlots, pattern
from tests._pipe_child import PipeChild, run_body, started

# WELCOME payload of these tests: slot size, slots, rows, this subscriber's row
HEAD = struct.Struct("<QIII")
GEN = struct.Struct("<I")
SLOTS, ROWS, SLOT_SIZE = 8, 4, 4096


# -- a stream stand-in: queued waits on the real shared page -------------------------


class PageStream:
    """Work queued on a 'stream': waits until flags of a shared page reach values."""

    def __init__(self, flags: SharedFlags) -> None:
        self.flags = flags
        self.waits: list[tuple[int, int]] = []

    def wait(self, offset: int, value: int) -> None:
        self.waits.append((offset, value))

    def idle(self) -> bool:
        if self.flags.closed:
            return not self.waits
        self.waits = [(o, v) for o, v in self.waits if not self.flags.reached(o, v)]
        return not self.waits

    def synchronize(self) -> None:
        deadline = time.monotonic() + 10.0
        while not self.idle():
            assert time.monotonic() < deadline, f"the stream never ends: {self.waits}"
            time.sleep(0.001)


# -- the producer: memfd slots, a real sync page, flags set from the host -------------


def _producer(conn: Connection, address: str, frames: int, set_first: int, base: int) -> None:
    """Publish ``frames`` frames; set the frame flags of the first ``set_first`` only; wait."""
    layout = FlagLayout(SLOTS, ROWS)
    page = SharedFlags.create(layout.nbytes)
    slots = MemfdSlots(SLOTS, SLOT_SIZE)

    welcome = Welcome(HEAD.pack(SLOT_SIZE, SLOTS, ROWS, 0), (*slots.fds, page.fd))
    core = PublisherCore(address, SLOTS, welcome=welcome)
    try:
        deadline = time.monotonic() + 30
        while not core.subscribers:
            assert time.monotonic() < deadline, "no subscriber"
            core.poll(0.01)
        gens = [base] * SLOTS
        for slot in range(SLOTS):  # each slot's flag holds the generation published last
            page.store(layout.frame_offset(slot), base)
        for i in range(frames):
            slot, _readers = core.acquire(10.0)
            seq = core.next_seq
            slots.write(slot, seq)
            gens[slot] = (gens[slot] + 1) & 0xFFFFFFFF
            if i < set_first:  # the producer's stream got to the flag write
                page.store(layout.frame_offset(slot), gens[slot])
            core.publish(slot, GEN.pack(gens[slot]))
        conn.send(("published", frames))
        conn.recv()  # SIGKILLed (or told to close) meanwhile
        core.close()
        conn.send(("closed", 0))
    finally:
        slots.close()
        page.close()


class Producer(PipeChild):
    """A producer process and the pipe to it."""

    def __init__(self, address: str, frames: int, set_first: int, base: int = 0) -> None:
        super().__init__(_producer, address, frames, set_first, base)

    def expect(self, what: str, timeout: float = 30.0) -> None:
        got = self.recv(timeout, f"producer sent nothing within {timeout} s")
        assert got[0] == what, got

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()

    def close_cleanly(self) -> None:
        self.conn.send("close")
        self.expect("closed")
        self.proc.join(10)
        self.conn.close()


# -- the subscriber: what the GPU Subscriber does, without the GPU -------------------


class PageFrame:
    """A received frame: seq, slot, generation, and a view on the slot to verify."""

    def __init__(self, owner: PageConsumer, seq: int, slot: int, generation: int) -> None:
        self.owner = owner
        self.seq = seq
        self.slot = slot
        self.generation = generation

    @property
    def complete(self) -> bool | None:
        return self.owner.waits.state(self.owner.flags, self.slot, self.generation)

    def intact(self) -> bool:
        return self.owner.maps[self.slot][:] == pattern(self.seq, SLOT_SIZE)

    def release(self) -> None:
        self.owner.core.release(self.seq, self.slot)


class PageConsumer:
    """A SubscriberCore with the slots and the sync page mapped and a pidfd on the producer."""

    def __init__(self, address: str) -> None:
        self.core = SubscriberCore(address, timeout=5.0)
        fds = self.core.take_fds()
        self.maps: list[Any] = []
        try:
            size, n, rows, row = HEAD.unpack(self.core.welcome_payload)
            assert (n, rows, row) == (SLOTS, ROWS, 0) and len(fds) == n + 1
            import mmap

            for fd in fds[:-1]:
                self.maps.append(mmap.mmap(fd, size, prot=mmap.PROT_READ))
            self.layout = FlagLayout(n, rows)
            self.flags = SharedFlags.open(fds[-1], self.layout.nbytes)
        except BaseException:
            self.core.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self.waits = FrameWaits(self.layout)
        self.stream = PageStream(self.flags)
        self.pidfd = open_pidfd(self.core.producer_pid)
        if self.pidfd >= 0:
            self.core.watch(self.pidfd)  # as the GPU subscriber: its death is a hang-up
        self.closed = False

    def recv(self, timeout: float | None = 10.0) -> PageFrame:
        frame = self.core.recv(timeout)
        (gen,) = GEN.unpack(frame.payload)
        offset = self.layout.frame_offset(frame.slot)
        # as the GPU subscriber (Subscriber._written): once the producer is dead, a queued
        # frame its stream never wrote is not handed out, nor any after it; one it wrote
        # is (a clean close's frames, read after the producer exited)
        written = frame_state(self.flags.load(offset), gen) is True
        if self.core.alarm and not written and exited(self.pidfd):
            self.settle_if_dead()
            raise EndOfStream("the publisher exited", False)
        if not self.flags.reached(offset, gen):  # the GPU subscriber enqueues a wait here
            self.stream.wait(offset, gen)
            self.waits.note(frame.slot, gen)
        got = PageFrame(self, frame.seq, frame.slot, gen)
        assert got.intact(), f"frame {frame.seq} arrived overwritten"
        return got

    def settle_if_dead(self) -> None:
        if exited(self.pidfd):
            self.waits.resolve(self.flags)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        assert settle_streams(self.flags, self.stream, self.waits, self.pidfd, 5.0)
        self.waits.freeze(self.flags)
        self.core.close()
        self.flags.close()
        for m in self.maps:
            m.close()
        close_pidfd(self.pidfd)


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:ipcpool-slot" in line or "memfd:cupy_ipcpool-sync" in line for line in f)


def _run(conn: Connection, body: Callable[[], Any]) -> None:
    run_body(conn, body, with_traceback=True)


class Child(PipeChild):
    """A spawned test process (its target answers through :func:`_run`) and the pipe to it."""

    def expect(self, timeout: float = 60.0) -> Any:
        msg = self.recv(timeout, f"child sent nothing within {timeout} s")
        if msg[0] == "err":
            raise AssertionError(f"child failed: {msg[1]}: {msg[2]}")
        return msg[1]


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    with started(Child) as start:
        yield start


@pytest.fixture
def address(tmp_path: Any) -> str:
    return str(tmp_path / "chan.sock")


# -- one subscriber process, many publisher deaths -------------------------------------

HOLD, SET_FIRST = 4, 2


def _outlive(conn: Connection, address: str, cycles: int) -> None:
    """For each publisher: wait for it, hold 4 frames (2 of them with flags set), see it
    die, check what each frame says, close; report fds and mappings after each."""

    def body() -> list[tuple[int, int, int]]:
        counts = []
        for _ in range(cycles):
            sub = connect_waiting(lambda: PageConsumer(address), address, 30.0)
            held = [sub.recv() for _ in range(HOLD)]
            assert [f.complete for f in held] == [True] * SET_FIRST + [None] * (HOLD - SET_FIRST)
            conn.send(("msg", "holding"))
            assert conn.recv() == "killed"  # two more frames were queued when it died
            with pytest.raises(EndOfStream) as info:
                while True:
                    held.append(sub.recv(timeout=30.0))
            assert not info.value.clean
            assert len(held) == HOLD, "a frame queued after the death was handed out"
            # the flags it never set are forced, and say so; the data is as it left it
            sub.settle_if_dead()
            assert [f.complete for f in held] == [True] * SET_FIRST + [False] * (HOLD - SET_FIRST)
            for f in held[SET_FIRST:]:
                word = sub.flags.load(sub.layout.frame_offset(f.slot))
                # the last value the producer wrote (the frame before) + FORCED
                assert word == (f.generation - 1 + FORCED) & 0xFFFFFFFF
            assert sub.stream.idle(), "a wait on a flag of the dead producer is left"
            assert all(f.intact() for f in held)
            for f in held:
                f.release()  # only forgets it locally: the publisher is gone
            forced = sub.waits.forced
            sub.close()
            assert [f.complete for f in held] == [True] * SET_FIRST + [False] * (HOLD - SET_FIRST)
            counts.append((fd_count(), _mappings(), forced))
            conn.send(("msg", counts[-1]))
        return counts

    _run(conn, body)


@pytest.mark.timeout(240)
def test_one_subscriber_process_outlives_30_publisher_deaths(
    address: str, spawn: Callable[..., Child]
) -> None:
    cycles = 30
    sub = spawn(_outlive, address, cycles)
    counts = []
    for n in range(cycles):
        # generations that wrap past 2**32 in some cycles: so do the forced values
        pub = Producer(address, HOLD + 2, SET_FIRST, base=0xFFFFFFFF if n % 3 == 0 else n)
        pub.expect("published")
        assert sub.expect() == "holding"
        pub.kill()
        sub.conn.send("killed")
        counts.append(sub.expect())
    assert sub.expect() == counts
    fds = {c[0] for c in counts}
    assert len(fds) == 1, f"fds grew over the cycles: {[c[0] for c in counts]}"
    assert {c[1] for c in counts} == {0}, "slot or sync page mappings left behind"
    assert {c[2] for c in counts} == {HOLD - SET_FIRST}


# -- follow(): the same subscriber across restarts ---------------------------------------

PER_SESSION = 5


def _follow(conn: Connection, address: str, restart_on_close: bool, sessions: int) -> None:
    def body() -> list[Any]:
        follower: Follower[PageConsumer] = Follower(
            lambda: PageConsumer(address), address, wait=30.0, restart_on_close=restart_on_close
        )
        seen: list[tuple[int, int]] = []
        old: list[PageFrame] = []
        report = []
        with follower:
            for frame in follower:
                seen.append((follower.reconnects, frame.seq))
                assert frame.intact()
                old.append(frame)
                if len(seen) % PER_SESSION == 0:
                    for f in old:  # frames of a publisher that died since: no error
                        f.release()
                    old.clear()
                    report.append((follower.reconnects, fd_count(), _mappings()))
                    conn.send(("msg", "session done"))
                    if len(report) == sessions:
                        break
            assert follower.subscriber is not None or not restart_on_close
        report.append((follower.reconnects, fd_count(), _mappings()))
        return [seen, report, follower.closed]

    _run(conn, body)


@pytest.mark.timeout(240)
def test_follow_receives_every_frame_across_10_restarts(
    address: str, spawn: Callable[..., Child]
) -> None:
    # 10 killed publishers: follow's loop is the same each time (30 deaths with wrapping
    # generations: test_one_subscriber_process_outlives_30_publisher_deaths)
    sessions = 10
    sub = spawn(_follow, address, False, sessions + 1)
    for n in range(sessions + 1):
        pub = Producer(address, PER_SESSION, PER_SESSION)
        pub.expect("published")
        assert sub.expect() == "session done"
        if n < sessions:
            pub.kill()
        else:
            pub.close_cleanly()
    seen, report, closed = sub.expect()
    # sequence numbers start again with each publisher; reconnects count the restarts
    assert seen == [(r, s) for r in range(sessions + 1) for s in range(PER_SESSION)]
    assert [r[0] for r in report[:-1]] == list(range(sessions + 1))
    assert len({r[1] for r in report[1:-1]}) == 1, f"fds grew: {[r[1] for r in report]}"
    assert {r[2] for r in report[1:-1]} <= {SLOTS + 1}  # the current publisher's only
    assert report[-1][2] == 0 and closed


def _follow_until_clean_end(conn: Connection, address: str) -> None:
    def body() -> list[tuple[int, int]]:
        seen = []
        with Follower(lambda: PageConsumer(address), address, wait=30.0) as follower:
            for frame in follower:  # ends at the clean close
                seen.append((follower.reconnects, frame.seq))
            assert isinstance(follower.last_end, EndOfStream) and follower.last_end.clean
            with pytest.raises(EndOfStream):
                follower.recv(timeout=1.0)
        return seen

    _run(conn, body)


def _follow_through_clean_close(conn: Connection, address: str) -> None:
    def body() -> list[tuple[int, int]]:
        seen = []
        follower = Follower(
            lambda: PageConsumer(address), address, wait=30.0, restart_on_close=True
        )
        with follower:
            while len(seen) < 2 * PER_SESSION:
                frame = follower.recv(timeout=30.0)
                seen.append((follower.reconnects, frame.seq))
                if len(seen) == PER_SESSION:
                    conn.send(("msg", "first done"))
        return seen

    _run(conn, body)


@pytest.mark.timeout(120)
def test_a_clean_close_ends_follow_unless_restart_on_close(
    address: str, spawn: Callable[..., Child]
) -> None:
    sub = spawn(_follow_until_clean_end, address)
    pub = Producer(address, PER_SESSION, PER_SESSION)
    pub.expect("published")
    pub.close_cleanly()
    assert sub.expect() == [(0, s) for s in range(PER_SESSION)]

    sub = spawn(_follow_through_clean_close, address)
    pub = Producer(address, PER_SESSION, PER_SESSION)
    pub.expect("published")
    assert sub.expect() == "first done"
    pub.close_cleanly()
    pub = Producer(address, PER_SESSION, PER_SESSION)
    pub.expect("published")
    assert sub.expect() == [(r, s) for r in (0, 1) for s in range(PER_SESSION)]
    pub.close_cleanly()


def _follow_after_the_publisher_exited(conn: Connection, address: str) -> None:
    def body() -> list[int]:
        with Follower(lambda: PageConsumer(address), address, wait=5.0) as follower:
            frames = iter(follower)
            seen = [next(frames).seq]
            conn.send(("msg", "first"))
            assert conn.recv() == "go"  # the publisher closed cleanly, and its process exited
            seen += [frame.seq for frame in frames]
            assert isinstance(follower.last_end, EndOfStream) and follower.last_end.clean
        return seen

    _run(conn, body)


def test_frames_before_a_clean_close_are_handed_out_after_the_publisher_exits(
    address: str, spawn: Callable[..., Child]
) -> None:
    """A subscriber that reads its queue only once the publisher's process has exited
    (alarmed by its pidfd) still gets every frame written before the BYE, then a clean
    end: only a frame the dead producer's stream never wrote is dropped."""
    sub = spawn(_follow_after_the_publisher_exited, address)
    pub = Producer(address, PER_SESSION, PER_SESSION)
    pub.expect("published")
    assert sub.expect() == "first"
    pub.close_cleanly()  # joins the producer's process
    sub.conn.send("go")
    assert sub.expect() == list(range(PER_SESSION))


def test_follow_stays_usable_after_wait_runs_out(address: str) -> None:
    follower = Follower(lambda: PageConsumer(address), address, wait=0.2)
    start = time.monotonic()
    with pytest.raises(ChannelTimeoutError, match="no publisher answered"):
        follower.recv()
    assert 0.2 <= time.monotonic() - start < 2.0
    assert follower.subscriber is None and not follower.closed
    with pytest.raises(ChannelTimeoutError):
        follower.recv(timeout=0.05)  # the frame timeout bounds the wait too
    follower.close()
    follower.close()
    with pytest.raises(Exception, match="closed"):
        follower.recv()


# -- subscribe(wait=): a publisher that is not up yet ---------------------------------


def _subscribe_early(conn: Connection, address: str, wait: float) -> None:
    def body() -> list[int]:
        t0 = time.monotonic()
        conn.send(("msg", "waiting"))  # the clock runs before the publisher is started
        sub = connect_waiting(lambda: PageConsumer(address), address, wait)
        conn.send(("msg", time.monotonic() - t0))
        seqs = [sub.recv(timeout=30.0).seq for _ in range(3)]
        sub.close()
        return seqs

    _run(conn, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stale", [False, True], ids=["no-socket", "dead-publishers-socket"])
def test_wait_subscribes_to_a_publisher_that_comes_up_later(
    address: str, spawn: Callable[..., Child], stale: bool
) -> None:
    if stale:  # a dead publisher's socket file: connect is refused until a new one binds
        import socket

        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(address)
        s.close()
        with pytest.raises(TransportError) as info:
            PageConsumer(address)
        assert info.value.errno == 111  # ECONNREFUSED
    sub = spawn(_subscribe_early, address, 60.0)
    assert sub.expect() == "waiting"
    time.sleep(1.0)
    pub = Producer(address, 3, 3)
    waited = sub.expect()
    assert waited >= 0.9
    pub.expect("published")
    assert sub.expect() == [0, 1, 2]
    pub.kill()


def test_wait_gives_up_with_a_timeout_and_refusals_are_not_retried(address: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChannelTimeoutError, match=r"within 0\.3 s") as info:
        connect_waiting(lambda: PageConsumer(address), address, 0.3)
    assert isinstance(info.value, TimeoutError)
    assert 0.3 <= time.monotonic() - start < 2.0
    with pytest.raises(TransportError) as direct:  # wait=0: one attempt, the plain error
        connect_waiting(lambda: PageConsumer(address), address, 0.0)
    assert direct.value.errno == 2  # ENOENT

    calls = []

    def refused() -> None:
        calls.append(1)
        raise PeerRefusedError("the publisher refused: uid")

    with pytest.raises(PeerRefusedError):
        connect_waiting(refused, address, 5.0)
    assert calls == [1]


@pytest.mark.parametrize("bad", [-1.0, math.nan, "soon", None])
def test_wait_must_be_seconds(bad: Any) -> None:
    with pytest.raises(UsageError, match="seconds"):
        check_wait(bad)
    assert check_wait(math.inf) == math.inf


# -- forced flags: what each process that maps the page can tell -----------------------


def test_frame_state_tells_set_forced_and_pending_apart_cyclically() -> None:
    for gen in (1, 1000, 0xFFFFFFFF, 0xFFFFFFF0):
        assert frame_state(gen, gen) is True
        assert frame_state((gen + 1) & 0xFFFFFFFF, gen) is True  # republished since
        assert frame_state((gen - 1) & 0xFFFFFFFF, gen) is None
        # forced after the producer had written this frame (or a later one): complete
        assert frame_state((gen + FORCED) & 0xFFFFFFFF, gen) is True
        assert frame_state((gen + 3 + FORCED) & 0xFFFFFFFF, gen) is True
        # forced when the producer's last write was an earlier frame: never written
        assert frame_state((gen - 1 + FORCED) & 0xFFFFFFFF, gen) is False
        assert frame_state((gen - 3 + FORCED) & 0xFFFFFFFF, gen) is False


def test_resolve_forces_only_what_is_awaited_and_never_moves_a_flag_back() -> None:
    layout = FlagLayout(4, 1)
    page = SharedFlags.create(layout.nbytes)
    other = SharedFlags.open(page.fd, layout.nbytes)  # a second subscriber's mapping
    try:
        waits = FrameWaits(layout)
        page.store(layout.frame_offset(0), 7)  # slot 0: set by the producer
        waits.note(0, 7)
        waits.note(1, 5)  # slot 1: awaited, never set
        page.store(layout.frame_offset(2), 9)  # slot 2: set, never awaited
        page.store(layout.read_offset(0, 1), 42)  # read flags are not frame flags
        assert waits.pending(page) == [1]
        assert waits.resolve(page) == [1]
        assert waits.resolve(page) == []  # once
        assert waits.forced == 1
        assert [other.load(layout.frame_offset(s)) for s in range(4)] == [7, FORCED, 9, 0]
        assert other.load(layout.read_offset(0, 1)) == 42
        # the other mapping tells them apart, as the other subscriber's Frame.complete does
        theirs = FrameWaits(layout)
        assert theirs.state(other, 0, 7) is True
        assert theirs.state(other, 1, 5) is False
        assert theirs.state(other, 3, 1) is None
        waits.freeze(page)
        page.close()
        assert waits.state(None, 1, 5) is False and waits.state(page, 0, 7) is True
    finally:
        other.close()
        page.close()


def _write_flags_then_wait(conn: Connection, fd_path: str, offsets: list[int]) -> None:
    def body() -> None:
        fd = os.open(fd_path, os.O_RDWR)
        try:
            flags = SharedFlags.open(fd, FlagLayout(SLOTS, ROWS).nbytes)
        finally:
            os.close(fd)
        for off in offsets:
            flags.store(off, 3)  # its stream's read-flag writes that landed
        conn.send(("msg", "written"))
        conn.recv()  # killed here; its other writes die with it

    _run(conn, body)


@pytest.mark.timeout(60)
def test_a_dead_readers_flags_are_forced_a_live_ones_never(spawn: Callable[..., Child]) -> None:
    """The publisher's departed reader (``reader_rows``): its row is kept while it lives and
    a stream waits on it; once it died, the flags it never wrote are forced at close."""
    layout = FlagLayout(SLOTS, ROWS)
    page = SharedFlags.create(layout.nbytes)
    rows = reader_rows(page, layout)
    try:
        for sub_id in (1, 2):  # rows 0 and 1, taken and let go without reading
            assert rows.assign(sub_id, os.getpid()) == sub_id - 1
            rows.leave(sub_id, [3] * SLOTS, False)
        row = 2
        landed = [layout.read_offset(row, s) for s in range(0, SLOTS, 2)]
        child = spawn(_write_flags_then_wait, f"/proc/{os.getpid()}/fd/{page.fd}", landed)
        assert child.expect() == "written"
        assert child.proc.pid is not None
        assert rows.assign(3, child.proc.pid) == row  # round-robin: the next row
        rows.adopt(3)
        stream = PageStream(page)  # the publisher's stream waits on the odd slots' flags
        for s in range(1, SLOTS, 2):
            stream.wait(layout.read_offset(row, s), 3)
        rows.close([3] * SLOTS)  # the publisher closes: its row is departed
        assert rows.departed == 1 and rows.live == 0
        # alive: nothing is forced, and the page is not declared free
        assert not settle_page(stream, rows, 0.2)
        assert not stream.idle() and rows.forced == 0
        assert all(page.load(layout.read_offset(row, s)) == 0 for s in range(1, SLOTS, 2))
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.join(10)
        assert settle_page(stream, rows, 5.0)
        assert stream.idle() and rows.all_settled()
        assert rows.forced == SLOTS // 2  # only the flags it never wrote
        assert page.load(layout.read_offset(row + 1, 1)) == 0  # other rows untouched
        rows.release_page()
        rows.release_page()
    finally:
        rows.release_page()
        page.close()


def test_a_live_producers_flags_are_never_forced(spawn: Callable[..., Child]) -> None:
    """settle_streams waits for a live producer and gives up without forcing."""
    layout = FlagLayout(SLOTS, ROWS)
    page = SharedFlags.create(layout.nbytes)
    pidfd = open_pidfd(os.getpid())  # the 'producer' is this live process
    try:
        waits = FrameWaits(layout)
        stream = PageStream(page)
        stream.wait(layout.frame_offset(3), 11)
        waits.note(3, 11)
        start = time.monotonic()
        assert not settle_streams(page, stream, waits, pidfd, 0.2)
        assert time.monotonic() - start >= 0.2
        assert page.load(layout.frame_offset(3)) == 0 and waits.forced == 0
        page.store(layout.frame_offset(3), 11)  # the producer's stream gets there
        assert settle_streams(page, stream, waits, pidfd, 5.0)
        assert waits.forced == 0
        # without a pidfd nobody can tell: nothing is forced either
        stream.wait(layout.frame_offset(4), 1)
        waits.note(4, 1)
        assert not settle_streams(page, stream, waits, -1, 0.1)
        assert waits.forced == 0
    finally:
        close_pidfd(pidfd)
        page.close()


# -- the public entry points' checks (no publisher needed) -----------------------------


def test_wait_and_follow_are_for_local_publishers_and_follow_checks_its_options() -> None:
    import cupy_ipcpool as cip

    with pytest.raises(UsageError, match="local publishers"):
        cip.subscribe("ucx://127.0.0.1:1", wait=1.0)
    with pytest.raises(UsageError, match="ucx"):
        cip.follow("ucx://127.0.0.1:1")
    with pytest.raises(UsageError, match="unexpected keyword"):
        cip.follow("/tmp/x.sock", credits=3)  # a typo is reported now, not at the first recv
    with pytest.raises(UsageError, match="mode"):
        cip.follow("/tmp/x.sock", mode="newest")
    with pytest.raises(UsageError, match="seconds"):
        cip.follow("/tmp/x.sock", wait=-1)
    follower = cip.follow("/tmp/x.sock", mode="latest", credit=2, wait=5.0)
    assert follower.subscriber is None and follower.reconnects == 0 and not follower.closed
    assert "waiting" in repr(follower)
    follower.close()
