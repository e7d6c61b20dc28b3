"""Races between the publisher's accept thread and its producer thread, forced, not waited for.

Each test builds the exact interleaving that a loaded machine produces now and
then: the accept thread is held inside a ``welcome`` callback (a
``threading.Event``) while the producer thread changes the world under it, fd
numbers are steered with held descriptors, and the only waits are on events
that the code under test causes (a message received, a callback run).  The
timeouts are bounds for a broken build, never the synchronisation.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._handshake import SubscriberInfo
from cupy_ipcpool.channel._publisher_core import PublisherCore

#: Bound on each wait of these tests (only a broken build waits that long).
BOUND = 10.0


@pytest.fixture
def address(tmp_path: os.PathLike[str]) -> str:
    return os.path.join(os.fspath(tmp_path), "chan.sock")


def _hello(name: bytes) -> bytes:
    return proto.encode_hello(proto.MODE_CODES["block"], 4, os.getpid(), name)


def _client() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(BOUND)
    return sock


def _recv(sock: socket.socket) -> proto.Message:
    return proto.decode(sock.recv(proto.MAX_WELCOME_SIZE + 1))


def _until(cond: Callable[[], bool], core: PublisherCore, what: str) -> None:
    """Run the producer's loop until ``cond()`` holds (``what`` says what did not happen)."""
    deadline = time.monotonic() + BOUND
    while not cond():
        assert time.monotonic() < deadline, what
        core.poll(0.01)


def _quiet(sock: socket.socket) -> bool:
    """True if nothing (no message, no hang-up) is waiting on ``sock``."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLRDHUP)
    return not poller.poll(0)


class _Gate:
    """A ``welcome`` callback that holds the accept thread inside it for one named HELLO."""

    def __init__(self, gated: bytes) -> None:
        self.gated = gated
        self.entered = threading.Event()
        self.release = threading.Event()
        self.left: list[bytes] = []
        self.gated_left = threading.Event()

    def welcome(self, info: SubscriberInfo) -> tuple[bytes, list[int]]:
        if info.hello == self.gated:
            self.entered.set()
            assert self.release.wait(BOUND), "the test never released the accept thread"
        return b"", []

    def on_leave(self, info: SubscriberInfo) -> None:
        self.left.append(info.hello)
        if info.hello == self.gated:
            self.gated_left.set()


@pytest.fixture
def held_fds() -> Iterator[list[int]]:
    """Descriptors a test holds open to steer which number the kernel gives out next."""
    held: list[int] = []
    yield held
    for fd in held:
        os.close(fd)


def _fill_holes_below(fd: int, held: list[int]) -> None:
    """Hold every free descriptor number below ``fd`` (which is open), so it is next once closed."""
    while True:
        got = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if got > fd:
            os.close(got)
            return
        held.append(got)


@pytest.mark.timeout(60)
def test_a_stale_hangup_is_not_applied_to_a_newcomer_with_the_same_fd(
    address: str, held_fds: list[int]
) -> None:
    """An event raised for a closed connection is never applied to the next one with its number.

    The interleaving: subscriber A is welcomed and watched (fd N) by the
    accept thread; while that thread is held in G's ``welcome``, the producer
    adopts A and drops it (N closed), newcomer B connects and G hangs up.  The
    thread's next ``poll`` then reports, in one batch and in this order: the
    listener (B, accepted as fd N and welcomed), the adoption wake-up, N's
    POLLNVAL (raised for A) and G's hang-up (the marker that the batch is done).
    """
    gate = _Gate(b"gate")
    core = PublisherCore(address, 4, welcome=gate.welcome, on_leave=gate.on_leave)
    g, a, b = _client(), _client(), _client()
    try:
        g.connect(address)  # no HELLO yet: accepted and left waiting for it
        a.connect(address)
        a.send(_hello(b"A"))
        assert isinstance(_recv(a), proto.Welcome)  # so G was accepted before, and A is watched
        g.send(_hello(b"gate"))
        assert gate.entered.wait(BOUND), "the accept thread never got G's HELLO"

        _until(lambda: len(core.subscribers) == 1, core, "A was not adopted")
        (info_a,) = core.subscribers
        fd_a = core._session.fd(info_a.sub_id)  # the fd number the newcomer must be given
        _fill_holes_below(fd_a, held_fds)
        a.send(proto.encode_bye())
        _until(lambda: not core.subscribers, core, "A's BYE did not end it")
        probe = os.dup(0)
        os.close(probe)
        assert probe == fd_a, "the interleaving was not forced: fd N is not the next number"
        g.shutdown(socket.SHUT_WR)  # G hangs up; it can still read its WELCOME
        b.connect(address)
        b.send(_hello(b"newcomer"))
        gate.release.set()

        assert gate.gated_left.wait(BOUND), "G's hang-up was never reaped"
        assert gate.left == [b"A", b"gate"], "a live newcomer was cut off by A's old event"
        assert isinstance(_recv(b), proto.Welcome)
        assert _quiet(b), "the newcomer saw something after its WELCOME"
        _until(lambda: len(core.subscribers) == 1, core, "the newcomer was not adopted")
        (info_b,) = core.subscribers
        assert info_b.hello == b"newcomer"
        assert core._session.fd(info_b.sub_id) == fd_a  # it got the number of the one that went
    finally:
        gate.release.set()
        core.close()
        for sock in (g, a, b):
            sock.close()


@pytest.mark.timeout(60)
def test_close_stops_accepting_before_it_waits_for_subscribers(address: str) -> None:
    """While ``close(linger=...)`` waits for its subscribers, nobody new is welcomed.

    The BYE is the event: once a subscriber has it, the listening socket must
    already be gone (a connect is refused), a handshake that was in progress
    ends without a WELCOME (EOF: a waiting subscriber retries), and a welcomed
    subscriber not yet adopted is lingered on like an adopted one.
    """
    core = PublisherCore(address, 4, welcome=lambda _info: (b"", []))
    first, midway, unadopted, late = _client(), _client(), _client(), _client()
    closer: threading.Thread | None = None
    result: list[bool] = []
    try:
        first.connect(address)
        first.send(_hello(b"first"))
        assert isinstance(_recv(first), proto.Welcome)
        _until(lambda: len(core.subscribers) == 1, core, "the first subscriber was not adopted")
        midway.connect(address)  # accepted, no HELLO yet
        unadopted.connect(address)
        unadopted.send(_hello(b"unadopted"))
        assert isinstance(_recv(unadopted), proto.Welcome)  # so midway is in the handshake

        closer = threading.Thread(target=lambda: result.append(core.close(linger=BOUND)))
        closer.start()
        assert isinstance(_recv(first), proto.Bye)

        try:
            late.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        else:
            late.send(_hello(b"late"))
            reply = type(_recv(late)).__name__
            pytest.fail(f"a subscriber that connected during close() got a {reply}")
        assert not os.path.exists(address)
        assert midway.recv(proto.MAX_WELCOME_SIZE + 1) == b""  # ended without a WELCOME
        assert isinstance(_recv(unadopted), proto.Bye)

        first.close()
        assert closer.is_alive()  # still lingering on the unadopted subscriber
        unadopted.close()
        closer.join(BOUND)
        assert not closer.is_alive()
        assert result == [True]
    finally:
        for sock in (first, midway, unadopted, late):
            sock.close()
        if closer is not None:
            closer.join(BOUND)
        core.close()
