"""The ahead schedule's rules, CPU only: what an ``"ahead"`` subscriber predicts and accepts.

A subscriber in ``mode="ahead"`` hands frame *k + n* out (``n`` slots) as
soon as it has frame *k* by message: the same slot, the same arrays, the next
generation (``channel/_ahead.py``, :class:`AheadSchedule`).  The message comes
later and confirms the prediction, or the subscriber refuses it with a
``ProtocolError`` (the publisher broke the schedule ``ahead=True`` promised).
After a clean end, :func:`settle_unpublished` (``channel/_settle.py``) forces
the frame flags of the frames handed out ahead that the producer never
published, so that every stream waiting on them goes on and those frames read
as not written (:func:`frame_state` False), while the frames published before
stay complete.

The FRAME payloads here are built as the publisher builds them
(``FRAME_HEAD`` and, per array, ``ArrayHandle.pack_parts`` around
``ArrayHandle.pack_generation``), from handles constructed directly; the flags
are a real memfd page (:class:`SharedFlags`).  No GPU, no mocks of CUDA.  The
GPU tier, between processes, is ``tests/test_ahead_gpu.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import numpy
import pytest

from cupy_ipcpool._errors import ProtocolError, UsageError
from cupy_ipcpool._handles import ArrayHandle
from cupy_ipcpool.channel._ahead import AheadSchedule, Predicted, split_handles
from cupy_ipcpool.channel._payload import FRAME_HEAD, FRAME_VOID
from cupy_ipcpool.channel._settle import settle_unpublished
from cupy_ipcpool.channel._syncpage import FORCED, FlagLayout, SharedFlags, frame_state

M = 0xFFFFFFFF

#: One array of a frame: (byte offset in the slot, shape, strides, dtype).
Spec = tuple[int, tuple[int, ...], tuple[int, ...], str]

#: The layout every frame of these tests has (a publisher with ahead=True keeps one).
LAYOUT: tuple[Spec, ...] = (
    (0, (4, 8), (32, 4), "float32"),
    (256, (16,), (8,), "int64"),
    (4096, (3, 5, 2), (2, 12, 40), "uint16"),
)


def gen_of(slot: int) -> int:
    """The generation of each slot's first frame in these tests (distinct per slot)."""
    return 5000 + 7 * slot


def handle_list(
    slot: int, generations: Sequence[int], layout: Sequence[Spec] = LAYOUT
) -> list[ArrayHandle]:
    return [
        ArrayHandle(slot, g, offset, shape, strides, numpy.dtype(dtype))
        for g, (offset, shape, strides, dtype) in zip(generations, layout, strict=True)
    ]


def packed_handles(
    slot: int, generation: int, layout: Sequence[Spec] = LAYOUT, gens: Sequence[int] | None = None
) -> bytes:
    """The frame's handles as the publisher packs them: ``head + pack_generation(g) + tail``."""
    gens = [generation] * len(layout) if gens is None else gens
    out = []
    for handle, g in zip(handle_list(slot, gens, layout), gens, strict=True):
        head, tail = handle.pack_parts()
        out.append(head + ArrayHandle.pack_generation(g) + tail)
    return b"".join(out)


def frame(
    slot: int,
    generation: int,
    layout: Sequence[Spec] = LAYOUT,
    metadata: bytes = b"",
    *,
    gens: Sequence[int] | None = None,
    head_slot: int | None = None,
    meta_len: int | None = None,
) -> bytes:
    """A FRAME payload of ``slot`` at ``generation`` (the fields overridable, to break it)."""
    head = FRAME_HEAD.pack(
        slot if head_slot is None else head_slot,
        generation & M,
        len(layout),
        len(metadata) if meta_len is None else meta_len,
    )
    return head + packed_handles(slot, generation, layout, gens) + metadata


def void(slot: int, generation: int, metadata: bytes = b"") -> bytes:
    """A void frame's FRAME payload: its flag index marked, no arrays."""
    return FRAME_HEAD.pack(slot | FRAME_VOID, generation & M, 0, len(metadata)) + metadata


