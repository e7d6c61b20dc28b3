"""Leases that end at the subscriber's read flag, before its RELEASE message (``ahead=True``).

With ``Publisher(ahead=True)`` the producer's host takes a lease back as soon
as it sees the subscriber's read flag at the generation of the frame it was
sent (:meth:`LeaseBook.settle`), without waiting for the RELEASE message that
an ``"ahead"`` subscriber sends only at its next ``recv()``; that message, when
it comes, is no news.  Here the rule runs for real over the GPU-free stand-ins:
memfd slots (:mod:`tests._memfd_backend`), a memfd flag page
(:class:`SharedFlags`) that a consumer in another process writes from its host
(where a GPU stream would write it), and real sockets.  The consumer checks
every frame's bytes before it writes the flag, so a slot reused while its
lease was held fails the test.  The GPU path is in ``test_ahead_gpu.py``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from cupy_ipcpool._engine import SETTLE_RECHECK
from cupy_ipcpool._errors import LeaseStateError, ProtocolError
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._handshake import SubscriberInfo
from cupy_ipcpool.channel._leases import BLOCK, LeaseBook
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from cupy_ipcpool.channel._syncpage import FlagLayout, SharedFlags
from tests import _pipe_child
from tests._memfd_backend import MemfdSlots, pattern

SPAWN = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)


# -- the book ---------------------------------------------------------------------------


def book_with_frame(slot: int = 0, seq: int = 7) -> LeaseBook:
    book = LeaseBook(2)
    book.add_subscriber(1, BLOCK, 2)
    assert book.publishing(slot, seq) == [1]
    return book


def test_a_settled_lease_frees_the_slot_and_its_release_is_no_news_once() -> None:
    """The crossing: the flag is seen first, then the RELEASE that was in flight."""
    book = book_with_frame()
    assert book.settle(1, 0) is True
    assert book.is_free(0) and book.outstanding(1) == 0 and book.ended == 1
    assert book.readers_to_wait(0) == [1]  # the producer's stream still orders after the flag
    assert book.releases_due == 1
    assert book.release(1, 7, 0) is None  # the RELEASE that follows changes nothing
    assert book.releases_due == 0 and book.ended == 1
    assert book.is_free(0) and book.readers_to_wait(0) == [1]
    with pytest.raises(ProtocolError, match="does not hold"):
        book.release(1, 7, 0)  # a repeat of it is explained by no lease
    assert book.releases_due == 0 and book.subscribers() == [1]


def test_a_release_of_an_older_frame_leaves_the_newer_lease_of_the_slot() -> None:
    book = book_with_frame(0, 7)
    book.settle(1, 0)
    book.publishing(0, 9)
    assert book.release(1, 7, 0) is None
    assert book.lease_count(0) == 1 and book.held_by(1) == {9: 0}
    assert book.release(1, 9, 0) is True


def test_releases_that_were_never_settled_are_still_refused() -> None:
    book = book_with_frame(0, 7)
    book.settle(1, 0)
    with pytest.raises(ProtocolError, match="does not hold"):
        book.release(1, 8, 0)  # newer than anything settled there
    with pytest.raises(ProtocolError, match="was in slot 0"):
        book.release(1, 7, 1)  # the settled seq, named in another slot
    with pytest.raises(LeaseStateError):
        book.settle(1, 0)  # nothing held there now
    with pytest.raises(LeaseStateError):
        book.settle(2, 1)  # an unknown subscriber


def flag_set(sub_id: int, slot: int) -> bool:
    """Every holder's read flag says it released its frame."""
    return True


def two_settled_frames() -> LeaseBook:
    """Subscriber 1 was sent frames 7 (slot 0) and 8 (slot 1); both ended at their flags."""
    book = LeaseBook(2)
    book.add_subscriber(1, BLOCK, 2)
    book.publishing(0, 7)
    book.publishing(1, 8)
    assert book.settle_flagged(flag_set) == 2
    assert book.releases_due == 2
    return book


@pytest.mark.parametrize(
    ("seq", "slot", "match"),
    [
        (0, 0, "does not hold"),  # a seq never sent to it (below the settled ones)
        (3, 1, "does not hold"),  # a seq never sent to it, in another slot
        (7, 1, "was in slot 0"),  # a settled seq, named in the other settled slot
        (8, 0, "was in slot 1"),
        (7, 2, "outside 0..1"),  # a slot out of range
        (7, 1 << 31, "outside 0..1"),
    ],
)
def test_a_release_no_lease_explains_is_refused_and_changes_nothing(
    seq: int, slot: int, match: str
) -> None:
    book = two_settled_frames()
    with pytest.raises(ProtocolError, match=match):
        book.release(1, seq, slot)
    assert book.releases_due == 2  # the two RELEASEs due are still due
    assert book.release(1, 7, 0) is None and book.release(1, 8, 1) is None
    assert book.releases_due == 0


