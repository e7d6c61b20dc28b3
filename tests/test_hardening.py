"""Issue 10 for real: no client, honest or hostile, locks out the publisher or the fd server.

Every attack runs against the real session core (memfd slots) or the real fd
server, from real processes over real sockets; attackers of another user are
spawned children that drop to uid 65534.  Each test asserts the honest path
and is bounded in time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import struct
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer, MemfdSlots
from _memop_recorder import MemopRecorder
from _pipe_child import PipeChild, started
from _stop import sigstop

from cupy_ipcpool._errors import (
    ChannelTimeoutError,
    EndOfStream,
    EvictedError,
    IpcPoolError,
    LeaseStateError,
    PeerRefusedError,
    ProtocolError,
    TransportError,
)
from cupy_ipcpool._transport import FdServer, bind_unix, fetch_fds, fetch_fds_over_socket
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._handshake import HANDSHAKE_TIMEOUT, SubscriberInfo, Welcome
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._settle import reader_rows
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from cupy_ipcpool.channel._syncpage import FlagLayout, SharedFlags

NOBODY = 65534

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="attacks of another user need root to drop to uid 65534"
)


# -- helpers ---------------------------------------------------------------------------


@contextlib.contextmanager
def _memfd_channel(
    address: str, num_slots: int, slot_size: int = 4096, **kwargs: Any
) -> Iterator[tuple[PublisherCore, MemfdSlots]]:
    """A publisher core over memfd slots, driven by the test itself; both closed after."""
    slots = MemfdSlots(num_slots, slot_size)
    try:
        core = PublisherCore(address, num_slots, welcome=slots.welcome(), **kwargs)
        try:
            yield core, slots
        finally:
            core.close()
    finally:
        slots.close()


def _until_subscribed(core: PublisherCore) -> None:
    while not core.subscribers:
        core.poll(0.01)


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _umask() -> int:
    """The process umask, read without changing it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise AssertionError("no Umask in /proc/self/status")


@pytest.fixture
def public_dir() -> Iterator[str]:
    """A directory other users can use, sticky like /tmp (tmp_path is private to root)."""
    d = tempfile.mkdtemp(prefix="ipcpool-hardening-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    for name in os.listdir(d):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(d, name))
    with contextlib.suppress(OSError):
        os.rmdir(d)


class RowProducer:
    """A publisher that gives each subscriber a row of read flags, as the channel does.

    A background thread publishes (memfd slots) and polls, as a live producer
    would.  The accept thread hands out the rows (the engine's ``ReaderRows``
    over a page of flags); one welcomed and never adopted gives its row back
    there, an adopted one through ``on_leave``.
    """

    def __init__(self, address: str, num_slots: int = 8, **kwargs: Any) -> None:
        self.slots = MemfdSlots(num_slots)
        layout = FlagLayout(num_slots, kwargs.get("max_subscribers", 64))
        self.flags = SharedFlags.create(layout.nbytes)
        self.rows = reader_rows(self.flags, layout)
        self.idle = [0] * num_slots
        welcome = Welcome(
            struct.pack("<QI", self.slots.slot_size, 0),
            tuple(self.slots.fds),
            rows=self.rows,
            row_at=8,
        )
        self.core = PublisherCore(
            address, num_slots, welcome=welcome, on_leave=self._on_leave, **kwargs
        )
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._pause = threading.Event()
        self.published = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _on_leave(self, info: SubscriberInfo) -> None:
        self.rows.leave(info.sub_id, self.idle, True)  # no stream waits on its flags

    def rows_in_use(self) -> int:
        return self.rows.live

    @property
    def welcomed(self) -> int:
        return self.core.welcomed

    def _loop(self) -> None:
        core = self.core
        try:
            while not self._stop.is_set():
                if self._pause.is_set():
                    time.sleep(0.005)
                    continue
                slot, _readers = core.acquire(10.0)
                seq = core.next_seq
                self.slots.write(slot, seq)
                core.publish(slot)
                self.published += 1
                core.poll(0.002)
        except BaseException as exc:
            self.errors.append(exc)

    def subscribers(self) -> int:
        self._pause.set()
        try:
            time.sleep(0.02)
            return len(self.core.subscribers)
        finally:
            self._pause.clear()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(15)
        self.core.close()
        self.slots.close()
        self.rows.release_page()
        self.flags.close()
        assert not self.errors, self.errors

    def __enter__(self) -> RowProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hello() -> bytes:
    return proto.encode_hello(proto.MODE_BLOCK, 4, os.getpid())


def _hello_and_hang_up(address: str, n: int, how: str = "close") -> None:
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(address)
            s.send(_hello())
            if how == "shut_rd" and i % 2:
                s.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        finally:
            s.close()


def _idle_connections(
    address: str, n: int, kind: int = socket.SOCK_SEQPACKET
) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, kind)
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.connect(address)
        out.append(s)
    return out


def _child_idle_as(conn: Connection, uid: int, address: str, n: int, kind: int) -> None:
    """As ``uid``: hold ``n`` idle connections to ``address`` until told to stop."""
    try:
        _drop_to(uid)
        socks = _idle_connections(address, n, kind)
        conn.send(("ready", len(socks)))
        conn.recv()
        for s in socks:
            s.close()
        conn.send(("done", 0))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))


