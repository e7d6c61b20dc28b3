"""Admission of remote handshakes: per source address, by progress, one deadline each.

Pure state (no I/O, no clock: the caller passes ``now``).  The local channel
keeps at most a few handshakes per uid (:class:`cupy_ipcpool._transport.Admission`);
a TCP peer has no uid, so the remote server applies the same rule per source
address.  Its handshake has two waits (for HELLO, then for PROOF), so the rule
is kept per *stage*: at most ``per_address`` handshakes of one address wait
in each stage, and one more in a stage makes the oldest of that address *in
that stage* go.  A flood of silent connections therefore only ever pushes out
silent connections of the same address: a subscriber whose HELLO arrived is
out of their reach, and one that already proved the secret is not waiting at
all.  Every handshake has one deadline, from accept, whatever its stage.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .._errors import UsageError

#: Stage of a connection accepted and waiting for its HELLO.
WAIT_HELLO = 0
#: Stage of a connection that sent HELLO, was challenged and owes its PROOF.
WAIT_PROOF = 1


def address_key(host: str) -> int:
    """The admission key of a peer's source address (its integer value; IPv4-mapped folded)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return hash(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return int(ip)


@dataclass
class _Entry:
    address: int
    stage: int
    deadline: float


class HandshakeBook:
    """Handshakes in progress, keyed by an opaque id (the caller's fd), oldest first.

    Parameters
    ----------
    per_address:
        Most handshakes of one address waiting in one stage (at least 1).
    timeout:
        Seconds each handshake has, from :meth:`admit`, to finish.

    Notes
    -----
    Remove a key before its fd is closed, so a recycled fd number is never
    confused with it.
    """

    def __init__(self, per_address: int, timeout: float) -> None:
        if per_address < 1:
            raise UsageError(f"per_address must be at least 1, not {per_address}")
        if not timeout > 0:
            raise UsageError(f"timeout must be positive, not {timeout}")
        self.per_address = int(per_address)
        self.timeout = float(timeout)
        self._entries: dict[int, _Entry] = {}  # in admission order: deadlines increase
        self._by_stage: dict[tuple[int, int], dict[int, None]] = {}

    def admit(self, key: int, address: int, now: float) -> list[int]:
        """Admit ``key`` from ``address`` (stage :data:`WAIT_HELLO`); return the keys that go.

        Raises
        ------
        UsageError
            ``key`` is already admitted.
        """
        if key in self._entries:
            raise UsageError(f"handshake {key} is already admitted")
        evicted = self._make_room(address, WAIT_HELLO)
        self._entries[key] = _Entry(address, WAIT_HELLO, now + self.timeout)
        self._by_stage.setdefault((address, WAIT_HELLO), {})[key] = None
        return evicted

    def advance(self, key: int, stage: int) -> list[int]:
        """``key`` reached ``stage`` (its deadline stays); return the keys that go to make room.

        Raises
        ------
        KeyError
            ``key`` is not admitted.
        UsageError
            ``stage`` is not after the current one.
        """
        entry = self._entries[key]
        if stage <= entry.stage:
            raise UsageError(f"handshake {key} is at stage {entry.stage}, cannot go to {stage}")
        self._unindex(key, entry)
        evicted = self._make_room(entry.address, stage)
        entry.stage = stage
        self._by_stage.setdefault((entry.address, stage), {})[key] = None
        return evicted

    def remove(self, key: int) -> bool:
        """Forget ``key`` (finished, failed or closed); True if it was admitted."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._unindex(key, entry)
        return True

    def expired(self, now: float) -> list[int]:
        """Remove and return the keys whose deadline has passed (oldest first)."""
        out = []
        for key, entry in self._entries.items():
            if entry.deadline > now:
                break
            out.append(key)
        for key in out:
            self.remove(key)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline (None when nothing waits)."""
        for entry in self._entries.values():
            return entry.deadline
        return None

    def next_to_go(self, address: int, stage: int) -> int | None:
        """The key that one more handshake of ``address`` in ``stage`` would push out (or None)."""
        same = self._by_stage.get((address, stage), {})
        if len(same) < self.per_address:
            return None
        return next(iter(same))

    def stage(self, key: int) -> int:
        """The stage of ``key``."""
        return self._entries[key].stage

    def count(self, address: int | None = None, stage: int | None = None) -> int:
        """Handshakes in progress (of ``address`` and ``stage``, or in all)."""
        return sum(
            1
            for e in self._entries.values()
            if (address is None or e.address == address) and (stage is None or e.stage == stage)
        )

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # -- internals --

    def _make_room(self, address: int, stage: int) -> list[int]:
        same = self._by_stage.get((address, stage), {})
        evicted: list[int] = []
        while len(same) >= self.per_address:
            oldest = next(iter(same))
            self.remove(oldest)
            evicted.append(oldest)
        return evicted

    def _unindex(self, key: int, entry: _Entry) -> None:
        index = (entry.address, entry.stage)
        same = self._by_stage.get(index)
        if same is not None:
            same.pop(key, None)
            if not same:
                del self._by_stage[index]


__all__ = ["WAIT_HELLO", "WAIT_PROOF", "HandshakeBook", "address_key"]
