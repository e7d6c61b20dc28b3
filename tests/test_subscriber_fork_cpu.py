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
(:class:`test_publisher_fork_cpu._Lines`).
"""

from __future__ import annotations

import fcntl
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer, MemfdProducer
from test_publisher_fork_cpu import BOUND, _Lines, _say, _tell, _wait_child

from cupy_ipcpool._errors import EndOfStream, PoolClosedError
from cupy_ipcpool.channel._handshake import SubscriberInfo

MODES = ["drop", "exit", "mp-drop", "close"]


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
    """In the forked child: ``close()`` the inherited subscriber; it is closed here (later
    calls raise :class:`PoolClosedError`) and its copy of the socket is gone."""
    core = sub.core
    if core.close() is not None:
        raise AssertionError("close() answered something")
    if not core.closed or core.connected():
        raise AssertionError("the subscriber is not closed in the child")
    try:
        core.recv(0.0)
    except PoolClosedError:
        pass
    else:
        raise AssertionError("recv after close() did not raise PoolClosedError")
    if core.fileno() != -1:
        raise AssertionError("the child's copy of the socket is still open")
    core.close()  # idempotent


def _mp_target(sub: MemfdConsumer) -> None:
    _child_drops(sub)


def _fork_and_let_go(sub: MemfdConsumer, mode: str) -> int:
    """Fork a child that lets go of the subscriber as ``mode`` says; its exit code."""
    if mode == "mp-drop":
        proc = multiprocessing.get_context("fork").Process(target=_mp_target, args=(sub,))
        proc.start()
        proc.join(BOUND)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise TimeoutError(f"the forked child did not end within {BOUND} s")
        return proc.exitcode
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        if mode in ("drop", "close"):
            try:
                (_child_drops if mode == "drop" else _child_closes)(sub)
            except BaseException as exc:
                print(f"child: {exc!r}", file=sys.stderr, flush=True)
                os._exit(1)
            os._exit(0)
        # "exit": the interpreter's own exit, the subscriber still held: its finalizer runs
        # there (weakref.finalize's atexit)
        assert sub.core._finalizer.atexit and sub.core._finalizer.alive
        sys.exit(0)
    return _wait_child(pid)


def _subscriber_main(mode: str, address: str) -> None:
    commands = _Lines(sys.stdin.fileno())
    sub = MemfdConsumer(address, timeout=BOUND)
    _say("subscribed")
    assert commands.next() == "published"  # frame 0 waits, unread, in our socket
    fd = sub.core.fileno()
    code = _fork_and_let_go(sub, mode)
    nonblocking = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK)
    _say(json.dumps({"child_exit": code, "nonblocking": nonblocking}))
    for _ in range(2):
        assert commands.next() == "recv"
        frame = sub.recv(BOUND)  # frame 0: queued before the fork, not read by the child
        sub.release(frame)
        _say(json.dumps({"seq": frame.seq}))
    assert commands.next() == "closed"
    try:
        sub.core.recv(BOUND)
    except EndOfStream as exc:
        _say(json.dumps({"end": str(exc), "clean": exc.clean}))
    sub.close()


# -- the test: the publisher's side ----------------------------------------------------------


@pytest.fixture
def subscriber_process(tmp_path: Any) -> Iterator[Any]:
    """Start the subscriber's process for a mode; killed at the end if still running."""
    procs: list[subprocess.Popen[bytes]] = []
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def start(mode: str, address: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", os.path.abspath(__file__), mode, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=repo),
            cwd=repo,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=BOUND)


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
        out = _Lines(proc.stdout.fileno())
        try:
            assert out.next() == "subscribed"
            prod.wait_subscribers(1, timeout=BOUND)
            assert prod.publish_next(timeout=BOUND) == 0
            _tell(proc, "published")

            report = json.loads(out.next())
            assert report == {"child_exit": 0, "nonblocking": False}
            # the child has ended: whatever it sent is in the socket, read by this poll
            assert prod.core.poll(0.0) == 0
            assert left == [], prod.core.last_leave_reason
            assert len(prod.core.subscribers) == 1

            _tell(proc, "recv")
            assert json.loads(out.next()) == {"seq": 0}  # the frame queued before the fork
            assert prod.core.poll(BOUND) == 1  # its RELEASE
            assert prod.publish_next(timeout=BOUND) == 1
            _tell(proc, "recv")
            assert json.loads(out.next()) == {"seq": 1}
            assert prod.core.poll(BOUND) == 1
            assert left == []

            prod.core.close()
            _tell(proc, "closed")
            assert json.loads(out.next()) == {"end": "the publisher said BYE", "clean": True}
            _, err = proc.communicate(timeout=BOUND)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate(timeout=BOUND)
            print(err.decode(errors="replace"), file=sys.stderr)
            raise
        assert proc.returncode == 0, err.decode(errors="replace")
        assert err == b"", err.decode(errors="replace")
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
