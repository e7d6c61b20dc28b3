"""Lease accounting for the ring: who holds which slot, and when a slot may be reused.

:class:`LeaseBook` is a pure state machine (no I/O, no locks, no clocks).  A slot
is *free* when no subscriber holds a lease on it and the producer holds no local
reference to it (``hold``/``unhold``); only free slots are handed out for
writing.  Leases are created by :meth:`LeaseBook.publishing` and returned by
:meth:`LeaseBook.release` (the RELEASE message), :meth:`LeaseBook.settle` (the
subscriber's read flag, seen first) or, all at once, by
:meth:`LeaseBook.remove_subscriber`.

Every RELEASE must be explained by a lease.  A lease that ended at its read
flag leaves one *due* RELEASE, keyed by the lease's ``(seq, slot)``: that one
message is accepted as no news, once.  Any other RELEASE -- one never sent to
that subscriber, a second one of a lease, a wrong or out-of-range slot -- is a
:class:`ProtocolError`, which costs the sender its connection.  At most
:func:`default_max_due` dues are kept per subscriber; past that,
:meth:`LeaseBook.settle` leaves its leases to end by their messages.  An
``"ahead"`` subscriber may also release a frame not published yet, where the
fixed schedule of ``Publisher(ahead=True)`` puts it; its lease ends as the
frame is published.

Two rules keep ``"latest"`` subscribers from ever making the producer wait:
each one's credit is capped at ``max_credit``, and together they never lease
more than ``num_slots - latest_reserve`` slots, so ``latest_reserve`` slots stay
out of their reach.  An eviction rule (:meth:`LeaseBook.overdue`) names the
subscribers that hold a lease longer than a timeout; the clock is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._errors import LeaseStateError, ProtocolError, SlotIndexError, UsageError
from .._slots import first_free_slot

BLOCK = "block"
LATEST = "latest"
#: A ``"block"`` subscriber that takes frames ahead of their messages: the same leases.
AHEAD = "ahead"


def read_flag_done(reached: Callable[[int, int], bool], flag: int, published: int) -> bool:
    """Whether a subscriber's read flag says its lease on a slot has ended.

    ``flag`` locates the subscriber's read flag of the slot for ``reached``
    (the flag page's cyclic comparison, as on the GPU); ``published`` is the
    generation of the frame sent in that slot.  Only that generation counts:
    a flag's older values (a previous owner's, a frame of an earlier round)
    are behind it, and a subscriber never writes one it was not sent.
    """
    return reached(flag, published & 0xFFFFFFFF)


def default_latest_reserve(num_slots: int) -> int:
    """Slots kept out of ``"latest"`` subscribers' reach: 2 (1 for a 2-slot ring, 0 for 1 slot).

    Two, so that a producer which keeps the previous frame's arrays alive while
    it writes the next one still finds a free slot.
    """
    return max(0, min(2, num_slots - 1))


def default_max_due(num_slots: int) -> int:
    """Most RELEASEs due from one subscriber (:meth:`LeaseBook.settle`): ``4 * num_slots``.

    A RELEASE is due for each lease that ended at its read flag while its
    message has not come.  An honest subscriber has at most ``3 * num_slots``
    of them: it holds a RELEASE back only for a frame handed out ahead and not
    confirmed yet (at most ``depth <= num_slots`` of them) and sends every
    other one at once, and the publisher reads the sockets at least once a
    ring while releases are due.  A RELEASE due now is therefore of a frame
    that, at the last such read, was leased to the subscriber (at most
    ``num_slots``) or held back by it (at most ``depth``), or was published
    since (at most ``num_slots``).  The fourth ring is slack.

    Past the bound nothing is refused: :meth:`LeaseBook.settle` stops ending
    that subscriber's leases, which then end by their RELEASE messages, as in
    ``"block"`` mode.  So a subscriber that writes read flags and never sends
    its RELEASEs costs the publisher at most this many entries, and an honest
    one is never dropped because of the bound, whatever the timing.
    """
    return 4 * num_slots


def default_max_credit(num_slots: int) -> int:
    """Default cap on a subscriber's credit: ``num_slots - latest_reserve``, at least 1."""
    return max(1, num_slots - default_latest_reserve(num_slots))


