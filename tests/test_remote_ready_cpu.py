"""The device receive ring's ready watcher (remote/_memory.py), on the CPU.

A released device slot is granted to the server again only once the
reader's GPU work on it has run; the watcher thread waits for each such
event on the host and wakes the session.  Its GPU use is one
``event.synchronize()``; here the events are host stand-ins that complete
when the test says, so that the order and the wake-ups are checked for real.
The GPU tier (tests/test_remote_gpu.py) checks the slot is not refilled early.
"""

from __future__ import annotations

import contextlib
import threading

from cupy_ipcpool.remote._memory import _ReadyWatcher


class _Event:
    """Completes when :meth:`finish` is called; ``fail`` makes synchronize raise."""

    def __init__(self, fail: bool = False) -> None:
        self._done = threading.Event()
        self.fail = fail

    def finish(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        assert self._done.wait(10)
        if self.fail:
            raise RuntimeError("cudaErrorLaunchFailure (stand-in)")


def _watcher() -> tuple[_ReadyWatcher, threading.Semaphore, list[str]]:
    woken = threading.Semaphore(0)
    scopes: list[str] = []

    @contextlib.contextmanager
    def scope():
        scopes.append("in")
        yield
        scopes.append("out")

    return _ReadyWatcher(woken.release, scope), woken, scopes


def test_each_event_wakes_the_session_once_it_has_completed_not_before() -> None:
    watcher, woken, scopes = _watcher()
    first, second = _Event(), _Event()
    watcher.watch(first)
    watcher.watch(second)
    assert not woken.acquire(timeout=0.2)  # nothing completed: no wake-up
    first.finish()
    assert woken.acquire(timeout=10)
    assert not woken.acquire(timeout=0.2)  # the second has not completed
    second.finish()
    assert woken.acquire(timeout=10)
    watcher.close()
    watcher._thread.join(10)
    assert not watcher._thread.is_alive()
    assert scopes == ["in", "out"]  # the device was made current once, for the thread


def test_a_failed_event_still_wakes_the_session_which_then_sees_the_error() -> None:
    """The error is not swallowed: the session's ready() queries the event and raises."""
    watcher, woken, _ = _watcher()
    bad = _Event(fail=True)
    watcher.watch(bad)
    bad.finish()
    assert woken.acquire(timeout=10)
    later = _Event()
    watcher.watch(later)  # the thread goes on after a failure
    later.finish()
    assert woken.acquire(timeout=10)
    watcher.close()
    watcher._thread.join(10)
    assert not watcher._thread.is_alive()


def test_close_does_not_wait_for_an_event_that_never_completes() -> None:
    watcher, woken, _ = _watcher()
    hung = _Event()
    watcher.watch(hung)
    watcher.close()  # returns at once
    assert watcher._thread.is_alive()
    hung.finish()  # once the stream moves on, the thread ends
    watcher._thread.join(10)
    assert not watcher._thread.is_alive()
    assert woken.acquire(timeout=1)