def warmed(num_slots: int, depth: int, start: int = 0) -> AheadSchedule:
    """A schedule that received frames ``start .. start + num_slots - 1`` by message."""
    schedule = AheadSchedule(num_slots, depth)
    for seq in range(start, start + num_slots):
        slot = (seq - start) % num_slots
        schedule.received(seq, slot, frame(slot, gen_of(slot)))
    return schedule


def check_entry(entry: Predicted | None, seq: int, slot: int, generation: int) -> Predicted:
    """``entry`` is frame ``seq`` in ``slot`` at ``generation``, its handles the publisher's."""
    assert entry is not None
    assert (entry.seq, entry.slot, entry.generation) == (seq, slot, generation)
    assert entry.count == len(LAYOUT)
    assert entry.handles == packed_handles(slot, generation)
    # and the handles decode to the arrays the publisher published, at that generation
    pos, decoded = 0, []
    for _ in range(entry.count):
        handle, pos = ArrayHandle.unpack_from(entry.handles, pos)
        decoded.append(handle)
    assert pos == len(entry.handles)
    assert decoded == handle_list(slot, [generation] * len(LAYOUT))
    assert entry.confirmed_generation is None and entry.metadata == b"" and not entry.void
    return entry


# -- what is predicted ----------------------------------------------------------------


def test_nothing_is_predicted_before_the_first_message() -> None:
    schedule = AheadSchedule(4, 4)
    assert schedule.predict() is None
    assert schedule.predict() is None
    assert not schedule.outstanding


@pytest.mark.parametrize(
    ("num_slots", "depth"), [(1, 1), (1, 3), (2, 1), (3, 2), (3, 3), (3, 8), (4, 4)]
)
def test_after_one_round_by_message_the_next_round_is_predicted(num_slots: int, depth: int) -> None:
    """Frame n + i in slot i at the next generation; min(depth, num_slots) of them, then None."""
    schedule = warmed(num_slots, depth)
    predicted = []
    while (entry := schedule.predict()) is not None:
        predicted.append(entry)
        assert len(predicted) <= num_slots + depth  # a runaway stops here, not forever
    assert len(predicted) == min(depth, num_slots)
    for i, entry in enumerate(predicted):
        check_entry(entry, num_slots + i, i, gen_of(i) + 1)
    assert list(schedule.outstanding) == predicted
    assert schedule.predict() is None  # still nothing more


def test_a_frame_is_predicted_from_its_slot_confirmed_not_merely_predicted() -> None:
    """Depth beyond the ring: at most one round ahead of the last frame of each slot."""
    schedule = warmed(3, 8)
    first = [schedule.predict() for _ in range(3)]
    assert [e.seq for e in first if e is not None] == [3, 4, 5]
    # frame 6 (slot 0) needs frame 3 by message; frame 3 is only predicted
    assert schedule.predict() is None
    schedule.confirm(3, 0, frame(0, gen_of(0) + 1))
    check_entry(schedule.predict(), 6, 0, gen_of(0) + 2)
    assert schedule.predict() is None  # frame 7 needs frame 4's message
    schedule.confirm(4, 1, frame(1, gen_of(1) + 1))
    check_entry(schedule.predict(), 7, 1, gen_of(1) + 2)
    assert [e.seq for e in schedule.outstanding] == [5, 6, 7]


def test_a_slot_whose_frame_the_consumer_holds_is_not_predicted_until_released() -> None:
    """A stream waiting for frame k + n and then releasing frame k would wait forever (the
    producer writes k + n after k's read flag): while k is held, k + n is not handed out
    ahead; the other slots' next frames still are, and k + n once k is released."""
    schedule = warmed(4, 4)
    for slot in range(4):
        schedule.handed(slot)  # frames 0 .. 3 handed out by message
    assert schedule.predict() is None  # frame 4 (slot 0): frame 0 is held
    schedule.released(0)
    check_entry(schedule.predict(), 4, 0, gen_of(0) + 1)
    schedule.handed(0)
    assert schedule.predict() is None  # frame 5 (slot 1): frame 1 is held
    schedule.released(1)
    schedule.released(1)  # twice: no harm
    check_entry(schedule.predict(), 5, 1, gen_of(1) + 1)
    assert [e.seq for e in schedule.outstanding] == [4, 5]


