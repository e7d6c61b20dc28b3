"""An ``"ahead"`` subscriber may release a frame before it is published.

Such a subscriber hands frame *k + n* out (``n``: the ring's slots) once it
received frame *k* by message, so it may release it before the frame's
message comes, often before the frame is published at all:
``SubscriberCore.release_ahead`` sends that RELEASE.  The publisher's lease
book notes it and ends the lease as the frame is published: the slot is free
again at once, and the producer's stream still orders its next write there
after the read flag.  A producer waiting for that lease then depends neither
on the subscriber's host calling ``recv()`` again nor on the GPU running its
work: the wait that makes ahead mode's round-trip tail (docs/performance.md).
Only the fixed schedule of ``Publisher(ahead=True)`` explains such a RELEASE:
anything else costs the sender its connection.  The stream end to end, with
bytes checked, is ``tests/test_ahead_stream_cpu.py`` (release-early); the GPU
subscriber releases so (``Frame.release`` of a frame handed out ahead).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from cupy_ipcpool._errors import ProtocolError
from cupy_ipcpool.channel._leases import AHEAD, BLOCK, LeaseBook
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from tests.test_flag_leases_cpu import ConsumerProcesses, FlagProducer, ask

SLOTS = 4


def ahead_book(published: int = SLOTS) -> LeaseBook:
    """A book with an ahead subscriber (1) and a block one (2) that were sent frames
    ``0 .. published - 1`` round-robin and released them."""
    book = LeaseBook(SLOTS)
    book.add_subscriber(1, AHEAD, 1)
    book.add_subscriber(2, BLOCK, 1)
    for seq in range(published):
        assert book.publishing(seq % SLOTS, seq) == [1, 2]
        book.release(1, seq, seq % SLOTS)
        book.release(2, seq, seq % SLOTS)
    return book


def test_a_frame_released_before_its_publication_is_free_as_it_is_published() -> None:
    book = ahead_book()
    ended = book.ended
    assert book.release(1, SLOTS, 0) is None  # frame 4, slot 0: not published yet
    assert book.ended == ended  # nothing ended yet
    assert book.publishing(0, SLOTS) == [1, 2]  # it is still sent (its metadata)
    assert book.leases(0) == [(2, SLOTS)]  # only the block subscriber holds it
    assert book.ended == ended + 1
    assert book.readers_to_wait(0) == [1]  # the next write orders after its read flag
    book.release(2, SLOTS, 0)
    assert book.is_free(0)


def test_every_frame_of_the_next_round_may_be_released_early_once() -> None:
    book = ahead_book()
    for seq in range(SLOTS, 2 * SLOTS):
        assert book.release(1, seq, seq % SLOTS) is None
    for seq in range(SLOTS, 2 * SLOTS):
        book.publishing(seq % SLOTS, seq)
        assert book.held_by(1) == {}
    assert book.outstanding(1) == 0 and book.outstanding(2) == SLOTS


@pytest.mark.parametrize(
    ("sub_id", "seq", "slot", "why"),
    [
        (2, SLOTS, 0, "does not hold"),  # a block subscriber predicts nothing
        (1, 2 * SLOTS, 0, "does not hold"),  # past the ring after the last published
        (1, SLOTS, 1, "schedule puts it in slot 0"),  # not the schedule's slot
        (1, SLOTS - 1, SLOTS - 1, "does not hold"),  # published and released already
        (1, SLOTS, SLOTS, "outside"),  # no such slot
    ],
)
def test_an_early_release_no_schedule_explains_is_refused(
    sub_id: int, seq: int, slot: int, why: str
) -> None:
    book = ahead_book()
    with pytest.raises(ProtocolError, match=why):
        book.release(sub_id, seq, slot)
    book.publishing(0, SLOTS)
    assert book.lease_count(0) == 2  # nothing was ended by it


def test_an_early_release_twice_or_before_any_frame_is_refused() -> None:
    book = ahead_book()
    book.release(1, SLOTS, 0)
    with pytest.raises(ProtocolError, match="twice"):
        book.release(1, SLOTS, 0)
    empty = LeaseBook(SLOTS)
    empty.add_subscriber(1, AHEAD, 1)
    with pytest.raises(ProtocolError, match="does not hold"):
        empty.release(1, 0, 0)  # nothing published: nothing to predict from


def test_an_early_release_off_the_schedules_generation_ends_at_the_read_flag() -> None:
    """The pool was used outside the publisher: the frame's generation is not the one the
    subscriber predicted, so its read flag says the wrong one until the message comes.
    The lease is kept (the producer waits on the host, not on its stream), ends at the
    rewritten flag, and no second RELEASE is due or accepted."""
    book = ahead_book()
    assert book.release(1, SLOTS, 0) is None
    assert book.publishing(0, SLOTS, on_schedule=False) == [1, 2]
    assert sorted(book.leases(0)) == [(1, SLOTS), (2, SLOTS)]  # kept
    ended = book.ended
    with pytest.raises(ProtocolError, match="twice"):
        book.release(1, SLOTS, 0)  # its one RELEASE came already
    assert book.settle(1, 0) is False  # the rewritten flag: ended, the block one holds
    assert book.ended == ended + 1
    assert book.releases_due == 0  # nothing more is due from it
    with pytest.raises(ProtocolError, match="does not hold"):
        book.release(1, SLOTS, 0)
    book.release(2, SLOTS, 0)
    assert book.is_free(0)


def test_off_the_schedule_a_release_after_publication_waits_for_the_read_flag() -> None:
    """The same frame off the schedule, its early RELEASE arriving after the frame was
    published (the race of every lock-step loop): the lease still ends only at the
    rewritten read flag, for an "ahead" subscriber, while a block one's ends at its RELEASE;
    a RELEASE after the flag is the one due, as usual."""
    book = ahead_book()
    assert book.publishing(0, SLOTS, on_schedule=False) == [1, 2]
    assert book.release(1, SLOTS, 0) is None  # no news: its flag may say the predicted one
    assert sorted(book.leases(0)) == [(1, SLOTS), (2, SLOTS)]
    assert book.release(2, SLOTS, 0) is False  # a block subscriber: its RELEASE ends it
    assert book.settle(1, 0) is True and book.releases_due == 0
    assert book.is_free(0)
    # the flag first, then the RELEASE: due once, as for any lease ended at its flag
    book.publishing(1, SLOTS + 1, on_schedule=False)
    book.release(2, SLOTS + 1, 1)
    assert book.settle(1, 1) is True and book.releases_due == 1
    assert book.release(1, SLOTS + 1, 1) is None and book.releases_due == 0


def test_a_subscriber_that_leaves_takes_its_early_releases_with_it() -> None:
    book = ahead_book()
    book.release(1, SLOTS, 0)
    book.remove_subscriber(1)
    assert book.publishing(0, SLOTS) == [2]
    assert book.leases(0) == [(2, SLOTS)]


# -- over real sockets: a consumer in another process -----------------------------------


def early_consumer(conn: Connection, address: str) -> None:
    """An ``"ahead"`` consumer: ``("frames", n)`` takes and releases ``n`` frames by
    message; ``("early", seq, slot)`` releases a frame before its message; ``("held",)``
    answers the frames its core holds."""
    core = SubscriberCore(address, mode="ahead", timeout=5.0)
    try:
        for fd in core.take_fds():
            os.close(fd)
        while True:
            cmd = conn.recv()
            try:
                if cmd[0] == "close":
                    break
                if cmd[0] == "frames":
                    seqs = []
                    for _ in range(cmd[1]):
                        frame = core.recv(10.0)
                        if frame.seq in core.held:
                            core.release(frame.seq, frame.slot)
                        seqs.append(frame.seq)
                    conn.send(("ok", seqs))
                elif cmd[0] == "early":
                    core.release_ahead(cmd[1], cmd[2])
                    conn.send(("ok", []))
                elif cmd[0] == "held":
                    conn.send(("ok", sorted(core.held)))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        core.close()


@pytest.fixture
def early(tmp_path: Any) -> Iterator[Callable[[], tuple[FlagProducer, Connection]]]:
    procs = ConsumerProcesses()

    def start() -> tuple[FlagProducer, Connection]:
        prod = FlagProducer(str(tmp_path / "early.sock"))
        return prod, procs.start(prod, early_consumer)[1]

    yield start
    procs.stop()


def _publish_next(prod: FlagProducer) -> tuple[int, int]:
    """Publish the next frame in the ring's next slot (the ahead schedule), waiting for it."""
    seq = prod.core.next_seq
    slot = seq % 2
    while prod.core.lease_book.lease_count(slot):
        prod.core.poll(1.0)
    prod.slots.write(slot, seq)
    prod.published[slot] = seq + 1
    assert prod.core.publish(slot) == seq
    return seq, slot