def _child_dribble_as(conn: Connection, uid: int, path: str, period: float) -> None:
    """As ``uid``: connect to an fd server and send one request byte every ``period`` s."""
    try:
        _drop_to(uid)
        request = b"FDS1\x10" + b"x" * 16
        socks = []
        conn.send(("ready", 0))
        i = 0
        while not conn.poll(period):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with contextlib.suppress(OSError):
                s.connect(path)
                socks.append(s)
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(request[i % len(request) : i % len(request) + 1])
            i += 1
        for s in socks:
            s.close()
        conn.send(("done", 0))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))


class Child(PipeChild):
    """A child that sends ``(what, value)`` messages and ends when told "stop"."""

    def expect(self, what: str, timeout: float = 30.0) -> Any:
        msg = self.recv(timeout, f"child sent nothing within {timeout} s")
        assert msg[0] == what, msg
        return msg[1]

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        super().finish()


@pytest.fixture
def children() -> Iterator[Callable[..., Child]]:
    with started(Child) as start:
        yield start


def _timed_join(address: str, **kwargs: Any) -> tuple[float, MemfdConsumer]:
    t0 = time.monotonic()
    consumer = MemfdConsumer(address, timeout=10.0, **kwargs)
    return time.monotonic() - t0, consumer


# -- 1, 2: the publisher's handshake ------------------------------------------------


@needs_root
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nobody_allowed", [False, True], ids=["nobody-refused", "nobody-allowed"])
def test_honest_join_under_attack(
    public_dir: str, children: Callable[..., Child], nobody_allowed: bool
) -> None:
    address = os.path.join(public_dir, "chan.sock")
    allowed = {0, NOBODY} if nobody_allowed else {0, NOBODY - 1}  # 0666 socket either way
    with RowProducer(address, allowed_uids=allowed) as producer:
        # 50 idle connections of another uid (refused at accept, or capped per uid)
        nobody = children(_child_idle_as, NOBODY, address, 50, socket.SOCK_SEQPACKET)
        assert nobody.expect("ready") == 50
        # 200 clients that say HELLO and hang up at once (half shut down SHUT_RD first)
        _hello_and_hang_up(address, 100)
        _hello_and_hang_up(address, 100, how="shut_rd")
        # 20 honest subscribers that give up (time out) during the handshake
        timed_out = 0
        for _ in range(20):
            try:
                SubscriberCore(address, timeout=0.0005).close()
            except ChannelTimeoutError:
                timed_out += 1
        # 50 idle connections of our own uid
        idle = _idle_connections(address, 50)
        try:
            # every row taken for a client that left comes back
            deadline = time.monotonic() + 10
            while producer.rows_in_use() > producer.subscribers():
                assert time.monotonic() < deadline, (
                    f"{producer.rows_in_use()} rows taken for {producer.subscribers()} subscribers"
                )
                time.sleep(0.02)
            assert producer.welcomed >= 1
            joins = []
            for _ in range(3):
                took, consumer = _timed_join(address)
                with consumer:
                    joins.append(took)
                    seqs = [consumer.recv(timeout=5.0).seq for _ in range(3)]
                    assert seqs == sorted(seqs)
            # none waited for an attacker's handshake to run out (HANDSHAKE_TIMEOUT): the
            # honest HELLO is answered whatever the idle and hung-up connections hold
            assert max(joins) < HANDSHAKE_TIMEOUT, f"honest joins took {joins} s under attack"
        finally:
            for s in idle:
                s.close()
    print(
        f"\nhonest join under attack: {[round(t * 1000, 1) for t in joins]} ms; "
        f"{timed_out} of 20 short-timeout subscribers timed out"
    )


