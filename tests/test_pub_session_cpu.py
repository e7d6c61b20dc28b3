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

import errno
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from _gil import assert_gil_released
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool._engine import LeaseCore, PublisherSession
from cupy_ipcpool._errors import LeaseStateError, SlotIndexError, UsageError
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
def subs(request: pytest.FixtureRequest) -> Iterator[Subs]:
    made = Subs(getattr(request, "param", ["block", "block"]))
    yield made
    made.close()


def _recv(sock: socket.socket) -> bytes:
    return sock.recv(proto.MAX_FRAME_SIZE + 1, socket.MSG_DONTWAIT)


def _decoded(datagrams: list[bytes]) -> list[object]:
    return [proto.decode(d) if d else b"" for d in datagrams if d[:1] != b"x"]


def test_publish_sends_the_frame_and_a_release_comes_back_into_the_book(subs: Subs) -> None:
    assert subs.session.publish(1, 7, True, b"meta", 0) is None
    for sub_id in (1, 2):
        (frame,) = _decoded(subs.read_all(sub_id))
        assert frame == proto.Frame(7, 1, b"meta")
        subs.theirs[sub_id].send(proto.encode_release(7, 1))
    assert subs.session.take(1_000_000, 1 << 30) is None
    assert subs.book.lease_count(1) == 0
    assert subs.session.ids() == [1, 2] and subs.session.evictions == 0


@pytest.mark.parametrize("payload", [b"", b"handles and metadata", bytes(proto.MAX_FRAME_PAYLOAD)])
def test_publish_gives_the_frame_to_every_receiver_and_leases_it(
    subs: Subs, payload: bytes
) -> None:
    """Every FRAME is byte for byte the Python reference encoder's."""
    assert subs.session.publish(2, 2**64 - 2, True, payload, 0) is None
    for sub_id in subs.theirs:
        assert _recv(subs.theirs[sub_id]) == proto.encode_frame(2**64 - 2, 2, payload)
    assert subs.book.leases(2) == [(1, 2**64 - 2), (2, 2**64 - 2)]
    assert subs.book.last_published == (2**64 - 2, 2)


@pytest.mark.parametrize("subs", [["block", "latest", "block"]], indirect=True)
def test_publish_reaches_only_those_the_book_names(subs: Subs) -> None:
    """A "latest" subscriber holding its credit (2) gets no third frame."""
    for seq in range(3):
        assert subs.session.publish(seq, seq, True, b"", 0) is None
    for sub_id, seqs in ((1, [0, 1, 2]), (2, [0, 1]), (3, [0, 1, 2])):
        assert [proto.decode(_recv(subs.theirs[sub_id])).seq for _ in seqs] == seqs  # type: ignore[union-attr]
        with pytest.raises(BlockingIOError):
            _recv(subs.theirs[sub_id])


@pytest.mark.parametrize("subs", [["latest", "block", "block"]], indirect=True)
def test_a_full_latest_socket_skips_the_frame_and_a_closed_peer_is_dropped(subs: Subs) -> None:
    """A "latest" subscriber's full socket cancels its lease (it stays); a peer that
    closed is dropped with the send's errno; the rest still get the frame."""
    subs.fill(1)
    subs.theirs[2].close()
    left = subs.session.publish(0, 7, True, b"p", 0)
    assert left is not None and [sub_id for sub_id, _why in left] == [2]
    assert left[0][1] in (f"send failed: {os.strerror(e)}" for e in (errno.EPIPE, errno.ECONNRESET))
    assert subs.book.held_by(1) == {} and subs.session.ids() == [1, 3]
    assert subs.book.leases(0) == [(3, 7)]
    assert _recv(subs.theirs[3]) == proto.encode_frame(7, 0, b"p")


def test_a_full_socket_that_drains_in_time_gets_its_frame(subs: Subs) -> None:
    """publish waits for room (up to send_timeout); once the subscriber reads, the frame
    goes and nobody leaves."""
    subs.fill(1)
    read: list[bytes] = []

    def drain() -> None:
        time.sleep(0.05)
        read.extend(subs.read_all(1))  # the frame too, if it comes meanwhile

    t = threading.Thread(target=drain)
    t.start()
    try:
        assert subs.session.publish(1, 6, True, b"m", 0) is None
    finally:
        t.join()
    read.extend(subs.read_all(1))
    assert [d for d in read if d[:1] != b"x"] == [proto.encode_frame(6, 1, b"m")]
    assert subs.session.ids() == [1, 2] and subs.session.evictions == 0


