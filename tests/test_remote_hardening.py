"""No remote client, honest or hostile, locks out the remote server or stalls its producer.

The rules of the local channel (``test_hardening.py``), over UCX on 127.0.0.1
with host memory: handshakes admitted per source address (a flood of silent
connections from one address keeps no honest subscriber out), a stopped
``"latest"`` subscriber never makes the producer wait, a send that does not
complete within ``send_timeout`` evicts its subscriber and gives its leases
back, every way a connection ends gives back what it took, and
``python -m cupy_ipcpool serve`` never ends while its producer lives (and says
why, with a non-zero status, when it ends for another reason).  Attackers and
stopped subscribers are real processes; every test is bounded in time.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from _remote import SECRET, remote_sub, served_host_channel, wait_for
from skips import needs_ucx

from cupy_ipcpool import EndOfStream, SlotBusyError, UsageError
from cupy_ipcpool.remote import _wire as wire
from cupy_ipcpool.remote._accept import MAX_PENDING_PER_ADDRESS
from cupy_ipcpool.remote._admission import WAIT_PROOF, HandshakeBook, address_key
from cupy_ipcpool.remote._credit import ServerBook
from tests import _pipe_child
from tests._fds import open_fds
from tests._stop import sigstop

CTX = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)
SECRET_ENV = "CUPY_IPCPOOL_SECRET"
N_BYTES = 1 << 20  # rendezvous on every transport: a send completes only when the peer takes it


# -- pure: admission per address --------------------------------------------------------


def test_admission_is_per_address_and_per_stage() -> None:
    book = HandshakeBook(2, 5.0)
    a, b = address_key("10.0.0.1"), address_key("10.0.0.2")
    assert address_key("::ffff:10.0.0.1") == a  # IPv4-mapped is the same address
    assert book.admit(1, a, 0.0) == [] and book.admit(2, a, 0.1) == []
    assert book.admit(3, b, 0.2) == []  # another address is not counted against a
    assert book.admit(4, a, 0.3) == [1]  # the oldest of a makes room
    assert book.count(a) == 2 and book.count(b) == 1
    # A connection that sent its HELLO is out of reach of silent ones of its address.
    assert book.advance(2, WAIT_PROOF) == []
    assert book.admit(5, a, 0.4) == [] and book.admit(6, a, 0.5) == [4]
    assert book.stage(2) == WAIT_PROOF and 2 in book
    assert book.advance(5, WAIT_PROOF) == []
    assert book.advance(6, WAIT_PROOF) == [2]  # in its own stage, the oldest goes
    with pytest.raises(UsageError):
        book.advance(6, WAIT_PROOF)
    with pytest.raises(UsageError):
        book.admit(6, a, 0.6)


def test_admission_one_deadline_from_accept() -> None:
    book = HandshakeBook(8, 1.0)
    book.admit(1, 7, 0.0)
    book.admit(2, 7, 0.5)
    book.advance(2, WAIT_PROOF)  # advancing keeps the deadline of the accept
    assert book.next_deadline() == 1.0
    assert book.expired(0.99) == []
    assert book.expired(1.0) == [1]
    assert book.expired(1.6) == [2]
    assert book.count() == 0 and book.next_deadline() is None
    assert not book.remove(2)
    with pytest.raises(UsageError):
        HandshakeBook(0, 1.0)
    with pytest.raises(UsageError):
        HandshakeBook(1, 0.0)


# -- pure: latest budget, overdue sends ---------------------------------------------------


def test_latest_sends_never_retain_the_reserve() -> None:
    book = ServerBook(source_slots=4)  # 4 - 2 reserved: 2 frames for "latest" sends
    book.add_subscriber(1, "latest", 8)
    book.add_subscriber(2, "latest", 8)
    for slot in range(8):
        book.credit(1, slot)
    book.credit(2, 0)
    assert sorted(book.offer(10)) == [(1, 0), (2, 0)]  # one frame, shared
    assert book.offer(11) == [(1, 1)]
    assert book.offer(12) == []  # would retain a third frame: skipped, credit kept
    assert book.latest_skips == 1 and book.granted(1) == 6 and not book.retained(12)
    assert book.latest_frames() == 2
    assert not book.sent(1, 10) and book.sent(2, 10)  # frame 10 free once both finished
    assert book.offer(13) == [(1, 2)]


def test_overdue_sends_name_the_subscriber_and_abandon_gives_back() -> None:
    book = ServerBook(source_slots=8)
    book.add_subscriber(1, "block", 2)
    book.add_subscriber(2, "block", 2)
    book.credit(1, 0, now=0.0)
    book.credit(2, 0, now=0.0)
    assert sorted(book.offer(5, now=1.0)) == [(1, 0), (2, 0)]
    book.offer(6, now=2.0)  # both queue it
    assert book.next_deadline(5.0) == 6.0
    assert book.overdue(5.9, 5.0) == [] and book.overdue(6.1, 5.0) == [1, 2]
    assert book.sent(2, 5) is False  # 2 finished; 1 still holds frame 5
    assert book.overdue(6.1, 5.0) == [1]
    freed = book.remove_subscriber(1, abandon_sends=True)
    assert freed == [5]  # frame 6 still queued for 2
    assert book.in_flight() == 0 and book.retained(6)
    assert book.sent(1, 5) is False  # the late report of an abandoned send is ignored
    assert book.remove_subscriber(2) == [6] and book.retained_frames() == []


# -- end to end ---------------------------------------------------------------------------


def _arrays(seq: int) -> tuple[np.ndarray]:
    return (np.full(N_BYTES, seq % 251, np.uint8),)


def check(frame: Any) -> int:
    (seq,) = struct.unpack("<Q", frame.metadata)
    (a,) = frame.arrays
    assert a.shape == (N_BYTES,) and (a == seq % 251).all(), f"frame {seq}: wrong bytes"
    return int(seq)


def publish(pub: Any, timeout: float = 5.0) -> int:
    seq = pub.core.next_seq
    assert pub.send(*_arrays(seq), metadata=struct.pack("<Q", seq), timeout=timeout) == seq
    return int(seq)


def producer(
    num_slots: int = 4, **kwargs: Any
) -> contextlib.AbstractContextManager[tuple[Any, Any]]:
    """A host channel (slots of 2 * N_BYTES) and its remote server, both in this process."""
    return served_host_channel(2 * N_BYTES, num_slots, **kwargs)


def leases_back(pub: Any) -> bool:
    pub.poll(0.0)
    return all(pub.leases(s) == 0 for s in range(pub.num_slots))


def _state(pub: Any, server: Any) -> str:
    """What the server and the producer hold now, for a failure message."""
    pub.poll(0.0)
    book = server._book
    subs = [(s.sub_id, s.mode, book.granted(s.sub_id)) for s in server.subscribers]
    return (
        f"subscribers (id, mode, credit)={subs} in_flight={book.in_flight()} "
        f"retained={book.retained_frames()} frames_sent={server.frames_sent} "
        f"evictions={server.evictions} last_leave_reason={server.last_leave_reason!r} "
        f"ended={server.ended!r} leases={[pub.leases(s) for s in range(pub.num_slots)]}"
    )


def _fd_table() -> dict[int, str]:
    """This process's open fds, ``fd -> readlink target``, once garbage is collected."""
    gc.collect()  # a refused subscriber's UCX worker goes with its last reference
    return open_fds()


