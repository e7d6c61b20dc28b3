"""Children of the restart and death cycles of ``test_session.py``, in a module of their own.

A spawned child imports the module of its target: this one imports only the
session core and the memfd backend, so that each of the many short-lived
processes of those tests starts in a fraction of a second.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

from _memfd_backend import MemfdConsumer, MemfdProducer
from _pipe_child import run_body

from cupy_ipcpool._errors import EndOfStream, TransportError
from tests._fds import fd_count


def _memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:ipcpool-slot" in line for line in f)


def child_publish_until_killed(conn: Connection, address: str, frames: int) -> None:
    """Publish ``frames`` frames to the first subscriber, report the fd count, wait to die."""

    def body() -> None:
        with MemfdProducer(address, 8) as producer:
            producer.wait_subscribers(1)
            for _ in range(frames):
                producer.publish_next(timeout=10.0)
            conn.send(("msg", fd_count()))
            conn.recv()  # the parent SIGKILLs this process meanwhile

    run_body(conn, body)


def child_outlive_publishers(conn: Connection, address: str, cycles: int, hold: int) -> None:
    """For each publisher that comes up at ``address``: subscribe, hold ``hold`` frames, see it
    die (EndOfStream, clean False, after the frames still queued), check every frame, close;
    report fds and mappings."""

    def body() -> None:
        for _ in range(cycles):
            deadline = time.monotonic() + 30
            while True:  # wait for the next publisher
                try:
                    consumer = MemfdConsumer(address, timeout=5.0)
                    break
                except (TransportError, EndOfStream):
                    # not up yet (ECONNREFUSED, ENOENT), or the dying one's listener took
                    # the connection and then closed (EndOfStream during the handshake)
                    assert time.monotonic() < deadline, "no publisher came up"
                    time.sleep(0.005)
            with consumer:
                held = [consumer.recv(timeout=10.0) for _ in range(hold)]
                conn.send(("msg", "holding"))
                while True:  # frames queued before the death are intact (no one rewrote them)
                    try:
                        held.append(consumer.recv(timeout=30.0))
                    except EndOfStream as exc:
                        assert not exc.clean, exc
                        break
                    assert len(held) <= hold + 2, "more frames than were published"
                for frame in held:  # the memory outlives its publisher
                    consumer.check(frame)
                    consumer.release(frame)  # only forgets it locally now
            conn.send(("msg", (fd_count(), _memfd_mappings())))

    run_body(conn, body)


def child_hold_until_killed(conn: Connection, address: str) -> None:
    """Subscribe, take two frames and keep them (more stay queued) until killed."""

    def body() -> None:
        with MemfdConsumer(address, timeout=10.0) as consumer:
            conn.send(("msg", consumer.core.sub_id))
            for _ in range(2):
                consumer.recv(timeout=10.0)
            conn.send(("msg", "holding"))
            conn.recv()

    run_body(conn, body)