def test_publish_refuses_bad_arguments_and_leases_nothing(subs: Subs) -> None:
    with pytest.raises(UsageError, match="frame payload is 65537 bytes, more than the limit"):
        subs.session.publish(0, 1, True, bytes(proto.MAX_FRAME_PAYLOAD + 1), 0)
    with pytest.raises(TypeError):
        subs.session.publish(0, 1, True, bytearray(3), 0)
    with pytest.raises(SlotIndexError):
        subs.session.publish(SLOTS, 1, True, b"", 0)
    with pytest.raises(OverflowError):
        subs.session.publish(0, -1, True, b"", 0)
    assert subs.book.leases(0) == [] and subs.book.last_published is None
    assert subs.session.publish(0, 1, True, b"", 0) is None
    with pytest.raises(LeaseStateError):  # the slot still has leases
        subs.session.publish(0, 2, True, b"", 0)
    for sub_id in subs.theirs:
        assert _recv(subs.theirs[sub_id]) == proto.encode_frame(1, 0)
        with pytest.raises(BlockingIOError):
            _recv(subs.theirs[sub_id])


def test_the_session_refuses_bad_arguments(subs: Subs) -> None:
    with pytest.raises(ValueError):
        subs.session.add(8, "block", 1, -1)
    with pytest.raises(OverflowError):
        subs.session.add(2**32, "block", 1, os.dup(0))
    with pytest.raises(TypeError, match="LeaseCore"):
        PublisherSession(object(), None, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="send_timeout"):
        PublisherSession(LeaseCore(2), None, -1.0)
    with pytest.raises(ValueError, match="lease_timeout"):
        PublisherSession(LeaseCore(2), float("nan"), 1.0)
    with pytest.raises(RuntimeError, match="not initialised"):
        PublisherSession.__new__(PublisherSession).publish(0, 0, True, b"")
    assert PublisherSession(LeaseCore(2), None, 1.0).count == 0
    with pytest.raises(ValueError):
        subs.session.take(-2, 1)
    with pytest.raises(ValueError):
        subs.session.take(0, 0)


# -- take -----------------------------------------------------------------------------------


def test_take_times_out_with_none(subs: Subs) -> None:
    """``timeout_us`` is microseconds: a wait shorter than a millisecond is not rounded
    up to one (a producer looks at the read flags between steps of tens of them)."""
    start = time.monotonic()
    assert subs.session.take(50_000, 1) is None
    assert time.monotonic() - start >= 0.045
    assert subs.session.take(0, 1) is None
    assert PublisherSession(LeaseCore(2), None, 1.0).take(0, 1) is None
    short = []
    for _ in range(20):
        start = time.perf_counter()
        assert subs.session.take(50, 1) is None
        short.append(time.perf_counter() - start)
    assert min(short) >= 50e-6
    assert min(short) < 0.9e-3, f"a 50 us wait took {min(short) * 1e6:.0f} us at best"


def test_take_puts_limit_releases_per_ready_socket_into_the_book(subs: Subs) -> None:
    for seq in range(2):
        subs.session.publish(seq, seq, True, b"", 0)
    for seq in range(2):
        subs.theirs[1].send(proto.encode_release(seq, seq))
    subs.theirs[2].send(proto.encode_release(1, 1))
    assert subs.session.take(1_000_000, 1) is None
    assert subs.book.held_by(1) == {1: 1} and subs.book.held_by(2) == {0: 0}
    assert subs.book.ended == 2
    assert subs.session.take(0, 1 << 30) is None
    assert subs.book.held_by(1) == {} and subs.book.ended == 3


@pytest.mark.parametrize("timeout_us", [-1, 2**62])
def test_take_wakes_on_a_release_sent_during_the_wait(subs: Subs, timeout_us: int) -> None:
    """Without limit, or longer than the clock can add: a real wait, woken by the RELEASE."""
    subs.session.publish(3, 9, True, b"", 0)

    def later() -> None:
        time.sleep(0.05)
        subs.theirs[2].send(proto.encode_release(9, 3))

    t = threading.Thread(target=later)
    t.start()
    try:
        assert subs.session.take(timeout_us, 1) is None
    finally:
        t.join()
    assert [s for s, _seq in subs.book.leases(3)] == [1]


