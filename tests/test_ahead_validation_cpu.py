"""Every message an ``"ahead"`` subscriber takes is checked before it is parsed; CPU only.

An ``"ahead"`` subscriber takes FRAME messages two ways (``channel/_ahead.py``):
a frame received by message before any prediction of it
(:meth:`AheadSchedule.received`, when :class:`AheadInbox` hands it out) and the
confirmation of a frame handed out ahead (:meth:`AheadSchedule.confirm`, when
the inbox takes messages: in ``next`` and in ``take``, which
``Subscriber.close`` calls too).  Both read the payload's head with the one
check block mode uses (:func:`~cupy_ipcpool.channel._payload.frame_head`), so a
malformed message is a :class:`ProtocolError` (which closes the GPU
subscriber: ``tests/test_ahead_gpu.py``) on every path, and never any other
exception.  The crafted cases below are each refused on both paths; the fuzz
tests feed random bytes and mutations of valid payloads, as
``tests/test_handles.py`` fuzzes descriptors and handles.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_ipcpool._errors import ProtocolError
from cupy_ipcpool.channel._ahead import AheadInbox, AheadSchedule, Predicted
from cupy_ipcpool.channel._payload import FRAME_HEAD, FRAME_VOID, MAX_ARRAYS, MAX_METADATA
from tests.test_ahead_cpu import LAYOUT, M, frame, gen_of, packed_handles, void, warmed
from tests.test_handles import _mutate

#: The two ways a message is taken: (seq, slot, generation) of the frame it is for.
FIRST = (0, 0, gen_of(0))  # the first message, before anything was received
CONFIRMING = (2, 0, gen_of(0) + 1)  # frame 2, handed out ahead (two slots, both received)


class Messages:
    """A :data:`~cupy_ipcpool.channel._ahead.MessageSource` over a list: what the core
    would return, one message per call; None once there are none."""

    def __init__(self) -> None:
        self.queue: deque[tuple[int, int, bytes]] = deque()

    def __call__(self, timeout: float | None) -> tuple[int, int, bytes] | None:
        return self.queue.popleft() if self.queue else None


def first_message(payload: bytes) -> None:
    """``payload`` as the first message an inbox takes, handed out by ``next``."""
    messages = Messages()
    inbox = AheadInbox(AheadSchedule(2, 2), messages, lambda entry: None)
    messages.queue.append((*FIRST[:2], payload))
    got = inbox.next(0.0)
    assert got == (*FIRST[:2], payload)  # taken: the head passed the one check


def confirmation(payload: bytes, take: Callable[[AheadInbox], object]) -> Predicted:
    """``payload`` as the message of frame 2, handed out ahead; taken by ``take(inbox)``."""
    messages = Messages()
    confirmed: list[Predicted] = []
    inbox = AheadInbox(warmed(2, 2), messages, confirmed.append)
    entry = inbox.next(0.0)
    assert isinstance(entry, Predicted) and (entry.seq, entry.slot) == CONFIRMING[:2]
    messages.queue.append((*CONFIRMING[:2], payload))
    take(inbox)
    assert confirmed == [entry]
    assert len(entry.metadata) <= MAX_METADATA  # the limit holds on this path too
    return entry


def by_next(inbox: AheadInbox) -> object:
    return inbox.next(0.0)


def by_take(inbox: AheadInbox) -> object:  # what Subscriber.close does
    inbox.take()
    return None


# -- crafted cases: each refused as the first message and as a confirmation ----------------

Builder = Callable[[int, int], bytes]  # (slot, generation) -> payload


def _many_arrays(slot: int, generation: int) -> bytes:
    layout = [(64 * i, (4,), (4,), "float32") for i in range(MAX_ARRAYS + 1)]
    return frame(slot, generation, layout)


CRAFTED: dict[str, Builder] = {
    "payload shorter than its head": lambda s, g: frame(s, g)[: FRAME_HEAD.size - 1],
    "empty payload": lambda s, g: b"",
    "more arrays than a frame may carry": _many_arrays,
    "no arrays and metadata over the limit": (
        lambda s, g: FRAME_HEAD.pack(s, g & M, 0, 60_000) + b"m" * 60_000
    ),
    "void frame with metadata over the limit": lambda s, g: void(s, g, b"m" * 60_000),
    "arrays and metadata over the limit": lambda s, g: frame(s, g, metadata=b"m" * 16_385),
    "flag names another slot": lambda s, g: frame(s, g, head_slot=s + 1),
    "void mark on another slot's flag": (
        lambda s, g: FRAME_HEAD.pack((s + 1) | FRAME_VOID, g & M, 0, 0)
    ),
    "void frame with arrays": (
        lambda s, g: FRAME_HEAD.pack(s | FRAME_VOID, g & M, len(LAYOUT), 0) + packed_handles(s, g)
    ),
    "no arrays and not marked void": lambda s, g: FRAME_HEAD.pack(s, g & M, 0, 0),
    "arrays of another generation than the head": lambda s, g: frame(s, g, gens=[g + 2] * 3),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_malformed_message_is_a_protocol_error_on_every_path(case: str) -> None:
    build = CRAFTED[case]
    with pytest.raises(ProtocolError):
        first_message(build(*FIRST[1:]))
    for take in (by_next, by_take):
        with pytest.raises(ProtocolError):
            confirmation(build(*CONFIRMING[1:]), take)


def test_the_crafted_cases_differ_from_accepted_messages_only_where_they_say() -> None:
    """The well-formed messages they are made from are taken on both paths."""
    first_message(frame(*FIRST[1:]))
    first_message(void(*FIRST[1:]))
    for take in (by_next, by_take):
        assert confirmation(frame(*CONFIRMING[1:], metadata=b"m"), take).metadata == b"m"
        entry = confirmation(void(*CONFIRMING[1:]), take)
        assert entry.void and entry.confirmed_generation == CONFIRMING[2]
    limit = b"m" * MAX_METADATA  # the limit itself is allowed
    assert confirmation(frame(*CONFIRMING[1:], metadata=limit), by_take).metadata == limit


def test_a_generation_with_no_successor_predicts_nothing() -> None:
    """A handle's generation is a u64: after 2**64 - 1 there is no frame to predict
    (the frame comes by message), rather than an error packing the next one."""
    schedule = AheadSchedule(1, 1)
    last = (1 << 64) - 1
    schedule.received(0, 0, frame(0, last))
    assert schedule.predict() is None
    assert not schedule.outstanding


# -- fuzz: only ProtocolError comes out -----------------------------------------------------


def _first_or_refused(payload: bytes) -> None:
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        first_message(payload)


def _confirmed_or_refused(payload: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        confirmation(payload, by_take)


@given(st.binary(max_size=300))
def test_fuzz_ahead_random_bytes(data: bytes) -> None:
    for payload in (data, FRAME_HEAD.pack(0, gen_of(0) & M, 1, 0) + data):
        _first_or_refused(payload)
    for payload in (data, FRAME_HEAD.pack(0, CONFIRMING[2] & M, len(LAYOUT), 0) + data):
        _confirmed_or_refused(payload)


@given(st.data())
def test_fuzz_ahead_mutations(data: st.DataObject) -> None:
    slot, generation = data.draw(st.sampled_from([FIRST[1:], CONFIRMING[1:]]))
    base = data.draw(
        st.sampled_from(
            [
                frame(slot, generation),
                frame(slot, generation, metadata=b"metadata"),
                void(slot, generation),
                void(slot, generation, b"metadata"),
            ]
        )
    )
    payload = _mutate(base, data.draw)
    if (slot, generation) == FIRST[1:]:
        _first_or_refused(payload)
    else:
        _confirmed_or_refused(payload)