def _fd_kind(target: str) -> str:
    """An fd's kind: ``socket``, ``pipe``, ``anon_inode:[eventfd]``, a path without its ids."""
    if target.startswith(("socket:[", "pipe:[")):
        return target.split(":", 1)[0]
    return re.sub(r"[0-9a-f]{6,}", "*", target)  # /dev/shm/ucx_shm_posix_<id> (deleted)


def _fds_added(before: dict[int, str], after: dict[int, str]) -> list[str]:
    """``fd=target`` of ``after``'s fds of every kind that has more of them than ``before``."""
    more = Counter(map(_fd_kind, after.values())) - Counter(map(_fd_kind, before.values()))
    return [
        f"{fd}={t}"
        for fd, t in sorted(after.items())
        if _fd_kind(t) in more and before.get(fd) != t
    ]


def _settled_fd_table(timeout: float = 10.0) -> dict[int, str]:
    """The fd table once it stayed the same (by kind) for half a second."""
    deadline = time.monotonic() + timeout
    table = _fd_table()
    stable_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - stable_since < 0.5:
        time.sleep(0.05)
        now = _fd_table()
        if Counter(map(_fd_kind, now.values())) != Counter(map(_fd_kind, table.values())):
            stable_since = time.monotonic()
        table = now
    return table