@pytest.mark.timeout(60)
def test_hello_then_hang_up_gives_every_row_back(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    with RowProducer(address, max_subscribers=8) as producer:
        _hello_and_hang_up(address, 64)
        _hello_and_hang_up(address, 64, how="shut_rd")
        deadline = time.monotonic() + 10
        while producer.rows_in_use():
            assert time.monotonic() < deadline, f"{producer.rows_in_use()} rows leaked"
            time.sleep(0.02)
        with MemfdConsumer(address, timeout=5.0) as consumer:
            consumer.recv(timeout=5.0)
            assert producer.rows_in_use() == 1


@pytest.mark.timeout(60)
def test_welcome_that_cannot_be_sent_gives_the_row_back(tmp_path: Any) -> None:
    """A HELLO queued by a client that has left: the WELCOME fails (or the hang-up is seen
    right after it), the row comes back, and ``on_leave`` hears of each in the producer's
    thread."""
    address = str(tmp_path / "chan.sock")
    slots = MemfdSlots(2)
    left: list[int] = []
    producer = threading.get_ident()

    def on_leave(info: SubscriberInfo) -> None:
        assert threading.get_ident() == producer
        left.append(info.sub_id)

    core = PublisherCore(address, 2, welcome=slots.welcome(), on_leave=on_leave)
    try:
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(address)
            s.send(_hello())
            s.close()
        deadline = time.monotonic() + 10
        while len(left) < 5:
            assert time.monotonic() < deadline, (core.welcomed, left)
            core.poll(0.02)
        assert sorted(left) == [1, 2, 3, 4, 5]
        assert core.welcomed == 5
        assert core.subscribers == []
    finally:
        core.close()
        slots.close()


@pytest.mark.timeout(60)
def test_idle_connection_does_not_delay_a_join_and_times_out(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    with RowProducer(address, handshake_timeout=0.5) as producer:
        idle = _idle_connections(address, 3)
        took, consumer = _timed_join(address)
        consumer.close()
        assert took < 1.0
        for s in idle:  # each idle one is told why and closed at its deadline
            s.settimeout(5.0)
            reply = proto.decode(s.recv(4096))
            assert isinstance(reply, proto.Refuse) and "no HELLO within" in reply.reason
            assert s.recv(4096) == b""
            s.close()
        assert producer.core._acc.pending_handshakes() == 0


@pytest.mark.timeout(60)
def test_pending_handshakes_are_capped_per_uid(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    with RowProducer(address, max_pending_per_uid=4) as producer:
        idle = _idle_connections(address, 10)
        deadline = time.monotonic() + 5
        while producer.core._acc.pending_handshakes(os.geteuid()) != 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = 0
        for s in idle[:6]:  # the oldest six made room
            s.settimeout(5.0)
            reply = proto.decode(s.recv(4096))
            assert isinstance(reply, proto.Refuse) and "oldest" in reply.reason
            refused += 1
        assert refused == 6
        took, consumer = _timed_join(address)
        consumer.close()
        assert took < 1.0
        for s in idle:
            s.close()


@pytest.mark.timeout(60)
def test_full_backlog_is_retried_until_the_subscribers_timeout(tmp_path: Any) -> None:
    address = str(tmp_path / "full.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(0)  # never accepted: the queue fills at once
    fillers = _idle_connections(address, 8)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeoutError) as info:
            SubscriberCore(address, timeout=0.5)
        took = time.monotonic() - t0
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, IpcPoolError)
        assert 0.4 < took < 3.0, f"gave up after {took} s"
    finally:
        for s in fillers:
            s.close()
        listener.close()


# -- 3: the fd server -------------------------------------------------------------------


@needs_root
@pytest.mark.timeout(120)
def test_fd_fetch_under_idle_and_dribbling_clients(
    public_dir: str, children: Callable[..., Child], fd_count: Callable[[], int]
) -> None:
    slots = MemfdSlots(3)
    path = os.path.join(public_dir, "fds.sock")
    token = b"t" * 16
    # the socket is 0666 (another uid is allowed), so uid 65534 can connect and is refused
    with FdServer(slots.fds, token=token, path=path, allowed_uids={NOBODY - 1}):
        idle = _idle_connections(path, 32, socket.SOCK_STREAM)
        for s in idle[:8]:  # some send half a request and stop
            with contextlib.suppress(OSError):
                s.send(b"FD")
        dribbler = children(_child_dribble_as, NOBODY, path, 0.5)
        dribbler.expect("ready")
        own_dribbler = threading.Event()

        def dribble_own() -> None:
            socks = []
            while not own_dribbler.wait(0.5):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                with contextlib.suppress(OSError):
                    s.connect(path)
                    socks.append(s)
                for s in socks:
                    with contextlib.suppress(OSError):
                        s.send(b"F")
            for s in socks:
                s.close()

        t = threading.Thread(target=dribble_own, daemon=True)
        t.start()
        try:
            times = []
            before = fd_count()
            for _ in range(9):
                t0 = time.monotonic()
                fds = fetch_fds_over_socket(path, token, 3, timeout=5.0)
                times.append(time.monotonic() - t0)
                for fd in fds:
                    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
                    os.close(fd)
                time.sleep(0.1)
            assert max(times) < 1.0, f"fetches took {times} s"
            assert fd_count() <= before + 2  # the dribbler thread's sockets come and go
        finally:
            own_dribbler.set()
            t.join(5)
            for s in idle:
                s.close()
    slots.close()
    print(f"\nfd fetch under attack: max {max(times) * 1000:.1f} ms")


@pytest.mark.timeout(60)
def test_fd_server_per_uid_cap_drops_the_oldest(tmp_path: Any) -> None:
    slots = MemfdSlots(2)
    from cupy_ipcpool import _transport

    with FdServer(slots.fds, token=b"k") as server:
        idle = _idle_connections(
            server.path, _transport.MAX_PENDING_PER_UID + 4, socket.SOCK_STREAM
        )
        for s in idle[:4]:
            s.setblocking(True)
            s.settimeout(5.0)
            assert s.recv(1) == bytes([_transport.STATUS_BUSY])
        fds = fetch_fds_over_socket(server.path, b"k", 2, timeout=2.0)
        for fd in fds:
            os.close(fd)
        for s in idle:
            s.close()
    slots.close()


# -- 4: latest never stalls the producer; lease timeout ---------------------------------


def _child_greedy_latest(conn: Connection, address: str) -> None:
    """Latest subscribers asking for credit 65535 that never release: join on "join", leave
    on "leave", report the credit granted and the frames received."""
    try:
        while conn.recv() == "join":
            with SubscriberCore(address, mode="latest", credit=65535, timeout=10) as sub:
                conn.send(("joined", sub.credit))
                got = 0
                while not conn.poll(0):
                    with contextlib.suppress(ChannelTimeoutError):
                        sub.recv(timeout=0.05)
                        got += 1
                assert conn.recv() == "leave"
            conn.send(("left", got))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))


