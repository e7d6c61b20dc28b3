"""The per-frame path's options and shortcuts, for real (processes, sockets, memfd slots).

* ``spin_us``: a short busy-poll before sleeping, on the subscriber's ``recv``
  and the publisher's ``poll`` (off by default: an idle end uses no CPU);
* ``SubscriberCore.watch``: one ``poll(0)`` per frame covers the socket's
  hang-up and the producer's pidfd;
* ``LeaseBook.lease_count`` / ``any_leased``: the cheap questions the pool asks
  for every acquire.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
from _memfd_backend import MemfdConsumer, MemfdProducer

from cupy_ipcpool._errors import ChannelTimeoutError, EndOfStream, UsageError
from cupy_ipcpool.channel._leases import LeaseBook
from cupy_ipcpool.channel._session import MAX_SPIN_US, PublisherCore, SubscriberCore

CTX = mp.get_context("spawn")


@pytest.fixture
def address(tmp_path: os.PathLike[str]) -> str:
    return os.path.join(os.fspath(tmp_path), "hot.sock")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- spin_us: validation ----------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, MAX_SPIN_US + 1, True, "50", None])
def test_spin_us_is_validated(address: str, bad: object) -> None:
    with MemfdProducer(address, 2), pytest.raises(UsageError, match="spin_us"):
        SubscriberCore(address, spin_us=bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="spin_us"):
        PublisherCore(address, 2, welcome=lambda info: (b"", []), spin_us=bad)  # type: ignore[arg-type]


# -- spin_us: frames still arrive, in order, unharmed ------------------------------


def _echo(conn: Connection, address: str, frames: int, spin_us: float) -> None:
    try:
        with MemfdConsumer(address, spin_us=spin_us) as consumer:
            conn.send("ready")
            for _ in range(frames):
                frame = consumer.recv(timeout=30.0)
                consumer.release(frame)
        conn.send("done")
    except BaseException as exc:
        conn.send(f"error: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("spin_us", [0, 200])
def test_round_trips_with_and_without_spin(address: str, spin_us: float) -> None:
    """Ping-pong 300 frames; the publisher spins in poll() as the subscriber does in recv()."""
    frames = 300
    with MemfdProducer(address, 4, spin_us=spin_us) as producer:
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_echo, args=(child, address, frames, spin_us), daemon=True)
        proc.start()
        try:
            assert parent.poll(60) and parent.recv() == "ready"
            producer.wait_subscribers(1)
            for _ in range(frames):
                producer.publish_next(timeout=10.0)
                deadline = time.monotonic() + 10.0
                while producer.core.lease_book.any_leased():
                    assert time.monotonic() < deadline, "the lease did not come back"
                    producer.core.poll(1.0)
            assert parent.poll(30) and parent.recv() == "done"
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def test_spin_respects_the_timeout(address: str) -> None:
    """recv(timeout) with a spin longer than the timeout still ends at the timeout."""
    with MemfdProducer(address, 2) as producer, SubscriberCore(address, spin_us=MAX_SPIN_US) as sub:
        producer.wait_subscribers(1)
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeoutError):
            sub.recv(timeout=0.002)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(ChannelTimeoutError):
            sub.recv(timeout=0)  # no frame, no wait, no spin


# -- idle: no CPU without spin -----------------------------------------------------


def _idle_recv(address: str, spin_us: float) -> tuple[float, float]:
    """CPU seconds and wall seconds of one ``recv(timeout=1.0)`` with nothing published."""
    with MemfdProducer(address, 2) as producer, SubscriberCore(address, spin_us=spin_us) as sub:
        producer.wait_subscribers(1)
        cpu0, wall0 = _cpu_seconds(), time.monotonic()
        with pytest.raises(ChannelTimeoutError):
            sub.recv(timeout=1.0)
        return _cpu_seconds() - cpu0, time.monotonic() - wall0


@pytest.mark.parametrize("spin_us", [0, 1000], ids=["no spin", "1 ms spin"])
def test_idle_subscriber_uses_no_cpu(address: str, spin_us: float) -> None:
    """A subscriber blocked in recv for a second uses (almost) no CPU: it sleeps in poll(2).

    With ``spin_us`` one recv burns at most its spin, then sleeps like the
    default.  A busy loop would use the whole second; the bound leaves room
    for a loaded CI machine (the benchmark measures the real fraction over 5 s).
    """
    cpu, wall = _idle_recv(address, spin_us)
    assert wall >= 0.9
    assert cpu / wall < 0.05, f"idle recv used {cpu:.3f} s of CPU in {wall:.3f} s"


# -- recv without a timeout: sleeps in recv(2) itself --------------------------------


def _publish_then(conn: Connection, address: str, end: str) -> None:
    """Publish one frame 0.3 s after the subscriber joined; then say BYE, or wait to be killed."""
    try:
        with MemfdProducer(address, 2) as producer:
            conn.send("ready")
            producer.wait_subscribers(1)
            time.sleep(0.3)
            producer.publish_next()
            deadline = time.monotonic() + 10.0
            while producer.core.lease_book.any_leased() and time.monotonic() < deadline:
                producer.core.poll(0.1)
            conn.send("released")
            if end == "kill":
                time.sleep(60)  # the test kills this process
    except BaseException as exc:
        conn.send(f"error: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("end", ["bye", "kill"])
def test_recv_without_timeout_sleeps_and_wakes_for_a_frame_and_for_the_end(
    address: str, end: str
) -> None:
    """``recv()`` with no timeout sleeps in ``recv`` (the socket is blocking after the
    handshake): no CPU while it waits, and it wakes for a frame, for a BYE and for a
    publisher killed with SIGKILL (the kernel hangs the socket up)."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_publish_then, args=(child, address, end), daemon=True)
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "ready"
        with SubscriberCore(address) as sub:
            cpu0, wall0 = _cpu_seconds(), time.monotonic()
            frame = sub.recv()  # published 0.3 s from now
            cpu, wall = _cpu_seconds() - cpu0, time.monotonic() - wall0
            assert wall >= 0.2 and cpu / wall < 0.2, (cpu, wall)
            sub.release(frame.seq, frame.slot)
            assert parent.poll(30) and parent.recv() == "released"
            if end == "kill":
                threading.Timer(0.3, proc.kill).start()
            with pytest.raises(EndOfStream) as info:
                sub.recv()  # the last call waited: this one sleeps in recv at once
            assert info.value.clean is (end == "bye")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- watch(): the hang-up check covers another fd ----------------------------------