def silent_flood(conn: Connection, host: str, port: int, count: int, source: str) -> None:
    """Keep ``count`` silent connections from ``source`` open; open one more as one closes."""
    socks: dict[int, socket.socket] = {}
    poller = select.poll()
    opened = 0

    def open_one() -> None:
        nonlocal opened
        with contextlib.suppress(OSError):
            s = socket.create_connection((host, port), timeout=5, source_address=(source, 0))
            socks[s.fileno()] = s
            poller.register(s, select.POLLIN)
            opened += 1

    for _ in range(count):
        open_one()
    conn.send(("ready", opened))
    while not conn.poll(0):
        for fd, _ev in poller.poll(20):
            s = socks.pop(fd)
            poller.unregister(fd)
            s.close()
            open_one()
        while len(socks) < count:
            open_one()
    conn.send(("done", opened))


@needs_ucx
@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"], ids=["other", "same"])
def test_silent_connections_from_one_address_lock_no_one_out(source: str) -> None:
    # From another address (127/8 is all loopback) the flood cannot touch an honest
    # handshake at all; from the subscribers' own address it pushes out only the
    # oldest silent ones, and a subscriber pushed out before its HELLO was read
    # tries again within its timeout.
    with producer() as (pub, server):
        host, port = wire.parse_address(server.address)
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=silent_flood, args=(child, host, port, 32, source))
        proc.start()
        try:
            assert parent.poll(30), "the attacker did not start"
            assert parent.recv()[0] == "ready"
            # the flood is in place: every handshake room of its address is taken
            wait_for(lambda: server.pending_handshakes >= MAX_PENDING_PER_ADDRESS)
            joins = []
            for _ in range(6):  # honest subscribers from the same address, one after another
                t0 = time.monotonic()
                with remote_sub(server.address, timeout=10) as sub:
                    joins.append(time.monotonic() - t0)
                    wait_for(lambda: len(server.subscribers) == 1)
                    seq = publish(pub)
                    with sub.recv(timeout=10) as f:
                        assert check(f) == seq
                wait_for(lambda: not server.subscribers)
            parent.send("stop")
            assert parent.poll(30)
            _tag, opened = parent.recv()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        assert opened > 32 + 6  # the flood was renewed as the server pushed its connections out
        assert max(joins) < 3.0, joins  # each one joined within a bound, none was refused


def mode_child(conn: Connection, address: str, slots: int, mode: str) -> None:
    """A ``mode`` subscriber that takes and releases frames until told to stop."""
    got = 0
    try:
        with remote_sub(address, mode=mode, slots=slots) as sub:
            conn.send(("joined", sub.sub_id))
            while not conn.poll(0):
                try:
                    with sub.recv(timeout=0.2) as f:
                        check(f)
                        got += 1
                except TimeoutError:
                    continue
            conn.send(("stopped", got, ""))
    except BaseException as exc:
        conn.send(("error", got, type(exc).__name__))


def _rate(pub: Any, seconds: float) -> tuple[float, int]:
    """Frames per second the producer publishes as fast as it can, and SlotBusyErrors."""
    n = busy = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            publish(pub, timeout=0.5)
            n += 1
        except SlotBusyError:
            busy += 1
    return n / (time.monotonic() - t0), busy


