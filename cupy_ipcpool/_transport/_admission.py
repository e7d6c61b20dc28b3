"""Admission of waiting connections per group, each with a deadline: pure state, no I/O."""

from __future__ import annotations

from collections.abc import Hashable

from cupy_ipcpool._errors import UsageError

__all__ = [
    "MAX_PENDING_PER_UID",
    "Admission",
]

#: Most connections of one uid that wait at once (the fd server's requests, the
#: channel's handshakes); one more makes the oldest of that uid go.
MAX_PENDING_PER_UID = 8


class Admission:
    """Connections waiting for something (a handshake, a request), per group, each with a deadline.

    A pure state machine (no I/O, no clock: the caller passes ``now``).  A
    group is whatever must not crowd out the others: the peer's uid for local
    sockets, a source address and handshake stage for the remote server.  At
    most ``per_uid`` connections of one group wait at once: admitting one more
    makes the oldest of that group go, so an idle or hostile client of one
    group can never keep out a client of another group, and keeps out a fresh
    client of its own group only for as long as that client is slower than
    the idle ones.

    Parameters
    ----------
    per_uid:
        Most waiting connections per group (at least 1).
    timeout:
        Seconds each connection may wait, from admission (moving it to
        another group with :meth:`move` keeps its deadline).

    Notes
    -----
    Keys are the caller's: a number of the connection's own (the channel's
    handshakes), or its fd (the fd server, the remote server), which must then
    be removed before the fd is closed, so that a recycled fd number is never
    confused with it.
    """

    def __init__(self, per_uid: int, timeout: float) -> None:
        if per_uid < 1:
            raise UsageError(f"per_uid must be at least 1, not {per_uid}")
        if not timeout > 0:
            raise UsageError(f"timeout must be positive, not {timeout}")
        self.per_uid = int(per_uid)
        self.timeout = float(timeout)
        # key -> (group, deadline), in admission order: with one timeout, and moves that
        # keep the deadline, the deadlines increase along it
        self._entries: dict[int, tuple[Hashable, float]] = {}
        self._by_group: dict[Hashable, dict[int, None]] = {}

    def admit(self, key: int, uid: Hashable, now: float) -> list[int]:
        """Admit ``key`` in group ``uid``; return the keys that must go to make room (oldest first).

        Raises
        ------
        UsageError
            ``key`` is already admitted (also a ``ValueError``).
        """
        if key in self._entries:
            raise UsageError(f"{key!r} is already admitted")
        evicted = self._make_room(uid)
        self._by_group.setdefault(uid, {})[key] = None
        self._entries[key] = (uid, now + self.timeout)
        return evicted

    def move(self, key: int, group: Hashable) -> list[int]:
        """Move ``key`` to ``group``, keeping its deadline; return the keys that go to make room.

        Raises
        ------
        KeyError
            ``key`` is not admitted.
        """
        old, deadline = self._entries[key]
        self._unindex(key, old)
        evicted = self._make_room(group)
        self._by_group.setdefault(group, {})[key] = None
        self._entries[key] = (group, deadline)
        return evicted

    def group(self, key: int) -> Hashable:
        """The group of ``key`` (KeyError if it is not admitted)."""
        return self._entries[key][0]

    def next_to_go(self, group: Hashable) -> int | None:
        """The key that one more admission to ``group`` would push out (None: there is room)."""
        same = self._by_group.get(group, {})
        if len(same) < self.per_uid:
            return None
        return next(iter(same))

    def remove(self, key: int) -> bool:
        """Forget ``key``; True if it was admitted."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._unindex(key, entry[0])
        return True

    def expired(self, now: float) -> list[int]:
        """Remove and return the keys whose deadline has passed (oldest first)."""
        out = []
        for key, (_group, deadline) in self._entries.items():
            if deadline > now:
                break  # deadlines increase in admission order
            out.append(key)
        for key in out:
            self.remove(key)
        return out

    def next_deadline(self) -> float | None:
        """Return the earliest deadline (None when nothing waits)."""
        for _group, deadline in self._entries.values():
            return deadline
        return None

    def count(self, uid: Hashable | None = None) -> int:
        """Return how many connections wait (of group ``uid``, or in all)."""
        if uid is None:
            return len(self._entries)
        return len(self._by_group.get(uid, ()))

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _make_room(self, group: Hashable) -> list[int]:
        same = self._by_group.get(group, {})
        evicted: list[int] = []
        while len(same) >= self.per_uid:
            oldest = next(iter(same))
            self.remove(oldest)
            evicted.append(oldest)
        return evicted

    def _unindex(self, key: int, group: Hashable) -> None:
        same = self._by_group[group]
        del same[key]
        if not same:
            del self._by_group[group]