def test_each_settled_lease_explains_one_release_only() -> None:
    book = two_settled_frames()
    assert book.release(1, 8, 1) is None
    with pytest.raises(ProtocolError, match="does not hold"):
        book.release(1, 8, 1)  # its settled RELEASE came already
    assert book.releases_due == 1
    book.publishing(1, 9)
    book.settle(1, 1)
    with pytest.raises(ProtocolError, match="does not hold"):
        book.release(1, 8, 1)  # still refused once a newer lease of its slot settled
    assert book.release(1, 9, 1) is None and book.release(1, 7, 0) is None
    assert book.releases_due == 0
    for seq, slot in ((7, 0), (9, 1)):
        with pytest.raises(ProtocolError, match="does not hold"):
            book.release(1, seq, slot)


def test_a_release_before_the_flag_ends_the_lease_and_leaves_nothing_due() -> None:
    book = book_with_frame(0, 7)
    assert book.release(1, 7, 0) is True  # the message came first: a plain release
    assert book.settle_flagged(flag_set) == 0  # the flag: nothing to settle
    assert book.releases_due == 0 and book.ended == 1 and book.is_free(0)
    book.publishing(0, 9)
    assert book.settle_flagged(flag_set) == 1
    with pytest.raises(ProtocolError, match="does not hold"):
        book.release(1, 7, 0)  # frame 7's RELEASE came already: not no news for frame 9's
    assert book.releases_due == 1
    assert book.release(1, 9, 0) is None and book.releases_due == 0


def test_removing_a_subscriber_takes_its_due_releases_out_of_the_count() -> None:
    book = LeaseBook(3)
    for sub_id in (1, 2):
        book.add_subscriber(sub_id, BLOCK, 3)
    book.publishing(0, 7)
    book.publishing(1, 8)
    book.publishing(2, 9)
    for slot in (0, 1):
        book.settle(1, slot)
    book.settle(2, 0)
    assert book.releases_due == 3
    assert book.release(1, 7, 0) is None  # one of subscriber 1's came
    with pytest.raises(ProtocolError):
        book.release(1, 7, 0)  # a repeat: the caller drops subscriber 1
    assert book.releases_due == 2
    assert book.remove_subscriber(1) == []  # slot 2 is still leased by subscriber 2
    assert book.releases_due == 1  # subscriber 2's frame 7: still due
    assert book.release(2, 7, 0) is None and book.releases_due == 0
    assert book.release(2, 8, 1) is True and book.release(2, 9, 2) is True
    assert book.free_slots() == [0, 1, 2] and book.releases_due == 0


def test_a_subscriber_that_sends_no_release_is_bounded_and_then_waited_for() -> None:
    """Read flags without RELEASEs: at most ``4 * num_slots`` stay due, then its leases
    end only by message, as in block mode; it is not dropped, and once RELEASEs come
    its flags count again."""
    book = LeaseBook(2)
    book.add_subscriber(1, BLOCK, 2)
    bound = 4 * book.num_slots
    seq = 0
    while (slot := book.pick_free_slot(seq)) is not None:
        assert seq < 100, "settle never stopped"
        book.publishing(slot, seq)
        seq += 1
        book.settle_flagged(flag_set)
    assert book.releases_due == bound and book.max_due == bound
    assert seq == bound + 2  # then both slots stay leased: their flags no longer end them
    assert book.held_by(1) == {bound: 0, bound + 1: 1}
    assert book.settle(1, 0) is None and book.lease_count(0) == 1
    assert book.release(1, bound, 0) is True  # a lease still ends by its RELEASE
    assert book.release(1, 0, 0) is None  # one due RELEASE came: room for one flag again
    assert book.settle_flagged(flag_set) == 1 and book.held_by(1) == {}
    assert book.releases_due == bound
    assert book.remove_subscriber(1) == [] and book.releases_due == 0


def test_settle_flagged_asks_only_about_holders_and_counts_what_it_ended() -> None:
    book = LeaseBook(3)
    for sub_id in (1, 2):
        book.add_subscriber(sub_id, BLOCK, 3)
    book.publishing(0, 1)
    book.publishing(2, 2)
    asked: list[tuple[int, int]] = []

    def reached(sub_id: int, slot: int) -> bool:
        asked.append((sub_id, slot))
        return sub_id == 2

    assert book.settle_flagged(reached) == 2
    assert sorted(asked) == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert book.leases(0) == [(1, 1)] and book.leases(2) == [(1, 2)]
    asked.clear()
    assert book.settle_flagged(lambda s, slot: True, 2) == 1
    assert book.leases(2) == [] and book.leases(0) == [(1, 1)]
    assert book.remove_subscriber(1) == [0]