def _publish_without_waiting(core: PublisherCore, slots: MemfdSlots, frames: int) -> None:
    """Publish ``frames`` frames; SlotBusyError if the producer ever had to wait for a slot."""
    for n in range(1, frames + 1):
        slot, _ = core.acquire(0.0)  # SlotBusyError if the producer would have to wait
        slots.write(slot, core.next_seq)
        core.publish(slot)
        if n % 16 == 0:
            core.poll(0.0)


@pytest.mark.timeout(120)
def test_greedy_latest_subscriber_never_makes_the_producer_wait(
    tmp_path: Any, children: Callable[..., Child]
) -> None:
    """A latest subscriber asking for all the credit there is gets max_credit (6 of 8 slots):
    the producer, publishing as fast as it can while it holds all 6, never waits for a slot.
    (What that leaves of the producer's rate is a measurement, not a test: benchmarks/.)"""
    address = str(tmp_path / "chan.sock")
    with _memfd_channel(address, 8, 1024 * 1024) as (core, slots):
        assert core.max_credit == 6
        greedy = children(_child_greedy_latest, address)
        for _ in range(5):  # join and leave again: each time the same
            _publish_without_waiting(core, slots, 500)
            greedy.conn.send("join")
            _until_subscribed(core)
            assert greedy.expect("joined") == 6  # the credit granted, not the one asked
            (info,) = core.subscribers
            assert info.credit == 6
            _publish_without_waiting(core, slots, 2000)
            assert core.lease_book.outstanding(info.sub_id) == 6  # it holds all it may
            assert core.lease_book.latest_leased_slots() == 6
            greedy.conn.send("leave")
            assert 1 <= greedy.expect("left") <= 6
            while core.subscribers:
                core.poll(0.01)
        greedy.conn.send("stop")


def _child_stopped_block(conn: Connection, address: str) -> None:
    """A block subscriber that takes frames, gets SIGSTOPped holding them, then resumes."""
    try:
        with MemfdConsumer(address, timeout=10) as consumer:
            conn.send(("joined", consumer.core.lease_timeout))
            frames = [consumer.recv(timeout=10) for _ in range(2)]
            conn.send(("holding", [f.seq for f in frames]))
            os.kill(os.getpid(), signal.SIGSTOP)
            errors = []
            try:
                consumer.core.release(frames[0].seq, frames[0].slot)
            except IpcPoolError as exc:
                errors.append(type(exc).__name__)
            try:
                consumer.core.recv(timeout=1)
            except IpcPoolError as exc:
                errors.append(type(exc).__name__)
            conn.send(("errors", errors))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(60)
def test_lease_timeout_evicts_a_stopped_subscriber(
    tmp_path: Any, children: Callable[..., Child]
) -> None:
    address = str(tmp_path / "chan.sock")
    left: list[int] = []
    with _memfd_channel(address, 4, lease_timeout=0.5, on_leave=lambda i: left.append(1)) as (
        core,
        slots,
    ):
        child = children(_child_stopped_block, address)
        _until_subscribed(core)
        assert child.expect("joined") == 0.5
        for _ in range(2):
            slot, _ = core.acquire(5.0)
            slots.write(slot, core.next_seq)
            core.publish(slot)
        child.expect("holding")
        # the producer keeps going: it waits at most about lease_timeout, never forever
        t0 = time.monotonic()
        for _ in range(20):
            slot, _ = core.acquire(5.0)
            slots.write(slot, core.next_seq)
            core.publish(slot)
        assert time.monotonic() - t0 < 3.0
        assert core.evictions == 1 and left == [1]
        assert "evicted" in core.last_leave_reason
        os.kill(child.proc.pid, signal.SIGCONT)
        assert child.expect("errors") == ["EvictedError", "EvictedError"]


def _evict_overdue(core: PublisherCore) -> None:
    """Let ``lease_timeout=0.2`` pass; the publisher's next poll evicts the one subscriber."""
    time.sleep(0.3)
    core.poll(0.0)
    assert core.evictions == 1


def _publish_three_then_evict(core: PublisherCore) -> None:
    """Publish three frames to the one subscriber, then evict it (``lease_timeout=0.2``)."""
    _until_subscribed(core)
    for _ in range(3):
        slot, _ = core.acquire(1.0)
        core.publish(slot)
    _evict_overdue(core)


def _until_hung_up(sub: SubscriberCore) -> None:
    """Wait (at most 5 s) until ``sub`` sees that the publisher hung up."""
    deadline = time.monotonic() + 5
    while sub.connected():
        assert time.monotonic() < deadline, "the hang-up was never seen"
        time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spin_us", [0, 200], ids=["sleeping", "spinning"])
def test_evicted_subscriber_never_gets_a_revoked_frame(tmp_path: Any, spin_us: float) -> None:
    """Frames queued before the eviction are not handed out; EvictedError instead.

    Also while spinning: a frame taken by a non-blocking receive gets the same
    hang-up check as one that was waited for.
    """
    address = str(tmp_path / "chan.sock")
    with (
        _memfd_channel(address, 8, lease_timeout=0.2) as (core, _slots),
        SubscriberCore(address, timeout=5, spin_us=spin_us) as sub,
    ):
        assert sub.lease_timeout == 0.2 and sub.connected()
        _publish_three_then_evict(core)
        # the GPU subscriber asks this before writing its sync-page row
        assert not sub.connected()
        with pytest.raises(EvictedError) as info:
            sub.recv(timeout=1)
        assert "lease_timeout" in str(info.value)
        assert isinstance(info.value, EndOfStream) and not info.value.clean
        assert sub.held == {}
        with pytest.raises(EvictedError):
            sub.recv(timeout=1)
        assert sub.evicted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spin_us", [0, 200], ids=["sleeping", "spinning"])