@pytest.fixture
def eventfd() -> Iterator[int]:
    fd = os.eventfd(0, os.EFD_CLOEXEC)
    yield fd
    os.close(fd)


def test_watched_fd_sets_the_alarm(address: str, eventfd: int) -> None:
    with MemfdProducer(address, 4) as producer, SubscriberCore(address) as sub:
        sub.watch(eventfd)
        producer.wait_subscribers(1)
        producer.publish_next()
        frame = sub.recv(timeout=5)
        assert not sub.alarm
        assert sub.connected()
        sub.release(frame.seq, frame.slot)
        os.eventfd_write(eventfd, 1)  # the "producer exited" signal fires
        producer.publish_next()
        frame = sub.recv(timeout=5)  # the frame is still handed over; the caller decides
        assert sub.alarm
        assert not sub.connected()
        sub.release(frame.seq, frame.slot)


def test_watch_takes_each_fd_once_and_at_most_15(address: str) -> None:
    """The compiled calls poll the socket and the watched fds as one set of at most 16."""
    fds = [os.eventfd(0, os.EFD_CLOEXEC) for _ in range(16)]
    try:
        with MemfdProducer(address, 4) as producer, SubscriberCore(address) as sub:
            for fd in fds[:15]:
                sub.watch(fd)
                sub.watch(fd)  # again: still one entry
            with pytest.raises(UsageError, match="at most 15"):
                sub.watch(fds[15])
            producer.wait_subscribers(1)
            producer.publish_next()
            frame = sub.recv(timeout=5)  # the set still works
            assert not sub.alarm
            os.eventfd_write(fds[14], 1)
            assert not sub.connected() and sub.alarm
            sub.release(frame.seq, frame.slot)
    finally:
        for fd in fds:
            os.close(fd)


def test_hangup_sets_the_alarm(address: str) -> None:
    with MemfdProducer(address, 4) as producer, SubscriberCore(address) as sub:
        producer.wait_subscribers(1)
        assert sub.connected() and not sub.alarm
        producer.close()
        deadline = time.monotonic() + 5
        while sub.connected():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sub.alarm


# -- the lease book's cheap questions ----------------------------------------------


def test_lease_count_and_any_leased() -> None:
    book = LeaseBook(4)
    book.add_subscriber(1, "block", 2)
    book.add_subscriber(2, "block", 2)
    assert not book.any_leased()
    assert [book.lease_count(s) for s in range(4)] == [0, 0, 0, 0]
    book.publishing(1, 10)
    assert book.any_leased()
    assert book.lease_count(1) == 2 == len(book.leases(1))
    book.release(1, 10, 1)
    assert book.lease_count(1) == 1
    book.remove_subscriber(2)
    assert book.lease_count(1) == 0
    assert not book.any_leased()
