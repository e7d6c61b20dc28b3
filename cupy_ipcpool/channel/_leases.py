"""Lease accounting for the ring: who holds which slot, and when a slot may be reused.

:class:`LeaseBook` is a pure state machine (no I/O, no locks, no clocks), the
engine's (``c/src/leases.c``, through ``_engine.LeaseCore``): this module documents
its rules and keeps its Python API.  A slot
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
from typing import TYPE_CHECKING

from .._compiled import loader
from ._protocol import ENGINE_PROTOCOL

if TYPE_CHECKING:  # the engine is loaded at the first book (_engine below)
    from .._engine import LeaseCore, PublisherSession

#: The engine: every rule of the book is c/src/leases.c's (``LeaseCore``); this module
#: documents them and keeps the Python API.
_engine = loader("cupy_ipcpool._engine", PROTOCOL=ENGINE_PROTOCOL)

BLOCK = "block"
LATEST = "latest"
#: A ``"block"`` subscriber that takes frames ahead of their messages: the same leases.
AHEAD = "ahead"


def default_latest_reserve(num_slots: int) -> int:
    """Slots kept out of ``"latest"`` subscribers' reach: 2 (1 for a 2-slot ring, 0 for 1 slot).

    Two, so that a producer which keeps the previous frame's arrays alive while
    it writes the next one still finds a free slot.
    """
    return int(_engine().lease_defaults(num_slots)[0])


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
    return int(_engine().lease_defaults(num_slots)[1])


def default_max_credit(num_slots: int) -> int:
    """Default cap on a subscriber's credit: ``num_slots - latest_reserve``, at least 1."""
    return int(_engine().lease_defaults(num_slots)[2])


