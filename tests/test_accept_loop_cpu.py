"""The one accept loop (cupy_ipcpool._transport._accept_loop) on real sockets and threads.

Nothing here sleeps to wait for something: every wait is on an event that the
code under test causes (a callback run, a message received), bounded by
:data:`BOUND` for a broken build only.  The back-off is tested for real: a
child process lowers its ``RLIMIT_NOFILE`` and fills its fd table, so that
accept(2) fails with ``EMFILE`` while a connection is queued.
"""

from __future__ import annotations

import itertools
import os
import queue
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from cupy_ipcpool._transport import Admission
from cupy_ipcpool._transport._accept_loop import (
    ACCEPT_BACKOFF_S,
    HANDSHAKE_TIMEOUT,
    STOP_TIMEOUT_S,
    AcceptLoop,
)
from tests._fds import open_fds
from tests.test_concurrency_cpu import _fill_holes_below

#: Bound on each wait (only a broken build waits that long).
BOUND = 10.0


class _Conn:
    """An accepted connection, named by the order it came in."""

    def __init__(self, name: str, sock: socket.socket) -> None:
        self.name = name
        self.sock = sock
        self.fd = sock.fileno()


class _User:
    """A user of the loop: records what it is handed, watches what it accepts for POLLIN."""

    def __init__(
        self,
        listener: socket.socket,
        names: str = "",
        loop_class: type[AcceptLoop[_Conn]] = AcceptLoop,
        **kw: Any,
    ) -> None:
        self.names = iter(names)
        self.accepted: queue.Queue[_Conn] = queue.Queue()
        self.events: list[tuple[str, int]] = []
        self.conns: list[_Conn] = []  # every connection accepted: on_exit closes them
        self.exited = threading.Event()
        self.loop: AcceptLoop[_Conn] = loop_class(
            listener,
            name="test-accept",
            on_accept=self.on_accept,
            on_event=self.on_event,
            on_exit=self.on_exit,
            **kw,
        )

    def on_accept(self, sock: socket.socket, _address: object) -> None:
        conn = _Conn(next(self.names, "?"), sock)
        self.conns.append(conn)
        self.loop.watch(conn.fd, conn, select.POLLIN)
        self.accepted.put(conn)

    def on_event(self, conn: _Conn, events: int) -> None:
        self.events.append((conn.name, events))

    def on_exit(self) -> None:
        for conn in self.conns:
            conn.sock.close()
        self.exited.set()


