"""The per-frame path's shortcuts do what the general path does, and its rules hold.

Every frame takes a few shortcuts past the general code: options that change
how an end waits, and cheap questions asked instead of general ones.  Each is
tested here against the path it stands for, for real (processes, sockets,
memfd slots; on CPU):

* ``spin_us``: a short busy-poll before sleeping, on the subscriber's ``recv``
  and the publisher's ``poll`` (off by default: an idle end uses no CPU);
  frames still arrive in order, a timeout still holds;
* ``SubscriberCore.watch``: one ``poll(0)`` per frame covers the socket's
  hang-up and the watched fds (the producer's pidfd);
* ``LeaseBook.lease_count`` / ``any_leased``: the cheap questions the pool asks
  for every acquire, against ``leases``.

And the per-frame bookkeeping's rules, each with one implementation (Python):
the slot pick (``SlotTable.take``: the first free slot after the current one,
round-robin) and the subscriber's frame assembly (the FRAME payload's head,
then ``PeerPool._arrays_from_wire``, which hands a kept array out again only
while nothing else uses it).  CuPy's objects are plain stand-ins
(``tests/test_kept_array_cpu``); the kept-array rule itself is tested there,
the publisher's write ordering (``SyncPage.order_all``) in
``tests/test_syncpage_cpu.py``.  The GPU suite runs the same code under the
real channel.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer, MemfdProducer
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kept_array_cpu import _CP

from cupy_ipcpool import _driver
from cupy_ipcpool._arrays import SlotRefs
from cupy_ipcpool._errors import (
    ChannelTimeoutError,
    DescriptorError,
    EndOfStream,
    ProtocolError,
    SlotBusyError,
    StaleHandleError,
    UsageError,
)
from cupy_ipcpool._handles import ArrayHandle
from cupy_ipcpool._peer import PeerPool
from cupy_ipcpool._slots import SlotTable
from cupy_ipcpool.channel._handshake import Welcome
from cupy_ipcpool.channel._leases import LeaseBook
from cupy_ipcpool.channel._payload import FRAME_HEAD, FRAME_VOID, frame_head
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._sockets import MAX_SPIN_US
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from tests import _pipe_child

CTX = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)


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
        PublisherCore(address, 2, welcome=Welcome(), spin_us=bad)  # type: ignore[arg-type]


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


# ================================================ the per-frame bookkeeping's rules


# ------------------------------------------------------------------ the slot pick
class _Source:
    """A lease source whose per-slot holders are given."""

    def __init__(self, holders: list[set[int]]) -> None:
        self.holders = holders

    def leases(self, slot: int) -> int:
        return len(self.holders[slot])

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
def test_take_picks_the_first_free_slot_after_the_current_one(data: st.DataObject) -> None:
    """Free: no local reference, no writer, no view in use, no peer lease."""
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
    table = _table(n, counts, writing, views, held)
    table.current = current
    for s in range(n):
        table.generation[s] = 10 * s
    before = _state(table)
    free = [
        s % n
        for s in range(current + 1, current + 1 + n)
        if not (counts[s % n] or writing[s % n] or held[s % n])
        and not (views[s % n] is not None and views[s % n].busy)
    ]
    if not free:
        with pytest.raises(SlotBusyError):
            table.take(0)
        assert _state(table) == before  # nothing taken
        return
    want = free[0]
    assert table.take(0) == (want, 10 * want + 1)
    assert table.writing[want] is True and table.generation[want] == 10 * want + 1
    assert table.current == want
    counts_after, writing_after, generation_after, _ = _state(table)
    assert counts_after == counts
    assert [w for s, w in enumerate(writing_after) if s != want] == [
        w for s, w in enumerate(writing) if s != want
    ]
    assert [g for s, g in enumerate(generation_after) if s != want] == [
        10 * s for s in range(n) if s != want
    ]


def test_take_is_round_robin() -> None:
    table = _table(3, [0, 0, 0], [False] * 3, [None] * 3, [0, 0, 0])
    taken = []
    for _ in range(4):
        slot, gen = table.take(0)
        taken.append((slot, gen))
        table.release_writer(slot)
    assert taken == [(1, 1), (2, 1), (0, 1), (1, 2)]


def test_take_asks_each_view_and_passes_on_what_it_raises() -> None:
    class Failing:
        def in_use(self) -> bool:
            raise RuntimeError("asked")

    table = _table(2, [0, 0], [False, False], [_View(True), None], [0, 0])
    assert table.take(0) == (1, 1)  # slot 0's view is in use
    table.release_writer(1)
    table.views[0] = Failing()
    with pytest.raises(RuntimeError, match="asked"):
        table.take(0)
    assert table.writing == [False, False] and table.generation == [0, 1]


# ------------------------------------------------------------------ frame assembly
def _handle(slot: int, generation: int, offset: int = 0, shape: tuple[int, ...] = (4,)):
    return ArrayHandle(slot, generation, offset, shape, (4,) * len(shape), "int32")


def _payload(slot: int, generation: int, handles: list[ArrayHandle], meta: bytes = b"") -> bytes:
    head = FRAME_HEAD.pack(slot, generation & 0xFFFFFFFF, len(handles), len(meta))
    return head + b"".join(h.pack() for h in handles) + meta


def _wire(*handles: ArrayHandle) -> bytes:
    return b"".join(h.pack() for h in handles)


def _peer(num_slots: int = 4, slot_nbytes: int = 1 << 20) -> PeerPool:
    """A peer pool over stand-in slots and CuPy stand-ins: what the frame assembly reads."""
    peer = PeerPool.__new__(PeerPool)
    peer._desc = SimpleNamespace(num_slots=num_slots, slot_nbytes=slot_nbytes)  # type: ignore[assignment]
    peer._slots = SimpleNamespace(  # type: ignore[assignment]
        ptrs=[0x1000_0000 * (s + 1) for s in range(num_slots)], refs=SlotRefs(num_slots)
    )
    peer._device = 0
    peer._epoch = _driver.fork_epoch()
    peer._seen_generation = [0] * num_slots
    peer._geometry = {}
    peer._views = {}
    peer._lent = []
    peer._closed = False
    peer._cp = _CP
    return peer


def _owners(peer: PeerPool) -> list[Any]:
    return [v.holder.owner for v in peer._views.values()]


def test_a_frame_of_known_geometries_gets_the_kept_arrays_again() -> None:
    peer = _peer()
    first, second = object(), object()
    wire = _wire(_handle(2, 8), _handle(2, 8, offset=64, shape=(2, 2)))
    arrays, pos = peer._arrays_from_wire(wire, 0, 2, first)
    assert pos == len(wire)
    assert [a.data.ptr for a in arrays] == [0x3000_0000, 0x3000_0000 + 64]
    assert [a.shape for a in arrays] == [(4,), (2, 2)]
    views = list(peer._views.values())
    assert [v.array for v in views] == arrays and _owners(peer) == [first, first]
    del arrays
    peer._drop_idle_owners()
    assert _owners(peer) == [None, None]  # nothing holds the first frame's owner now
    wire = _wire(_handle(2, 9), _handle(2, 9, offset=64, shape=(2, 2)))
    again, _ = peer._arrays_from_wire(wire, 0, 2, second)
    assert again == [v.array for v in views]  # the same arrays, no new ones
    assert list(peer._views.values()) == views and _owners(peer) == [second, second]
    assert peer._seen_generation == [0, 0, 9, 0] and peer._lent == views


def test_an_array_still_in_use_is_not_handed_out_again() -> None:
    peer = _peer()
    first, second = object(), object()
    (in_hand,), _ = peer._arrays_from_wire(_wire(_handle(1, 5)), 0, 1, first)
    (fresh,), _ = peer._arrays_from_wire(_wire(_handle(1, 6)), 0, 1, second)
    assert fresh is not in_hand
    assert in_hand.data.mem.owner.owner is first  # the old frame keeps its owner
    assert fresh.data.mem.owner.owner is second
    peer._drop_idle_owners()  # both still in use: both owners kept
    assert in_hand.data.mem.owner.owner is first and fresh.data.mem.owner.owner is second


def test_the_same_geometry_twice_in_one_frame_is_two_arrays() -> None:
    peer = _peer()
    h = _handle(1, 5)
    arrays, _ = peer._arrays_from_wire(_wire(h, h), 0, 2, object())
    assert arrays[0] is not arrays[1] and arrays[0].data.ptr == arrays[1].data.ptr


def test_a_handle_older_than_one_seen_is_refused() -> None:
    peer = _peer()
    peer._arrays_from_wire(_wire(_handle(1, 5)), 0, 1, object())
    with pytest.raises(StaleHandleError, match="generation 3"):
        peer._arrays_from_wire(_wire(_handle(1, 3)), 0, 1, object())
    assert peer._seen_generation[1] == 5


@pytest.mark.parametrize(
    "wire",
    [
        _wire(_handle(1, 5))[:10],  # truncated
        _wire(_handle(4, 5)),  # a slot the pool does not have
        _wire(_handle(1, 5, offset=(1 << 20) - 8)),  # past the slot's end
    ],
    ids=["truncated", "no such slot", "past the slot"],
)
def test_a_handle_that_does_not_fit_is_refused_and_not_cached(wire: bytes) -> None:
    peer = _peer()
    with pytest.raises(DescriptorError):
        peer._arrays_from_wire(wire, 0, 1, object())
    assert peer._geometry == {} and peer._views == {} and peer._lent == []


def _bad_heads() -> dict[str, tuple[bytes, int, str]]:
    payload = _payload(1, 5, [_handle(1, 5)], b"xy")
    rest = payload[FRAME_HEAD.size :]
    return {
        "head shorter than FRAME_HEAD": (payload[:5], 1, "payload too short"),
        "flag names another slot": (payload, 2, "names flag 1"),
        "too many arrays": (FRAME_HEAD.pack(1, 5, 65, 0) + rest, 1, "65 arrays"),
        "too much metadata": (FRAME_HEAD.pack(1, 5, 1, 16385) + rest, 1, "16385 metadata"),
        "void frame with arrays": (
            FRAME_HEAD.pack(1 | FRAME_VOID, 5, 1, 2) + rest,
            1,
            "void frame with 1 arrays",
        ),
        "void mark on another slot's flag": (
            FRAME_HEAD.pack(2 | FRAME_VOID, 5, 0, 0),
            1,
            f"names flag {2 | FRAME_VOID}",
        ),
        "another high bit": (FRAME_HEAD.pack(1 | 1 << 30, 5, 0, 0), 1, "names flag"),
    }


def test_a_frame_head_is_read_as_written() -> None:
    payload = _payload(1, (1 << 32) + 5, [_handle(1, 5), _handle(1, 5)], b"xy")
    assert frame_head(7, 1, memoryview(payload)) == (5, 2, 2, False)  # the generation's low bits


def test_a_void_frame_head_is_read_as_void() -> None:
    """Bit 31 of the flag index marks a void frame (a publisher with ahead=True sends one
    for a frame taken and not published): no arrays, the metadata as said."""
    head = FRAME_HEAD.pack(1 | FRAME_VOID, 5, 0, 0)
    assert frame_head(7, 1, memoryview(head)) == (5, 0, 0, True)
    assert frame_head(7, 1, FRAME_HEAD.pack(1 | FRAME_VOID, 5, 0, 2) + b"xy") == (5, 0, 2, True)
    assert frame_head(7, 1, FRAME_HEAD.pack(1, 5, 0, 0)) == (5, 0, 0, False)  # no arrays: not void
    assert FRAME_VOID == 1 << 31


@pytest.mark.parametrize("case", sorted(_bad_heads()))
def test_a_malformed_frame_head_is_a_protocol_error(case: str) -> None:
    payload, slot, message = _bad_heads()[case]
    with pytest.raises(ProtocolError, match=message):
        frame_head(7, slot, payload)