def test_a_subscriber_joining_mid_stream_waits_for_each_slots_previous_use() -> None:
    """First message seq 1000 in slot 3: nothing predicted until 1004's previous use (1000)."""
    schedule = AheadSchedule(4, 4)
    schedule.received(1000, 3, frame(3, gen_of(3)))
    assert schedule.predict() is None
    for seq, slot in ((1001, 0), (1002, 1)):
        schedule.received(seq, slot, frame(slot, gen_of(slot)))
        # frame seq + 1's slot was not seen since joining
        assert schedule.predict() is None, f"predicted after {seq} without slot's previous use"
        assert not schedule.outstanding
    schedule.received(1003, 2, frame(2, gen_of(2)))
    # 1004 is in slot 3, whose previous use (1000) came by message; 1005..1007 follow
    check_entry(schedule.predict(), 1004, 3, gen_of(3) + 1)
    check_entry(schedule.predict(), 1005, 0, gen_of(0) + 1)
    check_entry(schedule.predict(), 1006, 1, gen_of(1) + 1)
    check_entry(schedule.predict(), 1007, 2, gen_of(2) + 1)
    assert schedule.predict() is None


def test_received_while_a_prediction_is_outstanding_is_refused() -> None:
    schedule = warmed(2, 2)
    entry = schedule.predict()
    assert entry is not None
    with pytest.raises(ProtocolError, match="waits for its own"):
        schedule.received(2, 0, frame(0, gen_of(0) + 1))


@pytest.mark.parametrize(("num_slots", "depth"), [(0, 1), (-1, 1), (4, 0), (4, -2), (0, 0)])
def test_a_schedule_needs_a_slot_and_a_depth(num_slots: int, depth: int) -> None:
    with pytest.raises(UsageError, match="at least 1"):
        AheadSchedule(num_slots, depth)


# -- confirmations ----------------------------------------------------------------------


def test_the_exact_message_confirms_the_prediction() -> None:
    schedule = warmed(2, 2)
    entry = check_entry(schedule.predict(), 2, 0, gen_of(0) + 1)
    other = check_entry(schedule.predict(), 3, 1, gen_of(1) + 1)
    got = schedule.confirm(2, 0, frame(0, gen_of(0) + 1, metadata=b"meta of 2"))
    assert got is entry
    assert got.confirmed_generation == gen_of(0) + 1
    assert got.metadata == b"meta of 2" and not got.void
    assert list(schedule.outstanding) == [other]
    # the next round of slot 0 is predicted from it
    check_entry(schedule.predict(), 4, 0, gen_of(0) + 2)
    assert schedule.predict() is None  # depth 2: 3 and 4 out


def test_a_steady_stream_is_predicted_and_confirmed_frame_after_frame() -> None:
    """Many rounds: every frame predicted as the publisher wrote it, and confirmed in order."""
    num_slots, depth = 3, 2
    schedule = warmed(num_slots, depth)
    generations = [gen_of(s) for s in range(num_slots)]
    next_message = num_slots
    handed_out = 0
    for _ in range(40):
        entry = schedule.predict()
        if entry is None:
            # depth frames are out: the oldest one's message arrives
            slot = next_message % num_slots
            generations[slot] += 1
            meta = f"frame {next_message}".encode()
            got = schedule.confirm(
                next_message, slot, frame(slot, generations[slot], metadata=meta)
            )
            assert (got.seq, got.confirmed_generation, got.metadata) == (
                next_message,
                generations[slot],
                meta,
            )
            next_message += 1
            continue
        seq = num_slots + handed_out
        check_entry(entry, seq, seq % num_slots, generations[seq % num_slots] + 1)
        handed_out += 1
        assert len(schedule.outstanding) <= depth
    assert handed_out > 20 and next_message > 20


