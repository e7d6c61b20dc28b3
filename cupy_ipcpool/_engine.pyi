"""Type stub of the compiled module ``cupy_ipcpool._engine`` (source: ``c/python/engine.c``
and ``c/python/frameio.c`` over the C library's ``c/src``)."""

from collections.abc import Sequence
from typing import Any

#: The layouts and limits the engine was built for (``cupy_ipcpool._compiled.load`` checks them).
FRAME_HEAD_SIZE: int
FRAME_VOID: int
MAX_ARRAYS: int
MAX_METADATA: int
HANDLE_SIZE: int
SYNC_FORCED: int
SYNC_SET_WINDOW: int
SYNC_READS_ALIGN: int
SYNC_RECORD_CAP: int
SETTLE_RECHECK: tuple[float, float, float]

def frame_head(
    payload: bytes | bytearray | memoryview, seq: int, slot: int, /
) -> tuple[int, int, int, bool]:
    """Check a FRAME payload's head; return (generation, count, metadata_len, void)."""

def check_frame(
    payload: bytes | bytearray | memoryview, seq: int, slot: int, slot_nbytes: int, /
) -> tuple[int, int, int, bool]:
    """Check a whole FRAME payload (head, handles, metadata length); as :func:`frame_head`."""

def decode(data: bytes | bytearray | memoryview, /) -> tuple[Any, ...]:
    """Decode and check one channel message; return its type and fields."""

def sync_layout(num_slots: int, max_subscribers: int, /) -> tuple[int, int]:
    """(reads_offset, nbytes) of a sync page; UsageError outside the limits."""

def flag_state(word: int, generation: int, /) -> int:
    """1 set (or forced after the write), 0 forced before it, -1 not set yet."""

def flag_force(page: bytearray | memoryview | object, offset: int, awaited: int, /) -> bool:
    """Force a dead producer's frame flag (compare-and-swap); True if this call stored it."""

def hangup_drain(fd: int, queued: list[bytes], /) -> None:
    """Append every datagram still queued on ``fd`` after a hang-up to ``queued``."""

def hangup_verdict(messages: list[bytes], /) -> tuple[str, int]:
    """The verdict on what was queued at a hang-up: ``("bye"|"evicted"|"bad"|"drop", i)``."""

def handshake(
    path: str,
    mode: int,
    credit: int,
    payload: bytes,
    allowed_uids: list[int],
    timeout_ms: int,
    /,
) -> tuple[int, int, int, int, int, int, int, int, bytes, list[int]]:
    """The subscriber's handshake: ``(sock_fd, pid, uid, sub_id, num_slots, next_seq, credit,
    lease_timeout_ms, payload, fds)``; raises each failure as its cupy_ipcpool exception."""

def lease_defaults(num_slots: int, /) -> tuple[int, int, int]:
    """``(latest_reserve, max_due, max_credit)`` of a ring of ``num_slots``."""

def granted_credit(asked: int, max_credit: int, /) -> int:
    """``min(asked, max_credit)``, at least 1."""