def test_recv_alone_never_hands_out_a_frame_queued_before_an_eviction(
    tmp_path: Any, spin_us: float
) -> None:
    """The same without asking ``connected()`` first: recv's own check must see the eviction.

    The frames are already queued when recv runs, so it takes them without
    waiting (while spinning: by a non-blocking receive); the hang-up check
    that follows such a receive is what turns them into EvictedError.
    """
    address = str(tmp_path / "chan.sock")
    with (
        _memfd_channel(address, 8, lease_timeout=0.2) as (core, _slots),
        SubscriberCore(address, timeout=5, spin_us=spin_us) as sub,
    ):
        _publish_three_then_evict(core)
        with pytest.raises(EvictedError):
            sub.recv(timeout=1)
        assert sub.held == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spin_us", [0, 200], ids=["sleeping", "spinning"])
def test_connected_turns_false_on_a_clean_close_and_keeps_queued_frames(
    tmp_path: Any, spin_us: float
) -> None:
    """After the publisher hangs up, ``connected()`` is False; frames sent before still arrive."""
    address = str(tmp_path / "chan.sock")
    with (
        _memfd_channel(address, 4) as (core, _slots),
        SubscriberCore(address, timeout=5, spin_us=spin_us) as sub,
    ):
        _until_subscribed(core)
        assert sub.connected()
        slot, _ = core.acquire(1.0)
        seq = core.publish(slot)
        core.close()
        _until_hung_up(sub)
        frame = sub.recv(timeout=1)
        assert (frame.seq, frame.slot) == (seq, slot)
        assert not sub.evicted
        with pytest.raises(EndOfStream) as info:
            sub.recv(timeout=1)
        assert info.value.clean


# -- 4a': eviction with frames queued while the subscriber is stopped or not reading --------


def _call_result(consumer: MemfdConsumer) -> tuple[str, Any]:
    """One ``recv``: ("frame", (seq, intact)) where intact says the slot held its data
    when recv returned, or ("raised", exception type name)."""
    try:
        frame = consumer.core.recv(timeout=30)
    except IpcPoolError as exc:
        return "raised", type(exc).__name__
    got = consumer.maps[frame.slot][:8]
    return "frame", (frame.seq, int.from_bytes(got, "little") == frame.seq)


def _child_waiting_in_recv(conn: Connection, address: str, rounds: int, spin_us: float) -> None:
    """Each round: subscribe, say so, and call recv (it waits for the frame) until evicted."""
    try:
        for _ in range(rounds):
            with MemfdConsumer(address, timeout=10, spin_us=spin_us) as consumer:
                conn.send(("waiting", consumer.core.sub_id))
                calls = []
                for _call in range(3):  # a frame taken before the stop, then EvictedError
                    calls.append(_call_result(consumer))
                    if calls[-1][0] == "raised":
                        break
                conn.send(("calls", calls))
        conn.send(("done", 0))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))


def _rewrite_every_slot(core: PublisherCore, slots: MemfdSlots) -> None:
    """Reuse every slot (nobody subscribed): write and publish a new frame into each."""
    for _ in range(core.num_slots):
        slot, _readers = core.acquire(5.0)
        slots.write(slot, core.next_seq)
        core.publish(slot)


def _unread_bytes(fd: int) -> int:
    """Bytes this socket sent that its peer has not read yet (``SIOCOUTQ`` of an AF_UNIX
    socket: the kernel's count, exact while the peer is stopped)."""
    (count,) = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4))
    return int(count)


def _check_calls(calls: list[tuple[str, Any]], frame_unread_at_stop: bool) -> None:
    """What recv may answer when the subscriber was stopped, evicted and resumed.

    Frame unread at the stop: it was queued at the eviction, so it is never
    handed out. Read before the stop: recv may have handed it out before the
    eviction (then its slot may be reused while it is held, as documented), or
    may raise EvictedError; either way the next call raises.
    """
    if frame_unread_at_stop:
        assert calls == [("raised", "EvictedError")], f"a revoked frame was handed out: {calls}"
    else:
        assert calls[-1] == ("raised", "EvictedError"), calls
        assert len(calls) <= 2, calls  # at most the frame handed out before the stop


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spin_us", [0, 200], ids=["sleeping", "spinning"])
def test_stopped_while_a_frame_is_queued_never_gets_it(
    tmp_path: Any, children: Callable[..., Child], spin_us: float
) -> None:
    """SIGSTOP right after a frame was sent to a subscriber waiting in recv (or just
    before, every other round); evict; reuse the slot; SIGCONT: its recv raises
    EvictedError instead of handing out that frame.

    The stop usually lands while the subscriber's wait has seen the frame arrive
    and its receive has not run yet: what the wait saw says nothing about the
    eviction that comes during the stop, so the check must follow the receive.
    Whether the frame was still unread at the stop is read from the kernel
    (the publisher's socket's unread bytes), not guessed: a frame the subscriber
    had read before the stop may lawfully have been handed out.
    """
    rounds = 4
    address = str(tmp_path / "chan.sock")
    with _memfd_channel(address, 4, lease_timeout=0.2) as (core, slots):
        child = children(_child_waiting_in_recv, address, rounds, spin_us)
        pid = child.proc.pid
        assert pid is not None
        for n in range(rounds):
            child.expect("waiting")
            _until_subscribed(core)
            (sub,) = core.subscribers
            fd = core._session.fd(sub.sub_id)  # the publisher's end of its socket
            time.sleep(0.05)  # the subscriber waits in poll(2) by now (past its spin)
            stop_first = n % 2 == 1  # the frame surely arrives during the stop
            if stop_first:
                sigstop(pid)
            slot, _ = core.acquire(5.0)
            slots.write(slot, core.next_seq)
            core.publish(slot)
            if not stop_first:
                sigstop(pid)
            try:
                unread = _unread_bytes(fd) > 0
                assert unread or not stop_first, "a frame sent during the stop was read"
                deadline = time.monotonic() + 5
                while core.evictions == n:
                    assert time.monotonic() < deadline, "the stopped subscriber was not evicted"
                    core.poll(0.05)
                assert core.subscribers == []
                _rewrite_every_slot(core, slots)
            finally:
                os.kill(pid, signal.SIGCONT)
            _check_calls(child.expect("calls"), unread)
        child.expect("done")
        assert core.evictions == rounds


