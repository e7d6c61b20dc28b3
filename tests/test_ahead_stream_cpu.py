"""An ``"ahead"`` stream end to end over the GPU-free stand-ins, each side's stream order kept.

The publisher's core (:class:`PublisherCore`, leases ending at the read flags
as with ``Publisher(ahead=True)``), a subscriber's core in ``"ahead"`` mode in
another process with the :class:`AheadInbox` the GPU subscriber uses, memfd
slots (``tests/_memfd_backend.py``) and a memfd flag page
(:class:`SharedFlags`).  What a GPU stream does in order -- wait for a flag,
touch the slot, write a flag -- a thread per process does in the same order
over the same page (:class:`StreamStandIn`), behind the host that queued it,
as a GPU runs behind its host.  So frames are handed out ahead of their data
and of their messages, the producer reuses a slot only after the read flag of
its previous use, and the consumer's check of a frame runs only once the
frame's flag is set.  What a user relies on: every frame handed out once, in
order; none read with another frame's bytes, those handed out ahead included;
the stream flows (a stall of the kind a wait for a message that never comes
would make fails the deadline).  The GPU tier is ``tests/test_ahead_gpu.py``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cupy_ipcpool.channel._ahead import AheadInbox, AheadSchedule, Predicted
from cupy_ipcpool.channel._handshake import SubscriberInfo
from cupy_ipcpool.channel._payload import FRAME_HEAD
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from cupy_ipcpool.channel._syncpage import FlagLayout, SharedFlags
from tests._memfd_backend import MemfdSlots, pattern
from tests.test_ahead_cpu import frame, gen_of

SPAWN = multiprocessing.get_context("spawn")
SLOTS = 4
SLOT_BYTES = 4096
LAYOUT = FlagLayout(SLOTS, 1)  # one subscriber: read-flag row 0
M = 0xFFFFFFFF
FRAMES = 3000
#: seconds one frame may take before the stream counts as stalled (it takes microseconds)
STALL = 10.0
#: The frame the publisher holds back until the consumer has taken it ahead.
HELD = 2 * SLOTS


class StreamStandIn:
    """What a stream does, in its order, behind the host that queues it: waits on a
    flag of the page (as ``cuStreamWaitValue32``), writes one (``cuStreamWriteValue32``)
    and runs work (a kernel), each only after everything queued before it."""

    def __init__(self, flags: SharedFlags) -> None:
        self._flags = flags
        self._ops: collections.deque[tuple[str, Any, int]] = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wait(self, offset: int, value: int) -> None:
        self._put(("wait", offset, value))

    def write(self, offset: int, value: int) -> None:
        self._put(("write", offset, value))

    def run(self, work: Callable[[], None]) -> None:
        self._put(("run", work, 0))

    def finish(self) -> None:
        """Wait until everything queued so far has run (a stream synchronize)."""
        done = threading.Event()
        self.run(done.set)
        assert done.wait(STALL), "the stream stand-in did not get through its queue"

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(STALL)

    def _put(self, op: tuple[str, Any, int]) -> None:
        with self._ready:
            self._ops.append(op)
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._ops and not self._closed:
                    self._ready.wait()
                if not self._ops:
                    return
                kind, what, value = self._ops.popleft()
            if kind == "wait":
                while not self._flags.reached(what, value):
                    if self._closed:
                        return
                    time.sleep(20e-6)
            elif kind == "write":
                self._flags.store(what, value)
            else:
                what()


def ahead_consumer(address: str, frames: int, q: Any, early: bool = False) -> None:
    """Take ``frames`` frames as the GPU subscriber does in ``"ahead"`` mode and release
    each at once: its check and its read flag queued on the stream behind the wait for
    its frame flag; the RELEASE of a frame handed out ahead when its message confirms it
    or, with ``early``, at once (``release_ahead``: perhaps before the frame is
    published, which the publisher's schedule allows; the GPU subscriber does not yet)."""
    core = SubscriberCore(address, mode="ahead", timeout=10)
    try:
        fds = core.take_fds()
        flags = SharedFlags.open(fds[-1], LAYOUT.nbytes)
        stream = StreamStandIn(flags)
        wrong: list[int] = []
        released_ahead: set[int] = set()

        def confirmed(entry: Predicted) -> None:
            if entry.seq in released_ahead:
                released_ahead.discard(entry.seq)
                core.release(entry.seq, entry.slot)

        def check(seq: int, slot: int) -> None:
            if os.pread(fds[slot], SLOT_BYTES, 0) != pattern(seq, SLOT_BYTES):
                wrong.append(seq)

        inbox = AheadInbox(AheadSchedule(SLOTS, SLOTS), core.next_view, confirmed)
        q.put(("ready",))
        handed_out: list[tuple[int, bool]] = []
        for _ in range(frames):
            got = inbox.next(STALL)
            ahead = isinstance(got, Predicted)
            if isinstance(got, Predicted):
                seq, slot, generation = got.seq, got.slot, got.generation & M
            else:
                seq, slot, payload = got
                generation = FRAME_HEAD.unpack_from(payload, 0)[1]
            stream.wait(LAYOUT.frame_offset(slot), generation)
            stream.run(functools.partial(check, seq, slot))
            stream.write(LAYOUT.read_offset(0, slot), generation)
            if ahead and early:
                core.release_ahead(seq, slot)  # perhaps before the frame is published
            elif ahead:
                released_ahead.add(seq)  # the RELEASE goes once its message confirms it
            else:
                core.release(seq, slot)
            handed_out.append((seq, ahead))
            if seq == HELD:  # the frame the publisher holds back until this is said
                q.put(("handed out", seq, ahead))
        stream.finish()  # the last frames' checks have run
        stream.close()
        for fd in fds:
            os.close(fd)
        q.put(("done", handed_out, wrong))
    except BaseException as exc:  # reported to the test, which fails with it
        q.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        core.close()


class _Publishing:
    """The publisher's side of an ahead stream over the stand-ins, a consumer in a child.

    The real :class:`PublisherCore` (its WELCOME passes the memfd slots and the flag
    page), the producer's stream stand-in, and what the producer last published in
    each slot; its leases end at the read flags, as with ``Publisher(ahead=True)``.
    """

    def __init__(
        self, tmp_path: Any, name: str, consumer: Callable[..., None], args: Callable[..., tuple]
    ) -> None:
        self.flags = SharedFlags.create(LAYOUT.nbytes)
        self.slots = MemfdSlots(SLOTS, SLOT_BYTES)
        self.core = PublisherCore(
            str(tmp_path / name),
            SLOTS,
            welcome=self.slots.welcome(self.flags.fd),
            on_join=self._join,
        )
        self.core.read_flags(self.flags.mapping, LAYOUT.reads_offset, 1)
        self.stream = StreamStandIn(self.flags)
        self.q = SPAWN.Queue()
        #: ``args(address, q)``: the consumer's arguments
        self.proc = SPAWN.Process(target=consumer, args=args(self.core.address, self.q))
        self.book = self.core.lease_book
        self.published = [0] * SLOTS

    def _join(self, info: SubscriberInfo) -> None:
        self.core.set_row(info.sub_id, 0)  # one subscriber: read-flag row 0

    def wait_free(self, seq: int, slot: int) -> None:
        """Until ``slot`` has no lease (Publisher(ahead=True) takes exactly this slot)."""
        deadline = time.monotonic() + STALL
        self.core.settle(slot)
        while self.book.lease_count(slot):
            assert time.monotonic() < deadline, f"frame {seq}: slot {slot} never came back"
            self.core.poll(STALL, True)
            self.core.settle(slot)

    def publish(self, seq: int, slot: int, generation: int, on_schedule: bool) -> None:
        """Frame ``seq`` into ``slot`` (free): the stream orders its write after the
        previous read, writes the bytes and the frame flag; then the FRAME goes out."""
        if self.published[slot]:
            self.stream.wait(LAYOUT.read_offset(0, slot), self.published[slot] & M)
        self.stream.run(functools.partial(self.slots.write, slot, seq))
        self.stream.write(LAYOUT.frame_offset(slot), generation & M)
        self.published[slot] = generation
        assert self.core.publish(slot, frame(slot, generation), on_schedule, generation) == seq

    def close(self) -> None:
        self.proc.join(STALL)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.stream.close()
        self.core.close()
        self.slots.close()
        self.flags.close()


@contextlib.contextmanager
def _publishing(
    tmp_path: Any, name: str, consumer: Callable[..., None], args: Callable[..., tuple]
) -> Iterator[_Publishing]:
    """A :class:`_Publishing` whose consumer has joined; everything closed afterwards."""
    side = _Publishing(tmp_path, name, consumer, args)
    side.proc.start()
    try:
        assert side.q.get(timeout=30) == ("ready",)
        deadline = time.monotonic() + STALL
        while not side.core.subscribers:
            assert time.monotonic() < deadline, "the consumer did not join"
            side.core.poll(0.01)
        yield side
    finally:
        side.close()


@pytest.mark.parametrize("early", [False, True], ids=["release-at-confirmation", "release-early"])
def test_an_ahead_stream_hands_out_every_frame_once_with_its_own_bytes(
    tmp_path: Any, early: bool
) -> None:
    with _publishing(
        tmp_path, "ahead.sock", ahead_consumer, lambda address, q: (address, FRAMES, q, early)
    ) as side:
        ended_at_publication = 0
        for seq in range(FRAMES):
            slot, generation = seq % SLOTS, gen_of(seq % SLOTS) + seq // SLOTS
            if seq == HELD:
                # Once every frame before it is back, the consumer finds no message waiting
                # and takes this one ahead: the ahead path runs whatever the two hosts' pace
                for earlier in range(SLOTS):
                    side.wait_free(seq, earlier)
                assert side.q.get(timeout=STALL) == ("handed out", HELD, True)
                side.core.poll(0.0)  # its early RELEASE (release-early) is read before it goes
            side.wait_free(seq, slot)
            side.publish(seq, slot, generation, True)
            # released before it was published: the lease ended as it was published
            ended_at_publication += not side.book.lease_count(slot)
        answer = side.q.get(timeout=60)
    assert answer[0] == "done", answer
    _, handed_out, wrong = answer
    assert [seq for seq, _ahead in handed_out] == list(range(FRAMES))
    assert wrong == [], f"frames read with other bytes: {wrong[:10]}"
    # the ahead path ran (frame HELD at least; how many more took it depends on the two
    # hosts' pace: a consumer that finds messages waiting hands those frames out by message)
    assert (HELD, True) in handed_out, "frame HELD was not handed out ahead"
    if early:  # and some of those were released before they were published (HELD at least)
        print(f"{ended_at_publication} of {FRAMES} leases ended as their frame was published")
        assert ended_at_publication, "no frame was released before its publication"


#: the frame after which the producer takes a slot from the pool beside the publisher
BESIDE_AFTER = 2 * SLOTS - 1
BESIDE_FRAMES = 6 * SLOTS


class _NullStream:
    """A stream object as the GPU subscriber sees it (``.ptr``); handle 0 is CuPy's
    default stream, what ``recv()`` and ``release()`` use unless told otherwise."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def beside_consumer(address: str, stream_handle: int, q: Any) -> None:
    """An ``"ahead"`` consumer whose frames handed out ahead are released and confirmed
    by the GPU subscriber's own code (:class:`~cupy_ipcpool.channel._subscriber._Lease`,
    ``Subscriber._release_ahead`` and ``Subscriber._confirmed``), its read-flag writes
    going to the stream stand-in: a frame released ahead and then confirmed at a later
    generation has its read flag rewritten on the stream it was released on.  Says
    ``("released ahead", seq)`` for each frame released ahead of its message."""
    from cupy_ipcpool.channel._settle import PageStreams
    from cupy_ipcpool.channel._subscriber import Frame, Subscriber, _Lease

    core = SubscriberCore(address, mode="ahead", timeout=10)
    try:
        fds = core.take_fds()
        flags = SharedFlags.open(fds[-1], LAYOUT.nbytes)
        stream = StreamStandIn(flags)
        handle = _NullStream(stream_handle)

        class Page:  # the SyncPage's write, onto the stream stand-in of that handle
            def write(self, sptr: int, offset: int, value: int) -> None:
                assert sptr == stream_handle, f"a read flag written on stream {sptr}"
                stream.write(offset, value)

        schedule = AheadSchedule(SLOTS, SLOTS)
        # the GPU subscriber's state that its ahead paths use, nothing more
        sub = Subscriber.__new__(Subscriber)
        sub._closed = False
        sub._sync = Page()  # type: ignore[assignment]
        sub._waits = None
        sub._core = core
        sub._ahead = schedule
        sub._read_flags = [LAYOUT.read_offset(0, s) for s in range(SLOTS)]
        sub._streams = PageStreams()
        sub._last_stream, sub._last_ptr = None, 0
        wrong: list[int] = []

        def check(seq: int, slot: int) -> None:
            if os.pread(fds[slot], SLOT_BYTES, 0) != pattern(seq, SLOT_BYTES):
                wrong.append(seq)

        inbox = AheadInbox(schedule, core.next_view, sub._confirmed)
        q.put(("ready",))
        handed_out: list[tuple[int, bool]] = []
        for _ in range(BESIDE_FRAMES):
            got = inbox.next(STALL)
            if isinstance(got, Predicted):
                seq, slot, generation = got.seq, got.slot, got.generation & M
                lease = _Lease(sub, seq, slot, generation, None, False)
                got.frame = Frame(seq, slot, (), b"", lease)
            else:
                seq, slot, payload = got
                generation = FRAME_HEAD.unpack_from(payload, 0)[1]
                lease = _Lease(sub, seq, slot, generation, None)
            schedule.handed(slot)
            stream.wait(LAYOUT.frame_offset(slot), generation)
            stream.run(functools.partial(check, seq, slot))
            if lease.confirmed:  # Subscriber._release's flag and RELEASE
                lease.released = True
                stream.write(LAYOUT.read_offset(0, slot), generation)
                core.release(seq, slot)
                schedule.released(slot)
            else:
                lease.release(handle)  # Subscriber._release_ahead
                q.put(("released ahead", seq))
            handed_out.append((seq, not lease.confirmed))
        stream.finish()
        stream.close()
        for fd in fds:
            os.close(fd)
        q.put(("done", handed_out, wrong))
    except BaseException as exc:  # reported to the test, which fails with it
        q.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        core.close()


@pytest.mark.parametrize("stream_handle", [0, 0x5EED], ids=["default-stream", "own-stream"])
def test_a_slot_taken_beside_the_publisher_comes_back_after_a_frame_released_ahead(
    tmp_path: Any, stream_handle: int
) -> None:
    """protocol.md: ``pool.acquire()`` beside an ahead publisher works.  The slot taken
    outside gets a generation the subscriber cannot predict; the frame published there
    next was handed out ahead and released before its message (its read flag at the
    predicted generation), so its lease ends only at the read flag its message makes
    the subscriber rewrite, on the stream it was released on -- also CuPy's default
    stream, whose handle is 0.  The producer then gets that slot back: every frame goes
    through, each read with its own bytes (the GPU tier: ``test_ahead_gpu.py``'s
    ``test_a_slot_taken_from_the_pool_beside_an_ahead_publisher``)."""
    released_ahead: set[int] = set()
    with _publishing(
        tmp_path,
        "beside.sock",
        beside_consumer,
        lambda address, q: (address, stream_handle, q),
    ) as side:

        def message() -> Any:
            got = side.q.get(timeout=STALL)
            if got[0] == "released ahead":
                released_ahead.add(got[1])
            return got

        generations = [gen_of(s) - 1 for s in range(SLOTS)]  # each slot's last write
        for seq in range(BESIDE_FRAMES):
            slot = seq % SLOTS
            if seq == BESIDE_AFTER + 1:
                # the consumer hands this frame out ahead (nothing else can come) and
                # releases it before it is published
                while seq not in released_ahead:
                    assert message()[0] == "released ahead", "the consumer stopped"
                # pool.acquire() beside the publisher takes this slot (the first free
                # one after the last written) and gives it back unpublished: the slot's
                # generation grows by one no subscriber sees
                side.wait_free(seq, slot)
                side.stream.wait(LAYOUT.read_offset(0, slot), side.published[slot] & M)
                generations[slot] += 1
            side.wait_free(seq, slot)
            generations[slot] += 1
            generation = generations[slot]
            # as Publisher._publish decides
            side.publish(seq, slot, generation, generation == side.published[slot] + 1)
        answer = message()
        while answer[0] == "released ahead":
            answer = message()
    assert answer[0] == "done", answer
    _, handed_out, wrong = answer
    assert [seq for seq, _ahead in handed_out] == list(range(BESIDE_FRAMES))
    assert (BESIDE_AFTER + 1, True) in handed_out  # the frame off the schedule went ahead
    assert wrong == [], f"frames read with other bytes: {wrong[:10]}"
