"""The per-frame path's shortcuts do what the general path does, and nothing else.

Every frame takes a few shortcuts past the general code: options that change
how an end waits, cheap questions asked instead of general ones, and compiled
calls that do a Python path's steady state.  Each is tested here against the
path it stands for, for real (processes, sockets, memfd slots; on CPU):

* ``spin_us``: a short busy-poll before sleeping, on the subscriber's ``recv``
  and the publisher's ``poll`` (off by default: an idle end uses no CPU);
  frames still arrive in order, a timeout still holds;
* ``SubscriberCore.watch``: one ``poll(0)`` per frame covers the socket's
  hang-up and the watched fds (the producer's pidfd);
* ``LeaseBook.lease_count`` / ``any_leased``: the cheap questions the pool asks
  for every acquire, against ``leases``;
* the compiled per-frame bookkeeping (``cupy_ipcpool._hotpath``): each call
  does the steady state of a Python path and answers None, having changed
  nothing, in every other case.  What the call does in the steady state is
  what the Python path does (the slot pick against ``SlotTable._pick``, the
  kept-array rule against ``KeptArray.in_use``), and every case it leaves to
  Python leaves the state as it was.  The driver's wait is a ctypes recorder
  (``tests/_memop_recorder``); CuPy's objects are plain stand-ins
  (``tests/test_kept_array_cpu``).  The GPU suite runs the same calls under
  the real channel.

How a missing or mismatched build of the compiled parts is reported is in
``tests/test_errors_cpu.py``.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import resource
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer, MemfdProducer
from _memop_recorder import MemopRecorder
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kept_array_cpu import _CP, _kept

from cupy_ipcpool._compiled import hotpath
from cupy_ipcpool._errors import ChannelTimeoutError, EndOfStream, UsageError
from cupy_ipcpool._handles import ArrayHandle
from cupy_ipcpool._peer import _KeptView
from cupy_ipcpool._slots import SlotTable
from cupy_ipcpool.channel._leases import LeaseBook
from cupy_ipcpool.channel._payload import FRAME_HEAD
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._sockets import MAX_SPIN_US
from cupy_ipcpool.channel._subscriber_core import SubscriberCore

CTX = mp.get_context("spawn")
hp = hotpath()
GEQ = 7  # any flags value: passed through to the driver call
BASE = 0x7000_0000  # the sync page's device address in these tests
STREAM = 0x1234


@pytest.fixture
def address(tmp_path: os.PathLike[str]) -> str:
    return os.path.join(os.fspath(tmp_path), "hot.sock")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- spin_us: validation ----------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, MAX_SPIN_US + 1, True, "50", None])
def test_spin_us_is_validated(address: str, bad: object) -> None:
    with MemfdProducer(address, 2), pytest.raises(UsageError, match="spin_us"):
        SubscriberCore(address, spin_us=bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="spin_us"):
        PublisherCore(address, 2, welcome=lambda info: (b"", []), spin_us=bad)  # type: ignore[arg-type]


# -- spin_us: frames still arrive, in order, unharmed ------------------------------


def _echo(conn: Connection, address: str, frames: int, spin_us: float) -> None:
    try:
        with MemfdConsumer(address, spin_us=spin_us) as consumer:
            conn.send("ready")
            for _ in range(frames):
                frame = consumer.recv(timeout=30.0)
                consumer.release(frame)
        conn.send("done")
    except BaseException as exc:
        conn.send(f"error: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("spin_us", [0, 200])
def test_round_trips_with_and_without_spin(address: str, spin_us: float) -> None:
    """Ping-pong 300 frames; the publisher spins in poll() as the subscriber does in recv()."""
    frames = 300
    with MemfdProducer(address, 4, spin_us=spin_us) as producer:
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_echo, args=(child, address, frames, spin_us), daemon=True)
        proc.start()
        try:
            assert parent.poll(60) and parent.recv() == "ready"
            producer.wait_subscribers(1)
            for _ in range(frames):
                producer.publish_next(timeout=10.0)
                deadline = time.monotonic() + 10.0
                while producer.core.lease_book.any_leased():
                    assert time.monotonic() < deadline, "the lease did not come back"
                    producer.core.poll(1.0)
            assert parent.poll(30) and parent.recv() == "done"
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def test_spin_respects_the_timeout(address: str) -> None:
    """recv(timeout) with a spin longer than the timeout still ends at the timeout."""
    with MemfdProducer(address, 2) as producer, SubscriberCore(address, spin_us=MAX_SPIN_US) as sub:
        producer.wait_subscribers(1)
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeoutError):
            sub.recv(timeout=0.002)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(ChannelTimeoutError):
            sub.recv(timeout=0)  # no frame, no wait, no spin


# -- idle: no CPU without spin -----------------------------------------------------


def _idle_recv(address: str, spin_us: float) -> tuple[float, float]:
    """CPU seconds and wall seconds of one ``recv(timeout=1.0)`` with nothing published."""
    with MemfdProducer(address, 2) as producer, SubscriberCore(address, spin_us=spin_us) as sub:
        producer.wait_subscribers(1)
        cpu0, wall0 = _cpu_seconds(), time.monotonic()
        with pytest.raises(ChannelTimeoutError):
            sub.recv(timeout=1.0)
        return _cpu_seconds() - cpu0, time.monotonic() - wall0


@pytest.mark.parametrize("spin_us", [0, 1000], ids=["no spin", "1 ms spin"])
def test_idle_subscriber_uses_no_cpu(address: str, spin_us: float) -> None:
    """A subscriber blocked in recv for a second uses (almost) no CPU: it sleeps in poll(2).

    With ``spin_us`` one recv burns at most its spin, then sleeps like the
    default.  A busy loop would use the whole second; the bound leaves room
    for a loaded CI machine (the benchmark measures the real fraction over 5 s).
    """
    cpu, wall = _idle_recv(address, spin_us)
    assert wall >= 0.9
    assert cpu / wall < 0.05, f"idle recv used {cpu:.3f} s of CPU in {wall:.3f} s"


# -- recv without a timeout: sleeps in recv(2) itself --------------------------------


def _publish_then(conn: Connection, address: str, end: str) -> None:
    """Publish one frame 0.3 s after the subscriber joined; then say BYE, or wait to be killed."""
    try:
        with MemfdProducer(address, 2) as producer:
            conn.send("ready")
            producer.wait_subscribers(1)
            time.sleep(0.3)
            producer.publish_next()
            deadline = time.monotonic() + 10.0
            while producer.core.lease_book.any_leased() and time.monotonic() < deadline:
                producer.core.poll(0.1)
            conn.send("released")
            if end == "kill":
                time.sleep(60)  # the test kills this process
    except BaseException as exc:
        conn.send(f"error: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("end", ["bye", "kill"])
def test_recv_without_timeout_sleeps_and_wakes_for_a_frame_and_for_the_end(
    address: str, end: str
) -> None:
    """``recv()`` with no timeout sleeps in ``recv`` (the socket is blocking after the
    handshake): no CPU while it waits, and it wakes for a frame, for a BYE and for a
    publisher killed with SIGKILL (the kernel hangs the socket up)."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_publish_then, args=(child, address, end), daemon=True)
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "ready"
        with SubscriberCore(address) as sub:
            cpu0, wall0 = _cpu_seconds(), time.monotonic()
            frame = sub.recv()  # published 0.3 s from now
            cpu, wall = _cpu_seconds() - cpu0, time.monotonic() - wall0
            assert wall >= 0.2 and cpu / wall < 0.2, (cpu, wall)
            sub.release(frame.seq, frame.slot)
            assert parent.poll(30) and parent.recv() == "released"
            if end == "kill":
                threading.Timer(0.3, proc.kill).start()
            with pytest.raises(EndOfStream) as info:
                sub.recv()  # the last call waited: this one sleeps in recv at once
            assert info.value.clean is (end == "bye")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- watch(): the hang-up check covers another fd ----------------------------------


