"""CPU tier: the slot table behind pool.acquire() (no GPU), with real memfd slots and leases.

The table is the pool's state machine: local references, writers (slot
tokens), generations and lease sources.  The lease source here is a real
:class:`PublisherCore` over memfd slots with a subscriber in a spawned child,
as in ``test_session.py``; nothing is faked.
"""

from __future__ import annotations

import gc
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer, MemfdProducer

from cupy_ipcpool import LeaseSource, SlotBusyError
from cupy_ipcpool._arrays import SlotRef
from cupy_ipcpool._slots import SlotTable
from tests import _pipe_child

CTX = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)


def test_take_is_round_robin_and_skips_busy_slots() -> None:
    table = SlotTable(3)
    assert table.take(0) == (1, 1)  # the first free slot after the current one (0)
    table.release_writer(1)
    pin = SlotRef(None, table, 2)  # an array over slot 2
    assert table.take(0) == (0, 1)  # 2 is skipped
    assert table.current == 0 and table.writing[0]
    with pytest.raises(SlotBusyError, match="slot 0: an open slot token writes it"):
        table.take(0, slot=0)
    table.release_writer(0)
    assert table.take(0) == (1, 2)
    table.release_writer(1)
    del pin
    gc.collect()
    assert table.take(0) == (2, 1)
    assert table.generation == [1, 2, 1]


def test_busy_message_says_who_holds_what() -> None:
    table = SlotTable(2)
    pins = [SlotRef(None, table, 0), SlotRef(None, table, 0)]
    table.take(0, slot=1)
    with pytest.raises(SlotBusyError) as info:
        table.take(0)
    text = str(info.value)
    assert "slot 0: 2 local array(s)" in text and "slot 1: an open slot token" in text
    assert isinstance(info.value, TimeoutError)
    del pins


def _wake_delay(table: SlotTable, drop: Callable[[], None]) -> float:
    """Seconds between ``drop()`` (which frees the table's only slot) and a waiting take()."""
    woke: list[float] = []

    def waiter() -> None:
        table.take(10.0)
        woke.append(time.monotonic())

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    assert not woke  # still waiting: the slot is held
    dropped = time.monotonic()
    drop()
    thread.join(5)
    assert woke
    return woke[0] - dropped


def test_a_waiter_wakes_when_another_thread_drops_an_array() -> None:
    table = SlotTable(1)
    pins = [SlotRef(None, table, 0)]
    assert _wake_delay(table, pins.clear) < 0.05  # notified, not polled


def test_a_waiter_wakes_when_a_token_is_released() -> None:
    table = SlotTable(1)
    table.take(0)
    got: list[tuple[int, int]] = []
    thread = threading.Thread(target=lambda: got.append(table.take(10.0)))
    thread.start()
    time.sleep(0.1)
    table.release_writer(0)
    thread.join(5)
    assert got == [(0, 2)]


class _Kept:
    """A stand-in for the pool's reusable view: in use while anything else refers to ``obj``.

    The same rule as :class:`cupy_ipcpool._arena.ReusableView`, over a plain
    Python object instead of a ``cupy.ndarray`` (the table itself needs no GPU).
    """

    def __init__(self) -> None:
        self.obj = bytearray(16)
        self._base = self._count()

    def _count(self) -> int:
        obj = self.obj
        return sys.getrefcount(obj)

    def in_use(self) -> bool:
        return self._count() != self._base


def test_a_view_in_use_holds_its_slot_like_an_array() -> None:
    table = SlotTable(2)
    kept = _Kept()
    table.views[1] = kept
    assert table.take(0) == (1, 1) and table.release_writer(1) is None  # idle: free
    held = kept.obj  # the user holds the view
    assert table.view_in_use(1) and table.is_busy(1) and table.local_refs(1) == 1
    assert table.take(0) == (0, 1)  # slot 1 is skipped
    table.release_writer(0)
    with pytest.raises(SlotBusyError, match="slot 1: 1 local array"):
        table.take(0, slot=1)
    del held
    assert not table.is_busy(1) and table.local_refs(1) == 0
    assert table.take(0) == (1, 2)


def test_a_waiter_sees_a_view_dropped_by_another_thread() -> None:
    """Nothing notifies when a view's last outside reference goes: the waiter looks again."""
    table = SlotTable(1)
    kept = _Kept()
    table.views[0] = kept
    held = [kept.obj]
    assert _wake_delay(table, held.clear) < 0.5


