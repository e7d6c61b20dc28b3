"""The producer side of a channel session, without the GPU parts: :class:`PublisherCore`.

It listens on a filesystem path (the engine's accept thread, ``c/src/acceptor.c``,
welcomes subscribers with a :class:`~._handshake.Welcome`), hands out free
slots, publishes frames and collects leases back.  The GPU layer
(:mod:`._publisher`) wraps it: it fills the opaque payloads (pool descriptor,
array handles) and provides the slot fds.

A ``"latest"`` subscriber's credit is capped so that it never makes the
producer wait; an optional lease timeout evicts a subscriber that holds a
frame too long (its notice is queued and its connection shut down before its
leases return to the ring).

Hot path (``acquire``/``publish``/``poll``): the caller's thread, one
``send``/``recv`` per message, fixed layouts, ``poll(2)`` for waiting.  Each
step's socket work and its rules are one engine call on the lease book's
session (``c/src/pub_session.c``, :meth:`LeaseBook.session`), which owns the
adopted subscribers' sockets: ``publish`` gives the frame to the receivers the
book names (waiting for a full ``"block"`` socket, evicting it after
``send_timeout``), ``take`` reads the subscribers' messages into the book,
``expire`` evicts whoever holds a frame past ``lease_timeout``.  Who left comes
back here, for ``on_leave``.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .._errors import PoolClosedError, SlotBusyError
from .._transport._closing import ClosedFlag, close_in_forked_children
from .._transport._unix import allowed_uid_set, check_socket_path, unlink_if_ours
from . import _leases, _sockets
from ._handshake import (
    HANDSHAKE_TIMEOUT,
    MAX_PENDING_PER_UID,
    SubscriberInfo,
    Welcome,
)
from ._leases import LeaseBook
from ._sockets import _spin_ns, _us, _warn

if TYPE_CHECKING:
    from .._engine import Producer, PublisherSession

#: What the engine's accept thread tells of a subscriber: (sub_id, fd, pid, uid, mode,
#: credit, hello, peer_pid, row).
_Taken = tuple[int, int, int, int, str, int, bytes, int, "int | None"]


def _unlink_ours(address: str, ident: tuple[int, int]) -> None:
    """Remove the socket file at ``address`` if it is still this publisher's; warns on failure."""
    try:
        unlink_if_ours(address, ident)
    except OSError as exc:
        _warn(f"could not remove the socket file {address}: {exc}")


def _info(taken: _Taken) -> SubscriberInfo:
    sub_id, _fd, pid, uid, mode, credit, hello, peer_pid, _row = taken
    return SubscriberInfo(sub_id, pid, uid, mode, credit, hello, peer_pid)


def _close_publisher(
    producer: Producer,
    session: PublisherSession,
    address: str,
    ident: tuple[int, int],
    pid: int,
) -> None:
    """Tear a publisher down (also its finalizer); warns instead of raising.

    As the finalizer of a publisher made in process ``pid``, in a child forked from it
    (collected there, or at its exit) it does nothing: the subscribers and the socket
    file are the parent's, and a BYE, the drain of their sockets (their RELEASEs) or
    the unlink would end the parent's channel.  The engine's objects, freed with the
    publisher, close only this process's copies of the fds, without a word
    (``cipi_pubsession_free``; ``cipi_acceptor_free`` joins no thread in a forked
    child, ``c/src/acceptor.c``).  :meth:`PublisherCore.close` keeps the same rule.
    """
    if os.getpid() != pid:
        return
    try:
        producer.stop()
    except Exception as exc:
        _warn(f"stopping the accept thread failed: {exc!r}")
    try:
        session.close(0.0)  # BYE to each subscriber, every socket closed
    except Exception as exc:
        _warn(f"closing the subscribers' sockets failed: {exc!r}")
    _unlink_ours(address, ident)