@pytest.fixture
def eventfd() -> Iterator[int]:
    fd = os.eventfd(0, os.EFD_CLOEXEC)
    yield fd
    os.close(fd)


def test_watched_fd_sets_the_alarm(address: str, eventfd: int) -> None:
    with MemfdProducer(address, 4) as producer, SubscriberCore(address) as sub:
        sub.watch(eventfd)
        producer.wait_subscribers(1)
        producer.publish_next()
        frame = sub.recv(timeout=5)
        assert not sub.alarm
        assert sub.connected()
        sub.release(frame.seq, frame.slot)
        os.eventfd_write(eventfd, 1)  # the "producer exited" signal fires
        producer.publish_next()
        frame = sub.recv(timeout=5)  # the frame is still handed over; the caller decides
        assert sub.alarm
        assert not sub.connected()
        sub.release(frame.seq, frame.slot)


def test_watch_takes_each_fd_once_and_at_most_15(address: str) -> None:
    """The compiled calls poll the socket and the watched fds as one set of at most 16."""
    fds = [os.eventfd(0, os.EFD_CLOEXEC) for _ in range(16)]
    try:
        with MemfdProducer(address, 4) as producer, SubscriberCore(address) as sub:
            for fd in fds[:15]:
                sub.watch(fd)
                sub.watch(fd)  # again: still one entry
            with pytest.raises(UsageError, match="at most 15"):
                sub.watch(fds[15])
            producer.wait_subscribers(1)
            producer.publish_next()
            frame = sub.recv(timeout=5)  # the set still works
            assert not sub.alarm
            os.eventfd_write(fds[14], 1)
            assert not sub.connected() and sub.alarm
            sub.release(frame.seq, frame.slot)
    finally:
        for fd in fds:
            os.close(fd)