def _child_not_reading(conn: Connection, address: str, spin_us: float) -> None:
    """Take one frame, hold it and stop calling recv; when told, call recv again."""
    try:
        with MemfdConsumer(address, timeout=10, spin_us=spin_us) as consumer:
            conn.send(("joined", consumer.core.sub_id))
            first = consumer.recv(timeout=10)
            conn.send(("holding", first.seq))
            assert conn.recv() == "go"
            calls = [_call_result(consumer)]
            if calls[0][0] == "frame":
                calls.append(_call_result(consumer))
            conn.send(("calls", calls))
            with contextlib.suppress(IpcPoolError):
                consumer.core.release(first.seq, first.slot)
            conn.send(("evicted", consumer.core.evicted))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spin_us", [0, 200], ids=["sleeping", "spinning"])
@pytest.mark.parametrize("payload", [0, proto.MAX_FRAME_PAYLOAD], ids=["small", "full-socket"])
def test_subscriber_that_stops_reading_never_gets_a_revoked_frame(
    tmp_path: Any, children: Callable[..., Child], spin_us: float, payload: int
) -> None:
    """A subscriber holds a frame and stops calling recv while more frames queue up
    (with 64 KiB payloads, until its socket is full); it is evicted, every slot is
    reused; its next recv raises EvictedError and hands out none of the queued frames."""
    address = str(tmp_path / "chan.sock")
    data = b"p" * payload
    with _memfd_channel(address, 16, lease_timeout=0.3, send_timeout=0.2) as (core, slots):
        child = children(_child_not_reading, address, spin_us)
        child.expect("joined")
        _until_subscribed(core)
        slot, _ = core.acquire(5.0)
        slots.write(slot, core.next_seq)
        core.publish(slot, data)
        child.expect("holding")
        queued = 0
        deadline = time.monotonic() + 10
        while core.subscribers:  # frames queue up until the subscriber is evicted
            assert time.monotonic() < deadline, "the subscriber that stopped reading stayed"
            slot, _ = core.acquire(5.0)
            slots.write(slot, core.next_seq)
            core.publish(slot, data)
            queued += 1
            core.poll(0.02)
        assert queued >= 2 and core.evictions == 1
        reason = core.last_leave_reason
        assert "lease_timeout" in reason or "stayed full" in reason
        _rewrite_every_slot(core, slots)
        child.conn.send("go")
        calls = child.expect("calls")
        assert calls[0] == ("raised", "EvictedError"), calls
        assert calls == [("raised", "EvictedError")]
        assert child.expect("evicted") is True


@pytest.mark.timeout(60)
def test_evictions_counts_each_evicted_subscriber(tmp_path: Any) -> None:
    """``evictions`` counts subscribers evicted (lease timeout, full socket), not others."""
    address = str(tmp_path / "chan.sock")
    with _memfd_channel(address, 8, lease_timeout=0.2) as (core, _slots):
        assert core.evictions == 0
        with pytest.raises(AttributeError):
            core.evictions = 5  # type: ignore[misc]
        subs = [SubscriberCore(address, timeout=5) for _ in range(3)]
        try:
            while len(core.subscribers) < 3:
                core.poll(0.01)
            subs[2].close()  # leaves by itself: not an eviction
            slot, _ = core.acquire(1.0)
            core.publish(slot)
            frame = subs[1].recv(timeout=5)
            subs[1].release(frame.seq, frame.slot)
            time.sleep(0.3)
            core.poll(0.0)
            assert core.evictions == 1  # subs[0] held its frame too long; subs[1] released
            assert len(core.subscribers) == 1
            with pytest.raises(EvictedError):
                subs[0].recv(timeout=1)
        finally:
            for sub in subs:
                sub.close()
        assert core.evictions == 1


# -- 4b: the subscriber's compiled release (read-flag write + RELEASE in one call) ----------


def _one_frame(core: PublisherCore, sub: SubscriberCore) -> tuple[int, int]:
    slot, _ = core.acquire(1.0)
    core.publish(slot, b"meta")
    seq, got_slot, payload = sub.recv_view(timeout=5)
    assert (got_slot, bytes(payload)) == (slot, b"meta")
    return seq, slot