def test_a_higher_generation_than_predicted_is_accepted_and_used_from_then_on() -> None:
    """The pool was used outside the publisher: the slot's generation grew by more than one."""
    schedule = warmed(2, 2)
    check_entry(schedule.predict(), 2, 0, gen_of(0) + 1)
    check_entry(schedule.predict(), 3, 1, gen_of(1) + 1)
    real = gen_of(0) + 5
    got = schedule.confirm(2, 0, frame(0, real))
    assert got.confirmed_generation == real
    assert got.generation == gen_of(0) + 1  # what was predicted (and waited for) stays
    schedule.confirm(3, 1, frame(1, gen_of(1) + 1))
    check_entry(schedule.predict(), 4, 0, real + 1)
    check_entry(schedule.predict(), 5, 1, gen_of(1) + 2)


def test_generations_past_2_to_the_32_are_predicted_in_full() -> None:
    """The handles carry 64-bit generations; the FRAME head and the flags their low 32 bits."""
    schedule = AheadSchedule(1, 1)
    schedule.received(0, 0, frame(0, M))
    entry = check_entry(schedule.predict(), 1, 0, M + 1)
    assert entry.generation & M == 0
    got = schedule.confirm(1, 0, frame(0, M + 1))
    assert got.confirmed_generation == M + 1
    check_entry(schedule.predict(), 2, 0, M + 2)
    # a jump across the wrap is a higher generation: accepted
    got = schedule.confirm(2, 0, frame(0, M + 4))
    assert got.confirmed_generation == M + 4
    check_entry(schedule.predict(), 3, 0, M + 5)


def test_a_void_frame_confirms_and_the_slot_keeps_its_layout() -> None:
    schedule = warmed(2, 2)
    entry = check_entry(schedule.predict(), 2, 0, gen_of(0) + 1)
    check_entry(schedule.predict(), 3, 1, gen_of(1) + 1)
    got = schedule.confirm(2, 0, void(0, gen_of(0) + 1, b"nothing"))
    assert got is entry
    assert got.void and got.metadata == b"nothing"
    assert got.confirmed_generation == gen_of(0) + 1
    # a void frame at a higher generation is one too
    got = schedule.confirm(3, 1, void(1, gen_of(1) + 3))
    assert got.void and got.confirmed_generation == gen_of(1) + 3 and got.metadata == b""
    # the next round is predicted with the arrays seen before, at the next generation
    check_entry(schedule.predict(), 4, 0, gen_of(0) + 2)
    check_entry(schedule.predict(), 5, 1, gen_of(1) + 4)


def test_a_void_frame_by_message_keeps_the_layout_seen_before() -> None:
    schedule = warmed(2, 1)
    check_entry(schedule.predict(), 2, 0, gen_of(0) + 1)
    schedule.confirm(2, 0, frame(0, gen_of(0) + 1))
    # frame 3's message arrived before anything was predicted of it: received, void
    schedule.received(3, 1, void(1, gen_of(1) + 1))
    check_entry(schedule.predict(), 4, 0, gen_of(0) + 2)
    schedule.confirm(4, 0, frame(0, gen_of(0) + 2))
    check_entry(schedule.predict(), 5, 1, gen_of(1) + 2)


def test_a_void_frame_by_message_past_2_to_the_32_keeps_the_full_generation() -> None:
    base = (1 << 32) + 5
    schedule = AheadSchedule(2, 1)
    schedule.received(0, 0, frame(0, base))
    schedule.received(1, 1, frame(1, base))
    check_entry(schedule.predict(), 2, 0, base + 1)
    schedule.confirm(2, 0, frame(0, base + 1))
    schedule.received(3, 1, void(1, base + 1))  # its message came before any prediction
    check_entry(schedule.predict(), 4, 0, base + 2)
    schedule.confirm(4, 0, frame(0, base + 2))
    # frame 5 in slot 1, as the publisher packs it: generation base + 2 in every handle
    check_entry(schedule.predict(), 5, 1, base + 2)