def test_hangup_sets_the_alarm(address: str) -> None:
    with MemfdProducer(address, 4) as producer, SubscriberCore(address) as sub:
        producer.wait_subscribers(1)
        assert sub.connected() and not sub.alarm
        producer.close()
        deadline = time.monotonic() + 5
        while sub.connected():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sub.alarm


# -- the lease book's cheap questions ----------------------------------------------


def test_lease_count_and_any_leased() -> None:
    book = LeaseBook(4)
    book.add_subscriber(1, "block", 2)
    book.add_subscriber(2, "block", 2)
    assert not book.any_leased()
    assert [book.lease_count(s) for s in range(4)] == [0, 0, 0, 0]
    book.publishing(1, 10)
    assert book.any_leased()
    assert book.lease_count(1) == 2 == len(book.leases(1))
    book.release(1, 10, 1)
    assert book.lease_count(1) == 1
    book.remove_subscriber(2)
    assert book.lease_count(1) == 0
    assert not book.any_leased()


# ================================================ the compiled per-frame bookkeeping


def _page(words: int = 64) -> memoryview:
    return memoryview(bytearray(4 * words)).cast("I")


def _held_elsewhere(lock: Any) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """Hold ``lock`` on another thread until the returned ``release`` event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert taken.wait(10)
    return taken, release, t


# ------------------------------------------------------------------ kept arrays
def test_the_compiled_in_use_rule_is_keptarrays() -> None:
    kept = _kept()
    assert hp.in_use(kept) is kept.in_use() is False
    held = kept.array
    assert hp.in_use(kept) is kept.in_use() is True
    del held
    memptr = kept.array.data
    assert hp.in_use(kept) is kept.in_use() is True
    del memptr
    mem = kept.array.data.mem
    assert hp.in_use(kept) is kept.in_use() is True
    del mem
    assert hp.in_use(kept) is kept.in_use() is False


def test_other_objects_are_asked_their_in_use() -> None:
    class Busy:
        def in_use(self) -> bool:
            return True

    class Failing:
        def in_use(self) -> bool:
            raise RuntimeError("asked")

    assert hp.in_use(Busy()) is True
    with pytest.raises(RuntimeError, match="asked"):
        hp.in_use(Failing())


# ------------------------------------------------------------------ the slot pick
class _Source:
    """A lease source with ``holder_sets`` (as the channel's publisher has)."""

    def __init__(self, holders: list[set[int]]) -> None:
        self.holder_sets = holders

    def leases(self, slot: int) -> int:
        return len(self.holder_sets[slot])

    def collect(self, timeout: float | None) -> int:
        return 0

    def order_write(self, slot: int, stream: int) -> None:
        pass


class _View:
    def __init__(self, busy: bool) -> None:
        self.busy = busy

    def in_use(self) -> bool:
        return self.busy


def _table(n: int, counts: list[int], writing: list[bool], views: list[Any], held: list[int]):
    table = SlotTable(n)
    for s in range(n):
        table.counts[s] = counts[s]
        table.writing[s] = writing[s]
        table.views[s] = views[s]
    table.add_source(_Source([{1} if h else set() for h in held]))
    return table


def _state(table: SlotTable) -> tuple[Any, ...]:
    return (list(table.counts), list(table.writing), list(table.generation), table.current)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_take_slot_picks_what_the_python_pick_picks(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 8))
    flags = st.lists(st.booleans(), min_size=n, max_size=n)
    counts = [int(c) for c in data.draw(flags)]
    writing = data.draw(flags)
    views = [
        None if v is None else _View(v)
        for v in data.draw(st.lists(st.none() | st.booleans(), min_size=n, max_size=n))
    ]
    held = [int(h) for h in data.draw(flags)]
    current = data.draw(st.integers(0, n - 1))
    fast = _table(n, counts, writing, views, held)
    slow = _table(n, counts, writing, views, held)
    fast.current = slow.current = current
    for s in range(n):
        fast.generation[s] = slow.generation[s] = 10 * s
    got = hp.take_slot(fast._fast, fast.sources, current + 1)
    want = slow._pick(None)
    if want is None:
        assert got is None
        assert _state(fast) == _state(slow)
        return
    assert got == (want, 10 * want + 1)
    assert fast.writing[want] is True and fast.generation[want] == 10 * want + 1
    assert fast.current == want
    slow.writing[want], slow.generation[want], slow.current = True, 10 * want + 1, want
    assert _state(fast) == _state(slow)


