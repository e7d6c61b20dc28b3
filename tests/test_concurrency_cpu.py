"""Races between the publisher's accept thread and its producer thread, forced, not waited for.

Fd numbers are steered with held descriptors, and the only waits are on
events that the code under test causes (a message received, a callback run).
The timeouts are bounds for a broken build, never the synchronisation.
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
from cupy_ipcpool.channel._handshake import Welcome
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

    Each round: subscriber A is welcomed (the accept thread watches its fd N for a hang-up
    until the producer takes it), adopted and dropped (N closed by the producer), and a
    newcomer B connects at once with every lower number held, so the kernel gives it N while
    the accept thread may still hold A's N in its poll set.  The thread matches every event
    to the connection it was raised for (a welcomed subscriber by its id, a handshake by its
    key), so B is never taken for A: it is welcomed, adopted, and sent nothing else.
    """
    left: list[bytes] = []
    core = PublisherCore(address, 4, welcome=Welcome(), on_leave=lambda i: left.append(i.hello))
    try:
        for n in range(20):
            a, b = _client(), _client()  # both made before the numbers are steered
            a.connect(address)
            a.send(_hello(b"A%d" % n))
            assert isinstance(_recv(a), proto.Welcome)
            _until(lambda: len(core.subscribers) == 1, core, "A was not adopted")
            (info_a,) = core.subscribers
            fd_a = core._session.fd(info_a.sub_id)  # the number the newcomer must be given
            _fill_holes_below(fd_a, held_fds)
            a.send(proto.encode_bye())
            _until(lambda: not core.subscribers, core, "A's BYE did not end it")
            probe = os.dup(0)
            os.close(probe)
            assert probe == fd_a, "fd N is not the next number"
            b.connect(address)
            b.send(_hello(b"B%d" % n))
            assert isinstance(_recv(b), proto.Welcome)
            _until(lambda: len(core.subscribers) == 1, core, "the newcomer was not adopted")
            (info_b,) = core.subscribers
            assert info_b.hello == b"B%d" % n
            assert core._session.fd(info_b.sub_id) == fd_a  # the number of the one that went
            assert _quiet(b), "the newcomer saw something after its WELCOME"
            b.send(proto.encode_bye())
            _until(lambda: not core.subscribers, core, "B's BYE did not end it")
            a.close()  # (open until now: its number stays out of the kernel's next pick)
            b.close()
            assert left == [x for k in range(n + 1) for x in (b"A%d" % k, b"B%d" % k)]
            for fd in held_fds:
                os.close(fd)
            held_fds.clear()
    finally:
        core.close()


@pytest.mark.timeout(60)
def test_close_stops_accepting_before_it_waits_for_subscribers(address: str) -> None:
    """While ``close(linger=...)`` waits for its subscribers, nobody new is welcomed.

    The BYE is the event: once a subscriber has it, the listening socket must
    already be gone (a connect is refused), a handshake that was in progress
    ends without a WELCOME (EOF: a waiting subscriber retries), and a welcomed
    subscriber not yet adopted is lingered on like an adopted one.
    """
    core = PublisherCore(address, 4, welcome=Welcome())
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