def granted_credit(asked: int, max_credit: int) -> int:
    """The credit granted to a subscriber asking for ``asked``: ``min(asked, max_credit)``, >= 1.

    The channel's one credit rule: the handshake grants it in WELCOME and
    :meth:`LeaseBook.add_subscriber` keeps it.
    """
    return int(_engine().granted_credit(int(asked), int(max_credit)))


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
        self._core: LeaseCore = _engine().LeaseCore(
            num_slots, max_credit=max_credit, latest_reserve=latest_reserve
        )
        self.num_slots = num_slots
        self.max_credit = self._core.max_credit
        self.latest_reserve = self._core.latest_reserve
        #: Most leases per subscriber ended at their read flag with their RELEASE still due.
        self.max_due = self._core.max_due

    @property
    def releases_due(self) -> int:
        """Leases ended at their read flag whose RELEASE message has not come yet, over
        every subscriber: messages the owner must still read from the sockets."""
        return self._core.releases_due

    @property
    def last_published(self) -> tuple[int, int] | None:
        """``(seq, slot)`` of the last frame published (:meth:`publishing`), or None."""
        return self._core.last_published

    @property
    def ended(self) -> int:
        """Leases ended so far by :meth:`release`, :meth:`settle` or a departure
        (:meth:`remove_subscriber`), by whichever caller: the owner reports them from
        this count (each once), not from what one of its calls happened to end, and a
        wait for a lease ends when it grows."""
        return self._core.ended

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
        return self._core.add_subscriber(sub_id, mode, credit)

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
        return self._core.remove_subscriber(sub_id)

    def suspend(self, sub_id: int) -> None:
        """Stop giving subscriber ``sub_id`` frames, keeping the leases it holds.

        For a subscriber that is being dropped while its frames cannot be
        revoked yet (the publisher could not tell it so): its slots stay
        leased until :meth:`remove_subscriber`, it receives no further frame,
        and :meth:`overdue` no longer names it.  An unknown id is ignored.
        """
        self._core.suspend(sub_id)

    def subscribers(self) -> list[int]:
        """Return the registered subscriber ids."""
        return self._core.subscribers()

    # -- local holds -------------------------------------------------------

    def hold(self, slot: int) -> None:
        """Count one more local reference (a live producer array) to ``slot``."""
        self._core.hold(slot)

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
        return self._core.unhold(slot)

    def holds(self, slot: int) -> int:
        """Return the number of local holds on ``slot``."""
        return self._core.holds(slot)

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
        return self._core.publishing(slot, seq, now, on_schedule)

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
        return self._core.release(sub_id, seq, slot)

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
        return self._core.settle(sub_id, slot)

    def settle_flagged(self, reached: Callable[[int, int], bool], slot: int | None = None) -> int:
        """:meth:`settle` every lease for which ``reached(sub_id, slot)`` is True; return how many.

        Looks at the holders of ``slot``'s frame, or of every leased slot when
        ``slot`` is None, except those with :attr:`max_due` RELEASEs due (their
        leases end by message).  ``reached`` is the caller's look at the
        holder's read flag for that slot, at the generation of the frame it
        was sent.
        """
        return self._core.settle_flagged(reached, slot)

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
        return self._core.cancel(sub_id, seq, slot)

    # -- queries -----------------------------------------------------------

    def is_free(self, slot: int) -> bool:
        """Return True when ``slot`` has no leases and no local holds."""
        return self._core.is_free(slot)

    def lease_count(self, slot: int) -> int:
        """Return how many subscribers lease ``slot`` (the cheap form of :meth:`leases`)."""
        return self._core.lease_count(slot)

    def session(self, lease_timeout: float | None, send_timeout: float) -> PublisherSession:
        """A new publisher session over this book: the adopted subscribers' sockets.

        The engine's ``PublisherSession`` (``c/src/pub_session.c``) owns each
        subscriber's socket from ``add`` on.  ``publish`` publishes a frame
        (:meth:`publishing`) and sends it to every receiver (a full ``"latest"``
        socket skips it, a full ``"block"`` one is waited for up to
        ``send_timeout``, then evicted); ``take`` reads the subscribers' messages,
        each RELEASE into this book; ``expire`` evicts whoever holds a frame past
        ``lease_timeout``.  An evicted subscriber is told why behind the frames
        queued for it before its leases come back.  Each call returns those that
        left, ``[(sub_id, why)]``, their sockets closed and their leases back.
        The owner serialises calls to the session and the book alike.
        """
        return _engine().PublisherSession(self._core, lease_timeout, send_timeout)

    def any_leased(self) -> bool:
        """Return True while any subscriber holds any lease."""
        return self._core.any_leased()

    def free_slots(self) -> list[int]:
        """Return all free slots in index order."""
        return self._core.free_slots()

    def leases(self, slot: int) -> list[tuple[int, int]]:
        """Return the ``(sub_id, seq)`` leases on ``slot``, sorted by subscriber id."""
        return self._core.leases(slot)

    def outstanding(self, sub_id: int) -> int:
        """Return how many leases subscriber ``sub_id`` holds (0 when unknown)."""
        return self._core.outstanding(sub_id)

    def held_by(self, sub_id: int) -> dict[int, int]:
        """Return subscriber ``sub_id``'s leases as ``{seq: slot}``."""
        return self._core.held_by(sub_id)

    def credit(self, sub_id: int) -> int:
        """Return subscriber ``sub_id``'s granted credit (0 when unknown)."""
        return self._core.credit(sub_id)

    def latest_leased_slots(self) -> int:
        """Return how many slots carry a ``"latest"`` subscriber's lease."""
        return self._core.latest_slots

    # -- eviction rule -----------------------------------------------------

    def oldest_lease(self, sub_id: int) -> float | None:
        """Return when subscriber ``sub_id``'s oldest lease began (None: it holds none)."""
        return self._core.oldest_lease(sub_id)

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
        return self._core.overdue(now, timeout)

    def next_expiry(self, timeout: float) -> float | None:
        """Return the earliest time a lease held now becomes overdue (None: no leases)."""
        return self._core.next_expiry(timeout)

    def readers_to_wait(self, slot: int) -> list[int]:
        """Return subscribers that released ``slot`` since it was last published.

        The producer's stream must wait on their read flags before writing
        the slot again.
        """
        return self._core.readers_to_wait(slot)

    def pick_free_slot(self, start: int) -> int | None:
        """Scan round-robin from ``start`` for a free slot.

        The rule of :func:`~cupy_ipcpool._slots.first_free_slot` (the pool's
        too), the engine's (``c/src/leases.c``): the producer's ``acquire`` picks
        so; free: no lease and no local hold.

        Parameters
        ----------
        start:
            First slot to look at (taken modulo ``num_slots``).

        Returns
        -------
        int or None
            The first free slot, or None when every slot is leased or held.
        """
        return self._core.pick_free(start)


__all__ = [
    "BLOCK",
    "LATEST",
    "LeaseBook",
    "default_latest_reserve",
    "default_max_credit",
    "default_max_due",
    "granted_credit",
]