# -- a producer, a consumer in another process, a flag page -----------------------------

LAYOUT = FlagLayout(2, 1)


class FlagProducer:
    """A :class:`PublisherCore` over memfd slots whose leases also end at the read flag.

    The flag page goes to the consumer with the slots' fds; each frame's
    generation is its seq + 1 (a new one for every use of a slot; the page starts at 0,
    as the pool's generations start at 1), and the
    look at the flags is the engine's (:meth:`PublisherCore.settle`, reading the page
    as ``Publisher`` has it read).
    """

    def __init__(self, address: str) -> None:
        self.flags = SharedFlags.create(LAYOUT.nbytes)
        self.published = [0, 0]
        self.slots = MemfdSlots(2)
        self.core = PublisherCore(
            address, 2, welcome=self.slots.welcome(self.flags.fd), on_join=self._join
        )
        self.core.read_flags(self.flags.mapping, LAYOUT.reads_offset, 1)

    def _join(self, info: SubscriberInfo) -> None:
        self.core.set_row(info.sub_id, 0)  # every consumer here writes row 0

    def wait_subscribers(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.core.subscribers) < n:
            assert time.monotonic() < deadline, "the consumer did not join"
            self.core.poll(0.01)

    def publish_flagged(self) -> tuple[int, int]:
        """Publish the next frame (waiting for its slot by messages and flags)."""
        deadline = time.monotonic() + 10
        while True:
            slot = self.core.lease_book.pick_free_slot(0)
            if slot is not None:
                break
            assert time.monotonic() < deadline, "no slot came free"
            self.core.poll(1.0, True)
        seq = self.core.next_seq
        self.slots.write(slot, seq)
        self.published[slot] = seq + 1
        assert self.core.publish(slot, generation=seq + 1) == seq
        return seq, slot

    def publish_without_waiting(self) -> tuple[int, int]:
        """Publish the next frame in a slot the flags say is free, reading no message.

        What ``Publisher.acquire`` does when its look at the flags finds the slot
        free (``_PublisherLeases.leases``): no poll of the sockets.
        """
        self.core.settle()
        slot = self.core.lease_book.pick_free_slot(0)
        assert slot is not None, "the flags freed no slot"
        seq = self.core.next_seq
        self.slots.write(slot, seq)
        self.published[slot] = seq + 1
        assert self.core.publish(slot, generation=seq + 1) == seq
        return seq, slot

    def close(self) -> None:
        self.core.close()
        self.slots.close()
        self.flags.close()


def flag_consumer(conn: Connection, address: str, release_after: int) -> None:
    """Check each frame, write its read flag, send its RELEASE ``release_after`` frames late.

    Commands from the test: ``("frames", n)`` takes ``n`` frames; ``("flush",)``
    sends the RELEASEs still due; ``("raw", seq, slot)`` sends a RELEASE of
    ``(seq, slot)`` whatever it holds (a hostile one); ``("close",)`` ends.
    Answers ``("ok", seqs)`` or ``("error", text)``.
    """
    # a RELEASE that finds the socket full waits this long, then raises (reported)
    core = SubscriberCore(address, mode="block", timeout=5.0)
    due: list[tuple[int, int]] = []
    try:
        (size,) = struct.unpack("<Q", core.welcome_payload)
        fds = core.take_fds()
        slots = [mmap.mmap(fd, size, prot=mmap.PROT_READ) for fd in fds[:-1]]
        flags = SharedFlags.open(fds[-1], LAYOUT.nbytes)
        for fd in fds:
            os.close(fd)
        while True:
            cmd = conn.recv()
            try:
                if cmd[0] == "close":
                    break
                if cmd[0] == "flush":
                    for seq, slot in due:
                        core._sock.send(proto.encode_release(seq, slot))
                    due.clear()
                    conn.send(("ok", []))
                    continue
                if cmd[0] == "raw":
                    core._sock.send(proto.encode_release(cmd[1], cmd[2]))
                    conn.send(("ok", []))
                    continue
                seqs = []
                for _ in range(cmd[1]):
                    frame = core.recv(10.0)
                    for when in ("at receipt", "at release"):
                        if slots[frame.slot][:] != pattern(frame.seq, size):
                            raise AssertionError(f"frame {frame.seq} overwritten {when}")
                    flags.store(LAYOUT.read_offset(0, frame.slot), frame.seq + 1)
                    # the flag ends the lease (ahead=True): the core holds the frame no
                    # more, so the slot's next frame is no protocol error
                    # (docs/protocol.md, "What a subscriber refuses"); its RELEASE trails
                    core._ledger.release(frame.seq, frame.slot)
                    due.append((frame.seq, frame.slot))
                    while len(due) > release_after:
                        core._sock.send(proto.encode_release(*due.pop(0)))
                    seqs.append(frame.seq)
                conn.send(("ok", seqs))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        core.close()


