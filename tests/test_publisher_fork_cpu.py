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
import multiprocessing
import os
import select
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer, MemfdProducer

from cupy_ipcpool._errors import EndOfStream, PoolClosedError
from cupy_ipcpool.channel._protocol import Frame

#: Seconds any one step may take (a bound, not a pause: every wait ends at its event).
BOUND = 20.0
MODES = ["drop", "exit", "mp-drop", "close"]


class _Lines:
    """Lines read from ``fd``, each within a bound (``select``, then ``os.read``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def next(self, timeout: float = BOUND) -> str:
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no line within {timeout} s (so far {self.buf!r})")
            data = os.read(self.fd, 65536)
            if not data:
                raise EOFError(f"the other end closed (so far {self.buf!r})")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


# -- the publisher's process (this file run as a script) ------------------------------------


def _say(*words: object) -> None:
    print(*words, flush=True)


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


def _child_closes(prod: MemfdProducer) -> None:
    """In the forked child: ``close()`` the inherited publisher (as the GPU layer's
    finalizers do there); it is closed here (later calls raise :class:`PoolClosedError`)
    and answers False (the subscribers are the parent's, connected)."""
    core = prod.core
    slot_fds = _slot_fds()  # prod.slots (its fds, its mmaps' dups) and the accept side's
    if core.close() is not False:
        raise AssertionError("close() in the child did not answer False")
    if _slot_fds() != slot_fds - core.num_slots:  # the accept side's copies closed at once
        raise AssertionError(f"slot fds open: {slot_fds} before close(), {_slot_fds()} after")
    if not core.closed:
        raise AssertionError("the publisher is not closed in the child")
    for call in (lambda: core.poll(0.0), lambda: core.acquire(0.0)):
        try:
            call()
        except PoolClosedError:
            pass
        else:
            raise AssertionError("a call after close() did not raise PoolClosedError")
    if core.close() is not True:  # idempotent, as in the process that made it
        raise AssertionError("a second close() did not answer True")


def _mp_target(prod: MemfdProducer) -> None:
    _child_drops(prod)


def _wait_child(pid: int) -> int:
    """The exit code of child ``pid``, waited for within a bound."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], BOUND)
    finally:
        os.close(pidfd)
    if not ready:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise TimeoutError(f"the forked child {pid} did not end within {BOUND} s")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _fork_and_let_go(prod: MemfdProducer, mode: str) -> int:
    """Fork a child that lets go of the publisher as ``mode`` says; its exit code.

    Called with no ``with``/``finally`` around it: a child that leaves by
    ``sys.exit`` runs nothing of the parent's on its way out but the exit's own
    finalizers.
    """
    if mode == "mp-drop":
        proc = multiprocessing.get_context("fork").Process(target=_mp_target, args=(prod,))
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
                (_child_drops if mode == "drop" else _child_closes)(prod)
            except BaseException as exc:
                print(f"child: {exc!r}", file=sys.stderr, flush=True)
                os._exit(1)
            os._exit(0)
        # "exit": the interpreter's own exit, the publisher still held: its finalizer runs
        # there (weakref.finalize's atexit)
        assert prod.core._finalizer.atexit and prod.core._finalizer.alive
        sys.exit(0)
    return _wait_child(pid)


def _publisher_main(mode: str, address: str) -> None:
    commands = _Lines(sys.stdin.fileno())
    prod = MemfdProducer(address, 4)
    _say("listening")
    prod.wait_subscribers(1, timeout=BOUND)
    prod.publish_next(timeout=BOUND)
    _say("published")
    assert commands.next() == "released"  # its RELEASE waits, unread, in our socket
    code = _fork_and_let_go(prod, mode)
    core = prod.core
    report: dict[str, Any] = {"child_exit": code, "file_after_child": os.path.exists(address)}
    report["returned"] = core.poll(0.0)  # frame 0's RELEASE, read here
    report["subscribers"] = len(core.subscribers)
    report["seq"] = prod.publish_next(timeout=BOUND)
    _say(json.dumps(report))
    assert commands.next() == "close"
    del core
    prod.close()
    _say(json.dumps({"file_after_close": os.path.exists(address)}))


# -- the test: the subscriber's side ---------------------------------------------------------


@pytest.fixture
def publisher_process(tmp_path: Any) -> Iterator[Any]:
    """Start the publisher's process for a mode; killed at the end if still running."""
    procs: list[subprocess.Popen[bytes]] = []
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def start(mode: str) -> tuple[subprocess.Popen[bytes], str]:
        address = str(tmp_path / "pub.sock")
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", os.path.abspath(__file__), mode, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=repo),
            cwd=repo,
        )
        procs.append(proc)
        return proc, address

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=BOUND)


def _tell(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


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
    out = _Lines(proc.stdout.fileno())
    try:
        assert out.next() == "listening"
        sub = MemfdConsumer(address, timeout=BOUND)
        try:
            assert out.next() == "published"
            first = sub.recv(BOUND)
            assert first.seq == 0
            sub.release(first)
            _tell(proc, "released")

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

            _tell(proc, "close")
            assert json.loads(out.next()) == {"file_after_close": False}
            with pytest.raises(EndOfStream, match="BYE"):
                sub.core.recv(BOUND)
            assert not os.path.exists(address)
        finally:
            sub.core.close()
        _, err = proc.communicate(timeout=BOUND)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=BOUND)
        print(err.decode(errors="replace"), file=sys.stderr)
        raise
    assert proc.returncode == 0, err.decode(errors="replace")
    assert err == b"", err.decode(errors="replace")


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