def test_a_release_sent_before_publication_ends_the_lease_as_it_is_published(
    early: Any,
) -> None:
    prod, consumer = early()
    for _ in range(2):
        _publish_next(prod)
    assert ask(consumer, "frames", 2) == [0, 1]
    ask(consumer, "early", 2, 0)  # frame 2 is not published yet
    while prod.core.lease_book.any_leased():
        prod.core.poll(1.0)  # the RELEASEs of frames 0 and 1, and frame 2's
    prod.core.poll(0.0)
    assert _publish_next(prod) == (2, 0)
    assert not prod.core.lease_book.any_leased()  # its lease ended as it was published
    assert prod.core.poll(0.0) == 1  # and a waiting producer hears of it at once
    assert ask(consumer, "frames", 1) == [2]  # the frame still comes, with its metadata
    assert ask(consumer, "held") == []  # and is not held (its RELEASE went already)
    assert len(prod.core.subscribers) == 1


@pytest.mark.parametrize(("seq", "slot"), [(9, 1), (2, 1)], ids=["past-the-ring", "wrong-slot"])
def test_an_early_release_the_schedule_does_not_explain_drops_the_sender(
    early: Any, seq: int, slot: int
) -> None:
    prod, consumer = early()
    for _ in range(2):
        _publish_next(prod)
    ask(consumer, "frames", 2)
    ask(consumer, "early", seq, slot)
    while prod.core.subscribers:
        assert prod.core.poll(5.0) >= 0
        if "protocol error" in prod.core.last_leave_reason:
            break
    assert prod.core.subscribers == []
    assert "protocol error" in prod.core.last_leave_reason