def granted_credit(asked: int, max_credit: int) -> int:
    """The credit granted to a subscriber asking for ``asked``: ``min(asked, max_credit)``, >= 1.

    The channel's one credit rule: the handshake grants it in WELCOME and
    :meth:`LeaseBook.add_subscriber` keeps it.
    """
    return max(1, min(int(asked), int(max_credit)))


@dataclass
class _Subscriber:
    mode: str
    credit: int
    leases: dict[int, int] = field(default_factory=dict)  # seq -> slot, oldest first
    suspended: bool = False  # keeps its leases, receives nothing, is never overdue
    # seq -> slot of each lease that ended at its read flag (:meth:`LeaseBook.settle`)
    # and whose RELEASE message has not come yet: that one message is no news
    due: dict[int, int] = field(default_factory=dict)
    # an "ahead" subscriber: it may release a frame before it is published
    ahead: bool = False
    # seq -> slot of the frames it released before they were published (:meth:`release`)
    early: dict[int, int] = field(default_factory=dict)
    # seq -> slot of the leases of frames published off the schedule (a generation the
    # subscriber could not predict), which end at their read flags only: a RELEASE sent
    # before the frame's message came leaves the predicted generation in the flag
    flag_only: dict[int, int] = field(default_factory=dict)
    # seq -> slot of those whose RELEASE came already: no RELEASE is due when they end
    spent: dict[int, int] = field(default_factory=dict)


