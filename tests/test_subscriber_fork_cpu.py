"""A child forked from a subscriber's process leaves the parent's subscription alone.

A process that holds a live :class:`SubscriberCore` and forks (``os.fork``,
multiprocessing's ``fork`` start method) gives the child a copy of the
subscriber, with a copy of its socket.  When the child drops its copy (garbage
collection), exits holding it (``weakref.finalize`` runs at exit) or calls its
``close()``, it must not say BYE on the parent's connection (the publisher
would drop the parent's subscriber), read the messages queued for the parent
(its frames would be lost), send RELEASEs owed or change the socket's flags,
which the parent shares: it only closes its own copies of the fds.

The subscriber runs in a process of its own (this file run as a script, below),
the publisher here: the child inherits the subscriber and nothing else.  The
two talk over the script's stdin and stdout, each read with a bound
(``tests/_fork.py``).
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from _fork import BOUND, MODES, Lines, ends_clean, fork_and_let_go, say, script_processes, tell
from _memfd_backend import MemfdConsumer, MemfdProducer

from cupy_ipcpool._errors import EndOfStream, PoolClosedError
from cupy_ipcpool.channel._handshake import SubscriberInfo

# -- the subscriber's process (this file run as a script) -----------------------------------


def _child_drops(sub: MemfdConsumer) -> None:
    """In the forked child: drop the inherited subscriber and collect it; exit 0 only if
    its finalizer did run here."""
    finalizer = sub.core._finalizer
    del sub.core
    gc.collect()
    if finalizer.alive:
        raise AssertionError("the subscriber was not collected in the child")


def _child_closes(sub: MemfdConsumer) -> None:
    """In the forked child: the inherited subscriber was closed at the fork (its copy of the
    socket gone); its calls raise :class:`PoolClosedError` saying why; ``close()`` again
    answers None, as always."""
    core = sub.core
    if not core.closed or core.connected():
        raise AssertionError("the subscriber was not closed at the fork")
    if core.fileno() != -1:
        raise AssertionError("the child's copy of the socket is still open")
    try:
        core.recv(0.0)
    except PoolClosedError as exc:
        if "fork" not in str(exc):
            raise AssertionError(f"the error does not say why: {exc}") from None
    else:
        raise AssertionError("recv after the fork did not raise PoolClosedError")
    if core.close() is not None:
        raise AssertionError("close() answered something")


def _subscriber_main(mode: str, address: str) -> None:
    commands = Lines(sys.stdin.fileno())
    sub = MemfdConsumer(address, timeout=BOUND)
    say("subscribed")
    assert commands.next() == "published"  # frame 0 waits, unread, in our socket
    fd = sub.core.fileno()
    code = fork_and_let_go(sub, mode, _child_drops, _child_closes)
    nonblocking = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK)
    say(json.dumps({"child_exit": code, "nonblocking": nonblocking}))
    for _ in range(2):
        assert commands.next() == "recv"
        frame = sub.recv(BOUND)  # frame 0: queued before the fork, not read by the child
        sub.release(frame)
        say(json.dumps({"seq": frame.seq}))
    assert commands.next() == "closed"
    try:
        sub.core.recv(BOUND)
    except EndOfStream as exc:
        say(json.dumps({"end": str(exc), "clean": exc.clean}))
    sub.close()


# -- the test: the publisher's side ----------------------------------------------------------


@pytest.fixture
def subscriber_process(tmp_path: Any) -> Iterator[Any]:
    """Start the subscriber's process for a mode; killed at the end if still running."""
    with script_processes(__file__) as start:
        yield start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_a_forked_child_letting_go_of_the_subscriber_leaves_the_parent_subscribed(
    subscriber_process: Any, tmp_path: Any, mode: str
) -> None:
    """``drop``: the child deletes its copy and collects it (then ``os._exit``); ``exit``:
    the child leaves by ``sys.exit`` with the copy held (its finalizer runs at exit);
    ``mp-drop``: a multiprocessing ``fork`` worker drops it; ``close``: the child calls
    ``close()`` (closed there, its socket copy gone).  Afterwards the publisher got no BYE
    and keeps the subscriber, the frame queued before the fork reaches the parent (not read
    by the child), its RELEASE and the next frame go through, the socket is still blocking,
    and the publisher's ``close()`` ends the parent's stream with a BYE."""
    address = str(tmp_path / "pub.sock")
    left: list[SubscriberInfo] = []
    prod = MemfdProducer(address, 4, on_leave=left.append)
    try:
        proc = subscriber_process(mode, address)
        assert proc.stdout is not None
        out = Lines(proc.stdout.fileno())
        with ends_clean(proc):
            assert out.next() == "subscribed"
            prod.wait_subscribers(1, timeout=BOUND)
            assert prod.publish_next(timeout=BOUND) == 0
            tell(proc, "published")

            report = json.loads(out.next())
            assert report == {"child_exit": 0, "nonblocking": False}
            # the child has ended: whatever it sent is in the socket, read by this poll
            assert prod.core.poll(0.0) == 0
            assert left == [], prod.core.last_leave_reason
            assert len(prod.core.subscribers) == 1

            tell(proc, "recv")
            assert json.loads(out.next()) == {"seq": 0}  # the frame queued before the fork
            assert prod.core.poll(BOUND) == 1  # its RELEASE
            assert prod.publish_next(timeout=BOUND) == 1
            tell(proc, "recv")
            assert json.loads(out.next()) == {"seq": 1}
            assert prod.core.poll(BOUND) == 1
            assert left == []

            prod.core.close()
            tell(proc, "closed")
            assert json.loads(out.next()) == {"end": "the publisher said BYE", "clean": True}
    finally:
        prod.close()


def test_the_finalizer_still_says_bye_in_the_process_that_made_the_subscriber(
    tmp_path: Any,
) -> None:
    """Dropped without ``close()`` where it was made, the subscriber still says BYE (the
    fork guard is no guard against its own process)."""
    address = str(tmp_path / "pub.sock")
    left: list[SubscriberInfo] = []
    with MemfdProducer(address, 4, on_leave=left.append) as prod:
        sub = MemfdConsumer(address, timeout=BOUND)
        prod.wait_subscribers(1, timeout=BOUND)
        (joined,) = prod.core.subscribers
        prod.publish_next(timeout=BOUND)
        assert sub.recv(BOUND).seq == 0  # held: its lease ends with the subscriber
        ref = weakref.ref(sub.core)
        del sub.core
        gc.collect()
        assert ref() is None
        assert prod.core.poll(BOUND) == 1  # the BYE: the subscriber left, its lease ended
        assert left == [joined]
        assert prod.core.last_leave_reason == "said BYE"
        assert prod.core.subscribers == []
        for m in sub.maps:
            m.close()


if __name__ == "__main__":
    _subscriber_main(sys.argv[1], sys.argv[2])