def test_take_is_round_robin_through_the_compiled_pick() -> None:
    table = _table(3, [0, 0, 0], [False] * 3, [None] * 3, [0, 0, 0])
    taken = []
    for _ in range(4):
        slot, gen = table.take(0)
        taken.append((slot, gen))
        table.release_writer(slot)
    assert taken == [(1, 1), (2, 1), (0, 1), (1, 2)]


def test_take_slot_leaves_a_table_locked_elsewhere_alone() -> None:
    table = _table(2, [0, 0], [False, False], [None, None], [0, 0])
    before = _state(table)
    _, release, t = _held_elsewhere(table.lock)
    try:
        assert hp.take_slot(table._fast, table.sources, 0) is None
        assert _state(table) == before
    finally:
        release.set()
        t.join()
    assert hp.take_slot(table._fast, table.sources, 0) == (0, 1)


def test_take_slot_leaves_sources_without_holder_sets_to_python() -> None:
    class Plain:
        def leases(self, slot: int) -> int:
            return 0

        def collect(self, timeout: float | None) -> int:
            return 0

        def order_write(self, slot: int, stream: int) -> None:
            pass

    table = SlotTable(2)
    table.add_source(Plain())
    assert hp.take_slot(table._fast, table.sources, 0) is None
    assert table.writing == [False, False] and table.generation == [0, 0]
    assert table.take(0) == (1, 1)  # the Python pick


# ------------------------------------------------------------------ write ordering
def _order_ctx(rec: MemopRecorder, words: memoryview, readers: list[list[int]], **kw: Any):
    lock = kw.get("lock", threading.RLock())
    rows = {sub: (sub, [BASE + 4 * (8 * sub + s) for s in range(4)]) for sub in (1, 2, 3)}
    published = kw.get("published", [5, 6, 7, 8])
    return (lock, readers, rows, published, words, BASE, rec.address, GEQ)


def _read_flag(sub: int, slot: int) -> int:
    return 8 * sub + slot  # the word index of subscriber sub's read flag for slot


