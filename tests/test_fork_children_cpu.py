"""A long-lived child forked from a channel end's process does not hide that process's death.

A worker forked while a subscriber or a publisher is open (``os.fork``, multiprocessing's
``fork`` workers, a DataLoader's) would inherit copies of its sockets.  Kept, a copy hides
the parent's death: a killed subscriber's socket would not hang up, so its publisher would
keep the frames it held (a ``"block"`` publisher stalls); a killed publisher's listening
socket would still take connections, so a publisher restarted at its path would find it
live and be refused.  The child closes its copies at the fork
(``_transport._closing.close_in_forked_children``).

The channel end runs in a process of its own (this file run as a script), which forks a
child that outlives it, then is killed; the other end is here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _fork import BOUND, Lines, say, script_processes
from _memfd_backend import MemfdConsumer, MemfdProducer

# -- the channel end's process (this file run as a script) ----------------------------------


def _fork_a_lingering_child() -> None:
    """Fork a child that says its pid, then only sleeps (until killed).  It speaks, not the
    parent: ``os.fork`` returns in the child once the at-fork handlers ran there, so the
    line means that its copies are closed (the parent could be killed before that)."""
    if os.fork() == 0:  # pragma: no cover - the child
        say(f"child {os.getpid()}")
        time.sleep(3 * BOUND)
        os._exit(0)


def _main(role: str, address: str) -> None:
    if role == "sub":
        sub = MemfdConsumer(address, timeout=BOUND)
        say("subscribed")
        held = sub.recv(BOUND)  # held when killed
        assert held.seq == 0
    else:
        prod = MemfdProducer(address, 4)
        say("listening")
    _fork_a_lingering_child()
    time.sleep(3 * BOUND)  # until killed
    raise AssertionError(f"{role} was not killed: {prod if role == 'pub' else sub}")


@pytest.fixture
def channel_end(tmp_path: Any) -> Iterator[Any]:
    """``start(role, address)``: the script's process; it and the child it says it forked
    are killed at the end."""
    children: list[int] = []
    with script_processes(__file__) as start:

        def run(role: str, address: str) -> tuple[Any, Lines]:
            proc = start(role, address)
            assert proc.stdout is not None
            return proc, Lines(proc.stdout.fileno())

        try:
            yield run, children
        finally:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _kill(proc: Any) -> None:
    proc.kill()
    proc.wait(BOUND)


@pytest.mark.timeout(120)
def test_a_killed_subscriber_gives_its_frames_back_while_its_forked_child_lives(
    channel_end: Any, tmp_path: Any
) -> None:
    """The subscriber's process holds frame 0, forks a child that lives on, and is killed:
    its socket hangs up all the same (the child closed its copy at the fork), so the
    publisher takes frame 0's lease back and hears that it left."""
    run, children = channel_end
    address = str(tmp_path / "pub.sock")
    left: list[object] = []
    with MemfdProducer(address, 4, on_leave=left.append) as prod:
        proc, out = run("sub", address)
        assert out.next() == "subscribed"
        prod.wait_subscribers(1, timeout=BOUND)
        assert prod.publish_next(timeout=BOUND) == 0
        word, pid = out.next().split()
        assert word == "child"
        children.append(int(pid))
        assert prod.core.poll(0.0) == 0  # frame 0 is held
        _kill(proc)
        returned = 0
        deadline = time.monotonic() + BOUND
        while not (returned and left):
            returned += prod.core.poll(0.1)
            assert time.monotonic() < deadline, "the killed subscriber's lease never came back"
        assert returned == 1 and len(left) == 1
        assert os.path.exists(f"/proc/{pid}")  # the child lives on: it held nothing


@pytest.mark.timeout(120)
def test_a_publisher_restarts_at_the_path_of_a_killed_one_whose_forked_child_lives(
    channel_end: Any, tmp_path: Any
) -> None:
    """The publisher's process forks a child that lives on, and is killed: its socket file
    is stale (nobody listens: the child closed its copy of the listener at the fork), so a
    new publisher takes the path and serves."""
    run, children = channel_end
    address = str(tmp_path / "pub.sock")
    proc, out = run("pub", address)
    assert out.next() == "listening"
    word, pid = out.next().split()
    assert word == "child"
    children.append(int(pid))
    _kill(proc)
    with MemfdProducer(address, 4) as prod:  # not "already listening"
        sub = MemfdConsumer(address, timeout=BOUND)
        try:
            prod.wait_subscribers(1, timeout=BOUND)
            assert prod.publish_next(timeout=BOUND) == 0
            frame = sub.recv(BOUND)
            assert frame.seq == 0
            sub.release(frame)
        finally:
            sub.core.close()
    assert os.path.exists(f"/proc/{pid}")


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