@contextlib.contextmanager
def _child(target: Any, address: str, slots: int, *args: Any) -> Iterator[tuple[Any, Connection]]:
    """Start ``target(conn, address, slots, *args)``; yield once it sent ("joined", ...)."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(child, address, slots, *args))
    proc.start()
    child.close()
    try:
        assert parent.poll(30), "the subscriber child did not start"
        msg = parent.recv()
        assert msg[0] == "joined", msg
        yield proc, parent
    finally:
        if proc.is_alive():
            if proc.pid is not None:  # a stopped child is killed once it runs again
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)
        proc.close()
        parent.close()


@needs_ucx
@pytest.mark.timeout(120)
def test_stopped_latest_subscriber_does_not_stall_the_producer() -> None:
    # 4 slots on both sides, as the subscriber grants its whole ring: the sends to it
    # never complete while it is stopped; they may retain 2 slots, never the last ones.
    with (
        producer(num_slots=4, send_timeout=30.0) as (pub, server),
        _child(mode_child, server.address, 4, "latest") as (proc, conn),
    ):
        wait_for(lambda: server.subscribers)
        base, busy0 = _rate(pub, 1.5)
        assert busy0 == 0 and base > 20
        sub_id = server.subscribers[0].sub_id
        wait_for(lambda: server._book.granted(sub_id) == 4)  # it offers its whole ring again
        sigstop(proc.pid)  # every frame sent to it from now on stays in flight
        stalled, busy = _rate(pub, 2.0)
        os.kill(proc.pid, signal.SIGCONT)
        assert busy == 0, f"{busy} SlotBusyError while one latest subscriber was stopped"
        assert stalled >= base / 3, (base, stalled)  # within a factor 3 of its rate
        assert len(server.subscribers) == 1  # it is not evicted before send_timeout
        wait_for(lambda: server.frames_sent > 0)
        conn.send("stop")
        assert conn.poll(30)
        tag, got, err = conn.recv()
        assert tag == "stopped" and got > 0, (tag, got, err)  # it goes on after SIGCONT


@needs_ucx
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["latest", "block"])
def test_send_timeout_evicts_a_stopped_subscriber_and_gives_back(mode: str) -> None:
    # send_timeout 2 s, not the default 5 s (docs/remote.md pins that one): the rule, sooner
    with producer(num_slots=4, send_timeout=2.0) as (pub, server):
        timeout = server.send_timeout
        with _child(mode_child, server.address, 2, mode) as (proc, conn):
            wait_for(lambda: server.subscribers, what=lambda: _state(pub, server))
            sub_id = server.subscribers[0].sub_id
            # its whole ring is offered
            wait_for(lambda: server._book.granted(sub_id) == 2, what=lambda: _state(pub, server))
            sigstop(proc.pid)  # the frames sent into it never complete
            t0 = time.monotonic()
            while server.subscribers:  # the producer goes on publishing meanwhile
                with contextlib.suppress(SlotBusyError):  # a block subscriber may make it wait
                    publish(pub, timeout=0.1)
                waited = time.monotonic() - t0
                assert waited < timeout + 3.0, (
                    f"no eviction {waited:.1f} s after the subscriber stopped "
                    f"(send_timeout={timeout} s): {_state(pub, server)}"
                )
                time.sleep(0.001)  # leave the server's threads their turn on a loaded machine
            # Evicted: its leases (frames in flight to it included) come back without
            # the producer publishing again.
            left = time.monotonic() + 5.0
            while not leases_back(pub):
                assert time.monotonic() < left, (
                    f"leases kept after the eviction: {_state(pub, server)}"
                )
                time.sleep(0.005)
            assert "send_timeout" in server.last_leave_reason, _state(pub, server)
            assert server.evictions == 1, _state(pub, server)
            for _ in range(10):  # every slot is the producer's again
                publish(pub, timeout=1.0)
            os.kill(proc.pid, signal.SIGCONT)
            assert conn.poll(30), "the subscriber did not report after SIGCONT"
            tag, _got, err = conn.recv()
            assert (tag, err) == ("error", "EvictedError"), (tag, err, server.last_leave_reason)


def _raw(address: str) -> socket.socket:
    host, port = wire.parse_address(address)
    return socket.create_connection((host, port), timeout=5)


def killed_child(conn: Connection, address: str, slots: int) -> None:
    """Join, receive and hold ``slots`` frames, then wait to be killed."""
    try:
        sub = remote_sub(address, slots=slots)
        conn.send(("joined", sub.sub_id))
        held = [sub.recv(timeout=20) for _ in range(slots)]
        conn.send(("held", [check(f) for f in held]))
        time.sleep(60)
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, str(exc)))


#: The handshake deadline of the server that ``_end_every_way`` talks to: shorter than the
#: default (5 s) so that the silent connection of each round is refused sooner, and long
#: enough for an honest subscriber's handshake on a loaded machine.
HANDSHAKE_DEADLINE = 2.5


def _end_every_way(pub: Any, server: Any) -> None:
    """End one connection each way a connection ends; return once the server forgot them."""
    from cupy_ipcpool.remote import AuthenticationError

    # refused: the wrong secret, a malformed HELLO
    with pytest.raises(AuthenticationError):
        remote_sub(server.address, secret="wrong horse battery staple 42")
    with _raw(server.address) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert s.recv(4096)  # a REFUSE
    # hung up: before HELLO, between HELLO and PROOF
    _raw(server.address).close()
    with _raw(server.address) as s:
        s.sendall(wire.encode_hello(os.urandom(32), 0, 2))
        s.recv(4096)
    # timed out: a silent connection is refused after the handshake deadline
    silent = _raw(server.address)
    silent.settimeout(HANDSHAKE_DEADLINE + 8)
    t0 = time.monotonic()
    assert silent.recv(4096)  # the REFUSE at the deadline
    assert time.monotonic() - t0 < HANDSHAKE_DEADLINE + 3
    silent.close()
    # joined then closed (BYE) while frames were in flight
    with remote_sub(server.address, slots=2):
        wait_for(lambda: server.subscribers)
        publish(pub)
        publish(pub)
    # joined then killed while holding frames, with frames queued for it
    with _child(killed_child, server.address, 2) as (proc, _conn):
        wait_for(lambda: server.subscribers)
        for _ in range(2):
            publish(pub)
        wait_for(lambda: _conn.poll(0), timeout=30, poll=lambda: pub.poll(0.0))
        for _ in range(2):
            publish(pub, timeout=1.0)  # queued in the bridge for it
        proc.kill()
        proc.join(10)

    def state() -> str:
        return _state(pub, server)

    wait_for(lambda: not server.subscribers, timeout=20, what=state)
    wait_for(lambda: leases_back(pub), timeout=20, what=state)
    wait_for(lambda: server.pending_handshakes == 0, timeout=10, what=state)


@needs_ucx
@pytest.mark.timeout(120)
def test_every_way_a_connection_ends_gives_everything_back() -> None:
    # The first round opens what this process keeps for its life: the multiprocessing
    # resource tracker's pipe (the first spawn), what UCX and the CUDA driver open at a
    # first use (a first transfer, a first peer of a kind).  Each round ends each
    # connection every way once: a server keeping anything per connection has more
    # fds of some kind after the second round than after the first.
    with producer(num_slots=4, handshake_timeout=HANDSHAKE_DEADLINE) as (pub, server):
        start = _fd_table()
        _end_every_way(pub, server)
        first = _settled_fd_table()
        _end_every_way(pub, server)
        deadline = time.monotonic() + 30.0  # an endpoint to a killed peer goes when UCX sees it
        while left := _fds_added(first, _fd_table()):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"fds left by the second round (of kinds it has more of than the first "
                    f"left): {left}; the first round had kept {_fds_added(start, first)}; "
                    f"{_state(pub, server)}"
                )
            time.sleep(0.05)
        for _ in range(8):
            publish(pub, timeout=1.0)  # every slot is the producer's again


# -- the serve command ---------------------------------------------------------------------


def host_producer(conn: Connection, path: str) -> None:
    """A host channel publishing a frame every 10 ms until told to close (or killed)."""
    from cupy_ipcpool.remote import HostChannelPublisher

    with HostChannelPublisher(path, 4, 2 * N_BYTES) as pub:
        conn.send("ready")
        seq = 0
        while not conn.poll(0):
            with contextlib.suppress(SlotBusyError):
                pub.send(*_arrays(seq), metadata=struct.pack("<Q", seq), timeout=0.05)
                seq += 1
            pub.poll(0.01)
    conn.send("closed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str, secret: bool = True) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.pop(SECRET_ENV, None)
    if secret:
        env[SECRET_ENV] = SECRET
    return subprocess.Popen(
        [sys.executable, "-m", "cupy_ipcpool", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


_BAD_CLIENTS = """
import sys
from cupy_ipcpool.remote import subscribe
address = sys.argv[1]
for secret, insecure in (("wrong horse battery staple 42", False), (None, True), (None, False)):
    try:
        subscribe(address, secret=secret, insecure=insecure, memory="host", timeout=10).close()
        print("joined")
    except Exception as exc:
        print(type(exc).__name__)