class ConsumerProcesses:
    """Producers, each with a consumer process joined to it by a pipe; :meth:`stop` ends
    them all (the consumer told ``stop_message``, then killed if it lingers)."""

    def __init__(self) -> None:
        self.started: list[tuple[FlagProducer, Any, Connection]] = []

    def start(
        self, prod: FlagProducer, target: Callable[..., None], *args: Any
    ) -> tuple[Any, Connection]:
        """Start ``target(conn, prod's address, *args)`` and wait until it joined."""
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=target, args=(child, prod.core.address, *args))
        proc.start()
        self.started.append((prod, proc, parent))
        prod.wait_subscribers(1)
        return proc, parent

    def stop(self, stop_message: tuple[str] = ("close",)) -> None:
        for prod, proc, parent in self.started:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    parent.send(stop_message)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
            prod.close()


@pytest.fixture
def pair(tmp_path: Any) -> Iterator[Callable[[int], tuple[FlagProducer, Connection]]]:
    procs = ConsumerProcesses()

    def start(release_after: int) -> tuple[FlagProducer, Connection]:
        prod = FlagProducer(str(tmp_path / "flags.sock"))
        return prod, procs.start(prod, flag_consumer, release_after)[1]

    yield start
    procs.stop()


def ask(conn: Connection, *cmd: Any) -> list[int]:
    conn.send(cmd)
    assert conn.poll(20), "the consumer did not answer"
    status, value = conn.recv()
    assert status == "ok", value
    return value


def test_the_producer_runs_on_read_flags_while_releases_come_late(pair: Any) -> None:
    prod, consumer = pair(release_after=3)  # RELEASE messages trail the flags by 3 frames
    frames = 200
    seqs = []
    for _ in range(frames):
        prod.publish_flagged()
        seqs.extend(ask(consumer, "frames", 1))  # the consumer checked it and wrote its flag
    assert seqs == list(range(frames))
    ask(consumer, "flush")
    deadline = time.monotonic() + 10
    while prod.core.lease_book.any_leased() or prod.core.poll(0.0, True):
        assert time.monotonic() < deadline
        prod.core.poll(0.1, True)
    # the late RELEASE of every frame settled by its flag was no news: the subscriber
    # stayed, and no lease is left
    assert len(prod.core.subscribers) == 1
    assert not prod.core.lease_book.any_leased()


def test_a_flag_of_an_earlier_frame_does_not_end_a_lease(pair: Any) -> None:
    prod, consumer = pair(release_after=99)  # no RELEASE message at all
    prod.publish_flagged()
    prod.publish_flagged()  # both slots leased
    ask(consumer, "frames", 2)  # flags at frames 0 and 1
    assert prod.core.poll(0.0, True) == 2
    seq, slot = prod.publish_flagged()
    assert (seq, slot) == (2, 0)
    # slot 0's flag still holds frame 0's generation, which is not frame 2's
    assert prod.core.poll(0.0, True) == 0
    assert prod.core.lease_book.leases(0) == [(prod.core.subscribers[0].sub_id, 2)]


def test_a_waiting_poll_sees_a_flag_set_later_and_does_not_spin(pair: Any) -> None:
    prod, consumer = pair(release_after=99)
    prod.publish_flagged()
    # nothing sets the flag: the poll sleeps its timeout out, looking at the flags
    # between growing steps (not once per message, not in a busy loop)
    looks = prod.core._session.flag_looks
    wait = 0.3
    assert prod.core.poll(wait, True) == 0
    first, longest, growth = SETTLE_RECHECK
    steps, step, slept = 0, first, 0.0
    while slept < wait:
        slept, steps, step = slept + step, steps + 1, min(step * growth, longest)
    # the look before waiting, and the last one
    assert prod.core._session.flag_looks - looks <= steps + 2
    # the flag set while the producer waits (no message comes) ends its wait
    consumer.send(("frames", 1))
    assert prod.core.poll(10.0, True) == 1
    assert consumer.poll(10) and consumer.recv() == ("ok", [0])


