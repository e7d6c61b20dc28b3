"""SIGSTOP that has taken effect (standard library only).

``kill(pid, SIGSTOP)`` returns once the signal is queued, not once the process has
stopped: each of its threads stops when it next runs kernel code, which on a loaded
machine (or under gVisor) can be long enough for it to take a frame or answer a
message sent after the ``kill``. A test whose premise is "what is sent from now on
finds it stopped" stops it with :func:`sigstop`.
"""

from __future__ import annotations

import os
import signal
import time


def _state(stat_path: str) -> str:
    """The one-letter state in a ``/proc/.../stat`` file (``T`` or ``t``: stopped)."""
    with open(stat_path) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped."""
    tasks = f"/proc/{pid}/task"
    try:
        return all(_state(f"{tasks}/{tid}/stat") in ("T", "t") for tid in os.listdir(tasks))
    except FileNotFoundError:  # a thread that ended while we looked: look again
        return False


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """Stop process ``pid`` and return once every thread of it has stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not stopped(pid):
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout} s"
        time.sleep(0.001)