class LeaseCore:
    """The publisher's lease book (c/src/leases.c); ``channel._leases.LeaseBook`` documents it."""

    num_slots: int
    max_credit: int
    latest_reserve: int
    max_due: int
    releases_due: int
    ended: int
    latest_slots: int
    last_published: tuple[int, int] | None

    def __init__(
        self, num_slots: int, *, max_credit: int | None = ..., latest_reserve: int | None = ...
    ) -> None: ...
    def add_subscriber(self, sub_id: int, mode: str, credit: int, /) -> int: ...
    def remove_subscriber(self, sub_id: int, /) -> list[int]: ...
    def suspend(self, sub_id: int, /) -> None: ...
    def subscribers(self) -> list[int]: ...
    def hold(self, slot: int, /) -> None: ...
    def unhold(self, slot: int, /) -> bool: ...
    def holds(self, slot: int, /) -> int: ...
    def publishing(self, slot: int, seq: int, now: float, on_schedule: bool, /) -> list[int]: ...
    def release(self, sub_id: int, seq: int, slot: int, /) -> bool | None: ...
    def settle(self, sub_id: int, slot: int, /) -> bool | None: ...
    def settle_flagged(self, reached: object, slot: int | None, /) -> int: ...
    def cancel(self, sub_id: int, seq: int, slot: int, /) -> bool: ...
    def is_free(self, slot: int, /) -> bool: ...
    def lease_count(self, slot: int, /) -> int: ...
    def any_leased(self) -> bool: ...
    def free_slots(self) -> list[int]: ...
    def leases(self, slot: int, /) -> list[tuple[int, int]]: ...
    def outstanding(self, sub_id: int, /) -> int: ...
    def held_by(self, sub_id: int, /) -> dict[int, int]: ...
    def credit(self, sub_id: int, /) -> int: ...
    def oldest_lease(self, sub_id: int, /) -> float | None: ...
    def overdue(self, now: float, timeout: float, /) -> list[int]: ...
    def next_expiry(self, timeout: float, /) -> float | None: ...
    def readers_to_wait(self, slot: int, /) -> list[int]: ...

class PublisherSession:
    """The publisher's adopted subscribers (c/src/pub_session.c), over the lease book of a
    :class:`LeaseCore`; ``channel._leases.LeaseBook.session`` documents it."""

    count: int
    noticing: int
    evictions: int
    next_expiry: float | None
    flag_looks: int

    def __init__(
        self, lease_core: LeaseCore, lease_timeout: float | None, send_timeout: float
    ) -> None: ...
    def add(self, sub_id: int, mode: str, credit: int, fd: int, /) -> None: ...
    def publish(
        self, slot: int, seq: int, on_schedule: bool, payload: bytes, generation: int, /
    ) -> list[tuple[int, str]] | None: ...
    def flags(self, page: object, reads_offset: int, rows: int, /) -> None: ...
    def set_row(self, sub_id: int, row: int, /) -> None: ...
    def settle(self, slot: int, /) -> int: ...
    def poll(
        self, timeout_us: int, spin_ns: int, settle: bool, /
    ) -> list[tuple[int, str]] | None: ...
    def take(self, timeout_us: int, limit: int, /) -> list[tuple[int, str]] | None: ...
    def drop(self, sub_id: int, why: str, notify: bool, /) -> list[tuple[int, str]] | None: ...
    def retry_notices(self) -> list[tuple[int, str]] | None: ...
    def expire(self) -> list[tuple[int, str]] | None: ...
    def close(self, linger: float, /) -> bool: ...
    def fd(self, sub_id: int, /) -> int: ...
    def ids(self) -> list[int]: ...

class FrameBook:
    """The engine's frame book (c/src/book.c) for one subscriber."""

    record: tuple[tuple[int, int, int], ...]
    generations: list[int]
    final: list[int] | None
    forced: int
    untracked: int
    record_cap: int

    def __init__(self, num_slots: int, *, record_cap: int = ...) -> None: ...
    def __len__(self) -> int: ...
    def note(self, slot: int, generation: int, /) -> None: ...
    def received(self, page: object, seq: int, slot: int, generation: int, /) -> bool: ...
    def prune(self, page: object, /) -> None: ...
    def pending(self, page: object, /) -> list[int]: ...
    def resolve(self, page: object, /) -> list[int]: ...
    def freeze(self, page: object, /) -> None: ...
    def state(self, page: object, slot: int, generation: int, /) -> int: ...
    def answers(self, page: object, /) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

