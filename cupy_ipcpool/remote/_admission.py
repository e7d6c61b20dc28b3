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

from .._errors import UsageError
from .._transport import Admission

#: Stage of a connection accepted and waiting for its HELLO.
WAIT_HELLO = 0
#: Stage of a connection that sent HELLO, was challenged and owes its PROOF.
WAIT_PROOF = 1
_STAGES = (WAIT_HELLO, WAIT_PROOF)


def address_key(host: str) -> int:
    """The admission key of a peer's source address (its integer value; IPv4-mapped folded)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return hash(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return int(ip)


class HandshakeBook:
    """Handshakes in progress, keyed by an opaque id (the caller's fd), oldest first.

    The local channel's :class:`~cupy_ipcpool._transport.Admission` with a
    handshake's ``(address, stage)`` as its group: what this adds is the
    stage order (a handshake only moves on) and counts per address.

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
        self._admission = Admission(per_address, timeout)

    def admit(self, key: int, address: int, now: float) -> list[int]:
        """Admit ``key`` from ``address`` (stage :data:`WAIT_HELLO`); return the keys that go.

        Raises
        ------
        UsageError
            ``key`` is already admitted.
        """
        if key in self._admission:
            raise UsageError(f"handshake {key} is already admitted")
        return self._admission.admit(key, (address, WAIT_HELLO), now)

    def advance(self, key: int, stage: int) -> list[int]:
        """``key`` reached ``stage`` (its deadline stays); return the keys that go to make room.

        Raises
        ------
        KeyError
            ``key`` is not admitted.
        UsageError
            ``stage`` is not after the current one.
        """
        address, current = self._group(key)
        if stage <= current:
            raise UsageError(f"handshake {key} is at stage {current}, cannot go to {stage}")
        return self._admission.move(key, (address, stage))

    def remove(self, key: int) -> bool:
        """Forget ``key`` (finished, failed or closed); True if it was admitted."""
        return self._admission.remove(key)

    def expired(self, now: float) -> list[int]:
        """Remove and return the keys whose deadline has passed (oldest first)."""
        return self._admission.expired(now)

    def next_deadline(self) -> float | None:
        """The earliest deadline (None when nothing waits)."""
        return self._admission.next_deadline()

    def next_to_go(self, address: int, stage: int) -> int | None:
        """The key that one more handshake of ``address`` in ``stage`` would push out (or None)."""
        return self._admission.next_to_go((address, stage))

    def stage(self, key: int) -> int:
        """The stage of ``key``."""
        return self._group(key)[1]

    def count(self, address: int | None = None) -> int:
        """Handshakes in progress (of ``address``, in any stage, or in all)."""
        if address is None:
            return len(self._admission)
        return sum(self._admission.count((address, stage)) for stage in _STAGES)

    def __contains__(self, key: object) -> bool:
        return key in self._admission

    def _group(self, key: int) -> tuple[int, int]:
        group = self._admission.group(key)
        assert isinstance(group, tuple)
        return group


__all__ = ["WAIT_HELLO", "WAIT_PROOF", "HandshakeBook", "address_key"]