def test_order_slot_waits_only_on_flags_the_host_does_not_see_set() -> None:
    rec, words = MemopRecorder(), _page()
    readers: list[list[int]] = [[], [1], [], [1, 2]]
    ctx = _order_ctx(rec, words, readers)
    assert hp.order_slot(ctx, 0, STREAM) == (0, 0)  # nobody read slot 0
    assert hp.order_slot(ctx, 1, STREAM) == (1, 0)  # subscriber 1's flag is not at 6
    assert rec.calls == [(STREAM, BASE + 4 * _read_flag(1, 1), 6, GEQ)]
    words[_read_flag(1, 1)] = 6
    assert hp.order_slot(ctx, 1, STREAM) == (0, 0)
    words[_read_flag(1, 3)] = 9  # past 8: reached (cyclic comparison)
    assert hp.order_slot(ctx, 3, STREAM) == (1, 0)  # subscriber 2's only
    assert rec.calls[-1] == (STREAM, BASE + 4 * _read_flag(2, 3), 8, GEQ)
    assert len(rec.calls) == 2


def test_order_slot_leaves_several_waits_and_a_held_lock_to_python() -> None:
    rec, words = MemopRecorder(), _page()
    ctx = _order_ctx(rec, words, [[1, 2], [], [], []])
    assert hp.order_slot(ctx, 0, STREAM) is None  # two flags: the Python path batches
    _, release, t = _held_elsewhere(ctx[0])
    try:
        assert hp.order_slot(_order_ctx(rec, words, [[1], [], [], []], lock=ctx[0]), 0, 1) is None
    finally:
        release.set()
        t.join()
    assert rec.calls == []


def test_order_slot_skips_departed_readers_and_reports_driver_errors() -> None:
    rec, words = MemopRecorder(result=201), _page()
    ctx = _order_ctx(rec, words, [[9, 1], [], [], []])  # subscriber 9 has left (no row)
    assert hp.order_slot(ctx, 0, STREAM) == (1, 201)
    assert rec.calls == [(STREAM, BASE + 4 * _read_flag(1, 0), 5, GEQ)]


def test_order_slot_refuses_a_flag_outside_the_page() -> None:
    rec = MemopRecorder()
    ctx = _order_ctx(rec, _page(words=8), [[3], [], [], []])  # row 3 lies past 8 words
    with pytest.raises(ValueError, match="not in the page"):
        hp.order_slot(ctx, 0, STREAM)
    assert ctx[0].acquire(blocking=False)  # the lock was let go
    ctx[0].release()


# ------------------------------------------------------------------ frame assembly
def _handle(slot: int, generation: int, offset: int = 0, shape: tuple[int, ...] = (4,)):
    return ArrayHandle(slot, generation, offset, shape, (4,) * len(shape), "int32")


def _payload(slot: int, generation: int, handles: list[ArrayHandle], meta: bytes = b"") -> bytes:
    head = FRAME_HEAD.pack(slot, generation & 0xFFFFFFFF, len(handles), len(meta))
    return head + b"".join(h.pack() for h in handles) + meta


class _Receiver:
    """What a subscriber's peer pool holds for the compiled assembly, for 4 slots."""

    def __init__(self, geometries: list[ArrayHandle], rc: int = 0) -> None:
        self.cache: dict[bytes, Any] = {}
        self.views: dict[bytes, _KeptView] = {}
        self.seen = [0] * 4
        self.lent: list[Any] = []
        self.words = _page()
        self.flags = [BASE + 4 * s for s in range(4)]
        self.rec = MemopRecorder(rc)
        for h in geometries:
            key, _gen, _end = ArrayHandle.peek(h.pack())
            self.cache[key] = (h.slot, h.offset, h.shape, h.strides, h.dtype)
            self.views[key] = _KeptView(_CP, 0x1000, 1 << 20, 0, key, self.cache[key], None)
        self.ctx = (
            self.cache, self.views, self.seen, self.lent,
            self.words, BASE, self.flags, self.rec.address, GEQ,
        )  # fmt: skip

    def state(self) -> tuple[Any, ...]:
        owners = [v.holder.owner for v in self.views.values()]
        return (list(self.seen), list(self.lent), owners, list(self.rec.calls))