def _write_args(rec: MemopRecorder) -> tuple[int, int, int, int, int]:
    return rec.address, 0x5000, 0x7000_0040, 17, 0  # fn, stream, flag address, value, flags


@pytest.mark.timeout(60)
def test_release_with_write_writes_once_and_returns_the_lease(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    rec = MemopRecorder()
    with _memfd_channel(address, 4) as (core, _slots), SubscriberCore(address, timeout=5) as sub:
        _until_subscribed(core)
        seq, slot = _one_frame(core, sub)
        assert sub.held == {seq: slot} and core.lease_book.lease_count(slot) == 1
        with pytest.raises(ProtocolError):  # not the frame held: nothing written or sent
            sub.release_with_write(seq, slot + 1, *_write_args(rec))
        assert rec.calls == []
        assert sub.release_with_write(seq, slot, *_write_args(rec)) == 0
        assert rec.calls == [(0x5000, 0x7000_0040, 17, 0)]
        assert sub.held == {}
        _wait_released(core, slot)
        with pytest.raises(ProtocolError):  # released twice
            sub.release_with_write(seq, slot, *_write_args(rec))
        assert len(rec.calls) == 1


@pytest.mark.timeout(60)
def test_release_with_write_keeps_the_frame_when_the_driver_fails(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    failing = MemopRecorder(result=700)
    with _memfd_channel(address, 4) as (core, _slots), SubscriberCore(address, timeout=5) as sub:
        _until_subscribed(core)
        seq, slot = _one_frame(core, sub)
        assert sub.release_with_write(seq, slot, *_write_args(failing)) == 700
        assert sub.held == {seq: slot}  # nothing was sent: still held, may be released again
        core.poll(0.2)
        assert core.lease_book.lease_count(slot) == 1
        rec = MemopRecorder()
        assert sub.release_with_write(seq, slot, *_write_args(rec)) == 0
        _wait_released(core, slot)


@pytest.mark.timeout(60)
def test_release_with_write_never_writes_after_an_eviction(tmp_path: Any) -> None:
    """An evicted subscriber's sync-page row may belong to a newer subscriber: no write."""
    address = str(tmp_path / "chan.sock")
    rec = MemopRecorder()
    with (
        _memfd_channel(address, 8, lease_timeout=0.2) as (core, _slots),
        SubscriberCore(address, timeout=5) as sub,
    ):
        _until_subscribed(core)
        seq, slot = _one_frame(core, sub)
        _evict_overdue(core)
        with pytest.raises(EvictedError):
            sub.release_with_write(seq, slot, *_write_args(rec))
        assert rec.calls == []
        assert sub.held == {}


@pytest.mark.timeout(60)
def test_release_with_write_after_the_publisher_left_forgets_the_frame(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    rec = MemopRecorder()
    with _memfd_channel(address, 4) as (core, _slots), SubscriberCore(address, timeout=5) as sub:
        _until_subscribed(core)
        seq, slot = _one_frame(core, sub)
        core.close()
        _until_hung_up(sub)
        assert sub.release_with_write(seq, slot, *_write_args(rec)) == 0
        assert rec.calls == []
        assert sub.held == {}


@pytest.mark.timeout(60)
def test_release_with_write_skips_the_write_when_a_watched_fd_fired(tmp_path: Any) -> None:
    """The producer's pidfd readable (it exited): its sync page is not written any more."""
    address = str(tmp_path / "chan.sock")
    rec = MemopRecorder()
    r, w = os.pipe()
    try:
        with (
            _memfd_channel(address, 4) as (core, _slots),
            SubscriberCore(address, timeout=5) as sub,
        ):
            _until_subscribed(core)
            sub.watch(r)
            seq, slot = _one_frame(core, sub)
            os.write(w, b"!")
            assert sub.release_with_write(seq, slot, *_write_args(rec)) == 0
            assert rec.calls == [] and sub.alarm
            _wait_released(core, slot)  # the RELEASE still went: the publisher is there
    finally:
        os.close(r)
        os.close(w)


def _wait_released(core: PublisherCore, slot: int) -> None:
    deadline = time.monotonic() + 5
    while core.lease_book.lease_count(slot):
        assert time.monotonic() < deadline, "the RELEASE never arrived"
        core.poll(0.05)


# -- 5: the fd client checks who serves the socket ----------------------------------------


def _child_squat(conn: Connection, path: str) -> None:
    """As uid 65534: serve memfds of its own at ``path``; report what a client sent."""
    try:
        _drop_to(NOBODY)
        fd = os.memfd_create("squatter")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o666)
        listener.listen(8)
        conn.send(("ready", 0))
        got = b""
        listener.settimeout(10)
        for _ in range(3):
            c, _ = listener.accept()
            c.settimeout(0.5)
            with contextlib.suppress(OSError):
                socket.send_fds(c, [bytes([0]) + (1).to_bytes(4, "big")], [])
                socket.send_fds(c, [b"F"], [fd])
                got += c.recv(4096)
            c.close()
        conn.send(("got", got))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))