@pytest.mark.parametrize("subs", [["block"] * 6], indirect=True)
def test_take_drops_a_subscriber_at_anything_but_a_release(subs: Subs) -> None:
    """A BYE, a hang-up, a message a subscriber may not send, bytes that are not the
    protocol's, a RELEASE the book cannot explain: each ends that subscriber, with its
    reason (what it sent after is not read); the others are read on."""
    subs.session.publish(0, 1, True, b"", 0)
    for sub_id in subs.theirs:
        _recv(subs.theirs[sub_id])  # a FRAME left unread would make a hang-up a reset
    subs.theirs[1].send(proto.encode_release(1, 0))
    subs.theirs[1].send(proto.encode_bye())
    subs.theirs[1].send(proto.encode_release(2, 0))  # after the BYE: not read
    subs.theirs[2].send(proto.encode_release(1, 0) + b"x")  # not a RELEASE: one byte more
    subs.theirs[3].close()
    subs.theirs[4].send(proto.encode_hello(proto.MODE_BLOCK, 1, 1, b"long" * 10))
    subs.theirs[5].send(b"GET / HTTP/1.0\r\n")
    subs.theirs[6].send(proto.encode_release(1, 0))
    subs.theirs[6].send(proto.encode_release(1, 0))  # twice
    left = subs.session.take(1_000_000, 1 << 30)
    assert left is not None
    why = dict(left)
    assert [sub_id for sub_id, _t in left] == [1, 2, 3, 4, 5, 6]
    assert why[1] == "said BYE"
    assert why[2] == "protocol error: RELEASE must be 16 bytes, got 17"
    assert why[3] == "disconnected"
    assert why[4] == "protocol error: unexpected HELLO from a subscriber"
    assert why[5].startswith("protocol error: bad magic")
    assert why[6] == (
        "protocol error: subscriber 6 released frame 1, which it does not hold "
        "(never sent to it, or released already)"
    )
    assert subs.session.ids() == [] and subs.book.leases(0) == []
    assert subs.book.ended == 6  # each lease ended once: 2 by RELEASE, 4 by departure


def test_take_reports_a_failed_receive() -> None:
    book = LeaseBook(2)
    session = book.session(None, 1.0)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    session.add(1, "block", 1, a.detach())
    try:
        a2 = socket.socket(fileno=os.dup(session.fd(1)))
        a2.send(b"x")
        a2.close()
        b.close()
        assert session.take(1_000_000, 1) == [
            (1, f"receive failed: {os.strerror(errno.ECONNRESET)}")
        ]
    finally:
        session.close(0.0)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(min_size=1, max_size=40),
        st.builds(proto.encode_release, st.integers(0, 3), st.integers(0, SLOTS)),
        st.builds(proto.encode_frame, st.integers(0, 9), st.integers(0, 9), st.binary(max_size=9)),
    )
)
def test_take_counts_exactly_the_releases_the_book_explains(data: bytes) -> None:
    """Subscriber 1 holds frame 2 in slot 2: a datagram is taken into the book exactly when
    it is that RELEASE, byte for byte; anything else ends the subscriber."""
    made = Subs(["block"])
    try:
        made.session.publish(2, 2, True, b"", 0)
        _recv(made.theirs[1])
        made.theirs[1].send(data)
        left = made.session.take(1_000_000, 1)
        if data == proto.encode_release(2, 2):
            assert left is None and made.book.held_by(1) == {} and made.session.ids() == [1]
        else:
            assert left is not None and [sub_id for sub_id, _t in left] == [1]
            assert made.session.ids() == []
    finally:
        made.close()


