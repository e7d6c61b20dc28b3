"""The publisher's session (``_engine.PublisherSession``, ``c/src/pub_session.c``).

The adopted subscribers' sockets, owned by the session: who leaves and why,
eviction (a lease past ``lease_timeout``, a socket full past ``send_timeout``),
the notice an evicted subscriber is told before its leases come back, and the
BYE at close.  Real ``SOCK_SEQPACKET`` socket pairs stand for the subscribers
(the session gets our end); what they read is decoded by the Python reference
decoder (``channel._protocol``).  Through ``PublisherCore`` the whole CPU suite
drives the same session with real subscriber processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from cupy_ipcpool._errors import UsageError
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._leases import LeaseBook

SLOTS = 4


class Subs:
    """A lease book, its session, and subscribers 1..n whose far ends are ``theirs``."""

    def __init__(
        self, modes: list[str], lease_timeout: float | None = None, send_timeout: float = 5.0
    ) -> None:
        self.book = LeaseBook(SLOTS)
        self.session = self.book.session(lease_timeout, send_timeout)
        self.theirs: dict[int, socket.socket] = {}
        for sub_id, mode in enumerate(modes, 1):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            theirs.setblocking(False)
            self.theirs[sub_id] = theirs
            self.session.add(sub_id, mode, 2, ours.detach())

    def ours(self, sub_id: int) -> socket.socket:
        """A second descriptor of the session's end toward ``sub_id`` (ours to close)."""
        return socket.socket(fileno=os.dup(self.session.fd(sub_id)))

    def fill(self, sub_id: int) -> None:
        """Fill the session's end toward ``sub_id`` until a send would wait."""
        with self.ours(sub_id) as ours:
            ours.setblocking(False)
            with pytest.raises(BlockingIOError):
                while True:
                    ours.send(b"x" * 4096)

    def read_all(self, sub_id: int) -> list[bytes]:
        """What ``sub_id`` reads until its queue is empty (b"" last: the end)."""
        got = []
        while True:
            try:
                data = self.theirs[sub_id].recv(1 << 17)
            except BlockingIOError:
                return got
            got.append(data)
            if not data:
                return got

    def close(self) -> None:
        self.session.close(0.0)
        for sock in self.theirs.values():
            sock.close()


@pytest.fixture
def subs() -> Iterator[Subs]:
    made = Subs(["block", "block"])
    yield made
    made.close()


def _decoded(datagrams: list[bytes]) -> list[object]:
    return [proto.decode(d) if d else b"" for d in datagrams if d[:1] != b"x"]


def test_publish_sends_the_frame_and_a_release_comes_back_into_the_book(subs: Subs) -> None:
    assert subs.session.publish(1, 7, True, b"meta") is None
    for sub_id in (1, 2):
        (frame,) = _decoded(subs.read_all(sub_id))
        assert frame == proto.Frame(7, 1, b"meta")
        subs.theirs[sub_id].send(proto.encode_release(7, 1))
    assert subs.session.take(1_000_000, 1 << 30) is None
    assert subs.book.lease_count(1) == 0
    assert subs.session.ids() == [1, 2] and subs.session.evictions == 0


def test_a_bye_or_a_hangup_ends_its_subscriber_and_gives_its_leases_back(subs: Subs) -> None:
    assert subs.session.publish(0, 1, True, b"") is None
    fd = subs.session.fd(1)
    subs.theirs[1].send(proto.encode_bye())
    subs.read_all(2)  # closed with its frame unread, it would be a reset, not a hang-up
    subs.theirs[2].close()
    left = subs.session.take(1_000_000, 1 << 30)
    assert sorted(left or []) == [(1, "said BYE"), (2, "disconnected")]
    assert subs.session.ids() == [] and subs.session.count == 0
    assert subs.book.lease_count(0) == 0 and subs.book.subscribers() == []
    with pytest.raises(OSError):
        os.fstat(fd)  # the session closed its socket
    assert subs.session.take(0, 1) is None  # each is reported once


def test_add_owns_the_fd_and_closes_it_when_it_cannot_add(subs: Subs) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = ours.detach()
    with pytest.raises(UsageError, match="already registered"):
        subs.session.add(1, "block", 2, fd)
    with pytest.raises(OSError):
        os.fstat(fd)
    assert theirs.recv(16) == b""  # closed: its peer sees the end
    theirs.close()
    with pytest.raises(UsageError, match="mode must be"):
        subs.session.add(3, "sometimes", 2, os.dup(0))
    assert subs.session.ids() == [1, 2]


def test_a_lease_past_lease_timeout_is_evicted_behind_the_frames_queued() -> None:
    """The notice (a REFUSE naming the frame and the limit) comes after the frames already
    queued, then the end; the leases come back once it is queued."""
    subs = Subs(["block", "latest"], lease_timeout=0.05)
    try:
        assert subs.session.publish(2, 9, True, b"") is None
        assert subs.session.next_expiry is not None
        assert _decoded(subs.read_all(2)) == [proto.Frame(9, 2, b"")]
        subs.theirs[2].send(proto.encode_release(9, 2))  # in time: not evicted
        assert subs.session.expire() is None  # not overdue yet
        time.sleep(0.06)
        left = subs.session.expire()
        why = "evicted: held frame 9 for more than lease_timeout=0.05 s"
        assert left == [(1, why)]
        assert _decoded(subs.read_all(1)) == [proto.Frame(9, 2, b""), proto.Refuse(why), b""]
        assert subs.session.evictions == 1 and subs.session.ids() == [2]
        assert subs.book.lease_count(2) == 0 and subs.session.next_expiry is None
    finally:
        subs.close()


