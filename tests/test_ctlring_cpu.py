"""The control ring for real: spawned processes, a sealed memfd, eventfds, SCM_RIGHTS, SIGKILL."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import mmap
import multiprocessing as mp
import os
import random
import resource
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from cupy_ipcpool._errors import PoolClosedError, ProtocolError
from cupy_ipcpool.channel import _ctlring
from cupy_ipcpool.channel._ctlring import PublisherRing, SubscriberRing, layout

CTX = mp.get_context("spawn")
SLOTS = 8


# -- child side -------------------------------------------------------------------


def _attach_from(sock: socket.socket, **kw: Any) -> SubscriberRing:
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 3)
    return SubscriberRing.attach(fds, SLOTS, **kw)


def child_echo(sock: socket.socket, conn: Connection, count: int, kw: dict[str, Any]) -> None:
    """Receive ``count`` frames, check order and payload, release each; report the result."""
    try:
        ring = _attach_from(sock, **kw)
        conn.send("ready")
        bad = []
        for i in range(count):
            rec = ring.recv_frame(timeout=20, watch=[sock])
            if rec is None:
                bad.append((i, "none"))
                break
            seq, slot, gen, payload = rec
            if (seq, slot, gen, payload) != (i, i % SLOTS, i & 0xFFFFFFFF, _payload(i)):
                bad.append((i, rec))
            ring.send_release(seq, slot, gen, timeout=20)
        conn.send(("done", bad))
        conn.recv()  # hold the ring until the parent has checked
        ring.close()
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, str(exc)))


def child_consume_on_demand(sock: socket.socket, conn: Connection) -> None:
    """Consume one frame each time the parent asks."""
    try:
        ring = _attach_from(sock)
        conn.send("ready")
        while True:
            n = conn.recv()
            if n == 0:
                break
            got = [ring.recv_frame(timeout=10) for _ in range(n)]
            conn.send([g[0] if g else None for g in got])
        ring.close()
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, str(exc)))


def child_idle_waiter(
    sock: socket.socket, conn: Connection, seconds: float, spin_us: float
) -> None:
    """Wait for a frame that does not come; report the CPU time that took."""
    try:
        ring = _attach_from(sock, spin_us=spin_us)
        conn.send("ready")
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        rec = ring.recv_frame(timeout=seconds)
        wall = time.monotonic() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        conn.send(("done", rec, wall, cpu))
        ring.close()
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, str(exc)))


def child_hold(sock: socket.socket, conn: Connection) -> None:
    """Attach, say so, then block forever (to be SIGKILLed)."""
    ring = _attach_from(sock)
    conn.send(("pid", os.getpid()))
    ring.recv_frame(timeout=None)


def child_publisher(sock: socket.socket, conn: Connection) -> None:
    """Create a ring, send it, publish one frame, then block forever (to be SIGKILLed)."""
    ring = PublisherRing.create(SLOTS)
    socket.send_fds(sock, [b"ring"], ring.fds())
    ring.send_frame(0, 0, 0, b"hi")
    conn.send(("pid", os.getpid()))
    time.sleep(600)


def child_hostile(sock: socket.socket, conn: Connection, what: str) -> None:
    """Attach, then corrupt the ring as a hostile subscriber would."""
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 3)
    memfd = fds[0]
    size = os.fstat(memfd).st_size
    mm = mmap.mmap(memfd, size)
    if what == "release_head":
        struct.pack_into("<Q", mm, 192, 1 << 40)
    elif what == "frame_tail":
        struct.pack_into("<Q", mm, 128, 12345)
    elif what == "release_record":
        lay = layout(SLOTS, 8, 8, 256)
        off = lay["release_records"]
        struct.pack_into("<QQII", mm, off, 0, 0, SLOTS + 5, 0)  # slot out of range
        struct.pack_into("<Q", mm, 192, 1)
        os.eventfd_write(fds[1], 1)
    mm.close()
    conn.send("done")
    time.sleep(30)


# -- parent side ------------------------------------------------------------------


def _payload(i: int) -> bytes:
    return bytes([i & 0xFF]) * (i % 200)


class Child:
    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.conn, child_conn = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child_sock, child_conn, *args), daemon=True)
        self.proc.start()
        child_sock.close()
        child_conn.close()

    def send_ring(self, ring: PublisherRing) -> None:
        socket.send_fds(self.sock, [b"ring"], ring.fds())

    def expect(self, timeout: float = 30.0) -> Any:
        assert self.conn.poll(timeout), f"child sent nothing within {timeout} s"
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise AssertionError(f"child failed: {msg[1]}: {msg[2]}")
        return msg

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.sock.close()
        self.conn.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    children: list[Child] = []

    def make(target: Callable[..., None], *args: Any) -> Child:
        c = Child(target, *args)
        children.append(c)
        return c

    yield make
    for c in children:
        c.stop()


def _pair(**kw: Any) -> tuple[PublisherRing, SubscriberRing]:
    pub = PublisherRing.create(SLOTS, **kw)
    sub = SubscriberRing.attach([os.dup(fd) for fd in pub.fds()], SLOTS)
    return pub, sub


def _raw(pub: PublisherRing) -> mmap.mmap:
    """A second mapping of the ring: what a hostile peer can write to."""
    memfd = pub.fds()[0]
    return mmap.mmap(memfd, os.fstat(memfd).st_size)


# -- ordering and wrap-around -----------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [1, 8])
def test_order_payload_and_wraparound_across_processes(
    spawn: Callable[..., Child], capacity: int
) -> None:
    count = 3000
    with PublisherRing.create(SLOTS, capacity=capacity) as pub:
        child = spawn(child_echo, count, {})
        child.send_ring(pub)
        assert child.expect() == "ready"
        released = []
        for i in range(count):
            assert pub.send_frame(i, i % SLOTS, i, _payload(i), timeout=20, watch=[child.sock])
            while (rel := pub.try_recv_release()) is not None:
                released.append(rel)
        while len(released) < count:
            rel = pub.recv_release(timeout=20, watch=[child.sock])
            assert rel is not None, f"only {len(released)} releases came back"
            released.append(rel)
        assert released == [(i, i % SLOTS, i) for i in range(count)]
        assert child.expect() == ("done", [])
        child.conn.send("bye")


def test_ordering_through_the_eventfd_on_weakly_ordered_cpus(monkeypatch: Any) -> None:
    """The path for CPUs without total store order: the reader reads the eventfd first."""
    monkeypatch.setattr(_ctlring, "STRONG_ORDER", False)
    pub, sub = _pair()
    with pub, sub:
        for i in range(50):
            assert pub.send_frame(i, i % SLOTS, i, b"p")
            assert pub.send_frame(i + 1000, 0, 0)
            assert sub.recv_frame(timeout=1) == (i, i % SLOTS, i, b"p")
            assert sub.recv_frame(timeout=1) == (i + 1000, 0, 0, b"")
            assert sub.try_recv_frame() is None


# -- full lanes ---------------------------------------------------------------------


def test_full_lane_drops_in_drop_mode() -> None:
    pub, sub = _pair(capacity=4, full="drop")
    with pub, sub:
        for i in range(4):
            assert pub.send_frame(i, 0, 0)
        t0 = time.monotonic()
        assert pub.send_frame(4, 0, 0, timeout=5) is False  # drop mode never waits
        assert time.monotonic() - t0 < 0.5
        assert sub.recv_frame(timeout=1) is not None
        assert pub.send_frame(4, 0, 0)
        assert [sub.try_recv_frame()[0] for _ in range(4)] == [1, 2, 3, 4]  # type: ignore[index]


def test_full_lane_blocks_up_to_the_timeout() -> None:
    pub, sub = _pair(capacity=2)
    with pub, sub:
        assert pub.send_frame(0, 0, 0) and pub.send_frame(1, 0, 0)
        t0 = time.monotonic()
        assert pub.send_frame(2, 0, 0, timeout=0.2) is False
        assert 0.15 < time.monotonic() - t0 < 5.0
        assert pub.send_frame(2, 0, 0, timeout=0) is False


@pytest.mark.timeout(60)
def test_blocked_writer_wakes_when_the_reader_frees_space(spawn: Callable[..., Child]) -> None:
    with PublisherRing.create(SLOTS, capacity=2) as pub:
        child = spawn(child_consume_on_demand)
        child.send_ring(pub)
        assert child.expect() == "ready"
        assert pub.send_frame(0, 0, 0) and pub.send_frame(1, 0, 0)
        child.conn.send(1)  # the child consumes one record, which frees one
        t0 = time.monotonic()
        assert pub.send_frame(2, 0, 0, timeout=20)
        assert time.monotonic() - t0 < 5.0
        assert child.expect() == [0]
        child.conn.send(2)
        assert child.expect() == [1, 2]
        child.conn.send(0)


# -- hostile and corrupt input ----------------------------------------------------


def _corrupt(pub: PublisherRing, offset: int, fmt: str, *values: int) -> None:
    mm = _raw(pub)
    struct.pack_into(fmt, mm, offset, *values)
    mm.close()


@pytest.mark.parametrize(
    "offset, fmt, values, match",
    [
        (64, "<Q", (9,), "head"),  # head more than capacity ahead
        (64, "<Q", ((1 << 64) - 1,), "head"),
        (320, "<QQIIII", (5, 0, 0, 0, 0, 0), "position"),  # wrong position stamp
        (320, "<QQIIII", (0, 0, SLOTS, 0, 0, 0), "slot"),
        (320, "<QQIIII", (0, 0, 0, 0, 1, 0), "reserved"),
        (320, "<QQIIII", (0, 0, 0, 0, 0, 257), "payload"),
        (320, "<QQIIII", (0, 0, 0, 0, 0, 0xFFFFFFFF), "payload"),
    ],
)
def test_corrupt_frame_lane_is_a_protocol_error(
    offset: int, fmt: str, values: tuple[int, ...], match: str
) -> None:
    pub, sub = _pair()
    with pub, sub:
        assert pub.send_frame(0, 1, 2, b"ok")
        _corrupt(pub, offset, fmt, *values)
        with pytest.raises(ProtocolError, match=match):
            sub.recv_frame(timeout=1)


def test_corrupt_tails_and_release_records_are_protocol_errors() -> None:
    pub, sub = _pair()
    with pub, sub:
        _corrupt(pub, 128, "<Q", 3)  # the subscriber's tail ahead of the publisher's head
        with pytest.raises(ProtocolError, match="tail"):
            pub.send_frame(0, 0, 0)
    pub, sub = _pair()
    with pub, sub:
        assert sub.send_release(0, 0, 0)
        _corrupt(pub, 256, "<Q", 1 << 50)  # the publisher's tail, rewritten by the subscriber
        with pytest.raises(ProtocolError, match="tail"):
            sub.send_release(1, 0, 0)
    pub, sub = _pair()
    with pub, sub:
        lay = layout(SLOTS, SLOTS, SLOTS, 256)
        assert sub.send_release(0, 0, 0)
        _corrupt(pub, lay["release_records"], "<QQII", 0, 0, 99, 0)
        with pytest.raises(ProtocolError, match="slot"):
            pub.recv_release(timeout=1)


def test_random_garbage_gives_records_or_protocol_errors_only() -> None:
    rng = random.Random(11)
    for trial in range(300):
        pub, sub = _pair(capacity=4, inline_max=64)
        with pub, sub:
            for i in range(rng.randrange(0, 4)):
                pub.send_frame(i, 0, 0, b"x" * i)
            mm = _raw(pub)
            for _ in range(rng.randrange(1, 8)):
                off = rng.randrange(64, len(mm) - 8)
                mm[off : off + 8] = rng.randbytes(8)
            mm.close()
            try:
                for _ in range(6):
                    rec = sub.try_recv_frame()
                    if rec is not None:
                        _seq, slot, _gen, payload = rec
                        assert 0 <= slot < SLOTS and len(payload) <= 64
            except ProtocolError:
                pass
            with contextlib.suppress(ProtocolError):
                pub.send_frame(trial, 0, 0)


def _header_fds(edit: Callable[[mmap.mmap], None], seal: bool = True) -> list[int]:
    """The fds of a ring whose memory was edited (or built unsealed) before attaching."""
    pub = PublisherRing.create(SLOTS)
    memfd, pe, se = (os.dup(fd) for fd in pub.fds())
    mm = _raw(pub)
    edit(mm)
    mm.close()
    if not seal:
        size = os.fstat(memfd).st_size
        plain = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(plain, size)
        os.pwrite(plain, os.pread(memfd, size, 0), 0)
        os.close(memfd)
        memfd = plain
    pub.close()
    return [memfd, pe, se]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: struct.pack_into("<I", m, 0, 0xDEAD), "magic"),
        (lambda m: struct.pack_into("<H", m, 4, 9), "version"),
        (lambda m: struct.pack_into("<I", m, 8, 3), "power of two"),
        (lambda m: struct.pack_into("<I", m, 8, 1 << 20), "power of two"),
        (lambda m: struct.pack_into("<I", m, 24, 1 << 20), "inline_max"),
        (lambda m: struct.pack_into("<I", m, 28, 9), "slots"),
        (lambda m: struct.pack_into("<Q", m, 32, 1 << 40), "add up"),
        (lambda m: struct.pack_into("<I", m, 16, 64), "add up"),
        (lambda m: struct.pack_into("<Q", m, 128, 1), "start empty"),
    ],
)
def test_bad_header_refused_at_attach(
    edit: Callable[[mmap.mmap], None], match: str, fd_count: Callable[[], int]
) -> None:
    fds = _header_fds(edit)
    gc.collect()
    before = fd_count()
    with pytest.raises(ProtocolError, match=match):
        SubscriberRing.attach(fds, SLOTS)
    assert fd_count() == before - 3  # attach owns the fds: closed on failure


def test_attach_refuses_wrong_fds(tmp_path: Any) -> None:
    with pytest.raises(ProtocolError, match="sealed"):
        SubscriberRing.attach(_header_fds(lambda m: None, seal=False), SLOTS)
    pub = PublisherRing.create(SLOTS)
    with pub:
        r, w = os.pipe()
        fds = [os.dup(pub.fds()[0]), r, os.dup(pub.fds()[2])]
        with pytest.raises(ProtocolError, match="eventfd"):
            SubscriberRing.attach(fds, SLOTS)
        os.close(w)
        f = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT)
        with pytest.raises(ProtocolError, match="memfd"):
            SubscriberRing.attach([f, os.dup(pub.fds()[1]), os.dup(pub.fds()[2])], SLOTS)
        with pytest.raises(ProtocolError, match="3 fds"):
            SubscriberRing.attach([os.dup(pub.fds()[1])], SLOTS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["release_head", "frame_tail", "release_record"])
def test_hostile_subscriber_process(spawn: Callable[..., Child], what: str) -> None:
    with PublisherRing.create(SLOTS) as pub:
        child = spawn(child_hostile, what)
        child.send_ring(pub)
        assert child.expect() == "done"
        with pytest.raises(ProtocolError):
            if what == "frame_tail":
                pub.send_frame(0, 0, 0)
            else:
                pub.recv_release(timeout=5)


def test_caller_errors_are_value_errors() -> None:
    pub, sub = _pair(inline_max=8)
    with pub, sub:
        with pytest.raises(ValueError, match="at most 8"):
            pub.send_frame(0, 0, 0, b"123456789")
        with pytest.raises(ValueError, match="out of range"):
            pub.send_frame(0, SLOTS, 0)
        with pytest.raises(ValueError, match="out of range"):
            sub.send_release(-1, 0, 0)
    for kw in ({"capacity": 3}, {"inline_max": 7}, {"full": "maybe"}, {"spin_us": -1}):
        with pytest.raises(ValueError):
            PublisherRing.create(SLOTS, **kw)


# -- peer death -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigkilled_subscriber_is_seen_through_pidfd_and_socket(spawn: Callable[..., Child]) -> None:
    with PublisherRing.create(SLOTS, capacity=2) as pub:
        child = spawn(child_hold)
        child.send_ring(pub)
        _tag, pid = child.expect()
        pidfd = os.pidfd_open(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            assert pub.recv_release(timeout=30, watch=[pidfd]) is None
            assert time.monotonic() - t0 < 10
            # a full lane whose reader died does not hang the writer either
            assert pub.send_frame(0, 0, 0) and pub.send_frame(1, 0, 0)
            t0 = time.monotonic()
            assert pub.send_frame(2, 0, 0, timeout=30, watch=[child.sock]) is False
            assert time.monotonic() - t0 < 10
        finally:
            os.close(pidfd)


@pytest.mark.timeout(60)
def test_sigkilled_publisher_leaves_the_subscriber_its_records(spawn: Callable[..., Child]) -> None:
    child = spawn(child_publisher)
    _msg, fds, _f, _a = socket.recv_fds(child.sock, 16, 3)
    _tag, pid = child.expect()
    with SubscriberRing.attach(fds, SLOTS) as sub:
        os.kill(pid, signal.SIGKILL)
        child.proc.join(10)
        assert sub.recv_frame(timeout=1) == (0, 0, 0, b"hi")  # the mapping outlives its creator
        t0 = time.monotonic()
        assert sub.recv_frame(timeout=30, watch=[child.sock]) is None  # socket EOF ends the wait
        assert time.monotonic() - t0 < 10
        assert sub.send_release(0, 0, 0)  # the memory is still mapped: no crash


# -- CPU use, fds, teardown -------------------------------------------------------


@pytest.mark.timeout(60)
def test_idle_waiter_uses_no_cpu(spawn: Callable[..., Child]) -> None:
    with PublisherRing.create(SLOTS) as pub:
        child = spawn(child_idle_waiter, 3.0, 0.0)
        child.send_ring(pub)
        assert child.expect() == "ready"
        _tag, rec, wall, cpu = child.expect(timeout=30)
    assert rec is None and wall >= 2.9
    assert cpu < 0.01 * wall, f"idle waiter used {cpu * 1e3:.1f} ms of CPU in {wall:.1f} s"


@pytest.mark.timeout(60)
def test_spin_is_bounded_then_sleeps(spawn: Callable[..., Child]) -> None:
    with PublisherRing.create(SLOTS) as pub:
        child = spawn(child_idle_waiter, 2.0, 200.0)  # spins 200 us, then sleeps
        child.send_ring(pub)
        assert child.expect() == "ready"
        _tag, rec, wall, cpu = child.expect(timeout=30)
    assert rec is None and cpu < 0.02 * wall


def _cloexec(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)


def test_fds_are_close_on_exec() -> None:
    pub = PublisherRing.create(SLOTS)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with pub, a, b:
        assert all(_cloexec(fd) for fd in pub.fds())
        socket.send_fds(a, [b"ring"], pub.fds())
        _m, fds, _f, _a = socket.recv_fds(b, 16, 3)
        for fd in fds:  # received fds may come inheritable; attach fixes that
            os.set_inheritable(fd, True)
        with SubscriberRing.attach(fds, SLOTS) as sub:
            assert _cloexec(sub.fileno())
            ring_fds = [
                int(fd)
                for fd in os.listdir("/proc/self/fd")
                if _link(int(fd)).startswith(
                    ("/memfd:cupy_ipcpool-ctlring", "anon_inode:[eventfd]")
                )
            ]
            assert len(ring_fds) >= 7  # both ends' fds and the mappings' private dups
            assert all(_cloexec(fd) for fd in ring_fds)


def _link(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _ring_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("cupy_ipcpool-ctlring" in line for line in f)


def test_close_releases_everything(fd_count: Callable[[], int]) -> None:
    gc.collect()
    fds0, maps0 = fd_count(), _ring_maps()
    pub, sub = _pair()
    # publisher: memfd + 2 eventfds; subscriber: 2 eventfds (its memfd is closed once mapped);
    # each mmap object holds a private dup of the memfd
    assert fd_count() == fds0 + 7 and _ring_maps() == maps0 + 2
    pub.send_frame(0, 0, 0)
    sub.close()
    sub.close()  # idempotent
    pub.close()
    assert fd_count() == fds0 and _ring_maps() == maps0
    with pytest.raises(PoolClosedError):
        pub.send_frame(1, 0, 0)
    with pytest.raises(PoolClosedError):
        sub.recv_frame(timeout=0)
    with pytest.raises(PoolClosedError):
        pub.fds()


def test_forgotten_rings_are_released_by_the_finalizer(fd_count: Callable[[], int]) -> None:
    gc.collect()
    fds0, maps0 = fd_count(), _ring_maps()
    pub, sub = _pair()
    del pub, sub
    gc.collect()
    assert fd_count() == fds0 and _ring_maps() == maps0


def test_layout_is_pure_and_validated() -> None:
    lay = layout(8, 8, 8, 256)
    assert lay["frame_record"] % 64 == 0 and lay["total"] % 64 == 0
    assert lay["release_records"] == lay["frame_records"] + 8 * lay["frame_record"]
    with contextlib.suppress(ValueError):
        layout(0, 8, 8, 0)
        raise AssertionError("num_slots 0 accepted")