def test_take_lets_other_threads_run_but_not_use_the_session(subs: Subs) -> None:
    subs.session.publish(2, 9, True, b"", 0)
    refused: list[BaseException] = []

    looked: list[list[int]] = []

    def wake() -> None:
        looked.append(subs.session.ids())  # looking is fine (a user's monitoring thread)
        try:
            subs.session.drop(2, "from another thread", False)
        except RuntimeError as exc:
            refused.append(exc)
        subs.theirs[1].send(proto.encode_release(9, 2))

    got = assert_gil_released(lambda: subs.session.take(30_000_000, 1), ("poll", "ppoll"), wake)
    assert got is None and subs.book.held_by(1) == {}
    assert len(refused) == 1 and "waiting on another thread" in str(refused[0])
    assert looked == [[1, 2]] and subs.session.ids() == [1, 2]


def test_a_bye_or_a_hangup_ends_its_subscriber_and_gives_its_leases_back(subs: Subs) -> None:
    assert subs.session.publish(0, 1, True, b"", 0) is None
    subs.theirs[1].send(proto.encode_bye())
    subs.read_all(2)  # closed with its frame unread, it would be a reset, not a hang-up
    subs.theirs[2].close()
    left = subs.session.take(1_000_000, 1 << 30)
    assert sorted(left or []) == [(1, "said BYE"), (2, "disconnected")]
    assert subs.session.ids() == [] and subs.session.count == 0
    assert subs.book.lease_count(0) == 0 and subs.book.subscribers() == []
    assert _decoded(subs.read_all(1)) == [proto.Frame(1, 0, b""), b""]  # its end closed
    assert subs.session.take(0, 1) is None  # each is reported once


def test_add_owns_the_fd_and_closes_it_when_it_cannot_add(subs: Subs) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = ours.detach()
    with pytest.raises(UsageError, match="already registered"):
        subs.session.add(1, "block", 2, fd)
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
        assert subs.session.publish(2, 9, True, b"", 0) is None
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
        left = subs.session.publish(0, 3, True, b"", 0)
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
            subs.session.publish(1, 4, True, b"", 0)
        assert time.monotonic() - start < 10.0
        assert subs.book.last_published == (4, 1)
        assert subs.session.ids() == [2]
        left = subs.session.take(0, 1)  # reported with the next answer
        assert left is not None and left[0][0] == 1 and "interrupted" in left[0][1]
        assert subs.book.leases(1) == [(2, 4)]
    finally:
        # A call that failed before its wait leaves the signal to come here: its handler's
        # exception must not skip the cleanup (left to the collector, these sockets' warnings
        # would fail the next test of this worker that collects).
        timer.cancel()
        try:
            timer.join()
        finally:
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
    assert subs.session.publish(0, 1, True, b"", 0) is None
    subs.fill(1)
    out["left_at_drop"] = subs.session.drop(1, "evicted: told later", True)
    out["noticing"] = subs.session.noticing
    out["ids"] = subs.session.ids()
    out["leases_kept"] = subs.book.lease_count(0)
    assert subs.session.publish(1, 2, True, b"", 0) is None  # nothing more goes to it
    out["leases_of_next"] = subs.book.lease_count(1)
    out["left_on_retry"] = subs.session.retry_notices()
    # a wait without limit tries again every CIPI_NOTICE_RETRY_NS (nothing else would wake it)
    out["left_on_poll"] = subs.session.poll(-1, 0, False)
    first = proto.decode(subs.theirs[1].recv(1 << 17))
    assert isinstance(first, proto.Frame)
    out["first"] = [first.seq, first.slot]
    for _ in range(4):  # and some filler: room for the notice
        subs.theirs[1].recv(1 << 17)
    # the next wait's try queues it: the leases that come back end that wait at once
    out["left_once_read"] = subs.session.poll(-1, 0, False)
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
    assert out["left_on_retry"] is None and out["left_on_poll"] is None
    assert out["first"] == [1, 0]
    assert out["left_once_read"] == [[1, "evicted: told later"]]
    assert out["noticing_after"] == 0 and out["leases_after"] == 0
    assert out["tail"] == [str(proto.Refuse("evicted: told later")), "b''"]
    assert out["frames_after"] == 0


