"""Credit and flow control of remote sessions: pure state, no I/O, no locks, no clocks.

A remote subscriber's credit is its free receive slots: it *grants* a slot
(CREDIT) when the slot is free, and the server sends one frame into each
granted slot.  :class:`ServerBook` decides, for each frame the server takes
from its local source, which subscribers get it now, which wait for credit
(``"block"``) and which skip it (``"latest"``), and when the source frame may
be released (no send in flight and no subscriber queued on it).
:class:`ClientBook` checks on the subscriber that the server only uses slots
that were granted, in increasing sequence order.

The local channel's rules hold for the source's ring: ``"latest"`` sends in
flight together never retain more than ``source_slots - latest_reserve``
source frames (the reserve of :func:`~cupy_ipcpool.channel._leases.default_latest_reserve`),
so a ``"latest"`` subscriber whose sends stall never makes the producer wait:
it skips frames instead.  Every send carries its start time (the caller's
clock); :meth:`ServerBook.overdue` names the subscribers with a send older
than a timeout, and :meth:`ServerBook.remove_subscriber` with
``abandon_sends=True`` gives back what their sends retained.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .._errors import ProtocolError, UsageError
from ..channel._leases import default_latest_reserve

BLOCK = "block"
LATEST = "latest"


@dataclass
class _Sub:
    mode: str
    num_slots: int
    granted: collections.deque[int] = field(default_factory=collections.deque)
    granted_set: set[int] = field(default_factory=set)
    queue: collections.deque[int] = field(default_factory=collections.deque)


class ServerBook:
    """Grants, queues and sends in flight of every remote subscriber of one server.

    Frames are identified by an opaque integer the caller chooses (the source
    frame's sequence number).  A frame is *retained* while a send of it is in
    flight or a ``"block"`` subscriber waits for credit to receive it.

    Parameters
    ----------
    source_slots:
        Slots of the source's ring.  ``"latest"`` sends in flight together
        retain at most ``source_slots - default_latest_reserve(source_slots)``
        distinct frames; a ``"latest"`` subscriber with credit skips a frame
        that would exceed it.  None: no such cap (for tests of the other rules).
    """

    def __init__(self, *, source_slots: int | None = None) -> None:
        if source_slots is not None and source_slots < 1:
            raise UsageError(f"source_slots must be at least 1, not {source_slots}")
        self._subs: dict[int, _Sub] = {}
        self._refs: collections.Counter[int] = collections.Counter()
        #: sends in flight: (sub_id, frame) -> (count, oldest start time)
        self._sends: dict[tuple[int, int], list[float]] = {}
        self._latest_sends: set[tuple[int, int]] = set()
        self._latest_refs: collections.Counter[int] = collections.Counter()
        self.latest_budget: int | None = (
            None if source_slots is None else source_slots - default_latest_reserve(source_slots)
        )
        #: frames a ``"latest"`` subscriber with credit skipped to respect the budget
        self.latest_skips = 0

    # -- subscribers --

    def add_subscriber(self, sub_id: int, mode: str, num_slots: int) -> None:
        """Register a subscriber with a receive ring of ``num_slots`` (no credit yet).

        Raises
        ------
        UsageError
            Duplicate id, unknown mode, or a ring of fewer than one slot.
        """
        if sub_id in self._subs:
            raise UsageError(f"subscriber {sub_id} is already registered")
        if mode not in (BLOCK, LATEST):
            raise UsageError(f"mode must be 'block' or 'latest', not {mode!r}")
        if num_slots < 1:
            raise UsageError(f"num_slots must be at least 1, not {num_slots}")
        self._subs[sub_id] = _Sub(mode, num_slots)

    def remove_subscriber(self, sub_id: int, *, abandon_sends: bool = False) -> list[int]:
        """Forget a subscriber: drop its queue and grants.

        Parameters
        ----------
        abandon_sends:
            Also give back what its sends in flight retain (they will never
            be reported, or their reports are ignored).  Otherwise they keep
            their frames retained until :meth:`sent` reports them.

        Returns
        -------
        list[int]
            Frames no longer retained by anyone (release them).
        """
        sub = self._subs.pop(sub_id, None)
        freed = []
        if sub is not None:
            for frame in sub.queue:
                if self._unref(frame):
                    freed.append(frame)
        if abandon_sends:
            for key in [k for k in self._sends if k[0] == sub_id]:
                count = int(self._sends.pop(key)[0])
                self._forget_latest(key)
                for _ in range(count):
                    if self._unref(key[1]):
                        freed.append(key[1])
        return freed

    def subscribers(self) -> list[int]:
        """Registered subscriber ids."""
        return list(self._subs)

    def mode(self, sub_id: int) -> str:
        """The subscriber's mode."""
        return self._subs[sub_id].mode

    # -- events --

    def credit(self, sub_id: int, slot: int, now: float = 0.0) -> tuple[int, int] | None:
        """The subscriber granted ``slot``; return ``(frame, slot)`` to send now, if one waits.

        Raises
        ------
        ProtocolError
            The slot is outside the subscriber's ring or is already granted.
        KeyError
            Unknown subscriber.
        """
        sub = self._subs[sub_id]
        if not 0 <= slot < sub.num_slots:
            raise ProtocolError(f"credit for slot {slot} of a {sub.num_slots}-slot ring")
        if slot in sub.granted_set:
            raise ProtocolError(f"slot {slot} granted twice")
        if sub.queue:
            frame = sub.queue.popleft()
            self._start(sub_id, frame, now, ref=False)  # the queue's reference becomes the send's
            return frame, slot
        sub.granted.append(slot)
        sub.granted_set.add(slot)
        return None

    def offer(self, frame: int, now: float = 0.0) -> list[tuple[int, int]]:
        """A new frame from the source; return the ``(sub_id, slot)`` sends to start now.

        Subscribers with credit get it now; ``"block"`` subscribers without
        credit queue it; ``"latest"`` subscribers without credit skip it, and
        so do those with credit when the frame would take the ``"latest"``
        sends past the source's budget.
        """
        sends = []
        budget = self.latest_budget
        for sub_id, sub in self._subs.items():
            if sub.granted:
                if (
                    sub.mode == LATEST
                    and budget is not None
                    and frame not in self._latest_refs
                    and len(self._latest_refs) >= budget
                ):
                    self.latest_skips += 1
                    continue
                slot = sub.granted.popleft()
                sub.granted_set.discard(slot)
                self._start(sub_id, frame, now, ref=True)
                sends.append((sub_id, slot))
            elif sub.mode == BLOCK:
                sub.queue.append(frame)
                self._refs[frame] += 1
        return sends

    def sent(self, sub_id: int, frame: int) -> bool:
        """A send of ``frame`` to ``sub_id`` completed or failed; True when ``frame`` is free.

        Works for subscribers already removed (their last sends finish late);
        a send given back by ``remove_subscriber(..., abandon_sends=True)`` is
        ignored (False).
        """
        key = (sub_id, frame)
        entry = self._sends.get(key)
        if entry is None:
            return False
        entry[0] -= 1
        if entry[0] <= 0:
            del self._sends[key]
            self._forget_latest(key)
        return self._unref(frame)

    # -- queries --

    def retained(self, frame: int) -> bool:
        """True while a send or a queued subscriber refers to ``frame``."""
        return self._refs[frame] > 0

    def retained_frames(self) -> list[int]:
        """Every retained frame."""
        return [f for f, n in self._refs.items() if n > 0]

    def queued(self, sub_id: int) -> int:
        """Frames waiting for ``sub_id``'s credit."""
        return len(self._subs[sub_id].queue)

    def granted(self, sub_id: int) -> int:
        """Slots ``sub_id`` granted and not yet used."""
        return len(self._subs[sub_id].granted)

    def in_flight(self, sub_id: int | None = None) -> int:
        """Sends in flight (of ``sub_id``, or in all)."""
        return sum(int(e[0]) for k, e in self._sends.items() if sub_id is None or k[0] == sub_id)

    def latest_frames(self) -> int:
        """Distinct frames retained by ``"latest"`` sends in flight."""
        return len(self._latest_refs)

    def next_deadline(self, timeout: float) -> float | None:
        """When the oldest send in flight becomes overdue (None: none in flight)."""
        starts = [e[1] for k, e in self._sends.items() if k[0] in self._subs]
        return min(starts) + timeout if starts else None

    def overdue(self, now: float, timeout: float) -> list[int]:
        """Registered subscribers with a send in flight for longer than ``timeout``."""
        late = {k[0] for k, e in self._sends.items() if now - e[1] > timeout}
        return sorted(s for s in late if s in self._subs)

    # -- internals --

    def _start(self, sub_id: int, frame: int, now: float, *, ref: bool) -> None:
        key = (sub_id, frame)
        entry = self._sends.get(key)
        if entry is None:
            self._sends[key] = [1, now]
        else:
            entry[0] += 1
        if ref:
            self._refs[frame] += 1
        if self._subs[sub_id].mode == LATEST and key not in self._latest_sends:
            self._latest_sends.add(key)
            self._latest_refs[frame] += 1

    def _forget_latest(self, key: tuple[int, int]) -> None:
        if key in self._latest_sends:
            self._latest_sends.discard(key)
            n = self._latest_refs[key[1]] - 1
            if n <= 0:
                del self._latest_refs[key[1]]
            else:
                self._latest_refs[key[1]] = n

    def _unref(self, frame: int) -> bool:
        n = self._refs[frame] - 1
        if n <= 0:
            self._refs.pop(frame, None)
            return True
        self._refs[frame] = n
        return False


class ClientBook:
    """The subscriber's view of its receive ring: granted, receiving and held slots.

    Parameters
    ----------
    num_slots:
        Slots in the receive ring.
    next_seq:
        Lower bound of the first frame's sequence number (from WELCOME).
    """

    def __init__(self, num_slots: int, next_seq: int = 0) -> None:
        if num_slots < 1:
            raise UsageError(f"num_slots must be at least 1, not {num_slots}")
        self.num_slots = num_slots
        self._granted: set[int] = set()
        self._receiving: dict[int, int] = {}  # slot -> seq
        self._held: dict[int, int] = {}  # slot -> seq
        self._next_seq = next_seq

    def grant(self, slot: int) -> None:
        """Record that ``slot`` is offered to the server.

        Raises
        ------
        UsageError
            The slot is out of range or not free.
        """
        if not 0 <= slot < self.num_slots:
            raise UsageError(f"slot {slot} outside the {self.num_slots}-slot ring")
        if slot in self._granted or slot in self._receiving or slot in self._held:
            raise UsageError(f"slot {slot} is not free")
        self._granted.add(slot)

    def frame(self, seq: int, slot: int) -> None:
        """The server announces frame ``seq`` in ``slot``.

        Raises
        ------
        ProtocolError
            The slot was not granted, or ``seq`` does not increase.
        """
        if slot not in self._granted:
            raise ProtocolError(f"frame {seq} sent into slot {slot}, which was not granted")
        if seq < self._next_seq:
            raise ProtocolError(f"frame {seq} after frame {self._next_seq - 1}: out of order")
        self._granted.discard(slot)
        self._receiving[slot] = seq
        self._next_seq = seq + 1

    def received(self, slot: int) -> int:
        """The frame in ``slot`` arrived completely; return its seq (the slot is held now)."""
        seq = self._receiving.pop(slot)
        self._held[slot] = seq
        return seq

    def abandon(self, slot: int) -> None:
        """A frame in ``slot`` never arrived (the connection ended): the slot is free again."""
        self._receiving.pop(slot, None)

    def release(self, slot: int) -> None:
        """The user is done with ``slot``: it may be granted again.

        Raises
        ------
        UsageError
            The slot is not held.
        """
        if slot not in self._held:
            raise UsageError(f"slot {slot} is not held")
        del self._held[slot]

    @property
    def granted(self) -> frozenset[int]:
        """Slots offered and not yet used."""
        return frozenset(self._granted)

    @property
    def receiving(self) -> dict[int, int]:
        """Slots being written, as ``{slot: seq}``."""
        return dict(self._receiving)

    @property
    def held(self) -> dict[int, int]:
        """Slots with a received frame not yet released, as ``{slot: seq}``."""
        return dict(self._held)

    def free(self) -> list[int]:
        """Slots neither granted, nor being received, nor held."""
        busy = self._granted | self._receiving.keys() | self._held.keys()
        return [s for s in range(self.num_slots) if s not in busy]