"""


@contextlib.contextmanager
def _served(tmp: str) -> Iterator[tuple[Any, Connection, subprocess.Popen[bytes], str]]:
    path = os.path.join(tmp, "cam.sock")
    parent, child = CTX.Pipe()
    prod = CTX.Process(target=host_producer, args=(child, path))
    prod.start()
    serve: subprocess.Popen[bytes] | None = None
    try:
        assert parent.poll(30) and parent.recv() == "ready"
        address = f"ucx://127.0.0.1:{_free_port()}"
        listen = address.removeprefix("ucx://")
        serve = _cli("serve", path, "--listen", listen, "--memory", "host")
        deadline = time.monotonic() + 30
        while True:  # serving once the listener answers
            with contextlib.suppress(OSError), _raw(address):
                break
            assert serve.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.1)
        yield prod, parent, serve, address
    finally:
        if serve is not None:
            if serve.poll() is None:
                serve.kill()
            # its pipe closed too: left to the garbage collector, its ResourceWarning
            # would fail whichever test of this worker collects it
            serve.communicate(timeout=10)
        if prod.is_alive():
            prod.kill()
        prod.join(10)


@needs_ucx
@pytest.mark.timeout(180)
def test_serve_outlives_refused_clients_and_serves_a_relay() -> None:
    from cupy_ipcpool.remote import HostChannelSubscriber

    with tempfile.TemporaryDirectory() as tmp, _served(tmp) as (_prod, _conn, serve, address):
        relay_path = os.path.join(tmp, "relay.sock")
        bad = subprocess.Popen(
            [sys.executable, "-c", _BAD_CLIENTS, address],
            env={k: v for k, v in os.environ.items() if k != SECRET_ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        relay = _cli("relay", address, relay_path, "--slots", "4", "--memory", "host")
        try:
            out, _ = bad.communicate(timeout=60)
            assert out.split() == [b"AuthenticationError", b"AuthenticationError", b"UsageError"]
            wait_for(lambda: os.path.exists(relay_path) or relay.poll() is not None, timeout=30)
            assert relay.poll() is None, relay.communicate()[0]
            with HostChannelSubscriber(relay_path) as reader:
                seen: list[int] = []
                deadline = time.monotonic() + 30
                while len(seen) < 5 and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError), reader.recv(timeout=0.2) as f:
                        seen.append(check(f))
                assert len(seen) == 5 and seen == sorted(seen)
            assert serve.poll() is None  # still serving
        finally:
            if relay.poll() is None:
                relay.send_signal(signal.SIGINT)
            relay.communicate(timeout=30)
        serve.send_signal(signal.SIGINT)
        out, _ = serve.communicate(timeout=30)
        assert serve.returncode == 0, out


@needs_ucx
@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["closed", "killed"])
def test_serve_exit_status_says_how_its_producer_ended(end: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, _served(tmp) as (prod, conn, serve, _address):
        time.sleep(0.5)
        if end == "closed":
            conn.send("close")
            assert conn.poll(30) and conn.recv() == "closed"
        else:
            prod.kill()
        out, _ = serve.communicate(timeout=30)
        if end == "closed":
            assert serve.returncode == 0, out
        else:
            assert serve.returncode == 1, out
            assert b"the server ended" in out, out


@needs_ucx
@pytest.mark.timeout(60)
def test_server_ended_says_why() -> None:
    with producer() as (pub, server):
        assert server.running and server.ended is None
        pub.close()  # the producer closes its channel cleanly
        assert server.wait(20)
        ended = server.ended
        assert isinstance(ended, EndOfStream) and ended.clean
        assert "source ended" in str(ended)
