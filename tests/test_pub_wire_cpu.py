"""The publisher's per-frame wire (``_engine.PublisherWire``, ``c/src/pub_wire.c``).

Real ``SOCK_SEQPACKET`` socket pairs stand for the subscribers; the lease book
is the engine's (``LeaseBook``); every FRAME is compared with the bytes of the
Python encoder and every RELEASE is made by it (``channel._protocol``), an
independent writer of the same layouts.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from _gil import assert_gil_released
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool._engine import LeaseCore, PublisherWire
from cupy_ipcpool._errors import LeaseStateError, SlotIndexError, UsageError
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._leases import LeaseBook

SLOTS = 4


class Subs:
    """A lease book, its wire, and subscribers 1..n on socket pairs (ours, theirs)."""

    def __init__(self, modes: list[str]) -> None:
        self.book = LeaseBook(SLOTS)
        self.wire = self.book.wire()
        self.pairs: dict[int, tuple[socket.socket, socket.socket]] = {}
        for sub_id, mode in enumerate(modes, 1):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.pairs[sub_id] = (ours, theirs)
            self.book.add_subscriber(sub_id, mode, 2)
            self.wire.add(sub_id, ours.fileno())

    def theirs(self, sub_id: int) -> socket.socket:
        return self.pairs[sub_id][1]

    def fill(self, sub_id: int) -> None:
        """Fill our end's send buffer toward ``sub_id`` (their receive queue)."""
        ours = self.pairs[sub_id][0]
        ours.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:
                ours.send(b"x" * 4096)

    def close(self) -> None:
        for a, b in self.pairs.values():
            a.close()
            b.close()


@pytest.fixture
def subs(request: pytest.FixtureRequest) -> Iterator[Subs]:
    made = Subs(getattr(request, "param", ["block", "block", "block"]))
    yield made
    made.close()


def _recv(sock: socket.socket) -> bytes:
    return sock.recv(proto.MAX_FRAME_SIZE + 1, socket.MSG_DONTWAIT)


# -- send ---------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"", b"handles and metadata", bytes(proto.MAX_FRAME_PAYLOAD)])
def test_send_gives_the_frame_to_every_receiver_and_leases_it(subs: Subs, payload: bytes) -> None:
    assert subs.wire.send(2, 2**64 - 2, 0.0, True, payload) is None
    for sub_id in subs.pairs:
        assert _recv(subs.theirs(sub_id)) == proto.encode_frame(2**64 - 2, 2, payload)
    assert subs.book.leases(2) == [(1, 2**64 - 2), (2, 2**64 - 2), (3, 2**64 - 2)]
    assert subs.book.last_published == (2**64 - 2, 2)


@pytest.mark.parametrize("subs", [["block", "latest", "block"]], indirect=True)
def test_send_reaches_only_those_the_book_names(subs: Subs) -> None:
    """A "latest" subscriber holding its credit (2) gets no third frame; a subscriber in
    the book but not on the wire is leased (its notice is pending) but not sent to."""
    assert subs.wire.remove(3) is True
    assert subs.wire.remove(3) is False
    assert subs.wire.count == 2
    for seq in range(3):
        assert subs.wire.send(seq, seq, 0.0, True, b"") is None
    assert [proto.decode(_recv(subs.theirs(1))).seq for _ in range(3)] == [0, 1, 2]
    assert [proto.decode(_recv(subs.theirs(2))).seq for _ in range(2)] == [0, 1]
    for sub_id in (2, 3):
        with pytest.raises(BlockingIOError):
            _recv(subs.theirs(sub_id))
    assert subs.book.held_by(3) == {0: 0, 1: 1, 2: 2}


def test_send_finds_every_receiver_whatever_the_wire_order(subs: Subs) -> None:
    """The wire looks receivers up from where the last was found: one taken off and put
    back (last on the wire, first in the book) still gets every frame, once."""
    assert subs.wire.remove(1)
    subs.wire.add(1, subs.pairs[1][0].fileno())
    for seq in range(2):
        assert subs.wire.send(seq, seq, 0.0, True, b"") is None
    for sub_id in subs.pairs:
        assert [proto.decode(_recv(subs.theirs(sub_id))).seq for _ in range(2)] == [0, 1]
        with pytest.raises(BlockingIOError):
            _recv(subs.theirs(sub_id))