def test_a_void_first_use_of_a_slot_predicts_nothing_for_it() -> None:
    schedule = AheadSchedule(2, 2)
    schedule.received(0, 0, void(0, gen_of(0)))
    schedule.received(1, 1, frame(1, gen_of(1)))
    assert schedule.predict() is None  # frame 2: slot 0 has no layout yet
    schedule.received(2, 0, frame(0, gen_of(0) + 1))
    check_entry(schedule.predict(), 3, 1, gen_of(1) + 1)
    check_entry(schedule.predict(), 4, 0, gen_of(0) + 2)


# -- confirmations refused ------------------------------------------------------------------

G = gen_of(0) + 1  # the generation predicted for frame 2 in slot 0 (two slots)
OTHER_SHAPE = ((0, (8, 4), (16, 4), "float32"), *LAYOUT[1:])
OTHER_OFFSET = ((64, (4, 8), (32, 4), "float32"), *LAYOUT[1:])
OTHER_DTYPE = ((0, (4, 8), (32, 4), "int32"), *LAYOUT[1:])
OTHER_STRIDES = ((0, (4, 8), (4, 16), "float32"), *LAYOUT[1:])
GOOD = frame(0, G)


def refused_cases() -> Iterator[tuple[str, int, int, bytes]]:
    """``(name, seq, slot, payload)`` of messages that are not frame 2 as predicted."""
    yield "wrong seq", 3, 0, GOOD
    yield "wrong slot", 2, 1, frame(1, G)
    yield "head names another slot", 2, 0, frame(0, G, head_slot=1)
    yield "the previous generation again", 2, 0, frame(0, G - 1)
    yield "a generation far below", 2, 0, frame(0, G - 1000)
    yield "other shape", 2, 0, frame(0, G, OTHER_SHAPE)
    yield "other offset", 2, 0, frame(0, G, OTHER_OFFSET)
    yield "other dtype", 2, 0, frame(0, G, OTHER_DTYPE)
    yield "other strides", 2, 0, frame(0, G, OTHER_STRIDES)
    yield "an array fewer", 2, 0, frame(0, G, LAYOUT[:2])
    yield "an array more", 2, 0, frame(0, G, (*LAYOUT, (8192, (2,), (4,), "float32")))
    yield "mixed generations", 2, 0, frame(0, G, gens=[G, G + 1, G])
    yield "handles of another generation than the head", 2, 0, frame(0, G, gens=[G + 2] * 3)
    yield "truncated handle", 2, 0, GOOD[:-5]
    yield "a handle missing", 2, 0, GOOD[: FRAME_HEAD.size + len(packed_handles(0, G, LAYOUT[:2]))]
    yield "payload shorter than its head", 2, 0, GOOD[: FRAME_HEAD.size - 1]
    yield "metadata shorter than said", 2, 0, frame(0, G, metadata=b"abcd", meta_len=5)
    yield "metadata longer than said", 2, 0, frame(0, G, metadata=b"abcd", meta_len=3)
    yield "bytes after the handles, none said", 2, 0, frame(0, G, metadata=b"x", meta_len=0)


CASES = list(refused_cases())