class FrameLedger:
    """The engine's frame ledger (c/src/ledger.c) for one subscriber: rule 1, holds."""

    held: dict[int, int]
    ahead: frozenset[int]
    last_seq: int

    def __init__(self, num_slots: int, next_seq: int) -> None: ...
    def take(self, seq: int, slot: int, /) -> bool: ...
    def judge(self, data: bytes | bytearray | memoryview, /) -> tuple[Any, ...]: ...
    def release(self, seq: int, slot: int, /) -> None: ...
    def hold_again(self, seq: int, slot: int, /) -> None: ...
    def release_ahead(self, seq: int, slot: int, /) -> None: ...

class OwedReleases:
    """The RELEASEs a subscriber owes (c/src/owed.c): kept in order, bounded."""

    pending: list[tuple[int, int]]
    limit: int

    def __init__(self, num_slots: int) -> None: ...
    def __len__(self) -> int: ...
    def send(self, fd: int, seq: int, slot: int, /) -> bool: ...
    def owe(self, seq: int, slot: int, /) -> None: ...
    def flush(self, fd: int, /) -> bool: ...
    def clear(self) -> None: ...

# -- the channel's per-frame socket calls (c/python/frameio.c)

#: (magic, version, FRAME, RELEASE, FRAME header size, RELEASE size, most FRAME payload bytes)
PROTOCOL: tuple[int, int, int, int, int, int, int]

def pollfds(pairs: object, /) -> bytes:
    """Pack ``(fd, events)`` pairs (at most 16) as a ``struct pollfd`` array."""

def recv_frame(
    fd: int, buf: bytearray, timeout_ms: int, poll_first: bool, hup: bytes, /
) -> tuple[int, int, int, bool] | None:
    """Wait for one datagram; ``(n, seq, slot, waited)``, seq -1 when not a FRAME to take.

    A FRAME counts as one to take only if no fd of ``hup`` was ready after it was received.
    """

def release_frame(
    fd: int,
    hup: bytes,
    fn: int,
    stream: int,
    addr: int,
    value: int,
    flags: int,
    seq: int,
    slot: int,
    /,
) -> int:
    """Hang-up check, read-flag write, RELEASE; -1 after a hang-up, else the CUresult."""

class Acceptor:
    """The publisher's accept thread (``c/src/acceptor.c``); it owns ``listener`` from here on."""

    news: bool
    next_seq: int
    welcomed: int
    failure: str | None

    def __init__(
        self,
        listener: int,
        *,
        num_slots: int,
        payload: bytes,
        fds: Sequence[int],
        rows: ReaderRows | None,
        row_at: int,
        refuse: dict[str, str],
        allowed_uids: Sequence[int],
        max_subscribers: int,
        max_credit: int,
        lease_timeout_ms: int,
        handshake_timeout: float,
        max_pending_per_uid: int,
    ) -> None: ...
    def start(self) -> None: ...
    def take(
        self,
    ) -> tuple[
        list[tuple[int, int, int, int, str, int, bytes, int, int | None]],
        list[tuple[int, int, int, int, str, int, bytes, int, int | None]],
    ]: ...
    def dropped(self) -> None: ...
    def stop(self) -> None: ...
    def pending_handshakes(self, uid: int | None = None, /) -> int: ...

class ReaderRows:
    """The publisher's rows of read flags (c/src/reader_rows.c);
    ``channel._settle.reader_rows`` documents it."""

    departed: int
    live: int
    forced: int

    def __init__(self, page: object, reads_offset: int, max_rows: int, num_slots: int) -> None: ...
    def assign(self, sub_id: int, pid: int, /) -> int | None: ...
    def adopt(self, sub_id: int, /) -> None: ...
    def index(self, sub_id: int, /) -> int | None: ...
    def drop(self, sub_id: int, /) -> None: ...
    def leave(self, sub_id: int, published: Sequence[int], idle: bool, /) -> None: ...
    def due(self) -> bool: ...
    def settle(self, idle: bool, /) -> int: ...
    def close(self, published: Sequence[int], /) -> None: ...
    def all_settled(self) -> bool: ...
    def release_page(self) -> None: ...