def _listener(directory: str) -> tuple[socket.socket, str]:
    path = os.path.join(directory, "l.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(16)
    sock.setblocking(False)
    return sock, path


def _client(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(BOUND)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


@pytest.fixture
def directory() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="accept-loop-") as d:  # short: AF_UNIX paths
        yield d


def test_one_handshake_timeout() -> None:
    from cupy_ipcpool.channel import _handshake
    from cupy_ipcpool.remote import _accept

    assert _handshake.HANDSHAKE_TIMEOUT is HANDSHAKE_TIMEOUT
    assert _accept.HANDSHAKE_TIMEOUT is HANDSHAKE_TIMEOUT
    assert HANDSHAKE_TIMEOUT == 5.0


@pytest.mark.timeout(60)
def test_accepted_connections_and_their_events_go_to_the_callbacks(directory: str) -> None:
    listener, path = _listener(directory)
    echoed = threading.Event()

    class Echo(_User):
        def on_event(self, conn: _Conn, events: int) -> None:
            data = conn.sock.recv(100)
            echoed.set()
            conn.sock.send(data.upper())

    user = Echo(listener, "ab")
    user.loop.start()
    a, b = _client(path), _client(path)
    try:
        first, second = user.accepted.get(timeout=BOUND), user.accepted.get(timeout=BOUND)
        assert (first.name, second.name) == ("a", "b")
        assert first.sock.getblocking() is False  # handed over non-blocking
        b.send(b"hello")
        assert b.recv(100) == b"HELLO"
        assert echoed.is_set()
        assert {c.name for c in user.loop.watched()} == {"a", "b"}
    finally:
        user.loop.stop()
        a.close()
        b.close()
    assert user.exited.is_set()
    assert not user.loop.thread.is_alive()
    assert user.loop.failure is None
    assert listener.fileno() == -1  # closed by stop


@pytest.mark.timeout(60)
def test_a_stale_event_is_not_handed_to_a_newcomer_with_the_same_fd(directory: str) -> None:
    """An event raised for a closed connection never reaches the next one given its number.

    The interleaving: while the loop is held in G's callback, the owner of A
    closes A's socket (number N, still in the poll set) and newcomer B
    connects.  The next ``poll`` reports the listener (B, accepted as N) and
    N's POLLNVAL, raised for A, in one batch: it must go to nobody.
    """
    listener, path = _listener(directory)
    held, release = threading.Event(), threading.Event()
    marker = threading.Event()

    class Gated(_User):
        def on_event(self, conn: _Conn, events: int) -> None:
            super().on_event(conn, events)
            if conn.name in ("g", "m"):
                conn.sock.recv(100)
                self.loop.forget(conn.fd, conn)
            if conn.name == "g":
                held.set()
                assert release.wait(BOUND), "the test never released the loop"
            elif conn.name == "m":
                marker.set()

    user = Gated(listener, "gamb")
    user.loop.start()
    clients = []
    held_fds: list[int] = []
    try:
        for _ in "gam":
            clients.append(_client(path))
            user.accepted.get(timeout=BOUND)  # accepted in this order
        g, _a, m = clients
        conn_a = next(c for c in user.loop.watched() if c.name == "a")
        _fill_holes_below(conn_a.fd, held_fds)
        g.send(b"g")
        assert held.wait(BOUND), "the loop never saw G's message"

        b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # before N is free
        clients.append(b)
        conn_a.sock.close()  # its owner closes it; the loop still polls its number
        probe = os.dup(0)
        os.close(probe)
        assert probe == conn_a.fd, "the interleaving was not forced: N is not the next number"
        b.connect(path)  # queued
        release.set()

        conn_b = user.accepted.get(timeout=BOUND)
        assert conn_b.name == "b"
        assert conn_b.fd == conn_a.fd  # the newcomer did get A's number
        m.send(b"m")  # polled after N: once seen, N's events of that batch were handled
        assert marker.wait(BOUND)
        assert [name for name, _ev in user.events] == ["g", "m"], user.events
    finally:
        release.set()
        user.loop.stop()
        for sock in clients:
            sock.close()
        for fd in held_fds:
            os.close(fd)


@pytest.mark.timeout(60)
def test_wake_calls_on_wake_and_stop_ends_the_thread(directory: str) -> None:
    listener, path = _listener(directory)
    woken = threading.Event()
    user = _User(listener, on_wake=woken.set)
    user.loop.start()
    user.loop.wake()
    assert woken.wait(BOUND)
    user.loop.stop()
    assert not user.loop.thread.is_alive()
    assert user.exited.is_set()
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
        _client(path)  # nobody listens any more (the file stays: the user's to unlink)
    user.loop.stop()  # idempotent


def test_stop_before_start() -> None:
    with tempfile.TemporaryDirectory(prefix="accept-loop-") as d:
        listener, _path = _listener(d)
        user = _User(listener)
        wake_r = user.loop._wake_r
        pipe = os.fstat(wake_r)
        user.loop.stop()
        assert listener.fileno() == -1
        try:
            now = os.fstat(wake_r)
        except OSError:
            pass  # closed
        else:  # the number went to something else since
            assert (now.st_dev, now.st_ino) != (pipe.st_dev, pipe.st_ino), "the pipe is open"
        assert not user.exited.is_set()  # no thread ran


def _one_message_ends_the_thread(user: _User, path: str) -> None:
    """Send one message to a connection of ``user``'s loop; return once the thread has ended."""
    user.loop.start()
    with _client(path) as c:
        user.accepted.get(timeout=BOUND)
        c.send(b"x")
        assert user.exited.wait(BOUND)
        user.loop.thread.join(BOUND)
        assert not user.loop.thread.is_alive()
        assert c.recv(1) == b""  # on_exit closed the connection


@pytest.mark.timeout(60)
def test_stop_from_a_callback(directory: str) -> None:
    """A callback that stops the loop returns at once; the thread ends after it, and cleans up."""
    listener, path = _listener(directory)

    class Stopper(_User):
        def on_event(self, conn: _Conn, events: int) -> None:
            super().on_event(conn, events)
            conn.sock.recv(100)
            self.loop.stop()  # on the loop's own thread: no join

    user = Stopper(listener)
    _one_message_ends_the_thread(user, path)
    assert user.loop.failure is None


@pytest.mark.timeout(60)
def test_a_callback_that_raises_ends_the_loop_and_says_why(directory: str) -> None:
    """As before the one loop, an exception out of a callback is a bug: the thread ends.

    (Callbacks catch what a connection may raise: the channel's ``welcome``
    that raises refuses that subscriber only, tests/test_session.py.)  The
    thread records why (the remote server ends with that reason) and its
    user's ``on_exit`` still runs.
    """
    listener, path = _listener(directory)

    class Broken(_User):
        def on_event(self, conn: _Conn, events: int) -> None:
            conn.sock.recv(100)
            raise RuntimeError("a bug in a callback")

    user = Broken(listener)
    _one_message_ends_the_thread(user, path)
    assert user.loop.failure == "the accept thread failed: RuntimeError('a bug in a callback')"
    user.loop.stop()  # still fine afterwards


@pytest.mark.timeout(60)
def test_deadlines_bound_the_poll_and_expired_keys_go_to_on_expired(directory: str) -> None:
    listener, path = _listener(directory)
    timeout = 0.05
    book = Admission(4, timeout)
    expired: queue.Queue[tuple[int, float]] = queue.Queue()
    conns: dict[int, _Conn] = {}

    class Timed(_User):
        def on_accept(self, sock: socket.socket, _address: object) -> None:
            conn = _Conn("t", sock)
            self.conns.append(conn)
            conns[conn.fd] = conn
            book.admit(conn.fd, 0, time.monotonic())
            self.loop.watch(conn.fd, conn, select.POLLIN)
            self.accepted.put(conn)

    def on_expired(fd: int) -> None:
        conn = conns.pop(fd)
        user.loop.forget(fd, conn)
        conn.sock.close()
        expired.put((fd, time.monotonic()))

    user = Timed(listener, deadlines=book, on_expired=on_expired)
    user.loop.start()
    try:
        t0 = time.monotonic()
        with _client(path) as c:
            conn = user.accepted.get(timeout=BOUND)
            fd, when = expired.get(timeout=BOUND)  # nothing else wakes the loop
            assert fd == conn.fd
            assert when - t0 >= timeout
            assert c.recv(1) == b""
    finally:
        user.loop.stop()


# -- the back-off, for real: a child process out of fds ------------------------------------


def _run_child(scenario: str) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), scenario],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=repo,
    )
    assert proc.returncode == 0, f"child {scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip() == "ok", proc.stdout


