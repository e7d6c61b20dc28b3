"""A departure wakes the producer that waits for a slot the departed subscriber held.

protocol.md, Failures: when a subscriber leaves -- BYE, a hang-up without BYE,
death (SIGKILL), eviction -- its leases come back and a waiting ``acquire()``
is woken at once.  The wait of a publisher made with ``ahead=True`` is the poll
that also looks at the read flags (``PublisherCore.poll(timeout, settle)``,
what ``Publisher``'s lease source calls while ``pool.acquire`` waits); here it
runs for real over the GPU-free stand-ins of ``tests/test_flag_leases_cpu.py``
(memfd slots, a memfd flag page, real sockets, the subscriber in another
process), beside the plain wait, for each way of leaving.  The subscriber holds
both slots of the ring and sets no read flag and sends no RELEASE, so only its
departure can free a slot.  Each wait is given far more time than the
departure takes (``WAIT``); it must end within ``WOKEN`` of the departure (the
bound protocol.md states).  Before the fix a waiting poll with the flag look
ended only at a RELEASE or a read flag: it slept its whole timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from tests.test_flag_leases_cpu import LAYOUT, ConsumerProcesses, FlagProducer

#: The producer's wait (s): a departure must end it long before.
WAIT = 30.0
#: The bound protocol.md states for a departure to wake a waiting acquire (s).
WOKEN = 1.0
#: The lease timeout of the eviction case (s).
LEASE_TIMEOUT = 0.5

WAYS = ("bye", "hang-up", "sigkill", "evicted")


class Producer(FlagProducer):
    """:class:`FlagProducer` with an optional ``lease_timeout``."""

    def __init__(self, address: str, lease_timeout: float | None) -> None:
        super().__init__(address)
        if lease_timeout is not None:
            self.core.close()
            self.core = PublisherCore(
                address,
                2,
                welcome=self.slots.welcome(self.flags.fd),
                on_join=self._join,
                lease_timeout=lease_timeout,
            )
            self.core.read_flags(self.flags.mapping, LAYOUT.reads_offset, 1)


def holding_consumer(conn: Connection, address: str) -> None:
    """Take two frames and hold them (no read flag, no RELEASE); on ``("leave", how)``
    leave that way: ``"bye"`` says BYE, ``"hang-up"`` shuts the socket down without
    one and lives on; other ways are the test's (it kills or evicts this process)."""
    core = SubscriberCore(address, mode="block", timeout=5.0)
    for fd in core.take_fds():
        os.close(fd)
    frames = [core.recv(10.0) for _ in range(2)]
    conn.send(("holding", [f.seq for f in frames]))
    cmd = conn.recv()
    if cmd == ("leave", "bye"):
        core.close()
    elif cmd == ("leave", "hang-up"):
        socket.socket(fileno=os.dup(core.fileno())).shutdown(socket.SHUT_RDWR)
    if cmd[0] == "leave":
        conn.recv()  # alive until the test is done
    core.close()


@pytest.fixture
def holding(tmp_path: Any) -> Iterator[Callable[[str], tuple[Producer, Any, Connection]]]:
    procs = ConsumerProcesses()

    def start(way: str) -> tuple[Producer, Any, Connection]:
        prod = Producer(str(tmp_path / "depart.sock"), LEASE_TIMEOUT if way == "evicted" else None)
        proc, conn = procs.start(prod, holding_consumer)
        for _ in range(2):
            publish_in_a_free_slot(prod)
        assert conn.poll(20) and conn.recv() == ("holding", [0, 1])
        return prod, proc, conn

    yield start
    procs.stop(("done",))


def publish_in_a_free_slot(prod: FlagProducer) -> None:
    """Publish the next frame in a free slot (one must be free)."""
    slot = prod.core.lease_book.pick_free_slot(0)
    assert slot is not None
    seq = prod.core.next_seq
    prod.slots.write(slot, seq)
    prod.published[slot] = seq + 1
    prod.core.publish(slot, generation=seq + 1)


def _leave_soon(way: str, proc: Any, conn: Connection, delay: float) -> threading.Thread:
    """Make the subscriber leave ``delay`` s from now (while the producer waits)."""

    def leave() -> None:
        time.sleep(delay)
        if way == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)
        elif way in ("bye", "hang-up"):
            conn.send(("leave", way))

    thread = threading.Thread(target=leave, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [True, False], ids=["ahead-wait", "plain-wait"])
@pytest.mark.parametrize("way", WAYS)
def test_a_departure_wakes_the_waiting_producer(holding: Any, way: str, flags: bool) -> None:
    prod, proc, conn = holding(way)
    book = prod.core.lease_book
    assert book.pick_free_slot(0) is None  # both slots held: only the departure frees one
    assert prod.core.poll(0.0) == 0
    leave_at = time.monotonic() + 0.2
    # an eviction comes at the lease timeout, counted from the frames' publication
    thread = _leave_soon(way, proc, conn, 0.2)
    start = time.monotonic()
    returned = prod.core.poll(WAIT, flags)
    woke = time.monotonic()
    thread.join()
    assert returned == 2, f"the poll ended with {returned} leases returned ({way})"
    assert book.pick_free_slot(0) is not None and not book.any_leased()
    assert prod.core.subscribers == []
    if way == "evicted":
        assert prod.core.evictions == 1
        assert woke - start < LEASE_TIMEOUT + WOKEN
    else:
        assert woke - leave_at < WOKEN, f"woken {woke - leave_at:.3f} s after the departure"
    # and the producer goes on: the next frame goes out (to nobody) at once
    publish_in_a_free_slot(prod)


@pytest.mark.timeout(120)
def test_a_departure_wakes_a_producer_that_waits_without_limit(holding: Any) -> None:
    """``timeout=None``: before the fix a waiting poll with the flag look never resumed."""
    prod, _proc, conn = holding("bye")
    result: list[int] = []
    waiter = threading.Thread(target=lambda: result.append(prod.core.poll(None, True)), daemon=True)
    waiter.start()
    time.sleep(0.2)
    conn.send(("leave", "bye"))
    waiter.join(WAIT)
    assert not waiter.is_alive(), "the producer never resumed after the BYE"
    assert result == [2]