def test_subscribers_can_be_read_while_the_producer_waits(tmp_path: object) -> None:
    """A monitoring thread reads ``subscribers`` while the producer's thread waits in
    ``poll`` (the session's wait has the GIL released): it gets the list, not an error."""
    from cupy_ipcpool.channel._handshake import Welcome
    from cupy_ipcpool.channel._publisher_core import PublisherCore
    from cupy_ipcpool.channel._subscriber_core import SubscriberCore

    address = os.path.join(str(tmp_path), "p.sock")
    with (
        PublisherCore(address, 4, welcome=Welcome()) as core,
        SubscriberCore(address, timeout=5) as sub,
    ):
        deadline = time.monotonic() + 5
        while not core.subscribers:
            assert time.monotonic() < deadline
            core.poll(0.01)
        waiting = threading.Thread(target=core.poll, args=(5.0,))
        waiting.start()
        try:
            time.sleep(0.05)  # in its wait by now
            assert [info.sub_id for info in core.subscribers] == [sub.sub_id]
        finally:
            sub.close()  # its BYE ends the wait
            waiting.join()
        assert core.subscribers == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"send_timeout": -1.0}, r"send_timeout must be 0\.\.1e9 seconds, not -1"),
        ({"send_timeout": float("inf")}, r"send_timeout must be 0\.\.1e9 seconds, not inf"),
        ({"send_timeout": float("nan")}, r"send_timeout must be 0\.\.1e9 seconds, not nan"),
        ({"lease_timeout": 0.0}, r"lease_timeout must be positive seconds or None"),
        ({"lease_timeout": -2}, r"lease_timeout must be positive seconds or None"),
        ({"lease_timeout": 5e6}, r"lease_timeout must be below 4294967 seconds, not 5e\+06"),
        ({"num_slots": 0}, r"num_slots must be in 1\.\.65536, not 0"),
        ({"num_slots": 65537}, r"num_slots must be in 1\.\.65536, not 65537"),
        ({"num_slots": -3}, r"num_slots must be a count, not -3"),
        ({"max_subscribers": 0}, r"max_subscribers must be at least 1, not 0"),
        ({"max_credit": 0}, r"max_credit must be at least 1 \(None: the default\), not 0"),
        ({"max_credit": 65536}, r"max_credit must be at most 65535, not 65536"),
        ({"handshake_timeout": 0}, r"handshake_timeout must be positive seconds up to 1e9"),
        ({"max_pending_per_uid": 0}, r"max_pending_per_uid must be at least 1, not 0"),
    ],
)
def test_a_publisher_refuses_options_it_cannot_keep(
    tmp_path: object, kwargs: dict[str, float], match: str
) -> None:
    """Refused when the publisher is made (not at the first stall), with nothing bound: the
    C API's one rule of a publisher's options (cipi_pub_check_options), Python's None for
    "the default" and "no limit" aside."""
    from cupy_ipcpool.channel._handshake import Welcome
    from cupy_ipcpool.channel._publisher_core import PublisherCore

    address = os.path.join(str(tmp_path), "p.sock")
    options: dict[str, float] = {"num_slots": 4, **kwargs}
    with pytest.raises(UsageError, match=match):
        PublisherCore(address, welcome=Welcome(), **options)  # type: ignore[arg-type]
    assert not os.path.exists(address)


def test_a_publisher_takes_integers_of_any_kind_and_refuses_floats(tmp_path: object) -> None:
    """Counts may be any integer (``__index__``: NumPy's too); a float is a UsageTypeError."""
    import numpy as np

    from cupy_ipcpool._errors import UsageTypeError
    from cupy_ipcpool.channel._handshake import Welcome
    from cupy_ipcpool.channel._publisher_core import PublisherCore

    address = os.path.join(str(tmp_path), "p.sock")
    core = PublisherCore(address, np.int64(4), welcome=Welcome(), max_credit=np.int32(2))
    try:
        assert (core.num_slots, core.max_credit) == (4, 2)
    finally:
        core.close()
    with pytest.raises(UsageTypeError, match="num_slots must be an int, not float"):
        PublisherCore(address, 4.0, welcome=Welcome())  # type: ignore[arg-type]
    assert not os.path.exists(address)


def test_a_publisher_takes_the_edges_of_its_options(tmp_path: object) -> None:
    """The edges of each range are accepted: one slot, a credit of 65535, no send timeout (a
    full socket drops its subscriber at once), the longest lease timeout."""
    from cupy_ipcpool.channel._handshake import Welcome
    from cupy_ipcpool.channel._publisher_core import PublisherCore

    address = os.path.join(str(tmp_path), "p.sock")
    for options in (
        {"num_slots": 1, "max_credit": 65535, "send_timeout": 0.0},
        {"num_slots": 65536, "lease_timeout": 4294966.5, "max_subscribers": 1},
    ):
        core = PublisherCore(address, welcome=Welcome(), **options)  # type: ignore[arg-type]
        try:
            assert os.path.exists(address)
        finally:
            core.close()