@pytest.mark.parametrize("subs", [["block", "latest", "ahead", "block"]], indirect=True)
def test_a_full_latest_socket_skips_the_frame_and_others_are_reported(subs: Subs) -> None:
    """A "latest" subscriber's full socket cancels its lease; a "block" or "ahead" one's is
    an EAGAIN event (the caller waits for room); a closed peer, the send's errno; the
    rest still get the frame."""
    for sub_id in (1, 2, 3):
        subs.fill(sub_id)
    subs.theirs(4).close()
    failed = subs.wire.send(0, 7, 0.0, True, b"p")
    assert failed is not None
    assert [(sub_id, err) for sub_id, err, _why in failed][:2] == [
        (1, errno.EAGAIN),
        (3, errno.EAGAIN),
    ]
    assert failed[2][0] == 4 and failed[2][1] in (errno.EPIPE, errno.ECONNRESET)
    assert failed[2][2] == f"send failed: {__import__('os').strerror(failed[2][1])}"
    assert failed[0][2] == "its socket is full"
    assert subs.book.held_by(2) == {}  # cancelled
    assert subs.book.held_by(1) == {7: 0} and subs.book.held_by(3) == {7: 0}


def test_send_within_waits_for_room_up_to_its_timeout(subs: Subs) -> None:
    """A full socket's frame is sent once the subscriber reads (the wait ends then), or the
    call answers ETIMEDOUT after the timeout (the publisher evicts it)."""
    subs.fill(1)
    start = time.monotonic()
    assert subs.wire.send_within(1, 5, 1, b"m", 0.05) == errno.ETIMEDOUT
    assert time.monotonic() - start >= 0.05

    def drain() -> None:
        time.sleep(0.05)
        while True:
            try:
                subs.theirs(1).recv(1 << 17, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return

    t = threading.Thread(target=drain)
    t.start()
    try:
        assert subs.wire.send_within(1, 6, 1, b"m", 30.0) == 0
    finally:
        t.join()
    assert subs.wire.send_within(2, 5, 1, b"m", 0.0) == 0
    assert _recv(subs.theirs(2)) == proto.encode_frame(5, 1, b"m")
    subs.theirs(3).close()
    assert subs.wire.send_within(3, 5, 1, b"m", 1.0) in (errno.EPIPE, errno.ECONNRESET)
    assert subs.wire.send_within(9, 5, 1, b"m", 1.0) == errno.EBADF
    with pytest.raises(UsageError, match="more than the limit"):
        subs.wire.send_within(2, 5, 1, bytes(proto.MAX_FRAME_PAYLOAD + 1), 1.0)
    with pytest.raises(ValueError):
        subs.wire.send_within(2, 5, 1, b"m", -1.0)


class _Alarm(Exception):
    pass


def test_a_signal_ends_a_stalled_send_with_its_handlers_exception(subs: Subs) -> None:
    """The wait for room runs with the GIL released; a signal's Python handler still runs
    at once, and its exception ends the wait (a stalled publish answers Ctrl-C)."""
    subs.fill(1)

    def alarm(_signum: int, _frame: object) -> None:
        raise _Alarm

    # SIGUSR1 sent to this thread (pytest-timeout owns SIGALRM): its wait gets EINTR
    old = signal.signal(signal.SIGUSR1, alarm)
    me = threading.get_ident()
    t = threading.Timer(0.05, signal.pthread_kill, (me, signal.SIGUSR1))
    start = time.monotonic()
    t.start()
    try:
        with pytest.raises(_Alarm):
            subs.wire.send_within(1, 5, 1, b"m", 30.0)
    finally:
        t.join()
        signal.signal(signal.SIGUSR1, old)
    assert time.monotonic() - start < 10.0
    assert subs.wire.count == 3  # the wire is usable again
    assert subs.wire.send_within(2, 5, 1, b"m", 0.0) == 0


def test_send_refuses_bad_arguments_and_leases_nothing(subs: Subs) -> None:
    with pytest.raises(UsageError, match="frame payload is 65537 bytes, more than the limit"):
        subs.wire.send(0, 1, 0.0, True, bytes(proto.MAX_FRAME_PAYLOAD + 1))
    with pytest.raises(TypeError):
        subs.wire.send(0, 1, 0.0, True, bytearray(3))
    with pytest.raises(SlotIndexError):
        subs.wire.send(SLOTS, 1, 0.0, True, b"")
    with pytest.raises(OverflowError):
        subs.wire.send(0, -1, 0.0, True, b"")
    assert subs.book.leases(0) == [] and subs.book.last_published is None
    assert subs.wire.send(0, 1, 0.0, True, b"") is None
    with pytest.raises(LeaseStateError):  # the slot still has leases
        subs.wire.send(0, 2, 0.0, True, b"")
    for sub_id in subs.pairs:
        assert _recv(subs.theirs(sub_id)) == proto.encode_frame(1, 0)
        with pytest.raises(BlockingIOError):
            _recv(subs.theirs(sub_id))


def test_the_wire_refuses_a_second_entry_and_a_bad_book(subs: Subs) -> None:
    with pytest.raises(UsageError, match="on the wire already"):
        subs.wire.add(1, 99)
    with pytest.raises(UsageError, match="on the wire already"):
        subs.wire.add(8, subs.pairs[2][0].fileno())
    with pytest.raises(ValueError):
        subs.wire.add(8, -1)
    with pytest.raises(OverflowError):
        subs.wire.add(2**32, 99)
    with pytest.raises(TypeError, match="LeaseCore"):
        PublisherWire(object())
    with pytest.raises(RuntimeError, match="not initialised"):
        PublisherWire.__new__(PublisherWire).send(0, 0, 0.0, True, b"")
    assert PublisherWire(LeaseCore(2)).count == 0


# -- take ---------------------------------------------------------------------------------


def test_take_times_out_with_none(subs: Subs) -> None:
    """``timeout_us`` is microseconds: a wait shorter than a millisecond is not rounded
    up to one (a producer looks at the read flags between steps of tens of them)."""
    start = time.monotonic()
    assert subs.wire.take(50_000, 1) is None
    assert time.monotonic() - start >= 0.045
    assert subs.wire.take(0, 1) is None
    assert PublisherWire(LeaseCore(2)).take(0, 1) is None
    short = []
    for _ in range(20):
        start = time.perf_counter()
        assert subs.wire.take(50, 1) is None
        short.append(time.perf_counter() - start)
    assert min(short) >= 50e-6
    assert min(short) < 0.9e-3, f"a 50 us wait took {min(short) * 1e6:.0f} us at best"


def test_take_puts_limit_releases_per_ready_socket_into_the_book(subs: Subs) -> None:
    for seq in range(2):
        subs.wire.send(seq, seq, 0.0, True, b"")
    for seq in range(2):
        subs.theirs(1).send(proto.encode_release(seq, seq))
    subs.theirs(2).send(proto.encode_release(1, 1))
    assert subs.wire.take(1_000_000, 1) is None
    assert subs.book.held_by(1) == {1: 1} and subs.book.held_by(2) == {0: 0}
    assert subs.book.ended == 2
    assert subs.wire.take(0, 1 << 30) is None
    assert subs.book.held_by(1) == {} and subs.book.ended == 3


@pytest.mark.parametrize("timeout_us", [-1, 2**62])
def test_take_wakes_on_a_release_sent_during_the_wait(subs: Subs, timeout_us: int) -> None:
    """Without limit, or longer than the clock can add: a real wait, woken by the RELEASE."""
    subs.wire.send(3, 9, 0.0, True, b"")

    def later() -> None:
        time.sleep(0.05)
        subs.theirs(2).send(proto.encode_release(9, 3))

    t = threading.Thread(target=later)
    t.start()
    try:
        assert subs.wire.take(timeout_us, 1) is None
    finally:
        t.join()
    assert [s for s, _seq in subs.book.leases(3)] == [1, 3]


@pytest.mark.parametrize("subs", [["block"] * 6], indirect=True)
def test_take_ends_a_subscriber_at_anything_but_a_release(subs: Subs) -> None:
    """A BYE, a hang-up, a message a subscriber may not send, bytes that are not the
    protocol's, a RELEASE the book cannot explain: each ends that subscriber's reading,
    with its reason; what follows stays queued, and the others are read on."""
    subs.wire.send(0, 1, 0.0, True, b"")
    subs.theirs(1).send(proto.encode_release(1, 0))
    subs.theirs(1).send(proto.encode_bye())
    subs.theirs(1).send(proto.encode_release(2, 0))  # after the BYE: left queued
    subs.theirs(2).send(proto.encode_release(1, 0) + b"x")  # not a RELEASE: one byte more
    _recv(subs.theirs(3))  # a FRAME left unread would make the hang-up a reset
    subs.theirs(3).close()
    subs.theirs(4).send(proto.encode_hello(proto.MODE_BLOCK, 1, 1, b"long" * 10))
    subs.theirs(5).send(b"GET / HTTP/1.0\r\n")
    subs.theirs(6).send(proto.encode_release(1, 0))
    subs.theirs(6).send(proto.encode_release(1, 0))  # twice
    ended = subs.wire.take(1_000_000, 1 << 30)
    assert ended is not None
    why = {sub_id: text for sub_id, _err, text in ended}
    assert [sub_id for sub_id, _e, _t in ended] == [1, 2, 3, 4, 5, 6]
    assert why[1] == "said BYE"
    assert why[2] == "protocol error: RELEASE must be 16 bytes, got 17"
    assert why[3] == "disconnected"
    assert why[4] == "protocol error: unexpected HELLO from a subscriber"
    assert why[5].startswith("protocol error: bad magic")
    assert why[6] == (
        "protocol error: subscriber 6 released frame 1, which it does not hold "
        "(never sent to it, or released already)"
    )
    assert all(err == 0 for _s, err, _t in ended)
    assert subs.book.held_by(1) == {} and subs.book.held_by(6) == {}
    assert subs.book.held_by(2) == {1: 0}
    assert subs.pairs[1][0].recv(64, socket.MSG_DONTWAIT) == proto.encode_release(2, 0)


def test_take_reports_a_failed_receive() -> None:
    book = LeaseBook(2)
    wire = book.wire()
    book.add_subscriber(1, "block", 1)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wire.add(1, a.fileno())
        a.send(b"x")
        b.close()
        assert wire.take(1_000_000, 1) == [
            (1, errno.ECONNRESET, f"receive failed: {__import__('os').strerror(errno.ECONNRESET)}")
        ]
    finally:
        a.close()


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
    it is that RELEASE, byte for byte; anything else ends the subscriber, the book as it was."""
    made = Subs(["block"])
    try:
        made.wire.send(2, 2, 0.0, True, b"")
        made.theirs(1).send(data)
        ended = made.wire.take(1_000_000, 1)
        if data == proto.encode_release(2, 2):
            assert ended is None and made.book.held_by(1) == {}
        else:
            assert ended is not None and [sub_id for sub_id, _e, _t in ended] == [1]
            assert made.book.held_by(1) == {2: 2}
    finally:
        made.close()


def test_take_lets_other_threads_run_but_not_use_the_wire(subs: Subs) -> None:
    subs.wire.send(2, 9, 0.0, True, b"")
    refused: list[BaseException] = []

    def wake() -> None:
        try:
            subs.wire.remove(1)
        except RuntimeError as exc:
            refused.append(exc)
        subs.theirs(1).send(proto.encode_release(9, 2))

    got = assert_gil_released(lambda: subs.wire.take(30_000_000, 1), ("poll", "ppoll"), wake)
    assert got is None and subs.book.held_by(1) == {}
    assert len(refused) == 1 and "waiting (take, send_within)" in str(refused[0])
    with pytest.raises(ValueError):
        subs.wire.take(-2, 1)
    with pytest.raises(ValueError):
        subs.wire.take(0, 0)