@pytest.mark.parametrize(
    ("seq", "slot", "payload"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_message_other_than_the_predicted_frame_is_refused(
    seq: int, slot: int, payload: bytes
) -> None:
    schedule = warmed(2, 2)
    check_entry(schedule.predict(), 2, 0, G)
    with pytest.raises(ProtocolError):
        schedule.confirm(seq, slot, payload)


def test_the_refusal_cases_differ_from_the_good_message_only_where_they_say() -> None:
    """The good message itself is accepted: each refusal is of its own defect."""
    schedule = warmed(2, 2)
    check_entry(schedule.predict(), 2, 0, G)
    assert schedule.confirm(2, 0, GOOD).confirmed_generation == G


@pytest.mark.parametrize("older", [M, M - 1, M - 1000, (1 << 32) + 7 - (1 << 31)])
def test_a_generation_below_the_predicted_is_refused_across_the_wrap(older: int) -> None:
    """Predicted 2**32 + 7 (low bits 7): a message of a generation just below the wrap is older."""
    schedule = AheadSchedule(1, 1)
    schedule.received(0, 0, frame(0, (1 << 32) + 6))
    check_entry(schedule.predict(), 1, 0, (1 << 32) + 7)
    with pytest.raises(ProtocolError, match="below"):
        schedule.confirm(1, 0, frame(0, older))


def test_at_the_wrap_the_predicted_generation_and_later_ones_are_accepted() -> None:
    for real in (1 << 32, (1 << 32) + 1, (1 << 32) + 1000):
        schedule = AheadSchedule(1, 1)
        schedule.received(0, 0, frame(0, M))
        check_entry(schedule.predict(), 1, 0, 1 << 32)
        with pytest.raises(ProtocolError, match="below"):
            schedule.confirm(1, 0, frame(0, M))  # the previous use again
        assert schedule.confirm(1, 0, frame(0, real)).confirmed_generation == real


def test_a_confirmation_with_nothing_outstanding_is_refused() -> None:
    schedule = warmed(2, 2)
    with pytest.raises(ProtocolError, match="no frame handed out ahead"):
        schedule.confirm(2, 0, GOOD)
    check_entry(schedule.predict(), 2, 0, G)
    schedule.confirm(2, 0, GOOD)
    with pytest.raises(ProtocolError, match="no frame handed out ahead"):
        schedule.confirm(2, 0, GOOD)  # the same message twice


def test_split_handles_gives_the_publishers_parts_and_generations() -> None:
    payload = frame(0, G, metadata=b"tail", gens=[G, G + 1, G + 2])
    parts, generations = split_handles(payload, len(LAYOUT), 4)
    assert generations == [G, G + 1, G + 2]
    assert parts == [h.pack_parts() for h in handle_list(0, [0] * len(LAYOUT))]
    with pytest.raises(ProtocolError, match="metadata length"):
        split_handles(payload, len(LAYOUT), 3)
    with pytest.raises(ProtocolError, match="bad array handle"):
        split_handles(payload[:-10], len(LAYOUT), 0)


# -- settle_unpublished: the flags of frames handed out ahead, never published -------------------


@pytest.fixture
def page() -> Iterator[tuple[SharedFlags, FlagLayout]]:
    layout = FlagLayout(4, 2)
    flags = SharedFlags.create(layout.nbytes)
    try:
        yield flags, layout
    finally:
        flags.close()


def outstanding(num_slots: int, generations: Sequence[int]) -> list[Predicted]:
    """The frames a schedule hands out ahead after one round at ``generations`` by message."""
    schedule = AheadSchedule(num_slots, num_slots)
    for slot, g in enumerate(generations):
        schedule.received(slot, slot, frame(slot, g))
    while schedule.predict() is not None:
        pass
    return list(schedule.outstanding)


def words(flags: SharedFlags) -> list[int]:
    return [flags.load(off) for off in range(0, flags.nbytes, 4)]


def test_an_unpublished_frame_is_forced_and_the_published_one_stays_complete(
    page: tuple[SharedFlags, FlagLayout],
) -> None:
    flags, layout = page
    other = SharedFlags.open(flags.fd, layout.nbytes)  # another subscriber's mapping
    try:
        (entry,) = outstanding(1, [10])
        g = entry.generation
        assert g == 11
        flags.store(layout.frame_offset(0), g - 1)  # the last frame published in slot 0
        before = words(flags)
        assert settle_unpublished(flags, layout, [entry], 0.05) is True
        word = flags.load(layout.frame_offset(0))
        assert word == (g - 1 + FORCED) & M
        assert frame_state(word, g) is False  # never written
        assert frame_state(word, g - 1) is True  # the published frame stays complete
        assert flags.reached(layout.frame_offset(0), g)  # every wait on it ends
        assert frame_state(other.load(layout.frame_offset(0)), g) is False
        after = words(flags)
        assert [a for i, a in enumerate(after) if i != 0] == before[1:]  # nothing else moved
    finally:
        other.close()


def test_every_unpublished_frame_of_the_round_is_forced(
    page: tuple[SharedFlags, FlagLayout],
) -> None:
    flags, layout = page
    entries = outstanding(4, [5, 6, 7, 8])
    assert [e.slot for e in entries] == [0, 1, 2, 3]
    for e in entries:
        flags.store(layout.frame_offset(e.slot), e.generation - 1)
    assert settle_unpublished(flags, layout, entries, 0.05) is True
    for e in entries:
        word = flags.load(layout.frame_offset(e.slot))
        assert frame_state(word, e.generation) is False
        assert frame_state(word, e.generation - 1) is True


def test_a_flag_without_the_last_published_frame_is_waited_for_then_left_alone(
    page: tuple[SharedFlags, FlagLayout],
) -> None:
    """The producer's write of g - 1 has not landed: nothing forced, False after the grace."""
    flags, layout = page
    (entry,) = outstanding(1, [10])
    flags.store(layout.frame_offset(0), entry.generation - 2)
    before = words(flags)
    assert settle_unpublished(flags, layout, [entry], 0.05) is False
    assert words(flags) == before
    assert frame_state(flags.load(layout.frame_offset(0)), entry.generation) is None


def test_one_slot_not_ready_forces_none_of_them(
    page: tuple[SharedFlags, FlagLayout],
) -> None:
    flags, layout = page
    entries = outstanding(3, [20, 30, 40])
    flags.store(layout.frame_offset(0), 20)  # ready
    flags.store(layout.frame_offset(1), 29)  # 30 not landed yet
    flags.store(layout.frame_offset(2), 40)  # ready
    before = words(flags)
    assert settle_unpublished(flags, layout, entries, 0.05) is False
    assert words(flags) == before


def test_the_last_published_frame_landing_during_the_grace_is_waited_for(
    page: tuple[SharedFlags, FlagLayout],
) -> None:
    flags, layout = page
    (entry,) = outstanding(1, [10])
    g = entry.generation
    flags.store(layout.frame_offset(0), g - 2)
    started = threading.Event()

    def producer_stream() -> None:
        started.set()
        time.sleep(0.02)
        flags.store(layout.frame_offset(0), g - 1)

    writer = threading.Thread(target=producer_stream)
    writer.start()
    try:
        assert started.wait(5.0)
        assert settle_unpublished(flags, layout, [entry], 5.0) is True
    finally:
        writer.join()
    word = flags.load(layout.frame_offset(0))
    assert frame_state(word, g) is False
    assert frame_state(word, g - 1) is True


@pytest.mark.parametrize("ahead_by", [0, 1, 4])
def test_a_frame_that_was_published_is_left_as_it_is(
    page: tuple[SharedFlags, FlagLayout], ahead_by: int
) -> None:
    """The flag at or after g: the producer wrote the frame (at g or, used outside, later)."""
    flags, layout = page
    (entry,) = outstanding(1, [10])
    g = entry.generation
    flags.store(layout.frame_offset(0), g + ahead_by)
    assert settle_unpublished(flags, layout, [entry], 0.05) is True
    word = flags.load(layout.frame_offset(0))
    assert word == g + ahead_by
    assert frame_state(word, g) is True


def test_settle_unpublished_across_the_wrap(page: tuple[SharedFlags, FlagLayout]) -> None:
    """Predicted 2**32 (flag value 0) after M: the flag at M is forced, M's frame complete."""
    flags, layout = page
    (entry,) = outstanding(1, [M])
    assert entry.generation == 1 << 32
    flags.store(layout.frame_offset(0), M)
    assert settle_unpublished(flags, layout, [entry], 0.05) is True
    word = flags.load(layout.frame_offset(0))
    assert frame_state(word, 0) is False
    assert frame_state(word, M) is True


def test_nothing_outstanding_settles_at_once(page: tuple[SharedFlags, FlagLayout]) -> None:
    flags, layout = page
    before = words(flags)
    assert settle_unpublished(flags, layout, [], 5.0) is True
    assert words(flags) == before
