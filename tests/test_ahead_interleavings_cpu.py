"""An ``"ahead"`` subscriber's leases under every order of events the GPU and the sockets allow.

A seeded simulation drives the publisher's real :class:`LeaseBook` with an
honest ``"ahead"`` subscriber, in the order a random schedule picks among the
events possible at each step:

* the publisher publishes the next frame once its slot has no lease, and
  sometimes after the pool took that slot outside it (the generation grows by
  two: off the schedule, as ``pool.acquire()`` beside a publisher does); its
  stream first waits for the read flags the book names
  (:meth:`LeaseBook.readers_to_wait`), then sets the frame flag;
* it reads the next RELEASE from the socket, or ends a lease whose read flag
  it sees at the frame's generation (:meth:`LeaseBook.settle`);
* the subscriber hands the next frame out ahead (predicted from its slot's
  last frame received by message: the next generation; once the consumer
  released that frame, below) or takes the next
  FRAME message (confirming the oldest frame handed out ahead, or handing one
  out from it), and releases its oldest frame: before its message, the
  predicted generation goes to the read flag and the RELEASE at once, and the
  message, when it names a later generation, rewrites the flag (as
  ``channel/_subscriber.py`` does);
* either stream runs its next operation, in the order they were queued: the
  subscriber's waits for frame flags and read-flag writes, the producer's
  waits for read flags and frame-flag writes.

Whatever the order, the book never refuses the subscriber, neither the
publisher nor a stream waits forever, and at the end every lease has ended
and no RELEASE is still due.

Frame *k + n* (the slot's next use) is handed out ahead only once frame *k*
is released (:meth:`AheadSchedule.predict`'s rule): a consumer that still
held *k*, and released it on the stream waiting for *k + n*, would deadlock
the two streams (its read flag for *k* queued behind the wait for *k + n*,
which the producer writes only after that read flag).  Without that rule
this simulation ends with both streams waiting.

protocol.md's ahead section states these rules.  On a GPU, the same
situation is ``test_ahead_gpu.py``'s
``test_a_slot_taken_from_the_pool_beside_an_ahead_publisher``.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import pytest

from cupy_ipcpool.channel._leases import AHEAD, LeaseBook

SLOTS = 4
DEPTH = 4
SUB = 1


@dataclass
class Handed:
    """A frame the subscriber handed out."""

    seq: int
    slot: int
    generation: int  # predicted, until its message confirms it
    confirmed: bool
    released: bool = False


class Simulation:
    def __init__(self, seed: int, frames: int, off_schedule: float) -> None:
        self.rng = random.Random(seed)
        self.frames = frames
        self.off_schedule = off_schedule
        self.book = LeaseBook(SLOTS)
        self.book.add_subscriber(SUB, AHEAD, SLOTS)
        # the publisher
        self.generation = [0] * SLOTS  # of the frame last written in each slot
        self.frame_gen: dict[int, int] = {}  # seq -> its true generation
        self.next_seq = 0
        self.releases: deque[tuple[int, int]] = deque()  # RELEASEs on the socket
        # the subscriber
        self.messages: deque[tuple[int, int, int]] = deque()  # FRAME messages on the socket
        self.handed: dict[int, Handed] = {}
        self.outstanding: deque[int] = deque()  # handed out ahead, not confirmed, in order
        self.by_message: dict[int, tuple[int, int]] = {}  # slot -> (seq, generation)
        self.next_hand = 0
        self.next_release = 0
        self.stream: deque[tuple[str, int, int]] = deque()  # ("wait", seq, 0) / ("write", slot, g)
        self.read_flag = [0] * SLOTS  # what the publisher sees
        # the producer's stream: ("read", slot, generation) waits, ("frame", seq, 0) writes
        self.producer: deque[tuple[str, int, int]] = deque()
        self.frames_set = 0  # frame flags set, in seq order

    # -- the events ------------------------------------------------------------------------

    def events(self) -> list[str]:
        can = []
        if self.next_seq < self.frames and self.book.lease_count(self.next_seq % SLOTS) == 0:
            can.append("publish")
        if self.releases:
            can.append("release_msg")
        if self._settleable():
            can.append("settle")
        if self._predictable():
            can.append("hand_ahead")
        if self.messages:
            can.append("take_message")
        if self.next_release < self.next_hand:
            can.append("release")
        if self.stream and self._stream_can_run():
            can.append("stream")
        if self.producer and self._producer_can_run():
            can.append("producer_step")
        return can

    def publish(self) -> None:
        seq, slot = self.next_seq, self.next_seq % SLOTS
        on_schedule = not (seq >= SLOTS and self.rng.random() < self.off_schedule)
        if SUB in self.book.readers_to_wait(slot):  # its write orders after the read flag
            self.producer.append(("read", slot, self.generation[slot]))
        self.generation[slot] += 1 if on_schedule else 2
        self.frame_gen[seq] = self.generation[slot]
        self.producer.append(("frame", seq, 0))
        receivers = self.book.publishing(slot, seq, 0.0, on_schedule=on_schedule)
        assert receivers == [SUB]
        self.messages.append((seq, slot, self.generation[slot]))
        self.next_seq += 1

    def release_msg(self) -> None:
        seq, slot = self.releases.popleft()
        self.book.release(SUB, seq, slot)

    def _settleable(self) -> list[int]:
        out = []
        for slot in range(SLOTS):
            for sub_id, seq in self.book.leases(slot):
                if sub_id == SUB and self.read_flag[slot] >= self.frame_gen[seq]:
                    out.append(slot)
        return out

    def settle(self) -> None:
        self.book.settle(SUB, self.rng.choice(self._settleable()))

    def _predictable(self) -> bool:
        seq = self.next_hand
        if seq >= self.frames or len(self.outstanding) >= DEPTH:
            return False
        last = self.by_message.get(seq % SLOTS)
        if last is None or last[0] != seq - SLOTS:
            return False
        # AheadSchedule.predict's rule: the slot's previous frame was released
        return self.handed[seq - SLOTS].released

    def hand_ahead(self) -> None:
        seq, slot = self.next_hand, self.next_hand % SLOTS
        generation = self.by_message[slot][1] + 1
        self.handed[seq] = Handed(seq, slot, generation, confirmed=False)
        self.outstanding.append(seq)
        self.stream.append(("wait", seq, 0))  # its reads wait for the frame flag
        self.next_hand += 1

    def take_message(self) -> None:
        seq, slot, generation = self.messages.popleft()
        if self.outstanding:
            assert self.outstanding[0] == seq  # the schedule holds
            self.outstanding.popleft()
            frame = self.handed[seq]
            assert generation >= frame.generation
            if generation != frame.generation and frame.released:
                self.stream.append(("write", slot, generation))  # the flag must say this one
            frame.generation, frame.confirmed = generation, True
        else:
            assert seq == self.next_hand
            self.handed[seq] = Handed(seq, slot, generation, confirmed=True)
            self.next_hand += 1
        self.by_message[slot] = (seq, generation)

    def release(self) -> None:
        frame = self.handed[self.next_release]
        frame.released = True
        self.stream.append(("write", frame.slot, frame.generation))
        self.releases.append((frame.seq, frame.slot))
        self.next_release += 1

    def _stream_can_run(self) -> bool:
        op, seq, _ = self.stream[0]
        return op == "write" or seq < self.frames_set

    def stream_step(self) -> None:
        op, a, b = self.stream.popleft()
        if op == "write":
            self.read_flag[a] = b

    def _producer_can_run(self) -> bool:
        op, slot, generation = self.producer[0]
        return op == "frame" or self.read_flag[slot] >= generation

    def producer_step(self) -> None:
        op, seq, _ = self.producer.popleft()
        if op == "frame":
            assert seq == self.frames_set
            self.frames_set += 1

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        steps = 0
        while True:
            can = self.events()
            if not can:
                break
            event = self.rng.choice(can)
            getattr(self, "stream_step" if event == "stream" else event)()
            steps += 1
            assert steps < 100 * self.frames, "no end"
        state = (
            f"published {self.next_seq}/{self.frames}, leases "
            f"{[self.book.leases(s) for s in range(SLOTS)]}, handed {self.next_hand}, "
            f"released {self.next_release}, flags {self.read_flag}, gens {self.generation}"
        )
        assert self.next_seq == self.frames, f"the publisher waits forever: {state}"
        assert not self.producer and not self.stream, f"a stream waits forever: {state}"
        assert self.next_release == self.frames, state
        assert all(self.book.lease_count(s) == 0 for s in range(SLOTS)), state
        assert self.book.releases_due == 0, state
        assert self.book.held_by(SUB) == {}, state


@pytest.mark.parametrize("off_schedule", [0.0, 0.25, 1.0])
def test_every_order_of_events_ends_every_lease_without_a_refusal(off_schedule: float) -> None:
    for seed in range(150):
        Simulation(seed, frames=40, off_schedule=off_schedule).run()
