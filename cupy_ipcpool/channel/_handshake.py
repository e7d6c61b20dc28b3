"""The publisher's listening side, as data: what a subscriber is told, and what it told.

The accept thread, admission and the handshake are the engine's
(``c/src/acceptor.c``, ``_engine.Acceptor``): a C thread that welcomes
subscribers for :class:`~._publisher_core.PublisherCore` and calls no Python.
Limits that keep any client, honest or hostile, from locking others out: a
connection's uid is checked before anything it sent is read; handshakes run
concurrently, each with one deadline (:data:`HANDSHAKE_TIMEOUT`), at most
:data:`MAX_PENDING_PER_UID` per uid; a row of read flags taken for a subscriber
comes back however its connection ends before adoption.  This module holds
what the Python side gives it (:class:`Welcome`) and gets back
(:class:`SubscriberInfo`), and the check of a stale socket file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._transport import MAX_PENDING_PER_UID
from .._transport._accept_loop import HANDSHAKE_TIMEOUT

if TYPE_CHECKING:
    from .._engine import ReaderRows


@dataclass(frozen=True)
class SubscriberInfo:
    """What the producer knows about one subscriber.

    Attributes
    ----------
    sub_id:
        Id assigned by the producer (unique for the publisher's lifetime).
    pid:
        The subscriber's pid from ``SO_PEERCRED`` (the pid it claimed in HELLO
        when the kernel reports 0, e.g. across pid namespaces).
    uid:
        The subscriber's uid from ``SO_PEERCRED``.
    mode:
        ``"block"`` or ``"latest"``.
    credit:
        Most frames it holds at once (enforced for ``"latest"``): the credit
        it asked for, capped at the publisher's ``max_credit``.
    hello:
        The opaque HELLO payload (the GPU layer's event handles).
    peer_pid:
        The pid from ``SO_PEERCRED`` alone: 0 where the kernel cannot name the
        subscriber's process in this PID namespace.  Only this pid may be
        watched for the subscriber's death (``pid`` may be its claim, a
        number of another namespace that names some other process here).
    """

    sub_id: int
    pid: int
    uid: int
    mode: str
    credit: int
    hello: bytes = b""
    peer_pid: int = 0


@dataclass(frozen=True)
class Welcome:
    """What the publisher tells each subscriber it welcomes: data, no callback.

    Every subscriber gets the same ``payload`` and ``fds``, but for its row of
    read flags when ``rows`` is given.  The accept thread composes the WELCOME
    from this alone (it calls no user code), so a subscriber is welcomed while
    the producer's thread is busy elsewhere.  The publisher checks it when it
    is made (``UsageError``): a row that does not fit the payload, more fds than
    one message carries (253), a payload over 64 KiB, a mode that does not
    exist.

    Attributes
    ----------
    payload:
        The WELCOME's opaque payload (the GPU layer's pool descriptor and sync
        page layout; the host tier's slot size).
    fds:
        Sent with every WELCOME; the publisher keeps duplicates of its own, so
        the caller's may be closed once it is made.
    rows:
        The publisher's rows of read flags (``c/src/reader_rows.c``): each
        subscriber is given one when welcomed (refused when every row is
        live), written into ``payload`` at ``row_at`` (4 bytes, little
        endian); a subscriber welcomed and never adopted gives its row back.
    row_at:
        Where the row goes in ``payload`` (with ``rows`` only).
    refuse:
        Subscriber modes this publisher does not serve, each with the reason
        its REFUSE gives (``{"ahead": "..."}``).
    """

    payload: bytes = b""
    fds: tuple[int, ...] = ()
    rows: ReaderRows | None = None
    row_at: int = 0
    refuse: Mapping[str, str] = field(default_factory=dict)


__all__ = ["HANDSHAKE_TIMEOUT", "MAX_PENDING_PER_UID", "SubscriberInfo", "Welcome"]
