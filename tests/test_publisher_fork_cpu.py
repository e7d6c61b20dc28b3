"""A child forked from a publisher's process leaves the parent's channel alone.

A process that holds a live :class:`PublisherCore` and forks (``os.fork``,
multiprocessing's ``fork`` start method) gives the child a copy of the
publisher, with copies of the subscribers' sockets.  When the child drops its
copy (garbage collection), exits (``weakref.finalize`` runs at exit) or calls
its ``close()`` (as the GPU layer's finalizers do there), the publisher must not
say BYE to the parent's subscribers, read their messages, or remove the
parent's socket file: the subscriber goes on receiving
the parent's frames, its RELEASEs reach the parent, and the parent's own
``close()`` still says BYE and removes the file.

The publisher runs in a process of its own (this file run as a script, below),
the subscriber here: the child inherits the publisher and nothing else (a
subscriber of the same process would be inherited too).  The two talk over
the script's stdin and stdout, each read with a bound.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from _fork import BOUND, MODES, Lines, ends_clean, fork_and_let_go, say, script_processes, tell
from _memfd_backend import MemfdConsumer, MemfdProducer

from cupy_ipcpool._errors import EndOfStream, PoolClosedError
from cupy_ipcpool.channel._protocol import Frame

# -- the publisher's process (this file run as a script) ------------------------------------


def _child_drops(prod: MemfdProducer) -> None:
    """In the forked child: drop the inherited publisher and collect it, as a worker that
    lets go of what it inherited would; exit 0 only if its finalizer did run here."""
    finalizer = prod.core._finalizer
    del prod.core
    gc.collect()
    if finalizer.alive:
        raise AssertionError("the publisher was not collected in the child")


def _slot_fds() -> int:
    """How many of this process's fds are memfds of the slots."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:ipcpool-slot")
    return count


#: The slot memfds open in the publisher's process when it forked.
_SLOT_FDS_AT_FORK = [0]


def _child_closes(prod: MemfdProducer) -> None:
    """In the forked child: the inherited publisher was closed at the fork, its copies of the
    accept side's fds (the WELCOME's slot memfds among them) too; its calls raise
    :class:`PoolClosedError` saying why; ``close()`` again (as the GPU layer's finalizers
    do there) answers True, closed already."""
    core = prod.core
    if not core.closed:
        raise AssertionError("the publisher was not closed at the fork")
    before = _SLOT_FDS_AT_FORK[0]  # prod.slots' (its fds, its mmaps' dups), the accept side's
    if _slot_fds() != before - core.num_slots:
        raise AssertionError(f"slot fds open: {before} before the fork, {_slot_fds()} after")
    for call in (lambda: core.poll(0.0), lambda: core.acquire(0.0)):
        try:
            call()
        except PoolClosedError as exc:
            if "fork" not in str(exc):
                raise AssertionError(f"the error does not say why: {exc}") from None
        else:
            raise AssertionError("a call after the fork did not raise PoolClosedError")
    if core.close() is not True:  # closed already
        raise AssertionError("close() did not answer True")


def _publisher_main(mode: str, address: str) -> None:
    commands = Lines(sys.stdin.fileno())
    prod = MemfdProducer(address, 4)
    say("listening")
    prod.wait_subscribers(1, timeout=BOUND)
    prod.publish_next(timeout=BOUND)
    say("published")
    assert commands.next() == "released"  # its RELEASE waits, unread, in our socket
    _SLOT_FDS_AT_FORK[0] = _slot_fds()
    code = fork_and_let_go(prod, mode, _child_drops, _child_closes)
    core = prod.core
    report: dict[str, Any] = {"child_exit": code, "file_after_child": os.path.exists(address)}
    report["returned"] = core.poll(0.0)  # frame 0's RELEASE, read here
    report["subscribers"] = len(core.subscribers)
    report["seq"] = prod.publish_next(timeout=BOUND)
    say(json.dumps(report))
    assert commands.next() == "close"
    del core
    prod.close()
    say(json.dumps({"file_after_close": os.path.exists(address)}))


# -- the test: the subscriber's side ---------------------------------------------------------


@pytest.fixture
def publisher_process(tmp_path: Any) -> Iterator[Any]:
    """Start the publisher's process for a mode; killed at the end if still running."""
    with script_processes(__file__) as start_script:

        def start(mode: str) -> tuple[subprocess.Popen[bytes], str]:
            address = str(tmp_path / "pub.sock")
            return start_script(mode, address), address

        yield start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_a_forked_child_letting_go_of_the_publisher_leaves_the_parent_serving(
    publisher_process: Any, mode: str
) -> None:
    """``drop``: the child deletes its copy and collects it (then ``os._exit``);
    ``exit``: the child leaves by ``sys.exit`` with the copy held (its finalizer runs at
    exit); ``mp-drop``: a multiprocessing ``fork`` worker drops it; ``close``: the child
    calls ``close()`` (closed there, answering False).  Afterwards the
    subscriber got no BYE and receives the parent's next frame, the RELEASE it had sent
    before the fork reached the parent (not read by the child), the socket file is there
    and takes a new subscriber; and the parent's ``close()`` says BYE and removes it."""
    proc, address = publisher_process(mode)
    assert proc.stdout is not None
    out = Lines(proc.stdout.fileno())
    with ends_clean(proc):
        assert out.next() == "listening"
        sub = MemfdConsumer(address, timeout=BOUND)
        try:
            assert out.next() == "published"
            first = sub.recv(BOUND)
            assert first.seq == 0
            sub.release(first)
            tell(proc, "released")

            report = json.loads(out.next())
            assert report["child_exit"] == 0
            assert report["file_after_child"] is True
            assert report["returned"] == 1  # frame 0's RELEASE reached the parent
            assert report["subscribers"] == 1
            assert os.path.exists(address)
            frame = sub.recv(BOUND)  # no BYE, no EndOfStream: the parent's next frame
            assert isinstance(frame, Frame) and frame.seq == report["seq"] == 1
            sub.release(frame)
            late = MemfdConsumer(address, timeout=BOUND)  # the listener is the parent's still
            late.core.close()

            tell(proc, "close")
            assert json.loads(out.next()) == {"file_after_close": False}
            with pytest.raises(EndOfStream, match="BYE"):
                sub.core.recv(BOUND)
            assert not os.path.exists(address)
        finally:
            sub.core.close()


def test_the_finalizer_still_tears_down_in_the_process_that_made_the_publisher(
    tmp_path: Any,
) -> None:
    """Dropped without ``close()`` where it was made, the publisher still says BYE and
    removes its socket file (the fork guard is no guard against its own process)."""
    address = str(tmp_path / "pub.sock")
    prod = MemfdProducer(address, 4)
    try:
        sub = MemfdConsumer(address, timeout=BOUND)
        try:
            prod.wait_subscribers(1, timeout=BOUND)
            ref = weakref.ref(prod.core)
            del prod.core
            gc.collect()
            assert ref() is None
            with pytest.raises(EndOfStream, match="BYE"):
                sub.core.recv(BOUND)
            assert not os.path.exists(address)
        finally:
            sub.core.close()
    finally:
        prod.slots.close()


if __name__ == "__main__":
    _publisher_main(sys.argv[1], sys.argv[2])
