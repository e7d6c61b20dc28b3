"""Admission of waiting connections per uid, each with a deadline: pure state, no I/O."""

from __future__ import annotations

__all__ = [
    "Admission",
]


class Admission:
    """Connections waiting for something (a handshake, a request), per uid, each with a deadline.

    A pure state machine (no I/O, no clock: the caller passes ``now``).  At most
    ``per_uid`` connections of one uid wait at once: admitting one more makes
    the oldest of that uid go, so an idle or hostile client of one uid can
    never keep out a client of another uid, and keeps out a fresh client of its
    own uid only for as long as that client is slower than the idle ones.

    Parameters
    ----------
    per_uid:
        Most waiting connections per uid (at least 1).
    timeout:
        Seconds each connection may wait, from admission.

    Notes
    -----
    Keys are fds; remove a key before its fd is closed, so a recycled fd
    number is never confused with it.
    """

    def __init__(self, per_uid: int, timeout: float) -> None:
        if per_uid < 1:
            raise ValueError(f"per_uid must be at least 1, not {per_uid}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        self.per_uid = int(per_uid)
        self.timeout = float(timeout)
        self._entries: dict[int, tuple[int, float]] = {}  # key -> (uid, deadline), by age
        self._by_uid: dict[int, dict[int, None]] = {}

    def admit(self, key: int, uid: int, now: float) -> list[int]:
        """Admit ``key`` for ``uid``; return the keys that must go to make room (oldest first).

        Raises
        ------
        ValueError
            ``key`` is already admitted.
        """
        if key in self._entries:
            raise ValueError(f"{key!r} is already admitted")
        same = self._by_uid.setdefault(uid, {})
        evicted: list[int] = []
        while len(same) >= self.per_uid:
            oldest = next(iter(same))
            self.remove(oldest)
            evicted.append(oldest)
        same = self._by_uid.setdefault(uid, {})
        same[key] = None
        self._entries[key] = (uid, now + self.timeout)
        return evicted

    def remove(self, key: int) -> bool:
        """Forget ``key``; True if it was admitted."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        same = self._by_uid[entry[0]]
        del same[key]
        if not same:
            del self._by_uid[entry[0]]
        return True

    def expired(self, now: float) -> list[int]:
        """Remove and return the keys whose deadline has passed (oldest first)."""
        out = []
        for key, (_uid, deadline) in self._entries.items():
            if deadline > now:
                break  # admitted in order with one timeout: deadlines increase
            out.append(key)
        for key in out:
            self.remove(key)
        return out

    def next_deadline(self) -> float | None:
        """Return the earliest deadline (None when nothing waits)."""
        for _uid, deadline in self._entries.values():
            return deadline
        return None

    def count(self, uid: int | None = None) -> int:
        """Return how many connections wait (of ``uid``, or in all)."""
        if uid is None:
            return len(self._entries)
        return len(self._by_uid.get(uid, ()))

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