def test_take_frame_hands_the_kept_arrays_to_the_new_frame() -> None:
    r = _Receiver([_handle(2, 0), _handle(2, 0, offset=64, shape=(2, 2))])
    owner = object()
    payload = _payload(2, 9, [_handle(2, 9), _handle(2, 9, 64, (2, 2))], b"meta")
    got = hp.take_frame(r.ctx, memoryview(payload), 2, owner, STREAM)
    assert got is not None
    generation, arrays, metadata, waited, rc = got
    views = list(r.views.values())
    assert (generation, metadata, waited, rc) == (9, b"meta", True, 0)
    assert arrays == (views[0].array, views[1].array)
    assert [v.holder.owner for v in views] == [owner, owner]
    assert r.seen == [0, 0, 9, 0] and r.lent == views
    assert r.rec.calls == [(STREAM, r.flags[2], 9, GEQ)]  # the flag is not set yet
    del arrays, got
    r.lent.clear()
    r.words[2] = 10  # the host sees the next frame's flag set: no wait
    got = hp.take_frame(r.ctx, _payload(2, 10, [_handle(2, 10)]), 2, owner, STREAM)
    assert got is not None and got[3] is False and len(r.rec.calls) == 1


def test_take_frame_reports_the_drivers_error() -> None:
    r = _Receiver([_handle(1, 0)], rc=700)
    got = hp.take_frame(r.ctx, _payload(1, 3, [_handle(1, 3)]), 1, object(), STREAM)
    assert got is not None and got[4] == 700


def _unusual_frames() -> dict[str, tuple[bytes, int]]:
    h = _handle(1, 5)
    payload = _payload(1, 5, [h], b"xy")
    return {
        "unknown geometry": (_payload(1, 5, [_handle(1, 5, offset=128)]), 1),
        "older generation than seen": (_payload(1, 2, [_handle(1, 2)]), 1),
        "the same geometry twice": (_payload(1, 5, [h, h]), 1),
        "metadata length off": (payload[:-1], 1),
        "truncated handle": (payload[: FRAME_HEAD.size + 10], 1),
        "head shorter than FRAME_HEAD": (payload[:5], 1),
        "flag names another slot": (payload, 2),
        "too many arrays": (FRAME_HEAD.pack(1, 5, 65, 0) + payload[FRAME_HEAD.size :], 1),
        "too much metadata": (FRAME_HEAD.pack(1, 5, 1, 16385) + payload[FRAME_HEAD.size :], 1),
    }


@pytest.mark.parametrize("case", sorted(_unusual_frames()))
def test_take_frame_changes_nothing_in_a_case_it_leaves_to_python(case: str) -> None:
    payload, slot = _unusual_frames()[case]
    r = _Receiver([_handle(1, 0)])
    r.seen[1] = 3
    before = copy.copy(r.state())
    assert hp.take_frame(r.ctx, payload, slot, object(), STREAM) is None
    assert r.state() == before


def test_take_frame_leaves_a_kept_array_in_use_to_python() -> None:
    r = _Receiver([_handle(1, 0)])
    (view,) = r.views.values()
    in_hand = view.array  # the last frame's array is still used
    before = r.state()
    assert hp.take_frame(r.ctx, _payload(1, 5, [_handle(1, 5)]), 1, object(), STREAM) is None
    assert r.state() == before
    del in_hand
    assert hp.take_frame(r.ctx, _payload(1, 5, [_handle(1, 5)]), 1, object(), STREAM) is not None


def test_take_frame_refuses_a_flag_outside_the_page_before_handing_anything_out() -> None:
    r = _Receiver([_handle(1, 0)])
    r.flags[1] = BASE + 4 * 4096  # past the page
    before = r.state()
    with pytest.raises(ValueError, match="not in the page"):
        hp.take_frame(r.ctx, _payload(1, 5, [_handle(1, 5)]), 1, object(), STREAM)
    assert r.state() == before
