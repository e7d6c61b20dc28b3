"""Frames handed out ahead of their FRAME messages: the schedule a subscriber predicts.

A publisher made with ``ahead=True`` keeps a fixed schedule: frame *k + 1* is
written in the slot after frame *k*'s (round-robin), every frame has the
array layout of the first, and the slot's generation grows by one per use.
A subscriber in ``"ahead"`` mode therefore knows frame *k + n* (``n`` slots)
once it has received frame *k* by message: the same slot, the same arrays,
the next generation.  It hands that frame out at once, its stream waiting on
the GPU for the frame flag to reach the predicted generation, and its host
never waits for the message; the message arrives later and *confirms* the
prediction (:meth:`AheadSchedule.confirm`), bringing the metadata.

Why the wait is exact: the flag of slot *s* holds the generation the
producer's stream wrote last.  A frame is predicted only from a frame of the
same slot that this subscriber received by message (so its generation ``g``
is the real one), as ``g + 1``; the producer's next write there is frame
*k + n*'s, at ``g + 1`` or later (a generation may grow by more when the pool
was used outside the publisher), and it comes only after this subscriber's
read flag of frame *k*.  So the wait ends at frame *k + n*'s write and no
other: not at the previous use (``g < g + 1``), and not at a later one (the
producer waits, before that, for the read flag this subscriber writes after
its work on frame *k + n*).  A confirmation with a higher generation than
predicted is therefore sound; the subscriber then writes its read flag with
the real one.

This module is the bookkeeping only, no GPU: the predicted frames' wire
form (their handles, as the publisher would pack them), the check of each
confirmation (:class:`AheadSchedule`), and the order in which frames are
handed out and the stream ends (:class:`AheadInbox`).  Every message taken,
by either way, is first checked by block mode's one check of a FRAME head
(:func:`~._payload.frame_head`): a malformed one is a :class:`ProtocolError`.
:class:`~._subscriber.Subscriber` does the GPU part.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import ChannelTimeoutError, EndOfStream, ProtocolError, UsageError
from .._handles import ArrayHandle
from ._payload import FRAME_HEAD, frame_head

_MASK = 0xFFFFFFFF
_HALF = 1 << 31
_LAST_GENERATION = (1 << 64) - 1  # a handle's generation is a u64


@dataclass
class Predicted:
    """A frame handed out ahead of its message.

    ``handles``: the frame's array handles as the publisher packs them (for
    the arrays and to check the confirmation); ``frame``: what the GPU layer
    handed out (kept until the confirmation, which brings its metadata).
    """

    seq: int
    slot: int
    generation: int
    count: int
    handles: bytes
    frame: Any = None
    #: set by :meth:`AheadSchedule.confirm`: the generation the message names
    confirmed_generation: int | None = None
    #: set by :meth:`AheadSchedule.confirm`: the message is a void frame (``FRAME_VOID``)
    void: bool = False
    #: set by :meth:`AheadSchedule.confirm`: the frame's metadata
    metadata: bytes = b""


@dataclass
class _SlotState:
    """The last frame of one slot that this subscriber received by message."""

    seq: int
    generation: int
    #: per array, the handle split around its generation (None: a void frame, no layout)
    parts: list[tuple[bytes, bytes]] | None = field(default=None)


def split_handles(
    payload: bytes | memoryview, count: int, meta_len: int
) -> tuple[list[tuple[bytes, bytes]], list[int]]:
    """The ``count`` handles of a FRAME payload, each as ``(head, tail)``, and their generations.

    Raises
    ------
    ProtocolError
        A handle is truncated, or the handles and metadata do not fill the payload.
    """
    pos = FRAME_HEAD.size
    parts, generations = [], []
    try:
        for _ in range(count):
            head, tail, generation, pos = ArrayHandle.parts_at(payload, pos)
            parts.append((head, tail))
            generations.append(generation)
    except Exception as exc:
        raise ProtocolError(f"bad array handle in a frame: {exc}") from None
    if len(payload) - pos != meta_len:
        raise ProtocolError("frame: metadata length does not match")
    return parts, generations


def _checked_head(seq: int, slot: int, payload: bytes | memoryview) -> tuple[int, int, int, bool]:
    """:func:`~._payload.frame_head`, and the schedule's own rule: a frame of a publisher
    with ``ahead=True`` has arrays (the first frame's layout) unless it is void."""
    gen32, count, meta_len, void = frame_head(seq, slot, payload)
    if not count and not void:
        raise ProtocolError(
            f"frame {seq} has no arrays and is not void (a publisher with ahead=True sends "
            "every frame with the arrays of the first, and a frame it did not publish void)"
        )
    return gen32, count, meta_len, void


def _generation_of(seq: int, gens: list[int], gen32: int) -> int:
    """The generation a frame's handles name: one for all, with the head's low 32 bits."""
    generation = gens[0]
    if any(g != generation for g in gens) or (generation & _MASK) != gen32:
        raise ProtocolError(f"frame {seq}: its arrays name different generations")
    return generation


class AheadSchedule:
    """What an ``"ahead"`` subscriber predicts, and the check of each confirmation.

    Parameters
    ----------
    num_slots:
        The ring's slots.
    depth:
        Most frames handed out ahead of their messages at once (1 or more);
        at most ``num_slots`` are ever predicted (a frame is predicted only
        from the previous use of its slot received by message).
    """

    def __init__(self, num_slots: int, depth: int) -> None:
        if num_slots < 1:
            raise UsageError(f"num_slots must be at least 1, not {num_slots}")
        if depth < 1:
            raise UsageError(f"depth must be at least 1, not {depth}")
        self.num_slots = num_slots
        self.depth = depth
        self._slots: list[_SlotState | None] = [None] * num_slots
        # slots whose frame the consumer holds (handed out, not released): :meth:`handed`
        self._held: set[int] = set()
        #: frames handed out ahead and not confirmed yet, oldest first
        self.outstanding: deque[Predicted] = deque()
        self._last: tuple[int, int] | None = None  # (seq, slot) of the last frame handed out

    def received(self, seq: int, slot: int, payload: bytes | memoryview) -> None:
        """Frame ``seq`` was received by message before any prediction of it, and handed out.

        ``payload`` is its FRAME payload, checked here (:func:`~._payload.frame_head`,
        then its handles) before anything is noted.

        Raises
        ------
        ProtocolError
            The payload is malformed, or breaks the schedule (a frame with no
            arrays that is not void, arrays naming other generations than the head).
        """
        if self.outstanding:
            raise ProtocolError(
                f"frame {seq} handed out from its message while frame "
                f"{self.outstanding[0].seq} waits for its own"
            )
        gen32, count, meta_len, void = _checked_head(seq, slot, payload)
        parts, gens = split_handles(payload, count, meta_len)
        if void:  # only the low 32 bits of its generation are on the wire
            state = self._slots[slot]
            generation = gen32
            if state is not None:
                generation = state.generation + ((gen32 - state.generation) & _MASK)
            self._note(seq, slot, generation, None)
        else:
            self._note(seq, slot, _generation_of(seq, gens, gen32), parts)
        self._last = (seq, slot)

    def _note(
        self, seq: int, slot: int, generation: int, parts: list[tuple[bytes, bytes]] | None
    ) -> None:
        state = self._slots[slot]
        if parts is None and state is not None:
            parts = state.parts  # a void frame: the layout stays the one seen before
        self._slots[slot] = _SlotState(seq, generation, parts)

    def handed(self, slot: int) -> None:
        """The consumer was handed ``slot``'s frame (by message or ahead) and holds it."""
        self._held.add(slot)

    def released(self, slot: int) -> None:
        """The consumer released ``slot``'s frame (its read flag is queued)."""
        self._held.discard(slot)

    def predict(self) -> Predicted | None:
        """The next frame, if it can be handed out ahead now; it then counts as outstanding.

        None while ``depth`` frames are outstanding, before the first message,
        when the previous use of the next slot was not received by message
        (the first ``num_slots`` frames after joining, a void first use), or
        while the consumer still holds that previous frame (:meth:`handed`,
        :meth:`released`).  The last rule keeps the GPU out of a deadlock: a
        stream waiting for frame *k + n* and then releasing frame *k* would
        queue *k*'s read flag behind that wait, and the producer writes *k + n*
        only after that read flag.  Such a frame comes by message instead,
        once *k* is released, as in ``"block"`` mode.
        """
        last = self._last
        if last is None or len(self.outstanding) >= self.depth:
            return None
        seq = last[0] + 1
        slot = (last[1] + 1) % self.num_slots
        if slot in self._held:
            return None
        state = self._slots[slot]
        if state is None or state.parts is None or state.seq != seq - self.num_slots:
            return None
        generation = state.generation + 1
        if generation > _LAST_GENERATION:
            return None  # no generation after it on the wire: the frame comes by message
        gen = ArrayHandle.pack_generation(generation)
        handles = b"".join(head + gen + tail for head, tail in state.parts)
        entry = Predicted(seq, slot, generation, len(state.parts), handles)
        self.outstanding.append(entry)
        self._last = (seq, slot)
        return entry

    def confirm(self, seq: int, slot: int, payload: bytes | memoryview) -> Predicted:
        """Match FRAME ``seq``'s message with the oldest frame handed out ahead.

        Returns the :class:`Predicted` entry, no longer outstanding, with
        ``confirmed_generation``, ``void`` and ``metadata`` set.

        Raises
        ------
        ProtocolError
            The message is malformed (:func:`~._payload.frame_head`, its
            handles), or is not the frame predicted: another seq or slot, a
            generation below the predicted one, or other arrays.  The
            publisher broke the schedule it promised (``ahead=True``).
        """
        if not self.outstanding:
            raise ProtocolError(f"frame {seq} confirms no frame handed out ahead")
        entry = self.outstanding[0]
        gen32, count, meta_len, void = _checked_head(seq, slot, payload)
        if seq != entry.seq or slot != entry.slot:
            raise ProtocolError(
                f"frame {seq} came in slot {slot}; the publisher's schedule (ahead=True) "
                f"put frame {entry.seq} in slot {entry.slot}"
            )
        handles = entry.handles
        end = FRAME_HEAD.size + len(handles)
        if (
            count == entry.count
            and gen32 == entry.generation & _MASK
            and len(payload) - end == meta_len
            and payload[FRAME_HEAD.size : end] == handles
        ):
            # the frame as predicted, to the byte (every frame but the rare ones below):
            # its handles are the slot's layout at the predicted generation
            self.outstanding.popleft()
            entry.confirmed_generation = entry.generation
            entry.metadata = bytes(payload[end:]) if meta_len else b""
            self._last_confirmed(seq, slot, entry.generation)
            return entry
        if ((gen32 - entry.generation) & _MASK) >= _HALF:
            raise ProtocolError(
                f"frame {seq} in slot {slot} is of generation {gen32}, below the "
                f"{entry.generation & _MASK} its previous use in that slot implies"
            )
        parts, gens = split_handles(payload, count, meta_len)
        if void:
            generation = entry.generation + ((gen32 - entry.generation) & _MASK)
        else:
            expected = self._slots[slot]
            if len(parts) != entry.count or expected is None or parts != expected.parts:
                raise ProtocolError(
                    f"frame {seq}: its arrays differ from the layout of the frames before "
                    "(a publisher with ahead=True keeps one layout)"
                )
            generation = _generation_of(seq, gens, gen32)
        self.outstanding.popleft()
        entry.confirmed_generation = generation
        entry.void = void
        entry.metadata = bytes(payload[len(payload) - meta_len :]) if meta_len else b""
        self._note(seq, slot, generation, None if void else parts)
        return entry

    def _last_confirmed(self, seq: int, slot: int, generation: int) -> None:
        """Frame ``seq`` confirmed as predicted: the slot's layout stays, at ``generation``."""
        state = self._slots[slot]
        assert state is not None  # a prediction was made from it
        state.seq, state.generation = seq, generation


#: The next FRAME message within ``timeout`` seconds, as ``(seq, slot, payload)``
#: (the payload valid until the next call), or None when none came in that time;
#: raises EndOfStream.
MessageSource = Callable[[float | None], "tuple[int, int, bytes | memoryview] | None"]


class AheadInbox:
    """What an ``"ahead"`` subscriber hands out next: a frame by message, or one predicted.

    Messages are taken as they come: each confirms the oldest frame handed out
    ahead (``confirmed`` is called with its :class:`Predicted` entry), or,
    with nothing outstanding, waits here to be handed out from its message.
    A clean end (BYE) taken while such messages wait is held back until they
    are handed out: every frame published before the BYE is handed out, as in
    ``"block"`` mode.  After an unclean end (the producer died, eviction)
    nothing more is handed out, as in ``"block"`` mode.

    Parameters
    ----------
    schedule:
        The predictions and their checks.
    message:
        The next FRAME message (see :data:`MessageSource`); after an end it
        raises that end again.
    confirmed:
        Called with each entry a message confirmed.
    """

    def __init__(
        self,
        schedule: AheadSchedule,
        message: MessageSource,
        confirmed: Callable[[Predicted], None],
    ) -> None:
        self.schedule = schedule
        self._message = message
        self._confirmed = confirmed
        #: messages taken with nothing outstanding, to hand out in order
        self._early: deque[tuple[int, int, bytes]] = deque()
        self._ended = False  # a clean end was taken behind the messages in _early

    def next(self, timeout: float | None) -> tuple[int, int, bytes] | Predicted:
        """The next frame: ``(seq, slot, payload)`` from its message, or a prediction.

        Raises what ``message`` raises: :class:`ChannelTimeoutError` when no
        frame can be handed out within ``timeout`` (``depth`` frames are out
        ahead, or nothing can be predicted, and no message came), the
        :class:`EndOfStream` once every frame published before it was handed
        out; :class:`ProtocolError` for a message that breaks the schedule.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.take()  # what arrived meanwhile: confirmations, frames to hand out
        while True:
            if self._early:
                seq, slot, payload = self._early.popleft()
                self.schedule.received(seq, slot, payload)
                return seq, slot, payload
            if self._ended:
                self._message(0.0)  # raises the end, answered as of now
                raise AssertionError("the message source went on after its end")
            entry = self.schedule.predict()
            if entry is not None:
                return entry
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.take(left, at_least_one=True)

    def take(self, timeout: float | None = 0.0, at_least_one: bool = False) -> None:
        """Take the messages that have arrived; with ``at_least_one``, wait up to
        ``timeout`` for one message instead and take only it (none:
        :class:`ChannelTimeoutError`), as the caller wants the first and the
        next look finds any others at once."""
        schedule = self.schedule
        while not self._ended:
            try:
                got = self._message(timeout if at_least_one else 0.0)
            except EndOfStream as end:
                if end.clean and self._early:
                    self._ended = True  # raised again once _early is handed out
                    return
                raise
            if got is None:
                if at_least_one:
                    raise ChannelTimeoutError.no_frame(timeout)
                return
            seq, slot, payload = got
            if schedule.outstanding:
                self._confirmed(schedule.confirm(seq, slot, payload))
            else:
                self._early.append((seq, slot, bytes(payload)))
            if at_least_one:
                return