def test_a_socket_full_past_send_timeout_is_evicted_and_told_why() -> None:
    subs = Subs(["block", "block"], send_timeout=0.05)
    try:
        subs.fill(1)
        start = time.monotonic()
        left = subs.session.publish(0, 3, True, b"")
        assert time.monotonic() - start >= 0.05
        why = "evicted: its socket stayed full for 0.05 s"
        assert left == [(1, why)]
        got = _decoded(subs.read_all(1))
        assert got[-2:] == [proto.Refuse(why), b""]  # behind the filler; the frame never went
        assert proto.Frame(3, 0, b"") not in got
        assert _decoded(subs.read_all(2)) == [proto.Frame(3, 0, b"")]
        assert subs.book.leases(0) == [(2, 3)] and subs.session.evictions == 1
    finally:
        subs.close()


class _Alarm(Exception):
    pass


def test_a_signal_during_the_wait_for_room_raises_and_evicts_that_subscriber() -> None:
    """The wait runs with the GIL released; a signal whose handler raises ends it, and the
    subscriber whose frame did not go is evicted (it would hold a lease on a frame it never
    gets); the frame is published for the others."""
    subs = Subs(["block", "block"], send_timeout=30.0)
    old = signal.signal(signal.SIGUSR1, _raise_alarm)
    timer = threading.Timer(0.05, signal.pthread_kill, (threading.get_ident(), signal.SIGUSR1))
    try:
        subs.fill(1)
        start = time.monotonic()
        timer.start()
        with pytest.raises(_Alarm):
            subs.session.publish(1, 4, True, b"")
        assert time.monotonic() - start < 10.0
        assert subs.book.last_published == (4, 1)
        assert subs.session.ids() == [2]
        left = subs.session.take(0, 1)  # reported with the next answer
        assert left is not None and left[0][0] == 1 and "interrupted" in left[0][1]
        assert subs.book.leases(1) == [(2, 4)]
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, old)
        subs.close()


def _raise_alarm(_signum: int, _frame: object) -> None:
    raise _Alarm


def test_close_says_bye_and_waits_for_every_subscriber_to_hang_up(subs: Subs) -> None:
    def hang_up_later() -> None:
        time.sleep(0.05)
        for sock in subs.theirs.values():
            sock.shutdown(socket.SHUT_RDWR)

    t = threading.Thread(target=hang_up_later)
    t.start()
    try:
        assert subs.session.close(5.0) is True
    finally:
        t.join()
    for sub_id in (1, 2):
        assert _decoded(subs.read_all(sub_id)) == [proto.Bye(), b""]
    assert subs.session.count == 0


def test_close_gives_up_on_a_subscriber_that_stays_after_linger(subs: Subs) -> None:
    start = time.monotonic()
    assert subs.session.close(0.05) is False
    assert time.monotonic() - start >= 0.05
    assert _decoded(subs.read_all(1)) == [proto.Bye(), b""]


# -- a notice that does not fit -------------------------------------------------------------


def _unprivileged_notice_run(write_fd: int) -> None:
    """In a child without the right to grow a socket's buffer past net.core.wmem_max (no
    CAP_NET_ADMIN): an eviction notice that cannot fit, then fits once the peer reads."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
    with open("/proc/sys/net/core/wmem_max") as f:
        wmem_max = int(f.read())
    subs = Subs(["block"])
    out: dict[str, object] = {}
    with subs.ours(1) as ours:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wmem_max)  # as far as it grows
    assert subs.session.publish(0, 1, True, b"") is None
    subs.fill(1)
    out["left_at_drop"] = subs.session.drop(1, "evicted: told later", True)
    out["noticing"] = subs.session.noticing
    out["ids"] = subs.session.ids()
    out["leases_kept"] = subs.book.lease_count(0)
    assert subs.session.publish(1, 2, True, b"") is None  # nothing more goes to it
    out["leases_of_next"] = subs.book.lease_count(1)
    out["left_on_retry"] = subs.session.retry_notices()
    first = proto.decode(subs.theirs[1].recv(1 << 17))
    assert isinstance(first, proto.Frame)
    out["first"] = [first.seq, first.slot]
    for _ in range(4):  # and some filler: room for the notice
        subs.theirs[1].recv(1 << 17)
    out["left_once_read"] = subs.session.retry_notices()
    out["noticing_after"] = subs.session.noticing
    out["leases_after"] = subs.book.lease_count(0)
    rest = subs.read_all(1)
    out["tail"] = [str(m) for m in _decoded(rest[-2:])]
    out["frames_after"] = sum(1 for m in _decoded(rest) if isinstance(m, proto.Frame))
    os.write(write_fd, json.dumps(out).encode())


def test_a_notice_that_does_not_fit_keeps_the_leases_until_it_does() -> None:
    """The subscriber's socket is full and its buffer cannot grow (a process without
    CAP_NET_ADMIN, at net.core.wmem_max): the evicted subscriber keeps its leases, suspended,
    and gets no frame more; once it reads and the notice fits, it goes, and its leases come
    back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            _unprivileged_notice_run(w)
            code = 0
        except BaseException as exc:
            os.write(w, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    out = json.loads(data)
    assert "error" not in out, out
    assert os.waitstatus_to_exitcode(status) == 0
    assert out["left_at_drop"] is None and out["noticing"] == 1 and out["ids"] == []
    assert out["leases_kept"] == 1 and out["leases_of_next"] == 0
    assert out["left_on_retry"] is None
    assert out["first"] == [1, 0]
    assert out["left_once_read"] == [[1, "evicted: told later"]]
    assert out["noticing_after"] == 0 and out["leases_after"] == 0
    assert out["tail"] == [str(proto.Refuse("evicted: told later")), "b''"]
    assert out["frames_after"] == 0
