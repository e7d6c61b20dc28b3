"""What the fork tests share: a forked child that lets go of an inherited channel core, and
the line protocol between pytest and the process that holds that core.

``test_publisher_fork_cpu`` and ``test_subscriber_fork_cpu`` run the core in a process
of its own (the test file run as a script); it forks, the child lets go of its copy as the
mode says, and the two processes talk over the script's stdin and stdout, each line read
within a bound.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

#: Seconds any one step may take (a bound, not a pause: every wait ends at its event).
BOUND = 20.0
#: How a forked child lets go of its copy (closed at the fork already): deletes and
#: collects it (then ``os._exit``), leaves by ``sys.exit`` holding it, the same as a
#: multiprocessing ``fork`` worker, or calls its ``close()`` again.
MODES = ["drop", "exit", "mp-drop", "close"]


class Lines:
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


def say(*words: object) -> None:
    """One line to the test (stdout), flushed."""
    print(*words, flush=True)


def tell(proc: subprocess.Popen[bytes], line: str) -> None:
    """One line to the core's process (its stdin)."""
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


def wait_child(pid: int) -> int:
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


def fork_and_let_go(
    holder: Any, mode: str, drops: Callable[[Any], None], closes: Callable[[Any], None]
) -> int:
    """Fork a child that lets go of ``holder.core`` as ``mode`` says (``drops``, ``closes``:
    what the child does with ``holder`` for "drop"/"mp-drop" and "close"); its exit code.

    Called with no ``with``/``finally`` around it: a child that leaves by
    ``sys.exit`` runs nothing of the parent's on its way out but the exit's own
    finalizers.
    """
    if mode == "mp-drop":
        proc = multiprocessing.get_context("fork").Process(target=drops, args=(holder,))
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
                (drops if mode == "drop" else closes)(holder)
            except BaseException as exc:
                print(f"child: {exc!r}", file=sys.stderr, flush=True)
                os._exit(1)
            os._exit(0)
        # "exit": the interpreter's own exit, the core still held: its finalizer runs
        # there (weakref.finalize's atexit)
        assert holder.core.closed  # closed at the fork (_transport._closing)
        sys.exit(0)
    return wait_child(pid)


@contextlib.contextmanager
def script_processes(script: str) -> Iterator[Callable[[str, str], subprocess.Popen[bytes]]]:
    """``start(mode, address)``: ``script`` run as a process of its own (warnings are
    errors), its stdin and stdout the line protocol; each is killed at the end if still
    running."""
    procs: list[subprocess.Popen[bytes]] = []
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def start(mode: str, address: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", os.path.abspath(script), mode, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=repo),
            cwd=repo,
        )
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=BOUND)


@contextlib.contextmanager
def ends_clean(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """The block talks to ``proc``; then ``proc`` must end by itself with exit code 0 and
    nothing on stderr.  A failure in the block kills it and prints its stderr."""
    try:
        yield
        _, err = proc.communicate(timeout=BOUND)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=BOUND)
        print(err.decode(errors="replace"), file=sys.stderr)
        raise
    assert proc.returncode == 0, err.decode(errors="replace")
    assert err == b"", err.decode(errors="replace")