class PublisherCore(ClosedFlag):
    """The producer side of a channel: listen, welcome, lease slots, publish frames.

    Parameters
    ----------
    address:
        Filesystem path of the Unix socket.  A stale socket file (nobody
        listening) is replaced; a live one is refused.
    num_slots:
        Number of slots in the ring.
    welcome:
        What each subscriber is welcomed with (:class:`~._handshake.Welcome`:
        the payload, the fds, its row of read flags, the modes refused).  The
        accept thread composes each WELCOME from it and calls no user code.
    allowed_uids:
        Uids that may subscribe (``SO_PEERCRED``); default: this process's
        effective uid only, and the socket file is mode 0600.  When other uids
        are allowed the file is 0666 and the uid check alone decides.
    on_join, on_leave:
        Called in the producer's thread when a subscriber is adopted (at the
        next ``poll``/``acquire``/``publish``) and when it leaves (BYE, EOF,
        error, out-of-protocol message, eviction).  ``on_leave`` is also called
        for a subscriber that was welcomed but never adopted (the WELCOME could
        not be sent, or it hung up before adoption), without an ``on_join``
        before it: in the producer's thread too, at its next call (or at
        ``close``).  Exceptions become ``RuntimeWarning``.
    max_subscribers:
        Further subscribers are refused.
    send_timeout:
        How long a ``"block"`` subscriber's full socket may stall ``publish``
        before that subscriber is dropped.
    max_credit:
        Cap on a subscriber's credit (default
        :func:`~cupy_ipcpool.channel._leases.default_max_credit`: ``num_slots - 2``, at
        least 1).  Together with the ring's reserve (``"latest"`` subscribers
        never lease the last two slots) it makes ``"latest"`` never stall the
        producer, whatever credit a subscriber asks for.
    lease_timeout:
        Seconds a subscriber may hold a frame; one that holds a frame longer
        is evicted (told why, disconnected, its leases taken back).  None (the
        default): no limit, a ``"block"`` subscriber that never releases
        stalls the producer until ``acquire`` times out.
    handshake_timeout:
        Seconds a connection has, from accept, to send its HELLO.
    max_pending_per_uid:
        Most handshakes of one uid in progress at once; one more makes the
        oldest of that uid go.
    spin_us:
        Microseconds :meth:`poll` with a timeout busy-polls the subscribers'
        sockets before it sleeps (default 0: no spin, no CPU while waiting).

    Notes
    -----
    Not thread-safe: call every method from one thread.  The accept thread only
    appends to lock-protected lists (welcomed; welcomed and gone before adoption)
    and reaps the welcomed that hang up.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        num_slots: int,
        *,
        welcome: Welcome,
        allowed_uids: Iterable[int] | None = None,
        on_join: Callable[[SubscriberInfo], object] | None = None,
        on_leave: Callable[[SubscriberInfo], object] | None = None,
        max_subscribers: int = 64,
        send_timeout: float = 5.0,
        max_credit: int | None = None,
        lease_timeout: float | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending_per_uid: int = MAX_PENDING_PER_UID,
        spin_us: float = 0.0,
    ) -> None:
        _sockets._load_frameio()
        self._spin_ns = _spin_ns(spin_us)
        self.address = check_socket_path(address)  # refused here, before a stale file is probed
        engine = _leases._engine()
        # the one rule of a publisher's options (c/src/publisher.c: cipi_pub_check_options)
        engine.check_publisher_options(
            num_slots=num_slots,
            max_subscribers=max_subscribers,
            max_credit=max_credit,
            lease_timeout=lease_timeout,
            send_timeout=send_timeout,
            handshake_timeout=handshake_timeout,
            max_pending_per_uid=max_pending_per_uid,
        )
        self.num_slots = int(num_slots)
        self._book = LeaseBook(self.num_slots, max_credit=max_credit)
        self.max_credit = self._book.max_credit
        self.lease_timeout = lease_timeout
        euid = os.geteuid()
        allowed = allowed_uid_set(allowed_uids, euid)
        self.allowed_uids = allowed
        self._on_join = on_join
        self._on_leave = on_leave
        #: the adopted subscribers' sockets: frames out, messages in, eviction (the engine's)
        self._session = self._book.session(lease_timeout, send_timeout)
        self._closed = False
        self.last_leave_reason = ""

        # the publisher's socket (c/src/listen.c: a stale file replaced, the mode by who may
        # connect, the backlog), listening before its file appears
        listener, dev, ino = engine.publisher_listen(self.address, sorted(allowed), max_subscribers)
        ident = (dev, ino)
        try:
            # the engine's accept thread (c/src/acceptor.c); it owns the listener from here on
            self._acc = engine.Acceptor(
                listener,
                num_slots=self.num_slots,
                payload=welcome.payload,
                fds=welcome.fds,
                rows=welcome.rows,
                row_at=welcome.row_at,
                refuse=dict(welcome.refuse),
                allowed_uids=sorted(allowed),
                max_subscribers=max_subscribers,
                max_credit=self.max_credit,
                lease_timeout_ms=0 if lease_timeout is None else math.ceil(lease_timeout * 1000),
                handshake_timeout=handshake_timeout,
                max_pending_per_uid=max_pending_per_uid,
            )
        except BaseException:
            os.close(listener)
            os.unlink(self.address)
            raise
        self._ident = ident
        #: the producer's calls: adoption, the next seq, the pick of a free slot, the count
        #: of leases ended (c/src/producer.c)
        self._producer = engine.Producer(self._session, self._acc)
        #: the process that made it: in another (a forked child) closing touches nothing
        #: of the parent's channel (close, _close_publisher)
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(
            self, _close_publisher, self._producer, self._session, self.address, ident, self._pid
        )
        self._acc.start()
        close_in_forked_children(self)  # a child's copies would hide this process's death

    # -- context manager / teardown --

    def close(self, linger: float = 0.0) -> bool:
        """Stop accepting, say BYE to every subscriber, close every socket.

        Accepting stops first: the listening socket is closed and its file
        removed, and handshakes in progress end without a WELCOME, before any
        BYE is sent.  So a subscriber that connects during ``close`` is never
        welcomed only to be told BYE (one that waits for a publisher, such as
        a :class:`~cupy_ipcpool.channel.Follower`, finds nobody listening and
        waits for the next one).

        Parameters
        ----------
        linger:
            Seconds to wait, after the BYE, for every subscriber (adopted, or
            welcomed and not yet adopted) to disconnect before the sockets are
            closed.

        In a process other than the one that made the publisher (a child forked
        from it, such as the GPU layer's finalizers run there) the channel is the
        parent's: nothing is stopped, sent, read, shut down or unlinked (no BYE, the
        subscribers' RELEASEs left for the parent, the socket file kept), no
        callback is called and ``linger`` is ignored.  The publisher is closed here
        all the same (its calls raise :class:`PoolClosedError`), and this process's
        copies of the fds are closed at once without a word: the accept side's
        (listener, the WELCOME's fds) and the subscribers' sockets.  A
        child forked while the publisher is open does this at the fork
        (:func:`~cupy_ipcpool._transport._closing.close_in_forked_children`).

        Returns
        -------
        bool
            True when every subscriber had disconnected (always True with
            ``linger=0`` and no subscribers; False when some were still
            connected when the sockets were closed).  In a forked child False:
            the subscribers are the parent's, still connected.  A second call
            returns True.

        Idempotent; never raises (problems become :class:`TeardownWarning`).
        """
        if self._closed:
            return True
        self._closed = True
        if os.getpid() != self._pid:  # a forked child: our copies only (see above)
            self._finalizer.detach()  # (it would do nothing here either)
            try:  # the forked child's stop: joins nothing, takes no lock, closes our copies
                self._acc.stop()
            except Exception as exc:
                _warn(f"closing the accept thread's copies failed: {exc!r}")
            try:  # the subscribers' sockets: our copies, closed without a word
                self._session.forget()
            except Exception as exc:
                _warn(f"closing the subscribers' sockets' copies failed: {exc!r}")
            return False
        session = self._session
        try:  # welcomed, not adopted: told BYE and lingered for alike
            self._tell(self._producer.stop())
        except Exception as exc:
            _warn(f"stopping the accept thread failed: {exc!r}")
        if self._acc.failure is not None:  # it had ended before: nobody was welcomed since
            _warn(f"the publisher's accept thread had stopped: {self._acc.failure}")
        _unlink_ours(self.address, self._ident)
        try:
            all_gone = session.close(linger)
        except Exception as exc:
            _warn(f"closing the subscribers' sockets failed: {exc!r}")
            all_gone = False
        self._finalizer()
        return all_gone

    def _check_open(self) -> None:
        if self._closed:
            if os.getpid() != self._pid:
                raise PoolClosedError(
                    f"the publisher at {self.address} was made in process {self._pid}; a "
                    "child created by fork closes its copy at once (a channel end belongs to "
                    "the process that made it: publish from the child with a publisher of "
                    "its own, or start it with spawn)"
                )
            raise PoolClosedError(f"publisher at {self.address} is closed")

    # -- state --

    @property
    def subscribers(self) -> list[SubscriberInfo]:
        """The adopted subscribers (an evicted one is not, even while its notice waits)."""
        return [_info(taken) for taken in self._producer.subscribers()]

    @property
    def lease_book(self) -> LeaseBook:
        """The lease accounting (read it; mutate only through this class)."""
        return self._book

    @property
    def next_seq(self) -> int:
        """Sequence number the next :meth:`publish` assigns."""
        return self._producer.next_seq

    @property
    def welcomed(self) -> int:
        """Subscribers a WELCOME was made for so far (sent or not, adopted or not)."""
        return self._acc.welcomed

    @property
    def evictions(self) -> int:
        """Subscribers evicted so far: held a frame past ``lease_timeout``, or a full socket.

        Each was told why (an eviction notice behind the frames queued for it,
        none of which it hands out) before its leases came back to the ring.
        """
        return self._session.evictions

    def read_flags(self, page: object, reads_offset: int, rows: int) -> None:
        """Read the subscribers' read flags from ``page`` (the sync page's host mapping,
        held until :meth:`close`): ``rows`` rows of ``num_slots`` flags from byte
        ``reads_offset`` on.  Each subscriber's row is given by :meth:`set_row`."""
        self._session.flags(page, reads_offset, rows)

    def set_row(self, sub_id: int, row: int) -> None:
        """Subscriber ``sub_id`` (adopted) writes its read flags in row ``row``."""
        self._session.set_row(sub_id, row)

    def settle(self, slot: int | None = None) -> int:
        """End every lease (of ``slot``, or of every slot) whose subscriber's read flag holds
        the generation published there; return how many ended.

        With ``Publisher(ahead=True)`` a lease ends when its read flag says so,
        before the RELEASE message (which then is no news).  The engine reads
        the flags (``c/src/pub_session.c``); nothing without :meth:`read_flags`.
        """
        return self._session.settle(-1 if slot is None else slot)

    def hold(self, slot: int) -> None:
        """Count a local reference (a live producer array) to ``slot``."""
        self._book.hold(slot)

    def unhold(self, slot: int) -> bool:
        """Drop a local reference to ``slot``; True when the slot became free."""
        return self._book.unhold(slot)

    # -- hot path --

    def poll(self, timeout: float | None = 0.0, settle: bool = False) -> int:
        """Adopt new subscribers and process their messages.

        Parameters
        ----------
        timeout:
            Seconds to wait for a lease to end (None: until one does; 0: do not wait).
        settle:
            Whether leases also end at the subscribers' read flags
            (``Publisher(ahead=True)``, :meth:`settle`), looked at after the
            messages.  While such leases are held, a waiting poll looks again
            at growing intervals (``CIPI_SETTLE_RECHECK_*`` in
            ``c/src/cip_internal.h``) and in every round of its spin, since
            nothing wakes it when a flag is set.

        Returns
        -------
        int
            Number of leases returned since the previous ``poll``, each counted
            once, however it ended: a RELEASE, a read flag, or its subscriber's
            departure (BYE, hang-up, death, eviction), in this call or in
            another that read the sockets or the flags meanwhile
            (:meth:`publish`, :meth:`acquire`, a look at a slot's leases).  A
            wait ends as soon as one ends; while some are still unreported,
            the call does not wait.

        The wait is one engine call (``PublisherSession.poll``,
        ``c/src/pub_poll.c``): the eviction notices that wait for room are
        tried again, the sockets are read (each RELEASE into the lease book; a
        subscriber that ends is dropped there), the read flags looked at, the
        leases past ``lease_timeout`` evicted; with ``spin_us`` it first looks
        without sleeping.  Who left comes back here, for ``on_leave``.
        """
        if self._closed:
            self._check_open()  # raises
        producer = self._producer
        returned = producer.poll(_us(timeout), self._spin_ns, settle)
        if producer.has_news:
            self._tell(producer.news())
        return int(returned)

    def acquire(self, timeout: float | None = None) -> tuple[int, list[int]]:
        """Return a free slot to write the next frame into.

        Slots are scanned round-robin after the last published one.  While
        none is free, waits for subscribers' releases (or departures).

        Parameters
        ----------
        timeout:
            Seconds to wait (None: forever).

        Returns
        -------
        slot : int
            A slot with no leases and no local holds.
        readers : list[int]
            Subscribers that read the slot since it was last published: the
            producer must wait on their read flags before writing it.

        Raises
        ------
        SlotBusyError
            No slot became free in time; the message says who holds what.
        PoolClosedError
            The publisher is closed.
        """
        self._check_open()
        producer = self._producer
        slot = producer.acquire(_us(timeout))
        if producer.has_news:
            self._tell(producer.news())
        if slot is None:
            raise SlotBusyError(self._busy_message(timeout))
        return slot, self._book.readers_to_wait(slot)

    def publish(
        self, slot: int, payload: bytes = b"", on_schedule: bool = True, generation: int = 0
    ) -> int:
        """Send frame ``(next seq, slot, payload)`` to the subscribers that take it.

        Every ``"block"`` subscriber receives it (a full socket stalls up to
        ``send_timeout``, then that subscriber is dropped); a ``"latest"``
        subscriber receives it while it holds fewer than ``credit`` frames and
        its socket has room, and otherwise skips it.

        Parameters
        ----------
        slot:
            The slot written (usually from :meth:`acquire`); it must have no leases.
        payload:
            Opaque bytes, at most 64 KiB.
        on_schedule:
            Whether the frame's generation is the one ``"ahead"`` subscribers
            predict; False makes their leases on it end only at their read
            flags (``LeaseBook.publishing``).
        generation:
            The slot's generation in this frame: what a subscriber's read flag
            of the slot holds once it is done with it (:meth:`settle`).

        Returns
        -------
        int
            The frame's sequence number.

        Raises
        ------
        UsageError
            The payload is too large.
        LeaseStateError
            The slot still has leases.
        PoolClosedError
            The publisher is closed.
        """
        self._check_open()
        if type(payload) is not bytes:
            payload = bytes(payload)
        producer = self._producer
        try:
            return int(producer.publish(slot, payload, on_schedule, generation))
        finally:
            if producer.has_news:
                self._tell(producer.news())

    # -- internals --

    def _tell(
        self,
        news: tuple[list[_Taken], list[_Taken], list[tuple[_Taken | None, str]]] | None,
    ) -> None:
        """Tell ``on_join`` who was adopted, ``on_leave`` who went before adoption and who left
        (their sockets closed, leases back; each as it joined, the engine's record), in that
        order."""
        if news is None:
            return
        joined, gone, left = news
        for taken in joined:
            self._callback(self._on_join, _info(taken), "on_join")
        for taken in gone:
            self._callback(self._on_leave, _info(taken), "on_leave")
        for record, why in left:
            self.last_leave_reason = why
            if record is not None:  # (None: added at close, never told as joined)
                self._callback(self._on_leave, _info(record), "on_leave")

    @staticmethod
    def _callback(
        func: Callable[[SubscriberInfo], object] | None, info: SubscriberInfo, name: str
    ) -> None:
        if func is None:
            return
        try:
            func(info)
        except Exception as exc:
            warnings.warn(f"{name} callback raised {exc!r}", RuntimeWarning, stacklevel=4)

    def _busy_message(self, timeout: float | None) -> str:
        book = self._book
        by_sub: dict[int, list[int]] = {}
        for slot in range(self.num_slots):
            for sub_id, _seq in book.leases(slot):
                by_sub.setdefault(sub_id, []).append(slot)
        parts = []
        for sub_id, slots in sorted(by_sub.items()):
            record = self._producer.subscriber(sub_id)
            who = f"pid {record[2]}, {record[4]}" if record is not None else "gone"
            parts.append(f"subscriber {sub_id} ({who}) holds slots {slots}")
        local = [s for s in range(self.num_slots) if book.holds(s)]
        if local:
            parts.append(f"local arrays hold slots {local}")
        return (
            f"no slot became free within {timeout} s: all {self.num_slots} slots are in use "
            f"({'; '.join(parts)}); subscribers must release their frames (or use "
            "mode='latest'), or give the pool more slots"
        )


__all__ = ["PublisherCore"]