class LeaseBook:
    """Lease and local-hold counts for ``num_slots`` slots.

    Parameters
    ----------
    num_slots:
        Number of slots in the ring (at least 1).
    max_credit:
        Cap on every subscriber's credit (default :func:`default_max_credit`);
        a subscriber asking for more is granted this much.
    latest_reserve:
        Slots that ``"latest"`` subscribers together never lease (default
        :func:`default_latest_reserve`).

    Notes
    -----
    Not thread-safe: the owner serialises calls.  :attr:`max_due` (see
    :func:`default_max_due`) bounds, per subscriber, the leases ended at
    their read flag whose RELEASE message is still due.
    """

    def __init__(
        self, num_slots: int, *, max_credit: int | None = None, latest_reserve: int | None = None
    ) -> None:
        if num_slots < 1:
            raise UsageError(f"num_slots must be at least 1, not {num_slots}")
        self.num_slots = num_slots
        if max_credit is None:
            max_credit = default_max_credit(num_slots)
        if max_credit < 1:
            raise UsageError(f"max_credit must be at least 1, not {max_credit}")
        if latest_reserve is None:
            latest_reserve = default_latest_reserve(num_slots)
        if not 0 <= latest_reserve < num_slots:
            raise UsageError(f"latest_reserve must be in 0..{num_slots - 1}, not {latest_reserve}")
        self.max_credit = int(max_credit)
        self.latest_reserve = int(latest_reserve)
        #: Most leases per subscriber ended at their read flag with their RELEASE still due.
        self.max_due = default_max_due(num_slots)
        self._latest_budget = num_slots - self.latest_reserve
        # Per slot: how many "latest" subscribers lease it; and how many slots have any.
        self._latest_count: list[int] = [0] * num_slots
        self._latest_slots = 0
        # Per slot: when its current frame was published (the caller's clock).
        self._since: list[float] = [0.0] * num_slots
        self._subs: dict[int, _Subscriber] = {}
        # Per slot: subscribers holding a lease on its current frame, and that frame's seq.
        self._holders: list[set[int]] = [set() for _ in range(num_slots)]
        self._seq: list[int | None] = [None] * num_slots
        self._holds: list[int] = [0] * num_slots
        self._readers: list[list[int]] = [[] for _ in range(num_slots)]
        #: Leases ended at their read flag whose RELEASE message has not come yet, over
        #: every subscriber: messages the owner must still read from the sockets.
        self.releases_due = 0
        #: ``(seq, slot)`` of the last frame published (:meth:`publishing`), or None
        self.last_published: tuple[int, int] | None = None
        #: Leases ended so far by :meth:`release`, :meth:`settle` or a departure
        #: (:meth:`remove_subscriber`), by whichever caller: the owner reports them
        #: from this count (each once), not from what one of its calls happened to
        #: end, and a wait for a lease ends when it grows.
        self.ended = 0

    # -- subscribers -------------------------------------------------------

    def add_subscriber(self, sub_id: int, mode: str, credit: int) -> int:
        """Register a subscriber.

        Parameters
        ----------
        sub_id:
            Unique id.
        mode:
            ``"block"`` (receives every frame; ``credit`` is informational, the
            ring size bounds its leases) or ``"latest"`` (receives a frame only
            while it holds fewer than ``credit`` leases).
        credit:
            Most outstanding leases for a ``"latest"`` subscriber (at least 1);
            capped at ``max_credit``.

        Returns
        -------
        int
            The credit granted: :func:`granted_credit`, ``min(credit, max_credit)``.

        Raises
        ------
        UsageError
            Duplicate id, unknown mode or credit below 1.
        """
        if sub_id in self._subs:
            raise UsageError(f"subscriber {sub_id} is already registered")
        if mode not in (BLOCK, LATEST, AHEAD):
            raise UsageError(f"mode must be 'block', 'latest' or 'ahead', not {mode!r}")
        ahead = mode == AHEAD
        if ahead:
            mode = BLOCK
        if credit < 1:
            raise UsageError(f"credit must be at least 1, not {credit}")
        granted = granted_credit(credit, self.max_credit)
        self._subs[sub_id] = _Subscriber(mode, granted, ahead=ahead)
        return granted

    def remove_subscriber(self, sub_id: int) -> list[int]:
        """Forget a subscriber and return all its leases at once.

        Parameters
        ----------
        sub_id:
            The subscriber; an unknown id is ignored.

        Returns
        -------
        list[int]
            Slots that became free (no leases, no local holds) because of this.

        Notes
        -----
        Its leases count in :attr:`ended` (a departure returns them as a
        RELEASE would, and wakes whoever waits for one).  The RELEASE messages
        still due from it (:meth:`settle`) will never be read: they leave
        :attr:`releases_due`.
        """
        sub = self._subs.pop(sub_id, None)
        for readers in self._readers:
            if sub_id in readers:
                readers.remove(sub_id)
        if sub is None:
            return []
        self.releases_due -= len(sub.due)
        self.ended += len(sub.leases)
        freed = []
        for slot in sorted(set(sub.leases.values())):
            if sub.mode == LATEST:
                self._latest_drop(slot)
            holders = self._holders[slot]
            holders.discard(sub_id)
            if not holders:
                self._seq[slot] = None
                if not self._holds[slot]:
                    freed.append(slot)
        return freed

    def suspend(self, sub_id: int) -> None:
        """Stop giving subscriber ``sub_id`` frames, keeping the leases it holds.

        For a subscriber that is being dropped while its frames cannot be
        revoked yet (the publisher could not tell it so): its slots stay
        leased until :meth:`remove_subscriber`, it receives no further frame,
        and :meth:`overdue` no longer names it.  An unknown id is ignored.
        """
        sub = self._subs.get(sub_id)
        if sub is not None:
            sub.suspended = True

    def subscribers(self) -> list[int]:
        """Return the registered subscriber ids."""
        return list(self._subs)

    # -- local holds -------------------------------------------------------

    def hold(self, slot: int) -> None:
        """Count one more local reference (a live producer array) to ``slot``."""
        self._check_slot(slot)
        self._holds[slot] += 1

    def unhold(self, slot: int) -> bool:
        """Drop one local reference to ``slot``.

        Returns
        -------
        bool
            True when the slot became free.

        Raises
        ------
        LeaseStateError
            The slot has no local hold.
        """
        self._check_slot(slot)
        if self._holds[slot] == 0:
            raise LeaseStateError(f"unhold of slot {slot}, which has no local hold")
        self._holds[slot] -= 1
        return self.is_free(slot)

    def holds(self, slot: int) -> int:
        """Return the number of local holds on ``slot``."""
        return self._holds[slot]

    # -- frames ------------------------------------------------------------

    def publishing(
        self, slot: int, seq: int, now: float = 0.0, on_schedule: bool = True
    ) -> list[int]:
        """Decide who receives frame ``seq`` in ``slot`` and record their leases.

        Every ``"block"`` subscriber receives it; a ``"latest"`` subscriber
        receives it only while it holds fewer than ``credit`` leases and the
        ``"latest"`` subscribers together lease fewer than ``num_slots -
        latest_reserve`` slots (or already lease this one).  The slot's
        ``readers_to_wait`` list is cleared.

        Parameters
        ----------
        slot:
            A slot without leases (local holds are allowed: the producer's own
            arrays usually still live in the slot it publishes).
        seq:
            The frame's sequence number.
        now:
            The caller's clock, recorded as the start of these leases (for
            :meth:`overdue`).
        on_schedule:
            Whether the frame's generation is the one the schedule predicts,
            so that a RELEASE of an ``"ahead"`` subscriber ends its lease
            (here, for one released early: :meth:`_early`).  The publisher
            passes False when the pool was used outside it: a subscriber that
            released the frame before its message came wrote the predicted
            generation into its read flag, and rewrites it only when the
            message comes.  Every ``"ahead"`` subscriber's lease on such a
            frame then ends only at its read flag (:meth:`settle`; a RELEASE
            before it is no news, and none is due after it), and the producer
            waits for that on the host, as for any lease.

        Returns
        -------
        list[int]
            Subscriber ids that now hold a lease and must be sent the frame.

        Raises
        ------
        LeaseStateError
            The slot still has leases (a bug in the caller).
        """
        self._check_slot(slot)
        if self._holders[slot]:
            raise LeaseStateError(
                f"slot {slot} published while subscribers {sorted(self._holders[slot])} "
                f"still hold frame {self._seq[slot]}"
            )
        receivers = []
        latest_room = self._latest_slots < self._latest_budget
        n_latest = 0
        for sub_id, sub in self._subs.items():
            if sub.suspended:
                continue
            if sub.mode == BLOCK:
                receivers.append(sub_id)
            elif latest_room and len(sub.leases) < sub.credit:
                receivers.append(sub_id)
                n_latest += 1
        released_early = []  # "ahead" subscribers that released this frame before it came
        for sub_id in receivers:
            sub = self._subs[sub_id]
            sub.leases[seq] = slot
            if sub.early and sub.early.pop(seq, None) == slot:
                released_early.append((sub_id, sub))
            elif sub.ahead and not on_schedule:
                sub.flag_only[seq] = slot
        if receivers:
            self._holders[slot].update(receivers)
            self._seq[slot] = seq
            self._since[slot] = now
            if n_latest:
                self._latest_count[slot] = n_latest
                self._latest_slots += 1
        self._readers[slot].clear()
        self.last_published = (seq, slot)
        for sub_id, sub in released_early:
            if on_schedule:
                # its lease ends at once; the producer's stream orders after its read flag
                self._end_lease(sub_id, sub, seq, slot)
            else:
                sub.spent[seq] = slot
        return receivers

    def _latest_drop(self, slot: int) -> None:
        """One ``"latest"`` lease on ``slot`` ended."""
        count = self._latest_count[slot] - 1
        self._latest_count[slot] = count
        if count == 0:
            self._latest_slots -= 1

    def release(self, sub_id: int, seq: int, slot: int) -> bool | None:
        """Take subscriber ``sub_id``'s RELEASE message of frame ``seq`` in ``slot``.

        The message must be explained by a lease: either the subscriber holds
        exactly that lease, which ends here, or that lease ended at its read
        flag (:meth:`settle`) and this is its one RELEASE still due, which is
        then no news.  An ``"ahead"`` subscriber may also release a frame it
        handed out ahead before the frame is published (:meth:`_early`): its
        lease then ends as :meth:`publishing` records it.

        Parameters
        ----------
        sub_id, seq, slot:
            The lease, exactly as published (untrusted: from the subscriber).

        Returns
        -------
        bool or None
            True when the slot became free; None when the lease had ended at
            its read flag already (nothing changes but the due count), or the
            frame is not published yet.

        Raises
        ------
        ProtocolError
            Nothing explains the message: the subscriber is unknown, the slot
            is out of range, or the subscriber neither holds that lease nor
            has its RELEASE due (a frame never sent to it, a second RELEASE of
            a frame, the wrong slot), nor may release it early.  The caller
            drops the subscriber.
        """
        sub = self._subs.get(sub_id)
        if sub is None:
            raise ProtocolError(f"release from unknown subscriber {sub_id}")
        if not 0 <= slot < self.num_slots:
            raise ProtocolError(
                f"subscriber {sub_id} released frame {seq} as slot {slot}, "
                f"outside 0..{self.num_slots - 1}"
            )
        held = sub.leases.get(seq)
        if held is not None and (sub.spent or sub.flag_only):
            if seq in sub.spent:
                raise ProtocolError(f"subscriber {sub_id} released frame {seq} twice")
            if sub.flag_only.get(seq) == slot:  # published off the schedule
                del sub.flag_only[seq]
                sub.spent[seq] = slot  # the lease ends at its read flag
                return None
        if held is None:
            held = sub.due.get(seq)
            if held is None:
                if sub.ahead and self._early(sub_id, sub, seq, slot):
                    return None
                raise ProtocolError(
                    f"subscriber {sub_id} released frame {seq}, which it does not hold "
                    "(never sent to it, or released already)"
                )
            if held != slot:
                raise ProtocolError(
                    f"subscriber {sub_id} released frame {seq} as slot {slot}, "
                    f"but it was in slot {held}"
                )
            del sub.due[seq]  # its lease ended at its read flag: this message is no news
            self.releases_due -= 1
            return None
        if held != slot:
            raise ProtocolError(
                f"subscriber {sub_id} released frame {seq} as slot {slot}, but it is in slot {held}"
            )
        return self._end_lease(sub_id, sub, seq, slot)

    def _early(self, sub_id: int, sub: _Subscriber, seq: int, slot: int) -> bool:
        """Note an ``"ahead"`` subscriber's RELEASE of frame ``seq``, not published yet.

        Such a subscriber hands frame *k + n* out once it received frame *k*
        (``n``: the ring's slots) by message, and may release it at once; its
        RELEASE can then arrive before the frame is published.  It is
        explained only by the fixed schedule of a ``Publisher(ahead=True)``:
        ``seq`` within ``num_slots`` after the last frame published, in the slot
        that schedule gives it, released once.  The lease then ends as
        :meth:`publishing` records it (its slot is free at once; the
        producer's stream still orders after the read flag).

        Returns
        -------
        bool
            True when noted; False when ``seq`` is not a frame to come (the
            caller refuses the message).

        Raises
        ------
        ProtocolError
            ``seq`` is a frame to come, but not in ``slot``, or released already.
        """
        last = self.last_published
        if last is None or not 0 < seq - last[0] <= self.num_slots:
            return False
        expected = (last[1] + seq - last[0]) % self.num_slots
        if slot != expected:
            raise ProtocolError(
                f"subscriber {sub_id} released frame {seq} (not published yet) as slot "
                f"{slot}; the publisher's schedule puts it in slot {expected}"
            )
        if seq in sub.early:
            raise ProtocolError(f"subscriber {sub_id} released frame {seq} twice")
        for gone in [s for s in sub.early if s <= last[0]]:
            del sub.early[gone]  # published without it (suspended meanwhile): nothing to end
        sub.early[seq] = slot
        return True

    def settle(self, sub_id: int, slot: int) -> bool | None:
        """End subscriber ``sub_id``'s lease on ``slot``'s frame: its read flag says it released it.

        The RELEASE message that the subscriber still sends for that frame is
        then due: :meth:`release` answers it, once, with None.  The caller
        looks at the flag (the sync page is host memory): the subscriber's
        stream writes it at release, after its work on the frame, so a flag at
        the frame's generation means what the message would.

        While the subscriber has :attr:`max_due` RELEASEs due, its lease is
        left to end by its message (None is returned): a subscriber that
        writes read flags but sends no RELEASE cannot grow the book.

        Returns
        -------
        bool or None
            True when the slot became free, False when it did not; None when
            the lease was kept because of the bound.

        Raises
        ------
        LeaseStateError
            The subscriber holds no lease on the slot's frame (a bug in the caller).
        """
        sub = self._subs.get(sub_id)
        seq = self._seq[slot]
        if sub is None or seq is None or sub.leases.get(seq) != slot:
            raise LeaseStateError(f"subscriber {sub_id} holds no lease on slot {slot}")
        if sub.spent and sub.spent.pop(seq, None) is not None:
            return self._end_lease(sub_id, sub, seq, slot)  # its RELEASE came already
        if sub.flag_only:
            sub.flag_only.pop(seq, None)  # ended at its flag: its RELEASE is due as usual
        if len(sub.due) >= self.max_due:
            return None
        sub.due[seq] = slot
        self.releases_due += 1
        return self._end_lease(sub_id, sub, seq, slot)

    def settle_flagged(self, reached: Callable[[int, int], bool], slot: int | None = None) -> int:
        """:meth:`settle` every lease for which ``reached(sub_id, slot)`` is True; return how many.

        Looks at the holders of ``slot``'s frame, or of every leased slot when
        ``slot`` is None, except those with :attr:`max_due` RELEASEs due (their
        leases end by message).  ``reached`` is the caller's look at the
        holder's read flag for that slot, at the generation of the frame it
        was sent.
        """
        holders = self._holders
        subs = self._subs
        max_due = self.max_due
        slots = range(self.num_slots) if slot is None else (slot,)
        ended = 0
        for s in slots:
            if holders[s]:
                for sub_id in [
                    h for h in holders[s] if len(subs[h].due) < max_due and reached(h, s)
                ]:
                    if self.settle(sub_id, s) is not None:
                        ended += 1
        return ended

    def _end_lease(self, sub_id: int, sub: _Subscriber, seq: int, slot: int) -> bool:
        del sub.leases[seq]
        self.ended += 1
        if sub.mode == LATEST:
            self._latest_drop(slot)
        holders = self._holders[slot]
        holders.discard(sub_id)
        readers = self._readers[slot]
        if sub_id not in readers:
            readers.append(sub_id)
        if holders:
            return False
        self._seq[slot] = None
        return self._holds[slot] == 0

    def cancel(self, sub_id: int, seq: int, slot: int) -> bool:
        """Undo a lease that was never delivered (the frame could not be sent).

        Unlike :meth:`release`, the subscriber is not added to the slot's
        ``readers_to_wait`` (it never read the slot).

        Returns
        -------
        bool
            True when the slot became free.

        Raises
        ------
        ProtocolError
            The subscriber does not hold that lease.
        """
        sub = self._subs.get(sub_id)
        if sub is None or sub.leases.get(seq) != slot:
            raise ProtocolError(f"subscriber {sub_id} holds no lease on frame {seq} in slot {slot}")
        del sub.leases[seq]
        if sub.spent or sub.flag_only:
            sub.spent.pop(seq, None)
            sub.flag_only.pop(seq, None)
        if sub.mode == LATEST:
            self._latest_drop(slot)
        holders = self._holders[slot]
        holders.discard(sub_id)
        if holders:
            return False
        self._seq[slot] = None
        return self._holds[slot] == 0

    # -- queries -----------------------------------------------------------

    def is_free(self, slot: int) -> bool:
        """Return True when ``slot`` has no leases and no local holds."""
        return not self._holders[slot] and self._holds[slot] == 0

    def lease_count(self, slot: int) -> int:
        """Return how many subscribers lease ``slot`` (the cheap form of :meth:`leases`)."""
        return len(self._holders[slot])

    def any_leased(self) -> bool:
        """Return True while any subscriber holds any lease."""
        return any(self._holders)

    def free_slots(self) -> list[int]:
        """Return all free slots in index order."""
        return [s for s in range(self.num_slots) if self.is_free(s)]

    def leases(self, slot: int) -> list[tuple[int, int]]:
        """Return the ``(sub_id, seq)`` leases on ``slot``, sorted by subscriber id."""
        seq = self._seq[slot]
        if seq is None:
            return []
        return [(sub_id, seq) for sub_id in sorted(self._holders[slot])]

    def outstanding(self, sub_id: int) -> int:
        """Return how many leases subscriber ``sub_id`` holds (0 when unknown)."""
        sub = self._subs.get(sub_id)
        return 0 if sub is None else len(sub.leases)

    def held_by(self, sub_id: int) -> dict[int, int]:
        """Return subscriber ``sub_id``'s leases as ``{seq: slot}``."""
        sub = self._subs.get(sub_id)
        return {} if sub is None else dict(sub.leases)

    def credit(self, sub_id: int) -> int:
        """Return subscriber ``sub_id``'s granted credit (0 when unknown)."""
        sub = self._subs.get(sub_id)
        return 0 if sub is None else sub.credit

    def latest_leased_slots(self) -> int:
        """Return how many slots carry a ``"latest"`` subscriber's lease."""
        return self._latest_slots

    # -- eviction rule -----------------------------------------------------

    def oldest_lease(self, sub_id: int) -> float | None:
        """Return when subscriber ``sub_id``'s oldest lease began (None: it holds none)."""
        sub = self._subs.get(sub_id)
        if sub is None or not sub.leases:
            return None
        return self._since[next(iter(sub.leases.values()))]

    def overdue(self, now: float, timeout: float) -> list[int]:
        """Return the subscribers holding a lease that began more than ``timeout`` before ``now``.

        Parameters
        ----------
        now:
            The caller's clock (the same one passed to :meth:`publishing`).
        timeout:
            Longest a lease may be held.

        Returns
        -------
        list[int]
            Subscriber ids to evict (with :meth:`remove_subscriber`), in id order.
        """
        since = self._since
        limit = now - timeout
        out = []
        for sub_id, sub in self._subs.items():
            if sub.leases and not sub.suspended and since[next(iter(sub.leases.values()))] < limit:
                out.append(sub_id)
        return sorted(out)

    def next_expiry(self, timeout: float) -> float | None:
        """Return the earliest time a lease held now becomes overdue (None: no leases)."""
        since = self._since
        starts = [
            since[next(iter(sub.leases.values()))]
            for sub in self._subs.values()
            if sub.leases and not sub.suspended
        ]
        return min(starts) + timeout if starts else None

    def readers_to_wait(self, slot: int) -> list[int]:
        """Return subscribers that released ``slot`` since it was last published.

        The producer's stream must wait on their read flags before writing
        the slot again.
        """
        return list(self._readers[slot])

    def pick_free_slot(self, start: int) -> int | None:
        """Scan round-robin from ``start`` for a free slot.

        The rule of :func:`~cupy_ipcpool._slots.first_free_slot` (the pool's
        too); free: no lease and no local hold.

        Parameters
        ----------
        start:
            First slot to look at (taken modulo ``num_slots``).

        Returns
        -------
        int or None
            The first free slot, or None when every slot is leased or held.
        """
        holders = self._holders
        holds = self._holds
        return first_free_slot(start, self.num_slots, lambda s: holders[s] or holds[s])

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlotIndexError(f"slot {slot} is outside 0..{self.num_slots - 1}")


__all__ = [
    "BLOCK",
    "LATEST",
    "LeaseBook",
    "default_latest_reserve",
    "default_max_credit",
    "default_max_due",
    "granted_credit",
]