@needs_root
@pytest.mark.timeout(60)
def test_fd_client_refuses_a_squatter(
    public_dir: str, children: Callable[..., Child], fd_count: Callable[[], int]
) -> None:
    path = os.path.join(public_dir, "fds.sock")
    squatter = children(_child_squat, path)
    squatter.expect("ready")
    before = fd_count()
    with pytest.raises(PeerRefusedError, match="nothing was sent"):
        fetch_fds_over_socket(path, b"secret-pool-id", 1, timeout=2, server_uid=0)
    with pytest.raises(PeerRefusedError, match="nothing was sent"):
        fetch_fds_over_socket(path, b"secret-pool-id", 1, timeout=2)  # not our uid, not root
    from cupy_ipcpool._transport import process_start_time

    with pytest.raises(PeerRefusedError, match="not the exporter"):
        fetch_fds(
            pid=os.getpid(),
            start_time=process_start_time(os.getpid()),
            fds=[0],
            socket_path=path,
            token=b"secret-pool-id",
            method="socket",
        )
    assert fd_count() == before  # no fd of the squatter accepted
    assert squatter.expect("got") == b""  # and it never saw the token


# -- 6, 7: umask, close-on-exec, error types ----------------------------------------------


@pytest.mark.timeout(60)
def test_binding_never_changes_the_umask(tmp_path: Any) -> None:
    original = _umask()
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.add(_umask())

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    slots = MemfdSlots(1)
    try:
        for i in range(20):
            with FdServer(slots.fds, token=b"k", path=str(tmp_path / f"f{i}.sock")) as server:
                assert os.stat(server.path).st_mode & 0o777 == 0o600
            core = PublisherCore(str(tmp_path / f"p{i}.sock"), 1, welcome=slots.welcome())
            assert os.stat(core.address).st_mode & 0o777 == 0o600
            core.close()
        # a path too long for the private directory next to it: fchmod before bind
        deep = tmp_path / ("d" * (100 - len(str(tmp_path))))
        deep.mkdir()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bind_unix(s, str(deep / "s"), 0o600, backlog=1)
        assert os.stat(deep / "s").st_mode & 0o777 == 0o600
        s.close()
    finally:
        stop.set()
        t.join(5)
        slots.close()
    assert seen == {original}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ipcp")]  # temp dirs removed


@pytest.mark.timeout(60)
def test_every_received_fd_is_close_on_exec(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    with _memfd_channel(address, 3) as (_core, slots):
        with SubscriberCore(address, timeout=5) as sub:
            fds = sub.take_fds()
            assert len(fds) == 3
            for fd in fds:
                assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
                os.close(fd)
        with FdServer(slots.fds, token=b"k") as server:
            for fd in fetch_fds_over_socket(server.path, b"k", 3):
                assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
                os.close(fd)


def _child_fake_publisher(conn: Connection, address: str, behaviour: str) -> None:
    """A 'publisher' that accepts and then misbehaves: dies with the HELLO unread, or is silent."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(4)
    conn.send(("ready", 0))
    c, _ = listener.accept()
    if behaviour == "die":
        deadline = time.monotonic() + 5
        while not select_readable(c) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)  # the HELLO unread: the subscriber is reset
    conn.recv()
    c.close()


def select_readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


@pytest.mark.timeout(60)
def test_handshake_failures_are_documented_errors(
    tmp_path: Any, children: Callable[..., Child]
) -> None:
    dying = str(tmp_path / "dying.sock")
    child = children(_child_fake_publisher, dying, "die")
    child.expect("ready")
    with pytest.raises(EndOfStream) as info:
        SubscriberCore(dying, timeout=10)
    assert not info.value.clean  # not a raw ConnectionResetError

    silent = str(tmp_path / "silent.sock")
    child = children(_child_fake_publisher, silent, "silent")
    child.expect("ready")
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeoutError):
        SubscriberCore(silent, timeout=0.5)
    assert time.monotonic() - t0 < 3.0

    with pytest.raises(TransportError):
        SubscriberCore(str(tmp_path / "nobody-here.sock"), timeout=1)


@pytest.mark.timeout(60)
def test_session_errors_are_library_errors(tmp_path: Any) -> None:
    address = str(tmp_path / "chan.sock")
    with (
        _memfd_channel(address, 2) as (core, _slots),
        SubscriberCore(address, timeout=5) as sub,
    ):
        _until_subscribed(core)
        with pytest.raises(ChannelTimeoutError):
            sub.recv(timeout=0.05)
        slot, _ = core.acquire(1)
        core.publish(slot)
        with pytest.raises(LeaseStateError):
            core.publish(slot)  # still leased
        with pytest.raises(LeaseStateError):
            core.unhold(slot)
        assert issubclass(LeaseStateError, RuntimeError)


@pytest.mark.timeout(60)
def test_refused_uid_costs_nothing(tmp_path: Any) -> None:
    """A refused peer is told at once, whatever it sends or does not send."""
    address = str(tmp_path / "chan.sock")
    with _memfd_channel(address, 1, allowed_uids={os.geteuid() + 1}) as (core, _slots):
        socks = _idle_connections(address, 20)
        for s in socks:
            s.setblocking(True)
            s.settimeout(5)
            reply = proto.decode(s.recv(4096))
            assert isinstance(reply, proto.Refuse) and "not allowed" in reply.reason
            s.close()
        assert core._acc.pending_handshakes() == 0
        with pytest.raises(PeerRefusedError, match="not allowed"):
            SubscriberCore(address, timeout=5)
