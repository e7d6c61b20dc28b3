"""The order an ``"ahead"`` subscriber hands frames out in, and how its stream ends; CPU only.

:class:`AheadInbox` (``channel/_ahead.py``) takes the FRAME messages of a real
:class:`SubscriberCore` over a real socket from a real :class:`PublisherCore`
(its slots memfds, ``tests/_memfd_backend.py``): each message confirms the
oldest frame handed out ahead, or, with none outstanding, is handed out
itself.  What a user relies on: every frame published before the BYE is
handed out, once, in order; the frames handed out ahead past the last one
published are still outstanding at the end (so ``_settle.settle_unpublished``
ends their waits); a frame predicted may be released before its message comes
(``SubscriberCore.release_ahead``), and its message then needs no RELEASE.  The
GPU tier is ``tests/test_ahead_gpu.py``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from cupy_ipcpool._errors import ChannelTimeoutError, EndOfStream
from cupy_ipcpool.channel._ahead import AheadInbox, AheadSchedule, Predicted
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from tests._memfd_backend import MemfdProducer
from tests.test_ahead_cpu import frame, gen_of

SLOTS = 4


class Consumer:
    """A core in ``"ahead"`` mode and an inbox over it; releases as the GPU subscriber does."""

    def __init__(self, address: str, depth: int = SLOTS) -> None:
        self.core = SubscriberCore(address, mode="ahead", timeout=10)
        for fd in self.core.take_fds():  # the memfds: not mapped here, the order is the test
            os.close(fd)
        self.inbox = AheadInbox(AheadSchedule(SLOTS, depth), self._message, self._confirmed)
        #: per frame handed out: (seq, "message" or "ahead"); the seqs confirmed, in order
        self.handed_out: list[tuple[int, str]] = []
        self.confirmed: list[int] = []

    def _message(self, timeout: float | None) -> tuple[int, int, bytes | memoryview] | None:
        return self.core.next_view(timeout)

    def _confirmed(self, entry: Predicted) -> None:
        self.confirmed.append(entry.seq)  # its RELEASE went when it was handed out

    def next(self, timeout: float = 10.0) -> None:
        """Hand out the next frame and release it at once (a fast consumer)."""
        got = self.inbox.next(timeout)
        if isinstance(got, Predicted):
            self.handed_out.append((got.seq, "ahead"))
            self.core.release_ahead(got.seq, got.slot)  # before its message: at once
        else:
            seq, slot, _payload = got
            self.handed_out.append((seq, "message"))
            self.core.release(seq, slot)

    def until_the_end(self) -> EndOfStream:
        with pytest.raises(EndOfStream) as end:
            while True:
                self.next()
        return end.value

    def close(self) -> None:
        self.core.close()


def publish(producer: MemfdProducer, count: int) -> None:
    """Frames ``next_seq .. + count - 1`` in the round-robin schedule of ``ahead=True``."""
    for _ in range(count):
        slot, _readers = producer.core.acquire(10.0)
        seq = producer.core.next_seq
        assert slot == seq % SLOTS
        producer.slots.write(slot, seq)
        producer.core.publish(slot, frame(slot, gen_of(slot) + seq // SLOTS, metadata=b"m%d" % seq))


def publish_and_close(producer: MemfdProducer, count: int) -> None:
    """:func:`publish` ``count`` frames, then the BYE."""
    publish(producer, count)
    producer.core.close()


@pytest.fixture
def channel(tmp_path) -> Iterator[tuple[MemfdProducer, Consumer]]:
    producer = MemfdProducer(str(tmp_path / "ahead.sock"), SLOTS)
    consumer = None
    try:
        consumer = Consumer(producer.core.address)
        producer.wait_subscribers(1)
        yield producer, consumer
    finally:
        if consumer is not None:
            consumer.close()
        producer.close()


def check_the_end(consumer: Consumer, end: EndOfStream, published: int) -> None:
    """Every frame published handed out once, in order; the rest ahead and outstanding."""
    assert end.clean
    seqs = [seq for seq, _how in consumer.handed_out]
    assert seqs == list(range(len(seqs)))
    assert len(seqs) >= published
    beyond = consumer.handed_out[published:]
    assert all(how == "ahead" for _seq, how in beyond)
    outstanding = [entry.seq for entry in consumer.inbox.schedule.outstanding]
    assert outstanding == [seq for seq, _how in beyond]
    ahead_published = [seq for seq, how in consumer.handed_out[:published] if how == "ahead"]
    assert consumer.confirmed == ahead_published


def test_frames_queued_before_the_bye_are_handed_out_before_the_end(channel) -> None:
    """Messages and the BYE all waiting when ``next`` runs: the frames come first."""
    producer, consumer = channel
    publish(producer, SLOTS)
    for _ in range(SLOTS):
        consumer.next()  # by message, released at once
    publish(producer, SLOTS)  # the next round, into the slots just released
    producer.core.close()  # BYE behind them
    end = consumer.until_the_end()
    check_the_end(consumer, end, 2 * SLOTS)
    assert consumer.handed_out[SLOTS:] == [(s, "message") for s in range(SLOTS, 2 * SLOTS)]


def test_confirmations_and_then_frames_queued_before_the_bye(channel) -> None:
    """Frames out ahead, then their messages, more frames and the BYE at once: the
    messages confirm what is out, the frames after are handed out, then the end."""
    producer, consumer = channel
    publish(producer, SLOTS)
    for _ in range(2 * SLOTS):
        consumer.next()  # 0..3 by message, 4..7 ahead (their RELEASE deferred)
    assert [how for _s, how in consumer.handed_out[SLOTS:]] == ["ahead"] * SLOTS
    with pytest.raises(ChannelTimeoutError):
        consumer.next(timeout=0.2)  # depth frames out ahead and no message: nothing to hand out
    assert consumer.confirmed == []
    # 4..7 into the slots of 0..3; 8.. need the RELEASEs of 4..7, sent when their messages
    # confirm them; then the BYE
    thread = threading.Thread(target=publish_and_close, args=(producer, SLOTS + 3))
    thread.start()
    try:
        end = consumer.until_the_end()
    finally:
        thread.join(10)
    assert consumer.confirmed[:SLOTS] == list(range(SLOTS, 2 * SLOTS))
    check_the_end(consumer, end, 2 * SLOTS + 3)


@pytest.mark.parametrize("depth", [1, 2, SLOTS])
@pytest.mark.parametrize("count", [1, SLOTS - 1, SLOTS, 3 * SLOTS + 1, 200])
def test_a_producer_running_free_then_closing(tmp_path, depth: int, count: int) -> None:
    """Producer and consumer run side by side and the producer closes at any point of
    the schedule: every frame published is handed out, in order, then the end."""
    with MemfdProducer(str(tmp_path / "free.sock"), SLOTS) as producer:
        consumer = Consumer(producer.core.address, depth)
        try:
            producer.wait_subscribers(1)
            thread = threading.Thread(target=publish_and_close, args=(producer, count))
            thread.start()
            try:
                end = consumer.until_the_end()
            finally:
                thread.join(10)
            check_the_end(consumer, end, count)
            assert len(consumer.inbox.schedule.outstanding) <= depth
        finally:
            consumer.close()


def test_an_unclean_end_hands_out_nothing_more() -> None:
    """After the producer died or evicted us, frames whose messages were taken are not
    handed out (their flags may never be set, as in "block" mode) and the end is raised."""
    script: list[object] = [
        (0, 0, frame(0, gen_of(0))),
        EndOfStream("the publisher died", False),
    ]

    def message(timeout: float | None) -> tuple[int, int, bytes]:
        item = script[0] if len(script) == 1 else script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[return-value]

    inbox = AheadInbox(AheadSchedule(SLOTS, SLOTS), message, lambda entry: None)
    with pytest.raises(EndOfStream) as end:
        inbox.next(1.0)
    assert not end.value.clean


def test_a_lock_step_frame_costs_one_look_and_one_wait() -> None:
    """Depth 1, the frame out ahead not confirmed yet: handing out the next one looks
    once (nothing there), waits once for the confirming message, and hands out at once,
    without a further look that would find nothing (each look is a receive)."""
    script: list[tuple[int, int, bytes] | None] = [
        *((seq, seq, frame(seq, gen_of(seq))) for seq in range(SLOTS)),
        None,  # the drain after those: nothing more
    ]
    asked: list[float | None] = []

    def message(timeout: float | None) -> tuple[int, int, bytes] | None:
        asked.append(timeout)
        return script.pop(0) if script else None

    inbox = AheadInbox(AheadSchedule(SLOTS, 1), message, lambda entry: None)
    for seq in range(SLOTS):  # by message: the slots' layouts are known from here on
        assert inbox.next(1.0)[0] == seq  # type: ignore[index]
    ahead = inbox.next(1.0)
    assert isinstance(ahead, Predicted) and ahead.seq == SLOTS
    # the next frame: its look finds nothing, its wait gets the confirmation of frame SLOTS
    script[:] = [None, (SLOTS, 0, frame(0, gen_of(0) + 1))]
    asked.clear()
    after = inbox.next(5.0)
    assert isinstance(after, Predicted) and after.seq == SLOTS + 1
    assert len(asked) == 2 and asked[0] == 0.0 and asked[1] is not None and asked[1] > 0.0
    assert script == []
    assert list(inbox.schedule.outstanding) == [after]


def test_a_look_that_finds_nothing_answers_none(channel) -> None:
    """``next_view(0)`` on a subscriber with nothing queued answers None (no exception);
    ``recv_view`` says the same as a :class:`ChannelTimeoutError`."""
    producer, consumer = channel
    assert consumer.core.next_view(0.0) is None
    with pytest.raises(ChannelTimeoutError):
        consumer.core.recv_view(0.05)
    publish(producer, 1)
    got = consumer.core.next_view(5.0)
    assert got is not None and got[:2] == (0, 0)
