"""Admission of waiting connections per group, each with a deadline: pure state, no I/O.

The rule is the engine's (``c/src/admission.c``, bound as ``_engine.AdmissionBook``), which
the publisher's accept thread follows in C: :class:`Admission` gives it to the fd server and
the remote server, numbering their groups for it.  ``_engine`` imports nothing above
``_errors``; of it, the layers below the channel use only ``AdmissionBook``
(tests/test_errors_cpu.py holds them to that).
"""

from __future__ import annotations

from collections.abc import Hashable

from .._compiled import loader

__all__ = [
    "MAX_PENDING_PER_UID",
    "Admission",
]

#: Most connections of one uid that wait at once (the fd server's requests, the
#: channel's handshakes); one more makes the oldest of that uid go.
MAX_PENDING_PER_UID = 8

#: The engine, loaded at the first Admission (it checks no layout of this layer's).
_engine = loader("cupy_ipcpool._engine")


class Admission:
    """Connections waiting for something (a handshake, a request), per group, each with a deadline.

    A pure state machine (no I/O, no clock: the caller passes ``now``).  A
    group is whatever must not crowd out the others: the peer's uid for local
    sockets, a source address and handshake stage for the remote server.  At
    most ``per_uid`` connections of one group wait at once: admitting one more
    makes the oldest of that group go, so an idle or hostile client of one
    group can never keep out a client of another group, and keeps out a fresh
    client of its own group only for as long as that client is slower than
    the idle ones.  A connection's deadline is set at admission and kept
    through moves; a moved connection is the newest of its new group; they
    expire in admission order.  The rule is the engine's (``c/src/admission.c``).

    Parameters
    ----------
    per_uid:
        Most waiting connections per group (at least 1).
    timeout:
        Seconds each connection may wait, from admission (moving it to
        another group with :meth:`move` keeps its deadline).

    Raises
    ------
    UsageError
        ``per_uid`` below 1 or ``timeout`` not positive.

    Notes
    -----
    Keys are the caller's: non-negative integers below 2**64, such as the
    connection's fd (the fd server, the remote server), which must then be
    removed before the fd is closed, so that a recycled fd number is never
    confused with it.  Groups are any hashable values.
    """

    def __init__(self, per_uid: int, timeout: float) -> None:
        self._waiting = _engine().AdmissionBook(per_uid, timeout)
        self.per_uid = int(per_uid)
        self.timeout = float(timeout)
        # the caller's groups, numbered for the engine's book (which keeps 64-bit ints);
        # the numbers of groups nobody waits in are forgotten from time to time
        self._ids: dict[Hashable, int] = {}
        self._groups: dict[int, Hashable] = {}
        self._next_id = 0

    def _id(self, group: Hashable) -> int:
        gid = self._ids.get(group)
        if gid is None:
            if len(self._ids) > 2 * len(self._waiting) + 8:
                self._forget_empty()
            gid = self._next_id
            self._next_id += 1
            self._ids[group] = gid
            self._groups[gid] = group
        return gid

    def _forget_empty(self) -> None:
        waiting = self._waiting
        for group, gid in list(self._ids.items()):
            if not waiting.count(gid):
                del self._ids[group], self._groups[gid]

    def admit(self, key: int, uid: Hashable, now: float) -> list[int]:
        """Admit ``key`` in group ``uid``; return the keys that must go to make room (oldest first).

        Raises
        ------
        UsageError
            ``key`` is already admitted (also a ``ValueError``).
        """
        return self._waiting.admit(key, self._id(uid), now)

    def move(self, key: int, group: Hashable) -> list[int]:
        """Move ``key`` to ``group``, keeping its deadline; return the keys that go to make room.

        Raises
        ------
        KeyError
            ``key`` is not admitted.
        """
        return self._waiting.move(key, self._id(group))

    def group(self, key: int) -> Hashable:
        """The group of ``key`` (KeyError if it is not admitted)."""
        return self._groups[self._waiting.group(key)]

    def next_to_go(self, group: Hashable) -> int | None:
        """The key that one more admission to ``group`` would push out (None: there is room)."""
        gid = self._ids.get(group)
        return None if gid is None else self._waiting.next_to_go(gid)

    def remove(self, key: int) -> bool:
        """Forget ``key``; True if it was admitted."""
        return self._waiting.remove(key)

    def expired(self, now: float) -> list[int]:
        """Remove and return the keys whose deadline has passed (oldest first)."""
        return self._waiting.expired(now)

    def next_deadline(self) -> float | None:
        """Return the earliest deadline (None when nothing waits)."""
        return self._waiting.next_deadline()

    def count(self, uid: Hashable | None = None) -> int:
        """Return how many connections wait (of group ``uid``, or in all)."""
        if uid is None:
            return len(self._waiting)
        gid = self._ids.get(uid)
        return 0 if gid is None else self._waiting.count(gid)

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)
