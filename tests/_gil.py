"""Whether a call lets other Python threads run (releases the GIL) while it blocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def counts_during(*calls: Callable[[], Any]) -> list[int]:
    """Run each call in turn while another thread counts; how far it counted during each."""
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    out = []
    try:
        while counted[0] == 0:
            pass
        for call in calls:
            before = counted[0]
            call()
            out.append(counted[0] - before)
    finally:
        stop.set()
        thread.join()
    return out


def assert_gil_released(call: Callable[[], Any]) -> None:
    """``call`` blocks for well over 30 ms: the counting thread must run ~freely meanwhile.

    The reference is what it counts while this thread sleeps 30 ms (GIL
    released).  Were the GIL held during ``call``, the thread would run for at
    most a switch interval or two (5 ms each).
    """
    reference, during = counts_during(lambda: time.sleep(0.03), call)
    assert during > 3 * reference, (during, reference)