def test_timeout_zero_does_not_wait() -> None:
    table = SlotTable(1)
    table.take(0)
    start = time.monotonic()
    with pytest.raises(SlotBusyError):
        table.take(0)
    assert time.monotonic() - start < 0.05


def test_a_timed_take_waits_its_timeout_then_says_busy() -> None:
    """The deadline starts when no slot is free (the clock is not read on the fast path)."""
    table = SlotTable(1)
    table.take(0)
    start = time.monotonic()
    with pytest.raises(SlotBusyError, match="slot 0"):
        table.take(0.3)
    waited = time.monotonic() - start
    assert 0.25 <= waited < 5.0, waited


# ------------------------------------------------------------- with real leases


class CoreLeases:
    """A lease source over a real PublisherCore (what the channel's publisher does)."""

    def __init__(self, producer: MemfdProducer) -> None:
        self.core = producer.core
        self.ordered: list[tuple[int, int]] = []

    def leases(self, slot: int) -> int:
        return len(self.core.lease_book.leases(slot))

    def collect(self, timeout: float | None) -> int:
        return self.core.poll(timeout)

    def order_write(self, slot: int, stream: int) -> None:
        self.ordered.append((slot, stream))


def _hold_then_release(conn: Connection, address: str, hold: float) -> None:
    try:
        with MemfdConsumer(address) as consumer:
            frames = [consumer.recv(30), consumer.recv(30)]
            conn.send(("ok", [f.slot for f in frames]))
            time.sleep(hold)
            for frame in frames:
                consumer.release(frame)
            conn.send(("ok", "released"))
            conn.recv()  # wait for the parent before saying goodbye
    except BaseException as exc:
        conn.send(("err", type(exc).__name__, str(exc)))


@pytest.fixture
def address(tmp_path: Any) -> Iterator[str]:
    yield str(tmp_path / "chan.sock")


@pytest.mark.timeout(60)
def test_take_waits_for_peer_leases_and_wakes_when_they_come_back(address: str) -> None:
    with MemfdProducer(address, 2) as producer:
        source = CoreLeases(producer)
        assert isinstance(source, LeaseSource)
        table = SlotTable(2)
        table.add_source(source)
        parent, child_end = CTX.Pipe()
        proc = CTX.Process(target=_hold_then_release, args=(child_end, address, 0.5), daemon=True)
        proc.start()
        child_end.close()
        try:
            producer.wait_subscribers(1, timeout=30)
            for _ in range(2):  # fill both slots, each leased by the subscriber
                slot, _gen = table.take(0)
                seq = producer.core.next_seq
                producer.slots.write(slot, seq)
                producer.core.publish(slot)
                table.release_writer(slot)
            assert parent.poll(30)
            assert parent.recv()[0] == "ok"
            assert table.leases(0) == 1 and table.leases(1) == 1
            with pytest.raises(SlotBusyError, match="1 peer lease"):
                table.take(0)
            start = time.monotonic()
            slot, _gen = table.take(20.0)  # returns when the leases come back
            waited = time.monotonic() - start
            assert 0.2 < waited < 10, waited
            assert slot in (0, 1) and table.leases(slot) == 0
            table.release_writer(slot)
            assert parent.poll(30) and parent.recv() == ("ok", "released")
            parent.send("bye")
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            parent.close()
        table.remove_source(source)
        assert table.sources == ()


# ------------------------------------------------------------- the array calls' defaults


@pytest.mark.parametrize("method", ["IpcPool.array", "SlotToken.array"])
def test_array_calls_default_to_the_dtype_of_cupy_empty(method: str) -> None:
    """``pool.array()`` and ``token.array(shape)`` make what ``cupy.empty(shape)`` makes
    (float64); the GPU tests check the arrays themselves."""
    import cupy  # imports without a GPU
    import numpy

    import cupy_ipcpool as cip

    cls, name = method.split(".")
    params = inspect.signature(getattr(getattr(cip, cls), name)).parameters
    expected = numpy.dtype(inspect.signature(cupy.empty).parameters["dtype"].default)
    assert numpy.dtype(params["dtype"].default) == expected == numpy.float64
    # shape and dtype are the obvious first arguments; everything after them is keyword-only
    kinds = [p.kind for p in params.values()]
    assert list(params)[1:3] == ["shape", "dtype"]
    assert all(k is inspect.Parameter.KEYWORD_ONLY for k in kinds[3:])