@pytest.mark.timeout(90)
def test_out_of_fds_backs_off_and_accepts_once_fds_are_free() -> None:
    """EMFILE: the loop waits ACCEPT_BACKOFF_S between tries, then accepts the queued connection."""
    _run_child("backoff")


@pytest.mark.timeout(90)
def test_out_of_fds_the_loop_still_serves_and_stops_at_once() -> None:
    """During a back-off (an hour here) the connections accepted are served, and stop ends it."""
    _run_child("serve-and-stop")


def _fd_numbers() -> set[int]:
    """The fds open now (less the one the listing itself used)."""
    return set(open_fds())


def _fill_fd_table() -> list[int]:
    """Lower RLIMIT_NOFILE just above the fds open now and open fds until EMFILE."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(n) for n in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 16, hard))
    held = []
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            assert exc.errno == 24, exc  # EMFILE
            return held


class _Probe(_User):
    """Records when each back-off began (before it is set: see the gaps below)."""

    def __init__(self, listener: socket.socket, **kw: Any) -> None:
        self.backoff_times: list[float] = []
        self.third_backoff = threading.Event()
        self.first_backoff = threading.Event()
        probe = self

        class Loop(AcceptLoop[_Conn]):
            def _back_off(self) -> None:
                probe.backoff_times.append(time.monotonic())
                probe.first_backoff.set()
                if len(probe.backoff_times) == 3:
                    probe.third_backoff.set()
                super()._back_off()

        super().__init__(listener, "abcdef", loop_class=Loop, **kw)


def _child_backoff(directory: str) -> None:
    fds_before = _fd_numbers()
    listener, path = _listener(directory)
    user = _Probe(listener)
    assert user.loop.backoff == ACCEPT_BACKOFF_S
    user.loop.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(BOUND)
    held = _fill_fd_table()
    client.connect(path)  # queued: accepting it needs an fd this process does not have
    assert user.third_backoff.wait(BOUND), "accept never failed with EMFILE"
    times = list(user.backoff_times[:3])
    # a try starts no sooner than the back-off after the one before: no spinning
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap >= ACCEPT_BACKOFF_S for gap in gaps), gaps
    assert user.accepted.empty()
    for fd in held:
        os.close(fd)
    conn = user.accepted.get(timeout=BOUND)  # at the next try
    conn.sock.send(b"in")
    assert client.recv(2) == b"in"
    assert user.loop.backoffs >= 3
    user.loop.stop()
    client.close()
    assert not user.loop.thread.is_alive()
    os.unlink(path)
    assert _fd_numbers() == fds_before, (fds_before, _fd_numbers())


def _child_serve_and_stop(directory: str) -> None:
    fds_before = _fd_numbers()
    listener, path = _listener(directory)
    served = threading.Event()

    class Served(_Probe):
        def on_event(self, conn: _Conn, events: int) -> None:
            super().on_event(conn, events)
            if conn.sock.recv(100) == b"ping":
                served.set()

    user = Served(listener, backoff=3600.0)
    user.loop.start()
    early = _client(path)
    user.accepted.get(timeout=BOUND)
    late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held = _fill_fd_table()
    late.connect(path)
    assert user.first_backoff.wait(BOUND), "accept never failed with EMFILE"
    early.send(b"ping")  # the listener is left alone for an hour; this one is served
    assert served.wait(BOUND), "a connection was not served during the back-off"
    assert user.accepted.empty()
    for fd in held:
        os.close(fd)
    user.loop.stop()  # wakes the thread in its back-off; no warning that it did not stop
    assert not user.loop.thread.is_alive(), f"still backing off after {STOP_TIMEOUT_S} s"
    assert user.accepted.empty()
    assert early.recv(1) == b""  # on_exit closed it
    early.close()
    late.close()
    os.unlink(path)
    assert _fd_numbers() == fds_before, (fds_before, _fd_numbers())


def _child_main(scenario: str) -> None:
    with (
        warnings.catch_warnings(record=True) as caught,
        tempfile.TemporaryDirectory(prefix="accept-loop-") as d,
    ):
        warnings.simplefilter("always")
        {"backoff": _child_backoff, "serve-and-stop": _child_serve_and_stop}[scenario](d)
    assert not caught, [str(w.message) for w in caught]
    print("ok")


if __name__ == "__main__":
    _child_main(sys.argv[1])