def test_a_signal_during_closes_linger_raises_and_every_socket_is_closed(subs: Subs) -> None:
    """``close(linger)`` waits with the GIL released; a signal whose handler raises ends the
    wait with that exception, and every socket is closed all the same (after the BYE)."""
    old = signal.signal(signal.SIGUSR1, _raise_alarm)
    timer = threading.Timer(0.05, signal.pthread_kill, (threading.get_ident(), signal.SIGUSR1))
    try:
        start = time.monotonic()
        timer.start()
        with pytest.raises(_Alarm):
            subs.session.close(30.0)
        assert time.monotonic() - start < 10.0
    finally:
        timer.cancel()  # as above: a signal that comes late must not skip the restore
        try:
            timer.join()
        finally:
            signal.signal(signal.SIGUSR1, old)
    assert subs.session.count == 0
    for sub_id in (1, 2):  # the BYE, then the end: the session's end is closed
        assert _decoded(subs.read_all(sub_id)) == [proto.Bye(), b""]


def test_a_long_reason_is_cut_whole_characters_in_the_notice_and_the_departure(
    subs: Subs,
) -> None:
    """A reason longer than the engine keeps is cut before the character it would split:
    the REFUSE stays UTF-8 (a subscriber decodes it) and the departure says the same."""
    why = "evicted: " + "é" * 300
    left = subs.session.drop(1, why, True)
    assert left is not None and left[0][0] == 1
    kept = left[0][1]
    assert why.startswith(kept) and 200 < len(kept.encode()) < 224
    notice = _decoded(subs.read_all(1))
    assert notice == [proto.Refuse(kept), b""]


def test_on_leave_tells_a_subscriber_as_it_joined_from_the_engines_record(
    tmp_path: object,
) -> None:
    """Who joined is known until it leaves: ``subscribers`` lists it (its HELLO payload, its
    granted credit, the kernel's pid), a busy ``acquire`` names its pid and mode, and its
    ``on_leave`` gets the same record as its ``on_join`` (c/src/producer.c keeps it; no
    Python copy)."""
    from cupy_ipcpool._errors import SlotBusyError
    from cupy_ipcpool.channel._handshake import Welcome
    from cupy_ipcpool.channel._publisher_core import PublisherCore

    address = os.path.join(str(tmp_path), "p.sock")
    joined: list[object] = []
    left: list[object] = []
    with PublisherCore(
        address, 4, welcome=Welcome(), on_join=joined.append, on_leave=left.append
    ) as core:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10.0)
        s.connect(address)
        s.send(proto.encode_hello(proto.MODE_CODES["block"], 3, os.getpid(), b"who am I"))
        welcome = proto.decode(s.recv(proto.MAX_WELCOME_SIZE + 1))
        assert isinstance(welcome, proto.Welcome)
        deadline = time.monotonic() + 10.0
        while not joined:
            core.poll(0.01)
            assert time.monotonic() < deadline
        (info,) = joined
        assert core.subscribers == [info]
        assert (info.sub_id, info.pid, info.uid, info.mode) == (
            welcome.sub_id,
            os.getpid(),
            os.geteuid(),
            "block",
        )
        # granted: the 3 asked for, capped at max_credit (num_slots - 2)
        assert (info.credit, info.hello, info.peer_pid) == (2, b"who am I", os.getpid())
        for _ in range(4):  # a "block" subscriber takes every frame: it holds all 4 slots
            slot, _readers = core.acquire(timeout=1.0)
            core.publish(slot)
        with pytest.raises(
            SlotBusyError, match=rf"\(pid {os.getpid()}, block\) holds slots \[0, 1, 2, 3\]"
        ):
            core.acquire(timeout=0.05)
        s.close()
        while not left:
            core.poll(0.01)
            assert time.monotonic() < deadline
        assert left == [info]
        assert core.subscribers == []
