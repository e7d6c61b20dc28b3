"""Publisher/subscriber sessions for real: spawned processes, Unix sockets, memfd slots."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer, MemfdProducer, MemfdSlots
from _pipe_child import PipeChild, run_body, started
from _restart_children import (
    child_hold_until_killed,
    child_outlive_publishers,
    child_publish_until_killed,
)

from cupy_ipcpool._errors import (
    EndOfStream,
    PeerRefusedError,
    PoolClosedError,
    ProtocolError,
    SlotBusyError,
    TransportError,
    UsageError,
)
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._handshake import SubscriberInfo, Welcome
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._settle import reader_rows
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from cupy_ipcpool.channel._syncpage import FlagLayout, SharedFlags
from tests._fds import fd_count, fds_opened_since, open_fds
from tests.skips import drops_to_uid

# -- child side -------------------------------------------------------------------


def child_consume(conn: Connection, address: str, kwargs: dict[str, Any], opts: dict[str, Any]):
    """Receive and verify frames until EndOfStream; report what was seen.

    opts: sleep_every (sleep 2 ms every N frames), hold_each (seconds to hold
    each frame), never_release, report_after (send a message after N frames),
    fd_check_after (count fds after N frames and at the end).
    """

    def body() -> dict[str, Any]:
        seqs: list[int] = []
        fds_mid = None
        with MemfdConsumer(address, **kwargs) as consumer:
            conn.send(("msg", consumer.core.sub_id))
            while True:
                try:
                    frame = consumer.recv(timeout=30.0)
                except EndOfStream:
                    break
                seqs.append(frame.seq)
                if opts.get("hold_each"):
                    time.sleep(opts["hold_each"])
                if opts.get("sleep_every") and len(seqs) % opts["sleep_every"] == 0:
                    time.sleep(0.002)
                if len(seqs) == opts.get("report_after"):
                    conn.send(("msg", len(seqs)))
                if len(seqs) == opts.get("fd_check_after"):
                    fds_mid = fd_count()
                if not opts.get("never_release"):
                    consumer.release(frame)
            held = consumer.core.held
            for seq, slot in held.items():  # still readable after the end
                consumer.check(proto.Frame(seq, slot))
            fds_end = fd_count()
        return {
            "seqs": seqs,
            "consecutive": all(b == a + 1 for a, b in itertools.pairwise(seqs)),
            "increasing": all(b > a for a, b in itertools.pairwise(seqs)),
            "fds": (fds_mid, fds_end),
        }

    run_body(conn, body)


def child_produce(conn: Connection, address: str, frames: int) -> None:
    """Publish ``frames`` frames to the first subscriber, then obey 'close' (or get killed)."""

    def body() -> str:
        with MemfdProducer(address, 4) as producer:
            conn.send(("msg", "ready"))
            producer.wait_subscribers(1)
            for _ in range(frames):
                producer.publish_next(timeout=10.0)
            conn.send(("msg", "published"))
            command = conn.recv()
            assert command == "close"
        return "closed"

    run_body(conn, body)


def child_subscribe_as(conn: Connection, address: str, uid: int, producer_uid: int) -> None:
    """Drop to ``uid`` (imports are done already) and try to subscribe."""

    def body() -> str:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        with SubscriberCore(address, timeout=5.0, allowed_uids={producer_uid}) as sub:
            return f"subscribed as {sub.sub_id}"

    run_body(conn, body)


# -- parent side ------------------------------------------------------------------


class Child(PipeChild):
    """A spawned child process (its target answers through :func:`run_body`) and the pipe to it."""

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def expect(self, timeout: float = 30.0) -> Any:
        msg = self.recv(timeout, f"child {self.pid} sent nothing within {timeout} s")
        if msg[0] == "err":
            raise AssertionError(f"child {self.pid} failed: {msg[1]}: {msg[2]}")
        return msg[1]

    def expect_error(self, timeout: float = 30.0) -> tuple[str, str]:
        msg = self.recv(timeout, f"child {self.pid} sent nothing within {timeout} s")
        assert msg[0] == "err", f"child {self.pid} succeeded: {msg}"
        return msg[1], msg[2]

    def send(self, obj: Any) -> None:
        self.conn.send(obj)

    def finish(self) -> None:
        super().finish()
        self.proc.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    with started(Child) as start:
        yield start


@pytest.fixture
def address(tmp_path: Any) -> str:
    return str(tmp_path / "chan.sock")


def _wait_all_released(core: PublisherCore, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(core.lease_book.free_slots()) < core.num_slots:
        assert time.monotonic() < deadline, "leases did not come back"
        core.poll(0.05)


# -- multi-process scenarios ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_block_mode_in_order_no_overwrite(address: str, spawn: Callable[..., Child]) -> None:
    with MemfdProducer(address, 4) as producer:
        child = spawn(child_consume, address, {}, {"sleep_every": 97})
        child.expect()
        producer.wait_subscribers(1)
        for _ in range(2000):
            producer.publish_next(timeout=10.0)
        _wait_all_released(producer.core)
    result = child.expect()
    assert result["seqs"] == list(range(2000))


@pytest.mark.timeout(60)
def test_backpressure_when_consumer_never_releases(
    address: str, spawn: Callable[..., Child]
) -> None:
    with MemfdProducer(address, 4) as producer:
        child = spawn(child_consume, address, {}, {"never_release": True})
        child.expect()
        producer.wait_subscribers(1)
        for _ in range(4):
            producer.publish_next(timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(SlotBusyError, match=f"pid {child.pid}") as info:
            producer.publish_next(timeout=0.5)
        assert 0.45 < time.monotonic() - t0 < 2.0
        assert "slots [0, 1, 2, 3]" in str(info.value)
    assert child.expect()["seqs"] == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_latest_skips_and_never_blocks_producer(address: str, spawn: Callable[..., Child]) -> None:
    with MemfdProducer(address, 4) as producer:
        child = spawn(child_consume, address, {"mode": "latest", "credit": 2}, {"hold_each": 0.005})
        sub_id = child.expect()
        producer.wait_subscribers(1)
        book = producer.core.lease_book
        published = 300
        for _ in range(published):
            producer.publish_next(timeout=0.0)  # never waits
            assert book.outstanding(sub_id) <= 2
            producer.core.poll(0.001)
        _wait_all_released(producer.core)
    result = child.expect()
    assert 2 <= len(result["seqs"]) < published
    assert result["increasing"]


@pytest.mark.timeout(60)
def test_fan_out_and_late_subscriber(address: str, spawn: Callable[..., Child]) -> None:
    joined: list[SubscriberInfo] = []
    with MemfdProducer(address, 6, on_join=joined.append) as producer:
        children = [spawn(child_consume, address, {}, {}) for _ in range(4)]
        for child in children:
            child.expect()
        producer.wait_subscribers(4)
        for _ in range(300):
            producer.publish_next(timeout=10.0)
        late = spawn(child_consume, address, {}, {})
        late.expect()
        producer.wait_subscribers(5)
        for _ in range(100):
            producer.publish_next(timeout=10.0)
        _wait_all_released(producer.core)
    for child in children:
        assert child.expect()["seqs"] == list(range(400))
    assert late.expect()["seqs"] == list(range(300, 400))
    assert sorted(info.pid for info in joined) == sorted(c.pid for c in [*children, late])


@pytest.mark.timeout(60)
def test_killed_consumer_returns_its_leases(address: str, spawn: Callable[..., Child]) -> None:
    left: list[SubscriberInfo] = []
    with MemfdProducer(address, 4, on_leave=left.append) as producer:
        hog = spawn(child_consume, address, {}, {"never_release": True, "report_after": 4})
        good = spawn(child_consume, address, {}, {})
        hog.expect()
        good.expect()
        producer.wait_subscribers(2)
        for _ in range(4):
            producer.publish_next(timeout=5.0)
        assert hog.expect() == 4  # it now holds every slot
        with pytest.raises(SlotBusyError):
            producer.core.acquire(timeout=0.0)
        os.kill(hog.pid, signal.SIGKILL)
        t0 = time.monotonic()
        producer.core.acquire(timeout=1.0)
        assert time.monotonic() - t0 < 1.0
        assert [info.pid for info in left] == [hog.pid]
        for _ in range(50):
            producer.publish_next(timeout=5.0)
        _wait_all_released(producer.core)
    assert good.expect()["seqs"] == list(range(54))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["kill", "close"])
def test_producer_end_gives_end_of_stream(
    how: str, address: str, spawn: Callable[..., Child]
) -> None:
    child = spawn(child_produce, address, 3)
    assert child.expect() == "ready"
    with MemfdConsumer(address) as consumer:
        frames = [consumer.recv(timeout=10.0) for _ in range(3)]
        assert [f.seq for f in frames] == [0, 1, 2]
        assert child.expect() == "published"
        if how == "kill":
            os.kill(child.pid, signal.SIGKILL)
        else:
            child.send("close")
            assert child.expect() == "closed"
        with pytest.raises(EndOfStream):
            consumer.recv(timeout=10.0)
        with pytest.raises(EndOfStream):
            consumer.recv(timeout=10.0)
        for frame in frames:  # the memfd mappings outlive the producer
            consumer.check(frame)
            consumer.release(frame)
    child.proc.join(10)
    if how == "kill":
        assert os.path.exists(address)  # stale socket file: a new publisher replaces it
    with MemfdProducer(address, 2):
        pass
    assert not os.path.exists(address)


@pytest.mark.timeout(60)
def test_bad_peers_are_dropped_others_unaffected(address: str, spawn: Callable[..., Child]) -> None:
    with MemfdProducer(address, 4) as producer:
        good = spawn(child_consume, address, {}, {})
        good.expect()
        producer.wait_subscribers(1)
        producer.publish_next()

        # A raw client that sends garbage instead of HELLO is refused and closed.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
            raw.settimeout(10)
            raw.connect(address)
            raw.send(b"garbage!")
            reply = proto.decode(raw.recv(4096))
            assert isinstance(reply, proto.Refuse)
            assert "bad HELLO" in reply.reason
            assert raw.recv(4096) == b""

        # A welcomed subscriber that releases a frame it never got is dropped.
        with SubscriberCore(address) as rogue:
            producer.wait_subscribers(2)
            rogue._sock.send(proto.encode_release(12345, 0))
            deadline = time.monotonic() + 10
            while len(producer.core.subscribers) > 1:
                assert time.monotonic() < deadline
                producer.core.poll(0.05)
            assert "does not hold" in producer.core.last_leave_reason
            with pytest.raises(EndOfStream):
                rogue.recv(timeout=10)

        # One that sends junk after the welcome is dropped too.
        with SubscriberCore(address) as rogue:
            producer.wait_subscribers(2)
            rogue._sock.send(b"\x00" * 16)
            while len(producer.core.subscribers) > 1:
                producer.core.poll(0.05)
            assert "protocol error" in producer.core.last_leave_reason

        for _ in range(100):
            producer.publish_next()
        _wait_all_released(producer.core)
    assert good.expect()["seqs"] == list(range(101))


def test_socket_mode(address: str) -> None:
    with MemfdProducer(address, 1):
        assert stat.S_IMODE(os.stat(address).st_mode) == 0o600
    with MemfdProducer(address, 1, allowed_uids={os.geteuid(), 12345}):
        assert stat.S_IMODE(os.stat(address).st_mode) == 0o666
    assert not os.path.exists(address)


@pytest.fixture
def public_dir() -> Iterator[str]:
    """A directory other uids can traverse (pytest's tmp_path is private to root)."""
    path = tempfile.mkdtemp(prefix="ipcpool-test-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(60)
@drops_to_uid(65534)
def test_other_uid_is_refused(public_dir: str, spawn: Callable[..., Child]) -> None:
    address = os.path.join(public_dir, "chan.sock")
    with MemfdProducer(address, 2):
        child = spawn(child_subscribe_as, address, 65534, os.geteuid())
        kind, message = child.expect_error()
        assert kind == "TransportError"
        assert "EACCES" in message  # the 0600 file stops it at connect
    with MemfdProducer(address, 2, allowed_uids={os.geteuid(), 12345}) as producer:
        child = spawn(child_subscribe_as, address, 65534, os.geteuid())
        kind, message = child.expect_error()
        assert kind == "PeerRefusedError"
        assert "uid 65534 is not allowed" in message
        producer.core.poll(0.0)
        assert producer.core.subscribers == []


@pytest.mark.timeout(60)
def test_no_fd_growth(address: str, spawn: Callable[..., Child]) -> None:
    with MemfdProducer(address, 4) as producer:
        child = spawn(child_consume, address, {}, {"fd_check_after": 100})
        child.expect()
        producer.wait_subscribers(1)
        for _ in range(100):
            producer.publish_next()
        _wait_all_released(producer.core)
        before = open_fds()
        for _ in range(4900):
            producer.publish_next()
        _wait_all_released(producer.core)
        assert not fds_opened_since(before)
    result = child.expect()
    mid, end = result["fds"]
    assert len(result["seqs"]) == 5000
    assert end == mid


@pytest.mark.timeout(300)
def test_subscriber_process_outlives_many_publisher_deaths(
    address: str, spawn: Callable[..., Child]
) -> None:
    """12 publishers, each SIGKILLed while one long-lived subscriber process holds frames of it:
    the subscriber ends each session cleanly and its fds and mappings stay flat; each new
    publisher binds the same path (over the dead one's socket file) with the same fds.
    (30 deaths with generations wrapping: tests/test_restart_cpu.py.)"""
    cycles, hold = 12, 4
    sub = spawn(child_outlive_publishers, address, cycles, hold)
    sub_counts: list[tuple[int, int]] = []
    pub_fds: list[int] = []
    for _ in range(cycles):
        pub = Child(child_publish_until_killed, address, hold + 2)
        try:
            if not pub.conn.poll(30.0) and sub.conn.poll(0):  # the subscriber failed: say why
                sub.expect(0)
            pub_fds.append(pub.expect())
            assert sub.expect() == "holding"
            os.kill(pub.pid, signal.SIGKILL)
            pub.proc.join(10)
        finally:
            pub.finish()
        sub_counts.append(sub.expect())
    sub.proc.join(10)
    assert sub.proc.exitcode == 0
    assert {mappings for _fds, mappings in sub_counts} == {0}
    assert len({fds for fds, _mappings in sub_counts}) == 1, sub_counts
    assert len(set(pub_fds)) == 1, pub_fds


@pytest.mark.timeout(300)
def test_publisher_outlives_many_subscriber_deaths(address: str) -> None:
    """15 subscriber processes, each SIGKILLed holding frames with more queued for it: every
    lease and every fd of the publisher comes back each time."""
    left: list[SubscriberInfo] = []
    deaths = 15
    with MemfdProducer(address, 8, on_leave=left.append) as producer:
        before = None
        for n in range(deaths):
            child = Child(child_hold_until_killed, address)
            try:
                child.expect()
                producer.wait_subscribers(1)
                for _ in range(4):
                    producer.publish_next(timeout=5.0)
                assert child.expect() == "holding"
                os.kill(child.pid, signal.SIGKILL)
                child.proc.join(10)
            finally:
                child.finish()
            deadline = time.monotonic() + 10
            while producer.core.subscribers or len(left) <= n:
                assert time.monotonic() < deadline, "the killed subscriber was not dropped"
                producer.core.poll(0.05)
            _wait_all_released(producer.core)
            if before is None:
                before = open_fds()
            assert not fds_opened_since(before), n
        assert len(left) == deaths and producer.core.evictions == 0


# -- in-process behaviour -----------------------------------------------------------


def test_refuses_to_bind_over_live_or_foreign_file(address: str) -> None:
    with MemfdProducer(address, 1):
        with pytest.raises(TransportError, match="already listening") as info:
            MemfdProducer(address, 1)
        assert info.value.errno == errno.EADDRINUSE
    with open(address, "w") as f:
        f.write("not a socket")
    with pytest.raises(TransportError, match="not a socket"):
        MemfdProducer(address, 1)
    os.unlink(address)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(address)  # closed without unlinking: a stale file
    with MemfdProducer(address, 1):
        pass


def test_subscriber_errors(address: str) -> None:
    with pytest.raises(TransportError, match="is the publisher running"):
        SubscriberCore(address)
    with MemfdProducer(address, 2) as producer:
        with pytest.raises(PeerRefusedError, match="runs as uid"):
            SubscriberCore(address, allowed_uids={12345})
        with pytest.raises(ValueError):
            SubscriberCore(address, mode="often")
        sub = SubscriberCore(address, mode="latest")
        assert sub.credit == 1
        fds = sub.take_fds()
        assert len(fds) == 2
        assert sub.take_fds() == []
        for fd in fds:
            os.close(fd)
        producer.wait_subscribers(1)
        with pytest.raises(TimeoutError):
            sub.recv(timeout=0.05)
        producer.publish_next()
        frame = sub.recv(timeout=5)
        with pytest.raises(ProtocolError):
            sub.release(frame.seq, frame.slot + 1)
        sub.release(frame.seq, frame.slot)
        with pytest.raises(ProtocolError):
            sub.release(frame.seq, frame.slot)
        sub.close()
        sub.close()
        with pytest.raises(PoolClosedError):
            sub.recv()
    assert producer.core.closed
    with pytest.raises(PoolClosedError):
        producer.core.acquire(0)


def test_welcome_payload_rows_and_refusals(address: str) -> None:
    """Each subscriber's WELCOME is the publisher's payload with its own row written in; a
    mode the publisher does not serve, a full set of rows and a full publisher are refused,
    each saying why; a row comes back when its subscriber leaves."""
    layout = FlagLayout(2, 2)
    flags = SharedFlags.create(layout.nbytes)
    rows = reader_rows(flags, layout)
    welcome = Welcome(
        b"payload:" + bytes(4) + b"!", rows=rows, row_at=8, refuse={"latest": "no thanks"}
    )

    def leave(info: SubscriberInfo) -> None:
        rows.leave(info.sub_id, [0, 0], True)

    try:
        with PublisherCore(address, 2, welcome=welcome, on_leave=leave) as pub:
            with pytest.raises(PeerRefusedError, match="no thanks"):
                SubscriberCore(address, mode="latest")
            with SubscriberCore(address) as one, SubscriberCore(address, mode="ahead") as two:
                assert one.welcome_payload == b"payload:\0\0\0\0!"
                assert two.welcome_payload == b"payload:\1\0\0\0!"
                assert one.take_fds() == []
                with pytest.raises(PeerRefusedError, match="no free subscriber row"):
                    SubscriberCore(address)
                assert rows.live == 2
            deadline = time.monotonic() + 10
            while pub.subscribers or rows.live:
                assert time.monotonic() < deadline, (pub.subscribers, rows.live)
                pub.poll(0.05)
            with SubscriberCore(address) as three:  # round-robin: row 0 again
                assert three.welcome_payload == b"payload:\0\0\0\0!"
                assert three.sub_id == 3  # a refused subscriber takes no id
    finally:
        rows.release_page()
        flags.close()
    with PublisherCore(address, 2, welcome=Welcome(b"p"), max_subscribers=1) as pub:
        with SubscriberCore(address) as sub:
            assert sub.welcome_payload == b"p"
            with pytest.raises(PeerRefusedError, match="max_subscribers=1"):
                SubscriberCore(address)
        pub.poll(0.2)
        pub.poll(0.2)
        assert pub.subscribers == []


def test_a_closed_publisher_holds_no_fd_while_it_lives(address: str) -> None:
    """``close()`` lets go of every fd at once (the listener, the accept thread's wake-up, its
    copies of the WELCOME's fds, the subscribers' sockets), not when the object is collected:
    a reference kept (or a cycle the collector frees later) holds nothing."""
    slots = MemfdSlots(4)
    try:
        before = fd_count()
        core = PublisherCore(address, 4, welcome=slots.welcome())
        adopted = SubscriberCore(address)
        deadline = time.monotonic() + 10
        while not core.subscribers:
            assert time.monotonic() < deadline, "the subscriber was not adopted"
            core.poll(0.01)
        waiting = SubscriberCore(address)  # welcomed; close() finds it not adopted
        core.close()
        for sub in (adopted, waiting):
            for fd in sub.take_fds():
                os.close(fd)
            sub.close()
        assert fd_count() == before, "the closed publisher still holds fds"
        assert core.closed  # (still referenced here)
    finally:
        slots.close()


def test_welcome_refuses_what_it_cannot_send(address: str) -> None:
    """A ``Welcome`` whose row would not fit its payload, with too many fds, an fd that is
    not open, or refusing a mode that does not exist, is refused when the publisher is made,
    with nothing bound and no fd kept (the copies made before the bad one are closed)."""
    layout = FlagLayout(1, 1)
    flags = SharedFlags.create(layout.nbytes)
    rows = reader_rows(flags, layout)
    closed = 1 << 20  # above any fd number this process is allowed
    try:
        bad = [
            (Welcome(b"abcd", rows=rows, row_at=2), "row_at=2"),
            (Welcome(b"", (0,) * 300), "300 fds do not fit"),
            (Welcome(b"", (0, 1, closed)), f"fd {closed} cannot be duplicated"),
            (Welcome(b"", refuse={"lastest": "typo"}), "refuse names no mode"),
        ]
        for welcome, match in bad:
            before = fd_count()
            with pytest.raises(UsageError, match=match):
                PublisherCore(address, 2, welcome=welcome)
            assert not os.path.exists(address)
            assert fd_count() == before
    finally:
        rows.release_page()
        flags.close()


def test_untaken_fds_are_closed(address: str, fd_count: Callable[[], int]) -> None:
    with MemfdProducer(address, 3) as producer:
        before = fd_count()
        sub = SubscriberCore(address)
        producer.wait_subscribers(1)
        assert fd_count() == before + 5  # both ends of the connection + 3 slot fds
        sub.close()
        while producer.core.subscribers:
            producer.core.poll(0.05)
        assert fd_count() == before


def test_block_subscriber_with_full_socket_is_dropped(address: str) -> None:
    payload = b"p" * proto.MAX_FRAME_PAYLOAD
    with MemfdProducer(address, 64, send_timeout=0.2) as producer, SubscriberCore(address):
        producer.wait_subscribers(1)
        with contextlib.suppress(SlotBusyError):
            for _ in range(64):
                producer.publish_next(timeout=0.0, payload=payload)
                if not producer.core.subscribers:
                    break
        assert producer.core.subscribers == []
        assert "stayed full" in producer.core.last_leave_reason


def test_acquire_reports_readers_to_wait(address: str) -> None:
    with MemfdProducer(address, 2) as producer, SubscriberCore(address) as sub:
        producer.wait_subscribers(1)
        assert producer.core.acquire(0) == (0, [])
        producer.publish_next()
        producer.publish_next()
        for _ in range(2):
            frame = sub.recv(timeout=5)
            sub.release(frame.seq, frame.slot)
        assert producer.core.acquire(timeout=5) == (0, [sub.sub_id])
        producer.core.hold(0)
        assert producer.core.acquire(timeout=5) == (1, [sub.sub_id])
        producer.core.unhold(0)


def test_large_welcome_payload(address: str) -> None:
    big = bytes(range(256)) * (proto.MAX_WELCOME_PAYLOAD // 256)

    with PublisherCore(address, 1, welcome=Welcome(big)):
        try:
            sub = SubscriberCore(address)
        except PeerRefusedError as exc:  # a small net.core.wmem_max: refused, and says why
            assert "wmem_max" in str(exc)
        else:
            with sub:
                assert sub.welcome_payload == big