def test_a_producer_that_never_waits_still_reads_the_due_releases(pair: Any) -> None:
    """Every slot is freed by its flag, so the producer never needs a message; the
    RELEASE messages still come, one per frame, and are read once a ring: the
    consumer's socket never fills (a full one would stall its release, then raise)."""
    prod, consumer = pair(release_after=0)  # a RELEASE right after each flag
    frames = 3000
    for _ in range(frames):
        prod.publish_without_waiting()
        ask(consumer, "frames", 1)
    book = prod.core.lease_book
    assert book.releases_due <= 2 * book.num_slots
    assert len(prod.core.subscribers) == 1


def test_a_lease_a_look_at_the_flags_ended_is_reported_by_the_next_poll(pair: Any) -> None:
    """A lease that ended outside ``poll`` -- at a look at the flags, as the pool's
    lease count does inside ``frame()`` and ``publish()`` -- is reported by the next
    poll, at once: a producer that polls until its frame's lease came back must not
    wait for a message (the late RELEASE of that lease is no news)."""
    prod, consumer = pair(release_after=99)  # no RELEASE message: only the flag
    prod.publish_flagged()
    ask(consumer, "frames", 1)  # the consumer checked frame 0 and set its flag
    assert prod.core.settle() == 1  # not a poll
    assert prod.core.poll(10.0, True) == 1  # reported, without waiting
    assert prod.core.poll(0.0, True) == 0  # and once only


def test_a_release_another_call_read_is_reported_by_the_next_poll(pair: Any) -> None:
    """A RELEASE that ``acquire`` read from the socket (or ``publish``, reading the
    due ones) ended its lease there; the next poll reports it and does not wait."""
    prod, consumer = pair(release_after=0)  # a RELEASE right after each frame
    prod.publish_flagged()
    ask(consumer, "frames", 1)  # its RELEASE is in the producer's socket now
    slot, _ = prod.core.acquire(0.0)  # reads it: frame 0's lease ends here
    assert not prod.core.lease_book.any_leased()
    assert prod.core.poll(10.0) == 1
    assert prod.core.poll(0.0) == 0
    assert slot in (0, 1)


def test_a_release_that_crossed_its_flag_is_kept_and_a_repeat_of_it_drops_the_sender(
    pair: Any,
) -> None:
    """Over real sockets: the flag seen first, then the RELEASE that was in flight, is
    no news (the subscriber stays); the same RELEASE once more costs the connection."""
    prod, consumer = pair(release_after=0)  # a RELEASE right after each flag
    seq, slot = prod.publish_flagged()
    ask(consumer, "frames", 1)  # flag written, RELEASE sent, neither seen yet
    book = prod.core.lease_book
    assert prod.core.settle() == 1  # the flag first: the crossing
    assert book.releases_due == 1
    prod.core.poll(0.0)  # reads the RELEASE: no news
    assert len(prod.core.subscribers) == 1 and book.releases_due == 0
    assert book.is_free(slot)
    ask(consumer, "raw", seq, slot)  # the same RELEASE again
    deadline = time.monotonic() + 10
    while prod.core.subscribers:
        assert time.monotonic() < deadline, "a repeated RELEASE was accepted"
        prod.core.poll(0.05)
    assert "protocol error" in prod.core.last_leave_reason
    assert "does not hold" in prod.core.last_leave_reason
    assert book.releases_due == 0


def test_flags_without_releases_end_leases_up_to_the_bound_then_messages_do(
    pair: Any,
) -> None:
    """Over real sockets: a subscriber that writes its read flags and holds its RELEASEs
    back frees slots by flag for ``4 * num_slots`` frames; then the producer waits for
    its messages (it is not dropped), and once they come every one is accepted."""
    prod, consumer = pair(release_after=99)  # no RELEASE until "flush"
    book = prod.core.lease_book
    bound = 4 * book.num_slots
    for _ in range(bound + 2):
        prod.publish_without_waiting()  # its slot freed by a flag, no message read
        ask(consumer, "frames", 1)
    assert prod.core.settle() == 0  # both flags set, neither ends a lease
    assert book.pick_free_slot(0) is None and book.releases_due == bound
    prod.core.poll(0.0)  # reports the leases the flags ended so far
    assert prod.core.poll(0.2, True) == 0  # the producer waits for messages
    ask(consumer, "flush")  # all bound + 2 RELEASEs: bound of them due, 2 ending leases
    deadline = time.monotonic() + 10
    while book.any_leased() or book.releases_due:
        assert time.monotonic() < deadline, "the RELEASEs did not end the leases"
        prod.core.poll(0.1)
    assert len(prod.core.subscribers) == 1
    prod.publish_without_waiting()  # flags count again
    assert ask(consumer, "frames", 1) == [bound + 2]
